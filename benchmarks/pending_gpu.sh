#!/usr/bin/env bash
# What waits for a GPU (issues 20-24), as named groups for device calls (groups accumulate; `next` is the current queue):
#
#   bash benchmarks/pending_gpu.sh GROUPS [OUT]    # GROUPS: comma-separated names below, or tests | bench | next
#   DEADLINE=540 bash benchmarks/pending_gpu.sh next   # start no group after 540 s, and cut the running one's
#                                                      # timeout to what is left
# On the device tool: `DEADLINE=450 bash benchmarks/pending_gpu.sh GROUPS $OUT > $OUT/log.txt 2>&1` writes each
# group's text into $OUT as it finishes (a call that hits its time limit still returns what is there); the
# tool returns a limited number of files, so tar the bench JSONs (`tar czf $OUT/json.tgz -C $OUT *.json`) rather
# than deleting them: they hold the per-kernel breakdowns.
#
# next: set by the session that queues work (empty: nothing queued).
# Tests (each under a timeout; rc 124 = deadlock or too slow): t_sparse, t_dense, t_batch_invariance, t_qrows,
#   t_qm, t_prefill_quant, t_prefill_kernel, t_prefill_separate, t_rope_bf16_write, t_bf16.
# Benches (CUPTI, beside XLA / cuDNN): ab_merge (benchmarks/sparse_merge_ab_gpu.py), sweep_small, sweep_bmm_b1,
#   b_prefill_deepseek, b_prefill_glm5, b_prefill_ctx, b_prefill_step,
#   b_prefill_step_ctx, b_invariant, b_dense_D1 (D1 and D3), b_layer, latency / latency_b8 / steps_small.
# Queued in the thirty-sixth session, extended in the thirty-seventh (no device then): t_decode_pv (decode + prefill
#   kernel GPU tests, the dense kernel's "seesaw" route among them), b_seesaw (sparse F1 / P1 and now dense D1 / D2,
#   ~180 s), b_prefill_pv (~170 s); then the kit CASES=D1,D2,D3,P2 (issue 21: D1-D3 in one run), the bf16 kit below
#   (issue 22) and b_prefill_ctx,b_prefill_step,b_prefill_step_ctx (issue 23).
# Then the peer kit (CASES=C0,P1,P2,P3,P4,P5,D1 bash .peers/run_on_h200.sh) for CURRENT.md's FlashMLA rows, and
#   issue 22's BF16 rows with mla-pallas on a bf16 cache: apply benchmarks/peers_bf16_cache_option.diff to the
#   copy (`patch -d .peers -p1 < benchmarks/peers_bf16_cache_option.diff`), then
#   PEERS_CACHE_DTYPE=bf16 CASES=D1,D2,F1,P1,P3 bash .peers/run_on_h200.sh (carry .peers).
#   As groups: kit_dense (D1,D2,D3,P2), kit_bf16, and kit_bf16_seesaw (the bf16 kit after applying
#   benchmarks/queued/seesaw_default.diff to the device's copy: last in its call).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
WHAT=${1:-tests}
OUT=${2:-results/pending}
PY=${PYTHON:-python3}
DEADLINE=${DEADLINE:-100000}
export PYTHONPATH=$PWD
mkdir -p "$OUT"
declare -A RC
run() {   # name, timeout seconds, command...
  local name=$1 t=$2; shift 2
  local left=$((DEADLINE - SECONDS))
  if ((left < 30)); then echo "## $name: skipped (deadline)"; RC[$name]=skipped; return; fi
  ((t > left)) && t=$left
  echo "## $name (timeout $t s, at $SECONDS s)"
  timeout "$t" "$@" 2>&1 | grep -v "^[WI]0000" > "$OUT/$name.txt"
  RC[$name]=${PIPESTATUS[0]}
  tail -n 25 "$OUT/$name.txt"
  echo "## $name: rc ${RC[$name]} (at $SECONDS s)"
}
T="$PY -m pytest -q -m gpu -p no:cacheprovider -s"
B="$PY -m mla_pallas.cli bench"
common=(--no-plot --no-progress --out "$OUT")
t_sparse() { run t_sparse 300 $T tests/test_sparse_decode_gpu.py; }
ab_merge() { run ab_merge 300 $PY benchmarks/sparse_merge_ab_gpu.py; }
sweep_bmm_b1() {   # the decode step's two BMMs at B1 with weights cold in HBM (5.3 us each in the step; 4.1 / 3.8 us
                   # was measured with 2 input sets, i.e. from L2): is another tile or ring depth faster cold?
  run sweep_bmm_uk 150 $B quantize_and_bmm_fp8 --impl xla,mosaic --sweep --preset deepseek_v32 --shape T=1 \
    "${common[@]}"
  run sweep_bmm_uv 150 $B quantize_and_bmm_fp8 --impl xla,mosaic --sweep --shape T=1,H=128,K=512,N=128 "${common[@]}"
}
sweep_small() {   # split lengths at small batches with the new merge (heads on N kept 4-tile splits under the old one)
  local bh b h
  for bh in "8 8" "8 16" "1 128"; do
    read -r b h <<<"$bh"
    run "sweep_B${b}_H${h}" 100 $B sparse_mla_decode --impl mosaic --sweep \
      --sweep-only tiles_per_split=1,tiles_per_split=2,tiles_per_split=4 \
      --shape B=$b,s_q=1,H=$h,topk=2048,page=64,ctx=32768 "${common[@]}"
  done
}
t_qpair() {   # the (q_latent, q_rope) pair on the raw-PTX quantizer: bitwise the concatenated q (both designs)
  run t_qpair 120 $T tests/test_q_pair.py
}
t_qpair_quick() {   # two of t_qpair's shapes (heads on N H8 s_q2; twin B1 H128), for a short call
  run t_qpair_quick 90 $T tests/test_q_pair.py -k "3-2-8 or 1-1-128"
}
step_ds_b1() { run step_deepseek_B1 120 $B mla_decode_step --impl xla,mosaic --shape model=deepseek_v32,B=1,s_q=1 \
  "${common[@]}"; }
