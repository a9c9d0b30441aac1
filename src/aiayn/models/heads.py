"""Output heads and weight initialisation shared by the model families.

Legend: B batch, T length, D model width, V vocabulary, C classes.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from aiayn import inference_linear
from aiayn.config import TransformerConfig
from aiayn.feedforward import activation_function
from aiayn.normalisation import layer_norm


class OutputProjection(nn.Module):
    """Hidden states (B, T, D) -> logits (B, T, V); "the pre-softmax linear transformation" (3.4).

    With ``tied`` the weight is the given embedding matrix itself (paper 3.4), not a copy.
    """

    def __init__(self, config: TransformerConfig, embedding: nn.Embedding, *, tied: bool):
        super().__init__()
        vocab_size, d_model = embedding.weight.shape
        if tied:
            self.weight = embedding.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, d_model))
            nn.init.xavier_uniform_(self.weight)
        self.bias = nn.Parameter(torch.zeros(vocab_size)) if config.output_bias else None

    # Row counts for which the vocabulary-major product is used on CPU when no gradient is needed
    # and the derived-weight path (aiayn.inference_linear.small_rows_linear) does not apply; from
    # UNCOPIED_MIN_ROWS rows oneDNN on the uncopied weight is faster where it applies (2 threads,
    # cold weights, V 8192 D 256 / V 16384 D 512: 1.35 / 1.52x at 16 rows, 1.62 / 1.49x at 64,
    # level at 8, 0.53 / 0.60x at 2).
    VOCABULARY_MAJOR_ROWS = (2, 64)
    UNCOPIED_MIN_ROWS = 16
    # Where neither applies, from 6 to 12 rows the weight split across the threads as it is
    # (aiayn.inference_linear.split_rows) is faster than the vocabulary-major product (2 threads,
    # AVX2 kernels, cold weights, us, vocabulary-major / split: V 8192 D 256 at 6 / 8 / 12 rows
    # 756 / 640, 833 / 652, 1,393 / 767; V 32000 D 768 8,045 / 7,435, 10,313 / 7,546, 16,561 /
    # 9,081; at 2..5 rows and at 16 the vocabulary-major product is level or faster).
    SPLIT_ROWS = (6, 12)

    def forward(self, hidden: Tensor) -> Tensor:
        # Gradient mode first: training (and torch.compile's symbolic shapes) never reach the test.
        if not torch.is_grad_enabled() and hidden.device.type == "cpu":
            if inference_linear.uses_bf16_packed(hidden, self.weight):  # under CPU bf16 autocast
                return inference_linear.bf16_packed_linear(hidden, self.weight, self.bias)
            # A decoding step: a transposed copy (1 row) or oneDNN's packed weight (2..64 rows),
            # made once and rebuilt when the weight changes.
            if inference_linear.uses_small_rows(hidden, self.weight):
                return inference_linear.small_rows_linear(hidden, self.weight, self.bias)
            if (self.weight.shape[0] >= inference_linear.PACKED_MIN_OUTPUTS
                    and inference_linear.compiled_step_applies(hidden, self.weight)):
                return inference_linear.compiled_step_linear(hidden, self.weight, self.bias,
                                                             layer=False)
            rows = hidden.numel() // hidden.shape[-1]
            low, high = self.VOCABULARY_MAJOR_ROWS
            if low <= rows <= high:
                if (rows >= self.UNCOPIED_MIN_ROWS
                        and inference_linear.uses_uncopied_step(hidden, self.weight)):
                    return inference_linear.uncopied_step_linear(hidden, self.weight, self.bias)
                split_low, split_high = self.SPLIT_ROWS
                if split_low <= rows <= split_high:
                    parts = inference_linear.split_rows_parts(hidden, self.weight,
                                                              max_rows=split_high)
                    if parts > 1:
                        return inference_linear.split_rows(hidden, self.weight, self.bias, parts)
                return self._vocabulary_major(hidden, rows)
        return nn.functional.linear(hidden, self.weight, self.bias)

    def _vocabulary_major(self, hidden: Tensor, rows: int) -> Tensor:
        """The same logits as W h + b, computed as (W (V, D) @ h^T (D, N))^T.

        Decoding projects a handful of rows (N = batch x beams) onto a large vocabulary. ``linear``
        multiplies h (N, D) by the transposed (V, D) matrix, and the CPU BLAS then repacks all of W on
        every call; with W as the left, untransposed operand only the small h^T is packed. Measured
        (benchmarks/generation.py, 1 thread, V 8192, D 256): 5.7 -> 3.1 ms for N 8, 7.3 -> 5.8 ms for
        N 16. The result is made contiguous (a copy of N x V, small next to the product) so that callers
        see the layout ``linear`` gives; values equal ``linear``'s up to summation order.
        """
        flat = hidden.reshape(rows, hidden.shape[-1])  # (N, D)
        if self.bias is None:
            logits = torch.mm(self.weight, flat.t())  # (V, N)
        else:
            logits = torch.addmm(self.bias.unsqueeze(1), self.weight, flat.t())  # (V, N)
        return logits.t().contiguous().view(*hidden.shape[:-1], -1)  # (..., V)


def pool(hidden: Tensor, padding_mask: Tensor | None, how: str) -> Tensor:
    """(B, T, D) -> (B, D): the first token, or the mean over real tokens."""
    if how == "first":
        return hidden[:, 0]
    if padding_mask is None:
        return hidden.mean(dim=1)
    weights = padding_mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
    return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


class ClassificationHead(nn.Module):
    """Pooled (B, D) -> class logits (B, C), with BERT's optional dense + tanh "pooler"."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.pooler = nn.Linear(config.d_model, config.d_model) if config.pooler else None
        self.dropout = nn.Dropout(config.dropout)
        self.classifier = nn.Linear(config.d_model, config.num_labels)

    def forward(self, pooled: Tensor) -> Tensor:
        if self.pooler is not None:
            pooled = torch.tanh(self.pooler(pooled))
        return self.classifier(self.dropout(pooled))


