"""FSDP2's dim-0 layout of a sharded parameter: the one home of its arithmetic.

``fully_shard`` shards dim 0 with ``torch.chunk``; its collectives pad every rank to the same rows::

    full parameter: shape S, d = S[0] rows, inner = prod(S[1:]) (1 for a 1-D parameter)
    c = ceil(d / W)                               padded rows per rank
    rank r owns rows [r*c, min((r+1)*c, d))       -> rank_rows(d, W, r) in [0, c]; possibly none
    n = c * inner                                 padded elements per rank
    a bucket of parameters packs, per rank, [ p_0 (n_0) | p_1 (n_1) | ... ], p_i at offsets(n)[i]

Works on ints and SymInts (fake implementations run it on symbolic sizes); ``shard_views`` and
``add_partials`` apply it to a packed buffer. A leaf module: the ops, the sharding plan, the kernels and the
passes import it; it imports nothing of ours. (The kernel tests keep an independent spec of this layout, on
purpose: it is their oracle.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch._prims_common import make_contiguous_strides_for


def padded_rows(d, world_size: int):
    """c = ceil(d / W): rows every rank holds after padding (``torch.chunk``'s chunk size)."""
    return (d + world_size - 1) // world_size


def rank_rows(d, world_size: int, rank: int):
    """Unpadded rows of a d-row parameter on ``rank``: ``min(c, max(0, d - rank * c))``."""
    c = padded_rows(d, world_size)
    if type(d) is int:  # fast path: torch.sym_min/max cost microseconds, and calls carry hundreds of params
        return min(c, max(0, d - rank * c))
    return torch.sym_min(c, torch.sym_max(0, d - rank * c))


def inner_numel(shape: Sequence) -> int:
    """``prod(S[1:])``: elements per row (1 for a 1-D parameter)."""
    return math.prod(shape[1:])


def padded_numels(full_shapes: Sequence[Sequence], world_size: int) -> list:
    """``n_i = ceil(d_i / W) * prod(S_i[1:])`` for every parameter: its padded elements per rank."""
    return [padded_rows(s[0], world_size) * inner_numel(s) for s in full_shapes]


def offsets(sizes: Sequence) -> list:
    """Exclusive prefix sums: where each segment starts in a packed buffer."""
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc = acc + s
    return out


def shard_views(flat: torch.Tensor, full_shapes: Sequence[Sequence], world_size: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s shard of every parameter as a view of ``flat``, its packed rows (padding trimmed), as
    FSDP2's ``as_strided`` views of its reduce-scatter output: disjoint, sharing ``flat``'s memory."""
    outs, offset = [], flat.storage_offset()
    for shape, n in zip(full_shapes, padded_numels(full_shapes, world_size)):
        local = (rank_rows(shape[0], world_size, rank), *shape[1:])
        outs.append(flat.as_strided(local, make_contiguous_strides_for(local), offset))
        offset = offset + n
    return outs


def add_partials(reduced: torch.Tensor, partials: Sequence[torch.Tensor | None], full_shapes, local_rows, world_size: int) -> torch.Tensor:
    """``reduced`` (this rank's flat reduce-scatter output) with each parameter's accumulated partial added to
    its rows: FSDP2's ``reduce_output += partial_reduce_output``, element by element; padding rows and
    parameters without a partial are left as they are (no ``+ 0``, which would turn a -0.0 into 0.0)."""
    pieces, offset = [], 0
    for shape, rows, partial in zip(full_shapes, local_rows, partials):
        rest = math.prod(shape[1:])
        block, mine = padded_rows(shape[0], world_size) * rest, rows * rest
        if partial is None or mine == 0:
            pieces.append(reduced[offset:offset + block])
        else:
            pieces.append(reduced[offset:offset + mine] + partial.reshape(-1))
            if block > mine:
                pieces.append(reduced[offset + mine:offset + block])
        offset += block
    return torch.cat(pieces)
