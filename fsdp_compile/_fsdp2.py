"""The one reader of FSDP2's private state (``torch.distributed.fsdp._fully_shard``).

FSDP2's public API is ``fully_shard``, ``FSDPModule`` and its setters. What fsdp_compile needs to
reproduce FSDP2 in a graph lives in its private classes: ``FSDPState`` (the hooks, mixed precision, the
prefetch lists), ``FSDPParamGroup`` (process groups, the runtime settings the setters write, what is in
flight) and ``FSDPParam`` (each parameter's layout). Every read of them is here, as a typed accessor
with a test (``tests/test_fsdp2_adapter.py``), and returns plain records where it can: a torch that
renames an attribute fails here, naming it and the torch we test with, not somewhere inside a trace.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy

# CI runs the whole suite on 2.13.0 and the fast tier and the demo on 2.14.1 (.ci/run)
TESTED_TORCH = ("2.13", "2.14")
_TESTED = " and ".join(f"{v}.x" for v in TESTED_TORCH)
_INSTALL = "install torch==2.13.0 or torch==2.14.1"


@functools.cache
def warn_if_untested_torch() -> bool:
    """Warn, once per process, when this torch is not a version fsdp_compile is tested with: it reads
    FSDP2's private state and Inductor's internals, which change without notice between releases."""
    version = torch.__version__.split("+")[0]
    if ".".join(version.split(".")[:2]) in TESTED_TORCH:
        return False
    warnings.warn(
        f"fsdp_compile is tested with torch {_TESTED}, not {version}: it reads FSDP2's private state, so "
        f"training may fail or, worse, differ from eager FSDP2 without an error; {_INSTALL}, or check "
        "this torch with the test suite (python3 -m pytest tests) before relying on it",
        UserWarning, stacklevel=3,
    )
    return True


class FSDP2Changed(RuntimeError):
    """This torch's FSDP2 lacks something fsdp_compile reads."""


def _get(obj, name: str):
    try:
        return getattr(obj, name)
    except AttributeError:
        raise FSDP2Changed(
            f"fsdp_compile reads FSDP2's {type(obj).__name__}.{name}, which torch {torch.__version__} does not "
            f"have: fsdp_compile is tested with torch {_TESTED}; {_INSTALL}, or a fsdp_compile release made "
            "for this torch"
        ) from None


def _private(module: str, name: str):
    import importlib

    try:
        return getattr(importlib.import_module(f"torch.distributed.fsdp._fully_shard.{module}"), name)
    except (ImportError, AttributeError):
        raise FSDP2Changed(
            f"fsdp_compile uses FSDP2's {module}.{name}, which torch {torch.__version__} does not have: "
            f"fsdp_compile is tested with torch {_TESTED}; {_INSTALL}"
        ) from None


# --- states: one per fully_shard call ----------------------------------------------------------------


def states(model: nn.Module) -> list[tuple[str, nn.Module, object]]:
    """``(fqn, module, state)`` for every FSDP state, in pre-order: one per ``fully_shard`` call, named by
    its first module (``fully_shard([m1, m2])`` shards several modules as one group)."""
    out, seen = [], set()
    for fqn, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = _get(module, "_get_fsdp_state")()
            if id(state) not in seen:
                seen.add(id(state))
                out.append((fqn, module, state))
    return out


def lazy_init(state, allow_meta: bool = False) -> None:
    """FSDP2's lazy init (its first forward's pre-hook runs it; idempotent). ``allow_meta``: FSDP2 refuses
    meta parameters, which ``explain`` captures at full size without memory; its check is skipped for
    this call only."""
    if not allow_meta:
        _get(state, "_lazy_init")()
        return
    # its lazy init validates the groups of every state under its module
    groups = [pg for _, _, sub in states(modules(state)[0]) for pg in param_groups(sub)]
    for pg in groups:  # on the instances, for this call: the class, and every other model, keep the check
        _get(pg, "_validate_no_meta_params")
        pg._validate_no_meta_params = lambda: None
    try:
        _get(state, "_lazy_init")()
    finally:
        for pg in groups:
            del pg._validate_no_meta_params


def param_groups(state) -> list:
    """The state's ``FSDPParamGroup``s (one per mesh; none for a module without parameters)."""
    return list(_get(state, "_fsdp_param_groups"))


def prefetch(state) -> tuple[list, list]:
    """The states ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` named."""
    return list(_get(state, "_states_to_forward_prefetch")), list(_get(state, "_states_to_backward_prefetch"))


