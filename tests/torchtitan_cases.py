"""torchtitan's Llama3 and DeepSeek-V3 debug models, built, sharded and trained by torchtitan's own code on
CPU gloo ranks: eager FSDP2 next to ``fsdp_compile.compile`` on the same weights and batches.

What is torchtitan's (0.3.0) and used as it is: the models' registered debug configs
(``llama3_configs["debugmodel"]``, ``deepseekv3_configs["debugmodel"]``), ``parallelize_llama`` /
``parallelize_deepseekv3`` (``apply_fsdp_to_decoder``: its ``MixedPrecisionPolicy`` from
``TrainingConfig`` — bf16 parameters, fp32 reduction —, its reshard policy ``"default"``, one FSDP group per
block, ``[norm, lm_head]`` kept unsharded after forward, the root, ``set_gradient_divide_factor(1.0)``),
``ParallelDims`` and its meshes, ``init_weights``, ``CrossEntropyLoss`` (sum, divided by the global count of
valid tokens from ``dist_sum_tensor``), ``OptimizersContainer`` from ``default_adamw`` (fused AdamW), the
DeepSeek model spec's ``post_optimizer_build_fn`` (the MoE load-balancing pre-step hook that all-reduces
``tokens_per_expert_E`` and updates ``expert_bias_E``), ``clip_grad_norm_`` and the order of
``Trainer.train_step`` (``zero_grad(set_to_none=False)``, forward, loss, backward, clip, step).

What this file changes, each because CPU gloo ranks need it (none changes the arithmetic):

* ``torchtitan.tools.utils.device_type`` is ``"cuda"`` on a machine without an accelerator; its meshes are
  built on it, so it is set to ``"cpu"`` here.
* the attention is torchtitan's ``ScaledDotProductAttention`` (its flex and varlen attentions have no CPU
  backward); the models are then called without attention masks, plain causal attention.
* ``layers[:n_layers]``: the debug models have 6 layers; the first two of Llama3's, the first three of
  DeepSeek-V3's (one dense block, then two MoE blocks: a repeated kind of MoE block).
* every FSDP module gets ``set_force_sum_reduction_for_comms(True)``: with torchtitan's
  ``set_gradient_divide_factor(1.0)`` eager FSDP2 reduce-scatters with ``PREMUL_SUM(1.0)``, which gloo does
  not have; forced SUM with the same factor 1.0 is the same arithmetic (both models get it).
* ``spmd_backend``: ``"partial_dtensor"`` (torchtitan's plain ``fully_shard(mesh=fsdp)``) unless a case says
  ``"full_dtensor"``: every parameter a DTensor on the SPMD mesh (from the sharding configs), the batch made
  DTensors by ``full_dtensor.parallelize_inputs`` as ``Trainer.post_dataloading_process`` does, and
  ``fully_shard(..., dp_mesh_dims=DataParallelMeshDims(shard="dp_shard"))``. torchtitan's default,
  ``"spmd_types"``, calls ``fully_shard`` the same way but leaves its parameters plain tensors annotated by
  spmd_types, which torch 2.13's ``fully_shard`` refuses ("must be DTensors on the full SPMD mesh"): eager
  FSDP2 cannot run it on that torch, on any device, so there is no oracle to compare with there (the
  ``spmd_types`` cases check that refusal); torch 2.14's trains it, and the cases compare with it.
  As ``Trainer`` does under ``spmd_types``, the batch is annotated by ``annotate_input_spmd_types`` and the
  forward, loss and backward run in ``get_spmd_context(parallel_dims=...)`` (its ``train_context``, without
  ``debug.spmd_typechecking``): it sets the current SPMD mesh, which the vocab-parallel loss reads under TP
  (without it the loss takes the sharded logits for the full vocabulary: "Target 1067 is out of bounds").
* ``Decoder.Config.update_from_config`` is not called: it imports ``torchtitan.trainer`` (dataloaders,
  tensorboard, checkpointing: packages the test extra does not need) and, with ``partial_dtensor`` and data
  parallelism only, sets nothing these models use but the RoPE cache length (left at the config's; the
  models read its first ``SEQ`` positions). With TP, EP or another ``spmd_backend`` it also sets the model's
  sharding plan: those cases call the functions it calls for that (``set_llama3_sharding_config``, ...).
* activation checkpointing only where a case asks for it (torchtitan's ``SelectiveAC`` / ``FullAC``
  configs, applied by its parallelize functions), torchtitan's own compile off (``CompileConfig()``):
  ``fsdp_compile`` compiles.

Both models are initialized once, by torchtitan's ``init_weights`` on the eager one, and the compiled one
gets a copy of its local shards and buffers (DTensor's random generator advances between two inits).
"""

