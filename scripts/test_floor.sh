#!/usr/bin/env bash
# The test suite on the oldest versions aiayn declares: Python 3.10, torch 2.4, transformers 4.40
# (with the tokenizers it pins), numpy 1.x, in a virtual environment of its own (.venv-floor/,
# about 5 GB: PyPI's torch 2.4 is a CUDA build). Not part of CI, which runs scripts/test.sh on
# torch 2.13; run it when a change uses a PyTorch or transformers API that may be new.
#   bash scripts/test_floor.sh [pytest arguments]     e.g. -q -n 2 -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
# The oldest Python there is, 3.10 if any (pyenv's too); FLOOR_PYTHON picks one.
python=${FLOOR_PYTHON:-}
if [ -z "$python" ]; then
  for candidate in python3.10 $(ls -d "$(pyenv root 2>/dev/null)"/versions/3.10*/bin/python3 \
                                 2>/dev/null) python3; do
    if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))' 2>/dev/null; then
      python=$candidate
      break
    fi
  done
  python=${python:-python3}
fi
if [ ! -x .venv-floor/bin/python ]; then
  "$python" -m venv .venv-floor
fi
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
printf 'torch==2.4.1\ntransformers==4.40.2\nnumpy<2\n' > "$constraints"
.venv-floor/bin/python -m pip install -q -c "$constraints" -e ".[dev]"
.venv-floor/bin/python -c 'import sys, torch, transformers, tokenizers
print(f"floor: Python {sys.version.split()[0]}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, tokenizers {tokenizers.__version__}")'
exec bash scripts/run_pytest.sh .venv-floor/bin/python "$@"
