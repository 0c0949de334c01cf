"""A region whose body makes a tensor subclass inside another (torchao's float8 tensor parallelism: each block's
input cast to a ``Float8TrainingTensor`` inside a DTensor, by ``PrepareFloat8ModuleInput``).

Torch 2.13 traces such a body inline but not as a region, for two reasons:

* **Dynamo's check of a region body's intermediates** (``collect_intermediate_outputs``, which keeps out of a
  region's outputs an intermediate that aliases an input; ``torch/_dynamo/variables/higher_order_ops.py``)
  reads each intermediate's fake tensor through ``torch._higher_order_ops.utils._collect_fake_inputs``. That
  function unwraps a subclass one level and asserts it found fake tensors: "Expected FakeTensor after
  unwrapping, got <class '...Float8TrainingTensor'>". ``nested_subclass_regions`` unwraps a subclass of
  subclasses down to its fake leaves, in ``__tensor_flatten__`` order, as the one-level case does. Every
  caller (Dynamo's aliasing checks) reads the first leaf's storage, which is what it reads for one level.
* **invoke_subgraph's functionalization runs the body below autograd** (``FunctionalizeCtxWrapper``). An op
  that autograd decomposes (CompositeImplicitAutograd: ``view_as`` in ``DTensor.from_local``, ``chunk``)
  so arrives whole at ``FunctionalTensorMode``. That mode decomposes it for the tensors it recognizes, but
  hands it to an unrecognized subclass, which may implement few ops (torchao's: "attempting to run
  aten.view_as.default, this is not supported"). Inside a region body's functionalization, the mode
  decomposes such an op first wherever its own test (``_can_decompose``: autograd would have decomposed it,
  or it is a view) says it would for a recognized tensor. The subclass then sees the ops it sees inline,
  where autograd decomposed them before the mode.

Both apply while our compiled step is traced (``capture.active``), the second only inside the functionalization
of a higher-order operator's body (``FunctionalizeCtxWrapper``: a region's). Inline code reaches neither: its
intermediates are not a region's, and autograd decomposes before the mode sees an op. In a TP region's body a
DTensor is such an unrecognized subclass too; its CompositeImplicitAutograd ops are then decomposed before
DTensor sees them, as autograd decomposes them in eager and inline (the TP parity cases stay bitwise).

Seen and checked on 2.13.0 and 2.14.1 (``tests/test_tp.py::test_llama_float8_tensor_parallel_gathers_float8_activations``,
fast tier, fails on both without it; bitwise against eager FSDP2 with regions on and off in
``tests/test_tp_multirank.py``, 2.13.0). Delete when
``_collect_fake_inputs`` recurses into nested subclasses and a region body is functionalized above autograd's
decompositions (or ``FunctionalTensorMode`` decomposes before deferring to a subclass).
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fsdp_compile._torch import patched


def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors inside ``t``, depth first in ``__tensor_flatten__`` order."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    inner = (getattr(t, name) for name in t.__tensor_flatten__()[0])
    return [leaf for x in inner if isinstance(x, torch.Tensor) for leaf in _leaves(x)]


def _nested(value) -> bool:
    return is_traceable_wrapper_subclass(value) and any(
        is_traceable_wrapper_subclass(getattr(value, name)) for name in value.__tensor_flatten__()[0])


@contextlib.contextmanager
def nested_subclass_regions():
    """Within the block: a nested subclass's fake leaves for Dynamo's region checks, and, inside a region body's
    functionalization, an op that autograd would have decomposed decomposed before a subclass sees it."""
    from torch._higher_order_ops import utils
    from torch._subclasses import functional_tensor as ft

    collect = utils._collect_fake_inputs
    call = utils.FunctionalizeCtxWrapper.__call__
    dispatch = ft.FunctionalTensorMode.__torch_dispatch__
    depth = [0]  # region bodies being functionalized

    def collect_fake_inputs(inputs):
        out = []
        for inp in inputs:
            node = inp.node if isinstance(inp, torch.fx.Proxy) else inp
            value = node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None
            out += _leaves(value) if _nested(value) else collect([inp])
        return out

    def functionalized_call(self, *args, **kwargs):
        depth[0] += 1
        try:
            return call(self, *args, **kwargs)
        finally:
            depth[0] -= 1

    def torch_dispatch(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (depth[0] and ft._has_unrecognized_tensor_types(types) and func not in ft.FunctionalTensor.metadata_fns
                and self._can_decompose(func, args, kwargs) and torch._C._dispatch_has_kernel(func.name())):
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        return dispatch(self, func, types, args, kwargs)

    with patched((utils, "_collect_fake_inputs", collect_fake_inputs),
                 (utils.FunctionalizeCtxWrapper, "__call__", functionalized_call),
                 (ft.FunctionalTensorMode, "__torch_dispatch__", torch_dispatch)):
        yield
