"""Single-process tests on the fake process group: what the capture puts in the graphs, and its errors."""

import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdp_compile as fc
from dist_helpers import fake_process_group
from models import FrozenBuffers, Llama, LlamaArgs, OddMLP, shard

_c10d = torch.ops._c10d_functional
# collectives exactly where eager FSDP2 issues them (the default buckets and reorders)
EAGER_LIKE = fc.CompileConfig(backend="aot_eager", bucket="fsdp_group", reorder=False)


def llama(n_layers=4, **kw):
    torch.manual_seed(0)
    m = Llama(LlamaArgs(n_layers=n_layers, **kw))
    return shard(m, m.layers)


def tokens():
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("world_size", [2, 8, 1024])
def test_explain_counts_like_eager(world_size):
    """Eager FSDP2 on a 4-block model: 9 all-gathers (5 forward, 4 backward re-gathers) and 5 RS."""
    with fake_process_group(world_size, rank=1):
        report = fc.explain(llama(), tokens(), config=EAGER_LIKE)
    assert (report.graph_breaks, report.recompiles, report.dynamo_graphs) == (0, 0, 1)
    assert report.forward == {"all_gathers": 5, "reduce_scatters": 0, "all_reduces": 0}
    assert report.backward == {"all_gathers": 4, "reduce_scatters": 5, "all_reduces": 0}
    assert (report.all_gathers, report.reduce_scatters, report.all_reduces) == (9, 5, 0)
    assert [b.groups for b in report.buckets] == [[""], ["layers.0"], ["layers.1"], ["layers.2"], ["layers.3"]]
    assert "9 all-gathers" in report.to_markdown() and '"reduce_scatters": 5' in report.to_json()


@pytest.mark.slow  # out of the fast tier (its budget); the full suite runs it
def test_explain_keeps_no_readable_stages(monkeypatch):
    """``explain`` returns only the report, so it writes no readable graph (each graph's stages cost 42 ms per
    layer of Llama-3 70B's explain in float8 x TP); ``explain_with_graphs``, which dumps use, keeps them, and
    both report the same collectives, buckets and estimates."""
    from fsdp_compile import backend
    from fsdp_compile._explain import explain_with_graphs

    written = []
    monkeypatch.setattr(backend, "readable", lambda gm: written.append(gm) or "graph")
    with fake_process_group(2):
        report = fc.explain(llama(2), tokens(), config=EAGER_LIKE)
        assert written == []
        dumped, captured = explain_with_graphs(llama(2), (tokens(),), {}, EAGER_LIKE)
    stages = [[name for name, _ in r.stages] for r in captured.records]
    assert [r.kind for r in captured.records] == ["forward", "backward"]
    assert all(names and names[0] == "captured" for names in stages), stages
    assert len(written) == sum(map(len, stages))
    same = lambda r: (r.forward, r.backward, [b.params for b in r.buckets], r.est_step_ms, r.est_peak_bytes)  # noqa: E731
    assert same(report) == same(dumped)


def test_explain_zoo():
    with fake_process_group(4):
        tied = fc.explain(llama(2, tie_embeddings=True), tokens(), config=EAGER_LIKE)
        # the tied embedding/output weight is one parameter of the root group: gathered and reduced once
        assert tied.buckets[0].params == ["tok_embeddings.weight", "norm.weight"]
        assert (tied.all_gathers, tied.reduce_scatters) == (5, 3)
        torch.manual_seed(0)
        odd = OddMLP()
        odd_report = fc.explain(shard(odd, odd.blocks), torch.randn(3, 6), config=EAGER_LIKE)
        assert (odd_report.all_gathers, odd_report.reduce_scatters) == (5, 3)
        torch.manual_seed(0)
        frozen = FrozenBuffers()
        frozen_report = fc.explain(shard(frozen, frozen.blocks), torch.randint(0, 32, (2, 8)), config=EAGER_LIKE)
        assert frozen_report.graph_breaks == 0 and frozen_report.reduce_scatters == 3


