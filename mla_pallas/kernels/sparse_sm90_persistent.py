""""producer_vt" with persistent CTAs (``TuningConfig.persistent``: opt-in, not yet timed on a GPU; the op's
sweep and the diagnosis script's row ``persistent`` measure it against the one-item CTAs; delete it if slower).

The heads-on-M "producer_vt" kernel (``kernels/sparse_sm90_heads_m.py``: producer WG0, multipliers WG1 / WG2,
loader WG3) with a grid of ``num_ctas`` CTAs, each looping over work items (query tile, split): CTA c takes items
c, c + num_ctas, ... . Shapes, dtypes and results are those of ``sparse_sm90_heads_m.build`` (fp8 cache, Q
quantized in the kernel).

Across items: the K ring and the P slots are counted with a global tile counter g = i · tiles_per_split + t (i the
CTA's item counter; Mosaic GPU tracks each barrier's phase per thread, so waits only have to stay in order); Q, its
amax row and the indices are doubled by item parity (j = i % 2). The multipliers quantize item i + 1's Q into slot
1 - j at the start of item i (that slot was item i - 1's, whose QKᵀs the producer finished before it published item
i - 1's last P, which the multipliers have consumed); the producer waits ``q_bar[j]`` at each item's start. The
loader waits ``idx_empty[j]`` (the producer's arrival after its last softmax of item i - 2) before the index TMA of
item i. kv_scale / l keeps one slot: with tiles_per_split >= 3 the producer cannot finish item i + 1 before the
multipliers have read item i's (the two P slots bound its lead). The rings are observed once more after the last
item only (``common.drain``).

SMEM (32-tile splits, k_buffers 2): Q 2 × 40 960 + K 81 920 + P slots 16 384 + indices 2 × 8 192 + lse, head rows
(alpha 2, kv_scale / l, amax 2), barriers, scratch: ~197 KB.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common, q_quant
from mla_pallas.kernels import sparse_sm90_heads_m as hm
from mla_pallas.kernels.common import D_V, TILE, swizzled

HEAD_ROWS = hm.INV_SLOT + 3   # alpha slots, kv_scale / l, the two amax rows


def _view(r: common.SparseRefs, j):
  """The refs of item parity ``j``: its Q tile, indices and their barriers."""
  return dataclasses.replace(r, q_sw=r.q_sw.at[j], idx_smem=r.idx_smem.at[j], q_bar=r.q_bar.at[j],
                             idx_bar=r.idx_bar.at[j])


def _amax(r: common.SparseRefs, j):
  return r.head_smem.at[hm.INV_SLOT + 1 + j]


def _quantize(tile_q, r: common.SparseRefs, j, half: int, heads: int, interpret: bool):
  """Multiplier ``half``'s 32 rows of query tile ``tile_q`` into Q slot ``j`` and its amax row, then q_bar[j]."""
  hm._quantize_q_rows(tile_q, _view(r, j), half, heads, interpret, amax=_amax(r, j))


class _Items:
  """This CTA's work items: item i is global item cta + i · num_ctas = (tile_q, split)."""

  def __init__(self, num_items: int, num_ctas: int, num_splits: int, tiles_per_token: int):
    self.cta = lax.axis_index("cta")
    self.count = lax.div(num_items - self.cta + num_ctas - 1, num_ctas)
    self.num_ctas, self.num_splits, self.tiles_per_token = num_ctas, num_splits, tiles_per_token

  def coords(self, i):
    g = self.cta + i * self.num_ctas
    tile_q, split = lax.div(g, self.num_splits), lax.rem(g, self.num_splits)
    return tile_q, split, lax.div(tile_q, self.tiles_per_token)


