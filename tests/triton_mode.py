"""fsdp_compile's Triton kernels built for Triton's CPU interpreter only while a test asks for it.

Triton decides when ``@triton.jit`` runs whether a kernel is compiled for a GPU or interpreted, so
``triton_interpreter()`` sets ``TRITON_INTERPRET=1`` and rebuilds the kernel modules for the block, then
restores the variable and rebuilds them again. Nothing leaks into later tests of the same process: on a
GPU machine a ``cuda`` test after a kernel test still gets compiled kernels. (The ops' registrations in
``kernels._library`` reach the kernel modules by attribute at call time, so they follow the rebuild.)
"""

from __future__ import annotations

import contextlib
import importlib
import os

KERNEL_MODULES = (
    "fsdp_compile.kernels._common",
    "fsdp_compile.kernels._all_gather_copy_in",
    "fsdp_compile.kernels._all_gather_copy_out",
    "fsdp_compile.kernels._reduce_scatter_copy_in",
    "fsdp_compile.kernels._reduce_scatter_copy_out",
)


def _rebuild() -> None:
    for name in KERNEL_MODULES:
        importlib.reload(importlib.import_module(name))


@contextlib.contextmanager
def triton_interpreter():
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    _rebuild()
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
        _rebuild()
