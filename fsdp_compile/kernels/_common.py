"""Shared pieces of the four copy kernels: FSDP2's padded layout, input checks, impl choice, Triton tables.

The layout (FSDP2's, exactly; ``torch.chunk`` along dim 0 as ``fully_shard`` does; its arithmetic lives
in ``fsdp_compile._layout``)::

    full parameter i: shape S_i, d_i = S_i[0] rows, inner_i = prod(S_i[1:]) (1 for a 1-D bias)
    c_i = ceil(d_i / W)                     padded rows per rank
    rank r owns rows [r*c_i, min((r+1)*c_i, d_i))   -> rows_r_i in [0, c_i]; possibly none
    n_i = c_i * inner_i                     padded elements per rank
    N   = sum_i n_i                         one rank's packed chunk
    one rank's chunk:      [ p_0 (n_0) | p_1 (n_1) | ... ]      param i at off_i = n_0 + ... + n_{i-1}
    all-gather output:     [ rank 0 chunk | rank 1 chunk | ... ]   W * N elements, rank-major
    padding (elements >= rows_r_i * inner_i within a rank's n_i) is always written as zero.

Triton side: every kernel is one launch over a work list. The many-tensor side of a call (shards, full
parameters or gradients) is reached through a *segment table* (int64 ``[S, 4]``: data pointer, valid
numel, padded numel ``n_i``, packed offset ``off_i``) and programs through a *work table* (int64 ``[P, 3]``:
segment, rank, first element of the block within that rank's piece), so the launch count does not grow
with the number of tensors. The two kernels that move whole parameters between the rank-major layout and
full tensors (all-gather copy-out, reduce-scatter copy-in) give each program one rank's piece of one
parameter, so no program divides an element index by ``n_i`` (64-bit division is a long instruction
sequence on GPUs: with it these two kernels ran at half the copy bandwidth on an H200).

Rounding: torch casts fp32 -> bf16/fp16 with round-to-nearest-even. Under ``TRITON_INTERPRET=1`` Triton's
fp32 -> bf16 cast truncates (measured: 50% of random values differ by 1 ulp; ``fp_downcast_rounding="rtne"``
does not help, the interpreter ignores it), so ``cast_to`` rounds to bf16 explicitly with integer
arithmetic, which is exact on the interpreter and on GPUs alike. The interpreter's fp32 -> fp16 cast is
numpy's ``astype``, already RTNE (measured: 0 mismatches against torch over 1.8M values including
subnormals, overflow and random bit patterns), so fp16 uses the plain cast. NaN stays NaN; its payload is
not compared, because torch itself is not consistent there (CPU vectorized fp32 -> bf16 gives 0xFFFF, the
scalar path 0x7FC0).
"""

from __future__ import annotations

import collections
import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from fsdp_compile._layout import offsets

try:  # Triton is optional: the package (and the torch paths) must import without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None

IMPLS = ("auto", "triton", "torch")

# The dtypes the Triton kernels read and write. fp64 is left to torch: torch's own fp64 -> fp16 cast is
# not even self-consistent (vectorized path rounds once, scalar path rounds through fp32), so there is no
# bitwise target to meet.
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Number of Triton launches per kernel name since import; tests assert "one launch per call" with it and
# bench/kernels.py reports it. Read deltas, never reset.
LAUNCHES: collections.Counter[str] = collections.Counter()


# ---------------------------------------------------------------------------------------------------------
# The op schemas' shape lists. (FSDP2's layout math itself: ``fsdp_compile._layout``.)


def flatten_shapes(full_shapes: Sequence[Sequence]) -> tuple[list, list[int]]:
    """Full shapes -> (concatenated sizes, ndims): the op schemas take lists of lists this way."""
    return [s for shape in full_shapes for s in shape], [len(shape) for shape in full_shapes]


