"""What crosses a region's boundary, and what a region may trace once for every block of a kind.

**DTensor parameters.** A TP/EP block's unsharded parameters are DTensors (``forward._as_dtensor`` builds
them at the top level, as FSDP2's ``init_unsharded_param`` does). Only their local tensors enter the
region (``to_local``: in backward it hands the local gradient back as a DTensor of the parameter's own
placements, which ``_as_dtensor``'s backward then takes as it is); the region rebuilds each DTensor from
its ``ParallelSpec``, a constant of the region (equal for every block of the kind: ``parallel_reason``),
with ``_as_dtensor``'s own backward (``_DataParallelDTensor``: a Partial gradient redistributed to its
placements, on the non-data-parallel dims). So the gradient that leaves the region is the local tensor
the inline compile hands to the reduce-scatter, redistributed by the same collective, inside the region
instead of after it.

**DTensor activations.** A template region's call (``regions._flatten_call``) hands its DTensor operands other
than parameters (its arguments, and buffers: torchtitan's RoPE cache is a Replicate DTensor under TP) in as
their local tensors (``to_local``), each layout (mesh, placements, global shape and stride) interned as an int
that the call's ``spec`` string names: a constant of the trace, and part of the region's reuse key, so a block
called with activations laid out otherwise gets its own trace. Inside, each is rebuilt by ``DTensor.from_local``
with its backward (``_RegionDTensor``, no data-parallel dims). The body hands each DTensor it returns (the result,
or an item of a tuple or list) back as its local tensor, and notes its layout when Dynamo traces it, by region,
``spec`` and operand shapes (``call_key``); the call rebuilds it outside from that note. Dynamo traces the body
before the code after the call, and stamps a reused trace out for a call of the same key, so the note is always
there, and is the body's. Both notes are taken at trace time only (``assume_constant_result``), and cost nothing
in the step. The gradient of such an output is redistributed to its forward placements (Partial as Replicate)
before the region's backward, and the input gradient leaves it in the input's placements, as ``from_local`` and
``to_local`` do; the blocks we know (torchtitan's, Shard(1) in and out under sequence parallelism) get their
gradients in those placements already, so nothing moves. A region that returns a DTensor in any other structure
(a dict) is traced per block and inlined, as before (``_torch/_invoke_subgraph.py``: Dynamo stamps a reused trace's
outputs out as plain tensors), as is one from a call that is not flat (``call_key``) or a block passed in itself
(``regions.region_of``), which flatten nothing.

**Tensor subclass parameters.** What an all-gather extension's ``fsdp_post_all_gather`` rebuilds (torchao's
``Float8TrainingTensor``: float8 data and a scale) cannot be a region operand either. It enters as its inner
tensors (``__tensor_flatten__``), with a carrier of its gradient, and the region rebuilds it by
``__tensor_unflatten__`` from a ``SubclassSpec``: the flatten context that ``read_spec`` read off the one
``fsdp_post_all_gather`` call it makes at compile time, on tensors of the gathered shapes (the subclass itself
exists only inside the traced step), equal for every block of the kind (``subclass_reason``) and checked against
the traced subclass's at every call (an error that names the fix where the extension's settings changed since).
The subclass's gradient (torchao's float8 matmul gives its weight a plain one) leaves the region through the
carrier unchanged, to ``_extensions.Attach`` and the reduce-scatter, as inline. With regions on, the top level
builds neither the subclass nor its TP DTensor for a template region's blocks: ``traced_forward`` defers those
parameters (``capture.forward.Deferred``), and each block's call hands its region the inner tensors straight from
``fsdp_post_all_gather`` on the all-gather's outputs (``SubclassCrossing.direct``, one node a weight where
``Attach``, ``_as_dtensor``, ``to_local`` and ``Inner`` were four); a block of the kind that runs inline builds
its own. A TP parameter's DTensor of such a
subclass (torchao's float8 x TP) crosses the same way: its local tensor flattened, rebuilt inside, then made the
DTensor. The float8 activations such blocks make inside (a DTensor of a ``Float8TrainingTensor``) need two torch
fixes to trace as a region (``_torch/_nested_subclasses.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

from fsdp_compile._extensions import Attach
from fsdp_compile.capture.forward import data_parallel_grad


INLINE_PARALLEL = (
    "its parameters are DTensors of tensor or expert parallelism (or tensor subclasses an all-gather extension "
    "rebuilds) and its blocks differ in a plain attribute, so each is passed into the region itself, with them "
    "(torch 2.13's invoke_subgraph hands a region's DTensors back as plain tensors, and takes no subclass "
    "operands); only a template region flattens them"
)
INLINE_PARALLEL_DIFFERS = (
    "its DTensor parameter {name!r} is laid out differently in {fqn!r} than in {first!r} ({a} against {b}): "
    "a region's DTensor layout is a constant of its trace"
)
INLINE_SUBCLASS = (
    "fsdp_post_all_gather rebuilds its parameter {fqn!r} as a {kind}, which does not flatten to plain inner tensors "
    "(__tensor_flatten__), and torch 2.13's invoke_subgraph takes no tensor subclass operands"
)
INLINE_SUBCLASS_DIFFERS = (
    "fsdp_post_all_gather rebuilds its parameter {name!r} in {fqn!r} as {a}, in {first!r} as {b}: a region "
    "rebuilds it from its inner tensors with one flatten context, a constant of its trace"
)


def parallel_specs(plan, fqn: str, names) -> tuple:
    """Per tensor name of block ``fqn`` (``_make_region``'s ``names``): the ``ParallelSpec`` of a parameter
    handed to the block as a DTensor, else None (a plain parameter, an spmd_types one, a buffer)."""
    specs = {p.fqn: p.parallel for p in plan.group(fqn).params}
    out = tuple(specs.get(f"{fqn}.{n}") for n in names)
    return tuple(s if s is not None and s.grad_placements is None else None for s in out)


def parallel_reason(plan, fqns: list[str], names) -> str | None:
    """Why the DTensor parameters of blocks ``fqns`` cannot share one region's constants (None: they can)."""
    first = parallel_specs(plan, fqns[0], names)
    for fqn in fqns[1:]:
        for name, a, b in zip(names, parallel_specs(plan, fqn, names), first):
            if _spec_key(a) != _spec_key(b):
                return INLINE_PARALLEL_DIFFERS.format(name=name, fqn=fqn, first=fqns[0], a=_shown(a), b=_shown(b))
    return None


def _spec_key(spec):
    if spec is None:
        return None
    return (mesh_key(spec.mesh), tuple(spec.placements), tuple(spec.shape), tuple(spec.stride), tuple(spec.dp_dims))


def mesh_key(mesh) -> tuple:
    """A mesh by its ranks, dim names and process groups: ``mesh["tp"]`` is a new object at every slicing, and
    meshes compare equal by layout alone (two meshes of one shape on other groups would)."""
    try:
        return ("mesh", mesh.device_type, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()),
                mesh.mesh_dim_names, tuple(g.group_name for g in mesh.get_all_groups()))
    except AttributeError:  # a mesh torch handed over as an opaque object (FakeScriptObject) reads nothing: by identity
        return ("object", id(mesh))


