"""torchtitan's Llama3 and DeepSeek-V3 debug models, built and sharded by torchtitan's own code
(``parallelize_llama`` / ``parallelize_deepseekv3``: its mixed precision, bf16 parameters and fp32 reduction,
its reshard policy, ``set_gradient_divide_factor(1.0)``), trained with its loss, its optimizers container, its
MoE load-balancing hook and its ``clip_grad_norm_`` on 2 gloo ranks: ``fsdp_compile.compile`` trains them
bitwise like eager FSDP2 under ``aot_eager``, with the default config otherwise, and close to it under
Inductor. What the harness adapts to CPU, and why, is in ``torchtitan_cases``.

torchtitan is not in the test extra (its declared dependencies are its trainer's: datasets, tensorboard,
wandb, torchdata...); install it and the two modules its models import with ``torchtitan_cases.INSTALL``
(``torchtitan==0.3.0 --no-deps``, then ``spmd-types`` and ``tyro``), or these tests skip, saying what is missing.
"""

import pytest
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

from dist_helpers import run_ranks
from torchtitan_cases import TitanCase, titan_worker, torchtitan_missing

pytestmark = pytest.mark.multirank

_missing = torchtitan_missing()
if _missing:
    pytest.skip(_missing, allow_module_level=True)

LLAMA = TitanCase(model="llama3")
# the first three layers: one dense block and two MoE blocks, so the MoE block is a repeated kind of block
# that fsdp_compile considers for a region (with two layers every block is of its own kind)
DEEPSEEK = TitanCase(model="deepseek_v3", n_layers=3)
BITWISE = [
    LLAMA,  # regions on (the default): both blocks one region, complex RoPE inside
    TitanCase(model="llama3", regions=False),  # ... and inline: the differential guard
    DEEPSEEK,  # regions on: the MoE blocks, which update their token counters in place, one region
    TitanCase(model="deepseek_v3", n_layers=3, regions=False),  # ... and inline: the differential guard
    TitanCase(model="llama3", ac="selective"),  # torchtitan's SelectiveAC, its debug config's choice
    TitanCase(model="llama3", loss="chunked"),  # ChunkedLossWrapper, its debug config's loss: lm_head run by the loss
]
DEEPSEEK_SAC = TitanCase(model="deepseek_v3", n_layers=3, ac="selective")
# spmd_backend="full_dtensor": every parameter a DTensor on the SPMD mesh, fully_shard(..., dp_mesh_dims=...)
FULL_DTENSOR = TitanCase(model="llama3", spmd_backend="full_dtensor", steps=2)
# torchtitan's default backend: torch 2.13's eager FSDP2 refuses it, torch 2.14's trains it (FSDPParam.is_spmd_types)
SPMD_TYPES = TitanCase(model="llama3", spmd_backend="spmd_types", steps=2)
SPMD_TYPES_FSDP = hasattr(FSDPParam, "_restore_spmd_types")  # this torch's fully_shard accepts spmd_types parameters
INDUCTOR = TitanCase(model="llama3", backend="inductor", steps=2)


@pytest.fixture(scope="module")
def results():
    return run_ranks(titan_worker, 2, [*BITWISE, DEEPSEEK_SAC, FULL_DTENSOR, SPMD_TYPES], timeout=900)


def _ok(results, case):
    for rank, per_rank in enumerate(results):
        r = per_rank[case.name]
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert r["graph_breaks"] == 0, (rank, r["graph_breaks"])
        assert r["param_dtype"] == "torch.bfloat16"  # torchtitan's mixed precision is on
        yield rank, r


