"""Traceable FSDP2: bypass FSDP2's eager hooks while our compiled step runs, gather through our ops.

FSDP2 registers ``FSDPState._pre_forward`` / ``_post_forward`` as module hooks, and both are
``torch._dynamo.disable``d: Dynamo cannot trace them (``fullgraph=True`` fails with "Attempted to call
function marked as skipped"). We replace each of those two hook entries, in place and under the same
hook id, by a dispatcher:

* outside our compiled step it calls FSDP2's hook unchanged, so eager use of the model (evaluation,
  debugging, plain ``torch.compile``) keeps FSDP2's exact behaviour;
* inside it (``STEP.active``, which Dynamo guards on) it does only the traceable part of FSDP2's hook: the
  ``MixedPrecisionPolicy`` casts (``cast_forward_inputs`` before, ``output_dtype`` after).

The parameters come from ``traced_forward``: for every unit of the communication schedule (an FSDP
group, a bucket of them, or one parameter) one ``fsdp_compile::unshard`` over its local shards (``DTensor.to_local()``, taken just outside the graph, so gradients arrive as
Shard(0) DTensor ``.grad`` on the original parameters), then the model runs with the full tensors in
its parameters' places (``call_with``). The passes then move each unshard to just before its group's first use
(``passes/placement.py``), which is where FSDP2's pre-forward hook would have issued it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import types
import weakref
from typing import NamedTuple

import torch
import torch.nn as nn

from fsdp_compile import _extensions, _fsdp2
from fsdp_compile._torch import _invoke_subgraph
from fsdp_compile._annotations import UNSHARD, annotate
from fsdp_compile.ops import Comm, Reduction, UnshardArgs
from fsdp_compile.passes.schedule import Schedule, Unit
from fsdp_compile.plan import ParamPlan, ShardingPlan, fsdp_states

class _StepState:
    """What FSDP2's hook dispatchers and the regional forwards read: whether our compiled step is running
    (and being traced: Dynamo guards on these attributes), and whether repeated blocks run as regions.
    Set only for the duration of one compiled call, by ``active``; one object, so the guards stay put."""

    active = False
    regions = False


STEP = _StepState()


class _Active:
    def __init__(self, regions: bool, loggers: list[tuple[object, object]]):
        self.regions, self.loggers = regions, loggers

    def __enter__(self):
        self._prev = (STEP.active, STEP.regions)
        STEP.active, STEP.regions = True, self.regions
        self._patches = contextlib.ExitStack()
        self._patches.enter_context(_invoke_subgraph.schemas_cached())
        self._patches.enter_context(_invoke_subgraph.reuse_checked())
        self._saved = [(module, module.logger) for module, _ in self.loggers]
        for module, proxy in self.loggers:
            module.logger = proxy

    def __exit__(self, *exc):
        STEP.active, STEP.regions = self._prev
        self._patches.__exit__(*exc)
        for module, logger in reversed(self._saved):
            module.logger = logger


def active(regions: bool = False, loggers: list[tuple[object, object]] = ()) -> _Active:
    """The compiled call's scope: FSDP2's hooks dispatch to ours, blocks to their regions (``regions``), and
    the model's loggers (``install_logging``) defer their messages to ``flush_logs``."""
    return _Active(regions, list(loggers))


# --- logging inside the captured step -------------------------------------------------------------------
#
# Model code logs (transformers' ``logger.warning_once`` in its loss, say), and Dynamo cannot trace a
# logging.Logger method: under fullgraph=True that is an error. Dynamo's ``reorderable_logging_functions``
# do not help: torch 2.13 replays only the calls made in the top frame and drops those inside inlined
# functions, i.e. every call a model makes. While our step runs, each such module's ``logger`` global is
# a stand-in whose logging methods append ``(logger, method, args, kwargs)`` to ``_PENDING``: a list
# mutation, which Dynamo traces and replays after the graph like any side effect. ``flush_logs`` (after
# every compiled call) hands them to the real logger, so the message is emitted, once where it says once.

_LOG_METHODS = ("debug", "info", "warning", "warn", "error", "critical", "exception", "log", "warning_once",
                "info_once", "warning_advice")
_REAL: dict[str, logging.Logger] = {}  # logger name -> the module's real logger
_PENDING: list[tuple] = []  # (logger name, method, args, kwargs) logged by the last compiled call


