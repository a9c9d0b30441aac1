"""``aiayn train TASK``: one sub-parser per task, the shared training options, then ``train``.

Tasks register here: ``TASKS`` maps a task name to a module with ``add_arguments(parser)`` (its own
options; it may also change the shared defaults with ``parser.set_defaults``), ``make_task(args)``
(returns a ``aiayn.training.Task``) and ``evaluate(args) -> dict`` (for ``aiayn evaluate``). Modules
are imported by name; keep their top-level imports light. A task whose module is not in this
installation is left out of the command line (each task lands on its own branch).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

from aiayn.commands import DefaultsHelpFormatter, summary

TASKS: dict[str, str] = {
    "translation": "aiayn.commands.train_translation",
    "lm": "aiayn.commands.train_lm",
    "classification": "aiayn.commands.train_classification",
    "mlm": "aiayn.commands.train_mlm",
    "image-classification": "aiayn.commands.train_image_classification",
    "text2text": "aiayn.commands.train_text_to_text",
}


def available_tasks() -> list[str]:
    """Task names whose module exists in this installation."""
    import importlib.util

    return [name for name, module in TASKS.items() if importlib.util.find_spec(module) is not None]


def task_module(name: str) -> ModuleType:
    if name not in available_tasks():
        raise ValueError(f"unknown task {name!r}; choose one of {available_tasks()}")
    return importlib.import_module(TASKS[name])


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train", help="train a model for a task (translation, ...)",
        description="Train a model and write a run directory (run.json, model.safetensors, "
                    "checkpoints/, log.jsonl, task assets). Re-running the same command resumes "
                    "from the latest checkpoint.")
    tasks = parser.add_subparsers(dest="task", metavar="TASK")
    for name in available_tasks():
        module = task_module(name)
        doc = summary(module.__doc__, name)
        task_parser = tasks.add_parser(name, help=doc, description=doc,
                                       formatter_class=DefaultsHelpFormatter)
        add_training_arguments(task_parser)
        module.add_arguments(task_parser)
        task_parser.set_defaults(run=run)
    parser.set_defaults(run=lambda args: _missing_task(parser))


def _missing_task(parser: argparse.ArgumentParser) -> int:
    import sys

    parser.print_usage(sys.stderr)  # a usage error: usage and the problem on stderr, exit code 2
    print(f"{parser.prog}: error: choose a TASK: {', '.join(available_tasks())}", file=sys.stderr)
    return 2


def device_name(text: str) -> str:
    """argparse type: a device this PyTorch can use (a usage error naming why otherwise)."""
    from aiayn.training.devices import check_device

    try:
        return check_device(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_int(text: str) -> int:
    """argparse type: a count that must be at least 1 (a usage error otherwise, exit code 2)."""
    return _count(text, minimum=1, what="a positive integer")


def non_negative_int(text: str) -> int:
    """argparse type: a count that may be 0 (e.g. "only at the end")."""
    return _count(text, minimum=0, what="a non-negative integer")


def _count(text: str, *, minimum: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return value


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    """Options every task shares (paper section 5 defaults)."""
    group = parser.add_argument_group("run")
    group.add_argument("--out", required=True, metavar="RUN_DIR",
                       help="run directory to create, or to resume if it holds checkpoints")
    group.add_argument("--preset", default="base", help="model preset (aiayn.presets.PRESETS)")
    group.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                       help="override a model config field, e.g. --set dropout=0.2 (repeatable)")
    group.add_argument("--no-resume", action="store_true",
                       help="fail instead of resuming when RUN_DIR already holds checkpoints")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--device", type=device_name, default=None,
                       help="cpu, cuda, ... (default: cuda if available)")
    group.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    group = parser.add_argument_group("optimisation")
    group.add_argument("--steps", type=positive_int, default=100_000, help="optimizer updates")
    group.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                       help="stop training after this many seconds (then evaluate and save)")
    group.add_argument("--optimizer", choices=("adam", "adamw"), default="adam")
    group.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.98))
    group.add_argument("--adam-eps", type=float, default=1e-9)
    group.add_argument("--weight-decay", type=float, default=0.0)
    group.add_argument("--decay-matrices-only", action=argparse.BooleanOptionalAction,
                       default=False, help="weight decay on matrices/embeddings only, not on "
                       "biases and LayerNorm (GPT-2, nanoGPT)")
    group.add_argument("--schedule", choices=("noam", "warmup_cosine", "constant"), default="noam")
    group.add_argument("--warmup", type=non_negative_int, default=4000, help="warm-up steps")
    group.add_argument("--lr-factor", type=float, default=1.0,
                       help="noam: multiplies d_model^-0.5 * min(step^-0.5, step*warmup^-1.5)")
    group.add_argument("--lr", type=float, default=1e-3,
                       help="peak learning rate (warmup_cosine, constant)")
    group.add_argument("--min-lr", type=float, default=None,
                       help="warmup_cosine floor (unset: the task's recipe's, 0 without one; a "
                       "recipe's floor above a lower --lr is scaled with it, keeping the "
                       "recipe's floor-to-peak ratio)")
    group.add_argument("--accumulation", type=positive_int, default=1,
                       help="micro-batches per update (gradient normalised by their tokens)")
    group.add_argument("--clip-norm", type=float, default=None, help="gradient norm clipping")
    group.add_argument("--autocast", choices=("bf16", "fp16", "auto", "none"), default=None,
                       help="mixed precision: bf16, fp16 (with a gradient scaler), auto (bf16 "
                            "where the device runs it natively: CUDA, or a CPU with AMX / "
                            "AVX512-BF16) or none (float32; the default unless a task's recipe "
                            "says otherwise)")
    group.add_argument("--nonfinite", choices=("skip", "raise"), default="skip",
                       help="a non-finite (inf/NaN) loss or gradient: skip that update (weights "
                       "unchanged, logged and counted) or stop with an error naming the step "
                       "(docs/faults-and-numerics.md)")
    group = parser.add_argument_group(
        "distributed and memory", "launch with torchrun --nproc-per-node N -m aiayn train ... "
        "(docs/distributed.md); --accumulation is per process")
    group.add_argument("--distributed", choices=("ddp", "fsdp"), default="ddp",
                       help="under torchrun: replicate (DDP) or shard (FSDP2) the model")
    group.add_argument("--dist-timeout", type=float, default=1800.0, metavar="SECONDS",
                       help="how long a rank waits for a missing peer before failing")
    group.add_argument("--activation-checkpointing", action="store_true",
                       help="recompute layer activations in the backward pass (less memory)")
    group.add_argument("--compile", action="store_true",
                       help="torch.compile the model and its loss as one graph (under DDP / FSDP: "
                            "each layer)")
    group = parser.add_argument_group("evaluation and checkpoints")
    group.add_argument("--eval-every", type=non_negative_int, default=1000)
    group.add_argument("--save-every", type=non_negative_int, default=1000)
    group.add_argument("--log-every", type=positive_int, default=10)
    group.add_argument("--tensorboard", action="store_true",
                       help="also log every metric to RUN_DIR/tensorboard (needs the tensorboard "
                       "package: pip install 'aiayn[tensorboard]'); log.jsonl is always written")
    group.add_argument("--keep-last", type=non_negative_int, default=5, help="checkpoints kept (0: all)")
    group.add_argument("--average-last", type=non_negative_int, default=0,
                       help="average the last K checkpoints at the end (paper 6.1: 5); the "
                       "average is the run's model if it scores better (with --best-metric none, "
                       "always)")
    group.add_argument("--best-metric", default="loss",
                       help="validation metric that picks the run's model ('none': final, or "
                       "the average of --average-last)")
    group.add_argument("--best-mode", choices=("min", "max"), default="min")


def describe_recipes(parser: argparse.ArgumentParser, recipes: dict[str, dict[str, Any]]) -> None:
    """Say every recipe's value in the help of each option the recipes set, e.g. ``recipes={"on
    the CPU": {...}, "on CUDA": {...}}`` -> "(default: 3000 on the CPU, 20000 on CUDA)"."""
    names = set().union(*(recipe.keys() for recipe in recipes.values()))
    for action in parser._actions:
        if action.dest in names:
            defaults = ", ".join(f"{recipe[action.dest]} {when}".rstrip()
                                 for when, recipe in recipes.items())
            text = f"{action.help or ''} (default: {defaults})".lstrip(" ")
            # %% for argparse; the zero-width %(default) keeps it from adding "(default: None)"
            action.help = text.replace("%", "%%") + "%(default).0s"


