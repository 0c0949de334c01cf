"""``ShardingPlan``: the FSDP2 layout of a model read into plain data.

Everything the capture needs to reproduce FSDP2's eager semantics in one graph: the FSDP groups in
module pre-order, each group's parameters (by FQN), its process group, ``reshard_after_forward`` and
mixed-precision policy, and the gradient reduction FSDP2 would use. Options that the capture does
not implement yet are rejected here with ``NotImplementedError`` naming the option, before any trace.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from fsdp_compile import _fsdp2
from fsdp_compile._agree import check_ranks_agree  # noqa: F401 (fsdp_compile's API imports it from here)
from fsdp_compile._fsdp2 import Settings
from fsdp_compile._layout import padded_rows, rank_rows
from fsdp_compile._param_specs import ExtensionSpec, ParallelSpec, parallel_spec


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    # first FQN in ``model.named_parameters()``; tied aliases resolve to it. One of several FSDP parameters
    # that share one sharded parameter (``places``) is named by its first place instead
    fqn: str
    full_shape: tuple[int, ...]  # what the all-gather rebuilds: the parameter's shape, or its TP/EP-local one
    local_rows: int  # this rank's unpadded dim-0 rows (0 for ranks past the end)
    orig_dtype: torch.dtype
    requires_grad: bool
    matmul: bool  # a weight of matrix products (2-D or more, and not only an embedding table): the cost model's FLOPs
    parallel: ParallelSpec | None = None  # a DTensor before fully_shard: what the module is handed
    extension: ExtensionSpec | None = None  # gathers what fsdp_pre_all_gather returns (float8, ...)
    # where several FSDP parameters share this sharded parameter (``_own_places``): the ``module.attribute``
    # names FSDP2 puts this one's unsharded parameter at (only they get it); (): every module holding it
    places: tuple[str, ...] = ()

    def gathered_bytes(self, world_size: int, gather_dtype: torch.dtype | None) -> int:
        """Bytes its all-gather moves: its all-gather inputs from every rank, or its padded rows in ``gather_dtype``."""
        if self.extension is not None:
            return self.extension.input_bytes * world_size
        return _padded_numel(self.full_shape, world_size) * (gather_dtype or self.orig_dtype).itemsize


class BucketKey(NamedTuple):
    """What FSDP modules must have alike to share one all-gather and one reduce-scatter (a bucket)."""

    process_group: str
    world_size: int
    reshard_after_forward: bool
    orig_dtype: torch.dtype  # FSDP2 requires one original dtype per group
    param_dtype: torch.dtype | None  # MixedPrecisionPolicy.param_dtype
    reduce_dtype: torch.dtype | None
    reduce_op: str
    pre_factor: float | None  # gradient pre-divide factor
    post_factor: float | None  # gradient post-divide factor
    replicate_group: str | None  # HSDP
    all_reduce_op: str  # HSDP
    post_forward_group: str | None  # an int reshard_after_forward's post-forward group
    unshard_in_backward: bool = True  # set_unshard_in_backward: a unit is re-gathered in backward for all or none
    # "sync" | "no_sync" | "no_all_reduce" (HSDP): set only while it differs between modules (bucket="auto")
    gradient_sync: str | None = None
    offload: str | None = None  # CPUOffloadPolicy on an accelerator (GroupPlan.offload)
    offload_pinned: bool = False  # GroupPlan.offload_pinned


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """One FSDP parameter group: one all-gather in forward, one reduce-scatter in backward (as eager)."""

    fqn: str  # the FSDP module's FQN ("" for the root); a module's further parameter groups: group_keys
    params: tuple[ParamPlan, ...]
    group_name: str  # c10d process group name used by the functional collectives
    world_size: int
    reshard_after_forward: bool  # re-gather in backward (True) or keep unsharded params for it
    param_dtype: torch.dtype | None  # all-gather / compute dtype (None: the parameter's own)
    reduce_dtype: torch.dtype | None  # reduce-scatter dtype (None: the gradient's)
    reduce_op: str  # "avg" | "sum" | "premul_sum"
    pre_factor: float | None  # divisor before a "sum", multiplier for "premul_sum"
    post_factor: float | None  # divisor after the reduce-scatter
    replicate_group_name: str | None = None  # HSDP: the replicate dimension's process group (all-reduce after RS)
    replicate_size: int = 1
    all_reduce_op: str = "avg"  # HSDP: "avg" | "sum"
    # an int reshard_after_forward=N: after forward this rank keeps 1/N of the gathered buffer and re-gathers
    # it in backward over the post-forward group (N ranks of its shard group) instead of the whole group
    post_forward_group_name: str | None = None
    post_forward_size: int = 0
    forward_prefetch: tuple[str, ...] = ()  # FSDP2's set_modules_to_forward_prefetch: FQNs gathered at our pre-forward
    backward_prefetch: tuple[str, ...] = ()  # ... set_modules_to_backward_prefetch
    # set_unshard_in_backward(False): its backward must not need its parameters (FSDP2 does not re-gather them;
    # a backward graph that re-gathers them is refused, backend.py)
    unshard_in_backward: bool = True
    mesh_dims: tuple[str, ...] = ("dp", "replicate")  # the FSDP mesh's names of its shard and replicate dims
    # a module holding other FSDP modules (the root): its parameters registered before theirs (an embedding),
    # which its forward uses before them; the rest (a final norm, an output head) it uses after them
    leading: tuple[str, ...] = ()
    offload: str | None = None  # CPUOffloadPolicy on an accelerator: its device type (_fsdp2.offload_device)
    offload_pinned: bool = False  # with offload, CPUOffloadPolicy(pin_memory=True): gradients copied back non-blocking

    @property
    def unsharded_bytes(self) -> int:
        """Bytes one all-gather of this group moves: every parameter padded to W rows, in ``param_dtype``; an
        all-gather extension's inputs (int8 or float8 data and their scales) as they are."""
        return sum(p.gathered_bytes(self.world_size, self.param_dtype) for p in self.params)

    @property
    def reduce_bytes(self) -> int:
        """Bytes one reduce-scatter of this group's gradients takes in (trainable parameters, ``reduce_dtype``)."""
        return sum(
            _padded_numel(p.full_shape, self.world_size) * (self.reduce_dtype or p.orig_dtype).itemsize
            for p in self.params if p.requires_grad
        )

    @property
    def matmul_numel(self) -> int:
        """Elements of this group's matrix-product weights: forward FLOPs per token are twice this."""
        return sum(math.prod(p.full_shape) for p in self.params if p.matmul)

    def bucket_key(self) -> BucketKey:
        """Groups with equal keys can share one all-gather and one reduce-scatter."""
        return BucketKey(self.group_name, self.world_size, self.reshard_after_forward, self.params[0].orig_dtype,
                         self.param_dtype, self.reduce_dtype, self.reduce_op, self.pre_factor, self.post_factor,
                         self.replicate_group_name, self.all_reduce_op, self.post_forward_group_name,
                         self.unshard_in_backward, offload=self.offload,
                         offload_pinned=self.offload_pinned)


