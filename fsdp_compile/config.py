"""``CompileConfig``: every knob of ``fsdp_compile.compile`` in one frozen, validated dataclass."""

from __future__ import annotations

import dataclasses
import os
from typing import Literal, Union, get_args

from fsdp_compile.passes.cost_model import HardwareProfile

Backend = Literal["inductor", "aot_eager"]
BucketMode = Literal["none", "fsdp_group", "auto"]
Kernels = Literal["auto", "triton", "torch"]
# Cost-model profiles; the passes issue documents each constant (fsdp_compile/passes/cost_model.py).
Hardware = Literal["auto", "h100-nvlink", "h100-ib", "cpu-gloo"]

DUMP_ENV = "FSDP_COMPILE_DUMP"


@dataclasses.dataclass(frozen=True)
class CompileConfig:
    """How ``fsdp_compile.compile`` captures and optimizes an FSDP2 model.

    Every field keeps the meaning it has in ``DESIGN.md``; invalid values raise ``ValueError`` (a wrong
    type: ``TypeError``) here, at construction, with one line naming the field, the value and the fix,
    never later inside a compile.
    """

    backend: Backend = "inductor"
    """``"inductor"`` generates code (C++ on CPU, Triton on GPU); ``"aot_eager"`` runs the same captured,
    partitioned and rewritten graphs op by op: bitwise equal to eager FSDP2 in fp32, for numerics and debugging."""

    bucket: Union[BucketMode, tuple[tuple[str, ...], ...]] = "auto"
    """How collectives are grouped into the schedule's units. ``"none"``: one all-gather and one
    reduce-scatter per parameter. ``"fsdp_group"``: one per FSDP module, as eager FSDP2. ``"auto"``: adjacent
    FSDP modules merged while the cost model predicts a faster step within the memory budget, and the root
    gathered in two parts where that is faster: its leading parameters (an embedding) where it starts, its
    head (final norm, output) after the blocks, whose reduce-scatter then overlaps the blocks' backward. Or an
    explicit plan: a sequence of buckets, each a sequence of adjacent FSDP module FQNs."""

    bucket_cap_mb: float | None = None
    """Upper bound on one bucket's all-gather in MiB; ``None`` lets the cost model choose."""

    reorder: bool = True
    """Prefetch all-gathers and defer reduce-scatter waits for overlap, as far as the cost model predicts
    a faster step within ``memory_budget_gb``; off: every collective sits where eager FSDP2 issues it
    (without its prefetch; FSDP2's own prefetch settings are honored either way)."""

    memory_budget_gb: float | None = None
    """Bound (GiB) on what the schedule holds at once of gathered parameters and reduce-scatter buffers:
    the part of the peak a schedule decides (activations and sharded state are the same under every
    schedule), and the same on every rank. ``None``: what eager FSDP2 holds on the same model."""

    hardware: Hardware | HardwareProfile = "auto"
    """Cost-model profile: a name (``"auto"`` picks ``cpu-gloo`` on CPU and an H100 profile on CUDA), or a
    ``passes.HardwareProfile`` of your own (your machine's measured speeds: ``bench/calibrate_cpu_gloo.py``
    measures a CPU's). Every rank must pass the same one, as every other field (the ranks' configs are
    compared at the first call)."""

    regions: bool = True
    """Trace and compile each kind of repeated block (same class, parameter shapes, dtypes and mixed
    precision: the layers of a transformer) once, as a region every block calls, so compile time grows with
    the distinct code, not with depth. Off: every block is traced and compiled on its own."""

    kernels: Kernels = "auto"
    """Copy-in/copy-out implementation: ``"triton"``, ``"torch"``, or ``"auto"`` (Triton on CUDA, torch elsewhere)."""

    cudagraphs: bool = False
    """Replay the compiled forward and backward as CUDA graphs (torch's CUDA graph trees: one memory pool, the
    parameters' local shards and the modules' buffers as static inputs, NCCL collectives captured inside),
    which takes the host's launch overhead out of the step. CUDA only. A graph that cannot be captured (a
    tensor off the GPU, data-dependent sizes, dynamic shapes, ops torch cannot capture) runs uncaptured, with
    a warning and the reason in ``explain``'s report (``passes/cudagraphs.py``). Outputs and gradients are
    copied out of the graphs' memory, so they stay valid after the next step; a replay that runs past the
    process group's timeout aborts the group (``_cudagraphs.py``). Call ``compiled.close()`` before
    ``destroy_process_group``. Off by default until measured on more than one GPU model (docs/gpu.md)."""

    dump_dir: str | None = None
    """Write every stage's graphs and the schedule report here; defaults to ``$FSDP_COMPILE_DUMP``. Checked
    here for the common mistakes; created by ``compile`` and ``explain`` (``debug.dump.make_dump_dir``)."""

    def __post_init__(self) -> None:
        _check_choice("backend", self.backend, Backend, "fsdp_compile runs its passes before either")
        if not isinstance(self.hardware, HardwareProfile):
            _check_choice("hardware", self.hardware, Hardware,
                          "the cost model's profiles; 'auto' picks by device; or a passes.HardwareProfile")
        _check_choice("kernels", self.kernels, Kernels, "the copy-in/copy-out implementation")
        for name in ("reorder", "regions", "cudagraphs"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {_shown(getattr(self, name))}")
        if isinstance(self.bucket, str):
            _check_choice("bucket", self.bucket, BucketMode, "or a list of lists of FSDP module FQNs")
        else:
            object.__setattr__(self, "bucket", _bucket_plan(self.bucket))
        for name, unit in (("bucket_cap_mb", "MiB"), ("memory_budget_gb", "GiB")):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(f"{name} must be a number of {unit} > 0 or None, got {_shown(value)}")
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a number of {unit} > 0 or None, got {value!r}")
        from_env = self.dump_dir is None and bool(os.environ.get(DUMP_ENV))
        if from_env:
            object.__setattr__(self, "dump_dir", os.environ[DUMP_ENV])
        if self.dump_dir is not None:
            if not isinstance(self.dump_dir, (str, os.PathLike)):
                raise TypeError(f"dump_dir must be a directory path or None, got {_shown(self.dump_dir)}")
            object.__setattr__(self, "dump_dir", os.fspath(self.dump_dir))
            problem = _unwritable(self.dump_dir)
            if problem:
                where = f"${DUMP_ENV}={self.dump_dir!r}" if from_env else f"dump_dir={self.dump_dir!r}"
                raise ValueError(f"{where} {problem}; point it at a directory you can write, or unset it")

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


def _shown(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def _check_choice(name: str, value: object, choices, hint: str) -> None:
    allowed = get_args(choices)
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))} ({hint}), got {_shown(value)}")