@pytest.mark.parametrize("case", BITWISE, ids=lambda c: c.name)
def test_torchtitan_bitwise(results, case):
    for rank, r in _ok(results, case):
        # ChunkedLossWrapper ends each step with lm_head.set_reshard_after_forward(True): [norm, lm_head],
        # which torchtitan shards with reshard_after_forward=False, reshards after forward from the second
        # step on, in eager FSDP2 too; the compiled model re-plans once for that setting
        assert r["dynamo_graphs"] == (2 if case.loss == "chunked" else 1), (rank, r["dynamo_graphs"])
        assert r["loss_eager"] == r["loss_compiled"], (rank, r["loss_eager"], r["loss_compiled"])
        assert r["norm_eager"] == r["norm_compiled"], (rank, r["norm_eager"], r["norm_compiled"])
        for key in ("grad_diff", "counter_diff", "param_diff", "buffer_diff"):
            assert max(r[key]) == 0.0, (rank, key, r[key])


def test_torchtitan_full_dtensor(results):
    """``parallelize_llama`` under ``spmd_backend="full_dtensor"`` (dp_shard 2): its parameters are DTensors on the
    SPMD mesh and ``fully_shard`` gets ``dp_mesh_dims=DataParallelMeshDims(shard="dp_shard")``; the batch is a
    DTensor Shard(0) on it. Bitwise like eager FSDP2; the blocks one region (they take and return DTensors, which
    cross its boundary as their local tensors: capture/boundary.py)."""
    for rank, r in _ok(results, FULL_DTENSOR):
        assert r["param_meshes"] == ["('dp_shard',)"], r["param_meshes"]  # the SPMD mesh, not FSDP's own
        assert r["dynamo_graphs"] == 1 and r["regions"][0]["region"], (rank, r["dynamo_graphs"], r["regions"])
        assert r["loss_eager"] == r["loss_compiled"], (rank, r["loss_eager"], r["loss_compiled"])
        assert r["norm_eager"] == r["norm_compiled"], (rank, r["norm_eager"], r["norm_compiled"])
        for key in ("grad_diff", "param_diff", "buffer_diff"):
            assert max(r[key]) == 0.0, (rank, key, r[key])


def test_torchtitan_spmd_types(results):
    """torchtitan's default ``spmd_backend="spmd_types"`` leaves its parameters plain tensors annotated with
    spmd_types and passes ``dp_mesh_dims`` to ``fully_shard``. Torch 2.13's wants DTensors on the SPMD mesh:
    eager FSDP2 itself refuses it, before anything is compiled. Torch 2.14's stores them as DTensors on the SPMD
    mesh and hands the module the gathered plain tensors, whose gradients it reduce-scatters as they are under
    data parallelism alone (dp_shard 2): bitwise like eager FSDP2, the blocks one region (plain tensors)."""
    if not SPMD_TYPES_FSDP:
        for rank, per_rank in enumerate(results):
            error = per_rank[SPMD_TYPES.name].get("error", "")
            assert "must be DTensors on the full SPMD mesh" in error and "fully_shard" in error, (rank, error[-2000:])
        return
    for rank, r in _ok(results, SPMD_TYPES):
        assert r["param_meshes"] == ["('dp_shard',)"], r["param_meshes"]  # FSDP2's storage: the SPMD mesh
        assert r["dynamo_graphs"] == 1 and r["regions"][0]["region"], (rank, r["dynamo_graphs"], r["regions"])
        assert r["loss_eager"] == r["loss_compiled"], (rank, r["loss_eager"], r["loss_compiled"])
        assert r["norm_eager"] == r["norm_compiled"], (rank, r["norm_eager"], r["norm_compiled"])
        for key in ("grad_diff", "param_diff", "buffer_diff"):
            assert max(r[key]) == 0.0, (rank, key, r[key])


