"""The ``fsdp_compile::`` ops: FSDP2's unshard and gradient reduce-scatter, functional and differentiable.

``unshard(shards, ...)`` turns one FSDP group's local dim-0 shards into its full parameters::

    copy-in (pad each shard to ceil(d/W) rows, cast to param_dtype, concatenate)
      -> _c10d_functional.all_gather_into_tensor -> wait_tensor
      -> copy-out (rank-major view, trim the padding)

and its backward is ``reduce_scatter_grads(grads, ...)``::

    pack (pad each grad to W*ceil(d/W) rows, cast to reduce_dtype, rank-major concatenation)
      -> _c10d_functional.reduce_scatter_tensor(avg | sum) -> wait_tensor
      -> unpack (this rank's unpadded rows, post-divide, cast to the parameter's dtype)

On one rank (world size 1, or a 1-wide shard dimension of a 2-D mesh) neither gathers nor copies, as FSDP2
issues no collective there: each parameter is its shard or one cast of it, each shard gradient its
unsharded gradient with FSDP2's casts and divides (``_one_rank``); HSDP's all-reduce stays.

Both are opaque to Dynamo (one node per FSDP group in the Dynamo graph, where the group structure is
still visible) and decomposed by AOTAutograd through ``DECOMPOSITIONS`` into the functional collectives
above, so the joint/forward/backward graphs hold plain ``_c10d_functional`` ops that Inductor and our
passes understand. The eager kernels run the same decomposition, so calling the ops outside ``compile``
gives the same numbers.

The numerics follow FSDP2 exactly (``_fsdp_collectives.foreach_reduce`` and
``_get_gradient_divide_factors``): fp32/bf16 reduce with ``avg``; other reduce dtypes (fp16) divide by
``pre`` before and ``post`` after a ``sum``; a user divide factor is applied as a pre-multiply, as
NCCL's ``PREMUL_SUM`` does. No rank is baked into the graphs: every rank-dependent size comes from the
shard shapes, so graphs of evenly sharded models are identical on every rank.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
from collections.abc import Sequence
from typing import Optional

import torch
from torch import Tensor

from fsdp_compile import _one_rank as one_rank  # registers own_copy, as K its ops
from fsdp_compile import _payloads as payload_copies  # registers pack_payloads, unpack_payloads, as K
from fsdp_compile import kernels as K  # registers the copy ops: a graph from the compile caches calls them untraced
from fsdp_compile._annotations import REDUCE_SCATTER, UNSHARD, annotate
from fsdp_compile._layout import add_partials, padded_rows, rank_rows, shard_views

_c10d = torch.ops._c10d_functional


# --- the ops' arguments: one typed record each, one string argument in the op schema -----------------
#
# Each op takes its tensors and one ``str``: its record, encoded with named fields (``encode``/``decode``,
# here only). A string is a constant of the graph, hashable and picklable, so the caches key on it, and
# no rank is in it: the graphs (and their cache entries) of evenly sharded models are the same on every
# rank, and one rank's saved artifacts serve the others.


@dataclasses.dataclass(frozen=True)
class Comm:
    """Where and how one FSDP collective runs."""

    fsdp_groups: tuple[str, ...]  # the FSDP module FQNs it serves ("" for the root): the annotation the passes read
    unit: int  # its unit in the schedule (``passes.schedule``): how the passes find it in every graph
    group_name: str  # the c10d process group the functional collective runs on
    world_size: int
    kernels: str  # how the fsdp_compile.kernels copy ops around each collective run (unshard_impl): "torch"
    #               their torch references, "triton" one Triton launch each
    offload: str | None = None  # CPUOffloadPolicy on an accelerator: its device type (to_device, to_host)
    offload_pinned: bool = False  # CPUOffloadPolicy(pin_memory=True): to_host's copies are non-blocking


@dataclasses.dataclass(frozen=True)
class Reduction:
    """How gradients are reduced, as FSDP2's ``foreach_reduce`` does: used by the backward only."""

    dtype: torch.dtype | None  # reduce-scatter dtype; None: the gradient's own
    op: str  # "avg" | "sum" | "premul_sum"
    pre_factor: float | None  # divisor before a "sum", multiplier for "premul_sum"
    post_factor: float | None  # divisor after the reduce-scatter (and HSDP's all-reduce)
    all_reduce_group: str | None = None  # HSDP: the replicate dimension's process group, all-reduced after the RS
    all_reduce_op: str = "avg"  # HSDP: "avg" | "sum"


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else getattr(torch, name)


