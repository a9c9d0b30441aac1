"""Translation end to end, side by side: aiayn ``Transformer`` vs Hugging Face ``MarianMTModel``.

Both models are the default of ``aiayn train translation`` (preset ``mt-cpu``) on the bundled corpus,
trained for the same wall-clock budget each and scored on the same test sentences:

- same data: ``TranslationTask`` built from the ``aiayn train translation`` defaults (split, length
  filters, one joint BPE tokenizer trained once), and the same token-count batches in the same order;
- same architecture and initial weights: the MarianConfig is the interop's export of the aiayn config
  (``aiayn.save_pretrained`` -> ``MarianMTModel.from_pretrained``), the other side is a weight copy,
  and the initial logits of both are compared before training;
- the same training hyper-parameters (Adam 0.9/0.98/1e-9, the noam schedule, label smoothing 0.1,
  dropout, clipping, seed of ``aiayn train translation``), each library computing them its own way:
  aiayn ``TranslationTask.loss`` and the aiayn trainer's optimizer (torch's fused Adam), Marian the
  Hugging Face ``Trainer``'s ``LabelSmoother`` and its default optimizer ``adamw_torch_fused``
  (weight decay 0: the same update as Adam);
- same clock: blocks of ``--block-steps`` steps alternate between the sides (ours, peer, peer, ours,
  ...) so machine noise hits both; each side's clock counts only its own steps (batches are built
  once, outside both clocks) and stops at ``--budget-seconds``;
- decoding: each library's own (``aiayn.decoding`` vs ``generate``), greedy and beam 4 with alpha
  0.6, plus the cross check (each decoder on both trained models), sacreBLEU/chrF on detokenized text.

    PYTHONPATH=src python3 benchmarks/translation_vs_marian.py --budget-seconds 1200  # docs' table
    PYTHONPATH=src python3 benchmarks/translation_vs_marian.py --out /tmp/tvm.json    # 240 s a side
    PYTHONPATH=src python3 benchmarks/translation_vs_marian.py --quick   # smoke run, about 2 min

Writes a table to stdout and ``benchmarks/results/translation_vs_marian.json`` (``--out``); a
``--quick`` run writes JSON only where ``--out`` says (it never replaces the recorded result).

Legend: B sentences, S source length, T target length, V vocabulary.
"""

from __future__ import annotations

import argparse
import gc
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from common import BENCH_DIR, cpu_name, save_results

import aiayn
from aiayn.config import TransformerConfig
from aiayn.data.batching import TranslationBatch, collate, token_batches
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from aiayn.interop.hf import from_transformers
from aiayn.models import Transformer
from aiayn.tasks.translate import score_translations, translate_ids
from aiayn.training import make_optimizer
from aiayn.training.loss import label_smoothed_cross_entropy

REPO = BENCH_DIR.parent
DEFAULT_DATA = REPO / "data" / "ddtp_en_de.tsv.gz"
MAX_EXTRA = 50  # paper 6.1: output up to input length + 50
DECODINGS = {"greedy": dict(beam_size=1, alpha=0.0), "beam4": dict(beam_size=4, alpha=0.6)}


# --- the shared setup: task, training config and the two twins --------------------------------------
def translation_setup(data: Path, seed: int):
    """``aiayn train translation``'s own defaults: its task (data, split, filters, tokenizer), preset
    and training config, parsed by the real CLI parser so the benchmark cannot drift from them."""
    from aiayn.cli import build_parser
    from aiayn.commands.train import training_config_from_args
    from aiayn.commands.train_translation import make_task

    args = build_parser().parse_args(["train", "translation", "--data", str(data), "--out",
                                      "unused", "--seed", str(seed), "--device", "cpu",
                                      "--valid-bleu-sentences", "0"])
    task = make_task(args)
    # Marian's positions are the sin | cos "split" layout; aiayn takes the same (a fixed permutation
    # of the paper's interleaved table, so nothing is learnt differently).
    config = task.model_config(TransformerConfig.preset(args.preset, sinusoid_layout="split"))
    return args, task, config, training_config_from_args(args, config.d_model)