def _installed(model):
    """What is on the model's modules where compile attaches: hook entries, instance forwards."""
    return [(name, dict(m._forward_pre_hooks), dict(m._forward_hooks), m.__dict__.get("forward"))
            for name, m in model.named_modules()]


@pytest.mark.slow  # out of the fast tier (its budget); the full suite runs it
def test_explain_leaves_state_alone():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    check = FSDPParamGroup._validate_no_meta_params
    with fake_process_group(8):
        model = llama(2)
        params = [p.detach().clone() for p in model.parameters()]
        rng = torch.get_rng_state()
        installed = _installed(model)
        fc.explain(model, tokens())
        assert all(p.grad is None for p in model.parameters())
        assert all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(params, model.parameters()))
        assert torch.equal(rng, torch.get_rng_state())
        assert _installed(model) == installed  # FSDP2's own hooks, the blocks' own forwards
        with torch.device("meta"):
            meta = llama(2)
        fc.explain(meta, tokens().to("meta"))  # FSDP2's meta check is skipped for that model only
        assert FSDPParamGroup._validate_no_meta_params is check
        groups = [pg for m in meta.modules() if isinstance(m, FSDPModule) for pg in m._get_fsdp_state()._fsdp_param_groups]
        assert groups and not any("_validate_no_meta_params" in vars(pg) for pg in groups)


def test_detach_gives_the_model_back():
    """compile attaches once per model; the last detach restores FSDP2's hooks and the blocks' forwards,
    and the model trains eagerly as before; explain of a compiled model leaves it compiled."""
    with fake_process_group(2):
        model = llama(2)
        installed = _installed(model)
        a = fc.compile(model, backend="aot_eager")
        b = fc.compile(model, backend="aot_eager")
        attached = _installed(model)
        assert attached != installed and all(h.__name__.startswith("fsdp_compile") for h in model._forward_pre_hooks.values())
        fc.explain(model, tokens())
        assert _installed(model) == attached
        a(tokens())
        a.detach()
        a.detach()  # idempotent
        assert _installed(model) == attached  # b still uses them
        with pytest.raises(RuntimeError, match="detached"):
            a(tokens())
        b(tokens()).sum().backward()
        b.detach()
        assert _installed(model) == installed
        model(tokens()).sum().backward()  # eager FSDP2, its own hooks
        assert all(p.grad is not None for p in model.parameters())


def _graph_code(rank, world_size):
    with fake_process_group(world_size, rank=rank):
        compiled = fc.compile(llama(2), backend="aot_eager")
        compiled(tokens()).sum().backward()
        return [gm.code for gm in compiled.captured.forward + compiled.captured.backward]


@pytest.mark.slow
def test_graphs_identical_on_every_rank():
    """No rank is baked into the graphs: with even shards every rank compiles the same code."""
    assert _graph_code(0, 8) == _graph_code(5, 8)


def _collective_order(gm):
    order = []
    for node in gm.graph.nodes:
        if node.target in (_c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default):
            kind = "AG" if "all_gather" in str(node.target) else "RS"
            order.append(f"{kind}({node.meta['custom']['fsdp_compile']['group'] or 'root'})")
    return order


def test_collectives_placed_like_eager():
    """Forward: each group gathered at its first use. Backward: a block is re-gathered right before its
    backward and reduce-scattered right after, as FSDP2's pre-/post-backward hooks do; the root (kept
    unsharded by fully_shard's default) is not re-gathered."""
    with fake_process_group(2):
        compiled = fc.compile(llama(2), config=EAGER_LIKE)
        compiled(tokens()).sum().backward()
    fw, bw = compiled.captured.forward[0], compiled.captured.backward[0]
    assert _collective_order(fw) == ["AG(root)", "AG(layers.0)", "AG(layers.1)"]
    assert _collective_order(bw) == ["AG(layers.1)", "RS(layers.1)", "AG(layers.0)", "RS(layers.0)", "RS(root)"]
    # layers.1 is gathered after layers.0's compute (its matmuls, or the call of the blocks' region)
    nodes = list(fw.graph.nodes)
    compute = (torch.ops.aten.mm.default, torch.ops.higher_order.invoke_subgraph)
    first = next(i for i, n in enumerate(nodes) if n.target in compute)
    names = [n.name for n in nodes]
    assert names.index("all_gather_into_tensor_1") < first < names.index("all_gather_into_tensor_2")


