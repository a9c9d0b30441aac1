"""The Vision Transformer (Dosovitskiy et al. 2021): the paper's encoder stack over image patches.

    z_0 = patch embedding + [CLS] + positions        (eq. 1, ``aiayn.nn.patches``)
    z_l = the encoder layers, pre-norm, GELU FFN     (eqs. 2-3: ``aiayn.nn.layers.EncoderLayer``)
    y   = LN(z_L^0) -> linear head                   (eq. 4: final norm, [CLS] state, classifier)

Nothing in the stack is specific to images: pre-norm (``norm_first``), GELU (``activation``) and the
final LayerNorm (``final_norm``) are config fields of the shared blocks. The architecture reads
``image_size``, ``patch_size`` and ``num_channels``; the text fields (vocabulary, ``max_length``,
special ids) are ignored. There is no padding: every image has the same N + 1 tokens.

Legend: B batch, C channels (``num_channels``), H = W image size, N patches, D model width,
K classes.
"""

from __future__ import annotations

from torch import Tensor, nn

from aiayn.config import TransformerConfig
from aiayn.models.heads import ClassificationHead, initialise, pool
from aiayn.nn.patches import PatchEmbedding
from aiayn.nn.stacks import AttentionMaps, Encoder


def check_vision_config(config: TransformerConfig) -> None:
    """The fields the ViT needs set one way (the others it ignores or honours as given).

    Raises:
        ValueError: no encoder layers, positions other than learned (the ViT's only kind), or a
            text embedding's extra (``embedding_norm``, token types, a ``position_offset``),
            which a patch embedding does not have.
    """
    if config.n_encoder_layers < 1:
        raise ValueError(f"a Vision Transformer needs n_encoder_layers >= 1, got "
                         f"{config.n_encoder_layers}")
    if config.positions != "learned":
        raise ValueError(f"a Vision Transformer has learned positions (positions='learned'), got "
                         f"positions={config.positions!r}")
    for name, value in (("embedding_norm", config.embedding_norm),
                        ("type_vocab_size", config.type_vocab_size),
                        ("position_offset", config.position_offset)):
        if value:
            raise ValueError(f"a Vision Transformer's patch embedding has no {name} (a text "
                             f"embedding's), got {name}={value!r}")


class VisionTransformer(nn.Module):
    """Images (B, C, H, W) -> hidden states (B, 1 + N, D): [CLS] first, then the patches.

    Example:
        >>> import torch
        >>> from aiayn import TransformerConfig, VisionTransformer
        >>> vit = VisionTransformer(TransformerConfig.preset("vit-digits"))
        >>> vit(torch.randn(4, 1, 8, 8)).shape  # [CLS] and 16 patches of width 64
        torch.Size([4, 17, 64])
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        check_vision_config(config)
        self.config = config
        self.embeddings = PatchEmbedding(config)
        self.encoder = Encoder(config, tokens=None)
        initialise(self.encoder, config)

    def encode(self, images: Tensor, *, need_weights: bool = False
               ) -> tuple[Tensor, list[Tensor]]:
        """Hidden states (B, 1 + N, D) and, with ``need_weights``, the weights per layer."""
        tokens = self.embeddings(images)  # (B, 1 + N, D)
        return self.encoder.forward_embedded(tokens, need_weights=need_weights)

    def forward(self, images: Tensor, *, return_attention: bool = False
                ) -> Tensor | tuple[Tensor, AttentionMaps]:
        """``images`` (B, C, H, W) floats. With ``return_attention`` also the per-layer weights
        (B, H, 1 + N, 1 + N) in ``AttentionMaps.encoder``; query and key 0 are [CLS]."""
        hidden, weights = self.encode(images, need_weights=return_attention)
        return (hidden, AttentionMaps(encoder=weights)) if return_attention else hidden


class ImageClassifier(nn.Module):
    """Class logits (B, K) of images (B, C, H, W): the ViT, the [CLS] state, a linear head (eq. 4).

    ``config.pooling="mean"`` classifies the mean of all tokens ([CLS] included) instead of the
    [CLS] state (the paper's appendix D.3 compares the two heads); ``config.pooler`` adds BERT's
    dense + tanh before the linear map.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.encoder = VisionTransformer(config)
        self.head = ClassificationHead(config)
        initialise(self.head, config)

    def forward(self, images: Tensor, *, return_attention: bool = False
                ) -> Tensor | tuple[Tensor, AttentionMaps]:
        """``images`` (B, C, H, W) floats -> logits (B, K) (and the attention maps)."""
        hidden, weights = self.encoder.encode(images, need_weights=return_attention)
        logits = self.head(pool(hidden, None, self.config.pooling))  # (B, K)
        return (logits, AttentionMaps(encoder=weights)) if return_attention else logits
