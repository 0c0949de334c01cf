"""FSDP2 setters that frameworks call, honored under compile: 4 gloo ranks (one group for the file), bitwise
against eager ``fully_shard`` under ``aot_eager``.

* ``set_requires_all_reduce(False)``, HSDP on a 2 x 2 mesh (gradient accumulation that reduce-scatters but
  does not all-reduce): the micro-batches without it reduce-scatter and keep FSDP2's partial reduce output
  (no ``.grad`` yet), the one with it adds them before its all-reduce. fp32; bf16 with an fp32 reduce under
  ``bucket="auto"``, after a micro-batch without any gradient sync. Ranks train on batches of different
  shapes and must issue the same collectives.
* ``set_unshard_in_backward(False)`` on an embedding in an FSDP module of its own: neither eager nor the
  compiled backward re-gathers it. (Where the backward needs the parameters eager FSDP2 fails, and
  ``fc.compile`` refuses: ``tests/test_bad_inputs.py``.)

``torch.distributed._composable.checkpoint`` is a block pattern of the parity grid (``dropout_composable``,
``tests/test_parity_multirank.py``).
"""

import functools

import pytest
import torch

from dist_helpers import run_ranks, run_scenarios, scenario
from parity import Case, build, loss_fn, record_step

pytestmark = pytest.mark.multirank


def _signature(graphs) -> list:
    """Per graph, each collective's kind and group size in graph order: what every rank must issue alike."""
    from fsdp_compile.passes.predicates import collective_kind, world_size

    return [[(collective_kind(n), world_size(n)) for n in g.graph.nodes if collective_kind(n)] for g in graphs]


def all_reduce_worker(rank, world_size, *, mp, bucket, no_sync_first, ddp=False):
    """2 optimizer steps of 3 micro-batches: all-reduce in the last only (and, with ``no_sync_first``, no
    gradient sync at all in the first). ``ddp``: ``replicate`` (FSDP2's DDP) on every rank instead of HSDP."""
    import fsdp_compile as fc
    from fsdp_compile.report import count_collectives

    case = Case(ddp="all", mp=mp) if ddp else Case(replicate=2, mp=mp)
    eager, model = build(case), build(case)
    compiled = fc.compile(model, backend="aot_eager", bucket=bucket)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model)]
    shape = (2, 16) if rank % 2 == 0 else (1, 12)  # batch shapes differ between ranks
    out = {"losses": [], "grad_diff": [], "param_diff": [], "no_grad_before_all_reduce": [], "backward": {}}
    for step in range(2):
        for micro in range(3):
            for m in (eager, model):
                m.set_requires_gradient_sync(not (no_sync_first and micro == 0))
                m.set_requires_all_reduce(micro == 2)
            x = torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(100 * (3 * step + micro) + rank))
            n_backward = len(compiled.captured.backward)
            for runner in (eager, compiled):
                loss = loss_fn(case, runner(x), x)
                loss.backward()
                out["losses"].append(loss.item())
            if len(compiled.captured.backward) > n_backward:  # this mode's backward, compiled now
                mode = "all_reduce" if micro == 2 else "no_sync" if no_sync_first and micro == 0 else "no_all_reduce"
                out["backward"][mode] = count_collectives(compiled.captured.backward[-1:])
            if micro < 2:
                out["no_grad_before_all_reduce"].append(
                    [p.grad is None for p in eager.parameters()] == [p.grad is None for p in model.parameters()]
                    and all(p.grad is None for p in model.parameters()))
        record_step(out, eager, model, opts)
    out["dynamo_graphs"] = len(compiled.captured.dynamo)
    out["signature"] = _signature(compiled.captured.forward + compiled.captured.backward)
    return out


def unshard_in_backward_worker(rank, world_size):
    """An embedding in its own FSDP module (resharded after forward) with set_unshard_in_backward(False)."""
    import fsdp_compile as fc
    import models
    from fsdp_compile.report import count_collectives

    def make():
        torch.manual_seed(0)
        m = models.Llama(models.LlamaArgs(n_layers=2))
        models.shard(m, [m.tok_embeddings, *m.layers])
        m.tok_embeddings.set_unshard_in_backward(False)
        return m

    case = Case()
    eager, model = make(), make()
    compiled = fc.compile(model, backend="aot_eager", bucket="fsdp_group")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model)]
    out = {"losses": [], "grad_diff": [], "param_diff": []}
    for step in range(2):
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))
        for runner in (eager, compiled):
            loss = loss_fn(case, runner(x), x)
            loss.backward()
            out["losses"].append(loss.item())
        record_step(out, eager, model, opts)
    out["backward"] = count_collectives(compiled.captured.backward)
    from fsdp_compile._annotations import fsdp_groups
    from fsdp_compile.passes.predicates import collective_kind

    out["regathered"] = sorted({g for n in compiled.captured.backward[0].graph.nodes
                                if collective_kind(n) == "all_gather" for g in fsdp_groups(n)})
    return out


