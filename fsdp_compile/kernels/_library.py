"""The four copy kernels as ``fsdp_compile::`` torch.library ops, and the public functions that call them.

Schemas (full shapes are lists of lists, which a schema cannot hold, so they travel flattened: either as
``dim0s`` with the trailing dims read off the per-parameter input tensors, or as ``flat_shapes`` + ``ndims``
from ``_common.flatten_shapes``)::

    fsdp_compile::all_gather_copy_in(Tensor[] shards, SymInt[] dim0s, int world_size, int rank,
                                     ScalarType? dtype=None, str impl="auto") -> Tensor
    fsdp_compile::all_gather_copy_out(Tensor gathered, SymInt[] flat_shapes, int[] ndims, int world_size,
                                      ScalarType? dtype=None, str impl="auto") -> Tensor[]
    fsdp_compile::reduce_scatter_copy_in(Tensor[] grads, int world_size,
                                         ScalarType? dtype=None, str impl="auto") -> Tensor
    fsdp_compile::reduce_scatter_copy_out(Tensor reduced, SymInt[] flat_shapes, int[] ndims, int world_size,
                                          int rank, ScalarType? dtype=None, str impl="auto") -> Tensor[]

``impl`` is an op argument, so each call in a graph carries its choice: "triton", "torch", or "auto"
(Triton on CUDA when it is usable, torch otherwise), resolved when the op runs. The ops are functional
(no input is mutated, every output is a fresh allocation) and have fake implementations, so they trace
under make_fx / FakeTensorMode / torch.compile(fullgraph=True).

Why an opaque op and not ``triton_op``: a ``triton_op`` body is also its fake implementation and is
decomposed into its kernels whenever AOTAutograd functionalizes, for every backend, so the body runs on
fake tensors. Ours cannot: one launch over many tensors needs their addresses in a pointer table, and fake
tensors have none (``data_ptr()`` raises); without a table it would be one launch per tensor. And under
``TRITON_INTERPRET=1`` ``wrap_triton`` returns the raw interpreted kernel, which cannot run on fake tensors,
so the CPU end-to-end test could not use Triton at all. As opaque ops the kernels run as they are, in
eager, under aot_eager and as Inductor fallback kernels, on CUDA and (interpreted) on CPU.

Autograd: the four ops are two adjoint pairs, registered as each other's backward, casting gradients
back to the input dtype: all_gather_copy_in <-> reduce_scatter_copy_out (pad <-> trim one rank's chunk)
and all_gather_copy_out <-> reduce_scatter_copy_in (unpack <-> pack all ranks' chunks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _common as C
from . import _all_gather_copy_in as _agi
from . import _all_gather_copy_out as _ago
from . import _reduce_scatter_copy_in as _rsi
from . import _reduce_scatter_copy_out as _rso

# Defined with torch.library.Library rather than custom_op: the same op to the dispatcher and to every
# tracer, at half the per-call Python overhead (measured with 96 tensors: 13 vs 29 us for a Tensor[]
# input, 16 vs 40 us for a Tensor[] output), which matters for buckets of many small parameters.
_lib = torch.library.Library("fsdp_compile", "FRAGMENT")


def _define(name: str, schema: str, impl, fake, setup_context, backward) -> None:
    _lib.define(name + schema)
    # CompositeExplicitAutograd: one implementation for every device (impl picks the kernel), never
    # decomposed by tracers; the fake below serves Meta and FakeTensor.
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"fsdp_compile::{name}", fake, lib=_lib)
    op = getattr(torch.ops.fsdp_compile, name).default
    _lib.impl(name, _autograd_kernel(op, impl, backward, setup_context), "Autograd", with_keyset=True)


_BELOW_AUTOGRAD = torch._C._after_autograd_keyset
_DENSE = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)


def _autograd_kernel(op, impl, backward, setup_context):
    """``torch.library.register_autograd``'s kernel, with a short way through for the calls that need no
    graph: a compiled step's (its forward and backward graphs run under no_grad) call the ops with plain
    CPU or CUDA tensors and no mode or subclass in the way, and there the dispatcher would only redispatch
    to ``impl`` below autograd, another trip from Python to C++ and back, boxing every argument. Those calls
    run ``impl`` here, as that redispatch would (below autograd); every other call (one that records a graph,
    or meets a fake or functional tensor, a mode, vmap) takes register_autograd's own path. On the
    development machine the trip cost 6-16 us of a call's 50-90 (one 0.95B-Llama block's ops at W=8, launch
    stubbed); on an H100's host a call takes 120-260 us (bench/op_overhead.py)."""
    slow = torch._library.autograd.make_autograd_impl(op, torch._library.autograd.Info(backward, setup_context))

    def kernel(keyset, *args):
        if not (torch._C.is_grad_enabled() and torch._C._any_requires_grad(*args)) and _dense_below_autograd(keyset):
            with torch._C._AutoDispatchBelowAutograd():
                return impl(*args)
        return slow(keyset, *args)

    return kernel