def unflatten_shapes(flat_shapes: Sequence, ndims: Sequence[int]) -> list[tuple]:
    """Inverse of ``flatten_shapes``."""
    if sum(ndims) != len(flat_shapes):
        raise ValueError(
            f"flat_shapes has {len(flat_shapes)} sizes but ndims {list(ndims)} sums to {sum(ndims)}: "
            "pass flat_shapes and ndims from fsdp_compile.kernels._common.flatten_shapes(full_shapes)"
        )
    starts = offsets(ndims)
    return [tuple(flat_shapes[s : s + k]) for s, k in zip(starts, ndims)]


# ---------------------------------------------------------------------------------------------------------
# Input checks. Every message names the argument and says what to pass instead.


def check_world(world_size, rank=None) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size must be an int (the process group size), got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1 (the process group size), got {world_size}")
    if rank is None:
        return
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise TypeError(f"rank must be an int in [0, world_size), got {type(rank).__name__}")
    if not 0 <= rank < world_size:
        raise ValueError(
            f"rank must be in [0, world_size={world_size}), got {rank}: pass this process's rank in the "
            "sharding process group (group.rank()), not the global rank"
        )


def check_impl(impl) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def check_dtype(dtype) -> None:
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None (keep the input dtype), got {dtype!r}")


def check_full_shapes(full_shapes, name: str = "full_shapes") -> list[tuple]:
    """A list of non-empty shapes with non-negative sizes; returns them as tuples."""
    if isinstance(full_shapes, torch.Size) or not isinstance(full_shapes, (list, tuple)):
        raise TypeError(f"{name} must be a list of shapes (one per parameter), got {type(full_shapes).__name__}")
    shapes = []
    for i, shape in enumerate(full_shapes):
        if not isinstance(shape, (list, tuple, torch.Size)):
            raise TypeError(f"{name}[{i}] must be a shape (tuple of ints), got {type(shape).__name__}")
        shape = tuple(shape)
        if len(shape) == 0:
            raise ValueError(
                f"{name}[{i}] is 0-dim; FSDP2 shards dim 0, so every parameter has at least one dim: "
                "pass 1-element parameters as shape (1,)"
            )
        if min(shape) < 0:
            raise ValueError(f"{name}[{i}] has a negative size: {shape}")
        shapes.append(shape)
    return shapes


def check_tensor_list(tensors, name: str) -> None:
    """Non-empty list of tensors with one dtype and one device (one packed buffer holds them all)."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of tensors, got {type(tensors).__name__}")
    if len(tensors) == 0:
        raise ValueError(f"{name} is empty: pass at least one tensor (the output dtype and device come from it)")
    t0 = tensors[0]
    if not isinstance(t0, torch.Tensor):
        raise TypeError(f"{name}[0] must be a tensor, got {type(t0).__name__}")
    dtype, device = t0.dtype, t0.device
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}[{i}] must be a tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise TypeError(
                f"{name}[{i}] has dtype {t.dtype} but {name}[0] has {dtype}: all tensors of one call "
                f"share a dtype; cast first, or make one call per dtype"
            )
        if t.device != device:
            raise ValueError(f"{name}[{i}] is on {t.device} but {name}[0] is on {device}: move them to one device")
        if t.dim() == 0:
            raise ValueError(f"{name}[{i}] is 0-dim; FSDP2 shards dim 0: reshape it to (1,)")


def check_flat_input(t, name: str, expected_numel, what: str) -> torch.Tensor:
    """The packed side (gathered / reduced): right element count; returned 1-D."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.numel() != expected_numel:
        raise ValueError(f"{name} has {t.numel()} elements but {what} = {expected_numel}: {_fix(name)}")
    return t.reshape(-1)


def _fix(name: str) -> str:
    if name == "gathered":
        return "pass the whole all-gather output (all ranks' chunks) for exactly these full_shapes and world_size"
    return "pass this rank's reduce-scatter output for exactly these full_shapes and world_size"


