"""``ShardingPlan``: the FSDP2 layout of a model read into plain data.

Everything the capture needs to reproduce FSDP2's eager semantics in one graph: the FSDP groups in
module pre-order, each group's parameters (by FQN), its process group, ``reshard_after_forward`` and
mixed-precision policy, and the gradient reduction FSDP2 would use. Options that the capture does
not implement yet are rejected here with ``NotImplementedError`` naming the option, before any trace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from fsdp_compile._layout import padded_rows, rank_rows


@dataclasses.dataclass(frozen=True)
class ParamPlan:
    fqn: str  # first FQN in ``model.named_parameters()``; tied aliases resolve to it
    full_shape: tuple[int, ...]
    local_rows: int  # this rank's unpadded dim-0 rows (0 for ranks past the end)
    orig_dtype: torch.dtype
    requires_grad: bool
    matmul: bool  # a weight of matrix products (2-D or more, and not only an embedding table): the cost model's FLOPs


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """One FSDP parameter group: one all-gather in forward, one reduce-scatter in backward (as eager)."""

    fqn: str  # the FSDP module's FQN ("" for the root)
    params: tuple[ParamPlan, ...]
    group_name: str  # c10d process group name used by the functional collectives
    world_size: int
    rank: int
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
    post_forward_rank: int = 0  # this rank's index in its post-forward group
    forward_prefetch: tuple[str, ...] = ()  # FSDP2's set_modules_to_forward_prefetch: FQNs gathered at our pre-forward
    backward_prefetch: tuple[str, ...] = ()  # ... set_modules_to_backward_prefetch

    @property
    def unsharded_bytes(self) -> int:
        """Bytes one all-gather of this group moves: every parameter padded to W rows, in ``param_dtype``."""
        return sum(_padded_numel(p.full_shape, self.world_size) * (self.param_dtype or p.orig_dtype).itemsize for p in self.params)

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

    def bucket_key(self) -> tuple:
        """Groups with equal keys can share one all-gather and one reduce-scatter."""
        orig_dtype = self.params[0].orig_dtype  # FSDP2 requires one original dtype per group
        return (self.group_name, self.world_size, self.reshard_after_forward, orig_dtype, self.param_dtype,
                self.reduce_dtype, self.reduce_op, self.pre_factor, self.post_factor, self.replicate_group_name,
                self.all_reduce_op, self.post_forward_group_name)


def _padded_numel(shape: tuple[int, ...], world_size: int) -> int:
    return padded_rows(shape[0], world_size) * world_size * math.prod(shape[1:])


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    groups: tuple[GroupPlan, ...]
    device: torch.device  # where the parameters live (one device per rank)

    def fingerprint(self) -> list[tuple]:
        """The rank-independent part of the plan: what every rank must agree on to issue the same
        collectives in the same order (local shard sizes and the rank itself may differ)."""
        # process groups by size, not name: HSDP's shard groups differ between replicas by name only
        return [
            (g.fqn, g.world_size, g.reshard_after_forward, str(g.param_dtype), str(g.reduce_dtype),
             g.reduce_op, g.pre_factor, g.post_factor, g.replicate_size, g.all_reduce_op, g.post_forward_size,
             g.forward_prefetch, g.backward_prefetch,
             tuple((p.fqn, p.full_shape, str(p.orig_dtype), p.requires_grad, p.matmul) for p in g.params))
            for g in self.groups
        ]

    def process_group_names(self) -> list[str]:
        """Every process group the plan's collectives run on (shard groups; HSDP's replicate groups too)."""
        names = [g.group_name for g in self.groups]
        names += [n for g in self.groups for n in (g.replicate_group_name, g.post_forward_group_name) if n]
        return list(dict.fromkeys(names))

    def has_fsdp_children(self, fqn: str) -> bool:
        """Whether other FSDP modules live inside module ``fqn`` (the root, usually)."""
        prefix = fqn + "." if fqn else ""
        return any(g.fqn != fqn and g.fqn.startswith(prefix) for g in self.groups)

    def group(self, fqn: str) -> GroupPlan:
        for g in self.groups:
            if g.fqn == fqn:
                return g
        raise KeyError(f"no FSDP module {fqn!r}; FSDP modules: {[g.fqn for g in self.groups]}")


def fsdp_states(model: nn.Module):
    """``(fqn, module, state)`` for every FSDP state, in pre-order: one per ``fully_shard`` call, named by
    its first module (``fully_shard([m1, m2])`` shards several modules as one group)."""
    out, seen = [], set()
    for fqn, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            if id(state) not in seen:
                seen.add(id(state))
                out.append((fqn, module, state))
    return out


def lazy_init(model: nn.Module) -> None:
    """Run FSDP2's lazy init eagerly (it normally runs in the first forward's pre-hook)."""
    states = fsdp_states(model)
    if not states:
        raise ValueError(
            f"{type(model).__name__} has no module sharded by fully_shard: call "
            "fsdp_compile.fully_shard (or torch.distributed.fsdp.fully_shard) on each block and then on "
            "the root before fsdp_compile.compile"
        )
    outer: list[str] = []
    for fqn, _, state in states:  # pre-order: an outermost FSDP module comes before its children
        if not any(o == "" or fqn == o or fqn.startswith(o + ".") for o in outer):
            with _allow_meta_params(model):
                state._lazy_init()  # idempotent; makes this state the root of its subtree, as its forward would
            outer.append(fqn)


@contextlib.contextmanager
def _allow_meta_params(model: nn.Module):
    """FSDP2's lazy init refuses meta parameters (they must be materialized before training). A model
    entirely on the meta device is still worth capturing: ``explain`` runs it on meta tensors to report
    collectives, buckets and costs at full scale with no memory. Mixed meta/real models still fail."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    if not all(p.is_meta for p in model.parameters()):
        yield
        return
    original = FSDPParamGroup._validate_no_meta_params
    FSDPParamGroup._validate_no_meta_params = lambda self: None
    try:
        yield
    finally:
        FSDPParamGroup._validate_no_meta_params = original


