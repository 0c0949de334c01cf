"""The compile backend, wiring only: Dynamo graph -> AOTAutograd (our decompositions, recompute tagging)
-> forward/backward graphs -> ``passes.pipeline.run_passes`` -> ``aot_eager`` (no codegen) or Inductor.

Every graph rewrite lives in ``passes/``, every dump in ``debug/``. Under Inductor our passes are its own
custom-pass hooks, each a ``CustomGraphPass`` whose ``uuid`` covers what it depends on, so Inductor's FX
graph cache and AOTAutograd's cache key on them and a second process with the same model, config and
schedule starts warm:

* ``joint_custom_pre_pass``: recompute tagging (``passes/recompute.py``);
* ``post_grad_custom_pre_pass``: placement and the schedule's moves (``passes/pipeline.py``);
* ``post_grad_custom_post_pass``: order pinning, after the caches' checks (``control_deps`` cannot be
  cached as an input graph, but as part of the generated code it can).

A cache hit skips our passes, so their records travel beside the caches (``_record_cache``) and are read
back on a hit: what a warm process reports equals the cold one's (a hit whose records are missing warns).
Dumps need the graphs themselves: a compile that dumps turns the FX graph cache and AOTAutograd's off.
Inductor settings are scoped to this backend's compiles (``config_patches``, which also wrap the lazily
compiled backward), never set globally.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import warnings
from collections.abc import Callable

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._guards import detect_fake_mode
from torch._functorch._aot_autograd.utils import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomGraphPass

from fsdp_compile import _record_cache
from fsdp_compile._cudagraphs import Decision, Gate, aot_eager_compiler, backward_static_inputs, forward_static_inputs
from fsdp_compile._annotations import fsdp_meta
from fsdp_compile._torch import _aot_cache, _dtensor
from fsdp_compile._torch._invoke_subgraph import (
    region_aliases_patchable,
    region_outputs_alias_inputs,
    subgraphs_donate_nothing,
)
from fsdp_compile.config import CompileConfig
from fsdp_compile.debug.dump import CompileHook, readable
from fsdp_compile.ops import DECOMPOSITIONS
from fsdp_compile.passes.cost_model import CostModel
from fsdp_compile.passes.pin_order import pin_collective_order
from fsdp_compile.passes.pipeline import PassRecord, run_passes
from fsdp_compile.passes.recompute import tag_unshard_recompute
from fsdp_compile.passes.regions import INDUCTOR_REGIONS_UNSOUND, RegionDecision, admit_regions
from fsdp_compile.passes.schedule import Schedule
from fsdp_compile.plan import ShardingPlan


@dataclasses.dataclass
class CapturedGraphs:
    """What the backend saw, per compile: read by ``explain`` and the debug dumps (empty for a compile
    that a cache served: its passes did not run in this process)."""

    dynamo: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)
    forward: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)
    backward: list[torch.fx.GraphModule] = dataclasses.field(default_factory=list)
    records: list[PassRecord] = dataclasses.field(default_factory=list)
    output_code: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (kind, Inductor's source)
    regions: list[RegionDecision] = dataclasses.field(default_factory=list)  # per region call of each Dynamo graph
    cudagraphs: list[Decision] = dataclasses.field(default_factory=list)  # per graph, with cudagraphs=True

    def collectives(self, kind: str) -> dict[str, int]:
        """Collectives in every compiled ``kind`` ("forward" | "backward") graph so far, from the records:
        the same whether the passes ran here or a cache served the compile."""
        out = {"all_gathers": 0, "reduce_scatters": 0, "all_reduces": 0}
        for r in self.records:
            if r.kind == kind:
                for k, v in r.collectives.items():
                    out[k] += v
        return out


@functools.cache
def _source_hash() -> str:
    import pathlib

    digest = hashlib.sha256()
    root = pathlib.Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


class _Pass(CustomGraphPass):
    """One of our passes as an Inductor custom pass. Its ``uuid`` keys Inductor's and AOTAutograd's
    caches, which hash the Dynamo graph but not what we do after it: it covers the pass, the config, the
    schedule and the package's source (a cached artifact is reused only for all of them equal)."""

    def __init__(self, name: str, key: tuple, fn: Callable[[torch.fx.Graph], None]):
        self.name, self.key, self.fn = name, key, fn

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.fn(graph)

    def uuid(self) -> bytes:
        return hashlib.sha256(repr((self.name, self.key, _source_hash())).encode()).digest()


def _decomp_table() -> dict:
    from torch._inductor.decomposition import select_decomp_table

    return {**select_decomp_table(), **DECOMPOSITIONS}


