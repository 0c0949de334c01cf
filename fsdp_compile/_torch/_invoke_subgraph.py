"""Three additions to torch 2.13's ``invoke_subgraph``: a Conjugate kernel, which it lacks, and, while our
compiled step runs, one schema per region and operand layout instead of one per call, and two checks on
Dynamo's reuse of a region's trace for another block. Two more fix Inductor's lowering of a region call while
our graphs compile (``subgraphs_donate_nothing``, ``region_outputs_alias_inputs``).

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
outside it. Operands with symbolic sizes are not cached. Nor is a region traced again for its first
schema: the ATen graph it needs is at hand, for Dynamo's body in ``passes/regions.py``'s trace of it (made
to decide on the region) and for AOTAutograd's forward and backward parts in the parts themselves. That
was three traces a compile: a 2-layer Llama's first step under ``aot_eager`` went from 4.6 s to 3.5 s
(mean of 20 compiles each, with and without checkpointed blocks, one process, fake process group).

**Reuse.** A region whose blocks differ in some attribute (HF decoder layers carry their ``layer_idx``) is
traced for its first block; Dynamo then records the trace with the guards on what it read, and stamps it
out for a later block whose guards hold (``torch/_dynamo/variables/invoke_subgraph.py``). ``reuse_checked``
adds these checks, during our compiled call only:

* Dynamo guards on what the trace read from the objects as they were before the step, but an attribute the
  enclosing forward wrote earlier in the same trace (``block.scale = ...`` in the parent's loop) is read
  from that pending write, unguarded: the first block's value would be stamped out for every block. A block
  with such a write on it or any of its submodules is neither recorded nor served from a record (traced as
  itself).
* Recording raises where the trace read something its machinery does not handle: a tensor from the
  enclosing graph that is no argument ("Freevar has no source"), or a guard kind it cannot re-check
  ("unsupported guard type"). The trace then stays unrecorded instead of failing the compile.
* A trace that returns a tensor subclass (a DTensor its region left as one) is not recorded: Dynamo stamps a record's
  outputs out as plain tensors, so the code after a later block's call would be traced on plain tensors.
* A trace that read a Python number the graph takes as a tensor (a float attribute automatic dynamic made an
  unspecialized input after it changed between compiles) is not recorded: the stamped-out call for a later block
  re-read that block's as a constant, where the body takes a tensor ("'float' object has no attribute 'item'" in
  AOTAutograd; ``test_blocks_passed_in_whose_float_attribute_changes_between_steps``).

and two savings on the way to a reuse: a call is fingerprinted (the leaves it matches a record by) without
tracing ``pytree.tree_flatten`` through Dynamo where the call is plain (``_fingerprint``), and the check of
a record re-sources each of its sources once (``_clones_shared``). Dynamo's reuse lookups of a 16-layer HF
Llama went from 1.34 s to 0.13 s of its compile (fingerprints 0.95 -> 0.003 s, checks 0.42 -> 0.12 s; one
process, fake process group).

**Versions, and when each part can go** (no upstream issue or PR is cited for any of them):

* ``register``: the missing kernel seen on 2.13.0; checked on 2.13.0 and 2.14.1 (``test_complex_region_trains``,
  fast tier). Goes when every supported torch registers its own Conjugate kernel (``register`` defers to it).
* ``schemas_cached``: measured on 2.13.0; runs on 2.14.1 too (``test_regions.py``'s schema tests, fast tier).
  Goes when torch's ``gen_schema`` stops re-tracing a region per call.
* ``reuse_checked``: its holes seen on 2.13.0, the only torch where guarded reuse is on (``GUARDED_REUSE``);
  on 2.14.1 only keyed reuse passes through it. Goes when Dynamo guards a pending attribute write on reuse,
  records without raising, stamps an unspecialized number out as it traced it, and stops reusing across a
  differing float attribute (2.14.1, ``test_which_blocks_share_a_region``).
* ``subgraphs_donate_nothing``: seen on 2.13.0; checked on 2.13.0 and 2.14.1
  (``tests/test_ops.py::test_regions_under_inductor_two_layers``, CI's ``-m inductor tests/test_ops.py``). Goes
  when ``SubgraphLowering`` stops taking the enclosing graph's ``bw_donated_idxs``.
* ``region_outputs_alias_inputs``: seen on 2.14.1 (on 2.13.0 with ``reorder_for_peak_memory``); checked on both
  by the same tests. Goes when ``test_region_outputs_that_are_inputs_keep_them_alive`` (torch alone) passes
  without it: Inductor's ``InvokeSubgraph`` outputs declare the inputs they alias.
"""

