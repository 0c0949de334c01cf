"""Warm restarts: a second process compiling the same model and config is served by Inductor's FX graph
cache and AOTAutograd's cache, and a process with an empty cache directory starts warm from artifacts saved
with ``torch.compiler.save_cache_artifacts`` (counters, not timings); all report the same collectives. The
graphs hold no rank, so rank 0's artifacts serve rank 1 too. The cold job is also the suite's check that
the product default under Inductor trains like eager FSDP2 (one cold Inductor compile serves both checks).

Each run is a fresh Python process per rank: real gloo ranks (the numbers must be real to compare the
losses), a 2-block Llama under the default config (Inductor, regions, the default schedule). Two jobs of
two ranks: a cold one, then one whose rank 0 restarts on its own cache and whose rank 1 starts from an
empty cache with rank 0's artifacts.
"""

import collections
import dataclasses
import json
import os
import subprocess
import sys
import typing

import pytest

pytestmark = pytest.mark.inductor

SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
from torch._dynamo.utils import counters
from parity import Case, batch, build, loss_fn
import fsdp_compile as fc

mode, artifacts, rank, world_size, store = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
mode = mode.split(",")[rank]
if mode == "load":
    with open(artifacts, "rb") as f:
        torch.compiler.load_cache_artifacts(f.read())
fc.single_thread_gloo()
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world_size)
case = Case(n_layers=2)  # the tests' Llama, fully_shard per block and at the root
m, ref = build(case), build(case)  # ref: eager FSDP2, the oracle
compiled = fc.compile(m)
opts = [torch.optim.AdamW(x.parameters(), lr=1e-2) for x in (m, ref)]
losses, grad_diff = [], []
for step in range(3):
    tokens = batch(case, step, rank)
    pair = []
    for model, opt in zip((compiled, ref), opts):
        loss = loss_fn(case, model(tokens), tokens)
        loss.backward()
        pair.append(loss.item())
    grad_diff.append(max((a.grad.to_local() - b.grad.to_local()).abs().max().item() for a, b in zip(m.parameters(), ref.parameters())))
    grad = float(sum(p.grad.to_local().double().square().sum() for p in m.parameters()))
    for opt in opts:
        opt.step()
        opt.zero_grad()
    losses.append(pair)
param_diff = max((a.to_local() - b.to_local()).abs().max().item() for a, b in zip(m.parameters(), ref.parameters()))
if mode == "cold" and rank == 0:
    data, _ = torch.compiler.save_cache_artifacts()
    with open(artifacts, "wb") as f:
        f.write(data)
print("RESULT " + json.dumps({
    "inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k},
    "aot": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
    "loss": losses[-1][0],
    "losses": losses,  # [compiled, eager FSDP2] per step
    "grad_diff": grad_diff,
    "param_diff": param_diff,
    "dynamo_graphs": len(compiled.captured.dynamo),
    "collectives": [compiled.captured.collectives("forward"), compiled.captured.collectives("backward")],
    "records": len(compiled.captured.records),
    "grad": grad,
}))
"""


def _run(tmp_path, ranks: list[tuple[str, str]], job: str) -> list[dict]:
    """One process per rank, ``ranks[r]``: (its Inductor cache directory, its mode: cold | warm | load)."""
    script = tmp_path / "compile_once.py"
    script.write_text(SCRIPT)
    store = tmp_path / f"store_{job}"
    modes = ",".join(mode for _, mode in ranks)
    procs = []
    for rank, (cache_dir, _) in enumerate(ranks):
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": cache_dir,
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
        }
        args = [sys.executable, str(script), modes, str(tmp_path / "artifacts.bin"), str(rank), str(len(ranks)), str(store)]
        procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        outs = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        line = next(x for x in out.splitlines() if x.startswith("RESULT "))
        results.append(json.loads(line[len("RESULT "):]))
    return results


def _served(run: dict) -> None:
    """Forward and backward served from the FX graph cache, both via AOTAutograd's."""
    assert run["inductor"].get("fxgraph_cache_hit", 0) >= 2 and not run["inductor"].get("fxgraph_cache_miss"), run
    assert run["aot"].get("autograd_cache_hit", 0) >= 1, run


