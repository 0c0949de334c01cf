"""Planning a ``Schedule`` (``schedule.py``): the units a bucket policy gives, FSDP2's own prefetch
settings honored, then (``bucket="auto"``) the root gathered in two parts (its embedding, its head) where
that pays, adjacent modules merged, and (``reorder``) each unit's prefetch
distance and sink depth searched, greedily, on the predicted step time (``predict.py``) within the memory
budget. Deterministic: equal inputs give equal schedules on every rank.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from fsdp_compile.passes.cost_model import CostModel
from fsdp_compile.passes.predict import peak_bytes, predict, step_s
from fsdp_compile.passes.search import Search
from fsdp_compile.passes.schedule import Module, Schedule, Unit, backward_order
from fsdp_compile.plan import inside

PREFETCH_DEPTH = 3  # the furthest ahead (in units) an all-gather is ever issued
SINK_DEPTH = 2  # the most reduce-scatters issued before an earlier one is waited for


def _unit(members: Sequence[Module], params: tuple[str, ...] | None = None, tail: bool | None = None) -> Unit:
    ag = rs = 0
    for m in members:
        for name, a, r in zip(m.params, m.param_bytes, m.reduce_bytes):
            if params is None or name in params:
                ag, rs = ag + a, rs + r
    return Unit(
        members=tuple(m.fqn for m in members), params=params, issue_at=-1, backward_issue_at=-1, sink=0,
        all_gather_bytes=ag, reduce_scatter_bytes=rs, regathers=members[0].reshard_after_forward,
        tail=any(m.holds_children for m in members) if tail is None else tail,
    )


def _module_units(modules: Sequence[Module], *, per_param: bool = False, split: frozenset[str] = frozenset()) -> list[Unit]:
    """One unit per module (per parameter with ``per_param``), in forward order. A module in ``split`` (with
    ``per_param``, every module that holds others) is gathered in two parts: its leading parameters where it
    starts, the rest (its head: ``tail``) after its last inner module, where its forward uses them."""
    out: list[Unit] = []
    pending: list[tuple[str, list[Unit]]] = []  # (FQN, head units) of the modules we are inside
    for m in modules:
        while pending and not inside(m.fqn, pending[-1][0]):
            out.extend(pending.pop()[1])
        if not (m.holds_children and (per_param or m.fqn in split)):
            out.extend([_unit([m], (p,)) for p in m.params] if per_param else [_unit([m])])
            continue
        lead = tuple(p for p in m.params if p in m.leading)
        head = tuple(p for p in m.params if p not in m.leading)
        parts = [(p,) for p in lead] if per_param else [lead]
        out.extend(_unit([m], part, tail=False) for part in parts if part)
        parts = [(p,) for p in head] if per_param else [head]
        pending.append((m.fqn, [_unit([m], part, tail=True) for part in parts if part]))
    while pending:
        out.extend(pending.pop()[1])
    return out


def _splittable(modules: Sequence[Module]) -> list[str]:
    """The modules ``bucket="auto"`` may gather in two parts (``_module_units``): those that hold others and
    use parameters both before and after them, and are not in an FSDP2 prefetch list (whose meaning is the
    whole module's all-gather)."""
    named = {f for m in modules for f in (*m.forward_prefetch, *m.backward_prefetch)}
    return [
        m.fqn for m in modules
        if m.holds_children and m.leading and len(m.leading) < len(m.params)
        and m.fqn not in named and not m.forward_prefetch and not m.backward_prefetch
    ]


def _just_in_time(units: Sequence[Unit]) -> list[Unit]:
    return [dataclasses.replace(u, issue_at=i, backward_issue_at=i, sink=0) for i, u in enumerate(units)]


def check_bucket_plan(modules: Sequence[Module], buckets: Sequence[Sequence[str]]) -> None:
    """An explicit bucket plan's one problem, named, as a ``ValueError``: a module that is no FSDP module,
    one named twice, a bucket of modules that are not adjacent in forward order, or of modules that
    cannot share one all-gather. Checked when ``compile`` is called and again where the plan is applied."""
    order = [m.fqn for m in modules]
    by_fqn = {m.fqn: m for m in modules}
    seen: set[str] = set()
    for bucket in buckets:
        for fqn in bucket:
            if fqn not in by_fqn:
                raise ValueError(f"bucket plan names {fqn!r}, which is not an FSDP module; FSDP modules: {order}")
            if fqn in seen:
                raise ValueError(f"bucket plan names {fqn!r} twice; each FSDP module goes in one bucket")
            seen.add(fqn)
    for bucket in buckets:
        # one all-gather, issued where its first module runs: a module between two members would run
        # between the gather and the use of the later one, and the later one's parameters held across it
        at = sorted(order.index(f) for f in bucket)
        for a, b in zip(at, at[1:]):
            if b > a + 1:
                between = order[a + 1:b]
                raise ValueError(
                    f"bucket {list(bucket)} joins FSDP modules that are not adjacent in forward order: {between} "
                    f"run between {order[a]!r} and {order[b]!r}; a bucket is one all-gather of adjacent modules: "
                    f"add {between} to it, or split it"
                )
        members = [by_fqn[order[i]] for i in at]
        if len({m.key for m in members}) > 1:
            raise ValueError(
                f"bucket {list(bucket)} mixes FSDP modules that cannot share one all-gather: they differ in "
                f"{_key_difference(members)}; split it (one all-gather is re-gathered in backward or kept, for "
                "all its modules alike)"
            )


def _explicit_units(modules: Sequence[Module], buckets: Sequence[Sequence[str]]) -> list[Unit]:
    check_bucket_plan(modules, buckets)
    order = [m.fqn for m in modules]
    by_fqn = {m.fqn: m for m in modules}
    where = {fqn: b for b, bucket in enumerate(buckets) for fqn in bucket}
    units, done = [], set()
    for m in modules:  # a bucket is gathered where its first member is needed
        b = where.get(m.fqn)
        if b is None:
            units.append(_unit([m]))
        elif b not in done:
            units.append(_unit([by_fqn[f] for f in sorted(buckets[b], key=order.index)]))
            done.add(b)
    return units


def _key_difference(members: Sequence[Module]) -> str:
    """The fields of the members' keys (``plan.BucketKey``) that differ, with their values."""
    keys = [m.key for m in members]
    names = getattr(keys[0], "_fields", [str(i) for i in range(len(keys[0]))])
    diff = [f"{name} ({' vs '.join(map(str, dict.fromkeys(values)))})"
            for name, *values in zip(names, *keys) if len(set(values)) > 1]
    return ", ".join(diff) or "their sharding"


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

    # The searches below judge many candidate schedules, some more than once (a merge declined is the next
    # pair's "apart"), each by a prediction of the whole step: predictions are kept per candidate, and each
    # unit's costs across candidates (Llama-3 70B at W=64, 81 FSDP modules: 3.3 s -> 1.9 s).
    predictions: dict[tuple[Unit, ...], dict] = {}
    costs: dict = {}

    def ev(units):
        key = tuple(units)
        if key not in predictions:
            predictions[key] = predict(key, modules, cost_model, workload, memo=costs)
        return predictions[key]

    # eager FSDP2 on CPU runs its collectives synchronously (no streams, unshard_async_op=False)
    blocking = cost_model.profile.device_type == "cpu"
    eager_pred = predict(eager_fsdp2(modules), modules, cost_model, workload, blocking=blocking)
    budget = memory_budget_bytes if memory_budget_bytes is not None else peak_bytes(eager_pred)
    if isinstance(policy, str):
        if policy == "none":
            units = _module_units(modules, per_param=True)
        elif policy in ("fsdp_group", "auto"):
            units = _module_units(modules)
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
    if memory_budget_bytes is not None and peak_bytes(as_placed) > budget:
        raise ValueError(
            f"memory_budget_gb={memory_budget_bytes / 2**30:.3g} is below the {peak_bytes(as_placed) / 2**20:.2f} MiB of "
            "gathered parameters and reduce-scatter buffers this model holds at once even without prefetching; "
            "raise it, or leave it None (what eager FSDP2 holds)"
        )
    budget = max(budget, peak_bytes(as_placed))  # an explicit bucket plan is honored; the budget bounds the moves

    search = lambda units: Search(units, modules, cost_model, workload, costs)  # noqa: E731
    unsplit = None
    if policy == "auto":
        planned = lambda u: _planned(u, modules, search, ev, budget, reorder)  # noqa: E731
        units, unsplit = _split(units, modules, planned)
        merged = _merge(units, ev, budget, bucket_cap_bytes, {m.fqn: m.key for m in modules}, reorder)
        # the merges are judged on _best_simple's two fixed schedules: kept where the searched step agrees (HF
        # Llama on cpu-gloo, 2 ranks, the root split: blocks merged in pairs, searched 232.5 ms against 208.4)
        if merged != units and _faster(planned(merged), planned(units)):
            units = merged
    fixed_fwd, fixed_bwd = _apply_fsdp2_prefetch(units, modules)
    if reorder:
        _search(units, search(units), budget, fixed_fwd, fixed_bwd)
    predicted = {"planned": ev(units), "as_placed": ev(_just_in_time(units)), "eager_fsdp2": eager_pred}
    if unsplit is not None:  # explain's "split" line: the step planned without the split, for the gain
        predicted["unsplit"] = unsplit
    return Schedule(
        units=tuple(units),
        policy=policy if isinstance(policy, str) else "explicit",
        workload=workload,
        hardware=cost_model.profile.name,
        comm_budget_bytes=int(budget),
        predicted=predicted,
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


def _split(units, modules, planned) -> tuple[list[Unit], dict | None]:
    """``bucket="auto"``: gather each splittable module (``_splittable``) in two parts where the predicted
    step gets faster within the memory budget, each side judged as the search would plan it (``_planned``:
    FSDP2's prefetch lists, then prefetch distances and sinks with ``reorder``). The units, and the
    prediction of the best schedule without any split where one was taken (None: none taken). Judged by the
    searched schedule, not by ``_best_simple``'s two fixed ones: where prefetching everything one ahead is
    over the budget both sides fall back to just in time, where a split only adds a collective (HF Llama on
    cpu-gloo, 2 ranks: 246.1 vs 245.1 ms just in time, searched 208.4 vs 218.4 ms)."""
    split: frozenset[str] = frozenset()
    best = whole = planned(units)
    for fqn in _splittable(modules):
        trial = _module_units(modules, split=split | {fqn})
        pred = planned(trial)
        if _faster(pred, best):
            split, units, best = split | {fqn}, trial, pred
    return _just_in_time(units), (whole if split else None)


def _faster(a: dict | None, b: dict | None) -> bool:
    """Whether prediction ``a`` fits the budget (not None) and is faster than ``b``."""
    return a is not None and (b is None or step_s(a) < step_s(b))


def _planned(units: list[Unit], modules, search, ev, budget: int, reorder: bool) -> dict | None:
    """The prediction of ``units`` as ``plan_schedule`` would finish them (FSDP2's prefetch lists honored,
    then, with ``reorder``, the greedy search), or None where even that is over the budget."""
    units = _just_in_time(units)
    fixed_fwd, fixed_bwd = _apply_fsdp2_prefetch(units, modules)
    if reorder:
        _search(units, search(units), budget, fixed_fwd, fixed_bwd)
    pred = ev(units)
    return pred if peak_bytes(pred) <= budget else None


# A merge is taken only where it saves at least this fraction of the predicted step. ``unit_costs`` prices compute
# from matmul weights alone, so a smaller predicted gain is within the model's error, while a merge moves where each
# later all-gather ends against the compute before it. Llama-3 8B on 64 H100s over IB (bench/scale_sim.py): merges
# predicted to save 0.07% each grouped the blocks [0-2] [3,4] [5] [6,7] ..., simulated at 1413.8 ms, 1.025x the
# overlap limit, where no merge gives 1395.8 ms; merges that pay (tiny modules over 1024 ranks, latency-bound
# gloo steps) save several percent each.
MERGE_MIN_GAIN = 0.005


def _merge(units, ev, budget, cap, key, reorder) -> list[Unit]:
    """``bucket="auto"``: grow each bucket over the next module while the predicted step gets faster by at least
    ``MERGE_MIN_GAIN`` (with the overlap ``reorder`` would give it), the bucket stays under the cap and memory
    under the budget."""
    done: list[Unit] = []
    current = units[0]
    for k, nxt in enumerate(units[1:], start=1):
        if current.params is None and nxt.params is None and key[current.members[0]] == key[nxt.members[0]] and (
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
            if pj is not None and (pa is None or step_s(pj) < step_s(pa) * (1 - MERGE_MIN_GAIN)):
                current = merged
                continue
        done.append(current)
        current = nxt
    return _just_in_time([*done, current])


def _best_simple(units: list[Unit], ev, budget: int, reorder: bool) -> dict | None:
    """The faster of "just in time" and (with ``reorder``) "everything one ahead" within the budget (None:
    neither fits): how a merge is judged, in linear time, before the search refines the winner."""
    options = [ev(units)] + ([ev(_one_ahead(units))] if reorder else [])
    fits = [p for p in options if peak_bytes(p) <= budget]
    return min(fits, key=step_s) if fits else None


def _one_ahead(units: list[Unit]) -> list[Unit]:
    """Every all-gather one unit ahead, every reduce-scatter one pending: how a merge is judged."""
    out = [dataclasses.replace(u, issue_at=max(0, i - 1), sink=1) for i, u in enumerate(units)]
    order = backward_order(out)
    for prev, i in zip(order, order[1:]):
        out[i] = dataclasses.replace(out[i], backward_issue_at=prev)
    return out


def _search(units: list[Unit], search: Search, budget: int, fixed_fwd: set[int], fixed_bwd: set[int]) -> None:
    """In place, greedy, unit by unit: the prefetch distance (forward, then backward) and the sink depth
    that give the fastest predicted step within the budget; a tie keeps the less aggressive choice. All
    -gathers stay in order in each direction. Each candidate differs from the current schedule in one
    unit, and ``search`` (``predict.Search``) simulates only what the change touches."""
    best = search.current()

    def consider(i: int, **change) -> None:
        nonlocal best
        unit = dataclasses.replace(units[i], **change)
        pred = search.trial(i, unit)
        if peak_bytes(pred) <= budget and step_s(pred) < step_s(best) * (1 - 1e-9):
            search.accept()
            units[i], best = unit, pred

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
