"""Subword language modelling: the byte-level BPE, token files (memory-mapped; nanoGPT's
``train.bin`` / ``val.bin``), and ``aiayn train lm --tokenizer`` with ``generate`` / ``evaluate`` end
to end on the bundled Shakespeare."""

import gzip
import json
import math
import os
import sys

import numpy as np
import pytest
import script_helpers as scripts
import torch
import torch.nn.functional as F

import checkpoint_builders as builders
from hf_helpers import needs_transformers_5
from aiayn.cli import main
from aiayn.data import chunked_encoding
from aiayn.data.byte_bpe import END_OF_TEXT, learn_byte_bpe, save_byte_bpe
from aiayn.data.text import contiguous_blocks, random_blocks, split_text
from aiayn.data.token_files import TokenFiles
from aiayn.training.run import load_run

pytest.importorskip("tokenizers")

TEXT = builders.shakespeare(40_000)
TINY = ["--preset", "baby-gpt", "--set", "d_model=32", "--set", "n_heads=2", "--set", "d_ff=64",
        "--set", "n_decoder_layers=1", "--block-size", "32", "--batch-size", "4", "--threads", "1",
        "--no-progress"]


@pytest.fixture(scope="module")
def bpe():
    return learn_byte_bpe(TEXT.splitlines(keepends=True), vocab_size=400)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "shakespeare.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def encoder(tokenizer):
    def encode_batch(texts):
        return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
    return encode_batch


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


# --- the byte-level BPE --------------------------------------------------------------------------
def test_byte_bpe_round_trips_any_text_and_reserves_id_0(bpe):
    sample = TEXT[:2000] + "Grüße, naïve café — 東京 🙂\ttab\r\n  two spaces"
    ids = bpe.encode(sample).ids
    assert bpe.decode(ids) == sample  # bytes, not characters: nothing is unknown
    assert bpe.get_vocab_size() == 400
    assert bpe.token_to_id(END_OF_TEXT) == 0 and 0 not in bpe.encode(TEXT).ids
    assert len(bpe.encode(TEXT).ids) < len(TEXT) / 1.5  # 143 merges: > 1.5 characters a token


def test_the_literal_end_of_text_marker_is_id_0_as_transformers_reads_it(bpe, tmp_path):
    """The one text that does not round-trip: "<|endoftext|>" in a corpus is the separator's id,
    as transformers' tokenizer reads the saved file (GPT-2's behaviour), and decoding drops it."""
    from transformers import PreTrainedTokenizerFast

    from aiayn.data.byte_bpe import save_byte_bpe

    text = "First document.<|endoftext|>Second one."
    ids = bpe.encode(text).ids
    assert ids.count(0) == 1 and bpe.decode(ids) == "First document.Second one."
    theirs = PreTrainedTokenizerFast(tokenizer_file=str(save_byte_bpe(bpe, tmp_path)))
    assert theirs(text)["input_ids"] == ids


def test_byte_bpe_needs_room_for_the_bytes():
    with pytest.raises(ValueError, match="at least 257 entries"):
        learn_byte_bpe(["abc"], vocab_size=256)


# --- token files ---------------------------------------------------------------------------------
@pytest.mark.parametrize("on_disk", [True, False], ids=["files", "memory"])
def test_token_files_hold_the_ids_of_encoding_each_split_whole(bpe, tmp_path, monkeypatch,
                                                               on_disk):
    """Encoded in many small chunks (a gzip file with Windows line ends), each split's ids are those
    of the tokenizer on the whole split's text (the character split of split_text)."""
    monkeypatch.setattr(chunked_encoding, "CHUNK_CHARACTERS", 300)
    path = tmp_path / "text.txt.gz"
    path.write_bytes(gzip.compress(TEXT.replace("\n", "\r\n").encode("utf-8")))
    calls = []

    def encode_batch(texts):
        calls.append(len(texts))
        return encoder(bpe)(texts)

    tokens = TokenFiles.write(path, encode_batch=encode_batch, vocab_size=400, tokenizer_id="t",
                              valid_fraction=0.1, directory=tmp_path / "tokens" if on_disk else None)
    train_text, valid_text = split_text(TEXT, 0.1)
    assert sum(calls) > 50  # the chunks really were many
    assert tokens.train.tolist() == bpe.encode(train_text).ids
    assert tokens.valid.tolist() == bpe.encode(valid_text).ids
    assert (tokens.train_characters, tokens.valid_characters) == (len(train_text), len(valid_text))
    assert tokens.train.dtype == np.uint16
    if on_disk:
        assert isinstance(tokens.train, np.memmap)
        assert (tmp_path / "tokens" / "train.bin").stat().st_size == 2 * len(tokens.train)
        again = TokenFiles.open(tmp_path / "tokens")
        assert np.array_equal(again.valid, tokens.valid) and again.info == tokens.info
        assert not list((tmp_path / "tokens").glob(".*.tmp"))