def test_which_blocks_are_regions(results):
    """Llama3's blocks (complex RoPE) are one region; so are DeepSeek-V3's MoE blocks, which count their tokens
    into a buffer in place (the region owns a copy, written back at top level): one body, called per block; the
    dense block is of its own kind."""
    regions = {case.name: next(_ok(results, case))[1]["regions"] for case in BITWISE}
    assert regions[LLAMA.name] == [{"blocks": ["layers.0", "layers.1"], "region": True, "why": None}]
    assert regions[DEEPSEEK.name] == [{"blocks": ["layers.1", "layers.2"], "region": True, "why": None}]
    for _, r in _ok(results, DEEPSEEK):
        assert r["region_calls"] == {"subgraph_0": 2}, r["region_calls"]
    for case in BITWISE:
        if case.regions is False:
            assert all(not r["region"] for r in regions[case.name]), regions[case.name]


def test_deepseek_moe_counters_and_hook_ran(results):
    """The counters compared bitwise are live: every token counted top-k times in each MoE block before
    torchtitan's pre-step hook all-reduces them, and the expert biases it updates moved."""
    moe_layers, top_k = 2, 3
    from torchtitan_cases import BATCH, SEQ

    for _, r in _ok(results, DEEPSEEK):
        counts = r["tokens_per_expert"]["compiled"]
        assert sorted(counts) == ["layers.1.moe.tokens_per_expert_E", "layers.2.moe.tokens_per_expert_E"]
        assert sum(sum(c) for c in counts.values()) == moe_layers * BATCH * SEQ * top_k, counts
        assert r["expert_bias"] > 0.0


def test_deepseek_selective_ac_counts_tokens_once(results):
    """Under activation checkpointing, eager recomputes each MoE block's forward in backward and so adds its
    token counts twice (torchtitan's hook halves them for that); the compiled step updates the buffer once,
    as a forward mutation. The first step is bitwise equal until then; the counts differ by exactly 2x, so
    the load-balancing bias updates, and the training after them, differ from eager's."""
    for rank, r in _ok(results, DEEPSEEK_SAC):
        assert r["dynamo_graphs"] == 1
        assert r["loss_eager"][0] == r["loss_compiled"][0] and r["grad_diff"][0] == 0.0, (rank, r)
        eager, compiled = r["tokens_per_expert"]["eager"], r["tokens_per_expert"]["compiled"]
        assert eager == {n: [2 * x for x in c] for n, c in compiled.items()}, (rank, eager, compiled)


@pytest.mark.inductor
def test_torchtitan_inductor_close():
    """Llama3 under Inductor (C++ on CPU), bf16 parameters: not bitwise (fused kernels round differently).
    Tolerances: losses and gradient norms within 1e-3 relative, every gradient within 5 % of the largest
    (measured: 1.4 %),
    and the weights moved from their common start in the same direction (cosine >= 0.99; AdamW's first
    steps are about lr * sign(gradient), so a few near-zero gradients that differ move their weights by
    up to 2 * lr either way, which an elementwise bound would have to allow)."""
    (r0, r1) = run_ranks(titan_worker, 2, [INDUCTOR], timeout=600)
    for rank, per_rank in enumerate((r0, r1)):
        r = per_rank[INDUCTOR.name]
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert r["graph_breaks"] == 0 and r["dynamo_graphs"] == 1, (rank, r)
        for key in ("loss", "norm"):
            for e, c in zip(r[f"{key}_eager"], r[f"{key}_compiled"], strict=True):
                assert abs(e - c) <= 1e-3 * abs(e), (rank, key, e, c)
        for diff, scale in zip(r["grad_diff"], r["grad_scale"], strict=True):
            assert diff <= 0.05 * scale, (rank, diff, scale)
        assert min(r["update_cos"]) >= 0.99, (rank, r["update_cos"])


