"""Reordering: prefetch all-gathers and sink reduce-scatter waits within a memory budget.

Hand-built schedule (``passes_helpers.PROFILE``: mm of [1000, 1000]^2 = 2 ms, all-gather of 1 MB per
rank = 3 ms, memory traffic free)::

    input:      mm0 (2 ms) -> ag1 (3 ms, exposed) -> wait ag1 -> sum          step 5 ms
    reordered:  ag1 -> mm0 (hides 2 ms of ag1) -> wait ag1 (1 ms exposed) -> sum   step 3 ms

Memory: x 1 MB and a 4 MB are inputs (live throughout); mm0's output (4 MB) is freed after its sum; the
gathered buffer is 2 MB. Input peak: x + a + mm0 + its 4-byte sum = 9 MB + 4 (at the sum). Reordered:
x + a + ag1 + mm0 + sum = 11 MB + 4, so the default budget (the input's peak) forbids the move and an
11 MB + 4 budget allows it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

from dist_helpers import fake_process_group
from fsdp_compile.passes import peak_memory, simulate
from fsdp_compile.passes import predicates as P
from fsdp_compile.passes.cost_model import CostModel
from fsdp_compile.passes.reordering import reorder
from passes_helpers import PROFILE, EmulatedRanks, captured, copy_gm, random_inputs, same_outputs

c10d = torch.ops._c10d_functional
MB = 1_000_000
MS = 1e-3
S = 4  # one fp32 scalar


def _hand_built():
    with fake_process_group(2):
        pg = dist.group.WORLD.group_name

        def step(x, a):
            s0 = torch.mm(a, a).sum()
            ag1 = c10d.all_gather_into_tensor(x, 2, pg)
            return c10d.wait_tensor(ag1).sum() + s0

        return make_fx(step, tracing_mode="fake")(torch.empty(250_000), torch.empty(1000, 1000))


def _order(gm):
    return [n.name for n in gm.graph.nodes if n.op == "call_function"]


def test_prefetch_blocked_by_default_budget():
    gm = _hand_built()
    cm = CostModel(PROFILE)
    assert peak_memory(gm)[0] == 9 * MB + S
    before = _order(gm)
    r = reorder(gm, cm)
    assert r.moves == [] and _order(gm) == before
    assert (r.step_before, r.step_after) == pytest.approx((5 * MS, 5 * MS))
    assert r.memory_budget == 9 * MB + S


def test_prefetch_within_budget_hides_the_all_gather():
    gm = _hand_built()
    cm = CostModel(PROFILE)
    r = reorder(gm, cm, memory_budget_bytes=11 * MB + S)
    [move] = r.moves
    assert (move.kind, move.node, move.anchor, move.was) == ("prefetch", "all_gather_into_tensor", "mm", "wait_tensor")
    assert (move.step_before, move.step_after, move.peak_after) == pytest.approx((5 * MS, 3 * MS, 11 * MB + S))
    assert _order(gm)[:3] == ["all_gather_into_tensor", "mm", "sum_1"]
    assert (r.step_before, r.step_after) == pytest.approx((5 * MS, 3 * MS))
    assert simulate(gm, cm).step_time == pytest.approx(3 * MS)
    assert r.peak_after == peak_memory(gm)[0] == 11 * MB + S


@pytest.mark.parametrize("world_size, hardware", [(8, "h100-nvlink"), (1024, "h100-ib")])
def test_captured_llama(world_size, hardware):
    fw, bw, _ = captured(world_size)
    for gm in (fw, bw):
        new = copy_gm(gm)
        before = simulate(gm, hardware)
        r = reorder(new, hardware)
        after = simulate(new, hardware)
        assert r.moves, "the capture's schedule exposes every collective: something must move"
        assert after.step_time == pytest.approx(r.step_after) and after.step_time < before.step_time
        assert after.exposed_comm_time < before.exposed_comm_time
        assert peak_memory(new)[0] <= peak_memory(gm)[0] == r.memory_budget
        for kind in ("all_gather", "reduce_scatter"):  # order within a kind is kept
            assert [n.name for n in P.collectives(new.graph, kind)] == [n.name for n in P.collectives(gm.graph, kind)]
        inputs = random_inputs(gm)
        assert same_outputs(EmulatedRanks(gm).run(*inputs), EmulatedRanks(new).run(*inputs))
        if gm is bw:
            assert any(m.kind == "sink_wait" for m in r.moves)
            assert any(c.hidden > 0 for c in after.collectives if c.kind == "reduce_scatter")
        assert any(c.hidden > 0 for c in after.collectives if c.kind == "all_gather")
