"""Cost model: predicted seconds for every FX node, from shapes in ``node.meta["val"]`` and a hardware profile.

* Collectives: alpha-beta model of NCCL's ring (and, for all-reduce, tree) algorithms, in the bus-bandwidth
  convention of nccl-tests (``bytes`` is the full gathered / unreduced tensor, see ``collective_bytes``)::

      ring all-gather / reduce-scatter:  base + step * (W - 1)          + bytes * (W - 1) / W / bus_bw
      ring all-reduce:                   base + step * 2 * (W - 1)      + 2 * bytes * (W - 1) / W / bus_bw
      tree all-reduce:                   base + step * 2 * ceil(log2 W) + 2 * bytes / bus_bw

  Inside one node (``W <= ranks_per_node``) the intra-node link is used, otherwise the inter-node link
  (a ring's steps all run at the pace of its slowest hop). Process groups run concurrently and do not
  share bandwidth in this model.
* Compute: roofline, ``max(FLOPs / matmul_flops, bytes / mem_bw) + op_overhead``. FLOPs are counted from
  shapes for mm / _scaled_mm (float8, at the float8 rate) / addmm / bmm / baddbmm / convolution(+backward) / scaled-dot-product attention (+backward);
  every other op is memory bound (bytes read + written); views and aliases are free.

Nothing here touches a GPU driver or Triton (Inductor's own estimator calls ``triton.testing.get_dram_gbps``,
which needs a GPU driver and fails on a CPU-only machine); ``hardware="auto"`` decides
from the graph's device and world size alone, so every rank picks the same profile.

All numbers are estimates. Each profile constant names its source next to it.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import torch
import torch.fx as fx

from fsdp_compile.passes import predicates as P

aten = torch.ops.aten

GB = 1e9
TFLOP = 1e12
US = 1e-6


@dataclasses.dataclass(frozen=True)
class LinkProfile:
    """One interconnect level, as seen by a collective's ring."""

    bus_bw: float
    """Bus bandwidth at large messages, bytes/s (nccl-tests' ``busbw``: algorithm-independent link speed)."""

    step_latency: float
    """Seconds per ring step (per hop), the alpha of the alpha-beta model."""

    base_latency: float
    """Seconds per collective regardless of size (launch, synchronization)."""


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
    """Per-rank compute and communication speeds. Achievable numbers, not datasheet peaks."""

    name: str
    device_type: str  # "cuda" | "cpu": the device the profile describes
    matmul_flops_fp32: float  # FLOP/s for fp32 matmul / conv / attention
    matmul_flops_lowp: float  # FLOP/s for bf16 / fp16
    mem_bw: float  # bytes moved (read + written) per second by memory-bound ops
    op_overhead: float  # seconds per executed op (launch / eager dispatch), views excluded
    intra: LinkProfile  # link inside one node
    ranks_per_node: int  # ranks that share the intra-node link
    inter: LinkProfile | None = None  # link across nodes; None: one level
    source: str = ""  # where the numbers come from (and when they were measured)
    view_overhead: float = 0.0  # seconds per view / alias node (0 where compiled code makes views free)
    matmul_flops_float8: float | None = None  # FLOP/s for float8 (torch._scaled_mm); None: as bf16
    # Bytes the communication backend allocates per byte a collective moves (``predicates.collective_bytes``),
    # held from the collective's issue to its wait, by kind; kinds not named allocate nothing (NCCL works in
    # place). The planner counts them against the memory budget, so a schedule that keeps more collectives in
    # flight pays for their buffers.
    collective_scratch: tuple[tuple[str, float], ...] = ()
    # Collective kinds the backend runs with an algorithm of a speed of its own: their link, in place of
    # ``link``'s one level (gloo's all-reduce, against the all-gather and reduce-scatter ``intra`` is fitted on).
    kind_links: tuple[tuple[str, LinkProfile], ...] = ()
    # The share of the time a collective runs beside compute that it takes from compute: 0 where the collective
    # runs on hardware of its own (a GPU's copy engines and NCCL's SMs, as this model counts them); gloo's
    # threads run on the cores compute runs on, so a collective that overlaps compute slows it. Charged to the
    # compute stream at the collective's wait (``_program.run``).
    comm_cpu_share: float = 0.0

    def __post_init__(self):
        if self.matmul_flops_float8 is None:
            object.__setattr__(self, "matmul_flops_float8", self.matmul_flops_lowp)

    def link(self, world_size: int, kind: str | None = None) -> LinkProfile:
        if self.inter is None or world_size <= self.ranks_per_node:
            return dict(self.kind_links).get(kind, self.intra)
        return self.inter

    def scratch_bytes(self, kind: str | None, nbytes: int) -> int:
        """What the backend allocates for a ``kind`` collective moving ``nbytes`` (``collective_scratch``)."""
        return int(dict(self.collective_scratch).get(kind, 0.0) * nbytes)

    def matmul_flops(self, dtype: torch.dtype) -> float:
        if dtype.is_floating_point and dtype.itemsize == 1:  # the float8 types
            return self.matmul_flops_float8
        return self.matmul_flops_lowp if dtype in (torch.bfloat16, torch.float16) else self.matmul_flops_fp32


