"""M2M100's own tokenizer (``sentencepiece.bpe.model`` + ``vocab.json``, no tokenizer.json) against
``transformers.M2M100Tokenizer``: ids for several texts and language pairs, decoded texts, and
``aiayn translate`` / ``aiayn evaluate`` on a small random M2M100 saved with it, against
``generate(forced_bos_token_id=get_lang_id(tgt))`` + ``batch_decode(skip_special_tokens=True)``.

Two layouts: "listed", as facebook/m2m100_418M ships it (special_tokens_map.json lists the 100
codes as additional special tokens), and "saved", what ``M2M100Tokenizer(vocab, spm)
.save_pretrained`` writes (no codes listed: transformers neither skips nor splits them, nor does
aiayn); "wmt21" is "saved" with the 8-code language set."""

import io
import json
import shutil
import sys

import pytest
import torch

from checkpoint_builders import pairs

transformers = pytest.importorskip("transformers")
sentencepiece = pytest.importorskip("sentencepiece")
from test_hf_multilingual import EOS, PAD, build_hf, make_eos_reachable  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = ["the cat sat on the mat", "Überprüfung der Pakete: xyz ß  qq", "a  b . it 's , ok ?",
         "hello __fr__ world </s> x<s>y", " leading and trailing spaces ", ""]
LINES = ["the cat sat on the mat", "Die Pakete"]  # translated by the command tests
MADEUP = 8  # num_madeup_words: model rows after the codes that no token names


@pytest.fixture(scope="module")
def spm_files(tmp_path_factory):
    """A SentencePiece BPE model trained on the bundled pairs and a vocab.json in fairseq's order
    (<s> <pad> </s> <unk>, then the pieces; every 17th piece left out, so it encodes as <unk>)."""
    directory = tmp_path_factory.mktemp("m2m100-spm")
    corpus = directory / "corpus.txt"
    corpus.write_text("".join(f"{en}\n{de}\n" for en, de in pairs()), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(directory / "spm"), vocab_size=300, model_type="bpe",
        character_coverage=1.0, minloglevel=2)
    processor = sentencepiece.SentencePieceProcessor(model_file=str(directory / "spm.model"))
    vocabulary = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for index in range(processor.get_piece_size()):
        if index % 17 != 5:
            vocabulary.setdefault(processor.id_to_piece(index), len(vocabulary))
    (directory / "vocab.json").write_text(json.dumps(vocabulary), encoding="utf-8")
    return directory / "vocab.json", directory / "spm.model"


def write_tokenizer(directory, spm_files, layout: str):
    """The tokenizer files of ``layout`` in ``directory``; the language codes' tokens."""
    from transformers.models.m2m_100.tokenization_m2m_100 import FAIRSEQ_LANGUAGE_CODES

    language_set = "wmt21" if layout == "wmt21" else "m2m100"
    tokenizer = transformers.M2M100Tokenizer(*map(str, spm_files), language_codes=language_set)
    tokenizer.save_pretrained(directory)
    codes = [f"__{code}__" for code in FAIRSEQ_LANGUAGE_CODES[language_set]]
    if layout == "listed":  # facebook/m2m100_418M's files
        specials = dict(bos_token="<s>", eos_token="</s>", sep_token="</s>", unk_token="<unk>",
                        pad_token="<pad>")
        (directory / "special_tokens_map.json").write_text(json.dumps(
            {**specials, "additional_special_tokens": codes}), encoding="utf-8")
        # the hub's file names no clean_up_tokenization_spaces, which transformers 4 takes as
        # true and 5 as false (aiayn: false); said here, it reads alike under both
        (directory / "tokenizer_config.json").write_text(json.dumps(
            {**specials, "src_lang": None, "tgt_lang": None, "language_codes": "m2m100",
             "sp_model_kwargs": {}, "num_madeup_words": MADEUP, "model_max_length": 1024,
             "tokenizer_class": "M2M100Tokenizer", "clean_up_tokenization_spaces": False}),
            encoding="utf-8")
    return codes


