"""The tutorials' other pictures: sinusoidal positions, the learning-rate schedule, a run's curves.

- ``plot_positions``: the paper's encoding (3.5) as curves of a few dimensions, as a (position x
  dimension) image, and the dot-product similarity PE(p) . PE(q) of every pair of positions, which
  depends only on p - q (why the paper chose sinusoids: relative offsets are linear functions).
- ``plot_schedule``: the learning rate of eq. 3 over steps for several d_model / warmup pairs.
- ``plot_run``: loss, perplexity, BLEU / accuracy and learning rate over steps from ``log.jsonl``.
- ``plot_confusion``: the confusion matrix of a saved classification evaluation.

matplotlib is imported inside the functions (Agg backend).
Legend: P positions, D model width.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Sequence

from aiayn.visualise.heatmaps import COLOUR_MAP, pyplot, save_figure


def readable_dimensions(d_model: int, length: int, layout: str = "interleaved") -> list[int]:
    """Up to four sine dimensions whose wavelengths are about length/8, /4, /2 and length itself,
    so their curves are distinguishable over ``length`` positions (dimension 2i has wavelength
    2 pi 10000^(2i/d_model)); fewer where two wavelengths round to one dimension."""
    dims = []
    for wavelength in (length / 8, length / 4, length / 2, length):
        frequency_index = round(d_model / 2 * math.log(max(wavelength, 2 * math.pi) / (2 * math.pi))
                                / math.log(10000.0))
        frequency_index = min(max(frequency_index, 0), d_model // 2 - 1)
        dim = 2 * frequency_index if layout == "interleaved" else frequency_index
        if dim not in dims:
            dims.append(dim)
    return dims


def plot_positions(d_model: int, length: int, path: str | Path, *,
                   layout: str = "interleaved", dims: Sequence[int] | None = None,
                   dpi: int = 110) -> Path:
    """Three panels of the sinusoidal position encoding of ``length`` positions and width ``d_model``.

    ``dims``: the dimensions drawn as curves (default: ``readable_dimensions``).

    Raises:
        ValueError: d_model not a positive even number, length < 2, or a dimension outside the table.
    """
    from aiayn.nn.positions import sinusoidal_table

    if d_model < 2 or d_model % 2:
        raise ValueError(f"d_model must be a positive even number, got {d_model}")
    if length < 2:
        raise ValueError(f"length must be >= 2, got {length}")
    if dims is None:
        dims = readable_dimensions(d_model, length, layout)
    if any(not 0 <= dim < d_model for dim in dims):
        raise ValueError(f"dims {list(dims)} must lie in 0..{d_model - 1}")
    table = sinusoidal_table(length, d_model, layout).double()  # (P, D)
    similarity = (table @ table.T).numpy()  # (P, P)
    plt = pyplot()
    figure, axes = plt.subplots(1, 3, figsize=(17, 5), layout="constrained",
                                gridspec_kw={"width_ratios": [1.2, 1.2, 1]})
    for dim in dims:
        axes[0].plot(table[:, dim].numpy(), label=f"dim {dim}")
    axes[0].set(title="PE(pos, i) for a few dimensions i", xlabel="position",
                ylabel="encoding value")
    axes[0].legend(fontsize=8, loc="upper right")
    image = axes[1].imshow(table.numpy(), cmap="RdBu", aspect="auto", vmin=-1, vmax=1,
                           interpolation="nearest")
    axes[1].set(title=f"sinusoidal encoding ({layout}), d_model={d_model}", xlabel="dimension i",
                ylabel="position")
    figure.colorbar(image, ax=axes[1], shrink=0.85).set_label("PE(pos, i)")
    image = axes[2].imshow(similarity, cmap=COLOUR_MAP, aspect="equal", interpolation="nearest")
    axes[2].set(title="dot product PE(p) . PE(q)", xlabel="position q", ylabel="position p")
    figure.colorbar(image, ax=axes[2], shrink=0.85).set_label("similarity")
    figure.suptitle("Positional encoding (paper 3.5): "
                    "PE(pos,2i) = sin(pos/10000^(2i/d)), PE(pos,2i+1) = cos(pos/10000^(2i/d))")
    return save_figure(figure, path, dpi=dpi)


def plot_schedule(path: str | Path, *, d_models: Sequence[int] = (512,),
                  warmups: Sequence[int] = (4000,), steps: int = 20000,
                  factor: float = 1.0, dpi: int = 110) -> Path:
    """The learning rate of eq. 3, lrate = factor * d^-0.5 * min(step^-0.5, step * warmup^-1.5),
    for every pair of ``d_models`` x ``warmups`` over ``steps`` steps.

    Raises:
        ValueError: an empty or non-positive d_model / warmup list, steps < 2, factor <= 0.
    """
    from aiayn.training.schedules import noam

    if not d_models or not warmups or min(d_models) < 1 or min(warmups) < 1:
        raise ValueError(f"d_models {list(d_models)} and warmups {list(warmups)} must be non-empty "
                         "lists of positive integers")
    if steps < 2:
        raise ValueError(f"steps must be >= 2, got {steps}")
    if factor <= 0:
        raise ValueError(f"factor must be > 0, got {factor}")
    plt = pyplot()
    figure, axis = plt.subplots(figsize=(8, 4.8), layout="constrained")
    step_axis = range(1, steps + 1)
    for d_model in d_models:
        for warmup in warmups:
            rates = [noam(step, d_model=d_model, warmup=warmup, factor=factor)
                     for step in step_axis]
            peak = max(rates)
            axis.plot(step_axis, rates, label=f"d_model={d_model}, warmup={warmup} "
                                              f"(peak {peak:.2e})")
    axis.set(title="Learning rate schedule (paper eq. 3)", xlabel="training step",
             ylabel="learning rate")
    axis.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    axis.grid(alpha=0.3)
    axis.legend()
    return save_figure(figure, path, dpi=dpi)


def read_log(path: str | Path) -> list[dict]:
    """Records of a JSON-lines training log; blank lines are skipped.

    Raises:
        FileNotFoundError: no such file.
        ValueError: an empty log, a malformed line or a record without an integer ``step`` (naming the
            file and line).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no training log at {path}")
    records = []
    with open(path, encoding="utf-8") as stream:
        for number, line in enumerate(stream, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got "
                                 f"{type(record).__name__}")
            step = record.get("step")
            if not isinstance(step, int) or isinstance(step, bool):
                raise ValueError(f"{path}:{number}: record has no integer 'step' (got {step!r})")
            records.append(record)
    if not records:
        raise ValueError(f"{path}: the training log is empty")
    return records


