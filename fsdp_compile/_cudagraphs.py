"""CUDA graphs over the compiled step (``CompileConfig(cudagraphs=True)``): the gate that decides per graph,
the replay watchdog, and the teardown.

The step's forward and backward graphs are handed to torch's CUDA graph trees (``torch._inductor.
cudagraph_trees``: one memory pool per device, static inputs read in place, other inputs copied into the
graph's buffers, a re-recording when a static input moves), under Inductor through its own
``triton.cudagraphs`` and under ``aot_eager`` as torch's ``cudagraphs`` Dynamo backend does. What is ours:

* **the decision**, per graph, from ``passes/cudagraphs.py`` (and torch's own where Inductor declines one):
  recorded in ``CapturedGraphs.cudagraphs``, shown by ``explain``, warned about; a backward whose forward is
  not captured is not captured either;
* **static inputs**: every parameter's local shard is marked (``_extensions.LocalShards``), so the graphs
  read the shards the optimizer updates in place instead of copying them in at every replay;
* **memory the user keeps**: a replay overwrites the outputs of the previous one, so the step's outputs
  and every gradient are copied out of the pool (``_extensions.LocalShards``, ``CompiledFSDPModule``):
  a loss kept from an earlier step, a gradient accumulated over steps stay what eager gives;
* **timeouts**: NCCL's watchdog does not see collectives replayed from a graph. ``Watchdog`` records an
  event after each replayed step and aborts the step's process groups if the event has not completed
  within their timeout, so a rank that lost a peer fails (the next wait raises) instead of hanging;
* **teardown**: ``release()`` frees the graphs and their pool; ``CompiledFSDPModule.close()`` calls it,
  and must run before ``destroy_process_group``, while the communicators the graphs captured still exist.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable

import torch

from fsdp_compile.passes.cudagraphs import capture_blockers

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Decision:
    """Whether one compiled graph replays as a CUDA graph, and if not, why."""

    kind: str  # "forward" | "backward" | "inference"
    index: int  # its position among the step's graphs of that kind
    captured: bool
    reason: str | None = None
    copied: list[str] = dataclasses.field(default_factory=list)  # inputs copied into the graph at each replay

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class Gate:
    """One compiled step's CUDA graph decisions (a backend's: its forward and backward graphs, per recompile)."""

    def __init__(self, device: torch.device, decisions: list[Decision], warn: bool = True):
        self.device, self.decisions, self.warn = device, decisions, warn  # explain records without warning
        self._forward_captured: bool | None = None  # the last forward graph's decision, for its backward
        self._copied: list[str] = []  # the last decided graph's inputs that are not static

    def decide(self, kind: str, gm: torch.fx.GraphModule, static_inputs) -> list[str]:
        """Why ``gm`` (the step's ``kind`` graph) must run uncaptured; empty: capture it."""
        reasons = capture_blockers(gm, self.device, static_inputs)
        if kind == "backward" and self._forward_captured is False:
            reasons = ["its forward graph runs uncaptured (its saved tensors are not in the graphs' pool)", *reasons]
        static = set(static_inputs)
        self._copied = [f"{p.name} {_described(p.meta.get('val'))}"
                        for i, p in enumerate(gm.graph.find_nodes(op="placeholder"))
                        if i not in static and isinstance(p.meta.get("val"), torch.Tensor)]
        return reasons

    def record(self, kind: str, reasons: list[str]) -> Decision:
        index = sum(d.kind == kind for d in self.decisions)
        decision = Decision(kind, index, not reasons, "; ".join(reasons) or None, self._copied if not reasons else [])
        self.decisions.append(decision)
        if kind != "backward":
            self._forward_captured = decision.captured
        if reasons and self.warn:
            warnings.warn(f"fsdp_compile: the {kind} graph {index} runs without CUDA graphs: {decision.reason}",
                          stacklevel=2)
        return decision


def _described(val) -> str:
    return f"{str(val.dtype).removeprefix('torch.')}{list(val.shape)}"


def forward_static_inputs() -> list[int]:
    """The forward graph's inputs whose memory is fixed (parameters' shards, buffers), as AOTAutograd
    recorded them from Dynamo's ``_dynamo_static_input_type`` marks."""
    context = torch._guards.TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None) if context is not None else None
    return list(meta.static_input_indices) if meta is not None else []


def backward_static_inputs(gm: torch.fx.GraphModule) -> list[int]:
    """The backward graph's saved tensors (its leading inputs): outputs of the captured forward, in the pool."""
    from torch._inductor.utils import count_tangents

    return list(range(count_tangents(gm)))


