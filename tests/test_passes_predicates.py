"""Node predicates on real captured graphs (4-layer Llama, fake process group, world sizes 2, 8, 1024).

A 4-layer Llama sharded per block and at the root has 5 FSDP groups. Forward: 5 all-gathers. Backward:
the 4 blocks re-gather (``reshard_after_forward=True``; the root keeps its parameters) and all 5 groups
reduce-scatter.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from fsdp_compile.passes import predicates as P
from passes_helpers import captured

GROUPS = ["", "layers.0", "layers.1", "layers.2", "layers.3"]


@pytest.mark.parametrize("world_size", [2, 8, 1024])
def test_counts_groups_and_order(world_size):
    fw, bw, plan = captured(world_size)
    assert [g.fqn for g in plan.groups] == GROUPS
    ag_fw = P.collectives(fw.graph, "all_gather")
    assert [P.fsdp_group(n) for n in ag_fw] == GROUPS
    assert P.collectives(fw.graph, "reduce_scatter") == []
    ag_bw = P.collectives(bw.graph, "all_gather")
    rs_bw = P.collectives(bw.graph, "reduce_scatter")
    assert [P.fsdp_group(n) for n in ag_bw] == GROUPS[:0:-1]  # layers.3 .. layers.0
    assert [P.fsdp_group(n) for n in rs_bw] == GROUPS[::-1]  # layers.3 .. layers.0, root
    for n in ag_fw + ag_bw + rs_bw:
        assert P.is_collective(n) and P.fsdp_meta(n) is not None
        assert P.collective_kind(n) != "all_reduce"
    assert all(P.is_all_gather(n) and not P.is_reduce_scatter(n) for n in ag_fw + ag_bw)
    assert all(P.is_reduce_scatter(n) and P.collective_kind(n) == "reduce_scatter" for n in rs_bw)


@pytest.mark.parametrize("world_size", [2, 8, 1024])
def test_sizes_world_and_group(world_size):
    fw, bw, plan = captured(world_size)
    for g in (fw.graph, bw.graph):
        for n in P.collectives(g):
            group = plan.group(P.fsdp_group(n))
            assert P.world_size(n) == world_size
            assert P.process_group_name(n) == group.group_name
            # all-gather: input bytes x W = the group's padded unsharded bytes; reduce-scatter: its input
            assert P.collective_bytes(n) == group.unsharded_bytes
            assert n.args[0].meta["val"].dtype == torch.float32
            if P.is_reduce_scatter(n):
                assert P.reduce_op(n) == group.reduce_op == "avg"
                assert P.collective_bytes(n) == P.node_bytes(n.args[0])
            else:
                assert P.reduce_op(n) is None
                assert P.collective_bytes(n) == P.node_bytes(n.args[0]) * world_size == P.node_bytes(n)


@pytest.mark.parametrize("world_size", [2, 1024])
def test_wait_pairs_and_copies(world_size):
    fw, bw, _ = captured(world_size)
    for gm in (fw, bw):
        g = gm.graph
        waits = [n for n in g.nodes if P.is_wait(n)]
        assert len(waits) == len(P.collectives(g))
        for w in waits:
            c = P.collective_of(w)
            assert c is not None and P.wait_of(c) is w
            assert P.fsdp_group(w) == P.fsdp_group(c)
            # the collective's input is its group's copy-in (cat / clone / pack view), its wait's users the
            # copy-out: annotated for the same group, and neither a collective nor a wait
            for x in (c.args[0], *w.users):
                assert x.op == "call_function" and P.fsdp_group(x) == P.fsdp_group(c) in GROUPS
                assert not P.is_collective(x) and not P.is_wait(x)
        assert P.collective_of(waits[0].args[0]) is None  # not a wait
        assert P.wait_of(next(iter(g.nodes))) is None


def test_recomputed_all_gathers_do_not_depend_on_tangents():
    _, bw, _ = captured(8)
    grad_side = P.gradient_dependent(bw.graph)
    assert all(n not in grad_side for n in P.collectives(bw.graph, "all_gather"))
    assert all(n in grad_side for n in P.collectives(bw.graph, "reduce_scatter"))


def test_non_collectives_rejected():
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.call_function(torch.ops.aten.relu.default, (x,))
    g.output(y)
    assert P.collective_kind(y) is None and P.fsdp_group(y) is None and P.fsdp_groups(y) == ()
    for fn in (P.collective_bytes, P.world_size, P.process_group_name):
        with pytest.raises(ValueError, match="relu"):
            fn(y)


def test_one_copy_out_op_per_all_gather():
    """kernels="torch" (CPU's default): each gathered buffer goes to its parameters through one
    ``fsdp_compile::all_gather_copy_out`` (FSDP2's split_with_sizes_copy), not a slice, clone and view per
    parameter, which tripled the graphs' nodes per block and Inductor's compile time with them (ops.py)."""
    fw, bw, _ = captured(8)
    copy_out = torch.ops.fsdp_compile.all_gather_copy_out.default
    for gm in (fw, bw):
        for ag in P.collectives(gm.graph, "all_gather"):
            (wait,) = ag.users
            assert [u.target for u in wait.users] == [copy_out], (ag.name, list(wait.users))
        assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]
