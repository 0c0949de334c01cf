"""``compiled_vs_eager.py --pp N``: pipeline parallelism with FSDP stages, eager against ``fc.compile_stage``.

The stage split and schedule of tests/test_pipeline_multirank.py: our Llama cut into N stages (its share of the
blocks each, the embedding with the first, norm and output with the last), one stage per rank of the pp dim of a
(N, world/N) mesh, ``fully_shard`` per block and per stage over the dp dim, ``Schedule1F1B`` with 4 micro-batches
(the batch is split into them: --batch 4 gives micro-batches of 1 sequence). Each dp replica trains on its own
batch. Variants:
  eager          the stages as fully_shard left them (FSDP2's hooks, its no-sync micro-batches, REDUCE_GRAD)
  fc             each stage's module compiled by fc.compile_stage and handed to PipelineStage
  compute-only   the same stages unsharded and torch.compile'd: no FSDP collectives, the pp send/recv stay
                 (the bound a perfect overlap of the dp collectives would reach; the pipeline bubble stays too;
                 its dp replicas average no gradients, so its loss is not eager's)
Bytes per step per mesh dim, per rank, each collective's full buffer: dp as compiled_vs_eager counts it (eager:
FSDP2's c10d calls as they run; fc: the collectives of its forward and backward graphs times the micro-batches
that ran them, plus the reduce-scatter it runs eagerly at REDUCE_GRAD); pp: the bytes of the activations and
gradients this rank sends (``isend``) in the schedule's P2P batches; rank 0's dp bytes by source too. Times are rank 0's (the first stage: a
pipeline step ends on every rank within the last stage's backward); the loss is the last stage's, averaged over
its micro-batches.
"""

from __future__ import annotations

import contextlib
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as schedules
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import _harness as H

import fsdp_compile as fc
import fsdp_compile._pipeline as pipeline
from fsdp_compile.models import Llama

MICROBATCHES = 4  # as tests/test_pipeline_multirank.py
PP_VARIANTS = ["eager", "fc", "compute-only"]


def _loss(out, target):
    return F.cross_entropy(out.flatten(0, 1).float(), target.flatten())


class PPVariant:
    def __init__(self, name, sizes, mesh, device, backend, mp, optimizer):
        from test_pipeline_multirank import LlamaStage  # the test's split

        self.name, self.times, self.first_step_s, self.loss = name, [], None, None
        self.pp, n = mesh["pp"].get_local_rank(), mesh["pp"].size()
        torch.manual_seed(0)
        with torch.device(device):
            self.module = LlamaStage(Llama(sizes), self.pp, n)
        if name == "compute-only":
            runner = torch.compile(self.module.to(mp.param_dtype) if mp else self.module, backend=backend)
        else:
            for block in self.module.layers:
                fully_shard(block, mesh=mesh["dp"], mp_policy=mp or MixedPrecisionPolicy())
            fully_shard(self.module, mesh=mesh["dp"], mp_policy=mp or MixedPrecisionPolicy())
            runner = self.module if name == "eager" else fc.compile_stage(self.module, backend=backend)
        self.runner = runner
        stage = PipelineStage(runner, self.pp, n, device, group=mesh["pp"].get_group())
        self.schedule = Schedule1F1B(stage, MICROBATCHES, loss_fn=_loss)
        self.opt = H.adamw(self.module.parameters(), 3e-3, optimizer)
        self.last = self.pp == n - 1

    def step(self, tokens: torch.Tensor) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        losses = []
        if self.pp == 0:
            self.schedule.step(tokens[:, :-1])
        elif self.last:
            self.schedule.step(target=tokens[:, 1:], losses=losses)
        else:
            self.schedule.step()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        if losses:
            self.loss = sum(loss.item() for loss in losses) / len(losses)
        return dt


