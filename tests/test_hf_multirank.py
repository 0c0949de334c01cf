"""HF transformers decoders, sharded with torch's ``fully_shard`` per decoder layer, compiled as one graph
and trained bitwise like eager FSDP2 (aot_eager, fp32) on 2 gloo ranks: Llama, GPT-2 (tied embeddings,
Conv1D, a logging call in its loss), Qwen3 (q/k norms), Phi-3 (fused qkv and gate/up projections), Qwen2 (q/k/v
biases) and Gemma (tied embeddings, scaled by sqrt(hidden)). tests/test_hf_distributed_multirank runs them in bf16.

The loss is the model's own (``labels=``), so transformers' loss functions run inside the graph too.
Dropout is off: eager and compiled draw random numbers differently.
"""

import logging

import pytest

from dist_helpers import run_ranks

pytestmark = pytest.mark.multirank
transformers = pytest.importorskip("transformers")

VOCAB = 512
FAMILIES = ["llama", "gpt2", "qwen3", "phi3", "qwen2", "gemma"]
# Training without a KV cache lets the layers share one trace on torch 2.13 (tests/test_regions.py); with
# one, each layer is traced. Both ways are common in training scripts.
NO_CACHE = {"llama", "phi3", "qwen2", "gemma"}


def build(family: str):
    import torch
    import transformers as t
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, attn_implementation="sdpa")
    if family == "gpt2":
        cfg = t.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0, **common)
        model = t.GPT2LMHeadModel(cfg)
        layers = model.transformer.h
    else:
        config, cls = {
            "llama": (t.LlamaConfig, t.LlamaForCausalLM),
            "qwen3": (t.Qwen3Config, t.Qwen3ForCausalLM),
            "phi3": (t.Phi3Config, t.Phi3ForCausalLM),
            "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM),
            "gemma": (t.GemmaConfig, t.GemmaForCausalLM),
        }[family]
        cfg = config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, head_dim=16, **common)
        if family == "phi3":
            cfg.pad_token_id = 0  # its default (32000) is past this vocabulary
        if hasattr(cfg, "attention_dropout"):
            cfg.attention_dropout = 0.0
        if hasattr(cfg, "resid_pdrop"):
            cfg.resid_pdrop = cfg.embd_pdrop = 0.0
        model = cls(cfg)
        layers = model.model.layers
    for layer in layers:
        fully_shard(layer)
    return fully_shard(model)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def hf_worker(rank, world_size, families):
    import torch
    from torch._dynamo.utils import counters

    import fsdp_compile as fc
    from parity import record_step

    out = {}
    for family in families:
        eager, model = build(family), build(family)
        compiled = fc.compile(model, backend="aot_eager")
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, model)]
        records = _Records()
        logging.getLogger("transformers").addHandler(records)
        breaks = sum(counters["graph_break"].values())
        r = {"loss_eager": [], "loss_compiled": [], "grad_diff": [], "param_diff": []}
        try:
            for step in range(2):
                ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(100 * step + rank))
                # the compiled model first: a warning_once the step logs is then logged by it, not by eager
                kwargs = {"use_cache": False} if family in NO_CACHE else {}
                lc = compiled(input_ids=ids, labels=ids, **kwargs).loss
                lc.backward()
                if step == 0:
                    r["warnings_compiled"] = list(records.messages)
                le = eager(input_ids=ids, labels=ids, **kwargs).loss
                le.backward()
                r["loss_eager"].append(le.item())
                r["loss_compiled"].append(lc.item())
                record_step(r, eager, model, opts)
        finally:
            logging.getLogger("transformers").removeHandler(records)
        r["graph_breaks"] = sum(counters["graph_break"].values()) - breaks
        r["dynamo_graphs"] = len(compiled.captured.dynamo)
        r["tied"] = model.get_output_embeddings().weight is model.get_input_embeddings().weight
        out[family] = r
    return out


@pytest.fixture(scope="module")
def results():
    return run_ranks(hf_worker, 2, FAMILIES, timeout=900)


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_decoder_bitwise(results, family):
    for rank, per_rank in enumerate(results):
        r = per_rank[family]
        assert r["graph_breaks"] == 0 and r["dynamo_graphs"] == 1, (rank, r)
        assert r["loss_eager"] == r["loss_compiled"], (rank, r)
        assert max(r["grad_diff"]) == 0.0 and max(r["param_diff"]) == 0.0, (rank, r)


def test_gpt2_ties_and_keeps_its_warning(results):
    """GPT-2's embedding and output weights are one parameter; the warning transformers logs inside the
    step (a ``logger.warning_once``, which Dynamo would refuse under fullgraph) is still logged."""
    for per_rank in results:
        r = per_rank["gpt2"]
        assert r["tied"]
        assert r["warnings_compiled"], r
