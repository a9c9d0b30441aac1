"""Property-based tests (hypothesis): mask helpers, batching and bucketing, tokenizer round trips and
learning-rate schedules hold their contracts for any input, not just the hand-picked ones.

Example counts stay modest (see SETTINGS) so the file runs in seconds.
"""

from __future__ import annotations

import gzip
import random
import unicodedata
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aiayn import TransformerConfig
from aiayn.nn.attention.kernels import KERNELS
from aiayn.data.batching import collate, token_batches
from aiayn.data.sequence_batches import bucketed_batches, pad_right
from aiayn.data.text import CharVocabulary
from aiayn.masks import (attention_mask, causal_mask, key_padding_to_attention,
                         padding_mask_from_ids, padding_mask_from_lengths)
from aiayn.training.schedules import Schedule, noam, warmup_cosine

SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])
# The bundled English-German pairs (data/README.md); the first 399 are the corpus below.
DATA = Path(__file__).resolve().parents[1] / "data" / "ddtp_en_de.tsv.gz"


# --- masks ----------------------------------------------------------------------------------------
@SETTINGS
@given(st.lists(st.integers(0, 12), min_size=1, max_size=6), st.integers(0, 4))
def test_padding_mask_from_lengths_is_a_prefix_of_each_length(lengths, extra):
    width = max(lengths) + extra
    mask = padding_mask_from_lengths(torch.tensor(lengths), width)
    assert mask.shape == (len(lengths), width) and mask.dtype == torch.bool
    for row, length in zip(mask, lengths):
        assert row.tolist() == [True] * length + [False] * (width - length)
    assert torch.equal(padding_mask_from_lengths(torch.tensor(lengths)),
                       mask[:, :max(lengths)])


@SETTINGS
@given(st.lists(st.lists(st.integers(0, 5), min_size=3, max_size=3), min_size=1, max_size=4),
       st.integers(0, 5))
def test_padding_mask_from_ids_marks_exactly_the_non_pad_tokens(rows, pad):
    ids = torch.tensor(rows)
    mask = padding_mask_from_ids(ids, pad)
    assert mask.tolist() == [[token != pad for token in row] for row in rows]


@SETTINGS
@given(st.integers(1, 9), st.integers(0, 6))
def test_causal_mask_is_right_aligned(query_length, cached):
    key_length = query_length + cached
    mask = causal_mask(query_length, key_length)
    assert mask.shape == (query_length, key_length)
    for i in range(query_length):  # query i sits at absolute position cached + i
        assert mask[i].tolist() == [j <= cached + i for j in range(key_length)]
    assert mask[-1].all()  # the newest query sees every key
    # Decoding one token at a time sees exactly the rows of the full mask.
    full = causal_mask(key_length)
    assert torch.equal(mask, full[cached:])
    with pytest.raises(ValueError, match="query_length <= key_length"):
        causal_mask(key_length + 1, key_length)


@SETTINGS
@given(st.lists(st.integers(0, 7), min_size=1, max_size=4), st.integers(1, 7), st.booleans())
def test_attention_mask_is_padding_and_causal(lengths, query_length, causal):
    width = max(max(lengths), query_length)
    padding = padding_mask_from_lengths(torch.tensor(lengths), width)
    mask = attention_mask(padding, causal=causal, query_length=query_length)
    for b, length in enumerate(lengths):
        for i in range(query_length):
            for j in range(width):
                allowed = j < length and (not causal or j <= width - query_length + i)
                assert bool(mask.expand(len(lengths), 1, query_length, width)[b, 0, i, j]) \
                    == allowed
    assert torch.equal(key_padding_to_attention(padding), padding[:, None, None, :])


@SETTINGS
@given(st.integers(1, 6), st.integers(1, 9), st.booleans(), st.sampled_from(sorted(KERNELS)),
       st.integers(0, 2**31 - 1))
def test_every_kernel_honours_any_boolean_mask(query_length, key_extra, causal, name, seed):
    """Random masks, fully masked rows included: each kernel matches eq. 1 written out (the
    reference kernel) on the rows it attends exactly, and gives zeros where nothing is allowed.
    The sparse kernel with a window covering every key and linear attention are compared on
    what they compute exactly (sparse = dense here; linear against its own definition is in
    test_efficient_attention, so only finiteness and empty rows are checked for it)."""
    generator = torch.Generator().manual_seed(seed)
    key_length = query_length + key_extra - 1
    config = TransformerConfig.preset("tiny", attention=name, attention_window=64,
                                      attention_stride=64, attention_chunk_size=3)
    kernel = KERNELS[name].build(config)
    q = torch.randn(2, 2, query_length, 4, generator=generator)
    k, v = (torch.randn(2, 2, key_length, 4, generator=generator) for _ in range(2))
    mask = torch.rand(2, 1, 1, key_length, generator=generator) < 0.6  # key padding
    out = kernel(q, k, v, mask=mask, causal=causal)
    allowed = mask.expand(2, 2, query_length, key_length)
    if causal:
        allowed = allowed & causal_mask(query_length, key_length)
    empty = ~allowed.any(-1)  # (B, H, T)
    assert torch.isfinite(out).all()
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    if name != "linear":
        expected = KERNELS["reference"].build(config)(q, k, v, mask=mask, causal=causal)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


