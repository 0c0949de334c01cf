"""Eager ``fully_shard`` versus ``fsdp_compile.compile`` on the same seed, data and optimizer.

``run_case`` builds two identical sharded models, trains one eagerly and one compiled for a few steps,
and returns per-step losses and the largest differences of gradients and updated shards. Used by the
multi-rank tests (inside spawned gloo ranks) and by the demo.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_compile.passes.cost_model import CPU_GLOO
from models import FrozenBuffers, Llama, LlamaArgs, OddMLP, Patterns, shard

PATTERNS = ("rope_complex", "moe", "dropout_ckpt", "dropout_cw", "dropout_composable")  # models.Patterns

MP = {
    None: None,
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16_reduce_bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
    "fp16": MixedPrecisionPolicy(param_dtype=torch.float16),  # fp16 reduce: FSDP2's pre/post divide
}


@dataclasses.dataclass(frozen=True)
class Case:
    model: str = "llama"  # llama | llama_tied | llama_ac | llama_grouped | odd | frozen | one of PATTERNS
    reshard: bool | int | None = None  # None: fully_shard's default (True, root kept unsharded); int: post-forward mesh
    mp: str | None = None
    backend: str = "aot_eager"
    steps: int = 3
    accum: int = 1  # micro-batches per optimizer step (gradient accumulation)
    n_layers: int = 2
    bucket: object = "fsdp_group"  # CompileConfig.bucket (an explicit plan as a tuple of tuples)
    reorder: bool = False
    regions: bool = True  # CompileConfig.regions
    inline: bool = False  # a second compiled model with regions off, checked too (the differential guard)
    offload: bool | str = False  # CPUOffloadPolicy(pin_memory=False) on every FSDP module; "pinned": pin_memory=True (GPUs)
    # with offload: the accelerator's graphs (host-device copies around the collectives, ops.to_device/to_host)
    # built with cpu as the device (``host_copies``)
    host_copies: bool = False
    replicate: int = 1  # > 1: a (replicate, world/replicate) mesh, HSDP (= world: FSDP1's NO_SHARD)
    # with replicate > 1: every parameter a Replicate() DTensor on that mesh (distribute_module), fully_shard(...,
    # dp_mesh_dims=DataParallelMeshDims(shard="shard", replicate="replicate")), the batch a DTensor sharded on both
    spmd: bool = False
    # torch.distributed._composable.replicate_with_fsdp.replicate (FSDP2's DDPMeshInfo: replicated parameters,
    # all-reduced gradients) on the default 1-D mesh of every rank instead of fully_shard: "all" on every block and
    # the root; "blocks" on the blocks, the root fully_shard (a mixed model)
    ddp: str | None = None
    ignored: bool = False  # the root's norm weight in ignored_params: not sharded, its gradient not reduced
    ragged: bool = False  # batch shapes differ between ranks (rank invariance; the same shape every step of a rank)
    cudagraphs: bool = False  # CompileConfig.cudagraphs (CUDA only: tests/test_cuda.py)
    hardware: object = "auto"  # CompileConfig.hardware: a profile's name or a HardwareProfile (``FREE_OVERLAP``)

    @property
    def name(self) -> str:
        parts = [self.model, f"reshard={self.reshard}", f"mp={self.mp}", self.backend]
        if self.accum > 1:
            parts.append(f"accum={self.accum}")
        if self.bucket != "fsdp_group" or self.reorder:
            bucket = self.bucket if isinstance(self.bucket, str) else "plan"
            parts.append(f"bucket={bucket}" + ("+reorder" if self.reorder else ""))
        if not self.regions:
            parts.append("no-regions")
        if self.offload:
            parts.append("offload" + ("+pinned" if self.offload == "pinned" else "") + ("+host_copies" if self.host_copies else ""))
        if self.replicate > 1:
            parts.append(f"hsdp{self.replicate}")
        if self.spmd:
            parts.append("dp_mesh_dims")
        if self.ddp:
            parts.append(f"replicate={self.ddp}")
        if self.ignored:
            parts.append("ignored")
        if self.ragged:
            parts.append("ragged")
        if self.cudagraphs:
            parts.append("cudagraphs")
        if self.hardware != "auto":
            parts.append(f"hw={getattr(self.hardware, 'name', self.hardware)}")
        return "-".join(parts)


# cpu-gloo as it was before its contention share (hidden communication taken as free): the plans some cases were
# built to exercise (the root split on 4 ranks) are made with it
FREE_OVERLAP = dataclasses.replace(CPU_GLOO, name="cpu-gloo:free-overlap", comm_cpu_share=0.0)

_SPMD_MESHES: dict = {}


def build(case: Case):
    torch.manual_seed(0)
    if case.model.startswith("llama"):
        m = Llama(LlamaArgs(n_layers=case.n_layers, tie_embeddings=case.model == "llama_tied"))
        if case.model == "llama_ac":  # activation checkpointing per block, then fully_shard (torchtitan's order)
            from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

            m.layers = torch.nn.ModuleList(checkpoint_wrapper(b) for b in m.layers)
        blocks = list(m.layers)
        if case.model == "llama_grouped":  # fully_shard([layers.0, layers.1]): one FSDP group of two modules
            blocks = [blocks[:2], *blocks[2:]]
    elif case.model in PATTERNS:
        m = Patterns(case.model, n_layers=case.n_layers)
        blocks = list(m.layers)
    elif case.model == "odd":
        m = OddMLP()
        blocks = m.blocks
    elif case.model == "frozen":
        m = FrozenBuffers()
        blocks = m.blocks
    else:
        raise ValueError(case.model)
    kwargs = {}
    if case.offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=case.offload == "pinned")
    if case.reshard is not None:
        kwargs["reshard_after_forward"] = case.reshard
    if case.replicate > 1:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        shape = (case.replicate, dist.get_world_size() // case.replicate)
        kwargs["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
        if case.spmd:
            # one mesh for every model of the case: DTensor's sharding cache hands distribute_module's parameters
            # the first equal mesh it met, and FSDP2 wants the very mesh fully_shard gets
            kwargs["mesh"] = _SPMD_MESHES.setdefault(shape, kwargs["mesh"])
            from torch.distributed.fsdp import DataParallelMeshDims
            from torch.distributed.tensor import distribute_module

            m = distribute_module(m, kwargs["mesh"])
            kwargs["dp_mesh_dims"] = DataParallelMeshDims(shard="shard", replicate="replicate")
    root_kwargs = {}
    if MP[case.mp] is not None:
        kwargs["mp_policy"] = MP[case.mp]
        # the root casts its output back to fp32, as a training loop with a bf16 model wants
        root_kwargs["mp_policy"] = dataclasses.replace(MP[case.mp], output_dtype=torch.float32)
    if case.ignored:
        root_kwargs["ignored_params"] = {m.norm.weight}
    if case.ddp:
        from torch.distributed._composable.replicate_with_fsdp import replicate

        for b in blocks:
            replicate(b, **kwargs)
        if case.ddp == "blocks":
            from torch.distributed.fsdp import fully_shard

            return fully_shard(m, **{**kwargs, **root_kwargs})
        return replicate(m, **{**kwargs, **root_kwargs})
    return shard(m, blocks, root_kwargs, **kwargs)


def batch(case: Case, step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    if case.model.startswith("llama") or case.model in PATTERNS:
        return torch.randint(0, 256, (1, 12) if case.ragged and rank % 2 else (2, 16), generator=g)
    if case.model == "odd":
        return torch.randn(4, 6, generator=g)
    return torch.randint(0, 32, (2, 8), generator=g)


def spmd_input(case: Case, model, x):
    """``case.spmd``: the batch as a DTensor sharded over every data-parallel dim of the parameters' mesh."""
    if not case.spmd:
        return x
    from torch.distributed.tensor import DTensor, Shard

    mesh = next(model.parameters()).device_mesh
    return DTensor.from_local(x, mesh, [Shard(0)] * mesh.ndim, run_check=False)