class _Record:
    """``encode()`` to the op's string argument, ``decode(text)`` back (cached: the fake and eager
    implementations decode at every call)."""

    def encode(self) -> str:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in fields.items():
            if isinstance(value, tuple):  # sizes: a shard's rows under dynamic shapes specialize (parameters do not change shape)
                fields[name] = [int(v) for v in value]
        fields["comm"] = dataclasses.asdict(self.comm)
        fields["reduction"] = {**dataclasses.asdict(self.reduction), "dtype": _dtype_name(self.reduction.dtype)}
        for name in self._dtypes:
            fields[name] = _dtype_name(fields[name])
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    def schema(self) -> tuple:
        """The op's arguments after its tensor lists."""
        return (self.encode(),)

    @classmethod
    def decode(cls, text: str):
        return _decode(cls, text)


@functools.lru_cache(maxsize=4096)
def _decode(cls, text: str):
    fields = json.loads(text)
    comm = fields.pop("comm")
    reduction = fields.pop("reduction")
    for name in cls._dtypes:
        fields[name] = _dtype(fields[name])
    for name, value in fields.items():
        if isinstance(value, list):
            fields[name] = tuple(value)
    return cls(
        comm=Comm(**{**comm, "fsdp_groups": tuple(comm["fsdp_groups"])}),
        reduction=Reduction(**{**reduction, "dtype": _dtype(reduction["dtype"])}),
        **fields,
    )


@dataclasses.dataclass(frozen=True)
class UnshardArgs(_Record):
    """Everything ``fsdp_compile::unshard`` takes besides the local shards."""

    _dtypes = ("param_dtype",)

    comm: Comm
    dim0s: tuple[int, ...]  # each parameter's unsharded dim-0 size (the rest of its shape: the shard's)
    param_dtype: torch.dtype | None  # all-gather and compute dtype; None: the parameter's own
    reduction: Reduction  # parametrizes the backward (reduce_scatter_grads)
    # per parameter, how many all-gather inputs its fsdp_pre_all_gather returned (0: a plain parameter; see
    # _extensions.py); () when the unit has no extension
    payloads: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class ReduceScatterArgs(_Record):
    """Everything ``fsdp_compile::reduce_scatter_grads`` takes besides the full-size gradients."""

    _dtypes = ("orig_dtype",)

    comm: Comm
    local_rows: tuple[int, ...]  # this rank's unpadded rows of each parameter (0 past the end)
    orig_dtype: torch.dtype  # the sharded parameter's dtype: the shard gradients come back in it
    reduction: Reduction  # reduction.dtype is resolved (never None here)
    # HSDP's set_requires_all_reduce(False): reduce-scatter only, and hand back each parameter's rows of the
    # reduce-scattered buffer (FSDP2's partial reduce output: reduce dtype, not post-divided), no all-reduce
    all_reduce: bool = True


def _rank_of_rows(dim0s: Sequence[int], local_rows: Sequence[int], world_size: int) -> int:
    """The first rank whose dim-0 shards have ``local_rows`` rows: what the Triton copy kernels take as
    their rank, read off the shard shapes instead of the process. Evenly sharded, every rank has the same
    rows and this is 0 on all of them, so the rank stays out of the graph; unevenly sharded, the shapes
    (which are in the graph anyway) tell ranks apart only where their rows differ."""
    for r in range(world_size):
        if all(rank_rows(d, world_size, r) == n for d, n in zip(dim0s, local_rows)):
            return r
    raise ValueError(f"no rank of {world_size} holds {list(local_rows)} rows of dim-0 sizes {list(dim0s)}")


