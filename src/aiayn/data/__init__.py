"""Data for the tasks: text files and readers, label maps, splits, subword tokenizers, masking."""
