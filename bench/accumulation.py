"""Gradient accumulation without gradient sync: eager FSDP2 versus fsdp_compile, per optimizer step.

    torchrun --nproc-per-node 2 bench/accumulation.py [--model small] [--micro 4] [--steps 6] [--backend inductor]

Each optimizer step runs ``--micro`` micro-batches, then AdamW. Variants (same seed, batches, optimizer):
  eager:sync       fully_shard, every micro-batch reduce-scatters its gradients
  eager:no_sync    set_requires_gradient_sync(False) on all micro-batches but the last (FSDP2's no_sync)
  fc:sync          fsdp_compile.compile on the same model, reduce-scatter every micro-batch
  fc:no_sync       fsdp_compile.compile with gradient sync off but on the last micro-batch
Per variant: median optimizer-step time over timed steps run round-robin (drift hits every variant alike),
bytes communicated per optimizer step (all-gather outputs, reduce-scatter inputs, all-reduce tensors:
counted at torch.distributed for eager, in the compiled graphs that ran for fsdp_compile), the final loss.
Writes bench/results/accumulation_<model>.json. Gloo on CPU; NCCL when CUDA is present.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

# a fresh Inductor cache: the bytes are read from the graphs our passes see, which a cache hit skips
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fsdp_compile_bench_")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, os.path.dirname(__file__))
import _harness as H  # noqa: E402

import fsdp_compile as fc  # noqa: E402
from fsdp_compile.models import SIZES, Llama, llama_blocks  # noqa: E402
from fsdp_compile.report import collective_bytes  # noqa: E402

KINDS = ("all_gathers", "reduce_scatters", "all_reduces")


@contextlib.contextmanager
def eager_bytes():
    """Bytes handed to torch.distributed's all-gather, reduce-scatter and all-reduce within the block."""
    counts = dict.fromkeys(KINDS, 0)
    where = {  # function: (kind, the argument holding the full buffer: keyword, position)
        "all_gather_into_tensor": ("all_gathers", "output_tensor", 0),
        "all_gather_single": ("all_gathers", "output_tensor", 0),  # what FSDP2 calls in torch 2.13
        "reduce_scatter_tensor": ("reduce_scatters", "input", 1),
        "reduce_scatter_single": ("reduce_scatters", "input", 1),
        "all_reduce": ("all_reduces", "tensor", 0),
    }
    saved = {name: getattr(dist, name) for name in where if hasattr(dist, name)}
    depth = [0]  # one collective counted once, should one of these call another

    def counting(name):
        kind, key, pos = where[name]

        def fn(*args, **kwargs):
            if depth[0] == 0:
                t = kwargs[key] if key in kwargs else args[pos]
                counts[kind] += t.numel() * t.element_size()
            depth[0] += 1
            try:
                return saved[name](*args, **kwargs)
            finally:
                depth[0] -= 1

        return fn

    for name in saved:
        setattr(dist, name, counting(name))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


