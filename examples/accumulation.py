"""Gradient accumulation in bf16 with FSDP2 + fsdp_compile, checked against eager FSDP2 (2 ranks).

    torchrun --nproc-per-node 2 examples/accumulation.py [--backend inductor|aot_eager] [--steps 4] [--micro 4]

Each optimizer step runs ``--micro`` micro-batches. All but the last run with
``model.set_requires_gradient_sync(False)``: no reduce-scatter, FSDP2 keeps the unsharded gradients and
adds to them; the last micro-batch syncs, reduce-scattering the sum once. Parameters are sharded in fp32
and computed in bf16 (``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``). The same
loop runs on an eager FSDP2 copy of the model, from the same seed on the same data: under ``aot_eager``
the losses must be equal bit for bit; Inductor fuses kernels and rounds differently in bf16, so the
script prints the difference and only fails past a loose bound. NCCL where every rank has a GPU,
else gloo on CPU.
"""

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import fsdp_compile as fc
from fsdp_compile.models import Llama, LlamaArgs

ARGS = LlamaArgs(vocab=256, dim=64, n_layers=4, n_heads=4, ffn_dim=160, max_seq=64)
BATCH, SEQ = 2, 32


def init_distributed() -> torch.device:
    if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):  # a GPU for every rank: NCCL
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    fc.single_thread_gloo()  # before init: torch's gloo can race between its two worker threads
    dist.init_process_group("gloo")
    return torch.device("cpu")


def build(device: torch.device) -> torch.nn.Module:
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(0)
    with device:
        model = Llama(ARGS)
    for block in model.layers:
        fully_shard(block, mp_policy=mp)
    return fully_shard(model, mp_policy=mp)


def batch(step: int, micro: int, device: torch.device) -> torch.Tensor:
    # a learnable stream, different on every rank and micro-batch
    g = torch.Generator().manual_seed(10_000 * dist.get_rank() + 100 * step + micro)
    start = torch.randint(0, ARGS.vocab, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    return ((start + stride * torch.arange(SEQ + 1)) % ARGS.vocab).to(device)


def train_step(model, forward, opt, step: int, n_micro: int, device) -> float:
    """One optimizer step over n_micro micro-batches; returns the mean micro-batch loss."""
    total = 0.0
    for micro in range(n_micro):
        model.set_requires_gradient_sync(micro == n_micro - 1)  # sync (reduce-scatter) on the last only
        seq = batch(step, micro, device)
        logits = forward(seq[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), seq[:, 1:].flatten()) / n_micro
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    opt.zero_grad()
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--micro", type=int, default=4, help="micro-batches per optimizer step")
    args = parser.parse_args()
    if "LOCAL_WORLD_SIZE" not in os.environ:
        parser.error("launch with torchrun, e.g.: torchrun --nproc-per-node 2 examples/accumulation.py")
    device = init_distributed()
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)

    eager = build(device)
    model = build(device)
    compiled = fc.compile(model, backend=args.backend)
    opts = [torch.optim.AdamW(m.parameters(), lr=3e-3) for m in (eager, model)]

    say(f"{args.micro} micro-batches per step, bf16 compute, {dist.get_world_size()} ranks ({device.type}), "
        f"backend={args.backend}")
    say("step | eager FSDP2 loss | compiled loss | |diff|")
    worst = 0.0
    for step in range(args.steps):
        le = train_step(eager, eager, opts[0], step, args.micro, device)
        lc = train_step(model, compiled, opts[1], step, args.micro, device)  # the first call compiles
        say(f"{step:4d} | {le:15.6f} | {lc:13.6f} | {abs(le - lc):.1e}")
        if not math.isfinite(lc):
            raise SystemExit(f"rank {rank}: step {step}: compiled loss is {lc}")
        worst = max(worst, abs(le - lc) / abs(le))

    # the updated fp32 shards, parameter by parameter
    param_diff = max((a.to_local() - b.to_local()).abs().max().item()
                     for a, b in zip(eager.parameters(), model.parameters()))
    say(f"largest differences from eager FSDP2: loss {worst:.1e} (relative), parameters {param_diff:.1e}")
    if args.backend == "aot_eager" and (worst, param_diff) != (0.0, 0.0):
        raise SystemExit(f"rank {rank}: under aot_eager, losses and parameters must equal eager FSDP2's")
    if worst > 2e-2:
        raise SystemExit(f"rank {rank}: compiled losses are {worst:.1e} (relative) from eager FSDP2's")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
