"""Calibrate the ``cpu-gloo`` cost-model profile (``fsdp_compile/passes/cost_model.py``) on this machine.

Spawns 2 gloo ranks on 127.0.0.1 (``torch.multiprocessing`` spawn + ``FileStore``), 1 thread each, and
measures, on both ranks at once (as in training):

* ``_c10d_functional.all_gather_into_tensor`` and ``reduce_scatter_tensor`` (+ ``wait_tensor``), the ops
  our graphs run, over message sizes 4 KiB .. 16 MiB; fits ``t = alpha + bytes * (W-1)/W / bus_bw``
  (least squares on relative error) and reports ``step_latency = alpha / (W-1)`` and ``bus_bw``. With 2
  ranks the per-collective base latency and the per-step latency cannot be told apart, so all of alpha
  goes into ``step_latency`` and ``base_latency`` is 0;
* fp32 and bf16 matmul GFLOP/s (``torch.mm``, 512 and 1024 square);
* memory bandwidth as bytes moved (read + write) per second by ``Tensor.copy_`` of 64 MiB;
* per-node overhead: an FX GraphModule of 500 dependent ``aten.add`` (or ``aten.view``) calls on a
  1-element tensor, per node: what ``aot_eager``, which runs the graph node by node, pays per op (view).

Usage: ``python bench/calibrate_cpu_gloo.py [--out bench/results/calibrate_cpu_gloo.json]``. Prints medians
per size and the fitted constants to paste into ``CPU_GLOO``, and writes them with the raw measurements to
the JSON file that the profile cites. Takes ~30 s.

``--all-reduce`` measures ``_c10d_functional.all_reduce`` the same way, on its own: gloo runs it with an
algorithm of its own speed (torch's gloo reduce-scatter is an all-reduce of its whole input plus a copy,
so the shared fit above prices an all-reduce at about twice what it takes). It fits ``t = alpha + x /
bus_bw`` with the ring's ``x = 2 bytes (W-1)/W`` and writes ``calibrate_cpu_gloo_all_reduce.json``, the
source of ``CPU_GLOO.kind_links``. The rest of the profile is left as it is.

``--contention`` measures what a collective takes from compute running beside it (``CPU_GLOO.
comm_cpu_share``): on both ranks, the compute the planner overlaps collectives with, a training step
(forward and backward of ``fsdp_compile.models.Llama`` "small", unsharded, compiled by Inductor: its
matmuls and fused kernels), alone, and the same step right after issuing a collective whose wait follows
the step, alternating, 15 pairs per kind and size (1 .. 16 MiB); the delay is the paired difference, and
the share the least-squares slope of the median delays on the collective's own duration (measured in the
same rounds, nothing beside it). Writes ``calibrate_cpu_gloo_contention.json``; takes about a minute.

``--sync`` measures what a wait costs where both ranks compute between collectives (not in the profile: a
lead of issue 51): on both ranks the same compute (``SYNC_MATMULS`` 256 x 256 matmuls, about 60 ms) cut into
k = 1, 4 or 16 segments, an all-reduce waited at once after each, against the same compute without one;
per size (4 B .. 4 MiB) the marginal cost of a wait, ``(T(16) - T(4)) / 12``, beside the all-reduce's own
time with nothing beside it. Writes ``calibrate_cpu_gloo_sync.json``; takes about a minute.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(__file__))
import _harness as H  # noqa: E402

W = 2
SIZES = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]  # bytes gathered / reduced


CHAIN = 500


def _chain(target, extra_args):
    """An FX GraphModule of ``CHAIN`` dependent calls of ``target``: how ``aot_eager`` runs a graph."""
    import torch.fx as fx

    g = fx.Graph()
    y = g.placeholder("x")
    for _ in range(CHAIN):
        y = g.call_function(target, (y, *extra_args))
    g.output(y)
    return fx.GraphModule(torch.nn.Module(), g)


def _agreed(t: float) -> float:
    """The slower rank's median: a collective ends when both ranks are done."""
    x = torch.tensor([t], dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return float(x)


def _compute_rates() -> dict:
    """Matmul FLOP/s, memory bandwidth and per-node overheads, both ranks busy at once."""
    dist.barrier()
    flops = {}
    for dtype in (torch.float32, torch.bfloat16):
        rates = []
        for n in (512, 1024):
            a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
            rates.append(2 * n**3 / H.adaptive_median_s(lambda: torch.mm(a, b), min_time=0.5))
        flops[str(dtype)] = max(rates)
    src, dst = torch.empty(16 << 20), torch.empty(16 << 20)  # 64 MiB fp32
    src.fill_(1.0)
    mem_bw = 2 * src.nbytes / H.adaptive_median_s(lambda: dst.copy_(src), min_time=0.5)
    one = torch.ones(1)
    adds = _chain(torch.ops.aten.add.Tensor, (1,))
    views = _chain(torch.ops.aten.view.default, ([-1],))
    overhead = H.adaptive_median_s(lambda: adds(one), min_time=0.5) / CHAIN
    view_overhead = H.adaptive_median_s(lambda: views(one), min_time=0.5) / CHAIN
    return {"flops": flops, "mem_bw": mem_bw, "op_overhead": overhead, "view_overhead": view_overhead}


def _worker(rank: int, store_path: str, out_path: str, kinds: tuple[str, ...] = ("all_gather", "reduce_scatter"),
            compute: bool = True) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, W), rank=rank, world_size=W)
    c10d = torch.ops._c10d_functional
    group_name = dist.group.WORLD.group_name
    res: dict = {"collectives": {}}
    try:
        for kind in kinds:
            rows = []
            for nbytes in SIZES:
                numel = nbytes // 4
                if kind == "all_gather":
                    x = torch.randn(numel // W)

                    def fn(x=x):
                        c10d.wait_tensor(c10d.all_gather_into_tensor(x, W, group_name))
                elif kind == "reduce_scatter":
                    x = torch.randn(numel)

                    def fn(x=x):
                        c10d.wait_tensor(c10d.reduce_scatter_tensor(x, "sum", W, group_name))
                else:
                    x = torch.randn(numel)

                    def fn(x=x):
                        c10d.wait_tensor(c10d.all_reduce(x, "sum", group_name))

                # the same number of repetitions on both ranks, or the collectives would not match
                reps = 200 if nbytes <= (256 << 10) else 40 if nbytes <= (4 << 20) else 10
                fn()
                times = []
                for _ in range(reps):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                rows.append((nbytes, _agreed(statistics.median(times))))
            res["collectives"][kind] = rows
        if compute:
            res.update(_compute_rates())
        if rank == 0:  # rank 0's numbers; both ranks ran at once
            with open(out_path, "w") as f:
                json.dump(res, f)
    finally:
        dist.destroy_process_group()


def _contention_worker(rank: int, store_path: str, out_path: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, W), rank=rank, world_size=W)
    c10d = torch.ops._c10d_functional
    group_name = dist.group.WORLD.group_name
    from fsdp_compile.models import SIZES, Llama

    torch.manual_seed(0)
    model = torch.compile(Llama(SIZES["small"]))
    tokens = torch.randint(0, SIZES["small"].vocab, (4, 64))

    def compute():
        model(tokens).float().sum().backward()

    for _ in range(3):  # the compile, then warm
        compute()

    rows = []
    try:
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            for nbytes in (1 << 20, 4 << 20, 16 << 20):
                x = torch.randn(nbytes // 4 // W if kind == "all_gather" else nbytes // 4)

                def issue(x=x, kind=kind):
                    if kind == "all_gather":
                        return c10d.all_gather_into_tensor(x, W, group_name)
                    if kind == "reduce_scatter":
                        return c10d.reduce_scatter_tensor(x, "sum", W, group_name)
                    return c10d.all_reduce(x.clone(), "sum", group_name)

                c10d.wait_tensor(issue())
                alone, coll, delay = [], [], []
                for _ in range(15):
                    dist.barrier()
                    t0 = time.perf_counter()
                    compute()
                    alone.append(time.perf_counter() - t0)
                    dist.barrier()
                    t0 = time.perf_counter()
                    c10d.wait_tensor(issue())
                    coll.append(time.perf_counter() - t0)
                    dist.barrier()
                    t0 = time.perf_counter()
                    work = issue()
                    compute()
                    delay.append(time.perf_counter() - t0 - alone[-1])
                    c10d.wait_tensor(work)
                rows.append({"kind": kind, "bytes": nbytes, "compute_s": _agreed(statistics.median(alone)),
                             "collective_s": _agreed(statistics.median(coll)), "delay_s": _agreed(statistics.median(delay))})
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


SYNC_MATMULS = 256


def _sync_worker(rank: int, store_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, W), rank=rank, world_size=W)
    c10d = torch.ops._c10d_functional
    group_name = dist.group.WORLD.group_name
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def step(x, k: int) -> None:  # the same matmuls, a wait after each of k segments (k = 0: no collective)
        for _ in range(max(k, 1)):
            for _ in range(SYNC_MATMULS // max(k, 1)):
                torch.mm(a, b)
            if k:
                c10d.wait_tensor(c10d.all_reduce_(x, "sum", group_name))

    def timed(fn) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    rows = []
    try:
        for nbytes in (4, 256 << 10, 1 << 20, 4 << 20):
            x = torch.zeros(nbytes // 4)
            for k in (0, 1, 4, 16):
                step(x, k)  # warm
            times = {k: [] for k in (0, 1, 4, 16)}
            for _ in range(9):  # rounds, each k once, alternating
                for k in times:
                    times[k].append(timed(lambda: step(x, k)))
            alone = [timed(lambda: c10d.wait_tensor(c10d.all_reduce_(x, "sum", group_name))) for _ in range(30)]
            t = {k: _agreed(statistics.median(v)) for k, v in times.items()}
            rows.append({"bytes": nbytes, "step_s": {str(k): v for k, v in t.items()}, "alone_s": _agreed(statistics.median(alone)),
                         "per_wait_s": (t[16] - t[4]) / 12})
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def sync_main(out_path: str) -> None:
    rows = _spawned(_sync_worker)
    print(f"cpu-gloo waits beside compute, {datetime.date.today()}, {W} gloo ranks on 127.0.0.1, 1 thread per rank")
    for r in rows:
        steps = ", ".join(f"k={k}: {v * 1e3:.1f}" for k, v in r["step_s"].items())
        print(f"  {r['bytes'] >> 10:>6} KiB all-reduce: step ms {steps}; a wait costs {r['per_wait_s'] * 1e3:.2f} ms, "
              f"the all-reduce alone {r['alone_s'] * 1e3:.2f} ms")
    H.write_json(out_path, {"machine": H.machine(), "matmuls": SYNC_MATMULS, "rows": rows})
    print(f"wrote {out_path}")


def _spawned(worker, *args):
    """Run ``worker(rank, store_path, out_path, *args)`` on ``W`` spawned ranks; what rank 0 wrote to ``out_path``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(worker, args=(os.path.join(tmp, "store"), out, *args), nprocs=W, join=True)
        with open(out) as f:
            return json.load(f)


def contention_main(out_path: str) -> None:
    rows = _spawned(_contention_worker)
    print(f"cpu-gloo contention, {datetime.date.today()}, {W} gloo ranks on 127.0.0.1, 1 thread per rank")
    for r in rows:
        print(f"  {r['kind']:>15} {r['bytes'] >> 10:>6} KiB: collective {r['collective_s'] * 1e3:6.2f} ms, compute beside it "
              f"+{r['delay_s'] * 1e3:6.2f} ms of {r['compute_s'] * 1e3:.1f} ({r['delay_s'] / r['collective_s']:.2f})")
    share = sum(r["delay_s"] * r["collective_s"] for r in rows) / sum(r["collective_s"] ** 2 for r in rows)
    print(f"  fit: comm_cpu_share = {share:.3f}")
    H.write_json(out_path, {"machine": H.machine(), "rows": rows, "fit": {"comm_cpu_share": share}})
    print(f"wrote {out_path}")


def fit(rows: list[tuple[int, float]], world_size: int = W, passes: int = 1) -> tuple[float, float]:
    """Least squares of ``t = alpha + x / bw`` with ``x = passes * bytes * (W-1)/W`` (an all-reduce's ring: 2
    passes), on relative error."""
    # minimize sum(((alpha + beta x) - t)^2 / t^2): weighted normal equations
    s = [(1 / t**2, passes * nbytes * (world_size - 1) / world_size, t) for nbytes, t in rows]
    a11 = sum(w for w, x, t in s)
    a12 = sum(w * x for w, x, t in s)
    a22 = sum(w * x * x for w, x, t in s)
    b1 = sum(w * t for w, x, t in s)
    b2 = sum(w * x * t for w, x, t in s)
    det = a11 * a22 - a12 * a12
    alpha = (b1 * a22 - b2 * a12) / det
    beta = (a11 * b2 - a12 * b1) / det
    return max(alpha, 0.0), 1.0 / beta


def all_reduce_main(out_path: str) -> None:
    rows = _spawned(_worker, ("all_reduce",), False)["collectives"]["all_reduce"]
    print(f"cpu-gloo all-reduce, {datetime.date.today()}, {W} gloo ranks on 127.0.0.1, 1 thread per rank")
    for nbytes, t in rows:
        print(f"    {nbytes / 1024:>8.0f} KiB  {t * 1e6:>10.1f} us  ({2 * nbytes * (W - 1) / W / t / 1e9:.2f} GB/s bus)")
    alpha, bw = fit(rows, passes=2)
    link = {"bus_bw": bw, "step_latency": alpha / (2 * (W - 1)), "base_latency": 0.0}
    print(f"  fit: step_latency = {link['step_latency'] * 1e6:.1f} us, bus_bw = {bw / 1e9:.2f} GB/s")
    print(f"CPU_GLOO.kind_links: ((\"all_reduce\", LinkProfile(bus_bw={bw / 1e9:.3f} * GB, "
          f"step_latency={link['step_latency'] * 1e6:.1f} * US, base_latency=0.0)),)")
    H.write_json(out_path, {"machine": H.machine(), "collectives": {"all_reduce": rows}, "fit": {"all_reduce": link}})
    print(f"wrote {out_path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=None,
        help="where to write the measurements, the fit and the constants (default: the file CPU_GLOO cites, "
             "results/calibrate_cpu_gloo[_all_reduce|_contention|_sync].json by the mode)",
    )
    parser.add_argument("--all-reduce", action="store_true",
                        help="measure gloo's all-reduce alone (default --out: results/calibrate_cpu_gloo_all_reduce.json)")
    parser.add_argument("--contention", action="store_true",
                        help="measure what collectives take from compute beside them (default --out: "
                             "results/calibrate_cpu_gloo_contention.json)")
    parser.add_argument("--sync", action="store_true",
                        help="measure what a wait costs between compute segments (default --out: results/calibrate_cpu_gloo_sync.json)")
    args = parser.parse_args()
    mode = "_contention" if args.contention else "_all_reduce" if args.all_reduce else "_sync" if args.sync else ""
    out_path = args.out or os.path.join(os.path.dirname(__file__), "results", f"calibrate_cpu_gloo{mode}.json")
    if args.contention:
        contention_main(out_path)
        return
    if args.sync:
        sync_main(out_path)
        return
    if args.all_reduce:
        all_reduce_main(out_path)
        return
    res = _spawned(_worker)
    print(f"cpu-gloo calibration, {datetime.date.today()}, {W} gloo ranks on 127.0.0.1, 1 thread per rank")
    fits = {}
    for kind, rows in res["collectives"].items():
        print(f"  {kind}:")
        for nbytes, t in rows:
            print(f"    {nbytes / 1024:>8.0f} KiB  {t * 1e6:>10.1f} us  ({nbytes * (W - 1) / W / t / 1e9:.2f} GB/s bus)")
        alpha, bw = fit(rows)
        fits[kind] = {"step_latency": alpha / (W - 1), "bus_bw": bw}
        print(f"    fit: step_latency = {alpha / (W - 1) * 1e6:.1f} us, bus_bw = {bw / 1e9:.2f} GB/s")
    step = statistics.mean(f["step_latency"] for f in fits.values())
    bw = statistics.mean(f["bus_bw"] for f in fits.values())
    print(f"  matmul fp32: {res['flops']['torch.float32'] / 1e9:.1f} GFLOP/s, bf16: {res['flops']['torch.bfloat16'] / 1e9:.1f} GFLOP/s")
    print(f"  memory: {res['mem_bw'] / 1e9:.2f} GB/s moved (read + write)")
    print(f"  per-node overhead in an FX graph: {res['op_overhead'] * 1e6:.2f} us per op, {res['view_overhead'] * 1e6:.2f} us per view")
    constants = {
        "matmul_flops_fp32": res["flops"]["torch.float32"], "matmul_flops_lowp": res["flops"]["torch.bfloat16"],
        "mem_bw": res["mem_bw"], "op_overhead": res["op_overhead"], "view_overhead": res["view_overhead"],
        "bus_bw": bw, "step_latency": step, "base_latency": 0.0,
    }
    print("CPU_GLOO constants:")
    print(f"  matmul_flops_fp32={res['flops']['torch.float32'] / 1e9:.1f} * 1e9,")
    print(f"  matmul_flops_lowp={res['flops']['torch.bfloat16'] / 1e9:.1f} * 1e9,")
    print(f"  mem_bw={res['mem_bw'] / 1e9:.2f} * GB,")
    print(f"  op_overhead={res['op_overhead'] * 1e6:.2f} * US,")
    print(f"  view_overhead={res['view_overhead'] * 1e6:.2f} * US,")
    print(f"  intra=LinkProfile(bus_bw={bw / 1e9:.3f} * GB, step_latency={step * 1e6:.1f} * US, base_latency=0.0),")
    H.write_json(out_path, {"machine": H.machine(), **res, "fit": fits, "constants": constants})
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
