"""The compile backend: Dynamo graph -> our placement -> AOTAutograd (our decompositions, our recompute
tags) -> forward/backward graphs -> ``aot_eager`` (no codegen) or Inductor.

Inductor settings are scoped to this backend's compiles (``config_patches`` of ``compile_fx`` also wraps
the lazily compiled backward), never set globally.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch._aot_autograd.utils import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_compile.capture import place_collectives, unshard_chain_nodes
from fsdp_compile.config import CompileConfig
from fsdp_compile.ops import DECOMPOSITIONS, META_KEY
from fsdp_compile.plan import ShardingPlan


@dataclasses.dataclass
class PassRecord:
    """What the passes did to one forward or backward graph, and what the cost model predicts."""

    kind: str  # "forward" | "backward"
    index: int  # which compile of that kind (0 for the first)
    hardware: str
    buckets: list[dict]  # {"kind", "groups", "collectives", "bytes"} per bucket, in program order
    moves: list[str]  # the reordering pass's kept moves, with their reason
    memory_budget: int  # bytes
    before: dict  # Schedule.to_dict() of the graph as captured (collectives where eager FSDP2 issues them)
    after: dict  # ... after bucketing and reordering
    peak_before: int
    peak_after: int
    peak_node: str | None
    stages: list[tuple[str, str]]  # (stage name, readable graph) when dumps are wanted


@dataclasses.dataclass
class CapturedGraphs:
    """What the backend saw, per compile: read by ``explain`` and the debug dumps."""

    dynamo: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)
    forward: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)
    backward: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)
    records: list[PassRecord] = dataclasses.field(default_factory=list)
    output_code: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (kind, Inductor's source)


def fsdp_meta(node: torch.fx.Node) -> dict | None:
    return (node.meta.get("custom") or {}).get(META_KEY)


def tag_unshard_recompute(graph: torch.fx.Graph, reshard: dict[str, bool]) -> None:
    """Joint-graph pass: an FSDP group with ``reshard_after_forward=True`` re-gathers in backward.

    Every node of its unshard chain (copy-in, all-gather, wait, copy-out) becomes MUST_RECOMPUTE, so the
    partitioner saves only the local shards and replays the chain in backward, as FSDP2's pre-backward
    unshard does. Groups with ``reshard_after_forward=False`` keep the partitioner's default for
    collectives (``force_save_collectives``: the gathered buffer is saved for backward).
    """
    for node in unshard_chain_nodes(graph):
        if reshard.get(fsdp_meta(node)["group"], False):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE


class _JointTagPass(CustomGraphPass):
    """The joint-graph tagging pass, whose ``uuid`` also keys Inductor's and AOTAutograd's caches.

    Our passes run inside the compile, after the Dynamo graph that those caches hash: two configs
    (bucket="auto" vs "fsdp_group", reorder on/off, another hardware profile) share one Dynamo graph.
    The uuid therefore covers the whole config and our source, so a cached artifact is only reused for
    the same config and the same fsdp_compile code.
    """

    def __init__(self, reshard: dict[str, bool], config: CompileConfig):
        self.reshard = reshard
        self.config = config

    def __call__(self, graph: torch.fx.Graph) -> None:
        tag_unshard_recompute(graph, self.reshard)

    def uuid(self) -> bytes:
        key = repr((sorted(self.reshard.items()), dataclasses.replace(self.config, dump_dir=None), _source_hash()))
        return hashlib.sha256(key.encode()).digest()


@functools.cache
def _source_hash() -> str:
    import pathlib

    digest = hashlib.sha256()
    root = pathlib.Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def make_backend(config: CompileConfig, plan: ShardingPlan, captured: CapturedGraphs, codegen: bool = True) -> Callable:
    """``codegen=False`` (``explain``) stops after our passes: the graphs are what the configured backend
    would receive (Inductor's decompositions included), but nothing is generated."""
    reshard = {g.fqn: g.reshard_after_forward for g in plan.groups}
    keep_stages = bool(config.dump_dir) or not codegen

    def record(kind: str, gm: torch.fx.GraphModule) -> None:
        graphs = getattr(captured, kind)
        if kind != "dynamo":
            # forward/backward: collectives where FSDP2 issues them, then our passes
            place_collectives(gm.graph)
            record_ = run_passes(gm, kind, len(graphs), config, plan, keep_stages)
            captured.records.append(record_)
            _trace_artifacts(record_)
            gm.recompile()
            if config.dump_dir:
                _dump_record(config.dump_dir, record_)
        elif config.dump_dir:
            _dump_text(config.dump_dir, f"0_dynamo{len(graphs)}.txt", _readable(gm))
        graphs.append(gm)

    def backend(gm: torch.fx.GraphModule, example_inputs):
        record("dynamo", gm)
        if config.backend == "inductor" and codegen:
            return _inductor(gm, example_inputs, reshard, record, captured, config)
        decompositions = DECOMPOSITIONS
        if config.backend == "inductor":
            from torch._inductor.decomposition import select_decomp_table

            decompositions = {**select_decomp_table(), **DECOMPOSITIONS}
        return _aot_eager(gm, example_inputs, reshard, record, decompositions)

    return backend


def run_passes(gm, kind: str, index: int, config: CompileConfig, plan: ShardingPlan, keep_stages: bool) -> PassRecord:
    """Bucketing then reordering on one partitioned graph, in place; returns what they did and predict.

    Every decision comes from the graph and the config (never from timing), so every rank rewrites its
    identical graph identically and the collectives keep one order on all ranks.
    """
    from fsdp_compile import passes

    graph = gm.graph
    stages = [("captured", _readable(gm))] if keep_stages else []
    cost = passes.cost_model_for(config.hardware, graph)
    before = passes.simulate(graph, cost)
    peak_before = passes.peak_memory(graph)[0]
    # one budget for both passes, from the graph as captured: eager FSDP2's peak unless the user set one
    budget = (
        int(config.memory_budget_gb * 2**30) if config.memory_budget_gb is not None else passes.default_memory_budget(graph)
    )
    policy = config.bucket if isinstance(config.bucket, str) else [list(b) for b in config.bucket]
    buckets = passes.plan_buckets(
        graph, policy, bucket_cap_mb=config.bucket_cap_mb, memory_budget_bytes=budget, cost_model=cost,
        known_groups=[g.fqn for g in plan.groups],
    )
    bucket_rows = [
        {
            "kind": passes.predicates.collective_kind(b[0]),
            "groups": groups,
            "collectives": [n.name for n in b],
            "bytes": sum(passes.predicates.collective_bytes(n) for n in b),
        }
        for b, groups in zip(buckets, passes.bucket_groups(buckets))
    ]
    if any(len(b) > 1 for b in buckets):
        passes.apply_buckets(graph, buckets)
        if keep_stages:
            stages.append(("bucketed", _readable(gm)))
    moves: list[str] = []
    if config.reorder:
        moves = passes.reorder(graph, cost, memory_budget_bytes=budget).moves
        if keep_stages:
            stages.append(("reordered", _readable(gm)))
    after = passes.simulate(graph, cost)
    peak_after, peak_node = passes.peak_memory(graph)
    return PassRecord(
        kind=kind, index=index, hardware=cost.profile.name, buckets=bucket_rows, moves=moves, memory_budget=budget,
        before=before.to_dict(), after=after.to_dict(), peak_before=peak_before, peak_after=peak_after,
        peak_node=None if peak_node is None else peak_node.name, stages=stages,
    )


# Matmul-like ops: Inductor runs them as extern kernels (never fused), so pinning them costs nothing.
_ANCHORS = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten.convolution.default,
}


