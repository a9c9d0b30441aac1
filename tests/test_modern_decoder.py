"""The modern decoder's blocks (issue 33): RMSNorm, rotary positions, SwiGLU, grouped-query attention.

Each block against its formula or an independent equivalent (a grouped-query model equals the
multi-head model whose key/value heads are repeated; the fused kernel's grouping equals its repeat
fallback and the other kernels), cached decoding against the full forward (also left-padded and in
fixed-shape slot steps), the KV cache's size, and bad configs refused with the field named.
HF Llama parity is tests/test_hf_llama.py.
"""

from __future__ import annotations

import pytest
import torch

from aiayn import CausalLM, TransformerConfig
from aiayn.decoding.generation import generate
from aiayn.nn.attention import kernels as kernel_module
from aiayn.nn.attention.chunked import ChunkedAttention
from aiayn.nn.attention.kernels import FusedAttention, ReferenceAttention, repeat_kv_heads
from aiayn.nn.attention.sparse import SparseAttention
from aiayn.nn.feedforward import GatedFeedForward
from aiayn.nn.rotary import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.usefixtures("one_thread")

LLAMA = TransformerConfig.preset("llama-char", vocab_size=50, d_model=64, n_heads=8, n_kv_heads=2,
                                 d_ff=96, n_decoder_layers=2, max_length=48, init_std=0.2)
PROMPTS = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]


def llama(seed: int = 0, **changes) -> CausalLM:
    torch.manual_seed(seed)
    model = CausalLM(LLAMA.replace(**changes)).eval()
    with torch.no_grad():  # gains away from 1 so a wrongly applied norm shows
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1 + 0.3 * torch.randn_like(parameter))
    return model


