"""Fine-tuning a multilingual checkpoint (NLLB / M2M100): ``aiayn train translation --init DIR
--src-lang X --tgt-lang Y`` trains on transformers' format (source ``[X] tokens </s>``, labels
``[Y] tokens </s>``, decoder input ``</s> [Y] tokens``), with transformers' loss; the run keeps the
pair, so ``aiayn translate RUN`` needs no codes and prints what ``generate`` with
``forced_bos_token_id`` prints for the fine-tuned weights."""

import json

import pytest
import torch

import aiayn
from aiayn.cli import main
from aiayn.training.run import load_run
from test_checkpoint_finetuning import FAST, export, run_cli
from test_hf_multilingual import EOS, PAD, build_nllb

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

PAIRS = [("the cat sat on the mat", "le chat est sur le tapis"),
         ("a dog and a cat", "un chien et un chat"),
         ("the mat", "le tapis"), ("a cat sat", "un chat"), ("the dog", "le chien")] * 8
SENTENCES = ["the cat sat on the mat", "a dog"]


@pytest.fixture(scope="module")
def nllb_dir(tmp_path_factory):
    return build_nllb(tmp_path_factory.mktemp("nllb"), tmp_path_factory.mktemp("nllb-scratch"))


@pytest.fixture(scope="module")
def pairs_tsv(tmp_path_factory):
    path = tmp_path_factory.mktemp("pairs") / "pairs.tsv"
    path.write_text("".join(f"{en}\t{fr}\n" for en, fr in PAIRS), encoding="utf-8")
    return path


def task_and_tokenizer(directory, pairs_tsv, src: str, tgt: str):
    """The translation task fine-tuning checkpoint ``directory`` on the pairs from ``src`` to
    ``tgt`` (every pair trained, in file order, no label smoothing); transformers' tokenizer for
    that pair, and its ``input_ids`` and ``text_target`` labels of the pairs."""
    from aiayn.tasks.checkpoints import set_language_pair
    from aiayn.tasks.pretrained import load_pretrained_model
    from aiayn.tasks.translation import TranslationTask

    pretrained = load_pretrained_model(directory, "translation")
    set_language_pair(pretrained.tokenizer, directory, src, tgt)
    task = TranslationTask([pairs_tsv], pretrained=pretrained, label_smoothing=0.0,
                           valid_fraction=0.0, test_fraction=0.0, max_tokens=10_000)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, src_lang=src, tgt_lang=tgt)
    theirs = tokenizer([p[0] for p in PAIRS], text_target=[p[1] for p in PAIRS])
    return task, tokenizer, theirs


def test_training_batches_and_loss_are_transformers(nllb_dir, pairs_tsv):
    """The task's ids are NllbTokenizerFast's ``input_ids`` and ``text_target`` labels; the batch's
    decoder input is M2M100's ``shift_tokens_right`` of the labels where a label is scored; the
    per-token loss is the model's own ``labels=`` loss."""
    from transformers.models.m2m_100.modeling_m2m_100 import shift_tokens_right

    task, tokenizer, theirs = task_and_tokenizer(nllb_dir, pairs_tsv, "eng_Latn", "fra_Latn")
    assert [ids + [EOS] for ids in task.train_source] == theirs["input_ids"]
    assert [ids + [EOS] for ids in task.train_target] == theirs["labels"]
    assert all(ids[0] == tokenizer.convert_tokens_to_ids("fra_Latn") for ids in theirs["labels"])

    model = task.build_model(task.model_config(None)).eval()
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(nllb_dir).eval()
    batch = next(iter(task.train_batches(0)))
    labels = batch.targets.masked_fill(batch.targets == PAD, -100)
    shifted = shift_tokens_right(batch.targets, PAD, hf.config.decoder_start_token_id)
    scored = batch.targets != PAD  # (transformers also feeds a padded row's </s>, never scored)
    assert torch.equal(batch.decoder_input[scored], shifted[scored])
    with torch.no_grad():
        ours = float(task.loss(model, batch)) / batch.target_tokens
        want = float(hf(input_ids=batch.source, attention_mask=(batch.source != PAD).long(),
                        labels=labels).loss)
    assert ours == pytest.approx(want, abs=1e-4)


def _hf_translations(directory, sentences, *, src: str, tgt: str):
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, src_lang=src)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(directory).eval()
    outputs = []
    for sentence in sentences:
        ids = torch.tensor([tokenizer(sentence)["input_ids"]])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=1,
                                 do_sample=False, max_new_tokens=ids.shape[1] + 50,
                                 forced_bos_token_id=tokenizer.convert_tokens_to_ids(tgt),
                                 forced_eos_token_id=EOS, bad_words_ids=[[PAD]])
        outputs.append(tokenizer.decode(out[0], skip_special_tokens=True))
    return outputs


