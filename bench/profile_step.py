"""Where one compiled step's time goes: fsdp_compile against torchtitan's SimpleFSDP and the compute-only
bound, on the same model, data and ranks as bench/compiled_vs_eager.py (whose variants this reuses).

    torchrun --nproc-per-node 2 bench/profile_step.py [--model hf-llama|small|tiny] [--steps 6]
                                                      [--variants fc simplefsdp compute-only ...]
    torchrun --nproc-per-node 1 bench/profile_step.py --model llama-1b --mp bf16 --batch 2 \
        --variants eager torch.compile fc compute-only                     # one GPU

Per variant, on rank 0:
* the first step (the compile), by phase, from torch's own compile timers
  (``torch._dynamo.utils.compilation_time_metrics``, inclusive and nested: ``_harness.PHASES``) and a timer around
  our passes: Dynamo's frame compile, the backend call, the partitioner, the backward's compile, and per
  Inductor graph its lowering, scheduling and code generation, and C++/Triton compile;
* a steady step, timed without the profiler (median of ``--steps``), then the same steps under
  ``torch.profiler`` with Inductor's kernel and wrapper-call marks on (they are compiled in, for every
  variant alike), every event's self time put in one bucket:

  matmul, attention      aten mm/addmm/bmm and SDPA kernels (extern calls from the graphs, or eager)
  fused kernels          Inductor's generated C++/Triton kernels, other than copies
  copy-in/copy-out       generated kernels made only of cat/copy/split/pad-like ops, and FSDP's own copy ops
  collective launch      the c10d call that enqueues an all-gather / reduce-scatter / all-reduce
  collective wait        wait_tensor and Work.wait: the time compute waited for communication
  other aten             every other ATen op's own time (views, allocations, small eager ops)
  graph wrapper          the generated Python wrapper's own time (between kernels, region calls included)
                         and AOTAutograd's runtime wrappers
  fc outside graph       CompiledFSDPModule.forward around the graph: settings and step key, the local
                         shards (to_local, all-gather extensions), gradient-sync sinks
  dynamo guards          Dynamo's cache lookup and guard evaluation at each call
  autograd engine        the engine's own time between backward nodes
  optimizer              AdamW's step and zero_grad
  step barrier (bench)   the benchmark's barrier before each step (the ranks' skew)
  unattributed           the step's wall time outside every profiled event (Python between ops, barrier)

The profiler's own overhead inflates the small events: the table gives both ms per step under the
profiler and each bucket's share of it; the unprofiled median is the step time.

On GPUs the same steps are also profiled on the device (``ProfilerActivity.CUDA``), and a second table
puts each kernel's (and memcpy's, memset's) device time in a bucket, by its name and by the CPU op that
launched it (``GPU_BUCKETS``): what the GPU spent the step on, and how long it sat idle (the profiled
step's wall time less the union of its kernels' intervals), which is where the host's Python, launches
and waits show. ``--trace-dir`` also writes each variant's profile as a Chrome trace (gzipped), for
Perfetto or tlparse-like tools. Writes bench/results/profile_step_<model>.json (``--stem`` otherwise).

``--replicate``: FSDP2's ``replicate`` per block and on the root (``bench/_replicate_bench.py``'s model), that
bench's fc variants (``fc``, ``fc:one-bucket``: every module's gradients in one all-reduce, ``fc:free-overlap``,
``fc:fsdp_group``, ``fc:no-reorder``) and ``compute-only``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import gzip
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
import _replicate_bench as RB  # noqa: E402
import compiled_vs_eager as CVE  # noqa: E402  (sets a cold Inductor cache dir unless --warm-cache)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import _harness as H  # noqa: E402

from fsdp_compile import _api  # noqa: E402

BUCKETS = ("matmul", "attention", "fused kernels", "copy-in/copy-out", "collective launch", "collective wait",
           "other aten", "graph wrapper", "fc outside graph", "dynamo guards", "autograd engine", "optimizer",
           "step barrier (bench)", "unattributed")
# ops that only move bytes: a generated kernel made of these alone is a copy-in/copy-out
_COPY_OPS = {"cat", "copy", "to", "split", "with", "sizes", "clone", "view", "slice", "constant", "pad", "nd", "new",
             "zeros", "empty", "fill", "select", "narrow", "as", "strided", "full", "scatter", "index", "put", "cpp",
             "fused", "triton", "poi", "per", "red", "unsafe", "expand", "permute", "t", "transpose", "reshape",
             "unsqueeze", "squeeze", "contiguous", "stack", "chunk", "all", "gather", "reduce", "copy_", "in", "out",
             "fsdp", "compile", "cast", "unshard", "reshard", "pack", "unpack", "graph"}
_MATMUL = re.compile(r"^aten::(mm|addmm|bmm|baddbmm|_scaled_mm|matmul|linear)$")
_ATTENTION = re.compile(r"scaled_dot_product|flash_attention|efficient_attention")
_LAUNCH = re.compile(r"all_gather|allgather|reduce_scatter|all_reduce|allreduce|broadcast|all_to_all", re.I)
_WAIT = re.compile(r"wait_tensor|::wait$|Work\.wait|c10d::wait", re.I)
_FC = "fc:"  # our record_function marks
# device time on GPUs: by kernel name, and by the CPU op that launched the kernel (optimizer, FSDP2's copies)
GPU_BUCKETS = ("matmul", "attention", "fused kernels", "copy-in/copy-out", "collective (NCCL)", "optimizer",
               "memcpy/memset", "other aten kernels", "idle")
_GPU_MATMUL = re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|matmul|sm\d+_.*(mma|tensorop)", re.I)
_GPU_ATTENTION = re.compile(r"flash|fmha|attention|sdpa|softmax_warp", re.I)
_GPU_COPY = re.compile(r"_(all_gather|reduce_scatter)_copy_(in|out)_kernel|chunk_cat|split_with_sizes_copy", re.I)


def _kernel_bucket(name: str) -> str:
    tokens = {t for t in re.split(r"[_\W]+", name.lower()) if t and not t.isdigit()}
    return "copy-in/copy-out" if tokens <= _COPY_OPS else "fused kernels"


def bucket_of(name: str, ancestors: list[str]) -> str:
    if any(a.startswith("Optimizer.") for a in ancestors) or name.startswith("Optimizer."):
        return "optimizer"
    if name == "c10d::barrier" or any(a == "c10d::barrier" for a in ancestors):
        return "step barrier (bench)"
    if _WAIT.search(name):
        return "collective wait"
    if name.startswith(("fsdp::", "fsdp_compile::")):  # before the launch pattern: fsdp_compile::all_gather_copy_in
        return "copy-in/copy-out"
    if _LAUNCH.search(name) and "cpp_fused" not in name and "triton_" not in name:
        return "collective launch"
    if _MATMUL.match(name):
        return "matmul"
    if _ATTENTION.search(name):
        return "attention"
    kernel = re.sub(r"^graph_(\d+|None)_", "", name)  # Inductor prefixes a graph's kernels with its id
    if kernel.startswith(("cpp_fused", "triton_", "kernel_cpp")):
        return _kernel_bucket(kernel)
    if "inductor_wrapper_call" in name or name.startswith(("CompiledFunction", "## Call CompiledFxGraph")):
        return "graph wrapper"
    if name.startswith(_FC):
        return "fc outside graph"
    if "Dynamo" in name or name.startswith("Torch-Compiled Region"):
        return "dynamo guards"
    if name.startswith("autograd::engine"):
        return "autograd engine"
    if name.startswith("aten::") or name.startswith("c10d::"):
        return "other aten"
    return "graph wrapper" if "graph" in name.lower() else "other aten"


def waits_in_order(prof, steps: int) -> list[dict]:
    """Each collective wait of a step in the order the step meets it (the same every step), its mean ms
    over the steps and whether it ran in the backward: where the step blocked on communication."""
    waits = sorted((e for e in prof.events() if _WAIT.search(e.name)), key=lambda e: e.time_range.start)
    if not waits or len(waits) % steps:
        return []
    per = len(waits) // steps
    out = []
    for i in range(per):
        evs = waits[i::per]
        backward, p = False, evs[0].cpu_parent
        while p is not None:
            backward |= "Backward" in p.name or p.name.startswith("autograd::engine")
            p = p.cpu_parent
        out.append({"index": i, "backward": backward, "ms": sum(e.cpu_time_total for e in evs) / 1e3 / steps})
    return out


def attribute(prof, steps: int, wall_s: float) -> tuple[dict, list]:
    """ms per step per bucket, and the 15 largest (bucket, name) self times."""
    per = collections.Counter()
    names = collections.Counter()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    top_total = 0.0
    for e in events:
        ancestors, p = [], e.cpu_parent
        while p is not None:
            ancestors.append(p.name)
            p = p.cpu_parent
        if not ancestors and e.name != "ProfilerStep*":
            top_total += e.cpu_time_total
        b = bucket_of(e.name, ancestors)
        per[b] += e.self_cpu_time_total
        names[(b, e.name)] += e.self_cpu_time_total
    per["unattributed"] += max(0.0, wall_s * 1e6 - top_total)
    ms = {b: per[b] / 1e3 / steps for b in BUCKETS}
    top = [{"bucket": b, "name": n, "ms_per_step": t / 1e3 / steps} for (b, n), t in names.most_common(15)]
    return ms, top


def gpu_bucket(name: str, launchers: list[str]) -> str:
    """The bucket of one device event: its name, and the names of the CPU op that launched it and of that
    op's ancestors (innermost first)."""
    if any(a.startswith("Optimizer.") for a in launchers):
        return "optimizer"
    low = name.lower()
    if "nccl" in low:
        return "collective (NCCL)"
    if low.startswith(("memcpy", "memset")):
        return "memcpy/memset"
    if _GPU_COPY.search(name) or any(a.startswith(("fsdp::", "fsdp_compile::")) for a in launchers):
        return "copy-in/copy-out"
    if _GPU_ATTENTION.search(name) or any(_ATTENTION.search(a) for a in launchers[:3]):
        return "attention"  # before matmul: cuDNN's attention kernels are named sm90_..._wgmma too
    if _GPU_MATMUL.search(name):
        return "matmul"
    if "multi_tensor_apply" in low:
        return "optimizer"
    kernel = re.sub(r"^graph_(\d+|None)_", "", name)
    if kernel.startswith("triton_"):
        return _kernel_bucket(kernel)
    return "other aten kernels"


