"""The ``llama-char`` preset of ``aiayn train lm``: Llama's decoder at char-gpt's sizes and recipe,
trained, sampled and evaluated through the command line (tiny here; docs/modern-decoder.md has the
Shakespeare run)."""

from __future__ import annotations

import json

import pytest

from aiayn import CausalLM, TransformerConfig, count_parameters
from aiayn.cli import build_parser, main

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
        "First Citizen:\nYou are all resolved rather to die than to famish?\n\n") * 12


def test_llama_char_is_char_gpt_with_the_four_changes():
    llama, gpt = TransformerConfig.preset("llama-char"), TransformerConfig.preset("char-gpt")
    changed = {name for name, value in llama.to_dict().items() if gpt.to_dict()[name] != value}
    assert changed == {"positions", "norm", "gated_ffn", "activation", "d_ff", "n_kv_heads"}
    llama_model, gpt_model = CausalLM(llama), CausalLM(gpt)
    assert all("bias" not in name for name, _ in llama_model.named_parameters())
    # SwiGLU's three (D, 344) matrices ~ GPT's two (D, 512); 2 KV heads of 4 and no position table
    # make the rest of the difference
    ffn = lambda model: count_parameters(model.decoder.layers[0].feedforward)  # noqa: E731
    assert abs(ffn(llama_model) - ffn(gpt_model)) / ffn(gpt_model) < 0.01
    assert count_parameters(llama_model) < count_parameters(gpt_model)


def test_llama_char_takes_char_gpts_learning_rate(tmp_path):
    from aiayn.commands import train_lm

    text_file = tmp_path / "tiny.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    args = build_parser().parse_args(["train", "lm", "--data", str(text_file), "--out",
                                      str(tmp_path / "run"), "--preset", "llama-char"])
    train_lm.make_task(args)
    assert args.lr == train_lm.PEAK_LR["char-gpt"] == 3e-3


def test_train_and_generate_from_the_command_line(tmp_path, capsys):
    text_file = tmp_path / "tiny.txt"
    text_file.write_text(TEXT, encoding="utf-8")
    run_dir = tmp_path / "run"
    assert main(["train", "lm", "--data", str(text_file), "--out", str(run_dir), "--steps", "4",
                 "--eval-every", "4", "--save-every", "4", "--preset", "llama-char",
                 "--set", "n_decoder_layers=1", "--block-size", "16", "--batch-size", "4",
                 "--threads", "1", "--no-progress"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["task"] == "lm" and summary["step"] == 4
    info = json.loads((run_dir / "run.json").read_text())
    assert info["model_config"]["positions"] == "rotary" and info["model_config"]["n_kv_heads"] == 2
    assert main(["generate", str(run_dir), "--prompt", "First", "--prompt", "All",
                 "--max-new-tokens", "30", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "=== 'First'" in out and "=== 'All'" in out
    assert main(["evaluate", str(run_dir), "--data", str(text_file), "--split", "valid"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(summary["loss"], rel=1e-5)
