"""Unit tests of the small passes on hand-built graphs: placement, recompute tagging, order pinning.

Each graph is a few nodes written out below, annotated as the capture annotates its ops' chains (copy-in,
all-gather, wait, copy-out; reduce-scatter and its wait), so the expected result can be read off by hand.
No process group and no trace: the passes are pure functions of the graph.
"""

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_compile._annotations import KEY, REDUCE_SCATTER, UNSHARD
from fsdp_compile.passes.pin_order import pin_collective_order
from fsdp_compile.passes.placement import drop_unread_unshards, place_collectives
from fsdp_compile.passes.recompute import tag_unshard_recompute

aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def _call(g: fx.Graph, name: str, target, *args, kind: str | None = None, group: str = "", unit: int = 0) -> fx.Node:
    node = g.call_function(target, args)
    node.name = name
    if kind is not None:
        node.meta["custom"] = {KEY: {"kind": kind, "group": group, "bucket": (group,), "unit": unit}}
    return node


def _unshard_chain(g: fx.Graph, shard: fx.Node, group: str, unit: int, tag: str) -> fx.Node:
    """copy-in, all-gather over 2 ranks, wait, copy-out (a view), annotated as ``group``'s unshard."""
    kw = dict(kind=UNSHARD, group=group, unit=unit)
    copy_in = _call(g, f"copy_in{tag}", aten.clone.default, shard, **kw)
    gathered = _call(g, f"ag{tag}", c10d.all_gather_into_tensor.default, copy_in, 2, "0", **kw)
    wait = _call(g, f"wait{tag}", c10d.wait_tensor.default, gathered, **kw)
    return _call(g, f"copy_out{tag}", aten.view.default, wait, [4, 4], **kw)


def _names(g: fx.Graph) -> list[str]:
    return [n.name for n in g.nodes if n.op == "call_function"]


def _forward_graph() -> fx.Graph:
    """Both blocks' unshard chains at the top, as the capture issues them, then the blocks' compute."""
    g = fx.Graph()
    x, s0, s1 = g.placeholder("x"), g.placeholder("s0"), g.placeholder("s1")
    w0 = _unshard_chain(g, s0, "layers.0", 0, "0")
    w1 = _unshard_chain(g, s1, "layers.1", 1, "1")
    y0 = _call(g, "mm0", aten.mm.default, x, w0)
    y1 = _call(g, "mm1", aten.mm.default, y0, w1)
    g.output((y1,))
    return g


def test_unshards_sink_to_their_first_use():
    g = _forward_graph()
    assert place_collectives(g) == 4  # block 1's chain; block 0's already ends right before its use
    assert _names(g) == ["copy_in0", "ag0", "wait0", "copy_out0", "mm0", "copy_in1", "ag1", "wait1", "copy_out1", "mm1"]
    assert place_collectives(g) == 0  # a fixed point


def test_unread_unshards_are_dropped_and_saved_ones_rise():
    g = fx.Graph()
    x, s0, s1 = g.placeholder("x"), g.placeholder("s0"), g.placeholder("s1")
    _unshard_chain(g, s0, "layers.0", 0, "0")  # nobody reads it
    _call(g, "mm", aten.mm.default, x, x)
    saved = _call(g, "kept", aten.clone.default, s1, kind=UNSHARD, group="layers.1", unit=1)
    out = _call(g, "mm2", aten.mm.default, x, x)
    g.output((out, saved))  # read by the output only: a value saved for backward
    assert drop_unread_unshards(g) == 4
    place_collectives(g)
    # the unread chain is gone; the saved value rises to just after its input (the placeholders)
    assert _names(g) == ["kept", "mm", "mm2"]


def test_reduce_scatters_rise_to_just_after_their_gradient():
    g = fx.Graph()
    x, tangent = g.placeholder("x"), g.placeholder("tangents_1")
    grad1 = _call(g, "grad1", aten.mm.default, tangent, x)
    grad0 = _call(g, "grad0", aten.mm.default, grad1, x)
    more = _call(g, "more", aten.mm.default, grad0, x)
    kw = dict(kind=REDUCE_SCATTER, group="layers.1", unit=1)
    rs = _call(g, "rs1", c10d.reduce_scatter_tensor.default, grad1, "avg", 2, "0", **kw)
    wait = _call(g, "wait_rs1", c10d.wait_tensor.default, rs, **kw)
    g.output((more, wait))
    assert place_collectives(g) == 2
    assert _names(g) == ["grad1", "rs1", "wait_rs1", "grad0", "more"]


def test_recompute_tags_the_chains_of_resharded_groups_only():
    g = _forward_graph()
    chain0 = [n for n in g.nodes if n.name.endswith("0") and n.name != "mm0" and n.op == "call_function"]
    chain0[0].meta["recompute"] = CheckpointPolicy.PREFER_SAVE  # already tagged (activation checkpointing)
    assert tag_unshard_recompute(g, {"layers.0": True, "layers.1": False}) == 3
    assert [n.meta.get("recompute") for n in chain0] == [CheckpointPolicy.PREFER_SAVE] + [CheckpointPolicy.MUST_RECOMPUTE] * 3
    assert not any("recompute" in n.meta for n in g.nodes if n.name.endswith("1"))
    assert not any("recompute" in n.meta for n in g.nodes if n.name.startswith("mm"))


def test_pinning_holds_each_prefetch_behind_compute():
    """all-gather, mm, wait, mm: the first mm must follow the all-gather and the wait the first mm, so
    Inductor cannot pull the wait up to its collective; nothing else is pinned."""
    from torch._inductor.fx_passes.control_dependencies import control_deps

    g = fx.Graph()
    x, s = g.placeholder("x"), g.placeholder("s")
    ag = _call(g, "ag", c10d.all_gather_into_tensor.default, s, 2, "0")
    first = _call(g, "mm_a", aten.mm.default, x, x)
    wait = _call(g, "wait", c10d.wait_tensor.default, ag)
    _call(g, "mm_b", aten.mm.default, first, wait)
    gm = fx.GraphModule(torch.nn.Module(), g)
    g.output((list(gm.graph.nodes)[-1],))
    gm.recompile()
    assert pin_collective_order(gm) == 2
    pinned = {n.name: [d.name for d in n.args[0]] for n in gm.graph.nodes if n.target is control_deps}
    assert pinned == {"mm_a": ["ag"], "wait": ["mm_a"]}
    # both all-gathers issued before the first mm: it follows both; no mm precedes the waits
    both = fx.GraphModule(torch.nn.Module(), _forward_graph())
    assert pin_collective_order(both) == 2
    assert {n.name: sorted(d.name for d in n.args[0]) for n in both.graph.nodes if n.target is control_deps} == {"mm0": ["ag0", "ag1"]}
