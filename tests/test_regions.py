"""Regions: each kind of repeated block traced and compiled once (``capture.install_regions``).

Single process, fake process group. Numerics (bitwise against eager ``fully_shard``, with and without
regions) are in the multi-rank parity grid.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_compile as fc
from dist_helpers import fake_process_group
from fsdp_compile.capture import regions as capture_regions
from fsdp_compile._torch._invoke_subgraph import GUARDED_REUSE
from fsdp_compile.passes.regions import SYMBOLIC_FLOAT
from fsdp_compile.report import count_collectives
from models import Llama, LlamaArgs, shard
from parity import step_guards

_invoke_subgraph = torch.ops.higher_order.invoke_subgraph


def _region_calls(gm) -> list[str]:
    return [n.args[0].target for n in gm.graph.nodes if n.target is _invoke_subgraph]


@pytest.fixture
def traces(monkeypatch):
    """Counts Dynamo's traces of a region's body and its stamp-outs of a recorded trace."""
    import torch._dynamo.variables.invoke_subgraph as IS

    counts = {"traces": 0, "stamp_outs": 0}
    trace, stamp = IS.InvokeSubgraphHigherOrderVariable.create_wrapped_node, IS.stamp_out_subgraph

    def counted_trace(self, *a, **k):
        counts["traces"] += 1
        return trace(self, *a, **k)

    def counted_stamp(*a, **k):
        counts["stamp_outs"] += 1
        return stamp(*a, **k)

    monkeypatch.setattr(IS.InvokeSubgraphHigherOrderVariable, "create_wrapped_node", counted_trace)
    monkeypatch.setattr(IS, "stamp_out_subgraph", counted_stamp)
    return counts


@pytest.fixture
def schemas(monkeypatch):
    """Every invoke_subgraph schema we answer from a graph at hand (regions.py's ATen trace of a body, or
    AOTAutograd's ATen forward and backward parts of a region) checked equal to the one torch's gen_schema
    traces the subgraph for; the identifiers answered, in order. Torch's own gen_schema, called for any
    other subgraph, is counted under ``None``."""
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    from fsdp_compile._torch import _invoke_subgraph as IS

    hop = type(invoke_subgraph)
    torchs = hop.gen_schema
    aten_form, schema_from_aten = IS.aten_form, IS.schema_from_aten
    asked, answered = [], []

    def recording_aten_form(subgraph):
        asked.append(subgraph)
        return aten_form(subgraph)

    def checked_schema(op, aten, identifier, operands):
        ours = schema_from_aten(op, aten, identifier, operands)
        assert str(ours) == str(torchs(op, asked[-1], identifier, *operands)), identifier
        answered.append(identifier)
        return ours

    def counted_torchs(op, *args, **kwargs):
        answered.append(None)
        return torchs(op, *args, **kwargs)

    monkeypatch.setattr(IS, "aten_form", recording_aten_form)
    monkeypatch.setattr(IS, "schema_from_aten", checked_schema)
    monkeypatch.setattr(hop, "gen_schema", counted_torchs)
    yield answered
    assert hop.gen_schema is counted_torchs  # torch's class as it was after our call


def test_a_block_is_traced_once(traces, schemas):
    """Four Llama blocks: Dynamo traces the block's body once and stamps it out three times; the graph
    calls one subgraph four times, with every all-gather and reduce-scatter at top level."""
    counts = traces
    with fake_process_group(2):
        torch.manual_seed(0)
        m = Llama(LlamaArgs(n_layers=4))
        compiled = fc.compile(shard(m, m.layers), backend="aot_eager", bucket="fsdp_group")
        compiled(torch.randint(0, 256, (2, 16))).sum().backward()
    assert counts == {"traces": 1, "stamp_outs": 3}
    # the schemas of the region, its forward part and its backward part, one per operand layout (10 asked
    # for), come from graphs at hand: torch traces none of them again
    assert schemas == ["subgraph_0", "fw_subgraph_0", "bw_subgraph_0_0"], schemas
    assert not any(b.forward.fsdp_compile_passes_block for b in m.layers)  # equal attributes: one template
    assert _region_calls(compiled.captured.dynamo[0]) == ["subgraph_0"] * 4
    assert count_collectives(compiled.captured.dynamo) == {"all_gathers": 0, "reduce_scatters": 0, "all_reduces": 0}
    assert count_collectives(compiled.captured.forward)["all_gathers"] == 5  # the unshards, decomposed at top level


def test_schemas_of_a_checkpointed_block_equal_torchs(schemas):
    """A region holding a checkpoint (checkpoint_wrapper blocks): its body nests a higher-order op."""
    from parity import Case, build

    with fake_process_group(2):
        compiled = fc.compile(build(Case(model="llama_ac")), backend="aot_eager")
        compiled(torch.randint(0, 256, (2, 16))).sum().backward()
    assert compiled.regions()[0]["region"], compiled.regions()
    assert {"subgraph_0", "fw_subgraph_0", "bw_subgraph_0_0"} <= set(schemas), schemas


@pytest.mark.slow
@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_forward_kept(reshard):
    """A region's forward would hand its gathered parameters to its backward as saved values; the recompute
    pass gives the backward the top-level ones, so resharded blocks are gathered again in backward, as
    eager FSDP2 and the model compiled without regions do (one re-gather per resharded block, one
    reduce-scatter per FSDP group: test_parity_multirank.py's test_collectives_like_eager)."""
    with fake_process_group(2):
        torch.manual_seed(0)
        m = Llama(LlamaArgs(n_layers=3))
        shard(m, m.layers, root_kwargs={"reshard_after_forward": False}, reshard_after_forward=reshard)
        compiled = fc.compile(m, backend="aot_eager", bucket="fsdp_group", reorder=False)
        compiled(torch.randint(0, 256, (2, 16))).sum().backward()
    assert compiled.regions()[0]["region"], compiled.regions()  # the blocks ran as one region
    counts = count_collectives(compiled.captured.backward)
    assert counts == {"all_gathers": 3 if reshard else 0, "reduce_scatters": 4, "all_reduces": 0}
    # the region's backward takes each Linear weight as it was gathered, not as t(t(weight)) rebuilt at top level
    # (14 more nodes per block in the joint graph, and a top-level partition 3x as long at 12 HF layers)
    t, region = torch.ops.aten.t.default, torch.ops.higher_order.invoke_subgraph
    operands = [a for gm in compiled.captured.backward for n in gm.graph.find_nodes(op="call_function", target=region)
                for a in n.args[2:] if isinstance(a, torch.fx.Node)]
    assert operands and not [a for a in operands if a.target is t and a.args[0].target is t], operands


class Scaled(nn.Module):
    """A block that reads a per-instance attribute in forward."""

    def __init__(self, k: float):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.k = k

    def forward(self, x):
        return self.lin(x) * self.k


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.same = nn.ModuleList(Scaled(1.0) for _ in range(2))
        self.differ = nn.ModuleList(Scaled(float(k)) for k in (2, 3))
        self.wide = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)) for _ in range(2))
        self.lonely = nn.Linear(8, 8)

    def forward(self, x):
        for block in [*self.same, *self.differ, *self.wide, self.lonely]:
            x = block(x)
        return x


