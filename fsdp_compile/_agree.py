"""Check that ranks agree on plain data, with tensor collectives only.

``torch.distributed``'s object collectives pickle through NumPy, which neither torch's CPU wheel nor this
package depends on (``RuntimeError: Numpy is not available`` on a minimal install). Here every rank
serializes its items to JSON and the ranks of one process group compare a 32-byte digest: one small
all-gather when they agree, the common case. Only when they differ are the full payloads exchanged, so
the error can name the first item that differs and both ranks' values. Every rank raises the same kind
of error, within the process group's timeout, instead of a hang or a size mismatch in a later collective.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

_DIGEST = 32  # sha256


def _gather(payload: bytes, group, device: torch.device) -> list[bytes]:
    """Every rank's ``payload`` (any length), in group-rank order."""
    world = dist.get_world_size(group)
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    lengths = torch.empty(world, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(lengths, length, group=group)
    lengths_list = lengths.tolist()
    width = max(lengths_list)
    mine = torch.zeros(width, dtype=torch.uint8, device=device)
    if payload:
        mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
    gathered = torch.empty(world * width, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(gathered, mine, group=group)
    rows = gathered.view(world, width).cpu()
    return [bytes(rows[r, :n].tolist()) for r, n in enumerate(lengths_list)]


def check_same(what: str, items: list[tuple[str, object]], group, device: torch.device, fix: str) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all of them hold equal ``items``.

    ``items``: ``(label, JSON-serializable value)`` pairs, compared in order; the error names ``what``,
    the two ranks (global ranks), the first label whose values differ, both values and ``fix``.
    """
    if device.type == "meta":
        device = torch.device("cpu")
    payload = json.dumps(items, sort_keys=True, default=str).encode()
    digest = torch.frombuffer(bytearray(hashlib.sha256(payload).digest()), dtype=torch.uint8).to(device)
    world = dist.get_world_size(group)
    digests = torch.empty(world * _DIGEST, dtype=torch.uint8, device=device)
    dist.all_gather_into_tensor(digests, digest, group=group)
    if bool((digests.view(world, _DIGEST) == digest).all()):
        return
    payloads = _gather(payload, group, device)
    me = dist.get_rank(group)
    mine = json.loads(payload)
    for other, raw in enumerate(payloads):
        theirs = json.loads(raw)
        if theirs == mine:
            continue
        diff = next(
            (_first_difference(a[0], a[1], b[1]) for a, b in zip(mine, theirs) if a != b),
            ("number of entries", len(mine), len(theirs)),
        )
        label, a, b = diff
        raise ValueError(
            f"rank {dist.get_global_rank(group, me)} and rank {dist.get_global_rank(group, other)} disagree on "
            f"{what}: {label} is {a} vs {b}; {fix}"
        )
    # Our items equal everyone's, but some other pair differs: name one such pair too.
    first = json.loads(payloads[0])
    other = next(r for r, raw in enumerate(payloads) if json.loads(raw) != first)
    raise ValueError(
        f"rank {dist.get_global_rank(group, 0)} and rank {dist.get_global_rank(group, other)} disagree on {what}; {fix}"
    )


def _first_difference(label: str, a, b) -> tuple[str, object, object]:
    """Down to the first field that differs: ``("FSDP group 'x': params[2].shape", a, b)``."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in list(a) + [k for k in b if k not in a]:
            if a.get(key) != b.get(key):
                return _first_difference(f"{label}: {key}" if ":" not in label else f"{label}.{key}", a.get(key), b.get(key))
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return _first_difference(f"{label}[{i}]", x, y)
    return label, a, b


def agree_max(value: int, groups, device: torch.device) -> int:
    """The maximum of ``value`` over the ranks of every process group in ``groups`` (one after the other,
    so over a 2-D mesh given its row and column groups, the maximum over the mesh)."""
    if device.type == "meta":
        device = torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=device)
    for group in groups:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())
