"""The communication schedule: plain data over FSDP modules, planned from rank-invariant inputs only.

Hand-checked program (``passes_helpers.PROFILE``: 1 TFLOP/s, free launches, a 0.5 GB/s link with 1 ms per
ring step; two modules M0, M1 of one 1 MB parameter each, 2 GFLOP forward and 4 GFLOP backward each, at
world size 2, so every all-gather and reduce-scatter takes 1 ms + 1 MB / 2 / 0.5 GB/s = 2 ms)::

    forward, just in time:  AG0 (2, exposed) M0 (2) AG1 (2, exposed) M1 (2)            8 ms, 4 exposed
    forward, planned:       AG0 AG1 | wait AG0 (2) M0 (2, hides AG1) M1 (2)            6 ms, 2 exposed
    backward, just in time: AG1 (2) M1 (4) RS1 (2) AG0 (2) M0 (4) RS0 (2)              16 ms, 8 exposed
    backward, planned:      AG1 AG0 | wait AG1 (2) M1 (4, hides AG0) RS1 M0 (4, hides RS1) RS0 (2)   12 ms, 4 exposed
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dist_helpers import fake_process_group
from fsdp_compile.passes.cost_model import CostModel
from fsdp_compile.passes.planner import eager_fsdp2, plan_schedule
from fsdp_compile.passes.predict import predict
from fsdp_compile.passes.schedule import Module, backward_order, modules_of
from fsdp_compile.plan import BucketKey, read_plan
from models import Llama, LlamaArgs, OddMLP, shard
from passes_helpers import PROFILE

MB = 1_000_000
MS = 1e-3
KEY = BucketKey("pg", 2, True, torch.float32, None, torch.float32, "avg", None, None, None, "avg", None)


def module(fqn: str, **kw) -> Module:
    fields = dict(
        fqn=fqn, key=KEY, params=(f"{fqn}.w",), param_bytes=(MB,), reduce_bytes=(MB,), flops_per_token=(2_000_000,),
        process_group="pg", world_size=2, reshard_after_forward=True, holds_children=False, lowp=False,
    )
    return Module(**{**fields, **kw})


def steps(pred: dict) -> tuple[float, ...]:
    f, b = pred["forward"], pred["backward"]
    return (f["step_s"], f["exposed_s"], b["step_s"], b["exposed_s"])


def test_hand_checked_program():
    mods = [module("m0"), module("m1")]
    cm = CostModel(PROFILE)
    s = plan_schedule(mods, policy="fsdp_group", reorder=True, cost_model=cm, workload=1000)
    assert steps(s.predicted["as_placed"]) == pytest.approx((8 * MS, 4 * MS, 16 * MS, 8 * MS))
    assert steps(s.predicted["planned"]) == pytest.approx((6 * MS, 2 * MS, 12 * MS, 4 * MS))
    # M1's all-gather at M0's first use; M0's re-gather at M1's backward start; RS1 waited before RS0
    assert [(u.issue_at, u.backward_issue_at, u.sink) for u in s.units] == [(0, 1, 0), (0, 1, 1)]
    # memory: eager FSDP2 holds two gathered modules in backward (its default prefetch), so may we
    assert s.comm_budget_bytes == 2 * MB == max(p["comm_peak_bytes"] for p in s.predicted["planned"].values())
    # without reordering nothing moves
    jit = plan_schedule(mods, policy="fsdp_group", reorder=False, cost_model=cm, workload=1000)
    assert [(u.issue_at, u.backward_issue_at, u.sink) for u in jit.units] == [(0, 0, 0), (1, 1, 0)]
    assert steps(jit.predicted["planned"]) == steps(s.predicted["as_placed"])


def test_memory_budget():
    mods = [module("m0"), module("m1")]
    cm = CostModel(PROFILE)
    tight = plan_schedule(mods, policy="fsdp_group", reorder=True, cost_model=cm, workload=1000, memory_budget_bytes=MB)
    # only 1 MB may be gathered at once: no prefetch, and every reduce-scatter waited before the next gather
    assert [(u.issue_at, u.backward_issue_at) for u in tight.units] == [(0, 0), (1, 1)]
    assert max(p["comm_peak_bytes"] for p in tight.predicted["planned"].values()) <= MB
    with pytest.raises(ValueError, match=r"memory_budget_gb=.* below the 0\.95 MiB .* raise it, or leave it None"):
        plan_schedule(mods, policy="fsdp_group", reorder=True, cost_model=cm, workload=1000, memory_budget_bytes=MB // 2)


def test_backend_scratch_counts_against_the_budget():
    """A backend that copies a reduce-scatter's input (gloo: ``HardwareProfile.collective_scratch``) holds that
    copy from the issue to the wait, so a pending reduce-scatter holds twice its bytes. With a 2 MB budget::

        no scratch:  AG1 AG0 | M1 (4, hides AG0) RS1 M0 (4, hides RS1) RS0     12 ms; 2 MB: AG0 + RS1 during M0
        scratch:     AG1 M1 (4) RS1 (2) AG0 (2) M0 (4) RS0 (2)                 16 ms; 2 MB: RS1 + its copy

    With scratch, prefetching AG0 (AG0 + RS1 + copy at RS1's issue) or sinking RS1 (the same during M0) holds
    3 MB; the forward's prefetch (no reduce-scatter) stays. Eager FSDP2 on a CPU profile waits each
    collective as it issues it (no streams), so its copies are freed at once: 16 ms, 3 MB at RS1's issue
    (AG0 prefetched)."""
    mods = [module("m0"), module("m1")]
    gloo_like = CostModel(dataclasses.replace(PROFILE, collective_scratch=(("reduce_scatter", 1.0),)))
    plain = plan_schedule(mods, policy="fsdp_group", reorder=True, cost_model=CostModel(PROFILE), workload=1000, memory_budget_bytes=2 * MB)
    assert [(u.issue_at, u.backward_issue_at, u.sink) for u in plain.units] == [(0, 1, 0), (0, 1, 1)]
    s = plan_schedule(mods, policy="fsdp_group", reorder=True, cost_model=gloo_like, workload=1000, memory_budget_bytes=2 * MB)
    assert [(u.issue_at, u.backward_issue_at, u.sink) for u in s.units] == [(0, 0, 0), (0, 1, 0)]
    assert steps(s.predicted["planned"]) == pytest.approx((6 * MS, 2 * MS, 16 * MS, 8 * MS))
    assert [s.predicted["planned"][k]["comm_peak_bytes"] for k in ("forward", "backward")] == [2 * MB, 2 * MB]
    eager = s.predicted["eager_fsdp2"]["backward"]
    assert (eager["step_s"], eager["comm_peak_bytes"]) == (pytest.approx(16 * MS), 3 * MB)
    # a pending reduce-scatter (the default plan's sink) holds its copy: 3 MB where the plain profile says 2
    sunk = predict(plain.units, mods, gloo_like, 1000)
    assert [sunk[k]["comm_peak_bytes"] for k in ("forward", "backward")] == [2 * MB, 3 * MB]


def test_fsdp2_prefetch_settings_are_honored():
    """FSDP2's set_modules_to_forward_prefetch / set_modules_to_backward_prefetch: module A gathers its
    targets when A starts, with or without our own reordering."""
    mods = [module("m0", forward_prefetch=("m2",)), module("m1"), module("m2", backward_prefetch=("m0",)), module("m3")]
    for reorder in (False, True):
        s = plan_schedule(mods, policy="fsdp_group", reorder=reorder, cost_model=CostModel(PROFILE), workload=1000)
        assert s.units[2].issue_at == 0
        assert s.units[0].backward_issue_at == 2
    s = plan_schedule(mods, policy="fsdp_group", reorder=False, cost_model=CostModel(PROFILE), workload=1000)
    assert [u.issue_at for u in s.units] == [0, 1, 0, 3]  # nothing else moves without reordering


def _llama_modules(world_size: int, rank: int = 0, n_layers: int = 4, args: LlamaArgs | None = None, **kw):
    with fake_process_group(world_size, rank=rank):
        torch.manual_seed(0)
        m = Llama(args or LlamaArgs(n_layers=n_layers))
        shard(m, m.layers, **kw)
        return modules_of(read_plan(m))


def test_policies():
    mods = _llama_modules(8)
    cm = CostModel("h100-nvlink")

    def members(policy):
        return [u.members for u in plan_schedule(mods, policy=policy, reorder=True, cost_model=cm, workload=64).units]

    assert members("fsdp_group") == [("",), ("layers.0",), ("layers.1",), ("layers.2",), ("layers.3",)]
    per_param = plan_schedule(mods, policy="none", reorder=True, cost_model=cm, workload=64).units
    assert len(per_param) == 3 + 4 * 9 and all(len(u.params) == 1 for u in per_param)
    # the root's embedding where it starts, its head (final norm, output) where it runs: after the blocks
    assert [u.params for u in per_param if u.members == ("",)] == [("tok_embeddings.weight",), ("norm.weight",), ("output.weight",)]
    assert [per_param.index(u) for u in per_param if u.members == ("",)] == [0, 37, 38]
    assert [per_param[i].params for i in backward_order(per_param)[:2]] == [("norm.weight",), ("output.weight",)]
    assert members([["layers.0", "layers.1"], ["layers.3"]]) == [("",), ("layers.0", "layers.1"), ("layers.2",), ("layers.3",)]
    # the root keeps fully_shard's default of not resharding, the blocks reshard: one all-gather cannot do both
    with pytest.raises(ValueError, match=r"bucket \['', 'layers.0'\] mixes .* differ in reshard_after_forward \(False vs True\); split it"):
        members([["", "layers.0"]])
    with pytest.raises(ValueError, match="names 'layers.9', which is not an FSDP module"):
        members([["layers.9"]])
    with pytest.raises(ValueError, match="names 'layers.1' twice"):
        members([["layers.1"], ["layers.1", "layers.2"]])
    # a bucket is one all-gather where its first module runs: modules between its members are named
    with pytest.raises(ValueError, match=r"bucket \['layers.0', 'layers.2'\] joins FSDP modules that are not adjacent "
                       r"in forward order: \['layers.1'\] run between 'layers.0' and 'layers.2'.*add \['layers.1'\] to it"):
        members([["layers.0", "layers.2"], ["layers.1"]])
    with pytest.raises(ValueError, match=r"\['layers.1', 'layers.2'\] run between 'layers.0' and 'layers.3'"):
        members([["layers.3", "layers.0"]])
    # not adjacent and differing in reshard_after_forward: the order is what to fix first
    with pytest.raises(ValueError, match=r"not adjacent in forward order: \['layers.0'\] run between '' and 'layers.1'"):
        members([["", "layers.1"]])
    assert members([["layers.1", "layers.0"]])[1] == ("layers.0", "layers.1")  # adjacent, in any order
    bf16 = [dataclasses.replace(m, key=m.key._replace(param_dtype=torch.bfloat16)) if m.fqn == "layers.1" else m for m in mods]
    with pytest.raises(ValueError, match=r"differ in param_dtype \(None vs torch.bfloat16\)"):
        plan_schedule(bf16, policy=[["layers.0", "layers.1"]], reorder=True, cost_model=cm, workload=64)


def test_auto_gathers_the_root_in_two_parts():
    """The root R holds an embedding E (used first; no FLOPs) and a head H (used last), 1 MB each, and one
    block M; the hand-checked program's costs (module docstring), the root kept unsharded (FSDP2's default).
    Gathered whole, R's reduce-scatter (2 MB: 3 ms) waits for E's gradient, the step's last compute::

        backward, R whole:  H (4, hides AG M) M (4) RS M (2) RS R (3)               13 ms
        backward, R split:  H (4, hides AG M) M (4, hides RS H) RS M (2) RS E (2)   12 ms
        forward, R whole:   AG R (3) AG M (2) M (2) H (2)                           9 ms
        forward, R split:   AG E (2) AG M (2) M (2, hides AG H) H (2)               8 ms

    Without reordering nothing hides the extra reduce-scatter, so the root stays whole; over 1024 ranks
    across nodes, where a collective is mostly latency, too."""
    root = module("", params=("E", "H"), param_bytes=(MB, MB), reduce_bytes=(MB, MB), flops_per_token=(0, 2_000_000),
                  holds_children=True, leading=("E",), reshard_after_forward=False, key=KEY._replace(reshard_after_forward=False))
    mods, cm = [root, module("m")], CostModel(PROFILE)
    split = plan_schedule(mods, policy="auto", reorder=True, cost_model=cm, workload=1000)
    assert [(u.members, u.params, u.tail) for u in split.units] == [(("",), ("E",), False), (("m",), None, False), (("",), ("H",), True)]
    assert split.backward_order() == [2, 1, 0]
    assert steps(split.predicted["planned"]) == pytest.approx((8 * MS, 4 * MS, 12 * MS, 4 * MS))
    whole = plan_schedule(mods, policy="fsdp_group", reorder=True, cost_model=cm, workload=1000)
    assert steps(whole.predicted["planned"]) == pytest.approx((9 * MS, 5 * MS, 13 * MS, 5 * MS))
    assert [u.params for u in plan_schedule(mods, policy="auto", reorder=False, cost_model=cm, workload=1000).units] == [None, None]
    # FSDP2's prefetch lists name whole modules: a root in one is gathered whole
    listed = [dataclasses.replace(root, forward_prefetch=("m",)), module("m")]
    assert [u.params for u in plan_schedule(listed, policy="auto", reorder=True, cost_model=cm, workload=1000).units] == [None, None]
    # the Llama, from its sharding plan: the embedding is the root's leading parameter
    llama = plan_schedule(_llama_modules(8), policy="auto", reorder=True, cost_model=CostModel("h100-nvlink"), workload=64)
    assert [(u.params, u.tail) for u in llama.units if u.members == ("",)] == [
        (("tok_embeddings.weight",), False), (("norm.weight", "output.weight"), True)]
    wide = plan_schedule(_llama_modules(1024), policy="auto", reorder=True, cost_model=CostModel("h100-ib"), workload=64)
    assert all(u.params is None for u in wide.units)


def test_split_judged_as_the_search_plans_it():
    """bench/compiled_vs_eager.py's `small` Llama on cpu-gloo, 2 ranks, its 4 x 63 tokens: everything one ahead
    is over eager FSDP2's memory budget whole and split alike, so judged on just-in-time schedules the split
    only added a collective (123.7 against 122.7 ms) and the root stayed whole; as the search plans each
    side, the split is faster (94.0 against 96.0 ms): the head gathered after the blocks (prefetched at the
    last one), its reduce-scatter right after its backward. The schedule keeps the unsplit prediction for
    explain's gain; the block merges, judged on the fixed schedules, are kept only where the searched step
    agrees, so auto is never predicted slower than its unmerged split.

    Judged with communication hidden behind compute as free (cpu-gloo's ``comm_cpu_share`` at 0, as the profile
    was before 2026-11-30). With the calibrated share, a collective costs compute 0.69 of the time it runs beside
    it, and the split's extra collective no longer pays: the root stays whole."""
    from fsdp_compile.models import SIZES
    from fsdp_compile.passes import planner
    from parity import FREE_OVERLAP

    mods, cm = _llama_modules(2, args=SIZES["small"]), CostModel(FREE_OVERLAP)
    calibrated = plan_schedule(mods, policy="auto", reorder=True, cost_model=CostModel("cpu-gloo"), workload=252)
    assert [u.params for u in calibrated.units] == [None] * 5 and "unsplit" not in calibrated.predicted
    assert sum(steps(calibrated.predicted["planned"])[0::2]) < sum(steps(calibrated.predicted["eager_fsdp2"])[0::2])
    s = plan_schedule(mods, policy="auto", reorder=True, cost_model=cm, workload=252)
    root = [(i, u.params, u.tail) for i, u in enumerate(s.units) if u.members == ("",)]
    assert root == [(0, ("tok_embeddings.weight",), False), (len(s.units) - 1, ("norm.weight", "output.weight"), True)]
    assert s.units[-1].issue_at == len(s.units) - 2  # the head's all-gather after the blocks begin, not at the start
    split, unsplit = sum(steps(s.predicted["planned"])[0::2]), sum(steps(s.predicted["unsplit"])[0::2])
    assert split == pytest.approx(94.02 * MS, abs=0.01 * MS) and unsplit == pytest.approx(95.96 * MS, abs=0.01 * MS)
    # the old judgement: the faster of just in time and one ahead within the budget
    budget = s.comm_budget_bytes
    memo: dict = {}
    ev = lambda u: predict(tuple(u), mods, cm, 252, memo=memo)  # noqa: E731
    simple = [planner._best_simple(planner._just_in_time(planner._module_units(mods, split=x)), ev, budget, True)
              for x in (frozenset(), frozenset({""}))]
    assert [step_ms(p) for p in simple] == pytest.approx([122.66, 123.67], abs=0.01)
    whole = plan_schedule(mods, policy="fsdp_group", reorder=True, cost_model=cm, workload=252)
    assert "unsplit" not in whole.predicted and split < sum(steps(whole.predicted["planned"])[0::2])
    # rank-invariant: planned from the plan alone, so every rank's plan is this one
    assert plan_schedule(_llama_modules(2, rank=1, args=SIZES["small"]), policy="auto", reorder=True, cost_model=cm,
                         workload=252).digest() == s.digest()