def modules(state) -> tuple[nn.Module, ...]:
    """The modules one ``fully_shard`` call sharded (several for ``fully_shard([m1, m2])``)."""
    return tuple(_get(state, "_modules"))


def forward_hooks(state) -> tuple:
    """The state's forward pre-hook and post-hook functions, as registered (wrapped) on its modules."""
    return _get(state, "_pre_forward"), _get(state, "_post_forward")


def mp_policy(state) -> MixedPrecisionPolicy:
    return _get(state, "_mp_policy")


def floating_cast(dtype: torch.dtype):
    """FSDP2's ``cast_forward_inputs`` / ``output_dtype`` cast, as a function of a tree of tensors that
    casts every floating one. Made before tracing: Dynamo traces the returned function, not the lookup."""
    from torch.distributed.utils import _apply_to_tensors

    cast_one = functools.partial(_private("_fsdp_common", "_cast_fp_tensor"), dtype)
    return lambda tree: _apply_to_tensors(cast_one, tree)


def composable_checkpoint(module: nn.Module) -> bool:
    """Whether ``torch.distributed._composable.checkpoint`` was applied to ``module`` (the composable API's
    registry, where ``fully_shard`` registers itself too)."""
    from torch.distributed._composable.contract import _get_registry

    return "checkpoint" in (_get_registry(module) or {})


_CHECKPOINT_HOOKS = ("torch.distributed._composable.checkpoint_activation", "checkpoint.<locals>.forward_pre_hook",
                     "checkpoint.<locals>.forward_hook")


def composable_checkpoint_hooks(module: nn.Module) -> tuple[dict, list[tuple[dict, int]]]:
    """What ``torch.distributed._composable.checkpoint(module, **kwargs)`` installed on ``module``: the
    ``torch.utils.checkpoint.checkpoint`` keyword arguments it was called with (read from its forward
    pre-hook's closure) and its two hooks, ``(hook dict, hook id)``, pre-hook first."""
    import inspect

    where, pre_name, post_name = _CHECKPOINT_HOOKS
    found, kwargs = [], None
    for hooks, name in ((module._forward_pre_hooks, pre_name), (module._forward_hooks, post_name)):
        for hook_id, hook in hooks.items():
            hook = getattr(hook, "fsdp_hook", hook)  # the original behind our dispatcher
            if getattr(hook, "__module__", None) == where and getattr(hook, "__qualname__", None) == name:
                found.append((hooks, hook_id))
                if name == pre_name:
                    cells = inspect.getclosurevars(hook).nonlocals
                    kwargs = {key: cells[key] for key in ("preserve_rng_state", "determinism_check", "debug")
                              if key in cells}
                    if cells.get("user_context_fns") is not None:
                        kwargs["context_fn"] = cells["user_context_fns"]
    if len(found) != 2 or kwargs is None or len(kwargs) < 3:
        raise FSDP2Changed(
            f"fsdp_compile reads the hooks of torch.distributed._composable.checkpoint, which torch "
            f"{torch.__version__} installs otherwise: fsdp_compile is tested with torch {_TESTED}; {_INSTALL}, or "
            "wrap the block with checkpoint_wrapper instead"
        )
    return kwargs, found