def marian_from_aiayn(model: Transformer, directory: Path):
    """The MarianMTModel of an aiayn model: interop export, then Hugging Face's own loader."""
    from transformers import MarianMTModel

    aiayn.save_pretrained(model, directory)
    marian = MarianMTModel.from_pretrained(directory, attn_implementation="sdpa")
    # transformers 5.23's from_pretrained makes the fixed sinusoid tables trainable (requires_grad
    # True; the constructor sets False): Adam would then train Marian's positions.
    for stack in (marian.model.encoder, marian.model.decoder):
        stack.embed_positions.weight.requires_grad_(False)
    return marian


def load_marian_into(model: Transformer, marian) -> None:
    """Copy Marian's weights into ``model`` through the interop name map (strict on names/shapes).

    Marian's ``final_logits_bias`` is a zero buffer that is never trained; the aiayn model has no
    output bias (``mt-cpu``), which is the same function.
    """
    twin = from_transformers(marian)
    if twin.generator.bias.any():
        raise ValueError("Marian's final_logits_bias is not zero; the aiayn model has no output bias")
    state = twin.state_dict()
    del state["generator.bias"]
    model.load_state_dict(state)


def twins(config: TransformerConfig, *, init: str, seed: int, directory: Path):
    """(aiayn model, MarianMTModel) with one architecture and equal initial weights.

    ``init="marian"``: Hugging Face initialises (N(0, init_std) everywhere) and aiayn copies it;
    ``init="aiayn"``: aiayn initialises (Xavier matrices) and Marian copies it.
    """
    from transformers import MarianConfig, MarianMTModel

    torch.manual_seed(seed)
    ours = Transformer(config)
    marian = marian_from_aiayn(ours, directory)
    if init == "marian":
        torch.manual_seed(seed)
        marian = MarianMTModel._from_config(MarianConfig.from_pretrained(directory),
                                            attn_implementation="sdpa")
        load_marian_into(ours, marian)
    if parameter_count(ours) != parameter_count(marian):
        raise ValueError(f"trainable parameters differ: aiayn {parameter_count(ours)}, Marian "
                         f"{parameter_count(marian)}")
    # the architecture only: Marian's bias and pad row train differently (fixed / no lookups)
    check = from_transformers(marian).config.replace(
        output_bias=False, output_bias_buffer=False, init_std=config.init_std,
        embedding_padding_idx=config.embedding_padding_idx)
    differing = {k for k, v in check.to_dict().items() if config.to_dict()[k] != v}
    if differing:
        raise ValueError(f"Marian's config does not round-trip to the aiayn config: {differing}")
    return ours.train(), marian.train()


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)  # tied counted once


def max_logit_difference(ours: Transformer, marian, batch: TranslationBatch) -> float:
    ours.eval(), marian.eval()
    with torch.no_grad():
        difference = (ours_logits(ours, batch) - marian_logits(marian, batch)).abs().max()
    ours.train(), marian.train()
    return float(difference)


def ours_logits(model: Transformer, batch: TranslationBatch) -> Tensor:
    return model(batch.source, batch.decoder_input, src_padding_mask=batch.source != PAD_ID)


def marian_logits(model, batch: TranslationBatch) -> Tensor:
    # No decoder mask: causal only, as ours (right padding is never seen by real queries).
    # use_cache=False: by default Marian also fills a KV cache in a training forward.
    return model(input_ids=batch.source, attention_mask=(batch.source != PAD_ID).long(),
                 decoder_input_ids=batch.decoder_input, use_cache=False).logits  # (B, T, V)


# --- training: one step function for both, alternating blocks --------------------------------------
@dataclass
class Side:
    name: str
    model: nn.Module
    logits: Callable[[nn.Module, TranslationBatch], Tensor]
    optimizer: torch.optim.Optimizer
    rng: Tensor  # this side's dropout RNG state, so the two sides do not share one stream
    training_loss: Callable[..., Tensor]  # (model, batch, smoothing, task) -> mean loss a token
    seconds: float = 0.0
    steps: int = 0
    skipped: int = 0
    source_tokens: int = 0
    target_tokens: int = 0
    losses: list[float] = field(default_factory=list)  # per-step mean training loss

    def loss(self, batch: TranslationBatch, smoothing: float) -> Tensor:
        """Summed label-smoothed loss (paper 5.4) with aiayn's loss function: the one measure
        of both models for validation."""
        logits = self.logits(self.model, batch)  # (B, T, V)
        return label_smoothed_cross_entropy(logits.flatten(0, 1), batch.targets.flatten(),
                                            smoothing=smoothing, ignore_index=PAD_ID)


