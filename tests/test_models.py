"""Shapes, causality, padding invariance and attention maps for every family and both norm orders."""

import math

import pytest
import torch

from aiayn import (AttentionMaps, CausalLM, MaskedLM, SequenceClassifier, Transformer,
                   TransformerConfig, TransformerEncoder)
from aiayn.nn.positions import LearnedPositions, sinusoidal_table

NORMS = [pytest.param(False, id="post-norm"), pytest.param(True, id="pre-norm")]


def tiny(**overrides):
    return TransformerConfig.preset("tiny", **overrides)


def ids(batch, length, vocab=100):
    return torch.randint(3, vocab, (batch, length))


@pytest.mark.parametrize("norm_first", NORMS)
@pytest.mark.parametrize("kernel", ["fused", "reference"])
def test_shapes_of_every_family(norm_first, kernel):
    config = tiny(norm_first=norm_first, attention=kernel, num_labels=5)
    src, tgt = ids(3, 11), ids(3, 6)
    assert Transformer(config)(src, tgt).shape == (3, 6, 100)
    assert TransformerEncoder(config)(src).shape == (3, 11, 32)
    assert SequenceClassifier(config)(src).shape == (3, 5)
    assert SequenceClassifier(config.replace(pooling="mean"))(src).shape == (3, 5)
    assert MaskedLM(config)(src).shape == (3, 11, 100)
    assert CausalLM(config)(tgt).shape == (3, 6, 100)


@pytest.mark.parametrize("norm_first", NORMS)
def test_pre_norm_has_final_norm_and_post_norm_does_not(norm_first):
    model = Transformer(tiny(norm_first=norm_first))
    assert (model.encoder.norm is not None) == norm_first
    assert (model.decoder.norm is not None) == norm_first


@pytest.mark.parametrize("norm_first", NORMS)
def test_decoder_only_is_causal(norm_first):
    model = CausalLM(tiny(norm_first=norm_first)).eval()
    tokens = ids(2, 10)
    changed = tokens.clone()
    changed[:, 6:] = ids(2, 4)
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :6], after[:, :6], rtol=0, atol=0)
    assert not torch.allclose(before[:, 6:], after[:, 6:])


@pytest.mark.parametrize("norm_first", NORMS)
def test_encoder_decoder_target_is_causal(norm_first):
    model = Transformer(tiny(norm_first=norm_first)).eval()
    src, tgt = ids(2, 8), ids(2, 7)
    changed = tgt.clone()
    changed[:, 4:] = ids(2, 3)
    torch.testing.assert_close(model(src, tgt)[:, :4], model(src, changed)[:, :4], rtol=0, atol=0)


@pytest.mark.parametrize("norm_first", NORMS)
def test_changing_padded_tokens_changes_no_real_output(norm_first):
    config = tiny(norm_first=norm_first)
    src, tgt = ids(2, 9), ids(2, 6)
    src_mask = torch.ones(2, 9, dtype=torch.bool)
    src_mask[0, 5:] = False
    tgt_mask = torch.ones(2, 6, dtype=torch.bool)
    tgt_mask[1, 4:] = False
    src2, tgt2 = src.clone(), tgt.clone()
    src2[0, 5:], tgt2[1, 4:] = ids(1, 4), ids(1, 2)

    model = Transformer(config).eval()
    a = model(src, tgt, src_padding_mask=src_mask, tgt_padding_mask=tgt_mask)
    b = model(src2, tgt2, src_padding_mask=src_mask, tgt_padding_mask=tgt_mask)
    torch.testing.assert_close(a[tgt_mask], b[tgt_mask], rtol=0, atol=1e-6)

    encoder = TransformerEncoder(config).eval()
    torch.testing.assert_close(encoder(src, padding_mask=src_mask)[src_mask],
                               encoder(src2, padding_mask=src_mask)[src_mask], rtol=0, atol=1e-6)
    classifier = SequenceClassifier(config.replace(pooling="mean")).eval()
    torch.testing.assert_close(classifier(src, padding_mask=src_mask),
                               classifier(src2, padding_mask=src_mask), rtol=0, atol=1e-6)

    lm = CausalLM(config).eval()
    left = torch.ones(2, 6, dtype=torch.bool)
    left[0, :2] = False  # left padding
    tokens2 = tgt.clone()
    tokens2[0, :2] = ids(1, 2)
    torch.testing.assert_close(lm(tgt, padding_mask=left)[left], lm(tokens2, padding_mask=left)[left],
                               rtol=0, atol=1e-6)


