"""Regions: each repeated block traced and compiled once.

A model's blocks (same class, parameter shapes, dtypes and mixed precision) run through one
``torch.compiler.nested_compile_region`` function per kind of block, which takes the block's unsharded
parameters and buffers as explicit inputs: AOTAutograd partitions and Inductor compiles the body once, and
every block calls it (``invoke_subgraph``). The collectives and copies stay in the top-level graph, where
the passes see them. Each block's own forward is what the region replaces: its FSDP hooks (our
dispatchers) and any user hooks run per block, outside.

A region traces one block and reuses the trace, so nothing that differs between blocks may be read inside
it. Blocks whose plain attributes (ints, floats, strings, ...) are all equal share a template block and a
reuse key: traced once. Blocks that differ in some attribute (HF decoder layers carry their layer_idx)
pass themselves in instead, without a key: Dynamo traces the first and reuses that trace for the others
where the guards on what it read hold, else traces them too and keeps one subgraph for identical ones
(what it would have read differently, it keeps apart). Blocks with hooks inside share a region where their
hooks are provably the template's, DTensor parameters enter as their local tensors, and parameters an all-gather
extension rebuilds as a tensor subclass as its inner tensors (``boundary``).

This installs the regions on the model, before any trace; ``passes/regions.py`` decides on the traced graphs
which region calls stay regions.
"""

from __future__ import annotations

import itertools
import types

import torch
import torch.nn as nn

from fsdp_compile._annotations import UNSHARD, annotate
from fsdp_compile._torch import _invoke_subgraph
from fsdp_compile.capture import block_hooks, boundary
from fsdp_compile.capture.boundary import INLINE_PARALLEL, INLINE_SUBCLASS
from fsdp_compile.capture.forward import _get, call_with, constants, materialized, place_table
from fsdp_compile.capture.step import STEP
from fsdp_compile.plan import ShardingPlan


_PLAIN = (int, float, str, bool, type(None))


def _plain_attributes(module: nn.Module) -> tuple:
    out = []
    for name, sub in nn.Module.named_modules(module):
        attrs = tuple(sorted((k, v) for k, v in vars(sub).items() if isinstance(v, _PLAIN)))
        out.append((name, attrs))
    return tuple(out)


def _tensor_names(block: nn.Module) -> tuple[str, ...]:
    """The block's parameters' and buffers' names, in the order its region takes them (``_make_region``)."""
    return tuple(n for n, _ in nn.Module.named_parameters(block)) + tuple(n for n, _ in nn.Module.named_buffers(block))


def find_repeated_blocks(model: nn.Module, plan: ShardingPlan) -> list[list[str]]:
    """FSDP modules that can share one region, grouped (two or more each), in forward order."""
    modules = dict(model.named_modules())
    kinds: dict[tuple, list[str]] = {}
    for g in plan.groups:
        # not a module's only group (per-parameter meshes: plan.group_keys): its block is compiled inline
        if g.fqn == "" or g.fqn not in modules or plan.has_fsdp_children(g.fqn):
            continue
        m = modules[g.fqn]
        # raw names: CheckpointWrapper.named_parameters() strips its own prefix
        params = list(nn.Module.named_parameters(m))
        # hooks inside a block (TP's) are compared per kind (``inline_reason``)
        if {f"{g.fqn}.{n}" for n, _ in params} != {p.fqn for p in g.params}:
            continue
        signature = (
            type(m), g.param_dtype,
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in params),
            tuple((n, tuple(b.shape), b.dtype) for n, b in nn.Module.named_buffers(m)),
        )
        kinds.setdefault(signature, []).append(g.fqn)
    return [fqns for fqns in kinds.values() if len(fqns) >= 2]


def _reuse_key(spec, *operands) -> int:
    """What the template trace depends on besides the block: the call's structure (``_flatten_call``'s spec)
    and its operands' dtypes, ranks, requires_grad. Dynamo traces it at every call of the region: a flat call
    is hashed as it is (a pytree walk cost 16 ms a call), the rare nested one through its leaves."""
    leaves = operands if spec is not None else torch.utils._pytree.tree_leaves(operands)
    return hash((spec, *[
        (t.dtype, t.dim(), t.requires_grad) if isinstance(t, torch.Tensor) else (type(t).__name__, repr(t))
        for t in leaves
    ]))


