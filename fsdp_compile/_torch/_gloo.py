"""Gloo process groups with one worker thread, and the warning for groups with more.

torch's ``ProcessGroupGloo`` (2.13, and upstream's source as read on 2026-11-25) runs collectives on
``threads`` worker threads (2 for groups made by ``init_process_group`` and ``new_group``). After each
collective, the worker thread writes the group's status, ``pgStatus_->lastCompletedWorkName`` (a
``std::string``), outside the group's lock (``ProcessGroupGloo::runLoop``). When two collectives of one
group finish at the same moment, both threads assign the string and both free its old buffer: a double free,
which glibc reports later as ``malloc(): unaligned tcache chunk detected`` (SIGABRT) or a crash elsewhere.
AddressSanitizer names it: "attempting double-free ... in thread T4 ... freed by thread T3 ... in
c10d::ProcessGroupGloo::runLoop". A compiled step keeps collectives in flight together (an all-gather
prefetched while a reduce-scatter runs), and its all-gathers (functional collectives) run on gloo as
``allgather_into_tensor_coalesced``, whose op name ``ALLGATHER_COALESCED`` is too long for the string's
inline buffer: a move-assignment from a heap string frees the old buffer, so two such names finishing
together free it twice (the 20-byte region ASan reports). Eager FSDP2's all-gathers run as
``_allgather_base``, whose name fits inline, so eager meets the race far less often. With one worker thread,
only that thread writes the status, so the race cannot happen.

Found (2026-11-25) by running the multirank tests under AddressSanitizer, preloaded into the
uninstrumented torch (libstdc++ too, or ASan's ``__cxa_throw`` interceptor aborts on the first caught C++
exception); it runs at about full speed, and with one-thread groups the same run is clean::

    LD_PRELOAD="/usr/lib/x86_64-linux-gnu/libasan.so.8 /usr/lib/x86_64-linux-gnu/libstdc++.so.6" \
    ASAN_OPTIONS=detect_leaks=0:halt_on_error=1:log_path=/tmp/asan/log python3 -m pytest -m multirank tests

``single_thread_gloo()`` makes the gloo groups created after it (``init_process_group``, ``new_group``,
``DeviceMesh``) use one worker thread. Collectives of one group then run one after another (those of
different groups still run at once). On the development machine (2 cores, 2 ranks) the step benchmarks
stayed within their noise and the multirank tests got faster. NCCL is not affected.

Versions, and when it can go (no upstream issue or PR is cited; the race was found here): the race caught on
2.13.0 under AddressSanitizer, and read in ``runLoop`` of 2.13.0 and of upstream's source (2026-11-25). The
one-thread groups run under every multi-rank test on 2.13.0 (``tests/test_gloo_multirank.py`` checks one
worker thread and the warning) and under the demo on 2.14.1 (CI part 4), where the race was not re-run
under ASan. ``single_thread_gloo`` and ``warn_if_racy_gloo`` go when every supported torch writes the group's
status under its lock; ``single_thread_gloo`` is public (``fsdp_compile.__all__``, the examples call it), so
it stays a no-op for a release first. ``gloo_threads`` and ``measure_collective_scratch`` measure gloo
rather than work around it (the cost model's ``cpu-gloo`` profile cites them): they move, not go.
"""

from __future__ import annotations

import datetime
import functools
import os
import warnings

import torch
import torch.distributed as dist

_installed = False


def _one_thread_class(real: type) -> type:
    """A ``ProcessGroupGloo`` that, built as torch builds a group (store, rank, size, timeout, and on 2.14
    ``enable_reconfigure``), gets the default devices (``GLOO_SOCKET_IFNAME``'s interfaces, else the
    host's) and one worker thread; built with options, it takes them as they are."""

    class OneThreadGloo(real):
        def __init__(self, store, rank, size, timeout=datetime.timedelta(minutes=30), **kwargs):
            if isinstance(timeout, real._Options):
                super().__init__(store, rank, size, timeout)
                return
            opts = real._Options()
            opts._timeout = timeout
            for name, value in kwargs.items():  # what newer torch passes, as an option of the same name
                if not hasattr(opts, name):
                    raise TypeError(
                        f"torch {torch.__version__} builds a gloo group with {name}={value!r}, which "
                        "fsdp_compile.single_thread_gloo cannot pass on; create the group without it"
                    )
                setattr(opts, name, value)
            ifnames = os.environ.get("GLOO_SOCKET_IFNAME", "")
            if len(ifnames) > 1:  # as torch's own constructor reads it
                opts._devices = [real.create_device(interface=i) for i in ifnames.split(",")]
            else:
                opts._devices = [real.create_default_device()]
            opts._threads = 1
            super().__init__(store, rank, size, opts)

    OneThreadGloo.__qualname__ = OneThreadGloo.__name__ = "ProcessGroupGloo"
    return OneThreadGloo


