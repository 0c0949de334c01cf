"""Bucketing: plans (policies, caps, budgets, errors) and applied graphs (counts, order, numerics).

Numerics: collectives on the fake process group return garbage, so bucketed and original graphs are
run with ``EmulatedRanks`` (all-gather / reduce-scatter emulated over W virtual ranks) and compared
bitwise; a small hand-built graph also runs for real on a 1-rank gloo group.
"""

from __future__ import annotations

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.fx.traceback as fx_traceback
from torch.fx.experimental.proxy_tensor import make_fx

from fsdp_compile.ops import Comm, Reduction, ReduceScatterArgs, UnshardArgs, reduce_scatter_grads_impl, unshard_impl
from fsdp_compile.passes import _bucket_rewrite as R
from fsdp_compile.passes import bucketing as B
from fsdp_compile.passes import peak_memory, simulate
from fsdp_compile.passes import predicates as P
from passes_helpers import EmulatedRanks, captured, copy_gm, nodes_by_name, random_inputs, same_outputs

GROUPS = ["", "layers.0", "layers.1", "layers.2", "layers.3"]


def _order(gm, kind):
    """FSDP groups of the graph's collectives of one kind, in program order, flattened over buckets."""
    return [g for n in P.collectives(gm.graph, kind) for g in P.fsdp_groups(n)]


def _apply_on_copy(gm, plan):
    out = copy_gm(gm)
    names = nodes_by_name(out)
    B.apply_buckets(out, [[names[n.name] for n in b] for b in plan])
    return out


def _same_numbers(gm, bucketed):
    inputs = random_inputs(gm)
    return same_outputs(EmulatedRanks(gm).run(*inputs), EmulatedRanks(bucketed).run(*inputs))


@pytest.mark.parametrize("policy", ["none", "fsdp_group"])
def test_keep_policies_are_singletons(policy):
    fw, bw, _ = captured(8)
    for gm, n in ((fw, 5), (bw, 9)):
        plan = B.plan_buckets(gm, policy)
        assert len(plan) == n and all(len(b) == 1 for b in plan)
        before = gm.code
        out = _apply_on_copy(gm, plan)
        assert out.code == before


def test_explicit_plan_world_8():
    fw, bw, plan_ = captured(8)
    policy = [["", "layers.0"], ["layers.1", "layers.2", "layers.3"]]
    fw_plan = B.plan_buckets(fw, policy, known_groups=[g.fqn for g in plan_.groups])
    assert B.bucket_groups(fw_plan) == policy
    bw_plan = B.plan_buckets(bw, policy)
    # backward: the root is not re-gathered (its parameters are kept), so layers.0 gathers alone
    assert B.bucket_groups(bw_plan) == [["layers.3", "layers.2", "layers.1"], ["layers.3", "layers.2", "layers.1"], ["layers.0"], ["layers.0", ""]]
    assert [P.collective_kind(b[0]) for b in bw_plan] == ["all_gather", "reduce_scatter", "all_gather", "reduce_scatter"]
    new_fw, new_bw = _apply_on_copy(fw, fw_plan), _apply_on_copy(bw, bw_plan)
    assert len(P.collectives(new_fw.graph, "all_gather")) == 2
    assert len(P.collectives(new_bw.graph, "all_gather")) == 2
    assert len(P.collectives(new_bw.graph, "reduce_scatter")) == 2
    for old, new in ((fw, new_fw), (bw, new_bw)):
        for kind in ("all_gather", "reduce_scatter"):
            assert _order(new, kind) == _order(old, kind)  # order kept
        # the bucketed collective moves the members' bytes in one go
        for n in P.collectives(new.graph):
            assert P.collective_bytes(n) == sum(plan_.group(g).unsharded_bytes for g in P.fsdp_groups(n))
        assert _same_numbers(old, new)


