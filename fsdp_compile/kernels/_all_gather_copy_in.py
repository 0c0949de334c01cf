"""All-gather copy-in: this rank's local shards -> its packed, zero-padded chunk of the all-gather input.

    out: [N = sum_i n_i]
    out[off_i + e] = shard_i.flatten()[e]   for e <  m_i = rows_r_i * inner_i
                   = 0                       for m_i <= e < n_i            (FSDP2's dim-0 padding)
    cast to ``dtype`` (torch's round-to-nearest-even).

Shard i must have shape (rows_r_i, *S_i[1:]) as ``fully_shard`` leaves it (``DTensor.to_local()``), possibly
(0, *S_i[1:]) on a rank past the last row. Non-contiguous shards are accepted: the torch path reads them
strided, the Triton path makes a contiguous copy first (the kernel addresses shards by flat index).
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
    def _all_gather_copy_in_kernel(
        out_ptr,  # *OUT [N]: this rank's packed chunk; OUT = out's dtype
        seg_ptr,  # *i64 [S, 4]: per shard i (data_ptr, m_i = its numel, n_i = padded numel, off_i in out)
        work_ptr,  # *i64 [P, 3]: per program (shard i, 0, first element of its block within [0, n_i))
        SRC: tl.constexpr,  # tl dtype of every shard (one dtype per call, checked by the launcher)
        BLOCK: tl.constexpr,  # elements per program (C.block_size)
        VEC: tl.constexpr,  # C.vector_width: every m_i, n_i, off_i a multiple of it, every shard 16-byte aligned
    ):
        pid = tl.program_id(0)
        i = tl.load(work_ptr + 3 * pid)
        start = tl.load(work_ptr + 3 * pid + 2)
        src = tl.load(seg_ptr + 4 * i).to(tl.pointer_type(SRC))
        m = tl.load(seg_ptr + 4 * i + 1)
        n = tl.load(seg_ptr + 4 * i + 2)
        off = tl.load(seg_ptr + 4 * i + 3)
        if VEC > 1:  # what C.vector_width checked, and start (a multiple of BLOCK by construction)
            start = tl.multiple_of(start, BLOCK)
            src, m, n, off = tl.multiple_of(src, 16), tl.multiple_of(m, VEC), tl.multiple_of(n, VEC), tl.multiple_of(off, VEC)
        e = start + tl.arange(0, BLOCK)  # element within shard i's padded segment
        x = tl.load(src + e, mask=e < m, other=0)  # e >= m is padding: zero
        tl.store(out_ptr + off + e, C.cast_to(x, out_ptr.dtype.element_ty), mask=e < n)


def _triton(shards: Sequence[torch.Tensor], plan: C.CallSizes, out: torch.Tensor) -> None:
    # The kernel reads shard i as flat [m_i]: keep the contiguous copies alive until the launch is queued.
    shards = [s if s.is_contiguous() else s.contiguous() for s in shards]
    layout = C.work_layout("padded", (), plan.n, 1, out.device.type)
    seg, work = C.build_tables(shards, plan.numels, plan.n, plan.offs, layout, out.device)
    C.launch(
        "all_gather_copy_in", _all_gather_copy_in_kernel, layout.programs, out, seg, work,
        SRC=C.tl_dtype(shards[0].dtype), BLOCK=layout.block,
        VEC=C.aligned_width(shards, plan.gcd, (shards[0].dtype, out.dtype)),
    )


def _torch(shards: Sequence[torch.Tensor], n: Sequence[int], offs: Sequence[int], out: torch.Tensor) -> None:
    """Reference and CPU path. No padding on this rank and ``C.prefer_chunk_cat``: one ``torch._chunk_cat``
    (num_chunks=1: flattens, casts, reads strided, no Python per tensor). Otherwise split ``out`` into
    (data m_i, padding n_i - m_i) views, one foreach copy (casts, reads strided) and one foreach zero."""
    m = [s.numel() for s in shards]
    if m == list(n) and min(m) > 0 and C.prefer_chunk_cat(shards, out.dtype):  # _chunk_cat rejects empty tensors
        torch._chunk_cat(list(shards), 0, 1, out=out.view(1, -1))
        return
    views = torch.split_with_sizes(out, [x for m_i, n_i in zip(m, n) for x in (m_i, n_i - m_i)])
    torch._foreach_copy_([v.view(*s.shape) for v, s in zip(views[0::2], shards)], list(shards))
    pads = [views[2 * i + 1] for i, (m_i, n_i) in enumerate(zip(m, n)) if n_i > m_i]
    if pads:
        torch._foreach_zero_(pads)


def check(shards, dim0s: Sequence, world_size: int, rank: int) -> list:
    """n_i for every shard; raises if a shard is not rank ``rank``'s piece of (dim0s[i], *shards[i].shape[1:])."""
    C.check_tensor_list(shards, "shards")
    C.check_world(world_size, rank)
    if len(dim0s) != len(shards):
        raise ValueError(f"got {len(shards)} shards but {len(dim0s)} full shapes: pass one full shape per shard")
    n = []
    for i, (s, d) in enumerate(zip(shards, dim0s)):
        shape = s.shape
        rows = L.rank_rows(d, world_size, rank)
        if shape[0] != rows:
            c = L.padded_rows(d, world_size)
            full = (d, *shape[1:])
            raise ValueError(
                f"shards[{i}] has shape {tuple(shape)}, but full shape {full} over world_size={world_size} "
                f"gives rank {rank} rows [{min(rank * c, d)}, {min(rank * c, d) + rows}), i.e. shape "
                f"{(rows, *shape[1:])}: pass the local shard (DTensor.to_local()) of that parameter, "
                f"unpadded, and this rank's rank"
            )
        n.append(L.padded_rows(d, world_size) * L.inner_numel(shape))
    return n


@functools.lru_cache(maxsize=1024)
def _plan(shapes: tuple, dim0s: tuple, world_size: int, rank: int) -> C.CallSizes:
    """Once per (shard shapes, dim0s, world size, rank)."""
    n = check([torch.empty(s, device="meta") for s in shapes], dim0s, world_size, rank)
    m, offs = [math.prod(s) for s in shapes], L.offsets(n)
    return C.CallSizes(list(shapes), tuple(m), tuple(n), offs, sum(n), C.size_gcd([*m, *n, *offs]))


def run(shards, dim0s, world_size: int, rank: int, dtype=None, impl: str = "auto", out=None) -> torch.Tensor:
    """Checked entry shared by the op and the ``out=`` form; returns ``out`` (allocated when None)."""
    C.check_tensor_list(shards, "shards")
    plan = _plan(tuple(s.shape for s in shards), tuple(dim0s), world_size, rank)
    C.check_dtype(dtype)
    dtype = dtype or shards[0].dtype
    device = shards[0].device
    impl = C.resolve_impl(impl, device, (shards[0].dtype, dtype))
    if out is None:
        out = torch.empty(plan.total, dtype=dtype, device=device)
    else:
        C.check_out(out, plan.total, dtype, device)
    if impl == "triton":
        _triton(shards, plan, out)
    else:
        _torch(shards, plan.n, plan.offs, out)
    return out
