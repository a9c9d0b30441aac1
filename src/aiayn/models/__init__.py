"""The model families, all built from aiayn's stacks: the paper's three and the ViT."""

from aiayn.models.decoder_only import CausalLM
from aiayn.models.encoder_decoder import Transformer
from aiayn.models.encoder_only import MaskedLM, SequenceClassifier, TransformerEncoder
from aiayn.models.vision import ImageClassifier, VisionTransformer

__all__ = ["CausalLM", "ImageClassifier", "MaskedLM", "SequenceClassifier", "Transformer",
           "TransformerEncoder", "VisionTransformer"]
