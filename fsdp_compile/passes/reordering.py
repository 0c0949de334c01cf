"""Reordering: prefetch all-gathers and sink reduce-scatter waits, within a memory budget.

The capture issues every collective where FSDP2's hooks would and waits for it at once (see
``placement.place_collectives``), so no communication overlaps compute. This pass, run after bucketing:

1. **prefetches all-gathers**: each all-gather (with the copy-in nodes that feed it) moves up past the
   compute before it, as early as the memory budget allows, but never above the previous all-gather:
   all-gathers keep their order, so ``ag1 -> mm0 -> wait ag1`` becomes
   ``ag1 -> ag2 -> mm0 -> wait ag1 -> mm1 (hides ag2) -> wait ag2``. Its wait stays before its first use;
2. **sinks reduce-scatter waits**: each reduce-scatter's wait (with the unpack nodes that read it) moves
   down, as late as the budget allows (the reduce-scatter's input stays alive until its wait), but never
   below the next reduce-scatter's wait: the reduce-scatter then overlaps the compute that follows it.

A move is kept only if the simulated step (``simulate``) gets faster. Memory is ``memory.peak_memory``'s
model; the budget defaults to the input graph's peak (the pass never raises it).

Collectives of one kind keep their order; an all-gather may move above a reduce-scatter (FSDP2 itself
issues the next block's all-gather before the current block's reduce-scatter in backward). Every decision
is a function of the graph and the arguments, so all ranks reorder their identical graphs identically.
Numerics are unchanged: only the positions of nodes change, never what they compute.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from fsdp_compile.passes import _program
from fsdp_compile.passes import predicates as P
from fsdp_compile.passes.cost_model import CostModel, HardwareProfile, cost_model_for


@dataclasses.dataclass(frozen=True)
class Move:
    """One kept move: plain data (the report renders it)."""

    kind: str  # "prefetch" (an all-gather and its copy-in issued earlier) | "sink_wait" (a wait and its readers later)
    node: str  # the collective (prefetch) or wait (sink_wait) whose chain moved
    anchor: str  # the chain now sits right before this node (prefetch) or right after it (sink_wait)
    was: str  # ... and used to sit right before (prefetch) / after (sink_wait) this one
    step_before: float  # simulated step, seconds: why the move was kept (it got faster ...)
    step_after: float
    peak_after: int  # ... and the predicted peak stayed within the budget (bytes)


@dataclasses.dataclass
class ReorderResult:
    moves: list[Move]
    step_before: float  # simulated seconds
    step_after: float
    peak_before: int  # bytes, memory.peak_memory
    peak_after: int
    memory_budget: int


def _move(ops: list[_program.Op], names: list[str], before: str | None, after: str | None = None) -> list[_program.Op]:
    """``ops`` with the ops named ``names`` (in their order) moved right before ``before`` / after ``after``."""
    moving = set(names)
    picked = [op for op in ops if op.name in moving]
    out = []
    for op in ops:
        if op.name == before:
            out.extend(picked)
        if op.name not in moving:
            out.append(op)
        if op.name == after:
            out.extend(picked)
    return out


class _Reorderer:
    def __init__(self, graph: fx.Graph, cm: CostModel, budget: int | None):
        self.graph, self.cm = graph, cm
        self.ops = _program.lower(self.graph, cm)
        self.step, self.peak = self.evaluate(self.ops)
        self.budget = self.peak if budget is None else budget
        self.moves: list[Move] = []

    def evaluate(self, ops) -> tuple[float, int]:
        return _program.run(ops, self.cm.profile.op_overhead)[0], max(_program.timeline(ops), default=0)

    def positions(self) -> dict[fx.Node, int]:
        return {n: i for i, n in enumerate(self.graph.nodes)}

    def try_moves(self, candidates: list[tuple[list[fx.Node], fx.Node | None, fx.Node | None]], kind: str) -> bool:
        """Apply the most aggressive candidate move (nodes, before, after) within the budget, if it is faster.

        ``candidates`` run from the most to the least aggressive; a binary search finds the first one within
        the budget (memory grows monotonically with the distance moved). It is kept only if the simulated
        step gets faster; otherwise nothing moves.
        """
        def ops_of(c):
            nodes, before, after = c
            return _move(self.ops, [n.name for n in nodes], before.name if before else None, after.name if after else None)

        lo, hi = 0, len(candidates)  # first index whose peak fits
        cache = {}
        while lo < hi:
            mid = (lo + hi) // 2
            cache[mid] = ops_of(candidates[mid])
            _, peak = self.evaluate(cache[mid])
            if peak <= self.budget:
                hi = mid
            else:
                lo = mid + 1
        if lo == len(candidates):
            return False
        ops = cache.get(lo) or ops_of(candidates[lo])
        step, peak = self.evaluate(ops)
        if not step < self.step:
            return False
        nodes, before, after = candidates[lo]
        old = nodes[-1].next if kind == "prefetch" else nodes[0].prev
        if before is not None:
            for n in nodes:
                before.prepend(n)
        else:
            anchor = after
            for n in nodes:
                anchor.append(n)
                anchor = n
        lead = nodes[-1] if kind == "prefetch" else nodes[0]
        anchor = before if before is not None else after
        self.moves.append(Move(kind, lead.name, anchor.name, old.name, self.step, step, peak))
        self.ops, self.step, self.peak = ops, step, peak
        return True

    def prefetch_all_gathers(self) -> None:
        ags = P.collectives(self.graph, "all_gather")
        for i, ag in enumerate(ags):
            pos = self.positions()
            nodes = list(self.graph.nodes)
            placeholders = [pos[n] for n in self.graph.find_nodes(op="placeholder")]
            floor = pos[ags[i - 1]] if i else max(placeholders, default=-1)
            # ag's producers after the floor: they move with it; a wait or collective among them is a wall
            chain, wall = self._closure(ag, lambda n: n.all_input_nodes, lambda n: pos[n] > floor)
            first = min(pos[n] for n in chain)
            lowest = max([floor, *(pos[n] for n in wall)]) + 1
            candidates = []  # earliest first
            for p in range(lowest, first):
                candidates.append(([n for n in chain if pos[n] >= p], nodes[p], None))
            self.try_moves(candidates, "prefetch")

    def sink_reduce_scatter_waits(self) -> None:
        rss = P.collectives(self.graph, "reduce_scatter")
        for i, rs in enumerate(rss):
            wait = P.wait_of(rs)
            if wait is None:
                continue
            pos = self.positions()
            nodes = list(self.graph.nodes)
            nxt = P.wait_of(rss[i + 1]) if i + 1 < len(rss) else None
            ceiling = pos[nxt] if nxt is not None else len(nodes) - 1  # the next wait, or the output node
            # the wait's readers before the ceiling move with it; a collective or wait among them is a wall
            chain, wall = self._closure(wait, lambda n: n.users, lambda n: pos[n] < ceiling)
            highest = min([ceiling, *(pos[n] for n in wall)]) - 1
            members = set(chain)
            candidates = []  # latest first
            for p in range(highest, pos[wait], -1):
                if nodes[p] not in members:
                    candidates.append(([n for n in chain if pos[n] <= p], None, nodes[p]))
            self.try_moves(candidates, "sink_wait")

    def _closure(self, start: fx.Node, step, inside) -> tuple[list[fx.Node], list[fx.Node]]:
        """Nodes reachable from ``start`` through ``step`` while ``inside``: (movable ones in order, walls)."""
        pos = self.positions()
        chain, wall, seen, stack = [], [], set(), [start]
        while stack:
            n = stack.pop()
            if n in seen or not inside(n):
                continue
            seen.add(n)
            if n is not start and P.is_fixed(n):
                wall.append(n)
                continue
            chain.append(n)
            stack.extend(step(n))
        return sorted(chain, key=pos.__getitem__), wall


def reorder(
    gm: fx.GraphModule | fx.Graph,
    cost_model: CostModel | HardwareProfile | str = "auto",
    *,
    memory_budget_bytes: int | None = None,
    prefetch: bool = True,
    sink_waits: bool = True,
) -> ReorderResult:
    """Prefetch all-gathers and sink reduce-scatter waits in ``gm`` (in place, recompiled if a
    GraphModule; see the module docstring).

    ``memory_budget_bytes``: the predicted peak (``memory.peak_memory``) must stay under it; ``None``
    means the input graph's predicted peak.
    """
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    cm = cost_model_for(cost_model, graph)
    r = _Reorderer(graph, cm, memory_budget_bytes)
    step0, peak0 = r.step, r.peak
    if r.peak > r.budget:  # nothing to move within a budget the input already exceeds
        return ReorderResult([], step0, step0, peak0, peak0, r.budget)
    if prefetch:
        r.prefetch_all_gathers()
    if sink_waits:
        r.sink_reduce_scatter_waits()
    graph.lint()
    if isinstance(gm, fx.GraphModule):
        gm.recompile()
    return ReorderResult(r.moves, step0, r.step, peak0, r.peak, r.budget)
