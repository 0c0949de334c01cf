"""Planning time: the schedule every rank plans at its first compiled step, for Llama-3 shapes sharded on
the fake process group (meta device: no compute, no memory), per bucket policy, with the planner's search
as it is (``search.Search``: each candidate simulated only where it differs from the current schedule)
beside the same search judging every candidate by a prediction of the whole step (as it was before
2026-11-27), in one run; the two must plan the same schedule, bit for bit (the digests are compared).

    python bench/planning.py                       # 8B at W=8, 70B at W=64; every policy
    python bench/planning.py --whole-max-units 800 # also time the whole-step search where it takes minutes

``bucket="none"`` gathers each parameter apart (291 units on 8B, 723 on 70B), the case the search's cost
grows with. The whole-step search is skipped above ``--whole-max-units`` units (70B with "none" took about
280 s with it). One process, one thread; best of ``--repeats``. Writes bench/results/planning.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

sys.path.insert(0, os.path.dirname(__file__))
import _harness as H  # noqa: E402

from fsdp_compile.models import SIZES, Llama, llama_blocks  # noqa: E402
from fsdp_compile.passes import CostModel, modules_of, planner  # noqa: E402
from fsdp_compile.passes import predict as P  # noqa: E402
from fsdp_compile.passes import search as S  # noqa: E402
from fsdp_compile.plan import read_plan  # noqa: E402


class WholeSearch(S.Search):
    """The search judging every candidate by ``predict`` on the whole schedule."""

    def __init__(self, units, modules, cost_model, workload, memo=None):
        super().__init__(units, modules, cost_model, workload, memo)
        self.args = (modules, cost_model, workload, memo)

    def trial(self, i, unit):
        units = list(self.units)
        units[i] = unit
        self._pending = (units, [])
        modules, cost_model, workload, memo = self.args
        return P.predict(units, modules, cost_model, workload, memo=memo)


def modules(size: str, world: int):
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with torch.device("meta"):
            model = Llama(SIZES[size])
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in llama_blocks(model):
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return modules_of(read_plan(model))
    finally:
        dist.destroy_process_group()


def plan(mods, policy: str, hardware: str, search, repeats: int) -> tuple[float, str, int]:
    planner.Search = search
    try:
        best, digest = float("inf"), None
        for _ in range(repeats):
            t = time.perf_counter()
            s = planner.plan_schedule(mods, policy=policy, reorder=True, cost_model=CostModel(hardware), workload=2048)
            best = min(best, time.perf_counter() - t)
            digest = s.digest()
        return best, digest, len(s.units)
    finally:
        planner.Search = S.Search


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["llama3-8b:8", "llama3-70b:64"], help="size:world_size")
    ap.add_argument("--policies", nargs="+", default=["auto", "fsdp_group", "none"])
    ap.add_argument("--hardware", default="h100-nvlink")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--whole-max-units", type=int, default=300)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "planning.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    print(f"{'model':<11} {'W':>5} {'policy':<10} {'units':>5} {'search s':>9} {'whole-step s':>12} {'ratio':>7}  same plan")
    for config in args.configs:
        size, world = config.split(":")
        mods = modules(size, int(world))
        for policy in args.policies:
            s, digest, units = plan(mods, policy, args.hardware, S.Search, args.repeats)
            row = {"model": size, "world_size": int(world), "policy": policy, "units": units, "search_s": s,
                   "whole_s": None, "same_plan": None}
            if units <= args.whole_max_units:
                w, whole_digest, _ = plan(mods, policy, args.hardware, WholeSearch, 1 if units > 100 else args.repeats)
                row.update(whole_s=w, same_plan=whole_digest == digest)
            rows.append(row)
            whole = f"{row['whole_s']:12.3f} {row['whole_s'] / s:6.1f}x  {row['same_plan']}" if row["whole_s"] else f"{'-':>12} {'-':>7}  -"
            print(f"{size:<11} {world:>5} {policy:<10} {units:>5} {s:9.3f} {whole}", flush=True)
    assert all(r["same_plan"] is not False for r in rows), "the two searches planned different schedules"
    H.write_json(args.out, {"machine": H.machine(), "hardware": args.hardware, "workload": 2048, "rows": rows})
    print("wrote", args.out)


if __name__ == "__main__":
    main()
