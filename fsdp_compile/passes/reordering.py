"""Reordering: apply a schedule's prefetches and deferred waits to one graph.

After placement every collective sits where FSDP2's hooks issue it and is waited at once::

    [copy-in j, AG j, wait j, copy-out j] compute j [copy-in i, AG i, wait i, copy-out i] compute i

``apply_schedule`` then, for every unit the schedule (``schedule.Schedule``) prefetches, moves its
all-gather with the copy-in that feeds it to just before the wait of the unit it is anchored at::

    [copy-in j, AG j, copy-in i, AG i, wait j, copy-out j] compute j (hides AG i) [wait i, copy-out i] compute i

and for every reduce-scatter with ``sink = s`` moves its wait, and the unpack that reads it, to just
before the s-th later reduce-scatter (after its pack), or to the end of the graph. A unit of a one-rank group
(``replicate``, FSDP2's DDP) has no reduce-scatter: its gradients' all-reduce takes its place (HSDP's
all-reduce follows its unit's reduce-scatter, which stays the unit's).

Every move is named by the schedule's units, which every rank holds identically, and anchored at other
collectives, whose relative order is the graph's structure, so every rank issues the same collectives
in the same order, whatever its shapes. A move that would carry a collective, a wait, a graph input or
a side effect along is not made (on every rank alike). Numerics are unchanged: only positions change.
"""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from fsdp_compile.passes import predicates as P
from fsdp_compile.passes.schedule import Schedule, backward_order


@dataclasses.dataclass(frozen=True)
class Move:
    """One move made: plain data (the report renders it)."""

    kind: str  # "prefetch" (an all-gather and its copy-in issued earlier) | "sink_wait" (a wait and its readers later)
    unit: int  # the schedule's unit
    node: str  # the collective (prefetch) or wait (sink_wait) whose chain moved
    anchor: str  # the chain now sits right before this node
    was: str  # ... and used to be followed by this one


def _units(graph: fx.Graph, pred) -> dict[int, fx.Node]:
    return {P.fsdp_unit(n): n for n in graph.nodes if pred(n) and P.fsdp_unit(n) is not None}


def _reductions(graph: fx.Graph, gradient_side: set[fx.Node]) -> dict[int, fx.Node]:
    """Each unit's gradient collective: its reduce-scatter, else (a one-rank group) its all-reduce on the
    gradient side (the annotation's kind does not say: AOTAutograd copies the unshard's onto the backward)."""
    out = _units(graph, P.is_reduce_scatter)
    for n in graph.nodes:
        if P.collective_kind(n) == "all_reduce" and n in gradient_side and P.fsdp_unit(n) is not None:
            out.setdefault(P.fsdp_unit(n), n)
    return out


def _chain(start: fx.Node, step, inside) -> list[fx.Node] | None:
    """``start`` and the nodes reachable through ``step`` while ``inside``, in program order; None if one
    of them may not move (``predicates.is_fixed``)."""
    chain, seen, stack = [], set(), [start]
    while stack:
        n = stack.pop()
        if n in seen or not inside(n):
            continue
        seen.add(n)
        if n is not start and (P.is_fixed(n) or n.op == "output"):
            return None
        chain.append(n)
        stack.extend(step(n))
    return sorted(chain)  # fx.Node's < is program order


def _after(chain: list[fx.Node]) -> fx.Node:
    """The first node after the chain's last one that is not in the chain."""
    members, n = set(chain), chain[-1].next
    while n in members:
        n = n.next
    return n


def _move_before(chain: list[fx.Node], anchor: fx.Node) -> None:
    for n in chain:
        anchor.prepend(n)


def apply_schedule(graph: fx.Graph, schedule: Schedule) -> list[Move]:
    """Move, in place, this graph's collectives to the schedule's points; returns the moves made.

    Nodes compare by program order (``fx.Node``'s ``<``, which every move keeps up to date), so the pass is
    linear in the graph plus the chains it moves, with no position map rebuilt per unit."""
    moves: list[Move] = []
    units = schedule.units
    gathers = _units(graph, P.is_all_gather)
    gradient_side = P.gradient_dependent(graph)
    backward = bool(gradient_side)
    if backward:
        order = [i for i in backward_order(units) if i in gathers]
        start = next(n for n in graph.nodes if n.op != "placeholder")
        first = backward_order(units)[0] if units else None

        def anchor_of(i: int) -> fx.Node | None:
            j = units[i].backward_issue_at
            if j in gathers and j != i:
                return P.wait_of(gathers[j])
            return start if j == first and j != i else None
    else:
        order = sorted(gathers)

        def anchor_of(i: int) -> fx.Node | None:
            j = units[i].issue_at
            return P.wait_of(gathers[j]) if j in gathers and j != i else None

    for i in order:  # in issue order: units anchored at the same point stay in order
        anchor = anchor_of(i)
        ag = gathers[i]
        if anchor is None:
            continue
        if anchor > ag:
            continue
        chain = _chain(ag, lambda n: n.all_input_nodes, lambda n: n > anchor)
        if chain:
            was = _after(chain)
            _move_before(chain, anchor)
            moves.append(Move("prefetch", i, ag.name, anchor.name, was.name))

    scatters = _reductions(graph, gradient_side)
    seq = sorted(scatters, key=scatters.__getitem__)
    output = graph.output_node()
    for k, c in enumerate(seq):
        sink = units[c].sink
        wait = P.wait_of(scatters[c])
        if sink <= 0 or wait is None:
            continue
        target = scatters[seq[k + sink]] if k + sink < len(seq) else output
        if target < wait:
            continue
        chain = _chain(wait, lambda n: n.users, lambda n: n < target)
        if chain:
            was = _after(chain)
            _move_before(chain, target)
            moves.append(Move("sink_wait", c, wait.name, target.name, was.name))
    graph.lint()
    return moves