def _padded_numel(shape: tuple[int, ...], world_size: int) -> int:
    return padded_rows(shape[0], world_size) * world_size * math.prod(shape[1:])


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    groups: tuple[GroupPlan, ...]
    device: torch.device  # where the parameters live (one device per rank)

    def fingerprint(self) -> list[dict]:
        """The rank-independent part of the plan, one record per FSDP group with named fields: what every
        rank must agree on to issue the same collectives in the same order (local shard sizes and the rank
        itself may differ). Plain JSON values, so a disagreement names the field."""
        # process groups by size, not name: HSDP's shard groups differ between replicas by name only
        return [
            {"fqn": g.fqn, "world_size": g.world_size, "reshard_after_forward": g.reshard_after_forward,
             "param_dtype": str(g.param_dtype), "reduce_dtype": str(g.reduce_dtype), "reduce_op": g.reduce_op,
             "pre_factor": g.pre_factor, "post_factor": g.post_factor, "replicate_size": g.replicate_size,
             "all_reduce_op": g.all_reduce_op, "post_forward_size": g.post_forward_size,
             "unshard_in_backward": g.unshard_in_backward, "offload": g.offload,
             "offload_pinned": g.offload_pinned,
             "forward_prefetch": list(g.forward_prefetch), "backward_prefetch": list(g.backward_prefetch),
             "leading": list(g.leading),
             "params": [{"fqn": p.fqn, "shape": list(p.full_shape), "dtype": str(p.orig_dtype),
                         "requires_grad": p.requires_grad, "matmul": p.matmul,
                         "parallel": None if p.parallel is None else p.parallel.describe(),
                         "extension": None if p.extension is None else [p.extension.kind, p.extension.input_bytes]}
                        for p in g.params]}
            for g in self.groups
        ]

    def process_group_names(self) -> list[str]:
        """Every process group the plan's collectives run on (shard groups; HSDP's replicate groups too)."""
        names = [g.group_name for g in self.groups]
        names += [n for g in self.groups for n in (g.replicate_group_name, g.post_forward_group_name) if n]
        return list(dict.fromkeys(names))

    def process_groups(self) -> list:
        """The groups ``process_group_names`` names, resolved; none where there are no peers to talk to (no
        process group initialized, or the fake one)."""
        if not dist.is_initialized() or dist.get_backend() == "fake":
            return []
        from torch.distributed.distributed_c10d import _resolve_process_group

        return [_resolve_process_group(n) for n in self.process_group_names()]

    def mesh_dim_of_groups(self) -> dict[str, str]:
        """Every process group the model's collectives run on, by c10d name -> the mesh dim it is: FSDP's
        shard dim, HSDP's replicate dim, and the TP/EP dims of parameters that were DTensors (their
        parallel plan's collectives run on those). What the report counts collectives per."""
        out = {}
        for g in self.groups:
            out.setdefault(g.group_name, g.mesh_dims[0])
            if g.replicate_group_name:
                out.setdefault(g.replicate_group_name, g.mesh_dims[1])
            if g.post_forward_group_name:
                out.setdefault(g.post_forward_group_name, f"{g.mesh_dims[0]} (post-forward)")
            for p in g.params:
                if p.parallel is not None:
                    for i, name in enumerate(p.parallel.dim_names):
                        out.setdefault(p.parallel.mesh.get_group(i).group_name, name)
        return out

    def has_fsdp_children(self, fqn: str) -> bool:
        """Whether other FSDP modules live inside module ``fqn`` (the root, usually)."""
        return any(inside(g.fqn, fqn) for g in self.groups)

    def group(self, fqn: str) -> GroupPlan:
        for g in self.groups:
            if g.fqn == fqn:
                return g
        raise KeyError(f"no FSDP module {fqn!r}; FSDP modules: {[g.fqn for g in self.groups]}")