def _shown(spec) -> str:
    return "a plain tensor" if spec is None else f"{spec.describe()}, shape {tuple(spec.shape)}"


def flattened(tensors: tuple, specs: tuple, subclasses: tuple | None = None, direct: tuple | None = None
              ) -> tuple | None:
    """The region's operands: each DTensor parameter as its local tensor, each subclass (its local tensor) as
    its inner tensors and a carrier of its gradient (``SubclassCrossing``), outside the region; None where one
    is not what the region was made for now (something replaced it: the block then runs inline). ``specs``: per
    tensor, whether it is a DTensor parameter (its ``ParallelSpec``, or a bool). ``direct``:
    per tensor, the operands ``SubclassCrossing.direct`` made of it straight from the all-gather (None: from
    ``tensors``)."""
    from torch.distributed.tensor import DTensor

    out = []
    for j, (t, s, sub) in enumerate(zip(tensors, specs, subclasses or (None,) * len(specs))):
        if direct is not None and direct[j] is not None:
            out += direct[j]
            continue
        if s:
            if not isinstance(t, DTensor):
                return None
            t = t.to_local()
        if sub is not None:
            if type(t) is not sub.spec.cls:
                return None
            out += sub.inner.apply(t)  # which checks its flatten context
        else:
            out.append(t)
    return tuple(out)


