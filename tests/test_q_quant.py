"""kernels/q_quant.py: the attention kernels' in-kernel Q quantization (quantize_head_rows), bitwise against the XLA
pre-pass (quant.quantize_rows_fp8, the zero columns, the row scale max(|q| · k)) in interpret mode with race
detection, lowered for sm_90a, and natively on a GPU."""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas import testing
from mla_pallas.kernels import common, q_quant
from mla_pallas.ops import sparse_decode as sd


RACES = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=True)


def _xla(q, kv_scale, softmax_scale):
  """The op's XLA pre-pass for heads on M (64-row tiles): quantize_rows_fp8, the zero columns, max(|q| · k)."""
  return sd._xla_kernel_q(q, "sm90", q.shape[1] // 64, softmax_scale, jnp.float32(kv_scale))


def _inputs(rng, T, H, dtype):
  q = jnp.asarray(rng.standard_normal((T, H, common.D_QK)) * 3, dtype)
  q = q.at[0, 5].set(0)                           # an all-zero row: scale 1
  q = q.at[-1, -1, 7].set(jnp.asarray(1e4, dtype))    # one large value: the row's scale
  return q


def _assert_bitwise(got, want):
  (q8, rs), (w8, wrs) = got, want
  assert q8.shape == w8.shape and q8.dtype == w8.dtype and rs.shape == wrs.shape
  assert np.array_equal(np.asarray(q8).view(np.uint8), np.asarray(w8).view(np.uint8))
  assert np.array_equal(np.asarray(rs), np.asarray(wrs))


def _head_rows_kernel(T: int, H: int, interpret):
  """A test kernel around q_quant.quantize_head_rows (the heads-on-N attention kernel's Q): token t's H rows of q
  [T · H, 576] into its 16-row fp8 tile and amax row, both copied out: (q8 [T, 16, 640] fp8, amax [T, 32] f32, of
  which [:, :16] are written)."""
  from jax import lax
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu

  def body(q_gmem, q8_gmem, amax_gmem, q_sw, amax_smem):
    t = lax.axis_index("t")
    quantize = q_quant.quantize_head_rows_interpret if interpret else q_quant.quantize_head_rows
    quantize(q_gmem, q_sw, amax_smem, t * H, H)
    plgpu.commit_smem()
    for c in range(common.SW_CHUNKS):
      plgpu.copy_smem_to_gmem(q_sw.at[c], q8_gmem.at[t, :, pl.ds(c * common.SW_CHUNK, common.SW_CHUNK)])
    plgpu.copy_smem_to_gmem(amax_smem, amax_gmem.at[t])
    plgpu.wait_smem_to_gmem(0)

  rows = q_quant.HEAD_ROWS
  return plgpu.kernel(
      body, out_type=(jax.ShapeDtypeStruct((T, rows, common.Q_SW_COLS), common.FP8),
                      jax.ShapeDtypeStruct((T, 32), jnp.float32)),
      grid=(T,), grid_names=("t",),
      scratch_types=[common.q_scratch(rows), plgpu.SMEM((32,), jnp.float32)],
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE), **common.interpret_kwargs(interpret))


def _check_head_rows(q, q8, amax, kv_scale, softmax_scale):
  """The heads-on-N tile of each token is the first 16 rows of the XLA pre-pass's zero-padded 64-row tile (rows
  past H all zeros), and row_scales(amax) its row scales, bitwise."""
  H = q.shape[1]
  w8, wrs = _xla(jnp.pad(q, ((0, 0), (0, 64 - H), (0, 0))), kv_scale, softmax_scale)
  rows = q_quant.HEAD_ROWS
  assert np.array_equal(np.asarray(q8).view(np.uint8), np.asarray(w8[:, :rows]).view(np.uint8))
  rs = q_quant.row_scales(amax[:, :rows], softmax_scale, jnp.float32(kv_scale))
  assert np.array_equal(np.asarray(rs), np.asarray(wrs[:, :rows]))


@pytest.mark.parametrize("T,H,dtype,kv_scale", [(3, 8, jnp.bfloat16, 0.5), (2, 16, jnp.float32, 1.0)])
def test_head_rows_bitwise_interpret(rng, T, H, dtype, kv_scale):
  """quantize_head_rows' interpret-mode form (Pallas array ops) makes the XLA pre-pass's bytes and scales."""
  q = _inputs(rng, T, H, dtype)
  testing.reset_interpreter()
  q8, amax = _head_rows_kernel(T, H, RACES)(q.reshape(T * H, -1))
  assert not testing.races_found()
  _check_head_rows(q, q8, amax, kv_scale, 192 ** -0.5)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("T,H,dtype", [(5, 8, jnp.bfloat16), (3, 16, jnp.float32), (4, 16, jnp.bfloat16)])
def test_head_rows_bitwise_gpu(rng, T, H, dtype):
  """The raw-PTX form (one warp per row, butterfly max, swizzled 16-byte stores) makes the same bytes and scales.
  (Its use in the attention kernel was checked on the H200 bitwise against the XLA pre-pass before that path was
  deleted: docs/kernels/sparse_decode_sm90.md, "Q in the heads-on-N kernel".)"""
  q = _inputs(rng, T, H, dtype)
  q8, amax = jax.jit(_head_rows_kernel(T, H, False))(q.reshape(T * H, -1))
  _check_head_rows(q, q8, amax, 0.5, 576 ** -0.5)


def test_head_rows_lower_for_sm90():
  """sm_90a lowering of the raw form: per warp 4 rows, each 2 16-byte loads of latent and 2 of rope, a 5-step
  butterfly, two 16-byte swizzled stores (latent; tail chunk) and lane 0's amax store."""
  S = jax.ShapeDtypeStruct
  low = testing.lower_for_cuda(_head_rows_kernel(2, 16, False), S((32, common.D_QK), jnp.bfloat16))
  assert low.count(r"st\.shared\.v4\.b32") == 4 * 2 and low.count(r"st\.shared\.f32") == 4
  assert low.count(r"shfl\.sync\.bfly|nvvm\.shfl\.sync\s+bfly") == 4 * 5


@pytest.mark.parametrize("load_regs,in_flight", [(q_quant.Q_LOAD_REGS, 4), (0, 1)])
def test_head_rows_loads_in_flight(monkeypatch, load_regs, in_flight):
  """The raw form issues the 16-byte q loads of a batch of rows (Q_LOAD_REGS registers per lane: all 4 bf16 rows a
  warp has here) before the first store, so that their global latencies overlap; with Q_LOAD_REGS = 0, one row's
  4 loads at a time (the diagnosis script's "q_rows_serial" row)."""
  monkeypatch.setattr(q_quant, "Q_LOAD_REGS", load_regs)
  S = jax.ShapeDtypeStruct
  low = testing.lower_for_cuda(_head_rows_kernel(2, 16, False), S((32, common.D_QK), jnp.bfloat16))
  txt = "".join(low.mosaic)
  first_store = txt.index("st.shared.v4.b32")
  loads = re.findall(r"llvm\.load[^\n]*vector<8xbf16>", txt[:first_store])
  assert len(loads) == 4 * in_flight
  assert len(re.findall(r"llvm\.load[^\n]*vector<8xbf16>", txt)) == 4 * 4