# --- H100 SXM5 ------------------------------------------------------------------------------------
# Datasheet (NVIDIA H100 Tensor Core GPU datasheet, SXM5 column): 989 TFLOP/s dense BF16/FP16 tensor core
# (1979 with sparsity), 67 TFLOP/s FP32 (non-tensor core; torch does not use TF32 for fp32 matmul by
# default), 1979 TFLOP/s dense FP8 tensor core, 3.35 TB/s HBM3, NVLink 4 at 900 GB/s bidirectional = 450 GB/s per direction.
# Achievable fractions are estimates: large cuBLAS bf16 GEMMs reach ~70% of peak (~700 TFLOP/s);
# STREAM-like copies reach ~85% of HBM bandwidth (~2.8 TB/s).
_H100_BF16 = 989 * TFLOP * 0.70
_H100_FP32 = 67 * TFLOP * 0.70
_H100_FP8 = 1979 * TFLOP * 0.70  # torch._scaled_mm (torchao's float8 Linear); the same fraction assumed
_H100_HBM = 3.35e12 * 0.85
# Average launch cost per ATen node (~4 us per CUDA kernel launch without CUDA graphs; Inductor fuses
# pointwise chains, so the share per FX node is lower): an estimate.
_H100_OP_OVERHEAD = 2 * US
# NVLink 4 through NVSwitch, 8 GPUs: nccl-tests all_gather_perf / reduce_scatter_perf reach a bus
# bandwidth of ~360 GB/s at large sizes (80% of the 450 GB/s per direction; all-reduce with NVLS goes
# higher, FSDP uses AG/RS). Latencies from NCCL's tuning model (src/graph/tuning.cc,
# ncclTunerConstantsDefaults): base latency 6.6-14 us per collective (ring), hardware latency
# 0.6-3.4 us per NVLink step (LL .. Simple protocol); we take 10 us and 1 us.
_NVLINK4 = LinkProfile(bus_bw=360 * GB, step_latency=1.0 * US, base_latency=10 * US)
# Across nodes: one 400 Gb/s NDR InfiniBand NIC (ConnectX-7) per GPU, as in DGX H100 (8 compute NICs).
# 400 Gb/s = 50 GB/s line rate; NCCL's network transport achieves ~45 GB/s per NIC. A ring's
# cross-node hop runs at one NIC's speed; NCCL can exceed this by striping channels over all 8 rails
# (and SHARP), so this is the pessimistic end of multi-node bus bandwidth. Per-step latency: NCCL's
# hardware latency for NET ring steps is 2.7-14 us (LL .. Simple); we take 5 us.
_IB_NDR = LinkProfile(bus_bw=45 * GB, step_latency=5.0 * US, base_latency=10 * US)

H100_NVLINK = HardwareProfile(
    name="h100-nvlink",
    device_type="cuda",
    matmul_flops_fp32=_H100_FP32,
    matmul_flops_lowp=_H100_BF16,
    matmul_flops_float8=_H100_FP8,
    mem_bw=_H100_HBM,
    op_overhead=_H100_OP_OVERHEAD,
    intra=_NVLINK4,
    ranks_per_node=8,
    source="NVIDIA H100 SXM5 datasheet; NCCL tuning.cc latencies; nccl-tests bus bandwidths (estimates)",
)

H100_IB = dataclasses.replace(
    H100_NVLINK,
    name="h100-ib",
    inter=_IB_NDR,
    source=H100_NVLINK.source + "; 400 Gb/s NDR InfiniBand, one NIC per GPU (estimate)",
)