from __future__ import annotations

import contextlib
import functools
import weakref

import torch
from torch._C import DispatchKey
from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

from fsdp_compile._torch import patched


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
            aten = aten_form(subgraph)
            if aten is None:
                per_graph[key] = original(self, subgraph, identifier, *operands)
            else:
                per_graph[key] = schema_from_aten(self, aten, identifier, operands)
        return per_graph[key]

    gen_schema.fsdp_compile_cached = True
    with patched((cls, "gen_schema", gen_schema)):
        yield


# The ATen form of each region body that passes/regions.py traced to decide on it (weakly, by body).
ATEN_FORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_BUILTIN_MODULES = ("_operator", "math")  # getitem, and arithmetic on sizes


def aten_form(subgraph: torch.fx.GraphModule) -> torch.fx.GraphModule | None:
    """A graph equal to what torch's ``gen_schema`` would trace ``subgraph`` into, without tracing: the ATen
    form regions.py recorded for a Dynamo body, or ``subgraph`` itself where it is already ATen with its
    values (AOTAutograd's forward and backward parts of a region). None: torch traces it."""
    known = ATEN_FORMS.get(subgraph)
    if known is not None:
        return known
    for node in subgraph.graph.nodes:
        if node.op in ("call_method", "call_module"):
            return None
        if node.op in ("placeholder", "call_function") and "val" not in node.meta:
            return None
        if node.op == "call_function" and not (
            isinstance(node.target, (torch._ops.OpOverload, torch._ops.HigherOrderOperator))
            or getattr(node.target, "__module__", None) in _BUILTIN_MODULES
        ):
            return None
    return subgraph


def schema_from_aten(hop, aten: torch.fx.GraphModule, identifier, operands):
    """``InvokeSubgraphHOP.gen_schema`` on an ATen graph already at hand: the same arguments, input mutations
    and outputs (``tests/test_regions.py`` holds the two equal)."""
    from torch._higher_order_ops.schema import HopSchemaGenerator
    from torch._higher_order_ops.utils import check_input_alias_and_mutation_return_outputs

    gen = HopSchemaGenerator(hop)
    gen.add_arg("subgraph", aten)
    gen.add_arg("identifier", identifier)
    *_, mutated, outputs = check_input_alias_and_mutation_return_outputs(aten)
    for i, operand in enumerate(operands):
        gen.add_arg(f"arg{i}", operand, is_mutated=i in mutated)
    for out in outputs:
        gen.add_output(out)
    return gen.gen_schema()


# Dynamo's guard-based reuse (blocks passed in, no reuse key) is trusted on torch 2.13 only, where the
# tests hold it bitwise. Measured on 2.14.1: blocks that differ in a float attribute read in forward were
# served the first block's trace (tests/test_regions.py::test_which_blocks_share_a_region, wrong outputs).
# Elsewhere every such block is traced as itself, as before reuse.
GUARDED_REUSE = torch.__version__.startswith("2.13.")

_RECORDING = ("build_reuse_condition", "save_reuse_entry")  # each returns None; the first's None means "do not record"


def _written_block(tx, fingerprint) -> bool:
    """Whether a module among the region call's operands, or a submodule of one, has an attribute written
    earlier in this trace (Dynamo's pending ``store_attr`` mutations)."""
    written = {id(getattr(vt, "value", None)) for vt in tx.output.side_effects.store_attr_mutations}
    for _, vt in fingerprint.flat_vts:
        module = getattr(vt, "value", None)
        if isinstance(module, torch.nn.Module) and any(id(m) in written for m in module.modules()):
            return True
    return False


def _reads_number_as_tensor(tx, traced_sources) -> bool:
    """Whether a region's trace read a Python number the graph takes as a tensor (an unspecialized float: such a
    trace is not recorded, see ``reuse_checked``)."""
    if not traced_sources:
        return False
    return any(getattr(arg, "pass_arg_as_tensor", False) and arg.source in traced_sources for arg in tx.output.graphargs)


class _NotPlain(Exception):
    pass


_LEAF = object()  # what a classified operand stands for in the mirror (pytree takes it for a leaf)
_LEAF_CONSTANTS = (int, float, bool, str, bytes, complex, type(None))  # None too: a leaf to torch's pytree


