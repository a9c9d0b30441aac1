"""Data readers and vocabularies (``aiayn.data.text``: plain text for language modelling)."""
