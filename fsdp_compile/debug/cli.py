"""``fsdp-compile``: explain or dump a model's compiled FSDP step without real ranks.

    fsdp-compile explain --model tiny --world-size 8
    fsdp-compile dump --model llama3-8b --world-size 64 --hardware h100-ib --out dump/
    fsdp-compile dump --model mypkg.models:build --world-size 8 --out dump/
    fsdp-compile report dump/

Models: a built-in name (``tiny`` and ``small`` with real CPU weights; ``llama3-8b`` and ``llama3-70b``
shapes on the meta device: no memory) or ``package.module:function`` returning ``(model, args)`` or
``(model, args, kwargs)`` with the model already sharded by ``fully_shard``. The process group is the
fake one at ``--world-size``: collectives are recorded, not run.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback

BUILTIN = ("tiny", "small", "llama3-8b", "llama3-70b")


class UserError(Exception):
    """A mistake in the command line or the user's model: one line, exit code 2."""


def _progress(msg: str) -> None:
    sys.stderr.write(f"[fsdp-compile {time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def build_builtin(name: str):
    import torch
    from torch.distributed.fsdp import fully_shard

    from fsdp_compile.models import SIZES, Llama, llama_blocks

    args = SIZES[name]
    meta = name.startswith("llama3")
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = Llama(args)
    for block in llama_blocks(model):
        fully_shard(block)
    fully_shard(model)
    seq = min(args.max_seq, 2048)
    tokens = torch.randint(0, args.vocab, (1, seq), device="meta" if meta else "cpu")
    return model, (tokens,), {}


def load_user(spec: str):
    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise UserError(f"--model {spec!r}: expected one of {', '.join(BUILTIN)} or package.module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UserError(f"--model {spec!r}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UserError(f"--model {spec!r}: {module_name!r} has no function {fn_name!r}")
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - the user's code: one line, what it raised
        raise UserError(f"--model {spec!r}: {fn_name}() raised {type(e).__name__}: {e}") from None
    if not isinstance(out, tuple) or len(out) not in (2, 3):
        raise UserError(f"--model {spec!r}: {fn_name}() must return (model, args) or (model, args, kwargs)")
    model, args, kwargs = (*out, {}) if len(out) == 2 else out
    return model, tuple(args) if isinstance(args, (list, tuple)) else (args,), dict(kwargs)


def load_model(spec: str):
    from fsdp_compile.plan import fsdp_states

    model, args, kwargs = build_builtin(spec) if spec in BUILTIN else load_user(spec)
    if not fsdp_states(model):
        raise UserError(
            f"--model {spec!r} returned a model with no module sharded by fully_shard: shard each block and "
            "then the root before returning it"
        )
    return model, args, kwargs


def _config(ns):
    from fsdp_compile.config import CompileConfig

    hardware = ns.hardware
    if hardware == "auto" and ns.model.startswith("llama3"):  # GPU-scale shapes on the meta device
        hardware = "h100-nvlink" if ns.world_size <= 8 else "h100-ib"
    return CompileConfig(backend="inductor", bucket=ns.bucket, reorder=ns.reorder, hardware=hardware)


def _explain(ns):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_compile.debug import explain_graphs

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ns.world_size)
    try:
        _progress(f"building {ns.model} on the fake process group (world size {ns.world_size})")
        model, args, kwargs = load_model(ns.model)
        _progress("capturing forward and backward (no code generation)")
        t0 = time.monotonic()
        report, captured = explain_graphs(model, *args, config=_config(ns), **kwargs)
        _progress(f"captured in {time.monotonic() - t0:.1f} s")
        return report, captured
    finally:
        dist.destroy_process_group()


def cmd_explain(ns) -> None:
    report, _ = _explain(ns)
    print(report.to_json() if ns.json else report.to_markdown())


def cmd_dump(ns) -> None:
    from fsdp_compile.debug.dump import write_dump

    _check_writable(ns.out)
    report, captured = _explain(ns)
    paths = write_dump(ns.out, report, captured)
    _progress(f"wrote {len(paths)} files to {ns.out}")
    print(report.to_markdown())


def cmd_report(ns) -> None:
    from fsdp_compile.debug.dump import rerender

    if not os.path.isfile(os.path.join(ns.dir, "report.json")):
        raise UserError(f"{ns.dir!r} is not a fsdp-compile dump (no report.json); make one with 'fsdp-compile dump'")
    _check_writable(ns.dir)
    paths = rerender(ns.dir)
    _progress(f"re-rendered {len(paths)} files in {ns.dir}")


def _check_writable(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, ".fsdp-compile-write-test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise UserError(f"--out {path!r} is not writable: {e.strerror}") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fsdp-compile", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verbose", action="store_true", help="show tracebacks")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--model", required=True, help=f"{' | '.join(BUILTIN)} | package.module:function")
        sp.add_argument("--world-size", type=int, default=8, help="ranks on the fake process group (default 8)")
        sp.add_argument(
            "--hardware", default="auto",
            help="cost-model profile: h100-nvlink, h100-ib, cpu-gloo, or auto (the llama3 models: h100-nvlink up to "
            "8 ranks, h100-ib beyond; otherwise the device the model is on)",
        )
        sp.add_argument("--bucket", default="auto", help="none | fsdp_group | auto (bucketing policy, default auto)")
        sp.add_argument("--reorder", action=argparse.BooleanOptionalAction, default=True, help="prefetch all-gathers and sink waits (default on)")

    e = sub.add_parser("explain", help="print the report: graph breaks, collectives, buckets, predicted cost")
    common(e)
    e.add_argument("--json", action="store_true", help="JSON instead of markdown")
    e.set_defaults(fn=cmd_explain)
    d = sub.add_parser("dump", help="write graphs per stage, schedule.json, report.md and the timeline to --out")
    common(d)
    d.add_argument("--out", required=True, help="output directory")
    d.set_defaults(fn=cmd_dump)
    r = sub.add_parser("report", help="re-render report.md and the timeline of a dump directory")
    r.add_argument("dir")
    r.set_defaults(fn=cmd_report)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = parser().parse_args(argv)
    if getattr(ns, "world_size", 1) < 1:
        print("fsdp-compile: error: --world-size must be >= 1", file=sys.stderr)
        return 2
    try:
        ns.fn(ns)
    except (UserError, ValueError, TypeError, NotImplementedError) as e:
        if ns.verbose:
            traceback.print_exc()
        print(f"fsdp-compile: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
