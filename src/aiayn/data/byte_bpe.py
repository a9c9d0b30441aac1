"""A byte-level BPE vocabulary for language modelling, learned as GPT-2's was (Radford et al. 2019).

The text is split by GPT-2's pre-tokenizer pattern into words, their UTF-8 bytes are the initial
256 symbols, and the most frequent adjacent pairs are merged until the vocabulary has
``vocab_size`` entries. Any text encodes (no unknown token) and decodes back exactly, except the
literal text ``<|endoftext|>``: id 0 is that token (GPT-2's document separator), and as GPT-2's
tokenizer in ``transformers`` reads it, the text ``<|endoftext|>`` is that id, which decoding
leaves out.

Saved as a Hugging Face ``tokenizer.json``: ``aiayn.interop.hf_tokenizer.load_tokenizer`` and
``transformers``' ``PreTrainedTokenizerFast(tokenizer_file=...)`` read it.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

END_OF_TEXT = "<|endoftext|>"
MIN_VOCAB_SIZE = 256 + 1  # the bytes and <|endoftext|>


def learn_byte_bpe(texts: Iterable[str], *, vocab_size: int, min_frequency: int = 2):
    """A ``tokenizers.Tokenizer``: byte-level BPE of at most ``vocab_size`` entries learned on
    ``texts`` (pieces of the training text, e.g. batches of lines; fewer entries when the text
    has fewer pairs seen ``min_frequency`` times).

    Raises:
        ValueError: ``vocab_size`` below 257 (the 256 bytes and ``<|endoftext|>``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"a byte-level BPE vocabulary needs at least {MIN_VOCAB_SIZE} entries "
                         f"(256 bytes and {END_OF_TEXT}), got {vocab_size!r}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=[END_OF_TEXT], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_byte_bpe(tokenizer, directory: str | Path) -> Path:
    """Write ``tokenizer.json`` (and the special-token map that names ``<|endoftext|>``, as
    GPT-2's checkpoint does) into ``directory`` atomically; returns the tokenizer file's path."""
    import json

    from aiayn.training.checkpoint import atomic_write_bytes

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    atomic_write_bytes(path, tokenizer.to_str().encode("utf-8"))
    specials = {"bos_token": END_OF_TEXT, "eos_token": END_OF_TEXT, "unk_token": END_OF_TEXT}
    atomic_write_bytes(directory / "special_tokens_map.json",
                       json.dumps(specials, indent=1).encode("utf-8"))
    return path
