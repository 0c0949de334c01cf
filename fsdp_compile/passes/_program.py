"""A graph lowered to a flat list of ``Op``s: what ``simulate`` times and ``memory`` measures.

Both public analyses run on this form so that the bucketing planner can evaluate a candidate bucket by
editing the list (cheap) instead of copying and rewriting the FX graph (expensive), and get the same
answer ``simulate`` / ``peak_memory`` give for the rewritten graph.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from fsdp_compile.passes import predicates as P


@dataclasses.dataclass
class CollInfo:
    kind: str
    process_group: str
    fsdp_groups: list[str]
    bytes: int
    world_size: int
    wait: str | None


@dataclasses.dataclass
class Op:
    name: str
    kind: str  # "compute" | "collective" | "wait" | "io"
    cost: float = 0.0  # compute: seconds on the compute stream; collective: duration on its stream
    allocs: list = dataclasses.field(default_factory=list)  # [(storage key, bytes)] first allocated here
    uses: list = dataclasses.field(default_factory=list)  # storage keys kept alive through this op
    pinned: bool = False  # allocs live from the first op to the last (graph inputs)
    pg: str | None = None  # collective: process group name
    coll: str | None = None  # wait: its collective's op name
    info: CollInfo | None = None  # collective: what the schedule reports


def _key(t: torch.Tensor):
    try:
        return StorageWeakRef(t.untyped_storage())
    except Exception:  # noqa: BLE001 - tensors without storage: one key each
        return ("tensor", id(t))


def _nbytes(t: torch.Tensor) -> int:
    try:
        return P._hint(t.untyped_storage().nbytes())
    except Exception:  # noqa: BLE001
        return P.tensor_bytes(t)


def storage_keys(graph: fx.Graph) -> tuple[dict[fx.Node, list], dict[object, int]]:
    """Storage keys per node (aliases share keys) and bytes per key; see ``memory``'s docstring."""
    keys: dict[fx.Node, list] = {}
    nbytes: dict[object, int] = {}
    alias: dict[object, object] = {}  # a wait's fake storage -> its collective's
    for n in graph.nodes:
        if P.is_wait(n) and isinstance(n.args[0], fx.Node):
            # wait_tensor returns its input; its fake value has a storage of its own, which views of the
            # wait's result share: map it to the collective's
            ks = list(keys.get(n.args[0], []))
            own = P.val_tensors(n.meta.get("val"))
            if own and len(ks) == 1:
                alias[_key(own[0])] = ks[0]
        else:
            tensors = P.val_tensors(n.meta.get("val"))
            if tensors:
                ks = {}  # insertion-ordered and deduplicated in O(1): a graph's output holds every saved tensor
                for t in tensors:
                    k = _key(t)
                    k = alias.get(k, k)
                    if k not in ks:
                        ks[k] = None
                        nbytes.setdefault(k, _nbytes(t))
                ks = list(ks)
            elif "val" not in n.meta and P.is_view(n) and n.all_input_nodes:
                ks = list(keys.get(n.all_input_nodes[0], []))
            else:
                ks = []
        keys[n] = ks
    return keys, nbytes


def lower(graph: fx.Graph, cost_model=None) -> list[Op]:
    """One ``Op`` per node, in order; costs, and the backend's scratch for each collective (allocated at the
    collective, used by its wait: ``HardwareProfile.collective_scratch``), only when ``cost_model`` is given."""
    keys, nbytes = storage_keys(graph)
    seen: set = set()
    ops = []
    for n in graph.nodes:
        own = keys[n]
        allocs = [(k, nbytes[k]) for k in own if k not in seen]
        seen.update(own)
        uses = list(own)
        for a in n.all_input_nodes:
            uses.extend(keys.get(a, ()))
        op = Op(name=n.name, kind="compute", allocs=allocs, uses=uses, pinned=n.op == "placeholder")
        if P.is_collective(n):
            wait = P.wait_of(n)
            op.kind, op.pg = "collective", P.process_group_name(n)
            op.info = CollInfo(
                kind=P.collective_kind(n),
                process_group=op.pg,
                fsdp_groups=list(P.fsdp_groups(n)),
                bytes=P.collective_bytes(n),
                world_size=P.world_size(n),
                wait=wait.name if wait is not None else None,
            )
            if cost_model is not None:
                op.cost = cost_model.collective_node_time(n)
                if scratch := cost_model.profile.scratch_bytes(op.info.kind, op.info.bytes):
                    op.allocs.append((("scratch", n.name), scratch))
        elif P.is_wait(n):
            coll = P.collective_of(n)
            op.kind = "wait"
            op.coll = coll.name if coll is not None else None
            if coll is not None:
                uses.append(("scratch", coll.name))  # the backend's scratch lives until the wait
            for a in coll.all_input_nodes if coll is not None else ():
                uses.extend(keys.get(a, ()))  # the library reads a collective's input until its wait
        elif n.op != "call_function":
            op.kind = "io"
        elif cost_model is not None:
            op.cost = cost_model.node_time(n)
        ops.append(op)
    return ops


def timeline(ops: list[Op]) -> list[int]:
    """Bytes live while each op runs (allocated at or before it, last used at or after it)."""
    last_use: dict[object, int] = {}
    for i, op in enumerate(ops):
        for k in op.uses:
            last_use[k] = i
    end = len(ops) - 1
    delta = [0] * (len(ops) + 1)
    for i, op in enumerate(ops):
        for k, b in op.allocs:
            start, stop = (0, end) if op.pinned else (i, max(i, last_use.get(k, i)))
            delta[start] += b
            delta[stop + 1] -= b
    out, live = [], 0
    for d in delta[:-1]:
        live += d
        out.append(live)
    return out


@dataclasses.dataclass
class CollTiming:
    op: Op
    issue: float
    start: float
    end: float
    wait_at: float | None = None
    exposed: float = 0.0


def run(ops: list[Op], issue_overhead: float, comm_cpu_share: float = 0.0) -> tuple[float, float, list[CollTiming]]:
    """``(step time, compute-stream busy time, per-collective timings)``; rules in ``simulate``'s docstring.
    At each wait, ``comm_cpu_share`` (``HardwareProfile.comm_cpu_share``) of the time the collective ran beside
    the compute stream (from its start to the earlier of its end and the wait) is charged to the compute stream."""
    t = busy = 0.0
    free: dict[str, float] = {}
    timings: dict[str, CollTiming] = {}
    for op in ops:
        if op.kind == "collective":
            t += issue_overhead
            busy += issue_overhead
            start = max(t, free.get(op.pg, 0.0))
            free[op.pg] = start + op.cost
            timings[op.name] = CollTiming(op, issue=t, start=start, end=start + op.cost)
        elif op.kind == "wait":
            ct = timings.get(op.coll)
            if ct is not None and ct.wait_at is None:
                ct.wait_at = t
                charge = comm_cpu_share * max(0.0, min(ct.end, t) - ct.start)  # what it took from the compute beside it
                t += charge
                busy += charge
                ct.exposed = max(0.0, ct.end - t)
                t = max(t, ct.end)
        else:
            t += op.cost
            busy += op.cost
    for ct in timings.values():
        if ct.wait_at is None:
            ct.exposed = max(0.0, ct.end - t)
    return max([t, *free.values()]), busy, list(timings.values())
