"""Whether one region's trace may serve every block of a kind, given the hooks inside them (split from
``boundary``, which says what crosses the region's boundary).

``parallelize_module`` hooks every Linear it parallelizes (each a lambda around a
``functools.partial`` of its style's input/output function, with the layouts and the mesh). The template
block's trace runs its hooks; that trace serves the other blocks only where their hooks are provably the
same computation (``hooks_reason``): the same functions, holding equal values (the same submodule path, a
mesh of the same ranks and process groups, equal placements). Anything else is compared by identity, so a
hook not provably equal keeps the kind inline, with the reason.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn as nn

from fsdp_compile.capture.boundary import mesh_key


INLINE_HOOKS = (
    "the hooks inside {fqn!r} ({where}) are not provably the same as {first!r}'s, whose trace the region would "
    "reuse (hooks are compared by their functions and the values they hold)"
)

INLINE_OWN_FORWARD = (
    "{fqn!r} runs a forward set on it (not its class's: transformers' expert-parallel ep_forward), which a region, "
    "tracing its class's forward once for every block, would skip"
)
INLINE_OWN_HOOKS = (
    "{fqn!r} has hooks of its own besides FSDP's: they run around the region call, per block, and may change what "
    "the region's trace reads (transformers' expert-parallel hooks on an experts module do)"
)

_VALUES = (int, float, str, bool, type(None), torch.dtype, torch.device)
_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def hooks_reason(blocks: list[nn.Module], fqns: list[str]) -> str | None:
    """Why the hooks inside ``blocks`` (one kind) are not provably the template's (None: they are, or there
    are none). The block's own hooks (FSDP2's, our dispatchers, a user's) run outside the region, per block."""
    for block, fqn in zip(blocks, fqns):
        if _replaced_forward(block):  # a template region traces the class's forward
            return INLINE_OWN_FORWARD.format(fqn=fqn)
        own = [h for kind in _HOOKS for h in getattr(block, kind).values() if not _fsdp_hook(h)]
        if own:  # they run around the region call, and may change what its trace reads (transformers' EP hooks)
            return INLINE_OWN_HOOKS.format(fqn=fqn)
    first = _hook_signature(blocks[0])
    for block, fqn in zip(blocks[1:], fqns[1:]):
        mine = _hook_signature(block)
        if mine != first:
            differ = sorted({w for w, _ in set(mine) ^ set(first)} if _hashable(mine, first) else {"?"})
            return INLINE_HOOKS.format(fqn=fqn, first=fqns[0], where=", ".join(differ[:3]) or "order")
    return None


def _replaced_forward(block: nn.Module) -> bool:
    """Whether ``block.forward`` was replaced per instance (transformers' expert-parallel ``ep_forward``), seen
    through ours (``fsdp_compile_own_forward``) and a composable checkpoint's around ours (``_inner``)."""
    f = block.__dict__.get("forward")
    while f is not None:
        if hasattr(f, "fsdp_compile_own_forward"):
            f = f.fsdp_compile_own_forward
        elif (getattr(f, "__kwdefaults__", None) or {}).get("_inner") is not None:
            f = f.__kwdefaults__["_inner"]
        else:
            return getattr(f, "__func__", None) is not type(block).forward
    return False


def _fsdp_hook(hook) -> bool:
    """FSDP2's own forward hooks on a block (``fully_shard``'s, ``replicate``'s), or our dispatchers in their
    place (``capture/hooks.py``, composable checkpoint's too)."""
    owner = getattr(hook, "__self__", None) or getattr(getattr(hook, "func", None), "__self__", None)
    return hasattr(hook, "fsdp_hook") or type(owner).__module__.startswith(
        ("torch.distributed.fsdp", "torch.distributed._composable"))


def _hashable(*values) -> bool:
    try:
        hash(values)
        return True
    except TypeError:
        return False


def _hook_signature(block: nn.Module) -> tuple:
    paths = {id(m): p for p, m in nn.Module.named_modules(block)}
    out = []
    for path, sub in nn.Module.named_modules(block):
        if path == "":  # the block's own hooks run around the region call, not in its trace
            continue
        for kind in _HOOKS:
            flags = (getattr(sub, kind + "_with_kwargs", {}), getattr(sub, kind + "_always_called", {}))
            hooks = [(_described(h, paths), hid in flags[0], hid in flags[1]) for hid, h in getattr(sub, kind).items()]
            if hooks:
                out.append((f"{path}.{kind}", tuple(hooks)))
    return tuple(out)


def _described(obj, paths: dict, depth: int = 0):
    """``obj`` (a hook, or what a hook holds) as a value equal to another block's exactly where both provably
    compute the same: a submodule of the block by its path, plain values and placements by value, functions
    by their code and what they hold, a parallel style by its class and attributes, a mesh by its ranks and
    process groups; anything else by identity (the same object in every block: a global function)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle
    from torch.distributed.tensor.placement_types import Placement

    if depth > 8:
        return ("object", id(obj))
    d = functools.partial(_described, paths=paths, depth=depth + 1)
    if isinstance(obj, nn.Module):
        return ("module", paths[id(obj)]) if id(obj) in paths else ("object", id(obj))
    if isinstance(obj, _VALUES) or isinstance(obj, Placement):
        return ("value", type(obj), obj)
    if isinstance(obj, DeviceMesh):
        return mesh_key(obj)
    if type(obj) in (tuple, list):
        return (type(obj).__name__, tuple(d(o) for o in obj))
    if isinstance(obj, tuple) and hasattr(type(obj), "_fields"):  # a NamedTuple (torchao's LinearMMConfig)
        return ("namedtuple", type(obj), tuple(d(o) for o in obj))
    if type(obj) is dict and all(isinstance(k, str) for k in obj):
        return ("dict", tuple((k, d(v)) for k, v in obj.items()))
    if isinstance(obj, functools.partial):
        return ("partial", d(obj.func), d(obj.args), d(dict(obj.keywords)))
    if isinstance(obj, types.MethodType):
        return ("method", obj.__func__, d(obj.__self__))
    if isinstance(obj, types.FunctionType):
        try:
            cells = tuple(c.cell_contents for c in obj.__closure__ or ())
        except ValueError:  # an empty cell
            return ("object", id(obj))
        return ("function", obj.__code__, id(obj.__globals__), d(cells), d(obj.__defaults__), d(obj.__kwdefaults__))
    if isinstance(obj, ParallelStyle):
        return ("style", type(obj), d(dict(vars(obj))))
    return ("object", id(obj))