class _DeferredLogger:
    def __init__(self, logger: logging.Logger):
        self._logger = logger
        self._name = logger.name
        _REAL[logger.name] = logger

    def __getattr__(self, name: str):  # everything but the logging methods: the real logger's
        return getattr(self._logger, name)


def _deferred(method: str):
    def log(self, *args, **kwargs):
        _PENDING.append((self._name, method, args, kwargs))

    log.__name__ = method
    return log


for _method in _LOG_METHODS:
    setattr(_DeferredLogger, _method, _deferred(_method))


def flush_logs() -> None:
    """Emit what the model logged during the compiled call, through the real loggers, in order."""
    pending = list(_PENDING)
    _PENDING.clear()
    for name, method, args, kwargs in pending:
        getattr(_REAL[name], method)(*args, **kwargs)


def install_logging(model: nn.Module) -> list[tuple[object, object]]:
    """``(module, stand-in)`` for the ``logger`` globals of the modules that define the model's classes,
    and of transformers (its base classes and losses log too): ``active`` swaps them in for one call."""
    names = {type(m).__module__ for m in model.modules()}
    names |= {n for n in sys.modules if n == "transformers" or n.startswith("transformers.")}
    out = []
    for name in sorted(names):
        module = sys.modules.get(name)
        logger = getattr(module, "logger", None) if module is not None else None
        if isinstance(logger, logging.Logger):
            out.append((module, _DeferredLogger(logger)))
    return out


def _make_pre_hook(state, fsdp_hook):
    policy = _fsdp2.mp_policy(state)
    cast = _fsdp2.floating_cast(policy.param_dtype) if policy.cast_forward_inputs and policy.param_dtype else None

    def fsdp_compile_pre_forward(module, args, kwargs):
        if not STEP.active:
            return fsdp_hook(module, args, kwargs)
        if cast is None:
            return args, kwargs
        return cast(args), cast(kwargs)

    fsdp_compile_pre_forward.fsdp_hook = fsdp_hook
    return fsdp_compile_pre_forward


def _make_post_hook(state, fsdp_hook):
    output_dtype = _fsdp2.mp_policy(state).output_dtype
    cast = _fsdp2.floating_cast(output_dtype) if output_dtype is not None else None

    def fsdp_compile_post_forward(module, input, output):
        if not STEP.active:
            return fsdp_hook(module, input, output)
        return output if cast is None else cast(output)

    fsdp_compile_post_forward.fsdp_hook = fsdp_hook
    return fsdp_compile_post_forward


def _wraps(hook, fn) -> bool:
    """``hook`` is ``fn``, or wraps it: a group's hooks are ``functools.wraps`` wrappers of the state's
    (``_register_group_forward_hooks``), themselves wrapped by ``torch._dynamo.disable``."""
    for _ in range(8):
        if hook is None:
            return False
        if hook == fn:
            return True
        hook = getattr(hook, "__wrapped__", None)
    return False


def install_hooks(model: nn.Module) -> list[tuple[dict, int, object]]:
    """Swap FSDP2's forward hooks for dispatchers, in place, under the same hook ids (eager behaviour is
    unchanged). A group of several modules (``fully_shard([m1, m2])``) has FSDP2's hooks, wrapped, on each
    of them. Returns ``(hook dict, hook id, dispatcher)`` per swap, for ``Attachment.detach``."""
    swapped = []
    for fqn, _, state in fsdp_states(model):
        pre, post = _fsdp2.forward_hooks(state)
        for module in _fsdp2.modules(state):
            for hooks, fsdp_fn, make in (
                (module._forward_pre_hooks, pre, _make_pre_hook),
                (module._forward_hooks, post, _make_post_hook),
            ):
                found = False
                for hook_id, hook in list(hooks.items()):
                    if _wraps(hook, fsdp_fn) and not hasattr(hook, "fsdp_hook"):
                        hooks[hook_id] = make(state, hook)
                        swapped.append((hooks, hook_id, hooks[hook_id]))
                        found = True
                if not found:
                    raise RuntimeError(f"FSDP2's forward hooks on {fqn or '<root>'!r} are missing; was a hook removed?")
    return swapped


