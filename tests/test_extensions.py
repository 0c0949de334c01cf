"""All-gather extensions on the fake process group: what is planned, captured and refused (issue 21).
The numerics against eager FSDP2 are in ``test_extensions_multirank.py``."""

import types

import pytest
import torch

import fsdp_compile as fc
from dist_helpers import fake_process_group
from extensions import Int8Gathered, Int8GatheredOneArg, Opaque, convert_linears
from models import Llama, LlamaArgs, shard

W = 4


def llama(cls=Int8Gathered, **kwargs):
    torch.manual_seed(0)
    model = convert_linears(Llama(LlamaArgs(n_layers=2)), cls)
    return shard(model, list(model.layers), **kwargs)


def tokens():
    return torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("cls", [Int8Gathered, Int8GatheredOneArg])
def test_plan_counts_the_payload_bytes(cls):
    with fake_process_group(W):
        plan = fc.compile(llama(cls)).plan
        block = plan.group("layers.0")
        ext = [p for p in block.params if p.extension is not None]
        assert {p.extension.kind for p in ext} == {cls.__name__} and len(ext) == 7  # wq wk wv wo w1 w2 w3
        for p in ext:  # int8 data and a float32 maximum per row, from every rank
            rows, cols = p.full_shape[0] // W, p.full_shape[1]
            assert p.extension.input_bytes == rows * cols + 4 * rows
            assert p.extension.one_arg == (cls is Int8GatheredOneArg)
        plain = [p for p in block.params if p.extension is None]  # the norms: fp32
        assert block.unsharded_bytes == W * sum(p.extension.input_bytes for p in ext) + 4 * sum(p.full_shape[0] for p in plain)
        assert "Int8Gathered" in str(plan.fingerprint())


def test_explain_gathers_bytes():
    """The captured all-gathers move uint8 (int8 data, float32 maxima and fp32 norms packed as bytes), and the
    report's buckets count those bytes."""
    with fake_process_group(W):
        model = llama()
        config = fc.CompileConfig(backend="aot_eager", bucket="fsdp_group")
        report, captured = fc._explain.explain_with_graphs(model, (tokens(),), {}, config)
        dtypes = {
            n.args[0].meta["val"].dtype for g in captured.forward for n in g.graph.nodes
            if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default
        }
        assert dtypes == {torch.uint8}
        plan = fc.compile(model).plan
        assert {b.bytes for b in report.buckets} == {g.unsharded_bytes for g in plan.groups}
        assert report.graph_breaks == 0


def _refused(model, match):
    with pytest.raises(NotImplementedError, match=match) as info:
        fc.compile(model)(tokens())
    assert "\n" not in str(info.value)


def test_refused_not_traceable():
    with fake_process_group(W):
        _refused(llama(Opaque), r"parameter '(output|layers\.0\.attention\.wq)\.weight'.*Opaque, has no __tensor_flatten__")


def test_refused_int_reshard_after_forward():
    with fake_process_group(W):
        _refused(llama(reshard_after_forward=2), r"parameter '(output|layers\.0\.attention\.wq)\.weight'.*reshard_after_forward is an int")


class _OddMetadata(Int8Gathered):
    def fsdp_pre_all_gather(self, mesh, orig_size, contiguous_orig_stride, module, mp_policy):
        inputs, _ = super().fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)
        return inputs, (object(),)


def test_refused_metadata_that_is_not_plain():
    with fake_process_group(W):
        _refused(llama(_OddMetadata), r"parameter '(output|layers\.0\.attention\.wq)\.weight'.*metadata holds \['object'\]")


def _misbuilt(build):
    """Int8Gathered whose fsdp_post_all_gather returns ``build`` of the parameter it rebuilds."""

    class Misbuilt(Int8Gathered):
        def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
            full, inner = super().fsdp_post_all_gather(all_gather_outputs, metadata, param_dtype, out=out)
            return build(full), inner

        @staticmethod
        def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
            return Misbuilt(inner["_tensor"], meta["qmax"])

    return Misbuilt


