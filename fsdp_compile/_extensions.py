"""FSDP2's all-gather extensions under compile: a local shard that implements ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` (torchao's float8 weights, quantized weights) is gathered as what it sends.

FSDP2's contract (``_fsdp_param.py``): ``fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module,
mp_policy)`` (or the older ``fsdp_pre_all_gather(mesh)``) returns ``(all-gather inputs, metadata)``;
``fsdp_post_all_gather(outputs, metadata, param_dtype)`` returns ``(unsharded tensor, inner tensors)``; the
unsharded parameter is a leaf whose gradient is reduce-scattered into the sharded parameter's ``.grad``.

Here, per compiled call:

* eagerly, just outside the graph where ``to_local()`` is taken (``prepare``): ``fsdp_pre_all_gather`` runs
  under ``no_grad``, as in FSDP2. Outside, because it is free to do what a graph cannot hold: torchao's
  float8 all-reduces the weight's amax over ``mesh`` with an eager collective, and its metadata may be any
  Python object. It runs on the parameter's own local tensor, as in FSDP2: torchao keeps the scale of
  ``precompute_float8_dynamic_scale_for_fsdp`` there, which a view of it drops. Its tensors (inputs, tensors
  in the metadata) enter the graph as inputs; the rest of the metadata (structure and non-tensor leaves) is
  part of the key the compiled step is looked up by (``Key``), so new metadata compiles anew (on this rank
  alone: no collective) and is never reused stale;
* in the graph: the unit's ``fsdp_compile::unshard`` gathers those inputs with its plain parameters in one
  all-gather (``ops.py``: one buffer, as bytes where dtypes differ, as FSDP2's ``foreach_all_gather``
  packs them), and ``Attach`` (one node) rebuilds the parameter from the gathered outputs with
  ``fsdp_post_all_gather`` under ``no_grad`` and hands its gradient to the op's backward, which reduce-scatters
  it with the unit's other gradients. The op sees a stand-in for the shard (``ShardGrad``: no memory, stride
  0) whose gradient goes to the local shard, hence to the DTensor's ``.grad``, as FSDP2's post-backward sets it;
* a parameter that was a DTensor before ``fully_shard`` (TP, e.g. torchao's ``Float8ColwiseParallel`` /
  ``Float8RowwiseParallel``): what ``fsdp_post_all_gather`` rebuilt (its TP-local tensor) is wrapped as the
  DTensor of its TP plan, as FSDP2's ``init_unsharded_param`` wraps it (``capture.forward``), and its
  gradient comes back through that DTensor's backward, as any TP parameter's.

float8 payloads (torchao's ``WeightWithDynamicFloat8CastTensor``) always travel as bytes: gloo has no float8
type, so eager FSDP2 fails where every parameter of a module is float8, and the op does not. A parameter
that ``fsdp_post_all_gather`` rebuilds as a tensor subclass (torchao's ``Float8TrainingTensor``; found by
one call at plan time, ``read_spec``, which also keeps the subclass's ``__tensor_flatten__`` context) enters
its block's region as its inner tensors (torch 2.13's ``invoke_subgraph`` takes no subclass operands), rebuilt
inside from that context (``capture/boundary.py``).

Refused, naming the parameter: a subclass without ``__tensor_flatten__`` (its ``fsdp_post_all_gather``
runs on it inside the graph), an int ``reshard_after_forward`` (FSDP2 refuses it too), and metadata
whose non-tensor leaves are not plain constants. ``fsdp_post_all_gather`` is never called with ``out=``:
each step builds its tensor anew.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import operator
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils import _pytree as pytree

from fsdp_compile._layout import padded_rows

_CONSTANTS = (type(None), bool, int, float, str, torch.dtype, torch.Size)


def read_spec(where: str, local: Tensor, args: tuple, post_forward: bool, world_size: int):
    """The plan's ``ExtensionSpec`` of one parameter (``plan._read_group``), or a ``NotImplementedError``
    that names it and why."""
    from fsdp_compile._param_specs import ExtensionSpec

    kind = type(local).__name__
    why = None
    if not hasattr(type(local), "__tensor_flatten__"):
        why = (f"its local shard, a {kind}, has no __tensor_flatten__: fsdp_post_all_gather runs on it inside the "
               "graph, which needs a traceable wrapper subclass (__tensor_flatten__ / __tensor_unflatten__)")
    elif post_forward:
        why = "reshard_after_forward is an int (FSDP2 itself cannot reshard an extension's parameter to a smaller mesh)"
    n_args = len(inspect.signature(local.fsdp_pre_all_gather).parameters)
    if why is None and n_args not in (1, 5):
        why = f"fsdp_pre_all_gather takes {n_args} arguments; FSDP2 calls it with 1 (mesh) or 5"
    if why is not None:
        raise NotImplementedError(f"{where}: its all-gather extension (fsdp_pre_all_gather) is not supported under "
                                  f"fsdp_compile.compile: {why}; train it with eager FSDP2")
    mesh, orig_size, stride, module, mp_policy = args
    spec = ExtensionSpec(kind, mesh, orig_size, stride, module, mp_policy, n_args == 1, 0, "")
    inputs, metadata = pre_all_gather(where, local, spec, world_size)
    _flatten_metadata(where, metadata)
    outputs = tuple(t.new_empty((world_size * t.shape[0], *t.shape[1:])) for t in inputs)  # every rank's, uninitialized
    param_dtype = (mp_policy.param_dtype if mp_policy else None) or local.dtype
    try:  # what it rebuilds (a tensor subclass cannot be a region's operand)
        with torch.no_grad():
            full, _ = local.fsdp_post_all_gather(outputs, metadata, param_dtype)
    except Exception as e:
        raise RuntimeError(f"{where}: its fsdp_post_all_gather failed on tensors of the gathered inputs' shapes and "
                           f"dtypes, called once at compile time to see what it builds: {type(e).__name__}: {e}") from e
    # checked here, before the trace: raised in it, Dynamo reports "Observed exception" and hides the message
    if full.dtype != param_dtype or tuple(full.shape[1:]) != tuple(orig_size[1:]) or full.shape[0] < orig_size[0]:
        raise NotImplementedError(
            f"{where}: its fsdp_post_all_gather built {full.dtype} {tuple(full.shape)}, expected {param_dtype} of "
            f"shape {tuple(orig_size)} (FSDP2's unsharded parameter in param_dtype, padding rows allowed)")
    plain = type(full) in (Tensor, torch.nn.Parameter)
    return dataclasses.replace(spec, input_bytes=sum(t.numel() * t.element_size() for t in inputs),
                               unsharded_kind="Tensor" if plain else type(full).__name__,
                               unsharded_flatten=None if plain else _flatten_context(full))


def _flatten_context(full: Tensor):
    """``(class, inner tensor names, context)`` of the subclass ``fsdp_post_all_gather`` built, or None where a
    region cannot take it by its inner tensors (no ``__tensor_flatten__``, or inner tensors that are subclasses)."""
    if not hasattr(type(full), "__tensor_flatten__"):
        return None
    names, ctx = full.__tensor_flatten__()
    if not all(type(getattr(full, n)) is Tensor for n in names):
        return None
    return type(full), tuple(names), ctx


def pre_all_gather(where: str, local: Tensor, spec, world_size: int) -> tuple[tuple[Tensor, ...], object]:
    """``fsdp_pre_all_gather`` as FSDP2 calls it (under ``no_grad``), with FSDP2's checks of what it returns."""
    with torch.no_grad():
        if spec.one_arg:
            inputs, metadata = local.fsdp_pre_all_gather(spec.mesh)
        else:
            inputs, metadata = local.fsdp_pre_all_gather(
                spec.mesh, torch.Size(spec.orig_size), spec.contiguous_stride, spec.module, spec.mp_policy)
    inputs = tuple(inputs)
    if not inputs or not all(type(t) is Tensor for t in inputs):
        raise NotImplementedError(f"{where}: fsdp_pre_all_gather must return plain tensors to all-gather, got "
                                  f"{[type(t).__name__ for t in inputs]}")
    padded = padded_rows(spec.orig_size[0], world_size)
    if local.shape[0] != padded and any(t.dim() == 0 or t.shape[0] != padded for t in inputs):
        raise ValueError(f"{where} is unevenly sharded: fsdp_pre_all_gather must return inputs of {padded} rows "
                         f"(FSDP2's padded shard), got {[tuple(t.shape) for t in inputs]}")
    return tuple(t.contiguous() for t in inputs), metadata


