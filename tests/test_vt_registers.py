"""kernels/vt_registers.py on its own: Vᵀ [512, 64 keys] as the f16 register A operand of Oᵀ += Vᵀ · Pᵀ, read from a
128-byte-swizzled fp8 K tile, and the row stores of Oᵀ (row r of M block g = latent column 8r + g).

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


def _inputs(rng, n):
  k = jnp.asarray(rng.standard_normal((5, 64, 128)).astype(np.float32)).astype(FP8)
  pt = jnp.asarray(rng.random((64, n)).astype(np.float32)).astype(jnp.float16)
  return k, pt


def test_latent_of_row_covers_every_column_once():
  cols = sorted(vt_registers.latent_of_row(g, r) for g in range(8) for r in range(64))
  assert cols == list(range(512))


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
