"""The planner's prediction of a schedule: its units run on the program ``unit_costs`` describes, timed by
the event simulator's rules (``_program.run``: compute, and communication per process group, first in,
first out) with the gathered parameters and reduce-scatter buffers alive at each point (``_program.
timeline``). The two differ only in what they are fed: per-unit estimates here, per-node costs there
(``tests/test_passes_predict.py`` measures the gap). ``_Machine`` applies those rules op by op as the
program is written, with no op list (``record=True`` keeps one, so that a test can check it against
``_program.run`` and ``timeline``), and the program is written in segments, one per unit in each
direction's order, so that the planner's search (``search.Search``) can judge a change to one unit by
simulating only from the first segment the change touches until the simulation's state meets the current
schedule's again.

**Memory** (``comm_peak_bytes``): the gathered parameters and reduce-scatter buffers alive at once, with
what the communication backend allocates for each collective in flight (``HardwareProfile.
collective_scratch``: gloo copies a reduce-scatter's input), the part of the peak a schedule controls
(activations, sharded state and gradients are the same under every schedule). A replicated unit (FSDP2's
``replicate``) gathers nothing, its parameters being the parameters, and its all-reduce's buffer becomes
its gradients, held to the end, as eager ``replicate`` holds them. The budget defaults to what eager FSDP2
holds on the same program (one module at a time, the next prefetched in backward, one reduce-scatter
pending; on a CPU profile every collective waited as it is issued, as eager FSDP2 runs them without
streams); ``CompileConfig.memory_budget_gb`` sets it. A plan that cannot meet it even without prefetching
is an error naming the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

from fsdp_compile.passes import _program
from fsdp_compile.passes.cost_model import CostModel, HardwareProfile
from fsdp_compile.passes.schedule import Module, Unit, backward_order
from fsdp_compile.passes.unit_costs import UnitCosts, unit_costs


def _ag(i: int) -> int:  # a unit's all-gather buffer
    return 2 * i


def _rs(i: int) -> int:  # a unit's reduce-scatter buffer
    return 2 * i + 1


class _Machine:
    """One compute stream, one FIFO stream per process group, a collective's launch on the compute stream
    (``_program.run``'s rules), and the bytes live while each op runs (``_program.timeline``'s), applied as
    each op is written. Only the gathered parameters, reduce-scatter buffers and the backend's scratch for
    collectives in flight are allocated, so the peak is ``comm_peak_bytes``. A buffer is freed after the
    op written last when it is released, the backend's scratch after its collective's wait; what is never
    released lives to the end."""

    def __init__(self, profile: HardwareProfile, blocking: bool, record: bool = False):
        self.overhead = profile.op_overhead
        self.comm_share = profile.comm_cpu_share
        self.scratch = profile.scratch_bytes
        self.blocking = blocking  # every collective waited as it is issued
        self.nbytes: dict[int, int] = {}  # buffer -> bytes (a buffer has the same bytes in every schedule)
        self.t = self.busy = 0.0  # compute stream: now, and busy so far
        self.free: dict[str, float] = {}  # process group -> when its stream is done
        self.pending: dict[int, tuple[float, float, int]] = {}  # collective issued, not waited -> (start, end, scratch)
        self.rs_held: frozenset[int] = frozenset()  # reduce-scatter buffers not yet released
        self.live = self.peak = 0
        self.ops: list[_program.Op] | None = [_program.Op("start", "io")] if record else None
        self.held: set[int] = set()  # record: buffers allocated and not yet released

    def state(self) -> tuple:
        """What decides the rest of a run: (now, busy so far, streams, pending collectives, held buffers,
        bytes live)."""
        return (self.t, self.busy, dict(self.free), dict(self.pending), self.rs_held, self.live)

    def _op(self, **kw) -> None:
        self.ops.append(_program.Op(f"op{len(self.ops)}", **kw))

    def compute(self, seconds: float) -> None:
        self.t += seconds
        self.busy += seconds
        self.peak = max(self.peak, self.live)
        if self.ops is not None:
            self._op(kind="compute", cost=seconds)

    def issue(self, key: int, kind: str, pg: str, seconds: float, nbytes: int) -> None:
        """A ``kind`` collective into buffer ``key`` of ``nbytes`` (what it moves), with the backend's scratch
        until its wait."""
        scratch = self.scratch(kind, nbytes)
        self.nbytes[key] = nbytes
        self.live += nbytes + scratch
        self.peak = max(self.peak, self.live)
        self.t += self.overhead
        self.busy += self.overhead
        start = max(self.t, self.free.get(pg, 0.0))
        self.free[pg] = start + seconds
        self.pending[key] = (start, start + seconds, scratch)
        if key & 1:
            self.rs_held = self.rs_held | {key}
        if self.ops is not None:
            allocs = [(key, nbytes)] + ([(("scratch", key), scratch)] if scratch else [])
            self.ops.append(_program.Op(f"c{key}", "collective", cost=seconds, allocs=allocs, pg=pg))
            self.held.add(key)
        if self.blocking:
            self.wait(key)

    def wait(self, key: int) -> None:
        """Wait for ``key`` (once: a blocking program has waited at the issue; its buffer stays held)."""
        if key in self.pending:
            start, end, scratch = self.pending.pop(key)
            self.peak = max(self.peak, self.live)
            charge = self.comm_share * max(0.0, min(end, self.t) - start)  # ``_program.run``'s charge
            self.t += charge
            self.busy += charge
            self.t = max(self.t, end)
            self.live -= scratch
            if self.ops is not None:
                self._op(kind="wait", coll=f"c{key}", uses=[("scratch", key)])

    def alloc(self, key: int, nbytes: int) -> None:
        """A buffer held from the start (gathered in forward and kept): before any op is written."""
        self.nbytes[key] = nbytes
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        if self.ops is not None:
            self.ops[0].allocs.append((key, nbytes))
            self.held.add(key)

    def release(self, key: int) -> None:
        """``key`` is freed after the last op written so far."""
        self.live -= self.nbytes[key]
        if key & 1:
            self.rs_held = self.rs_held - {key}
        if self.ops is not None:
            self.ops[-1].uses.append(key)
            self.held.discard(key)

    def settle(self, key: int) -> None:
        """Reduce buffer ``key``, waited, is the gradients from now on: no longer held for release, live to the end."""
        self.rs_held = self.rs_held - {key}

    def result(self) -> dict:
        step = max([self.t, *self.free.values()])
        if self.ops is not None:
            self.ops.append(_program.Op("end", "io", uses=sorted(self.held)))  # what is never released lives to the end
        return {"step_s": step, "exposed_s": step - self.busy, "comm_peak_bytes": self.peak}


def _anchors(order: Sequence[int], anchors: Sequence[int]) -> tuple[dict[int, list[int]], dict[int, int]]:
    """Where each unit's all-gather is issued, given the unit it is issued at (``anchors``, by unit; one that
    is no earlier unit in ``order`` means just in time): position in ``order`` -> the units issued there,
    in ``order``; and unit -> its position."""
    position = {u: k for k, u in enumerate(order)}
    issues: dict[int, list[int]] = {}
    at: dict[int, int] = {}
    for i in order:
        anchor = anchors[i]
        k = position[anchor] if 0 <= anchor < len(anchors) and position[anchor] <= position[i] else position[i]
        issues.setdefault(k, []).append(i)
        at[i] = k
    return issues, at


class _Forward:
    """The forward: segment ``i`` issues the all-gathers anchored at unit ``i``, waits for unit ``i``'s and
    runs its compute; the last segment runs the compute of the modules that hold others."""

    def __init__(self, units: Sequence[Unit], c: UnitCosts):
        self.units, self.c = units, c
        self.issues, self.issued_at = _anchors(range(len(units)), [u.issue_at for u in units])
        self.segments = len(units) + 1

    def start(self, m: _Machine) -> None:
        pass

    def segment(self, m: _Machine, k: int) -> None:
        units, c = self.units, self.c
        if k == len(units):
            m.compute(c.fwd_tail)
            return
        for j in self.issues.get(k, ()):
            if not c.replicated[j]:
                m.issue(_ag(j), "all_gather", c.pg[j], c.ag[j], units[j].all_gather_bytes)
        m.wait(_ag(k))
        m.compute(c.fwd[k])
        if units[k].regathers and not units[k].tail and not c.replicated[k]:
            m.release(_ag(k))  # resharded after its forward

    def touched(self, i: int, other: _Forward) -> tuple[int, int]:
        """The first and last segments whose ops differ from ``other``'s, which differs in unit ``i`` only."""
        at = (self.issued_at[i], other.issued_at[i])
        return min(at), max(at)