def _flatten_metadata(where: str, metadata) -> tuple[list, pytree.TreeSpec]:
    """``fsdp_pre_all_gather``'s metadata as pytree leaves, refused unless they are tensors and constants."""
    leaves, spec = pytree.tree_flatten(metadata)
    odd = [type(x).__name__ for x in leaves if not isinstance(x, (Tensor, *_CONSTANTS))]
    if odd:
        raise NotImplementedError(
            f"{where}: fsdp_pre_all_gather's metadata holds {odd}: fsdp_compile.compile supports tensors and "
            "plain constants (None, bool, int, float, str, dtype) there, whose changes it can see")
    return leaves, spec


class ShardGrad(torch.autograd.Function):
    """An extension parameter's local shard as the unshard op's input: a plain tensor of its shape and dtype
    that owns no memory (stride 0); the gradient the op hands it goes to the local shard."""

    @staticmethod
    def forward(ctx, local: Tensor) -> Tensor:
        return torch.empty_strided(local.shape, (0,) * local.dim(), dtype=local.dtype, device=local.device)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad


class Attach(torch.autograd.Function):
    """``fsdp_post_all_gather`` on the gathered ``outputs`` (under ``no_grad``: a Function's forward runs so, as
    FSDP2 builds its unsharded parameter), trimmed to ``size`` as FSDP2's ``init_unsharded_param`` does, with
    its gradient handed to ``handle`` (the unshard op's output for this parameter): what FSDP2's unsharded
    parameter leaf and its post-backward reduce-scatter do. ``allow_in_graph`` (as ``capture.boundary``'s
    crossings, hence ``setup_context``): one node of Dynamo's graph that AOTAutograd runs as it traces the step.
    Traced by Dynamo instead (the extension's Python and a Function's forward and backward, per parameter per
    layer), it took 0.14 s of a float8 Llama layer's 0.40 s of tracing (``aot_eager``, 2 against 6 layers)."""

    @staticmethod
    def forward(local: Tensor, outputs: list, metadata, handle: Tensor, param_dtype: torch.dtype, size: tuple,
                stride: tuple, fqn: str) -> Tensor:
        full, _ = local.fsdp_post_all_gather(tuple(outputs), metadata, param_dtype)
        if tuple(full.shape) != tuple(size):  # uneven shards: FSDP2's as_strided drops the padding rows
            full = torch.as_strided(full, size, stride, 0)
        else:
            full = full.view_as(full)
        # checked here, where Dynamo runs it on the traced tensors rather than traces it (``read_spec`` checked
        # the same at compile time on tensors of these shapes)
        if full.dtype != handle.dtype or tuple(full.shape) != tuple(handle.shape):
            raise NotImplementedError(
                f"parameter {fqn!r}: fsdp_post_all_gather returned {full.dtype} {tuple(full.shape)}, expected "
                f"{handle.dtype} {tuple(handle.shape)} (the parameter's shape in param_dtype)")
        return full

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad: Tensor):
        return None, None, None, grad, None, None, None, None


