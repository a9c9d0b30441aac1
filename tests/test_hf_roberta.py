"""RoBERTa and XLM-RoBERTa checkpoints (``aiayn.interop.hf_roberta``) against ``transformers`` built
from small configs: hidden states and logits, the heads a checkpoint lacks, round trips, the
checkpoint's own tokenizer (byte-level BPE with <s> ... </s>; a SentencePiece unigram for XLM-R),
and the commands on a checkpoint directory (classify, evaluate, fine-tuning and its resume)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from aiayn import from_pretrained, save_pretrained  # noqa: E402
from aiayn.cli import main  # noqa: E402
from aiayn.data.wordpiece import WordPieceTokenizer  # noqa: E402

import checkpoint_builders as builders  # noqa: E402

CLASSES = {
    "roberta": (transformers.RobertaConfig, transformers.RobertaModel,
                transformers.RobertaForMaskedLM, transformers.RobertaForSequenceClassification),
    "xlm-roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel,
                    transformers.XLMRobertaForMaskedLM,
                    transformers.XLMRobertaForSequenceClassification),
}
TEXTS = ["a game of chess for two players", "the network daemon serves files",
         "play sounds from the command line"]


def hf_config(family: str, **fields):
    settings = dict(vocab_size=70, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=64, max_position_embeddings=42, type_vocab_size=1,
                    num_labels=3, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return CLASSES[family][0](**{**settings, **fields})


def saved(model, directory):
    builders.randomise(model, std=0.3, skip=())
    model.eval().save_pretrained(directory)
    return directory


def padded_batch(pad: int = 1, length: int = 40):
    """Two right-padded texts (the second ends at column 9) and their mask (B, T)."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 70, (2, length), generator=generator)
    mask = torch.ones(2, length, dtype=torch.bool)
    ids[1, 9:], mask[1, 9:] = pad, False
    return ids, mask


def hf_outputs(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask.long())
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits


@pytest.mark.parametrize("family", sorted(CLASSES))
@pytest.mark.parametrize("kind", [1, 2, 3])  # the bare model, masked LM, classifier
def test_outputs_equal_transformers(family, kind, tmp_path):
    """Every real position (40 of the 40-position table: rows 2..41) of two right-padded texts."""
    torch.manual_seed(kind)
    reference = CLASSES[family][kind](hf_config(family))
    directory = saved(reference, tmp_path / "hf")
    ours = from_pretrained(directory).eval()
    assert ours.config.position_offset == 2 and ours.config.max_length == 40
    ids, mask = padded_batch()
    expected = hf_outputs(reference, ids, mask)
    with torch.no_grad():
        got = ours(ids, padding_mask=mask)
    if expected.dim() == 3:  # hidden states or MLM logits: real positions only
        expected, got = expected[mask], got[mask]
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_left_padded_text_equals_transformers(family, tmp_path):
    """RoBERTa numbers positions over the real tokens only (a pad reads the padding row): a text
    padded on the left or in the middle gets its right-padded copy's hidden states, in
    transformers and in aiayn, and the classifier equals transformers' (which pools column 0,
    a pad under left padding)."""
    ids, mask = padded_batch()
    left = torch.cat([ids[1:, 9:], ids[1:, :9]], dim=1)  # the 9 real tokens last
    left_mask = torch.cat([mask[1:, 9:], mask[1:, :9]], dim=1)
    middle = torch.cat([ids[1:, :4], ids[1:, 9:], ids[1:, 4:9]], dim=1)
    middle_mask = torch.cat([mask[1:, :4], mask[1:, 9:], mask[1:, 4:9]], dim=1)
    ids, mask = torch.cat([ids, left, middle]), torch.cat([mask, left_mask, middle_mask])
    outputs = []
    for kind in (1, 3):  # the bare model, the classifier
        torch.manual_seed(kind)
        reference = CLASSES[family][kind](hf_config(family))
        ours = from_pretrained(saved(reference, tmp_path / f"hf{kind}")).eval()
        assert ours.config.positions_skip_padding
        expected = hf_outputs(reference, ids, mask)
        with torch.no_grad():
            outputs.append(ours(ids, padding_mask=mask))
        torch.testing.assert_close(outputs[-1], expected, atol=2e-5, rtol=1e-5)
    real = [row[row_mask] for row, row_mask in zip(outputs[0], mask)]  # (9, D) each but row 0
    torch.testing.assert_close(real[2], real[1], atol=2e-5, rtol=1e-5)  # padding moves nothing
    torch.testing.assert_close(real[3], real[1], atol=2e-5, rtol=1e-5)
    # the table holds 40 positions: 45 columns fit when 5 are padding, not when all are real
    wide = torch.cat([torch.ones(4, 5, dtype=torch.long), ids], dim=1)
    wide_mask = torch.cat([torch.zeros(4, 5, dtype=torch.bool), mask], dim=1)
    with torch.no_grad():  # token types given: transformers 4's default buffer has 42 columns
        expected = reference(input_ids=wide, attention_mask=wide_mask.long(),
                             token_type_ids=torch.zeros_like(wide)).logits
        torch.testing.assert_close(ours(wide, padding_mask=wide_mask), expected, atol=2e-5,
                                   rtol=1e-5)
        with pytest.raises(ValueError, match="45 positions exceeds the position table"):
            ours(wide, padding_mask=torch.ones_like(wide_mask))


