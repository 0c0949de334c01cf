"""``CompileConfig(cudagraphs=True)`` without a GPU: which graphs the gate lets torch's CUDA graph trees
capture, and why not, on graphs captured from real models (the fake process group); the static inputs; the
copies out of the graphs' pool; the replay watchdog with stand-in events. The replays themselves are
``tests/test_cuda.py``'s (``bench/gpu.sh``)."""

import functools
import threading
import time

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

import fsdp_compile as fc
from dist_helpers import fake_process_group
from fsdp_compile import _cudagraphs
from fsdp_compile.passes.cudagraphs import capture_blockers
from models import Llama, LlamaArgs, Patterns, shard

CG = dict(backend="aot_eager", cudagraphs=True)


def llama(n_layers=2):
    torch.manual_seed(0)
    m = Llama(LlamaArgs(n_layers=n_layers))
    return shard(m, m.layers)


def tokens(seq=16):
    return torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_llama_step_is_captured_with_its_shards_static(backend):
    """Forward and backward both captured; the only input copied into the forward at each replay is the
    batch (every shard and buffer is read in place), into the backward only the loss's gradient."""
    with fake_process_group(8):
        report = fc.explain(llama(), tokens(), config=fc.CompileConfig(backend=backend, cudagraphs=True))
    assert [(d["kind"], d["captured"]) for d in report.cudagraphs] == [("forward", True), ("backward", True)]
    fw, bw = report.cudagraphs
    assert fw["copied"] == ["primals_22 int64[2, 16]"], fw
    assert [c.split()[0] for c in bw["copied"]] == ["tangents_1"], bw
    assert "CUDA graph, backward graph 0: captured" in report.to_markdown()


@pytest.mark.slow
def test_dynamic_shapes_run_uncaptured_and_say_why():
    """A symbolic sequence length: the forward runs uncaptured, and so its backward (its saved tensors are
    not in the pool), each with the reason."""
    x = tokens(24)
    torch._dynamo.mark_dynamic(x, 1)
    with fake_process_group(4):
        report = fc.explain(llama(), x, config=fc.CompileConfig(**CG))
    fw, bw = report.cudagraphs
    assert not fw["captured"] and "dynamic shapes" in fw["reason"], fw
    assert not bw["captured"] and bw["reason"].startswith("its forward graph runs uncaptured"), bw


@pytest.mark.slow
def test_buffers_mutated_in_place_are_static_so_captured():
    """DeepSeek-V3's bookkeeping (a tokens-per-expert buffer ``add_``-ed under no_grad): the buffer is a
    static input, which torch's trees let the graph mutate in place."""
    with fake_process_group(2):
        torch.manual_seed(0)
        m = Patterns("moe")
        shard(m, m.layers)
        report = fc.explain(m, tokens(), config=fc.CompileConfig(**CG))
    assert all(d["captured"] for d in report.cudagraphs), report.cudagraphs


# --- the pass, on graphs captured from a real step and on hand-built ones -----------------------------


@functools.cache
def _captured_forward():
    with fake_process_group(8):
        compiled = fc.compile(llama(), backend="aot_eager")
        compiled(tokens()).sum().backward()
    return compiled.captured.forward[0]


def test_a_step_captured_on_one_device_is_refused_on_another():
    """What a CPU tensor in a CUDA step looks like to the gate (a host copy, CPU offload's placement)."""
    gm = _captured_forward()
    assert capture_blockers(gm, torch.device("cpu"), range(100)) == []
    (reason,) = capture_blockers(gm, torch.device("cuda", 0), range(100))
    assert reason.startswith("tensors off cuda:0: cpu (") and "cannot be replayed" in reason


def _fake_graph(fn, *args):
    """``fn`` traced on fake tensors of static shapes, with a shape environment for data-dependent sizes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        fakes = [mode.from_tensor(a, static_shapes=True) for a in args]
        return make_fx(fn)(*fakes)


def test_data_dependent_sizes_are_refused():
    """Expert parallelism's split sizes come from ``.tolist()``; ``nonzero`` is the same kind of size."""
    gm = _fake_graph(lambda x: torch.nonzero(x) * 2, torch.randn(8))
    (reason,) = capture_blockers(gm, torch.device("cpu"))
    assert reason.startswith("data-dependent sizes at nonzero = nonzero.default"), reason