@pytest.fixture
def gloo_world_1():
    """A real process group of one rank (the fake one moves no data: numbers would be garbage)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_which_blocks_share_a_region(gloo_world_1):
    """Same class, shapes and dtypes: one region per kind. Blocks whose attributes differ pass themselves
    in (Dynamo traces each and keeps what differs apart); blocks whose inner hooks differ (one has a hook the
    other lacks) are inline, and say why; a block alone gets none."""
    if True:
        torch.manual_seed(0)
        m = Mixed()
        m.wide[1][0].register_forward_hook(lambda *a: None)
        blocks = [*m.same, *m.differ, *m.wide, m.lonely]
        shard(m, blocks)
        compiled = fc.compile(m, backend="aot_eager")
        assert capture_regions.find_repeated_blocks(m, compiled.plan) == [
            ["same.0", "same.1", "differ.0", "differ.1"], ["wide.0", "wide.1"]]
        x = torch.randn(4, 8)
        with torch.no_grad():
            expected = m(x)  # eager FSDP2
        assert torch.equal(compiled(x), expected)  # each block's own k, not the first block's
        why = compiled.regions()[1]["why"]
        assert "hooks inside 'wide.1' (0._forward_hooks)" in why, why
        # the ks differ: one region function, each block passed in (and traced as itself)
        forwards = [b.forward for b in (*m.same, *m.differ)]
        assert len({f.fsdp_compile_region for f in forwards}) == 1
        assert all(f.fsdp_compile_passes_block for f in forwards)


def _hf_llama_step(use_cache: bool):
    """A 3-layer HF Llama, its layers sharded, compiled under ``aot_eager``, one step on the fake process
    group: ``(model, compiled)``."""
    transformers = pytest.importorskip("transformers")
    with fake_process_group(2):
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
        )
        m = transformers.LlamaForCausalLM(cfg)
        shard(m, m.model.layers)
        compiled = fc.compile(m, backend="aot_eager")
        ids = torch.randint(0, 512, (2, 16))
        compiled(input_ids=ids, labels=ids, use_cache=use_cache).loss.backward()
    return m, compiled


@pytest.mark.parametrize("use_cache", [False, pytest.param(True, marks=pytest.mark.slow)])  # True: out of the fast tier
def test_hf_llama_layers_share_a_region(traces, schemas, use_cache):
    """HF decoder layers each carry their own layer_idx, so each is passed in. Without a KV cache the first
    layer's trace is stamped out for the others (it reads no layer_idx); a cache's update reads it and
    writes the cache (a side effect, no reuse), so each layer is traced, into one subgraph all the same."""
    m, compiled = _hf_llama_step(use_cache)
    assert all(b.forward.fsdp_compile_passes_block for b in m.model.layers)
    reused = not use_cache and GUARDED_REUSE  # torch 2.13 only
    assert traces == ({"traces": 1, "stamp_outs": 2} if reused else {"traces": 3, "stamp_outs": 0})
    # the decoder layers are called with keyword arguments
    assert _region_calls(compiled.captured.dynamo[0]) == ["subgraph_0"] * 3
    assert None not in schemas and "bw_subgraph_0_0" in schemas, schemas  # passed-in blocks too


@pytest.mark.parametrize("use_cache", [False, True])
def test_fingerprint_equals_torchs(monkeypatch, use_cache):
    """Dynamo fingerprints each region call to look up a recorded trace. Where the call is plain (keyword
    arguments, tuples of tensors: an HF decoder layer's), ours walks it in Python instead of tracing pytree:
    the same leaves (the very same variables, realized), tags, sources and treespec as torch's path. A call
    holding anything else (a KV cache object) goes to torch's path, as every call does on a torch other
    than 2.13 (``GUARDED_REUSE``)."""
    import torch._dynamo.variables.invoke_subgraph as IS

    from fsdp_compile._torch import _invoke_subgraph

    ours = _invoke_subgraph._fingerprint
    walked, handed_on = [], []

    def checked(original, tx, fn_args_vt, kwargs):
        def torchs(*args):
            handed_on.append(1)
            return original(*args)

        mine = ours(torchs, tx, fn_args_vt, kwargs)
        theirs = IS.build_fingerprint_with_pytree(tx, fn_args_vt, kwargs)
        assert (mine.treespec, mine.has_unknown, mine.arg_sources) == (theirs.treespec, theirs.has_unknown, theirs.arg_sources)
        assert [(tag, id(vt)) for tag, vt in mine.flat_vts] == [(tag, id(vt)) for tag, vt in theirs.flat_vts]
        walked.append(1)
        return mine

    monkeypatch.setattr(_invoke_subgraph, "_fingerprint", checked)
    _hf_llama_step(use_cache)
    assert len(walked) == 3  # every region call, each layer's
    assert len(handed_on) == (3 if use_cache or not GUARDED_REUSE else 0)  # a cache object: torch's path


def test_a_trace_dynamo_cannot_record_is_not_reused(monkeypatch, traces, gloo_world_1):
    """Where torch fails to record a trace for reuse (here made to), each block is traced as itself."""
    import torch._dynamo.variables.invoke_subgraph as IS

    def fails(*a, **k):
        raise AssertionError("Freevar has no source")

    monkeypatch.setattr(IS, "save_reuse_entry", fails)
    torch.manual_seed(0)
    m = Mixed()
    shard(m, [*m.same, *m.differ, *m.wide, m.lonely])
    compiled = fc.compile(m, backend="aot_eager")
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = m(x)  # eager FSDP2
    assert torch.equal(compiled(x), expected)
    assert IS.save_reuse_entry is fails  # torch's module as it was
    assert traces == {"traces": 6, "stamp_outs": 0}  # 5 traces and 1 stamp-out without the failure


class _Indexed(nn.Module):
    def __init__(self, i: int):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.index, self.k = i, 1.0

    def forward(self, x):
        return self.lin(x) * self.k


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.k = 1.0

    def forward(self, x):
        return self.lin(x) * self.k


class _SetsBlockAttributes(nn.Module):
    def __init__(self, indexed: bool = True):
        super().__init__()
        self.blocks = nn.ModuleList(_Indexed(i) if indexed else _Scaled() for i in range(3))

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            block.k = float(i + 1)  # written in the forward, before the block runs
            x = block(x)
        return x


@pytest.mark.parametrize("indexed", [True, False])
def test_a_block_written_in_the_forward_runs_as_itself(traces, gloo_world_1, indexed):
    """Dynamo reads an attribute written earlier in the same trace from that write, without a guard; reusing
    the first block's trace would scale every block by its k. Blocks passed in (their indices differ) are
    each traced as themselves; blocks of a template region (all attributes equal before the step) whose
    written value differs from the template's run inline."""
    torch.manual_seed(0)
    m = _SetsBlockAttributes(indexed)
    shard(m, list(m.blocks))
    compiled = fc.compile(m, backend="aot_eager")
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = m(x)  # eager FSDP2
    assert torch.equal(compiled(x), expected)
    # the template region: only the template itself (the others inline)
    assert traces == ({"traces": 3, "stamp_outs": 0} if indexed else {"traces": 1, "stamp_outs": 0})


class _SetsLaterBlocks(nn.Module):
    """Writes the blocks after the first (the template) in its forward: to the template's value, or another."""

    def __init__(self, k: float):
        super().__init__()
        self.blocks = nn.ModuleList(_Scaled() for _ in range(3))
        self.written = k

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i:
                block.k = self.written
            x = block(x)
        return x


@pytest.mark.parametrize("k", [1.0, 2.0])
def test_attributes_written_in_the_forward_and_changed_between_steps(traces, gloo_world_1, k):
    """Blocks written in the forward to the template's value share its trace (``_written_apart``); written to
    another, they run inline. Between steps, the value written changes, then the template's own k twice:
    Dynamo's automatic dynamic then traces it as a SymFloat, which torch 2.13's invoke_subgraph takes no operand
    of (before, that recompile failed inside Dynamo: "lift_tracked_freevar_to_input should not be called on root
    SubgraphTracer", now the template's own call reads its attributes before the region's body does); that graph
    runs the blocks inline, and says so. Every step equal to eager FSDP2."""
    torch.manual_seed(0)
    m = _SetsLaterBlocks(k)
    shard(m, list(m.blocks))
    compiled = fc.compile(m, backend="aot_eager")
    x = torch.randn(4, 8)

    def check():
        with torch.no_grad():
            expected = m(x)  # eager FSDP2
        assert torch.equal(compiled(x), expected)

    check()
    # k 1.0: the second block's input requires grad, the first's not (another reuse key), the third's trace stamped
    assert traces == ({"traces": 2, "stamp_outs": 1} if k == 1.0 else {"traces": 1, "stamp_outs": 0})
    m.written = 3.0  # the later blocks now differ from the template
    check()
    m.blocks[0].k = 3.0  # the template's k (which the region's body reads) changed between steps
    check()
    m.blocks[0].k = 5.0
    check()
    assert compiled.regions()[0]["why"] == SYMBOLIC_FLOAT


class _IndexedStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Indexed(i) for i in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_blocks_passed_in_whose_float_attribute_changes_between_steps(gloo_world_1):
    """Blocks that differ in an attribute (passed into their region themselves) whose float attribute, read in
    forward, changes on all of them between steps: after the second change Dynamo takes it as an unspecialized
    input (a tensor of the graph), and a trace stamped out for the next block re-read that block's as a constant
    (AOTAutograd: "'float' object has no attribute 'item'"). Such a trace is not recorded
    (``_invoke_subgraph._reads_number_as_tensor``): every step equal to eager FSDP2."""
    torch.manual_seed(0)
    m = _IndexedStack()
    shard(m, list(m.blocks))
    compiled = fc.compile(m, backend="aot_eager")
    x = torch.randn(4, 8)
    for k in (1.0, 3.0, 4.0):
        for block in m.blocks:
            block.k = k
        with torch.no_grad():
            expected = m(x)  # eager FSDP2
        assert torch.equal(compiled(x), expected)


# --- region admission (passes/regions.py), on Dynamo graphs without FSDP -----------------------------------


def _dynamo_graph(fn, *args):
    """Dynamo's graph of ``fn`` (fullgraph), as our backend receives it, with the fake mode of its inputs."""
    from torch._guards import detect_fake_mode

    seen = []

    def backend(gm, example_inputs):
        seen.append((gm, detect_fake_mode(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen[0]


def test_admission_inlines_random_ops_only_under_checkpoint():
    """One region called twice, once inside ``torch.utils.checkpoint``: only that call is inlined (its
    recompute would draw new random numbers); the other stays a region."""
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from fsdp_compile.passes.regions import RANDOM_UNDER_CHECKPOINT, admit_regions

    @torch.compiler.nested_compile_region
    def body(x, w):
        return F.dropout(x @ w, 0.5, True)

    def fn(x, w):
        return checkpoint(body, x, w, use_reentrant=False) + body(x, w)

    gm, fake_mode = _dynamo_graph(fn, torch.randn(4, 4, requires_grad=True), torch.randn(4, 4))
    decisions = admit_regions(gm, fake_mode)
    assert [d.why for d in decisions] == [RANDOM_UNDER_CHECKPOINT, None], decisions
    (ckpt,) = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.tag_activation_checkpoint]
    ckpt_body = getattr(gm, ckpt.args[0].target).graph
    assert not any(n.target is _invoke_subgraph for n in ckpt_body.nodes)  # the body was copied in ...
    assert any(n.target is torch.nn.functional.dropout for n in ckpt_body.nodes)  # ... dropout and all
    assert sum(n.target is _invoke_subgraph for n in gm.graph.nodes) == 1  # the other call: still a region


def test_admission_owns_a_buffer_it_mutates():
    """A body that updates a buffer in place (an MoE token counter) and reads it after the update: each call
    stays a region, working on its own copy of the buffer, and writes the new value back into the buffer after
    the call, at top level. Trained through AOTAutograd: outputs, gradients and the buffers' final values
    equal eager's, over two steps; the buffer that is only read gets no copy."""
    from torch._dynamo.backends.debugging import aot_eager
    from torch._guards import detect_fake_mode

    from fsdp_compile.passes.regions import admit_regions

    @torch.compiler.nested_compile_region
    def body(x, w, counter, bias):
        before = counter.sum()
        with torch.no_grad():
            counter.add_((x > 0).sum(0))
        return (x @ w + bias) * counter + before

    def fn(x, w, c0, c1, bias):
        return (body(torch.tanh(body(x, w, c0, bias)), w, c1, bias) * torch.arange(4.0)).sum()

    seen = []

    def backend(gm, example_inputs):
        seen.append((admit_regions(gm, detect_fake_mode(example_inputs)), gm))
        return aot_eager(gm, example_inputs)

    def train(f):
        torch.manual_seed(0)
        x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
        c0, c1, bias = torch.zeros(4), torch.ones(4), torch.randn(4)
        losses = []
        for _ in range(2):  # the update between forward and backward would fail eager's saved-tensor check
            losses.append(f(x, w, c0, c1, bias))
            losses[-1].backward()
        return [*losses, x.grad, w.grad, c0, c1, bias]

    torch._dynamo.reset()
    eager, compiled = train(fn), train(torch.compile(fn, backend=backend, fullgraph=True))
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled, strict=True)), (eager, compiled)
    (decisions, gm), = seen
    assert [d.why for d in decisions] == [None, None], decisions
    assert _region_calls(gm) == ["subgraph_0", "subgraph_0"]
    body_graph = gm.subgraph_0.graph
    assert [n.target for n in body_graph.nodes if n.op == "call_method" and n.target == "clone"] == ["clone"]
    writes = [n for n in gm.graph.nodes if n.target == "copy_"]
    assert [w.args[0].op for w in writes] == ["placeholder"] * 2  # c0, c1: the graph's inputs, in place


def test_admission_inlines_input_mutation():
    """A body that mutates an input that is no buffer (an activation computed in the graph, or an input that
    needs a gradient) in place: inlined, and the graph still runs it."""
    from fsdp_compile.passes.regions import MUTATES_INPUT, admit_regions

    @torch.compiler.nested_compile_region
    def body(x):
        x.mul_(2)
        return x + 1

    def fn(x, y):
        return body(x * 1) + body(y.exp())

    gm, fake_mode = _dynamo_graph(fn, torch.randn(3, 4), torch.randn(3, 4))
    decisions = admit_regions(gm, fake_mode)
    assert [d.why for d in decisions] == [MUTATES_INPUT, MUTATES_INPUT]
    assert not any(n.target is _invoke_subgraph for n in gm.graph.nodes)
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    (out,) = gm(x, y)
    assert torch.equal(out, (x * 1 * 2 + 1) + (y.exp() * 2 + 1))


def test_admission_refuses_every_region_when_told():
    """``refuse`` (the backend passes it under Inductor on a torch other than 2.13, where region calls
    train wrong: 2.14.1) inlines every call, nested ones under a checkpoint too, each with that reason;
    the graph computes what it did."""
    from torch.utils.checkpoint import checkpoint

    from fsdp_compile.passes.regions import INDUCTOR_REGIONS_UNSOUND, admit_regions

    @torch.compiler.nested_compile_region
    def body(x, w):
        return torch.tanh(x @ w)

    def fn(x, w):
        return checkpoint(body, x, w, use_reentrant=False) + body(x, w)

    x, w = torch.randn(4, 4), torch.randn(4, 4)
    gm, fake_mode = _dynamo_graph(fn, x, w)
    decisions = admit_regions(gm, fake_mode, refuse=INDUCTOR_REGIONS_UNSOUND)
    assert [d.why for d in decisions] == [INDUCTOR_REGIONS_UNSOUND] * 2, decisions
    assert not any(n.target is _invoke_subgraph for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
                   for n in m.graph.nodes)
    (out,) = gm(x, w)
    assert torch.allclose(out, 2 * torch.tanh(x @ w))


def test_complex_region_trains():
    """Complex RoPE inside a region saves a conjugate view for the backward region: torch 2.13 has no
    Conjugate kernel for invoke_subgraph; ours (fsdp_compile._torch._invoke_subgraph) resolves it, bitwise."""
    from fsdp_compile._torch import _invoke_subgraph

    _invoke_subgraph.register()

    @torch.compiler.nested_compile_region
    def body(x, freqs):
        return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * freqs).flatten(-2)

    def fn(x, freqs):
        return body(body(x, freqs), freqs)

    freqs = torch.polar(torch.ones(4), torch.arange(4.0))
    x = torch.randn(3, 8, requires_grad=True)
    fn(x, freqs).pow(2).sum().backward()
    expected, x.grad = x.grad, None
    torch._dynamo.reset()
    torch.compile(fn, backend="aot_eager", fullgraph=True)(x, freqs).pow(2).sum().backward()
    assert torch.equal(x.grad, expected)