_DENSE_BELOW_AUTOGRAD: dict[int, bool] = {}  # keyset.raw_repr() -> answer (DispatchKeySet is not hashable)


def _dense_below_autograd(keyset) -> bool:
    """Whether the dispatcher's next kernel below autograd for ``keyset`` is the CPU or CUDA one (ours),
    ADInplaceOrView (a fallthrough for these ops) aside."""
    raw = keyset.raw_repr()
    hit = _DENSE_BELOW_AUTOGRAD.get(raw)
    if hit is None:
        below = (keyset & _BELOW_AUTOGRAD).remove(torch._C.DispatchKey.ADInplaceOrView)
        hit = _DENSE_BELOW_AUTOGRAD[raw] = below.highestPriorityTypeId() in _DENSE
    return hit


def _with_nones(ctx, grad):
    """``grad`` for the first input, None for the others: as many as the call passed (defaults omitted
    by the caller are not inputs to autograd; ``ctx.needs_input_grad`` has one entry per passed input)."""
    return (grad, *[None] * (len(ctx.needs_input_grad) - 1))


# ---------------------------------------------------------------------------------------------------------
# fsdp_compile::all_gather_copy_in


def _agi_fake(shards, dim0s, world_size, rank, dtype=None, impl="auto"):
    n = _agi.check(shards, dim0s, world_size, rank)
    C.check_impl(impl)
    return shards[0].new_empty((sum(n),), dtype=dtype or shards[0].dtype)


def _agi_setup(ctx, inputs, output):
    shards, dim0s, world_size, rank, _, impl = inputs
    ctx.full_shapes = [(d, *s.shape[1:]) for s, d in zip(shards, dim0s)]
    ctx.args = (world_size, rank, shards[0].dtype, impl)


def _agi_backward(ctx, grad):
    # adjoint of pad = trim: this rank's rows of each segment, cast back to the shards' dtype
    world_size, rank, dtype, impl = ctx.args
    flat, ndims = C.flatten_shapes(ctx.full_shapes)
    return _with_nones(ctx, torch.ops.fsdp_compile.reduce_scatter_copy_out(grad, flat, ndims, world_size, rank, dtype, impl))


_define(
    "all_gather_copy_in",
    '(Tensor[] shards, SymInt[] dim0s, int world_size, int rank, ScalarType? dtype=None, str impl="auto") -> Tensor',
    _agi.run, _agi_fake, _agi_setup, _agi_backward,
)


# ---------------------------------------------------------------------------------------------------------
# fsdp_compile::all_gather_copy_out


def _ago_fake(gathered, flat_shapes, ndims, world_size, dtype=None, impl="auto"):
    _, shapes, _ = _ago.check(gathered, C.unflatten_shapes(flat_shapes, ndims), world_size)
    C.check_impl(impl)
    return [gathered.new_empty(s, dtype=dtype or gathered.dtype) for s in shapes]


def _ago_setup(ctx, inputs, output):
    gathered, _, _, world_size, _, impl = inputs
    ctx.args = (world_size, gathered.dtype, impl, gathered.shape)