def step_ms(pred: dict) -> float:
    return (pred["forward"]["step_s"] + pred["backward"]["step_s"]) * 1e3


def test_auto_merges_small_modules_when_latency_dominates():
    """Tiny modules over 1024 ranks across nodes: each collective is mostly ring latency, so buckets pay;
    a cap keeps every bucket under it."""
    mods = _llama_modules(1024)
    cm = CostModel("h100-ib")
    s = plan_schedule(mods, policy="auto", reorder=True, cost_model=cm, workload=64)
    assert len(s.units) < len(mods) and sum(len(u.members) for u in s.units) == len(mods)
    assert sum(steps(s.predicted["planned"])[0::2]) < sum(steps(plan_schedule(
        mods, policy="fsdp_group", reorder=True, cost_model=cm, workload=64).predicted["planned"])[0::2])
    cap = max(m.param_bytes[0] for m in mods) * 2
    capped = plan_schedule(mods, policy="auto", reorder=True, cost_model=cm, workload=64, bucket_cap_bytes=cap)
    assert all(u.all_gather_bytes <= cap for u in capped.units if len(u.members) > 1)


@pytest.mark.parametrize("world_size, ranks", [(4, (0, 3)), (1024, (0, 1023))])
def test_same_plan_on_every_rank(world_size, ranks):
    """Uneven shards (ranks past the last row hold nothing) change every rank's local shapes, not the plan."""
    plans = []
    for rank in ranks:
        with fake_process_group(world_size, rank=rank):
            torch.manual_seed(0)
            odd = OddMLP()
            plans.append(plan_schedule(
                modules_of(read_plan(shard(odd, odd.blocks))), policy="auto", reorder=True,
                cost_model=CostModel("h100-ib"), workload=4,
            ))
    assert plans[0].digest() == plans[1].digest()
    assert _llama_modules(world_size, ranks[0]) == _llama_modules(world_size, ranks[1])