@pytest.mark.parametrize("world_size, hardware", [(2, "h100-nvlink"), (8, "cpu-gloo"), (1024, "h100-ib")])
def test_auto(world_size, hardware):
    fw, bw, _ = captured(world_size)
    for gm in (fw, bw):
        plan = B.plan_buckets(gm, "auto", cost_model=hardware)
        members = [n for b in plan for n in b]
        assert sorted(n.name for n in members) == sorted(n.name for n in P.collectives(gm.graph))
        new = _apply_on_copy(gm, plan)
        before, after = simulate(gm, hardware), simulate(new, hardware)
        assert after.step_time <= before.step_time
        assert peak_memory(new)[0] <= B.default_memory_budget(gm.graph)
        assert len(P.collectives(new.graph)) == len(plan)
        for kind in ("all_gather", "reduce_scatter"):
            assert _order(new, kind) == _order(gm, kind)
        assert _same_numbers(gm, new)
    # latency-bound at 1024 ranks: something must be merged
    if world_size == 1024:
        assert any(len(b) > 1 for b in B.plan_buckets(fw, "auto", cost_model=hardware))


def test_auto_estimate_matches_applied_graph():
    """The planner evaluates candidates on the lowered op list; it must agree with the rewritten graph."""
    fw, bw, _ = captured(8)
    for gm in (fw, bw):
        cm = B.cost_model_for("cpu-gloo", gm.graph)
        est = R.Estimator(gm.graph, cm)
        for kind in ("all_gather", "reduce_scatter"):
            colls = P.collectives(gm.graph, kind)
            for bucket in [colls[i : i + 2] for i in range(len(colls) - 1)] + [colls[:3]]:
                if len(bucket) < 2:
                    continue
                rw = R.describe(gm.graph, bucket, est.pos)
                predicted = est.evaluate(est.transform(est.base, rw, "t"))
                new = _apply_on_copy(gm, [bucket])
                assert predicted[0] == pytest.approx(simulate(new, cm).step_time, rel=1e-12)
                assert predicted[1] == peak_memory(new)[0]


def test_auto_respects_cap_and_budget():
    fw, bw, plan_ = captured(1024)
    largest = max(g.unsharded_bytes for g in plan_.groups) / B.MB
    with pytest.raises(ValueError, match=r"bucket_cap_mb=0.01 is below the largest single collective: .* MiB"):
        B.plan_buckets(fw, "auto", bucket_cap_mb=0.01)
    # with memory to spare, 1023 ring steps of 5 us each make one bucket of everything the fastest
    uncapped = B.plan_buckets(fw, "auto", cost_model="h100-ib", memory_budget_bytes=1 << 40)
    assert B.bucket_groups(uncapped) == [GROUPS]
    cap = largest * 1.5
    capped = B.plan_buckets(fw, "auto", bucket_cap_mb=cap, cost_model="h100-ib", memory_budget_bytes=1 << 40)
    assert all(sum(P.collective_bytes(n) for n in b) <= cap * B.MB for b in capped)
    assert max(map(len, capped)) < max(map(len, uncapped))
    for gm in (fw, bw):
        budget = peak_memory(gm)[0]  # not a byte more than the capture's schedule
        plan = B.plan_buckets(gm, "auto", memory_budget_bytes=budget, cost_model="h100-ib")
        assert peak_memory(_apply_on_copy(gm, plan))[0] <= budget


def test_explicit_plan_errors():
    fw, bw, _ = captured(8)
    with pytest.raises(ValueError, match="unknown FSDP module 'layers.9'"):
        B.plan_buckets(fw, [["layers.0", "layers.9"]])
    with pytest.raises(ValueError, match="'layers.1' is in buckets 0 and 1"):
        B.plan_buckets(fw, [["layers.0", "layers.1"], ["layers.1"]])
    with pytest.raises(ValueError, match=r"not adjacent: \['all_gather_into_tensor_2'\] run between them"):
        B.plan_buckets(fw, [["layers.0", "layers.2"]])
    with pytest.raises(ValueError, match="over bucket_cap_mb"):
        B.plan_buckets(bw, [GROUPS], bucket_cap_mb=0.2)
    with pytest.raises(ValueError, match="bucket policy must be"):
        B.plan_buckets(fw, "everything")
    with pytest.raises(ValueError, match="kinds"):
        B.plan_buckets(fw, "auto", kinds=["all_reduce"])
    ag = P.collectives(fw.graph, "all_gather")
    other = copy_gm(fw)
    names = nodes_by_name(other)
    with pytest.raises(ValueError, match="not adjacent"):
        B.apply_buckets(other, [[names[ag[0].name], names[ag[2].name]]])
    with pytest.raises(ValueError, match="not in the graph"):
        B.apply_buckets(other, [[ag[0], ag[1]]])


