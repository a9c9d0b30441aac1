"""Beam search for an encoder-decoder ``Transformer`` (paper 6.1: beam 4, length penalty alpha 0.6,
maximum output length input + 50), batched over sentences, on the KV cache.

Each sentence keeps K live hypotheses. Per step, the 2K best one-token extensions of all its beams
are ranked; extensions that end with </s> among the first K become finished hypotheses scored by
log P / lp, with GNMT's lp(Y) = ((5 + |Y|) / 6)^alpha (Wu et al. 2016, the paper's reference), and
the K best other extensions live on (``cache.reorder`` moves their keys/values). A sentence is done
when it has K finished hypotheses or when no live one can still beat its best finished one; done
sentences leave the batch. Rows never interact, so results do not depend on the batching, and beam 1
equals greedy search.

Legend: B sentences, K beams, S source length, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from aiayn.config_checks import is_count, is_number
from aiayn.decoding.greedy import (DecoderStep, Hypothesis, blocked_tokens, check_encoder_decoder,
                                   cross_attention_mask, decoder_step, first_tokens, output_limits)


def length_penalty(length: int | Tensor, alpha: float) -> float | Tensor:
    """GNMT's lp(Y) = ((5 + |Y|) / 6)^alpha; alpha 0 gives 1 (plain log-probability)."""
    return ((5.0 + length) / 6.0) ** alpha


def check_beam_options(beam_size: int, alpha: float, vocab_size: int) -> None:
    """Raise ValueError unless K is a positive integer with 2K candidates in the vocabulary and
    alpha a non-negative number (a bool is neither: True would silently mean 1)."""
    if not is_count(beam_size):
        raise ValueError(f"beam_size must be a positive integer, got {beam_size!r}")
    if 2 * beam_size > vocab_size:
        raise ValueError(f"beam_size {beam_size} is too large for a vocabulary of {vocab_size}")
    if not is_number(alpha) or not alpha >= 0:  # NaN too
        raise ValueError(f"alpha must be a non-negative number, got {alpha!r}")


def force_eos(log_probs: Tensor, forced: Tensor, eos: int) -> Tensor:
    """``log_probs`` (n*K, V) where rows ``forced`` (n*K,) may only end: every token but </s> -inf."""
    others = torch.arange(log_probs.shape[-1], device=log_probs.device) != eos  # (V,)
    return log_probs.masked_fill(forced.unsqueeze(1) & others, -torch.inf)


@dataclass
class Extensions:
    """One step's choice for n sentences of K beams (``extend``)."""

    top_scores: Tensor  # (n, 2K) summed log-probabilities of the 2K best one-token extensions
    top_beam: Tensor  # (n, 2K) the beam each of them extends
    top_token: Tensor  # (n, 2K) the token it adds
    scores: Tensor  # (n, K) the K best that do not end with </s>: the live beams' scores
    beams: Tensor  # (n, K) the beam each live one extends
    tokens: Tensor  # (n, K) its new token


def extend(log_probs: Tensor, scores: Tensor, eos: int) -> Extensions:
    """The 2K best extensions of each sentence's K beams and the K live ones among them.

    ``log_probs`` (n*K, V) of the next token (modified in place), ``scores`` (n, K) of the beams.
    """
    n, K = scores.shape
    vocab = log_probs.shape[-1]
    candidates = log_probs.view(n, K, vocab).add_(scores.unsqueeze(2))  # (n, K, V), in place
    top_scores, top_index = candidates.view(n, K * vocab).topk(2 * K, dim=1)  # (n, 2K)
    top_beam = top_index // vocab  # (n, 2K)
    top_token = top_index % vocab  # (n, 2K)
    live_scores = top_scores.masked_fill(top_token == eos, -torch.inf)
    live, order = live_scores.topk(K, dim=1)  # (n, K)
    return Extensions(top_scores, top_beam, top_token, live, top_beam.gather(1, order),
                      top_token.gather(1, order))


def best_hypothesis(finished: list[Hypothesis]) -> Hypothesis:
    """The highest-scoring finished hypothesis (the first among equals); none: empty, -inf."""
    return max(finished, key=lambda h: h.score) if finished else Hypothesis([], float("-inf"))


def sentence_done(finished: list[Hypothesis], limit: int, position: int, best_live: float,
                  beam_size: int, alpha: float) -> bool:
    """Whether a sentence stops after step ``position``: its length limit is reached, or it has
    ``beam_size`` finished hypotheses, or no live beam can still beat its best finished one (live
    log-probabilities only fall, so ``best_live`` / lp(limit) bounds what a live beam can reach)."""
    if limit <= position + 1:
        return True
    return bool(finished) and (
        len(finished) >= beam_size
        or max(h.score for h in finished) >= best_live / length_penalty(limit, alpha))