# --- parameter groups: runtime settings, layout, what is in flight -----------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    """What FSDP2's setters have written on one parameter group (read at every compiled call: attribute
    reads only). Records compare field by field, so a change names the field."""

    requires_gradient_sync: bool  # set_requires_gradient_sync
    requires_all_reduce: bool  # set_requires_all_reduce (HSDP)
    reshard_after_backward: bool  # set_reshard_after_backward
    reshard_after_forward: bool  # set_reshard_after_forward (an int's post-forward group: uses_post_forward_mesh)
    uses_post_forward_mesh: bool
    gradient_divide_factor: float | None  # set_gradient_divide_factor / set_reduce_scatter_divide_factor
    force_sum_reduction_for_comms: bool
    reduce_scatter_unused_params: bool
    reduce_scatter_max_input_buffers: int
    unshard_in_backward: bool
    all_gather_comm: str  # the collective implementations' class names (custom ones from set_custom_*)
    reduce_scatter_comm: str
    all_reduce_hook: bool
    separate_reduce_scatter_group: bool
    forward_prefetch: tuple[int, ...]  # ids of the prefetched states
    backward_prefetch: tuple[int, ...]

    def without_sync_flags(self) -> Settings:
        """The settings that decide a plan: gradient sync is a mode of a compiled step, not another plan."""
        return dataclasses.replace(self, requires_gradient_sync=True, requires_all_reduce=True)


def settings(state, pg) -> Settings:
    forward, backward = prefetch(state)
    return Settings(
        requires_gradient_sync=_get(pg, "reduce_grads"),
        requires_all_reduce=_get(pg, "all_reduce_grads"),
        reshard_after_backward=_get(pg, "reshard_after_backward"),
        reshard_after_forward=_get(pg, "_reshard_after_forward"),
        uses_post_forward_mesh=_get(pg, "_use_post_forward_mesh"),
        gradient_divide_factor=_get(pg, "gradient_divide_factor"),
        force_sum_reduction_for_comms=_get(pg, "force_sum_reduction_for_comms"),
        reduce_scatter_unused_params=_get(pg, "reduce_scatter_unused_params"),
        reduce_scatter_max_input_buffers=_get(pg, "reduce_scatter_max_input_buffers"),
        unshard_in_backward=_get(pg, "unshard_in_backward"),
        all_gather_comm=type(_get(pg, "_all_gather_comm")).__name__,
        reduce_scatter_comm=type(_get(pg, "_reduce_scatter_comm")).__name__,
        all_reduce_hook=_get(pg, "_all_reduce_hook") is not None,
        # FSDP2's DDP (dp_mesh_dims without a shard dim) has neither group: plan.py refuses it by its layout
        separate_reduce_scatter_group=not _replicate_only(pg) and (
            _get(pg, "_reduce_scatter_process_group") is not _get(pg, "_all_gather_process_group")),
        forward_prefetch=tuple(id(s) for s in forward),
        backward_prefetch=tuple(id(s) for s in backward),
    )


@dataclasses.dataclass(frozen=True)
class Param:
    """One ``FSDPParam``: the sharded parameter and how FSDP2 lays it out."""

    fqn: str  # FSDP2's own name for it (from the root at fully_shard time)
    sharded_param: nn.Parameter  # the DTensor on the module: Shard(0) over FSDP's mesh (and its TP/EP dims)
    placement: object  # FSDP2's placement on its shard dim (Shard(0) by default)
    unsharded_shape: tuple[int, ...]  # what its all-gather rebuilds: the full shape, or a DTensor's local one
    # a DTensor before fully_shard (tensor / expert parallelism): its spec (mesh, placements, global shape
    # and stride), which the gathered local tensor is wrapped in again, as FSDP2's init_unsharded_param does
    unsharded_spec: object | None
    # dp_mesh_dims: the unsharded spec's data-parallel dims (FSDP2's _dp_dim_indices), where a gradient keeps the
    # placement it has for FSDP's reduce-scatter (FSDP2's _get_grad_inner_tensor redistributes the other dims only)
    dp_dims: tuple[int, ...]
    # torch >= 2.14 with spmd_types (torchtitan's default spmd_backend): a plain tensor annotated by spmd_types, stored
    # as a DTensor on the SPMD mesh (unsharded_spec) but handed to the module as the gathered plain tensor; its
    # gradient is read as a DTensor with these placements (FSDPParam._spmd_grad_placements: Partial on the
    # data-parallel dims), redistributed on the others to unsharded_spec's (_get_grad_inner_tensor). None otherwise
    spmd_grad_placements: tuple | None
    all_gather_extension: bool  # the local shard implements fsdp_pre_all_gather (float8, ...)
    # what FSDP2 passes an extension's fsdp_pre_all_gather after the shard: (its shard mesh, orig size, contiguous
    # orig stride, its module, its MixedPrecisionPolicy); None for a plain parameter
    pre_all_gather_args: tuple | None
    param_dtype: torch.dtype | None  # MixedPrecisionPolicy.param_dtype, where it differs from orig_dtype
    orig_dtype: torch.dtype
    # where FSDP2 puts this one's unsharded (and sharded) parameter: (module, attribute name), its module's
    # first, then the modules that shared it at fully_shard time (ParamModuleInfo)
    places: tuple[tuple[nn.Module, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Layout:
    """One ``FSDPParamGroup``: where its collectives run and how gradients are reduced."""

    device: torch.device
    offload_to_cpu: bool  # offload_policy=CPUOffloadPolicy()
    offload_pinned: bool  # CPUOffloadPolicy(pin_memory=True): host shards pinned, gradients copied back asynchronously
    spmd_mesh: bool  # fully_shard(..., dp_mesh_dims=...): parameters are DTensors on the full SPMD mesh
    mesh_kind: str  # mesh_kind: "fsdp" | "hsdp" | "ddp", or the class name of a mesh info fsdp_compile does not know
    replicate_only: bool  # no shard dim: DDPMeshInfo (replicate, or dp_mesh_dims=...(replicate=...) only), or unknown
    shard_mesh_rank: int
    all_gather_group: object  # ProcessGroup (None: replicate_only)
    all_reduce_group: object | None  # HSDP, DDP: the replicate dimension's ProcessGroup
    post_forward: tuple[object, int, int] | None  # an int reshard_after_forward: (ProcessGroup, size, rank)
    reduce_dtype: torch.dtype | None  # MixedPrecisionPolicy.reduce_dtype as FSDP2 resolved it
    params: tuple[Param, ...]
    shard_dim_name: str | None = None  # the FSDP mesh's names for its shard and (HSDP) replicate dims
    replicate_dim_name: str | None = None


def _places(info) -> tuple[tuple[nn.Module, str], ...]:
    """``FSDPParam._setattr_on_modules``' targets."""
    shared = zip(_get(info, "shared_modules"), _get(info, "shared_param_names"), strict=True)
    return ((_get(info, "module"), _get(info, "param_name")), *shared)


