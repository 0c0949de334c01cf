"""Recompute tagging, a joint-graph pass: ``reshard_after_forward=True`` re-gathers in backward.

Every node of such a group's unshard chain (copy-in, all-gather, wait, copy-out) becomes
``MUST_RECOMPUTE``, so the partitioner saves only the local shards and replays the chain in backward, as
FSDP2's pre-backward unshard does. Groups with ``reshard_after_forward=False`` keep the partitioner's
default for collectives (``force_save_collectives``: the gathered buffer is saved for backward).

Regions (``capture``'s repeated blocks, ``invoke_subgraph``) need one more step first. AOTAutograd
partitions a region on its own, and its forward part hands its inputs (the gathered parameters) and views
of them to its backward part as saved values; at top level those are outputs of the forward region call,
which the partitioner must save, so nothing would be re-gathered and every block's full parameters would
live from forward to backward. ``_rewire_region_inputs`` gives each backward region call the top-level
value instead (re-applying the view chain at top level): the same tensor, which the tags then recompute.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_compile._annotations import chains, fsdp_group

_invoke_subgraph = torch.ops.higher_order.invoke_subgraph
_aten = torch.ops.aten
_VIEWS = {
    _aten.t.default, _aten.view.default, _aten.transpose.int, _aten.permute.default, _aten.alias.default,
    _aten.unsqueeze.default, _aten.squeeze.dim, _aten.expand.default, _aten.slice.Tensor, _aten.select.int,
    _aten.reshape.default, _aten._reshape_alias.default, _aten.as_strided.default,
}


def tag_unshard_recompute(graph: fx.Graph, reshard: Mapping[str, bool]) -> int:
    """Tag, in place, the unshard chains of the FSDP groups ``reshard`` maps to True; returns the count."""
    if graph.owning_module is not None:
        _rewire_region_inputs(graph.owning_module)
    tagged = 0
    for node in chains(graph)[0]:
        if reshard.get(fsdp_group(node), False):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            tagged += 1
    return tagged


def _as_input(out: fx.Node) -> tuple[int, list[fx.Node]] | None:
    """``(placeholder index, view nodes from it to out)`` if ``out`` is a subgraph input or a view chain of one."""
    chain = []
    while out.op == "call_function" and out.target in _VIEWS:
        chain.append(out)
        out = out.args[0]
    if out.op != "placeholder":
        return None
    return list(out.graph.find_nodes(op="placeholder")).index(out), chain[::-1]


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
            if not isinstance(value, fx.Node) or value not in unshard:
                continue
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
