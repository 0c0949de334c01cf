"""Every graph rewrite and estimate of fsdp_compile, one per file, each a function of graph + policy.

On the joint graph (AOTAutograd's partition function, or Inductor's ``joint_custom_pre_pass``):

* ``recompute.tag_unshard_recompute(graph, reshard)``: ``reshard_after_forward=True`` groups re-gather in backward (an int: over the post-forward group).

Once per compiled model, before the first trace (``planner.py``, predicting with ``predict.py`` on the costs
of ``unit_costs.py``)::

    schedule = plan_schedule(modules_of(sharding_plan), policy=config.bucket, reorder=config.reorder,
                             cost_model=cm, workload=agreed_tokens)   # units (buckets), prefetch, sinks

The capture issues one all-gather per unit, so bucketing needs no graph rewrite. On each partitioned
forward / backward graph, in this order (``pipeline.run_passes``, which the backend calls)::

    place_collectives(graph)                       # placement.py: where FSDP2's hooks issue them
    apply_schedule(graph, schedule)                # reordering.py: the schedule's prefetches and sinks -> Moves
    pin_collective_order(gm)                       # pin_order.py: Inductor only, when something moved
    simulate(graph, cm); peak_memory(graph)        # simulate.py, memory.py: the report's estimates

The schedule is a function of rank-invariant data only, and every move is named by it and anchored at
other collectives, so all ranks issue the same collectives in the same order whatever their shapes. The
passes read graphs, the schedule and the annotation of ``fsdp_compile._annotations`` only: no module
here imports ``ops``, ``capture``, ``backend``, ``debug`` or ``_api``.

Entry points re-exported here:

* ``plan_schedule`` (``planner.py``), ``modules_of``, ``Schedule``, ``Unit``, ``Module`` (``schedule.py``);
  ``apply_schedule`` and ``Move`` (``reordering.py``).
* ``simulate(graph, cost_model="auto") -> Simulation``: predicted step time, exposed communication, and
  per-collective start / end / hidden / exposed times (``Simulation.to_dict()`` / ``to_json()``).
* ``peak_memory(graph) -> (bytes, node)`` and ``memory_timeline(graph) -> list[int]``: live bytes under the
  model documented in ``memory.py`` (graph inputs count as live throughout).
* ``CostModel(profile)``, ``cost_model_for(hardware, graph)``, ``HardwareProfile``, ``LinkProfile``,
  ``PROFILES`` (``h100-nvlink``, ``h100-ib``, ``cpu-gloo``), ``get_profile``, ``resolve_hardware``.
* ``place_collectives``, ``tag_unshard_recompute``, ``pin_collective_order``, ``run_passes``.
* ``predicates``: the node predicates every pass shares (``is_all_gather``, ``wait_of``, ``fsdp_group``,
  ``is_view``, ``is_fixed``, ...).
"""

from fsdp_compile.passes import predicates
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
from fsdp_compile.passes.pin_order import pin_collective_order
from fsdp_compile.passes.pipeline import PassRecord, run_passes
from fsdp_compile.passes.placement import place_collectives
from fsdp_compile.passes.recompute import tag_unshard_recompute
from fsdp_compile.passes.reordering import Move, apply_schedule
from fsdp_compile.passes.planner import plan_schedule
from fsdp_compile.passes.schedule import Module, Schedule, Unit, modules_of
from fsdp_compile.passes.simulate import CollectiveTiming, Simulation, simulate

__all__ = [
    "PROFILES",
    "CollectiveTiming",
    "CostModel",
    "HardwareProfile",
    "LinkProfile",
    "Module",
    "Move",
    "PassRecord",
    "Schedule",
    "Simulation",
    "Unit",
    "apply_schedule",
    "cost_model_for",
    "get_profile",
    "memory_timeline",
    "peak_memory",
    "pin_collective_order",
    "modules_of",
    "place_collectives",
    "plan_schedule",
    "predicates",
    "resolve_hardware",
    "run_passes",
    "simulate",
    "tag_unshard_recompute",
]
