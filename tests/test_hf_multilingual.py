"""The multilingual translation checkpoints: M2M100 / NLLB-200 (``M2M100ForConditionalGeneration``)
and mBART / mBART-50 (``MBartForConditionalGeneration``), built from small configs with random
weights, against transformers: logits, cached decoding, greedy and beam ``generate`` with a forced
target language code, the NLLB / mBART-50 tokenizers' source format, ``aiayn translate`` /
``aiayn evaluate`` with ``--src-lang`` / ``--tgt-lang``, and ``save_pretrained`` round trips."""

import io
import json
import re
import shutil
import sys

import pytest
import torch

import aiayn
from aiayn.decoding import beam as beam_module
from aiayn.decoding.greedy import greedy_search
from hf_helpers import max_diff_where, padded_ids, randomise

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-4
PAD, EOS = 1, 2
CODES = ["eng_Latn", "fra_Latn", "deu_Latn"]
MBART_CODES = ["en_XX", "fr_XX", "de_DE"]
CORPUS = ["the cat sat on the mat", "le chat est sur le tapis", "die katze sitzt auf der matte",
          "a dog and a cat"]
COMMON = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
              max_position_embeddings=80, dropout=0.0)
MAX_EXTRA = 10


def build_hf(kind: str, *, vocab: int = 64, untied: bool = False, **extra):
    """A random M2M100 or mBART model (every norm and bias random; eval mode)."""
    common = dict(COMMON, vocab_size=vocab, tie_word_embeddings=not untied, **extra)
    if kind == "m2m_100":
        model = transformers.M2M100ForConditionalGeneration(transformers.M2M100Config(**common))
    else:
        model = transformers.MBartForConditionalGeneration(
            transformers.MBartConfig(scale_embedding=True, decoder_start_token_id=EOS, **common))
    model.eval()
    randomise(model, std=0.3 if untied else 0.2)
    return model


