"""Replay a graph on a model machine: one compute stream, one communication stream per process group.

Nodes run in program order. The rules:

* a compute node occupies the compute stream for ``cost_model.node_time(node)``;
* a collective is issued by the compute stream (costing it ``op_overhead``, the launch); it starts when
  it is issued, its inputs are ready and its process group's stream has finished the previous collective,
  and runs for ``cost_model.collective_node_time``; different process groups run concurrently;
* ``wait_tensor`` blocks the compute stream until its collective ends. The time it blocks is the
  collective's *exposed* time; the rest of its duration overlapped compute (*hidden*). Where the
  collective's work runs on the compute stream's processor (gloo's threads on a CPU:
  ``HardwareProfile.comm_cpu_share``), that share of the time it ran beside compute (from its start to
  the earlier of its end and the wait) is charged to the compute stream at the wait, before it blocks:
  hidden communication still slows compute, exposed communication costs its duration and no more;
* the step ends when the compute stream and every communication stream are done.

Example (``tests/test_passes_simulate.py``)::

    ag1 -> mm0 (hides ag1) -> wait ag1 -> mm1

``ag1`` runs alongside ``mm0``; if it is longer, the wait exposes the difference.
The result is plain data (``Simulation.to_dict()`` is JSON-serializable) naming nodes and FSDP groups.
"""

from __future__ import annotations

import dataclasses
import json

import torch.fx as fx

from fsdp_compile.passes import _program
from fsdp_compile.passes.cost_model import CostModel, HardwareProfile, cost_model_for


@dataclasses.dataclass
class CollectiveTiming:
    name: str  # the collective's node name
    wait: str | None  # its wait_tensor's node name
    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce" | ...
    process_group: str
    fsdp_groups: list[str]  # FSDP module FQNs it serves (several for a bucket; empty if not FSDP's)
    bytes: int  # collective_bytes
    world_size: int
    issue: float  # seconds from the step's start: issued by the compute stream
    start: float  # began on its process group's stream
    end: float
    wait_at: float | None  # when the compute stream reached the wait
    duration: float
    exposed: float  # compute-stream stall at the wait
    hidden: float  # duration - exposed, at least 0

    @property
    def fsdp_group(self) -> str | None:
        return self.fsdp_groups[0] if self.fsdp_groups else None


@dataclasses.dataclass
class Simulation:
    step_time: float  # seconds: compute stream and all communication streams done
    compute_time: float  # seconds the compute stream is busy (including collective launches)
    comm_time: float  # sum of collective durations
    exposed_comm_time: float  # seconds the compute stream stalls on waits (+ communication after compute)
    hardware: str
    collectives: list[CollectiveTiming]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)


def simulate(graph: fx.Graph | fx.GraphModule, cost_model: CostModel | HardwareProfile | str = "auto") -> Simulation:
    """Predicted time of one execution of ``graph`` in node order (see the module docstring)."""
    if isinstance(graph, fx.GraphModule):
        graph = graph.graph
    cm = cost_model_for(cost_model, graph)
    return schedule_of(_program.lower(graph, cm), cm)


def schedule_of(ops: list[_program.Op], cm: CostModel) -> Simulation:
    step, busy, timings = _program.run(ops, cm.profile.op_overhead, cm.profile.comm_cpu_share)
    colls = []
    for ct in timings:
        info = ct.op.info
        colls.append(
            CollectiveTiming(
                name=ct.op.name,
                wait=info.wait,
                kind=info.kind,
                process_group=info.process_group,
                fsdp_groups=list(info.fsdp_groups),
                bytes=info.bytes,
                world_size=info.world_size,
                issue=ct.issue,
                start=ct.start,
                end=ct.end,
                wait_at=ct.wait_at,
                duration=ct.op.cost,
                exposed=ct.exposed,
                hidden=max(0.0, ct.op.cost - ct.exposed),
            )
        )
    return Simulation(
        step_time=step,
        compute_time=busy,
        comm_time=sum(c.duration for c in colls),
        exposed_comm_time=step - busy,
        hardware=cm.profile.name,
        collectives=colls,
    )
