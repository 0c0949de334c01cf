"""fsdp_compile.kernels: the four copy kernels against an independent spec of FSDP2's layout.

The spec below is written straight from the layout (``torch.chunk`` along dim 0, as ``fully_shard`` shards,
padding to ceil(d / W) rows, ``.to(dtype)`` for casts); it shares no code with the package. The torch
implementation must equal it bitwise, and the Triton kernels (run by the interpreter on CPU) must equal
the torch implementation bitwise, NaN payloads aside (torch itself is not consistent there).
"""

import math
import os
import random

import pytest
import torch

from fsdp_compile import kernels as K
from fsdp_compile import _layout as L
from fsdp_compile.kernels import _common as C

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# 1-row, fewer rows than ranks, 1-D, 3-D, 0-row, uneven: every W in 1..8 gives some empty shards.
SHAPES = [(7, 5), (2,), (4, 3, 2), (1, 9), (0, 3), (3,), (10, 1)]


@pytest.fixture
def triton_impl():
    """The Triton kernels, built for the CPU interpreter for this test only (``triton_mode``)."""
    pytest.importorskip("triton")
    from triton_mode import triton_interpreter

    with triton_interpreter():
        assert C.interpreting()
        yield "triton"


# ---------------------------------------------------------------------------------------------------------
# Spec (oracle).


def spec_shard(full: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    chunks = torch.chunk(full, world_size, dim=0) if full.shape[0] else ()
    return chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))


