"""FSDP composed with tensor and sequence parallelism, on the fake process group (no real ranks): the plan
reads each TP parameter's local layout and spec, the report counts collectives per mesh dim, HSDP+TP puts
each collective on its own dim's group, and what FSDP2 itself refuses is refused by name. The numerics
against eager FSDP2+TP run on 4 gloo ranks in ``test_tp_multirank.py``."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import fsdp_compile as fc
from dist_helpers import fake_process_group
from tp_cases import TPCase, build


def _explain(case: TPCase, world: int, rank: int):
    with fake_process_group(world, rank=rank):
        model, mesh = build(case)
        tokens = torch.randint(0, 256, (2, 16))
        return fc.explain(model, tokens, config=fc.CompileConfig(backend="aot_eager", bucket="fsdp_group")), model


def test_plan_reads_tensor_parallel_layout():
    with fake_process_group(4, rank=1):
        from fsdp_compile.plan import read_plan

        model, _ = build(TPCase(model="llama"))
        plan = read_plan(model)
        wq = next(p for g in plan.groups for p in g.params if p.fqn == "layers.0.attention.wq.weight")
        wo = next(p for g in plan.groups for p in g.params if p.fqn == "layers.0.attention.wo.weight")
        norm = next(p for g in plan.groups for p in g.params if p.fqn == "layers.0.attention_norm.weight")
        # FSDP gathers the TP-local tensor; the module gets the DTensor of the TP plan back
        assert wq.full_shape == (32, 64) and wq.parallel.shape == (64, 64) and wq.parallel.placements == (Shard(0),)
        assert wo.full_shape == (64, 32) and wo.parallel.placements == (Shard(1),)
        assert norm.full_shape == (64,) and norm.parallel.placements == (Replicate(),)
        assert plan.group("layers.0").world_size == 2  # the dp dim only
        assert set(plan.mesh_dim_of_groups().values()) == {"dp", "tp"}
        fingerprint = plan.fingerprint()[1]["params"]
        assert {p["parallel"] for p in fingerprint} == {"tp=Shard(dim=0)", "tp=Shard(dim=1)", "tp=Replicate()"}


def test_explain_counts_collectives_per_mesh_dim(tmp_path):
    """torchtitan's Llama plan with sequence parallelism: FSDP's collectives on dp, TP's on tp, and FSDP2's
    redistribute of the norms' Partial gradients (all-reduces over tp) in the same backward graph."""
    report, _ = _explain(TPCase(model="llama"), 4, 2)
    assert report.graph_breaks == 0 and report.dynamo_graphs == 1
    dims = report.collectives_by_mesh_dim
    # 3 FSDP modules (2 blocks + root), reshard_after_forward=True: gathered in forward, again in backward
    assert dims["dp"] == {"all_gathers": 6, "reduce_scatters": 3, "all_reduces": 0}
    # sequence parallel: per block 2 all-gathers (into attention, into the MLP) and 2 reduce-scatters (out of
    # them), 1 more each for the output; their transposes in backward; the 5 norms' gradients all-reduced
    assert dims["tp"] == {"all_gathers": 10, "reduce_scatters": 10, "all_reduces": 5}
    assert "on mesh dim `tp`: 10 all-gathers, 10 reduce-scatters, 5 all-reduces" in report.to_markdown()
    # the timeline: TP's collectives on their own lane, named by the mesh dim, beside FSDP's
    report.save_timeline(str(tmp_path / "timeline.html"))
    page = (tmp_path / "timeline.html").read_text()
    assert "comm tp (pg" in page and "comm dp (pg" in page


def test_hsdp_with_tensor_parallel_groups():
    """HSDP + TP on a (replicate 2, shard 2, tp 2) mesh of 8 ranks: all-gathers and reduce-scatters on the
    shard dim, the gradient all-reduce on the replicate dim, TP's collectives on tp."""
    report, model = _explain(TPCase(model="llama", replicate=2), 8, 5)
    dims = report.collectives_by_mesh_dim
    assert dims["shard"] == {"all_gathers": 6, "reduce_scatters": 3, "all_reduces": 0}
    assert dims["replicate"] == {"all_gathers": 0, "reduce_scatters": 0, "all_reduces": 3}
    assert dims["tp"]["all_gathers"] == 10
    placements = {str(p.placements) for p in model.parameters()}
    assert "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))" in placements


