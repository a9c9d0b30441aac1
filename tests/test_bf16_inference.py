"""Inference under CPU bf16 autocast (``aiayn.inference_linear.bf16_packed_linear``, issue 6).

- a product of 2+ rows multiplies a oneDNN-packed bf16 copy of the weight: the same bf16 result as
  autocast's ``F.linear`` (+ activation, up to bf16 rounding), and only where it applies (no autograd,
  bf16 autocast, 2+ rows, a weight with a version counter, no hooks, the switch on);
- the copy is rebuilt when the weight changes;
- under autocast the float32 decoding paths (packed float32 copies, split one-row products, oneDNN on
  the float32 weight) do not run: autocast's products are bf16;
- whole models (encoder forward, the LM's logits, the output projection at decoding rows) match the
  plain autocast path, and greedy decoding under autocast runs on the bf16 copies.
"""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from aiayn import CausalLM, TransformerConfig
from aiayn import inference_linear
from aiayn.decoding.sampling import generate
from aiayn.models import TransformerEncoder

pytestmark = pytest.mark.skipif(not inference_linear._BF16_SUPPORTED,
                                reason="no oneDNN bf16 kernels on this CPU")

ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu,
               "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def _bf16_autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def _took_the_path(weight: torch.Tensor) -> bool:
    return (id(weight), "bf16") in inference_linear.packed_weights._entries


def _close(got: torch.Tensor, expected: torch.Tensor, tolerance: float = 2e-2) -> None:
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def _layer(inputs: int = 48, outputs: int = 96, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(inputs, outputs, bias=bias)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(2, 48), (7, 48), (64, 48), (3, 40, 48)])
def test_packed_bf16_product_equals_autocast_linear(shape, bias):
    layer = _layer(bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad(), _bf16_autocast():
        expected = F.linear(x, layer.weight, layer.bias)
        got = inference_linear.linear(layer, x)
    assert _took_the_path(layer.weight)
    assert got.shape == expected.shape
    _close(got, expected)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("rows", [2, 64, 300])
def test_fused_activation_equals_autocast_linear_then_activation(activation, rows):
    layer = _layer()
    x = torch.randn(rows, 48)
    with torch.no_grad(), _bf16_autocast():
        expected = ACTIVATIONS[activation](F.linear(x, layer.weight, layer.bias))
        got = inference_linear.linear_activation(layer, x, activation)
    assert got is not None and _took_the_path(layer.weight)
    _close(got, expected)


def test_input_already_in_bf16():
    layer = _layer()
    x = torch.randn(5, 48).to(torch.bfloat16)
    with torch.no_grad(), _bf16_autocast():
        _close(inference_linear.linear(layer, x), F.linear(x, layer.weight, layer.bias))


def test_only_where_it_applies(monkeypatch):
    x = torch.randn(8, 48)

    def takes(layer, x=x, grad=False, dtype=torch.bfloat16):
        with torch.set_grad_enabled(grad), torch.autocast("cpu", dtype=dtype):
            inference_linear.linear(layer, x)
        return _took_the_path(layer.weight)

    assert takes(_layer())
    assert not takes(_layer(), grad=True)  # training keeps autocast's own products
    assert not takes(_layer(), x=torch.randn(1, 48))  # one row: autocast's GEMV
    assert not takes(_layer(), dtype=torch.float16)  # fp16 autocast
    with torch.no_grad():  # no autocast at all
        plain = _layer()
        inference_linear.linear(plain, x)
        assert not _took_the_path(plain.weight)
    hooked = _layer()
    hooked.register_forward_hook(lambda *args: None)
    assert not takes(hooked)  # the direct call would skip the hook
    with torch.inference_mode():
        frozen = _layer()  # an inference tensor: no version counter, a copy could go stale
    assert not takes(frozen)
    monkeypatch.setattr(inference_linear, "autocast_bf16_enabled", False)
    assert not takes(_layer())


def test_copy_is_rebuilt_when_the_weight_changes():
    layer = _layer()
    x = torch.randn(6, 48)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, fused=True)
    with torch.no_grad(), _bf16_autocast():
        inference_linear.linear(layer, x)
    layer(x).square().sum().backward()
    optimizer.step()  # fused: the version counter does not move, the step count does
    with torch.no_grad(), _bf16_autocast():
        _close(inference_linear.linear(layer, x), F.linear(x, layer.weight, layer.bias))
    with torch.no_grad():
        layer.weight.copy_(torch.randn_like(layer.weight))
        layer.bias.zero_()
    # a new autocast region: autocast's own cast cache does not see in-place changes within one
    with torch.no_grad(), _bf16_autocast():
        _close(inference_linear.linear(layer, x), F.linear(x, layer.weight, layer.bias))