class Attachment:
    """What ``compile`` and ``explain`` install on a model: FSDP2's forward hooks swapped for dispatchers
    (``install_hooks``), repeated blocks' forwards routed to regions (``install_regions``), and the model's
    logger stand-ins (``install_logging``, swapped in only during a compiled call). Installed once per model
    and shared by everything attached to it; ``detach`` puts the model back as it was when the last user
    detaches."""

    def __init__(self, model: nn.Module, installed: _Installed):
        self.model, self._installed, self.attached = model, installed, True

    @property
    def repeated(self) -> list[list[str]]:
        return self._installed.repeated

    @property
    def loggers(self) -> list[tuple[object, object]]:
        return self._installed.loggers

    def detach(self) -> None:
        if not self.attached:
            return
        self.attached = False
        installed = self._installed
        installed.users -= 1
        if installed.users:
            return
        del _INSTALLED[self.model]
        for hooks, hook_id, dispatcher in installed.hooks:
            if hooks.get(hook_id) is dispatcher:
                hooks[hook_id] = dispatcher.fsdp_hook
        for block, previous, ours in installed.forwards:
            if block.__dict__.get("forward") is ours:
                if previous is None:
                    del block.forward
                else:
                    block.forward = previous


class _Installed:
    def __init__(self, hooks, repeated, forwards, loggers):
        self.hooks, self.repeated, self.forwards, self.loggers, self.users = hooks, repeated, forwards, loggers, 0


_INSTALLED: "weakref.WeakKeyDictionary[nn.Module, _Installed]" = weakref.WeakKeyDictionary()


def attach(model: nn.Module, plan: ShardingPlan) -> Attachment:
    """Install (once per model) what the compiled step needs on ``model``; see ``Attachment``."""
    installed = _INSTALLED.get(model)
    if installed is None:
        hooks = install_hooks(model)
        repeated, forwards = install_regions(model, plan)
        installed = _INSTALLED[model] = _Installed(hooks, repeated, forwards, install_logging(model))
    installed.users += 1
    return Attachment(model, installed)


class UnitTrace(NamedTuple):
    """What ``traced_forward`` reads of one schedule unit, found once outside the trace (Dynamo traces every
    read: walking the plan for a unit's parameters and its group cost about 17 ms of tracing per unit, HF
    Llama at 16 layers, Dynamo's profiler)."""

    arguments: str  # its encoded ``UnshardArgs`` (``unshard_args``), a constant of the graph
    params: tuple[ParamPlan, ...]  # ``unit_params``: the parameters its op takes and returns, in order
    fqns: tuple[str, ...]
    parallel: tuple | None  # per parameter, its TP/EP spec (``ParamPlan.parallel``); None where no parameter has one
    members: tuple[str, ...]
    param_dtype: torch.dtype | None


def unit_traces(plan: ShardingPlan, schedule: Schedule, kernels: str, key: tuple) -> list[UnitTrace]:
    """``UnitTrace`` of every unit of ``schedule``, for the all-gather extension key ``key``."""
    out = []
    for i, unit in enumerate(schedule.units):
        params = tuple(unit_params(plan, unit))
        parallel = tuple(p.parallel for p in params)
        out.append(UnitTrace(
            unshard_args(plan, unit, i, kernels, key[i]).encode(), params, tuple(p.fqn for p in params),
            parallel if any(x is not None for x in parallel) else None, unit.members, plan.group(unit.members[0]).param_dtype,
        ))
    return out


def traced_forward(
    model: nn.Module, units: list[UnitTrace], key: tuple, places: dict, shards: list[list[torch.Tensor]],
    sinks: list[list], accumulated: list[list], extensions: list[list], args, kwargs
):
    """The function Dynamo captures: one ``fsdp_compile::unshard`` per unit of the schedule (``shards[i]``:
    the local shards of ``units[i].params``, whose op arguments ``units[i].arguments`` were encoded before
    tracing; ``sinks[i]`` / ``accumulated[i]``: gradient accumulation without sync, see the op; ``key[i]`` /
    ``extensions[i]``: its all-gather extensions, ``_extensions.prepare``), then the model on the full
    parameters (``places``: ``parameter_places``)."""
    full = {}
    for i, (unit, unit_shards) in enumerate(zip(units, shards)):
        if key[i] is None:
            gathered = torch.ops.fsdp_compile.unshard(unit_shards, sinks[i], accumulated[i], [], unit.arguments)
            if unit.parallel is None:
                for fqn, t in zip(unit.fqns, gathered):
                    full[fqn] = t
            else:
                for fqn, spec, t in zip(unit.fqns, unit.parallel, gathered):
                    full[fqn] = t if spec is None else _as_dtensor(t, spec)
            continue
        selves, payloads, metadatas = _extensions.split(extensions[i], key[i])
        outs = iter(torch.ops.fsdp_compile.unshard(unit_shards, sinks[i], accumulated[i], payloads, unit.arguments))
        with annotate(UNSHARD, unit.members, i):  # part of the unit's unshard chain (re-gathered for reshard_after_forward)
            for p, layout in zip(unit.params, key[i]):
                if layout is None:
                    full[p.fqn] = next(outs)
                    continue
                outputs = [next(outs) for _ in range(layout.n_inputs)]
                full[p.fqn] = _extensions.post_all_gather(
                    selves.pop(0), outputs, metadatas.pop(0), next(outs), unit.param_dtype or p.orig_dtype, p.extension, p.fqn)
    return call_with(model, places, full, args, kwargs)


