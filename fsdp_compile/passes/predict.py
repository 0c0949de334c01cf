"""The planner's prediction of a schedule: its units run on the program ``unit_costs`` describes, two
kinds of stream as in ``simulate`` (compute, and communication per process group, first in, first out),
with the gathered parameters and reduce-scatter buffers alive at each point.

**Memory** (``comm_peak_bytes``): the gathered parameters and reduce-scatter buffers alive at once, the
part of the peak a schedule controls (activations, sharded state and gradients are the same under every
schedule). The budget defaults to what eager FSDP2 holds on the same program (one module at a time, the
next prefetched in backward, one reduce-scatter pending); ``CompileConfig.memory_budget_gb`` sets it. A
plan that cannot meet it even without prefetching is an error naming the numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fsdp_compile.passes.cost_model import CostModel
from fsdp_compile.passes.schedule import Module, Unit, backward_order
from fsdp_compile.passes.unit_costs import UnitCosts, unit_costs


class _Streams:
    """The simulator's rules (see ``simulate``): one compute stream, one FIFO stream per process group, and
    the bytes of gathered parameters and reduce-scatter buffers alive."""

    def __init__(self, issue_overhead: float):
        self.t = self.busy = 0.0
        self.free: dict[str, float] = {}
        self.end: dict[object, float] = {}
        self.issue_overhead = issue_overhead
        self.live = self.peak = 0

    def compute(self, seconds: float) -> None:
        self.t += seconds
        self.busy += seconds

    def issue(self, key, pg: str, seconds: float, nbytes: int) -> None:
        self.compute(self.issue_overhead)
        start = max(self.t, self.free.get(pg, 0.0))
        self.free[pg] = self.end[key] = start + seconds
        self.alloc(nbytes)

    def wait(self, key) -> None:
        self.t = max(self.t, self.end.pop(key, 0.0))

    def alloc(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def release(self, nbytes: int) -> None:
        self.live -= nbytes

    def result(self) -> dict:
        step = max([self.t, *self.free.values()])
        return {"step_s": step, "exposed_s": step - self.busy, "comm_peak_bytes": self.peak}


def _anchors(units: Sequence[Unit], order: Sequence[int], attr: str) -> dict[int, list[int]]:
    """Position in ``order`` -> the units whose all-gather is issued there, in ``order``."""
    position = {u: k for k, u in enumerate(order)}
    out: dict[int, list[int]] = {}
    for i in order:
        anchor = getattr(units[i], attr)
        k = position[anchor] if 0 <= anchor < len(units) and position[anchor] <= position[i] else position[i]
        out.setdefault(k, []).append(i)
    return out


def _run_forward(units: Sequence[Unit], c: UnitCosts, overhead: float) -> dict:
    s = _Streams(overhead)
    order = list(range(len(units)))
    issues = _anchors(units, order, "issue_at")
    for i in order:
        for j in issues.get(i, []):
            s.issue(("ag", j), c.pg[j], c.ag[j], units[j].all_gather_bytes)
        s.wait(("ag", i))
        s.compute(c.fwd[i])
        if units[i].regathers and not units[i].tail:
            s.release(units[i].all_gather_bytes)  # resharded after its forward
    s.compute(c.fwd_tail)
    return s.result()


def _run_backward(units: Sequence[Unit], c: UnitCosts, overhead: float) -> dict:
    s = _Streams(overhead)
    order = backward_order(units)
    for u in units:  # kept unsharded since forward
        if not u.regathers:
            s.alloc(u.all_gather_bytes)
    issues = _anchors([u if u.regathers else dataclasses.replace(u, backward_issue_at=-1) for u in units], order,
                      "backward_issue_at")
    reduced = [i for i in order if not units[i].tail] + [i for i in order if units[i].tail]
    reduced = [i for i in reduced if units[i].reduce_scatter_bytes]
    rank = {j: k for k, j in enumerate(reduced)}
    waits_before: dict[int, list[int]] = {}  # reduce-scatter k waits for these earlier ones first
    for j in reduced:
        if units[j].sink:
            waits_before.setdefault(rank[j] + units[j].sink, []).append(j)

    def reduce_scatter(i: int) -> None:
        for j in waits_before.get(rank[i], []):
            s.wait(("rs", j))
            s.release(units[j].reduce_scatter_bytes)
        s.issue(("rs", i), c.pg[i], c.rs[i], units[i].reduce_scatter_bytes)
        if units[i].sink == 0:
            s.wait(("rs", i))
            s.release(units[i].reduce_scatter_bytes)

    head_done = False
    for k, i in enumerate(order):
        if not units[i].tail and not head_done:
            s.compute(c.bwd_head)  # the head's backward: every tail unit is gathered by now
            head_done = True
        for j in issues.get(k, []):
            if units[j].regathers:
                s.issue(("ag", j), c.pg[j], c.ag[j], units[j].all_gather_bytes)
        if units[i].regathers:
            s.wait(("ag", i))
        if units[i].tail:
            continue
        s.compute(c.bwd[i])
        s.release(units[i].all_gather_bytes)
        if units[i].reduce_scatter_bytes:
            reduce_scatter(i)
    if not head_done:
        s.compute(c.bwd_head)
    for i in order:
        if units[i].tail:
            s.release(units[i].all_gather_bytes)
            if units[i].reduce_scatter_bytes:
                reduce_scatter(i)
    for i in reduced:  # what is still pending is waited at the end
        if ("rs", i) in s.end:
            s.wait(("rs", i))
            s.release(units[i].reduce_scatter_bytes)
    return s.result()


def predict(units: Sequence[Unit], modules: Sequence[Module], cost_model: CostModel, workload: int) -> dict:
    """``{"forward" | "backward": {"step_s", "exposed_s", "comm_peak_bytes"}}`` of ``units`` on the program."""
    c = unit_costs(units, {m.fqn: m for m in modules}, cost_model, workload)
    overhead = cost_model.profile.op_overhead
    return {"forward": _run_forward(units, c, overhead), "backward": _run_backward(units, c, overhead)}


def step_s(pred: dict) -> float:
    """A prediction's step: forward plus backward."""
    return pred["forward"]["step_s"] + pred["backward"]["step_s"]


def peak_bytes(pred: dict) -> int:
    """A prediction's ``comm_peak_bytes``: the larger of forward's and backward's."""
    return max(pred["forward"]["comm_peak_bytes"], pred["backward"]["comm_peak_bytes"])
