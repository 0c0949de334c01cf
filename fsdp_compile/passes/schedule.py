"""The communication schedule: planned once per compiled model, over FSDP modules, identical on every rank.

A ``Schedule`` is plain data. Its ``units`` are the all-gathers, in forward order: each gathers one or more
FSDP modules (a bucket), or one parameter (``bucket="none"``), and its backward is one reduce-scatter of
the same members. Per unit it says

* ``issue_at``: the unit at whose first use in forward this unit's all-gather is issued (itself: just in
  time; an earlier unit: prefetched, overlapping that unit's compute);
* ``backward_issue_at``: the same for the backward re-gather of a ``reshard_after_forward`` unit, over the
  backward order;
* ``sink``: how many later reduce-scatters are issued before this unit's reduce-scatter is waited for.

The capture issues one ``fsdp_compile::unshard`` per unit (so bucketing needs no graph rewrite), and
``reordering.apply_schedule`` moves each graph's all-gathers and waits to the points named here.

**Rank invariance.** Every input is the same on every rank: the ``ShardingPlan`` (parameter shapes and
dtypes per FSDP module, process groups, mixed precision, ``reshard_after_forward``, FSDP2's prefetch
settings), the config, the hardware profile, and ``workload``, the tokens per step, which the ranks agree
on (their maximum) before the first compiled call. Nothing comes from a rank's own graph, so ranks with
different batch shapes, uneven shards or a recompile of their own all apply the same plan; and since
the plan is a function of what the compile caches key on, a rank that hits a cache and one that misses
it cannot end up with different plans.

**The model it plans on** (``_run``): the forward runs the units in order, each module's compute after its
unit's all-gather, except modules that hold other FSDP modules (the root), whose own compute (an output
head, say) comes last; the backward runs it in reverse, the head first. Compute is estimated from each
module's matrix-product weights (2 FLOPs per weight element per token forward, 4 backward) at the
profile's matmul rate, plus the profile's per-op overhead for a few ops per parameter; communication by
the profile's alpha-beta model on the exact bytes. Attention's token-squared work and memory-bound ops
are not counted: the plan needs the ratio of compute to communication per module about right, no more.
Two streams as in ``simulate``: compute, and communication per process group (first in, first out).

**Memory** (``comm_peak_bytes``): the gathered parameters and reduce-scatter buffers alive at once, the
part of the peak a schedule controls (activations, sharded state and gradients are the same under every
schedule). The budget defaults to what eager FSDP2 holds on the same program (one module at a time, the
next prefetched in backward, one reduce-scatter pending); ``CompileConfig.memory_budget_gb`` sets it. A
plan that cannot meet it even without prefetching is an error naming the numbers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Sequence

import torch

from fsdp_compile._layout import padded_rows
from fsdp_compile.passes.cost_model import CostModel

PREFETCH_DEPTH = 3  # the furthest ahead (in units) an all-gather is ever issued
SINK_DEPTH = 2  # the most reduce-scatters issued before an earlier one is waited for


@dataclasses.dataclass(frozen=True)
class Module:
    """One FSDP module as the planner sees it: rank-invariant numbers only."""

    fqn: str
    key: tuple  # modules with equal keys may share a unit (plan.BucketKey: process group, dtypes, reduction, reshard)
    params: tuple[str, ...]
    param_bytes: tuple[int, ...]  # per parameter: bytes its all-gather moves (padded, in the gather dtype)
    reduce_bytes: tuple[int, ...]  # per parameter: bytes its reduce-scatter takes in (0: frozen)
    flops_per_token: tuple[int, ...]  # per parameter: forward FLOPs per token (2 x numel for matmul weights)
    process_group: str
    world_size: int
    reshard_after_forward: bool
    holds_children: bool  # other FSDP modules live inside it: its own compute comes last in forward
    lowp: bool  # computes in bf16/fp16 (the profile's faster matmul rate)
    replicate_size: int = 1  # HSDP: its reduce-scatter is followed by an all-reduce over this many replicas
    forward_prefetch: tuple[str, ...] = ()  # FSDP2's set_modules_to_forward_prefetch
    backward_prefetch: tuple[str, ...] = ()  # FSDP2's set_modules_to_backward_prefetch


@dataclasses.dataclass(frozen=True)
class Unit:
    """One all-gather in forward, its re-gather in backward (``regathers``) and its reduce-scatter."""

    members: tuple[str, ...]  # FSDP module FQNs, adjacent in forward order
    param: str | None  # bucket="none": the one parameter this unit gathers; None: all the members' parameters
    issue_at: int  # forward: the unit at whose first use this all-gather is issued (own index: just in time)
    backward_issue_at: int  # backward: the unit at whose backward start it is issued (own index: just in time)
    sink: int  # backward: later reduce-scatters issued before this one is waited for (0: waited at once)
    all_gather_bytes: int
    reduce_scatter_bytes: int  # 0: nothing trainable, no reduce-scatter
    regathers: bool  # reshard_after_forward: gathered again in backward
    tail: bool  # holds a module that holds other FSDP modules (the root): needed first in backward, reduced last


@dataclasses.dataclass(frozen=True)
class Schedule:
    units: tuple[Unit, ...]  # forward order
    policy: str  # "none" | "fsdp_group" | "auto" | "explicit"
    workload: int  # tokens per step the plan assumes (the maximum over ranks)
    hardware: str
    comm_budget_bytes: int
    predicted: dict  # "planned" | "as_placed" | "eager_fsdp2" -> "forward" | "backward" -> {step_s, exposed_s, comm_peak_bytes}
    planning_s: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def digest(self) -> str:
        """What every rank must hold identically (the planning time excluded)."""
        d = self.to_dict()
        d.pop("planning_s")
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()

    def backward_order(self) -> list[int]:
        return backward_order(self.units)


def backward_order(units: Sequence[Unit]) -> list[int]:
    """Unit indices in the order the backward needs them: the tail (the root's head) first, then the rest
    in reverse forward order."""
    return [i for i, u in enumerate(units) if u.tail] + [i for i in reversed(range(len(units))) if not units[i].tail]


def modules_of(plan) -> list[Module]:
    """The planner's view of a ``ShardingPlan``'s FSDP modules, in forward (pre-)order."""
    out = []
    for g in plan.groups:
        gather = g.param_dtype or g.params[0].orig_dtype
        param_bytes, reduce_bytes, flops = [], [], []
        for p in g.params:
            padded = padded_rows(p.full_shape[0], g.world_size) * g.world_size * math.prod(p.full_shape[1:])
            param_bytes.append(padded * gather.itemsize)
            reduce_bytes.append(padded * (g.reduce_dtype or p.orig_dtype).itemsize if p.requires_grad else 0)
            flops.append(2 * math.prod(p.full_shape) if p.matmul else 0)
        out.append(Module(
            fqn=g.fqn, key=g.bucket_key(), params=tuple(p.fqn for p in g.params), param_bytes=tuple(param_bytes),
            reduce_bytes=tuple(reduce_bytes), flops_per_token=tuple(flops), process_group=g.group_name,
            world_size=g.world_size, reshard_after_forward=g.reshard_after_forward,
            holds_children=plan.has_fsdp_children(g.fqn), lowp=gather in (torch.bfloat16, torch.float16),
            replicate_size=g.replicate_size,
            forward_prefetch=g.forward_prefetch, backward_prefetch=g.backward_prefetch,
        ))
    return out


# --- costs ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Costs:
    ag: tuple[float, ...]  # per unit: all-gather seconds
    rs: tuple[float, ...]  # per unit: reduce-scatter seconds (0: none)
    fwd: tuple[float, ...]  # per unit: forward compute right after its all-gather
    fwd_tail: float  # forward compute at the end (modules holding other modules)
    bwd: tuple[float, ...]  # per unit: backward compute
    bwd_head: float  # backward compute at the start (the tail's)
    pg: tuple[str, ...]


def _costs(units: Sequence[Unit], modules: dict[str, Module], cm: CostModel, workload: int) -> _Costs:
    p = cm.profile
    ag, rs, fwd, bwd, pg = [], [], [], [], []
    tail = head = 0.0
    for u in units:
        ms = [modules[f] for f in u.members]
        ws = ms[0].world_size
        ag.append(cm.collective_time("all_gather", u.all_gather_bytes, ws))
        rs.append(cm.collective_time("reduce_scatter", u.reduce_scatter_bytes, ws) if u.reduce_scatter_bytes else 0.0)
        if u.reduce_scatter_bytes and ms[0].replicate_size > 1:  # HSDP: then the reduced shard across replicas
            rs[-1] += cm.collective_time("all_reduce", u.reduce_scatter_bytes // ws, ms[0].replicate_size)
        own_f = own_b = 0.0
        for m in ms:
            idx = range(len(m.params)) if u.param is None else [m.params.index(u.param)]
            flops = workload * sum(m.flops_per_token[i] for i in idx)  # forward; backward: twice (dX and dW)
            rate = p.matmul_flops_lowp if m.lowp else p.matmul_flops_fp32
            f = flops / rate + 4 * len(idx) * p.op_overhead
            b = 2 * flops / rate + 8 * len(idx) * p.op_overhead
            if m.holds_children:
                tail, head = tail + f, head + b
            else:
                own_f, own_b = own_f + f, own_b + b
        fwd.append(own_f)
        bwd.append(own_b)
        pg.append(ms[0].process_group)
    return _Costs(tuple(ag), tuple(rs), tuple(fwd), tail, tuple(bwd), head, tuple(pg))


# --- simulation ------------------------------------------------------------------------------------------


class _Streams:
    """The simulator's rules (see ``simulate``): one compute stream, one FIFO stream per process group, and
    the bytes of gathered parameters and reduce-scatter buffers alive."""

    def __init__(self, issue_overhead: float):
        self.t = self.busy = 0.0
        self.free: dict[str, float] = {}
        self.end: dict[object, float] = {}
        self.issue_overhead = issue_overhead
        self.live = self.peak = 0

    def compute(self, seconds: float) -> None:
        self.t += seconds
        self.busy += seconds

    def issue(self, key, pg: str, seconds: float, nbytes: int) -> None:
        self.compute(self.issue_overhead)
        start = max(self.t, self.free.get(pg, 0.0))
        self.free[pg] = self.end[key] = start + seconds
        self.alloc(nbytes)

    def wait(self, key) -> None:
        self.t = max(self.t, self.end.pop(key, 0.0))

    def alloc(self, nbytes: int) -> None:
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def release(self, nbytes: int) -> None:
        self.live -= nbytes

    def result(self) -> dict:
        step = max([self.t, *self.free.values()])
        return {"step_s": step, "exposed_s": step - self.busy, "comm_peak_bytes": self.peak}


def _anchors(units: Sequence[Unit], order: Sequence[int], attr: str) -> dict[int, list[int]]:
    """Position in ``order`` -> the units whose all-gather is issued there, in ``order``."""
    position = {u: k for k, u in enumerate(order)}
    out: dict[int, list[int]] = {}
    for i in order:
        anchor = getattr(units[i], attr)
        k = position[anchor] if 0 <= anchor < len(units) and position[anchor] <= position[i] else position[i]
        out.setdefault(k, []).append(i)
    return out


def _run_forward(units: Sequence[Unit], c: _Costs, overhead: float) -> dict:
    s = _Streams(overhead)
    order = list(range(len(units)))
    issues = _anchors(units, order, "issue_at")
    for i in order:
        for j in issues.get(i, []):
            s.issue(("ag", j), c.pg[j], c.ag[j], units[j].all_gather_bytes)
        s.wait(("ag", i))
        s.compute(c.fwd[i])
        if units[i].regathers and not units[i].tail:
            s.release(units[i].all_gather_bytes)  # resharded after its forward
    s.compute(c.fwd_tail)
    return s.result()


def _run_backward(units: Sequence[Unit], c: _Costs, overhead: float) -> dict:
    s = _Streams(overhead)
    order = backward_order(units)
    for u in units:  # kept unsharded since forward
        if not u.regathers:
            s.alloc(u.all_gather_bytes)
    issues = _anchors([u if u.regathers else dataclasses.replace(u, backward_issue_at=-1) for u in units], order,
                      "backward_issue_at")
    reduced = [i for i in order if not units[i].tail] + [i for i in order if units[i].tail]
    reduced = [i for i in reduced if units[i].reduce_scatter_bytes]
    rank = {j: k for k, j in enumerate(reduced)}
    waits_before: dict[int, list[int]] = {}  # reduce-scatter k waits for these earlier ones first
    for j in reduced:
        if units[j].sink:
            waits_before.setdefault(rank[j] + units[j].sink, []).append(j)

    def reduce_scatter(i: int) -> None:
        for j in waits_before.get(rank[i], []):
            s.wait(("rs", j))
            s.release(units[j].reduce_scatter_bytes)
        s.issue(("rs", i), c.pg[i], c.rs[i], units[i].reduce_scatter_bytes)
        if units[i].sink == 0:
            s.wait(("rs", i))
            s.release(units[i].reduce_scatter_bytes)

    head_done = False
    for k, i in enumerate(order):
        if not units[i].tail and not head_done:
            s.compute(c.bwd_head)  # the head's backward: every tail unit is gathered by now
            head_done = True
        for j in issues.get(k, []):
            if units[j].regathers:
                s.issue(("ag", j), c.pg[j], c.ag[j], units[j].all_gather_bytes)
        if units[i].regathers:
            s.wait(("ag", i))
        if units[i].tail:
            continue
        s.compute(c.bwd[i])
        s.release(units[i].all_gather_bytes)
        if units[i].reduce_scatter_bytes:
            reduce_scatter(i)
    if not head_done:
        s.compute(c.bwd_head)
    for i in order:
        if units[i].tail:
            s.release(units[i].all_gather_bytes)
            if units[i].reduce_scatter_bytes:
                reduce_scatter(i)
    for i in reduced:  # what is still pending is waited at the end
        if ("rs", i) in s.end:
            s.wait(("rs", i))
            s.release(units[i].reduce_scatter_bytes)
    return s.result()


def predict(units: Sequence[Unit], modules: Sequence[Module], cost_model: CostModel, workload: int) -> dict:
    """``{"forward" | "backward": {"step_s", "exposed_s", "comm_peak_bytes"}}`` of ``units`` on the program."""
    c = _costs(units, {m.fqn: m for m in modules}, cost_model, workload)
    overhead = cost_model.profile.op_overhead
    return {"forward": _run_forward(units, c, overhead), "backward": _run_backward(units, c, overhead)}


def _step(pred: dict) -> float:
    return pred["forward"]["step_s"] + pred["backward"]["step_s"]


def _peak(pred: dict) -> int:
    return max(pred["forward"]["comm_peak_bytes"], pred["backward"]["comm_peak_bytes"])


# --- units from a policy ----------------------------------------------------------------------------------


def _unit(members: Sequence[Module], param: str | None = None) -> Unit:
    ag = rs = 0
    for m in members:
        for name, a, r in zip(m.params, m.param_bytes, m.reduce_bytes):
            if param is None or name == param:
                ag, rs = ag + a, rs + r
    return Unit(
        members=tuple(m.fqn for m in members), param=param, issue_at=-1, backward_issue_at=-1, sink=0,
        all_gather_bytes=ag, reduce_scatter_bytes=rs, regathers=members[0].reshard_after_forward,
        tail=any(m.holds_children for m in members),
    )


def _just_in_time(units: Sequence[Unit]) -> list[Unit]:
    return [dataclasses.replace(u, issue_at=i, backward_issue_at=i, sink=0) for i, u in enumerate(units)]


def _explicit_units(modules: Sequence[Module], buckets: Sequence[Sequence[str]]) -> list[Unit]:
    order = [m.fqn for m in modules]
    by_fqn = {m.fqn: m for m in modules}
    where: dict[str, int] = {}
    for b, bucket in enumerate(buckets):
        for fqn in bucket:
            if fqn not in by_fqn:
                raise ValueError(f"bucket plan names {fqn!r}, which is not an FSDP module; FSDP modules: {order}")
            if fqn in where:
                raise ValueError(f"bucket plan names {fqn!r} twice; each FSDP module goes in one bucket")
            where[fqn] = b
    units, done = [], set()
    for m in modules:  # a bucket is gathered where its first member is needed
        b = where.get(m.fqn)
        if b is None:
            units.append(_unit([m]))
        elif b not in done:
            members = [by_fqn[f] for f in sorted(buckets[b], key=order.index)]
            if len({x.key for x in members}) > 1:
                raise ValueError(
                    f"bucket {list(buckets[b])} mixes FSDP modules that cannot share one all-gather: they differ in "
                    f"{_key_difference(members)}; split it (one all-gather is re-gathered in backward or kept, for "
                    "all its modules alike)"
                )
            units.append(_unit(members))
            done.add(b)
    return units


def _key_difference(members: Sequence[Module]) -> str:
    """The fields of the members' keys (``plan.BucketKey``) that differ, with their values."""
    keys = [m.key for m in members]
    names = getattr(keys[0], "_fields", [str(i) for i in range(len(keys[0]))])
    diff = [f"{name} ({' vs '.join(map(str, dict.fromkeys(values)))})"
            for name, *values in zip(names, *keys) if len(set(values)) > 1]
    return ", ".join(diff) or "their sharding"


# --- planning ---------------------------------------------------------------------------------------------


def plan_schedule(
    modules: Sequence[Module],
    *,
    policy: str | Sequence[Sequence[str]],
    reorder: bool,
    cost_model: CostModel,
    workload: int,
    bucket_cap_bytes: int | None = None,
    memory_budget_bytes: float | None = None,
) -> Schedule:
    """The schedule for ``modules`` (forward order). Deterministic: equal inputs give equal schedules."""
    t0 = time.perf_counter()
    workload = max(1, int(workload))

    def ev(units):
        return predict(units, modules, cost_model, workload)

    eager_pred = ev(eager_fsdp2(modules))
    budget = memory_budget_bytes if memory_budget_bytes is not None else _peak(eager_pred)
    if isinstance(policy, str):
        if policy == "none":
            units = [_unit([m], p) for m in modules for p in m.params]
        elif policy in ("fsdp_group", "auto"):
            units = [_unit([m]) for m in modules]
        else:
            raise ValueError(f"bucket policy must be 'none', 'fsdp_group', 'auto' or a list of lists of FQNs, got {policy!r}")
    else:
        units = _explicit_units(modules, policy)
    units = _just_in_time(units)
    if bucket_cap_bytes is not None:
        for u in units:
            if len(u.members) > 1 and u.all_gather_bytes > bucket_cap_bytes:
                raise ValueError(
                    f"bucket {list(u.members)} gathers {u.all_gather_bytes / 2**20:.2f} MiB, over bucket_cap_mb="
                    f"{bucket_cap_bytes / 2**20:g}; raise the cap or split the bucket"
                )
    as_placed = ev(units)
    if memory_budget_bytes is not None and _peak(as_placed) > budget:
        raise ValueError(
            f"memory_budget_gb={memory_budget_bytes / 2**30:.3g} is below the {_peak(as_placed) / 2**20:.2f} MiB of "
            "gathered parameters and reduce-scatter buffers this model holds at once even without prefetching; "
            "raise it, or leave it None (what eager FSDP2 holds)"
        )
    budget = max(budget, _peak(as_placed))  # an explicit bucket plan is honored; the budget bounds the moves

    if policy == "auto":
        units = _merge(units, ev, budget, bucket_cap_bytes, {m.fqn: m.key for m in modules}, reorder)
    fixed_fwd, fixed_bwd = _apply_fsdp2_prefetch(units, modules)
    if reorder:
        _search(units, ev, budget, fixed_fwd, fixed_bwd)
    return Schedule(
        units=tuple(units),
        policy=policy if isinstance(policy, str) else "explicit",
        workload=workload,
        hardware=cost_model.profile.name,
        comm_budget_bytes=int(budget),
        predicted={"planned": ev(units), "as_placed": ev(_just_in_time(units)), "eager_fsdp2": eager_pred},
        planning_s=time.perf_counter() - t0,
    )


def eager_fsdp2(modules: Sequence[Module]) -> list[Unit]:
    """Eager FSDP2's own schedule on this program: one all-gather per module, no forward prefetch unless set,
    the next module prefetched in backward (its default) unless a list is set, one reduce-scatter pending."""
    units = [dataclasses.replace(_unit([m]), issue_at=i, backward_issue_at=i, sink=1) for i, m in enumerate(modules)]
    order = backward_order(units)
    for prev, i in zip(order, order[1:]):
        if not modules[prev].backward_prefetch:
            units[i] = dataclasses.replace(units[i], backward_issue_at=prev)
    _apply_fsdp2_prefetch(units, modules)
    return units


def _apply_fsdp2_prefetch(units: list[Unit], modules: Sequence[Module]) -> tuple[set[int], set[int]]:
    """FSDP2's ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``: module A's list
    gathers its targets when A starts. Honored exactly, in place; returns the units the search must leave
    alone (forward, backward)."""
    unit_of = {f: i for i, u in enumerate(units) for f in u.members}
    position = {u: k for k, u in enumerate(backward_order(units))}
    fixed_fwd, fixed_bwd = set(), set()
    for m in modules:
        a = unit_of[m.fqn]
        for target in m.forward_prefetch:
            t = unit_of[target]
            if t > a:
                units[t] = dataclasses.replace(units[t], issue_at=min(units[t].issue_at, a))
                fixed_fwd.add(t)
        for target in m.backward_prefetch:
            t = unit_of[target]
            if position[t] > position[a] and units[t].regathers:
                earlier = units[t].backward_issue_at if t in fixed_bwd else t
                units[t] = dataclasses.replace(units[t], backward_issue_at=min(earlier, a, key=position.__getitem__))
                fixed_bwd.add(t)
    return fixed_fwd, fixed_bwd


def _merge(units, ev, budget, cap, key, reorder) -> list[Unit]:
    """``bucket="auto"``: grow each bucket over the next module while the predicted step gets faster (with
    the overlap ``reorder`` would give it), the bucket stays under the cap and memory under the budget."""
    done: list[Unit] = []
    current = units[0]
    for k, nxt in enumerate(units[1:], start=1):
        if key[current.members[0]] == key[nxt.members[0]] and (
            cap is None or current.all_gather_bytes + nxt.all_gather_bytes <= cap
        ):
            merged = dataclasses.replace(
                current, members=current.members + nxt.members,
                all_gather_bytes=current.all_gather_bytes + nxt.all_gather_bytes,
                reduce_scatter_bytes=current.reduce_scatter_bytes + nxt.reduce_scatter_bytes,
                tail=current.tail or nxt.tail,
            )
            rest = list(units[k + 1:])
            pa = _best_simple(_just_in_time([*done, current, nxt, *rest]), ev, budget, reorder)
            pj = _best_simple(_just_in_time([*done, merged, *rest]), ev, budget, reorder)
            if pj is not None and (pa is None or _step(pj) < _step(pa)):
                current = merged
                continue
        done.append(current)
        current = nxt
    return _just_in_time([*done, current])


def _best_simple(units: list[Unit], ev, budget: int, reorder: bool) -> dict | None:
    """The faster of "just in time" and (with ``reorder``) "everything one ahead" within the budget (None:
    neither fits): how a merge is judged, in linear time, before the search refines the winner."""
    options = [ev(units)] + ([ev(_one_ahead(units))] if reorder else [])
    fits = [p for p in options if _peak(p) <= budget]
    return min(fits, key=_step) if fits else None


def _one_ahead(units: list[Unit]) -> list[Unit]:
    """Every all-gather one unit ahead, every reduce-scatter one pending: how a merge is judged."""
    out = [dataclasses.replace(u, issue_at=max(0, i - 1), sink=1) for i, u in enumerate(units)]
    order = backward_order(out)
    for prev, i in zip(order, order[1:]):
        out[i] = dataclasses.replace(out[i], backward_issue_at=prev)
    return out


def _search(units: list[Unit], ev, budget: int, fixed_fwd: set[int], fixed_bwd: set[int]) -> None:
    """In place, greedy, unit by unit: the prefetch distance (forward, then backward) and the sink depth
    that give the fastest predicted step within the budget; a tie keeps the less aggressive choice. All
    -gathers stay in order in each direction."""
    best = ev(units)

    def consider(i: int, **change) -> None:
        nonlocal best
        trial = list(units)
        trial[i] = dataclasses.replace(units[i], **change)
        pred = ev(trial)
        if _peak(pred) <= budget and _step(pred) < _step(best) * (1 - 1e-9):
            units[i], best = trial[i], pred

    for i in range(1, len(units)):
        if i not in fixed_fwd:
            for d in range(1, PREFETCH_DEPTH + 1):
                if i - d < units[i - 1].issue_at:
                    break
                consider(i, issue_at=i - d)
    order = backward_order(units)
    position = {u: k for k, u in enumerate(order)}
    floor = 0  # the position the previous backward all-gather was issued at
    for k, i in enumerate(order):
        if not units[i].regathers:
            continue
        if i not in fixed_bwd:
            for d in range(1, PREFETCH_DEPTH + 1):
                if k - d < floor:
                    break
                consider(i, backward_issue_at=order[k - d])
        floor = position.get(units[i].backward_issue_at, k)
    for i in order:
        if units[i].reduce_scatter_bytes:
            for depth in range(1, SINK_DEPTH + 1):
                consider(i, sink=depth)
