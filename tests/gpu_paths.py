"""The CUDA branches of fsdp_compile's choices, on a machine without a GPU: every module imported, then,
under ``pretend_cuda()`` (torch.cuda answering as an H100), the choices a GPU user's first compiled step
makes: kernels="auto" -> Triton, the impl per dtype, the GPU block size, the hardware profile by world size.

Run in an environment holding only the package's declared dependencies (CI runs it in the quickstart
venv), and with ``--block-numpy`` anywhere: numpy then fails to import, as on a GPU box without it, so an
undeclared numpy import on these paths fails here. Exit status 0 when every check passes.

    python tests/gpu_paths.py [--block-numpy]
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
import types


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block-numpy", action="store_true")
    args = ap.parse_args(argv)
    if args.block_numpy:  # ``import numpy`` raises ModuleNotFoundError; importlib.util.find_spec says None
        sys.modules["numpy"] = None
    os.environ.pop("TRITON_INTERPRET", None)  # a GPU user's kernels are compiled, not interpreted
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

    import torch

    import fsdp_compile
    from pretend_cuda import CHECKED_ON, pretend_cuda

    if torch.__version__.split("+")[0] not in CHECKED_ON:
        print(f"skipped: tests/pretend_cuda.py was checked on torch {CHECKED_ON}, this is {torch.__version__}")
        return 0
    failures = []

    def check(what, got, expected):
        ok = got == expected
        print(f"{'ok  ' if ok else 'FAIL'} {what}: {got!r}" + ("" if ok else f", expected {expected!r}"))
        if not ok:
            failures.append(what)

    modules = [m.name for m in pkgutil.walk_packages(fsdp_compile.__path__, "fsdp_compile.")]
    for name in modules:
        importlib.import_module(name)
    check("modules imported", len(modules) > 20, True)
    cuda = torch.device("cuda", 0)
    with pretend_cuda(90):
        from fsdp_compile import _api
        from fsdp_compile.kernels import _common as C
        from fsdp_compile.passes.cost_model import resolve_hardware

        check("kernels='auto' on a cuda plan", _api._resolve_kernels("auto", types.SimpleNamespace(device=cuda)), "triton")
        check("Triton kernels compiled, not interpreted", C.interpreting(), False)
        for dtype in C.TRITON_DTYPES:
            check(f"impl 'auto' for {dtype} on cuda", C.resolve_impl("auto", cuda, (dtype, torch.float32)), "triton")
        check("impl 'auto' for float64 on cuda", C.resolve_impl("auto", cuda, (torch.float64,)), "torch")
        check("impl 'auto' for float8 payloads on cuda", C.resolve_impl("auto", cuda, (torch.uint8,)), "torch")
        check("block size on cuda", C.block_size([10**6, 7], cuda), C._GPU_BLOCK)
        check("hardware 'auto', cuda, 8 ranks", resolve_hardware("auto", device_type="cuda", world_size=8), "h100-nvlink")
        check("hardware 'auto', cuda, 64 ranks", resolve_hardware("auto", device_type="cuda", world_size=64), "h100-ib")
    print(f"{len(failures)} failed" if failures else "all passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
