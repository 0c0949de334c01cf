"""Write docs/results.md from bench/results/*.json: every measurement this project keeps, one section per
JSON, each naming its file, the machine, the torch version and date the JSON records, and the command.

    python3 bench/results_page.py            # (re)write docs/results.md
    python3 bench/results_page.py --check    # exit 1 if docs/results.md is not what this script writes

The page is generated, never edited by hand: change a JSON (or this script) and run it again. It is
deterministic (files in sorted order, no time of generation), so unchanged JSON gives a byte-identical
page; tests/test_docs.py checks that the committed page is current. Standard library only (no torch).

Where a JSON lacks something (the CPU's model, a date, the command line) the page says "not recorded";
it never fills in a value. A command is shown as recorded (the benchmark's own arguments, which most
scripts store under ``config``/``args``/``env``), or rebuilt from what the JSON holds and marked so.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
PAGE = os.path.join(ROOT, "docs", "results.md")
LINK = "../bench/results/"  # from docs/, where the page lives
NR = "not recorded"

# (family title, file-name prefix, what it measures). A JSON belongs to the first family whose prefix it starts with.
FAMILIES = [
    ("GPU: the compiled step", "gpu_step_", "`bench/compiled_vs_eager.py` on NVIDIA GPUs (`bench/gpu.sh` step 3): "
     "eager FSDP2, torch.compile on FSDP2, fc and the compute-only bound (the model unsharded, no collectives)."),
    ("GPU: where the step goes", "gpu_profile_", "`bench/profile_step.py` on one GPU (`bench/gpu.sh` step 4): host "
     "time per bucket from `torch.profiler` (ms per step), and device time per kernel bucket."),
    ("GPU: copy kernels", "gpu_kernels", "`bench/kernels.py --device cuda` (`bench/gpu.sh` step 2): GB/s of device time "
     "(bytes read + written) of the Triton copy kernels against `copy_` and FSDP2's own copy ops."),
    ("GPU: cuda-marked tests", "gpu_tests", "`pytest -m cuda` on a GPU (`bench/gpu.sh` step 1)."),
    ("CPU: compiled vs eager step", "compiled_vs_eager_", "`bench/compiled_vs_eager.py` on CPU gloo ranks (one "
     "thread each, `fc.single_thread_gloo`): median step of timed steps in interleaved windows. Variants: `eager` "
     "(FSDP2), `torch.compile` (on the FSDP2 model), `fc` (defaults), `fc:fsdp_group` (one bucket per FSDP module), "
     "`fc:no-reorder` (`reorder=False`: no prefetch or deferred waits), `fc:no-regions`, `fc:free-overlap` (planned with the `cpu-gloo` profile's `comm_cpu_share` at 0, as the profile was before 2026-11-30: communication hidden behind compute taken as free; the `_contention_` runs), `fc:no-reshard` (`fully_shard(reshard_after_forward=False)`: no re-gather in backward, as the `simplefsdp` variant), `simplefsdp` (torchtitan 0.3.0's, with its transformer-block bucketing, when importable), `simplefsdp:reshard` "
     "(the same with its parameters resharded after forward and re-gathered in backward, like `fc`'s default: each "
     "all-gather recomputed under a selective checkpoint policy, as SimpleFSDP did before torchtitan 0.3.0; the "
     "like-for-like peer of `fc`, as `simplefsdp` is of `fc:no-reshard`). The `simplefsdp` rows of `hf-llama` runs "
     "before the `_reshard_peer_` runs (2026-11-30) ran SimpleFSDP without its bucketing, found then with "
     "transformers 5.24: its decorated forward hid the module paths torch's bucketing matches, so each parameter "
     "kept its own all-gather and reduce-scatter (39 each on 4 layers), and each of those rows is slower than "
     "eager FSDP2's step; the bench now calls the model from a module of its own and fails where the bucketing "
     "matches nothing. "
     "`compute-only` (the model unsharded, no collectives; with `--tp`, the TP model without FSDP), `comm-only` "
     "(fc's collectives alone, same ops, sizes and order, no compute; its CPU busy time is what gloo takes from the "
     "cores). The step floors: on a machine whose cores run both gloo and compute, no schedule beats compute-only + "
     "comm-only's CPU time. First steps: since commit 49449c7 each variant compiles with Inductor's caches empty, "
     "before it the variants of one run shared them, and these JSONs record no commit: compare compile times in the "
     "compile-time runs. Paired by window (runs since 2026-11-30): per window, a variant's median step over the "
     "other's in the same window (seconds apart, so a drift of the machine's speed divides out), then the median "
     "and p10-p90 of those ratios over the windows."),
    ("CPU: where the step goes", "profile_step_", "`bench/profile_step.py`: ms per step by bucket under `torch.profiler`."),
    ("CPU: gradient accumulation", "accumulation_", "`bench/accumulation.py`: micro-batches per optimizer step; "
     "`no_sync` sets `set_requires_gradient_sync(False)` on all micro-batches but the last; times and MiB per "
     "optimizer step (counted at torch.distributed for eager, in the compiled graphs for fc)."),
    ("CPU: long run", "soak", "`bench/soak.py`: many steps beside eager FSDP2 with cycling sequence lengths."),
    ("Compile time", "compile_time", "`bench/compile_time.py`: first compiled step (compile included), cold caches and "
     "a warm restart, against depth; by torch's compile timers."),
    ("Planning time", "planning", "`bench/planning.py`: the schedule's search at the first step, on the fake process group."),
    ("CPU: copy kernels", "kernels", "`bench/kernels.py`: GB/s of the copy ops (torch implementation on CPU) against "
     "`copy_` and FSDP2's copy ops."),
    ("Simulated at scale", "scale_sim", "`bench/scale_sim.py`: the cost model and simulator on Llama-3 shapes on the "
     "meta device, batch 1 x 2048 per rank, bf16 compute; nothing here ran on a GPU: H100 figures are predictions. "
     "Variants: `eager-equivalent` (one collective per FSDP module, issued just in time), `eager FSDP2` (the same "
     "graphs with eager FSDP2's own schedule: the next module prefetched in backward, one reduce-scatter pending), "
     "`fc default`, `torch 2.13 passes` (Inductor's bucketing passes with their defaults). The limit is "
     "max(compute, busiest process group's communication) from the same simulation. `--replicate` (FSDP2's `replicate`, "
     "all-reduces only, none in forward): also the per-graph limit, forward compute + max(backward compute, all-reduces)."),
    ("Cost-model calibration", "calibrate_cpu_gloo", "`bench/calibrate_cpu_gloo.py`: the constants of the `cpu-gloo` profile."),
]
_NOT_FLAGS = {"out", "world_size"}  # keys of a recorded config that are not command-line options


# --- formatting ----------------------------------------------------------------------------------------

def num(x, fmt: str = ".1f") -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        return format(x, fmt)
    return str(x)


def ms(seconds, fmt: str = ".1f") -> str:
    return "-" if seconds is None else format(seconds * 1e3, fmt)


def mib(nbytes, fmt: str = ".1f") -> str:
    return "-" if nbytes is None else format(nbytes / 2**20, fmt)


def table(header: list[str], rows: list[list]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return out + [""]


def code(s: str) -> str:
    return f"`{s}`"


# --- what every section starts with ---------------------------------------------------------------------

def machine(d: dict) -> str:
    """Device, software and date, from whichever of the schemas' fields the JSON has."""
    m, env, gpu = d.get("machine") or {}, d.get("env") or {}, d.get("gpu") or {}
    gpu_name = gpu.get("device") or m.get("cuda") or env.get("device") or d.get("device")
    cores = m.get("cpu_count", env.get("cpu_count"))
    cores = f"{cores} cores" if cores is not None else f"core count {NR}"
    model = m.get("cpu_model") or NR
    if gpu_name:
        count = gpu.get("gpu_count", env.get("gpu_count", d.get("gpu_count")))
        device = f"GPU: {gpu_name}" + (f" (machine has {count})" if count is not None else "")
        device += f"; host CPU model {model}, {cores}"
    elif m or env:  # the harness records machine.cuda = None on a CPU run
        device = f"CPU (model {model}), {cores}"
    else:
        device = f"device {NR}"
    parts = [device, f"torch {m.get('torch') or env.get('torch') or d.get('torch') or NR}"]
    for label, value in (("CUDA", gpu.get("cuda") or env.get("cuda_version") or (d.get("cuda") if gpu_name else None)),
                         ("Triton", gpu.get("triton") or env.get("triton") or d.get("triton")),
                         ("NCCL", gpu.get("nccl") or d.get("nccl"))):
        if value:
            parts.append(f"{label} {value}")
    parts.append(f"Python {m.get('python') or env.get('python') or NR}")
    parts.append(f"platform {m.get('platform') or env.get('machine') or NR}")
    parts.append(f"date {m.get('date') or d.get('date') or NR}")
    parts.append(f"commit {d.get('commit') or NR}")
    return "; ".join(parts)


