"""Hugging Face parity: HF models with random weights -> save_pretrained -> aiayn.from_pretrained gives
the same hidden states / logits (<= 1e-4, float32, padded batches); and aiayn.save_pretrained ->
transformers.from_pretrained gives aiayn's outputs back (round trip)."""

import pytest
import torch

import aiayn
from aiayn import TransformerConfig
from aiayn.models import CausalLM, MaskedLM, SequenceClassifier, Transformer, TransformerEncoder
from hf_helpers import (MARIAN_SEPARATE_VOCAB_4, max_diff_where, needs_transformers_5,
                        padded_ids, randomise)

transformers = pytest.importorskip("transformers")


pytestmark = pytest.mark.usefixtures("one_thread")
TOLERANCE = 1e-4

BERT_CONFIGS = {  # odd widths, head counts and layer counts
    "d36-h3-l3": dict(hidden_size=36, num_attention_heads=3, num_hidden_layers=3, intermediate_size=50),
    "d45-h5-l1": dict(hidden_size=45, num_attention_heads=5, num_hidden_layers=1, intermediate_size=31,
                      hidden_act="gelu_new", layer_norm_eps=1e-5, type_vocab_size=3),
    "d64-h8-l2-relu": dict(hidden_size=64, num_attention_heads=8, num_hidden_layers=2,
                           intermediate_size=96, hidden_act="relu", num_labels=5),
}
GPT2_CONFIGS = {
    "d30-h5-l3": dict(n_embd=30, n_head=5, n_layer=3),
    "d33-h3-l1-inner": dict(n_embd=33, n_head=3, n_layer=1, n_inner=47, layer_norm_epsilon=1e-6),
    "d64-h4-l2-gelu-untied": dict(n_embd=64, n_head=4, n_layer=2, activation_function="gelu",
                                  tie_word_embeddings=False),
}
SEQ2SEQ_COMMON = dict(max_position_embeddings=64)
MARIAN_CONFIGS = {
    "d42-h3-e2d3-swish-scaled": dict(d_model=42, encoder_attention_heads=3, decoder_attention_heads=3,
                                     encoder_layers=2, decoder_layers=3, encoder_ffn_dim=50,
                                     decoder_ffn_dim=50, activation_function="swish",
                                     scale_embedding=True),
    "d30-h5-e1d1-gelu": dict(d_model=30, encoder_attention_heads=5, decoder_attention_heads=5,
                             encoder_layers=1, decoder_layers=1, encoder_ffn_dim=37,
                             decoder_ffn_dim=37),
    "d48-h6-e3d2-separate-vocab": dict(d_model=48, encoder_attention_heads=6,
                                       decoder_attention_heads=6, encoder_layers=3, decoder_layers=2,
                                       encoder_ffn_dim=64, decoder_ffn_dim=64,
                                       activation_function="swish", scale_embedding=True,
                                       decoder_vocab_size=45,
                                       share_encoder_decoder_embeddings=False),
}
BART_CONFIGS = {
    "d42-h3-e2d3": dict(d_model=42, encoder_attention_heads=3, decoder_attention_heads=3,
                        encoder_layers=2, decoder_layers=3, encoder_ffn_dim=50, decoder_ffn_dim=50),
    "d35-h7-e1d2-scaled": dict(d_model=35, encoder_attention_heads=7, decoder_attention_heads=7,
                               encoder_layers=1, decoder_layers=2, encoder_ffn_dim=29,
                               decoder_ffn_dim=29, scale_embedding=True),
    "d32-h4-e3d1-relu-untied": dict(d_model=32, encoder_attention_heads=4, decoder_attention_heads=4,
                                    encoder_layers=3, decoder_layers=1, encoder_ffn_dim=40,
                                    decoder_ffn_dim=40, activation_function="relu",
                                    tie_word_embeddings=False),
}
LENGTHS, TARGET_LENGTHS = [9, 5, 7], [6, 8, 3]


def _save_hf(hf_model, tmp_path):
    hf_model.eval()
    randomise(hf_model)
    hf_model.save_pretrained(tmp_path)
    return hf_model


# --- BERT ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("architecture, aiayn_class", [
    ("BertModel", TransformerEncoder), ("BertForMaskedLM", MaskedLM),
    ("BertForSequenceClassification", SequenceClassifier)])
