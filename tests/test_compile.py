"""The plain models compile whole: ``torch.compile(model, fullgraph=True)`` captures the training
forward + backward of every family (the paper's, GPT, BERT, DeBERTa, T5, ModernBERT, RoBERTa heads)
and a cached decoding step in one graph, with the eager results.

``aot_eager`` traces exactly what inductor would (Dynamo's graph, AOTAutograd's forward and backward)
without generating code, which takes minutes on 2 cores; tests/test_fast_inference.py runs inductor.
"""

from __future__ import annotations

import pytest
import torch

from aiayn import (PRESETS, CausalLM, MaskedLM, SequenceClassifier, Transformer, TransformerConfig,
                   TransformerEncoder)
from aiayn.decoding.generation import decode_step
from aiayn.decoding.greedy import decoder_step

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's imports

CONFIG = TransformerConfig.preset("tiny", vocab_size=60, dropout=0.0)
IDS = torch.tensor([[5, 9, 12, 7, 3, 8, 4], [11, 4, 6, 21, 9, 0, 0]])
MASK = IDS != 0
T5 = CONFIG.replace(  # T5's blocks: relative position buckets, RMS norm, no position table
    **{k: v for k, v in PRESETS["t5-cpu"].items() if k not in (
        "d_model", "d_ff", "n_heads", "n_encoder_layers", "n_decoder_layers", "dropout",
        "relative_attention_buckets", "relative_attention_max_distance")},
    relative_attention_buckets=8, relative_attention_max_distance=16)


def family_output(model, ids, mask, family=None):
    family = family or type(model)
    if family is Transformer:
        return model(ids, ids[:, :5], src_padding_mask=mask)
    if family in (TransformerEncoder, MaskedLM, SequenceClassifier):
        return model(ids, padding_mask=mask)
    return model(ids)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family, config", [
    (CausalLM, CONFIG.replace(norm_first=True, n_encoder_layers=0)),
    (Transformer, CONFIG),
    (TransformerEncoder, CONFIG.replace(activation="gelu", norm_first=True)),
    (TransformerEncoder, CONFIG.replace(  # DeBERTa-v3's disentangled attention, log buckets
        activation="gelu", positions="none", n_decoder_layers=0, attention_scale=(8 * 3) ** -0.5,
        disentangled_attention={"terms": ["c2p", "p2c"], "span": 4, "max_distance": 16})),
    (Transformer, T5),
    (SequenceClassifier, CONFIG.replace(  # ModernBERT: rotary, a band on the sliding layers
        n_decoder_layers=0, activation="gelu", norm_first=True, positions="rotary",
        gated_ffn=True, bias=False, layer_norm_bias=False, embedding_norm=True,
        scale_embeddings=False, sliding_window=3, sliding_window_layers=[1],
        rope_local_theta=50.0, pooler=True, pooler_activation="gelu", pooler_norm=True,
        num_labels=3)),
    (MaskedLM, CONFIG.replace(  # RoBERTa: positions count real tokens only
        n_decoder_layers=0, activation="gelu", positions="learned", max_length=16,
        positions_skip_padding=True, pad_id=1, position_offset=2)),
], ids=["CausalLM", "Transformer", "TransformerEncoder", "DeBERTa", "T5", "ModernBERT",
        "RoBERTa"])
def test_training_forward_and_backward_compile_in_one_graph(family, config):
    torch.manual_seed(0)
    model = family(config).train()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    out = family_output(compiled, IDS, MASK, family)
    out.float().square().mean().backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    want_out = family_output(model, IDS, MASK)
    want_out.float().square().mean().backward()
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    assert got.keys() == {name for name, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(got[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["decoder-only", "encoder-decoder", "t5"])
def test_a_cached_decoding_step_compiles_in_one_graph(kind):
    torch.manual_seed(0)
    with torch.no_grad():
        if kind == "decoder-only":
            model = CausalLM(CONFIG.replace(norm_first=True, n_encoder_layers=0)).eval()
            step = torch.compile(decode_step, fullgraph=True, backend="aot_eager", dynamic=True)
            caches = [model.new_cache(2, 16) for _ in range(2)]
            for cache in caches:
                model(IDS[:, :4], cache=cache)
            for t in range(4, 7):
                got = step(model, IDS[:, t:t + 1], None, None, caches[0])
                want = decode_step(model, IDS[:, t:t + 1], None, None, caches[1])
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            model = Transformer(T5 if kind == "t5" else CONFIG).eval()
            step = torch.compile(decoder_step, fullgraph=True, backend="aot_eager", dynamic=True)
            memory = model.encode(IDS, MASK)
            caches = [model.new_cache(2, 16) for _ in range(2)]
            for cache in caches:
                model.decode(IDS[:, :1], memory, memory_padding_mask=MASK, cache=cache)
            for t in range(1, 4):
                got = step(model, IDS[:, t:t + 1], MASK, caches[0])
                want = decoder_step(model, IDS[:, t:t + 1], MASK, caches[1])
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