@contextlib.contextmanager
def counting(v: PPVariant, BytesByDim, graph_bytes_per_dim, dims: dict):
    """Yields {mesh dim: bytes} of one step of ``v`` (the module docstring's convention), with "dp_detail": where
    the dp bytes come from (eager: its c10d calls by name; fc: its graphs per micro-batch and REDUCE_GRAD)."""
    from eager_calls import count_eager_collectives

    out = {"dp": 0, "pp": 0, "dp_detail": {}}
    real_p2p, real_rs = schedules._batch_p2p, pipeline.reduce_scatter

    def p2p(ops, desc=None):
        out["pp"] += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return real_p2p(ops, desc)

    def rs(args, grads, params):  # the reduce-scatter's input, as graphs count it
        nbytes = sum(g.numel() * g.element_size() for g in grads)
        out["dp_detail"]["REDUCE_GRAD reduce-scatters"] = out["dp_detail"].get("REDUCE_GRAD reduce-scatters", 0) + nbytes
        out["dp"] += nbytes
        return real_rs(args, grads, params)

    count = BytesByDim({g: d for g, d in dims.items() if d == "dp"})
    schedules._batch_p2p, pipeline.reduce_scatter = p2p, rs
    try:
        with count if v.name == "eager" else contextlib.nullcontext(), count_eager_collectives() as calls:
            yield out
    finally:
        schedules._batch_p2p, pipeline.reduce_scatter = real_p2p, real_rs
    for name, nbytes in zip(calls, calls.bytes):
        if "send" not in name and "recv" not in name and "barrier" not in name:
            out["dp_detail"][f"eager {name}"] = out["dp_detail"].get(f"eager {name}", 0) + nbytes
    if v.name == "eager":
        out["dp"] += count.bytes.get("dp", 0)
    elif getattr(v.runner, "captured", None) is not None:  # every micro-batch runs the stage's one forward and backward graph
        for kind, graphs in (("forward", v.runner.captured.forward[:1]), ("backward", v.runner.captured.backward[:1])):
            per = BytesByDim(dims)
            graph_bytes_per_dim(graphs, per)
            out["dp_detail"][f"{kind} graph x {MICROBATCHES}"] = MICROBATCHES * per.bytes.get("dp", 0)
            out["dp"] += MICROBATCHES * per.bytes.get("dp", 0)


