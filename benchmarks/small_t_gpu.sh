#!/usr/bin/env bash
# Decode-size (small T) measurements of the graph kernels on one H200, ~6 minutes:
#   1. GPU tests of the BMM in-kernel quantization path (T = 1, 5: unpadded a; 70, 256), bitwise vs the pre-pass;
#   2. quantize_and_bmm_fp8 at T = 1, 8: DeepSeek W_UK with TuningConfig variants, the other shapes at defaults and stages=2;
#   3. the rope kernel's small-T plan (benchmarks/rope_sweep_gpu.py small_t): where "auto" should start, and the
#      warpgroup count at small T.
# Usage (repo root): PYTHONPATH=. bash benchmarks/small_t_gpu.sh    -> logs and JSON in ${OUT:-results}
set -u
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
START=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - START )) s] $*"; }
quiet() { grep -v "^W0\|^I0\|^ *$"; }

stamp "BMM GPU tests (in-kernel quantization, bitwise vs the pre-pass)"
timeout 150 python3 -m pytest -q -x tests/test_bmm_fp8_kernel_gpu.py -k "bitwise or partial" > "$OUT/bmm_tests.log" 2>&1
echo "pytest exit code: $? (124 = timed out)"; tail -n 3 "$OUT/bmm_tests.log"

stamp "BMM, DeepSeek W_UK, T = 1, 8: variants"
timeout 150 python3 benchmarks/bmm_small_t_gpu.py --tokens 1,8 --shapes 0 \
  --variants "stages=2;stages=8;a_buffers=1;max_ctas=128" 2>&1 | quiet | tee "$OUT/bmm_small_t.log"
stamp "BMM, other shapes, T = 1, 8: defaults"
timeout 100 python3 benchmarks/bmm_small_t_gpu.py --tokens 1,8 --shapes 1,2,3 --variants "stages=2" 2>&1 | quiet \
  | tee -a "$OUT/bmm_small_t.log"

stamp "rope small-T plan"
ROPE_V3_DEADLINE=$(( $(date +%s) + 170 )) timeout 200 python3 benchmarks/rope_sweep_gpu.py "$OUT" small_t 2>&1 \
  | quiet | tee "$OUT/rope_small_t.log"
stamp "done"