def test_memoized_unit_costs_predict_the_same():
    """The planner keeps each unit's costs across the candidates it judges: every prediction equals the
    one made afresh, to the last bit, for schedules that share units and ones that split the root."""
    mods = _llama_modules(8)
    cm = CostModel("h100-nvlink")
    memo: dict = {}
    candidates = [
        plan_schedule(mods, policy=policy, reorder=reorder, cost_model=cm, workload=64).units
        for policy in ("auto", "fsdp_group", "none") for reorder in (True, False)
    ] + [eager_fsdp2(mods)]
    assert any(u.params is not None and u.tail for units in candidates for u in units)  # the root in parts
    for units in candidates * 2:  # the second round is served from the memo
        assert predict(units, mods, cm, 64, memo=memo) == predict(units, mods, cm, 64)
    assert memo


def _programs(seed: int):
    """Varied unit programs: Llama modules resharded or kept, per module / per parameter / the root split,
    on a GPU profile and on gloo's (scratch), each schedule's issue points and sinks drawn at random."""
    import random

    from fsdp_compile.passes import unit_costs

    rng = random.Random(seed)
    for reshard, policy, hw in [(True, "fsdp_group", "h100-nvlink"), (False, "none", "cpu-gloo"), (True, "auto", "cpu-gloo"),
                                (True, "none", "h100-ib")]:
        mods = _llama_modules(8, reshard_after_forward=reshard, n_layers=2)
        cm = CostModel(hw)
        base = plan_schedule(mods, policy=policy, reorder=False, cost_model=cm, workload=64).units
        for _ in range(6):
            order = backward_order(base)
            units = [dataclasses.replace(u, issue_at=rng.randint(max(0, i - 3), i),
                                         backward_issue_at=order[rng.randint(max(0, order.index(i) - 3), order.index(i))],
                                         sink=rng.randint(0, 2)) for i, u in enumerate(base)]
            yield units, mods, cm, unit_costs.unit_costs(units, {m.fqn: m for m in mods}, cm, 64)