@torch.no_grad()
def cached(model: CausalLM, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits of a prefill of ``prefill`` tokens, then one token at a time on the KV cache."""
    cache = model.new_cache(ids.shape[0], ids.shape[1])
    steps = [model(ids[:, :prefill], cache=cache)] + [model(ids[:, t:t + 1], cache=cache)
                                                      for t in range(prefill, ids.shape[1])]
    return torch.cat(steps, dim=1)


def test_rms_norm_is_its_formula_without_mean_or_bias():
    model = llama()
    norm = model.decoder.layers[0].self_attention_residual.norm
    x = torch.randn(3, 5, 64) + 2.0  # a mean far from 0: LayerNorm would remove it
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + LLAMA.layer_norm_eps) * norm.weight
    torch.testing.assert_close(norm(x), want)
    assert [name for name, _ in norm.named_parameters()] == ["weight"]


def test_rotation_keeps_lengths_and_scores_depend_only_on_the_distance():
    rotary = RotaryEmbedding(16, theta=10000.0, max_length=64)
    q, k = torch.randn(2, 3, 1, 16), torch.randn(2, 3, 1, 16)

    def score(m: int, n: int) -> torch.Tensor:
        rotated_q = apply_rotary(q, rotary(torch.tensor([m])))
        rotated_k = apply_rotary(k, rotary(torch.tensor([n])))
        return (rotated_q * rotated_k).sum(-1)

    rotated = apply_rotary(q, rotary(torch.tensor([7])))
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1))
    torch.testing.assert_close(score(9, 4), score(25, 20), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(score(9, 4), score(9, 5), atol=1e-3)
    # position 0 is the identity; per-row positions (B, T) give per-row rotations
    torch.testing.assert_close(apply_rotary(q, rotary(torch.tensor([0]))), q)
    cos, sin = rotary(torch.tensor([[3], [5]]))
    assert cos.shape == sin.shape == (2, 1, 1, 16)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def test_linear_scaling_is_position_interpolation():
    """Chen et al. 2023: position m with factor f is plain RoPE at m / f."""
    plain = RotaryEmbedding(16, theta=10000.0, max_length=256)
    scaled = RotaryEmbedding(16, theta=10000.0, max_length=256,
                             scaling={"rope_type": "linear", "factor": 4.0})
    positions = torch.arange(0, 200, 4)
    for got, want in zip(scaled(positions), plain(positions // 4)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_llama3_scaling_keeps_short_wavelengths_and_stretches_long_ones():
    """Llama 3.1's rule by hand: wavelengths under 32 / 4 = 8 positions kept, over 32 / 1 divided
    by the factor 8, and in between (1 - s) theta / 8 + s theta with s = (32 / wavelength - 1) / 3."""
    plain = RotaryEmbedding(16, theta=10000.0).inverse_frequency
    scaled = RotaryEmbedding(16, theta=10000.0, scaling=LLAMA3).inverse_frequency
    wavelengths = 2 * torch.pi / plain  # 6.3, 19.9, 62.8, ... positions
    short, long = wavelengths < 8, wavelengths > 32
    assert short.any() and long.any() and (~short & ~long).any()  # all three bands exercised
    torch.testing.assert_close(scaled[short], plain[short], rtol=0, atol=0)
    torch.testing.assert_close(scaled[long], plain[long] / 8, rtol=1e-6, atol=0)
    smooth = (32 / wavelengths - 1) / 3
    between = ~short & ~long
    torch.testing.assert_close(scaled[between],
                               ((1 - smooth) * plain / 8 + smooth * plain)[between])


def test_yarn_scales_cos_and_sin_by_its_attention_factor():
    rotary = RotaryEmbedding(16, theta=10000.0, max_length=256, scaling=YARN)
    cos, sin = rotary(torch.arange(100))
    factor = 0.1 * torch.log(torch.tensor(4.0)) + 1  # Peng et al. 2023, eq. 22: sqrt(1/t)
    torch.testing.assert_close(cos ** 2 + sin ** 2, torch.full_like(cos, factor.item() ** 2))
    plain = RotaryEmbedding(16, theta=10000.0).inverse_frequency
    torch.testing.assert_close(rotary.inverse_frequency[0], plain[0])  # fastest: kept
    torch.testing.assert_close(rotary.inverse_frequency[-1], plain[-1] / 4)  # slowest: / factor


@pytest.mark.parametrize("scaling", [LLAMA3, YARN], ids=["llama3", "yarn"])
def test_scaled_rope_decodes_with_a_cache_as_the_full_forward_and_saves(tmp_path, scaling):
    model = llama(rope_scaling=scaling)
    ids = torch.randint(3, 50, (2, 40))  # past original_max_position_embeddings = 32
    with torch.no_grad():
        full = model(ids)
        steps = cached(model, ids, 20)
        assert not torch.allclose(llama()(ids), full, atol=1e-3)  # the scaling changes the model
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)
    model.config.save(tmp_path / "config.json")
    assert TransformerConfig.load(tmp_path / "config.json") == model.config


def test_qkv_bias_puts_biases_on_q_k_v_alone():
    """Qwen2: biases on the query, key and value projections, none on the output or the FFN."""
    for fused in (True, False):
        attention = llama(qkv_bias=True, bias=False, fused_projections=fused
                          ).decoder.layers[0].self_attention
        projections = [attention.qkv_proj] if fused else [attention.q_proj, attention.k_proj,
                                                          attention.v_proj]
        assert all(p.bias is not None for p in projections) and attention.out_proj.bias is None
    model = llama(qkv_bias=False, bias=True)
    assert model.decoder.layers[0].self_attention.qkv_proj.bias is None
    assert model.decoder.layers[0].feedforward.gate_proj.bias is not None


def test_qk_norm_normalises_each_heads_queries_and_keys_before_the_rotation():
    """QK-norm (Qwen3) by hand: RMSNorm over Dh of every head's q and k, times its gain."""
    model = llama(qk_norm=True)
    attention = model.decoder.layers[0].self_attention
    x = torch.randn(2, 5, 64)
    q, k, v = attention.qkv_proj(x).split(attention.split_sizes, dim=-1)
    q, k = q.view(2, 5, 8, 8).transpose(1, 2), k.view(2, 5, 2, 8).transpose(1, 2)

    def rms(t: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return t / torch.sqrt(t.pow(2).mean(-1, keepdim=True) + LLAMA.layer_norm_eps) * gain

    got_q, got_k, _ = attention.project(x)
    torch.testing.assert_close(got_q, rms(q, attention.q_norm.weight))
    torch.testing.assert_close(got_k, rms(k, attention.k_norm.weight))
    assert attention.q_norm.weight.shape == (8,)  # over Dh, shared by the heads
    ids = torch.randint(3, 50, (2, 12))
    with torch.no_grad():
        steps = cached(model, ids, 5)
        torch.testing.assert_close(steps, model(ids), rtol=1e-5, atol=1e-5)


def test_a_sliding_window_hides_keys_more_than_w_minus_1_behind_by_hand():
    """Window 3: query 5 sees keys 3, 4, 5 (and, causal, nothing after); one layer of two slides."""
    from aiayn.masks import causal_mask, window_mask

    allowed = window_mask(torch.arange(2, 6), 6, 3) & causal_mask(4, 6)  # queries at slots 2..5
    assert allowed.int().tolist() == [[1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 0],
                                      [0, 0, 0, 1, 1, 1]]
    model, plain = llama(sliding_window=3, sliding_window_layers=[1]), llama()
    ids = torch.randint(3, 50, (2, 12))
    with torch.no_grad():
        got, free = model(ids), plain(ids)
        torch.testing.assert_close(got[:, :3], free[:, :3])  # within the window: no difference
        assert not torch.allclose(got[:, 3:], free[:, 3:], atol=1e-3)
        # by hand: layer 0 unmasked but causal, layer 1 with exactly the band above, then the head
        rotation = model.decoder.rotary(torch.arange(12))
        layer0, layer1 = model.decoder.layers
        x = layer0(model.decoder.embeddings(ids), rotation=rotation)[0]
        band = causal_mask(12, 12) & window_mask(torch.arange(12), 12, 3)  # (T, T)
        x = layer1(x, self_mask=band, rotation=rotation)[0]
        torch.testing.assert_close(model.lm_head(model.decoder.norm(x)), got)


@pytest.mark.parametrize("attention", ["fused", "reference", "chunked"])
def test_sliding_window_cached_decoding_and_slot_steps_equal_the_full_forward(attention):
    from aiayn.fast.cuda_graphs import GraphedSteps

    model = llama(sliding_window=4, attention=attention, attention_chunk_size=4)
    ids = torch.randint(3, 50, (2, 20))
    with torch.no_grad():
        full = model(ids)
        steps = cached(model, ids, 6)
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)
    got = generate(model, PROMPTS, max_new_tokens=25, greedy=True,
                   steps=GraphedSteps(use_graph=False))
    assert got.tokens == generate(model, PROMPTS, max_new_tokens=25, greedy=True).tokens


def test_sandwich_norm_normalises_the_sub_layer_output_before_the_sum():
    """Gemma 2/3 by hand: x + post_norm(Sublayer(norm(x))), each norm with its own gain."""
    model = llama(sandwich_norm=True)
    layer = model.decoder.layers[0]
    residual = layer.feedforward_residual
    assert residual.post_norm is not None and residual.post_norm is not residual.norm
    x = torch.randn(2, 5, 64)
    want = x + residual.post_norm(layer.feedforward(residual.norm(x)))
    torch.testing.assert_close(residual.add(x, layer.feedforward(residual.input(x))), want)


def test_sliding_layers_rotate_with_their_own_base():
    """Windows wider than the text, so only the rotation can differ: rope_local_theta equal to
    rope_theta changes nothing, another base changes the model, every layer sliding at base 100
    is the plain model at rope_theta 100, and cached decoding equals the full forward."""
    same = llama(sliding_window=40, sliding_window_layers=[0], rope_local_theta=10000.0)
    plain = llama()
    ids = torch.randint(3, 50, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(same(ids), plain(ids))  # window 40 > 12 keys: no effect
        local = llama(sliding_window=40, sliding_window_layers=[0], rope_local_theta=100.0)
        assert not torch.allclose(local(ids), plain(ids), atol=1e-3)
        # both layers sliding with base 100 == every layer at rope_theta 100
        everywhere = llama(sliding_window=40, rope_local_theta=100.0)
        torch.testing.assert_close(everywhere(ids), llama(rope_theta=100.0)(ids))
        steps = cached(local, ids, 5)
        torch.testing.assert_close(steps, local(ids), rtol=1e-5, atol=1e-5)


def test_swiglu_is_down_of_silu_gate_times_up_without_biases():
    ffn = GatedFeedForward(8, 12, activation="silu")
    x = torch.randn(2, 3, 8)
    gate, up, down = ffn.gate_proj.weight, ffn.up_proj.weight, ffn.down_proj.weight
    want = (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T
    torch.testing.assert_close(ffn(x), want)
    assert all(module.bias is None for module in (ffn.gate_proj, ffn.up_proj, ffn.down_proj))


@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "separate-qkv"])
def test_grouped_query_attention_equals_multi_head_with_repeated_key_value_heads(fused):
    """Hkv = 2 for H = 8: the same as H = 8 key/value heads where each group repeats its head."""
    grouped = llama(fused_projections=fused)
    full = CausalLM(LLAMA.replace(n_kv_heads=None, fused_projections=fused)).eval()
    dh, group = LLAMA.head_dim, LLAMA.n_heads // LLAMA.n_kv_heads
    state = {}
    for name, value in grouped.state_dict().items():
        if name.endswith("qkv_proj.weight"):
            q, k, v = value.split((8 * dh, 2 * dh, 2 * dh))
            value = torch.cat([q, *(x.view(2, dh, -1).repeat_interleave(group, 0).reshape(-1, 64)
                                    for x in (k, v))])
        elif name.endswith(("k_proj.weight", "v_proj.weight")):
            value = value.view(2, dh, -1).repeat_interleave(group, 0).reshape(-1, 64)
        state[name] = value
    full.load_state_dict(state)
    ids = torch.randint(3, 50, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(grouped(ids), full(ids), rtol=1e-5, atol=1e-5)


def test_every_softmax_kernel_groups_heads_alike_and_the_fused_fallback_repeats():
    q = torch.randn(2, 8, 6, 16)
    k, v = torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    mask = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    mask[1, ..., :3] = False
    want = ReferenceAttention()(q, *repeat_kv_heads(k, v, 8), mask=mask, causal=True)
    for kernel in (ReferenceAttention(), FusedAttention(), ChunkedAttention(4),
                   SparseAttention("local", window=64)):
        torch.testing.assert_close(kernel(q, k, v, mask=mask, causal=True), want,
                                   rtol=1e-5, atol=1e-5, msg=type(kernel).__name__)
    assert kernel_module.SDPA_GROUPS_HEADS == (torch.__version__ >= (2, 5))


def test_fused_kernel_without_sdpa_grouping_repeats_the_heads(monkeypatch):
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)
    grouped = FusedAttention()(q, k, v, causal=True)
    monkeypatch.setattr(kernel_module, "SDPA_GROUPS_HEADS", False)
    torch.testing.assert_close(FusedAttention()(q, k, v, causal=True), grouped)


def test_partial_rotary_positions_turn_the_first_dims_and_pass_the_rest_by_hand():
    """Phi-4-mini's layout: Dr = int(Dh * fraction) dims turn at the frequencies of a Dr-wide head
    (pair i with i + Dr/2), the last Dh - Dr pass through untouched."""
    rotary = RotaryEmbedding(6, theta=100.0, max_length=64)  # Dr = 6 of Dh = 8
    x = torch.randn(2, 3, 5, 8)  # (B, H, T, Dh)
    positions = torch.tensor([0, 3, 7, 20, 41])
    got = apply_rotary(x, rotary(positions))
    assert torch.equal(got[..., 6:], x[..., 6:])
    theta = 100.0 ** (-torch.arange(3) * 2 / 6)  # (Dr/2,)
    angle = positions[:, None].float() * theta  # (T, Dr/2)
    first, second = x[..., :3], x[..., 3:6]
    want = torch.cat((first * angle.cos() - second * angle.sin(),
                      second * angle.cos() + first * angle.sin()), dim=-1)
    torch.testing.assert_close(got[..., :6], want, rtol=1e-5, atol=1e-5)


def test_partial_rotary_decodes_with_a_cache_as_the_full_forward_and_in_slot_steps():
    from aiayn.fast.cuda_graphs import GraphedSteps

    model = llama(rotary_fraction=0.75)
    assert (model.config.rotary_dim, model.decoder.rotary.inverse_frequency.shape) == (6, (3,))
    ids = torch.randint(3, 50, (2, 12))
    with torch.no_grad():
        full = model(ids)
        steps = cached(model, ids, 5)
        assert (llama()(ids) - full).abs().max() > 1e-2  # the unturned dims change the model
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)
    got = generate(model, PROMPTS, max_new_tokens=15, greedy=True,
                   steps=GraphedSteps(use_graph=False))
    assert got.tokens == generate(model, PROMPTS, max_new_tokens=15, greedy=True).tokens


