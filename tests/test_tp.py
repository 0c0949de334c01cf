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


def _explain(case: TPCase, world: int, rank: int, hook=None):
    with fake_process_group(world, rank=rank):
        model, mesh = build(case)
        if hook is not None:
            model.register_forward_pre_hook(hook)
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
    # the model's forward reads a block's TP parameter outside that block, as eager allows: during the step it
    # is the gathered DTensor there too (a region block's TP parameters are built at top level, not deferred
    # into the region as float8 weights are, which would leave None in its place: Dynamo's "Observed exception")
    seen = []
    report, _ = _explain(TPCase(model="llama"), 4, 2, hook=lambda m, args: seen.append(m.layers[0].attention.wq.weight.shape))
    assert seen == [torch.Size([64, 64])]
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


# 14 s: the fast tier keeps TP's per-dim counts (above) and HSDP's (test_capture::test_hsdp_reduces_then_all_reduces)
@pytest.mark.slow
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


# two captures (12 s): the fast tier keeps TP's capture (above) and the schedule's (test_capture, test_passes_*)
@pytest.mark.slow
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

    # regions off: TP's collectives in the top-level graphs, where the passes could move them (in a region's body,
    # the blocks' own, no pass reaches them)
    planned, moves = tp_sequence(fc.CompileConfig(backend="aot_eager", bucket="fsdp_group", reorder=True, hardware="h100-ib",
                                                  regions=False))
    placed, none = tp_sequence(fc.CompileConfig(backend="aot_eager", bucket="fsdp_group", reorder=False, regions=False))
    assert moves > 0 and none == 0
    assert len(planned[0]) == 10  # sequence parallel: 5 all-gathers, 5 reduce-scatters in forward
    assert planned == placed


# "before" (one FSDP parameter, the plain case) in the full suite only; the fast tier keeps "after"
@pytest.mark.parametrize("tied", ["after", pytest.param("before", marks=pytest.mark.slow)])
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


