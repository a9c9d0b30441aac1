"""Autoregressive generation from a decoder-only model on the static KV cache.

One prefill of the (left-padded) prompts, then one token per step (``aiayn.decoding.sampling`` picks
it): greedy, temperature, top-k, top-p and min-p sampling, a repetition penalty, stop token ids, a
host-side stop test (e.g. stop strings), a seeded generator, batched prompts of different lengths,
and a per-step streaming callback.
What to generate is a ``GenerationConfig``; how the model runs is a ``Steps`` object (plain calls of
``decode_step`` by default; ``aiayn.fast`` passes compiled steps or CUDA graphs). A ``PrefixCache``
(``aiayn.decoding.prefix_cache``) carries one call's cache into the next, which then prefills only
what its prompt does not share with the ids that cache holds (the turns of a chat).

Per step the loop runs the model on one new token per row and writes into buffers allocated once
(the token buffer, the key-padding mask, the positions); nothing is read back to the host except where
a stop condition needs it, every ``check_every`` steps (or every step when a callback streams tokens).

Left padding: row b's prompt of length L_b sits at the right end of the L columns, its pad columns are
False in the key-padding mask and its real tokens get positions 0..L_b-1 (explicit ``positions``), so
every row computes what it would compute alone.

The last new token is never fed back, so N new tokens after an L-token prompt need L + N - 1
positions. Past the context: with ``slide=True``, when the cache is full the token just picked is not
fed to it; the cache is rebuilt from the last ``context // 2`` tokens, that token included (one
prefill), and generation goes on, as nanoGPT's sampler crops its input to the block size. Prompts of
different lengths slide together, when the longest row fills the cache, so there a shorter row
conditions on fewer of its own tokens than it would alone. Without ``slide``, asking for more
positions than the cache holds is an error before anything runs.

LongRoPE (``rope_scaling`` "longrope", aiayn.nn.rotary) turns every position by other angles once
a sequence is longer than original_max_position_embeddings: when the batch first grows past it,
the cache is rebuilt by one prefill of the whole sequence, as transformers' Phi-3 ``generate``
does. The switch follows the batch's longest row, so there a shorter row is not computed as alone.

Legend: B batch (prompts), L padded prompt length, N new tokens, V vocabulary, C cache capacity.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from torch import Tensor, nn

from aiayn.config_checks import is_count, is_number
from aiayn.decoding.prompts import id_like, prompt_rows
from aiayn.decoding.sampling import next_tokens, penalise_repeats
from aiayn.models.modes import evaluating
from aiayn.nn.rotary import longrope_switch

if TYPE_CHECKING:
    from aiayn.decoding.prefix_cache import PrefixCache

StepCallback = Callable[[int, Tensor, Tensor], None]
StopTest = Callable[[int, list[int]], bool]
DecodeStep = Callable[[nn.Module, Tensor, "Tensor | None", "Tensor | None", object], Tensor]


@dataclass(frozen=True, kw_only=True)
class GenerationConfig:
    """What ``generate`` produces.

    Fields:
        max_new_tokens: tokens to add per prompt at most.
        greedy: take the most likely token (ignores temperature, top_k, top_p, min_p and the seed).
        temperature: divides the logits; 0 means greedy.
        top_k / top_p: sample only from the k most likely tokens / from the nucleus of mass p.
        min_p: sample only from tokens at least min_p times as likely as the likeliest.
        repetition_penalty: > 1 makes every token already in the row (prompt, its padding and what
            was generated) less likely, greedy or sampled, as ``transformers`` does; 1: off.
        seed: seeds a fresh random stream for sampling: the same seed, prompts and settings give
            the same tokens (None: torch's global stream, or the ``generator`` passed).
        stop_ids: token ids that end a row (e.g. eos); checked on the device.
        check_every: steps between the host reads that test whether every row has finished.
        context: cache capacity C (None: the model's ``max_length``).
        slide: when the cache is full, rebuild it from the last C // 2 tokens and go on.
        pad_id: the id written in pad columns (None: the model's ``pad_id``; never attended).
    """

    max_new_tokens: int = 100
    greedy: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()
    check_every: int = 8
    context: int | None = None
    slide: bool = False
    pad_id: int | None = None

    def __post_init__(self) -> None:
        if not is_count(self.max_new_tokens):
            raise ValueError(f"max_new_tokens must be a positive integer, got "
                             f"{self.max_new_tokens!r}")
        stop_ids = (self.stop_ids,) if id_like(self.stop_ids) else self.stop_ids  # one id
        try:
            stop_ids = tuple(stop_ids)
        except TypeError:
            stop_ids = (stop_ids,)  # not iterable: refused just below
        if not all(id_like(t) for t in stop_ids):
            raise ValueError(f"stop_ids must be integer token ids, got {self.stop_ids!r}")
        object.__setattr__(self, "stop_ids", stop_ids)
        if not is_number(self.temperature) or not self.temperature >= 0:  # NaN too
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if self.top_k is not None and not is_count(self.top_k):
            raise ValueError(f"top_k must be a positive integer or None, got {self.top_k!r}")
        if self.top_p is not None and not (is_number(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")
        if self.min_p is not None and not (is_number(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] or None, got {self.min_p!r}")
        if not (is_number(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got "
                             f"{self.repetition_penalty!r}")
        if not is_count(self.check_every):
            raise ValueError(f"check_every must be a positive integer, got {self.check_every!r}")
        if self.context is not None and not (is_count(self.context) and self.context > 1):
            raise ValueError(f"context must be an integer >= 2 or None, got {self.context!r}")

    @property
    def picks_greedily(self) -> bool:
        return self.greedy or self.temperature == 0

    def replace(self, **changes) -> "GenerationConfig":
        """A copy with some fields changed (unknown names are an error), validated again."""
        known = {field.name for field in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"unknown generation option(s): {', '.join(unknown)}; choose from "
                            f"{sorted(known)}")
        return dataclasses.replace(self, **changes)


@dataclass
class Generation:
    """What ``generate`` returns.

    Attributes:
        tokens: the new tokens of each prompt (stop token and everything after it left out).
        finish_reasons: per prompt, "stop_id" (a stop token), "stop" (the stop test) or "length".
    """

    tokens: list[list[int]]
    finish_reasons: list[str]


def decode_step(model: nn.Module, ids: Tensor, padding_mask: Tensor | None,
                positions: Tensor | None, cache) -> Tensor:
    """Logits (B, V) of the newest position after ``ids`` (B, 1) go through the cache."""
    return model(ids, padding_mask=padding_mask, positions=positions, cache=cache)[:, -1]


class Steps:
    """How ``generate`` runs the model: a cache, the prompt's prefill, then one call per token.

    This default calls ``step`` (``decode_step``, or a compiled version of it) on the growing cache;
    ``aiayn.fast`` subclasses it to replay fixed-shape steps from a CUDA graph.
    """

    owns_caches = False  # True: a cache goes back to the steps, which hand it to a later call

    def __init__(self, step: DecodeStep = decode_step):
        self.step = step

    def new_cache(self, model: nn.Module, batch: int, capacity: int):
        return model.new_cache(batch, capacity)

    def prefill(self, model: nn.Module, cache, sequence: Tensor, real: Tensor, start: int,
                end: int, padded: bool) -> tuple[Tensor, Tensor | None]:
        """Columns start..end-1 of ``sequence`` (B, L + N) into ``cache`` at its positions
        ``cache.length ..`` (empty: a prompt or a slid window; else a ``PrefixCache``'s kept
        prefix); the last logits (B, V) and, for left-padded batches, each row's next position
        (B, 1)."""
        return _prefill(model, cache, sequence, real, start, end, padded)

    def next(self, model: nn.Module, cache, sequence: Tensor, real: Tensor, window: int,
             column: int, positions: Tensor | None) -> Tensor:
        """Logits (B, V) after the token in ``column`` goes through the cache, which holds columns
        ``window ..``; ``real`` (B, L + N) marks the columns that are not padding, ``positions``
        (B, 1) the token's positions in a left-padded batch (else None)."""
        mask = real[:, window:column + 1] if positions is not None else None  # (B, keys so far)
        return self.step(model, sequence[:, column:column + 1], mask, positions, cache)


@torch.no_grad()
def generate(model: nn.Module, prompt_ids: Tensor | Sequence[Sequence[int]] | Sequence[int],
             config: GenerationConfig | None = None, *, generator: torch.Generator | None = None,
             stop: StopTest | None = None, on_step: StepCallback | None = None,
             steps: Steps | None = None, prefix_cache: PrefixCache | None = None,
             **options) -> Generation:
    """Continue each prompt with up to ``config.max_new_tokens`` tokens.

    Args:
        model: a ``CausalLM`` (any module with ``config``, ``new_cache`` and
            ``forward(ids, padding_mask=, positions=, cache=)``); put in eval mode for the call.
        prompt_ids: one prompt (list of ints or (T,) tensor) or several (list of lists of different
            lengths, or a (B, T) tensor); several prompts are left-padded into one batch.
        config: what to generate (default ``GenerationConfig()``); ``options`` override its fields,
            e.g. ``generate(model, prompt, max_new_tokens=50, greedy=True)``.
        generator: the random stream for sampling (when ``config.seed`` is None).
        stop: host-side test ``stop(row, new_tokens) -> bool`` (e.g. a stop string), run every
            ``check_every`` steps and at the end; the row's tokens are kept as they are (the caller
            cuts at its stop string).
        on_step: ``on_step(step, tokens (B,), finished (B,))`` after every step, for streaming; rows
            whose ``finished`` is True had already stopped and their token is meaningless.
        steps: runs the model (default ``Steps()``: plain calls); ``aiayn.fast`` passes compiled
            steps or CUDA graphs.
        prefix_cache: a ``PrefixCache`` holding an earlier call's cache: its positions that the
            prompt shares are kept, the rest prefilled, and it then holds this call's.

    Returns:
        A ``Generation`` (new tokens and finish reason per prompt).

    Raises:
        ValueError: bad options, token ids outside the vocabulary, an empty prompt, or (without
            ``slide``) a prompt plus ``max_new_tokens`` longer than the cache.
        TypeError: an option that is not a ``GenerationConfig`` field.
    """
    config = (config or GenerationConfig()).replace(**options) if options else \
        (config or GenerationConfig())
    steps = steps or Steps()
    model_config = model.config
    if getattr(model, "encoder", None) is not None:
        raise TypeError("generate continues prompts with a decoder-only model (CausalLM); decode "
                        "an encoder-decoder with aiayn.decoding.greedy.greedy_search or "
                        "aiayn.decoding.beam.beam_search")
    rows = prompt_rows(prompt_ids, model_config.vocab_size)
    capacity = model_config.max_length if config.context is None else config.context
    limit = model_config.position_limit
    if limit is not None and capacity > limit:
        raise ValueError(f"context must be in [2, {limit}] (the model's max_length), got "
                         f"{capacity!r}")
    lengths = [len(row) for row in rows]
    batch, width = len(rows), max(lengths)
    new = config.max_new_tokens
    total = width + new
    fed = total - 1  # positions the model sees: the last new token is never fed back
    if width > capacity:
        raise ValueError(f"a prompt of {width} tokens does not fit the context of {capacity} "
                         f"tokens; truncate it (keep its last tokens)")
    if fed > capacity and not config.slide:
        raise ValueError(f"generation past the cache capacity: a prompt of {width} tokens plus "
                         f"max_new_tokens={new} needs {fed} positions but the cache holds "
                         f"{capacity} (lower max_new_tokens, shorten the prompt, or slide)")
    device = next(model.parameters()).device
    pad_id = model_config.pad_id if config.pad_id is None else config.pad_id
    for name, ids in (("pad_id", [pad_id]), ("stop_ids", config.stop_ids)):
        outside = [int(t) for t in ids if not 0 <= int(t) < model_config.vocab_size]
        if outside:
            raise ValueError(f"{name} {outside[0]} is outside the vocabulary "
                             f"[0, {model_config.vocab_size})")
    greedy = config.picks_greedily
    if config.seed is not None and not greedy:
        generator = torch.Generator(device=device).manual_seed(config.seed)

    # Buffers allocated once: every token (B, L + N), which columns are real, the next position.
    sequence = torch.full((batch, total), pad_id, dtype=torch.long, device=device)
    real = torch.zeros((batch, total), dtype=torch.bool, device=device)
    for index, row in enumerate(rows):
        sequence[index, width - len(row):width] = torch.tensor(row, dtype=torch.long)
        real[index, width - len(row):] = True  # generated columns are real for every row
    padded = min(lengths) != width
    stop_ids = {int(t) for t in config.stop_ids}
    stop_set = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    stopped_by_id = torch.zeros(batch, dtype=torch.bool, device=device)
    host_stopped = [0] * batch  # per row: how many new tokens it had when the stop test passed
    can_stop = stop is not None or bool(stop_set.numel())

    switch = longrope_switch(getattr(model_config, "rope_scaling", None))  # None: never
    with evaluating(model):
        window = 0  # first column held by the cache
        if prefix_cache is None:
            cache = steps.new_cache(model, batch, min(capacity, fed))
            logits, next_position = steps.prefill(model, cache, sequence, real, 0, width, padded)
        else:  # a cache of at least min(capacity, fed) that holds the shared prefix, then the rest
            cache, logits, next_position = prefix_cache.prefill(model, steps, sequence, real,
                                                                width, padded, capacity, fed)
        produced = 0
        for index in range(new):
            column = width + index
            if config.repetition_penalty != 1.0:
                logits = penalise_repeats(logits, sequence[:, :column], config.repetition_penalty)
            token = next_tokens(logits, greedy=greedy, temperature=config.temperature,
                                top_k=config.top_k, top_p=config.top_p, min_p=config.min_p,
                                generator=generator)  # (B,)
            if can_stop:  # rows that stopped keep writing pad (no row stops otherwise)
                token = token.masked_fill(finished, pad_id)
            sequence[:, column] = token
            produced = index + 1
            if stop_set.numel():
                hit = torch.isin(token, stop_set) & ~finished
                stopped_by_id |= hit
                finished |= hit
            if on_step is not None:
                on_step(index, token, finished)
            last = index == new - 1
            if can_stop and (produced % config.check_every == 0 or on_step is not None or last):
                if stop is not None:
                    _run_stop_test(stop, sequence[:, width:column + 1], finished, host_stopped)
                    if any(host_stopped):
                        finished |= torch.tensor([bool(n) for n in host_stopped], device=device)
                if bool(finished.all()):
                    break
            if last:
                break
            full = column - window == cache.max_length
            if full:  # keep the last C // 2 tokens (slide)
                window = column + 1 - capacity // 2
            if full or column - window == switch:
                # LongRoPE turns every position by its long factors from this token on, and the
                # cache holds keys turned by the short ones: run the whole sequence again, as
                # transformers' Phi-3 generate does (aiayn.nn.rotary)
                cache = steps.new_cache(model, batch, cache.max_length)
                logits, next_position = steps.prefill(model, cache, sequence, real, window,
                                                      column + 1, padded)
                continue
            logits = steps.next(model, cache, sequence, real, window, column,
                                next_position if padded else None)  # (B, V)
            if padded:
                next_position += 1
    if prefix_cache is not None:
        prefix_cache.keep(cache, sequence, window)
    return _result(sequence[:, width:width + produced].tolist(), stopped_by_id.tolist(),
                   host_stopped, stop_ids)


def _run_stop_test(stop: StopTest, new_tokens: Tensor, finished: Tensor,
                   host_stopped: list[int]) -> None:
    """Record in ``host_stopped`` the length of each row still running whose new tokens (B, N)
    pass ``stop``."""
    host_finished = finished.tolist()
    for index, row in enumerate(new_tokens.tolist()):
        if not host_finished[index] and not host_stopped[index] and stop(index, row):
            host_stopped[index] = len(row)


def _result(new: list[list[int]], by_id: list[bool], host_stopped: list[int],
            stop_ids: set[int]) -> Generation:
    tokens, reasons = [], []
    for index, row in enumerate(new):
        if by_id[index]:
            cut = next(i for i, t in enumerate(row) if t in stop_ids)
            tokens.append(row[:cut])
            reasons.append("stop_id")
        elif host_stopped[index]:  # the tokens up to the test that stopped it, no filler after
            tokens.append(row[:host_stopped[index]])
            reasons.append("stop")
        else:
            tokens.append(row)
            reasons.append("length")
    return Generation(tokens=tokens, finish_reasons=reasons)


def _prefill(model: nn.Module, cache, sequence: Tensor, real: Tensor, start: int, end: int,
             padded: bool) -> tuple[Tensor, Tensor | None]:
    """Run columns start..end-1 into the cache, after the positions it holds; returns the last
    logits (B, V) and, for padded batches, the next position of each row (B, 1)."""
    ids = sequence[:, start:end]  # (B, T)
    if not padded:
        return _last_logits(model, ids, cache=cache), None
    mask = real[:, start:end]  # (B, T)
    positions = (mask.long().cumsum(dim=1) - 1).clamp(min=0)  # (B, T): 0.. over real tokens
    logits = _last_logits(model, ids, padding_mask=mask, positions=positions, cache=cache)
    return logits, positions[:, -1:] + 1  # (B, 1)


def _last_logits(model: nn.Module, ids: Tensor, **kwargs) -> Tensor:
    """Logits (B, V) of the last position only: a prefill needs no others, and projecting the whole
    prompt onto the vocabulary costs as much as T decoding steps' projections. A model without
    ``hidden_states`` / ``lm_head`` (any module generate accepts) runs whole."""
    if hasattr(model, "hidden_states") and hasattr(model, "lm_head"):
        return model.lm_head(model.hidden_states(ids, **kwargs)[:, -1])  # (B, D) -> (B, V)
    return model(ids, **kwargs)[:, -1]