# FSDP2's runtime setters (FSDPModule.set_*) under compile. ``settings_key`` is read at every compiled call:
# a change takes effect at the next call, on every rank together (they are SPMD calls), never silently.
# * honored: set_requires_gradient_sync (a mode of the compiled step: no reduce-scatter, unsharded gradients
#   accumulated as FSDP2 does), set_reshard_after_forward, set_modules_to_forward_prefetch,
#   set_modules_to_backward_prefetch, set_gradient_divide_factor, set_reduce_scatter_divide_factor,
#   set_force_sum_reduction_for_comms (read into a new plan and schedule);
# * nothing to do under compile (no work of a compiled step is in flight when it returns, and its
#   collectives run after whatever the caller issued before): set_is_last_backward, set_post_optim_event;
# * refused, naming the setter (``_unsupported_settings``): the rest, when set away from FSDP2's default.
_DEFAULT_COMMS = ("DefaultAllGather", "DefaultReduceScatter")


def _unsupported_settings(pg) -> list[tuple[str, str]]:
    out = []
    if not pg.reshard_after_backward:
        out.append(("set_reshard_after_backward(False)", "keeps the parameters unsharded after backward"))
    if pg._is_hsdp and not pg.all_reduce_grads:
        out.append(("set_requires_all_reduce(False)", "defers HSDP's all-reduce (partial reductions)"))
    if not pg.unshard_in_backward:
        out.append(("set_unshard_in_backward(False)", "skips the re-gather in backward"))
    if pg.reduce_scatter_unused_params:
        out.append(("set_reduce_scatter_unused_params(True)", "reduce-scatters zeros for unused parameters"))
    if pg.reduce_scatter_max_input_buffers != 1:
        out.append((f"set_reduce_scatter_max_input_buffers({pg.reduce_scatter_max_input_buffers})",
                    "sets FSDP2's own reduce-scatter scheduling (ours: CompileConfig.memory_budget_gb)"))
    comms = (type(pg._all_gather_comm).__name__, type(pg._reduce_scatter_comm).__name__)
    if comms != _DEFAULT_COMMS:
        out.append(("set_custom_all_gather / set_custom_reduce_scatter / set_symm_mem_for_comm / "
                    "set_allocate_memory_from_process_group_for_comm", f"replaced the collectives ({', '.join(comms)})"))
    if pg._reduce_scatter_process_group is not pg._all_gather_process_group:
        out.append(("set_separate_reduce_scatter_group(True)", "runs reduce-scatters on their own process group"))
    return out


