"""Eager FSDP2 versus torch.compile versus fsdp_compile on the same model, data and machine.

    torchrun --nproc-per-node 2 bench/compiled_vs_eager.py [--model small|tiny|hf-llama] [--steps 20] [--quick]
    torchrun --nproc-per-node 4 bench/compiled_vs_eager.py --tp 2 [--quick]     # FSDP over dp x TP over tp
    torchrun --nproc-per-node 2 bench/compiled_vs_eager.py --float8 [--quick]   # torchao float8 all-gather
    torchrun --nproc-per-node 4 bench/compiled_vs_eager.py --tp 2 --float8 --quick  # both (issue 46)
    torchrun --nproc-per-node 4 bench/compiled_vs_eager.py --pp 2 --quick      # pipeline: pp 2 x dp 2 FSDP stages
    torchrun --nproc-per-node 2 bench/compiled_vs_eager.py --replicate [--model hf-llama]  # replicate vs DDP (issue 51)
    torchrun --nproc-per-node 1 bench/compiled_vs_eager.py --device cuda --model llama-1b --mp bf16 --batch 2 \
        --variants torch.compile fc                                          # one GPU (bench/gpu.sh)

Models: ``small``/``tiny`` (fsdp_compile.models.Llama), ``hf-llama`` (transformers' LlamaForCausalLM: hidden 256,
intermediate 688, 8 heads, vocab 4096, 4 layers, sdpa; batch 4 x 128 unless set), ``llama-1b`` (the same Llama
at 0.95B parameters for one GPU: dim 2048, 16 layers of 16 heads, FFN 5632, vocab 32000; sequences of 2048
unless set; with ``--mp bf16`` and batch 2 one variant holds 15 GB of fp32 parameters, gradients and AdamW
state, so eager, torch.compile and fc fit one 80 GB H100 together).
Device: ``--device auto`` (the default) runs on GPUs with NCCL when CUDA is present, else on CPU with gloo;
``cuda`` insists on GPUs (one per rank); ``cpu`` hides them. ``--mp bf16``: FSDP2's MixedPrecisionPolicy(bf16
parameters, fp32 reduce) on every fully_shard call (compute-only: the model cast to bf16).
Variants (each its own model from the same seed, AdamW (``--optimizer``: fused, as torchtitan's default, or
foreach), the same batches):
  eager             torch's fully_shard, no compile
  torch.compile     torch.compile(model) on the fully_shard model: FSDP2's hooks stay eager (graph breaks)
  compute-only      the same model unsharded, torch.compile'd, no collectives: the bound a perfect overlap
                    of communication would reach (every rank computes its own batch, as in the others);
                    with --tp, the same TP model without FSDP: TP's collectives stay, FSDP's are gone
  fc                fsdp_compile.compile(model): the default (bucket="auto", reorder=True, regions)
  comm-only         fc's collectives alone, no compute (CommOnly says how): with compute-only, the floors
                    of a step where the ranks share their cores with gloo (CPU), printed after the table
  fc:cudagraphs     fc with CompileConfig(cudagraphs=True): forward and backward replayed as CUDA graphs
                    (CUDA only; skipped elsewhere)
  fc:fsdp_group     one collective per FSDP module, where eager FSDP2 issues them (reorder=False)
  fc:no-reorder     bucket="auto" with reorder=False: buckets planned as fc's are, but judged without overlap, and
                    each collective where eager FSDP2 issues it (no prefetch, no deferred waits); beside fc, what
                    the overlap gains or costs (the in-graph AG/RS column says whether the buckets differ)
  fc:no-regions     the default without regions (every block compiled on its own)
  fc:free-overlap   (CPU) the default planned with cpu-gloo's comm_cpu_share at 0, as the profile was before
                    2026-11-30: communication hidden behind compute taken as free; beside fc, what pricing the
                    cores gloo takes from compute changes in the plan and the step
  fc:no-reshard     the default on a model sharded with fully_shard(reshard_after_forward=False): the gathered
                    parameters kept from forward to backward, no re-gather, as the SimpleFSDP variant does (it is
                    compiled without graph_trainer's memory policy, which is what recomputes its all-gathers)
  simplefsdp        a peer, when torchtitan is importable: torchtitan's SimpleFSDP (graph_trainer's
                    data_parallel, mode "fully_shard", its MixedPrecisionPolicy with --mp) compiled with
                    fullgraph=True and its transformer-block bucketing (torch's manual_overlap_bucketing over
                    the embedding, each block, then norm + output), as graph_trainer's JIT mode does; its
                    Inductor settings (no buffer reuse, no peak-memory or comm reordering, the pass as
                    post_grad_custom_post_pass) are given to this compile only, not set globally; on
                    CPU, torch's roofline estimates get this machine's figures (_cpu_roofline says why)
  simplefsdp:reshard  SimpleFSDP as above with its parameters resharded after forward, like fc's default: each
                    all-gather (with its cast) recomputed in backward under torch.utils.checkpoint with a
                    selective policy, as torchtitan's SimpleFSDP did for reshard_after_forward=True before 0.3.0
                    and its graph_trainer's default memory policy does (reshard_after_forward "default" without
                    pipeline parallelism is True); the like-for-like peer of fc, where simplefsdp is fc:no-reshard's
With --float8: every Linear but the output is torchao's Float8Linear (emulated matmuls off sm_89+ GPUs, so on
a CPU the compute is not float8's); the variants are eager, eager:float8-ag, torch.compile, fc, fc:float8-ag
and compute-only, where ":float8-ag" sets enable_fsdp_float8_all_gather=True and precomputes the scales after
each optimizer step (precompute_float8_dynamic_scale_for_fsdp, as torchtitan does); the others gather the
weights in their dtype and cast them in each Float8Linear, inside the compiled graph where there is one
(Inductor's scale can differ from eager's in the last bit, which flips float8 roundings: their losses drift
from eager's, as any compiled float8 model's do).
With --tp N (Llama models): torchtitan's TP plan (fsdp_compile.models.tensor_parallel: sequence parallel,
column/row-parallel projections) on the tp dim of a (world/N, N) mesh, fully_shard over dp; the ranks of
one TP group share their batch. With --float8 too, the float8 Linears take torchao's float8 TP styles
(Float8ColwiseParallel / Float8RowwiseParallel / PrepareFloat8ModuleInput: ``tensor_parallel(float8=True)``);
on gloo, which has no float8 dtypes, their float8 activation all-gathers go as uint8 (gloo_float8_all_gather).
With --offload: CPUOffloadPolicy on every fully_shard call (pinned on GPUs: FSDP2's seed configuration), variants
eager and fc only (issue 50's target: fc's step within 1.3x eager's).
With --pp N: pipeline parallelism with FSDP stages (bench/_pipeline_bench.py says what runs and counts): eager,
fc (fc.compile_stage) and compute-only, the split and 1F1B schedule of tests/test_pipeline_multirank.py.
Bytes per mesh dim (``collective_bytes_per_dim``, dp / tp): eager variants' collectives counted as they run (a
dispatch mode over the step: FSDP2's c10d calls and DTensor's functional collectives, TP's and the float8
scale precompute's); fc variants' from their first forward and backward graphs, plus the scale precompute run
eagerly after the optimizer step; None for compute-only and torch.compile (their graphs are not ours to read).
Per variant: first-step time (includes the compile, from a cold Inductor cache unless --warm-cache: each
variant's own, in-memory caches cleared; Dynamo's code caches are shared, since one model's compiled
frames may serve another's calls wherever the guards pass: ``first_step_dynamo_graphs`` counts the graphs
Dynamo compiled in it, and one served that way compiles fewer: on an H200 SimpleFSDP's first step took 5.6 s
after torch.compile's on the same model class, 39 s without it),
median and p10/p90 step time over timed steps run in interleaved windows (drift hits every variant
alike), the cost model's predicted step time next to it (cpu-gloo on CPU; for eager: the same graphs
with collectives where eager issues them), collectives per step (Python c10d calls, i.e. eager hooks,
and collectives inside compiled graphs) and the bytes they move, peak step memory (tensor bytes allocated by one step above
those live before it), final loss versus eager.
Writes bench/results/compiled_vs_eager_<model>.json and .png (``--stem`` names them otherwise); on GPUs the
JSON names the device, the GPU count and the torch, CUDA and Triton versions. Gloo on CPU; NCCL on GPUs.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time

if "--warm-cache" not in sys.argv:  # before torch reads its config: every variant compiles from scratch
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="fsdp_compile_bench_")
if "--device=cpu" in sys.argv or any(a == "--device" and b == "cpu" for a, b in zip(sys.argv, sys.argv[1:])):
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch initializes CUDA: H.init_ranks then picks gloo on CPU

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(__file__))
import _harness as H  # noqa: E402

import fsdp_compile as fc  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))
from eager_calls import count_eager_collectives  # noqa: E402  (the tests' instrumentation)
from parity import FREE_OVERLAP  # noqa: E402  (cpu-gloo with its contention share at 0: fc:free-overlap)
from fsdp_compile.models import SIZES, Llama, LlamaArgs, gloo_float8_all_gather, llama_blocks, tensor_parallel  # noqa: E402
from fsdp_compile.report import collective_bytes, count_collectives, with_region_bodies  # noqa: E402

HF_VOCAB = 4096
# Benchmark-only sizes beside fsdp_compile.models.SIZES: "llama-1b" fills one 80 GB GPU with three variants
# (eager, torch.compile, fc) of bf16 mixed precision at batch 2 x 2048.
BENCH_SIZES = {"llama-1b": LlamaArgs(vocab=32000, dim=2048, n_layers=16, n_heads=16, ffn_dim=5632, max_seq=2048)}
MODEL_SIZES = {**SIZES, **BENCH_SIZES}
MP = {None: None, "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


_MESH = None  # the (dp, tp) mesh of --tp, built once


def float8(model: torch.nn.Module, model_name: str, device: torch.device, all_gather: bool) -> None:
    """torchao's float8 training on every Linear but the output projection (as torchtitan converts)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    emulate = device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather, emulate=emulate)
    output = "lm_head" if model_name == "hf-llama" else "output"
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn != output)


