"""The passes in order on one partitioned forward or backward graph, and the plain-data record of what they did.

    placement  -> bucketing -> reordering -> (Inductor only) order pinning

The backend calls ``run_passes`` from its forward/backward compilers, identically for ``aot_eager`` and
Inductor. Every decision comes from the graph and the config (never from timing), so every rank rewrites
its identical graph identically and the collectives keep one order on all ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch.fx as fx

from fsdp_compile.config import CompileConfig
from fsdp_compile.passes import predicates as P
from fsdp_compile.passes.bucketing import apply_buckets, bucket_groups, plan_buckets
from fsdp_compile.passes.cost_model import cost_model_for
from fsdp_compile.passes.memory import default_memory_budget, peak_memory
from fsdp_compile.passes.pin_order import pin_collective_order
from fsdp_compile.passes.placement import place_collectives
from fsdp_compile.passes.reordering import reorder
from fsdp_compile.passes.simulate import simulate


@dataclasses.dataclass
class PassRecord:
    """What the passes did to one forward or backward graph, and what the cost model predicts."""

    kind: str  # "forward" | "backward"
    index: int  # which compile of that kind (0 for the first)
    hardware: str
    buckets: list[dict]  # {"kind", "groups", "collectives", "bytes"} per bucket, in program order
    moves: list[dict]  # the reordering pass's kept moves (reordering.Move as a dict)
    memory_budget: int  # bytes
    before: dict  # Schedule.to_dict() of the graph as placed (collectives where eager FSDP2 issues them)
    after: dict  # ... after bucketing and reordering
    peak_before: int
    peak_after: int
    peak_node: str | None
    pinned_edges: int  # control dependencies added for Inductor (0 when not pinned)
    stages: list[tuple[str, str]]  # (stage name, readable graph) when a snapshot function was given


def run_passes(
    gm: fx.GraphModule,
    kind: str,
    index: int,
    config: CompileConfig,
    known_groups: Sequence[str],
    *,
    pin_order: bool = False,
    snapshot: Callable[[fx.GraphModule], str] | None = None,
) -> PassRecord:
    """Every pass on ``gm``, in place; ``snapshot(gm)`` (if given) renders each stage for dumps."""
    graph = gm.graph
    place_collectives(graph)
    stages = [("captured", snapshot(gm))] if snapshot else []
    cost = cost_model_for(config.hardware, graph)
    before = simulate(graph, cost)
    peak_before = peak_memory(graph)[0]
    # one budget for both passes, from the graph as placed: eager FSDP2's peak unless the user set one
    budget = (
        int(config.memory_budget_gb * 2**30) if config.memory_budget_gb is not None else default_memory_budget(graph)
    )
    policy = config.bucket if isinstance(config.bucket, str) else [list(b) for b in config.bucket]
    buckets = plan_buckets(
        graph, policy, bucket_cap_mb=config.bucket_cap_mb, memory_budget_bytes=budget, cost_model=cost,
        known_groups=known_groups,
    )
    bucket_rows = [
        {
            "kind": P.collective_kind(b[0]),
            "groups": groups,
            "collectives": [n.name for n in b],
            "bytes": sum(P.collective_bytes(n) for n in b),
        }
        for b, groups in zip(buckets, bucket_groups(buckets))
    ]
    if any(len(b) > 1 for b in buckets):
        apply_buckets(graph, buckets)
        if snapshot:
            stages.append(("bucketed", snapshot(gm)))
    moves = []
    if config.reorder:
        moves = reorder(graph, cost, memory_budget_bytes=budget).moves
        if snapshot:
            stages.append(("reordered", snapshot(gm)))
    after = simulate(graph, cost)
    peak_after, peak_node = peak_memory(graph)
    # Only reordered graphs need pinning; control_deps also keeps Inductor's FX graph cache away.
    pinned = pin_collective_order(gm) if pin_order and moves else 0
    gm.recompile()
    return PassRecord(
        kind=kind, index=index, hardware=cost.profile.name, buckets=bucket_rows,
        moves=[dataclasses.asdict(m) for m in moves], memory_budget=budget, before=before.to_dict(),
        after=after.to_dict(), peak_before=peak_before, peak_after=peak_after,
        peak_node=None if peak_node is None else peak_node.name, pinned_edges=pinned, stages=stages,
    )