def _mirror(vt, flat: list):
    """The region call's operand ``vt`` as Python lists, tuples and dicts around ``_LEAF``s, its
    leaves appended to ``flat`` as ``(tag, vt)`` in pytree's order. ``_NotPlain`` for anything else (a
    namedtuple, a dict subclass, a leaf Dynamo's reuse does not classify): pytree's path decides those."""
    from torch._dynamo.variables import ConstantVariable, ConstDictVariable, ListVariable, TupleVariable
    from torch._dynamo.variables import invoke_subgraph as variables
    from torch._dynamo.variables.lazy import LazyVariableTracker

    real = vt.realize() if type(vt) is LazyVariableTracker else vt
    kind = type(real)
    if kind is ListVariable or kind is TupleVariable:
        items = [_mirror(item, flat) for item in real.items]
        return items if kind is ListVariable else tuple(items)
    if kind is ConstDictVariable and real.user_cls is dict:
        try:
            items = real.keys_as_python_constant()
        except NotImplementedError:  # a key that is no constant
            raise _NotPlain from None
        return {key: _mirror(item, flat) for key, item in items.items()}
    if kind is ConstantVariable and type(real.value) not in _LEAF_CONSTANTS:
        raise _NotPlain
    tag = variables.classify_vt(real)
    if tag is None:
        raise _NotPlain
    flat.append((tag, real))  # realized, as pytree's path hands it back
    return _LEAF


def _fingerprint(original, tx, fn_args_vt, kwargs):
    """``build_input_fingerprint`` of Dynamo's region reuse, with the same result, without tracing
    ``pytree.tree_flatten`` through Dynamo where the call's structure is plain: its lists, tuples and dicts
    are walked here, and pytree flattens a mirror of them. Torch's path cost 60 ms of tracing per region
    call of an HF decoder layer (keyword arguments, a tuple of tensors). Anything else goes to torch's path,
    as does a flat call (torch's own fast path). On torch 2.13 only (``GUARDED_REUSE``), where the result is
    checked equal to torch's: 2.14.1's path hands back a block unrealized, under its closure's source."""
    from torch._dynamo.variables import invoke_subgraph as variables

    if not GUARDED_REUSE or (not kwargs and all(variables.classify_vt(vt) is not None for vt in fn_args_vt)):
        return original(tx, fn_args_vt, kwargs)
    flat: list = []
    try:
        mirror = ([_mirror(vt, flat) for vt in fn_args_vt], {key: _mirror(vt, flat) for key, vt in kwargs.items()})
    except _NotPlain:
        return original(tx, fn_args_vt, kwargs)
    leaves, treespec = torch.utils._pytree.tree_flatten(mirror)
    if len(leaves) != len(flat) or any(leaf is not _LEAF for leaf in leaves):
        return original(tx, fn_args_vt, kwargs)
    return variables.InputFingerprint(flat, [getattr(vt, "source", None) for _, vt in flat], False, treespec)


@contextlib.contextmanager
def _clones_shared():
    """Within the block, ``ChainedSource.clone`` under one transform is computed once per source: the reuse
    check re-sources every guard and read of a record for the new block (``layers[0].x`` -> ``layers[1].x``),
    each clone re-building its whole chain, shared prefixes included (about 1600 clones, 30 ms a call of an
    HF decoder layer's region). A clone is a function of the source and the transform (frozen dataclasses)."""
    from torch._guards import ChainedSource

    original = ChainedSource.__dict__["clone"]
    memo: dict = {}

    def clone(self, transform_fn=None):
        if transform_fn is None:
            return original(self, transform_fn)
        key = (transform_fn, self)  # the transform held: no id reused
        if key not in memo:
            memo[key] = original(self, transform_fn)
        return memo[key]

    with patched((ChainedSource, "clone", clone)):
        yield


