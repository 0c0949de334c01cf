"""On a CUDA machine: the Triton copy kernels compiled for the GPU, and the compiled step over NCCL.

Every test here is marked ``cuda`` and skips, saying why, without a CUDA device (CI and the CPU
development machine); ``bench/gpu.sh`` runs them with ``pytest -m cuda tests``.

(a) Kernels: each of the four copy kernels with ``impl="triton"`` (compiled by Triton for this GPU, not
    interpreted) bitwise equal to ``impl="torch"`` (the pure-torch reference, also on the GPU) for every
    (src, dst) pair of fp32/bf16/fp16, over test_kernels.py's odd shapes plus tensors that span several
    programs, on world sizes that leave empty and padded shards. The torch reference itself is checked
    against test_kernels.py's spec on the same tensors.
(b) The compiled step on one NCCL rank against eager FSDP2 on the same seed (``parity.run_case``):
    ``aot_eager`` must be bitwise (fp32 and bf16/fp16 mixed precision: the same aten kernels in the same
    order); Inductor generates other kernels (fused RMSNorm and softmax, reordered reductions), so it gets
    a tolerance: losses within 1e-4, gradients and updated shards within 1e-3 after 3 AdamW steps, fp32.
    The ranks run with deterministic algorithms and the math SDPA backend, so that eager itself is
    reproducible (flash and memory-efficient attention backward accumulate with atomics).
(c) The same on 8 NCCL ranks, one GPU each, when 8 GPUs are there (NCCL pinned to one ring, see there).
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist

from fsdp_compile import _layout as L
from fsdp_compile import kernels as K
from fsdp_compile.kernels import _common as C
from dist_helpers import collect
from parity import Case
from test_kernels import (
    DTYPES, SHAPES, _unshard_reshard, assert_bitwise, params, spec_copy_in, spec_copy_out, spec_rs_copy_in,
    spec_rs_copy_out, spec_shard, special_fp32,
)

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(GPUS == 0, reason="needs a CUDA device (torch.cuda.is_available() is False here); "
                                         "on a GPU machine run bench/gpu.sh"),
]

# test_kernels.py's odd shapes, plus tensors of several 2048-element programs each (C._GPU_BLOCK), one of
# them with a ragged last block, and one that no world size below divides evenly.
CUDA_SHAPES = [*SHAPES, (1001, 301), (4099,), (257, 3), (37, 2048)]
# 1: no padding; 2: even splits of most shapes; 3, 5, 7: rows that no rank count divides; 8: empty shards.
WORLD_SIZES = (1, 2, 3, 5, 7, 8)
PAIRS = [(s, d) for s in DTYPES for d in DTYPES]


def _pair_id(pair) -> str:
    return "->".join(str(t).removeprefix("torch.") for t in pair)


@pytest.fixture
def cuda_triton():
    """The Triton kernels compiled for this GPU: skips where Triton cannot, or where TRITON_INTERPRET=1
    built them for the CPU interpreter (its tables hold host addresses, no use on a device)."""
    pytest.importorskip("triton")
    if C.interpreting():
        pytest.skip("TRITON_INTERPRET=1 is set: fsdp_compile's kernels were built for the CPU interpreter")
    if C.resolve_impl("auto", torch.device("cuda"), (torch.float32,)) != "triton":
        pytest.skip("Triton cannot compile for this CUDA device (torch.utils._triton.has_triton() is False)")
    return torch.device("cuda")


def cuda_params(shapes, dtype, seed):
    """test_kernels.params on the GPU, the first large tensor overwritten with special values (random bit
    patterns, rounding ties, infinities, NaNs, subnormals, fp16 overflow), so every cast meets them."""
    fulls = params(shapes, dtype, seed=seed)
    i = shapes.index((1001, 301))
    special = special_fp32().to(dtype)
    flat = fulls[i].reshape(-1)
    flat[: special.numel()] = special
    return [f.cuda() for f in fulls]


# ---------------------------------------------------------------------------------------------------------
# (a) Kernels: triton == torch on the GPU, bitwise.


def test_auto_picks_triton_on_cuda(cuda_triton):
    """What CompileConfig(kernels="auto") relies on: the ops' "auto" resolves to the Triton kernels here."""
    assert all(C.resolve_impl("auto", cuda_triton, (d,)) == "triton" for d in DTYPES)


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_all_gather_triton_equals_torch(pair, cuda_triton):
    src, dst = pair
    for world_size in WORLD_SIZES:
        fulls = cuda_params(CUDA_SHAPES, src, seed=world_size)
        chunks = []
        for rank in range(world_size):
            shards = [spec_shard(f, world_size, rank) for f in fulls]
            ref = K.all_gather_copy_in(shards, CUDA_SHAPES, world_size, rank, dst, impl="torch")
            assert_bitwise(ref, spec_copy_in(fulls, world_size, rank, dst), f"torch copy-in W={world_size} rank {rank}")
            got = K.all_gather_copy_in(shards, CUDA_SHAPES, world_size, rank, dst, impl="triton")
            assert_bitwise(got, ref, f"triton copy-in W={world_size} rank {rank}")
            chunks.append(ref)
        gathered = torch.cat(chunks)  # dst, what all_gather_into_tensor returns
        for out_dtype in (None, src):
            ref = K.all_gather_copy_out(gathered, CUDA_SHAPES, world_size, out_dtype, impl="torch")
            assert_bitwise(ref, spec_copy_out(gathered, CUDA_SHAPES, world_size, out_dtype or dst), f"torch copy-out W={world_size}")
            got = K.all_gather_copy_out(gathered, CUDA_SHAPES, world_size, out_dtype, impl="triton")
            assert_bitwise(got, ref, f"triton copy-out W={world_size} dtype={out_dtype}")


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_reduce_scatter_triton_equals_torch(pair, cuda_triton):
    src, dst = pair
    for world_size in WORLD_SIZES:
        grads = cuda_params(CUDA_SHAPES, src, seed=100 + world_size)
        packed = K.reduce_scatter_copy_in(grads, world_size, dst, impl="torch")
        assert_bitwise(packed, spec_rs_copy_in(grads, world_size, dst), f"torch rs copy-in W={world_size}")
        assert_bitwise(K.reduce_scatter_copy_in(grads, world_size, dst, impl="triton"), packed, f"triton rs copy-in W={world_size}")
        chunk = packed.numel() // world_size
        for rank in range(world_size):
            reduced = packed[rank * chunk : (rank + 1) * chunk]
            ref = K.reduce_scatter_copy_out(reduced, CUDA_SHAPES, world_size, rank, src, impl="torch")
            assert_bitwise(ref, spec_rs_copy_out(reduced, CUDA_SHAPES, world_size, rank, src), f"torch rs copy-out W={world_size} rank {rank}")
            got = K.reduce_scatter_copy_out(reduced, CUDA_SHAPES, world_size, rank, src, impl="triton")
            assert_bitwise(got, ref, f"triton rs copy-out W={world_size} rank {rank}")


