"""The annotation our ops leave on graph nodes, for the passes to read: its one home.

Every node of an unshard chain (copy-in, all-gather, wait, copy-out) and of a gradient reduce-scatter
chain (pack, reduce-scatter, wait, unpack) carries ``node.meta["custom"]["fsdp_compile"]``::

    {"kind": "unshard" | "reduce_scatter",
     "group": <the first FSDP module FQN, "" for the root>, "bucket": (<every FSDP module FQN>, ...),
     "unit": <the index of the schedule's unit: one all-gather and one reduce-scatter>}

AOTAutograd copies a
forward op's annotation onto the backward nodes it derives, so a reduce-scatter chain may carry
``"kind": "unshard"``: whether a node is gradient-side is decided by the graph (``gradient_dependent``),
never by the kind alone. A leaf module: ``ops`` writes the annotation, ``passes`` read it, and neither
imports the other.
"""

from __future__ import annotations

import torch.fx as fx
import torch.fx.traceback as fx_traceback

KEY = "fsdp_compile"
UNSHARD = "unshard"
REDUCE_SCATTER = "reduce_scatter"


def annotate(kind: str, groups: tuple[str, ...], unit: int = -1):
    """Context manager: nodes traced inside it serve the FSDP modules ``groups`` as schedule unit ``unit``."""
    return fx_traceback.annotate({KEY: {"kind": kind, "group": groups[0], "bucket": tuple(groups), "unit": unit}})


def fsdp_meta(node: fx.Node) -> dict | None:
    """The node's annotation, or None for nodes our ops did not produce."""
    return (node.meta.get("custom") or {}).get(KEY)


def fsdp_group(node: fx.Node) -> str | None:
    """The FSDP module FQN (``""`` for the root) whose chain holds ``node``; a bucket's first module."""
    meta = fsdp_meta(node)
    return None if meta is None else meta.get("group")


def fsdp_groups(node: fx.Node) -> tuple[str, ...]:
    """All FSDP modules a node serves: one for the capture's nodes, every member for a bucket's nodes."""
    meta = fsdp_meta(node)
    if meta is None:
        return ()
    return tuple(meta.get("bucket") or (meta["group"],))


def fsdp_unit(node: fx.Node) -> int | None:
    """The schedule unit whose chain holds ``node`` (None for nodes our ops did not produce)."""
    meta = fsdp_meta(node)
    return None if meta is None else meta.get("unit", -1)


def gradient_dependent(graph: fx.Graph) -> set[fx.Node]:
    """The ``tangents_*`` placeholders and every node computed from them: in a backward graph, the
    gradient side. An all-gather outside this set in a backward graph is a recomputed one."""
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def chains(graph: fx.Graph) -> tuple[set[fx.Node], set[fx.Node]]:
    """The annotated nodes split into (unshard chains, reduce-scatter chains).

    Unshard chain: computed from graph inputs alone (in a forward graph, or recomputed in a backward
    graph). Reduce-scatter chain: the decomposed backward of an unshard; it depends on gradients.
    """
    grad = gradient_dependent(graph)
    unshard, reduce = set(), set()
    for node in graph.nodes:
        meta = fsdp_meta(node)
        if meta and meta["kind"] in (UNSHARD, REDUCE_SCATTER) and node.op == "call_function":
            (reduce if node in grad else unshard).add(node)
    return unshard, reduce
