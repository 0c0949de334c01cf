"""Bucketing: merge adjacent FSDP all-gathers (forward and backward graphs) and reduce-scatters (backward).

Plan, then apply::

    buckets = plan_buckets(gm.graph, "auto", cost_model="cpu-gloo")   # list[list[Node]], plain data
    apply_buckets(gm, buckets)                                          # edits gm in place

**Invariant: only adjacent collectives are merged, and their order is kept.** Two collectives are adjacent
when no other collective of the same kind (all-gather or reduce-scatter) is issued between them in program
order, and they share a process group, dtype, world size (and reduce op). A bucket's collective is issued
where its first member was (all-gather: the data is needed then) or where its last member was
(reduce-scatter: all gradients are ready then), so the sequence of collectives of each kind on each process
group is the sequence before bucketing with runs merged. Every decision is a function of the graph and the
arguments, so every rank, holding the same graph, makes the same buckets and issues the same collectives in
the same order.

Policies (``CompileConfig.bucket``):

* ``"none"`` and ``"fsdp_group"``: keep what the capture emits, one collective per FSDP group (singletons);
* ``"auto"``: grow each bucket over adjacent collectives while the simulated step (``simulate``) gets faster,
  the bucket stays under ``bucket_cap_mb`` and the predicted peak memory (``memory``) stays under the
  budget (default: ``memory.default_memory_budget``, eager FSDP2's predicted peak);
* an explicit plan: a list of buckets, each a list of FSDP module FQNs (``""`` is the root); the named
  groups' all-gathers are merged, and so are their reduce-scatters. Groups not named stay alone.

The rewrite itself, and its twin on the lowered program that planning evaluates, are ``_bucket_rewrite``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Union

import torch.fx as fx

from fsdp_compile.passes import predicates as P
from fsdp_compile.passes._bucket_rewrite import KINDS, Estimator, apply_rewrite, bucket_key, check_adjacent, describe, fake_mode
from fsdp_compile.passes.cost_model import CostModel, HardwareProfile, cost_model_for
from fsdp_compile.passes.memory import default_memory_budget

BucketMode = Literal["none", "fsdp_group", "auto"]
BucketPolicy = Union[BucketMode, Sequence[Sequence[str]]]
MB = 1024 * 1024


def apply_buckets(gm: fx.GraphModule | fx.Graph, plan: Sequence[Sequence[fx.Node]]) -> list[fx.Node]:
    """Rewrite every bucket of two or more collectives into one (see the module docstring), in place.

    ``plan`` is ``plan_buckets``'s result (or any list of lists of adjacent, compatible collectives of
    ``gm``). Returns one collective node per bucket: the merged one, or the member of a singleton.
    Raises ``ValueError`` naming the nodes if a bucket cannot be merged.
    """
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    mode = fake_mode(graph)
    out = []
    for bucket in plan:
        bucket = list(bucket)
        if len(bucket) < 2:
            out.extend(bucket)
            continue
        pos = {n: i for i, n in enumerate(graph.nodes)}
        missing = [n.name for n in bucket if n not in pos]
        if missing:
            raise ValueError(f"bucket members {missing} are not in the graph")
        bucket.sort(key=pos.__getitem__)
        check_adjacent(graph, bucket, pos)
        rw = describe(graph, bucket, pos)
        if isinstance(rw, str):
            raise ValueError(f"cannot bucket {[n.name for n in bucket]}: {rw}")
        out.append(apply_rewrite(graph, rw, mode))
    graph.lint()
    if isinstance(gm, fx.GraphModule):
        gm.recompile()
    return out


# --- planning, policies -------------------------------------------------------------------------------------


def _runs(graph: fx.Graph, kind: str) -> list[list[fx.Node]]:
    """Maximal runs of consecutive same-kind collectives with one key; non-FSDP ones stand alone."""
    runs: list[list[fx.Node]] = []
    prev_key = None
    for n in P.collectives(graph, kind):
        key = bucket_key(n) if P.fsdp_meta(n) is not None else ("non-fsdp", n)
        if runs and key == prev_key:
            runs[-1].append(n)
        else:
            runs.append([n])
        prev_key = key
    return [run for run in runs if P.fsdp_meta(run[0]) is not None]


def plan_buckets(
    graph: fx.Graph | fx.GraphModule,
    policy: BucketPolicy = "auto",
    *,
    kinds: Sequence[str] = KINDS,
    bucket_cap_mb: float | None = None,
    memory_budget_bytes: int | None = None,
    cost_model: CostModel | HardwareProfile | str = "auto",
    known_groups: Sequence[str] | None = None,
) -> list[list[fx.Node]]:
    """Buckets of the graph's FSDP collectives of ``kinds``, each a list of nodes in program order.

    Every FSDP all-gather / reduce-scatter appears in exactly one bucket (singletons stay as they are);
    buckets are ordered by their first member. ``policy``: see the module docstring.

    ``bucket_cap_mb``: upper bound on a bucket's ``collective_bytes`` (MiB), ``None`` for none.
    ``memory_budget_bytes`` (``"auto"`` only): the predicted peak (``memory.peak_memory``) must stay under
    it; ``None`` means ``default_memory_budget(graph)``, eager FSDP2's predicted peak. ``known_groups``: the FSDP module FQNs an explicit plan may name (e.g.
    ``[g.fqn for g in plan.groups]``); defaults to the groups seen in this graph.
    """
    if isinstance(graph, fx.GraphModule):
        graph = graph.graph
    kinds = tuple(kinds)
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        raise ValueError(f"kinds must be drawn from {KINDS}, got {bad}")
    cap = None
    colls = [n for k in kinds for n in P.collectives(graph, k) if P.fsdp_meta(n) is not None]
    if bucket_cap_mb is not None:
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
        cap = bucket_cap_mb * MB
        biggest = max(colls, key=P.collective_bytes, default=None)
        if biggest is not None and P.collective_bytes(biggest) > cap:
            raise ValueError(
                f"bucket_cap_mb={bucket_cap_mb} is below the largest single collective: {biggest.name} "
                f"(FSDP group {P.fsdp_group(biggest)!r}) moves {P.collective_bytes(biggest) / MB:.3f} MiB"
            )
    pos = {n: i for i, n in enumerate(graph.nodes)}
    if isinstance(policy, str):
        if policy in ("none", "fsdp_group"):
            buckets = [[n] for n in colls]
        elif policy == "auto":
            buckets = _plan_auto(graph, kinds, cap, memory_budget_bytes, cost_model_for(cost_model, graph))
        else:
            raise ValueError(f"bucket policy must be 'none', 'fsdp_group', 'auto' or a list of lists of FQNs, got {policy!r}")
    else:
        buckets = _plan_explicit(graph, policy, kinds, cap, known_groups, pos)
    return sorted(buckets, key=lambda b: pos[b[0]])


def _plan_explicit(graph, policy, kinds, cap, known_groups, pos) -> list[list[fx.Node]]:
    try:
        plan = [[fqn for fqn in bucket] for bucket in policy]
    except TypeError:
        raise ValueError(f"an explicit bucket plan is a list of lists of FSDP module FQNs, got {policy!r}") from None
    seen_groups = {g for n in graph.nodes for g in P.fsdp_groups(n)}
    known = set(known_groups) if known_groups is not None else seen_groups
    where: dict[str, int] = {}
    for i, bucket in enumerate(plan):
        if not bucket:
            raise ValueError(f"bucket {i} of the explicit plan is empty")
        for fqn in bucket:
            if not isinstance(fqn, str) or fqn not in known:
                raise ValueError(f"the bucket plan names unknown FSDP module {fqn!r}; FSDP modules: {sorted(known)}")
            if fqn in where:
                raise ValueError(f"FSDP module {fqn!r} is in buckets {where[fqn]} and {i}; name each module once")
            where[fqn] = i
    out: list[list[fx.Node]] = []
    for kind in kinds:
        by_bucket: dict[int, list[fx.Node]] = {}
        for n in P.collectives(graph, kind):
            if P.fsdp_meta(n) is None:
                continue
            b = where.get(P.fsdp_group(n))
            if b is None:
                out.append([n])
            else:
                by_bucket.setdefault(b, []).append(n)
        for b, members in by_bucket.items():
            members.sort(key=pos.__getitem__)
            if len(members) > 1:
                check_adjacent(graph, members, pos)
                rw = describe(graph, members, pos)
                if isinstance(rw, str):
                    raise ValueError(f"cannot bucket FSDP modules {plan[b]} ({kind}): {rw}")
                size = sum(P.collective_bytes(n) for n in members)
                if cap is not None and size > cap:
                    raise ValueError(
                        f"bucket {plan[b]} ({kind}) moves {size / MB:.3f} MiB, over bucket_cap_mb={cap / MB:g}"
                    )
            out.append(members)
    return out


# --- "auto": grow buckets while the simulated step gets faster and memory stays in budget ----------


def _plan_auto(graph, kinds, cap, budget, cm: CostModel) -> list[list[fx.Node]]:
    est = Estimator(graph, cm)
    current = est.base
    if budget is None:
        budget = default_memory_budget(graph)
    buckets: list[list[fx.Node]] = []
    n_tags = 0
    for kind in kinds:
        for run in _runs(graph, kind):
            bucket: list[fx.Node] = []
            bucket_ops = current  # ``current`` with ``bucket`` applied
            bucket_step = None  # its simulated step time, once known
            for c in run:
                if not bucket:
                    bucket = [c]
                    continue
                cand = [*bucket, c]
                ok = cap is None or sum(P.collective_bytes(n) for n in cand) <= cap
                if ok:
                    rw = describe(graph, cand, est.pos)
                    ok = not isinstance(rw, str)
                if ok:
                    n_tags += 1
                    cand_ops = est.transform(current, rw, str(n_tags))
                    # compare with the bucket as it is and ``c`` alone
                    cand_step, cand_peak = est.evaluate(cand_ops)
                    if bucket_step is None:
                        bucket_step = est.evaluate(bucket_ops)[0]
                    ok = cand_step < bucket_step and cand_peak <= budget
                if ok:
                    bucket, bucket_ops, bucket_step = cand, cand_ops, cand_step
                else:
                    buckets.append(bucket)
                    current = bucket_ops
                    bucket = [c]  # ``c`` alone: ``bucket_ops`` is still right, its step too
            if bucket:
                buckets.append(bucket)
                current = bucket_ops
    return buckets


def bucket_groups(plan: Sequence[Sequence[fx.Node]]) -> list[list[str]]:
    """The FSDP module FQNs of each bucket (for reports)."""
    out = []
    for bucket in plan:
        groups: list[str] = []
        for n in bucket:
            for g in P.fsdp_groups(n):
                if g not in groups:
                    groups.append(g)
        out.append(groups)
    return out
