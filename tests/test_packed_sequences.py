"""Skipping padding at inference (aiayn.packed_sequences): the encoder run on its real tokens only.

At every real position the packed forward equals the padded forward (the plain path, switched off)
for post- and pre-norm encoders and every position-independent kernel, whatever the padding looks
like (right, left, gaps, an empty sequence); padded positions come out zero. Where it must not apply
(gradients recorded, the sparse kernel, too little padding, attention maps asked for) the output is
the plain path's, padded positions included. Translation decodes the same tokens either way.
"""
import pytest
import torch

from aiayn import MaskedLM, SequenceClassifier, Transformer, TransformerConfig, packed_sequences
from aiayn.attention.multihead import MultiHeadAttention
from aiayn.attention.kernels import FusedAttention
from aiayn.decoding.beam import beam_search
from aiayn.decoding.greedy import greedy_search
from aiayn.models import TransformerEncoder
from aiayn.training.distributed import apply_activation_checkpointing, compile_layers


def _padded_forward(model, ids, mask):
    packed_sequences.enabled = False
    try:
        return model(ids, padding_mask=mask)
    finally:
        packed_sequences.enabled = True


def _encoder(**overrides):
    config = TransformerConfig.preset("tiny", **overrides)
    return TransformerEncoder(config).eval(), config


def _batch(config, lengths, length=12):
    ids = torch.randint(1, config.vocab_size, (len(lengths), length))
    mask = torch.arange(length) < torch.tensor(lengths)[:, None]  # (B, T) right padding
    return ids.masked_fill(~mask, 0), mask


@pytest.mark.parametrize("kernel", ["fused", "reference", "chunked", "linear"])
@pytest.mark.parametrize("norm_first", [False, True])
def test_packed_encoder_equals_padded_at_real_positions(kernel, norm_first):
    model, config = _encoder(attention=kernel, norm_first=norm_first, final_norm=norm_first,
                             attention_chunk_size=4)
    ids, mask = _batch(config, [12, 5, 9, 1])
    with torch.inference_mode():
        assert packed_sequences.applies(mask, uses_positions=False)
        packed = model(ids, padding_mask=mask)
        padded = _padded_forward(model, ids, mask)
    assert packed.shape == padded.shape == (4, 12, 32)
    torch.testing.assert_close(packed[mask], padded[mask], atol=2e-5, rtol=1e-5)
    assert torch.equal(packed[~mask], torch.zeros_like(packed[~mask]))
    assert padded[~mask].abs().sum() > 0  # the padded path did compute those positions


@pytest.mark.parametrize("pooling", ["first", "mean"])
def test_classifier_and_masked_lm_heads_see_the_same_real_tokens(pooling):
    config = TransformerConfig.preset("tiny", num_labels=3, pooling=pooling, norm_first=True)
    ids, mask = _batch(config, [12, 3, 8, 10])
    classifier, masked_lm = SequenceClassifier(config).eval(), MaskedLM(config).eval()
    with torch.inference_mode():
        torch.testing.assert_close(classifier(ids, padding_mask=mask),
                                   _padded_forward(classifier, ids, mask), atol=2e-5, rtol=1e-5)
        logits = masked_lm(ids, padding_mask=mask)  # (B, T, V)
        torch.testing.assert_close(logits[mask], _padded_forward(masked_lm, ids, mask)[mask],
                                   atol=2e-5, rtol=1e-5)


def test_left_padding_gaps_and_an_empty_sequence():
    model, config = _encoder()
    ids = torch.randint(1, config.vocab_size, (4, 10))
    mask = torch.ones(4, 10, dtype=torch.bool)
    mask[0, :4] = False  # left padding
    mask[1, 3:6] = False  # a gap in the middle
    mask[2, :] = False  # nothing real at all
    mask[3, 7:] = False
    with torch.no_grad():
        packed = model(ids, padding_mask=mask)
        padded = _padded_forward(model, ids, mask)
    torch.testing.assert_close(packed[mask], padded[mask], atol=2e-5, rtol=1e-5)
    assert torch.equal(packed[~mask], torch.zeros_like(packed[~mask]))