def flags(config: dict, skip: set[str] = frozenset()) -> list[str]:
    """A recorded argparse namespace as command-line options (None and False left out)."""
    out = []
    for key, value in config.items():
        if key in _NOT_FLAGS or key in skip or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif isinstance(value, list):
            out.append(" ".join([flag, *map(str, value)]))
        else:
            out.append(f"{flag} {value}")
    return out


def with_optimizer(cfg: dict) -> dict:
    """A step benchmark's config with its AdamW implementation: runs before ``--optimizer`` existed
    (2026-11-28) used torch's default, foreach."""
    return {**cfg, "optimizer": cfg.get("optimizer", "foreach")}


def torchrun(script: str, world, opts: list[str]) -> str:
    return " ".join([f"torchrun --nproc-per-node {world}", script, *opts])


def command(name: str, d: dict) -> str:
    """``- command ...`` line: the recorded arguments as a command, or what can be rebuilt and how; glibc malloc
    variables the run had (``machine.malloc_env``) go in front of a rebuilt one."""
    line = _command(name, d)
    env = (d.get("machine") or {}).get("malloc_env")
    if env and line.endswith("`") and "`" in line:
        head, _, cmd = line[:-1].rpartition("`")
        line = head + "`" + " ".join(f"{k}={v}" for k, v in env.items()) + " " + cmd + "`"
    return line


