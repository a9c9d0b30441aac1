"""T5's relative position bias (Raffel et al. 2020, 2.1; Shaw et al. 2018's relative positions, simplified).

T5 has no position vectors. Each attention score q_i . k_j gets a learned scalar b[bucket(j - i), h]
added before the softmax, one per head h. The distance j - i is put in one of ``buckets`` buckets:
half of them exact small distances, the other half logarithmically wider up to ``max_distance``
(every farther distance shares the last bucket). In the encoder the sign matters (half the buckets
look left, half right); the decoder is causal and only looks back. A stack computes the bias once
and hands it to every layer (T5 shares the first layer's table with the rest of its stack).

The bias is an additive float tensor (B|1, H, T, S), not a mask: the kernels that can add it to
their scores take it as ``position_bias`` (aiayn.nn.attention.kernels).

Legend: B batch, H heads, T query length, S key length.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def relative_position_bucket(relative_position: Tensor, *, bidirectional: bool, buckets: int,
                             max_distance: int) -> Tensor:
    """Bucket ids in [0, buckets) of key-minus-query distances (mesh-tensorflow's
    ``_relative_position_bucket``, as Hugging Face's T5 computes it)."""
    bucket = torch.zeros_like(relative_position)
    if bidirectional:
        buckets //= 2
        bucket = bucket + (relative_position > 0).long() * buckets  # keys to the right: upper half
        distance = relative_position.abs()
    else:
        distance = -relative_position.clamp(max=0)  # causal: only keys to the left (j <= i)
    exact = buckets // 2  # distances 0 .. exact - 1 each have their own bucket
    # the rest: log-spaced from ``exact`` to ``max_distance``, the last bucket for all beyond
    log_ratio = torch.log(distance.float() / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (buckets - exact)).long()).clamp(max=buckets - 1)
    return bucket + torch.where(distance < exact, distance, far)


class RelativePositionBias(nn.Module):
    """The learned (buckets, H) table and the (1, H, T, S) bias of T queries over S keys.

    Args:
        buckets: number of distance buckets (``config.relative_attention_buckets``; T5: 32).
        max_distance: distances at or beyond it share the last bucket (T5: 128).
        heads: H.
        bidirectional: True in an encoder, False in a causal decoder.
    """

    def __init__(self, buckets: int, max_distance: int, heads: int, *, bidirectional: bool):
        super().__init__()
        self.buckets, self.max_distance = buckets, max_distance
        self.bidirectional = bidirectional
        self.embedding = nn.Embedding(buckets, heads)
        # Every distance at or past max_distance shares a last bucket, so the buckets of j - i in
        # [-max_distance, max_distance] are all there are: computed once here, looked up in
        # ``forward`` (no math on the bucket counts there, which torch 2.4's torch.compile with
        # dynamic shapes holds as symbols and cannot take the log of).
        span = torch.arange(-max_distance, max_distance + 1)  # (2M + 1,)
        self.register_buffer("span_bucket", relative_position_bucket(
            span, bidirectional=bidirectional, buckets=buckets, max_distance=max_distance),
            persistent=False)  # (2M + 1,): the bucket of j - i at index j - i + M

    def forward(self, query_length: int, key_length: int, start: int = 0) -> Tensor:
        """(1, H, T, S): queries at positions start .. start + T - 1, keys at 0 .. S - 1."""
        device = self.embedding.weight.device
        query = torch.arange(start, start + query_length, device=device)[:, None]  # (T, 1)
        key = torch.arange(key_length, device=device)[None, :]  # (1, S)
        distance = (key - query).clamp(-self.max_distance, self.max_distance)  # (T, S)
        bucket = self.span_bucket[distance + self.max_distance]  # (T, S)
        return self.embedding(bucket).permute(2, 0, 1).unsqueeze(0)  # (T, S, H) -> (1, H, T, S)

    def extra_repr(self) -> str:
        return (f"buckets={self.buckets}, max_distance={self.max_distance}, "
                f"bidirectional={self.bidirectional}")