def aot_eager_compiler(kind: str, gm: torch.fx.GraphModule, inputs: list, gate: Gate, device_index: list):
    """What ``aot_eager`` runs for one graph with ``cudagraphs=True``: the graph itself, recorded and replayed
    by torch's CUDA graph trees where ``gate`` allows it (torch's ``cudagraphs`` Dynamo backend, with our
    decision and static inputs)."""
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor.cudagraph_trees import cudagraphify_impl, get_manager
    from torch._inductor.cudagraph_utils import get_placeholder_info

    from torch._dynamo.backends.cudagraphs import find_input_mutations, get_stack_traces

    interp = boxed_nop(gm, inputs)
    backward = kind == "backward"
    static = backward_static_inputs(gm) if backward else forward_static_inputs()
    reasons = gate.decide(kind, gm, static)
    gate.record(kind, reasons)
    if reasons and not backward:
        device_index[0] = None  # this forward runs outside the trees: its backward must not tell them it runs
    if reasons:
        if backward and device_index[0] is not None:  # the forward was captured: tell its tree we run the backward
            manager = get_manager(device_index[0], create_if_none_exists=False)

            def run_backward(args):
                manager.set_to_running_backward()
                return interp(args)

            run_backward._boxed_call = True
            return run_backward
        return interp
    index = gate.device.index if gate.device.index is not None else torch.cuda.current_device()
    if not backward:
        device_index[0] = index
    out = cudagraphify_impl(
        interp, inputs, static, device_index=index, is_backward=backward, is_inference=kind == "inference",
        stack_traces=get_stack_traces(gm), placeholders=get_placeholder_info(gm.graph),
        mutated_input_idxs=find_input_mutations(gm.graph),
    )
    out._boxed_call = True
    return out


def mark_static(tensors) -> None:
    """``torch._dynamo.mark_static_address(t, guard=False)`` for each: the graphs read them where they are
    (a module's buffers, a parameter's shard); a tensor that moves makes the trees record the graph anew."""
    for t in tensors:
        t._dynamo_static_input_type = "unguarded"


def copy_out(tree):
    """The step's outputs, each tensor copied out of the graphs' pool (a later replay overwrites the pool)."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.clone(), tree)


def release() -> None:
    """Free every CUDA graph and the pool of torch's graph trees (all compiled models' in this process)."""
    from torch._inductor import cudagraph_trees

    cudagraph_trees.reset_cudagraph_trees()


# --- the replay watchdog -----------------------------------------------------------------------------------


def group_timeout(group) -> datetime.timedelta:
    """The timeout a process group's collectives run under (NCCL's option; the default otherwise)."""
    from torch.distributed import distributed_c10d as c10d

    try:
        backend = group._get_backend(torch.device("cuda"))
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
            return timeout
    except (RuntimeError, AttributeError, ValueError):
        pass
    return c10d.default_pg_timeout


def abort_groups(groups) -> None:
    """Abort the communicators of ``groups``: kernels waiting on a lost peer return, later waits raise."""
    from torch.distributed import distributed_c10d as c10d

    for group in groups:
        try:
            c10d._abort_process_group(group)
        except Exception as e:  # noqa: BLE001 - one group's failure must not stop the others' abort
            log.error("fsdp_compile: aborting process group %s failed: %s", getattr(group, "group_name", group), e)


class Watchdog:
    """Each replayed step's completion, checked against a deadline on a thread of its own.

    ``arm(event, label)`` after a step's last replay: if ``event`` has not completed ``timeout`` seconds
    later, ``on_timeout(label)`` runs once (by default: log, and abort the step's process groups) and every
    later ``check()`` raises. ``event`` is anything with ``query() -> bool`` (a ``torch.cuda.Event``), so the
    logic is tested without a GPU."""

    def __init__(self, timeout: float, on_timeout: Callable[[str], None], poll: float = 0.05):
        self.timeout, self.on_timeout, self.poll = timeout, on_timeout, poll
        self._pending: deque = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self.fired: str | None = None
        self._thread = threading.Thread(target=self._run, name="fsdp_compile-cudagraph-watchdog", daemon=True)
        self._thread.start()

    def arm(self, event, label: str) -> None:
        self.check()
        with self._lock:
            self._pending.append((event, time.monotonic() + self.timeout, label))
        self._wake.set()

    def check(self) -> None:
        if self.fired is not None:
            raise RuntimeError(
                f"fsdp_compile: {self.fired} did not finish within the process group's timeout of {self.timeout:.0f} s, "
                "so its process groups were aborted: a rank most likely stopped or diverged (every rank must call "
                "the compiled model for every step); the first rank to fail says why"
            )

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stopped:
            with self._lock:
                head = self._pending[0] if self._pending else None
            if head is None:
                self._wake.wait()
                self._wake.clear()
                continue
            event, deadline, label = head
            if event.query():
                with self._lock:
                    self._pending.popleft()
                continue
            if time.monotonic() > deadline:
                self.fired = label
                with self._lock:
                    self._pending.clear()
                try:
                    self.on_timeout(label)
                except Exception as e:  # noqa: BLE001 - logged; check() still raises on the caller's thread
                    log.error("fsdp_compile: the CUDA graph watchdog's timeout action failed: %s", e)
                continue
            time.sleep(self.poll)
