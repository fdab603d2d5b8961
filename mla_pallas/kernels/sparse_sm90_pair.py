"""Schedule "pair_v16" of the heads-on-M sparse sm_90 kernel (``TuningConfig(schedule="pair_v16")``; fp8 cache
only; a sweep candidate, not the op's choice until measured: docs/kernels/sparse_decode_sm90.md).

The heads-on-M kernel (:mod:`mla_pallas.kernels.sparse_sm90_heads_m`: inputs, outputs, the loader, Q quantized in
the kernel) with its work per 64-key tile split between two *math* warpgroups that take alternate tiles, as
FlashMLA's sm_90 sparse prefill does over a bf16 cache: no warpgroup computes an S or a softmax that the other
also computes ("twin" does both twice), and no single warpgroup carries every tile's QKᵀ and softmax
("producer_vt"'s producer). P·V reads V from an f16 tile in SMEM, as FlashMLA's reads its bf16 V: the earlier
"pair" (deleted, commit 3e99bed) built Vᵀ fragments in registers and spilled.

Warpgroups (384 threads; registers: loader 24, math 240 each, ``PAIR_REGS``: 24 + 2 · 240 = 3 · 168):

* WG2 — loader: the split's indices, then the gather of every tile into the ring of ``k_buffers`` K tiles
  (``common.gather_tiles``), exactly as in the other schedules.
* WG0, WG1 — math warpgroup w. First it quantizes 32 of the tile's Q rows (``_quantize_q_rows``, half w). Then per
  tile pair j (tiles 2j and 2j + 1; ``tiles_per_split`` even):
  1. S = Q·Kᵀ of its own tile t = 2j + w (five fp8 wgmmas), scaled by the row scales, invalid keys masked; its
     row max goes to the exchange row (2 · (j % 2) + w) of ``head_smem`` and both warpgroups meet on
     ``max_bar[j % 2]``; both then move their running max to max(m, own, other) lazily, as "producer_vt"'s
     producer does (``heads_m.RESCALE_THRESHOLD``: only where it grows by more than 2^8) — the same bits in both,
     so they keep one running max.
  2. P = 2^(S - m_new) (f16) into P slot w (once both released it: ``p_empty[w]``, two arrivals), published on
     ``p_full[w]``; its own row sums l_w += rowsum(P) after l_w · alpha (each keeps a partial sum).
  3. O half (latent columns 256 w ... 256 w + 255: [64 heads, 256] f32, 128 registers) rescaled by
     alpha = 2^(m - m_new) unless every alpha is 1, then for its own tile and then the other's (after
     ``p_full[1 - w]``): the upcast of its two V chunks of that K tile into its columns of the f16 V tile
     (``heads_m._stage_v16_half``: raw Mosaic GPU, one warpgroup barrier), the K buffer's release (``k_empty``,
     two arrivals), and O half += P · V half (4 m64n256k16: P in registers for its own tile, from the other's
     slot for the other's; waited for before the next upcast overwrites its columns); each P slot is released
     (``p_empty``) once both multiplied it.
  After the last pair the two partial sums meet (``l_bar``), l = l_0 + l_1, and each stores its half of O scaled
  by kv_scale / l; WG0 writes the lse. Interpret mode runs the same code with P always from the slots and
  ``common.stage_v16``'s ref stores (it has no wgmma with A in registers and no ``inline_mgpu``).

SMEM (32-tile splits, two K buffers; each buffer rounded up to 1 KB): Q 40 960 + K 2 · 40 960 + V f16 65 536 + P
slots 2 · 8 192 + indices 8 192 + lse 1 024 + ``head_smem`` 10 rows · 256 (rounded: 3 072) + barriers 512 + Mosaic
reduction scratch 2 048 = 219 648 (no room for a third K buffer).
"""
from __future__ import annotations

import functools

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common, q_quant
from mla_pallas.kernels import sparse_sm90_heads_m as heads_m
from mla_pallas.kernels.common import D_V, TILE, swizzled

PAIR_REGS = (24, 240)   # loader, each math warpgroup: 24 + 2 · 240 = 504 = 3 · 168 (the 384-thread launch share)
MATH = 2                # math warpgroups; the loader is warpgroup 2
# head_smem rows ([HEAD_ROWS, 64] f32): each warpgroup's alpha (0, 1); row 2 unused; the rows' max |q|
# (heads_m._amax_row: row 3); the row-max exchange (4 + 2 · (pair % 2) + w); the partial row sums (8 + w)
ALPHA_ROW, MAX_ROW, L_ROW = 0, 4, 8
HEAD_ROWS = 10
assert heads_m.INV_SLOT + 1 == 3      # heads_m._amax_row's row, between the alpha and exchange rows