# --- the decompositions: what the compiled graphs hold ------------------------------------------------


def _padded(shard: Tensor, dim0: int, world_size: int, dtype) -> Tensor:
    """One plain parameter's all-gather input in a unit with extensions: its shard cast to ``dtype`` (None:
    keep) and padded with zero rows to ceil(dim0 / W), as FSDP2 pads an uneven dim-0 shard."""
    c = padded_rows(dim0, world_size)
    x = shard.to(dtype) if dtype is not None else shard
    if x.shape[0] != c:
        x = torch.constant_pad_nd(x, [0, 0] * (x.dim() - 1) + [0, c - x.shape[0]])
    return x


def to_device(shards: Sequence[Tensor], c: Comm) -> list[Tensor]:
    """CPU offload: the host shards copied to the device first, as FSDP2's ``all_gather_inputs`` copies them
    (``non_blocking=True``, pinned or not) before its copy-in casts them. ``_to_copy`` itself, not ``.to``:
    the graphs built on ``cpu`` for the tests (``_fsdp2.offload_device``) keep the copy, which ``.to`` of a
    tensor already there would skip."""
    return [torch.ops.aten._to_copy.default(s, device=torch.device(c.offload), non_blocking=True) for s in shards]


def to_host(grads: list[Tensor], c: Comm) -> list[Tensor]:
    """CPU offload: the reduce-scattered shard gradients, already in the parameters' dtype, copied to the
    host, as FSDP2's ``foreach_reduce`` copies them. With ``pin_memory=True`` non-blocking, into pinned memory
    (Inductor pins a non-blocking device-to-host copy's output, as ``_to_copy`` does eagerly), and
    ``_extensions.LocalShards``' backward waits for the copies before any gradient reaches ``.grad``, as
    FSDP2's ``finalize_backward`` waits on its offload events; a blocking copy would stall the host at each
    one until the device caught up (on an H200, 0.95B Llama: 2.13x eager FSDP2's step). Otherwise blocking,
    into pageable memory, as FSDP2 copies them then."""
    if not c.offload:
        return grads
    pinned = {"non_blocking": True} if c.offload_pinned else {}  # the pageable graph's copies as they were
    return [torch.ops.aten._to_copy.default(g, device=torch.device("cpu"), **pinned) for g in grads]


def unshard_impl(shards: list[Tensor], args: UnshardArgs, payloads: Sequence[Tensor] = ()) -> list[Tensor]:
    """copy-in -> all-gather -> wait -> copy-out, every node annotated with the FSDP group."""
    c = args.comm
    with annotate(UNSHARD, c.fsdp_groups, c.unit):
        if c.offload:  # an annotated part of the unshard: re-gathered in backward with it (reshard_after_forward)
            shards = to_device(shards, c)
        if any(args.payloads):  # all-gather extensions: torch ops (the Triton copy kernels take parameters only)
            return _unshard_payloads(shards, args, payloads)
        if c.world_size == 1:  # one rank: each parameter is its shard, or its cast
            return [one_rank.param(s, args.param_dtype) for s in shards]
        full_shapes = [(d, *s.shape[1:]) for s, d in zip(shards, args.dim0s)]
        # The copies on either side of a collective are ops (fsdp_compile.kernels), a Triton launch or their
        # torch reference (FSDP2's own copies), here and in reduce_scatter_grads_impl. Traced as torch ops (a
        # reshape, pad and cast per parameter, then a cat; a slice, clone and view per parameter) they made
        # most of the top-level graphs' nodes per block, and Inductor's compile time grows with those nodes
        # (its C++ code generation alone spends about 7 ms on each). The copy-out as an op: the cold first
        # step of an 8-layer HF Llama 61.5 -> 51.8 s (fake process group). The copy-ins and the gradients'
        # copy-out too: 16 layers on 2 gloo ranks 73.3 -> 61.8 s (two alternating runs each), 20
        # layers in one process 69.9 -> 60.6 s; the step within noise (HF Llama, 2 ranks: 0.85x -> 0.88x
        # eager's in two alternating runs each), its peak lower (86.8 -> 74.8 and 82.2 MiB).
        rank = _rank_of_rows(args.dim0s, [s.shape[0] for s in shards], c.world_size)
        flat = K.all_gather_copy_in(shards, full_shapes, c.world_size, rank, dtype=args.param_dtype, impl=c.kernels)
        return K.all_gather_copy_out(_all_gather(flat, c), full_shapes, c.world_size, impl=c.kernels)


