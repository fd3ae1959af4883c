#!/usr/bin/env bash
# One command for a GPU machine: the whole test suite on the GPU (the `gpu` tests run for real,
# the Hypothesis profile `gpu` draws more and larger examples), then the fast-path benchmarks.
#
#   bash bench/run_gpu.sh [OUTDIR]          # default OUTDIR: bench_out/
#
# Needs: a CUDA GPU, torch + triton 3.6, numpy, ml_dtypes, hypothesis, pytest (pytest-xdist used
# when present), rich. DeepGEMM is optional: if .gpu/deep_gemm/install.sh exists it is built
# (~70 s) so that the cross-check against deep_gemm.utils runs (otherwise that test skips, saying
# why) and the benchmark includes DeepGEMM's own quantizer as a baseline.
# Environment: RUN_TESTS=0 / RUN_BENCH=0 skip a part; TESTS picks test paths (default: all);
# BENCH_ARGS adds quantization-benchmark flags (--quick ...).
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${1:-bench_out}"
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python3 -c 'import torch; assert torch.cuda.is_available(), "no CUDA GPU"; print("GPU:", torch.cuda.get_device_name())' || exit 1
if [ -f .gpu/deep_gemm/install.sh ] && [ "${SKIP_DEEP_GEMM:-0}" != 1 ]; then
  # shellcheck disable=SC1091
  source .gpu/deep_gemm/install.sh || echo "deep_gemm build failed; its cross-check will skip"
fi
status=0
if [ "${RUN_TESTS:-1}" = 1 ]; then
  xdist=""
  python3 -c 'import xdist' 2>/dev/null && xdist="-n ${PYTEST_WORKERS:-8}"
  # the production-shape layers hold ~20 GiB of weights per process: their file runs apart, 3 processes
  # (8 run out of memory on a 141 GB H200; 3 take 82 s there)
  prod=property_tests/test_fastpath_moe_production.py
  # shellcheck disable=SC2086
  MOEREF_HYPOTHESIS_PROFILE=gpu python3 -m pytest ${TESTS:-} --ignore "$prod" -q \
    -p no:cacheprovider $xdist -rs 2>&1 | tee "$OUTDIR/gpu_tests.log"
  status=${PIPESTATUS[0]}
  if [ -z "${TESTS:-}" ] || [[ " ${TESTS} " == *"$prod"* ]]; then
    xdist3=""
    [ -n "$xdist" ] && xdist3="-n 3"
    # shellcheck disable=SC2086
    MOEREF_HYPOTHESIS_PROFILE=gpu python3 -m pytest "$prod" -q -p no:cacheprovider $xdist3 -rs \
      2>&1 | tee "$OUTDIR/gpu_tests_production.log"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  fi
fi
if [ "${RUN_BENCH:-1}" = 1 ]; then
  # shellcheck disable=SC2086
  python3 bench/bench_quant_gpu.py --out "$OUTDIR" --baselines --ceiling ${BENCH_ARGS:-} 2>&1 | tee "$OUTDIR/bench_quant.log"
  python3 bench/bench_dispatch_gpu.py --out "$OUTDIR" 2>&1 | tee "$OUTDIR/bench_dispatch.log"
fi
exit $status
