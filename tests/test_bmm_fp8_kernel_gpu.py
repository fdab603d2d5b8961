"""quantize_and_bmm_fp8 on a Hopper GPU (sm_90a): the Mosaic kernel at real sizes against the reference, beside
the XLA path (cuBLASLt FP8).

Error model. Both implementations quantize ``a`` exactly like the reference (bitwise the same ``a8`` and scales),
so the only differences are (1) Hopper's fp8 wgmma accumulation, which is below f32 precision: max abs error
~0.011 against an exact f32 product for N(0, 1) fp8 inputs at K = 128 (``testing.WGMMA_FP8_MAX_ABS_ERROR``),
i.e. ~0.011 / sqrt(128) ~= 1e-3 relative to a K = 128 dot product's typical size. The kernel never accumulates
more than one 128-wide K block in a wgmma chain (blocks are promoted into f32), so this holds for every K;
(2) f32 summation order, negligible; (3) the final bf16 rounding of both outputs, sqrt(2) * 2^-8 / sqrt(3)
RMS relative. The rel-L2 tolerance is 3x the quadrature sum of (1) and (3): 3 * sqrt(0.00097^2 + 0.0032^2) ~= 0.010.

Run with ``-s`` to see the measured errors of both paths.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mla_pallas
from mla_pallas import _dispatch, quant, reference, testing
from mla_pallas.ops import bmm_fp8 as bmm_mod

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

OP = "quantize_and_bmm_fp8"
# (K, N): DeepSeek-V3.2 q_nope @ W_UK, GLM-5 q_nope @ W_UK, output projections through W_UV.
PAIRS = [(128, 512), (192, 512), (512, 128), (512, 256)]
TOKENS = [1, 70, 1000, 4096]


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _inputs_jit(key, t, h, k, n):
  ka, kr, kw, km = jax.random.split(key, 4)
  a = jax.random.normal(ka, (t, h, k)) * jnp.exp(jax.random.normal(kr, (t, h, 1)))
  a = a.at[t // 2, h - 1].set(0.0)                        # an all-zero row (scale 1)
  kb, nb = -(-k // 128), -(-n // 128)
  mag = jnp.exp(jax.random.normal(km, (h, kb, nb)))       # block scales spread over ~e^±2
  mag = jnp.repeat(jnp.repeat(mag, 128, axis=1), 128, axis=2)[:, :k, :n]
  w8, ws = quant.quantize_blocks_fp8(jax.random.normal(kw, (h, k, n)) * 0.05 * mag)
  return a.astype(jnp.bfloat16), w8, ws


def make_inputs(rng, t, h, k, n):
  """On-device version of tests/test_bmm_fp8_kernel.py's make_inputs (same distributions), for real sizes."""
  return _inputs_jit(jax.random.key(int(rng.integers(2 ** 31))), t, h, k, n)


def _tolerance() -> float:
  wgmma = testing.WGMMA_FP8_MAX_ABS_ERROR[128] / math.sqrt(128)
  out_bf16 = math.sqrt(2.0) * testing.BF16_UNIT_ROUNDOFF / math.sqrt(3.0)
  return 3.0 * math.sqrt(wgmma ** 2 + out_bf16 ** 2)


def _metrics(got, want):
  g, w = np.asarray(got, np.float64), np.asarray(want, np.float64)
  rel = np.linalg.norm(g - w) / np.linalg.norm(w)
  return rel, float(np.abs(g - w).max() / np.abs(w).max())


@pytest.mark.parametrize("k,n", PAIRS)
@pytest.mark.parametrize("t", TOKENS)
def test_kernel_matches_reference(rng, k, n, t):
  h = 128
  act_scale = "per_token" if (t + k) % 2 == 0 else "per_tensor"
  a, w8, ws = make_inputs(rng, t, h, k, n)
  wt = bmm_mod.prepare_weight(w8)
  want = reference.quantize_and_bmm_fp8(a, w8, ws, act_scale=act_scale)
  out = mla_pallas.quantize_and_bmm_fp8(a, wt, ws, act_scale=act_scale, weight_layout="hnk", impl="mosaic")
  assert _dispatch.last_impl(OP) == "mosaic"
  out2 = mla_pallas.quantize_and_bmm_fp8(a, w8, ws, act_scale=act_scale, impl="mosaic")   # "hkn": transposed
  xla = mla_pallas.quantize_and_bmm_fp8(a, wt, ws, act_scale=act_scale, weight_layout="hnk", impl="xla")
  km, xm = _metrics(out, want), _metrics(xla, want)
  print(f"\nT={t} H={h} K={k} N={n} {act_scale}: kernel rel-L2 {km[0]:.2e} max-abs/max {km[1]:.2e} | "
        f"xla rel-L2 {xm[0]:.2e} max-abs/max {xm[1]:.2e}")
  testing.assert_close_fp8(out, want, rel_l2=_tolerance(), min_cos=0.9999, what="kernel")
  assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(out2).view(np.uint16)), \
      "weight layouts (or two runs) disagree"
  # The XLA path under the same model (cuBLASLt's FP8 GEMM accumulates like the wgmma); at T = 1 it missed by a's
  # whole e4m3 rounding (2.6e-2) until the quantized a went behind an optimization barrier (twenty-third session)
  testing.assert_close_fp8(xla, want, rel_l2=_tolerance(), min_cos=0.9999, what="xla path")