ALL_REDUCE = {
    "fp32": dict(mp=None, bucket="fsdp_group", no_sync_first=False),
    "bf16-auto-no_sync_first": dict(mp="bf16", bucket="auto", no_sync_first=True),
}


def setters_worker(rank, world_size):
    """Every scenario in one group of ranks; a scenario that raises is reported by name, the others still run."""
    scenarios = {f"all_reduce-{name}": functools.partial(all_reduce_worker, **kw) for name, kw in ALL_REDUCE.items()}
    scenarios["unshard_in_backward"] = unshard_in_backward_worker
    scenarios["replicate-accumulation"] = functools.partial(all_reduce_worker, mp="bf16", bucket="auto", no_sync_first=True,
                                                            ddp=True)
    return run_scenarios(scenarios, rank, world_size)


@pytest.fixture(scope="module")
def results():
    return run_ranks(setters_worker, 4, timeout=900)



def _bitwise(rank, r, atol=0.0):
    """Losses bitwise; gradients and parameters bitwise, or within ``atol`` where a case says why."""
    eager, compiled = r["losses"][0::2], r["losses"][1::2]
    assert eager == compiled, (rank, r["losses"])
    assert max(r["grad_diff"]) <= atol and max(r["param_diff"]) <= atol, (rank, r)


@pytest.mark.parametrize("name", ALL_REDUCE)
def test_requires_all_reduce(results, name):
    per_rank = scenario(results, f"all_reduce-{name}")
    for rank, r in enumerate(per_rank):
        _bitwise(rank, r)
        assert all(r["no_grad_before_all_reduce"]), r  # FSDP2 keeps the partial output, not .grad
        backward = r["backward"]
        # without all-reduce: every reduce-scatter, no all-reduce; the step with it: one all-reduce per reduce-scatter
        assert backward["no_all_reduce"]["all_reduces"] == 0, backward
        assert backward["no_all_reduce"]["reduce_scatters"] == backward["all_reduce"]["reduce_scatters"] > 0, backward
        assert backward["all_reduce"]["all_reduces"] == backward["all_reduce"]["reduce_scatters"], backward
        if "no_sync" in backward:
            assert backward["no_sync"]["reduce_scatters"] == backward["no_sync"]["all_reduces"] == 0, backward
        # one compile per mode: without all-reduce; with it (the partials as inputs); without sync
        assert r["dynamo_graphs"] == len(backward), (r["dynamo_graphs"], backward)
    if name == "fp32":
        assert per_rank[0]["backward"]["all_reduce"] == {"all_gathers": 2, "reduce_scatters": 3, "all_reduces": 3}
    # batch shapes differ between ranks: the same collectives, in the same order, on every rank
    assert all(r["signature"] == per_rank[0]["signature"] for r in per_rank)


def test_unshard_in_backward(results):
    for rank, r in enumerate(scenario(results, "unshard_in_backward")):
        _bitwise(rank, r)
        # the blocks are re-gathered in backward, the embedding is not (as in eager); every module reduce-scatters
        assert r["regathered"] == ["layers.0", "layers.1"], r["regathered"]
        assert r["backward"]["reduce_scatters"] == 4, r["backward"]


def test_replicate_accumulation(results):
    """``replicate`` (FSDP2's DDP, 4 ranks, bf16 with an fp32 reduce, ``bucket="auto"``): a micro-batch without
    gradient sync, one with ``set_requires_all_reduce(False)`` (FSDP2's partial reduce output, no ``.grad``), then
    the all-reduce; batch shapes differ between ranks. No all-gather and no reduce-scatter anywhere, the all-reduces
    in the synced backward only, the same collectives in the same order on every rank."""
    per_rank = scenario(results, "replicate-accumulation")
    for rank, r in enumerate(per_rank):
        # Not bitwise on 4 ranks: an all-reduce sums each element over the ranks in an order that its offset in the
        # flat buffer sets (gloo's ring), and bucket="auto" lays the parameters out otherwise than FSDP2's per-group
        # buffers (on cpu-gloo, every module in one all-reduce; before its contention share, [norm, output] apart
        # from the embedding, measured then: output.weight's gradient one fp32 ulp off, 2.3e-10, the rest bitwise);
        # bucket="fsdp_group", or 2 ranks (a sum of two commutes), are bitwise. The losses stay bitwise.
        _bitwise(rank, r, atol=1e-8)
        assert all(r["no_grad_before_all_reduce"]), r
        backward = r["backward"]
        assert set(backward) == {"no_sync", "no_all_reduce", "all_reduce"}, backward
        assert all(b["all_gathers"] == b["reduce_scatters"] == 0 for b in backward.values()), backward
        assert backward["no_sync"]["all_reduces"] == backward["no_all_reduce"]["all_reduces"] == 0, backward
        assert backward["all_reduce"]["all_reduces"] > 0, backward
        assert r["dynamo_graphs"] == len(backward), (r["dynamo_graphs"], backward)
    assert all(r["signature"] == per_rank[0]["signature"] for r in per_rank)
