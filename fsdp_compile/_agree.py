"""Check that ranks agree on plain data, through the process group's store: never a collective.

An agreement runs where one rank may be alone: in ``fsdp_compile.compile`` and at the first call of the
compiled model. Over collectives, a rank whose peers are elsewhere (in the eager model's all-gathers,
another collective) pairs its small all-gather with theirs, of another size, and gloo aborts the process
(``EnforceNotMet``: "Received data size doesn't match", exit -6), which no ``except`` can catch. The
c10d store behind the group (a TCPStore under torchrun) pairs nothing: each rank sets a key under
``fsdp_compile/agree/<group name>/<round>/``, waits for its peers' keys within the group's timeout, and a
rank whose peers never come raises an error that names them and the fix. The round is this rank's count
of agreements on the group, kept in the store too, so a new process group starts again at round 1. The
keys stay (tens of bytes per rank and agreement, a few agreements per compile): deleting them safely
would take one more round of waiting.

Every rank serializes its items to JSON and publishes a 32-byte digest; only when the digests differ are
the full payloads exchanged, so the error can name the first item that differs and both ranks' values.
Every rank raises the same kind of error, within the process group's timeout, instead of a hang.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_process_group_store

from fsdp_compile._quote import quoted

_PREFIX = "fsdp_compile/agree"
_FIX = (
    "every rank must call fsdp_compile.compile(model) and then the compiled model for every step, together "
    "(docs/troubleshooting.md)"
)


def _timeout(group) -> datetime.timedelta:
    """The process group's own timeout (what its collectives wait: gloo's and NCCL's options), else its
    store's (a backend without options, or a torch that moved them): a bound either way."""
    try:
        return group._get_backend(torch.device(group._device_types[0])).options._timeout
    except (AttributeError, IndexError, RuntimeError):
        return _get_process_group_store(group).timeout


class _Round:
    """One agreement of this rank with the other ranks of ``group``, over its store."""

    def __init__(self, group, what: str):
        self.group, self.what = group, what
        self.store = _get_process_group_store(group)
        self.world, self.me = group.size(), group.rank()
        self.timeout = _timeout(group)
        base = f"{_PREFIX}/{group.group_name}"
        self.prefix = f"{base}/{self.store.add(f'{base}/rounds/{self.me}', 1)}"

    def exchange(self, tag: str, value: bytes) -> list[bytes]:
        """Every rank's ``value`` for ``tag``, in group-rank order, once all of them have set theirs."""
        keys = [f"{self.prefix}/{tag}/{r}" for r in range(self.world)]
        t0 = time.monotonic()
        try:
            self.store.set(keys[self.me], value)
            self.store.wait(keys, self.timeout)
        except RuntimeError as e:  # DistStoreError on a timeout, DistNetworkError when the store is gone
            self._gave_up(keys, time.monotonic() - t0, e)
        values = self.store.multi_get(keys)
        gave_up = f"{self.prefix}/gave_up"
        if self.store.check([gave_up]):
            late = int(self.store.get(gave_up))
            raise RuntimeError(
                f"fsdp_compile: rank {self._global(self.me)} reached the ranks' agreement on {self.what} after rank "
                f"{late} had stopped waiting for it (the process group's timeout, {self.timeout.total_seconds():g} s): "
                f"the ranks diverged; {_FIX}"
            )
        return values

    def _gave_up(self, keys: list[str], waited: float, error: Exception) -> None:
        me = self._global(self.me)
        try:
            missing = [self._global(r) for r, k in enumerate(keys) if not self.store.check([k])]
            self.store.set(f"{self.prefix}/gave_up", str(me))  # a rank that comes later raises too
        except RuntimeError:  # the store itself is gone (its host rank stopped)
            missing = [self._global(r) for r in range(self.world) if r != self.me]
        raise RuntimeError(
            f"fsdp_compile: rank {me} waited {waited:.0f} s (the process group's timeout) for rank(s) {missing} to "
            f"agree on {self.what}, and they never reached fsdp_compile.compile or the compiled model's first call: "
            f"they are running something else (the eager model, another collective) or have stopped; {_FIX} "
            f"(the store: {quoted(error, 200)})"
        ) from None

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)


def check_same(what: str, items: list[tuple[str, object]], group, fix: str) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all of them hold equal ``items``.

    ``items``: ``(label, JSON-serializable value)`` pairs, compared in order; the error names ``what``,
    the two ranks (global ranks), the first label whose values differ, both values and ``fix``. A rank
    whose peers do not come within the group's timeout raises ``RuntimeError`` saying so.
    """
    payload = json.dumps(items, sort_keys=True, default=str).encode()
    agreement = _Round(group, what)
    digests = agreement.exchange("digest", hashlib.sha256(payload).digest())
    if len(set(digests)) == 1:
        return
    payloads = agreement.exchange("payload", payload)
    me = agreement.me
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


def agree_max(value: int, groups, what: str = "the tokens per step") -> int:
    """The maximum of ``value`` over the ranks of every process group in ``groups`` (one after the other,
    so over a 2-D mesh given its row and column groups, the maximum over the mesh)."""
    for group in groups:
        if group.size() > 1:
            value = max(int(v) for v in _Round(group, what).exchange("value", str(value).encode()))
    return value


def check_ranks_agree(plan, config_items: list[tuple[str, object]] = ()) -> None:
    """Compare ``plan.fingerprint()`` (``plan``: a ``ShardingPlan``) and the config across the ranks of every
    process group the plan's collectives use, once, before the first trace (moved here from ``plan``, which
    re-exports it).

    Ranks that shard different models, or compile with different settings, would issue different
    collectives inside the compiled graphs and block until the process group's timeout, or exchange the
    wrong bytes; this turns that into an error on every rank that names the first difference. It
    compares within each FSDP process group, not the whole world: ranks outside it (another pipeline
    stage, say) may hold another model. Over the process group's store, never a collective (``check_same``):
    a rank that compiles alone raises, within the group's timeout, instead of pairing with its peers'
    eager collectives. Skipped on the fake process group (no peers).
    """
    groups = plan.process_groups()
    if not groups:
        return
    items = [(f"FSDP group {entry['fqn'] or '<root>'!r}", entry) for entry in plan.fingerprint()]
    items.insert(0, ("the number of FSDP groups", len(items)))
    for group in groups:
        if group.size() > 1:
            check_same(
                "the fsdp_compile.CompileConfig", list(config_items), group,
                "every rank must pass the same settings to fsdp_compile.compile",
            )
            check_same(
                "the sharded model", items, group,
                "every rank must build the same model and call fully_shard the same way before fsdp_compile.compile",
            )
