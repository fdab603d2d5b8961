"""Per-row FP8 quantization of a few activation rows by one warpgroup, into a wgmma-ready SMEM tile (sm_90, raw
Mosaic GPU through ``plgpu.inline_mgpu``).

Used by :mod:`mla_pallas.kernels.bmm_fp8` with ``TuningConfig.a_quant="producer"`` at decode sizes (T <= MAX_ROWS,
one M tile): the producer warpgroup quantizes the tile's T real rows straight from GMEM (why: docs/kernels/bmm_fp8.md).

Per row (warp ``w`` takes rows w, w + 4, ..; lane ``l`` < K / 16 takes the 16 values [16 l, 16 l + 16)):

    x      = a[m0 + r, h, 16 l : 16 l + 16]            two 16-byte ld.global of bf16, converted to f32
    amax   = max |x| over the row                       per lane, then a butterfly over the warp (max is exact)
    scale  = amax · f32(1/448), 1 for an all-zero row   (written to ``scales[r]``)
    x8     = e4m3(x · (1 / scale))                      cvt.rn.satfinite (its saturation is the clip)

which are the float32 operations of :func:`mla_pallas.quant.quantize_rows_fp8` (and of the consumers' register
path in bmm_fp8), so the fp8 bytes and scales are the same. The 16 fp8 bytes go to row r of the tile
``a8`` ([K / 64, 64, 64] fp8, Tiling(8, 64) + 64-byte swizzle: chunk c = l // 4 at byte c · 4096 + 64 r, 16-byte
granule g = l % 4), stored at the swizzled address: the hardware's 64-byte swizzle XORs address bits 4-5 with
bits 7-8, computed here from the absolute SMEM address. Rows r >= ``rows`` of the tile are not written: the
wgmma rows they feed are output rows past T, which the kernel's TMA store drops.

The caller makes the stores visible to the async proxy (``plgpu.commit_smem``) before the wgmmas read them.
Interpret mode has no ``inline_mgpu`` (bmm_fp8 runs its consumer quantization there); this module is checked by
sm_90 lowering on the CPU (tests/test_bmm_fp8_kernel.py) and bitwise against the pre-pass path on the GPU
(tests/test_bmm_fp8_kernel_gpu.py).
"""
from __future__ import annotations

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels.common import FP8, swizzled
from mla_pallas.kernels.raw_mgpu import (SCALAR_LAYOUT, abs_max, c32, fp8_words, i32, load_f32, scalar_array,
                                         scalar_value, st_shared_f32, st_shared_v4, swizzle, thread_in_warpgroup,
                                         warp_max, when, wide)
from mla_pallas.quant import _INV_FP8_MAX

LANE_VALUES = 16     # values of a row per lane: two 16-byte bf16 loads, one 16-byte fp8 store
MAX_K = 32 * LANE_VALUES
MAX_ROWS = 16        # rows per tile (4 per warp)
CHUNK = 64           # fp8 bytes per swizzled tile row (one 64-wide K chunk)


def _row_body(a_base, a8_base, sc_base, heads: int, k: int, row, m0, h, lane):
  """Quantize tile row ``row`` (token m0 + row, head h) as described in the module docstring (one warp)."""
  f32 = ir.F32Type.get()
  lanes = k // LANE_VALUES
  active = arith.cmpi(arith.CmpIPredicate.ult, lane, c32(lanes)) if lanes < 32 else None
  my_lane = arith.select(active, lane, c32(0)) if active is not None else lane   # idle lanes read lane 0's
  tok = arith.addi(m0, row)
  elem = arith.addi(arith.muli(arith.addi(arith.muli(tok, c32(heads)), h), c32(k)),
                    arith.muli(my_lane, c32(LANE_VALUES)))
  xs = load_f32(a_base, wide(arith.muli(elem, c32(2))), ir.BF16Type.get(), LANE_VALUES)
  amax = abs_max(xs)
  if active is not None:
    amax = arith.select(active, amax, arith.constant(f32, 0.0))
  amax = warp_max(amax)
  scale = arith.mulf(amax, arith.constant(f32, float(_INV_FP8_MAX)))
  is_zero = arith.cmpf(arith.CmpFPredicate.OEQ, scale, arith.constant(f32, 0.0))
  scale = arith.select(is_zero, arith.constant(f32, 1.0), scale)
  w = fp8_words(xs, arith.divf(arith.constant(f32, 1.0), scale))

  def store():
    chunk = arith.divui(lane, c32(4))
    granule = arith.remui(lane, c32(4))
    addr = arith.addi(a8_base, arith.addi(arith.muli(chunk, c32(CHUNK * CHUNK)),
                                          arith.addi(arith.muli(row, c32(CHUNK)), arith.muli(granule, c32(16)))))
    st_shared_v4(swizzle(addr, CHUNK), w)
    when(arith.cmpi(arith.CmpIPredicate.eq, lane, c32(0)),
         lambda: st_shared_f32(arith.addi(sc_base, arith.muli(row, c32(4))), scale))

  if active is not None:
    when(active, store)
  else:
    store()


def quantize_rows_raw(a, a8, scales, m0, h, rows: int):
  """Raw Mosaic GPU body (one warpgroup): quantize tokens m0 .. m0 + rows of head ``h`` of ``a`` (GMEM memref
  [T8, H, K] bf16) into rows 0 .. rows of the fp8 tile ``a8`` (SMEM memref of a [K / 64, 64, 64] float8_e4m3fn tile,
  Tiling(8, 64) + 64-byte swizzle) and their scales into ``scales`` (SMEM memref [64] f32). ``m0``, ``h``: i32
  values; ``rows`` static, <= MAX_ROWS. K % 16 == 0, K <= MAX_K."""
  _, heads, k = ir.MemRefType(a.type).shape
  assert k % LANE_VALUES == 0 and k <= MAX_K and 1 <= rows <= MAX_ROWS, (k, rows)
  _, warp, lane = thread_in_warpgroup()
  a_base = mgpu_utils.memref_ptr(a)
  a8_base = llvm.ptrtoint(i32(), mgpu_utils.memref_ptr(a8))
  sc_base = llvm.ptrtoint(i32(), mgpu_utils.memref_ptr(scales))
  for j in range(-(-rows // 4)):
    row = arith.addi(warp, c32(4 * j))
    if 4 * (j + 1) <= rows:
      _row_body(a_base, a8_base, sc_base, heads, k, row, m0, h, lane)
    else:   # only some warps have a row in this round (warp-uniform branch)
      when(arith.cmpi(arith.CmpIPredicate.ult, row, c32(rows)),
           lambda row=row: _row_body(a_base, a8_base, sc_base, heads, k, row, m0, h, lane))


def quantize_rows(a_ref, a8_ref, scales_ref, m0, h, rows: int):
  """Pallas-level :func:`quantize_rows_raw` (run by one warpgroup): ``a_ref`` GMEM [T8, H, K] bf16, ``a8_ref`` SMEM
  [K / 64, 64, 64] fp8 with the transforms ``swizzled(FP8, 64)``, ``scales_ref`` SMEM [64] f32; ``m0``, ``h``
  int32 scalars (traced)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(swizzled(FP8, CHUNK)), plgpu.RefType(),
                                SCALAR_LAYOUT, SCALAR_LAYOUT))
  def f(ctx, a, a8, sc, m0_fa, h_fa):
    del ctx
    quantize_rows_raw(a, a8, sc, scalar_value(m0_fa), scalar_value(h_fa), rows)
  f(a_ref, a8_ref, scales_ref, scalar_array(m0), scalar_array(h))

