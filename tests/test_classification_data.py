"""Classification data: TSV reader errors, label map round trip, stratified split, metrics,
BERT masking proportions, the WordPiece tokenizer."""

import gzip
import json
from collections import Counter

import numpy as np
import pytest
import torch

from aiayn.data.labelled_tsv import read_labelled_tsv
from aiayn.data.labels import LabelMap
from aiayn.data.masking import IGNORE_INDEX, MaskingRule, mask_tokens
from aiayn.data.splits import stratified_split
from aiayn.data.wordpiece import WordPieceTokenizer
from aiayn.tasks.classification_metrics import classification_report, confusion_matrix


def write(path, text: str | bytes):
    path.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return path


# --- TSV reader -----------------------------------------------------------------------------------
def test_reads_rows_without_header(tmp_path):
    data = read_labelled_tsv(write(tmp_path / "a.tsv", "good film\tpos\r\n\nbad film\tneg\n"))
    assert data.texts == ("good film", "bad film") and data.labels == ("pos", "neg")
    assert data.lines == (1, 3) and data.splits is None


def test_header_names_columns_in_any_order_and_extra_columns_are_ignored(tmp_path):
    path = write(tmp_path / "a.tsv", "label\tpackage\ttext\nnet\tcurl\tfetch urls\n")
    data = read_labelled_tsv(path)
    assert data.texts == ("fetch urls",) and data.labels == ("net",) and data.lines == (2,)


def test_split_column_and_gzip(tmp_path):
    path = tmp_path / "a.tsv.gz"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write("text\tlabel\tsplit\na\tx\ttrain\nb\ty\ttest\nc\tx\tvalid\n")
    data = read_labelled_tsv(path)
    assert data.splits == ("train", "test", "valid")
    assert data.split("test").texts == ("b",)


@pytest.mark.parametrize("content, message", [
    ("", "bad.tsv: the file is empty"),
    ("\n\n", "bad.tsv: the file is empty"),
    ("text\tlabel\n", "bad.tsv: the file has a header but no rows"),
    ("a\tx\nb\n", r"bad.tsv:2: expected 2 tab-separated fields \(text<TAB>label\), got 1"),
    ("a\tx\nb\ty\tz\n", "bad.tsv:2: expected 2 tab-separated fields"),
    ("text\tlabel\tpackage\na\tx\n", "bad.tsv:2: expected 3 tab-separated fields"),
    ("a\tx\n  \ty\n", "bad.tsv:2: empty text"),
    ("a\tx\nb\t \n", "bad.tsv:2: empty label"),
    ("text\tlabel\tsplit\na\tx\tdev\n", "bad.tsv:2: unknown split 'dev'"),
])
def test_malformed_files_name_the_problem_and_line(tmp_path, content, message):
    path = write(tmp_path / "bad.tsv", content)
    with pytest.raises(ValueError, match=message) as info:
        read_labelled_tsv(path)
    assert str(path) in str(info.value)


def test_non_utf8_names_file_and_line(tmp_path):
    path = write(tmp_path / "latin1.tsv", "ok\tx\n".encode() + "caf\u00e9\ty\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.tsv:2: not UTF-8 text \(byte 0xe9"):
        read_labelled_tsv(path)


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        read_labelled_tsv(tmp_path / "nope.tsv")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        read_labelled_tsv(tmp_path)


def test_bundled_data_reads():
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "data" / "debian_sections_topical.tsv.gz"
    data = read_labelled_tsv(path)
    assert len(data) == 8271 and len(set(data.labels)) == 21


# --- labels -----------------------------------------------------------------------------------
def test_label_map_round_trip_and_unknown_label(tmp_path):
    labels = LabelMap.from_labels(["sound", "admin", "net", "admin"])
    assert labels.names == ("admin", "net", "sound")
    assert [labels.index(name) for name in ("admin", "net", "sound")] == [0, 1, 2]
    labels.save(tmp_path / "labels.json")
    again = LabelMap.load(tmp_path / "labels.json")
    assert again == labels and again.index("sound") == 2 and again.name(1) == "net"
    with pytest.raises(ValueError, match=r"x.tsv, line 7: unknown label 'games'; the model knows 3"):
        again.index("games", where="x.tsv, line 7")