def test_inputs_mutated_in_place_must_be_static():
    def f(buf, x):
        buf.add_(1)
        return x * 2

    gm = _fake_graph(f, torch.zeros(4), torch.randn(4))
    assert capture_blockers(gm, torch.device("cpu"), static_inputs=[0]) == []
    (reason,) = capture_blockers(gm, torch.device("cpu"), static_inputs=[])
    assert reason.startswith("inputs mutated in place that are copied into the graph at each replay (buf_1")


def test_ops_torch_cannot_capture_are_refused():
    """Activation checkpointing that preserves RNG state (dropout) runs its recompute under these ops."""
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.ops.higher_order.run_and_save_rng_state, (torch.ops.aten.rand.default, [4])))
    (reason,) = capture_blockers(fx.GraphModule(nn.Module(), g), torch.device("cpu"))
    assert reason == "an op torch cannot capture: run_and_save_rng_state = run_and_save_rng_state", reason
    del x


# --- what the user keeps is out of the pool ---------------------------------------------------------


def test_local_shards_are_static_and_their_gradients_copied():
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    from fsdp_compile._extensions import LocalShards

    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        p = nn.Parameter(DTensor.from_local(torch.randn(3, 4), mesh, [Shard(0)], run_check=False))
        for cudagraphs in (False, True):
            (local,) = LocalShards.apply(cudagraphs, p)
            assert getattr(local, "_dynamo_static_input_type", None) == ("unguarded" if cudagraphs else None)
            grad = torch.randn(3, 4)
            (out,) = torch.autograd.grad(local, p, grad)
            shares = out._local_tensor.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr()
            assert shares is not cudagraphs and torch.equal(out._local_tensor, grad)


def test_copy_out_copies_every_tensor():
    a, b = torch.randn(3), torch.randn(2)
    out = _cudagraphs.copy_out({"loss": a, "rest": (b, 3)})
    assert out["rest"][1] == 3 and torch.equal(out["loss"], a) and out["loss"].data_ptr() != a.data_ptr()


# --- the replay watchdog --------------------------------------------------------------------------------


class _Event:
    def __init__(self, done_after: float | None):
        self.at = None if done_after is None else time.monotonic() + done_after

    def query(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


def test_watchdog_lets_finished_replays_pass():
    fired = []
    dog = _cudagraphs.Watchdog(0.5, fired.append, poll=0.01)
    try:
        for _ in range(3):
            dog.arm(_Event(0.05), "step")
        time.sleep(0.8)
        dog.check()
        assert fired == []
    finally:
        dog.stop()


def test_watchdog_aborts_a_hung_replay_once_and_every_later_call_raises():
    fired = []
    done = threading.Event()
    dog = _cudagraphs.Watchdog(0.2, lambda what: (fired.append(what), done.set()), poll=0.01)
    try:
        dog.arm(_Event(None), "the CUDA graphs replayed before this call (call 2)")
        assert done.wait(5)
        time.sleep(0.1)
        assert fired == ["the CUDA graphs replayed before this call (call 2)"]
        with pytest.raises(RuntimeError, match=r"did not finish within the process group's timeout of 0 s, so its process groups were aborted"):
            dog.arm(_Event(0.0), "next")
    finally:
        dog.stop()


def test_a_blocked_graph_runs_as_it_is_under_aot_eager():
    """``aot_eager``'s compiler with cudagraphs=True: a graph the gate refuses (here: CPU tensors in a CUDA
    step) is run as it is, uncaptured, and the decision says why; its backward follows it."""
    gm = _captured_forward()
    decisions = []
    gate = _cudagraphs.Gate(torch.device("cuda", 0), decisions, warn=False)
    inputs = [torch.empty_like(p.meta["val"]) if isinstance(p.meta.get("val"), torch.Tensor) else p.meta.get("val")
              for p in gm.graph.find_nodes(op="placeholder")]
    forward_device = [None]
    fn = _cudagraphs.aot_eager_compiler("forward", gm, inputs, gate, forward_device)
    assert fn(list(inputs)) is not None and forward_device == [None]
    assert not decisions[0].captured and decisions[0].reason.startswith("tensors off cuda:0")
    assert gate.decide("backward", gm, range(100))[0].startswith("its forward graph runs uncaptured")
