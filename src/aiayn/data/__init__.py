"""Data readers, tokenizers and batching: parallel corpora for translation (``parallel``, ``tokenizer``,
``batching``), plain text for language modelling (``text``), labelled text for classification and
masked-LM pretraining (``labelled_tsv``, ``labels``, ``splits``, ``wordpiece``, ``masking``,
``row_batching``)."""
