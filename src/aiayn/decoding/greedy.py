"""Greedy decoding of an encoder-decoder ``Transformer`` on its KV cache, batched.

Every sentence of a batch advances one token per step from position 0, so the decoder needs no
target padding mask; a sentence that has produced </s> leaves the batch (its cache rows are dropped),
and each row's computation never depends on the other rows, so the output does not depend on how
sentences are batched.

Legend: B sentences, S source length, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, nn

from aiayn.nn.attention.cache import DecoderCache


@dataclass
class Hypothesis:
    tokens: list[int]  # without </s>
    score: float  # log-probability (beam: divided by the length penalty)


def check_encoder_decoder(model: nn.Module, search: str) -> None:
    """Raise TypeError unless ``model`` encodes a source and decodes from it (an encoder-decoder
    ``Transformer``): a decoder-only or encoder-only model has nothing for a search to decode
    from (``generate``, which continues prompts, refuses an encoder-decoder the same way)."""
    if not (callable(getattr(model, "encode", None)) and callable(getattr(model, "decode", None))):
        raise TypeError(f"{search} decodes with an encoder-decoder model (Transformer), got "
                        f"{type(model).__name__}; continue prompts of a decoder-only model "
                        f"(CausalLM) with aiayn.decoding.generation.generate")


def output_limits(source_mask: Tensor, *, max_extra: int, model_max_length: int | None) -> Tensor:
    """Per-sentence number of output tokens, </s> included: the paper's "input length + 50"
    (section 6.1), capped by the position table (a hypothesis of n tokens feeds the decoder n
    positions: the start symbol and all but its last token; None: no table, no cap). Shape (B,).

    Raises:
        ValueError: ``source_mask`` is not (B, S), or ``max_extra`` is not a non-negative integer.
    """
    if not isinstance(source_mask, Tensor) or source_mask.dim() != 2:
        raise ValueError(f"source_mask must be a (B, S) tensor, got "
                         f"{tuple(getattr(source_mask, 'shape', ())) or type(source_mask).__name__}")
    if not isinstance(max_extra, int) or isinstance(max_extra, bool) or max_extra < 0:
        raise ValueError(f"max_extra must be a non-negative integer, got {max_extra!r}")
    limits = source_mask.sum(dim=1) + max_extra
    return limits if model_max_length is None else limits.clamp(max=model_max_length)


def first_tokens(model: nn.Module, rows: int, forced: Sequence[int], device,
                 start: int | None = None) -> Tensor:
    """The decoder's first input (rows, 1 + F): the start symbol (``start``, else the model's
    ``decoder_start_id``), then the ``forced`` tokens (a target language code). A forced token is
    generated with log-probability 0, as transformers' ``ForcedBOSTokenLogitsProcessor`` scores
    it, and counts towards the output length.

    Raises:
        ValueError: ``start`` or a forced token is not an id of the model's vocabulary.
    """
    first = [model.config.decoder_start_id if start is None else start, *forced]
    vocab = model.config.vocab_size
    for name, token in zip(("start", *["forced"] * len(forced)), first):
        if isinstance(token, (bool, float)) or not 0 <= int(token) < vocab:
            raise ValueError(f"{name} token {token!r} is not an id of the model's vocabulary "
                             f"(0..{vocab - 1})")
    return torch.tensor([int(token) for token in first], dtype=torch.long,
                        device=device).repeat(rows, 1)  # (rows, 1 + F)


def cross_attention_mask(source_mask: Tensor) -> Tensor | None:
    """The memory mask a search passes to its decoding steps: None when no position is padding (one
    sentence, or sentences of one length), so no step masks its cross-attention for nothing."""
    return None if bool(source_mask.all()) else source_mask


def blocked_tokens(model: nn.Module, start: int | None = None) -> list[int]:
    """Ids that are never generated: padding and the start symbol (the model's, and ``start`` where
    a search is given one), unless that is ``</s>`` (BART's decoder starts from ``</s>``, which must
    still end a hypothesis)."""
    config = model.config
    return sorted({config.pad_id, config.decoder_start_id, start} - {config.eos_id, None})


DecoderStep = Callable[[nn.Module, Tensor, "Tensor | None", DecoderCache], Tensor]


@torch.no_grad()
def decoder_step(model: nn.Module, tokens: Tensor, memory_padding_mask: Tensor | None,
                 cache: DecoderCache) -> Tensor:
    """Logits (B, V) of the next position of every row, after the first step (the cache then holds
    the memory's cross-attention keys/values); ``tokens`` (B, 1)."""
    return model.decode(tokens, None, memory_padding_mask=memory_padding_mask, cache=cache)[:, -1]


@torch.no_grad()
def greedy_search(model: nn.Module, source: Tensor, source_mask: Tensor, *,
                  max_extra: int = 50, step: DecoderStep = decoder_step,
                  forced: Sequence[int] = (), start: int | None = None) -> list[Hypothesis]:
    """The most likely next token at each step, until </s> or the length limit.

    Args:
        model: an encoder-decoder ``Transformer`` (in eval mode).
        source: (B, S) source ids; ``source_mask`` (B, S) True on real tokens.
        max_extra: output may be up to source length + ``max_extra`` tokens (paper: 50).
        step: computes each step after the first (default ``decoder_step``; ``aiayn.fast`` passes
            a compiled one).
        forced: tokens every output starts with after the start symbol, fed to the decoder with it
            (transformers' ``forced_bos_token_id``: NLLB's target language code); they count
            towards the length limit, score 0 and are left out of the hypotheses.
        start: the decoder's start symbol in place of the model's ``decoder_start_id``
            (transformers' ``decoder_start_token_id`` given to ``generate``: mBART's target
            language code); never generated, unless it is </s>.

    Returns:
        One hypothesis per sentence, in input order.

    Raises:
        TypeError: ``model`` is not an encoder-decoder (``generate`` continues a decoder-only one).
        ValueError: ``start`` or a forced token is not an id of the vocabulary, or ``max_extra``
            is not a non-negative integer.
    """
    check_encoder_decoder(model, "greedy_search")
    config = model.config
    batch = source.shape[0]
    limits = output_limits(source_mask, max_extra=max_extra, model_max_length=config.position_limit)
    limits = limits.clamp(min=len(forced) + 1)  # room for the forced tokens and </s>
    steps = int(limits.max())
    memory = model.encode(source, source_mask)  # (B, S, D)
    cache = model.new_cache(batch, steps)
    tokens = first_tokens(model, batch, forced, source.device, start)  # (B, 1 + F)
    alive = torch.arange(batch, device=source.device)  # original index of each row
    results: list[list[int]] = [[] for _ in range(batch)]
    scores = [0.0] * batch
    blocked = blocked_tokens(model, start)
    mask = cross_attention_mask(source_mask)  # (B, S) or None
    first = True
    for position in range(len(forced), steps):  # position: of the output token chosen
        if first:  # projects the memory into the cache
            logits = model.decode(tokens, memory, memory_padding_mask=mask, cache=cache)[:, -1]
        else:
            logits = step(model, tokens, mask, cache)
        logits = logits.float()  # (B_alive, V)
        first = False
        log_probs = torch.log_softmax(logits, dim=-1)
        log_probs[:, blocked] = -torch.inf
        forced = limits[alive] <= position + 1  # the last position a sentence may use: </s> only
        if bool(forced.any()):
            keep_eos = log_probs[:, config.eos_id].clone()
            log_probs[forced] = -torch.inf
            log_probs[forced, config.eos_id] = keep_eos[forced]
        best, next_tokens = log_probs.max(dim=-1)  # (B_alive,)
        finished = next_tokens == config.eos_id
        for row, (index, token, score) in enumerate(zip(alive.tolist(), next_tokens.tolist(),
                                                        best.tolist())):
            scores[index] += score
            if token != config.eos_id:
                results[index].append(token)
        if bool(finished.all()):
            break
        if bool(finished.any()):
            keep = (~finished).nonzero().squeeze(1)  # (B_alive',)
            cache.reorder(keep)
            alive, next_tokens = alive[keep], next_tokens[keep]
            mask = None if mask is None else mask[keep]
        tokens = next_tokens.unsqueeze(1)  # (B_alive, 1)
    return [Hypothesis(results[i], scores[i]) for i in range(batch)]
