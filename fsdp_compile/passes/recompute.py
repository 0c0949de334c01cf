"""Recompute tagging, a joint-graph pass: ``reshard_after_forward=True`` re-gathers in backward.

Every node of such a group's unshard chain (copy-in, all-gather, wait, copy-out) becomes
``MUST_RECOMPUTE``, so the partitioner saves only the local shards and replays the chain in backward, as
FSDP2's pre-backward unshard does. Groups with ``reshard_after_forward=False`` keep the partitioner's
default for collectives (``force_save_collectives``: the gathered buffer is saved for backward).

An int ``reshard_after_forward=N`` (``_regather_from_post_forward``): after the forward all-gather this
rank keeps chunk ``i`` of ``N`` of the gathered buffer (``i``: its index in its post-forward group, N
consecutive ranks of the shard group, FSDP2's ``mesh.view(-1, N)``), saved for backward; the backward's
uses of the group's parameters read a re-gather of those chunks over the post-forward group: an all-gather
of N ranks instead of the whole group, the same buffer bit for bit, then the same copy-out. The chunk is a
slice of the packed buffer, not FSDP2's per-parameter re-padding over N ranks: the same bytes held and
moved, one copy fewer.

Regions (``capture``'s repeated blocks, ``invoke_subgraph``) need one more step first. AOTAutograd
partitions a region on its own, and its forward part hands its inputs (the gathered parameters) and views
of them to its backward part as saved values; at top level those are outputs of the forward region call,
which the partitioner must save, so nothing would be re-gathered and every block's full parameters would
live from forward to backward. ``_rewire_region_inputs`` gives each backward region call the top-level
value instead (re-applying the view chain at top level, or none where the chain gives the input's own layout
back: a Linear's backward saves its weight as ``t(t(w))``): the same tensor, which the tags then recompute.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_compile._annotations import chains, fsdp_group, gradient_dependent

_invoke_subgraph = torch.ops.higher_order.invoke_subgraph
_aten = torch.ops.aten
_VIEWS = {
    _aten.t.default, _aten.view.default, _aten.transpose.int, _aten.permute.default, _aten.alias.default,
    _aten.unsqueeze.default, _aten.squeeze.dim, _aten.expand.default, _aten.slice.Tensor, _aten.select.int,
    _aten.reshape.default, _aten._reshape_alias.default, _aten.as_strided.default,
}


def tag_unshard_recompute(graph: fx.Graph, reshard: Mapping[str, bool | tuple[str, int]]) -> int:
    """Tag, in place, the unshard chains of the FSDP groups ``reshard`` maps to True, and re-gather those it
    maps to a post-forward group ``(process group name, size)`` from it; returns how many
    chain nodes were tagged."""
    if graph.owning_module is not None:
        _rewire_region_inputs(graph.owning_module)
    post = {g: v for g, v in reshard.items() if isinstance(v, tuple)}
    if post:
        _regather_from_post_forward(graph, post)
    tagged = 0
    for node in chains(graph)[0]:
        if reshard.get(fsdp_group(node), False) is not False and "recompute" not in node.meta:
            # an int's own chain too: forward nodes that activation checkpointing replays in backward re-gather
            # over the whole group rather than keep the full parameters
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            tagged += 1
    return tagged


_c10d = torch.ops._c10d_functional


def _fake_call(graph: fx.Graph, target, args: tuple, like: fx.Node, policy) -> fx.Node:
    """A new node ``target(*args)`` with its fake value, ``like``'s annotation and the recompute ``policy``."""
    def val(a):
        return a.meta["val"] if isinstance(a, fx.Node) else a

    node = graph.call_function(target, args)
    with like.meta["val"].fake_mode:
        node.meta["val"] = target(*[val(a) for a in args])
    if "custom" in like.meta:
        node.meta["custom"] = like.meta["custom"]
    if policy is not None:
        node.meta["recompute"] = policy
    return node


def _param_only(node: fx.Node, derived: set[fx.Node]) -> bool:
    """A deterministic aten or prims op, our copy-out or a getitem, computed from gathered parameters alone:
    safe to replay."""
    if node.op != "call_function" or not node.all_input_nodes or any(a not in derived for a in node.all_input_nodes):
        return False
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target.name() in ("fsdp_compile::all_gather_copy_out", "fsdp_compile::unpack_payloads"):  # our copy-outs (kernels/, _payloads.py)
        return True
    return node.target.namespace in ("aten", "prims") and torch.Tag.nondeterministic_seeded not in node.target.tags