def ours_training_loss(model: Transformer, batch: TranslationBatch, smoothing: float,
                       task) -> Tensor:
    """What ``aiayn train translation`` computes: ``TranslationTask.loss`` / target tokens."""
    return task.loss(model, batch, smoothing=smoothing) / batch.target_tokens


def marian_training_loss(model, batch: TranslationBatch, smoothing: float, task) -> Tensor:
    """What the Hugging Face ``Trainer`` computes with ``label_smoothing_factor``: its
    ``LabelSmoother`` on the logits, averaged over the target tokens (the same value)."""
    from transformers.trainer_pt_utils import LabelSmoother

    labels = batch.targets.masked_fill(batch.targets == PAD_ID, -100)  # (B, T)
    # Without num_items_in_batch (which transformers 4 lacks) it divides by the labels that are
    # not -100: the target tokens.
    return LabelSmoother(epsilon=smoothing)({"logits": marian_logits(model, batch)}, labels)


def initial_training_losses(ours, marian, batch: TranslationBatch, smoothing: float, task
                            ) -> dict[str, float]:
    """Each side's training loss on the first batch before training, without dropout: the two
    libraries' loss functions give the same value on the same logits."""
    losses = {}
    for name, model, loss in (("aiayn", ours, ours_training_loss),
                              ("marian", marian, marian_training_loss)):
        model.eval()
        with torch.no_grad():
            losses[name] = float(loss(model, batch, smoothing, task))
        model.train()
    return losses


def make_side(name, model, logits, training, seed) -> Side:
    parameters = [p for p in model.parameters() if p.requires_grad]
    if name == "aiayn":  # the aiayn trainer's optimizer (torch's fused Adam where it applies)
        optimizer = make_optimizer(model, training)
        training_loss = ours_training_loss
    else:  # TrainingArguments' default optim "adamw_torch_fused"; weight decay 0 is Adam
        optimizer = torch.optim.AdamW(parameters, lr=training.schedule(1), betas=training.betas,
                                      eps=training.eps, weight_decay=training.weight_decay,
                                      fused=True)
        training_loss = marian_training_loss
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    rng = torch.random.get_rng_state()
    torch.random.set_rng_state(generator_state)
    return Side(name, model, logits, optimizer, rng, training_loss)


def train_step(side: Side, batch: TranslationBatch, training, smoothing: float, task) -> None:
    """One update with each library's own loss and optimizer; the rest as the aiayn trainer does
    it (schedule, clipping, a non-finite update skipped)."""
    loss = side.training_loss(side.model, batch, smoothing, task)  # mean over target tokens
    loss.backward()
    lr = training.schedule(side.steps + 1)
    for group in side.optimizer.param_groups:
        group["lr"] = lr
    norm = torch.nn.utils.clip_grad_norm_(side.model.parameters(),
                                          training.clip_norm or float("inf"))
    if torch.isfinite(norm):
        side.optimizer.step()
    else:
        side.skipped += 1
    side.optimizer.zero_grad(set_to_none=True)
    side.steps += 1
    side.source_tokens += batch.source_tokens
    side.target_tokens += batch.target_tokens
    side.losses.append(float(loss.detach()))


class SharedBatches:
    """The task's training batches, built once (outside both clocks) and read by each side in order."""

    def __init__(self, task):
        self.task, self.batches, self.epoch = task, [], 0

    def __getitem__(self, index: int) -> TranslationBatch:
        while index >= len(self.batches):
            self.batches.extend(self.task.train_batches(self.epoch))
            self.epoch += 1
        return self.batches[index]


