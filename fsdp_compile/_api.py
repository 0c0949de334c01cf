"""``fully_shard``, ``compile`` and the module ``compile`` returns."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import itertools

import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as _torch_fully_shard
from torch.distributed.utils import _to_kwargs
from torch.utils._pytree import tree_flatten

import torch.distributed as dist

from fsdp_compile import _cudagraphs, _extensions, _fsdp2, _gc, capture
from fsdp_compile._agree import agree_max
from fsdp_compile._quote import quoted
from fsdp_compile._step import Step, traced_step
from fsdp_compile._torch._gloo import warn_if_racy_gloo
from fsdp_compile.backend import CapturedGraphs, make_backend
from fsdp_compile.config import CompileConfig
from fsdp_compile.debug.dump import make_dump_dir
from fsdp_compile.passes import CostModel, Schedule, modules_of, plan_schedule, resolve_hardware
from fsdp_compile.passes.planner import check_bucket_plan
from fsdp_compile.plan import ShardingPlan, check_ranks_agree, param_groups, read_plan, settings_key
from fsdp_compile.report import region_summary

__all__ = ["fully_shard", "compile", "CompiledFSDPModule"]

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

    def __init__(self, model: nn.Module, plan: ShardingPlan, config: CompileConfig, *, codegen: bool = True,
                 stages: bool = False):
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
        self._stages = stages  # keep each graph's readable stages in its PassRecord (explain's dumps)
        self._groups = param_groups(model)  # [(fqn, FSDP state, param group)]: FSDP2's runtime settings
        self._settings: tuple = ()  # ((fqn, _fsdp2.Settings), ...) as read at the current call
        self._plan_settings = settings_key(self._groups)  # ... as they were when self.plan was read
        self._steps: dict[tuple, Step] = {}  # per plan: FSDP2's settings other than gradient sync
        self._sinks: dict[str, torch.Tensor] = {}  # parameter FQN -> accumulation sink (no-sync micro-batches)
        self._partials: dict[str, torch.Tensor] = {}  # ... its HSDP partial sink (micro-batches without all-reduce)
        self._meta = any(p.is_meta for p in model.parameters())  # explain's full-scale capture without memory
        self._attachment = capture.attach(model, plan)
        self._watchdog: _cudagraphs.Watchdog | None = None  # cudagraphs=True with collectives: replays' deadlines
        self._calls = 0
        if config.cudagraphs:
            _cudagraphs.mark_static(model.buffers())  # read in place by the graphs, not copied in at each replay

    def forward(self, *args, **kwargs):
        if not self._attachment.attached:
            raise RuntimeError(
                "this compiled model was detached (CompiledFSDPModule.detach): call the original model for eager "
                "FSDP2, or fsdp_compile.compile(model) again"
            )
        if self.plan.device.type not in ("cpu", "meta") and (args or kwargs):
            # as FSDP2's root pre-forward does (and DDP): inputs move to the parameters' accelerator
            (args,), (kwargs,) = _to_kwargs(args, kwargs, self.plan.device, False)
        elif self.plan.device.type == "cpu" and not self._meta:
            _check_input_devices(args, kwargs, self.plan.device)
        step = self._current_step(args, kwargs)
        # The local shards are taken eagerly, outside the graph: DTensor.to_local() is differentiable, so
        # autograd carries each shard gradient back to its DTensor parameter's .grad, while the graph
        # sees plain tensors only (no DTensor desugaring, no DeviceMesh among the saved values, which
        # AOTAutograd's activation-checkpointing path cannot save).
        # All-gather extensions' fsdp_pre_all_gather runs here too (_extensions.py says why).
        world_size = {p.fqn: g.world_size for g in step.plan.groups for p in g.params}
        # explain (no codegen, any device) marks the shards static too: its report says what a GPU run captures
        replays = self.config.cudagraphs and self._codegen and self.plan.device.type == "cuda"
        shards, extensions, key = _extensions.prepare(step.params, step.param_plans, lambda pp: world_size[pp.fqn],
                                                      self.config.cudagraphs)
        sinks, accumulated, partials = self._gradient_sync(step)
        if replays:
            self._arm_watchdog("the CUDA graphs replayed before this call of the compiled model")
        try:
            with (capture.active(self.config.regions, self._attachment.loggers), _named_collective_failures(),
                  _gc.ours()):
                out = step.run(key, self.captured, shards, sinks, accumulated, partials, extensions, *args, **kwargs)
        finally:
            capture.flush_logs()
        # a later replay overwrites the graphs' outputs: what the caller keeps is copied out of the pool
        return _cudagraphs.copy_out(out) if replays else out

    def _arm_watchdog(self, label: str) -> None:
        """Before each call's replay: everything queued so far (the last step's backward graph) must finish
        within the process groups' timeout (NCCL's watchdog does not see collectives replayed from a graph)."""
        self._calls += 1
        groups = [g for g in self.plan.process_groups() if g.size() > 1]
        if not groups:  # no collective in the graphs: nothing can wait on a peer
            return
        if self._watchdog is None:
            timeout = min(_cudagraphs.group_timeout(g) for g in groups).total_seconds()
            self._watchdog = _cudagraphs.Watchdog(timeout, lambda what: self._on_timeout(what, groups))
        event = torch.cuda.Event()
        event.record()
        self._watchdog.arm(event, f"{label} (call {self._calls})")

    @staticmethod
    def _on_timeout(what: str, groups) -> None:
        import logging

        logging.getLogger(__name__).error(
            "fsdp_compile: %s did not finish within the process group's timeout; aborting its process groups", what)
        _cudagraphs.abort_groups(groups)

    def close(self) -> None:
        """Free what ``cudagraphs=True`` holds: the CUDA graphs (all of torch's graph trees in this process)
        and their memory pool, and the replay watchdog. Call it before ``dist.destroy_process_group()``: the
        graphs hold the communicators they captured. A later call of the model records the graphs anew.
        Nothing to do without ``cudagraphs``; idempotent."""
        if self.config.cudagraphs and self.plan.device.type == "cuda" and self._codegen:
            self._arm_watchdog("the CUDA graphs replayed before close()")  # a hung replay must not hang here
            torch.cuda.synchronize()
            _cudagraphs.release()
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    def _current_step(self, args, kwargs) -> Step:
        """The compiled step for FSDP2's current settings and parameters (a change takes effect here)."""
        for fqn, _, pg in self._groups:
            if _fsdp2.all_gather_in_flight(pg):
                raise ValueError(
                    f"FSDP module {fqn or '<root>'!r} has an all-gather in flight (model.unshard(async_op=True)): "
                    "wait on its UnshardHandle and call model.reshard() before calling the compiled model, which "
                    "gathers the parameters itself"
                )
            if not _fsdp2.is_sharded(pg):
                # left unsharded by an eager forward (the root, reshard_after_forward=False) or by unshard():
                # the compiled step reads the shards, which those copies came from; FSDP2's reshard() frees
                # them and puts the sharded parameters back on the modules (local, no collective)
                _fsdp2.reshard(pg)
        key = self._settings = self._read_settings()
        # gradient sync is a mode of a step, not another plan, while it is alike for every module: with
        # bucket="auto", modules with and without sync must not share a unit (one reduce-scatter), so a mix
        # is planned anew, with buckets that split along it (an explicit plan is the user's: _gradient_sync).
        # Modules that still hold gradients accumulated without sync count as without: the step that syncs
        # them keeps the split, so each unit's accumulated gradients are all there or all absent.
        # HSDP without all-reduce (set_requires_all_reduce(False)) is a third mode, split along the same way.
        pending = {fqn for fqn, sink in self._sinks.items() if sink.grad is not None}  # parameter FQNs
        groups = {fqn: self.plan.group(fqn) for fqn, _ in key}
        modes = {
            fqn: "no_sync" if not s.requires_gradient_sync or any(p.fqn in pending for p in groups[fqn].params)
            else "sync" if s.requires_all_reduce or not groups[fqn].replicate_group_name else "no_all_reduce"
            for fqn, s in key
        }
        mixed = tuple(sorted(modes.items())) if self.config.bucket == "auto" and len(set(modes.values())) > 1 else None
        plan_key = (tuple((fqn, settings.without_sync_flags()) for fqn, settings in key), mixed)
        step = self._steps.get(plan_key)
        if step is None:
            if self._steps or key != self._plan_settings:  # a setting changed since the plan was read (refuses
                self.plan, self._plan_settings = read_plan(self._orig_mod), key  # what we cannot do)
            step = self._steps[plan_key] = self._plan_and_compile(args, kwargs, dict(mixed or ()))
        elif not step.current():
            # parameters replaced (load_state_dict(assign=True), to_empty, ...): FSDP2's own references too
            for _, _, pg in self._groups:
                _fsdp2.reset_sharded_params(pg)
            plan = read_plan(self._orig_mod)
            if plan.fingerprint() != self.plan.fingerprint():
                raise ValueError(
                    "the model's parameters were replaced by ones of other shapes, dtypes or sharding than "
                    "fsdp_compile.compile planned for: call fsdp_compile.compile again on the model"
                )
            step.params = step.lookup(self._orig_mod)
        self.schedule = step.schedule
        return step

    def _read_settings(self) -> tuple:
        """FSDP2's settings as this call's step reads them (a pipeline stage's differ: ``_pipeline.py``)."""
        return settings_key(self._groups)

    def _gradient_sync(self, step: Step) -> tuple[list, list, list]:
        """Per unit: sinks for the unsharded gradients (FSDP2's set_requires_gradient_sync(False): no
        reduce-scatter, gradients accumulated unsharded) or, when it syncs, the gradients accumulated so
        far (consumed by this step's reduce-scatter, so forgotten here); and HSDP's (partial sinks, partials):
        without all-reduce (set_requires_all_reduce(False)) sinks for the reduce-scattered rows, with it the
        rows accumulated so far (consumed by this step's all-reduce)."""
        flags_of = {fqn: (s.requires_gradient_sync, s.requires_all_reduce or not step.plan.group(fqn).replicate_group_name)
                    for fqn, s in self._settings}
        sinks, accumulated, partials = [], [], []
        for unit, params, plans in zip(step.schedule.units, step.params, step.param_plans):
            flags = {flags_of[f] for f in unit.members}
            if len(flags) > 1:  # only an explicit bucket plan gets here: "auto" re-plans (_current_step)
                raise ValueError(
                    f"set_requires_gradient_sync or set_requires_all_reduce differs between FSDP modules "
                    f"{list(unit.members)}, which your bucket plan (CompileConfig.bucket) puts in one all-gather and "
                    "reduce-scatter: set it alike for them, or put them in separate buckets (bucket='auto' splits "
                    "buckets along it by itself)"
                )
            sync, all_reduce = flags.pop()
            if sync:
                sinks.append([])
                accumulated.append(_take_grads(self._sinks, plans))
                if all_reduce:
                    partials.append(([], _take_grads(self._partials, plans)))
                else:
                    partials.append(([self._sink(pp, step.plan, self._partials) if pp.requires_grad else None
                                      for pp in plans], []))
            else:
                sinks.append([self._sink(pp, step.plan) if pp.requires_grad else None for pp in plans])
                accumulated.append([])
                partials.append(([], []))
        return sinks, accumulated, partials

    def _sink(self, pp, plan: ShardingPlan, sinks: dict | None = None) -> torch.Tensor:
        """``pp``'s accumulation sink: of its full shape (no sync), or of its shard's (``self._partials``)."""
        sinks = self._sinks if sinks is None else sinks
        sink = sinks.get(pp.fqn)
        if sink is None:
            group = next(g for g in plan.groups if any(q.fqn == pp.fqn for q in g.params))
            dtype = group.reduce_dtype or group.param_dtype or pp.orig_dtype  # FSDP2 accumulates in the reduce dtype
            # a leaf of the parameter's full shape that owns one element: only its .grad holds memory
            shape = pp.full_shape if sinks is self._sinks else (pp.local_rows, *pp.full_shape[1:])
            sink = torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device=plan.device)
            sinks[pp.fqn] = sink.requires_grad_()
            if self.config.cudagraphs:  # its gradient accumulates over replays: out of the graphs' pool first
                sink.register_hook(torch.Tensor.clone)
        return sink

    def _plan_and_compile(self, args, kwargs, modes: dict | None = None) -> Step:
        """On every rank together (the first call, or the first after FSDP2's settings changed): agree on
        the workload, plan the communication schedule (the same on every rank: ``passes/planner.py``),
        then build the compiled step. Later calls, and every recompile (new shapes, eval mode), reuse
        both: no rank ever plans, or talks to the others, on its own."""
        workload = agreed_workload(self.plan, args, kwargs)
        cfg = self.config
        modules = modules_of(self.plan)
        if modes:  # modules with equal keys may share a unit: with and without sync (or all-reduce) may not
            modules = [dataclasses.replace(m, key=m.key._replace(gradient_sync=modes[m.fqn])) for m in modules]
        schedule = plan_schedule(
            modules, policy=cfg.bucket if isinstance(cfg.bucket, str) else [list(b) for b in cfg.bucket],
            reorder=cfg.reorder, cost_model=self.cost_model, workload=workload,
            bucket_cap_bytes=None if cfg.bucket_cap_mb is None else int(cfg.bucket_cap_mb * 2**20),
            memory_budget_bytes=None if cfg.memory_budget_gb is None else cfg.memory_budget_gb * 2**30,
        )
        plan = self.plan

        def build(key: tuple, deferred: dict[str, int]):
            fn = traced_step(self._orig_mod, plan, schedule, self.kernels, key, deferred)
            # its own code object: Dynamo keeps its compiled entries (and its recompile limit, 8 by default)
            # per code object, so one process can hold many compiled models without their guards evicting each other
            fn = capture._unique_code(fn, f"fsdp_compile_step_{next(_instances)}")
            backend = make_backend(cfg, plan, schedule, self.cost_model, self.captured, codegen=self._codegen,
                                   stages=self._stages)
            return torch.compile(fn, backend=backend, fullgraph=True)

        return Step(self._orig_mod, self.plan, schedule, build, self._attachment.deferred)

    def detach(self) -> None:
        """Give the model back to eager FSDP2 exactly as ``compile`` found it: FSDP2's own forward hooks under
        their hook ids, each repeated block's own ``forward``. Calling this object afterwards raises; the
        parameters, gradients and optimizer state are the model's and stay as they are. Idempotent."""
        self._attachment.detach()

    def regions(self) -> list[dict]:
        """Per kind of repeated block: compiled once as a region, or inline and why (``Report.regions``), as
        ``compile`` found the blocks and the compiled steps since (``Attachment.inline``)."""
        a = self._attachment
        return region_summary(a.repeated, self.captured.regions, self.config.regions, a.inline(), len(self.captured.dynamo))

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