def spec_padded_rank_slice(full: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows, flattened and zero-padded to n = ceil(d / W) * prod(S[1:])."""
    c = -(-full.shape[0] // world_size)
    n = c * math.prod(full.shape[1:])
    flat = spec_shard(full, world_size, rank).reshape(-1)
    return torch.cat([flat, flat.new_zeros(n - flat.numel())])


def spec_copy_in(fulls, world_size, rank, dtype):
    return torch.cat([spec_padded_rank_slice(f, world_size, rank) for f in fulls]).to(dtype)


def spec_rs_copy_in(grads, world_size, dtype):
    return torch.cat([spec_copy_in(grads, world_size, r, dtype) for r in range(world_size)])


def spec_copy_out(gathered, shapes, world_size, dtype):
    g = gathered.view(world_size, -1)
    outs, off = [], 0
    for s in shapes:
        n = -(-s[0] // world_size) * math.prod(s[1:])
        outs.append(g[:, off : off + n].reshape(-1)[: math.prod(s)].view(s).to(dtype))
        off += n
    return outs


def spec_rs_copy_out(reduced, shapes, world_size, rank, dtype):
    outs, off = [], 0
    for s in shapes:
        c = -(-s[0] // world_size)
        rows = min(c, max(0, s[0] - rank * c))
        inner = math.prod(s[1:])
        outs.append(reduced[off : off + rows * inner].view(rows, *s[1:]).to(dtype))
        off += c * inner
    return outs


# ---------------------------------------------------------------------------------------------------------
# Helpers.


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern, with every NaN mapped to one pattern (payloads are not part of the contract)."""
    t = torch.where(torch.isnan(t), torch.full_like(t, float("nan")), t)
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bitwise(actual, expected, what=""):
    if isinstance(actual, torch.Tensor):
        actual, expected = [actual], [expected]
    assert len(actual) == len(expected), what
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert a.shape == e.shape and a.dtype == e.dtype, f"{what}[{i}]: {a.shape} {a.dtype} vs {e.shape} {e.dtype}"
        assert a.is_contiguous(), f"{what}[{i}] is not contiguous"
        diff = (bits(a) != bits(e)).nonzero()
        assert diff.numel() == 0, f"{what}[{i}]: {diff.shape[0]} elements differ, first at {diff[0].tolist()}: {a[tuple(diff[0])]} vs {e[tuple(diff[0])]}"


def params(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # A spread of magnitudes, so that casts round in every way (and bf16/fp16 differ).
    return [(torch.randn(s, generator=g) * 10 ** torch.randint(-3, 4, s, generator=g).float()).to(dtype) for s in shapes]


def launches(name: str) -> int:
    return C.LAUNCHES[name]


# ---------------------------------------------------------------------------------------------------------
# All-gather: copy-in on every rank, concatenate in rank order, copy-out == the full parameters.


@pytest.mark.parametrize("world_size", range(1, 9))
def test_all_gather_round_trip_every_world_size(world_size, triton_impl):
    fulls = params(SHAPES, torch.float32, seed=world_size)
    chunks = []
    for rank in range(world_size):
        shards = [spec_shard(f, world_size, rank) for f in fulls]
        ref = K.all_gather_copy_in(shards, SHAPES, world_size, rank, impl="torch")
        assert_bitwise(ref, spec_copy_in(fulls, world_size, rank, torch.float32), f"torch copy-in rank {rank}")
        assert_bitwise(K.all_gather_copy_in(shards, SHAPES, world_size, rank, impl=triton_impl), ref, "triton copy-in")
        chunks.append(ref)
    gathered = torch.cat(chunks)
    for impl in ("torch", triton_impl):
        assert_bitwise(K.all_gather_copy_out(gathered, SHAPES, world_size, impl=impl), fulls, f"{impl} copy-out")


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_all_gather_casts(src, dst, triton_impl):
    """param dtype -> all-gather dtype on copy-in, and back (or on) on copy-out; both bitwise to .to()."""
    world_size = 3
    fulls = params(SHAPES, src)
    shards_by_rank = [[spec_shard(f, world_size, r) for f in fulls] for r in range(world_size)]
    chunks = []
    for rank, shards in enumerate(shards_by_rank):
        ref = K.all_gather_copy_in(shards, SHAPES, world_size, rank, dst, impl="torch")
        assert_bitwise(ref, spec_copy_in(fulls, world_size, rank, dst), "torch copy-in")
        assert_bitwise(K.all_gather_copy_in(shards, SHAPES, world_size, rank, dst, impl=triton_impl), ref, "triton copy-in")
        chunks.append(ref)
    gathered = torch.cat(chunks)  # dst
    for out_dtype in (None, src):
        ref = K.all_gather_copy_out(gathered, SHAPES, world_size, out_dtype, impl="torch")
        assert_bitwise(ref, spec_copy_out(gathered, SHAPES, world_size, out_dtype or dst), "torch copy-out")
        assert_bitwise(K.all_gather_copy_out(gathered, SHAPES, world_size, out_dtype, impl=triton_impl), ref, "triton copy-out")
    # Lossless when the all-gather dtype holds the parameter dtype (same dtype, or fp16/bf16 -> fp32).
    if src == dst or dst == torch.float32:
        assert_bitwise(K.all_gather_copy_out(gathered, SHAPES, world_size, src, impl=triton_impl), fulls, "round trip")


# ---------------------------------------------------------------------------------------------------------
# Reduce-scatter: copy-in of the full gradients, rank r's chunk, copy-out == rank r's rows.


@pytest.mark.parametrize("world_size", range(1, 9))
def test_reduce_scatter_round_trip_every_world_size(world_size, triton_impl):
    grads = params(SHAPES, torch.float32, seed=100 + world_size)
    packed = K.reduce_scatter_copy_in(grads, world_size, impl="torch")
    assert_bitwise(packed, spec_rs_copy_in(grads, world_size, torch.float32), "torch rs copy-in")
    assert_bitwise(K.reduce_scatter_copy_in(grads, world_size, impl=triton_impl), packed, "triton rs copy-in")
    chunk = packed.numel() // world_size
    for rank in range(world_size):
        reduced = packed[rank * chunk : (rank + 1) * chunk]
        expected = [spec_shard(g, world_size, rank) for g in grads]
        for impl in ("torch", triton_impl):
            assert_bitwise(K.reduce_scatter_copy_out(reduced, SHAPES, world_size, rank, impl=impl), expected, f"{impl} rs copy-out")


@pytest.mark.parametrize("src", DTYPES)
@pytest.mark.parametrize("dst", DTYPES)
def test_reduce_scatter_casts(src, dst, triton_impl):
    world_size = 4
    grads = params(SHAPES, src, seed=7)
    packed = K.reduce_scatter_copy_in(grads, world_size, dst, impl="torch")
    assert_bitwise(packed, spec_rs_copy_in(grads, world_size, dst), "torch rs copy-in")
    assert_bitwise(K.reduce_scatter_copy_in(grads, world_size, dst, impl=triton_impl), packed, "triton rs copy-in")
    chunk = packed.numel() // world_size
    for rank in (0, world_size - 1):
        reduced = packed[rank * chunk : (rank + 1) * chunk]
        ref = K.reduce_scatter_copy_out(reduced, SHAPES, world_size, rank, src, impl="torch")
        assert_bitwise(ref, spec_rs_copy_out(reduced, SHAPES, world_size, rank, src), "torch rs copy-out")
        assert_bitwise(K.reduce_scatter_copy_out(reduced, SHAPES, world_size, rank, src, impl=triton_impl), ref, "triton rs copy-out")


@pytest.mark.parametrize("path", ["chunk_cat", "foreach"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 5, 8])
def test_both_cpu_paths_match_the_spec(path, world_size, monkeypatch):
    """The torch implementation picks torch._chunk_cat or split views + foreach copies by size and dtype
    (C.prefer_chunk_cat); force each and check all four kernels, with and without empty tensors and casts."""
    monkeypatch.setattr(C, "prefer_chunk_cat", lambda tensors, dtype: path == "chunk_cat")
    for shapes in (SHAPES, [s for s in SHAPES if s[0] > 0]):
        for src, dst in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float16, torch.float32)):
            fulls = params(shapes, src, seed=world_size)
            chunks = []
            for rank in range(world_size):
                shards = [spec_shard(f, world_size, rank) for f in fulls]
                chunks.append(K.all_gather_copy_in(shards, shapes, world_size, rank, dst, impl="torch"))
                assert_bitwise(chunks[-1], spec_copy_in(fulls, world_size, rank, dst), f"copy-in rank {rank}")
            gathered = torch.cat(chunks)
            assert_bitwise(K.all_gather_copy_out(gathered, shapes, world_size, src, impl="torch"), spec_copy_out(gathered, shapes, world_size, src))
            packed = K.reduce_scatter_copy_in(fulls, world_size, dst, impl="torch")
            assert_bitwise(packed, spec_rs_copy_in(fulls, world_size, dst), "rs copy-in")
            reduced = packed[: packed.numel() // world_size]
            assert_bitwise(K.reduce_scatter_copy_out(reduced, shapes, world_size, 0, src, impl="torch"), spec_rs_copy_out(reduced, shapes, world_size, 0, src))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_outputs_are_fresh_memory(impl, request):
    """Functional: no output shares memory with an input or with another output, or is a view."""
    if impl == "triton":
        request.getfixturevalue("triton_impl")
    world_size, rank = 2, 0
    shapes = [(4, 3), (2,)]
    fulls = params(shapes, torch.float32)
    shards = [spec_shard(f, world_size, rank) for f in fulls]  # W=2, rank 0: no padding, no cast: copies could be views
    gathered = torch.cat([spec_copy_in(fulls, world_size, r, torch.float32) for r in range(world_size)])
    results = [
        (shards, [K.all_gather_copy_in(shards, shapes, world_size, rank, impl=impl)]),
        ([gathered], K.all_gather_copy_out(gathered, shapes, world_size, impl=impl)),
        (fulls, [K.reduce_scatter_copy_in(fulls, world_size, impl=impl)]),
        ([gathered], K.reduce_scatter_copy_out(gathered[: gathered.numel() // world_size], shapes, world_size, rank, impl=impl)),
    ]

    def span(t):
        start = t.untyped_storage().data_ptr()
        return start, start + t.untyped_storage().nbytes()

    for inputs, outputs in results:
        for i, o in enumerate(outputs):
            assert not o._is_view()
            for other in [*inputs, *outputs[:i]]:
                (a0, a1), (b0, b1) = span(o), span(other)
                assert a1 <= b0 or b1 <= a0, "output shares memory"


def test_op_schemas():
    """The contract the capture code calls (see fsdp_compile/kernels/_library.py)."""
    ops = torch.ops.fsdp_compile
    assert [str(op.default._schema) for op in (ops.all_gather_copy_in, ops.all_gather_copy_out, ops.reduce_scatter_copy_in, ops.reduce_scatter_copy_out)] == [
        'fsdp_compile::all_gather_copy_in(Tensor[] shards, SymInt[] dim0s, int world_size, int rank, ScalarType? dtype=None, str impl="auto") -> Tensor',
        'fsdp_compile::all_gather_copy_out(Tensor gathered, SymInt[] flat_shapes, int[] ndims, int world_size, ScalarType? dtype=None, str impl="auto") -> Tensor[]',
        'fsdp_compile::reduce_scatter_copy_in(Tensor[] grads, int world_size, ScalarType? dtype=None, str impl="auto") -> Tensor',
        'fsdp_compile::reduce_scatter_copy_out(Tensor reduced, SymInt[] flat_shapes, int[] ndims, int world_size, int rank, ScalarType? dtype=None, str impl="auto") -> Tensor[]',
    ]


# ---------------------------------------------------------------------------------------------------------
# One launch per call, however many tensors; several programs per tensor when tensors are large.


def test_many_tensors_one_launch_each(triton_impl):
    rng = random.Random(0)
    shapes = [tuple(rng.randint(0, 9) for _ in range(rng.randint(1, 3))) for _ in range(40)]
    shapes = [(max(s[0], 1), *s[1:]) if i % 5 else s for i, s in enumerate(shapes)]  # a few 0-row params too
    world_size, rank = 5, 2
    fulls = params(shapes, torch.float32, seed=3)
    grads = params(shapes, torch.bfloat16, seed=4)
    shards = [spec_shard(f, world_size, rank) for f in fulls]
    before = dict(C.LAUNCHES)

    packed = K.all_gather_copy_in(shards, shapes, world_size, rank, torch.bfloat16, impl=triton_impl)
    assert_bitwise(packed, spec_copy_in(fulls, world_size, rank, torch.bfloat16))
    gathered = torch.cat([spec_copy_in(fulls, world_size, r, torch.bfloat16) for r in range(world_size)])
    outs = K.all_gather_copy_out(gathered, shapes, world_size, torch.float32, impl=triton_impl)
    assert_bitwise(outs, [f.to(torch.bfloat16).float() for f in fulls])
    rs = K.reduce_scatter_copy_in(grads, world_size, torch.float32, impl=triton_impl)
    assert_bitwise(rs, spec_rs_copy_in(grads, world_size, torch.float32))
    chunk = rs.numel() // world_size
    sharded = K.reduce_scatter_copy_out(rs[rank * chunk : (rank + 1) * chunk], shapes, world_size, rank, torch.bfloat16, impl=triton_impl)
    assert_bitwise(sharded, [spec_shard(g, world_size, rank) for g in grads])

    for name in ("all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", "reduce_scatter_copy_out"):
        assert launches(name) - before.get(name, 0) == 1, name


def test_large_tensors_span_several_programs(triton_impl):
    shapes = [(1001, 301), (5,), (257, 3)]
    world_size = 3
    fulls = params(shapes, torch.float32, seed=5)
    n = L.padded_numels(shapes, world_size)
    assert C.block_size(n, torch.device("cpu")) < n[0]  # several programs for the big one
    gathered = torch.cat([spec_copy_in(fulls, world_size, r, torch.bfloat16) for r in range(world_size)])
    shards = [spec_shard(f, world_size, 1) for f in fulls]
    assert_bitwise(K.all_gather_copy_in(shards, shapes, world_size, 1, torch.bfloat16, impl=triton_impl), gathered.view(3, -1)[1])
    assert_bitwise(
        K.all_gather_copy_out(gathered, shapes, world_size, torch.float32, impl=triton_impl),
        K.all_gather_copy_out(gathered, shapes, world_size, torch.float32, impl="torch"),
    )
    assert_bitwise(K.reduce_scatter_copy_in(fulls, world_size, torch.float16, impl=triton_impl), spec_rs_copy_in(fulls, world_size, torch.float16))


def test_block_size_model():
    cpu = torch.device("cpu")
    assert C.block_size([10, 20], cpu) == 256  # small tensors: small blocks (a masked lane costs as much as a live one)
    assert C.block_size([10_000_000], cpu) == 65536  # big tensors: the largest block, fewest programs
    assert C.block_size([10_000_000], torch.device("cuda")) == C._GPU_BLOCK


def test_vector_width_only_where_every_size_and_pointer_allows_it():
    """VEC is what the kernels promise Triton (tl.multiple_of): 16 bytes of the narrowest dtype where every
    size and offset is a multiple of it and every tensor starts on 16 bytes, else 1 (a false promise would
    make a masked vector access run past a tensor's end on a GPU)."""
    aligned = torch.empty(64), torch.empty(32)
    assert C.vector_width(aligned, [64, 32, 0, 64], (torch.float32, torch.bfloat16)) == 8
    assert C.vector_width(aligned, [64, 32, 0, 64], (torch.float32, torch.float32)) == 4
    assert C.vector_width(aligned, [64, 36, 0, 64], (torch.float32, torch.bfloat16)) == 1  # 36 is not a multiple of 8
    assert C.vector_width(aligned, [64, 36, 0, 64], (torch.float32, torch.float32)) == 4
    assert C.vector_width(aligned, [64, 7], (torch.float32,)) == 1
    shifted = torch.empty(65)[1:]  # starts 4 bytes into its storage
    assert C.vector_width([aligned[0], shifted], [64, 64], (torch.float32,)) == 1
    assert C.vector_width([torch.empty(0)], [0], (torch.bfloat16,)) == 8


def test_padding_only_and_empty_calls(triton_impl):
    before = launches("all_gather_copy_in")
    out = K.all_gather_copy_in([torch.empty(0, 3)], [(2, 3)], 4, 3, impl=triton_impl)  # 2 rows over 4 ranks: rank 3 has none
    assert out.shape == (3,) and bool((out == 0).all())  # ... but still one padded row, written as zeros
    assert launches("all_gather_copy_in") == before + 1
    before = launches("all_gather_copy_out")
    assert K.all_gather_copy_out(torch.empty(0), [(0, 3)], 4, impl=triton_impl)[0].shape == (0, 3)
    assert launches("all_gather_copy_out") == before


# ---------------------------------------------------------------------------------------------------------
# Rounding: explicit RTNE for bf16 (the interpreter's cast truncates), fp16 already RTNE.


def special_fp32() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=g, dtype=torch.int64).to(torch.int32)
    mantissa_ties = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80_8001, 0x3F80_7FFF], dtype=torch.int64).to(torch.int32)
    edges = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan"), 3.4028235e38, -3.4028235e38,
         65504.0, 65520.0, 65519.99, 1e-40, -1e-45, 6e-8, 2.9e-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11],
        dtype=torch.float32,
    )
    return torch.cat([random_bits.view(torch.float32), mantissa_ties.view(torch.float32), edges])