def ours_and_theirs(directory, src: str, tgt: str):
    from aiayn.interop.hf_tokenizer import load_tokenizer
    from aiayn.tasks.checkpoints import Seq2SeqTokenizer

    ours = Seq2SeqTokenizer(load_tokenizer(directory), directory, eos_id=EOS)
    ours.set_languages(src, tgt, model_type="m2m_100")
    return ours, transformers.AutoTokenizer.from_pretrained(directory, src_lang=src, tgt_lang=tgt)


@pytest.mark.parametrize("layout", ["listed", "saved", "wmt21"])
def test_ids_and_texts_match_m2m100_tokenizer(layout, spm_files, tmp_path):
    """[__src__] pieces </s> for each source code, the target code forced as get_lang_id gives
    it, and decoded texts (unknown ids and the codes included) equal to transformers'."""
    codes = write_tokenizer(tmp_path, spm_files, layout)
    size = len(json.loads(spm_files[0].read_text()))
    pairs_ = [("en", "fr"), ("de", "en"), ("zh", "ja")] if layout != "wmt21" \
        else [("en", "de"), ("ha", "cs")]
    for src, tgt in pairs_:
        ours, theirs = ours_and_theirs(tmp_path, src, tgt)
        want = theirs(TEXTS)["input_ids"]
        assert [ids + [EOS] for ids in ours.encode(TEXTS)] == want
        assert ours.tokenizer.tokens(TEXTS[1], add_special_tokens=False) == \
            theirs.convert_ids_to_tokens(want[1][1:-1])
        forced = list(ours.language_ids.forced)
        assert forced == [theirs.get_lang_id(tgt)] == [size + codes.index(f"__{tgt}__")]
        assert ours.decode(want) == theirs.batch_decode(want, skip_special_tokens=True)
        made_up = list(range(size + len(codes), size + len(codes) + MADEUP))
        rows = [[5, size, size + 3, 7, 3, 2, 1, 0, 9], made_up + [40, 41], forced]
        assert ours.decode(rows) == theirs.batch_decode(rows, skip_special_tokens=True)
    assert ours.vocab_size == size + len(codes)


def test_language_code_errors(spm_files, tmp_path):
    """Codes come from the language set whether or not the files list them; others are refused."""
    from aiayn.interop.hf_tokenizer import load_tokenizer
    from aiayn.tasks.checkpoints import Seq2SeqTokenizer

    write_tokenizer(tmp_path, spm_files, "saved")
    ours = Seq2SeqTokenizer(load_tokenizer(tmp_path), tmp_path, eos_id=EOS)
    with pytest.raises(ValueError, match=r"--tgt-lang 'xx' is not a language code of this M2M100 "
                                         r"tokenizer; it has __af__, __am__, .*\(100 codes\)"):
        ours.set_languages("en", "xx", model_type="m2m_100")
    with pytest.raises(ValueError, match=r"give --src-lang \(src_lang"):
        ours.set_languages(None, "fr", model_type="m2m_100")
    ours.set_languages("__en__", "fr", model_type="m2m_100")  # the token works as well as the code


def test_which_directories_are_m2m100_tokenizers(spm_files, tmp_path):
    from aiayn.interop.hf_tokenizer import has_tokenizer, load_tokenizer

    write_tokenizer(tmp_path, spm_files, "saved")
    assert has_tokenizer(tmp_path)
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {**settings, "language_codes": "wmt22"}))
    with pytest.raises(ValueError, match=r"language_codes 'wmt22' is not one of m2m100, wmt21"):
        load_tokenizer(tmp_path)
    # Speech2Text ships the same two files; it is not read as M2M100's
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "Speech2TextTokenizer"}')
    assert not has_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"no tokenizer found"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "vocab.json").write_text('{"<unk>": 0}')
    with pytest.raises(ValueError, match=r"vocab.json: no entry for </s>"):
        load_tokenizer(tmp_path)