def pin_collective_order(gm: torch.fx.GraphModule) -> int:
    """Make Inductor keep the collective schedule our passes chose; returns the edges added.

    Inductor's scheduler is free to move a ``wait_tensor`` up to its collective (measured: it puts each
    wait right after its all-gather, undoing every prefetch). Two kinds of control dependency, both
    following the graph's current order (so they cannot form a cycle), hold the overlap in place: a
    collective comes before the first matmul-like op after it, and a wait after the last matmul-like op
    before it. They use Inductor's own ``control_deps`` mechanism, which its overlap scheduler uses too.
    """
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    from fsdp_compile.passes import predicates

    deps: dict[torch.fx.Node, OrderedSet] = {}
    pending: list[torch.fx.Node] = []  # collectives issued since the last anchor
    last_anchor = None
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if predicates.is_collective(node):
            pending.append(node)
        elif predicates.is_wait(node):
            if last_anchor is not None:
                deps.setdefault(node, OrderedSet()).add(last_anchor)
        elif node.target in _ANCHORS:
            for coll in pending:
                deps.setdefault(node, OrderedSet()).add(coll)
            pending.clear()
            last_anchor = node
    if deps:
        preserve_node_ordering(gm.graph, deps)
        gm.recompile()
    return sum(len(v) for v in deps.values())