def collect_series(records: Iterable[dict]) -> dict[tuple[str, str], tuple[list[int], list[float]]]:
    """Finite numeric values per (metric key, series label); the label adds a record's ``split``
    ("train", "valid", ...) so that train and validation losses logged under one key stay apart."""
    series: dict[tuple[str, str], tuple[list[int], list[float]]] = {}
    for record in records:
        split = record.get("split")
        for key, value in record.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not math.isfinite(value):
                continue
            label = f"{split} {key}" if isinstance(split, str) and split else key
            steps, values = series.setdefault((key, label), ([], []))
            steps.append(record["step"])
            values.append(float(value))
    return series


def _is_loss(key: str) -> bool:
    return key == "loss" or key.endswith("_loss") or key.startswith("loss_")


SCORE_WORDS = ("bleu", "chrf", "accuracy", "f1")


def _is_score(key: str) -> bool:
    lower = key.lower()
    return any(word in lower for word in SCORE_WORDS) or lower == "acc" or lower.endswith("_acc")

RATE_KEYS = ("lr", "learning_rate")


def plot_run(log_path: str | Path, path: str | Path, *, title: str | None = None,
             dpi: int = 110) -> Path:
    """Loss, perplexity (exp of each loss), scores (BLEU, chrF, accuracy, F1) and learning rate over
    steps, one panel each, from a run's ``log.jsonl``; panels without data are left out. Records
    with a ``split`` field ("train", "valid") give one curve per split.

    Raises:
        FileNotFoundError / ValueError: see ``read_log``; also a log with none of these metrics.
    """
    records = read_log(log_path)
    series = collect_series(records)
    groups = [("loss", "loss (nats / token)", _is_loss, False),
              ("perplexity", "perplexity = exp(loss)", _is_loss, True),
              ("scores", "score", lambda key: _is_score(key) and not _is_loss(key), False),
              ("learning rate", "learning rate", lambda key: key in RATE_KEYS, False)]
    panels = []
    for name, ylabel, wanted, exponentiate in groups:
        labels = sorted(label for key, label in series if wanted(key))
        if labels:
            panels.append((name, ylabel, labels, exponentiate))
    if not panels:
        keys = sorted({key for key, _ in series})
        raise ValueError(f"{log_path}: no loss, score or learning-rate metrics to plot (keys: "
                         f"{keys})")
    by_label = {label: data for (_, label), data in series.items()}
    plt = pyplot()
    figure, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2),
                                layout="constrained", squeeze=False)
    for axis, (name, ylabel, panel_keys, exponentiate) in zip(axes[0], panels):
        for key in panel_keys:
            steps, values = by_label[key]
            if exponentiate:
                values = [math.exp(min(value, 50.0)) for value in values]
            marker = "o" if len(steps) <= 30 else None
            axis.plot(steps, values, marker=marker, markersize=3,
                      label=f"exp({key})" if exponentiate else key)
        if exponentiate:
            axis.set_yscale("log")
        if name == "learning rate":
            axis.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        axis.set(title=name, xlabel="step", ylabel=ylabel)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    figure.suptitle(title or f"Training run: {Path(log_path).parent.name or log_path}")
    return save_figure(figure, path, dpi=dpi)


