"""Beam search on Marian: aiayn's ``beam_search`` equals Hugging Face ``generate(num_beams=4)`` token for
token when both use one length-penalty convention.

Conventions matched (see docs/huggingface.md): HF scores a finished hypothesis sum(log p) / L**alpha,
aiayn (the paper, GNMT) sum(log p) / ((5 + L) / 6)**alpha, so they agree at alpha = 0; and with HF's
length penalty swapped into aiayn's search they agree for any alpha. Both keep the 2K best extensions
per step and finish </s> extensions among the first K (fairseq's rule); both block pad (HF:
``bad_words_ids``) and force </s> at the last allowed position (HF: ``forced_eos_token_id``).
One convention differs and is kept out of these cases: at that forced last position HF scores </s>
with log-probability 0, aiayn with its real log-probability; the hypotheses here end well before it.
"""

import pytest
import torch

import aiayn
from aiayn.decoding import beam as beam_module
from hf_helpers import randomise

transformers = pytest.importorskip("transformers")
BEAMS, MAX_EXTRA = 4, 50


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    directory = tmp_path_factory.mktemp("marian")
    config = transformers.MarianConfig(
        vocab_size=40, pad_token_id=39, decoder_start_token_id=39, eos_token_id=0,
        forced_eos_token_id=0, max_position_embeddings=80, d_model=32, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=48,
        decoder_ffn_dim=48, scale_embedding=True, activation_function="swish")
    hf = transformers.MarianMTModel(config).eval()
    randomise(hf, std=0.1)
    with torch.no_grad():  # make </s> reachable so hypotheses finish at different lengths
        hf.final_logits_bias[0, 0] += 1.0
    hf.save_pretrained(directory)
    return hf, aiayn.from_pretrained(directory)


def _hf_beam(hf, source, *, alpha):
    limit = source.shape[1] + MAX_EXTRA  # aiayn: source length + max_extra tokens, </s> included
    with torch.no_grad():
        out = hf.generate(source, attention_mask=torch.ones_like(source), num_beams=BEAMS,
                          do_sample=False, length_penalty=alpha, early_stopping=True,
                          max_new_tokens=limit, forced_eos_token_id=0, bad_words_ids=[[39]])
    tokens = out[0, 1:].tolist()  # drop the decoder start token
    return tokens[: tokens.index(0)] if 0 in tokens else tokens  # up to </s>


@pytest.mark.parametrize("seed", range(4))
def test_beam_matches_hf_without_length_penalty(marian, seed):
    hf, ours = marian
    source = torch.randint(1, 39, (1, 5 + seed), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(source, dtype=torch.bool)
    best = beam_module.beam_search(ours, source, mask, beam_size=BEAMS, alpha=0.0,
                                   max_extra=MAX_EXTRA)[0]
    assert 0 < len(best.tokens) < source.shape[1] + MAX_EXTRA - 1  # </s> not forced at the limit
    assert best.tokens == _hf_beam(hf, source, alpha=0.0)


@pytest.mark.parametrize("seed", range(4))
def test_beam_matches_hf_with_hf_length_penalty(marian, seed, monkeypatch):
    """HF's convention L**alpha swapped into aiayn's search: the same tokens for alpha = 0.5."""
    hf, ours = marian
    monkeypatch.setattr(beam_module, "length_penalty", lambda length, alpha: length ** alpha)
    source = torch.randint(1, 39, (1, 5 + seed), generator=torch.Generator().manual_seed(100 + seed))
    mask = torch.ones_like(source, dtype=torch.bool)
    best = beam_module.beam_search(ours, source, mask, beam_size=BEAMS, alpha=0.5,
                                   max_extra=MAX_EXTRA)[0]
    assert 0 < len(best.tokens) < source.shape[1] + MAX_EXTRA - 1  # </s> not forced
    assert best.tokens == _hf_beam(hf, source, alpha=0.5)


@pytest.mark.parametrize("seed", range(3))
def test_greedy_search_matches_hf(marian, seed):
    """aiayn.decoding's batched greedy search (pad blocked, </s> forced at the limit) = HF greedy."""
    from aiayn.decoding.greedy import greedy_search

    hf, ours = marian
    source = torch.randint(1, 39, (1, 5 + seed), generator=torch.Generator().manual_seed(200 + seed))
    mask = torch.ones_like(source, dtype=torch.bool)
    best = greedy_search(ours, source, mask, max_extra=MAX_EXTRA)[0]
    with torch.no_grad():
        out = hf.generate(source, attention_mask=mask.long(), num_beams=1, do_sample=False,
                          max_new_tokens=source.shape[1] + MAX_EXTRA, forced_eos_token_id=0,
                          bad_words_ids=[[39]])
    tokens = out[0, 1:].tolist()
    assert best.tokens == (tokens[: tokens.index(0)] if 0 in tokens else tokens)