def test_prediction_runs_the_event_simulators_rules():
    """``predict``'s machine applies ``_program.run``'s and ``timeline``'s rules as the program is written:
    its result equals theirs on the ops it recorded, bit for bit, blocking (eager on CPU) or not."""
    from fsdp_compile.passes import _program
    from fsdp_compile.passes.predict import _Backward, _Forward, _run

    n = 0
    for units, _, cm, c in _programs(0):
        for program in (_Forward(units, c), _Backward(units, c)):
            for blocking in (False, True):
                result, m = _run(program, cm.profile, blocking, record=True)
                step, busy, _ = _program.run(m.ops, cm.profile.op_overhead, cm.profile.comm_cpu_share)
                assert result == {"step_s": step, "exposed_s": step - busy, "comm_peak_bytes": max(_program.timeline(m.ops))}
                n += 1
    assert n == 4 * 6 * 4


def test_search_predicts_like_predict(monkeypatch):
    """The planner's search simulates a candidate only from the first segment its change touches until its
    state meets the current schedule's: every candidate's prediction equals ``predict``'s on the whole
    schedule (times to a trillionth, bytes exactly), the shortcut is taken, and the schedules planned are
    those a search by whole predictions plans, bit for bit."""
    from fsdp_compile.passes import planner
    from fsdp_compile.passes import search as P

    met = []
    meets = P._meets
    monkeypatch.setattr(P, "_meets", lambda m, state: met.append(meets(m, state)) or met[-1])

    class Search(P.Search):
        def __init__(self, units, modules, cost_model, workload, memo=None):
            super().__init__(units, modules, cost_model, workload, memo)
            self.args = (modules, cost_model, workload)

    class Checked(Search):
        def trial(self, i, unit):
            pred = super().trial(i, unit)
            whole = predict(self._pending[0], *self.args)
            for d in ("forward", "backward"):
                assert pred[d]["comm_peak_bytes"] == whole[d]["comm_peak_bytes"], (i, unit, d)
                for k in ("step_s", "exposed_s"):
                    assert pred[d][k] == pytest.approx(whole[d][k], rel=1e-12, abs=1e-15), (i, unit, d, k)
            return pred

    class Whole(Search):  # the search as it was: every candidate predicted whole
        def trial(self, i, unit):
            units = list(self.units)
            units[i] = unit
            self._pending = (units, [])
            return predict(units, *self.args)

    def plans(search):
        monkeypatch.setattr(planner, "Search", search)
        out = []
        for reshard, world, hw, policy, budget in [
            (True, 8, "h100-nvlink", "none", None), (True, 8, "h100-nvlink", "auto", None), (False, 64, "h100-ib", "none", None),
            (True, 2, "cpu-gloo", "none", None), (True, 1024, "h100-ib", "fsdp_group", None), (True, 8, "h100-nvlink", "none", 1e8),
        ]:
            mods = _llama_modules(world, reshard_after_forward=reshard, n_layers=3)
            out.append(plan_schedule(mods, policy=policy, reorder=True, cost_model=CostModel(hw), workload=2048,
                                     memory_budget_bytes=budget).digest())
        return out

    checked = plans(Checked)
    assert met.count(True) > 100 and met.count(False) > 0, (met.count(True), met.count(False))
    assert checked == plans(Whole)


