"""Helpers for raw Mosaic GPU code run inside Pallas kernels through ``plgpu.inline_mgpu`` (sm_90).

``inline_mgpu`` passes refs (as memrefs) and register arrays (as ``FragmentedArray``) only, so a traced int32
scalar travels as a warpgroup array (:func:`scalar_array`) and is read back inside the body
(:func:`scalar_value`). The rest builds i32 constants, byte-offset pointers and the thread's position in its
warpgroup. Used by :mod:`mla_pallas.kernels.rope_direct`, :mod:`mla_pallas.kernels.bmm_row_quant` and
:mod:`mla_pallas.kernels.vt_registers`.
"""
from __future__ import annotations

import numpy as np
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, gpu, llvm, vector
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

THREADS = 128                 # one warpgroup
SCALAR_LAYOUT = plgpu.Layout.WG_STRIDED((THREADS,), 1)


def i32():
  return ir.IntegerType.get_signless(32)


def c32(x: int):
  """An i32 constant."""
  return arith.constant(i32(), x)


def byte_ptr(base, byte_offset):
  """``base`` (an llvm pointer) advanced by ``byte_offset`` (an i32 value) bytes."""
  i64 = ir.IntegerType.get_signless(64)
  return mgpu_utils.getelementptr(base, [arith.extui(i64, byte_offset)], ir.IntegerType.get_signless(8))


def thread_in_warpgroup():
  """(tid, warp, lane) of this thread within its warpgroup: tid in [0, 128), warp in [0, 4), lane in [0, 32)."""
  tid = arith.remui(arith.index_cast(i32(), gpu.thread_id(gpu.Dimension.x)), c32(THREADS))
  return tid, arith.divui(tid, c32(32)), arith.remui(tid, c32(32))


def asm(result_type, args, text: str, constraints: str, side_effects: bool = False):
  """One inline PTX statement (``llvm.inline_asm``)."""
  return llvm.inline_asm(result_type, args, text, constraints, has_side_effects=side_effects)


def scalar_array(x):
  """An int32 scalar (traced) as a warpgroup array: ``inline_mgpu`` takes refs and register arrays only."""
  return plgpu.layout_cast(jnp.full((THREADS,), x, jnp.int32), SCALAR_LAYOUT)


def scalar_value(fa):
  """The i32 value of a :func:`scalar_array` inside an ``inline_mgpu`` body."""
  reg = fa.registers.flat[0]
  return vector.extract(reg, [], [0]) if str(reg.type).startswith("vector") else reg


def i64():
  return ir.IntegerType.get_signless(64)


def c64(x: int):
  """An i64 constant."""
  return arith.constant(i64(), x)


def wide(x):
  """A non-negative i32 value as i64 (for byte offsets that may pass 2 GiB, e.g. into a large paged cache)."""
  return arith.extui(i64(), x)


def byte_ptr64(base, byte_offset):
  """``base`` (an llvm pointer) advanced by ``byte_offset`` (an i64 value) bytes."""
  return mgpu_utils.getelementptr(base, [byte_offset], ir.IntegerType.get_signless(8))


def convert_vectors(vectors, dtype: ir.Type):
  """vector<8 x f32> values converted to ``dtype`` (e.g. bf16, float8_e4m3fn: round to nearest even, fp8
  saturating) by Mosaic GPU's own ``FragmentedArray.astype`` (the conversions its register arrays use), as
  vector<8 x dtype> values. The vectors are wrapped in a strided fragmented array only to reach that code."""
  regs = np.array(list(vectors), dtype=object)
  fa = mgpu_fa.FragmentedArray(_registers=regs, _layout=mgpu_fa.WGStridedFragLayout((len(regs) * 8 * THREADS,), 8),
                               _is_signed=None)
  return list(fa.astype(dtype).registers.flat)