@contextlib.contextmanager
def reuse_checked():
    """Within the block, Dynamo neither records nor reuses a region trace for a block written to earlier in
    the trace, a trace it fails to record stays unrecorded (each call traces anew), and a plain call is
    fingerprinted by ``_fingerprint``."""
    from torch._dynamo.variables import invoke_subgraph as variables

    names = (*_RECORDING, "is_reuse_eligible", "is_reusable", "build_input_fingerprint")
    originals = {name: getattr(variables, name, None) for name in names}
    if None in originals.values() or any(getattr(f, "fsdp_compile_checks", False) for f in originals.values()):
        yield  # a torch without them, or nested
        return

    def skipping(original):
        def record(*args, **kwargs):
            kind = _returns_subclass(args, kwargs)
            if kind is not None and hasattr(args[1], "get_function"):  # compiled.regions() says why it is inline
                args[1].get_function().fsdp_compile_inline_why = RETURNS_SUBCLASS.format(kind=kind)
            if kind is not None:
                return None
            try:
                return original(*args, **kwargs)
            except (AssertionError, RuntimeError) as e:  # nothing is recorded before the entry is complete
                variables.hc_log.debug("subgraph_reuse: not recorded (fsdp_compile) -- %s", e)
                return None

        return record

    def eligible(tx, body_r, fingerprint, *args, **kwargs):
        keyed = kwargs.get("has_reuse_hash_fn", args[2] if len(args) > 2 else False)
        if not keyed and not GUARDED_REUSE:
            return False
        if _written_block(tx, fingerprint):
            variables.hc_log.debug("subgraph_reuse: not eligible (fsdp_compile) -- a block written in this trace")
            return False
        if not keyed and _reads_number_as_tensor(tx, args[1] if len(args) > 1 else kwargs.get("traced_sources")):
            variables.hc_log.debug("subgraph_reuse: not eligible (fsdp_compile) -- reads a number passed as a tensor")
            return False
        return originals["is_reuse_eligible"](tx, body_r, fingerprint, *args, **kwargs)

    def reusable(tx, condition, fingerprint, *args, **kwargs):
        if _written_block(tx, fingerprint):
            return False
        with _clones_shared():
            return originals["is_reusable"](tx, condition, fingerprint, *args, **kwargs)

    replacements = {name: skipping(originals[name]) for name in _RECORDING}
    replacements.update(
        is_reuse_eligible=eligible,
        is_reusable=reusable,
        build_input_fingerprint=functools.partial(_fingerprint, originals["build_input_fingerprint"]),
    )
    for fn in replacements.values():
        fn.fsdp_compile_checks = True
    with patched(*((variables, name, fn) for name, fn in replacements.items())):
        yield


RETURNS_SUBCLASS = (
    "returns a DTensor or another tensor subclass ({kind}) that its region cannot hand back as its local tensor (in a "
    "dict, or from a block passed in itself), and torch 2.13's invoke_subgraph hands back as a plain tensor: each "
    "block is traced as itself and inlined, where it stays one"
)