def _by_gradient_memory(model) -> list[list[str]]:
    """The parameters grouped by the memory their shard gradient lives in; within a group, the gradients'
    elements are disjoint."""
    groups = {}
    for name, p in model.named_parameters():
        g = p.grad.to_local()
        groups.setdefault(g.untyped_storage().data_ptr(), []).append((g.storage_offset(), g.numel(), name))
    for views in groups.values():
        views.sort()
        assert all(a[0] + a[1] <= b[0] for a, b in zip(views, views[1:])), views
    return sorted(sorted(name for *_, name in views) for views in groups.values())


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.inductor)])
def test_shard_gradients_are_views_of_their_reduce_scatter_output_as_fsdp2s(backend):
    """Without a cast, a group's shard gradients are disjoint views of its reduce-scatter's output (no copy-out),
    as FSDP2's ``foreach_reduce`` leaves them: the parameters grouped by their gradients' memory as eager's."""
    with fake_process_group(2):
        eager, model = llama(2), llama(2)
        eager(tokens()).sum().backward()
        fc.compile(model, config=dataclasses.replace(EAGER_LIKE, backend=backend))(tokens()).sum().backward()
    expected = _by_gradient_memory(eager)
    assert _by_gradient_memory(model) == expected
    assert len(expected) == 3  # the two blocks and the root


@pytest.mark.slow
def test_new_sequence_length_recompiles_once_dynamic():
    with fake_process_group(4):
        compiled = fc.compile(llama(2), backend="aot_eager")
        for seq in (16, 24, 32, 40):
            compiled(torch.randint(0, 256, (2, seq))).sum().backward()
    # Dynamo's automatic dynamic shapes: one static graph, then one with a symbolic sequence length
    assert len(compiled.captured.dynamo) == 2
    assert all(_collective_order(fw)[:1] == ["AG(root)"] for fw in compiled.captured.forward)


def test_reshard_false_saves_unsharded_params():
    with fake_process_group(2):
        torch.manual_seed(0)
        m = Llama(LlamaArgs(n_layers=2))
        report = fc.explain(shard(m, m.layers, reshard_after_forward=False), tokens(), config=EAGER_LIKE)
    assert report.backward["all_gathers"] == 0 and report.reduce_scatters == 3


def test_composable_checkpoint_recomputes():
    """torch.distributed._composable.checkpoint per block: inside the compiled step each block runs under
    torch.utils.checkpoint (its hooks do nothing there), so the forward saves fewer tensors and the backward
    recomputes the block's matmuls; detach gives its hooks back."""
    from torch.distributed._composable import checkpoint

    saved, matmuls = {}, {}
    with fake_process_group(2):
        for ckpt in (False, True):
            torch.manual_seed(0)
            m = Llama(LlamaArgs(n_layers=1))
            hooks = []
            if ckpt:
                for b in m.layers:
                    checkpoint(b)
                hooks = [dict(b._forward_pre_hooks) for b in m.layers]
            compiled = fc.compile(shard(m, m.layers), config=EAGER_LIKE)
            compiled(tokens()).float().sum().backward()
            (out,) = [n for n in compiled.captured.forward[0].graph.nodes if n.op == "output"]
            saved[ckpt] = len(out.args[0])
            matmuls[ckpt] = sum(n.target is torch.ops.aten.mm.default for n in compiled.captured.backward[0].graph.nodes)
            compiled.detach()
            for b, before in zip(m.layers, hooks):
                assert {k: v for k, v in b._forward_pre_hooks.items() if k in before} == before
                assert "forward" not in b.__dict__
    assert saved[True] < saved[False] and matmuls[True] > matmuls[False], (saved, matmuls)


