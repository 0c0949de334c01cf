"""The predicted schedule as a picture: one panel per graph (forward, backward), one row for the compute
stream and one per process group; collectives labelled by their FSDP modules, exposed time in red.

``save_timeline(report, path)`` writes ``.png`` (matplotlib) or a self-contained ``.html`` (inline SVG,
no script, no network). Both read only ``Report.graphs`` (plain data), so a saved dump re-renders.
"""

from __future__ import annotations

import html

COLORS = {"all_gather": "#4C72B0", "reduce_scatter": "#DD8452", "all_reduce": "#55A868"}
EXPOSED = "#C44E52"
COMPUTE = "#8C8C8C"


def _label(groups: list[str]) -> str:
    names = [g or "root" for g in groups]
    if not names:  # not FSDP's: a collective of the model's own parallel plan (TP), on its own lane
        return ""
    return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]} ({len(names)})"


def _rows(graph: dict, mesh_dims: dict[str, str] | None = None) -> tuple[list[str], list[dict]]:
    sched = graph["after"]
    groups = sorted({c["process_group"] for c in sched["collectives"]})
    dims = mesh_dims or {}  # one lane per process group, named by its mesh dim where the report knows it (dp, tp, ...)
    rows = ["compute"] + [f"comm {dims[g]} (pg {g})" if g in dims else f"comm (pg {g})" for g in groups]
    bars = []
    stalls = []
    for c in sched["collectives"]:
        row = 1 + groups.index(c["process_group"])
        bars.append({"row": row, "start": c["start"], "end": c["end"], "color": COLORS.get(c["kind"], "#937860"),
                     "label": _label(c["fsdp_groups"]), "exposed": c["exposed"], "title":
                     f"{c['name']}: {c['kind']} of {c['bytes'] / 2**20:.2f} MiB for {', '.join(g or 'root' for g in c['fsdp_groups']) or 'the model'}; "
                     f"{c['duration'] * 1e3:.3f} ms, hidden {c['hidden'] * 1e3:.3f} ms, exposed {c['exposed'] * 1e3:.3f} ms"})
        if c["exposed"] > 0 and c["wait_at"] is not None:
            stalls.append((c["wait_at"], c["exposed"], c["name"]))
    return rows, bars + [{"row": 0, "start": s, "end": s + e, "color": EXPOSED, "label": "", "exposed": 0,
                           "title": f"compute waits {e * 1e3:.3f} ms for {n}"} for s, e, n in stalls]


def save_timeline(report, path: str) -> None:
    graphs = [g for g in report.graphs if g["after"]["collectives"] or g["after"]["step_time"] > 0]
    if not graphs:
        raise ValueError("the report has no predicted schedule (no graph with collectives was captured)")
    if path.endswith(".html"):
        _html(report, graphs, path)
    elif path.endswith(".png"):
        _png(report, graphs, path)
    else:
        raise ValueError(f"timeline path must end in .png or .html, got {path!r}")


def _title(report, graph) -> str:
    a, b = graph["after"], graph["before"]
    return (f"{graph['kind']} graph {graph['index']} on {graph['hardware']}: step {a['step_time'] * 1e3:.2f} ms "
            f"(exposed comm {a['exposed_comm_time'] * 1e3:.2f} ms); as captured {b['step_time'] * 1e3:.2f} ms "
            f"(exposed {b['exposed_comm_time'] * 1e3:.2f} ms)")


