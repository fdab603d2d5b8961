"""kernels/q_quant.py: the heads-on-N kernel's in-kernel Q quantization (quantize_head_rows) and the sparse heads-on-M
kernels' Q pre-pass in one kernel, bitwise against the XLA pre-pass
(quant.quantize_rows_fp8, the zero columns, the row scale max(|q| · k)) in interpret mode with race detection, lowered for
sm_90a, and natively on a GPU; at the op level (where it is the default pre-pass for H a multiple of 64) the kernel gives bitwise the outputs of
the XLA pre-pass."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas import testing
from mla_pallas.kernels import common, q_quant
from mla_pallas.ops import sparse_decode as sd

from _sparse_inputs import make_case, run_kernel

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


@pytest.mark.parametrize("T,H,dtype,kv_scale", [(3, 128, jnp.bfloat16, 0.5), (2, 64, jnp.float32, 1.0)])
def test_bitwise_interpret(rng, T, H, dtype, kv_scale):
  q = _inputs(rng, T, H, dtype)
  testing.reset_interpreter()
  got = q_quant.quantize_q(q, kv_scale, 192 ** -0.5, interpret=RACES)
  assert not testing.races_found()
  _assert_bitwise(got, _xla(q, kv_scale, 192 ** -0.5))


def test_errors():
  with pytest.raises(NotImplementedError, match="multiples of 64"):
    q_quant.quantize_q(jnp.zeros((2, 32, 576), jnp.bfloat16), 1.0, 0.1)
  with pytest.raises(ValueError, match="576"):
    q_quant.quantize_q(jnp.zeros((2, 64, 512), jnp.bfloat16), 1.0, 0.1)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_for_sm90(dtype):
  S = jax.ShapeDtypeStruct
  low = testing.lower_for_cuda(q_quant.build(4, 128, jnp.dtype(dtype).name, 0.04), S((4, 128, 576), dtype),
                               S((1,), jnp.float32))
  txt = "".join(low.mosaic)
  assert txt.count("cp.async.bulk.tensor") >= 3 + 5 + 1 or txt.count("cp.async.bulk") >= 9   # 3 in, 5 + 1 out


@pytest.mark.parametrize("H", [64, 128])
def test_op_prepass_kernel_is_bitwise_the_xla_prepass(rng, H, monkeypatch):
  """sparse_mla_decode's pre-pass kernel (its default from 2048 q rows under the "producer_vt" schedule; "twin"
  quantizes Q in the attention kernel) feeds the attention kernel the same Q bytes and scales as the XLA pre-pass:
  the op's outputs are bitwise equal with the kernel replaced by the XLA ops."""
  monkeypatch.setattr(sd, "PREPASS_KERNEL_MIN_ROWS", 0)     # the kernel from the first row (default: 2048 rows)
  case = make_case(rng, B=2, s_q=1, H=H, topk=200, page_size=16, num_pages=64)
  tuning = (("schedule", "producer_vt"),)                   # the schedule that takes a pre-quantized Q
  out = run_kernel(case, interpret=True, tuning=tuning)
  calls = []

  def xla_prepass(q, kv_scale, softmax_scale, interpret=False):
    calls.append(q.shape)
    return _xla(q, kv_scale, softmax_scale)
  monkeypatch.setattr(q_quant, "quantize_q", xla_prepass)
  jax.clear_caches()
  base = run_kernel(case, interpret=True, tuning=tuning)
  assert calls, "the op did not route its pre-pass through q_quant.quantize_q"
  for a, b in zip(out, base):
    assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("T,H", [(256, 128), (37, 64)])
def test_bitwise_gpu(rng, T, H):
  q = _inputs(rng, T, H, jnp.bfloat16)
  _assert_bitwise(q_quant.quantize_q(q, 0.5, 576 ** -0.5), jax.jit(_xla, static_argnums=2)(q, 0.5, 576 ** -0.5))


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