def _regather_from_post_forward(graph: fx.Graph, post: Mapping[str, tuple[str, int]]) -> int:
    """See the module docstring; returns how many units re-gather from their post-forward group."""
    unshard, grad = chains(graph)[0], gradient_dependent(graph)
    waits = {}  # the gathered buffer of each unit with a post-forward group
    for node in graph.nodes:
        if (node in unshard and node.target is _c10d.wait_tensor.default and fsdp_group(node) in post
                and node.args[0].target is _c10d.all_gather_into_tensor.default):
            waits[node] = post[fsdp_group(node)]
    derived = set(waits)  # the buffers and what is computed from them (and other such nodes) alone
    for node in graph.nodes:
        if node not in grad and node not in derived and _param_only(node, derived):
            derived.add(node)
    mirror: dict[fx.Node, fx.Node] = {}

    def mirrored(node: fx.Node, before: fx.Node) -> fx.Node:
        if node in mirror:
            return mirror[node]
        if node in waits:  # the chunk kept after forward, re-gathered before its first backward use
            name, n = waits[node]
            buf = node.meta["val"]
            with graph.inserting_after(node):  # fsdp_compile::post_forward_shard, an op of ours (see ops.py)
                kept = _fake_call(graph, torch.ops.fsdp_compile.post_forward_shard.default, (node, name), node,
                                  CheckpointPolicy.MUST_SAVE)
            with graph.inserting_before(before):
                ag = node.args[0]
                out = _fake_call(graph, _c10d.all_gather_into_tensor.default, (kept, n, name), ag,
                                 CheckpointPolicy.MUST_RECOMPUTE)
                out = _fake_call(graph, _c10d.wait_tensor.default, (out,), node, CheckpointPolicy.MUST_RECOMPUTE)
                out = _fake_call(graph, _aten.view.default, (out, list(buf.shape)), node,
                                 CheckpointPolicy.MUST_RECOMPUTE)
        else:
            inputs = {a: mirrored(a, before) for a in node.all_input_nodes}
            with graph.inserting_before(before):
                out = graph.node_copy(node, lambda a: inputs[a])
            out.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
        mirror[node] = out
        return out

    for node in list(graph.nodes):
        if node in grad and node.op == "call_function" and any(a in derived for a in node.all_input_nodes):
            for a in [a for a in node.all_input_nodes if a in derived]:
                node.replace_input_with(a, mirrored(a, node))
    graph.lint()
    return len({w for w in waits if w in mirror})


def _as_input(out: fx.Node) -> tuple[int, list[fx.Node]] | None:
    """``(placeholder index, view nodes from it to out)`` if ``out`` is a subgraph input or a view chain of one."""
    chain = []
    while out.op == "call_function" and out.target in _VIEWS:
        chain.append(out)
        out = out.args[0]
    if out.op != "placeholder":
        return None
    return list(out.graph.find_nodes(op="placeholder")).index(out), chain[::-1]


def _same_layout(a: fx.Node, b: fx.Node) -> bool:
    """Whether ``a``, a view chain of ``b``, has ``b``'s dtype, shape, strides and storage offset: the chain
    gives back ``b``'s own layout."""
    x, y = a.meta.get("val"), b.meta.get("val")
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        return False
    return (x.dtype == y.dtype and x.shape == y.shape and x.stride() == y.stride()
            and x.storage_offset() == y.storage_offset())


def _views_of_unshard(value, unshard: set[fx.Node]) -> list[fx.Node] | None:
    """The view nodes from an unshard chain node to ``value`` ([] where ``value`` is one), or None where it is
    not such a view: a TP parameter enters its region as the local tensor of the DTensor built on the gathered
    tensor (``capture/boundary.py``), two views of it in ATen."""
    views = []
    while isinstance(value, fx.Node) and value not in unshard and value.op == "call_function" and value.target in _VIEWS:
        views.append(value)
        value = value.args[0]
    return views if isinstance(value, fx.Node) and value in unshard else None


def _rewire_region_inputs(gm: fx.GraphModule) -> int:
    """Backward region calls take the forward region call's own inputs, not its pass-through outputs, for
    values of unshard chains (see the module docstring); returns how many arguments were rewired."""
    graph = gm.graph
    unshard = chains(graph)[0]
    rewired = 0
    for call in list(graph.nodes):
        if not (call.op == "call_function" and call.target is _invoke_subgraph):
            continue
        args = list(call.args)
        for j, a in enumerate(call.args[2:], start=2):
            if not (isinstance(a, fx.Node) and a.target is operator.getitem and a.args[0].target is _invoke_subgraph):
                continue
            producer, index = a.args
            outputs = getattr(gm, producer.args[0].target).graph.output_node().args[0]
            hit = _as_input(outputs[index])
            if hit is None:
                continue
            k, views = hit
            value = producer.args[2 + k]
            between = _views_of_unshard(value, unshard)
            if between is None:
                continue
            if views and _same_layout(views[-1], views[0].args[0]):  # t(t(w)), as a Linear's backward saves it: w
                views = []
            for view in between:  # recomputed from the chain, not saved (a saved view keeps its whole base)
                view.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            with graph.inserting_before(call):
                for view in views:
                    value = graph.call_function(view.target, (value, *view.args[1:]), dict(view.kwargs))
                    value.meta = {**view.meta, "recompute": CheckpointPolicy.MUST_RECOMPUTE}
            args[j] = value
            rewired += 1
        call.args = tuple(args)
    if rewired:
        graph.lint()
        gm.recompile()
    return rewired
