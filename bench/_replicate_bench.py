"""``compiled_vs_eager.py --replicate``: plain data parallelism (issue 51), FSDP2's ``replicate`` against DDP.

The model of ``--model`` (HF Llama or our Llama), every rank its own batch, AdamW, the interleaved windows,
peak-memory steps and CPU floor of compiled_vs_eager. Variants (each its own model from the same seed):
  eager             ``torch.distributed._composable.replicate_with_fsdp.replicate`` per block and on the root
                    (FSDP2's DDPMeshInfo: one all-reduce per module in its post-backward, as it runs eagerly)
  ddp+torch.compile torch's ``DistributedDataParallel`` (default buckets: 1 MiB first, 25 MiB after) under
                    ``torch.compile``: Dynamo's DDPOptimizer splits the graph at each gradient bucket and
                    compiles each piece on its own, so DDP's C++ reducer can all-reduce a bucket between them
  compute-only      the same model, no data parallelism, torch.compile'd: the bound a perfect overlap reaches
  fc                ``fc.compile`` of the eager variant's structure (the default config)
  fc:one-bucket     the same with every module's gradients in one all-reduce (an explicit bucket plan of every
                    replicated module), issued after the backward as DDP's single bucket
  fc:free-overlap   fc planned with cpu-gloo's comm_cpu_share at 0 (compiled_vs_eager's variant of that name)
  fc:fsdp_group     one all-reduce per replicated module, each waited at once (not reordered): no overlap
  fc:no-reorder     fc's default buckets, each waited at once (not reordered)
  comm-only         fc's collectives alone (compiled_vs_eager's CommOnly): with compute-only, the CPU floor
Graphs per variant, counted over its two warm-up steps: Dynamo's graphs and graph breaks (torch's counters) and,
for DDP, DDPOptimizer's buckets (each one compiled subgraph; the splits are not Dynamo graph breaks but cut the
step as one: ``buckets - 1`` places where compiled code hands back to DDP's reducer). Collectives per step and
bytes (each all-reduce's tensor): eager, FSDP2's c10d calls as they run; fc, its graphs; DDP, its reducer's
buckets (C++ calls no Python hook sees: read from DDP's logging data, the gradients' bytes).
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

import _harness as H

import fsdp_compile as fc

REPLICATE_VARIANTS = ["eager", "ddp+torch.compile", "compute-only", "fc", "comm-only", "fc:one-bucket", "fc:free-overlap",
                      "fc:fsdp_group", "fc:no-reorder"]


def _blocks(model: torch.nn.Module, model_name: str) -> list[torch.nn.Module]:
    """The blocks ``replicated`` wraps before the root."""
    from fsdp_compile.models import llama_blocks

    return list(model.model.layers if model_name == "hf-llama" else llama_blocks(model))


def replicated(model: torch.nn.Module, model_name: str) -> torch.nn.Module:
    from torch.distributed._composable.replicate_with_fsdp import replicate

    for block in _blocks(model, model_name):
        replicate(block)
    return replicate(model)


def replicated_fqns(model: torch.nn.Module, model_name: str) -> tuple[str, ...]:
    """The FQNs of the modules ``replicated`` wraps, blocks first, the root ("") last."""
    names = {m: n for n, m in model.named_modules()}
    return (*(names[b] for b in _blocks(model, model_name)), "")


def compile_replicated(name: str, model: torch.nn.Module, model_name: str, backend: str, cve):
    """Variant ``name``'s fc compile of ``model`` (already ``replicated``): ``fc``, ``fc:one-bucket`` (every
    replicated module in one bucket), or another of compiled_vs_eager's fc variants (``cve.FC_OVERRIDES``)."""
    if name == "fc:one-bucket":  # every gradient in one all-reduce after the backward, as DDP's one bucket
        return fc.compile(model, backend=backend, bucket=(replicated_fqns(model, model_name),))
    return fc.compile(model, backend=backend, **cve.FC_OVERRIDES.get(name, {}))


def ddp_optimizer_buckets():
    """Counts DDPOptimizer's buckets: it prints them (``pretty_print_buckets``) once per graph it splits."""
    import torch._dynamo.backends.distributed as ddp_backend

    seen, real = [], ddp_backend.pretty_print_buckets

    def record(buckets, cap):
        seen.append(len(buckets))
        return real(buckets, cap)

    ddp_backend.pretty_print_buckets = record
    return seen


