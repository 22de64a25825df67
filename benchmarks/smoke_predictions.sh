#!/usr/bin/env bash
# Eval smoke runs whose predictions must not change across a refactor: records and NQ, every
# method, --trials 2 --limit 6 (and, with ENGINE=vllm, the methods vLLM serves).
# Usage: benchmarks/smoke_predictions.sh OUT_DIR [python]; compare two OUT_DIRs with
# python -m benchmarks.compare_predictions OLD NEW. EXTRA adds arguments to every run (since 0.3,
# vLLM serves an approximate realisation only when asked: EXTRA=--approximate ENGINE=vllm).
set -euo pipefail
out=${1:?usage: smoke_predictions.sh OUT_DIR [python]}
py=${2:-.venv/bin/python}
engine=${ENGINE:-transformers}
if [ "$engine" = vllm ]; then
  methods=none,oracle,auto,reread
else
  methods=none,closedbook,gold_only,repeat,oracle,auto,reread,blend,snapkv,quantize,select,minicache
fi
for task in records nq; do
  "$py" -m kvedit eval litm --task "$task" --methods "$methods" --trials 2 --limit 6 \
    --engine "$engine" --no-progress --out "$out/$task-$engine" ${EXTRA:-}
done