def loss_fn(case: Case, out, inp):
    if case.spmd:  # a DTensor: every rank's loss, summed
        return out.float().pow(2).sum()
    if case.model.startswith("llama") or case.model in PATTERNS:
        return F.cross_entropy(out.flatten(0, 1).float(), inp.flatten())
    return out.float().pow(2).mean()


def _value(loss) -> float:
    return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item()


def max_diff(xs, ys) -> float:
    d = 0.0
    for x, y in zip(xs, ys):
        if x is None or y is None:
            if (x is None) != (y is None):
                return float("inf")
            continue
        x, y = x.to_local() if hasattr(x, "to_local") else x, y.to_local() if hasattr(y, "to_local") else y
        if x.numel():
            d = max(d, (x.float() - y.float()).abs().max().item())
    return d


def step_guards(compiled) -> str:
    """The guards of a compiled model's one compiled step, as Dynamo prints them."""
    (step,) = compiled._steps.values()
    (fn,) = step._compiled.values()
    (entry,) = torch._dynamo.eval_frame._debug_get_cache_entry_list(fn._torchdynamo_orig_callable.__code__)
    return str(entry.guard_manager)


def record_step(out: dict, eager, model, opts) -> None:
    """The end of one optimizer step of eager FSDP2 (``eager``) and the compiled model's ``model`` side by
    side: the largest gradient difference, every optimizer's step, then the largest parameter difference."""
    out["grad_diff"].append(max_diff([p.grad for p in eager.parameters()], [p.grad for p in model.parameters()]))
    for opt in opts:
        opt.step()
        opt.zero_grad()
    out["param_diff"].append(max_diff(list(eager.parameters()), list(model.parameters())))


