"""DeBERTa-v2/v3 checkpoints (``aiayn.interop.hf_deberta``, ``aiayn.nn.disentangled``) against
``transformers`` built from small configs (random weights, no download): hidden states, masked-LM
logits (both head layouts) and classifier logits within 1e-4 at every real position of
right-padded rows, for v3-style (shared projections, log buckets, LayerNorm'd relative embeddings,
no absolute positions) and v2-style (own position projections, clamped distances, absolute
positions) configs with both and with one score term; the terms matter; inputs past
max_position_embeddings without an absolute table (refused with one); a seeded training run with
dropout (each layer's own mask of the relative table); the shared projections computing no value
rows; the disentangled terms against explicit loops; Microsoft's file layout; heads a checkpoint
lacks; round trips through ``save_pretrained``; the commands on a checkpoint directory with a
SentencePiece-unigram tokenizer.json, cutting texts to max_position_embeddings; refusals naming
the field."""

from __future__ import annotations

import json
import math

import pytest
import torch

import aiayn
from aiayn import MaskedLM, SequenceClassifier, TransformerConfig, TransformerEncoder
from aiayn.cli import main
from aiayn.nn.disentangled import (Disentangled, DisentangledTerms, RelativeTable, log_bucket,
                                   relative_rows)
from hf_helpers import assert_round_trip, padded_ids, randomise

import checkpoint_builders as builders

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 97
LENGTHS = [30, 17, 5]  # right padding; 30 positions: past the exact distances of 8 buckets
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0, num_labels=3, pad_token_id=0)
V3 = dict(relative_attention=True, position_buckets=8, max_relative_positions=64,
          norm_rel_ebd="layer_norm", share_att_key=True, pos_att_type=["p2c", "c2p"],
          position_biased_input=False)
V2 = dict(relative_attention=True, position_buckets=-1, max_relative_positions=12,
          share_att_key=False, pos_att_type="c2p|p2c", position_biased_input=True,
          type_vocab_size=2)
CONFIGS = {"v3": V3, "v3-256-buckets": dict(V3, position_buckets=256, max_relative_positions=-1),
           "v3-c2p": dict(V3, pos_att_type=["c2p"]), "v2": V2,
           "v2-p2c": dict(V2, pos_att_type="p2c")}
KINDS = {"Model": TransformerEncoder, "ForMaskedLM": MaskedLM,
         "ForSequenceClassification": SequenceClassifier}


def hf_model(kind: str = "Model", *, seed: int = 0, **fields):
    config = transformers.DebertaV2Config(**{**SIZES, **V3, **fields})
    torch.manual_seed(seed)
    model = getattr(transformers, f"DebertaV2{kind}")(config).eval()
    randomise(model, std=0.2)  # relative embeddings too: c2p and p2c are far from zero
    return model


def saved(model, directory):
    model.save_pretrained(directory)
    return directory


@torch.no_grad()
def outputs(hf, ours, lengths=LENGTHS):
    """(aiayn's, transformers') outputs on right-padded rows, real positions only: (N, ...)."""
    ids, mask = padded_ids(VOCAB, lengths, pad=0)
    out = hf(ids, attention_mask=mask.long())
    want = out.last_hidden_state if hasattr(out, "last_hidden_state") else out.logits
    got = ours(ids, padding_mask=mask)
    return (got[mask], want[mask]) if want.dim() == 3 else (got, want)


@pytest.mark.parametrize("variant", sorted(CONFIGS))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_outputs_equal_transformers(kind, variant, tmp_path):
    hf = hf_model(kind, **CONFIGS[variant])
    ours = aiayn.from_pretrained(saved(hf, tmp_path / "hf"))
    assert type(ours) is KINDS[kind]
    got, want = outputs(hf, ours)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    # the disentangled terms matter: without them the outputs move far
    stack = ours.encoder if kind == "Model" else ours.encoder.encoder
    stack.relative = None
    assert (outputs(hf, ours)[0] - want).abs().max().item() > 1e-2