def test_label_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        LabelMap.load(tmp_path / "missing.json")
    write(tmp_path / "bad.json", "{not json")
    with pytest.raises(ValueError, match="corrupt label file"):
        LabelMap.load(tmp_path / "bad.json")
    write(tmp_path / "dup.json", json.dumps({"labels": ["a", "a"]}))
    with pytest.raises(ValueError, match="duplicate labels"):
        LabelMap.load(tmp_path / "dup.json")


# --- split ------------------------------------------------------------------------------------
def test_stratified_split_keeps_class_shares_and_is_reproducible():
    labels = ["a"] * 100 + ["b"] * 50 + ["c"] * 10 + ["d"] * 2
    parts = stratified_split(labels, valid_fraction=0.1, test_fraction=0.2, seed=3)
    everything = parts.train + parts.valid + parts.test
    assert sorted(everything) == list(range(len(labels)))  # a partition
    count = lambda rows: Counter(labels[i] for i in rows)  # noqa: E731
    assert count(parts.test) == {"a": 20, "b": 10, "c": 2}
    assert count(parts.valid) == {"a": 10, "b": 5, "c": 1}
    assert count(parts.train) == {"a": 70, "b": 35, "c": 7, "d": 2}  # 2 rows: both stay in train
    assert parts == stratified_split(labels, valid_fraction=0.1, test_fraction=0.2, seed=3)
    assert parts != stratified_split(labels, valid_fraction=0.1, test_fraction=0.2, seed=4)


def test_a_repeated_text_is_never_in_training_and_a_held_out_part(tmp_path):
    """Keys (the texts): rows of one text the draw spread over parts all go to train; distinct
    texts split exactly as without keys; the classification command's split and its evaluation
    rows (held_out_keys) hold no text of the training rows."""
    labels = ["a"] * 60 + ["b"] * 60
    texts = [f"text {i % 20} of {label}" for i, label in enumerate(labels)]  # each 3 times
    plain = stratified_split(labels, valid_fraction=0.1, test_fraction=0.2, seed=0)
    keyed = stratified_split(labels, valid_fraction=0.1, test_fraction=0.2, seed=0, keys=texts)
    assert sorted(keyed.train + keyed.valid + keyed.test) == list(range(120))
    seen = {texts[i] for i in keyed.train}
    assert not seen & {texts[i] for i in keyed.valid + keyed.test}
    assert not {texts[i] for i in keyed.valid} & {texts[i] for i in keyed.test}
    assert set(keyed.valid) <= set(plain.valid) and set(keyed.test) <= set(plain.test)
    unique = [f"text {i}" for i in range(120)]
    assert stratified_split(labels, valid_fraction=0.1, test_fraction=0.2, seed=0,
                            keys=unique) == plain
    with pytest.raises(ValueError, match="119 keys for 120 rows"):
        stratified_split(labels, keys=unique[:-1])

    from aiayn.commands.train_classification import _evaluation_rows, load_splits

    path = tmp_path / "dups.tsv"
    path.write_text("".join(f"{t}\t{lab}\n" for t, lab in zip(texts, labels)), encoding="utf-8")
    data, parts, settings = load_splits(path, valid_fraction=0.1, test_fraction=0.2, seed=0)
    assert not set(parts["train"].texts) & (set(parts["valid"].texts) | set(parts["test"].texts))
    assert _evaluation_rows(data, settings, "test")[0].texts == parts["test"].texts


def test_stratified_split_keeps_a_training_row_and_checks_fractions():
    parts = stratified_split(["a", "a", "a"], valid_fraction=0.4, test_fraction=0.4)
    assert len(parts.train) == 1 and len(parts.valid) == 1 and len(parts.test) == 1
    with pytest.raises(ValueError, match="valid_fraction"):
        stratified_split(["a"], valid_fraction=1.5)
    with pytest.raises(ValueError, match="must be below 1"):
        stratified_split(["a"], valid_fraction=0.5, test_fraction=0.5)


