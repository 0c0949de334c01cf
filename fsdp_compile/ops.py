"""The ``fsdp_compile::`` ops: FSDP2's unshard and gradient reduce-scatter, functional and differentiable.

``unshard(shards, ...)`` turns one FSDP group's local dim-0 shards into its full parameters::

    copy-in (pad each shard to ceil(d/W) rows, cast to param_dtype, concatenate)
      -> _c10d_functional.all_gather_into_tensor -> wait_tensor
      -> copy-out (rank-major view, trim the padding)

and its backward is ``reduce_scatter_grads(grads, ...)``::

    pack (pad each grad to W*ceil(d/W) rows, cast to reduce_dtype, rank-major concatenation)
      -> _c10d_functional.reduce_scatter_tensor(avg | sum) -> wait_tensor
      -> unpack (this rank's unpadded rows, post-divide, cast to the parameter's dtype)

Both are opaque to Dynamo (one node per FSDP group in the Dynamo graph, where the group structure is
still visible) and decomposed by AOTAutograd through ``DECOMPOSITIONS`` into the functional collectives
above, so the joint/forward/backward graphs hold plain ``_c10d_functional`` ops that Inductor and our
passes understand. The eager kernels run the same decomposition, so calling the ops outside ``compile``
gives the same numbers.

The numerics follow FSDP2 exactly (``_fsdp_collectives.foreach_reduce`` and
``_get_gradient_divide_factors``): fp32/bf16 reduce with ``avg``; other reduce dtypes (fp16) divide by
``pre`` before and ``post`` after a ``sum``; a user divide factor is applied as a pre-multiply, as
NCCL's ``PREMUL_SUM`` does. No rank is baked into the graphs: every rank-dependent size comes from the
shard shapes, so graphs of evenly sharded models are identical on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from fsdp_compile._annotations import REDUCE_SCATTER, UNSHARD, annotate
from fsdp_compile._layout import inner_numel, padded_rows

_c10d = torch.ops._c10d_functional


# --- the ops' arguments: one typed record each, converted to and from the op schema here only ----------


@dataclasses.dataclass(frozen=True)
class Comm:
    """Where and how one FSDP collective runs."""

    fsdp_groups: tuple[str, ...]  # the FSDP module FQNs it serves ("" for the root): the annotation the passes read
    unit: int  # its unit in the schedule (``passes.schedule``): how the passes find it in every graph
    group_name: str  # the c10d process group the functional collective runs on
    world_size: int
    rank: int  # read only by the Triton copy kernels (the torch copies take it from the shard shapes)
    kernels: str  # "torch" (copies traced as torch ops) | "triton" (fsdp_compile.kernels, one launch each)


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How gradients are reduced, as FSDP2's ``foreach_reduce`` does: used by the backward only."""

    dtype: torch.dtype | None  # reduce-scatter dtype; None: the gradient's own
    op: str  # "avg" | "sum" | "premul_sum"
    pre_factor: float | None  # divisor before a "sum", multiplier for "premul_sum"
    post_factor: float | None  # divisor after the reduce-scatter (and HSDP's all-reduce)
    all_reduce_group: str | None = None  # HSDP: the replicate dimension's process group, all-reduced after the RS
    all_reduce_op: str = "avg"  # HSDP: "avg" | "sum"


def _to_schema(comm: Comm, sizes: tuple[int, ...], dtype: torch.dtype | None, reduction: Reduction) -> tuple:
    """Both ops' arguments after their tensor list, in schema order: one list of sizes, the ``Comm``, one
    dtype, the ``Reduction``. The records below keep their fields in that order."""
    # FQNs never hold a comma, and a schema has no list of strings: the members travel joined
    return (list(sizes), ",".join(comm.fsdp_groups), comm.unit, comm.group_name, comm.world_size, comm.rank,
            comm.kernels, dtype, reduction.dtype, reduction.op, reduction.pre_factor, reduction.post_factor,
            reduction.all_reduce_group or "", reduction.all_reduce_op)


def _from_schema(sizes, fsdp_groups, unit, group_name, world_size, rank, kernels, dtype, reduce_dtype, reduce_op,
                 pre_factor, post_factor, all_reduce_group, all_reduce_op) -> tuple:
    return (Comm(tuple(fsdp_groups.split(",")), unit, group_name, world_size, rank, kernels), tuple(sizes), dtype,
            Reduction(reduce_dtype, reduce_op, pre_factor, post_factor, all_reduce_group or None, all_reduce_op))


