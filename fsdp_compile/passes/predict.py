"""The planner's prediction of a schedule: its units run on the program ``unit_costs`` describes, written
as ``_program.Op``s and timed by the event simulator ``simulate`` runs on graphs (``_program.run``: compute,
and communication per process group, first in, first out), with the gathered parameters and
reduce-scatter buffers alive at each point (``_program.timeline``). The two differ only in what they are
fed: per-unit estimates here, per-node costs there (``tests/test_passes_predict.py`` measures the gap).

**Memory** (``comm_peak_bytes``): the gathered parameters and reduce-scatter buffers alive at once, with
what the communication backend allocates for each collective in flight (``HardwareProfile.
collective_scratch``: gloo copies a reduce-scatter's input), the part of the peak a schedule controls
(activations, sharded state and gradients are the same under every schedule). The budget defaults to
what eager FSDP2 holds on the same program (one module at a time, the next prefetched in backward, one
reduce-scatter pending; on a CPU profile every collective waited as it is issued, as eager FSDP2 runs
them without streams); ``CompileConfig.memory_budget_gb`` sets it. A plan that cannot meet it even
without prefetching is an error naming the numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fsdp_compile.passes import _program
from fsdp_compile.passes.cost_model import CostModel, HardwareProfile
from fsdp_compile.passes.schedule import Module, Unit, backward_order
from fsdp_compile.passes.unit_costs import UnitCosts, unit_costs


class _Program:
    """The unit program written as ``_program.Op``s, so that it is timed by ``_program.run`` and measured by
    ``_program.timeline``: the one event simulator, which ``simulate`` and ``memory`` run on graphs (one
    compute stream, one FIFO stream per process group, a collective's launch on the compute stream). Only
    the gathered parameters, reduce-scatter buffers and the backend's scratch for collectives in flight are
    allocated, so the peak is ``comm_peak_bytes``."""

    def __init__(self, profile: HardwareProfile, blocking: bool):
        self.issue_overhead = profile.op_overhead
        self.scratch = profile.scratch_bytes  # what the backend allocates beside a collective, to its wait
        self.blocking = blocking  # every collective waited as it is issued
        self.ops: list[_program.Op] = [_program.Op("start", "io")]  # holds what is gathered before the step
        self.pending: set[str] = set()  # collectives issued and not yet waited
        self.held: set[str] = set()  # buffers allocated and not yet released

    def compute(self, seconds: float) -> None:
        self.ops.append(_program.Op(f"compute_{len(self.ops)}", "compute", cost=seconds))

    def issue(self, key: str, kind: str, pg: str, seconds: float, nbytes: int) -> None:
        """A ``kind`` collective into a new buffer ``key`` (its name too: a wait names it) of ``nbytes`` (what
        it moves), with the backend's scratch until its wait."""
        allocs = [(key, nbytes)]
        if scratch := self.scratch(kind, nbytes):
            allocs.append((("scratch", key), scratch))
        self.ops.append(_program.Op(key, "collective", cost=seconds, allocs=allocs, pg=pg))
        self.pending.add(key)
        self.held.add(key)
        if self.blocking:
            self.wait(key)

    def wait(self, key: str) -> None:
        """Wait for ``key`` (once: a blocking program has waited at the issue; its buffer stays held)."""
        if key in self.pending:
            self.ops.append(_program.Op(f"wait_{key}", "wait", coll=key, uses=[("scratch", key)]))
            self.pending.discard(key)

    def alloc(self, key: str, nbytes: int) -> None:
        """A buffer held from the start (gathered in forward and kept)."""
        self.ops[0].allocs.append((key, nbytes))
        self.held.add(key)

    def release(self, key: str) -> None:
        """``key`` is freed after the last op written so far."""
        self.ops[-1].uses.append(key)
        self.held.discard(key)

    def result(self) -> dict:
        self.ops.append(_program.Op("end", "io", uses=sorted(self.held)))  # what is never released lives to the end
        step, busy, _ = _program.run(self.ops, self.issue_overhead)
        return {"step_s": step, "exposed_s": step - busy, "comm_peak_bytes": max(_program.timeline(self.ops))}


def _anchors(units: Sequence[Unit], order: Sequence[int], attr: str) -> dict[int, list[int]]:
    """Position in ``order`` -> the units whose all-gather is issued there, in ``order``."""
    position = {u: k for k, u in enumerate(order)}
    out: dict[int, list[int]] = {}
    for i in order:
        anchor = getattr(units[i], attr)
        k = position[anchor] if 0 <= anchor < len(units) and position[anchor] <= position[i] else position[i]
        out.setdefault(k, []).append(i)
    return out


def _run_forward(units: Sequence[Unit], c: UnitCosts, s: _Program) -> dict:
    order = list(range(len(units)))
    issues = _anchors(units, order, "issue_at")
    for i in order:
        for j in issues.get(i, []):
            s.issue(f"ag{j}", "all_gather", c.pg[j], c.ag[j], units[j].all_gather_bytes)
        s.wait(f"ag{i}")
        s.compute(c.fwd[i])
        if units[i].regathers and not units[i].tail:
            s.release(f"ag{i}")  # resharded after its forward
    s.compute(c.fwd_tail)
    return s.result()


def _run_backward(units: Sequence[Unit], c: UnitCosts, s: _Program) -> dict:
    order = backward_order(units)
    for i, u in enumerate(units):  # kept unsharded since forward
        if not u.regathers:
            s.alloc(f"ag{i}", u.all_gather_bytes)
    issues = _anchors([u if u.regathers else dataclasses.replace(u, backward_issue_at=-1) for u in units], order,
                      "backward_issue_at")
    early = [i for i in order if units[i].tail and not c.late[i]]  # a head apart from its leading parameters
    reduced = early + [i for i in order if not units[i].tail] + [i for i in order if units[i].tail and c.late[i]]
    reduced = [i for i in reduced if units[i].reduce_scatter_bytes]
    rank = {j: k for k, j in enumerate(reduced)}
    waits_before: dict[int, list[int]] = {}  # reduce-scatter k waits for these earlier ones first
    for j in reduced:
        if units[j].sink:
            waits_before.setdefault(rank[j] + units[j].sink, []).append(j)

    def reduce_scatter(i: int) -> None:
        for j in waits_before.get(rank[i], []):
            s.wait(f"rs{j}")
            s.release(f"rs{j}")
        s.issue(f"rs{i}", "reduce_scatter", c.pg[i], c.rs[i], units[i].reduce_scatter_bytes)
        if units[i].sink == 0:
            s.wait(f"rs{i}")
            s.release(f"rs{i}")

    def head() -> None:  # the head's backward: every tail unit is gathered by now
        s.compute(c.bwd_head)
        for i in early:
            s.release(f"ag{i}")
            if units[i].reduce_scatter_bytes:
                reduce_scatter(i)

    head_done = False
    for k, i in enumerate(order):
        if not units[i].tail and not head_done:
            head()
            head_done = True
        for j in issues.get(k, []):
            if units[j].regathers:
                s.issue(f"ag{j}", "all_gather", c.pg[j], c.ag[j], units[j].all_gather_bytes)
        if units[i].regathers:
            s.wait(f"ag{i}")
        if units[i].tail:
            continue
        s.compute(c.bwd[i])
        s.release(f"ag{i}")
        if units[i].reduce_scatter_bytes:
            reduce_scatter(i)
    if not head_done:
        head()
    for i in order:
        if units[i].tail and c.late[i]:
            s.release(f"ag{i}")
            if units[i].reduce_scatter_bytes:
                reduce_scatter(i)
    for i in reduced:  # what is still pending is waited at the end
        if f"rs{i}" in s.held:
            s.wait(f"rs{i}")
            s.release(f"rs{i}")
    return s.result()


def predict(
    units: Sequence[Unit], modules: Sequence[Module], cost_model: CostModel, workload: int, *, blocking: bool = False,
    memo: dict | None = None,
) -> dict:
    """``{"forward" | "backward": {"step_s", "exposed_s", "comm_peak_bytes"}}`` of ``units`` on the program.
    ``blocking``: every collective is waited as soon as it is issued, its buffer released where ``units`` say
    (eager FSDP2 on CPU: no streams, so its collectives are synchronous and the backend's scratch is freed at
    once; its reduce-scatter input is still kept until the next reduce-scatter). ``memo``: ``unit_costs``'."""
    c = unit_costs(units, {m.fqn: m for m in modules}, cost_model, workload, memo)
    p = cost_model.profile
    return {"forward": _run_forward(units, c, _Program(p, blocking)), "backward": _run_backward(units, c, _Program(p, blocking))}


def step_s(pred: dict) -> float:
    """A prediction's step: forward plus backward."""
    return pred["forward"]["step_s"] + pred["backward"]["step_s"]


def peak_bytes(pred: dict) -> int:
    """A prediction's ``comm_peak_bytes``: the larger of forward's and backward's."""
    return max(pred["forward"]["comm_peak_bytes"], pred["backward"]["comm_peak_bytes"])