@torch.no_grad()
def beam_search(model: nn.Module, source: Tensor, source_mask: Tensor, *, beam_size: int = 4,
                alpha: float = 0.6, max_extra: int = 50, step: DecoderStep = decoder_step,
                forced: Sequence[int] = (), start: int | None = None) -> list[Hypothesis]:
    """The best hypothesis of a beam search for each sentence.

    Args:
        model: an encoder-decoder ``Transformer`` (in eval mode).
        source: (B, S) source ids; ``source_mask`` (B, S) True on real tokens.
        beam_size: K (paper: 4); 1 is greedy search.
        alpha: length penalty exponent (paper: 0.6).
        max_extra: output may be up to source length + ``max_extra`` tokens (paper: 50).
        step: computes each step after the first (default ``decoder_step``; ``aiayn.fast`` passes
            a compiled one).
        forced: tokens every hypothesis starts with after the start symbol (``greedy_search``'s):
            scored 0, counted in the length (as transformers counts its forced BOS token), left out
            of the hypotheses.
        start: the decoder's start symbol in place of the model's (``greedy_search``'s).

    Raises:
        TypeError: ``model`` is not an encoder-decoder (``generate`` continues a decoder-only one).
        ValueError: beam_size not an integer >= 1 or larger than the vocabulary allows, alpha not
            a number >= 0, max_extra not an integer >= 0; ``start`` or a forced token is not an id
            of the vocabulary.
    """
    check_encoder_decoder(model, "beam_search")
    config = model.config
    check_beam_options(beam_size, alpha, config.vocab_size)
    K, eos = beam_size, config.eos_id
    device = source.device
    batch = source.shape[0]
    limits_all = output_limits(source_mask, max_extra=max_extra,
                               model_max_length=config.position_limit)
    limits_all = limits_all.clamp(min=len(forced) + 1)  # room for the forced tokens and </s>
    steps = int(limits_all.max())
    memory = model.encode(source, source_mask)  # (B, S, D)
    mask = cross_attention_mask(source_mask)  # (B, S) or None
    # The K beams of a sentence share its memory: the cache keeps its cross-attention keys/values
    # once per sentence (no repeat, no reorder when beams swap).
    cache = model.new_cache(batch * K, steps, rows_per_memory=K)
    alive = list(range(batch))  # original sentence index of each live batch entry
    limits = limits_all.tolist()
    # Only beam 0 is real at the start; the others would duplicate it.
    scores = torch.full((batch, K), -torch.inf, device=device)  # (B, K) summed log-probabilities
    scores[:, 0] = 0.0
    history = torch.empty((batch * K, 0), dtype=torch.long, device=device)  # (B*K, t)
    tokens = first_tokens(model, batch * K, forced, device, start)  # (B*K, 1 + F)
    finished: list[list[Hypothesis]] = [[] for _ in range(batch)]
    blocked = blocked_tokens(model, start)
    first = True
    for position in range(len(forced), steps):  # position: of the output token chosen
        n = len(alive)
        if first:  # projects the memory into the cache
            logits = model.decode(tokens, memory, memory_padding_mask=mask, cache=cache)[:, -1]
        else:
            logits = step(model, tokens, mask, cache)
        logits = logits.float()  # (n*K, V)
        first = False
        log_probs = torch.log_softmax(logits, dim=-1)  # (n*K, V)
        log_probs[:, blocked] = -torch.inf
        at_limit = [limits[i] <= position + 1 for i in alive]  # host lists: no tensor, no sync
        if any(at_limit):  # the last position a sentence may use: </s> only
            forced = torch.tensor(at_limit, device=device).repeat_interleave(K)  # (n*K,)
            log_probs = force_eos(log_probs, forced, eos)
        chosen = extend(log_probs, scores, eos)

        # Finished hypotheses: </s> extensions among the first K candidates (fairseq's rule).
        is_eos = chosen.top_token[:, :K] == eos
        eos_first_k = (is_eos & torch.isfinite(chosen.top_scores[:, :K])).nonzero().tolist()
        if eos_first_k:
            length = position + 1  # tokens including </s>
            penalty = length_penalty(length, alpha)
            for row, column in eos_first_k:
                beam = int(chosen.top_beam[row, column])
                sequence = history[row * K + beam].tolist()
                finished[alive[row]].append(
                    Hypothesis(sequence, float(chosen.top_scores[row, column]) / penalty))

        # Live hypotheses: the K best extensions that do not end the sentence.
        scores, new_tokens = chosen.scores, chosen.tokens  # (n, K)
        rows = (chosen.beams + torch.arange(n, device=device).unsqueeze(1) * K).view(-1)  # (n*K,)

        best_live = scores[:, 0].tolist()
        keep_sentences = [row for row, index in enumerate(alive) if not sentence_done(
            finished[index], limits[index], position, best_live[row], K, alpha)]
        if not keep_sentences:
            break
        if len(keep_sentences) < n:
            keep = torch.tensor(keep_sentences, device=device)
            rows = rows.view(n, K)[keep].view(-1)
            scores, new_tokens = scores[keep], new_tokens[keep]
            alive = [alive[row] for row in keep_sentences]
            mask = None if mask is None else mask[keep]  # (n', S)
            cache.select_sources(keep)
        cache.reorder(rows, cross=False)  # self-attention only: cross keys/values are per sentence
        history = torch.cat([history[rows], new_tokens.view(-1, 1)], dim=1)  # (n'*K, t+1)
        tokens = new_tokens.view(-1, 1)  # (n'*K, 1)
    return [best_hypothesis(hypotheses) for hypotheses in finished]
