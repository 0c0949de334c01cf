"""Post-accumulate-grad hooks that a model registers in its forward on a parameter FSDP gathers.

transformers' ``ReplicatedWithGradAllReduce`` (Qwen3's ``q_norm`` / ``k_norm`` under its own TP plan) calls
``param.register_post_accumulate_grad_hook(hook)`` in the module's first forward with grad enabled; ``hook(param)``
all-reduces ``param.grad`` over tp in place. Eagerly ``param`` is FSDP2's unsharded parameter, a leaf: the hook
runs once its gradient is complete, before FSDP2's post-backward reduce-scatter reads it. In our trace it is the
gathered tensor, an intermediate, which Dynamo 2.13 treats as ``register_hook``: it traces the hook body at
once, on the tensor itself, whose ``.grad`` is None ("_c10d_functional.all_reduce: ... must be Tensor, not
NoneType"). While our step is traced, such a call (on a tensor with no source: every gathered parameter) is
registered instead as a gradient hook of that tensor that hands the hook a stand-in whose ``.grad`` is the
gradient and returns the ``.grad`` it leaves: it runs in the backward graph on the complete gradient (every use
summed), just before the unit's reduce-scatter, as eagerly; Dynamo traces the body's in-place ``dist.all_reduce``
as a functional one. A tensor with a source (a parameter FSDP does not manage) keeps Dynamo's handling.

Checked on 2.13.0. Delete when Dynamo traces a post-accumulate-grad hook on an intermediate as a gradient hook.
"""

from __future__ import annotations

import contextlib


class _GradBox:
    """The parameter a post-accumulate-grad hook is handed in the backward graph: its ``.grad`` alone."""

    def __init__(self, grad):
        self.grad = grad


def _as_grad_hook(hook, grad):
    # a copy: the hook mutates .grad in place, and a hook's input is the autograd engine's, not ours to write
    box = _GradBox(grad.clone())
    hook(box)
    return box.grad


class HookRefused(NotImplementedError):
    """A post-accumulate-grad hook registered in forward whose body Dynamo cannot trace on a gradient."""


@contextlib.contextmanager
def traced_as_grad_hooks():
    """While our step is traced: post-accumulate-grad hooks on gathered parameters run on their gradients. A
    hook that cannot is refused with ``HookRefused``, not Dynamo's wrapper of it."""
    from torch._dynamo import variables
    from torch._dynamo.exc import TorchDynamoException, Unsupported
    from torch._dynamo.variables.tensor import TensorVariable

    original = TensorVariable.method_register_post_accumulate_grad_hook

    def register(self, tx, *args, **kwargs):
        if self.source is not None or len(args) != 1 or kwargs:
            return original(self, tx, *args, **kwargs)
        hook = args[0]
        adapter = variables.FunctoolsPartialVariable(variables.UserFunctionVariable(_as_grad_hook), [hook], {})
        try:
            return self._method_register_hook(tx, "register_hook", adapter)
        except Unsupported as e:
            fn = getattr(hook, "fn", None)
            name = f"{fn.__module__}.{fn.__qualname__}" if fn is not None else repr(hook)
            where = tx.frame_summary()
            raise HookRefused(
                f"fsdp_compile: the post-accumulate-grad hook {name}, registered on an FSDP parameter in forward "
                f"({where.filename}:{where.lineno}), cannot be traced on that parameter's gradient "
                f"({getattr(e, 'gb_type', None) or str(e).splitlines()[0]}): make the hook a function of "
                "param.grad alone (tensor ops and torch.distributed collectives), or register it on the sharded "
                "parameter before fsdp_compile.compile, or train this model with eager FSDP2") from e

    TensorVariable.method_register_post_accumulate_grad_hook = register
    try:
        yield
    except TorchDynamoException as e:
        cause = e  # Dynamo wraps what is raised in a trace, and may chain it once more
        while cause is not None and not isinstance(cause, HookRefused):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise HookRefused(str(cause)) from e
    finally:
        TensorVariable.method_register_post_accumulate_grad_hook = original
