"""The compiled FSDP step at scale, by simulation: Llama-3 8B / 70B shapes on the meta device, sharded on
the fake process group at world sizes 8 to 1024, scored by fsdp_compile's cost model and simulator.

    python bench/scale_sim.py [--sizes llama3-8b llama3-70b] [--world-sizes 8 16 64 256 1024] [--quick]
    python bench/scale_sim.py --sizes llama3-70b --world-sizes 512 --tp 8     # FSDP 64 x TP 8
    python bench/scale_sim.py --float8 [--quick]       # torchao float8 all-gather against bf16
    python bench/scale_sim.py --sizes llama3-70b --world-sizes 512 --tp 8 --float8   # both (issue 46)
    python bench/scale_sim.py --sizes llama3-405b --world-sizes 2048 --tp 8 --pp 8   # one stage of pp 8 x dp 32 x tp 8

For every (model, world size, hardware profile) the forward and backward graphs are captured as
``fsdp_compile.compile`` would hand them to Inductor, and four schedules are scored by the same simulator:
  eager-equivalent   bucket="fsdp_group", no reordering (one collective per FSDP module, issued just in time)
  eager FSDP2        the same graphs with eager FSDP2's own schedule applied: the next module prefetched in
                     backward, one reduce-scatter pending (passes.planner.eager_fsdp2)
  fc default         fsdp_compile's default schedule (bucket="auto", reorder=True), planned for the
                     agreed tokens per step, applied to its own capture
  torch 2.13 passes  torch._inductor.fx_passes.bucketing.bucket_all_gather / bucket_reduce_scatter with
                     their defaults (greedy adjacent merging under a 2000 MB cap) on the eager-equivalent
                     graphs, no reordering
Model assumptions, printed with the results: one compute stream and one stream per process group;
compute time = FLOPs / (0.7 x dense peak) for matmul-like ops, bytes / (0.85 x HBM bandwidth) for the
rest; collectives by an alpha-beta ring model (h100-nvlink: 360 GB/s bus bandwidth inside a node;
h100-ib: 45 GB/s per GPU across nodes, 5 us per ring step); memory = live tensor bytes with graph inputs
live throughout. Batch 1 x 2048 tokens per rank, bf16 compute (MixedPrecisionPolicy), fp32 reduce.
With --tp N: torchtitan's TP plan (``fsdp_compile.models.tensor_parallel``, sequence parallel) on the tp dim
of a (W/N, N) mesh and FSDP over the W/N dp ranks; TP's collectives are in every variant's graphs, priced
like FSDP's on their own group (a group of at most 8 ranks on the intra-node link), and stay where the
model issues them (no variant moves them).
With --float8: every configuration is captured twice, as above (bf16) and with every Linear but the output
a torchao Float8Linear with enable_fsdp_float8_all_gather=True (its weights gathered as float8, one byte
per element): its matmuls are torch._scaled_mm, priced at the profile's float8 rate (H100: twice bf16's),
plus its dynamic-scaling casts, each priced as its own memory-bound op (Inductor fuses them into a few
kernels, so the float8 step's compute is overpriced: read its all-gather bytes and exposed communication,
not its step). Two variants, eager FSDP2 and fc default, in bf16 and in float8. With --tp too, the float8
blocks take torchao's float8 TP styles (Float8ColwiseParallel / Float8RowwiseParallel /
PrepareFloat8ModuleInput: ``tensor_parallel(float8=True)``), so TP's sequence all-gathers carry float8
activations as well. fc default's rows record its capture's seconds (``capture_s``) and its regions.
Overlap limit (the "limit" columns and keys): max(compute, communication), the step a perfect overlap of the
two would give, both from the same simulation as the step, at the same profile and on each variant's own
graphs. compute = the compute stream's busy time over the forward and backward graphs: every non-collective
node as captured (before Inductor: aten ops priced one by one, unfused, attention as the captured graph
computes it), the FSDP copy-in kernels included (the cat packing each all-gather's input; the cat packing
each reduce-scatter's fp32 gradients; the copy-out is views of the gathered buffer, free), plus one launch
per collective. communication = the collectives' durations on the busiest process group's stream (all-gathers
and reduce-scatters share one stream per group), both graphs. Neither includes the optimizer step, gradient
clipping or anything else outside the two graphs. The step is forward's plus backward's and no collective
crosses between them, so limit_per_graph_ms (per graph, max(compute, communication), summed) is the tighter
bound; the tables print the step-level one. x/limit = x's step / limit.
With --layers N: every size captured with N blocks instead of its own (32 for 8B, 80 for 70B), a cheaper run on a
loaded machine; every figure is then of that shorter model (the blocks are alike, so per-block ratios, exposed %
and step / limit, carry over; absolute milliseconds do not).
With --pp N (pipeline parallelism with FSDP stages, ``fc.compile_stage``): one pipeline stage is simulated, not the
pipeline. A stage holds ceil(layers / N) blocks (16 of Llama-3 405B's 126 at pp 8: the fullest stage; or --layers)
plus the embedding (--stages first) or the final norm and output (--stages last, whose input is the previous
stage's output: bf16 hidden states, its sequence shard under TP). The fake process group is the stage's own
W/N ranks, a (W/N/tp, tp) mesh: its FSDP and TP groups are those of the full (pp, dp, tp) mesh, and the pp dim
takes part in no simulated collective. The step scored is one micro-batch's (1 x --seq tokens) forward and
backward, captured as fc.compile captures a step with gradient sync: every micro-batch all-gathers each
module's parameters in forward and its blocks again in backward, as compile_stage does (measured by
compiled_vs_eager --pp 2; eager FSDP2 under a pipeline schedule keeps a stage's parameters unsharded after each
micro-batch's backward, so its later micro-batches' forwards gather nothing: the "eager FSDP2" rows here
overcount eager's all-gathers, by up to a stage's parameters per micro-batch), and the reduce-scatters are in
its backward, where under a pipeline schedule they run once per step (at REDUCE_GRAD, after the last
micro-batch's backward), so the per-micro-batch figure carries a whole step's reduce-scatter time: an upper
bound on a micro-batch's communication, exact for the last one. Not modeled: the pipeline's bubbles and its
schedule (1F1B or other), the pp send/recv of activations and gradients and their overlap with compute, the
number of micro-batches, and stages other than the first and the last (a middle stage is the last without its
norm and output). A pipeline step is then about (micro-batches + N - 1) micro-batch steps of the slowest stage.
With --replicate: FSDP2's replicate (DDP: parameters replicated, no all-gather) on every block and the root instead of
fully_shard, each unit's gradients all-reduced over the W ranks (ring or tree, the faster) in backward; the forward
has no communication, so its compute cannot hide any: limit_per_graph_ms (forward compute + max(backward compute,
all-reduces)) is the bound the step can reach, the step-level limit is below it wherever communication dominates.
Writes bench/results/scale_sim.json and scale_sim.png (scale_sim_tp<N>_<sizes>.* with --tp, scale_sim_float8.*
with --float8, both with both, scale_sim_pp<N>_... with --pp, scale_sim_replicate.* with --replicate, _<N>layers
appended with --layers).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, os.path.dirname(__file__))
import _harness as H  # noqa: E402

import fsdp_compile as fc  # noqa: E402
from fsdp_compile import passes  # noqa: E402
from fsdp_compile._torch._dtensor import forget_meshes  # noqa: E402
from fsdp_compile.debug import explain_graphs  # noqa: E402
from fsdp_compile.passes.planner import eager_fsdp2  # noqa: E402
from fsdp_compile.plan import read_plan  # noqa: E402
from fsdp_compile.models import SIZES as MODEL_SIZES, Llama, LlamaArgs, llama_blocks, tensor_parallel  # noqa: E402

# Meta's published Llama 3.1 405B config beside the package's sizes (simulation only)
SIZES = {**MODEL_SIZES, "llama3-405b": LlamaArgs(vocab=128256, dim=16384, n_layers=126, n_heads=128, n_kv_heads=8,
                                                 ffn_dim=53248, max_seq=8192)}
VARIANTS = ("eager-equivalent", "eager FSDP2", "fc default", "torch 2.13 passes")


class Stage(torch.nn.Module):
    """A pipeline stage of ``full`` (--pp): all its blocks, with its embedding (the first stage) or its final norm
    and output (the last), as tests/test_pipeline_multirank.py and torchtitan split our Llama."""

    def __init__(self, full: Llama, first: bool):
        super().__init__()
        self.tok_embeddings = full.tok_embeddings if first else None
        self.layers = full.layers
        self.norm, self.output = (None, None) if first else (full.norm, full.output)
        self.register_buffer("rope", full.rope, persistent=False)

    def forward(self, x):
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers:
            x = layer(x, self.rope)
        return x if self.output is None else self.output(self.norm(x))


def stage_layers(size: str, pp: int, layers: int | None) -> int:
    """Blocks per stage under --pp (the most any stage holds), or per model: --layers if given."""
    return layers or (-(-SIZES[size].n_layers // pp) if pp > 1 else SIZES[size].n_layers)


def capture(size: str, world: int, seq: int, hardware: str, tp: int = 1, float8: bool = False, layers: int | None = None,
            stage: str | None = None, replicate: bool = False, **config):
    """Forward and backward graphs of one training step (after our passes), and the schedule applied;
    ``float8``: torchao's float8 Linears with the float8 all-gather; ``layers``: that many blocks, not the size's;
    ``stage``: "first" or "last", that pipeline stage of the model (``world``: the stage's dp x tp ranks);
    ``replicate``: FSDP2's replicate (DDP) in place of fully_shard."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with torch.device("meta"):
            model = Llama(dataclasses.replace(SIZES[size], n_layers=layers or SIZES[size].n_layers))
        if float8:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            config8 = Float8LinearConfig(enable_fsdp_float8_all_gather=True)  # torch._scaled_mm, as on an H100
            convert_to_float8_training(model, config=config8, module_filter_fn=lambda _, fqn: fqn != "output")
        mesh = {}
        if tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            dp_tp = init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
            tensor_parallel(model, dp_tp["tp"], float8=float8)  # float8: torchao's float8 TP styles
            mesh = {"mesh": dp_tp["dp"]}
        tokens = torch.randint(0, 128, (1, seq), device="meta")
        if stage is not None:
            model = Stage(model, first=stage == "first")
            if stage == "last":  # the previous stage's output: its sequence shard under TP's sequence parallelism
                tokens = torch.randn(1, seq // tp, SIZES[size].dim, dtype=torch.bfloat16, device="meta")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        wrap = fully_shard
        if replicate:
            from torch.distributed._composable.replicate_with_fsdp import replicate as wrap
        for block in llama_blocks(model):
            wrap(block, mp_policy=mp, **mesh)
        wrap(model, mp_policy=mp, **mesh)
        report, captured = explain_graphs(model, tokens, config=fc.CompileConfig(backend="inductor", hardware=hardware, **config))
        return [captured.forward[0], captured.backward[0]], report, passes.modules_of(read_plan(model))
    finally:
        dist.destroy_process_group()
        forget_meshes()  # the next capture's mesh, on a new fake group, must not meet this one (fsdp_compile/_torch/_dtensor.py)


def score(graphs, hardware: str, variant: str, world: int, schedule=None, tp: int = 1) -> dict:
    out = {"step_ms": 0.0, "exposed_comm_ms": 0.0, "peak_bytes": 0, "all_gathers": 0, "reduce_scatters": 0,
           "all_gather_bytes": 0, "all_reduces": 0, "compute_ms": 0.0, "limit_per_graph_ms": 0.0}
    comm_per_group: dict[str, float] = {}  # ms of collectives per process group (one stream each), both graphs
    # the torch passes and the all-reduces' sizes resolve process groups by name: score them under a fake
    # group of the same size, with the mesh made again in the same order (so its groups get the same names)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        if tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            init_device_mesh("cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
        for gm in graphs:
            gm = copy.deepcopy(gm)
            cost = passes.cost_model_for(hardware, gm.graph)
            if variant == "eager FSDP2":
                passes.apply_schedule(gm.graph, schedule)
            elif variant == "torch 2.13 passes":
                from torch._inductor.fx_passes.bucketing import bucket_all_gather, bucket_reduce_scatter

                bucket_all_gather(gm)
                bucket_reduce_scatter(gm)
            sched = passes.simulate(gm.graph, cost)
            out["step_ms"] += sched.step_time * 1e3
            out["exposed_comm_ms"] += sched.exposed_comm_time * 1e3
            out["peak_bytes"] = max(out["peak_bytes"], passes.peak_memory(gm.graph)[0])
            out["all_gathers"] += sum(1 for c in sched.collectives if c.kind == "all_gather")
            out["all_gather_bytes"] += sum(c.bytes for c in sched.collectives if c.kind == "all_gather")
            out["reduce_scatters"] += sum(1 for c in sched.collectives if c.kind == "reduce_scatter")
            out["all_reduces"] += sum(1 for c in sched.collectives if c.kind == "all_reduce")
            # the overlap limit, from this same simulation: the compute stream's busy time and the busiest
            # communication stream's (the docstring's "Overlap limit")
            out["compute_ms"] += sched.compute_time * 1e3
            graph_comm: dict[str, float] = {}
            for c in sched.collectives:
                graph_comm[c.process_group] = graph_comm.get(c.process_group, 0.0) + c.duration * 1e3
                comm_per_group[c.process_group] = comm_per_group.get(c.process_group, 0.0) + c.duration * 1e3
            out["limit_per_graph_ms"] += max(sched.compute_time * 1e3, max(graph_comm.values(), default=0.0))
    finally:
        dist.destroy_process_group()
    out["exposed_pct"] = 100 * out["exposed_comm_ms"] / out["step_ms"] if out["step_ms"] else 0.0
    out["comm_ms"] = max(comm_per_group.values(), default=0.0)
    out["comm_per_group_ms"] = comm_per_group
    out["limit_ms"] = max(out["compute_ms"], out["comm_ms"])
    out["step_over_limit"] = out["step_ms"] / out["limit_ms"] if out["limit_ms"] else float("nan")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", nargs="+", default=["llama3-8b", "llama3-70b"], choices=["llama3-8b", "llama3-70b", "llama3-405b"])
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[8, 16, 64, 256, 1024])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="llama3-8b at world sizes 8 and 64 only")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: FSDP over world/tp ranks")
    ap.add_argument("--float8", action="store_true", help="bf16 against torchao's float8 all-gather (eager FSDP2, fc default)")
    ap.add_argument("--layers", type=int, default=None,
                    help="capture this many blocks instead of the size's (a cheaper run: every figure is of the shorter model)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree: simulate one stage (the docstring's --pp)")
    ap.add_argument("--stages", nargs="+", default=["first", "last"], choices=["first", "last"], help="with --pp: which stages")
    ap.add_argument("--replicate", action="store_true", help="FSDP2's replicate (DDP) in place of fully_shard")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    if args.pp > 1 and args.float8:
        ap.error("--pp: bf16 only (no --float8)")
    if args.replicate and (args.pp > 1 or args.tp > 1 or args.float8):
        ap.error("--replicate: data parallelism alone (no --pp, --tp, --float8)")
    if args.quick:
        args.sizes, args.world_sizes = ["llama3-8b"], [8, 64]
    variants = ("eager FSDP2", "fc default") if args.float8 else VARIANTS
    rows = []
    t0 = time.monotonic()
    for size in args.sizes:
        for world in args.world_sizes:
            profiles = ["h100-nvlink", "h100-ib"] if world <= 8 else ["h100-ib"]
            sim = world // args.pp  # --pp: one stage's dp x tp ranks (its FSDP and TP groups; pp's are not simulated)
            layers = stage_layers(size, args.pp, args.layers) if args.pp > 1 else args.layers
            for hardware, float8, stage in [(h, f, st) for h in profiles for f in ((False, True) if args.float8 else (False,))
                                            for st in (args.stages if args.pp > 1 else (None,))]:
                started = time.perf_counter()  # the model built on the meta device, sharded, and explain_graphs
                ours, report, _ = capture(size, sim, args.seq, hardware, args.tp, float8, layers, stage, args.replicate)
                capture_s = time.perf_counter() - started
                plan = report.schedule
                # the eager-equivalent capture, for the other variants
                placed, _, modules = capture(size, sim, args.seq, hardware, args.tp, float8, layers, stage, args.replicate,
                                             bucket="fsdp_group", reorder=False)
                eager = passes.Schedule(
                    units=tuple(eager_fsdp2(modules)), policy="eager FSDP2", workload=plan["workload"],
                    hardware=hardware, comm_budget_bytes=0, predicted={}, planning_s=0.0,
                )
                for variant in variants:
                    graphs = ours if variant == "fc default" else placed
                    try:
                        r = score(graphs, hardware, variant, sim, eager, args.tp)
                    except Exception as e:  # noqa: BLE001 - a pass that fails is a result, reported as such
                        r = {"error": f"{type(e).__name__}: {e}"[:300]}
                    if variant == "fc default":
                        r["planning_ms"] = report.planning_ms
                        r["units"] = len(plan["units"])
                        r["capture_s"] = capture_s  # one process, cold: what fc.explain of this model takes
                        r["regions"] = [(len(x["blocks"]), x["why"] or "region") for x in report.regions]
                    name = variant + (" float8" if float8 else "") + (f" {stage} stage" if stage else "")
                    rows.append({"model": size, "world_size": world, "tp": args.tp, "hardware": hardware, "variant": name,
                                 "float8_all_gather": float8, "layers": layers or SIZES[size].n_layers,
                                 **({"pp": args.pp, "stage": stage, "dp": sim // args.tp, "microbatch": [1, args.seq]}
                                    if stage else {}), **r})
                    sys.stderr.write(f"[{time.monotonic() - t0:6.0f}s] {size} W={world} {hardware} {name}: "
                                     f"{r.get('step_ms', float('nan')):.1f} ms, exposed {r.get('exposed_pct', float('nan')):.1f}%\n")
    print("Model assumptions" + __doc__.split("Model assumptions")[1].split("Writes")[0].rstrip().replace("\n", " "))
    print("\n| model | W | hardware | variant | step ms | exposed comm ms (% of step) | peak GiB/rank | AG/RS | planning ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['model']} | {r['world_size']} | {r['hardware']} | {r['variant']} | failed: {r['error'][:80]} | | | | |")
            continue
        planning = f"{r['planning_ms']:.0f}" if "planning_ms" in r else "-"
        ar = f" (AR {r['all_reduces']})" if r.get("all_reduces") else ""  # --replicate
        print(f"| {r['model']} | {r['world_size']} | {r['hardware']} | {r['variant']} | {r['step_ms']:.1f} | "
              f"{r['exposed_comm_ms']:.2f} ({r['exposed_pct']:.1f}%) | {r['peak_bytes'] / 2**30:.2f} | "
              f"{r['all_gathers']}/{r['reduce_scatters']}{ar} | {planning} |")
    _print_limits(rows)
    print("\nfc's capture (fc.explain_graphs of fc default, one process, cold; building and sharding the model on the meta "
          "device included), and its repeated blocks (count, region or why inline):")
    for r in (r for r in rows if "capture_s" in r):
        print(f"- {r['model']} W={r['world_size']} {r['hardware']} {r['variant']}: {r['capture_s']:.1f} s, {r['regions']}")
    if args.float8:
        print("\nfloat8 all-gather against bf16 (same model, W, hardware, schedule policy):")
        print("| model | W | hardware | variant | all-gather GB/step | exposed comm ms | step ms |")
        print("|---|---|---|---|---|---|---|")
        by = {(r["model"], r["world_size"], r["hardware"], r["variant"]): r for r in rows if "error" not in r}
        for (model, world, hardware, name), f8 in by.items():
            bf = by.get((model, world, hardware, name.removesuffix(" float8")))
            if not name.endswith(" float8") or bf is None:
                continue
            print(f"| {model} | {world} | {hardware} | {name.removesuffix(' float8')} | "
                  f"{bf['all_gather_bytes'] / 1e9:.2f} -> {f8['all_gather_bytes'] / 1e9:.2f} "
                  f"({f8['all_gather_bytes'] / bf['all_gather_bytes']:.2f}x) | {bf['exposed_comm_ms']:.2f} -> "
                  f"{f8['exposed_comm_ms']:.2f} | {bf['step_ms']:.1f} -> {f8['step_ms']:.1f} ({f8['step_ms'] / bf['step_ms']:.3f}x) |")
    stem = ("scale_sim" + (f"_pp{args.pp}" if args.pp > 1 else "")
            + (f"_tp{args.tp}_{'_'.join(args.sizes)}" if args.tp > 1 else "") + ("_float8" if args.float8 else "")
            + ("_replicate" if args.replicate else "")
            + (f"_{args.layers}layers" if args.layers else ""))
    H.write_json(os.path.join(args.out, f"{stem}.json"), {"machine": H.machine(), "config": vars(args), "rows": rows})
    _plot(rows, os.path.join(args.out, f"{stem}.png"))
    print(f"wrote {args.out}/{stem}.json and .png")


def _print_limits(rows):
    """Per configuration: the overlap limit (fc default's graphs) beside fc default's step and eager FSDP2's."""
    print("\nOverlap limit: max(compute, comm), ms, from the same simulation as each step; compute = compute-stream "
          "busy time (every captured non-collective node, FSDP copy-in cats included, + collective launches), "
          "comm = the busiest process group's collectives; no optimizer step (see the docstring)")
    print("| model | W | hardware | compute ms | comm ms | limit ms | per-graph limit ms | fc step ms | eager FSDP2 step ms "
          "| fc/limit | fc/per-graph limit | eager/limit |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    by = {(r["model"], r["world_size"], r["hardware"], r["variant"]): r for r in rows if "error" not in r}
    for (model, world, hardware, name), fc_row in by.items():
        if not name.startswith("fc default"):
            continue
        suffix = name.removeprefix("fc default")  # "" or " float8"
        eager_row = by.get((model, world, hardware, "eager FSDP2" + suffix))
        eager_step = eager_ratio = "-"
        if eager_row is not None:
            eager_step = f"{eager_row['step_ms']:.1f}"
            eager_ratio = f"{eager_row['step_over_limit']:.3f}"
            if abs(eager_row["limit_ms"] / fc_row["limit_ms"] - 1) > 1e-3:  # its graphs do other work: own limit
                eager_ratio += f" (own limit {eager_row['limit_ms']:.1f})"
        print(f"| {model} | {world} | {hardware}{suffix} | {fc_row['compute_ms']:.1f} | {fc_row['comm_ms']:.1f} | "
              f"{fc_row['limit_ms']:.1f} | {fc_row['limit_per_graph_ms']:.1f} | {fc_row['step_ms']:.1f} | {eager_step} | "
              f"{fc_row['step_over_limit']:.3f} | {fc_row['step_ms'] / fc_row['limit_per_graph_ms']:.3f} | "
              f"{eager_ratio} |")


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(2, len(models), figsize=(6 * len(models), 7.5), squeeze=False)
    names = list(dict.fromkeys(r["variant"] for r in rows))
    for col, model in enumerate(models):
        for ax, key, ylabel in ((axes[0][col], "exposed_pct", "predicted exposed communication, % of step"),
                                (axes[1][col], "step_over_limit", "step / overlap limit max(compute, comm)")):
            for variant, style in zip(names, ("o-", "v-", "s-", "^--")):
                pts = sorted((r["world_size"], r[key]) for r in rows
                             if r["model"] == model and r["variant"] == variant and r["hardware"] == "h100-ib" and "error" not in r)
                if pts:
                    ax.plot(*zip(*pts), style, label=variant)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("world size (h100-ib profile)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{model}: simulated FSDP step")
            ax.legend()
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
