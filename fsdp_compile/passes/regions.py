"""Region admission: every repeated-block region either computes what the inline compile computes, or is
inlined back into the graph that calls it. Runs on Dynamo's graph, before AOTAutograd.

A region (``torch.compiler.nested_compile_region``, ``invoke_subgraph`` in the graph) is traced once and
partitioned on its own, and torch 2.13 gets two block patterns wrong there that the inline compile gets
right (each measured against eager FSDP2, ``tests/test_regions.py``):

* **random ops under activation checkpointing.** ``torch.utils.checkpoint`` around a block tags the whole
  region call for recompute, so the backward re-runs the region and draws new random numbers: dropout's
  gradients come out with masks the forward never used (silently wrong). Inline, the partitioner sees the
  random op itself and saves its mask, as eager's checkpoint replays its RNG state.
* **in-place mutation of an input or buffer** (an MoE block's token counter under ``no_grad``):
  ``invoke_subgraph`` refuses to train through it ("does not currently support training with in-place
  input or buffer mutations"); inline, AOTAutograd functionalizes it like any buffer update.

(Complex tensors at a region's boundary, e.g. complex RoPE, crashed too; that one is fixed at the root:
``fsdp_compile._torch._invoke_subgraph``.)

``admit_regions(gm, fake_mode)`` decides per region call from the graph alone (rank-invariant: the same
model traces the same graph on every rank) and inlines the calls it refuses, in place. What it returns
says which kinds of block stayed regions and why the others did not.
"""

from __future__ import annotations

import dataclasses
import itertools
import operator
import re

import torch
import torch.fx as fx

from fsdp_compile._torch._invoke_subgraph import ATEN_FORMS

_INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
_REGION_NAME = re.compile(r"\bin (fsdp_compile_region_\d+)\b")

RANDOM_UNDER_CHECKPOINT = (
    "random ops under activation checkpointing (a region call is recomputed whole, with new random "
    "numbers; inline, the partitioner saves the random op's output as eager's checkpoint replays its RNG)"
)
MUTATES_INPUT = (
    "mutates an input or buffer in place (torch 2.13's invoke_subgraph cannot train through that; inline, "
    "AOTAutograd functionalizes it)"
)

UNANALYSED = "its body could not be traced to ATen for these checks (inline is always right)"


@dataclasses.dataclass
class RegionDecision:
    """One region call site: ``region`` is the function's name (``fsdp_compile_region_<kind index>``, see
    ``capture.install_regions``), ``why`` is None where the call stayed a region."""

    region: str | None
    subgraph: str
    why: str | None


INDUCTOR_REGIONS_UNSOUND = (
    "regions under this torch's Inductor are not known to be sound: its lowering of a region call may reuse "
    "the memory of a region input that a region output aliases (torch 2.14.1 without "
    "fsdp_compile._torch._invoke_subgraph.region_outputs_alias_inputs: every gradient of fsdp_compile.models' "
    "2-layer Llama off, by up to 3.7e3; exact inline)"
)


def admit_regions(gm: fx.GraphModule, fake_mode=None, refuse: str | None = None) -> list[RegionDecision]:
    """Inline (in place) every region call that would differ from the inline compile; return one decision
    per call, in graph order. ``fake_mode``: Dynamo's, to re-trace region bodies to ATen (None: detect it
    from the graph's example values). ``refuse``: inline every region call, for this reason."""
    verdicts: dict[int, str | None] = {}  # id(body) -> why not (one analysis per distinct body)
    decisions: list[RegionDecision] = []
    _walk(gm, under_checkpoint=False, fake_mode=fake_mode, verdicts=verdicts, decisions=decisions, refuse=refuse)
    return decisions


def _walk(gm: fx.GraphModule, under_checkpoint: bool, fake_mode, verdicts, decisions, refuse=None) -> None:
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is _CHECKPOINT:
            _walk(_attr(gm, node.args[0]), True, fake_mode, verdicts, decisions, refuse)
        elif node.target is _INVOKE_SUBGRAPH:
            body = _attr(gm, node.args[0])
            key = id(body)
            if key not in verdicts:
                verdicts[key] = refuse or _why_not(body, fake_mode)
            why = verdicts[key]
            if why == RANDOM_UNDER_CHECKPOINT and not under_checkpoint:
                why = None
            decisions.append(RegionDecision(_region_name(body), node.args[0].target, why))
            if why is None:
                # a checkpoint inside the region (checkpoint_wrapper blocks) is partitioned with the region
                continue
            _inline(gm, node, body)
            changed = True
        elif isinstance(node.target, torch._ops.HigherOrderOperator):
            for arg in node.args:
                if isinstance(arg, fx.Node) and arg.op == "get_attr":
                    sub = _attr(gm, arg)
                    if isinstance(sub, fx.GraphModule):
                        _walk(sub, under_checkpoint, fake_mode, verdicts, decisions, refuse)
    if changed:
        for node in list(gm.graph.find_nodes(op="get_attr")):
            if not node.users:  # the inlined bodies' references (the bodies stay attributes: others may share them)
                gm.graph.erase_node(node)
        gm.graph.lint()
        gm.recompile()


