"""The efficient kernels inside real models: every family builds and runs, incremental decoding equals
the full forward, beam reordering works on linear attention's recurrent state, config validation."""

import pytest
import torch

from aiayn import CausalLM, Transformer, TransformerConfig
from aiayn.nn.attention.chunked import ChunkedAttention
from aiayn.nn.attention.kernels import FusedAttention, make_kernel
from aiayn.nn.attention.linear import LinearAttention, LinearAttentionState
from aiayn.nn.attention.sparse import SparseAttention
from aiayn.models import MaskedLM, SequenceClassifier, TransformerEncoder

KERNEL_CONFIGS = {
    "chunked": dict(attention="chunked", attention_chunk_size=4),
    "linear": dict(attention="linear", attention_chunk_size=4),
    # window and stride far below the sequence length, so the pattern really is sparse
    "sparse": dict(attention="sparse", attention_window=3, attention_stride=4),
    "sparse-local": dict(attention="sparse", attention_window=3, attention_pattern="local"),
    # strided keys at most 1 stride (3 positions) back: bounded on these 10-14 token sequences (the
    # 14-token LM's columns of 5 rows take the row windows, the shorter ones the masked column grid)
    "sparse-bounded": dict(attention="sparse", attention_window=2, attention_stride=3,
                           attention_stride_count=1),
}


def tiny(name, **overrides):
    return TransformerConfig.preset("tiny", **{**KERNEL_CONFIGS[name], **overrides})


