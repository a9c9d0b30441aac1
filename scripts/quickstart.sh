#!/usr/bin/env bash
# README command 1 (the main job): install aiayn, train the default English->German Transformer on
# the bundled Debian DDTP corpus (about 10 minutes on 2 CPU cores), then print its test BLEU with
# greedy and beam search and a few translations. Re-running resumes / reuses runs/quickstart.
set -euo pipefail
cd "$(dirname "$0")/.."
# The pinned torch first (this project's machines serve a local CPU wheel). PyPI's Linux wheel is
# the CUDA build (GBs): for a CPU-only machine, install the CPU wheel before running this (it
# satisfies the pin): pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[translation]"
# PRESET=t5-cpu trains T5's blocks at the same size instead of the paper's model (docs/translation.md).
PRESET=${PRESET:-mt-cpu}
if [ "$PRESET" = mt-cpu ]; then RUN=${RUN:-runs/quickstart}; else RUN=${RUN:-runs/quickstart-$PRESET}; fi
DATA=data/ddtp_en_de.tsv.gz
# Training stops at 3000 steps or after 9 minutes, whichever comes first.
aiayn train translation --data "$DATA" --out "$RUN" --preset "$PRESET" --time-limit 540 --threads 2
# The scores and translations are also kept in $RUN/quickstart-results.txt (docs/translation.md
# quotes such files).
{
echo "== test BLEU, greedy"
aiayn evaluate "$RUN" --data "$DATA" --split test --beam 1 --threads 2
echo "== test BLEU, beam 4, alpha 0.6"
aiayn evaluate "$RUN" --data "$DATA" --split test --beam 4 --alpha 0.6 --threads 2
echo "== a few translations (beam 4)"
SENTENCES=$(printf '%s\n' \
  "This package contains the documentation." \
  "A simple tool to convert images between different formats." \
  "This is a transitional dummy package. It can safely be removed." \
  "The library is written in C and has no dependencies.")
echo "$SENTENCES" | aiayn translate "$RUN" --threads 2 | paste <(echo "$SENTENCES") - \
  | sed 's/\t/\n    => /'
} | tee "$RUN/quickstart-results.txt"
