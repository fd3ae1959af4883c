#!/usr/bin/env bash
# One command for a GPU machine: the fast-path test suite on the GPU, then the benchmarks.
#
#   bash bench/run_gpu.sh [OUTDIR]          # default OUTDIR: bench_out/
#
# Needs: a CUDA GPU, torch + triton 3.6, numpy, ml_dtypes, hypothesis, pytest (pytest-xdist used
# when present). DeepGEMM is optional: if .gpu/deep_gemm/install.sh exists it is built (~70 s) so
# that the cross-check against deep_gemm.utils runs (otherwise that test skips, saying why) and the
# benchmark includes DeepGEMM's own quantizer as a baseline.
# Environment: RUN_TESTS=0 / RUN_BENCH=0 skip a part; BENCH_ARGS adds benchmark flags (--quick ...).
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
  MOEREF_HYPOTHESIS_PROFILE=gpu python3 -m pytest property_tests/test_fastpath_quant.py -q -p no:randomly \
    -p no:cacheprovider $xdist -rs 2>&1 | tee "$OUTDIR/gpu_tests.log"
  status=${PIPESTATUS[0]}
fi
if [ "${RUN_BENCH:-1}" = 1 ]; then
  python3 bench/bench_quant_gpu.py --out "$OUTDIR" --baselines ${BENCH_ARGS:-} 2>&1 | tee "$OUTDIR/bench.log"
fi
exit $status
