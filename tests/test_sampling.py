"""Generation on the KV cache: greedy == full forward, sampling sets, seeds, batches, stops, limits."""

import pytest
import torch

from aiayn import CausalLM, TransformerConfig
from aiayn.decoding.generation import generate
from aiayn.decoding.sampling import filter_logits, next_tokens


def tiny_lm(seed: int = 0, **overrides) -> CausalLM:
    torch.manual_seed(seed)
    config = TransformerConfig.preset(
        "tiny", **{"vocab_size": 23, "max_length": 24, "norm_first": True, "positions": "learned",
                   "scale_embeddings": False, "init_std": 0.3, **overrides})
    return CausalLM(config).eval()


@torch.no_grad()
def greedy_by_full_forward(model, prompt, steps):
    """Reference: re-run the whole sequence without a cache and take the argmax each step."""
    ids = torch.tensor([prompt])
    for _ in range(steps):
        next_id = model(ids)[:, -1].argmax(dim=-1, keepdim=True)  # (1, 1)
        ids = torch.cat([ids, next_id], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_greedy_equals_argmax_of_the_full_forward(positions):
    model = tiny_lm(positions=positions)
    prompt = [3, 1, 4, 1, 5]
    result = generate(model, prompt, max_new_tokens=12, greedy=True)
    assert result.tokens == [greedy_by_full_forward(model, prompt, 12)]
    assert result.finish_reasons == ["length"]
    assert generate(model, prompt, max_new_tokens=12, temperature=0).tokens == result.tokens


def test_top_k_keeps_exactly_the_k_largest_logits():
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(1))
    kept = filter_logits(logits, top_k=7).isfinite()
    expected = torch.zeros_like(kept).scatter(1, logits.topk(7, dim=1).indices, True)
    assert torch.equal(kept, expected)


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(2))
    for p in (0.05, 0.3, 0.9, 0.999):
        kept = filter_logits(logits, top_p=p).isfinite()
        for row in range(logits.shape[0]):
            probs = logits[row].softmax(0)
            order = probs.argsort(descending=True).tolist()
            mass, nucleus = 0.0, set()
            for token in order:  # add the likeliest tokens until the mass reaches p
                nucleus.add(token)
                mass += probs[token].item()
                if mass >= p:
                    break
            assert set(kept[row].nonzero().flatten().tolist()) == nucleus
    assert filter_logits(logits, top_p=1.0).isfinite().all()


def test_min_p_keeps_the_tokens_at_least_that_fraction_as_likely_as_the_top():
    probs = torch.tensor([[0.5, 0.3, 0.12, 0.05, 0.03]])  # min_p 0.2: floor 0.1
    kept = filter_logits(probs.log(), min_p=0.2).isfinite()
    assert kept.tolist() == [[True, True, True, False, False]]
    assert filter_logits(probs.log(), min_p=1.0).isfinite().sum() == 1  # the top always stays


def test_the_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    from aiayn.decoding.sampling import penalise_repeats

    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    got = penalise_repeats(logits, torch.tensor([[0, 1, 1]]), 2.0)  # a repeat counts once
    assert got.tolist() == [[1.0, -2.0, 0.5, 3.0]]


def test_sampling_never_leaves_the_top_k_and_top_p_sets():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 50, generator=generator).repeat(4000, 1)  # (4000, V): many draws
    allowed_k = set(logits[0].topk(5).indices.tolist())
    drawn = next_tokens(logits, top_k=5, generator=generator)
    assert set(drawn.tolist()) <= allowed_k and len(set(drawn.tolist())) > 1
    allowed_p = set(filter_logits(logits[:1], top_p=0.5).isfinite()[0].nonzero().flatten().tolist())
    drawn = next_tokens(logits, top_p=0.5, temperature=0.7, generator=generator)
    assert set(drawn.tolist()) <= allowed_p
    both = set(filter_logits(logits[:1], top_k=3, top_p=0.9).isfinite()[0].nonzero()
               .flatten().tolist())
    drawn = next_tokens(logits, top_k=3, top_p=0.9, generator=generator)
    assert set(drawn.tolist()) <= both and len(both) <= 3


def test_generated_tokens_stay_inside_the_top_k_set_of_each_step():
    model = tiny_lm()
    prompt = [2, 7, 1]
    result = generate(model, prompt, max_new_tokens=15, top_k=2, seed=5, temperature=2.0)
    ids = torch.tensor([prompt + result.tokens[0]])
    with torch.no_grad():
        logits = model(ids)[0, len(prompt) - 1:-1]  # (N, V): the logits each token was drawn from
    allowed = logits.topk(2, dim=-1).indices  # (N, 2)
    chosen = torch.tensor(result.tokens[0]).unsqueeze(1)
    assert (allowed == chosen).any(dim=1).all()


