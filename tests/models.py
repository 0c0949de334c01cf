"""The model zoo for tests, the demo and the benchmarks.

* ``Llama``: a Llama-style decoder (RMSNorm, RoPE, SwiGLU, optional tied embeddings), from the package.
* ``OddMLP``: dims that no world size divides (uneven dim-0 shards, ranks with empty shards).
* ``FrozenBuffers``: frozen parameters and buffers beside trainable ones.

``shard(model, ...)`` applies ``fully_shard`` per block and then to the root, as users do.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_compile.models import Llama, LlamaArgs  # noqa: F401  (re-exported for the tests)


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
