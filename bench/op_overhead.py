"""Host time per call of the four fsdp_compile copy ops, called as a compiled graph calls them.

    python3 bench/op_overhead.py [--device cpu|cuda] [--world-size 8] [--calls 200] [--profile]

Inductor's wrapper calls each op as an extern kernel, ``torch.ops.fsdp_compile.<op>.default(...)``, once
per FSDP unit and direction: on a GPU the step is host-bound when these calls take longer than their
kernels run (a 0.95B Llama on one H100, 2026-11-26: 32 + 32 + 17 + 17 calls per step took 59 ms of host
time under the profiler while the GPU sat idle 100 ms of a 181 ms step). Here each op is called
``--calls`` times back to back on one 0.95B-Llama block's parameters (dim 2048, FFN 5632: 9 tensors,
fp32 -> bf16 for the all-gather, bf16 -> fp32 for the reduce-scatter) without synchronizing, so the host
time per call is the time to queue it: argument checks, dispatch, output allocation, the pointer tables
and the launch, not the copy (unless the device's queue fills). On CPU the torch implementation runs the
copies on the host, so CPU figures include the copy itself: use small shapes (``--dim``) to see the
overhead alone. ``--profile``: cProfile's 25
largest own-time entries for each op. Prints a table; writes nothing.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401  (registers torch.ops.fsdp.*)

from fsdp_compile import _layout as L
from fsdp_compile.kernels import _common as C


def block_shapes(dim: int, ffn: int) -> list[tuple[int, ...]]:
    return [(dim, dim)] * 4 + [(ffn, dim), (dim, ffn), (ffn, dim), (dim,), (dim,)]


def cases(shapes, world_size: int, device: torch.device, impl: str):
    """name -> a zero-argument call, as Inductor's wrapper makes it."""
    ops = torch.ops.fsdp_compile
    fulls = [torch.randn(s, device=device) for s in shapes]
    rank = 0
    shards = [f[: L.rank_rows(s[0], world_size, rank)] for f, s in zip(fulls, shapes)]
    dim0s = [s[0] for s in shapes]
    flat, ndims = C.flatten_shapes(shapes)
    n = L.padded_numels(shapes, world_size)
    gathered = torch.randn(world_size * sum(n), device=device, dtype=torch.bfloat16)
    grads = [torch.randn(s, device=device, dtype=torch.bfloat16) for s in shapes]
    reduced = torch.randn(sum(n), device=device)
    bf16, f32 = torch.bfloat16, torch.float32
    return {
        "all_gather_copy_in": lambda: ops.all_gather_copy_in.default(shards, dim0s, world_size, rank, bf16, impl),
        "all_gather_copy_out": lambda: ops.all_gather_copy_out.default(gathered, flat, ndims, world_size, None, impl),
        "reduce_scatter_copy_in": lambda: ops.reduce_scatter_copy_in.default(grads, world_size, f32, impl),
        "reduce_scatter_copy_out": lambda: ops.reduce_scatter_copy_out.default(reduced, flat, ndims, world_size, rank, None, impl),
    }


def host_us(fn, calls: int, sync) -> float:
    """Median over 5 rounds of the host time per call of ``calls`` unsynchronized calls."""
    rounds = []
    for _ in range(6):
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--dim", type=int, default=2048, help="model dim (FFN = 2.75 x dim); small dims isolate the overhead on CPU")
    ap.add_argument("--profile", action="store_true", help="cProfile each op's calls")
    args = ap.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    shapes = block_shapes(args.dim, args.dim * 11 // 4)
    impls = ["triton", "torch"] if device.type == "cuda" else ["torch"]
    print(f"op_overhead: {device}{' ' + torch.cuda.get_device_name() if device.type == 'cuda' else ''}, W={args.world_size}, "
          f"{len(shapes)} tensors ({sum(torch.Size(s).numel() for s in shapes) / 1e6:.1f}M parameters), "
          f"{args.calls} calls per round, torch {torch.__version__}")
    print(f"| op | {' | '.join(f'{i}, us per call' for i in impls)} |")
    print("|---|" + "---|" * len(impls))
    profiles = {}
    for impl in impls:
        for name, fn in cases(shapes, args.world_size, device, impl).items():
            fn()  # compile / warm caches
            profiles.setdefault(name, {})[impl] = host_us(fn, args.calls, sync)
            if args.profile and impl == impls[0]:
                sync()
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.calls):
                    fn()
                prof.disable()
                profiles[name]["stats"] = prof
    for name, row in profiles.items():
        print(f"| {name} | " + " | ".join(f"{row[i]:.1f}" for i in impls) + " |")
    for name, row in profiles.items():
        if "stats" in row:
            print(f"\n== {name} ({impls[0]}), own time, {args.calls} calls")
            pstats.Stats(row["stats"]).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