@pytest.mark.parametrize("name, fused", [(name, True) for name in BERT_CONFIGS]
                         + [("d36-h3-l3", False)], ids=lambda v: {True: "fused-qkv",
                                                                   False: "separate-qkv"}.get(v, v))
def test_bert_parity(tmp_path, architecture, aiayn_class, name, fused):
    config = transformers.BertConfig(vocab_size=57, max_position_embeddings=40, **BERT_CONFIGS[name])
    hf = _save_hf(getattr(transformers, architecture)(config), tmp_path)
    ours = aiayn.from_pretrained(tmp_path, fused_projections=fused)
    assert type(ours) is aiayn_class and not ours.training
    ids, mask = padded_ids(57, LENGTHS, pad=0)
    token_types = torch.randint(0, config.type_vocab_size, ids.shape)
    with torch.no_grad():
        reference = hf(input_ids=ids, attention_mask=mask.long(), token_type_ids=token_types)
        out = ours(ids, padding_mask=mask, token_types=token_types)
    if architecture == "BertForSequenceClassification":
        assert out.shape == reference.logits.shape == (3, config.num_labels)
        assert (out - reference.logits).abs().max().item() <= TOLERANCE
    else:
        expected = reference.last_hidden_state if architecture == "BertModel" else reference.logits
        assert max_diff_where(out, expected, mask) <= TOLERANCE


def test_bert_checkpoint_loads_as_another_head(tmp_path):
    """BertModel weights -> a classifier for fine-tuning (pooler loaded, classifier new), and
    BertForMaskedLM weights -> a bare encoder (MLM head dropped): the encoder is the same."""
    config = transformers.BertConfig(vocab_size=57, max_position_embeddings=40,
                                     **BERT_CONFIGS["d36-h3-l3"])
    hf = _save_hf(transformers.BertModel(config), tmp_path)
    classifier = aiayn.from_pretrained(tmp_path, task="classification", num_labels=4)
    assert classifier.head.classifier.out_features == 4
    torch.testing.assert_close(classifier.head.pooler.weight, hf.pooler.dense.weight)
    ids, mask = padded_ids(57, LENGTHS, pad=0)
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        hidden = classifier.encoder(ids, padding_mask=mask)
    assert max_diff_where(hidden, expected, mask) <= TOLERANCE
    mlm_dir = tmp_path / "mlm"
    mlm = _save_hf(transformers.BertForMaskedLM(config), mlm_dir)
    encoder = aiayn.from_pretrained(mlm_dir, task="encoder")
    with torch.no_grad():
        expected = mlm.bert(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        assert max_diff_where(encoder(ids, padding_mask=mask), expected, mask) <= TOLERANCE


# --- GPT-2 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("architecture, name", [
    (architecture, name) for architecture in ("GPT2Model", "GPT2LMHeadModel")
    for name in GPT2_CONFIGS if not (architecture == "GPT2Model" and "untied" in name)])
def test_gpt2_parity(tmp_path, architecture, name):
    config = transformers.GPT2Config(vocab_size=61, n_positions=80, bos_token_id=60,
                                     eos_token_id=60, **GPT2_CONFIGS[name])
    hf = _save_hf(getattr(transformers, architecture)(config), tmp_path)
    ours = aiayn.from_pretrained(tmp_path)
    assert isinstance(ours, CausalLM)
    ids, mask = padded_ids(61, LENGTHS, pad=0)
    with torch.no_grad():
        reference = hf(input_ids=ids, attention_mask=mask.long())
        if architecture == "GPT2Model":
            out, expected = ours.hidden_states(ids, padding_mask=mask), reference.last_hidden_state
        else:
            out, expected = ours(ids, padding_mask=mask), reference.logits
    assert max_diff_where(out, expected, mask) <= TOLERANCE


# --- Marian and BART -----------------------------------------------------------------------------
def _seq2seq_case(family, name):
    if family == "marian":
        fields = MARIAN_CONFIGS[name]
        target_vocab = fields.get("decoder_vocab_size", 60)
        config = transformers.MarianConfig(vocab_size=60, pad_token_id=target_vocab - 1,
                                           decoder_start_token_id=target_vocab - 1, eos_token_id=0,
                                           **SEQ2SEQ_COMMON, **fields)
        return transformers.MarianMTModel(config), config, target_vocab
    config = transformers.BartConfig(vocab_size=60, **SEQ2SEQ_COMMON, **BART_CONFIGS[name])
    return transformers.BartForConditionalGeneration(config), config, 60


