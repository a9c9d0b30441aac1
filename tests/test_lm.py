"""Language modelling: text reading errors, character vocabulary, blocks, the LM task, the presets,
and ``aiayn train lm`` / ``generate`` / ``evaluate`` end to end on a tiny text."""

import gzip
import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from aiayn import CausalLM, TransformerConfig, count_parameters
from aiayn.cli import main
from aiayn.data.text import (CharVocabulary, contiguous_blocks, random_blocks, read_text,
                             split_text)
from aiayn.tasks.lm import LanguageModelTask, evaluate_ids

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\n") * 12

TINY = ["--preset", "baby-gpt", "--set", "d_model=32", "--set", "n_heads=2", "--set", "d_ff=64",
        "--set", "n_decoder_layers=1", "--block-size", "16", "--batch-size", "4", "--threads", "1",
        "--no-progress"]


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


# --- reading text --------------------------------------------------------------------------------
def test_windows_line_ends_read_as_newlines(tmp_path):
    """A CR LF file gives the text (and so the vocabulary) of its LF twin; a lone CR stays."""
    (tmp_path / "crlf.txt").write_bytes(b"First Citizen:\r\nSpeak.\r\n\r\nA\rB\n")
    assert read_text(tmp_path / "crlf.txt") == "First Citizen:\nSpeak.\n\nA\rB\n"


