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