def _bucket_plan(bucket) -> tuple[tuple[str, ...], ...]:
    """An explicit bucket plan as a tuple of tuples of FQNs, or one line saying what is wrong with it."""
    example = "e.g. bucket=[['layers.0', 'layers.1'], ['layers.2', 'layers.3']]"
    try:
        buckets = list(bucket)
    except TypeError:
        raise TypeError(f"bucket must be 'none', 'fsdp_group', 'auto' or a list of lists of FSDP module FQNs ({example}), "
                        f"got {_shown(bucket)}") from None
    if not buckets:
        raise ValueError(f"an explicit bucket plan needs at least one bucket ({example}), got {bucket!r}")
    if all(isinstance(b, str) for b in buckets):
        raise ValueError(f"bucket={bucket!r} is a flat list: a plan is a list of buckets, each a list of FSDP module "
                         f"FQNs; for one bucket of these modules write bucket=[{list(buckets)!r}]")
    plan = []
    for b in buckets:
        if isinstance(b, str) or not hasattr(b, "__iter__"):
            raise TypeError(f"every bucket of the plan is a list of FSDP module FQNs ({example}), got {_shown(b)}")
        members = tuple(b)
        if not members:
            raise ValueError(f"an explicit bucket plan needs non-empty buckets ({example}), got {bucket!r}")
        bad = [m for m in members if not isinstance(m, str)]
        if bad:
            raise TypeError(f"bucket {list(members)!r} holds {_shown(bad[0])}: name FSDP modules by their FQN strings "
                            "('' for the root)")
        plan.append(members)
    seen: set[str] = set()
    for members in plan:
        for fqn in members:
            if fqn in seen:
                raise ValueError(f"bucket plan names {fqn!r} twice; each FSDP module goes in one bucket")
            seen.add(fqn)
    return tuple(plan)


def _unwritable(path: str) -> str | None:
    """Why ``path`` cannot hold a dump (None: it can). Nothing is created here."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if os.path.exists(probe) and not os.path.isdir(probe):
        return f"is not a directory ({probe!r} is a file)"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"is not writable ({probe!r} does not allow it)"
    return None
