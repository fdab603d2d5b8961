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
from jax._src.lib.mlir.dialects import arith, gpu, llvm, math as math_dialect, scf, vector
from jax.experimental.mosaic import gpu as mgpu
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


def thread_in_warpgroup():
  """(tid, warp, lane) of this thread within its warpgroup: tid in [0, 128), warp in [0, 4), lane in [0, 32)."""
  tid = arith.remui(arith.index_cast(i32(), gpu.thread_id(gpu.Dimension.x)), c32(THREADS))
  return tid, arith.divui(tid, c32(32)), arith.remui(tid, c32(32))


def asm(result_type, args, text: str, constraints: str, side_effects: bool = False):
  """One inline PTX statement (``llvm.inline_asm``)."""
  return llvm.inline_asm(result_type, args, text, constraints, has_side_effects=side_effects)


def wgmma_commit() -> None:
  """``wgmma.commit_group``: the wgmmas issued since the last commit form one group."""
  asm(ir.Type.parse("!llvm.void"), [], "wgmma.commit_group.sync.aligned;", "", side_effects=True)


def wgmma_wait(pending: int) -> None:
  """``wgmma.wait_group``: wait until at most ``pending`` of this warpgroup's newest groups are in flight."""
  asm(ir.Type.parse("!llvm.void"), [], f"wgmma.wait_group.sync.aligned {pending};", "", side_effects=True)


def with_registers(acc, regs):
  """The Mosaic GPU accumulator ``acc`` (``mgpu.WGMMAAccumulator``) with its registers replaced by ``regs`` (the
  outputs of raw ``wgmma_m64`` calls on a copy of ``acc``'s registers), in ``acc``'s layout."""
  return mgpu.WGMMAAccumulator(_value=mgpu_fa.FragmentedArray(_registers=regs, _layout=acc._value.layout,
                                                              _is_signed=None),
                               _original_layout=acc._original_layout, _sync=False)


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


def float_bytes(dtype: ir.Type) -> int:
  """Bytes of a bf16 (2) or f32 (4) element type."""
  return 2 if str(dtype) == "bf16" else 4


def load_vectors(base, byte_offset, dtype: ir.Type, values: int):
  """``values`` (a multiple of 8) consecutive bf16 or f32 values at ``base`` (an llvm pointer) + ``byte_offset``
  (an i64 value; 16-byte aligned), as vector<8 x dtype> values (16-byte loads; :func:`widen` makes them f32)."""
  item = float_bytes(dtype)
  return [llvm.load(ir.VectorType.get((8,), dtype), byte_ptr64(base, arith.addi(byte_offset, c64(8 * item * j))),
                    alignment=16) for j in range(values // 8)]


def widen(vectors):
  """vector<8 x bf16 | f32> values as vector<8 x f32> (bf16 widened exactly)."""
  f32 = ir.F32Type.get()
  return [v if ir.VectorType(v.type).element_type == f32 else arith.extf(ir.VectorType.get((8,), f32), v)
          for v in vectors]


def load_f32(base, byte_offset, dtype: ir.Type, values: int):
  """``values`` (a multiple of 8) consecutive bf16 or f32 values at ``base`` (an llvm pointer) + ``byte_offset``
  (an i64 value; 16-byte aligned), as vector<8 x f32> values (16-byte loads, bf16 widened exactly)."""
  return widen(load_vectors(base, byte_offset, dtype, values))


def abs_max(vectors):
  """max |x| over vector<8 x f32> values (an f32 value)."""
  f32 = ir.F32Type.get()
  out = None
  for x in vectors:
    m = vector.reduction(f32, vector.CombiningKind.MAXIMUMF, math_dialect.absf(x))
    out = m if out is None else arith.maximumf(out, m)
  return out


def warp_max(x):
  """The f32 value ``x`` maxed over the 32 lanes of the warp (a butterfly; max is exact, so every lane gets the
  same bits)."""
  for d in (16, 8, 4, 2, 1):
    x = arith.maximumf(x, mgpu_utils.shfl_bfly(x, d))
  return x


def fp8_words(vectors, inv):
  """vector<8 x f32> values times the f32 value ``inv``, converted to e4m3 (round to nearest even, saturating: the
  clip of quant.quantize_fp8), as i32 words (two per vector)."""
  v8f = ir.VectorType.get((8,), ir.F32Type.get())
  inv_v = vector.broadcast(v8f, inv)
  q = convert_vectors([arith.mulf(x, inv_v) for x in vectors], ir.Float8E4M3FNType.get())
  words = [vector.bitcast(ir.VectorType.get((2,), i32()), reg) for reg in q]
  return [vector.extract(v, [], [j]) for v in words for j in range(2)]


def swizzle(addr, swizzle_bytes: int):
  """The SMEM address (i32) of byte ``addr`` of a tile with the hardware's ``swizzle_bytes`` (64 or 128) swizzle:
  address bits 4.. (the 16-byte granule) XOR bits 7.. (the 128-byte row within the pattern), computed from the
  absolute address."""
  mask = swizzle_bytes // 16 - 1
  bits = arith.andi(arith.shrui(addr, c32(7)), c32(mask))
  return arith.xori(addr, arith.shli(bits, c32(4)))


def st_shared_v4(addr, words) -> None:
  """Store four i32 words (16 bytes) at SMEM address ``addr`` (i32)."""
  asm(ir.Type.parse("!llvm.void"), [addr, *words], "st.shared.v4.b32 [$0], {$1, $2, $3, $4};", "r,r,r,r,r",
      side_effects=True)


def st_shared_f32(addr, value) -> None:
  """Store one f32 value at SMEM address ``addr`` (i32)."""
  asm(ir.Type.parse("!llvm.void"), [addr, value], "st.shared.f32 [$0], $1;", "r,f", side_effects=True)


def when(cond, body) -> None:
  """``body()`` under the i1 value ``cond`` (an ``scf.if`` without results)."""
  if_ = scf.IfOp(cond)
  with ir.InsertionPoint(if_.then_block):
    body()
    scf.yield_([])
