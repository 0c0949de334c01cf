"""The fsdp-compile command line, run as users run it: in a subprocess, on the fake process group."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

CLI = [sys.executable, "-m", "fsdp_compile.debug.cli"]


def run(args, tmp_path, env_extra=None, timeout=300):
    env = {**os.environ, **(env_extra or {})}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    """One dump of the tiny model at world size 8, under TORCH_TRACE."""
    tmp = tmp_path_factory.mktemp("cli")
    out, trace = tmp / "dump", tmp / "trace"
    proc = run(["dump", "--model", "tiny", "--world-size", "8", "--hardware", "h100-nvlink", "--out", str(out)], tmp,
               {"TORCH_TRACE": str(trace)})
    assert proc.returncode == 0, proc.stderr
    return out, trace, proc


@pytest.mark.slow
def test_dump_writes_every_stage(dump):
    out, _, proc = dump
    names = sorted(os.listdir(out))
    stages = {"0_dynamo0.txt", "1_forward0_0_captured.txt", "1_forward0_1_reordered.txt",
              "2_backward0_0_captured.txt", "2_backward0_1_reordered.txt"}
    assert stages <= set(names), names
    assert {"report.md", "report.json", "schedule.json", "timeline.png", "timeline.html"} <= set(names)
    assert "fsdp_compile report" in proc.stdout


def test_report_lists_every_collective(dump):
    out, _, _ = dump
    md = (out / "report.md").read_text()
    schedule = json.loads((out / "schedule.json").read_text())
    names = {"forward0": [], "backward0": []}
    for g in schedule["graphs"]:
        names[g["graph"]] = [c["name"] for c in g["collectives"]]
    # the final graphs hold exactly the collectives the schedule lists, and report.md has a row for each
    for graph, file in (("forward0", "1_forward0_1_reordered.txt"), ("backward0", "2_backward0_1_reordered.txt")):
        text = (out / file).read_text()
        in_graph = [line.split(":")[0][2:] for line in text.splitlines() if line.startswith("# ") and "_c10d_functional." in line and "wait_tensor" not in line]
        assert sorted(in_graph) == sorted(names[graph]) and in_graph, (graph, in_graph, names[graph])
        for name in in_graph:
            assert f"| {name} |" in md


def test_timeline_files(dump):
    out, _, _ = dump
    with open(out / "timeline.png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    img = matplotlib.image.imread(out / "timeline.png")
    assert img.shape[0] > 200 and img.shape[1] > 800
    html = (out / "timeline.html").read_text()
    assert "<svg" in html and "<script" not in html and "http://" not in html and "https://" not in html


def test_torch_trace_holds_our_artifacts(dump):
    _, trace, _ = dump
    logs = "".join(p.read_text() for p in trace.iterdir())
    for name in ("fsdp_compile_forward0_schedule", "fsdp_compile_backward0_schedule", "fsdp_compile_forward0_reordered_graph"):
        assert name in logs


@pytest.mark.slow  # out of the fast tier (its budget); the full suite runs it
def test_report_rerenders_a_dump(dump, tmp_path):
    out, _, _ = dump
    before = (out / "report.md").read_text()
    (out / "report.md").unlink()
    (out / "timeline.png").unlink()
    proc = run(["report", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (out / "report.md").read_text() == before and (out / "timeline.png").exists()


@pytest.mark.slow
def test_explain_json(tmp_path):
    proc = run(["explain", "--model", "tiny", "--world-size", "4", "--bucket", "fsdp_group", "--no-reorder", "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["all_gathers"], report["reduce_scatters"], report["graph_breaks"]) == (5, 3, 0)


USER_MODULE = textwrap.dedent('''
    import torch

    def unsharded():
        return torch.nn.Linear(4, 4), (torch.randn(2, 4),)

    def sharded():
        from torch.distributed.fsdp import fully_shard
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))
        fully_shard(m[0]); fully_shard(m)
        return m, (torch.randn(2, 4),)

    def raises():
        raise RuntimeError("boom: the user's builder failed")

    def wrong():
        return 3
''')


ERRORS = [
    (["explain", "--model", "no_such_module:build"], "cannot import 'no_such_module'"),
    (["explain", "--model", "usermodels:missing"], "has no function 'missing'"),
    (["explain", "--model", "usermodels:unsharded"], "no module sharded by fully_shard"),
    (["explain", "--model", "tiny", "--bucket", "sometimes"], "bucket must be one of"),
    (["dump", "--model", "tiny", "--out", "/proc/forbidden"], "is not writable"),
    (["report", "/nonexistent"], "is not a fsdp-compile dump"),
    (["explain", "--model", "usermodels:raises"], "raises() raised RuntimeError: boom: the user's builder failed"),
    (["explain", "--model", "usermodels:wrong"], "wrong() must return (model, args) or (model, args, kwargs)"),
    (["explain", "--model", "tiny", "--hardware", "tpu"], "hardware must be one of"),
    (["explain", "--model", "tiny", "ENV:FSDP_COMPILE_DUMP=usermodels.py/dump"], "$FSDP_COMPILE_DUMP='usermodels.py/dump' is not a directory"),
]

# Every case through the CLI's main() in one subprocess (one torch import, not ten): its exit code, its stderr,
# and any exception that escaped main() as a traceback (which the test then finds in stderr).
_DRIVER = textwrap.dedent('''
    import contextlib, io, json, os, sys, traceback
    from fsdp_compile.debug.cli import main
    results = []
    for args in json.loads(sys.argv[1]):
        env = dict(a[len("ENV:"):].split("=", 1) for a in args if a.startswith("ENV:"))
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                code = main([a for a in args if not a.startswith("ENV:")])
            except SystemExit as e:
                code = e.code
            except BaseException:
                traceback.print_exc()
                code = None
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
        results.append({"code": code, "stderr": err.getvalue()})
    print(json.dumps(results))
''')


@pytest.fixture(scope="module")
def errors(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli_errors")
    (tmp / "usermodels.py").write_text(USER_MODULE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", _DRIVER, json.dumps([a for a, _ in ERRORS])], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("case", range(len(ERRORS)), ids=[m[:40] for _, m in ERRORS])
def test_errors_are_one_line_exit_2(errors, case):
    result, message = errors[case], ERRORS[case][1]
    assert result["code"] == 2, result
    lines = [line for line in result["stderr"].splitlines() if line.startswith("fsdp-compile: error:")]
    assert len(lines) == 1 and message in lines[0], result["stderr"]
    assert "Traceback" not in result["stderr"]


def test_an_error_exits_2_from_the_command(tmp_path):
    """The same through the command users type: `python -m fsdp_compile.debug.cli` exits with main()'s 2."""
    proc = run(["report", "/nonexistent"], tmp_path, timeout=120)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stderr.startswith("fsdp-compile: error:") and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_user_model(tmp_path):
    (tmp_path / "usermodels.py").write_text(USER_MODULE)
    proc = run(["explain", "--model", "usermodels:sharded", "--world-size", "2", "--json"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["graph_breaks"] == 0