def _png(report, graphs, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    height = 0.8 + sum(1.0 + 0.45 * len(_rows(g, report.mesh_dims)[0]) for g in graphs)
    fig, axes = plt.subplots(len(graphs), 1, figsize=(13, height), squeeze=False)
    for ax, graph in zip(axes[:, 0], graphs):
        rows, bars = _rows(graph, report.mesh_dims)
        step_ms = graph["after"]["step_time"] * 1e3
        ax.barh(0, step_ms, left=0, height=0.5, color=COMPUTE, alpha=0.35)
        for bar in bars:
            start, width = bar["start"] * 1e3, (bar["end"] - bar["start"]) * 1e3
            ax.barh(bar["row"], width, left=start, height=0.5, color=bar["color"], edgecolor="white", linewidth=0.5)
            if bar["exposed"] > 0:  # the tail of the collective the compute stream waited for
                ax.barh(bar["row"], bar["exposed"] * 1e3, left=start + width - bar["exposed"] * 1e3, height=0.5,
                        color="none", edgecolor=EXPOSED, hatch="////", linewidth=0)
            if bar["label"] and width > step_ms * 0.04:
                ax.text(start + width / 2, bar["row"], bar["label"], ha="center", va="center", fontsize=7, color="white", clip_on=True)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels(rows)
        ax.invert_yaxis()
        ax.set_xlim(0, step_ms * 1.01)
        ax.set_xlabel("predicted time (ms)")
        ax.set_title(_title(report, graph), fontsize=9, loc="left")
    handles = [Patch(color=COMPUTE, alpha=0.35, label="compute stream busy"), Patch(color=EXPOSED, label="compute waits (exposed comm)")]
    kinds = {c["kind"] for g in graphs for c in g["after"]["collectives"]}
    handles += [Patch(color=c, label=k.replace("_", "-")) for k, c in COLORS.items() if k in kinds]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _html(report, graphs, path: str) -> None:
    width, row_h, left = 1100, 26, 120
    parts = ["<!DOCTYPE html><html><head><meta charset='utf-8'><title>fsdp_compile timeline</title>",
             "<style>body{font-family:sans-serif;font-size:13px}text{font-size:11px}</style></head><body>",
             f"<h2>fsdp_compile predicted schedule</h2><p>{html.escape(report.to_markdown().splitlines()[4][2:])}</p>",
             "<p>Rows: the compute stream (grey: busy; red: waiting on a collective) and one communication stream "
             "per process group (blue: all-gather, orange: reduce-scatter). Hover a bar for its figures.</p>"]
    for graph in graphs:
        rows, bars = _rows(graph, report.mesh_dims)
        step = graph["after"]["step_time"] or 1e-9
        scale = (width - left - 10) / step
        height = row_h * len(rows) + 30
        parts.append(f"<h3>{html.escape(_title(report, graph))}</h3><svg width='{width}' height='{height}'>")
        for i, name in enumerate(rows):
            parts.append(f"<text x='4' y='{i * row_h + 17}'>{html.escape(name)}</text>")
        parts.append(f"<rect x='{left}' y='4' width='{step * scale:.1f}' height='{row_h - 8}' fill='{COMPUTE}' opacity='0.35'/>")
        for bar in bars:
            x, w = left + bar["start"] * scale, max(1.0, (bar["end"] - bar["start"]) * scale)
            y = bar["row"] * row_h + 4
            parts.append(f"<g><title>{html.escape(bar['title'])}</title><rect x='{x:.1f}' y='{y}' width='{w:.1f}' height='{row_h - 8}' fill='{bar['color']}'/>")
            if bar["exposed"] > 0:
                ew = bar["exposed"] * scale
                parts.append(f"<rect x='{x + w - ew:.1f}' y='{y}' width='{ew:.1f}' height='{row_h - 8}' fill='none' stroke='{EXPOSED}' stroke-width='2'/>")
            if bar["label"] and w > 40:
                parts.append(f"<text x='{x + w / 2:.1f}' y='{y + 13}' text-anchor='middle' fill='white'>{html.escape(bar['label'])}</text>")
            parts.append("</g>")
        axis_y = row_h * len(rows) + 15
        for k in range(6):
            t = step * k / 5
            parts.append(f"<text x='{left + t * scale:.1f}' y='{axis_y}' text-anchor='middle'>{t * 1e3:.2f} ms</text>")
        parts.append("</svg>")
    parts.append("</body></html>")
    with open(path, "w") as f:
        f.write("\n".join(parts))
