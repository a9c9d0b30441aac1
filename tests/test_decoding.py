"""Greedy and beam search: cache vs recomputation, beam 1 == greedy, batch-size invariance."""

from __future__ import annotations

import pytest
import torch

from aiayn import Transformer, TransformerConfig
from aiayn.decoding.beam import beam_search, length_penalty
from aiayn.decoding.greedy import greedy_search

EOS = 2


_TRAINED: dict[int, dict[str, torch.Tensor]] = {}


def make_model(seed=0):
    """A tiny model briefly trained to copy its source, so that its outputs end (</s>) at
    different lengths, like a real translation model's; an untrained one says </s> at once or
    never."""
    torch.manual_seed(seed)
    config = TransformerConfig.preset("tiny", vocab_size=30, dropout=0.0)
    model = Transformer(config)
    if seed not in _TRAINED:
        optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
        generator = torch.Generator().manual_seed(seed)
        for _ in range(60):
            length = int(torch.randint(2, 9, (1,), generator=generator))
            body = torch.randint(3, 30, (16, length), generator=generator)
            source = torch.cat([body, torch.full((16, 1), EOS)], 1)
            decoder_input = torch.cat([torch.full((16, 1), 1), body], 1)
            loss = torch.nn.functional.cross_entropy(
                model(source, decoder_input).flatten(0, 1), source.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        _TRAINED[seed] = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(_TRAINED[seed])
    return model.eval()


def make_sources(count=7, seed=1):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 9, (count,), generator=generator).tolist()
    rows = [torch.randint(3, 30, (n,), generator=generator).tolist() + [EOS] for n in lengths]
    return rows


def pad(rows):
    width = max(map(len, rows))
    source = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    return source, source != 0


def reference_greedy(model, row, max_extra):
    """Greedy without a cache: recompute the whole prefix every step."""
    source = torch.tensor([row])
    memory = model.encode(source)
    tokens = [model.config.bos_id]
    limit = len(row) + max_extra
    for position in range(limit):
        logits = model.decode(torch.tensor([tokens]), memory)[0, -1]
        logits[[0, 1]] = -torch.inf
        if position == limit - 1:
            return tokens[1:]
        token = int(logits.argmax())
        if token == EOS:
            return tokens[1:]
        tokens.append(token)
    return tokens[1:]


def test_greedy_on_cache_equals_recomputation():
    model, rows = make_model(), make_sources()
    source, mask = pad(rows)
    with torch.no_grad():
        got = [h.tokens for h in greedy_search(model, source, mask, max_extra=6)]
        expected = [reference_greedy(model, row, 6) for row in rows]
    assert got == expected
    lengths = {len(tokens) for tokens in got}
    assert len(lengths) > 1  # sentences finished at different steps (batch compaction ran)


def test_outputs_respect_the_length_limit():
    model, rows = make_model(), make_sources()
    source, mask = pad(rows)
    for hypotheses in (greedy_search(model, source, mask, max_extra=3),
                       beam_search(model, source, mask, beam_size=3, max_extra=3)):
        for row, hypothesis in zip(rows, hypotheses):
            assert len(hypothesis.tokens) <= len(row) + 3 - 1  # + </s> = the limit


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_one_equals_greedy(seed):
    model, rows = make_model(seed), make_sources(seed=seed + 10)
    source, mask = pad(rows)
    greedy = greedy_search(model, source, mask, max_extra=8)
    beam = beam_search(model, source, mask, beam_size=1, alpha=0.6, max_extra=8)
    assert [h.tokens for h in beam] == [h.tokens for h in greedy]


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_results_do_not_depend_on_the_batch(search):
    model, rows = make_model(), make_sources(count=9)

    def decode(batch_rows):
        source, mask = pad(batch_rows)
        if search == "greedy":
            return [h.tokens for h in greedy_search(model, source, mask, max_extra=8)]
        return [h.tokens for h in beam_search(model, source, mask, beam_size=4, max_extra=8)]

    together = decode(rows)
    one_by_one = [decode([row])[0] for row in rows]
    reversed_batch = decode(rows[::-1])[::-1]
    in_threes = [tokens for start in range(0, 9, 3) for tokens in decode(rows[start:start + 3])]
    assert together == one_by_one == reversed_batch == in_threes