def single_thread_gloo() -> None:
    """Gloo process groups created after this call run their collectives on one worker thread instead
    of torch's two, which share a status string without a lock and can corrupt the heap when two
    collectives finish at once (this module's docstring). Call it before ``init_process_group``, on
    every rank; calling it again does nothing. The groups are torch's own ``ProcessGroupGloo``."""
    global _installed
    if _installed:
        return
    from torch.distributed import distributed_c10d as c10d

    real = c10d.ProcessGroupGloo
    one_thread = _one_thread_class(real)
    helper = c10d._new_process_group_helper

    @functools.wraps(helper)
    def new_process_group_helper(*args, **kwargs):
        # the one place torch builds a gloo group by name; the name is swapped only while it runs, so
        # ``isinstance(backend, ProcessGroupGloo)`` elsewhere still sees torch's class
        c10d.ProcessGroupGloo = one_thread
        try:
            return helper(*args, **kwargs)
        finally:
            c10d.ProcessGroupGloo = real

    c10d._new_process_group_helper = new_process_group_helper
    _installed = True


def gloo_threads(group) -> int | None:
    """The worker threads of ``group``'s gloo backend, or None when it has none (another backend)."""
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:
        return None
    if not isinstance(backend, dist.ProcessGroupGloo):
        return None
    return backend.options._threads


def warn_if_racy_gloo(groups) -> None:
    """Warn when a process group the compiled step uses is gloo with more than one worker thread, naming
    the fix (Python's warning filters show it once per group list)."""
    racy = [g.group_name for g in groups if (gloo_threads(g) or 0) > 1 and g.size() > 1]
    if racy:
        warnings.warn(
            f"fsdp_compile: gloo process group(s) {sorted(set(racy))} run collectives on more than one worker "
            "thread; torch's ProcessGroupGloo then writes its status from those threads without a lock, and two "
            "collectives finishing at once can corrupt the heap (SIGABRT, 'malloc(): unaligned tcache chunk "
            "detected'). Call fsdp_compile.single_thread_gloo() before torch.distributed.init_process_group.",
            RuntimeWarning,
            stacklevel=3,
        )


def measure_collective_scratch(group, numel: int = 1 << 18) -> dict[str, dict[str, float]]:
    """What the backend of ``group`` allocates for each functional collective beyond its output, per byte the
    collective moves (the gathered output of an all-gather, the input of the others:
    ``passes.predicates.collective_bytes``): ``{kind: {"peak": ..., "held": ...}}``, ``peak`` the most
    between issue and wait, ``held`` what is still allocated once the collective has finished and until its
    wait (``HardwareProfile.collective_scratch`` states ``held``). Read from the profiler's allocation events,
    which include the worker thread's; every rank of ``group`` calls it.

    torch 2.13's gloo: a reduce-scatter copies its input at issue and all-reduces the copy, freed at the wait
    (peak 1.0, held 1.0); an all-gather gathers into a flat buffer of its output's size on the worker thread
    and copies out, freed as it finishes (peak 1.0, held 0); all-reduce and all-to-all allocate nothing."""
    import time

    from torch.profiler import ProfilerActivity, profile

    ops, name, W = torch.ops._c10d_functional, group.group_name, group.size()
    x, flag = torch.ones(numel), torch.zeros(1)
    runs = {
        "all_gather": lambda: ops.all_gather_into_tensor(x, W, name),
        "reduce_scatter": lambda: ops.reduce_scatter_tensor(x, "sum", W, name),
        "all_reduce": lambda: ops.all_reduce(x, "sum", name),
        "all_to_all": lambda: ops.all_to_all_single(x, [numel // W] * W, [numel // W] * W, name),
    }
    moved = {"all_gather": x.nbytes * W}
    out = {}
    for kind, issue in runs.items():
        ops.wait_tensor(issue())  # warm-up: the first call sets up the group's buffers
        dist.barrier(group)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            pending = issue()
            # the collective has finished: on a one-thread group this in-place all-reduce (which allocates
            # nothing) runs after it; with more threads, the sleep is ample for 1 MiB over 127.0.0.1
            dist.all_reduce(flag, group=group)
            if gloo_threads(group) != 1:
                time.sleep(0.2)
            torch.ones(1)  # a 4-byte marker: what is live here was held past the collective's end
            result = ops.wait_tensor(pending)
        events = sorted(
            (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() != 0),
            key=lambda e: e.start_ns(),
        )
        live = peak = 0
        held = None
        for e in events:
            if e.nbytes() == 4 and held is None:
                held = live
            live += e.nbytes()
            peak = max(peak, live)
        size = moved.get(kind, x.nbytes)
        out[kind] = {"peak": round((peak - result.nbytes) / size, 2), "held": round((held - result.nbytes) / size, 2)}
        del pending, result
    return out