def test_in_memory_models_and_the_unfused_projections_agree():
    hf = hf_model("ForSequenceClassification", **V2)
    got, want = outputs(hf, aiayn.interop.hf.from_transformers(hf, fused_projections=False,
                                                                attention="reference"))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


# --- inputs past max_position_embeddings ---------------------------------------------------------
LONG = {  # max_position_embeddings 512 and no absolute table: relative distances only
    "v3-base-buckets": dict(V3, position_buckets=256, max_relative_positions=-1,
                            max_position_embeddings=512),
    "v3-8-buckets": dict(V3, max_position_embeddings=512),
    "clamped": dict(V2, position_biased_input=False, max_position_embeddings=512)}


@pytest.mark.parametrize("variant", sorted(LONG))
def test_inputs_past_max_position_embeddings_equal_transformers_without_an_absolute_table(
        variant):
    """transformers runs a model without ``position_biased_input`` on any length, its distances
    bucketed up to ``max_relative_positions`` and clamped to the 2k rows: so does aiayn."""
    hf = hf_model("Model", **LONG[variant])
    ours = aiayn.interop.hf.from_transformers(hf)
    assert ours.config.max_length == 512
    got, want = outputs(hf, ours, lengths=[600, 530, 7])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_inputs_past_an_absolute_table_or_a_bare_max_length_are_refused():
    ours = aiayn.interop.hf.from_transformers(hf_model("Model", **V2))  # positions "learned", 64
    ids, mask = padded_ids(VOCAB, [65], pad=0)
    with pytest.raises(ValueError, match="65 positions exceeds the position table"):
        ours(ids, padding_mask=mask)
    # no position information at all: max_length holds (T5's relative bias runs any length,
    # tests/test_hf_t5.py)
    config = TransformerConfig(vocab_size=VOCAB, d_model=16, n_heads=2, d_ff=16,
                               n_encoder_layers=1, n_decoder_layers=0, positions="none",
                               max_length=64)
    assert config.position_limit == 64
    with pytest.raises(ValueError, match="65 positions exceeds max_length=64"):
        TransformerEncoder(config)(ids)


# --- dropout on the relative table, each layer its own mask --------------------------------------
def test_each_layer_drops_the_relative_table_with_a_mask_of_its_own():
    """Training with dropout (transformers' ``pos_dropout`` in every layer's attention, drawn
    after the embeddings' dropout and before the layer's output dropouts): the same seed gives
    the same outputs as transformers, so every layer draws its own mask where transformers does;
    in eval mode the outputs agree too."""
    hf = hf_model("Model", hidden_dropout_prob=0.2)  # 30 positions: the whole table of 16 rows
    ours = aiayn.interop.hf.from_transformers(hf)
    assert ours.config.dropout == 0.2 and ours.config.attention_dropout == 0.0
    hf.train(), ours.train()
    ids, mask = padded_ids(VOCAB, LENGTHS, pad=0)
    tables = []
    dropout = ours.encoder.relative.dropout
    hook = dropout.register_forward_hook(lambda module, args, out: tables.append(out))
    with torch.no_grad():
        torch.manual_seed(1)
        want = hf(ids, attention_mask=mask.long()).last_hidden_state
        torch.manual_seed(1)
        got = ours(ids, padding_mask=mask)
    hook.remove()
    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-4)
    assert len(tables) == 2 and tables[0].shape == (16, 64)
    assert not torch.equal(tables[0] == 0, tables[1] == 0)  # two layers, two masks
    hf.eval(), ours.eval()
    got, want = outputs(hf, ours)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


