"""The gather of one 64-key K tile with 16-byte per-thread ``cp.async`` loads (sm_90), issued by a whole warpgroup.

The sparse sm_90 kernels read each selected cache row (576 fp8 bytes) into a K tile [5, 64, 128] fp8 with the
128-byte swizzle that wgmma expects (chunks 0-3: cache columns 0-511; chunk 4: columns 448-575, see
``common.gather_tiles``). A per-row TMA needs five 128-byte boxes per row (320 per tile), and the TMA unit issues
them one at a time. Here the 128 threads of the loader warpgroup issue the tile's 2560 16-byte pieces instead,
20 each:

* thread ``tid`` owns the 16-byte unit ``j = tid % 8`` of rows ``r = tid // 8 + 16 i`` (i = 0..3) in all five
  chunks: the 8 threads of one row read 128 contiguous bytes per chunk (coalesced);
* destination: ``chunk · 8192 + r · 128 + 16 · (j XOR r % 8)`` (the 128-byte swizzle of a 1024-byte-aligned
  tile, the same addressing as ``kernels/vt_registers.py``);
* row ids come from ``idx`` (SMEM [n_tiles, 64] int32, row ``t``); an id outside [0, num_slots) reads nothing
  (``cp.async`` with source size 0 zero-fills the 16 bytes) from row 0's address, so nothing past the cache is
  ever addressed; byte offsets into the cache are 64-bit (caches past 2 GiB);
* completion: each thread commits one ``cp.async`` group per tile. :func:`wait_tiles` (``cp.async.wait_group n``)
  leaves at most ``n`` of the newest tiles in flight and fences the generic proxy against the async proxy
  (``fence.proxy.async``: wgmma reads the tile); the caller's warpgroup ``barrier_arrive`` on a completed tile's
  ``k_full`` barrier (one arrival of the warpgroup) then publishes it. ``common.gather_tiles`` keeps
  ``k_buffers - 2`` tiles in flight behind the newest (no deadlock: the tile whose release it waits for next is
  always published first).

Raw Mosaic GPU code (``plgpu.inline_mgpu``): interpret mode cannot run it; the kernels keep the per-row copies
there (README: interpret-only code paths). Checked by lowering on the CPU (instruction counts) and against the
reference on the GPU.
"""
from __future__ import annotations

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common
from mla_pallas.kernels.raw_mgpu import (SCALAR_LAYOUT, asm, c32, c64, scalar_array, scalar_value,
                                         thread_in_warpgroup, wide)

UNIT = 16                           # bytes per cp.async
UNITS_PER_CHUNK = common.SW_CHUNK // UNIT      # 8
ROWS_PER_PASS = 128 // UNITS_PER_CHUNK         # 16 rows per pass of the warpgroup
PASSES = common.TILE // ROWS_PER_PASS          # 4
CHUNK_BYTES = common.TILE * common.SW_CHUNK    # 8192: one [64, 128] chunk of the tile
CP_ASYNC_PER_THREAD = PASSES * common.SW_CHUNKS  # 20
# One 16-byte piece: destination (u32 SMEM address), source (u64 address), source size (16, or 0 to zero-fill).
CP_ASYNC = "cp.async.cg.shared.global [$0], [$1], 16, $2;"


