"""``aiayn train translation|lm --init DIR``: fine-tuning a checkpoint keeps its tokenizer and
vocabulary, and the run directory then works with every command; what the run prints equals what
``transformers`` prints for the fine-tuned weights exported with the checkpoint's tokenizer."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

import aiayn
import checkpoint_builders as builders
from aiayn.cli import main
from aiayn.training.run import load_run

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentencepiece")
pytestmark = pytest.mark.usefixtures("one_thread")

FAST = ["--threads", "1", "--no-progress", "--steps", "3", "--eval-every", "3", "--save-every",
        "3", "--log-every", "1"]
SENTENCES = ["This package contains the documentation.", "Command-line tools for audio files"]


def run_cli(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiayn", *args], capture_output=True,
                          input=stdin.encode() if stdin is not None else None, check=False)


def export(run_dir, destination):
    """The run's weights as an HF checkpoint with the tokenizer files the run kept."""
    aiayn.save_pretrained(load_run(run_dir).model, destination)
    for path in (run_dir / "pretrained_tokenizer").iterdir():
        shutil.copyfile(path, destination / path.name)
    return destination


@pytest.fixture(scope="module")
def translation_data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "pairs.tsv"
    path.write_text("en\tde\n" + "".join(f"{en}\t{de}\n" for en, de in builders.pairs(80)),
                    encoding="utf-8")
    return path


@pytest.mark.parametrize("family", ["marian", "bart"])
def test_train_translation_from_a_checkpoint_keeps_its_tokenizer(family, translation_data,
                                                                  tmp_path, capsys):
    from test_checkpoint_commands import hf_greedy_translations

    checkpoint = getattr(builders, family)(tmp_path / family)
    out = tmp_path / "run"
    assert main(["train", "translation", "--data", str(translation_data), "--out", str(out),
                 "--init", str(checkpoint), "--valid-bleu-sentences", "2", "--lr-factor", "5",
                 *FAST]) == 0
    info = json.loads((out / "run.json").read_text())
    assert info["assets"]["tokenizer"] == "pretrained_tokenizer"
    assert info["assets"]["init"] == f"hugging face {checkpoint}"
    config = json.loads((checkpoint / "config.json").read_text())
    assert info["model_config"]["src_vocab_size"] == config["vocab_size"]
    assert info["model_config"]["pad_id"] == config["pad_token_id"]
    tuned = load_run(out).model.state_dict()
    start = aiayn.from_pretrained(checkpoint).state_dict()
    assert any(not torch.equal(tuned[name], start[name]) for name in start)  # it trained
    result = run_cli("translate", str(out), "--beam", "1", "--threads", "1",
                     stdin="".join(s + "\n" for s in SENTENCES))
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().splitlines() == hf_greedy_translations(
        export(out, tmp_path / "exported"), SENTENCES)
    capsys.readouterr()
    assert main(["evaluate", str(out), "--data", str(translation_data), "--beam", "1",
                 "--limit", "3"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["sentences"] == 3
    # an aiayn run starts a fine-tuning just as well, with the tokenizer it kept
    again = tmp_path / "again"
    assert main(["train", "translation", "--data", str(translation_data), "--out", str(again),
                 "--init", str(out), "--valid-bleu-sentences", "2", *FAST]) == 0
    assert json.loads((again / "run.json").read_text())["assets"]["init"] == f"aiayn run {out}"
    assert (again / "pretrained_tokenizer" / "tokenizer_config.json").is_file()


def test_train_lm_from_gpt2_keeps_its_tokenizer(tmp_path, capsys):
    checkpoint = builders.gpt2(tmp_path / "gpt2")
    text = tmp_path / "text.txt"
    text.write_text(builders.shakespeare(20_000), encoding="utf-8")
    out = tmp_path / "run"
    assert main(["train", "lm", "--data", str(text), "--out", str(out), "--init",
                 str(checkpoint), "--block-size", "32", "--batch-size", "4", *FAST]) == 0
    info = json.loads((out / "run.json").read_text())
    assert info["assets"]["kind"] == "pretrained"
    assert info["model_config"]["max_length"] == 64  # the checkpoint's positions, kept
    exported = export(out, tmp_path / "exported")
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    prompt = "KING: "
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                   max_new_tokens=20, min_new_tokens=0,
                                   pad_token_id=model.config.eos_token_id)
    result = run_cli("generate", str(out), "--prompt", prompt, "--greedy", "--max-new-tokens",
                     "20", "--threads", "1")
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode() == prompt + tokenizer.decode(generated[0, ids.shape[1]:],
                                                               skip_special_tokens=True) + "\n"
    capsys.readouterr()
    assert main(["evaluate", str(out), "--data", str(text), "--split", "valid"]) == 0
    assert "bits_per_token" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main(["attention", str(out), "--text", "KING: what", "--out",
                 str(tmp_path / "maps"), "--dpi", "40"]) == 0


def test_init_errors_name_the_directory(tmp_path, translation_data, capsys):
    checkpoint = builders.gpt2(tmp_path / "gpt2")
    assert main(["train", "translation", "--data", str(translation_data), "--out",
                 str(tmp_path / "r"), "--init", str(checkpoint), *FAST]) == 1
    assert "--init: " in capsys.readouterr().err
    text = tmp_path / "text.txt"
    text.write_text(builders.shakespeare(5_000), encoding="utf-8")
    assert main(["train", "lm", "--data", str(text), "--out", str(tmp_path / "r2"), "--init",
                 str(checkpoint), "--block-size", "100", *FAST]) == 1
    assert "--block-size 100 exceeds the pretrained model's context of 64" in \
        capsys.readouterr().err