# --- CPU + gloo -----------------------------------------------------------------------------------
# Measured on the development machine (2 cores; 2 gloo ranks over 127.0.0.1, 1 thread per rank, both ranks
# busy at once) by ``bench/calibrate_cpu_gloo.py``, which writes every measurement and this fit to
# ``bench/results/calibrate_cpu_gloo.json`` (2026-11-22). Runs on this shared machine spread by about
# +-25%; the machines of this workplace differ too (an earlier one had AVX512-BF16 and ran bf16 matmuls at
# ~200 GFLOP/s; this one emulates them). With 2 ranks the per-collective and per-step latencies cannot be
# told apart: all of it is per step. The per-node overheads are what ``aot_eager`` pays (it runs the graph
# node by node); Inductor's C++ code fuses nodes, so on CPU + Inductor this profile overestimates compute.
CPU_GLOO = HardwareProfile(
    name="cpu-gloo",
    device_type="cpu",
    matmul_flops_fp32=68.9e9,  # torch.mm fp32, 512/1024 square
    matmul_flops_lowp=1.16e9,  # torch.mm bf16 (no native bf16 matmul on this machine's CPU)
    mem_bw=12.84 * GB,  # Tensor.copy_ of 64 MiB: bytes read + written per second
    op_overhead=5.67 * US,  # per aten.add node of an FX graph on a 1-element tensor
    view_overhead=3.45 * US,  # per aten.view node of an FX graph
    intra=LinkProfile(bus_bw=0.558 * GB, step_latency=499.8 * US, base_latency=0.0),  # AG + RS fit, 4 KiB..16 MiB
    ranks_per_node=1 << 30,  # one host: every rank on the same "node"
    # torch 2.13's gloo (fsdp_compile._torch._gloo.measure_collective_scratch; tests/test_gloo_multirank.py checks it): a
    # reduce-scatter copies its whole input at issue and all-reduces the copy, freed at the wait. An all-gather's
    # flat buffer (its output's size) lives only while it runs on the group's worker thread and is freed before
    # the wait: counted from issue to wait it would charge a prefetched all-gather twice its bytes for the whole
    # prefetch (tried: on `small` the planner then merged blocks two by two without prefetching, predicted step
    # +26%), so it is left out. All-reduce, all-to-all: nothing.
    collective_scratch=(("reduce_scatter", 1.0),),
    # gloo's all-reduce, measured on its own (``bench/calibrate_cpu_gloo.py --all-reduce``, 2026-11-29): 17.7 ms
    # for 16 MiB, where ``intra``'s ring (2 x a reduce-scatter's bytes) gives 31.0. Torch's gloo reduce-scatter
    # is itself an all-reduce of its whole input (``collective_scratch``), so ``intra``'s fit priced every
    # all-reduce (``replicate``'s gradients, HSDP's) about twice.
    kind_links=(("all_reduce", LinkProfile(bus_bw=1.485 * GB, step_latency=193.3 * US, base_latency=0.0)),),
    # gloo's threads share the cores with compute: a collective beside a training step (a small Llama's forward
    # and backward, compiled) delayed the step by 0.69 of the collective's own duration (all-gather,
    # reduce-scatter and all-reduce, 1-16 MiB; ``bench/calibrate_cpu_gloo.py --contention``, 2026-11-30).
    # Without it the planner took communication hidden behind compute as free.
    comm_cpu_share=0.69,
    source="bench/results/calibrate_cpu_gloo.json (bench/calibrate_cpu_gloo.py on the development machine, 2026-11-22); "
           "all-reduce: bench/results/calibrate_cpu_gloo_all_reduce.json (--all-reduce, 2026-11-29); "
           "contention: bench/results/calibrate_cpu_gloo_contention.json (--contention, 2026-11-30)",
)

PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (H100_NVLINK, H100_IB, CPU_GLOO)}


def get_profile(name: str) -> HardwareProfile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware profile {name!r}; known: {sorted(PROFILES)} or 'auto'") from None


def resolve_hardware(hardware: str | HardwareProfile, *, device_type: str, world_size: int) -> str | HardwareProfile:
    """``"auto"`` -> ``cpu-gloo`` on CPU, ``h100-nvlink`` on CUDA with <= 8 ranks, else ``h100-ib``; a name is
    checked, a ``HardwareProfile`` (``CompileConfig.hardware`` of your own) returned as it is.

    Decided from the graph's device and collective sizes only (no driver query), so every rank agrees.
    """
    if isinstance(hardware, HardwareProfile):
        return hardware
    if hardware != "auto":
        get_profile(hardware)
        return hardware
    if device_type != "cuda":
        return "cpu-gloo"
    return "h100-nvlink" if world_size <= H100_NVLINK.ranks_per_node else "h100-ib"