@pytest.mark.parametrize("dst", (torch.bfloat16, torch.float16))
def test_downcast_rounds_like_torch(dst, triton_impl):
    x = special_fp32()
    out = K.all_gather_copy_in([x], [tuple(x.shape)], 1, 0, dst, impl=triton_impl)
    assert_bitwise(out, x.to(dst))
    assert torch.equal(torch.isnan(out), torch.isnan(x))
    # fp16 -> bf16 rounds once from the exact fp32 value, as torch does.
    h = x.to(torch.float16)
    assert_bitwise(K.all_gather_copy_in([h], [tuple(h.shape)], 1, 0, torch.bfloat16, impl=triton_impl), h.to(torch.bfloat16))


def test_layout_made_once_per_shape(triton_impl, monkeypatch):
    """A call's pieces, block and work table depend only on its shapes and world size (W pieces per tensor
    for the per-rank kernels): a second call with the same shapes, on other tensors, makes none of them and
    copies the same."""
    world_size, shapes = 64, [(130, 3), (7,), (64, 2)]
    n = L.padded_numels(shapes, world_size)
    gathered = torch.randn(world_size * sum(n))
    grads = params(shapes, torch.float32, seed=5)
    C.work_layout.cache_clear()
    out = K.all_gather_copy_out(gathered, shapes, world_size, impl=triton_impl)
    packed = K.reduce_scatter_copy_in(grads, world_size, impl=triton_impl)

    def made(*args):
        raise AssertionError("a layout was made again for shapes seen before")

    monkeypatch.setattr(C, "rank_pieces", made)
    monkeypatch.setattr(C, "_work_table", made)
    for got, want in zip(K.all_gather_copy_out(gathered.clone(), shapes, world_size, impl=triton_impl), out):
        assert_bitwise(got, want)
    assert_bitwise(K.reduce_scatter_copy_in([g.clone() for g in grads], world_size, impl=triton_impl), packed)
    assert C.work_layout.cache_info().hits == 2