def _returns_subclass(args, kwargs) -> str | None:
    """The tensor subclass (DTensor) a trace ``save_reuse_entry`` would record returns, if any (see ``reuse_checked``;
    unrecorded, each call is traced as itself, and ``passes/regions.py`` inlines it)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    body_r = kwargs.get("body_r", args[7] if len(args) > 7 else None)  # what the region returns (a tensor, a tuple)
    for vt in getattr(body_r, "items", [body_r]):
        proxy = getattr(vt, "proxy", None)
        value = proxy.node.meta.get("example_value") if proxy is not None else None
        if is_traceable_wrapper_subclass(value):
            return type(value).__name__
    return None


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
        # a DTensor's mesh (capture/boundary.py): torch's gen_schema takes from_local's detach_ of an input's view
        # for an input mutation ("NYI: Functionalize rule for custom_function_call"); ours, from ATen, does not
        elif type(o).__name__ in ("DeviceMesh", "FakeScriptObject"):
            out.append(("mesh", id(getattr(o, "real_obj", o))))
        else:
            return None
    return tuple(out)


@contextlib.contextmanager
def subgraphs_donate_nothing():
    """While Inductor compiles one of our graphs: a region's subgraph has no donated inputs.

    Inductor lowers a region's body with ``SubgraphLowering``, whose ``GraphLowering.__init__`` takes
    ``bw_donated_idxs`` from the tracing context: the donated inputs of the enclosing backward graph.
    torch 2.13 then applies those indices to the subgraph's own placeholders, so a subgraph input that the
    caller still owns (a region's incoming gradient) can be taken for a donated buffer and overwritten
    with the region's output, while the caller, seeing no alias, reuses that input's storage after the
    call. On fsdp_compile.models' 2-layer Llama this zeroed the embedding's incoming gradient before the
    embedding backward read it: its gradient was off by 0.19, every other one exact
    (``tests/test_ops.py::test_regions_under_inductor_two_layers``); 1, 3 or 4 layers escaped only because
    the indices fell elsewhere. The enclosing graph keeps its own donations."""
    from torch._inductor.graph import SubgraphLowering

    original = SubgraphLowering.__init__

    def __init__(self, parent, *args, **kwargs):
        original(self, parent, *args, **kwargs)
        self.bw_donated_idxs = None

    with patched((SubgraphLowering, "__init__", __init__)):
        yield


def _aliased_inputs(body) -> list[tuple[int, ...]]:
    """Per output of a lowered region body (a ``SubgraphLowering`` that has run): the indices of the body's
    inputs whose storage that output is, or views (an input returned as is, a ``reinterpret_tensor`` of
    one, or an aliasing kernel's output over one, followed transitively)."""
    from torch._inductor import ir

    index = {name: i for i, name in enumerate(body.graph_input_names)}
    result = []
    for out in body.graph_outputs:
        node = out
        while isinstance(node, (ir.TensorBox, ir.StorageBox, ir.BaseView)):
            node = node.data
        try:
            pending = [node.get_name()]
        except (AttributeError, NotImplementedError):  # None, a constant, a symbolic size
            pending = []
        seen: set[str] = set()
        found: set[int] = set()
        while pending:
            name = pending.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in index:
                found.add(index[name])
            buf = body.name_to_buffer.get(name)
            if buf is not None:
                pending.extend(buf.get_inputs_that_alias_output())
        result.append(tuple(sorted(found)))
    return result


def region_aliases_patchable() -> bool:
    """Whether this torch has what ``region_outputs_alias_inputs`` patches."""
    from torch._inductor import ir

    return isinstance(vars(ir.InvokeSubgraph).get("create"), classmethod) and hasattr(
        ir.MultiOutput, "get_inputs_that_alias_output"
    )


@contextlib.contextmanager
def region_outputs_alias_inputs():
    """While Inductor compiles one of our graphs: a region call's outputs that are its inputs (or views of
    them) are known to alias those inputs.

    AOTAutograd partitions a region into a forward body that returns ``(*outputs, *saved)`` and a
    backward body that takes ``saved``; a saved tensor can be one of the forward body's inputs (a block
    saves its input activation for RMSNorm's backward), so the body returns that input as an output.
    Inductor lowers the call (``ir.InvokeSubgraph.create``) to one ``MultiOutput`` per output, each a
    fresh buffer to the caller's scheduler, which declares no alias (``get_inputs_that_alias_output`` is
    empty): the input's buffer is freed at the call, and the wrapper's memory planner may hand its storage
    to a later buffer of the same size while the saved output, the same storage, still waits for the
    backward. On fsdp_compile.models' 2-layer Llama the final norm's output was written over layer 1's
    saved input: every gradient but layer 1's FFN off, by up to 3.7e3 (torch 2.14.1, whose
    ``aten_distributed_optimizations.enable_simple_overlap`` fills in the buffer sizes that the planner's
    peak estimate needs; on torch 2.13 the estimate was 0 and the reuse was never taken, unless
    ``reorder_for_peak_memory`` filled them in, with the same 3.7e3). Here each such ``MultiOutput``
    names the caller's operands it aliases, as Inductor's own aliasing kernels do: the scheduler keeps
    an input alive (and out of the reuse pool) while an output aliasing it lives
    (``tests/test_ops.py::test_regions_under_inductor_two_layers``). Nothing else is changed: an output
    that aliases no input is still a fresh buffer."""
    if not region_aliases_patchable():
        yield
        return
    from torch._inductor import ir

    invoke = ir.InvokeSubgraph
    original_create = vars(invoke)["create"]
    original_aliases = ir.MultiOutput.get_inputs_that_alias_output

    def create(cls, subgraph, *operands):
        outs = original_create.__func__(cls, subgraph, *operands)
        call = next((o.inputs[0] for o in outs if isinstance(o, ir.MultiOutput)), None)
        body = getattr(subgraph, "graph", None)
        if call is None or body is None or len(call.inputs) != len(body.graph_input_names):
            return outs
        for out, aliased in zip(outs, _aliased_inputs(body)):
            if isinstance(out, ir.MultiOutput) and aliased:
                names = []
                for i in aliased:
                    try:
                        names.append(call.inputs[i].get_name())
                    except (AttributeError, NotImplementedError):  # a size, not a buffer
                        pass
                out.fsdp_compile_aliases = tuple(names)
        return outs

    def get_inputs_that_alias_output(self):
        return [*original_aliases(self), *getattr(self, "fsdp_compile_aliases", ())]

    with patched((invoke, "create", classmethod(create)),
                 (ir.MultiOutput, "get_inputs_that_alias_output", get_inputs_that_alias_output)):
        yield