t_fences() {   # the proxy fences added in the twenty-first session: bmm "registers" (bitwise the pre-pass) and the
               # prefill kernel's ks ring (against the reference), one model each
  run t_fences 150 $T tests/test_bmm_fp8_kernel_gpu.py tests/test_prefill_kernel_gpu.py \
    -k "quantization_variants or (kernel_matches_reference and deepseek and (ragged or context))"
}
steps_b1() {   # the B1 decode steps after the q pair (the concatenate launch gone)
  run step_deepseek_B1 120 $B mla_decode_step --impl xla,mosaic --shape model=deepseek_v32,B=1,s_q=1 "${common[@]}"
  run step_glm5_tp8_B1 100 $B mla_decode_step --impl xla,mosaic --shape model=glm5,B=1,s_q=1,tp=8 "${common[@]}"
}
t_bi_branch() {   # batch invariance through the decode branch (the pair inside the graph)
  run t_bi_branch 120 $T tests/test_batch_invariance_gpu.py -k decode_branch
}
ab_step_split() {   # the heads-on-M split plan and the merge in W_UV inside the DeepSeek-V3.2 B1 / B2 and GLM-5 B1
                    # steps (benchmarks/step_split_ab_gpu.py)
  run ab_step_split 300 $PY benchmarks/step_split_ab_gpu.py
}
t_merge() {   # the split-KV merge in W_UV's producer (raw PTX) against the float64 merge; the graph that uses it
  run t_merge 200 $T tests/test_merge_bmm_gpu.py
}
xla_bmm_check() {   # the XLA path of quantize_and_bmm_fp8 failed its check at T1 K512 N128 on the H200: which axis?
  run xla_bmm_check 120 $PY benchmarks/xla_bmm_check_gpu.py
}
t_prologue() {   # W_UK's product and the cache write in one launch: bitwise the two kernels, the graph bitwise
  run t_prologue 200 $T tests/test_prologue_gpu.py
}
ab_colaunch() {   # the co-launch, W_UK's prefetch of W_UV and the 2-tile plan in the decode steps, weights cold
  run ab_colaunch 300 $PY benchmarks/step_split_ab_gpu.py --sets 8 --co-launch-ab --two-tile \
    --batches 1,4
}
t_bmm_xla() {   # the XLA bmm path now asserted against the reference (every T, K / N pair of the test)
  run t_bmm_xla 240 $T tests/test_bmm_fp8_kernel_gpu.py -k kernel_matches_reference
}
ab_colaunch_b128() {   # the co-launch at B128 (the op's rule keeps two launches there; "1 launch" lifts it)
  run ab_colaunch_b128 240 $PY benchmarks/step_split_ab_gpu.py --sets 4 --co-launch-ab --batches 128
}
steps_b8() {   # the B8 decode steps (issue 24: no larger-batch row may get slower)
  run step_deepseek_B8 120 $B mla_decode_step --impl xla,mosaic --shape model=deepseek_v32,B=8,s_q=1 "${common[@]}"
  run step_glm5_tp8_B8 100 $B mla_decode_step --impl xla,mosaic --shape model=glm5,B=8,s_q=1,tp=8 "${common[@]}"
  run step_deepseek_tp8_B8 100 $B mla_decode_step --impl xla,mosaic --shape model=deepseek_v32,B=8,s_q=1,tp=8 \
    "${common[@]}"
}
xla_bmm_check_nox() {   # the XLA check again without excess precision
  XLA_FLAGS=--xla_allow_excess_precision=false run xla_bmm_check_nox 100 $PY benchmarks/xla_bmm_check_gpu.py
}
t_qrows() {   # the raw-PTX Q quantization of the heads-on-N kernel, bytes and scales against the XLA pre-pass
  run t_qrows 120 $T tests/test_q_quant.py -k head_rows
}
t_qm() {   # heads on M "twin" (the consumers quantize Q in raw PTX) against "producer_vt" and the reference
  run t_qm 240 $T tests/test_sparse_decode_gpu.py -k heads_m_twin_quantizes_q
}
t_prefill_quant() {   # mla_prefill's q / k pre-pass kernel (kernels/prefill_quant.py): bitwise the XLA pre-pass;
                      # then the op at 64 heads through it, default config, against the reference
  run t_prefill_quant 150 $T tests/test_prefill_quant.py
  t_prefill_h64
}
t_prefill_h64() { run t_prefill_h64 240 $T tests/test_prefill_kernel_gpu.py -k prepass_kernel_matches_reference; }
ab_prefill_prepass() {   # the op with the pre-pass kernel against the XLA pre-pass, DeepSeek-V3.2 and GLM-5 2 x 4096
  run ab_prefill_prepass 300 $PY benchmarks/prefill_prepass_ab_gpu.py
}
steps_small() {   # the changed small-batch rows: heads on M with f32 "twin" partials, the steps, dense H16
  run sparse_B1_sq1_H128 100 $B sparse_mla_decode --impl mosaic --shape B=1,s_q=1,H=128,topk=2048,page=64,ctx=32768 \
    "${common[@]}"
  run sparse_B8_sq1_H128 100 $B sparse_mla_decode --impl mosaic --shape B=8,s_q=1,H=128,topk=2048,page=64,ctx=32768 \
    "${common[@]}"
  run step_deepseek_B1 100 $B mla_decode_step --impl xla,mosaic --shape model=deepseek_v32,B=1,s_q=1 "${common[@]}"
  run step_glm5_tp8_B1 100 $B mla_decode_step --impl xla,mosaic --shape model=glm5,B=1,s_q=1,tp=8 "${common[@]}"
  run step_glm5_tp8_B8 100 $B mla_decode_step --impl xla,mosaic --shape model=glm5,B=8,s_q=1,tp=8 "${common[@]}"
  run step_deepseek_tp8_B8 100 $B mla_decode_step --impl xla,mosaic --shape model=deepseek_v32,B=8,s_q=1,tp=8 \
    "${common[@]}"
}
t_prefill_kernel() { run t_prefill_kernel 300 $T tests/test_prefill_kernel_gpu.py; }
t_prefill_separate() { run t_prefill_separate 240 $T tests/test_prefill_gpu.py -k separate; }
t_batch_invariance() { run t_batch_invariance 240 $T tests/test_batch_invariance_gpu.py; }
t_dense() { run t_dense 200 $T tests/test_dense_decode_gpu.py; }
t_rope_bf16_write() { run t_rope_bf16_write 120 $T tests/test_rope_rmsnorm_kernel_gpu.py -k bf16; }
t_bf16() { run t_bf16 240 $T tests/test_sparse_decode_gpu.py -k bf16; }
b_prefill_deepseek() { run b_prefill_deepseek 300 $B mla_prefill --impl all --sweep --preset deepseek_v32 \
  "${common[@]}"; }