def _replicate_only(pg) -> bool:
    return not isinstance(_get(pg, "mesh_info"), _private("_fsdp_common", "FSDPMeshInfo"))


def mesh_kind(pg) -> str:
    """The kind of FSDP2 mesh info a parameter group has: "fsdp" (FSDPMeshInfo, a custom subclass too), "hsdp",
    "ddp" (DDPMeshInfo: ``replicate``, or ``dp_mesh_dims`` without a shard dim), else the class's name: one that
    fsdp_compile does not know, which ``plan`` refuses before reading anything else of it."""
    info = _get(pg, "mesh_info")
    for kind, name in (("hsdp", "HSDPMeshInfo"), ("fsdp", "FSDPMeshInfo"), ("ddp", "DDPMeshInfo")):
        if isinstance(info, _private("_fsdp_common", name)):
            return kind
    return type(info).__name__


def api(state) -> str:
    """The composable API that made an FSDP state: "replicate" (``torch.distributed._composable.replicate_with_fsdp``,
    whose state is FSDP2's, named "Replicate") or "fully_shard"."""
    return "replicate" if _get(state, "_state_name") == "Replicate" else "fully_shard"


def layout(pg) -> Layout:
    """After FSDP2's lazy init (``lazy_init``), which resolves the dtypes."""
    mesh_info = _get(pg, "mesh_info")
    kind = mesh_kind(pg)
    replicate_only = _replicate_only(pg)
    spmd = bool(getattr(mesh_info, "is_spmd_mesh", False))
    post_forward = None
    if _get(pg, "_use_post_forward_mesh"):
        pf = _get(pg, "post_forward_mesh_info")
        post_forward = (pf.shard_process_group, pf.shard_mesh_size, pf.shard_mesh_rank)
    params = []
    for fp in _get(pg, "fsdp_params"):
        local = getattr(fp, "_sharded_local_tensor", None)
        extension = getattr(fp, "_extensions_data", None) is not None and hasattr(local, "fsdp_pre_all_gather")
        params.append(Param(
            fqn=_get(fp, "_param_fqn"),
            sharded_param=_get(fp, "sharded_param"),
            placement=_get(fp, "fsdp_placement"),
            unsharded_shape=tuple(_get(fp, "_orig_size")),
            unsharded_spec=_get(fp, "_unsharded_dtensor_spec") if _get(fp, "is_dtensor") else None,
            dp_dims=tuple(sorted(_get(fp, "_dp_dim_indices"))) if spmd else (),
            # torch 2.13 has no spmd_types support (its fully_shard refuses such parameters), nor the attribute
            spmd_grad_placements=(tuple(_get(fp, "_spmd_grad_placements"))
                                  if getattr(fp, "is_spmd_types", False) else None),
            all_gather_extension=extension,
            pre_all_gather_args=(
                _get(fp, "shard_mesh_from_root"), tuple(_get(fp, "_orig_size")), tuple(_get(fp, "_contiguous_orig_stride")),
                _get(_get(fp, "_module_info"), "module"), _get(fp, "mp_policy"),
            ) if extension else None,
            param_dtype=_get(fp, "param_dtype"),
            orig_dtype=_get(fp, "orig_dtype"),
            places=_places(_get(fp, "_module_info")),
        ))
    hsdp = _get(pg, "_is_hsdp")
    # with dp_mesh_dims, mesh_info.mesh is the data-parallel submesh FSDP2 took (its dims flattened where several)
    ddp = kind == "ddp"  # replicate: no shard group; its gradients are all-reduced over the replicate group
    names = (getattr(mesh_info.mesh, "mesh_dim_names", None) or ()) if not replicate_only or ddp else ()
    shard_dim = getattr(mesh_info, "shard_mesh_dim", None)
    replicate_dim = getattr(mesh_info, "replicate_mesh_dim", None) if hsdp or ddp else None
    return Layout(
        device=_get(pg, "device"),
        offload_to_cpu=isinstance(_get(pg, "offload_policy"), CPUOffloadPolicy),
        offload_pinned=bool(getattr(_get(pg, "offload_policy"), "pin_memory", False)),
        spmd_mesh=spmd,
        mesh_kind=kind,
        replicate_only=replicate_only,
        shard_mesh_rank=0 if replicate_only else mesh_info.shard_mesh_rank,
        all_gather_group=None if replicate_only else _get(pg, "_all_gather_process_group"),  # DDP: none
        all_reduce_group=_get(pg, "_all_reduce_process_group") if hsdp or ddp else None,
        post_forward=post_forward,
        reduce_dtype=_get(pg, "_reduce_dtype"),
        params=tuple(params),
        shard_dim_name=names[shard_dim] if names and shard_dim is not None else None,
        replicate_dim_name=names[replicate_dim] if names and replicate_dim is not None else None,
    )


