"""Traceable FSDP2: bypass FSDP2's eager hooks while our compiled step runs, gather through our ops.

FSDP2 registers ``FSDPState._pre_forward`` / ``_post_forward`` as module hooks, and both are
``torch._dynamo.disable``d: Dynamo cannot trace them (``fullgraph=True`` fails with "Attempted to call
function marked as skipped"). We replace each of those two hook entries, in place and under the same
hook id, by a dispatcher:

* outside our compiled step it calls FSDP2's hook unchanged, so eager use of the model (evaluation,
  debugging, plain ``torch.compile``) keeps FSDP2's exact behaviour;
* inside it (``_ACTIVE``, which Dynamo guards on) it does only the traceable part of FSDP2's hook: the
  ``MixedPrecisionPolicy`` casts (``cast_forward_inputs`` before, ``output_dtype`` after).

The parameters come from ``traced_forward``: for every FSDP group one ``fsdp_compile::unshard`` over the
group's local shards (``DTensor.to_local()``, taken just outside the graph, so gradients arrive as
Shard(0) DTensor ``.grad`` on the original parameters), then ``torch.func.functional_call`` runs the model with the full tensors. The
backend then moves each unshard to just before its group's first use (``place_collectives``), which is
where FSDP2's pre-forward hook would have issued it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn as nn
from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
from torch.distributed.utils import _apply_to_tensors

from fsdp_compile.plan import ShardingPlan, fsdp_states

_ACTIVE = False  # True only while our compiled step runs (and while Dynamo traces it)


class _Active:
    def __enter__(self):
        global _ACTIVE
        self._prev, _ACTIVE = _ACTIVE, True

    def __exit__(self, *exc):
        global _ACTIVE
        _ACTIVE = self._prev


def active() -> _Active:
    return _Active()


def _cast(dtype, tree):
    return _apply_to_tensors(functools.partial(_cast_fp_tensor, dtype), tree)


def _make_pre_hook(state, fsdp_hook):
    policy = state._mp_policy
    cast_dtype = policy.param_dtype if policy.cast_forward_inputs else None

    def fsdp_compile_pre_forward(module, args, kwargs):
        if not _ACTIVE:
            return fsdp_hook(module, args, kwargs)
        if cast_dtype is None:
            return args, kwargs
        return _cast(cast_dtype, args), _cast(cast_dtype, kwargs)

    fsdp_compile_pre_forward.fsdp_hook = fsdp_hook
    return fsdp_compile_pre_forward


def _make_post_hook(state, fsdp_hook):
    output_dtype = state._mp_policy.output_dtype

    def fsdp_compile_post_forward(module, input, output):
        if not _ACTIVE:
            return fsdp_hook(module, input, output)
        return output if output_dtype is None else _cast(output_dtype, output)

    fsdp_compile_post_forward.fsdp_hook = fsdp_hook
    return fsdp_compile_post_forward


def install_hooks(model: nn.Module) -> None:
    """Swap FSDP2's forward hooks for dispatchers (idempotent; eager behaviour is unchanged)."""
    for fqn, module, state in fsdp_states(model):
        pre_id = state._pre_forward_hook_handle.id
        post_id = state._post_forward_hook_handle.id
        pre, post = module._forward_pre_hooks.get(pre_id), module._forward_hooks.get(post_id)
        if pre is None or post is None:
            raise RuntimeError(f"FSDP2's forward hooks on {fqn or '<root>'!r} are missing; was the hook removed?")
        if not hasattr(pre, "fsdp_hook"):
            module._forward_pre_hooks[pre_id] = _make_pre_hook(state, pre)
        if not hasattr(post, "fsdp_hook"):
            module._forward_hooks[post_id] = _make_post_hook(state, post)