# Shapes a transformer has (every size a multiple of 8, so C.vector_width gives 16-byte accesses), with a
# bias of 64 (8 elements a rank at W=8) and one tensor spanning several programs.
ALIGNED_SHAPES = [(256, 64), (64,), (512, 128), (128,), (96, 2048)]


@pytest.mark.parametrize("pair", PAIRS, ids=_pair_id)
def test_vectorized_kernels_equal_torch(pair, cuda_triton):
    """The 16-byte path (VEC > 1), and beside it one shard that starts off 16 bytes (VEC = 1 for that call)."""
    src, dst = pair
    for world_size in (1, 2, 8):
        fulls = [f.cuda() for f in params(ALIGNED_SHAPES, src, seed=30 + world_size)]
        n = L.padded_numels(ALIGNED_SHAPES, world_size)
        assert C.vector_width(fulls, [*(f.numel() for f in fulls), *n, *L.offsets(n)], pair) == 16 // min(src.itemsize, dst.itemsize)
        for rank in range(world_size):
            shards = [spec_shard(f, world_size, rank) for f in fulls]
            want = K.all_gather_copy_in(shards, ALIGNED_SHAPES, world_size, rank, dst, impl="torch")
            assert_bitwise(K.all_gather_copy_in(shards, ALIGNED_SHAPES, world_size, rank, dst, impl="triton"), want)
            shifted = torch.empty(shards[0].numel() + 1, dtype=src, device="cuda")[1:].view(shards[0].shape)
            shifted.copy_(shards[0])  # same values, 2 or 4 bytes off alignment
            assert_bitwise(K.all_gather_copy_in([shifted, *shards[1:]], ALIGNED_SHAPES, world_size, rank, dst, impl="triton"), want)
        gathered = torch.cat([K.all_gather_copy_in([spec_shard(f, world_size, r) for f in fulls], ALIGNED_SHAPES, world_size, r, dst, impl="torch")
                              for r in range(world_size)])
        for out_dtype in (None, src):
            assert_bitwise(K.all_gather_copy_out(gathered, ALIGNED_SHAPES, world_size, out_dtype, impl="triton"),
                           K.all_gather_copy_out(gathered, ALIGNED_SHAPES, world_size, out_dtype, impl="torch"))
        packed = K.reduce_scatter_copy_in(fulls, world_size, dst, impl="torch")
        assert_bitwise(K.reduce_scatter_copy_in(fulls, world_size, dst, impl="triton"), packed)
        chunk = packed.numel() // world_size
        for rank in range(world_size):
            reduced = packed[rank * chunk : (rank + 1) * chunk]
            assert_bitwise(K.reduce_scatter_copy_out(reduced, ALIGNED_SHAPES, world_size, rank, src, impl="triton"),
                           K.reduce_scatter_copy_out(reduced, ALIGNED_SHAPES, world_size, rank, src, impl="torch"))


