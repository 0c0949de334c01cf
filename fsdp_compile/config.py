"""``CompileConfig``: every knob of ``fsdp_compile.compile`` in one frozen, validated dataclass."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal, Union, get_args

Backend = Literal["inductor", "aot_eager"]
BucketMode = Literal["none", "fsdp_group", "auto"]
Kernels = Literal["auto", "triton", "torch"]
# Cost-model profiles; the passes issue documents each constant (fsdp_compile/passes/cost_model.py).
Hardware = Literal["auto", "h100-nvlink", "h100-ib", "cpu-gloo"]

DUMP_ENV = "FSDP_COMPILE_DUMP"


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """How ``fsdp_compile.compile`` captures and optimizes an FSDP2 model.

    Every field keeps the meaning it has in ``DESIGN.md``; invalid values raise ``ValueError`` here,
    at construction, never later inside a compile.
    """

    backend: Backend = "inductor"
    """``"inductor"`` generates code (C++ on CPU, Triton on GPU); ``"aot_eager"`` runs the same captured,
    partitioned and rewritten graphs op by op: bitwise equal to eager FSDP2 in fp32, for numerics and debugging."""

    bucket: Union[BucketMode, tuple[tuple[str, ...], ...]] = "auto"
    """How collectives are grouped. ``"none"``: one all-gather and one reduce-scatter per parameter.
    ``"fsdp_group"``: one per FSDP module, as eager FSDP2. ``"auto"``: adjacent FSDP modules merged while
    the cost model predicts a faster step within the memory budget. Or an explicit plan: a sequence of
    buckets, each a sequence of adjacent FSDP module FQNs."""

    bucket_cap_mb: float | None = None
    """Upper bound on one bucket's size in MB; ``None`` lets the cost model choose."""

    reorder: bool = True
    """Prefetch all-gathers and sink reduce-scatter waits for overlap, each move kept only if the cost
    model predicts a faster step within ``memory_budget_gb``; off: every collective sits where eager
    FSDP2 issues it (without its prefetch)."""

    memory_budget_gb: float | None = None
    """Predicted peak-memory bound for bucketing and reordering (GiB); ``None``: eager FSDP2's predicted
    peak (the graph as captured plus one prefetched all-gather)."""

    hardware: Hardware = "auto"
    """Cost-model profile; ``"auto"`` picks ``cpu-gloo`` on CPU and an H100 profile on CUDA."""

    regions: bool = True
    """Trace and compile each kind of repeated block (same class, parameter shapes, dtypes and mixed
    precision: the layers of a transformer) once, as a region every block calls, so compile time grows with
    the distinct code, not with depth. Off: every block is traced and compiled on its own."""

    kernels: Kernels = "auto"
    """Copy-in/copy-out implementation: ``"triton"``, ``"torch"``, or ``"auto"`` (Triton on CUDA, torch elsewhere)."""

    dump_dir: str | None = None
    """Write every stage's graphs and the schedule report here; defaults to ``$FSDP_COMPILE_DUMP``."""

    def __post_init__(self) -> None:
        _check_choice("backend", self.backend, Backend)
        _check_choice("hardware", self.hardware, Hardware)
        _check_choice("kernels", self.kernels, Kernels)
        if isinstance(self.bucket, str):
            _check_choice("bucket", self.bucket, BucketMode)
        else:
            try:
                plan = tuple(tuple(str(fqn) for fqn in bucket) for bucket in self.bucket)
            except TypeError:
                raise ValueError(
                    f"bucket must be one of {get_args(BucketMode)} or a list of lists of FSDP module FQNs, "
                    f"got {self.bucket!r}"
                ) from None
            if not plan or any(not bucket for bucket in plan):
                raise ValueError(f"an explicit bucket plan needs non-empty buckets, got {self.bucket!r}")
            object.__setattr__(self, "bucket", plan)
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0 or None, got {self.bucket_cap_mb!r}")
        if self.memory_budget_gb is not None and not self.memory_budget_gb > 0:
            raise ValueError(f"memory_budget_gb must be > 0 or None, got {self.memory_budget_gb!r}")
        if self.dump_dir is None and os.environ.get(DUMP_ENV):
            object.__setattr__(self, "dump_dir", os.environ[DUMP_ENV])

    def agreement_items(self) -> list[tuple[str, object]]:
        """The fields every rank must set alike (``dump_dir`` may differ: one directory per rank is fine)."""
        return [(f"CompileConfig.{f.name}", repr(getattr(self, f.name))) for f in dataclasses.fields(self) if f.name != "dump_dir"]

    def replace(self, **overrides) -> "CompileConfig":
        unknown = set(overrides) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(
                f"unknown CompileConfig option(s) {sorted(unknown)}; valid: {[f.name for f in dataclasses.fields(self)]}"
            )
        return dataclasses.replace(self, **overrides)


def _check_choice(name: str, value: object, choices) -> None:
    allowed = get_args(choices)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
