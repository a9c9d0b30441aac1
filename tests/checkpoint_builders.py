"""Small Hugging Face checkpoint directories built offline, as a hub download would lay them out:
config.json + model.safetensors from ``transformers`` (random weights) and the tokenizer files of
that family, trained on the bundled data and saved by ``transformers`` itself:

    marian   source.spm / target.spm (SentencePiece unigram) + vocab.json + tokenizer_config.json
    bart     tokenizer.json (byte-level BPE, <s> ... </s>) + tokenizer_config.json
    gpt2     tokenizer.json (byte-level BPE, no special tokens added) + tokenizer_config.json
    bert     tokenizer.json + vocab.txt (WordPiece, [CLS] ... [SEP]), a sequence classifier
    distilbert  bert's tokenizer files (saved as DistilBERT's), a DistilBertForSequenceClassification
    t5       tokenizer.json (SentencePiece-style unigram, ... </s>; <pad>=0 </s>=1 <unk>=2 and
             <extra_id_*> sentinels) + tokenizer_config.json, T5 1.1 (gated-gelu, head untied)
    llama    tokenizer.json (Llama 2's byte-fallback BPE: <unk>=0 <s>=1 </s>=2, <0x00>..<0xFF>,
             <s> ... added) + tokenizer_config.json, grouped-query attention (4 heads, 2 kv)
    gemma3   llama's tokenizer files (<s> added), a Gemma3ForCausalLM: sandwich norms, QK-norm, one
             global layer after two sliding ones (window 8), local and global RoPE bases
    gemma2   llama's tokenizer files, a Gemma2ForCausalLM: sandwich norms, the even layers
             sliding (window 8), soft-capped scores and logits
    qwen3    tokenizer.json (byte-level BPE, Qwen's <|endoftext|> and chat markers, nothing added)
             + tokenizer_config.json with a ChatML chat template (``CHATML``), QK-norm,
             grouped-query attention, a head width of its own
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch

from hf_helpers import randomise

DATA = Path(__file__).resolve().parents[1] / "data"
LABELS = ("games", "net", "sound")


def pairs(limit: int = 1000) -> list[tuple[str, str]]:
    with gzip.open(DATA / "ddtp_en_de.tsv.gz", "rt", encoding="utf-8") as stream:
        rows = [line.rstrip("\n").split("\t") for line in stream][1:limit + 1]
    return [(row[0], row[1]) for row in rows]


def shakespeare(characters: int = 60_000) -> str:
    with gzip.open(DATA / "shakespeare_tiny.txt.gz", "rt", encoding="utf-8") as stream:
        return stream.read(characters)


def marian(directory: Path, *, vocab: int = 300, seed: int = 0) -> Path:
    """A MarianMTModel with one SentencePiece model for both sides and OPUS's id layout:
    </s> = 0, <unk> = 1, the pieces, <pad> last (also the decoder start)."""
    import sentencepiece
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    text = directory / "corpus.txt"
    text.write_text("".join(f"{en}\n{de}\n" for en, de in pairs()), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(text), model_prefix=str(directory / "spm"), vocab_size=vocab,
        model_type="unigram", character_coverage=1.0, bos_id=-1, eos_id=-1, unk_id=0,
        minloglevel=2)
    text.unlink()
    for name in ("source.spm", "target.spm"):
        (directory / name).write_bytes((directory / "spm.model").read_bytes())
    (directory / "spm.model").unlink()
    (directory / "spm.vocab").unlink()
    processor = sentencepiece.SentencePieceProcessor(model_file=str(directory / "source.spm"))
    pieces = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
    vocabulary = {"</s>": 0, "<unk>": 1}
    for piece in pieces:
        vocabulary.setdefault(piece, len(vocabulary))
    vocabulary["<pad>"] = len(vocabulary)
    (directory / "vocab.json").write_text(json.dumps(vocabulary), encoding="utf-8")
    tokenizer = transformers.MarianTokenizer(str(directory / "source.spm"),
                                             str(directory / "target.spm"),
                                             str(directory / "vocab.json"))
    tokenizer.save_pretrained(directory)
    pad = vocabulary["<pad>"]
    config = transformers.MarianConfig(
        vocab_size=len(vocabulary), decoder_vocab_size=len(vocabulary), pad_token_id=pad,
        decoder_start_token_id=pad, eos_token_id=0, max_position_embeddings=128, d_model=32,
        encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
        scale_embedding=True, activation_function="swish")
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(config).eval()
    randomise(model, std=0.3)
    model.save_pretrained(directory)
    return directory


def _byte_level_bpe(texts: list[str], vocab: int, specials: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def bart(directory: Path, *, vocab: int = 400, seed: int = 0) -> Path:
    """A BartForConditionalGeneration with a byte-level BPE tokenizer: <s>=0 <pad>=1 </s>=2."""
    import transformers
    from tokenizers import processors

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tokenizer = _byte_level_bpe([t for pair in pairs() for t in pair], vocab, specials)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", mask_token="<mask>")
    fast.save_pretrained(directory)
    config = transformers.BartConfig(
        vocab_size=tokenizer.get_vocab_size(), d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=128, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.BartForConditionalGeneration(config).eval()
    randomise(model, std=0.3, skip=())
    model.save_pretrained(directory)
    return directory


def gpt2(directory: Path, *, vocab: int = 400, seed: int = 0) -> Path:
    """A GPT2LMHeadModel with a byte-level BPE tokenizer trained on the bundled Shakespeare."""
    import transformers

    text = shakespeare()
    tokenizer = _byte_level_bpe(text.splitlines(keepends=True), vocab, ["<|endoftext|>"])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
        unk_token="<|endoftext|>")
    fast.save_pretrained(directory)
    eos = tokenizer.token_to_id("<|endoftext|>")
    config = transformers.GPT2Config(vocab_size=tokenizer.get_vocab_size(), n_positions=64,
                                     n_embd=32, n_layer=2, n_head=4, bos_token_id=eos,
                                     eos_token_id=eos)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    randomise(model, std=0.3)
    model.save_pretrained(directory)
    return directory


def bert_classifier(directory: Path, texts: list[str], *, seed: int = 0) -> Path:
    """A BertForSequenceClassification over ``LABELS`` with a WordPiece vocabulary learned on
    ``texts`` (tokenizer.json with BERT's [CLS] ... [SEP] template, and vocab.txt)."""
    import transformers

    from aiayn.data.wordpiece import WordPieceTokenizer

    learned = WordPieceTokenizer.train(texts, vocab_size=200)
    vocabulary = learned._tokenizer.get_vocab()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "vocab.txt").write_text(
        "".join(token + "\n" for token, _ in sorted(vocabulary.items(), key=lambda kv: kv[1])),
        encoding="utf-8")
    # Read from vocab.txt (transformers 5 ignores a vocab_file argument: the tokenizer.json it
    # wrote held the 5 special tokens alone, and every word was [UNK])
    transformers.BertTokenizerFast.from_pretrained(directory).save_pretrained(directory)
    config = transformers.BertConfig(
        vocab_size=len(vocabulary), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, num_labels=len(LABELS),
        id2label=dict(enumerate(LABELS)), label2id={name: i for i, name in enumerate(LABELS)})
    torch.manual_seed(seed)
    model = transformers.BertForSequenceClassification(config).eval()
    randomise(model, std=0.3, skip=())
    model.save_pretrained(directory)
    return directory


