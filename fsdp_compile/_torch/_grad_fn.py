"""``x.grad_fn is None`` on a tensor computed in the trace (spmd_types' collectives).

spmd_types 0.3.1's collectives, which torchtitan's default ``spmd_backend="spmd_types"`` calls for tensor
parallelism (its sequence-parallel all-gathers and reduce-scatters, the loss's vocab all-gather), read
``x.requires_grad and x.grad_fn is None`` (``input_is_leaf``, used only to refuse an asynchronous backward on a
leaf). Dynamo cannot hand out the ``grad_fn`` of a tensor computed in the graph and fails under
``fullgraph=True`` ("Tensor with grad_fn()"). There the answer to ``is None`` is known: the tensor has one. In
the functions listed in ``_ONLY_IS_NONE`` (each reads ``grad_fn`` for that test alone), the capture answers a
stand-in constant, so ``is None`` is False as eagerly; anywhere else Dynamo's own handling.

Checked on 2.14.1 (torch 2.13's fully_shard refuses spmd_types parameters). Delete when Dynamo answers
``grad_fn is None`` for a tensor computed in the graph, or spmd_types stops reading it.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

from fsdp_compile._torch import patched

# (module, function) whose only use of ``x.grad_fn`` is ``x.grad_fn is None`` (spmd_types 0.3.1)
_ONLY_IS_NONE = {
    ("spmd_types._collectives", name) for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
} | {("spmd_types._local", name) for name in ("reinterpret", "convert", "invariant_to_replicate")}


def _codes() -> set:
    """The code objects of ``_ONLY_IS_NONE`` among the modules already imported (none is imported for it)."""
    codes = set()
    for module, name in _ONLY_IS_NONE:
        fn = getattr(sys.modules.get(module), name, None)
        if fn is not None:
            codes.add(inspect.unwrap(fn).__code__)  # spmd_types wraps them (_traceback)
    return codes


@contextlib.contextmanager
def grad_fn_not_none():
    """While our step is traced: ``x.grad_fn`` of a tensor with one, read in a listed function, is a non-None
    constant."""
    from torch._dynamo.variables import ConstantVariable
    from torch._dynamo.variables.tensor import TensorVariable

    original = TensorVariable.method_attr_grad_fn
    codes = _codes()

    def method_attr_grad_fn(self, tx):
        if self.has_grad_fn and tx.f_code in codes:
            return ConstantVariable.create(True)  # not None; only compared with None there
        return original(self, tx)

    with patched((TensorVariable, "method_attr_grad_fn", method_attr_grad_fn)):
        yield
