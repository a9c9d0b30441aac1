"""Data: parallel corpora, the joint subword tokenizer and token-count batching (translation);
plain text, the character vocabulary and blocks (``text``, language modelling)."""
