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
