"""Placement: every collective where FSDP2's hooks issue it, the starting point of every later pass.

AOTAutograd leaves the all-gathers where the joint graph had them: the forward's at each group's
``unshard`` call, and the ones recomputed for ``reshard_after_forward`` all at the top of the backward,
which would hold every group's full parameters at once. And since the capture issues all unshards
before any compute, autograd's sequence-number priority runs their backward, the reduce-scatters, after
all compute: every unsharded gradient would live to the end. So each unshard-chain node sinks to just
before its first user (last node first), which is where FSDP2's pre-forward / pre-backward hook issues
the all-gather, and each reduce-scatter-chain node rises to just after its last input (first node
first), where its post-backward hook issues the reduce-scatter.

A chain node that only the graph's output reads (a value saved for backward) rises to just after its
inputs instead. An unshard chain whose gathered values nobody reads is dropped first
(``drop_unread_unshards``): the partitioner keeps collectives as side effects, so the backward's re-gather
over the post-forward group of an int ``reshard_after_forward`` (``recompute.py``) would also run, unread,
in the forward.

A pure function of the graph, so every rank makes the same moves and the collectives keep one order on
all ranks.
"""

from __future__ import annotations

import torch.fx as fx

from fsdp_compile._annotations import chains


def drop_unread_unshards(graph: fx.Graph) -> int:
    """Erase the unshard-chain nodes whose results nobody reads (last first); returns how many."""
    unshard = chains(graph)[0]
    dropped = 0
    for node in reversed(list(graph.nodes)):
        if node in unshard and not node.users:
            graph.erase_node(node)
            dropped += 1
    return dropped


def place_collectives(graph: fx.Graph) -> int:
    """Move the FSDP chains in place (see the module docstring); returns how many nodes moved.

    Linear in the graph: nodes compare by position (``fx.Node``'s ``<``, kept up to date by every move),
    so no position map is rebuilt per move."""
    drop_unread_unshards(graph)
    unshard, reduce = chains(graph)
    # read by the graph's output only (saved for backward: an int reshard_after_forward's post-forward shard)
    saved = [n for n in graph.nodes if n in unshard and n.users and all(u.op == "output" for u in n.users)]
    is_saved = set(saved)
    moved = 0
    for node in reversed(list(graph.nodes)):
        if node not in unshard or node in is_saved:
            continue
        users = [u for u in node.users if u not in is_saved]
        if users:
            first = min(users)
            if first.prev is not node:
                first.prepend(node)
                moved += 1
    for node in saved:  # taken as soon as it can be, so the buffer it comes from is freed at its last use
        last = max(node.all_input_nodes, default=None)
        if last is not None and last.next is not node:
            last.append(node)
            moved += 1
    for node in list(graph.nodes):
        if node in reduce:
            last = max(node.all_input_nodes, default=None)
            if last is not None and last.next is not node:
                last.append(node)
                moved += 1
    graph.lint()
    return moved