def graph_device_type(graph: fx.Graph) -> str:
    """The device type of the first tensor in the graph's ``meta["val"]``s (``"cpu"`` if none)."""
    for n in graph.nodes:
        for t in P.val_tensors(n.meta.get("val")):
            return t.device.type
    return "cpu"


def graph_world_size(graph: fx.Graph) -> int:
    """The largest world size among the graph's collectives (1 without collectives)."""
    sizes = []
    for n in P.collectives(graph):
        try:
            sizes.append(P.world_size(n))
        except ValueError:
            pass
    return max(sizes, default=1)


# --- FLOPs ----------------------------------------------------------------------------------------


def _val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else None


def _shape(a) -> tuple[int, ...]:
    v = _val(a)
    return tuple(P._hint(s) for s in v.shape) if isinstance(v, torch.Tensor) else ()


def _named_arg(node: fx.Node, name: str, default=None):
    schema = getattr(node.target, "_schema", None)
    if name in node.kwargs:
        return node.kwargs[name]
    if schema is not None:
        for i, arg in enumerate(schema.arguments):
            if arg.name == name:
                return node.args[i] if i < len(node.args) else default
    return default


_SDPA_FWD = {
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math",
    "scaled_dot_product_attention",
}
_SDPA_BWD = {
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention_backward",
}


def _matmul_dtype(node: fx.Node) -> torch.dtype:
    """The precision a matmul-like node runs in: its narrowest floating-point input (float8 data beside
    float32 scales in ``_scaled_mm``; ``mm`` of bf16 inputs)."""
    dtypes = [t.dtype for a in node.all_input_nodes for t in P.val_tensors(a.meta.get("val")) if t.dtype.is_floating_point]
    return min(dtypes, key=lambda d: d.itemsize, default=torch.float32)


def node_flops(node: fx.Node) -> int:
    """FLOPs (multiply-add = 2) of matmul-like nodes, from input shapes; 0 for everything else."""
    if node.op != "call_function":
        return 0
    packet = getattr(node.target, "overloadpacket", None)
    name = getattr(packet, "__name__", "")
    args = node.args
    if name == "mm":  # [M, K] @ [K, N]
        (m, k), (_, n) = _shape(args[0]), _shape(args[1])
        return 2 * m * k * n
    if name == "_scaled_mm":  # float8 [M, K] @ [K, N] with scales (torchao's float8 Linear)
        (m, k), (_, n) = _shape(args[0]), _shape(args[1])
        return 2 * m * k * n
    if name == "addmm":  # bias + [M, K] @ [K, N]
        (m, k), (_, n) = _shape(args[1]), _shape(args[2])
        return 2 * m * k * n + m * n
    if name in ("bmm", "baddbmm"):  # [B, M, K] @ [B, K, N]
        a, b = (args[0], args[1]) if name == "bmm" else (args[1], args[2])
        (bs, m, k), (_, _, n) = _shape(a), _shape(b)
        return 2 * bs * m * k * n + (bs * m * n if name == "baddbmm" else 0)
    if name == "convolution":
        x, w = _shape(args[0]), _shape(args[1])
        transposed = bool(_named_arg(node, "transposed", False))
        # every output (input, if transposed) element takes prod(w[1:]) multiply-adds
        return 2 * math.prod(x if transposed else _shape(node)) * math.prod(w[1:])
    if name == "convolution_backward":  # grad_input + grad_weight: twice the forward
        go, x, w = _shape(args[0]), _shape(args[1]), _shape(args[2])
        transposed = bool(_named_arg(node, "transposed", False))
        fwd = 2 * math.prod(x if transposed else go) * math.prod(w[1:])
        mask = _named_arg(node, "output_mask", [True, True, True])
        return fwd * (int(bool(mask[0])) + int(bool(mask[1])))
    if name in _SDPA_FWD or name in _SDPA_BWD:
        q, k, v = (_shape(_named_arg(node, n)) for n in ("query", "key", "value"))
        if not (q and k and v):
            return 0
        # q: [..., Sq, D], k: [..., Sk, D], v: [..., Sk, Dv]: QK^T and PV
        batch = math.prod(q[:-2])
        flops = 2 * batch * q[-2] * k[-2] * (q[-1] + v[-1])
        if _named_arg(node, "is_causal", False):
            flops //= 2
        # backward: recompute QK^T, then dV, dP, dQ, dK: 5 matmuls instead of 2
        return flops * 5 // 2 if name in _SDPA_BWD else flops
    return 0


