"""Multilingual translation on the CPU: aiayn's ``translate_ids`` (what ``aiayn translate`` runs) vs
transformers' ``M2M100ForConditionalGeneration.generate`` on the same NLLB-shaped weights.

NLLB-200-distilled-600M's widths (D 1024, 16 heads, F 4096, ReLU, pre-norm, fairseq sinusoidal
positions, embeddings * sqrt(D), vocabulary 256,206 tied with the output), ``--layers`` encoder and
decoder layers (the checkpoint has 12 + 12), random weights (transformers' own initialisation,
seed 0; aiayn takes them through ``aiayn.interop.hf.from_transformers``). One batch of ``--batch``
right-padded sources, each ``[eng_Latn] ids </s>`` with 10..30 random ids, translated with the
target code (deu_Latn, NLLB's ids) forced first, greedy and beam 4, float32, 2 threads (as the
other benchmarks), inference mode.

Equal work: random weights rarely pick </s>, so both sides generate exactly ``--new`` tokens per
sentence (the forced code and </s> included) and every decoder call of one side has its twin on
the other:

- transformers: ``max_new_tokens = N``, ``min_new_tokens = N - 1`` (no </s> before the last),
  ``forced_eos_token_id`` = </s> (the last token is </s>), ``forced_bos_token_id`` = the target
  code, ``suppress_tokens=[pad]`` (aiayn never generates pad); beam: ``num_beams=4``,
  ``length_penalty=0.6``, ``early_stopping=True``. Otherwise its defaults: SDPA attention, the
  dynamic KV cache (``use_cache=True``), float32.
- aiayn: ``translate_ids(..., beam_size, alpha=0.6, max_tokens=4000, forced=[code],
  engine=prepare_for_inference(model, InferenceOptions(compile=False)))``: the searches and engine
  ``aiayn translate`` runs by default on a CPU (``commands/translate.py``, ``commands/engine.py``).
  Its length limit per sentence is min(source length + ``max_extra``, ``max_length``) tokens, </s>
  forced at the last: the model is loaded with ``max_length=N`` (a config override; NLLB's
  positions are a fixed table, so no weight changes) and ``max_extra=N``, so every sentence's
  limit is N. Sources are truncated to ``max_length - 2`` ids: ``--new`` must be >= 33.

transformers' first call computes the forced code's logits from the start symbol; aiayn feeds the
start symbol and the code together in its first call: both run the decoder and the output layer
on N positions per sentence (per beam). The greedy outputs must be identical token for token (the
run stops otherwise); for beam 4 every hypothesis must have N - 2 tokens on both sides (equal
work), and the share of identical hypotheses is reported (transformers scores the forced </s> 0,
aiayn by its log-probability, which can change which beam wins: tests/test_hf_beam.py).

Output tokens/s counts the N tokens of each returned translation (not the K beams); the ratio is
the median over rounds of transformers' seconds / aiayn's (alternating rounds, ours first then
theirs first, after a warm-up), > 1 when aiayn is faster.

    python3 benchmarks/multilingual_translation.py --rounds 6 \
        --out benchmarks/results/multilingual_translation.json

Legend: B sentences, S source length, N output tokens per sentence, K beams, V vocabulary.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from common import alternate, cpu_name, save_results, setup

PAD, EOS = 1, 2
ENG_LATN, DEU_LATN = 256047, 256042  # NLLB's tokenizer ids of the two codes
CODES = 206  # NLLB's language codes and <mask> follow its 256,000 ordinary tokens
NLLB = dict(d_model=1024, encoder_attention_heads=16, decoder_attention_heads=16,
            encoder_ffn_dim=4096, decoder_ffn_dim=4096, vocab_size=256206,
            max_position_embeddings=1024, scale_embedding=True, activation_function="relu",
            dropout=0.1, attention_dropout=0.1, encoder_layerdrop=0.0, decoder_layerdrop=0.0,
            pad_token_id=PAD, bos_token_id=0, eos_token_id=EOS, decoder_start_token_id=EOS,
            tie_word_embeddings=True)  # facebook/nllb-200-distilled-600M's config.json
SOURCE_IDS = (10, 30)  # random ids per source, language code and </s> aside
DECODINGS = {"greedy": dict(beam_size=1), "beam4": dict(beam_size=4)}
ALPHA = 0.6  # aiayn translate's default


def hf_nllb(layers: int, scale: float):
    """transformers' M2M100 at NLLB-600M's widths (``scale`` < 1 shrinks them, for the tests)."""
    import transformers

    fields = dict(NLLB, encoder_layers=layers, decoder_layers=layers)
    if scale < 1:
        fields.update(d_model=max(64, int(1024 * scale) // 64 * 64),
                      encoder_ffn_dim=max(64, int(4096 * scale)),
                      decoder_ffn_dim=max(64, int(4096 * scale)),
                      vocab_size=max(CODES + 64, int(NLLB["vocab_size"] * scale)),
                      encoder_attention_heads=4, decoder_attention_heads=4)
    config = transformers.M2M100Config(**fields)
    torch.manual_seed(0)
    return transformers.M2M100ForConditionalGeneration._from_config(
        config, attn_implementation="sdpa").eval()


def codes(vocab: int) -> tuple[int, int]:
    """The ids of eng_Latn and deu_Latn: NLLB's, at the same distance from the end of a shrunk
    vocabulary."""
    shift = vocab - NLLB["vocab_size"]
    return ENG_LATN + shift, DEU_LATN + shift


def sources(batch: int, vocab: int) -> list[list[int]]:
    """``batch`` sources ``[eng_Latn] ids`` (</s> is added by each side's batching), 10..30 ids
    drawn from the ordinary tokens (no specials, no language codes)."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(SOURCE_IDS[0], SOURCE_IDS[1] + 1, (batch,), generator=generator)
    lengths[0], lengths[-1] = SOURCE_IDS  # the extremes are always there
    source_code = codes(vocab)[0]
    return [[source_code] + torch.randint(4, vocab - CODES, (int(n),), generator=generator).tolist()
            for n in lengths]


def hf_batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The right-padded (B, S) ids ``[code] ids </s> pad...`` and their attention mask."""
    width = max(len(row) for row in rows) + 1
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    for index, row in enumerate(rows):
        ids[index, :len(row) + 1] = torch.tensor(row + [EOS])
    return ids, (ids != PAD).long()


def build_sides(hf, rows: list[list[int]], new: int, beam_size: int) -> dict:
    from transformers import GenerationConfig

    from aiayn.fast import InferenceOptions, prepare_for_inference
    from aiayn.interop.hf import from_transformers
    from aiayn.tasks.translate import translate_ids

    ours = from_transformers(hf, max_length=new)  # the length limit: N tokens per sentence
    engine = prepare_for_inference(ours, InferenceOptions(compile=False))  # `aiayn translate`'s
    ids, mask = hf_batch(rows)
    target = codes(hf.config.vocab_size)[1]
    beam = dict(num_beams=beam_size, length_penalty=ALPHA, early_stopping=True) \
        if beam_size > 1 else dict(num_beams=1)
    config = GenerationConfig(max_new_tokens=new, min_new_tokens=new - 1, do_sample=False,
                              decoder_start_token_id=EOS, eos_token_id=EOS, pad_token_id=PAD,
                              bos_token_id=0, forced_bos_token_id=target,
                              forced_eos_token_id=EOS, suppress_tokens=[PAD], use_cache=True,
                              **beam)

    def aiayn_side() -> list[list[int]]:
        with torch.inference_mode():
            return translate_ids(ours, rows, beam_size=beam_size, alpha=ALPHA, max_tokens=4000,
                                 max_extra=new, engine=engine, forced=[target])

    def hf_side() -> list[list[int]]:
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, generation_config=config)  # (B, 1 + N)
        assert bool((out[:, 1] == target).all()) and bool((out[:, -1] == EOS).all())
        return out[:, 2:-1].tolist()  # start symbol, code and </s> aside, as aiayn returns

    return {"aiayn": aiayn_side, "hf": hf_side}


def run(*, layers: int, new: int, batch: int, rounds: int, scale: float) -> list[dict]:
    setup()
    hf = hf_nllb(layers, scale)
    rows = sources(batch, hf.config.vocab_size)
    parameters = sum(p.numel() for p in hf.parameters())
    results = []
    for name, options in DECODINGS.items():
        sides = build_sides(hf, rows, new, options["beam_size"])
        ours, theirs = sides["aiayn"](), sides["hf"]()
        lengths = {len(tokens) for tokens in ours + theirs}
        assert lengths == {new - 2}, f"{name}: output lengths {lengths}, want {new - 2} each"
        same = sum(a == b for a, b in zip(ours, theirs))
        if name == "greedy":
            assert same == batch, f"greedy outputs differ: {same} of {batch} equal"
        timing = alternate(sides, rounds=rounds, warmup=1)
        ratios = [h / a for a, h in zip(timing.seconds["aiayn"], timing.seconds["hf"])]
        tokens = batch * new
        results.append(dict(
            decoding=name, beam_size=options["beam_size"],
            alpha=ALPHA if name != "greedy" else None,
            shape=f"d{hf.config.d_model} L{layers}+{layers} V{hf.config.vocab_size} B{batch} "
                  f"S{min(map(len, rows)) + 1}..{max(map(len, rows)) + 1} N{new}",
            parameters=parameters, sentences=batch, new_tokens_per_sentence=new,
            same_tokens=same == batch, identical_sentences=same,
            aiayn_seconds=timing.median("aiayn"), hf_seconds=timing.median("hf"),
            aiayn_tokens_per_s=tokens / timing.median("aiayn"),
            hf_tokens_per_s=tokens / timing.median("hf"),
            aiayn_sentences_per_s=batch / timing.median("aiayn"),
            hf_sentences_per_s=batch / timing.median("hf"),
            ratio=statistics.median(ratios), ratios=ratios, rounds=len(ratios)))
    return results


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2,
                        help="encoder and decoder layers each (NLLB-600M: 12)")
    parser.add_argument("--new", type=int, default=40,
                        help="output tokens per sentence, target code and </s> included (>= 33)")
    parser.add_argument("--batch", type=int, default=8, help="sentences in the batch")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="< 1 shrinks the widths and vocabulary (smoke tests only)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.new < SOURCE_IDS[1] + 3:
        parser.error(f"--new must be >= {SOURCE_IDS[1] + 3}: it is also aiayn's position limit, "
                     f"and the longest source takes {SOURCE_IDS[1] + 2} positions")
    if args.layers < 1 or args.batch < 2 or args.rounds < 1 or not 0 < args.scale <= 1:
        parser.error("--layers and --rounds must be >= 1, --batch >= 2, --scale in (0, 1]")
    began = time.perf_counter()
    rows = run(layers=args.layers, new=args.new, batch=args.batch, rounds=args.rounds,
               scale=args.scale)
    for row in rows:
        print(f"{row['decoding']:<7} {row['shape']}: aiayn {row['aiayn_tokens_per_s']:7.1f} vs "
              f"hf {row['hf_tokens_per_s']:7.1f} tokens/s ({row['aiayn_sentences_per_s']:.2f} vs "
              f"{row['hf_sentences_per_s']:.2f} sentences/s), hf/aiayn time {row['ratio']:.3f}, "
              f"identical {row['identical_sentences']}/{row['sentences']}")
    if args.out is not None:
        import transformers

        command = "python3 benchmarks/multilingual_translation.py " + " ".join(argv)
        save_results(args.out, dict(
            benchmark="multilingual translation: aiayn translate_ids vs HF M2M100 generate",
            command=command.strip(), cpu=cpu_name(), threads=torch.get_num_threads(),
            torch=torch.__version__, transformers=transformers.__version__,
            ratio="median over rounds of hf seconds / aiayn seconds (> 1: aiayn faster)",
            total_seconds=round(time.perf_counter() - began, 1), rows=rows))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