def marked_tokenizer(kind: str):
    """A ``tokenizers.Tokenizer`` learned on TEXT of a layout that marks the start of a text with
    SentencePiece's space marker "▁", as ``transformers`` writes each (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers import trainers

    from aiayn.data.tokenizer import SubwordTokenizer

    lines = TEXT.splitlines(keepends=True)
    if kind == "aiayn-subword":  # the translation tokenizer (prepend_scheme "always")
        return SubwordTokenizer.train(lines, vocab_size=300)._backend
    if kind in ("metaspace-bpe", "metaspace-unigram"):  # split at spaces (T5's: a Unigram model)
        unigram = kind == "metaspace-unigram"
        tokenizer = Tokenizer(models.Unigram() if unigram else models.BPE(unk_token="<unk>"))
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
        trainer = (trainers.UnigramTrainer if unigram else trainers.BpeTrainer)(
            vocab_size=300, special_tokens=["<unk>"], show_progress=False,
            **({"unk_token": "<unk>"} if unigram else {}))
        tokenizer.train_from_iterator(lines, trainer)
        return tokenizer
    # Llama's: <unk> <s> </s>, the byte tokens (byte fallback), BPE pieces, <s> added in front
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    learned = Tokenizer(models.BPE())
    learned.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    learned.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                           show_progress=False))
    model = json.loads(learned.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=model["vocab"], merges=merges, unk_token="<unk>",
                                     fuse_unk=True, byte_fallback=True))
    if kind == "llama-2":  # Llama 2's tokenizer.json (transformers 4's LlamaTokenizerFast, legacy)
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                     normalizers.Replace(" ", "\u2581")])
    else:  # "llama": transformers 5's LlamaTokenizer
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", 1)])
    return tokenizer


KINDS = ["byte-level", "metaspace-bpe", "metaspace-unigram", "llama-2", "llama", "aiayn-subword"]


@pytest.fixture(scope="module")
def tokenizers_of_each_kind(bpe):
    return {kind: bpe if kind == "byte-level" else marked_tokenizer(kind) for kind in KINDS}


@pytest.mark.parametrize("context", [1024, 16], ids=["lines", "line-ends"])
@pytest.mark.parametrize("kind", KINDS)
def test_chunks_give_the_ids_of_one_call_on_the_whole_split(tokenizers_of_each_kind, kind, context,
                                                            tmp_path, monkeypatch):
    """Token files and encode_text, written in many chunks through the task's encoder of a
    checkpoint's tokenizer.json, hold the ids of one call on each whole split, without special
    tokens, for GPT-2's byte-level BPE (aiayn's --tokenizer bpe) and for tokenizers that mark the
    start of a text (which encoding each chunk alone would mark at every chunk), whether a chunk
    is encoded after the whole last line of the one before or only its end."""
    from aiayn.interop.hf_tokenizer import load_tokenizer
    from aiayn.tasks.checkpoints import TextTokenizer
    from aiayn.tasks.lm import batch_encoder

    tokenizer = tokenizers_of_each_kind[kind]
    monkeypatch.setattr(chunked_encoding, "CHUNK_CHARACTERS", 300)
    monkeypatch.setattr(chunked_encoding, "CHUNKS_PER_BATCH", 4)
    monkeypatch.setattr(chunked_encoding, "CONTEXT_CHARACTERS", context)
    (tmp_path / "tokenizer").mkdir()
    tokenizer.save(str(tmp_path / "tokenizer" / "tokenizer.json"))
    encode_batch = batch_encoder(TextTokenizer(load_tokenizer(tmp_path / "tokenizer"),
                                               tmp_path / "tokenizer"))
    vocab_size = tokenizer.get_vocab_size()
    text = TEXT[:20_000]
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")

    def whole(part: str) -> list[int]:
        return tokenizer.encode(part, add_special_tokens=False).ids

    def written() -> tuple[list[int], list[int], list[int]]:
        tokens = TokenFiles.write(path, encode_batch=encode_batch, vocab_size=vocab_size,
                                  tokenizer_id="t", valid_fraction=0.2, directory=tmp_path / "tok")
        ids, characters = chunked_encoding.encode_text(path, encode_batch=encode_batch,
                                                  vocab_size=vocab_size, start=1234, stop=17_777)
        assert characters == 17_777 - 1234
        return tokens.train.tolist(), tokens.valid.tolist(), ids.tolist()

    train_text, valid_text = split_text(text, 0.2)
    expected = whole(train_text), whole(valid_text), whole(text[1234:17_777])
    assert written() == expected
    if kind == "llama-2":  # the checkpoint's template would put <s> in front
        assert tokenizer.encode(text[:50]).ids[0] == 1 and 1 not in expected[0]
    # Each chunk encoded alone (no context): the same ids for GPT-2's, marked starts for the others
    monkeypatch.setattr(chunked_encoding, "chunk_context", lambda chunk: "")
    alone = written()
    if kind == "byte-level":
        assert alone == expected
    else:  # in each split and in the part encode_text reads
        assert all(got != want for got, want in zip(alone, expected))


def test_a_tokenizer_that_joins_lines_encodes_those_chunks_alone_with_a_warning(tmp_path,
                                                                                monkeypatch):
    """Where a token joins the end of a line and the start of the next (pieces learned across lines
    without splitting at spaces), no cut gives the ids of one call: such a chunk is encoded on its
    own (as before the context existed), the others after their context, and a warning counts
    them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    lines = TEXT.splitlines(keepends=True)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    tokenizer.train_from_iterator(["".join(lines[i:i + 20]) for i in range(0, len(lines), 20)],
                                  trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"],
                                                      show_progress=False))
    monkeypatch.setattr(chunked_encoding, "CHUNK_CHARACTERS", 300)
    path = tmp_path / "joined.txt"
    path.write_text(TEXT[:20_000], encoding="utf-8")
    with pytest.warns(UserWarning, match=r"joined.txt: the tokenizer joins the end of a line and "
                                         r"the start of the next into one token at (\d+) of (\d+) "
                                         r"chunk starts") as caught:
        tokens = TokenFiles.write(path, encode_batch=encoder(tokenizer), vocab_size=400,
                                  tokenizer_id="t", valid_fraction=0.2, directory=tmp_path / "tok")
    # the rule, chunk by chunk, with the tokenizer called on each piece alone
    train_text, _ = split_text(TEXT[:20_000], 0.2)
    expected, joined, context = [], 0, ""
    for chunk in chunked_encoding.text_chunks(iter(train_text.splitlines(keepends=True))):
        ids, head = tokenizer.encode(context + chunk).ids, tokenizer.encode(context).ids
        if not context:  # the split's first chunk
            expected += ids
        elif ids[:len(head)] == head:
            expected += ids[len(head):]
        else:
            joined += 1
            expected += tokenizer.encode(chunk).ids
        context = chunked_encoding.chunk_context(chunk)
    assert joined >= 1
    assert tokens.train.tolist() == expected
    assert str(caught[0].message).count(f" at {joined} of ") == 1


