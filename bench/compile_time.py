"""First-step (compile) time against depth, cold and warm: fsdp_compile vs torch.compile.

    python bench/compile_time.py [--depths 2 8 16 32] [--model hf|ours|tp|float8|float8-tp|deepseek|titan-tp] [--quick] [--one-process] [--repeat N]

For every depth and variant, two fresh processes of 2 gloo ranks each (1 thread per rank) run one
forward + backward: "cold" with an empty Inductor cache directory, then "warm" with the one the cold run
filled (a restart). The figure is the slower rank's first step, compile included. ``--one-process``: one
rank on torch's fake process group of world size 2 instead (the same graphs, no second rank compiling
beside it on the same cores). ``--repeat N``: N rounds over every depth and variant, each with its own
cache directories; the tables give the median of the N. Variants:
  fc              fsdp_compile.compile on the fully_shard model (default config: Inductor, regions, schedule)
  fc:no-regions   the same with CompileConfig(regions=False): every block compiled inline
  torch-fsdp      torch.compile on the same fully_shard model (graph breaks at every FSDP hook)
  torch-plain     torch.compile on the same model unsharded (no FSDP, no collectives): the compiler's own cost
The model is a narrow Llama (hidden 64), so compute is negligible: HF transformers' LlamaForCausalLM when
installed (``--model hf``), else fsdp_compile.models.Llama; ``--model tp`` the latter with torchtitan's TP plan
on a (dp 2, tp 2) mesh (4 ranks), ``float8`` with torchao's float8 Linears and FSDP2's float8 all-gather,
``float8-tp`` both (torchao's float8 TP plan, ``tensor_parallel(float8=True)``: float8 x TP),
``deepseek`` torchtitan's DeepSeek-V3 debug model (MoE blocks, dim 256), parallelized by torchtitan over
data parallelism, ``titan-tp`` its Llama3 debug model parallelized by torchtitan's ``parallelize_llama`` over
dp 2 x tp 2 (sequence parallelism: blocks that take and return DTensors) (torchtitan installed;
``tests/torchtitan_cases.py``). Results go to
bench/results/compile_time[_one_process][_<model>].json, ``hf`` without the suffix. Per variant it also prints the cold first step by
compile phase (torch's compile timers: Dynamo, AOTAutograd's partitioner, Inductor's lowering, codegen and
C++ compile; our passes) at every depth, with what one more layer adds to each.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import _harness as H  # noqa: E402

VARIANTS = ("fc", "fc:no-regions", "torch-fsdp", "torch-plain")
W = 2
MODELS = {  # --model: what it builds (``build``)
    "hf": "HF transformers' LlamaForCausalLM",
    "ours": "fsdp_compile.models.Llama",
    "tp": "fsdp_compile.models.Llama with torchtitan's TP plan, dp 2 x tp 2",
    "float8": "fsdp_compile.models.Llama in torchao float8 with FSDP2's float8 all-gather",
    "float8-tp": "fsdp_compile.models.Llama in torchao float8 (float8 all-gather) with torchao's float8 TP plan, dp 2 x tp 2",
    "deepseek": "torchtitan's DeepSeek-V3 debug model (MoE), parallelized by torchtitan",
    "titan-tp": "torchtitan's Llama3 debug model, parallelized by torchtitan with TP, dp 2 x tp 2",
}


def world(model_kind: str) -> int:
    return 4 if model_kind in ("tp", "float8-tp", "titan-tp") else W  # tp: dp 2 x tp 2


def build(model_kind: str, depth: int, shard: bool):
    """The model at ``depth`` layers, ``fully_shard`` on every block and then the root where ``shard`` (tp: over
    dp of a (dp 2, tp 2) mesh, after torchtitan's TP plan; deepseek: torchtitan's own parallelize function,
    which shards), and the function of its output that the step differentiates."""
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    loss = lambda out: out.float().logsumexp(-1).mean()  # noqa: E731
    if model_kind in ("deepseek", "titan-tp"):
        if model_kind == "titan-tp":  # its logits: a DTensor sharded over the vocabulary (loss parallel)
            loss = lambda out: (getattr(out, "full_tensor", lambda: out)()).float().logsumexp(-1).mean()  # noqa: E731
        return _titan(model_kind, depth, shard), loss
    mesh = {}
    if model_kind == "hf":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=depth,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                          attn_implementation="sdpa", use_cache=False)  # training: no KV cache
        model = LlamaForCausalLM(cfg)
        blocks, loss = list(model.model.layers), (lambda out: out.loss)
    else:
        from fsdp_compile.models import Llama, LlamaArgs, tensor_parallel

        model = Llama(LlamaArgs(vocab=1024, dim=64, n_layers=depth, n_heads=4, ffn_dim=128, max_seq=128))
        blocks = list(model.layers)
        if model_kind in ("float8", "float8-tp"):  # torchao's float8 Linears (emulated on a CPU), float8 all-gather
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=not torch.cuda.is_available())
            convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn != "output")
        if model_kind in ("tp", "float8-tp"):
            from torch.distributed.device_mesh import init_device_mesh

            from fsdp_compile.models import gloo_float8_all_gather

            dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            tensor_parallel(model, dp_tp["tp"], float8=model_kind == "float8-tp")
            if model_kind == "float8-tp":
                gloo_float8_all_gather()  # its float8 sequence all-gathers as bytes on gloo (the fake group carries any dtype)
            mesh = {"mesh": dp_tp["dp"]}
    if shard:
        for b in blocks:
            fully_shard(b, **mesh)
        fully_shard(model, **mesh)
    return model, loss


def _titan(model_kind: str, depth: int, shard: bool):
    """torchtitan's DeepSeek-V3 debug model (MoE: its first layer dense, the others mixture-of-experts, token
    counters updated in place) at ``depth`` layers, parallelized by torchtitan's own ``parallelize_deepseekv3``
    over data parallelism alone, or (``titan-tp``) its Llama3 debug model by its ``parallelize_llama`` over dp 2 x
    tp 2 (sequence parallelism: the blocks take and return DTensors), where ``shard`` (else unparallelized), as
    tests/torchtitan_cases.py builds them."""
    import copy

    import torch
    import torchtitan_cases as T
    from torchtitan.config import CompileConfig, TrainingConfig

    import torchtitan.distributed.utils as dist_utils

    T._on_cpu()
    dist_utils.set_spmd_backend("partial_dtensor")
    tp = model_kind == "titan-tp"
    cfg, parallelize = T._model_config("llama3" if tp else "deepseek_v3", 2)
    dense = 0 if tp else 1  # DeepSeek-V3's first layer is dense, the others repeat the second (MoE)
    cfg.layers = cfg.layers[:dense] + [copy.deepcopy(cfg.layers[dense]) for _ in range(depth - dense)]
    if shard:
        dims, parallelism = T._parallel_dims(world(model_kind), tp=2 if tp else 1)
    if shard and tp:  # what update_from_config does: its Llama3 sharding plan
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        set_llama3_sharding_config(cfg, enable_sp=parallelism.enable_sequence_parallel)
    with torch.device("meta"):
        model = cfg.build()
    if shard:
        model = parallelize(model, parallel_dims=dims, training=TrainingConfig(local_batch_size=2, seq_len=64),
                            parallelism=parallelism, compile_config=CompileConfig(), ac_config=None, dump_folder="")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def _rank(rank: int, store: str, args, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import fsdp_compile as fc

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    if args.one_process:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world(args.model))
    else:
        fc.single_thread_gloo()  # torch's gloo races between its worker threads (fsdp_compile/_torch/_gloo.py)
        dist.init_process_group("gloo", store=dist.FileStore(store, world(args.model)), rank=rank, world_size=world(args.model),
                                timeout=datetime.timedelta(seconds=900))
    model, loss = build(args.model, args.depth, shard=args.variant != "torch-plain")
    extra = {}
    if args.variant.startswith("fc"):
        step = fc.compile(model, regions=args.variant == "fc")
    else:
        step = torch.compile(model)
    ids = torch.randint(0, 1024, (2, 64), generator=torch.Generator().manual_seed(rank))
    dist.barrier()
    t0 = time.perf_counter()
    with H.compile_timing() as timing:
        loss(step(input_ids=ids, labels=ids) if args.model == "hf" else step(ids)).backward()
    first = time.perf_counter() - t0
    if args.variant.startswith("fc"):
        extra = {"planning_s": step.schedule.planning_s, "units": len(step.schedule.units)}
    extra["phases_s"] = H.compile_phases(timing, first)  # this rank's (rank 0's is written)
    extra["dynamo_frames"] = timing["calls"].get("_compile.compile_inner", 0)
    extra["inductor_graphs"] = timing["calls"].get("compile_fx_inner", 0)
    from torch._dynamo.utils import counters

    extra["fx_cache_hits"] = counters["inductor"].get("fxgraph_cache_hit", 0)
    extra["aot_cache_hits"] = counters["aot_autograd"].get("autograd_cache_hit", 0)
    t = torch.tensor([first], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"first_step_s": float(t), **extra}, f)
    dist.destroy_process_group()


def worker(args) -> None:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        if args.one_process:
            _rank(0, os.path.join(tmp, "store"), args, out)
        else:
            mp.spawn(_rank, args=(os.path.join(tmp, "store"), args, out), nprocs=world(args.model), join=True)
        with open(out) as f:
            print("RESULT " + f.read())


def measure(variant: str, depth: int, model: str, cache_dir: str, one_process: bool = False) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    cmd = [sys.executable, __file__, "--worker", "--variant", variant, "--depth", str(depth), "--model", model]
    cmd += ["--one-process"] if one_process else []
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr or proc.stdout)[-4000:]}  # a rank that died: its own report, not only the spawner's
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", nargs="+", type=int, default=[2, 8, 16, 32])
    ap.add_argument("--variants", nargs="+", default=[v for v in VARIANTS if v != "fc:no-regions"],
                    help=f"space- or comma-separated, of: {' '.join(VARIANTS)}")
    ap.add_argument("--model", choices=list(MODELS), default=None)
    ap.add_argument("--quick", action="store_true", help="depths 2 and 8 only")
    ap.add_argument("--one-process", action="store_true", help="one rank on the fake process group (world size 2)")
    ap.add_argument("--repeat", type=int, default=1, help="rounds over every depth and variant; tables give medians")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.variants = H.names_listed(args.variants)
    if unknown := [v for v in args.variants if v not in VARIANTS]:
        ap.error(f"--variants {' '.join(unknown)}: not a variant; the variants: {' '.join(VARIANTS)}")
    if args.model in ("deepseek", "titan-tp"):
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))
    if args.model is None:
        try:
            import transformers  # noqa: F401

            args.model = "hf"
        except ImportError:
            args.model = "ours"
    if args.worker:
        return worker(args)
    if args.quick:
        args.depths = [2, 8]
    runs = []
    for round_ in range(args.repeat):
        for depth in args.depths:
            for variant in args.variants:
                with tempfile.TemporaryDirectory() as cache:
                    cold = measure(variant, depth, args.model, cache, args.one_process)
                    warm = measure(variant, depth, args.model, cache, args.one_process)
                runs.append({"round": round_, "depth": depth, "variant": variant, "cold": cold, "warm": warm})
                sys.stderr.write(f"depth {depth:3d} {variant:12s} cold {cold.get('first_step_s', float('nan')):7.1f} s  "
                                 f"warm {warm.get('first_step_s', float('nan')):7.1f} s\n")
    rows = _medians(runs, args)
    where = "one process, fake process group of 2" if args.one_process else "2 gloo ranks"
    print(f"\nfirst step (compile) seconds, {where}, {MODELS[args.model]} (cold: empty cache; warm: restart)"
          + (f"; median of {args.repeat} rounds" if args.repeat > 1 else ""))
    print("| depth | " + " | ".join(f"{v} cold | {v} warm" for v in args.variants) + " | fc planning ms |")
    print("|---" * (2 * len(args.variants) + 2) + "|")
    for depth in args.depths:
        cells, planning = [], "-"
        for variant in args.variants:
            r = next(x for x in rows if x["depth"] == depth and x["variant"] == variant)
            cells += [f"{r[k]['first_step_s']:.1f}" if "first_step_s" in r[k] else "failed" for k in ("cold", "warm")]
            if variant == "fc" and "planning_s" in r["cold"]:
                planning = f"{r['cold']['planning_s'] * 1e3:.1f}"
        print(f"| {depth} | " + " | ".join(cells) + f" | {planning} |")
    _phase_table(rows, args)
    name = ("compile_time_one_process" if args.one_process else "compile_time") + ("" if args.model == "hf" else f"_{args.model}")
    payload = {"machine": H.machine(), "model": args.model, "one_process": args.one_process, "rows": rows}
    if args.repeat > 1:
        payload["runs"] = runs
    H.write_json(os.path.join(args.out, f"{name}.json"), payload)
    _plot(rows, args, os.path.join(args.out, f"{name}.png"))
    print(f"wrote {args.out}/{name}.json and .png")


def _medians(runs, args) -> list[dict]:
    """One row per depth and variant: each number the median over its rounds (of those that did not fail)."""
    import statistics

    def median(records: list[dict]) -> dict:
        ok = [r for r in records if "first_step_s" in r]
        if not ok:
            return records[0]
        out = dict(ok[len(ok) // 2])  # counts (frames, graphs) from one round
        out["first_step_s"] = statistics.median(r["first_step_s"] for r in ok)
        if "phases_s" in ok[0]:
            out["phases_s"] = {k: statistics.median(r["phases_s"][k] for r in ok) for k in ok[0]["phases_s"]}
        if "planning_s" in ok[0]:
            out["planning_s"] = statistics.median(r["planning_s"] for r in ok)
        out["rounds"] = len(ok)
        return out

    rows = []
    for depth in args.depths:
        for variant in args.variants:
            mine = [r for r in runs if r["depth"] == depth and r["variant"] == variant]
            rows.append({"depth": depth, "variant": variant, "cold": median([r["cold"] for r in mine]),
                         "warm": median([r["warm"] for r in mine])})
    return rows


def _phase_table(rows, args) -> None:
    """Per variant, the cold first step by compile phase (``_harness.PHASES``, rank 0's timers) at every
    depth, and what one more layer adds to each phase (least squares over the depths)."""
    depths = args.depths
    for variant in args.variants:
        got = {r["depth"]: r["cold"] for r in rows if r["variant"] == variant and "phases_s" in r["cold"]}
        if not got:
            continue
        print(f"\n{variant}, cold first step by phase (s; torch's compile timers, inclusive, nested as indented):")
        print("| phase | " + " | ".join(f"{d} layers" for d in depths) + " | per added layer |")
        print("|---" * (len(depths) + 2) + "|")
        labels = list(next(iter(got.values()))["phases_s"])
        for label in [*labels, "dynamo_frames", "inductor_graphs"]:
            ys = [(d, got[d]["phases_s"][label] if label in labels else got[d][label]) for d in depths if d in got]
            slope = _slope(ys)
            fmt = "{:.0f}" if label in ("dynamo_frames", "inductor_graphs") else "{:.2f}"
            print(f"| {label} | " + " | ".join(fmt.format(y) for _, y in ys) + f" | {slope:+.3f} |")


def _slope(points) -> float:
    if len(points) < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def _plot(rows, args, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for variant, color in zip(args.variants, ("#4C72B0", "#8172B3", "#DD8452", "#55A868")):
        for kind, style in (("cold", "o-"), ("warm", "s--")):
            pts = [(r["depth"], r[kind]["first_step_s"]) for r in rows if r["variant"] == variant and "first_step_s" in r[kind]]
            if pts:
                ax.plot(*zip(*pts), style, color=color, label=f"{variant} {kind}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("layers")
    ax.set_ylabel("first step, s (compile included)")
    ax.set_title(f"compile time, {args.model} model, CPU")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
