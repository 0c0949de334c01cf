"""Traceable FSDP2: bypass FSDP2's eager hooks while our compiled step runs, gather through our ops.

FSDP2 registers ``FSDPState._pre_forward`` / ``_post_forward`` as module hooks, and both are
``torch._dynamo.disable``d: Dynamo cannot trace them (``fullgraph=True`` fails with "Attempted to call
function marked as skipped"). We replace each of those two hook entries, in place and under the same
hook id, by a dispatcher:

* outside our compiled step it calls FSDP2's hook unchanged, so eager use of the model (evaluation,
  debugging, plain ``torch.compile``) keeps FSDP2's exact behaviour;
* inside it (``_ACTIVE``, which Dynamo guards on) it does only the traceable part of FSDP2's hook: the
  ``MixedPrecisionPolicy`` casts (``cast_forward_inputs`` before, ``output_dtype`` after).

The parameters come from ``traced_forward``: for every unit of the communication schedule (an FSDP
group, a bucket of them, or one parameter) one ``fsdp_compile::unshard`` over its local shards (``DTensor.to_local()``, taken just outside the graph, so gradients arrive as
Shard(0) DTensor ``.grad`` on the original parameters), then ``torch.func.functional_call`` runs the
model with the full tensors. The passes then move each unshard to just before its group's first use
(``passes/placement.py``), which is where FSDP2's pre-forward hook would have issued it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.fsdp._fully_shard._fsdp_common import _cast_fp_tensor
from torch.distributed.utils import _apply_to_tensors

from fsdp_compile.ops import Comm, Reduction, UnshardArgs
from fsdp_compile.passes.schedule import Schedule, Unit
from fsdp_compile.plan import ParamPlan, ShardingPlan, fsdp_states

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
    model: nn.Module, plan: ShardingPlan, schedule: Schedule, kernels: str, shards: list[list[torch.Tensor]], args, kwargs
):
    """The function Dynamo captures: one ``fsdp_compile::unshard`` per unit of the schedule (``shards[i]``:
    the local shards of ``unit_params(plan, schedule.units[i])``), then the model on the full parameters."""
    full = {}
    for i, (unit, unit_shards) in enumerate(zip(schedule.units, shards)):
        params = unit_params(plan, unit)
        gathered = torch.ops.fsdp_compile.unshard(unit_shards, *unshard_args(plan, unit, i, kernels).schema())
        full.update({p.fqn: t for p, t in zip(params, gathered)})
    return torch.func.functional_call(model, full, args, kwargs, tie_weights=True, strict=False)


def unit_params(plan: ShardingPlan, unit: Unit) -> list[ParamPlan]:
    """The parameters one unit gathers, in the order its op takes and returns them."""
    params = [p for fqn in unit.members for p in plan.group(fqn).params]
    return [p for p in params if p.fqn == unit.param] if unit.param is not None else params


def unshard_args(plan: ShardingPlan, unit: Unit, index: int, kernels: str) -> UnshardArgs:
    """The ``fsdp_compile::unshard`` arguments of schedule unit ``index`` (its members share everything but
    their parameters: ``GroupPlan.bucket_key``)."""
    group = plan.group(unit.members[0])
    return UnshardArgs(
        comm=Comm(unit.members, index, group.group_name, group.world_size, group.rank, kernels),
        dim0s=tuple(p.full_shape[0] for p in unit_params(plan, unit)),
        param_dtype=group.param_dtype,
        reduction=Reduction(group.reduce_dtype, group.reduce_op, group.pre_factor, group.post_factor),
    )