def _command(name: str, d: dict) -> str:
    stem = name[:-len(".json")]
    recorded = d.get("command") or (d.get("machine") or {}).get("command")  # a JSON that records its command line
    if recorded:
        return "command (recorded): " + code(recorded if isinstance(recorded, str) else " ".join(map(str, recorded)))
    cfg = d.get("config") or d.get("args")
    if name.startswith(("gpu_step_", "compiled_vs_eager_")) and cfg:
        cfg = with_optimizer(dict(cfg, device=str(cfg.get("device", "auto")).split(":")[0]))  # device recorded as resolved (cuda:0)
        note = "" if cfg.get("stem") in (None, stem) else f"; written as `{cfg['stem']}.json`, renamed since"
        return (f"command (from the JSON's `config`{note}): "
                + code(torchrun("bench/compiled_vs_eager.py", cfg.get("world_size", NR), flags(cfg))))
    if name.startswith(("gpu_profile_", "profile_step_")) and cfg:
        note = "" if cfg.get("stem") in (None, stem) else f"; written as `{cfg['stem']}.json`, renamed since"
        return (f"command (from the JSON's `config`{note}): "
                + code(torchrun("bench/profile_step.py", cfg.get("world_size", NR), flags(with_optimizer(cfg)))))
    if name.startswith("accumulation_") and cfg:
        return "command (from the JSON's `args`): " + code(torchrun("bench/accumulation.py", d.get("world_size", NR), flags(with_optimizer(cfg))))
    if name.startswith("soak") and cfg:
        return ("command (from the JSON's `config`; the world size is not recorded, the script's docstring runs 2 "
                "ranks): " + code(torchrun("bench/soak.py", 2, flags(cfg))))
    if name.startswith("scale_sim") and cfg:
        return "command (from the JSON's `config`): " + code(" ".join(["python3 bench/scale_sim.py", *flags(cfg)]))
    if name.startswith("compile_time"):
        rows = d.get("rows", [])
        depths = sorted({r["depth"] for r in rows})
        variants = list(dict.fromkeys(r["variant"] for r in rows))
        rounds = {r.get("cold", {}).get("rounds") for r in rows} - {None}
        opts = [f"--model {d['model']}"] if d.get("model") else []
        opts += ["--depths " + " ".join(map(str, depths)), "--variants " + " ".join(variants)]
        opts += ["--one-process"] if d.get("one_process") else []
        opts += [f"--repeat {max(rounds)}"] if rounds else []
        return ("command (not recorded; rebuilt from the JSON's rows, `model` and `one_process`): "
                + code(" ".join(["python3 bench/compile_time.py", *opts])))
    if name.startswith("planning"):
        configs = list(dict.fromkeys(f"{r['model']}:{r['world_size']}" for r in d.get("rows", [])))
        policies = list(dict.fromkeys(r["policy"] for r in d.get("rows", [])))
        return ("command (not recorded; rebuilt from the rows and `hardware`, `--repeats` and `--whole-max-units` "
                f"{NR}): " + code(f"python3 bench/planning.py --configs {' '.join(configs)} --policies "
                                  f"{' '.join(policies)} --hardware {d.get('hardware', NR)}"))
    if name.startswith(("kernels", "gpu_kernels")) and d.get("env"):
        env = d["env"]
        opts = ["--device cuda"] if name.startswith("gpu_") else []
        opts += [f"--world-size {env['world_size']}", f"--rank {env['rank']}", f"--repeats {env['repeats']}",
                 f"--warmup {env['warmup']}", f"--threads {env['threads']}"]
        where = "" if name.startswith("gpu_") else ", `--device` not recorded"
        return f"command (rebuilt from the JSON's `env`{where}): " + code(" ".join(["python3 bench/kernels.py", *opts]))
    if name.startswith("gpu_tests"):
        return ("command: not recorded; the file has the form `bench/gpu.sh` step 1 writes "
                "(`python3 -m pytest -m cuda tests`, summarized from its JUnit XML)")
    if name.startswith("calibrate_cpu_gloo"):
        mode = {"calibrate_cpu_gloo_all_reduce": " --all-reduce", "calibrate_cpu_gloo_contention": " --contention",
                "calibrate_cpu_gloo_sync": " --sync"}.get(stem, "")
        return f"command (not recorded; rebuilt from the file's name): `python3 bench/calibrate_cpu_gloo.py{mode}`"
    return f"command: {NR}"


