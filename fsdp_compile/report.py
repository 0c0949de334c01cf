"""``Report``: what ``fsdp_compile.explain`` found in the captured graphs."""

from __future__ import annotations

import dataclasses
import json


@dataclasses.dataclass
class Bucket:
    """One unit of the schedule: one all-gather (and, for trainable groups, one reduce-scatter)."""

    groups: list[str]  # FSDP module FQNs ("" is the root)
    params: list[str]  # parameter FQNs
    bytes: int  # unsharded bytes gathered (padded, in the all-gather dtype)


@dataclasses.dataclass
class Report:
    graph_breaks: int
    recompiles: int
    dynamo_graphs: int
    all_gathers: int  # per step, forward + backward
    reduce_scatters: int
    all_reduces: int
    forward: dict[str, int]  # per-graph collective counts
    backward: dict[str, int]
    buckets: list[Bucket]  # the schedule's units, in forward order
    backend: str
    hardware: str | None = None  # the cost-model profile used for the estimates
    # Predicted by the cost model and simulator for forward + backward after our passes ...
    est_step_ms: float | None = None
    est_exposed_comm_ms: float | None = None
    est_peak_bytes: int | None = None
    # ... and for the same graphs as placed, before the schedule's moves (every collective where FSDP2's hooks
    # issue it, without its prefetch; with bucket="fsdp_group", eager FSDP2's collectives)
    eager_est_step_ms: float | None = None
    eager_est_exposed_comm_ms: float | None = None
    eager_est_peak_bytes: int | None = None
    graphs: list[dict] = dataclasses.field(default_factory=list)  # per graph: collectives, moves, simulations (PassRecord)
    schedule: dict | None = None  # passes.schedule.Schedule.to_dict(): units, prefetch, sinks, its own predictions
    planning_ms: float | None = None  # time spent planning the schedule (once per compiled model)
    # per kind of repeated block: {"blocks": [FSDP module FQNs], "region": bool, "why": None | why inline}
    regions: list[dict] = dataclasses.field(default_factory=list)
    # per mesh dim (FSDP's shard dim, HSDP's replicate dim, TP/EP dims), forward + backward: {kind: count}
    collectives_by_mesh_dim: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    mesh_dims: dict[str, str] = dataclasses.field(default_factory=dict)  # process group name -> its mesh dim (timeline lanes)
    # with cudagraphs=True, per compiled graph: {"kind", "index", "captured": bool, "reason": None | why not}
    cudagraphs: list[dict] = dataclasses.field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def to_markdown(self) -> str:
        est = lambda v, unit="": "n/a" if v is None else f"{v:.3f}{unit}"  # noqa: E731
        mib = lambda v: "n/a" if v is None else f"{v / 2**20:.1f} MiB"  # noqa: E731
        plan = self.schedule or {}
        lines = [
            "# fsdp_compile report",
            "",
            f"- backend: `{self.backend}`",
            f"- schedule: {len(self.buckets)} units (bucket policy `{plan.get('policy')}`), planned in "
            f"{est(self.planning_ms, ' ms')} for {plan.get('workload')} tokens per step on `{plan.get('hardware')}`",
            f"- Dynamo graphs: {self.dynamo_graphs}, graph breaks: {self.graph_breaks}, recompiles: {self.recompiles}",
            f"- collectives per step: {self.all_gathers} all-gathers ({self.forward['all_gathers']} forward, "
            f"{self.backward['all_gathers']} backward), {self.reduce_scatters} reduce-scatters, "
            f"{self.all_reduces} all-reduces",
            f"- predicted on `{self.hardware}` (forward + backward): step {est(self.est_step_ms, ' ms')}, exposed "
            f"communication {est(self.est_exposed_comm_ms, ' ms')}, peak {mib(self.est_peak_bytes)}",
            f"- the graphs as placed (every collective where FSDP2's hooks issue it, before the schedule's moves): "
            f"step {est(self.eager_est_step_ms, ' ms')}, "
            f"exposed communication {est(self.eager_est_exposed_comm_ms, ' ms')}, peak {mib(self.eager_est_peak_bytes)}",
            *_split_lines(plan),
            *(f"- on mesh dim `{dim}`: " + ", ".join(f"{n} {kind.replace('_', '-')}" for kind, n in counts.items() if n)
              for dim, counts in self.collectives_by_mesh_dim.items()),
            *(f"- repeated blocks {_blocks(r['blocks'])}: "
              + ("one compiled region" if r["region"] else f"compiled inline: {r['why']}")
              + (f"; inline in Dynamo graph {', '.join(map(str, r['inline_in_graphs']))} (a recompile that ran the "
                 "blocks inline, as blocks taking DTensors do under dynamic shapes)" if r.get("inline_in_graphs") else "")
              for r in self.regions),
            *(f"- CUDA graph, {d['kind']} graph {d['index']}: "
              + ("captured" if d["captured"] else f"runs uncaptured: {d['reason']}") for d in self.cudagraphs),
            "",
            "| unit | FSDP modules | parameters | unsharded MiB | issued at (forward) | issued at (backward) | RS waits after |",
            "|---|---|---|---|---|---|---|",
        ]
        units = plan.get("units") or [{}] * len(self.buckets)
        for i, (b, u) in enumerate(zip(self.buckets, units)):
            groups = ", ".join(g or "<root>" for g in b.groups)
            if u.get("params"):  # one parameter, or one part of a module (the root's embedding, its head)
                groups += f" ({', '.join(u['params'])})"
            fwd = "-" if u.get("issue_at", i) == i else f"unit {u['issue_at']}"
            bwd = "-" if not u.get("regathers") or u.get("backward_issue_at", i) == i else f"unit {u['backward_issue_at']}"
            sink = f"{u['sink']} later" if u.get("sink") else "-"
            lines.append(f"| {i} | {groups} | {len(b.params)} | {b.bytes / 2**20:.3f} | {fwd} | {bwd} | {sink} |")
        return "\n".join(lines) + "\n"

    def save_timeline(self, path: str) -> None:
        """The predicted schedule as a picture: ``.png`` (matplotlib) or a self-contained ``.html``."""
        from fsdp_compile.debug.timeline import save_timeline

        save_timeline(self, path)