def check_out(out, numel, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor or None, got {type(out).__name__}")
    if out.dtype != dtype:
        raise TypeError(f"out has dtype {out.dtype} but the result is {dtype}: allocate out with dtype={dtype}")
    if out.device != device:
        raise ValueError(f"out is on {out.device} but the inputs are on {device}: allocate out on {device}")
    if out.dim() != 1 or out.numel() != numel:
        raise ValueError(f"out must be 1-D with {numel} elements, got shape {tuple(out.shape)}")
    if not out.is_contiguous():
        raise ValueError("out must be contiguous (it is written in place): pass a contiguous buffer or a narrow() of one")


# CPU torch paths: ``torch._chunk_cat`` packs a whole list in one C++ call, no Python work per tensor, and
# copies as fast as ``copy_`` when the dtype is kept; but its casting copy runs at ~0.5x of ``copy_``.
# Split views + ``_foreach_copy_`` cast at copy_ speed but cost ~1-3 us of Python per tensor. Measured
# here (16 tensors, fp32 -> bf16): equal at 4 KiB per tensor, _chunk_cat 15% slower at 16 KiB, 1.7x at
# 256 KiB. So: _chunk_cat unless casting tensors of 16 KiB or more on average.
CHUNK_CAT_MAX_CAST_BYTES_PER_TENSOR = 16 * 1024


def prefer_chunk_cat(tensors: Sequence[torch.Tensor], out_dtype: torch.dtype) -> bool:
    if tensors[0].dtype == out_dtype:
        return True
    nbytes = sum(t.numel() for t in tensors) * tensors[0].element_size()
    return nbytes < CHUNK_CAT_MAX_CAST_BYTES_PER_TENSOR * len(tensors)


# ---------------------------------------------------------------------------------------------------------
# impl choice.


def interpreting() -> bool:
    """Whether the @triton.jit kernels were built for the CPU interpreter. Triton decides this when the
    decorator runs, i.e. from TRITON_INTERPRET at the time fsdp_compile.kernels is imported."""
    return _INTERPRETED


@functools.cache
def _gpu_triton_usable() -> bool:
    if triton is None or interpreting():
        return False
    from torch.utils._triton import has_triton

    return has_triton()


def resolve_impl(impl: str, device: torch.device, dtypes: Sequence[torch.dtype]) -> str:
    """"auto" -> "triton" on CUDA when Triton compiles for it and the dtypes are ones the kernels handle,
    else "torch". "triton" is checked here so that a bad request fails with advice, not inside the kernel."""
    check_impl(impl)
    if impl == "torch":
        return impl
    supported = all(d in TRITON_DTYPES for d in dtypes)
    if impl == "auto":
        return "triton" if device.type == "cuda" and supported and _gpu_triton_usable() else "torch"
    if triton is None:
        raise RuntimeError("impl='triton' needs the triton package: pip install triton, or pass impl='torch'")
    if not supported:
        raise TypeError(
            f"impl='triton' handles dtypes {[str(d) for d in TRITON_DTYPES]}, got {[str(d) for d in dtypes]}: "
            "pass impl='torch' (or 'auto') for other dtypes"
        )
    if device.type == "cpu" and not interpreting():
        raise RuntimeError(
            "impl='triton' on CPU tensors runs only in the Triton interpreter: set TRITON_INTERPRET=1 in the "
            "environment before fsdp_compile is imported, or pass impl='torch'"
        )
    if device.type != "cpu" and interpreting():
        # The segment tables hold raw device addresses, which the interpreter (running on the host) cannot read.
        raise RuntimeError(
            f"impl='triton' on {device.type} tensors cannot run under TRITON_INTERPRET=1: unset it, or pass impl='torch'"
        )
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"impl='triton' runs on cuda (or cpu under the interpreter), not {device.type}: pass impl='torch'")
    return impl


# ---------------------------------------------------------------------------------------------------------
# Triton launch plumbing.

# Interpreter cost model, measured on a 2-core CPU box with these kernels under TRITON_INTERPRET=1:
# each program costs a fixed ~0.6 ms plus ~75 ns per element of BLOCK, whatever the mask hides.
_INTERP_PROGRAM_NS = 600_000
_INTERP_ELEMENT_NS = 75
_INTERP_BLOCKS = tuple(1 << k for k in range(8, 17))  # 256 .. 65536

