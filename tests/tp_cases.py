"""FSDP composed with tensor, sequence and expert parallelism: eager FSDP2 + TP/EP against ``fsdp_compile.compile``.

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
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

from fsdp_compile.models import Llama, LlamaArgs, gloo_float8_all_gather, tensor_parallel
from parity import max_diff


@dataclasses.dataclass(frozen=True)
class TPCase:
    # mlp (ColwiseParallel -> RowwiseParallel) | llama (torchtitan's plan: SP, loss_parallel) | moe (expert
    # parallelism: experts Shard(0) on an ep mesh, FSDP over efsdp, all-to-all dispatch of data-dependent sizes)
    # | hf_llama (transformers' LlamaForCausalLM with its own TP plan, model.tp_plan, applied by transformers)
    # | hf_qwen3 (Qwen3ForCausalLM, the same way: its q_norm/k_norm style registers post-accumulate-grad hooks in forward)
    # | hf_qwen3_moe (Qwen3MoeForCausalLM with transformers' expert parallelism, its ep plan applied by
    # transformers; tp=1: experts over (efsdp 2, ep 2), the rest over all 4 ranks, as from_pretrained lays out
    # fsdp 4 x ep 2)
    model: str = "mlp"
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
    # llama: tok_embeddings.weight and output.weight tied. "after": tied again after fully_shard, as torchtitan's
    # Decoder.init_states does (its TP plan had made them two parameters, and fully_shard two FSDP parameters,
    # which FSDP2's lazy init then points at the one); "before": tied again between the TP plan and fully_shard
    tied: str | None = None
    micro: int = 1  # backward calls per optimizer step, each reduce-scattered into .grad (torchtitan's accumulation)
    # torchao's float8 Linears with FSDP2's float8 all-gather (emulated matmuls: they run on a CPU), the head
    # (mlp) or output (llama) a plain Linear. mlp: TP by torchao's Float8ColwiseParallel / Float8RowwiseParallel
    # with the input cast on the block itself; llama: torchtitan's float8 TP plan (models.tensor_parallel(float8=True):
    # each block's attention and MLP input cast to float8 before its sequence all-gather, which gloo carries as bytes)
    float8: bool = False
    # a second compiled model with regions off, trained beside the first and checked bitwise too (the
    # differential guard, as parity.Case.inline): a region must compute what the inline compile computes
    inline: bool = False
    # llama: the model's forward writes a plain attribute of its last block to another value than the first's, so
    # that block runs inline (regions._written_apart) while the others call the region
    written: bool = False

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
        if self.tied:
            parts.append(f"tied_{self.tied}")
        if self.micro > 1:
            parts.append(f"micro{self.micro}")
        if self.float8:
            parts.append("float8")
        if self.inline:
            parts.append("inline")
        if self.written:
            parts.append("written")
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


def _mesh(shape: tuple, names: tuple):
    """One mesh per shape per process group, as a job builds it once: DTensor caches sharding decisions
    with the mesh in them, and meshes compare equal by layout alone, so a second mesh of the same shape
    (on new groups) would meet the first one in those caches (``dist_helpers.forget_meshes``)."""
    key = (id(dist.distributed_c10d._get_default_group()), shape, names)
    if key not in _MESHES:
        if any(k[0] != key[0] for k in _MESHES):
            _MESHES.clear()
        _MESHES[key] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[key]


def mesh_for(case: TPCase):
    world = dist.get_world_size()
    if case.model == "moe":  # torchtitan's expert layout: experts over (efsdp, ep), dense layers over fsdp
        return _mesh((world // case.tp, case.tp), ("efsdp", "ep"))
    if case.model == "hf_qwen3_moe":  # transformers' expert view (efsdp, ep) beside its (size 1) tp dim
        return _mesh((world // 2, 2, case.tp), ("efsdp", "ep", "tp"))
    if case.replicate > 1:
        return _mesh((case.replicate, world // case.replicate // case.tp, case.tp), ("replicate", "shard", "tp"))
    return _mesh((world // case.tp, case.tp), ("dp", "tp"))


E, D, H = 4, 8, 12  # the MoE's experts, model dim, expert hidden dim


class Experts(nn.Module):
    """Expert weights [E, ...]: under expert parallelism DTensors Shard(0) on the ep mesh, of which each rank
    runs its local experts (torchtitan's GroupedExperts takes ``to_local()`` the same way)."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, D, H) * D**-0.5)
        self.w2 = nn.Parameter(torch.randn(E, H, D) * H**-0.5)

    def forward(self, x, local_ids):
        w1 = self.w1.to_local() if isinstance(self.w1, DTensor) else self.w1
        w2 = self.w2.to_local() if isinstance(self.w2, DTensor) else self.w2
        h = F.gelu(torch.bmm(x.unsqueeze(1), w1[local_ids])).squeeze(1)
        return torch.bmm(h.unsqueeze(1), w2[local_ids]).squeeze(1)


class MoE(nn.Module):
    """Top-1 routing with torchtitan's TokenDispatcher pattern: tokens sorted by expert, counts exchanged by
    an all-to-all, split sizes read with ``.tolist()`` (data-dependent), tokens dispatched and combined by
    all-to-alls of those sizes over the ep group."""

    def __init__(self, ep_mesh):
        super().__init__()
        self.router = nn.Linear(D, E, bias=False)  # used through argmax only: no gradient, as in eager
        self.experts = Experts()
        self.ep_mesh = ep_mesh

    def forward(self, x):
        from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

        tokens = x.reshape(-1, D)
        ids = self.router(tokens).argmax(-1)
        order = ids.argsort(stable=True)
        counts = torch.bincount(ids, minlength=E)
        ep, group = self.ep_mesh.size(), self.ep_mesh.get_group()
        received = all_to_all_single(counts, None, None, group)
        input_splits = counts.view(ep, -1).sum(1).tolist()
        output_splits = received.view(ep, -1).sum(1).tolist()
        routed = all_to_all_single_autograd(tokens[order], output_splits, input_splits, group)
        local_ids = all_to_all_single(ids[order] % (E // ep), output_splits, input_splits, group)
        out = all_to_all_single_autograd(self.experts(routed, local_ids), input_splits, output_splits, group)
        return x + torch.empty_like(out).index_copy(0, order, out).view_as(x)


class MoEModel(nn.Module):
    def __init__(self, ep_mesh):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.moe = MoE(ep_mesh)
        self.out = nn.Linear(D, 4)

    def forward(self, x):
        return self.out(self.moe(self.inp(x)))


def _build_moe(case: TPCase):
    """Experts distributed Shard(0) over ep, then fully_shard over efsdp (the experts' own data-parallel
    mesh), the rest over all ranks, as torchtitan's apply_moe_ep_tp / apply_fsdp lay them out."""
    from torch.distributed.tensor import distribute_tensor

    mesh = mesh_for(case)
    torch.manual_seed(0)
    m = MoEModel(mesh["ep"])
    for name in ("w1", "w2"):
        p = getattr(m.moe.experts, name)
        setattr(m.moe.experts, name, nn.Parameter(distribute_tensor(p.data, mesh["ep"], [Shard(0)])))
    fully_shard(m.moe.experts, mesh=mesh["efsdp"], reshard_after_forward=case.reshard)
    fully_shard(m, mesh=_mesh((dist.get_world_size(),), ("fsdp",)), reshard_after_forward=case.reshard)
    return m, mesh


def _build_hf(case: TPCase):
    """transformers' own TP: ``model.tp_plan`` (the config's ``base_model_tp_plan`` and its head's) expanded
    and applied by ``transformers.distributed.tensor_parallel.apply_tensor_parallelism``, the DTensor path
    ``from_pretrained(tp_plan=...)`` takes; then fully_shard per decoder layer and the root over dp. Qwen3's
    plan makes q_norm/k_norm ``ReplicatedWithGradAllReduce``: plain replicated weights whose forward registers
    a post-accumulate-grad hook all-reducing ``param.grad`` over tp (on FSDP2's unsharded parameter eagerly)."""
    import transformers
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    mesh = mesh_for(case)
    torch.manual_seed(0)
    kind = {"hf_llama": "Llama", "hf_qwen3": "Qwen3"}[case.model]
    cfg = getattr(transformers, f"{kind}Config")(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa")
    m = getattr(transformers, f"{kind}ForCausalLM")(cfg)
    apply_tensor_parallelism(m, mesh["tp"], m._expand_parallel_plan(m.tp_plan))
    for layer in m.model.layers:
        fully_shard(layer, mesh=mesh["dp"], reshard_after_forward=case.reshard)
    fully_shard(m, mesh=mesh["dp"], reshard_after_forward=case.reshard)
    return m, mesh


def _build_hf_qwen3_moe(case: TPCase, mp_policy: MixedPrecisionPolicy | None = None):
    """Qwen3MoeForCausalLM (2 layers, hidden 64, 4 experts, top-2, vocab 256, fp32, sdpa) with transformers'
    expert parallelism as ``from_pretrained(distributed_config=DistributedConfig(ep_size=2))`` applies it
    (``maybe_distribute_model``): ``apply_expert_parallelism`` with the model's ep plan (experts'
    weights Shard(0) on ep, AutoEP's all-to-all dispatch in training), then ``apply_fully_sharded_data_parallelism``'s
    layout: the experts fully_shard over efsdp, their gradients summed and divided by the dp size, each decoder
    layer and the root over all ranks. The split sizes of the dispatch are read back to the host, and
    ``AllToAllEP`` branches on the received token count (``if tokens.shape[0] == 0``): layer 0's router sends every
    token to experts 0 and 1, so ep rank 1 receives none there (the size-zero side eagerly), layer 1 routes freely."""
    import transformers
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    mesh = mesh_for(case)
    dp_mesh = _mesh((dist.get_world_size(),), ("fsdp",))
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=64, attn_implementation="sdpa")
    m = transformers.Qwen3MoeForCausalLM(cfg)
    _route_to_first_experts(m.model.layers[0].mlp.gate)
    apply_expert_parallelism(m, mesh["ep"], mesh["tp"], m._expand_parallel_plan(m.ep_plan))
    kwargs = {"mp_policy": mp_policy} if mp_policy is not None else {}
    for layer in m.model.layers:
        fully_shard(layer.mlp.experts, mesh=mesh["efsdp"], reshard_after_forward=True, **kwargs)
        layer.mlp.experts.set_gradient_divide_factor(float(dist.get_world_size()))
        layer.mlp.experts.set_force_sum_reduction_for_comms(True)
    for layer in m.model.layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=case.reshard, **kwargs)
    fully_shard(m, mesh=dp_mesh, reshard_after_forward=case.reshard, **kwargs)
    return m, mesh


def _route_to_first_experts(gate: nn.Module):
    """Top-2 fixed to experts 0 and 1 (ep rank 0's), weighted by the router's softmax over those two: the
    other ep rank receives no tokens from the dispatch."""
    forward = gate.forward

    def routed(hidden_states):
        logits, _, _ = forward(hidden_states)
        return logits, torch.softmax(logits[:, :2], dim=-1), torch.arange(2).expand(logits.shape[0], 2)

    gate.forward = routed


def build(case: TPCase):
    if case.model == "moe":
        return _build_moe(case)
    if case.model == "hf_qwen3_moe":
        return _build_hf_qwen3_moe(case)
    if case.model.startswith("hf_"):
        return _build_hf(case)
    mesh = mesh_for(case)
    torch.manual_seed(0)
    if case.model == "mlp":
        m = MLP(hidden=32 if case.float8 else 24)  # torchao's float8 needs dims that are multiples of 16
        blocks = list(m.blocks)
    else:
        # written: 3 layers, so that two blocks call the region (Dynamo inlines a region called once)
        m = Llama(LlamaArgs(n_layers=3 if case.written else 2, tie_embeddings=case.tied is not None))
        blocks = list(m.layers)
        if case.written:
            for b in blocks:
                b.tag = 0
            m.register_forward_pre_hook(lambda mod, args: setattr(mod.layers[-1], "tag", 1))
    if case.float8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
        plain = "head" if case.model == "mlp" else "output"
        convert_to_float8_training(m, config=config, module_filter_fn=lambda _, fqn: fqn != plain)
    if case.ac:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        container = m.blocks if case.model == "mlp" else m.layers
        for i, b in enumerate(blocks):
            container[i] = checkpoint_wrapper(b)
    tp_mesh = mesh["tp"]
    if case.model == "mlp":
        for b in m.blocks:
            inner = b._checkpoint_wrapped_module if case.ac else b
            if case.float8:  # the block's input cast to float8 once, before its Linears (torchtitan's recipe)
                from torchao.float8.float8_tensor_parallel import PrepareFloat8ModuleInput

                parallelize_module(inner, tp_mesh, PrepareFloat8ModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)))
            parallelize_module(inner, tp_mesh, _mlp_tp_plan(case.float8))
    else:
        tensor_parallel(_unwrapped(m, case.ac), tp_mesh, loss_parallel=True, float8=case.float8)
        if case.tied == "before":  # parallelize_module distributed each alias into a parameter of its own
            m.output.weight = m.tok_embeddings.weight
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
    if case.tied == "after":
        m.output.weight = m.tok_embeddings.weight
    return m, mesh