def test_a_block_call_goes_in_flat():
    """A block's call reaches its region as leaves and a constant string (Dynamo's fingerprint fast path),
    and the region rebuilds exactly the call; a call with any other value goes in through pytree."""
    t, u = torch.zeros(1), torch.ones(2)
    calls = [
        ((t,), {}),  # nn.Sequential: one positional
        ((), {}),
        ((t, (t, u)), {"mask": None, "rope": (t, u), "sizes": [1, 2], "cache": False, "name": "x"}),
    ]
    for args, kwargs in calls:
        spec, operands = capture_regions._flatten_call((u, t), args, kwargs)
        assert isinstance(spec, str) and all(isinstance(o, capture_regions._LEAVES) for o in operands)
        tensors, args2, kwargs2 = capture_regions._unflatten_call(spec, 2, operands)
        assert tensors == (u, t) and args2 == args and kwargs2 == kwargs and type(kwargs2["rope"] if kwargs else ()) is tuple
    odd = ((t,), {"cache": object()})
    spec, operands = capture_regions._flatten_call((u,), *odd)
    assert spec is None and capture_regions._unflatten_call(spec, 1, operands) == ((u,), *odd)


def test_the_reuse_key_of_a_block_call():
    """A template region's trace is reused for calls with the same structure and the same dtypes, ranks and
    requires_grad of their tensors; any of these differing keys it apart, nested calls included."""
    t, u = torch.zeros(1), torch.ones(2, 3)

    def key(tensors, args, kwargs):
        spec, operands = capture_regions._flatten_call(tensors, args, kwargs)
        return capture_regions._reuse_key(spec, *operands)  # as the region is called

    base = key((u, t), (t,), {"mask": None})
    assert key((u + 1, t + 1), (t + 1,), {"mask": None}) == base
    assert key((u, t), (t.double(),), {"mask": None}) != base
    assert key((u, t), (t.reshape(1, 1),), {"mask": None}) != base
    assert key((u, t.clone().requires_grad_()), (t,), {"mask": None}) != base
    assert key((u, t), (t,), {"mask": None, "cache": False}) != base
    assert key((u, t), (), {"x": t, "mask": None}) != base  # the same leaves, another structure
    nested = {"cache": {"k": t}}
    assert key((u,), (t,), nested) == key((u,), (t,), {"cache": {"k": t}}) != key((u,), (t,), {"cache": {"k": t.double()}})


