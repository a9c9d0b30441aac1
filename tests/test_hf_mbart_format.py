"""The language formats where a code goes after the source's </s>: mBART's own tokenizer
(mbart-large-cc25, mbart-large-en-ro: ``tokens </s> [src]``, the decoder starting from ``[tgt]``)
and NLLB's legacy format (``tokens </s> [src]``, the target code forced). Built from a small
tokenizer.json with transformers' ``MBartTokenizer`` / ``NllbTokenizerFast`` and a random
``MBartForConditionalGeneration``, against transformers: the ids, ``generate`` with
``decoder_start_token_id``, fine-tuning batches and loss, and a fine-tuned run's translations."""

import io
import json
import re
import sys

import pytest
import torch

import aiayn
from aiayn.cli import main
from aiayn.data.batching import collate
from hf_helpers import randomise
import test_multilingual_finetuning as finetuning
from test_checkpoint_finetuning import export, run_cli
from test_hf_multilingual import CODES, COMMON, CORPUS, EOS, PAD, build_nllb

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytestmark = pytest.mark.usefixtures("one_thread")

LINES = ["the cat sat on the mat", "a dog", "le chat est sur le tapis"]
pairs_tsv = finetuning.pairs_tsv  # the English-French pairs NLLB is fine-tuned on there


def _mbart_codes():
    from transformers.models.mbart.tokenization_mbart import FAIRSEQ_LANGUAGE_CODES

    return list(FAIRSEQ_LANGUAGE_CODES)