def fill_unset(args: argparse.Namespace, recipe: dict[str, Any]) -> None:
    """Give each of ``recipe``'s settings that the command line left unset (None) its value. A
    recipe's cosine floor (``min_lr``) above a peak ``lr`` the command line set lower (``--lr 5e-5``
    to fine-tune) becomes ``lr`` times the recipe's floor-to-peak ratio: the rate decays as the
    recipe's does instead of climbing to the floor."""
    unset = [name for name in recipe if getattr(args, name, None) is None]
    for name in unset:
        setattr(args, name, recipe[name])
    if "min_lr" in unset and "lr" in recipe and "lr" not in unset and args.lr < args.min_lr:
        args.min_lr = args.lr * recipe["min_lr"] / recipe["lr"]


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """``["dropout=0.2", "activation=gelu"]`` -> {"dropout": 0.2, "activation": "gelu"}."""
    import dataclasses

    from aiayn.config import TransformerConfig

    known = {field.name for field in dataclasses.fields(TransformerConfig)}
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects FIELD=VALUE, got {item!r}")
        if key not in known:
            raise ValueError(f"--set: unknown model config field {key!r}")
        try:
            overrides[key] = json.loads(text)
        except json.JSONDecodeError:
            overrides[key] = text  # a bare word such as gelu
    return overrides


