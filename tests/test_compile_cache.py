"""Warm restarts: a second process compiling the same model and config is served by Inductor's FX graph
cache and AOTAutograd's cache, and a process with an empty cache directory starts warm from artifacts saved
with ``torch.compiler.save_cache_artifacts`` (counters, not timings); all three report the same collectives.
The graphs hold no rank, so rank 0's artifacts serve rank 1 too.

Each run is a fresh Python process per rank: real gloo ranks (the numbers must be real to compare the
losses), a 2-block Llama under the default config (Inductor, regions, the default schedule).
"""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.inductor

SCRIPT = r"""
import json, sys, torch, torch.distributed as dist
from torch._dynamo.utils import counters
from models import Llama, LlamaArgs, shard
import fsdp_compile as fc

mode, artifacts, rank, world_size, store = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if mode == "load":
    with open(artifacts, "rb") as f:
        torch.compiler.load_cache_artifacts(f.read())
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world_size)
torch.manual_seed(0)
m = Llama(LlamaArgs(n_layers=2, dim=32, ffn_dim=64))
compiled = fc.compile(shard(m, m.layers))
tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
loss = compiled(tokens).float().logsumexp(-1).mean()
loss.backward()
if mode == "cold" and rank == 0:
    data, _ = torch.compiler.save_cache_artifacts()
    with open(artifacts, "wb") as f:
        f.write(data)
print("RESULT " + json.dumps({
    "inductor": {k: v for k, v in counters["inductor"].items() if "cache" in k},
    "aot": {k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
    "loss": loss.item(),
    "collectives": [compiled.captured.collectives("forward"), compiled.captured.collectives("backward")],
    "records": len(compiled.captured.records),
    "grad": float(sum(p.grad.to_local().double().square().sum() for p in m.parameters())),
}))
"""


def _run(tmp_path, cache_dirs: list[str], mode: str) -> list[dict]:
    """One process per rank (``len(cache_dirs)`` ranks, each with its own Inductor cache directory)."""
    script = tmp_path / "compile_once.py"
    script.write_text(SCRIPT)
    store = tmp_path / f"store_{mode}_{len(cache_dirs)}"
    procs = []
    for rank, cache_dir in enumerate(cache_dirs):
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": cache_dir,
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]),
        }
        args = [sys.executable, str(script), mode, str(tmp_path / "artifacts.bin"), str(rank), str(len(cache_dirs)), str(store)]
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


def test_second_process_hits_the_caches(tmp_path):
    (cold,) = _run(tmp_path, [str(tmp_path / "cache")], "cold")
    (warm,) = _run(tmp_path, [str(tmp_path / "cache")], "warm")
    (loaded,) = _run(tmp_path, [str(tmp_path / "empty")], "load")
    assert cold["inductor"].get("fxgraph_cache_miss", 0) >= 2 and not cold["inductor"].get("fxgraph_cache_bypass"), cold
    assert cold["aot"].get("autograd_cache_saved", 0) >= 1, cold
    for run in (warm, loaded):
        _served(run)
        assert (run["loss"], run["grad"]) == (cold["loss"], cold["grad"])
        # what the step reports about its collectives does not depend on the cache (the demo prints it)
        assert run["collectives"] == cold["collectives"] and run["records"] == cold["records"] == 2, (run, cold)
    assert cold["collectives"][0]["all_gathers"] > 0 and cold["collectives"][1]["all_gathers"] > 0, cold  # resharded blocks re-gather


def test_one_ranks_artifacts_serve_every_rank(tmp_path):
    """No rank in any graph: 2 gloo ranks compile with caches of their own; rank 0 saves its artifacts; in
    a new job both ranks start from empty caches with rank 0's artifacts and both are served by them
    (compile once, ship to every rank), training as before."""
    cold = _run(tmp_path, [str(tmp_path / "cold0"), str(tmp_path / "cold1")], "cold")
    loaded = _run(tmp_path, [str(tmp_path / "new0"), str(tmp_path / "new1")], "load")
    for rank, (before, after) in enumerate(zip(cold, loaded)):
        _served(after)
        assert (after["loss"], after["grad"]) == (before["loss"], before["grad"]), rank
        assert after["collectives"] == before["collectives"], rank
