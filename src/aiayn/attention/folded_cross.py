"""Cross-attention for decoding steps with its query and output projections folded into the memory.

A decoding step's cross-attention multiplies a few query rows by W^Q, attends to keys and values that
stay fixed for the whole generation, and multiplies the result by W^O. Both projections are linear, so
they can be moved onto the fixed side once per source (the "absorbed" projections of DeepSeek-V2's
multi-head latent attention). Per head h, with x a decoder row, k_h and v_h the cached keys and values
and s = 1 / sqrt(Dh) (paper 3.2.1, eq. 1):

    scores_h = s (x W_h^Q + b_h^Q) k_h^T = x (s W_h^Q k_h^T) + s b_h^Q k_h^T
    output   = sum_h softmax(scores_h) (v_h W_h^O) + b^O

so each source keeps ``scores_weight`` = [s W_h^Q k_h^T]_h (D, H*S), ``scores_bias`` = [s b_h^Q k_h^T]_h
(1, H*S) and ``values`` = [v_h W_h^O]_h stacked over the heads (H*S, D), and a step is two batched
products and one softmax: the per-head sum over S followed by the sum over heads is one product over
the H*S axis. On a CPU this replaces two projections, the fold of the beams and one SDPA call per layer
(measured alone, 2 threads, d256 H4: 4 sources x 4 beams, 32 source tokens, 228 -> 49 us a layer
with warm caches; far less in a whole step, where the folded matrices come from memory).

It pays while the folded matrices stay small: they are H times the keys and values, and the products
read them on every step, so it is for small batches of short sources (one to a few sentences
translated, with or without beams; ``worth_folding`` has the measured limits: a decoding step of 4
sources x 4 beams over 32 tokens 1.08x faster, 16 sentences greedy 0.86x, so not folded). The
result equals the unfolded layer up to float summation order (tests/test_folded_cross.py).

Legend: B' sources (memory rows), R query rows per source (beams x new tokens), H heads, S source
length, D model width, Dh head width (D / H).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class FoldedCrossAttention:
    """One layer's cross-attention over fixed memory, projections folded in (module docstring)."""

    scores_weight: Tensor  # (B', D, H*S)
    scores_bias: Tensor | None  # (B', 1, H*S); None without a query bias
    values: Tensor  # (B', H*S, D)
    out_bias: Tensor | None  # (D,)
    heads: int

    @property
    def sources(self) -> int:
        return self.values.shape[0]

    @property
    def source_length(self) -> int:
        return self.values.shape[1] // self.heads

    def select(self, index: Tensor) -> "FoldedCrossAttention":
        """The sources ``index`` (B'',) only (finished sentences leave a batch)."""
        bias = None if self.scores_bias is None else self.scores_bias.index_select(0, index)
        return FoldedCrossAttention(self.scores_weight.index_select(0, index), bias,
                                    self.values.index_select(0, index), self.out_bias, self.heads)

    def attend(self, x: Tensor, mask: Tensor | None = None, need_weights: bool = False
               ) -> tuple[Tensor, Tensor | None]:
        """Cross-attention output (B', R, D) of query rows x (B', R, D), and if ``need_weights`` the
        weights (B', H, R, S).

        ``mask`` is the boolean cross-attention mask broadcastable to (B', H, R, S), True = may attend;
        a row with no key to attend to gets zero attention (output: the output bias), as every kernel.
        """
        sources, rows, _ = x.shape
        scores = (torch.bmm(x, self.scores_weight) if self.scores_bias is None
                  else torch.baddbmm(self.scores_bias, x, self.scores_weight))  # (B', R, H*S)
        scores = scores.view(sources, rows, self.heads, -1)  # (B', R, H, S)
        has_key = None
        if mask is not None:
            allowed = mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape)).transpose(1, 2)
            # allowed: broadcastable to (B', R, H, S)
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
            has_key = allowed.any(dim=-1, keepdim=True)  # (B'|1, R|1, H|1, 1)
        weights = scores.softmax(dim=-1)  # (B', R, H, S)
        if has_key is not None:
            weights = weights * has_key
        flat = weights.view(sources, rows, -1)  # (B', R, H*S): one product sums over S and heads
        out = (torch.bmm(flat, self.values) if self.out_bias is None
               else torch.baddbmm(self.out_bias, flat, self.values))  # (B', R, D)
        return out, weights.transpose(1, 2) if need_weights else None  # (B', H, R, S)


