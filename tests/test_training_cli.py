"""The shared ``aiayn train`` / ``aiayn evaluate`` plumbing."""

import pytest

from aiayn.cli import main
from aiayn.commands.train import TASKS, parse_overrides


def test_tasks_registry_is_a_plain_dict_of_module_names():
    assert isinstance(TASKS, dict) and all(isinstance(v, str) for v in TASKS.values())


def test_train_help_exits_cleanly(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--help"])
    assert exit_info.value.code == 0
    assert "TASK" in capsys.readouterr().out


def test_model_overrides_parse_json_values_and_reject_unknown_fields():
    assert parse_overrides(["dropout=0.2", "activation=gelu", "n_heads=4"]) == {
        "dropout": 0.2, "activation": "gelu", "n_heads": 4}
    with pytest.raises(ValueError, match="unknown model config field 'widht'"):
        parse_overrides(["widht=3"])
    with pytest.raises(ValueError, match="FIELD=VALUE"):
        parse_overrides(["dropout"])


def test_evaluate_rejects_what_is_not_a_run(tmp_path, capsys):
    assert main(["evaluate", str(tmp_path / "missing"), "--data", "x.tsv"]) == 1
    assert "run directory not found" in capsys.readouterr().err
    assert main(["evaluate", str(tmp_path), "--data", "x.tsv"]) == 1
    assert "is not an aiayn run directory" in capsys.readouterr().err


TASK_ARGS = {"lm": ["--data", "x.txt"], "mlm": ["--data", "x.txt"], "classification": [],
             "image-classification": []}


def _schedule(task, *options):
    from aiayn.cli import build_parser
    from aiayn.commands.train import training_config_from_args

    args = build_parser().parse_args(["train", task, "--out", "run", "--device", "cpu",
                                      *TASK_ARGS[task], *options])
    if task == "classification":  # its recipe is filled where the task is made
        from aiayn.commands.train_classification import apply_recipe

        apply_recipe(args)
    return training_config_from_args(args, 128).schedule


@pytest.mark.parametrize("task", list(TASK_ARGS))
def test_a_peak_below_the_recipes_floor_scales_the_floor_so_the_rate_only_decays(task):
    """A fine-tuning --lr below the recipe's cosine floor: the floor keeps the recipe's ratio to
    the peak, so the rate never rises above --lr; a higher --lr keeps the recipe's floor, and a
    floor given above the peak is an error."""
    recipe = _schedule(task)
    assert 0 < recipe.floor < recipe.peak
    low = recipe.floor / 10
    schedule = _schedule(task, "--lr", str(low))
    assert (schedule.peak, schedule.floor) == (low, pytest.approx(low * recipe.floor / recipe.peak))
    rates = [schedule(step) for step in range(1, schedule.total + 1)]
    assert max(rates) == pytest.approx(low) and rates[-1] == pytest.approx(schedule.floor)
    assert _schedule(task, "--lr", str(recipe.peak * 2)).floor == recipe.floor
    assert _schedule(task, "--lr", str(low), "--min-lr", str(low / 2)).floor == low / 2
    with pytest.raises(ValueError, match="floor .* is above its peak"):
        _schedule(task, "--lr", str(low), "--min-lr", str(low * 2))


def test_translation_without_a_cosine_floor_has_floor_zero():
    from aiayn.cli import build_parser
    from aiayn.commands.train import training_config_from_args
    from aiayn.commands.train_translation import apply_recipe

    args = build_parser().parse_args(["train", "translation", "--data", "x.tsv", "--out", "run",
                                      "--device", "cpu", "--schedule", "warmup_cosine"])
    apply_recipe(args)  # the device's recipe, filled where the task is made
    assert training_config_from_args(args, 128).schedule.floor == 0.0
