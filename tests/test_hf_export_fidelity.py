"""What ``save_pretrained`` cannot express is refused, and what it writes transformers runs alike.

Each refused case was exported before without a word and loaded by transformers as another model
(logits off by 0.7-5.6 on these tiny models): a kernel other than exact softmax attention, q/k
norms, soft caps, sandwich norms, Marian with a position offset, DeBERTa numbering positions over
real tokens. The others check a written or read setting against transformers: T5's exact gated
GELU, and the defaults transformers gives to config.json fields left out (M2M100's embedding
scale, Gemma 2's soft caps).
"""

from __future__ import annotations

import json

import pytest
import torch

from aiayn import (CausalLM, MaskedLM, Transformer, TransformerConfig, from_pretrained,
                   save_pretrained)

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=100, d_model=32, n_heads=4, d_ff=64, max_length=64, dropout=0.0,
             attention_dropout=0.0, activation_dropout=0.0)
LLAMA = dict(SMALL, n_encoder_layers=0, n_decoder_layers=2, norm="rms", norm_first=True,
             final_norm=True, positions="rotary", gated_ffn=True, activation="silu",
             scale_embeddings=False, bias=False, tie_output=False)
GPT2 = dict(SMALL, n_encoder_layers=0, n_decoder_layers=2, norm_first=True, final_norm=True,
            positions="learned", activation="gelu_tanh", scale_embeddings=False, bias=True,
            tie_output=True)
BERT = dict(SMALL, n_encoder_layers=2, n_decoder_layers=0, norm_first=False, final_norm=False,
            positions="learned", scale_embeddings=False, embedding_norm=True, type_vocab_size=2,
            activation="gelu", layer_norm_eps=1e-12, output_bias=True, pooler=True, pad_id=0)
SEQ2SEQ = dict(SMALL, n_encoder_layers=2, n_decoder_layers=2, pad_id=0, bos_id=1, eos_id=2,
               decoder_start_id=0)
MARIAN = dict(SEQ2SEQ, positions="sinusoidal", sinusoid_layout="split", scale_embeddings=True,
              norm_first=False, final_norm=False, activation="silu")
MBART = dict(SEQ2SEQ, positions="learned", position_offset=2, embedding_norm=True,
             scale_embeddings=False, norm_first=True, final_norm=True, activation="gelu",
             output_bias=True)
T5 = dict(SEQ2SEQ, norm="rms", norm_first=True, final_norm=True, bias=False, positions="none",
          scale_embeddings=False, scale_attention=False, relative_attention_buckets=8,
          relative_attention_max_distance=20, activation="relu", tie_output=False)
SPARSE = dict(attention="sparse", attention_window=4, attention_stride=4)


@pytest.mark.parametrize("model_class, base, change, field", [
    (CausalLM, LLAMA, SPARSE, "attention='sparse'"),
    (CausalLM, LLAMA, dict(attention="linear"), "attention='linear'"),
    (CausalLM, GPT2, SPARSE, "attention='sparse'"),
    (MaskedLM, BERT, dict(attention="linear"), "attention='linear'"),
    (Transformer, MARIAN, SPARSE, "attention='sparse'"),
    (CausalLM, LLAMA, dict(logit_softcap=0.5), "logit_softcap"),
    (CausalLM, LLAMA, dict(attention_softcap=0.5, attention="reference"), "attention_softcap"),
    (CausalLM, GPT2, dict(qk_norm=True), "qk_norm"),
    (CausalLM, GPT2, dict(logit_softcap=0.5), "logit_softcap"),
    (MaskedLM, BERT, dict(qk_norm=True), "qk_norm"),
    (MaskedLM, BERT, dict(attention_softcap=0.5, attention="reference"), "attention_softcap"),
    (Transformer, MARIAN, dict(qk_norm=True), "qk_norm"),
    (Transformer, MARIAN, dict(position_offset=3), "position_offset"),
    (Transformer, MBART, dict(sandwich_norm=True), "sandwich_norm"),
    (Transformer, T5, dict(qk_norm=True), "qk_norm"),
    (Transformer, T5, dict(sandwich_norm=True), "sandwich_norm"),
    (Transformer, T5, dict(logit_softcap=0.5), "logit_softcap"),
])
def test_save_refuses_what_the_hf_family_cannot_express(tmp_path, model_class, base, change,
                                                         field):
    model = model_class(TransformerConfig(**{**base, **change}))
    with pytest.raises(ValueError, match=f"cannot export.*{field}"):
        save_pretrained(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_chunked_attention_is_exact_and_exports(tmp_path):
    torch.manual_seed(0)
    model = CausalLM(TransformerConfig(**LLAMA, attention="chunked",
                                       attention_chunk_size=4)).eval()
    save_pretrained(model, tmp_path)
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids), theirs(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
def test_t5s_gated_gelu_is_written_as_the_gelu_it_is(tmp_path, activation):
    """T5Config reads "gated-gelu" as the tanh GELU: the exact GELU is written by its name and
    read back as itself."""
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(**{**T5, "gated_ffn": True,
                                             "activation": activation})).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, 0.5)
    save_pretrained(model, tmp_path)
    theirs = transformers.T5ForConditionalGeneration.from_pretrained(tmp_path).eval()
    source = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    target = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = model(source, target)
        torch.testing.assert_close(ours, theirs(input_ids=source, decoder_input_ids=target).logits,
                                   atol=1e-3, rtol=1e-4)
    assert from_pretrained(tmp_path).config.activation == activation


def _drop_config_fields(directory, *names):
    config = json.loads((directory / "config.json").read_text())
    for name in names:
        config.pop(name)
    (directory / "config.json").write_text(json.dumps(config))


def test_a_config_json_without_m2m100s_scale_embedding_is_read_with_its_default(tmp_path):
    """M2M100Config's scale_embedding defaults to True: a config.json that leaves it out is read
    as transformers reads it."""
    config = transformers.M2M100Config(vocab_size=100, d_model=32, encoder_layers=1,
                                       decoder_layers=1, encoder_attention_heads=4,
                                       decoder_attention_heads=4, encoder_ffn_dim=64,
                                       decoder_ffn_dim=64, max_position_embeddings=64,
                                       dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    torch.manual_seed(0)
    transformers.M2M100ForConditionalGeneration(config).save_pretrained(tmp_path)
    _drop_config_fields(tmp_path, "scale_embedding")
    theirs = transformers.M2M100ForConditionalGeneration.from_pretrained(tmp_path).eval()
    assert theirs.config.scale_embedding is True
    ours = from_pretrained(tmp_path).eval()
    assert ours.config.scale_embeddings is True
    source = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    target = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            ours(source, target), theirs(input_ids=source, decoder_input_ids=target).logits,
            atol=1e-4, rtol=1e-4)


def test_a_config_json_without_gemma2s_soft_caps_is_read_with_their_defaults(tmp_path):
    """Gemma2Config's soft caps default to 50 (attention) and 30 (logits)."""
    if not hasattr(transformers, "Gemma2Config"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 2 (4.42 added it)")
    config = transformers.Gemma2Config(vocab_size=100, hidden_size=32, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8,
                                       max_position_embeddings=64, sliding_window=16)
    torch.manual_seed(0)
    transformers.Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    _drop_config_fields(tmp_path, "attn_logit_softcapping", "final_logit_softcapping")
    ours = from_pretrained(tmp_path)
    assert (ours.config.attention_softcap, ours.config.logit_softcap) == (50.0, 30.0)