def fsdp_states(model: nn.Module):
    """``(fqn, module, state)`` for every FSDP state, in pre-order (``_fsdp2.states``)."""
    return _fsdp2.states(model)


def lazy_init(model: nn.Module) -> None:
    """Run FSDP2's lazy init eagerly (it normally runs in the first forward's pre-hook). A model entirely
    on the meta device is still worth capturing: ``explain`` runs it on meta tensors to report
    collectives, buckets and costs at full scale with no memory (mixed meta/real models still fail)."""
    states = fsdp_states(model)
    if not states:
        raise ValueError(
            f"{type(model).__name__} has no module sharded by fully_shard: call "
            "fsdp_compile.fully_shard (or torch.distributed.fsdp.fully_shard) on each block and then on "
            "the root before fsdp_compile.compile"
        )
    all_meta = all(p.is_meta for p in model.parameters())
    outer: list[str] = []
    for fqn, _, state in states:  # pre-order: an outermost FSDP module comes before its children
        # replicate's lazy init takes only replicate states as its own: fully_shard ones inside would each be a root
        if (o := next((f for f, _, s in states if inside(fqn, f) and _fsdp2.api(s) != _fsdp2.api(state) == "fully_shard"),
                      None)) is not None:
            raise NotImplementedError(
                f"FSDP module {fqn!r}: fully_shard inside replicate module {o or '<root>'!r} (FSDP2 initializes each such "
                "module as a root of its own) is not supported under fsdp_compile.compile; replicate the blocks and "
                "fully_shard the root instead, or use one API for the whole model")
        if not any(o == "" or fqn == o or fqn.startswith(o + ".") for o in outer):
            _fsdp2.lazy_init(state, allow_meta=all_meta)  # makes this state the root of its subtree
            outer.append(fqn)


