#!/usr/bin/env bash
# Expert parallelism on N GPUs of one host (issue 34), NCCL with NVLink multicast off; each step has a
# 5-minute limit:
#   1. the EP property suites on the nccl-N world (device engine vs NumPy engine, the DeepEP contracts, the
#      layer's bit-identity, EP shards of fastpath.moe), Hypothesis profile $PROFILE (default dev: 60 examples);
#   2. tests/test_distributed_nccl.py (the layer on 1..N NCCL ranks, validation with a planted fault, the
#      benchmark's smoke run);
#   3. bench/bench_ep_gpu.py under torchrun -> docs/data/ep_nccl<N>_<date>.json, then the docs tables.
#
#   bash bench/run_ep_gpu.sh 2        # or 4; OUTDIR (logs) as the second argument, default bench_out/
set -uo pipefail
cd "$(dirname "$0")/.."
N="${1:?give the number of GPUs (2 or 4)}"
OUTDIR="${2:-bench_out}"
mkdir -p "$OUTDIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 -c "import torch; n = torch.cuda.device_count(); assert n >= $N, f'{n} GPUs, {$N} needed'" || exit 1
status=0
MOEREF_EP_BACKENDS="nccl-$N" MOEREF_HYPOTHESIS_PROFILE="${PROFILE:-dev}" timeout 300 python3 -m pytest -p no:xdist -q -rs \
  property_tests/test_ep_device_engine_props.py property_tests/test_distributed_props.py 2>&1 | tee "$OUTDIR/ep_props_nccl$N.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
timeout 300 python3 -m pytest -p no:xdist -q -rs tests/test_distributed_nccl.py 2>&1 | tee "$OUTDIR/ep_nccl_tests_$N.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
out="docs/data/ep_nccl${N}_$(date -u +%Y-%m-%d).json"
timeout 300 torchrun --nproc-per-node "$N" bench/bench_ep_gpu.py --out "$out" 2>&1 | tee "$OUTDIR/ep_bench_$N.log"
if [ "${PIPESTATUS[0]}" = 0 ]; then
  python3 bench/report_ep.py || status=1   # rewrites the tables of docs/expert-parallel.md, docs/performance.md
else
  status=1
fi
exit $status
