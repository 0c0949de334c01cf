"""Pipeline parallelism: an FSDP stage of ``torch.distributed.pipelining``, compiled.

``compile_stage(stage_module)`` returns a ``CompiledFSDPStage``, handed to ``PipelineStage`` in place of the
``fully_shard`` module. It is a ``CompiledFSDPModule`` and an ``FSDPModule``: the stage and its schedules
find an FSDP stage (``isinstance(submod, FSDPModule)``) and call FSDP2's methods on it, which reach the
stage's module (``unshard``/``reshard`` for the runtime schedules' UNSHARD/RESHARD, the setters).

Eager FSDP2 under a pipeline schedule reduces nothing in any micro-batch's backward: before each one the
stage sets ``set_requires_gradient_sync(False)`` (and ``set_reshard_after_backward(False)``), so the unsharded
gradients accumulate, and its REDUCE_GRAD action turns sync back on and runs FSDP2's post-backward by hand,
which reduce-scatters them once. A compiled step fixes at its forward whether its backward reduce-scatters,
but the stage decides that only before the backward (the first micro-batches' forwards still see the last
step's sync), so a compiled stage runs every micro-batch as FSDP2's no-sync mode (one compiled graph:
gradients accumulated unsharded in FSDP2's dtype) and reduce-scatters what accumulated where eager FSDP2
would: at REDUCE_GRAD (``fully_shard.state(stage)`` is ``_StageState``, whose final callback does it), or at
the end of a backward run while ``requires_gradient_sync`` is on (a stage called outside a schedule).
``set_reshard_after_backward(False)`` keeps eager's gathered parameters for the next micro-batch; the
compiled forward gathers them again from the same shards, the same values, so the stage takes it as said.
"""

from __future__ import annotations

import dataclasses
import types

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp_compile import _fsdp2, capture
from fsdp_compile._api import CompiledFSDPModule, compile as _compile
from fsdp_compile.ops import ReduceScatterArgs, UnshardArgs

__all__ = ["CompiledFSDPStage", "compile_stage"]


class _StageState:
    """What ``PipelineStage.perform_reduce_grad`` (REDUCE_GRAD) reads of ``fully_shard.state(stage)``: no FSDP
    parameter group to post-backward by hand, a final callback that reduce-scatters the accumulated gradients."""

    def __init__(self, stage: CompiledFSDPStage):
        self._stage = stage
        self._state_ctx = types.SimpleNamespace(all_states=[])

    def _root_post_backward_final_callback(self) -> None:
        self._stage._reduce_synced()


class CompiledFSDPStage(CompiledFSDPModule, FSDPModule):
    """A pipeline stage's ``fully_shard`` module compiled by ``compile_stage`` (see the module docstring).
    FSDP2's methods run on the stage's module, but for ``set_reshard_after_backward``, which it keeps."""

    def __new__(cls, *args, **kwargs):  # FSDPModule's __new__ builds the class fully_shard replaced
        return object.__new__(cls)

    def _become_stage(self) -> None:
        self._reshard_after_backward = True  # what the stage last asked for: nothing to do (module docstring)
        self._backward_queued = False
        self._hooked: set[str] = set()  # sinks with our end-of-backward hook
        _fsdp2.give_state(self, self._orig_mod, _StageState(self))

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Taken, not passed on: every compiled micro-batch gathers its parameters from the shards, which do
        not change between micro-batches, so keeping eager's gathered copy would compute the same."""
        self._reshard_after_backward = reshard_after_backward

    def _read_settings(self) -> tuple:
        # every micro-batch accumulates unsharded; the reduce-scatter is decided after the backward. Read at each
        # call: a backward that failed before its end queued a callback that never ran, and is over now
        self._backward_queued = False
        return tuple((fqn, dataclasses.replace(s, requires_gradient_sync=False)) for fqn, s in super()._read_settings())

    def _sink(self, pp, plan, sinks: dict | None = None) -> torch.Tensor:
        sink = super()._sink(pp, plan, sinks)
        if sinks is None and pp.fqn not in self._hooked:
            sink.register_post_accumulate_grad_hook(self._on_gradient)
            self._hooked.add(pp.fqn)
        return sink

    def _on_gradient(self, _sink) -> None:
        """FSDP2 reads ``requires_gradient_sync`` at the end of the backward: so do we."""
        if not self._backward_queued:
            self._backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._backward_queued = False
        self._reduce_synced()

    def _reduce_synced(self) -> None:
        """Reduce-scatter, unit by unit of the last step's schedule, the unsharded gradients accumulated for the
        FSDP modules whose ``requires_gradient_sync`` is on, as FSDP2's post-backward reduces them (the
        compiled backward's own ``fsdp_compile::reduce_scatter_grads``, run eagerly), into ``.grad``."""
        step = next((s for s in self._steps.values() if s.schedule is self.schedule), None)
        if step is None or not any(sink.grad is not None for sink in self._sinks.values()):
            return
        settings = dict(super()._read_settings())
        units = capture.unit_traces(step.plan, step.schedule, self.kernels, (None,) * len(step.schedule.units))
        for unit, params, plans in zip(units, step.params, step.param_plans):
            if not all(settings[m].requires_gradient_sync for m in unit.members) or not any(
                    self._has_gradient(pp.fqn) for pp in plans):
                continue
            if not all(settings[m].requires_all_reduce or not step.plan.group(m).replicate_group_name for m in unit.members):
                raise NotImplementedError(
                    "set_requires_all_reduce(False) on an HSDP pipeline stage compiled by fsdp_compile.compile_stage: "
                    "not supported yet; leave it on or run the stage eagerly"
                )
            acc = [self._sinks[pp.fqn].grad if self._has_gradient(pp.fqn) and pp.requires_grad else None for pp in plans]
            for pp in plans:
                if pp.fqn in self._sinks:
                    self._sinks[pp.fqn].grad = None
            keep = [i for i, a in enumerate(acc) if a is not None]
            for i, grad in zip(keep, reduce_scatter(UnshardArgs.decode(unit.arguments), [acc[i] for i in keep],
                                                    [params[i] for i in keep])):
                _accumulate(params[i], grad)

    def _has_gradient(self, fqn: str) -> bool:
        sink = self._sinks.get(fqn)
        return sink is not None and sink.grad is not None


