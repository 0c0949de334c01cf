"""Compiler passes over AOTAutograd's partitioned forward and backward graphs.

They run on the graphs the backend's forward / backward compilers receive, after
``capture.place_collectives`` (which puts every collective where FSDP2's hooks would issue it), and
before ``make_boxed_func`` (``aot_eager``) or ``compile_fx_inner`` (Inductor)::

    cm = cost_model_for(config.hardware, gm.graph)
    budget = (int(config.memory_budget_gb * 1e9) if config.memory_budget_gb is not None
              else default_memory_budget(gm.graph))      # eager FSDP2's predicted peak; before any rewrite
    buckets = plan_buckets(gm.graph, config.bucket, bucket_cap_mb=config.bucket_cap_mb,
                           memory_budget_bytes=budget, cost_model=cm,
                           known_groups=[g.fqn for g in plan.groups])
    apply_buckets(gm, buckets)                     # edits and recompiles gm
    if config.reorder:
        reorder(gm, cm, memory_budget_bytes=budget)   # prefetch all-gathers, sink reduce-scatter waits
    schedule = simulate(gm, cm)                    # Report.est_step_ms / est_exposed_comm_ms
    peak, _ = peak_memory(gm)                      # Report.est_peak_bytes

(Pass the same ``budget`` to both: each pass defaults to the peak of the graph *it* receives.)

Every decision is a function of the graph and the configuration (never of local timing), so all ranks
rewrite their identical graphs identically and issue the same collectives in the same order.

Entry points:

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
  -> ReorderResult``: prefetch all-gathers and sink reduce-scatter waits, keeping each move only if the
  simulated step gets faster and the predicted peak stays within the budget (default: the input's peak).
* ``predicates``: the node predicates every pass shares (``is_all_gather``, ``wait_of``, ``fsdp_group``, ...).
"""

from fsdp_compile.passes import predicates
from fsdp_compile.passes.bucketing import apply_buckets, bucket_groups, default_memory_budget, plan_buckets
from fsdp_compile.passes.cost_model import (
    PROFILES,
    CostModel,
    HardwareProfile,
    LinkProfile,
    cost_model_for,
    get_profile,
    resolve_hardware,
)
from fsdp_compile.passes.memory import memory_timeline, peak_memory
from fsdp_compile.passes.reordering import ReorderResult, reorder
from fsdp_compile.passes.simulate import CollectiveTiming, Schedule, simulate

__all__ = [
    "PROFILES",
    "CollectiveTiming",
    "CostModel",
    "HardwareProfile",
    "LinkProfile",
    "ReorderResult",
    "Schedule",
    "apply_buckets",
    "bucket_groups",
    "cost_model_for",
    "default_memory_budget",
    "get_profile",
    "memory_timeline",
    "peak_memory",
    "plan_buckets",
    "predicates",
    "reorder",
    "resolve_hardware",
    "simulate",
]