def _split_lines(plan: dict) -> list[str]:
    """The modules ``bucket="auto"`` gathers in parts (the root: its embedding, its head), and the gain the
    planner predicted for it: its planned step against the best it planned with every module whole."""
    predicted = plan.get("predicted") or {}
    if "unsplit" not in predicted:  # only an auto plan that split something keeps it
        return []
    parts: dict[str, list[str]] = {}
    for i, u in enumerate(plan["units"]):
        if u.get("params"):
            parts.setdefault(u["members"][0], []).append(f"unit {i} ({', '.join(u['params'])})")
    step = lambda p: (p["forward"]["step_s"] + p["backward"]["step_s"]) * 1e3  # noqa: E731
    split, whole = step(predicted["planned"]), step(predicted["unsplit"])
    return [f"- split: `{fqn or '<root>'}` gathered and reduce-scattered in parts: " + ", ".join(p) for fqn, p in parts.items()] + [
        f"- the split's predicted gain: step {split:.3f} ms against {whole:.3f} ms planned with every FSDP module whole "
        f"({whole - split:.3f} ms, {(1 - split / whole) * 100:.1f}%)"]


def _blocks(fqns: list[str]) -> str:
    return f"`{fqns[0]}` .. `{fqns[-1]}` ({len(fqns)})" if len(fqns) > 2 else ", ".join(f"`{f}`" for f in fqns)


def region_summary(repeated: list[list[str]], decisions, enabled: bool, fixed: dict[int, str] | None = None,
                   graphs: int = 1) -> list[dict]:
    """``Report.regions``: kind ``i`` of ``repeated`` (``capture.install_regions``) runs as
    ``fsdp_compile_region_<i>``; ``decisions`` are ``passes.regions.admit_regions``' for every call of the
    step's ``graphs`` Dynamo graphs; ``fixed``: kinds compiled inline whatever the trace
    (``capture.inline_reason``), and why. A region that a later graph (a recompile) runs inline, where the
    block's call is not one a region can take (``capture.regions``: a DTensor layout of a symbolic shape under
    dynamic shapes), lists that graph in ``inline_in_graphs`` (absent where none does)."""
    out = []
    for i, blocks in enumerate(repeated):
        mine = [d for d in decisions if d.region == f"fsdp_compile_region_{i}"]
        whys = [d.why for d in mine]
        if not enabled:
            why = "CompileConfig(regions=False)"
        elif fixed and i in fixed:
            why = fixed[i]
        elif not whys:
            why = "not called as a region in the captured step"
        else:
            why = next((w for w in whys if w is not None), None)
        entry = {"blocks": list(blocks), "region": why is None, "why": why}
        inline = [k for k in range(graphs) if not any(d.graph == k for d in mine)] if why is None else []
        if inline:
            entry["inline_in_graphs"] = inline
        out.append(entry)
    return out


def count_collectives(graphs) -> dict[str, int]:
    """All-gathers, reduce-scatters and all-reduces in ``graphs``, a region's (a TP block's) once per call: the
    same counts with regions on and off."""
    from fsdp_compile.passes.predicates import collective_counts

    counts = {"all_gathers": 0, "reduce_scatters": 0, "all_reduces": 0}
    for gm in graphs:
        for kind, n in collective_counts(with_region_bodies(gm)).items():
            counts[kind] += n
    return counts


def collectives_by_mesh_dim(graphs, mesh_dims: dict[str, str]) -> dict[str, dict[str, int]]:
    """``count_collectives`` per mesh dim, and all-to-alls (expert parallelism's token dispatch) where there
    are any: ``mesh_dims`` names each process group (``ShardingPlan.mesh_dim_of_groups``); a group it does
    not name is counted under its c10d name. A region's collectives (a TP block's) count once per call."""
    from fsdp_compile.passes.predicates import collective_kind, counted_kind, process_group_name

    out: dict[str, dict[str, int]] = {}
    for gm in graphs:
        for node in with_region_bodies(gm):
            kind = counted_kind(node) or ("all_to_alls" if collective_kind(node) == "all_to_all" else None)
            if kind is not None:
                name = process_group_name(node)
                counts = out.setdefault(mesh_dims.get(name, name), {"all_gathers": 0, "reduce_scatters": 0, "all_reduces": 0})
                counts[kind] = counts.get(kind, 0) + 1
    return out


def with_region_bodies(gm):
    """``gm``'s nodes, each region call (``invoke_subgraph``) replaced by its body's nodes."""
    import torch

    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph:
            yield from with_region_bodies(getattr(gm, node.args[0].target))
        else:
            yield node


def collective_bytes(graphs) -> dict[str, int]:
    """Bytes per kind of collective in ``graphs``, each counted as its full buffer: an all-gather's output,
    a reduce-scatter's input, an all-reduce's tensor (the buffers eager FSDP2 hands to torch.distributed); a
    region's once per call."""
    from fsdp_compile.passes.predicates import counted_kind, node_bytes

    out = {"all_gathers": 0, "reduce_scatters": 0, "all_reduces": 0}
    for gm in graphs:
        for node in with_region_bodies(gm):
            kind = counted_kind(node)
            if kind is not None:
                out[kind] += node_bytes(node.args[0] if kind == "reduce_scatters" else node)
    return out
