"""``CPUOffloadPolicy`` on an accelerator without one: where the host-device copies sit in the captured
graphs (the fake process group). The accelerator's graphs are built with ``cpu`` as the device
(``parity.host_copies``), so each copy is a ``_to_copy`` node to see; on a real CPU device there are none, as
FSDP2's copies are no-ops there. Bitwise training with these graphs: ``test_parity_multirank``'s
``offload+host_copies`` case; on a GPU: ``test_cuda.py::test_cpu_offload_bitwise``."""

import contextlib

import pytest
import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

import fsdp_compile as fc
from dist_helpers import fake_process_group
from fsdp_compile._explain import explain_with_graphs
from models import Llama, LlamaArgs, shard
from parity import device_copies, host_copies

COPY = torch.ops.aten._to_copy.default
FSDP_OPS = torch.ops.fsdp_compile


def captured(copies: bool, pinned: bool = False):
    """Forward and backward graphs of a 2-layer Llama offloaded to the host, bf16 compute, on 4 fake ranks.
    ``pinned``: the graphs of ``CPUOffloadPolicy(pin_memory=True)``, which a machine without an accelerator
    cannot shard with (pinning needs one): the policy says ``pin_memory=True`` only after ``fully_shard``."""
    with fake_process_group(4), host_copies() if copies else contextlib.nullcontext():
        torch.manual_seed(0)
        m = Llama(LlamaArgs(n_layers=2))
        policy = CPUOffloadPolicy(pin_memory=False)
        shard(m, m.layers, offload_policy=policy, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        policy.pin_memory = pinned
        x = torch.randint(0, 256, (2, 16))
        _, graphs = explain_with_graphs(m, (x,), {}, fc.CompileConfig(backend="aot_eager"))
    return graphs.forward[0], graphs.backward[0], sum(1 for _ in m.parameters())


def _calls(gm, target):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def _to_device(gm):
    """Every host-to-device copy: each a sharded parameter (a placeholder), copied for its copy-in alone."""
    out = []
    for copy_in in _calls(gm, FSDP_OPS.all_gather_copy_in.default):
        for n in copy_in.args[0]:
            assert n.target is COPY and n.kwargs.get("non_blocking") is True, n.format_node()
            assert n.args[0].op == "placeholder" and list(n.users) == [copy_in], n.format_node()
            out.append(n)
    return out


@pytest.fixture(scope="module")
def graphs():
    return captured(copies=True)


def test_host_shards_are_copied_to_the_device_right_before_each_copy_in(graphs):
    forward, backward, n_params = graphs
    # the forward gathers every parameter once; the backward re-gathers the blocks (reshard_after_forward),
    # not the root (fully_shard keeps it unsharded), copying their shards again as FSDP2 does
    assert len(_to_device(forward)) == n_params
    assert 0 < len(_to_device(backward)) < n_params
    # nothing else is copied between devices in the forward
    assert len(device_copies(forward)) == n_params


@pytest.mark.parametrize("pinned", [False, True], ids=["pageable", "pinned"])
def test_gradients_are_copied_to_the_host_right_after_each_reduce_scatter(graphs, pinned):
    """Blocking, as FSDP2 copies them into pageable memory; with ``pin_memory=True`` non-blocking, as FSDP2
    copies them into pinned memory (``LocalShards``' backward waits for them: ``test_cuda.py``'s pinned cases)."""
    _, backward, n_params = captured(copies=True, pinned=True) if pinned else graphs
    expected = {"device": torch.device("cpu"), **({"non_blocking": True} if pinned else {})}
    outputs = set(backward.graph.output_node().args[0])
    to_host = []
    for copy_out in _calls(backward, FSDP_OPS.reduce_scatter_copy_out.default):
        for item in copy_out.users:  # each shard gradient, in the parameter's dtype, then its copy
            (copy,) = item.users
            assert copy.target is COPY and copy.kwargs == expected, copy.format_node()
            assert copy in outputs and list(copy.users) == [backward.graph.output_node()]
            to_host.append(copy)
    assert len(to_host) == n_params
    assert len(device_copies(backward)) == n_params + len(_to_device(backward))


def test_a_cpu_device_gets_no_copies():
    """Offload on a CPU device, as before: FSDP2's copies are no-ops there, and the graphs have none."""
    forward, backward, _ = captured(copies=False)
    assert not device_copies(forward) and not device_copies(backward)