def _all_gather(flat: Tensor, c) -> Tensor:
    """All-gather and wait (more than one rank: one rank gathers nothing, see ``_one_rank``)."""
    return _c10d.wait_tensor(_c10d.all_gather_into_tensor(flat, c.world_size, c.group_name))


def _unshard_payloads(shards: Sequence[Tensor], args: UnshardArgs, payloads: Sequence[Tensor]) -> list[Tensor]:
    """A unit with all-gather extensions, as FSDP2's ``foreach_all_gather`` and its copy-out: every rank's
    inputs (plain parameters padded and cast, extensions' ``fsdp_pre_all_gather`` tensors as they are)
    in one buffer, of their dtype where they share one, else (or where one is a float8) as bytes (uint8). Per extension parameter it
    returns its gathered inputs (each ``[W * rows, *rest]``, FSDP2's unflatten) and a stride-0 handle of the
    parameter's shape, whose gradient (``_extensions.Attach``) the backward reduce-scatters."""
    c, world_size = args.comm, args.comm.world_size
    if world_size == 1:  # nothing to gather: each input as it is (_one_rank.payloads)
        return one_rank.payloads(shards, args, payloads)
    pieces, it = [], iter(payloads)
    for shard, d, n in zip(shards, args.dim0s, args.payloads):
        pieces += [_padded(shard, d, world_size, args.param_dtype)] if n == 0 else [next(it) for _ in range(n)]
    # packed, as bytes where dtypes differ, and unpacked by one op each (``_payloads`` says why ops)
    chunks = iter(payload_copies.unpack(_all_gather(payload_copies.pack(pieces), c), pieces, world_size))
    outs = []
    for shard, d, n in zip(shards, args.dim0s, args.payloads):
        if n == 0:
            full = next(chunks)
            outs.append(full[:d] if full.shape[0] != d else full)
            continue
        outs += [next(chunks) for _ in range(n)]
        shape = (d, *shard.shape[1:])
        outs.append(torch.empty_strided(shape, (0,) * len(shape), dtype=args.param_dtype or shard.dtype, device=shard.device))
    return outs


