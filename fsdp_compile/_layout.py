"""FSDP2's dim-0 layout of a sharded parameter: the one home of its arithmetic.

``fully_shard`` shards dim 0 with ``torch.chunk``; its collectives pad every rank to the same rows::

    full parameter: shape S, d = S[0] rows, inner = prod(S[1:]) (1 for a 1-D parameter)
    c = ceil(d / W)                               padded rows per rank
    rank r owns rows [r*c, min((r+1)*c, d))       -> rank_rows(d, W, r) in [0, c]; possibly none
    n = c * inner                                 padded elements per rank
    a bucket of parameters packs, per rank, [ p_0 (n_0) | p_1 (n_1) | ... ], p_i at offsets(n)[i]

Works on ints and SymInts (fake implementations run it on symbolic sizes). A leaf module: the ops, the
sharding plan, the kernels and the passes import it; it imports nothing of ours. (The kernel tests keep an
independent spec of this layout, on purpose: it is their oracle.)
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


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
