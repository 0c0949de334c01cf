"""Pipeline parallelism with FSDP stages (``torch.distributed.pipelining``), each stage's module compiled by
``fsdp_compile.compile_stage`` and handed to ``PipelineStage``: 4 gloo ranks, pp 2 x dp 2, one group for the
file, bitwise against eager FSDP2 stages under the same schedule, under ``aot_eager``.

Our Llama split into stages (embedding with the first, norm and output with the last), 4 micro-batches, 2
optimizer steps, under ``ScheduleGPipe``, ``Schedule1F1B`` and ``ScheduleInterleaved1F1B`` (2 stages per
rank: the runtime schedule, with its UNSHARD/RESHARD actions). The two data-parallel replicas train on
sequences of different lengths. The stage sets ``set_requires_gradient_sync(False)`` and
``set_reshard_after_backward(False)`` before each micro-batch's backward and reduces at REDUCE_GRAD: the
compiled stages reduce-scatter once per FSDP module a step (not per micro-batch), from one compiled graph
each, and the data-parallel peers issue the same collectives. And torchtitan's own pipeline split of its Llama3
(``pipeline_llm``, pp 2 x dp_shard 2, 1F1B), where installed.
"""

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from dist_helpers import run_ranks, run_scenarios, scenario
from parity import record_step
from torchtitan_cases import torchtitan_missing

pytestmark = pytest.mark.multirank

MICROBATCHES = 4


class LlamaStage(nn.Module):
    """Stage ``index`` of ``n_stages`` of our Llama ``full``: its share of the blocks, the embedding in the first
    stage, the final norm and output in the last (torchtitan's split)."""

    def __init__(self, full, index: int, n_stages: int):
        super().__init__()
        per = len(full.layers) // n_stages
        self.tok_embeddings = full.tok_embeddings if index == 0 else None
        self.layers = nn.ModuleList(full.layers[index * per:(index + 1) * per])
        last = index == n_stages - 1
        self.norm, self.output = (full.norm, full.output) if last else (None, None)
        self.register_buffer("rope", full.rope, persistent=False)

    def forward(self, x):
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        for layer in self.layers:
            x = layer(x, self.rope)
        return x if self.output is None else self.output(self.norm(x))


def _loss(out, target):
    return F.cross_entropy(out.flatten(0, 1), target.flatten())


