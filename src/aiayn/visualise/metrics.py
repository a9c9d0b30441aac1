"""What does each head do? Pattern metrics of attention weights, and a label per head.

For every real query token i of a sequence with n real keys, a head's weights w_i (a distribution over the
keys) give:

    entropy            -sum_j w_ij log w_ij  (nats; 0 = one key, log n = uniform)
    normalised entropy entropy / log(a_i), a_i = number of keys query i may see: real, earlier
                       when causal, within the layer's sliding window if it has one (1 = uniform);
                       rows with a single allowed key are left out of its mean
    max weight         max_j w_ij
    self mass          w_ii  (the diagonal: query i attends to key i)
    previous mass      w_i,i-1  (rows i >= 1 only: the first token has no previous token)
    local mass         sum_{|j - i| <= window} w_ij
    first mass         w_i0  (a [CLS]/<s>-like sink)
    last mass          w_i,n-1  (the last real key: a [SEP]/</s>-like sink)

Each metric is averaged over every real query row of every sequence given (padding rows never count), so
a file of texts gives the row-weighted mean over all its tokens. For cross-attention the "self" and
"previous" positions compare target position i with source position i: a monotone-alignment proxy.

Labels (thresholds chosen so that a label means most of the attention goes one place):
    "previous-token" / "first-token" / "last-token" / "self": that mean mass >= ``MASS_THRESHOLD`` (0.5);
        where several pass, the largest wins;
    "broad": none of those, and mean normalised entropy >= ``BROAD_ENTROPY`` (0.85: close to uniform);
    "other": none of the above (a content-dependent head).

Legend: B batch, L layers, H heads, T query length, S key length.
"""

from __future__ import annotations

import csv
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from aiayn.visualise.files import atomic_write_text

MASS_THRESHOLD = 0.5
BROAD_ENTROPY = 0.85
DEFAULT_WINDOW = 2

METRIC_NAMES = ("entropy", "normalised_entropy", "max_weight", "self_mass", "previous_mass",
                "local_mass", "first_mass", "last_mass")
# Which masses can name a head, in the order used to break exact ties.
MASS_LABELS = (("previous_mass", "previous-token"), ("first_mass", "first-token"),
               ("last_mass", "last-token"), ("self_mass", "self"))


def _check_weights(weights: Tensor) -> Tensor:
    if not isinstance(weights, Tensor) or weights.dim() != 4:
        shape = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"attention weights must have shape (B, H, T, S), got {shape}")
    if not torch.isfinite(weights).all():
        raise ValueError("attention weights contain NaN or infinity")
    return weights.detach().to(torch.float64)


def _lengths(mask: Tensor | None, batch: int, length: int, name: str, device) -> Tensor:
    """Real lengths (B,) from a (B, L) padding mask (True = real token, right padding assumed)."""
    if mask is None:
        return torch.full((batch,), length, dtype=torch.long, device=device)
    if tuple(mask.shape) != (batch, length) or mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor of shape {(batch, length)}, got "
                         f"{mask.dtype} {tuple(mask.shape)}")
    lengths = mask.sum(dim=1)
    expected = torch.arange(length, device=mask.device) < lengths[:, None]  # (B, L)
    if not torch.equal(expected, mask):
        raise ValueError(f"{name} must be right-padded (True tokens first, then padding)")
    return lengths.to(device)