@pytest.mark.parametrize("dst", (torch.bfloat16, torch.float16))
def test_downcast_rounds_like_torch_on_cuda(dst, cuda_triton):
    """The GPU's own conversions (cvt.rn for fp16, _round_to_bf16 for bf16) against torch's CUDA casts."""
    x = special_fp32().cuda()
    assert_bitwise(K.all_gather_copy_in([x], [tuple(x.shape)], 1, 0, dst, impl="triton"), x.to(dst))
    h = x.to(torch.float16)
    assert_bitwise(K.all_gather_copy_in([h], [tuple(h.shape)], 1, 0, torch.bfloat16, impl="triton"), h.to(torch.bfloat16))


def test_one_launch_per_call_strides_and_out(cuda_triton):
    """Many tensors, one launch per kernel call; transposed and strided inputs; ``out=`` into this rank's
    slice of a larger buffer, leaving the rest untouched."""
    world_size, rank = 5, 2
    shapes = [(8, 6), (10,), *CUDA_SHAPES]
    fulls = [torch.randn(6, 8, device="cuda").t(), torch.randn(20, device="cuda")[::2],
             *cuda_params(CUDA_SHAPES, torch.float32, seed=3)]
    shards = [spec_shard(f, world_size, rank) for f in fulls]
    before = dict(C.LAUNCHES)
    got = K.all_gather_copy_in(shards, shapes, world_size, rank, torch.bfloat16, impl="triton")
    assert_bitwise(got, K.all_gather_copy_in(shards, shapes, world_size, rank, torch.bfloat16, impl="torch"))
    packed = K.reduce_scatter_copy_in(fulls, world_size, torch.bfloat16, impl="triton")
    assert_bitwise(packed, K.reduce_scatter_copy_in(fulls, world_size, torch.bfloat16, impl="torch"))
    strided = torch.stack([packed, packed], 1)[:, 0]  # the same values, stride 2
    assert_bitwise(K.all_gather_copy_out(strided, shapes, world_size, torch.float32, impl="triton"),
                   K.all_gather_copy_out(packed, shapes, world_size, torch.float32, impl="torch"))
    chunk = packed.numel() // world_size
    assert_bitwise(K.reduce_scatter_copy_out(strided[rank * chunk : (rank + 1) * chunk], shapes, world_size, rank, torch.float32, impl="triton"),
                   K.reduce_scatter_copy_out(packed[rank * chunk : (rank + 1) * chunk], shapes, world_size, rank, torch.float32, impl="torch"))
    for name in ("all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", "reduce_scatter_copy_out"):
        assert C.LAUNCHES[name] - before.get(name, 0) == 1, name

    buffer = torch.full((world_size * got.numel(),), -1.0, dtype=torch.bfloat16, device="cuda")
    mine = buffer.narrow(0, rank * got.numel(), got.numel())
    assert K.all_gather_copy_in(shards, shapes, world_size, rank, torch.bfloat16, impl="triton", out=mine) is mine
    assert_bitwise(mine, got)
    rest = torch.cat([buffer[: rank * got.numel()], buffer[(rank + 1) * got.numel() :]])
    assert bool((rest == -1).all())
    rs_out = torch.empty_like(packed)
    assert K.reduce_scatter_copy_in(fulls, world_size, torch.bfloat16, impl="triton", out=rs_out) is rs_out
    assert_bitwise(rs_out, packed)
    torch.cuda.synchronize()


