import subprocess
import sys

import pytest

from aiayn.cli import main


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "demo" in capsys.readouterr().out


def test_python_dash_m_runs_the_same_cli():
    result = subprocess.run([sys.executable, "-m", "aiayn", "--version"], capture_output=True,
                            text=True, check=True)
    assert result.stdout.startswith("aiayn ")


def test_demo_runs_every_family(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "Transformer" in out and "SequenceClassifier" in out and "CausalLM" in out


def test_unknown_preset_is_a_clear_error(capsys):
    assert main(["demo", "--preset", "nope"]) == 1
    assert "unknown preset 'nope'" in capsys.readouterr().err


def test_no_command_prints_help_and_fails(capsys):
    assert main([]) == 2


def test_an_allocation_too_large_for_the_machine_is_a_one_line_error(capsys, monkeypatch):
    """As a huge --set max_length or --max-tokens gives: no traceback, the options to lower."""
    import argparse

    from aiayn import cli

    def allocate(args):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't "
                           "allocate memory: you tried to allocate 51200000000 bytes")

    parser = argparse.ArgumentParser()
    parser.set_defaults(run=allocate, command="train")
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert cli.main([]) == 1
    error = capsys.readouterr().err
    assert error.startswith("aiayn train: error: out of memory") and "--max-tokens" in error
    parser.set_defaults(run=lambda args: (_ for _ in ()).throw(RuntimeError("another failure")))
    with pytest.raises(RuntimeError, match="another failure"):  # not every RuntimeError
        cli.main([])
