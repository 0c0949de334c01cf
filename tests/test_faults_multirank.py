"""Faults end fast and cleanly, and resuming from a checkpoint is exact. 2 gloo ranks, a 30 s timeout.

* a rank that raises, dies, or skips the compiled step for another collective: every other rank raises
  within the process group's timeout, with an error that says the ranks diverged; no process is left;
* a rank that compiles while its peer runs the eager model, or comes to compile after its peer gave up:
  both raise within the (3 s) timeout, the compiling one saying so; no process is aborted (gloo used to
  abort the lone rank when its agreement all-gather met the eager model's of another size);
* a rank that dies while a DCP checkpoint is being written: the checkpoint is absent (no metadata, it
  does not load), while the one written before is complete and loads;
* compiled training for 4 steps, a DCP save, new processes that load it and train 4 more: bitwise equal
  to 8 steps without the interruption (aot_eager).
"""

import os
import time

import pytest
import torch

from dist_helpers import run_ranks
from parity import Case, batch, build, loss_fn

pytestmark = pytest.mark.multirank

PG_TIMEOUT = 15
CASE = Case(n_layers=2)


def _setup():
    import fsdp_compile as fc

    model = build(CASE)
    compiled = fc.compile(model, backend="aot_eager")
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    return model, compiled, opt


def _step(compiled, opt, step: int, rank: int) -> float:
    x = batch(CASE, step, rank)
    loss = loss_fn(CASE, compiled(x), x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def fault_worker(rank, world_size, mode):
    import torch.distributed as dist

    _, compiled, opt = _setup()
    _step(compiled, opt, 0, rank)
    if rank == 1:
        if mode == "raise":
            raise RuntimeError("rank 1: the user's own code failed")
        if mode == "die":
            os._exit(3)
        if mode == "skip":  # another collective where the compiled step's should be
            try:
                dist.barrier()
            except Exception as e:  # noqa: BLE001 - reported to the test
                return {"error": str(e)}
            return {"error": None}
    t0 = time.monotonic()
    try:
        _step(compiled, opt, 1, rank)
    except Exception as e:  # noqa: BLE001 - what the test checks
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None}


@pytest.mark.parametrize("mode", ["raise", "die", "skip"])
def test_a_failing_rank_stops_the_others_fast(mode):
    t0 = time.monotonic()
    outcomes = run_ranks(fault_worker, 2, mode, timeout=240, pg_timeout=PG_TIMEOUT, outcomes=True)
    status, r = outcomes[0]
    assert status == "ok" and r["error"], outcomes
    assert "fsdp_compile: a collective of the compiled step failed on rank 0" in r["error"], r["error"]
    assert "ranks most likely diverged" in r["error"], r["error"]
    assert r["seconds"] < PG_TIMEOUT + 30, r  # within the process group's timeout (plus its own teardown)
    if mode == "raise":
        assert outcomes[1][0] == "error" and "the user's own code failed" in outcomes[1][1]
    if mode == "die":
        assert outcomes[1] == ("died", 3)
    assert time.monotonic() - t0 < 200  # and run_ranks joined or killed every process


LONE_TIMEOUT = 3


def lone_compile_worker(rank, world_size, mode):
    """Rank 0 compiles and calls the compiled model; rank 1 does ``mode`` instead."""
    import fsdp_compile as fc

    model = build(CASE)
    x = batch(CASE, 0, rank)
    t0 = time.monotonic()
    try:
        if rank == 0 or mode == "late":
            if rank == 1:  # comes to compile after rank 0 stopped waiting for it
                time.sleep(LONE_TIMEOUT + 3)
                t0 = time.monotonic()
            loss_fn(CASE, fc.compile(model, backend="aot_eager")(x), x).backward()
        elif mode == "eager":  # FSDP2's own all-gathers, of other sizes than any agreement's
            loss_fn(CASE, model(x), x).backward()
    except Exception as e:  # noqa: BLE001 - what the test checks
        return {"error": str(e), "seconds": time.monotonic() - t0}
    return {"error": None}