def _tp_blocks(n: int = 2):
    """``n`` blocks (Linear -> GELU -> Linear) parallelized by ``parallelize_module`` on a 1-rank tp mesh, each
    with TP's hooks on its Linears; the mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    blocks = [nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(n)]
    for b in blocks:
        parallelize_module(b, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return blocks, mesh


def _layout_hook(placement, module, args):
    return args


def test_tp_hooks_compared_per_kind(gloo_world_1):
    """TP's hooks (a lambda around a functools.partial of its style's function, per Linear) are the same in
    every block: the template's trace serves them all. A hook holding another value, or only on one block,
    is not provably the same: the kind stays inline, naming where."""
    import functools

    from torch.distributed.tensor import Shard

    from fsdp_compile.capture import block_hooks

    blocks, mesh = _tp_blocks(3)
    fqns = ["b.0", "b.1", "b.2"]
    assert block_hooks.hooks_reason(blocks, fqns) is None
    for b, dim in zip(blocks, (1, 1, 0)):  # equal partials of one function, but b.2's holds another placement
        b[0].register_forward_pre_hook(functools.partial(_layout_hook, Shard(dim)))
    assert "'b.2' (0._forward_pre_hooks)" in block_hooks.hooks_reason(blocks, fqns)
    blocks[1][2].register_forward_hook(lambda *a: None)
    assert "'b.1' (2._forward_hooks)" in block_hooks.hooks_reason(blocks, fqns)
    # a block's own hooks run around the region call and may change what it reads (transformers' EP experts)
    blocks[2].register_forward_pre_hook(lambda *a: None)
    assert "'b.2' has hooks of its own" in block_hooks.hooks_reason(blocks, fqns)
    blocks[0].forward = functools.partial(type(blocks[0]).forward, blocks[0])  # as transformers' EP sets ep_forward
    assert "'b.0' runs a forward set on it" in block_hooks.hooks_reason(blocks, fqns)


def test_named_tuples_in_hooks_compared_by_value(gloo_world_1):
    """A hook's NamedTuple (each block's own ``LinearMMConfig`` in torchao's ``PrepareFloat8ModuleInput``) is
    compared by its type and fields, not by identity: equal ones in every block keep the kind one region."""
    import functools
    from typing import NamedTuple

    from fsdp_compile.capture import block_hooks

    class Config(NamedTuple):
        emulate: bool
        scale: float

    class Other(NamedTuple):
        emulate: bool
        scale: float

    blocks, _ = _tp_blocks(3)
    fqns = ["b.0", "b.1", "b.2"]
    configs = [Config(True, 1.0), Config(True, 1.0), Other(True, 1.0)]  # equal fields, b.2's another type
    for b, config in zip(blocks, configs):
        b[0].register_forward_pre_hook(functools.partial(_layout_hook, config))
    assert block_hooks.hooks_reason(blocks[:2], fqns[:2]) is None
    assert "'b.2' (0._forward_pre_hooks)" in block_hooks.hooks_reason(blocks, fqns)


def test_dtensor_crosses_the_boundary_as_its_local_tensor(gloo_world_1):
    """Outside, a DTensor parameter goes in as ``to_local()``; inside, ``rebuilt`` gives a DTensor of its spec
    whose backward hands a Partial gradient back redistributed to the parameter's placements (what
    ``forward._as_dtensor``'s backward does inline), and a Replicate one straight through."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from fsdp_compile._param_specs import ParallelSpec
    from fsdp_compile.capture import boundary

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    spec = ParallelSpec(mesh, (Replicate(),), (4, 3), (3, 1))
    param = DTensor.from_local(torch.randn(4, 3, requires_grad=True), mesh, [Replicate()], run_check=False)
    specs = (spec, None)
    local, plain = boundary.flattened((param, torch.ones(2)), specs)
    assert type(local) is torch.Tensor and type(plain) is torch.Tensor
    inside, same = boundary.rebuilt((local.detach().requires_grad_(), plain), specs)
    assert isinstance(inside, DTensor) and inside.placements == (Replicate(),) and same is plain
    assert inside.shape == (4, 3) and inside.stride() == (3, 1)
    g = torch.randn(4, 3)
    for placement in (Replicate(), Partial()):
        leaf = local.detach().requires_grad_()
        (rebuilt,) = boundary.rebuilt((leaf,), (spec,))
        rebuilt.backward(DTensor.from_local(g, mesh, [placement], run_check=False))
        assert type(leaf.grad) is torch.Tensor and torch.equal(leaf.grad, g)


