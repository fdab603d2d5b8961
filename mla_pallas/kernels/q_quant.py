"""FP8 quantization of query rows inside the sparse sm_90 attention kernels, and helpers shared with the prefill
quantization kernel (``kernels/prefill_quant.py``: :func:`stage_rows`, :func:`f32_columns`).

Per query row (one head of one token), in the float32 arithmetic of :func:`mla_pallas.quant.quantize_rows_fp8`:

    amax      = max |q[row, :576]|
    scale     = amax · f32(1/448)   (1 for an all-zero row)
    q8[row]   = e4m3(clip(q · (1 / scale), ±448))  as latent (512) | 64 zeros | rope (64)   (640 bytes)
    rs[row]   = amax · k,  k = f32(1/448) · ((softmax_scale · kv_scale) · log2 e)   (:func:`row_scales`)

so the bytes and scales equal the XLA pre-pass's (``ops.sparse_decode._xla_kernel_q``: ``quantize_rows_fp8``,
the concatenation with zeros, and rs as max |q| · k, a second reduction XLA can fuse with the first). The
attention kernels quantize their Q tile's rows with :func:`quantize_head_rows` (raw PTX: one warp per row, 16-byte
loads) from GMEM into the swizzled Q tile; the one-launch pre-pass kernel that was here before them is in
docs/kernels/sparse_decode_sm90.md (deleted: no kernel takes a pre-quantized Q over an fp8 cache any more).
"""
from __future__ import annotations


import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common
from mla_pallas.kernels import raw_mgpu as raw
from mla_pallas.quant import FP8_MAX, _INV_FP8_MAX

CHUNK = 64                 # columns per register pass


def stage_rows(src, x_smem, bar) -> None:
  """TMA the [64, D] rows ``src`` (GMEM, bf16 or f32) into ``x_smem`` [D / chunk_cols, 64, chunk_cols] as
  128-byte-swizzled chunks (64 bf16 or 32 f32 columns each) and wait for them on ``bar`` (one arrival per chunk)."""
  chunk_cols = x_smem.shape[-1]
  for c in range(x_smem.shape[0]):
    plgpu.copy_gmem_to_smem(src.at[:, pl.ds(c * chunk_cols, chunk_cols)], x_smem.at[c], bar)
  plgpu.barrier_wait(bar)


def f32_columns(x_smem, c):
  """Columns [64 c, 64 c + 64) of a tile staged by :func:`stage_rows`, as f32 [64, 64] registers (WGMMA layout;
  the swizzled chunks make the loads conflict-free)."""
  per = CHUNK // x_smem.shape[-1]
  parts = [plgpu.load(x_smem.at[c * per + i], layout=plgpu.Layout.WGMMA).astype(jnp.float32) for i in range(per)]
  return parts[0] if per == 1 else jnp.concatenate(parts, axis=1)


def row_scales(amax, softmax_scale: float, kv_scale):
  """The attention kernels' per-row logit scale from a row's max |q|: amax · k with k = f32(1/448) · ((softmax_scale
  · kv_scale) · log2 e), in this order (the XLA pre-pass computes max(|q| · k) over the row, the same bits since
  rounding is monotonic). It equals q's scale · (softmax_scale · kv_scale · log2 e) up to one rounding; an all-zero
  row gets 0 instead (its logits are 0 either way)."""
  k = jnp.float32(_INV_FP8_MAX) * ((jnp.float32(softmax_scale) * kv_scale) * jnp.float32(common.LOG2E))
  return amax * k


# ----------------------------------------------------------------------------------------------------------------
# In-kernel form for the attention kernels: the heads-on-N kernel's 16-row Q tile (kernels/sparse_sm90_heads_n.py,
# one token's H <= 16 rows) or a half of the heads-on-M kernel's 64-row tile (kernels/sparse_sm90_heads_m.py,
# ``TuningConfig.q_in_kernel``), quantized by a warpgroup straight from GMEM into the swizzled Q tile.

