"""Parity with PyTorch's own implementation: copy torch.nn weights into aiayn, get the same outputs."""

import pytest
import torch
from torch import nn

from aiayn import Transformer
from aiayn.interop.torch_nn import (config_from_torch, load_torch_decoder, load_torch_encoder,
                                    load_torch_transformer)
from aiayn.masks import key_padding_to_attention
from aiayn.nn.stacks import Decoder, Encoder

D, H, F = 48, 4, 80
VARIANTS = [pytest.param(norm_first, activation, id=f"{'pre' if norm_first else 'post'}-{activation}")
            for norm_first in (False, True) for activation in ("relu", "gelu")]


def _inputs(batch=3, source=9, target=7):
    src, tgt = torch.randn(batch, source, D), torch.randn(batch, target, D)
    src_real = torch.ones(batch, source, dtype=torch.bool)
    src_real[0, 6:] = False
    src_real[2, 8:] = False
    tgt_real = torch.ones(batch, target, dtype=torch.bool)
    tgt_real[1, 5:] = False
    return src, tgt, src_real, tgt_real


@pytest.mark.parametrize("norm_first, activation", VARIANTS)
@pytest.mark.parametrize("fused_projections", [True, False])
def test_nn_transformer_parity(norm_first, activation, fused_projections):
    reference = nn.Transformer(D, H, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=F,
                               dropout=0.1, activation=activation, batch_first=True,
                               norm_first=norm_first)
    reference.eval()
    config = config_from_torch(reference, vocab_size=10, fused_projections=fused_projections)
    assert config.final_norm  # nn.Transformer always ends both stacks with a LayerNorm
    ours = Transformer(config).eval()
    load_torch_transformer(reference, ours)
    src, tgt, src_real, tgt_real = _inputs()
    causal = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool).triu(1)  # True = blocked
    with torch.no_grad():
        expected = reference(src, tgt, tgt_mask=causal, src_key_padding_mask=~src_real,
                             tgt_key_padding_mask=~tgt_real, memory_key_padding_mask=~src_real)
        memory, _ = ours.encoder.forward_embedded(src, key_padding_to_attention(src_real))
        actual, _, _ = ours.decoder.forward_embedded(
            tgt, memory, self_mask=key_padding_to_attention(tgt_real),
            memory_mask=key_padding_to_attention(src_real))
    assert (actual[tgt_real] - expected[tgt_real]).abs().max() <= 1e-5


@pytest.mark.parametrize("norm_first, activation", VARIANTS)
@pytest.mark.parametrize("final_norm", [True, False])
def test_nn_transformer_encoder_parity(norm_first, activation, final_norm):
    layer = nn.TransformerEncoderLayer(D, H, F, dropout=0.1, activation=activation,
                                       batch_first=True, norm_first=norm_first)
    reference = nn.TransformerEncoder(layer, num_layers=3, norm=nn.LayerNorm(D) if final_norm else None,
                                      enable_nested_tensor=False).eval()
    config = config_from_torch(reference, vocab_size=10)
    ours = Encoder(config, nn.Embedding(10, D)).eval()
    load_torch_encoder(reference, ours)
    src, _, src_real, _ = _inputs()
    with torch.no_grad():
        expected = reference(src, src_key_padding_mask=~src_real)
        actual, _ = ours.forward_embedded(src, key_padding_to_attention(src_real))
        unmasked_expected = reference(src)
        unmasked_actual, _ = ours.forward_embedded(src)
    assert (actual[src_real] - expected[src_real]).abs().max() <= 1e-5
    assert (unmasked_actual - unmasked_expected).abs().max() <= 1e-5


@pytest.mark.parametrize("norm_first, activation", VARIANTS)
def test_nn_transformer_decoder_parity(norm_first, activation):
    layer = nn.TransformerDecoderLayer(D, H, F, dropout=0.1, activation=activation,
                                       batch_first=True, norm_first=norm_first)
    reference = nn.TransformerDecoder(layer, num_layers=2, norm=nn.LayerNorm(D)).eval()
    config = config_from_torch(reference, vocab_size=10)
    ours = Decoder(config, nn.Embedding(10, D), cross_attention=True).eval()
    load_torch_decoder(reference, ours)
    memory, tgt, memory_real, tgt_real = _inputs()
    causal = torch.ones(tgt.shape[1], tgt.shape[1], dtype=torch.bool).triu(1)  # True = blocked
    with torch.no_grad():
        expected = reference(tgt, memory, tgt_mask=causal, tgt_key_padding_mask=~tgt_real,
                             memory_key_padding_mask=~memory_real)
        actual, _, _ = ours.forward_embedded(tgt, memory,
                                             self_mask=key_padding_to_attention(tgt_real),
                                             memory_mask=key_padding_to_attention(memory_real))
    assert (actual[tgt_real] - expected[tgt_real]).abs().max() <= 1e-5


def test_copy_refuses_mismatched_architectures():
    reference = nn.Transformer(D, H, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=F,
                               batch_first=True)
    config = config_from_torch(reference, vocab_size=10)
    too_deep = Transformer(config.replace(n_encoder_layers=3))
    with pytest.raises(ValueError, match="torch.nn state has no 'layers.2"):
        load_torch_transformer(reference, too_deep)
    too_wide = Transformer(config.replace(d_ff=F * 2))
    with pytest.raises(ValueError, match="shape mismatch.*linear1"):
        load_torch_transformer(reference, too_wide)
    with pytest.raises(TypeError, match="expected nn.Transformer"):
        config_from_torch(nn.Linear(2, 2))