def test_read_text_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.txt: text file not found"):
        read_text(tmp_path / "missing.txt")
    with pytest.raises(IsADirectoryError, match="is a directory"):
        read_text(tmp_path)
    (tmp_path / "empty.txt").write_text("  \n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty.txt: the file is empty"):
        read_text(tmp_path / "empty.txt")
    (tmp_path / "latin1.txt").write_bytes("line one\nline two\nna\xefve\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt:3: not UTF-8 text \(byte 0xef at column 3\)"):
        read_text(tmp_path / "latin1.txt")
    (tmp_path / "bad.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match="not a valid gzip file"):
        read_text(tmp_path / "bad.gz")


def test_read_text_reads_gzip_and_drops_a_byte_order_mark(tmp_path):
    (tmp_path / "t.txt.gz").write_bytes(gzip.compress("\ufeffhello\n".encode("utf-8")))
    assert read_text(tmp_path / "t.txt.gz") == "hello\n"


def test_bundled_shakespeare_is_the_shared_corpus():
    from pathlib import Path

    text = read_text(Path(__file__).parents[1] / "data" / "shakespeare_tiny.txt.gz")
    assert len(text) == 1_158_412 and len(set(text)) == 78
    assert text.startswith("CORIOLANUS") or text[:200].strip()


# --- vocabulary, split, blocks -------------------------------------------------------------------
def test_char_vocabulary_round_trip_and_unknown_characters(tmp_path):
    vocabulary = CharVocabulary.from_text("hello world")
    assert vocabulary.symbols == sorted(set("hello world"))
    ids = vocabulary.encode("world hello")
    assert vocabulary.decode(ids) == "world hello"
    with pytest.raises(ValueError, match=r"prompt:1: character 'z' is not in the model's "
                                         r"vocabulary of 8 characters \(column 9\)"):
        vocabulary.encode("hello woz", source="prompt")
    vocabulary.save(tmp_path)
    assert CharVocabulary.load(tmp_path).symbols == vocabulary.symbols
    (tmp_path / "vocabulary.json").write_text("{broken", encoding="utf-8")
    with pytest.raises(ValueError, match="corrupt vocabulary"):
        CharVocabulary.load(tmp_path)
    with pytest.raises(ValueError, match="distinct"):
        CharVocabulary(["a", "a"])


@pytest.mark.parametrize("seed", range(5))
def test_vectorised_ids_equal_a_lookup_character_by_character(seed):
    """``ids`` (a binary search over code points) gives the id of each character as a dict lookup
    does, for any characters (astral ones, a lone surrogate) and symbols in any order."""
    import random

    rng = random.Random(seed)
    alphabet = list("ab\n\t \r\u00e9\u4e2d\U0001f600\ud800") + [chr(rng.randrange(0x110000))
                                                                 for _ in range(20)]
    alphabet = list(dict.fromkeys(alphabet))
    rng.shuffle(alphabet)  # ids in no sorted order
    vocabulary = CharVocabulary(alphabet)
    text = "".join(rng.choice(alphabet) for _ in range(500))
    ids = vocabulary.ids(text)
    assert ids.dtype == np.int64 and ids.tolist() == [alphabet.index(c) for c in text]
    assert vocabulary.encode(text) == ids.tolist() and vocabulary.decode(ids.tolist()) == text
    assert vocabulary.ids("").tolist() == []
    for outside in ("\x00", "\U0010ffff", "z"):
        if outside not in alphabet:
            with pytest.raises(ValueError, match="is not in the model's vocabulary"):
                vocabulary.ids(text[:7] + outside)


def test_character_ids_are_streamed_to_token_files_as_encoding_the_whole_text(tmp_path,
                                                                             monkeypatch):
    """The task's character ids (memory-mapped token files, written in chunks) equal encoding each
    split whole (nanoGPT's shakespeare_char preparation), for a text of CR LF lines and non-ASCII
    characters cut into many chunks; a resumed run reuses the files, a changed text remakes them."""
    from aiayn.data import chunked_encoding

    monkeypatch.setattr(chunked_encoding, "CHUNK_CHARACTERS", 50)
    monkeypatch.setattr(chunked_encoding, "CHUNKS_PER_BATCH", 3)
    path = tmp_path / "t.txt"
    path.write_bytes(("Früh:\r\n  Gruß — 東京 😀\r\n\r\n" + TEXT).encode("utf-8") * 3)
    text = read_text(path)
    reference = CharVocabulary.from_text(text)
    train, valid = split_text(text, 0.25)
    run_dir = tmp_path / "run"
    task = LanguageModelTask(path, valid_fraction=0.25, run_dir=run_dir)
    assert task.vocabulary.symbols == reference.symbols and "\r" not in task.vocabulary.symbols
    assert isinstance(task.train_ids, np.memmap) and task.train_ids.dtype == np.uint16
    assert task.train_ids.tolist() == reference.encode(train)
    assert task.valid_ids.tolist() == reference.encode(valid)
    in_memory = LanguageModelTask(path, valid_fraction=0.25)  # no run directory
    assert in_memory.valid_ids.tolist() == reference.encode(valid)
    made = (run_dir / "tokens" / "train.bin").stat().st_mtime_ns
    again = LanguageModelTask(path, valid_fraction=0.25, run_dir=run_dir)
    assert (run_dir / "tokens" / "train.bin").stat().st_mtime_ns == made
    assert again.train_ids.tolist() == task.train_ids.tolist()
    path.write_text(TEXT, encoding="utf-8")
    changed = LanguageModelTask(path, valid_fraction=0.25, run_dir=run_dir)
    assert changed.valid_ids.tolist() == CharVocabulary.from_text(TEXT).encode(
        split_text(TEXT, 0.25)[1])


@pytest.mark.parametrize("where", ["train", "valid", "cut"])
def test_a_character_outside_a_fine_tuned_vocabulary_is_reported_at_its_line(tmp_path,
                                                                             monkeypatch, where):
    """Fine-tuning a character model on a text with a new character names the file, the line and
    the column, wherever the chunks fall: deep in training, in the validation split, or in the
    line the split cuts, after the cut."""
    from aiayn.data import chunked_encoding
    from aiayn.tasks.pretrained import PretrainedModel

    monkeypatch.setattr(chunked_encoding, "CHUNK_CHARACTERS", 40)
    monkeypatch.setattr(chunked_encoding, "CHUNKS_PER_BATCH", 2)
    lines = TEXT.splitlines(keepends=True)
    column = 6
    if where == "cut":  # the line holding the first validation character, past it
        cut, seen = int((len(TEXT) + 1) * 0.9), 0
        number = next(n for n, line in enumerate(lines, 1) if (seen := seen + len(line)) > cut)
        column = cut - (seen - len(lines[number - 1])) + 3
        assert 1 < column < len(lines[number - 1])
    else:
        number = len(lines) - 2 if where == "valid" else 37
    lines[number - 1] = lines[number - 1][:column - 1] + "Z" + lines[number - 1][column - 1:]
    path = tmp_path / "z.txt"
    path.write_text("".join(lines), encoding="utf-8")
    pretrained = PretrainedModel(config=None, weights={}, tokenizer=CharVocabulary.from_text(TEXT),
                                 source="a run")
    with pytest.raises(ValueError, match=rf"z.txt:{number}: character 'Z' is not in the model's "
                                         rf"vocabulary of \d+ characters \(column {column}\)"):
        LanguageModelTask(path, pretrained=pretrained)


def test_split_is_first_ninety_and_last_ten_percent():
    train, valid = split_text("abcdefghij" * 10)
    assert len(train) == 90 and len(valid) == 10 and train + valid == "abcdefghij" * 10
    with pytest.raises(ValueError, match="valid_fraction"):
        split_text("abc", 1.0)


def test_random_blocks_are_windows_with_targets_shifted_by_one():
    ids = torch.arange(100)
    generator = torch.Generator().manual_seed(0)
    batches = list(random_blocks(ids, block_size=8, batch_size=3, batches=4, generator=generator))
    assert len(batches) == 4
    for x, y in batches:
        assert x.shape == y.shape == (3, 8)
        assert torch.equal(y, x + 1)  # ids are their positions: contiguous windows
        assert (x[:, 1:] - x[:, :-1] == 1).all()


def test_contiguous_blocks_predict_every_target_exactly_once():
    ids = torch.arange(53)
    targets = [t for _, y in contiguous_blocks(ids, block_size=8, batch_size=2)
               for t in y.flatten().tolist()]
    assert targets == list(range(1, 53))
    with pytest.raises(ValueError, match="the evaluation text has 5 tokens, shorter than the "
                                         "context of 8"):
        list(contiguous_blocks(torch.arange(5), block_size=8, batch_size=2))


def test_evaluate_ids_equals_the_mean_loss_over_all_targets():
    torch.manual_seed(0)
    model = CausalLM(TransformerConfig.preset("baby-gpt", vocab_size=11, d_model=16, n_heads=2,
                                              d_ff=32, n_decoder_layers=1, max_length=8)).eval()
    ids = torch.randint(11, (30,))
    metrics = evaluate_ids(model, ids, block_size=8, batch_size=2)
    losses = []
    with torch.no_grad():
        for start in range(0, 29, 8):  # the same blocks, one at a time
            x, y = ids[start:start + 8][: 29 - start], ids[start + 1:start + 9]
            logits = model(x.unsqueeze(0))[0]
            losses += torch.nn.functional.cross_entropy(logits, y, reduction="none").tolist()
    assert len(losses) == 29 and metrics["tokens"] == 29
    assert metrics["loss"] == pytest.approx(sum(losses) / 29, rel=1e-6)
    assert metrics["bpc"] == pytest.approx(metrics["loss"] / math.log(2))
    assert metrics["ppl"] == pytest.approx(math.exp(metrics["loss"]))


# --- the task ------------------------------------------------------------------------------------
def test_task_sets_vocabulary_and_context_and_rejects_short_text(text_file, tmp_path):
    task = LanguageModelTask(text_file, batch_size=4, block_size=16, seed=3)
    config = task.model_config(TransformerConfig.preset("baby-gpt"))
    assert config.vocab_size == len(set(TEXT)) and config.max_length == 16
    first = [x for x, _ in task.train_batches(0)]
    again = [x for x, _ in task.train_batches(0)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))  # deterministic per epoch
    assert not torch.equal(first[0], next(iter(task.train_batches(1)))[0])
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be.\n" * 3, encoding="utf-8")
    with pytest.raises(ValueError, match="validation part of .*short.txt.* shorter than the "
                                         "context of 16"):
        LanguageModelTask(short, block_size=16).model_config(TransformerConfig.preset("baby-gpt"))
    for field in ("block_size", "batches_per_epoch"):  # 0 is not "unset"
        with pytest.raises(ValueError, match=f"{field} must be a positive integer, got 0"):
            LanguageModelTask(text_file, **{field: 0})