torch._dynamo.allow_in_graph(Attach)


class LocalShards(torch.autograd.Function):
    """``[p.to_local() for p in params]`` as one autograd node: each DTensor parameter's local shard (a view,
    as ``to_local`` returns), and in the backward each shard gradient as a DTensor of the parameter's
    placements, built as ``to_local``'s backward builds it (``_ToTorchTensor``: the parameter's spec, or a
    new one where the gradient's global stride differs) but without ``DTensor.from_local``'s autograd node
    per parameter. A compiled step's backward returns every shard gradient at its end anyway, so one node
    for all of them delays none. On an H100's host (0.95B Llama, 147 parameters) ``to_local``, its backward
    and the ``from_local`` inside it took 3.8 + 4.8 + 5.6 ms of a profiled step; on the development machine
    147 parameters' forward and backward take 4.1 ms this way against 9.1 (forward alone 0.30 against 1.03).

    ``cudagraphs``: the step replays CUDA graphs (``_cudagraphs.py``). Each shard is then marked a static
    input (its memory is the parameter's, updated in place by the optimizer: the graphs read it there
    instead of copying it in at every replay), and each gradient is copied out of the graphs' pool, which
    the next replay overwrites while ``.grad`` may still hold it (accumulation, ``zero_grad(set_to_none=False)``).

    A parameter passed more than once (several FSDP parameters share it: ``plan._own_places``) gets its
    gradients added in FSDP2's order, the first FSDP parameter's first, onto what ``.grad`` holds already
    (eager's ``grad._local_tensor += reduced`` per FSDP parameter): all but the last are added to ``.grad``
    here, the last one by autograd's accumulation (``(g + a) + b``, where returning ``a + b`` would give
    ``g + (a + b)``); without a ``.grad``, their sum is returned."""

    @staticmethod
    def forward(ctx, cudagraphs: bool, *params):
        ctx.specs = [p._spec for p in params]
        ctx.copy_out = cudagraphs
        ctx.shared = _shared(params)
        ctx.set_materialize_grads(False)
        locals_ = [p._local_tensor.view_as(p._local_tensor) for p in params]
        if cudagraphs:
            for t in locals_:  # _cudagraphs.mark_static (which imports this module)
                t._dynamo_static_input_type = "unguarded"
        frozen = [t for t, p in zip(locals_, params) if not p.requires_grad]
        if frozen:  # as to_local of a parameter that needs no gradient: no gradient either
            ctx.mark_non_differentiable(*frozen)
        return tuple(locals_)

    @staticmethod
    def backward(ctx, *grads):
        from torch.distributed.tensor import DTensor

        _wait_for_host_copies(grads)
        out = []
        for grad, spec in zip(grads, ctx.specs):
            if grad is None:
                out.append(None)
                continue
            key = (id(spec), grad.shape, grad.stride(), grad.dtype)
            kept = _GRAD_SPECS.get(key)
            if kept is None or kept[0] is not spec:
                kept = (spec, _grad_spec(spec, grad))
                if len(_GRAD_SPECS) >= 8192:  # parameters replaced many times over: start afresh
                    _GRAD_SPECS.clear()
                _GRAD_SPECS[key] = kept
            out.append(DTensor(grad.clone() if ctx.copy_out else grad.view_as(grad), kept[1], requires_grad=False))
        for param, indices in ctx.shared:
            grads = [out[i] for i in indices if out[i] is not None]
            for i in indices:
                out[i] = None
            if not grads:
                continue
            if param.grad is None:
                out[indices[0]] = functools.reduce(operator.add, grads)
                continue
            with torch.no_grad():
                for grad in grads[:-1]:
                    param.grad.add_(grad)
            out[indices[0]] = grads[-1]
        return (None, *out)