class _Backward:
    """The backward, in ``backward_order``: segment ``k`` (the head's backward first, at the first unit that
    is not a tail) issues the re-gathers anchored there, waits for its unit's, runs its compute and
    reduce-scatters it, first waiting for the reduce-scatters its turn sinks; the last segment reduces
    the late tails and waits for what is still pending."""

    def __init__(self, units: Sequence[Unit], c: UnitCosts):
        self.units, self.c = units, c
        self.order = order = backward_order(units)
        self.position = {i: k for k, i in enumerate(order)}
        self.issues, self.issued_at = _anchors(order, [u.backward_issue_at if u.regathers else -1 for u in units])
        self.early = [i for i in order if units[i].tail and not c.late[i]]  # a head apart from its leading parameters
        reduced = self.early + [i for i in order if not units[i].tail] + [i for i in order if units[i].tail and c.late[i]]
        self.reduced = [i for i in reduced if units[i].reduce_scatter_bytes]
        self.rank = {j: k for k, j in enumerate(self.reduced)}
        self.waits_before: dict[int, list[int]] = {}  # reduce-scatter k waits for these earlier ones first
        for j in self.reduced:
            if units[j].sink:
                self.waits_before.setdefault(self.rank[j] + units[j].sink, []).append(j)
        self.head_at = next((k for k, i in enumerate(order) if not units[i].tail), len(order))
        self.segments = len(order) + 1

    def start(self, m: _Machine) -> None:
        for i, u in enumerate(self.units):  # kept unsharded since forward
            if not u.regathers and not self.c.replicated[i]:
                m.alloc(_ag(i), u.all_gather_bytes)

    def _resharded(self, m: _Machine, i: int) -> None:
        if not self.c.replicated[i]:
            m.release(_ag(i))

    def _reduced(self, m: _Machine, i: int) -> None:
        """Wait for unit ``i``'s reduction: a reduce-scatter's buffer is freed; a replicated unit's all-reduce
        buffer is its gradients from then on (FSDP2's ``replicate`` reduces in place and keeps views of it)."""
        m.wait(_rs(i))
        if self.c.replicated[i]:
            m.settle(_rs(i))
        else:
            m.release(_rs(i))

    def _reduce_scatter(self, m: _Machine, i: int) -> None:
        for j in self.waits_before.get(self.rank[i], ()):
            self._reduced(m, j)
        kind = "all_reduce" if self.c.replicated[i] else "reduce_scatter"
        m.issue(_rs(i), kind, self.c.pg[i], self.c.rs[i], self.units[i].reduce_scatter_bytes)
        if self.units[i].sink == 0:
            self._reduced(m, i)

    def _head(self, m: _Machine) -> None:  # the head's backward: every tail unit is gathered by now
        m.compute(self.c.bwd_head)
        for i in self.early:
            self._resharded(m, i)
            if self.units[i].reduce_scatter_bytes:
                self._reduce_scatter(m, i)

    def segment(self, m: _Machine, k: int) -> None:
        units = self.units
        if k == self.head_at:
            self._head(m)
        if k == len(self.order):
            for i in self.order:  # blocks merged into a tail unit (a whole root and its first blocks): their backward
                if units[i].tail and self.c.bwd[i]:  # comes last, before the tail's late reduction (was left out)
                    m.compute(self.c.bwd[i])
            for i in self.order:
                if units[i].tail and self.c.late[i]:
                    self._resharded(m, i)
                    if units[i].reduce_scatter_bytes:
                        self._reduce_scatter(m, i)
            for i in self.reduced:  # what is still pending is waited at the end
                if _rs(i) in m.rs_held:
                    self._reduced(m, i)
            return
        for j in self.issues.get(k, ()):
            if units[j].regathers and not self.c.replicated[j]:
                m.issue(_ag(j), "all_gather", self.c.pg[j], self.c.ag[j], units[j].all_gather_bytes)
        i = self.order[k]
        if units[i].regathers:
            m.wait(_ag(i))
        if units[i].tail:
            return
        m.compute(self.c.bwd[i])
        self._resharded(m, i)
        if units[i].reduce_scatter_bytes:
            self._reduce_scatter(m, i)

    def _reduced_in(self, i: int) -> int:
        """The segment that reduce-scatters unit ``i``."""
        if self.units[i].tail:
            return self.head_at if i in self.early else len(self.order)
        return self.position[i]

    def _sinks_in(self, i: int) -> int:
        """The segment that waits for unit ``i``'s reduce-scatter, sunk ``sink`` reduce-scatters deep."""
        r = self.rank[i] + self.units[i].sink
        return self._reduced_in(self.reduced[r]) if r < len(self.reduced) else len(self.order)

    def touched(self, i: int, other: _Backward) -> tuple[int, int]:
        """The first and last segments whose ops differ from ``other``'s, which differs in unit ``i`` only."""
        at = [self.issued_at[i], other.issued_at[i]]
        if i in self.rank:
            at += [self._reduced_in(i), self._sinks_in(i), other._sinks_in(i)]
        return min(at), max(at)


def _run(program, profile: HardwareProfile, blocking: bool, record: bool = False) -> tuple[dict, _Machine]:
    m = _Machine(profile, blocking, record)
    program.start(m)
    for k in range(program.segments):
        program.segment(m, k)
    return m.result(), m


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
    return {"forward": _run(_Forward(units, c), p, blocking)[0], "backward": _run(_Backward(units, c), p, blocking)[0]}


def step_s(pred: dict) -> float:
    """A prediction's step: forward plus backward."""
    return pred["forward"]["step_s"] + pred["backward"]["step_s"]


def peak_bytes(pred: dict) -> int:
    """A prediction's ``comm_peak_bytes``: the larger of forward's and backward's."""
    return max(pred["forward"]["comm_peak_bytes"], pred["backward"]["comm_peak_bytes"])
