"""One rank, no copies (issue 50): an FSDP group of one rank gathers and reduce-scatters nothing.

FSDP2 (torch 2.13) issues no collective there: its unshard copies each shard (cast to param_dtype) into the
parameter's all-gather output, and its reduce-scatter copies the packed gradients (cast to reduce_dtype,
divided) into its output and views them out. The compiled graphs keep what changes a value and nothing
else: each unsharded parameter is its local shard (an alias) or one cast of it, each shard gradient the
unsharded one (an alias) or one cast of it, with no copy-in, copy-out, pack, unpack or concatenation, and
train bitwise as eager FSDP2 under ``aot_eager`` (the same casts at the same points). A shard gradient that
would share its memory with another one or with a graph input is copied (``ops._as_shard_grad``): in-place
writes to ``.grad`` (``clip_grad_norm_``, accumulation) must not reach another tensor. A 1-wide FSDP dim
of a 2-D mesh is one rank too: HSDP all-reduces its one packed buffer across the replicas (the multi-rank
test), tensor parallelism keeps its own collectives (the fake process group).
"""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp_compile
from fsdp_compile._annotations import chains, fsdp_meta

_ops = torch.ops.fsdp_compile
# the copies around a collective (kernels/) and the shard gradient copy of ops._as_shard_grad
COPY_OPS = {_ops.all_gather_copy_in.default, _ops.all_gather_copy_out.default, _ops.reduce_scatter_copy_in.default,
            _ops.reduce_scatter_copy_out.default}
CASTS = {torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default}
SAME = torch.ops.aten.as_strided.default  # ops._same: the shard, or the gradient, itself


