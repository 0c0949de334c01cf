"""``pretend_cuda(arch)``: a CPU-only torch build answers CUDA device queries as one NVIDIA GPU of compute
capability ``arch`` (90: an H100), and Triton's driver is a stub reporting that target, so Inductor
generates CUDA code and Triton compiles it (PTX + cubin with the ptxas in the triton wheel) without a GPU.
Nothing can run: there is no device. Test-only: it patches torch internals, so it is pinned to the torch
versions it was checked on (``CHECKED_ON``) and ``require_checked_torch()`` skips elsewhere.

What is patched, and why (each measured on torch 2.13.0+cpu, ../shared/gpu_probe/README.md):
- ``torch.cuda`` queries and Dynamo's ``CudaInterface`` (which bound them at import): availability,
  capability, properties, RNG state (Dynamo saves it), device switches (``torch.cuda.device`` in compile_fx);
- Inductor's pattern-matcher init traces its patterns with real-device constructors: traced on CPU instead
  (the patterns are device-agnostic);
- Tensor methods whose Python bindings take a CUDA device guard first (``__getitem__``, ``__setitem__``,
  ``copy_``, ``__invert__``) are rerouted, for fake cuda tensors only, to the aten ops behind them.
"""

from __future__ import annotations

import contextlib
import types
from unittest import mock

import torch

CHECKED_ON = ("2.13.0", "2.14.1")


def require_checked_torch() -> None:
    import pytest

    version = torch.__version__.split("+")[0]
    if version not in CHECKED_ON:
        pytest.skip(f"tests/pretend_cuda.py patches torch internals and was checked on torch {CHECKED_ON}, "
                    f"not {version}: check it there and add the version")


def properties(arch: int = 90) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        name=f"pretend sm_{arch} (H100 80GB HBM3 figures)", major=arch // 10, minor=arch % 10,
        multi_processor_count=132, total_memory=80 * 2**30, regs_per_multiprocessor=65536,
        max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32, L2_cache_size=50 * 2**20,
        shared_memory_per_block=48 * 1024, shared_memory_per_block_optin=227 * 1024,
        shared_memory_per_multiprocessor=228 * 1024, gcnArchName="NVIDIA", is_integrated=False,
        is_multi_gpu_board=False, uuid="00000000-0000-0000-0000-000000000000", pci_bus_id=0, pci_device_id=0,
        pci_domain_id=0, clock_rate=1980000, memory_clock_rate=2619000, memory_bus_width=5120,
    )


def stub_triton_driver(arch: int = 90):
    """An instance of Triton's own CudaDriver (so Inductor's set_driver_to_gpu keeps it) that never builds
    cuda_utils.so (which links libcuda) and reports a fixed target."""
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    class StubCudaDriver(CudaDriver):
        def __init__(self):
            pass

        def get_current_target(self):
            return GPUTarget("cuda", arch, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_device_capability(self, device=None):
            return (arch // 10, arch % 10)

        def get_active_torch_device(self):
            return torch.device("cuda", 0)

    return StubCudaDriver()


def _getitem(real):
    """Basic indexing (ints, slices, None, ...) of a cuda tensor rebuilt from select/slice/unsqueeze."""

    def getitem(self, idx):
        items = idx if isinstance(idx, tuple) else (idx,)
        basic = all(i is None or i is Ellipsis or (isinstance(i, (slice, int, torch.SymInt)) and not isinstance(i, bool))
                    for i in items)
        if self.device.type != "cuda" or not basic:
            return real(self, idx)
        if Ellipsis in items:
            at = items.index(Ellipsis)
            used = sum(i is not None and i is not Ellipsis for i in items)
            items = items[:at] + (slice(None),) * (self.dim() - used) + items[at + 1 :]
        out, dim = self, 0
        for i in items:
            if i is None:
                out, dim = out.unsqueeze(dim), dim + 1
            elif isinstance(i, slice):
                out = torch.ops.aten.slice.Tensor(out, dim, i.start, i.stop, 1 if i.step is None else i.step)
                dim += 1
            else:
                out = out.select(dim, i)
        return out

    return getitem


@contextlib.contextmanager
def pretend_cuda(arch: int = 90):
    import triton
    from torch._dynamo import device_interface as di
    from torch._inductor.fx_passes import joint_graph
    from torch.utils._triton import has_triton

    props = properties(arch)
    fns = dict(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
        set_device=lambda device=None: None, get_device_capability=lambda device=None: (props.major, props.minor),
        get_device_properties=lambda device=None: props, is_bf16_supported=lambda *a, **k: True,
        synchronize=lambda device=None: None, get_rng_state=lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
        set_rng_state=lambda new_state, device="cuda": None, _exchange_device=lambda device: 0,
        _maybe_exchange_device=lambda device: 0,
    )
    getitem = _getitem(torch.Tensor.__getitem__)
    real_setitem, real_copy, real_invert = torch.Tensor.__setitem__, torch.Tensor.copy_, torch.Tensor.__invert__
    real_lazy_init = joint_graph.lazy_init

    def setitem(self, idx, value):
        if self.device.type != "cuda":
            return real_setitem(self, idx, value)
        view = getitem(self, idx)
        if isinstance(value, torch.Tensor):
            torch.ops.aten.copy_.default(view, value)
        else:
            torch.ops.aten.fill_.Scalar(view, value)

    def copy_(self, src, non_blocking=False):
        if self.device.type == "cuda" or (isinstance(src, torch.Tensor) and src.device.type == "cuda"):
            return torch.ops.aten.copy_.default(self, src, non_blocking)
        return real_copy(self, src, non_blocking)

    def invert(self):
        return torch.ops.aten.bitwise_not.default(self) if self.device.type == "cuda" else real_invert(self)

    with contextlib.ExitStack() as stack:
        patch = lambda obj, name, value: stack.enter_context(mock.patch.object(obj, name, value))  # noqa: E731
        for name, fn in fns.items():
            patch(torch.cuda, name, fn)
            if hasattr(di.CudaInterface, name):
                patch(di.CudaInterface, name, staticmethod(fn))
        patch(di.CudaInterface, "get_compute_capability", staticmethod(lambda device=None: arch))
        patch(di.CudaInterface.Worker, "get_device_properties", staticmethod(lambda device=None: props))
        patch(di.CudaInterface.Worker, "current_device", staticmethod(lambda: 0))
        patch(di.CudaInterface.Worker, "set_device", staticmethod(lambda device: None))
        patch(joint_graph, "lazy_init", lambda input_device=None, *a, **k: real_lazy_init(torch.device("cpu"), *a, **k))
        patch(torch.Tensor, "__getitem__", getitem)
        patch(torch.Tensor, "__setitem__", setitem)
        patch(torch.Tensor, "copy_", copy_)
        patch(torch.Tensor, "__invert__", invert)
        has_triton.cache_clear()  # functools.cache: an answer from before the context would stick
        previous = triton.runtime.driver._active
        triton.runtime.driver.set_active(stub_triton_driver(arch))
        try:
            yield props
        finally:
            triton.runtime.driver._active = previous
            has_triton.cache_clear()
