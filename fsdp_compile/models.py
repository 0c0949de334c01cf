"""A Llama-style decoder (RMSNorm, RoPE, SwiGLU, optional tied embeddings) for the demo, the tests and
the benchmarks, with named sizes, and torchtitan's tensor-parallel plan for it (``tensor_parallel``).
Plain PyTorch: nothing here knows about FSDP."""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

@dataclasses.dataclass
class LlamaArgs:
    vocab: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # grouped-query attention (Llama 3); None: as many as n_heads
    ffn_dim: int = 160
    max_seq: int = 64
    tie_embeddings: bool = False


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # x: [B, S, D]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_cache(seq: int, head_dim: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq).float(), freqs)  # [S, hd/2]
    return torch.stack([angles.cos(), angles.sin()], dim=-1)  # [S, hd/2, 2]


def apply_rope(x, cache):
    # x: [B, S, H, hd]; cache: [S, hd/2, 2]
    x2 = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = cache[: x.shape[1], None, :, 0], cache[: x.shape[1], None, :, 1]
    out = torch.stack([x2[..., 0] * cos - x2[..., 1] * sin, x2[..., 0] * sin + x2[..., 1] * cos], -1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.n_heads, self.head_dim = a.n_heads, a.dim // a.n_heads
        self.n_kv_heads = a.n_kv_heads or a.n_heads
        self.wq = nn.Linear(a.dim, a.dim, bias=False)
        self.wk = nn.Linear(a.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)

    def forward(self, x, cache):
        B, S = x.shape[:2]
        # heads as -1: under tensor parallelism each rank holds its own heads (torchtitan's Llama does the same)
        q = self.wq(x).view(B, S, -1, self.head_dim)
        k = self.wk(x).view(B, S, -1, self.head_dim)
        v = self.wv(x).view(B, S, -1, self.head_dim)
        q, k = apply_rope(q, cache), apply_rope(k, cache)
        # [B, H, S, hd]
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
            enable_gqa=self.n_kv_heads != self.n_heads,
        )
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


class FeedForward(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn_dim, bias=False)
        self.w2 = nn.Linear(a.ffn_dim, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # SwiGLU


class Block(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim)
        self.feed_forward = FeedForward(a)

    def forward(self, x, cache):
        x = x + self.attention(self.attention_norm(x), cache)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, a: LlamaArgs | None = None):
        super().__init__()
        a = a or LlamaArgs()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)
        if a.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("rope", rope_cache(a.max_seq, a.dim // a.n_heads), persistent=False)
        self.reset_parameters()

    def reset_parameters(self):
        for name, p in self.named_parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02 if "output" not in name else 1 / math.sqrt(self.args.dim))

    def forward(self, tokens):
        # tokens: [B, S] -> logits [B, S, V]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x, self.rope)
        return self.output(self.norm(x))


SIZES = {
    # name: LlamaArgs; "tiny" is the demo and test default, "small" a CPU benchmark size
    "tiny": LlamaArgs(),
    "small": LlamaArgs(vocab=1024, dim=256, n_layers=4, n_heads=4, ffn_dim=688, max_seq=128),
    # Llama 3 shapes (Meta's published configs), for explain/simulation on the meta device
    "llama3-8b": LlamaArgs(vocab=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, max_seq=8192),
    "llama3-70b": LlamaArgs(vocab=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, max_seq=8192),
}


def tensor_parallel(model: Llama, tp_mesh, loss_parallel: bool = False, float8: bool = False) -> Llama:
    """torchtitan's Llama TP plan (``torchtitan/models/llama3/parallelize.py: apply_tp``) on ``tp_mesh``:
    sequence-parallel norms, column-parallel q/k/v and w1/w3 taking the sequence-sharded activations whole,
    row-parallel wo and w2 back to sequence shards, a vocabulary-sharded embedding. ``loss_parallel``: the
    logits stay sharded over the vocabulary (compute the loss under ``loss_parallel()``); otherwise they
    come back whole. ``float8``: the blocks' Linears are torchao Float8Linears (``convert_to_float8_training``)
    and take torchao's float8 styles instead (torchtitan's float8 tensorwise TP: each block input cast to
    float8 once, before its redistribution, so the sequence all-gather carries one byte per element).
    Before ``fully_shard``, as with any parallel plan."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    colwise, rowwise, prepare_input = ColwiseParallel, RowwiseParallel, PrepareModuleInput
    if float8:
        from torchao.float8 import float8_tensor_parallel as f8tp

        colwise, rowwise = f8tp.Float8ColwiseParallel, f8tp.Float8RowwiseParallel
        prepare_input = f8tp.PrepareFloat8ModuleInput

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": prepare_input(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.wo": rowwise(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": prepare_input(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": colwise(),
            "feed_forward.w2": rowwise(output_layouts=Shard(1)),
            "feed_forward.w3": colwise(),
        })
    return model


def gloo_float8_all_gather() -> None:
    """For ``tensor_parallel(float8=True)`` on gloo, called once in each process that runs it (idempotent).
    gloo has no float8 dtypes (all-gathering one fails: "Invalid scalar type"; NCCL has them), and torchao's
    float8 TP all-gathers float8 activations (PrepareFloat8ModuleInput's sequence all-gather, the e5m2
    gradients in backward): in this process torchao gathers their bytes as uint8 instead, the same bytes.
    FSDP2's float8 weight all-gather is uint8 already."""
    from torchao.float8 import float8_ops

    gather = float8_ops.FLOAT8_OPS_TABLE[torch.ops._c10d_functional.all_gather_into_tensor.default]
    if getattr(gather, "as_bytes", False):
        return

    def as_bytes(aten_op, args, kwargs=None):
        return gather(lambda data, *a, **k: aten_op(data.view(torch.uint8), *a, **k).view(data.dtype), args, kwargs)

    as_bytes.as_bytes = True
    for op in (torch.ops.c10d_functional.all_gather_into_tensor.default, torch.ops._c10d_functional.all_gather_into_tensor.default):
        float8_ops.FLOAT8_OPS_TABLE[op] = as_bytes


def llama_blocks(model: Llama):
    """The modules to shard one by one before the root (as torchtitan does)."""
    return list(model.layers)