def simple_fsdp_missing() -> str | None:
    """Why the simplefsdp variant cannot run here, or None."""
    try:
        from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing  # noqa: F401
        from torchtitan.experiments.graph_trainer import simple_fsdp  # noqa: F401
    except ImportError as e:
        return (f"needs torchtitan 0.3.0's graph_trainer ({e}): python3 -m pip install torchtitan==0.3.0 --no-deps "
                "&& python3 -m pip install spmd-types==0.3.1 tyro==1.0.16")
    return None


def transformer_block_buckets(model_name: str, n_layers: int) -> list:
    """graph_trainer's bucket plan (common_utils.get_default_transformer_block_buckets) in this model's
    names: the embedding, one bucket per block, then the final norm with the output projection."""
    if model_name == "hf-llama":
        return ["model.embed_tokens", *(f"model.layers.{i}" for i in range(n_layers)), ["model.norm", "lm_head"]]
    return ["tok_embeddings", *(f"layers.{i}" for i in range(n_layers)), ["norm", "output"]]


def _cpu_roofline() -> None:
    """torch's overlap scheduler (under manual_overlap_bucketing) estimates every compute node with a
    roofline that asks Triton for the GPU's DRAM bandwidth, and fails without a GPU driver ("0 active
    drivers", ../shared/probes/README.md). On CPU, this process gives it this machine's measured figures
    instead: fsdp_compile's cpu-gloo profile (bench/calibrate_cpu_gloo.py), the one fc's planner uses."""
    import torch.utils._runtime_estimation as estimation
    from fsdp_compile.passes.cost_model import get_profile

    cpu = get_profile("cpu-gloo")
    estimation.get_gpu_dram_gbps = lambda: cpu.mem_bw / 1e9
    estimation.get_device_tflops = lambda dtype: (cpu.matmul_flops_fp32 if dtype == torch.float32
                                                  else cpu.matmul_flops_lowp) / 1e12