def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def gpu_attribute(prof, steps: int, wall_s: float) -> dict:
    """Device time per step per ``GPU_BUCKETS`` bucket (ms), the GPU's idle time within the profiled
    steps, and the 12 largest kernels by device time."""
    events = prof.events()
    cpu = {e.id: e for e in events if e.device_type == torch.autograd.DeviceType.CPU}
    per, names, spans = collections.Counter(), collections.Counter(), []
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA or e.is_user_annotation:
            continue  # record_function ranges (Inductor's wrapper calls, Optimizer.step) are mirrored on the GPU
        launchers, p = [], cpu.get(e.linked_correlation_id)
        while p is not None:
            launchers.append(p.name)
            p = p.cpu_parent
        start, end = e.time_range.start, e.time_range.end
        b = gpu_bucket(e.name, launchers)
        per[b] += end - start
        names[(b, e.name)] += end - start
        spans.append((start, end))
    busy = _union_us(spans)
    ms = {b: per[b] / 1e3 / steps for b in GPU_BUCKETS}
    ms["idle"] = max(0.0, wall_s * 1e6 - busy) / 1e3 / steps
    return {"buckets_ms": ms, "busy_ms": busy / 1e3 / steps, "kernels_per_step": len(spans) / steps,
            "top_kernels": [{"bucket": b, "name": n, "ms_per_step": t / 1e3 / steps}
                            for (b, n), t in names.most_common(12)]}


