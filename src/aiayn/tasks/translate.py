"""Translating text with a trained encoder-decoder and scoring it with sacreBLEU and chrF.

Sentences are sorted by length and decoded in batches of about ``max_tokens`` source tokens, then
returned in input order; the decoders guarantee the output does not depend on the batching.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from aiayn.data.batching import collate, token_batches
from aiayn.data.tokenizer import SubwordTokenizer
from aiayn.decoding.beam import beam_search
from aiayn.decoding.greedy import greedy_search

if TYPE_CHECKING:
    from aiayn.fast import InferenceEngine


def language_options(tokenizer) -> dict[str, Any]:
    """The ``translate_ids`` options of a checkpoint's tokenizer set to a language pair
    (``Seq2SeqTokenizer.language_ids``): {} for any other tokenizer."""
    pair = getattr(tokenizer, "language_ids", None)
    if pair is None:
        return {}
    return {"forced": pair.forced, "start": pair.decoder_start,
            "source_suffix": pair.source_suffix}


def translate_ids(model: nn.Module, sources: Sequence[Sequence[int]], *, beam_size: int = 4,
                  alpha: float = 0.6, max_tokens: int = 4000, max_extra: int = 50,
                  engine: "InferenceEngine | None" = None, forced: Sequence[int] = (),
                  start: int | None = None, source_suffix: Sequence[int] = ()
                  ) -> list[list[int]]:
    """Output ids (no </s>) for source id sequences (no </s>), in input order; ``engine`` (an
    ``aiayn.fast.InferenceEngine`` prepared for ``model``) runs the searches, else the plain
    ``greedy_search`` / ``beam_search``. A language pair's codes (``language_options``):
    ``forced``, ids every output starts with (a target language code), left out of the outputs;
    ``start``, the decoder's start symbol in place of the model's (mBART's target code);
    ``source_suffix``, ids after each source's </s> (mBART's source code)."""
    if engine is None:
        greedy, beam = partial(greedy_search, model), partial(beam_search, model)
    elif engine.model is not model:
        raise ValueError("the engine was prepared for another model")
    else:
        greedy, beam = engine.greedy_search, engine.beam_search
    config = model.config
    device = next(model.parameters()).device
    outputs: list[list[int]] = [[] for _ in sources]
    # Longest source the position table allows (it also holds </s> and any source suffix); no
    # table (T5): any length.
    limit = config.position_limit
    longest = None if limit is None else limit - 2 - len(source_suffix)
    cut = 0 if longest is None else sum(len(ids) > longest for ids in sources)
    if cut:
        warnings.warn(f"{cut} source(s) longer than the model's position table allows were cut "
                      f"to their first {longest} subwords (max_length {config.max_length})",
                      RuntimeWarning, stacklevel=2)
    sources = [list(ids if longest is None else ids[:longest]) for ids in sources]
    lengths = [len(ids) + 1 + len(source_suffix) for ids in sources]
    # Beam search holds K rows per sentence: size batches by the beam.
    budget = max(max_tokens // max(beam_size, 1), 1)
    for indices in token_batches(lengths, lengths, max_tokens=budget, shuffle=False):
        batch = collate([sources[i] for i in indices], None, indices, pad_id=config.pad_id,
                        bos_id=config.bos_id, eos_id=config.eos_id, source_suffix=source_suffix)
        source = batch.source.to(device)
        mask = source != config.pad_id
        options = dict(max_extra=max_extra, forced=list(forced), start=start)
        if beam_size == 1:
            hypotheses = greedy(source, mask, **options)
        else:
            hypotheses = beam(source, mask, beam_size=beam_size, alpha=alpha, **options)
        for index, hypothesis in zip(indices, hypotheses):
            outputs[index] = hypothesis.tokens
    return outputs


def translate_texts(model: nn.Module, tokenizer: SubwordTokenizer, texts: Sequence[str], *,
                    beam_size: int = 4, alpha: float = 0.6, max_tokens: int = 4000,
                    engine: "InferenceEngine | None" = None) -> list[str]:
    """Detokenized translations of ``texts`` (empty text -> empty translation). A checkpoint's
    tokenizer set to a language pair (``Seq2SeqTokenizer.set_languages``) puts the codes where the
    checkpoint's format has them (``language_options``)."""
    outputs = [""] * len(texts)
    keep = [i for i, text in enumerate(texts) if text.strip()]
    if not keep:
        return outputs
    ids = tokenizer.encode([texts[i] for i in keep])
    model.eval()
    with torch.inference_mode():
        hypotheses = translate_ids(model, ids, beam_size=beam_size, alpha=alpha,
                                   max_tokens=max_tokens, engine=engine,
                                   **language_options(tokenizer))
    for i, text in zip(keep, tokenizer.decode(hypotheses)):
        outputs[i] = text
    return outputs


def score_translations(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, float]:
    """Corpus sacreBLEU (13a tokenization, as sacreBLEU's default) and chrF on detokenized text."""
    import sacrebleu

    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(references)} references")
    bleu = sacrebleu.corpus_bleu(list(hypotheses), [list(references)])
    chrf = sacrebleu.corpus_chrf(list(hypotheses), [list(references)])
    return {"bleu": round(bleu.score, 2), "chrf": round(chrf.score, 2)}