@pytest.mark.parametrize("name", list(KERNEL_CONFIGS))
@pytest.mark.parametrize("norm_first", [False, True], ids=["post-norm", "pre-norm"])
def test_causal_lm_cached_steps_equal_full_forward(name, norm_first):
    model = CausalLM(tiny(name, norm_first=norm_first)).eval()
    tokens = torch.randint(3, 100, (3, 14))
    padding = torch.ones(3, 14, dtype=torch.bool)
    padding[1, 11:] = False  # right padding: queries before it never see it under the causal mask
    full = model(tokens, padding_mask=padding)
    cache = model.new_cache(batch=3, max_length=14)
    prefill = model(tokens[:, :6], padding_mask=padding[:, :6], cache=cache)
    steps = [model(tokens[:, t: t + 1], padding_mask=padding[:, : t + 1], cache=cache)
             for t in range(6, 14)]
    torch.testing.assert_close(torch.cat([prefill] + steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert cache.length == 14


@pytest.mark.parametrize("name", list(KERNEL_CONFIGS))
def test_encoder_decoder_cached_steps_equal_full_forward(name):
    model = Transformer(tiny(name)).eval()
    src, tgt = torch.randint(3, 100, (2, 11)), torch.randint(3, 100, (2, 10))
    src_mask = torch.ones(2, 11, dtype=torch.bool)
    src_mask[1, 7:] = False
    full = model(src, tgt, src_padding_mask=src_mask)
    memory = model.encode(src, src_mask)
    cache = model.new_cache(batch=2, max_length=10)
    first = model.decode(tgt[:, :3], memory, memory_padding_mask=src_mask, cache=cache)
    rest = [model.decode(tgt[:, t: t + 1], None, memory_padding_mask=src_mask, cache=cache)
            for t in range(3, 10)]
    torch.testing.assert_close(torch.cat([first] + rest, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(KERNEL_CONFIGS))
def test_every_family_runs_forward_and_backward(name):
    config = tiny(name)
    ids = torch.randint(3, 100, (2, 9))
    padding = torch.ones(2, 9, dtype=torch.bool)
    padding[0, 6:] = False
    outputs = {
        "encoder-decoder": Transformer(config)(ids, ids[:, :7], src_padding_mask=padding),
        "decoder-only": CausalLM(config)(ids, padding_mask=padding),
        "encoder": TransformerEncoder(config)(ids, padding_mask=padding),
        "classifier": SequenceClassifier(config)(ids, padding_mask=padding),
        "masked-lm": MaskedLM(config)(ids, padding_mask=padding),
    }
    assert outputs["encoder-decoder"].shape == (2, 7, 100)
    assert outputs["decoder-only"].shape == (2, 9, 100)
    assert outputs["encoder"].shape == (2, 9, 32)
    assert outputs["classifier"].shape == (2, 2)
    assert outputs["masked-lm"].shape == (2, 9, 100)
    for family, out in outputs.items():
        assert torch.isfinite(out).all(), family
        out.square().mean().backward()


def test_kernels_are_chosen_by_config_including_cross_attention():
    kernels = {name: make_kernel(tiny(name)) for name in KERNEL_CONFIGS}
    assert isinstance(kernels["chunked"], ChunkedAttention) and kernels["chunked"].chunk_size == 4
    assert isinstance(kernels["linear"], LinearAttention)
    sparse = kernels["sparse"]
    assert isinstance(sparse, SparseAttention)
    assert (sparse.pattern, sparse.window, sparse.stride) == ("local+strided", 3, 4)
    # A positional pattern means nothing between two sequences: sparse cross-attention is exact.
    assert isinstance(make_kernel(tiny("sparse"), cross=True), ChunkedAttention)
    assert isinstance(make_kernel(tiny("sparse", attention_dropout=0.1), cross=True),
                      FusedAttention)
    layer = Transformer(tiny("sparse")).decoder.layers[0]
    assert isinstance(layer.self_attention.kernel, SparseAttention)
    assert isinstance(layer.cross_attention.kernel, ChunkedAttention)


def test_linear_decoding_state_is_constant_size_and_follows_beams():
    model = Transformer(tiny("linear")).eval()
    src, tgt = torch.randint(3, 100, (3, 6)), torch.randint(3, 100, (3, 5))
    memory = model.encode(src)
    cache = model.new_cache(batch=3, max_length=5)
    assert all(isinstance(layer, LinearAttentionState) for layer in cache.self_attention)
    sizes = [layer.state.shape for layer in cache.self_attention]
    model.decode(tgt[:, :3], memory, cache=cache)
    assert [layer.state.shape for layer in cache.self_attention] == sizes == [(3, 4, 8, 8)] * 2
    order = torch.tensor([2, 2, 0])
    cache.reorder(order)
    stepped = model.decode(tgt[order, 3:4], None, cache=cache)
    full = model(src[order], tgt[order, :4])
    torch.testing.assert_close(stepped[:, 0], full[:, 3], rtol=1e-5, atol=1e-5)


def test_linear_state_capacity_and_position_checks():
    model = CausalLM(tiny("linear")).eval()
    cache = model.new_cache(batch=1, max_length=4)
    model(torch.randint(3, 100, (1, 3)), cache=cache)
    with pytest.raises(ValueError, match="overflow"):
        model(torch.randint(3, 100, (1, 2)), cache=cache)
    state = LinearAttentionState(1, 1, 8, 4)
    q = torch.zeros(1, 1, 1, 4)
    with pytest.raises(ValueError, match="holds 0 positions"):
        LinearAttention().decode(q, q, q, state, start=2)
    with pytest.raises(ValueError, match="overflow"):
        LinearAttention().decode(torch.zeros(1, 1, 9, 4), torch.zeros(1, 1, 9, 4),
                                 torch.zeros(1, 1, 9, 4), state, start=0)


@pytest.mark.parametrize("field, value, message", [
    ("attention_window", 0, "attention_window must be a positive integer"),
    ("attention_stride", -1, "attention_stride must be a positive integer"),
    ("attention_stride_count", 0, "attention_stride_count must be a positive integer or None"),
    ("attention_chunk_size", 1.5, "attention_chunk_size must be a positive integer"),
    ("attention_pattern", "dilated", "attention_pattern must be one of"),
])
def test_config_fields_are_validated(field, value, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig.preset("tiny", attention="sparse", **{field: value})


@pytest.mark.parametrize("kernel", ["linear", "chunked"])
def test_attention_dropout_is_refused_where_there_are_no_weights(kernel):
    with pytest.raises(ValueError, match="attention_dropout must be 0"):
        TransformerConfig.preset("tiny", attention=kernel, attention_dropout=0.1)
    assert TransformerConfig.preset("tiny", attention="sparse", attention_dropout=0.1)


def test_config_round_trips_the_new_fields(tmp_path):
    config = tiny("sparse", attention_pattern="strided")
    config.save(tmp_path / "config.json")
    assert TransformerConfig.load(tmp_path / "config.json") == config
