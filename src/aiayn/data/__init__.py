"""Data for translation: parallel corpus reading and splitting, the joint subword tokenizer, and
token-count batching."""