@pytest.fixture(scope="module", params=["m2m_100", "mbart"])
def tied(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = build_hf(request.param)
    hf.save_pretrained(directory)
    return hf, aiayn.from_pretrained(directory), directory


@pytest.mark.parametrize("padding", ["right", "left"])
def test_logits_match_transformers(tied, padding):
    """Padded sources, a teacher-forced target: the logits agree within 1e-4. Under left padding
    M2M100 numbers source positions over the real tokens (``positions_skip_padding``) and mBART
    counts every column, pads too: each as transformers does."""
    hf, ours, _ = tied
    assert ours.config.positions_skip_padding == (hf.config.model_type == "m2m_100")
    source, source_mask = padded_ids(64, [9, 5, 7], pad=PAD, seed=1)
    if padding == "left":
        source, source_mask = source.flip(1), source_mask.flip(1)
    target, target_mask = padded_ids(64, [6, 8, 3], pad=PAD, seed=2)
    target[:, 0] = EOS  # the decoder starts from </s>
    with torch.no_grad():
        want = hf(input_ids=source, attention_mask=source_mask.long(), decoder_input_ids=target,
                  decoder_attention_mask=target_mask.long()).logits
        got = ours(source, target, src_padding_mask=source_mask, tgt_padding_mask=target_mask)
    assert max_diff_where(got, want, target_mask) <= TOLERANCE


def test_cached_steps_equal_the_full_forward(tied):
    _, ours, _ = tied
    source, source_mask = padded_ids(64, [9, 5, 7], pad=PAD, seed=3)
    target = torch.randint(3, 64, (3, 7), generator=torch.Generator().manual_seed(4))
    target[:, 0] = EOS
    with torch.no_grad():
        full = ours(source, target, src_padding_mask=source_mask)
        memory = ours.encode(source, source_mask)
        cache = ours.new_cache(3, 7)
        steps = [ours.decode(target[:, :1], memory, memory_padding_mask=source_mask, cache=cache)]
        steps += [ours.decode(target[:, t:t + 1], None, memory_padding_mask=source_mask,
                              cache=cache) for t in range(1, 7)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_fairseq_positions_are_transformers_table():
    """M2M100's sinusoidal table (tensor2tensor's frequencies, sin | cos, from pad + 1) bit for bit."""
    from transformers.models.m2m_100.modeling_m2m_100 import M2M100SinusoidalPositionalEmbedding

    config = aiayn.TransformerConfig(vocab_size=20, d_model=32, n_heads=4, d_ff=40,
                                     max_length=50, positions="sinusoidal",
                                     sinusoid_layout="fairseq", position_offset=PAD + 1)
    ours = aiayn.models.Transformer(config).encoder.embeddings.positions
    hf = M2M100SinusoidalPositionalEmbedding(50, 32, padding_idx=PAD)
    ids = torch.full((1, 50), 5)
    torch.testing.assert_close(ours(50), hf(ids)[0], atol=0, rtol=0)


# --- generate --------------------------------------------------------------------------------
def make_eos_reachable(hf, ids, mask, forced: int, scale: float = 1.0) -> None:
    """Random models repeat a few tokens and never end: give </s> the output row of the token
    their greedy outputs of ``ids`` hold most (times ``scale``), so translations end at different
    lengths."""
    with torch.no_grad():
        hf.model.decoder.layer_norm.bias.mul_(0.1)
        out = hf.generate(ids, attention_mask=mask.long(), num_beams=1, do_sample=False,
                          max_new_tokens=12, bad_words_ids=[[PAD]], forced_bos_token_id=forced)
        tokens = out[:, 2:].flatten()
        tokens = tokens[(tokens != EOS) & (tokens != PAD)]
        frequent = int(tokens.mode().values)
        hf.lm_head.weight[EOS] = hf.lm_head.weight[frequent] * scale
        if hasattr(hf, "final_logits_bias"):  # mBART's
            hf.final_logits_bias[0, EOS] = hf.final_logits_bias[0, frequent]


@pytest.fixture(scope="module", params=["m2m_100", "mbart"])
def untied(request, tmp_path_factory):
    """A model with its own output projection whose translations end at different lengths."""
    directory = tmp_path_factory.mktemp(f"{request.param}-untied")
    # the first scale whose beams end early for both alphas; these random models sit near ties,
    # so the search is fine (1.0 itself would tie </s> with the token exactly) and picks, in each
    # run, a model on which the comparison is not empty
    for scale in [round(1.0 - 0.005 * k, 3) for k in range(1, 61)]:
        hf = build_hf(request.param, vocab=60, untied=True)
        make_eos_reachable(hf, *_sources(), forced=58, scale=scale)
        ids, mask = _sources()
        limits = (mask.sum(1) + MAX_EXTRA - 2).tolist()
        if all(any(0 < len(tokens) < limit for tokens, limit in
                   zip(_hf_generate(hf, ids, mask, beams=4, alpha=alpha), limits))
               for alpha in (0.0, 1.0)):
            break
    else:
        raise AssertionError(f"no {request.param} model among the scales ends a beam early")
    hf.save_pretrained(directory)
    return hf, aiayn.from_pretrained(directory)


def _sources():
    """Four right-padded rows: [lang] tokens </s>, lengths 5 .. 8 (B, 8) and their mask."""
    ids, mask = padded_ids(56, [5, 6, 7, 8], pad=PAD, seed=7, low=4)
    lengths = mask.sum(1)
    ids[:, 0] = 57  # a source language code
    ids[torch.arange(4), lengths - 1] = EOS
    return ids, mask


def _hf_generate(hf, ids, mask, *, beams: int, alpha: float = 0.0):
    """transformers' generate, row by row (each with aiayn's limit: its length + MAX_EXTRA
    tokens, the forced code and </s> included), </s> forced at the last, pad never generated."""
    outputs = []
    for row, row_mask in zip(ids, mask):
        source = row[row_mask].unsqueeze(0)
        options = dict(length_penalty=alpha, early_stopping=True) if beams > 1 else {}
        with torch.no_grad():
            out = hf.generate(source, attention_mask=torch.ones_like(source), num_beams=beams,
                              do_sample=False, max_new_tokens=source.shape[1] + MAX_EXTRA,
                              forced_bos_token_id=58, forced_eos_token_id=EOS,
                              bad_words_ids=[[PAD]], **options)
        assert out[0, :2].tolist() == [EOS, 58]  # decoder start, the forced target code
        tokens = out[0, 2:].tolist()
        outputs.append(tokens[:tokens.index(EOS)] if EOS in tokens else tokens)
    return outputs


def test_greedy_matches_generate_with_forced_bos(untied):
    hf, ours = untied
    ids, mask = _sources()
    got = [h.tokens for h in greedy_search(ours, ids, mask, max_extra=MAX_EXTRA, forced=[58])]
    assert got == _hf_generate(hf, ids, mask, beams=1)


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_beam_matches_generate_with_forced_bos(untied, alpha, monkeypatch):
    """Beam 4; alpha 1 with transformers' length penalty L**alpha swapped in (tests/test_hf_beam.py):
    the forced code scores 0 and counts in L on both sides, so hypotheses rank alike."""
    hf, ours = untied
    monkeypatch.setattr(beam_module, "length_penalty", lambda length, alpha: length ** alpha)
    ids, mask = _sources()
    got = [h.tokens for h in beam_module.beam_search(ours, ids, mask, beam_size=4, alpha=alpha,
                                                     max_extra=MAX_EXTRA, forced=[58])]
    want = _hf_generate(hf, ids, mask, beams=4, alpha=alpha)
    # A hypothesis that reaches the limit ends with </s> forced, which transformers scores 0 and
    # aiayn by its log-probability (tests/test_hf_beam.py): those rows are left out.
    limits = (mask.sum(1) + MAX_EXTRA - 2).tolist()  # output tokens, code and </s> aside
    compared = [(ours_, theirs) for ours_, theirs, limit in zip(got, want, limits)
                if len(theirs) < limit and len(ours_) < limit]
    assert [ours_ for ours_, _ in compared] == [theirs for _, theirs in compared]
    assert sum(len(theirs) > 0 for _, theirs in compared) >= 1, (got, want)


# --- tokenizers and the command line ---------------------------------------------------------
def _tokenizer_json(path, codes, *, unigram: bool):
    """A small SentencePiece-style tokenizer.json as transformers converts NLLB's (BPE) and
    mBART-50's (Unigram), with the language codes as added special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<s>", "<pad>", "</s>", "<unk>"]
    tokenizer = Tokenizer(models.Unigram() if unigram
                          else models.BPE(unk_token="<unk>", fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                       prepend_scheme="always", split=True)
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always",
                                           split=True)
    trainer = (trainers.UnigramTrainer(vocab_size=58, special_tokens=specials, unk_token="<unk>",
                                       show_progress=False) if unigram
               else trainers.BpeTrainer(vocab_size=58, special_tokens=specials,
                                        show_progress=False))
    tokenizer.train_from_iterator(CORPUS * 5, trainer)
    tokenizer.add_special_tokens(codes + ["<mask>"])
    tokenizer.save(str(path))
    return tokenizer.get_vocab_size()


def _hf_tokenizer(kind, directory, scratch):
    """An NllbTokenizerFast's files, written by transformers."""
    _tokenizer_json(scratch / "tokenizer.json", CODES, unigram=False)
    tokenizer = transformers.NllbTokenizerFast(tokenizer_file=str(scratch / "tokenizer.json"),
                                               src_lang=CODES[0], additional_special_tokens=CODES)
    tokenizer.save_pretrained(directory)
    return CODES


@pytest.fixture(scope="module")
def nllb_dir(tmp_path_factory):
    return build_nllb(tmp_path_factory.mktemp("nllb"), tmp_path_factory.mktemp("nllb-scratch"))


def build_nllb(directory, scratch):
    """A small NLLB-like checkpoint: M2M100 weights + an NllbTokenizerFast's files."""
    _hf_tokenizer("nllb", directory, scratch)
    vocab = transformers.AutoTokenizer.from_pretrained(directory).__len__()
    hf = build_hf("m2m_100", vocab=vocab, untied=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, src_lang="eng_Latn")
    batch = tokenizer(CORPUS, padding=True, return_tensors="pt")
    make_eos_reachable(hf, batch["input_ids"], batch["attention_mask"].bool(),
                       forced=tokenizer.convert_tokens_to_ids("fra_Latn"))
    hf.save_pretrained(directory)
    return directory


def test_source_format_matches_nllb_tokenizer(tmp_path):
    """[src_lang] tokens </s>: what NllbTokenizerFast gives, for each code."""
    from aiayn.interop.hf_tokenizer import load_tokenizer
    from aiayn.tasks.checkpoints import Seq2SeqTokenizer

    directory = tmp_path / "tokenizer"
    codes = _hf_tokenizer("nllb", directory, tmp_path)
    texts = ["the cat sat", "le chat xyz sur le tapis", "die katze"]
    ours = Seq2SeqTokenizer(load_tokenizer(directory), directory, eos_id=EOS)
    for code in codes:
        theirs = transformers.AutoTokenizer.from_pretrained(directory, src_lang=code)
        ours.set_languages(code, codes[1], model_type="m2m_100")
        assert [ids + [EOS] for ids in ours.encode(texts)] == theirs(texts)["input_ids"]
        assert list(ours.language_ids.forced) == [theirs.convert_tokens_to_ids(codes[1])]
    assert ours.decode([[codes_id] + ids for codes_id, ids in
                        zip(ours.language_ids.forced * 3, ours.encode(texts))]) == \
        theirs.batch_decode(theirs(texts)["input_ids"], skip_special_tokens=True)


def test_source_format_of_mbart50(tmp_path):
    """mBART-50: [src_lang] tokens </s>, the format MBart50TokenizerFast documents. Compared with
    the format, not the class: transformers 5 rebuilds an mBART-50 vocabulary from a
    SentencePiece-ordered tokenizer.json and appends its 52 codes, which a small tokenizer.json
    made offline does not reproduce."""
    from tokenizers import Tokenizer

    from aiayn.interop.hf_tokenizer import load_tokenizer
    from aiayn.tasks.checkpoints import Seq2SeqTokenizer

    _tokenizer_json(tmp_path / "tokenizer.json", MBART_CODES, unigram=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "MBart50Tokenizer", "src_lang": "en_XX",
         "additional_special_tokens": MBART_CODES}), encoding="utf-8")
    raw = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ours = Seq2SeqTokenizer(load_tokenizer(tmp_path), tmp_path, eos_id=EOS)
    ours.set_languages("fr_XX", "de_DE", model_type="mbart")
    texts = ["the cat sat", "le chat"]
    assert ours.encode(texts) == [[raw.token_to_id("fr_XX")] + raw.encode(
        text, add_special_tokens=False).ids for text in texts]
    assert list(ours.language_ids.forced) == [raw.token_to_id("de_DE")]
    with pytest.raises(ValueError, match=r"'fr' is not a language code of this mBART-50 "
                                         r"tokenizer; it has en_XX, fr_XX, de_DE"):
        ours.set_languages("fr", "de_DE", model_type="mbart")