def fine_tune(monkeypatch, init, pairs_tsv, out, src: str, tgt: str, model_type: str
              ) -> list[dict]:
    """``aiayn train translation --init INIT --src-lang SRC --tgt-lang TGT`` on the pairs, a short
    run that validates with 2 translated sentences; checks that it trained and saved its pair.
    Returns the keyword arguments of each ``translate_ids`` call its validation made."""
    import aiayn.tasks.translate as translate_module

    seen = []
    plain = translate_module.translate_ids

    def recording(*args, **kwargs):
        seen.append(kwargs)
        return plain(*args, **kwargs)

    monkeypatch.setattr(translate_module, "translate_ids", recording)
    assert main(["train", "translation", "--data", str(pairs_tsv), "--out", str(out), "--init",
                 str(init), "--src-lang", src, "--tgt-lang", tgt, "--valid-bleu-sentences", "2",
                 "--lr-factor", "5", *FAST]) == 0
    monkeypatch.setattr(translate_module, "translate_ids", plain)
    info = json.loads((out / "run.json").read_text())
    assert info["assets"]["languages"] == {"src_lang": src, "tgt_lang": tgt,
                                           "model_type": model_type}
    start = aiayn.from_pretrained(init).state_dict()
    tuned = load_run(out).model.state_dict()
    assert any(not torch.equal(tuned[name], start[name]) for name in start)  # it trained
    assert seen
    return seen


def test_fine_tuned_run_keeps_its_language_pair(nllb_dir, pairs_tsv, tmp_path, monkeypatch,
                                                 capsys):
    out = tmp_path / "run"
    seen = fine_tune(monkeypatch, nllb_dir, pairs_tsv, out, "eng_Latn", "fra_Latn", "m2m_100")
    fra = transformers.AutoTokenizer.from_pretrained(nllb_dir).convert_tokens_to_ids("fra_Latn")
    assert all(list(kwargs.get("forced", ())) == [fra] for kwargs in seen)
    exported = export(out, tmp_path / "exported")
    result = run_cli("translate", str(out), "--beam", "1", "--threads", "1",
                     stdin="".join(s + "\n" for s in SENTENCES))
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().splitlines() == _hf_translations(
        exported, SENTENCES, src="eng_Latn", tgt="fra_Latn")
    # one code given replaces that side of the saved pair
    result = run_cli("translate", str(out), "--beam", "1", "--threads", "1", "--tgt-lang",
                     "deu_Latn", stdin="".join(s + "\n" for s in SENTENCES))
    assert result.returncode == 0, result.stderr.decode()
    assert result.stdout.decode().splitlines() == _hf_translations(
        exported, SENTENCES, src="eng_Latn", tgt="deu_Latn")
    capsys.readouterr()
    assert main(["evaluate", str(out), "--data", str(pairs_tsv), "--beam", "1",
                 "--limit", "3"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["sentences"] == 3
    # the run starts another fine-tuning with its pair, codes not repeated
    again = tmp_path / "again"
    assert main(["train", "translation", "--data", str(pairs_tsv), "--out", str(again),
                 "--init", str(out), "--valid-bleu-sentences", "1", *FAST]) == 0
    assert json.loads((again / "run.json").read_text())["assets"]["languages"]["tgt_lang"] == \
        "fra_Latn"


@pytest.mark.parametrize("init, args, message", [
    ("nllb", (), r"give --src-lang and --tgt-lang .*eng_Latn, fra_Latn, deu_Latn"),
    ("nllb", ("--src-lang", "eng_Latn", "--tgt-lang", "xx_Latn"),
     r"--tgt-lang 'xx_Latn' is not a language code of this NLLB tokenizer"),
    (None, ("--src-lang", "eng_Latn", "--tgt-lang", "fra_Latn"),
     r"--src-lang / --tgt-lang need --init"),
])
def test_language_errors_stop_before_training(nllb_dir, pairs_tsv, tmp_path, capsys, init,
                                              args, message):
    import re

    out = tmp_path / "run"
    init_args = ["--init", str(nllb_dir)] if init else []
    assert main(["train", "translation", "--data", str(pairs_tsv), "--out", str(out),
                 *init_args, *args, *FAST]) == 1
    assert re.search(message, capsys.readouterr().err)
    assert not (out / "run.json").exists()


def test_codes_for_a_checkpoint_without_them_are_refused(pairs_tsv, tmp_path, capsys):
    import checkpoint_builders as builders

    checkpoint = builders.marian(tmp_path / "marian")
    assert main(["train", "translation", "--data", str(pairs_tsv), "--out", str(tmp_path / "r"),
                 "--init", str(checkpoint), "--src-lang", "en", "--tgt-lang", "de", *FAST]) == 1
    assert "this tokenizer has no language codes" in capsys.readouterr().err
