"""Probe: what a CTA's fixed cost (Q + index load, pipeline fill, drain, epilogue, launch) adds to the sm_90 sparse
decode kernel at the GLM-5 TP-8 shape. The same 16384 tiles of 64 gathered keys (B·s_q·topk/64 at (b)) are run
as n_tok query tokens of tiles_per_split tiles each: (1024, 16), (512, 32), (256, 64). CUPTI time of the kernel
alone (no pre-pass), head_axis="n" defaults of the op plus TUNING.

  PYTHONPATH=. python3 benchmarks/sparse_split_length_probe_gpu.py   (one H200; TUNING="name=value+..." optional)
"""
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.mosaic.gpu import profiler

from benchmarks.sm90_sparse_decode_gpu import _tuning
from mla_pallas.ops import sparse_decode as sd
from mla_pallas.kernels import sparse_decode_sm90 as sm90
TILES = 16384
CTX = 32768


def main():
  extra = dict(_tuning(os.environ.get("TUNING", "")))
  kw = sd._default_tuning("sm90", 8, tuple(extra.items()))
  num_slots = 128 * CTX
  kv = jax.random.normal(jax.random.key(1), (num_slots, 576), jnp.float32).astype(jnp.float8_e4m3fn)
  rng = np.random.default_rng(0)
  for n_tok, tps in ((1024, 16), (512, 32), (256, 64)):
    cfg = sm90.TuningConfig(tiles_per_split=tps, heads_n=16, **kw)
    kern = sm90.build(n_tok, n_tok, num_slots, 1, 1, "bfloat16", cfg, out_heads=8, q_stride=8)
    q8 = jax.random.normal(jax.random.key(2), (n_tok * 8, sm90.Q_SW_COLS), jnp.float32).astype(jnp.float8_e4m3fn)
    qs = jnp.full((n_tok * 8,), 0.01, jnp.float32)     # flat Q rows, 8 heads per token (q_stride=8)
    base = (rng.integers(0, 128, (n_tok, 1, 1)) * CTX).astype(np.int32)
    idx = jnp.asarray(rng.integers(0, CTX, (n_tok, tps, 64)).astype(np.int32) + base)
    f = jax.jit(kern)
    _, ts = profiler.measure(f, iterations=20)(q8, qs, kv, idx, jnp.ones((1,), jnp.float32))
    us = statistics.median(ts) * 1e3
    print(f"n_tok {n_tok:5d} x tiles_per_split {tps:3d}: kernel {us:7.1f} us "
          f"({us / (TILES / 132):.3f} us per tile per SM, {n_tok / 132:.2f} CTAs per SM)", flush=True)


if __name__ == "__main__":
  main()