@pytest.fixture
def gloo_world_1():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def compiled_models(monkeypatch):
    """Every model ``fsdp_compile.compile`` returns while the test runs (parity.run_case compiles its own)."""
    made, compile_ = [], fsdp_compile.compile

    def compile(*args, **kwargs):
        made.append(compile_(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(fsdp_compile, "compile", compile)
    return made


def targets(gm) -> collections.Counter:
    return collections.Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


def check_graphs(compiled, n_params: int, cast: bool) -> dict:
    """The first forward and backward graphs: no collective, no copy op, no concatenation; every node of an
    unshard or gradient chain the tensor itself (fp32) or a cast (mixed precision); one per parameter in the forward,
    one per gradient in the backward."""
    forward, backward = compiled.captured.forward[0], compiled.captured.backward[0]
    out = {}
    for kind, gm in (("forward", forward), ("backward", backward)):
        ts = targets(gm)
        assert not COPY_OPS & set(ts), (kind, {t: ts[t] for t in COPY_OPS & set(ts)})
        assert not any(getattr(t, "namespace", None) == "_c10d_functional" for t in ts), (kind, ts)
        assert ts[torch.ops.aten.cat.default] == 0 and ts[_ops.own_copy.default] == 0, (kind, ts)
        unshard, reduce = chains(gm.graph)
        kinds = collections.Counter(n.target for n in unshard | reduce)
        assert kinds and set(kinds) <= (CASTS if cast else {SAME}), (kind, kinds)
        out[kind] = (len(unshard), len(reduce))
    assert out["forward"] == (n_params, 0), out  # each parameter once: its shard, or its cast
    assert out["backward"][1] == n_params, out  # each gradient once (the rest: reshard_after_forward's recasts)
    return out


@pytest.mark.parametrize("mp", [None, "bf16"])
def test_one_rank_has_no_copies(gloo_world_1, compiled_models, mp):
    """Eager FSDP2 against the compiled step on one rank for three steps (AdamW updates the shards in place
    between them, which the unsharded parameters are), the blocks resharded after forward (re-cast or
    re-read in backward), the root not: bitwise, and the graphs hold no collective and no copy (before: a
    copy-in and a copy-out per unit in the forward, again for the re-gathers, and a pack and an unpack per
    unit's gradients)."""
    import parity

    r = parity.run_case(parity.Case(mp=mp, bucket="auto", reorder=True, steps=3), 0, 1)
    assert r["forward"] == r["backward"] == {"all_gathers": 0, "reduce_scatters": 0, "all_reduces": 0}, r
    assert r["loss_compiled"] == r["loss_eager"], r
    assert max(r["grad_diff"]) == 0.0 and max(r["param_diff"]) == 0.0, r
    assert r["grad_types"] == ["DTensor"]
    (compiled,) = compiled_models
    n_params = len(list(compiled.parameters()))
    check_graphs(compiled, n_params, cast=mp is not None)


@pytest.fixture
def no_compile_caches():
    """A compile that the FX graph or AOTAutograd cache serves skips our passes, so its graphs are not in
    ``captured``: compile afresh."""
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield


@pytest.mark.inductor
def test_one_rank_has_no_copies_under_inductor(gloo_world_1, compiled_models, no_compile_caches):
    """The same under Inductor (its graphs as our passes see them, before its own rewrites): close to eager,
    the shard gradients each in memory of their own."""
    import parity

    r = parity.run_case(parity.Case(backend="inductor", steps=2), 0, 1)
    assert r["forward"] == r["backward"] == {"all_gathers": 0, "reduce_scatters": 0, "all_reduces": 0}, r
    assert max(abs(a - b) for a, b in zip(r["loss_compiled"], r["loss_eager"])) < 1e-5, r
    assert max(r["grad_diff"]) < 1e-4 and max(r["param_diff"]) < 1e-4, r
    (compiled,) = compiled_models
    check_graphs(compiled, len(list(compiled.parameters())), cast=False)


@pytest.mark.slow  # out of the fast tier (its budget); the full suite runs it
def test_one_rank_accumulation_without_sync(gloo_world_1, compiled_models):
    """``set_requires_gradient_sync(False)`` for three micro-batches, then one that syncs, on one rank in bf16
    (FSDP2 keeps the unsharded gradients in the reduce dtype): bitwise as eager FSDP2, and neither the
    no-sync nor the syncing step's graphs copy anything."""
    from test_options_multirank import accumulation_worker

    r = accumulation_worker(0, 1, mp="bf16")
    assert all(le == lc for le, lc in r["losses"]), r["losses"]
    assert max(r["grad_diff"]) == 0.0 and max(r["param_diff"]) == 0.0, r
    assert all(r["none_after_no_sync"]) and r["dynamo_graphs"] == 2, r
    (compiled,) = compiled_models
    assert len(compiled.captured.backward) == 2
    for gm in compiled.captured.forward + compiled.captured.backward:
        ts = targets(gm)
        assert not COPY_OPS & set(ts) and ts[torch.ops.aten.cat.default] == 0 and ts[_ops.own_copy.default] == 0, ts


# --- shard gradients own their memory -------------------------------------------------------------------


class TwinBlock(nn.Module):
    """A Llama block scaled by the sum of two parameters: autograd hands both the same gradient."""

    def __init__(self, args):
        from fsdp_compile.models import Block

        super().__init__()
        self.block = Block(args)
        self.a = nn.Parameter(torch.ones(args.dim))
        self.b = nn.Parameter(torch.full((args.dim,), 0.5))

    def forward(self, x, cache):
        return self.block(x, cache) * (self.a + self.b)


class TwinLlama(nn.Module):
    """TwinBlocks (a region), and at the root a shift added to the logits: its gradient is the output's."""

    def __init__(self):
        from fsdp_compile.models import Llama, LlamaArgs

        super().__init__()
        args = LlamaArgs(n_layers=2)
        self.llama = Llama(args)
        self.llama.layers = nn.ModuleList(TwinBlock(args) for _ in range(args.n_layers))
        self.shift = nn.Parameter(torch.zeros(2, 16, args.vocab))

    def forward(self, tokens):
        return self.llama(tokens) + self.shift


def _twin():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    m = TwinLlama()
    for block in m.llama.layers:
        fully_shard(block)
    fully_shard(m)
    return m


def _shared_grads(model) -> list[list[str]]:
    by_memory = collections.defaultdict(list)
    for name, p in model.named_parameters():
        by_memory[p.grad.to_local().untyped_storage().data_ptr()].append(name)
    return [names for names in by_memory.values() if len(names) > 1]


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_one_rank_shard_gradients_own_their_memory(gloo_world_1, no_compile_caches, backend):
    """``a + b`` in a region block (the region's backward returns one tensor for both, as one output or as
    two) and a root parameter whose gradient is the graph's incoming one: each shard gradient is copied
    where it would share memory, so two micro-batches accumulate into ``.grad`` and ``clip_grad_norm_``
    scales it in place as in eager FSDP2 (bitwise under aot_eager); the other gradients are not copied."""
    eager, model = _twin(), _twin()
    compiled = fsdp_compile.compile(model, backend=backend)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model)]
    tol = 0.0 if backend == "aot_eager" else 1e-5
    for step in range(2):
        for micro in range(2):
            tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(10 * step + micro))
            for m in (eager, compiled):
                F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()
        assert _shared_grads(model) == []
        for m, opt in zip((eager, model), opts):
            torch.nn.utils.clip_grad_norm_(list(m.parameters()), 0.1)
        for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
            assert (pe.grad.to_local() - pc.grad.to_local()).abs().max().item() <= tol, (step, name)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert compiled.regions() == [{"blocks": ["llama.layers.0", "llama.layers.1"], "region": True, "why": None}]
    backward = targets(compiled.captured.backward[0])
    # b's gradient in each block (a's is not copied), and the shift's (the tangent)
    assert backward[_ops.own_copy.default] == 3, backward
    assert not COPY_OPS & set(backward)


