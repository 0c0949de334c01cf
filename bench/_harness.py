"""Shared benchmark harness: interleaved timing windows, robust statistics, peak memory, results files.

Noisy shared machines (measured here: ±25% run to run) need ratios from one run: every variant is
timed in short windows interleaved with the others, so drift hits all of them alike, and the reported
figures are medians with p10/p90 spread. Warm-up (the compile) is timed separately and excluded.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import sys
import time

import torch

import fsdp_compile as fc


OPTIMIZERS = ("fused", "foreach")


def adamw(params, lr: float, implementation: str = "fused") -> torch.optim.AdamW:
    """Every benchmark's optimizer, the same in every variant: AdamW as torchtitan builds it by default
    (``"fused"``: one fused kernel per step), or torch's default (``"foreach"``). FSDP2's parameters are
    DTensors, and each of foreach AdamW's dozen ops per step is dispatched through DTensor, where fused AdamW
    is one dispatch: on the 2-core CPU (2 gloo ranks, ``small``, 39 parameters) its step took 27.7 ms foreach
    and 5.3 ms fused on fully_shard's parameters, 38.5 and 8.4 ms on replicate's, 18.3 and 6.9 ms on plain
    ones (compute-only). ``--optimizer foreach`` gives the benchmarks' figures before 2026-11-28."""
    if implementation not in OPTIMIZERS:
        raise ValueError(f"optimizer implementation must be one of {OPTIMIZERS}, got {implementation!r}")
    return torch.optim.AdamW(params, lr=lr, **{implementation: True})


def add_optimizer_arg(ap) -> None:
    ap.add_argument("--optimizer", default="fused", choices=OPTIMIZERS,
                    help="AdamW's implementation in every variant: fused (torchtitan's default) or foreach (torch's)")


def names_listed(values: list[str] | None) -> list[str] | None:
    """``--variants`` as given, space- or comma-separated (``fc simplefsdp`` or ``fc,simplefsdp``)."""
    return None if values is None else [v for value in values for v in value.split(",") if v]


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(times: list[float]) -> dict:
    return {
        "median_step_s": statistics.median(times),
        "p10_step_s": percentile(times, 0.1),
        "p90_step_s": percentile(times, 0.9),
        "steps_timed": len(times),
    }


# the variants a step benchmark's rows are paired with (``paired``), where the run has them
PAIRED_WITH = ("eager", "torch.compile", "ddp+torch.compile", "simplefsdp", "simplefsdp:reshard", "compute-only")


def paired(times: list[float], ref: list[float], window: int) -> dict | None:
    """``times`` against ``ref``, paired by window: per window, the median of ``times``' steps over the median
    of ``ref``'s; their median and p10 / p90 over the windows. The step benchmarks time their variants in
    interleaved windows (each window runs every variant in turn), so a variant's window and the reference's
    ran seconds apart: a drift of the machine's speed (15-20% between runs of the 2-core CPU, ±10% within
    one) divides out of each window's ratio, where it stays in a ratio of whole-run medians. None without
    two windows each."""
    def medians(xs):
        return [statistics.median(xs[i:i + window]) for i in range(0, len(xs), window)]

    a, b = medians(times), medians(ref)
    if len(a) != len(b) or len(a) < 2:
        return None
    ratios = [x / y for x, y in zip(a, b)]
    return {"median": statistics.median(ratios), "p10": percentile(ratios, 0.1), "p90": percentile(ratios, 0.9),
            "windows": len(ratios)}


def paired_with(name: str, times: dict, window: int) -> dict:
    """``paired`` of variant ``name``'s timed steps against each other variant of ``PAIRED_WITH`` in ``times``
    (variant -> its timed steps)."""
    return {o: paired(times[name], times[o], window) for o in PAIRED_WITH if o in times and o != name}