def test_refused_post_all_gather_of_another_dtype_or_shape():
    """What ``fsdp_post_all_gather`` builds must be the parameter in ``param_dtype`` (FSDP2 uses it as the unsharded
    parameter): checked when the plan is read, before any trace, naming the parameter, what it built and what was
    expected (a check in the trace reached the user as Dynamo's "Observed exception", the message in its debug
    context)."""
    where = r"parameter '(output|layers\.0\.attention\.wq)\.weight'.*fsdp_post_all_gather built "
    with fake_process_group(W):
        _refused(llama(_misbuilt(lambda full: full.double())),
                 where + r"torch\.float64 \(\d+, \d+\), expected torch\.float32 of shape \(\d+, \d+\)")
        _refused(llama(_misbuilt(lambda full: full.t())), where + r"torch\.float32 \(\d+, \d+\), expected")


def test_adapter_reads_what_fsdp2_passes_fsdp_pre_all_gather():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_compile import _fsdp2
    from fsdp_compile.plan import lazy_init, param_groups

    with fake_process_group(W):
        model = llama()
        lazy_init(model)
        _, _, pg = next(g for g in param_groups(model) if g[0] == "layers.0")
        params = _fsdp2.layout(pg).params
        ext = [p for p in params if p.all_gather_extension]
        assert len(ext) == 7 and all(p.pre_all_gather_args is None for p in params if not p.all_gather_extension)
        mesh, size, stride, module, mp = ext[0].pre_all_gather_args
        assert size == tuple(ext[0].sharded_param.shape) and stride == (size[1], 1)
        assert isinstance(module, torch.nn.Linear) and module.weight is ext[0].sharded_param
        assert mesh.size() == W and mp == MixedPrecisionPolicy()


@pytest.mark.parametrize("float8_all_gather", [False, True, "differing"])
def test_torchao_float8_blocks_share_a_region(float8_all_gather):
    """Blocks of torchao float8 Linears are one region, with the float8 all-gather too: each weight that
    fsdp_post_all_gather rebuilds as a Float8TrainingTensor enters the region as its float8 data and scale,
    rebuilt inside with one flatten context (``capture/boundary.py``; numerics: test_float8_multirank). Blocks
    whose weights rebuild with different contexts (here, another emulate) stay inline, naming the weight.
    Without the all-gather they are a region (under Inductor: test_ops::test_regions_under_inductor_two_layers)."""
    pytest.importorskip("torchao.float8", reason="torchao (the test extra) is not installed")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from fsdp_compile import capture
    from fsdp_compile.plan import read_plan

    with fake_process_group(W):
        torch.manual_seed(0)
        model = Llama(LlamaArgs(n_layers=2))
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=bool(float8_all_gather), emulate=True)
        if float8_all_gather == "differing":  # layers.1 for real float8 matmuls: another LinearMMConfig
            convert_to_float8_training(model.layers[1], config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
        convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn != "output" and type(m) is torch.nn.Linear)
        shard(model, list(model.layers))
        plan = read_plan(model)
        why = capture.inline_reason(plan, ["layers.0", "layers.1"], model)
    if float8_all_gather == "differing":
        assert "'attention.wq.weight' in 'layers.1' as a Float8TrainingTensor" in why, why
    else:
        assert why is None, why


