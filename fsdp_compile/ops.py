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

from collections.abc import Sequence

import torch
import torch.fx.traceback as fx_traceback
from torch import Tensor

_c10d = torch.ops._c10d_functional

# Marker placed in node.meta["custom"] by the decompositions, read by capture.py and passes/.
META_KEY = "fsdp_compile"


def padded_rows(dim0: int, world_size: int) -> int:
    """Rows every rank holds for a parameter with ``dim0`` rows: FSDP2's ``ceil(dim0 / W)``."""
    return -(-dim0 // world_size)


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
        n = c * _prod(tail)
        full = per_rank[:, offset : offset + n].reshape(world_size * c, *tail)
        outs.append(full[:d] if world_size * c != d else full)
        offset += n
    return outs


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def unshard_impl(
    shards: list[Tensor],
    dim0s: list[int],
    group_name: str,
    world_size: int,
    rank: int,
    param_dtype: torch.dtype | None,
    group_fqn: str,
    kernels: str,
) -> list[Tensor]:
    with fx_traceback.annotate({META_KEY: {"kind": "unshard", "group": group_fqn}}):
        if kernels == "triton":  # one launch each for copy-in and copy-out (fsdp_compile.kernels)
            from fsdp_compile import kernels as K

            full_shapes = _full_shapes(shards, dim0s)
            flat = K.all_gather_copy_in(shards, full_shapes, world_size, rank, dtype=param_dtype, impl="triton")
            gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(flat, world_size, group_name))
            return K.all_gather_copy_out(gathered, full_shapes, world_size, impl="triton")
        # torch ops, traced into the graph: Inductor fuses them with their neighbours
        flat = _copy_in(shards, dim0s, world_size, param_dtype)
        gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(flat, world_size, group_name))
        return _copy_out(gathered, shards, dim0s, world_size)


def _full_shapes(tensors: Sequence[Tensor], dim0s: Sequence[int]) -> list[tuple[int, ...]]:
    return [(d, *t.shape[1:]) for t, d in zip(tensors, dim0s)]


def reduce_scatter_grads_impl(
    grads: list[Tensor],
    local_rows: list[int],
    group_name: str,
    world_size: int,
    rank: int,
    reduce_dtype: torch.dtype,
    orig_dtype: torch.dtype,
    reduce_op: str,
    pre_factor: float | None,
    post_factor: float | None,
    group_fqn: str,
    kernels: str,
) -> list[Tensor]:
    with fx_traceback.annotate({META_KEY: {"kind": "reduce_scatter", "group": group_fqn}}):
        if kernels == "triton":
            from fsdp_compile import kernels as K

            packed = K.reduce_scatter_copy_in(grads, world_size, dtype=reduce_dtype, impl="triton")
        else:
            packed = _pack_grads(grads, world_size, reduce_dtype)
        if reduce_op == "premul_sum":  # NCCL's PREMUL_SUM: scale each input, then sum
            packed, reduce_op = packed * pre_factor, "sum"
        elif pre_factor is not None:
            packed = packed / pre_factor
        if world_size > 1:
            reduced = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(packed, reduce_op, world_size, group_name))
        else:
            reduced = packed.clone()
        if post_factor is not None:
            reduced = reduced / post_factor
        if kernels == "triton":
            full_shapes = [tuple(g.shape) for g in grads]
            return K.reduce_scatter_copy_out(reduced, full_shapes, world_size, rank, dtype=orig_dtype, impl="triton")
        return _unpack_grads(reduced, grads, local_rows, world_size, orig_dtype)


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
        n = c * _prod(tail)
        shard = reduced[offset : offset + n].view(c, *tail)
        if rows != c:
            shard = shard[:rows]
        outs.append(shard.to(dtype))
        offset += n
    return outs


