"""The schedule's invariant on real gloo ranks: every rank issues the same collectives, whatever its inputs.

All under the default config (``bucket="auto"``, ``reorder=True``) with ``aot_eager``, bitwise against eager
``fully_shard`` on the same seed and data:

* ranks with different batch shapes (one token against 4 x 16);
* uneven shards (a 257-row embedding over 2 ranks) with a recompile on rank 0 only (a new sequence
  length at step 2);
* FSDP2's own prefetch settings (``set_modules_to_forward_prefetch`` / ``..._backward_prefetch``), honored;
* and ranks compiling with different settings: a clear error on every rank, naming the setting.
"""


import pytest
import torch

from dist_helpers import run_ranks
from parity import Case, build, loss_fn, max_diff

pytestmark = pytest.mark.multirank


def _train(eager, model, compiled, batches, case):
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    out = {"loss_eager": [], "loss_compiled": [], "grad_diff": [], "param_diff": []}
    for x in batches:
        le = loss_fn(case, eager(x), x)
        le.backward()
        lc = loss_fn(case, compiled(x), x)
        lc.backward()
        out["loss_eager"].append(le.item())
        out["loss_compiled"].append(lc.item())
        out["grad_diff"].append(max_diff([p.grad for p in eager.parameters()], [p.grad for p in model.parameters()]))
        for opt in (opt_e, opt_c):
            opt.step()
            opt.zero_grad()
        out["param_diff"].append(max_diff(list(eager.parameters()), list(model.parameters())))
    out["dynamo_graphs"] = len(compiled.captured.dynamo)
    out["schedule"] = compiled.schedule.digest()
    return out


def _tokens(rank, step, shape, vocab=256):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(100 * step + rank))


def schedule_worker(rank, world_size):
    import fsdp_compile as fc

    results = {}
    case = Case(n_layers=3)

    # ranks with different batch shapes: rank 0 trains on one token, rank 1 on 4 x 16
    eager, model = build(case), build(case)
    compiled = fc.compile(model, backend="aot_eager")
    shape = (1, 1) if rank == 0 else (4, 16)
    results["batch_shapes"] = _train(eager, model, compiled, [_tokens(rank, s, shape) for s in range(3)], case)

    # uneven shards (257 embedding rows: 129 + 128), and rank 0 alone changes its sequence length at step 2
    import models

    def build_uneven():
        torch.manual_seed(0)
        m = models.Llama(models.LlamaArgs(n_layers=2, vocab=257))
        return models.shard(m, m.layers)

    eager, model = build_uneven(), build_uneven()
    compiled = fc.compile(model, backend="aot_eager")
    batches = [_tokens(rank, s, (2, 24 if rank == 0 and s >= 2 else 16), vocab=257) for s in range(4)]
    results["uneven_recompile"] = _train(eager, model, compiled, batches, case)

    # the root split (hardware="h100-nvlink" makes it pay at this size): uneven shards (257 embedding rows: each
    # part padded on its own), rank 0 one token, rank 1 4 x 16; the plan made from the agreed workload alone
    eager, model = build_uneven(), build_uneven()
    compiled = fc.compile(model, backend="aot_eager", hardware="h100-nvlink")
    shape = (1, 1) if rank == 0 else (4, 16)
    results["split_batch_shapes"] = _train(eager, model, compiled, [_tokens(rank, s, shape, vocab=257) for s in range(2)], case)
    results["split_batch_shapes"]["parts"] = [u.params for u in compiled.schedule.units if u.params]

    # FSDP2's prefetch settings, on both models
    eager, model = build(case), build(case)
    for m in (eager, model):
        m.layers[0].set_modules_to_forward_prefetch([m.layers[2]])
        m.layers[2].set_modules_to_backward_prefetch([m.layers[0]])
    compiled = fc.compile(model, backend="aot_eager")
    results["prefetch_settings"] = _train(eager, model, compiled, [_tokens(rank, s, (2, 16)) for s in range(3)], case)
    units = compiled.schedule.units
    unit_of = {f: i for i, u in enumerate(units) for f in u.members}
    results["prefetch_settings"]["anchors"] = (
        units[unit_of["layers.2"]].issue_at == unit_of["layers.0"],
        units[unit_of["layers.0"]].backward_issue_at == unit_of["layers.2"],
    )

    # different settings per rank: both ranks refuse, before any trace
    try:
        fc.compile(build(case), backend="aot_eager", bucket="auto" if rank == 0 else "fsdp_group")
        results["config_mismatch"] = "no error"
    except ValueError as e:
        results["config_mismatch"] = str(e)
    return results


@pytest.fixture(scope="module")
def results():
    return run_ranks(schedule_worker, 2, timeout=600, pg_timeout=60)


@pytest.mark.parametrize("name", ["batch_shapes", "uneven_recompile", "split_batch_shapes", "prefetch_settings"])
def test_bitwise_with_eager(results, name):
    for rank, per_rank in enumerate(results):
        r = per_rank[name]
        assert r["loss_eager"] == r["loss_compiled"], (rank, r)
        assert max(r["grad_diff"]) == 0.0 and max(r["param_diff"]) == 0.0, (rank, r)
    assert results[0][name]["schedule"] == results[1][name]["schedule"]  # one plan on both ranks


def test_split_root_on_every_rank(results):
    for r in results:
        assert r["split_batch_shapes"]["parts"] == [("tok_embeddings.weight",), ("norm.weight", "output.weight")], r


def test_recompile_on_one_rank_only(results):
    assert results[0]["uneven_recompile"]["dynamo_graphs"] == 2
    assert results[1]["uneven_recompile"]["dynamo_graphs"] == 1


def test_prefetch_settings_honored(results):
    assert all(r["prefetch_settings"]["anchors"] == (True, True) for r in results)


def test_different_settings_fail_on_every_rank(results):
    for rank, r in enumerate(results):
        msg = r["config_mismatch"]
        assert "disagree on the fsdp_compile.CompileConfig: CompileConfig.bucket is" in msg, msg
        assert "every rank must pass the same settings to fsdp_compile.compile" in msg, msg
