"""The model zoo for tests, the demo and the benchmarks.

* ``Llama``: a Llama-style decoder (RMSNorm, RoPE, SwiGLU, optional tied embeddings), from the package.
* ``OddMLP``: dims that no world size divides (uneven dim-0 shards, ranks with empty shards).
* ``FrozenBuffers``: frozen parameters and buffers beside trainable ones.
* ``Patterns``: block patterns that regions must get right, from real clients: complex RoPE (torchtitan's
  Llama3), an MoE block that counts its tokens in a buffer updated in place (torchtitan's DeepSeek-V3),
  dropout under ``torch.utils.checkpoint`` and under ``checkpoint_wrapper``.

``shard(model, ...)`` applies ``fully_shard`` per block and then to the root, as users do.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fsdp_compile.models import Llama, LlamaArgs, RMSNorm  # noqa: F401  (re-exported for the tests)


class OddMLP(nn.Module):
    """Dim-0 sizes 5, 7, 3 and 1: uneven over 2 and 4 ranks; the 1-row ``scale`` leaves ranks with empty shards."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 5)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(5, 7), nn.GELU(), nn.Linear(7, 5)) for _ in range(2)])
        self.out = nn.Linear(5, 3)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        # x: [B, 6] -> [B, 3]
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.out(h) * self.scale


class FrozenBuffers(nn.Module):
    """A frozen embedding and frozen block weight beside trainable ones, and buffers read in forward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.emb.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.blocks[0].weight.requires_grad_(False)
        self.head = nn.Linear(16, 32)
        self.register_buffer("shift", torch.linspace(-1, 1, 16))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, ids):
        h = self.emb(ids) + self.shift
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.head(h)


def shard(model: nn.Module, blocks, root_kwargs: dict | None = None, **fsdp_kwargs) -> nn.Module:
    """``fully_shard`` each block, then the root (with ``root_kwargs`` overriding ``fsdp_kwargs``)."""
    from torch.distributed.fsdp import fully_shard

    for b in blocks:
        fully_shard(b, **fsdp_kwargs)
    fully_shard(model, **{**fsdp_kwargs, **(root_kwargs or {})})
    return model


class ComplexRopeAttention(nn.Module):
    """Attention with torchtitan's complex rotary embedding: ``view_as_complex(q) * freqs_cis``."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x, freqs_cis):
        # x: [B, S, D]; freqs_cis: [S_max, hd/2] complex64
        B, S, D = x.shape
        q, k, v = (w(x).view(B, S, self.n_heads, self.head_dim) for w in (self.wq, self.wk, self.wv))
        rot = freqs_cis[:S, None, :]  # [S, 1, hd/2]
        q, k = (torch.view_as_real(torch.view_as_complex(t.float().reshape(B, S, self.n_heads, -1, 2)) * rot)
                .flatten(3).type_as(x) for t in (q, k))
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(B, S, D))


class MoE(nn.Module):
    """Top-2 of 4 experts, computed densely (no data-dependent shapes), with DeepSeek-V3's bookkeeping:
    ``tokens_per_expert`` counted in a buffer updated in place under ``no_grad``, an ``expert_bias``
    buffer read by the router."""

    def __init__(self, dim: int, n_experts: int = 4, hidden: int = 48):
        super().__init__()
        self.router = nn.Linear(dim, n_experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(n_experts, dim, hidden) * dim**-0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, hidden, dim) * hidden**-0.5)
        self.register_buffer("expert_bias", torch.linspace(-0.1, 0.1, n_experts))
        self.register_buffer("tokens_per_expert", torch.zeros(n_experts))

    def forward(self, x):
        # x: [B, S, D]
        scores = torch.sigmoid(self.router(x))  # [B, S, E]
        _, top = torch.topk(scores + self.expert_bias, 2, dim=-1)  # [B, S, 2]
        chosen = (top[..., None] == torch.arange(scores.shape[-1], device=x.device)).any(-2)  # [B, S, E]
        with torch.no_grad():
            self.tokens_per_expert.add_(chosen.sum((0, 1)).float())
        gates = torch.where(chosen, scores, torch.zeros_like(scores))
        gates = gates / gates.sum(-1, keepdim=True)
        h = torch.einsum("bsd,edh->bseh", x, self.w1)
        y = torch.einsum("bseh,ehd->bsed", F.silu(h), self.w2)  # [B, S, E, D]
        return (y * gates[..., None]).sum(-2)


class PatternBlock(nn.Module):
    def __init__(self, pattern: str, dim: int):
        super().__init__()
        self.pattern = pattern
        self.norm = RMSNorm(dim)
        if pattern == "rope_complex":
            self.attention = ComplexRopeAttention(dim, 4)
        self.mix = MoE(dim) if pattern == "moe" else nn.Linear(dim, dim)

    def forward(self, x, freqs_cis):
        if self.pattern == "rope_complex":
            x = x + self.attention(self.norm(x), freqs_cis)
        h = self.mix(self.norm(x))
        if self.pattern.startswith("dropout"):
            h = F.dropout(h, 0.3, self.training)
        return x + h


class Patterns(nn.Module):
    """Embedding, two blocks of one ``pattern``, norm, head. Patterns: ``rope_complex``, ``moe``,
    ``dropout_ckpt`` (the root calls ``torch.utils.checkpoint`` on each block), ``dropout_cw`` (each block is
    wrapped by ``checkpoint_wrapper`` before ``fully_shard``, torchtitan's order), ``dropout_composable`` (each
    block checkpointed by ``torch.distributed._composable.checkpoint`` before ``fully_shard``)."""

    def __init__(self, pattern: str, n_layers: int = 2, dim: int = 32, vocab: int = 256, max_seq: int = 64):
        super().__init__()
        self.pattern = pattern
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(PatternBlock(pattern, dim) for _ in range(n_layers))
        if pattern == "dropout_cw":
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            self.layers = nn.ModuleList(checkpoint_wrapper(b) for b in self.layers)
        if pattern == "dropout_composable":
            from torch.distributed._composable import checkpoint as composable_checkpoint

            for b in self.layers:
                composable_checkpoint(b)
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        angles = torch.outer(torch.arange(max_seq).float(), 1.0 / 10000.0 ** (torch.arange(0, 8, 2).float() / 8))
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, tokens):
        # tokens: [B, S] -> logits [B, S, V]
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            if self.pattern == "dropout_ckpt":
                x = checkpoint(layer, x, self.freqs_cis, use_reentrant=False)
            else:
                x = layer(x, self.freqs_cis)
        return self.output(self.norm(x))
