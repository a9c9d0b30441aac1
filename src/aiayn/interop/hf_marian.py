"""Marian (``MarianMTModel``) and BART (``BartForConditionalGeneration``) checkpoints <-> aiayn's
encoder-decoder ``Transformer``.

Both are the paper's post-norm encoder-decoder (3.1) with separate q/k/v projections (concatenated here
into the fused ``qkv_proj`` and, for cross-attention, ``kv_proj``), a logits bias ``final_logits_bias``
(-> ``output_bias``) and the output projection tied to the target embedding. They differ in:

    Marian (modeling_marian.py)                         BART (modeling_bart.py)
    sinusoidal positions, sin | cos halves               learned positions, table indexed from 2
      (``sinusoid_layout="split"``), not saved            (``position_offset=2``; 2 spare rows)
    embeddings * sqrt(D) when scale_embedding (true      embeddings * sqrt(D) when scale_embedding
      for the OPUS models)                                (false for facebook/bart-*)
    no embedding LayerNorm                               ``layernorm_embedding`` after tokens +
                                                          positions (``embedding_norm``)
    SiLU ("swish") in the OPUS models                    GELU
    decoder starts from pad (decoder_start_token_id)     decoder starts from eos (id 2)
    source/target vocabularies may differ               one shared vocabulary
      (share_encoder_decoder_embeddings=false)

Both scale the token embeddings only, never the positions, exactly like aiayn's ``Embeddings``; with a
cache, positions continue from the number of tokens already decoded (HF: past_key_values_length).

Legend: D model width, F feed-forward width, V target vocabulary, Vs source vocabulary.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor, nn

from aiayn.config import TransformerConfig
from aiayn.interop.hf_common import (AIAYN_ACTIVATIONS, Checkpoint, NameMap, Rule,
                                     activation_from_hf, build_config, require)
from aiayn.models import Transformer
from aiayn.nn.positions import sinusoidal_table

MODEL_TYPES = ("marian", "bart")
ARCHITECTURES = {"MarianMTModel": "seq2seq", "BartForConditionalGeneration": "seq2seq",
                 "MarianModel": "seq2seq", "BartModel": "seq2seq"}


def config_from_hf(hf: dict[str, Any], checkpoint: Checkpoint,
                   overrides: dict[str, Any]) -> TransformerConfig:
    """The aiayn config of a Marian or BART config.json (``overrides`` win)."""
    source = checkpoint.directory
    marian = hf.get("model_type") == "marian"
    for encoder_name, decoder_name in (("encoder_attention_heads", "decoder_attention_heads"),
                                       ("encoder_ffn_dim", "decoder_ffn_dim")):
        if require(hf, encoder_name, source) != require(hf, decoder_name, source):
            raise ValueError(f"{source / 'config.json'}: {encoder_name}={hf[encoder_name]} differs "
                             f"from {decoder_name}={hf[decoder_name]}; aiayn's stacks share one size")
    for name in ("normalize_before", "add_final_layer_norm"):  # pre-norm variants (mBART): not BART
        if hf.get(name):
            raise ValueError(f"{source / 'config.json'}: {name}=true is not supported")
    if not hf.get("normalize_embedding", True) or hf.get("static_position_embeddings"):
        raise ValueError(f"{source / 'config.json'}: normalize_embedding=false / "
                         f"static_position_embeddings=true are not supported")
    shared = hf.get("share_encoder_decoder_embeddings", True) if marian else True
    vocab_size = require(hf, "vocab_size", source)
    target_vocab = (hf.get("decoder_vocab_size") or vocab_size) if marian else vocab_size
    pad = require(hf, "pad_token_id", source)
    eos = hf.get("eos_token_id")
    eos = eos if isinstance(eos, int) else (eos[0] if isinstance(eos, list) and eos else 2)
    start = hf.get("decoder_start_token_id")
    start = start if isinstance(start, int) else (pad if marian else eos)
    bos = hf.get("bos_token_id")
    bos = bos if isinstance(bos, int) else start  # Marian has no bos: generation starts from pad
    fields: dict[str, Any] = dict(
        vocab_size=target_vocab, src_vocab_size=vocab_size, tie_source_target=shared,
        d_model=require(hf, "d_model", source), n_heads=hf["encoder_attention_heads"],
        d_ff=hf["encoder_ffn_dim"], n_encoder_layers=require(hf, "encoder_layers", source),
        n_decoder_layers=require(hf, "decoder_layers", source),
        max_length=hf.get("max_position_embeddings", 1024), dropout=hf.get("dropout", 0.1),
        attention_dropout=hf.get("attention_dropout", 0.0),
        activation_dropout=hf.get("activation_dropout", 0.0),
        activation=activation_from_hf(hf.get("activation_function", "gelu"),
                                      "activation_function", source),
        norm_first=False, final_norm=False, layer_norm_eps=1e-5,  # nn.LayerNorm's default in HF
        positions="sinusoidal" if marian else "learned", sinusoid_layout="split",
        position_offset=0 if marian else 2, scale_embeddings=bool(hf.get("scale_embedding", False)),
        embedding_norm=not marian, type_vocab_size=0,
        tie_output=hf.get("tie_word_embeddings", True), output_bias=True,
        output_bias_buffer=True, embedding_padding_idx=True,  # as transformers trains them
        init_std=hf.get("init_std", 0.02), pad_id=pad, bos_id=bos, eos_id=eos,
        decoder_start_id=start)
    fields.update(overrides)
    return build_config(fields, source)


def _attention(ours: str, hf: str, *, cross: bool, fused: bool, n: int) -> list[Rule]:
    rules = []
    for kind in ("weight", "bias"):
        q, k, v = (f"{hf}{name}.{kind}" for name in ("q_proj", "k_proj", "v_proj"))
        if fused and not cross:
            rules.append(Rule(f"{ours}qkv_proj.{kind}", (q, k, v), n))
        elif fused:
            rules += [Rule(f"{ours}q_proj.{kind}", (q,), n), Rule(f"{ours}kv_proj.{kind}", (k, v), n)]
        else:
            rules += [Rule(f"{ours}{name}_proj.{kind}", (source,), n)
                      for name, source in (("q", q), ("k", k), ("v", v))]
        rules.append(Rule(f"{ours}out_proj.{kind}", (f"{hf}out_proj.{kind}",), n))
    return rules


def _stack(config: TransformerConfig, side: str, prefix: str) -> list[Rule]:
    """Rules for one stack; ``side`` is "encoder" or "decoder" in both naming schemes."""
    n = config.n_encoder_layers if side == "encoder" else config.n_decoder_layers
    ours, hf = f"{side}.layers.{{}}.", f"{prefix}{side}.layers.{{}}."
    fused = config.fused_projections
    rules = _attention(f"{ours}self_attention.", f"{hf}self_attn.", cross=False, fused=fused, n=n)
    norms = {"self_attn_layer_norm": "attention_residual" if side == "encoder"
             else "self_attention_residual", "final_layer_norm": "feedforward_residual"}
    if side == "decoder":
        rules += _attention(f"{ours}cross_attention.", f"{hf}encoder_attn.", cross=True, fused=fused,
                            n=n)
        norms["encoder_attn_layer_norm"] = "cross_attention_residual"
    for kind in ("weight", "bias"):
        rules += [Rule(f"{ours}feedforward.linear1.{kind}", (f"{hf}fc1.{kind}",), n),
                  Rule(f"{ours}feedforward.linear2.{kind}", (f"{hf}fc2.{kind}",), n)]
        rules += [Rule(f"{ours}{residual}.norm.{kind}", (f"{hf}{norm}.{kind}",), n)
                  for norm, residual in norms.items()]
        if config.embedding_norm:
            rules.append(Rule(f"{side}.embeddings.norm.{kind}",
                              (f"{prefix}{side}.layernorm_embedding.{kind}",)))
    if config.final_norm:  # mBART, M2M100: a LayerNorm after the last layer
        rules += [Rule(f"{side}.norm.{kind}", (f"{prefix}{side}.layer_norm.{kind}",))
                  for kind in ("weight", "bias")]
    if config.positions == "learned":
        rules.append(Rule(f"{side}.embeddings.positions.weight",
                          (f"{prefix}{side}.embed_positions.weight",)))
    return rules


def name_map(config: TransformerConfig, prefix: str, *, has_head: bool,
             untied_layout: bool) -> NameMap:
    """How a Marian/BART checkpoint (keys under ``prefix``: "model." or "") fills a ``Transformer``.

    ``untied_layout``: transformers >= 5 with ``tie_word_embeddings=false`` unties every embedding
    (encoder, decoder, lm_head each its own key; ``shared`` is then unused by HF's forward).
    """
    rules = _stack(config, "encoder", prefix) + _stack(config, "decoder", prefix)
    encoder_tokens, target_tokens = (f"{prefix}encoder.embed_tokens.weight",
                                     f"{prefix}decoder.embed_tokens.weight")
    shared = f"{prefix}shared.weight"
    ties: list[tuple[str, ...]] = []
    dropped: list[str] = []
    if untied_layout:
        dropped.append(re.escape(shared))
    elif config.tie_source_target:
        ties.append((shared, encoder_tokens, target_tokens))
        encoder_tokens = target_tokens = shared
    rules.append(Rule("encoder.embeddings.tokens.weight", (encoder_tokens,)))
    if not config.tie_source_target or untied_layout:
        rules.append(Rule("decoder.embeddings.tokens.weight", (target_tokens,)))
    new = []
    if config.tie_output:
        ties = [group + ("lm_head.weight",) if group[0] == target_tokens else group for group in ties]
        if not ties:
            ties.append((target_tokens, "lm_head.weight"))
    elif has_head:
        rules.append(Rule("generator.weight", ("lm_head.weight",)))
    else:
        new.append("generator.weight")
    if config.output_bias:
        if has_head:
            rules.append(Rule("generator.bias", ("final_logits_bias",), layout="row"))
        else:
            new.append("generator.bias")  # MarianModel/BartModel: no logits bias, zeros as in HF
    constants, ignore = {}, []
    if config.positions == "sinusoidal" and config.sinusoid_layout == "split":
        # Marian's fixed table, saved by older transformers
        table = sinusoidal_table(config.max_length, config.d_model, config.sinusoid_layout)
        constants = {f"{prefix}{side}.embed_positions.weight": table
                     for side in ("encoder", "decoder")}
    elif config.positions == "sinusoidal":  # M2M100's fixed table (never saved by transformers)
        ignore = [re.escape(f"{prefix}{side}.embed_positions.weights")
                  for side in ("encoder", "decoder")]
    return NameMap(rules, ties=ties, ignore=ignore, constants=constants, new=new,
                   dropped=dropped)


def plan(checkpoint: Checkpoint, architecture: str, task: str | None,
         overrides: dict[str, Any], *, make_config=None, family: str = "Marian/BART"
         ) -> tuple[nn.Module, NameMap]:
    """The ``Transformer`` and name map of a checkpoint; ``make_config`` (default
    ``config_from_hf``) translates its config.json (``aiayn.interop.hf_multilingual`` passes its
    own for mBART and M2M100, which name their weights as BART does)."""
    if task not in (None, "seq2seq"):
        raise ValueError(f"a {family} checkpoint loads as 'seq2seq', not task={task!r}")
    prefix = "model." if any(k.startswith("model.") for k in checkpoint.tensors) else ""
    has_head = "final_logits_bias" in checkpoint.tensors or "lm_head.weight" in checkpoint.tensors
    untied_layout = (not checkpoint.config.get("tie_word_embeddings", True)
                     and f"{prefix}encoder.embed_tokens.weight" in checkpoint.tensors)
    if untied_layout:  # separate encoder and decoder matrices, even with one vocabulary
        overrides = {"tie_source_target": False, **overrides}
    config = (make_config or config_from_hf)(checkpoint.config, checkpoint, overrides)
    target_tokens = f"{prefix}decoder.embed_tokens.weight"
    embedding = checkpoint.tensors.get(target_tokens)
    if (not config.tie_source_target and embedding is not None
            and embedding.shape[0] == config.src_vocab_size > config.vocab_size):
        # transformers < 5 gives a separate-vocabulary Marian decoder a copy of the source
        # embedding (Vs rows); target ids (< V) only ever index its first V rows.
        checkpoint.tensors[target_tokens] = embedding[:config.vocab_size]
    return Transformer(config), name_map(config, prefix, has_head=has_head,
                                         untied_layout=untied_layout)


# --- export --------------------------------------------------------------------------------------
def matches(model: nn.Module) -> bool:
    return isinstance(model, Transformer)


def pick_flavour(config: TransformerConfig, flavours: dict[str, dict[str, Any]]) -> str:
    """The first of ``flavours`` (name -> the config values it needs) whose values the config has.

    Raises:
        ValueError: none fits; the message gives what each needs and what the model has.
    """
    for name, wanted in flavours.items():
        if all(getattr(config, field) == value for field, value in wanted.items()):
            return name
    fields = sorted({field for wanted in flavours.values() for field in wanted})
    names = " or ".join(FLAVOUR_NAMES.get(name, name) for name in flavours)
    needs = ", ".join(f"{FLAVOUR_NAMES.get(name, name)} needs {wanted}"
                      for name, wanted in flavours.items())
    has = ", ".join(f"{field}={getattr(config, field)!r}" for field in fields)
    raise ValueError(f"cannot export as {names}: {needs}; the model has {has}")


FLAVOUR_NAMES = {"marian": "Marian", "bart": "BART", "mbart": "mBART", "m2m_100": "M2M100"}


def _flavour(config: TransformerConfig) -> str:
    return pick_flavour(config, {
        "marian": dict(positions="sinusoidal", sinusoid_layout="split", embedding_norm=False,
                       positions_skip_padding=False, position_offset=0),
        "bart": dict(positions="learned", position_offset=2, embedding_norm=True,
                     tie_source_target=True, positions_skip_padding=False)})


def hf_fields(config: TransformerConfig) -> dict[str, Any]:
    """The config.json fields that Marian, BART, mBART and M2M100 name alike."""
    return dict(d_model=config.d_model, vocab_size=config.src_vocab_size,
                encoder_layers=config.n_encoder_layers, decoder_layers=config.n_decoder_layers,
                encoder_attention_heads=config.n_heads, decoder_attention_heads=config.n_heads,
                encoder_ffn_dim=config.d_ff, decoder_ffn_dim=config.d_ff,
                max_position_embeddings=config.max_length, dropout=config.dropout,
                attention_dropout=config.attention_dropout,
                activation_dropout=config.activation_dropout,
                activation_function=AIAYN_ACTIVATIONS[config.activation],
                scale_embedding=config.scale_embeddings, tie_word_embeddings=config.tie_output,
                pad_token_id=config.pad_id, eos_token_id=config.eos_id,
                decoder_start_token_id=config.decoder_start_id,
                init_std=config.init_std or 0.02, is_encoder_decoder=True)


def export(model: nn.Module) -> tuple[dict[str, Any], NameMap]:
    """The HF config.json and name map that write an aiayn ``Transformer`` as Marian or BART."""
    config: TransformerConfig = model.config
    flavour = _flavour(config)
    for name, value in dict(norm_first=False, final_norm=False, bias=True, type_vocab_size=0,
                            layer_norm_eps=1e-5).items():
        if getattr(config, name) != value:
            raise ValueError(f"cannot export as {flavour}: it needs {name}={value!r}, the model has "
                             f"{name}={getattr(config, name)!r}")
    hf = dict(model_type=flavour, **hf_fields(config))
    if flavour == "marian":
        hf.update(architectures=["MarianMTModel"], decoder_vocab_size=config.vocab_size,
                  share_encoder_decoder_embeddings=config.tie_source_target, bos_token_id=None)
    else:
        hf.update(architectures=["BartForConditionalGeneration"], bos_token_id=config.bos_id)
    return hf, name_map(config, "model.", has_head=True, untied_layout=not config.tie_output)


def extra_tensors(model: nn.Module) -> dict[str, Tensor]:
    """What HF expects beyond the mapped parameters: ``final_logits_bias`` of zeros when the aiayn
    model has no output bias, and ``shared`` (unused by HF's forward) in the untied layout."""
    config: TransformerConfig = model.config
    extra = {}
    if not config.output_bias:
        extra["final_logits_bias"] = torch.zeros(1, config.vocab_size)
    if not config.tie_output and config.tie_source_target:
        extra["model.shared.weight"] = model.encoder.embeddings.tokens.weight.detach().clone()
    return extra