def test_interpreter_plain_bf16_cast_truncates(triton_impl):
    """Evidence for the explicit rounding in _common.cast_to: the interpreter's own ``.to(tl.bfloat16)``
    truncates. If this starts failing, Triton fixed the interpreter and the workaround can go."""
    import triton
    import triton.language as tl

    @triton.jit
    def plain_cast(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(dst + offs, tl.load(src + offs, mask=offs < n).to(tl.bfloat16), mask=offs < n)

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    out = torch.empty(4096, dtype=torch.bfloat16)
    plain_cast[(1,)](x, out, 4096, BLOCK=4096)
    truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert torch.equal(out, truncated) and not torch.equal(out, x.to(torch.bfloat16))


def test_cuda_choices_need_no_undeclared_import():
    """On CUDA, kernels="auto" picks these Triton kernels. tests/gpu_paths.py drives the CUDA choices under a
    pretend H100 in a process where numpy cannot be imported (the package does not declare it): importing
    triton.runtime.interpreter to tell interpreted kernels apart once made every GPU user need numpy."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences triton 3.9's default-change warning
    here = os.path.dirname(os.path.abspath(__file__))
    script = os.path.join(here, "gpu_paths.py")
    # the checkout under test, whether or not (or wherever) the package is installed
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.dirname(here), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, script, "--block-numpy"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "all passed" in proc.stdout or "skipped" in proc.stdout


# ---------------------------------------------------------------------------------------------------------
# Strides and out=.


def test_non_contiguous_inputs_are_read_correctly(triton_impl):
    world_size, rank = 3, 1
    weight_t = torch.randn(6, 8).t()  # [8, 6], strides (1, 8): a transposed weight's gradient
    fulls = [weight_t, torch.randn(20)[::2]]
    shapes = [tuple(f.shape) for f in fulls]
    shards = [spec_shard(f, world_size, rank) for f in fulls]
    assert not any(s.is_contiguous() for s in shards)
    for impl in ("torch", triton_impl):
        assert_bitwise(K.all_gather_copy_in(shards, shapes, world_size, rank, impl=impl), spec_copy_in(fulls, world_size, rank, torch.float32))
        assert_bitwise(K.reduce_scatter_copy_in(fulls, world_size, torch.bfloat16, impl=impl), spec_rs_copy_in(fulls, world_size, torch.bfloat16))
        gathered = torch.cat([spec_copy_in(fulls, world_size, r, torch.float32) for r in range(world_size)])
        strided = torch.stack([gathered, gathered], 1)[:, 0]  # same values, stride 2
        assert_bitwise(K.all_gather_copy_out(strided, shapes, world_size, impl=impl), K.all_gather_copy_out(gathered, shapes, world_size, impl="torch"))
        assert_bitwise(K.reduce_scatter_copy_out(strided[: strided.numel() // 3], shapes, world_size, rank, impl=impl),
                       spec_rs_copy_out(gathered[: gathered.numel() // 3], shapes, world_size, rank, torch.float32))


def test_out_writes_in_place(triton_impl):
    world_size, rank = 4, 2
    fulls = params(SHAPES, torch.float32, seed=9)
    shards = [spec_shard(f, world_size, rank) for f in fulls]
    for impl in ("torch", triton_impl):
        total = sum(L.padded_numels(SHAPES, world_size))
        ag_buffer = torch.full((world_size * total,), -1.0, dtype=torch.bfloat16)  # FSDP2-style: write this rank's slice
        mine = ag_buffer.narrow(0, rank * total, total)
        assert K.all_gather_copy_in(shards, SHAPES, world_size, rank, torch.bfloat16, impl=impl, out=mine) is mine
        assert_bitwise(mine, spec_copy_in(fulls, world_size, rank, torch.bfloat16))
        assert bool((ag_buffer[: rank * total] == -1).all()) and bool((ag_buffer[(rank + 1) * total :] == -1).all())
        rs_out = torch.empty(world_size * total)
        assert K.reduce_scatter_copy_in(fulls, world_size, impl=impl, out=rs_out) is rs_out
        assert_bitwise(rs_out, spec_rs_copy_in(fulls, world_size, torch.float32))


# ---------------------------------------------------------------------------------------------------------
# Bad input: clear errors naming the argument.


def _shards(world_size=2, rank=0):
    return [spec_shard(torch.randn(5, 3), world_size, rank), spec_shard(torch.randn(4), world_size, rank)]


BAD_INPUTS = [
    (lambda: K.all_gather_copy_in([torch.randn(3, 3), torch.randn(2, dtype=torch.bfloat16)], [(5, 3), (4,)], 2, 0), TypeError, r"shards\[1\] has dtype"),
    (lambda: K.all_gather_copy_in([torch.randn(3, 3), torch.randn(2, device="meta")], [(5, 3), (4,)], 2, 0), ValueError, r"shards\[1\] is on meta"),
    (lambda: K.all_gather_copy_in([torch.randn(2, 3), torch.randn(2)], [(5, 3), (4,)], 2, 0), ValueError, r"shards\[0\] has shape \(2, 3\).*rank 0 rows \[0, 3\)"),
    (lambda: K.all_gather_copy_in([torch.randn(3, 4), torch.randn(2)], [(5, 3), (4,)], 2, 0), ValueError, r"trailing dims"),
    (lambda: K.all_gather_copy_in(_shards(), [(5, 3)], 2, 0), ValueError, r"2 shards but 1 full_shapes"),
    (lambda: K.all_gather_copy_in(_shards(), [(5, 3), (4,)], 2, 2), ValueError, r"rank must be in \[0, world_size=2\)"),
    (lambda: K.all_gather_copy_in(_shards(), [(5, 3), (4,)], 2, -1), ValueError, r"rank must be in"),
    (lambda: K.all_gather_copy_in(_shards(1), [(5, 3), (4,)], 0, 0), ValueError, r"world_size must be >= 1"),
    (lambda: K.all_gather_copy_in(_shards(), [(5, 3), (4,)], 2.0, 0), TypeError, r"world_size must be an int"),
    (lambda: K.all_gather_copy_in([], [], 2, 0), ValueError, r"shards is empty"),
    (lambda: K.all_gather_copy_in([torch.tensor(1.0)], [()], 1, 0), ValueError, r"full_shapes\[0\] is 0-dim"),
    (lambda: K.all_gather_copy_in(_shards(), [(5, 3), (4,)], 2, 0, dtype="bf16"), TypeError, r"dtype must be a torch.dtype"),
    (lambda: K.all_gather_copy_in(_shards(), [(5, 3), (4,)], 2, 0, impl="cuda"), ValueError, r"impl must be one of"),
    (lambda: K.all_gather_copy_in(_shards(), [(5, 3), (4,)], 2, 0, out=torch.empty(9)), ValueError, r"out must be 1-D with 11 elements"),
    (lambda: K.all_gather_copy_in(_shards(), [(5, 3), (4,)], 2, 0, out=torch.empty(22)[::2]), ValueError, r"out must be contiguous"),
    (lambda: K.all_gather_copy_in(_shards(), [(5, 3), (4,)], 2, 0, torch.bfloat16, out=torch.empty(11)), TypeError, r"out has dtype torch.float32"),
    (lambda: K.all_gather_copy_out(torch.empty(21), [(5, 3), (4,)], 2), ValueError, r"gathered has 21 elements but world_size \* sum\(n_i\) = 2 \* 11"),
    (lambda: K.all_gather_copy_out(torch.empty(22), [(5, 3), (4,)], 0), ValueError, r"world_size must be >= 1"),
    (lambda: K.all_gather_copy_out(torch.empty(22), (5, 3), 2), TypeError, r"full_shapes\[0\] must be a shape"),
    (lambda: K.reduce_scatter_copy_in([torch.randn(5, 3), torch.randn(4, dtype=torch.float16)], 2), TypeError, r"grads\[1\] has dtype"),
    (lambda: K.reduce_scatter_copy_in([torch.randn(5, 3), torch.randn(4, device="meta")], 2), ValueError, r"grads\[1\] is on meta"),
    (lambda: K.reduce_scatter_copy_in(torch.randn(5, 3), 2), TypeError, r"grads must be a list of tensors"),
    (lambda: K.reduce_scatter_copy_in([torch.randn(5, 3)], 0), ValueError, r"world_size must be >= 1"),
    (lambda: K.reduce_scatter_copy_in([torch.randn(5, 3)], 2, out=torch.empty(10)), ValueError, r"out must be 1-D with 18 elements"),
    (lambda: K.reduce_scatter_copy_out(torch.empty(12), [(5, 3), (4,)], 2, 0), ValueError, r"reduced has 12 elements but sum\(n_i\) .* = 11"),
    (lambda: K.reduce_scatter_copy_out(torch.empty(11), [(5, 3), (4,)], 2, 5), ValueError, r"rank must be in \[0, world_size=2\)"),
    (lambda: K.reduce_scatter_copy_out(torch.empty(11), [(5, 3), (-4,)], 2, 0), ValueError, r"full_shapes\[1\] has a negative size"),
    (lambda: K.all_gather_copy_in([torch.randn(3, 3, dtype=torch.float64)], [(5, 3)], 2, 0, impl="triton"), TypeError, r"impl='triton' handles dtypes"),
]


@pytest.mark.parametrize("call, error, match", BAD_INPUTS, ids=[f"{i}-{m[:32]}" for i, (_, _, m) in enumerate(BAD_INPUTS)])
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ---------------------------------------------------------------------------------------------------------
# The ops: opcheck, fake tensors, torch.compile, autograd.


def _op_cases(impl):
    world_size, rank = 3, 2
    fulls = params(SHAPES, torch.float32, seed=11)
    flat, ndims = C.flatten_shapes(SHAPES)
    dim0s = [s[0] for s in SHAPES]
    shards = [spec_shard(f, world_size, rank) for f in fulls]
    gathered = torch.cat([spec_copy_in(fulls, world_size, r, torch.bfloat16) for r in range(world_size)])
    reduced = gathered[: gathered.numel() // world_size].clone()
    ops = torch.ops.fsdp_compile
    return [
        (ops.all_gather_copy_in.default, (shards, dim0s, world_size, rank, torch.bfloat16, impl)),
        (ops.all_gather_copy_out.default, (gathered, flat, ndims, world_size, torch.float32, impl)),
        (ops.reduce_scatter_copy_in.default, (fulls, world_size, torch.bfloat16, impl)),
        (ops.reduce_scatter_copy_out.default, (reduced, flat, ndims, world_size, rank, None, impl)),
    ]


@pytest.mark.parametrize("case", range(4))
def test_opcheck_torch_impl(case):
    op, args = _op_cases("torch")[case]
    torch.library.opcheck(op, args)


def test_ops_trace_with_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._pytree import tree_flatten, tree_map_only

    for op, args in _op_cases("torch"):
        real, _ = tree_flatten(op(*args))
        with FakeTensorMode() as mode:
            fake, _ = tree_flatten(op(*tree_map_only(torch.Tensor, mode.from_tensor, args)))
        assert [(f.shape, f.dtype) for f in fake] == [(r.shape, r.dtype) for r in real], op
        gm = make_fx(lambda *a: op(*a), tracing_mode="fake")(*args)
        assert [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target is op] == [op]


def test_ops_run_directly_only_where_the_dispatcher_would(monkeypatch):
    """The ops' autograd kernel (_library._autograd_kernel) runs the implementation itself for calls that
    record no graph on plain tensors, as a compiled step makes them; a call that needs a graph, or meets a
    fake tensor or a dispatch mode, goes through the dispatcher as torch.library.register_autograd's would."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_map_only

    redispatched = []
    real = torch._ops.OpOverload.redispatch
    monkeypatch.setattr(torch._ops.OpOverload, "redispatch", lambda op, *a, **k: redispatched.append(op) or real(op, *a, **k))

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    for op, args in _op_cases("torch"):
        redispatched.clear()
        with torch.no_grad():
            direct = op(*args)
        assert redispatched == [], op
        with torch.no_grad(), torch._C._AutoDispatchBelowAutograd():  # what the dispatcher would run
            expected = op(*args)
        assert all(torch.equal(a, b) for a, b in zip(tree_flatten(direct)[0], tree_flatten(expected)[0])), op
        redispatched.clear()
        with Seen() as mode, torch.no_grad():
            op(*args)
        assert op in mode.ops and redispatched == [op], op
        redispatched.clear()
        with FakeTensorMode() as fake_mode, torch.no_grad():
            out = op(*tree_map_only(torch.Tensor, fake_mode.from_tensor, args))
        assert all(isinstance(t, FakeTensor) for t in tree_flatten(out)[0]) and redispatched == [op], op
        grad_args = tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(), args)
        redispatched.clear()
        out = op(*grad_args)
        assert all(t.grad_fn is not None for t in tree_flatten(out)[0]) and redispatched == [op], op


