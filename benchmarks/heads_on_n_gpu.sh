#!/usr/bin/env bash
# The sparse-decode kernel's head_axis="n" arrangement (H <= 32: heads on the MMAs' N side; the op's default for
# H <= 16 with 3 K buffers since 2026-11-30, benchmarks/RESULTS.md v6) on one H200, ~4 min:
#   1. GPU tests: tests/test_sparse_decode_gpu.py -k "heads_on or head_axes" (NaN rows, invalid/duplicate indices, an all-invalid
#      row, odd top-k, determinism; against the float32 reference, beside the XLA path);
#   2. (b) GLM-5 TP-8 (B 128, s_q 4, H 8, top-k 2048) and B 128 s_q 2 H 16 (case h16), the default (head_axis=n) vs head_axis=m, beside XLA, and
#      head_axis=n ablations (no QK / no V upcast / loader alone) to place its time.
# The rule for the default is HEADS_ON_N_MAX / _default_tuning in mla_pallas/ops/sparse_decode.py.
# Usage (repo root): PYTHONPATH=. bash benchmarks/heads_on_n_gpu.sh    -> logs and JSON in ${OUT:-results}
set -u
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
timeout 200 python3 -m pytest -q -s tests/test_sparse_decode_gpu.py -k "heads_on or head_axes" > "$OUT/heads_on_n_tests.log" 2>&1
echo "GPU tests exit code: $?"; grep -E "rel-L2|passed|failed|Error" "$OUT/heads_on_n_tests.log" | tail -n 12
VARIANTS=default,head_axis=m ABLATE="qk,v_stage,qk+pv+v_stage" timeout 240 \
  python3 benchmarks/sm90_sparse_decode_gpu.py --bench --cases b,h16 2>&1 | grep -v "^W0\|^I0" | tee "$OUT/heads_on_n_bench.log"