def distilbert_classifier(directory: Path, texts: list[str], *, seed: int = 0) -> Path:
    """A DistilBertForSequenceClassification over ``LABELS`` with the WordPiece vocabulary
    (vocab.txt) of ``bert_classifier``, and the tokenizer.json ``DistilBertTokenizerFast`` makes of
    it (read from vocab.txt: transformers 5 ignores a ``vocab_file`` argument)."""
    import transformers

    bert_classifier(directory, texts)  # the vocabulary; the BERT files are replaced below
    for path in directory.iterdir():
        if path.name != "vocab.txt":
            path.unlink()
    tokenizer = transformers.DistilBertTokenizerFast.from_pretrained(directory)
    tokenizer.save_pretrained(directory)
    config = transformers.DistilBertConfig(
        vocab_size=len(tokenizer), dim=32, n_layers=2, n_heads=4, hidden_dim=64,
        max_position_embeddings=64, num_labels=len(LABELS), id2label=dict(enumerate(LABELS)),
        label2id={name: i for i, name in enumerate(LABELS)})
    torch.manual_seed(seed)
    model = transformers.DistilBertForSequenceClassification(config).eval()
    randomise(model, std=0.3, skip=())
    model.save_pretrained(directory)
    return directory


def t5(directory: Path, *, vocab: int = 300, sentinels: int = 4, seed: int = 0) -> Path:
    """A T5ForConditionalGeneration (T5 1.1: gated-gelu, a head of its own) with a unigram
    vocabulary laid out as T5's: <pad>=0 (also the decoder start), </s>=1, <unk>=2, the pieces,
    then ``sentinels`` <extra_id_*> tokens; ``transformers.T5Tokenizer`` writes the files."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    learned = Tokenizer(models.Unigram())
    learned.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)])
    trainer = trainers.UnigramTrainer(vocab_size=vocab, special_tokens=["<pad>", "</s>", "<unk>"],
                                      unk_token="<unk>", show_progress=False)
    learned.train_from_iterator([t for pair in pairs() for t in pair], trainer=trainer)
    pieces = [tuple(piece) for piece in json.loads(learned.to_str())["model"]["vocab"]]
    tokenizer = transformers.T5Tokenizer(vocab=pieces, extra_ids=sentinels)
    tokenizer.save_pretrained(directory)
    config = transformers.T5Config(
        vocab_size=len(tokenizer), d_model=32, d_ff=48, num_layers=2, num_heads=4,
        relative_attention_num_buckets=8, relative_attention_max_distance=20,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, pad_token_id=0,
        eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(config).eval()
    randomise(model, std=0.3)
    with torch.no_grad():  # make </s> likelier, so outputs end at different lengths
        model.lm_head.weight[1] *= 3.0
    model.save_pretrained(directory)
    return directory


def llama(directory: Path, *, vocab: int = 600, seed: int = 0) -> Path:
    """A LlamaForCausalLM with grouped-query attention (4 heads, 2 key/value heads) and Llama 2's
    tokenizer layout: <unk>=0 <s>=1 </s>=2, the byte tokens <0x00>..<0xFF> (byte fallback), then
    BPE pieces learned on the bundled Shakespeare; ``transformers.LlamaTokenizer`` writes the
    files, with <s> added in front of every text (``add_bos_token``) as Llama 2's does."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    learned = Tokenizer(models.BPE())
    learned.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first",
                                                     split=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=specials, show_progress=False)
    learned.train_from_iterator(shakespeare().splitlines(keepends=True), trainer=trainer)
    model_json = json.loads(learned.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model_json["merges"]]
    tokenizer = transformers.LlamaTokenizer(vocab=model_json["vocab"], merges=merges,
                                            add_bos_token=True)
    tokenizer.save_pretrained(directory)
    # The byte tokens are ordinary pieces of the vocabulary, as in Llama 2 (not added tokens).
    saved = json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))
    saved["added_tokens"] = [t for t in saved["added_tokens"] if t["id"] < 3]
    (directory / "tokenizer.json").write_text(json.dumps(saved), encoding="utf-8")
    config = transformers.LlamaConfig(
        vocab_size=len(model_json["vocab"]), hidden_size=32, intermediate_size=48,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    randomise(model, std=0.3, skip=("rotary_emb",))
    model.save_pretrained(directory)
    return directory


# A ChatML chat template (the layout of Qwen's), written for these tests: a default system message,
# raise_exception on unknown roles, the assistant's turn opened when add_generation_prompt
CHATML = (
    "{%- if messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- set turns = messages[1:] %}"
    "{%- else %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- set turns = messages %}"
    "{%- endif %}\n"
    "{%- for message in turns %}\n"
    "{%- if message.role not in ['user', 'assistant'] %}"
    "{{ raise_exception('roles must be user or assistant, got ' + message.role) }}"
    "{%- endif %}\n"
    "{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def qwen3(directory: Path, *, vocab: int = 500, seed: int = 0) -> Path:
    """A Qwen3ForCausalLM (QK-norm, 4 heads of width 16 on a width of 32, 2 key/value heads) with
    Qwen's tokenizer layout: byte-level BPE, specials after the learned pieces, no BOS added."""
    import transformers

    tokenizer = _byte_level_bpe(shakespeare().splitlines(keepends=True), vocab, [])
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=specials[1:])
    fast.add_special_tokens({"eos_token": specials[0]})
    fast.chat_template = CHATML
    fast.save_pretrained(directory)
    eos = fast.convert_tokens_to_ids(specials[0])
    config = transformers.Qwen3Config(
        vocab_size=len(fast), hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(config).eval()
    randomise(model, std=0.3, skip=("rotary_emb",))
    model.save_pretrained(directory)
    return directory


def _llama_tokenizer_only(directory: Path) -> int:
    """``llama``'s tokenizer files in ``directory`` (its weights and settings removed, for another
    family's to go there); the vocabulary's size."""
    llama(directory)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (directory / name).unlink(missing_ok=True)
    return len(json.loads((directory / "tokenizer.json").read_text(encoding="utf-8"))["model"]
               ["vocab"])


def gemma2(directory: Path, *, seed: int = 0) -> Path:
    """A Gemma2ForCausalLM (the even layers sliding with a window of 8, scores and logits
    soft-capped where they bite: 4.0 and 6.0) with the tokenizer of ``llama``."""
    import transformers

    vocab = _llama_tokenizer_only(directory)
    config = transformers.Gemma2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=64, sliding_window=8, attn_logit_softcapping=4.0,
        final_logit_softcapping=6.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.Gemma2ForCausalLM(config).eval()
    randomise(model, std=0.3, skip=("rotary_emb", "embed_scale"))
    model.save_pretrained(directory)
    return directory


def gemma3(directory: Path, *, seed: int = 0) -> Path:
    """A Gemma3ForCausalLM (4 heads of width 16, 1 key/value head, layers sliding, sliding, global
    with a window of 8) with the tokenizer of ``llama`` (a SentencePiece-style BPE, <s> added)."""
    import transformers

    vocab = _llama_tokenizer_only(directory)
    config = transformers.Gemma3TextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        max_position_embeddings=64, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(config).eval()
    randomise(model, std=0.3, skip=("rotary_emb", "embed_scale"))
    model.save_pretrained(directory)
    return directory


def phi3(directory: Path, *, seed: int = 0) -> Path:
    """A Phi3ForCausalLM (fused qkv_proj and gate_up_proj; 4 heads, 2 key/value heads, every layer
    sliding with a window of 8) with the tokenizer of ``llama`` (<s> added, as Phi-3's adds it)."""
    import transformers

    vocab = _llama_tokenizer_only(directory)
    config = transformers.Phi3Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    model = transformers.Phi3ForCausalLM(config).eval()
    randomise(model, std=0.3, skip=("rotary_emb",))
    model.save_pretrained(directory)
    return directory
