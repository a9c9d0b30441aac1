"""The same behaviour on every device this machine has: the CPU always, a CUDA GPU where there is one.

The rest of the suite runs on the CPU; these tests carry its main guarantees to an accelerator (the
fused attention equals eq. 1, cached decoding equals the full forward, the chunked loss equals the
plain loss under bf16 autocast, a bf16-autocast training step learns). Where no GPU is present the
CUDA cases are skipped and the CPU cases check the tests themselves; on a lent GPU
``python3 -m pytest tests/test_devices.py`` runs both (benchmarks/gpu_checks.sh).
"""

import pytest
import torch
import torch.nn.functional as F

from aiayn import CausalLM, TransformerConfig
from aiayn.nn.attention.kernels import FusedAttention, ReferenceAttention
from aiayn.decoding.generation import generate
from aiayn.masks import key_padding_to_attention
from aiayn.tasks.lm import token_loss
from aiayn.training.chunked_loss import chunked_cross_entropy
from aiayn.training.loss import label_smoothed_cross_entropy
from hf_helpers import randomise

DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(
               not torch.cuda.is_available(), reason="no CUDA device here"))]
# fp32 on a GPU: SDPA's memory-efficient kernel and cuBLAS sum in other orders than the CPU.
TOLERANCE = {"cpu": 1e-5, "cuda": 1e-4}


def tiny(**overrides):
    return TransformerConfig.preset("tiny", **overrides)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["padding", "causal"])
def test_fused_attention_equals_eq_1(device, dtype, causal):
    """SDPA (flash / memory-efficient / CPU kernels, whichever the device picks) against eq. 1
    written out, in float32 and bf16, with a padding mask or the causal one."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 32, generator=generator).to(device, dtype) for _ in range(3))
    mask = None
    if not causal:
        keep = torch.ones(2, 16, dtype=torch.bool)
        keep[1, 11:] = False
        mask = key_padding_to_attention(keep).to(device)  # (B, 1, 1, S)
    fused = FusedAttention()(q, k, v, mask=mask, causal=causal)
    reference = ReferenceAttention()(q.float(), k.float(), v.float(), mask=mask, causal=causal)
    tolerance = TOLERANCE[device] if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused.float(), reference, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["band", "causal band"])
def test_fused_attention_in_blocks_equals_eq_1_under_the_band(device, dtype, causal):
    """A narrow band (sliding window) runs block by block on overlapping views of the keys: the
    same numbers as eq. 1 under the whole mask, with padding and grouped heads, forward and
    backward."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 100, 32, generator=generator).to(device, dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 100, 32, generator=generator).to(device, dtype).requires_grad_()
            for _ in range(2))
    keep = torch.ones(2, 100, dtype=torch.bool)
    keep[1, 70:] = False
    mask = key_padding_to_attention(keep).to(device)  # (B, 1, 1, S)
    fused = FusedAttention()(q, k, v, mask=mask, causal=causal, band=8)
    fused_grads = torch.autograd.grad(fused.float().square().sum(), (q, k, v))
    inputs = [t.detach().float().requires_grad_() for t in (q, k, v)]
    reference = ReferenceAttention()(*inputs, mask=mask, causal=causal, band=8)
    reference_grads = torch.autograd.grad(reference.square().sum(), inputs)
    tolerance = TOLERANCE[device] if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused.float(), reference, rtol=tolerance, atol=tolerance)
    for a, b in zip(fused_grads, reference_grads):
        torch.testing.assert_close(a.float(), b, rtol=tolerance * 10, atol=tolerance * 10)