def settings_key(groups) -> tuple:
    """What of FSDP2's runtime settings a compiled step depends on, for ``groups`` = ``[(fqn, state,
    param_group)]``: cheap to read at every call (attribute reads only)."""
    return tuple(
        (fqn, pg.reduce_grads, pg.all_reduce_grads, pg.reshard_after_backward, pg.post_forward_mesh_info is not None,
         pg._use_post_forward_mesh, pg.gradient_divide_factor, pg.force_sum_reduction_for_comms,
         pg.reduce_scatter_unused_params, pg.reduce_scatter_max_input_buffers, pg.unshard_in_backward,
         type(pg._all_gather_comm).__name__, type(pg._reduce_scatter_comm).__name__, pg._all_reduce_hook is not None,
         pg._reduce_scatter_process_group is pg._all_gather_process_group,
         tuple(id(s) for s in state._states_to_forward_prefetch), tuple(id(s) for s in state._states_to_backward_prefetch))
        for fqn, state, pg in groups
    )


def param_groups(model: nn.Module) -> list:
    """``[(fqn, state, param group)]`` of every FSDP module that manages parameters, in pre-order."""
    return [(fqn, state, state._fsdp_param_groups[0]) for fqn, _, state in fsdp_states(model) if state._fsdp_param_groups]


def check_ranks_agree(plan: ShardingPlan, config_items: list[tuple[str, object]] = ()) -> None:
    """Compare ``plan.fingerprint()`` and the config across the ranks of every process group the plan's
    collectives use, once, before the first trace.

    Ranks that shard different models, or compile with different settings, would issue different
    collectives inside the compiled graphs and block until the process group's timeout, or exchange the
    wrong bytes; this turns that into an error on every rank that names the first difference. It
    compares within each FSDP process group, not the whole world: ranks outside it (another pipeline
    stage, say) may hold another model. Tensor collectives only (``_agree``), bounded by the process
    group's timeout. Skipped on the fake process group (no peers).
    """
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return
    from torch.distributed.distributed_c10d import _resolve_process_group

    from fsdp_compile._agree import check_same

    items = [(f"FSDP group {entry[0] or '<root>'!r}", entry) for entry in plan.fingerprint()]
    items.insert(0, ("the number of FSDP groups", len(items)))
    for name in plan.process_group_names():
        group = _resolve_process_group(name)
        if group.size() > 1:
            check_same(
                "the fsdp_compile.CompileConfig", list(config_items), group, plan.device,
                "every rank must pass the same settings to fsdp_compile.compile",
            )
            check_same(
                "the sharded model", items, group, plan.device,
                "every rank must build the same model and call fully_shard the same way before fsdp_compile.compile",
            )


