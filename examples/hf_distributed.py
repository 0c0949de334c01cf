"""A transformers model loaded with its own TP and FSDP plans by from_pretrained, then fsdp_compile (4 ranks).

    torchrun --nproc-per-node 4 examples/hf_distributed.py [--backend inductor|aot_eager] [--steps 4] [--bf16]

transformers' documented distributed loading: rank 0 saves a tiny seeded Qwen2 (grouped-query attention:
4 heads, 2 kv heads; nothing is downloaded) with ``save_pretrained`` to a temporary directory, standing in
for a checkpoint, and every rank loads it with ``from_pretrained(dir, distributed_config=DistributedConfig(
tp_plan="auto", tp_size=2, fsdp_size=2))``. transformers builds the (fsdp 2, tp 2) mesh itself, applies the
model's TP plan over tp and its FSDP plan over fsdp (``fully_shard`` on the embedding, each decoder layer,
the final norm with ``lm_head``, the root). One extra line, ``fc.compile(model)``, compiles the sharded model
as one graph with the TP collectives in it; AdamW trains the same sharded DTensor parameters.

``--bf16`` passes ``fsdp_mixed_precision=True`` (FSDP2's bf16 parameters, fp32 gradient reduction). With an
``attention_mask`` in the batch (a tokenizer's), transformers takes another attention path under any compile
than eagerly (an explicit mask, k/v repeated instead of SDPA's ``enable_gqa``), so bf16 results are those of
``torch.compile``, not of eager, unless ``TRANSFORMERS_SDPA_FORCE_GQA=1`` is set (docs/support.md). This
script passes no mask.

The batch is the same on the two ranks of a tp group (tp is the mesh's last dimension) and differs per fsdp
rank. The script exits non-zero unless transformers sharded every parameter as a DTensor and every loss is
finite. NCCL where every rank has a GPU, else gloo on CPU.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.distributed import DistributedConfig

import fsdp_compile as fc

VOCAB, BATCH, SEQ, TP = 512, 2, 32, 2


def init_distributed():
    if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):  # a GPU for every rank: NCCL
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return
    fc.single_thread_gloo()  # before init: torch's gloo can race between its two worker threads
    dist.init_process_group("gloo")


def save_tiny_model(path: str):
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)


def batch(step: int, device: torch.device) -> torch.Tensor:
    # a learnable stream: each token is the previous one plus a per-row stride; one batch per fsdp rank
    g = torch.Generator().manual_seed(1000 * (dist.get_rank() // TP) + step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    return ((start + stride * torch.arange(SEQ)) % VOCAB).to(device)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--bf16", action="store_true", help="DistributedConfig(fsdp_mixed_precision=True)")
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", "0")) != 4:
        parser.error("launch with torchrun on 4 ranks: torchrun --nproc-per-node 4 examples/hf_distributed.py")
    init_distributed()  # from_pretrained uses the process group it finds
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)

    path = [tempfile.mkdtemp(prefix="hf_distributed_") if rank == 0 else None]  # one machine: a shared /tmp
    dist.broadcast_object_list(path)
    path = path[0]
    if rank == 0:
        save_tiny_model(path)
    dist.barrier()
    config = DistributedConfig(tp_plan="auto", tp_size=TP, fsdp_size=2, fsdp_mixed_precision=args.bf16)
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=config, attn_implementation="sdpa")
    device = next(model.parameters()).device
    not_sharded = [name for name, p in model.named_parameters() if not isinstance(p, DTensor)]
    if not_sharded or not isinstance(model, FSDPModule):
        raise SystemExit(f"rank {rank}: transformers did not shard the model: {not_sharded or 'no root FSDP module'}")

    compiled = fc.compile(model, backend=args.backend)  # same parameters, same FQNs: model's
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    say(f"Qwen2ForCausalLM from_pretrained(fsdp 2 x tp 2) on {dist.get_world_size()} ranks ({device.type}), "
        f"backend={args.backend}, {'bf16' if args.bf16 else 'fp32'}")
    for step in range(args.steps):
        ids = batch(step, device)
        loss = compiled(input_ids=ids, labels=ids).loss  # the first call compiles
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.item()
        if not math.isfinite(loss):
            raise SystemExit(f"rank {rank}: step {step}: loss is {loss}")
        say(f"step {step:3d} | loss {loss:.4f}")

    dist.barrier()
    if rank == 0:
        shutil.rmtree(path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
