"""T5's blocks in aiayn (issue 32): the relative position bias (buckets equal Hugging Face's, one table
per stack, causal in the decoder), with the KV cache (cached decoding == full forward) and with the
fused kernel (== the reference kernel), refused by the efficient kernels and next to absolute
positions; the rescaled output projection in the chunked training loss. HF parity is
tests/test_hf_t5.py."""

from __future__ import annotations

import pytest
import torch

from aiayn import CausalLM, Transformer, TransformerConfig, count_parameters
from aiayn.nn.attention.chunked import ChunkedAttention
from aiayn.nn.attention.kernels import FusedAttention, ReferenceAttention
from aiayn.nn.attention.linear import LinearAttention
from aiayn.nn.attention.sparse import SparseAttention
from aiayn.nn.relative_bias import RelativePositionBias, relative_position_bucket
from aiayn.training.chunked_loss import projected_loss

pytestmark = pytest.mark.usefixtures("one_thread")

T5 = TransformerConfig.preset(
    "tiny", vocab_size=60, d_model=32, n_heads=4, d_ff=48, n_encoder_layers=2, n_decoder_layers=3,
    max_length=64, dropout=0.0, norm="rms", norm_first=True, bias=False, positions="none",
    scale_embeddings=False, relative_attention_buckets=8, relative_attention_max_distance=20,
    scale_attention=False, scale_output=True, activation="gelu_tanh", gated_ffn=True, pad_id=0,
    eos_id=1, bos_id=0)


def t5(seed: int = 0, **changes) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(T5.replace(**changes)).eval()
    with torch.no_grad():  # a bias table far from 0, so a wrong bucket shows
        for stack in (model.encoder, model.decoder):
            stack.position_bias.embedding.weight.normal_(std=1.0)
    return model


@pytest.mark.parametrize("bidirectional", [True, False], ids=["encoder", "decoder"])
@pytest.mark.parametrize("buckets, distance", [(32, 128), (8, 20)])
def test_buckets_equal_hugging_faces(bidirectional, buckets, distance):
    transformers = pytest.importorskip("transformers")
    hf_bucket = transformers.models.t5.modeling_t5.T5Attention._relative_position_bucket
    relative = torch.arange(-300, 301)[None, :] - torch.arange(0, 5)[:, None]  # (5, 601)
    ours = relative_position_bucket(relative, bidirectional=bidirectional, buckets=buckets,
                                    max_distance=distance)
    want = hf_bucket(relative, bidirectional=bidirectional, num_buckets=buckets,
                     max_distance=distance)
    assert torch.equal(ours, want)
    assert ours.min() >= 0 and ours.max() == buckets - 1
    if not bidirectional:  # a causal decoder never tells keys to the right apart
        assert (ours[relative > 0] == 0).all()
    # The module looks the buckets up in a table of the distances up to max_distance: the same
    # buckets for queries 250..254 over keys 0..600, distances far past max_distance included.
    bias = RelativePositionBias(buckets, distance, 1, bidirectional=bidirectional)
    with torch.no_grad():
        bias.embedding.weight.copy_(torch.arange(buckets, dtype=torch.float)[:, None])
    relative = torch.arange(0, 601)[None, :] - torch.arange(250, 255)[:, None]  # (5, 601)
    want = hf_bucket(relative, bidirectional=bidirectional, num_buckets=buckets,
                     max_distance=distance)
    assert torch.equal(bias(5, 601, start=250)[0, 0].long(), want)


def test_one_bias_table_per_stack_shared_by_its_layers():
    model = t5()
    tables = [name for name, _ in model.named_parameters() if "position_bias" in name]
    assert tables == ["encoder.position_bias.embedding.weight",
                      "decoder.position_bias.embedding.weight"]
    assert model.encoder.position_bias.bidirectional and not model.decoder.position_bias.bidirectional
    bias = model.decoder.position_bias(3, 7, start=4)  # queries 4..6 over keys 0..6
    assert bias.shape == (1, 4, 3, 7)
    torch.testing.assert_close(bias[0, :, 0, :5], bias[0, :, 2, 2:7])  # depends on j - i only


