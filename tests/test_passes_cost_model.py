"""Cost model against hand-computed numbers; FLOPs from shapes; ``hardware="auto"`` without any driver."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from fsdp_compile.passes import cost_model as C
from fsdp_compile.passes import predicates as P
from fsdp_compile.passes.cost_model import CostModel, HardwareProfile, LinkProfile

MiB = 1 << 20


def test_ring_all_gather_h100_nvlink_by_hand():
    cm = CostModel("h100-nvlink")
    # 8 ranks, 64 MiB gathered: 10 us + 7 * 1 us + 64 MiB * 7/8 / 360 GB/s
    expected = 10e-6 + 7 * 1e-6 + 64 * MiB * 7 / 8 / 360e9
    assert cm.collective_time("all_gather", 64 * MiB, 8) == pytest.approx(expected, rel=1e-12)
    assert cm.collective_time("reduce_scatter", 64 * MiB, 8) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(180.1e-6, rel=1e-3)  # 163.1 us of bandwidth + 17 us of latency


def test_multi_node_uses_infiniband():
    nv, ib = CostModel("h100-nvlink"), CostModel("h100-ib")
    # inside one node both profiles agree
    assert ib.collective_time("all_gather", MiB, 8) == nv.collective_time("all_gather", MiB, 8)
    # 1024 ranks over NDR: 10 us + 1023 * 5 us + 1 GiB * 1023/1024 / 45 GB/s
    expected = 10e-6 + 1023 * 5e-6 + (1 << 30) * 1023 / 1024 / 45e9
    assert ib.collective_time("reduce_scatter", 1 << 30, 1024) == pytest.approx(expected, rel=1e-12)


def test_all_reduce_ring_vs_tree():
    cm = CostModel("h100-ib")
    w, b = 1024, 4 * MiB
    ring = 10e-6 + 2 * 1023 * 5e-6 + 2 * b * 1023 / 1024 / 45e9
    tree = 10e-6 + 2 * 10 * 5e-6 + 2 * b / 45e9
    assert cm.collective_time("all_reduce", b, w, "ring") == pytest.approx(ring, rel=1e-12)
    assert cm.collective_time("all_reduce", b, w, "tree") == pytest.approx(tree, rel=1e-12)
    assert cm.collective_time("all_reduce", b, w) == pytest.approx(min(ring, tree))  # tree at this scale
    with pytest.raises(ValueError, match="tree"):
        cm.collective_time("all_gather", b, w, "tree")
    with pytest.raises(ValueError, match="algorithm"):
        cm.collective_time("all_gather", b, w, "butterfly")
    with pytest.raises(ValueError, match="kind"):
        cm.collective_time("gossip", b, w)


def test_one_rank_costs_base_latency_only():
    cm = CostModel("h100-nvlink")
    assert cm.collective_time("all_gather", 64 * MiB, 1) == pytest.approx(10e-6)


def test_profiles_are_frozen_and_documented():
    for name, p in C.PROFILES.items():
        assert p.name == name and p.source
        assert p.matmul_flops_fp32 > 0 and p.mem_bw > 0 and p.intra.bus_bw > 0
        with pytest.raises(Exception):
            p.mem_bw = 1.0  # frozen
    # datasheet numbers times the documented efficiencies
    assert C.H100_NVLINK.matmul_flops_lowp == pytest.approx(989e12 * 0.7)
    assert C.H100_NVLINK.mem_bw == pytest.approx(3.35e12 * 0.85)
    with pytest.raises(ValueError, match="unknown hardware profile 'tpu'"):
        C.get_profile("tpu")


def test_resolve_hardware():
    assert C.resolve_hardware("auto", device_type="cpu", world_size=1024) == "cpu-gloo"
    assert C.resolve_hardware("auto", device_type="cuda", world_size=8) == "h100-nvlink"
    assert C.resolve_hardware("auto", device_type="cuda", world_size=16) == "h100-ib"
    assert C.resolve_hardware("h100-ib", device_type="cpu", world_size=2) == "h100-ib"
    assert C.resolve_hardware(C.H100_IB, device_type="cpu", world_size=2) is C.H100_IB  # a profile of your own
    with pytest.raises(ValueError, match="'a100'"):
        C.resolve_hardware("a100", device_type="cuda", world_size=2)


def _graph(fn, *shapes, dtype=torch.float32):
    return make_fx(fn, tracing_mode="fake")(*[torch.empty(s, dtype=dtype) for s in shapes]).graph


def _node(graph, name):
    return next(n for n in graph.nodes if n.op == "call_function" and name in str(n.target))


@pytest.mark.parametrize(
    "fn, shapes, op, flops",
    [
        (torch.mm, [(32, 48), (48, 80)], "aten.mm", 2 * 32 * 48 * 80),
        (lambda b, x, w: torch.addmm(b, x, w), [(80,), (32, 48), (48, 80)], "aten.addmm", 2 * 32 * 48 * 80 + 32 * 80),
        (torch.bmm, [(4, 32, 48), (4, 48, 80)], "aten.bmm", 2 * 4 * 32 * 48 * 80),
        # output [2, 16, 6, 6] x (3 x 3 x 3) multiply-adds each
        (lambda x, w: F.conv2d(x, w), [(2, 3, 8, 8), (16, 3, 3, 3)], "aten.convolution", 2 * 2 * 16 * 6 * 6 * 27),
        # QK^T and PV: 2 * B*H * Sq * Sk * (D + Dv)
        (lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [(2, 4, 16, 8)] * 3, "scaled_dot_product", 2 * 8 * 16 * 16 * 16),
        (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), [(2, 4, 16, 8)] * 3, "scaled_dot_product", 8 * 16 * 16 * 16),
    ],
)
def test_flops_from_shapes(fn, shapes, op, flops):
    g = _graph(fn, *shapes)
    assert C.node_flops(_node(g, op)) == flops


def test_attention_backward_flops_are_two_and_a_half_forward():
    def f(q, k, v):
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        return torch.autograd.grad(out.sum(), (q, k, v))

    g = _graph(f, *[(2, 4, 16, 8)] * 3)
    fwd = _node(g, "scaled_dot_product_flash_attention_for_cpu.default")
    bwd = _node(g, "scaled_dot_product_flash_attention_for_cpu_backward")
    assert C.node_flops(bwd) == C.node_flops(fwd) * 5 // 2 == 5 * 8 * 16 * 16 * 16


PROFILE = HardwareProfile(
    name="test",
    device_type="cpu",
    matmul_flops_fp32=1e12,
    matmul_flops_lowp=4e12,
    mem_bw=1e9,
    op_overhead=1e-6,
    intra=LinkProfile(bus_bw=1e9, step_latency=1e-6, base_latency=0.0),
    ranks_per_node=8,
)


def test_compute_time_roofline_and_views():
    g = _graph(lambda a, b: (torch.mm(a, b).view(-1) + 1.0).relu(), (256, 512), (512, 1024))
    cm = CostModel(PROFILE)
    mm, view, add = _node(g, "aten.mm"), _node(g, "aten.view"), _node(g, "aten.add")
    # mm: 2*256*512*1024 FLOPs at 1 TFLOP/s = 268.4 us; its bytes (0.5 + 2 + 1 MiB) at 1 GB/s = 3.67 ms: memory bound
    mm_bytes = 4 * (256 * 512 + 512 * 1024 + 256 * 1024)
    assert cm.compute_time(mm) == pytest.approx(max(2 * 256 * 512 * 1024 / 1e12, mm_bytes / 1e9) + 1e-6)
    assert cm.compute_time(view) == 0.0 and P.is_view(view)
    assert cm.compute_time(add) == pytest.approx(2 * 4 * 256 * 1024 / 1e9 + 1e-6)  # read + write
    # with a fast memory the mm is compute bound, at the bf16 rate for bf16 inputs
    fast = CostModel(HardwareProfile(**{**PROFILE.__dict__, "mem_bw": math.inf}))
    assert fast.compute_time(mm) == pytest.approx(2 * 256 * 512 * 1024 / 1e12 + 1e-6)
    g16 = _graph(torch.mm, (256, 512), (512, 1024), dtype=torch.bfloat16)
    assert fast.compute_time(_node(g16, "aten.mm")) == pytest.approx(2 * 256 * 512 * 1024 / 4e12 + 1e-6)


def test_float8_matmuls_at_the_float8_rate():
    """torchao's float8 Linear (not emulated) runs torch._scaled_mm: its FLOPs are a matmul's, priced at the
    profile's float8 rate (H100: the datasheet's dense FP8 at the same efficiency), not as memory traffic."""

    def f(a, b):
        one = torch.ones((), dtype=torch.float32)
        return torch._scaled_mm(a, b.t(), one, one, out_dtype=torch.bfloat16)

    g = _graph(f, (256, 512), (1024, 512), dtype=torch.float8_e4m3fn)
    mm = _node(g, "aten._scaled_mm")
    assert C.node_flops(mm) == 2 * 256 * 512 * 1024
    fast = CostModel(HardwareProfile(**{**PROFILE.__dict__, "mem_bw": math.inf, "matmul_flops_float8": 8e12}))
    assert fast.compute_time(mm) == pytest.approx(2 * 256 * 512 * 1024 / 8e12 + 1e-6)
    assert C.H100_NVLINK.matmul_flops_float8 == pytest.approx(1979e12 * 0.7)
    assert PROFILE.matmul_flops_float8 == PROFILE.matmul_flops_lowp  # not given: as bf16


def test_auto_never_touches_a_gpu_driver(monkeypatch):
    """Inductor's estimator calls into the driver and fails on CPU; ours decides from the graph alone."""

    g = _graph(torch.mm, (8, 8), (8, 8))  # tracing itself asks torch.cuda.is_available()

    def boom(*a, **k):
        raise AssertionError("GPU driver queried")

    for name in ("is_available", "device_count", "get_device_properties", "get_device_capability"):
        monkeypatch.setattr(torch.cuda, name, boom)
    cm = C.cost_model_for("auto", g)
    assert cm.profile.name == "cpu-gloo"
    assert cm.node_time(_node(g, "aten.mm")) > 0


