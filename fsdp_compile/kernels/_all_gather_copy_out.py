"""All-gather copy-out: the rank-major all-gather output -> every full parameter, padding trimmed.

    gathered: [W * N], viewed [W, N]; rank w's copy of param i is gathered[w, off_i : off_i + n_i]
    full_i.flatten()[e] = gathered[w, off_i + j]   with w = e // n_i, j = e % n_i, for e < M_i = prod(S_i)
    full_i: [S_i], contiguous, its own allocation (never a view; the torch impl leaves the padding rows
            at the end of its storage, as FSDP2's unsharded parameters do), cast to ``dtype``.

Element e of a full parameter is row e // inner_i, and rank w holds rows [w * c_i, (w + 1) * c_i), i.e.
elements [w * n_i, (w + 1) * n_i): so the parameter is the concatenation of the W rank slices, cut at M_i
(the padding rows all sit at the end, on the last ranks). A non-contiguous ``gathered`` is made contiguous.
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
    def _all_gather_copy_out_kernel(
        gathered_ptr,  # *IN [W * N]: the all-gather output, rank-major
        seg_ptr,  # *i64 [S, 4]: per param i (data_ptr of full_i, M_i = prod(S_i), n_i, off_i within a rank's chunk)
        work_ptr,  # *i64 [P, 3]: per program (param i, rank w, first element of its block within rank w's piece)
        row_stride,  # N = sum(n_i): elements per rank in gathered
        DST: tl.constexpr,  # tl dtype of every output
        BLOCK: tl.constexpr,  # elements per program (C.block_size)
        VEC: tl.constexpr,  # C.vector_width: every M_i, n_i, off_i and N a multiple of it, every full_i 16-byte aligned
    ):
        pid = tl.program_id(0)
        i = tl.load(work_ptr + 3 * pid)
        w = tl.load(work_ptr + 3 * pid + 1)
        start = tl.load(work_ptr + 3 * pid + 2)
        dst = tl.load(seg_ptr + 4 * i).to(tl.pointer_type(DST))
        numel = tl.load(seg_ptr + 4 * i + 1)
        n = tl.load(seg_ptr + 4 * i + 2)
        off = tl.load(seg_ptr + 4 * i + 3)
        if VEC > 1:  # what C.vector_width checked, and start (a multiple of BLOCK by construction)
            start = tl.multiple_of(start, BLOCK)
            dst, numel, n = tl.multiple_of(dst, 16), tl.multiple_of(numel, VEC), tl.multiple_of(n, VEC)
            off = tl.multiple_of(off, VEC)
        j = start + tl.arange(0, BLOCK)  # element of rank w's piece: element w * n + j of full_i
        mask = (j < n) & (w * n + j < numel)
        base = w * row_stride + off  # where rank w's copy of param i starts in gathered
        if VEC > 1:
            base = tl.multiple_of(base, VEC)  # N and off_i are multiples of VEC
        x = tl.load(gathered_ptr + base + j, mask=mask)
        tl.store(dst + w * n + j, C.cast_to(x, DST), mask=mask)


def _triton(gathered: torch.Tensor, plan: C.CallSizes, outs: Sequence[torch.Tensor], world_size: int) -> None:
    layout = C.work_layout("ranks", plan.numels, plan.n, world_size, gathered.device.type)
    seg, work = C.build_tables(outs, plan.numels, plan.n, plan.offs, layout, gathered.device)
    C.launch(
        "all_gather_copy_out", _all_gather_copy_out_kernel, layout.programs, gathered, seg, work, plan.total,
        DST=C.tl_dtype(outs[0].dtype), BLOCK=layout.block,
        VEC=C.aligned_width(outs, plan.gcd, (gathered.dtype, outs[0].dtype)),
    )


def _torch(
    gathered: torch.Tensor, n: Sequence[int], offs: Sequence[int], padded: Sequence[torch.Tensor], world_size: int
) -> None:
    """Reference and CPU path, into every param's *padded* buffer [W * c_i, *S_i[1:]] viewed [W, n_i]
    (see ``run``): FSDP2's own copy-out, one ``split_with_sizes_copy`` of gathered [W, N] along dim 1; it
    cannot cast, so a cast goes through split views and one foreach copy instead."""
    g = gathered.view(world_size, -1)  # [W, N]
    dsts = [p.view(world_size, -1) for p in padded]
    if gathered.dtype == padded[0].dtype:
        torch.split_with_sizes_copy(g, list(n), dim=1, out=dsts)
    else:
        torch._foreach_copy_(dsts, list(torch.split_with_sizes(g, list(n), dim=1)))


def _shapes(full_shapes, world_size: int) -> tuple[list[tuple], list[int]]:
    """The checked shapes and n_i (the fake's and ``_plan``'s: one rule for the graph's sizes and the run's)."""
    shapes = C.check_full_shapes(full_shapes)
    C.check_world(world_size)
    return shapes, L.padded_numels(shapes, world_size)


def _flat(gathered, world_size: int, total) -> torch.Tensor:
    return C.check_flat_input(gathered, "gathered", world_size * total, f"world_size * sum(n_i) = {world_size} * {total}")


def check(gathered, full_shapes, world_size: int) -> tuple[torch.Tensor, list[tuple], list[int]]:
    """Returns gathered as 1-D, the shapes and n_i; raises if its size does not match (full_shapes, world_size)."""
    shapes, n = _shapes(full_shapes, world_size)
    return _flat(gathered, world_size, sum(n)), shapes, n


@functools.lru_cache(maxsize=1024)
def _plan(flat_shapes: tuple, ndims: tuple, world_size: int) -> C.CallSizes:
    """Once per (shapes, world size)."""
    shapes, n = _shapes(C.unflatten_shapes(flat_shapes, ndims), world_size)
    offs, numels = L.offsets(n), [math.prod(s) for s in shapes]
    return C.CallSizes(shapes, tuple(numels), tuple(n), offs, sum(n), C.size_gcd([*numels, *n, *offs, sum(n)]))


def run(gathered, flat_shapes, ndims, world_size: int, dtype=None, impl: str = "auto") -> list[torch.Tensor]:
    """Checked entry used by the op (the shapes flattened, as in its schema)."""
    plan = _plan(tuple(flat_shapes), tuple(ndims), world_size)
    flat = _flat(gathered, world_size, plan.total)
    C.check_dtype(dtype)
    dtype = dtype or gathered.dtype
    impl = C.resolve_impl(impl, gathered.device, (gathered.dtype, dtype))
    flat = flat if flat.is_contiguous() else flat.contiguous()
    if impl == "triton":
        outs = [torch.empty(s, dtype=dtype, device=gathered.device) for s in plan.shapes]
        if outs:
            _triton(flat, plan, outs, world_size)
        return outs
    # torch: param i is allocated padded, [W * c_i, *S_i[1:]], as FSDP2 allocates its all-gather outputs:
    # the padding rows give one foreach copy a [W, n_i] destination per param. Then resize_ trims it to
    # S_i in place: the first d_i rows, contiguous, a plain tensor (not a view, so autograd and in-place
    # ops treat it as any fresh tensor), whose storage keeps the few padding rows and is shared with nothing.
    shapes = plan.shapes
    padded = [torch.empty(world_size * L.padded_rows(s[0], world_size), *s[1:], dtype=dtype, device=gathered.device) for s in shapes]
    if padded and plan.total > 0:
        _torch(flat, plan.n, plan.offs, padded, world_size)
    for p, s in zip(padded, shapes):
        p.resize_(s)
    return padded
