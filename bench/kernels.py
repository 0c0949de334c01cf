"""How fast are fsdp_compile's copy-in/copy-out kernels against a plain copy and FSDP2's own copy ops?

    python3 bench/kernels.py [--world-size 8] [--repeats 30] [--warmup 5] [--threads 1] [--device all|cpu|cuda]

CPU (unless --device cuda): the torch implementation (the CPU path), called through the public functions (argument
checks, op dispatch and output allocation included), against
  (a) ``copy``: one contiguous ``dst.copy_(src)`` writing as many elements, same dtypes;
  (b) ``fsdp``: what FSDP2 eager runs for the same step, with its own ops on the same inputs:
      all-gather copy-in  = torch.ops.fsdp.all_gather_copy_in (after FSDP2's foreach cast when casting),
      all-gather copy-out = torch.ops.fsdp.split_with_sizes_copy into padded per-parameter outputs,
      reduce-scatter copy-in = torch.ops.fsdp.chunk_cat; reduce-scatter copy-out has no FSDP2 op
      (FSDP2 keeps views of the reduce-scatter output), so it is compared with (a) only.
Columns: ``ours`` = functional form (allocates its output, as inside a compiled graph); ``out=`` = the
copy-ins writing into a preallocated buffer; ``fsdp`` = FSDP2 as it runs (it allocates its buffers every
step); ``f.out=`` = FSDP2's ops into preallocated buffers; ``al+cp`` = ``torch.empty + copy_``; ``copy`` =
``copy_`` into a preallocated buffer. Ratios compare like with like: ours / al+cp, out= / copy (GB/s),
fsdp / ours and f.out= / out= (time). Methods are timed round-robin, medians, warm-up rounds dropped.
CUDA (where there is a GPU and Triton compiles for it; ``--device cuda`` for that part alone, as
bench/gpu.sh runs it): the same kernels and workloads, plus one Llama-3-8B block, in fp32->fp32,
fp32->bf16 and bf16->fp32, our Triton kernels (``triton``, ``out=``) and our torch implementation on the
GPU (``torch``) against FSDP2's ops (``fsdp``, ``f.out=``), ``empty + copy_`` and ``copy_``. GB/s from device
time (CUDA events around each call on a cold L2, launches queued behind a busy stream, so host overhead is
hidden), and host wall time per call (synchronized: launch and Python overhead included), launches per
call and kernels the GPU ran (triton/torch/fsdp); the device-to-device copy bandwidth of a 1 GiB buffer
for scale.
GB/s counts bytes read + bytes written. Medians, warm-up excluded.
Writes bench/results/kernels.json (``--device cuda``: bench/results/gpu_kernels.json, naming the GPU).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401  (registers torch.ops.fsdp.*)

sys.path.insert(0, os.path.dirname(__file__))
import _harness as H  # noqa: E402

from fsdp_compile import _layout as L  # noqa: E402
from fsdp_compile import kernels as K  # noqa: E402
from fsdp_compile.kernels import _common as C  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "kernels.json"
CUDA_RESULTS = Path(__file__).resolve().parent / "results" / "gpu_kernels.json"


def workloads() -> dict[str, list[tuple[int, ...]]]:
    """Full parameter shapes of one bucket each."""
    dim, ffn = 1024, 2816  # one Llama-style block: 12.6M parameters
    block = [(dim, dim)] * 4 + [(ffn, dim), (dim, ffn), (ffn, dim), (dim,), (dim,)]
    # Overhead-bound: 96 small uneven tensors (biases, norms, small heads), 0.3M parameters.
    small = [(37 + i % 5, 61) if i % 2 else (101 + i,) for i in range(96)]
    return {"llama_block": block, "many_small": small}


def shard(full: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    chunks = torch.chunk(full, world_size, dim=0)
    return chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))


# ---------------------------------------------------------------------------------------------------------
# CPU.


def kernel_cases(shapes, world_size: int, rank: int, param_dtype, comm_dtype, device=torch.device("cpu"), impls=None):
    """Per kernel: (bytes moved, {method: callable}, (elements written, src dtype, dst dtype) for the plain copy).
    ``impls``: method name -> our impl ({"ours": "torch"} on CPU); the copy-ins also get ``<name>_out``."""
    impls = impls or {"ours": "torch"}
    fulls = [torch.randn(s, dtype=param_dtype, device=device) for s in shapes]
    shards = [shard(f, world_size, rank) for f in fulls]
    n = L.padded_numels(shapes, world_size)
    N = sum(n)
    numels = [math.prod(s) for s in shapes]
    isz, osz = param_dtype.itemsize, comm_dtype.itemsize
    gathered = torch.randn(world_size * N, device=device).to(comm_dtype)
    reduced = torch.randn(N, device=device).to(comm_dtype)
    grads = [torch.randn(s, dtype=param_dtype, device=device) for s in shapes]
    m = [s.numel() for s in shards]
    cases = {}

    # all-gather copy-in: shards (param dtype) -> [N] (comm dtype)
    padded_inputs = [torch.cat([s.reshape(-1), s.new_zeros(n_i - s.numel())]) for s, n_i in zip(shards, n)]  # FSDP2 keeps shards padded
    ag_out = torch.empty(world_size * N, dtype=comm_dtype, device=device)
    mine = ag_out.narrow(0, rank * N, N)

    cast_buf = torch.empty(N, dtype=comm_dtype, device=device)

    def fsdp_ag_in(out=None, flat=None):
        inputs = padded_inputs
        if param_dtype != comm_dtype:  # FSDP2's mixed-precision path: foreach cast into one flat buffer first
            flat = torch.empty(N, dtype=comm_dtype, device=device) if flat is None else flat
            inputs = list(torch.split(flat, n))
            torch._foreach_copy_(inputs, padded_inputs)
        out = torch.empty(world_size * N, dtype=comm_dtype, device=device) if out is None else out
        torch.ops.fsdp.all_gather_copy_in(inputs, out, n, N, rank)

    ag_in = {}
    for name, impl in impls.items():
        ag_in[name] = lambda impl=impl: K.all_gather_copy_in(shards, shapes, world_size, rank, comm_dtype, impl=impl)
        ag_in[f"{name}_out"] = lambda impl=impl: K.all_gather_copy_in(shards, shapes, world_size, rank, comm_dtype, impl=impl, out=mine)
    cases["all_gather_copy_in"] = (
        sum(m) * isz + N * osz,
        {**ag_in, "fsdp": fsdp_ag_in, "fsdp_out": lambda: fsdp_ag_in(ag_out, cast_buf)},
        (N, param_dtype, comm_dtype),
    )

    # all-gather copy-out: [W * N] (comm dtype) -> full params (comm dtype, as FSDP2's unsharded params)
    def fsdp_ag_out():  # FSDP2 (re)allocates its padded all_gather_outputs every unshard
        outs = [torch.empty(world_size * n_i, dtype=comm_dtype, device=device) for n_i in n]
        torch.ops.fsdp.split_with_sizes_copy(gathered.view(world_size, -1), n, dim=1, out=[o.view(world_size, -1) for o in outs])

    cases["all_gather_copy_out"] = (
        sum(numels) * 2 * osz,
        {**{name: lambda impl=impl: K.all_gather_copy_out(gathered, shapes, world_size, impl=impl) for name, impl in impls.items()},
         "fsdp": fsdp_ag_out},
        (sum(numels), comm_dtype, comm_dtype),
    )

    # reduce-scatter copy-in: full grads (param dtype) -> [W * N] (comm dtype)
    rs_buf = torch.empty(world_size * N, dtype=comm_dtype, device=device)

    def fsdp_rs_in(out=None):  # FSDP2 allocates the reduce-scatter input every step
        out = torch.empty(world_size * N, dtype=comm_dtype, device=device) if out is None else out
        torch.ops.fsdp.chunk_cat(grads, dim=0, num_chunks=world_size, out=out.view(world_size, -1))

    rs_in = {}
    for name, impl in impls.items():
        rs_in[name] = lambda impl=impl: K.reduce_scatter_copy_in(grads, world_size, comm_dtype, impl=impl)
        rs_in[f"{name}_out"] = lambda impl=impl: K.reduce_scatter_copy_in(grads, world_size, comm_dtype, impl=impl, out=rs_buf)
    cases["reduce_scatter_copy_in"] = (
        sum(numels) * isz + world_size * N * osz,
        {**rs_in, "fsdp": fsdp_rs_in, "fsdp_out": lambda: fsdp_rs_in(rs_buf)},
        (world_size * N, param_dtype, comm_dtype),
    )

    # reduce-scatter copy-out: [N] (comm dtype) -> sharded grads (param dtype)
    cases["reduce_scatter_copy_out"] = (
        sum(m) * (osz + isz),
        {name: lambda impl=impl: K.reduce_scatter_copy_out(reduced, shapes, world_size, rank, param_dtype, impl=impl)
         for name, impl in impls.items()},
        (sum(m), comm_dtype, param_dtype),
    )
    return cases


def bench_cpu(args) -> list[dict]:
    rows = []
    for wname, shapes in workloads().items():
        for param_dtype, comm_dtype in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16)):
            per_kernel = kernel_cases(shapes, args.world_size, args.rank, param_dtype, comm_dtype)
            for kernel, (nbytes, methods, (elems, src_dt, dst_dt)) in per_kernel.items():
                src = torch.randn(elems).to(src_dt)
                dst = torch.empty(elems, dtype=dst_dt)
                fns = {
                    "copy": lambda: dst.copy_(src),
                    "alloc_copy": lambda: torch.empty(elems, dtype=dst_dt).copy_(src),
                    **methods,
                }
                t = H.medians_s(fns, args.repeats, args.warmup)
                copy_bytes = elems * (src_dt.itemsize + dst_dt.itemsize)
                row = {"workload": wname, "kernel": kernel, "dtypes": f"{_short(param_dtype)}->{_short(comm_dtype)}", "bytes": nbytes}
                _rates(row, t, copy_bytes, nbytes, "ours")
                rows.append(row)
                print(_fmt(row), flush=True)
    return rows


def _rates(row: dict, t: dict, copy_bytes: int, nbytes: int, ours: str) -> None:
    """Into ``row``: each method's ms and GB/s (copies move ``copy_bytes``, the rest ``nbytes``), then the
    like-for-like ratios of ``ours`` (the method under test): functional (allocating) vs empty + copy_;
    out= vs copy_ into a preallocated buffer; FSDP2's ops as eager runs them (allocating) vs ours
    functional; preallocated vs preallocated (time ratios)."""
    for k, sec in t.items():
        row[f"{k}_ms"] = sec * 1e3
        row[f"{k}_GBps"] = (copy_bytes if "copy" in k else nbytes) / sec / 1e9
    row[f"{ours}_vs_alloc_copy"] = row[f"{ours}_GBps"] / row["alloc_copy_GBps"]
    if f"{ours}_out" in t:
        row[f"{ours}_out_vs_copy"] = row[f"{ours}_out_GBps"] / row["copy_GBps"]
    if "fsdp" in t:
        row[f"fsdp_time_over_{ours}"] = row["fsdp_ms"] / row[f"{ours}_ms"]
    if "fsdp_out" in t:
        row[f"fsdp_out_time_over_{ours}_out"] = row["fsdp_out_ms"] / row[f"{ours}_out_ms"]


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]


def _fmt(row: dict) -> str:
    def g(key):
        return f"{row[key]:6.2f}" if key in row else "     -"

    def x(key):
        return f"{row[key]:6.2f}x" if key in row else "      -"

    return (
        f"{row['workload']:11s} {row['kernel']:23s} {row['dtypes']:9s} {row['bytes'] / 1e6:6.1f} "
        f"{g('ours_GBps')} {g('ours_out_GBps')} {g('fsdp_GBps')} {g('fsdp_out_GBps')} {g('alloc_copy_GBps')} {g('copy_GBps')}  "
        f"{x('ours_vs_alloc_copy')} {x('ours_out_vs_copy')} {x('fsdp_time_over_ours')} {x('fsdp_out_time_over_ours_out')}"
    )


HEADER = f"""{'':11s} {'':23s} {'':9s} {'':6s} {'GB/s (bytes read + written)':^41s}  {'ratios (>= 1: ours is as fast or faster)':^31s}
{'workload':11s} {'kernel':23s} {'dtypes':9s} {'MB':>6s} {'ours':>6s} {'out=':>6s} {'fsdp':>6s} {'f.out=':>6s} {'al+cp':>6s} {'copy':>6s}  {'o/al+cp':>7s} {'out=/cp':>7s} {'fsdp/o':>7s} {'f.out/o':>7s}"""


# ---------------------------------------------------------------------------------------------------------
# CUDA (only where there is a GPU: bench/gpu.sh; the development machine has none).

CUDA_PAIRS = ((torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32))


def cuda_workloads() -> dict[str, list[tuple[int, ...]]]:
    """The CPU workloads plus one Llama-3-8B block (218M parameters, 872 MB in fp32): at W=8 a rank's shard
    is 109 MB, far beyond the 50 MB L2, so the copies run at memory bandwidth."""
    dim, kv, ffn = 4096, 1024, 14336
    return {**workloads(), "llama3_8b_block": [(dim, dim), (kv, dim), (kv, dim), (dim, dim), (ffn, dim), (dim, ffn), (ffn, dim), (dim,), (dim,)]}


def cuda_medians_s(fns: dict, repeats: int, warmup: int, flush: torch.Tensor) -> dict:
    """Median device seconds per call of each fn, by CUDA events, round-robin. Before each call the L2 is
    flushed (``flush.zero_()``, larger than the L2) and the stream held busy for a moment
    (``torch.cuda._sleep``), so that the call's launches queue up behind it: the events then time the
    GPU's work for the call (host-side launch overhead hidden), on cold caches."""
    times = {k: [] for k in fns}
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in fns]
    for i in range(warmup + repeats):
        for (k, fn), (start, end) in zip(fns.items(), events):
            flush.zero_()
            torch.cuda._sleep(1_000_000)  # ~0.5 ms at H100 clocks: longer than any call's host-side work here
            start.record()
            fn()
            end.record()
            end.synchronize()
            if i >= warmup:
                times[k].append(start.elapsed_time(end) / 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def d2d_bandwidth(dev, args, flush, nbytes: int = 1 << 30) -> float:
    """GB/s of one large device-to-device ``copy_``, bytes read + written: the device's copy ceiling."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    return 2 * nbytes / cuda_medians_s({"d2d": lambda: b.copy_(a)}, args.repeats, args.warmup, flush)["d2d"] / 1e9


def device_kernels(fn) -> int:
    """Kernels (and device copies) one call runs on the GPU, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def bench_cuda(args) -> list[dict] | str:
    """Per workload, dtype pair and kernel: our Triton kernels (``triton``, and ``triton_out`` into a
    preallocated buffer for the copy-ins), our torch implementation on the GPU (``torch``), FSDP2's own ops as
    eager FSDP2 runs them (``fsdp``, ``fsdp_out``), a plain ``copy_`` of as many elements (``copy``) and
    ``torch.empty + copy_`` (``alloc_copy``). GB/s from device time (CUDA events, cold L2); ``*_wall_ms``:
    host wall time per call with a synchronize before and after (launch and Python overhead included, warm
    L2): for the small workloads that, not the device time, is what a training step pays."""
    if not torch.cuda.is_available():
        return "skipped: no CUDA device"
    if C.resolve_impl("auto", torch.device("cuda"), (torch.float32,)) != "triton":
        return "skipped: Triton is not usable on this CUDA device (or TRITON_INTERPRET=1 is set)"
    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    flush = torch.empty(max(4 * l2, 256 << 20), dtype=torch.uint8, device=dev)
    d2d_GBps = d2d_bandwidth(dev, args, flush)
    print(f"CUDA: {torch.cuda.get_device_name(dev)}, device-to-device copy {d2d_GBps:.0f} GB/s (1 GiB, read + written)")
    print(CUDA_HEADER)
    rows = []
    for wname, shapes in cuda_workloads().items():
        for param_dtype, comm_dtype in CUDA_PAIRS:
            per_kernel = kernel_cases(shapes, args.world_size, args.rank, param_dtype, comm_dtype, dev,
                                      impls={"triton": "triton", "torch": "torch"})
            for kernel, (nbytes, methods, (elems, src_dt, dst_dt)) in per_kernel.items():
                src = torch.randn(elems, device=dev).to(src_dt)
                dst = torch.empty(elems, dtype=dst_dt, device=dev)
                fns = {
                    "copy": lambda: dst.copy_(src),
                    "alloc_copy": lambda: torch.empty(elems, dtype=dst_dt, device=dev).copy_(src),
                    **methods,
                }
                t = cuda_medians_s(fns, args.repeats, args.warmup, flush)
                wall = H.medians_s(fns, args.repeats, args.warmup, sync)
                copy_bytes = elems * (src_dt.itemsize + dst_dt.itemsize)
                row = {"workload": wname, "kernel": kernel, "dtypes": f"{_short(param_dtype)}->{_short(comm_dtype)}",
                       "bytes": nbytes, "d2d_GBps": d2d_GBps}
                _rates(row, t, copy_bytes, nbytes, "triton")
                row.update({f"{k}_wall_ms": wall[k] * 1e3 for k in t})
                row["triton_vs_d2d"] = row["triton_GBps"] / d2d_GBps
                before = C.LAUNCHES[kernel]
                methods["triton"]()
                row["triton_launches"] = C.LAUNCHES[kernel] - before
                for k in ("triton", "torch", "fsdp"):
                    if k in methods:
                        row[f"{k}_device_kernels"] = device_kernels(methods[k])
                rows.append(row)
                print(_fmt_cuda(row), flush=True)
            del per_kernel
            torch.cuda.empty_cache()
    return rows


def _fmt_cuda(row: dict) -> str:
    def g(key):
        return f"{row[key]:7.0f}" if key in row else "      -"

    def x(key):
        return f"{row[key]:6.2f}x" if key in row else "      -"

    def us(key):
        return f"{row[key] * 1e3:7.0f}" if key in row else "      -"

    kernels = "/".join(str(row.get(f"{k}_device_kernels", "-")) for k in ("triton", "torch", "fsdp"))
    return (
        f"{row['workload']:15s} {row['kernel']:23s} {row['dtypes']:9s} {row['bytes'] / 1e6:7.1f} "
        f"{g('triton_GBps')} {g('triton_out_GBps')} {g('torch_GBps')} {g('fsdp_GBps')} {g('fsdp_out_GBps')} "
        f"{g('alloc_copy_GBps')} {g('copy_GBps')} {us('triton_wall_ms')} {us('fsdp_wall_ms')}  "
        f"{x('triton_vs_alloc_copy')} {x('triton_out_vs_copy')} {x('fsdp_time_over_triton')} {x('fsdp_out_time_over_triton_out')}  {kernels:>8s}"
    )


CUDA_HEADER = f"""{'':15s} {'':23s} {'':9s} {'':7s} {'GB/s, device time (bytes read + written)':^55s} {'wall us':^15s}  {'ratios (>= 1: ours is as fast or faster)':^31s}  {'kernels':>8s}
{'workload':15s} {'kernel':23s} {'dtypes':9s} {'MB':>7s} {'triton':>7s} {'out=':>7s} {'torch':>7s} {'fsdp':>7s} {'f.out=':>7s} {'al+cp':>7s} {'copy':>7s} {'triton':>7s} {'fsdp':>7s}  {'t/al+cp':>7s} {'out=/cp':>7s} {'fsdp/t':>7s} {'f.out/o':>7s}  {'t/to/fs':>8s}"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--rank", type=int, default=3)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for the CPU part")
    p.add_argument("--device", choices=("all", "cpu", "cuda"), default="all",
                   help="all: the CPU part, then CUDA where there is a GPU (default); cuda: the GPU part only, "
                        "an error without one")
    p.add_argument("--out", type=Path, default=None, help=f"default {RESULTS} ({CUDA_RESULTS} with --device cuda)")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False (no GPU, or a CPU build of torch)")
    args.out = args.out or (CUDA_RESULTS if args.device == "cuda" else RESULTS)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    cpu = None
    if args.device != "cuda":
        print(f"CPU, torch implementation, world_size={args.world_size}, rank={args.rank}, {args.threads} thread(s)")
        print(HEADER)
        cpu = bench_cpu(args)
        print()
    cuda = bench_cuda(args) if args.device != "cpu" else "skipped: --device cpu"
    if isinstance(cuda, str):
        print("CUDA:", cuda)
    if args.device == "cuda" and isinstance(cuda, str):
        raise SystemExit(f"bench/kernels.py --device cuda: {cuda}")
    result = {
        "machine": H.machine(),
        "env": {
            "triton": getattr(C.triton, "__version__", None),
            "threads": args.threads,
            "world_size": args.world_size,
            "rank": args.rank,
            "repeats": args.repeats,
            "warmup": args.warmup,
        },
        "cpu": cpu,
        "cuda": cuda,
    }
    if not isinstance(cuda, str):
        # the same keys as every other GPU result (device, gpu_count, torch, cuda, triton, nccl)
        result["env"] |= H.gpu_info(torch.cuda.current_device()) | {
            "timing": "CUDA events, cold L2, medians; wall: host clock"}
    H.write_json(str(args.out), result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