class _DecompTable(dict):
    """Inductor's decompositions and ours, pickled by name: ``compile_fx`` hands its ``decompositions`` to
    the FX graph cache's key, and the table's ~1500 functions do not pickle (closures, pybind11 methods),
    which would make every compile bypass the cache. Its content is covered by the passes' uuid (our
    source) and by torch's version (in every cache key)."""

    def __reduce__(self):
        return (_decomp_table, ())


# torch versions on which regions under Inductor, with subgraphs_donate_nothing and region_outputs_alias_inputs,
# give eager FSDP2's gradients (tests/test_ops.py::test_regions_under_inductor_two_layers)
REGIONS_SOUND_UNDER_INDUCTOR = ("2.13.", "2.14.1")


def _is_backward(graph: torch.fx.Graph) -> bool:
    return any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)


# Torch functions that AOTAutograd's cache does not list, so that it never caches a graph calling one, though a
# cached graph is as sound as a traced one: Dynamo puts the entry and exit of torch.nn.attention.sdpa_kernel(...)
# and of torch.autocast(...) in the graph as these calls, with their settings as constant arguments (so in the
# cache key), for AOTAutograd's trace of the graph to run under them, and the traced graph holds what they chose
# (the attention kernel, the casts). Measured on torchtitan's DeepSeek-V3, whose attention enters sdpa_kernel and
# whose MoE router leaves autocast: "Bypassing autograd cache due to: Unsupported call_function target", so
# every warm start traced the whole step again. Keyed by the torch version that defines them.
# Also Dynamo's trampoline for an autograd Function in the graph, which _torch/_aot_cache.py keys by the Function,
# and the value classes a graph constructs (_aot_cache.value_classes: torchao's float8 configs), per graph.
CACHE_SAFE_FUNCTIONS = {
    name: torch.__version__
    for name in ("torch.nn.attention._backend_from_string", "torch.nn.attention._sdpa_kernel",
                 "torch.amp.autocast_mode._enter_autocast", "torch.amp.autocast_mode._exit_autocast",
                 _aot_cache.MARKED)
}