def header(name: str, d: dict) -> list[str]:
    lines = [f"### {name}", "", f"- file: [`bench/results/{name}`]({LINK}{name})", f"- machine: {machine(d)}",
             f"- {command(name, d)}"]
    return lines + [""]


def plot(name: str, files: set[str]) -> list[str]:
    png = name[:-len(".json")] + ".png"
    return [f"![{png}]({LINK}{png})", ""] if png in files else []


# --- one renderer per schema ----------------------------------------------------------------------------

def step_variants(d: dict) -> list[str]:
    """compiled_vs_eager_*.json and gpu_step_*.json."""
    variants = d.get("variants", {})
    cpu_col = any("median_cpu_s" in v for v in variants.values())
    # where a run counted them (--replicate): all-reduces, and Dynamo's graphs and breaks (DDPOptimizer's splits)
    ar_col = any(v.get("all_reduces") is not None for v in variants.values())
    graphs_col = any(v.get("dynamo_graphs") is not None for v in variants.values())
    faults_col = any(v.get("minor_faults_per_step") is not None for v in variants.values())  # runs since 2026-11-28
    head = ["variant", "median ms", "p10-p90 ms", "vs eager", "first step s", "all-gathers", "reduce-scatters",
            "collective MB/step", "peak MiB", "final loss", "loss - eager's", "predicted ms"] + (["CPU busy ms"] if cpu_col else []) + (
            ["all-reduces"] if ar_col else []) + (["Dynamo graphs / breaks"] if graphs_col else []) + (
            ["minor page faults/step"] if faults_col else [])
    rows = []
    for name, v in variants.items():
        p10, p90 = v.get("p10_step_s"), v.get("p90_step_s")
        row = [name, ms(v.get("median_step_s")), f"{ms(p10)}-{ms(p90)}", num(v.get("ratio_vs_eager"), ".2f") + "x",
               num(v.get("first_step_s")), num(v.get("all_gathers"), "d"), num(v.get("reduce_scatters"), "d"),
               num(None if v.get("collective_bytes_per_step") is None else v["collective_bytes_per_step"] / 1e6, ".3f"),
               mib(v.get("peak_bytes")), num(v.get("final_loss"), ".5f"), num(v.get("final_loss_delta_vs_eager"), ".1e"),
               num(v.get("predicted_step_ms"))]
        graphs = "-" if v.get("dynamo_graphs") is None else f"{v['dynamo_graphs']} / {v.get('graph_breaks', NR)}"
        rows.append(row + ([ms(v.get("median_cpu_s"))] if cpu_col else []) + (
            [num(v.get("all_reduces"), "d")] if ar_col else []) + ([graphs] if graphs_col else []) + (
            [num(v.get("minor_faults_per_step"), "d")] if faults_col else []))
    cfg = d.get("config", {})
    out = [f"Median of {cfg.get('steps', NR)} timed steps per variant; peak: {d.get('peak_memory_measures', NR)}.", ""]
    out += table(head, rows)
    per_dim = {n: v["collective_bytes_per_dim"] for n, v in variants.items() if v.get("collective_bytes_per_dim")}
    for name, by_dim in per_dim.items():  # bytes per mesh dim, where the run counted them (--tp runs since issue 46)
        out += [f"- `{name}` collective MB/step by mesh dim: " + ", ".join(f"{d} {b / 1e6:.3f}" for d, b in sorted(by_dim.items()))]
    for name, v in variants.items():  # --pp runs: per rank (a pipeline's stages move different bytes)
        for rank, by_dim in enumerate(v.get("collective_bytes_per_dim_by_rank") or []):
            out += [f"- `{name}` rank {rank} collective MB/step by mesh dim: " + ", ".join(f"{d} {b / 1e6:.3f}" for d, b in sorted(by_dim.items()))]
        if v.get("dp_detail_rank0"):
            out += [f"- `{name}` rank 0 dp MB/step by source: " + ", ".join(f"{k} {b / 1e6:.3f}" for k, b in v["dp_detail_rank0"].items())]
    paired = {n: v["paired"] for n, v in variants.items() if n.startswith(("fc", "simplefsdp")) and v.get("paired")}
    for name, pairs in paired.items():  # runs since 2026-11-30: per window, then the median over the windows
        out += [f"- `{name}` paired by window: " + ", ".join(
            f"{p['median']:.3f}x `{o}` (p10-p90 {p['p10']:.3f}-{p['p90']:.3f}, {p['windows']} windows)"
            for o, p in pairs.items() if p)]
    for variant, why in sorted((d.get("skipped") or {}).items()):
        out += [f"- skipped `{variant}`: {why}"]
    for label, seconds in (d.get("step_floors_s") or {}).items():
        out += [f"- step floor, {label}: {ms(seconds)} ms"]
    by_rank = any(v.get("collective_bytes_per_dim_by_rank") for v in variants.values())
    return out + ([""] if d.get("skipped") or d.get("step_floors_s") or per_dim or by_rank or paired else [])