def _ago_backward(ctx, grads):
    # adjoint of unpack = pack (zero padding); grads of unused outputs arrive as zeros (autograd
    # materializes them), so the list is complete.
    world_size, dtype, impl, shape = ctx.args
    return _with_nones(ctx, torch.ops.fsdp_compile.reduce_scatter_copy_in(grads, world_size, dtype, impl).view(shape))


_define(
    "all_gather_copy_out",
    '(Tensor gathered, SymInt[] flat_shapes, int[] ndims, int world_size, ScalarType? dtype=None, str impl="auto") -> Tensor[]',
    _ago.run, _ago_fake, _ago_setup, _ago_backward,
)


# ---------------------------------------------------------------------------------------------------------
# fsdp_compile::reduce_scatter_copy_in


def _rsi_fake(grads, world_size, dtype=None, impl="auto"):
    n = _rsi.check(grads, world_size)
    C.check_impl(impl)
    return grads[0].new_empty((world_size * sum(n),), dtype=dtype or grads[0].dtype)


def _rsi_setup(ctx, inputs, output):
    grads, world_size, _, impl = inputs
    ctx.full_shapes = [tuple(g.shape) for g in grads]
    ctx.args = (world_size, grads[0].dtype, impl)


def _rsi_backward(ctx, grad):
    # adjoint of pack = unpack: every full gradient back out of the rank-major buffer
    world_size, dtype, impl = ctx.args
    flat, ndims = C.flatten_shapes(ctx.full_shapes)
    return _with_nones(ctx, torch.ops.fsdp_compile.all_gather_copy_out(grad, flat, ndims, world_size, dtype, impl))


_define(
    "reduce_scatter_copy_in",
    '(Tensor[] grads, int world_size, ScalarType? dtype=None, str impl="auto") -> Tensor',
    _rsi.run, _rsi_fake, _rsi_setup, _rsi_backward,
)


# ---------------------------------------------------------------------------------------------------------
# fsdp_compile::reduce_scatter_copy_out


def _rso_fake(reduced, flat_shapes, ndims, world_size, rank, dtype=None, impl="auto"):
    _, local, _ = _rso.check(reduced, C.unflatten_shapes(flat_shapes, ndims), world_size, rank)
    C.check_impl(impl)
    return [reduced.new_empty(s, dtype=dtype or reduced.dtype) for s in local]


def _rso_setup(ctx, inputs, output):
    reduced, flat_shapes, ndims, world_size, rank, _, impl = inputs
    ctx.dim0s = [s[0] for s in C.unflatten_shapes(flat_shapes, ndims)]
    ctx.args = (world_size, rank, reduced.dtype, impl, reduced.shape)


def _rso_backward(ctx, grads):
    # adjoint of trim = pad
    world_size, rank, dtype, impl, shape = ctx.args
    return _with_nones(ctx, torch.ops.fsdp_compile.all_gather_copy_in(grads, ctx.dim0s, world_size, rank, dtype, impl).view(shape))


_define(
    "reduce_scatter_copy_out",
    '(Tensor reduced, SymInt[] flat_shapes, int[] ndims, int world_size, int rank, ScalarType? dtype=None, str impl="auto") -> Tensor[]',
    _rso.run, _rso_fake, _rso_setup, _rso_backward,
)


# ---------------------------------------------------------------------------------------------------------
# Public functions: check arguments (naming the bad one), flatten shapes for the schemas, call the ops.
# Inside a traced graph call these with out=None: each becomes one op node. ``out=`` writes in place
# (e.g. straight into this rank's slice of an all-gather buffer, as FSDP2 does): eager only, not
# differentiable, not an op.
# impl everywhere: "triton", "torch" or "auto" (Triton on CUDA when usable, torch otherwise).


def _check_scalars(world_size, rank, dtype, impl) -> None:
    """Before the op call: the dispatcher's own schema errors do not say what to pass instead."""
    C.check_world(world_size, rank)
    C.check_dtype(dtype)
    C.check_impl(impl)