@dataclass
class PatternAccumulator:
    """Sums per-head metrics over query rows; add batches with ``update``, read means with ``means``.

    Args:
        n_heads: heads H of the attention being measured.
        causal: the attention is causal (query i sees keys 0..i); sets the allowed-key count used by the
            normalised entropy.
        window: half-width of the local window (keys i - window .. i + window).
        band: the layer's own sliding window W (``config.sliding_window``: query i sees the keys
            less than W positions away), which the allowed-key count keeps to; None: no window.
    """

    n_heads: int
    causal: bool = False
    window: int = DEFAULT_WINDOW
    band: int | None = None
    sums: dict[str, Tensor] = field(default_factory=dict)
    counts: dict[str, Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.n_heads < 1:
            raise ValueError(f"n_heads must be >= 1, got {self.n_heads}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if self.band is not None and self.band < 1:
            raise ValueError(f"band must be >= 1 or None, got {self.band}")
        for name in METRIC_NAMES:
            self.sums[name] = torch.zeros(self.n_heads, dtype=torch.float64)
            self.counts[name] = torch.zeros((), dtype=torch.float64)

    def update(self, weights: Tensor, query_mask: Tensor | None = None,
               key_mask: Tensor | None = None) -> None:
        """Add one batch of weights (B, H, T, S) with padding masks (B, T) / (B, S), True = real.

        Raises:
            ValueError: wrong shapes, a head count other than ``n_heads``, non-finite weights, or masks
                that are not right-padded booleans.
        """
        w = _check_weights(weights).cpu()
        batch, heads, queries, keys = w.shape
        if heads != self.n_heads:
            raise ValueError(f"weights have {heads} heads, the accumulator {self.n_heads}")
        q_len = _lengths(None if query_mask is None else query_mask.cpu(), batch, queries,
                         "query_mask", w.device)
        k_len = _lengths(None if key_mask is None else key_mask.cpu(), batch, keys, "key_mask",
                         w.device)
        i = torch.arange(queries)[:, None]  # (T, 1) query positions
        j = torch.arange(keys)[None, :]     # (1, S) key positions
        real_row = torch.arange(queries)[None, :] < q_len[:, None]  # (B, T)
        real_key = torch.arange(keys)[None, :] < k_len[:, None]  # (B, S)
        # Keys each query may see: the real keys, and with causality only keys up to the query.
        visible = real_key[:, None, :].expand(batch, queries, keys)  # (B, T, S)
        if self.causal:
            visible = visible & (j <= i)[None]
        if self.band is not None:
            visible = visible & ((i - j).abs() < self.band)[None]
        allowed = visible.sum(dim=-1).to(torch.float64)  # (B, T)

        def add(name: str, per_row: Tensor, rows: Tensor) -> None:
            """per_row (B, H, T), rows (B, T) bool: which rows count for this metric."""
            self.sums[name] += (per_row * rows[:, None, :]).sum(dim=(0, 2))
            self.counts[name] += rows.sum()

        plogp = torch.where(w > 0, w * w.clamp_min(1e-300).log(), torch.zeros_like(w))
        entropy = -plogp.sum(dim=-1)  # (B, H, T)
        add("entropy", entropy, real_row)
        spread = real_row & (allowed > 1)
        add("normalised_entropy", entropy / allowed.clamp_min(2).log()[:, None, :], spread)
        add("max_weight", w.max(dim=-1).values, real_row)

        def mass_at(offset: int) -> tuple[Tensor, Tensor]:
            """Weight on key i + offset (B, H, T) and the rows where that key exists and is real."""
            key = i[:, 0] + offset  # (T,)
            exists = (key >= 0)[None, :] & (key[None, :] < k_len[:, None])  # (B, T)
            index = key.clamp(0, keys - 1)[None, None, :, None].expand(batch, heads, queries, 1)
            return w.gather(-1, index)[..., 0], exists

        self_mass, has_self = mass_at(0)
        add("self_mass", self_mass, real_row & has_self)
        previous_mass, has_previous = mass_at(-1)
        add("previous_mass", previous_mass, real_row & has_previous)
        near = ((j - i).abs() <= self.window)[None, None]  # (1, 1, T, S)
        add("local_mass", (w * near).sum(dim=-1), real_row)
        add("first_mass", w[..., 0], real_row)
        last_index = (k_len - 1).clamp_min(0)[:, None, None, None].expand(batch, heads, queries, 1)
        add("last_mass", w.gather(-1, last_index)[..., 0], real_row)

    def means(self) -> dict[str, list[float]]:
        """Mean of each metric per head (NaN for a metric no row contributed to)."""
        return {name: (self.sums[name] / self.counts[name]).tolist() if self.counts[name] > 0
                else [math.nan] * self.n_heads for name in METRIC_NAMES}


def label_head(metrics: dict[str, float]) -> str:
    """The pattern label of one head from its mean metrics (see the module docstring)."""
    best: tuple[str, float] | None = None
    for key, name in MASS_LABELS:  # exact ties go to the first in MASS_LABELS
        mass = metrics.get(key, math.nan)
        if not math.isnan(mass) and mass >= MASS_THRESHOLD and (best is None or mass > best[1]):
            best = (name, mass)
    if best is not None:
        return best[0]
    entropy = metrics.get("normalised_entropy", math.nan)
    if not math.isnan(entropy) and entropy >= BROAD_ENTROPY:
        return "broad"
    return "other"


def head_pattern_metrics(weights: Tensor, query_mask: Tensor | None = None,
                         key_mask: Tensor | None = None, *, causal: bool = False,
                         window: int = DEFAULT_WINDOW, band: int | None = None
                         ) -> list[dict[str, float | str | int]]:
    """Per-head metrics and label of one batch of weights (B, H, T, S); one dict per head.

    Args:
        weights: attention weights, rows summing to 1 over real keys.
        query_mask: (B, T) True = real query (right padding); None = all real.
        key_mask: (B, S) True = real key; None = all real.
        causal: the attention is causal (for the normalised entropy).
        window: half-width of the local window.
        band: the attention's sliding window, if any (for the normalised entropy).

    Raises:
        ValueError: see ``PatternAccumulator.update``.
    """
    accumulator = PatternAccumulator(n_heads=_check_weights(weights).shape[1], causal=causal,
                                     window=window, band=band)
    accumulator.update(weights, query_mask, key_mask)
    return rows_from_means(accumulator.means())


def rows_from_means(means: dict[str, list[float]], **identity) -> list[dict]:
    """One row per head: ``identity`` fields, ``head``, every metric and the label."""
    n_heads = len(means[METRIC_NAMES[0]])
    rows = []
    for head in range(n_heads):
        row = dict(identity)
        row["head"] = head
        row.update({name: means[name][head] for name in METRIC_NAMES})
        row["label"] = label_head(row)
        rows.append(row)
    return rows


def write_metrics(rows: list[dict], json_path: str | Path, csv_path: str | Path) -> None:
    """Write the metric rows as JSON (a list of objects, NaN as null) and CSV, each atomically."""
    clean = [{key: (None if isinstance(value, float) and math.isnan(value) else value)
              for key, value in row.items()} for row in rows]
    atomic_write_text(json_path, json.dumps(clean, indent=1) + "\n")
    buffer = io.StringIO()
    fields = list(clean[0]) if clean else ["head", *METRIC_NAMES, "label"]
    writer = csv.DictWriter(buffer, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for row in clean:
        writer.writerow({key: (f"{value:.6g}" if isinstance(value, float) else value)
                         for key, value in row.items()})
    atomic_write_text(csv_path, buffer.getvalue())
