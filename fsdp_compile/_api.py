"""``fully_shard``, ``compile`` and the module ``compile`` returns."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as _torch_fully_shard
from torch.utils._pytree import tree_flatten

import torch.distributed as dist

from fsdp_compile import capture
from fsdp_compile._agree import agree_max
from fsdp_compile.backend import CapturedGraphs, make_backend
from fsdp_compile.config import CompileConfig
from fsdp_compile.passes.cost_model import CostModel, resolve_hardware
from fsdp_compile.passes.schedule import Schedule, modules_of, plan_schedule
from fsdp_compile.plan import ShardingPlan, check_ranks_agree, read_plan
from fsdp_compile.report import Bucket, Report, count_collectives

__all__ = ["fully_shard", "compile", "explain", "CompiledFSDPModule"]

_instances = itertools.count()


def fully_shard(module, **kwargs):
    """Drop-in for ``torch.distributed.fsdp.fully_shard``: same signature, same result (torch's classes).

    Kept as our own entry point so that anything a later compile needs at sharding time has one place to
    go; today it adds nothing and the result is indistinguishable from torch's.
    """
    return _torch_fully_shard(module, **kwargs)


fully_shard.__signature__ = inspect.signature(_torch_fully_shard)


class CompiledFSDPModule(nn.Module):
    """What ``fsdp_compile.compile`` returns: calls run the compiled one-graph step.

    It owns no state: ``parameters()``, ``named_parameters()``, ``state_dict()`` and
    ``load_state_dict()`` are the original model's (same DTensor objects, same FQNs, no prefix), so an
    optimizer, ``clip_grad_norm_`` and DCP work with either object. The original model stays usable
    eagerly with FSDP2's own hooks.
    """

    def __init__(self, model: nn.Module, plan: ShardingPlan, config: CompileConfig, *, codegen: bool = True):
        super().__init__()
        self._orig_mod = model
        self.plan = plan
        self.config = config
        self.captured = CapturedGraphs()
        self.kernels = _resolve_kernels(config.kernels, plan)
        self.cost_model = CostModel(resolve_hardware(
            config.hardware, device_type=plan.device.type, world_size=max(g.world_size for g in plan.groups)
        ))
        self.schedule: Schedule | None = None  # planned at the first call (it needs the agreed workload)
        self._codegen = codegen
        self._compiled = None
        self._unit_params: list[list[nn.Parameter]] = []

    def forward(self, *args, **kwargs):
        if self._compiled is None:
            self._plan_and_compile(args, kwargs)
        # The local shards are taken eagerly, outside the graph: DTensor.to_local() is differentiable, so
        # autograd carries each shard gradient back to its DTensor parameter's .grad, while the graph
        # sees plain tensors only (no DTensor desugaring, no DeviceMesh among the saved values, which
        # AOTAutograd's activation-checkpointing path cannot save).
        shards = [[p.to_local() for p in unit] for unit in self._unit_params]
        with capture.active(regions=self.config.regions):
            return self._compiled(shards, *args, **kwargs)

    def _plan_and_compile(self, args, kwargs) -> None:
        """The first call, on every rank together: agree on the workload, plan the communication schedule
        (the same on every rank: ``passes/schedule.py``), then build the compiled step. Later calls, and
        every recompile (new shapes, eval mode), reuse both: no rank ever plans, or talks to the others,
        on its own."""
        workload = agreed_workload(self.plan, args, kwargs)
        cfg = self.config
        self.schedule = plan_schedule(
            modules_of(self.plan), policy=cfg.bucket if isinstance(cfg.bucket, str) else [list(b) for b in cfg.bucket],
            reorder=cfg.reorder, cost_model=self.cost_model, workload=workload,
            bucket_cap_bytes=None if cfg.bucket_cap_mb is None else int(cfg.bucket_cap_mb * 2**20),
            memory_budget_bytes=None if cfg.memory_budget_gb is None else int(cfg.memory_budget_gb * 2**30),
        )
        by_name = dict(self._orig_mod.named_parameters())
        self._unit_params = [
            [by_name[p.fqn] for p in capture.unit_params(self.plan, u)] for u in self.schedule.units
        ]
        step = _make_step(self._orig_mod, self.plan, self.schedule, self.kernels)
        # its own code object: Dynamo keeps its compiled entries (and its recompile limit, 8 by default)
        # per code object, so one process can hold many compiled models without their guards evicting each other
        step = capture._unique_code(step, f"fsdp_compile_step_{next(_instances)}")
        backend = make_backend(cfg, self.plan, self.schedule, self.cost_model, self.captured, codegen=self._codegen)
        self._compiled = torch.compile(step, backend=backend, fullgraph=True)

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


def _make_step(model, plan, schedule, kernels):
    def step(shards, *args, **kwargs):
        return capture.traced_forward(model, plan, schedule, kernels, shards, args, kwargs)

    return step


def workload_of(args, kwargs) -> int:
    """Tokens per step, as the schedule's cost model counts them: the largest input, counting every
    element of an integer tensor (token ids) and every row of a floating one (features in the last dim)."""
    sizes = [1]
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.numel():
            rows = t.numel() if not t.is_floating_point() or t.dim() < 2 else t.numel() // t.shape[-1]
            sizes.append(int(rows))
    return max(sizes)


def agreed_workload(plan: ShardingPlan, args, kwargs) -> int:
    """``workload_of`` the first call's inputs, the maximum over the ranks of every FSDP process group
    (one all-reduce each; none on the fake process group): every rank then plans the same schedule."""
    local = workload_of(args, kwargs)
    if not dist.is_initialized() or dist.get_backend() == "fake":
        return local
    from torch.distributed.distributed_c10d import _resolve_process_group

    names = sorted({g.group_name for g in plan.groups})
    return agree_max(local, [_resolve_process_group(n) for n in names], plan.device)


def _resolve_kernels(kernels: str, plan: ShardingPlan) -> str:
    """"auto": the Triton kernels on CUDA (when Triton can run), torch ops elsewhere."""
    if kernels != "auto":
        return kernels
    from torch.utils._triton import has_triton

    return "triton" if plan.device.type == "cuda" and has_triton() else "torch"


def compile(model: nn.Module, config: CompileConfig | None = None, **overrides) -> CompiledFSDPModule:
    """Capture ``model`` (sharded by ``fully_shard``) as one forward graph and one backward graph.

    ``compiled(*args)`` then ``loss.backward()`` then ``optimizer.step()``, as in eager FSDP2: gradients
    land as Shard(0) DTensors on the original parameters. ``overrides`` are ``CompileConfig`` fields.
    """
    if isinstance(model, CompiledFSDPModule):
        raise TypeError("this model is already compiled by fsdp_compile.compile; pass the original module")
    config, plan = _prepare(model, config, overrides)
    return CompiledFSDPModule(model, plan, config)


def explain(model: nn.Module, *example_args, config: CompileConfig | None = None, **example_kwargs) -> Report:
    """Capture forward and backward once on the example inputs and report what the compiler sees.

    No training step happens: parameter values, ``.grad``, buffers and the RNG state are restored
    afterwards. The graphs are the ones ``compile`` would hand to the configured backend (with
    Inductor's decompositions when ``backend="inductor"``), but no code is generated, so this is fast.
    Collectives run for real on a real process group (call it on every rank) and are no-ops on the
    fake one; a model entirely on the meta device is captured at full size without memory.
    """
    return explain_with_graphs(model, example_args, example_kwargs, config)[0]


def explain_with_graphs(model: nn.Module, example_args, example_kwargs, config: CompileConfig | None = None):
    """``explain``, also returning the ``CapturedGraphs`` (every stage's graph, for dumps)."""
    if isinstance(model, CompiledFSDPModule):
        config, model = config or model.config, model._orig_mod
    config, plan = _prepare(model, config, {})
    compiled = CompiledFSDPModule(model, plan, config, codegen=False)
    from torch._dynamo.utils import counters

    breaks_before = sum(counters["graph_break"].values())
    with _preserved_state(model):
        out = compiled(*example_args, **(example_kwargs or {}))
        leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if leaves:
            torch.stack([t.float().sum() for t in leaves]).sum().backward()
    fw, bw = count_collectives(compiled.captured.forward), count_collectives(compiled.captured.backward)
    records = compiled.captured.records

    def total(stage: str, key: str) -> float | None:
        return sum(getattr(r, stage)[key] for r in records) * 1e3 if records else None

    schedule = compiled.schedule
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
    ), compiled.captured


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


def _prepare(model: nn.Module, config: CompileConfig | None, overrides: dict) -> tuple[CompileConfig, ShardingPlan]:
    """Validate the config against the model's FSDP layout, agree on it across ranks, install the hook
    dispatchers: everything ``compile`` and ``explain`` do before tracing."""
    config = _resolve_config(model, config, overrides)
    plan = read_plan(model)
    _check_against_plan(config, plan)
    check_ranks_agree(plan, config.agreement_items())
    capture.install_hooks(model)
    capture.install_regions(model, plan)
    return config, plan


def _resolve_config(model: nn.Module, config: CompileConfig | None, overrides: dict) -> CompileConfig:
    if isinstance(model, torch._dynamo.eval_frame.OptimizedModule):
        raise TypeError(
            "got a torch.compile'd module; pass the uncompiled fully_shard model (fsdp_compile calls "
            "torch.compile itself)"
        )
    if config is not None and not isinstance(config, CompileConfig):
        raise TypeError(f"config must be a fsdp_compile.CompileConfig, got {type(config).__name__}")
    config = config or CompileConfig()
    if overrides:
        config = config.replace(**overrides)
    return config


def _check_against_plan(config: CompileConfig, plan: ShardingPlan) -> None:
    """Bucketing options that name modules or sizes, checked before any trace with one clear error."""
    groups = [g.fqn for g in plan.groups]
    if not isinstance(config.bucket, str):
        seen: set[str] = set()
        for bucket in config.bucket:
            for fqn in bucket:
                if fqn not in groups:
                    raise ValueError(f"bucket plan names {fqn!r}, which is not an FSDP module; FSDP modules: {groups}")
                if fqn in seen:
                    raise ValueError(f"bucket plan names {fqn!r} twice; each FSDP module goes in one bucket")
                seen.add(fqn)
    if config.bucket_cap_mb is not None:
        largest = max(plan.groups, key=lambda g: g.unsharded_bytes)
        if largest.unsharded_bytes > config.bucket_cap_mb * 2**20:
            raise ValueError(
                f"bucket_cap_mb={config.bucket_cap_mb} is below FSDP module {largest.fqn or '<root>'!r}'s "
                f"{largest.unsharded_bytes / 2**20:.2f} MiB all-gather; raise the cap or leave it None"
            )
