"""``Report``: what ``fsdp_compile.explain`` found in the captured graphs."""

from __future__ import annotations

import dataclasses
import json

import torch

_c10d = torch.ops._c10d_functional
_ALL_GATHER = {_c10d.all_gather_into_tensor.default, _c10d.all_gather_into_tensor_out.default}
_REDUCE_SCATTER = {_c10d.reduce_scatter_tensor.default}
_ALL_REDUCE = {_c10d.all_reduce.default}


@dataclasses.dataclass
class Bucket:
    """One all-gather (and, for trainable groups, its reduce-scatter): members and unsharded bytes."""

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
    buckets: list[Bucket]
    backend: str
    # Filled by the cost model and simulator (the passes issue); None until they run.
    est_step_ms: float | None = None
    est_exposed_comm_ms: float | None = None
    est_peak_bytes: int | None = None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    def to_markdown(self) -> str:
        est = lambda v, unit="": "n/a (cost model not run)" if v is None else f"{v:.3f}{unit}"  # noqa: E731
        lines = [
            "# fsdp_compile report",
            "",
            f"- backend: `{self.backend}`",
            f"- Dynamo graphs: {self.dynamo_graphs}, graph breaks: {self.graph_breaks}, recompiles: {self.recompiles}",
            f"- collectives per step: {self.all_gathers} all-gathers ({self.forward['all_gathers']} forward, "
            f"{self.backward['all_gathers']} backward), {self.reduce_scatters} reduce-scatters, "
            f"{self.all_reduces} all-reduces",
            f"- predicted step: {est(self.est_step_ms, ' ms')}, exposed communication: "
            f"{est(self.est_exposed_comm_ms, ' ms')}, peak memory: "
            f"{'n/a' if self.est_peak_bytes is None else f'{self.est_peak_bytes / 2**20:.1f} MiB'}",
            "",
            "| bucket | FSDP modules | parameters | unsharded MiB |",
            "|---|---|---|---|",
        ]
        for i, b in enumerate(self.buckets):
            groups = ", ".join(g or "<root>" for g in b.groups)
            lines.append(f"| {i} | {groups} | {len(b.params)} | {b.bytes / 2**20:.3f} |")
        return "\n".join(lines) + "\n"

    def save_timeline(self, path: str) -> None:
        raise NotImplementedError(
            "save_timeline needs the schedule simulator (fsdp_compile.passes.simulate), which has not landed yet"
        )


def count_collectives(graphs) -> dict[str, int]:
    counts = {"all_gathers": 0, "reduce_scatters": 0, "all_reduces": 0}
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.target in _ALL_GATHER:
                counts["all_gathers"] += 1
            elif node.target in _REDUCE_SCATTER:
                counts["reduce_scatters"] += 1
            elif node.target in _ALL_REDUCE:
                counts["all_reduces"] += 1
    return counts
