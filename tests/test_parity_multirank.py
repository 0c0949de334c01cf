"""Compiled training equals eager ``fully_shard`` on real gloo ranks.

Under ``aot_eager`` in fp32 the compiled step runs the same kernels in the same order as eager FSDP2
(the all-gather copy-in/out and reduce-scatter pack only move bytes; AVG is gloo's own), so losses,
gradients and updated shards must be *bitwise* equal; mixed precision too, since the casts happen at
the same points. Inductor generates different kernels (fused, reordered reductions), so it gets a
tolerance (see ``test_compile_cache.py``, whose cold job checks the default config under Inductor).
"""

import pytest

from dist_helpers import run_ranks
from parity import FREE_OVERLAP, PATTERNS, Case, parity_worker

pytestmark = pytest.mark.multirank

# One factor at a time from the default (FSDP2's collectives, no reordering), then pairs: each pair of
# factors (model, mixed precision, bucketing, reshard) that interacts is covered once, not every product.
CASES_2 = [
    Case(inline=True),
    Case(reshard=False),
    Case(reshard=True),  # the root re-gathers in backward too
    Case(model="frozen"),  # frozen parameters, buffers
    Case(mp="bf16_reduce_bf16"),
    Case(model="odd", mp="fp16"),  # uneven dim-0 shards, unwrapped modules, a root with parameters; fp16 reduce: FSDP2's pre/post divide
    Case(accum=2, mp="bf16"),  # accumulation with sync in bf16 (without sync: test_options_multirank)
    # the passes only merge and move collectives and copies: numerics stay bitwise
    Case(bucket="none"),
    Case(bucket=(("layers.0", "layers.1"),), reorder=True),
    Case(model="odd", bucket="auto", reorder=True),
    Case(mp="bf16", bucket="auto", reorder=True, n_layers=3),
    Case(model="llama_ac", mp="bf16", inline=True),  # activation checkpointing inside each FSDP block
    # block patterns of real clients (complex RoPE, an MoE buffer update, dropout under checkpointing), under
    # the default bucketing and reordering, each also compiled with regions off (the differential guard)
    *(Case(model=p, bucket="auto", reorder=True, inline=True) for p in PATTERNS),
    Case(offload=True),  # CPUOffloadPolicy on a CPU device: what eager FSDP2 does there
    # ... and the accelerator's graphs, host-device copies around each collective, on cpu: bitwise too
    Case(offload=True, host_copies=True, mp="bf16"),
    Case(model="llama_grouped", n_layers=3),  # fully_shard([layers.0, layers.1]) and layers.2
    Case(model="llama_grouped", n_layers=3, bucket="auto", reorder=True, mp="bf16"),
    Case(ignored=True),  # fully_shard(root, ignored_params={norm.weight}): a plain parameter, local gradient
    # the tied embedding and output weight: one parameter, one gradient (on 2 ranks: a 4-rank case costs 2x)
    Case(model="llama_tied", mp="bf16"),
    # replicate (FSDP2's DDP): no all-gather, each unit's gradients all-reduced; on the MLP stack in bf16 with
    # auto buckets; and a mixed model (replicate blocks, a fully_shard root)
    Case(ddp="all"),
    Case(model="odd", ddp="all", mp="bf16", bucket="auto", reorder=True),
    Case(ddp="blocks", mp="bf16"),
    Case(model="llama_ac", ddp="all", inline=True),  # replicate over checkpointed blocks, regions on and off
]
CASES_4 = [
    Case(model="odd"),
    # HSDP on a 2x2 mesh: reduce-scatter over the shard dimension, all-reduce over the replicas
    Case(replicate=2),
    Case(replicate=2, mp="bf16", bucket="auto", reorder=True),
    Case(replicate=4),  # a 4x1 mesh: FSDP1's NO_SHARD (all-reduce only, gathers of one rank)
    # the same HSDP by fully_shard(..., dp_mesh_dims=...): parameters Replicate() DTensors on the named 2x2 mesh
    Case(model="odd", replicate=2, spmd=True),
    # int reshard_after_forward: kept sharded over 2 ranks after forward, re-gathered from them in backward
    Case(reshard=2),
    Case(model="llama_ac", reshard=2, mp="bf16", bucket="auto", reorder=True),  # with checkpointed blocks
    # bucket="auto" splits the root (its embedding, its head: two all-gathers, two reduce-scatters) on 4 ranks,
    # reduced in bf16 (where a different summation order would show), regions on and off; planned with
    # cpu-gloo's communication free, where the split pays on this model (with its contention share it does not)
    Case(mp="bf16_reduce_bf16", bucket="auto", reorder=True, inline=True, hardware=FREE_OVERLAP),
    # replicate on 4 ranks, batch shapes differing per rank: fp32; checkpointed blocks in bf16 with accumulation,
    # in FSDP2's all-reduce buffers: bucket="auto" puts every module in one, and on 4 ranks gloo's ring all-reduce
    # sums each element in an order its offset in the buffer sets, so auto is bitwise only where those sums are
    # exact (it was on an Intel Xeon; on an AMD EPYC, 9.3e-10 off in the second step's gradients). auto's layout is
    # checked bitwise on 2 ranks above and within 1e-8 on 4 (test_setters_multirank.py::test_replicate_accumulation)
    Case(ddp="all", ragged=True),
    Case(model="llama_ac", ddp="all", mp="bf16", accum=2, reorder=True, ragged=True),
]