# GPU: 2048 elements per program, 4 warps -> 16 elements per thread. Measured on an H200 (2026-11-26, torch
# 2.11, Triton 3.6; one Llama-3-8B block at W=8 and a 12.6M-parameter block, fp32 and fp32 -> bf16, every
# kernel, against 4096 x 4, 4096 x 8 and 8192 x 8): the fastest or within 3% of it in all 16 cases, with
# scalar and with 16-byte accesses; 8192 x 8 was 13-51% slower. With 16-byte accesses the kernels copy a
# Llama-3-8B block at 94-99% of copy_'s bandwidth.
_GPU_BLOCK = 2048
_GPU_WARPS = 4


def block_size(domains: Sequence[int], device: torch.device) -> int:
    """Elements per program. On the interpreter, minimize the modeled time over powers of two: few large
    programs for big tensors, small blocks when every segment is small (a 65536-wide masked block costs
    the same as a full one)."""
    if device.type != "cpu":
        return _GPU_BLOCK

    def cost(b: int) -> int:
        programs = sum(-(-d // b) for d in domains)
        return programs * (_INTERP_PROGRAM_NS + b * _INTERP_ELEMENT_NS)

    return min(_INTERP_BLOCKS, key=cost)


def tl_dtype(dtype: torch.dtype):
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[dtype]


def _work_table(pieces: tuple[tuple[int, ...], ...], block: int) -> torch.Tensor:
    """[P, 3] int64 (segment, rank, first element) covering ``pieces[i][w]`` elements of segment i's rank-w
    piece in ``block``-sized programs; empty pieces get no program. It depends only on the shapes, not on
    the pointers."""
    seg = torch.tensor([i for i, per in enumerate(pieces) for _ in per], dtype=torch.int64)
    rank = torch.tensor([w for per in pieces for w in range(len(per))], dtype=torch.int64)
    counts = torch.tensor([-(-d // block) for per in pieces for d in per], dtype=torch.int64)
    piece = torch.repeat_interleave(torch.arange(counts.numel(), dtype=torch.int64), counts)
    first_program = torch.cumsum(counts, 0) - counts  # per piece: index of its first program
    start = (torch.arange(piece.numel(), dtype=torch.int64) - first_program[piece]) * block
    return torch.stack([seg[piece], rank[piece], start], dim=1).reshape(-1)


class WorkLayout(NamedTuple):
    key: tuple  # what the work table depends on: O(tensors) to hash, whatever the world size
    work: torch.Tensor  # the work table, on the host
    block: int
    programs: int


# How a kernel cuts its segments into pieces (``_work_table``), from the sizes it is called with.
PIECES = {
    "padded": lambda numels, n, world_size: tuple((x,) for x in n),  # each n_i whole, flat
    "valid": lambda numels, n, world_size: tuple((m,) for m in numels),  # each M_i whole, flat
    "chunks": lambda numels, n, world_size: tuple((x,) * world_size for x in n),  # every rank's n_i
    "ranks": lambda numels, n, world_size: tuple(rank_pieces(m, x, world_size) for m, x in zip(numels, n)),
}


@functools.lru_cache(maxsize=256)
def work_layout(kind: str, numels: tuple[int, ...], n: tuple[int, ...], world_size: int, device_type: str) -> WorkLayout:
    """The pieces, block and work table of a call, made once per shape: the pieces are W per tensor for
    the per-rank kinds, so making them and hashing them for the caches at every call cost O(W x tensors)
    of Python (one 0.95B-Llama block's copy-out on the development machine: 0.6 ms at W=64, 16 ms at
    W=1024)."""
    pieces = PIECES[kind](numels, n, world_size)
    block = block_size([d for per in pieces for d in per], torch.device(device_type))
    work = _work_table(pieces, block)
    return WorkLayout((kind, numels, n, world_size, block), work, block, work.numel() // 3)


# Tables already on a device, keyed by everything they hold: segment tables by their rows (addresses and
# sizes), work tables by the pieces and block alone (they hold no address). A step's copy-in reads the same
# shards (the same addresses) every step, and the caching allocator mostly hands a copy-out the same output
# addresses step after step, so most calls find both here and queue no host-to-device copy ahead of the
# kernel; a call whose outputs moved uploads its segment table (S x 32 bytes) and reuses the work table,
# which every block of a model shares. Measured on an H200 (one Llama-3-8B block, W=8, fp32): the copy-in,
# whose kernel this did not change, went from 2881 to 3753 GB/s of device time. On an H100 (a 0.95B Llama,
# one rank, 2026-11-26), when one entry held both tables, copy-out calls missed about half the time and
# rebuilt and uploaded their whole work table (0.6 MB) at each miss: a cat, a pinned copy and a
# host-to-device copy, some 300 us of host time per miss under the profiler. Bounded by bytes (a work table
# holds 24 bytes per program: 2.6 MB for that 8B block's copy-out). Not used while a CUDA graph is being
# captured: the graph would keep reading a table that a later eviction frees.
_DEVICE_TABLES: collections.OrderedDict = collections.OrderedDict()  # key -> (device tensor, streams read on)
_DEVICE_TABLES_MAX_BYTES = 64 << 20
_device_tables_bytes = 0


def _on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    # Pinned + non_blocking: a pageable host-to-device copy would synchronize the stream and stall the
    # host. The caching host allocator keeps the pinned block alive until the copy has run, and never
    # reuses one allocated and used during a CUDA graph capture, whose replays read it again
    # (ATen/core/CachingHostAllocator.h; tests/test_cuda.py checks it).
    return host if device.type == "cpu" else host.pin_memory().to(device, non_blocking=True)


def _device_table(key: tuple, make, device: torch.device, stream: int) -> torch.Tensor:
    """``make()`` (a host int64 tensor) on ``device``, from ``_DEVICE_TABLES`` when made before."""
    global _device_tables_bytes
    hit = _DEVICE_TABLES.get(key)
    if hit is None:
        hit = _DEVICE_TABLES[key] = (_on_device(make(), device), {stream})
        _device_tables_bytes += hit[0].nbytes
        while _device_tables_bytes > _DEVICE_TABLES_MAX_BYTES and len(_DEVICE_TABLES) > 1:
            old = _DEVICE_TABLES.popitem(last=False)[1][0]
            _device_tables_bytes -= old.nbytes
    else:
        _DEVICE_TABLES.move_to_end(key)
        if stream not in hit[1]:
            # Read on another stream than it was made on: when evicted, its memory must wait for that
            # stream's kernels too. (Only then: record_stream on every call cost ~40 us of host time.)
            hit[0].record_stream(torch.cuda.current_stream(device))
            hit[1].add(stream)
    return hit[0]


def build_tables(
    tensors: Sequence[torch.Tensor],
    valid: Sequence[int],
    padded: Sequence[int],
    offs: Sequence[int],
    layout: WorkLayout,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Segment table [S, 4] = (data_ptr, valid numel, padded numel n_i, packed offset off_i) and the
    layout's work table [P, 3] = (segment, rank, first element of the block), each on the device once
    (``_DEVICE_TABLES``)."""
    rows: list[int] = []
    for t, v, n, o in zip(tensors, valid, padded, offs):
        rows += (t.data_ptr(), v, n, o)
    if device.type == "cpu" or torch.cuda.is_current_stream_capturing():
        return _on_device(torch.tensor(rows, dtype=torch.int64), device), _on_device(layout.work, device)
    stream = torch._C._cuda_getCurrentRawStream(device.index if device.index is not None else torch.cuda.current_device())
    seg = _device_table(("seg", device, tuple(rows)), lambda: torch.tensor(rows, dtype=torch.int64), device, stream)
    return seg, _device_table(("work", device, layout.key), lambda: layout.work, device, stream)


def rank_pieces(numel: int, n: int, world_size: int) -> tuple[int, ...]:
    """Elements of a full parameter (``numel``, ``n`` padded per rank) that each rank's piece holds."""
    return tuple(max(0, min(n, numel - w * n)) for w in range(world_size))


def vector_width(tensors: Sequence[torch.Tensor], sizes: Sequence[int], dtypes: Sequence[torch.dtype]) -> int:
    """``VEC`` for a launch: elements per 16-byte access of the narrowest dtype when every size and offset
    the kernel reads from its tables (``sizes``) is a multiple of it and every tensor the tables point to
    starts on 16 bytes; else 1. The kernels pass it to ``tl.multiple_of``: the claim must hold, or a masked
    vector access would read or write past a tensor's end. Measured on Triton's PTX for sm_90: without
    these hints every access is one element wide (``ld.global.b16`` for bf16), with them 16 bytes."""
    return aligned_width(tensors, size_gcd(sizes), dtypes)


class CallSizes(NamedTuple):
    """What a call's shapes decide, made once per shape by each kernel's ``_plan``: ``run`` is called at every step."""

    shapes: list[tuple]  # the per-parameter side's shapes: the shards or gradients read, the tensors allocated
    numels: tuple[int, ...]  # their elements (m_i or M_i)
    n: tuple[int, ...]  # n_i
    offs: list[int]  # off_i
    total: int  # sum(n_i)
    gcd: int  # of the sizes and offsets the kernel reads from its tables (aligned_width)


def size_gcd(sizes: Sequence[int]) -> int:
    """The gcd of ``sizes`` (0 for none or all zero): what ``vector_width`` needs of them, made once per shape."""
    g = 0
    for v in sizes:
        g = math.gcd(g, int(v))
    return g


def aligned_width(tensors: Sequence[torch.Tensor], gcd: int, dtypes: Sequence[torch.dtype]) -> int:
    """``vector_width`` from the gcd of the sizes (``size_gcd``)."""
    vec = 16 // min(d.itemsize for d in dtypes)
    if gcd % vec or any(t.data_ptr() % 16 for t in tensors):
        return 1
    return vec


def launch(name: str, kernel, num_programs: int, *args, **kwargs) -> None:
    """Launch ``kernel`` once on a 1-D grid (counted in LAUNCHES); nothing to do -> no launch."""
    if num_programs == 0:
        return
    if _INTERPRETED:
        import numpy as np

        # The interpreter casts with numpy, which warns when fp32 -> fp16 overflows to inf: that is the
        # intended result (torch gives inf too), not an error.
        with np.errstate(over="ignore"):
            kernel[(num_programs,)](*args, **kwargs)
    else:
        kernel[(num_programs,)](*args, num_warps=_GPU_WARPS, **kwargs)
    LAUNCHES[name] += 1


if triton is not None:

    @triton.jit
    def _round_to_bf16(x):
        """fp32 -> bf16 with round-to-nearest-even, by integer arithmetic (the interpreter's cast truncates).
        Adding 0x7FFF plus the lowest kept bit to the fp32 bits and dropping the low 16 bits rounds ties to
        even; overflow carries into the exponent (-> inf) exactly as RTNE does. NaN would carry into
        garbage, so it maps to a quiet NaN with the input's sign."""
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        quiet_nan = ((bits >> 16) & 0x8000) | 0x7FC0
        out = tl.where(x != x, quiet_nan, rounded)
        return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def cast_to(x, DST: tl.constexpr):
        """x.to(DST), bitwise equal to torch's ``.to(dtype)`` for fp32/bf16/fp16 in every direction.
        Upcasts are exact; fp16 <- anything is RTNE already; bf16 <- fp32/fp16 goes through ``_round_to_bf16``
        (fp16 -> fp32 is exact, so rounding once from fp32 is what torch does)."""
        if DST == tl.bfloat16:
            if x.dtype != tl.bfloat16:
                y = _round_to_bf16(x.to(tl.float32))
            else:
                y = x
        else:
            y = x.to(DST)
        return y

    # Not isinstance(cast_to, InterpretedFunction): importing triton.runtime.interpreter imports numpy,
    # which no GPU user needs and this package does not declare. Under TRITON_INTERPRET=1 @triton.jit
    # returns an InterpretedFunction, which is not a JITFunction.
    from triton.runtime.jit import JITFunction

    _INTERPRETED = not isinstance(cast_to, JITFunction)
else:  # pragma: no cover
    _INTERPRETED = False