def test_states_meet_only_up_to_a_shift_in_time():
    """``_meets``: two simulations meet where everything ahead of them is the same relative to now: the
    bytes live, the buffers held, the collectives pending, when each ends and how long it has run beside
    compute, when each stream is free."""
    from fsdp_compile.passes.predict import _Machine, _rs
    from fsdp_compile.passes.search import _meets

    def machine(t0, *, second=1.0, pg="pg", release=True):
        m = _Machine(PROFILE, False)
        m.compute(t0)
        m.issue(_rs(0), "reduce_scatter", "pg", 1.0, MB)
        m.issue(_rs(1), "reduce_scatter", pg, second, MB)
        m.wait(_rs(0))
        if release:
            m.release(_rs(0))
        return m

    a = machine(1.0)
    assert _meets(machine(3.0), a.state())  # the same, two seconds later
    assert not _meets(machine(3.0, second=2.0), a.state())  # a stream free later
    assert not _meets(machine(3.0, pg="other"), a.state())  # the same bytes, another stream busy
    assert not _meets(machine(3.0, release=False), a.state())  # a reduce-scatter still held

    def changed(m, field, edit):
        state = list(m.state())
        i = ("t", "busy", "free", "pending", "rs_held", "live").index(field)
        state[i] = edit(state[i])
        return tuple(state)

    kept = machine(1.0, release=False)
    assert not _meets(kept, changed(kept, "rs_held", lambda h: frozenset({_rs(1), _rs(2)})))  # another one held
    assert not _meets(kept, changed(kept, "free", lambda f: {**f, "other": 9.0}))  # a stream busy that is not here
    assert not _meets(kept, changed(kept, "pending", lambda p: {**p, _rs(0): (0.0, 0.0, 0)}))  # a wait not made here
    start, end, scratch = kept.pending[_rs(1)]
    assert not _meets(kept, changed(kept, "pending", lambda p: {**p, _rs(1): (start, end - 0.5, scratch)}))  # ends earlier
    # started earlier, ending as long after now: it has run longer beside compute, which its wait charges where the
    # profile has a comm_cpu_share (and nothing where it has none)
    earlier = changed(kept, "pending", lambda p: {**p, _rs(1): (start - 0.5, end, scratch)})
    assert _meets(kept, earlier)
    kept.comm_share = 0.5
    assert not _meets(kept, earlier)
    assert _meets(kept, changed(kept, "pending", lambda p: {**p, _rs(1): (start, end + 1e-15, scratch)}))  # to a trillionth


