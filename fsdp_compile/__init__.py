"""fsdp-compile: one-graph ``torch.compile`` for FSDP2 (``fully_shard``) models."""

from fsdp_compile import ops as _ops  # noqa: F401  (registers the fsdp_compile:: ops)
from fsdp_compile._api import CompiledFSDPModule, compile, fully_shard
from fsdp_compile.config import CompileConfig

__all__ = ["CompileConfig", "CompiledFSDPModule", "compile", "fully_shard"]