def plot_confusion(report_path: str | Path, path: str | Path, *, title: str | None = None,
                   dpi: int = 110) -> Path:
    """The confusion matrix saved by ``aiayn evaluate`` (``RUN/evaluation/<data>.<split>.json``):
    each row (true label) coloured by the share of its rows predicted as each label, with the counts
    written in the cells, so a small class's errors show as clearly as a large one's.

    Raises:
        FileNotFoundError / ValueError: no such file, or not a saved classification evaluation.
    """
    source = Path(report_path)
    try:
        report = json.loads(source.read_text(encoding="utf-8"))
        labels, counts = list(report["labels"]), report["confusion"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        if isinstance(error, FileNotFoundError):
            raise
        raise ValueError(f"{source}: not a saved classification evaluation ({error})") from None
    import numpy as np

    matrix = np.asarray(counts, dtype=float)  # (C, C): [true, predicted]
    shares = matrix / np.maximum(matrix.sum(axis=1, keepdims=True), 1.0)
    plt = pyplot()
    size = 2.0 + 0.42 * len(labels)
    figure, axis = plt.subplots(figsize=(size + 1.2, size), layout="constrained")
    image = axis.imshow(shares, cmap=COLOUR_MAP, vmin=0.0, vmax=1.0)
    for (row, column), count in np.ndenumerate(matrix):
        if count:
            axis.text(column, row, str(int(count)), ha="center", va="center", fontsize=7,
                      color="white" if shares[row, column] > 0.55 else "black")
    axis.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
    axis.set_yticks(range(len(labels)), labels, fontsize=8)
    axis.set(xlabel="predicted", ylabel="true")
    figure.colorbar(image, ax=axis, shrink=0.7, label="share of the true label's rows")
    accuracy, macro_f1 = report.get("accuracy"), report.get("macro_f1")
    scores = f" (accuracy {accuracy:.3f}, macro-F1 {macro_f1:.3f})" if accuracy is not None \
        and macro_f1 is not None else ""
    axis.set_title((title or f"Confusion matrix: {source.name}") + scores, fontsize=10)
    return save_figure(figure, path, dpi=dpi)
