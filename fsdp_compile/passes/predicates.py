"""Node predicates shared by every pass: which FX nodes are collectives and waits, what they move.

The graphs our passes see are AOTAutograd's partitioned forward and backward graphs, after
``placement.place_collectives``. ``ops.unshard`` decomposes into plain functional collectives::

    copy-in (views, convert_element_type, constant_pad_nd, cat | clone)          forward / recomputed
      -> _c10d_functional.all_gather_into_tensor(flat, W, group_name) -> wait_tensor
      -> copy-out (view [W, -1], slice, clone, _unsafe_view per parameter)
    pack (convert_element_type, constant_pad_nd, view [W, -1], cat dim 1, view -1)    backward
      -> _c10d_functional.reduce_scatter_tensor(packed, "avg" | "sum", W, group_name) -> wait_tensor
      -> unpack (slice, view, convert_element_type per parameter)

Every node of both chains carries the annotation of ``fsdp_compile._annotations`` (``fsdp_meta``); which
collective a node is comes from its target, never from the annotation. This module and that leaf are all
the passes know of the capture: no pass imports ``ops``, ``capture``, ``backend``, ``debug`` or ``_api``.
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

# the annotation's readers, public here for every pass
from fsdp_compile._annotations import fsdp_group, fsdp_groups, fsdp_meta, fsdp_unit, gradient_dependent  # noqa: F401

_c10d = torch.ops._c10d_functional

ALL_GATHER_OPS = frozenset({_c10d.all_gather_into_tensor.default})
REDUCE_SCATTER_OPS = frozenset({_c10d.reduce_scatter_tensor.default})
ALL_REDUCE_OPS = frozenset({_c10d.all_reduce.default})
# Collectives the simulator knows how to time but that no pass rewrites.
_OTHER_COLLECTIVE_OPS = frozenset(
    {
        _c10d.all_gather_into_tensor_out.default,
        _c10d.all_reduce_.default,
        _c10d.all_to_all_single.default,
        _c10d.broadcast.default,
        _c10d.all_gather_into_tensor_coalesced.default,
        _c10d.reduce_scatter_tensor_coalesced.default,
    }
)
COLLECTIVE_OPS = ALL_GATHER_OPS | REDUCE_SCATTER_OPS | ALL_REDUCE_OPS | _OTHER_COLLECTIVE_OPS
# what the report and the passes' records count, per step: FSDP's collectives (an out= all-gather too) and
# those of a model's own parallel plan (TP)
_COUNTED = {
    **{op: "all_gathers" for op in ALL_GATHER_OPS | {_c10d.all_gather_into_tensor_out.default}},
    **{op: "reduce_scatters" for op in REDUCE_SCATTER_OPS},
    **{op: "all_reduces" for op in ALL_REDUCE_OPS | {_c10d.all_reduce_.default}},  # Inductor makes TP's in place
}
WAIT_OPS = frozenset({_c10d.wait_tensor.default})

_KIND = {
    **{op: "all_gather" for op in ALL_GATHER_OPS | {_c10d.all_gather_into_tensor_out.default, _c10d.all_gather_into_tensor_coalesced.default}},
    **{op: "reduce_scatter" for op in REDUCE_SCATTER_OPS | {_c10d.reduce_scatter_tensor_coalesced.default}},
    **{op: "all_reduce" for op in ALL_REDUCE_OPS | {_c10d.all_reduce_.default}},
    _c10d.all_to_all_single.default: "all_to_all",
    _c10d.broadcast.default: "broadcast",
}


def _is_call(node: fx.Node, ops) -> bool:
    return node.op == "call_function" and node.target in ops


def is_all_gather(node: fx.Node) -> bool:
    """``_c10d_functional.all_gather_into_tensor`` (the only all-gather our passes rewrite)."""
    return _is_call(node, ALL_GATHER_OPS)


def is_reduce_scatter(node: fx.Node) -> bool:
    """``_c10d_functional.reduce_scatter_tensor``."""
    return _is_call(node, REDUCE_SCATTER_OPS)


def is_collective(node: fx.Node) -> bool:
    """Any functional collective that returns before completion and is finished by a ``wait_tensor``."""
    return _is_call(node, COLLECTIVE_OPS)


def is_wait(node: fx.Node) -> bool:
    """``_c10d_functional.wait_tensor``."""
    return _is_call(node, WAIT_OPS)


def collective_kind(node: fx.Node) -> str | None:
    """``"all_gather" | "reduce_scatter" | "all_reduce" | "all_to_all" | "broadcast"``, or None."""
    return _KIND.get(node.target) if node.op == "call_function" else None


def counted_kind(node: fx.Node) -> str | None:
    """``"all_gathers" | "reduce_scatters" | "all_reduces"``: the count ``node`` adds to, or None."""
    return _COUNTED.get(node.target) if node.op == "call_function" else None


def collective_counts(nodes) -> dict[str, int]:
    """All-gathers, reduce-scatters and all-reduces among ``nodes`` (a graph's, or ``report.with_region_bodies``)."""
    counts = {"all_gathers": 0, "reduce_scatters": 0, "all_reduces": 0}
    for node in nodes:
        kind = counted_kind(node)
        if kind is not None:
            counts[kind] += 1
    return counts


def wait_of(collective: fx.Node) -> fx.Node | None:
    """The ``wait_tensor`` that finishes ``collective`` (None if it is never waited in this graph)."""
    for user in collective.users:
        if is_wait(user):
            return user
    return None


def collective_of(wait: fx.Node) -> fx.Node | None:
    """The collective a ``wait_tensor`` finishes (None for a wait on anything else)."""
    if not is_wait(wait):
        return None
    src = wait.args[0]
    # coalesced collectives return a list: wait(getitem(coll, i))
    if isinstance(src, fx.Node) and src.op == "call_function" and src.target is operator.getitem and src.args:
        src = src.args[0]
    return src if isinstance(src, fx.Node) and is_collective(src) else None


def _arg(node: fx.Node, index: int, name: str):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs[name]


def process_group_name(node: fx.Node) -> str:
    """The c10d group name a collective runs on (``group_name`` argument)."""
    kind = collective_kind(node)
    if kind is None:
        raise ValueError(f"{node.name} ({node.target}) is not a functional collective")
    index = {"all_gather": 2, "reduce_scatter": 3, "all_reduce": 2, "all_to_all": 3, "broadcast": 2}[kind]
    return str(_arg(node, index, "group_name"))


def world_size(node: fx.Node) -> int:
    """The number of ranks a collective runs over.

    All-gather and reduce-scatter carry it as ``group_size``; for the others it is looked up from the
    registered process group by name (needs an initialized process group, real or fake).
    """
    kind = collective_kind(node)
    if kind == "all_gather":
        return int(_arg(node, 1, "group_size"))
    if kind == "reduce_scatter":
        return int(_arg(node, 2, "group_size"))
    if kind is None:
        raise ValueError(f"{node.name} ({node.target}) is not a functional collective")
    from torch.distributed.distributed_c10d import _get_group_size_by_name

    name = process_group_name(node)
    try:
        return int(_get_group_size_by_name(name))
    except Exception as e:  # noqa: BLE001 - re-raised with the node and group named
        raise ValueError(f"cannot find the size of process group {name!r} used by {node.name}: {e}") from None


def reduce_op(node: fx.Node) -> str | None:
    """``"sum" | "avg" | ...`` for a reduce-scatter / all-reduce, None for other collectives."""
    kind = collective_kind(node)
    if kind in ("reduce_scatter", "all_reduce"):
        return str(_arg(node, 1, "reduce_op"))
    return None


# --- sizes ----------------------------------------------------------------------------------------


def _hint(x) -> int:
    """An int for a size. Symbolic sizes give their hint: ``int(SymInt)`` would install a guard that
    specializes the compiled graph to this size (one recompile per new sequence length)."""
    if isinstance(x, int):
        return x
    from torch.fx.experimental.symbolic_shapes import optimization_hint

    return int(optimization_hint(x, fallback=8192))  # unbacked sizes (no hint): assume a long sequence


def tensor_bytes(val) -> int:
    """Bytes of a tensor's elements (``numel * itemsize``; size hints for symbolic shapes)."""
    if not isinstance(val, torch.Tensor):
        return 0
    return math.prod(_hint(s) for s in val.shape) * val.dtype.itemsize


def val_tensors(val) -> list[torch.Tensor]:
    """The tensors in a ``node.meta["val"]`` (a tensor, or a tuple / list of them, or none)."""
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in val_tensors(v)]
    return []