class Variant:
    def __init__(self, name: str, args, device):
        self.name, self.micro = name, args.micro
        self.no_sync = name.endswith("no_sync")
        torch.manual_seed(0)
        with torch.device(device):
            model = Llama(SIZES[args.model])
        for block in llama_blocks(model):
            fully_shard(block)
        self.model = fully_shard(model)
        self.runner = fc.compile(model, backend=args.backend) if name.startswith("fc") else model
        self.opt = H.adamw(model.parameters(), 3e-3, args.optimizer)
        self.times: list[float] = []
        self.first_step_s = None
        self.bytes: dict[str, int] | None = None
        self.mode_graphs: dict[bool, list] = {}  # fc: gradient sync on/off -> the graphs that mode runs
        self.loss = None

    def step(self, batches) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        with eager_bytes() as eager:
            for i, tokens in enumerate(batches):
                sync = not self.no_sync or i == len(batches) - 1
                self.model.set_requires_gradient_sync(sync)
                captured = getattr(self.runner, "captured", None)
                n_f, n_b = (len(captured.forward), len(captured.backward)) if captured else (0, 0)
                logits = self.runner(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
                loss.backward()
                if captured and len(captured.forward) > n_f:  # this mode compiled now: its graphs
                    self.mode_graphs[sync] = captured.forward[n_f:] + captured.backward[n_b:]
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            if batches[0].is_cuda:
                torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.loss = loss.item()
        if self.name.startswith("fc"):
            per_mode = {sync: collective_bytes(gs) for sync, gs in self.mode_graphs.items()}
            n_sync = 1 if self.no_sync else self.micro
            self.bytes = {k: n_sync * per_mode[True][k] + (self.micro - n_sync) * per_mode.get(False, {}).get(k, 0) for k in KINDS}
            self.bytes["eager_calls_bytes"] = sum(eager.values())  # 0: no eager collective ran
        else:
            self.bytes = dict(eager)
        return dt


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=sorted(SIZES))
    ap.add_argument("--micro", type=int, default=4, help="micro-batches per optimizer step")
    ap.add_argument("--steps", type=int, default=6, help="timed optimizer steps per variant (after 2 warm-up steps)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    H.add_optimizer_arg(ap)
    args = ap.parse_args()
    if "RANK" not in os.environ:
        ap.error("launch with torchrun, e.g.: torchrun --nproc-per-node 2 bench/accumulation.py")
    device, rank, world, say = H.init_ranks(timeout_s=900)
    vocab = SIZES[args.model].vocab
    variants = [Variant(name, args, device) for name in ("eager:sync", "eager:no_sync", "fc:sync", "fc:no_sync")]
    say(f"accumulation: '{args.model}', {world} ranks ({dist.get_backend()}), backend={args.backend}, "
        f"{args.micro} micro-batches of {args.batch} x {args.seq} per optimizer step")

    def batches(step: int):
        g = torch.Generator().manual_seed(1000 * step + rank)
        return [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g).to(device) for _ in range(args.micro)]

    progress = H.Progress(len(variants) * (2 + args.steps), enabled=rank == 0)
    for v in variants:  # warm-up: the first optimizer step compiles (both modes, for no_sync)
        v.first_step_s = v.step(batches(0))
        progress.step(f"{v.name}: first step {v.first_step_s:.1f}s")
        v.step(batches(1))
        progress.step(f"{v.name}: warm-up")
    for s in range(args.steps):  # round-robin: one optimizer step of each variant in turn
        for v in variants:
            v.times.append(v.step(batches(2 + s)))
            progress.step(f"{v.name}: step {s}")
    progress.close()

    by = {v.name: v for v in variants}
    rows = []
    for v in variants:
        stats = H.summarize(v.times)
        mib = {k: v.bytes[k] / 2**20 for k in KINDS}
        rows.append({"variant": v.name, "first_step_s": v.first_step_s, **stats, "mib": mib, "loss": v.loss,
                     "eager_calls_bytes": v.bytes.get("eager_calls_bytes")})
    say("\n| variant | median ms | vs eager same mode | MiB all-gathered | MiB reduce-scattered | MiB total | vs sync | loss |")
    say("|---|---|---|---|---|---|---|---|")
    for r in rows:
        same = "eager:" + r["variant"].split(":")[1]
        base = next(x for x in rows if x["variant"] == same)
        sync = next(x for x in rows if x["variant"] == r["variant"].split(":")[0] + ":sync")
        total, sync_total = sum(r["mib"].values()), sum(sync["mib"].values())
        vs_sync = f"{total / sync_total:.2f}x" if sync_total else "-"
        say(f"| {r['variant']} | {r['median_step_s'] * 1e3:.1f} | {r['median_step_s'] / base['median_step_s']:.2f}x | "
            f"{r['mib']['all_gathers']:.1f} | {r['mib']['reduce_scatters']:.1f} | {total:.1f} | {vs_sync} | "
            f"{r['loss']:.6f} |")
    if rank == 0:
        H.write_json(os.path.join(args.out, f"accumulation_{args.model}.json"), {
            "machine": H.machine(), "args": vars(args), "world_size": world, "rows": rows,
            "loss_diff_no_sync": abs(by["fc:no_sync"].loss - by["eager:no_sync"].loss),
        })
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