def test_large_vocabularies_are_stored_as_uint32(bpe, tmp_path):
    (tmp_path / "t.txt").write_text(TEXT[:3000], encoding="utf-8")
    tokens = TokenFiles.write(tmp_path / "t.txt", encode_batch=encoder(bpe), vocab_size=70_000,
                              tokenizer_id="t", valid_fraction=0.5, directory=tmp_path / "tok")
    assert tokens.train.dtype == np.uint32
    assert tokens.train.tolist() == bpe.encode(TEXT[:1500]).ids


def test_memory_mapped_blocks_equal_the_blocks_of_a_tensor(tmp_path):
    values = (np.arange(1000, dtype=np.int64) * 7919 % 60_000).astype(np.uint16)
    values.tofile(tmp_path / "ids.bin")
    mapped = np.memmap(tmp_path / "ids.bin", dtype=np.uint16, mode="r")
    tensor = torch.from_numpy(values.astype(np.int64))
    pairs = zip(random_blocks(mapped, block_size=16, batch_size=3, batches=5,
                              generator=torch.Generator().manual_seed(1)),
                random_blocks(tensor, block_size=16, batch_size=3, batches=5,
                              generator=torch.Generator().manual_seed(1)))
    for (x, y), (x_ref, y_ref) in pairs:
        assert x.dtype == torch.long and torch.equal(x, x_ref) and torch.equal(y, y_ref)
        assert torch.equal(x[:, 1:], y[:, :-1])
    blocks = list(contiguous_blocks(mapped, block_size=16, batch_size=4))
    reference = list(contiguous_blocks(tensor, block_size=16, batch_size=4))
    assert len(blocks) == len(reference) and blocks[-1][0].shape == (1, 999 % 16)
    for (x, y), (x_ref, y_ref) in zip(blocks, reference):
        assert torch.equal(x, x_ref) and torch.equal(y, y_ref)
    targets = torch.cat([y.flatten() for _, y in blocks])
    assert torch.equal(targets, tensor[1:])  # every target once, in order