def reduce_scatter_grads_impl(grads: list[Tensor], args: ReduceScatterArgs, partials: Sequence[Tensor | None] = ()) -> list[Tensor]:
    """pack -> reduce-scatter -> wait -> unpack, with FSDP2's divide factors, annotated like the unshard.
    HSDP: ``partials`` (per gradient, or empty) are the partial reduce outputs accumulated without all-reduce
    (``ReduceScatterArgs.all_reduce``), added to this reduce-scatter's output before the all-reduce, as
    FSDP2's ``foreach_reduce`` adds its ``partial_reduce_output``."""
    c, r = args.comm, args.reduction
    with annotate(REDUCE_SCATTER, c.fsdp_groups, c.unit):
        if c.world_size == 1 and r.all_reduce_group is None:  # one rank (_one_rank)
            return to_host([one_rank.grad(g, r, args.orig_dtype) for g in grads], c)
        packed = K.reduce_scatter_copy_in(grads, c.world_size, dtype=r.dtype, impl=c.kernels)  # unshard_impl says why an op
        op = r.op
        if op == "premul_sum" and c.world_size == 1:  # HSDP on a one-rank shard dim: FSDP2 divides (_one_rank.grad)
            packed, op = packed / (1.0 / r.pre_factor), "sum"
        elif op == "premul_sum":  # NCCL's PREMUL_SUM: scale each input, then sum
            packed, op = packed * r.pre_factor, "sum"
        elif r.pre_factor is not None and r.pre_factor != 1:  # FSDP2's _div_if_needed: no divide by 1
            packed = packed / r.pre_factor
        # one rank (HSDP's 1-wide shard dim; without HSDP _one_rank.grad): the packed buffer is already this
        # rank's, and it is all-reduced as it is
        reduced = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(packed, op, c.world_size, c.group_name)) if c.world_size > 1 else packed
        full_shapes = [tuple(g.shape) for g in grads]
        rank = _rank_of_rows([g.shape[0] for g in grads], args.local_rows, c.world_size)
        if r.all_reduce_group is not None:  # HSDP: then across the replicas, as FSDP2's foreach_reduce
            if not args.all_reduce:  # FSDP2 keeps this partial output as it is (on the device): no all-reduce, no post-divide
                return shard_views(reduced, full_shapes, c.world_size, rank)
            if any(p is not None for p in partials):
                reduced = add_partials(reduced, partials, full_shapes, args.local_rows, c.world_size)
            reduced = _c10d.wait_tensor(_c10d.all_reduce(reduced, r.all_reduce_op, r.all_reduce_group))
        if r.post_factor is not None and r.post_factor != 1:
            reduced = reduced / r.post_factor
        return to_host(shard_grads(reduced, full_shapes, c.world_size, rank, args.orig_dtype, c.kernels), c)


def shard_grads(reduced: Tensor, full_shapes, world_size: int, rank: int, dtype: torch.dtype, kernels: str) -> list[Tensor]:
    """This rank's shard gradients out of its flat reduce-scatter (or all-reduce) output ``reduced``: where no
    cast is needed, views of its rows (``shard_views``), as FSDP2's ``foreach_reduce`` leaves them, nothing
    copied; a cast, the copy-out op (Triton or torch) into tensors of their own, as FSDP2 casts."""
    if dtype != reduced.dtype:
        return K.reduce_scatter_copy_out(reduced, full_shapes, world_size, rank, dtype=dtype, impl=kernels)
    return shard_views(reduced, full_shapes, world_size, rank)


# --- the ops -------------------------------------------------------------------------------------------
# Eager calls only (compiled graphs use DECOMPOSITIONS): a custom op's outputs may not alias each other or
# its inputs, and some decompositions' outputs are views of one buffer (all-gather extensions' payloads),
# hence the clones.


@torch.library.custom_op("fsdp_compile::unshard", mutates_args=())
def unshard(shards: list[Tensor], sinks: list[Optional[Tensor]], accumulated: list[Optional[Tensor]],
            partial_sinks: list[Optional[Tensor]], partials: list[Optional[Tensor]],
            payloads: list[Tensor], args: str) -> list[Tensor]:
    """All-gather one unit's dim-0 shards into full parameters (see the module docstring). ``args`` is
    ``UnshardArgs.encode()``; its reduce-side fields parametrize the backward.

    Gradient accumulation without sync (FSDP2's ``set_requires_gradient_sync(False)``): ``sinks`` (one per
    parameter, empty otherwise) are leaves that own no memory; the backward then hands them the unsharded
    gradients instead of reduce-scattering, and autograd accumulates them into ``sink.grad`` in the sink's
    dtype (the reduce dtype), as FSDP2 keeps its unsharded gradients. The step that syncs passes those as
    ``accumulated``: its backward adds them to its own before the reduce-scatter, as FSDP2 does.

    HSDP without all-reduce (FSDP2's ``set_requires_all_reduce(False)``): ``partial_sinks`` (one per
    parameter, of its shard's shape, in the reduce dtype; empty otherwise) take each parameter's rows of the
    reduce-scattered buffer, not all-reduced and not post-divided, and autograd accumulates them into
    ``.grad`` as FSDP2 accumulates its ``partial_reduce_output``; the step that all-reduces passes those as
    ``partials``, added to its reduce-scatter's output before the all-reduce.

    All-gather extensions: ``payloads`` are the units' ``fsdp_pre_all_gather`` tensors (``_unshard_payloads``
    says what comes back for those parameters)."""
    outs = unshard_impl(shards, UnshardArgs.decode(args), payloads)
    return [t if t.dim() and 0 in t.stride() else t.clone() for t in outs]  # a stride-0 handle is its own memory