@pytest.fixture(scope="module")
def results_2():
    return run_ranks(parity_worker, 2, CASES_2, timeout=600)


@pytest.fixture(scope="module")
def results_4():
    return run_ranks(parity_worker, 4, CASES_4, timeout=600)


def _check_bitwise(results, case):
    for rank, per_rank in enumerate(results):
        r = per_rank[case.name]
        assert r["graph_breaks"] == 0 and r["dynamo_graphs"] == 1, (rank, r)
        assert r["grad_types"] == ["DTensor"], r["grad_types"]  # gradients land on the sharded DTensors
        assert ("loss_inline" in r) == (case.inline and case.regions)  # the differential guard ran where asked
        for name in ("compiled", "inline") if "loss_inline" in r else ("compiled",):
            assert r[f"loss_{name}"] == r["loss_eager"], (rank, name, r["loss_eager"], r[f"loss_{name}"])
            assert max(r[f"{name}_grad_diff"]) == 0.0, (rank, name, r[f"{name}_grad_diff"])
            assert max(r[f"{name}_param_diff"]) == 0.0, (rank, name, r[f"{name}_param_diff"])
            assert max(r[f"{name}_buffer_diff"]) == 0.0, (rank, name, r[f"{name}_buffer_diff"])


def test_offload_host_copies_are_in_the_graphs(results_2):
    """The ``host_copies`` case trained with the copies test_offload.py places (and the other offload case without)."""
    for per_rank in results_2:
        with_copies = per_rank[Case(offload=True, host_copies=True, mp="bf16").name]["device_copies"]
        assert with_copies["forward"] > 0 and with_copies["backward"] > with_copies["forward"], with_copies
        assert per_rank[Case(offload=True).name]["device_copies"] == {"forward": 0, "backward": 0}


@pytest.mark.parametrize("case", CASES_2, ids=lambda c: c.name)
def test_bitwise_2_ranks(results_2, case):
    _check_bitwise(results_2, case)


@pytest.mark.parametrize("case", CASES_4, ids=lambda c: c.name)
def test_bitwise_4_ranks(results_4, case):
    _check_bitwise(results_4, case)


def test_which_patterns_are_regions(results_2):
    """Complex RoPE and checkpoint_wrapper blocks stay regions (the first through our Conjugate kernel for
    invoke_subgraph), and so does an MoE block that updates a buffer in place (its region owns a copy, written
    back at top level); dropout under torch.utils.checkpoint around a region is compiled inline, and the report
    says why."""
    from fsdp_compile.passes.regions import RANDOM_UNDER_CHECKPOINT

    expected = {"rope_complex": None, "dropout_cw": None, "moe": None, "dropout_ckpt": RANDOM_UNDER_CHECKPOINT,
                "dropout_composable": RANDOM_UNDER_CHECKPOINT}  # its checkpoint wraps the region call
    for pattern, why in expected.items():
        regions = results_2[0][Case(model=pattern, bucket="auto", reorder=True).name]["regions"]
        assert regions == [{"blocks": ["layers.0", "layers.1"], "region": why is None, "why": why}], (pattern, regions)
    assert results_2[0][Case().name]["regions"] == [{"blocks": ["layers.0", "layers.1"], "region": True, "why": None}]


def test_graphs_identical_on_every_rank(results_2):
    """Every pass decision comes from the graph and the config: evenly sharded models compile to the same
    graphs on every rank (the uneven OddMLP's shard shapes differ by rank, so its graphs do too)."""
    for case in CASES_2:
        if case.model != "odd":
            assert results_2[0][case.name]["graph_hash"] == results_2[1][case.name]["graph_hash"], case.name


def test_bucketing_counts(results_2):
    r = results_2[0]
    none = r[Case(bucket="none").name]
    assert none["forward"]["all_gathers"] == 3 + 2 * 9  # one per parameter: the root 3, each block 9
    plan = r[Case(bucket=(("layers.0", "layers.1"),), reorder=True).name]
    assert plan["forward"]["all_gathers"] == 2  # the root, then both blocks in one


