"""Parallel corpus reading, splitting, tokenizer and token batching."""

from __future__ import annotations

import gzip
import warnings

import pytest

from aiayn.data.batching import collate, token_batches
from aiayn.data.parallel import read_aligned, read_pairs, read_tsv, split_pairs
from aiayn.data.tokenizer import SubwordTokenizer

PAIRS = [("the house is small", "das Haus ist klein"), ("the cat sleeps", "die Katze schläft"),
         ("a small cat", "eine kleine Katze"), ("the house sleeps", "das Haus schläft")]


def write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_tsv_without_header(tmp_path):
    path = write(tmp_path / "a.tsv", "".join(f"{e}\t{d}\n" for e, d in PAIRS))
    pairs = read_tsv(path)
    assert [(p.source, p.target) for p in pairs] == PAIRS
    assert pairs[1].origin == f"{path}:2" and pairs[0].split is None


def test_a_first_line_of_sentences_is_a_pair_whatever_its_other_fields(tmp_path):
    """A file without a header whose third column is a language code ('de'): the first line is
    the first pair, not a header that would move the target to that column for every line."""
    path = write(tmp_path / "a.tsv", "".join(f"{e}\t{d}\tde\n" for e, d in PAIRS))
    assert [(p.source, p.target) for p in read_tsv(path)] == PAIRS
    named = write(tmp_path / "b.tsv", "english\tfrench\tsplit\n" + "".join(
        f"{e}\t{d}\ttrain\n" for e, d in PAIRS))  # names without spaces: still a header
    assert [(p.source, p.target, p.split) for p in read_tsv(named)] == [
        (e, d, "train") for e, d in PAIRS]


def test_tsv_with_header_and_split_column_gz(tmp_path):
    rows = "en\tde\tsource\tsplit\n" + "".join(
        f"{e}\t{d}\tddtp:x\t{s}\n" for (e, d), s in zip(PAIRS, ["train", "train", "valid", "test"]))
    path = tmp_path / "a.tsv.gz"
    path.write_bytes(gzip.compress(rows.encode()))
    pairs = read_pairs([path])
    assert [p.split for p in pairs] == ["train", "train", "valid", "test"]
    splits = split_pairs(pairs)
    assert [len(splits[k]) for k in ("train", "valid", "test")] == [2, 1, 1]


def test_two_aligned_files(tmp_path):
    src = write(tmp_path / "src.txt", "".join(e + "\n" for e, _ in PAIRS))
    tgt = write(tmp_path / "tgt.txt", "".join(d + "\n" for _, d in PAIRS))
    assert [(p.source, p.target) for p in read_pairs([src, tgt])] == PAIRS
    write(tgt, "".join(d + "\n" for _, d in PAIRS[:3]))
    with pytest.raises(ValueError, match="has 4 lines but .* has 3"):
        read_aligned(src, tgt)


