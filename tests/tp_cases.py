"""FSDP composed with tensor and sequence parallelism: eager FSDP2 + TP against ``fsdp_compile.compile``.

Each case builds a model, parallelizes it with ``torch.distributed.tensor.parallel`` on the ``tp`` dim of
a (dp, tp) mesh (or (replicate, shard, tp) for HSDP), shards it with torch's ``fully_shard`` over the data
parallel dims, and trains an eager copy and a compiled copy side by side on the same batches (the same on
the ranks of one TP group, as TP requires). Used by ``tests/test_tp_multirank.py`` inside gloo ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, loss_parallel, parallelize_module,
)

from fsdp_compile.models import Llama, LlamaArgs
from parity import max_diff


@dataclasses.dataclass(frozen=True)
class TPCase:
    model: str = "mlp"  # mlp (ColwiseParallel -> RowwiseParallel) | llama (torchtitan's plan: SP, loss_parallel)
    tp: int = 2
    replicate: int = 1  # > 1: HSDP, a (replicate, shard, tp) mesh
    reshard: bool | int = True
    mp: str | None = None  # "bf16": param_dtype bf16, reduce_dtype fp32
    ac: bool = False  # checkpoint_wrapper on every block, before TP and fully_shard (torchtitan's order)
    backend: str = "aot_eager"
    steps: int = 2
    ragged: bool = False  # batch shapes differ between data-parallel ranks (rank invariance)
    dcp: bool = False  # then a torch.distributed.checkpoint save and load into a fresh compiled model
    planned: bool = False  # CompileConfig's defaults (bucket="auto", reorder=True); else one unit per FSDP module

    @property
    def name(self) -> str:
        parts = [self.model, f"tp{self.tp}", f"reshard={self.reshard}", f"mp={self.mp}", self.backend]
        if self.replicate > 1:
            parts.append(f"hsdp{self.replicate}")
        if self.ac:
            parts.append("ac")
        if self.ragged:
            parts.append("ragged")
        if self.dcp:
            parts.append("dcp")
        if self.planned:
            parts.append("planned")
        return "-".join(parts)


class MLP(nn.Module):
    def __init__(self, dim: int = 16, hidden: int = 24, n_blocks: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(n_blocks)
        )
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


_MESHES: dict[tuple, object] = {}


def mesh_for(case: TPCase):
    """One mesh per shape per process group, as a job builds it once: DTensor caches sharding decisions
    with the mesh in them, and meshes compare equal by layout alone, so a second mesh of the same shape
    (on new groups) would meet the first one in those caches (``dist_helpers.forget_meshes``)."""
    world = dist.get_world_size()
    if case.replicate > 1:
        shape, names = (case.replicate, world // case.replicate // case.tp, case.tp), ("replicate", "shard", "tp")
    else:
        shape, names = (world // case.tp, case.tp), ("dp", "tp")
    key = (id(dist.distributed_c10d._get_default_group()), shape, names)
    if key not in _MESHES:
        _MESHES.clear()
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def llama_tp_plan(model: Llama, tp_mesh) -> None:
    """torchtitan's Llama TP plan (``torchtitan/models/llama3/parallelize.py: apply_tp``), with loss parallel."""
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def build(case: TPCase):
    mesh = mesh_for(case)
    torch.manual_seed(0)
    if case.model == "mlp":
        m = MLP()
        blocks = list(m.blocks)
    else:
        m = Llama(LlamaArgs(n_layers=2))
        blocks = list(m.layers)
    if case.ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        container = m.blocks if case.model == "mlp" else m.layers
        for i, b in enumerate(blocks):
            container[i] = checkpoint_wrapper(b)
    tp_mesh = mesh["tp"]
    if case.model == "mlp":
        for b in m.blocks:
            inner = b._checkpoint_wrapped_module if case.ac else b
            parallelize_module(inner, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    else:
        llama_tp_plan(_unwrapped(m, case.ac), tp_mesh)
    blocks = list(m.blocks if case.model == "mlp" else m.layers)
    dp_mesh = mesh["replicate", "shard"] if case.replicate > 1 else mesh["dp"]
    kwargs = {"mesh": dp_mesh, "reshard_after_forward": case.reshard}
    if case.mp == "bf16":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for b in blocks:
        fully_shard(b, **kwargs)
    root = dict(kwargs)
    if case.mp == "bf16":
        root["mp_policy"] = MixedPrecisionPolicy(torch.bfloat16, torch.float32, output_dtype=torch.float32)
    fully_shard(m, **root)
    return m, mesh


def _unwrapped(m, ac: bool):
    """The Llama with its blocks unwrapped for the TP plan's FQNs (checkpoint_wrapper adds a prefix)."""
    if not ac:
        return m
    view = Llama.__new__(Llama)
    nn.Module.__init__(view)
    view.tok_embeddings, view.norm, view.output = m.tok_embeddings, m.norm, m.output
    view.layers = nn.ModuleList(b._checkpoint_wrapped_module for b in m.layers)
    return view


def batch(case: TPCase, step: int):
    """The same batch on every rank of a TP group (TP's contract), another per data-parallel rank."""
    dp_rank = dist.get_rank() // case.tp
    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    if case.model == "mlp":
        return torch.randn(4 + (2 * dp_rank if case.ragged else 0), 16, generator=g)
    return torch.randint(0, 256, (2, 16 + (8 * dp_rank if case.ragged else 0)), generator=g)


def loss_of(case: TPCase, out, x):
    if case.model == "mlp":
        return out.float().pow(2).mean()
    return F.cross_entropy(out.flatten(0, 1).float(), x.flatten())


def _context(case: TPCase):
    return loss_parallel() if case.model == "llama" else contextlib.nullcontext()


def run_tp_case(case: TPCase) -> dict:
    import fsdp_compile as fc
    from torch._dynamo.utils import counters

    eager, mesh = build(case)
    model, _ = build(case)
    breaks = sum(counters["graph_break"].values())
    config = fc.CompileConfig(backend=case.backend)
    if not case.planned:
        config = config.replace(bucket="fsdp_group", reorder=False)
    compiled = fc.compile(model, config)
    opt_e = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
    out = {"loss_eager": [], "loss_compiled": [], "grad_diff": [], "param_diff": []}
    for step in range(case.steps):
        x = batch(case, step)
        for m, opt, key in ((eager, opt_e, "eager"), (compiled, opt_c, "compiled")):
            with _context(case):
                loss = loss_of(case, m(x), x)
                loss.backward()
            out[f"loss_{key}"].append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
        out["grad_diff"].append(max_diff([p.grad for p in eager.parameters()], [p.grad for p in model.parameters()]))
        out["grad_placements"] = sorted({  # the gradients are FSDP2's: DTensors of the parameter's own placements
            str(p.grad.placements == p.placements) for p in model.parameters() if p.grad is not None
        })
        for opt in (opt_e, opt_c):
            opt.step()
            opt.zero_grad()
        out["param_diff"].append(max_diff(list(eager.parameters()), list(model.parameters())))
    if case.dcp:
        out["dcp"] = _dcp_round_trip(case, compiled, model)
    out["graph_breaks"] = sum(counters["graph_break"].values()) - breaks
    out["dynamo_graphs"] = len(compiled.captured.dynamo)
    out["regions"] = [r["why"] or "region" for r in compiled.regions()]
    out["param_placements"] = sorted({str(p.placements) for p in model.parameters()})
    from fsdp_compile.passes.predicates import collective_kind, process_group_name, world_size
    from fsdp_compile.report import collectives_by_mesh_dim

    dims = compiled.plan.mesh_dim_of_groups()
    graphs = compiled.captured.forward[:1] + compiled.captured.backward[:1]
    out["by_mesh_dim"] = collectives_by_mesh_dim(graphs, dims)
    out["moves"] = sum(len(r.moves) for r in compiled.captured.records)
    # what every rank must issue alike: each collective's kind, mesh dim and group size, in graph order
    out["collectives"] = [
        [(collective_kind(n), dims.get(process_group_name(n)), world_size(n)) for n in g.graph.nodes if collective_kind(n)]
        for g in graphs
    ]
    return out


def _dcp_round_trip(case: TPCase, compiled, model) -> dict:
    """Save the trained compiled model with DCP, load it into a fresh one (compiled too): the 2-D DTensor
    parameters come back bitwise, and both then take the same next step."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    import fsdp_compile as fc

    path = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    dcp.save(compiled.state_dict(), checkpoint_id=path[0])
    fresh, _ = build(case)
    restored = fc.compile(fresh, backend=case.backend, bucket="fsdp_group", reorder=False)
    state = restored.state_dict()
    dcp.load(state, checkpoint_id=path[0])
    restored.load_state_dict(state)
    loaded_diff = max_diff(list(model.parameters()), list(fresh.parameters()))
    x = batch(case, 99)
    losses = []
    for m in (compiled, restored):
        with _context(case):
            loss = loss_of(case, m(x), x)
            loss.backward()
        losses.append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
    return {"loaded_diff": loaded_diff, "next_losses": losses,
            "next_grad_diff": max_diff([p.grad for p in model.parameters()], [p.grad for p in fresh.parameters()])}


def tp_worker(rank: int, world_size: int, cases: list[TPCase]) -> dict:
    return {case.name: run_tp_case(case) for case in cases}