# FSDP2's runtime setters (FSDPModule.set_*) under compile. ``settings_key`` is read at every compiled call:
# a change takes effect at the next call, on every rank together (they are SPMD calls), never silently.
# * honored: set_requires_gradient_sync (a mode of the compiled step: no reduce-scatter, unsharded gradients
#   accumulated as FSDP2 does), set_requires_all_reduce (HSDP: another mode, reduce-scatter without the
#   all-reduce, its output accumulated as FSDP2's partial reduce output), set_reshard_after_forward,
#   set_modules_to_forward_prefetch, set_modules_to_backward_prefetch, set_gradient_divide_factor,
#   set_reduce_scatter_divide_factor, set_force_sum_reduction_for_comms (read into a new plan and schedule),
#   set_unshard_in_backward(False) (the compiled backward re-gathers only parameters it needs: refused where it
#   needs that module's, backend.py);
# * nothing to do under compile (no work of a compiled step is in flight when it returns, and its
#   collectives run after whatever the caller issued before): set_is_last_backward, set_post_optim_event;
# * refused, naming the setter (``_unsupported_settings``): the rest, when set away from FSDP2's default.
_DEFAULT_COMMS = ("DefaultAllGather", "DefaultReduceScatter")


def _unsupported_settings(settings: Settings) -> list[tuple[str, str]]:
    out = []
    if not settings.reshard_after_backward:
        out.append(("set_reshard_after_backward(False)", "keeps the parameters unsharded after backward"))
    if settings.reduce_scatter_unused_params:
        out.append(("set_reduce_scatter_unused_params(True)", "reduce-scatters zeros for unused parameters"))
    if settings.reduce_scatter_max_input_buffers != 1:
        out.append((f"set_reduce_scatter_max_input_buffers({settings.reduce_scatter_max_input_buffers})",
                    "sets FSDP2's own reduce-scatter scheduling (ours: CompileConfig.memory_budget_gb)"))
    comms = (settings.all_gather_comm, settings.reduce_scatter_comm)
    if comms != _DEFAULT_COMMS:
        out.append(("set_custom_all_gather / set_custom_reduce_scatter / set_symm_mem_for_comm / "
                    "set_allocate_memory_from_process_group_for_comm", f"replaced the collectives ({', '.join(comms)})"))
    if settings.separate_reduce_scatter_group:
        out.append(("set_separate_reduce_scatter_group(True)", "runs reduce-scatters on their own process group"))
    return out


def settings_key(groups) -> tuple[tuple[str, Settings], ...]:
    """What of FSDP2's runtime settings a compiled step depends on, for ``groups`` = ``[(fqn, state,
    param_group)]``: cheap to read at every call (attribute reads only)."""
    return tuple((fqn, _fsdp2.settings(state, pg)) for fqn, state, pg in groups)


def param_groups(model: nn.Module) -> list:
    """``[(group key, state, param group)]`` of every FSDP parameter group, in pre-order (``group_keys``)."""
    return [(key, state, pg) for fqn, _, state in fsdp_states(model)
            for key, pg in zip(group_keys(fqn, _fsdp2.param_groups(state)), _fsdp2.param_groups(state))]