@pytest.mark.slow
def test_many_compiled_models_in_one_process():
    """Each compiled model has its own Dynamo cache entry: no recompile-limit eviction across models (more
    models than Dynamo's recompile limit, lowered from 8 to 2 so that 3 compiles show it)."""
    with fake_process_group(2), torch._dynamo.config.patch(recompile_limit=2):
        compiled = [fc.compile(llama(1), backend="aot_eager") for _ in range(3)]
        for c in compiled:
            c(tokens())
        compiled[0](tokens())
        assert [len(c.captured.dynamo) for c in compiled] == [1] * 3


def test_compiled_module_shares_state():
    with fake_process_group(2):
        model = llama(1)
        compiled = fc.compile(model, backend="aot_eager")
        assert [p for p in compiled.parameters()] == [p for p in model.parameters()]
        assert list(compiled.state_dict()) == list(model.state_dict())
        assert dict(compiled.named_parameters()).keys() == dict(model.named_parameters()).keys()
        assert compiled.layers is model.layers


def test_fully_shard_is_torchs():
    with fake_process_group(2):
        m = nn.Linear(4, 4)
        assert fc.fully_shard(m) is m
        from torch.distributed.fsdp import FSDPModule

        assert isinstance(m, FSDPModule) and type(m).__name__ == "FSDPLinear"


# ---- bad input: one clear error naming the fix ------------------------------------------------------


def test_error_model_not_sharded():
    with fake_process_group(2):
        with pytest.raises(ValueError, match="call fsdp_compile.fully_shard"):
            fc.compile(nn.Linear(4, 4))


def test_error_torch_compiled_module():
    with fake_process_group(2):
        with pytest.raises(TypeError, match="uncompiled fully_shard model"):
            fc.compile(torch.compile(llama(1)))


class _HookedScale(nn.Module):
    """A replicated weight whose forward hooks its gradient, as transformers' ReplicatedWithGradAllReduce does."""

    def __init__(self, hook):
        super().__init__()
        self.weight, self.hook = nn.Parameter(torch.ones(8)), hook

    def forward(self, x):
        if torch.is_grad_enabled():
            self.weight.register_post_accumulate_grad_hook(self.hook)
        return x * self.weight


def _halve(param):
    param.grad.mul_(0.5)


def _async_all_reduce(param):
    torch.distributed.all_reduce(param.grad, async_op=True).wait()


@pytest.mark.parametrize("hook", [_halve, _async_all_reduce])
def test_post_accumulate_grad_hook_registered_in_forward(hook):
    """A hook registered in forward on an FSDP parameter runs on its gradient in the backward graph (bitwise
    with tp all-reduces: test_from_pretrained_distributed_config_bitwise[qwen3-bf16]); one whose body cannot be traced there is refused, named."""
    with fake_process_group(2):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), _HookedScale(hook))
        shard(m, [m[1]])
        x = torch.randn(2, 8)
        if hook is _halve:
            report = fc.explain(m, x, config=EAGER_LIKE)
            assert (report.graph_breaks, report.dynamo_graphs) == (0, 1)
            return
        with pytest.raises(NotImplementedError, match="post-accumulate-grad hook .*_async_all_reduce, registered on an "
                           "FSDP parameter in forward, cannot run on that parameter's gradient in the backward graph"):
            fc.explain(m, x, config=EAGER_LIKE)


class _EmptyBranch(nn.Module):
    """Branches on a size read back from a tensor (as expert parallelism's all-to-all split sizes are)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, x):
        rows = x[: (x[:, 0] > 0).sum().tolist()]
        if rows.shape[0] == 0:  # data-dependent: not one of the branches the capture knows
            return x * self.weight
        return x * self.weight + rows.sum()


def test_data_dependent_branch_refused_with_its_line():
    """A Python branch on a data-dependent size outside the known ones (transformers' AllToAllEP, taken on its
    general path: TPCase(model="hf_qwen3_moe")) is refused, naming its file and line, not Dynamo's guard error."""
    with fake_process_group(2):
        m = nn.Sequential(nn.Linear(8, 8), _EmptyBranch())
        shard(m, [m[1]])
        with pytest.raises(NotImplementedError, match=r"data-dependent value Eq\(u\d+, 0\) at .*test_capture.py:\d+ "
                           r"\(if rows.shape\[0\] == 0:.*guard_or_false"):
            fc.explain(m, torch.randn(2, 8), config=EAGER_LIKE)