@pytest.mark.parametrize("text,message", [
    ("", "a.tsv: the file is empty"),
    ("\n\n", "no sentence pairs"),
    ("a\tb\nonly one field\n", r"a.tsv:2: expected at least 2 tab-separated fields"),
    ("a\tb\n\tb\n", r"a.tsv:2: empty source text"),
    ("en\tde\tsplit\na\tb\tdev\n", r"a.tsv:2: split must be one of"),
])
def test_tsv_errors_name_file_and_line(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        read_tsv(write(tmp_path / "a.tsv", text))


def test_missing_file_and_bad_encoding(tmp_path):
    with pytest.raises(FileNotFoundError, match="data file not found"):
        read_tsv(tmp_path / "nope.tsv")
    path = tmp_path / "bad.tsv"
    path.write_bytes(b"a\tb\n\xff\xfe\tc\n")
    with pytest.raises(ValueError, match=r"bad.tsv:2: not UTF-8 text \(byte 0xff at column 1\)"):
        read_tsv(path)


def test_hash_split_is_reproducible_and_order_independent(tmp_path):
    lines = [(f"sentence number {i}", f"Satz Nummer {i}") for i in range(400)]
    path = write(tmp_path / "a.tsv", "".join(f"{e}\t{d}\n" for e, d in lines))
    first = split_pairs(read_tsv(path), valid_fraction=0.1, test_fraction=0.1)
    write(path, "".join(f"{e}\t{d}\n" for e, d in reversed(lines)))
    second = split_pairs(read_tsv(path), valid_fraction=0.1, test_fraction=0.1)
    for name in ("train", "valid", "test"):
        assert sorted(p.source for p in first[name]) == sorted(p.source for p in second[name])
    assert 20 <= len(first["test"]) <= 60 and 20 <= len(first["valid"]) <= 60


def test_tokenizer_round_trip_and_save_load(tmp_path):
    texts = [e for e, _ in PAIRS] + [d for _, d in PAIRS]
    tokenizer = SubwordTokenizer.train(texts * 5, vocab_size=80)
    ids = tokenizer.encode(["das Haus schläft", "the small cat"])
    assert all(i >= 4 for row in ids for i in row)  # no special ids inside text
    assert tokenizer.decode(ids) == ["das Haus schläft", "the small cat"]
    tokenizer.save(tmp_path / "tokenizer.json")
    assert SubwordTokenizer.load(tmp_path / "tokenizer.json").encode(["das Haus"]) == \
        tokenizer.encode(["das Haus"])
    write(tmp_path / "broken.json", "{")
    with pytest.raises(ValueError, match="broken.json: not a valid tokenizer"):
        SubwordTokenizer.load(tmp_path / "broken.json")


def test_token_batches_respect_the_budget_and_cover_every_sentence():
    source = [3, 10, 4, 7, 7, 2, 12, 5, 9, 1] * 5
    target = [4, 9, 5, 8, 6, 3, 11, 5, 10, 2] * 5
    batches = token_batches(source, target, max_tokens=30, shuffle=True, seed=3)
    assert sorted(i for batch in batches for i in batch) == list(range(50))
    for batch in batches:
        assert max(max(source[i], target[i]) for i in batch) * len(batch) <= 30
    assert batches == token_batches(source, target, max_tokens=30, shuffle=True, seed=3)
    assert batches != token_batches(source, target, max_tokens=30, shuffle=True, seed=4)


def test_collate_shifts_targets_and_counts_tokens():
    batch = collate([[5, 6], [7]], [[8, 9, 10], [11]], [0, 1], pad_id=0, bos_id=1, eos_id=2)
    assert batch.source.tolist() == [[5, 6, 2], [7, 2, 0]]
    assert batch.decoder_input.tolist() == [[1, 8, 9, 10], [1, 11, 0, 0]]
    assert batch.targets.tolist() == [[8, 9, 10, 2], [11, 2, 0, 0]]
    assert batch.target_tokens == 6 and batch.source_tokens == 5


def test_no_validation_pairs_warns_and_is_recorded(tmp_path):
    """A split column without valid rows: validation falls back to training pairs, said in a
    warning and in the run's assets; with valid rows, neither."""
    from aiayn.tasks.translation import TranslationTask

    sentences = [(f"the house {n} is small", f"das Haus {n} ist klein") for n in range(30)]

    def tsv(name, splits):
        return write(tmp_path / name, "en\tde\tsplit\n" + "".join(
            f"{e}\t{d}\t{s}\n" for (e, d), s in zip(sentences, splits)))

    no_valid = tsv("a.tsv", ["train"] * 28 + ["test"] * 2)
    with pytest.warns(RuntimeWarning, match="a.tsv: no validation pairs .* validation scores the "
                                            "first 28 training pairs, which the model trains on"):
        task = TranslationTask([no_valid], vocab_size=80, valid_bleu_sentences=0)
    assert task.valid_pairs == [p for p in read_pairs([no_valid]) if p.split == "train"]
    assert task.save_assets(tmp_path)["valid_from_train"] is True
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*no validation pairs", category=RuntimeWarning)
        task = TranslationTask([tsv("b.tsv", ["train"] * 26 + ["valid"] * 2 + ["test"] * 2)],
                               vocab_size=80, valid_bleu_sentences=0)
    assert task.save_assets(tmp_path)["valid_from_train"] is False
