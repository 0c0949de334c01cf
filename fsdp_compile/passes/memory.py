"""Live memory of a graph executed in node order, from the fake tensors in ``node.meta["val"]``.

The model, per storage (tensors that share a storage are one allocation; views, ``_unsafe_view``,
``getitem`` and other aliases allocate nothing):

* allocated at the first node whose output is in it;
* freed after its last use: the last node that reads a tensor in it or whose output aliases it.
  A collective's input is held until the collective's ``wait_tensor`` (the communication library reads it
  until then), and ``wait_tensor`` returns its collective's output (same storage, although the fake tensors
  of the two nodes are distinct objects);
* graph inputs (placeholders: parameters, saved activations, tangents) are live throughout: the caller owns
  them, so they count from the first node to the last whether or not a later node still reads them;
* graph outputs are live to the end;
* with a cost model, what the communication backend allocates for a collective beyond its output
  (``HardwareProfile.collective_scratch``: gloo's copy of a reduce-scatter's input) is allocated at the
  collective and freed after its wait.

``memory_timeline(graph)[i]`` is the bytes live while node ``i`` runs: everything allocated before or at
``i`` and not freed before ``i`` (a node's inputs and outputs coexist). The caching allocator's rounding and
fragmentation are not modelled.
"""

from __future__ import annotations

import torch.fx as fx

from fsdp_compile.passes import _program


def memory_timeline(graph: fx.Graph | fx.GraphModule, cost_model=None) -> list[int]:
    """Bytes live while each node runs, in ``graph.nodes`` order (the backend's scratch with ``cost_model``)."""
    if isinstance(graph, fx.GraphModule):
        graph = graph.graph
    return _program.timeline(_program.lower(graph, cost_model))


def peak_memory(graph: fx.Graph | fx.GraphModule, cost_model=None) -> tuple[int, fx.Node | None]:
    """``(peak live bytes, the first node at which it is reached)`` (``(0, None)`` for an empty graph); the
    backend's scratch counted with ``cost_model``."""
    if isinstance(graph, fx.GraphModule):
        graph = graph.graph
    return peak_of(graph, _program.lower(graph, cost_model))


def peak_of(graph: fx.Graph, ops: list[_program.Op]) -> tuple[int, fx.Node | None]:
    """``peak_memory`` of ``graph`` from its lowering ``ops``: a caller that also simulates lowers it once."""
    timeline = _program.timeline(ops)
    if not timeline:
        return 0, None
    peak = max(timeline)
    return peak, list(graph.nodes)[timeline.index(peak)]