def _empty_table_cache() -> None:
    C._DEVICE_TABLES.clear()
    C._device_tables_bytes = 0


def _capture_copy_in(shards, world_size: int, rank: int):
    """(graph, its output): one bf16 all-gather copy-in of ``shards`` captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        out = K.all_gather_copy_in(shards, CUDA_SHAPES, world_size, rank, torch.bfloat16, impl="triton")
    torch.cuda.current_stream().wait_stream(side)
    return graph, out


def test_device_tables_cached_by_content(cuda_triton, monkeypatch):
    """A call whose tables were made before copies nothing to the device and reuses them: the segment table
    by its addresses and sizes, the work table by its pieces alone; other addresses get another segment
    table and share the work table, so results stay right; the cache stays in its bytes bound; a table read
    on a second stream is recorded on it (its memory waits for that stream's kernels)."""
    world_size, rank = 4, 1
    fulls = cuda_params(CUDA_SHAPES, torch.float32, seed=21)
    shards = [spec_shard(f, world_size, rank) for f in fulls]
    _empty_table_cache()
    first = K.all_gather_copy_in(shards, CUDA_SHAPES, world_size, rank, torch.bfloat16, impl="triton")
    assert sorted(k[0] for k in C._DEVICE_TABLES) == ["seg", "work"]
    entries = dict(C._DEVICE_TABLES)
    again = K.all_gather_copy_in(shards, CUDA_SHAPES, world_size, rank, torch.bfloat16, impl="triton")
    assert C._DEVICE_TABLES.keys() == entries.keys() and all(C._DEVICE_TABLES[k] is v for k, v in entries.items())
    assert_bitwise(again, first)
    moved = [s.clone() + 1 for s in shards]  # other addresses, other values
    got = K.all_gather_copy_in(moved, CUDA_SHAPES, world_size, rank, torch.bfloat16, impl="triton")
    assert sorted(k[0] for k in C._DEVICE_TABLES) == ["seg", "seg", "work"]  # the work table is shared
    assert_bitwise(got, K.all_gather_copy_in(moved, CUDA_SHAPES, world_size, rank, torch.bfloat16, impl="torch"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = K.all_gather_copy_in(shards, CUDA_SHAPES, world_size, rank, torch.bfloat16, impl="triton")
    torch.cuda.current_stream().wait_stream(side)
    assert_bitwise(on_side, first)
    assert all(len(streams) == 2 for _, streams in entries.values())  # the creating stream and the side stream
    bound = sum(t.nbytes for t, _ in entries.values())
    monkeypatch.setattr(C, "_DEVICE_TABLES_MAX_BYTES", bound)
    for i in range(5):
        K.all_gather_copy_in([s.clone() for s in shards], CUDA_SHAPES, world_size, rank, torch.bfloat16, impl="triton")
        assert C._device_tables_bytes <= C._DEVICE_TABLES_MAX_BYTES and len(C._DEVICE_TABLES) <= 2
    torch.cuda.synchronize()
    _empty_table_cache()


def test_cuda_graph_capture_bypasses_the_table_cache(cuda_triton):
    """A call captured in a CUDA graph makes its own tables (kept alive by the graph's pool), never a cached
    one that a later eviction could free under the graph; replays copy the shards' current values."""
    world_size, rank = 4, 1
    fulls = cuda_params(CUDA_SHAPES, torch.float32, seed=22)
    shards = [spec_shard(f, world_size, rank) for f in fulls]
    want = K.all_gather_copy_in(shards, CUDA_SHAPES, world_size, rank, torch.bfloat16, impl="torch")
    K.all_gather_copy_in(shards, CUDA_SHAPES, world_size, rank, torch.bfloat16, impl="triton")  # warm: compiled, cached
    cached = dict(C._DEVICE_TABLES)
    graph, out = _capture_copy_in(shards, world_size, rank)
    assert C._DEVICE_TABLES.keys() == cached.keys()
    _empty_table_cache()  # evict everything: the graph must not depend on it
    torch.cuda.empty_cache()
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(out, want)
    for s in shards:
        s.mul_(2)
    graph.replay()
    torch.cuda.synchronize()
    assert_bitwise(out, K.all_gather_copy_in(shards, CUDA_SHAPES, world_size, rank, torch.bfloat16, impl="torch"))


def test_cuda_graph_replays_tables_made_during_capture(cuda_triton):
    """A call first seen during capture builds its tables there (a pinned host-to-device copy inside the
    graph); later calls, which allocate and fill pinned host blocks of their own, must not overwrite what
    the graph's copy reads at each replay. torch's caching host allocator guarantees it (it never reuses
    a pinned block allocated and used during a capture); this checks that the kernels rely on it rightly."""
    world_size, rank = 4, 1
    fulls = cuda_params(CUDA_SHAPES, torch.float32, seed=23)
    shards = [spec_shard(f, world_size, rank) for f in fulls]
    want = K.all_gather_copy_in(shards, CUDA_SHAPES, world_size, rank, torch.bfloat16, impl="torch")
    K.all_gather_copy_in(shards, CUDA_SHAPES, world_size, rank, torch.bfloat16, impl="triton")  # compile the kernel
    _empty_table_cache()
    graph, out = _capture_copy_in(shards, world_size, rank)
    others = [[s.clone() for s in shards] for _ in range(8)]
    for other in others:  # new tables, with other addresses, through the same pinned host allocator
        _empty_table_cache()
        K.all_gather_copy_in(other, CUDA_SHAPES, world_size, rank, torch.bfloat16, impl="triton")
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        assert_bitwise(out, want)


def test_inductor_runs_the_triton_ops_on_cuda(cuda_triton):
    """Under Inductor on CUDA the ops stay extern kernels: the Triton copies run inside the compiled graph
    (4 launches) and give the eager torch reference's bits."""
    world_size, rank = 4, 1
    fulls = cuda_params(CUDA_SHAPES, torch.float32, seed=15)
    grads = cuda_params(CUDA_SHAPES, torch.bfloat16, seed=16)
    shards = [spec_shard(f, world_size, rank) for f in fulls]
    want = _unshard_reshard(shards, grads, world_size, rank, "torch")
    torch._dynamo.reset()
    compiled = torch.compile(_unshard_reshard, backend="inductor", fullgraph=True)
    before = sum(C.LAUNCHES.values())
    got = compiled(shards, grads, world_size, rank, "triton")
    assert sum(C.LAUNCHES.values()) - before == 4
    for g, w in zip(got, want):
        assert_bitwise(g, w)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------------
# (b), (c) The compiled step over NCCL against eager FSDP2.
#
# tests/dist_helpers.run_ranks is gloo only (and forks its ranks, which CUDA forbids once initialized), so
# the NCCL ranks are spawned here, the same way (a FileStore, bounded waits), and collected by its
# dist_helpers.collect: the first failure re-raised.

BITWISE = [
    Case(),  # fp32, one FSDP group per block, FSDP2's own collective order
    Case(mp="bf16"),
    Case(model="odd", mp="fp16"),  # uneven dim-0 shards, a root with parameters; fp16 reduce: pre/post divide
    Case(mp="bf16", bucket="auto", reorder=True, n_layers=3),  # fc's defaults: buckets and prefetch
    Case(model="llama_ac", mp="bf16", bucket="auto", reorder=True),  # checkpoint_wrapper blocks as regions
]
INDUCTOR = Case(backend="inductor")
INDUCTOR_LOSS_TOL, INDUCTOR_TENSOR_TOL = 1e-4, 1e-3


def _nccl_rank(rank, world_size, store_path, fn, args, results):
    # a cache directory of this spawn's own: a compile that Inductor's or AOTAutograd's cache serves (a rerun on the
    # same machine) leaves no graphs in ``captured``, which the parity checks read
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(os.path.dirname(store_path), "inductor")
    try:
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=300), device_id=torch.device("cuda", rank),
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, "error", traceback.format_exc()))