@torch.library.custom_op("fsdp_compile::unshard", mutates_args=())
def unshard(
    shards: list[Tensor],
    dim0s: list[int],
    group_name: str,
    world_size: int,
    rank: int,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    reduce_op: str,
    pre_factor: float | None,
    post_factor: float | None,
    group_fqn: str,
    kernels: str,
) -> list[Tensor]:
    """All-gather one FSDP group's dim-0 shards into full parameters (see the module docstring).

    The reduce-side arguments are unused in forward; they parametrize the backward, which is
    ``reduce_scatter_grads``. ``dim0s[i]`` is parameter i's unsharded dim-0 size; the trailing dims and
    the padding come from the shard shapes. ``kernels`` is "torch" (copies traced as torch ops) or
    "triton" (``fsdp_compile.kernels``, one launch per copy); ``rank`` is only read by the latter.
    """
    # Eager calls only (compiled graphs use DECOMPOSITIONS): a custom op's outputs may not alias each
    # other, and the decomposition's outputs are views of one gathered buffer.
    return [
        t.clone()
        for t in unshard_impl(shards, dim0s, group_name, world_size, rank, param_dtype, group_fqn, kernels)
    ]


@unshard.register_fake
def _(shards, dim0s, group_name, world_size, rank, param_dtype, reduce_dtype, reduce_op, pre_factor, post_factor, group_fqn, kernels):
    return [
        s.new_empty((d, *s.shape[1:]), dtype=param_dtype or s.dtype) for s, d in zip(shards, dim0s)
    ]


@torch.library.custom_op("fsdp_compile::reduce_scatter_grads", mutates_args=())
def reduce_scatter_grads(
    grads: list[Tensor],
    local_rows: list[int],
    group_name: str,
    world_size: int,
    rank: int,
    reduce_dtype: torch.dtype,
    orig_dtype: torch.dtype,
    reduce_op: str,
    pre_factor: float | None,
    post_factor: float | None,
    group_fqn: str,
    kernels: str,
) -> list[Tensor]:
    """Reduce-scatter full-parameter gradients into this rank's shard gradients (FSDP2's post-backward)."""
    return [
        t.clone()
        for t in reduce_scatter_grads_impl(
            grads, local_rows, group_name, world_size, rank, reduce_dtype, orig_dtype, reduce_op, pre_factor,
            post_factor, group_fqn, kernels,
        )
    ]


@reduce_scatter_grads.register_fake
def _(grads, local_rows, group_name, world_size, rank, reduce_dtype, orig_dtype, reduce_op, pre_factor, post_factor, group_fqn, kernels):
    return [g.new_empty((rows, *g.shape[1:]), dtype=orig_dtype) for g, rows in zip(grads, local_rows)]


def _unshard_setup_context(ctx, inputs, output) -> None:
    shards, dim0s, group_name, world_size, rank, param_dtype, reduce_dtype, reduce_op, pre, post, group_fqn, kernels = inputs
    ctx.local_rows = [s.shape[0] for s in shards]
    ctx.orig_dtypes = [s.dtype for s in shards]
    ctx.trainable = [s.requires_grad for s in shards]
    ctx.args = (group_name, world_size, rank, reduce_dtype, reduce_op, pre, post, group_fqn, kernels)


def _unshard_backward(ctx, grads):
    group_name, world_size, rank, reduce_dtype, reduce_op, pre, post, group_fqn, kernels = ctx.args
    # Only parameters that require grad (and got one) take part, as in FSDP2's post_backward; the
    # selection is static per trace, so every rank issues the same reduce-scatter.
    keep = [i for i, g in enumerate(grads) if g is not None and ctx.trainable[i]]
    shard_grads: list[Tensor | None] = [None] * len(grads)
    if keep:
        orig_dtype = ctx.orig_dtypes[keep[0]]
        reduced = reduce_scatter_grads(
            [grads[i] for i in keep],
            [ctx.local_rows[i] for i in keep],
            group_name,
            world_size,
            rank,
            reduce_dtype or grads[keep[0]].dtype,
            orig_dtype,
            reduce_op,
            pre,
            post,
            group_fqn,
            kernels,
        )
        for i, g in zip(keep, reduced):
            shard_grads[i] = g
    return (shard_grads,) + (None,) * 11


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)


# AOTAutograd decomposes our ops into the functional collectives above (see backend.py).
DECOMPOSITIONS = {
    torch.ops.fsdp_compile.unshard.default: lambda shards, dim0s, group_name, world_size, rank, param_dtype, *rest: (
        unshard_impl(shards, dim0s, group_name, world_size, rank, param_dtype, rest[-2], rest[-1])
    ),
    torch.ops.fsdp_compile.reduce_scatter_grads.default: reduce_scatter_grads_impl,
}