_MADE = itertools.count()


def _make_region(blocks: list[nn.Module], index: int, crossing: tuple | None = None):
    from torch.nn.utils.stateless import _reparametrize_module

    template = blocks[0]
    names = tuple(n for n, _ in nn.Module.named_parameters(template)) + tuple(n for n, _ in nn.Module.named_buffers(template))
    forward = type(template).forward
    n = len(names) if crossing is None else boundary.width(crossing[1])
    name = f"fsdp_compile_region_{index}"
    dtensors = boundary.dtensor_parameters(crossing)
    if len({_plain_attributes(b) for b in blocks}) == 1:
        made = f"{name}:{next(_MADE)}"  # what its outputs' layouts are noted by: this region's, not another model's

        def region(spec, *operands):
            key = boundary.call_key(made, spec, operands[n:], dtensors)
            if spec is not None:  # DTensor activations, from their local tensors (``boundary``)
                spec, _, named = spec.partition("#")
                operands = boundary.activations_rebuilt(operands, named)
            tensors, args, kwargs = _unflatten_call(spec, n, operands)
            if crossing is not None:  # DTensor and subclass parameters, from what crossed (``boundary``)
                tensors = boundary.rebuilt(tensors, *crossing)
            with _reparametrize_module(template, dict(zip(names, tensors))):
                return boundary.outputs_flattened(forward(template, *args, **kwargs), key)

        compiled = torch.compiler.nested_compile_region(_unique_code(region, name), reuse_hash_fn=_reuse_key)
        compiled.fsdp_compile_made = made
        return compiled, names, False

    # Each block is passed in with its unsharded tensors already in place (traced_forward's call_with put
    # them there), so the body sets nothing: Dynamo reuses the first block's trace for every later block whose
    # guards on what the trace read hold (a layer_idx read by a KV cache's update does not), and traces the
    # others as themselves. The tensors are operands so that the reuse maps each block's own to the subgraph's.
    def region_of(block, tensors, *args, **kwargs):
        return forward(block, *args, **kwargs)

    return torch.compiler.nested_compile_region(_unique_code(region_of, name)), names, True


def inline_reason(plan: ShardingPlan, fqns: list[str], model: nn.Module) -> str | None:
    """Why the blocks ``fqns`` (one kind) of ``model`` cannot run as a region at all, or None: what ``compile`` reads
    off the blocks (``install_regions``); what a compiled step finds since is ``found_inline``'s."""
    blocks = [model.get_submodule(f) for f in fqns]
    names = _tensor_names(blocks[0])
    # DTensor parameters cross the boundary as local tensors, their layouts constants of the region (``boundary``);
    # spmd_types parameters are plain tensors (their all-reduce over tp runs outside the region)
    if any(boundary.parallel_specs(plan, fqns[0], names)) or any(boundary.subclass_specs(plan, fqns[0], names)):
        if len({_plain_attributes(b) for b in blocks}) > 1:
            return INLINE_PARALLEL
        why = boundary.parallel_reason(plan, fqns, names)
        if why is not None:
            return why
    why = block_hooks.hooks_reason(blocks, fqns)
    if why is not None:
        return why
    # subclass parameters cross as their inner tensors, their flatten contexts constants of the region (``boundary``)
    return boundary.subclass_reason(plan, fqns, names)


def found_inline(model: nn.Module, fqns: list[str]) -> str | None:
    """Why a compiled step found the region of blocks ``fqns`` unusable (returning a DTensor: each block then
    traced as itself and inlined), or None."""
    region = getattr(model.get_submodule(fqns[0]).forward, "fsdp_compile_region", None)
    return getattr(getattr(region, "__marked_compile_region_fn__", None), "fsdp_compile_inline_why", None)


_DEFERRED = itertools.count()