def host_copies():
    """CPU offload compiled as on an accelerator, with ``cpu`` as its device: the plan (read at ``compile``)
    asks for the host-device copies that a CPU device does not need (``_fsdp2.offload_device``)."""
    from unittest import mock

    from fsdp_compile import _fsdp2

    return mock.patch.object(_fsdp2, "offload_device", lambda layout: "cpu" if layout.offload_to_cpu else None)


def device_copies(gm) -> list:
    """The host-device copies in a captured graph (``ops.to_device`` / ``to_host``: ``_to_copy`` to a device),
    not the model's own casts."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten._to_copy.default
            and "device" in n.kwargs]


def run_case(case: Case, rank: int, world_size: int) -> dict:
    with host_copies() if case.host_copies else contextlib.nullcontext():  # for every plan read, not only compile's
        return _run_case(case, rank, world_size)


def _run_case(case: Case, rank: int, world_size: int) -> dict:
    """Eager FSDP2 and the compiled model, trained side by side. With ``case.inline`` (and regions on, under
    ``aot_eager``: the bitwise cases) a third model is compiled with regions off, the differential guard: a
    region must compute what the inline compile computes (``inline_*`` keys). Under Inductor, whose results
    are only close, that copy would cost a second Inductor compile and be checked by nothing."""
    import fsdp_compile as fc

    eager = build(case)
    variants = {"compiled": case.regions}
    if case.inline and case.regions and case.backend == "aot_eager":
        variants["inline"] = False
    models = {name: build(case) for name in variants}
    compiled = {
        name: fc.compile(models[name], backend=case.backend, bucket=case.bucket, reorder=case.reorder, regions=regions,
                         cudagraphs=case.cudagraphs, hardware=case.hardware)
        for name, regions in variants.items()
    }
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opts = {name: torch.optim.AdamW(c.parameters(), lr=1e-2) for name, c in compiled.items()}
    out = {"loss_eager": []}
    for name in variants:
        out.update({f"loss_{name}": [], f"{name}_grad_diff": [], f"{name}_param_diff": [], f"{name}_buffer_diff": []})
    for step in range(case.steps):
        for micro in range(case.accum):
            x = batch(case, step * case.accum + micro, rank)
            torch.manual_seed(100 + step)  # the same random numbers (dropout) for every model
            le = loss_fn(case, eager(spmd_input(case, eager, x)), x)
            le.backward()
            losses = {}
            for name, c in compiled.items():
                torch.manual_seed(100 + step)
                losses[name] = loss_fn(case, c(spmd_input(case, models[name], x)), x)
                losses[name].backward()
        out["loss_eager"].append(_value(le))
        for name in variants:
            out[f"loss_{name}"].append(_value(losses[name]))
            out[f"{name}_grad_diff"].append(
                max_diff([p.grad for p in eager.parameters()], [p.grad for p in models[name].parameters()]))
            out[f"{name}_buffer_diff"].append(max_diff(list(eager.buffers()), list(models[name].buffers())))
        out["grad_types"] = sorted(
            {type(p.grad).__name__ for p in models["compiled"].parameters() if p.requires_grad and type(p).__name__ == "DTensor"}
        )
        opt_e.step()
        opt_e.zero_grad()
        for name in variants:
            opts[name].step()
            opts[name].zero_grad()
            out[f"{name}_param_diff"].append(max_diff(list(eager.parameters()), list(models[name].parameters())))
    comp = compiled["compiled"]
    out["grad_diff"], out["param_diff"] = out["compiled_grad_diff"], out["compiled_param_diff"]
    out["dynamo_graphs"] = len(comp.captured.dynamo)
    out["regions"] = comp.regions()
    from fsdp_compile.report import count_collectives

    out["forward"] = count_collectives(comp.captured.forward[:1])
    out["backward"] = count_collectives(comp.captured.backward[:1])
    from fsdp_compile.passes.predicates import world_size as group_size

    out["all_gather_sizes"] = {  # the process group size of every all-gather, in graph order
        kind: [group_size(n) for n in getattr(comp.captured, kind)[0].graph.nodes
               if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
        for kind in ("forward", "backward")
    }
    import hashlib

    out["graph_hash"] = hashlib.sha256(
        "".join(g.code for g in comp.captured.forward + comp.captured.backward).encode()
    ).hexdigest()
    out["cudagraphs"] = [d.to_dict() for d in comp.captured.cudagraphs]
    out["device_copies"] = {  # host-device copies (CPU offload on an accelerator, or host_copies)
        kind: sum(len(device_copies(g)) for g in getattr(comp.captured, kind)) for kind in ("forward", "backward")
    }
    for c in compiled.values():
        c.close()  # before the process group goes: the CUDA graphs hold its communicators
    return out


def parity_worker(rank: int, world_size: int, cases: list[Case]) -> dict:
    from torch._dynamo.utils import counters

    results = {}
    for case in cases:
        before = sum(counters["graph_break"].values())
        results[case.name] = run_case(case, rank, world_size)
        results[case.name]["graph_breaks"] = sum(counters["graph_break"].values()) - before
    return results