@pytest.mark.parametrize("mode", ["eager", "late"])
def test_a_rank_that_compiles_alone_raises(mode):
    t0 = time.monotonic()
    outcomes = run_ranks(lone_compile_worker, 2, mode, timeout=120, pg_timeout=LONE_TIMEOUT, outcomes=True)
    assert [status for status, _ in outcomes] == ["ok", "ok"], outcomes  # neither died (gloo aborted with -6)
    lone, other = outcomes[0][1], outcomes[1][1]
    assert "fsdp_compile: rank 0 waited" in lone["error"], lone
    assert "for rank(s) [1] to agree on the fsdp_compile.CompileConfig" in lone["error"], lone
    assert "every rank must call fsdp_compile.compile(model) and then the compiled model" in lone["error"], lone
    assert LONE_TIMEOUT - 1 < lone["seconds"] < LONE_TIMEOUT + 10, lone  # the group's timeout, not more
    assert other["error"] and other["seconds"] < LONE_TIMEOUT + 10, other
    if mode == "late":  # it finds that rank 0 gave up, at once, instead of entering the compiled step alone
        assert "rank 1 reached the ranks' agreement on the fsdp_compile.CompileConfig after rank 0" in other["error"]
        assert other["seconds"] < 2, other
    assert time.monotonic() - t0 < 100


def checkpoint_fault_worker(rank, world_size, ckpt):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, compiled, opt = _setup()
    _step(compiled, opt, 0, rank)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(ckpt, "complete"))
    if rank == 1:  # dies in the middle of writing its part of the next checkpoint
        from torch.distributed.checkpoint import filesystem

        def die(*args, **kwargs):
            os._exit(4)

        filesystem.FileSystemWriter.write_data = die
    broken = os.path.join(ckpt, "broken")
    try:
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=broken)
        error = None
    except Exception as e:  # noqa: BLE001 - what the test checks
        error = str(e)
    return {"error": error, "metadata": os.path.exists(os.path.join(broken, ".metadata"))}


def test_checkpoint_written_during_a_fault_is_absent(tmp_path):
    import torch.distributed.checkpoint as dcp

    outcomes = run_ranks(checkpoint_fault_worker, 2, str(tmp_path), timeout=240, pg_timeout=PG_TIMEOUT, outcomes=True)
    assert outcomes[1] == ("died", 4), outcomes
    status, r = outcomes[0]
    assert status == "ok" and r["error"] and not r["metadata"], outcomes
    # the earlier checkpoint is complete (its metadata lists what each rank wrote); the broken one is not one
    assert dcp.FileSystemReader(str(tmp_path / "complete")).read_metadata().state_dict_metadata
    with pytest.raises(Exception):
        dcp.FileSystemReader(str(tmp_path / "broken")).read_metadata()


def resume_worker(rank, world_size, ckpt, phase):
    """``"first"``: 8 steps straight, a DCP checkpoint after step 4; ``"second"``: new processes load it and
    run steps 4 to 8."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, compiled, opt = _setup()
    if phase == "second":
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=ckpt)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    losses = []
    for s in range(4, 8) if phase == "second" else range(8):
        losses.append(_step(compiled, opt, s, rank))
        if phase == "first" and s == 3:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt)
    # plain lists: a tensor in the result queue would share memory with a process that is exiting
    shards = [p.to_local().tolist() for p in model.parameters()]
    return {"losses": losses, "shards": shards}


def test_resume_from_checkpoint_is_exact(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    straight = run_ranks(resume_worker, 2, ckpt, "first", timeout=300)
    resumed = run_ranks(resume_worker, 2, ckpt, "second", timeout=300)  # new processes, from the checkpoint
    for rank in range(2):
        assert resumed[rank]["losses"] == straight[rank]["losses"][4:], rank
        assert resumed[rank]["shards"] == straight[rank]["shards"], rank  # exact: fp32 values as Python floats
