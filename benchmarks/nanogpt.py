"""nanoGPT as its ``model.py`` builds GPT-2 and its ``bench.py`` trains it: the peer of the LM rows.

The architecture of karpathy/nanoGPT's ``model.py`` (pre-norm blocks; a LayerNorm whose bias is
optional; causal self-attention through one (D, 3D) ``c_attn`` and SDPA with ``is_causal``; an MLP of
``c_fc``, exact GELU and ``c_proj``; learned positions; the output head tied to the token embedding;
N(0, 0.02) weights with the residual projections at 0.02 / sqrt(2 L); the loss computed in
``forward`` by ``F.cross_entropy`` over the full logits) and the set-up of its ``bench.py``
(``bias=False``, dropout 0, vocabulary 50304, bf16 autocast, TF32 allowed, AdamW through
``configure_optimizers``: weight decay on the 2-D tensors only, ``fused=True`` on CUDA; compiled
whole with ``torch.compile(model)``), written here for the benchmarks. ``aiayn_from_nanogpt`` builds
the aiayn ``CausalLM`` of the same architecture holding the same weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class NanoConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64 (nanoGPT's choice)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (nanoGPT's; torch's ``bias=False`` did not exist then)."""

    def __init__(self, width: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: NanoConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: NanoConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: NanoConfig):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: NanoConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias)))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None):
        t = idx.shape[1]
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay: float, learning_rate: float,
                             betas: tuple[float, float], device_type: str) -> torch.optim.AdamW:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas,
                                 fused=device_type == "cuda")

    def flops_per_token(self) -> float:
        """nanoGPT's ``estimate_mfu`` count: 6 N + 12 L H Q T (N without the position table)."""
        config = self.config
        n = sum(p.numel() for p in self.parameters()) - self.transformer.wpe.weight.numel()
        head = config.n_embd // config.n_head
        return 6 * n + 12 * config.n_layer * config.n_head * head * config.block_size


def bench_optimizer(model: nn.Module, device_type: str) -> torch.optim.AdamW:
    """``bench.py``'s optimizer (weight decay 1e-2, lr 1e-4, betas (0.9, 0.95)) for either model."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 1e-2},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=1e-4, betas=(0.9, 0.95), fused=device_type == "cuda")


def aiayn_config(config: NanoConfig):
    """The aiayn ``TransformerConfig`` of nanoGPT's architecture."""
    from aiayn import TransformerConfig

    return TransformerConfig(
        vocab_size=config.vocab_size, d_model=config.n_embd, n_heads=config.n_head,
        d_ff=4 * config.n_embd, n_encoder_layers=0, n_decoder_layers=config.n_layer,
        max_length=config.block_size, dropout=config.dropout, activation="gelu", norm_first=True,
        bias=config.bias, layer_norm_bias=config.bias, positions="learned",
        scale_embeddings=False, tie_output=True, init_std=0.02, scaled_residual_init=True)


def aiayn_from_nanogpt(model: GPT):
    """An aiayn ``CausalLM`` of the same architecture holding ``model``'s weights."""
    from aiayn import CausalLM

    ours = CausalLM(aiayn_config(model.config))
    names = {"lm_head.weight": "lm_head.weight",  # the tied matrix, under both names
             "transformer.wte.weight": "decoder.embeddings.tokens.weight",
             "transformer.wpe.weight": "decoder.embeddings.positions.weight",
             "transformer.ln_f.weight": "decoder.norm.weight",
             "transformer.ln_f.bias": "decoder.norm.bias"}
    layer = {"ln_1": "self_attention_residual.norm", "attn.c_attn": "self_attention.qkv_proj",
             "attn.c_proj": "self_attention.out_proj", "ln_2": "feedforward_residual.norm",
             "mlp.c_fc": "feedforward.linear1", "mlp.c_proj": "feedforward.linear2"}
    for index in range(model.config.n_layer):
        for theirs, mine in layer.items():
            for kind in ("weight", "bias"):
                names[f"transformer.h.{index}.{theirs}.{kind}"] = \
                    f"decoder.layers.{index}.{mine}.{kind}"
    source = model.state_dict()
    target = ours.state_dict()
    state = {mine: source[theirs] for theirs, mine in names.items() if theirs in source}
    missing = set(target) - set(state)
    if missing:
        raise ValueError(f"weights without a nanoGPT source: {sorted(missing)}")
    ours.load_state_dict(state)
    return ours