def rebuilt(operands: tuple, specs: tuple, subclasses: tuple | None = None) -> tuple:
    """Inside the region: ``flattened``'s operands as the block's tensors, each subclass rebuilt from its inner
    tensors and each local tensor as the DTensor ``_as_dtensor`` made of it, with their backwards."""
    out, i = [], 0
    for s, sub in zip(specs, subclasses or (None,) * len(specs)):
        if sub is None:
            t, i = operands[i], i + 1
        else:
            t, i = sub.rebuild.apply(*operands[i : i + _width(sub)]), i + _width(sub)
        if s is not None:
            t = _RegionDTensor.apply(t, s.mesh, s.placements, s.dp_dims, s.shape, s.stride)
        out.append(t)
    return tuple(out)


def width(subclasses: tuple) -> int:
    """How many operands ``flattened`` makes of the block's tensors."""
    return sum(_width(sub) for sub in subclasses)


def _width(sub) -> int:
    """Operands of one tensor across the boundary: itself, or a subclass's inner tensors and its carrier."""
    return 1 if sub is None else len(sub.spec.names) + 1


class SubclassSpec(NamedTuple):
    """What ``fsdp_post_all_gather`` builds for one parameter of a kind's blocks, a constant of their region:
    ``__tensor_unflatten__``'s class, inner tensor names, context and outer size and stride."""

    cls: type
    names: tuple[str, ...]
    ctx: object
    size: tuple[int, ...]
    stride: tuple[int, ...]


class SubclassCrossing(NamedTuple):
    """A subclass parameter across a region's boundary: ``inner`` (outside) hands the region its inner tensors
    and a carrier, and ``rebuild`` (inside) builds the subclass back from them; the carrier (the parameter's
    shape and dtype, no memory: stride 0) takes the subclass's gradient out of the region, where ``inner``'s
    backward hands it to the subclass, whose own backward (``_extensions.Attach``) takes it to the all-gather's.
    Only pass-throughs: the gradient the reduce-scatter gets is the inline compile's. ``direct`` is ``Attach``
    and ``inner`` in one, on what the all-gather returned (``capture.forward``'s deferred parameters): the
    subclass, and the TP DTensor of it that the block's own forward would read, are never built at top level."""

    spec: SubclassSpec
    inner: type
    rebuild: type
    direct: type


def subclass_specs(plan, fqn: str, names) -> tuple:
    """Per tensor name of block ``fqn``: the ``SubclassSpec`` of a parameter whose all-gather extension
    rebuilds it as a subclass that flattens to plain tensors, else None."""
    exts = {p.fqn: p.extension for p in plan.group(fqn).params}
    out = []
    for name in names:
        e = exts.get(f"{fqn}.{name}")
        flat = None if e is None else e.unsharded_flatten
        out.append(None if flat is None else SubclassSpec(*flat, tuple(e.orig_size), tuple(e.contiguous_stride)))
    return tuple(out)


def subclass_reason(plan, fqns: list[str], names) -> str | None:
    """Why the subclass parameters of blocks ``fqns`` cannot share one region's constants (None: they can)."""
    for p in (p for f in fqns for p in plan.group(f).params):
        if p.extension is not None and p.extension.unsharded_kind != "Tensor" and p.extension.unsharded_flatten is None:
            return INLINE_SUBCLASS.format(fqn=p.fqn, kind=p.extension.unsharded_kind)
    first = subclass_specs(plan, fqns[0], names)
    for fqn in fqns[1:]:
        for name, a, b in zip(names, subclass_specs(plan, fqn, names), first):
            if not _same(a, b):
                return INLINE_SUBCLASS_DIFFERS.format(name=name, fqn=fqn, first=fqns[0], a=_subclass_shown(a),
                                                      b=_subclass_shown(b))
    return None


def _same(a, b) -> bool:
    try:
        return bool(a == b)
    except Exception:  # a context holding tensors, or whose == is not a bool
        return a is b