def node_io_bytes(node: fx.Node) -> int:
    """Bytes a node reads and writes: its tensor inputs' and outputs' elements."""
    inputs = sum(P.node_bytes(a) for a in node.all_input_nodes)
    return inputs + P.node_bytes(node)


class CostModel:
    """Predicted seconds per node and per collective for one ``HardwareProfile``."""

    def __init__(self, profile: HardwareProfile | str):
        self.profile = get_profile(profile) if isinstance(profile, str) else profile

    def __repr__(self) -> str:
        return f"CostModel({self.profile.name!r})"

    # communication
    def collective_time(self, kind: str, nbytes: int, world_size: int, algorithm: str = "auto") -> float:
        """Seconds for one collective of ``nbytes`` (``collective_bytes`` convention) over ``world_size`` ranks.

        ``algorithm``: ``"ring"``, ``"tree"`` (all-reduce only) or ``"auto"`` (the faster, as NCCL's tuner picks).
        """
        if algorithm not in ("auto", "ring", "tree"):
            raise ValueError(f"algorithm must be 'auto', 'ring' or 'tree', got {algorithm!r}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        link = self.profile.link(world_size, kind)
        if world_size == 1:
            return link.base_latency
        w = world_size
        if kind == "all_reduce":
            ring = link.base_latency + 2 * (w - 1) * link.step_latency + 2 * nbytes * (w - 1) / w / link.bus_bw
            tree = link.base_latency + 2 * math.ceil(math.log2(w)) * link.step_latency + 2 * nbytes / link.bus_bw
            return {"ring": ring, "tree": tree, "auto": min(ring, tree)}[algorithm]
        if algorithm == "tree":
            raise ValueError(f"algorithm='tree' applies to all_reduce only, not {kind}")
        if kind in ("all_gather", "reduce_scatter", "all_to_all"):
            return link.base_latency + (w - 1) * link.step_latency + nbytes * (w - 1) / w / link.bus_bw
        if kind == "broadcast":
            return link.base_latency + (w - 1) * link.step_latency + nbytes / link.bus_bw
        raise ValueError(f"unknown collective kind {kind!r}")

    def collective_node_time(self, node: fx.Node) -> float:
        return self.collective_time(P.collective_kind(node), P.collective_bytes(node), P.world_size(node))

    # compute
    def compute_time(self, node: fx.Node) -> float:
        """Roofline time of a non-collective node on the compute stream (0 for views and graph I/O); a region
        call (``invoke_subgraph``, a repeated block) costs what its body does."""
        if node.op != "call_function":
            return 0.0
        if node.target is torch.ops.higher_order.invoke_subgraph:
            return self._region_time(node)
        if P.is_view(node):
            return 0.0 if node.target is operator.getitem else self.profile.view_overhead
        tensors = P.val_tensors(node.meta.get("val"))
        if not tensors and not any(P.val_tensors(a.meta.get("val")) for a in node.all_input_nodes):
            return 0.0  # symbolic-size arithmetic and other host-side nodes
        p = self.profile
        flops = node_flops(node)
        t_flops = flops / p.matmul_flops(_matmul_dtype(node)) if flops else 0.0
        t_mem = node_io_bytes(node) / p.mem_bw
        return max(t_flops, t_mem) + p.op_overhead

    def _region_time(self, node: fx.Node) -> float:
        body = getattr(node.graph.owning_module, node.args[0].target, None)
        if body is None:
            return 0.0
        cache = self.__dict__.setdefault("_regions", {})
        if id(body) not in cache:  # one body, called by every block
            cache[id(body)] = (body, sum(self.node_time(n) for n in body.graph.nodes))
        return cache[id(body)][1]

    def node_time(self, node: fx.Node) -> float:
        """Seconds a node occupies its stream: a collective its process group's, anything else the compute stream.

        ``wait_tensor`` costs nothing itself; the simulator makes it block until its collective ends.
        """
        if P.is_collective(node):
            return self.collective_node_time(node)
        if P.is_wait(node):
            return 0.0
        return self.compute_time(node)


def cost_model_for(hardware: str | HardwareProfile | CostModel, graph: fx.Graph) -> CostModel:
    """The cost model for ``CompileConfig.hardware`` (``"auto"`` resolved from ``graph``)."""
    if isinstance(hardware, CostModel):
        return hardware
    return CostModel(resolve_hardware(hardware, device_type=graph_device_type(graph), world_size=graph_world_size(graph)))
