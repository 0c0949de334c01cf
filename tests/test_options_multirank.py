"""FSDP2's runtime settings under compile, on 2 gloo ranks (one group for the whole file), bitwise against
eager ``fully_shard``.

* gradient accumulation without sync (``set_requires_gradient_sync(False)``): no reduce-scatter while off,
  unsharded gradients accumulated in FSDP2's dtype (the reduce dtype), reduce-scattered when it syncs;
  fp32, bf16 with fp32 reduce and bf16 reduce; at most one compile per mode;
* settings changed after compile take effect at the next call (``set_reshard_after_forward``,
  ``set_force_sum_reduction_for_comms``, ``set_gradient_divide_factor``), or are refused there, naming
  the setter;
* a user's ``unshard(async_op=True)`` still in flight at a compiled call is refused with what to do;
  unsharded parameters (its handle waited, or an eager forward that kept them) are resharded by the call;
* parameters replaced after compile (``load_state_dict(assign=True)``): the compiled step reads the new ones.
"""

import functools

import pytest
import torch

from dist_helpers import run_ranks, run_scenarios, scenario
from parity import Case, batch, build, loss_fn, max_diff, record_step

pytestmark = pytest.mark.multirank


def _both(case):
    import fsdp_compile as fc

    eager, model = build(case), build(case)
    compiled = fc.compile(model, backend="aot_eager")
    return eager, model, compiled


def _micro(case, runner, step, rank):
    x = batch(case, step, rank)
    loss = loss_fn(case, runner(x), x)
    loss.backward()
    return loss.item()


def accumulation_worker(rank, world_size, *, mp):
    from fsdp_compile.report import count_collectives

    case = Case(n_layers=2, mp=mp)
    eager, model, compiled = _both(case)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model)]
    out = {"losses": [], "grad_diff": [], "param_diff": [], "none_after_no_sync": [], "no_sync_reduce_scatters": None}
    for step in range(2):
        for micro in range(4):
            sync = micro == 3
            for m in (eager, model):
                m.set_requires_gradient_sync(sync)
            le = _micro(case, eager, 4 * step + micro, rank)
            n_backward = len(compiled.captured.backward)
            lc = _micro(case, compiled, 4 * step + micro, rank)
            out["losses"].append((le, lc))
            if not sync:
                out["none_after_no_sync"].append(
                    all(p.grad is None for p in model.parameters()) == all(p.grad is None for p in eager.parameters())
                )
                if len(compiled.captured.backward) > n_backward:  # the no-sync backward graph, when compiled
                    out["no_sync_reduce_scatters"] = count_collectives(compiled.captured.backward[-1:])["reduce_scatters"]
        record_step(out, eager, model, opts)
    out["dynamo_graphs"] = len(compiled.captured.dynamo)
    return out


def options_worker(rank, world_size):
    """Every scenario of this file in one group of ranks (one spawn, one torch import per rank); a scenario
    that raises is reported by name and the others still run."""
    scenarios = {f"accumulation-{mp}": functools.partial(accumulation_worker, mp=mp) for mp in ACCUMULATION_MP}
    scenarios.update(mixed_sync=mixed_sync_worker, settings=settings_worker)
    return run_scenarios(scenarios, rank, world_size)


@pytest.fixture(scope="module")
def results():
    return run_ranks(options_worker, 2, timeout=900)



ACCUMULATION_MP = [None, "bf16_reduce_bf16"]  # bf16 with an fp32 reduce, with sync: the parity grid


@pytest.mark.parametrize("mp", ACCUMULATION_MP)
def test_accumulation_without_sync(results, mp):
    for rank, r in enumerate(scenario(results, f"accumulation-{mp}")):
        assert all(le == lc for le, lc in r["losses"]), (rank, r["losses"])
        assert max(r["grad_diff"]) == 0.0 and max(r["param_diff"]) == 0.0, (rank, r)
        assert all(r["none_after_no_sync"]), r  # no sharded gradient until the step that syncs, as in eager
        assert r["no_sync_reduce_scatters"] == 0, r
        # one compile per mode: no sync; sync after no-sync micro-batches (their gradients as inputs)
        assert r["dynamo_graphs"] == 2, r["dynamo_graphs"]