TP = TitanCase(model="llama3", tp=2, steps=2)
# enable_weight_tying under TP: its TP plan distributes tok_embeddings and lm_head apart, fully_shard makes them
# two FSDP parameters and init_states ties them again, which eager FSDP2 reduce-scatters one by one
TP_TIED = TitanCase(model="llama3", tp=2, steps=2, tied=True)
TP_INLINE = TitanCase(model="llama3", tp=2, steps=2, regions=False)  # the differential guard: blocks inline
# expert_parallel_degree 2 (dp_shard 4, efsdp 2 x ep 2): one dense block, one MoE block whose routed experts
# parallelize_deepseekv3 keeps in the block's FSDP module on the efsdp mesh (two FSDP2 parameter groups)
EP = TitanCase(model="deepseek_v3", ep=2, steps=2)
# full_dtensor (dp_shard 2 x tp 2): parameters on the 2-D SPMD mesh, FSDP2's _StridedShard placements on dp_shard
TP_FULL = TitanCase(model="llama3", tp=2, steps=2, spmd_backend="full_dtensor")
# spmd_types (dp_shard 2 x tp 2): torch 2.13's fully_shard refuses it (no step runs), torch 2.14's trains it
TP_SPMD_TYPES = TitanCase(model="llama3", tp=2, steps=2, spmd_backend="spmd_types")


@pytest.fixture(scope="module")
def tp_results():
    return run_ranks(titan_worker, 4, [TP, TP_TIED, TP_INLINE, EP, TP_FULL, TP_SPMD_TYPES], timeout=900)


@pytest.mark.parametrize("case", [TP, TP_TIED, TP_INLINE, TP_FULL], ids=lambda c: c.name)
def test_torchtitan_tensor_parallel(tp_results, case):
    """torchtitan's own ``apply_tp`` (sequence-parallel norms, column/row-parallel projections, logits left
    sharded over the vocabulary for its vocab-parallel loss) and ``apply_fsdp`` on 4 ranks, dp_shard 2 x
    tp 2, as ``parallelize_llama`` composes them, with and without weight tying, and
    under spmd_backend="full_dtensor" (fully_shard(..., dp_mesh_dims=...) on the dp_shard x tp mesh): bitwise like
    eager FSDP2 + TP, the blocks one region (their Shard(1) DTensor activations crossing its boundary as local
    tensors, capture/boundary.py) and, regions off, inline."""
    for rank, r in _ok(tp_results, case):
        # FSDP2's 2-D DTensors: TP is on; full_dtensor: the SPMD mesh's names (dp_mesh_dims)
        meshes = ["('dp_shard', 'tp')"] if case.spmd_backend == "full_dtensor" else ["('fsdp', 'tp')"]
        assert r["param_meshes"] == meshes, r["param_meshes"]
        assert r["dynamo_graphs"] == 1, (rank, r["dynamo_graphs"])
        # torchtitan 0.3.0's blocks take and return Shard(1) DTensors (sequence parallelism)
        on = case.regions is not False
        assert r["regions"] == [{"blocks": ["layers.0", "layers.1"], "region": on,
                                 "why": None if on else "CompileConfig(regions=False)"}], r["regions"]
        assert r["loss_eager"] == r["loss_compiled"], (rank, r["loss_eager"], r["loss_compiled"])
        assert r["norm_eager"] == r["norm_compiled"], (rank, r["norm_eager"], r["norm_compiled"])
        for key in ("grad_diff", "param_diff", "buffer_diff"):
            assert max(r[key]) == 0.0, (rank, key, r[key])