@pytest.mark.slow
def test_tp_blocks_share_a_region(gloo_world_1):
    """fsdp_compile.models' Llama with torchtitan's TP plan (sequence-parallel norms, column/row-parallel
    projections, TP's hooks inside each block) on a 1 x 1 (dp, tp) mesh: the blocks are one region, the DTensor
    parameters crossing its boundary as local tensors, and the step equals eager FSDP2's and the inline
    compile's. (1 rank moves no data: the placements' collectives are checked bitwise on 4 ranks,
    tests/test_tp_multirank.py.)"""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel

    from fsdp_compile.models import tensor_parallel

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    models = []
    for _ in range(3):
        torch.manual_seed(0)
        m = tensor_parallel(Llama(LlamaArgs(n_layers=2)), mesh["tp"], loss_parallel=True)
        for layer in m.layers:
            fully_shard(layer, mesh=mesh["dp"])
        models.append(fully_shard(m, mesh=mesh["dp"]))
    compiled = [fc.compile(m, backend="aot_eager", regions=r) for m, r in zip(models[1:], (True, False))]
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for f in (models[0], *compiled):
        with loss_parallel():
            loss = torch.nn.functional.cross_entropy(f(x).flatten(0, 1), x.flatten())
            loss.backward()
        losses.append(loss.full_tensor())
    assert compiled[0].regions() == [{"blocks": ["layers.0", "layers.1"], "region": True, "why": None}]
    assert torch.equal(losses[0], losses[1]) and torch.equal(losses[0], losses[2])
    for m in models[1:]:
        for p, q in zip(models[0].parameters(), m.parameters()):
            assert torch.equal(p.grad.to_local(), q.grad.to_local())