def test_eager_fsdp2_reference():
    """Eager FSDP2 on the same program: no forward prefetch, the next module prefetched in backward."""
    mods = _llama_modules(8)
    units = eager_fsdp2(mods)
    assert [u.issue_at for u in units] == list(range(5))
    # backward order: the root (its head) first, then the blocks in reverse; each gathers the next
    assert [units[i].backward_issue_at for i in (4, 3, 2, 1)] == [0, 4, 3, 2]
    pred = predict(units, mods, CostModel("h100-nvlink"), 64)
    assert pred["backward"]["exposed_s"] < predict(
        [dataclasses.replace(u, backward_issue_at=i) for i, u in enumerate(units)], mods, CostModel("h100-nvlink"), 64
    )["backward"]["exposed_s"]


def test_a_block_merged_into_the_whole_root_keeps_its_backward():
    """A whole root bucketed with its first block is a tail unit (needed first in backward); the block's backward
    compute still counts, at the end, before the unit's late reduce-scatter. It was left out, so a merge into the
    root looked like free compute to bucket="auto" (Llama-3 8B under replicate, W=8: root + layers.0 merged).
    Hand-checked (PROFILE, module costs as in the docstring): AG root+m1 3 ms (2 MB), the root's head 4, AG m2 2,
    m2 4, RS m2 2, m1 4, RS root+m1 3 = 22 ms."""
    mods = [module("", holds_children=True, leading=(".w",)), module("m1"), module("m2")]
    s = plan_schedule(mods, policy=(("", "m1"),), reorder=False, cost_model=CostModel(PROFILE), workload=1000)
    assert [u.members for u in s.units] == [("", "m1"), ("m2",)] and s.units[0].tail
    assert s.predicted["planned"]["backward"]["step_s"] == pytest.approx(22 * MS)