def _subclass_shown(spec) -> str:
    return "a plain tensor" if spec is None else f"a {spec.cls.__name__} of context {spec.ctx!r}"


def subclass_crossings(specs: tuple) -> tuple:
    """``SubclassCrossing`` per ``SubclassSpec`` (None stays None): the functions of one kind's region. Each is
    its own class, holding its constants, ``allow_in_graph`` as ``_RegionDTensor`` (their outputs are subclasses
    and inner tensors of one, which AOTAutograd traces through; Dynamo's trace of a Function would not)."""
    return tuple(None if s is None else SubclassCrossing(s, *_subclass_functions(s)) for s in specs)


def _subclass_functions(spec: SubclassSpec) -> tuple[type, type, type]:
    def inner_tensors(t, fresh=()) -> tuple:
        # checked here, where Dynamo runs it on the traced subclass, not traces it: traced (with the comparison
        # of the context, a dict for torchao's), it took about 35 ms of a float8 x TP Llama block's 0.89 s
        ctx = spec.cls.__tensor_flatten__(t)[1]
        if not _same(ctx, spec.ctx):
            raise RuntimeError(
                f"fsdp_compile: fsdp_post_all_gather built a {spec.cls.__name__} of flatten context {ctx!r} in the "
                f"trace, where it built one of {spec.ctx!r} when fsdp_compile.compile read it: the all-gather "
                "extension's settings changed since; call fsdp_compile.compile again")
        carrier = torch.empty_strided(t.shape, (0,) * t.dim(), dtype=t.dtype, device=t.device)
        inner = [getattr(t, n) for n in spec.names]
        # an inner tensor that is one of ``fresh`` is copied: region operands may not alias one another
        return (*(x.clone() if any(x is f for f in fresh) else x.view_as(x) for x in inner), carrier)

    class Inner(torch.autograd.Function):
        @staticmethod
        def forward(t):
            return inner_tensors(t)

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.mark_non_differentiable(*output[:-1])
            ctx.set_materialize_grads(False)

        @staticmethod
        def backward(ctx, *grads):
            return grads[-1]

    class Rebuild(torch.autograd.Function):
        @staticmethod
        def forward(*operands):  # Inner's outputs: the inner tensors, then the carrier
            return spec.cls.__tensor_unflatten__(dict(zip(spec.names, operands)), spec.ctx, spec.size, spec.stride)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, grad):
            return (*(None for _ in spec.names), grad)

    class Direct(Inner):  # Inner's setup_context
        """``Attach`` then ``Inner``, on ``Attach``'s arguments; the carrier's gradient goes to the handle. A
        metadata tensor that the subclass holds as it is (torchao's scale, 0-dim) is copied: precomputed scales are
        views of one tensor, and Dynamo refuses region operands that alias one another (``Inner`` on ``Attach``'s
        output met no such aliasing there)."""

        @staticmethod
        def forward(local, outputs, metadata, handle, param_dtype, size, stride, fqn):
            full = Attach.forward(local, outputs, metadata, handle, param_dtype, size, stride, fqn)
            return inner_tensors(full, [x for x in pytree.tree_leaves(metadata) if isinstance(x, torch.Tensor)])

        @staticmethod
        def backward(ctx, *grads):
            return None, None, None, grads[-1], None, None, None, None

    for fn in (Inner, Rebuild, Direct):
        fn.fsdp_compile_key = repr(spec)  # AOTAutograd's cache key (``_torch/_aot_cache.py``): its source does not show it
        torch._dynamo.allow_in_graph(fn)
    return Inner, Rebuild, Direct


class _RegionDTensor(torch.autograd.Function):
    """``forward._DataParallelDTensor`` (with ``dp_dims`` ``()``: ``DTensor.from_local``'s backward) in the form
    a region's trace takes: AOTAutograd traces a region's body under functorch's transforms, which require
    ``setup_context``. ``allow_in_graph`` for the same reason as there."""

    @staticmethod
    def forward(local, mesh, placements, dp_dims, shape, stride):
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.placements, ctx.dp_dims = inputs[2], inputs[3]

    @staticmethod
    def backward(ctx, grad):
        return data_parallel_grad(grad, ctx.placements, ctx.dp_dims), None, None, None, None, None