class MaskedLMHead(nn.Module):
    """Hidden states (B, T, D) -> vocabulary logits (B, T, V) for masked-token prediction (BERT)."""

    def __init__(self, config: TransformerConfig, embedding: nn.Embedding):
        super().__init__()
        if config.mlm_transform:
            self.dense = nn.Linear(config.d_model, config.d_model)
            self.activation = activation_function(config.activation)
            self.norm = layer_norm(config)
        else:
            self.dense = None
        self.projection = OutputProjection(config, embedding, tied=config.tie_output)

    def forward(self, hidden: Tensor) -> Tensor:
        if self.dense is not None:
            hidden = self.norm(self.activation(self.dense(hidden)))
        return self.projection(hidden)


def initialise(model: nn.Module, config: TransformerConfig) -> None:
    """Initial weights. The paper gives none; we follow its reference code (tensor2tensor):
    Xavier-uniform matrices and N(0, D^-1/2) embeddings, which the sqrt(D) scaling brings to unit size.
    With ``config.init_std`` every matrix and embedding is N(0, init_std) instead (GPT-2, BERT).
    """
    for module in model.modules():
        if isinstance(module, nn.Linear):
            if config.init_std is None:
                nn.init.xavier_uniform_(module.weight)
            else:
                nn.init.normal_(module.weight, std=config.init_std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            std = config.init_std if config.init_std is not None else config.d_model ** -0.5
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, nn.LayerNorm):
            if module.weight is not None:
                nn.init.ones_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    if config.scaled_residual_init and config.init_std is not None:
        # GPT-2 (Radford et al. 2019, 2.3): the layers' projections into the residual stream, the
        # attention output and the FFN's second matrix, start at std / sqrt(2 * layers) so the sum
        # of 2 * layers residual branches keeps the size of one.
        layers = max(config.n_encoder_layers + config.n_decoder_layers, 1)
        std = config.init_std / (2 * layers) ** 0.5
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and name.endswith(("out_proj", "linear2")):
                nn.init.normal_(module.weight, std=std)