def _translate(directory, lines, *args, monkeypatch, capsys):
    from aiayn.cli import main

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(lines).encode())))
    code = main(["translate", str(directory), *args])
    captured = capsys.readouterr()
    if code:
        assert re.search(r"aiayn translate: error: ", captured.err)
    return code, captured.out.splitlines()


@pytest.mark.parametrize("beam", [1, 4])
def test_translate_prints_what_generate_and_decode_print(nllb_dir, beam, monkeypatch, capsys):
    lines = ["the cat sat on the mat", "a dog"]
    code, printed = _translate(nllb_dir, lines, "--src-lang", "eng_Latn", "--tgt-lang", "fra_Latn",
                               "--beam", str(beam), "--alpha", "0", monkeypatch=monkeypatch,
                               capsys=capsys)
    assert code == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(nllb_dir, src_lang="eng_Latn")
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(nllb_dir).eval()
    forced = tokenizer.convert_tokens_to_ids("fra_Latn")
    want = []
    for line in lines:
        ids = torch.tensor([tokenizer(line)["input_ids"]])
        options = dict(length_penalty=0.0, early_stopping=True) if beam > 1 else {}
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=beam,
                                 do_sample=False, max_new_tokens=ids.shape[1] + 50,
                                 forced_bos_token_id=forced, forced_eos_token_id=EOS,
                                 bad_words_ids=[[PAD]], **options)
        assert out[0, 1] == forced
        want.append(tokenizer.decode(out[0], skip_special_tokens=True))
    assert printed == want


