"""``fsdp_compile._fsdp2``, the one reader of FSDP2's private state: one test per accessor, on the fake
process group (on a real one of a single rank where FSDP2 moves data), and the error a torch without an
attribute gives.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.placement_types import Shard

from dist_helpers import fake_process_group
from fsdp_compile import _fsdp2
from models import Llama, LlamaArgs, shard


def _llama(n_layers=2, **fsdp):
    torch.manual_seed(0)
    m = Llama(LlamaArgs(n_layers=n_layers))
    return shard(m, m.layers, **fsdp)


@pytest.fixture
def fake4():
    with fake_process_group(4, rank=1):
        yield


@pytest.fixture
def gloo1():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _group(model, fqn):
    """The state and parameter group of FSDP module ``fqn``, after FSDP2's lazy init (as ``read_plan``)."""
    _fsdp2.lazy_init(_fsdp2.states(model)[0][2])
    state = next(s for f, _, s in _fsdp2.states(model) if f == fqn)
    return state, _fsdp2.param_groups(state)[0]


def test_states_in_pre_order(fake4):
    m = _llama()
    assert [f for f, _, _ in _fsdp2.states(m)] == ["", "layers.0", "layers.1"]
    torch.manual_seed(0)
    g = Llama(LlamaArgs(n_layers=3))
    fully_shard([g.layers[0], g.layers[1]])  # one state for two modules, named by the first
    fully_shard(g)
    states = _fsdp2.states(g)
    assert [f for f, _, _ in states] == ["", "layers.0"]
    assert _fsdp2.modules(states[1][2]) == (g.layers[0], g.layers[1])


def test_composable_checkpoint(fake4):
    from torch.distributed._composable import checkpoint

    torch.manual_seed(0)
    m = Llama(LlamaArgs(n_layers=2))
    checkpoint(m.layers[0])
    assert _fsdp2.composable_checkpoint(m.layers[0]) and not _fsdp2.composable_checkpoint(m.layers[1])
    kwargs, hooks = _fsdp2.composable_checkpoint_hooks(m.layers[0])
    assert kwargs == {"preserve_rng_state": True, "determinism_check": "default", "debug": False}
    assert [held is m.layers[0]._forward_pre_hooks for held, _ in hooks] == [True, False]
    context = lambda: (contextlib.nullcontext(), contextlib.nullcontext())  # noqa: E731
    checkpoint(m.layers[1], preserve_rng_state=False, context_fn=context)
    kwargs, _ = _fsdp2.composable_checkpoint_hooks(m.layers[1])
    assert kwargs["preserve_rng_state"] is False and kwargs["context_fn"] is context


def test_lazy_init_and_param_groups(fake4):
    m = _llama()
    for _, _, state in _fsdp2.states(m):
        _fsdp2.lazy_init(state)
        _fsdp2.lazy_init(state)  # idempotent
    _, pg = _group(m, "layers.0")
    assert len(_fsdp2.param_groups(_group(m, "layers.0")[0])) == 1 and _fsdp2.is_sharded(pg)
    empty = nn.Module()
    empty.inner = nn.Linear(2, 2)
    fully_shard(empty.inner)
    fully_shard(empty)  # the root owns no parameter of its own
    assert _fsdp2.param_groups(_fsdp2.states(empty)[0][2]) == []


def test_lazy_init_of_a_meta_model(fake4):
    with torch.device("meta"):
        m = _llama()
    (_, _, root), *_ = _fsdp2.states(m)
    with pytest.raises(Exception, match="meta"):
        _fsdp2.lazy_init(root)  # FSDP2 refuses meta parameters ...
    _fsdp2.lazy_init(root, allow_meta=True)  # ... unless asked for this call only
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    assert FSDPParamGroup._validate_no_meta_params.__name__ == "_validate_no_meta_params"  # restored


def test_prefetch_lists(fake4):
    m = _llama(3)
    m.layers[0].set_modules_to_forward_prefetch([m.layers[1], m.layers[2]])
    m.layers[2].set_modules_to_backward_prefetch([m.layers[0]])
    by_fqn = {f: s for f, _, s in _fsdp2.states(m)}
    assert _fsdp2.prefetch(by_fqn["layers.0"]) == ([by_fqn["layers.1"], by_fqn["layers.2"]], [])
    assert _fsdp2.prefetch(by_fqn["layers.2"]) == ([], [by_fqn["layers.0"]])


def test_forward_hooks_are_registered_on_the_modules(fake4):
    m = _llama()
    state, _ = _group(m, "layers.0")
    pre, post = _fsdp2.forward_hooks(state)
    from fsdp_compile.capture.hooks import _wraps

    assert any(_wraps(h, pre) for h in m.layers[0]._forward_pre_hooks.values())
    assert any(_wraps(h, post) for h in m.layers[0]._forward_hooks.values())