torch._dynamo.allow_in_graph(_RegionDTensor)


# DTensor activations (``activations_flattened`` / ``activations_rebuilt``). Their layouts are interned here, each
# by an int that a region call's ``spec`` string carries (so the layout is a constant of the region's trace, and
# part of its reuse key), and the layouts of what a region returns, noted when Dynamo traces its body, per region
# and call key. Both are read and written only at trace time (``assume_constant_result``: Dynamo calls them
# eagerly and takes their results as constants).
_LAYOUTS: list = []  # (mesh, placements, shape, stride)
_LAYOUT_IDS: dict = {}
_OUTPUTS: dict = {}  # (region, call key) -> per output: a layout id, or None (a plain tensor or a constant)
_HOLDING: list = [None]  # the compile whose entries the three tables hold


def _tables(compile_id) -> None:
    """The tables serve the compile under way: a region's body is traced, cached and reused within one Dynamo
    compile (its invoke_subgraph cache is the TracingContext's), so when another compile writes, the earlier one's
    entries are dropped, and with them its meshes (and their process groups, which a process that compiles again
    after ``destroy_process_group`` would otherwise keep alive). Before, the tables grew with every compile."""
    if _HOLDING[0] != compile_id:
        _LAYOUTS.clear()
        _LAYOUT_IDS.clear()
        _OUTPUTS.clear()
        _HOLDING[0] = compile_id


@torch._dynamo.assume_constant_result
def _layout_id(mesh, placements, shape, stride) -> int:
    mesh = getattr(mesh, "real_obj", mesh)  # Dynamo hands a mesh over as a FakeScriptObject, new at every call
    # per compile: the mesh ``_layout`` hands back must be one this trace has a source for (its first block's).
    # Another compile's (a second model, or this one's before destroy_process_group) is new to Dynamo: a region
    # reused for the next block could not find it ("NameError: name 'sub_layout_0' is not defined")
    compile_id = torch._guards.CompileContext.current_compile_id()
    _tables(compile_id)
    key = (compile_id, mesh_key(mesh), tuple(placements), tuple(shape), tuple(stride))
    if key not in _LAYOUT_IDS:
        _LAYOUT_IDS[key] = len(_LAYOUTS)
        _LAYOUTS.append((mesh, tuple(placements), tuple(shape), tuple(stride)))
    return _LAYOUT_IDS[key]


@torch._dynamo.assume_constant_result
def _layout(i: int) -> tuple:
    return _LAYOUTS[i]


@torch._dynamo.assume_constant_result
def _note_outputs(key: tuple, ids: tuple) -> bool:
    _tables(torch._guards.CompileContext.current_compile_id())
    _OUTPUTS[key] = ids
    return True


@torch._dynamo.assume_constant_result
def _noted_outputs(key: tuple):
    return _OUTPUTS.get(key)


def _id_of(t) -> int:
    return _layout_id(t.device_mesh, t.placements, tuple(t.shape), t.stride())


def dtensor_parameters(crossing: tuple | None) -> bool:
    """Whether a region's ``crossing`` (``regions._crossing``: per tensor a ``ParallelSpec`` or None, and the
    subclass crossings) takes DTensor parameters."""
    return crossing is not None and any(crossing[0])


def symbolic_dtensor_call(operands: tuple, dtensors: bool) -> bool:
    """Whether a call that takes DTensors (``dtensors``: DTensor parameters; or a DTensor among ``operands``) is
    traced with dynamic shapes (after an automatic-dynamic recompile, say): its layouts and the note of its outputs
    are keyed by shapes, which must be constants of the trace (Dynamo refuses a SymInt given to
    ``assume_constant_result``), so such a call runs inline. Traced code cannot tell a SymInt from an int (Dynamo
    answers ``isinstance(s, torch.SymInt)`` False, ``isinstance(s, int)`` True), so the whole trace is asked."""
    from torch.distributed.tensor import DTensor

    if not (dtensors or any(isinstance(t, DTensor) for t in operands)):
        return False
    return _dynamic_trace()