# --- the shared projections of the relative table ------------------------------------------------
@pytest.mark.parametrize("fused", [True, False])
def test_shared_projections_project_the_table_to_queries_and_keys_only(fused):
    """DeBERTa-v3's ``share_att_key``: the layer's query and key projections project the table,
    its value rows are never computed (counted in FLOPs), and the outputs equal transformers'
    with fused and separate projections alike."""
    from torch.utils.flop_counter import FlopCounterMode

    from aiayn.nn.disentangled import project_query_key

    hf = hf_model("Model")
    ours = aiayn.interop.hf.from_transformers(hf, fused_projections=fused)
    got, want = outputs(hf, ours)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    attention = ours.encoder.layers[0].self_attention
    table = torch.randn(1, 16, 64)  # (1, R, D)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        q_r, k_r = project_query_key(attention, table)
    assert counter.get_total_flops() == 2 * 16 * 64 * (2 * 64)  # (R, D) x (D, 2D), no values
    with torch.no_grad():
        q_all, k_all, _ = attention.project(table)
    torch.testing.assert_close(q_r, q_all, rtol=0, atol=1e-6)
    torch.testing.assert_close(k_r, k_all, rtol=0, atol=1e-6)


def test_masked_lm_head_in_transformers_5s_layout(tmp_path):
    """``legacy: false`` (transformers 5) writes ``lm_predictions.lm_head.*``; transformers 4 has
    only ``cls.predictions.*`` and ignores the field: each file is read as it is."""
    hf = hf_model("ForMaskedLM", legacy=False)
    directory = saved(hf, tmp_path / "hf")
    ours = aiayn.from_pretrained(directory)
    got, want = outputs(hf, ours)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def microsoft_layout(tmp_path):
    """Microsoft's deberta-v3 files: no architectures, the base under ``deberta.``, an MLM head
    (``lm_predictions``) and the replaced-token-detection head (``mask_predictions``)."""
    from safetensors.torch import save_file

    hf = hf_model("ForMaskedLM")  # transformers 4 has only the cls.predictions layout
    directory = saved(hf, tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    config.pop("architectures")
    config["pos_att_type"] = "p2c|c2p"
    (directory / "config.json").write_text(json.dumps(config))
    renamed = {"cls.predictions.transform.": "lm_predictions.lm_head.",
               "cls.predictions.bias": "lm_predictions.lm_head.bias"}
    tensors = {}
    for key, value in hf.state_dict().items():
        for old, new in renamed.items():
            key = key.replace(old, new)
        if not key.startswith("cls."):  # the decoder: the word embeddings and the bias again
            tensors[key] = value.contiguous()
    tensors.update({"mask_predictions.dense.weight": torch.zeros(64, 64),
                    "mask_predictions.classifier.weight": torch.zeros(1, 64)})
    save_file(tensors, str(directory / "model.safetensors"))
    return hf, directory


def test_microsofts_file_layout_loads_as_an_encoder_or_a_masked_lm(tmp_path):
    hf, directory = microsoft_layout(tmp_path)
    assert aiayn.interop.hf.checkpoint_task(directory) == "encoder"
    encoder = aiayn.from_pretrained(directory)
    assert type(encoder) is TransformerEncoder
    ids, mask = padded_ids(VOCAB, LENGTHS, pad=0)
    with torch.no_grad():
        want = hf.deberta(ids, attention_mask=mask.long()).last_hidden_state
        torch.testing.assert_close(encoder(ids, padding_mask=mask)[mask], want[mask], rtol=0,
                                   atol=1e-4)
    got, want = outputs(hf, aiayn.from_pretrained(directory, task="masked_lm"))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_heads_a_checkpoint_lacks_are_new(tmp_path):
    hf = hf_model("Model")
    directory = saved(hf, tmp_path / "hf")
    classifier = aiayn.from_pretrained(directory, task="classification", num_labels=4)
    assert classifier.head.classifier.out_features == 4
    ids, mask = padded_ids(VOCAB, LENGTHS, pad=0)
    with torch.no_grad():
        want = hf(ids, attention_mask=mask.long()).last_hidden_state
        got = classifier.encoder(ids, padding_mask=mask)
    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=1e-4)
    classifier_file = saved(hf_model("ForSequenceClassification"), tmp_path / "classifier")
    assert type(aiayn.from_pretrained(classifier_file, task="encoder")) is TransformerEncoder