@pytest.mark.multirank  # two processes per job: real gloo ranks
def test_restarts_and_other_ranks_are_served(tmp_path):
    """Rank 0 restarting on its own cache directory is served by it; rank 1, on an empty one, by rank 0's
    artifacts (no rank in any graph: compile once, ship to every rank); both train as before."""
    cold = _run(tmp_path, [(str(tmp_path / "cache0"), "cold"), (str(tmp_path / "cache1"), "cold")], "cold")
    restarted = _run(tmp_path, [(str(tmp_path / "cache0"), "warm"), (str(tmp_path / "empty1"), "load")], "restart")
    for rank, (before, after) in enumerate(zip(cold, restarted)):
        assert before["inductor"].get("fxgraph_cache_miss", 0) >= 2 and not before["inductor"].get("fxgraph_cache_bypass"), before
        assert before["aot"].get("autograd_cache_saved", 0) >= 1, before
        _served(after)
        assert (after["loss"], after["grad"]) == (before["loss"], before["grad"]), rank
        # what the step reports about its collectives does not depend on the cache (the demo prints it)
        assert after["collectives"] == before["collectives"] and after["records"] == before["records"] == 2, (rank, after, before)
    assert cold[0]["collectives"][0]["all_gathers"] > 0 and cold[0]["collectives"][1]["all_gathers"] > 0  # resharded blocks re-gather
    # Inductor against eager FSDP2 (the product default: auto bucketing, reordering, regions). Inductor fuses
    # and reorders reductions (RMSNorm, softmax, the matmul epilogues), so the step is not bitwise; on this
    # tiny fp32 model it stays within 1e-5 on losses and 1e-4 on gradients and parameters after 3 AdamW steps
    for rank, r in enumerate(cold):
        assert r["dynamo_graphs"] == 1, r
        assert 1 <= r["collectives"][0]["all_gathers"] <= 3 and 1 <= r["collectives"][1]["reduce_scatters"] <= 3, r
        assert max(abs(a - b) for a, b in r["losses"]) < 1e-5, (rank, r["losses"])
        assert max(r["grad_diff"]) < 1e-4 and r["param_diff"] < 1e-4, (rank, r["grad_diff"], r["param_diff"])


ONE_RANK = r"""
import json, sys, torch, torch.distributed as dist
from torch._dynamo.utils import counters
import fsdp_compile as fc
from fsdp_compile.models import Llama, LlamaArgs, tensor_parallel
from torch.distributed.fsdp import fully_shard

store = sys.argv[1]
dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
torch.manual_seed(0)
model = Llama(LlamaArgs(vocab=256, dim=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq=64))
# torchao's float8 Linears (emulated) with FSDP2's float8 all-gather: torchao's autograd Functions; and its float8
# TP plan on a 1 x 1 mesh: DeviceMesh inputs, the region boundary's DTensor crossings
from torch.distributed.device_mesh import init_device_mesh
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from fsdp_compile.models import gloo_float8_all_gather

config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn != "output")
dp_tp = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
tensor_parallel(model, dp_tp["tp"], float8=True)
gloo_float8_all_gather()
mesh = {"mesh": dp_tp["dp"]}
for block in model.layers:
    fully_shard(block, **mesh)
fully_shard(model, **mesh)
compiled = fc.compile(model)
tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
out = compiled(tokens)
loss = out.full_tensor() if hasattr(out, "full_tensor") else out
loss = loss.float().logsumexp(-1).mean()
loss.backward()
grads = [p.grad.to_local().double().square().sum().item() for p in model.parameters()]
print("RESULT " + json.dumps({"aot": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
                              "loss": loss.item(), "grads": grads, "records": len(compiled.captured.records),
                              "regions": any(r["region"] for r in compiled.regions())}))
"""


@pytest.mark.parametrize("n_layers", [1, 2], ids=["inline", "region"])
def test_restarts_of_graphs_with_autograd_functions_and_meshes_are_served(tmp_path, n_layers):
    """AOTAutograd's cache serves the warm restart of a graph that calls autograd Functions (torchao's float8
    matmul; the region boundary's DTensor crossings), takes DeviceMeshes (TP) and, where a float8 block runs
    inline (one layer: no region), constructs torchao's float8 configs (NamedTuples, frozen dataclasses): torch
    2.13 cannot key any of them (``_torch/_aot_cache.py``), so such restarts traced and partitioned the step
    again. One model holds them all (float8 x TP on a 1 x 1 mesh). One process (gloo, world size 1: real numbers),
    so not ``multirank``: it runs beside the rank groups, not after them. Inductor; the restart computes what the
    cold run computed, bit for bit."""
    pytest.importorskip("torchao.float8", reason="torchao (the test extra) is not installed")
    script = tmp_path / "one_rank.py"
    script.write_text(ONE_RANK.replace("n_layers=2", f"n_layers={n_layers}"))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "TORCHINDUCTOR_COMPILE_THREADS": "1"}
    runs = []
    for job in ("cold", "warm"):
        p = subprocess.run([sys.executable, str(script), str(tmp_path / f"store_{job}")], env=env,
                           capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(next(x for x in p.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):]))
    cold, warm = runs
    assert cold["aot"].get("autograd_cache_saved", 0) >= 1 and not cold["aot"].get("autograd_cache_bypass"), cold
    assert warm["aot"].get("autograd_cache_hit", 0) >= 1 and not warm["aot"].get("autograd_cache_bypass"), warm
    assert (warm["loss"], warm["grads"]) == (cold["loss"], cold["grads"]) and warm["records"] == cold["records"] == 2
    assert warm["regions"] == cold["regions"] == (n_layers > 1), (cold, warm)


