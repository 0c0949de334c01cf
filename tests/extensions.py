"""A traceable weight subclass implementing FSDP2's all-gather extension, for the extension tests.

``Int8Gathered`` wraps a float weight. Its ``fsdp_pre_all_gather`` sends an int8 quantization of the shard
(one byte per element) and each row's float32 absolute maximum: inputs of two dtypes, which FSDP2 packs
as bytes (gloo can gather those). Its metadata is ``(qmax,)``, a Python int that the dequantization in
``fsdp_post_all_gather`` divides by, so a stale ``qmax`` gives other numbers. Like torchao's float8
weight wrapper it keeps its class through the ops FSDP2 uses to shard it (views, slices, copies) and
unwraps to the inner tensor for every other op (matmuls, the optimizer's updates).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils import _pytree as pytree

aten = torch.ops.aten
_PRESERVE = {
    aten.empty_like.default, aten.new_zeros.default, aten.slice.Tensor, aten.copy_.default, aten.view.default,
    aten.as_strided.default, aten._to_copy.default, aten.split.Tensor, aten.clone.default, aten.detach.default,
    aten.alias.default,
}


class Int8Gathered(torch.Tensor):
    @staticmethod
    def __new__(cls, tensor: torch.Tensor, qmax: int = 127):
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor, qmax: int = 127):
        self._tensor = tensor
        self.qmax = qmax

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        first = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Int8Gathered))
        args, kwargs = pytree.tree_map_only(Int8Gathered, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE:
            return out
        return pytree.tree_map_only(torch.Tensor, lambda x: type(first)(x, first.qmax), out)

    def __tensor_flatten__(self):
        return ["_tensor"], {"qmax": self.qmax}

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Int8Gathered(inner["_tensor"], meta["qmax"])

    def __repr__(self):
        return f"Int8Gathered({self._tensor!r}, qmax={self.qmax})"

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        x = self._tensor
        amax = x.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-8)  # (rows, 1) float32
        q = torch.round(x.float() * (self.qmax / amax)).clamp(-self.qmax, self.qmax).to(torch.int8)
        return (q, amax), (self.qmax,)

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        q, amax = all_gather_outputs
        (qmax,) = metadata
        full = q.to(param_dtype) * (amax.to(param_dtype) / qmax)
        if out is not None:  # eager FSDP2 from its second all-gather on: refill its unsharded parameter, which
            out.data.copy_(full)  # autograd may have saved (torchao's float8 only swaps the scale: its data aliases the output)
            return None
        return full, (full,)


class Int8GatheredOneArg(Int8Gathered):
    """The older one-argument ``fsdp_pre_all_gather(mesh)`` that FSDP2 still accepts."""

    def fsdp_pre_all_gather(self, mesh):  # noqa: D102
        return super().fsdp_pre_all_gather(mesh, None, None, None, None)

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Int8GatheredOneArg(inner["_tensor"], meta["qmax"])


class Opaque(torch.Tensor):
    """Implements the extension but is not traceable (no ``__tensor_flatten__``): refused."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, tensor.size(), dtype=tensor.dtype, device=tensor.device,
                                                   requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        args, kwargs = pytree.tree_map_only(Opaque, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, Opaque, out) if func in _PRESERVE else out

    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        return (self._tensor,), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return all_gather_outputs[0].to(param_dtype), ()


def convert_linears(model: nn.Module, cls=Int8Gathered) -> nn.Module:
    """Every ``nn.Linear`` weight wrapped in ``cls`` (before ``fully_shard``, as torchao converts)."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(cls(m.weight.data), requires_grad=m.weight.requires_grad)
    return model