def offload_device(layout: Layout) -> str | None:
    """``CPUOffloadPolicy`` on an accelerator: the device type its host shards are copied to before the
    all-gather (and their gradients copied back from), as FSDP2's ``all_gather_inputs`` and ``foreach_reduce``
    do; the type alone, so no device index (no rank) is in the graphs. None without offload, and on a CPU
    device, where FSDP2's copies are no-ops (tests patch this to build the accelerator's graphs on ``cpu``)."""
    return layout.device.type if layout.offload_to_cpu and layout.device.type != "cpu" else None


def gradient_divide_factors(group, replicate_group, reduce_dtype: torch.dtype, device_type: str,
                            factor: float | None, force_sum: bool) -> tuple:
    """FSDP2's ``(pre, post, reduce-scatter op, all-reduce op)`` for a reduction (``_fsdp_collectives``)."""
    return _private("_fsdp_collectives", "_get_gradient_divide_factors")(
        group, replicate_group, reduce_dtype, device_type, factor, force_sum
    )


def all_gather_in_flight(pg) -> bool:
    """A user's ``unshard(async_op=True)`` not yet waited on."""
    return _get(pg, "_all_gather_result") is not None


def is_sharded(pg) -> bool:
    return _get(pg, "is_sharded")


def reshard(pg) -> None:
    """FSDP2's reshard: frees the unsharded parameters, puts the sharded ones back (local, no collective)."""
    _get(pg, "reshard")()


def reset_sharded_params(pg) -> None:
    """After the parameters were replaced (``load_state_dict(assign=True)``): FSDP2 re-reads them."""
    for fp in _get(pg, "fsdp_params"):
        _get(fp, "reset_sharded_param")()


def give_state(wrapper: nn.Module, model: nn.Module, state) -> None:
    """Make ``fully_shard.state(wrapper)`` return ``state`` (what ``torch.distributed.pipelining`` reads of
    an FSDP stage at its REDUCE_GRAD action): ``contract`` keeps a module's states in its ``__dict__``
    under ``STATE_KEY``, keyed by the API; ``model``'s FSDP one is given to ``wrapper``, nothing else."""
    from torch.distributed._composable.contract import STATE_KEY
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    keys = [k for k, v in model.__dict__.get(STATE_KEY, {}).items() if isinstance(v, FSDPState)]
    if not keys:
        raise FSDP2Changed(f"torch {torch.__version__} keeps fully_shard's state elsewhere; {_INSTALL}")
    wrapper.__dict__[STATE_KEY] = {k: state for k in keys}
