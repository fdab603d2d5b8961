"""kernels/prefill_quant.py: mla_prefill's q / k pre-pass in one kernel (per-row e4m3 in the prefill kernel's aligned
packing), bitwise against the XLA pre-pass it replaces (ops.prefill._fp8_per_row) in interpret mode with race
detection, lowered for sm_90a with counts, and natively on a GPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas import testing
from mla_pallas.kernels import prefill_quant
from mla_pallas.ops import prefill as pf

RACES = plgpu.InterpretGPUParams(detect_races=True)


def _inputs(rng, t, h, d, dtype, cu):
  """x [t, h, d] with an all-zero row, a -0.0, +-inf and NaN entries, a row of only non-finite values and one large
  value; ``src`` of the aligned packing of ``cu`` (zero rows between sequences)."""
  x = np.asarray(rng.standard_normal((t, h, d)) * 3, np.float32)
  x[0, 5] = 0.0
  x[0, 6, 3] = -0.0
  x[1, 7, 11], x[1, 8, 0], x[2, 9, 3] = np.inf, np.nan, -np.inf
  x[2, 10] = np.nan
  x[t - 1, h - 1, d - 1] = 1e4
  _, src, _ = pf._aligned_packing(jnp.asarray(cu, jnp.int32), t, len(cu) - 1)
  return jnp.asarray(x, dtype), src


def _assert_bitwise(got, want):
  (x8, s), (w8, ws) = got, want
  assert x8.shape == w8.shape and x8.dtype == w8.dtype and s.shape == ws.shape
  np.testing.assert_array_equal(np.asarray(x8).view(np.uint8), np.asarray(w8).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(s), np.asarray(ws))


@pytest.mark.parametrize("t,h,d,dtype,cu", [
    (13, 64, 192, jnp.bfloat16, [0, 5, 13]),       # DeepSeek-V3.2's d_qk; two sequences: padding rows between
    (9, 128, 256, jnp.float32, [0, 1, 1, 9]),      # GLM-5's d_qk, f32 x (32-column chunks); an empty sequence
])
def test_bitwise_interpret(rng, t, h, d, dtype, cu):
  x, src = _inputs(rng, t, h, d, dtype, cu)
  assert pf._prepass_kernel(x)
  testing.reset_interpreter()
  got = pf._quantize_rows(x, src, interpret=RACES)
  assert not testing.races_found()
  _assert_bitwise(got, pf._fp8_per_row(x, src))


def test_rule_and_errors():
  """H or D not a multiple of 64 keeps the XLA pre-pass; the kernel refuses them."""
  assert not pf._prepass_kernel(jnp.zeros((4, 32, 192), jnp.bfloat16))
  assert not pf._prepass_kernel(jnp.zeros((4, 64, 96), jnp.bfloat16))
  with pytest.raises(NotImplementedError, match="multiples"):
    prefill_quant.build(4, 32, 192, 8, "bfloat16")


@pytest.mark.parametrize("dtype,d", [(jnp.bfloat16, 192), (jnp.float32, 256)])
def test_lowers_for_sm90(dtype, d):
  """sm_90a lowering, with counts: per CTA d / (128 bytes) TMA loads of the [64, d] slab, d / 64 fp8 chunk stores
  and one of the scales."""
  S = jax.ShapeDtypeStruct
  kern = prefill_quant.build(100, 128, d, 120, jnp.dtype(dtype).name)
  low = testing.lower_for_cuda(kern, S((100, 128, d), dtype), S((120,), jnp.int32), arch=(9, 0))
  loads = d * jnp.dtype(dtype).itemsize // 128
  assert low.count(r"cp\.async\.bulk\.tensor\.shared\.cluster\.global") == loads
  assert low.count(r"cp\.async\.bulk\.tensor\.global\.shared\.cta") == d // 64
  assert low.count(r"cp\.async\.bulk\.global\.shared::cta") == 1        # the scales: a 1-D bulk copy


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("t,h,d,cu", [(1000, 128, 192, [0, 37, 600, 600, 1000]), (300, 64, 256, [0, 300])])
def test_bitwise_gpu(rng, t, h, d, cu):
  x, src = _inputs(rng, t, h, d, jnp.bfloat16, cu)
  _assert_bitwise(jax.jit(pf._quantize_rows)(x, src), jax.jit(pf._fp8_per_row)(x, src))
