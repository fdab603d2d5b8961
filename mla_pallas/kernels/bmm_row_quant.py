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
from jax._src.lib.mlir.dialects import arith, llvm, math as math_dialect, vector
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels.common import FP8, swizzled
from mla_pallas.kernels.raw_mgpu import (SCALAR_LAYOUT, abs_max, byte_ptr64, c32, c64, fp8_words, i32, load_f32,
                                         scalar_array, scalar_value, st_shared_f32, st_shared_v4, swizzle,
                                         thread_in_warpgroup, warp_max, when, wide)
from mla_pallas.quant import _INV_FP8_MAX

LANE_VALUES = 16     # values of a row per lane: two 16-byte bf16 loads, one 16-byte fp8 store
MAX_K = 32 * LANE_VALUES
MAX_ROWS = 16        # rows per tile (4 per warp)
CHUNK = 64           # fp8 bytes per swizzled tile row (one 64-wide K chunk)


def _row_body(a_base, a8_base, sc_base, heads: int, k: int, row, m0, h, lane):
  """Quantize tile row ``row`` (token m0 + row, head h) as described in the module docstring (one warp)."""
  lanes = k // LANE_VALUES
  active = arith.cmpi(arith.CmpIPredicate.ult, lane, c32(lanes)) if lanes < 32 else None
  my_lane = arith.select(active, lane, c32(0)) if active is not None else lane   # idle lanes read lane 0's
  tok = arith.addi(m0, row)
  elem = arith.addi(arith.muli(arith.addi(arith.muli(tok, c32(heads)), h), c32(k)),
                    arith.muli(my_lane, c32(LANE_VALUES)))
  xs = load_f32(a_base, wide(arith.muli(elem, c32(2))), ir.BF16Type.get(), LANE_VALUES)
  _quantize_store(xs, a8_base, sc_base, row, lane, active)


def _quantize_store(xs, a8_base, sc_base, row, lane, active=None):
  """The lane's LANE_VALUES values ``xs`` (vector<8 x f32> values) of tile row ``row``: row amax over the warp,
  scale, e4m3 bytes into the swizzled tile and (lane 0) the scale, as described in the module docstring. ``active``:
  None (all 32 lanes hold values) or the i1 "this lane holds values" (idle lanes add 0 to the amax, store nothing)."""
  f32 = ir.F32Type.get()
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


MERGE_SPLITS_PER_LOAD = 4   # split partials whose 16-byte loads a lane has in flight at once (64 registers)