def run_pipeline(args, sizes, mp, batch, BytesByDim, graph_bytes_per_dim):
    """compiled_vs_eager's main for --pp (``sizes``: the model's LlamaArgs, ``mp``: its MixedPrecisionPolicy or
    None; ``batch``, ``BytesByDim``, ``graph_bytes_per_dim``: its helpers)."""
    device, rank, world, say = H.init_ranks(timeout_s=900)
    mesh = init_device_mesh(device.type, (args.pp, world // args.pp), mesh_dim_names=("pp", "dp"))
    dp = mesh["dp"].get_local_rank()
    dims = {mesh["dp"].get_group().group_name: "dp", mesh["pp"].get_group().group_name: "pp"}
    names = [n for n in PP_VARIANTS if n == "eager" or not args.variants or n in args.variants]
    variants = [PPVariant(n, sizes, mesh, device, args.backend, mp, args.optimizer) for n in names]
    say(f"compiled_vs_eager --pp {args.pp}: '{args.model}', {world} ranks ({dist.get_backend()}), pp {args.pp} x dp "
        f"{world // args.pp}, Schedule1F1B, {MICROBATCHES} micro-batches of a {args.batch} x {args.seq} batch per dp "
        f"replica, backend={args.backend}" + (f", mixed precision {args.mp}" if args.mp else ""))
    step_no = {v.name: 0 for v in variants}
    vocab = sizes.vocab

    def run(v, n, timed):
        for _ in range(n):
            dt = v.step(batch(step_no[v.name], dp, vocab, device, args.batch, args.seq))
            step_no[v.name] += 1
            if timed:
                v.times.append(dt)
            elif v.first_step_s is None:
                v.first_step_s = dt

    per_dim = {}
    for v in variants:
        with H.cold_compile(not args.warm_cache):
            run(v, 1, timed=False)
        with counting(v, BytesByDim, graph_bytes_per_dim, dims) as counted:
            run(v, 1, timed=False)
        per_dim[v.name] = counted
        say(f"  {v.name}: first step {v.first_step_s:.1f} s")
    windows = -(-args.steps // args.window)
    for w in range(windows):
        for v in variants:
            run(v, min(args.window, args.steps - w * args.window), timed=True)
    # every rank's bytes (stages differ: the first sends activations, the last gradients) and the last stage's loss
    mine = {v.name: {"bytes_per_dim": per_dim[v.name], "loss": v.loss} for v in variants}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    results = {}
    base = H.summarize(variants[0].times)["median_step_s"]
    for v in variants:
        loss = next(r[v.name]["loss"] for r in everyone if r[v.name]["loss"] is not None)
        eager_loss = next(r["eager"]["loss"] for r in everyone if r["eager"]["loss"] is not None)
        stats = H.summarize(v.times)
        results[v.name] = {
            **stats, "first_step_s": v.first_step_s, "ratio_vs_eager": stats["median_step_s"] / base,
            "collective_bytes_per_dim_by_rank": [{d: b for d, b in r[v.name]["bytes_per_dim"].items() if d != "dp_detail"}
                                                 for r in everyone],
            "dp_detail_rank0": everyone[0][v.name]["bytes_per_dim"]["dp_detail"],
            "final_loss": loss, "final_loss_delta_vs_eager": abs(loss - eager_loss),
        }
    say("\n| variant | median ms | p10-p90 ms | vs eager | first step s | final loss (Δ vs eager) |\n|---|---|---|---|---|---|")
    for name, r in results.items():
        say(f"| {name} | {r['median_step_s'] * 1e3:.1f} | {r['p10_step_s'] * 1e3:.1f}-{r['p90_step_s'] * 1e3:.1f} | "
            f"{r['ratio_vs_eager']:.2f}x | {r['first_step_s']:.1f} | {r['final_loss']:.5f} ({r['final_loss_delta_vs_eager']:.1e}) |")
    say("\ncollective MB per step per rank by mesh dim (dp: FSDP's collectives; pp: bytes sent)\n"
        "| variant | " + " | ".join(f"rank {i} dp | rank {i} pp" for i in range(world)) + " |\n|---|" + "---|---|" * world)
    for name, r in results.items():
        say(f"| {name} | " + " | ".join(f"{b['dp'] / 1e6:.3f} | {b['pp'] / 1e6:.3f}" for b in r["collective_bytes_per_dim_by_rank"]) + " |")
    for name, r in results.items():
        say(f"{name} rank 0 dp bytes by source: {r['dp_detail_rank0']}")
    bound = results.get("compute-only")
    if bound and "fc" in results:
        say(f"fc: {results['fc']['ratio_vs_eager']:.2f}x eager, {results['fc']['median_step_s'] / bound['median_step_s']:.2f}x "
            "the compute-only bound")
    if rank == 0:
        stem = args.stem or f"compiled_vs_eager_{args.model}_pp{args.pp}"
        H.write_json(os.path.join(args.out, f"{stem}.json"), {
            "config": vars(args) | {"world_size": world, "device": str(device)},
            "pipeline": {"schedule": "1F1B", "microbatches": MICROBATCHES, "mesh": {"pp": args.pp, "dp": world // args.pp}},
            "machine": H.machine(), "what": __doc__.strip(), "variants": results})
        H.bar_chart(os.path.join(args.out, f"{stem}.png"), list(results),
                    [r["median_step_s"] * 1e3 for r in results.values()],
                    [(r["p10_step_s"] * 1e3, r["p90_step_s"] * 1e3) for r in results.values()],
                    f"'{args.model}', {world} ranks pp {args.pp} x dp {world // args.pp}, {device.type}: step time", "ms per step")
        say(f"wrote {args.out}/{stem}.json and .png")
    dist.destroy_process_group()