# T5 starts its embeddings, relative-position tables and an untied output matrix at N(0, 1), 10-20x
# the layers' matrices, for Adafactor, whose steps are relative to each weight's size; Adam's are
# not. 30 was chosen on the validation split (docs/t5.md: 1, 10, 30 and 100 compared).
EMBEDDING_LR_SCALE = 30.0


def add_embedding_lr_scale(group: argparse._ArgumentGroup) -> None:
    """``--embedding-lr-scale`` of the encoder-decoder commands (``embedding_lr_scales``)."""
    group.add_argument("--embedding-lr-scale", type=float, default=None, metavar="F",
                       help="learning-rate factor for the weights a T5-style model starts at unit "
                            "scale (token embeddings, relative-position tables, an untied output "
                            "matrix): Adam moves every weight by about the same step, so without "
                            f"it these learn 10-20x slower for their size (default "
                            f"{EMBEDDING_LR_SCALE:g} from scratch, 1 with --init; no effect on "
                            "models without T5's output scaling, such as mt-cpu)")


def embedding_lr_scales(args: argparse.Namespace, config=None) -> dict[str, float]:
    """``lr_scales`` for ``--embedding-lr-scale`` on the weights ``config`` (default: ``--preset``
    with ``--set``) starts at unit scale (``unit_scale_prefixes``: none unless the config rescales
    the output, as T5 does). Unset, the factor is ``EMBEDDING_LR_SCALE`` for a model trained from
    scratch and 1 for one fine-tuned from ``--init`` (its weights are no longer at their initial
    scale)."""
    import math

    from aiayn.config import TransformerConfig
    from aiayn.models.heads import unit_scale_prefixes

    scale = args.embedding_lr_scale
    if scale is None:
        scale = 1.0 if getattr(args, "init", None) else EMBEDDING_LR_SCALE
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"--embedding-lr-scale must be a positive number, got {scale}")
    if config is None:
        config = TransformerConfig.preset(args.preset, **parse_overrides(args.set))
    return {} if scale == 1 else dict.fromkeys(unit_scale_prefixes(config), float(scale))


# The options behind each TrainingConfig field a resume must keep (``training.run``).
SETTING_OPTIONS = {
    "optimizer": ("--optimizer",), "betas": ("--betas",), "eps": ("--adam-eps",),
    "weight_decay": ("--weight-decay",), "decay_matrices_only": ("--decay-matrices-only",),
    "schedule": ("--schedule", "--lr", "--lr-factor", "--warmup", "--min-lr"),
    "lr_scales": ("--embedding-lr-scale", "--head-lr-scale"), "accumulation": ("--accumulation",),
    "clip_norm": ("--clip-norm",), "seed": ("--seed",), "best_metric": ("--best-metric",),
    "best_mode": ("--best-mode",)}