def test_all_padding_sequence_gives_finite_outputs():
    config = tiny()
    model = Transformer(config)
    src = ids(2, 1)
    mask = torch.tensor([[False], [True]])
    logits = model(src, ids(2, 1), src_padding_mask=mask)
    logits.sum().backward()
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("kernel", ["fused", "reference"])
def test_return_attention_gives_maps_and_identical_logits(kernel):
    config = tiny(attention=kernel)
    model = Transformer(config).eval()
    src, tgt = ids(2, 9), ids(2, 6)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 7:] = False
    plain = model(src, tgt, src_padding_mask=mask)
    logits, maps = model(src, tgt, src_padding_mask=mask, return_attention=True)
    assert isinstance(maps, AttentionMaps)
    torch.testing.assert_close(logits, plain, rtol=1e-5, atol=1e-5)
    assert [m.shape for m in maps.encoder] == [(2, 4, 9, 9)] * 2
    assert [m.shape for m in maps.decoder] == [(2, 4, 6, 6)] * 2
    assert [m.shape for m in maps.cross] == [(2, 4, 6, 9)] * 2
    for weights in maps.encoder + maps.decoder + maps.cross:
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    for weights in maps.encoder:  # padded source keys get no weight
        assert weights[1, :, :, 7:].abs().max() == 0
    assert maps.cross[0][1, :, :, 7:].abs().max() == 0  # padded source keys get no weight
    assert maps.decoder[0][..., 0, 1:].abs().max() == 0  # causal: position 0 sees only itself
    lm_logits, lm_maps = CausalLM(config).eval()(tgt, return_attention=True)
    assert len(lm_maps.decoder) == 2 and not lm_maps.encoder and not lm_maps.cross
    _, encoder_maps = TransformerEncoder(config)(src, return_attention=True)
    assert len(encoder_maps.encoder) == 2


@pytest.mark.parametrize("kernel, settings", [
    ("linear", {}), ("sparse", dict(attention_window=2, attention_stride=2))])
def test_return_attention_refuses_kernels_without_softmax_weights(kernel, settings):
    """Linear and sparse attention compute another function than eq. 1: the reference kernel's
    weights are not theirs, so asking for maps is an error, not a picture of another model."""
    config = tiny(attention=kernel, attention_dropout=0.0, **settings)
    for call in (lambda: CausalLM(config).eval()(ids(2, 6), return_attention=True),
                 lambda: TransformerEncoder(config)(ids(2, 6), return_attention=True)):
        with pytest.raises(ValueError, match=f"the {'Linear' if kernel == 'linear' else 'Sparse'}"
                                             f"Attention kernel does not compute softmax"):
            call()
    CausalLM(config).eval()(ids(2, 6))  # without maps, as always


def test_sinusoidal_table_is_the_papers_formula():
    table = sinusoidal_table(50, 16)
    for pos in (0, 7, 49):
        for i in range(8):
            angle = pos / 10000 ** (2 * i / 16)
            assert math.isclose(table[pos, 2 * i].item(), math.sin(angle), abs_tol=1e-6)
            assert math.isclose(table[pos, 2 * i + 1].item(), math.cos(angle), abs_tol=1e-6)
    split = sinusoidal_table(50, 16, "split")
    torch.testing.assert_close(split[:, :8], table[:, 0::2])
    torch.testing.assert_close(split[:, 8:], table[:, 1::2])