def pipeline_worker(rank, world_size, *, schedule: str, stages_per_rank: int, mp: bool):
    """Eager FSDP2 stages and compiled ones, each under its own ``schedule``, trained side by side (``mp``: bf16
    parameters, fp32 reduce: the micro-batches' gradients accumulate in fp32, as FSDP2 keeps them)."""
    import fsdp_compile as fc
    import fsdp_compile._pipeline as pipeline
    from fsdp_compile.models import Llama, LlamaArgs
    from fsdp_compile.report import count_collectives
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    n_stages = 2 * stages_per_rank
    indices = [pp + 2 * k for k in range(stages_per_rank)]  # the interleaved schedules' stage-to-rank map

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp else MixedPrecisionPolicy()

    def build():
        torch.manual_seed(0)
        full = Llama(LlamaArgs(n_layers=n_stages))
        mods = [LlamaStage(full, i, n_stages) for i in indices]
        for m in mods:
            for block in m.layers:
                fully_shard(block, mesh=mesh["dp"], mp_policy=policy)
            fully_shard(m, mesh=mesh["dp"], mp_policy=policy)
        return mods

    def make_schedule(mods):
        stages = [PipelineStage(m, i, n_stages, torch.device("cpu"), group=mesh["pp"].get_group())
                  for m, i in zip(mods, indices)]
        if schedule == "Interleaved1F1B":
            return ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=_loss)
        return {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule](stages[0], MICROBATCHES, loss_fn=_loss)

    eager, model = build(), build()
    compiled = [fc.compile_stage(m, backend="aot_eager", bucket="fsdp_group") for m in model]
    assert all(isinstance(c, torch.distributed.fsdp.FSDPModule) for c in compiled)
    runs = {"eager": make_schedule(eager), "compiled": make_schedule(compiled)}
    opts = [torch.optim.AdamW(nn.ModuleList(mods).parameters(), lr=1e-2) for mods in (eager, model)]
    reduced = []
    real_reduce_scatter = pipeline.reduce_scatter
    pipeline.reduce_scatter = lambda args, grads, params: (reduced.append(len(grads)), real_reduce_scatter(args, grads, params))[1]
    seq = 16 if dp == 0 else 12  # the data-parallel replicas' batches differ in shape
    out = {"losses": {"eager": [], "compiled": []}, "grad_diff": [], "param_diff": [], "reduce_scatters": []}
    try:
        for step in range(2):
            gen = torch.Generator().manual_seed(100 * step + dp)
            x = torch.randint(0, 256, (MICROBATCHES, seq), generator=gen)
            target = torch.randint(0, 256, (MICROBATCHES, seq), generator=gen)
            before = len(reduced)
            for name, run in runs.items():
                losses = []
                if pp == 0:
                    run.step(x)
                else:
                    run.step(target=target, losses=losses)
                out["losses"][name].append([loss.item() for loss in losses])
            out["reduce_scatters"].append(len(reduced) - before)
            record_step(out, nn.ModuleList(eager), nn.ModuleList(model), opts)
    finally:
        pipeline.reduce_scatter = real_reduce_scatter
    out["fsdp_modules"] = sum(len(c.plan.groups) for c in compiled)  # with parameters (an interleaved middle stage's root has none)
    out["dynamo_graphs"] = [len(c.captured.dynamo) for c in compiled]
    out["backward"] = [count_collectives(c.captured.backward) for c in compiled]
    out["signature"] = [[str(n.target) for g in c.captured.forward + c.captured.backward for n in g.graph.nodes
                         if "c10d" in str(n.target)] for c in compiled]
    return out


def titan_worker(rank, world_size):
    """torchtitan's own pipeline split of its Llama3 debug model (``pipeline_llm``: 2 layers, pp 2 x dp_shard 2,
    1F1B, 4 micro-batches, its loss with a global valid-token count), each stage's module compiled after
    materialization and put back on its stage as torchtitan puts a torch.compile'd one (``stage.submod = m``)."""
    import tempfile

    import torchtitan.distributed.utils as dist_utils
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan_cases import SEQ, VOCAB, _copy_state, _model_config, _on_cpu, max_diff

    import fsdp_compile as fc

    _on_cpu()
    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", pipeline_parallel_degree=2,
                                    pipeline_parallel_schedule="1F1B")
    dims = ParallelDims.from_config(parallelism, world_size)
    dims.build_mesh()
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    cfg, parallelize = _model_config("llama3", 2)
    training = TrainingConfig(local_batch_size=MICROBATCHES, seq_len=SEQ)

    def make(tmp):
        loss_fn = CrossEntropyLoss.Config(global_vocab_size=VOCAB).build(compile_config=CompileConfig())
        with torch.device("meta"):
            m = cfg.build()
        schedule, parts, first, last = pipeline_llm(
            m, parallel_dims=dims, training=training, parallelism=parallelism, compile_config=CompileConfig(),
            ac_config=None, dump_folder=tmp, device=torch.device("cpu"), model_config=cfg, parallelize_fn=parallelize,
            loss_fn=loss_fn)
        for part in parts:
            for module in part.modules():
                if isinstance(module, FSDPModule):
                    module.set_force_sum_reduction_for_comms(True)  # as the torchtitan harness (torchtitan_cases.build)
            part.to_empty(device="cpu")
        return schedule, parts, first, last

    with tempfile.TemporaryDirectory() as tmp:
        eager, comp = make(tmp), make(tmp)
    torch.manual_seed(0)
    with torch.no_grad():
        for part in eager[1]:
            part.init_weights(buffer_device=None)
    for a, b in zip(eager[1], comp[1]):
        _copy_state(a, b)
    stage = comp[0]._stage
    stage.submod = compiled = fc.compile_stage(stage.submod, backend="aot_eager")
    params = [[p for part in run[1] for p in part.parameters()] for run in (eager, comp)]
    opts = [torch.optim.AdamW(ps, lr=8e-4) for ps in params]
    batch_mesh = dims.get_mesh("batch")
    out = {"losses": {"eager": [], "compiled": []}, "grad_diff": [], "param_diff": [], "grads": []}
    for step in range(2):
        gen = torch.Generator().manual_seed(1000 * step + batch_mesh.get_local_rank())
        tokens = torch.randint(0, VOCAB, (MICROBATCHES, SEQ), generator=gen)
        labels = torch.randint(0, VOCAB, (MICROBATCHES, SEQ), generator=gen)
        labels[0, :3] = IGNORE_INDEX
        valid = dist_utils.dist_sum_tensor((labels != IGNORE_INDEX).sum(), batch_mesh)
        for name, (schedule, _, first, last) in zip(("eager", "compiled"), (eager, comp)):
            losses = [] if last else None
            schedule.step(*((tokens,) if first else ()), target=labels if last else None, losses=losses,
                          loss_kwargs={"global_valid_tokens": valid}, return_outputs=False)
            out["losses"][name].append([loss.item() for loss in losses or []])
        out["grads"].append(sum(p.grad is not None for p in params[1]))
        out["grad_diff"].append(max_diff([p.grad for p in params[0]], [p.grad for p in params[1]]))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        out["param_diff"].append(max_diff(*params))
    out["dynamo_graphs"] = len(compiled.captured.dynamo)
    return out


SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2}  # stages per rank
MIXED_PRECISION = {"1F1B"}


def pipeline_scenarios(rank, world_size):
    scenarios = {name: functools.partial(pipeline_worker, schedule=name, stages_per_rank=n, mp=name in MIXED_PRECISION)
                 for name, n in SCHEDULES.items()}
    if torchtitan_missing() is None:
        scenarios["torchtitan"] = titan_worker
    return run_scenarios(scenarios, rank, world_size)


@pytest.fixture(scope="module")
def results():
    return run_ranks(pipeline_scenarios, 4, timeout=900)


@pytest.mark.parametrize("name", SCHEDULES)
def test_pipeline_stages_match_eager(results, name):
    per_rank = scenario(results, name)
    for rank, r in enumerate(per_rank):
        assert r["losses"]["eager"] == r["losses"]["compiled"], (rank, r["losses"])
        assert max(r["grad_diff"]) == 0.0 and max(r["param_diff"]) == 0.0, (rank, r)
        # one reduce-scatter per FSDP module a step, at REDUCE_GRAD; none in any micro-batch's backward
        assert r["reduce_scatters"] == [r["fsdp_modules"]] * 2, r
        assert all(b["reduce_scatters"] == 0 for b in r["backward"]), r["backward"]
        assert r["dynamo_graphs"] == [1] * SCHEDULES[name], r["dynamo_graphs"]  # one mode: no sync
    assert all(r["losses"]["eager"][0] for r in per_rank[2:]), "the last stage's ranks got no losses"
    for a, b in ((0, 1), (2, 3)):  # data-parallel peers (same stages, batches of different shapes): the same collectives
        assert per_rank[a]["signature"] == per_rank[b]["signature"]


@pytest.mark.skipif(torchtitan_missing() is not None, reason=str(torchtitan_missing()))
def test_torchtitan_pipeline_stages_match_eager(results):
    per_rank = scenario(results, "torchtitan")
    for rank, r in enumerate(per_rank):
        assert r["losses"]["eager"] == r["losses"]["compiled"], (rank, r["losses"])
        assert max(r["grad_diff"]) == 0.0 and max(r["param_diff"]) == 0.0, (rank, r)
        assert min(r["grads"]) > 0 and r["dynamo_graphs"] == 1, (rank, r)
    assert all(len(step) == MICROBATCHES for r in per_rank[2:] for step in r["losses"]["eager"])