def make_backend(
    config: CompileConfig,
    plan: ShardingPlan,
    schedule: Schedule,
    cost_model: CostModel,
    captured: CapturedGraphs,
    codegen: bool = True,
    stages: bool = False,
) -> Callable:
    """``codegen=False`` (``explain``) stops after our passes: the graphs are what the configured backend
    would receive (Inductor's decompositions included), but nothing is generated. ``stages``: keep every
    graph's readable stages in its ``PassRecord`` (for ``debug.dump.write_dump``; a dump directory keeps them
    anyway): on Llama-3 70B in float8 x TP they cost 42 ms per layer of ``explain``."""
    reshard = {  # per FSDP group: True / False, or an int's post-forward group (name, size)
        g.fqn: (g.post_forward_group_name, g.post_forward_size) if g.post_forward_size
        else g.reshard_after_forward
        for g in plan.groups
    }
    hook = CompileHook(config.dump_dir)
    snapshot = readable if config.dump_dir or stages else None
    inductor = config.backend == "inductor" and codegen
    gate = Gate(plan.device, captured.cudagraphs, warn=codegen) if config.cudagraphs else None
    moves_anything = any(
        u.issue_at != i or u.backward_issue_at != i or u.sink for i, u in enumerate(schedule.units)
    )

    def on_graph(kind: str, gm: torch.fx.GraphModule, record_key: str | None = None) -> None:
        """Every forward/backward graph, before it is compiled: our passes, then the record and dumps.
        Inductor also runs its post-grad hooks on each region's body (``invoke_subgraph``): a body holds
        no FSDP collective (they stay at top level) and is left alone."""
        if not _is_top_level(gm):
            return
        graphs = getattr(captured, kind)
        record = run_passes(gm, kind, len(graphs), schedule, cost_model, snapshot=snapshot)
        check_unshard_in_backward(plan, record)
        captured.records.append(record)
        graphs.append(gm)
        hook.passes(record)
        if record_key is not None:
            _record_cache.store(record_key, record)

    parallel = any(p.parallel is not None for g in plan.groups for p in g.params)

    def backend(gm: torch.fx.GraphModule, example_inputs):
        if parallel:  # tracing starts from an empty DTensor sharding cache (see _dtensor.py); it refills eagerly
            _dtensor.clear_sharding_cache()
        # regions that would compute something else than the inline compile are inlined (passes/regions.py)
        # under Inductor, only on the torches whose region lowering our patches were measured to fix
        sound = torch.__version__.startswith(REGIONS_SOUND_UNDER_INDUCTOR) and region_aliases_patchable()
        refuse = INDUCTOR_REGIONS_UNSOUND if inductor and not sound else None
        captured.regions.extend(dataclasses.replace(d, graph=len(captured.dynamo))
                                for d in admit_regions(gm, detect_fake_mode(example_inputs), refuse))
        hook.dynamo(len(captured.dynamo), gm)
        captured.dynamo.append(gm)
        if inductor:
            key = (sorted(reshard.items()), dataclasses.replace(config, dump_dir=None), schedule.digest(),
                   cost_model.profile)
            record_key = _record_cache.graph_key(gm, example_inputs, repr(key) + _source_hash())
            stored = _record_cache.load(record_key)
            patches = {
                "joint_custom_pre_pass": _Pass("recompute", key, lambda g: tag_unshard_recompute(g, reshard)),
                "post_grad_custom_pre_pass": _Pass(
                    "schedule", key,
                    lambda g: on_graph("backward" if _is_backward(g) else "forward", g.owning_module, record_key),
                ),
                "post_grad_custom_post_pass": _Pass(
                    "pin", key, lambda g: pin_collective_order(g.owning_module) if moves_anything else None
                ),
            }
            # Inductor's scheduler reorders for peak memory by default. On torch 2.13 that corrupted reused
            # regions (measured: layer 0's gradients off by 2e4 relative, with torch's own
            # nested_compile_region on a Llama block, no FSDP; the donation fix of pytorch#193960 is
            # related): it fills in the buffer sizes with which the wrapper's memory planner reuses a
            # region's input that a region output aliases (_invoke_subgraph.region_outputs_alias_inputs
            # fixes that). It also undoes our prefetches. Our schedule plans memory itself.
            patches["reorder_for_peak_memory"] = False
            patches["unsafe_marked_cacheable_functions"] = {**torch._inductor.config.unsafe_marked_cacheable_functions,
                                                            **CACHE_SAFE_FUNCTIONS, **_aot_cache.value_classes(gm)}
            if config.dump_dir:
                patches["fx_graph_cache"] = False  # a cache hit would skip the passes that write the dump
            if gate is not None:
                patches["triton.cudagraphs"] = True
            # AOTAutograd's cache would bring back graphs without asking the gate (_cudagraphs.py)
            use_aot_cache = not config.dump_dir and gate is None
            return _inductor(gm, example_inputs, patches, captured, hook, stored, use_aot_cache, gate, plan)
        decompositions = DECOMPOSITIONS
        if config.backend == "inductor":
            decompositions = _decomp_table()
        return _aot_eager(gm, example_inputs, reshard, on_graph, decompositions, gate, codegen)

    return backend


def check_unshard_in_backward(plan: ShardingPlan, record: PassRecord) -> None:
    """FSDP2's ``set_unshard_in_backward(False)`` promises that a module's backward does not need its
    parameters: FSDP2 then does not re-gather them, and a backward that needs them fails in eager (it reads
    the freed unsharded storage: "setStorage: ... out of bounds for storage of size 0"). The compiled backward
    re-gathers a unit only where it needs it, so the setting holds by itself wherever eager can train; a
    backward graph that re-gathers such a module is refused, naming it."""
    off = {g.fqn for g in plan.groups if not g.unshard_in_backward}
    if record.kind != "backward" or not off:
        return
    for bucket in record.buckets:
        needed = [f for f in bucket["groups"] if f in off] if bucket["kind"] == "all_gather" else []
        if needed:
            raise NotImplementedError(
                f"FSDP module {needed[0] or '<root>'!r} has set_unshard_in_backward(False), but its backward needs "
                "its parameters (eager FSDP2 does not re-gather them and fails reading their freed storage): call "
                "set_unshard_in_backward(True) on it, or shard it with reshard_after_forward=False"
            )


def _aot_eager(gm, example_inputs, reshard, on_graph, decompositions, gate: Gate | None, codegen: bool):
    """``gate``: with cudagraphs=True, each graph replayed by torch's CUDA graph trees where it allows
    (``explain``, ``codegen=False``: only the decision is recorded)."""
    def partition(joint, joint_inputs, **kwargs):
        tag_unshard_recompute(joint.graph, reshard)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    forward_device = [None]  # the device index of the last captured forward, for its backward (torch's trees)

    def compiler(kind):
        def compile_graph(g, inputs):
            on_graph("backward" if kind == "backward" else "forward", g)
            if gate is None:
                return make_boxed_func(g.forward)
            if codegen:
                return aot_eager_compiler(kind, g, inputs, gate, forward_device)
            static = backward_static_inputs(g) if kind == "backward" else forward_static_inputs()
            gate.record(kind, gate.decide(kind, g, static))
            return make_boxed_func(g.forward)

        return compile_graph

    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        partition_fn=partition,
        decompositions=decompositions,
        keep_inference_input_mutations=True,
    )(gm, example_inputs)


