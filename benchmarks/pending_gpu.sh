#!/usr/bin/env bash
# Everything written on the CPU and not yet run on a GPU (2026-12-02: issues 20-24), in one device call:
#
#   bash benchmarks/pending_gpu.sh tests  [OUT]   # the pending GPU tests, each group under a timeout (deadlock = rc 124)
#   bash benchmarks/pending_gpu.sh bench  [OUT]   # the benches that decide the defaults (CUPTI, beside XLA / cuDNN)
#   bash benchmarks/pending_gpu.sh latency [OUT]  # issue 24's latency shapes; each JSON keeps the per-kernel
#                                                 # CUPTI breakdown (results[].kernels)
#
# Then flip what passed: sparse_decode.BF16_VALIDATED_HEADS (+16, 8), dense_decode.PAGE_LOADER_VALIDATED_ON,
# rope_rmsnorm._BF16_PAGES_VALIDATED_ON, prefill._KERNEL_VALIDATED_ON (only where measured faster than cuDNN),
# and record the numbers (RESULTS.md, CURRENT.md; predictions in docs/kernels/*.md, "Waiting for the GPU").
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WHAT=${1:-tests}
OUT=${2:-results/pending}
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD
mkdir -p "$OUT"
run() {   # name, timeout seconds, command...
  local name=$1 t=$2; shift 2
  echo "## $name"
  timeout "$t" "$@" 2>&1 | grep -v "^[WI]0000" | tee "$OUT/$name.txt" | tail -n 25
  echo "## $name: rc ${PIPESTATUS[0]}"
}
if [[ $WHAT == tests ]]; then
  T="$PY -m pytest -q -m gpu -p no:cacheprovider -s"
  run prefill_kernel 240 $T tests/test_prefill_kernel_gpu.py tests/test_prefill_gpu.py -k "kernel or separate"
  run batch_invariance 240 $T tests/test_batch_invariance_gpu.py
  run dense_page_loader 200 $T tests/test_dense_decode_gpu.py
  run rope_bf16_write 120 $T tests/test_rope_rmsnorm_kernel_gpu.py -k bf16
  run sparse_pv_pair_bf16 240 $T tests/test_sparse_decode_gpu.py -k "pv_pair or bf16"
elif [[ $WHAT == bench ]]; then
  B="$PY -m mla_pallas.cli bench"
  run prefill_deepseek 300 $B mla_prefill --impl all --sweep --preset deepseek_v32 --no-plot --no-progress --out "$OUT"
  run prefill_glm5 200 $B mla_prefill --impl all --preset glm5 --no-plot --no-progress --out "$OUT"
  run prefill_ctx 300 $B mla_prefill --impl xla,mosaic,f32 --shape ctx=4096 --no-plot --no-progress --out "$OUT"
  run prefill_step 300 $B mla_prefill_step --impl xla,auto --no-check --no-plot --no-progress --out "$OUT"
  run prefill_step_ctx 300 $B mla_prefill_step --impl xla,auto --no-check --shape ctx=4096 --no-plot --no-progress \
    --out "$OUT"
  for inv in 0 1; do
    run "invariant${inv}_P1" 200 $B sparse_mla_decode --impl mosaic \
      --shape B=128,s_q=2,H=128,topk=2048,page=64,ctx=32768,invariant=$inv --no-plot --no-progress --out "$OUT"
    run "invariant${inv}_B8" 200 $B sparse_mla_decode --impl mosaic \
      --shape B=8,s_q=1,H=128,topk=2048,page=64,ctx=32768,invariant=$inv --no-plot --no-progress --out "$OUT"
  done
  run dense_D1 200 $B dense_mla_decode --impl all --shape B=128,s_q=1,H=128,ctx=4096,page=64 --no-plot \
    --no-progress --out "$OUT"
elif [[ $WHAT == latency ]]; then
  B="$PY -m mla_pallas.cli bench"
  common=(--no-plot --no-progress --out "$OUT")
  for h in 8 16 128; do
    for bs in "1 1" "8 1" "8 4" "4 6"; do
      read -r b sq <<<"$bs"
      run "sparse_B${b}_sq${sq}_H${h}" 120 $B sparse_mla_decode --impl xla,mosaic \
        --shape B=$b,s_q=$sq,H=$h,topk=2048,page=64,ctx=32768 "${common[@]}"
    done
  done
  for b in 1 8; do
    run "dense_B${b}_H16" 120 $B dense_mla_decode --impl xla,mosaic --shape B=$b,s_q=1,H=16,ctx=8192,page=64 \
      "${common[@]}"
    run "step_deepseek_B${b}" 120 $B mla_decode_step --impl all --shape model=deepseek_v32,B=$b,s_q=1 "${common[@]}"
    run "step_glm5_tp8_B${b}" 120 $B mla_decode_step --impl all --shape model=glm5,B=$b,s_q=1,tp=8 "${common[@]}"
    run "step_deepseek_tp8_B${b}" 120 $B mla_decode_step --impl all --shape model=deepseek_v32,B=$b,s_q=1,tp=8 \
      "${common[@]}"
  done
else
  echo "usage: $0 tests|bench|latency [OUT]" >&2
  exit 2
fi