def _per_param_mesh_llama():
    """Each block's feed-forward weights on a 4-rank mesh (the efsdp dim of (efsdp, ep), as torchtitan's experts),
    the rest of the block over all 8 ranks, by ``shard_placement_fn``: two FSDP2 parameter groups per block."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult

    from models import Llama, LlamaArgs

    dp = init_device_mesh("cpu", (8,), mesh_dim_names=("fsdp",))
    sparse = init_device_mesh("cpu", (4, 2), mesh_dim_names=("efsdp", "ep"))
    torch.manual_seed(0)
    m = Llama(LlamaArgs(n_layers=2))
    infos = FSDPMeshInfo(sparse["efsdp"], shard_mesh_dim=0), FSDPMeshInfo(dp, shard_mesh_dim=0)  # one object per mesh
    for block in m.layers:
        experts = set(block.feed_forward.parameters())

        def place(p, experts=experts):
            return ShardPlacementResult(placement=Shard(0), mesh_info=infos[0] if p in experts else infos[1])

        fully_shard(block, mesh=dp, shard_placement_fn=place)
    fully_shard(m, mesh=dp)
    return m


@pytest.mark.slow  # out of the fast tier (its budget); the full suite runs it
def test_per_parameter_meshes_one_unit_per_group():
    """A module whose parameters FSDP2 keeps on two meshes (torchtitan's MoE blocks under expert parallelism)
    is two groups, named by the module and module@mesh dim: each one all-gather over its own process group,
    in FSDP2's order (forward: the module's groups in order; backward: reversed), bucketed only with groups of
    its own mesh, and FSDP2's setters apply to both. Bitwise against eager FSDP2: torchtitan's DeepSeek-V3 with
    expert parallelism, ``test_torchtitan_multirank``."""
    with fake_process_group(8, rank=1):
        model = _per_param_mesh_llama()
        tokens = torch.randint(0, 256, (2, 16))
        report = fc.explain(model, tokens, config=fc.CompileConfig(backend="aot_eager", bucket="auto"))
        compiled = fc.compile(model, backend="aot_eager", bucket="fsdp_group", reorder=False)
        compiled(tokens).float().sum().backward()
        model.layers[0].set_reshard_after_forward(False)
        model.layers[0].set_modules_to_forward_prefetch([model.layers[1]])
        model.layers[1].set_modules_to_backward_prefetch([model.layers[0]])
        compiled(tokens).float().sum().backward()
        plan, fw, bw = compiled.plan, compiled.captured.forward[0].graph, compiled.captured.backward[0].graph
        units = [u.members for u in compiled.schedule.units]
        issue_at = {u.members[0]: units[u.issue_at][0] for u in compiled.schedule.units}
    keys = ["", "layers.0", "layers.0@efsdp", "layers.1", "layers.1@efsdp"]
    assert [g.fqn for g in plan.groups] == keys
    assert {g.fqn: g.world_size for g in plan.groups} == {k: 4 if "@" in k else 8 for k in keys}
    assert {p.fqn.rsplit(".", 2)[1] for p in plan.group("layers.1@efsdp").params} == {"w1", "w2", "w3"}
    for bucket in report.buckets:  # "auto" never joins groups of two meshes
        assert len({"@" in g for g in bucket.groups}) == 1, bucket
    gathers = [n.meta["custom"]["fsdp_compile"]["group"] for n in fw.nodes
               if n.target == torch.ops._c10d_functional.all_gather_into_tensor.default]
    assert gathers == keys
    reduces = [n.meta["custom"]["fsdp_compile"]["group"] for n in bw.nodes
               if n.target == torch.ops._c10d_functional.reduce_scatter_tensor.default]
    assert reduces == ["layers.1@efsdp", "layers.1", "layers.0@efsdp", "layers.0", ""]
    # the setters, called on the module, are read for both its groups: a new plan at the next call. A prefetch
    # list gathers every group of its targets, from its module's first group in forward, its last in backward
    assert [g.reshard_after_forward for g in plan.groups] == [False, False, False, True, True]
    assert {g.fqn: (g.forward_prefetch, g.backward_prefetch) for g in plan.groups if "layers" in g.fqn} == {
        "layers.0": (("layers.1", "layers.1@efsdp"), ()), "layers.0@efsdp": ((), ()),
        "layers.1": ((), ()), "layers.1@efsdp": ((), ("layers.0@efsdp", "layers.0"))}
    assert units == [(k,) for k in keys] and issue_at["layers.1"] == issue_at["layers.1@efsdp"] == "layers.0"


@pytest.mark.parametrize("all_gather", [True, pytest.param(False, marks=pytest.mark.slow)],  # False: out of the fast tier
                         ids=["float8_all_gather", "bf16_all_gather"])
def test_llama_float8_tensor_parallel_gathers_float8_activations(all_gather):
    """``models.tensor_parallel(float8=True)`` (``bench/scale_sim.py --tp --float8``, issue 46): torchao's float8
    TP styles on torchtitan's Llama plan compile as one graph, FSDP's all-gathers carry bytes (uint8) with the
    float8 all-gather, and TP's sequence all-gathers carry float8 activations (PrepareFloat8ModuleInput casts
    before redistributing). The blocks are one region (issue 48), with or without the float8 all-gather:
    their hooks hold equal ``LinearMMConfig``s, and the float8 DTensor activations inside trace as a region
    (``_torch/_nested_subclasses.py``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from fsdp_compile.debug import explain_graphs
    from fsdp_compile.models import Llama, LlamaArgs, tensor_parallel
    from fsdp_compile.passes.predicates import collective_kind
    from fsdp_compile.report import with_region_bodies

    with fake_process_group(4, rank=1):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        torch.manual_seed(0)
        model = Llama(LlamaArgs(n_layers=2))
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather, emulate=True)
        convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn != "output")
        tensor_parallel(model, mesh["tp"], loss_parallel=True, float8=True)
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        report, captured = explain_graphs(model, torch.randint(0, 256, (2, 16)), config=fc.CompileConfig(backend="aot_eager"))
        assert report.graph_breaks == 0 and report.dynamo_graphs == 1
        forward = captured.forward[0]  # with each region call's body in its place: TP's gathers are inside
        gathered = [n.meta["val"].dtype for n in with_region_bodies(forward) if collective_kind(n) == "all_gather"]
        # per block: one float8 sequence all-gather into attention, one into the MLP
        assert gathered.count(torch.float8_e4m3fn) == 4 and (torch.uint8 in gathered) == all_gather
        assert report.regions == [{"blocks": ["layers.0", "layers.1"], "region": True, "why": None}]
        assert report.forward["all_gathers"] == len(gathered)  # the report counts a region's once per call
