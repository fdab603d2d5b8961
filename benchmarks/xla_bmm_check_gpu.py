"""Where does the XLA path of ``quantize_and_bmm_fp8`` lose accuracy on the H200? (twenty-second session finding)

The T1 H128 K512 N128 sweep (W_UV at decode) failed its reference check on the XLA row (rel-L2 2.58e-2 against
a tolerance of 1.16e-2; the Mosaic kernel 7.1e-4), while W_UK's shape (K 128: one 128-wide K block) passed at
5e-6. This prints rel-L2 against ``reference.quantize_and_bmm_fp8`` for the XLA path over the axes that differ:
K blocks (1 / 2 / 4), T (1 / 16 / 256), N (128 / 512), weight layout ("hkn" / "hnk"), and one control that runs
the same per-block products with the fp8 operands upcast to bf16 (exact values; bf16 dot_general with f32
accumulation), which separates XLA's FP8 GEMM from the op's own arithmetic.

First run (twenty-third session): every T = 1 row missed by 2.6e-2 except K 128 N 512 (6e-5); T 16 / 256 passed
(6.9e-4); the bf16 control missed by 2.6e-2 at every T with K >= 256. 2.6e-2 is the size of a's e4m3 rounding, and
on the CPU every column is <= 6e-5. Hypothesis: XLA's GPU pipeline, allowed excess precision
(``--xla_allow_excess_precision``, on by default), removes the f32 -> f8 -> (bf16 / f32) convert chain wherever
the fp8 a is upcast (the T = 1 dot, which cuBLASLt's FP8 GEMM does not take, and the control), so a is never
rounded to e4m3. Second run: a column with ``lax.optimization_barrier`` on the fp8 a (which no simplification
crosses) and the whole table again under ``XLA_FLAGS=--xla_allow_excess_precision=false``. Prediction: both bring
the T = 1 rows to <= 1e-3. Measured: both did (2e-7 - 6e-5); the library's XLA path now has the barrier, so the
"xla" columns are that path and the barrier column went.

Usage (repository root, on the GPU): PYTHONPATH=. python3 benchmarks/xla_bmm_check_gpu.py
"""
from __future__ import annotations

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mla_pallas import quant, reference
from mla_pallas.ops import bmm_fp8 as bmm_mod


def _bf16_control(a, w, w_scale):
  """The XLA path's products with the fp8 operands upcast to bf16 (``hkn`` weights)."""
  t, h, k = a.shape
  n = w.shape[2]
  a8, a_s = quant.quantize_rows_fp8(a, axis=-1)
  ws_cols = jnp.repeat(w_scale, 128, axis=2)[:, :, :n]
  acc = jnp.zeros((h, t, n), jnp.float32)
  for kb in range(-(-k // 128)):
    k0, k1 = kb * 128, min(k, (kb + 1) * 128)
    part = lax.dot_general(a8[:, :, k0:k1].astype(jnp.bfloat16), w[:, k0:k1, :].astype(jnp.bfloat16),
                           (((2,), (1,)), ((1,), (0,))), preferred_element_type=jnp.float32)
    acc = acc + part * ws_cols[:, kb, None, :]
  return (jnp.swapaxes(acc, 0, 1) * a_s[..., None]).astype(jnp.bfloat16)


def _rel(got, want):
  g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(g - w) / np.linalg.norm(w))


def main():
  key = jax.random.key(0)
  print(f"{'T':>4} {'H':>4} {'K':>4} {'N':>4} | {'xla hkn':>9} {'xla hnk':>9} {'bf16 ctl':>9}")
  for t, h, k, n in [(1, 128, 128, 512), (1, 128, 256, 128), (1, 128, 512, 128), (16, 128, 512, 128),
                     (256, 128, 512, 128), (1, 128, 512, 512), (1, 16, 512, 128)]:
    ka, kw = jax.random.split(jax.random.fold_in(key, t * 7 + k))
    a = (jax.random.normal(ka, (t, h, k)) * 2.0).astype(jnp.bfloat16)
    w8, ws = quant.quantize_blocks_fp8(jax.random.normal(kw, (h, k, n)) * 0.05)
    want = reference.quantize_and_bmm_fp8(a, w8, ws)
    hkn = bmm_mod._bmm_jit(a, w8, ws, act_scale="per_token", weight_layout="hkn", impl="xla")
    hnk = bmm_mod._bmm_jit(a, bmm_mod.prepare_weight(w8), ws, act_scale="per_token", weight_layout="hnk",
                           impl="xla")
    ctl = jax.jit(_bf16_control)(a, w8, ws)
    print(f"{t:>4} {h:>4} {k:>4} {n:>4} | {_rel(hkn, want):9.2e} {_rel(hnk, want):9.2e} {_rel(ctl, want):9.2e}",
          flush=True)


if __name__ == "__main__":
  main()