def test_error_compiling_twice():
    with fake_process_group(2):
        compiled = fc.compile(llama(1), backend="aot_eager")
        with pytest.raises(TypeError, match="pass the original module"):
            fc.compile(compiled)


@pytest.mark.parametrize("replicate, shard_size", [(2, 2), (8, 128)])
def test_hsdp_reduces_then_all_reduces(replicate, shard_size):
    """HSDP (a 2-D mesh): gather and reduce-scatter over the shard dimension, then one all-reduce per
    reduce-scatter over the replicate dimension, as eager FSDP2 does."""
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(replicate * shard_size, rank=1):
        mesh = init_device_mesh("cpu", (replicate, shard_size), mesh_dim_names=("replicate", "shard"))
        torch.manual_seed(0)
        m = Llama(LlamaArgs(n_layers=2))
        shard(m, m.layers, mesh=mesh)
        report = fc.explain(m, tokens(), config=EAGER_LIKE)
    assert (report.graph_breaks, report.all_gathers, report.reduce_scatters) == (0, 5, 3)
    assert report.all_reduces == report.reduce_scatters
    assert report.backward["all_reduces"] == 3 and report.forward["all_reduces"] == 0


def test_multi_module_group():
    """fully_shard([layers.0, layers.1]): one group, one all-gather (forward and backward), one reduce-scatter."""
    with fake_process_group(2):
        torch.manual_seed(0)
        m = Llama(LlamaArgs(n_layers=2))
        fully_shard([m.layers[0], m.layers[1]])
        fully_shard(m)
        report = fc.explain(m, tokens(), config=EAGER_LIKE)
    assert [b.groups for b in report.buckets] == [[""], ["layers.0"]]
    assert report.forward["all_gathers"] == 2 and report.backward == {"all_gathers": 1, "reduce_scatters": 2, "all_reduces": 0}


def test_config_overrides_and_env(monkeypatch):
    with pytest.raises(TypeError, match="unknown CompileConfig option"):
        fc.CompileConfig().replace(bucket_size=3)
    monkeypatch.setenv("FSDP_COMPILE_DUMP", "/tmp/somewhere")
    assert fc.CompileConfig().dump_dir == "/tmp/somewhere"
    defaults = fc.CompileConfig()
    assert (defaults.backend, defaults.bucket, defaults.reorder, defaults.kernels) == ("inductor", "auto", True, "auto")
    cfg = fc.CompileConfig(bucket=[["layers.0", "layers.1"], ["layers.2"]])
    assert cfg.bucket == (("layers.0", "layers.1"), ("layers.2",))
    with pytest.raises(dataclasses_FrozenInstanceError()):
        cfg.backend = "aot_eager"


def dataclasses_FrozenInstanceError():
    import dataclasses

    return dataclasses.FrozenInstanceError


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(bucket=[["layers.0", "layers.9"]]), "names 'layers.9', which is not an FSDP module"),
        (dict(bucket=[["layers.0"], ["layers.0"]]), "names 'layers.0' twice"),
        (dict(bucket_cap_mb=0.01), r"bucket_cap_mb=0.01 is below FSDP module .*all-gather"),
    ],
)
def test_bucket_options_checked_before_tracing(overrides, match):
    with fake_process_group(2):
        with pytest.raises(ValueError, match=match):
            fc.compile(llama(1), **overrides)


