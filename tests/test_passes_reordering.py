"""``apply_schedule``: a schedule's prefetches and deferred waits on captured graphs.

The graphs are captured as placed (``bucket="fsdp_group", reorder=False``: every collective where FSDP2's
hooks issue it), then a schedule planned for the same units is applied to copies. The schedule decides
which collectives move where; the graph only supplies anchors (other collectives), so every rank's graph
gets the same collectives in the same order, whatever its activation shapes or shard sizes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fsdp_compile as fc
from dist_helpers import fake_process_group
from fsdp_compile.passes import predicates as P
from fsdp_compile.passes.cost_model import CostModel
from fsdp_compile.passes.reordering import apply_schedule
from fsdp_compile.passes.planner import plan_schedule
from fsdp_compile.passes.schedule import modules_of
from models import Llama, LlamaArgs, OddMLP, shard
from passes_helpers import EmulatedRanks, captured, copy_gm, random_inputs, same_outputs

AS_PLACED = fc.CompileConfig(backend="aot_eager", bucket="fsdp_group", reorder=False)


def _sequence(gm) -> list[tuple[str, int, int, int]]:
    """What the process groups see: every FSDP collective (kind, unit, group size, bytes), in issue order."""
    return [(P.collective_kind(n), P.fsdp_unit(n), P.world_size(n), P.collective_bytes(n)) for n in P.collectives(gm.graph)]


def _planned(plan, hardware="h100-nvlink", workload=64):
    return plan_schedule(modules_of(plan), policy="fsdp_group", reorder=True, cost_model=CostModel(hardware), workload=workload)


@pytest.mark.parametrize("world_size", [8, 1024])
def test_captured_llama(world_size):
    fw, bw, plan = captured(world_size)
    schedule = _planned(plan, "h100-nvlink" if world_size == 8 else "h100-ib")
    assert any(u.issue_at != i for i, u in enumerate(schedule.units))  # something to apply
    for gm in (fw, bw):
        new = copy_gm(gm)
        moves = apply_schedule(new.graph, schedule)
        new.recompile()
        assert moves
        for kind in ("all_gather", "reduce_scatter"):  # order within a kind is kept
            assert [P.fsdp_unit(n) for n in P.collectives(new.graph, kind)] == [
                P.fsdp_unit(n) for n in P.collectives(gm.graph, kind)
            ]
        pos = {n: k for k, n in enumerate(new.graph.nodes)}
        gathers = {P.fsdp_unit(n): n for n in P.collectives(new.graph, "all_gather")}
        for i, ag in gathers.items():  # every prefetch lands before its anchor's wait
            anchor = schedule.units[i].issue_at if gm is fw else schedule.units[i].backward_issue_at
            if anchor != i and anchor in gathers:
                assert pos[ag] < pos[P.wait_of(gathers[anchor])], (i, anchor)
        inputs = random_inputs(gm)
        assert same_outputs(EmulatedRanks(gm).run(*inputs), EmulatedRanks(new).run(*inputs))
    kinds = {m.kind for m in apply_schedule(copy_gm(bw).graph, schedule)}
    assert kinds == {"prefetch", "sink_wait"}


def _capture(world_size, rank, model_fn, batch):
    with fake_process_group(world_size, rank=rank):
        torch.manual_seed(0)
        model = model_fn()
        compiled = fc.compile(model, config=AS_PLACED)
        compiled(batch).float().sum().backward()
        return compiled.captured.forward[0], compiled.captured.backward[0], compiled.plan


def _llama():
    m = Llama(LlamaArgs(n_layers=3))
    return shard(m, m.layers)


def _llama_post_forward_2():
    m = Llama(LlamaArgs(n_layers=3))
    return shard(m, m.layers, reshard_after_forward=2)


def _odd():
    m = OddMLP()
    return shard(m, m.blocks)


@pytest.mark.parametrize(
    "world_size, model_fn, batches",
    [
        # two ranks with different batch shapes: one token vs 4 x 32
        (8, _llama, [((0, torch.randint(0, 256, (1, 1)))), (5, torch.randint(0, 256, (4, 32)))]),
        # uneven shards: rank 0 holds rows that rank 3 does not (its shards are empty), other batch sizes too
        (4, _odd, [(0, torch.randn(2, 6)), (3, torch.randn(7, 6))]),
        # int reshard_after_forward: ranks 0 and 3 keep different chunks, re-gathered over different groups
        (4, _llama_post_forward_2, [(0, torch.randint(0, 256, (1, 1))), (3, torch.randint(0, 256, (4, 32)))]),
    ],
    ids=["batch_shapes", "uneven_shards", "post_forward_2"],
)
@pytest.mark.slow
def test_every_rank_issues_the_same_sequence(world_size, model_fn, batches):
    """The graphs differ (activation shapes, pad nodes on short ranks); the collectives they issue, in order,
    after the same schedule is applied, do not."""
    graphs = [_capture(world_size, rank, model_fn, batch) for rank, batch in batches]
    schedule = _planned(graphs[0][2])
    assert schedule.digest() == _planned(graphs[1][2]).digest()
    sequences = []
    for fw, bw, _ in graphs:
        seq = []
        for gm in (fw, bw):
            new = copy_gm(gm)
            apply_schedule(new.graph, schedule)
            seq.append(_sequence(new))
        sequences.append(seq)
    assert sequences[0] == sequences[1]
    assert [fw.code for fw, _, _ in graphs][0] != [fw.code for fw, _, _ in graphs][1]  # the graphs themselves differ


def test_nothing_moves_without_a_plan_to():
    fw, bw, plan = captured(8)
    schedule = plan_schedule(modules_of(plan), policy="fsdp_group", reorder=False, cost_model=CostModel("h100-nvlink"), workload=64)
    for gm in (fw, bw):
        new = copy_gm(gm)
        assert apply_schedule(new.graph, schedule) == []
        assert [n.name for n in new.graph.nodes] == [n.name for n in gm.graph.nodes]


def _one_sink(schedule, bw, k: int):
    """``(moves, graph)``: ``schedule`` applied to a copy of ``bw`` with every unit issued in place and only unit
    ``k``'s reduction wait deferred past the next one (sink 1)."""
    units = [dataclasses.replace(u, issue_at=i, backward_issue_at=i, sink=0) for i, u in enumerate(schedule.units)]
    units[k] = dataclasses.replace(units[k], sink=1)
    new = copy_gm(bw)
    return apply_schedule(new.graph, dataclasses.replace(schedule, units=tuple(units))), new