@pytest.mark.parametrize("variant", ["v3", "v2"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_round_trip_loads_in_transformers_as_deberta(kind, variant, tmp_path):
    hf = hf_model(kind, **CONFIGS[variant])
    ours = aiayn.from_pretrained(saved(hf, tmp_path / "hf"))
    aiayn.save_pretrained(ours, tmp_path / "ours")
    again = getattr(transformers, f"DebertaV2{kind}").from_pretrained(tmp_path / "ours").eval()
    if kind != "Model":
        ids, _ = padded_ids(VOCAB, [12, 12], pad=0)
        assert_round_trip(hf, ours, again, ids, path=tmp_path / "ours")
        return
    torch.testing.assert_close(outputs(again, ours), outputs(hf, ours), rtol=0, atol=1e-5)
    assert aiayn.from_pretrained(tmp_path / "ours").config == ours.config
    want = hf.state_dict()
    assert again.state_dict().keys() == want.keys()
    for name, tensor in again.state_dict().items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)


# --- the disentangled terms, written out ---------------------------------------------------------
def python_bucket(distance: int, buckets: int, max_distance: int) -> int:
    """DeBERTa's log bucket of one signed distance, in Python floats."""
    mid = buckets // 2
    if abs(distance) <= mid:
        return distance
    step = math.ceil(math.log(abs(distance) / mid) / math.log((max_distance - 1) / mid)
                     * (mid - 1)) + mid
    return step if distance > 0 else -step


@pytest.mark.parametrize("buckets", [None, 4, 8])
@pytest.mark.parametrize("terms", [("c2p", "p2c"), ("c2p",), ("p2c",)])
def test_disentangled_terms_equal_explicit_loops(terms, buckets):
    spec = Disentangled(terms=terms, span=buckets or 3, max_distance=buckets and 20,
                        share_projections=False, norm=False)
    length, heads, width = 11, 2, 8
    config = TransformerConfig(vocab_size=10, d_model=heads * width, n_heads=heads, d_ff=8,
                               n_encoder_layers=1, n_decoder_layers=0, attention="reference",
                               attention_scale=0.3, disentangled_attention=vars(spec))
    attention = TransformerEncoder(config).encoder.layers[0].self_attention
    terms_module = attention.disentangled
    assert isinstance(terms_module, DisentangledTerms)
    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, heads, length, width, generator=generator) for _ in range(2))
    table = torch.randn(2 * spec.span, heads * width, generator=generator)
    rows = relative_rows(length, spec, torch.device("cpu"))
    got = terms_module(q, k, RelativeTable(table, rows), attention)
    with torch.no_grad():
        k_r = terms_module.key_proj(table) if "c2p" in terms else None  # (R, H * Dh)
        q_r = terms_module.query_proj(table) if "p2c" in terms else None
    want = torch.zeros(2, heads, length, length)
    for i in range(length):
        for j in range(length):
            distance = i - j if buckets is None else python_bucket(i - j, buckets, 20)
            row = min(max(distance + spec.span, 0), 2 * spec.span - 1)
            assert rows[i, j] == row
            for h in range(heads):
                part = slice(h * width, (h + 1) * width)
                if k_r is not None:
                    want[:, h, i, j] += q[:, h, i] @ k_r[row, part]
                if q_r is not None:
                    want[:, h, i, j] += k[:, h, j] @ q_r[row, part]
    torch.testing.assert_close(got, want * 0.3, rtol=0, atol=1e-5)


@pytest.mark.parametrize("span, max_distance, length", [(256, 512, 40), (256, 512, 129),
                                                         (256, 512, 130), (8, 64, 30),
                                                         (12, None, 5), (12, None, 30)])