from __future__ import annotations

import dataclasses

import torch

VOCAB = 2048  # the debug models' vocabulary
BATCH, SEQ = 2, 32


@dataclasses.dataclass(frozen=True)
class TitanCase:
    model: str = "llama3"  # llama3 | deepseek_v3
    backend: str = "aot_eager"
    regions: bool | None = None  # None: fsdp_compile's default
    steps: int = 3
    n_layers: int = 2  # the first n layers of the debug model (DeepSeek-V3's first is dense, the rest MoE)
    ac: str | None = None  # None | "selective" | "full": torchtitan's SelectiveAC / FullAC configs
    loss: str = "ce"  # "ce": CrossEntropyLoss | "chunked": ChunkedLossWrapper (lm_head run by the loss)
    tp: int = 1  # tensor_parallel_degree: torchtitan's apply_tp (sequence parallel, loss parallel)
    tied: bool = False  # enable_weight_tying (Llama3 1B and 3B, Qwen3): tok_embeddings.weight is lm_head.weight
    # ParallelismConfig.spmd_backend: "partial_dtensor" (fully_shard(mesh=fsdp)) | "full_dtensor" (every parameter a
    # DTensor on the SPMD mesh, fully_shard(..., dp_mesh_dims=...)) | "spmd_types" (torchtitan's default)
    spmd_backend: str = "partial_dtensor"
    # expert_parallel_degree (DeepSeek-V3): routed experts sharded over ep, kept in their block's FSDP module on
    # the efsdp mesh (FSDP2's per-parameter meshes: two parameter groups in each MoE block)
    ep: int = 1

    @property
    def name(self) -> str:
        parts = [self.model, f"{self.n_layers}layers", self.backend]
        if self.regions is not None:
            parts.append(f"regions={self.regions}")
        if self.ac:
            parts.append(f"ac={self.ac}")
        if self.loss != "ce":
            parts.append(f"loss={self.loss}")
        if self.tp > 1:
            parts.append(f"tp{self.tp}")
        if self.tied:
            parts.append("tied")
        if self.ep > 1:
            parts.append(f"ep{self.ep}")
        if self.spmd_backend != "partial_dtensor":
            parts.append(self.spmd_backend)
        return "-".join(parts)


TORCHTITAN = "0.3.0"  # the version this harness reads; its APIs change between releases
INSTALL = (f"python3 -m pip install torchtitan=={TORCHTITAN} --no-deps && "
           "python3 -m pip install spmd-types==0.3.1 tyro==1.0.16")