def parameter_places(model: nn.Module, fqns) -> dict[str, tuple[tuple[dict, str], ...]]:
    """Where each parameter ``fqns`` names is held: ``(module._parameters, name)`` for every module that holds
    it, every alias of a tied one included (``functional_call(tie_weights=True)``'s untying). Found once,
    outside the trace: Dynamo traced ``functional_call``'s walk of every module's parameters on every
    compile, 0.35 s per layer of an HF Llama (and reading ``module._parameters`` in the trace, 1 ms each)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, module in nn.Module.named_modules(model, remove_duplicate=False):
        for name, param in module._parameters.items():
            if param is not None and (module, name) not in holders.setdefault(id(param), []):
                holders[id(param)].append((module, name))
    out = {}
    for fqn in fqns:
        path, _, name = fqn.rpartition(".")
        module = _get(model, path) if path else model
        param = module._parameters.get(name)
        if param is None:
            raise ValueError(f"fsdp_compile: no parameter {fqn!r} on the model: call fsdp_compile.compile again")
        out[fqn] = tuple((holder._parameters, key) for holder, key in holders[id(param)])
    return out


def call_with(model: nn.Module, places: dict, tensors: dict[str, torch.Tensor], args, kwargs):
    """``model(*args, **kwargs)`` with each parameter named in ``tensors`` replaced, at every place it is held
    (``parameter_places``), by its tensor: ``functional_call(model, tensors, args, kwargs, tie_weights=True)``
    for a dict of parameters, without the module walk. The parameters are put back on the way out."""
    saved = []
    try:
        for fqn, tensor in tensors.items():
            for held, name in places[fqn]:
                saved.append((held, name, held[name]))
                held[name] = tensor
        return model(*args, **kwargs)
    finally:
        for held, name, param in reversed(saved):
            held[name] = param


def _as_dtensor(local: torch.Tensor, spec):
    """A gathered TP/EP-local tensor as the DTensor its module's parallel plan expects (FSDP2's
    ``init_unsharded_param``). Differentiable: the gradient comes back as the local tensor, redistributed
    to ``spec.placements`` first where it is not already (a Partial gradient of a replicated weight is
    all-reduced over its mesh), as FSDP2 does before its reduce-scatter."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)


def unit_params(plan: ShardingPlan, unit: Unit) -> list[ParamPlan]:
    """The parameters one unit gathers, in the order its op takes and returns them."""
    params = [p for fqn in unit.members for p in plan.group(fqn).params]
    return [p for p in params if p.fqn in unit.params] if unit.params is not None else params


def unshard_args(plan: ShardingPlan, unit: Unit, index: int, kernels: str, layouts: tuple | None = None) -> UnshardArgs:
    """The ``fsdp_compile::unshard`` arguments of schedule unit ``index`` (its members share everything but
    their parameters: ``GroupPlan.bucket_key``); ``layouts``: its all-gather extensions' (``_extensions.Layout``)."""
    group = plan.group(unit.members[0])
    payloads = () if layouts is None else tuple(0 if x is None else x.n_inputs for x in layouts)
    return UnshardArgs(
        comm=Comm(unit.members, index, group.group_name, group.world_size, kernels),
        dim0s=tuple(p.full_shape[0] for p in unit_params(plan, unit)),
        param_dtype=group.param_dtype,
        reduction=Reduction(group.reduce_dtype, group.reduce_op, group.pre_factor, group.post_factor,
                            group.replicate_group_name, group.all_reduce_op),
        payloads=payloads,
    )