# Dr = 6 of Dh = 8 (rotary_fraction 0.75), the original context 16 of max_length 48
LONGROPE = {"rope_type": "longrope", "factor": 3.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0, 1.5, 2.5], "long_factor": [1.25, 4.0, 9.0]}


def test_longrope_divides_each_frequency_by_its_factor_chosen_by_the_furthest_position():
    """LongRoPE by hand: theta_i / short_factor[i] while a call's positions stay below the
    original 16, theta_i / long_factor[i] for every position of a call that reaches 16, cos and
    sin times sqrt(1 + ln 3 / ln 16)."""
    rotary = RotaryEmbedding(6, theta=100.0, max_length=48, scaling=LONGROPE)
    theta = 100.0 ** (-torch.arange(3) * 2 / 6)
    attention = (1 + torch.log(torch.tensor(3.0)) / torch.log(torch.tensor(16.0))).sqrt()

    def expected(positions, factors):
        angle = positions[..., None].float() * theta / torch.tensor(factors)
        angle = torch.cat((angle, angle), dim=-1)
        return angle.cos() * attention, angle.sin() * attention

    for positions, factors in ((torch.arange(16), LONGROPE["short_factor"]),
                               (torch.arange(17), LONGROPE["long_factor"]),
                               (torch.tensor([3]), LONGROPE["short_factor"]),
                               (torch.tensor([[3], [16]]), LONGROPE["long_factor"])):  # any row
        for got, want in zip(rotary(positions), expected(positions, factors)):
            torch.testing.assert_close(got.reshape(want.shape), want, rtol=1e-5, atol=1e-6)