def test_replicate_all_reduces_only(results_2):
    """replicate: no all-gather and no reduce-scatter, one all-reduce per unit in backward (FSDP2's foreach_reduce
    at a world size of 1, then its all-reduce over the replicas); mixed with a fully_shard root, the root is
    gathered and reduce-scattered and the blocks all-reduced."""
    for rank in (0, 1):
        for case in (Case(ddp="all"), Case(model="odd", ddp="all", mp="bf16", bucket="auto", reorder=True)):
            r = results_2[rank][case.name]
            assert r["forward"] == {"all_gathers": 0, "reduce_scatters": 0, "all_reduces": 0}, r["forward"]
            assert r["backward"]["all_gathers"] == r["backward"]["reduce_scatters"] == 0, r["backward"]
            # one per FSDP module under fsdp_group buckets (bucket="auto" merges or splits units by its cost model)
            assert r["backward"]["all_reduces"] == 3 if case.bucket == "fsdp_group" else r["backward"]["all_reduces"] >= 1
        mixed = results_2[rank][Case(ddp="blocks", mp="bf16").name]
        assert mixed["forward"]["all_gathers"] == 1, mixed["forward"]
        assert mixed["backward"] == {"all_gathers": 0, "reduce_scatters": 1, "all_reduces": 2}, mixed["backward"]


def test_replicate_4_ranks_same_collectives(results_4):
    """replicate with batch shapes differing per rank: every rank issues the same all-reduces (and nothing else)."""
    for case in (c for c in CASES_4 if c.ddp):
        counts = [(per_rank[case.name]["forward"], per_rank[case.name]["backward"]) for per_rank in results_4]
        assert counts[0][0] == {"all_gathers": 0, "reduce_scatters": 0, "all_reduces": 0}, (case.name, counts[0])
        assert counts[0][1]["all_reduces"] >= 1 and counts[0][1]["all_gathers"] == counts[0][1]["reduce_scatters"] == 0
        assert all(c == counts[0] for c in counts), (case.name, counts)


def test_a_group_of_modules_is_one_collective(results_2):
    """fully_shard([layers.0, layers.1]): one all-gather before the first runs, one reduce-scatter after the
    last one's gradients (root, the pair, layers.2)."""
    r = results_2[0][Case(model="llama_grouped", n_layers=3).name]
    assert r["forward"]["all_gathers"] == 3 and r["backward"]["reduce_scatters"] == 3, r


def test_collectives_like_eager(results_2):
    """One all-gather per FSDP group in forward, one per resharded group in backward, one RS per group."""
    groups = 3  # root + 2 layers
    r = results_2[0]
    assert r[Case().name]["forward"]["all_gathers"] == groups
    assert r[Case().name]["backward"] == {"all_gathers": 2, "reduce_scatters": groups, "all_reduces": 0}
    assert r[Case(reshard=True).name]["backward"]["all_gathers"] == groups
    assert r[Case(reshard=False).name]["backward"]["all_gathers"] == 0
    # blocks.0's only trainable parameter is its bias, whose gradient needs no weights: the compiled
    # backward skips the re-gather that eager FSDP2's pre-backward hook would issue.
    assert r[Case(model="frozen").name]["backward"] == {"all_gathers": 1, "reduce_scatters": 3, "all_reduces": 0}


def test_int_reshard_regathers_over_the_post_forward_group(results_4):
    """reshard_after_forward=2 on 4 ranks: forward all-gathers over 4 ranks, the backward re-gathers over
    the 2-rank post-forward groups (root, layers.0, layers.1), as FSDP2 does."""
    sizes = results_4[0][Case(reshard=2).name]["all_gather_sizes"]
    assert sizes == {"forward": [4, 4, 4], "backward": [2, 2, 2]}, sizes
    case = Case(model="llama_ac", reshard=2, mp="bf16", bucket="auto", reorder=True)
    sizes = results_4[0][case.name]["all_gather_sizes"]
    assert set(sizes["forward"]) == {4} and set(sizes["backward"]) == {2}, sizes


def test_auto_split_root_is_bitwise(results_4):
    """The bf16-reduce auto case's root is gathered and reduce-scattered in two parts (the embedding; norm and output):
    one collective more each way than its FSDP groups, bitwise on every rank (test_bitwise_4_ranks)."""
    for per_rank in results_4:
        r = per_rank[Case(mp="bf16_reduce_bf16", bucket="auto", reorder=True, inline=True, hardware=FREE_OVERLAP).name]
        assert r["forward"]["all_gathers"] == 4 and r["backward"]["reduce_scatters"] == 4, r


def test_hsdp_all_reduces_each_reduce_scatter(results_4):
    r = results_4[0][Case(replicate=2).name]
    assert r["backward"]["reduce_scatters"] == 3 and r["backward"]["all_reduces"] == 3, r