def train_alternating(sides: list[Side], batches: SharedBatches, training, *, smoothing: float,
                      budget: float, block_steps: int) -> None:
    """Blocks of ``block_steps`` steps per side, order reversed every round, until every side's own
    clock reaches ``budget`` seconds."""
    round_index = 0
    while any(side.seconds < budget for side in sides):
        for side in sides if round_index % 2 == 0 else sides[::-1]:
            if side.seconds >= budget:
                continue
            for _ in range(block_steps):  # warm batches first: a side never waits for the other
                batches[side.steps + block_steps]
            gc.collect()
            torch.random.set_rng_state(side.rng)
            for _ in range(block_steps):
                batch = batches[side.steps]
                start = time.perf_counter()
                train_step(side, batch, training, smoothing, batches.task)
                side.seconds += time.perf_counter() - start
                if side.seconds >= budget:
                    break
            side.rng = torch.random.get_rng_state()
        round_index += 1
        progress("  " + ", ".join(f"{side.name}: {side.steps} steps in {side.seconds:.0f} s, "
                                  f"loss {side.losses[-1]:.2f}" for side in sides))


def valid_loss(side: Side, task) -> float:
    """Per-token cross-entropy (no smoothing) on the validation split."""
    side.model.eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in task.valid_batches():
            total += float(side.loss(batch, 0.0))
            tokens += batch.target_tokens
    side.model.train()
    return total / tokens