def test_positions_are_read_past_the_padding_rows(tmp_path):
    """The same weights read from row 0 of the table, as BERT reads it, give other hidden states:
    the offset is what makes them equal."""
    torch.manual_seed(0)
    reference = transformers.RobertaModel(hf_config("roberta"))
    directory = saved(reference, tmp_path / "hf")
    ours = from_pretrained(directory).eval()
    ids, mask = padded_batch(length=20)
    expected = hf_outputs(reference, ids, mask)
    ours.encoder.embeddings.positions.offset = 0
    with torch.no_grad():
        unshifted = ours(ids, padding_mask=mask)
    assert (unshifted[mask] - expected[mask]).abs().max() > 1e-2


def test_heads_a_checkpoint_lacks_are_new_and_heads_it_has_are_dropped(tmp_path):
    """A bare RobertaModel fine-tunes into a classifier (a fresh head, as transformers makes one;
    its pooler is not used), a masked-LM checkpoint loads as a bare encoder (its head dropped)."""
    torch.manual_seed(0)
    bare = saved(transformers.RobertaModel(hf_config("roberta")), tmp_path / "bare")
    classifier = from_pretrained(bare, task="classification").eval()
    reference = transformers.RobertaForSequenceClassification.from_pretrained(bare).eval()
    ids, mask = padded_batch()
    with torch.no_grad():
        reference.classifier.load_state_dict({  # transformers' fresh head, as aiayn drew its own
            "dense.weight": classifier.head.pooler.weight, "dense.bias": classifier.head.pooler.bias,
            "out_proj.weight": classifier.head.classifier.weight,
            "out_proj.bias": classifier.head.classifier.bias})
        torch.testing.assert_close(classifier(ids, padding_mask=mask),
                                   hf_outputs(reference, ids, mask), atol=2e-5, rtol=1e-5)
    masked = saved(transformers.RobertaForMaskedLM(hf_config("roberta")), tmp_path / "mlm")
    encoder = from_pretrained(masked, task="encoder").eval()
    expected = hf_outputs(transformers.RobertaModel.from_pretrained(masked).eval(), ids, mask)
    with torch.no_grad():
        torch.testing.assert_close(encoder(ids, padding_mask=mask)[mask], expected[mask],
                                   atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", [1, 2, 3])
def test_round_trip_loads_in_transformers_as_roberta(kind, tmp_path):
    torch.manual_seed(0)
    family = "xlm-roberta"  # written back as roberta: the same network
    directory = saved(CLASSES[family][kind](hf_config(family)), tmp_path / "hf")
    ours = from_pretrained(directory).eval()
    written = save_pretrained(ours, tmp_path / "out")
    config = json.loads((written / "config.json").read_text())
    assert config["model_type"] == "roberta" and config["max_position_embeddings"] == 42
    again = getattr(transformers, config["architectures"][0]).from_pretrained(written).eval()
    assert type(again).__name__ == CLASSES["roberta"][kind].__name__
    ids, mask = padded_batch()
    expected = hf_outputs(again, ids, mask)
    with torch.no_grad():
        got = ours(ids, padding_mask=mask)
    if expected.dim() == 3:
        expected, got = expected[mask], got[mask]
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-5)


def test_an_encoder_whose_table_is_not_offset_by_the_padding_id_is_refused(tmp_path):
    from aiayn import SequenceClassifier, TransformerConfig

    config = TransformerConfig.preset("encoder-small", vocab_size=50, d_model=16, n_heads=2, d_ff=32,
                                      n_encoder_layers=1, max_length=16, type_vocab_size=1,
                                      num_labels=2, pooler=True, position_offset=3, pad_id=0)
    with pytest.raises(ValueError, match="cannot export as RoBERTa: its positions start at "
                                         "pad_id \\+ 1 = 1"):
        save_pretrained(SequenceClassifier(config), tmp_path / "out")


# --- tokenizers and commands ---------------------------------------------------------------------
def roberta_tokenizer(directory):
    """RoBERTa's layout: a byte-level BPE, <s>=0 <pad>=1 </s>=2 <unk>=3 <mask>=4, <s> X </s>."""
    from tokenizers import processors

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tokenizer = builders._byte_level_bpe(TEXTS * 5 + [t for pair in builders.pairs(300)
                                                      for t in pair], 300, specials)
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    fast = transformers.RobertaTokenizerFast(tokenizer_object=tokenizer)
    fast.save_pretrained(directory)
    return fast