@pytest.mark.slow  # out of the fast tier (its budget); the full suite runs it
def test_what_a_tp_llama_step_guards(gloo_world_1):
    """A compiled step guards each block's own state (its shards, the dicts its parameters are swapped into, the
    attributes its region's trace may read), not what is fixed for the life of its code object: the parameters'
    names, their TP layouts, the attributes' names (``capture.forward.constants``). Before, those were 236 of the
    401 guards each added block of this TP Llama cost, checked at every call and built at every compile."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import loss_parallel

    from fsdp_compile.models import tensor_parallel

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    guards = []
    for n_layers in (2, 3):
        torch._dynamo.reset()
        torch.manual_seed(0)
        m = tensor_parallel(Llama(LlamaArgs(n_layers=n_layers)), mesh["tp"], loss_parallel=True)
        for layer in m.layers:
            fully_shard(layer, mesh=mesh["dp"])
        compiled = fc.compile(fully_shard(m, mesh=mesh["dp"]), backend="aot_eager")
        x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
        with loss_parallel():
            torch.nn.functional.cross_entropy(compiled(x).flatten(0, 1), x.flatten()).backward()
        guards.append(step_guards(compiled))
        assert compiled.regions()[0]["region"]
    for constant in ("== 'layers.", "== 'training'", "== 'eps'", "in_features"):  # names
        assert constant not in guards[1], [line for line in guards[1].splitlines() if constant in line][:3]
    for field in (".placements", ".stride", ".dp_dims"):  # TP layouts: the region's, once per kind, not per block
        assert guards[0].count(field) == guards[1].count(field), field
    per_block = len(guards[1].splitlines()) - len(guards[0].splitlines())
    assert per_block < 450, per_block  # printed lines per added block on torch 2.13: 360 (165 guards); 881 before


class _Residual(nn.Module):
    """An embedding then 3 TP blocks that take a Replicate DTensor and return one (their row-parallel output
    stays a DTensor: ``use_local_output=False``), as torchtitan's blocks take and return Shard(1) ones."""

    def __init__(self, mesh):
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        super().__init__()
        self.tp = mesh["tp"]
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8)) for _ in range(3))
        for b in self.blocks:  # mesh["tp"] sliced per block: a new mesh object each time, of the same groups
            parallelize_module(b, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel(use_local_output=False)})

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Replicate

        x = DTensor.from_local(self.inp(x), self.tp, [Replicate()], run_check=False)
        for b in self.blocks:
            x = x + b(x)
        return x.to_local()


