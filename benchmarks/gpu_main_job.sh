#!/usr/bin/env bash
# The README's main job on a GPU: `aiayn train translation` with its defaults (on CUDA its CUDA
# recipe, src/aiayn/commands/train_translation.py) and any EXTRA options on the bundled corpus for
# SECONDS of training (the README's job: 540), then test BLEU with greedy search and with beam 4;
# prints one JSON line each. On an H200 the training part took 555 s of a 600-s device call: give
# the call its whole limit (benchmarks/results/gpu/main_job.json). Runs from the repository root
# with the source tree on PYTHONPATH (no install: the device machine has torch, tokenizers and
# sacrebleu, and no network).
#
#     bash benchmarks/gpu_main_job.sh [SECONDS [RUN_DIR [EXTRA...]]]   # 540, /tmp/aiayn-gpu-main-job
set -euo pipefail
seconds=${1:-540}
run=${2:-/tmp/aiayn-gpu-main-job}
shift $(( $# < 2 ? $# : 2 ))
data=data/ddtp_en_de.tsv.gz
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
rm -rf "$run"
start=$(date +%s)
python3 -m aiayn train translation --data "$data" --out "$run" --time-limit "$seconds" --no-progress "$@"
echo "training took $(( $(date +%s) - start )) s"
python3 -m aiayn evaluate "$run" --data "$data" --split test --beam 1 --device cuda
python3 -m aiayn evaluate "$run" --data "$data" --split test --beam 4 --alpha 0.6 --device cuda
tail -n 3 "$run/log.jsonl"
