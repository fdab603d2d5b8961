#!/usr/bin/env bash
# After a change of default configs (rope small-T / deep-ring rules, BMM T < 8 paths), on 2 H200s, ~5 minutes:
#   GPU 0: rope GPU tests, BMM GPU tests (T = 1, 5 unpadded, swizzled output; partial tiles), then the default
#          configs timed beside XLA (benchmarks/rope_sweep_gpu.py defaults; bmm_small_t_gpu.py at T = 1, 8);
#   GPU 1: the full sparse-decode GPU grid, slow cases included (every H x s_q).
# Usage (repo root, nvidia-h200-x2): PYTHONPATH=. bash benchmarks/defaults_check_gpu.sh -> logs in ${OUT:-results}
set -u
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.} XLA_PYTHON_CLIENT_PREALLOCATE=false
quiet() { grep -v "^W0\|^I0\|^ *$"; }
(CUDA_VISIBLE_DEVICES=1 MLA_PALLAS_SLOW=1 timeout 420 python3 -m pytest -q tests/test_sparse_decode_gpu.py \
   > "$OUT/sparse_gpu_slow.log" 2>&1; echo "sparse slow grid exit code: $?" >> "$OUT/sparse_gpu_slow.log") &
export CUDA_VISIBLE_DEVICES=0
timeout 150 python3 -m pytest -q -x tests/test_rope_rmsnorm_kernel_gpu.py -k "not bandwidth" > "$OUT/rope_tests.log" 2>&1
echo "rope GPU tests exit code: $?"; tail -n 2 "$OUT/rope_tests.log"
timeout 120 python3 -m pytest -q -x tests/test_bmm_fp8_kernel_gpu.py \
  -k "bitwise or partial or jit or matches_reference[1-" > "$OUT/bmm_tests.log" 2>&1
echo "bmm GPU tests exit code: $?"; tail -n 2 "$OUT/bmm_tests.log"
timeout 100 python3 benchmarks/bmm_small_t_gpu.py --tokens 1,8 --variants default 2>&1 | quiet | tee "$OUT/bmm.log"
ROPE_V3_DEADLINE=$(( $(date +%s) + 100 )) timeout 130 python3 benchmarks/rope_sweep_gpu.py "$OUT" defaults 2>&1 \
  | quiet | tee "$OUT/rope_defaults.log"
wait
tail -n 4 "$OUT/sparse_gpu_slow.log"
