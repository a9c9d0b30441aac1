"""Pretrained encoders to start a classifier from: an aiayn masked-LM (or classification) run
directory, or a Hugging Face BERT-format directory read through ``aiayn.from_pretrained``.

Either way we get the encoder's config, its weights (the state of a ``TransformerEncoder``) and the
tokenizer it was trained with: a fine-tuned model must see the ids it was pretrained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from aiayn.config import TransformerConfig
from aiayn.data.wordpiece import WordPieceTokenizer


@dataclass
class PretrainedEncoder:
    """An encoder to initialise from.

    Attributes:
        config: its architecture (vocabulary, widths, positions, ...).
        weights: ``TransformerEncoder.state_dict()`` of the pretrained encoder.
        tokenizer: the tokenizer it was trained with.
        source: a description for run.json ("aiayn run X" / "hf X").
    """

    config: TransformerConfig
    weights: dict[str, Tensor]
    tokenizer: WordPieceTokenizer
    source: str


def load_pretrained_encoder(path: str | Path) -> PretrainedEncoder:
    """Read an encoder from an aiayn run directory (task "mlm" or "classification") or a Hugging Face
    directory (``config.json`` + weights + ``tokenizer.json``/``vocab.txt``).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: neither kind of directory, a run of another task, or a model aiayn cannot load.
    """
    from aiayn.training.run import RUN_FILE

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--init: not found: {path}")
    if not path.is_dir():
        raise ValueError(f"--init expects a directory (an aiayn mlm run or a Hugging Face model), "
                         f"got the file {path}")
    if (path / RUN_FILE).is_file():
        return _from_run(path)
    if (path / "config.json").is_file():
        return _from_hugging_face(path)
    raise ValueError(f"--init: {path} is neither an aiayn run directory (no {RUN_FILE}) nor a "
                     f"Hugging Face model directory (no config.json)")


def _from_run(path: Path) -> PretrainedEncoder:
    from aiayn.training.run import load_run

    run = load_run(path)
    if run.task not in ("mlm", "classification"):
        raise ValueError(f"--init: {path} is a run of task {run.task!r}; a classifier starts from "
                         f"an 'mlm' (or 'classification') run")
    tokenizer = run.assets.tokenizer
    return PretrainedEncoder(config=run.model_config, weights=run.model.encoder.state_dict(),
                             tokenizer=tokenizer, source=f"aiayn {run.task} run {path}")


def _from_hugging_face(path: Path) -> PretrainedEncoder:
    import aiayn

    from_pretrained = getattr(aiayn, "from_pretrained", None)
    if from_pretrained is None:
        raise ValueError("--init with a Hugging Face directory needs aiayn.from_pretrained, which "
                         "is not available in this installation; initialise from an aiayn mlm "
                         "run directory instead")
    encoder = from_pretrained(path, task="encoder")
    return PretrainedEncoder(config=encoder.config, weights=encoder.state_dict(),
                             tokenizer=WordPieceTokenizer.from_pretrained_dir(path),
                             source=f"hugging face {path}")


@dataclass
class PretrainedModel:
    """A whole model to fine-tune (translation, language modelling): its config, the state of the
    aiayn model it loads into, and its tokenizer (kept: the ids must be the pretrained ones)."""

    config: TransformerConfig
    weights: dict[str, Tensor]
    tokenizer: object
    source: str


def load_pretrained_model(path: str | Path, task: str) -> PretrainedModel:
    """``--init DIR`` of ``aiayn train translation`` / ``lm``: an aiayn run of ``task`` or a Hugging
    Face checkpoint of that task (``aiayn.tasks.checkpoints.load_model_dir``).

    Raises:
        FileNotFoundError / ValueError: as ``load_model_dir``, prefixed with ``--init``.
    """
    from aiayn.tasks.checkpoints import load_model_dir

    try:
        run = load_model_dir(path, task=task)
    except (FileNotFoundError, ValueError) as error:
        raise type(error)(f"--init: {error}") from None
    kind = "aiayn run" if (Path(path) / "run.json").is_file() else "hugging face"
    return PretrainedModel(config=run.model_config, weights=run.model.state_dict(),
                           tokenizer=run.assets, source=f"{kind} {path}")