# --- a hand-built graph: the capture's own decompositions, traced with make_fx ----------------------

W = 2


def _step(group_name, w):
    def comm(group):
        return Comm(fsdp_group=group, group_name=group_name, world_size=w, rank=0, kernels="torch")

    avg = Reduction(dtype=torch.float32, op="avg", pre_factor=None, post_factor=None)

    def step(a, b, c, g1, g2):
        # two FSDP groups: m1 = {a [5, 3] (uneven over 2 ranks: 3 + 2 rows), b [4]}, m2 = {c [4, 3]}
        fa, fb = unshard_impl([a, b], UnshardArgs(comm("m1"), (5, 4), None, avg))
        (fc,) = unshard_impl([c], UnshardArgs(comm("m2"), (4,), None, avg))
        out = fa.sum(0) * fb[:3] + fc.sum(0)
        (r1,) = reduce_scatter_grads_impl([g1], ReduceScatterArgs(comm("m1"), (2,), torch.float32, avg))
        (r2,) = reduce_scatter_grads_impl([g2], ReduceScatterArgs(comm("m2"), (2,), torch.float32, avg))
        return out, r1, r2

    return step


def _trace_step(w):
    pg = dist.group.WORLD.group_name
    shapes = [(-(-5 // w), 3), (-(-4 // w),), (-(-4 // w), 3), (4, 3), (4, 3)]
    with fx_traceback.preserve_node_meta():
        gm = make_fx(_step(pg, w), tracing_mode="fake")(*[torch.empty(s) for s in shapes])
    return gm, shapes


def _dump(gm) -> str:
    pg = dist.group.WORLD.group_name
    lines = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and (P.fsdp_meta(n) or P.is_collective(n)):
            args = ", ".join("pg" if a == pg else str(a) for a in n.args)
            lines.append(f"{n.name} = {n.target.__name__}({args})  # {','.join(P.fsdp_groups(n))}")
    return "\n".join(lines)


class TestHandBuilt(expecttest.TestCase):
    def test_bucketed_graph(self):
        from dist_helpers import fake_process_group

        with fake_process_group(W):
            gm, _ = _trace_step(W)
            plan = B.plan_buckets(gm, [["m1", "m2"]])
            self.assertEqual(B.bucket_groups(plan), [["m1", "m2"], ["m1", "m2"]])
            new = _apply_on_copy(gm, plan)
            self.assertExpectedInline(_dump(new), """\
view = view.default(a_1, [-1])  # m1
view_1 = view.default(b_1, [-1])  # m1
view_3 = view.default(c_1, [-1])  # m2
cat_default = cat.default([view, view_1, view_3])  # m1,m2
all_gather_into_tensor_default = all_gather_into_tensor.default(cat_default, 2, pg)  # m1,m2
wait_tensor_default = wait_tensor.default(all_gather_into_tensor_default)  # m1,m2
view_default = view.default(wait_tensor_default, [2, 17])  # m1,m2
slice_tensor = slice.Tensor(view_default, 1, 0, 11)  # m1,m2
slice_tensor_1 = slice.Tensor(view_default, 1, 11, 17)  # m1,m2
slice_1 = slice.Tensor(slice_tensor, 1, 0, 9)  # m1
clone = clone.default(slice_1)  # m1
_unsafe_view = _unsafe_view.default(clone, [6, 3])  # m1
slice_2 = slice.Tensor(_unsafe_view, 0, 0, 5)  # m1
slice_3 = slice.Tensor(slice_tensor, 1, 9, 11)  # m1
clone_1 = clone.default(slice_3)  # m1
_unsafe_view_1 = _unsafe_view.default(clone_1, [4])  # m1
alias = alias.default(slice_tensor_1)  # m2
clone_default = clone.default(alias)  # m2
view_5 = view.default(clone_default, [4, 3])  # m2
view_6 = view.default(g1_1, [2, -1])  # m1
view_9 = view.default(g2_1, [2, -1])  # m2
cat_default_1 = cat.default([view_6, view_9], 1)  # m1,m2
view_default_1 = view.default(cat_default_1, [-1])  # m1,m2
reduce_scatter_tensor_default = reduce_scatter_tensor.default(view_default_1, avg, 2, pg)  # m1,m2
wait_tensor_default_1 = wait_tensor.default(reduce_scatter_tensor_default)  # m1,m2
slice_tensor_2 = slice.Tensor(wait_tensor_default_1, 0, 0, 6)  # m1,m2
slice_tensor_3 = slice.Tensor(wait_tensor_default_1, 0, 6, 12)  # m1,m2
slice_5 = slice.Tensor(slice_tensor_2, 0, 0, 6)  # m1
view_8 = view.default(slice_5, [2, 3])  # m1
slice_6 = slice.Tensor(slice_tensor_3, 0, 0, 6)  # m2
view_11 = view.default(slice_6, [2, 3])  # m2""")
            self.assertTrue(_same_numbers(gm, new))


def test_hand_built_runs_for_real_on_one_gloo_rank():
    """The bucketed graph executes with real functional collectives (1-rank gloo) and matches the original."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        gm, shapes = _trace_step(1)
        plan = B.plan_buckets(gm, [["m1", "m2"]])
        assert B.bucket_groups(plan) == [["m1", "m2"]]  # one rank: no reduce-scatter in the graph
        new = _apply_on_copy(gm, plan)
        assert len(P.collectives(new.graph)) == 1
        torch.manual_seed(0)
        inputs = [torch.randn(s) for s in shapes]
        assert same_outputs(gm(*inputs), new(*inputs))
    finally:
        dist.destroy_process_group()


def test_opaque_copy_in_and_copy_out():
    """Copy-ins that are not a ``cat`` and copy-outs that read the flat 1-D result (as custom copy kernels
    do) still bucket: the flat inputs are concatenated and each member gets a contiguous 1-D slice."""
    from dist_helpers import fake_process_group
    from fsdp_compile._annotations import UNSHARD, annotate

    def tag(group):
        return annotate(UNSHARD, group)

    with fake_process_group(W):
        pg = dist.group.WORLD.group_name

        def step(x, y, g1, g2):
            with tag("m1"):
                a = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x * 2, W, pg))
                r1 = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(g1 * 1.5, "sum", W, pg))
            with tag("m2"):
                b = _c10d.wait_tensor(_c10d.all_gather_into_tensor(y * 3, W, pg))
                r2 = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(g2 * 0.5, "sum", W, pg))
            return a * 1.0 + b[:8].sum(), r1 + 1, r2 + 1

        with fx_traceback.preserve_node_meta():
            gm = make_fx(step, tracing_mode="fake")(torch.empty(4), torch.empty(6), torch.empty(8), torch.empty(10))
        plan = B.plan_buckets(gm, [["m1", "m2"]])
        assert B.bucket_groups(plan) == [["m1", "m2"], ["m1", "m2"]]
        new = _apply_on_copy(gm, plan)
    assert len(P.collectives(new.graph)) == 2
    assert [P.collective_bytes(n) for n in P.collectives(new.graph)] == [4 * 2 * 10, 4 * 18]
    assert _same_numbers(gm, new)


_c10d = torch.ops._c10d_functional