def test_evaluate_runs_with_language_codes(nllb_dir, tmp_path, capsys):
    from aiayn.cli import main

    (tmp_path / "src.txt").write_text("the cat sat\na dog and a cat\n", encoding="utf-8")
    (tmp_path / "tgt.txt").write_text("le chat\nun chien\n", encoding="utf-8")
    code = main(["evaluate", str(nllb_dir), "--data", str(tmp_path / "src.txt"),
                 str(tmp_path / "tgt.txt"), "--src-lang", "eng_Latn", "--tgt-lang", "deu_Latn",
                 "--beam", "2"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["sentences"] == 2 and "bleu" in result and "chrf" in result


@pytest.mark.parametrize("args, message", [
    ((), r"give --src-lang and --tgt-lang .*eng_Latn, fra_Latn, deu_Latn"),
    (("--src-lang", "eng_Latn"), r"give --tgt-lang \(src_lang / tgt_lang in Python\)"),
    (("--src-lang", "eng_Latn", "--tgt-lang", "xx_Latn"),
     r"--tgt-lang 'xx_Latn' is not a language code of this NLLB tokenizer; it has eng_Latn"),
])
def test_language_code_errors(nllb_dir, args, message, monkeypatch, capsys):
    """The Python API raises; ``aiayn translate`` and ``aiayn evaluate`` say it and exit 1."""
    from aiayn.cli import main
    from aiayn.tasks.checkpoints import load_model_dir, set_languages

    run = load_model_dir(nllb_dir, task="translation")
    values = dict(zip(args[::2], args[1::2]))
    with pytest.raises(ValueError, match=message):
        set_languages(run, values.get("--src-lang"), values.get("--tgt-lang"))
    code, printed = _translate(nllb_dir, ["the cat"], *args, monkeypatch=monkeypatch,
                               capsys=capsys)
    assert code == 1 and printed == []
    data = nllb_dir.parent / "errors.tsv"
    data.write_text("the cat\tle chat\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["evaluate", str(nllb_dir), "--data", str(data), *args]) == 1
    assert re.search(message, capsys.readouterr().err)


def test_codes_for_a_checkpoint_without_them_are_refused(tmp_path):
    """A Marian / BART tokenizer has no language codes: --src-lang is an error, not ignored."""
    from aiayn.interop.hf_languages import LanguageIds, language_codes, language_ids

    directory = tmp_path / "plain"
    directory.mkdir()
    (directory / "tokenizer_config.json").write_text('{"tokenizer_class": "BartTokenizer"}')
    with pytest.raises(ValueError, match=r"--src-lang applies to multilingual checkpoints"):
        language_ids(language_codes(directory), None, "en_XX", None)
    assert language_ids(language_codes(directory), None, None, None) == LanguageIds()


# --- save_pretrained -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["m2m_100", "mbart"])
@pytest.mark.parametrize("untied_head", [False, True], ids=["tied", "untied"])
def test_round_trip(kind, untied_head, tmp_path):
    hf = build_hf(kind, untied=untied_head)
    hf.save_pretrained(tmp_path / "hf")
    ours = aiayn.from_pretrained(tmp_path / "hf")
    aiayn.save_pretrained(ours, tmp_path / "ours")
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert config["model_type"] == kind
    again = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours").eval()
    assert type(again) is type(hf)
    ids = torch.randint(3, 64, (2, 7), generator=torch.Generator().manual_seed(9))
    ids[:, 0] = EOS
    with torch.no_grad():
        want = hf(input_ids=ids, decoder_input_ids=ids).logits
        torch.testing.assert_close(again(input_ids=ids, decoder_input_ids=ids).logits, want,
                                   rtol=0, atol=1e-5)
        torch.testing.assert_close(ours(ids, ids), want, rtol=0, atol=1e-4)
    reloaded = aiayn.from_pretrained(tmp_path / "ours").config
    if untied_head:  # aiayn writes transformers 5's untied layout (separate encoder and decoder
        # matrices); one saved by transformers 4 keeps them shared: the same weights either way
        reloaded = reloaded.replace(tie_source_target=ours.config.tie_source_target)
    assert reloaded == ours.config
    hf_state, again_state = hf.state_dict(), again.state_dict()
    assert hf_state.keys() == again_state.keys()
    if untied_head:  # transformers 5 saves an untied model's unused ``shared``; aiayn drops it
        hf_state.pop("model.shared.weight")
    for name in hf_state:
        torch.testing.assert_close(again_state[name], hf_state[name], rtol=0, atol=0, msg=name)
    shutil.rmtree(tmp_path / "hf")


def test_pre_norm_model_of_neither_layout_is_refused(tmp_path):
    config = aiayn.TransformerConfig(vocab_size=40, d_model=32, n_heads=4, d_ff=40,
                                     n_encoder_layers=1, n_decoder_layers=1, max_length=20,
                                     norm_first=True, positions="sinusoidal")
    with pytest.raises(ValueError, match=r"cannot export as mBART or M2M100"):
        aiayn.save_pretrained(aiayn.models.Transformer(config), tmp_path)