# --- batching -------------------------------------------------------------------------------------
lengths_strategy = st.lists(st.integers(1, 30), min_size=0, max_size=60)


@SETTINGS
@given(st.data(), lengths_strategy, st.integers(1, 120), st.booleans(), st.integers(0, 99))
def test_token_batches_cover_every_sentence_once_within_the_budget(data, sources, max_tokens,
                                                                   shuffle, seed):
    targets = data.draw(st.lists(st.integers(1, 30), min_size=len(sources),
                                 max_size=len(sources)))
    batches = token_batches(sources, targets, max_tokens=max_tokens, shuffle=shuffle, seed=seed)
    flat = [index for batch in batches for index in batch]
    assert sorted(flat) == list(range(len(sources)))  # every example exactly once
    for batch in batches:
        assert batch
        longest = max(max(sources[i], targets[i]) for i in batch)
        # padded tokens per side within budget; a sentence longer than the budget rides alone
        assert longest * len(batch) <= max_tokens or len(batch) == 1
    assert batches == token_batches(sources, targets, max_tokens=max_tokens, shuffle=shuffle,
                                    seed=seed)  # reproducible epoch


@SETTINGS
@given(lengths_strategy, st.integers(1, 9), st.integers(1, 4), st.one_of(st.none(),
                                                                         st.integers(0, 99)))
def test_bucketed_batches_cover_every_row_once(lengths, batch_size, pool_batches, seed):
    rng = None if seed is None else random.Random(seed)
    batches = bucketed_batches(lengths, batch_size=batch_size, rng=rng,
                               pool_batches=pool_batches)
    flat = [index for batch in batches for index in batch]
    assert sorted(flat) == list(range(len(lengths)))
    assert all(1 <= len(batch) <= batch_size for batch in batches)
    if seed is None:  # evaluation order: sorted by length
        assert [lengths[i] for i in flat] == sorted(lengths)
    else:
        again = bucketed_batches(lengths, batch_size=batch_size, rng=random.Random(seed),
                                 pool_batches=pool_batches)
        assert again == batches


@SETTINGS
@given(st.lists(st.lists(st.integers(4, 50), min_size=1, max_size=7), min_size=1, max_size=5),
       st.data())
def test_collate_and_pad_right_keep_every_token(sources, data):
    targets = data.draw(st.lists(st.lists(st.integers(4, 50), min_size=1, max_size=7),
                                 min_size=len(sources), max_size=len(sources)))
    batch = collate(sources, targets, list(range(len(sources))), pad_id=0, bos_id=1, eos_id=2)
    assert batch.target_tokens == int((batch.targets != 0).sum()) == sum(len(t) + 1
                                                                          for t in targets)
    assert batch.source_tokens == int((batch.source != 0).sum())
    for row, (source, target) in enumerate(zip(sources, targets)):
        assert batch.source[row, :len(source) + 1].tolist() == [*source, 2]
        assert batch.targets[row, :len(target) + 1].tolist() == [*target, 2]
        assert batch.decoder_input[row, :len(target) + 1].tolist() == [1, *target]
    ids, mask = pad_right(sources, 0)
    assert [row[m].tolist() for row, m in zip(ids, mask)] == sources


# --- tokenizers -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus():
    with gzip.open(DATA, "rt", encoding="utf-8") as handle:
        lines = [next(handle).rstrip("\n") for _ in range(400)][1:]  # past the header
    return [part for line in lines for part in line.split("\t")[:2]]


@pytest.fixture(scope="module")
def bpe(corpus):
    from aiayn.data.tokenizer import SubwordTokenizer

    return SubwordTokenizer.train(corpus, vocab_size=400)


def stable_alphabet(corpus):
    """Characters of the corpus that NFKC keeps as they are, no combining marks, and no
    whitespace but the plain space (the tokenizer normalises the rest)."""
    chars = set("".join(corpus))
    return sorted(c for c in chars if unicodedata.normalize("NFKC", c) == c
                  and not unicodedata.combining(c) and (c == " " or not c.isspace()))


def test_bpe_round_trips_any_text_over_its_alphabet(corpus, bpe):
    alphabet = stable_alphabet(corpus)
    # Any text over the training alphabet; Metaspace drops a leading space (documented limit).
    texts = st.text(alphabet=alphabet, min_size=0, max_size=40).filter(
        lambda t: not t.startswith(" ") and unicodedata.normalize("NFKC", t) == t)

    @SETTINGS
    @given(st.lists(texts, min_size=1, max_size=4))
    def check(batch):
        ids = bpe.encode(batch)
        assert all(0 <= i < bpe.vocab_size and i not in (0, 1, 2, 3) for row in ids
                   for i in row)  # no <unk>, no special ids inside the text
        assert bpe.decode(ids) == batch

    check()