def test_sink_defers_a_wait_past_the_next_reduce_scatter():
    _, bw, plan = captured(8)
    moves, new = _one_sink(_planned(plan), bw, 4)  # layers.3, the first reduce-scatter in backward
    assert [(m.kind, m.unit) for m in moves] == [("sink_wait", 4)]
    order = [n for n in new.graph.nodes if P.is_reduce_scatter(n) or P.is_wait(n)]
    rs = {P.fsdp_unit(n): n for n in order if P.is_reduce_scatter(n)}
    # layers.3's reduce-scatter is waited right before layers.2's is issued
    assert order.index(P.wait_of(rs[4])) == order.index(rs[3]) - 1


def _replicated_llama():
    from torch.distributed._composable.replicate_with_fsdp import replicate

    m = Llama(LlamaArgs(n_layers=3))
    for b in m.layers:
        replicate(b)
    return replicate(m)


@pytest.mark.slow  # out of the fast tier (its budget); the full suite runs it
def test_sink_defers_a_replicate_all_reduce():
    """replicate (FSDP2's DDP): a one-rank group has no reduce-scatter, its gradients' all-reduce is the unit's
    reduction, and a sink defers its wait as a reduce-scatter's (before, every all-reduce was waited at once:
    bench/scale_sim.py --replicate found all of the backward's communication exposed)."""
    _, bw, plan = _capture(8, 0, _replicated_llama, torch.randint(0, 256, (2, 16)))
    moves, new = _one_sink(_planned(plan), bw, 3)  # layers.2, the first all-reduce in backward
    assert [(m.kind, m.unit) for m in moves] == [("sink_wait", 3)]
    order = [n for n in new.graph.nodes if P.collective_kind(n) == "all_reduce" or P.is_wait(n)]
    ar = {P.fsdp_unit(n): n for n in order if P.collective_kind(n) == "all_reduce"}
    assert sorted(ar) == [0, 1, 2, 3] and not P.collectives(new.graph, "reduce_scatter")
    assert order.index(P.wait_of(ar[3])) == order.index(ar[2]) - 1  # waited right before layers.1's is issued