@dataclasses.dataclass(frozen=True)
class UnshardArgs:
    """Everything ``fsdp_compile::unshard`` takes besides the local shards."""

    comm: Comm
    dim0s: tuple[int, ...]  # each parameter's unsharded dim-0 size (the rest of its shape: the shard's)
    param_dtype: torch.dtype | None  # all-gather and compute dtype; None: the parameter's own
    reduction: Reduction  # parametrizes the backward (reduce_scatter_grads)

    def schema(self) -> tuple:
        return _to_schema(self.comm, self.dim0s, self.param_dtype, self.reduction)

    @classmethod
    def from_schema(cls, *schema) -> UnshardArgs:
        return cls(*_from_schema(*schema))


@dataclasses.dataclass(frozen=True)
class ReduceScatterArgs:
    """Everything ``fsdp_compile::reduce_scatter_grads`` takes besides the full-size gradients."""

    comm: Comm
    local_rows: tuple[int, ...]  # this rank's unpadded rows of each parameter (0 past the end)
    orig_dtype: torch.dtype  # the sharded parameter's dtype: the shard gradients come back in it
    reduction: Reduction  # reduction.dtype is resolved (never None here)

    def schema(self) -> tuple:
        return _to_schema(self.comm, self.local_rows, self.orig_dtype, self.reduction)

    @classmethod
    def from_schema(cls, *schema) -> ReduceScatterArgs:
        return cls(*_from_schema(*schema))


# --- the decompositions: what the compiled graphs hold ------------------------------------------------


def _copy_in(shards: Sequence[Tensor], dim0s: Sequence[int], world_size: int, dtype) -> Tensor:
    # out: [sum(n_i)], n_i = ceil(d_i / W) * prod(S_i[1:])
    flats = []
    for shard, d in zip(shards, dim0s):
        c = padded_rows(d, world_size)
        x = shard.to(dtype) if dtype is not None else shard
        if x.shape[0] != c:  # uneven dim-0 sharding: zero rows at the end, as FSDP2 pads
            x = torch.constant_pad_nd(x, [0, 0] * (x.dim() - 1) + [0, c - x.shape[0]])
        flats.append(x.reshape(-1))
    return torch.cat(flats) if len(flats) > 1 else flats[0].clone()


def _copy_out(gathered: Tensor, shards: Sequence[Tensor], dim0s: Sequence[int], world_size: int) -> list[Tensor]:
    # gathered: [W * sum(n_i)], rank-major; returns each full parameter [d_i, *S_i[1:]]
    per_rank = gathered.view(world_size, -1)
    outs, offset = [], 0
    for shard, d in zip(shards, dim0s):
        c = padded_rows(d, world_size)
        tail = tuple(shard.shape[1:])
        n = c * inner_numel((c, *tail))
        full = per_rank[:, offset : offset + n].reshape(world_size * c, *tail)
        outs.append(full[:d] if world_size * c != d else full)
        offset += n
    return outs


def unshard_impl(shards: list[Tensor], args: UnshardArgs) -> list[Tensor]:
    """copy-in -> all-gather -> wait -> copy-out, every node annotated with the FSDP group."""
    c = args.comm
    with annotate(UNSHARD, c.fsdp_groups, c.unit):
        if c.kernels == "triton":  # one launch each for copy-in and copy-out (fsdp_compile.kernels)
            from fsdp_compile import kernels as K

            full_shapes = [(d, *s.shape[1:]) for s, d in zip(shards, args.dim0s)]
            flat = K.all_gather_copy_in(shards, full_shapes, c.world_size, c.rank, dtype=args.param_dtype, impl="triton")
            gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(flat, c.world_size, c.group_name))
            return K.all_gather_copy_out(gathered, full_shapes, c.world_size, impl="triton")
        # torch ops, traced into the graph: Inductor fuses them with their neighbours
        flat = _copy_in(shards, args.dim0s, c.world_size, args.param_dtype)
        gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(flat, c.world_size, c.group_name))
        return _copy_out(gathered, shards, args.dim0s, c.world_size)