def _wait_for_host_copies(grads) -> None:
    """``CPUOffloadPolicy(pin_memory=True)``: the backward graph copied the shard gradients to pinned host
    memory without blocking (``ops.to_host``). The host waits for those copies here, before a gradient reaches
    ``.grad``, an accumulation, a hook or the optimizer, as FSDP2's ``finalize_backward`` synchronizes its
    offload events. A pinned gradient is the sign: a blocking copy's (``pin_memory=False``) is pageable."""
    if torch.accelerator.is_available() and any(g is not None and g.is_cpu and g.is_pinned() for g in grads):
        torch.accelerator.synchronize()


def _shared(params) -> list[tuple[Tensor, list[int]]]:
    """Each parameter passed more than once, with the positions it was passed at."""
    if len({id(p) for p in params}) == len(params):
        return []
    at: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        at.setdefault(id(p), []).append(i)
    return [(params[indices[0]], indices) for indices in at.values() if len(indices) > 1]


# (id of the parameter's spec, gradient's shape, stride, dtype) -> (that spec, the gradient's DTensorSpec).
# Building one is Python (DTensorSpec's __post_init__ and its guarded __setattr__), every parameter every
# step, and gives the same spec every step; torch shares specs between DTensors (FSDP2 builds every step's
# sharded gradient on its one _sharding_spec), so one is kept per parameter and layout: 147 parameters (a
# 16-layer Llama) 1.88 ms -> 0.08 ms a step on the development machine. Keyed by the spec object, not its
# value: specs compare equal by mesh layout, and a mesh built later on new process groups would be handed
# the old mesh (_dtensor.forget_meshes); the entry holds the spec, so its id is not reused meanwhile.
_GRAD_SPECS: dict = {}


def _grad_spec(spec, grad: Tensor):
    """``_ToTorchTensor.backward``, then ``_FromTorchTensor.forward`` with its shape and stride given: the
    parameter's placements (Partial as Replicate), its global shape, the gradient's global stride (the
    parameter's where the layouts agree) and the gradient's dtype."""
    from torch.distributed.tensor._api import _normalize_placements_for_grad
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_global_tensor_info

    _, stride = compute_global_tensor_info(grad, spec.mesh, spec.placements)
    meta = TensorMeta(spec.shape, tuple(stride), grad.dtype)
    return DTensorSpec(spec.mesh, _normalize_placements_for_grad(spec.placements), tensor_meta=meta)


class Layout(NamedTuple):
    """What of one extension parameter's call the graph is specialized on (part of the step's key)."""

    n_inputs: int  # tensors fsdp_pre_all_gather returned
    metadata: pytree.TreeSpec  # the metadata's structure
    constants: tuple  # its leaves: (True, None) for a tensor (a graph input), (False, value) for a constant
    container: str = ""  # ``_container(metadata)``: how ``split`` rebuilds it without tracing pytree


