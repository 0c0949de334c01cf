"""End to end: compiled training with the Triton copy kernels (interpreted on CPU) equals the torch copies.

Each spawned rank builds the kernels for Triton's interpreter for the run only (``triton_mode``).
"""

import pytest

from dist_helpers import run_ranks
from parity import Case, batch, build, loss_fn, max_diff

pytest.importorskip("triton")
pytestmark = pytest.mark.multirank


def kernels_worker(rank, world_size, case):
    from triton_mode import triton_interpreter

    with triton_interpreter():
        return _kernels_worker(rank, case)


def _kernels_worker(rank, case):
    import torch

    import fsdp_compile as fc
    from fsdp_compile.kernels import _common

    models = {k: build(case) for k in ("torch", "triton")}
    compiled = {k: fc.compile(m, backend="aot_eager", kernels=k) for k, m in models.items()}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in models.items()}
    out = {"loss": {k: [] for k in models}, "grad_diff": [], "param_diff": []}
    launches_before = sum(_common.LAUNCHES.values())
    for step in range(3):
        x = batch(case, step, rank)
        for k in models:
            loss = loss_fn(case, compiled[k](x), x)
            loss.backward()
            out["loss"][k].append(loss.item())
        out["grad_diff"].append(max_diff([p.grad for p in models["torch"].parameters()], [p.grad for p in models["triton"].parameters()]))
        for k in models:
            opts[k].step()
            opts[k].zero_grad()
        out["param_diff"].append(max_diff(list(models["torch"].parameters()), list(models["triton"].parameters())))
    graph_ops = {
        k: sorted({str(n.target) for g in compiled[k].captured.forward + compiled[k].captured.backward for n in g.graph.nodes if "fsdp_compile" in str(n.target)})
        for k in models
    }
    out["graph_ops"] = graph_ops
    out["launches"] = sum(_common.LAUNCHES.values()) - launches_before
    out["units"] = len(compiled["triton"].schedule.units)
    return out


@pytest.mark.parametrize("case", [Case(model="odd"), Case(n_layers=2, mp="bf16_reduce_bf16")], ids=lambda c: f"{c.model}-mp={c.mp}")
def test_triton_kernels_equal_torch_copies(case):
    # odd: every parameter padded on some rank, the shard gradients views of the reduce-scatter's output (fp32, no
    # cast: ops.shard_grads); bf16: the gradients reduced in bf16 and copied out cast to fp32 (the copy-out kernel)
    cast = case.mp is not None
    for rank, r in enumerate(run_ranks(kernels_worker, 2, case, timeout=600)):
        assert r["loss"]["torch"] == r["loss"]["triton"], (rank, r["loss"])
        assert max(r["grad_diff"]) == 0.0 and max(r["param_diff"]) == 0.0, (rank, r)
        # both runs' graphs hold our copy ops, and nothing else of ours (ops.py), whatever runs them
        for kernels in ("torch", "triton"):
            assert {op.split(".")[1] for op in r["graph_ops"][kernels]} == {
                "all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", *(["reduce_scatter_copy_out"] * cast),
            }, r["graph_ops"]
        # per unit of the schedule and step: gather in, gather out, grad pack (and the cast grad unpack), plus re-gathers
        assert r["launches"] >= 3 * (3 + cast) * r["units"], (r["launches"], r["units"])