def test_cpu_gloo_profile_is_its_calibration():
    """The cpu-gloo constants are the fits that bench/calibrate_cpu_gloo.py wrote (its all-reduce link and the
    contention share too), and the profile cites them."""
    import json
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "bench" / "results" / "calibrate_cpu_gloo.json"
    constants = json.loads(path.read_text())["constants"]
    p = C.PROFILES["cpu-gloo"]
    assert "bench/results/calibrate_cpu_gloo.json" in p.source
    ours = {
        "matmul_flops_fp32": p.matmul_flops_fp32, "matmul_flops_lowp": p.matmul_flops_lowp, "mem_bw": p.mem_bw,
        "op_overhead": p.op_overhead, "view_overhead": p.view_overhead, "bus_bw": p.intra.bus_bw,
        "step_latency": p.intra.step_latency, "base_latency": p.intra.base_latency,
    }
    for name, value in ours.items():
        assert value == pytest.approx(constants[name], rel=0.01, abs=1e-12), name
    # gloo's all-reduce, fitted apart (``--all-reduce``): the same check on its link
    ar = pathlib.Path(__file__).parents[1] / "bench" / "results" / "calibrate_cpu_gloo_all_reduce.json"
    assert "bench/results/calibrate_cpu_gloo_all_reduce.json" in p.source
    link = dict(p.kind_links)["all_reduce"]
    for name, value in json.loads(ar.read_text())["fit"]["all_reduce"].items():
        assert getattr(link, name) == pytest.approx(value, rel=0.01, abs=1e-12), name
    # what gloo's threads take from compute beside them (``--contention``), rounded as the profile states it
    contention = pathlib.Path(__file__).parents[1] / "bench" / "results" / "calibrate_cpu_gloo_contention.json"
    assert "bench/results/calibrate_cpu_gloo_contention.json" in p.source
    assert p.comm_cpu_share == pytest.approx(json.loads(contention.read_text())["fit"]["comm_cpu_share"], abs=0.005)