# --- all-gather extensions ------------------------------------------------------------------------------


def _bf16_gathered():
    from extensions import Int8Gathered

    class Bf16Gathered(Int8Gathered):
        """One all-gather input, the shard in bfloat16: eager FSDP2 on one rank takes a parameter's first
        input only (torch 2.13's ``wait_for_unshard``), so Int8Gathered's two fail there."""

        def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
            return (self._tensor.to(torch.bfloat16),), (self.qmax,)

        def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
            full = all_gather_outputs[0].to(param_dtype)
            if out is not None:
                out.data.copy_(full)
                return None
            return full, (full,)

        @staticmethod
        def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
            return Bf16Gathered(inner["_tensor"], meta["qmax"])

    return Bf16Gathered


@pytest.mark.parametrize("reshard", [True, False])
def test_one_rank_extensions(gloo_world_1, reshard):
    """Parameters with FSDP2's all-gather extension (every Linear weight gathered as bfloat16) beside plain
    ones: ``fsdp_post_all_gather`` gets the ``fsdp_pre_all_gather`` tensor itself, no buffer; bitwise as
    eager FSDP2 for three steps."""
    from extensions import convert_linears
    from models import Llama, LlamaArgs, shard

    import parity

    cls = _bf16_gathered()

    def build():
        torch.manual_seed(0)
        model = convert_linears(Llama(LlamaArgs(n_layers=2)), cls)
        return shard(model, list(model.layers), reshard_after_forward=reshard)

    eager, model = build(), build()
    compiled = fsdp_compile.compile(model, backend="aot_eager")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model)]
    for step in range(3):
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
        losses = [F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()) for m in (eager, compiled)]
        for loss in losses:
            loss.backward()
        assert losses[0].item() == losses[1].item(), step
        assert parity.max_diff([p.grad for p in eager.parameters()], [p.grad for p in model.parameters()]) == 0.0
        for opt in opts:
            opt.step()
            opt.zero_grad()
        assert parity.max_diff(list(eager.parameters()), list(model.parameters())) == 0.0
    assert {type(p.to_local()).__name__ for p in model.parameters()} == {"Bf16Gathered", "Tensor"}
    assert any(p.extension is not None for g in compiled.plan.groups for p in g.params)
    for gm in (compiled.captured.forward[0], compiled.captured.backward[0]):
        ts = targets(gm)
        assert not COPY_OPS & set(ts) and ts[torch.ops.aten.cat.default] == 0, ts
        assert not any(getattr(t, "namespace", None) == "_c10d_functional" for t in ts), ts