def group_keys(fqn: str, pgs: list) -> list[str]:
    """The names of an FSDP module's parameter groups in the plan (``GroupPlan.fqn``), the schedule's units,
    the annotations and the setters' records: its FQN for its first group, so a module of one group is named
    as before; for each further one (``shard_placement_fn`` putting parameters on another mesh: torchtitan's
    routed experts on efsdp) FQN@its mesh's shard dim name (``"layers.1@efsdp"``), or @its index."""
    keys = [fqn]
    for i, pg in enumerate(pgs[1:], start=1):
        key = f"{fqn}@{_fsdp2.layout(pg).shard_dim_name or i}"
        keys.append(key if key not in keys else f"{fqn}@{i}")
    return keys[:len(pgs)]


def read_plan(model: nn.Module) -> ShardingPlan:
    lazy_init(model)
    canonical = {}
    for name, p in model.named_parameters():  # remove_duplicate=True: tied params keep one FQN
        canonical.setdefault(p, name)
    # a parameter is a matrix-product weight unless every module that owns it is an embedding (tied
    # embedding/output weights are both)
    lookup_only: dict[nn.Parameter, bool] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                lookup_only[p] = lookup_only.get(p, True) and isinstance(module, (nn.Embedding, nn.EmbeddingBag))
    module_names = {m: n for n, m in reversed(list(nn.Module.named_modules(model, remove_duplicate=False)))}
    states = fsdp_states(model)
    keys_of_state = {state: group_keys(fqn, _fsdp2.param_groups(state)) for fqn, _, state in states}
    groups = []
    devices = set()
    for fqn, module, state in states:
        pgs = _fsdp2.param_groups(state)
        if len(pgs) > 1 and any(inside(f, fqn) for f, _, _ in states):
            raise NotImplementedError(
                f"FSDP module {fqn or '<root>'!r} has {len(pgs)} parameter groups (per-parameter meshes from "
                "shard_placement_fn) and holds other FSDP modules: not supported under fsdp_compile.compile yet; "
                "give the other mesh's parameters an FSDP module of their own (fully_shard(submodule, mesh=...)), "
                "or use shard_placement_fn on modules that hold no FSDP module (torchtitan's MoE blocks)"
            )
        # FSDP2 gathers a module's groups in order and reduce-scatters them in reverse (the schedule's orders);
        # a state's forward prefetch is issued at its first group's start, its backward one at its last group's
        keys = group_keys(fqn, pgs)
        forward, backward = _fsdp2.prefetch(state)
        forward = tuple(k for s in forward for k in keys_of_state[s])
        backward = tuple(k for s in backward for k in reversed(keys_of_state[s]))
        for i, (key, pg) in enumerate(zip(keys, pgs)):
            layout = _fsdp2.layout(pg)
            group = _read_group(key, layout, _fsdp2.settings(state, pg), canonical, lookup_only, module_names,
                                _fsdp2.api(state))
            groups.append(dataclasses.replace(
                group, forward_prefetch=forward if i == 0 else (), backward_prefetch=backward if i == len(pgs) - 1 else ()))
            devices.add(layout.device)
    if len(devices) > 1:
        raise ValueError(f"FSDP groups live on different devices {sorted(map(str, devices))}; use one device per rank")
    if not groups:
        raise ValueError("the model's FSDP modules manage no parameters: nothing to shard or compile")
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    return ShardingPlan(_with_leading(_own_places(groups), names), devices.pop())


def _own_places(groups: list[GroupPlan]) -> list[GroupPlan]:
    """FSDP parameters sharing one sharded parameter (a tie made after ``fully_shard``, as torchtitan's
    ``init_states`` under TP): eager FSDP2 gathers each for its own modules and reduce-scatters each gradient
    on its own, so each keeps its own name (its first place) and places; every other parameter drops them."""
    count: dict[str, int] = {}
    for p in (p for g in groups for p in g.params):
        count[p.fqn] = count.get(p.fqn, 0) + 1
    return [dataclasses.replace(g, params=tuple(
        dataclasses.replace(p, fqn=p.places[0]) if count[p.fqn] > 1 and p.places else dataclasses.replace(p, places=())
        for p in g.params)) for g in groups]


def inside(fqn: str, outer: str) -> bool:
    """Whether module ``fqn`` lives inside module ``outer`` (and is not ``outer`` itself)."""
    return fqn != outer and (outer == "" or fqn.startswith(outer + "."))