def test_explain_fills_estimates():
    """The default schedule, scored by the node-level simulator on the graphs: never slower or more exposed
    than the graphs as captured; and by its own model: within the default budget (what eager FSDP2 holds
    of gathered parameters and reduce-scatter buffers)."""
    with fake_process_group(8):
        config = fc.CompileConfig(backend="aot_eager", bucket="auto", reorder=True, hardware="h100-nvlink")
        report = fc.explain(llama(4), tokens(), config=config)
    assert report.hardware == "h100-nvlink"
    assert report.cudagraphs == []  # decided only with cudagraphs=True (tests/test_cudagraphs.py)
    assert 0 < report.est_step_ms <= report.eager_est_step_ms
    assert 0 <= report.est_exposed_comm_ms <= report.eager_est_exposed_comm_ms
    planned = report.schedule["predicted"]["planned"]
    assert max(planned[k]["comm_peak_bytes"] for k in ("forward", "backward")) <= report.schedule["comm_budget_bytes"]
    assert report.schedule["comm_budget_bytes"] == max(
        report.schedule["predicted"]["eager_fsdp2"][k]["comm_peak_bytes"] for k in ("forward", "backward")
    )
    assert all(g["comm_budget"] == report.schedule["comm_budget_bytes"] for g in report.graphs)
    # every parameter in exactly one forward bucket; the root's in two (its embedding, its head)
    params = [p for b in report.buckets for p in b.params]
    assert len(params) == len(set(params)) == 3 + 4 * 9
    assert [b.groups for b in report.buckets if "" in b.groups] == [[""], [""]]
    # explain names the split and the gain the planner predicted for it
    text = report.to_markdown()
    assert "- split: `<root>` gathered and reduce-scattered in parts: unit 0 (tok_embeddings.weight), unit" in text
    planned, unsplit = (sum(report.schedule["predicted"][k][d]["step_s"] for d in ("forward", "backward")) * 1e3
                        for k in ("planned", "unsplit"))
    assert planned < unsplit and f"step {planned:.3f} ms against {unsplit:.3f} ms planned with every FSDP module whole" in text
    assert len({g for b in report.buckets for g in b.groups}) == 5
    assert [g["kind"] for g in report.graphs] == ["forward", "backward"]


@pytest.mark.slow  # out of the fast tier (its budget); the full suite runs it
def test_hardware_takes_a_profile_of_your_own():
    """``hardware=`` a ``HardwareProfile``: the plan is made from its numbers and the report names it; the same
    numbers as a built-in profile plan the same schedule, a slower link a slower predicted step."""
    from fsdp_compile.passes.cost_model import GB, H100_NVLINK, LinkProfile

    mine = dataclasses.replace(H100_NVLINK, name="my-cluster")
    slow = dataclasses.replace(H100_NVLINK, name="slow-link", intra=LinkProfile(bus_bw=1 * GB, step_latency=1e-3, base_latency=0.0))
    with fake_process_group(8):
        reports = [fc.explain(llama(4), tokens(), config=fc.CompileConfig(backend="aot_eager", hardware=h))
                   for h in ("h100-nvlink", mine, slow)]
    by_name, by_profile, slower = reports
    assert (by_name.hardware, by_profile.hardware, slower.hardware) == ("h100-nvlink", "my-cluster", "slow-link")
    strip = lambda r: {k: v for k, v in r.schedule.items() if k not in ("hardware", "planning_s")}  # noqa: E731
    assert strip(by_profile) == strip(by_name)
    assert slower.est_step_ms > by_name.est_step_ms


def test_dump_dir(tmp_path):
    """A real compile with dump_dir writes each graph at each stage and its predicted schedule."""
    with fake_process_group(2):
        compiled = fc.compile(llama(1), backend="aot_eager", dump_dir=str(tmp_path))
        compiled(tokens()).sum().backward()
    names = sorted(p.name for p in tmp_path.iterdir())
    for kind in ("1_forward0", "2_backward0"):
        assert f"{kind}_0_captured.txt" in names and f"{kind}_schedule.json" in names, names
        assert any(n.startswith(kind) and n.endswith("_reordered.txt") for n in names), names
    assert "0_dynamo0.txt" in names
    forward = (tmp_path / "1_forward0_0_captured.txt").read_text()
    assert "all_gather_into_tensor" in forward and "'layers.0'" in forward
    assert "reduce_scatter_tensor" in (tmp_path / "2_backward0_0_captured.txt").read_text()