def run_nccl_ranks(fn, world_size: int, *args, timeout: float = 900.0):
    """``fn(rank, world_size, *args)`` on ``world_size`` spawned NCCL ranks, rank r on GPU r; its return
    values, one per rank."""
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_nccl_rank, args=(r, world_size, os.path.join(tmp, "store"), fn, args, results), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        return collect(procs, results, f"{fn.__name__} on {world_size} NCCL ranks", timeout)


def nccl_worker(rank, world_size, cases):
    """parity.run_case per case (eager FSDP2 and fc side by side), with the batches on this rank's GPU
    (FSDP2 moves a CPU batch into the model, but the loss compares the output with the CPU batch); then
    test_kernels_e2e_multirank's torch-copies vs Triton-copies run, compiled both ways."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before the first cuBLAS handle
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_flash_sdp(False)  # the math backend: a deterministic attention backward
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    import parity
    import test_kernels_e2e_multirank as e2e

    import fsdp_compile as fc

    cpu_batch = parity.batch

    def cuda_batch(case, step, r):
        return cpu_batch(case, step, r).cuda()

    parity.batch = e2e.batch = cuda_batch
    out = {"parity": parity.parity_worker(rank, world_size, cases)}
    out["kernels"] = fc.compile(parity.build(Case()), backend="aot_eager").kernels  # CompileConfig(kernels="auto")
    out["triton_vs_torch"] = e2e._kernels_worker(rank, Case(model="odd"))
    return out


def check_nccl(results, cases):
    for rank, r in enumerate(results):
        assert r["kernels"] == "triton", (rank, r["kernels"])  # "auto" picked the Triton copies on CUDA
        k = r["triton_vs_torch"]
        assert k["loss"]["torch"] == k["loss"]["triton"], (rank, k["loss"])
        assert max(k["grad_diff"]) == 0.0 and max(k["param_diff"]) == 0.0, (rank, k)
        # one rank copies nothing (ops.py: a one-rank group's parameters are its shards, or one cast of them)
        copies = {"all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", "reduce_scatter_copy_out"}
        assert {op.split(".")[1] for op in k["graph_ops"]["triton"]} == (copies if len(results) > 1 else set()), k["graph_ops"]
        for case in cases:
            c = r["parity"][case.name]
            assert c["graph_breaks"] == 0 and c["dynamo_graphs"] == 1, (rank, case.name, c)
            assert c["grad_types"] == ["DTensor"], (rank, case.name, c["grad_types"])
            if case.backend == "aot_eager":
                assert c["loss_compiled"] == c["loss_eager"], (rank, case.name, c["loss_eager"], c["loss_compiled"])
                assert max(c["grad_diff"]) == 0.0 and max(c["param_diff"]) == 0.0, (rank, case.name, c)
                assert max(c["compiled_buffer_diff"]) == 0.0, (rank, case.name, c)
            else:
                diffs = [abs(a - b) for a, b in zip(c["loss_eager"], c["loss_compiled"])]
                assert max(diffs) < INDUCTOR_LOSS_TOL, (rank, case.name, diffs)
                assert max(c["grad_diff"]) < INDUCTOR_TENSOR_TOL and max(c["param_diff"]) < INDUCTOR_TENSOR_TOL, (rank, case.name, c)


@pytest.mark.skipif(GPUS > 0 and not dist.is_nccl_available(), reason="this torch build has no NCCL")
def test_compiled_step_equals_eager_one_nccl_rank():
    cases = [*BITWISE, INDUCTOR]
    check_nccl(run_nccl_ranks(nccl_worker, 1, cases), cases)


@pytest.mark.skipif(0 < GPUS < 8, reason=f"needs 8 GPUs for 8 NCCL ranks (one each); {GPUS} here")
@pytest.mark.skipif(GPUS > 0 and not dist.is_nccl_available(), reason="this torch build has no NCCL")
def test_compiled_step_equals_eager_eight_nccl_ranks(monkeypatch):
    """NCCL on one ring and one channel (the ranks inherit the environment): with several channels, or NVLS,
    an element's summation order in a reduce-scatter depends on its offset in the buffer, which fc's buckets
    change; on one ring it depends only on the rank that receives it, as in eager FSDP2's buffers."""
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("NCCL_MIN_NCHANNELS", "1")
    monkeypatch.setenv("NCCL_MAX_NCHANNELS", "1")
    cases = [*BITWISE, INDUCTOR]
    check_nccl(run_nccl_ranks(nccl_worker, 8, cases), cases)