def smem_budget(cfg: heads_m.TuningConfig) -> int:
  """Bytes of SMEM of the "pair_v16" kernel (module docstring)."""
  lay = cfg.layout
  return common.smem_bytes(
      ((lay.chunks, TILE, lay.chunk_cols), lay.dtype),                   # Q
      ((cfg.k_buffers, lay.chunks, TILE, lay.chunk_cols), lay.dtype),    # K
      ((TILE, D_V), jnp.float16),                                        # V f16
      ((MATH, TILE, TILE), jnp.float16),                                 # P slots
      ((cfg.tiles_per_split, TILE), jnp.int32),                          # indices
      ((TILE,), jnp.float32),                                            # lse staging
      ((HEAD_ROWS, TILE), jnp.float32),                                  # head rows
  ) + 64 * 8 + 2048


def _math(cfg: heads_m.TuningConfig, num_slots: int, out_dtype, interpret: bool, w: int, tile_q, split, r,
          max_bar, l_bar, heads: int, softmax_scale: float):
  """Math warpgroup ``w`` (module docstring)."""
  plgpu.set_max_registers(PAIR_REGS[1], action="increase")
  heads_m._quantize_q_rows(tile_q, r, w, heads, interpret)
  plgpu.barrier_wait(r.q_bar)
  plgpu.barrier_wait(r.idx_bar)
  kv_scale = r.scal_gmem[0]
  row_scale = q_quant.row_scales(plgpu.load(heads_m._amax_row(r), layout=heads_m.ROW_LAYOUT, optimized=False),
                                 softmax_scale, kv_scale)
  rows = r.head_smem

  def landed(t):
    kb = lax.rem(t, cfg.k_buffers)
    plgpu.barrier_wait(r.k_full.at[kb])
    return kb, r.k_sw.at[kb]

  def softmax(j, s, m, l):
    t = 2 * j + w
    cols = plgpu.load(r.idx_smem.at[t], layout=heads_m.COL_LAYOUT, optimized=False)
    valid = lax.broadcast_in_dim(common.valid_keys(cols, num_slots), s.shape, [1])
    s = jnp.where(valid, s * lax.broadcast_in_dim(row_scale, s.shape, [0]), -jnp.inf)
    own = s.max(axis=1)
    slot = lax.rem(j, 2)
    rows.at[MAX_ROW + 2 * slot + w][...] = own
    plgpu.barrier_arrive(max_bar.at[slot])
    plgpu.barrier_wait(max_bar.at[slot])
    other = plgpu.load(rows.at[MAX_ROW + 2 * slot + 1 - w], layout=heads_m.ROW_LAYOUT, optimized=False)
    # lazy (heads_m.RESCALE_THRESHOLD); max is exact and commutative: the same m and alpha bits in both warpgroups
    m_new, m_use, alpha = common.running_max_step(m, jnp.maximum(own, other), heads_m.RESCALE_THRESHOLD)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [0]))
    return p, alpha, m_new, l * alpha + p.sum(axis=1)

  def publish(j, p16):
    @pl.when(j >= 1)
    def _():
      plgpu.barrier_wait(r.p_empty.at[w])    # both multiplied the previous pair's P of slot w
    r.p_sw.at[w][...] = p16
    plgpu.commit_smem()
    plgpu.barrier_arrive(r.p_full.at[w])

  def pv(j, acc, alpha, p_own):   # its O half += both tiles of pair j, its own first
    # the rescale, skipped where every alpha is 1 (the all-ones test on the column layout through its own SMEM
    # row: shuffles only; the store's warpgroup barriers order the load)
    rows.at[ALPHA_ROW + w][...] = alpha
    every_one = common.alpha_is_one(plgpu.load(rows.at[ALPHA_ROW + w], layout=heads_m.COL_LAYOUT, optimized=False))
    acc = lax.cond(every_one, lambda a: a, lambda a: a * lax.broadcast_in_dim(alpha, a.shape, [0]), acc)
    for u in (w, 1 - w):
      if u != w:
        _, k_tiles = landed(2 * j + u)
      else:
        k_tiles = r.k_sw.at[lax.rem(2 * j + u, cfg.k_buffers)]
      heads_m._stage_v16_half(k_tiles, w, r, interpret)
      plgpu.barrier_arrive(r.k_empty.at[lax.rem(2 * j + u, cfg.k_buffers)])
      if u != w:
        plgpu.barrier_wait(r.p_full.at[u])
      acc = heads_m._pv_half(acc, p_own if u == w else r.p_sw.at[u], w, interpret, r)
    return acc

  def pair(j, carry):
    acc, m, l = carry
    _, k_tiles = landed(2 * j + w)
    s = heads_m._qk_and_upcast(k_tiles, None, r)
    p, alpha, m, l = softmax(j, s, m, l)
    p16 = p.astype(jnp.float16)
    publish(j, p16)
    acc = pv(j, acc, alpha, r.p_sw.at[w] if interpret else p16)   # own P: registers (the interpreter: its slot)
    for u in range(MATH):
      plgpu.barrier_arrive(r.p_empty.at[u])
    return acc, m, l

  acc0, m0, l0 = heads_m._zero_state()
  acc, m, l = lax.fori_loop(0, cfg.tiles_per_split // 2, pair, (acc0, m0, l0))
  rows.at[L_ROW + w][...] = l
  plgpu.barrier_arrive(l_bar)
  plgpu.barrier_wait(l_bar)
  l = l + plgpu.load(rows.at[L_ROW + 1 - w], layout=heads_m.ROW_LAYOUT, optimized=False)   # commutative: same bits
  inv = kv_scale / jnp.where(l == 0.0, 1.0, l)
  heads_m._store_half(acc, inv, w, out_dtype, tile_q, split, r)
  common.store_lse(w, m, l, r.lse_smem, r.lse_gmem.at[tile_q, split])
  plgpu.barrier_wait(r.p_empty.at[w])   # the last pair's release of its slot (interpret-mode barrier rule)


def _body(cfg, num_slots, tiles_per_token, out_dtype, interpret, heads, softmax_scale, q_split, *refs):
  if q_split:           # q as (latent [T · H, 512], rope [T · H, 64])
    refs = (refs[:2],) + refs[2:]
  q_gmem, kv_gmem, idx_gmem, scal_gmem, o_gmem, lse_gmem, q_sw, k_sw, *rest = refs
  v16, *rest = rest
  (p_sw, idx_smem, lse_smem, head_smem, q_bar, idx_bar, k_full, k_empty, p_full, p_empty, max_bar,
   l_bar) = rest
  r = common.SparseRefs(q_gmem, None, kv_gmem, idx_gmem, scal_gmem, o_gmem, lse_gmem, q_sw, k_sw, v16, p_sw,
                        idx_smem, lse_smem, head_smem, q_bar, idx_bar, k_full, k_empty, p_full, p_empty)
  wg = lax.axis_index("wg")
  tile_q = lax.axis_index("q")
  split = lax.axis_index("split")

  @pl.when(wg == MATH)
  def _():
    heads_m._loader(cfg, num_slots, interpret, tile_q, split, lax.div(tile_q, tiles_per_token), r)

  for w in range(MATH):
    @pl.when(wg == w)
    def _():
      _math(cfg, num_slots, out_dtype, interpret, w, tile_q, split, r, max_bar, l_bar, heads, softmax_scale)


def build(num_q_tiles: int, num_slots: int, num_splits: int, tiles_per_token: int, out_dtype,
          cfg: heads_m.TuningConfig, interpret=False, heads: int | None = None, softmax_scale: float | None = None,
          q_split: bool = False):
  """The "pair_v16" kernel (``heads_m.build``'s arguments and results; called by it for that schedule)."""
  interp = bool(interpret)
  common.check_interpret_threads(interp, MATH + 1, "schedule 'pair_v16'")
  body = functools.partial(_body, cfg, num_slots, tiles_per_token, out_dtype, interp, heads, float(softmax_scale),
                           bool(q_split))
  return heads_m.kernel_call(
      body, num_q_tiles, num_splits, out_dtype, MATH + 1, interpret, approx_math=True,   # as "producer_vt"
      scratch_types=[
          common.q_scratch(TILE, cfg.layout),                                              # Q
          common.k_scratch(cfg.k_buffers, cfg.layout),                                     # K
          plgpu.SMEM((TILE, D_V), jnp.float16, transforms=swizzled(jnp.float16, 128)),     # V f16
          plgpu.SMEM((MATH, TILE, TILE), jnp.float16, transforms=swizzled(jnp.float16, 128)),   # P slots
          plgpu.SMEM((cfg.tiles_per_split, TILE), jnp.int32),                              # indices
          plgpu.SMEM((TILE,), jnp.float32),                                                # lse
          plgpu.SMEM((HEAD_ROWS, TILE), jnp.float32),                                      # head rows
          plgpu.Barrier(num_arrivals=2),                                                   # q_bar
          plgpu.Barrier(),                                                                 # idx_bar
          plgpu.Barrier(num_arrivals=common.k_full_arrivals(interp, cfg.layout),
                        num_barriers=cfg.k_buffers),                                       # k_full
          plgpu.Barrier(num_arrivals=MATH, num_barriers=cfg.k_buffers),                    # k_empty
          plgpu.Barrier(num_barriers=MATH),                                                # p_full
          plgpu.Barrier(num_arrivals=MATH, num_barriers=MATH),                             # p_empty
          plgpu.Barrier(num_arrivals=MATH, num_barriers=2),                                # max_bar
          plgpu.Barrier(num_arrivals=MATH),                                                # l_bar
      ])
