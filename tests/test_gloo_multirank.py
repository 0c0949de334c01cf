"""``fsdp_compile.single_thread_gloo``, on 2 gloo ranks (``run_ranks`` calls it before
``init_process_group``, as the demo and the benchmarks do).

* the default group, a new group and a 2-D DeviceMesh's groups are torch's ``ProcessGroupGloo`` with one
  worker thread (torch's two race on the group's status: ``fsdp_compile/_torch/_gloo.py``);
* ``fc.compile`` on a model sharded over a gloo group with two worker threads warns, naming the fix; on
  one-thread groups it does not; the one-thread group trains like eager FSDP2 (the parity tests run on
  such groups throughout);
* what gloo allocates per collective beyond its output, measured, is what the ``cpu-gloo`` cost-model
  profile's ``collective_scratch`` says (the planner counts it against the memory budget).
"""

import warnings

import pytest
import torch

from dist_helpers import run_ranks

pytestmark = pytest.mark.multirank


def gloo_worker(rank, world_size):
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import fsdp_compile as fc
    from fsdp_compile._torch._gloo import gloo_threads, measure_collective_scratch

    out = {}
    world = dist.group.WORLD
    out["world"] = (gloo_threads(world), isinstance(world._get_backend(torch.device("cpu")), dist.ProcessGroupGloo))
    out["new_group"] = gloo_threads(dist.new_group(backend="gloo"))
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    out["mesh"] = [gloo_threads(mesh.get_group(d)) for d in ("dp", "tp")]
    fc.single_thread_gloo()  # a second call changes nothing
    out["again"] = gloo_threads(dist.new_group(backend="gloo"))

    # a group torch builds with its own two threads (the helper as torch has it)
    helper = c10d._new_process_group_helper
    c10d._new_process_group_helper = helper.__wrapped__
    try:
        two = dist.new_group(backend="gloo")
    finally:
        c10d._new_process_group_helper = helper
    out["two"] = gloo_threads(two)

    def compile_on(m):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        fully_shard(model[0], mesh=m)
        fully_shard(model, mesh=m)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            compiled = fc.compile(model, backend="aot_eager")
        return compiled, [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]

    _, out["warned_two"] = compile_on(DeviceMesh.from_group(two, "cpu"))
    compiled, out["warned_one"] = compile_on(init_device_mesh("cpu", (world_size,)))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    compiled(x).sum().backward()
    out["grads"] = all(p.grad is not None for p in compiled.parameters())
    out["scratch"] = measure_collective_scratch(world)
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(gloo_worker, 2, timeout=300)


def test_groups_have_one_worker_thread(results):
    for r in results:
        assert r["world"] == (1, True), r
        assert r["new_group"] == 1 and r["again"] == 1, r
        assert r["mesh"] == [1, 1], r
        assert r["two"] == 2, r  # torch's own default, which the warning below is about


def test_compile_warns_on_gloo_with_two_threads(results):
    for r in results:
        assert len(r["warned_two"]) == 1, r["warned_two"]
        assert "fsdp_compile.single_thread_gloo()" in r["warned_two"][0]
        assert "more than one worker thread" in r["warned_two"][0]
        assert r["warned_one"] == [], r["warned_one"]
        assert r["grads"]


def test_cpu_gloo_profile_states_gloos_scratch(results):
    from fsdp_compile.passes.cost_model import CPU_GLOO

    stated = dict(CPU_GLOO.collective_scratch)
    for r in results:
        measured = r["scratch"]
        assert set(measured) == {"all_gather", "reduce_scatter", "all_reduce", "all_to_all"}, measured
        # held from the collective's end to its wait: what the profile states (a reduce-scatter's input copy)
        assert {k: m["held"] for k, m in measured.items()} == {k: stated.get(k, 0.0) for k in measured}, measured
        # the all-gather's flat buffer exists only while it runs (the profile leaves it out); the rest none
        assert {k: m["peak"] for k, m in measured.items()} == {
            "all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 0.0, "all_to_all": 0.0}, measured