def _regather_policy():
    """torchtitan's SimpleFSDP before 0.3.0 (simple_fsdp.py's fsdp_policy): recompute the all-gather, its wait and
    the parameter's cast in backward, save everything else."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    recompute = {torch.ops._c10d_functional.all_gather_into_tensor.default,
                 torch.ops._c10d_functional.wait_tensor.default, torch.ops.aten._to_copy.default}

    def policy(ctx, func, *args, **kwargs):
        return CheckpointPolicy.MUST_RECOMPUTE if func in recompute else CheckpointPolicy.MUST_SAVE

    return create_selective_checkpoint_contexts(policy)


def simple_fsdp_reshard(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (SimpleFSDP's, with wrapper classes of its own: ``build``) with every parameter resharded after
    forward, re-gathered in backward: each of its ``ReplicateComputation`` parametrizations (held by the property
    SimpleFSDP's wrapper class gives each parameter) marked, and the class's forward running a marked one's
    all-gather under ``torch.utils.checkpoint`` with ``_regather_policy`` (what SimpleFSDP's forward did with
    ``reshard_after_forward=True`` before 0.3.0)."""
    from torch.utils.checkpoint import checkpoint
    from torchtitan.experiments.graph_trainer import simple_fsdp as S

    cls = S.ReplicateComputation
    if not getattr(cls, "_bench_reshard", False):
        own = cls.forward

        def forward(self, x):
            if not getattr(self, "bench_reshard", False) or not S._active_parametrization:
                return own(self, x)
            return checkpoint(self.replicate_compute, x, use_reentrant=False, context_fn=_regather_policy)

        cls.forward, cls._bench_reshard = forward, True
    marked = 0
    for module in model.modules():
        for name in module._parameters:
            prop = getattr(type(module), name, None)
            cells = getattr(getattr(prop, "fget", None), "__closure__", None) or ()
            for cell in cells:
                if isinstance(cell.cell_contents, cls):
                    cell.cell_contents.bench_reshard = True
                    marked += 1
    assert marked == sum(1 for _ in model.parameters()), (marked, "SimpleFSDP parametrizations found")
    return model


