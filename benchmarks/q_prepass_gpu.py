"""The heads-on-M sparse sm_90 kernel's Q pre-pass on the H200, by itself: the fused XLA ops
(ops.sparse_decode._xla_kernel_q) against kernels/q_quant.py, CUPTI device time per call over 4 rotated input
sets, after a bitwise check of the two results. Question it answers: from how many q rows does the one-launch
kernel beat XLA's fusions (ops.sparse_decode.PREPASS_KERNEL_MIN_ROWS), and what does it cost at T = 1?

Usage (repository root, on the GPU):  PYTHONPATH=. python3 benchmarks/q_prepass_gpu.py [--iters 50]
"""
from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from mla_pallas import bench_timing
from mla_pallas.kernels import q_quant
from mla_pallas.ops import sparse_decode as sd

# (T query tokens, H heads) of the heads-on-M design (heads on N quantizes q in its attention kernel since the
# nineteenth session; its rows here before that: 5.1-5.3 us kernel vs 3.4-3.7 XLA, RESULTS.md "eighteenth session")
SHAPES = [(1, 128), (8, 128), (16, 128), (256, 128)]
SCALE = 576 ** -0.5


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--iters", type=int, default=50)
  args = ap.parse_args()
  print(f"{'T':>4} {'H':>4} {'xla us':>8} {'kernel us':>9}  xla kernels")
  for t, h in SHAPES:
    xla = jax.jit(lambda q, n=h // 64: sd._xla_kernel_q(q, "sm90", n, SCALE, jnp.float32(0.5)))
    kern = jax.jit(lambda q: q_quant.quantize_q(q, jnp.float32(0.5), SCALE))
    sets = [(jax.random.normal(jax.random.key(i), (t, h, 576), jnp.bfloat16) * 3,) for i in range(4)]
    a, b = xla(*sets[0]), kern(*sets[0])
    same = all(np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)) for x, y in zip(a, b))
    times = {}
    for name, fn in (("xla", xla), ("kernel", kern)):
      samples, kernels = bench_timing.time_cupti(fn, sets, iters=args.iters, warmup=3)
      times[name] = (statistics.median(samples), kernels)
    ks = ", ".join(f"{k[:28]} {v:.2f}" for k, v in times["xla"][1].items())
    print(f"{t:>4} {h:>4} {times['xla'][0]:8.2f} {times['kernel'][0]:9.2f}  {ks}"
          + ("" if same else "   NOT BITWISE EQUAL"), flush=True)


if __name__ == "__main__":
  main()