def install_regions(model: nn.Module, plan: ShardingPlan) -> tuple[list[list[str]], list, dict[str, int], dict[int, str]]:
    """Route every repeated block's forward through its region while a compiled step runs with regions on
    (outside a compiled step the block's own forward runs). Returns the repeated blocks (kind ``i`` runs as
    ``fsdp_compile_region_<i>``, unless ``passes/regions.py`` inlines its calls), per block routed,
    ``(block, its previous instance forward or None, the routing forward)`` for ``Attachment.detach``, and the
    parameters whose region takes them straight from the all-gather (a template region's subclass parameters:
    ``capture.forward.Deferred``), each by fqn with the key its block's forward looks it up by, and why each kind
    not routed runs inline (``inline_reason`` read here, once: a model's forward may write a template region's
    blocks apart later, and those blocks then run inline one by one, as ``_written_apart`` finds them)."""
    _invoke_subgraph.register()
    modules = dict(model.named_modules())
    repeated = find_repeated_blocks(model, plan)
    forwards, deferred, inline = [], {}, {}
    for index, fqns in enumerate(repeated):
        blocks = [modules[f] for f in fqns]
        why = inline_reason(plan, fqns, model)
        if why is not None:
            inline[index] = why
            continue
        crossing = _crossing(plan, fqns[0], _tensor_names(blocks[0]))
        region, names, pass_block = _make_region(blocks, index, crossing)
        for fqn, block in zip(fqns, blocks):
            previous = block.__dict__.get("forward")
            # the template with itself: its attributes read at top level before its region's body reads them
            pairs = () if pass_block else _attribute_pairs(block, blocks[0])
            keys = ()
            if crossing is not None and not pass_block:
                keys = tuple(None if sub is None else next(_DEFERRED) for sub in crossing[1])
                deferred.update((f"{fqn}.{name}", k) for name, k in zip(names, keys) if k is not None)
            block.forward = _regional_forward(block, region, names, pass_block, pairs, crossing, keys)
            forwards.append((block, previous, block.forward))
    return repeated, forwards, deferred, inline


def _crossing(plan: ShardingPlan, fqn: str, names) -> tuple | None:
    """``(ParallelSpec or None, SubclassCrossing or None)`` per tensor of a kind's blocks (``boundary``), or None
    where every tensor crosses as it is."""
    specs, subclasses = boundary.parallel_specs(plan, fqn, names), boundary.subclass_specs(plan, fqn, names)
    if not any(specs) and not any(subclasses):
        return None
    return specs, boundary.subclass_crossings(subclasses)


# Flags that torch's wrappers set on every submodule they take (fully_shard: _is_fsdp_managed_module and
# _fsdp_use_orig_params; parallelize_module: _distribute_module_applied) or that registering a backward hook sets
# (_is_full_backward_hook, its hooks compared by ``block_hooks``): read by no forward, and nothing writes them in
# a step. ``_written_apart`` does not read them: 45 of the 76 attributes of a float8 x TP Llama block, whose
# reads (each guarded) took about 60 ms of its tracing. Blocks that differ in one are still told apart
# (``_plain_attributes``: each then passed in itself).
_FLAGS = frozenset({"_is_full_backward_hook", "_is_fsdp_managed_module", "_fsdp_use_orig_params",
                    "_distribute_module_applied"})
# A Linear's in_features and out_features (torchao's Float8Linear's too) are its weight's shape, which a kind's
# signature makes equal in every block (``find_repeated_blocks``): 14 of the 31 attributes of a Llama block, whose
# reads took about 270 of the 3,000 steps of Dynamo's tracing per TP Llama block. Written apart from the weight,
# they would describe another Linear than the one the block holds.
_LINEAR_SHAPE = frozenset({"in_features", "out_features"})


def _attribute_pairs(block: nn.Module, template: nn.Module) -> tuple:
    """``(submodules of block, the template's, their attributes)`` for ``_written_apart``: every submodule of the
    block that has plain attributes (but ``_FLAGS``, and a Linear's ``_LINEAR_SHAPE``), or ``()`` where none has.
    The attributes come through ``capture.forward.constants`` as ``(index of the submodule, name)``, unguarded: a
    name Dynamo read off a tuple was guarded, as was each tuple's structure (with ``_LINEAR_SHAPE``, a TP Llama
    block's comparisons went from about 94 guards to 34). Each submodule appears once: Dynamo guards that every
    path by which it meets one object leads to that object, so one entry per attribute cost about 100 such
    guards per block."""
    subs, mines, templates, names = dict(nn.Module.named_modules(template)), [], [], []
    for path, sub in nn.Module.named_modules(block):
        skip = _FLAGS | _LINEAR_SHAPE if isinstance(sub, nn.Linear) else _FLAGS
        keys = tuple(key for key, value in vars(sub).items() if isinstance(value, _PLAIN) and key not in skip)
        names += [(len(mines), key) for key in keys]
        if keys:
            mines.append(sub)
            templates.append(subs[path])
    return (tuple(mines), tuple(templates), constants([tuple(names)])) if mines else ()