def _trace_artifacts(record: PassRecord) -> None:
    """Our schedule, next to Dynamo's and Inductor's artifacts, in a ``TORCH_TRACE`` run (for tlparse)."""
    import json

    from torch._logging import trace_structured

    name = f"fsdp_compile_{record.kind}{record.index}"
    payload = {k: v for k, v in dataclasses.asdict(record).items() if k != "stages"}
    trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": f"{name}_schedule", "encoding": "json"},
        payload_fn=lambda: json.dumps(payload),
    )
    for stage, text in record.stages:
        trace_structured(
            "artifact",
            metadata_fn=lambda stage=stage: {"name": f"{name}_{stage}_graph", "encoding": "string"},
            payload_fn=lambda text=text: text,
        )


def _readable(gm: torch.fx.GraphModule) -> str:
    gm.recompile()
    text = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    from fsdp_compile.passes.predicates import fsdp_groups

    lines = ["", "# collectives (node -> FSDP groups)"]
    for node in gm.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("_c10d_functional."):
            lines.append(f"# {node.name}: {node.target} groups={list(fsdp_groups(node))!r}")
    return text + "\n".join(lines) + "\n"


_KIND_NO = {"dynamo": 0, "forward": 1, "backward": 2}


def _dump_text(dump_dir: str, name: str, text: str) -> None:
    import os

    os.makedirs(dump_dir, exist_ok=True)
    with open(os.path.join(dump_dir, name), "w") as f:
        f.write(text)


def _dump_record(dump_dir: str, record: PassRecord) -> None:
    """A compiled graph's stages (captured, bucketed, reordered) and its predicted schedule, named as
    ``fsdp_compile.debug.dump`` names them so that both kinds of dump sort the same way."""
    import json

    prefix = f"{_KIND_NO[record.kind]}_{record.kind}{record.index}"
    for i, (stage, text) in enumerate(record.stages):
        _dump_text(dump_dir, f"{prefix}_{i}_{stage}.txt", text)
    payload = {k: v for k, v in dataclasses.asdict(record).items() if k != "stages"}
    _dump_text(dump_dir, f"{prefix}_schedule.json", json.dumps(payload, indent=2))


def _aot_eager(gm, example_inputs, reshard, record, decompositions):
    def partition(joint, joint_inputs, **kwargs):
        tag_unshard_recompute(joint.graph, reshard)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def compiler(kind):
        def compile_graph(g, _inputs):
            record(kind, g)
            return make_boxed_func(g.forward)

        return compile_graph

    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        partition_fn=partition,
        decompositions=decompositions,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)


def _inductor(gm, example_inputs, reshard, record, captured, config):
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    def inner_compile(g, *args, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else "forward"
        record(kind, g)
        if captured.records[-1].moves:  # only reordered graphs need pinning (and control_deps disables
            pin_collective_order(g)  # Inductor's FX graph cache, so graphs without moves stay cacheable)
        out = compile_fx_inner(g, *args, **kwargs)
        source = getattr(out, "source_code", None)
        if source:
            captured.output_code.append((kind, source))
            if config.dump_dir:
                index = sum(1 for k, _ in captured.output_code if k == kind) - 1
                _dump_text(config.dump_dir, f"{_KIND_NO[kind]}_{kind}{index}_9_inductor_output_code.py", source)
        return out

    return compile_fx(
        gm,
        example_inputs,
        inner_compile=inner_compile,
        decompositions={**select_decomp_table(), **DECOMPOSITIONS},
        config_patches={"joint_custom_pre_pass": _JointTagPass(reshard, config)},
    )