def _loader(cfg, num_slots, interpret, items: _Items, r: common.SparseRefs, idx_empty):
  plgpu.set_max_registers(hm.PRODUCER_REGS[0], action="decrease")
  n = cfg.tiles_per_split

  def item(i, _):
    j = lax.rem(i, 2)
    _, split, token = items.coords(i)

    @pl.when(i >= 2)
    def _():
      plgpu.barrier_wait(idx_empty.at[j])      # the producer is done with item i - 2's indices
    plgpu.copy_gmem_to_smem(r.idx_gmem.at[token, pl.ds(split * n, n)], r.idx_smem.at[j], r.idx_bar.at[j])
    plgpu.barrier_wait(r.idx_bar.at[j])
    common.gather_tiles(r.kv_gmem, r.k_sw, r.idx_smem.at[j], r.k_full, r.k_empty, num_slots=num_slots,
                        n_tiles=n, k_buffers=cfg.k_buffers, interpret=interpret, layout=cfg.layout,
                        first=i * n, drain_ring=False)
  lax.fori_loop(0, items.count, item, None)
  for kb in range(cfg.k_buffers):      # the last observation of every ring slot (items.count * n >= k_buffers)
    plgpu.barrier_wait(r.k_empty.at[kb])
  for j in range(2):                   # and of the index slots' last releases

    @pl.when(items.count > j)
    def _():
      plgpu.barrier_wait(idx_empty.at[lax.rem(items.count - 1 - j, 2)])


def _producer(cfg, num_slots, items: _Items, r: common.SparseRefs, idx_empty, softmax_scale: float):
  plgpu.set_max_registers(hm.PRODUCER_REGS[1], action="decrease")
  n = cfg.tiles_per_split
  kv_scale = r.scal_gmem[0]

  def item(i, _):
    j = lax.rem(i, 2)
    tile_q, split, _ = items.coords(i)
    ri = _view(r, j)
    plgpu.barrier_wait(ri.q_bar)
    plgpu.barrier_wait(ri.idx_bar)
    amax = plgpu.load(_amax(r, j), layout=hm.ROW_LAYOUT, optimized=False)
    row_scale = q_quant.row_scales(amax, softmax_scale, kv_scale)
    hm._producer_item(cfg, num_slots, row_scale, kv_scale, tile_q, split, ri, first=i * n)
    plgpu.barrier_arrive(idx_empty.at[j])    # the loader may now bring item i + 2's indices
  lax.fori_loop(0, items.count, item, None)
  for pb in range(hm.P_BUFFERS):       # the last observation of each P slot (items.count * n >= P_BUFFERS)
    plgpu.barrier_wait(r.p_empty.at[pb])


def _multiplier(cfg, out_dtype, interpret: bool, heads: int, items: _Items, r: common.SparseRefs, half: int):
  plgpu.set_max_registers(hm.PRODUCER_REGS[2], action="increase")
  n = cfg.tiles_per_split
  _quantize(items.coords(0)[0], r, 0, half, heads, interpret)

  def item(i, _):
    j = lax.rem(i, 2)
    tile_q, split, _ = items.coords(i)

    @pl.when(i + 1 < items.count)
    def _():
      _quantize(items.coords(i + 1)[0], r, 1 - j, half, heads, interpret)

    if interpret:     # the stand-in of interpret mode: V upcast in SMEM, P from its slot
      hm._multiplier_interpret_item(cfg, out_dtype, tile_q, split, r, half, first=i * n)
    else:
      hm._multiplier_item(cfg, tile_q, split, r, half, first=i * n)
  lax.fori_loop(0, items.count, item, None)


def _body(cfg, num_slots, items_args, out_dtype, interpret, heads, softmax_scale, q_gmem, kv_gmem, idx_gmem,
          scal_gmem, o_gmem, lse_gmem, q_sw, k_sw, *rest):
  v16, rest = (rest[0], rest[1:]) if interpret else (None, rest)
  p_sw, idx_smem, lse_smem, head_smem, q_bar, idx_bar, k_full, k_empty, p_full, p_empty, idx_empty = rest
  r = common.SparseRefs(q_gmem, None, kv_gmem, idx_gmem, scal_gmem, o_gmem, lse_gmem, q_sw, k_sw, v16, p_sw,
                        idx_smem, lse_smem, head_smem, q_bar, idx_bar, k_full, k_empty, p_full, p_empty)
  items = _Items(*items_args)
  wg = lax.axis_index("wg")

  @pl.when(wg == cfg.loader)
  def _():
    _loader(cfg, num_slots, interpret, items, r, idx_empty)

  @pl.when(wg == 0)
  def _():
    _producer(cfg, num_slots, items, r, idx_empty, softmax_scale)

  for half in range(2):
    @pl.when(wg == 1 + half)
    def _():
      _multiplier(cfg, out_dtype, interpret, heads, items, r, half)


