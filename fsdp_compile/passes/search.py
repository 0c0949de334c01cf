"""The planner's search (``planner._search``) judges thousands of schedules that each differ from the current
one in one unit: ``Search`` predicts each as ``predict`` would, simulating only the segments the change
touches, from the first until the simulation's state meets the current schedule's again (``_meets``), with
the current schedule's states kept per segment and shifted in time where an accepted change moves them
(``_Shifts``). Predictions equal ``predict``'s to a trillionth (``tests/test_passes_schedule.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fsdp_compile.passes.cost_model import CostModel, HardwareProfile
from fsdp_compile.passes.predict import _Backward, _Forward, _Machine
from fsdp_compile.passes.schedule import Module, Unit
from fsdp_compile.passes.unit_costs import unit_costs


class _Shifts:
    """Times added to every segment from some segment on (a Fenwick tree over segments): accepting a change
    shifts the current schedule's states after the point where the new one meets them, without rewriting
    them."""

    def __init__(self, n: int):
        self.tree = [(0.0, 0.0)] * (n + 1)

    def add(self, k: int, dt: float, dbusy: float) -> None:
        """Segments ``k`` and later run ``dt`` later, with ``dbusy`` more busy time before them."""
        k += 1
        while k < len(self.tree):
            t, b = self.tree[k]
            self.tree[k] = (t + dt, b + dbusy)
            k += k & -k

    def at(self, k: int) -> tuple[float, float]:
        t = b = 0.0
        k += 1
        while k:
            dt, db = self.tree[k]
            t, b = t + dt, b + db
            k -= k & -k
        return t, b


class _Direction:
    """One direction of the current schedule for ``Search``: the simulation's state at the start of every
    segment (``states``, its times less ``shifts``), the most bytes live in each segment, and the result."""

    def __init__(self, program, profile: HardwareProfile):
        self.profile = profile
        self.nbytes: dict[int, int] = {}  # shared by every machine: a buffer has the same bytes in every schedule
        m = self._machine()
        program.start(m)
        self.start_peak = m.peak
        self.states: list[tuple] = []
        self.peaks: list[int] = []  # the most bytes live in each segment
        self.shifts = _Shifts(program.segments)
        self._run(m, program, 0, None)

    def _machine(self) -> _Machine:
        m = _Machine(self.profile, False)
        m.nbytes = self.nbytes
        return m

    def _resume(self, k: int) -> _Machine:
        """A machine in the state the current schedule is in at the start of segment ``k``."""
        t, busy, free, pending, rs_held, live = self.states[k]
        dt, dbusy = self.shifts.at(k)
        m = self._machine()
        m.t, m.busy, m.rs_held, m.live = t + dt, busy + dbusy, rs_held, live
        m.free = {pg: v + dt for pg, v in free.items()}
        m.pending = {key: (start + dt, end + dt, scratch) for key, (start, end, scratch) in pending.items()}
        m.peak = max(self.start_peak, max(self.peaks[:k])) if k else self.start_peak
        return m

    def _meet(self, m: _Machine, k: int, hi: int | None) -> tuple[float, float] | None:
        """Where ``m`` (at the start of segment ``k``, past ``hi``, the last segment whose ops differ) meets the
        current schedule (``_meets``; stored states compare as they are: a shift in time cancels out): the
        time and busy time it runs ahead of it."""
        if hi is None or k <= hi or not _meets(m, self.states[k]):
            return None
        t, busy = self.states[k][:2]
        dt, dbusy = self.shifts.at(k)
        return m.t - (t + dt), m.busy - (busy + dbusy)

    def _run(self, m: _Machine, program, lo: int, hi: int | None) -> None:
        """``program`` becomes current, ``m`` at the start of its segment ``lo``: its states are recorded up to
        the segment where it meets the current schedule past ``hi``; from there the current ones, shifted."""
        states, peaks = [], []
        for k in range(lo, program.segments):
            ahead = self._meet(m, k, hi)
            if ahead is not None:
                self._record(lo, states, peaks, k)
                self.shifts.add(k, *ahead)
                result, busy = self.end
                step = result["step_s"] + ahead[0]
                busy += ahead[1]
                self.end = ({"step_s": step, "exposed_s": step - busy, "comm_peak_bytes": max(m.peak, self.after[k])}, busy)
                self.program = program
                return
            dt, dbusy = self.shifts.at(k) if k < len(self.states) else (0.0, 0.0)
            t, busy, free, pending, rs_held, live = m.t, m.busy, m.free, m.pending, m.rs_held, m.live
            states.append((t - dt, busy - dbusy, {pg: v - dt for pg, v in free.items()},
                           {key: (start - dt, end - dt, scratch) for key, (start, end, scratch) in pending.items()},
                           rs_held, live))
            before, m.peak = m.peak, m.live
            program.segment(m, k)
            peaks.append(m.peak)
            m.peak = max(before, m.peak)
        self._record(lo, states, peaks, program.segments)
        self.end = (m.result(), m.busy)
        self.program = program

    def _record(self, lo: int, states: list, peaks: list, k: int) -> None:
        """Segments ``lo`` to ``k`` (exclusive) recorded anew; the most bytes live from each segment on."""
        self.states[lo:k] = states
        self.peaks[lo:k] = peaks
        if k == len(self.peaks):
            self.after = self.peaks[:]
            k = len(self.peaks) - 1
        for j in reversed(range(k)):
            self.after[j] = max(self.peaks[j], self.after[j + 1])

    def trial(self, program, i: int) -> tuple[dict, tuple[int, int]]:
        """``program``'s result, where it differs from the current one in unit ``i`` only: simulated from the
        first segment the change touches until the state meets the current schedule's at a segment past the
        last one it touches (from there on it runs the same ops, shifted in time); and the segments to
        ``accept`` it from and past."""
        lo, hi = program.touched(i, self.program)
        m = self._resume(lo)
        for k in range(lo, program.segments):
            ahead = self._meet(m, k, hi)
            if ahead is not None:
                result, busy = self.end
                step = result["step_s"] + ahead[0]
                return {"step_s": step, "exposed_s": step - (busy + ahead[1]),
                        "comm_peak_bytes": max(m.peak, self.after[k])}, (lo, hi)
            program.segment(m, k)
        return m.result(), (lo, hi)

    def accept(self, program, touched: tuple[int, int]) -> None:
        lo, hi = touched
        self._run(self._resume(lo), program, lo, hi)


def _meets(m: _Machine, state: tuple) -> bool:
    """Whether ``m`` is in ``state`` up to a shift in time: the same bytes live and buffers held, the same
    collectives pending, each ending as long after now and (where the profile charges it at the wait,
    ``HardwareProfile.comm_cpu_share``) having run as long beside compute so far (to a trillionth), each
    stream free as long after now (0: free already)."""
    t, _, free, pending, rs_held, live = state
    if m.live != live or m.rs_held != rs_held or m.pending.keys() != pending.keys():
        return False
    tol = 1e-12 * max(t, m.t)
    for key, (start, end, scratch) in m.pending.items():
        other_start, other, other_scratch = pending[key]
        if scratch != other_scratch or abs(max(0.0, end - m.t) - max(0.0, other - t)) > tol:
            return False
        if m.comm_share and abs(max(0.0, min(end, m.t) - start) - max(0.0, min(other, t) - other_start)) > tol:
            return False
    for pg in m.free.keys() | free.keys():
        if abs(max(0.0, m.free.get(pg, 0.0) - m.t) - max(0.0, free.get(pg, 0.0) - t)) > tol:
            return False
    return True


class Search:
    """Predictions for the planner's search (``planner._search``), which judges schedules that differ from
    the current one in one unit's ``issue_at`` (the forward), ``backward_issue_at`` or ``sink`` (the
    backward): each direction a change touches is simulated only from the first segment the change
    touches until its state meets the current schedule's (``_Direction.trial``), and an accepted one is made
    current the same way, so a search over n units costs about n short simulations instead of n whole ones
    (Llama-3 70B at W=64 with ``bucket="none"``, 723 units: 280 s -> 2.9 s). Predictions equal ``predict``'s
    to a trillionth (``tests/test_passes_schedule.py``)."""

    def __init__(self, units: Sequence[Unit], modules: Sequence[Module], cost_model: CostModel, workload: int,
                 memo: dict | None = None):
        self.units = list(units)
        self.c = unit_costs(units, {m.fqn: m for m in modules}, cost_model, workload, memo)
        p = cost_model.profile
        self.forward = _Direction(_Forward(self.units, self.c), p)
        self.backward = _Direction(_Backward(self.units, self.c), p)
        self._pending: tuple | None = None

    def current(self) -> dict:
        return {"forward": self.forward.end[0], "backward": self.backward.end[0]}

    def trial(self, i: int, unit: Unit) -> dict:
        """The prediction of the current units with unit ``i`` replaced by ``unit`` (its costs the same);
        ``accept`` makes it current."""
        old = self.units[i]
        if dataclasses.replace(unit, issue_at=old.issue_at, backward_issue_at=old.backward_issue_at, sink=old.sink) != old:
            raise ValueError(f"Search judges changes of issue_at, backward_issue_at and sink only, not {unit} for {old}")
        units = list(self.units)
        units[i] = unit
        pred, changes = self.current(), []
        if unit.issue_at != old.issue_at:
            program = _Forward(units, self.c)
            pred["forward"], touched = self.forward.trial(program, i)
            changes.append((self.forward, program, touched))
        if (unit.backward_issue_at, unit.sink) != (old.backward_issue_at, old.sink):
            program = _Backward(units, self.c)
            pred["backward"], touched = self.backward.trial(program, i)
            changes.append((self.backward, program, touched))
        self._pending = (units, changes)
        return pred

    def accept(self) -> None:
        """The last ``trial`` becomes the current schedule."""
        self.units, changes = self._pending
        for direction, program, touched in changes:
            direction.accept(program, touched)
        self._pending = None