@unshard.register_fake
def _(shards, sinks, accumulated, partial_sinks, partials, payloads, args):
    a = UnshardArgs.decode(args)
    if not any(a.payloads):
        device = a.comm.offload  # None: the shards' own
        return [s.new_empty((d, *s.shape[1:]), dtype=a.param_dtype or s.dtype, device=device) for s, d in zip(shards, a.dim0s)]
    outs, it, w = [], iter(payloads), a.comm.world_size
    for s, d, n in zip(shards, a.dim0s, a.payloads):
        dtype = a.param_dtype or s.dtype
        if n == 0:
            outs.append(s.new_empty((d, *s.shape[1:]), dtype=dtype))
            continue
        for _ in range(n):
            t = next(it)
            outs.append(t.new_empty((w * t.shape[0], *t.shape[1:]) if t.dim() else (w,)))
        shape = (d, *s.shape[1:])
        outs.append(s.new_empty_strided(shape, (0,) * len(shape), dtype=dtype))
    return outs


@torch.library.custom_op("fsdp_compile::reduce_scatter_grads", mutates_args=())
def reduce_scatter_grads(grads: list[Tensor], partials: list[Optional[Tensor]], args: str) -> list[Tensor]:
    """Reduce-scatter full-parameter gradients into this rank's shard gradients (FSDP2's post-backward).
    ``args`` is ``ReduceScatterArgs.encode()``; ``partials``: HSDP's, see ``reduce_scatter_grads_impl``."""
    return [t.clone() for t in reduce_scatter_grads_impl(grads, ReduceScatterArgs.decode(args), partials)]


@reduce_scatter_grads.register_fake
def _(grads, partials, args):
    a = ReduceScatterArgs.decode(args)
    dtype = a.orig_dtype if a.all_reduce else a.reduction.dtype
    device = "cpu" if a.comm.offload and a.all_reduce else None  # None: the gradients' own (to_host)
    return [g.new_empty((rows, *g.shape[1:]), dtype=dtype, device=device) for g, rows in zip(grads, a.local_rows)]


