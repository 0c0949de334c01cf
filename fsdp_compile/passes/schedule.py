"""The communication schedule: planned once per compiled model, over FSDP modules, identical on every rank.

A ``Schedule`` is plain data. Its ``units`` are the all-gathers, in forward order: each gathers one or more
FSDP modules (a bucket), one parameter (``bucket="none"``), or one part of a module that holds other FSDP
modules (``bucket="auto"`` may split the root: its leading parameters, an embedding, gathered where it
starts, and the rest, its head, after its last inner module, so the head's reduce-scatter is issued as soon
as the head's backward is done instead of after the embedding's, the last compute of the step); its
backward is one reduce-scatter of the same parameters. Per unit it says

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

Planned by ``planner.plan_schedule``; predicted by ``predict.predict`` on the per-unit costs of
``unit_costs``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Sequence

import torch

from fsdp_compile._layout import padded_rows



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
    leading: tuple[str, ...] = ()  # holds_children: the parameters its forward uses before its inner modules


@dataclasses.dataclass(frozen=True)
class Unit:
    """One all-gather in forward, its re-gather in backward (``regathers``) and its reduce-scatter."""

    members: tuple[str, ...]  # FSDP module FQNs, adjacent in forward order
    params: tuple[str, ...] | None  # the parameters of its one member it gathers (a parameter, a part); None: all
    issue_at: int  # forward: the unit at whose first use this all-gather is issued (own index: just in time)
    backward_issue_at: int  # backward: the unit at whose backward start it is issued (own index: just in time)
    sink: int  # backward: later reduce-scatters issued before this one is waited for (0: waited at once)
    all_gather_bytes: int
    reduce_scatter_bytes: int  # 0: nothing trainable, no reduce-scatter
    regathers: bool  # reshard_after_forward: gathered again in backward
    tail: bool  # the head of a module that holds other FSDP modules (the root's): needed first in backward


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
            param_bytes.append(p.gathered_bytes(g.world_size, gather))  # an all-gather extension's inputs as they are
            reduce_bytes.append(padded * (g.reduce_dtype or p.orig_dtype).itemsize if p.requires_grad else 0)
            flops.append(2 * math.prod(p.full_shape) if p.matmul else 0)
        out.append(Module(
            fqn=g.fqn, key=g.bucket_key(), params=tuple(p.fqn for p in g.params), param_bytes=tuple(param_bytes),
            reduce_bytes=tuple(reduce_bytes), flops_per_token=tuple(flops), process_group=g.group_name,
            world_size=g.world_size, reshard_after_forward=g.reshard_after_forward,
            holds_children=plan.has_fsdp_children(g.fqn), lowp=gather in (torch.bfloat16, torch.float16),
            replicate_size=g.replicate_size,
            forward_prefetch=g.forward_prefetch, backward_prefetch=g.backward_prefetch, leading=g.leading,
        ))
    return out
