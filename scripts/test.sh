#!/usr/bin/env bash
# README command 2: install aiayn with its test extras and run the whole test suite (slow tests too).
set -euo pipefail
cd "$(dirname "$0")/.."
# The pinned torch first (this project's machines serve a local CPU wheel). PyPI's Linux wheel is
# the CUDA build (GBs): for a CPU-only machine, install the CPU wheel before running this (it
# satisfies the pin): pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[dev]"
# Two pytest-xdist workers (a third less wall time on 2 cores than one process); later arguments
# win: `bash scripts/test.sh -n 0` runs in one process.
exec bash scripts/run_pytest.sh python3 -n 2 --dist loadgroup "$@"
