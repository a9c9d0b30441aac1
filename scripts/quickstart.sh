#!/usr/bin/env bash
# README command 1: install aiayn, then run the main job on bundled data.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[dev]"
aiayn demo