def test_beam_search_scores_are_length_normalised_log_probabilities():
    model, rows = make_model(), make_sources(count=3)
    source, mask = pad(rows)
    hypotheses = beam_search(model, source, mask, beam_size=4, alpha=0.6, max_extra=8)
    for row, hypothesis in zip(rows, hypotheses):
        # rescore the returned hypothesis with teacher forcing
        target = [1] + hypothesis.tokens
        with torch.no_grad():
            logits = model(torch.tensor([row]), torch.tensor([target]))[0]
        log_probs = torch.log_softmax(logits, -1)
        total = sum(float(log_probs[i, t]) for i, t in enumerate(hypothesis.tokens + [EOS]))
        assert hypothesis.score == pytest.approx(
            total / length_penalty(len(hypothesis.tokens) + 1, 0.6), rel=1e-4, abs=1e-4)


def test_wider_beam_finds_hypotheses_at_least_as_good_as_greedy_on_average():
    model, rows = make_model(3), make_sources(count=12, seed=4)
    source, mask = pad(rows)
    greedy = greedy_search(model, source, mask, max_extra=8)
    beam = beam_search(model, source, mask, beam_size=6, alpha=0.0, max_extra=8)
    assert sum(b.score >= g.score - 1e-5 for b, g in zip(beam, greedy)) >= 10


def test_length_penalty_is_gnmt():
    assert length_penalty(1, 0.6) == pytest.approx(1.0)
    assert length_penalty(10, 0.6) == pytest.approx((15 / 6) ** 0.6)
    assert length_penalty(7, 0.0) == 1.0


def test_bad_beam_arguments():
    model, rows = make_model(), make_sources(count=2)
    source, mask = pad(rows)
    with pytest.raises(ValueError, match="beam_size"):
        beam_search(model, source, mask, beam_size=0)
    with pytest.raises(ValueError, match="too large"):
        beam_search(model, source, mask, beam_size=20)
    with pytest.raises(ValueError, match="alpha"):
        beam_search(model, source, mask, alpha=-1.0)


@pytest.mark.parametrize("search", ["greedy", "beam"])
def test_an_unpadded_batch_decodes_without_a_cross_attention_mask(search, monkeypatch):
    """Without padding the search passes no memory mask to the decoder; the hypotheses and scores
    equal those of the same sentences decoded beside a padded one (where the mask is needed)."""
    model, rows = make_model(), make_sources(count=12)
    rows = [row[:4] for row in rows if len(row) >= 4][:3]  # equal lengths: no padding
    assert len(rows) == 3
    masks_seen = []
    decode = model.decode

    def recording_decode(*args, memory_padding_mask=None, **kwargs):
        masks_seen.append(memory_padding_mask)
        return decode(*args, memory_padding_mask=memory_padding_mask, **kwargs)

    monkeypatch.setattr(model, "decode", recording_decode)

    def run(batch_rows):
        source, mask = pad(batch_rows)
        if search == "greedy":
            return greedy_search(model, source, mask, max_extra=6)
        return beam_search(model, source, mask, beam_size=3, max_extra=6)

    alone = run(rows)
    assert masks_seen and all(mask is None for mask in masks_seen)
    masks_seen.clear()
    beside_padded = run(rows + [rows[0][:2]])[:len(rows)]
    assert all(mask is not None for mask in masks_seen)
    assert [h.tokens for h in alone] == [h.tokens for h in beside_padded]
    torch.testing.assert_close(torch.tensor([h.score for h in alone]),
                               torch.tensor([h.score for h in beside_padded]), rtol=1e-5, atol=1e-5)


def test_translate_ids_cuts_sources_past_the_position_table_and_says_so():
    """A source longer than the position table allows (with </s>, and room for the first output
    position) is translated from its first max_length - 2 ids, with a warning counting the cut
    sources; sources that fit give no warning."""
    import warnings

    from aiayn.tasks.translate import translate_ids

    torch.manual_seed(0)
    model = Transformer(TransformerConfig.preset("tiny", vocab_size=30, dropout=0.0,
                                                 max_length=16)).eval()
    long, short = list(range(3, 30)), [5, 6, 7]
    with pytest.warns(RuntimeWarning, match=r"1 source\(s\) longer than the model's position "
                                            r"table allows were cut to their first 14 subwords"):
        cut = translate_ids(model, [long, short], beam_size=1, max_extra=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*position table", category=RuntimeWarning)
        assert translate_ids(model, [long[:14], short], beam_size=1, max_extra=2) == cut
