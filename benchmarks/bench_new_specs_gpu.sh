#!/usr/bin/env bash
# The mla-pallas bench runs of the BMM, rope and one-decode-step specs (mla_pallas/bench.py) on one H200.
# Each prints one line per implementation and writes its JSON to ${OUT:-results}; each took 12-57 s (compile
# included) on an H200 on 2026-11-30. Usage: PYTHONPATH=. bash benchmarks/bench_new_specs_gpu.sh
set -u
B="python3 -m mla_pallas.cli bench --no-progress --no-plot --out ${OUT:-results}"
# quantize_and_bmm_fp8: XLA = fp8 dot_general (cuBLASLt) vs the Mosaic kernel; DeepSeek-V3.2 q_nope @ W_UK
$B quantize_and_bmm_fp8 --impl all --preset deepseek_v32 --shape T=128      # decode batch
$B quantize_and_bmm_fp8 --impl all --preset deepseek_v32 --shape T=4096     # prefill chunk
$B quantize_and_bmm_fp8 --impl all --preset glm5 --shape T=4096             # K=192
$B quantize_and_bmm_fp8 --impl all --shape T=4096,H=128,K=512,N=128         # o_latent @ W_UV (DeepSeek)
# rope + rmsnorm (+ fp8 cache write), with the same run's device copy of the same bytes ("% copy BW")
$B fused_rope_rmsnorm_quantization --impl all --shape T=128,H=128
$B fused_rope_rmsnorm_quantization --impl all --shape T=4096,H=128
$B rope_rmsnorm --impl all --shape T=4096,H=128
# one decode step of the attention graph: pure XLA vs our kernels (mosaic: all four steps; auto: validated only)
$B mla_decode_step --impl all --preset deepseek_v32                  # B128 s_q1 H128 top-k 2048 ctx 32768
$B mla_decode_step --impl all --preset glm5 --shape tp=8             # GLM-5 TP-8 shard: 8 heads
