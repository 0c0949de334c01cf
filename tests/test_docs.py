"""The documentation cannot drift from the code: the README's example runs, its CompileConfig table lists
every field with its default, its commands are the ones CI runs, every relative link resolves, and
docs/results.md is what ``bench/results_page.py`` writes from ``bench/results/*.json``.

One process; the README's example runs on the fake process group (world size 2, rank 0) with
``backend="aot_eager"``, so collectives are recorded, not run, and nothing is code-generated.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import re

import pytest
import torch.distributed as dist

import fsdp_compile as fc
from dist_helpers import fake_process_group

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOCS = os.path.join(ROOT, "docs")
EXAMPLE_MARK = "<!-- tests/test_docs.py runs this block"
TABLE_MARK = "<!-- CompileConfig table:"


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _block_after(text: str, mark: str, lang: str) -> str:
    """The first fenced block of ``lang`` after ``mark`` (or, without the mark, the first such block)."""
    start = text.find(mark)
    m = re.compile(rf"^```{lang}\n(.*?)^```", re.S | re.M).search(text, max(start, 0))
    assert m, f"README.md has no ```{lang} block" + (f" after {mark!r}" if start >= 0 else "")
    return m.group(1)


def _results_page():
    spec = importlib.util.spec_from_file_location("results_page", os.path.join(ROOT, "bench", "results_page.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_page_is_current(tmp_path):
    out = tmp_path / "results.md"
    assert _results_page().main(["--out", str(out)]) == 0
    assert out.read_text() == _read(os.path.join(DOCS, "results.md")), (
        "docs/results.md is not what bench/results_page.py writes from bench/results/*.json: run "
        "python3 bench/results_page.py and commit docs/results.md"
    )


def test_results_page_check_fails_on_a_stale_page(tmp_path, capsys):
    stale = tmp_path / "results.md"
    stale.write_text("# Results\n")
    assert _results_page().main(["--check", "--out", str(stale)]) == 1
    assert "is not current" in capsys.readouterr().err


def test_readme_example_runs():
    """The README's example, as a user pastes it, on the fake process group. Only the process group (fake, not
    gloo), ``single_thread_gloo`` (no global patch of torch in this process) and the backend (``aot_eager``)
    are swapped; a renamed or changed API fails here."""
    code = _block_after(_read(README), EXAMPLE_MARK, "python")
    calls, compiled = [], []
    real_compile = fc.compile

    def compile_aot_eager(model, config=None, **overrides):
        compiled.append(real_compile(model, config, **{**overrides, "backend": "aot_eager"}))
        return compiled[-1]

    with fake_process_group(2), pytest.MonkeyPatch.context() as mp:
        mp.setattr(dist, "init_process_group", lambda backend=None, *a, **k: calls.append(("init", backend)))
        mp.setattr(dist, "destroy_process_group", lambda *a, **k: calls.append(("destroy", None)))
        mp.setattr(fc, "single_thread_gloo", lambda: calls.append(("single_thread_gloo", None)))
        mp.setattr(fc, "compile", compile_aot_eager)
        exec(compile(code, "README.md (the example)", "exec"), {"__name__": "__main__"})
    assert [c for c, _ in calls] == ["single_thread_gloo", "init", "destroy"], calls
    assert len(compiled) == 1, "the README's example should compile its model once"
    captured = compiled[0].captured
    assert len(captured.dynamo) == 1, "the example's step should be one Dynamo graph"
    fw, bw = captured.collectives("forward"), captured.collectives("backward")
    assert fw["all_gathers"] > 0 and bw["reduce_scatters"] > 0, (fw, bw)


def test_readme_compile_config_table_lists_every_field():
    text = _read(README)
    start = text.find(TABLE_MARK)
    assert start >= 0, f"README.md lost the marker {TABLE_MARK!r} above the CompileConfig table"
    rows = {}
    for line in text[start:].splitlines()[1:]:
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("field", "---") or set(cells[0]) <= {"-"}:
            continue
        rows[cells[0].strip("`")] = cells[1].strip("`")
    fields = {f.name: f.default for f in dataclasses.fields(fc.CompileConfig)}
    assert list(rows) == list(fields), f"README's CompileConfig table has {list(rows)}, config.py {list(fields)}"
    for name, default in fields.items():
        assert ast.literal_eval(rows[name]) == default, f"README says {name} defaults to {rows[name]}, config.py {default!r}"


def test_readme_commands_are_the_ones_ci_runs():
    text, ci = _read(README), _read(os.path.join(ROOT, ".ci", "run"))
    commands = re.findall(r"^```bash\n(.*?)\n```", text, re.S | re.M)
    assert len(commands) >= 2, "README.md should show the demo and the test command"
    for command in commands[:2]:
        for part in command.split(" && "):
            assert part.strip() in ci, f"README's {part.strip()!r} is not what .ci/run runs"


def test_readme_is_short_and_undated():
    text = _read(README)
    assert len(text) <= 12_000, f"README.md has {len(text)} characters; the limit is 12,000 (move detail to docs/)"
    dated = [line for line in text.splitlines() if re.search(r"20\d\d-\d\d-\d\d", line)]
    assert not dated, f"README.md holds dated lines (test and CI timings belong in CI's log): {dated}"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but '-' and '_' dropped, spaces to hyphens."""
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", _prose(markdown), re.M):
        kept = "".join(c for c in heading.strip().lower() if c.isalnum() or c in " -_")
        out.add(kept.replace(" ", "-"))
    return out


def _prose(markdown: str) -> str:
    """Markdown without fenced code blocks and HTML comments (their brackets are not links)."""
    markdown = re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M)
    return re.sub(r"<!--.*?-->", "", markdown, flags=re.S)


def _doc_files() -> list[str]:
    return [README] + sorted(os.path.join(DOCS, f) for f in os.listdir(DOCS) if f.endswith(".md"))


@pytest.mark.parametrize("path", _doc_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(_read(path))):
        if re.match(r"[a-z]+:", target):  # http(s):, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        if not os.path.exists(resolved):
            broken.append(f"{target} (no {os.path.relpath(resolved, ROOT)})")
        elif anchor and resolved.endswith(".md") and anchor not in _anchors(_read(resolved)):
            broken.append(f"{target} (no heading #{anchor} in {os.path.relpath(resolved, ROOT)})")
    assert not broken, f"{os.path.relpath(path, ROOT)} links to what does not exist: {broken}"
