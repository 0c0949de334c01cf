"""``fully_shard``, ``compile`` and the module ``compile`` returns."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as _torch_fully_shard

from fsdp_compile import capture
from fsdp_compile.backend import CapturedGraphs, make_backend
from fsdp_compile.config import CompileConfig
from fsdp_compile.plan import ShardingPlan, read_plan

__all__ = ["fully_shard", "compile", "CompiledFSDPModule"]


def fully_shard(module, **kwargs):
    """Drop-in for ``torch.distributed.fsdp.fully_shard``: same signature, same result (torch's classes).

    Kept as our own entry point so that anything a later compile needs at sharding time has one place to
    go; today it adds nothing and the result is indistinguishable from torch's.
    """
    return _torch_fully_shard(module, **kwargs)


fully_shard.__signature__ = __import__("inspect").signature(_torch_fully_shard)


class CompiledFSDPModule(nn.Module):
    """What ``fsdp_compile.compile`` returns: calls run the compiled one-graph step.

    It owns no state: ``parameters()``, ``named_parameters()``, ``state_dict()`` and
    ``load_state_dict()`` are the original model's (same DTensor objects, same FQNs, no prefix), so an
    optimizer, ``clip_grad_norm_`` and DCP work with either object. The original model stays usable
    eagerly with FSDP2's own hooks.
    """

    def __init__(self, model: nn.Module, plan: ShardingPlan, config: CompileConfig):
        super().__init__()
        self._orig_mod = model
        self.plan = plan
        self.config = config
        self.captured = CapturedGraphs()
        by_name = dict(model.named_parameters())
        self._group_params = [[by_name[p.fqn] for p in g.params] for g in plan.groups]
        self._compiled = torch.compile(
            self._step, backend=make_backend(config, plan, self.captured), fullgraph=True
        )

    def _step(self, *args, **kwargs):
        return capture.traced_forward(self._orig_mod, self.plan, self._group_params, args, kwargs)

    def forward(self, *args, **kwargs):
        with capture.active():
            return self._compiled(*args, **kwargs)

    # The original model's state, unprefixed.
    def named_parameters(self, *args, **kwargs):
        return self._orig_mod.named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self._orig_mod.parameters(recurse)

    def named_buffers(self, *args, **kwargs):
        return self._orig_mod.named_buffers(*args, **kwargs)

    def buffers(self, recurse: bool = True):
        return self._orig_mod.buffers(recurse)

    def state_dict(self, *args, **kwargs):
        return self._orig_mod.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self._orig_mod.load_state_dict(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._orig_mod, name)


def compile(model: nn.Module, config: CompileConfig | None = None, **overrides) -> CompiledFSDPModule:
    """Capture ``model`` (sharded by ``fully_shard``) as one forward graph and one backward graph.

    ``compiled(*args)`` then ``loss.backward()`` then ``optimizer.step()``, as in eager FSDP2: gradients
    land as Shard(0) DTensors on the original parameters. ``overrides`` are ``CompileConfig`` fields.
    """
    if isinstance(model, CompiledFSDPModule):
        raise TypeError("this model is already compiled by fsdp_compile.compile; pass the original module")
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise TypeError(
            "got a torch.compile'd module; pass the uncompiled fully_shard model to fsdp_compile.compile "
            "(it calls torch.compile itself)"
        )
    config = (config or CompileConfig()).replace(**overrides) if overrides else (config or CompileConfig())
    _check_supported(config)
    plan = read_plan(model)
    capture.install_hooks(model)
    return CompiledFSDPModule(model, plan, config)


def _check_supported(config: CompileConfig) -> None:
    if config.bucket not in ("fsdp_group",):
        raise NotImplementedError(
            f"bucket={config.bucket!r} needs the bucketing pass, which has not landed yet; use bucket='fsdp_group'"
        )