# --- regions: each repeated block traced and compiled once -------------------------------------------------
#
# A model's blocks (same class, parameter shapes, dtypes and mixed precision) run through one
# ``torch.compiler.nested_compile_region`` function per kind of block, which takes the block's unsharded
# parameters and buffers as explicit inputs: AOTAutograd partitions and Inductor compiles the body once, and
# every block calls it (``invoke_subgraph``). The collectives and copies stay in the top-level graph, where
# the passes see them. Each block's own forward is what the region replaces: its FSDP hooks (our
# dispatchers) and any user hooks run per block, outside.
#
# A region traces one block and reuses the trace, so nothing that differs between blocks may be read inside
# it. Blocks whose plain attributes (ints, floats, strings, ...) are all equal share a template block and a
# reuse key: traced once. Blocks that differ in some attribute (HF decoder layers carry their layer_idx)
# pass themselves in instead, without a key: Dynamo traces the first and reuses that trace for the others
# where the guards on what it read hold, else traces them too and keeps one subgraph for identical ones
# (what it would have read differently, it keeps apart). Blocks with hooks inside are left alone.


_PLAIN = (int, float, str, bool, type(None))


def _plain_attributes(module: nn.Module) -> tuple:
    out = []
    for name, sub in nn.Module.named_modules(module):
        attrs = tuple(sorted((k, v) for k, v in vars(sub).items() if isinstance(v, _PLAIN)))
        out.append((name, attrs))
    return tuple(out)


def _has_inner_hooks(module: nn.Module) -> bool:
    for name, sub in nn.Module.named_modules(module):
        hooks = list(sub._forward_hooks.values()) + list(sub._forward_pre_hooks.values())
        if name == "":  # the block's own: FSDP2's (our dispatchers) run outside the region, per block
            hooks = [h for h in hooks if not hasattr(h, "fsdp_hook")]
        if hooks or sub._backward_hooks or sub._backward_pre_hooks:
            return True
    return False


def find_repeated_blocks(model: nn.Module, plan: ShardingPlan) -> list[list[str]]:
    """FSDP modules that can share one region, grouped (two or more each), in forward order."""
    modules = dict(model.named_modules())
    kinds: dict[tuple, list[str]] = {}
    for g in plan.groups:
        if g.fqn == "" or plan.has_fsdp_children(g.fqn):
            continue
        m = modules[g.fqn]
        # raw names: CheckpointWrapper.named_parameters() strips its own prefix
        params = list(nn.Module.named_parameters(m))
        if {f"{g.fqn}.{n}" for n, _ in params} != {p.fqn for p in g.params} or _has_inner_hooks(m):
            continue
        signature = (
            type(m), g.param_dtype,
            tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in params),
            tuple((n, tuple(b.shape), b.dtype) for n, b in nn.Module.named_buffers(m)),
        )
        kinds.setdefault(signature, []).append(g.fqn)
    return [fqns for fqns in kinds.values() if len(fqns) >= 2]


def _reuse_key(spec, *operands) -> int:
    """What the template trace depends on besides the block: the call's structure (``_flatten_call``'s spec)
    and its operands' dtypes, ranks, requires_grad. Dynamo traces it at every call of the region: a flat call
    is hashed as it is (a pytree walk cost 16 ms a call), the rare nested one through its leaves."""
    leaves = operands if spec is not None else torch.utils._pytree.tree_leaves(operands)
    return hash((spec, *[
        (t.dtype, t.dim(), t.requires_grad) if isinstance(t, torch.Tensor) else (type(t).__name__, repr(t))
        for t in leaves
    ]))


def _make_region(blocks: list[nn.Module], index: int):
    from torch.nn.utils.stateless import _reparametrize_module

    template = blocks[0]
    names = tuple(n for n, _ in nn.Module.named_parameters(template)) + tuple(n for n, _ in nn.Module.named_buffers(template))
    forward = type(template).forward
    n = len(names)
    if len({_plain_attributes(b) for b in blocks}) == 1:
        def region(spec, *operands):
            tensors, args, kwargs = _unflatten_call(spec, n, operands)
            with _reparametrize_module(template, dict(zip(names, tensors))):
                return forward(template, *args, **kwargs)

        return torch.compiler.nested_compile_region(_unique_code(region, f"fsdp_compile_region_{index}"), reuse_hash_fn=_reuse_key), names, False

    # Each block is passed in with its unsharded tensors already in place (traced_forward's call_with put
    # them there), so the body sets nothing: Dynamo reuses the first block's trace for every later block whose
    # guards on what the trace read hold (a layer_idx read by a KV cache's update does not), and traces the
    # others as themselves. The tensors are operands so that the reuse maps each block's own to the subgraph's.
    def region_of(block, tensors, *args, **kwargs):
        return forward(block, *args, **kwargs)

    return torch.compiler.nested_compile_region(_unique_code(region_of, f"fsdp_compile_region_{index}")), names, True


