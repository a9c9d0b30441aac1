"""Autoregressive generation from a decoder-only model on the static KV cache.

One prefill of the (left-padded) prompts, then one token per step: greedy, temperature, top-k and
top-p (nucleus) sampling, stop token ids, a host-side stop test (e.g. stop strings), a seeded
generator, batched prompts of different lengths, and a per-step streaming callback.

Per step the loop runs the model on one new token per row and writes into buffers allocated once
(the token buffer, the key-padding mask, the positions); nothing is read back to the host except where
a stop condition needs it, every ``check_every`` steps (or every step when a callback streams tokens).

Left padding: row b's prompt of length L_b sits at the right end of the L columns, its pad columns are
False in the key-padding mask and its real tokens get positions 0..L_b-1 (explicit ``positions``), so
every row computes what it would compute alone.

Past the context: with ``slide=True`` a full cache is rebuilt from the last ``context // 2`` tokens
(one prefill) and generation goes on, as nanoGPT's sampler crops its input to the block size; without
it, asking for more tokens than the cache holds is an error before anything runs.

Legend: B batch (prompts), L padded prompt length, N new tokens, V vocabulary, C cache capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor, nn

from aiayn.decoding.top_k import top_k as select_top_k

StepCallback = Callable[[int, Tensor, Tensor], None]
StopTest = Callable[[int, list[int]], bool]


@dataclass
class Generation:
    """What ``generate`` returns.

    Attributes:
        tokens: the new tokens of each prompt (stop token and everything after it left out).
        finish_reasons: per prompt, "stop_id" (a stop token), "stop" (the stop test) or "length".
    """

    tokens: list[list[int]]
    finish_reasons: list[str]


def filter_logits(logits: Tensor, *, top_k: int | None = None, top_p: float | None = None
                  ) -> Tensor:
    """Logits (B, V) with -inf outside the top-k set and outside the top-p nucleus.

    top-k keeps the k largest logits (ties at the k-th value are kept). top-p keeps the smallest set of
    most likely tokens whose probability mass reaches ``top_p`` (Holtzman et al. 2020); the most likely
    token is always kept. Both together: top-k first, then the nucleus of what is left.
    """
    if top_k is not None and top_k < logits.shape[-1]:
        kth = select_top_k(logits, top_k)[0][..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V) each
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # (B, V): mass of the more likely tokens
        drop_sorted = mass_before >= top_p  # the first token has mass_before 0 < top_p: kept
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_tokens(logits: Tensor, *, greedy: bool = False, temperature: float = 1.0,
                top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """Pick one token per row from logits (B, V); returns (B,) token ids."""
    if greedy:
        return logits.argmax(dim=-1)
    logits = filter_logits(logits.float() / temperature, top_k=top_k, top_p=top_p)
    probs = logits.softmax(dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _check_arguments(max_new_tokens: int, temperature: float, top_k: int | None,
                     top_p: float | None, check_every: int) -> None:
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be a positive integer or None, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1] or None, got {top_p!r}")
    if not isinstance(check_every, int) or check_every < 1:
        raise ValueError(f"check_every must be a positive integer, got {check_every!r}")


def _prompt_rows(prompt_ids: Tensor | Sequence[Sequence[int]] | Sequence[int], vocab_size: int
                 ) -> list[list[int]]:
    if isinstance(prompt_ids, Tensor):
        if prompt_ids.dim() not in (1, 2) or prompt_ids.dtype not in (torch.long, torch.int32):
            raise ValueError(f"prompt_ids must be an integer (T,) or (B, T) tensor, got "
                             f"{prompt_ids.dtype} {tuple(prompt_ids.shape)}")
        rows = prompt_ids.reshape(-1, prompt_ids.shape[-1]).tolist()
    elif len(prompt_ids) and all(isinstance(t, int) for t in prompt_ids):
        rows = [list(prompt_ids)]
    else:
        rows = [list(row) for row in prompt_ids]
    if not rows:
        raise ValueError("no prompts given")
    for index, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompt {index} is empty; give at least one token (e.g. a newline "
                             f"or a start token)")
        bad = [t for t in row if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {index} holds token id {bad[0]!r} outside the vocabulary "
                             f"[0, {vocab_size})")
    return rows


@torch.no_grad()
def generate(model: nn.Module, prompt_ids: Tensor | Sequence[Sequence[int]] | Sequence[int], *,
             max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, greedy: bool = False, stop_ids: Sequence[int] = (),
             stop: StopTest | None = None, check_every: int = 8,
             generator: torch.Generator | None = None, seed: int | None = None,
             on_step: StepCallback | None = None, context: int | None = None,
             slide: bool = False, pad_id: int | None = None, compile: bool = False) -> Generation:
    """Continue each prompt with up to ``max_new_tokens`` tokens.

    Args:
        model: a ``CausalLM`` (any module with ``config``, ``new_cache`` and
            ``forward(ids, padding_mask=, positions=, cache=)``); put in eval mode for the call.
        prompt_ids: one prompt (list of ints or (T,) tensor) or several (list of lists of different
            lengths, or a (B, T) tensor); several prompts are left-padded into one batch.
        max_new_tokens: tokens to add per prompt at most.
        temperature: divides the logits; 0 means greedy.
        top_k / top_p: sample only from the k most likely tokens / from the nucleus of mass p.
        greedy: take the most likely token (ignores temperature, top_k, top_p, generator).
        stop_ids: token ids that end a row (e.g. eos); checked on the device.
        stop: host-side test ``stop(row, new_tokens) -> bool`` (e.g. a stop string), run every
            ``check_every`` steps and at the end; the row's tokens are kept as they are (the caller
            cuts at its stop string).
        check_every: steps between host syncs that test whether every row has finished.
        generator / seed: the random stream for sampling (a seed makes a fresh generator); the same
            seed, prompts and settings give the same tokens.
        on_step: ``on_step(step, tokens (B,), finished (B,))`` after every step, for streaming; rows
            whose ``finished`` is True had already stopped and their token is meaningless.
        context: cache capacity C (default ``model.config.max_length``).
        slide: when the cache is full, rebuild it from the last C // 2 tokens and go on.
        pad_id: the id written in pad columns (default ``model.config.pad_id``; never attended).
        compile: run each decoding step through ``torch.compile`` (one graph for the whole step,
            dynamic shapes, compiled once per model and process: seconds on the first call); the
            prompt's prefill stays eager. The tokens are those of the eager step up to summation
            order.

    Returns:
        A ``Generation`` (new tokens and finish reason per prompt).

    Raises:
        ValueError: bad arguments, token ids outside the vocabulary, an empty prompt, or (without
            ``slide``) a prompt plus ``max_new_tokens`` longer than the cache.
    """
    config = model.config
    _check_arguments(max_new_tokens, temperature, top_k, top_p, check_every)
    greedy = greedy or temperature == 0
    rows = _prompt_rows(prompt_ids, config.vocab_size)
    capacity = config.max_length if context is None else context
    if not isinstance(capacity, int) or not 1 < capacity <= config.max_length:
        raise ValueError(f"context must be in [2, {config.max_length}] (the model's max_length), "
                         f"got {capacity!r}")
    lengths = [len(row) for row in rows]
    batch, width = len(rows), max(lengths)
    total = width + max_new_tokens
    if width > capacity:
        raise ValueError(f"a prompt of {width} tokens does not fit the context of {capacity} "
                         f"tokens; truncate it (keep its last tokens)")
    if total > capacity and not slide:
        raise ValueError(f"generation past the cache capacity: a prompt of {width} tokens plus "
                         f"max_new_tokens={max_new_tokens} needs {total} positions but the cache "
                         f"holds {capacity} (lower max_new_tokens, shorten the prompt, or slide)")
    device = next(model.parameters()).device
    pad_id = config.pad_id if pad_id is None else pad_id
    if generator is None and seed is not None and not greedy:
        generator = torch.Generator(device=device).manual_seed(seed)

    # Buffers allocated once: every token (B, L + N), which columns are real, the next position.
    sequence = torch.full((batch, total), pad_id, dtype=torch.long, device=device)
    real = torch.zeros((batch, total), dtype=torch.bool, device=device)
    for index, row in enumerate(rows):
        sequence[index, width - len(row):width] = torch.tensor(row, dtype=torch.long)
        real[index, width - len(row):] = True  # generated columns are real for every row
    padded = min(lengths) != width
    stop_set = torch.tensor(sorted(set(stop_ids)), dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    stopped_by_id = torch.zeros(batch, dtype=torch.bool, device=device)
    host_stopped = [False] * batch
    can_stop = stop is not None or bool(stop_set.numel())

    decode_step = compiled_decode_step() if compile else _decode_step
    was_training = model.training
    model.eval()
    try:
        window = 0  # first column held by the cache
        cache = model.new_cache(batch, min(capacity, total))
        logits, next_position = _prefill(model, cache, sequence, real, window, width, padded)
        produced = 0
        for step in range(max_new_tokens):
            column = width + step
            if column - window == cache.max_length:  # full: keep the last C // 2 tokens (slide)
                window = column - capacity // 2
                cache = model.new_cache(batch, cache.max_length)
                logits, next_position = _prefill(model, cache, sequence, real, window, column,
                                                 padded)
            token = next_tokens(logits, greedy=greedy, temperature=temperature, top_k=top_k,
                                top_p=top_p, generator=generator)  # (B,)
            if can_stop:  # rows that stopped keep writing pad (no row stops otherwise)
                token = token.masked_fill(finished, pad_id)
            sequence[:, column] = token
            produced = step + 1
            if stop_set.numel():
                hit = torch.isin(token, stop_set) & ~finished
                stopped_by_id |= hit
                finished |= hit
            if on_step is not None:
                on_step(step, token, finished)
            last = step == max_new_tokens - 1
            if can_stop and (produced % check_every == 0 or on_step is not None or last):
                if stop is not None:
                    host_finished = finished.tolist()
                    new_rows = sequence[:, width:column + 1].tolist()
                    for index in range(batch):
                        if not host_finished[index] and not host_stopped[index] \
                                and stop(index, new_rows[index]):
                            host_stopped[index] = True
                    if any(host_stopped):
                        finished |= torch.tensor(host_stopped, device=device)
                if bool(finished.all()):
                    break
            if last:
                break
            mask = real[:, window:column + 1] if padded else None  # (B, keys so far)
            positions = next_position if padded else None
            logits = decode_step(model, sequence[:, column:column + 1], mask, positions,
                                 cache)  # (B, V)
            if padded:
                next_position += 1
    finally:
        model.train(was_training)

    new = sequence[:, width:width + produced].tolist()
    by_id = stopped_by_id.tolist()
    stop_id_set = set(stop_ids)
    tokens, reasons = [], []
    for index, row in enumerate(new):
        if by_id[index]:
            cut = next(i for i, t in enumerate(row) if t in stop_id_set)
            tokens.append(row[:cut])
            reasons.append("stop_id")
        else:
            tokens.append(row)
            reasons.append("stop" if host_stopped[index] else "length")
    return Generation(tokens=tokens, finish_reasons=reasons)


def _decode_step(model: nn.Module, ids: Tensor, padding_mask: Tensor | None,
                 positions: Tensor | None, cache) -> Tensor:
    """Logits (B, V) of the newest position after ``ids`` (B, 1) go through the cache."""
    return model(ids, padding_mask=padding_mask, positions=positions, cache=cache)[:, -1]


_compiled_step = None


def compiled_decode_step():
    """``_decode_step`` under ``torch.compile`` (made once per process; Dynamo keeps a graph per
    model). The step traces whole, without graph breaks: the CPU fast paths of
    ``aiayn.inference_linear`` that keep Python-side state step aside while compiling, and the
    one-row split reads the thread count from outside the graph."""
    global _compiled_step
    if _compiled_step is None:
        _compiled_step = torch.compile(_decode_step, dynamic=True)
    return _compiled_step


def _prefill(model: nn.Module, cache, sequence: Tensor, real: Tensor, start: int, end: int,
             padded: bool) -> tuple[Tensor, Tensor | None]:
    """Run columns start..end-1 into an empty cache; returns the last logits (B, V) and, for padded
    batches, the next position of each row (B, 1)."""
    ids = sequence[:, start:end]  # (B, T)
    if not padded:
        return _last_logits(model, ids, cache=cache), None
    mask = real[:, start:end]  # (B, T)
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T): 0.. over real tokens
    logits = _last_logits(model, ids, padding_mask=mask, positions=positions, cache=cache)
    return logits, positions[:, -1:] + 1  # (B, 1)


def _last_logits(model: nn.Module, ids: Tensor, **kwargs) -> Tensor:
    """Logits (B, V) of the last position only. A prefill needs no others, and projecting the whole
    prompt onto the vocabulary costs as much as T decoding steps' projections; a model without
    ``hidden_states`` / ``lm_head`` (any module generate accepts) runs whole."""
    if hasattr(model, "hidden_states") and hasattr(model, "lm_head"):
        return model.lm_head(model.hidden_states(ids, **kwargs)[:, -1])  # (B, D) -> (B, V)
    return model(ids, **kwargs)[:, -1]