def profile(d: dict) -> list[str]:
    variants = d.get("variants", {})
    names = list(variants)
    rows = [["step, unprofiled median (ms)", *(ms(variants[n].get("median_step_s")) for n in names)],
            ["step under the profiler (ms)", *(num(variants[n].get("profiled_step_ms")) for n in names)]]
    buckets = list(dict.fromkeys(b for n in names for b in variants[n].get("buckets_ms", {})))
    rows += [[f"host: {b}", *(num(variants[n].get("buckets_ms", {}).get(b)) for n in names)] for b in buckets]
    gpu_buckets = list(dict.fromkeys(b for n in names for b in (variants[n].get("gpu") or {}).get("buckets_ms", {})))
    rows += [[f"device: {b}", *(num((variants[n].get("gpu") or {}).get("buckets_ms", {}).get(b)) for n in names)]
             for b in gpu_buckets]
    if gpu_buckets:
        rows += [["device: busy", *(num((variants[n].get("gpu") or {}).get("busy_ms")) for n in names)],
                 ["device: kernels per step", *(num((variants[n].get("gpu") or {}).get("kernels_per_step"), ".0f") for n in names)]]
    rows += [["final loss", *(num(variants[n].get("final_loss"), ".5f") for n in names)]]
    out = [f"ms per step over {d.get('config', {}).get('steps', NR)} profiled steps, each event's own time in one bucket.", ""]
    out += table(["", *names], rows)
    phases = list(dict.fromkeys(p for n in names for p in variants[n].get("first_step_phases_s", {})))
    if phases:
        out += ["First step (cold), s, by torch's compile timers (inclusive; indented phases are inside the one above):", ""]
        out += table(["phase", *names], [[p.replace("  ", "&nbsp;&nbsp;"), *(num(variants[n].get("first_step_phases_s", {}).get(p), ".2f")
                                                                          for n in names)] for p in phases])
    waits = [(n, variants[n].get("waits_in_order") or []) for n in names]
    for n, ws in waits:
        if ws:
            fw = ", ".join(num(w["ms"]) for w in ws if not w.get("backward"))
            bw = ", ".join(num(w["ms"]) for w in ws if w.get("backward"))
            out += [f"- `{n}` collective waits in order, ms: forward {fw or '-'}; backward {bw or '-'}"]
    return out + ([""] if any(ws for _, ws in waits) else [])


def compile_time(d: dict) -> list[str]:
    rows = d.get("rows", [])
    out = []
    if any("rounds" in r.get("cold", {}) for r in rows):
        out += [f"Medians of {max(r['cold'].get('rounds', 1) for r in rows)} rounds (every round in the JSON's `runs`).", ""]
    out += table(["layers", "variant", "cold first step s", "warm first step s", "planning ms (cold)", "units",
                  "Dynamo frames", "Inductor graphs", "warm: FX / AOT cache hits"],
                 [[r["depth"], r["variant"], num(r["cold"].get("first_step_s")), num(r["warm"].get("first_step_s")),
                   ms(r["cold"].get("planning_s")), num(r["cold"].get("units"), "d"), num(r["cold"].get("dynamo_frames"), "d"),
                   num(r["cold"].get("inductor_graphs"), "d"),
                   f"{num(r['warm'].get('fx_cache_hits'), 'd')} / {num(r['warm'].get('aot_cache_hits'), 'd')}"] for r in rows])
    for variant in dict.fromkeys(r["variant"] for r in rows):
        mine = [r for r in rows if r["variant"] == variant]
        phases = list(dict.fromkeys(p for r in mine for p in r["cold"].get("phases_s", {})))
        if not phases:
            continue
        out += [f"`{variant}`, cold first step by phase, s:", ""]
        out += table(["phase", *(f"{r['depth']} layers" for r in mine)],
                     [[p.replace("  ", "&nbsp;&nbsp;"), *(num(r["cold"]["phases_s"].get(p), ".2f") for r in mine)] for p in phases])
    return out