def test_embeddings_are_scaled_by_sqrt_d_model():
    config = tiny(positions="none", dropout=0.0)
    model = Transformer(config)
    tokens = ids(1, 4)
    embedded = model.decoder.embeddings(tokens)
    torch.testing.assert_close(embedded, model.decoder.embeddings.tokens(tokens) * math.sqrt(32))
    unscaled = Transformer(config.replace(scale_embeddings=False)).decoder.embeddings
    torch.testing.assert_close(unscaled(tokens), unscaled.tokens(tokens))


def test_learned_positions_and_bert_style_embeddings():
    config = tiny(positions="learned", embedding_norm=True, type_vocab_size=2, pooler=True,
                  scale_embeddings=False, activation="gelu", output_bias=True)
    encoder = TransformerEncoder(config)
    assert isinstance(encoder.encoder.embeddings.positions, LearnedPositions)
    tokens = ids(2, 5)
    types = torch.zeros(2, 5, dtype=torch.long)
    torch.testing.assert_close(encoder(tokens), encoder(tokens, token_types=types))
    assert not torch.allclose(encoder(tokens), encoder(tokens, token_types=types + 1))
    assert SequenceClassifier(config)(tokens).shape == (2, 2)
    assert MaskedLM(config).head.projection.bias is not None


def test_training_mode_dropout_changes_outputs_and_eval_is_deterministic():
    model = CausalLM(tiny(dropout=0.3, attention_dropout=0.2, activation_dropout=0.1))
    tokens = ids(2, 8)
    model.train()
    assert not torch.allclose(model(tokens), model(tokens))
    model.eval()
    torch.testing.assert_close(model(tokens), model(tokens), rtol=0, atol=0)


def test_gradients_reach_every_parameter():
    model = Transformer(tiny(tie_output=False, tie_source_target=False))
    loss = model(ids(2, 5), ids(2, 4)).logsumexp(-1).mean()
    loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert not missing


# --- the encoder's sliding window and ModernBERT's pieces (tests/test_hf_modernbert.py: parity) ---
def windowed(**overrides):
    """A 4-layer pre-norm rotary encoder whose layers 1, 2 and 3 slide (ModernBERT's shape)."""
    return tiny(**{**dict(n_encoder_layers=4, norm_first=True, positions="rotary", gated_ffn=True,
                          sliding_window=3, sliding_window_layers=[1, 2, 3],
                          rope_local_theta=100.0, dropout=0.0), **overrides})


def test_an_encoder_window_as_wide_as_the_sequence_changes_nothing():
    """W = 12 over 12 positions hides no key (the farthest is 11 away): the same hidden states as
    no window at all, the local RoPE base aside; W = 3 hides keys and changes them."""
    torch.manual_seed(0)
    plain = TransformerEncoder(windowed(sliding_window=None, sliding_window_layers=None,
                                        rope_local_theta=None)).eval()
    wide = TransformerEncoder(windowed(sliding_window=12, rope_local_theta=None)).eval()
    narrow = TransformerEncoder(windowed(rope_local_theta=None)).eval()
    wide.load_state_dict(plain.state_dict())
    narrow.load_state_dict(plain.state_dict())
    src = ids(2, 12)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, 8:] = False
    with torch.no_grad():
        want = plain(src, padding_mask=mask)
        torch.testing.assert_close(wide(src, padding_mask=mask), want, rtol=0, atol=0)
        assert (narrow(src, padding_mask=mask) - want)[mask].abs().max() > 1e-3


@pytest.mark.parametrize("kernel", ["fused", "chunked"])
def test_kernels_with_the_band_equal_the_reference_kernel(kernel):
    """The band and the padding mask together (a padded row keeps zero weight on padded keys),
    through SDPA and the chunked kernel, against the reference kernel's written-out softmax; the
    reference kernel's maps are zero outside the band on the sliding layers."""
    torch.manual_seed(0)
    reference = TransformerEncoder(windowed(attention="reference")).eval()
    other = TransformerEncoder(windowed(attention=kernel, attention_chunk_size=4)).eval()
    other.load_state_dict(reference.state_dict())
    src = ids(2, 11)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, 6:] = False
    with torch.no_grad():
        want, maps = reference(src, padding_mask=mask, return_attention=True)
        torch.testing.assert_close(other(src, padding_mask=mask)[mask], want[mask],
                                   rtol=1e-5, atol=1e-5)
    far = torch.ones(11, 11).triu(3).bool() | torch.ones(11, 11).tril(-3).bool()  # |i - j| >= 3
    assert all(maps.encoder[i][:, :, far].abs().max() == 0 for i in (1, 2, 3))
    assert maps.encoder[0][:, :, far].abs().max() > 0  # layer 0 is global
    assert maps.encoder[1][1, :, :, 6:].abs().max() == 0  # padded keys


