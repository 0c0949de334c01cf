"""Every bad input gets one line naming the problem and the fix: a table, on the fake process group.

Config fields fail when the ``CompileConfig`` is made; model and option problems (an explicit bucket
plan's included) when ``compile`` (or ``explain``) is called, before any trace; plan problems at the first
call, where the schedule is planned, still before any trace. The command line's own table is in ``test_cli.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard

import fsdp_compile as fc
from dist_helpers import fake_process_group
from models import Llama, LlamaArgs, shard


def llama(n_layers: int = 2, **fsdp):
    torch.manual_seed(0)
    m = Llama(LlamaArgs(n_layers=n_layers))
    return shard(m, m.layers, **fsdp)


def tokens(dtype=torch.long, device="cpu"):
    return torch.randint(0, 256, (2, 16)).to(dtype=dtype, device=device)


def config(**kw):
    return lambda tmp: fc.CompileConfig(**kw)


def hsdp_stage_without_all_reduce():
    """A compiled pipeline stage on a 2 x 4 mesh whose backward ends with sync on and all-reduce off."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    stage = fc.compile_stage(llama(mesh=mesh), backend="aot_eager")
    stage.set_requires_all_reduce(False)
    stage(tokens()).sum().backward()


def extension_stage():
    from extensions import Int8Gathered, convert_linears

    torch.manual_seed(0)
    model = convert_linears(Llama(LlamaArgs(n_layers=2)), Int8Gathered)
    return fc.compile_stage(shard(model, list(model.layers)))


def compile_(model_fn, **kw):
    return lambda tmp: fc.compile(model_fn(), **kw)


def first_call(model_fn, inputs=tokens, **kw):
    def run(tmp):
        compiled = fc.compile(model_fn(), backend="aot_eager", **kw)
        compiled(inputs())

    return run


def unshard_in_backward_block():
    """set_unshard_in_backward(False) on a block whose backward needs its weights (eager FSDP2 fails there):
    refused when the backward graph is made, at the first call."""
    compiled = fc.compile(llama(), backend="aot_eager")
    compiled.layers[0].set_unshard_in_backward(False)
    compiled(tokens()).float().sum().backward()


def meta_llama():
    with torch.device("meta"):
        return llama()


def tensor_parallel_block():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    parallelize_module(m[0], mesh["tp"], ColwiseParallel())
    fully_shard(m, mesh=mesh["dp"], reshard_after_forward=2)  # FSDP2 refuses it for DTensor parameters
    return m


def partly_meta_llama():
    torch.manual_seed(0)
    m = Llama(LlamaArgs(n_layers=2))
    m.layers[1].to_empty(device="meta")  # one block never materialized
    return shard(m, m.layers)