# ---------------------------------------------------------------------------------------------------------
# (d) CompileConfig(cudagraphs=True): the compiled step replayed from CUDA graphs (torch's graph trees)
#     against eager FSDP2, bitwise under aot_eager (the graphs replay the same aten kernels); gradient
#     accumulation over micro-batches (each replay's gradients accumulated into .grad, the first
#     micro-batch's loss read after the second's replay); every graph captured, and replayed more often
#     than recorded.

CUDAGRAPH_CASES = [
    Case(cudagraphs=True),
    Case(mp="bf16", accum=2, cudagraphs=True),
    Case(mp="bf16", bucket="auto", reorder=True, n_layers=3, cudagraphs=True),
    Case(backend="inductor", cudagraphs=True),
]


def cudagraph_worker(rank, world_size, cases):
    from unittest import mock

    from torch._inductor.cudagraph_trees import CUDAGraphTreeManager

    counts = {"recorded": 0, "replayed": 0}
    record, execute = CUDAGraphTreeManager.record_function, CUDAGraphTreeManager.execute_node

    def counted(name, real):
        def wrapper(self, *args, **kwargs):
            counts[name] += 1
            return real(self, *args, **kwargs)

        return wrapper

    with mock.patch.object(CUDAGraphTreeManager, "record_function", counted("recorded", record)), \
            mock.patch.object(CUDAGraphTreeManager, "execute_node", counted("replayed", execute)):
        out = nccl_worker_parity(rank, world_size, cases)
    return {"parity": out, "counts": counts}