def _check_input_devices(args, kwargs, device: torch.device) -> None:
    for t in tree_flatten((args, kwargs))[0]:
        if isinstance(t, torch.Tensor) and t.device.type != device.type:
            raise ValueError(
                f"an input tensor of shape {tuple(t.shape)} is on {t.device}, but the model's parameters are on "
                f"{device}: move the inputs there first"
            )


@contextlib.contextmanager
def _named_collective_failures():
    """A collective of the compiled step that fails (a peer gone, sizes that do not match, a timeout) is
    almost always ranks that diverged: say so, and what to check, instead of gloo's or NCCL's words alone."""
    try:
        yield
    except (RuntimeError, dist.DistError) as e:
        text = str(e)
        markers = ("gloo", "Gloo", "NCCL", "Connection closed", "Timed out", "timed out", "Received data size",
                   "doesn't match", "connection reset", "Connection reset", "DistBackendError")
        if not dist.is_initialized() or not any(m in text or m in type(e).__name__ for m in markers):
            raise
        raise RuntimeError(
            f"fsdp_compile: a collective of the compiled step failed on rank {dist.get_rank()} ({quoted(e)}). The "
            "ranks most likely diverged: every rank must call the compiled model for every step, with the same "
            "model and config, and none may have stopped; the first rank to fail says why (docs/troubleshooting.md)"
        ) from e