@pytest.mark.parametrize("family, name", [
    pytest.param("marian", n, marks=MARIAN_SEPARATE_VOCAB_4 if "separate" in n else ())
    for n in MARIAN_CONFIGS] + [("bart", n) for n in BART_CONFIGS])
def test_seq2seq_parity(tmp_path, family, name):
    hf_model, config, target_vocab = _seq2seq_case(family, name)
    hf = _save_hf(hf_model, tmp_path)
    ours = aiayn.from_pretrained(tmp_path)
    assert isinstance(ours, Transformer)
    src, src_mask = padded_ids(min(60, target_vocab), LENGTHS, pad=config.pad_token_id)
    tgt, tgt_mask = padded_ids(target_vocab, TARGET_LENGTHS, pad=config.pad_token_id, seed=1)
    with torch.no_grad():
        reference = hf(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt,
                       decoder_attention_mask=tgt_mask.long())
        logits = ours(src, tgt, src_padding_mask=src_mask, tgt_padding_mask=tgt_mask)
        memory = ours.encode(src, src_mask)
    assert max_diff_where(logits, reference.logits, tgt_mask) <= TOLERANCE
    assert max_diff_where(memory, reference.encoder_last_hidden_state, src_mask) <= TOLERANCE


@pytest.mark.parametrize("family, name", [("marian", "d42-h3-e2d3-swish-scaled"),
                                          ("bart", "d42-h3-e2d3")])
def test_fine_tuning_gradients_equal_transformers(tmp_path, family, name):
    """One training step's loss and gradients, aiayn's translation loss against transformers'
    own: the same trainable tensors (final_logits_bias is a buffer there, and fixed here too) and
    the same gradient of the shared embedding, whose pad row (Marian's decoder start) takes no
    gradient from lookups there (padding_idx) and none here."""
    from aiayn.interop.hf import from_pretrained
    from aiayn.tasks.translation import translation_loss

    hf_model, config, target_vocab = _seq2seq_case(family, name)
    hf = _save_hf(hf_model, tmp_path)
    ours = from_pretrained(tmp_path)
    pad = config.pad_token_id
    src, _ = padded_ids(target_vocab - 1, LENGTHS, pad=pad)  # Marian's pad is the last id
    labels, mask = padded_ids(target_vocab - 1, TARGET_LENGTHS, pad=pad, seed=1)
    start = torch.full((len(TARGET_LENGTHS), 1), config.decoder_start_token_id)
    decoder_input = torch.cat([start, labels[:, :-1]], dim=1)
    hf_loss = hf(input_ids=src, attention_mask=(src != pad).long(), decoder_input_ids=decoder_input,
                 labels=labels.masked_fill(~mask, -100)).loss
    hf_loss.backward()
    loss = translation_loss(ours, src, decoder_input, labels, pad_id=pad) / mask.sum()
    loss.backward()
    assert loss.item() == pytest.approx(hf_loss.item(), rel=1e-5)
    trainable = sum(p.numel() for p in ours.parameters() if p.requires_grad)
    assert trainable == sum(p.numel() for p in hf.parameters() if p.requires_grad)
    torch.testing.assert_close(ours.decoder.embeddings.tokens.weight.grad,
                               hf.model.shared.weight.grad, rtol=1e-4, atol=1e-6)


def test_separate_vocab_marian_saved_by_transformers_4_loads(tmp_path):
    """transformers < 5 saved a separate-vocabulary Marian's decoder embedding as a copy of the
    source one (vocab_size rows), transformers 5 with decoder_vocab_size rows: aiayn loads both
    layouts to the same model (rows past the target vocabulary are never indexed)."""
    from safetensors.torch import load_file, save_file

    hf_model, config, target_vocab = _seq2seq_case("marian", "d48-h6-e3d2-separate-vocab")
    _save_hf(hf_model, tmp_path / "saved")
    tensors = load_file(tmp_path / "saved" / "model.safetensors")
    key = "model.decoder.embed_tokens.weight"
    rows = tensors[key][:target_vocab]  # the rows both layouts hold
    layouts = {"v5": rows, "v4": torch.cat([rows, torch.randn(config.vocab_size - target_vocab,
                                                              config.d_model)]),
               "neither": rows[:-1]}
    for name, embedding in layouts.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_bytes(
            (tmp_path / "saved" / "config.json").read_bytes())
        save_file({**tensors, key: embedding.contiguous()}, tmp_path / name / "model.safetensors",
                  metadata={"format": "pt"})
    expected, loaded = aiayn.from_pretrained(tmp_path / "v5"), aiayn.from_pretrained(tmp_path / "v4")
    for (name, value), (_, other) in zip(expected.state_dict().items(),
                                         loaded.state_dict().items(), strict=True):
        assert torch.equal(value, other), name
    with pytest.raises(ValueError, match="shape mismatch"):  # any other row count is an error
        aiayn.from_pretrained(tmp_path / "neither")


