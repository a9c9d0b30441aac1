"""Data for the tasks: text files and readers, splits, subword tokenizers, batching; translation
(parallel corpus, joint tokenizer, token-count batching) and classification / masked LM (labelled
TSV, label maps, stratified split, WordPiece, BERT masking)."""
