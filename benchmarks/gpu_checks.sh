#!/usr/bin/env bash
# Everything a lent GPU is for, as one device call (at most 9.9 minutes: give the call 600 s): the
# device tests (tests/test_devices.py), where a training step's time goes (benchmarks/gpu_profile.py:
# the chunked loss's paths, their gradients against each other and against float32) and the issue's
# GPU rows (benchmarks/gpu.py --compile; at 6 rounds its four rows took ~520 s on an H200, so 4).
# Runs from the repository root with the source tree on PYTHONPATH (no install: the device machine
# has torch and transformers, and no network).
#
#     bash benchmarks/gpu_checks.sh [OUTPUT_FOLDER]      # default benchmarks/results
#     AIAYN_DEVICE=cpu bash benchmarks/gpu_checks.sh /tmp/x   # small shapes on the CPU: checks the script
#
# Each step has its own time limit, so a hung or slow step leaves the later ones their time; every
# step writes its output as it goes (a cut-short run keeps what it measured).
set -uo pipefail
out=${1:-benchmarks/results}
device=${AIAYN_DEVICE:-cuda}
shapes=()
[ "$device" = cpu ] && shapes=(--tiny)
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv 2>/dev/null
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
status=0
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_devices.py 2>&1 | tee "$out/gpu_tests.txt" || status=1
timeout 100 python3 benchmarks/gpu_profile.py --device "$device" "${shapes[@]}" \
    --out "$out/gpu_profile.txt" > "$out/gpu_profile.log" 2>&1 || status=1
grep -v '^USDT' "$out/gpu_profile.log" | head -12
timeout 420 python3 benchmarks/gpu.py --device "$device" "${shapes[@]}" --compile --rounds 4 --row-budget-s 30 \
    --out "$out/results_gpu.json" 2>&1 | tee "$out/gpu.txt" || status=1
exit $status