def test_float8_weight_crosses_the_boundary_as_its_inner_tensors():
    """Outside, a Float8TrainingTensor weight (what fsdp_post_all_gather built, its gradient going to the
    all-gather's output through ``_extensions.post_all_gather``) goes in as its float8 data, its scale and a
    carrier that owns no memory; inside, it is rebuilt with the region's flatten context, and the plain gradient
    torchao's matmul gives it reaches the all-gather's output unchanged. Another context than the region's (the
    extension's settings changed after compile) is an error that names the fix, raised where Dynamo runs the
    crossing, not traces it."""
    pytest.importorskip("torchao.float8", reason="torchao (the test extra) is not installed")
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole, LinearMMConfig

    from fsdp_compile._extensions import Attach, attach_args
    from fsdp_compile.capture import boundary

    def weight(config):
        return Float8TrainingTensor(torch.randn(4, 3).to(torch.float8_e4m3fn), torch.tensor(0.5), torch.float32,
                                    config, GemmInputRole.WEIGHT)

    full = weight(LinearMMConfig())
    names, ctx = full.__tensor_flatten__()
    spec = boundary.SubclassSpec(Float8TrainingTensor, tuple(names), ctx, (4, 3), (3, 1))
    crossings = boundary.subclass_crossings((spec, None))
    handle = torch.zeros(4, 3, requires_grad=True)  # the all-gather's output for this weight
    bias = torch.ones(3)

    class Local:  # the local shard whose fsdp_post_all_gather built the weight
        def __init__(self, built):
            self.built = built

        def fsdp_post_all_gather(self, outputs, metadata, param_dtype):
            return self.built, outputs

    extension = types.SimpleNamespace(orig_size=(4, 3), contiguous_stride=(3, 1))

    def attached(built):
        return Attach.apply(*attach_args(Local(built), [], (), handle, torch.float32, extension, "w"))

    operands = boundary.flattened((attached(full), bias), (None, None), crossings)
    data, scale, carrier, plain = operands
    assert data.dtype == torch.float8_e4m3fn and torch.equal(data.view(torch.uint8), full._data.view(torch.uint8))
    assert torch.equal(scale, full._scale) and plain is bias
    assert carrier.shape == (4, 3) and carrier.stride() == (0, 0) and carrier.requires_grad
    leaves = (data, scale, carrier.detach().requires_grad_(), plain)
    inside, same = boundary.rebuilt(leaves, (None, None), crossings)
    assert type(inside) is Float8TrainingTensor and inside.__tensor_flatten__()[1] == ctx and same is plain
    g = torch.randn(4, 3)
    inside.backward(g)  # torchao's float8 matmul hands its weight a plain gradient
    assert torch.equal(leaves[2].grad, g)
    carrier.backward(g)
    assert torch.equal(handle.grad, g)
    other = weight(LinearMMConfig()._replace(output=LinearMMConfig().output._replace(emulate=True)))
    with pytest.raises(RuntimeError, match="settings changed since; call fsdp_compile.compile again"):
        boundary.flattened((attached(other), bias), (None, None), crossings)

    # straight from the all-gather (a deferred parameter): the same operands, the scale (metadata the subclass
    # holds as it is) copied, the carrier's gradient to the handle
    handle.grad = None
    direct = crossings[0].direct.apply(*attach_args(Local(full), [], (full._scale,), handle, torch.float32, extension, "w"))
    operands = boundary.flattened((None, bias), (None, None), crossings, (direct, None))
    data, scale, carrier, plain = operands
    assert torch.equal(data.view(torch.uint8), full._data.view(torch.uint8)) 
    assert torch.equal(scale, full._scale) and scale.data_ptr() != full._scale.data_ptr() and plain is bias
    assert data.data_ptr() == full._data.data_ptr()  # a view: the gathered bytes are not copied
    assert carrier.shape == (4, 3) and carrier.stride() == (0, 0) and carrier.requires_grad
    carrier.backward(g)
    assert torch.equal(handle.grad, g)
    with pytest.raises(RuntimeError, match="settings changed since; call fsdp_compile.compile again"):
        crossings[0].direct.apply(*attach_args(Local(other), [], (), handle, torch.float32, extension, "w"))


@pytest.mark.parametrize(("metadata", "container"), [
    (None, "leaf"), (3, "leaf"), ((0,), "tuple"), ([0, "a", None], "list"), ((0, (1,)), ""), ({"scale": 0}, "")])
def test_split_rebuilds_metadata_as_pytree_does(metadata, container):
    """``_extensions.split`` builds a leaf, or a plain tuple or list of leaves, as it is (``Layout.container``), and
    anything else through pytree: the same metadata either way, its tensors the graph's (a 0 stands for one)."""
    from torch.utils import _pytree as pytree

    from fsdp_compile._extensions import Layout, _container, split

    scale = torch.tensor(0.5)
    metadata = pytree.tree_map(lambda x: scale if type(x) is int and x == 0 else x, metadata)
    leaves, spec = pytree.tree_flatten(metadata)
    layout = Layout(1, spec, tuple((True, None) if isinstance(x, torch.Tensor) else (False, x) for x in leaves),
                    _container(spec))
    assert layout.container == container
    local, payload = torch.zeros(2), torch.ones(2)
    selves, payloads, metadatas = split([local, payload, *(x for x in leaves if isinstance(x, torch.Tensor))],
                                        (layout,))
    assert len(selves) == len(payloads) == 1 and selves[0] is local and payloads[0] is payload
    assert type(metadatas[0]) is type(metadata) and pytree.tree_flatten(metadatas[0])[1] == spec
    assert all(a is b for a, b in zip(pytree.tree_leaves(metadatas[0]), leaves))


