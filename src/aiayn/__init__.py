"""aiayn: the Transformer of "Attention Is All You Need", complete, fast and tested, on PyTorch.

Mask convention (everywhere): boolean, True = may attend / real token. See ``aiayn.masks``.
"""

from aiayn.config import PRESETS, TransformerConfig, count_parameters
from aiayn.models import (CausalLM, ImageClassifier, MaskedLM, SequenceClassifier, Transformer,
                          TransformerEncoder, VisionTransformer)
from aiayn.nn.stacks import AttentionMaps
# Hugging Face interop reads files directly: importing aiayn never imports transformers.
from aiayn.interop.hf import from_pretrained, from_transformers, save_pretrained

__version__ = "0.1.0"

__all__ = ["PRESETS", "AttentionMaps", "CausalLM", "ImageClassifier", "MaskedLM",
           "SequenceClassifier", "Transformer", "TransformerConfig", "TransformerEncoder",
           "VisionTransformer", "count_parameters", "from_pretrained", "from_transformers",
           "save_pretrained", "__version__"]
