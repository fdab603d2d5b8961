"""A/B on the H200 of mla_prefill's q / k pre-pass on its Mosaic path: kernels/prefill_quant.py (the default since the
nineteenth session: one launch that reads x once) against the XLA ops it replaced (ops.prefill._fp8_per_row: a
row-max reduction and a converting pass, 300 + 447 µs at DeepSeek-V3.2's 2 × 4096 tokens in the eighteenth
session), same process, same inputs. The old behaviour is restored by monkeypatching ``_prepass_kernel`` (below);
nothing in the library switches. Prints CUPTI µs per call of the op (impl="mosaic"), its five largest kernels,
and whether the two outputs are bitwise equal (they must be: the pre-passes give the same bytes and scales).

Prediction (written before the run): DeepSeek-V3.2 op 3378 → ~2780 µs (the pre-passes ~750 → ~150 µs: 400 MB of
bf16 q and k read once, 200 MB of fp8 written), GLM-5 2513 → ~2080 µs; cuDNN's ops were 2967 / 1744 µs.

Usage (repository root, on the GPU):  PYTHONPATH=. python3 benchmarks/prefill_prepass_ab_gpu.py [--iters 10]
Numbers go to benchmarks/RESULTS.md; the kernel stays the default only if it is not slower at either model.
"""
from __future__ import annotations

import argparse
import collections
import statistics

import jax
import numpy as np

from mla_pallas import bench, bench_timing
from mla_pallas.ops import prefill as pf

_DEFAULT = pf._prepass_kernel


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--iters", type=int, default=10)
  args = ap.parse_args()
  spec = bench.get_spec("mla_prefill")
  print(f"{'model':<14} | {'kernel us':>9} {'xla us':>9} | bitwise | kernel pre-pass / xla pre-pass (largest kernels)")
  for model in ("deepseek_v32", "glm5"):
    s = spec.shape(preset=model)
    sets = [spec.make_inputs(s, jax.random.key(i)) for i in range(2)]
    dqk = sets[0][0].shape[2]
    scale = dqk ** -0.5
    res = {}
    for name in ("kernel", "xla"):
      pf._prepass_kernel = _DEFAULT if name == "kernel" else (lambda x: False)
      jax.clear_caches()
      fn = lambda q, k, v, cu, cu_k, sc=scale: pf.mla_prefill(q, k, v, cu, softmax_scale=sc, causal=True, impl="mosaic")
      out = jax.jit(fn)(*sets[0])
      samples, kernels = bench_timing.time_cupti(fn, sets, iters=args.iters, warmup=2)
      agg = collections.Counter()
      for k, v in kernels.items():
        agg[k.split("#")[0]] += v
      res[name] = (statistics.median(samples), out, ", ".join(f"{k[:28]} {v:.0f}" for k, v in agg.most_common(5)))
    pf._prepass_kernel = _DEFAULT
    (tk, ok, kk), (tx, ox, kx) = res["kernel"], res["xla"]
    same = all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)) for a, b in zip(ok, ox))
    print(f"{model:<14} | {tk:9.1f} {tx:9.1f} | {str(same):<7} | {kk} / {kx}", flush=True)


if __name__ == "__main__":
  main()