def torchtitan_missing() -> str | None:
    """Why torchtitan cannot be used here, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("torchtitan")
    except PackageNotFoundError:
        return f"torchtitan is not installed ({INSTALL})"
    if found != TORCHTITAN:
        return f"torchtitan {found} is installed, these tests read torchtitan {TORCHTITAN} ({INSTALL})"
    try:
        import torchtitan.components.loss  # noqa: F401
        import torchtitan.components.optimizer  # noqa: F401
        import torchtitan.models.deepseek_v3  # noqa: F401
        import torchtitan.models.llama3  # noqa: F401
    except Exception as e:  # noqa: BLE001 - its models import triton, spmd_types, tyro at import time
        return f"torchtitan {found} is not importable ({type(e).__name__}: {e}; {INSTALL})"
    return None


def _on_cpu():
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.tools.utils as tools_utils

    for module in (tools_utils, parallel_dims, dist_utils):
        module.device_type = "cpu"


def _parallel_dims(world_size: int, tp: int = 1, ep: int = 1, spmd_backend: str = "partial_dtensor"):
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims

    parallelism = ParallelismConfig(spmd_backend=spmd_backend, tensor_parallel_degree=tp,
                                    expert_parallel_degree=ep)
    dims = ParallelDims.from_config(parallelism, world_size)
    dims.build_mesh()
    return dims, parallelism


def _model_config(model: str, n_layers: int, tied: bool = False):
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if model == "llama3":
        from torchtitan.models.llama3 import llama3_configs as configs
        from torchtitan.models.llama3 import parallelize_llama as parallelize

        cfg = configs["debugmodel"](attn_backend="flex")
    elif model == "deepseek_v3":
        from torchtitan.models.deepseek_v3 import deepseekv3_configs as configs
        from torchtitan.models.deepseek_v3 import parallelize_deepseekv3 as parallelize

        cfg = configs["debugmodel"](attn_backend="flex", moe_comm_backend="standard")
    else:
        raise ValueError(model)
    cfg.layers = cfg.layers[:n_layers]
    if tied:  # as its 1B and 3B configs: the parallelize functions and init_states read it
        cfg.enable_weight_tying = True
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg, parallelize


def build(case, dims, parallelism, dump_folder: str):
    """One sharded torchtitan model, its loss, optimizers container and training config."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.config import CompileConfig, TrainingConfig

    cfg, parallelize = _model_config(case.model, case.n_layers, case.tied)
    if case.tp > 1 or case.spmd_backend != "partial_dtensor":  # what update_from_config does: its Llama3 sharding plan
        from torchtitan.models.llama3.sharding import set_llama3_sharding_config

        assert case.model == "llama3", "the TP cases use torchtitan's Llama3 plan"
        set_llama3_sharding_config(cfg, enable_sp=parallelism.enable_sequence_parallel)
    if case.ep > 1:  # what update_from_config does for EP: torchtitan's own DeepSeek-V3 plan (experts on ep)
        from torchtitan.models.deepseek_v3.sharding import set_deepseek_v3_sharding_config

        assert case.model == "deepseek_v3", "the EP case uses torchtitan's DeepSeek-V3 plan"
        set_deepseek_v3_sharding_config(cfg, enable_sp=parallelism.enable_sequence_parallel, enable_ep=True)
    training = TrainingConfig(local_batch_size=BATCH, seq_len=SEQ)
    ac_config = None
    if case.ac == "selective":
        from torchtitan.distributed.activation_checkpoint import SelectiveAC

        ac_config = SelectiveAC.Config()
    elif case.ac == "full":
        from torchtitan.distributed.activation_checkpoint import FullAC

        ac_config = FullAC.Config()
    with torch.device("meta"):
        m = cfg.build()
    m = parallelize(m, parallel_dims=dims, training=training, parallelism=parallelism,
                    compile_config=CompileConfig(), ac_config=ac_config, dump_folder=dump_folder)
    for module in m.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    m.to_empty(device="cpu")
    m.train()
    loss_cfg = CrossEntropyLoss.Config(global_vocab_size=VOCAB)
    if case.loss == "chunked":
        from torchtitan.components.loss import ChunkedLossWrapper

        loss_cfg = ChunkedLossWrapper.Config(loss_fn=loss_cfg)
    loss_fn = loss_cfg.build(compile_config=CompileConfig())
    if case.loss == "chunked":  # as Trainer.__init__ does
        loss_fn.set_lm_head(m.lm_head)
        m._skip_lm_head = True
    return m, loss_fn, default_adamw(lr=8e-4), training


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _copy_state(src, dst):
    with torch.no_grad():
        for a, b in zip(src.parameters(), dst.parameters(), strict=True):
            _local(b).copy_(_local(a))
        for a, b in zip(src.buffers(), dst.buffers(), strict=True):
            _local(b).copy_(_local(a))