def test_longrope_generation_across_the_original_context_equals_full_forwards():
    """Each call picks its factors (a cached step past 16 turns its new keys long, the cached ones
    stay short); ``generate`` runs the sequence again when it first grows past 16 (transformers'
    Phi-3 does the same), so its tokens are those of full forwards, in slot steps too."""
    from aiayn.fast.cuda_graphs import GraphedSteps

    model = llama(rotary_fraction=0.75, rope_scaling=LONGROPE)
    ids = torch.randint(3, 50, (2, 30))
    with torch.no_grad():
        full = model(ids)
        torch.testing.assert_close(cached(model, ids[:, :16], 5), model(ids[:, :16]),
                                   rtol=1e-5, atol=1e-5)  # short throughout
        torch.testing.assert_close(cached(model, ids, 20), full, rtol=1e-5, atol=1e-5)
        assert (llama(rotary_fraction=0.75)(ids) - full).abs().max() > 1e-2
        prompt, loop = ids[:1, :10], ids[:1, :10]
        for _ in range(20):  # greedy by full forwards, no cache
            loop = torch.cat([loop, model(loop)[:, -1:].argmax(-1)], dim=1)
    got = generate(model, prompt, max_new_tokens=20, greedy=True).tokens
    assert got[0] == loop[0, 10:].tolist()
    batch = generate(model, PROMPTS, max_new_tokens=25, greedy=True).tokens
    slots = generate(model, PROMPTS, max_new_tokens=25, greedy=True,
                     steps=GraphedSteps(use_graph=False)).tokens
    assert slots == batch