def _forward_to_module(name: str):
    def method(self, *args, **kwargs):
        return getattr(self._orig_mod, name)(*args, **kwargs)

    method.__name__ = name
    method.__doc__ = f"FSDP2's ``FSDPModule.{name}`` on the stage's module."
    return method


for _name, _value in vars(FSDPModule).items():
    if callable(_value) and _name not in ("__new__", "_apply") and _name not in vars(CompiledFSDPStage):
        setattr(CompiledFSDPStage, _name, _forward_to_module(_name))


def reduce_scatter(args: UnshardArgs, grads: list[torch.Tensor], params: list[nn.Parameter]) -> list[torch.Tensor]:
    """One unit's accumulated unsharded gradients reduce-scattered into this rank's shard gradients, as the
    unit's compiled backward reduces them (``ops._unshard_backward``) when they are all it has."""
    reduction = dataclasses.replace(args.reduction, dtype=args.reduction.dtype or grads[0].dtype)
    rs = ReduceScatterArgs(args.comm, tuple(p._local_tensor.shape[0] for p in params), params[0].dtype, reduction)
    return torch.ops.fsdp_compile.reduce_scatter_grads(grads, [None] * len(grads), *rs.schema())


def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
    """``grad`` into the DTensor parameter's ``.grad``, as FSDP2's ``foreach_reduce`` puts it there."""
    if param.grad is None:
        param.grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False,
                                        shape=param.shape, stride=param.stride())
    else:
        param.grad._local_tensor += grad


def compile_stage(model: nn.Module, config=None, **overrides) -> CompiledFSDPStage:
    """``fsdp_compile.compile`` for a pipeline stage's ``fully_shard`` module, to hand to
    ``torch.distributed.pipelining.PipelineStage`` (see the module docstring)."""
    if not isinstance(model, FSDPModule):
        raise TypeError(
            f"compile_stage takes the stage's fully_shard module, got {type(model).__name__}: call fully_shard on "
            "it (after its blocks) first, or fsdp_compile.compile for a model that is no pipeline stage"
        )
    compiled = _compile(model, config, **overrides)
    extension = next((pp.fqn for g in compiled.plan.groups for pp in g.params if pp.extension is not None), None)
    if extension is not None:
        compiled.detach()
        raise NotImplementedError(
            f"parameter {extension!r} has an all-gather extension (fsdp_pre_all_gather): compile_stage does not "
            "reduce-scatter such gradients yet; use fsdp_compile.compile outside a pipeline, or run the stage eagerly"
        )
    compiled.__class__ = CompiledFSDPStage  # as fully_shard swaps a module's class
    compiled._become_stage()
    return compiled