class _Inner(torch.nn.Module):
    """``inner``, called: a module whose own forward Dynamo enters first (``compile_simple_fsdp``)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)


def compile_simple_fsdp(model: torch.nn.Module, model_name: str, backend: str, regather: bool = False):
    """graph_trainer's JIT compile (compile.py, jit_backend.py) with transformer_block_bucketing. ``regather``
    (``simple_fsdp_reshard``'s model): under aot_eager, AOTAutograd's min-cut partitioner, which honors the
    recompute policy (Inductor's is that one; AOTAutograd's default partitioner saves the all-gathers)."""
    from functools import partial

    n_layers = len(model.model.layers if model_name == "hf-llama" else model.layers)
    buckets = transformer_block_buckets(model_name, n_layers)
    if model_name == "hf-llama":
        # transformers' forward is a decorator's wrapper taking (*args, **kwargs), so Dynamo names the model
        # L['args'][0] and torch's module paths (graph_view._clean_stack_name) no longer match the plan's: its
        # bucketing found no module and left every parameter's collective alone (39 all-gathers, 39
        # reduce-scatters on 4 layers). Called from a module of ours, the model is L['self'].inner.
        model = _Inner(model)
        buckets = [[f"inner.{n}" for n in b] if isinstance(b, list) else f"inner.{b}" for b in buckets]
    if not any(p.is_cuda for p in model.parameters()):
        _cpu_roofline()
    if backend == "aot_eager":
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
        from torchtitan.experiments.graph_trainer.fsdp_passes import transformer_block_bucketing_reordering_pass

        pass_ = partial(transformer_block_bucketing_reordering_pass, fsdp_manual_buckets=buckets)
        return torch.compile(model, fullgraph=True, backend=aot_autograd(
            fw_compiler=pass_, bw_compiler=pass_, keep_inference_input_mutations=True,
            partition_fn=min_cut_rematerialization_partition if regather else default_partition))
    from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing

    def bucketing(graph: torch.fx.Graph):
        before = sum(count_collectives([graph.owning_module]).values())
        out = manual_overlap_bucketing(graph.owning_module, module_bucket_plans=buckets, insert_overlap_deps=True)
        after = sum(count_collectives([graph.owning_module]).values())
        if before > len(buckets) and after == before:  # a peer that buckets nothing is not SimpleFSDP's step
            raise RuntimeError(f"SimpleFSDP's bucketing matched none of the plan's modules ({buckets[:2]}...): "
                               f"{before} collectives left as they were")
        return out

    # the settings jit_backend.py writes into torch._inductor.config, scoped to this compile (forward and backward)
    options = {"allow_buffer_reuse": False, "reorder_for_peak_memory": False,
               "reorder_for_compute_comm_overlap": False, "post_grad_custom_post_pass": bucketing}
    return torch.compile(model, fullgraph=True, backend="inductor", options=options)


# The variants, in the order they run (each its own model; the module docstring says what each is)
VARIANTS = ["eager", "torch.compile", "compute-only", "fc", "comm-only", "fc:cudagraphs", "fc:fsdp_group", "fc:no-reorder",
            "fc:no-regions", "fc:free-overlap", "fc:no-reshard", "simplefsdp", "simplefsdp:reshard"]
FLOAT8_VARIANTS = ["eager", "eager:float8-ag", "torch.compile", "compute-only", "fc", "fc:no-regions", "fc:float8-ag"]
FC_OVERRIDES = {"fc:fsdp_group": dict(bucket="fsdp_group", reorder=False), "fc:no-reorder": dict(reorder=False),
                "fc:no-regions": dict(regions=False), "fc:cudagraphs": dict(cudagraphs=True),
                "fc:free-overlap": dict(hardware=FREE_OVERLAP)}
SHARD_WITH = {"compute-only": False, "simplefsdp": "simplefsdp", "simplefsdp:reshard": "simplefsdp:reshard",
              "fc:no-reshard": "no-reshard"}  # build()'s ``sharded``


def check_variants(asked, known, mode: str) -> None:
    """``--variants`` names only variants of this run's mode (a misspelt or other mode's name is not dropped unsaid)."""
    unknown = [v for v in asked or () if v not in known]
    if unknown:
        raise SystemExit(f"--variants {' '.join(unknown)}: not a variant of {mode}; its variants: {' '.join(known)}")


def make_variant(name: str, model_name: str, backend: str):
    """What turns the model ``build`` made for variant ``name`` into the callable it trains."""
    if name.startswith("eager"):
        return lambda m: m
    if name in ("torch.compile", "compute-only"):
        return lambda m: torch.compile(m, backend=backend)
    if name.startswith("simplefsdp"):
        return lambda m: compile_simple_fsdp(m, model_name, backend, regather=name == "simplefsdp:reshard")
    return lambda m: fc.compile(m, backend=backend, **FC_OVERRIDES.get(name, {}))


def build(model_name: str, device: torch.device, sharded: bool | str = True, tp: int = 1, float8_ag: bool | None = None,
          mp: str | None = None, offload: bool = False):
    """``sharded``: True, torch's fully_shard per block and at the root; "no-reshard", the same with
    ``reshard_after_forward=False``; False, not sharded; "simplefsdp", torchtitan's SimpleFSDP over all ranks.
    ``float8_ag``: None, no float8; else torchao's float8 Linears, with the float8 all-gather or not. ``mp``: a
    key of ``MP``, FSDP2's mixed precision on every fully_shard call (unsharded: the model cast; SimpleFSDP: its
    own policy of the same dtypes)."""
    torch.manual_seed(0)
    with torch.device(device):
        if model_name == "hf-llama":
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = LlamaConfig(vocab_size=HF_VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                              num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256,
                              attn_implementation="sdpa", use_cache=False)  # training: no KV cache
            model, blocks = LlamaForCausalLM(cfg), None
            blocks = list(model.model.layers)
        else:
            model = Llama(MODEL_SIZES[model_name])
            blocks = llama_blocks(model)
    if float8_ag is not None:
        float8(model, model_name, device, float8_ag)
    mesh = {}
    if tp > 1:
        global _MESH
        if _MESH is None:
            from torch.distributed.device_mesh import init_device_mesh

            _MESH = init_device_mesh(device.type, (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
        # float8: torchao's float8 TP styles on the float8 Linears (torchtitan's float8 tensorwise TP)
        tensor_parallel(model, _MESH["tp"], float8=float8_ag is not None)
        mesh = {"mesh": _MESH["dp"]}
    if not sharded:
        return model.to(MP[mp].param_dtype) if mp else model
    if sharded in ("simplefsdp", "simplefsdp:reshard"):
        from torch.distributed.device_mesh import init_device_mesh
        from torchtitan.experiments.graph_trainer import simple_fsdp as S

        policy = S.MixedPrecisionPolicy(MP[mp].param_dtype, MP[mp].reduce_dtype) if mp else None
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        if sharded == "simplefsdp":
            return S.data_parallel(model, mesh, mode="fully_shard", mp_policy=policy)
        # SimpleFSDP gives all modules of one class one wrapper class, whose properties hold the first model's
        # parametrizations: this model gets classes of its own, so that marking them leaves the other variant's
        saved = dict(S._wrap_class_cache)
        S._wrap_class_cache.clear()
        try:
            return simple_fsdp_reshard(S.data_parallel(model, mesh, mode="fully_shard", mp_policy=policy))
        finally:
            S._wrap_class_cache.clear()
            S._wrap_class_cache.update(saved)
    if mp:
        mesh["mp_policy"] = MP[mp]
    if sharded == "no-reshard":
        mesh["reshard_after_forward"] = False
    if offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        mesh["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in blocks:
        fully_shard(block, **mesh)
    return fully_shard(model, **mesh)


def logits_of(model_name: str, out):
    return out.logits if model_name == "hf-llama" else out


class Variant:
    def __init__(self, name: str, model_name: str, device: torch.device, make, sharded: bool | str = True, tp: int = 1,
                 float8_ag: bool | None = None, mp: str | None = None, offload: bool = False, optimizer: str = "fused"):
        self.model = build(model_name, device, sharded, tp, float8_ag, mp, offload)
        self.precompute = None  # with the float8 all-gather: torchao's scale precompute, after each optimizer step
        if float8_ag:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            self.precompute = precompute_float8_dynamic_scale_for_fsdp
        self.runner = make(self.model)
        # llama-1b diverged at 3e-3 (its loss rose to 11-15 in 25 steps on an H100), which made its loss
        # deltas between variants meaningless
        self.opt = H.adamw(self.model.parameters(), 3e-4 if model_name == "llama-1b" else 3e-3, optimizer)
        self._records(name, model_name)

    def _records(self, name: str, model_name: str) -> None:
        """What the run records per variant (main fills them in)."""
        self.name, self.model_name = name, model_name
        self.times: list[float] = []
        self.faults: list[int] = []  # minor page faults of this process per timed step (``H.minor_faults``)
        self.first_step_s = None
        self.first_step_graphs: int | None = None
        self.peak_bytes = 0
        self.peaks: list[int] = []
        self.loss = None
        self.eager_calls = None
        self.eager_bytes = None
        self.count = None  # a BytesByDim while a step counts its collectives
        self.bytes_per_dim = None

    def step(self, tokens: torch.Tensor) -> float:
        dist.barrier()
        count = self.count or contextlib.nullcontext()  # BytesByDim, on the step that counts collectives
        t0 = time.perf_counter()
        with count if self.name.startswith("eager") else contextlib.nullcontext():  # compiled ones: their graphs
            logits = logits_of(self.model_name, self.runner(tokens[:, :-1]))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        if self.precompute is not None:
            with count:
                self.precompute(self.model)
        if tokens.is_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.loss = loss.item()
        return dt

    def predicted_ms(self, stage: str = "after") -> float | None:
        """The cost model's step time for the first forward + backward graphs (``stage="before"``: as
        captured, before bucketing and reordering)."""
        captured = getattr(self.runner, "captured", None)
        if captured is None:
            return None
        firsts = {}
        for r in captured.records:
            firsts.setdefault(r.kind, r)
        return sum(getattr(r, stage)["step_time"] for r in firsts.values()) * 1e3

    def in_graph_collectives(self) -> dict | None:
        captured = getattr(self.runner, "captured", None)
        if captured is None:
            return None
        fw, bw = count_collectives(captured.forward[:1]), count_collectives(captured.backward[:1])
        nbytes = collective_bytes(captured.forward[:1] + captured.backward[:1])
        return {k: fw[k] + bw[k] for k in fw} | {"bytes": sum(nbytes.values())}


class BytesByDim(TorchDispatchMode):
    """Collective bytes per mesh dim of what runs under it, each collective its full buffer as
    fsdp_compile.report.collective_bytes counts it (an all-gather's output, a reduce-scatter's input, an
    all-reduce's tensor): eager FSDP2's c10d calls and DTensor's functional collectives alike."""

    def __init__(self, dims: dict[str, str]):
        super().__init__()
        self.dims, self.bytes = dims, {}  # group name -> mesh dim name; mesh dim name -> bytes

    def add(self, group_name: str, nbytes: int) -> None:
        dim = self.dims.get(group_name, group_name)
        self.bytes[dim] = self.bytes.get(dim, 0) + nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        flat = [a for x in (*args, *kwargs.values()) for a in (x if isinstance(x, (list, tuple)) else (x,))]
        tensors = [_payload_bytes(a) for a in flat if isinstance(a, torch.Tensor)]
        if func.namespace == "_c10d_functional" and name.startswith(("all_", "reduce_scatter", "broadcast")):
            group = [a for a in flat if isinstance(a, str)][-1]
            self.add(group, tensors[0] * (args[1] if name.startswith("all_gather") else 1))
        elif func.namespace == "c10d" and name != "barrier":
            group = next(a for a in flat if isinstance(a, torch.ScriptObject))  # the boxed ProcessGroup
            self.add(dist.ProcessGroup.unbox(group).group_name, max(tensors, default=0))
        return func(*args, **kwargs)


def _payload_bytes(t: torch.Tensor) -> int:
    """The bytes a collective moves for ``t``: a subclass's inner tensors of its shape (torchao's
    Float8TrainingTensor says its original dtype, fp32 or bf16, but moves its float8 ``_data``), not its scales."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    inner = [getattr(t, n) for n in t.__tensor_flatten__()[0]] if is_traceable_wrapper_subclass(t) else [t]
    return sum(i.numel() * i.element_size() for i in inner if i.shape == t.shape)


def graph_bytes_per_dim(gms, count: BytesByDim) -> None:
    """``count.add`` of every collective in the graphs (the first forward and backward of a compiled variant)."""
    from fsdp_compile.passes.predicates import counted_kind, node_bytes, process_group_name

    for gm in gms:
        for node in with_region_bodies(gm):  # a region's collectives (a TP block's) once per call
            kind = counted_kind(node)
            if kind is not None:
                count.add(process_group_name(node), node_bytes(node.args[0] if kind == "reduce_scatters" else node))


class CommOnly(Variant):
    """The ``fc`` variant's collectives alone: the all-gathers, reduce-scatters and all-reduces of its first
    forward and backward graphs, the same functional ops on buffers of the same sizes, dtypes and groups,
    issued in the graphs' order and waited for at the end, with no compute. ``cpu_times``: the process's CPU
    time per step (all its threads, user and system). Where the ranks' compute keeps every core busy (CPU
    ranks with gloo), each CPU second of communication is taken from compute: compute-only + comm-only's
    CPU time is then the step's floor, between max(compute-only, comm-only) (a perfect overlap on idle
    hardware) and compute-only + comm-only (no overlap at all)."""

    def __init__(self, fc_variant: Variant, device: torch.device):
        self._records("comm-only", fc_variant.model_name)  # no model of its own: Variant's records only
        self.fc, self.device = fc_variant, device
        self.calls = None
        self.cpu_times: list[float] = []

    def _replay(self) -> list:
        from fsdp_compile.passes.predicates import counted_kind

        def fresh(a):
            if isinstance(a, torch.fx.Node):
                val = a.meta["val"]
                return torch.zeros(val.shape, dtype=val.dtype, device=self.device)
            return [fresh(x) for x in a] if isinstance(a, (list, tuple)) else a

        captured = self.fc.runner.captured
        return [(n.target, fresh(n.args), fresh(n.kwargs)) for gm in captured.forward[:1] + captured.backward[:1]
                for n in with_region_bodies(gm) if counted_kind(n)]  # a region's (a TP block's) once per call

    def step(self, tokens: torch.Tensor) -> float:
        if self.calls is None:  # after the fc variant's first step, which captured its graphs
            self.calls = self._replay()
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        outs = [op(*args, **kwargs) for op, args, kwargs in self.calls]
        for out in outs:
            for t in out if isinstance(out, (list, tuple)) else (out,):
                torch.ops._c10d_functional.wait_tensor(t)
        if tokens.is_cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.cpu_times.append(time.process_time() - c0)
        return dt

    def median_cpu_s(self) -> float:
        """The median CPU time of its timed steps, which follow its two warm-up steps."""
        return H.summarize(self.cpu_times[2:2 + len(self.times)])["median_step_s"]

    def predicted_ms(self, stage: str = "after") -> None:
        return None

    def in_graph_collectives(self) -> dict | None:
        return self.fc.in_graph_collectives()  # the same collectives, replayed


def step_once(v: Variant, tokens, timed: bool) -> None:
    """One step of ``v``: a timed one records its time and this process's minor page faults, an untimed one
    the first step's time (the compile)."""
    faults = H.minor_faults()
    dt = v.step(tokens)
    if timed:
        v.times.append(dt)
        v.faults.append(H.minor_faults() - faults)
    elif v.first_step_s is None:
        v.first_step_s = dt