def test_local_shards_are_to_local_in_one_autograd_node():
    """_extensions.LocalShards, the compiled step's way from DTensor parameters to their local shards: the
    same views and, in the backward, the same DTensor gradients (values, placements, global shape and
    stride, dtype) as ``to_local`` per parameter, on a 1-D and a 2-D mesh (a Replicate dim among them),
    for a contiguous and a transposed gradient; a frozen parameter's shard needs no gradient, as its
    ``to_local`` does; one autograd node for all of them. The gradient specs it keeps serve the same
    parameter only."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    from fsdp_compile._extensions import LocalShards

    with fake_process_group(4):
        meshes = [init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))]
        placements = [[Shard(0)], [Shard(0), Replicate()]]
        for mesh, pl in zip(meshes, placements):
            torch.manual_seed(0)
            params = [torch.nn.Parameter(DTensor.from_local(torch.randn(*shape), mesh, pl, run_check=False))
                      for shape in [(3, 4), (5,), (4, 4)]]
            params.append(torch.nn.Parameter(DTensor.from_local(torch.randn(2, 2), mesh, pl, run_check=False), requires_grad=False))
            # a transposed gradient, then the same parameter's contiguous one: the gradient specs are kept per
            # parameter and layout (_GRAD_SPECS), so the second must not get the first's stride
            for grads in ([torch.randn(3, 4), torch.randn(5), torch.randn(4, 4).t()],
                          [torch.randn(3, 4), torch.randn(5), torch.randn(4, 4)]):
                results = []
                for batched in (False, True, True):
                    locals_ = LocalShards.apply(False, *params) if batched else [p.to_local() for p in params]
                    assert [t.requires_grad for t in locals_] == [True, True, True, False]
                    assert all(torch.equal(t, p._local_tensor) and t.data_ptr() == p._local_tensor.data_ptr() for t, p in zip(locals_, params))
                    if batched:
                        assert len({t.grad_fn for t in locals_[:3]}) == 1
                    # the gradients as they leave the node (AccumulateGrad would lay them out like the parameters)
                    results.append(torch.autograd.grad(locals_[:3], params[:3], grads[:3]))
                transposed = results[0][2]._spec.tensor_meta.stride != params[2]._spec.tensor_meta.stride
                assert transposed == (grads[2].stride() != (4, 1))
                for per_param, batched, again in zip(*results):
                    assert isinstance(batched, DTensor) and batched._spec == per_param._spec
                    assert batched.stride() == per_param.stride() and batched.dtype == per_param.dtype
                    assert torch.equal(batched._local_tensor, per_param._local_tensor)
                    assert again._spec is batched._spec and torch.equal(again._local_tensor, batched._local_tensor)
        # a mesh of the same layout built later (specs compare equal across the two): its parameters' gradients
        # are on it, not on the first (kept specs are keyed by the parameter's spec object). The parameter is
        # built from its spec: DTensor.from_local's and nn.Parameter's paths hand out the first mesh in torch 2.13
        later = init_device_mesh("cpu", (4,))
        assert later == meshes[0] and later is not meshes[0]
        spec = DTensorSpec(later, (Shard(0),), tensor_meta=TensorMeta(torch.Size((12, 4)), (4, 1), torch.float32))
        params = [DTensor(torch.randn(3, 4), spec, requires_grad=True)]
        assert params[0]._spec.mesh is later
        (grad,) = torch.autograd.grad(LocalShards.apply(False, *params), params, [torch.randn(3, 4)])
        assert grad._spec.mesh is later


def test_local_shards_add_a_shared_parameters_gradients_in_fsdp2s_order():
    """A parameter passed twice (two FSDP parameters share it: a tie made after fully_shard) gets its two
    gradients added as eager FSDP2 adds them, one after the other onto ``.grad``: ``(g + a) + b``, not
    ``g + (a + b)``, which rounds otherwise (1 + 2^-24 + 2^-24: 1.0 one way, 1 + 2^-23 the other);
    without a ``.grad``, ``a + b``. Each other parameter's gradient is its own."""
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    from fsdp_compile._extensions import LocalShards

    with fake_process_group(2):
        mesh = init_device_mesh("cpu", (2,))
        tied, other = (torch.nn.Parameter(DTensor.from_local(torch.zeros(2), mesh, [Shard(0)], run_check=False))
                       for _ in range(2))
        a, b = torch.full((2,), 2.0**-24), torch.full((2,), 2.0**-24)
        for before, expected in ((None, 2.0**-23), (1.0, 1.0)):
            tied.grad = None if before is None else DTensor.from_local(torch.full((2,), before), mesh, [Shard(0)])
            other.grad = None
            shards = LocalShards.apply(False, tied, other, tied)
            torch.autograd.backward(shards, [a, torch.ones(2), b])
            assert torch.equal(tied.grad.to_local(), torch.full((2,), expected)), (before, tied.grad)
            assert torch.equal(other.grad.to_local(), torch.ones(2))
        assert (1.0 + (2.0**-24 + 2.0**-24)) != expected  # the other order


