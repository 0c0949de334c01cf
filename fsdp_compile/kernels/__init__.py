"""Copy-in/copy-out kernels around FSDP2's all-gather and reduce-scatter, in FSDP2's padded layout.

Each function is one ``fsdp_compile::`` op (functional, with a fake implementation, traceable) with a
Triton kernel (one launch per call, however many tensors) and a torch implementation (the CPU path and
the test oracle), chosen per call by ``impl``. Layout and rounding: ``_common``; ops and schemas:
``_library``; one kernel per module.
"""

from ._library import all_gather_copy_in, all_gather_copy_out, reduce_scatter_copy_in, reduce_scatter_copy_out

__all__ = ["all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in", "reduce_scatter_copy_out"]