def _unshard_reshard(shards, grads, world_size, rank, impl):
    """What the capture code does around the collectives: copy-in, (all-gather), copy-out; copy-in, (RS), copy-out."""
    shapes = [(d, *s.shape[1:]) for s, d in zip(shards, [g.shape[0] for g in grads])]
    packed = K.all_gather_copy_in(shards, shapes, world_size, rank, torch.bfloat16, impl=impl)
    gathered = torch.cat([packed] * world_size)  # stand-in for all_gather_into_tensor
    fulls = K.all_gather_copy_out(gathered, shapes, world_size, torch.bfloat16, impl=impl)
    rs_in = K.reduce_scatter_copy_in(grads, world_size, torch.float32, impl=impl)
    chunk = rs_in.numel() // world_size
    sharded = K.reduce_scatter_copy_out(rs_in[rank * chunk : (rank + 1) * chunk], shapes, world_size, rank, torch.bfloat16, impl=impl)
    return fulls, sharded


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_torch_compile_fullgraph_aot_eager(impl, request):
    if impl == "triton":
        request.getfixturevalue("triton_impl")
    world_size, rank = 4, 1
    fulls = params(SHAPES, torch.float32, seed=12)
    grads = params(SHAPES, torch.bfloat16, seed=13)
    shards = [spec_shard(f, world_size, rank) for f in fulls]
    torch._dynamo.reset()
    compiled = torch.compile(_unshard_reshard, backend="aot_eager", fullgraph=True)
    before = sum(C.LAUNCHES.values())
    got = compiled(shards, grads, world_size, rank, impl)
    if impl == "triton":  # the Triton kernels really ran inside the compiled graph: 4 ops, 4 launches
        assert sum(C.LAUNCHES.values()) - before == 4
    want = _unshard_reshard(shards, grads, world_size, rank, "torch")
    for g, w in zip(got, want):
        assert_bitwise(g, w)