def all_gather_copy_in(
    shards: Sequence[torch.Tensor],
    full_shapes: Sequence[Sequence[int]],
    world_size: int,
    rank: int,
    dtype: torch.dtype | None = None,
    impl: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """This rank's packed all-gather input, [sum(n_i)]: every local shard flattened, zero-padded to n_i,
    cast to ``dtype`` (None: keep). shards[i]: [rows_r_i, *S_i[1:]], any strides; full_shapes[i] = S_i."""
    # The op checks the shards against (dim0s, world_size, rank); only the trailing dims, which the op
    # reads off the shards, are checked here.
    shapes = C.check_full_shapes(full_shapes)
    _check_scalars(world_size, rank, dtype, impl)
    if isinstance(shards, torch.Tensor) or not isinstance(shards, (list, tuple)):
        raise TypeError(f"shards must be a list of tensors, got {type(shards).__name__}")
    if len(shapes) != len(shards):
        raise ValueError(f"got {len(shards)} shards but {len(shapes)} full_shapes: pass one full shape per shard")
    for i, (s, full) in enumerate(zip(shards, shapes)):
        if isinstance(s, torch.Tensor) and s.shape[1:] != full[1:]:
            raise ValueError(
                f"shards[{i}] has shape {tuple(s.shape)} but full_shapes[{i}] = {tuple(full)}: a dim-0 shard keeps "
                f"the trailing dims {tuple(full[1:])}; pass the matching full shape or shard"
            )
    dim0s = [s[0] for s in shapes]
    if out is not None:
        with torch.no_grad():
            return _agi.run(list(shards), dim0s, world_size, rank, dtype, impl, out=out)
    return torch.ops.fsdp_compile.all_gather_copy_in(list(shards), dim0s, world_size, rank, dtype, impl)


def all_gather_copy_out(
    gathered: torch.Tensor,
    full_shapes: Sequence[Sequence[int]],
    world_size: int,
    dtype: torch.dtype | None = None,
    impl: str = "auto",
) -> list[torch.Tensor]:
    """Every full parameter from the all-gather output: gathered [W * sum(n_i)], rank-major -> one
    contiguous [S_i] per parameter, padding trimmed, cast to ``dtype`` (None: keep)."""
    shapes = C.check_full_shapes(full_shapes)
    _check_scalars(world_size, None, dtype, impl)
    flat, ndims = C.flatten_shapes(shapes)
    return torch.ops.fsdp_compile.all_gather_copy_out(gathered, flat, ndims, world_size, dtype, impl)


def reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor],
    world_size: int,
    dtype: torch.dtype | None = None,
    impl: str = "auto",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The reduce-scatter input, [W * sum(n_i)]: rank r's chunk is rows [r*c_i, (r+1)*c_i) of every
    grads[i] ([S_i], any strides), flattened and zero-padded to n_i; cast to ``dtype`` (None: keep)."""
    C.check_tensor_list(grads, "grads")
    _check_scalars(world_size, None, dtype, impl)
    if out is not None:
        with torch.no_grad():
            return _rsi.run(list(grads), world_size, dtype, impl, out=out)
    return torch.ops.fsdp_compile.reduce_scatter_copy_in(list(grads), world_size, dtype, impl)


def reduce_scatter_copy_out(
    reduced: torch.Tensor,
    full_shapes: Sequence[Sequence[int]],
    world_size: int,
    rank: int,
    dtype: torch.dtype | None = None,
    impl: str = "auto",
) -> list[torch.Tensor]:
    """This rank's sharded gradients from its reduce-scatter output: reduced [sum(n_i)] -> one
    [rows_r_i, *S_i[1:]] per parameter, padding trimmed, cast to ``dtype`` (None: keep)."""
    shapes = C.check_full_shapes(full_shapes)
    _check_scalars(world_size, rank, dtype, impl)
    flat, ndims = C.flatten_shapes(shapes)
    return torch.ops.fsdp_compile.reduce_scatter_copy_out(reduced, flat, ndims, world_size, rank, dtype, impl)