def test_mp_policy_and_cast(fake4):
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32)
    m = _llama(mp_policy=policy)
    state, _ = _group(m, "layers.1")
    assert _fsdp2.mp_policy(state) == policy
    out = _fsdp2.floating_cast(torch.bfloat16)((torch.ones(2), {"ids": torch.ones(2, dtype=torch.long)}))
    assert out[0].dtype == torch.bfloat16 and out[1]["ids"].dtype == torch.long


def test_settings_follow_the_setters(fake4):
    m = _llama()
    state, pg = _group(m, "layers.0")
    before = _fsdp2.settings(state, pg)
    assert before.requires_gradient_sync and before.reshard_after_forward and before.reshard_after_backward
    assert (before.all_gather_comm, before.reduce_scatter_comm) == ("DefaultAllGather", "DefaultReduceScatter")
    m.layers[0].set_requires_gradient_sync(False)
    m.layers[0].set_reshard_after_forward(False)
    m.layers[0].set_gradient_divide_factor(3.0)
    m.layers[0].set_modules_to_backward_prefetch([m.layers[1]])
    after = _fsdp2.settings(state, pg)
    assert not after.requires_gradient_sync and not after.reshard_after_forward
    assert after.gradient_divide_factor == 3.0 and after.backward_prefetch == (id(_group(m, "layers.1")[0]),)
    assert after.without_sync_flags().requires_gradient_sync  # the plan's view: sync is a mode, not a plan
    assert after.without_sync_flags() != before.without_sync_flags()  # ... the other settings are


