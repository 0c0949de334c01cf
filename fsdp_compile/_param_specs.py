"""What a parameter is besides a Shard(0) tensor of FSDP2: a DTensor of another parallelism (``ParallelSpec``),
or a local shard that implements FSDP2's all-gather extension (``ExtensionSpec``).

Plain data, read at plan time: ``plan.py`` keeps them on its ``ParamPlan``s, and ``_extensions.py`` builds an
``ExtensionSpec`` (``read_spec``). A leaf: it imports nothing of fsdp_compile, so both can import it.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ParallelSpec:
    """A parameter that was a DTensor before ``fully_shard`` (tensor, sequence or expert parallelism): FSDP
    shards and gathers its local tensor, and the module gets it back as this DTensor, as FSDP2's
    ``init_unsharded_param`` hands it over."""

    mesh: object  # DeviceMesh of its own parallelism (the "tp" or "ep" dims)
    placements: tuple  # its placements there (Shard(0) / Shard(1) / Replicate() ...)
    shape: tuple[int, ...]  # its global shape and stride
    stride: tuple[int, ...]
    # fully_shard(..., dp_mesh_dims=...): ``mesh`` is the full SPMD mesh, Replicate() on these data-parallel dims,
    # where its gradient keeps whatever placement it has (Partial: FSDP's reduce-scatter sums it)
    dp_dims: tuple[int, ...] = ()

    @property
    def dim_names(self) -> tuple[str, ...]:
        return self.mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(self.mesh.ndim))

    def describe(self) -> str:
        return ", ".join(f"{n}={p!r}" for n, p in zip(self.dim_names, self.placements))


@dataclasses.dataclass(frozen=True)
class ExtensionSpec:
    """A parameter whose local shard implements FSDP2's all-gather extension (``fsdp_pre_all_gather`` /
    ``fsdp_post_all_gather``, ``_extensions.py``): what its ``fsdp_pre_all_gather`` is called with, as FSDP2
    calls it, the bytes one rank's all-gather inputs take and the class of the tensor it rebuilds (measured once, at
    plan time)."""

    kind: str  # the local shard's class name (what the fingerprint compares)
    mesh: object  # FSDP2's shard mesh (shard_mesh_from_root)
    orig_size: tuple[int, ...]
    contiguous_stride: tuple[int, ...]
    module: object  # the nn.Module FSDP2 passes (the parameter's owner)
    mp_policy: object  # its MixedPrecisionPolicy
    one_arg: bool  # the older fsdp_pre_all_gather(mesh) signature
    input_bytes: int  # bytes of one rank's all-gather inputs
    unsharded_kind: str  # the class of what fsdp_post_all_gather returns ("Tensor" or a subclass)