@pytest.mark.inductor
def test_dump_dir_has_inductor_output_code(tmp_path):
    with fake_process_group(2):
        torch.manual_seed(0)
        model = shard(OddMLP(), [])
        compiled = fc.compile(model, dump_dir=str(tmp_path))  # the default backend: Inductor
        compiled(torch.randn(3, 6)).sum().backward()
    code = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith("_inductor_output_code.py"))
    assert code == ["1_forward0_9_inductor_output_code.py", "2_backward0_9_inductor_output_code.py"]
    assert "all_gather_into_tensor" in (tmp_path / code[0]).read_text()


def test_explain_meta_device_at_scale():
    """Llama-3-8B layer shapes (2 of the 32 layers) on the meta device at world 1024: captured and
    counted with no parameter memory (real fp32 weights would take ~5.9 GB)."""
    import resource

    from fsdp_compile.models import SIZES

    args = dataclasses.replace(SIZES["llama3-8b"], n_layers=2)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    with fake_process_group(1024):
        with torch.device("meta"):
            model = Llama(args)
        shard(model, model.layers)
        report = fc.explain(model, torch.randint(0, 100, (1, 256), device="meta"), config=EAGER_LIKE)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert (report.all_gathers, report.reduce_scatters) == (5, 3)
    assert report.buckets[1].bytes == 872_448_000  # one 8B block, fp32: 4*(4096*4096*2 + 2*1024*4096 + 3*4096*14336) + 2*4096*4 bytes
    assert grown_mib < 1000, grown_mib


def _overlapped(lines, collective, wait, anchor):
    """Names of collectives with at least one matmul-like call between them and their wait."""
    import re

    open_, hidden = {}, set()
    for line in lines:
        if m := re.search(collective, line):
            open_[m.group("out")] = False
        elif m := re.search(wait, line):
            if open_.pop(m.group("arg"), False):
                hidden.add(m.group("arg"))
        elif re.search(anchor, line):
            open_ = {k: True for k in open_}
    return len(hidden)


@pytest.mark.inductor
def test_inductor_keeps_the_overlap(tmp_path):
    """Inductor's scheduler would pull each wait up to its collective; pin_collective_order keeps every
    overlap our reordering chose (counted in Inductor's generated code, not just in our graph)."""
    with fake_process_group(2):
        # one unit per block, so every block's all-gather can hide behind the block before it
        compiled = fc.compile(llama(3), hardware="h100-nvlink", bucket="fsdp_group", dump_dir=str(tmp_path))
        compiled(tokens()).sum().backward()
    for kind in ("1_forward0", "2_backward0"):
        ours = (tmp_path / f"{kind}_1_reordered.txt").read_text().splitlines()
        code = (tmp_path / f"{kind}_9_inductor_output_code.py").read_text().splitlines()
        in_graph = _overlapped(
            ours, r"(?P<out>\w+): \"[^\"]*\" = torch\.ops\._c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor)\.default",
            r"torch\.ops\._c10d_functional\.wait_tensor\.default\((?P<arg>\w+)\)",
            r"torch\.ops\.aten\.(mm|bmm|addmm)\.default|torch\.ops\.higher_order\.invoke_subgraph\(",  # a block's region call
        )
        generated = _overlapped(
            code, r"(?P<out>buf\d+) = torch\.ops\._c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor)\.default\(",
            r"torch\.ops\._c10d_functional\.wait_tensor\.default\((?P<arg>buf\d+)\)",
            r"extern_kernels\.(mm|bmm|addmm)\(|= partitioned_[fb]w_subgraph_\w+\(",
        )
        assert in_graph >= 2 and generated >= in_graph, (kind, in_graph, generated)


