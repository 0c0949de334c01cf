"""One bucket's rewrite: many adjacent FSDP collectives of one kind merged into one.

``describe`` says how a list of collectives merges (or why it cannot); the rewrite then exists in two
forms kept side by side so that they cannot drift: ``apply_rewrite`` edits the FX graph, and
``Estimator.transform`` has the same effect on the lowered program (``_program``), which is what the
planner evaluates candidates on (editing a list is cheap; copying and rewriting the graph is not).

All-gather (``n_k``: member k's per-rank flat length, ``N = sum n_k``)::

    cat(copy-in pieces of every member)            [N]        one copy-in, at the first member's place
      -> all_gather_into_tensor -> wait_tensor     [W * N]    rank-major: rank r's flat at [r*N, (r+1)*N)
      -> view [W, N] -> slice columns [off_k, off_k + n_k]    each member's [W, n_k], fed to its copy-out

Reduce-scatter::

    cat(each member's packed [W, n_k], dim=1) -> view [W * N]   at the last member's place
      -> reduce_scatter_tensor -> wait_tensor     [N]
      -> slice [off_k, off_k + n_k]                  each member's reduced shard, fed to its unpack

The members' own concatenations (``cat`` / ``clone``) are absorbed, so the bucket adds no copy; a view in a
member's copy-out that no longer applies to the non-contiguous column slice gets a ``clone`` in front.
Numerics are unchanged: the same elements are gathered and reduced elementwise.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from fsdp_compile._annotations import REDUCE_SCATTER, UNSHARD, set_fsdp_meta
from fsdp_compile.passes import _program
from fsdp_compile.passes import predicates as P
from fsdp_compile.passes.cost_model import CostModel

aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
KINDS = ("all_gather", "reduce_scatter")


# --- one bucket's rewrite, described on the graph -------------------------------------------------


@dataclasses.dataclass
class Member:
    coll: fx.Node
    wait: fx.Node
    n: int  # per-rank flat length (all-gather input / reduce-scatter output)
    pieces: list[fx.Node]  # all-gather: 1-D inputs of the copy-in cat; reduce-scatter: [W, n_i] chunks
    view_input: bool  # reduce-scatter: the piece is ``coll``'s input viewed as [W, -1] (made by the rewrite)
    absorbed: list[fx.Node]  # the member's own cat/clone/view, erased with the collective


@dataclasses.dataclass
class Rewrite:
    kind: str
    members: list[Member]
    anchor: fx.Node  # new copy-in + collective go right before this node
    wait_anchor: fx.Node  # new wait + per-member slices go right before this node
    hoist: list[fx.Node]  # all-gather: pieces' producers after ``anchor``, moved before the new copy-in
    sink: list[fx.Node]  # reduce-scatter: members' users before ``wait_anchor``, moved after the slices
    world_size: int
    group_name: str
    reduce_op: str | None

    @property
    def groups(self) -> list[str]:
        out: list[str] = []
        for m in self.members:
            for g in P.fsdp_groups(m.coll):
                if g not in out:
                    out.append(g)
        return out


def bucket_key(node: fx.Node):
    return (P.collective_kind(node), P.process_group_name(node), P.world_size(node), P.collective_dtype(node), P.reduce_op(node))


def _numel(node: fx.Node) -> int:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise ValueError(f"{node.name} has no tensor meta['val']: bucketing needs shapes")
    return math.prod(P._hint(s) for s in val.shape)


def _is_view_to(node: fx.Node, src: fx.Node, ndim: int) -> bool:
    return (
        node.op == "call_function"
        and node.target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
        and node.args[0] is src
        and len(node.args[1]) == ndim
    )


def _member(coll: fx.Node) -> Member | str:
    """How one collective joins a bucket, or why it cannot."""
    wait = P.wait_of(coll)
    if wait is None:
        return f"{coll.name} is never waited in this graph"
    if len(coll.users) != 1:
        return f"{coll.name} has users besides its wait_tensor"
    x = coll.args[0]
    if not isinstance(x, fx.Node):
        return f"{coll.name}: input is not a graph value"
    w = P.world_size(coll)
    if P.is_all_gather(coll):
        n = _numel(x)
        if x.target is aten.cat.default and len(x.users) == 1 and (len(x.args) < 2 or x.args[1] in (0, -1)):
            pieces = list(x.args[0])
            if all(isinstance(p, fx.Node) and p.meta.get("val") is not None and p.meta["val"].dim() == 1 for p in pieces):
                return Member(coll, wait, n, pieces, False, [x])
        if x.target is aten.clone.default and len(x.users) == 1 and not x.kwargs and isinstance(x.args[0], fx.Node):
            src = x.args[0]
            if src.meta.get("val") is not None and src.meta["val"].dim() == 1:
                return Member(coll, wait, n, [src], False, [x])
        return Member(coll, wait, n, [x], False, [])
    # reduce-scatter: x = view(cat(chunks [W, n_i], dim=1), [-1]) from the capture's pack
    n = _numel(x) // w
    if _is_view_to(x, x.args[0], 1) and len(x.users) == 1:
        src = x.args[0]
        src_val = src.meta.get("val")
        if src.target is aten.cat.default and len(src.users) == 1 and len(src.args) > 1 and src.args[1] in (1, -1):
            chunks = list(src.args[0])
            if all(isinstance(c, fx.Node) and c.meta["val"].dim() == 2 and c.meta["val"].shape[0] == w for c in chunks):
                return Member(coll, wait, n, chunks, False, [x, src])
        if isinstance(src_val, torch.Tensor) and src_val.dim() == 2 and src_val.shape[0] == w:
            return Member(coll, wait, n, [src], False, [x])
    return Member(coll, wait, n, [x], True, [])


def describe(graph: fx.Graph, colls: list[fx.Node], pos: dict[fx.Node, int]) -> Rewrite | str:
    """The rewrite that merges ``colls`` (program order), or the reason it cannot be done."""
    members = []
    for c in colls:
        m = _member(c)
        if isinstance(m, str):
            return m
        members.append(m)
    first = colls[0]
    kind = P.collective_kind(first)
    if len({bucket_key(c) for c in colls}) != 1:
        return f"{[c.name for c in colls]} differ in process group, world size, dtype or reduce op"
    if kind == "all_gather":
        anchor = first
        wait_anchor = min((m.wait for m in members), key=pos.__getitem__)
        # producers of the pieces that come after the anchor must move before it
        hoist, seen, stack = [], set(), [p for m in members for p in m.pieces]
        while stack:
            n = stack.pop()
            if n in seen or pos[n] < pos[anchor]:
                continue
            seen.add(n)
            if P.is_fixed(n):
                return f"bucketing {[c.name for c in colls]} would move {n.name} ({n.target}) before {anchor.name}"
            hoist.append(n)
            stack.extend(n.all_input_nodes)
        hoist.sort(key=pos.__getitem__)
        sink: list[fx.Node] = []
    else:
        anchor = colls[-1]
        later = [m.wait for m in members if pos[m.wait] > pos[anchor]]
        wait_anchor = min(later, key=pos.__getitem__)
        # users of members' results that come before the new wait must move after it
        sink, seen, stack = [], set(), [u for m in members for u in m.wait.users]
        while stack:
            n = stack.pop()
            if n in seen or pos[n] > pos[wait_anchor]:
                continue
            seen.add(n)
            if P.is_fixed(n) and n.op != "placeholder":
                return f"bucketing {[c.name for c in colls]} would move {n.name} ({n.target}) after {wait_anchor.name}"
            sink.append(n)
            stack.extend(n.users)
        sink.sort(key=pos.__getitem__)
        sink_set = set(sink)
        # ...which is impossible if the bucket's own inputs depend on them
        stack, seen = [p for m in members for p in m.pieces], set()
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n in sink_set:
                return f"{[c.name for c in colls]}: {n.name} depends on an earlier member's result"
            stack.extend(n.all_input_nodes)
        hoist = []
    return Rewrite(
        kind=kind,
        members=members,
        anchor=anchor,
        wait_anchor=wait_anchor,
        hoist=hoist,
        sink=sink,
        world_size=P.world_size(first),
        group_name=P.process_group_name(first),
        reduce_op=P.reduce_op(first),
    )


# --- the rewrite, graph form: what apply_buckets runs --------------------------------------------------------------


def fake_mode(graph: fx.Graph) -> FakeTensorMode:
    for n in graph.nodes:
        for t in P.val_tensors(n.meta.get("val")):
            if isinstance(t, FakeTensor):
                return t.fake_mode
    return FakeTensorMode(allow_non_fake_inputs=True)


def _run_fake(mode: FakeTensorMode, target, args, kwargs=None):
    def val(a):
        if isinstance(a, fx.Node):
            v = a.meta["val"]
            return v if isinstance(v, FakeTensor) or not isinstance(v, torch.Tensor) else mode.from_tensor(v)
        if isinstance(a, (list, tuple)):
            return type(a)(val(x) for x in a)
        return a

    with mode:
        return target(*val(args), **(val(kwargs or {})))


def _call(graph: fx.Graph, mode, target, args, meta: dict, kwargs=None) -> fx.Node:
    node = graph.call_function(target, args, kwargs)
    node.meta.update(meta)
    node.meta["val"] = _run_fake(mode, target, args, kwargs)
    return node


def _merged_meta(rw: Rewrite) -> dict:
    base = rw.members[0].coll.meta
    meta = {k: base[k] for k in ("stack_trace", "nn_module_stack", "source_fn_stack", "seq_nr") if k in base}
    meta["custom"] = dict(base.get("custom") or {})
    set_fsdp_meta(meta, UNSHARD if rw.kind == "all_gather" else REDUCE_SCATTER, rw.groups)
    return meta


def apply_rewrite(graph: fx.Graph, rw: Rewrite, mode) -> fx.Node:
    meta = _merged_meta(rw)
    w, total = rw.world_size, sum(m.n for m in rw.members)
    with graph.inserting_before(rw.anchor):
        pieces = []
        for m in rw.members:
            if m.view_input:
                pieces.append(_call(graph, mode, aten.view.default, (m.pieces[0], [w, -1]), meta))
            else:
                pieces.extend(m.pieces)
        if rw.kind == "all_gather":
            flat = _call(graph, mode, aten.cat.default, (pieces,), meta)
            coll = _call(graph, mode, _c10d.all_gather_into_tensor.default, (flat, w, rw.group_name), meta)
        else:
            packed = _call(graph, mode, aten.cat.default, (pieces, 1), meta)
            flat = _call(graph, mode, aten.view.default, (packed, [-1]), meta)
            coll = _call(graph, mode, _c10d.reduce_scatter_tensor.default, (flat, rw.reduce_op, w, rw.group_name), meta)
    for n in rw.hoist:  # all-gather only: in program order, each right before the new copy-in
        flat.prepend(n)
    with graph.inserting_before(rw.wait_anchor):
        wait = _call(graph, mode, _c10d.wait_tensor.default, (coll,), meta)
        outs, off = [], 0
        if rw.kind == "all_gather":
            per_rank = _call(graph, mode, aten.view.default, (wait, [w, total]), meta)
            for m in rw.members:
                outs.append(_call(graph, mode, aten.slice.Tensor, (per_rank, 1, off, off + m.n), meta))
                off += m.n
        else:
            for m in rw.members:
                outs.append(_call(graph, mode, aten.slice.Tensor, (wait, 0, off, off + m.n), meta))
                off += m.n
    last = outs[-1]
    for n in rw.sink:
        last.append(n)
        last = n
    changed = []
    for m, out in zip(rw.members, outs):
        for u in list(m.wait.users):
            if rw.kind == "all_gather" and _is_view_to(u, m.wait, 2):
                changed.extend(u.users)
                u.replace_all_uses_with(out)
                graph.erase_node(u)
        if m.wait.users:
            if rw.kind == "all_gather":  # a 1-D use of the member's gathered buffer: give it one
                with graph.inserting_after(out):
                    contig = _call(graph, mode, aten.clone.default, (out,), meta, {"memory_format": torch.contiguous_format})
                with graph.inserting_after(contig):
                    out = _call(graph, mode, aten.view.default, (contig, [-1]), meta)
            changed.extend(m.wait.users)
            m.wait.replace_all_uses_with(out)
        graph.erase_node(m.wait)
        graph.erase_node(m.coll)
        for a in m.absorbed:  # cat before view: absorbed is in use order (view first)
            if not a.users:
                graph.erase_node(a)
    _repair_users(graph, changed, mode)
    return coll


_VIEW_TARGETS = (aten.view.default, aten._unsafe_view.default)


def _repair_users(graph: fx.Graph, start: list[fx.Node], mode) -> None:
    """Re-run fake propagation below replaced values; a view that no longer applies gets a clone in front.

    The members' copy-outs were traced on a contiguous ``[W, n]`` buffer; they now read a column slice
    of the bucket, whose strides differ. Propagation stops where the metadata comes out unchanged.
    """
    queue, queued = list(start), set(start)
    while queue:
        node = queue.pop(0)
        if node.op != "call_function" or "val" not in node.meta:
            continue
        try:
            new = _run_fake(mode, node.target, node.args, node.kwargs)
        except (RuntimeError, ValueError):  # "view size is not compatible with input tensor's size and stride"
            if node.target not in _VIEW_TARGETS:
                raise
            src = node.args[0]
            with graph.inserting_before(node):
                contig = graph.call_function(aten.clone.default, (src,), {"memory_format": torch.contiguous_format})
            contig.meta.update({k: v for k, v in node.meta.items() if k != "val"})
            contig.meta["val"] = _run_fake(mode, aten.clone.default, (src,), {"memory_format": torch.contiguous_format})
            node.replace_input_with(src, contig)
            new = _run_fake(mode, node.target, node.args, node.kwargs)
        # A view of a replaced value now aliases the bucket's storage: take the new metadata. Anything
        # else (clone, compute) allocates its own, so unchanged metadata ends the propagation.
        inputs = {_program._key(t) for a in node.all_input_nodes for t in P.val_tensors(a.meta.get("val"))}
        aliases = any(_program._key(t) in inputs for t in P.val_tensors(new))
        if not aliases and _same_layout(node.meta["val"], new):
            continue
        node.meta["val"] = new
        for u in node.users:
            if u not in queued:
                queued.add(u)
                queue.append(u)


def _same_layout(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype and a.storage_offset() == b.storage_offset()
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_layout(x, y) for x, y in zip(a, b))
    return type(a) is type(b)


def check_adjacent(graph: fx.Graph, bucket: list[fx.Node], pos) -> None:
    kind = P.collective_kind(bucket[0])
    if kind not in KINDS or any(P.collective_kind(n) != kind for n in bucket):
        raise ValueError(f"a bucket holds all-gathers or reduce-scatters of one kind, got {[(n.name, P.collective_kind(n)) for n in bucket]}")
    members = set(bucket)
    between = [
        n.name
        for n in graph.nodes
        if pos[bucket[0]] < pos[n] < pos[bucket[-1]] and n not in members and P.collective_kind(n) == kind
    ]
    if between:
        raise ValueError(
            f"{[n.name for n in bucket]} are not adjacent: {between} run between them; merging them would "
            "reorder collectives"
        )


# --- the rewrite, estimator form: the same effect on the lowered program, for planning -------------


class Estimator:
    """Evaluates bucket candidates on the lowered program (``_program``) instead of the FX graph.

    ``transform`` must have the effect ``apply_rewrite`` has on the graph; a test checks that the
    estimate of every planned bucket equals ``simulate`` / ``peak_memory`` of the rewritten graph."""

    def __init__(self, graph: fx.Graph, cm: CostModel):
        self.graph, self.cm = graph, cm
        self.keys, _ = _program.storage_keys(graph)
        self.base = _program.lower(graph, cm)
        self.pos = {n: i for i, n in enumerate(graph.nodes)}

    def evaluate(self, ops: list[_program.Op]) -> tuple[float, int]:
        step, _, _ = _program.run(ops, self.cm.profile.op_overhead)
        return step, max(_program.timeline(ops), default=0)

    def transform(self, ops: list[_program.Op], rw: Rewrite, tag: str) -> list[_program.Op]:
        """``ops`` with ``rw`` applied: the same effect ``_apply`` has on the graph, on the op list."""
        cm = self.cm
        by_name = {op.name: op for op in ops}
        remove = {m.coll.name for m in rw.members} | {m.wait.name for m in rw.members}
        remove |= {a.name for m in rw.members for a in m.absorbed}
        moved = {n.name for n in rw.hoist} | {n.name for n in rw.sink}
        k_in, k_out = ("bucket_in", tag), ("bucket_out", tag)
        rename = {}
        for m in rw.members:
            for k in self.keys[m.coll]:
                rename[k] = k_out
        w, total = rw.world_size, sum(m.n for m in rw.members)
        itemsize = rw.members[0].coll.args[0].meta["val"].dtype.itemsize
        piece_keys, piece_bytes = [], 0
        for m in rw.members:
            for p in m.pieces:
                piece_keys.extend(self.keys[p])
                piece_bytes += P.node_bytes(p)
        if rw.kind == "all_gather":
            in_bytes, out_bytes = total * itemsize, total * w * itemsize
        else:
            in_bytes, out_bytes = total * w * itemsize, total * itemsize
        cat_cost = (piece_bytes + in_bytes) / cm.profile.mem_bw + cm.profile.op_overhead
        coll_name = f"bucket_{tag}"
        info = _program.CollInfo(rw.kind, rw.group_name, rw.groups, out_bytes if rw.kind == "all_gather" else in_bytes, w, f"wait_{tag}")

        def view(name, uses):  # views cost only their dispatch (``view_overhead``) and allocate nothing
            return _program.Op(name, "compute", cm.profile.view_overhead, [], uses)

        piece_views = [view(f"piece_{tag}_{i}", self.keys[m.pieces[0]]) for i, m in enumerate(rw.members) if m.view_input]
        new_coll = [
            *[by_name[n.name] for n in rw.hoist],
            *piece_views,
            _program.Op(f"cat_{tag}", "compute", cat_cost, [(k_in, in_bytes)], [*piece_keys, k_in]),
            *([view(f"flat_{tag}", [k_in])] if rw.kind == "reduce_scatter" else []),
            _program.Op(
                coll_name, "collective", cm.collective_time(rw.kind, info.bytes, w), [(k_out, out_bytes)], [k_in, k_out],
                pg=rw.group_name, info=info,
            ),
        ]
        new_wait = [
            _program.Op(f"wait_{tag}", "wait", 0.0, [], [k_out, k_in], coll=coll_name),
            *([view(f"per_rank_{tag}", [k_out])] if rw.kind == "all_gather" else []),
            *[view(f"slice_{tag}_{i}", [k_out]) for i in range(len(rw.members))],
            *[by_name[n.name] for n in rw.sink],
        ]
        if rw.kind == "all_gather":  # each member's [W, n] view of its buffer becomes a slice of the bucket
            remove |= {u.name for m in rw.members for u in m.wait.users if _is_view_to(u, m.wait, 2)}
        out = []
        for op in ops:
            if op.name == rw.anchor.name:
                out.extend(new_coll)
            if op.name == rw.wait_anchor.name:
                out.extend(new_wait)
            if op.name in remove or op.name in moved:
                continue
            out.append(op)
        for i, op in enumerate(out):
            if any(k in rename for k in op.uses):
                out[i] = dataclasses.replace(op, uses=[rename.get(k, k) for k in op.uses])
        return out