@torch._dynamo.assume_constant_result
def _dynamic_trace() -> bool:
    """Whether the trace under way has a symbolic size (a backed symbol in its shape environment)."""
    ctx = torch._guards.TracingContext.try_get()
    env = getattr(getattr(ctx, "fake_mode", None), "shape_env", None)
    if env is None:
        return False
    # backed_var_to_val: torch 2.13 warns on var_to_val (deprecated), which older torches alone have
    return bool(env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val)


def activations_flattened(operands: tuple, first: int) -> tuple[tuple, str]:
    """Outside the region: ``operands`` with each DTensor from index ``first`` on (the block's buffers, then the
    call's activations) as its local tensor, and ``"index:layout,..."`` naming them (``spec``'s suffix: the
    layouts are constants of the region, and part of its reuse key)."""
    from torch.distributed.tensor import DTensor

    out, named = list(operands), []
    for i in range(first, len(out)):
        if isinstance(out[i], DTensor):
            named.append(f"{i}:{_id_of(out[i])}")
            out[i] = out[i].to_local()
    return tuple(out), ",".join(named)


def activations_rebuilt(operands: tuple, named: str) -> tuple:
    """Inside the region: the DTensor activations ``activations_flattened`` named, from their local tensors, with
    ``DTensor.from_local``'s backward (a gradient redistributed to their placements, Partial as Replicate)."""
    if not named:
        return operands
    out = list(operands)
    for part in named.split(","):
        i, _, k = part.partition(":")
        mesh, placements, shape, stride = _layout(int(k))
        out[int(i)] = _RegionDTensor.apply(out[int(i)], mesh, placements, (), shape, stride)
    return tuple(out)


def call_key(region: str, spec: str, operands: tuple, dtensors: bool) -> tuple:
    """What a region's outputs' layouts are noted by: the region, its call's structure and input layouts (``spec``),
    and of ``operands`` (the call's operands after the block's own tensors, whose shapes, dtypes and layouts are
    constants of the kind: about 250 steps of Dynamo's tracing per TP Llama block to read them) the tensors' shapes
    and dtypes (a DTensor's global shape follows them) and the constants (each its own trace:
    ``regions._reuse_key``), the same inside and outside the region. None for a call that is not flat (``spec``
    None) or takes no DTensor (no DTensor parameter, ``dtensors``, and no DTensor activation, which ``spec`` names
    after a "#", ``activations_flattened``): its outputs are left as they are
    (a DTensor among them: inline, ``_torch/_invoke_subgraph.py``). Only a DTensor call pays for the note: its key
    holds the shapes as constants, which a trace with dynamic shapes cannot give (Dynamo refuses a SymInt there)."""
    if spec is None or not (dtensors or "#" in spec):
        return None
    return (region, spec, *((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in operands))


def outputs_flattened(out, key: tuple):
    """Inside the region: its result with each DTensor (the result, or an item of a tuple or list) as its local
    tensor, their layouts noted under ``key`` for ``outputs_rebuilt``. Anything else is returned as it is."""
    from torch.distributed.tensor import DTensor

    items = out if type(out) in (tuple, list) else (out,)
    if key is None:
        return out
    if not any(isinstance(t, DTensor) for t in items):
        _note_outputs(key, None)
        return out
    _note_outputs(key, tuple(_id_of(t) if isinstance(t, DTensor) else None for t in items))
    flat = [t.to_local() if isinstance(t, DTensor) else t for t in items]
    return type(out)(flat) if type(out) in (tuple, list) else flat[0]


def outputs_rebuilt(out, key: tuple):
    """Outside the region: each output ``outputs_flattened`` handed back as its local tensor, as the DTensor the
    body returned (``DTensor.from_local``, its backward as there)."""
    ids = None if key is None else _noted_outputs(key)
    if ids is None:
        return out
    items = list(out) if type(out) in (tuple, list) else [out]
    for i, k in enumerate(ids):
        if k is not None:
            mesh, placements, shape, stride = _layout(k)
            items[i] = _RegionDTensor.apply(items[i], mesh, placements, (), shape, stride)
    return type(out)(items) if type(out) in (tuple, list) else items[0]