def _replicated_llama_modules(world_size: int, n_layers: int = 4) -> list[Module]:
    from torch.distributed._composable.replicate_with_fsdp import replicate

    with fake_process_group(world_size):
        torch.manual_seed(0)
        m = Llama(LlamaArgs(n_layers=n_layers))
        for block in m.layers:
            replicate(block)
        replicate(m)
        return modules_of(read_plan(m))


def test_replicated_units_gather_nothing_and_hold_their_all_reduced_gradients():
    """FSDP2's ``replicate`` (a one-rank shard group beside its replicas): no all-gather, so no gathered
    buffer and no launch in forward; its gradients' all-reduce runs in place, so the buffer is the gradients
    from its wait on, held to the end as eager holds them, and gloo allocates no scratch for it. The
    memory budget (eager's) is then every gradient, and one bucket of every module (all of them reduced at
    the end, DDP's one bucket) fits it. Counting the parameters as gathered buffers released after each
    module's backward, and the all-reduce as a gloo reduce-scatter with its copy, had put one bucket at
    twice eager's bytes."""
    mods = _replicated_llama_modules(2)
    assert all(m.world_size == 1 and m.replicate_size == 2 for m in mods)
    grads = sum(sum(m.reduce_bytes) for m in mods)
    cm = CostModel("cpu-gloo")
    eager = predict(eager_fsdp2(mods), mods, cm, 256, blocking=True)
    assert eager["forward"] == {"step_s": eager["forward"]["step_s"], "exposed_s": 0.0, "comm_peak_bytes": 0}
    assert eager["backward"]["comm_peak_bytes"] == grads
    one = plan_schedule(mods, policy=(tuple(m.fqn for m in mods),), reorder=True, cost_model=cm, workload=256)
    assert len(one.units) == 1 and one.comm_budget_bytes == grads
    assert one.predicted["planned"]["backward"]["comm_peak_bytes"] == grads
    # the forward is compute alone: no collective issued, no launch paid
    from fsdp_compile.passes.unit_costs import unit_costs

    c = unit_costs(eager_fsdp2(mods), {m.fqn: m for m in mods}, cm, 256)
    assert c.replicated == (True,) * len(mods)
    assert eager["forward"]["step_s"] == pytest.approx(sum(c.fwd) + c.fwd_tail, rel=1e-12)
    # and the machine still applies the event simulator's rules on what it recorded (held gradients included)
    from fsdp_compile.passes import _program
    from fsdp_compile.passes.predict import _Backward, _Forward, _run

    for units in (eager_fsdp2(mods), list(one.units)):
        c = unit_costs(units, {m.fqn: m for m in mods}, cm, 256)
        for program in (_Forward(units, c), _Backward(units, c)):
            for blocking in (False, True):
                result, m = _run(program, cm.profile, blocking, record=True)
                step, busy, _ = _program.run(m.ops, cm.profile.op_overhead, cm.profile.comm_cpu_share)
                assert result == {"step_s": step, "exposed_s": step - busy, "comm_peak_bytes": max(_program.timeline(m.ops))}


def test_gloo_all_reduce_has_its_own_link():
    """cpu-gloo prices an all-reduce on the link fitted to gloo's all-reduce (``kind_links``), not as two passes
    of the reduce-scatter fit (torch's gloo reduce-scatter is itself an all-reduce of its input: that fit
    priced a 16 MiB all-reduce at 31 ms, measured 17.7); the other kinds keep the shared link, and a profile
    without ``kind_links`` is unchanged."""
    from fsdp_compile.passes.cost_model import CPU_GLOO, H100_NVLINK

    cm = CostModel(CPU_GLOO)
    link = dict(CPU_GLOO.kind_links)["all_reduce"]
    n = 16 << 20
    assert cm.collective_time("all_reduce", n, 2, "ring") == pytest.approx(2 * link.step_latency + n / link.bus_bw)
    assert cm.collective_time("all_reduce", n, 2, "ring") < 0.6 * (
        2 * CPU_GLOO.intra.step_latency + n / CPU_GLOO.intra.bus_bw)
    assert CPU_GLOO.link(2, "all_gather") is CPU_GLOO.link(2, "reduce_scatter") is CPU_GLOO.link(2) is CPU_GLOO.intra
    assert H100_NVLINK.link(8, "all_reduce") is H100_NVLINK.intra