def test_float32_decoding_paths_do_not_run_under_autocast(monkeypatch):
    layer = _layer(outputs=inference_linear.PACKED_MIN_OUTPUTS)
    forbidden = []
    monkeypatch.setattr(inference_linear, "split_gemv",
                        lambda *args: forbidden.append("split_gemv"))
    monkeypatch.setattr(inference_linear, "_onednn_packed",
                        lambda *args: forbidden.append("float32 copy"))
    with torch.no_grad(), _bf16_autocast():
        for rows in (1, 2, 16, 64):
            x = torch.randn(rows, 1, 48)
            assert inference_linear.linear(layer, x).dtype == torch.bfloat16
            assert not inference_linear.uses_small_rows(x, layer.weight)
            assert not inference_linear.uses_packed_layer(x, layer)
            assert not inference_linear.uses_uncopied_step(x, layer.weight)
    assert forbidden == []


def _config(**overrides) -> TransformerConfig:
    base = dict(vocab_size=inference_linear.PACKED_MIN_OUTPUTS, d_model=64, n_heads=4, d_ff=128,
                n_encoder_layers=0, n_decoder_layers=2, max_length=64, dropout=0.0,
                norm_first=True, activation="gelu", positions="learned", tie_output=True,
                pad_id=0, bos_id=0, eos_id=0)
    base.update(overrides)
    return TransformerConfig(**base)


def _fast_and_plain(call, monkeypatch):
    with torch.no_grad(), _bf16_autocast():
        fast = call()
        monkeypatch.setattr(inference_linear, "autocast_bf16_enabled", False)
        plain = call()
        monkeypatch.setattr(inference_linear, "autocast_bf16_enabled", True)
    return fast, plain


def test_encoder_forward_matches_the_plain_autocast_path(monkeypatch):
    torch.manual_seed(0)
    encoder = TransformerEncoder(_config(n_encoder_layers=2, n_decoder_layers=0,
                                         vocab_size=200)).eval()
    ids = torch.randint(1, 200, (3, 20))
    fast, plain = _fast_and_plain(lambda: encoder(ids), monkeypatch)
    assert _took_the_path(encoder.encoder.layers[0].feedforward.linear1.weight)
    torch.testing.assert_close(fast.float(), plain.float(), atol=5e-2, rtol=5e-2)


def test_lm_logits_and_output_projection_match_the_plain_autocast_path(monkeypatch):
    torch.manual_seed(0)
    model = CausalLM(_config()).eval()
    ids = torch.randint(1, 1000, (4, 12))
    fast, plain = _fast_and_plain(lambda: model(ids), monkeypatch)
    assert _took_the_path(model.lm_head.weight)  # 48 rows onto the vocabulary
    torch.testing.assert_close(fast.float(), plain.float(), atol=5e-2, rtol=5e-2)
    hidden = torch.randn(4, 1, 64)  # a decoding step's rows
    fast, plain = _fast_and_plain(lambda: model.lm_head(hidden), monkeypatch)
    torch.testing.assert_close(fast.float(), plain.float(), atol=5e-2, rtol=5e-2)


def test_greedy_decoding_under_autocast_runs_on_the_bf16_copies(monkeypatch):
    torch.manual_seed(0)
    model = CausalLM(_config()).eval()
    prompt = torch.randint(1, 1000, (4, 5))
    forbidden = []
    monkeypatch.setattr(inference_linear, "split_gemv",
                        lambda *args: forbidden.append("split_gemv"))
    with torch.no_grad(), _bf16_autocast():
        result = generate(model, prompt, max_new_tokens=6, greedy=True)
    assert forbidden == [] and _took_the_path(model.lm_head.weight)
    assert [len(tokens) for tokens in result.tokens] == [6] * 4