# --- metrics ----------------------------------------------------------------------------------
def test_metrics_by_hand():
    # true:      a a a b b c
    # predicted: a a b b c c
    true, predicted = [0, 0, 0, 1, 1, 2], [0, 0, 1, 1, 2, 2]
    report = classification_report(true, predicted, ["a", "b", "c"])
    assert report.confusion.tolist() == [[2, 1, 0], [0, 1, 1], [0, 0, 1]]
    assert report.accuracy == pytest.approx(4 / 6)
    # a: P 2/2, R 2/3, F1 0.8; b: P 1/2, R 1/2, F1 0.5; c: P 1/2, R 1/1, F1 2/3
    assert report.precision == pytest.approx((1.0, 0.5, 0.5))
    assert report.recall == pytest.approx((2 / 3, 0.5, 1.0))
    assert report.f1 == pytest.approx((0.8, 0.5, 2 / 3))
    assert report.macro_f1 == pytest.approx((0.8 + 0.5 + 2 / 3) / 3)
    assert report.support == (3, 2, 1)
    assert report.confusion_tsv().splitlines()[1] == "a\t2\t1\t0"
    assert "true\\pred" in report.confusion_table()


def test_metrics_match_scikit_learn_and_skip_absent_classes():
    sklearn_metrics = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    true = rng.integers(0, 5, 200).tolist()
    predicted = [t if rng.random() < 0.6 else int(rng.integers(0, 5)) for t in true]
    report = classification_report(true, predicted, list("abcdefg"))  # f, g never occur
    assert report.macro_f1 == pytest.approx(
        sklearn_metrics.f1_score(true, predicted, average="macro"))
    assert report.accuracy == pytest.approx(sklearn_metrics.accuracy_score(true, predicted))
    assert (report.confusion[:5, :5] == sklearn_metrics.confusion_matrix(true, predicted)).all()


def test_metrics_bad_input():
    with pytest.raises(ValueError, match="zero predictions"):
        classification_report([], [], ["a"])
    with pytest.raises(ValueError, match="outside"):
        confusion_matrix([0, 3], [0, 1], 2)
    with pytest.raises(ValueError, match="equal-length"):
        confusion_matrix([0, 1], [0], 2)


# --- masking ----------------------------------------------------------------------------------
def test_bert_masking_proportions():
    vocab, mask_id, pad_id = 1000, 4, 0
    generator = torch.Generator().manual_seed(0)
    batch, length = 400, 128
    ids = torch.randint(10, vocab, (batch, length), generator=generator)
    lengths = torch.randint(20, length + 1, (batch,), generator=generator)
    real = torch.arange(length) < lengths[:, None]
    ids[~real] = pad_id
    ids[:, 0] = 2  # [CLS]
    ids[torch.arange(batch), lengths - 1] = 3  # [SEP]
    maskable = real.clone()
    maskable[:, 0] = False
    maskable[torch.arange(batch), lengths - 1] = False
    inputs, labels = mask_tokens(ids, maskable, mask_id=mask_id, random_ids=torch.arange(10, vocab),
                                 generator=generator)
    chosen = labels != IGNORE_INDEX
    # never a special token or padding; labels are the original ids
    assert not chosen[~maskable].any()
    assert (labels[chosen] == ids[chosen]).all()
    assert (inputs[~chosen] == ids[~chosen]).all()
    # exactly round(15%) of the maskable tokens of each row (at least one)
    expected = (maskable.sum(1).double() * 0.15).round().long().clamp(min=1)
    assert (chosen.sum(1) == expected).all()
    n = int(chosen.sum())
    masked = (inputs == mask_id) & chosen
    unchanged = (inputs == ids) & chosen
    replaced = chosen & ~masked & ~unchanged
    # Binomial standard deviations at n ~ 9000: 80% -> 0.42%, 10% -> 0.32%; allow 4 sigma.
    assert abs(masked.sum().item() / n - 0.8) < 0.017
    assert abs(replaced.sum().item() / n - 0.1) < 0.013
    # a random replacement may by chance equal the original (1 in 990): counts as unchanged
    assert abs(unchanged.sum().item() / n - 0.1) < 0.013
    assert (inputs[replaced] >= 10).all()  # drawn from the non-special vocabulary
    # chosen positions are spread over the maskable ones, not stuck at the start
    positions = chosen.nonzero()[:, 1].float()
    assert positions.mean() > 20