def _float8_llama(n_layers: int, hook, **attributes):
    """A seeded Llama of ``n_layers`` in torchao's float8 with the float8 all-gather (emulated matmuls), but its
    output; ``attributes`` set on every block, ``hook`` the root's forward pre-hook; each block and the root
    sharded."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    model = Llama(LlamaArgs(n_layers=n_layers))
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn != "output")
    for block in model.layers:
        for name, value in attributes.items():
            setattr(block, name, value)
    model.register_forward_pre_hook(hook)
    return shard(model, list(model.layers))


@pytest.mark.slow  # out of the fast tier (its budget); the full suite runs it
def test_float8_weights_go_to_their_region_unbuilt_and_are_built_where_a_block_runs_inline():
    """A float8 block's weights enter its region straight from the all-gather (``capture.forward.Deferred``: the
    Float8TrainingTensor is never built at top level), and a block of that kind that runs inline builds its own
    (``regions._regional_forward``'s ``inline``): here the third block, whose plain attribute the model's forward
    writes to another value than the template's. Three steps with AdamW on one gloo rank, every loss, gradient
    and parameter bitwise equal to eager FSDP2's with the float8 all-gather."""
    pytest.importorskip("torchao.float8", reason="torchao (the test extra) is not installed")
    import torch.distributed as dist
    import torch.nn.functional as F

    def build():
        return _float8_llama(3, lambda m, args: setattr(m.layers[2], "tag", 1), tag=0)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        eager, model = build(), build()
        compiled = fc.compile(model, backend="aot_eager")
        runs = []
        for m, runner in ((eager, eager), (model, compiled)):
            opt, out = torch.optim.AdamW(m.parameters(), lr=1e-2), []
            for step in range(3):
                x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
                loss = F.cross_entropy(runner(x).flatten(0, 1).float(), x.flatten())
                loss.backward()
                out.append((loss.detach(), [p.grad.to_local().clone() for p in m.parameters()]))
                opt.step()
                opt.zero_grad()
            runs.append((out, [p.to_local() for p in m.parameters()]))
        (want, want_params), (got, got_params) = runs
        for (a, ga), (b, gb) in zip(want, got):
            assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))
        assert all(torch.equal(x, y) for x, y in zip(want_params, got_params))
        assert len(compiled._attachment.deferred) == 21  # 7 weights a block
        (graph,) = compiled.captured.dynamo
        calls = [n for n in graph.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
        assert len(calls) == 2  # layers.0 and layers.1; layers.2 inline, its weights built in its forward
        # the kind's verdict is what compile found (one region), not what the blocks' attributes say after the steps
        assert [r["why"] for r in compiled.regions()] == [None]
    finally:
        dist.destroy_process_group()


def test_a_float8_weight_read_outside_its_block_is_built_at_top_level():
    """A deferred float8 weight is None in its place outside its block during the step, so a model that reads
    one there (here the root's forward pre-hook, which reads a block's weight) failed in Dynamo's trace
    ("Observed exception") where eager FSDP2 runs. The step is traced again with the weights built at top
    level, with a warning that says so: two steps bitwise equal to eager FSDP2's with the float8 all-gather,
    the hook reading what it reads eagerly, one Dynamo graph, the blocks still one region."""
    pytest.importorskip("torchao.float8", reason="torchao (the test extra) is not installed")
    import torch.distributed as dist
    import torch.nn.functional as F

    def build():
        return _float8_llama(2, lambda m, args: setattr(
            m, "read", (m.layers[0].attention.wq.weight.shape, m.layers[1].feed_forward.w2.weight.dtype)))

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        eager, model = build(), build()
        compiled = fc.compile(model, backend="aot_eager")
        runs, reads = [], []
        for m, runner in ((eager, eager), (model, compiled)):
            opt, out = torch.optim.AdamW(m.parameters(), lr=1e-2), []
            for step in range(2):
                x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(step))
                if m is model and step == 0:
                    with pytest.warns(UserWarning, match="built at top level.*AttributeError"):
                        y = runner(x)
                else:
                    y = runner(x)
                reads.append(m.read)
                loss = F.cross_entropy(y.flatten(0, 1).float(), x.flatten())
                loss.backward()
                out.append((loss.detach(), [p.grad.to_local().clone() for p in m.parameters()]))
                opt.step()
                opt.zero_grad()
            runs.append(out)
        for (a, ga), (b, gb) in zip(*runs):
            assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))
        assert reads == [(torch.Size([64, 64]), torch.float32)] * 4, reads  # eager's two steps, then fc's
        assert len(compiled.captured.dynamo) == 1
        assert [r["why"] for r in compiled.regions()] == [None]
    finally:
        dist.destroy_process_group()


