"""Data readers, tokenizers and batching: parallel corpora for translation (``corpus``, ``tokenizer``,
``batching``), plain text for language modelling (``text``), labelled text for classification."""
