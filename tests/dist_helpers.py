"""Run a test body on N real gloo ranks (127.0.0.1), or on the fake process group in-process.

``run_ranks(fn, world_size, *args)`` spawns one process per rank, initializes gloo through a FileStore
(no port races between concurrent tests), bounds every collective by ``pg_timeout`` and the whole run by
``timeout``, re-raises the first failing rank's traceback in the caller, and never leaves a process
behind. Ranks are forked from a forkserver that has imported torch and fsdp_compile once per test session
(a spawned rank spends about 3 s importing them; a forked one starts in milliseconds); each rank gets the
caller's environment as it is at the call. ``fn`` must be a module-level function (it is pickled by
reference); it gets ``(rank, world_size, *args)`` and its return value, which must be picklable, is
returned per rank.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import os
import queue
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fsdp_compile as fc
from fsdp_compile._torch._dtensor import forget_meshes


class RankFailure(AssertionError):
    pass


# imported once, by the forkserver, before it forks any rank: nothing here may start threads or read
# environment variables that tests change (the ranks get the caller's environment, ``_worker``)
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch._inductor.compile_fx", "fsdp_compile"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts (the first call)
    return ctx


def _worker(rank, world_size, store_path, pg_timeout, fn, args, results, env):
    try:
        os.environ.clear()
        os.environ.update(env)
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
        # a rank killed by a signal (SIGABRT from the allocator, SIGSEGV) prints every thread's Python stack
        # to its stderr, which pytest shows under the failing fixture
        faulthandler.enable(all_threads=True)
        torch.set_num_threads(1)
        fc.single_thread_gloo()  # torch's gloo races between its worker threads (fsdp_compile/_torch/_gloo.py)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        try:
            out = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(fn, world_size: int, *args, timeout: float = 300.0, pg_timeout: float = 120.0, outcomes: bool = False):
    """``fn`` on ``world_size`` spawned gloo ranks; its return values, one per rank. With ``outcomes``, a
    failing or dying rank does not stop the run: each rank's ``("ok", value)``, ``("error", traceback)``
    or ``("died", exitcode)``, once every rank has ended (for tests of faults)."""
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store_path, pg_timeout, fn, args, results, dict(os.environ)),
                        daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        return collect(procs, results, f"{fn.__name__} on {world_size} ranks", timeout, outcomes)


def collect(procs, results, what: str, timeout: float, outcomes: bool = False) -> list:
    """The ranks' ``(rank, status, payload)`` reports from ``results``, once every started process in
    ``procs`` (rank r at index r) has reported, within ``timeout`` seconds: their payloads, one per rank,
    or with ``outcomes`` each rank's ``(status, payload)`` / ``("died", exitcode)``; else the first failing
    or dying rank raises ``RankFailure``. Every process is joined, or killed, before it returns."""
    world_size = len(procs)
    outs: dict[int, object] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(outs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{what} did not finish in {timeout:.0f} s")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in outs]
                if dead and not outcomes:
                    raise RankFailure(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}")
                for i in dead:
                    outs[i] = ("died", procs[i].exitcode)
                continue
            if status == "error" and not outcomes:
                raise RankFailure(f"rank {rank} failed:\n{payload}")
            outs[rank] = (status, payload) if outcomes else payload
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [outs[r] for r in range(world_size)]


@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0):
    """The fake process group: collectives are no-ops, no other process needed (world sizes up to 1024+)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        forget_meshes()  # this group's meshes must not meet the next one's in DTensor's caches


def run_scenarios(scenarios: dict, rank: int, world_size: int) -> dict:
    """Each ``fn(rank, world_size)`` of ``scenarios`` in one group of ranks (one spawn, one torch import per
    rank); a scenario that raises is reported by name, with its traceback, and the others still run."""
    import traceback

    out = {}
    for name, fn in scenarios.items():
        try:
            out[name] = fn(rank, world_size)
        except Exception:  # noqa: BLE001 - reported to the test that owns the scenario
            out[name] = {"error": traceback.format_exc()}
    return out


def scenario(results: list, name: str) -> list[dict]:
    """Every rank's result of scenario ``name`` (``run_scenarios``); a rank where it raised fails the test."""
    per_rank = [r[name] for r in results]
    for r in per_rank:
        assert "error" not in r, r["error"]
    return per_rank