def test_int_reshard_after_forward_with_tensor_parallel_refused():
    """FSDP2's own post-forward reshard refuses DTensor parameters (``to_sharded_post_forward``): so do we,
    at compile, naming the option and the parameter."""
    with fake_process_group(8, rank=0):
        model, _ = build(TPCase(model="mlp", reshard=2))
        with pytest.raises(NotImplementedError, match=r"reshard_after_forward=2 \(an int\) with parameter 'blocks.0.0.weight'"):
            fc.compile(model)


def test_schedule_moves_fsdp_collectives_not_tp_ones():
    """A schedule that prefetches and defers FSDP's collectives (reorder=True, priced for h100-ib at 16 ranks:
    dp 8 x tp 2) leaves TP's where the model issues them: the same order, after the same compute, as in
    the capture without any schedule."""
    from fsdp_compile.debug import explain_graphs
    from fsdp_compile.passes.predicates import collective_kind, fsdp_meta, process_group_name

    def tp_sequence(config):
        with fake_process_group(16, rank=3):
            model, _ = build(TPCase(model="llama"))
            report, captured = explain_graphs(model, torch.randint(0, 256, (2, 16)), config=config)
            dims = report.mesh_dims
            seqs = []
            for g in captured.forward[:1] + captured.backward[:1]:
                nodes = list(g.graph.nodes)
                # each TP collective with the op right before it that is neither a collective nor FSDP's
                seqs.append([
                    (collective_kind(n), next(p.target for p in reversed(nodes[:i])
                                              if p.op == "call_function" and not collective_kind(p) and fsdp_meta(p) is None))
                    for i, n in enumerate(nodes) if collective_kind(n) and dims.get(process_group_name(n)) == "tp"
                ])
            return seqs, sum(len(r["moves"]) for r in report.graphs)

    planned, moves = tp_sequence(fc.CompileConfig(backend="aot_eager", bucket="fsdp_group", reorder=True, hardware="h100-ib"))
    placed, none = tp_sequence(fc.CompileConfig(backend="aot_eager", bucket="fsdp_group", reorder=False))
    assert moves > 0 and none == 0
    assert len(planned[0]) == 10  # sequence parallel: 5 all-gathers, 5 reduce-scatters in forward
    assert planned == placed


@pytest.mark.parametrize("tied", ["after", "before"])
def test_tied_weights_reduced_as_eager(tied):
    """Tied embedding and output weights under TP. Tied again after fully_shard (torchtitan's
    ``Decoder.init_states``), FSDP2 holds two FSDP parameters that its lazy init points at the one
    parameter: eager gathers each, hands each module its own, reduce-scatters each gradient on its own
    and adds them after. So must the compiled step: both stay in the plan, each named by and put at its
    own place, and the backward's reduce-scatter takes the two gradients apart, not their sum (which
    rounds differently: 7.5e-9 in fp32, 2.4e-4 in bf16, torchtitan's Llama3 at TP 2 x FSDP 2). Tied
    again before fully_shard, it is one FSDP parameter whose unsharded gradient autograd sums first, as
    eager does."""
    import torch.nn.functional as F
    from torch.distributed.tensor.parallel import loss_parallel

    with fake_process_group(4, rank=1):
        model, _ = build(TPCase(model="llama", tied=tied, mp="bf16"))
        compiled = fc.compile(model, backend="aot_eager", bucket="fsdp_group", reorder=False)
        tokens = torch.randint(0, 256, (2, 16))
        with loss_parallel():
            F.cross_entropy(compiled(tokens).flatten(0, 1).float(), tokens.flatten()).backward()
        (root,) = [g for g in compiled.plan.groups if g.fqn == ""]
        bw = compiled.captured.backward[0].graph
    heads = [(p.fqn, p.places) for p in root.params if p.fqn != "norm.weight"]
    (copy_in,) = [n for n in bw.nodes if n.target == torch.ops.fsdp_compile.reduce_scatter_copy_in.default
                  and len(n.args[0]) == len(root.params)]
    grads = [a for a, p in zip(copy_in.args[0], root.params) if p.fqn != "norm.weight"]
    if tied == "after":
        assert heads == [("tok_embeddings.weight", ("tok_embeddings.weight",)), ("output.weight", ("output.weight",))]
        # the embedding's gradient (embedding_dense_backward's rows) and the output's (a matmul), apart
        assert all(g.target != torch.ops.aten.add.Tensor for g in grads), grads
    else:
        assert heads == [("tok_embeddings.weight", ())]
        assert grads[0].target == torch.ops.aten.add.Tensor  # summed by autograd before the reduce-scatter