def test_char_vocabulary_round_trips_and_names_unknown_characters(corpus):
    vocabulary = CharVocabulary.from_text("".join(corpus))

    @SETTINGS
    @given(st.text(alphabet=vocabulary.symbols, max_size=60))
    def check(text):
        ids = vocabulary.encode(text)
        assert all(0 <= i < len(vocabulary) for i in ids)
        assert vocabulary.decode(ids) == text

    check()

    @SETTINGS
    @given(st.text(alphabet=vocabulary.symbols[:5], max_size=10),
           st.text(alphabet=vocabulary.symbols[:5], max_size=10))
    def unknown(before, after):
        text = before + "\u2603" + after  # a snowman: in no corpus here
        line = text.count("\n", 0, len(before)) + 1
        with pytest.raises(ValueError,
                           match=rf"corpus:{line}: character '\u2603' .* \(column \d+\)"):
            vocabulary.encode(text, source="corpus")

    assert "\u2603" not in vocabulary.symbols
    unknown()


def test_wordpiece_round_trips_lowercase_words(corpus):
    from aiayn.data.wordpiece import WordPieceTokenizer

    tokenizer = WordPieceTokenizer.train(corpus, vocab_size=400)
    word = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=12)

    @SETTINGS
    @given(st.lists(word, min_size=1, max_size=8), st.integers(3, 40))
    def check(words, max_length):
        text = " ".join(words)
        (ids,) = tokenizer.encode([text], max_length=1000)
        assert ids[0] == tokenizer.cls_id and ids[-1] == tokenizer.sep_id
        assert tokenizer.unk_id not in ids
        assert tokenizer.decode(ids) == text  # BERT normalisation keeps such text as it is
        (cut,) = tokenizer.encode([text], max_length=max_length)
        assert len(cut) <= max_length and cut[-1] == tokenizer.sep_id
        assert cut[:-1] == ids[:len(cut) - 1]  # truncation keeps a prefix of the pieces

    check()


# --- schedules ------------------------------------------------------------------------------------
@SETTINGS
@given(st.integers(1, 5000), st.sampled_from([16, 64, 512, 1024]), st.floats(0.1, 10.0))
def test_noam_rises_to_its_peak_at_warmup_then_decays(warmup, d_model, factor):
    rate = [noam(step, d_model=d_model, warmup=warmup, factor=factor)
            for step in range(1, 3 * warmup + 2)]
    peak = max(range(len(rate)), key=rate.__getitem__) + 1
    assert peak == warmup  # the paper's eq. 3 peaks at the end of the warm-up
    assert rate[warmup - 1] == pytest.approx(factor * d_model ** -0.5 * warmup ** -0.5)
    assert all(a <= b for a, b in zip(rate[:warmup], rate[1:warmup]))  # up
    assert all(a >= b for a, b in zip(rate[warmup - 1:], rate[warmup:]))  # then down
    assert noam(0, d_model=d_model, warmup=warmup, factor=factor) == rate[0]  # step 0 guard


@SETTINGS
# No subnormal fractions: hypothesis refuses them once something in the process has set
# flush-to-zero (torch 2.4's CPU torch.compile does).
@given(st.integers(0, 300), st.integers(1, 600), st.floats(1e-6, 1.0),
       st.floats(0.0, 1.0, allow_subnormal=False))
def test_warmup_cosine_stays_between_floor_and_peak_up_then_down(warmup, extra, peak, fraction):
    floor = peak * fraction
    total = warmup + extra
    rate = [warmup_cosine(step, peak=peak, warmup=warmup, total=total, floor=floor)
            for step in range(0, total + 20)]
    top = max(warmup, 1)
    # Linear warm-up from peak / warmup (below the floor at first), then within [floor, peak].
    assert all(0 < r <= peak * (1 + 1e-12) for r in rate[1:warmup + 1])
    assert all(floor * (1 - 1e-12) <= r <= peak * (1 + 1e-12) for r in rate[top:])
    if warmup:  # the peak at the end of the warm-up (warmup 0: the decay starts at step 1)
        assert rate[warmup] == pytest.approx(peak)
    assert all(a <= b + 1e-15 for a, b in zip(rate[1:top + 1], rate[2:top + 1]))  # up
    assert all(a >= b - 1e-15 for a, b in zip(rate[top:], rate[top + 1:]))  # then down
    assert rate[total:] == [floor] * len(rate[total:])  # the floor from ``total`` on
    schedule = Schedule(kind="warmup_cosine", peak=peak, warmup=warmup, total=total, floor=floor)
    assert [schedule(step) for step in range(len(rate))] == rate
