"""The three model families, all built from aiayn's stacks."""

from aiayn.models.decoder_only import CausalLM
from aiayn.models.encoder_decoder import Transformer
from aiayn.models.encoder_only import MaskedLM, SequenceClassifier, TransformerEncoder

__all__ = ["CausalLM", "MaskedLM", "SequenceClassifier", "Transformer", "TransformerEncoder"]