def merge_rounds(rows: int, splits: int) -> tuple[int, int]:
  """Load rounds (MERGE_SPLITS_PER_LOAD partials in flight per lane, one L2 round trip each) of the two ways
  :func:`merge_rows_raw` spreads a merge over the producer's 4 warps: (warps share each row, a warp per row)."""
  def ceil(a, b):
    return -(-a // b)
  return rows * ceil(ceil(splits, 4), MERGE_SPLITS_PER_LOAD), ceil(rows, 4) * ceil(splits, MERGE_SPLITS_PER_LOAD)


def merge_rows_raw(parts, lse, a8, scales, acc_smem, m0, h, rows: int, tiles_per_token: int):
  """Raw Mosaic GPU body (one warpgroup): merge the split-KV partials of tokens m0 .. m0 + rows of head ``h``
  (see :func:`merge_rows`) and quantize the merged rows into ``a8`` / ``scales`` as :func:`quantize_rows_raw` does.

  A row's merge: the max m of its S lse values (lane l reads splits l, l + 32, ..; a butterfly; issued after the
  first partials' loads, so that their L2 round trips overlap), then weights exp(lse_s − m) and weighted sums of lane l's 16 values [16 l, 16 l + 16) of each partial (MERGE_SPLITS_PER_LOAD
  partials' 32-byte loads in flight, then their sums), the total weight, a division, the row quantization. The 4
  warps take the work in whichever way needs fewer load rounds (:func:`merge_rounds`):
  * warps share each row (few rows, many splits): warp w sums splits w, w + 4, ..; the four warps' sums and weight
    totals meet in ``acc_smem`` ([2, 4, K + 4] f32: two rows in flight, column K the total) behind a warpgroup
    barrier, and warp ``row % 4`` adds them in warp order, divides and quantizes;
  * a warp per row (rows w, w + 4, ..): the warp sums all S splits in order and quantizes; no SMEM, no barrier."""
  _, splits, tile_rows, k = ir.MemRefType(parts.type).shape
  assert k == MAX_K and 1 <= rows <= MAX_ROWS and tile_rows == 64, (k, rows, tile_rows)
  f32 = ir.F32Type.get()
  v8f = ir.VectorType.get((8,), f32)
  _, warp, lane = thread_in_warpgroup()
  parts_base = mgpu_utils.memref_ptr(parts)
  lse_base = mgpu_utils.memref_ptr(lse)
  a8_base = llvm.ptrtoint(i32(), mgpu_utils.memref_ptr(a8))
  sc_base = llvm.ptrtoint(i32(), mgpu_utils.memref_ptr(scales))
  ninf = arith.constant(f32, float("-inf"))
  zero = arith.constant(f32, 0.0)
  head_row = arith.remui(h, c32(64))

  def row_start(row):   # element (tile, split 0, head_row) of token m0 + row (row: i32 value)
    tile = arith.addi(arith.muli(arith.addi(m0, row), c32(tiles_per_token)), arith.divui(h, c32(64)))
    return arith.addi(arith.muli(tile, c32(splits * 64)), head_row)

  def lse_at(first, split):   # lse[tile, split, head_row] (split: i32 value), an f32 value
    off = arith.muli(wide(arith.addi(first, arith.muli(split, c32(64)))), c64(4))
    return llvm.load(f32, byte_ptr64(lse_base, off))

  def row_max(first):   # m with −inf taken as 0
    m = ninf
    for j in range(-(-splits // 32)):
      s = arith.addi(lane, c32(32 * j))
      if 32 * (j + 1) > splits:   # lanes past the last split read it again (max is idempotent)
        s = arith.minui(s, c32(splits - 1))
      m = arith.maximumf(m, lse_at(first, s))
    m = warp_max(m)
    return arith.select(arith.cmpf(arith.CmpFPredicate.OEQ, m, ninf), zero, m)

  def weighted_sum(first, split_ids):   # split_ids: (i32 split, i1 valid or None) in summation order
    acc = [arith.constant(v8f, ir.DenseElementsAttr.get_splat(v8f, ir.FloatAttr.get(f32, 0.0)))] * 2
    tot = zero
    m_use = None
    for j0 in range(0, len(split_ids), MERGE_SPLITS_PER_LOAD):
      batch = []
      for s, valid in split_ids[j0:j0 + MERGE_SPLITS_PER_LOAD]:
        elem = arith.addi(arith.muli(arith.addi(first, arith.muli(s, c32(64))), c32(k)),
                          arith.muli(lane, c32(LANE_VALUES)))
        batch.append((lse_at(first, s), load_f32(parts_base, arith.muli(wide(elem), c64(4)), f32, LANE_VALUES),
                      valid))
      if m_use is None:   # the first partials' loads are issued before the max's: one L2 round trip less
        m_use = row_max(first)
      for l_s, xs, valid in batch:
        w = math_dialect.exp(arith.subf(l_s, m_use))
        if valid is not None:
          w = arith.select(valid, w, zero)
        tot = arith.addf(tot, w)
        wv = vector.broadcast(v8f, w)
        acc = [arith.addf(a, arith.mulf(wv, x)) for a, x in zip(acc, xs)]
    return acc, tot

  def store_row(row, sums, total):   # divide and quantize into tile row ``row`` (i32 value)
    total = arith.select(arith.cmpf(arith.CmpFPredicate.OEQ, total, zero), arith.constant(f32, 1.0), total)
    tv = vector.broadcast(v8f, total)
    _quantize_store([arith.divf(x, tv) for x in sums], a8_base, sc_base, row, lane)

  shared, per_warp = merge_rounds(rows, splits)
  if per_warp <= shared:
    for j in range(-(-rows // 4)):
      def one_row(j=j):
        row = arith.addi(warp, c32(4 * j))
        first = row_start(row)
        acc, tot = weighted_sum(first, [(c32(s), None) for s in range(splits)])
        store_row(row, acc, tot)
      if 4 * (j + 1) <= rows:
        one_row()
      else:   # only some warps have a row in this round (warp-uniform branch)
        when(arith.cmpi(arith.CmpIPredicate.ult, arith.addi(warp, c32(4 * j)), c32(rows)), one_row)
    return

  acc_base = mgpu_utils.memref_ptr(acc_smem)
  stride = k + 4                                          # acc_smem row: K sums, then the weight total
  for row in range(rows):
    first = row_start(c32(row))
    ids = []
    for j in range(-(-splits // 4)):   # warp w: splits w + 4 j (past the last: weight 0)
      s = arith.addi(warp, c32(4 * j))
      valid = arith.cmpi(arith.CmpIPredicate.ult, s, c32(splits)) if 4 * (j + 1) > splits else None
      ids.append((arith.select(valid, s, c32(splits - 1)) if valid is not None else s, valid))
    acc, tot = weighted_sum(first, ids)
    buf = (row % 2) * 4 * stride
    mine_at = arith.muli(arith.addi(c32(buf), arith.addi(arith.muli(warp, c32(stride)),
                                                           arith.muli(lane, c32(LANE_VALUES)))), c32(4))
    for i, a in enumerate(acc):
      llvm.store(a, byte_ptr64(acc_base, wide(arith.addi(mine_at, c32(32 * i)))), alignment=16)
    when(arith.cmpi(arith.CmpIPredicate.eq, lane, c32(0)),
         lambda: llvm.store(tot, byte_ptr64(acc_base, wide(arith.muli(
             arith.addi(c32(buf + k), arith.muli(warp, c32(stride))), c32(4))))))
    mgpu_utils.warpgroup_barrier()   # the four warps' sums are in acc_smem (row % 2 buffer)

    def finish(row=row, buf=buf):
      sums, total = None, None
      for w_ in range(4):
        base = (buf + w_ * stride) * 4
        at = arith.addi(c32(base), arith.muli(lane, c32(LANE_VALUES * 4)))
        part = [llvm.load(v8f, byte_ptr64(acc_base, wide(arith.addi(at, c32(32 * i)))), alignment=16)
                for i in range(2)]
        t_w = llvm.load(f32, byte_ptr64(acc_base, wide(c32(base + 4 * k))))
        sums = part if sums is None else [arith.addf(x, y) for x, y in zip(sums, part)]
        total = t_w if total is None else arith.addf(total, t_w)
      store_row(c32(row), sums, total)

    when(arith.cmpi(arith.CmpIPredicate.eq, warp, c32(row % 4)), finish)


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



def merge_rows(parts_ref, lse_ref, a8_ref, scales_ref, acc_ref, m0, h, rows: int, tiles_per_token: int):
  """Pallas-level :func:`merge_rows_raw` (run by one warpgroup): the A rows of tokens m0 .. m0 + rows of head ``h``
  as the merge of split-KV attention partials, quantized like :func:`quantize_rows`.

  ``parts_ref`` GMEM [T · tiles_per_token, S, 64, K] f32 and ``lse_ref`` GMEM [T · tiles_per_token, S, 64] f32: the
  heads-on-M attention kernel's normalised per-split outputs and natural-log lse, head h of token t at tile
  t · tiles_per_token + h // 64, row h % 64 (:func:`mla_pallas.ops.sparse_decode.combine_splits` merges the same
  arrays: weights exp(lse_s − max_s lse_s), max −inf taken as 0, a zero total as 1). K = MAX_K.
  ``acc_ref`` SMEM [2, 4, K + 4] f32 scratch; the others as in :func:`quantize_rows`."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.RefType(swizzled(FP8, CHUNK)),
                                plgpu.RefType(), plgpu.RefType(), SCALAR_LAYOUT, SCALAR_LAYOUT))
  def f(ctx, parts, lse, a8, sc, acc, m0_fa, h_fa):
    del ctx
    merge_rows_raw(parts, lse, a8, sc, acc, scalar_value(m0_fa), scalar_value(h_fa), rows, tiles_per_token)
  f(parts_ref, lse_ref, a8_ref, scales_ref, acc_ref, scalar_array(m0), scalar_array(h))
