"""A Conjugate kernel for ``invoke_subgraph``, which torch 2.13 lacks.

A region whose forward saves a complex tensor for its backward (complex RoPE: ``view_as_complex(q) *
freqs_cis``, whose backward multiplies by ``freqs_cis.conj()``) can hand the backward region a tensor with
the conjugate bit set. Every ATen op resolves that bit through the Conjugate dispatch key's fallback, but
a higher-order operator has no fallback and ``invoke_subgraph`` registers no kernel for that key:
"could not find kernel for HigherOrderOperator invoke_subgraph at dispatch key DispatchKey.Conjugate".

The kernel below does what the fallback does for an ATen op: materialize the conjugation
(``resolve_conj``, the values the bit stands for) and call the operator again with the key excluded.
The values are the ones eager computes with (an ATen op resolves the bit the same way before its
kernel runs), so the compiled step stays bitwise equal to eager FSDP2 (``tests/test_regions.py``).
It only adds a kernel where torch has none; a torch that brings its own keeps it.
"""

from __future__ import annotations

import torch
from torch._C import DispatchKey
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph


def _resolve_conj(subgraph, identifier, *operands):
    operands = tuple(o.resolve_conj() if isinstance(o, torch.Tensor) and o.is_conj() else o for o in operands)
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(DispatchKey.Conjugate)):
        return invoke_subgraph(subgraph, identifier, *operands)


def register() -> None:
    """Idempotent."""
    if DispatchKey.Conjugate not in invoke_subgraph.py_kernels:
        invoke_subgraph.py_impl(DispatchKey.Conjugate)(_resolve_conj)