def preset_defaults(args: argparse.Namespace) -> None:
    """Fill the options a task leaves to its preset's recipe (the task module's
    ``preset_defaults(args)``, if it has one: ``aiayn train lm``'s, whose ``make_task`` calls it
    too); options given stay."""
    fill = getattr(task_module(args.task), "preset_defaults", None)
    if fill is not None:
        fill(args)


def training_config_from_args(args: argparse.Namespace, d_model: int):
    from aiayn.training import Schedule, TrainingConfig
    from aiayn.training.devices import default_device
    from aiayn.training.precision import resolve_autocast

    preset_defaults(args)
    device = default_device(args.device)
    schedule = Schedule(kind=args.schedule, d_model=d_model, warmup=args.warmup,
                        factor=args.lr_factor, peak=args.lr, total=args.steps,
                        floor=args.min_lr if args.min_lr is not None else 0.0)
    best = None if args.best_metric in (None, "none") else args.best_metric
    return TrainingConfig(
        steps=args.steps, optimizer=args.optimizer, betas=tuple(args.betas), eps=args.adam_eps,
        weight_decay=args.weight_decay, decay_matrices_only=args.decay_matrices_only,
        schedule=schedule, lr_scales=getattr(args, "lr_scales", None) or {},
        accumulation=args.accumulation,
        clip_norm=args.clip_norm, autocast=resolve_autocast(args.autocast, device),
        eval_every=args.eval_every,
        save_every=args.save_every, log_every=args.log_every, keep_last=args.keep_last,
        average_last=args.average_last, best_metric=best, best_mode=args.best_mode,
        seed=args.seed, nonfinite=args.nonfinite, progress=not args.no_progress,
        device=args.device, distributed=args.distributed,
        activation_checkpointing=args.activation_checkpointing, compile=args.compile,
        time_limit=args.time_limit, tensorboard=args.tensorboard)


def run(args: argparse.Namespace) -> int:
    from aiayn.training.process_group import process_group_from_env

    out = Path(args.out)
    if out.exists() and not out.is_dir():  # before the data is read and tokenizers trained
        raise ValueError(f"--out {out} is a file, not a run directory")

    # Under torchrun: join the process group (and leave it even when training fails).
    with process_group_from_env(device=args.device, timeout_s=args.dist_timeout) as device:
        args.device = device
        return _train(args)


def _train(args: argparse.Namespace) -> int:
    import torch

    from aiayn.config import TransformerConfig
    from aiayn.training import train
    from aiayn.training.run import RUN_FILE, TrainingSettingsChanged, check_task
    from aiayn.training.process_group import is_rank_zero, world_size_from_env

    if args.threads:
        torch.set_num_threads(args.threads)
    module = task_module(args.task)
    # Reading the data may write into the run directory (a learned tokenizer, token files); a new
    # run directory is removed again when the data or the options turn out not to fit.
    new_run = not Path(args.out).exists()
    if (Path(args.out) / RUN_FILE).is_file():  # nothing is written into another task's run
        check_task(Path(args.out), args.task)
    try:
        task = module.make_task(args)
        model_config = task.model_config(
            TransformerConfig.preset(args.preset, **parse_overrides(args.set)))
        training = training_config_from_args(args, model_config.d_model)
        torch.manual_seed(args.seed)
        model = task.build_model(model_config)
    except BaseException:
        if new_run and Path(args.out).is_dir() and is_rank_zero():
            shutil.rmtree(args.out, ignore_errors=True)
        raise
    try:
        metrics = train(model, task, training, args.out, model_config=model_config,
                        resume=not args.no_resume)
    except TrainingSettingsChanged as error:  # name this command's options behind those fields
        options = sorted({option for field in error.fields
                          for option in SETTING_OPTIONS.get(field, ())
                          if hasattr(args, option[2:].replace("-", "_"))})
        if not options:
            raise
        raise ValueError(f"{error} (options: {', '.join(options)})") from None
    if world_size_from_env() <= 1 or os.environ.get("RANK", "0") == "0":  # rank 0 reports
        print(json.dumps({"task": args.task, "run_dir": str(args.out), **metrics}))
    return 0