def traced_forward(
    model: nn.Module, plan: ShardingPlan, kernels: str, per_param: bool, shards: list[list[torch.Tensor]], args, kwargs
):
    """The function Dynamo captures: unshard every group's local shards (``shards[i]`` for
    ``plan.groups[i]``), then run the model on the full parameters. ``per_param`` (``bucket="none"``)
    gives every parameter its own all-gather and reduce-scatter instead of one per FSDP group."""
    full = {}
    for group, group_shards in zip(plan.groups, shards):
        if per_param:
            for p, shard in zip(group.params, group_shards):
                full.update(_unshard(dataclasses.replace(group, params=(p,)), [shard], kernels))
        else:
            full.update(_unshard(group, group_shards, kernels))
    return torch.func.functional_call(model, full, args, kwargs, tie_weights=True, strict=False)


def _unshard(group, group_shards, kernels: str) -> dict[str, torch.Tensor]:
    gathered = torch.ops.fsdp_compile.unshard(
        group_shards,
        [p.full_shape[0] for p in group.params],
        group.group_name,
        group.world_size,
        group.rank,
        group.param_dtype,
        group.reduce_dtype,
        group.reduce_op,
        group.pre_factor,
        group.post_factor,
        group.fqn,
        kernels,
    )
    return {p.fqn: t for p, t in zip(group.params, gathered)}


def _classify(graph: torch.fx.Graph) -> tuple[set[torch.fx.Node], set[torch.fx.Node]]:
    """Split the nodes our ops decomposed into: (unshard chains, reduce-scatter chains).

    Unshard chain: copy-in, all-gather, wait, copy-out, computed from graph inputs alone (in a forward
    graph, or recomputed in a backward graph). Reduce-scatter chain: the decomposed backward of an
    unshard (pack, reduce-scatter, wait, unpack); it inherits the forward op's annotation but depends on
    gradients, i.e. on the tangents.
    """
    from fsdp_compile.ops import META_KEY

    grad_dependent: set[torch.fx.Node] = set()  # tangents and everything computed from them
    unshard, reduce = set(), set()
    for node in graph.nodes:
        is_grad = (node.op == "placeholder" and node.name.startswith("tangents")) or any(
            a in grad_dependent for a in node.all_input_nodes
        )
        if is_grad:
            grad_dependent.add(node)
        meta = (node.meta.get("custom") or {}).get(META_KEY)
        # AOTAutograd gives backward nodes the forward op's annotation ("unshard"); the decomposition's
        # own "reduce_scatter" annotation survives where it does not. Gradient dependence decides.
        if meta and meta["kind"] in ("unshard", "reduce_scatter") and node.op == "call_function":
            (reduce if is_grad else unshard).add(node)
    return unshard, reduce


def unshard_chain_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    return _classify(graph)[0]


def place_collectives(graph: torch.fx.Graph) -> int:
    """Put every unshard where FSDP2's pre-forward/pre-backward hook issues it, and every gradient
    reduce-scatter where its post-backward hook issues it. Returns how many nodes moved.

    AOTAutograd leaves the all-gathers where the joint graph had them: the forward's at each group's
    ``unshard`` call, and the ones recomputed for ``reshard_after_forward`` all at the top of the
    backward, which would hold every group's full parameters at once. And since ``traced_forward``
    issues all unshards before any compute, autograd's sequence-number priority runs their backward,
    the reduce-scatters, after all compute: every unsharded gradient would live to the end. So each
    unshard-chain node sinks to just before its first user (last node first), and each
    reduce-scatter-chain node rises to just after its last input (first node first).
    A pure function of the graph, so every rank makes the same moves and the collectives keep one
    order on all ranks.
    """
    unshard, reduce = _classify(graph)
    moved = 0
    for node in reversed(list(graph.nodes)):
        if node in unshard and node.users:
            first = min(node.users, key=_position(graph))
            if first.prev is not node:
                first.prepend(node)
                moved += 1
    for node in list(graph.nodes):
        if node in reduce:
            pos = _position(graph)
            last = max(node.all_input_nodes, key=pos, default=None)
            if last is not None and last.next is not node:
                last.append(node)
                moved += 1
    graph.lint()
    return moved


def _position(graph: torch.fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return order.__getitem__