def test_marian_tokenizer_ids_equal_transformers_on_hard_text(tmp_path):
    """Marian's SentencePiece + vocab.json tokenizer against transformers' MarianTokenizer, source
    and target side: a special token's text inside a sentence is that token's id, as there
    (it was pieces), and the odd inputs (spaces, accents, unseen characters) agree too."""
    pytest.importorskip("sentencepiece")
    from checkpoint_builders import marian

    from aiayn.interop.hf_tokenizer import load_tokenizer

    directory = marian(tmp_path / "marian")
    ours = load_tokenizer(directory)
    theirs = transformers.MarianTokenizer.from_pretrained(directory)
    for text in ["", "   ", "  the  house  ", "</s>", "<unk>", "<pad>", "x</s>y", "a <unk> b",
                 "das Haus</s></s>", "café cafe\u0301 中文 🙂", ">>de<< the house"]:
        assert ours.encode(text) == theirs(text)["input_ids"], text
        assert ours.encode(text, target=True) == theirs(text_target=text)["input_ids"], text
        ids = theirs(text)["input_ids"]
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_marian_positions_are_hf_sinusoids(tmp_path):
    """Marian's sin | cos halves table equals aiayn's "split" layout (and is checked if saved)."""
    hf_model, config, _ = _seq2seq_case("marian", "d42-h3-e2d3-swish-scaled")
    ours = aiayn.from_pretrained(_save_hf(hf_model, tmp_path) and tmp_path)
    table = hf_model.model.encoder.embed_positions.weight
    torch.testing.assert_close(ours.encoder.embeddings.positions.encoding, table, atol=1e-6,
                               rtol=0)


# --- round trip: aiayn -> save_pretrained -> transformers ----------------------------------------
def _randomised(model):
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2
                            + (1.0 if "norm.weight" in name else 0.0))
    return model.eval()


def _bert_config(**changes):
    return TransformerConfig(**{**dict(
        vocab_size=53, d_model=36, n_heads=3, d_ff=44, n_encoder_layers=2, n_decoder_layers=0,
        max_length=32, positions="learned", scale_embeddings=False, embedding_norm=True,
        type_vocab_size=2, activation="gelu", layer_norm_eps=1e-12, dropout=0.1, pad_id=0,
        num_labels=3), **changes})


@pytest.mark.parametrize("aiayn_class, auto", [
    (TransformerEncoder, "AutoModel"), (MaskedLM, "AutoModelForMaskedLM"),
    (SequenceClassifier, "AutoModelForSequenceClassification")])
