#!/usr/bin/env bash
# The rope/rmsnorm kernel v3 (mla_pallas/kernels/rope_rmsnorm.py) on one H200, in one run of ~6 minutes:
#   1. correctness: tests/test_rope_rmsnorm_kernel_gpu.py (default grid and every TuningConfig knob);
#   2. the bench CLI at the issue-4 shapes (XLA, mosaic, and a device copy of the same bytes: "% copy BW");
#   3. a sweep of TuningConfig variants per shape (op time, kernel-only time, the pre-pass; CUPTI, cache donated as
#      in the bench), each variant checked against the XLA path, plus the two forms of the duplicate-slot pre-pass.
# Usage (repo root): PYTHONPATH=. bash benchmarks/rope_v3_gpu.sh    -> logs and JSON in ${OUT:-results}
# Steps run under timeouts; the sweep stops at the time budget (ROPE_V3_BUDGET_S, default 330 s from the start),
# printing what it measured so far; the last three CLI runs only run if the budget leaves time for them.
set -u
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
START=$(date +%s)
BUDGET=${ROPE_V3_BUDGET_S:-330}
left() { echo $(( BUDGET - ($(date +%s) - START) )); }
stamp() { echo "== [$(( $(date +%s) - START )) s] $*"; }

stamp "GPU tests (correctness)"
timeout 150 python3 -m pytest -q -x -s tests/test_rope_rmsnorm_kernel_gpu.py -k "not bandwidth" \
  > "$OUT/rope_v3_tests.log" 2>&1
rc=$?
echo "pytest exit code: $rc (124 = timed out)"
grep -E "one step off|passed|failed|error|Error" "$OUT/rope_v3_tests.log" | tail -n 45
if [ $rc -ne 0 ]; then grep -v "^ *$" "$OUT/rope_v3_tests.log" | tail -n 40; fi

B="python3 -m mla_pallas.cli bench --no-progress --no-plot --out $OUT"
bench() {   # bench OP SHAPE: one CLI run (JSON in $OUT) if the budget leaves room for it
  if [ "$(left)" -lt "$2" ]; then stamp "skipped (time budget): bench $1"; return; fi
  stamp "bench $1 --impl all"
  timeout 60 $B $1 --impl all 2>&1 | tee -a "$OUT/rope_v3_bench.log" | grep -v "^ *$" | tail -n 8
}
bench "fused_rope_rmsnorm_quantization --shape T=4096,H=128" 150
bench "fused_rope_rmsnorm_quantization --shape T=128,H=128" 150

stamp "TuningConfig sweep (stops at the budget)"
SWEEP_S=$(( $(left) > 30 ? $(left) : 30 ))
ROPE_V3_DEADLINE=$(( START + BUDGET - 15 )) timeout $SWEEP_S python3 benchmarks/rope_sweep_gpu.py "$OUT" v3 2>&1 \
  | tee "$OUT/rope_v3_sweep.log" | grep -v "^W0\|^I0\|^ *$"
# The remaining CLI runs, as long as the budget allows (the sweep above timed these shapes' defaults already).
bench "fused_rope_rmsnorm_quantization --shape T=8192,H=16" 35
bench "rope_rmsnorm --shape T=4096,H=128" 35
bench "fused_rope_rmsnorm_quantization --shape T=1,H=128" 35
stamp "done (logs: $OUT/rope_v3_tests.log, $OUT/rope_v3_bench.log, $OUT/rope_v3_sweep.log)"
