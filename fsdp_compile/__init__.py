"""fsdp-compile: one-graph ``torch.compile`` for FSDP2 (``fully_shard``) models."""

from fsdp_compile import ops as _ops  # noqa: F401  (registers the fsdp_compile:: ops)
from fsdp_compile._api import CompiledFSDPModule, compile, fully_shard
from fsdp_compile._explain import explain
from fsdp_compile._pipeline import CompiledFSDPStage, compile_stage
from fsdp_compile._torch._gloo import single_thread_gloo
from fsdp_compile.config import CompileConfig
from fsdp_compile.report import Bucket, Report

__all__ = ["Bucket", "CompileConfig", "CompiledFSDPModule", "CompiledFSDPStage", "Report", "compile", "compile_stage", "explain",
           "fully_shard", "single_thread_gloo"]