b_prefill_glm5() { run b_prefill_glm5 200 $B mla_prefill --impl all --preset glm5 "${common[@]}"; }
b_prefill_ctx() { run b_prefill_ctx 300 $B mla_prefill --impl xla,mosaic,f32 --shape ctx=4096 "${common[@]}"; }
b_prefill_step() { run b_prefill_step 300 $B mla_prefill_step --impl xla,auto --no-check "${common[@]}"; }
b_prefill_step_ctx() { run b_prefill_step_ctx 300 $B mla_prefill_step --impl xla,auto --no-check --shape ctx=4096 \
  "${common[@]}"; }
b_invariant() {
  local inv
  for inv in 0 1; do
    run "b_invariant${inv}_P1" 200 $B sparse_mla_decode --impl mosaic \
      --shape B=128,s_q=2,H=128,topk=2048,page=64,ctx=32768,invariant=$inv "${common[@]}"
    run "b_invariant${inv}_B8" 200 $B sparse_mla_decode --impl mosaic \
      --shape B=8,s_q=1,H=128,topk=2048,page=64,ctx=32768,invariant=$inv "${common[@]}"
  done
}
b_dense_D1() {   # D1 and D3
  run b_dense_D1 200 $B dense_mla_decode --impl all --shape B=128,s_q=1,H=128,ctx=4096,page=64 "${common[@]}"
  run b_dense_D3 200 $B dense_mla_decode --impl all --shape B=64,s_q=1,H=16,ctx=32768,page=64 "${common[@]}"
}
latency() {
  local h bs b sq
  for h in 8 16 128; do
    for bs in "1 1" "8 1" "8 4" "4 6"; do
      read -r b sq <<<"$bs"
      run "sparse_B${b}_sq${sq}_H${h}" 120 $B sparse_mla_decode --impl xla,mosaic \
        --shape B=$b,s_q=$sq,H=$h,topk=2048,page=64,ctx=32768 "${common[@]}"
    done
  done
  latency_steps 1
  latency_steps 8
}
latency_b8() { latency_steps 8; }
latency_steps() {   # B: dense decode and the decode steps
  local b=$1
  run "dense_B${b}_H16" 120 $B dense_mla_decode --impl xla,mosaic --shape B=$b,s_q=1,H=16,ctx=8192,page=64 \
    "${common[@]}"
  run "step_deepseek_B${b}" 120 $B mla_decode_step --impl all --shape model=deepseek_v32,B=$b,s_q=1 "${common[@]}"
  run "step_glm5_tp8_B${b}" 120 $B mla_decode_step --impl all --shape model=glm5,B=$b,s_q=1,tp=8 "${common[@]}"
  run "step_deepseek_tp8_B${b}" 120 $B mla_decode_step --impl all --shape model=deepseek_v32,B=$b,s_q=1,tp=8 \
    "${common[@]}"
}
b_layer() {   # one FP8 layer's decode (K-major weights; "mosaic" is refused at model size: K = 7168 projections)
  local b
  for b in 1 8; do
    run "layer_deepseek_B${b}" 150 $B mla_layer_decode --impl xla,auto --shape model=deepseek_v32,B=$b "${common[@]}"
    run "layer_glm5_tp8_B${b}" 150 $B mla_layer_decode --impl xla,auto --shape model=glm5,B=$b,tp=8 "${common[@]}"
  done
}
t_producer() {   # "producer_vt" (the op's heads-on-M schedule from 8-tile splits) against the reference and "twin"
  run t_producer 200 $T tests/test_sparse_decode_gpu.py -k "heads_m_schedules and producer"
}
timeline_producer() {   # the in-kernel profiler's per-warpgroup region times of "producer_vt" (which warpgroup waits
                        # for which: the limiter) at P1 and at F1's per-CTA work (decode form, 4 waves)
  local py="$PY benchmarks/sparse_sm90_diagnose_gpu.py --timeline"
  run timeline_P1 150 $py --cases P1 --out "$OUT/timeline"
  run timeline_F1 150 $py --shape B=264,s_q=1,H=128,topk=2048,page=64,ctx=8192 --out "$OUT/timeline_f1"
  rm -f "$OUT"/timeline*/timeline_*/*trace.json    # tens of MB each; the summary is in the group's text
}
diag_producer() {   # "producer_vt" at P1 / F1 beside three P slots and the (24, 72, 208) register split (real
                    # variants, checked); ptxas report at P1
  local py="$PY benchmarks/sparse_sm90_diagnose_gpu.py --iters 20"
  run diag_prod_P1 240 $py --cases P1 --ptxas --rows none,p_slots_3,regs_24_72_208 --out "$OUT/diag_producer"
  run diag_prod_F1 240 $py --cases F1 --rows none,p_slots_3 --out "$OUT/diag_prod_F1"
}
diag_qrows() {   # the in-kernel Q quantization with its loads batched (the default since f3b9e9b, not yet timed)
                 # against one row at a time (q_rows_serial): P1, F1, C0 and the 1-tile "twin" at B1 H128
  local py="$PY benchmarks/sparse_sm90_diagnose_gpu.py --iters 20"
  run diag_qrows_P1 120 $py --cases P1,C0 --rows none,q_rows_serial --out "$OUT/diag_qrows"
  run diag_qrows_F1 150 $py --cases F1 --rows none,q_rows_serial --out "$OUT/diag_qrows_F1"
  run diag_qrows_B1 80 $py --shape B=1,s_q=1,H=128,topk=2048,page=64,ctx=32768 --rows none,q_rows_serial \
    --out "$OUT/diag_qrows_B1"
}
diag_approx() {   # the heads-on-M kernel with approximate exp2 / log2 against the default: P1 (ptxas), F1
  local py="$PY benchmarks/sparse_sm90_diagnose_gpu.py --iters 20"
  run diag_approx_P1 150 $py --cases P1 --ptxas --rows none,approx_math --out "$OUT/diag_approx"
  run diag_approx_F1 150 $py --cases F1 --rows none,approx_math --out "$OUT/diag_approx_F1"
}
t_lazy() { run t_lazy 200 $T tests/test_sparse_decode_gpu.py -k "lazy_rescale or sparse_prefill_heads_m"; }
diag_lazy() {   # on the lazy-rescaling default (23847e4): the producer's raw P store (p_store_raw), approx_math, the
                # row scale folded into the exponent (softmax_fma), all three (all3), eager rescaling: P1, F1
  local py="$PY benchmarks/sparse_sm90_diagnose_gpu.py --iters 20"
  run diag_lazy_P1 170 $py --cases P1 --ptxas --rows none,p_store_raw,approx_math,softmax_fma,all3,eager_rescale \
    --out "$OUT/diag_lazy"
  run diag_lazy_F1 230 $py --cases F1 --rows none,p_store_raw,approx_math,softmax_fma,all3 --out "$OUT/diag_lazy_F1"
}
t_sparse_rest() { run t_sparse_rest 280 $T tests/test_sparse_decode_gpu.py -k "not lazy_rescale and not sparse_prefill_heads_m"; }
timeline_P1() {
  run timeline_P1 150 $PY benchmarks/sparse_sm90_diagnose_gpu.py --timeline --cases P1 --out "$OUT/timeline"
  rm -f "$OUT"/timeline*/timeline_*/*trace.json
}
t_gpu_par() {   # the GPU test files of the sparse kernels in 6 processes on the one GPU (compiles dominate; no
  # preallocation, so the processes share the memory), for a call that must also time something
  XLA_PYTHON_CLIENT_PREALLOCATE=false run t_gpu_par 300 $PY -m pytest -q -m gpu -p no:cacheprovider -n 6 \
    tests/test_sparse_decode_gpu.py tests/test_dense_decode_gpu.py tests/test_batch_invariance_gpu.py
}
diag_s29() {   # the twenty-ninth session's "producer_vt" default (raw P store, approx_math, scale in the exponent)
  # against each part reverted and all three reverted
  local py="$PY benchmarks/sparse_sm90_diagnose_gpu.py --iters 20"
  run diag_s29_P1 150 $py --cases P1 --ptxas --rows none,p_store_ref,exact_math,scaled_logits,before_s29 \
    --out "$OUT/diag_s29"
  run diag_s29_F1 150 $py --cases F1 --rows none,scaled_logits,before_s29 --out "$OUT/diag_s29_F1"
}
timeline_F1() {   # the default's per-warpgroup timeline at F1 (62 waves: are the prologue and the tile rate P1's?)
  run timeline_F1 150 $PY benchmarks/sparse_sm90_diagnose_gpu.py --timeline \
    --shape B=1056,s_q=1,H=128,topk=2048,page=64,ctx=8192 --out "$OUT/timeline"
  rm -f "$OUT"/timeline*/timeline_*/*trace.json
}
t_gpu_par_vt() {   # t_gpu_par's three files and tests/test_vt_registers.py (~240 s with 6 processes before the
                   # dense kernel's route doubled tests/test_dense_decode_gpu.py)
  XLA_PYTHON_CLIENT_PREALLOCATE=false run t_gpu_par_vt 400 $PY -m pytest -q -m gpu -p no:cacheprovider -n 6 \
    -k "not bf16" tests/test_vt_registers.py tests/test_sparse_decode_gpu.py tests/test_dense_decode_gpu.py \
    tests/test_batch_invariance_gpu.py    # (the bf16-cache tests: t_bf16p)
}
b_dense_routes() {   # issue 21: the dense kernel (default plan, k_buffers=3, another split length) beside the sparse
                     # route (route=sparse) and XLA at the peer kit's D1 and D2, and D3 (heads on N) (~300 s)
  local only="--sweep --sweep-only route=sparse,k_buffers=3"
  run b_dense_routes_D1 150 $B dense_mla_decode --impl xla,mosaic $only,tiles_per_split=32 \
    --shape B=128,s_q=1,H=128,ctx=4096,page=64 "${common[@]}"
  run b_dense_routes_D2 150 $B dense_mla_decode --impl xla,mosaic $only,tiles_per_split=64 \
    --shape B=128,s_q=1,H=64,ctx=8192,page=64 "${common[@]}"
  run b_dense_routes_D3 120 $B dense_mla_decode --impl mosaic $only,k_buffers=5,tiles_per_split=64 \
    --shape B=64,s_q=1,H=16,ctx=32768,page=64 "${common[@]}"
}
t_all_par() {   # every GPU test of the decode kernels (sparse, dense, bf16 cache, batch invariance, Vt registers)
                # in 10 processes, beside the prefill kernel's ping-pong and fp8 P·V tests in 3, on the one GPU
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $(( DEADLINE - SECONDS < 520 ? DEADLINE - SECONDS : 520 )) $PY -m pytest -q -m gpu -p no:cacheprovider -n 3 \
    tests/test_prefill_kernel_gpu.py -k "pingpong or pv_fp8" > "$OUT/t_prefill_pp.txt" 2>&1 &
  local pid=$!
  XLA_PYTHON_CLIENT_PREALLOCATE=false run t_decode_par 520 $PY -m pytest -q -m gpu -p no:cacheprovider -n 10 \
    tests/test_vt_registers.py tests/test_sparse_decode_gpu.py tests/test_dense_decode_gpu.py \
    tests/test_batch_invariance_gpu.py
  wait $pid; RC[t_prefill_pp]=$?
  echo "## t_prefill_pp: rc ${RC[t_prefill_pp]}"; grep -v "^[WI]0000" "$OUT/t_prefill_pp.txt" | tail -n 25
}
diag_p2() {   # P2 (heads on N) went 167.2 -> 186.6 us between the thirty-second and thirty-fifth sessions' kit runs:
              # the default beside the heads-on-N P·V's forms of then, one at a time (fragments_fused: one asm block
              # per prmt and its two conversions; key_words_each: the V word addresses per key; p_desc_per_call:
              # the P descriptors per call) and all three (heads_n_4cb55bb), with ptxas
  local py="$PY benchmarks/sparse_sm90_diagnose_gpu.py"
  run diag_p2 150 $py --iters 20 --cases P2 --ptxas \
    --rows none,fragments_fused,key_words_each,p_desc_per_call,heads_n_4cb55bb --out "$OUT/diag_p2"
}
diag_d3() {   # issue 21's D3 (heads on N, 3.27 TB/s against the bar's 3.5): the sparse core at D3's work (64 tokens x
              # 512 tiles) with the gather, the P·V or the Vt words ablated: which warpgroup limits a tile (~1.45 us
              # per tile per SM, where 36 KB at 4 TB/s / 132 SMs is ~1.2)
  local py="$PY benchmarks/sparse_sm90_diagnose_gpu.py"
  run diag_d3 150 $py --iters 20 --shape B=64,s_q=1,H=16,topk=32768,page=64,ctx=32768 \
    --rows none,no_gather,no_pv,no_vt_words,heads_n_4cb55bb --out "$OUT/diag_d3"
}
diag_s32c() {   # the thirty-second session's two multiplier changes one by one (pv_prmt_each: 64 prmt from the
                # words; key_words_each: an address register per key) beside the default, P1 and F1
  local py="$PY benchmarks/sparse_sm90_diagnose_gpu.py"
  run diag_s32c_P1 60 $py --iters 20 --cases P1 --rows none,pv_prmt_each,key_words_each --out "$OUT/diag_s32c"
  run diag_s32c_F1 120 $py --iters 20 --cases F1 --rows none,pv_prmt_each,key_words_each --out "$OUT/diag_s32c_F1"
}
t_vt() { run t_vt 100 $T tests/test_vt_registers.py; }
t_prefill_pp() {   # issue 23: the prefill kernel's ping-pong schedule (TuningConfig.pingpong) and fp8 P·V
                   # (TuningConfig.pv_fp8) against the reference
  run t_prefill_pp 300 $T tests/test_prefill_kernel_gpu.py -k "pingpong or pv_fp8"
}
b_prefill_pp() {   # issue 23: the ping-pong schedule and fp8 P·V beside the default and cuDNN at both models,
                   # 2 x 4096 causal (the op's rows include its pre-passes; the per-kernel breakdown is in the JSON)
  run b_prefill_pp_deepseek 240 $B mla_prefill --impl all --sweep --sweep-only pingpong,pv_fp8 \
    --preset deepseek_v32 "${common[@]}"
  run b_prefill_pp_glm5 200 $B mla_prefill --impl all --sweep --sweep-only pingpong,pv_fp8 --preset glm5 \
    "${common[@]}"
}
diag_bf16() {   # issue 22, if b_bf16 falls short: where "producer_vt" over bf16 spends a tile (P1's shape, 16-tile
                # splits: the profiler's buffers do not fit beside 32-tile splits' indices) and the ablations
  local py="$PY benchmarks/sparse_sm90_diagnose_gpu.py" shape="B=128,s_q=2,H=128,topk=2048,page=64,ctx=32768,cache=bf16"
  run diag_bf16_rows 150 $py --iters 20 --shape $shape --tuning schedule=producer_vt,tiles_per_split=16 \
    --rows none,no_gather,no_qk,no_softmax,no_pv --out "$OUT/diag_bf16"
  run diag_bf16_timeline 120 $py --timeline --timeline-space 48 --shape $shape \
    --tuning schedule=producer_vt,tiles_per_split=16 --rows none --out "$OUT/diag_bf16_timeline"
  rm -f "$OUT"/diag_bf16_timeline/timeline_*/*trace.json
}
diag_seesaw() {   # issue 22, if b_seesaw falls short of its prediction (F1 2600-3000 us, P1 170-200): the ablations of
                  # "seesaw" at P1's shape (32-tile splits: no profiler buffers fit, so no timeline)
  run diag_seesaw_rows 150 $PY benchmarks/sparse_sm90_diagnose_gpu.py --iters 20 \
    --shape B=128,s_q=2,H=128,topk=2048,page=64,ctx=32768,cache=bf16 --tuning schedule=seesaw,tiles_per_split=32 \
    --rows none,no_gather,no_qk,no_softmax,no_pv --out "$OUT/diag_seesaw"
}
t_bf16p() {   # issue 22: the bf16-cache GPU tests ("twin", "producer_vt" over bf16 in the sparse op, both dense routes)
  XLA_PYTHON_CLIENT_PREALLOCATE=false run t_bf16p 300 $PY -m pytest -q -m gpu -p no:cacheprovider -n 4 -k bf16 \
    tests/test_sparse_decode_gpu.py tests/test_dense_decode_gpu.py
}
b_bf16() {   # issue 22: "producer_vt" over a bf16 cache (16- and 32-tile splits) beside "twin" (the default until
             # validated) at F1 and P1; the dense kernel's bf16 form beside the bf16 sparse route and XLA at D1, D2
  local only="--sweep --sweep-only schedule=producer_vt" cache="--cache-dtype bf16"
  run b_bf16_F1 150 $B sparse_mla_prefill --impl mosaic $cache $only \
    --shape T=4096,H=128,topk=2048,page=64,ctx=8192 "${common[@]}"
  run b_bf16_P1 100 $B sparse_mla_decode --impl mosaic $cache $only \
    --shape B=128,s_q=2,H=128,topk=2048,page=64,ctx=32768 "${common[@]}"
  run b_bf16_D1 100 $B dense_mla_decode --impl xla,mosaic $cache --sweep --sweep-only route=sparse \
    --shape B=128,s_q=1,H=128,ctx=4096,page=64 "${common[@]}"
  run b_bf16_D2 100 $B dense_mla_decode --impl mosaic $cache --sweep --sweep-only route=sparse \
    --shape B=128,s_q=1,H=64,ctx=8192,page=64 "${common[@]}"
}
sweep_producer_short() {   # "producer_vt" at the shorter splits where the op runs "twin" (8 and 16 tiles)
  local shape
  for shape in B=8,s_q=2,H=128,ctx=4096 B=32,s_q=1,H=128,ctx=32768 B=64,s_q=1,H=64,ctx=32768; do
    run "sweep_prod_${shape//[=,]/_}" 100 $B sparse_mla_decode --impl mosaic --sweep --sweep-only schedule=producer_vt \
      --shape "$shape,topk=2048,page=64" "${common[@]}"
  done
}
t_decode_pv() {   # the decode GPU tests (heads-on-N V word addresses, the bf16 validation flags) in 9 processes
                  # beside the prefill kernel's tests (fp8 P·V the default, the op's new Vᵀ pass) in 3; 300 s: the
                  # same decode files took 221 s in 10 processes in the thirty-fifth session, before the seesaw's tests
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $(( DEADLINE - SECONDS < 300 ? DEADLINE - SECONDS : 300 )) $PY -m pytest \
    -v -m gpu -p no:cacheprovider -n 3 tests/test_prefill_kernel_gpu.py > "$OUT/t_prefill_pv.txt" 2>&1 &
  local pid=$!
  XLA_PYTHON_CLIENT_PREALLOCATE=false run t_decode 300 $PY -m pytest -q -m gpu -p no:cacheprovider -n 9 \
    tests/test_vt_registers.py tests/test_sparse_decode_gpu.py tests/test_dense_decode_gpu.py
  wait $pid; RC[t_prefill_pv]=$?
  echo "## t_prefill_pv: rc ${RC[t_prefill_pv]}"; grep -E "passed|failed|FAILED|ERROR" "$OUT/t_prefill_pv.txt" | tail -n 12
}
b_prefill_pv() {   # issue 23: fp8 P·V (the default; with the ping-pong) beside bf16 P·V and cuDNN, with the op's Vᵀ pass
                   # in three XLA passes (it was one 1.8 ms fusion), 2 x 4096 causal, both models
  run b_prefill_pv_deepseek 60 $B mla_prefill --impl mosaic,cudnn --sweep --sweep-only pv_fp8,pingpong --preset deepseek_v32 \
    "${common[@]}"
  run b_prefill_pv_glm5 50 $B mla_prefill --impl mosaic,cudnn --sweep --sweep-only pv_fp8,pingpong --preset glm5 "${common[@]}"
}
b_seesaw() {   # issue 22: "seesaw" over a bf16 cache (the consumers alternate tiles for QKᵀ and softmax) beside
               # "producer_vt" (the bf16 default) at F1 and P1 (~150 s; its GPU tests are in t_decode_pv's files:
               # pytest -m gpu -k bf16_cache_producer tests/test_sparse_decode_gpu.py)
  local only="--sweep --sweep-only schedule=seesaw" cache="--cache-dtype bf16"
  run b_seesaw_F1 120 $B sparse_mla_prefill --impl mosaic $cache $only --shape T=4096,H=128,topk=2048,page=64,ctx=8192 \
    "${common[@]}"
  run b_seesaw_P1 80 $B sparse_mla_decode --impl mosaic $cache $only --shape B=128,s_q=2,H=128,topk=2048,page=64,ctx=32768 \
    "${common[@]}"
  # the dense kernel's bf16 form with "seesaw" (thirty-seventh session) at D1 and D2 (GPU tests: the "seesaw" route
  # of tests/test_dense_decode_gpu.py::test_bf16_cache_matches_reference, in t_decode_pv's files)
  run b_seesaw_D1 80 $B dense_mla_decode --impl mosaic $cache $only --shape B=128,s_q=1,H=128,ctx=4096,page=64 \
    "${common[@]}"
  run b_seesaw_D2 80 $B dense_mla_decode --impl mosaic $cache $only --shape B=128,s_q=1,H=64,ctx=8192,page=64 \
    "${common[@]}"
}
kit() {   # name, seconds, VAR=value...: the peer kit (.peers carried, with benchmarks/peers_bf16_cache_option.diff
          # applied for PEERS_CACHE_DTYPE) into $OUT/name, within the deadline; prints its table
  local name=$1 t=$2; shift 2
  local left=$((DEADLINE - SECONDS))
  if ((left < 90)); then echo "## $name: skipped (deadline)"; RC[$name]=skipped; return; fi
  ((t > left)) && t=$left
  echo "## $name (budget $t s, at $SECONDS s)"
  env "$@" PEERS_BUDGET_S=$((t - 10)) OUT="$OUT/$name" timeout "$t" bash .peers/run_on_h200.sh > "$OUT/$name.log" 2>&1
  RC[$name]=$?
  rm -f "$OUT/$name/flash_mla_cuda.so"
  sed -n '/^case shape/,/^\[merge\]/p' "$OUT/$name.log"
  echo "## $name: rc ${RC[$name]} (at $SECONDS s)"
}
kit_dense() { kit kit_dense 220 CASES=D1,D2,D3,P2; }   # issue 21: D1-D3 in one kit run (and P2's heads-on-N fix)
kit_bf16() { kit kit_bf16 240 PEERS_CACHE_DTYPE=bf16 CASES=D1,D2,F1,P1,P3; }   # issue 22 on the current defaults
kit_bf16_seesaw() {   # issue 22 with "seesaw" the bf16 default: benchmarks/queued/seesaw_default.diff applied to the
                      # device's copy first (the exact change to commit if it wins), so run it last in a call
  if ! patch -p1 --forward < benchmarks/queued/seesaw_default.diff > "$OUT/seesaw_patch.txt" 2>&1; then
    echo "## kit_bf16_seesaw: benchmarks/queued/seesaw_default.diff does not apply"; cat "$OUT/seesaw_patch.txt"
    RC[kit_bf16_seesaw]=patch; return
  fi
  kit kit_bf16_seesaw 240 PEERS_CACHE_DTYPE=bf16 CASES=D1,D2,F1,P1,P3
}
tests="t_sparse,t_dense,t_batch_invariance,t_qrows,t_qm,t_prefill_quant,t_prefill_kernel,t_prefill_separate,t_rope_bf16_write,t_bf16"
next="t_decode_pv,b_seesaw,b_prefill_pv"
bench="b_prefill_deepseek,b_prefill_glm5,b_prefill_ctx,b_prefill_step,b_prefill_step_ctx,b_invariant,b_dense_D1"
groups=()
for g in ${WHAT//,/ }; do
  case $g in
    tests) groups+=(${tests//,/ });; bench) groups+=(${bench//,/ });; next) groups+=(${next//,/ });;
    *) groups+=("$g");;
  esac
done
for g in "${groups[@]}"; do
  if ! declare -F "$g" >/dev/null; then echo "unknown group $g" >&2; exit 2; fi
done
for g in "${groups[@]}"; do "$g"; done
echo "## summary"; for k in "${!RC[@]}"; do echo "$k: ${RC[$k]}"; done | sort | tee "$OUT/summary.txt"