def test_token_files_that_are_truncated_or_foreign_are_refused(bpe, tmp_path):
    directory = tmp_path / "nanogpt"
    directory.mkdir()
    np.arange(100, dtype=np.uint16).tofile(directory / "train.bin")
    with pytest.raises(FileNotFoundError, match="val.bin"):
        TokenFiles.open_nanogpt(directory, vocab_size=400)
    (directory / "val.bin").write_bytes(b"\x01\x00\x02")  # an odd number of bytes
    with pytest.raises(ValueError, match="truncated"):
        TokenFiles.open_nanogpt(directory, vocab_size=400)
    np.array([1, 2, 500], dtype=np.uint16).tofile(directory / "val.bin")
    with pytest.raises(ValueError, match="token id 500, outside the tokenizer's vocabulary of 400"):
        TokenFiles.open_nanogpt(directory, vocab_size=400)
    (directory / "val.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="no tokens"):
        TokenFiles.open_nanogpt(directory, vocab_size=400)


# --- aiayn train lm --tokenizer ------------------------------------------------------------------
def test_train_lm_with_a_learned_bpe_end_to_end(text_file, tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["train", "lm", "--data", str(text_file), "--tokenizer", "bpe", "--vocab-size", "300",
            "--out", str(run_dir), "--eval-every", "4", "--save-every", "4", *TINY]
    assert main([*argv, "--steps", "4"]) == 0
    summary = last_json(capsys)
    info = json.loads((run_dir / "run.json").read_text())
    assert info["assets"]["kind"] == "bpe" and info["assets"]["size"] == 300
    assert info["model_config"]["vocab_size"] == 320  # padded to a multiple of 64

    # The validation figures, recomputed from the saved model and tokenizer by hand.
    run = load_run(run_dir)
    tokenizer = run.assets.tokenizer._tokenizer
    _, valid_text = split_text(TEXT, 0.1)
    ids = torch.tensor(tokenizer.encode(valid_text, add_special_tokens=False).ids)
    total = 0.0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, 32):
            block = ids[start:start + 33]
            logits = run.model(block[:-1][None])[0]  # (T, V)
            total += F.cross_entropy(logits, block[1:], reduction="sum").item()
    predicted = len(tokenizer.decode(ids[1:].tolist()))  # every character but the first token's
    assert summary["tokens"] == len(ids) - 1
    assert summary["loss"] == pytest.approx(total / (len(ids) - 1), rel=1e-5)
    assert summary["bits_per_token"] == pytest.approx(summary["loss"] / math.log(2))
    assert summary["bpc"] == pytest.approx(total / math.log(2) / predicted, rel=1e-5)

    assert main(["evaluate", str(run_dir), "--data", str(text_file), "--split", "valid"]) == 0
    result = last_json(capsys)
    for key in ("loss", "bpc", "bits_per_token", "tokens"):
        assert result[key] == pytest.approx(summary[key], rel=1e-6), key

    assert main(["generate", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "12",
                 "--seed", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ROMEO:") and len(out) > len("ROMEO:") + 1

    # Resumed: the saved tokenizer and token files are used as they are.
    stamps = {p.name: p.stat().st_mtime_ns for p in (run_dir / "tokens").iterdir()}
    bpe_file = (run_dir / "pretrained_tokenizer" / "tokenizer.json").read_bytes()
    assert main([*argv, "--steps", "6"]) == 0
    assert last_json(capsys)["step"] == 6
    assert {p.name: p.stat().st_mtime_ns for p in (run_dir / "tokens").iterdir()} == stamps
    assert (run_dir / "pretrained_tokenizer" / "tokenizer.json").read_bytes() == bpe_file


def test_token_files_are_made_again_when_the_text_changes(text_file, tmp_path, capsys):
    run_dir = tmp_path / "run"
    argv = ["train", "lm", "--data", str(text_file), "--tokenizer", "bpe", "--vocab-size", "300",
            "--out", str(run_dir), "--eval-every", "2", "--save-every", "2", *TINY]
    assert main([*argv, "--steps", "2"]) == 0
    first = json.loads((run_dir / "tokens" / "tokens.json").read_text())
    text_file.write_text(TEXT[:20_000], encoding="utf-8")
    assert main([*argv, "--steps", "4"]) == 0
    second = json.loads((run_dir / "tokens" / "tokens.json").read_text())
    assert first["train_characters"] + first["valid_characters"] == len(TEXT)
    assert second["train_characters"] + second["valid_characters"] == 20_000
    assert second["tokenizer"] == first["tokenizer"]  # the run's vocabulary is kept
    capsys.readouterr()


def test_train_lm_on_nanogpt_token_files(bpe, text_file, tmp_path, capsys):
    """nanoGPT's prepared directory (uint16 train.bin / val.bin) with the tokenizer that made it."""
    save_byte_bpe(bpe, tmp_path / "tokenizer")
    data = tmp_path / "prepared"
    data.mkdir()
    train_text, valid_text = split_text(TEXT, 0.1)
    np.array(bpe.encode(train_text).ids, dtype=np.uint16).tofile(data / "train.bin")
    np.array(bpe.encode(valid_text).ids, dtype=np.uint16).tofile(data / "val.bin")
    run_dir = tmp_path / "run"
    assert main(["train", "lm", "--data", str(data), "--tokenizer", str(tmp_path / "tokenizer"),
                 "--out", str(run_dir), "--steps", "3", "--eval-every", "3", "--save-every", "3",
                 *TINY]) == 0
    summary = last_json(capsys)
    assert "bpc" not in summary and summary["tokens"] == len(bpe.encode(valid_text).ids) - 1
    info = json.loads((run_dir / "run.json").read_text())
    assert info["model_config"]["vocab_size"] == 448 and info["assets"]["kind"] == "tokenizer"
    assert not (run_dir / "tokens").exists()  # read in place
    assert main(["evaluate", str(run_dir), "--data", str(data)]) == 0
    result = last_json(capsys)
    assert result["split"] == "valid" and result["loss"] == pytest.approx(summary["loss"], rel=1e-6)

    # The same ids from the text with --tokenizer DIR: the same batches, the same losses.
    text_run = tmp_path / "text-run"
    assert main(["train", "lm", "--data", str(text_file), "--tokenizer", str(tmp_path / "tokenizer"),
                 "--out", str(text_run), "--steps", "3", "--eval-every", "3", "--save-every", "3",
                 *TINY]) == 0
    assert last_json(capsys)["loss"] == pytest.approx(summary["loss"], rel=1e-6)


@pytest.mark.parametrize("family", ["gpt2", pytest.param("llama", marks=needs_transformers_5(
    "transformers.LlamaTokenizer is SentencePiece's, without vocab= and merges="))])
def test_fine_tuning_reads_its_text_as_transformers_tokenizes_it(text_file, tmp_path, capsys,
                                                                 monkeypatch, family):
    """GPT-2's byte-level BPE and Llama's tokenizer (which marks the start of a text), in many
    chunks: the ids of transformers' tokenizer on each whole split, without <s>."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(chunked_encoding, "CHUNK_CHARACTERS", 300)
    checkpoint = getattr(builders, family)(tmp_path / family)
    run_dir = tmp_path / "run"
    assert main(["train", "lm", "--init", str(checkpoint), "--data", str(text_file), "--out",
                 str(run_dir), "--steps", "1", "--eval-every", "1", "--save-every", "1",
                 "--block-size", "32", "--batch-size", "2", "--threads", "1", "--no-progress"]) == 0
    capsys.readouterr()
    tokens = TokenFiles.open(run_dir / "tokens")
    reference = transformers.AutoTokenizer.from_pretrained(checkpoint)
    train_text, valid_text = split_text(TEXT, 0.1)
    assert tokens.train.tolist() == reference(train_text, add_special_tokens=False)["input_ids"]
    assert tokens.valid.tolist() == reference(valid_text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("options, message", [
    (["--vocab-size", "300"], "--vocab-size sets the size of a learned BPE vocabulary"),
    (["--tokenizer", "MISSING"], "--tokenizer: no such directory"),
    (["--tokenizer", "EMPTY"], "has no tokenizer.json"),
    (["--tokenizer", "bpe", "--vocab-size", "100"], "at least 257 entries"),
])
def test_subword_options_that_do_not_fit_fail_clearly(text_file, tmp_path, capsys, options,
                                                      message):
    (tmp_path / "EMPTY").mkdir()
    options = [str(tmp_path / o) if o in ("MISSING", "EMPTY") else o for o in options]
    assert main(["train", "lm", "--data", str(text_file), "--out", str(tmp_path / "run"),
                 "--steps", "1", *options, *TINY]) == 1
    assert message in capsys.readouterr().err


def test_token_files_without_their_tokenizer_fail_clearly(tmp_path, capsys):
    data = tmp_path / "prepared"
    data.mkdir()
    for name in ("train.bin", "val.bin"):
        np.arange(200, dtype=np.uint16).tofile(data / name)
    assert main(["train", "lm", "--data", str(data), "--out", str(tmp_path / "run"),
                 "--steps", "1", *TINY]) == 1
    assert "read with the tokenizer that made them" in capsys.readouterr().err


@pytest.mark.slow
def test_torchrun_ranks_share_one_bpe_and_one_set_of_token_files(text_file, tmp_path):
    """Rank 0 learns the vocabulary and writes the token files; rank 1 waits and reads them."""
    from test_distributed import _free_port

    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), "-m", "aiayn", "train", "lm",
               "--data", str(text_file), "--tokenizer", "bpe", "--vocab-size", "300",
               "--steps", "2", "--eval-every", "2", "--save-every", "2", "--device", "cpu",
               "--out", str(run_dir), *TINY]
    # In a session of its own: a timeout kills torchrun and its workers.
    result = scripts.finish(scripts.start(command[1:], env={**os.environ, "OMP_NUM_THREADS": "1"}),
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1])["step"] == 2
    assert sorted(p.name for p in (run_dir / "tokens").iterdir()) == ["tokens.json", "train.bin",
                                                                      "val.bin"]
    assert load_run(run_dir).assets.tokenizer._tokenizer.get_vocab_size() == 300
