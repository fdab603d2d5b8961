"""A/B on the H200 of the split merge of sparse_mla_decode (fp8 cache): the default (``_partials_dtype``: bf16
split partials except on the heads-on-M "twin" schedule, since the nineteenth session; ``combine_splits``'
elementwise chain: two XLA launches) against the merge before the eighteenth session (f32 partials everywhere, the
merge as reductions over the split axis: three launches), same process, same inputs. The old
behaviour is restored by monkeypatching ``_partials_dtype`` and ``combine_splits`` (below); nothing in the library
switches. Prints CUPTI µs per call, the per-kernel totals, and each variant's rel-L2 against the float32 reference.

Usage (repository root, on the GPU):  PYTHONPATH=. python3 benchmarks/sparse_merge_ab_gpu.py [--iters 20]
Numbers go to benchmarks/RESULTS.md; the default is kept only if it is not slower at any shape.
"""
from __future__ import annotations

import argparse
import collections
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from mla_pallas import bench, bench_timing, reference
from mla_pallas.ops import sparse_decode as sd

# (B, s_q, H, top-k, ctx): issue 24's latency shapes, C0, P1 (one split: unchanged), P5 (2 splits of 128 tiles)
SHAPES = [(8, 1, 8, 2048, 32768), (8, 1, 16, 2048, 32768), (4, 6, 8, 2048, 32768), (1, 1, 128, 2048, 32768),
          (8, 1, 128, 2048, 32768), (8, 2, 128, 2048, 4096), (128, 2, 128, 2048, 32768),
          (148, 2, 128, 16384, 32768)]


def _reduction_merge(o, lse):
  """The merge before the eighteenth session (reductions over the split axis)."""
  m = jnp.max(lse, axis=-2, keepdims=True)
  m_use = jnp.where(m == -jnp.inf, 0.0, m)
  w = jnp.exp(lse - m_use)
  tot = jnp.sum(w, axis=-2)
  o = jnp.sum(w[..., None] * o.astype(jnp.float32), axis=-3) / jnp.where(tot == 0, 1.0, tot)[..., None]
  return o, jnp.log(tot) + m_use[..., 0, :]


def _variant(name):
  """Patch the module for a variant (the jit caches are cleared by the caller)."""
  if name == "old":
    sd._partials_dtype = lambda splits, bf16_cache, twin=False: "bfloat16" if splits == 1 else "float32"
    sd.combine_splits = _reduction_merge
  else:
    sd._partials_dtype, sd.combine_splits = _DEFAULTS


_DEFAULTS = (sd._partials_dtype, sd.combine_splits)


def rel_l2(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--iters", type=int, default=20)
  args = ap.parse_args()
  spec = bench.get_spec("sparse_mla_decode")
  print(f"{'B':>4} {'s_q':>3} {'H':>4} {'top-k':>6} {'splits':>6} | {'new us':>8} {'old us':>8} | "
        f"{'new rel-L2':>10} {'old rel-L2':>10} | new kernels / old kernels")
  for b, s_q, h, topk, ctx in SHAPES:
    s = dict(spec.gpu_defaults, B=b, s_q=s_q, H=h, topk=topk, ctx=ctx)
    sets = [spec.make_inputs(s, jax.random.key(i)) for i in range(3)]
    kw = spec.op_kwargs(s)
    q, cache, idx = sets[0]
    ref_out, _ = reference.sparse_mla_decode(q.astype(jnp.float32), cache, idx, **kw)
    splits = sd.default_config(h, b * s_q, topk).num_splits
    res = {}
    for name in ("new", "old"):
      _variant(name)
      jax.clear_caches()
      fn = lambda q, c, i: sd.sparse_mla_decode(q, c, i, impl="mosaic", **kw)
      out, _ = jax.jit(fn)(q, cache, idx)
      samples, kernels = bench_timing.time_cupti(fn, sets, iters=args.iters, warmup=2)
      agg = collections.Counter()
      for k, v in kernels.items():
        agg[k.split("#")[0]] += v
      res[name] = (statistics.median(samples), rel_l2(out, ref_out),
                   ", ".join(f"{k[:24]} {v:.1f}" for k, v in agg.most_common(5)))
    _variant("new")
    (tn, en, kn), (to, eo, ko) = res["new"], res["old"]
    print(f"{b:>4} {s_q:>3} {h:>4} {topk:>6} {splits:>6} | {tn:8.1f} {to:8.1f} | {en:10.2e} {eo:10.2e} | "
          f"{kn} / {ko}", flush=True)


if __name__ == "__main__":
  main()