# Why a kind of repeated block is compiled inline before any trace (``passes/regions.py`` decides the rest
# on the traced graphs).
INLINE_PARALLEL = (
    "its parameters are DTensors of tensor or expert parallelism, and torch 2.13's invoke_subgraph hands a "
    "region's DTensor outputs back as plain tensors (measured on torchtitan's Llama3 with TP)"
)


INLINE_SUBCLASS = (
    "fsdp_post_all_gather rebuilds its parameter {fqn!r} as a {kind}, and torch 2.13's invoke_subgraph takes no "
    "tensor subclass operands (measured with torchao's float8 weights)"
)


INLINE_FLOAT8 = (
    "it holds torchao float8 modules ({kind}): under Inductor, a region holding their dynamic float8 casts "
    "trained to another loss than eager FSDP2, torch.compile and the same blocks inline (measured: 3.08 against "
    "2.339 after 14 steps of bench/compiled_vs_eager.py --float8 --quick; bitwise under aot_eager), cause not "
    "found yet"
)


def inline_reason(plan: ShardingPlan, fqns: list[str], model: nn.Module) -> str | None:
    """Why the blocks ``fqns`` (one kind) of ``model`` cannot run as a region at all, or None."""
    params = [p for f in fqns for p in plan.group(f).params]
    if any(p.parallel is not None for p in params):
        return INLINE_PARALLEL
    for p in params:
        if p.extension is not None and p.extension.unsharded_kind != "Tensor":
            return INLINE_SUBCLASS.format(fqn=p.fqn, kind=p.extension.unsharded_kind)
    block = model.get_submodule(fqns[0])
    float8 = sorted({type(m).__name__ for m in block.modules() if type(m).__module__.startswith("torchao.float8")})
    if float8:
        return INLINE_FLOAT8.format(kind=", ".join(float8))
    return None


def install_regions(model: nn.Module, plan: ShardingPlan) -> tuple[list[list[str]], list]:
    """Route every repeated block's forward through its region while a compiled step runs with regions on
    (outside a compiled step the block's own forward runs). Returns the repeated blocks (kind ``i`` runs as
    ``fsdp_compile_region_<i>``, unless ``passes/regions.py`` inlines its calls) and, per block routed,
    ``(block, its previous instance forward or None, the routing forward)`` for ``Attachment.detach``."""
    _invoke_subgraph.register()
    modules = dict(model.named_modules())
    repeated = find_repeated_blocks(model, plan)
    forwards = []
    for index, fqns in enumerate(repeated):
        blocks = [modules[f] for f in fqns]
        if inline_reason(plan, fqns, model) is not None:
            continue
        region, names, pass_block = _make_region(blocks, index)
        for block in blocks:
            previous = block.__dict__.get("forward")
            pairs = () if pass_block or block is blocks[0] else _attribute_pairs(block, blocks[0])
            block.forward = _regional_forward(block, region, names, pass_block, pairs)
            forwards.append((block, previous, block.forward))
    return repeated, forwards


def _get(module: nn.Module, dotted: str):
    for part in dotted.split("."):
        module = getattr(module, part)
    return module


def _attribute_pairs(block: nn.Module, template: nn.Module) -> tuple:
    """``(submodule of block, the template's, its plain attributes' names)`` for every submodule of the block
    that has plain attributes. Each submodule appears once: Dynamo guards that every path by which it meets
    one object leads to that object, so one entry per attribute cost about 100 such guards per block."""
    subs, out = dict(nn.Module.named_modules(template)), []
    for path, sub in nn.Module.named_modules(block):
        keys = tuple(key for key, value in vars(sub).items() if isinstance(value, _PLAIN))
        if keys:
            out.append((sub, subs[path], keys))
    return tuple(out)


def _written_apart(pairs) -> bool:
    """Whether a block of a template region has a plain attribute that differs from the template's now: the
    model's forward wrote it (``block.scale = ...`` in the parent's loop), in the trace. Dynamo reads both
    (the write included) and folds the comparison; unwritten attributes are guarded, as any read is."""
    for mine, template, keys in pairs:
        for key in keys:
            a, b = getattr(mine, key), getattr(template, key)
            if a != b and (a == a or b == b):  # NaN equals NaN here
                return True
    return False