def test_layout_of_a_group(fake4):
    m = _llama(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    _, pg = _group(m, "layers.0")
    layout = _fsdp2.layout(pg)
    assert layout.device.type == "cpu" and not layout.offload_to_cpu and not layout.spmd_mesh
    assert layout.all_gather_group.size() == 4 and layout.all_reduce_group is None and layout.post_forward is None
    assert layout.shard_mesh_rank == 1 and layout.reduce_dtype == torch.float32
    names = [p.fqn for p in layout.params]
    assert names[:2] == ["layers.0.attention_norm.weight", "layers.0.attention.wq.weight"]
    first = layout.params[1]
    assert first.sharded_param is m.layers[0].attention.wq.weight and first.placement == Shard(0)
    assert (first.param_dtype, first.orig_dtype) == (torch.bfloat16, torch.float32)
    assert first.unsharded_spec is None and not first.all_gather_extension
    assert first.spmd_grad_placements is None  # not annotated by spmd_types (torch 2.13 has no such parameters)
    assert first.unsharded_shape == (64, 64)
    assert first.places == ((m.layers[0].attention.wq, "weight"),)  # where FSDP2 sets its (un)sharded parameter


def test_layout_tensor_parallel():
    """A parameter that was a DTensor before fully_shard: what its all-gather rebuilds is its TP-local
    tensor, and its spec is the TP one (mesh, placements, global shape) the module is handed back."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    with fake_process_group(4, rank=3):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        m = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 8))
        parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        fully_shard(m, mesh=mesh["dp"])
        _, pg = _group(m, "")
        params = {p.fqn: p for p in _fsdp2.layout(pg).params}
        col, row, bias = params["0.weight"], params["1.weight"], params["1.bias"]
        assert col.unsharded_shape == (3, 8) and tuple(col.unsharded_spec.shape) == (6, 8)
        assert col.unsharded_spec.placements == (Shard(0),) and col.unsharded_spec.mesh.mesh_dim_names == ("tp",)
        assert row.unsharded_shape == (8, 3) and row.unsharded_spec.placements == (Shard(1),)
        assert bias.unsharded_shape == (8,) and bias.unsharded_spec.placements == (Replicate(),)
        assert col.sharded_param.to_local().shape == (1, 8)  # dp rank 1 of the TP-local (3, 8): its last row


def test_spmd_types_gradient_moves():
    """What ``_param_specs.parallel_spec`` makes of an spmd_types parameter (torch >= 2.14) from FSDP2's storage
    placements and ``_spmd_grad_placements`` on a (dp_shard, tp) mesh: nothing moved off the data-parallel dims,
    a plain FSDP parameter (None); Partial(sum) -> Replicate on tp (an R-typed weight), the all-reduce fc builds;
    any other move refused, naming it (a P-typed weight: its Replicate gradient stored Partial)."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Partial, Replicate

    from fsdp_compile._param_specs import parallel_spec

    mesh = SimpleNamespace(mesh_dim_names=("dp_shard", "tp"), ndim=2)

    def spec(*placements):
        return SimpleNamespace(mesh=mesh, placements=placements, shape=(8,), stride=(1,))

    assert parallel_spec("w", spec(Replicate(), Shard(0)), (0,), (Partial(), Shard(0))) is None
    norm = parallel_spec("w", spec(Replicate(), Replicate()), (0,), (Partial(), Partial()))
    assert norm.grad_placements == (Partial(), Partial()) and norm.dp_dims == (0,)
    assert "plain tensor" in norm.describe()
    with pytest.raises(NotImplementedError, match=r"tp: R -> P\(sum\)"):
        parallel_spec("w", spec(Replicate(), Partial()), (0,), (Partial(), Replicate()))


def test_layout_hsdp_int_reshard_and_offload():
    from torch.distributed.device_mesh import init_device_mesh

    with fake_process_group(8, rank=5):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        _, pg = _group(_llama(mesh=mesh), "layers.0")
        hsdp = _fsdp2.layout(pg)
        assert hsdp.all_gather_group.size() == 4 and hsdp.all_reduce_group.size() == 2
        _, pg = _group(_llama(reshard_after_forward=2), "layers.0")
        group, size, rank = _fsdp2.layout(pg).post_forward
        assert (size, rank, group.size()) == (2, 1, 2)
        _, pg = _group(_llama(offload_policy=CPUOffloadPolicy(pin_memory=False)), "layers.0")
        assert _fsdp2.layout(pg).offload_to_cpu


def test_gradient_divide_factors(fake4):
    _, pg = _group(_llama(), "layers.0")
    group = _fsdp2.layout(pg).all_gather_group
    pre, post, op, _ = _fsdp2.gradient_divide_factors(group, None, torch.float32, "cpu", None, False)
    assert (pre, post, op) == (None, None, dist.ReduceOp.AVG)
    pre, post, op, _ = _fsdp2.gradient_divide_factors(group, None, torch.float16, "cpu", None, False)
    assert op == dist.ReduceOp.SUM and pre * post == 4


def test_unshard_state_and_reshard(gloo1):
    m = _llama()
    _, pg = _group(m, "layers.0")
    handle = m.layers[0].unshard(async_op=True)
    assert _fsdp2.all_gather_in_flight(pg)
    handle.wait()
    assert not _fsdp2.all_gather_in_flight(pg) and not _fsdp2.is_sharded(pg)
    _fsdp2.reshard(pg)
    assert _fsdp2.is_sharded(pg)


def test_reset_sharded_params(gloo1):
    m = _llama()
    _, pg = _group(m, "layers.0")
    sd = {k: v.detach().clone() for k, v in m.layers[0].state_dict().items()}
    m.layers[0].load_state_dict(sd, assign=True)  # new parameter objects on the module
    _fsdp2.reset_sharded_params(pg)
    layout = _fsdp2.layout(pg)
    assert layout.params[1].sharded_param is m.layers[0].attention.wq.weight


def test_a_missing_attribute_names_it_and_the_torch_we_test(fake4, monkeypatch):
    m = _llama()
    state, pg = _group(m, "layers.0")
    monkeypatch.delattr(type(pg), "reduce_scatter_unused_params", raising=False)
    monkeypatch.delattr(pg, "reduce_scatter_unused_params", raising=False)
    with pytest.raises(_fsdp2.FSDP2Changed, match=r"FSDPParamGroup\.reduce_scatter_unused_params, which torch .* does "
                       r"not have: fsdp_compile is tested with torch 2\.13\.x and 2\.14\.x; install torch==2\.13\.0"):
        _fsdp2.settings(state, pg)
    with pytest.raises(_fsdp2.FSDP2Changed, match=r"_fsdp_common\.no_such_thing"):
        _fsdp2._private("_fsdp_common", "no_such_thing")


def test_an_untested_torch_is_warned_once(monkeypatch):
    import warnings

    _fsdp2.warn_if_untested_torch.cache_clear()
    monkeypatch.setattr(torch, "__version__", "2.15.0+cu130")
    try:
        with pytest.warns(UserWarning, match=r"tested with torch 2\.13\.x and 2\.14\.x, not 2\.15\.0.*install torch==2\.13\.0"):
            assert _fsdp2.warn_if_untested_torch()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            _fsdp2.warn_if_untested_torch()  # once per process
        _fsdp2.warn_if_untested_torch.cache_clear()
        for tested in ("2.13.0+cpu", "2.14.1", "2.14.2+cu128"):
            monkeypatch.setattr(torch, "__version__", tested)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert not _fsdp2.warn_if_untested_torch()
            _fsdp2.warn_if_untested_torch.cache_clear()
    finally:
        _fsdp2.warn_if_untested_torch.cache_clear()