def test_the_table_cut_to_the_reachable_rows_reads_the_same_vectors(span, max_distance, length):
    """A short sequence reaches rows k - (T - 1) .. k + (T - 1) only: the cut table and its row
    index pick the same (LayerNorm'd) vector for every pair as the whole table."""
    from aiayn.nn.disentangled import RelativeEmbeddings

    spec = Disentangled(terms=("c2p",), span=span, max_distance=max_distance)
    module = RelativeEmbeddings(spec, 16, eps=1e-7, dropout=0.0)
    with torch.no_grad():
        module.norm.weight.normal_()
        table = module(length)
        rows = relative_rows(length, spec, torch.device("cpu"))
        whole = module.norm(module.embedding.weight)[rows]  # (T, T, D)
    assert table.embeddings.shape[0] == (min(2 * length - 1, 2 * span)
                                         if max_distance is None or length - 1 <= span // 2
                                         else 2 * span)
    torch.testing.assert_close(table.embeddings[table.rows], whole, rtol=0, atol=0)


def test_log_buckets_equal_transformers():
    from transformers.models.deberta_v2.modeling_deberta_v2 import make_log_bucket_position

    distances = torch.arange(-700, 701)
    for buckets, max_distance in ((256, 512), (8, 64), (4, 20), (32, 100)):
        want = make_log_bucket_position(distances, buckets, max_distance).long()
        assert torch.equal(log_bucket(distances, buckets, max_distance), want)


# --- tokenizer and commands ----------------------------------------------------------------------
TEXTS = ["a game of chess for two players", "the network daemon serves files",
         "play sounds from the command line"]


def deberta_tokenizer(directory):
    """DeBERTa-v3's layout: a SentencePiece unigram (Metaspace), [PAD]=0 [CLS]=1 [SEP]=2
    [UNK]=3, [MASK] last, [CLS] X [SEP]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    learned = Tokenizer(models.Unigram())
    learned.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    learned.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=["[PAD]", "[CLS]", "[SEP]",
                                                                      "[UNK]"],
                                      unk_token="[UNK]", show_progress=False)
    learned.train_from_iterator(TEXTS * 5 + [p[0] for p in builders.pairs(200)], trainer=trainer)
    learned.add_special_tokens(["[MASK]"])
    learned.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=learned, bos_token="[CLS]", eos_token="[SEP]", cls_token="[CLS]",
        sep_token="[SEP]", pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]")
    fast.save_pretrained(directory)
    return fast


def deberta_directory(directory, kind: str = "ForSequenceClassification"):
    tokenizer = deberta_tokenizer(directory)
    labels = dict(id2label=dict(enumerate(builders.LABELS)),
                  label2id={name: i for i, name in enumerate(builders.LABELS)})
    hf = hf_model(kind, vocab_size=len(tokenizer), bos_token_id=1, eos_token_id=2, **labels)
    return tokenizer, hf, saved(hf, directory)


def test_classify_evaluate_and_fine_tune_a_deberta_classifier(tmp_path, capsys):
    tokenizer, model, directory = deberta_directory(tmp_path / "hf")
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
    run = tmp_path / "run"  # v3 has no position table: --max-tokens past its 64 positions
    assert main(["train", "classification", "--data", str(data), "--out", str(run), "--init",
                 str(directory), "--eval-every", "2", "--save-every", "2", "--batch-size", "8",
                 "--threads", "1", "--no-progress", "--steps", "2", "--max-tokens", "80"]) == 0
    capsys.readouterr()
    assert json.loads((run / "run.json").read_text())["assets"]["max_tokens"] == 80
    text = " ".join(TEXTS * 8)
    assert len(tokenizer(text)["input_ids"]) > 80
    assert main(["classify", str(run), "--text", TEXTS[0], "--text", text]) == 0
    rows = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 2 and {row[0] for row in rows} <= set(builders.LABELS)


def test_the_commands_cut_texts_to_max_position_embeddings(tmp_path, capsys):
    """The model runs longer inputs, but ``classify`` (like ``evaluate`` and ``embed``) keeps the
    checkpoint's limit: a long text is cut to max_position_embeddings (64) tokens, as
    transformers' tokenizer cuts it with truncation."""
    tokenizer, model, directory = deberta_directory(tmp_path / "hf")
    text = " ".join(TEXTS * 8)
    assert len(tokenizer(text)["input_ids"]) > 64
    with torch.no_grad():
        encoded = tokenizer([text], truncation=True, max_length=64, return_tensors="pt")
        probabilities = model(**encoded).logits.softmax(-1)[0]
    assert main(["classify", str(directory), "--text", text]) == 0
    label, probability = capsys.readouterr().out.split("\t")[:2]
    assert label == builders.LABELS[probabilities.argmax()]
    assert float(probability) == pytest.approx(probabilities.max().item(), abs=6e-5)