@pytest.mark.parametrize("device", DEVICES)
def test_cached_decoding_equals_the_full_forward(device):
    model = CausalLM(tiny(norm_first=True, attention="fused")).eval().to(device)
    tokens = torch.randint(3, 100, (3, 12), device=device)
    with torch.inference_mode():
        full = model(tokens)
        cache = model.new_cache(batch=3, max_length=12)
        prefill = model(tokens[:, :5], cache=cache)
        steps = [model(tokens[:, t: t + 1], cache=cache) for t in range(5, 12)]
    tolerance = TOLERANCE[device]
    torch.testing.assert_close(torch.cat([prefill] + steps, dim=1), full, rtol=tolerance,
                               atol=tolerance)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_generation_picks_the_full_forwards_argmax(device):
    """Each generated token is the argmax of a full forward over everything before it."""
    torch.manual_seed(0)
    model = CausalLM(tiny(norm_first=True)).eval().to(device)
    prompt = torch.randint(3, 100, (2, 4), device=device)
    with torch.inference_mode():
        tokens = torch.tensor(generate(model, prompt, max_new_tokens=6, greedy=True).tokens,
                              device=device)
        sequence = prompt
        for step in range(6):
            logits = model(sequence)[:, -1]  # (B, V)
            top2 = logits.topk(2, dim=-1).values
            chosen = tokens[:, step]
            # A near-tie may be broken either way by another summation order: accept those.
            tie = (top2[:, 0] - top2[:, 1]) < 1e-4
            assert torch.all((chosen == logits.argmax(-1)) | tie)
            sequence = torch.cat([sequence, chosen[:, None]], dim=1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_chunked_loss_equals_the_plain_loss_under_bf16_autocast(device, smoothing):
    """The chunked loss against the logits + cross-entropy path under bf16 autocast, V = 50."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(300, 16, generator=generator)
    weight = torch.randn(50, 16, generator=generator)
    targets = torch.randint(0, 50, (300,), generator=generator)
    targets[::7] = -100
    plain = [t.clone().to(device).requires_grad_() for t in (hidden, weight)]
    fused = [t.clone().to(device).requires_grad_() for t in (hidden, weight)]
    targets = targets.to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        expected = label_smoothed_cross_entropy(F.linear(*plain), targets, smoothing=smoothing)
        got = chunked_cross_entropy(*fused, targets, smoothing=smoothing, chunk=64)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-3)
    expected.backward()
    got.backward()
    for ours, theirs in zip(fused, plain):
        scale = float(theirs.grad.abs().max())
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=0,
                                   atol=scale * 2 * torch.finfo(torch.bfloat16).eps)


@pytest.mark.parametrize("device", DEVICES)
def test_a_bf16_autocast_training_step_learns(device):
    """AdamW steps under bf16 autocast through aiayn's LM loss (the chunked path on a plain
    CausalLM) drive the loss on one batch down, with finite gradients throughout."""
    torch.manual_seed(0)
    model = CausalLM(tiny(norm_first=True)).train().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(3, 100, (4, 17), device=device)
    losses = []
    for _ in range(30):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = token_loss(model, ids[:, :-1], ids[:, 1:]) / ids[:, 1:].numel()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_engine_generation_is_greedy_under_the_full_forward(device, compiled):
    """``aiayn.fast``'s generation (on a GPU: fixed-shape steps replayed from CUDA graphs, compiled
    or not), same-length and left-padded prompts, twice (the second call replays the captured
    graphs): every token is the full forward's argmax for its row alone, up to near-ties."""
    from aiayn.fast import InferenceOptions, prepare_for_inference

    if compiled and device == "cpu":
        pytest.skip("compiled CPU steps: tests/test_fast_inference.py")
    torch.manual_seed(0)
    model = CausalLM(tiny(norm_first=True, n_encoder_layers=0)).to(device).eval()
    engine = prepare_for_inference(model, InferenceOptions(compile=compiled))
    assert engine.uses_cuda_graphs() == (device == "cuda")
    for prompts in ([[5, 6, 7, 8], [9, 10, 11, 12]], [[5, 6, 7, 8], [9, 10]]):
        for _ in range(2):
            result = engine.generate(prompts, max_new_tokens=16, greedy=True)
            for prompt, tokens in zip(prompts, result.tokens):
                assert len(tokens) == 16
                ids = torch.tensor([prompt + tokens], device=device)
                with torch.no_grad():
                    logits = model(ids)[0, len(prompt) - 1:-1].float()  # (16, V)
                chosen = logits.gather(1, ids[0, len(prompt):, None])[:, 0]
                assert torch.all(chosen >= logits.max(dim=-1).values - 1e-3), (prompt, tokens)