# --- decoding: aiayn.decoding and Hugging Face generate ---------------------------------------------
def generate_ids(marian, sources: list[list[int]], *, beam_size: int, alpha: float,
                 max_length: int, max_tokens: int = 4000) -> list[list[int]]:
    """Output ids (no </s>) of ``MarianMTModel.generate`` under aiayn's decoding conventions.

    The batches are ``translate_ids``'s (sorted by length, ``max_tokens`` / beam source tokens).
    Output limit: aiayn allows source length + 50 positions per sentence with </s> forced at the
    last one; ``generate`` takes one limit per batch, so it gets the batch's largest with </s> forced
    there (``forced_eos_token_id``) and each output is cut to its own sentence's limit (for greedy
    search exactly aiayn's rule). Pad and the start symbol are never generated (aiayn's
    ``blocked_tokens``); a beam search is done when it has K finished hypotheses
    (``early_stopping=True``), and scores them with HF's length penalty.
    """
    from transformers import GenerationConfig

    limit = max_length - 1
    sources = [list(ids[:limit - 1]) for ids in sources]
    lengths = [len(ids) + 1 for ids in sources]  # with </s>
    outputs: list[list[int]] = [[] for _ in sources]
    blocked = [[token] for token in sorted({PAD_ID, marian.config.decoder_start_token_id})]
    beam = dict(num_beams=beam_size, length_penalty=alpha, early_stopping=True) \
        if beam_size > 1 else dict(num_beams=1)
    for indices in token_batches(lengths, lengths, max_tokens=max(max_tokens // beam_size, 1),
                                 shuffle=False):
        source = collate([sources[i] for i in indices], None, indices, pad_id=PAD_ID,
                         bos_id=BOS_ID, eos_id=EOS_ID).source  # (B, S)
        positions = [min(lengths[i] + MAX_EXTRA, max_length) for i in indices]  # output_limits
        config = GenerationConfig(
            max_new_tokens=max(positions), min_new_tokens=0, do_sample=False,
            decoder_start_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
            forced_eos_token_id=EOS_ID, bad_words_ids=blocked, **beam)
        with torch.inference_mode():
            out = marian.generate(source, attention_mask=(source != PAD_ID).long(),
                                  generation_config=config)  # (B, 1 + new)
        for index, allowed, row in zip(indices, positions, out[:, 1:].tolist()):
            row = row[:row.index(EOS_ID)] if EOS_ID in row else row
            outputs[index] = row[:allowed - 1]  # the last allowed position holds </s>
    return outputs


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def score(decode: Callable[..., list[list[int]]], tokenizer, pairs, *, beam_size: int,
          alpha: float, label: str) -> dict[str, float]:
    start = time.perf_counter()
    with torch.inference_mode():
        ids = decode(tokenizer.encode([p.source for p in pairs]), beam_size=beam_size, alpha=alpha)
    seconds = time.perf_counter() - start
    result = {**score_translations(tokenizer.decode(ids), [p.target for p in pairs]),
              "seconds": round(seconds, 2)}
    progress(f"  {label}: {result}")
    return result


def evaluate_decoders(ours: Transformer, marian, tokenizer, pairs, directory: Path, *,
                      cross_check: bool) -> dict:
    """{model: {decoder: {decoding: scores}}}: each library's decoder on its own model and, with
    ``cross_check``, on the other's (a weight copy through the interop)."""
    ours.eval(), marian.eval()
    ours_twin = marian_from_aiayn(ours, directory / "ours-as-marian").eval()
    marian_twin = Transformer(ours.config)
    load_marian_into(marian_twin, marian)
    marian_twin.eval()
    models = {"aiayn": (ours, ours_twin), "marian": (marian_twin, marian)}
    results: dict[str, dict] = {}
    for name, (as_aiayn, as_marian) in models.items():
        decoders = {
            "aiayn.decoding": lambda s, **kw: translate_ids(as_aiayn, s, max_extra=MAX_EXTRA, **kw),
            "hf.generate": lambda s, **kw: generate_ids(as_marian, s, max_length=ours.config.max_length,
                                                        **kw)}
        if not cross_check:
            del decoders["hf.generate" if name == "aiayn" else "aiayn.decoding"]
        results[name] = {decoder: {mode: score(fn, tokenizer, pairs, **options,
                                               label=f"{name} model, {decoder} {mode}")
                                   for mode, options in DECODINGS.items()}
                         for decoder, fn in decoders.items()}
    return results


# --- report -----------------------------------------------------------------------------------------
def side_report(side: Side, valid: float, scores: dict, own_decoder: str) -> dict[str, Any]:
    own = scores[own_decoder]
    return {
        "steps": side.steps, "skipped_updates": side.skipped,
        "train_seconds": round(side.seconds, 2), "source_tokens": side.source_tokens,
        "target_tokens": side.target_tokens,
        "tokens_per_s": round((side.source_tokens + side.target_tokens) / side.seconds, 1),
        "target_tokens_per_s": round(side.target_tokens / side.seconds, 1),
        "train_loss_last": round(sum(side.losses[-20:]) / len(side.losses[-20:]), 4),
        "valid_loss": round(valid, 4), "own_decoder": own_decoder,
        "bleu_greedy": own["greedy"]["bleu"], "bleu_beam4": own["beam4"]["bleu"],
        "chrf_greedy": own["greedy"]["chrf"], "chrf_beam4": own["beam4"]["chrf"],
        "decoding": scores}


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def print_table(results: dict) -> None:
    ours, peer = results["aiayn"], results["marian"]
    rows = [("steps in the budget", "steps"), ("tokens/s (source+target)", "tokens_per_s"),
            ("target tokens/s", "target_tokens_per_s"), ("valid loss (no smoothing)", "valid_loss"),
            ("test BLEU greedy (own decoder)", "bleu_greedy"),
            ("test BLEU beam 4 (own decoder)", "bleu_beam4"),
            ("test chrF greedy (own decoder)", "chrf_greedy"),
            ("test chrF beam 4 (own decoder)", "chrf_beam4")]
    print(f"{'':34} {'aiayn':>10} {'marian':>10} {'ours/peer':>10}")
    for label, key in rows:
        print(f"{label:34} {ours[key]:>10} {peer[key]:>10} {ratio(ours[key], peer[key])!s:>10}")
    if len(ours["decoding"]) < 2:
        return
    print("cross check, BLEU (chrF) with one decoder for both trained models:")
    for decoder in ("aiayn.decoding", "hf.generate"):
        for mode in DECODINGS:
            cells = [f"{r['decoding'][decoder][mode]['bleu']:6.2f} "
                     f"({r['decoding'][decoder][mode]['chrf']:5.2f})" for r in (ours, peer)]
            print(f"  {decoder + ' ' + mode:32} {cells[0]:>16} {cells[1]:>16}")


def run(args: argparse.Namespace) -> dict:
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars of from_pretrained
    torch.set_num_threads(args.threads)
    began = time.perf_counter()
    cli, task, config, training = translation_setup(args.data, args.seed)
    setup_seconds = time.perf_counter() - began
    progress(f"data and tokenizer: {setup_seconds:.0f} s, {len(task.train_source)} training pairs")
    with tempfile.TemporaryDirectory() as scratch:
        ours, marian = twins(config, init=args.init, seed=args.seed,
                             directory=Path(scratch) / "init")
        batches = SharedBatches(task)
        difference = max_logit_difference(ours, marian, batches[0])
        initial_losses = initial_training_losses(ours, marian, batches[0], cli.label_smoothing,
                                                 task)
        sides = [make_side("aiayn", ours, ours_logits, training, args.seed),
                 make_side("marian", marian, marian_logits, training, args.seed)]
        train_alternating(sides, batches, training, smoothing=cli.label_smoothing,
                          budget=args.budget_seconds, block_steps=args.block_steps)
        valid = [valid_loss(side, task) for side in sides]
        progress(f"valid loss: aiayn {valid[0]:.3f}, marian {valid[1]:.3f}; decoding")
        pairs = task.test_pairs[:args.test_limit] if args.test_limit else task.test_pairs
        scores = evaluate_decoders(ours, marian, task.tokenizer, pairs, Path(scratch),
                                   cross_check=args.cross_check)
    results = {
        "benchmark": "translation end to end: aiayn Transformer vs HF MarianMTModel",
        "command": "python3 benchmarks/translation_vs_marian.py " + " ".join(args.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"threads": args.threads, "processor": platform.processor() or platform.machine(),
                    "cpu": cpu_name(),
                    "torch": torch.__version__, "transformers": transformers.__version__},
        "setup": {
            "data": str(args.data), "train_pairs": len(task.train_source),
            "filtered_pairs": task.filtered, "valid_pairs": len(task.valid_pairs),
            "test_sentences": len(pairs), "vocab_size": task.tokenizer.vocab_size,
            "preset": cli.preset, "model_config": config.to_dict(),
            "marian_config": {k: v for k, v in marian.config.to_dict().items()
                              if k in ("d_model", "encoder_layers", "decoder_layers",
                                       "encoder_attention_heads", "encoder_ffn_dim",
                                       "activation_function", "scale_embedding", "dropout",
                                       "max_position_embeddings", "vocab_size")},
            "parameters": {"aiayn": parameter_count(ours), "marian": parameter_count(marian)},
            "init": args.init, "initial_logits_max_abs_diff": difference,
            "initial_training_loss": initial_losses,
            "training": {**training.to_dict(), "label_smoothing": cli.label_smoothing,
                         "max_tokens": cli.max_tokens},
            "budget_seconds": args.budget_seconds, "block_steps": args.block_steps,
            "tokens_per_s": "real (non-pad) source + target tokens, </s> included, per second "
                            "of this side's training steps",
            "setup_seconds": round(setup_seconds, 1)},
        "aiayn": side_report(sides[0], valid[0], scores["aiayn"], "aiayn.decoding"),
        "marian": side_report(sides[1], valid[1], scores["marian"], "hf.generate"),
        "total_seconds": round(time.perf_counter() - began, 1)}
    ours_r, peer_r = results["aiayn"], results["marian"]
    results["ratios_ours_over_peer"] = {key: ratio(ours_r[key], peer_r[key]) for key in (
        "steps", "tokens_per_s", "target_tokens_per_s", "valid_loss", "bleu_greedy", "bleu_beam4",
        "chrf_greedy", "chrf_beam4")}
    return results


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-seconds", type=float, default=240.0,
                        help="training seconds per side (each side's own clock)")
    parser.add_argument("--block-steps", type=int, default=10,
                        help="steps a side runs before the other side's turn")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--test-limit", type=int, default=0,
                        help="decode only the first N test sentences (0: the whole test split)")
    parser.add_argument("--cross-check", action=argparse.BooleanOptionalAction, default=True,
                        help="also decode each trained model with the other library's decoder")
    parser.add_argument("--init", choices=("marian", "aiayn"), default="marian",
                        help="which library initialises; the other copies the weights")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="parallel corpus (TSV)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 s a side, blocks of 1 step, 4 test sentences")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON results (default benchmarks/results/translation_vs_marian.json; "
                             "with --quick, none)")
    args = parser.parse_args(argv)
    if args.quick:
        args.budget_seconds, args.block_steps = min(args.budget_seconds, 2.0), 1
        args.test_limit = 4
    for name in ("budget_seconds", "block_steps", "threads", "test_limit"):
        if getattr(args, name) < (0 if name == "test_limit" else 1e-9):
            parser.error(f"--{name.replace('_', '-')} must be positive")
    args.argv = argv
    results = run(args)
    print_table(results)
    if args.out is None and not args.quick:
        args.out = BENCH_DIR / "results" / "translation_vs_marian.json"
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        save_results(args.out, results)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main(sys.argv[1:])
