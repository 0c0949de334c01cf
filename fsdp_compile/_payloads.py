"""The copies around the all-gather of a unit with all-gather extensions (``ops._unshard_payloads``), as two
``fsdp_compile::`` ops::

    fsdp_compile::pack_payloads(Tensor[] pieces, bool as_bytes) -> Tensor
    fsdp_compile::unpack_payloads(Tensor gathered, int world_size, str dtypes, SymInt[] flat_shapes,
                                  int[] ndims) -> Tensor[]

The pieces are what FSDP2 gathers for such a unit: each extension parameter's ``fsdp_pre_all_gather`` tensors
(torchao float8: float8 data, a 0-dim scale) and each plain parameter's shard, padded and cast. They go in one
buffer, of their dtype where they share one, else (or where one is a float8, which gloo has no type for) as
bytes, as FSDP2 packs them; each comes back of its dtype, gathered ([W * rows, *rest]; a 0-dim piece [W]).

One op each, with every piece reinterpreted as bytes and back inside it: traced as a view to bytes and one back
per piece around the copy ops, they were 38 of a float8 Llama layer's 106 top-level nodes in the forward graph,
as many again in the backward's re-gather (Inductor's lowering and the partitioner work per node). Torch only,
FSDP2's own copies (the Triton kernels take parameters of one dtype: ``kernels/``), and not differentiable:
FSDP2 gathers these inputs under no_grad, and the unshard op's backward is the gradient's path. Defined as the
kernels' ops are (``kernels/_library.py``): the lighter call.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from fsdp_compile.kernels._common import flatten_shapes, unflatten_shapes


def pack(pieces: Sequence[Tensor]) -> Tensor:
    """This rank's all-gather input: every piece flattened into one buffer, as bytes where their dtypes differ
    or one is a float8."""
    as_bytes = len({p.dtype for p in pieces}) > 1 or any(p.dtype.is_floating_point and p.dtype.itemsize == 1 for p in pieces)
    return torch.ops.fsdp_compile.pack_payloads(list(pieces), as_bytes)


def unpack(gathered: Tensor, pieces: Sequence[Tensor], world_size: int) -> list[Tensor]:
    """Every piece of ``pack(pieces)`` on each of ``world_size`` ranks, gathered: [W * rows, *rest] (FSDP2's
    unflatten; a 0-dim piece [W]), of the piece's dtype, in memory of its own."""
    return torch.ops.fsdp_compile.unpack_payloads(gathered, world_size, *unpack_arguments(pieces, world_size))


def unpack_arguments(pieces: Sequence[Tensor], world_size: int) -> tuple[str, list, list[int]]:
    """``unpack_payloads``' arguments after ``world_size``: the pieces' dtype names and gathered shapes."""
    shapes = [(world_size * p.shape[0], *p.shape[1:]) if p.dim() else (world_size,) for p in pieces]
    return (",".join(str(p.dtype).removeprefix("torch.") for p in pieces), *flatten_shapes(shapes))


def _pack(pieces: list[Tensor], as_bytes: bool) -> Tensor:
    return torch.cat([p.reshape(-1).view(torch.uint8) if as_bytes else p.reshape(-1) for p in pieces])


def _pack_fake(pieces, as_bytes):
    n = sum(p.numel() * (p.dtype.itemsize if as_bytes else 1) for p in pieces)
    return pieces[0].new_empty((n,), dtype=torch.uint8 if as_bytes else pieces[0].dtype)


def _unpack(gathered: Tensor, world_size: int, dtypes: str, flat_shapes, ndims) -> list[Tensor]:
    """The pieces out of the all-gather output (rank-major: each rank's packed buffer in turn): one
    ``split_with_sizes_copy`` of the buffer viewed [W, N], FSDP2's copy-out, then views of each piece's."""
    pieces, n = _plan(dtypes, tuple(flat_shapes), tuple(ndims), world_size, gathered.dtype)
    outs = [gathered.new_empty((world_size, k)) for k in n]
    torch.split_with_sizes_copy(gathered.view(world_size, -1), n, dim=1, out=outs)
    return [(out.view(dtype) if dtype != gathered.dtype else out).view(shape) for out, (dtype, shape) in zip(outs, pieces)]


@functools.lru_cache(maxsize=1024)
def _plan(dtypes: str, flat_shapes: tuple, ndims: tuple, world_size: int, buffer_dtype: torch.dtype) -> tuple:
    """Once per call site (as the kernels' ``_plan``; ``_unpack`` runs at every step): each piece's dtype and
    gathered shape, and its elements of the buffer per rank."""
    pieces = tuple(zip(_dtypes(dtypes), unflatten_shapes(flat_shapes, ndims)))
    n = [math.prod(shape) // world_size * dtype.itemsize // buffer_dtype.itemsize for dtype, shape in pieces]
    return pieces, n


def _unpack_fake(gathered, world_size, dtypes, flat_shapes, ndims):
    return [gathered.new_empty(shape, dtype=dtype) for dtype, shape in zip(_dtypes(dtypes), unflatten_shapes(flat_shapes, ndims))]


@functools.lru_cache(maxsize=256)
def _dtypes(names: str) -> tuple[torch.dtype, ...]:
    """``dtypes``, a constant string of the graph (comma-separated names), as dtypes."""
    return tuple(getattr(torch, n) for n in names.split(","))


_lib = torch.library.Library("fsdp_compile", "FRAGMENT")
_lib.define("pack_payloads(Tensor[] pieces, bool as_bytes) -> Tensor")
_lib.define("unpack_payloads(Tensor gathered, int world_size, str dtypes, SymInt[] flat_shapes, int[] ndims) -> Tensor[]")
for _name, _impl, _fake in (("pack_payloads", _pack, _pack_fake), ("unpack_payloads", _unpack, _unpack_fake)):
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")  # every device; never decomposed by tracers
    torch.library.register_fake(f"fsdp_compile::{_name}", _fake, lib=_lib)