def test_not_applied_when_it_must_not_be():
    model, config = _encoder()
    ids, mask = _batch(config, [12, 4, 7])
    with torch.inference_mode():
        # too little padding to pay for the per-sequence attention calls
        few = torch.ones(2, 40, dtype=torch.bool)
        few[0, -1] = False
        assert not packed_sequences.applies(few, uses_positions=False)
        # no padding at all, and nothing but padding
        assert not packed_sequences.applies(torch.ones(2, 8, dtype=torch.bool), False)
        assert not packed_sequences.applies(torch.zeros(2, 8, dtype=torch.bool), False)
        # a kernel whose blocks sit at absolute positions
        assert not packed_sequences.applies(mask, uses_positions=True)
        sparse, sparse_config = _encoder(attention="sparse", attention_window=4,
                                         attention_stride=4)
        sparse_ids, _ = _batch(sparse_config, [12, 4, 7])
        out = sparse(sparse_ids, padding_mask=mask)
        assert out[~mask].abs().sum() > 0
        assert torch.equal(out, _padded_forward(sparse, sparse_ids, mask))
        packed_sequences.enabled = False
        try:
            assert not packed_sequences.applies(mask, uses_positions=False)
        finally:
            packed_sequences.enabled = True


def test_attention_maps_in_the_padded_layout():
    model, config = _encoder()
    ids, mask = _batch(config, [12, 4, 7])
    mask[2, :3] = False  # left padding too
    with torch.inference_mode():
        hidden, maps = model(ids, padding_mask=mask, return_attention=True)
        plain = model(ids, padding_mask=mask)
        packed_sequences.enabled = False
        try:
            padded_hidden, padded_maps = model(ids, padding_mask=mask, return_attention=True)
        finally:
            packed_sequences.enabled = True
    assert torch.equal(hidden, plain)  # collecting the maps changes no number
    torch.testing.assert_close(hidden[mask], padded_hidden[mask], atol=2e-5, rtol=1e-5)
    assert len(maps.encoder) == len(padded_maps.encoder) == config.n_encoder_layers
    both = mask[:, None, :, None] & mask[:, None, None, :]  # (B, 1, T, T) real query and key
    for packed_weights, padded_weights in zip(maps.encoder, padded_maps.encoder):
        assert packed_weights.shape == padded_weights.shape == (3, 4, 12, 12)
        torch.testing.assert_close(packed_weights * both, padded_weights * both, atol=1e-5,
                                   rtol=1e-5)
        assert torch.equal(packed_weights * ~both, torch.zeros_like(packed_weights))
        real_rows = packed_weights.sum(-1)[mask[:, None, :].expand(-1, 4, -1)]
        torch.testing.assert_close(real_rows, torch.ones_like(real_rows))


def test_translation_decodes_the_same_tokens():
    torch.manual_seed(3)
    config = TransformerConfig.preset("tiny")
    model = Transformer(config).eval()
    source = torch.randint(3, config.vocab_size, (4, 11))
    source_mask = torch.arange(11) < torch.tensor([11, 6, 8, 3])[:, None]
    source = source.masked_fill(~source_mask, config.pad_id)
    results = {}
    for enabled in (True, False):
        packed_sequences.enabled = enabled
        try:
            results[enabled] = (beam_search(model, source, source_mask, beam_size=3),
                                greedy_search(model, source, source_mask))
        finally:
            packed_sequences.enabled = True
    (beam_on, greedy_on), (beam_off, greedy_off) = results[True], results[False]
    assert [h.tokens for h in beam_on] == [h.tokens for h in beam_off]
    for on, off in zip(beam_on, beam_off):
        assert on.score == pytest.approx(off.score, abs=1e-5)
    assert [h.tokens for h in greedy_on] == [h.tokens for h in greedy_off]


