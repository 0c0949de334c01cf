"""Everything written about a compile: readable graphs, stage dumps, TORCH_TRACE artifacts, dump directories.

Two producers share the file names, so both kinds of dump sort the same way, in pipeline order:
``0_dynamo0.txt``, ``1_forward0_0_captured.txt``, ``1_forward0_1_reordered.txt``,
``1_forward0_9_inductor_output_code.py``, ``2_backward0_...``, then the reports:

* ``CompileHook``, the backend's one hook, while a real compile runs (``CompileConfig.dump_dir`` or
  ``$FSDP_COMPILE_DUMP``; TORCH_TRACE artifacts for tlparse whenever tracing is on);
* ``write_dump`` after ``explain`` (the CLI's ``dump``): also ``schedule.json``, ``report.md``,
  ``report.json`` and the timeline. ``rerender(dir)`` rebuilds ``report.md`` and the timelines from
  ``report.json`` alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import torch.fx as fx

from fsdp_compile._annotations import fsdp_groups
from fsdp_compile.report import Bucket, Report

KIND_NO = {"dynamo": 0, "forward": 1, "backward": 2}


def readable(gm: fx.GraphModule) -> str:
    """The graph as Python, without strides and devices, and each collective with its FSDP modules.
    ``print_readable`` generates the code afresh from the graph, so no ``recompile`` (seconds on a 70B graph)."""
    text = gm.print_readable(print_output=False, include_stride=False, include_device=False)
    lines = ["", "# collectives (node -> FSDP groups)"]
    for node in gm.graph.nodes:
        if node.op == "call_function" and str(node.target).startswith("_c10d_functional."):
            lines.append(f"# {node.name}: {node.target} groups={list(fsdp_groups(node))!r}")
    return text + "\n".join(lines) + "\n"


def make_dump_dir(dump_dir: str) -> None:
    """Create ``dump_dir`` and write a probe file in it, or raise ``ValueError`` naming the path and the OS's
    reason. ``compile`` and ``explain`` call it, so a directory that cannot hold the dump fails there, not as
    ``BackendCompilerFailed`` at the first step. ``CompileConfig`` checks the common mistakes when it is made
    but creates nothing (a config is a value: made, replaced and compared without touching the disk), and only
    creating decides: root ignores permissions, a name can be too long, the disk can change after the config."""
    from fsdp_compile.config import DUMP_ENV

    where = f"${DUMP_ENV}={dump_dir!r}" if os.environ.get(DUMP_ENV) == dump_dir else f"dump_dir={dump_dir!r}"
    try:
        os.makedirs(dump_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=dump_dir, prefix=".fsdp_compile_probe"):
            pass
    except OSError as e:
        raise ValueError(
            f"{where} cannot hold the dump: {e.strerror or e} ({e.filename!r}); point it at a directory you can "
            "write, or unset it"
        ) from e


def _write(dump_dir: str, name: str, text: str) -> str:
    os.makedirs(dump_dir, exist_ok=True)
    path = os.path.join(dump_dir, name)
    with open(path, "w") as f:
        f.write(text)
    return path


def _record_payload(record) -> dict:
    return {k: v for k, v in dataclasses.asdict(record).items() if k != "stages"}


class CompileHook:
    """What the backend reports while it compiles: graphs to ``dump_dir`` (if set) and to TORCH_TRACE."""

    def __init__(self, dump_dir: str | None):
        self.dump_dir = dump_dir

    def dynamo(self, index: int, gm: fx.GraphModule) -> None:
        if self.dump_dir:
            _write(self.dump_dir, f"0_dynamo{index}.txt", readable(gm))

    def passes(self, record) -> None:
        """A forward/backward graph's stages (captured, reordered) and predicted schedule."""
        from torch._logging import trace_structured

        name = f"fsdp_compile_{record.kind}{record.index}"
        payload = _record_payload(record)
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": f"{name}_schedule", "encoding": "json"},
            payload_fn=lambda: json.dumps(payload),
        )
        for stage, text in record.stages:
            trace_structured(
                "artifact",
                metadata_fn=lambda stage=stage: {"name": f"{name}_{stage}_graph", "encoding": "string"},
                payload_fn=lambda text=text: text,
            )
        if self.dump_dir:
            prefix = f"{KIND_NO[record.kind]}_{record.kind}{record.index}"
            for i, (stage, text) in enumerate(record.stages):
                _write(self.dump_dir, f"{prefix}_{i}_{stage}.txt", text)
            _write(self.dump_dir, f"{prefix}_schedule.json", json.dumps(payload, indent=2))

    def output_code(self, kind: str, index: int, source: str) -> None:
        if self.dump_dir:
            _write(self.dump_dir, f"{KIND_NO[kind]}_{kind}{index}_9_inductor_output_code.py", source)