def test_round_trip_bert(tmp_path, aiayn_class, auto):
    config = _bert_config(pooler=aiayn_class is SequenceClassifier,
                          output_bias=aiayn_class is MaskedLM)
    ours = _randomised(aiayn_class(config))
    aiayn.save_pretrained(ours, tmp_path)
    hf = getattr(transformers, auto).from_pretrained(tmp_path).eval()
    ids, mask = padded_ids(53, LENGTHS, pad=0)
    with torch.no_grad():
        out = ours(ids, padding_mask=mask)
        reference = hf(input_ids=ids, attention_mask=mask.long())
    expected = reference.last_hidden_state if aiayn_class is TransformerEncoder else reference.logits
    if aiayn_class is SequenceClassifier:
        assert (out - expected).abs().max().item() <= TOLERANCE
    else:
        assert max_diff_where(out, expected, mask) <= TOLERANCE
    again = aiayn.from_pretrained(tmp_path)  # and back: bit-identical parameters
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("tied", [True, False])
def test_round_trip_gpt2(tmp_path, tied):
    config = TransformerConfig(vocab_size=59, d_model=30, n_heads=5, d_ff=70, n_encoder_layers=0,
                               n_decoder_layers=2, max_length=48, norm_first=True,
                               positions="learned", scale_embeddings=False,
                               activation="gelu_tanh", tie_output=tied, bos_id=58, eos_id=58,
                               pad_id=58)
    ours = _randomised(CausalLM(config))
    aiayn.save_pretrained(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == "GPT2LMHeadModel"
    ids, mask = padded_ids(59, LENGTHS, pad=0)
    with torch.no_grad():
        assert max_diff_where(ours(ids, padding_mask=mask),
                              hf(input_ids=ids, attention_mask=mask.long()).logits,
                              mask) <= TOLERANCE


@pytest.mark.parametrize("flavour", [
    "marian", pytest.param("marian-separate-vocab", marks=needs_transformers_5(
        "it loads a separate-vocabulary Marian only with the source vocabulary's rows in the "
        "decoder embedding; aiayn writes transformers 5's layout")), "bart", "bart-untied"])
def test_round_trip_seq2seq(tmp_path, flavour):
    common = dict(d_model=42, n_heads=3, d_ff=50, n_encoder_layers=2, n_decoder_layers=2,
                  max_length=40, dropout=0.1, output_bias=True)
    if flavour.startswith("marian"):
        fields = dict(vocab_size=47, positions="sinusoidal", sinusoid_layout="split",
                      activation="silu", pad_id=46, eos_id=0, bos_id=46, decoder_start_id=46)
        if flavour.endswith("separate-vocab"):
            fields.update(src_vocab_size=55, tie_source_target=False)
    else:
        fields = dict(vocab_size=47, positions="learned", position_offset=2, embedding_norm=True,
                      scale_embeddings=False, activation="gelu", pad_id=1, bos_id=0, eos_id=2,
                      decoder_start_id=2, tie_output=flavour != "bart-untied")
    config = TransformerConfig(**common, **fields)
    ours = _randomised(Transformer(config))
    aiayn.save_pretrained(ours, tmp_path)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path).eval()
    assert type(hf).__name__ == ("MarianMTModel" if flavour.startswith("marian")
                                 else "BartForConditionalGeneration")
    src, src_mask = padded_ids(47, LENGTHS, pad=config.pad_id)
    tgt, tgt_mask = padded_ids(47, TARGET_LENGTHS, pad=config.pad_id, seed=1)
    with torch.no_grad():
        out = ours(src, tgt, src_padding_mask=src_mask, tgt_padding_mask=tgt_mask)
        reference = hf(input_ids=src, attention_mask=src_mask.long(), decoder_input_ids=tgt,
                       decoder_attention_mask=tgt_mask.long()).logits
    assert max_diff_where(out, reference, tgt_mask) <= TOLERANCE
    again = aiayn.from_pretrained(tmp_path)
    for (name, a), (_, b) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name


def test_save_refuses_a_config_hf_cannot_express(tmp_path):
    pre_norm_encoder = TransformerEncoder(_bert_config(norm_first=True))
    with pytest.raises(ValueError, match="norm_first"):
        aiayn.save_pretrained(pre_norm_encoder, tmp_path)
    paper = Transformer(TransformerConfig.preset("tiny"))  # interleaved sinusoids: neither family
    with pytest.raises(ValueError, match="sinusoid_layout"):
        aiayn.save_pretrained(paper, tmp_path)
    assert not (tmp_path / "config.json").exists()


@pytest.mark.parametrize("build", [
    lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=57, max_position_embeddings=40, **BERT_CONFIGS["d45-h5-l1"])),
    lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=61, n_positions=80, bos_token_id=60, eos_token_id=60, **GPT2_CONFIGS["d30-h5-l3"])),
    lambda: _seq2seq_case("marian", "d42-h3-e2d3-swish-scaled")[0],
    lambda: _seq2seq_case("bart", "d42-h3-e2d3")[0]], ids=["bert-mlm", "gpt2", "marian", "bart"])
def test_from_transformers_in_memory(build):
    hf = build().eval()
    randomise(hf)
    ours = aiayn.from_transformers(hf)
    ids, mask = padded_ids(44, LENGTHS, pad=hf.config.pad_token_id or 0)
    with torch.no_grad():
        if isinstance(ours, Transformer):
            out = ours(ids, ids, src_padding_mask=mask, tgt_padding_mask=mask)
            expected = hf(input_ids=ids, attention_mask=mask.long(), decoder_input_ids=ids,
                          decoder_attention_mask=mask.long()).logits
        else:
            out, expected = ours(ids, padding_mask=mask), hf(input_ids=ids,
                                                             attention_mask=mask.long()).logits
    assert max_diff_where(out, expected, mask) <= TOLERANCE