Key = tuple  # per unit: None (no extension) or, per parameter, None or its Layout


def prepare(units_params: list[list], units_plans: list[list], world_size_of, cudagraphs: bool = False
            ) -> tuple[list, list, Key]:
    """Per unit: the op's shard inputs (stand-ins for extension parameters), the extension tensors (per
    extension parameter: its local shard, detached, then its all-gather inputs, then its metadata's tensors),
    and the key of the step they need. ``cudagraphs``: ``LocalShards``'."""
    shards, tensors, key = [], [], []
    every = [p for params in units_params for p in params]
    flat = LocalShards.apply(cudagraphs, *every) if every else ()
    start = 0
    for params, plans in zip(units_params, units_plans):
        locals_ = flat[start : start + len(params)]
        start += len(params)
        if not any(pp.extension is not None for pp in plans):
            shards.append(list(locals_))
            tensors.append([])
            key.append(None)
            continue
        unit_shards, unit_tensors, layouts = [], [], []
        for pp, param, local in zip(plans, params, locals_):
            if pp.extension is None:
                unit_shards.append(local)
                layouts.append(None)
                continue
            where = f"parameter {pp.fqn!r}"
            # on the parameter's own local tensor, as FSDP2 calls it: a view of it (``local``) is a new
            # WeightWithDynamicFloat8CastTensor without the scale precompute_float8_dynamic_scale_for_fsdp set
            # on it, whose fsdp_pre_all_gather all-reduces the amax over FSDP's mesh alone (under TP, another scale)
            inputs, metadata = pre_all_gather(where, param._local_tensor, pp.extension, world_size_of(pp))
            leaves, spec = _flatten_metadata(where, metadata)
            unit_shards.append(ShardGrad.apply(local))
            unit_tensors += [local.detach(), *inputs, *(x for x in leaves if isinstance(x, Tensor))]
            layouts.append(Layout(len(inputs), spec, tuple((True, None) if isinstance(x, Tensor) else (False, x) for x in leaves),
                                  _container(spec)))
        shards.append(unit_shards)
        tensors.append(unit_tensors)
        key.append(tuple(layouts))
    return shards, tensors, tuple(key)


def split(unit_tensors: list[Tensor], layouts: tuple) -> tuple[list, list[Tensor], list]:
    """``prepare``'s extension tensors of one unit, in the trace: per extension parameter its local shard and
    its rebuilt metadata, and the all-gather inputs of all of them (the op's ``payloads``)."""
    selves, payloads, metadatas, i = [], [], [], 0
    for layout in layouts:
        if layout is None:
            continue
        selves.append(unit_tensors[i])
        payloads += unit_tensors[i + 1 : i + 1 + layout.n_inputs]
        i += 1 + layout.n_inputs
        leaves = []
        for is_tensor, value in layout.constants:
            if is_tensor:
                leaves.append(unit_tensors[i])
                i += 1
            else:
                leaves.append(value)
        if layout.container == "leaf":
            metadatas.append(leaves[0])
        elif layout.container:  # a tuple or list of leaves (torchao float8's ``(scale,)``)
            metadatas.append(tuple(leaves) if layout.container == "tuple" else list(leaves))
        else:
            metadatas.append(pytree.tree_unflatten(leaves, layout.metadata))
    return selves, payloads, metadatas


def _container(spec: pytree.TreeSpec) -> str:
    """``"leaf"``, ``"tuple"`` or ``"list"`` where the metadata is one leaf or a plain tuple or list of leaves, which
    ``split`` builds as it is: Dynamo traced ``tree_unflatten`` at about 7 ms a parameter (a float8 x TP Llama
    block's seven, 46 ms of its 0.89 s of tracing: Dynamo's profile of 4 against 8 layers); else ``""`` (pytree)."""
    if spec.is_leaf():
        return "leaf"
    if spec.type in (tuple, list) and all(spec.child(i).is_leaf() for i in range(spec.num_children)):
        return spec.type.__name__
    return ""


def attach_args(local: Tensor, outputs: list[Tensor], metadata, handle: Tensor, param_dtype: torch.dtype, spec,
                fqn: str) -> tuple:
    """``Attach``'s arguments: the parameter ``fsdp_post_all_gather`` rebuilds from the gathered ``outputs``, trimmed
    to its size (``spec``: its ``ExtensionSpec``, or ``capture.forward.Rebuilt``), with its gradient going to ``handle``."""
    return local, list(outputs), metadata, handle, param_dtype, tuple(spec.orig_size), tuple(spec.contiguous_stride), fqn