def test_torchtitan_expert_parallel(tp_results):
    """torchtitan's DeepSeek-V3 with expert parallelism, sharded by its own ``parallelize_deepseekv3`` on 4 ranks:
    the MoE block's routed experts (DTensors Shard(0) on ep, their all-to-all dispatch of data-dependent sizes
    traced) are its second FSDP2 parameter group, on the 2-rank efsdp mesh. Each group is its own unit, gathered
    and reduce-scattered over its own group with its own divide factors: bitwise like eager FSDP2, the MoE token
    counters and torchtitan's load-balancing hook too."""
    from torchtitan_cases import BATCH, SEQ

    for rank, r in _ok(tp_results, EP):
        assert r["param_meshes"] == ["('efsdp', 'ep')", "('fsdp',)"], r["param_meshes"]  # EP is on
        assert r["group_sizes"] == {"tok_embeddings": 4, "layers.0": 4, "layers.1": 4, "layers.1@efsdp": 2,
                                    "norm": 4}, r["group_sizes"]
        assert ["layers.1"] in r["units"] and ["layers.1@efsdp"] in r["units"], r["units"]
        assert r["dynamo_graphs"] == 1, (rank, r["dynamo_graphs"])
        assert r["loss_eager"] == r["loss_compiled"], (rank, r["loss_eager"], r["loss_compiled"])
        assert r["norm_eager"] == r["norm_compiled"], (rank, r["norm_eager"], r["norm_compiled"])
        for key in ("grad_diff", "counter_diff", "param_diff", "buffer_diff"):
            assert max(r[key]) == 0.0, (rank, key, r[key])
        counts = r["tokens_per_expert"]["compiled"]
        assert list(counts) == ["layers.1.moe.tokens_per_expert_E"]  # each rank's own tokens, top-3 of 8 experts
        assert sum(sum(c) for c in counts.values()) == BATCH * SEQ * 3, counts
        assert r["expert_bias"] > 0.0


def test_torchtitan_spmd_types_tensor_parallel(tp_results):
    """spmd_types with TP (dp_shard 2 x tp 2), torchtitan's default backend: torch 2.14's FSDP2 hands the module
    plain tensors and reads an R-typed weight's gradient (the sequence-parallel norms') as Partial over tp,
    all-reduced there before its reduce-scatter; fsdp_compile traces that all-reduce in the backward graph.
    Bitwise like eager FSDP2, the blocks one region (plain tensors). Torch 2.13's ``fully_shard`` refuses it."""
    if not SPMD_TYPES_FSDP:
        for rank, per_rank in enumerate(tp_results):
            error = per_rank[TP_SPMD_TYPES.name].get("error", "")
            assert "must be DTensors on the full SPMD mesh" in error, (rank, error[-2000:])
        return
    _spmd_types_tp_bitwise(tp_results)


@pytest.mark.skipif(not SPMD_TYPES_FSDP, reason="this torch's fully_shard refuses spmd_types parameters "
                    "(test_torchtitan_spmd_types_tensor_parallel pins that)")
def test_spmd_types_tensor_parallel_alone():
    """The case above in a 4-rank spawn of its own: .ci/run's torch 2.14.1 part runs it without the group's
    other cases (``-k alone``), since the multirank suite runs on torch 2.13 only, whose FSDP2 refuses it."""
    _spmd_types_tp_bitwise(run_ranks(titan_worker, 4, [TP_SPMD_TYPES], timeout=900))


def _spmd_types_tp_bitwise(tp_results):
    for rank, r in _ok(tp_results, TP_SPMD_TYPES):
        assert r["param_meshes"] == ["('dp_shard', 'tp')"], r["param_meshes"]  # FSDP2's storage: the SPMD mesh
        # the R-typed weights, all-reduced over tp (without it: gradients 1.2e-2 off at the first step)
        assert r["tp_all_reduced"] == ["layers.0.attention_norm.weight", "layers.0.ffn_norm.weight",
                                       "layers.1.attention_norm.weight", "layers.1.ffn_norm.weight",
                                       "norm.weight"], r["tp_all_reduced"]
        assert r["dynamo_graphs"] == 1 and r["graph_breaks"] == 0, (rank, r["dynamo_graphs"], r["graph_breaks"])
        assert r["regions"][0]["region"], (rank, r["regions"])
        assert r["loss_eager"] == r["loss_compiled"], (rank, r["loss_eager"], r["loss_compiled"])
        assert r["norm_eager"] == r["norm_compiled"], (rank, r["norm_eager"], r["norm_compiled"])
        for key in ("grad_diff", "param_diff", "buffer_diff"):
            assert max(r[key]) == 0.0, (rank, key, r[key])
