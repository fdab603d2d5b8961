"""A/B on the H200 of the heads-on-M split plan *inside the decode step* (issue 24): the op's rule (one-tile splits
while the grid has at most HEADS_M_ONE_TILE_MAX_CTAS = 64 CTAs, two-tile splits otherwise) was chosen from the
standalone op (B1 H128 top-k 2048: 1-tile 15.3 µs, 2-tile 16.9), but in the DeepSeek-V3.2 B1 step the 1-tile plan
came with a larger merge (32 f32 partials, 8.4 MB: 1.27 + 3.31 µs) and the step got slower when it was adopted
(29.4 → 30.3 µs, twentieth session; 28.4 after the q pair). This runs the step (graph.mla_decode_branch_fp8,
impl "mosaic", bench spec mla_decode_step) under each plan in one process, same inputs, by monkeypatching the
plan's constants (nothing in the library switches), and prints CUPTI µs per step with its per-kernel breakdown
and the standalone op beside it.

Prediction (written before any run): DeepSeek-V3.2 B1 step 1-tile 28.4 µs, 2-tile ~26.5-27 (merge 4.6 → ~2.9,
attention 11.2 → ~10.5-11); B2 unchanged (it already runs 2-tile splits: 128 CTAs); the standalone op keeps 1-tile
ahead at B1 (15.3 vs 16.9).

Second dimension (twenty-second session): the merge of the split partials inside W_UV's kernel (the graph's
default where the attention kernel leaves f32 "twin" partials: ops.bmm_fp8.merge_quantize_and_bmm_fp8) against
the op's XLA merge (graph.split_partials patched to None). Prediction (before any run): DeepSeek-V3.2 B1 1-tile
28.4 → ~25 µs (the two merge launches, 4.6 µs, go; W_UV 5.45 → ~6: its producer reads 64 KB of partials per head
from L2 while the 64 KB weight tile loads, all 8 K chunks in flight); GLM-5 (H64) B1 gains ~3 µs likewise; with
the merge in W_UV the 1-tile plan stays ahead of 2-tile (its extra partials cost no launch).

Third dimension (twenty-second session, not yet run): the cache-write kernel asks for W_UK's weights in L2 and
W_UK's kernel for W_UV's (``l2_prefetch=`` of fused_rope_rmsnorm_quantization / quantize_and_bmm_fp8, the graph's
default then) against no prefetch (``--prefetch-ab``, removed with the prefetches). Prediction: with cold weights (``--sets 8``) DeepSeek-V3.2 B1
25.64 → ~24.5 µs (W_UV 7.57 → ~7.0 and W_UK 5.45 → ~4.9, their L2 times; the cache write +~0.1 for issuing 128
prefetches); no change with ``--sets 2`` (the weights are in L2 anyway).

Result (twenty-third session): both prefetches on, the cache write's kernel went from 1.74 to 12.85 us at B1 (its
few CTAs issue every 64 KB prefetch of W_UK's 8 MB and do not retire before they are done), so it was deleted; then
W_UK's prefetch of W_UV made W_UK's kernel 1.6 us slower for 0.35 us less in W_UV (B1, with the co-launch below):
deleted too (docs/kernels/bmm_fp8.md, "L2 prefetch hints"). The "no L2 pf" rows are gone with them.

Fourth dimension (twenty-third session, not yet run): the cache write as extra CTAs of W_UK's launch (ops.prologue,
the graph's default) against the two launches (``--co-launch-ab``: "2 launches" patches
graph.cache_write_and_absorb to None). Prediction: DeepSeek-V3.2 B1 25.4 -> ~23.9 us (the cache write's 1.74 us
kernel goes; W_UK's 5.5 us grows by < 0.2: three more CTAs on idle SMs), B2-B8 likewise -1.5; GLM-5 B1 -1.5.
Result: B1 26.76 -> 25.20 with W_UK's prefetch on (23.88 with the co-launch and no prefetch), B4 35.58 -> 33.46,
GLM-5 B1 23.82 -> 22.12; the 2-tile plan stays behind (B1 25.37 vs 23.88, both without prefetch).
At B128 (``--batches 128 --co-launch-ab``, not run yet) the "1 launch" row lifts the op's 18-CTA rule: whether the
co-launch also pays with 288 cache-write CTAs (prediction: no, +1-3 us: three waves of full-SM CTAs).

Usage (repository root, on the GPU):  PYTHONPATH=. python3 benchmarks/step_split_ab_gpu.py [--iters 20]
Numbers go to benchmarks/RESULTS.md; the plan's rule changes only if the step is faster under the other plan.
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import unittest.mock

import jax

from mla_pallas import bench, bench_timing, graph
from mla_pallas.kernels import bmm_fp8 as kbmm, bmm_row_quant
from mla_pallas.ops import prologue, sparse_decode as sd

PLANS = {   # label -> (HEADS_M_ONE_TILE_MAX_CTAS, HEADS_M_MIN_SPLIT_TILES)
    "1-tile (default)": (sd.HEADS_M_ONE_TILE_MAX_CTAS, sd.HEADS_M_MIN_SPLIT_TILES),
    "2-tile": (0, 2),
}
MERGES = ("in W_UV", "XLA")   # the graph's default (W_UV's producer merges the splits) / split_partials disabled
# and, at B1 (32 splits: 8 per producer warp), the merge with all 8 of a warp's partials in flight at once
# (bmm_row_quant.MERGE_SPLITS_PER_LOAD 4 -> 8, the producer's registers 120 -> 168, the consumers' 192 -> 168)
WIDE = "W_UV x8"
SEP = "2 launch"             # the cache write and W_UK's product as two kernels (--co-launch-ab)
ONE = "1 launch"             # the co-launch at any size (CO_LAUNCH_MAX_SIDE_CTAS lifted; --co-launch-ab at B128)


@contextlib.contextmanager
def plan(one_tile_max_ctas: int, min_split_tiles: int, merge: str):
  with contextlib.ExitStack() as stack:
    stack.enter_context(unittest.mock.patch.object(sd, "HEADS_M_ONE_TILE_MAX_CTAS", one_tile_max_ctas))
    stack.enter_context(unittest.mock.patch.object(sd, "HEADS_M_MIN_SPLIT_TILES", min_split_tiles))
    if merge == "XLA":
      stack.enter_context(unittest.mock.patch.object(graph, "split_partials", lambda *a, **k: None))
    if merge == ONE:
      stack.enter_context(unittest.mock.patch.object(prologue, "CO_LAUNCH_MAX_SIDE_CTAS", 1 << 30))
    if merge == SEP:
      stack.enter_context(unittest.mock.patch.object(graph, "cache_write_and_absorb", lambda *a, **k: None))
    if merge == WIDE:
      stack.enter_context(unittest.mock.patch.object(bmm_row_quant, "MERGE_SPLITS_PER_LOAD", 8))
      stack.enter_context(unittest.mock.patch.object(kbmm, "MERGE_PRODUCER_REGS", 168))
      stack.enter_context(unittest.mock.patch.object(kbmm, "MERGE_CONSUMER_REGS", 168))
    jax.clear_caches()
    kbmm.build.cache_clear()
    yield


def _time(spec, shape, iters, n_sets=2):
  sets = [spec.make_inputs(shape, jax.random.key(i)) for i in range(n_sets)]
  fn = spec.op("mosaic", shape)
  if spec.state is not None:
    samples, kernels = bench_timing.time_cupti_state(fn, sets, spec.state, iters=iters, warmup=2)
  else:
    samples, kernels = bench_timing.time_cupti(fn, sets, iters=iters, warmup=2)
  top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
  return statistics.median(samples), ", ".join(f"{k[:30]} {v:.2f}" for k, v in top)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--batches", default="1,2,4,8")
  ap.add_argument("--two-tile", action="store_true", help="also the 2-tile plan at DeepSeek-V3.2 B1")
  ap.add_argument("--x8", action="store_true", help="also the merge with 8 partials per load at B1")
  ap.add_argument("--co-launch-ab", action="store_true", help="also each step with the cache write as its own kernel")
  ap.add_argument("--sets", type=int, default=2, help="input sets rotated (8: weights cold in HBM, as the bench "
                  "CLI's mla_decode_step; 2: from L2)")
  args = ap.parse_args()
  step, op = bench.get_spec("mla_decode_step"), bench.get_spec("sparse_mla_decode")
  print(f"{'shape':<16} {'plan':<17} {'merge':<8} | {'step us':>8} {'op us':>8} | splits | step kernels (us)")
  cases = [("deepseek_v32", 128, b, "1-tile (default)") for b in (1, 2, 4, 8, 128)]
  cases += [("deepseek_v32", 128, 1, "2-tile")] if args.two_tile else []
  cases += [("glm5", 64, b, "1-tile (default)") for b in (1, 8, 128)]
  for model, h, b, label in cases:
    if str(b) not in args.batches.split(","):
      continue
    s_step = step.shape(dict(B=b, s_q=1, ctx=32768), preset=model)
    s_op = op.shape(dict(B=b, s_q=1, H=h, topk=2048, page=64, ctx=32768))
    co = ((ONE,) if b > 8 else (SEP,)) if args.co_launch_ab else ()   # B128: the rule already runs two launches
    for merge in MERGES + ((WIDE,) if b == 1 and args.x8 else ()) + co:
      with plan(*PLANS[label], merge):
        cfg = sd.default_config(h, b, 2048)
        t_step, kern = _time(step, s_step, args.iters, args.sets)
        t_op = _time(op, s_op, args.iters, args.sets)[0] if merge == "XLA" else float("nan")
      print(f"{model[:8]} B{b} H{h:<4} {label:<17} {merge:<8} | {t_step:8.2f} {t_op:8.2f} | {cfg.num_splits:>6} | "
            f"{kern}", flush=True)

if __name__ == "__main__":
  main()