def test_masking_is_reproducible_and_checks_input():
    ids = torch.randint(5, 50, (4, 30))
    maskable = torch.ones_like(ids, dtype=torch.bool)
    run = lambda: mask_tokens(ids, maskable, mask_id=4, random_ids=torch.arange(5, 50),  # noqa
                              generator=torch.Generator().manual_seed(7))
    first, second = run(), run()
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    with pytest.raises(ValueError, match="must both be"):
        mask_tokens(ids, maskable[:, :3], mask_id=4, random_ids=torch.arange(5, 50),
                    generator=torch.Generator())
    with pytest.raises(ValueError, match="mask_share"):
        MaskingRule(mask_share=0.95, random_share=0.1)
    # a row with nothing maskable gets no target
    _, labels = mask_tokens(ids, torch.zeros_like(maskable), mask_id=4,
                            random_ids=torch.arange(5, 50), generator=torch.Generator())
    assert (labels == IGNORE_INDEX).all()


# --- tokenizer --------------------------------------------------------------------------------
def test_wordpiece_tokenizer_trains_saves_and_loads(tmp_path):
    texts = ["network tools for the command line", "a sound editor", "networking daemon"] * 20
    tokenizer = WordPieceTokenizer.train(texts, vocab_size=120)
    assert tokenizer.special_ids == (0, 1, 2, 3, 4)
    ids = tokenizer.encode(["Network TOOLS", "a sound editor for the command line"], max_length=5)
    assert ids[0][0] == tokenizer.cls_id and ids[0][-1] == tokenizer.sep_id
    assert len(ids[1]) == 5  # cut to max_length, [SEP] kept
    assert tokenizer.decode(ids[0]) == "network tools"
    tokenizer.save(tmp_path / "tokenizer.json")
    again = WordPieceTokenizer.load(tmp_path / "tokenizer.json")
    assert again.encode(["network tools"], max_length=16) == tokenizer.encode(
        ["network tools"], max_length=16)
    with pytest.raises(ValueError, match="at least 3"):
        tokenizer.encode(["x"], max_length=2)
    write(tmp_path / "bad.json", "{}")
    with pytest.raises(ValueError, match="not a tokenizer file"):
        WordPieceTokenizer.load(tmp_path / "bad.json")


def test_wordpiece_vocabulary_is_the_same_in_every_process(tmp_path):
    """Hugging Face's WordPieceTrainer gave a different vocabulary in each process (hash-map order);
    the same texts must give the same tokenizer file, whatever the process."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from aiayn.data.wordpiece import WordPieceTokenizer\n"
        "texts = [line.split('\\t')[0] for line in open(sys.argv[1], encoding='utf-8')]\n"
        "WordPieceTokenizer.train(texts, vocab_size=300).save(sys.argv[2])\n")
    corpus = tmp_path / "texts.tsv"
    corpus.write_text("".join(
        f"{' '.join(words)}\n" for words in
        [("network", "socket", "http", "server"), ("audio", "music", "player", "mixer"),
         ("game", "player", "level", "puzzle"), ("chess", "card", "board", "score"),
         ("proxy", "download", "packet", "route"), ("synth", "midi", "speaker", "volume")] * 15),
        encoding="utf-8")
    files = []
    for run in range(3):
        out = tmp_path / f"tokenizer{run}.json"
        subprocess.run([sys.executable, "-c", script, str(corpus), str(out)], check=True,
                       env={**__import__("os").environ, "PYTHONHASHSEED": str(run)})
        files.append(out.read_bytes())
    assert files[0] == files[1] == files[2]


def test_wordpiece_spells_every_word_of_seen_characters_and_keeps_the_word_starts():
    texts = ["network socket http server", "audio music player", "game level puzzle"] * 10
    tokenizer = WordPieceTokenizer.train(texts, vocab_size=60)
    vocabulary = tokenizer._tokenizer.get_vocab()
    for character in set("".join(texts)) - {" "}:
        assert character in vocabulary and "##" + character in vocabulary
    assert not any(token.startswith("\u2581") or token == "##" for token in vocabulary)
    ids = tokenizer.encode(["zebra", "puzzles on a server", "sound"], max_length=32)
    assert tokenizer.unk_id not in ids[1]  # unseen word, seen characters: spelled, not [UNK]
    assert tokenizer.decode(ids[1]) == "puzzles on a server"
    assert ids[0] == [tokenizer.cls_id, tokenizer.unk_id, tokenizer.sep_id]  # no 'b' in the texts
    assert tokenizer.encode(["[MASK] level"], max_length=8)[0][1] == tokenizer.mask_id
