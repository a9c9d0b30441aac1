#!/usr/bin/env bash
# Everything a lent GPU is for, as one device call (at most 565 s of steps; give the call 590 s): the device
# tests (tests/test_devices.py on CUDA), then benchmarks/gpu.py's rows, most important first, each
# step under its own time limit and writing its own results as it goes (a step cut short, or a
# failing one, leaves the later steps their time and the earlier results on disk).
# Runs from the repository root with the source tree on PYTHONPATH (no install: the device machine
# has torch and transformers, and no network).
#
#     bash benchmarks/gpu_checks.sh [OUTPUT_FOLDER]            # default benchmarks/results/gpu
#     AIAYN_DEVICE=cpu bash benchmarks/gpu_checks.sh /tmp/x    # tiny shapes on the CPU: checks the script
set -uo pipefail
out=${1:-benchmarks/results/gpu}
device=${AIAYN_DEVICE:-cuda}
shapes=()
[ "$device" = cpu ] && shapes=(--tiny)
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv 2>/dev/null
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
status=0
step() {  # step NAME SECONDS COMMAND...: run it under its limit, its output in $out/NAME.txt
    local name=$1 limit=$2
    shift 2
    echo "== $name (at most ${limit} s)"
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1 || { status=1; echo "   failed or timed out"; }
    grep -v -i 'warn' "$out/$name.txt" | tail -n 12
}
bench() {  # bench NAME SECONDS ROWS... [--profile]: benchmarks/gpu.py, JSON in $out/NAME.json
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" python3 benchmarks/gpu.py --device "$device" "${shapes[@]}" \
        --rounds 6 --row-budget-s 20 --out "$out/$name.json" --only "$@"
}
# Limits from the last runs: on an H100 lm_train took 69 s, greedy1 86 s and greedy8 + sample8
# 108 s, the three others 79 s; on an H200 the device tests took 42 s and the beam row alone 59 s.
# Each row also profiles its sides (--profile: the top kernels; for lm_train, where the eager
# step loses time to nanoGPT's, for the decoding rows what bounds a token).
bench lm_train 110 lm_train --profile
bench decoding 220 greedy1 greedy8 sample8 --profile
step device_tests 95 python3 -m pytest -q -p no:cacheprovider -x tests/test_devices.py
bench others 130 seq2seq_train beam greedy_mt encoder --profile
exit $status