def _mlp_tp_plan(float8: bool) -> dict:
    if not float8:
        return {"0": ColwiseParallel(), "2": RowwiseParallel()}
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    return {"0": Float8ColwiseParallel(), "2": Float8RowwiseParallel()}


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
    if case.model == "moe":  # every rank data-parallel (the experts see each other's tokens by all-to-all)
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        return torch.randn(2, 5 + (dist.get_rank() if case.ragged else 0), D, generator=g)
    if case.model == "mlp":
        return torch.randn(4 + (2 * dp_rank if case.ragged else 0), 16, generator=g)
    return torch.randint(0, 256, (2, 16 + (8 * dp_rank if case.ragged else 0)), generator=g)


def loss_of(case: TPCase, out, x):
    if case.model.startswith("hf_"):
        return F.cross_entropy(out.logits.flatten(0, 1).float(), x.flatten())
    if case.model in ("mlp", "moe"):
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
    runs = [(eager, opt_e, "eager"), (compiled, opt_c, "compiled")]
    if case.inline:  # regions off: the same checks under inline_* keys
        inline_model, _ = build(case)
        inline = fc.compile(inline_model, config.replace(regions=False))
        runs.append((inline, torch.optim.AdamW(inline.parameters(), lr=1e-2), "inline"))
        out.update(loss_inline=[], inline_grad_diff=[], inline_param_diff=[])
    for step in range(case.steps):
        for micro in range(case.micro):
            x = batch(case, step * case.micro + micro)
            for m, opt, key in runs:
                with _context(case):
                    loss = loss_of(case, m(x), x)
                    loss.backward()
                out[f"loss_{key}"].append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
        out["grad_diff"].append(max_diff([p.grad for p in eager.parameters()], [p.grad for p in model.parameters()]))
        if case.inline:
            out["inline_grad_diff"].append(
                max_diff([p.grad for p in eager.parameters()], [p.grad for p in inline_model.parameters()]))
        out["grad_placements"] = sorted({  # the gradients are FSDP2's: DTensors of the parameter's own placements
            str(p.grad.placements == p.placements) for p in model.parameters() if p.grad is not None
        })
        for _, opt, _ in runs:
            opt.step()
            opt.zero_grad()
        if case.float8:  # the next step's weight scales, from one all-reduce of the weights' amax (torchtitan's order)
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            for m, _, _ in runs:
                precompute_float8_dynamic_scale_for_fsdp(getattr(m, "_orig_mod", m))
        out["param_diff"].append(max_diff(list(eager.parameters()), list(model.parameters())))
        if case.inline:
            out["inline_param_diff"].append(max_diff(list(eager.parameters()), list(inline_model.parameters())))
    if case.dcp:
        out["dcp"] = _dcp_round_trip(case, compiled, model)
    out["graph_breaks"] = sum(counters["graph_break"].values()) - breaks
    out["dynamo_graphs"] = len(compiled.captured.dynamo)
    out["regions"] = [r["why"] or "region" for r in compiled.regions()]
    out["region_calls"] = sum(n.target is torch.ops.higher_order.invoke_subgraph
                              for g in compiled.captured.dynamo for n in g.graph.nodes)
    out["param_placements"] = sorted({str(p.placements) for p in model.parameters()})
    from fsdp_compile.passes.predicates import collective_kind, process_group_name, world_size
    from fsdp_compile.report import collectives_by_mesh_dim

    dims = compiled.plan.mesh_dim_of_groups()
    graphs = compiled.captured.forward[:1] + compiled.captured.backward[:1]
    out["by_mesh_dim"] = collectives_by_mesh_dim(graphs, dims)
    out["moves"] = sum(len(r.moves) for r in compiled.captured.records)
    if case.float8:  # what FSDP's all-gathers carry: each block's float8 weights at one byte per element
        out["dp_gathers"] = [(str(n.args[0].meta["val"].dtype), n.args[0].meta["val"].nbytes)
                             for n in graphs[0].graph.nodes if collective_kind(n) and dims.get(process_group_name(n)) == "dp"
                             and n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
        out["plan_bytes"] = {g.fqn: g.unsharded_bytes for g in compiled.plan.groups}
        block = (model.blocks if case.model == "mlp" else model.layers)[0]
        itemsize = 2 if case.mp == "bf16" else 4
        out["float8_block_bytes"] = sum(p.to_local().numel() * (1 if p.dim() == 2 else itemsize) for p in block.parameters())
        out["local_types"] = sorted({type(p.to_local()).__name__ for p in model.parameters()})
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
    if any(case.float8 for case in cases):
        gloo_float8_all_gather()
    return {case.name: run_tp_case(case) for case in cases}