def test_autograd_function_and_mesh_keys():
    """What ``_torch/_aot_cache.py`` keys: a trampoline by its Function's class, source and package version
    (two classes, two keys; the same class, the same key; classes made per use, by their constants too), anything
    else as torch keys it; a DeviceMesh by its
    layout and process group names, the same for the same mesh in any process."""
    import torch
    from torch._dynamo.variables.misc import produce_trampoline_autograd_apply
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCachePickler
    from torch.distributed.device_mesh import init_device_mesh

    from dist_helpers import fake_process_group
    from fsdp_compile._extensions import Attach, LocalShards
    from fsdp_compile._torch import _aot_cache

    plain = AOTAutogradCachePickler._format_global_for_cache_key("torch", torch)
    with _aot_cache.keys():
        fmt = AOTAutogradCachePickler._format_global_for_cache_key
        a = fmt("f", produce_trampoline_autograd_apply(Attach))
        b = fmt("f", produce_trampoline_autograd_apply(LocalShards))
        assert a == fmt("f", produce_trampoline_autograd_apply(Attach)) and a != b
        assert a.startswith("# cache_key_autograd_function f: fsdp_compile._extensions.Attach "), a
        assert fmt("torch", torch) == plain
        # a region crossing's classes, made per kind: keyed by their constants too (a subclass's flatten context)
        from fsdp_compile.capture import boundary

        def crossing(ctx):
            return boundary.subclass_crossings((boundary.SubclassSpec(torch.Tensor, ("_data",), ctx, (4,), (1,)),))[0]

        one, same, other = crossing({"emulate": False}), crossing({"emulate": False}), crossing({"emulate": True})
        for f in ("inner", "rebuild", "direct"):
            key = fmt("f", produce_trampoline_autograd_apply(getattr(one, f)))
            assert key == fmt("f", produce_trampoline_autograd_apply(getattr(same, f)))
            assert key != fmt("f", produce_trampoline_autograd_apply(getattr(other, f)))
    with pytest.raises(Exception, match="was not found"):  # restored: torch's own, which cannot name it
        AOTAutogradCachePickler._format_global_for_cache_key("f", produce_trampoline_autograd_apply(Attach))
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        key = _aot_cache._mesh_key(mesh)
        assert key[:5] == ("DeviceMesh", "cpu", (2, 2), [0, 1, 2, 3], ("dp", "tp")) and len(key[5]) == 2, key


class _Pair(typing.NamedTuple):
    a: int
    b: int


@dataclasses.dataclass(frozen=True)
class _Frozen:
    a: int


@dataclasses.dataclass
class _Mutable:
    a: int


def test_value_classes_a_graph_constructs_are_keyed():
    """The classes ``_aot_cache.value_classes`` names for AOTAutograd's node check (torchao's ``ScaledMMConfig``,
    ``LinearMMConfig``, ``CastConfig`` in an inline float8 block): NamedTuples and frozen dataclasses, in subgraphs
    too, each keyed by its source; not a mutable dataclass or any other class, whose instance could change after
    it is built."""
    import torch
    import torch.fx as fx

    from fsdp_compile._torch import _aot_cache

    inner = fx.Graph()
    inner.output(inner.call_function(_Frozen, (1,)))
    graph = fx.Graph()
    for cls in (_Pair, _Mutable, collections.OrderedDict):
        graph.call_function(cls, (1, 2) if cls is _Pair else ())
    graph.output(graph.get_attr("sub"))  # a subgraph, as a region's body is held
    root = torch.nn.Module()
    root.sub = fx.GraphModule(torch.nn.Module(), inner)
    named = _aot_cache.value_classes(fx.GraphModule(root, graph))
    assert sorted(named) == [f"{__name__}._Frozen", f"{__name__}._Pair"], named
    assert named[f"{__name__}._Pair"] == _aot_cache._class_key(_Pair) and __name__ in named[f"{__name__}._Pair"]