def accumulation(d: dict) -> list[str]:
    out = table(["variant", "first step s", "median ms", "p10-p90 ms", "MiB all-gathered", "MiB reduce-scattered",
                 "MiB all-reduced", "loss"],
                [[r["variant"], num(r.get("first_step_s"), ".2f"), ms(r.get("median_step_s")),
                  f"{ms(r.get('p10_step_s'))}-{ms(r.get('p90_step_s'))}", num(r.get("mib", {}).get("all_gathers")),
                  num(r.get("mib", {}).get("reduce_scatters")), num(r.get("mib", {}).get("all_reduces")),
                  num(r.get("loss"), ".6f")] for r in d.get("rows", [])])
    if "loss_diff_no_sync" in d:
        out += [f"- loss difference, fc without sync against eager without sync: {num(d['loss_diff_no_sync'], '.1e')}", ""]
    return out


def soak(d: dict) -> list[str]:
    out = [f"- Dynamo graphs by the end of warm-up: {num(d.get('dynamo_graphs_by_warmup'), 'd')}; recompiles after it: "
           f"{num(d.get('recompiles_after_warmup'), 'd')}",
           f"- drift of the medians, end against start: step peak {num(100 * d['drift_of_medians']['step_peak_bytes'], '+.1f')}%, "
           f"RSS {num(100 * d['drift_of_medians']['rss_bytes'], '+.2f')}%" if d.get("drift_of_medians") else "- drift: -", ""]
    memory = d.get("memory", {})
    out += table(["step", "step peak MiB", "RSS MiB"],
                 [[k, mib(v.get("step_peak_bytes"), ".2f"), mib(v.get("rss_bytes"))] for k, v in sorted(memory.items(), key=lambda kv: int(kv[0]))])
    out += table(["step", "eager loss", "compiled loss", "equal"],
                 [[r["step"], num(r["loss_eager"], ".6f"), num(r["loss_compiled"], ".6f"), num(r["equal"])] for r in d.get("losses", [])])
    return out


def scale_sim(d: dict) -> list[str]:
    rows = d.get("rows", [])
    extra = [k for k in ("limit_ms", "step_over_limit", "planning_ms", "units", "capture_s") if any(k in r for r in rows)]
    extra += ["all_reduces", "limit_per_graph_ms"] if any(r.get("all_reduces") for r in rows) else []  # --replicate
    names = {"limit_ms": "limit ms", "step_over_limit": "step / limit", "planning_ms": "planning ms", "units": "units",
             "all_reduces": "all-reduces", "limit_per_graph_ms": "per-graph limit ms",
             "capture_s": "capture s (fc.explain, one process)"}
    fmts = {"limit_ms": ".1f", "step_over_limit": ".3f", "planning_ms": ".0f", "units": "d", "all_reduces": "d",
            "limit_per_graph_ms": ".1f", "capture_s": ".1f"}
    return table(["model", "W", "tp", "profile", "variant", "float8 all-gather", "step ms", "exposed comm ms (%)",
                  "peak GiB", "all-gathers", "reduce-scatters", *(names[k] for k in extra)],
                 [[r["model"] + (f" ({r['layers']} layers" + (f" a stage, pp {r['pp']}" if "pp" in r else "") + ")" if "layers" in r else ""), r["world_size"], r.get("tp", 1), r["hardware"], r["variant"], num(r.get("float8_all_gather")),
                   num(r["step_ms"]), f"{num(r['exposed_comm_ms'])} ({num(r.get('exposed_pct'))}%)",
                   num(r["peak_bytes"] / 2**30, ".2f"), r.get("all_gathers", "-"), r.get("reduce_scatters", "-"),
                   *(num(r.get(k), fmts[k]) for k in extra)] for r in rows])