@contextlib.contextmanager
def fc_marks():
    """record_function marks around CompiledFSDPModule.forward's work outside the graph (patched in this
    process only)."""
    patched = []

    def mark(owner, attr, label):
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def wrapped(*a, **k):
            with record_function(_FC + label):
                return fn(*a, **k)

        setattr(owner, attr, wrapped)
        patched.append((owner, attr, fn))

    mark(_api.CompiledFSDPModule, "forward", "forward (own time)")
    mark(_api.CompiledFSDPModule, "_current_step", "settings and step key")
    mark(_api.CompiledFSDPModule, "_gradient_sync", "gradient-sync sinks")
    mark(_api._extensions, "prepare", "local shards (to_local, extensions)")
    try:
        yield
    finally:
        for owner, attr, fn in reversed(patched):
            setattr(owner, attr, fn)


# --replicate: _replicate_bench's fc variants and the compute-only bound (its DDP, eager and comm-only are not profiled)
REPLICATE_VARIANTS = [n for n in RB.REPLICATE_VARIANTS if n.startswith("fc") or n == "compute-only"]


def replicate_variant(name: str, model_name: str, backend: str):
    """``--replicate``: what turns the unsharded model into variant ``name``'s callable (``_replicate_bench``'s)."""
    if name == "compute-only":
        return CVE.make_variant(name, model_name, backend)
    return lambda model: RB.compile_replicated(name, RB.replicated(model, model_name), model_name, backend, CVE)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="hf-llama", choices=[*sorted(CVE.SIZES), *CVE.BENCH_SIZES, "hf-llama"])
    ap.add_argument("--mp", default=None, choices=[k for k in CVE.MP if k], help="FSDP2 mixed precision (bf16 parameters, fp32 reduce)")
    ap.add_argument("--steps", type=int, default=6, help="steps timed, then profiled, per variant")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    ap.add_argument("--variants", nargs="*", default=["fc", "simplefsdp", "compute-only"])
    ap.add_argument("--warm-cache", action="store_true", help="reuse Inductor's on-disk caches (default: cold)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    ap.add_argument("--stem", default=None, help="results file name without extension (default profile_step_<model>)")
    ap.add_argument("--trace-dir", default=None, help="also write each variant's profile there as trace_<variant>.json.gz")
    ap.add_argument("--replicate", action="store_true",
                    help="FSDP2's replicate (variants: _replicate_bench's fc ones and compute-only)")
    H.add_optimizer_arg(ap)
    args = ap.parse_args()
    args.variants = H.names_listed(args.variants)
    if "RANK" not in os.environ:
        ap.error("launch with torchrun, e.g.: torchrun --nproc-per-node 2 bench/profile_step.py")
    if args.mp and args.model == "hf-llama":
        ap.error("--mp: fsdp_compile.models' Llama sizes only")
    if args.seq is None:
        args.seq = {"hf-llama": 128, "llama-1b": 2048}.get(args.model, 64)
    torch._inductor.config.cpp.enable_kernel_profile = True  # generated C++ kernels record their names
    torch._inductor.config.profiler_mark_wrapper_call = True
    device, rank, world, say = H.init_ranks(timeout_s=900)
    vocab = CVE.HF_VOCAB if args.model == "hf-llama" else CVE.MODEL_SIZES[args.model].vocab
    CVE.check_variants(args.variants, REPLICATE_VARIANTS if args.replicate else CVE.VARIANTS,
                       "--replicate" if args.replicate else "this run")
    skipped = {}
    if "simplefsdp" in args.variants and (why := CVE.simple_fsdp_missing()):
        skipped["simplefsdp"] = why
        say(f"  skipped simplefsdp: {why}")
    say(f"profile_step: '{args.model}', {world} ranks ({dist.get_backend()}), backend={args.backend}, "
        f"batch {args.batch} x {args.seq}")
    results = {}
    step_no = collections.Counter()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])

    def run(v, n):
        t = []
        for _ in range(n):
            tokens = CVE.batch(step_no[v.name], rank, vocab, device, args.batch, args.seq)
            step_no[v.name] += 1
            t.append(v.step(tokens))
        return t

    for name in args.variants:
        if name in skipped:
            continue
        if args.replicate:
            make, sharded = replicate_variant(name, args.model, args.backend), False
        else:
            make, sharded = CVE.make_variant(name, args.model, args.backend), CVE.SHARD_WITH.get(name, True)
        v = CVE.Variant(name, args.model, device, make, sharded=sharded, mp=args.mp, optimizer=args.optimizer)
        with H.cold_compile(not args.warm_cache), H.compile_timing() as timing:
            first = run(v, 1)[0]
        phases = H.compile_phases(timing, first)
        run(v, 2)  # warm-up
        times = run(v, args.steps)
        with fc_marks(), profile(activities=activities) as prof:
            t0 = time.perf_counter()
            run(v, args.steps)
            if device.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        ms, top = attribute(prof, args.steps, wall)
        waits = waits_in_order(prof, args.steps)
        results[name] = {"first_step_phases_s": phases, "compile_timers_s": timing["timers"], "median_step_s": H.summarize(times)["median_step_s"],
                         "profiled_step_ms": wall * 1e3 / args.steps, "buckets_ms": ms, "top_events": top,
                         "waits_in_order": waits,
                         "final_loss": v.loss}
        if device.type == "cuda":
            results[name]["gpu"] = gpu_attribute(prof, args.steps, wall)
        if args.trace_dir and rank == 0:
            os.makedirs(args.trace_dir, exist_ok=True)
            path = os.path.join(args.trace_dir, f"trace_{name.replace(':', '_').replace('.', '_')}.json")
            prof.export_chrome_trace(path)
            with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
                g.write(f.read())
            os.remove(path)
        say(f"  {name}: first step {first:.1f} s, median step {results[name]['median_step_s'] * 1e3:.1f} ms "
            f"({wall * 1e3 / args.steps:.1f} ms profiled)")
        if hasattr(v.runner, "close"):  # fc:cudagraphs: its graphs and pool go before the next variant
            v.runner.close()
        del v
        torch._dynamo.reset()

    names = list(results)
    say("\n**Steady step** (ms per step under the profiler, share of it in brackets; unprofiled median first):\n")
    say("| bucket | " + " | ".join(names) + " |")
    say("|---|" + "---|" * len(names))
    say("| step, unprofiled median | " + " | ".join(f"{results[n]['median_step_s'] * 1e3:.1f}" for n in names) + " |")
    for b in BUCKETS:
        cells = []
        for n in names:
            r = results[n]
            cells.append(f"{r['buckets_ms'][b]:.1f} ({100 * r['buckets_ms'][b] / r['profiled_step_ms']:.0f}%)")
        say(f"| {b} | " + " | ".join(cells) + " |")
    say("| step, profiled | " + " | ".join(f"{results[n]['profiled_step_ms']:.1f}" for n in names) + " |")
    gpu_names = [n for n in names if "gpu" in results[n]]
    if gpu_names:
        say(f"\n**Steady step on the GPU** (device ms per step, {torch.cuda.get_device_name(device)}; share of the "
            "profiled step in brackets):\n")
        say("| bucket | " + " | ".join(gpu_names) + " |")
        say("|---|" + "---|" * len(gpu_names))
        for b in GPU_BUCKETS:
            cells = []
            for n in gpu_names:
                g = results[n]["gpu"]["buckets_ms"][b]
                cells.append(f"{g:.1f} ({100 * g / results[n]['profiled_step_ms']:.0f}%)")
            say(f"| {b} | " + " | ".join(cells) + " |")
        say("| kernels per step | " + " | ".join(f"{results[n]['gpu']['kernels_per_step']:.0f}" for n in gpu_names) + " |")
        say("| step, profiled | " + " | ".join(f"{results[n]['profiled_step_ms']:.1f}" for n in gpu_names) + " |")
    say("\n**First step** (s; torch's compile timers, inclusive, nested as indented):\n")
    say("| phase | " + " | ".join(names) + " |")
    say("|---|" + "---|" * len(names))
    for p in next(iter(results.values()))["first_step_phases_s"] if results else ():
        say(f"| {p} | " + " | ".join(f"{results[n]['first_step_phases_s'][p]:.2f}" for n in names) + " |")
    for n in names:
        w = results[n]["waits_in_order"]
        if w:
            say(f"\n{n}, collective waits in the order the step meets them (ms per step; 'b': in the backward): " + ", ".join(
                f"{x['ms']:.1f}{'b' if x['backward'] else ''}" for x in w))
    for n in names:
        say(f"\n{n}, largest self times (ms per step): " + "; ".join(
            f"{t['name'][:60]} [{t['bucket']}] {t['ms_per_step']:.1f}" for t in results[n]["top_events"][:8]))
    for n in gpu_names:
        say(f"\n{n}, largest device times (ms per step): " + "; ".join(
            f"{t['name'][:60]} [{t['bucket']}] {t['ms_per_step']:.1f}" for t in results[n]["gpu"]["top_kernels"][:8]))
    if rank == 0:
        path = os.path.join(args.out, f"{args.stem or 'profile_step_' + args.model}.json")
        payload = {"config": vars(args) | {"world_size": world}, "machine": H.machine(), "skipped": skipped, "variants": results}
        if device.type == "cuda":
            payload["gpu"] = H.gpu_info(device)
        H.write_json(path, payload)
        say(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