def test_partial_m_tiles(rng):
  """T = 67 (T % 8 != 0, T % 64 != 0): the last M tile is partial on both the TMA loads (zero-filled rows) and the
  TMA store (clipped rows, linear staging tile); its rows must equal those of a run on more tokens (rows are
  independent under per-token scaling)."""
  a, w8, ws = make_inputs(rng, 130, 16, 128, 256)
  wt = bmm_mod.prepare_weight(w8)
  full = mla_pallas.quantize_and_bmm_fp8(a, wt, ws, weight_layout="hnk", impl="mosaic")
  part = mla_pallas.quantize_and_bmm_fp8(a[:67], wt, ws, weight_layout="hnk", impl="mosaic")
  np.testing.assert_array_equal(np.asarray(part, np.float32), np.asarray(full, np.float32)[:67])


def test_jit_and_auto(rng):
  a, w8, ws = make_inputs(rng, 256, 128, 128, 512)
  wt = bmm_mod.prepare_weight(w8)
  f = jax.jit(lambda a, w, s: mla_pallas.quantize_and_bmm_fp8(a, w, s, weight_layout="hnk"))
  out = f(a, wt, ws)
  assert _dispatch.last_impl(OP) == "mosaic"
  want = reference.quantize_and_bmm_fp8(a, w8, ws)
  testing.assert_close_fp8(out, want, rel_l2=_tolerance(), min_cos=0.9999)
  assert jnp.dtype(out.dtype) == jnp.bfloat16


@pytest.mark.parametrize("k,n", [(128, 512), (192, 512), (512, 256)])
@pytest.mark.parametrize("t", [1, 5, 70, 256])   # T < 8: a unpadded (GMEM rows < 8)
def test_in_kernel_quantization_is_bitwise_the_prepass(rng, k, n, t):
  """quantize_k = K (the default at T <= FUSED_QUANT_MAX_TOKENS): the kernel quantizes bf16 ``a`` per row with the
  float32 operations of quant.quantize_rows_fp8 (amax, amax * f32(1/448), 1 / scale, product, clip, RNE cast), so
  the fp8 operands and hence the outputs equal the pre-pass path's bit for bit. A mismatch means the in-kernel
  division/reduction differs from XLA's on this GPU."""
  a, w8, ws = make_inputs(rng, t, 128, k, n)
  wt = bmm_mod.prepare_weight(w8)
  run = functools.partial(bmm_mod._bmm_jit, a, wt, ws, act_scale="per_token", weight_layout="hnk", impl="mosaic")
  fused, pre = run(tuning=(("quantize_k", k),)), run(tuning=(("quantize_k", None),))
  np.testing.assert_array_equal(np.asarray(fused).view(np.uint16), np.asarray(pre).view(np.uint16))


@pytest.mark.parametrize("k", [128, 192])
@pytest.mark.parametrize("t", [1, 8, 70])
def test_two_sub_tiles_per_consumer_is_bitwise_the_default(rng, k, t):
  """sub_n=2 (64 x 512 CTA tiles, two 64 x 128 sub-tiles per consumer on the resident K chunks; the default at
  decode sizes where it saves a wave) runs the
  same wgmmas and promotions per 64 x 128 sub-tile as the default, so the outputs are equal bit for bit, and
  close to the reference within the error model above."""
  a, w8, ws = make_inputs(rng, t, 128, k, 512)
  wt = bmm_mod.prepare_weight(w8)
  run = functools.partial(bmm_mod._bmm_jit, a, wt, ws, act_scale="per_token", weight_layout="hnk", impl="mosaic")
  two, one = run(tuning=(("sub_n", 2),)), run(tuning=(("sub_n", 1),))
  np.testing.assert_array_equal(np.asarray(two).view(np.uint16), np.asarray(one).view(np.uint16))
  want = reference.quantize_and_bmm_fp8(a, w8, ws, act_scale="per_token")
  testing.assert_close_fp8(two, want, rel_l2=_tolerance(), what="sub_n=2 vs reference")