def planning(d: dict) -> list[str]:
    return [f"Cost-model profile `{d.get('hardware', NR)}`, {d.get('workload', NR)} tokens per step; \"whole\" judges every "
            "candidate by a prediction of the whole step (the search before `predict.Search`).", ""] + table(
        ["model", "W", "policy", "units", "search s", "whole-step search s", "speed-up", "same plan"],
        [[r["model"], r["world_size"], r["policy"], r["units"], num(r["search_s"], ".3f"), num(r.get("whole_s"), ".3f"),
          "-" if r.get("whole_s") is None else num(r["whole_s"] / r["search_s"], ".1f") + "x", num(r.get("same_plan"))]
         for r in d.get("rows", [])])


def kernels(d: dict) -> list[str]:
    out = []
    for device in ("cpu", "cuda"):
        rows = d.get(device)
        if isinstance(rows, str):
            out += [f"- {device}: {rows}", ""]
            continue
        if not rows:
            continue
        ours = "triton" if device == "cuda" else "ours"
        head = ["workload", "kernel", "dtypes", "MB moved", f"{ours} GB/s", f"{ours} (out=) GB/s", "FSDP2's op GB/s",
                "`copy_` GB/s", "alloc + `copy_` GB/s"]
        if device == "cuda":
            head += ["torch impl GB/s", f"{ours} host us/call", "FSDP2's op host us/call"]
        body = []
        for r in rows:
            row = [r["workload"], r["kernel"], r["dtypes"], num(r["bytes"] / 1e6, ".1f"), num(r.get(f"{ours}_GBps")),
                   num(r.get(f"{ours}_out_GBps")), num(r.get("fsdp_GBps")), num(r.get("copy_GBps")), num(r.get("alloc_copy_GBps"))]
            if device == "cuda":
                row += [num(r.get("torch_GBps")), num(None if r.get("triton_wall_ms") is None else r["triton_wall_ms"] * 1e3, ".0f"),
                        num(None if r.get("fsdp_wall_ms") is None else r["fsdp_wall_ms"] * 1e3, ".0f")]
            body.append(row)
        timing = (d.get("env") or {}).get("timing")
        out += [f"{device.upper()}" + (f" ({timing})" if timing else "") + ":", ""] + table(head, body)
    return out


def gpu_tests(d: dict) -> list[str]:
    counts = d.get("counts", {})
    out = ["- " + ", ".join(f"{k} {v}" for k, v in counts.items()), ""]
    return out + table(["test", "outcome", "s", "message"],
                       [[r["test"], r["outcome"], num(r.get("seconds"), ".2f"), (r.get("message") or "").splitlines()[0][:160] if r.get("message") else ""]
                        for r in d.get("tests", [])])


def calibrate(d: dict) -> list[str]:
    if "matmuls" in d:  # --sync: the same compute cut by k waits
        ks = list(d["rows"][0]["step_s"])
        out = table(["all-reduce bytes", *(f"step ms, {k} waits" for k in ks), "ms per wait (16 against 4)", "all-reduce alone ms"],
                    [[r["bytes"], *(num(r["step_s"][k] * 1e3, ".1f") for k in ks), num(r["per_wait_s"] * 1e3, ".2f"),
                      num(r["alone_s"] * 1e3, ".2f")] for r in d["rows"]])
        return out + [f"The compute: {d['matmuls']} matmuls of 256 x 256 on each rank, cut into k segments with an all-reduce waited at "
                      "once after each. Not in the `cpu-gloo` profile.", ""]
    if "rows" in d:  # --contention: a training step with a collective beside it
        out = table(["collective", "bytes", "collective ms", "step ms", "step's delay ms", "delay / collective"],
                    [[r["kind"], r["bytes"], num(r["collective_s"] * 1e3, ".2f"), num(r["compute_s"] * 1e3, ".1f"),
                      num(r["delay_s"] * 1e3, ".2f"), num(r["delay_s"] / r["collective_s"], ".2f")] for r in d["rows"]])
        return out + [f"Fit (least squares through 0): `comm_cpu_share` = {num(d['fit']['comm_cpu_share'], '.3f')}.", ""]
    c = d.get("constants", {})
    out = table(["constant", "value"], [[k, num(v, ".4g")] for k, v in c.items()])
    coll = d.get("collectives", {})
    sizes = sorted({int(n) for rows in coll.values() for n, _ in rows})
    out += ["Median time per collective on 2 ranks, us:", ""]
    times = {k: {int(n): t for n, t in rows} for k, rows in coll.items()}
    out += table(["bytes", *coll], [[n, *(num(times[k][n] * 1e6, ".0f") if n in times[k] else "-" for k in coll)]
                                    for n in sizes])
    return out


def generic(d: dict) -> list[str]:
    return [f"No table for this schema yet (bench/results_page.py); top-level keys: {', '.join(sorted(d))}.", ""]