def _written_apart(mines: tuple, templates: tuple, names) -> bool:
    """Whether a block of a template region has a plain attribute that differs from the template's now: the
    model's forward wrote it (``block.scale = ...`` in the parent's loop), in the trace. Dynamo reads both
    (the write included) and folds the comparison; unwritten attributes are guarded, as any read is.
    ``names(0)``: every attribute, as ``(index of its submodule, name)``."""
    for j, key in names(0):
        a, b = getattr(mines[j], key), getattr(templates[j], key)
        if a != b and (a == a or b == b):  # NaN equals NaN here
            return True
    return False


def _holders(block: nn.Module, names) -> tuple:
    """Per dotted name (a parameter's or buffer's), the ``_parameters`` or ``_buffers`` dict that holds it and
    its key there, found once: Dynamo traced the ``getattr`` walk down to each at about 2 ms a tensor. As
    ``call_with`` takes places, by the index of the name (``place_table``: the dicts guarded, their keys not)."""
    out = {}
    for j, dotted in enumerate(names):
        path, _, key = dotted.rpartition(".")
        module = _get(block, path) if path else block
        out[j] = ((module._parameters if key in module._parameters else module._buffers, key),)
    return place_table(out)


def _regional_forward(block: nn.Module, region, names, pass_block: bool, pairs: tuple = (), crossing=None,
                      keys: tuple = ()):
    """``keys``: per tensor of ``names``, the key of its ``capture.forward.Deferred`` in ``STEP.pieces``, or None.
    What the forward reads of ``keys`` and ``crossing`` (which tensors are DTensors) comes through ``constants``,
    unguarded; the subclass crossings, guarded, only where there are some."""
    own = getattr(block.forward, "fsdp_compile_own_forward", block.forward)  # the bound method of its class
    made = getattr(region, "fsdp_compile_made", None)
    dtensors = boundary.dtensor_parameters(crossing)
    deferred = constants([keys]) if any(k is not None for k in keys) else None
    parallel = None if crossing is None else constants([tuple(s is not None for s in crossing[0])])
    subclasses = None if crossing is None or not any(crossing[1]) else crossing[1]
    holders = dicts, every = _holders(block, names)
    buffers = len(names) - len(tuple(nn.Module.named_parameters(block)))  # ``names`` lists them last (``_tensor_names``)

    def inline(entries, args, kwargs):
        """The block's own forward, with its deferred parameters built and in place for the call."""
        if entries is None:
            return own(*args, **kwargs)
        built = {j: materialized(entry) for j, entry in enumerate(entries) if entry is not None}
        return call_with(own, holders, built, args, kwargs)

    def forward(*args, **kwargs):
        pieces = STEP.pieces
        entries = None
        if deferred is not None and pieces is not None:
            entries = tuple([None if k is None else pieces.get(k) for k in deferred(0)])
            if not any(e is not None for e in entries):
                entries = None
        if not (STEP.active and STEP.regions):
            return inline(entries, args, kwargs)
        if pairs and _written_apart(*pairs):  # the template's trace would run with the template's values
            return inline(entries, args, kwargs)
        # the unsharded tensors that traced_forward's call_with put in place, as the region's inputs
        tensors = tuple([dicts[k][key] for _, k, key in every(0)])
        if parallel is not None:  # DTensor and subclass parameters go in flattened (``boundary``)
            tensors = boundary.flattened(tensors, parallel(0), subclasses, _direct(entries, subclasses))
            if tensors is None:
                return inline(entries, args, kwargs)
        if pass_block:
            return region(block, tensors, *args, **kwargs)
        spec, operands = _flatten_call(tensors, args, kwargs)
        # a block's parameters are DTensors only where ``crossing`` says (``dtensors``), its buffers may be
        if boundary.symbolic_dtensor_call(operands[len(tensors) - buffers:], dtensors):
            return inline(entries, args, kwargs)  # dynamic shapes: a layout's shape cannot be a constant of the region
        if spec is not None:  # DTensor activations and buffers (torchtitan's RoPE cache) go in as local tensors
            operands, named = boundary.activations_flattened(operands, len(tensors) - buffers)
            spec = f"{spec}#{named}" if named else spec
        key = boundary.call_key(made, spec, operands[len(tensors):], dtensors)
        return boundary.outputs_rebuilt(region(spec, *operands), key)

    forward.fsdp_compile_region = region
    forward.fsdp_compile_passes_block = pass_block  # blocks differ in an attribute: each traced as itself
    forward.fsdp_compile_own_forward = own
    return forward