def write_dump(out: str, report: Report, captured=None) -> list[str]:
    """Write everything about one capture into ``out``; returns the paths written."""
    os.makedirs(out, exist_ok=True)
    paths = []

    def write(name: str, text: str) -> None:
        path = os.path.join(out, name)
        with open(path, "w") as f:
            f.write(text)
        paths.append(path)

    if captured is not None:
        for i, gm in enumerate(captured.dynamo):
            write(f"0_dynamo{i}.txt", readable(gm))
        for record in captured.records:
            for s, (stage, text) in enumerate(record.stages):
                write(f"{KIND_NO[record.kind]}_{record.kind}{record.index}_{s}_{stage}.txt", text)
        for i, (kind, source) in enumerate(captured.output_code):
            write(f"{KIND_NO[kind]}_{kind}{i}_9_inductor_output_code.py", source)
    write("report.json", report.to_json())
    write("schedule.json", json.dumps(schedule_rows(report), indent=2))
    paths += render(out, report)
    return paths


def schedule_rows(report: Report) -> dict:
    """One row per collective and per graph: what ``schedule.json`` holds."""
    graphs = []
    for g in report.graphs:
        a, b = g["after"], g["before"]
        graphs.append({
            "graph": f"{g['kind']}{g['index']}",
            "hardware": g["hardware"],
            "predicted_step_ms": a["step_time"] * 1e3,
            "predicted_exposed_comm_ms": a["exposed_comm_time"] * 1e3,
            "as_captured_step_ms": b["step_time"] * 1e3,
            "as_captured_exposed_comm_ms": b["exposed_comm_time"] * 1e3,
            "peak_bytes": g["peak_after"],
            "peak_at": g["peak_node"],
            "comm_budget_bytes": g["comm_budget"],
            "buckets": g["buckets"],
            "moves": g["moves"],
            "collectives": [
                {
                    "name": c["name"], "wait": c["wait"], "kind": c["kind"], "process_group": c["process_group"],
                    "bytes": c["bytes"], "fsdp_groups": c["fsdp_groups"],
                    "issue_ms": c["issue"] * 1e3, "start_ms": c["start"] * 1e3, "end_ms": c["end"] * 1e3,
                    "wait_ms": None if c["wait_at"] is None else c["wait_at"] * 1e3,
                    "predicted_ms": c["duration"] * 1e3, "hidden_ms": c["hidden"] * 1e3, "exposed_ms": c["exposed"] * 1e3,
                }
                for c in a["collectives"]
            ],
        })
    return {"graphs": graphs}


def detailed_markdown(report: Report) -> str:
    lines = [report.to_markdown()]
    for g in schedule_rows(report)["graphs"]:
        lines += [
            f"## {g['graph']} ({g['hardware']})",
            "",
            f"Predicted step {g['predicted_step_ms']:.3f} ms, exposed communication {g['predicted_exposed_comm_ms']:.3f} ms "
            f"(as captured: {g['as_captured_step_ms']:.3f} ms, exposed {g['as_captured_exposed_comm_ms']:.3f} ms). "
            f"Peak {g['peak_bytes'] / 2**20:.1f} MiB at `{g['peak_at']}` (the schedule's budget for gathered parameters "
            f"and reduce-scatter buffers: {g['comm_budget_bytes'] / 2**20:.1f} MiB).",
            "",
            "| collective | kind | pg | MiB | FSDP modules | issued ms | wait node | waited ms | predicted ms | hidden ms | exposed ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for c in g["collectives"]:
            waited = "-" if c["wait_ms"] is None else f"{c['wait_ms']:.3f}"
            lines.append(
                f"| {c['name']} | {c['kind']} | {c['process_group']} | {c['bytes'] / 2**20:.2f} | "
                f"{', '.join(x or '<root>' for x in c['fsdp_groups'])} | {c['issue_ms']:.3f} | {c['wait']} | {waited} | "
                f"{c['predicted_ms']:.3f} | {c['hidden_ms']:.3f} | {c['exposed_ms']:.3f} |"
            )
        merged = [b for b in g["buckets"] if len(b["groups"]) > 1]
        lines += ["", f"{len(g['buckets'])} FSDP collectives, {len(merged)} of them for several FSDP modules (buckets)."]
        for b in merged:
            lines.append(f"- {b['kind']} of {', '.join(x or '<root>' for x in b['groups'])} ({b['bytes'] / 2**20:.2f} MiB)")
        if g["moves"]:
            lines += ["", "Moves made to follow the schedule (planned once, the same on every rank):"]
            lines += [f"- {render_move(m)}" for m in g["moves"]]
        lines.append("")
    return "\n".join(lines) + "\n"


def render_move(m: dict) -> str:
    """One ``reordering.Move`` (as a dict) as a sentence."""
    what = "all-gather issued" if m["kind"] == "prefetch" else "reduce-scatter waited"
    return f"unit {m['unit']}: {what} before {m['anchor']} ({m['node']}; was followed by {m['was']})"


def render(out: str, report: Report) -> list[str]:
    paths = []
    path = os.path.join(out, "report.md")
    with open(path, "w") as f:
        f.write(detailed_markdown(report))
    paths.append(path)
    if report.graphs:
        for name in ("timeline.png", "timeline.html"):
            report.save_timeline(os.path.join(out, name))
            paths.append(os.path.join(out, name))
    return paths


def load_report(path: str) -> Report:
    with open(path) as f:
        data = json.load(f)
    data["buckets"] = [Bucket(**b) for b in data["buckets"]]
    return Report(**data)


def rerender(out: str) -> list[str]:
    return render(out, load_report(os.path.join(out, "report.json")))