RENDERERS = {"gpu_step_": step_variants, "compiled_vs_eager_": step_variants, "gpu_profile_": profile,
             "profile_step_": profile, "accumulation_": accumulation, "soak": soak, "compile_time": compile_time,
             "planning": planning, "kernels": kernels, "gpu_kernels": kernels, "scale_sim": scale_sim,
             "gpu_tests": gpu_tests, "calibrate_cpu_gloo": calibrate}


# --- the page ----------------------------------------------------------------------------------------------

def family_of(name: str) -> str | None:
    return next((prefix for _, prefix, _ in FAMILIES if name.startswith(prefix)), None)


def render(results_dir: str = RESULTS) -> str:
    files = set(os.listdir(results_dir))
    jsons = sorted(f for f in files if f.endswith(".json"))
    lines = ["# Results", "",
             "<!-- generated by bench/results_page.py from bench/results/*.json: do not edit; regenerate with "
             "`python3 bench/results_page.py` -->", "",
             "Every measurement this project keeps, one section per JSON in `bench/results/`, each with the machine, "
             "torch version and date its JSON records and the command that produced it. Figures from different "
             "sections ran on different days and machines: compare within a table. Where a JSON lacks a field this "
             "page says \"not recorded\". CPU runs before 2026-11-28 name no CPU model (their JSONs record none), only the "
             "core count and the platform string. How to read them: [compile-time.md](compile-time.md), [gpu.md](gpu.md), "
             "[design.md](design.md).", ""]
    sections: list[tuple[str, list[str]]] = []
    for title, prefix, about in FAMILIES:
        mine = [f for f in jsons if family_of(f) == prefix]
        if mine:
            sections.append((title, [about, ""] + [line for f in mine for line in section(f, results_dir, files)]))
    other = [f for f in jsons if family_of(f) is None]
    if other:
        sections.append(("Other", [line for f in other for line in section(f, results_dir, files)]))
    extra = sorted(f for f in files if not f.endswith((".json", ".png")) and not f.startswith("."))
    extra += sorted(f for f in files if f.endswith(".png") and f[:-4] + ".json" not in files)
    if extra:
        body = []
        for f in extra:
            first = ""
            if f.endswith(".txt"):
                with open(os.path.join(results_dir, f)) as fh:
                    first = fh.readline().strip().lstrip("# ")
            body.append(f"- [`bench/results/{f}`]({LINK}{f})" + (f": {first}" if first else ""))
        sections.append(("Other files", body + [""]))
    lines += ["Contents: " + " · ".join(f"[{t}](#{anchor(t)})" for t, _ in sections), ""]
    for title, body in sections:
        lines += [f"## {title}", ""] + body
    while lines and lines[-1] == "":
        lines.pop()
    return "\n".join(lines) + "\n"


def section(name: str, results_dir: str, files: set[str]) -> list[str]:
    with open(os.path.join(results_dir, name)) as f:
        d = json.load(f)
    prefix = next((p for p in sorted(RENDERERS, key=len, reverse=True) if name.startswith(p)), None)
    try:
        body = RENDERERS[prefix](d) if prefix else generic(d)
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError) as e:  # a schema this script does not know yet
        body = [f"This JSON does not have the schema its name suggests ({type(e).__name__}: {e}); extend "
                "bench/results_page.py."] + generic(d)
    try:
        head = header(name, d)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        head = [f"### {name}", "", f"- file: [`bench/results/{name}`]({LINK}{name})",
                f"- machine and command: could not be read ({type(e).__name__}: {e})", ""]
    return head + body + plot(name, files)


def anchor(title: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    kept = "".join(c for c in title.lower() if c.isalnum() or c in " -_")
    return kept.replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is not what this script writes now")
    ap.add_argument("--out", default=PAGE, help="where to write the page (default docs/results.md)")
    ap.add_argument("--results", default=RESULTS, help="the JSON directory (default bench/results)")
    args = ap.parse_args(argv)
    page = render(args.results)
    if args.check:
        try:
            with open(args.out) as f:
                current = f.read()
        except FileNotFoundError:
            current = ""
        if current != page:
            diff = list(difflib.unified_diff(current.splitlines(), page.splitlines(), args.out, "regenerated", lineterm="", n=1))
            print(f"{os.path.relpath(args.out, ROOT)} is not current with bench/results/*.json (or bench/results_page.py): "
                  f"run python3 bench/results_page.py and commit the page. First differences:", file=sys.stderr)
            print("\n".join(diff[:40]), file=sys.stderr)
            return 1
        print(f"{os.path.relpath(args.out, ROOT)} is current")
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(page)
    print(f"wrote {os.path.relpath(args.out, ROOT)} ({len(page)} characters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