def replicate_only_llama():
    """dp_mesh_dims naming a replicate dim only: FSDP2's DDP (its DDPMeshInfo). A shard dim is compiled
    (``test_torchtitan_multirank``'s full_dtensor cases)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims

    from torch.distributed.tensor import distribute_module

    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    m = distribute_module(Llama(LlamaArgs(n_layers=2)), mesh)  # every parameter a Replicate() DTensor
    return shard(m, m.layers, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp"))


def replicated_on_spmd_mesh():
    """torch.distributed._composable.replicate_with_fsdp.replicate with dp_mesh_dims (parameters Replicate() DTensors
    on the SPMD mesh). replicate(module) on a 1-D mesh is compiled (test_parity_multirank's replicate cases)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import distribute_module

    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    m = distribute_module(Llama(LlamaArgs(n_layers=2)), mesh)
    for layer in m.layers:
        replicate(layer, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp"))
    return replicate(m, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(replicate="dp"))


def fully_shard_inside_replicate():
    """fully_shard blocks under a replicate root (the other order, replicate blocks under a fully_shard root, is
    compiled: test_parity_multirank's replicate=blocks case)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    torch.manual_seed(0)
    m = Llama(LlamaArgs(n_layers=2))
    for layer in m.layers:
        fully_shard(layer)
    return replicate(m)


def unknown_mesh_info():
    """A parameter group whose mesh info is none of FSDP2's three kinds (FSDP, HSDP, DDP)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import DataParallelMeshInfo

    class OtherMeshInfo(DataParallelMeshInfo):
        pass

    m = llama()
    group = m.layers[1]._get_fsdp_state()._fsdp_param_groups[0]
    group.mesh_info = OtherMeshInfo(group.mesh_info.mesh, shard_mesh_dim=0)
    return m


def float8_on_spmd_mesh():
    """torchao's float8 all-gather (an FSDP2 all-gather extension) with dp_mesh_dims."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import distribute_module

    pytest.importorskip("torchao.float8", reason="torchao (the test extra) is not installed")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    m = Llama(LlamaArgs(n_layers=2))
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    convert_to_float8_training(m, config=config, module_filter_fn=lambda _, fqn: fqn != "output")
    m = distribute_module(m, mesh)
    return shard(m, m.layers, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))


def shard_dim_1():
    from torch.distributed.tensor import Shard

    return llama(shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)


def per_param_mesh_root():
    """The root's output head on a 4-rank mesh by shard_placement_fn (two parameter groups) around its blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    head = FSDPMeshInfo(init_device_mesh("cpu", (4, 2), mesh_dim_names=("efsdp", "ep"))["efsdp"], shard_mesh_dim=0)
    torch.manual_seed(0)
    m = Llama(LlamaArgs(n_layers=2))
    output = m.output.weight
    place = lambda p: ShardPlacementResult(placement=Shard(0), mesh_info=head) if p is output else None  # noqa: E731
    return shard(m, m.layers, root_kwargs={"shard_placement_fn": place})


def offloaded_extension_on_accelerator():
    """CPUOffloadPolicy with an all-gather extension on a model whose FSDP2 device is an accelerator. No
    accelerator here: the CPU model's param groups are told theirs is ``cuda``, which is all the refusal reads."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    from extensions import Int8Gathered, convert_linears

    torch.manual_seed(0)
    m = convert_linears(Llama(LlamaArgs(n_layers=2)), Int8Gathered)
    shard(m, list(m.layers), offload_policy=CPUOffloadPolicy(pin_memory=False))
    for module in m.modules():
        if hasattr(module, "_get_fsdp_state"):
            for pg in module._get_fsdp_state()._fsdp_param_groups:
                pg.device = torch.device("cuda")
    return m


def with_setter(setter: str, *args, hsdp: bool = False):
    """A model whose root had FSDP2's ``setter(*args)`` called before ``compile``."""

    def make():
        kw = {}
        if hsdp:
            from torch.distributed.device_mesh import init_device_mesh

            kw["mesh"] = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        m = llama(**kw)
        getattr(m, setter)(*args)
        return m

    return make


def dump_dir_taken_after_config(tmp):
    cfg = fc.CompileConfig(dump_dir=str(tmp / "later" / "dump"))
    (tmp / "later").write_text("not a directory")
    fc.compile(llama(), cfg)


class NotAFile:
    """dump_dir below a file: not a directory, for any user (root ignores write permissions)."""


ROWS = [
    # CompileConfig: every field's type and range
    ("backend unknown", config(backend="eager"), ValueError, r"backend must be one of 'inductor', 'aot_eager'.*got 'eager'"),
    ("backend None", config(backend=None), ValueError, r"backend must be one of .* got None \(NoneType\)"),
    ("backend callable", config(backend=print), ValueError, r"backend must be one of .*fsdp_compile runs its passes"),
    ("bucket unknown", config(bucket="sometimes"), ValueError, r"bucket must be one of 'none', 'fsdp_group', 'auto'"),
    ("bucket number", config(bucket=7), TypeError, r"bucket must be 'none', 'fsdp_group', 'auto' or a list of lists"),
    ("bucket empty plan", config(bucket=[]), ValueError, r"needs at least one bucket"),
    ("bucket empty bucket", config(bucket=[[]]), ValueError, r"needs non-empty buckets"),
    ("bucket flat list", config(bucket=["layers.0", "layers.1"]), ValueError, r"is a flat list.*bucket=\[\['layers.0', 'layers.1'\]\]"),
    ("bucket mixed", config(bucket=[["layers.0"], "layers.1"]), TypeError, r"every bucket of the plan is a list of FSDP module FQNs"),
    ("bucket non-string", config(bucket=[["layers.0", 3]]), TypeError, r"holds 3 \(int\): name FSDP modules by their FQN strings"),
    ("bucket twice", config(bucket=[["layers.0"], ["layers.0"]]), ValueError, r"names 'layers.0' twice"),
    ("bucket_cap_mb string", config(bucket_cap_mb="10"), TypeError, r"bucket_cap_mb must be a number of MiB > 0 or None, got '10' \(str\)"),
    ("bucket_cap_mb bool", config(bucket_cap_mb=True), TypeError, r"bucket_cap_mb must be a number"),
    ("bucket_cap_mb zero", config(bucket_cap_mb=0), ValueError, r"bucket_cap_mb must be a number of MiB > 0"),
    ("bucket_cap_mb negative", config(bucket_cap_mb=-5), ValueError, r"bucket_cap_mb must be a number of MiB > 0"),
    ("bucket_cap_mb infinite", config(bucket_cap_mb=float("inf")), ValueError, r"bucket_cap_mb must be a number of MiB > 0"),
    ("reorder string", config(reorder="no"), TypeError, r"reorder must be True or False, got 'no' \(str\)"),
    ("reorder int", config(reorder=0), TypeError, r"reorder must be True or False"),
    ("regions string", config(regions="yes"), TypeError, r"regions must be True or False"),
    ("cudagraphs string", config(cudagraphs="yes"), TypeError, r"cudagraphs must be True or False"),
    ("cudagraphs on CPU", compile_(llama, cudagraphs=True), ValueError,
     r"cudagraphs=True replays CUDA graphs, but the model's parameters are on cpu: leave cudagraphs off there"),
    ("memory_budget_gb zero", config(memory_budget_gb=0), ValueError, r"memory_budget_gb must be a number of GiB > 0"),
    ("memory_budget_gb string", config(memory_budget_gb="1"), TypeError, r"memory_budget_gb must be a number of GiB"),
    ("memory_budget_gb nan", config(memory_budget_gb=float("nan")), ValueError, r"memory_budget_gb must be a number of GiB > 0"),
    ("hardware unknown", config(hardware="tpu"), ValueError, r"hardware must be one of 'auto', 'h100-nvlink'"),
    ("hardware case", config(hardware="H100-NVLINK"), ValueError, r"hardware must be one of"),
    ("kernels unknown", config(kernels="cuda"), ValueError, r"kernels must be one of 'auto', 'triton', 'torch'"),
    ("dump_dir not a path", config(dump_dir=123), TypeError, r"dump_dir must be a directory path or None"),
    ("dump_dir below a file", lambda tmp: fc.CompileConfig(dump_dir=str(tmp / "file" / "dump")), ValueError,
     r"dump_dir='.*file/dump' is not a directory .*point it at a directory you can write"),
    ("FSDP_COMPILE_DUMP below a file", "env", ValueError, r"\$FSDP_COMPILE_DUMP='.*file/dump' is not a directory"),
    # the dump directory is created when compile is called: what the config's check cannot foresee fails there
    ("dump_dir name too long", lambda tmp: fc.compile(llama(), dump_dir=str(tmp / ("d" * 300))), ValueError,
     r"dump_dir='.*d{300}' cannot hold the dump: .* \('.*d{300}'\); point it at a directory you can write"),
    ("dump_dir a file by the time of compile", dump_dir_taken_after_config, ValueError,
     r"dump_dir='.*later/dump' cannot hold the dump: Not a directory .*point it at a directory you can write"),
    ("unknown option", lambda tmp: fc.CompileConfig().replace(bucket_size=3), TypeError, r"unknown CompileConfig option\(s\) \['bucket_size'\]"),
    ("unknown override", compile_(llama, bucket_sizes=1), TypeError, r"unknown CompileConfig option\(s\) \['bucket_sizes'\]"),
    ("config of another type", compile_(llama, config={"backend": "aot_eager"}), TypeError, r"config must be a fsdp_compile.CompileConfig, got dict"),
    # models
    ("not sharded", lambda tmp: fc.compile(nn.Linear(4, 4)), ValueError, r"has no module sharded by fully_shard: call .*fully_shard"),
    ("torch.compile'd", lambda tmp: fc.compile(torch.compile(llama())), TypeError, r"torch.compile'd module; pass the uncompiled"),
    ("compiled twice", lambda tmp: fc.compile(fc.compile(llama())), TypeError, r"already compiled by fsdp_compile.compile"),
    ("meta parameters", compile_(meta_llama), ValueError, r"still on the meta device .*materialize them before training"),
    ("some parameters on meta", compile_(partly_meta_llama), ValueError, r"parameters are still on the meta device \(e.g. 'layers.1\."),
    ("int reshard_after_forward with tensor parallel", compile_(tensor_parallel_block), NotImplementedError,
     r"reshard_after_forward=2 \(an int\) with parameter '0.weight' a DTensor .*FSDP2 itself does not support"),
    ("dp_mesh_dims", compile_(replicate_only_llama), NotImplementedError,
     r"dp_mesh_dims=DataParallelMeshDims\(replicate=\.\.\.\)\) without a shard dim .*name a shard dim too"),
    ("replicate with dp_mesh_dims", compile_(replicated_on_spmd_mesh), NotImplementedError,
     r"FSDP module '<root>': replicate\(\.\.\., dp_mesh_dims=DataParallelMeshDims\(replicate=\.\.\.\)\) without a shard dim "
     r".*pass the data-parallel mesh as mesh= \(a 1-D mesh, no dp_mesh_dims\)"),
    ("fully_shard inside replicate", compile_(fully_shard_inside_replicate), NotImplementedError,
     r"FSDP module 'layers.0': fully_shard inside replicate module '<root>' .*replicate the blocks and fully_shard the root"),
    ("unknown mesh info", compile_(unknown_mesh_info), NotImplementedError,
     r"FSDP module 'layers.1': fully_shard\(\.\.\.\) gave it FSDP2's OtherMeshInfo, which fsdp_compile.compile does not"),
    ("dp_mesh_dims with float8", compile_(float8_on_spmd_mesh), NotImplementedError,
     r"an all-gather extension \(WeightWithDynamicFloat8CastTensor\) with fully_shard\(\.\.\., dp_mesh_dims=\.\.\.\)"),
    ("Shard(1) placements", compile_(shard_dim_1), NotImplementedError, r"only Shard\(0\) placements"),
    ("per-parameter meshes around FSDP modules", compile_(per_param_mesh_root), NotImplementedError,
     r"FSDP module '<root>' has 2 parameter groups \(per-parameter meshes from shard_placement_fn\) and holds other"),
    ("offload with an all-gather extension on an accelerator", compile_(offloaded_extension_on_accelerator),
     NotImplementedError, r"parameter '\S+': an all-gather extension \(Int8Gathered\) with "
     r"offload_policy=CPUOffloadPolicy\(\) on cuda is not supported .*train it with eager FSDP2, or drop the offload"),
    # FSDP2 setters we cannot compile: refused naming the setter (set after compile: at the next call)
    ("set_reshard_after_backward", compile_(with_setter("set_reshard_after_backward", False)), NotImplementedError,
     r"set_reshard_after_backward\(False\) keeps the parameters unsharded"),
    ("compile_stage of a module fully_shard did not shard", lambda tmp: fc.compile_stage(nn.Linear(4, 4)), TypeError,
     r"compile_stage takes the stage's fully_shard module, got Linear"),
    ("compile_stage with an all-gather extension", lambda tmp: extension_stage(), NotImplementedError,
     r"parameter '.*' has an all-gather extension \(fsdp_pre_all_gather\): compile_stage does not"),
    ("compile_stage: set_requires_all_reduce(False) at the end of a backward", lambda tmp: hsdp_stage_without_all_reduce(),
     NotImplementedError, r"set_requires_all_reduce\(False\) on an HSDP pipeline stage"),
    ("set_unshard_in_backward where backward needs the parameters", lambda tmp: unshard_in_backward_block(),
     NotImplementedError, r"'layers.0' has set_unshard_in_backward\(False\), but its backward needs its parameters .*"
     r"call set_unshard_in_backward\(True\) on it, or shard it with reshard_after_forward=False"),
    ("set_reduce_scatter_unused_params", compile_(with_setter("set_reduce_scatter_unused_params", True)),
     NotImplementedError, r"set_reduce_scatter_unused_params\(True\)"),
    ("set_reduce_scatter_max_input_buffers", compile_(with_setter("set_reduce_scatter_max_input_buffers", 2)),
     NotImplementedError, r"set_reduce_scatter_max_input_buffers\(2\)"),
    ("set_allocate_memory_from_process_group_for_comm",
     compile_(with_setter("set_allocate_memory_from_process_group_for_comm", True)), NotImplementedError,
     r"set_custom_all_gather / set_custom_reduce_scatter"),
    ("set_separate_reduce_scatter_group", compile_(with_setter("set_separate_reduce_scatter_group", True)),
     NotImplementedError, r"set_separate_reduce_scatter_group\(True\)"),
    ("set_all_reduce_hook", compile_(with_setter("set_all_reduce_hook", lambda grad: None)), NotImplementedError,
     r"set_all_reduce_hook"),
    ("config to explain", lambda tmp: fc.explain(llama(), tokens(), backend="aot_eager"), TypeError,
     r"explain\(\) got backend='aot_eager'.*config=fsdp_compile.CompileConfig\(backend='aot_eager'\)"),
    # options checked against the model, before any trace
    ("bucket names no module", compile_(llama, bucket=[["layers.9"]]), ValueError, r"names 'layers.9', which is not an FSDP module"),
    ("bucket not adjacent", compile_(lambda: llama(3), bucket=[["layers.0", "layers.2"], ["layers.1"]]), ValueError,
     r"bucket \['layers.0', 'layers.2'\] joins FSDP modules that are not adjacent in forward order: \['layers.1'\] run "
     r"between 'layers.0' and 'layers.2'; .*add \['layers.1'\] to it, or split it"),
    ("bucket not adjacent, reshard differs too", compile_(llama, bucket=[["", "layers.1"]]), ValueError,
     r"bucket \['', 'layers.1'\] joins FSDP modules that are not adjacent in forward order: \['layers.0'\] run between ''"),
    ("bucket mixes reshard", compile_(llama, bucket=[["", "layers.0"]]), ValueError,
     r"bucket \['', 'layers.0'\] mixes FSDP modules .* differ in reshard_after_forward \(False vs True\); split it"),
    ("bucket_cap_mb below a module", compile_(llama, bucket_cap_mb=0.001), ValueError, r"bucket_cap_mb=0.001 is below FSDP module"),
    # at the first call, where the schedule is planned
    ("memory budget too small", first_call(llama, memory_budget_gb=1e-9), ValueError, r"memory_budget_gb=1e-09 is below the .* MiB .*raise it, or leave it None"),
    # inputs
    ("input on another device", first_call(llama, inputs=lambda: tokens(device="meta")), ValueError, r"is on meta, but the model's parameters are on cpu: move the inputs there"),
    ("input of the wrong dtype", first_call(llama, inputs=lambda: tokens(dtype=torch.float32)), Exception, r"Long"),
]


@pytest.mark.parametrize("name, call, exc, match", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input(name, call, exc, match, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a directory")
    if call == "env":
        monkeypatch.setenv("FSDP_COMPILE_DUMP", str(tmp_path / "file" / "dump"))
        call = lambda tmp: fc.CompileConfig()  # noqa: E731
    with fake_process_group(8):
        with pytest.raises(exc, match=match) as info:
            call(tmp_path)
    if exc is not Exception:  # our own errors: one line (the model's own dtype error comes from the model)
        assert "\n" not in str(info.value), str(info.value)


def test_the_table_is_long_enough():
    assert len(ROWS) >= 40
    assert {f.name for f in dataclasses.fields(fc.CompileConfig)} <= {r[0].split()[0] for r in ROWS}


def test_compile_creates_the_dump_dir(tmp_path, monkeypatch):
    """Before any call, so a dump directory that cannot be made fails at compile, not at the first step."""
    with fake_process_group(8):
        fc.compile(llama(), dump_dir=str(tmp_path / "a" / "dump"))
        monkeypatch.setenv("FSDP_COMPILE_DUMP", str(tmp_path / "b" / "dump"))
        fc.compile(llama())
        monkeypatch.setenv("FSDP_COMPILE_DUMP", str(tmp_path / ("e" * 300)))
        with pytest.raises(ValueError, match=r"\$FSDP_COMPILE_DUMP='.*e{300}' cannot hold the dump"):
            fc.compile(llama())
    assert (tmp_path / "a" / "dump").is_dir() and (tmp_path / "b" / "dump").is_dir()
    assert not list((tmp_path / "a" / "dump").iterdir())  # the probe file is gone


def test_our_messages_quote_another_librarys_error_by_its_first_line():
    """What our errors quote of Dynamo's, gloo's or NCCL's (``fsdp_compile._quote.quoted``): the type and the first
    line that says something, cut to a limit; the type alone where the error says nothing."""
    from fsdp_compile._quote import quoted

    assert quoted(RuntimeError("\n  [gloo] Timed out  \nframe 1\nframe 2")) == "RuntimeError: [gloo] Timed out"
    assert quoted(ValueError("x" * 500), 200) == "ValueError: " + "x" * 200
    assert quoted(KeyError()) == "KeyError"
    assert quoted(RuntimeError(" \n ")) == "RuntimeError"