def test_a_fixed_seed_gives_the_same_tokens_and_another_seed_other_tokens():
    model = tiny_lm()
    first = generate(model, [1, 2, 3], max_new_tokens=20, seed=11, temperature=1.5)
    again = generate(model, [1, 2, 3], max_new_tokens=20, seed=11, temperature=1.5)
    other = generate(model, [1, 2, 3], max_new_tokens=20, seed=12, temperature=1.5)
    assert first.tokens == again.tokens
    assert first.tokens != other.tokens
    generator = torch.Generator().manual_seed(11)
    assert generate(model, [1, 2, 3], max_new_tokens=20, generator=generator,
                    temperature=1.5).tokens == first.tokens


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_a_batch_of_prompts_equals_each_prompt_alone(positions):
    model = tiny_lm(positions=positions)
    prompts = [[5, 6, 7, 8, 9, 10], [11], [3, 4, 12]]
    batch = generate(model, prompts, max_new_tokens=10, greedy=True)
    alone = [generate(model, prompt, max_new_tokens=10, greedy=True).tokens[0]
             for prompt in prompts]
    assert batch.tokens == alone
    assert batch.tokens[1] == greedy_by_full_forward(model, prompts[1], 10)


def test_batched_logits_match_single_prompt_logits():
    model = tiny_lm()
    seen = {}

    def record(step, tokens, finished):
        seen.setdefault("batch", []).append(tokens.clone())

    prompts = [[1, 2, 3, 4], [9, 8]]
    generate(model, prompts, max_new_tokens=6, greedy=True, on_step=record)
    streamed = torch.stack(seen["batch"], dim=1)  # (B, N)
    assert streamed[1].tolist() == greedy_by_full_forward(model, [9, 8], 6)


def test_generation_past_the_cache_capacity_is_a_clear_error():
    model = tiny_lm()
    with pytest.raises(ValueError, match="past the cache capacity.*needs 25 positions"):
        generate(model, [1] * 5, max_new_tokens=21)
    with pytest.raises(ValueError, match="past the cache capacity"):
        generate(model, [1, 2], max_new_tokens=10, context=10)
    # The last new token is never fed back: a prompt plus N tokens needs L + N - 1 positions.
    assert len(generate(model, [1] * 5, max_new_tokens=20).tokens[0]) == 20
    assert len(generate(model, [1, 2], max_new_tokens=9, context=10).tokens[0]) == 9
    with pytest.raises(ValueError, match="does not fit the context"):
        generate(model, [1] * 30, max_new_tokens=1, slide=True)


def test_sliding_past_the_context_matches_a_recomputed_window():
    model = tiny_lm(max_length=8)
    prompt = [4, 5, 6]
    result = generate(model, prompt, max_new_tokens=20, greedy=True, slide=True)
    sequence, window = list(prompt), 0
    with torch.no_grad():
        for column in range(len(prompt), len(prompt) + 20):
            logits = model(torch.tensor([sequence[window:column]]))[0, -1]  # up to 8 tokens
            sequence.append(int(logits.argmax()))
            if column - window == 8:  # the new token does not fit: keep the last half, with it
                window = column + 1 - 4
    assert result.tokens[0] == sequence[len(prompt):]


def test_sliding_with_a_padded_batch_matches_each_prompt_alone_until_the_first_slide():
    model = tiny_lm(max_length=8)
    prompts = [[4, 5, 6, 7, 8], [9, 3]]
    batch = generate(model, prompts, max_new_tokens=12, greedy=True, slide=True)
    assert len(batch.tokens[0]) == 12
    # Rows slide together, when the longest fills the cache (the token picked at column 8 is the
    # first that does not fit): until then the short row computes what it computes alone.
    alone = generate(model, prompts[1], max_new_tokens=4, greedy=True).tokens[0]
    assert batch.tokens[1][:4] == alone


def test_stop_ids_end_a_row_and_are_cut_from_its_tokens():
    model = tiny_lm()
    prompt = [3, 1, 4]
    free = generate(model, prompt, max_new_tokens=10, greedy=True).tokens[0]
    stop_token = free[4]
    first = free.index(stop_token)
    result = generate(model, [prompt, [7, 7, 7]], max_new_tokens=10, greedy=True,
                      stop_ids=[stop_token], check_every=3)
    assert result.tokens[0] == free[:first]
    assert result.finish_reasons[0] == "stop_id"
    other = generate(model, [7, 7, 7], max_new_tokens=10, greedy=True).tokens[0]
    if stop_token in other:
        assert result.tokens[1] == other[:other.index(stop_token)]
    else:
        assert result.tokens[1] == other and result.finish_reasons[1] == "length"


def test_a_host_stop_test_ends_generation_early():
    model = tiny_lm()
    calls = []

    def stop(row, tokens):
        calls.append(len(tokens))
        return len(tokens) >= 5

    result = generate(model, [1, 2], max_new_tokens=20, greedy=True, stop=stop, check_every=4)
    assert result.finish_reasons == ["stop"]
    assert len(result.tokens[0]) == 8  # checked after 4 and 8 tokens
    assert calls == [4, 8]


