"""aiayn's encoder-decoder with T5's blocks equals Hugging Face ``T5ForConditionalGeneration`` built from
configs (random weights, no download), T5 1.0 (ReLU FFN, tied and rescaled output) and 1.1
(gated-GELU FFN, an output projection of its own), with source and target padding: logits within
1e-4 in float32; save_pretrained / from_pretrained round trips that transformers loads; greedy and
beam search (4 beams) equal to HF ``generate`` on several sources (the conventions matched as in
tests/test_hf_beam.py: alpha 0, pad blocked, </s> forced at the last position)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import aiayn
from aiayn.decoding.beam import beam_search
from aiayn.decoding.greedy import greedy_search, output_limits
from aiayn.interop.hf import from_transformers
from aiayn.tasks.translate import translate_ids
from hf_helpers import greedy_seq2seq, padded_ids, randomise

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, PAD, EOS, BEAMS, MAX_EXTRA = 80, 0, 1, 4, 50
STYLES = {
    "t5-1.0": dict(feed_forward_proj="relu", tie_word_embeddings=True),
    "t5-1.1": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False),
    "t5-1.1-d_kv-6": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, d_kv=6),
}


def hf_t5(style: str, std: float = 0.2, decoder_layers: int = 3):
    """``decoder_layers`` other than the encoder's 2 breaks HF ``generate`` (transformers 5.24 sizes
    its decoder cache by ``num_layers``), so the generation tests take 2."""
    fields = {"d_kv": 8, **STYLES[style]}
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_ff=48, num_layers=2, num_decoder_layers=decoder_layers,
        num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=20, pad_token_id=PAD,
        eos_token_id=EOS, decoder_start_token_id=PAD, **fields)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    randomise(model, std=std)
    if not STYLES[style]["tie_word_embeddings"]:
        # transformers 5 builds a 1.1 model with its head tied (unscaled); a 1.1 checkpoint's head
        # is its own matrix, which is what this makes it
        model.lm_head.weight = nn.Parameter(torch.randn(VOCAB, 32) * std)
    return model


def batch():
    source, source_mask = padded_ids(VOCAB, [25, 14, 7], pad=PAD, low=2, seed=1)
    target, target_mask = padded_ids(VOCAB, [30, 9, 18], pad=PAD, low=2, seed=2)
    return source, source_mask, target, target_mask


def hf_logits(hf, source, source_mask, target, target_mask):
    with torch.no_grad():
        return hf(input_ids=source, attention_mask=source_mask.long(), decoder_input_ids=target,
                  decoder_attention_mask=target_mask.long()).logits


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("attention", ["fused", "reference"])
def test_logits_match_hf_with_padding(style, attention):
    hf = hf_t5(style)
    ours = from_transformers(hf, attention=attention)
    config = ours.config
    assert (config.tie_output, config.scale_output) == ((True, True) if style == "t5-1.0"
                                                        else (False, False))
    source, source_mask, target, target_mask = batch()
    want = hf_logits(hf, source, source_mask, target, target_mask)
    with torch.no_grad():
        got = ours(source, target, src_padding_mask=source_mask, tgt_padding_mask=target_mask)
    assert want[target_mask].std() > 0.1  # far from uniform: the comparison can fail
    assert (got - want)[target_mask].abs().max() < 1e-4


@pytest.mark.parametrize("style", STYLES)
def test_save_pretrained_round_trips_through_transformers(tmp_path, style):
    hf = hf_t5(style)
    hf.save_pretrained(tmp_path / "hf")
    ours = aiayn.from_pretrained(tmp_path / "hf")
    assert ours.config.tie_output == (style == "t5-1.0")
    aiayn.save_pretrained(ours, tmp_path / "ours")
    again = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours").eval()
    assert type(again).__name__ == "T5ForConditionalGeneration"
    source, source_mask, target, target_mask = batch()
    want = hf_logits(hf, source, source_mask, target, target_mask)
    torch.testing.assert_close(hf_logits(again, source, source_mask, target, target_mask), want,
                               rtol=0, atol=1e-5)
    hf_state, again_state = hf.state_dict(), again.state_dict()
    for name in hf_state:
        torch.testing.assert_close(again_state[name], hf_state[name], rtol=0, atol=0, msg=name)
    reloaded = aiayn.from_pretrained(tmp_path / "ours")
    for (name, mine), (_, theirs) in zip(ours.state_dict().items(),
                                         reloaded.state_dict().items()):
        torch.testing.assert_close(theirs, mine, rtol=0, atol=0, msg=name)


def a_source(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    source = torch.randint(2, VOCAB, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
    return source, torch.ones_like(source, dtype=torch.bool)


def up_to_eos(tokens: list[int]) -> list[int]:
    return tokens[: tokens.index(EOS)] if EOS in tokens else tokens


# Random T5s rarely say </s>: its output row gets a push along the mean final hidden state, worth
# about ``strength`` standard deviations of the logits (a logits bias, which T5 does not have).
EOS_STRENGTH = {"t5-1.0": 0.5, "t5-1.1": 1.0}


def generating_pair(style: str, eos_strength: float | None = None):
    """(transformers' T5, aiayn's copy) with </s> pushed by ``eos_strength`` (default
    ``EOS_STRENGTH[style]``; negative: never chosen)."""
    hf = hf_t5(style, std=0.3, decoder_layers=2)
    strength = EOS_STRENGTH[style] if eos_strength is None else eos_strength
    ours = from_transformers(hf)
    source = torch.randint(2, VOCAB, (8, 12), generator=torch.Generator().manual_seed(99))
    target = torch.randint(2, VOCAB, (8, 20), generator=torch.Generator().manual_seed(98))
    with torch.no_grad():
        hidden = ours.decoder(target, ours.encode(source))[0] * ours.generator.scale
        spread = (hidden @ ours.generator.weight.T).std()
        direction = hidden.reshape(-1, hidden.shape[-1]).mean(0)
        hf.lm_head.weight[EOS] += strength * spread * direction / direction.square().sum()
    return hf, from_transformers(hf)


@pytest.mark.parametrize("style", ["t5-1.0", "t5-1.1"])
def test_greedy_decoding_equals_hf_generate(style):
    hf, ours = generating_pair(style)
    lengths = []
    for seed in range(8):
        source, mask = a_source(seed)
        with torch.no_grad():
            want = hf.generate(source, attention_mask=mask.long(), do_sample=False, num_beams=1,
                               max_new_tokens=MAX_EXTRA, min_new_tokens=0)
        got = greedy_seq2seq(ours, source, mask, MAX_EXTRA, eos=EOS)
        assert got.tolist() == want.tolist()
        lengths.append(got.shape[1] - 1)
        # the library's batched greedy search (pad blocked, </s> forced at the limit)
        with torch.no_grad():
            want = hf.generate(source, attention_mask=mask.long(), do_sample=False, num_beams=1,
                               max_new_tokens=source.shape[1] + MAX_EXTRA,
                               forced_eos_token_id=EOS, bad_words_ids=[[PAD]])
        best = greedy_search(ours, source, mask, max_extra=MAX_EXTRA)[0]
        assert best.tokens == up_to_eos(want[0, 1:].tolist())
    assert min(lengths) < MAX_EXTRA == max(lengths)  # some stop at </s>, some run 50 tokens


@pytest.mark.parametrize("style", ["t5-1.0", "t5-1.1"])
def test_beam_search_of_four_equals_hf_generate(style):
    """Hypotheses that reach the length limit are left out: there HF scores the forced </s> with
    log-probability 0, aiayn with its own (tests/test_hf_beam.py)."""
    hf, ours = generating_pair(style)
    compared = []
    for seed in range(8):
        source, mask = a_source(seed)
        limit = source.shape[1] + MAX_EXTRA - 1  # tokens before the forced </s>
        with torch.no_grad():
            out = hf.generate(source, attention_mask=mask.long(), num_beams=BEAMS, do_sample=False,
                              length_penalty=0.0, early_stopping=True,
                              max_new_tokens=source.shape[1] + MAX_EXTRA,
                              forced_eos_token_id=EOS, bad_words_ids=[[PAD]])
        want = up_to_eos(out[0, 1:].tolist())
        best = beam_search(ours, source, mask, beam_size=BEAMS, alpha=0.0, max_extra=MAX_EXTRA)[0]
        if max(len(want), len(best.tokens)) >= limit:
            continue
        assert best.tokens == want
        compared.append(len(want))
    assert len(compared) >= 5 and max(compared) >= 3  # most sources, not only empty outputs


def test_a_batch_decodes_what_each_source_decodes_alone():
    ours = from_transformers(hf_t5("t5-1.1", std=0.3))
    source, mask, _, _ = batch()
    together = [h.tokens for h in beam_search(ours, source, mask, beam_size=BEAMS, max_extra=10)]
    alone = [beam_search(ours, row[None, row_mask], row_mask[None, row_mask], beam_size=BEAMS,
                         max_extra=10)[0].tokens for row, row_mask in zip(source, mask)]
    assert together == alone


def test_export_refuses_what_t5_cannot_express(tmp_path):
    ours = from_transformers(hf_t5("t5-1.0"))
    untied_scaled = aiayn.Transformer(ours.config.replace(tie_output=False))
    with pytest.raises(ValueError, match="rescales the output .* only with the head tied"):
        aiayn.save_pretrained(untied_scaled, tmp_path)
    biased = aiayn.Transformer(ours.config.replace(bias=True))
    with pytest.raises(ValueError, match="T5 needs bias=False"):
        aiayn.save_pretrained(biased, tmp_path)
    with pytest.raises(ValueError, match="feed_forward_proj='gated-gelu-x' is not supported"):
        config = dict(hf_t5("t5-1.1").config.to_dict(), feed_forward_proj="gated-gelu-x")
        checkpoint = aiayn.interop.hf_common.Checkpoint(tmp_path, config, {}, {})
        aiayn.interop.hf_t5.config_from_hf(config, checkpoint, {})


def test_inputs_and_outputs_longer_than_n_positions_run_as_in_transformers():
    """T5's relative bias has no position table: ``n_positions`` caps neither side (as in
    transformers), while the cache still defaults to it."""
    hf, _ = generating_pair("t5-1.1")
    hf.config.n_positions = 16
    ours = from_transformers(hf)
    assert (ours.config.max_length, ours.config.position_limit) == (16, None)
    assert ours.new_cache(batch=1).max_length == 16
    source, source_mask = padded_ids(VOCAB, [40, 23], pad=PAD, low=2, seed=3)
    target, target_mask = padded_ids(VOCAB, [36, 30], pad=PAD, low=2, seed=4)
    want = hf_logits(hf, source, source_mask, target, target_mask)
    with torch.no_grad():
        got = ours(source, target, src_padding_mask=source_mask, tgt_padding_mask=target_mask)
        assert (got - want)[target_mask].abs().max() < 1e-4
        memory = ours.encode(source, source_mask)
        cache = ours.new_cache(batch=2, max_length=36)  # cached steps past n_positions
        steps = [ours.decode(target[:, t:t + 1], memory if t == 0 else None,
                             memory_padding_mask=source_mask, cache=cache,
                             tgt_padding_mask=target_mask[:, :t + 1]) for t in range(36)]
    assert (torch.cat(steps, dim=1) - want)[target_mask].abs().max() < 1e-4
    sentence = source[0].tolist()  # 40 tokens, then </s> as translate_ids adds it
    source = torch.tensor([sentence + [EOS]])
    mask = torch.ones_like(source, dtype=torch.bool)
    assert output_limits(mask, max_extra=10, model_max_length=ours.config.position_limit) == 51
    with torch.no_grad():
        want = hf.generate(source, attention_mask=mask.long(), do_sample=False, num_beams=1,
                           max_new_tokens=source.shape[1] + 10, forced_eos_token_id=EOS,
                           bad_words_ids=[[PAD]])
    best = greedy_search(ours, source, mask, max_extra=10)[0]
    assert best.tokens == up_to_eos(want[0, 1:].tolist())
    beam_search(ours, source, mask, beam_size=BEAMS, max_extra=10)  # runs
    assert translate_ids(ours, [sentence], beam_size=1, max_extra=10) == [best.tokens]