def _is_top_level(gm: torch.fx.GraphModule) -> bool:
    """A forward or backward graph of the step (it holds our collectives), not a region's body."""
    return any(fsdp_meta(n) is not None for n in gm.graph.nodes)


def _inductor(gm, example_inputs, patches, captured, hook, stored: dict | None, use_aot_cache: bool, gate: Gate | None,
              plan: ShardingPlan):
    """``stored``: the records of an earlier compile of this graph (``_record_cache``), taken in place of
    the ones our passes would write when a cache serves the compile. ``gate``: with cudagraphs=True, which
    graphs Inductor's CUDA graph trees may capture (``triton.cudagraphs`` is on in ``patches``)."""
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    from torch._inductor.output_code import maybe_handle_backward_generation
    from torch._inductor.utils import BoxedBool

    def from_cache(kind: str) -> None:
        if stored and kind in stored:
            record = PassRecord(**{**stored[kind], "index": sum(r.kind == kind for r in captured.records)})
            check_unshard_in_backward(plan, record)
            captured.records.append(record)
        else:
            warnings.warn(
                f"fsdp_compile: a cache served this {kind} graph but our passes' record of it is missing (was "
                "fsdp_compile imported before torch.compiler.load_cache_artifacts?): compiled.captured and the "
                "collective counts leave that graph out; delete TORCHINDUCTOR_CACHE_DIR to compile it afresh",
                stacklevel=2,
            )

    def inner_compile(g, *args, **kwargs):
        """Inductor's own, observed: the generated code goes to the record and the dump (nothing here
        changes the graph, which the AOTAutograd cache's key would not see)."""
        kind = "backward" if kwargs.get("is_backward") else "forward"
        before = len(captured.records)
        reasons = None
        if gate is not None and _is_top_level(g):
            graph_kind = "inference" if kwargs.get("is_inference") else kind
            reasons = gate.decide(graph_kind, g, kwargs.get("static_input_idxs", ()))
            if reasons and kind == "backward":  # its own flag: the forward's stays as it was decided
                kwargs["cudagraphs"] = BoxedBool(False)
            elif reasons:
                BoxedBool.disable(kwargs["cudagraphs"])  # shared with its backward, which then runs uncaptured too
        ours = bool(reasons)
        # torch gives a region's body its caller's donations, and frees a region's inputs that its outputs alias
        with subgraphs_donate_nothing(), region_outputs_alias_inputs():
            out = compile_fx_inner(g, *args, **kwargs)
        if reasons is not None:
            if not reasons and not kwargs["cudagraphs"]:  # Inductor declined it after our gate let it through
                info = getattr(out, "cudagraph_info", None)
                reasons = [getattr(out, "disabled_cudagraphs_reason", None)
                           or "; ".join(getattr(info, "cudagraph_fail_reasons", None) or []) or "Inductor declined it"]
            forward_device = kwargs.get("boxed_forward_device_index")
            if ours and kind == "backward" and forward_device is not None and forward_device.value is not None:
                # a captured forward's tree must know its backward runs (torch does this when it declines one)
                maybe_handle_backward_generation(out, kwargs["boxed_forward_device_index"])
            gate.record(graph_kind, reasons)
        if len(captured.records) == before and _is_top_level(g):  # the FX graph cache served it
            from_cache(kind)
        source = getattr(out, "source_code", None)
        if source:
            captured.output_code.append((kind, source))
            hook.output_code(kind, sum(1 for k, _ in captured.output_code if k == kind) - 1, source)
        return out

    hits = counters["aot_autograd"]["autograd_cache_hit"]
    aot_cache = use_aot_cache and torch._functorch.config.enable_autograd_cache
    with torch._functorch.config.patch(enable_autograd_cache=aot_cache), _aot_cache.keys():
        out = compile_fx(
            gm, example_inputs, inner_compile=inner_compile, decompositions=_DecompTable(_decomp_table()),
            config_patches=patches,
        )
    if counters["aot_autograd"]["autograd_cache_hit"] > hits:  # AOTAutograd's cache served forward and backward
        from_cache("forward")
        from_cache("backward")
    return out
