#!/usr/bin/env bash
# Opt-in variants written on the CPU (interpret mode + sm_90 lowering), checked and timed on one H200 in one call
# (~8 minutes; each step under its own timeout). Last run 2026-11-30 (benchmarks/RESULTS.md v6, v2e, unique_slots):
# all three passed and are now defaults where they measured faster; kept to re-check them together:
#   1. sparse decode head_axis="n" (H <= 32): GPU tests, then (b) and H = 16 beside the default and XLA, with
#      ablations (benchmarks/heads_on_n_gpu.sh);
#   2. BMM sub_n=2 (64 x 512 CTA tiles): GPU tests (bitwise the default), then T = 1, 8 for the N = 512 shapes
#      beside XLA;
#   3. fused rope unique_slots=True: GPU tests, then timed against the duplicate-slot scan (rope_sweep_gpu.py).
# Usage (repo root): PYTHONPATH=. bash benchmarks/untested_variants_gpu.sh    -> logs and JSON in ${OUT:-results}
set -u
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
quiet() { grep -v "^W0\|^I0\|^ *$"; }
echo "== 1. sparse decode head_axis=n"
bash benchmarks/heads_on_n_gpu.sh
echo "== 2. BMM sub_n=2"
timeout 150 python3 -m pytest -q tests/test_bmm_fp8_kernel_gpu.py -k sub_tiles > "$OUT/bmm_sub_n_tests.log" 2>&1
echo "GPU tests exit code: $?"; tail -n 2 "$OUT/bmm_sub_n_tests.log"
timeout 120 python3 benchmarks/bmm_small_t_gpu.py --tokens 1,8 --shapes 0,2 --variants "sub_n=2;sub_n=2+stages=3" \
  2>&1 | quiet | tee "$OUT/bmm_sub_n.log"
echo "== 3. rope unique_slots"
timeout 120 python3 -m pytest -q tests/test_rope_rmsnorm_kernel_gpu.py -k unique_slots > "$OUT/rope_unique_tests.log" 2>&1
echo "GPU tests exit code: $?"; tail -n 2 "$OUT/rope_unique_tests.log"
ROPE_V3_DEADLINE=$(( $(date +%s) + 120 )) timeout 150 python3 benchmarks/rope_sweep_gpu.py "$OUT" unique 2>&1 \
  | quiet | tee "$OUT/rope_unique.log"
