"""How fast are fsdp_compile's copy-in/copy-out kernels against a plain copy and FSDP2's own copy ops?

    python3 bench/kernels.py [--world-size 8] [--repeats 30] [--warmup 5] [--threads 1]

CPU (always): the torch implementation (the CPU path), called through the public functions (argument
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
CUDA (only when present and Triton is usable): the Triton kernels against device-to-device copy
bandwidth, plus launches per call. GB/s counts bytes read + bytes written. Medians, warm-up excluded.
Writes bench/results/kernels.json.
"""

from __future__ import annotations

import argparse
import math
import os
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


def cpu_cases(shapes, world_size: int, rank: int, param_dtype, comm_dtype):
    """Per kernel: (bytes moved, {method: callable}, (elements written, src dtype, dst dtype) for the plain copy)."""
    fulls = [torch.randn(s, dtype=param_dtype) for s in shapes]
    shards = [shard(f, world_size, rank) for f in fulls]
    n = L.padded_numels(shapes, world_size)
    N = sum(n)
    numels = [math.prod(s) for s in shapes]
    isz, osz = param_dtype.itemsize, comm_dtype.itemsize
    gathered = torch.randn(world_size * N).to(comm_dtype)
    reduced = torch.randn(N).to(comm_dtype)
    grads = [torch.randn(s, dtype=param_dtype) for s in shapes]
    m = [s.numel() for s in shards]
    cases = {}

    # all-gather copy-in: shards (param dtype) -> [N] (comm dtype)
    padded_inputs = [torch.cat([s.reshape(-1), s.new_zeros(n_i - s.numel())]) for s, n_i in zip(shards, n)]  # FSDP2 keeps shards padded
    ag_out = torch.empty(world_size * N, dtype=comm_dtype)
    mine = ag_out.narrow(0, rank * N, N)

    cast_buf = torch.empty(N, dtype=comm_dtype)

    def fsdp_ag_in(out=None, flat=None):
        inputs = padded_inputs
        if param_dtype != comm_dtype:  # FSDP2's mixed-precision path: foreach cast into one flat buffer first
            flat = torch.empty(N, dtype=comm_dtype) if flat is None else flat
            inputs = list(torch.split(flat, n))
            torch._foreach_copy_(inputs, padded_inputs)
        out = torch.empty(world_size * N, dtype=comm_dtype) if out is None else out
        torch.ops.fsdp.all_gather_copy_in(inputs, out, n, N, rank)

    cases["all_gather_copy_in"] = (
        sum(m) * isz + N * osz,
        {
            "ours": lambda: K.all_gather_copy_in(shards, shapes, world_size, rank, comm_dtype, impl="torch"),
            "ours_out": lambda: K.all_gather_copy_in(shards, shapes, world_size, rank, comm_dtype, impl="torch", out=mine),
            "fsdp": fsdp_ag_in,
            "fsdp_out": lambda: fsdp_ag_in(ag_out, cast_buf),
        },
        (N, param_dtype, comm_dtype),
    )

    # all-gather copy-out: [W * N] (comm dtype) -> full params (comm dtype, as FSDP2's unsharded params)
    def fsdp_ag_out():  # FSDP2 (re)allocates its padded all_gather_outputs every unshard
        outs = [torch.empty(world_size * n_i, dtype=comm_dtype) for n_i in n]
        torch.ops.fsdp.split_with_sizes_copy(gathered.view(world_size, -1), n, dim=1, out=[o.view(world_size, -1) for o in outs])

    cases["all_gather_copy_out"] = (
        sum(numels) * 2 * osz,
        {"ours": lambda: K.all_gather_copy_out(gathered, shapes, world_size, impl="torch"), "fsdp": fsdp_ag_out},
        (sum(numels), comm_dtype, comm_dtype),
    )

    # reduce-scatter copy-in: full grads (param dtype) -> [W * N] (comm dtype)
    rs_buf = torch.empty(world_size * N, dtype=comm_dtype)

    def fsdp_rs_in(out=None):  # FSDP2 allocates the reduce-scatter input every step
        out = torch.empty(world_size * N, dtype=comm_dtype) if out is None else out
        torch.ops.fsdp.chunk_cat(grads, dim=0, num_chunks=world_size, out=out.view(world_size, -1))

    cases["reduce_scatter_copy_in"] = (
        sum(numels) * isz + world_size * N * osz,
        {
            "ours": lambda: K.reduce_scatter_copy_in(grads, world_size, comm_dtype, impl="torch"),
            "ours_out": lambda: K.reduce_scatter_copy_in(grads, world_size, comm_dtype, impl="torch", out=rs_buf),
            "fsdp": fsdp_rs_in,
            "fsdp_out": lambda: fsdp_rs_in(rs_buf),
        },
        (world_size * N, param_dtype, comm_dtype),
    )

    # reduce-scatter copy-out: [N] (comm dtype) -> sharded grads (param dtype)
    cases["reduce_scatter_copy_out"] = (
        sum(m) * (osz + isz),
        {"ours": lambda: K.reduce_scatter_copy_out(reduced, shapes, world_size, rank, param_dtype, impl="torch")},
        (sum(m), comm_dtype, param_dtype),
    )
    return cases


