"""Images as sequences (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words", 3.1, eq. 1).

    z_0 = [x_class; x_p^1 E; x_p^2 E; ...; x_p^N E] + E_pos,
    E in R^{(P^2 C) x D},  E_pos in R^{(N+1) x D}

An image (C, H, W) is cut into N = (H / P) (W / P) non-overlapping P x P patches; each flattened
patch x_p^i goes through one shared linear map E; a learned [CLS] vector x_class is put in front
(its final state is the image's representation); a learned position vector is added to each of the
N + 1 tokens. The result feeds the paper's encoder stack unchanged.

Legend: B batch, C channels, H = W image size, P patch size, G = H / P patches a side, N = G^2
patches, D model width.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aiayn.config import TransformerConfig


class PatchEmbedding(nn.Module):
    """Images (B, C, H, W) -> tokens (B, 1 + N, D): [CLS], then the patches in row-major order.

    E is a ``nn.Conv2d`` with kernel P and stride P: on non-overlapping patches a convolution is
    exactly one linear map applied to each flattened patch (its (D, C, P, P) weight is E reshaped).
    The [CLS] vector and the position table are kept as (1, 1, D) and (1, 1 + N, D) so that they
    broadcast over the batch (and have the layout of the ViT checkpoints).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.image_size, self.patch_size = config.image_size, config.patch_size
        self.num_channels = config.num_channels
        self.grid = config.image_size // config.patch_size  # G
        self.num_patches = self.grid * self.grid  # N
        d_model = config.d_model
        self.projection = nn.Conv2d(config.num_channels, d_model, kernel_size=config.patch_size,
                                    stride=config.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d_model))
        self.positions = nn.Parameter(torch.empty(1, 1 + self.num_patches, d_model))
        self.dropout = nn.Dropout(config.dropout)
        self.reset_parameters(config.init_std)

    def reset_parameters(self, init_std: float | None) -> None:
        """E like the other matrices of the model (Xavier on its (D, C P^2) form, or
        N(0, init_std)); positions and [CLS] N(0, 0.02) (ViT's reference code: positions
        N(0, 0.02), [CLS] zeros; HF ViT draws both from a truncated N(0, 0.02))."""
        weight = self.projection.weight.view(self.projection.out_channels, -1)  # (D, C P^2)
        if init_std is None:
            nn.init.xavier_uniform_(weight)
        else:
            nn.init.normal_(weight, std=init_std)
        nn.init.zeros_(self.projection.bias)
        nn.init.normal_(self.positions, std=0.02)
        nn.init.normal_(self.cls_token, std=0.02)

    def check_images(self, images: Tensor) -> None:
        """Refuse what the model cannot read: the message says what it takes.

        Raises:
            TypeError: not a floating-point tensor.
            ValueError: not (B, C, H, W), or other channels or size than the config's.
        """
        if not isinstance(images, Tensor):
            raise TypeError(f"images must be a tensor (B, C, H, W), got {type(images).__name__}")
        if not images.is_floating_point():
            raise TypeError(f"images must be a floating-point tensor (scale the pixels first), "
                            f"got {images.dtype}")
        if images.dim() != 4:
            raise ValueError(f"images must have shape (B, C, H, W), got {tuple(images.shape)}")
        channels, height, width = images.shape[1:]
        if channels != self.num_channels:
            raise ValueError(f"images have {channels} channels, the model takes "
                             f"{self.num_channels} (num_channels)")
        if (height, width) != (self.image_size, self.image_size):
            raise ValueError(f"images are {height}x{width} pixels, the model takes "
                             f"{self.image_size}x{self.image_size} (image_size); resize them")

    def forward(self, images: Tensor) -> Tensor:
        self.check_images(images)
        patches = self.projection(images)  # (B, D, G, G): x_p^i E for every patch
        patches = patches.flatten(2).transpose(1, 2)  # (B, N, D), row-major patch order
        cls = self.cls_token.expand(images.shape[0], -1, -1)  # (B, 1, D)
        tokens = torch.cat([cls, patches], dim=1)  # (B, 1 + N, D)
        return self.dropout(tokens + self.positions)  # eq. 1; dropout after it (ViT appendix B.1)
