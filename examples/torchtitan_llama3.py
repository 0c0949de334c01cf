"""torchtitan's Llama3 debug model, FSDP 2 x TP 2 by torchtitan's parallelize_llama, then fsdp_compile (4 ranks).

    torchrun --nproc-per-node 4 examples/torchtitan_llama3.py [--backend inductor|aot_eager] [--steps 4] [--layers 2]

Needs torchtitan 0.3.0, without its trainer's dependencies, and the two modules its models import:

    pip install torchtitan==0.3.0 --no-deps && pip install spmd-types==0.3.1 tyro==1.0.16

torchtitan's own code builds the model (``llama3_configs["debugmodel"]``), applies its tensor-parallel plan
and its FSDP2 (``parallelize_llama``: bf16 parameters, fp32 reduction, one FSDP group per block), initializes
it, and provides the loss (vocabulary-parallel cross entropy), the optimizer (AdamW) and ``clip_grad_norm_``;
the loop follows its ``Trainer.train_step``. fsdp_compile then compiles the sharded model as one graph, with
the TP collectives in it. What differs from torchtitan's trainer, and why:

* ``ScaledDotProductAttention`` instead of the debug model's flex attention (no backward on CPU);
* ``--layers``: the first N of the debug model's 6 blocks (default 2, to keep CPU runs short);
* ``spmd_backend="partial_dtensor"`` (plain ``fully_shard(mesh=...)``; its default passes ``dp_mesh_dims=``,
  which fsdp_compile refuses);
* on CPU only: torchtitan's device type set to "cpu", and every FSDP module reduces with a plain SUM
  (``set_force_sum_reduction_for_comms``: gloo lacks the PREMUL_SUM that ``set_gradient_divide_factor(1.0)``
  asks for; same arithmetic).

NCCL where every rank has a GPU, else gloo on CPU. Without torchtitan it prints what to install and exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.distributed as dist

import fsdp_compile as fc

VOCAB = 2048  # the debug model's vocabulary
BATCH, SEQ = 2, 64
TP = 2  # tensor-parallel degree; FSDP shards over the other ranks (2 of 4)
INSTALL = "pip install torchtitan==0.3.0 --no-deps && pip install spmd-types==0.3.1 tyro==1.0.16"


def torchtitan_missing() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torchtitan")
    except PackageNotFoundError:
        return "torchtitan is not installed"
    if found != "0.3.0":
        return f"torchtitan {found} is installed; this example reads torchtitan 0.3.0's APIs"
    try:
        import torchtitan.components.loss  # noqa: F401
        import torchtitan.models.llama3  # noqa: F401
    except Exception as e:  # noqa: BLE001 - its models import spmd_types and tyro at import time
        return f"torchtitan is not importable ({type(e).__name__}: {e})"
    return None


def init_distributed() -> torch.device:
    if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):  # a GPU for every rank: NCCL
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils

    for module in (tools_utils, parallel_dims, dist_utils):  # torchtitan assumes an accelerator
        module.device_type = "cpu"
    fc.single_thread_gloo()  # before init: torch's gloo can race between its two worker threads
    dist.init_process_group("gloo")
    return torch.device("cpu")


def build(device: torch.device, n_layers: int):
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs, parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    parallelism = ParallelismConfig(spmd_backend="partial_dtensor", tensor_parallel_degree=TP)
    dims = ParallelDims.from_config(parallelism, dist.get_world_size())  # dp_shard: the ranks left over
    dims.build_mesh()
    dist_utils.set_spmd_backend(parallelism.spmd_backend)

    cfg = llama3_configs["debugmodel"](attn_backend="flex")
    cfg.layers = cfg.layers[:n_layers]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    set_llama3_sharding_config(cfg, enable_sp=parallelism.enable_sequence_parallel)  # torchtitan's TP plan
    training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ)
    with torch.device("meta"):
        model = cfg.build()
    model = parallelize_llama(model, parallel_dims=dims, training=training, parallelism=parallelism,
                              compile_config=CompileConfig(), ac_config=None, dump_folder="outputs")  # read by AC only
    if device.type == "cpu":
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = CrossEntropyLoss.Config(global_vocab_size=VOCAB).build(compile_config=CompileConfig())
    optimizers = default_adamw(lr=8e-4).build(model_parts=[model])
    return model, loss_fn, optimizers, training, dims


def batch(step: int, dp_rank: int, device: torch.device):
    # the same batch on the ranks of one TP group, another per data-parallel rank; a learnable stream
    g = torch.Generator().manual_seed(1000 * dp_rank + step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2, help="the first N blocks of the debug model (at most 6)")
    args = parser.parse_args()
    if "LOCAL_WORLD_SIZE" not in os.environ:
        parser.error("launch with torchrun, e.g.: torchrun --nproc-per-node 4 examples/torchtitan_llama3.py")
    missing = torchtitan_missing()
    if missing:
        if os.environ.get("RANK", "0") == "0":
            print(f"skipped: {missing}. To run this example: {INSTALL}")
        sys.exit(0)

    import torchtitan.distributed.utils as dist_utils

    device = init_distributed()
    say = print if dist.get_rank() == 0 else (lambda *a, **k: None)
    model, loss_fn, optimizers, training, dims = build(device, args.layers)
    compiled = fc.compile(model, backend=args.backend)
    batch_mesh = dims.get_mesh("batch")
    say(f"torchtitan Llama3 debug model ({args.layers} layers): FSDP {dims.dp_shard} x TP {dims.tp} on "
        f"{dist.get_world_size()} ranks ({device.type}), backend={args.backend}")

    for step in range(args.steps):  # torchtitan's Trainer.train_step, one micro-batch
        optimizers.zero_grad()
        inputs, labels = batch(step, batch_mesh.get_local_rank(), device)
        global_valid_tokens = dist_utils.dist_sum_tensor(torch.tensor(labels.numel(), device=device), batch_mesh)
        pred = compiled(inputs)  # the first call compiles
        loss, _ = loss_fn(pred, labels, global_valid_tokens)
        loss.backward()
        norm = dist_utils.clip_grad_norm_(list(model.parameters()), training.max_norm, foreach=True,
                                          pp_mesh=None, ep_enabled=dims.ep_enabled)
        optimizers.step()
        loss = dist_utils.dist_sum_tensor(loss.detach(), batch_mesh).item()  # the global mean, as torchtitan logs
        if not math.isfinite(loss):
            raise SystemExit(f"rank {dist.get_rank()}: step {step}: loss is {loss}")
        say(f"step {step:3d} | loss {loss:.4f} | grad norm {norm.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