def paired_line(name: str, pairs: dict) -> str | None:
    """``fc, paired by window: 1.030x simplefsdp (p10-p90 0.970-1.090 over 8 windows), ...`` from ``paired_with``'s
    result; None where it holds no ratio."""
    parts = [f"{v['median']:.3f}x {o} (p10-p90 {v['p10']:.3f}-{v['p90']:.3f} over {v['windows']} windows)"
             for o, v in pairs.items() if v]
    return f"{name}, paired by window: " + ", ".join(parts) if parts else None


def medians_s(fns: dict, repeats: int, warmup: int, sync=lambda: None) -> dict:
    """Median seconds per call of each fn, timed round-robin (one call of each per round) so that load
    from other processes on a shared machine hits every variant alike; the first ``warmup`` rounds are
    dropped. ``sync`` runs before and after each call (``torch.cuda.synchronize`` on a GPU)."""
    times = {k: [] for k in fns}
    for i in range(warmup + repeats):
        for k, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def median_s(fn, repeats: int, warmup: int, sync=lambda: None) -> float:
    return medians_s({"fn": fn}, repeats, warmup, sync)["fn"]


def adaptive_median_s(fn, min_reps: int = 5, min_time: float = 0.2, max_reps: int = 2000) -> float:
    """Median seconds per call after one warm-up call, repeating until both ``min_reps`` calls and
    ``min_time`` seconds are reached (for calls whose duration is not known in advance)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= max_reps:
            break
    return statistics.median(times)


def step_peak_bytes(step, device: torch.device) -> int:
    """Peak tensor bytes allocated while ``step()`` runs, above what was live before it.

    CUDA: ``max_memory_allocated`` minus ``memory_allocated`` at the start. CPU: the same quantity from
    the profiler's allocation events (``profile_memory=True``), since the process's RSS cannot show it
    (glibc keeps freed pages resident and every variant shares the process). Counts activations,
    gathered parameters and gradients; not the parameters and optimizer state that live across steps.
    """
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.device_type() == torch._C._autograd.DeviceType.CPU]
    live = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        live += e.nbytes()
        peak = max(peak, live)
    return peak


class Progress:
    """One status line on rank 0's stderr (no extra dependency)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled, self.t0 = total, 0, enabled, time.monotonic()

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            elapsed = time.monotonic() - self.t0
            sys.stderr.write(f"\r[{self.done}/{self.total}] {elapsed:6.1f}s {label:<60}")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


def init_ranks(timeout_s: float = 900.0):
    """The process group of a torchrun launch: NCCL with one GPU per rank when CUDA is present, else gloo
    with one thread per rank. Returns ``(device, rank, world size, say)``, ``say`` printing on rank 0 only."""
    import datetime

    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)
        fc.single_thread_gloo()  # torch's gloo races between its worker threads (fsdp_compile/_torch/_gloo.py)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank = dist.get_rank()
    return device, rank, dist.get_world_size(), (print if rank == 0 else (lambda *a, **k: None))