@pytest.mark.parametrize("attention", ["fused", "reference", "chunked"])
def test_cached_decoding_equals_the_full_forward(attention):
    model = llama(attention=attention)
    ids = torch.randint(3, 50, (2, 12))
    with torch.no_grad():
        full = model(ids)
        steps = cached(model, ids, 5)
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("attention", ["fused", "reference", "chunked", "sparse"])
def test_an_explicit_attention_scale_decodes_with_a_cache_as_the_full_forward(attention):
    """Gemma 2 27B's scale, query_pre_attn_scalar^-1/2 with it not the head width: the prefill
    and each cached step use it as the full forward does, and it changes the model."""
    changes = dict(attention=attention, attention_chunk_size=4, attention_window=64)
    model = llama(attention_scale=0.5, **changes)  # Dh = 8: the default is 0.35
    ids = torch.randint(3, 50, (2, 12))
    with torch.no_grad():
        full = model(ids)
        steps = cached(model, ids, 5)
        assert (llama(**changes)(ids) - full).abs().max() > 1e-2
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)


def test_left_padded_rows_generate_what_they_generate_alone():
    model = llama()
    batch = generate(model, PROMPTS, max_new_tokens=20, greedy=True).tokens
    alone = [generate(model, [prompt], max_new_tokens=20, greedy=True).tokens[0]
             for prompt in PROMPTS]
    assert batch == alone