def faults_per_step(v: Variant) -> int | None:
    """The median of ``v``'s minor page faults per timed step (``step_once``), or None before any."""
    return sorted(v.faults)[len(v.faults) // 2] if v.faults else None


def faults_line(results: dict) -> str:
    """On a CPU: glibc's malloc hands a buffer above its mmap threshold fresh from the kernel, and each of its
    4 KiB pages faults in at first touch, so a variant that allocates more fresh memory per step pays for it
    in whatever touches it first (a copy, gloo's receive)."""
    return ("minor page faults per step (rank 0, median of the timed steps): "
            + ", ".join(f"{n} {r.get('minor_faults_per_step')}" for n, r in results.items()))


def bound_and_floor(results: dict) -> tuple[dict | None, float | None]:
    """Beside every step: the compute-only variant's results (the bound) and the CPU floor (compute-only +
    comm-only's CPU time, the README's floor on a CPU whose cores are all busy with compute), measured in the
    same run; None where the run lacks the variants."""
    bound, comm = results.get("compute-only"), results.get("comm-only")
    return bound, (bound["median_step_s"] + comm["median_cpu_s"] if bound and comm else None)


def bound_rows(bound: dict | None, floor: float | None, n_cols: int) -> list[str]:
    """The bound and the floor as the first rows of a step table of ``n_cols`` columns."""
    rows = [f"| (compute-only bound) | {bound['median_step_s'] * 1e3:.1f} |"] if bound else []
    if floor:
        rows.append(f"| (CPU floor: compute-only + comm-only's CPU time) | {floor * 1e3:.1f} |")
    return [row + " |" * (n_cols - 2) for row in rows]


def batch(step: int, rank: int, vocab: int, device, batch_size: int, seq: int):
    g = torch.Generator().manual_seed(10_000 * rank + step)
    start = torch.randint(0, vocab, (batch_size, 1), generator=g)
    stride = torch.randint(1, 4, (batch_size, 1), generator=g)
    return ((start + stride * torch.arange(seq + 1)) % vocab).to(device)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", choices=[*sorted(SIZES), *BENCH_SIZES, "hf-llama"])
    ap.add_argument("--steps", type=int, default=20, help="timed steps per variant (after 2 warm-up steps)")
    ap.add_argument("--peak-steps", type=int, default=5, help="steps per variant under the memory profiler (the worst is reported)")
    ap.add_argument("--window", type=int, default=5, help="steps per interleaved window")
    ap.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (64; 128 for hf-llama, 2048 for llama-1b)")
    ap.add_argument("--quick", action="store_true", help="tiny model, 10 timed steps: a few minutes on 2 CPU ranks")
    ap.add_argument("--variants", nargs="*", help="variants to run besides eager, space- or comma-separated (default: all)")
    ap.add_argument("--warm-cache", action="store_true", help="reuse Inductor's on-disk caches (default: a fresh, cold cache)")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (Llama models): FSDP over world/tp ranks")
    ap.add_argument("--float8", action="store_true", help="torchao float8 Linears, with and without the float8 all-gather")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree: FSDP stages under 1F1B (bench/_pipeline_bench.py)")
    ap.add_argument("--replicate", action="store_true", help="FSDP2's replicate vs DDP + torch.compile (bench/_replicate_bench.py)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                    help="auto: GPUs (NCCL) when CUDA is present, else CPU (gloo); cuda: GPUs or an error; cpu: hide GPUs")
    ap.add_argument("--offload", action="store_true", help="CPUOffloadPolicy on every fully_shard call: eager and fc only")
    ap.add_argument("--mp", default=None, choices=[k for k in MP if k], help="FSDP2 mixed precision (bf16 parameters, fp32 reduce)")
    ap.add_argument("--stem", default=None, help="results file name without extension (default compiled_vs_eager_<model>[...])")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    H.add_optimizer_arg(ap)
    args = ap.parse_args()
    args.variants = H.names_listed(args.variants)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False (no GPU, or a CPU build of torch)")
    if args.device == "cuda" and int(os.environ.get("LOCAL_WORLD_SIZE", 1)) > torch.cuda.device_count():
        ap.error(f"--device cuda: {os.environ['LOCAL_WORLD_SIZE']} ranks on this node but {torch.cuda.device_count()} GPUs (one each)")
    if args.mp and args.model == "hf-llama":
        ap.error("--mp: fsdp_compile.models' Llama sizes only")
    if args.tp > 1 and args.model == "hf-llama":
        ap.error("--tp uses fsdp_compile.models' Llama TP plan: --model tiny|small")
    if args.pp > 1 and (args.tp > 1 or args.float8 or args.model == "hf-llama"):
        ap.error("--pp: fsdp_compile.models' Llama sizes, without --tp or --float8")
    if "RANK" not in os.environ:
        ap.error("launch with torchrun, e.g.: torchrun --nproc-per-node 2 bench/compiled_vs_eager.py --quick")
    if args.quick:
        args.model, args.steps, args.window = "tiny", 10, 5
    if args.seq is None:
        args.seq = {"hf-llama": 128, "llama-1b": 2048}.get(args.model, 64)
    if args.pp > 1:
        from _pipeline_bench import PP_VARIANTS, run_pipeline

        check_variants(args.variants, PP_VARIANTS, "--pp")
        return run_pipeline(args, MODEL_SIZES[args.model], MP[args.mp], batch, BytesByDim, graph_bytes_per_dim)
    if args.replicate:
        from _replicate_bench import run_replicate

        return run_replicate(args, sys.modules[__name__])
    device, rank, world, say = H.init_ranks(timeout_s=900)
    vocab = HF_VOCAB if args.model == "hf-llama" else MODEL_SIZES[args.model].vocab
    if args.float8 and args.tp > 1 and dist.get_backend() == "gloo":
        gloo_float8_all_gather()

    names = FLOAT8_VARIANTS if args.float8 else VARIANTS
    check_variants(args.variants, names, "--float8" if args.float8 else "this run")
    # per variant with --float8: whether its float8 weights are all-gathered as float8
    float8_ag = {name: name.endswith(":float8-ag") for name in names} if args.float8 else {}
    names = [n for n in names if n == "eager" or not args.variants or n in args.variants]
    skipped: dict[str, str] = {}
    if args.offload:  # the others are not offloaded (compute-only: unsharded) or not ours to compare here
        skipped.update({n: "--offload: eager and fc only" for n in names if n not in ("eager", "fc")})
        names = [n for n in names if n in ("eager", "fc")]
    if any(n.startswith("simplefsdp") for n in names):
        why = ("--tp and --float8 runs leave it out" if args.tp > 1 or args.float8 else simple_fsdp_missing())
        if why:
            skipped.update({n: why for n in names if n.startswith("simplefsdp")})
            names = [n for n in names if not n.startswith("simplefsdp")]
    if "fc:cudagraphs" in names and device.type != "cuda":
        names.remove("fc:cudagraphs")
        skipped["fc:cudagraphs"] = "CUDA graphs: CUDA only"
    if "fc:free-overlap" in names and device.type != "cpu":
        names.remove("fc:free-overlap")
        skipped["fc:free-overlap"] = "the cpu-gloo profile: CPU only"
    if "comm-only" in names and (args.tp > 1 or "fc" not in names):
        names.remove("comm-only")
        skipped["comm-only"] = "replays the fc variant's FSDP collectives: needs fc, and no --tp (TP's would count too)"
    makers = {name: make_variant(name, args.model, args.backend) for name in names if name != "comm-only"}
    if args.tp > 1 and not args.variants:
        # measured alone (--variants torch.compile): torch 2.13's Inductor fails on this FSDP2 + TP model
        # ("Please convert all Tensors to FakeTensors first", aten.equal), and the state it leaves behind
        # breaks the later steps of the other variants in the same process
        makers.pop("torch.compile")
        skipped["torch.compile"] = ("fails to compile FSDP2 + TP in torch 2.13 (BackendCompilerFailed); run it alone "
                                    "with --variants torch.compile")
    variants = [Variant(name, args.model, device, make, sharded=SHARD_WITH.get(name, True), tp=args.tp,
                        float8_ag=float8_ag.get(name), mp=args.mp, offload=args.offload,
                        optimizer=args.optimizer) for name, make in makers.items()]
    if "comm-only" in names:
        variants.insert(names.index("comm-only"), CommOnly(variants[names.index("fc")], device))
    say(f"compiled_vs_eager: '{args.model}', {world} ranks ({dist.get_backend()}), backend={args.backend}, "
        f"batch {args.batch} x {args.seq}" + (f", FSDP {world // args.tp} x TP {args.tp}" if args.tp > 1 else "")
        + (", torchao float8 Linears" if args.float8 else "") + (f", mixed precision {args.mp}" if args.mp else "")
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else ""))
    for name, why in skipped.items():
        say(f"  skipped {name}: {why}")

    # mesh dim of each process group, for the bytes per mesh dim
    dims = {m.get_group().group_name: d for d, m in ((d, _MESH[d]) for d in ("dp", "tp"))} if args.tp > 1 else \
        {dist.group.WORLD.group_name: "dp"}
    windows = -(-args.steps // args.window)
    progress = H.Progress(len(variants) * (2 + windows + args.peak_steps), enabled=rank == 0)
    step_no = {v.name: 0 for v in variants}

    def run(v: Variant, n: int, timed: bool):
        for _ in range(n):
            tokens = batch(step_no[v.name], rank // args.tp, vocab, device, args.batch, args.seq)  # one per TP group
            step_no[v.name] += 1
            step_once(v, tokens, timed)

    for v in list(variants):  # warm-up: the first step compiles; a second lets caches settle
        graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        try:
            with H.cold_compile(not args.warm_cache):  # not the earlier variants' kernels and graphs
                run(v, 1, timed=False)
        except Exception as e:  # noqa: BLE001 - a variant that cannot compile this model is a result
            if v.name == "eager":
                raise
            # it fails in its compile, before any collective, on every rank alike: the others go on
            skipped[v.name] = f"its first step failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
            variants.remove(v)
            say(f"  skipped {v.name}: {skipped[v.name]}")
            progress.step(f"{v.name}: failed")
            progress.step(f"{v.name}: failed")
            continue
        # Dynamo graphs its first step compiled: fewer than its graphs where an earlier variant's cached
        # frames served it (the same model class, the guards passing), and then its first step is not cold
        v.first_step_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
        progress.step(f"{v.name}: first step {v.first_step_s:.1f}s")
        v.count = BytesByDim(dims)
        with count_eager_collectives() as calls:
            run(v, 1, timed=False)
        v.eager_calls = len(calls)
        v.eager_bytes = sum(calls.bytes)
        captured = getattr(getattr(v, "runner", None), "captured", None)
        if captured is not None and not isinstance(v, CommOnly):
            graph_bytes_per_dim(captured.forward[:1] + captured.backward[:1], v.count)
        if v.name.startswith(("eager", "fc")) and v.name != "fc:cudagraphs":
            v.bytes_per_dim = v.count.bytes
        v.count = None
        progress.step(f"{v.name}: warm-up")
    for w in range(windows):
        for v in variants:
            run(v, min(args.window, args.steps - w * args.window), timed=True)
            progress.step(f"{v.name}: window {w + 1}/{windows}")
    # untimed steps under the memory profiler, round-robin over the variants: on gloo a step's peak depends on
    # when the backend's worker thread allocates and frees its buffers against the compute (one step's
    # peak varied by 15% between runs of the same schedule), so each variant's peak is its worst of several
    for i in range(args.peak_steps):
        for v in variants:
            v.peaks.append(H.step_peak_bytes(lambda: run(v, 1, timed=False), device))
            progress.step(f"{v.name}: peak memory {i + 1}/{args.peak_steps}")
    for v in variants:
        v.peak_bytes = max(v.peaks)
    progress.close()

    eager = variants[0]
    base = H.summarize(eager.times)["median_step_s"]
    by_name = {v.name: v for v in variants}
    times = {v.name: v.times for v in variants}
    results = {}
    for v in variants:
        stats = H.summarize(v.times)
        graph = v.in_graph_collectives()
        predicted = v.predicted_ms()
        if v.name == "eager" and "fc:fsdp_group" in by_name:  # the same collectives, where eager issues them
            predicted = by_name["fc:fsdp_group"].predicted_ms("before")
        results[v.name] = {
            **stats,
            "predicted_step_ms": predicted,
            "first_step_s": v.first_step_s,
            "first_step_dynamo_graphs": v.first_step_graphs,
            "ratio_vs_eager": stats["median_step_s"] / base,
            "eager_c10d_calls_per_step": v.eager_calls,
            "all_gathers": graph["all_gathers"] if graph else None,
            "reduce_scatters": graph["reduce_scatters"] if graph else None,
            # FSDP's collectives, full buffers: torch.distributed calls (eager hooks) plus in-graph collectives
            # (None for SimpleFSDP: its collectives are in graphs we do not capture)
            "collective_bytes_per_step": None if v.name.startswith("simplefsdp") else v.eager_bytes + (graph["bytes"] if graph else 0),
            "collective_bytes_per_dim": v.bytes_per_dim,
            "peak_bytes": v.peak_bytes,
            "peak_bytes_per_step": v.peaks,
            "final_loss": v.loss,
            "final_loss_delta_vs_eager": None if v.loss is None else abs(v.loss - eager.loss),
            "minor_faults_per_step": faults_per_step(v),
            "paired": H.paired_with(v.name, times, args.window),
        }
        if isinstance(v, CommOnly):
            results[v.name]["median_cpu_s"] = v.median_cpu_s()

    tc, peer, comm = results.get("torch.compile"), results.get("simplefsdp"), results.get("comm-only")
    peer_reshard = results.get("simplefsdp:reshard")
    bound, floor = bound_and_floor(results)
    say("\n| variant | median ms | p10-p90 ms | vs eager | vs compute-only | vs CPU floor | predicted ms | first step s | Python c10d calls/step | in-graph AG/RS | collective MB/step | step peak MiB | final loss (Δ vs eager) |")
    say("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for line in bound_rows(bound, floor, 13):
        say(line)
    for name, r in results.items():
        graph = f"{r['all_gathers']}/{r['reduce_scatters']}" if r["all_gathers"] is not None else "-"
        say(
            f"| {name} | {r['median_step_s'] * 1e3:.1f} | {r['p10_step_s'] * 1e3:.1f}-{r['p90_step_s'] * 1e3:.1f} | "
            f"{r['ratio_vs_eager']:.2f}x | "
            f"{'-' if not bound else format(r['median_step_s'] / bound['median_step_s'], '.2f') + 'x'} | "
            f"{'-' if not floor else format(r['median_step_s'] / floor, '.2f') + 'x'} | {'-' if r['predicted_step_ms'] is None else format(r['predicted_step_ms'], '.1f')} | {r['first_step_s']:.1f} | {r['eager_c10d_calls_per_step']} | {graph} | "
            f"{'-' if r['collective_bytes_per_step'] is None else format(r['collective_bytes_per_step'] / 1e6, '.3f')} | "
            f"{r['peak_bytes'] / 2**20:.1f} | "
            + ("-" if r["final_loss"] is None else f"{r['final_loss']:.5f} ({r['final_loss_delta_vs_eager']:.1e})") + " |"
        )
    per_dim = {n: r["collective_bytes_per_dim"] for n, r in results.items() if r["collective_bytes_per_dim"]}
    dim_names = sorted({d for b in per_dim.values() for d in b})
    say("\ncollective MB per step by mesh dim (full buffers; eager: counted as they run, fc: its graphs + the scale "
        "precompute)\n| variant | " + " | ".join(dim_names) + " |\n|---|" + "---|" * len(dim_names))
    for name, b in per_dim.items():
        say(f"| {name} | " + " | ".join(f"{b.get(d, 0) / 1e6:.3f}" for d in dim_names) + " |")
    if device.type == "cpu":
        say(faults_line(results))
    if floor:
        say(f"comm-only: {comm['median_step_s'] * 1e3:.1f} ms, the process busy {comm['median_cpu_s'] * 1e3:.1f} ms of it "
            f"(CPU time). Step floors: max(compute-only, comm-only) {max(bound['median_step_s'], comm['median_step_s']) * 1e3:.1f} ms; "
            f"compute-only + comm-only's CPU time {floor * 1e3:.1f} ms (every core busy with compute); "
            f"compute-only + comm-only {(bound['median_step_s'] + comm['median_step_s']) * 1e3:.1f} ms (no overlap)")
    for name, r in results.items():
        if name.startswith(("fc", "simplefsdp")):
            say(
                f"{name}: {r['ratio_vs_eager']:.2f}x eager"
                + (f", {r['median_step_s'] / bound['median_step_s']:.2f}x the compute-only bound" if bound else "")
                + (f", {r['median_step_s'] / floor:.2f}x compute-only + comm-only's CPU time" if floor else "")
                + (f", {r['median_step_s'] / tc['median_step_s']:.2f}x torch.compile step time" if tc else "")
                + f"; peak {r['peak_bytes'] / results['eager']['peak_bytes']:.2f}x eager's"
                + (f"; first step {r['first_step_s'] / tc['first_step_s']:.2f}x torch.compile's" if tc else "")
                + (f"; {r['median_step_s'] / peer['median_step_s']:.2f}x SimpleFSDP's step"
                   if peer and name != "simplefsdp" else "")
                + (f"; {r['median_step_s'] / peer_reshard['median_step_s']:.2f}x SimpleFSDP resharded's"
                   if peer_reshard and not name.startswith("simplefsdp") else "")
            )
    for name, r in results.items():
        if name.startswith(("fc", "simplefsdp")) and (line := H.paired_line(name, r["paired"])):
            say(line)
    for base_name in ("eager", "fc") if args.float8 else ():
        r, base_r = results.get(f"{base_name}:float8-ag"), results.get(base_name)
        if r and base_r:
            say(f"{base_name}:float8-ag moves {r['collective_bytes_per_step'] / base_r['collective_bytes_per_step']:.2f}x "
                f"the collective bytes of {base_name} without it, at {r['median_step_s'] / base_r['median_step_s']:.2f}x its step time")
    if rank == 0:
        payload = {
            "config": vars(args) | {"world_size": world, "device": str(device)},
            "machine": H.machine(),
            "peak_memory_measures": "the worst of --peak-steps steps (rank 0): peak tensor bytes allocated during the step above those live before it "
            + ("(torch.cuda.max_memory_allocated)" if device.type == "cuda" else "(CPU profiler allocation events)"),
            "skipped": skipped,
            "variants": results,
        }
        if floor:
            payload["step_floors_s"] = {
                "max(compute-only, comm-only)": max(bound["median_step_s"], comm["median_step_s"]),
                "compute-only + comm-only's CPU time": floor,
                "compute-only + comm-only": bound["median_step_s"] + comm["median_step_s"],
            }
        if device.type == "cuda":  # which GPU produced these numbers
            payload["gpu"] = H.gpu_info(device)
        stem = args.stem or (f"compiled_vs_eager_{args.model}" + (f"_tp{args.tp}" if args.tp > 1 else "")
                             + ("_float8" if args.float8 else "") + ("_offload" if args.offload else ""))
        H.write_json(os.path.join(args.out, f"{stem}.json"), payload)
        names = list(results)
        H.bar_chart(
            os.path.join(args.out, f"{stem}.png"),
            names,
            [results[n]["median_step_s"] * 1e3 for n in names],
            [(results[n]["p10_step_s"] * 1e3, results[n]["p90_step_s"] * 1e3) for n in names],
            f"'{args.model}', {world} ranks, {device.type}: step time (median, p10-p90)",
            "ms per step",
        )
        say(f"wrote {args.out}/{stem}.json and .png")
    for v in variants:  # fc:cudagraphs' graphs hold the communicators: freed before the process group
        close = getattr(getattr(v, "runner", None), "close", None)
        if close is not None:
            close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