folding_enabled = True  # module switch (tests and A/B benchmarks turn it off)


def worth_folding(heads: int, source_length: int, d_model: int, sources: int) -> bool:
    """Whether folding is expected to make a decoding step faster.

    The folded products cost 2 * D * H * S multiply-adds a query row against the unfolded projections'
    2 * D^2 plus the attention's 2 * S * D, and read B' * 2 * H * S * D floats a step against the
    projection weights' 2 * D^2 plus the keys' and values' B' * 2 * S * D. Folding is taken while its
    arithmetic is no more than the projections' alone (H * S <= D) and it reads at most 1.5x the
    floats. Measured on whole decoding steps of a d256 H4 3-layer decoder (2-core AMD EPYC,
    unfolded / folded time): sources x beams x source length 1x1x32 1.09, 1x4x32 1.15, 2x4x32 1.12,
    4x4x32 1.08, 4x1x32 1.08, 2x4x64 1.10 (all read <= 1.33x); 8x4x32 1.02, 4x4x64 1.03 (2x), 8x1x32
    0.96 (2x), 16x1x32 0.86 (2.7x), and 1x1x128 0.92 (H * S = 2 D).
    """
    return (heads * source_length <= d_model
            and 2 * sources * heads * source_length <= 3 * (d_model + sources * source_length))


def fold(query: nn.Linear, output: nn.Linear, keys: Tensor, values: Tensor
         ) -> FoldedCrossAttention:
    """Fold the query projection ``query`` and output projection ``output`` (D -> D each) into the
    cached cross-attention ``keys`` and ``values`` (B', H, S, Dh)."""
    sources, heads, length, head_dim = keys.shape
    d_model = heads * head_dim
    # Heads lead, so each head's (Dh, D) weight multiplies every source's rows in one product: a
    # product broadcast over (B', H) would first copy the weights once per source.
    scaled_keys = keys * head_dim ** -0.5
    scaled_keys = scaled_keys.permute(1, 3, 0, 2).reshape(heads, head_dim, -1)  # (H, Dh, B'*S)
    query_weight = query.weight.view(heads, head_dim, d_model).transpose(1, 2)  # (H, D, Dh): W^Q_h^T
    # (H, D, Dh) @ (H, Dh, B'*S): column (h, b, s) is s * W^Q_h k_bhs^T, column (h, s) of source b's
    # scores_weight.
    scores_weight = torch.bmm(query_weight, scaled_keys).view(heads, d_model, sources, length)
    # contiguous: every decoding step reads it (with one head the reshape would be a strided view)
    scores_weight = scores_weight.permute(2, 1, 0, 3).reshape(sources, d_model, heads * length)
    scores_weight = scores_weight.contiguous()
    scores_bias = None
    if query.bias is not None:
        bias = query.bias.view(heads, head_dim, 1)  # (H, Dh, 1)
        scores_bias = (bias.transpose(1, 2) @ scaled_keys).view(heads, sources, length)
        scores_bias = scores_bias.transpose(0, 1).reshape(sources, 1, heads * length)  # (B', 1, H*S)
    # W^O_h^T as (H, Dh, D): output column block h of W^O (D, D), transposed
    output_weight = output.weight.view(d_model, heads, head_dim).permute(1, 2, 0)
    grouped_values = values.transpose(0, 1).reshape(heads, sources * length, head_dim)
    folded_values = torch.bmm(grouped_values, output_weight).view(heads, sources, length, d_model)
    folded_values = folded_values.transpose(0, 1).reshape(sources, heads * length, d_model)
    return FoldedCrossAttention(scores_weight, scores_bias, folded_values, output.bias, heads)