def _unigram_json(path) -> None:
    """A small SentencePiece-style Unigram tokenizer.json (mBART's kind) with fixed pieces and
    scores: the test texts' words and characters (a trained one differs from run to run), then
    mBART's 25 codes and <mask> as added special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    lines = CORPUS + LINES + [text for pair in finetuning.PAIRS for text in pair]
    words = sorted({f"\u2581{word}" for line in lines for word in line.split()})
    characters = sorted({c for line in lines for c in line.replace(" ", "")})
    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(word, -3.0 - 0.01 * index) for index, word in enumerate(words)]
    pieces += [(c, -5.0 - 0.01 * index) for index, c in enumerate(characters)]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=3, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                       prepend_scheme="always", split=True)
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always",
                                           split=True)
    tokenizer.add_special_tokens(_mbart_codes() + ["<mask>"])
    tokenizer.save(str(path))


def build_mbart(directory, scratch):
    """A small mbart-large-cc25-like checkpoint: transformers' ``MBartTokenizer`` files over a
    Unigram tokenizer.json with mBART's 25 codes, and a random mBART whose config starts the
    decoder from </s> (cc25's; ``generate`` is given the target code as decoder start)."""
    _unigram_json(scratch / "tokenizer.json")
    # transformers 4's MBartTokenizer is the SentencePiece one; its Fast one reads tokenizer.json
    fast = getattr(transformers, "MBartTokenizerFast", transformers.MBartTokenizer)
    tokenizer = fast(tokenizer_file=str(scratch / "tokenizer.json"), src_lang="en_XX",
                     tgt_lang="ro_RO")
    tokenizer.save_pretrained(directory)
    with torch.random.fork_rng():  # the position table (randomise leaves it) from a fixed seed
        torch.manual_seed(0)
        hf = transformers.MBartForConditionalGeneration(transformers.MBartConfig(
            scale_embedding=True, decoder_start_token_id=EOS, vocab_size=len(tokenizer),
            tie_word_embeddings=False, **COMMON)).eval()
    randomise(hf, std=0.5)  # outputs that depend on the source
    _end_early(hf, tokenizer)
    hf.save_pretrained(directory)
    return directory


def _end_early(hf, tokenizer) -> None:
    """Random models repeat a few tokens and never end: give </s> the output row (and a little more
    bias) of a token of the test lines' greedy translations (de_DE to fr_XX), the first, by how many
    different steps it first appears at, with which some greedy and some beam-4 translations of
    those lines end before the limit (transformers 4 and 5 build different random models)."""
    tokenizer.src_lang = "de_DE"
    start = tokenizer.convert_tokens_to_ids("fr_XX")
    sources = [tokenizer(line, return_tensors="pt") for line in LINES]

    def outputs(beams: int) -> list[list[int]]:
        options = dict(length_penalty=1.0, early_stopping=True) if beams > 1 else {}
        return [hf.generate(**ids, num_beams=beams, do_sample=False,
                            max_new_tokens=ids["input_ids"].shape[1] + 50,
                            bad_words_ids=[[PAD], [start]], decoder_start_token_id=start,
                            forced_eos_token_id=EOS, **options)[0, 1:].tolist()
                for ids in sources]

    def some_end(rows: list[list[int]]) -> bool:
        return any(EOS in row[1:] and len(row) < 50 for row in rows)

    with torch.no_grad():
        rows = outputs(1)

        def first_steps(token):
            return len({row.index(token) if token in row else len(row) for row in rows})

        weight, bias = hf.lm_head.weight[EOS].clone(), hf.final_logits_bias[0, EOS].clone()
        for chosen in sorted({t for row in rows for t in row} - {EOS, PAD}, key=first_steps,
                             reverse=True):
            hf.lm_head.weight[EOS] = hf.lm_head.weight[chosen]
            hf.final_logits_bias[0, EOS] = hf.final_logits_bias[0, chosen] + 0.01
            if some_end(outputs(1)) and some_end(outputs(4)):
                return
            hf.lm_head.weight[EOS], hf.final_logits_bias[0, EOS] = weight, bias
    raise AssertionError("no token makes the test lines' translations end")


@pytest.fixture(scope="module")
def mbart_dir(tmp_path_factory):
    return build_mbart(tmp_path_factory.mktemp("mbart"), tmp_path_factory.mktemp("mbart-scratch"))


def _ours(directory, src, tgt, model_type="mbart"):
    from aiayn.interop.hf_tokenizer import load_tokenizer
    from aiayn.tasks.checkpoints import Seq2SeqTokenizer

    tokenizer = Seq2SeqTokenizer(load_tokenizer(directory), directory, eos_id=EOS,
                                 model_type=model_type)
    tokenizer.set_languages(src, tgt)
    return tokenizer


def _sources(tokenizer, texts):
    """What the batcher feeds the encoder: each source + </s> + the source suffix, unpadded."""
    pair = tokenizer.language_ids
    batch = collate(tokenizer.encode(texts), None, range(len(texts)), pad_id=PAD, bos_id=0,
                    eos_id=EOS, source_suffix=pair.source_suffix)
    return [row[row != PAD].tolist() for row in batch.source]


@pytest.mark.parametrize("src, tgt", [("en_XX", "ro_RO"), ("de_DE", "fr_XX")])
def test_mbart_source_is_tokens_eos_code_and_the_decoder_starts_from_the_target(mbart_dir, src,
                                                                                tgt):
    theirs = transformers.AutoTokenizer.from_pretrained(mbart_dir, src_lang=src, tgt_lang=tgt)
    assert type(theirs).__name__.startswith("MBartTokenizer")
    ours = _ours(mbart_dir, src, tgt)
    assert _sources(ours, LINES) == theirs(LINES)["input_ids"]
    assert all(ids[-2:] == [EOS, theirs.convert_tokens_to_ids(src)]
               for ids in theirs(LINES)["input_ids"])
    pair = ours.language_ids
    assert (pair.source_prefix, pair.forced) == ((), ())
    assert pair.decoder_start == theirs.convert_tokens_to_ids(tgt)
    # targets: the tokens the decoder writes after [tgt] (transformers' labels before </s> [tgt])
    labels = theirs(text_target=LINES)["input_ids"]
    assert [ids + [EOS, pair.decoder_start] for ids in ours.encode_targets(LINES)] == labels
    assert ours.decode(ours.encode_targets(LINES)) == theirs.batch_decode(
        labels, skip_special_tokens=True)


def test_an_mbart_checkpoint_without_a_tokenizer_class_has_mbarts_codes(mbart_dir, tmp_path):
    """AutoTokenizer gives a ``model_type: mbart`` checkpoint that names no tokenizer class (as on
    the Hub) ``MBartTokenizer``, whose 25 codes are there whatever the files list."""
    from aiayn.interop.hf_languages import language_codes

    for path in mbart_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    for key in ("tokenizer_class", "extra_special_tokens", "additional_special_tokens"):
        settings.pop(key, None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    codes = language_codes(tmp_path, model_type="mbart")
    assert (codes.family, codes.codes) == ("mBART", tuple(_mbart_codes()))
    assert language_codes(tmp_path, model_type="bart").family is None
    ours = _ours(tmp_path, "de_DE", "fr_XX")
    theirs = transformers.AutoTokenizer.from_pretrained(mbart_dir, src_lang="de_DE")
    assert _sources(ours, LINES) == theirs(LINES)["input_ids"]
    with pytest.raises(ValueError, match=r"a mBART checkpoint translates between languages: give "
                                         r"--src-lang and --tgt-lang .*ar_AR, cs_CZ"):
        ours.set_languages(None, None)


def _hf_translations(directory, lines, *, src, tgt, beam, alpha=0.0, ended=None):
    """transformers' generate with the target code as decoder start, aiayn's limit (the source
    length + 50 tokens, </s> included), pad and the start symbol never generated. ``ended``: a
    list that gets, per line, whether its output has tokens and ends with </s> before the limit."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, src_lang=src)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
    start = tokenizer.convert_tokens_to_ids(tgt)
    outputs = []
    for line in lines:
        ids = torch.tensor([tokenizer(line)["input_ids"]])
        options = dict(length_penalty=alpha, early_stopping=True) if beam > 1 else {}
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=beam,
                                 do_sample=False, max_new_tokens=ids.shape[1] + 50,
                                 decoder_start_token_id=start, forced_eos_token_id=EOS,
                                 bad_words_ids=[[PAD], [start]], **options)
        assert out[0, 0] == start
        if ended is not None:
            tokens = out[0, 1:].tolist()
            ended.append(EOS in tokens[1:] and len(tokens) < ids.shape[1] + 50)
        outputs.append(tokenizer.decode(out[0], skip_special_tokens=True))
    return outputs


def _translate(directory, lines, *args, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(lines).encode())))
    code = main(["translate", str(directory), *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out.splitlines()


@pytest.mark.parametrize("beam", [1, 4])
def test_mbart_translate_prints_what_generate_with_the_decoder_start_prints(
        mbart_dir, beam, monkeypatch, capsys):
    """Greedy, and beam 4 with transformers' length penalty L**alpha swapped in at alpha 1
    (tests/test_hf_beam.py; at alpha 0 every beam of this model ends at once), on the lines whose
    translation ends before the length limit (tests/test_hf_multilingual.py leaves the others out
    for the same reason)."""
    from aiayn.decoding import beam as beam_module

    monkeypatch.setattr(beam_module, "length_penalty", lambda length, alpha: length ** alpha)
    printed = _translate(mbart_dir, LINES, "--src-lang", "de_DE", "--tgt-lang", "fr_XX",
                         "--beam", str(beam), "--alpha", "1", monkeypatch=monkeypatch,
                         capsys=capsys)
    ended = []
    want = _hf_translations(mbart_dir, LINES, src="de_DE", tgt="fr_XX", beam=beam, alpha=1.0,
                            ended=ended)
    assert any(ended)  # an output of some tokens that ends before the limit
    if beam == 1:
        assert printed == want
    else:  # a beam reaching the limit ends with </s> forced, scored 0 by transformers only
        assert [line for line, end in zip(printed, ended) if end] == \
            [line for line, end in zip(want, ended) if end]


def test_searches_start_from_the_given_symbol(mbart_dir):
    """``start`` replaces the model's decoder start: greedy equals a search whose model starts
    there; a start outside the vocabulary is refused before any work."""
    from aiayn.decoding.beam import beam_search
    from aiayn.decoding.greedy import first_tokens, greedy_search

    model = aiayn.from_pretrained(mbart_dir).eval()
    ours = _ours(mbart_dir, "en_XX", "ro_RO")
    source = collate(ours.encode(LINES), None, range(3), pad_id=PAD, bos_id=0, eos_id=EOS,
                     source_suffix=ours.language_ids.source_suffix).source
    mask = source != PAD
    start = ours.language_ids.decoder_start
    given = greedy_search(model, source, mask, start=start, max_extra=5)
    beam_given = beam_search(model, source, mask, start=start, beam_size=3, max_extra=5)
    model.config.decoder_start_id = start
    assert [h.tokens for h in given] == [h.tokens for h in greedy_search(model, source, mask,
                                                                          max_extra=5)]
    assert [h.tokens for h in beam_given] == [h.tokens for h in beam_search(
        model, source, mask, beam_size=3, max_extra=5)]
    assert first_tokens(model, 2, [7], "cpu", start=5).tolist() == [[5, 7], [5, 7]]
    vocab = model.config.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match=rf"start token {bad} is not an id of the model's "
                                             rf"vocabulary \(0\.\.{vocab - 1}\)"):
            greedy_search(model, source, mask, start=bad)
    with pytest.raises(ValueError, match=r"forced token 1.5 is not an id"):
        beam_search(model, source, mask, forced=[1.5])


def test_mbart_training_batches_and_loss_are_transformers(mbart_dir, pairs_tsv):
    """Fine-tuning batches: the source is ``tokens </s> [src]`` (MBartTokenizer's input_ids), the
    decoder input is mBART's ``shift_tokens_right`` of the labels (``[tgt] tokens </s>``) where a
    label is scored, and the per-token loss is transformers' on those labels. transformers'
    labels end with one more token, the target code after </s>, which a translation never
    reaches: aiayn does not train it."""
    from transformers.models.mbart.modeling_mbart import shift_tokens_right

    task, tokenizer, theirs = finetuning.task_and_tokenizer(mbart_dir, pairs_tsv, "en_XX",
                                                            "fr_XX")
    fr = tokenizer.convert_tokens_to_ids("fr_XX")
    assert len(task.train_source) == len(finetuning.PAIRS)  # none filtered: indices agree
    batch = next(iter(task.train_batches(0)))
    rows = batch.index.tolist()
    assert [row[row != PAD].tolist() for row in batch.source] == \
        [theirs["input_ids"][i] for i in rows]
    labels = [theirs["labels"][i] for i in rows]  # tokens </s> [fr_XX]
    assert all(ids[-2:] == [EOS, fr] for ids in labels)
    width = max(map(len, labels))
    padded = torch.tensor([ids + [PAD] * (width - len(ids)) for ids in labels])
    shifted = shift_tokens_right(padded, PAD)  # [fr_XX] tokens </s>
    scored = batch.targets != PAD
    assert torch.equal(batch.decoder_input[scored], shifted[:, :-1][scored])
    assert torch.equal(batch.targets[scored], padded[:, :-1][scored])

    model = task.build_model(task.model_config(None)).eval()
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(mbart_dir).eval()
    last = padded == fr  # the code after </s>: not scored
    with torch.no_grad():
        ours = float(task.loss(model, batch)) / batch.target_tokens
        want = float(hf(input_ids=batch.source, attention_mask=(batch.source != PAD).long(),
                        decoder_input_ids=shifted,
                        labels=padded.masked_fill(last | (padded == PAD), -100)).loss)
    assert ours == pytest.approx(want, abs=1e-4)


def test_fine_tuned_mbart_run_keeps_its_pair(mbart_dir, pairs_tsv, tmp_path, monkeypatch):
    out = tmp_path / "run"
    seen = finetuning.fine_tune(monkeypatch, mbart_dir, pairs_tsv, out, "en_XX", "fr_XX",
                                "mbart")
    codes = transformers.AutoTokenizer.from_pretrained(mbart_dir)
    en, fr = codes.convert_tokens_to_ids("en_XX"), codes.convert_tokens_to_ids("fr_XX")
    assert all((kwargs.get("start"), tuple(kwargs.get("source_suffix", ()))) == (fr, (en,))
               for kwargs in seen)  # what the run's validation decodes with
    exported = export(out, tmp_path / "exported")
    for args, tgt in (((), "fr_XX"), (("--tgt-lang", "de_DE"), "de_DE")):
        result = run_cli("translate", str(out), "--beam", "1", "--threads", "1", *args,
                         stdin="".join(line + "\n" for line in LINES))
        assert result.returncode == 0, result.stderr.decode()
        assert result.stdout.decode().splitlines() == _hf_translations(
            exported, LINES, src="en_XX", tgt=tgt, beam=1)


# --- NLLB's legacy format --------------------------------------------------------------------
@pytest.fixture(scope="module")
def legacy_nllb_dir(tmp_path_factory):
    """The small NLLB checkpoint of test_hf_multilingual with its tokenizer saved by
    ``NllbTokenizerFast(legacy_behaviour=True)``."""
    directory = build_nllb(tmp_path_factory.mktemp("nllb-legacy"),
                           tmp_path_factory.mktemp("nllb-legacy-scratch"))
    tokenizer = transformers.NllbTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"),
                                               src_lang=CODES[0], additional_special_tokens=CODES,
                                               legacy_behaviour=True)
    tokenizer.save_pretrained(directory)
    assert json.loads((directory / "tokenizer_config.json").read_text())["legacy_behaviour"]
    return directory


def test_legacy_nllb_source_ends_with_its_code_and_the_target_code_is_forced(
        legacy_nllb_dir, monkeypatch, capsys):
    theirs = transformers.AutoTokenizer.from_pretrained(legacy_nllb_dir, src_lang="deu_Latn")
    ours = _ours(legacy_nllb_dir, "deu_Latn", "fra_Latn", model_type="m2m_100")
    assert _sources(ours, LINES) == theirs(LINES)["input_ids"]
    fra = theirs.convert_tokens_to_ids("fra_Latn")
    assert ours.language_ids.forced == (fra,) and ours.language_ids.decoder_start is None

    printed = _translate(legacy_nllb_dir, LINES, "--src-lang", "deu_Latn", "--tgt-lang",
                         "fra_Latn", "--beam", "1", monkeypatch=monkeypatch, capsys=capsys)
    # generate with forced_bos_token_id, on the legacy tokenizer's input_ids
    assert printed == finetuning._hf_translations(legacy_nllb_dir, LINES, src="deu_Latn",
                                                  tgt="fra_Latn")


def test_unknown_mbart_code_is_refused(mbart_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the cat\n")))
    assert main(["translate", str(mbart_dir), "--src-lang", "en", "--tgt-lang", "ro_RO"]) == 1
    assert re.search(r"--src-lang 'en' is not a language code of this mBART tokenizer; it has "
                     r"ar_AR, cs_CZ", capsys.readouterr().err)


# --- aiayn attention -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["mbart", "legacy-nllb"])
def test_attention_shows_the_translation_with_its_language_codes(kind, mbart_dir,
                                                                 legacy_nllb_dir, tmp_path,
                                                                 capsys):
    """``aiayn attention DIR --src-lang X --tgt-lang Y``: the source ids are the tokenizer's for
    that pair, the decoder input is the start symbol, the forced code and the greedy translation
    ``aiayn translate`` prints (mBART: the target code as start)."""
    from aiayn.tasks.checkpoints import load_model_dir, set_languages
    from aiayn.tasks.translate import language_options, translate_ids
    from aiayn.visualise.subjects import load_subject

    directory, src, tgt = ((mbart_dir, "de_DE", "fr_XX") if kind == "mbart"
                           else (legacy_nllb_dir, "deu_Latn", "fra_Latn"))
    theirs = transformers.AutoTokenizer.from_pretrained(directory, src_lang=src)
    code = theirs.convert_tokens_to_ids(tgt)
    example = load_subject(directory, src_lang=src, tgt_lang=tgt).example(LINES[0])
    assert example.source_ids == theirs(LINES[0])["input_ids"]
    run = load_model_dir(directory, task="translation")
    set_languages(run, src, tgt)
    pair = run.assets.language_ids
    (want,) = translate_ids(run.model, run.assets.encode([LINES[0]]), beam_size=1,
                            **language_options(run.assets))
    first = [code] if kind == "mbart" else [EOS, code]
    assert example.target_ids == first + want
    assert (pair.decoder_start == code) == (kind == "mbart")
    given = load_subject(directory, src_lang=src, tgt_lang=tgt).example(LINES[0], "le chat")
    assert given.target_ids[:len(first)] == first and len(given.target_ids) > len(first)

    out = tmp_path / "maps"
    assert main(["attention", str(directory), "--text", LINES[0], "--src-lang", src,
                 "--tgt-lang", tgt, "--out", str(out)]) == 0
    assert {"cross_grid.png", "metrics.json"} <= {path.name for path in out.iterdir()}
    printed = capsys.readouterr().out
    assert f"target (greedy translation): {' '.join(theirs.convert_ids_to_tokens(first + want))}" \
        in printed
    assert main(["attention", str(directory), "--text", LINES[0], "--out", str(out)]) == 1
    assert re.search(r"give --src-lang and --tgt-lang", capsys.readouterr().err)
