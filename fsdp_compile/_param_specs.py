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
    # spmd_types (torch >= 2.14): the module is handed the gathered plain tensor, not the DTensor; its gradient is read
    # as a DTensor with these placements (FSDPParam._spmd_grad_placements) and redistributed on the non-dp dims to
    # ``placements`` (an all-reduce over tp for an R-typed weight), as FSDP2's _get_grad_inner_tensor does
    grad_placements: tuple | None = None

    @property
    def dim_names(self) -> tuple[str, ...]:
        return self.mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(self.mesh.ndim))

    def describe(self) -> str:
        out = ", ".join(f"{n}={p!r}" for n, p in zip(self.dim_names, self.placements))
        if self.grad_placements is not None:
            out += " (plain tensor; gradient from " + ", ".join(map(repr, self.grad_placements)) + ")"
        return out


def parallel_spec(where: str, spec, dp_dims: tuple[int, ...], spmd_grad_placements: tuple | None,
                  ) -> ParallelSpec | None:
    """What the module is handed for an FSDP2 parameter whose unsharded spec is ``spec`` (a DTensorSpec): that
    DTensor (``ParallelSpec``), or, for a parameter annotated by spmd_types (torch >= 2.14: FSDP2 stores it as a
    DTensor on the SPMD mesh and hands the module the gathered plain tensor), the plain tensor: None (a plain
    FSDP parameter) where FSDP2 reduce-scatters its gradient as it is (``_get_grad_inner_tensor``: the gradient's
    placements, Partial on the data-parallel dims, are kept there, and equal the spec's on the others, as under
    data parallelism alone), else a ``ParallelSpec`` with ``grad_placements``: the gradient is all-reduced over
    the dims where it is ``Partial(sum)`` and stored ``Replicate`` (torchtitan's TP: the R-typed weights of the
    sequence-parallel norms, "tp: P(sum) -> R") before the reduce-scatter. Any other move is refused."""
    from torch.distributed.tensor import Replicate

    placements = tuple(spec.placements)
    if spmd_grad_placements is None:
        return ParallelSpec(spec.mesh, placements, tuple(spec.shape), tuple(spec.stride), dp_dims)
    names = spec.mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(spec.mesh.ndim))
    moved = [(i, g, p) for i, (g, p) in enumerate(zip(spmd_grad_placements, placements)) if i not in dp_dims and g != p]
    if not moved:
        return None
    other = [f"{names[i]}: {g} -> {p}" for i, g, p in moved
             if not (g.is_partial() and getattr(g, "reduce_op", None) == "sum" and p == Replicate())]
    if other:
        raise NotImplementedError(
            f"{where}: a parameter annotated by spmd_types (torchtitan's spmd_backend=\"spmd_types\") whose "
            f"gradient FSDP2 redistributes on a non-data-parallel mesh dim ({'; '.join(other)}) is not supported "
            "under fsdp_compile.compile (data parallelism alone is, and an all-reduce of a Partial(sum) gradient to "
            "a Replicate weight, as TP's R-typed weights have); use spmd_backend=\"full_dtensor\" or "
            "\"partial_dtensor\" (parameters as DTensors), or train it with eager FSDP2"
        )
    return ParallelSpec(spec.mesh, placements, tuple(spec.shape), tuple(spec.stride), dp_dims,
                        tuple(spmd_grad_placements))


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
    # a subclass's (class, inner tensor names, flatten context) from its __tensor_flatten__, where its inner tensors
    # are plain (what a region takes it by: capture/boundary.py); None otherwise. Not compared: contexts may hold
    # anything (torchao's a config), and the kind and the step's key already tell extensions apart
    unsharded_flatten: object = dataclasses.field(default=None, compare=False)