def _holders(block: nn.Module, names) -> tuple:
    """Per dotted name (a parameter's or buffer's), the ``_parameters`` or ``_buffers`` dict that holds it and
    its key there, found once: Dynamo traced the ``getattr`` walk down to each at about 2 ms a tensor."""
    out = []
    for dotted in names:
        path, _, key = dotted.rpartition(".")
        module = _get(block, path) if path else block
        out.append((module._parameters if key in module._parameters else module._buffers, key))
    return tuple(out)


def _regional_forward(block: nn.Module, region, names, pass_block: bool, pairs: tuple = ()):
    own = getattr(block.forward, "fsdp_compile_own_forward", block.forward)  # the bound method of its class
    holders = _holders(block, names)

    def forward(*args, **kwargs):
        if not (STEP.active and STEP.regions):
            return own(*args, **kwargs)
        if pairs and _written_apart(pairs):  # the template's trace would run with the template's values
            return own(*args, **kwargs)
        # the unsharded tensors that traced_forward's call_with put in place, as the region's inputs
        tensors = tuple([held[key] for held, key in holders])
        if pass_block:
            return region(block, tensors, *args, **kwargs)
        spec, operands = _flatten_call(tensors, args, kwargs)
        return region(spec, *operands)

    forward.fsdp_compile_region = region
    forward.fsdp_compile_passes_block = pass_block  # blocks differ in an attribute: each traced as itself
    forward.fsdp_compile_own_forward = own
    return forward


# A region call whose operands are all leaves (tensors, constants, modules), with no keyword arguments, is
# fingerprinted by Dynamo without tracing pytree (``build_input_fingerprint``'s fast path): the pytree path
# cost about 50 ms of tracing per block (16 layers, Dynamo's profiler). A template region's call (tensors,
# positional arguments, keyword arguments whose values are leaves or tuples/lists of leaves) goes in flat,
# its structure in ``spec``, a constant string (so part of the fingerprint, and of the reuse key); any other
# call goes in as ``(tensors, args, kwargs)`` with ``spec`` None, through pytree's path. Not for blocks
# passed in (``region_of``): on the fast path Dynamo (2.13) reused the first block's trace for blocks that
# differ in a float attribute it read (``test_which_blocks_share_a_region``: wrong outputs), where the pytree
# path traces each; a template region's blocks have equal attributes, and its reuse is keyed
# (``_reuse_key``). On torch 2.13 pytree's path is cheap where the call is plain:
# ``_invoke_subgraph._fingerprint`` gives its result without tracing pytree.

_LEAVES = (torch.Tensor, bool, int, float, str, type(None))


def _flatten_call(tensors: tuple, args: tuple, kwargs: dict) -> tuple:
    """``(spec, operands)`` for the region call of one block (``_unflatten_call`` inverts it)."""
    flat, parts = list(tensors), []
    for key, value in [*(("*", a) for a in args), *kwargs.items()]:  # "*": positional
        if isinstance(value, _LEAVES):  # inline: Dynamo traces every call of a helper
            parts.append(key)
            flat.append(value)
        elif type(value) in (tuple, list) and all(isinstance(v, _LEAVES) for v in value):
            parts.append(f"{key}:{type(value).__name__}:{len(value)}")
            flat.extend(value)
        else:
            return None, (tensors, args, kwargs)
    return "|".join(parts), tuple(flat)


def _unflatten_call(spec: str | None, n: int, operands: tuple) -> tuple:
    """``(tensors, args, kwargs)`` from ``_flatten_call``'s ``(spec, operands)``; ``n``: the block's tensors."""
    if spec is None:
        return operands
    tensors, rest, args, kwargs = operands[:n], list(operands[n:]), [], {}
    for part in spec.split("|") if spec else ():
        key, _, kind = part.partition(":")
        if kind:
            container, _, size = kind.partition(":")
            value = rest[: int(size)]
            rest = rest[int(size):]
            value = tuple(value) if container == "tuple" else list(value)
        else:
            value = rest.pop(0)
        if key == "*":
            args.append(value)
        else:
            kwargs[key] = value
    return tensors, tuple(args), kwargs


def _unique_code(fn, name: str):
    """A copy of ``fn`` with its own code object: Dynamo keys compiled entries (and region reuse) by it."""
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