def test_the_step_retries_only_a_failed_first_trace_that_deferred_weights():
    """``Step.run``'s retry without deferred weights is taken only where it repeats nothing: the first call of a
    key, whose trace failed before reaching the backend, while the step defers weights. A failure after the
    backend took a graph (the graph may have run, and issued collectives), a later call's failure, or a step
    deferring nothing raises as it is."""
    from fsdp_compile._step import Step

    class Captured:
        def __init__(self):
            self.dynamo = []

    def step(deferred, fail):  # fail(deferred, captured) -> raise or not, per build
        s = Step.__new__(Step)
        s._compiled, s._deferred, s._ran, s.built = {}, deferred, set(), []

        def build(key, deferred):
            s.built.append(dict(deferred))

            def fn(captured):
                fail(deferred, captured)
                captured.dynamo.append("graph")
                return "out"
            return fn

        s._build = build
        return s

    def fails_while_deferred(deferred, captured):
        if deferred:
            raise RuntimeError("Observed exception\nDeveloper debug context: raised exception AttributeError('shape')")

    s, captured = step({"w": 0}, fails_while_deferred), Captured()
    with pytest.warns(UserWarning, match=r"built at top level.*AttributeError\('shape'\)"):
        assert s.run("k", captured, captured) == "out"
    assert s.built == [{"w": 0}, {}] and s.run("k", captured, captured) == "out" and len(s.built) == 2

    def fails_in_the_backend(deferred, captured):
        captured.dynamo.append("graph")
        raise RuntimeError("after the backend")

    def fails(deferred, captured):
        raise RuntimeError("a step that defers nothing")

    for deferred, fail in (({"w": 0}, fails_in_the_backend), ({}, fails)):
        s, captured = step(deferred, fail), Captured()
        with pytest.raises(RuntimeError):
            s.run("k", captured, captured)
        assert len(s.built) == 1, (deferred, s.built)

    calls = []

    def fails_the_second_call(deferred, captured):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the second call")

    s, captured = step({"w": 0}, fails_the_second_call), Captured()
    s.run("k", captured, captured)
    with pytest.raises(RuntimeError, match="the second call"):
        s.run("k", captured, captured)
    assert len(s.built) == 1