@functools.lru_cache(maxsize=32)
def build(num_q_tiles: int, num_slots: int, num_splits: int, tiles_per_token: int, out_dtype_name: str,
          cfg: hm.TuningConfig, num_ctas: int, heads: int, softmax_scale: float, interpret=False):
  """The kernel (arguments and results as ``sparse_sm90_heads_m.build`` with ``cfg.q_in_kernel``, q as one
  [T · H, 576] input) on ``min(num_ctas, items)`` persistent CTAs."""
  if not (cfg.producer and cfg.q_in_kernel) or cfg.tiles_per_split < 3:
    raise NotImplementedError(f"persistent CTAs run schedule 'producer_vt' over an fp8 cache with splits of at "
                              f"least 3 tiles; got {cfg}")
  num_items = num_q_tiles * num_splits
  num_ctas = max(1, min(num_ctas, num_items))
  interp = bool(interpret)
  common.check_interpret_threads(interp, cfg.loader + 1, "persistent 'producer_vt'")
  out_dtype = jnp.dtype(out_dtype_name)
  body = functools.partial(_body, cfg, num_slots, (num_items, num_ctas, num_splits, tiles_per_token), out_dtype,
                           interp, heads, float(softmax_scale))
  lay = cfg.layout
  v_scratch = [plgpu.SMEM((TILE, D_V), jnp.float16, transforms=swizzled(jnp.float16, 128))] if interp else []
  return plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((num_q_tiles, num_splits, TILE, D_V), out_dtype),
                jax.ShapeDtypeStruct((num_q_tiles, num_splits, TILE), jnp.float32)),
      grid=(num_ctas,), grid_names=("cta",),
      num_threads=cfg.loader + 1, thread_name="wg",
      scratch_types=[
          plgpu.SMEM((2, lay.chunks, TILE, lay.chunk_cols), lay.dtype,
                     transforms=swizzled(lay.dtype, common.SW_CHUNK)),                     # Q, by item parity
          common.k_scratch(cfg.k_buffers, cfg.layout),                                     # K ring
          *v_scratch,                                                                      # V f16 (interpret)
          plgpu.SMEM((hm.P_BUFFERS, TILE, TILE), jnp.float16, transforms=swizzled(jnp.float16, 128)),  # P slots
          plgpu.SMEM((2, cfg.tiles_per_split, TILE), jnp.int32),                           # indices, by parity
          plgpu.SMEM((TILE,), jnp.float32),                                                # lse
          plgpu.SMEM((HEAD_ROWS, TILE), jnp.float32),                                      # alpha, 1/l, amax
          plgpu.Barrier(num_arrivals=2, num_barriers=2),                                   # q_bar
          plgpu.Barrier(num_barriers=2),                                                   # idx_bar
          plgpu.Barrier(num_arrivals=common.k_full_arrivals(interp, cfg.layout),
                        num_barriers=cfg.k_buffers),                                       # k_full
          plgpu.Barrier(num_arrivals=3, num_barriers=cfg.k_buffers),                       # k_empty
          plgpu.Barrier(num_barriers=hm.P_BUFFERS + 1),                                    # p_full
          plgpu.Barrier(num_arrivals=2, num_barriers=hm.P_BUFFERS),                        # p_empty
          plgpu.Barrier(num_barriers=2),                                                   # idx_empty
      ],
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE),
      **common.interpret_kwargs(interpret),
  )
