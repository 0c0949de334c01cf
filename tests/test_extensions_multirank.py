"""FSDP2's all-gather extensions under compile, on 2 gloo ranks against eager FSDP2 (issue 21).

Every Linear weight of a small Llama is an ``Int8Gathered`` (``extensions.py``): its all-gather sends an
int8 quantization and float32 row maxima, which eager FSDP2 packs with the norms and embeddings as bytes;
``fsdp_post_all_gather`` dequantizes. Under ``aot_eager`` the compiled step runs the same quantization,
the same bytes and the same dequantization, so losses, gradients and updated shards are bitwise equal,
with ``reshard_after_forward`` True and False and in bf16 mixed precision. Then the metadata (``qmax``)
changes between steps: the compiled model compiles anew and still matches eager, which a stale ``qmax``
would not. One rank group runs every case (the spawn and gloo setup are most of the time).
"""

import pytest
import torch
import torch.nn.functional as F

from dist_helpers import run_ranks
from parity import max_diff

pytestmark = pytest.mark.multirank

CASES = [("fp32", True), ("bf16", False)]  # reshard False in fp32 too: test_float8_multirank
STEPS = 3


def build(mp: str, reshard: bool):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from extensions import convert_linears
    from models import Llama, LlamaArgs, shard

    torch.manual_seed(0)
    model = convert_linears(Llama(LlamaArgs(n_layers=2)))
    kwargs = {"reshard_after_forward": reshard}
    if mp == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return shard(model, list(model.layers), **kwargs)


def _step(model, opt, x) -> float:
    loss = F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
    loss.backward()
    return loss


def _gathers(graph) -> list[tuple[str, int]]:
    """(dtype, bytes per rank) of every all-gather's input in a graph."""
    out = []
    for n in graph.graph.nodes:
        if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default:
            val = n.args[0].meta["val"]
            out.append((str(val.dtype), val.numel() * val.element_size()))
    return out


def run_case(rank: int, mp: str, reshard: bool, change_metadata: bool) -> dict:
    import fsdp_compile as fc

    eager, model = build(mp, reshard), build(mp, reshard)
    compiled = fc.compile(model, backend="aot_eager", bucket="fsdp_group", reorder=False)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    out = {"losses": [], "grad_diff": [], "param_diff": []}
    for step in range(STEPS + change_metadata):
        if change_metadata and step == STEPS:  # coarser quantization from now on, on every rank, in both models
            for m in (eager, model):
                for p in m.parameters():
                    if hasattr(p._local_tensor, "qmax"):
                        p._local_tensor.qmax = 63
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1000 * step + rank))
        le, lc = _step(eager, opt_e, x), _step(compiled, opt_c, x)
        out["losses"].append((le.item(), lc.item()))
        out["grad_diff"].append(max_diff([p.grad for p in eager.parameters()], [p.grad for p in model.parameters()]))
        out["grad_types"] = sorted({type(p.grad).__name__ for p in model.parameters()})
        for opt in (opt_e, opt_c):
            opt.step()
            opt.zero_grad()
        out["param_diff"].append(max_diff(list(eager.parameters()), list(model.parameters())))
    out["forward_gathers"] = _gathers(compiled.captured.forward[0])
    out["dynamo_graphs"] = len(compiled.captured.dynamo)
    out["local_types"] = sorted({type(p.to_local()).__name__ for p in model.parameters()})
    out["plan_bytes"] = {g.fqn: g.unsharded_bytes for g in compiled.plan.groups}
    block = model.layers[0]
    linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
    # one rank's inputs of block 0: int8 data plus a float32 maximum per row of each Linear, and its norms'
    # shards in the gather dtype
    itemsize = 2 if mp == "bf16" else 4
    norms = sum(p.to_local().numel() for n, p in block.named_parameters() if "norm" in n)
    out["expected_block_bytes"] = sum(
        lin.weight.to_local().numel() + 4 * lin.weight.to_local().shape[0] for lin in linears) + itemsize * norms
    out["plain_block_bytes"] = itemsize * sum(p.to_local().numel() for p in block.parameters())
    return out


def worker(rank: int, world_size: int) -> dict:
    results = {}
    for mp, reshard in CASES:
        results[(mp, reshard)] = run_case(rank, mp, reshard, change_metadata=(mp, reshard) == CASES[0])
    return results


@pytest.fixture(scope="module")
def results():
    return run_ranks(worker, 2, timeout=900)


@pytest.mark.parametrize("mp, reshard", CASES, ids=[f"{m}-reshard_{r}" for m, r in CASES])
def test_bitwise_against_eager(results, mp, reshard):
    for rank_results in results:
        r = rank_results[(mp, reshard)]
        assert all(le == lc for le, lc in r["losses"]), r["losses"]
        assert max(r["grad_diff"]) == 0.0, r["grad_diff"]
        assert max(r["param_diff"]) == 0.0, r["param_diff"]
        assert r["local_types"] == ["Int8Gathered", "Tensor"]  # the extension is still there after training
        assert r["grad_types"] == ["DTensor"]  # gradients land on the sharded parameters, as in eager


@pytest.mark.parametrize("mp, reshard", CASES, ids=[f"{m}-reshard_{r}" for m, r in CASES])
def test_the_gather_moves_the_payload_bytes(results, mp, reshard):
    """Each block's all-gather is of bytes (int8 data, float32 maxima, the norms): what eager FSDP2 sends,
    and what the plan (so the cost model and explain) counts."""
    r = results[0][(mp, reshard)]
    gathers = r["forward_gathers"]
    assert {dtype for dtype, _ in gathers} >= {"torch.uint8"}
    assert gathers.count(("torch.uint8", r["expected_block_bytes"])) == 2, gathers  # layers.0 and layers.1
    assert r["plan_bytes"]["layers.0"] == 2 * r["expected_block_bytes"]  # both ranks' inputs
    # without the extension each block would gather its weights in the gather dtype
    assert r["expected_block_bytes"] < r["plain_block_bytes"] / (3.5 if mp == "fp32" else 1.8)


def test_changed_metadata_compiles_anew(results):
    """qmax changed before the last step: a stale qmax would dequantize 2x too large and differ from eager."""
    for rank_results in results:
        r = rank_results[CASES[0]]
        assert len(r["losses"]) == STEPS + 1
        assert r["losses"][-1][0] == r["losses"][-1][1] and r["grad_diff"][-1] == 0.0 and r["param_diff"][-1] == 0.0
        assert r["dynamo_graphs"] == 2  # one compile per metadata
