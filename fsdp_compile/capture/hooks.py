"""FSDP2's eager forward hooks, bypassed while our compiled step runs; what ``compile`` attaches to a model.

FSDP2 registers ``FSDPState._pre_forward`` / ``_post_forward`` as module hooks, and both are
``torch._dynamo.disable``d: Dynamo cannot trace them (``fullgraph=True`` fails with "Attempted to call
function marked as skipped"). We replace each of those two hook entries, in place and under the same
hook id, by a dispatcher:

* outside our compiled step it calls FSDP2's hook unchanged, so eager use of the model (evaluation,
  debugging, plain ``torch.compile``) keeps FSDP2's exact behaviour;
* inside it (``STEP.active``, which Dynamo guards on) it does only the traceable part of FSDP2's hook: the
  ``MixedPrecisionPolicy`` casts (``cast_forward_inputs`` before, ``output_dtype`` after).

The parameters come from ``forward.traced_forward`` instead. ``attach`` installs the dispatchers, the
repeated blocks' regions (``regions.py``) and the model's logger stand-ins, once per model.

``torch.distributed._composable.checkpoint(block)`` runs its recompute from two forward hooks that Dynamo
cannot trace (``_checkpoint_without_reentrant_generator`` is skipped). Inside our step its hooks are
dispatched to nothing and the block's forward runs under ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)`` with the keyword arguments it was given: the recompute ``checkpoint_wrapper`` does
(``install_checkpoints``); outside, its hooks run unchanged.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from fsdp_compile import _fsdp2
from fsdp_compile._torch._dynamo_logging import install_logging
from fsdp_compile.capture.regions import found_inline, install_regions
from fsdp_compile.capture.step import STEP
from fsdp_compile.plan import ShardingPlan, fsdp_states


def _make_pre_hook(state, fsdp_hook):
    policy = _fsdp2.mp_policy(state)
    cast = _fsdp2.floating_cast(policy.param_dtype) if policy.cast_forward_inputs and policy.param_dtype else None

    def fsdp_compile_pre_forward(module, args, kwargs):
        if not STEP.active:
            return fsdp_hook(module, args, kwargs)
        if cast is None:
            return args, kwargs
        return cast(args), cast(kwargs)

    fsdp_compile_pre_forward.fsdp_hook = fsdp_hook
    return fsdp_compile_pre_forward


def _make_post_hook(state, fsdp_hook):
    output_dtype = _fsdp2.mp_policy(state).output_dtype
    cast = _fsdp2.floating_cast(output_dtype) if output_dtype is not None else None

    def fsdp_compile_post_forward(module, input, output):
        if not STEP.active:
            return fsdp_hook(module, input, output)
        return output if cast is None else cast(output)

    fsdp_compile_post_forward.fsdp_hook = fsdp_hook
    return fsdp_compile_post_forward


def _dispatch_in_step(hook, inside):
    """A hook that calls ``hook`` outside our compiled step and ``inside`` within it (``fsdp_hook``: ``hook``)."""
    def fsdp_compile_hook(*args):
        return inside(*args) if STEP.active else hook(*args)

    fsdp_compile_hook.fsdp_hook = hook
    return fsdp_compile_hook


def install_checkpoint_hooks(model: nn.Module) -> list:
    """Every ``torch.distributed._composable.checkpoint``'s hooks dispatched to nothing inside our step (see
    the module docstring), before the regions (a block with hooks of its own is not made one); returns
    ``(hook dict, hook id, dispatcher)`` per swap, as ``install_hooks`` does."""
    swapped = []
    for _, module in model.named_modules():
        if _fsdp2.composable_checkpoint(module):
            for held, hook_id in _fsdp2.composable_checkpoint_hooks(module)[1]:
                if not hasattr(held[hook_id], "fsdp_hook"):
                    held[hook_id] = _dispatch_in_step(held[hook_id], lambda *args: None)
                    swapped.append((held, hook_id, held[hook_id]))
    return swapped


def install_checkpoint_forwards(model: nn.Module) -> list:
    """Inside our step, every ``torch.distributed._composable.checkpoint``'d module's forward runs under
    ``torch.utils.checkpoint.checkpoint`` with its keyword arguments; returns ``(module, its previous instance
    forward or None, ours)`` per module, as ``install_regions`` does. After the regions: a repeated block's
    checkpoint wraps its region call (``passes/regions.py`` inlines it where that would differ)."""
    forwards = []
    for _, module in model.named_modules():
        if not _fsdp2.composable_checkpoint(module):
            continue
        kwargs = _fsdp2.composable_checkpoint_hooks(module)[0]
        inner = module.forward  # its class's, or its region's (installed first)

        def forward(*args, _inner=inner, _ckpt=kwargs, **kw):
            if not STEP.active:
                return _inner(*args, **kw)
            return torch.utils.checkpoint.checkpoint(_inner, *args, use_reentrant=False, **_ckpt, **kw)

        forwards.append((module, module.__dict__.get("forward"), forward))
        module.forward = forward
    return forwards


def _wraps(hook, fn) -> bool:
    """``hook`` is ``fn``, or wraps it: a group's hooks are ``functools.wraps`` wrappers of the state's
    (``_register_group_forward_hooks``), themselves wrapped by ``torch._dynamo.disable``."""
    for _ in range(8):
        if hook is None:
            return False
        if hook == fn:
            return True
        hook = getattr(hook, "__wrapped__", None)
    return False


def install_hooks(model: nn.Module) -> list[tuple[dict, int, object]]:
    """Swap FSDP2's forward hooks for dispatchers, in place, under the same hook ids (eager behaviour is
    unchanged). A group of several modules (``fully_shard([m1, m2])``) has FSDP2's hooks, wrapped, on each
    of them. Returns ``(hook dict, hook id, dispatcher)`` per swap, for ``Attachment.detach``."""
    swapped = []
    for fqn, _, state in fsdp_states(model):
        pre, post = _fsdp2.forward_hooks(state)
        for module in _fsdp2.modules(state):
            for hooks, fsdp_fn, make in (
                (module._forward_pre_hooks, pre, _make_pre_hook),
                (module._forward_hooks, post, _make_post_hook),
            ):
                found = False
                for hook_id, hook in list(hooks.items()):
                    if _wraps(hook, fsdp_fn) and not hasattr(hook, "fsdp_hook"):
                        hooks[hook_id] = make(state, hook)
                        swapped.append((hooks, hook_id, hooks[hook_id]))
                        found = True
                if not found:
                    raise RuntimeError(f"FSDP2's forward hooks on {fqn or '<root>'!r} are missing; was a hook removed?")
    return swapped


class Attachment:
    """What ``compile`` and ``explain`` install on a model: FSDP2's forward hooks swapped for dispatchers
    (``install_hooks``), repeated blocks' forwards routed to regions (``install_regions``), and the model's
    logger stand-ins (``install_logging``, swapped in only during a compiled call). Installed once per model
    and shared by everything attached to it; ``detach`` puts the model back as it was when the last user
    detaches."""

    def __init__(self, model: nn.Module, installed: _Installed):
        self.model, self._installed, self.attached = model, installed, True

    @property
    def repeated(self) -> list[list[str]]:
        return self._installed.repeated

    @property
    def loggers(self) -> list[tuple[object, object]]:
        return self._installed.loggers

    @property
    def deferred(self) -> dict[str, int]:
        """``install_regions``' deferred parameters: fqn -> key."""
        return self._installed.deferred

    def inline(self) -> dict[int, str]:
        """Why each kind of repeated block that runs inline does (index -> why): as ``install_regions`` found its
        blocks at compile, or as a compiled step found its region since (``found_inline``)."""
        out = dict(self._installed.inline)
        for i, fqns in enumerate(self.repeated):
            if i not in out and (why := found_inline(self.model, fqns)):
                out[i] = why
        return out

    def detach(self) -> None:
        if not self.attached:
            return
        self.attached = False
        installed = self._installed
        installed.users -= 1
        if installed.users:
            return
        del _INSTALLED[self.model]
        for hooks, hook_id, dispatcher in installed.hooks:
            if hooks.get(hook_id) is dispatcher:
                hooks[hook_id] = dispatcher.fsdp_hook
        for block, previous, ours in reversed(installed.forwards):  # a checkpoint's forward wraps a region's
            if block.__dict__.get("forward") is ours:
                if previous is None:
                    del block.forward
                else:
                    block.forward = previous


class _Installed:
    def __init__(self, hooks, repeated, forwards, loggers, deferred, inline):
        self.hooks, self.repeated, self.forwards, self.loggers, self.users = hooks, repeated, forwards, loggers, 0
        self.deferred, self.inline = deferred, inline


_INSTALLED: "weakref.WeakKeyDictionary[nn.Module, _Installed]" = weakref.WeakKeyDictionary()


def attach(model: nn.Module, plan: ShardingPlan) -> Attachment:
    """Install (once per model) what the compiled step needs on ``model``; see ``Attachment``."""
    installed = _INSTALLED.get(model)
    if installed is None:
        hooks = install_hooks(model) + install_checkpoint_hooks(model)
        repeated, forwards, deferred, inline = install_regions(model, plan)
        forwards += install_checkpoint_forwards(model)
        installed = _INSTALLED[model] = _Installed(hooks, repeated, forwards, install_logging(model), deferred, inline)
    installed.users += 1
    return Attachment(model, installed)
