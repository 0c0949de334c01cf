"""Reduce-scatter copy-in: full (unsharded) gradients -> the rank-major, zero-padded reduce-scatter input.

    out: [W * N], viewed [W, N]; rank w's chunk holds, for every param i, rows [w*c_i, (w+1)*c_i) of grad_i
    out[w, off_i + j] = grad_i.flatten()[w * n_i + j]   if w * n_i + j < M_i = prod(S_i)
                      = 0                                otherwise (padding)
    cast to ``dtype``. This is ``torch._chunk_cat(grads, dim=0, num_chunks=W)``, which FSDP2 uses.

Non-contiguous gradients are accepted (a transposed weight's gradient often is): the torch path reads
them strided, the Triton path makes a contiguous copy first.
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
    def _reduce_scatter_copy_in_kernel(
        out_ptr,  # *OUT [W * N]: the reduce-scatter input, rank-major; OUT = out's dtype
        seg_ptr,  # *i64 [S, 4]: per grad i (data_ptr, M_i = prod(S_i), n_i, off_i within a rank's chunk)
        work_ptr,  # *i64 [P, 3]: per program (grad i, rank w, first element of its block within [0, n_i))
        row_stride,  # N = sum(n_i): elements per rank in out
        SRC: tl.constexpr,  # tl dtype of every gradient
        BLOCK: tl.constexpr,  # elements per program (C.block_size)
        VEC: tl.constexpr,  # C.vector_width: every M_i, n_i, off_i and N a multiple of it, every grad_i 16-byte aligned
    ):
        pid = tl.program_id(0)
        i = tl.load(work_ptr + 3 * pid)
        w = tl.load(work_ptr + 3 * pid + 1)
        start = tl.load(work_ptr + 3 * pid + 2)
        src = tl.load(seg_ptr + 4 * i).to(tl.pointer_type(SRC))
        numel = tl.load(seg_ptr + 4 * i + 1)
        n = tl.load(seg_ptr + 4 * i + 2)
        off = tl.load(seg_ptr + 4 * i + 3)
        if VEC > 1:  # what C.vector_width checked, and start (a multiple of BLOCK by construction)
            start = tl.multiple_of(start, BLOCK)
            src, numel, n = tl.multiple_of(src, 16), tl.multiple_of(numel, VEC), tl.multiple_of(n, VEC)
            off = tl.multiple_of(off, VEC)
        j = start + tl.arange(0, BLOCK)  # element of rank w's chunk: element w * n + j of grad_i padded to W * n_i
        x = tl.load(src + w * n + j, mask=(j < n) & (w * n + j < numel), other=0)  # beyond M_i: padding, zero
        base = w * row_stride + off  # where grad i's piece starts in rank w's chunk of out
        if VEC > 1:
            base = tl.multiple_of(base, VEC)  # N and off_i are multiples of VEC
        tl.store(out_ptr + base + j, C.cast_to(x, out_ptr.dtype.element_ty), mask=j < n)


def _triton(grads: Sequence[torch.Tensor], plan: C.CallSizes, out: torch.Tensor, world_size: int) -> None:
    # The kernel reads grad i as flat [M_i]: keep the contiguous copies alive until the launch is queued.
    grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    # every rank's chunk is written whole: padding is zeroed
    layout = C.work_layout("chunks", (), plan.n, world_size, out.device.type)
    seg, work = C.build_tables(grads, plan.numels, plan.n, plan.offs, layout, out.device)
    C.launch(
        "reduce_scatter_copy_in", _reduce_scatter_copy_in_kernel, layout.programs, out, seg, work, plan.total,
        SRC=C.tl_dtype(grads[0].dtype), BLOCK=layout.block,
        VEC=C.aligned_width(grads, plan.gcd, (grads[0].dtype, out.dtype)),
    )


def _torch(grads: Sequence[torch.Tensor], n: Sequence[int], offs: Sequence[int], out: torch.Tensor, world_size: int) -> None:
    """Reference and CPU path. When ``C.prefer_chunk_cat``: ``torch._chunk_cat`` (FSDP2's op: one C++
    call; it rejects empty tensors). Otherwise one foreach copy (casts, reads strided) between views: rank w's
    [c_i, *S_i[1:]] block of out <- rows [w*c_i, (w+1)*c_i) of grad i; the last, partial rank and the
    padding are separate pieces, zeroed by one foreach zero."""
    if sum(n) == 0:
        return
    o = out.view(world_size, -1)  # [W, N]
    if min(g.numel() for g in grads) > 0 and C.prefer_chunk_cat(grads, out.dtype):
        torch._chunk_cat(list(grads), 0, world_size, out=o)
        return
    dsts, srcs, pads = [], [], []
    for g, block in zip(grads, torch.split_with_sizes(o, list(n), dim=1)):  # block: [W, n_i]
        d, n_i = g.shape[0], block.shape[1]
        if n_i == 0:
            continue
        c = L.padded_rows(d, world_size)
        q, r = divmod(d, c)  # q ranks hold c rows, then one rank holds r rows, the rest none
        if q:
            dsts.append(block[:q].view(q, c, *g.shape[1:]))
            srcs.append(g[: q * c].unflatten(0, (q, c)))  # a view for any strides
        if r:
            dsts.append(block[q, : r * (n_i // c)].view(r, *g.shape[1:]))
            srcs.append(g[q * c :])
            pads.append(block[q, r * (n_i // c) :])
        if q + (r > 0) < world_size:
            pads.append(block[q + (r > 0) :])
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    if pads:
        torch._foreach_zero_(pads)


def check(grads, world_size: int) -> list[int]:
    """n_i for every gradient; raises on mixed dtypes/devices, 0-dim tensors or a bad world_size."""
    C.check_tensor_list(grads, "grads")
    C.check_world(world_size)
    return L.padded_numels([g.shape for g in grads], world_size)


@functools.lru_cache(maxsize=1024)
def _plan(shapes: tuple, world_size: int) -> C.CallSizes:
    """Once per (gradient shapes, world size)."""
    C.check_world(world_size)
    n = L.padded_numels(shapes, world_size)
    numels, offs = [math.prod(s) for s in shapes], L.offsets(n)
    return C.CallSizes(list(shapes), tuple(numels), tuple(n), offs, sum(n), C.size_gcd([*numels, *n, *offs]))


def run(grads, world_size: int, dtype=None, impl: str = "auto", out=None) -> torch.Tensor:
    """Checked entry shared by the op and the ``out=`` form; returns ``out`` (allocated when None)."""
    C.check_tensor_list(grads, "grads")
    plan = _plan(tuple(g.shape for g in grads), world_size)
    C.check_dtype(dtype)
    dtype = dtype or grads[0].dtype
    device = grads[0].device
    impl = C.resolve_impl(impl, device, (grads[0].dtype, dtype))
    total = world_size * plan.total
    if out is None:
        out = torch.empty(total, dtype=dtype, device=device)
    else:
        C.check_out(out, total, dtype, device)
    if impl == "triton":
        _triton(grads, plan, out, world_size)
    else:
        _torch(grads, plan.n, plan.offs, out, world_size)
    return out