def max_diff(xs, ys) -> float:
    d = 0.0
    for x, y in zip(xs, ys, strict=True):
        if x is None or y is None:
            if (x is None) != (y is None):
                return float("inf")
            continue
        x, y = _local(x), _local(y)
        if x.is_complex():  # RoPE caches
            x, y = torch.view_as_real(x), torch.view_as_real(y)
        if x.numel():
            d = max(d, (x.double() - y.double()).abs().max().item())
    return d


def _flat(model) -> torch.Tensor:
    return torch.cat([_local(p).detach().double().flatten() for p in model.parameters()])


def run_case(case: TitanCase, rank: int, world_size: int, dims, parallelism, tmp: str) -> dict:
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.components.loss import IGNORE_INDEX

    import fsdp_compile as fc

    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    eager, loss_eager, opt_cfg, training = build(case, dims, parallelism, tmp)
    comp, loss_comp, _, _ = build(case, dims, parallelism, tmp)
    torch.manual_seed(0)
    with torch.no_grad():
        eager.init_weights(buffer_device=None)
    if case.tied:  # what init_states does first, on the copy init_weights does not run on
        comp.tok_embeddings.weight = comp.lm_head.weight
    _copy_state(eager, comp)
    p0 = _flat(eager)
    kwargs = {} if case.regions is None else {"regions": case.regions}
    compiled = fc.compile(comp, backend=case.backend, **kwargs)

    runs = []
    for model, forward, loss_fn in ((eager, eager, loss_eager), (comp, compiled, loss_comp)):
        opts = opt_cfg.build(model_parts=[model])
        if case.model == "deepseek_v3":  # the model spec's post_optimizer_build_fn
            from torchtitan.components.optimizer import register_moe_load_balancing_hook

            register_moe_load_balancing_hook(opts, [model], dims)
        runs.append((model, forward, opts, loss_fn))

    out = {k: [] for k in ("loss_eager", "loss_compiled", "norm_eager", "norm_compiled", "grad_diff", "grad_scale",
                           "counter_diff", "param_diff", "buffer_diff", "update_cos")}
    batch_mesh = dims.get_mesh("batch")
    for step in range(case.steps):
        # the same batch on the ranks of one TP group (TP's contract), another per batch rank
        g = torch.Generator().manual_seed(1000 * step + batch_mesh.get_local_rank())
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels[0, :3] = IGNORE_INDEX  # a few ignored labels: the global valid-token count is not B * L * W
        grads, counters = [], []
        for (model, forward, opts, loss_fn), kind in zip(runs, ("eager", "compiled")):
            # Trainer.train_step, without gradient accumulation, pipeline or context parallelism
            opts.zero_grad(set_to_none=training.disable_cuda_graphs)  # False: gradients zeroed in place
            global_valid_tokens = dist_utils.dist_sum_tensor((labels != IGNORE_INDEX).sum(), batch_mesh)
            inputs, targets = tokens, labels
            if case.spmd_backend == "full_dtensor":  # Trainer.post_dataloading_process: DTensors on the SPMD mesh
                from torchtitan.distributed.full_dtensor import parallelize_inputs

                inputs, targets, _ = parallelize_inputs(dims, tokens, labels, {})
            elif case.spmd_backend == "spmd_types":  # the same, spmd_types annotations on the plain batch
                from torchtitan.distributed.spmd_types import annotate_input_spmd_types

                inputs, targets, _ = annotate_input_spmd_types(dims, tokens, labels, {})
            # Trainer._forward_backward_body: under spmd_types its train_context sets the current SPMD mesh, which
            # the vocab-parallel loss reads (spmd_mesh_size("tp")); a null context on the other backends
            with dist_utils.get_spmd_context(parallel_dims=dims)():
                # with TP the logits stay sharded over the vocabulary: torchtitan's loss is vocab-parallel
                pred = forward(inputs)
                loss, _ = loss_fn(pred, targets, global_valid_tokens)
                loss.backward()
            grads.append([None if p.grad is None else _local(p.grad).clone() for p in model.parameters()])
            # the MoE counters, before torchtitan's pre-step hook all-reduces and zeroes them
            counters.append({n: _local(b).clone() for n, b in model.named_buffers()})
            norm = dist_utils.clip_grad_norm_(list(model.parameters()), training.max_norm, foreach=True,
                                              pp_mesh=None, ep_enabled=dims.ep_enabled)
            opts.step()
            out[f"loss_{kind}"].append(loss.item())
            out[f"norm_{kind}"].append(norm.item())
        out["grad_diff"].append(max_diff(*grads))
        out["grad_scale"].append(max(g.abs().max().item() for g in grads[0] if g is not None and g.numel()))
        out["counter_diff"].append(max_diff(list(counters[0].values()), list(counters[1].values())))
        if step == 0:
            out["tokens_per_expert"] = {
                kind: {n: c.tolist() for n, c in cs.items() if n.endswith("tokens_per_expert_E")}
                for kind, cs in zip(("eager", "compiled"), counters)
            }
        out["param_diff"].append(max_diff(list(eager.parameters()), list(comp.parameters())))
        out["buffer_diff"].append(max_diff(list(eager.buffers()), list(comp.buffers())))
        # how far each model moved from the common initial weights, and in which direction
        de, dc = _flat(eager) - p0, _flat(comp) - p0
        out["update_cos"].append((de @ dc / (de.norm() * dc.norm())).item())
    out["expert_bias"] = sum(float(b.abs().sum()) for n, b in comp.named_buffers() if n.endswith("expert_bias_E"))
    out["dynamo_graphs"] = len(compiled.captured.dynamo)
    out["units"] = [list(u.members) for u in compiled.schedule.units]
    out["group_sizes"] = {g.fqn: g.world_size for g in compiled.plan.groups}
    out["regions"] = compiled.regions()
    # per region body (its identifier), the calls of it in the top-level Dynamo graphs: traced once, called per block
    calls = [n.args[1] for gm in compiled.captured.dynamo for n in gm.graph.nodes
             if n.target is torch.ops.higher_order.invoke_subgraph]
    out["region_calls"] = {i: calls.count(i) for i in sorted(set(calls))}
    out["dynamo_nodes"] = sum(len(gm.graph.nodes) for gm in compiled.captured.dynamo)
    out["param_meshes"] = sorted({str(p.device_mesh.mesh_dim_names) for p in comp.parameters()})
    # spmd_types: the parameters whose gradient fsdp_compile all-reduces over tp before the reduce-scatter
    out["tp_all_reduced"] = [p.fqn for g in compiled.plan.groups for p in g.params
                             if p.parallel is not None and p.parallel.grad_placements is not None]
    out["param_dtype"] = str(eager.layers["0"]._get_fsdp_state()._fsdp_param_group.mp_policy.param_dtype)
    return out


def titan_worker(rank: int, world_size: int, cases: list[TitanCase]) -> dict:
    import tempfile

    from torch._dynamo.utils import counters

    _on_cpu()
    meshes = {}  # per (tp, ep): the same meshes on every rank, built in the same order
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in cases:
            key = (case.tp, case.ep, case.spmd_backend)
            if key not in meshes:
                meshes[key] = _parallel_dims(world_size, *key)
            dims, parallelism = meshes[key]
            before = sum(counters["graph_break"].values())
            try:
                results[case.name] = run_case(case, rank, world_size, dims, parallelism, tmp)
            except Exception:  # noqa: BLE001 - a case that fails on every rank alike reports, the others run
                import traceback

                results[case.name] = {"error": traceback.format_exc()}
            results[case.name]["graph_breaks"] = sum(counters["graph_break"].values()) - before
    return results
