"""One rank, no copies: the unshard and gradient reduce-scatter of an FSDP group of one rank (world size 1,
or a 1-wide shard dimension of a 2-D mesh), as ``ops`` decomposes them there.

Nothing is gathered or reduce-scattered. FSDP2 (torch 2.13: ``FSDPParamGroup.unshard`` and
``wait_for_unshard``, ``foreach_reduce``) issues no collective there: its unshard copies each parameter's
all-gather input (the shard, cast to param_dtype) into that parameter's own all-gather output and views the
unsharded parameter out of it; its reduce-scatter packs the gradients (cast to reduce_dtype), pre-divides,
copies them into its output buffer (divided there by a user's gradient_divide_factor), post-divides, casts
back to the parameter's dtype and views the shard gradients out. The compiled graphs keep only what
changes a value: per parameter the cast to param_dtype (else the parameter is its shard itself: no copy, no
buffer), per gradient the casts and divides FSDP2 applies, in its order, none by a factor of 1 (FSDP2's
``_div_if_needed``); no copy-in, copy-out, pack, unpack or concatenation. HSDP keeps its all-reduce over
the replicas, one collective over one packed buffer as FSDP2's (``ops.reduce_scatter_grads_impl``).

A shard gradient handed out as the unsharded gradient itself must not share memory with another tensor
(``as_shard_grad``): that is decided while AOTAutograd traces the backward, from the traced graph.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
import torch.fx as fx
from torch import Tensor

_c10d = torch.ops._c10d_functional


def param(shard: Tensor, dtype) -> Tensor:
    """The unsharded parameter of a one-rank group: its shard itself (``same``), or one cast to
    ``param_dtype``. The unshard op is opaque to functionalization, which takes its outputs for new tensors: an
    in-place update of the parameter inside the graph is functionalized into a new tensor and never reaches
    the shard (as when the parameter was a copy). The optimizer updates the shard between steps, and a
    recomputation in backward (reshard_after_forward) reads it again, within the step that read it."""
    if dtype is not None and dtype != shard.dtype:
        return shard.to(dtype)
    return same(shard)


def same(x: Tensor) -> Tensor:
    """``x`` itself as a node of the chain, which carries its annotation (the passes and the backend find
    the step's graphs by it): ``as_strided`` over the same memory, as FSDP2's ``init_unsharded_param`` views
    its all-gather output. Not ``alias`` or a ``view`` of the same shape, which Inductor removes from the
    joint graph as no-ops before our passes see it; Inductor lowers this one to a reinterpretation (no
    kernel), and aot_eager runs it as a view."""
    return torch.ops.aten.as_strided.default(x, x.shape, x.stride(), x.storage_offset())


def payloads(shards: Sequence[Tensor], args, inputs: Sequence[Tensor]) -> list[Tensor]:
    """``ops._unshard_payloads`` on one rank (a unit with all-gather extensions; ``args``: its
    ``ops.UnshardArgs``): what that returns, without its buffer. A plain parameter is its shard or its cast
    (``param``); an extension parameter's gathered inputs are its ``fsdp_pre_all_gather`` tensors ([rows,
    *rest]; a 0-dim one as [1]), then comes its stride-0 handle."""
    outs, it = [], iter(inputs)
    for shard, d, n in zip(shards, args.dim0s, args.payloads):
        if n == 0:
            outs.append(param(shard, args.param_dtype))
            continue
        for _ in range(n):
            t = next(it)
            outs.append(t.reshape(-1, *t.shape[1:]))  # a view; a 0-dim input as [1], as gathered over one rank
        shape = (d, *shard.shape[1:])
        dtype = args.param_dtype or shard.dtype
        outs.append(torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device=shard.device))
    return outs


def grad(unsharded: Tensor, r, orig_dtype: torch.dtype) -> Tensor:
    """A one-rank group's shard gradient: FSDP2's casts and divides, in its order, on this gradient alone
    (``foreach_reduce`` at world size 1: pre-divide, the gradient_divide_factor, post-divide, then the cast
    back); ``r``: the op's ``ops.Reduction``. Contiguous, as FSDP2's views of its flat output are."""
    x = unsharded
    if r.dtype is not None and r.dtype != x.dtype:
        x = x.to(r.dtype, memory_format=torch.contiguous_format)
    if r.op == "premul_sum":  # FSDP2 divides by the factor where no reduce-scatter runs (pre_factor = 1 / it)
        x = x / (1.0 / r.pre_factor)
    elif r.pre_factor is not None and r.pre_factor != 1:
        x = x / r.pre_factor
    if r.post_factor is not None and r.post_factor != 1:
        x = x / r.post_factor
    if x.dtype != orig_dtype:
        x = x.to(orig_dtype, memory_format=torch.contiguous_format)
    if x is not unsharded:
        return x.contiguous()  # a no-op unless a divide kept a non-contiguous layout
    return as_shard_grad(unsharded)


def as_shard_grad(grad: Tensor) -> Tensor:
    """``grad`` handed out as a shard gradient as it is (``same``) where no other tensor can hold its
    memory, else a copy: a shard gradient must own its memory, as FSDP2's do (``clip_grad_norm_`` and
    gradient accumulation write ``.grad`` in place, and the DTensor gradient built around it hides any
    sharing from autograd's own check). Copied: a non-contiguous gradient (FSDP2's are contiguous); one
    that is, or views, a graph input (a tangent: the model output's gradient); one whose memory an earlier
    shard gradient of this graph took (autograd hands ``p1 + p2``'s gradient to both, also out of a region's
    backward), with ``own_copy``. Untraced (the op's eager kernel) it is the gradient itself, which the op
    copies."""
    if not grad.is_contiguous():
        return grad.contiguous()
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None:
        return same(grad)
    node = get_proxy_slot(grad, mode.tracer, None, lambda p: p.proxy.node)
    if node is None:
        return own_copy(grad)
    key = memory_key(node, mode.tracer.root)
    taken = node.graph.__dict__.setdefault("_fsdp_compile_shard_grads", set())  # this trace's keys
    if key is None or key in taken:
        return own_copy(grad)
    taken.add(key)
    return same(grad)


@torch.library.custom_op("fsdp_compile::own_copy", mutates_args=())
def own_copy(x: Tensor) -> Tensor:
    """A copy of ``x`` in memory of its own, which no graph pass removes: Inductor drops a ``clone`` whose
    source it takes for memory no graph output or input holds, and cannot see that two outputs of a region
    call are one tensor (``as_shard_grad``)."""
    return x.clone(memory_format=torch.contiguous_format)


@own_copy.register_fake
def _(x):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_invoke_subgraph = torch.ops.higher_order.invoke_subgraph
# ops whose output shares its first argument's memory though their schemas do not say so
_SAME_MEMORY = frozenset({torch.ops.aten._unsafe_view.default, torch.ops.aten._reshape_alias.default,
                          _c10d.wait_tensor.default})


def memory_key(node, root) -> tuple | None:
    """A key for the memory ``node``'s value lives in (equal keys: the same memory), found through views and
    into region bodies (``invoke_subgraph``: a body's output is the memory of the call's output, a body's
    input that of the call's operand); None where it is a graph input's or unknown (another higher-order op's
    output, a constant)."""
    calls = []  # (region call, the graph module holding it) entered, innermost last
    while True:
        target = node.target if node.op == "call_function" else None
        if target is not None and (target in _SAME_MEMORY or getattr(target, "is_view", False)):
            node = node.args[0]
        elif target is operator.getitem:
            call, i = node.args
            if call.target is _invoke_subgraph:
                body = getattr(root, call.args[0].target, None)
                if not isinstance(body, fx.GraphModule):
                    return None
                calls.append((call, root))
                root, node = body, body.graph.output_node().args[0][i]
            elif isinstance(call.target, torch._ops.OpOverload):
                if any(r.alias_info is not None for r in call.target._schema.returns):  # split, unbind, ...
                    node = call.args[0]
                else:
                    return (*[c for c, _ in calls], call, i)
            else:
                return None
        elif node.op == "placeholder" and calls:  # a body's input: the call's operand
            call, root_above = calls.pop()
            index = list(root.graph.find_nodes(op="placeholder")).index(node)
            root, node = root_above, call.args[2 + index]
        elif target is not None and isinstance(target, torch._ops.OpOverload):
            return (*[c for c, _ in calls], node)
        else:
            return None