@pytest.mark.slow
@pytest.mark.parametrize("reshard, ranks, kernels", [(True, (0, 3), "torch"), (True, (0, 3), "triton"), (2, (0, 1), "torch")])
def test_no_rank_in_the_graphs(reshard, ranks, kernels):
    """Two ranks of 4 capture the same Dynamo, forward and backward graphs (evenly sharded): nothing in
    them names the rank, so one rank's compiled artifacts can serve the others. A process group is named
    in the graph, so ranks of different subgroups (HSDP's replicas, an int reshard_after_forward's
    post-forward groups: {0, 1} and {2, 3} here) differ by those names only; the int's chunk index is
    read when the op runs (ops.post_forward_shard)."""
    import contextlib

    from triton_mode import triton_interpreter

    code = {}
    for rank in ranks:
        with fake_process_group(4, rank=rank), triton_interpreter() if kernels == "triton" else contextlib.nullcontext():
            torch.manual_seed(0)
            m = Llama(LlamaArgs(n_layers=2))
            shard(m, m.layers, reshard_after_forward=reshard)
            compiled = fc.compile(m, backend="aot_eager", kernels=kernels)
            compiled(tokens()).sum().backward()
            graphs = compiled.captured
            code[rank] = [  # without comments (a region call's id counts the compiles of this process)
                [line for line in g.print_readable(print_output=False).splitlines() if not line.lstrip().startswith("#")]
                for g in graphs.dynamo + graphs.forward + graphs.backward
            ]
    assert code[ranks[0]] == code[ranks[1]]


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.block(self.embed(ids)))


def test_call_with_is_functional_call():
    """``capture.call_with`` (the model run on the gathered tensors) computes what torch's
    ``functional_call(tie_weights=True)`` computes, tied aliases included, and puts the parameters back,
    also when the forward raises."""
    from fsdp_compile import capture

    torch.manual_seed(0)
    m = _Tied()
    originals = dict(nn.Module.named_parameters(m, remove_duplicate=False))
    new = {n: torch.randn_like(p) for n, p in m.named_parameters()}  # the tied weight under one name
    places = capture.parameter_places(m, list(new))
    assert [(held is mod._parameters, key) for (held, key), mod in zip(places["embed.weight"], (m.embed, m.head))] == [
        (True, "weight"), (True, "weight")]
    ids = torch.tensor([[1, 2, 3]])
    expected = torch.func.functional_call(m, new, (ids,), tie_weights=True)
    table = capture.place_table(places)
    assert len(table[0]) == 3  # embed's, head's and block's _parameters: each dict once
    assert torch.equal(capture.call_with(m, table, new, (ids,), {}), expected)
    with pytest.raises(IndexError):
        capture.call_with(m, table, new, (torch.tensor([[9]]),), {})  # out of the embedding's range
    after = dict(nn.Module.named_parameters(m, remove_duplicate=False))
    assert after.keys() == originals.keys() and all(after[n] is p for n, p in originals.items())
    with pytest.raises(ValueError, match="no parameter 'block.gone'"):
        capture.parameter_places(m, ["block.gone"])


def test_graphs_entering_sdpa_kernel_or_autocast_are_cacheable():
    """AOTAutograd's cache refuses a Dynamo graph that calls a torch function it does not list; Dynamo puts the
    entry and exit of ``sdpa_kernel(...)`` and ``torch.autocast(...)`` in the graph as such calls (torchtitan's
    attention and MoE router), so every warm start of those models traced the whole step again. Our compiles
    list them (``backend.CACHE_SAFE_FUNCTIONS``): the graph is then cacheable, and without them it is not."""
    import torch.nn.functional as F
    from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_cacheable
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from fsdp_compile.backend import CACHE_SAFE_FUNCTIONS

    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    @torch.compile(backend=grab, fullgraph=True)
    def attention(q):
        with sdpa_kernel(SDPBackend.MATH):
            out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        with torch.autocast("cpu", enabled=False):
            return out.float() @ out.float().transpose(-1, -2)

    attention(torch.randn(1, 2, 4, 8))
    (gm,) = graphs
    with pytest.raises(BypassAOTAutogradCache, match="Unsupported call_function target"):
        check_cacheable(gm)
    with torch._inductor.config.patch(unsafe_marked_cacheable_functions=CACHE_SAFE_FUNCTIONS):
        check_cacheable(gm)
