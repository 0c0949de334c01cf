"""The compile backend, wiring only: Dynamo graph -> AOTAutograd (our decompositions, recompute tagging)
-> forward/backward graphs -> ``passes.pipeline.run_passes`` -> ``aot_eager`` (no codegen) or Inductor.

Every graph rewrite lives in ``passes/``, every dump in ``debug/``. Inductor settings are scoped to this
backend's compiles (``config_patches`` of ``compile_fx`` also wraps the lazily compiled backward), never
set globally.
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

from fsdp_compile.config import CompileConfig
from fsdp_compile.debug.dump import CompileHook, readable
from fsdp_compile.ops import DECOMPOSITIONS
from fsdp_compile.passes.pipeline import PassRecord, run_passes
from fsdp_compile.passes.recompute import tag_unshard_recompute
from fsdp_compile.plan import ShardingPlan


@dataclasses.dataclass
class CapturedGraphs:
    """What the backend saw, per compile: read by ``explain`` and the debug dumps."""

    dynamo: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)
    forward: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)
    backward: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)
    records: list[PassRecord] = dataclasses.field(default_factory=list)
    output_code: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (kind, Inductor's source)


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
    known_groups = [g.fqn for g in plan.groups]
    hook = CompileHook(config.dump_dir)
    snapshot = readable if config.dump_dir or not codegen else None
    inductor = config.backend == "inductor" and codegen

    def on_graph(kind: str, gm: torch.fx.GraphModule) -> None:
        """Every forward/backward graph, before it is compiled: our passes, then the record and dumps."""
        graphs = getattr(captured, kind)
        record = run_passes(
            gm, kind, len(graphs), config, known_groups, pin_order=inductor, snapshot=snapshot
        )
        captured.records.append(record)
        graphs.append(gm)
        hook.passes(record)

    def backend(gm: torch.fx.GraphModule, example_inputs):
        hook.dynamo(len(captured.dynamo), gm)
        captured.dynamo.append(gm)
        if inductor:
            return _inductor(gm, example_inputs, reshard, config, on_graph, captured, hook)
        decompositions = DECOMPOSITIONS
        if config.backend == "inductor":
            from torch._inductor.decomposition import select_decomp_table

            decompositions = {**select_decomp_table(), **DECOMPOSITIONS}
        return _aot_eager(gm, example_inputs, reshard, on_graph, decompositions)

    return backend


def _aot_eager(gm, example_inputs, reshard, on_graph, decompositions):
    def partition(joint, joint_inputs, **kwargs):
        tag_unshard_recompute(joint.graph, reshard)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def compiler(kind):
        def compile_graph(g, _inputs):
            on_graph(kind, g)
            return make_boxed_func(g.forward)

        return compile_graph

    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        partition_fn=partition,
        decompositions=decompositions,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)


def _inductor(gm, example_inputs, reshard, config, on_graph, captured, hook):
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    def inner_compile(g, *args, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else "forward"
        on_graph(kind, g)
        out = compile_fx_inner(g, *args, **kwargs)
        source = getattr(out, "source_code", None)
        if source:
            captured.output_code.append((kind, source))
            hook.output_code(kind, sum(1 for k, _ in captured.output_code if k == kind) - 1, source)
        return out

    return compile_fx(
        gm,
        example_inputs,
        inner_compile=inner_compile,
        decompositions={**select_decomp_table(), **DECOMPOSITIONS},
        config_patches={"joint_custom_pre_pass": _JointTagPass(reshard, config)},
    )
