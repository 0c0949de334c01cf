"""Shared fixtures for the ``tests/test_passes_*.py`` files (no tests here; pytest does not collect it).

* ``captured(world_size)``: the forward and backward graphs of a 4-layer Llama on the fake process group,
  captured once per world size per session;
* ``EmulatedRanks``: an ``fx.Interpreter`` that runs a graph on real tensors with all-gather and
  reduce-scatter emulated over ``W`` virtual ranks, rank ``r`` holding ``(1 + r / W) * x``. Collectives on
  the fake process group return garbage, so this is how a bucketed graph's numbers are compared with the
  original's at any world size: a wrong layout (rows vs columns, offsets) changes the outputs;
* ``PROFILE``: the hand-checkable cost-model profile of the simulator and reordering tests (1 TFLOP/s,
  free memory traffic and launches, a 0.5 GB/s link with 1 ms per ring step);
* ``copy_gm``, ``random_inputs``, ``same_outputs``.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.fx as fx

from fsdp_compile.passes.cost_model import HardwareProfile, LinkProfile

_c10d = torch.ops._c10d_functional
PROFILE = HardwareProfile(
    name="hand",
    device_type="cpu",
    matmul_flops_fp32=1e12,
    matmul_flops_lowp=1e12,
    mem_bw=math.inf,
    op_overhead=0.0,
    intra=LinkProfile(bus_bw=0.5e9, step_latency=1e-3, base_latency=0.0),
    ranks_per_node=8,
)


@functools.lru_cache(maxsize=None)
def captured(world_size: int, n_layers: int = 4):
    """``(forward GraphModule, backward GraphModule, ShardingPlan)`` of ``Llama(n_layers)`` at ``world_size``."""
    import fsdp_compile
    from dist_helpers import fake_process_group
    from models import Llama, LlamaArgs, shard

    with fake_process_group(world_size):
        torch.manual_seed(0)
        m = Llama(LlamaArgs(n_layers=n_layers))
        shard(m, m.layers)
        # the graphs as captured: the passes under test run on them (the defaults would bucket and reorder)
        cm = fsdp_compile.compile(m, backend="aot_eager", bucket="fsdp_group", reorder=False)
        cm(torch.randint(0, 256, (2, 16))).sum().backward()
        return cm.captured.forward[0], cm.captured.backward[0], cm.plan


def copy_gm(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy sharing the original's metadata objects (node names are kept)."""
    g = fx.Graph()
    out = g.graph_copy(gm.graph, {})
    g.output(out)
    return fx.GraphModule(gm, g)


def nodes_by_name(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


class EmulatedRanks(fx.Interpreter):
    """Run on real tensors; rank ``r`` of ``W`` holds ``(1 + r / W) * x`` of this rank's ``x``."""

    def call_function(self, target, args, kwargs):
        if target is _c10d.all_gather_into_tensor.default:
            x, w, _ = args
            return torch.cat([x * (1 + r / w) for r in range(w)])
        if target is _c10d.reduce_scatter_tensor.default:
            x, op, w, _ = args
            chunk = x.view(w, -1)[0]  # rank 0's chunk of every rank's input
            out = sum(chunk * (1 + r / w) for r in range(w))
            return out / w if op == "avg" else out
        if target is _c10d.wait_tensor.default:
            return args[0]
        return super().call_function(target, args, kwargs)


def random_inputs(gm: fx.GraphModule, seed: int = 0) -> list:
    """Small positive floats (no overflow through the backward), 0/1 integers, None for opaque objects."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in gm.graph.find_nodes(op="placeholder"):
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
            out.append(torch.rand(v.shape, generator=gen).to(v.dtype) * 0.1)
        elif isinstance(v, torch.Tensor):
            out.append(torch.randint(0, 2, v.shape, generator=gen).to(v.dtype))
        else:
            out.append(None)
    return out


def same_outputs(a, b) -> bool:
    """Bitwise equal tensors (and equal non-tensors), NaN never expected."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            assert torch.isfinite(x).all() if x.is_floating_point() else True
            if not (isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)):
                return False
    return True