# --- the command line --------------------------------------------------------------------------
def generate(model, tokenizer, beam: int) -> list[tuple[str, bool]]:
    """transformers' translations of ``LINES`` into French (beam 4: ``--alpha 0``), with aiayn's
    limit (the length + 50 tokens), and whether each ended before the limit."""
    forced = tokenizer.get_lang_id("fr")
    translations = []
    for ids in tokenizer(LINES)["input_ids"]:
        ids = torch.tensor([ids])
        options = dict(length_penalty=0.0, early_stopping=True) if beam > 1 else {}
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=beam,
                                 do_sample=False, max_new_tokens=ids.shape[1] + 50,
                                 forced_bos_token_id=forced, forced_eos_token_id=EOS,
                                 bad_words_ids=[[PAD]], **options)
        assert out[0, 1] == forced
        translations.append((tokenizer.decode(out[0], skip_special_tokens=True),
                             out.shape[1] - 1 < ids.shape[1] + 50))
    return translations


@pytest.fixture(scope="module")
def m2m100_dir(spm_files, tmp_path_factory):
    """A small M2M100 checkpoint as facebook/m2m100_418M lays it out: the pieces, the 100 codes
    and 8 made-up words in the vocabulary, and M2M100's own tokenizer files."""
    directory = tmp_path_factory.mktemp("m2m100")
    codes = write_tokenizer(directory, spm_files, "listed")
    vocab = len(json.loads(spm_files[0].read_text())) + len(codes) + MADEUP
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, src_lang="en")
    batch = tokenizer(LINES, padding=True, return_tensors="pt")
    # the first </s> row whose translations are not empty and some end, greedy and beam 4 (the
    # weights differ between transformers 4 and 5, and so does the row that works)
    for scale in (1.0, 1.05, 0.95, 1.1, 0.9, 1.2, 0.8):
        hf = build_hf("m2m_100", vocab=vocab, untied=True)
        make_eos_reachable(hf, batch["input_ids"], batch["attention_mask"].bool(),
                           forced=tokenizer.get_lang_id("fr"), scale=scale)
        greedy = generate(hf, tokenizer, 1)
        if all(text for text, _ in greedy) and any(ended for _, ended in greedy) and \
                any(text and ended for text, ended in generate(hf, tokenizer, 4)):
            break
    hf.save_pretrained(directory)
    return directory


def _translate(directory, lines, *args, monkeypatch, capsys):
    from aiayn.cli import main

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("\n".join(lines).encode())))
    code = main(["translate", str(directory), *args])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err


