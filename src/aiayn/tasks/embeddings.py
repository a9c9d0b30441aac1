"""Sentence embeddings from an encoder, as sentence-transformers computes them for
all-MiniLM-L6-v2: ``[CLS] pieces [SEP]`` cut to the model's ``max_seq_length``, the mean of the last
hidden states over the real tokens, divided by its L2 norm (so a dot product is a cosine).

Legend: N texts, B batch, T longest length in the batch, D model width.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from aiayn.data.sequence_batches import pad_right
from aiayn.models.heads import pool


@dataclass
class Embedder:
    """An encoder (``TransformerEncoder``), its tokenizer and the longest input, in ids."""

    encoder: nn.Module
    tokenizer: object  # aiayn.data.wordpiece.WordPieceTokenizer
    max_tokens: int
    source: str


def load_embedder(path: str | Path) -> Embedder:
    """The encoder of a BERT checkpoint directory (any head: the bare encoder is used) or of an
    aiayn ``classification`` / ``mlm`` run, with its tokenizer.

    Raises:
        FileNotFoundError / ValueError: as ``aiayn.tasks.checkpoints.load_model_dir``; a directory
            whose model has no encoder of its own (translation, language model).
    """
    from aiayn.tasks.checkpoints import directory_task, load_model_dir, sentence_length

    path = Path(path)
    task = directory_task(path)
    if task not in ("encoder", "mlm", "classification"):
        raise ValueError(f"{path} holds a {task!r} model; embeddings come from an encoder: a BERT "
                         f"checkpoint or an aiayn 'classification' / 'mlm' run")
    if (path / "run.json").is_file():
        run = load_model_dir(path)
        return Embedder(run.model.encoder, run.assets.tokenizer, run.assets.max_tokens,
                        f"run {path}")
    run = load_model_dir(path, model_task="encoder")
    max_tokens = sentence_length(path, run.model_config.max_length)
    return Embedder(run.model, run.assets.tokenizer, max_tokens, f"checkpoint {path}")


@torch.no_grad()
def embed_texts(embedder: Embedder, texts: Sequence[str], *, tokens_per_batch: int = 8192,
                device: str | torch.device = "cpu") -> Tensor:
    """Normalised mean-pooled embeddings (N, D), float32, in input order.

    Texts are sorted by length and batched to about ``tokens_per_batch`` padded positions; the
    padding never changes a text's embedding (masked attention, masked mean).
    """
    if not texts:
        raise ValueError("nothing to embed")
    sequences = embedder.tokenizer.encode(list(texts), max_length=embedder.max_tokens)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
    results: list[Tensor | None] = [None] * len(sequences)
    start = 0
    while start < len(order):
        longest = len(sequences[order[start]])
        end = start + 1
        while end < len(order) and (end - start + 1) * len(sequences[order[end]]) <= \
                max(tokens_per_batch, longest):
            end += 1
        rows = order[start:end]
        ids, mask = pad_right([sequences[i] for i in rows], embedder.tokenizer.pad_id)  # (B, T)
        hidden = embedder.encoder(ids.to(device), padding_mask=mask.to(device))  # (B, T, D)
        pooled = pool(hidden.float(), mask.to(device), "mean")  # (B, D)
        vectors = torch.nn.functional.normalize(pooled, dim=-1).cpu()
        for row, index in enumerate(rows):
            results[index] = vectors[row]
        start = end
    return torch.stack(results)  # type: ignore[arg-type]