def _check_composable_checkpoint(model: nn.Module) -> None:
    """``torch.distributed._composable.checkpoint(block)`` runs its recompute from forward hooks that
    Dynamo refuses to trace (``_checkpoint_without_reentrant_generator`` is marked skipped; plain
    ``torch.compile(fullgraph=True)`` fails the same way): refused here, naming the traceable forms."""
    from torch.distributed._composable.contract import _get_registry

    for name, module in model.named_modules():
        if "checkpoint" in (_get_registry(module) or {}):
            raise NotImplementedError(
                f"module {name or '<root>'!r} is checkpointed with torch.distributed._composable.checkpoint, "
                "whose hooks torch.compile cannot trace: wrap the block with checkpoint_wrapper "
                "(torch.distributed.algorithms._checkpoint.checkpoint_wrapper) before fully_shard, or call "
                "torch.utils.checkpoint.checkpoint(block, ..., use_reentrant=False) in its parent's forward"
            )


def read_plan(model: nn.Module) -> ShardingPlan:
    _check_composable_checkpoint(model)
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
    states = fsdp_states(model)
    fqn_of_state = {state: fqn for fqn, _, state in states}
    groups = []
    devices = set()
    for fqn, module, state in states:
        param_groups = state._fsdp_param_groups
        if len(param_groups) > 1:
            raise NotImplementedError(
                f"FSDP module {fqn!r} has {len(param_groups)} parameter groups (per-parameter meshes from "
                "shard_placement_fn): not supported under fsdp_compile.compile yet"
            )
        if not param_groups:
            continue
        pg = param_groups[0]
        group = _read_group(fqn, pg, canonical, lookup_only)
        groups.append(dataclasses.replace(
            group,
            forward_prefetch=tuple(fqn_of_state[s] for s in state._states_to_forward_prefetch),
            backward_prefetch=tuple(fqn_of_state[s] for s in state._states_to_backward_prefetch),
        ))
        devices.add(pg.device)
    if len(devices) > 1:
        raise ValueError(f"FSDP groups live on different devices {sorted(map(str, devices))}; use one device per rank")
    if not groups:
        raise ValueError("the model's FSDP modules manage no parameters: nothing to shard or compile")
    return ShardingPlan(tuple(groups), devices.pop())