def test_the_local_layers_turn_rope_with_their_own_base():
    torch.manual_seed(0)
    own = TransformerEncoder(windowed()).eval()
    shared = TransformerEncoder(windowed(rope_local_theta=None)).eval()
    shared.load_state_dict(own.state_dict())
    src = ids(2, 9)
    with torch.no_grad():
        assert (own(src) - shared(src)).abs().max() > 1e-3
    head_dim = 32 // 4  # theta_1 = base^(-2 / Dh)
    assert own.encoder.rotary_local.inverse_frequency[1].item() == pytest.approx(100.0 ** -0.25)
    assert own.encoder.rotary.inverse_frequency[1].item() == pytest.approx(10000.0 ** (-2 / head_dim))


def test_first_attention_norm_false_leaves_the_first_layers_attention_input_as_it_is(tmp_path):
    """ModernBERT: no norm before layer 0's attention (in each stack), the others keep theirs."""
    config = windowed(first_attention_norm=False)
    encoder = TransformerEncoder(config)
    layers = encoder.encoder.layers
    assert isinstance(layers[0].attention_residual.norm, torch.nn.Identity)
    assert all(isinstance(layer.attention_residual.norm, torch.nn.LayerNorm) for layer in layers[1:])
    x = torch.randn(2, 5, 32) * 3 + 1
    torch.testing.assert_close(layers[0].attention_residual.input(x), x, rtol=0, atol=0)
    lm = CausalLM(tiny(norm_first=True, first_attention_norm=False, n_encoder_layers=0))
    assert isinstance(lm.decoder.layers[0].self_attention_residual.norm, torch.nn.Identity)
    assert isinstance(lm.decoder.layers[1].self_attention_residual.norm, torch.nn.LayerNorm)
    with pytest.raises(ValueError, match="first_attention_norm=False .* needs norm_first=True"):
        tiny(first_attention_norm=False)
    from aiayn import save_pretrained  # families without it refuse to write it

    with pytest.raises(ValueError, match="cannot export as gpt2: it needs first_attention_norm=True"):
        save_pretrained(lm, tmp_path)


def test_modernbert_heads_are_dense_activation_norm_without_dense_biases():
    """The classifier's pooler + GELU + LayerNorm (``pooler_norm``) and the MLM transform, both
    without a dense bias (``head_bias=False``), by hand."""
    config = windowed(pooler=True, pooler_activation="gelu", pooler_norm=True, head_bias=False,
                      pooling="mean", layer_norm_bias=False)
    classifier = SequenceClassifier(config).eval()
    head = classifier.head
    assert head.pooler.bias is None and head.norm.bias is None
    pooled = torch.randn(3, 32)
    want = head.classifier(torch.nn.functional.layer_norm(
        torch.nn.functional.gelu(pooled @ head.pooler.weight.T), (32,), head.norm.weight,
        eps=config.layer_norm_eps))
    torch.testing.assert_close(head(pooled), want)
    assert MaskedLM(config).head.dense.bias is None
    assert SequenceClassifier(tiny(pooler=True)).head.norm is None  # BERT's pooler: no norm


@pytest.mark.parametrize("module", ["aiayn.models.decoder_only", "aiayn.models.encoder_decoder",
                                    "aiayn.models.encoder_only", "aiayn.models.vision"])
def test_the_models_docstring_examples_run_as_shown(module):
    import doctest
    import importlib

    torch.manual_seed(0)
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
