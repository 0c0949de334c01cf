"""Whether a compiled forward or backward graph can be captured and replayed as a CUDA graph, and if not, why.

``capture_blockers(gm, device, static_inputs)`` reads a partitioned graph (after our passes, region bodies
included) and returns one line per reason it cannot be replayed from a CUDA graph, empty when it can::

    tensors off the step's device      a CPU scalar, a copy between host and device (CPU offload): a graph
                                       replays device work only, a host copy would read stale memory
    data-dependent sizes               an unbacked symbol (``.tolist()`` split sizes of expert parallelism's
                                       all-to-all, ``nonzero``): a graph's sizes are fixed at capture
    dynamic shapes                     a symbolic input size: one graph (and its memory) per size
    ops torch cannot capture           torch's own list (``cudagraph_unsafe`` tags, RNG ops of old
                                       generators, ``_local_scalar_dense``: a host sync)
    mutated inputs that are not static an input copied into the graph's buffer each replay, mutated there:
                                       the caller's tensor would not see the mutation

The backend (``backend.py``) asks this of every top-level graph before it hands it to torch's CUDA graph
trees, and runs a graph with blockers uncaptured, saying why (``CapturedGraphs.cudagraphs``, the report, a
warning): never silently. A backward whose forward runs uncaptured runs uncaptured too (its saved tensors
are not in the graphs' pool). Pure: reads the graph only, so it is tested on graphs captured on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.fx as fx


def capture_blockers(gm: fx.GraphModule, device: torch.device, static_inputs: Iterable[int] = ()) -> list[str]:
    """Why ``gm`` cannot be replayed as a CUDA graph on ``device`` (empty: it can). ``static_inputs``: the
    placeholder positions whose memory is the same at every call (parameters' shards, buffers, saved tensors)."""
    from torch._inductor.utils import is_cudagraph_unsafe_fx_node
    from torch.fx.experimental.symbolic_shapes import free_symbols, free_unbacked_symbols

    reasons: list[str] = []
    off_device: dict[str, str] = {}  # device -> first node on it
    unbacked = unsafe = None
    for graph_module in _graph_modules(gm):
        for node in graph_module.graph.nodes:
            for val in _values(node):
                if isinstance(val, torch.Tensor) and val.device != device and val.device.type != "meta":
                    off_device.setdefault(str(val.device), _where(node))
                if unbacked is None and free_unbacked_symbols(val):
                    unbacked = node
            if unsafe is None and node.op == "call_function" and is_cudagraph_unsafe_fx_node(node):
                unsafe = node
    if off_device:
        first = ", ".join(f"{d} ({n})" for d, n in sorted(off_device.items()))
        reasons.append(f"tensors off {device}: {first}; a copy between host and device cannot be replayed")
    if unbacked is not None:
        reasons.append(f"data-dependent sizes at {_where(unbacked)}: a CUDA graph's sizes are fixed at capture")
    placeholders = gm.graph.find_nodes(op="placeholder")
    dynamic = next((n for n in placeholders if free_symbols(n.meta.get("val"))), None)
    if dynamic is not None:
        reasons.append(f"dynamic shapes (input {dynamic.name}: {_shape(dynamic.meta.get('val'))}): one graph per "
                       "size; mark the inputs static (torch._dynamo.mark_static) or pad them to fixed sizes")
    if unsafe is not None:
        reasons.append(f"an op torch cannot capture: {_where(unsafe)}")
    mutated = sorted(set(_mutated_inputs(gm, placeholders)) - set(static_inputs))
    if mutated:
        names = ", ".join(placeholders[i].name for i in mutated[:4])
        reasons.append(f"inputs mutated in place that are copied into the graph at each replay ({names})")
    return reasons


def _graph_modules(gm: fx.GraphModule):
    """``gm`` and the graph modules it calls (region bodies of ``invoke_subgraph``)."""
    return [m for m in gm.modules() if isinstance(m, fx.GraphModule)]


def _values(node: fx.Node) -> list:
    val = node.meta.get("val")
    if isinstance(val, (list, tuple)):
        return list(val)
    return [] if val is None else [val]


def _where(node: fx.Node) -> str:
    target = getattr(node.target, "__name__", None) or str(node.target)
    return f"{node.name} = {target}"


def _shape(val) -> str:
    if isinstance(val, torch.Tensor):
        return str(list(val.shape))
    return repr(val)


def _mutated_inputs(gm: fx.GraphModule, placeholders: list[fx.Node]) -> list[int]:
    """Positions of the placeholders that an op with a mutable schema argument writes (``copy_`` of a
    functionalized input mutation, an in-place op), directly or through a view."""
    base = {}
    for i, p in enumerate(placeholders):
        base[p] = i
    for node in gm.graph.nodes:  # views of inputs map to the input (aliasing ops have no mutation of their own)
        if node.op == "call_function" and node not in base and _is_view(node):
            src = node.args[0] if node.args else None
            if isinstance(src, fx.Node) and src in base:
                base[node] = base[src]
    out = []
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None:
            continue
        for i, arg in enumerate(schema.arguments):
            if not (arg.alias_info and arg.alias_info.is_write):
                continue
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, fx.Node) and v in base:
                    out.append(base[v])
    return out


def _is_view(node: fx.Node) -> bool:
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    ret = schema.returns[0].alias_info
    return ret is not None and not ret.is_write