def _residual_models(n: int) -> list:
    """``n`` alike ``_Residual`` models, same seed, blocks and root sharded with torch's fully_shard on a 1 x 1
    (dp, tp) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    models = []
    for _ in range(n):
        torch.manual_seed(0)
        m = _Residual(mesh)
        for b in m.blocks:
            fully_shard(b, mesh=mesh["dp"])
        models.append(fully_shard(m, mesh=mesh["dp"]))
    return models


def test_blocks_taking_and_returning_dtensors_share_a_region(gloo_world_1):
    """DTensor activations cross a region's boundary as their local tensors, in and out, their layouts constants
    of the region (``capture/boundary.py``): the blocks are one region, and the step equals eager FSDP2's and the
    inline compile's."""
    models = _residual_models(3)
    compiled = [fc.compile(m, backend="aot_eager", regions=r) for m, r in zip(models[1:], (True, False))]
    x = torch.randn(4, 8)
    losses = [f(x).pow(2).sum() for f in (models[0], *compiled)]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1]) and torch.equal(losses[0], losses[2])
    for m in models[1:]:
        for p, q in zip(models[0].parameters(), m.parameters()):
            assert torch.equal(p.grad.to_local(), q.grad.to_local())
    assert compiled[0].regions() == [{"blocks": ["blocks.0", "blocks.1", "blocks.2"], "region": True, "why": None}]
    assert _region_calls(compiled[0].captured.dynamo[0]) == ["subgraph_0"] * 3  # one body, stamped out


