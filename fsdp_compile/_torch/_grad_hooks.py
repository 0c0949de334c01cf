"""Post-accumulate-grad hooks that a model registers in its forward on a parameter FSDP gathers.

transformers' ``ReplicatedWithGradAllReduce`` (Qwen3's ``q_norm`` / ``k_norm`` under its own TP plan) calls
``param.register_post_accumulate_grad_hook(hook)`` in the module's first forward with grad enabled; ``hook(param)``
all-reduces ``param.grad`` over tp in place. Eagerly ``param`` is FSDP2's unsharded parameter, a leaf: the hook
runs once its gradient is complete, before FSDP2's post-backward reduce-scatter reads it. In our trace it is the
gathered tensor, an intermediate, which Dynamo 2.13 treats as ``register_hook``: it traces the hook body at
once, on the tensor itself, whose ``.grad`` is None ("_c10d_functional.all_reduce: ... must be Tensor, not
NoneType"). While our step is traced, such a call (on a tensor with no source: every gathered parameter) puts
``_hook_gradient`` in the graph instead, which AOTAutograd runs when it traces the joint graph: it registers a
gradient hook on that tensor that hands the hook a stand-in whose ``.grad`` is (a copy of) the gradient and
returns the ``.grad`` the hook leaves, its ``dist.all_reduce`` traced as the functional all-reduce. So the hook
runs in the backward graph on the complete gradient (every use summed), just before the unit's reduce-scatter,
as eagerly. Not Dynamo's own ``register_hook`` path: its speculation of the hook body, restoring Dynamo's side
effects after it, lost attribute writes made later in the trace (Qwen3 with its KV cache on: "'DynamicLayer'
object has no attribute 'device'"). A tensor with a source (a parameter FSDP does not manage) keeps Dynamo's
handling.

Checked on 2.13.0 and 2.14.1. Delete when Dynamo traces a post-accumulate-grad hook on an intermediate as a gradient hook.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from fsdp_compile._quote import quoted
from fsdp_compile._torch import patched, wrapped

_NAME = "register_post_accumulate_grad_hook"
_HOOKS: list = []  # the hooks _hook_gradient runs, by index: the same on every rank (a constant of the graph)


class HookRefused(NotImplementedError):
    """A post-accumulate-grad hook registered in forward that cannot run on a gradient in the backward graph."""


class _GradBox:
    """The parameter a post-accumulate-grad hook is handed in the backward graph: its ``.grad`` alone."""

    def __init__(self, grad):
        self.grad = grad


_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.MAX: "max", dist.ReduceOp.MIN: "min",
        dist.ReduceOp.PRODUCT: "product"}


def _traced_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    """``dist.all_reduce`` in a hook traced into the backward graph: the functional all-reduce, in place."""
    from torch.distributed._functional_collectives import all_reduce_inplace

    if async_op or op not in _OPS:
        raise ValueError(f"dist.all_reduce(op={op}, async_op={async_op}): only a synchronous sum, avg, max, min or "
                         "product is traced")
    all_reduce_inplace(tensor, _OPS[op], group)


def _hook_gradient(tensor: torch.Tensor, index: int) -> torch.Tensor:
    """Run by AOTAutograd's trace: ``_HOOKS[index]`` on ``tensor``'s complete gradient, as a gradient hook."""
    hook = _HOOKS[index]

    def run(grad):
        # a copy: the hook writes .grad in place, and a hook's input is the autograd engine's, not ours to write
        box = _GradBox(grad.clone())
        saved = dist.all_reduce
        dist.all_reduce = _traced_all_reduce
        try:
            hook(box)
        except Exception as e:  # any body that does not trace on a gradient: named, not torch's words alone
            name = f"{getattr(hook, '__module__', '?')}.{getattr(hook, '__qualname__', repr(hook))}"
            raise HookRefused(
                f"fsdp_compile: the post-accumulate-grad hook {name}, registered on an FSDP parameter in forward, "
                f"cannot run on that parameter's gradient in the backward graph ({quoted(e)}): make it read and "
                "write param.grad alone (tensor ops and synchronous dist.all_reduce), or register it on the sharded "
                "parameter before fsdp_compile.compile, or train this model with eager FSDP2") from e
        finally:
            dist.all_reduce = saved
        return box.grad

    tensor.register_hook(run)
    return tensor


torch.fx.node._side_effectful_functions.add(_hook_gradient)  # kept where nothing reads its result


def _refuse(hook, tx, why: str):
    fn = getattr(hook, "fn", None)
    name = f"{fn.__module__}.{fn.__qualname__}" if fn is not None else type(hook).__name__
    where = tx.frame_summary()
    return HookRefused(
        f"fsdp_compile: the post-accumulate-grad hook {name}, registered on an FSDP parameter in forward "
        f"({where.filename}:{where.lineno}), cannot run on that parameter's gradient in the backward graph ({why}): "
        "make the hook a function defined outside forward that reads param.grad alone (tensor ops and "
        "dist.all_reduce), or register it on the sharded parameter before fsdp_compile.compile, or train this "
        "model with eager FSDP2")


@contextlib.contextmanager
def traced_as_grad_hooks():
    """While our step is traced: post-accumulate-grad hooks on gathered parameters run on their gradients. A
    hook that cannot is refused with ``HookRefused``, not Dynamo's wrapper of it."""
    from torch._dynamo import variables
    from torch._dynamo.exc import TorchDynamoException
    from torch._dynamo.variables.tensor import TensorVariable

    original = TensorVariable.method_register_post_accumulate_grad_hook

    def register(self, tx, *args, **kwargs):
        if self.source is not None or len(args) != 1 or kwargs:
            if entry is not None:
                return entry.handler(self, tx, *args, **kwargs)
            return original(self, tx, *args, **kwargs)
        try:
            fn = args[0].as_python_constant()
        except Exception as e:  # a closure made inside the traced forward: no object to call from the backward
            raise _refuse(args[0], tx, f"not a function object outside the trace: {type(e).__name__}") from e
        if not callable(fn):
            raise _refuse(args[0], tx, "not callable")
        if fn not in _HOOKS:
            _HOOKS.append(fn)
        proxy = self.as_proxy()
        hooked = proxy.tracer.create_proxy("call_function", _hook_gradient, (proxy, _HOOKS.index(fn)), {})
        hooked.node.meta["example_value"] = proxy.node.meta["example_value"]
        self.proxy = hooked  # what the forward computes from it next goes through the hooked tensor
        self.synchronize_attributes(tx)
        return variables.RemovableHandleVariable(mutation_type=variables.base.ValueMutationNew())

    # torch 2.13 dispatches the method by its name on the class; 2.14 through the class's tp_methods table,
    # whose Method entries hold the handler (called as handler(variable, tx, *args, **kwargs))
    table = TensorVariable.__dict__.get("tp_methods")
    entry = None if table is None else table.get(_NAME)
    if entry is not None:
        table[_NAME] = type(entry)(register)
    try:
        with patched((TensorVariable, "method_register_post_accumulate_grad_hook", register)):
            yield
    except TorchDynamoException as e:
        cause = wrapped(e, HookRefused)
        if cause is None:
            raise
        raise HookRefused(str(cause)) from e
    finally:
        if entry is not None:
            table[_NAME] = entry
