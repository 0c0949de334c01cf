"""Train a transformers LlamaForCausalLM with FSDP2 + fsdp_compile, then save and resume it with DCP (2 ranks).

    torchrun --nproc-per-node 2 examples/hf_llama.py [--backend inductor|aot_eager] [--steps 4] [--ckpt-dir DIR]

The model is built from a small config (nothing is downloaded). The training script is the one you would
write for eager FSDP2: ``fully_shard`` per decoder layer, then the root; one extra line,
``fc.compile(model)``; AdamW, ``clip_grad_norm_`` and ``torch.distributed.checkpoint`` (DCP) work on the same
sharded DTensor parameters as before. After training, the script saves a checkpoint, takes one more step,
loads the checkpoint back, checks that every parameter equals what was saved, and repeats that step: its
loss must be the same. NCCL where every rank has a GPU, else gloo on CPU. Without ``--ckpt-dir`` the
checkpoint goes to a temporary directory (one machine); on several machines pass one every rank can reach.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import fsdp_compile as fc

VOCAB, BATCH, SEQ = 512, 4, 64


def init_distributed() -> torch.device:
    if torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):  # a GPU for every rank: NCCL
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    fc.single_thread_gloo()  # before init: torch's gloo can race between its two worker threads
    dist.init_process_group("gloo")
    return torch.device("cpu")


def build(device: torch.device) -> torch.nn.Module:
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         attn_implementation="sdpa")
    torch.manual_seed(0)  # the same initial weights on every rank
    with device:
        model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def batch(step: int, device: torch.device) -> torch.Tensor:
    # a learnable stream, different on every rank: each token is the previous one plus a per-row stride
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
    stride = torch.randint(1, 4, (BATCH, 1), generator=g)
    return ((start + stride * torch.arange(SEQ)) % VOCAB).to(device)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ckpt-dir", default=None, help="DCP checkpoint directory (default: a temporary one)")
    args = parser.parse_args()
    if "LOCAL_WORLD_SIZE" not in os.environ:
        parser.error("launch with torchrun, e.g.: torchrun --nproc-per-node 2 examples/hf_llama.py")
    device = init_distributed()
    rank = dist.get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)

    model = build(device)
    compiled = fc.compile(model, backend=args.backend)  # same parameters, same FQNs: model's
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def train_step(step: int) -> float:
        ids = batch(step, device)
        loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss  # the first call compiles
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
        loss = loss.item()
        if not math.isfinite(loss):
            raise SystemExit(f"rank {rank}: step {step}: loss is {loss}")
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        say(f"step {step:3d} | loss {loss:.4f} | grad norm {norm.item():.4f}")
        return loss

    say(f"LlamaForCausalLM on {dist.get_world_size()} ranks ({device.type}), backend={args.backend}")
    for step in range(args.steps):
        train_step(step)

    # Save with DCP: each rank writes its own shards of the model and of the optimizer state.
    ckpt_dir = args.ckpt_dir
    if ckpt_dir is None:
        ckpt_dir = [tempfile.mkdtemp(prefix="hf_llama_ckpt_") if rank == 0 else None]
        dist.broadcast_object_list(ckpt_dir)
        ckpt_dir = ckpt_dir[0]
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=ckpt_dir)
    saved = {name: p.to_local().clone() for name, p in model.named_parameters()}
    say(f"saved a DCP checkpoint to {ckpt_dir}")

    loss_after_save = train_step(args.steps)  # moves the weights and the optimizer state on

    # Load it back into the same model and optimizer (in place: the compiled model keeps working).
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    wrong = [name for name, p in model.named_parameters() if not torch.equal(p.to_local(), saved[name])]
    if wrong:
        raise SystemExit(f"rank {rank}: after dcp.load, these parameters differ from the saved ones: {wrong}")
    say(f"loaded it back: all {len(saved)} parameters equal the saved ones; the step after the save, again:")
    loss_resumed = train_step(args.steps)
    if not math.isclose(loss_resumed, loss_after_save, rel_tol=1e-5):
        raise SystemExit(f"rank {rank}: resumed loss {loss_resumed} != {loss_after_save} before the load")

    dist.barrier()
    if args.ckpt_dir is None and rank == 0:
        shutil.rmtree(ckpt_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