def _with_leading(groups: list[GroupPlan], order: list[str]) -> tuple[GroupPlan, ...]:
    """``groups`` with ``leading`` set on those that hold other FSDP modules: their parameters that come
    before every parameter of those modules in ``order`` (``model.named_parameters()``)."""
    position = {fqn: i for i, fqn in enumerate(order)}
    out = []
    for g in groups:
        inner = [position[p.fqn] for h in groups if inside(h.fqn, g.fqn) for p in h.params]
        if inner:
            first = min(inner)
            g = dataclasses.replace(g, leading=tuple(p.fqn for p in g.params if position[p.fqn] < first))
        out.append(g)
    return tuple(out)


def _read_group(fqn: str, layout: _fsdp2.Layout, settings: Settings, canonical: dict, lookup_only: dict,
                module_names: dict, api: str = "fully_shard") -> GroupPlan:
    where = f"FSDP module {fqn or '<root>'!r}"
    offload = _fsdp2.offload_device(layout)
    if layout.mesh_kind not in ("fsdp", "hsdp", "ddp"):  # never an assertion from FSDP2's properties
        raise NotImplementedError(f"{where}: {api}(...) gave it FSDP2's {layout.mesh_kind}, which fsdp_compile.compile "
                                  "does not support (FSDPMeshInfo, HSDPMeshInfo, DDPMeshInfo); train it with eager FSDP2")
    if layout.replicate_only and layout.spmd_mesh:  # replicate(module, mesh=...) is compiled: see below
        fix = ("name a shard dim too (dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...))" if api == "fully_shard"
               else "pass the data-parallel mesh as mesh= (a 1-D mesh, no dp_mesh_dims)")
        raise NotImplementedError(
            f"{where}: {api}(..., dp_mesh_dims=DataParallelMeshDims(replicate=...)) without a shard dim "
            "(replicated parameters, all-reduced gradients: DDP) is not supported under fsdp_compile.compile yet; "
            f"{fix}, or train it with eager FSDP2"
        )
    post_forward = {}
    if layout.post_forward is not None:  # int reshard_after_forward: the post-forward group is N ranks of the shard group
        pf_group, n, pf_rank = layout.post_forward
        if pf_rank != layout.shard_mesh_rank % n:  # FSDP2's layout: mesh.view(-1, N)
            raise NotImplementedError(
                f"{where}: reshard_after_forward={n} with a post-forward group that is not N consecutive ranks of "
                "the shard group is not supported under fsdp_compile.compile; use True or False"
            )
        post_forward = dict(post_forward_group_name=pf_group.group_name, post_forward_size=n)
    if settings.all_reduce_hook:
        raise NotImplementedError(f"{where}: set_all_reduce_hook is not supported under fsdp_compile.compile yet")
    for setter, problem in _unsupported_settings(settings):
        raise NotImplementedError(
            f"{where}: {setter} {problem}, which fsdp_compile.compile does not support yet; set it back (or use "
            "eager FSDP2 for this model)"
        )
    # replicate (FSDP2's DDPMeshInfo) has no shard group: as FSDP2, a one-rank group (no all-gather, no reduce-scatter,
    # _one_rank) whose gradients are all-reduced over the replicate group, HSDP's path on a 1-wide shard dim
    group, replicate = layout.all_gather_group, layout.all_reduce_group
    world_size, rank = (group.size(), group.rank()) if group is not None else (1, 0)
    params = []
    for fp in layout.params:
        param = fp.sharded_param
        where_p = f"parameter {canonical.get(param, fp.fqn)!r}"
        if not isinstance(param, DTensor) or fp.placement != Shard(0):
            raise NotImplementedError(f"{where_p}: only Shard(0) placements are supported (got {fp.placement})")
        if param not in canonical:
            raise ValueError(f"{where_p} is managed by FSDP but not reachable by model.named_parameters()")
        local = param.to_local()
        full = fp.unsharded_shape  # the parameter's shape, or its TP/EP-local one (FSDP2 shards that)
        expected = rank_rows(full[0], world_size, rank)
        if local.shape[0] != expected or tuple(local.shape[1:]) != full[1:]:
            raise ValueError(f"{where_p}: local shard {tuple(local.shape)} does not match FSDP2's dim-0 layout of {full} over {world_size} ranks")
        matmul = len(full) >= 2 and not lookup_only.get(param, False)
        parallel = None
        if fp.unsharded_spec is not None:
            if layout.post_forward is not None:  # FSDP2's own to_sharded_post_forward refuses DTensor parameters
                raise NotImplementedError(
                    f"{where}: reshard_after_forward={post_forward['post_forward_size']} (an int) with {where_p} a "
                    "DTensor of tensor or expert parallelism: FSDP2 itself does not support resharding those to a "
                    "smaller mesh after forward; use reshard_after_forward=True or False"
                )
            parallel = parallel_spec(where_p, fp.unsharded_spec, fp.dp_dims, fp.spmd_grad_placements)
        extension = None
        if fp.all_gather_extension and layout.spmd_mesh:
            raise NotImplementedError(
                f"{where_p}: an all-gather extension ({type(local).__name__}) with fully_shard(..., dp_mesh_dims=...) "
                "is not supported under fsdp_compile.compile yet; pass the data-parallel mesh as mesh= instead"
            )
        if fp.all_gather_extension and offload:  # FSDP2 would run fsdp_pre_all_gather on the copied shard
            raise NotImplementedError(
                f"{where_p}: an all-gather extension ({type(local).__name__}) with offload_policy=CPUOffloadPolicy() "
                f"on {offload} is not supported under fsdp_compile.compile yet; train it with eager FSDP2, or drop the offload")
        if fp.all_gather_extension:
            from fsdp_compile import _extensions

            extension = _extensions.read_spec(where_p, local, fp.pre_all_gather_args, layout.post_forward is not None,
                                              world_size)
        places = tuple(f"{module_names[m]}.{a}".lstrip(".") for m, a in fp.places if m in module_names)
        params.append(ParamPlan(canonical[param], full, local.shape[0], param.dtype, param.requires_grad, matmul,
                                parallel, extension, places))
    trainable = [p for p in layout.params if p.sharded_param.requires_grad]
    param_dtype = next((p.param_dtype for p in layout.params if p.param_dtype is not None), None)
    grad_dtype = param_dtype or (trainable[0].orig_dtype if trainable else None)
    reduce_dtype = layout.reduce_dtype or grad_dtype
    pre = post = None
    reduce_op_name, all_reduce_op = "sum", "sum"
    if reduce_dtype is not None:
        pre, post, op, ar_op = _fsdp2.gradient_divide_factors(
            group, replicate, reduce_dtype, layout.device.type, settings.gradient_divide_factor,
            settings.force_sum_reduction_for_comms,
        )
        if op == dist.ReduceOp.AVG:
            reduce_op_name = "avg"
        elif op == dist.ReduceOp.SUM:
            reduce_op_name = "sum"
        else:  # PREMUL_SUM(1 / factor): FSDP2's custom gradient_divide_factor
            reduce_op_name, pre = "premul_sum", 1.0 / settings.gradient_divide_factor
        all_reduce_op = "avg" if ar_op == dist.ReduceOp.AVG else "sum"
    return GroupPlan(
        fqn=fqn,
        params=tuple(params),
        group_name=(group if group is not None else replicate).group_name,
        world_size=world_size,
        reshard_after_forward=settings.reshard_after_forward,
        unshard_in_backward=settings.unshard_in_backward,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reduce_op=reduce_op_name,
        pre_factor=pre,
        post_factor=post,
        replicate_group_name=None if replicate is None else replicate.group_name,
        replicate_size=1 if replicate is None else replicate.size(),
        all_reduce_op=all_reduce_op,
        mesh_dims=(layout.shard_dim_name or layout.replicate_dim_name or "dp", layout.replicate_dim_name or "replicate"),
        offload=offload,
        offload_pinned=offload is not None and layout.offload_pinned,
        **post_forward,
    )