def reduce_scatter_grads_impl(grads: list[Tensor], args: ReduceScatterArgs) -> list[Tensor]:
    """pack -> reduce-scatter -> wait -> unpack, with FSDP2's divide factors, annotated like the unshard."""
    c, r = args.comm, args.reduction
    with annotate(REDUCE_SCATTER, c.fsdp_groups, c.unit):
        if c.kernels == "triton":
            from fsdp_compile import kernels as K

            packed = K.reduce_scatter_copy_in(grads, c.world_size, dtype=r.dtype, impl="triton")
        else:
            packed = _pack_grads(grads, c.world_size, r.dtype)
        op = r.op
        if op == "premul_sum":  # NCCL's PREMUL_SUM: scale each input, then sum
            packed, op = packed * r.pre_factor, "sum"
        elif r.pre_factor is not None:
            packed = packed / r.pre_factor
        if c.world_size > 1:
            reduced = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(packed, op, c.world_size, c.group_name))
        else:
            reduced = packed.clone()
        if r.all_reduce_group is not None:  # HSDP: then across the replicas, as FSDP2's foreach_reduce
            reduced = _c10d.wait_tensor(_c10d.all_reduce(reduced, r.all_reduce_op, r.all_reduce_group))
        if r.post_factor is not None:
            reduced = reduced / r.post_factor
        if c.kernels == "triton":
            full_shapes = [tuple(g.shape) for g in grads]
            return K.reduce_scatter_copy_out(reduced, full_shapes, c.world_size, c.rank, dtype=args.orig_dtype, impl="triton")
        return _unpack_grads(reduced, grads, args.local_rows, c.world_size, args.orig_dtype)


def _pack_grads(grads: Sequence[Tensor], world_size: int, dtype: torch.dtype) -> Tensor:
    # packed: [W * sum(n_i)]; rank r's chunk holds rows [r*c_i, (r+1)*c_i) of every grad i (FSDP2's chunk_cat)
    chunks = []
    for g in grads:
        d = g.shape[0]
        c = padded_rows(d, world_size)
        x = g.to(dtype)
        if world_size * c != d:
            x = torch.constant_pad_nd(x, [0, 0] * (x.dim() - 1) + [0, world_size * c - d])
        chunks.append(x.reshape(world_size, -1))
    return torch.cat(chunks, dim=1).reshape(-1) if len(chunks) > 1 else chunks[0].reshape(-1)


def _unpack_grads(reduced: Tensor, grads, local_rows, world_size: int, dtype: torch.dtype) -> list[Tensor]:
    # reduced: [sum(n_i)], this rank's chunk; returns each shard gradient with its unpadded local rows
    outs, offset = [], 0
    for g, rows in zip(grads, local_rows):
        c = padded_rows(g.shape[0], world_size)
        tail = tuple(g.shape[1:])
        n = c * inner_numel((c, *tail))
        shard = reduced[offset : offset + n].view(c, *tail)
        if rows != c:
            shard = shard[:rows]
        outs.append(shard.to(dtype))
        offset += n
    return outs


# --- the ops -------------------------------------------------------------------------------------------
# Eager calls only (compiled graphs use DECOMPOSITIONS): a custom op's outputs may not alias each other or
# its inputs, and the decompositions' outputs are views of one buffer, hence the clones.


@torch.library.custom_op("fsdp_compile::unshard", mutates_args=())
def unshard(
    shards: list[Tensor], sinks: list[Optional[Tensor]], accumulated: list[Optional[Tensor]], dim0s: list[int],
    fsdp_groups: str, unit: int, group_name: str, world_size: int, rank: int, kernels: str,
    param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None, reduce_op: str, pre_factor: float | None,
    post_factor: float | None, all_reduce_group: str, all_reduce_op: str,
) -> list[Tensor]:
    """All-gather one unit's dim-0 shards into full parameters (see the module docstring). The arguments
    after ``accumulated`` are ``UnshardArgs.schema()``; the reduce-side ones parametrize the backward.

    Gradient accumulation without sync (FSDP2's ``set_requires_gradient_sync(False)``): ``sinks`` (one per
    parameter, empty otherwise) are leaves that own no memory; the backward then hands them the unsharded
    gradients instead of reduce-scattering, and autograd accumulates them into ``sink.grad`` in the sink's
    dtype (the reduce dtype), as FSDP2 keeps its unsharded gradients. The step that syncs passes those as
    ``accumulated``: its backward adds them to its own before the reduce-scatter, as FSDP2 does."""
    args = UnshardArgs.from_schema(dim0s, fsdp_groups, unit, group_name, world_size, rank, kernels, param_dtype,
                                   reduce_dtype, reduce_op, pre_factor, post_factor, all_reduce_group, all_reduce_op)
    return [t.clone() for t in unshard_impl(shards, args)]


@unshard.register_fake
def _(shards, sinks, accumulated, dim0s, fsdp_groups, unit, group_name, world_size, rank, kernels, param_dtype, *reduction):
    return [s.new_empty((d, *s.shape[1:]), dtype=param_dtype or s.dtype) for s, d in zip(shards, dim0s)]


