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

    bucket: Union[BucketMode, tuple[tuple[str, ...], ...]] = "fsdp_group"  # "auto" once the bucketing pass lands
    """How collectives are grouped. ``"none"``: one all-gather and one reduce-scatter per parameter.
    ``"fsdp_group"``: one per FSDP module, as eager FSDP2. ``"auto"``: chosen by the cost model.
    Or an explicit plan: a sequence of buckets, each a sequence of FSDP module FQNs."""

    bucket_cap_mb: float | None = None
    """Upper bound on one bucket's size in MB; ``None`` lets the cost model choose."""

    reorder: bool = False
    """Prefetch all-gathers and sink waits for overlap, within ``memory_budget_gb``. Off until the
    reordering pass lands (then on by default, as DESIGN.md says); without it every collective sits
    where eager FSDP2 issues it."""

    memory_budget_gb: float | None = None
    """Peak-memory bound for the reordering pass; ``None`` means no more than eager FSDP2's peak."""

    hardware: Hardware = "auto"
    """Cost-model profile; ``"auto"`` picks ``cpu-gloo`` on CPU and an H100 profile on CUDA."""

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