# In-kernel quantization designs (TuningConfig.a_quant) and tiles: the quantized rows kept in registers as the
# wgmma's register A operand (interpret mode cannot run that design: only here and in sm_90 lowering), or in the
# consumers' fp8 SMEM tiles; 64-column consumer tiles; 128-row CTA tiles.
QUANT_VARIANTS = [
    (("tile_n", 64), ("a_quant", "registers")),
    (("wg_split", "m"), ("a_quant", "registers")),
    (("a_quant", "registers"),),
    (("a_quant", "smem"),),
    (("tile_n", 64), ("a_quant", "smem")),
]


@pytest.mark.parametrize("k,n", PAIRS)
@pytest.mark.parametrize("t", [1, 3, 16])
def test_producer_quant_is_bitwise_the_prepass(rng, k, n, t):
  """TuningConfig.a_quant="producer" (kernels/bmm_row_quant.py: the producer warpgroup quantizes the T real rows from
  GMEM into a swizzled fp8 SMEM tile; raw Mosaic GPU, not runnable in interpret mode) computes the fp8 bytes and
  scales of quant.quantize_rows_fp8 and the same wgmmas as the pre-pass path: equal bit for bit. T = 16: four
  rows per warp; inputs with an all-zero row (scale 1) and rows of very different magnitudes (make_inputs)."""
  a, w8, ws = make_inputs(rng, t, 64, k, n)
  wt = bmm_mod.prepare_weight(w8)
  run = functools.partial(bmm_mod._bmm_jit, a, wt, ws, act_scale="per_token", weight_layout="hnk", impl="mosaic")
  pre = np.asarray(run(tuning=(("quantize_k", None),))).view(np.uint16)
  got = run(tuning=(("quantize_k", k), ("a_quant", "producer")))
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), pre)
  again = run(tuning=(("quantize_k", k), ("a_quant", "producer")))
  np.testing.assert_array_equal(np.asarray(again).view(np.uint16), pre)   # deterministic


@pytest.mark.parametrize("k,n", PAIRS)
@pytest.mark.parametrize("t", [1, 70])
def test_quantization_variants_are_bitwise_the_prepass(rng, k, n, t):
  """Every variant computes the same fp8 operands (the float32 operations of quant.quantize_rows_fp8) and the same
  wgmma chains and promotions per 128-wide K block as the pre-pass path, so the outputs are equal bit for bit (a
  64-column tile's products are a subset of a 128-column tile's; a register A operand holds the same bytes as the
  SMEM tile). Variants that do not fit this shape (SMEM, N % cta_n) are skipped in the loop."""
  a, w8, ws = make_inputs(rng, t, 64, k, n)
  wt = bmm_mod.prepare_weight(w8)
  run = functools.partial(bmm_mod._bmm_jit, a, wt, ws, act_scale="per_token", weight_layout="hnk", impl="mosaic")
  pre = np.asarray(run(tuning=(("quantize_k", None),))).view(np.uint16)
  ran = 0
  for v in QUANT_VARIANTS:
    tuning = v + (("quantize_k", k),)
    try:
      bmm_mod.default_config(t, k, n, 64, tuning=tuning)
    except ValueError:
      continue
    got = np.asarray(run(tuning=tuning)).view(np.uint16)
    np.testing.assert_array_equal(got, pre, err_msg=f"variant {v}")
    ran += 1
  assert ran >= 3


@pytest.mark.parametrize("t", [1, 70])
def test_two_pass_smem_quantization_is_bitwise_the_prepass(rng, t):
  """K = 576 > MAX_REGISTER_K: the op's default is the consumers' fp8 SMEM tiles with two SMEM passes over the
  bf16 rows (amax, then quantization) and one A buffer; same fp8 operands and wgmmas as the pre-pass path."""
  k, n, h = 576, 128, 16
  a, w8, ws = make_inputs(rng, t, h, k, n)
  c = bmm_mod.default_config(t, k, n, h)
  assert (c.quantize_k, c.a_quant, c.register_quant) == (k, "smem", False)
  wt = bmm_mod.prepare_weight(w8)
  run = functools.partial(bmm_mod._bmm_jit, a, wt, ws, act_scale="per_token", weight_layout="hnk", impl="mosaic")
  pre = np.asarray(run(tuning=(("quantize_k", None),))).view(np.uint16)
  np.testing.assert_array_equal(np.asarray(run()).view(np.uint16), pre)
  want = reference.quantize_and_bmm_fp8(a, w8, ws, act_scale="per_token")
  testing.assert_close_fp8(run(), want, rel_l2=_tolerance(), what="K = 576 kernel vs reference")