@pytest.mark.parametrize("beam", [1, 4])
def test_translate_prints_what_generate_and_decode_print(m2m100_dir, beam, monkeypatch, capsys):
    """Token for token; beam 4 on the translations that end before the limit: one that reaches it
    ends with </s> forced, which transformers scores 0 and aiayn by its log-probability
    (tests/test_hf_beam.py)."""
    code, printed, _ = _translate(m2m100_dir, LINES, "--src-lang", "en", "--tgt-lang", "fr",
                                  "--beam", str(beam), "--alpha", "0",
                                  monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(m2m100_dir, src_lang="en")
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(m2m100_dir).eval()
    compared = [(ours, theirs) for ours, (theirs, ended) in
                zip(printed, generate(model, tokenizer, beam)) if ended or beam == 1]
    assert [ours for ours, _ in compared] == [theirs for _, theirs in compared]
    assert any(ours for ours, _ in compared), (printed, compared)  # not only empty translations


def test_evaluate_runs_with_language_codes(m2m100_dir, tmp_path, capsys):
    from aiayn.cli import main

    (tmp_path / "src.txt").write_text("the cat sat\na dog and a cat\n", encoding="utf-8")
    (tmp_path / "tgt.txt").write_text("le chat\nun chien\n", encoding="utf-8")
    code = main(["evaluate", str(m2m100_dir), "--data", str(tmp_path / "src.txt"),
                 str(tmp_path / "tgt.txt"), "--src-lang", "en", "--tgt-lang", "de",
                 "--beam", "2"])
    assert code == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["sentences"] == 2 and "bleu" in result and "chrf" in result


def test_unknown_or_missing_code_is_an_error_of_the_command(m2m100_dir, monkeypatch, capsys):
    for args, message in [(("--src-lang", "en", "--tgt-lang", "xx"),
                           "--tgt-lang 'xx' is not a language code of this M2M100 tokenizer"),
                          (("--tgt-lang", "fr"), "give --src-lang")]:
        code, printed, err = _translate(m2m100_dir, ["the cat"], *args, monkeypatch=monkeypatch,
                                        capsys=capsys)
        assert code == 1 and printed == [] and "aiayn translate: error: " in err
        assert message in err


def test_run_fine_tuned_from_it_keeps_the_files(m2m100_dir, tmp_path):
    """``copy_tokenizer_files`` carries sentencepiece.bpe.model: the copy loads alike."""
    from aiayn.interop.hf_tokenizer import copy_tokenizer_files, load_tokenizer

    copied = copy_tokenizer_files(m2m100_dir, tmp_path / "copy")
    assert {"sentencepiece.bpe.model", "vocab.json", "special_tokens_map.json"} <= set(copied)
    ids = load_tokenizer(m2m100_dir).encode(TEXTS[1])
    assert load_tokenizer(tmp_path / "copy").encode(TEXTS[1]) == ids
    shutil.rmtree(tmp_path / "copy")
    # beside a tokenizer.json (XLM-R, NLLB), which is what loads, the model file is not carried
    shutil.copytree(m2m100_dir, tmp_path / "with-json")
    (tmp_path / "with-json" / "tokenizer.json").write_text("{}", encoding="utf-8")
    copied = copy_tokenizer_files(tmp_path / "with-json", tmp_path / "copy")
    assert "tokenizer.json" in copied and "sentencepiece.bpe.model" not in copied
    assert not (tmp_path / "copy" / "sentencepiece.bpe.model").exists()


def test_fine_tuning_pairs_are_m2m100_tokenizer_text_targets(m2m100_dir, tmp_path):
    """``train translation --init DIR --src-lang en --tgt-lang fr`` trains on ``M2M100Tokenizer
    (src, text_target=tgt)``'s ids, and the run reloads with its pair (M2M100's own tokenizer,
    whose codes come from the language set, kept with the checkpoint's model_type)."""
    from aiayn.cli import main
    from aiayn.tasks.checkpoints import load_model_dir, set_language_pair
    from aiayn.tasks.pretrained import load_pretrained_model
    from aiayn.tasks.translation import TranslationTask

    theirs = transformers.AutoTokenizer.from_pretrained(m2m100_dir, src_lang="en", tgt_lang="fr")
    texts = [(en, de) for en, de in pairs(80)  # pairs that fit the position table
             if max(len(theirs(en)["input_ids"]), len(theirs(de)["input_ids"])) < 60][:30]
    assert len(texts) >= 10
    data = tmp_path / "pairs.tsv"
    data.write_text("".join(f"{en}\t{de}\n" for en, de in texts), encoding="utf-8")
    pretrained = load_pretrained_model(m2m100_dir, "translation")
    set_language_pair(pretrained.tokenizer, m2m100_dir, "en", "fr")
    task = TranslationTask([data], pretrained=pretrained, valid_fraction=0.0, test_fraction=0.0,
                           max_ratio=1000.0)
    want = theirs([en for en, _ in texts], text_target=[de for _, de in texts])
    assert [ids + [EOS] for ids in task.train_source] == want["input_ids"]
    assert [ids + [EOS] for ids in task.train_target] == want["labels"]

    out = tmp_path / "run"
    assert main(["train", "translation", "--data", str(data), "--out", str(out), "--init",
                 str(m2m100_dir), "--src-lang", "en", "--tgt-lang", "fr", "--threads", "1",
                 "--no-progress", "--steps", "2", "--eval-every", "2", "--save-every", "2",
                 "--valid-bleu-sentences", "1"]) == 0
    run = load_model_dir(out, task="translation")
    assert run.assets.languages == {"src_lang": "en", "tgt_lang": "fr"}
    assert list(run.assets.language_ids.forced) == [theirs.get_lang_id("fr")]
    assert run.assets.encode(["the cat"]) == [theirs("the cat")["input_ids"][:-1]]