def test_a_row_stopped_by_the_host_test_keeps_no_filler_while_others_go_on():
    """The stopped row's tokens end where the test passed (no pad written after it), the other
    row runs to the length limit and computes what it computes alone."""
    model = tiny_lm()
    prompts = [[1, 2, 3], [4, 5, 6]]
    for every, on_step in [(4, None), (8, lambda *args: None)]:
        result = generate(model, prompts, max_new_tokens=16, greedy=True, check_every=every,
                          on_step=on_step, stop=lambda row, tokens: row == 0 and len(tokens) >= 3)
        alone = [generate(model, p, max_new_tokens=16, greedy=True).tokens[0] for p in prompts]
        stopped_at = 3 if on_step else 4  # every step with a callback, else every 4
        assert result.tokens == [alone[0][:stopped_at], alone[1]]
        assert result.finish_reasons == ["stop", "length"]


def test_a_tiny_temperature_samples_the_most_likely_token():
    """Dividing the logits by 1e-40 would overflow to inf and NaN; the gaps to the maximum are
    divided instead, so the draw is the argmax."""
    model = tiny_lm()
    assert generate(model, [1, 2], max_new_tokens=8, temperature=1e-40, seed=0).tokens == \
        generate(model, [1, 2], max_new_tokens=8, greedy=True).tokens


def test_prompts_and_stop_ids_may_be_numpy_or_tensor_integers():
    import numpy as np

    model = tiny_lm()
    want = generate(model, [[5, 6], [7]], max_new_tokens=4, greedy=True, stop_ids=(3,))
    for prompts in (np.array([[5, 6]]), [np.int64(5), np.int64(6)], [torch.tensor([5, 6]),
                                                                     torch.tensor([7])]):
        got = generate(model, prompts, max_new_tokens=4, greedy=True, stop_ids=3)
        assert got.tokens == want.tokens[:len(got.tokens)]


def test_streaming_callback_sees_every_token_in_order():
    model = tiny_lm()
    streamed = []
    result = generate(model, [2, 3], max_new_tokens=9, seed=4,
                      on_step=lambda step, tokens, finished: streamed.append(int(tokens[0])))
    assert streamed == result.tokens[0]


def test_bad_arguments_are_clear_errors():
    model = tiny_lm()
    with pytest.raises(ValueError, match="temperature"):
        generate(model, [1], max_new_tokens=2, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [1], max_new_tokens=2, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, [1], max_new_tokens=2, top_k=0)
    with pytest.raises(ValueError, match="min_p must be in"):
        generate(model, [1], max_new_tokens=2, min_p=1.5)
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        generate(model, [1], max_new_tokens=2, repetition_penalty=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [1], max_new_tokens=0)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[1], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="token id 23 outside the vocabulary"):
        generate(model, [1, 23], max_new_tokens=2)


def test_generation_restores_training_mode():
    model = tiny_lm().train()
    generate(model, [1], max_new_tokens=2, greedy=True)
    assert model.training


@pytest.mark.parametrize("mode", [True, False])
def test_generation_restores_the_mode_when_a_callback_raises(mode):
    """The caller's mode survives an error raised inside the decoding loop."""
    model = tiny_lm().train(mode)
    seen = []

    def on_step(index, token, finished):
        seen.append(model.training)
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        generate(model, [1], max_new_tokens=4, greedy=True, on_step=on_step)
    assert seen == [False] and model.training is mode


@pytest.mark.parametrize("batch, vocab", [(1, 7), (3, 500), (8, 50257)])
def test_sample_draws_what_torch_multinomial_draws(batch, vocab):
    """The exponential race draws the same ids as torch.multinomial(probs, 1) from the same
    generator state (both race the same Exp(1) draws), filtered-out ids included never."""
    from aiayn.decoding.sampling import sample

    logits = 3 * torch.randn(batch, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[:, ::3] = float("-inf")  # zero probability: never drawn
    probs = logits.softmax(dim=-1)
    for seed in range(50):
        ours = sample(probs, torch.Generator().manual_seed(seed))
        reference = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(ours, reference.squeeze(1))
        assert not (ours % 3 == 0).any()


def test_sample_follows_the_distribution():
    """Frequencies of 40,000 draws match the probabilities (4 standard errors)."""
    from aiayn.decoding.sampling import sample

    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05, 0.0]]).expand(40_000, 5).contiguous()
    counts = torch.bincount(sample(probs, torch.Generator().manual_seed(0)), minlength=5)
    frequencies = counts.double() / 40_000
    error = (probs[0].double() * (1 - probs[0].double()) / 40_000).sqrt()
    assert ((frequencies - probs[0].double()).abs() <= 4 * error + 1e-12).all()
    assert counts[4] == 0
