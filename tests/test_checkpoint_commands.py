"""Every command on a Hugging Face checkpoint directory prints what ``transformers`` computes with the
same checkpoint and its own tokenizer (small checkpoints built offline: tests/checkpoint_builders.py)."""

import json
import math
import subprocess
import sys

import pytest
import torch

import checkpoint_builders as builders
from aiayn.cli import main

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCES = ["This package contains the documentation.", "Command-line tools for audio files",
             "Dieses Paket enthält die Dokumentation."]
TEXTS = ["network proxy server for http clients", "audio player with a mixer",
         "a chess game with a board and puzzles"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {"marian": builders.marian(root / "marian"), "bart": builders.bart(root / "bart"),
            "gpt2": builders.gpt2(root / "gpt2"),
            "bert": builders.bert_classifier(root / "bert", TEXTS * 3)}


def run_cli(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiayn", *args], capture_output=True,
                          input=stdin.encode() if stdin is not None else None, check=False)


def hf_greedy_translations(directory, sentences, *, max_extra=50):
    """MarianMTModel / BartForConditionalGeneration ``generate`` (greedy) + the tokenizer's decode,
    with the limits aiayn's greedy search keeps: source length + 50 positions, </s> forced at the
    last, padding never generated."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
    config = model.config
    outputs = []
    for sentence in sentences:
        ids = torch.tensor([tokenizer(sentence)["input_ids"]])
        with torch.no_grad():
            generated = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                max_new_tokens=min(ids.shape[1] + max_extra, config.max_position_embeddings),
                min_new_tokens=0, forced_eos_token_id=config.eos_token_id,
                bad_words_ids=[[config.pad_token_id]], no_repeat_ngram_size=0,
                repetition_penalty=1.0, forced_bos_token_id=None)
        outputs.append(tokenizer.decode(generated[0], skip_special_tokens=True))
    return outputs


@pytest.mark.parametrize("family", ["marian", "bart"])
def test_translate_prints_what_transformers_generate_and_decode_print(checkpoints, family):
    result = run_cli("translate", str(checkpoints[family]), "--beam", "1", "--threads", "1",
                     stdin="".join(s + "\n" for s in SENTENCES))
    assert result.returncode == 0, result.stderr.decode()
    printed = result.stdout.decode().splitlines()
    expected = hf_greedy_translations(checkpoints[family], SENTENCES)
    assert printed == expected
    assert len(printed) == 3 and all(printed)  # outputs, not empty lines


def test_evaluate_scores_a_marian_checkpoint(checkpoints, tmp_path, capsys):
    data = tmp_path / "pairs.tsv"
    data.write_text("".join(f"{en}\t{de}\n" for en, de in builders.pairs(5)), encoding="utf-8")
    assert main(["evaluate", str(checkpoints["marian"]), "--data", str(data), "--beam", "1",
                 "--output", str(tmp_path / "out.txt")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["sentences"] == 5 and result["bleu"] >= 0.0
    written = (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines()
    assert written == hf_greedy_translations(checkpoints["marian"], [en for en, _ in
                                                                       builders.pairs(5)])


def test_generate_prints_what_gpt2_generate_and_decode_print(checkpoints):
    directory = checkpoints["gpt2"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    prompt = "ROMEO: what light"
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   num_beams=1, max_new_tokens=30, min_new_tokens=0,
                                   pad_token_id=model.config.eos_token_id)
    expected = prompt + tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True)
    for stream in ([], ["--no-stream"]):
        result = run_cli("generate", str(directory), "--prompt", prompt, "--greedy",
                         "--max-new-tokens", "30", "--threads", "1", *stream)
        assert result.returncode == 0, result.stderr.decode()
        assert result.stdout.decode() == expected + "\n"


def test_evaluate_a_gpt2_checkpoint_matches_its_transformers_loss(checkpoints, tmp_path, capsys):
    directory = checkpoints["gpt2"]
    text = builders.shakespeare(3000)
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    assert main(["evaluate", str(directory), "--data", str(path), "--split", "all"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    ids = torch.tensor(tokenizer(text)["input_ids"])
    context = model.config.n_positions  # contiguous blocks of the context, every target once
    total, count = 0.0, 0
    for start in range(0, ids.numel() - 1, context):
        block = ids[start:start + context + 1]
        with torch.no_grad():
            logits = model(block[:-1][None]).logits[0]  # (T, V)
        total += torch.nn.functional.cross_entropy(logits, block[1:], reduction="sum").item()
        count += block.numel() - 1
    assert result["tokens"] == count
    assert result["loss"] == pytest.approx(total / count, abs=1e-4)
    assert result["bits_per_token"] == pytest.approx(total / count / math.log(2), abs=1e-4)
    # Bits per character: over the characters of every token but the first (never predicted).
    characters = len(text) - len(tokenizer.decode(ids[:1]))
    assert result["bpc"] == pytest.approx(total / math.log(2) / characters, rel=1e-5)


def test_classify_and_evaluate_a_bert_classifier_checkpoint(checkpoints, tmp_path, capsys):
    directory = checkpoints["bert"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.no_grad():
        probabilities = model(**tokenizer(TEXTS, padding=True, return_tensors="pt")
                              ).logits.softmax(-1)
    result = run_cli("classify", str(directory), *[a for t in TEXTS for a in ("--text", t)])
    assert result.returncode == 0, result.stderr.decode()
    rows = [line.split("\t") for line in result.stdout.decode().splitlines()]
    assert [row[0] for row in rows] == [builders.LABELS[i] for i in probabilities.argmax(-1)]
    for row, expected in zip(rows, probabilities.max(-1).values.tolist()):
        assert float(row[1]) == pytest.approx(expected, abs=6e-5)
    data = tmp_path / "labelled.tsv"
    data.write_text("text\tlabel\n" + "".join(f"{t}\t{label}\n" for t, label in
                                              zip(TEXTS, builders.LABELS[::-1])), encoding="utf-8")
    assert main(["evaluate", str(directory), "--data", str(data), "--split", "all"]) == 0
    scored = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    right = sum(builders.LABELS[i] == label
                for i, label in zip(probabilities.argmax(-1), builders.LABELS[::-1]))
    assert scored["rows"] == 3 and scored["accuracy"] == pytest.approx(right / 3)
    assert not (directory / "evaluation").exists()  # nothing written into a checkpoint


@pytest.mark.parametrize("family", ["marian", "bart", "gpt2", "bert"])
def test_attention_on_each_checkpoint_uses_its_tokenizer(checkpoints, family, tmp_path, capsys):
    out = tmp_path / family
    # A given target for the translation checkpoints: their random weights translate to the length
    # limit, and drawing the ~80 x 80 decoder head with a number in each cell takes ~40 s.
    target = ["--target", SENTENCES[2]] if family in ("marian", "bart") else []
    assert main(["attention", str(checkpoints[family]), "--text", SENTENCES[0], *target,
                 "--out", str(out), "--dpi", "40"]) == 0
    assert "the checkpoint's tokenizer" in capsys.readouterr().out
    assert (out / "metrics.json").is_file()


def test_commands_refuse_a_checkpoint_of_another_task_or_without_a_tokenizer(checkpoints,
                                                                              tmp_path, capsys):
    assert main(["translate", str(checkpoints["gpt2"])]) == 1
    assert "is a Hugging Face checkpoint for 'lm', not 'translation'" in capsys.readouterr().err
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((checkpoints["gpt2"] / name).read_bytes())
    assert main(["generate", str(bare), "--prompt", "x"]) == 1
    assert "no tokenizer files" in capsys.readouterr().err
    assert main(["classify", str(tmp_path), "--text", "x"]) == 1
    assert "nor a Hugging Face checkpoint directory" in capsys.readouterr().err
