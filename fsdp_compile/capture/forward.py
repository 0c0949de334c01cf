"""The function Dynamo captures: every unit's unshard, then the model on the full parameters.

For every unit of the communication schedule (an FSDP group, a bucket of them, or one parameter) one
``fsdp_compile::unshard`` over its local shards (``DTensor.to_local()``, taken just outside the graph, so
gradients arrive as Shard(0) DTensor ``.grad`` on the original parameters), then the model runs with the
full tensors in its parameters' places (``call_with``). The passes then move each unshard to just before
its group's first use (``passes/placement.py``), which is where FSDP2's pre-forward hook would have issued
it. Everything ``traced_forward`` reads is found once, outside the trace (``unit_traces``,
``parameter_places``): Dynamo traces every read. What cannot change for the life of the step is read as a
constant, unguarded (``constants``): Dynamo guards every value it reads of an input. Not put in place: a region
block's all-gather extension parameters (torchao's float8 weights), which its region takes straight from the
all-gather (``Deferred``).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Callable, NamedTuple

import torch
import torch.nn as nn

from fsdp_compile import _extensions
from fsdp_compile._annotations import UNSHARD, annotate
from fsdp_compile.capture.step import STEP
from fsdp_compile.ops import Comm, Reduction, UnshardArgs
from fsdp_compile.passes.schedule import Schedule, Unit
from fsdp_compile.plan import ParamPlan, ShardingPlan


class UnitTrace(NamedTuple):
    """What ``traced_forward`` reads of one schedule unit, found once outside the trace (Dynamo traces every
    read: walking the plan for a unit's parameters and its group cost about 17 ms of tracing per unit, HF
    Llama at 16 layers, Dynamo's profiler)."""

    arguments: str  # its encoded ``UnshardArgs`` (``unshard_args``), a constant of the graph
    params: tuple  # ``unit_params``: the ParamPlans its op takes and returns (``trace_constants``: ``Rebuilt``s)
    fqns: tuple[str, ...]
    parallel: tuple | None  # per parameter, its TP/EP spec (``ParamPlan.parallel``); None where no parameter has one
    members: tuple[str, ...]
    param_dtype: torch.dtype | None
    layouts: tuple | None  # the step's key for it: per parameter its all-gather extension's ``Layout``; or None


class Deferred(NamedTuple):
    """An all-gather extension's parameter that its block's region takes as the inner tensors of what
    ``fsdp_post_all_gather`` builds (``boundary.SubclassCrossing.direct``): left unbuilt by ``traced_forward``,
    built by the block's forward where it runs inline (``materialized``)."""

    attach: tuple  # ``_extensions.Attach``'s arguments
    parallel: object  # ``ParamPlan.parallel``: its TP spec, or None (its mesh: ``mesh``)
    mesh: object
    members: tuple[str, ...]  # its unit's FSDP modules, and the unit's index: the unshard annotation
    unit: int


def materialized(entry: Deferred) -> torch.Tensor:
    """The unsharded parameter ``traced_forward`` would have built of ``entry``, for its block's own forward."""
    with annotate(UNSHARD, entry.members, entry.unit):
        t = _extensions.Attach.apply(*entry.attach)
        return t if entry.parallel is None else _as_dtensor(t, entry.parallel, entry.mesh)


def unit_traces(plan: ShardingPlan, schedule: Schedule, kernels: str, key: tuple) -> list[UnitTrace]:
    """``UnitTrace`` of every unit of ``schedule``, for the all-gather extension key ``key``."""
    out = []
    for i, unit in enumerate(schedule.units):
        params = tuple(unit_params(plan, unit))
        parallel = tuple(p.parallel for p in params)
        out.append(UnitTrace(
            unshard_args(plan, unit, i, kernels, key[i]).encode(), params, tuple(p.fqn for p in params),
            parallel if any(x is not None for x in parallel) else None, unit.members, plan.group(unit.members[0]).param_dtype,
            key[i],
        ))
    return out


_CONSTANTS = itertools.count()


def constants(values) -> Callable[[int], object]:
    """``values[i]`` for the trace, as a constant Dynamo does not guard (``assume_constant_result``: Dynamo calls
    it at trace time and keeps the result, unguarded). For values fixed for the life of a compiled step's code
    object (``_api``'s ``_unique_code``: one per step), which guards would check at every call for nothing.
    Dynamo keeps each result in the compiled frame's globals under the function's name, numbered from 0 on
    every call: a name of its own per accessor keeps that numbering short (with one name for all, every call of
    every compile in a process searched past all of those before it)."""

    def at(i: int):
        return values[i]

    name = f"fsdp_compile_constant_{next(_CONSTANTS)}"
    at.__code__ = at.__code__.replace(co_name=name, co_qualname=name)  # the name Dynamo keeps results under
    return torch._dynamo.assume_constant_result(at)


class TraceConstants(NamedTuple):
    """What ``traced_forward`` reads of the schedule's units. Every value Dynamo reads of an input is guarded:
    each parameter's name and its TP layout's placements, shape and stride cost about 140 of a TP Llama block's
    400 guards, built at every compile and checked at every call. ``units(i)``: unit ``i``'s ``UnitTrace``
    through ``constants``, with each TP spec's mesh as its index in ``meshes`` (a mesh crosses into the graph
    as an input, an opaque object whose source a region's reuse must resolve, so the meshes stay guarded, once
    each), and as its ``params`` the ``Rebuilt`` of each all-gather extension parameter (None for the others),
    or () in a unit without one."""

    units: Callable[[int], UnitTrace]
    meshes: tuple


class Rebuilt(NamedTuple):
    """What ``traced_forward`` reads of a parameter that ``fsdp_post_all_gather`` rebuilds (its ``ParamPlan``,
    whose ``ExtensionSpec`` holds modules and meshes: read guarded, with the key's layouts, 159 of the 378 guards
    each block of a float8 Llama cost on one rank)."""

    orig_dtype: torch.dtype
    orig_size: tuple[int, ...]
    contiguous_stride: tuple[int, ...]


def trace_constants(units: list[UnitTrace]) -> TraceConstants:
    """``TraceConstants`` of a step's ``unit_traces``."""
    meshes = _Interned()

    def indexed(spec):
        return None if spec is None else dataclasses.replace(spec, mesh=meshes.index(spec.mesh))

    def rebuilt(p: ParamPlan):
        e = p.extension
        if e is None:
            return None
        return Rebuilt(p.orig_dtype, tuple(e.orig_size), tuple(e.contiguous_stride))

    table = [u._replace(params=() if u.layouts is None else tuple(map(rebuilt, u.params)),
                        parallel=None if u.parallel is None else tuple(map(indexed, u.parallel)))
             for u in units]
    return TraceConstants(constants(table), tuple(meshes.values))


class _Interned:
    """Distinct objects by identity, each once in order of first sight: ``index(x)`` is ``x``'s place in
    ``values``, appended if new."""

    def __init__(self):
        self.values: list = []
        self._at: dict[int, int] = {}

    def index(self, x) -> int:
        k = self._at.setdefault(id(x), len(self.values))
        if k == len(self.values):
            self.values.append(x)  # held here, so its id() is not reused while the index lives
        return k


def traced_forward(
    model: nn.Module, constant: TraceConstants, places: tuple, deferred,
    shards: list[list[torch.Tensor]], sinks: list[list], accumulated: list[list], partials: list[tuple[list, list]],
    extensions: list[list], args, kwargs
):
    """The function Dynamo captures: one ``fsdp_compile::unshard`` per unit of the schedule (``shards[i]``:
    the local shards of unit ``i``'s parameters, whose op arguments were encoded before tracing: ``constant``,
    ``trace_constants``); ``sinks[i]`` / ``accumulated[i]``: gradient accumulation without sync, ``partials[i]``:
    HSDP's without all-reduce (its partial sinks, its partials), see the op; ``extensions[i]``: its all-gather
    extensions' tensors, ``_extensions.prepare``, their layouts the unit's ``layouts``), then the model on the full
    parameters (``places``: ``place_table``). An extension parameter to which ``deferred`` gives a key
    (``constants`` by name: the key or None; ``regions.install_regions``) is not built here, with regions on: its
    block's forward finds what it is built of in ``STEP.pieces``, under that key."""
    full, pieces, regions, meshes = {}, {}, STEP.regions, constant.meshes
    for i, unit_shards in enumerate(shards):
        unit = constant.units(i)
        if unit.layouts is None:
            gathered = torch.ops.fsdp_compile.unshard(unit_shards, sinks[i], accumulated[i], *partials[i], [], unit.arguments)
            if unit.parallel is None:
                for fqn, t in zip(unit.fqns, gathered):
                    full[fqn] = t
            else:
                for fqn, spec, t in zip(unit.fqns, unit.parallel, gathered):
                    full[fqn] = t if spec is None else _as_dtensor(t, spec, meshes[spec.mesh])
            continue
        selves, payloads, metadatas = _extensions.split(extensions[i], unit.layouts)
        outs = iter(torch.ops.fsdp_compile.unshard(unit_shards, sinks[i], accumulated[i], *partials[i], payloads,
                                                   unit.arguments))
        with annotate(UNSHARD, unit.members, i):  # part of the unit's unshard chain (re-gathered for reshard_after_forward)
            specs = unit.parallel or (None,) * len(unit.fqns)
            for fqn, p, spec, layout in zip(unit.fqns, unit.params, specs, unit.layouts):
                mesh = None if spec is None else meshes[spec.mesh]
                if layout is None:
                    t = next(outs)
                else:
                    outputs = [next(outs) for _ in range(layout.n_inputs)]
                    attach = _extensions.attach_args(
                        selves.pop(0), outputs, metadatas.pop(0), next(outs), unit.param_dtype or p.orig_dtype, p, fqn)
                    deferred_key = deferred(fqn) if regions else None
                    if deferred_key is not None:
                        pieces[deferred_key] = Deferred(attach, spec, mesh, unit.members, i)
                        # None in its place (nothing but its block's forward reads it, which builds it if it runs
                        # inline): the sharded parameter left there had the region's trace guard on its inner tensors
                        # (``_reparametrize_module`` reads what it swaps), which precomputed float8 scales change
                        full[fqn] = None
                        continue
                    t = _extensions.Attach.apply(*attach)
                # a TP parameter's rebuilt local tensor (torchao's Float8TrainingTensor) as its TP DTensor, as FSDP2's
                # init_unsharded_param wraps what fsdp_post_all_gather returns
                full[fqn] = t if mesh is None else _as_dtensor(t, spec, mesh)
    if not pieces:
        return call_with(model, places, full, args, kwargs)
    previous, STEP.pieces = STEP.pieces, pieces
    try:
        return call_with(model, places, full, args, kwargs)
    finally:
        STEP.pieces = previous


def parameter_places(model: nn.Module, fqns, own: dict[str, tuple[str, ...]] | None = None
                     ) -> dict[str, tuple[tuple[dict, str], ...]]:
    """Where each parameter ``fqns`` names is held: ``(module._parameters, name)`` for every module that holds
    it, every alias of a tied one included (``functional_call(tie_weights=True)``'s untying); for a name in
    ``own`` (``ParamPlan.places``: one of several FSDP parameters sharing a sharded parameter), only the
    places it lists. Found once, outside the trace: Dynamo traced ``functional_call``'s walk of every
    module's parameters on every compile, 0.35 s per layer of an HF Llama (and reading
    ``module._parameters`` in the trace, 1 ms each)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, module in nn.Module.named_modules(model, remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None and (module, name) not in holders.setdefault(id(param), []):
                holders[id(param)].append((module, name))
    out = {}
    for fqn in fqns:
        found = [_held(model, place) for place in (own or {}).get(fqn, (fqn,))]
        param = found[0][0]._parameters.get(found[0][1])
        if param is None or any(m._parameters.get(n) is not param for m, n in found):
            raise ValueError(f"fsdp_compile: no parameter {fqn!r} on the model: call fsdp_compile.compile again")
        places = found if fqn in (own or {}) else holders[id(param)]
        out[fqn] = tuple((holder._parameters, key) for holder, key in places)
    return out


def _held(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    path, _, name = fqn.rpartition(".")
    return (_get(model, path) if path else model), name


def place_table(places: dict) -> tuple[tuple[dict, ...], Callable]:
    """``parameter_places``' places as ``call_with`` takes them: the dicts that hold the parameters, each once, and
    every place as ``(name, index of its dict, key)``, through ``constants``. Dynamo guards each dict (the step
    writes into it) but not the names and tuples around it: 5 of the 7 guards a parameter's place cost."""
    dicts = _Interned()
    every = tuple((name, dicts.index(d), key) for name, held in places.items() for d, key in held)
    return tuple(dicts.values), constants([every])


def call_with(model, places: tuple, tensors: dict, args, kwargs):
    """``model(*args, **kwargs)`` with each parameter named in ``tensors`` replaced, at every place it is held
    (``places``: ``place_table`` of ``parameter_places``), by its tensor: ``functional_call(model, tensors, args,
    kwargs, tie_weights=True)`` for a dict of parameters, without the module walk. The parameters are put back on
    the way out. ``model`` may be any callable (a block's own forward: ``regions._regional_forward``'s inline
    build)."""
    dicts, every = places
    saved = []
    try:
        for name, k, key in every(0):
            if name in tensors:
                held = dicts[k]
                saved.append((held, key, held[key]))
                held[key] = tensors[name]
        return model(*args, **kwargs)
    finally:
        for held, key, param in reversed(saved):
            held[key] = param


def _as_dtensor(local: torch.Tensor, spec, mesh):
    """A gathered TP/EP-local tensor as the DTensor its module's parallel plan expects (FSDP2's
    ``init_unsharded_param``). Differentiable: the gradient comes back as the local tensor, redistributed
    to ``spec.placements`` first where it is not already (a Partial gradient of a replicated weight is
    all-reduced over its mesh), as FSDP2 does before its reduce-scatter; under ``dp_mesh_dims`` on the other
    dims than ``spec.dp_dims`` only (``_DataParallelDTensor``). An spmd_types parameter (``spec.grad_placements``)
    stays the plain tensor, with that backward (``_SpmdTypesParam``)."""
    if spec.grad_placements is not None:
        return _SpmdTypesParam.apply(local, mesh, spec.placements, spec.grad_placements, spec.dp_dims)
    # with dp_dims (), DTensor.from_local's backward; traced instead, from_local took about 5 ms a parameter
    return _DataParallelDTensor.apply(local, mesh, spec.placements, spec.dp_dims, spec.shape, spec.stride)


class _DataParallelDTensor(torch.autograd.Function):
    """``DTensor.from_local`` whose backward is FSDP2's ``_get_grad_inner_tensor`` under ``dp_mesh_dims``: the
    gradient is redistributed on the non-data-parallel dims only, and its local tensor handed to FSDP's
    reduce-scatter whatever its data-parallel placements are (Partial where the batch is sharded: summed by the
    reduce-scatter, not all-reduced first; Replicate, as torchtitan's token embedding gets under TP: reduced as
    it is). Neither is known before the backward is traced, so ``from_local``'s fixed ``grad_placements`` cannot
    say it. ``allow_in_graph``: Dynamo would trace this backward ahead, on gradients laid out as the output
    (measured: the sequence-parallel norms' Partial(tp) gradients then skipped their all-reduce over tp);
    AOTAutograd runs it on the gradients the backward has."""

    @staticmethod
    def forward(ctx, local, mesh, placements, dp_dims, shape, stride):
        from torch.distributed.tensor import DTensor

        ctx.placements, ctx.dp_dims = placements, dp_dims
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    @staticmethod
    def backward(ctx, grad):
        return data_parallel_grad(grad, ctx.placements, ctx.dp_dims), None, None, None, None, None


torch._dynamo.allow_in_graph(_DataParallelDTensor)


def data_parallel_grad(grad, placements, dp_dims):
    """``_DataParallelDTensor``'s backward: the local tensor of ``grad`` redistributed to ``placements`` on the
    dims not in ``dp_dims`` (a Partial one all-reduced, as Replicate), as it comes on those."""
    from torch.distributed.tensor import Replicate

    target = tuple(grad.placements[i] if i in dp_dims else Replicate() if p.is_partial() else p
                   for i, p in enumerate(placements))
    if target != tuple(grad.placements):
        grad = grad.redistribute(placements=target)
    return grad.to_local()


class _SpmdTypesParam(torch.autograd.Function):
    """The gathered plain tensor of an spmd_types parameter (torch >= 2.14), as FSDP2's init_unsharded_param keeps
    it, whose backward is FSDP2's ``_get_grad_inner_tensor`` for it: the gradient read as a DTensor with
    ``grad_placements`` and redistributed on the non-data-parallel dims to ``placements`` (an R-typed
    weight's Partial(tp) gradient all-reduced over tp) before FSDP's reduce-scatter. ``allow_in_graph`` as
    ``_DataParallelDTensor``: AOTAutograd runs this backward on the gradient the backward has."""

    @staticmethod
    def forward(ctx, local, mesh, placements, grad_placements, dp_dims):
        ctx.mesh, ctx.grad_placements = mesh, grad_placements
        ctx.target = tuple(g if i in dp_dims else p for i, (g, p) in enumerate(zip(grad_placements, placements)))
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor

        grad = DTensor.from_local(grad, ctx.mesh, ctx.grad_placements, run_check=False)
        return grad.redistribute(placements=ctx.target).to_local(), None, None, None, None


torch._dynamo.allow_in_graph(_SpmdTypesParam)


def unit_params(plan: ShardingPlan, unit: Unit) -> list[ParamPlan]:
    """The parameters one unit gathers, in the order its op takes and returns them."""
    params = [p for fqn in unit.members for p in plan.group(fqn).params]
    return [p for p in params if p.fqn in unit.params] if unit.params is not None else params


def unshard_args(plan: ShardingPlan, unit: Unit, index: int, kernels: str, layouts: tuple | None = None) -> UnshardArgs:
    """The ``fsdp_compile::unshard`` arguments of schedule unit ``index`` (its members share everything but
    their parameters: ``GroupPlan.bucket_key``); ``layouts``: its all-gather extensions' (``_extensions.Layout``)."""
    group = plan.group(unit.members[0])
    payloads = () if layouts is None else tuple(0 if x is None else x.n_inputs for x in layouts)
    return UnshardArgs(
        comm=Comm(unit.members, index, group.group_name, group.world_size, kernels, group.offload,
                  group.offload_pinned),
        dim0s=tuple(p.full_shape[0] for p in unit_params(plan, unit)),
        param_dtype=group.param_dtype,
        reduction=Reduction(group.reduce_dtype, group.reduce_op, group.pre_factor, group.post_factor,
                            group.replicate_group_name, group.all_reduce_op),
        payloads=payloads,
    )


def _get(module: nn.Module, dotted: str):
    for part in dotted.split("."):
        module = getattr(module, part)
    return module
