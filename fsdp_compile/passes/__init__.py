"""Every graph rewrite and estimate of fsdp_compile, one per file, each a function of graph + policy.

On the joint graph (AOTAutograd's partition function, or Inductor's ``joint_custom_pre_pass``):

* ``recompute.tag_unshard_recompute(graph, reshard)``: ``reshard_after_forward=True`` groups re-gather in backward.

On each partitioned forward / backward graph, in this order (``pipeline.run_passes``, which the backend calls)::

    place_collectives(graph)                       # placement.py: where FSDP2's hooks issue them
    cm = cost_model_for(config.hardware, graph)    # cost_model.py
    budget = default_memory_budget(graph)          # memory.py: eager FSDP2's predicted peak (or the config's)
    buckets = plan_buckets(graph, config.bucket, bucket_cap_mb=..., memory_budget_bytes=budget, cost_model=cm)
    apply_buckets(graph, buckets)                  # bucketing.py (the rewrite itself: _bucket_rewrite.py)
    reorder(graph, cm, memory_budget_bytes=budget) # reordering.py: prefetch all-gathers, sink waits -> Moves
    pin_collective_order(gm)                       # pin_order.py: Inductor only, when something moved
    simulate(graph, cm); peak_memory(graph)        # simulate.py, memory.py: the report's estimates

Every decision is a function of the graph and the configuration (never of local timing), so all ranks
rewrite their identical graphs identically and issue the same collectives in the same order. The passes
read graphs and the annotation of ``fsdp_compile._annotations`` only: no module here imports ``ops``,
``capture``, ``backend``, ``debug`` or ``_api``.

Entry points re-exported here:

* ``plan_buckets(graph, policy="auto", *, kinds=("all_gather", "reduce_scatter"), bucket_cap_mb=None,
  memory_budget_bytes=None, cost_model="auto", known_groups=None) -> list[list[fx.Node]]`` and
  ``apply_buckets(gm, plan) -> list[fx.Node]``; ``bucket_groups(plan)`` names each bucket's FSDP modules;
  ``default_memory_budget(graph)`` is eager FSDP2's predicted peak (the ``memory_budget_gb=None`` default).
* ``simulate(graph, cost_model="auto") -> Schedule``: predicted step time, exposed communication, and
  per-collective start / end / hidden / exposed times (``Schedule.to_dict()`` / ``to_json()``).
* ``peak_memory(graph) -> (bytes, node)`` and ``memory_timeline(graph) -> list[int]``: live bytes under the
  model documented in ``memory.py`` (graph inputs count as live throughout).
* ``CostModel(profile)``, ``cost_model_for(hardware, graph)``, ``HardwareProfile``, ``LinkProfile``,
  ``PROFILES`` (``h100-nvlink``, ``h100-ib``, ``cpu-gloo``), ``get_profile``, ``resolve_hardware``.
* ``reorder(gm, cost_model="auto", *, memory_budget_bytes=None, prefetch=True, sink_waits=True)
  -> ReorderResult``: its ``moves`` are ``Move`` records (kind, node, anchor, was, predicted step and peak).
* ``place_collectives``, ``tag_unshard_recompute``, ``pin_collective_order``, ``run_passes``.
* ``predicates``: the node predicates every pass shares (``is_all_gather``, ``wait_of``, ``fsdp_group``,
  ``is_view``, ``is_fixed``, ...).
"""

from fsdp_compile.passes import predicates
from fsdp_compile.passes.bucketing import apply_buckets, bucket_groups, plan_buckets
from fsdp_compile.passes.cost_model import (
    PROFILES,
    CostModel,
    HardwareProfile,
    LinkProfile,
    cost_model_for,
    get_profile,
    resolve_hardware,
)
from fsdp_compile.passes.memory import default_memory_budget, memory_timeline, peak_memory
from fsdp_compile.passes.pin_order import pin_collective_order
from fsdp_compile.passes.pipeline import PassRecord, run_passes
from fsdp_compile.passes.placement import place_collectives
from fsdp_compile.passes.recompute import tag_unshard_recompute
from fsdp_compile.passes.reordering import Move, ReorderResult, reorder
from fsdp_compile.passes.simulate import CollectiveTiming, Schedule, simulate

__all__ = [
    "PROFILES",
    "CollectiveTiming",
    "CostModel",
    "HardwareProfile",
    "LinkProfile",
    "Move",
    "PassRecord",
    "ReorderResult",
    "Schedule",
    "apply_buckets",
    "bucket_groups",
    "cost_model_for",
    "default_memory_budget",
    "get_profile",
    "memory_timeline",
    "peak_memory",
    "pin_collective_order",
    "place_collectives",
    "plan_buckets",
    "predicates",
    "reorder",
    "resolve_hardware",
    "run_passes",
    "simulate",
    "tag_unshard_recompute",
]
