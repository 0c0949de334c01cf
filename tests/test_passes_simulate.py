"""The simulator on small hand-built schedules whose answer is computed by hand, and on captured graphs.

Hand-built graphs are traced with ``make_fx`` (fake tensors) on the fake process group (2 ranks) and
timed with ``PROFILE``: 1 TFLOP/s, free memory traffic and launches, and a link of 0.5 GB/s with 1 ms per
ring step. So, with W = 2:

* ``mm(a [1000, 1000], a)``: 2e9 FLOPs = 2 ms;  ``mm(full [500, 1000], mm0)``: 1e9 FLOPs = 1 ms;
* all-gather of 1 MB per rank (2 MB gathered): 1 ms + 2 MB * (1/2) / 0.5 GB/s = 3 ms.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from dist_helpers import fake_process_group
from fsdp_compile.passes import simulate
from fsdp_compile.passes.cost_model import CostModel
from passes_helpers import PROFILE, captured

c10d = torch.ops._c10d_functional
MS = 1e-3


def _trace(fn, *shapes):
    return make_fx(fn, tracing_mode="fake")(*[torch.empty(s) for s in shapes]).graph


def _gather_beside_matmul(numel: int, waited_at_once: bool = False) -> fx.Graph:
    """``ag1 (numel per rank) -> mm0 [1000, 1000]^2 -> wait ag1 -> mm1 (the gathered rows @ mm0)``; with
    ``waited_at_once`` the wait comes right after ``ag1``."""
    pg = dist.group.WORLD.group_name

    def step(x, a):
        ag1 = c10d.all_gather_into_tensor(x, 2, pg)
        if waited_at_once:
            ag1 = c10d.wait_tensor(ag1)
        mm0 = torch.mm(a, a)
        full = c10d.wait_tensor(ag1) if not waited_at_once else ag1
        return torch.mm(full.view(2 * numel // 1000, 1000), mm0)

    return _trace(step, (numel,), (1000, 1000))


def test_all_gather_hidden_behind_matmul():
    """``ag1 -> mm0 (hides ag1) -> wait ag1 -> mm1``

    ag1 runs [0, 3] ms, mm0 [0, 2]: the wait at 2 ms stalls until 3 (1 ms exposed, 2 hidden); mm1 [3, 4].
    """
    with fake_process_group(2):
        pg = dist.group.WORLD.group_name
        g = _gather_beside_matmul(250_000)
    s = simulate(g, CostModel(PROFILE))
    assert s.step_time == pytest.approx(4 * MS)
    assert s.compute_time == pytest.approx(3 * MS)
    assert s.exposed_comm_time == pytest.approx(1 * MS)
    (ag,) = s.collectives
    assert (ag.kind, ag.bytes, ag.world_size, ag.process_group) == ("all_gather", 2_000_000, 2, pg)
    assert (ag.issue, ag.start, ag.end, ag.wait_at) == pytest.approx((0, 0, 3 * MS, 2 * MS))
    assert (ag.duration, ag.exposed, ag.hidden) == pytest.approx((3 * MS, 1 * MS, 2 * MS))
    assert ag.wait is not None and ag.name.startswith("all_gather") and ag.fsdp_groups == []
    assert json.loads(s.to_json())["collectives"][0]["exposed"] == pytest.approx(1 * MS)


def test_communication_that_shares_the_compute_processor_slows_compute():
    """``comm_cpu_share`` 0.5 (gloo's threads on the cores compute runs on). ``ag1`` of 0.5 MB per rank (1 ms +
    1 MB * (1/2) / 0.5 GB/s = 2 ms) beside ``mm0`` (2 ms): hidden whole, it ran 2 ms beside compute, so its wait
    charges the compute stream 1 ms; then ``mm1`` (0.5 ms): step 3.5 ms, where it is 2.5 ms with the
    collective free. Waited at once, it ran beside nothing: it costs its duration and no more."""
    import dataclasses

    with fake_process_group(2):
        g, g_exposed = _gather_beside_matmul(125_000), _gather_beside_matmul(125_000, waited_at_once=True)
    free, shared = CostModel(PROFILE), CostModel(dataclasses.replace(PROFILE, comm_cpu_share=0.5))
    assert simulate(g, free).step_time == pytest.approx(2.5 * MS)
    s = simulate(g, shared)
    assert (s.step_time, s.compute_time, s.exposed_comm_time) == pytest.approx((3.5 * MS, 3.5 * MS, 0))
    (ag,) = s.collectives
    assert (ag.issue, ag.end, ag.wait_at, ag.exposed, ag.hidden) == pytest.approx((0, 2 * MS, 2 * MS, 0, 2 * MS))
    assert simulate(g_exposed, shared).step_time == pytest.approx(simulate(g_exposed, free).step_time) == pytest.approx(4.5 * MS)
    (ag,) = simulate(g_exposed, shared).collectives
    assert (ag.exposed, ag.hidden) == pytest.approx((2 * MS, 0))


def test_same_process_group_queues_other_groups_overlap():
    """Two all-gathers issued together, then ``mm0`` (2 ms), then both waits.

    Same group: ag1 [0, 3], ag2 queued [3, 6]; waits at 2 and 3 expose 1 + 3 ms; step 6 ms.
    Different groups: both [0, 3]; waits expose 1 + 0 ms; step 3 ms.
    """
    with fake_process_group(2):
        pg1 = dist.group.WORLD.group_name
        pg2 = dist.new_group([0, 1]).group_name
        assert pg1 != pg2
        graphs = {}

        def make_step(second):
            def step(x, y, a):
                ag1 = c10d.all_gather_into_tensor(x, 2, pg1)
                ag2 = c10d.all_gather_into_tensor(y, 2, second)
                mm0 = torch.mm(a, a)
                return c10d.wait_tensor(ag1).sum() + c10d.wait_tensor(ag2).sum() + mm0.sum()

            return step

        for name, second in (("same", pg1), ("other", pg2)):
            graphs[name] = _trace(make_step(second), (250_000,), (250_000,), (1000, 1000))
    cm = CostModel(PROFILE)
    same, other = simulate(graphs["same"], cm), simulate(graphs["other"], cm)
    assert same.step_time == pytest.approx(6 * MS)
    assert [c.exposed for c in same.collectives] == pytest.approx([1 * MS, 3 * MS])
    assert [c.hidden for c in same.collectives] == pytest.approx([2 * MS, 0])
    assert same.collectives[1].start == pytest.approx(3 * MS)
    assert other.step_time == pytest.approx(3 * MS)
    assert [c.exposed for c in other.collectives] == pytest.approx([1 * MS, 0])


def test_unwaited_collective_extends_the_step():
    with fake_process_group(2):
        pg = dist.group.WORLD.group_name

        def step(x, a):
            c10d.all_gather_into_tensor(x, 2, pg)
            return torch.mm(a, a)

        g = _trace(step, (250_000,), (1000, 1000))
    s = simulate(g, CostModel(PROFILE))
    assert s.step_time == pytest.approx(3 * MS)
    assert s.collectives[0].wait is None and s.collectives[0].exposed == pytest.approx(1 * MS)


@pytest.mark.parametrize("world_size", [8, 1024])
def test_captured_llama(world_size):
    fw, bw, _ = captured(world_size)
    for gm in (fw, bw):
        for hw in ("cpu-gloo", "h100-nvlink", "h100-ib"):
            s = simulate(gm, hw)
            assert s.hardware == hw
            assert s.step_time >= s.compute_time > 0
            assert s.exposed_comm_time == pytest.approx(sum(c.exposed for c in s.collectives))
            assert len(s.collectives) == (5 if gm is fw else 9)
            # the capture waits right after issuing: nothing overlaps yet (the reordering pass's job)
            assert all(c.hidden == pytest.approx(0, abs=1e-12) for c in s.collectives)
            assert [c.fsdp_group for c in s.collectives if c.kind == "all_gather"][0] == ("" if gm is fw else "layers.3")
            json.loads(s.to_json())
    # more ranks: the ring's latency term grows
    if world_size == 1024:
        assert simulate(fw, "h100-ib").step_time > simulate(captured(8)[0], "h100-ib").step_time