@pytest.mark.inductor
def test_torch_compile_inductor_runs_the_ops_as_fallback_kernels(triton_impl):
    """Under Inductor the ops stay opaque (extern fallback kernels): both impls run inside the compiled
    graph, the Triton kernels included (one launch per op)."""
    world_size, rank = 4, 1
    fulls = params(SHAPES, torch.float32, seed=15)
    grads = params(SHAPES, torch.bfloat16, seed=16)
    shards = [spec_shard(f, world_size, rank) for f in fulls]
    want = _unshard_reshard(shards, grads, world_size, rank, "torch")
    torch._dynamo.reset()
    compiled = torch.compile(_unshard_reshard, backend="inductor", fullgraph=True)
    for impl in ("torch", triton_impl):
        before = sum(C.LAUNCHES.values())
        got = compiled(shards, grads, world_size, rank, impl)
        assert sum(C.LAUNCHES.values()) - before == (4 if impl == triton_impl else 0)
        for g, w in zip(got, want):
            assert_bitwise(g, w)


def test_autograd_through_the_adjoint_pairs():
    """Each op's backward is its adjoint: compare gradients with the spec built from differentiable torch ops."""
    world_size, rank = 3, 1
    fulls = params(SHAPES, torch.float64, seed=14)
    flat, ndims = C.flatten_shapes(SHAPES)
    shards = [spec_shard(f, world_size, rank).detach().requires_grad_() for f in fulls]
    packed = K.all_gather_copy_in(shards, SHAPES, world_size, rank, torch.float32, impl="torch")
    weights = torch.randn(packed.shape, dtype=torch.float32)
    (packed * weights).sum().backward()
    expected = spec_rs_copy_out(weights.double(), SHAPES, world_size, rank, torch.float64)
    assert_bitwise([s.grad for s in shards], expected)

    for fn in (
        lambda x: torch.ops.fsdp_compile.all_gather_copy_out(x, flat, ndims, world_size, None, "torch"),
        lambda x: torch.ops.fsdp_compile.reduce_scatter_copy_out(x[: x.numel() // world_size], flat, ndims, world_size, rank, None, "torch"),
    ):
        x = torch.cat([spec_copy_in(fulls, world_size, r, torch.float64) for r in range(world_size)]).requires_grad_()
        assert torch.autograd.gradcheck(lambda x: tuple(fn(x)), (x,))
    grads = [f.detach().requires_grad_() for f in fulls]
    assert torch.autograd.gradcheck(lambda *g: K.reduce_scatter_copy_in(list(g), world_size, impl="torch"), grads)
    # Schema defaults left out by the caller (dtype, impl) are not autograd inputs either.
    x = [spec_shard(f, world_size, rank).detach().requires_grad_() for f in fulls]
    torch.ops.fsdp_compile.all_gather_copy_in(x, [s[0] for s in SHAPES], world_size, rank).sum().backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in x)
    assert torch.autograd.gradcheck(
        lambda *s: K.all_gather_copy_in(list(s), SHAPES, world_size, rank, impl="torch"),
        [spec_shard(f, world_size, rank).detach().requires_grad_() for f in fulls],
    )