def run_replicate(args, cve):
    """compiled_vs_eager's main for --replicate (``cve``: that module, whose Variant, CommOnly, BytesByDim and
    batch this reuses)."""
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel

    from eager_calls import count_eager_collectives

    if args.tp > 1 or args.pp > 1 or args.float8 or args.offload or args.mp:
        raise SystemExit("--replicate: fp32, without --tp, --pp, --float8, --offload or --mp")
    device, rank, world, say = H.init_ranks(timeout_s=900)
    vocab = cve.HF_VOCAB if args.model == "hf-llama" else cve.MODEL_SIZES[args.model].vocab
    buckets = ddp_optimizer_buckets()

    class RVariant(cve.Variant):
        def __init__(self, name: str):
            model = cve.build(args.model, device, sharded=False)
            if name == "eager" or name.startswith("fc"):
                model = replicated(model, args.model)
            self.model, self.precompute = model, None
            if name == "ddp+torch.compile":
                self.ddp = DistributedDataParallel(model)
                self.runner = torch.compile(self.ddp, backend=args.backend)
            elif name == "eager":
                self.runner = model
            elif name.startswith("fc"):
                self.runner = compile_replicated(name, model, args.model, args.backend, cve)
            else:  # a frame of its own: Dynamo's cache would hand it the model's forward DDP's compile split
                self.runner = torch.compile(lambda tokens: model(tokens), backend=args.backend)
            self.opt = H.adamw(model.parameters(), 3e-3, args.optimizer)
            self._records(name, args.model)

    cve.check_variants(args.variants, REPLICATE_VARIANTS, "--replicate")
    names = [n for n in REPLICATE_VARIANTS if n == "eager" or not args.variants or n in args.variants]
    if "comm-only" in names and "fc" not in names:
        names.remove("comm-only")
    variants = [RVariant(n) for n in names if n != "comm-only"]
    if "comm-only" in names:
        variants.insert(names.index("comm-only"), cve.CommOnly(variants[names.index("fc")], device))
    say(f"compiled_vs_eager --replicate: '{args.model}', {world} ranks ({dist.get_backend()}), backend={args.backend}, "
        f"batch {args.batch} x {args.seq}, fp32")
    dims = {dist.group.WORLD.group_name: "dp"}
    step_no = {v.name: 0 for v in variants}
    graphs = {}

    def run(v, n: int, timed: bool):
        for _ in range(n):
            cve.step_once(v, cve.batch(step_no[v.name], rank, vocab, device, args.batch, args.seq), timed)
            step_no[v.name] += 1

    for v in variants:
        g0, b0, n0 = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()), len(buckets)
        with H.cold_compile(not args.warm_cache):
            run(v, 1, timed=False)
        v.count = cve.BytesByDim(dims)
        with count_eager_collectives() as calls:
            run(v, 1, timed=False)
        v.eager_calls, v.eager_bytes = len(calls), sum(calls.bytes)
        v.all_reduce_calls = sum(1 for c in calls if c == "all_reduce")
        captured = getattr(getattr(v, "runner", None), "captured", None)
        if captured is not None and not isinstance(v, cve.CommOnly):
            cve.graph_bytes_per_dim(captured.forward[:1] + captured.backward[:1], v.count)
        v.bytes_per_dim, v.count = v.count.bytes, None
        if v.name not in ("eager", "comm-only"):
            graphs[v.name] = {"dynamo_graphs": counters["stats"]["unique_graphs"] - g0,
                              "graph_breaks": sum(counters["graph_break"].values()) - b0,
                              "ddp_optimizer_buckets": buckets[n0:] or None}
        say(f"  {v.name}: first step {v.first_step_s:.1f} s" + (f", {graphs[v.name]}" if v.name in graphs else ""))
    windows = -(-args.steps // args.window)
    for w in range(windows):
        for v in variants:
            run(v, min(args.window, args.steps - w * args.window), timed=True)
    for _ in range(args.peak_steps):
        for v in variants:
            v.peaks.append(H.step_peak_bytes(lambda: run(v, 1, timed=False), device))

    results, base = {}, H.summarize(variants[0].times)["median_step_s"]
    eager_loss = variants[0].loss
    times = {v.name: v.times for v in variants}
    for v in variants:
        stats = H.summarize(v.times)
        graph = v.in_graph_collectives() or {}
        r = {**stats, "predicted_step_ms": v.predicted_ms(), "first_step_s": v.first_step_s,
             "ratio_vs_eager": stats["median_step_s"] / base, "eager_c10d_calls_per_step": v.eager_calls,
             "all_gathers": graph.get("all_gathers"), "reduce_scatters": graph.get("reduce_scatters"),
             "all_reduces": graph.get("all_reduces"),
             "collective_bytes_per_step": v.eager_bytes + graph.get("bytes", 0),
             "collective_bytes_per_dim": v.bytes_per_dim or None, "peak_bytes": max(v.peaks), "peak_bytes_per_step": v.peaks,
             "final_loss": v.loss, "final_loss_delta_vs_eager": None if v.loss is None else abs(v.loss - eager_loss),
             "minor_faults_per_step": cve.faults_per_step(v),
             "paired": H.paired_with(v.name, times, args.window),
             **graphs.get(v.name, {})}
        if v.name == "eager":  # its c10d calls less the step's barrier
            r["all_reduces"] = v.all_reduce_calls
        if v.name == "ddp+torch.compile":  # the reducer's all-reduces: C++ calls, one per bucket
            sizes = v.ddp._get_ddp_logging_data().get("bucket_sizes")
            grads = sum(p.numel() * p.element_size() for p in v.model.parameters() if p.requires_grad)
            r |= {"all_reduces": len(str(sizes).split(",")) if sizes else None, "ddp_bucket_sizes": sizes,
                  "collective_bytes_per_step": grads, "collective_bytes_per_dim": {"dp": grads}}
        if v.name == "compute-only":
            r["collective_bytes_per_step"] = 0
        if isinstance(v, cve.CommOnly):
            r["median_cpu_s"] = v.median_cpu_s()
        results[v.name] = r
    (bound, floor), comm = cve.bound_and_floor(results), results.get("comm-only")
    say("\n| variant | median ms | p10-p90 ms | vs eager | vs compute-only | vs CPU floor | first step s | Dynamo graphs "
        "| graph breaks | DDPOptimizer buckets | all-reduces/step | collective MB/step | step peak MiB | final loss (Δ vs eager) |")
    say("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for line in cve.bound_rows(bound, floor, 14):
        say(line)
    for name, r in results.items():
        ratio = (lambda x: "-" if not x else f"{r['median_step_s'] / x:.2f}x")
        say(f"| {name} | {r['median_step_s'] * 1e3:.1f} | {r['p10_step_s'] * 1e3:.1f}-{r['p90_step_s'] * 1e3:.1f} | "
            f"{r['ratio_vs_eager']:.2f}x | {ratio(bound and bound['median_step_s'])} | {ratio(floor)} | {r['first_step_s']:.1f} | "
            f"{r.get('dynamo_graphs', '-')} | {r.get('graph_breaks', '-')} | {r.get('ddp_optimizer_buckets') or '-'} | "
            f"{r['all_reduces'] if r['all_reduces'] is not None else '-'} | {r['collective_bytes_per_step'] / 1e6:.3f} | "
            f"{r['peak_bytes'] / 2**20:.1f} | " + ("-" if r["final_loss"] is None else
                                                  f"{r['final_loss']:.5f} ({r['final_loss_delta_vs_eager']:.1e})") + " |")
    if device.type == "cpu":
        say(cve.faults_line(results))
    for name, r in results.items():
        if name.startswith("fc") and (line := H.paired_line(name, r["paired"])):
            say(line)
    if floor:
        say(f"comm-only: {comm['median_step_s'] * 1e3:.1f} ms, CPU busy {comm['median_cpu_s'] * 1e3:.1f} ms; CPU floor {floor * 1e3:.1f} ms")
    if rank == 0:
        stem = args.stem or f"compiled_vs_eager_{args.model}_replicate"
        payload = {"config": vars(args) | {"world_size": world, "device": str(device)}, "machine": H.machine(),
                   "what": __doc__.strip(), "load_average": os.getloadavg(),
                   "peak_memory_measures": "the worst of --peak-steps steps (rank 0), CPU profiler allocation events",
                   "variants": results}
        if floor:
            payload["step_floors_s"] = {"max(compute-only, comm-only)": max(bound["median_step_s"], comm["median_step_s"]),
                                        "compute-only + comm-only's CPU time": floor,
                                        "compute-only + comm-only": bound["median_step_s"] + comm["median_step_s"]}
        H.write_json(os.path.join(args.out, f"{stem}.json"), payload)
        H.bar_chart(os.path.join(args.out, f"{stem}.png"), list(results), [r["median_step_s"] * 1e3 for r in results.values()],
                    [(r["p10_step_s"] * 1e3, r["p90_step_s"] * 1e3) for r in results.values()],
                    f"'{args.model}', {world} ranks, replicate (DDP), {device.type}: step time", "ms per step")
        say(f"wrote {args.out}/{stem}.json and .png")
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