def _translator_and_engine(device: str, compiled: bool):
    """A tiny random translator whose outputs end at different steps, its ``aiayn.fast`` engine,
    and three padded sources with their mask."""
    from aiayn import Transformer
    from aiayn.fast import InferenceOptions, prepare_for_inference

    torch.manual_seed(0)
    config = tiny(vocab_size=60, max_length=48, output_bias=True)
    model = Transformer(config).to(device).eval()
    with torch.no_grad():
        model.generator.bias[config.eos_id] = 1.0
    engine = prepare_for_inference(model, InferenceOptions(compile=compiled))
    source = torch.tensor([[5, 9, 12, 7, 3, 8], [11, 4, 6, 0, 0, 0], [7, 7, 21, 30, 2, 0]],
                          device=device)
    return model, engine, source, source != config.pad_id


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_engine_greedy_translation_is_greedy_search(device, compiled):
    """``aiayn.fast``'s greedy search of an encoder-decoder (on a GPU: the graphed one-beam
    search), twice per shape, with and without a forced code: greedy search's tokens, scores
    within 1e-3."""
    from aiayn.decoding.greedy import greedy_search

    if compiled and device == "cpu":
        pytest.skip("compiled CPU steps: tests/test_fast_inference.py")
    model, engine, source, mask = _translator_and_engine(device, compiled)
    for language in ({}, {"forced": [57]}, {}):
        want = greedy_search(model, source, mask, max_extra=10, **language)
        got = engine.greedy_search(source, mask, max_extra=10, **language)
        assert [h.tokens for h in got] == [h.tokens for h in want]
        assert [h.score for h in got] == pytest.approx([h.score for h in want], abs=1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("language", [{}, {"forced": [57]}, {"start": 57}],
                         ids=["plain", "forced", "start"])
def test_engine_beam_search_is_beam_search(device, compiled, language):
    """``aiayn.fast``'s beam search (on a GPU: the whole step, search included, replayed from CUDA
    graphs, compiled or not), twice per shape, also with a target language code forced (NLLB) or
    as the start symbol (mBART): the plain search's scores, and each hypothesis's score is its
    teacher-forced log-probability over GNMT's length penalty (a forced token scored 0, counted
    in the length)."""
    from aiayn.decoding.beam import beam_search, length_penalty

    if compiled and device == "cpu":
        pytest.skip("compiled CPU steps: tests/test_fast_inference.py")
    if compiled and language:
        pytest.skip("a language code changes no compiled step: the eager cases cover it")
    model, engine, source, mask = _translator_and_engine(device, compiled)
    config = model.config
    want = beam_search(model, source, mask, beam_size=4, alpha=0.6, max_extra=10, **language)
    forced = language.get("forced", [])
    first = [language.get("start", config.decoder_start_id), *forced]
    for _ in range(2):
        got = engine.beam_search(source, mask, beam_size=4, alpha=0.6, max_extra=10, **language)
        for row, (g, w) in enumerate(zip(got, want)):
            assert g.score == pytest.approx(w.score, abs=1e-3)
            target = torch.tensor([first + g.tokens + [config.eos_id]], device=device)
            with torch.no_grad():
                logits = model(source[row:row + 1], target[:, :-1],
                               src_padding_mask=mask[row:row + 1]).float()
            log_p = logits.log_softmax(-1)[0].gather(1, target[0, 1:, None])[len(forced):].sum()
            length = len(forced) + len(g.tokens) + 1
            assert float(log_p) / length_penalty(length, 0.6) == pytest.approx(g.score, abs=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_engine_generation_of_a_relative_bias_decoder_is_the_plain_generation(device):
    """T5's relative position bias needs contiguous positions, which fixed-shape steps do not
    give: the engine runs such a model's steps plainly, on a GPU too."""
    from aiayn.fast import InferenceOptions, prepare_for_inference

    torch.manual_seed(0)
    model = CausalLM(tiny(norm_first=True, n_encoder_layers=0, positions="none",
                          relative_attention_buckets=8, relative_attention_max_distance=16)
                     ).to(device).eval()
    engine = prepare_for_inference(model, InferenceOptions(compile=False))
    assert not engine.uses_cuda_graphs()
    assert engine.generate([[5, 6, 7]], max_new_tokens=6, greedy=True).tokens == \
        generate(model, [[5, 6, 7]], max_new_tokens=6, greedy=True).tokens


def randomised(config: TransformerConfig, device: str) -> CausalLM:
    """A model whose weights are drawn from hf_helpers.randomise's seeded stream (std 0.2; the
    rotary frequencies kept)."""
    model = CausalLM(config).eval()
    randomise(model, std=0.2, skip=("rotary",))
    return model.to(device)


LONGROPE = {"rope_type": "longrope", "factor": 3.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0, 1.5, 2.5], "long_factor": [1.25, 4.0, 9.0]}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["window", "longrope"])
def test_engine_generation_past_a_window_or_a_longrope_switch_is_greedy(device, kind):
    """A Mistral-style window of 8 keys, and Phi-3's LongRoPE (partial rotary, switching to the
    long factors past 16 positions: generate runs the sequence again there), through the engine
    (on a GPU: fixed-shape steps replayed from CUDA graphs): 24 new tokens after prompts of 6 ids
    (and a left-padded one of 3 for the window) go well past both; every token is the argmax of
    the full forward of its row's ids before it (LongRoPE picks its factors by the length of each
    call, so one forward of the finished row would not do)."""
    from aiayn.fast import InferenceOptions, prepare_for_inference

    llama = TransformerConfig.preset("llama-char", vocab_size=50, d_model=64, n_heads=8,
                                     n_kv_heads=2, n_decoder_layers=2, d_ff=128, max_length=64)
    changes = (dict(sliding_window=8) if kind == "window"
               else dict(rotary_fraction=0.75, rope_scaling=LONGROPE))
    # Weights of std 0.2: at this scale the window and the long factors change the tokens
    model, without = (randomised(llama.replace(**c), device)
                      for c in (changes, {k: v for k, v in changes.items()
                                          if k == "rotary_fraction"}))
    engine = prepare_for_inference(model, InferenceOptions(compile=False))
    assert engine.generate([[5, 6, 7]], max_new_tokens=24, greedy=True).tokens != \
        generate(without, [[5, 6, 7]], max_new_tokens=24, greedy=True).tokens
    assert engine.uses_cuda_graphs() == (device == "cuda")
    # LongRoPE picks the factors by the furthest position of the whole batch, as transformers
    # does: a left-padded row's own forward would not be its reference, so its rows are as long
    second = [11, 12, 13] if kind == "window" else [11, 12, 13, 14, 15, 16]
    for prompts in ([[5, 6, 7, 8, 9, 10]], [[5, 6, 7, 8, 9, 10], second]):
        result = engine.generate(prompts, max_new_tokens=24, greedy=True)
        for prompt, tokens in zip(prompts, result.tokens):
            assert len(tokens) == 24
            ids = prompt + tokens
            for end in range(len(prompt), len(ids)):
                with torch.no_grad():
                    logits = model(torch.tensor([ids[:end]], device=device))[0, -1].float()
                assert logits[ids[end]] >= logits.max() - 1e-3, (kind, prompt, end, tokens)
