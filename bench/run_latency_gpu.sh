#!/usr/bin/env bash
# The decode-latency benchmark, then the CUDA-graph capture tests, on a GPU machine (issue 20):
#   bash bench/run_latency_gpu.sh OUTDIR [LABEL]
# OUTDIR gets bench_latency.json / .log and graph_tests.log. BENCH_ARGS adds benchmark flags.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-bench_out}"; LABEL="${2:-}"
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu,utilization.gpu --format=csv
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-260}" python3 bench/bench_latency_gpu.py --out "$OUTDIR" --label "$LABEL" ${BENCH_ARGS:-} \
  2>&1 | tee "$OUTDIR/bench_latency.log"
timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -p no:cacheprovider -rs tests/test_fastpath_graph_capture_gpu.py \
  tests/test_fastpath_masked_nosync.py ${TESTS:-} 2>&1 | tail -40 | tee "$OUTDIR/graph_tests.log"