def test_fixed_shape_slot_steps_give_the_plain_loops_tokens():
    """The CUDA-graph engine's steps (explicit positions, every cache slot), run as plain calls."""
    from aiayn.fast.cuda_graphs import GraphedSteps

    model = llama()
    got = generate(model, PROMPTS, max_new_tokens=15, greedy=True,
                   steps=GraphedSteps(use_graph=False))
    assert got.tokens == generate(model, PROMPTS, max_new_tokens=15, greedy=True).tokens


def cache_bytes(model: CausalLM) -> int:
    cache = model.new_cache(batch=4, max_length=48)
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.self_attention)


def test_the_kv_cache_of_four_times_fewer_kv_heads_is_four_times_smaller():
    grouped, full = llama(n_kv_heads=2), llama(n_kv_heads=None)
    assert cache_bytes(full) == 4 * cache_bytes(grouped)
    # 2 layers x (keys + values) x 4 rows x 2 heads x 48 positions x Dh 8 x 4 bytes
    assert cache_bytes(grouped) == 2 * 2 * 4 * 2 * 48 * 8 * 4


@pytest.mark.parametrize("fields, message", [
    (dict(n_kv_heads=3), r"n_kv_heads \(3\) must divide n_heads \(8\)"),
    (dict(n_kv_heads=0), "n_kv_heads must be a positive integer"),
    (dict(d_model=60, n_heads=4, n_kv_heads=None), r"even head width, got 15"),
    (dict(d_head=7), r"even head width, got 7"),
    (dict(attention="linear"), "n_kv_heads=2 needs a softmax kernel"),
    (dict(rope_theta=0.0), "rope_theta must be positive"),
    (dict(norm="batch"), "norm must be one of"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
     "rope_type='dynamic' is not supported: its frequencies change with the length"),
    (dict(rope_scaling={"rope_type": "ntk", "factor": 2.0}), "rope_type must be one of"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     r"missing \['low_freq_factor', 'high_freq_factor', 'original_max_position_embeddings'\]"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 2.0, "low": 1}), r"unknown \['low'\]"),
    (dict(rope_scaling={"rope_type": "linear", "factor": 0.5}), "factor .* must be >= 1"),
    (dict(rope_scaling={"rope_type": "linear", "factor": "2"}), "factor must be a positive number"),
    (dict(rope_scaling={**LLAMA3, "high_freq_factor": 1.0}), "must exceed low_freq_factor"),
    (dict(rope_scaling=[2.0]), "rope_scaling must be a dict"),
    (dict(rotary_fraction=0.0), r"rotary_fraction .* a number in \(0, 1\], got 0.0"),
    (dict(rotary_fraction=1.5), r"rotary_fraction .* a number in \(0, 1\], got 1.5"),
    (dict(rotary_fraction=0.375), r"rotary_fraction=0.375 of a head width of 8 rotates 3 "
                                  r"dimensions; .* need an even number"),
    (dict(rotary_fraction=0.1), r"rotates 0 dimensions"),
    (dict(positions="learned", rotary_fraction=0.5), r"rotary_fraction=0.5 .* needs "
                                                     r"positions='rotary'"),
    (dict(rotary_fraction=0.75, rope_scaling={**LONGROPE, "long_factor": [1.0] * 4}),
     r"long_factor needs one entry per rotary frequency: 3 for a rotated width of 6, got 4"),
    (dict(rope_scaling={**LONGROPE, "short_factor": [1.0, 0.0, 1.0, 1.0]}),
     r"short_factor must be a list of positive numbers"),
    (dict(rope_scaling={**LONGROPE, "short_factor": 1.0}),
     r"short_factor must be a list of positive numbers"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 3.0, "short_factor": [1.0] * 4}),
     r"missing \['long_factor', 'original_max_position_embeddings'\]"),
    (dict(positions="learned", rope_scaling={"rope_type": "linear", "factor": 2.0}),
     "rope_scaling scales rotary positions; positions is 'learned'"),
    (dict(sliding_window=0), "sliding_window must be a positive integer"),
    (dict(sliding_window_layers=[0]), "sliding_window_layers needs a sliding_window"),
    (dict(sliding_window=4, sliding_window_layers=[2]), r"layer indices in \[0, 2\)"),
    (dict(sliding_window=4, attention="sparse"), "sliding_window masks each query's keys"),
    (dict(rope_local_theta=100.0), "rope_local_theta is the RoPE base of sliding layers"),
    (dict(norm_first=False, sandwich_norm=True), "sandwich_norm .* needs norm_first=True"),
])
def test_bad_configs_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        LLAMA.replace(**fields)


