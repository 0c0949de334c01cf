"""The passes in order on one partitioned forward or backward graph, and the plain-data record of what they did.

    placement -> the schedule's prefetches and sinks (reordering)

and, under Inductor only, order pinning (``pin_order.py``), which the backend runs later as Inductor's
post-grad pass, after Inductor's own rewrites.

The backend runs ``run_passes`` on every forward and backward graph, the same for ``aot_eager`` and
Inductor. The schedule was planned once, before the first trace, from rank-invariant data; here it is
only applied, so every rank makes the same moves and the collectives keep one order on all ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch.fx as fx

from fsdp_compile.passes import _program
from fsdp_compile.passes import predicates as P
from fsdp_compile.passes.cost_model import CostModel
from fsdp_compile.passes.memory import peak_of
from fsdp_compile.passes.placement import place_collectives
from fsdp_compile.passes.reordering import apply_schedule
from fsdp_compile.passes.schedule import Schedule
from fsdp_compile.passes.simulate import Simulation, schedule_of


@dataclasses.dataclass
class PassRecord:
    """What the passes did to one forward or backward graph, and what the cost model predicts for it."""

    kind: str  # "forward" | "backward"
    index: int  # which compile of that kind (0 for the first)
    hardware: str
    buckets: list[dict]  # per collective, in program order: {"kind", "unit", "groups", "collectives", "bytes"}
    moves: list[dict]  # reordering.Move as dicts
    comm_budget: int  # the schedule's bound on gathered parameters + reduce-scatter buffers (bytes)
    before: dict  # Simulation.to_dict() of simulate() on the graph as placed (collectives where eager FSDP2 issues them)
    after: dict  # ... after the schedule's moves
    peak_before: int  # memory.peak_memory: predicted peak of the graph as placed
    peak_after: int
    peak_node: str | None
    stages: list[tuple[str, str]]  # (stage name, readable graph) when a snapshot function was given
    # collectives in the graph as compiled: {"all_gathers", "reduce_scatters", "all_reduces"} -> count
    collectives: dict = dataclasses.field(default_factory=dict)
    cached: bool = False  # read back with a compile that Inductor's or AOTAutograd's cache served (backend.py)


def run_passes(
    gm: fx.GraphModule,
    kind: str,
    index: int,
    schedule: Schedule,
    cost_model: CostModel,
    *,
    snapshot: Callable[[fx.GraphModule], str] | None = None,
) -> PassRecord:
    """Every pass on ``gm``, in place; ``snapshot(gm)`` (if given) renders each stage for dumps."""
    graph = gm.graph
    place_collectives(graph)
    stages = [("captured", snapshot(gm))] if snapshot else []
    before, peak = _estimates(graph, cost_model)
    peak_before = peak[0]
    moves = apply_schedule(graph, schedule)
    if snapshot and moves:
        stages.append(("reordered", snapshot(gm)))
    # the schedule only moves nodes, each move listed: without one, the graph is the one estimated above
    after, (peak_after, peak_node) = _estimates(graph, cost_model) if moves else (before, peak)
    buckets = [
        {
            "kind": P.collective_kind(n),
            "unit": P.fsdp_unit(n),
            "groups": list(P.fsdp_groups(n)),
            "collectives": [n.name],
            "bytes": P.collective_bytes(n),
        }
        for n in P.collectives(graph)
        if P.fsdp_meta(n) is not None
    ]
    gm.recompile()
    return PassRecord(
        kind=kind, index=index, hardware=cost_model.profile.name, buckets=buckets,
        moves=[dataclasses.asdict(m) for m in moves], comm_budget=schedule.comm_budget_bytes,
        before=before.to_dict(), after=after.to_dict(), peak_before=peak_before, peak_after=peak_after,
        peak_node=None if peak_node is None else peak_node.name, stages=stages,
        collectives=P.collective_counts(graph.nodes),
    )


def _estimates(graph: fx.Graph, cost_model: CostModel) -> tuple[Simulation, tuple[int, fx.Node | None]]:
    """``simulate`` and ``peak_memory`` of ``graph`` from one lowering (each alone would lower it again)."""
    ops = _program.lower(graph, cost_model)
    return schedule_of(ops, cost_model), peak_of(graph, ops)