# --- a 1-wide FSDP dim of a 2-D mesh ---------------------------------------------------------------------


# a TP capture (12 s): the fast tier keeps one-rank FSDP (above) and TP (test_tp's per-dim counts)
@pytest.mark.slow
def test_one_wide_fsdp_dim_with_tensor_parallel():
    """A (dp 1, tp 2) mesh on the fake process group: FSDP over one rank issues nothing and copies nothing;
    tensor parallelism's collectives stay."""
    from dist_helpers import fake_process_group
    from fsdp_compile.debug import explain_graphs
    from tp_cases import TPCase, build

    with fake_process_group(2, rank=1):
        model, mesh = build(TPCase(model="llama"))
        assert mesh["dp"].size() == 1
        report, captured = explain_graphs(model, torch.randint(0, 256, (2, 16)),
                                          config=fsdp_compile.CompileConfig(backend="aot_eager"))
        dims = report.collectives_by_mesh_dim
        assert "dp" not in dims or dims["dp"] == {"all_gathers": 0, "reduce_scatters": 0, "all_reduces": 0}, dims
        assert dims["tp"]["all_gathers"] == 10, dims
        for gm in captured.forward[:1] + captured.backward[:1]:
            ts = targets(gm)
            assert not COPY_OPS & set(ts) and ts[_ops.own_copy.default] == 0, ts
            assert {n.target for n in chains(gm.graph)[0] | chains(gm.graph)[1]} <= {SAME}


def _hsdp_worker(rank: int, world_size: int) -> dict:
    """Case(replicate=2) on 2 ranks: a (replicate 2, shard 1) mesh. parity.run_case, and the graphs' ops."""
    import parity

    made, compile_ = [], fsdp_compile.compile

    def compile(*args, **kwargs):
        made.append(compile_(*args, **kwargs))
        return made[-1]

    fsdp_compile.compile = compile
    out = {}
    for mp in (None, "bf16"):
        made.clear()
        r = parity.run_case(parity.Case(replicate=2, mp=mp, bucket="auto", reorder=True), rank, world_size)
        r["targets"] = {kind: {str(t): n for t, n in targets(getattr(made[0].captured, kind)[0]).items()}
                        for kind in ("forward", "backward")}
        r["units"] = len(made[0].schedule.units)
        out[mp] = r
    return out


@pytest.mark.multirank
def test_one_wide_shard_dim_of_hsdp():
    """HSDP on a (replicate 2, shard 1) mesh of 2 gloo ranks: no all-gather and no copy in the forward; in
    the backward no reduce-scatter, one all-reduce per unit over its packed gradients (one collective over
    one buffer, as FSDP2's), bitwise as eager FSDP2 in fp32 and bf16."""
    from dist_helpers import run_ranks

    results = run_ranks(_hsdp_worker, 2, timeout=600)
    for rank, per_rank in enumerate(results):
        for mp, r in per_rank.items():
            assert r["loss_compiled"] == r["loss_eager"], (rank, mp, r)
            assert max(r["grad_diff"]) == 0.0 and max(r["param_diff"]) == 0.0, (rank, mp, r)
            assert r["forward"] == {"all_gathers": 0, "reduce_scatters": 0, "all_reduces": 0}, r["forward"]
            assert r["backward"] == {"all_gathers": 0, "reduce_scatters": 0, "all_reduces": r["units"]}, r["backward"]
            fw, bw = r["targets"]["forward"], r["targets"]["backward"]
            assert not any(t.startswith("fsdp_compile.") or t == "aten.cat.default" for t in fw), fw
            assert bw.get("fsdp_compile.all_gather_copy_in.default", 0) == 0, bw  # nothing re-gathered
            assert bw.get("fsdp_compile.reduce_scatter_copy_in.default") == r["units"], bw  # the all-reduce's buffer
