#!/usr/bin/env bash
# The sparse kernels' sweep (every candidate of ops.sparse_decode.sweep_configs, each checked against the
# reference) at the peer kit's shapes, one `mla-pallas bench --sweep` per case. GPU only.
#
#   bash benchmarks/sparse_sweeps_gpu.sh [CASES] [OUT]     # CASES: comma-separated, default P1,P4,P5,C0,P3,F1
#   ONLY=schedule bash benchmarks/sparse_sweeps_gpu.sh P1,F1  # only the default and candidates matching ONLY
#
# Case shapes: ../shared/peers (C0 and P1-P5 sparse decode, F1 sparse prefill). Writes one JSON and table per case
# under OUT (default results/sweeps); timings are CUPTI medians of 20 calls over input sets rotated past L2.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
CASES=${1:-P1,P4,P5,C0,P3,F1}
OUT=${2:-results/sweeps}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
declare -A SHAPE=(
  [C0]="sparse_mla_decode B=8,s_q=2,H=128,topk=2048,page=64,ctx=4096"
  [P1]="sparse_mla_decode B=128,s_q=2,H=128,topk=2048,page=64,ctx=32768"
  [P2]="sparse_mla_decode B=128,s_q=4,H=8,topk=2048,page=64,ctx=32768"
  [P3]="sparse_mla_decode B=64,s_q=1,H=64,topk=2048,page=64,ctx=32768"
  [P4]="sparse_mla_decode B=128,s_q=1,H=64,topk=2048,page=64,ctx=32768"
  [P5]="sparse_mla_decode B=148,s_q=2,H=128,topk=16384,page=64,ctx=32768"
  [F1]="sparse_mla_prefill T=4096,H=128,topk=2048,page=64,ctx=8192"
)
for c in ${CASES//,/ }; do
  read -r op shape <<<"${SHAPE[$c]:?unknown case $c (one of ${!SHAPE[*]})}"
  echo "## $c: $op $shape"
  PYTHONPATH=$PWD "$PY" -m mla_pallas.cli bench "$op" --impl mosaic --sweep --shape "$shape" --no-plot \
    --no-progress ${ONLY:+--sweep-only "$ONLY"} --out "$OUT/$c" 2>&1 | grep -v "^[WI]0000" | tee "$OUT/$c.txt"
done
