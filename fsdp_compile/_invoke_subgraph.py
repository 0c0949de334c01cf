"""Three additions to torch 2.13's ``invoke_subgraph``: a Conjugate kernel, which it lacks, and, while our
compiled step runs, one schema per region and operand layout instead of one per call, and a failed attempt
to record a traced region for reuse that leaves it unrecorded instead of failing the compile.

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

**Schemas.** Under autograd, every call of a higher-order operator first asks for its schema, to refuse
training through an input mutation; ``invoke_subgraph``'s ``gen_schema`` re-traces the whole region to
answer. A region is one subgraph called once per block, so tracing a Llama-3 70B step re-traced its block
160 times (about a third of its ``explain``). The schema is a function of the subgraph and its operands'
metadata alone, so ``schemas_cached`` keeps it per subgraph (weakly: it goes with the graph) and operand
layout, for the duration of our compiled call only (``capture.active``): torch's class is as it was
outside it. Operands with symbolic sizes are not cached.

**Reuse.** A region whose blocks differ in some attribute (HF decoder layers carry their ``layer_idx``) is
traced for its first block; Dynamo then records the trace with the guards on what it read, and stamps it
out for a later block whose guards hold (``torch/_dynamo/variables/invoke_subgraph.py``). Recording raises
where the trace read something its machinery does not handle: a tensor from the enclosing graph that is no
argument ("Freevar has no source"), or a guard kind it cannot re-check ("unsupported guard type"). Each
block is then traced as itself, as it would be without reuse: ``reuse_failures_skipped`` makes the
recording best-effort, during our compiled call only.
"""

from __future__ import annotations

import contextlib
import weakref

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


_SCHEMAS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # subgraph -> {(identifier, layout): schema}


@contextlib.contextmanager
def schemas_cached():
    """Within the block, ``invoke_subgraph``'s schema is computed once per subgraph and operand layout."""
    cls = type(invoke_subgraph)
    original = vars(cls).get("gen_schema")
    if original is None or getattr(original, "fsdp_compile_cached", False):  # a torch without it, or nested
        yield
        return

    def gen_schema(self, subgraph, identifier, *operands):
        layout = _layout(operands)
        if not isinstance(subgraph, torch.fx.GraphModule) or identifier is None or layout is None:
            return original(self, subgraph, identifier, *operands)
        per_graph = _SCHEMAS.setdefault(subgraph, {})
        key = (identifier, layout)
        if key not in per_graph:
            per_graph[key] = original(self, subgraph, identifier, *operands)
        return per_graph[key]

    gen_schema.fsdp_compile_cached = True
    cls.gen_schema = gen_schema
    try:
        yield
    finally:
        cls.gen_schema = original


_RECORDING = ("build_reuse_condition", "save_reuse_entry")  # each returns None; the first's None means "do not record"


@contextlib.contextmanager
def reuse_failures_skipped():
    """Within the block, a trace Dynamo fails to record for reuse stays unrecorded (each call traces anew)."""
    from torch._dynamo.variables import invoke_subgraph as variables

    originals = {name: getattr(variables, name, None) for name in _RECORDING}
    if None in originals.values() or any(getattr(f, "fsdp_compile_skips", False) for f in originals.values()):
        yield  # a torch without them, or nested
        return

    def skipping(original):
        def record(*args, **kwargs):
            try:
                return original(*args, **kwargs)
            except (AssertionError, RuntimeError) as e:  # nothing is recorded before the entry is complete
                variables.hc_log.debug("subgraph_reuse: not recorded (fsdp_compile) -- %s", e)
                return None

        record.fsdp_compile_skips = True
        return record

    for name, original in originals.items():
        setattr(variables, name, skipping(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(variables, name, original)


def _layout(operands) -> tuple | None:
    """What a schema can depend on of the operands; None (not cached) for anything but tensors of concrete
    sizes, ints and None."""
    out = []
    for o in operands:
        if isinstance(o, torch.Tensor):
            if any(isinstance(d, torch.SymInt) for d in (*o.shape, *o.stride(), o.storage_offset())):
                return None
            out.append((type(o), tuple(o.shape), o.stride(), o.storage_offset(), o.dtype, o.device, o.requires_grad,
                        o.is_conj(), o.is_neg()))
        elif type(o) is int or o is None:
            out.append(o)
        else:
            return None
    return tuple(out)
