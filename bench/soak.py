"""Long runs stay flat: 200 compiled steps beside eager FSDP2, recompiles, memory and losses.

    torchrun --nproc-per-node 2 bench/soak.py [--steps 200] [--backend aot_eager]

Each rank trains the tiny Llama twice from the same seed and data: eager ``fully_shard`` and
``fsdp_compile.compile`` (AdamW, a new batch every step, sequence lengths cycling through 3 values so that
automatic dynamic shapes settle). Reports, from step 50 (after warm-up) to the last step: Dynamo graphs
compiled after warm-up (recompiles; target 0), the process's resident memory (RSS) and the tensor bytes one
step allocates at its peak (the CPU profiler's allocation events, or torch.cuda's counters), each the median
of three same-shape steps from step 50 and of three ending at the last step (target: within 2%), and the
compiled loss against eager's every 50 steps (target: equal under
aot_eager). Writes bench/results/soak.json.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(__file__))
import _harness as H  # noqa: E402

import fsdp_compile as fc  # noqa: E402
from fsdp_compile.models import SIZES, Llama, llama_blocks  # noqa: E402

SEQS = (32, 48, 64)


def build():
    torch.manual_seed(0)
    model = Llama(SIZES["tiny"])
    for block in llama_blocks(model):
        fully_shard(block)
    return fully_shard(model)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--backend", default="aot_eager", choices=["aot_eager", "inductor"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if "RANK" not in os.environ:
        ap.error("launch with torchrun, e.g.: torchrun --nproc-per-node 2 bench/soak.py")
    torch.set_num_threads(1)
    fc.single_thread_gloo()  # torch's gloo races between its worker threads (fsdp_compile/_torch/_gloo.py)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank = dist.get_rank()
    device = torch.device("cpu")
    vocab = SIZES["tiny"].vocab
    eager, model = build(), build()
    compiled = fc.compile(model, backend=args.backend)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, model)]

    def step(i: int, runner, opt) -> float:
        g = torch.Generator().manual_seed(1000 * i + rank)
        tokens = torch.randint(0, vocab, (4, SEQS[i % len(SEQS)] + 1), generator=g)
        loss = F.cross_entropy(runner(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    warm, marks, rows, graphs_at_warm = 50, {}, [], None
    # three steps of the same shapes at each end, each end summarized by its median: on CPU the peak of one
    # step varied by up to 25% between same-shape steps (2.8 to 3.7 MiB), without a trend
    cycle = len(SEQS)
    ends = {"start": [warm + k * cycle for k in range(3)], "end": [args.steps - k * cycle for k in (2, 1, 0)]}
    profiled = set(ends["start"] + ends["end"])
    for i in range(args.steps):
        le = step(i, eager, opts[0])
        if i + 1 in profiled:  # allocation peak and RSS at both ends
            out = {}
            peak = H.step_peak_bytes(lambda: out.update(loss=step(i, compiled, opts[1])), device)
            marks[i + 1] = {"step_peak_bytes": peak, "rss_bytes": rss_bytes()}
            lc = out["loss"]
        else:
            lc = step(i, compiled, opts[1])
        if i + 1 == warm:
            graphs_at_warm = len(compiled.captured.dynamo)
        if (i + 1) % 50 == 0:
            rows.append({"step": i + 1, "loss_eager": le, "loss_compiled": lc, "equal": le == lc})
    recompiles = len(compiled.captured.dynamo) - graphs_at_warm
    keys = ("step_peak_bytes", "rss_bytes")
    first, last = ({k: statistics.median(marks[i][k] for i in ends[e]) for k in keys} for e in ("start", "end"))
    drift = {k: (last[k] - first[k]) / first[k] if first[k] else 0.0 for k in keys}
    if rank == 0:
        print(f"soak: {args.steps} compiled steps on {dist.get_world_size()} ranks ({args.backend}), tiny Llama, "
              f"sequence lengths cycling {SEQS}")
        print(f"Dynamo graphs: {graphs_at_warm} by step {warm}, {recompiles} more after it (recompiles)")
        for k in keys:
            each = ", ".join(f"{i}: {marks[i][k] / 2**20:.2f}" for i in sorted(profiled))
            print(f"{k}: median of steps {ends['start']} {first[k] / 2**20:.2f} MiB, of steps {ends['end']} "
                  f"{last[k] / 2**20:.2f} MiB ({100 * drift[k]:+.2f}%); each step (MiB): {each}")
        print("| step | eager loss | compiled loss | equal |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['step']} | {r['loss_eager']:.6f} | {r['loss_compiled']:.6f} | {r['equal']} |")
        H.write_json(os.path.join(args.out, "soak.json"), {
            "machine": H.machine(), "config": vars(args), "recompiles_after_warmup": recompiles,
            "dynamo_graphs_by_warmup": graphs_at_warm, "memory": {str(k): v for k, v in marks.items()},
            "ends": ends, "drift_of_medians": drift, "losses": rows,
        })
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
