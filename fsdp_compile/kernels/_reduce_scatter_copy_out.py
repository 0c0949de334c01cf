"""Reduce-scatter copy-out: this rank's reduced chunk -> each parameter's sharded gradient, padding trimmed.

    reduced: [N = sum_i n_i], this rank's reduce-scatter output, param i at [off_i, off_i + n_i)
    grad_i = reduced[off_i : off_i + m_i].view(rows_r_i, *S_i[1:]),  m_i = rows_r_i * inner_i
    each its own allocation (never a view of ``reduced``: the op is functional), cast to ``dtype``.

A non-contiguous ``reduced`` is made contiguous.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from fsdp_compile import _layout as L

from . import _common as C
from ._common import tl, triton

if triton is not None:

    @triton.jit
    def _reduce_scatter_copy_out_kernel(
        reduced_ptr,  # *IN [N]: this rank's reduce-scatter output
        seg_ptr,  # *i64 [S, 4]: per param i (data_ptr of grad_i, m_i = its numel, n_i (unused here), off_i in reduced)
        work_ptr,  # *i64 [P, 3]: per program (param i, 0, first element of its block within [0, m_i))
        DST: tl.constexpr,  # tl dtype of every output
        BLOCK: tl.constexpr,  # elements per program (C.block_size)
        VEC: tl.constexpr,  # C.vector_width: every m_i, off_i a multiple of it, every grad_i 16-byte aligned
    ):
        pid = tl.program_id(0)
        i = tl.load(work_ptr + 3 * pid)
        start = tl.load(work_ptr + 3 * pid + 2)
        dst = tl.load(seg_ptr + 4 * i).to(tl.pointer_type(DST))
        m = tl.load(seg_ptr + 4 * i + 1)
        off = tl.load(seg_ptr + 4 * i + 3)
        if VEC > 1:  # what C.vector_width checked, and start (a multiple of BLOCK by construction)
            start = tl.multiple_of(start, BLOCK)
            dst, m, off = tl.multiple_of(dst, 16), tl.multiple_of(m, VEC), tl.multiple_of(off, VEC)
        e = start + tl.arange(0, BLOCK)  # element of grad_i
        mask = e < m
        x = tl.load(reduced_ptr + off + e, mask=mask)
        tl.store(dst + e, C.cast_to(x, DST), mask=mask)


def _triton(reduced: torch.Tensor, plan: C.CallSizes, outs: Sequence[torch.Tensor]) -> None:
    layout = C.work_layout("valid", plan.numels, (), 1, reduced.device.type)
    seg, work = C.build_tables(outs, plan.numels, plan.n, plan.offs, layout, reduced.device)
    C.launch(
        "reduce_scatter_copy_out", _reduce_scatter_copy_out_kernel, layout.programs, reduced, seg, work,
        DST=C.tl_dtype(outs[0].dtype), BLOCK=layout.block,
        VEC=C.aligned_width(outs, plan.gcd, (reduced.dtype, outs[0].dtype)),
    )


def _torch(reduced: torch.Tensor, n: Sequence[int], offs: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    """Reference and CPU path: split ``reduced`` into (data m_i, padding) views, one foreach copy."""
    m = [o.numel() for o in outs]
    views = torch.split_with_sizes(reduced, [x for m_i, n_i in zip(m, n) for x in (m_i, n_i - m_i)])
    torch._foreach_copy_(list(outs), [v.view(*o.shape) for v, o in zip(views[0::2], outs)])


def _shapes(full_shapes, world_size: int, rank: int) -> tuple[list[tuple], list[int]]:
    """This rank's shard shapes and n_i, checked (the fake's and ``_plan``'s: one rule for the graph's sizes
    and the run's)."""
    shapes = C.check_full_shapes(full_shapes)
    C.check_world(world_size, rank)
    local = [(L.rank_rows(s[0], world_size, rank), *s[1:]) for s in shapes]
    return local, L.padded_numels(shapes, world_size)


def _flat(reduced, total) -> torch.Tensor:
    return C.check_flat_input(reduced, "reduced", total, "sum(n_i) for these full_shapes and world_size")


def check(reduced, full_shapes, world_size: int, rank: int) -> tuple[torch.Tensor, list[tuple], list[int]]:
    """Returns reduced as 1-D, the local shard shapes and n_i; raises if reduced's size does not match."""
    local, n = _shapes(full_shapes, world_size, rank)
    return _flat(reduced, sum(n)), local, n


@functools.lru_cache(maxsize=1024)
def _plan(flat_shapes: tuple, ndims: tuple, world_size: int, rank: int) -> C.CallSizes:
    """Once per (shapes, world size, rank); its shapes are this rank's shard shapes."""
    local, n = _shapes(C.unflatten_shapes(flat_shapes, ndims), world_size, rank)
    numels, offs = [math.prod(s) for s in local], L.offsets(n)
    return C.CallSizes(local, tuple(numels), tuple(n), offs, sum(n), C.size_gcd([*numels, *offs]))


def run(reduced, flat_shapes, ndims, world_size: int, rank: int, dtype=None, impl: str = "auto") -> list[torch.Tensor]:
    """Checked entry used by the op (the shapes flattened, as in its schema)."""
    plan = _plan(tuple(flat_shapes), tuple(ndims), world_size, rank)
    flat = _flat(reduced, plan.total)
    C.check_dtype(dtype)
    dtype = dtype or reduced.dtype
    impl = C.resolve_impl(impl, reduced.device, (reduced.dtype, dtype))
    outs = [torch.empty(*s, dtype=dtype, device=reduced.device) for s in plan.shapes]
    if outs:
        flat = flat if flat.is_contiguous() else flat.contiguous()
        if impl == "triton":
            _triton(flat, plan, outs)
        else:
            _torch(flat, plan.n, plan.offs, outs)
    return outs
