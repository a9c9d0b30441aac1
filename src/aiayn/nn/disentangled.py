"""DeBERTa's disentangled attention (He et al. 2021, "DeBERTa: Decoding-enhanced BERT with
Disentangled Attention", section 3.1; DeBERTa-v3, He et al. 2023).

Each token is a content vector and, apart from it, every relative distance has a vector of its own.
Beside the content-to-content score q_i . k_j, an attention score gets two more terms (eq. 2-4):

    c2p[i, j] = q_i . k_r[d(i, j)]    content-to-position: query i's content, the distance's key
    p2c[i, j] = k_j . q_r[d(i, j)]    position-to-content: key j's content, the distance's query

    score[i, j] = (q_i . k_j + c2p[i, j] + p2c[i, j]) / sqrt(Dh * (1 + number of terms))   (eq. 4)

where k_r and q_r are the relative embeddings (one row per distance bucket, 2k rows) projected by
the layer's own key and query projections (DeBERTa-v3's ``share_att_key``) or by projections of
their own (DeBERTa-v2's ``pos_key_proj`` / ``pos_query_proj``), and d(i, j) is the row of the distance
i - j: k + bucket(i - j), clamped to [0, 2k). Beyond k / 2 distances are log-bucketed up to
``max_distance`` (DeBERTa-v2's ``make_log_bucket_position``, section 5.1 of the v2 notes); without
``max_distance`` they are only clamped. A layer uses one or both terms (``terms``).

The pieces compose as T5's relative bias does: the encoder stack owns the table of relative
embeddings (``RelativeEmbeddings``: the rows, their LayerNorm, the (T, S) row index of every pair)
and hands it to every layer; each layer's ``DisentangledTerms`` drops it out (a mask of its own, as
each of DeBERTa's layers applies its own ``pos_dropout``) and turns it, with that layer's q and k,
into an additive score term (B, H, T, S), already scaled, that goes to the attention kernel as its
``position_bias``. The kernel's own scale (``TransformerConfig.attention_scale``, which the DeBERTa
loader sets to (Dh * (1 + terms))^-1/2) scales q . k and the terms alike.

Only relative distances enter, so a model without absolute positions (DeBERTa-v3) runs on
sequences of any length, as transformers runs it: a distance of ``max_distance`` or more
(unbucketed: k or more) reads the last row of the table, its negative the first.

The config is one field, ``TransformerConfig.disentangled_attention``: a dict with the keys of
``Disentangled`` (checked by ``disentangled_spec``).

Legend: B batch, H heads, T query length, S key length, D model width, Dh head width, R = 2k rows
of the relative table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from aiayn.config import TransformerConfig
    from aiayn.nn.attention.multihead import SelfAttention

TERMS = ("c2p", "p2c")


@dataclass(frozen=True)
class Disentangled:
    """The settings of disentangled attention (``TransformerConfig.disentangled_attention``).

    Attributes:
        terms: the score terms beside q . k, a non-empty subset of ("c2p", "p2c").
        span: k; distances index 2k relative embeddings (DeBERTa's ``position_buckets``, or its
            ``max_relative_positions`` without buckets).
        max_distance: distances from k / 2 up to it are log-bucketed (DeBERTa's
            ``max_relative_positions`` with ``position_buckets`` > 0); None: not bucketed.
        share_projections: the layer's query and key projections project the relative embeddings
            (DeBERTa-v3's ``share_att_key``); False: projections of their own.
        norm: a LayerNorm on the relative embeddings (``norm_rel_ebd`` "layer_norm").
    """

    terms: tuple[str, ...]
    span: int
    max_distance: int | None = None
    share_projections: bool = True
    norm: bool = True


def disentangled_spec(config: "TransformerConfig") -> Disentangled | None:
    """The config's ``disentangled_attention`` checked and typed (None when off).

    Raises:
        ValueError: an unknown key, a bad value (naming it), or a config the terms cannot live in.
    """
    settings: Any = config.disentangled_attention
    if settings is None:
        return None
    fields = set(Disentangled.__dataclass_fields__)
    if not isinstance(settings, dict) or not set(settings) <= fields or "terms" not in settings \
            or "span" not in settings:
        raise ValueError(f"disentangled_attention must be a dict with 'terms' and 'span' (and "
                         f"optionally {sorted(fields - {'terms', 'span'})}), got {settings!r}")
    terms, span = settings["terms"], settings["span"]
    if not isinstance(terms, (list, tuple)) or not terms or len(set(terms)) != len(terms) \
            or not set(terms) <= set(TERMS):
        raise ValueError(f"disentangled_attention terms must be a non-empty subset of "
                         f"{list(TERMS)}, got {terms!r}")
    distance = settings.get("max_distance")
    for name, value in (("span", span), ("max_distance", distance)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 2):
            raise ValueError(f"disentangled_attention {name} must be an integer >= 2, got "
                             f"{value!r}")
    for name in ("share_projections", "norm"):
        if not isinstance(settings.get(name, True), bool):
            raise ValueError(f"disentangled_attention {name} must be true or false, got "
                             f"{settings[name]!r}")
    if config.n_decoder_layers or config.attention not in ("fused", "reference"):
        raise ValueError(f"disentangled_attention adds its terms to the scores of an encoder: it "
                         f"needs n_decoder_layers=0 and attention 'fused' or 'reference', got "
                         f"{config.n_decoder_layers} and {config.attention!r}")
    return Disentangled(**{**settings, "terms": tuple(t for t in TERMS if t in terms)})


def log_bucket(relative: Tensor, buckets: int, max_distance: int) -> Tensor:
    """DeBERTa-v2's log buckets of signed distances (long): |d| <= buckets / 2 kept as it is, a
    longer one mapped to sign(d) * (ceil(log(|d| / m) / log((max_distance - 1) / m) * (m - 1)) + m),
    m = buckets / 2, computed in float32 as transformers computes it, so the same rows are read."""
    mid = buckets // 2
    sign = torch.sign(relative)
    near = relative.abs() < mid
    distance = torch.where(near, torch.full_like(relative, mid - 1), relative.abs())  # log(0)-safe
    ratio = torch.log(distance / mid) / torch.log(torch.tensor((max_distance - 1) / mid))
    far = torch.ceil(ratio * (mid - 1)) + mid  # float32
    return torch.where(distance <= mid, relative.to(far.dtype), far * sign).long()


def relative_rows(length: int, spec: Disentangled, device: torch.device) -> Tensor:
    """(T, T) long: the relative-table row d(i, j) = clamp(k + bucket(i - j), 0, 2k - 1) of each
    query i and key j of a sequence of ``length`` positions."""
    positions = torch.arange(length, device=device)
    relative = positions[:, None] - positions[None, :]  # (T, S): i - j
    if spec.max_distance is not None:
        relative = log_bucket(relative, spec.span, spec.max_distance)
    return (relative + spec.span).clamp(0, 2 * spec.span - 1)


@dataclass
class RelativeTable:
    """What a stack hands its layers: the relative embeddings (R, D), the row of every query-key
    pair (T, S) and the dropout each layer applies to the embeddings (a mask of its own)."""

    embeddings: Tensor
    rows: Tensor
    dropout: nn.Module | None = None


class RelativeEmbeddings(nn.Module):
    """The stack's table of 2k relative embeddings (DeBERTa's ``rel_embeddings``), its optional
    LayerNorm, and the dropout (DeBERTa's ``pos_dropout``, training only) that each layer applies
    to it separately."""

    def __init__(self, spec: Disentangled, d_model: int, *, eps: float, dropout: float):
        super().__init__()
        self.spec = spec
        self.embedding = nn.Embedding(2 * spec.span, d_model)
        self.norm = nn.LayerNorm(d_model, eps=eps) if spec.norm else None
        self.dropout = nn.Dropout(dropout)

    def forward(self, length: int) -> RelativeTable:
        """The table rows that ``length`` positions reach, and the row of each pair among them."""
        spec, table = self.spec, self.embedding.weight  # (R, D)
        rows = relative_rows(length, spec, table.device)  # (T, T) into all R rows
        # Distances up to buckets / 2 are not bucketed, so when every distance of the sequence is
        # that short, its rows are k - (T - 1) .. k + (T - 1) (clamped): the table is cut to them,
        # and so are the projections and the products of each layer (DeBERTa-v3-base, 128 tokens:
        # 255 of its 512 rows).
        if spec.max_distance is None or length - 1 <= spec.span // 2:
            low = max(spec.span - (length - 1), 0)
            high = min(spec.span + length, 2 * spec.span)
            table, rows = table[low:high], rows - low  # (R', D), (T, T) into R'
        if self.norm is not None:
            table = self.norm(table)  # row by row: cutting first changes nothing
        return RelativeTable(table, rows, self.dropout)

    def extra_repr(self) -> str:
        spec = self.spec
        return f"terms={list(spec.terms)}, span={spec.span}, max_distance={spec.max_distance}"


class DisentangledTerms(nn.Module):
    """One layer's c2p and p2c terms (eq. 4), scaled by its kernel's scale, as an additive (B, H,
    T, S) score term. With ``share_projections`` the layer's own query and key projections project
    the relative embeddings (their value rows are not computed); without, it owns those
    projections: ``key_proj`` (c2p's k_r) and ``query_proj`` (p2c's q_r)."""

    def __init__(self, spec: Disentangled, d_model: int, inner: int):
        super().__init__()
        self.terms = spec.terms
        self.share_projections = spec.share_projections
        if not spec.share_projections:
            self.key_proj = nn.Linear(d_model, inner) if "c2p" in spec.terms else None
            self.query_proj = nn.Linear(d_model, inner) if "p2c" in spec.terms else None

    def forward(self, q: Tensor, k: Tensor, table: RelativeTable,
                attention: "SelfAttention") -> Tensor:
        """q (B, H, T, Dh), k (B, H, S, Dh) of ``attention`` (the layer whose projections and kernel
        scale are used) -> (B, H, T, S)."""
        relative = table.embeddings
        if table.dropout is not None:  # a fresh mask in every layer, as DeBERTa's pos_dropout
            relative = table.dropout(relative)
        relative = relative.unsqueeze(0)  # (1, R, D)
        if self.share_projections:
            q_r, k_r = project_query_key(attention, relative)  # (1, H, R, Dh) each
        else:
            q_r = None if self.query_proj is None else attention.split_heads(
                self.query_proj(relative))  # (1, H, R, Dh)
            k_r = None if self.key_proj is None else attention.split_heads(self.key_proj(relative))
        batch, heads, length, _ = q.shape
        rows = table.rows  # (T, S)
        score = 0.0
        if "c2p" in self.terms:  # c2p[i, j] = q_i . k_r[rows[i, j]]
            by_row = per_row(q, k_r)  # (B, H, T, R)
            score = score + by_row.gather(-1, rows.expand(batch, heads, *rows.shape))
        if "p2c" in self.terms:  # p2c[i, j] = k_j . q_r[rows[i, j]]
            by_row = per_row(k, q_r)  # (B, H, S, R)
            index = rows.transpose(0, 1).expand(batch, heads, *reversed(rows.shape))  # (B,H,S,T)
            score = score + by_row.gather(-1, index).transpose(-1, -2)  # (B, H, T, S)
        return score * attention.kernel.score_scale(q.shape[-1])


def project_query_key(attention: "SelfAttention", x: Tensor) -> tuple[Tensor, Tensor]:
    """What ``attention.project`` gives as queries (B, H, L, Dh) and keys (B, Hkv, L, Dh) of x
    (B, L, D), without computing the values: fused projections use the query and key rows of
    their (D, 3D) weight only."""
    if attention.fused_projections:
        queries, keys, _ = attention.split_sizes
        rows = queries + keys
        proj = attention.qkv_proj
        bias = None if proj.bias is None else proj.bias[:rows]
        q, k = F.linear(x, proj.weight[:rows], bias).split((queries, keys), dim=-1)  # (B, L, *)
    else:
        q, k = attention.q_proj(x), attention.k_proj(x)
    q, k = attention.split_heads(q), attention.split_heads(k, attention.n_kv_heads)
    if attention.q_norm is not None:  # QK-norm, as ``project`` applies it
        q, k = attention.q_norm(q), attention.k_norm(k)
    return q, k


def per_row(x: Tensor, table: Tensor) -> Tensor:
    """x (B, H, L, Dh) times every row of each head's table (1, H, R, Dh) -> (B, H, L, R), as
    one product per head over all B * L vectors (broadcasting the table over B copies it B times)."""
    batch, heads, length, width = x.shape
    flat = x.transpose(0, 1).reshape(heads, batch * length, width)  # (H, B * L, Dh)
    out = flat @ table[0].transpose(-1, -2)  # (H, B * L, R)
    return out.view(heads, batch, length, -1).transpose(0, 1)  # (B, H, L, R)
