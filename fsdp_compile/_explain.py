"""``explain``: capture one step on example inputs and report what the compiler sees, leaving the model as
it was."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten

from fsdp_compile import capture
from fsdp_compile._api import CompiledFSDPModule, _prepare
from fsdp_compile.config import CompileConfig
from fsdp_compile.report import Bucket, Report, collectives_by_mesh_dim, count_collectives

__all__ = ["explain"]


def explain(model: nn.Module, *example_args, config: CompileConfig | None = None, **example_kwargs) -> Report:
    """Capture forward and backward once on the example inputs and report what the compiler sees.

    No training step happens: parameter values, ``.grad``, buffers and the RNG state are restored
    afterwards. The graphs are the ones ``compile`` would hand to the configured backend (with
    Inductor's decompositions when ``backend="inductor"``), but no code is generated, so this is fast.
    Collectives run for real on a real process group (call it on every rank) and are no-ops on the
    fake one; a model entirely on the meta device is captured at full size without memory.
    """
    return explain_with_graphs(model, example_args, example_kwargs, config, stages=False)[0]


def explain_with_graphs(model: nn.Module, example_args, example_kwargs, config: CompileConfig | None = None,
                        stages: bool = True):
    """``explain``, also returning the ``CapturedGraphs`` (with ``stages``, every stage's graph in the records,
    for dumps; ``explain`` itself, which returns only the report, keeps none)."""
    if isinstance(model, CompiledFSDPModule):
        config, model = config or model.config, model._orig_mod
    _check_model_kwargs(model, example_kwargs or {})
    config, plan = _prepare(model, config, {})
    compiled = CompiledFSDPModule(model, plan, config, codegen=False, stages=stages)
    from torch._dynamo.utils import counters

    breaks_before = sum(counters["graph_break"].values())
    try:
        with _preserved_state(model):
            out = compiled(*example_args, **(example_kwargs or {}))
            leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
            if leaves:
                torch.stack([t.float().sum() for t in leaves]).sum().backward()
    finally:
        compiled.detach()  # the model as it was (still attached where a compile of it is)
    fw, bw = count_collectives(compiled.captured.forward), count_collectives(compiled.captured.backward)
    records = compiled.captured.records

    def total(stage: str, key: str) -> float | None:
        return sum(getattr(r, stage)[key] for r in records) * 1e3 if records else None

    schedule = compiled.schedule
    mesh_dims = plan.mesh_dim_of_groups()
    return Report(
        graph_breaks=sum(counters["graph_break"].values()) - breaks_before,
        recompiles=max(0, len(compiled.captured.dynamo) - 1),
        dynamo_graphs=len(compiled.captured.dynamo),
        all_gathers=fw["all_gathers"] + bw["all_gathers"],
        reduce_scatters=fw["reduce_scatters"] + bw["reduce_scatters"],
        all_reduces=fw["all_reduces"] + bw["all_reduces"],
        forward=fw,
        backward=bw,
        buckets=[
            Bucket(groups=list(u.members), params=[p.fqn for p in capture.unit_params(plan, u)], bytes=u.all_gather_bytes)
            for u in schedule.units
        ],
        backend=config.backend,
        hardware=records[0].hardware if records else None,
        est_step_ms=total("after", "step_time"),
        est_exposed_comm_ms=total("after", "exposed_comm_time"),
        est_peak_bytes=max((r.peak_after for r in records), default=None),
        eager_est_step_ms=total("before", "step_time"),
        eager_est_exposed_comm_ms=total("before", "exposed_comm_time"),
        eager_est_peak_bytes=max((r.peak_before for r in records), default=None),
        graphs=[{k: v for k, v in dataclasses.asdict(r).items() if k != "stages"} for r in records],
        schedule=schedule.to_dict(),
        planning_ms=schedule.planning_s * 1e3,
        regions=compiled.regions(),
        collectives_by_mesh_dim=collectives_by_mesh_dim(compiled.captured.forward + compiled.captured.backward, mesh_dims),
        mesh_dims=mesh_dims,
        cudagraphs=[d.to_dict() for d in compiled.captured.cudagraphs],
    ), compiled.captured


def _check_model_kwargs(model: nn.Module, kwargs: dict) -> None:
    """``explain(model, x, backend=...)``: keywords are the model's inputs, and CompileConfig fields that its
    forward does not take are almost certainly meant for the config."""
    fields = {f.name for f in dataclasses.fields(CompileConfig)} & set(kwargs)
    if not fields or not isinstance(model, nn.Module):
        return
    params = inspect.signature(model.forward).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    misplaced = sorted(f for f in fields if f not in params and not takes_any)
    if misplaced:
        shown = ", ".join(f"{f}={kwargs[f]!r}" for f in misplaced)
        raise TypeError(
            f"explain() got {shown}, which the model's forward does not take: CompileConfig fields go in "
            f"config=fsdp_compile.CompileConfig({shown}); keywords are the model's inputs"
        )


@contextlib.contextmanager
def _preserved_state(model: nn.Module):
    params = list(model.parameters())
    grads = [p.grad for p in params]
    values = [p.detach().clone() for p in params]
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        with torch.no_grad():
            for p, g, v in zip(params, grads, values):
                p.grad = g
                p.copy_(v)
            for b, v in buffers:
                b.copy_(v)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