def mixed_sync_worker(rank, world_size):
    """Gradient sync off for one block of an auto bucket (the user's setter, the bucket our choice): the
    step is re-planned with buckets split along it (also for the step that syncs what it accumulated), and
    trains like eager; the same for reshard_after_forward set on that block alone."""
    import fsdp_compile as fc

    case = Case(n_layers=3)
    eager, model = build(case), build(case)
    # bucket="auto", reorder=True; a budget that lets the planner merge alike blocks (at eager's, counting
    # gloo's copy of each pending reduce-scatter, it keeps every block apart on this small model)
    compiled = fc.compile(model, backend="aot_eager", hardware="cpu-gloo", memory_budget_gb=1)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model)]
    out = {"losses": [], "grad_diff": [], "param_diff": [], "units": []}
    for step in range(3):  # step 0 syncs everything; then 3 micro-batches, layers.1 synced in the last only
        micros = 1 if step == 0 else 3
        for micro in range(micros):
            for m in (eager, model):
                m.layers[1].set_requires_gradient_sync(micro == micros - 1, recurse=False)
            le = _micro(case, eager, 3 * step + micro, rank)
            lc = _micro(case, compiled, 3 * step + micro, rank)
            out["losses"].append((le, lc))
            out["units"].append([list(u.members) for u in compiled.schedule.units])
        record_step(out, eager, model, opts)
    for m in (eager, model):  # then reshard_after_forward differs inside the bucket: re-planned too
        m.layers[1].set_requires_gradient_sync(True, recurse=False)
        m.layers[1].set_reshard_after_forward(False, recurse=False)
    out["losses"].append((_micro(case, eager, 9, rank), _micro(case, compiled, 9, rank)))
    out["units"].append([list(u.members) for u in compiled.schedule.units])
    out["grad_diff"].append(max_diff([p.grad for p in eager.parameters()], [p.grad for p in model.parameters()]))
    return out


def test_auto_buckets_follow_gradient_sync(results):
    for rank, r in enumerate(scenario(results, "mixed_sync")):
        assert all(le == lc for le, lc in r["losses"]), (rank, r["losses"])
        assert max(r["grad_diff"]) == 0.0 and max(r["param_diff"]) == 0.0, (rank, r)
        merged = r["units"][0]  # all alike
        assert any(len(u) > 1 and "layers.1" in u for u in merged), merged  # layers.1 bucketed with another block
        for split in (r["units"][1], r["units"][-1]):  # layers.1 without sync; then with another reshard
            assert ["layers.1"] in split and not any(len(u) > 1 and "layers.1" in u for u in split), split


def settings_worker(rank, world_size):
    from fsdp_compile.report import count_collectives

    case = Case(n_layers=2)
    eager, model, compiled = _both(case)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model)]
    out = {"losses": [], "grad_diff": []}

    def step(s):
        le = _micro(case, eager, s, rank)
        lc = _micro(case, compiled, s, rank)
        out["losses"].append((le, lc))
        out["grad_diff"].append(max_diff([p.grad for p in eager.parameters()], [p.grad for p in model.parameters()]))
        for opt in opts:
            opt.step()
            opt.zero_grad()

    step(0)
    before = count_collectives(compiled.captured.backward[-1:])["all_gathers"]
    for m in (eager, model):  # keep every module unsharded between forward and backward from now on
        m.set_reshard_after_forward(False)
    step(1)
    out["backward_all_gathers"] = (before, count_collectives(compiled.captured.backward[-1:])["all_gathers"])
    for m in (eager, model):
        m.set_force_sum_reduction_for_comms(True)
        m.set_gradient_divide_factor(3.0)  # with force-sum: FSDP2's pre/post divide by a factor of 3 (gloo has no PREMUL_SUM)
        m.set_is_last_backward(True)  # nothing to wait for under compile: accepted
    step(2)
    for m in (eager, model):  # replaced parameters: a state dict loaded with assign=True
        sd = {k: v.detach().clone() if hasattr(v, "detach") else v for k, v in m.state_dict().items()}
        m.load_state_dict(sd, assign=True)
    step(3)
    out["replaced"] = all(p is q for p, q in zip(compiled.parameters(), model.parameters()))
    # a user unshard still in flight at a compiled call: refused (the call would not wait on the handle)
    handle = model.unshard(async_op=True)
    try:
        _micro(case, compiled, 4, rank)
        out["unsharded"] = None
    except ValueError as e:
        out["unsharded"] = str(e)
    handle.wait()  # unsharded now: the compiled call reshards (FSDP2's reshard(), local) and reads the shards
    step(5)
    model.set_reshard_after_backward(False)
    try:
        _micro(case, compiled, 6, rank)
        out["refused"] = None
    except NotImplementedError as e:
        out["refused"] = str(e)
    return out


def test_settings_after_compile(results):
    for rank, r in enumerate(scenario(results, "settings")):
        assert all(le == lc for le, lc in r["losses"]), (rank, r["losses"])
        assert max(r["grad_diff"]) == 0.0, (rank, r["grad_diff"])
        before, after = r["backward_all_gathers"]
        assert before > 0 and after == 0, r  # the blocks stop re-gathering in backward
        assert r["unsharded"] and "all-gather in flight" in r["unsharded"], r["unsharded"]
        assert len(r["losses"]) == 5  # trained on after the reshard
        assert r["refused"] and "set_reshard_after_backward(False)" in r["refused"], r["refused"]
