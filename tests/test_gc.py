"""Python's collector during our compiles (``fsdp_compile/_gc.py``): the thresholds are raised while a
compile of ours runs (the step's Dynamo compile and its lazy backward compile), restored after, and any
other compile, a collector the user disabled and thresholds the user raised are left alone."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.callback import CallbackArgs, CallbackTrigger

import fsdp_compile
from fsdp_compile import _gc


@pytest.fixture
def thresholds():
    """The process's thresholds and collector state, restored after the test."""
    saved, enabled = gc.get_threshold(), gc.isenabled()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*saved)
    (gc.enable if enabled else gc.disable)()


def _compile(trigger, compile_id, inside: bool):
    """Run the start callback of a compile, inside or outside a call of ours; returns its end."""
    args = CallbackArgs(trigger, compile_id)
    if inside:
        with _gc.ours():
            _gc._on_start(args)
    else:
        _gc._on_start(args)
    return lambda: _gc._on_end(args)


def test_raised_for_our_compiles_and_restored(thresholds):
    end = _compile(CallbackTrigger.DYNAMO, "test-ours/0", inside=True)
    assert gc.get_threshold() == _gc.THRESHOLDS
    end()
    assert gc.get_threshold() == (700, 10, 10)
    # the lazy backward of that compile's graphs runs under the forward's compile id, outside our call
    end = _compile(CallbackTrigger.LAZY_BACKWARD, "test-ours/0", inside=False)
    assert gc.get_threshold() == _gc.THRESHOLDS
    end()
    assert gc.get_threshold() == (700, 10, 10)


def test_other_compiles_left_alone(thresholds):
    for trigger, compile_id in ((CallbackTrigger.DYNAMO, "test-theirs/0"),
                                (CallbackTrigger.LAZY_BACKWARD, "test-theirs/0"),
                                (CallbackTrigger.CUDAGRAPH_RECORDING, "test-theirs/0")):
        end = _compile(trigger, compile_id, inside=False)
        assert gc.get_threshold() == (700, 10, 10), trigger
        end()
    end = _compile(CallbackTrigger.CUDAGRAPH_RECORDING, "test-ours-too/0", inside=True)  # a replay's recording
    assert gc.get_threshold() == (700, 10, 10)
    end()


def test_user_settings_kept(thresholds):
    gc.set_threshold(100_000, 5, 5)  # raised further by the user: kept; the others raised, then restored
    end = _compile(CallbackTrigger.DYNAMO, "test-user/0", inside=True)
    assert gc.get_threshold() == (100_000, _gc.THRESHOLDS[1], _gc.THRESHOLDS[2])
    end()
    assert gc.get_threshold() == (100_000, 5, 5)
    for disable in (gc.disable, lambda: gc.set_threshold(0, 10, 10)):
        gc.enable()
        gc.set_threshold(700, 10, 10)
        disable()
        before = gc.get_threshold(), gc.isenabled()
        end = _compile(CallbackTrigger.DYNAMO, "test-user/1", inside=True)
        assert (gc.get_threshold(), gc.isenabled()) == before
        end()
        assert (gc.get_threshold(), gc.isenabled()) == before


@pytest.fixture
def gloo_world_1():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("reset", [False, True], ids=["", "after-dynamo-reset"])
def test_a_compiled_step_compiles_with_raised_thresholds(gloo_world_1, thresholds, monkeypatch, reset):
    """Our passes run inside the forward's compile and inside the backward's (lazy, at the first backward):
    both see the raised thresholds; the step's call and backward leave the user's in force. Also after
    ``torch._dynamo.reset()``, which clears every compile callback (ours were gone for the rest of the process)."""
    from fsdp_compile import backend

    if reset:
        torch._dynamo.reset()

    seen, run_passes = [], backend.run_passes

    def spy(gm, kind, *args, **kwargs):
        seen.append((kind, gc.get_threshold()))
        return run_passes(gm, kind, *args, **kwargs)

    monkeypatch.setattr(backend, "run_passes", spy)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    for layer in (model[0], model[2], model):
        fsdp_compile.fully_shard(layer)
    compiled = fsdp_compile.compile(model, backend="aot_eager")
    out = compiled(torch.randn(3, 8))
    assert gc.get_threshold() == (700, 10, 10)
    out.sum().backward()
    assert gc.get_threshold() == (700, 10, 10)
    assert seen == [("forward", _gc.THRESHOLDS), ("backward", _gc.THRESHOLDS)]
    compiled(torch.randn(3, 8)).sum().backward()  # no compile: nothing more
    assert len(seen) == 2 and gc.get_threshold() == (700, 10, 10)