def test_embed_a_deberta_encoder(tmp_path, capsys):
    tokenizer, model, directory = deberta_directory(tmp_path / "hf", "Model")
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
    assert printed.shape == (3, 64)
    assert (printed - expected).abs().max().item() <= 1e-5


def test_a_sentencepiece_model_without_tokenizer_json_is_refused(tmp_path, capsys):
    from aiayn.data.wordpiece import WordPieceTokenizer

    directory = saved(hf_model("ForSequenceClassification"), tmp_path / "hf")
    (directory / "spm.model").write_bytes(b"\x00sentencepiece")
    with pytest.raises(ValueError, match="no tokenizer.json.*save_pretrained"):
        WordPieceTokenizer.from_pretrained_dir(directory)
    assert main(["classify", str(directory), "--text", TEXTS[0]]) != 0
    assert "spm.model but no tokenizer.json" in capsys.readouterr().err


# --- refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, message", [
    ("conv_kernel_size", 3, "conv_kernel_size=3"),
    ("embedding_size", 32, "embedding_size=32"),
    ("pooler_hidden_size", 32, "pooler_hidden_size=32"),
    ("pos_att_type", ["c2p", "p2p"], "pos_att_type="),
    ("pos_att_type", None, "no pos_att_type"),
    ("norm_rel_ebd", "rms_norm", "norm_rel_ebd='rms_norm'"),
    ("hidden_act", "tanh", "hidden_act='tanh'"),
    ("pooler_hidden_act", "mish", "pooler_hidden_act='mish'"),
    ("model_type", "deberta", "model_type='deberta'"),
])
def test_unsupported_configs_are_refused_naming_the_field(field, value, message, tmp_path):
    directory = saved(hf_model("ForSequenceClassification"), tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    config[field] = value
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message.replace("[", r"\[")):
        aiayn.from_pretrained(directory)


@pytest.mark.parametrize("settings, message", [
    (dict(terms=["c2c"], span=4), "terms must be"),
    (dict(terms=["c2p"], span=1), "span must be"),
    (dict(terms=["c2p"], span=4, buckets=3), "must be a dict"),
    (dict(terms=["c2p"], span=4, norm="yes"), "norm must be"),
])
def test_config_checks_disentangled_attention(settings, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig(n_decoder_layers=0, disentangled_attention=settings)
    with pytest.raises(ValueError, match="n_decoder_layers=0"):
        TransformerConfig(disentangled_attention=dict(terms=["c2p"], span=4))
    with pytest.raises(ValueError, match="attention 'fused' or 'reference'"):
        TransformerConfig(n_decoder_layers=0, attention="linear",
                          disentangled_attention=dict(terms=["c2p"], span=4))


def test_a_model_with_other_blocks_is_not_exported_as_deberta(tmp_path):
    hf = hf_model("Model")
    ours = aiayn.from_pretrained(saved(hf, tmp_path / "hf"))
    ours.config = ours.config.replace(attention_scale=0.5)
    with pytest.raises(ValueError, match="attention_scale=0.5"):
        aiayn.save_pretrained(ours, tmp_path / "ours")