def _read_group(fqn: str, pg, canonical: dict, lookup_only: dict) -> GroupPlan:
    where = f"FSDP module {fqn or '<root>'!r}"
    if isinstance(pg.offload_policy, CPUOffloadPolicy) and pg.device.type != "cpu":
        # On a CPU device the offloaded shards, gradients and optimizer state already live where compute
        # does (FSDP2's host copies are no-ops), so the compiled step is FSDP2's; on an accelerator the graph
        # would need the host-device copies around each collective, which is not built yet.
        raise NotImplementedError(
            f"{where}: offload_policy=CPUOffloadPolicy() on {pg.device.type} is not supported under "
            "fsdp_compile.compile yet (it is on CPU devices); train it with eager FSDP2, or drop the offload"
        )
    mesh_info = pg.mesh_info
    if not isinstance(mesh_info, FSDPMeshInfo) or mesh_info.is_spmd_mesh:
        raise NotImplementedError(
            f"{where}: fully_shard(..., dp_mesh_dims=...) (parameters on a larger SPMD mesh, or a replicate-only "
            "mesh) is not supported under fsdp_compile.compile yet; "
            "pass the data-parallel mesh itself as mesh= (1-D, or 2-D replicate x shard for HSDP)"
        )
    post_forward = {}
    if pg._use_post_forward_mesh:  # int reshard_after_forward: the post-forward group is N ranks of the shard group
        pf = pg.post_forward_mesh_info
        n = pf.shard_mesh_size
        if pf.shard_mesh_rank != mesh_info.shard_mesh_rank % n:  # FSDP2's layout: mesh.view(-1, N)
            raise NotImplementedError(
                f"{where}: reshard_after_forward={n} with a post-forward group that is not N consecutive ranks of "
                "the shard group is not supported under fsdp_compile.compile; use True or False"
            )
        post_forward = dict(post_forward_group_name=pf.shard_process_group.group_name, post_forward_size=n,
                            post_forward_rank=pf.shard_mesh_rank)
    if pg._all_reduce_hook is not None:
        raise NotImplementedError(f"{where}: set_all_reduce_hook is not supported under fsdp_compile.compile yet")
    for setter, problem in _unsupported_settings(pg):
        raise NotImplementedError(
            f"{where}: {setter} {problem}, which fsdp_compile.compile does not support yet; set it back (or use "
            "eager FSDP2 for this model)"
        )
    group = pg._all_gather_process_group
    if group is not pg._reduce_scatter_process_group:
        raise NotImplementedError(f"{where}: a separate reduce-scatter process group is not supported yet")
    world_size = group.size()
    params = []
    for fp in pg.fsdp_params:
        param = fp.sharded_param
        where_p = f"parameter {canonical.get(param, fp._param_fqn)!r}"
        if getattr(fp, "is_dtensor", False):
            raise NotImplementedError(
                f"{where_p} was already a DTensor before fully_shard (tensor or expert parallelism, a 2-D mesh): "
                "FSDP combined with it is not supported under fsdp_compile.compile yet; train it with eager "
                "FSDP2 (or torch.compile on its blocks)"
            )
        if not isinstance(param, DTensor) or fp.fsdp_placement != Shard(0):
            raise NotImplementedError(f"{where_p}: only Shard(0) placements are supported (got {fp.fsdp_placement})")
        if getattr(fp, "_extensions_data", None) is not None and hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
            raise NotImplementedError(f"{where_p}: tensor subclasses with fsdp_pre_all_gather are not supported yet")
        if param not in canonical:
            raise ValueError(f"{where_p} is managed by FSDP but not reachable by model.named_parameters()")
        local = param.to_local()
        full = tuple(param.shape)
        expected = rank_rows(full[0], world_size, group.rank())
        if local.shape[0] != expected or tuple(local.shape[1:]) != full[1:]:
            raise ValueError(f"{where_p}: local shard {tuple(local.shape)} does not match FSDP2's dim-0 layout of {full} over {world_size} ranks")
        matmul = len(full) >= 2 and not lookup_only.get(param, False)
        params.append(ParamPlan(canonical[param], full, local.shape[0], param.dtype, param.requires_grad, matmul))
    trainable = [p for p in pg.fsdp_params if p.sharded_param.requires_grad]
    param_dtype = next((p.param_dtype for p in pg.fsdp_params if p.param_dtype is not None), None)
    grad_dtype = param_dtype or (trainable[0].orig_dtype if trainable else None)
    reduce_dtype = pg._reduce_dtype or grad_dtype
    pre = post = None
    reduce_op_name, all_reduce_op = "sum", "sum"
    replicate = pg._all_reduce_process_group if pg._is_hsdp else None  # HSDP: all-reduce after the reduce-scatter
    if reduce_dtype is not None:
        pre, post, op, ar_op = _get_gradient_divide_factors(
            group, replicate, reduce_dtype, pg.device.type, pg.gradient_divide_factor, pg.force_sum_reduction_for_comms
        )
        if op == dist.ReduceOp.AVG:
            reduce_op_name = "avg"
        elif op == dist.ReduceOp.SUM:
            reduce_op_name = "sum"
        else:  # PREMUL_SUM(1 / factor): FSDP2's custom gradient_divide_factor
            reduce_op_name, pre = "premul_sum", 1.0 / pg.gradient_divide_factor
        all_reduce_op = "avg" if ar_op == dist.ReduceOp.AVG else "sum"
    return GroupPlan(
        fqn=fqn,
        params=tuple(params),
        group_name=group.group_name,
        world_size=world_size,
        rank=group.rank(),
        reshard_after_forward=pg._reshard_after_forward,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        reduce_op=reduce_op_name,
        pre_factor=pre,
        post_factor=post,
        replicate_group_name=None if replicate is None else replicate.group_name,
        replicate_size=1 if replicate is None else replicate.size(),
        all_reduce_op=all_reduce_op,
        **post_forward,
    )