def _attr(gm: fx.GraphModule, node: fx.Node):
    obj = gm
    for part in node.target.split("."):
        obj = getattr(obj, part)
    return obj


def _region_name(body: fx.GraphModule) -> str | None:
    for node in body.graph.nodes:
        match = _REGION_NAME.search(node.meta.get("stack_trace") or "")
        if match:
            return match.group(1)
    return None


def _why_not(body: fx.GraphModule, fake_mode) -> str | None:
    """Why a region with this body would differ from the inline compile (None: it would not). The body is
    Dynamo's (torch functions); which ops mutate or draw random numbers is only certain in ATen, so it is
    traced once more, on fake inputs."""
    try:
        aten = _to_aten(body, fake_mode)
    except Exception as e:  # noqa: BLE001  what cannot be analysed is not trusted: inline is always right
        return f"{UNANALYSED}: {type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    mutated = False
    random = False
    for sub in aten.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
                continue
            if torch.Tag.nondeterministic_seeded in node.target.tags:
                random = True
            if sub is aten and node.target._schema.is_mutable:
                mutated = mutated or _writes_input(node, aten)
    if mutated:
        return MUTATES_INPUT
    if random:
        return RANDOM_UNDER_CHECKPOINT
    return None


def _to_aten(body: fx.GraphModule, fake_mode) -> fx.GraphModule:
    from torch._guards import detect_fake_mode
    from torch.fx.experimental.proxy_tensor import make_fx

    inputs = [n.meta.get("example_value") for n in body.graph.find_nodes(op="placeholder")]
    mode = fake_mode or detect_fake_mode(inputs)
    with mode:
        fakes = [
            # fresh tensors of the same metadata: the body's mutations must not touch Dynamo's example values
            torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad)
            if isinstance(t, torch.Tensor) else t
            for t in inputs
        ]
        aten = make_fx(body, pre_dispatch=False)(*fakes)
    ATEN_FORMS[body] = aten  # invoke_subgraph's schema of this body, asked for by AOTAutograd, reads it
    return aten


def _writes_input(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether ``node`` (a mutable ATen op) writes into the storage of one of ``gm``'s inputs."""
    inputs = {_storage(p.meta.get("val")) for p in gm.graph.find_nodes(op="placeholder")}
    inputs.discard(None)
    for arg, schema in zip(node.args, node.target._schema.arguments):
        if schema.is_write and isinstance(arg, fx.Node) and _storage(arg.meta.get("val")) in inputs:
            return True
    return False


def _storage(t):
    if isinstance(t, torch.Tensor):
        return t.untyped_storage()._cdata
    return None


_names = itertools.count()


def _inline(gm: fx.GraphModule, call: fx.Node, body: fx.GraphModule) -> None:
    """Replace ``call`` (``invoke_subgraph(body, name, *operands)``) by a copy of ``body``'s nodes."""
    operands = call.args[2:]
    placeholders = list(body.graph.find_nodes(op="placeholder"))
    assert len(placeholders) == len(operands), (len(placeholders), len(operands))
    val_map: dict[fx.Node, fx.Node] = dict(zip(placeholders, operands))
    with gm.graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            if node.op == "get_attr":  # a nested body (a checkpoint inside the region): give it a fresh name
                name = f"fsdp_compile_inlined_{next(_names)}"
                setattr(gm, name, _attr(body, node))
                val_map[node] = gm.graph.get_attr(name)
                val_map[node].meta = dict(node.meta)
                continue
            val_map[node] = gm.graph.node_copy(node, lambda n: val_map[n])
        out = body.graph.output_node().args[0]
        results = [val_map[o] if isinstance(o, fx.Node) else o for o in out]
    for user in list(call.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(results[user.args[1]])
            gm.graph.erase_node(user)
        else:
            raise AssertionError(f"a region call's output used as a whole by {user.format_node()}")
    gm.graph.erase_node(call)
