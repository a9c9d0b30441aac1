#!/usr/bin/env bash
# README command 2: install aiayn with its test extras and run the whole test suite (slow tests too).
set -euo pipefail
cd "$(dirname "$0")/.."
# The CPU wheel first: any other torch request can pull a multi-GB CUDA build.
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[dev]"
exec bash scripts/run_pytest.sh python3 "$@"