HEAD_ROWS = 16             # rows of the heads-on-N Q tile (the MMAs' N)
LANE_VALUES = 16           # values per lane and row: latent [16 l, 16 l + 16) on every lane
# Registers per lane for the raw q vectors of the rows one warp has in flight (:func:`quantize_head_rows_raw`
# loads a batch of rows before it converts and stores any of them: bf16 rows 16 registers each, so 8 rows, f32
# 4; 0 = one row at a time, the form before the twenty-sixth session, whose 8 serialized global loads per warp
# the timeline put at 9-12 k cycles per 32 rows)
Q_LOAD_REGS = 128


def quantize_head_rows_raw(q, q8, amax_out, row0, rows: int, first=0, count: int | None = None,
                           q_rope=None, load_regs: int | None = None) -> None:
  """Raw Mosaic GPU body (one warpgroup): tile rows ``first .. first + count`` (default: all) of the Q tile ``q8``
  (SMEM memref [5, tile_rows, 128] fp8, Tiling(8, 128) + 128-byte swizzle: latent | 64 zeros | rope) from rows
  ``row0 + r`` of ``q`` (GMEM memref [R, 576] bf16 or f32; or, with ``q_rope``, q [R, 512] the latent part and
  q_rope [R, 64] the rope part, each bf16 or f32: the row is their concatenation), quantized per row as in the
  module docstring, and
  each row's max |q| into ``amax_out[r]`` (SMEM memref of >= tile_rows f32); tile rows ``r >= rows`` get zeros
  (and amax 0). ``row0``: i32 value; ``rows``, ``count`` (a multiple of 4) static; ``first`` static or an i32
  value (one code path for both halves of a tile); ``load_regs``: at most this many registers of q loads in
  flight per lane (a warpgroup with few registers; default and cap ``Q_LOAD_REGS``).

  Warp w takes tile rows first + w, first + w + 4, ...; lane l loads latent values [16 l, 16 l + 16) and lanes 4-7
  also rope values [16 (l - 4), 16 (l - 4) + 16), the loads of up to ``Q_LOAD_REGS`` registers' worth of rows
  issued before the first of them is converted (their global latencies overlap); the row max is a butterfly over
  the warp. Stores: latent as
  16 fp8 bytes at chunk l // 8, granule l % 8; in the tail chunk, lanes 0-3 write the zero granules 0-3 and
  lanes 4-7 the rope granules 4-7; lane 0 the row's amax. The caller fences (``plgpu.commit_smem``: the
  async-proxy fence and a warpgroup barrier) before the wgmmas and register loads read them."""
  f32 = ir.F32Type.get()
  q8_shape = ir.MemRefType(q8.type).shape   # tiled: [5, rows / 8, 1, 8, 128]
  tile_rows = q8_shape[1] * q8_shape[3] if len(q8_shape) == 5 else q8_shape[1]
  count = tile_rows if count is None else count
  if isinstance(first, int):
    assert count % 4 == 0 and 0 <= first and first + count <= tile_rows, (first, count, tile_rows)
    first = raw.c32(first)
  else:                    # an i32 value: the caller keeps first + count <= tile_rows
    assert count % 4 == 0 and count <= tile_rows, (count, tile_rows)
  dtype = ir.MemRefType(q.type).element_type
  item = raw.float_bytes(dtype)
  _, warp, lane = raw.thread_in_warpgroup()
  q_base = mgpu_utils.memref_ptr(q)
  if q_rope is None:       # one [R, 576] array: the rope part is columns 512-575 of the same rows
    row_bytes, rope_dtype, rope_base = common.D_QK * item, dtype, q_base
    rope_row_bytes, rope_col0 = row_bytes, common.D_V
  else:                    # latent [R, 512] and rope [R, 64]
    row_bytes, rope_dtype, rope_base = common.D_V * item, ir.MemRefType(q_rope.type).element_type, \
        mgpu_utils.memref_ptr(q_rope)
    rope_row_bytes, rope_col0 = common.D_ROPE * raw.float_bytes(rope_dtype), 0
  rope_item = raw.float_bytes(rope_dtype)
  q8_base = llvm.ptrtoint(raw.i32(), mgpu_utils.memref_ptr(q8))
  amax_base = llvm.ptrtoint(raw.i32(), mgpu_utils.memref_ptr(amax_out))
  zero_f = arith.constant(f32, 0.0)
  zeros8 = vector.broadcast(ir.VectorType.get((8,), f32), zero_f)
  rope_lane = arith.andi(arith.cmpi(arith.CmpIPredicate.uge, lane, raw.c32(4)),
                         arith.cmpi(arith.CmpIPredicate.ult, lane, raw.c32(8)))
  rope_part = arith.select(rope_lane, arith.subi(lane, raw.c32(4)), raw.c32(0))
  tail_lane = arith.cmpi(arith.CmpIPredicate.ult, lane, raw.c32(8))
  def load(j):          # row j of this warp: its raw latent and rope vectors (rows past `rows` read row 0)
    r = arith.addi(arith.addi(warp, first), raw.c32(4 * j))
    real = arith.cmpi(arith.CmpIPredicate.ult, r, raw.c32(rows))
    src = raw.wide(arith.addi(row0, arith.select(real, r, raw.c32(0))))
    latent = raw.load_vectors(q_base, arith.addi(arith.muli(src, raw.c64(row_bytes)), raw.wide(
        arith.muli(lane, raw.c32(LANE_VALUES * item)))), dtype, LANE_VALUES)
    rope = raw.load_vectors(rope_base, arith.addi(arith.muli(src, raw.c64(rope_row_bytes)), raw.wide(arith.muli(
        arith.addi(rope_part, raw.c32(rope_col0 // LANE_VALUES)), raw.c32(LANE_VALUES * rope_item)))),
        rope_dtype, LANE_VALUES)
    return r, real, latent, rope

  row_regs = LANE_VALUES * (item + rope_item) // 4     # registers of one row's raw vectors per lane
  per_batch = max(1, (Q_LOAD_REGS if load_regs is None else min(load_regs, Q_LOAD_REGS)) // row_regs)
  warp_rows = list(range(count // 4))
  for b in range(0, len(warp_rows), per_batch):
    batch = [load(j) for j in warp_rows[b:b + per_batch]]    # all the batch's loads in flight before any store
    for r, real, latent, rope in batch:
      latent = [arith.select(real, x, zeros8) for x in raw.widen(latent)]
      rope = [arith.select(arith.andi(real, rope_lane), x, zeros8) for x in raw.widen(rope)]
      amax = raw.warp_max(arith.maximumf(raw.abs_max(latent), raw.abs_max(rope)))
      scale = arith.mulf(amax, arith.constant(f32, float(_INV_FP8_MAX)))
      scale = arith.select(arith.cmpf(arith.CmpFPredicate.OEQ, scale, zero_f), arith.constant(f32, 1.0), scale)
      inv = arith.divf(arith.constant(f32, 1.0), scale)
      row_addr = arith.addi(q8_base, arith.muli(r, raw.c32(common.SW_CHUNK)))
      chunk_bytes = tile_rows * common.SW_CHUNK
      lat_addr = arith.addi(row_addr, arith.addi(arith.muli(arith.divui(lane, raw.c32(8)), raw.c32(chunk_bytes)),
                                                 arith.muli(arith.remui(lane, raw.c32(8)), raw.c32(16))))
      raw.st_shared_v4(raw.swizzle(lat_addr, common.SW_CHUNK), raw.fp8_words(latent, inv))
      tail_words = raw.fp8_words(rope, inv)       # zeros on lanes 0-3 (their rope values were zeroed)
      tail_addr = arith.addi(row_addr, arith.addi(raw.c32((common.SW_CHUNKS - 1) * chunk_bytes),
                                                  arith.muli(lane, raw.c32(16))))
      raw.when(tail_lane, lambda a=tail_addr, w=tail_words: raw.st_shared_v4(raw.swizzle(a, common.SW_CHUNK), w))
      raw.when(arith.cmpi(arith.CmpIPredicate.eq, lane, raw.c32(0)),
               lambda r=r, a=amax: raw.st_shared_f32(arith.addi(amax_base, arith.muli(r, raw.c32(4))), a))


def quantize_head_rows(q_ref, q8_ref, amax_ref, row0, rows: int, first=0, count: int | None = None,
                       load_regs: int | None = None) -> None:
  """Pallas-level :func:`quantize_head_rows_raw` (run by one warpgroup; not in interpret mode): ``q_ref`` GMEM
  [R, 576] bf16 / f32, or a pair (latent [R, 512], rope [R, 64]) of GMEM refs (:func:`q_parts`), ``q8_ref`` SMEM
  [5, tile_rows, 128] fp8 (``common.q_scratch``), ``amax_ref`` SMEM [>= tile_rows] f32; ``row0`` an int32 scalar
  (traced), ``rows``, ``count`` static, ``first`` static or an int32 scalar (traced; first + count <= the tile's
  rows)."""
  parts = q_parts(q_ref)
  sw = plgpu.RefType(common.swizzled(common.FP8, common.SW_CHUNK))
  static_first = isinstance(first, int)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) * len(parts) + (sw, plgpu.RefType(), raw.SCALAR_LAYOUT) +
                     (() if static_first else (raw.SCALAR_LAYOUT,)))
  def f(ctx, *args):
    del ctx
    if static_first:
      *qs, q8, amax, row0_fa = args
      first_v = first
    else:
      *qs, q8, amax, row0_fa, first_fa = args
      first_v = raw.scalar_value(first_fa)
    quantize_head_rows_raw(qs[0], q8, amax, raw.scalar_value(row0_fa), rows, first_v, count,
                           q_rope=qs[1] if len(qs) > 1 else None, load_regs=load_regs)
  f(*parts, q8_ref, amax_ref, raw.scalar_array(row0), *(() if static_first else (raw.scalar_array(first),)))


def q_parts(q_ref) -> tuple:
  """The attention kernels' q source as a tuple of GMEM refs: (q [R, 576],) or (latent [R, 512], rope [R, 64])."""
  parts = tuple(q_ref) if isinstance(q_ref, (tuple, list)) else (q_ref,)
  if len(parts) not in (1, 2):
    raise ValueError(f"q must be one [R, 576] ref or a (latent [R, 512], rope [R, 64]) pair; got {len(parts)} refs")
  return parts


def q_rows(q_ref, start, count: int):
  """Rows [start, start + count) of the q source (:func:`q_parts`) as one f32 [count, 576] array (interpret
  mode)."""
  parts = q_parts(q_ref)
  rows = [p[pl.ds(start, count), :].astype(jnp.float32) for p in parts]
  return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=1)


def quantize_head_rows_interpret(q_ref, q8_ref, amax_ref, row0, rows: int, first: int = 0,
                                 count: int | None = None, load_regs: int | None = None) -> None:
  """:func:`quantize_head_rows` for interpret mode (no ``inline_mgpu`` there): the same values by Pallas array
  ops (interpret mode checks no layouts); ``q_ref`` as there (``load_regs`` has no meaning here)."""
  del load_regs
  count = q8_ref.shape[1] if count is None else count
  real = min(max(rows - first, 0), count)     # tile rows first .. first + real come from q
  q8 = jnp.zeros((0, common.Q_SW_COLS), common.FP8)
  amax = jnp.zeros((0,), jnp.float32)
  if real:
    x = q_rows(q_ref, row0 + first, real)
    amax = jnp.abs(x).max(axis=1)
    scale = amax * _INV_FP8_MAX
    scale = jnp.where(scale == 0.0, 1.0, scale)
    q8 = jnp.clip(x * (1.0 / scale)[:, None], -FP8_MAX, FP8_MAX).astype(common.FP8)
    q8 = jnp.concatenate([q8[:, :common.D_V], jnp.zeros((real, common.Q_SW_COLS - common.D_QK), common.FP8),
                          q8[:, common.D_V:]], axis=1)
  if count > real:
    q8 = jnp.concatenate([q8, jnp.zeros((count - real, common.Q_SW_COLS), common.FP8)], axis=0)
    amax = jnp.concatenate([amax, jnp.zeros((count - real,), jnp.float32)])
  for c in range(common.SW_CHUNKS):
    q8_ref.at[c, pl.ds(first, count)][...] = q8[:, c * common.SW_CHUNK:(c + 1) * common.SW_CHUNK]
  amax_ref[pl.ds(first, count)] = amax