def test_baby_gpt_preset_is_nanogpts_baby_gpt():
    config = TransformerConfig.preset("baby-gpt", vocab_size=65)
    model = CausalLM(config)
    # nanoGPT prints "number of parameters: 0.80M" for this model (its count leaves out the
    # position table): 4 * (3*128*128 + 128*128 + 2*128*512 + 2*128) + 65*128 + 128 = 795,904.
    assert count_parameters(model) - 64 * 128 == 795_904
    assert all("bias" not in name for name, _ in model.named_parameters())
    assert model.lm_head.weight is model.decoder.embeddings.tokens.weight
    out_std = torch.stack([layer.self_attention.out_proj.weight.std()
                           for layer in model.decoder.layers])
    assert torch.allclose(out_std, torch.full_like(out_std, 0.02 / 8 ** 0.5), rtol=0.1)


# --- the command line ----------------------------------------------------------------------------
@pytest.mark.parametrize("options, preset, lr", [
    ([], "char-gpt", 3e-3),                                 # the tuned default
    (["--preset", "baby-gpt"], "baby-gpt", 1e-3),           # nanoGPT's exact recipe
    (["--preset", "char-gpt", "--lr", "5e-4"], "char-gpt", 5e-4),  # an explicit --lr wins
    (["--preset", "tiny"], "tiny", 1e-3),
])
def test_train_lm_peak_learning_rate_follows_the_preset(text_file, tmp_path, options, preset, lr):
    from aiayn.cli import build_parser
    from aiayn.commands import train_lm

    args = build_parser().parse_args(["train", "lm", "--data", str(text_file),
                                      "--out", str(tmp_path / "run"), *options])
    train_lm.make_task(args)
    assert (args.preset, args.lr) == (preset, lr)