@torch.library.custom_op("fsdp_compile::post_forward_shard", mutates_args=())
def post_forward_shard(gathered: Tensor, group_name: str) -> Tensor:
    """An int ``reshard_after_forward``'s post-forward shard (``passes/recompute.py``): this rank's chunk
    of a gathered buffer split over the post-forward process group ``group_name``, in memory of its own.
    The rank is read when the op runs, so it is not in the graph. An op, not ``clone`` of a view: Inductor
    removes such a clone as a no-op, and the saved view would keep the whole buffer alive."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    return gathered.view(group.size(), -1)[group.rank()].clone()


@post_forward_shard.register_fake
def _(gathered, group_name):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return gathered.new_empty(gathered.numel() // _resolve_process_group(group_name).size())


def _unshard_setup_context(ctx, inputs, output) -> None:
    shards, sinks, accumulated, partial_sinks, partials, payloads, args = inputs
    # A parameter whose gathered tensor gets no gradient (used only through argmax, say) keeps .grad None and
    # is not reduce-scattered, as in FSDP2's post-backward; materialized, it would be reduced as zeros and an
    # optimizer would then step it (weight decay, Adam's moments) where eager leaves it alone.
    ctx.set_materialize_grads(False)
    ctx.args = UnshardArgs.decode(args)
    ctx.local_rows = [s.shape[0] for s in shards]
    ctx.orig_dtypes = [s.dtype for s in shards]
    ctx.trainable = [s.requires_grad for s in shards]
    ctx.no_sync = any(t is not None for t in sinks)
    ctx.accumulated_at = [i for i, a in enumerate(accumulated) if a is not None]
    ctx.no_all_reduce = any(t is not None for t in partial_sinks)
    ctx.partials_at = [i for i, a in enumerate(partials) if a is not None]
    ctx.save_for_backward(*[a for a in accumulated if a is not None], *[a for a in partials if a is not None])
    ctx.n_schema = 1  # the encoded args
    ctx.n_payloads = len(payloads)  # no gradient: FSDP2 gathers them under no_grad
    ctx.n_sinks, ctx.n_accumulated = len(sinks), len(accumulated)  # each [] or one per shard
    ctx.n_partial_sinks, ctx.n_partials = len(partial_sinks), len(partials)


def _unshard_backward(ctx, grads):
    args: UnshardArgs = ctx.args
    if any(args.payloads):  # per parameter: its output's gradient, or its handle's (the last of its outputs)
        ends = itertools.accumulate(n + 1 for n in args.payloads)
        grads = [grads[e - 1] for e in ends]
    nones = [None] * len(grads)
    no_accumulated = [None] * ctx.n_accumulated
    no_partials = ([None] * ctx.n_partial_sinks, [None] * ctx.n_partials)
    if ctx.no_sync:  # no reduce-scatter: the unsharded gradients go to the sinks (autograd accumulates them)
        to_sinks = [g if ctx.trainable[i] else None for i, g in enumerate(grads)]
        return (nones, to_sinks, no_accumulated, *no_partials, [None] * ctx.n_payloads, *([None] * ctx.n_schema))
    grads = list(grads)
    saved = ctx.saved_tensors
    for i, acc in zip(ctx.accumulated_at, saved):  # FSDP2: accumulated += this backward's gradient
        grads[i] = acc if grads[i] is None else acc + grads[i]
    partials = dict(zip(ctx.partials_at, saved[len(ctx.accumulated_at):]))
    # Only parameters that require grad (and got one) take part, as in FSDP2's post_backward; the
    # selection is static per trace, so every rank issues the same reduce-scatter.
    keep = [i for i, g in enumerate(grads) if g is not None and ctx.trainable[i]]
    shard_grads: list[Tensor | None] = list(nones)
    if keep:
        reduction = dataclasses.replace(args.reduction, dtype=args.reduction.dtype or grads[keep[0]].dtype)
        rs = ReduceScatterArgs(args.comm, tuple(ctx.local_rows[i] for i in keep), ctx.orig_dtypes[keep[0]], reduction,
                               all_reduce=not ctx.no_all_reduce)
        reduced = reduce_scatter_grads([grads[i] for i in keep], [partials.get(i) for i in keep], *rs.schema())
        for i, g in zip(keep, reduced):
            shard_grads[i] = g
    if ctx.no_all_reduce:  # the reduce-scattered rows go to the partial sinks (autograd accumulates them)
        return (nones, [None] * ctx.n_sinks, no_accumulated, shard_grads, no_partials[1], [None] * ctx.n_payloads,
                *([None] * ctx.n_schema))
    return (shard_grads, [None] * ctx.n_sinks, no_accumulated, *no_partials, [None] * ctx.n_payloads,
            *([None] * ctx.n_schema))


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup_context)


# AOTAutograd decomposes our ops into the functional collectives above (see backend.py).
DECOMPOSITIONS = {
    torch.ops.fsdp_compile.unshard.default: (
        lambda shards, sinks, accumulated, partial_sinks, partials, payloads, args:
        unshard_impl(shards, UnshardArgs.decode(args), payloads)
    ),
    torch.ops.fsdp_compile.reduce_scatter_grads.default: (
        lambda grads, partials, args: reduce_scatter_grads_impl(grads, ReduceScatterArgs.decode(args), partials)
    ),
}