def test_a_head_width_of_its_own_sizes_the_projections():
    model = llama(d_head=12)  # 8 heads x 12 = 96 inner width for D = 64
    attention = model.decoder.layers[0].self_attention
    assert attention.qkv_proj.weight.shape == ((8 + 2 + 2) * 12, 64)
    assert attention.out_proj.weight.shape == (64, 96)
    ids = torch.randint(3, 50, (1, 7))
    with torch.no_grad():
        cache = model.new_cache(1, 8)
        steps = torch.cat([model(ids[:, :3], cache=cache), model(ids[:, 3:], cache=cache)], 1)
        torch.testing.assert_close(steps, model(ids), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("changes", [{}, dict(qk_norm=True, qkv_bias=True, bias=False,
                                              rope_scaling=YARN, sliding_window=4,
                                              sliding_window_layers=[1]),
                                     dict(sandwich_norm=True, qk_norm=True, sliding_window=4,
                                          sliding_window_layers=[0], rope_local_theta=100.0,
                                          attention_scale=0.25),
                                     dict(rotary_fraction=0.75, rope_scaling={
                                         **LONGROPE, "original_max_position_embeddings": 6})],
                         ids=["llama", "qwen-yarn-window", "gemma3", "phi4-partial-longrope"])
def test_the_modern_decoder_compiles_whole_for_training_and_a_cached_step(changes):
    """``torch.compile(fullgraph=True)``: rotary (also scaled), RMSNorm, SwiGLU, grouped heads and
    QK-norm break no graph (aot_eager traces what inductor would, see tests/test_compile.py)."""
    from aiayn.decoding.generation import decode_step

    torch._dynamo.reset()
    model = llama(**changes).train()
    ids = torch.randint(3, 50, (2, 9))
    out = torch.compile(model, fullgraph=True, backend="aot_eager")(ids)
    out.square().mean().backward()
    compiled_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    model(ids).square().mean().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(compiled_grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
    model.eval()
    step = torch.compile(decode_step, fullgraph=True, backend="aot_eager", dynamic=True)
    with torch.no_grad():
        caches = [model.new_cache(2, 16) for _ in range(2)]
        for cache in caches:
            model(ids[:, :4], cache=cache)
        for t in range(4, 9):
            torch.testing.assert_close(step(model, ids[:, t:t + 1], None, None, caches[0]),
                                       decode_step(model, ids[:, t:t + 1], None, None, caches[1]),
                                       rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
