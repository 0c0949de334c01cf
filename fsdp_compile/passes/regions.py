"""Region admission: every repeated-block region either computes what the inline compile computes, or is
inlined back into the graph that calls it. Runs on Dynamo's graph, before AOTAutograd.

A region (``torch.compiler.nested_compile_region``, ``invoke_subgraph`` in the graph) is traced once and
partitioned on its own, and torch 2.13 gets two block patterns wrong there that the inline compile gets
right (each measured against eager FSDP2, ``tests/test_regions.py``):

* **random ops under activation checkpointing.** ``torch.utils.checkpoint`` around a block tags the whole
  region call for recompute, so the backward re-runs the region and draws new random numbers: dropout's
  gradients come out with masks the forward never used (silently wrong). Inline, the partitioner sees the
  random op itself and saves its mask, as eager's checkpoint replays its RNG state.
* **in-place mutation of an input** (an activation passed in, a gathered parameter): ``invoke_subgraph``
  refuses to train through it ("does not currently support training with in-place input or buffer
  mutations"); inline, AOTAutograd functionalizes it. A buffer (an MoE block's token counter under
  ``no_grad``) is functionalized at the region boundary instead (``_own_copies``): the body works on its own
  copy, made at its start, and returns the copy's final value, which the caller writes back into the buffer
  right after the call, at top level, where AOTAutograd functionalizes the write like any buffer update.
  Every read inside the body, before or after the mutation, reads the copy, as eager reads the buffer.

(Complex tensors at a region's boundary, e.g. complex RoPE, crashed too; that one is fixed at the root:
``fsdp_compile._torch._invoke_subgraph``.)

``admit_regions(gm, fake_mode)`` decides per region call from the graph alone (rank-invariant: the same
model traces the same graph on every rank) and inlines the calls it refuses, in place. What it returns
says which kinds of block stayed regions and why the others did not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import operator
import re

import torch
import torch.fx as fx
import torch.nn as nn

from fsdp_compile._quote import quoted
from fsdp_compile._torch._invoke_subgraph import ATEN_FORMS, RETURNS_SUBCLASS

_INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
_CHECKPOINT = torch.ops.higher_order.tag_activation_checkpoint
_REGION_NAME = re.compile(r"\bin (fsdp_compile_region_\d+)\b")

RANDOM_UNDER_CHECKPOINT = (
    "random ops under activation checkpointing (a region call is recomputed whole, with new random "
    "numbers; inline, the partitioner saves the random op's output as eager's checkpoint replays its RNG)"
)
MUTATES_INPUT = (
    "mutates an input in place that is no buffer, or a buffer in a way its region cannot own (torch 2.13's "
    "invoke_subgraph cannot train through that; inline, AOTAutograd functionalizes it)"
)

UNANALYSED = "its body could not be traced to ATen for these checks (inline is always right)"

SYMBOLIC_FLOAT = (
    "takes a float Dynamo made symbolic (an attribute its body reads changed between compiles, which automatic "
    "dynamic then traces as a SymFloat), and torch 2.13's invoke_subgraph takes no SymFloat operand: inline in "
    "this graph"
)


@dataclasses.dataclass
class RegionDecision:
    """One region call site: ``region`` is the function's name (``fsdp_compile_region_<kind index>``, see
    ``capture.install_regions``), ``why`` is None where the call stayed a region."""

    region: str | None
    subgraph: str
    why: str | None
    graph: int = 0  # which of the step's Dynamo graphs (a recompile: a later one) holds the call


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
    if refuse is None:
        _own_buffers(gm, fake_mode, verdicts)
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
            why = verdicts[key] or _returns_subclass(body)
            if why == RANDOM_UNDER_CHECKPOINT and not under_checkpoint:
                why = None
            why = why or _symbolic_float(node)
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


def _symbolic_float(node: fx.Node) -> str | None:
    """``SYMBOLIC_FLOAT`` where a region call takes a SymFloat operand (AOTAutograd would refuse it: "invoke_subgraph
    operands must be a list of tensors/ints/SymInts/Generator")."""
    for arg in node.args[2:]:
        if isinstance(arg, fx.Node) and isinstance(arg.meta.get("example_value"), torch.SymFloat):
            return SYMBOLIC_FLOAT
    return None


def _own_buffers(gm: fx.GraphModule, fake_mode, verdicts: dict) -> None:
    """Give every region body that writes a buffer in place its own copy of it (``_own_copies``), written
    back after each call (``_write_back``); ``verdicts`` gets the verdict on each other body analysed here.

    Only where every call of the body is in ``gm`` itself (under a checkpoint, the checkpoint's body would
    write the buffer) and each operand written is an input of ``gm`` that needs no gradient (a buffer: a
    parameter is gathered in the graph, an activation computed there) and shares no storage with another
    operand of the call (that one would be read stale). Only the buffers a kind of block writes pay a copy,
    known from the ATen trace that decides on the region anyway: the others are read in place."""
    calls: dict[int, list[fx.Node]] = {}
    nested: set[int] = set()
    for sub in gm.modules():
        if not isinstance(sub, fx.GraphModule):
            continue
        for node in sub.graph.find_nodes(op="call_function", target=_INVOKE_SUBGRAPH):
            if sub is gm:
                calls.setdefault(id(_attr(gm, node.args[0])), []).append(node)
            else:
                nested.add(id(_attr(sub, node.args[0])))
    for key, nodes in calls.items():
        body = _attr(gm, nodes[0].args[0])
        try:
            _, written, random = _analyse(body, fake_mode)
        except Exception:  # noqa: BLE001  _walk analyses it again, and says why
            continue
        indices = sorted(written)
        if (not written or key in nested or not all(written.values())
                or not all(_owned(call, i) for call in nodes for i in indices)):
            verdicts[key] = _verdict(written, random)
            continue
        _own_copies(body, indices)
        for call in nodes:
            _write_back(gm, call, body, indices)
        # _walk traces the new body again: its verdict, and the ATen form AOTAutograd's schema reads


def _owned(call: fx.Node, i: int) -> bool:
    """Whether operand ``i`` of the region call ``call`` is a buffer its region may own (``_own_buffers``)."""
    operands = call.args[2:]
    operand = operands[i]
    if not isinstance(operand, fx.Node) or operand.op != "placeholder":
        return False
    value = operand.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or value.requires_grad or isinstance(value, nn.Parameter):
        return False
    others = [o for j, o in enumerate(operands) if j != i and isinstance(o, fx.Node)]
    return all(o is not operand and _storage(o.meta.get("example_value")) != _storage(value) for o in others)


def _own_copies(body: fx.GraphModule, indices: list[int]) -> None:
    """Rewrite ``body`` (in place) to work on a copy of each of its inputs ``indices``, made before anything
    reads it, and to return the copies' final values after its own outputs, in that order."""
    placeholders = list(body.graph.find_nodes(op="placeholder"))
    first = next(n for n in body.graph.nodes if n.op != "placeholder")
    copies = []
    for i in indices:
        with body.graph.inserting_before(first):
            copy = body.graph.call_method("clone", (placeholders[i],))
        copy.meta = {k: v for k, v in placeholders[i].meta.items() if k in ("example_value", "stack_trace")}
        placeholders[i].replace_all_uses_with(copy, delete_user_cb=lambda user, copy=copy: user is not copy)
        copies.append(copy)
    output = body.graph.output_node()
    output.args = (tuple(output.args[0]) + tuple(copies),)
    body.graph.lint()
    body.recompile()


def _write_back(gm: fx.GraphModule, call: fx.Node, body: fx.GraphModule, indices: list[int]) -> None:
    """Around ``call`` (its body rewritten by ``_own_copies``): hand it a copy of each buffer it writes, and
    copy each new value into its buffer right after it, in place. The copy: invoke_subgraph's backward holds
    on to every operand, and the write would bump the buffer's version under it ("modified by an inplace
    operation")."""
    n = len(body.graph.output_node().args[0]) - len(indices)  # the body's own outputs, then the copies
    values = call.meta.get("example_value")
    operands = list(call.args[2:])
    cursor = call
    for k, i in enumerate(indices):
        buffer = operands[i]
        value = buffer.meta["example_value"]
        with gm.graph.inserting_before(call):
            operands[i] = gm.graph.call_method("clone", (buffer,))
        with gm.graph.inserting_after(cursor):
            new = gm.graph.call_function(operator.getitem, (call, n + k))
        with gm.graph.inserting_after(new):
            cursor = gm.graph.call_method("copy_", (buffer, new))
        with value.fake_mode if hasattr(value, "fake_mode") else contextlib.nullcontext():
            operands[i].meta["example_value"] = torch.empty_strided(
                value.shape, value.stride(), dtype=value.dtype, device=value.device)
            new.meta["example_value"] = torch.empty_strided(
                value.shape, value.stride(), dtype=value.dtype, device=value.device)
        cursor.meta["example_value"] = value
        if isinstance(values, (tuple, list)):
            values = (*values, new.meta["example_value"])
    call.args = (*call.args[:2], *operands)
    if values is not None:
        call.meta["example_value"] = values
    gm.graph.lint()
    gm.recompile()


def _returns_subclass(body: fx.GraphModule) -> str | None:
    """RETURNS_SUBCLASS where an output of ``body`` (Dynamo's example values) is a tensor subclass. Its
    DTensor parameters enter as plain local tensors (``capture/boundary.py``); its outputs are not flattened."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    for out in body.graph.output_node().args[0]:
        value = out.meta.get("example_value") if isinstance(out, fx.Node) else None
        if is_traceable_wrapper_subclass(value):
            return RETURNS_SUBCLASS.format(kind=type(value).__name__)
    return None


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
        _, written, random = _analyse(body, fake_mode)
    except Exception as e:  # noqa: BLE001  what cannot be analysed is not trusted: inline is always right
        return f"{UNANALYSED}: {quoted(e, 200)}"
    return _verdict(written, random)


def _verdict(written: dict, random: bool) -> str | None:
    if written:
        return MUTATES_INPUT
    if random:
        return RANDOM_UNDER_CHECKPOINT
    return None


def _analyse(body: fx.GraphModule, fake_mode) -> tuple[fx.GraphModule, dict[int, bool], bool]:
    """``(ATen form, written, random)``: ``written`` maps each input of ``body`` that it writes in place to
    whether the write is a plain value update its region can own (``_own_copies``): no change of metadata
    (``resize_``, ``t_``, ...), and the input keeps ``requires_grad=False`` (no autograd history written in)."""
    aten, fakes = _to_aten(body, fake_mode)
    inputs: dict[int, list[int]] = {}
    for i, p in enumerate(aten.graph.find_nodes(op="placeholder")):
        if _storage(p.meta.get("val")) is not None:
            inputs.setdefault(_storage(p.meta["val"]), []).append(i)
    written: dict[int, bool] = {}
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
                plain = torch.Tag.inplace_view not in node.target.tags and node.target._schema.name not in _RESIZING
                for i in _written_inputs(node, inputs):
                    written[i] = written.get(i, True) and plain
    for i in written:
        grad = isinstance(fakes[i], torch.Tensor) and fakes[i].requires_grad
        written[i] = written[i] and not grad
    return aten, written, random


_RESIZING = ("aten::resize_", "aten::resize_as_", "aten::set_", "aten::as_strided_")


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
    return aten, fakes


def _written_inputs(node: fx.Node, inputs: dict[int, list[int]]) -> list[int]:
    """The indices of the inputs into whose storage ``node`` (a mutable ATen op) writes (``inputs``: storage ->
    the indices of the inputs on it)."""
    out = []
    for arg, schema in zip(node.args, node.target._schema.arguments):
        if schema.is_write and isinstance(arg, fx.Node):
            out.extend(inputs.get(_storage(arg.meta.get("val")), ()))
    return out


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
