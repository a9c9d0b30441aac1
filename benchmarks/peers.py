"""The peer models of the benchmarks and the aiayn twins built from their weights.

``aiayn_from_hf(hf_model)`` returns an aiayn model with the peer's architecture and weights: through
``aiayn.from_pretrained`` when the interop package provides it, otherwise through the explicit name maps
below (every aiayn parameter must be filled and every shape must match, so a mismatch cannot go unseen).
``NanoGPT`` is the "near limit" eager baseline: a minimal GPT on ``F.scaled_dot_product_attention``
written the way nanoGPT's ``model.py`` is.

Legend: B batch, T length, D model width, H heads, Dh head width, V vocabulary, L layers.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aiayn import TransformerConfig
from aiayn.models import CausalLM, Transformer, TransformerEncoder


# --- Hugging Face peers, random weights from configs (hub downloads are not available) ---------------
def hf_gpt2(*, d_model: int, layers: int, heads: int, vocab: int, positions: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=d_model, n_layer=layers, n_head=heads, vocab_size=vocab,
                        n_positions=positions, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return GPT2LMHeadModel._from_config(config, attn_implementation="sdpa")


def hf_marian(*, d_model: int, layers: int, heads: int, d_ff: int, vocab: int, positions: int):
    from transformers import MarianConfig, MarianMTModel

    config = MarianConfig(d_model=d_model, encoder_layers=layers, decoder_layers=layers,
                          encoder_attention_heads=heads, decoder_attention_heads=heads,
                          encoder_ffn_dim=d_ff, decoder_ffn_dim=d_ff, vocab_size=vocab,
                          decoder_vocab_size=vocab, max_position_embeddings=positions,
                          activation_function="swish", scale_embedding=True, dropout=0.0,
                          attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0,
                          eos_token_id=1, decoder_start_token_id=0, forced_eos_token_id=None)
    return MarianMTModel._from_config(config, attn_implementation="sdpa")


def hf_bert(*, d_model: int, layers: int, heads: int, d_ff: int, vocab: int, positions: int):
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=d_model, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=d_ff, vocab_size=vocab, max_position_embeddings=positions,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertModel._from_config(config, attn_implementation="sdpa", add_pooling_layer=False)


# --- explicit name maps (used until aiayn.from_pretrained exists) -------------------------------------
def _fill(target: nn.Module, values: dict[str, Tensor]) -> None:
    params = dict(target.named_parameters())  # tied matrices appear once
    missing = sorted(set(params) - set(values))
    unknown = sorted(set(values) - set(params))
    if missing or unknown:
        raise ValueError(f"weight map mismatch: unfilled {missing}, unknown {unknown}")
    with torch.no_grad():
        for name, value in values.items():
            if params[name].shape != value.shape:
                raise ValueError(f"{name}: aiayn {tuple(params[name].shape)} vs peer "
                                 f"{tuple(value.shape)}")
            params[name].copy_(value)


def _from_gpt2(hf) -> CausalLM:
    c = hf.config
    config = TransformerConfig(
        vocab_size=c.vocab_size, d_model=c.n_embd, n_heads=c.n_head, d_ff=4 * c.n_embd,
        n_encoder_layers=0, n_decoder_layers=c.n_layer, max_length=c.n_positions, dropout=0.0,
        activation="gelu_tanh", norm_first=True, layer_norm_eps=c.layer_norm_epsilon,
        positions="learned", scale_embeddings=False, tie_output=True, pad_id=0, bos_id=0, eos_id=0)
    model = CausalLM(config)
    s = hf.state_dict()
    values = {"decoder.embeddings.tokens.weight": s["transformer.wte.weight"],
              "decoder.embeddings.positions.weight": s["transformer.wpe.weight"],
              "decoder.norm.weight": s["transformer.ln_f.weight"],
              "decoder.norm.bias": s["transformer.ln_f.bias"]}
    for i in range(c.n_layer):
        h, a = f"transformer.h.{i}.", f"decoder.layers.{i}."
        for kind in ("weight", "bias"):
            t = (lambda x: x.t()) if kind == "weight" else (lambda x: x)  # Conv1D stores (in, out)
            values[a + f"self_attention.qkv_proj.{kind}"] = t(s[h + f"attn.c_attn.{kind}"])
            values[a + f"self_attention.out_proj.{kind}"] = t(s[h + f"attn.c_proj.{kind}"])
            values[a + f"feedforward.linear1.{kind}"] = t(s[h + f"mlp.c_fc.{kind}"])
            values[a + f"feedforward.linear2.{kind}"] = t(s[h + f"mlp.c_proj.{kind}"])
            values[a + f"self_attention_residual.norm.{kind}"] = s[h + f"ln_1.{kind}"]
            values[a + f"feedforward_residual.norm.{kind}"] = s[h + f"ln_2.{kind}"]
    _fill(model, values)
    return model


def _marian_attention(s: dict, src: str, dst: str, *, cross: bool, values: dict) -> None:
    for kind in ("weight", "bias"):
        q, k, v = (s[f"{src}.{p}_proj.{kind}"] for p in "qkv")
        if cross:
            values[f"{dst}.q_proj.{kind}"] = q
            values[f"{dst}.kv_proj.{kind}"] = torch.cat([k, v])
        else:
            values[f"{dst}.qkv_proj.{kind}"] = torch.cat([q, k, v])
        values[f"{dst}.out_proj.{kind}"] = s[f"{src}.out_proj.{kind}"]


def _from_marian(hf) -> Transformer:
    c = hf.config
    config = TransformerConfig(
        vocab_size=c.vocab_size, d_model=c.d_model, n_heads=c.encoder_attention_heads,
        d_ff=c.encoder_ffn_dim, n_encoder_layers=c.encoder_layers, n_decoder_layers=c.decoder_layers,
        max_length=c.max_position_embeddings, dropout=0.0, activation="silu", norm_first=False,
        positions="sinusoidal", sinusoid_layout="split", scale_embeddings=c.scale_embedding,
        tie_source_target=True, tie_output=True, output_bias=True, pad_id=c.pad_token_id,
        eos_id=c.eos_token_id, bos_id=c.pad_token_id, decoder_start_id=c.decoder_start_token_id)
    model = Transformer(config)
    s = hf.state_dict()
    values = {"encoder.embeddings.tokens.weight": s["model.shared.weight"],
              "generator.bias": s["final_logits_bias"][0]}
    for stack in ("encoder", "decoder"):
        layers = c.encoder_layers if stack == "encoder" else c.decoder_layers
        for i in range(layers):
            h, a = f"model.{stack}.layers.{i}.", f"{stack}.layers.{i}."
            _marian_attention(s, h + "self_attn", a + "self_attention", cross=False, values=values)
            first = "attention_residual" if stack == "encoder" else "self_attention_residual"
            for kind in ("weight", "bias"):
                values[a + f"{first}.norm.{kind}"] = s[h + f"self_attn_layer_norm.{kind}"]
                values[a + f"feedforward.linear1.{kind}"] = s[h + f"fc1.{kind}"]
                values[a + f"feedforward.linear2.{kind}"] = s[h + f"fc2.{kind}"]
                values[a + f"feedforward_residual.norm.{kind}"] = s[h + f"final_layer_norm.{kind}"]
            if stack == "decoder":
                _marian_attention(s, h + "encoder_attn", a + "cross_attention", cross=True,
                                  values=values)
                for kind in ("weight", "bias"):
                    values[a + f"cross_attention_residual.norm.{kind}"] = \
                        s[h + f"encoder_attn_layer_norm.{kind}"]
    _fill(model, values)
    return model


def _from_bert(hf) -> TransformerEncoder:
    c = hf.config
    config = TransformerConfig(
        vocab_size=c.vocab_size, d_model=c.hidden_size, n_heads=c.num_attention_heads,
        d_ff=c.intermediate_size, n_encoder_layers=c.num_hidden_layers, n_decoder_layers=0,
        max_length=c.max_position_embeddings, dropout=0.0, activation="gelu", norm_first=False,
        final_norm=False, layer_norm_eps=c.layer_norm_eps, positions="learned",
        scale_embeddings=False, embedding_norm=True, type_vocab_size=c.type_vocab_size,
        pad_id=c.pad_token_id, bos_id=0, eos_id=0)
    model = TransformerEncoder(config)
    s = hf.state_dict()
    e = "encoder.embeddings."
    values = {e + "tokens.weight": s["embeddings.word_embeddings.weight"],
              e + "positions.weight": s["embeddings.position_embeddings.weight"],
              e + "token_types.weight": s["embeddings.token_type_embeddings.weight"],
              e + "norm.weight": s["embeddings.LayerNorm.weight"],
              e + "norm.bias": s["embeddings.LayerNorm.bias"]}
    for i in range(c.num_hidden_layers):
        h, a = f"encoder.layer.{i}.", f"encoder.layers.{i}."
        for kind in ("weight", "bias"):
            values[a + f"self_attention.qkv_proj.{kind}"] = torch.cat(
                [s[h + f"attention.self.{p}.{kind}"] for p in ("query", "key", "value")])
            values[a + f"self_attention.out_proj.{kind}"] = s[h + f"attention.output.dense.{kind}"]
            values[a + f"attention_residual.norm.{kind}"] = s[h + f"attention.output.LayerNorm.{kind}"]
            values[a + f"feedforward.linear1.{kind}"] = s[h + f"intermediate.dense.{kind}"]
            values[a + f"feedforward.linear2.{kind}"] = s[h + f"output.dense.{kind}"]
            values[a + f"feedforward_residual.norm.{kind}"] = s[h + f"output.LayerNorm.{kind}"]
    _fill(model, values)
    return model


def aiayn_from_hf(hf) -> nn.Module:
    """The aiayn twin of a Hugging Face GPT-2 / Marian / BERT model (same weights and mode).

    Uses the interop package (``aiayn.interop.hf.from_transformers``) when present, else the maps above.
    """
    try:
        from aiayn.interop.hf import from_transformers
    except ImportError:
        builders = {"GPT2LMHeadModel": _from_gpt2, "MarianMTModel": _from_marian,
                    "BertModel": _from_bert}
        model = builders[type(hf).__name__](hf)
    else:
        model = from_transformers(hf)
    return model.train(hf.training)


# --- the nanoGPT-style baseline ---------------------------------------------------------------------
class NanoBlock(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d_model)
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: Tensor) -> Tensor:
        B, T, D = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(D, dim=2)
        q = q.view(B, T, self.heads, D // self.heads).transpose(1, 2)  # (B, H, T, Dh)
        k = k.view(B, T, self.heads, D // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, D // self.heads).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).contiguous().view(B, T, D))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class NanoGPT(nn.Module):
    """Minimal GPT-2 (pre-norm, learned positions, tied head) on SDPA with is_causal."""

    def __init__(self, *, d_model: int, layers: int, heads: int, vocab: int, positions: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(positions, d_model)
        self.h = nn.ModuleList(NanoBlock(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        return F.linear(self.ln_f(x), self.wte.weight)  # (B, T, V), tied head


def matmul_flops_per_token(d_model: int, layers: int, d_ff: int, vocab: int, length: int,
                           *, cross: bool = False) -> float:
    """Forward+backward FLOPs per token (nanoGPT/PaLM estimate: 6 N + 12 L D T).

    N counts the matmul weights of the blocks and the output projection (embedding lookups are free);
    the attention term counts QK^T and AV over the full T x T square (no causal discount).
    """
    attention = 4 * d_model * d_model * (2 if cross else 1)
    n = layers * (attention + 2 * d_model * d_ff) + d_model * vocab
    return 6 * n + 12 * layers * d_model * length * (2 if cross else 1)


def sinusoid(length: int, d_model: int) -> Tensor:
    """Split-layout table (sin | cos), as Marian's and the nn.Transformer peer's positions."""
    position = torch.arange(length, dtype=torch.float64).unsqueeze(1)
    frequency = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64)
                          * (-math.log(10000.0) / d_model))
    return torch.cat([(position * frequency).sin(), (position * frequency).cos()], dim=1).float()
