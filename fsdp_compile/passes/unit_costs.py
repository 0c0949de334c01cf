"""Per-unit costs for the planner: seconds of all-gather, reduce-scatter and compute per schedule unit,
from the rank-invariant ``Module`` numbers alone (the planner runs before any graph exists).

**The model the plan is made on** (``predict``): the forward runs the units in order, each module's compute after its
unit's all-gather, except the tail units of modules that hold other FSDP modules (the root), whose compute
(an output head, say) comes last; the backward runs it in reverse, the head first. A tail unit holding the
module's leading parameters (an embedding: the root gathered whole) is reduced at the end of the backward,
where their gradients are done; one without them right after the head's backward. Compute is estimated from each
module's matrix-product weights (2 FLOPs per weight element per token forward, 4 backward) at the
profile's matmul rate, plus the profile's per-op overhead for a few ops per parameter; communication by
the profile's alpha-beta model on the exact bytes. Attention's token-squared work and memory-bound ops
are not counted: the plan needs the ratio of compute to communication per module about right, no more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fsdp_compile.passes.cost_model import CostModel
from fsdp_compile.passes.schedule import Module, Unit


@dataclasses.dataclass(frozen=True)
class UnitCosts:
    ag: tuple[float, ...]  # per unit: all-gather seconds
    rs: tuple[float, ...]  # per unit: reduce-scatter seconds (0: none)
    fwd: tuple[float, ...]  # per unit: forward compute right after its all-gather
    fwd_tail: float  # forward compute at the end (modules holding other modules)
    bwd: tuple[float, ...]  # per unit: backward compute
    bwd_head: float  # backward compute at the start (the tail's)
    pg: tuple[str, ...]
    late: tuple[bool, ...]  # per unit: a tail whose reduce-scatter waits for the end (it holds leading parameters)
    # per unit: replicated, not sharded (FSDP2's ``replicate``: a shard group of one rank, replicas beside it): no
    # all-gather (its parameters are the parameters), and its gradients' collective is an all-reduce in place,
    # whose buffer becomes the gradients
    replicated: tuple[bool, ...]


def unit_costs(
    units: Sequence[Unit], modules: dict[str, Module], cm: CostModel, workload: int, memo: dict | None = None
) -> UnitCosts:
    """``units``' costs at ``workload`` tokens per step (see the module docstring). A unit's costs do not
    depend on where the schedule issues it: ``memo`` (a dict kept by the caller for one model, cost model
    and workload) holds them per unit across calls."""
    ag, rs, fwd, bwd, pg, late, replicated = [], [], [], [], [], [], []
    tail = head = 0.0
    for u in units:
        key = (u.members, u.params, u.all_gather_bytes, u.reduce_scatter_bytes, u.tail)
        one = memo.get(key) if memo is not None else None
        if one is None:
            one = _one_unit(u, modules, cm, workload)
            if memo is not None:
                memo[key] = one
        u_ag, u_rs, own_f, own_b, tails, u_pg, u_late, u_rep = one
        ag.append(u_ag)
        rs.append(u_rs)
        for f, b in tails:  # summed in the order of units and members, as ever
            tail, head = tail + f, head + b
        fwd.append(own_f)
        bwd.append(own_b)
        pg.append(u_pg)
        late.append(u_late)
        replicated.append(u_rep)
    return UnitCosts(tuple(ag), tuple(rs), tuple(fwd), tail, tuple(bwd), head, tuple(pg), tuple(late), tuple(replicated))


def _one_unit(u: Unit, modules: dict[str, Module], cm: CostModel, workload: int) -> tuple:
    """``(all-gather s, reduce-scatter s, forward s, backward s, ((tail forward s, head backward s) per
    member held to the end), process group, late, replicated)`` of one unit."""
    p = cm.profile
    ms = [modules[f] for f in u.members]
    ws = ms[0].world_size
    ag = cm.collective_time("all_gather", u.all_gather_bytes, ws)
    rs = cm.collective_time("reduce_scatter", u.reduce_scatter_bytes, ws) if u.reduce_scatter_bytes else 0.0
    if u.reduce_scatter_bytes and ms[0].replicate_size > 1:  # HSDP: then the reduced shard across replicas
        rs += cm.collective_time("all_reduce", u.reduce_scatter_bytes // ws, ms[0].replicate_size)
    own_f = own_b = 0.0
    late = False
    tails = []
    for m in ms:
        idx = [i for i, name in enumerate(m.params) if u.params is None or name in u.params]
        late = late or (u.tail and any(m.params[i] in m.leading for i in idx))
        flops = workload * sum(m.flops_per_token[i] for i in idx)  # forward; backward: twice (dX and dW)
        rate = p.matmul_flops_lowp if m.lowp else p.matmul_flops_fp32
        f = flops / rate + 4 * len(idx) * p.op_overhead
        b = 2 * flops / rate + 8 * len(idx) * p.op_overhead
        if m.holds_children and u.tail:
            tails.append((f, b))
        else:
            own_f, own_b = own_f + f, own_b + b
    return ag, rs, own_f, own_b, tuple(tails), ms[0].process_group, late, ws == 1 and ms[0].replicate_size > 1
