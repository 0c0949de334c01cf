"""What a training loop needs around the compiled step, on 2 real gloo ranks."""

import pytest
import torch

from dist_helpers import run_ranks
from eager_calls import count_eager_collectives
from parity import Case, batch, build, loss_fn, max_diff

pytestmark = pytest.mark.multirank


def training_worker(rank, world_size, ckpt_dir):
    import torch.distributed.checkpoint as dcp

    import fsdp_compile as fc

    case = Case(n_layers=2)
    eager, model = build(case), build(case)
    compiled = fc.compile(model, backend="aot_eager")
    opt = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    out = {}

    x = batch(case, 0, rank)
    loss_fn(case, compiled(x), x).backward()  # compile (not counted)
    opt.zero_grad()

    x = batch(case, 1, rank)
    with count_eager_collectives() as calls:
        loss_fn(case, compiled(x), x).backward()
        norm_c = torch.nn.utils.clip_grad_norm_(compiled.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    out["compiled_c10d_calls"] = list(calls)
    # the counter is live: eager FSDP2 goes through it
    with count_eager_collectives() as calls:
        loss_fn(case, eager(x), x).backward()
    out["eager_c10d_calls"] = len(calls)
    opt_e.zero_grad()
    out["clip_norm_is_tensor"] = isinstance(norm_c, torch.Tensor) and torch.isfinite(norm_c).item()

    # clip_grad_norm_ on the compiled model's DTensor grads equals eager FSDP2's, then the update too
    for m in (eager, model):
        with torch.no_grad():
            for p, q in zip(m.parameters(), model.parameters()):
                if m is eager:
                    p.copy_(q)
    x = batch(case, 2, rank)
    loss_fn(case, eager(x), x).backward()
    loss_fn(case, compiled(x), x).backward()
    ne = torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.1)
    nc = torch.nn.utils.clip_grad_norm_(compiled.parameters(), 0.1)
    out["clip_norm_diff"] = (ne.full_tensor() if hasattr(ne, "full_tensor") else ne).item() - (
        nc.full_tensor() if hasattr(nc, "full_tensor") else nc
    ).item()
    out["clipped_grad_diff"] = max_diff([p.grad for p in eager.parameters()], [p.grad for p in model.parameters()])
    opt.zero_grad()
    opt_e.zero_grad()

    # the original module still runs eagerly with FSDP2's hooks, and agrees with the compiled step
    with torch.no_grad():
        y_eager = model(x)
        y_comp = compiled(x)
    out["eager_vs_compiled_forward"] = (y_eager - y_comp).abs().max().item()

    # DCP: save the compiled model's state, load it into a fresh eager model
    dcp.save({"model": compiled.state_dict()}, checkpoint_id=ckpt_dir)
    fresh = build(Case(n_layers=2))
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    state = {"model": fresh.state_dict()}
    dcp.load(state, checkpoint_id=ckpt_dir)
    fresh.load_state_dict(state["model"])
    out["dcp_diff"] = max_diff(list(fresh.parameters()), list(model.parameters()))
    out["state_dict_keys_equal"] = list(compiled.state_dict()) == list(model.state_dict())
    # FSDP1's FULL_STATE_DICT: full tensors, gathered by torch's state-dict API from the compiled model
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(compiled, options=StateDictOptions(full_state_dict=True))
    out["full_state_dict"] = all(
        not hasattr(v, "to_local") and v.shape == p.shape and torch.equal(v, p.full_tensor())
        for (k, v), p in zip(sorted(full.items()), [dict(model.named_parameters())[k] for k in sorted(full)])
    ) and len(full) == len(list(model.parameters()))

    # explain on real ranks: no training step happens
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn(case, compiled(x), x).backward()
    grads = [p.grad for p in model.parameters()]
    report = fc.explain(model, x, config=fc.CompileConfig(backend="aot_eager", bucket="fsdp_group", reorder=False))
    out["explain"] = (report.graph_breaks, report.all_gathers, report.reduce_scatters)
    out["explain_params_unchanged"] = max_diff(before, list(model.parameters())) == 0.0
    out["explain_grads_kept"] = all(a is b for a, b in zip(grads, [p.grad for p in model.parameters()]))
    return out


def test_training_loop_pieces(tmp_path):
    results = run_ranks(training_worker, 2, str(tmp_path / "ckpt"), timeout=300)
    for rank, r in enumerate(results):
        assert r["compiled_c10d_calls"] == [], (rank, r["compiled_c10d_calls"])
        assert r["eager_c10d_calls"] >= 8, r  # 5 all-gathers + 3 reduce-scatters per eager step
        assert r["clip_norm_is_tensor"]
        assert r["clip_norm_diff"] == 0.0 and r["clipped_grad_diff"] == 0.0, r
        assert r["eager_vs_compiled_forward"] == 0.0, r
        assert r["dcp_diff"] == 0.0 and r["state_dict_keys_equal"] and r["full_state_dict"], r
        assert r["explain"] == (0, 5, 3), r["explain"]
        assert r["explain_params_unchanged"] and r["explain_grads_kept"], r


def mismatch_worker(rank, world_size):
    import fsdp_compile as fc

    model = build(Case(n_layers=2 + rank))  # rank 1 builds one more block
    try:
        fc.compile(model, backend="aot_eager")
    except ValueError as e:
        return str(e)
    return "no error"


def test_ranks_with_different_models_fail_fast():
    """Instead of mismatched collectives (a hang until the timeout), a clear error on every rank."""
    for rank, msg in enumerate(run_ranks(mismatch_worker, 2, timeout=120)):
        expected = "the number of FSDP groups is 3 vs 4" if rank == 0 else "the number of FSDP groups is 4 vs 3"
        assert "disagree on the sharded model" in msg and expected in msg, msg