def node_bytes(node) -> int:
    """Bytes of the tensors a node produces (0 without ``meta["val"]``)."""
    if not isinstance(node, fx.Node):
        return 0
    return sum(tensor_bytes(t) for t in val_tensors(node.meta.get("val")))


def collective_bytes(node: fx.Node) -> int:
    """The bytes a collective moves, in the convention of NCCL's bus-bandwidth formulas.

    all-gather: input bytes x world size (the gathered tensor); reduce-scatter and all-reduce: input
    bytes (the full, unreduced tensor). Read from ``meta["val"]``.
    """
    kind = collective_kind(node)
    if kind is None:
        raise ValueError(f"{node.name} ({node.target}) is not a functional collective")
    args = node.args[0] if isinstance(node.args[0], (list, tuple)) else [node.args[0]]
    in_bytes = sum(node_bytes(a) for a in args)
    if kind == "all_gather":
        return in_bytes * world_size(node)
    return in_bytes


def collectives(graph: fx.Graph, kind: str | None = None) -> list[fx.Node]:
    """The graph's collectives in program order, optionally only one ``collective_kind``."""
    return [n for n in graph.nodes if is_collective(n) and (kind is None or collective_kind(n) == kind)]


def is_view(node: fx.Node) -> bool:
    """Nodes that move no data: ATen views / aliases, tuple indexing, ``wait_tensor`` (returns its input)."""
    if node.op != "call_function":
        return node.op in ("placeholder", "output", "get_attr")
    if node.target is operator.getitem or is_wait(node):
        return True
    return getattr(node.target, "overloadpacket", None) in _VIEW_PACKETS


_VIEW_PACKETS = {
    getattr(torch.ops.aten, name)
    for name in (
        "view", "_unsafe_view", "_reshape_alias", "as_strided", "slice", "select", "t", "transpose",
        "permute", "expand", "unsqueeze", "squeeze", "alias", "detach", "split", "split_with_sizes",
        "chunk", "unbind", "diagonal", "narrow", "unfold", "view_as_real", "view_as_complex", "lift_fresh",
    )
    if hasattr(torch.ops.aten, name)
}


def is_fixed(node: fx.Node) -> bool:
    """A node the scheduling passes never carry along when they move a collective's chain: another
    collective or wait (that would reorder collectives), a graph input or output, or a side effect."""
    return is_collective(node) or is_wait(node) or node.op != "call_function" or node.is_impure()