def xlm_roberta_tokenizer(directory):
    """XLM-R's layout: a SentencePiece unigram, <s>=0 <pad>=1 </s>=2 <unk>=3, <mask> last,
    <s> X </s>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    learned = Tokenizer(models.Unigram())
    learned.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    learned.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=["<s>", "<pad>", "</s>",
                                                                      "<unk>"],
                                      unk_token="<unk>", show_progress=False)
    learned.train_from_iterator(TEXTS * 5 + [p[0] for p in builders.pairs(300)], trainer=trainer)
    learned.add_special_tokens(["<mask>"])
    learned.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=learned, bos_token="<s>", eos_token="</s>", cls_token="<s>",
        sep_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
    fast.save_pretrained(directory)
    return fast


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_the_checkpoints_tokenizer_encodes_as_transformers(family, tmp_path):
    make = roberta_tokenizer if family == "roberta" else xlm_roberta_tokenizer
    reference = make(tmp_path)
    ours = WordPieceTokenizer.from_pretrained_dir(tmp_path)
    assert (ours.cls_id, ours.pad_id, ours.sep_id) == (0, 1, 2)
    assert ours.mask_id == reference.mask_token_id and ours.unk_id == reference.unk_token_id
    texts = TEXTS + ["Ünïcödé and  spaces", "x" * 200]
    assert ours.encode(texts, max_length=16) == reference(texts, truncation=True,
                                                          max_length=16)["input_ids"]
    (tmp_path / "run").mkdir()
    ours.save(tmp_path / "run" / "tokenizer.json")
    again = WordPieceTokenizer.load(tmp_path / "run" / "tokenizer.json")
    assert again.special_tokens == ours.special_tokens and again.mask_id == ours.mask_id


def roberta_classifier(directory):
    tokenizer = roberta_tokenizer(directory)
    config = hf_config("roberta", vocab_size=len(tokenizer), max_position_embeddings=66,
                       id2label=dict(enumerate(builders.LABELS)),
                       label2id={name: i for i, name in enumerate(builders.LABELS)})
    torch.manual_seed(0)
    return saved(transformers.RobertaForSequenceClassification(config), directory)


def test_classify_evaluate_and_fine_tune_a_roberta_classifier(tmp_path, capsys):
    """``aiayn classify`` prints transformers' labels and probabilities (its tokenizer, its
    padding); a run fine-tuned from the checkpoint keeps RoBERTa's special tokens and resumes."""
    directory = roberta_classifier(tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    model = transformers.AutoModelForSequenceClassification.from_pretrained(directory).eval()
    with torch.no_grad():
        probabilities = model(**tokenizer(TEXTS, padding=True, return_tensors="pt")
                              ).logits.softmax(-1)
    assert main(["classify", str(directory), *[a for t in TEXTS for a in ("--text", t)]]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert [row[0] for row in rows] == [builders.LABELS[i] for i in probabilities.argmax(-1)]
    for row, expected in zip(rows, probabilities.max(-1).values.tolist()):
        assert float(row[1]) == pytest.approx(expected, abs=6e-5)

    data = tmp_path / "labelled.tsv"
    data.write_text("text\tlabel\n" + "".join(f"{t} {n}\t{label}\n" for n in range(8)
                                              for t, label in zip(TEXTS, builders.LABELS)),
                    encoding="utf-8")
    assert main(["evaluate", str(directory), "--data", str(data), "--split", "all"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"] == 24
    run = tmp_path / "run"
    common = ["train", "classification", "--data", str(data), "--out", str(run), "--init",
              str(directory), "--eval-every", "2", "--save-every", "2", "--batch-size", "8",
              "--threads", "1", "--no-progress"]
    assert main([*common, "--steps", "2"]) == 0
    capsys.readouterr()
    specials = json.loads((run / "special_tokens_map.json").read_text())
    assert specials["cls_token"] == "<s>" and specials["mask_token"] == "<mask>"
    assert main([*common, "--steps", "4"]) == 0  # resumes with the same tokenizer
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 4
    assert main(["classify", str(run), "--text", TEXTS[0]]) == 0
    assert capsys.readouterr().out.split("\t")[0] in builders.LABELS


def test_embed_a_roberta_sentence_encoder(tmp_path, capsys):
    """``aiayn embed`` on a RobertaModel (all-distilroberta-v1's layout): mean pooling over the
    mask and L2 normalisation of transformers' hidden states, as the model cards compute them."""
    directory = tmp_path / "hf"
    tokenizer = roberta_tokenizer(directory)
    torch.manual_seed(0)
    model = transformers.RobertaModel(hf_config("roberta", vocab_size=len(tokenizer),
                                                max_position_embeddings=66))
    saved(model, directory)
    inputs = tmp_path / "texts.txt"
    inputs.write_text("".join(t + "\n" for t in TEXTS), encoding="utf-8")
    assert main(["embed", str(directory), "--input", str(inputs)]) == 0
    printed = torch.tensor([[float(x) for x in line.split()]
                            for line in capsys.readouterr().out.splitlines()])
    encoded = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**encoded).last_hidden_state  # (N, T, D)
    mask = encoded["attention_mask"].unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    assert printed.shape == (3, 32)
    assert (printed - expected).abs().max().item() <= 1e-5