def _direct(entries, subclasses) -> tuple | None:
    """Per tensor, the region operands ``SubclassCrossing.direct`` makes of its ``Deferred`` entry (None: none),
    annotated as part of the unshard of the entry's unit (``passes/recompute.py`` re-gathers what it tags)."""
    if entries is None:
        return None
    out, units = [None] * len(entries), []
    for entry in entries:
        if entry is not None and (entry.members, entry.unit) not in units:
            units.append((entry.members, entry.unit))
    for members, unit in units:  # one annotation per unit (a block's parameters are in one, mostly)
        with annotate(UNSHARD, members, unit):
            for j, (entry, sub) in enumerate(zip(entries, subclasses)):
                if entry is not None and entry.unit == unit:
                    out[j] = sub.direct.apply(*entry.attach)
    return tuple(out)


# A region call whose operands are all leaves (tensors, constants, modules), with no keyword arguments, is
# fingerprinted by Dynamo without tracing pytree (``build_input_fingerprint``'s fast path): the pytree path
# cost about 50 ms of tracing per block (16 layers, Dynamo's profiler). A template region's call (tensors,
# positional arguments, keyword arguments whose values are leaves or tuples/lists of leaves) goes in flat,
# its structure in ``spec``, a constant string (so part of the fingerprint, and of the reuse key); any other
# call goes in as ``(tensors, args, kwargs)`` with ``spec`` None, through pytree's path. Not for blocks
# passed in (``region_of``): on the fast path Dynamo (2.13) reused the first block's trace for blocks that
# differ in a float attribute it read (``test_which_blocks_share_a_region``: wrong outputs), where the pytree
# path traces each; a template region's blocks have equal attributes, and its reuse is keyed
# (``_reuse_key``). On torch 2.13 pytree's path is cheap where the call is plain:
# ``_invoke_subgraph._fingerprint`` gives its result without tracing pytree.

_LEAVES = (torch.Tensor, bool, int, float, str, type(None))


def _flatten_call(tensors: tuple, args: tuple, kwargs: dict) -> tuple:
    """``(spec, operands)`` for the region call of one block (``_unflatten_call`` inverts it)."""
    flat, parts = list(tensors), []
    for key, value in [*(("*", a) for a in args), *kwargs.items()]:  # "*": positional
        if isinstance(value, _LEAVES):  # inline: Dynamo traces every call of a helper
            parts.append(key)
            flat.append(value)
        elif type(value) in (tuple, list) and all(isinstance(v, _LEAVES) for v in value):
            parts.append(f"{key}:{type(value).__name__}:{len(value)}")
            flat.extend(value)
        else:
            return None, (tensors, args, kwargs)
    return "|".join(parts), tuple(flat)


def _unflatten_call(spec: str | None, n: int, operands: tuple) -> tuple:
    """``(tensors, args, kwargs)`` from ``_flatten_call``'s ``(spec, operands)``; ``n``: the block's tensors."""
    if spec is None:
        return operands
    tensors, rest, args, kwargs = operands[:n], list(operands[n:]), [], {}
    for part in spec.split("|") if spec else ():
        key, _, kind = part.partition(":")
        if kind:
            container, _, size = kind.partition(":")
            value = rest[: int(size)]
            rest = rest[int(size):]
            value = tuple(value) if container == "tuple" else list(value)
        else:
            value = rest.pop(0)
        if key == "*":
            args.append(value)
        else:
            kwargs[key] = value
    return tensors, tuple(args), kwargs


def _unique_code(fn, name: str):
    """A copy of ``fn`` with its own code object: Dynamo keys compiled entries (and region reuse) by it."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