@pytest.mark.parametrize("options, expected", [
    ([], dict(lr=3e-3, betas=(0.9, 0.99), warmup=100, min_lr=1e-4, steps=2000, eval_every=500)),
    (["--preset", "gpt2"],  # nanoGPT's config/train_gpt2.py
     dict(lr=6e-4, betas=(0.9, 0.95), warmup=2000, min_lr=6e-5, steps=600_000, eval_every=1000)),
    (["--preset", "gpt2", "--steps", "10", "--betas", "0.9", "0.99", "--min-lr", "0"],
     dict(lr=6e-4, betas=(0.9, 0.99), warmup=2000, min_lr=0.0, steps=10, eval_every=1000)),
])
def test_train_lm_recipe_follows_the_preset_where_options_are_not_given(text_file, tmp_path,
                                                                        options, expected):
    from aiayn.cli import build_parser
    from aiayn.commands import train_lm

    args = build_parser().parse_args(["train", "lm", "--data", str(text_file),
                                      "--out", str(tmp_path / "run"), *options])
    train_lm.make_task(args)
    got = {key: tuple(value) if key == "betas" else value
           for key, value in vars(args).items() if key in expected}
    assert got == expected


def test_gpt2_preset_is_nanogpts_gpt2_small(monkeypatch):
    """The same parameters as nanoGPT's model.py at its train_gpt2.py settings (124.37M)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "nanogpt", Path(__file__).resolve().parents[1] / "benchmarks" / "nanogpt.py")
    nanogpt = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "nanogpt", nanogpt)  # its dataclass looks itself up there
    spec.loader.exec_module(nanogpt)
    with torch.device("meta"):
        ours = CausalLM(TransformerConfig.preset("gpt2"))
        theirs = nanogpt.GPT(nanogpt.NanoConfig())
    shapes = sorted(tuple(p.shape) for p in ours.parameters())
    assert shapes == sorted(tuple(p.shape) for p in theirs.parameters())
    assert count_parameters(ours) == 124_373_760


def test_char_gpt_is_the_baby_gpt_network():
    assert TransformerConfig.preset("char-gpt") == TransformerConfig.preset("baby-gpt")


def test_train_generate_evaluate_end_to_end(text_file, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "lm", "--data", str(text_file), "--out", str(run_dir), "--steps", "6",
                 "--eval-every", "3", "--save-every", "3", *TINY]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["task"] == "lm" and summary["step"] == 6 and summary["bpc"] > 0
    info = json.loads((run_dir / "run.json").read_text())
    assert info["task"] == "lm" and info["model_config"]["max_length"] == 16
    assert info["training_config"]["decay_matrices_only"] is True
    assert info["training_config"]["optimizer"] == "adamw"
    state = json.loads((run_dir / "checkpoints" / "step-6" / "trainer_state.json").read_text())
    groups = state["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]  # decay on matrices only

    assert main(["generate", str(run_dir), "--prompt", "First", "--max-new-tokens", "40",
                 "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("First") and len(out) == len("First") + 40 + 1
    assert main(["generate", str(run_dir), "--prompt", "First", "--max-new-tokens", "40",
                 "--seed", "1"]) == 0
    assert capsys.readouterr().out == out  # same seed, same text

    assert main(["evaluate", str(run_dir), "--data", str(text_file)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["task"] == "lm" and result["tokens"] == len(TEXT) - 1
    assert result["bpc"] == pytest.approx(result["loss"] / math.log(2))
    assert main(["evaluate", str(run_dir), "--data", str(text_file), "--split", "valid"]) == 0
    valid = json.loads(capsys.readouterr().out)
    assert valid["loss"] == pytest.approx(summary["loss"], rel=1e-5)  # what training reported



def test_evaluate_splits_the_text_as_the_run_did(text_file, tmp_path, capsys):
    """--split valid / train follow the run's --valid-fraction; a split plain text lacks is an
    error, not the whole file under another name."""
    run_dir = tmp_path / "run"
    assert main(["train", "lm", "--data", str(text_file), "--out", str(run_dir), "--steps", "2",
                 "--eval-every", "2", "--save-every", "0", "--valid-fraction", "0.3", *TINY]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    train_text, valid_text = split_text(TEXT, 0.3)
    results = {}
    for split in ("valid", "train", "all"):
        assert main(["evaluate", str(run_dir), "--data", str(text_file), "--split", split]) == 0
        results[split] = json.loads(capsys.readouterr().out)
        assert results[split]["split"] == split
    assert results["valid"]["loss"] == pytest.approx(summary["loss"], rel=1e-5)
    assert results["valid"]["tokens"] == len(valid_text) - 1
    assert results["train"]["tokens"] == len(train_text) - 1
    assert results["all"]["tokens"] == len(TEXT) - 1
    assert main(["evaluate", str(run_dir), "--data", str(text_file), "--split", "test"]) == 1
    assert "plain text has no 'test' split" in capsys.readouterr().err

def test_generate_options_stop_strings_long_prompts_and_batches(text_file, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "lm", "--data", str(text_file), "--out", str(run_dir), "--steps", "2",
                 "--eval-every", "0", "--save-every", "0", *TINY]) == 0
    capsys.readouterr()
    assert main(["generate", str(run_dir), "--prompt", "All", "--greedy", "--max-new-tokens",
                 "60"]) == 0
    free = capsys.readouterr().out[len("All"):-1]
    stop = free[5:7]
    assert main(["generate", str(run_dir), "--prompt", "All", "--greedy", "--max-new-tokens", "60",
                 "--stop", stop]) == 0
    assert capsys.readouterr().out == "All" + free[:free.index(stop)] + "\n"

    long_prompt = "speak " * 10  # 60 characters, context 16
    assert main(["generate", str(run_dir), "--prompt", long_prompt, "--greedy",
                 "--max-new-tokens", "5"]) == 0
    captured = capsys.readouterr()
    assert "warning: prompt 1 has 60 characters" in captured.err
    assert "keeping its last 16" in captured.err

    assert main(["generate", str(run_dir), "--prompt", "All", "--prompt", "First Citizen",
                 "--greedy", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "=== 'All'" in out and "=== 'First Citizen'" in out

    assert main(["generate", str(run_dir), "--chat", "Hello"]) == 1  # characters: no template
    assert "--chat needs a Hugging Face tokenizer with a chat template" in capsys.readouterr().err

    assert main(["generate", str(run_dir), "--prompt", "", "--max-new-tokens", "3"]) == 1
    assert "prompt 1 is empty; leave out --prompt to start from a newline" in \
        capsys.readouterr().err
    assert main(["generate", str(run_dir), "--prompt", "Zebra", "--max-new-tokens", "3"]) == 1
    assert "character 'Z' is not in the model's vocabulary" in capsys.readouterr().err
    assert main(["generate", str(run_dir), "--prompt", "All", "--max-new-tokens", "30",
                 "--no-slide"]) == 1
    refused = capsys.readouterr()
    assert "past the cache capacity" in refused.err and refused.out == ""  # not even the prompt


@pytest.mark.slow  # compiles the decoding step (seconds)
def test_generate_compile_option_prints_the_eager_text(text_file, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", "lm", "--data", str(text_file), "--out", str(run_dir), "--steps", "2",
                 "--eval-every", "0", "--save-every", "0", *TINY]) == 0
    capsys.readouterr()
    outputs = []
    for extra in ([], ["--compile"]):
        assert main(["generate", str(run_dir), "--prompt", "All", "--greedy", "--max-new-tokens",
                     "12", "--no-stream", *extra]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[1] == outputs[0] and len(outputs[0]) > len("All\n")


def test_train_lm_reports_bad_data_clearly(tmp_path, capsys):
    (tmp_path / "bin.txt").write_bytes(b"abc\n\xff\xfe\n")
    assert main(["train", "lm", "--data", str(tmp_path / "bin.txt"), "--out",
                 str(tmp_path / "r"), *TINY]) == 1
    assert "bin.txt:2: not UTF-8" in capsys.readouterr().err
    assert main(["train", "lm", "--data", str(tmp_path / "nope.txt"), "--out",
                 str(tmp_path / "r"), *TINY]) == 1
    assert "text file not found" in capsys.readouterr().err


@pytest.mark.slow  # a fresh interpreter: a few seconds idle, much more on a loaded machine
def test_generate_streams_through_the_real_command(text_file, tmp_path):
    run_dir = tmp_path / "run"
    assert main(["train", "lm", "--data", str(text_file), "--out", str(run_dir), "--steps", "1",
                 "--eval-every", "0", "--save-every", "0", *TINY]) == 0
    done = subprocess.run([sys.executable, "-m", "aiayn", "generate", str(run_dir), "--prompt",
                           "All", "--max-new-tokens", "10", "--seed", "3"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("All") and len(done.stdout) == 3 + 10 + 1