def nccl_worker_parity(rank, world_size, cases):
    """``nccl_worker``'s parity part alone."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    import parity

    cpu_batch = parity.batch
    parity.batch = lambda case, step, r: cpu_batch(case, step, r).cuda()
    return parity.parity_worker(rank, world_size, cases)


@pytest.mark.skipif(GPUS > 0 and not dist.is_nccl_available(), reason="this torch build has no NCCL")
def test_cudagraphs_step_equals_eager_one_nccl_rank():
    (r,) = run_nccl_ranks(cudagraph_worker, 1, CUDAGRAPH_CASES)
    for case in CUDAGRAPH_CASES:
        c = r["parity"][case.name]
        assert c["graph_breaks"] == 0 and c["dynamo_graphs"] == 1, (case.name, c)
        assert c["cudagraphs"] and all(d["captured"] for d in c["cudagraphs"]), (case.name, c["cudagraphs"])
        if case.backend == "aot_eager":
            assert c["loss_compiled"] == c["loss_eager"], (case.name, c["loss_eager"], c["loss_compiled"])
            assert max(c["grad_diff"]) == 0.0 and max(c["param_diff"]) == 0.0, (case.name, c)
        else:
            diffs = [abs(a - b) for a, b in zip(c["loss_eager"], c["loss_compiled"])]
            assert max(diffs) < INDUCTOR_LOSS_TOL, (case.name, diffs)
            assert max(c["grad_diff"]) < INDUCTOR_TENSOR_TOL and max(c["param_diff"]) < INDUCTOR_TENSOR_TOL, (case.name, c)
    assert r["counts"]["replayed"] > r["counts"]["recorded"] > 0, r["counts"]


def _capture_collectives(rank, world_size):
    """Functional collectives on an NCCL group, captured in a CUDA graph and replayed: what the graphs of
    cudagraphs=True hold on more than one rank."""
    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    x = torch.arange(8, dtype=torch.float32, device="cuda") + rank

    def step(t):
        gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(t, world_size, group))
        reduced = c10d.wait_tensor(c10d.reduce_scatter_tensor(gathered * 2, "sum", world_size, group))
        return gathered, reduced

    eager = step(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step(x)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        captured = step(x)
    x.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    expected = step(x)
    return [bool(torch.equal(a, b)) for a, b in zip(captured, expected)] + [bool(not torch.equal(eager[0], expected[0]))]


@pytest.mark.skipif(GPUS > 0 and not dist.is_nccl_available(), reason="this torch build has no NCCL")
def test_functional_collectives_replay_from_a_cuda_graph():
    assert run_nccl_ranks(_capture_collectives, 1) == [[True, True, True]]


def test_watchdog_aborts_a_replay_past_its_deadline():
    """A CUDA event that completes late (a sleeping kernel standing in for a peer that never answers)."""
    import threading

    from fsdp_compile import _cudagraphs

    fired = []
    done = threading.Event()
    dog = _cudagraphs.Watchdog(0.2, lambda what: (fired.append(what), done.set()), poll=0.01)
    try:
        torch.cuda._sleep(int(2e9))  # about a second on an H100
        event = torch.cuda.Event()
        event.record()
        dog.arm(event, "a slow replay")
        assert done.wait(10) and fired == ["a slow replay"]
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="did not finish within the process group's timeout"):
            dog.check()
    finally:
        dog.stop()


# ---------------------------------------------------------------------------------------------------------
# (e) CPUOffloadPolicy(pin_memory=True): sharded parameters, their gradients and AdamW on the host, each
#     unshard copying the shards to the GPU inside the graph before its copy-in and each reduce-scatter's
#     shard gradients back after it (ops.to_device / to_host; their placement: tests/test_offload.py),
#     bitwise against eager FSDP2 with the same policy under aot_eager (the copies move bytes only).

OFFLOAD_CASES = [
    Case(offload="pinned"),
    Case(offload="pinned", mp="bf16", bucket="auto", reorder=True, n_layers=3),
]


@pytest.mark.skipif(GPUS > 0 and not dist.is_nccl_available(), reason="this torch build has no NCCL")
def test_cpu_offload_bitwise():
    (r,) = run_nccl_ranks(nccl_worker_parity, 1, OFFLOAD_CASES)
    for case in OFFLOAD_CASES:
        c = r[case.name]
        assert c["graph_breaks"] == 0 and c["dynamo_graphs"] == 1, (case.name, c)
        assert c["grad_types"] == ["DTensor"], (case.name, c["grad_types"])
        assert c["device_copies"]["forward"] > 0 and c["device_copies"]["backward"] > 0, (case.name, c["device_copies"])
        assert c["loss_compiled"] == c["loss_eager"], (case.name, c["loss_eager"], c["loss_compiled"])
        assert max(c["grad_diff"]) == 0.0 and max(c["param_diff"]) == 0.0, (case.name, c)
        assert max(c["compiled_buffer_diff"]) == 0.0, (case.name, c)
