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
class CapturedGraphs:
    """What the backend saw, per compile: read by ``explain`` and the debug dumps."""

    dynamo: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)
    forward: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)
    backward: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)


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
    def __init__(self, reshard: dict[str, bool]):
        self.reshard = reshard

    def __call__(self, graph: torch.fx.Graph) -> None:
        tag_unshard_recompute(graph, self.reshard)

    def uuid(self) -> bytes:
        return hashlib.sha256(repr(sorted(self.reshard.items())).encode()).digest()


def make_backend(config: CompileConfig, plan: ShardingPlan, captured: CapturedGraphs, codegen: bool = True) -> Callable:
    """``codegen=False`` (``explain``) stops after our passes: the graphs are what the configured backend
    would receive (Inductor's decompositions included), but nothing is generated."""
    reshard = {g.fqn: g.reshard_after_forward for g in plan.groups}

    def record(kind: str, gm: torch.fx.GraphModule) -> None:
        graphs = getattr(captured, kind)
        graphs.append(gm)
        if config.dump_dir:
            _dump(config.dump_dir, kind, len(graphs) - 1, gm)

    def backend(gm: torch.fx.GraphModule, example_inputs):
        record("dynamo", gm)
        if config.backend == "inductor" and codegen:
            return _inductor(gm, example_inputs, reshard, record)
        decompositions = DECOMPOSITIONS
        if config.backend == "inductor":
            from torch._inductor.decomposition import select_decomp_table

            decompositions = {**select_decomp_table(), **DECOMPOSITIONS}
        return _aot_eager(gm, example_inputs, reshard, record, decompositions)

    return backend


def _dump(dump_dir: str, kind: str, index: int, gm: torch.fx.GraphModule) -> None:
    """Readable graph text (shapes, dtypes, the FSDP group of every collective node) per stage."""
    import os

    os.makedirs(dump_dir, exist_ok=True)
    stage = {"dynamo": 0, "forward": 1, "backward": 2}[kind]
    path = os.path.join(dump_dir, f"graph{index:03d}_{stage}_{kind}.txt")
    with open(path, "w") as f:
        f.write(gm.print_readable(print_output=False, include_stride=False, include_device=False))
        f.write("\n# collectives (node -> FSDP group)\n")
        for node in gm.graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("_c10d_functional."):
                f.write(f"# {node.name}: {node.target} group={(fsdp_meta(node) or {}).get('group')!r}\n")


def _aot_eager(gm, example_inputs, reshard, record, decompositions):
    def partition(joint, joint_inputs, **kwargs):
        tag_unshard_recompute(joint.graph, reshard)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def compiler(kind):
        def compile_graph(g, _inputs):
            place_collectives(g.graph)
            g.recompile()
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


def _inductor(gm, example_inputs, reshard, record):
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    def inner_compile(g, *args, **kwargs):
        place_collectives(g.graph)
        g.recompile()
        record("backward" if kwargs.get("is_backward") else "forward", g)
        return compile_fx_inner(g, *args, **kwargs)

    return compile_fx(
        gm,
        example_inputs,
        inner_compile=inner_compile,
        decompositions={**select_decomp_table(), **DECOMPOSITIONS},
        config_patches={"joint_custom_pre_pass": _JointTagPass(reshard)},
    )