def _take_grads(sinks: dict, plans) -> list:
    """The gradients accumulated in ``plans``' sinks (forgotten there: this step consumes them), or []."""
    out = []
    for pp in plans:
        sink = sinks.get(pp.fqn)
        out.append(None if sink is None else sink.grad)
        if sink is not None:
            sink.grad = None
    return out if any(a is not None for a in out) else []


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
    (over its store, ``_agree``; nothing on the fake process group): every rank then plans the same schedule."""
    local = workload_of(args, kwargs)
    return agree_max(local, plan.process_groups(), "the tokens per step (at the compiled model's first call)")


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
    _fsdp2.warn_if_untested_torch()
    if isinstance(model, nn.Module):
        meta = [n for n, p in model.named_parameters() if p.is_meta]
        if meta:
            raise ValueError(
                f"{len(meta)} parameters are still on the meta device (e.g. {meta[0]!r}): materialize them before "
                "training, as fully_shard requires (model.to_empty(device=...), then initialize them); "
                "fsdp_compile.explain captures a meta model without memory"
            )
    config, plan = _prepare(model, config, overrides)
    if config.cudagraphs and plan.device.type != "cuda":
        raise ValueError(
            f"cudagraphs=True replays CUDA graphs, but the model's parameters are on {plan.device}: leave cudagraphs "
            "off there (fsdp_compile.explain(..., cudagraphs=True) still reports which graphs could be captured)"
        )
    return CompiledFSDPModule(model, plan, config)


def _prepare(model: nn.Module, config: CompileConfig | None, overrides: dict) -> tuple[CompileConfig, ShardingPlan]:
    """Validate the config against the model's FSDP layout (creating its dump directory) and agree on it
    across ranks: everything ``compile`` and ``explain`` do before ``CompiledFSDPModule`` attaches."""
    config = _resolve_config(model, config, overrides)
    if config.dump_dir is not None:
        make_dump_dir(config.dump_dir)
    plan = read_plan(model)
    _check_against_plan(config, plan)
    check_ranks_agree(plan, config.agreement_items())
    warn_if_racy_gloo(plan.process_groups())
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
    if not isinstance(config.bucket, str):
        check_bucket_plan(modules_of(plan), config.bucket)
    if config.bucket_cap_mb is not None:
        largest = max(plan.groups, key=lambda g: g.unsharded_bytes)
        if largest.unsharded_bytes > config.bucket_cap_mb * 2**20:
            raise ValueError(
                f"bucket_cap_mb={config.bucket_cap_mb} is below FSDP module {largest.fqn or '<root>'!r}'s "
                f"{largest.unsharded_bytes / 2**20:.2f} MiB all-gather; raise the cap or leave it None"
            )
