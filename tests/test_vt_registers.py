"""kernels/vt_registers.py on its own: Vᵀ [512, 64 keys] as the f16 register A operand of Oᵀ += Vᵀ · Pᵀ, read from a
128-byte-swizzled fp8 K tile, and the row stores of Oᵀ (row r of M block g = latent column 8r + g; in the
heads-on-M multipliers' half form, ``latent_of_half_row``).

Interpret mode has no ``inline_mgpu``, so on the CPU this module is checked by lowering for sm_90a; the numbers
are checked on the GPU (marked), against float64 on the same fp8 / f16 inputs.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas import testing
from mla_pallas.kernels import common, vt_registers

FP8 = common.FP8


def _kernel(n: int, out_dtype):
  """K tile [5, 64, 128] fp8 and Pᵀ [64, n] f16 -> O [n, 512] = (Pᵀ)ᵀ · V, V = K chunks 0-3 as [64, 512]."""
  def body(k_gmem, pt_gmem, o_gmem, k_smem, pt_smem, bar):
    plgpu.copy_gmem_to_smem(k_gmem, k_smem, bar)
    plgpu.copy_gmem_to_smem(pt_gmem, pt_smem, bar)
    plgpu.barrier_wait(bar)
    words = vt_registers.load_v_words(k_smem)
    accs = tuple(plgpu.layout_cast(jnp.zeros((64, n), jnp.float32), plgpu.Layout.WGMMA)
                 for _ in range(vt_registers.M_BLOCKS))
    accs = vt_registers.pv_wgmmas(words, pt_smem, accs, 2 * n)
    accs = vt_registers.pv_wgmmas(words, pt_smem, accs, 2 * n)     # accumulates: twice the product
    vt_registers.store_o(accs, o_gmem)

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((n, 512), out_dtype), grid=(1,), grid_names=("x",),
      scratch_types=[plgpu.SMEM((5, 64, 128), FP8, transforms=common.swizzled(FP8, 128)),
                     plgpu.SMEM((64, n), jnp.float16, transforms=common.swizzled(jnp.float16, 2 * n)),
                     plgpu.Barrier(num_arrivals=2)],
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE))


def _half_kernel(out_dtype):
  """The heads-on-M multipliers' form: K tile [5, 64, 128] fp8 and P [64 heads, 64 keys] f16 (rows of heads, read
  as the K-major Pᵀ) -> O [64, 512] = P · V, each half of the latent columns from its own words and 4 blocks."""
  def body(k_gmem, p_gmem, o_gmem, k_smem, p_smem, bar):
    plgpu.copy_gmem_to_smem(k_gmem, k_smem, bar)
    plgpu.copy_gmem_to_smem(p_gmem, p_smem, bar)
    plgpu.barrier_wait(bar)
    for half in range(2):
      words = vt_registers.load_v_half_words(k_smem, half)
      accs = tuple(plgpu.layout_cast(jnp.zeros((64, 64), jnp.float32), plgpu.Layout.WGMMA)
                   for _ in range(vt_registers.HALF_BLOCKS))
      accs = vt_registers.pv_wgmmas(words, p_smem, accs, 128, blocks=tuple(range(vt_registers.HALF_BLOCKS)),
                                    p_rows=True, pipelined=True)
      vt_registers.store_half_o(accs, o_gmem, half)

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((64, 512), out_dtype), grid=(1,), grid_names=("x",),
      scratch_types=[plgpu.SMEM((5, 64, 128), FP8, transforms=common.swizzled(FP8, 128)),
                     plgpu.SMEM((64, 64), jnp.float16, transforms=common.swizzled(jnp.float16, 128)),
                     plgpu.Barrier(num_arrivals=2)],
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE))


def _inputs(rng, n):
  k = jnp.asarray(rng.standard_normal((5, 64, 128)).astype(np.float32)).astype(FP8)
  pt = jnp.asarray(rng.random((64, n)).astype(np.float32)).astype(jnp.float16)
  return k, pt


def test_latent_of_row_covers_every_column_once():
  cols = sorted(vt_registers.latent_of_row(g, r) for g in range(8) for r in range(64))
  assert cols == list(range(512))


def test_latent_of_half_row_covers_every_column_once():
  for half in range(2):
    cols = sorted(vt_registers.latent_of_half_row(half, g, r) for g in range(4) for r in range(64))
    assert cols == list(range(256 * half, 256 * half + 256))


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_half_form_lowers_for_sm90(out_dtype):
  """Per half and thread: 16 64-bit SMEM loads (one per key), one byte permute per register pair of two blocks
  (2 pairs x 16) and one e4m3x2 -> f16x2 conversion per A register (4 blocks x 16), 16 m64n64k16 wgmmas; per 8
  heads, 2 heads x one 8-column vector store."""
  rng = np.random.default_rng(0)
  k, _ = _inputs(rng, 64)
  low = testing.lower_for_cuda(_half_kernel(out_dtype), k, jnp.zeros((64, 64), jnp.float16), arch=(9, 0))
  assert low.count(r"ld\.shared\.v2\.b32") == 2 * 16
  assert low.count(r"prmt\.b32") == 2 * 32 and low.count(r"cvt\.rn\.f16x2\.e4m3x2") == 2 * 64
  assert low.count(r"m64n64k16\.f32\.f16\.f16") == 2 * 16
  assert low.count(r"\{alignment = 16 : i64\} : vector<8x") == 2 * 8 * 2


@pytest.mark.parametrize("n,out_dtype", [(16, jnp.bfloat16), (32, jnp.float32)])
def test_lowers_for_sm90(n, out_dtype):
  """Per thread: 32 64-bit SMEM loads (16 keys x 2 halves); per product (two here, from the same loads) 64 byte
  permutes, 128 e4m3x2 -> f16x2 conversions and 8 M blocks x 4 k16 steps of m64nNk16 f16 wgmmas; 4 row stores
  per 8 heads."""
  rng = np.random.default_rng(0)
  low = testing.lower_for_cuda(_kernel(n, out_dtype), *_inputs(rng, n), arch=(9, 0))
  assert low.count(r"ld\.shared\.v2\.b32") == 32
  assert low.count(r"prmt\.b32") == 2 * 64 and low.count(r"cvt\.rn\.f16x2\.e4m3x2") == 2 * 128
  assert low.count(rf"m64n{n}k16\.f32\.f16\.f16") == 2 * 32
  assert low.count(r"\{alignment = 16 : i64\} : vector<8x") == 4 * n // 8


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("n,out_dtype", [(16, jnp.bfloat16), (32, jnp.float32)])
def test_matches_float64(rng, n, out_dtype):
  """O = 2 (Pᵀ)ᵀ V on exact fp8 / f16 inputs: f32 accumulation of 64 products, then the output rounding (bf16:
  2^-9 relative; f32: the f32 sums' ~64 · 2^-24)."""
  k, pt = _inputs(rng, n)
  out = np.asarray(jax.jit(_kernel(n, out_dtype))(k, pt).astype(jnp.float32), np.float64)
  v = np.asarray(k.astype(jnp.float32), np.float64)[:4].transpose(1, 0, 2).reshape(64, 512)
  ref = 2 * np.asarray(pt.astype(jnp.float32), np.float64).T @ v
  rtol = 2.0 ** -8 if out_dtype == jnp.bfloat16 else 1e-5
  np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol * np.abs(ref).max())


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_half_form_matches_float64(rng, out_dtype):
  """O = P · V through the multipliers' half form (latent_of_half_row's order in the loads and the stores) on
  exact fp8 / f16 inputs: f32 accumulation of 64 products, then the output rounding (as above)."""
  k, _ = _inputs(rng, 64)
  p = jnp.asarray(rng.random((64, 64)).astype(np.float32)).astype(jnp.float16)
  out = np.asarray(jax.jit(_half_kernel(out_dtype))(k, p).astype(jnp.float32), np.float64)
  v = np.asarray(k.astype(jnp.float32), np.float64)[:4].transpose(1, 0, 2).reshape(64, 512)
  ref = np.asarray(p.astype(jnp.float32), np.float64) @ v
  rtol = 2.0 ** -8 if out_dtype == jnp.bfloat16 else 1e-5
  np.testing.assert_allclose(out, ref, rtol=rtol, atol=rtol * np.abs(ref).max())