@torch.library.custom_op("fsdp_compile::reduce_scatter_grads", mutates_args=())
def reduce_scatter_grads(
    grads: list[Tensor], local_rows: list[int], fsdp_groups: str, unit: int, group_name: str, world_size: int,
    rank: int, kernels: str, orig_dtype: torch.dtype, reduce_dtype: torch.dtype, reduce_op: str,
    pre_factor: float | None, post_factor: float | None, all_reduce_group: str, all_reduce_op: str,
) -> list[Tensor]:
    """Reduce-scatter full-parameter gradients into this rank's shard gradients (FSDP2's post-backward).
    The arguments after ``grads`` are ``ReduceScatterArgs.schema()``."""
    args = ReduceScatterArgs.from_schema(local_rows, fsdp_groups, unit, group_name, world_size, rank, kernels,
                                         orig_dtype, reduce_dtype, reduce_op, pre_factor, post_factor,
                                         all_reduce_group, all_reduce_op)
    return [t.clone() for t in reduce_scatter_grads_impl(grads, args)]


@reduce_scatter_grads.register_fake
def _(grads, local_rows, fsdp_groups, unit, group_name, world_size, rank, kernels, orig_dtype, *reduction):
    return [g.new_empty((rows, *g.shape[1:]), dtype=orig_dtype) for g, rows in zip(grads, local_rows)]


@torch.library.custom_op("fsdp_compile::post_forward_shard", mutates_args=())
def post_forward_shard(gathered: Tensor, size: int, index: int) -> Tensor:
    """An int ``reshard_after_forward``'s post-forward shard (``passes/recompute.py``): chunk ``index`` of
    ``size`` of a gathered buffer, in memory of its own. An op, not ``clone`` of a view: Inductor removes
    such a clone as a no-op, and the saved view would keep the whole buffer alive."""
    return gathered.view(size, -1)[index].clone()


@post_forward_shard.register_fake
def _(gathered, size, index):
    return gathered.new_empty(gathered.numel() // size)


def _unshard_setup_context(ctx, inputs, output) -> None:
    shards, sinks, accumulated, *schema = inputs
    ctx.args = UnshardArgs.from_schema(*schema)
    ctx.local_rows = [s.shape[0] for s in shards]
    ctx.orig_dtypes = [s.dtype for s in shards]
    ctx.trainable = [s.requires_grad for s in shards]
    ctx.no_sync = any(t is not None for t in sinks)
    ctx.accumulated_at = [i for i, a in enumerate(accumulated) if a is not None]
    ctx.save_for_backward(*[a for a in accumulated if a is not None])
    ctx.n_schema = len(schema)
    ctx.n_sinks, ctx.n_accumulated = len(sinks), len(accumulated)  # each [] or one per shard


def _unshard_backward(ctx, grads):
    args: UnshardArgs = ctx.args
    nones = [None] * len(grads)
    no_accumulated = [None] * ctx.n_accumulated
    if ctx.no_sync:  # no reduce-scatter: the unsharded gradients go to the sinks (autograd accumulates them)
        to_sinks = [g if ctx.trainable[i] else None for i, g in enumerate(grads)]
        return (nones, to_sinks, no_accumulated, *([None] * ctx.n_schema))
    grads = list(grads)
    for i, acc in zip(ctx.accumulated_at, ctx.saved_tensors):  # FSDP2: accumulated += this backward's gradient
        grads[i] = acc if grads[i] is None else acc + grads[i]
    # Only parameters that require grad (and got one) take part, as in FSDP2's post_backward; the
    # selection is static per trace, so every rank issues the same reduce-scatter.
    keep = [i for i, g in enumerate(grads) if g is not None and ctx.trainable[i]]
    shard_grads: list[Tensor | None] = list(nones)
    if keep:
        reduction = dataclasses.replace(args.reduction, dtype=args.reduction.dtype or grads[keep[0]].dtype)
        rs = ReduceScatterArgs(args.comm, tuple(ctx.local_rows[i] for i in keep), ctx.orig_dtypes[keep[0]], reduction)
        reduced = reduce_scatter_grads([grads[i] for i in keep], *rs.schema())
        for i, g in zip(keep, reduced):
            shard_grads[i] = g
    return (shard_grads, [None] * ctx.n_sinks, no_accumulated, *([None] * ctx.n_schema))


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)


# AOTAutograd decomposes our ops into the functional collectives above (see backend.py).
DECOMPOSITIONS = {
    torch.ops.fsdp_compile.unshard.default: (
        lambda shards, sinks, accumulated, *schema: unshard_impl(shards, UnshardArgs.from_schema(*schema))
    ),
    torch.ops.fsdp_compile.reduce_scatter_grads.default: (
        lambda grads, *schema: reduce_scatter_grads_impl(grads, ReduceScatterArgs.from_schema(*schema))
    ),
}