def issue_tile(kv, k_tile, idx, t, num_slots: int, layout: common.TileLayout = common.FP8_TILES,
               run=None) -> None:
  """Inside an ``inline_mgpu`` body: this thread's ``4 · layout.chunks`` ``cp.async`` (fp8: 20) of tile ``t`` (i32
  value) from ``kv`` (GMEM memref [num_slots, 576] of the layout's dtype) into ``k_tile`` (SMEM memref of one
  [chunks, 64, chunk_cols] swizzled K tile; fp8 [5, 64, 128]), row ids from ``idx`` (SMEM memref [n_tiles, 64]
  int32), committed as one group (module docstring; a bf16 row is 1152 bytes in nine chunks). ``run`` = (first,
  count) (i32 values; ``idx`` and ``t`` unused): the tile is the ``count`` consecutive rows from ``first`` instead
  (row r has id first + r where r < count, else none: a dense tile of a page, cut at a sequence's limit)."""
  item = layout.dtype.itemsize
  i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
  tid, _, _ = thread_in_warpgroup()
  j = arith.remui(tid, c32(UNITS_PER_CHUNK))
  r0 = arith.divui(tid, c32(UNITS_PER_CHUNK))
  swz = arith.muli(arith.xori(j, arith.remui(r0, c32(8))), c32(UNIT))   # r % 8 == r0 % 8 for every pass
  kv_base = llvm.ptrtoint(i64, mgpu_utils.memref_ptr(kv))
  k_base = llvm.ptrtoint(i32, mgpu_utils.memref_ptr(k_tile))
  if run is None:
    idx_base = llvm.ptrtoint(i32, mgpu_utils.memref_ptr(idx))
    row_ids = arith.addi(idx_base, arith.muli(t, c32(common.TILE * 4)))
  unit_col = arith.muli(j, c32(UNIT))
  for i in range(PASSES):
    r = arith.addi(r0, c32(ROWS_PER_PASS * i))
    if run is None:
      rid = asm(i32, [arith.addi(row_ids, arith.muli(r, c32(4)))], "ld.shared.b32 $0, [$1];", "=r,r",
                side_effects=True)
    else:
      rid = arith.select(arith.cmpi(arith.CmpIPredicate.slt, r, run[1]), arith.addi(run[0], r), c32(-1))
    valid = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, rid, c32(0)),
                       arith.cmpi(arith.CmpIPredicate.slt, rid, c32(num_slots)))
    row = arith.select(valid, rid, c32(0))
    size = arith.select(valid, c32(UNIT), c32(0))
    src_row = arith.addi(arith.addi(kv_base, arith.muli(wide(row), c64(common.D_QK * item))), wide(unit_col))
    dst_row = arith.addi(arith.addi(k_base, arith.muli(r, c32(common.SW_CHUNK))), swz)
    for c in range(layout.chunks):
      src = arith.addi(src_row, c64(layout.cols[c] * item))
      dst = arith.addi(dst_row, c32(c * CHUNK_BYTES))
      asm(ir.Type.parse("!llvm.void"), [dst, src, size], CP_ASYNC, "r,l,r", side_effects=True)
  asm(ir.Type.parse("!llvm.void"), [], "cp.async.commit_group;", "", side_effects=True)


def gather_tile(kv_gmem, k_tile_ref, idx_smem, t, *, num_slots: int,
                layout: common.TileLayout = common.FP8_TILES) -> None:
  """Pallas level: the loader warpgroup issues the gather of tile ``t`` (rows ``idx_smem[t]``) of ``kv_gmem``
  [num_slots, 576] into ``k_tile_ref`` ([chunks, 64, chunk_cols] of the layout's dtype, 128-byte swizzled; fp8
  [5, 64, 128]), one ``cp.async`` group per thread; :func:`wait_tiles` waits for it."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(common.swizzled(layout.dtype, common.SW_CHUNK)),
                                plgpu.RefType(), SCALAR_LAYOUT))
  def f(ctx, kv, k_tile, idx, t_arr):
    del ctx
    issue_tile(kv, k_tile, idx, scalar_value(t_arr), num_slots, layout)
  f(kv_gmem, k_tile_ref, idx_smem, scalar_array(t))


def copy_run(kv_gmem, k_tile_ref, first, count, *, num_slots: int,
             layout: common.TileLayout = common.FP8_TILES) -> None:
  """Pallas level: the loader warpgroup issues the copy of ``count`` consecutive cache rows from ``first`` (traced
  i32 scalars; rows count ... 63 zero-filled, as is every row when ``first`` is outside [0, num_slots)) into the
  K tile ``k_tile_ref`` of the layout's dtype, one ``cp.async`` group per thread (:func:`issue_tile` with
  ``run``); :func:`wait_tiles` waits for it."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(common.swizzled(layout.dtype, common.SW_CHUNK)),
                                SCALAR_LAYOUT, SCALAR_LAYOUT))
  def f(ctx, kv, k_tile, first_arr, count_arr):
    del ctx
    issue_tile(kv, k_tile, None, None, num_slots, layout,
               run=(scalar_value(first_arr), scalar_value(count_arr)))
  f(kv_gmem, k_tile_ref, scalar_array(first), scalar_array(count))


def wait_tiles(in_flight: int) -> None:
  """Pallas level: each loader thread waits until at most ``in_flight`` of its newest tile groups are pending,
  then fences its completed writes for the async proxy (wgmma)."""
  @plgpu.inline_mgpu()
  def f(ctx):
    del ctx
    asm(ir.Type.parse("!llvm.void"), [], f"cp.async.wait_group {in_flight};", "", side_effects=True)
    asm(ir.Type.parse("!llvm.void"), [], "fence.proxy.async.shared::cta;", "", side_effects=True)
  f()