@pytest.mark.parametrize("attention", ["fused", "reference"])
def test_cached_decoding_equals_the_full_forward(attention):
    model = t5(attention=attention)
    source = torch.randint(2, 60, (2, 9))
    source_mask = torch.ones_like(source, dtype=torch.bool)
    source_mask[1, 6:] = False
    target = torch.randint(2, 60, (2, 11))
    with torch.no_grad():
        full = model(source, target, src_padding_mask=source_mask)
        memory = model.encode(source, source_mask)
        cache = model.new_cache(2, 16)
        steps = [model.decode(target[:, :4], memory, memory_padding_mask=source_mask, cache=cache)]
        steps += [model.decode(target[:, t:t + 1], None, memory_padding_mask=source_mask,
                               cache=cache) for t in range(4, 11)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_fused_kernel_adds_the_bias_as_the_reference_does_and_keeps_empty_rows_zero():
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, 4, 7, 8), torch.randn(2, 4, 7, 8)
    bias = torch.randn(1, 4, 5, 7) * 3
    mask = torch.ones(2, 1, 5, 7, dtype=torch.bool)
    mask[1, :, 2] = False  # a query row with no key
    for scale in (None, 1.0):
        want = ReferenceAttention(scale)(q, k, v, mask=mask, causal=True, position_bias=bias)
        got = FusedAttention(scale)(q, k, v, mask=mask, causal=True, position_bias=bias)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.isfinite(got).all() and (got[1, :, 2] == 0).all()
        no_mask = FusedAttention(scale)(q, k, v, position_bias=bias)
        torch.testing.assert_close(no_mask, ReferenceAttention(scale)(q, k, v, position_bias=bias),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", [ChunkedAttention(4), LinearAttention(4),
                                    SparseAttention("local", window=4)],
                         ids=["chunked", "linear", "sparse"])
def test_efficient_kernels_refuse_a_position_bias(kernel):
    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="cannot add a position bias .* use attention='fused'"):
        kernel(q, q, q, position_bias=torch.zeros(1, 2, 5, 5))


@pytest.mark.parametrize("fields, message", [
    (dict(attention="chunked"), "attention='chunked' cannot add a relative position bias"),
    (dict(attention="sparse"), "attention='sparse' cannot add a relative position bias"),
    (dict(attention="linear", scale_attention=True),
     "attention='linear' cannot add a relative position bias"),
    (dict(positions="learned"), "replaces absolute positions: set positions='none', not 'learned'"),
    (dict(positions="sinusoidal"), "set positions='none', not 'sinusoidal'"),
    (dict(positions="rotary"), "set positions='none', not 'rotary'"),
    (dict(relative_attention_buckets=2), "relative_attention_buckets must be >= 4"),
    (dict(relative_attention_max_distance=3), "below 2 \\* relative_attention_max_distance"),
    (dict(relative_attention_buckets=-1), "relative_attention_buckets must be a non-negative"),
])
def test_bad_t5_configs_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        T5.replace(**fields)


def test_left_padded_positions_are_refused_with_a_relative_bias():
    model = CausalLM(T5.replace(n_encoder_layers=0)).eval()
    ids = torch.randint(2, 60, (2, 4))
    with pytest.raises(ValueError, match="relative position bias needs contiguous positions"):
        model(ids, padding_mask=ids > 0, positions=torch.zeros(2, 4, dtype=torch.long))


def test_rescaled_output_in_the_chunked_loss_equals_the_logits_loss():
    model = t5()
    hidden = torch.randn(3, 7, 32, requires_grad=True)
    targets = torch.randint(0, 60, (3, 7))
    logits = model.generator(hidden)
    torch.testing.assert_close(logits, (hidden * 32 ** -0.5) @ model.generator.weight.T)
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, 60), targets.reshape(-1),
                                             reduction="sum")
    torch.testing.assert_close(projected_loss(hidden, model.generator, targets), want,
                               rtol=1e-5, atol=1e-4)


def test_t5_blocks_have_no_biases_and_one_shared_embedding():
    model = t5()
    assert all("bias" not in name.split(".")[-1] for name, _ in model.named_parameters())
    assert model.generator.weight is model.encoder.embeddings.tokens.weight \
        is model.decoder.embeddings.tokens.weight
    assert model.encoder.embeddings.positions is None and model.encoder.embeddings.scale == 1.0
    untied = t5(tie_output=False, scale_output=False)
    assert count_parameters(untied) == count_parameters(model) + 60 * 32


@pytest.mark.parametrize("tie_output", [True, False])
def test_a_rescaled_output_starts_from_unit_scale_embeddings(tie_output):
    """T5's logits are (h / sqrt(D)) E^T: its embeddings (and an untied head) start at N(0, 1), as in
    mesh-tensorflow and HF's T5 init; the paper's models keep N(0, D^-1/2)."""
    torch.manual_seed(0)
    config = TransformerConfig.preset("t5-cpu", vocab_size=4000, tie_output=tie_output)
    model = Transformer(config)
    embedding = model.decoder.embeddings.tokens.weight
    assert embedding.std().item() == pytest.approx(1.0, rel=0.02)
    assert model.generator.weight.std().item() == pytest.approx(1.0, rel=0.02)
    assert (model.generator.weight is embedding) == tie_output
    paper = Transformer(TransformerConfig.preset("mt-cpu", vocab_size=4000))
    assert paper.decoder.embeddings.tokens.weight.std().item() == pytest.approx(128 ** -0.5,
                                                                                 rel=0.02)