@pytest.mark.parametrize("again", [1, 2])
def test_dtensor_blocks_under_dynamic_shapes_run_inline(gloo_world_1, again):
    """A new batch size recompiles with dynamic shapes (automatic dynamic), where a DTensor layout's shape is no
    constant (``boundary.symbolic_dtensor_call``): the first trace keeps its region, the dynamic one runs the
    blocks inline, and every step equals eager FSDP2's (before, Dynamo refused the SymInt: a hard error). Run twice
    in one process, on a new process group each time: the second compile interns its own layouts (before, it was
    handed the first one's mesh, for which Dynamo had no source: "NameError: name 'sub_layout_0' is not defined")."""
    models = _residual_models(2)
    compiled = fc.compile(models[1], backend="aot_eager")
    for n in (4, 6, 9):
        x = torch.randn(n, 8)
        losses = [f(x).pow(2).sum() for f in (models[0], compiled)]
        for loss in losses:
            loss.backward()
        assert torch.equal(losses[0], losses[1]), n
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(p.grad.to_local(), q.grad.to_local())
    static, dynamic = compiled.captured.dynamo
    assert _region_calls(static) == ["subgraph_0"] * 3 and _region_calls(dynamic) == []
    (kind,) = compiled.regions()  # the recompile's inline blocks are named, not hidden behind "one compiled region"
    assert kind["region"] and kind["inline_in_graphs"] == [1], kind


def test_layout_tables_hold_one_compile(gloo_world_1):
    """The DTensor layouts a region's calls intern (``capture/boundary.py``) are the compile's under way: a second
    model's compile drops the first one's entries (and their meshes) instead of adding to them, and the first model,
    compiled already, still trains like eager FSDP2 after it."""
    from fsdp_compile.capture import boundary

    models = _residual_models(3)
    x = torch.randn(4, 8)
    first = fc.compile(models[1], backend="aot_eager")
    first(x).pow(2).sum().backward()
    held = (len(boundary._LAYOUTS), len(boundary._OUTPUTS))
    assert held[0] > 0 and held[1] > 0
    second = fc.compile(models[2], backend="aot_eager")
    second(x).pow(2).sum().backward()
    assert (len(boundary._LAYOUTS), len(boundary._OUTPUTS)) == held  # before: twice as many
    assert len({key[0] for key in boundary._LAYOUT_IDS}) == 1  # one compile id
    loss = models[0](x).pow(2).sum()
    loss.backward()
    again = first(x).pow(2).sum()
    again.backward()
    assert torch.equal(loss, again)
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(2 * p.grad.to_local(), q.grad.to_local())  # two steps' gradients accumulated