def bench_cpu(args) -> list[dict]:
    rows = []
    for wname, shapes in workloads().items():
        for param_dtype, comm_dtype in ((torch.float32, torch.float32), (torch.float32, torch.bfloat16)):
            cases = cpu_cases(shapes, args.world_size, args.rank, param_dtype, comm_dtype)
            for kernel, (nbytes, methods, (elems, src_dt, dst_dt)) in cases.items():
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
                for k, sec in t.items():
                    row[f"{k}_ms"] = sec * 1e3
                    row[f"{k}_GBps"] = (copy_bytes if "copy" in k else nbytes) / sec / 1e9
                # Like for like: functional (allocating) vs empty + copy_; out= vs copy_ into a preallocated
                # buffer; FSDP2 as it runs (allocating) vs ours functional; preallocated vs preallocated.
                row["ours_vs_alloc_copy"] = row["ours_GBps"] / row["alloc_copy_GBps"]
                if "ours_out" in t:
                    row["ours_out_vs_copy"] = row["ours_out_GBps"] / row["copy_GBps"]
                if "fsdp" in t:
                    row["fsdp_time_over_ours"] = row["fsdp_ms"] / row["ours_ms"]
                if "fsdp_out" in t:
                    row["fsdp_out_time_over_ours_out"] = row["fsdp_out_ms"] / row["ours_out_ms"]
                rows.append(row)
                print(_fmt(row), flush=True)
    return rows


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
# CUDA (skipped here: no GPU).


def bench_cuda(args) -> list[dict] | str:
    if not torch.cuda.is_available():
        return "skipped: no CUDA device"
    if C.resolve_impl("auto", torch.device("cuda"), (torch.float32,)) != "triton":
        return "skipped: Triton is not usable on this CUDA device (or TRITON_INTERPRET=1 is set)"
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda")
    sync = torch.cuda.synchronize
    rows = []
    for wname, shapes in workloads().items():
        W, rank = args.world_size, args.rank
        fulls = [torch.randn(s, device=dev) for s in shapes]
        shards = [shard(f, W, rank) for f in fulls]
        n = L.padded_numels(shapes, W)
        N = sum(n)
        gathered = torch.randn(W * N, device=dev, dtype=torch.bfloat16)
        reduced = torch.randn(N, device=dev)
        numels = [math.prod(s) for s in shapes]
        m = [s.numel() for s in shards]
        calls = {  # kernel: (bytes moved, call(impl))
            "all_gather_copy_in": (sum(m) * 4 + N * 2, lambda impl: K.all_gather_copy_in(shards, shapes, W, rank, torch.bfloat16, impl=impl)),
            "all_gather_copy_out": (sum(numels) * 4, lambda impl: K.all_gather_copy_out(gathered, shapes, W, impl=impl)),
            "reduce_scatter_copy_in": (sum(numels) * 4 + W * N * 4, lambda impl: K.reduce_scatter_copy_in(fulls, W, impl=impl)),
            "reduce_scatter_copy_out": (sum(m) * 8, lambda impl: K.reduce_scatter_copy_out(reduced, shapes, W, rank, impl=impl)),
        }
        big = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        big2 = torch.empty_like(big)
        t_d2d = H.median_s(lambda: big2.copy_(big), args.repeats, args.warmup, sync)
        d2d_GBps = 2 * big.numel() / t_d2d / 1e9  # read + written
        for kernel, (nbytes, call) in calls.items():
            row = {"workload": wname, "kernel": kernel, "bytes": nbytes, "d2d_GBps": d2d_GBps}
            for impl in ("triton", "torch"):
                t = H.median_s(lambda: call(impl), args.repeats, args.warmup, sync)
                row[f"{impl}_GBps"] = nbytes / t / 1e9
                row[f"{impl}_vs_d2d"] = row[f"{impl}_GBps"] / d2d_GBps
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    call(impl)
                    sync()
                row[f"{impl}_device_kernels"] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
            before = C.LAUNCHES[kernel]
            call("triton")
            row["triton_launches"] = C.LAUNCHES[kernel] - before
            rows.append(row)
            print(
                f"{wname:12s} {kernel:24s} triton {row['triton_GBps']:7.1f} GB/s ({row['triton_vs_d2d']:.2f}x d2d, "
                f"{row['triton_launches']} launch, {row['triton_device_kernels']} device kernels)  torch "
                f"{row['torch_GBps']:7.1f} GB/s ({row['torch_device_kernels']} device kernels)   d2d {d2d_GBps:.1f} GB/s",
                flush=True,
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--rank", type=int, default=3)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads for the CPU part")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    print(f"CPU, torch implementation, world_size={args.world_size}, rank={args.rank}, {args.threads} thread(s)")
    print(HEADER)
    cpu = bench_cpu(args)
    print()
    cuda = bench_cuda(args)
    if isinstance(cuda, str):
        print("CUDA:", cuda)
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
    H.write_json(str(args.out), result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