def machine() -> dict:
    return {
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "malloc_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")},  # glibc's tuning
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def cpu_model() -> str | None:
    """The host CPU's model name (/proc/cpuinfo), or None where there is none to read. Two machines of the same
    core count and platform string differed by 1.4x in one CPU step benchmark (compute-only 88.0 against 63.2
    ms, 2026-11-28), so a CPU figure without its machine is hard to compare."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def minor_faults() -> int:
    """Minor page faults of this process so far, every thread (``getrusage``): on a CPU each first touch of
    memory that glibc's malloc took fresh from the kernel (an mmap above its threshold) is one per 4 KiB page."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def gpu_info(device) -> dict:
    """Which GPU, and which software, produced a GPU run's numbers."""
    import triton

    return {"device": torch.cuda.get_device_name(device), "gpu_count": torch.cuda.device_count(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version()))}


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def bar_chart(path: str, names: list[str], values: list[float], errors: list[tuple[float, float]], title: str, ylabel: str) -> bool:
    """A PNG bar chart with p10-p90 whiskers; returns False (and writes nothing) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(names)), 4))
    lower = [v - lo for v, (lo, _) in zip(values, errors)]
    upper = [hi - v for v, (_, hi) in zip(values, errors)]
    ax.bar(range(len(names)), values, yerr=[lower, upper], capsize=4, color="#4C72B0")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    for i, v in enumerate(values):
        ax.annotate(f"{v:.1f}", (i, v), ha="center", va="bottom", fontsize=8, xytext=(0, 3), textcoords="offset points")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


@contextlib.contextmanager
def passes_timer(acc: list):
    """Seconds of each call of our passes (``backend.run_passes``), appended to ``acc``."""
    from fsdp_compile import backend

    run = backend.run_passes

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return run(*a, **k)
        finally:
            acc.append(time.perf_counter() - t0)

    backend.run_passes = timed
    try:
        yield
    finally:
        backend.run_passes = run


# torch's compile timers (dynamo_timed), inclusive and nested as listed: Dynamo's compile of the frame holds
# the backend call, which holds AOTAutograd and the forward's Inductor compile; the backward's compile runs
# at the first backward unless AOTAutograd compiled it eagerly. Shown as they are, not differenced.
PHASES = (
    ("Dynamo: the frame (tracing, guards, the backend call)", ("_compile.compile_inner",)),
    ("  backend call (AOTAutograd + the forward's Inductor compile)", ("OutputGraph.call_user_compiler",)),
    ("  partitioner", ("min_cut_rematerialization_partition",)),
    ("backward compile (compile_fx bw_compiler)", ("compile_fx.<locals>.bw_compiler",)),
    ("Inductor per graph, forward + backward (compile_fx_inner)", ("compile_fx_inner",)),
    ("  our passes (run_passes, inside Inductor's post-grad passes)", ()),
    ("  lowering (GraphLowering.run)", ("GraphLowering.run",)),
    ("  scheduling + code generation", ("Scheduler.__init__", "GraphLowering.codegen")),
    ("  C++/Triton compile + module load", ("PyCodeCache.load_by_key_path",)),
)


@contextlib.contextmanager
def cold_compile(cold: bool = True):
    """Inductor's caches empty for what runs inside (when ``cold``): its in-memory caches cleared and a
    new on-disk cache dir, kept afterwards for the compiled modules. Without it, variants compiled one
    after another in one process share Inductor's kernels and graphs, and the later ones' first steps
    are not cold. (Dynamo's caches live on code objects and stay shared: on one H100 the compute-only
    model's first step took 1.4 s right after torch.compile's, whose frames' guards it passed, and 36.8 s
    in profile_step after ``torch._dynamo.reset()``.)"""
    if not cold:
        yield
        return
    from torch._inductor.utils import fresh_cache

    with fresh_cache(delete=False):
        yield


@contextlib.contextmanager
def compile_timing():
    """Torch's compile timers (``compilation_time_metrics``, cleared first) and our passes over the block:
    yields a dict filled on exit with ``timers`` (seconds per timer), ``calls`` (calls per timer) and
    ``passes_s``; ``compile_phases`` turns it into ``PHASES``."""
    metrics = torch._dynamo.utils.compilation_time_metrics
    metrics.clear()
    ours: list[float] = []
    out: dict = {}
    with passes_timer(ours):
        yield out
    out["timers"] = {k: sum(v) for k, v in metrics.items()}
    out["calls"] = {k: len(v) for k, v in metrics.items()}
    out["passes_s"] = sum(ours)


def compile_phases(timing: dict, first_s: float) -> dict:
    """Seconds per phase of the first step (``PHASES``, from a ``compile_timing`` record), plus the first
    step itself."""
    phases = {"first step": first_s}
    for label, keys in PHASES:
        phases[label] = timing["passes_s"] if not keys else sum(timing["timers"].get(k, 0.0) for k in keys)
    return phases
