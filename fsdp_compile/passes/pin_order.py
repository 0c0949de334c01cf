"""Order pinning: make Inductor keep the collective schedule the other passes chose.

Inductor's scheduler is free to move a ``wait_tensor`` up to its collective (measured: it puts each
wait right after its all-gather, undoing every prefetch). Two kinds of control dependency, both
following the graph's current order (so they cannot form a cycle), hold the overlap in place: a
collective comes before the first matmul-like op after it, and a wait after the last matmul-like op
before it. They use Inductor's own ``control_deps`` mechanism, which its overlap scheduler uses too.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fsdp_compile.passes import predicates as P

aten = torch.ops.aten

# Matmul-like ops: Inductor runs them as extern kernels (never fused), so pinning them costs nothing.
ANCHORS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default, aten.convolution.default,
})


def pin_collective_order(gm: fx.GraphModule) -> int:
    """Add the control dependencies in place (recompiling ``gm``); returns how many edges were added."""
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering
    from torch.utils._ordered_set import OrderedSet

    deps: dict[fx.Node, OrderedSet] = {}
    pending: list[fx.Node] = []  # collectives issued since the last anchor
    last_anchor = None
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if P.is_collective(node):
            pending.append(node)
        elif P.is_wait(node):
            if last_anchor is not None:
                deps.setdefault(node, OrderedSet()).add(last_anchor)
        elif node.target in ANCHORS:
            for coll in pending:
                deps.setdefault(node, OrderedSet()).add(coll)
            pending.clear()
            last_anchor = node
    if deps:
        preserve_node_ordering(gm.graph, deps)
        gm.recompile()
    return sum(len(v) for v in deps.values())
