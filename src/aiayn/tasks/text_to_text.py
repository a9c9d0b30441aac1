"""Text-to-text (Raffel et al. 2020, T5): every task as text in, text out, told apart by a prefix.

    translation pair (en, de)     ->  "translate English to German: en"  ->  "de"
    labelled text (text, label)   ->  "debian section: text"             ->  "label"

One joint subword vocabulary over every source and target, one encoder-decoder, one loss (the
translation task's label-smoothed cross-entropy), batches that mix the tasks. Validation reports the
loss and, per task, what the task is judged by: BLEU and chrF of greedy translations, and the
accuracy of the generated label text (exact match). A classification source longer than
``max_length`` subwords is cut (its prefix comes first and stays); a translation pair longer than that
is dropped, as the translation task does.

Legend: B batch, S source length, T target length, V vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from aiayn.config import TransformerConfig
from aiayn.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, TOKENIZER_FILE, SubwordTokenizer
from aiayn.models import Transformer
from aiayn.models.modes import evaluating
from aiayn.tasks.translation import PairBatches, check_pair_options
from aiayn.training.devices import default_device

KINDS = ("translation", "classification")
PREFIXES_FILE = "prefixes.json"
# Decoding limits (source length + this many tokens): paper 6.1's 50 for a translation, a few for a
# label, which is a word or two
MAX_EXTRA = {"translation": 50, "classification": 8}
# What the commands that apply a run do with each kind (error messages)
ACTIONS = {"translation": "translate", "classification": "classify"}
# Subwords of a classification source a run read when its run.json does not say (the default of
# --max-length): a longer text is cut to its beginning, in training and in generation alike
MAX_SOURCE_LENGTH = 128


@dataclass(frozen=True)
class TextExample:
    """One example as text: the prefixed source, the target text, and which task it belongs to."""

    source: str
    target: str
    kind: str


def translation_examples(pairs: Sequence[Any], prefix: str) -> list[TextExample]:
    """``SentencePair``s as examples: prefix + source -> target."""
    return [TextExample(prefix + pair.source, pair.target, "translation") for pair in pairs]


def classification_examples(rows: Any, prefix: str) -> list[TextExample]:
    """``LabelledTexts`` rows as examples: prefix + text -> label."""
    return [TextExample(prefix + text, label, "classification")
            for text, label in zip(rows.texts, rows.labels)]


class TextToTextTask(PairBatches):
    """An encoder-decoder trained on text examples of several tasks at once.

    Args:
        train: training examples (any mix of kinds).
        valid: validation examples; each kind present is scored by its metric.
        tokenizer: a joint subword tokenizer (``SubwordTokenizer.train`` on the training texts).
        prefixes: the prefix of each kind, saved with the run so decoding writes the same text.
        max_tokens: padded tokens per side per batch; max_length: subwords per side at most.
        label_smoothing: eps_ls of the loss; valid_sentences: translations decoded for BLEU.
    """

    name = "text2text"

    def __init__(self, *, train: Sequence[TextExample], valid: Sequence[TextExample],
                 tokenizer: SubwordTokenizer, prefixes: dict[str, str], max_tokens: int = 2500,
                 max_length: int = 128, label_smoothing: float = 0.1, valid_sentences: int = 200,
                 seed: int = 0, device: str | None = None):
        if not train:
            raise ValueError("text-to-text training needs examples (give --tasks and their data)")
        check_pair_options(max_tokens=max_tokens, max_length=max_length,
                           label_smoothing=label_smoothing, sentences=valid_sentences,
                           sentences_option="--valid-sentences")
        self.tokenizer, self.prefixes = tokenizer, dict(prefixes)
        self.pad_id, self.start_id, self.eos_id = PAD_ID, BOS_ID, EOS_ID
        self.max_tokens, self.max_length = max_tokens, max_length
        self.label_smoothing, self.valid_sentences, self.seed = label_smoothing, valid_sentences, seed
        self.device = torch.device(default_device(device))
        self.train_source, self.train_target = self._encode(train)
        self.filtered = len(train) - len(self.train_source)
        self.valid = list(valid)
        self.valid_source, self.valid_target = self._encode(self.valid, drop=False)

    def _encode(self, examples: Sequence[TextExample], *, drop: bool = True
                ) -> tuple[list[list[int]], list[list[int]]]:
        sources = self.tokenizer.encode([e.source for e in examples])
        targets = self.tokenizer.encode([e.target for e in examples])
        kept_source, kept_target = [], []
        for example, source, target in zip(examples, sources, targets):
            if example.kind == "classification":
                source = source[:self.max_length]  # a long description: keep its beginning
            elif drop and max(len(source), len(target)) > self.max_length:
                continue
            if source and target:
                kept_source.append(source)
                kept_target.append(target)
        return kept_source, kept_target

    # --- Task protocol ----------------------------------------------------------------------------
    def model_config(self, base: TransformerConfig) -> TransformerConfig:
        return base.replace(vocab_size=self.tokenizer.vocab_size, src_vocab_size=None,
                            pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, decoder_start_id=None,
                            max_length=max(base.max_length, self.max_length + 52))

    def build_model(self, model_config: TransformerConfig) -> nn.Module:
        return Transformer(model_config)

    def metric_names(self) -> set[str]:
        """loss and ppl; BLEU and chrF when translations are decoded; accuracy when
        classification examples are."""
        kinds = {e.kind for e in self.valid}
        return ({"loss", "ppl"}
                | ({"bleu", "chrf"} if "translation" in kinds and self.valid_sentences else set())
                | ({"accuracy"} if "classification" in kinds else set()))

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        metrics = self.valid_loss(model)
        translations = [e for e in self.valid if e.kind == "translation"][:self.valid_sentences]
        return {**metrics, **score_examples(model, self.tokenizer, translations),
                **score_examples(model, self.tokenizer,
                                 [e for e in self.valid if e.kind == "classification"],
                                 max_length=self.max_length)}

    def save_assets(self, run_dir: Path) -> dict[str, Any]:
        self.tokenizer.save(Path(run_dir) / TOKENIZER_FILE)
        (Path(run_dir) / PREFIXES_FILE).write_text(json.dumps(self.prefixes, indent=2) + "\n",
                                                   encoding="utf-8")
        kinds = {kind: sum(e.kind == kind for e in self.valid) for kind in KINDS}
        return {"tokenizer": TOKENIZER_FILE, "prefixes": self.prefixes,
                "max_length": self.max_length, "vocab_size": self.tokenizer.vocab_size,
                "train_examples": len(self.train_source),
                "filtered_examples": self.filtered, "valid_examples": kinds}

    @classmethod
    def load_assets(cls, run_dir: Path) -> "TextToTextAssets":
        run_dir = Path(run_dir)
        prefixes = json.loads((run_dir / PREFIXES_FILE).read_text(encoding="utf-8"))
        info = json.loads((run_dir / "run.json").read_text(encoding="utf-8")).get("assets", {})
        return TextToTextAssets(SubwordTokenizer.load(run_dir / TOKENIZER_FILE), prefixes,
                                max_length=int(info.get("max_length", MAX_SOURCE_LENGTH)))


@dataclass(frozen=True)
class TextToTextAssets:
    """What decoding a text-to-text run needs: its tokenizer, its task prefixes and the subwords
    of a classification source it read (``max_length``)."""

    tokenizer: SubwordTokenizer
    prefixes: dict[str, str]
    max_length: int = MAX_SOURCE_LENGTH


def generate_ids(model: nn.Module, tokenizer: SubwordTokenizer, sources: Sequence[str], *,
                 beam_size: int = 1, alpha: float = 0.6, max_extra: int = 50,
                 max_length: int | None = None, max_tokens: int = 4000, engine=None
                 ) -> tuple[list[list[int]], list[list[int]]]:
    """(source ids, output ids without </s>) for each (prefixed) source text, greedy or beam, in
    input order, decoded in batches of about ``max_tokens`` source tokens; sources are cut to
    ``max_length`` subwords (``engine``: an ``aiayn.fast.InferenceEngine`` for ``model`` runs the
    searches)."""
    from aiayn.tasks.translate import translate_ids

    ids = [row[:max_length] if max_length else row for row in tokenizer.encode(list(sources))]
    with evaluating(model), torch.inference_mode():
        outputs = translate_ids(model, ids, beam_size=beam_size, alpha=alpha,
                                max_tokens=max_tokens, max_extra=max_extra, engine=engine)
    return ids, outputs


def generate_texts(model: nn.Module, tokenizer: SubwordTokenizer, sources: Sequence[str],
                   **options: Any) -> list[str]:
    """The model's output text for each (prefixed) source (``generate_ids``' options)."""
    return tokenizer.decode(generate_ids(model, tokenizer, sources, **options)[1])


def output_log_probs(model: nn.Module, sources: Sequence[Sequence[int]],
                     outputs: Sequence[Sequence[int]], *, max_tokens: int = 4000) -> list[float]:
    """log P(output, </s> | source) for each pair of id sequences (no </s> in either): the
    teacher-forced log-probabilities of the output's tokens and its </s>, summed."""
    from aiayn.data.batching import collate, token_batches

    config = model.config
    device = next(model.parameters()).device
    result = [0.0] * len(sources)
    with evaluating(model), torch.inference_mode():
        for indices in token_batches([len(s) + 1 for s in sources], [len(t) + 1 for t in outputs],
                                     max_tokens=max_tokens, shuffle=False):
            batch = collate([sources[i] for i in indices], [outputs[i] for i in indices], indices,
                            pad_id=config.pad_id, bos_id=config.bos_id,
                            eos_id=config.eos_id).to(device)
            # causal: a real target position never sees the padding after it
            logits = model(batch.source, batch.decoder_input,
                           src_padding_mask=batch.source != config.pad_id)  # (B, T, V)
            picked = logits.float().log_softmax(-1).gather(
                -1, batch.targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
            lengths = torch.tensor([len(outputs[i]) + 1 for i in indices], device=device)
            real = torch.arange(picked.shape[1], device=device) < lengths[:, None]  # tokens, </s>
            for index, value in zip(indices, picked.masked_fill(~real, 0).sum(-1).tolist()):
                result[index] = value
    return result


def run_prefix(prefixes: dict[str, str], kind: str, run_dir: Any) -> str:
    """The prefix of ``kind`` in a text2text run's ``prefixes``; a ValueError naming the tasks the
    run was trained on when it has none (``aiayn translate`` / ``classify`` on the wrong run)."""
    if kind not in prefixes:
        raise ValueError(f"{run_dir} is a text2text run trained on {sorted(prefixes)} only: it "
                         f"does not {ACTIONS[kind]}")
    return prefixes[kind]


def score_examples(model: nn.Module, tokenizer: SubwordTokenizer,
                   examples: Sequence[TextExample], *, beam_size: int = 1, alpha: float = 0.6,
                   max_length: int = MAX_SOURCE_LENGTH, engine=None) -> dict[str, float]:
    """Translation examples: ``bleu`` and ``chrf``; classification examples: ``accuracy`` of the
    generated label text (stripped, exact match). Examples of one kind at a time; none: {}."""
    outputs = generate_examples(model, tokenizer, examples, beam_size=beam_size, alpha=alpha,
                                max_length=max_length, engine=engine)
    return score_outputs(outputs, examples)


def _one_kind(examples: Sequence[TextExample]) -> str:
    kinds = {e.kind for e in examples}
    if len(kinds) != 1:
        raise ValueError(f"score one kind of example at a time, got {sorted(kinds)}")
    return kinds.pop()


def generate_examples(model: nn.Module, tokenizer: SubwordTokenizer,
                      examples: Sequence[TextExample], *, beam_size: int = 1, alpha: float = 0.6,
                      max_length: int = MAX_SOURCE_LENGTH, max_tokens: int = 4000,
                      engine=None) -> list[str]:
    """The generated text of each example (``generate_texts`` with its kind's output limit);
    examples of one kind at a time. A classification source is cut to ``max_length`` subwords, as
    training cut it; a translation source is read whole (``translate_ids`` cuts only what the
    model's positions cannot hold, and warns)."""
    if not examples:
        return []
    kind = _one_kind(examples)
    return generate_texts(model, tokenizer, [e.source for e in examples], beam_size=beam_size,
                          alpha=alpha, max_extra=MAX_EXTRA[kind],
                          max_length=max_length if kind == "classification" else None,
                          max_tokens=max_tokens, engine=engine)


def score_outputs(outputs: Sequence[str], examples: Sequence[TextExample]) -> dict[str, float]:
    """``score_examples``' scores of texts already generated for ``examples``."""
    from aiayn.tasks.translate import score_translations

    if not examples:
        return {}
    if _one_kind(examples) == "classification":
        right = sum(out.strip() == e.target for out, e in zip(outputs, examples))
        return {"accuracy": right / len(examples)}
    return score_translations(outputs, [e.target for e in examples])