def test_packed_attention_input_is_checked():
    attention = MultiHeadAttention(32, 4, FusedAttention()).eval()
    mask = torch.tensor([[True] * 4 + [False], [True] * 5])
    x, packed = packed_sequences.pack(torch.randn(2, 5, 32), mask)  # (1, 9, 32)
    assert packed.offsets == [0, 4, 9] and packed.lengths == [4, 5]
    assert packed.positions(1).tolist() == [0, 1, 2, 3, 4]
    with torch.inference_mode():
        assert attention(x, packed=packed)[0].shape == (1, 9, 32)
        with pytest.raises(ValueError, match="shape \\(1, N=9, D\\)"):
            attention(x[:, :8], packed=packed)
        with pytest.raises(ValueError, match="without a mask"):
            attention(x, packed=packed, mask=torch.ones(1, 1, 1, 9, dtype=torch.bool))
        with pytest.raises(ValueError, match="without a mask"):
            attention(x, packed=packed, causal=True)
    cross = MultiHeadAttention(32, 4, FusedAttention(), cross=True).eval()
    with pytest.raises(ValueError, match="without a mask"):
        cross(x, torch.randn(1, 3, 32), packed=packed)


def test_a_compiled_encoder_keeps_the_padded_batch():
    model, config = _encoder()
    ids, mask = _batch(config, [12, 4, 7])
    with torch.inference_mode():
        eager = model(ids, padding_mask=mask)
        compiled = torch.compile(model, fullgraph=True)(ids, padding_mask=mask)  # no graph break
    torch.testing.assert_close(compiled[mask], eager[mask], atol=2e-5, rtol=1e-5)
    assert compiled[~mask].abs().sum() > 0  # the plain path: padded positions computed


def _gradients(model, loss_of):
    model.zero_grad()
    loss = loss_of(model)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()
                           if p.grad is not None}


def _padded(loss_of):
    def padded_loss(model):
        packed_sequences.enabled = False
        try:
            return loss_of(model)
        finally:
            packed_sequences.enabled = True
    return padded_loss


@pytest.mark.parametrize("checkpointed", [False, True])
def test_training_gives_the_padded_loss_and_gradients(checkpointed):
    torch.manual_seed(5)
    config = TransformerConfig.preset("tiny", num_labels=3, pooling="mean")
    ids, mask = _batch(config, [12, 3, 8, 10])
    labels = torch.tensor([0, 2, 1, 1])
    source = torch.randint(3, config.vocab_size, (3, 11))
    source_mask = torch.arange(11) < torch.tensor([11, 4, 7])[:, None]
    target = torch.randint(3, config.vocab_size, (3, 6))
    cases = [
        (SequenceClassifier(config).train(),
         lambda m: torch.nn.functional.cross_entropy(m(ids, padding_mask=mask), labels)),
        (MaskedLM(config).train(),
         lambda m: m(ids, padding_mask=mask)[mask].logsumexp(-1).mean()),
        (Transformer(config).train(),
         lambda m: m(source, target, src_padding_mask=source_mask).logsumexp(-1).mean()),
    ]
    for model, loss_of in cases:
        if checkpointed:
            apply_activation_checkpointing(model)
        assert packed_sequences.applies(mask, uses_positions=False)
        loss, grads = _gradients(model, loss_of)
        padded_loss, padded_grads = _gradients(model, _padded(loss_of))
        torch.testing.assert_close(loss, padded_loss, atol=1e-5, rtol=1e-5)
        assert grads.keys() == padded_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], padded_grads[name], atol=1e-5, rtol=1e-4,
                                       msg=name)


def test_dropout_in_training_and_compiled_layers():
    model, config = _encoder(dropout=0.3)
    model.train()
    ids, mask = _batch(config, [12, 4, 7])
    out = model(ids, padding_mask=mask)
    assert torch.equal(out[~mask], torch.zeros_like(out[~mask]))  # packed, dropout active
    out.sum().backward()
    assert model.encoder.skips_padding
    compile_layers(model)  # a compiled layer would recompile for every packed length
    assert not model.encoder.skips_padding
