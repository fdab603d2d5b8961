"""Native-FP8 sparse MLA decode for Hopper (sm_90a), heads on the MMAs' N side (the op's design for H <= 16).

What one CTA computes
---------------------
The H <= 16 heads of one query token, as the N = 16 columns of the MMAs (instead of padding them to 64 rows),
against ``tiles_per_split`` tiles of 64 gathered KV rows (one split of the token's top-k), everything transposed:

    Sᵀ   = K8 · Q8ᵀ  [64 keys, 16]        m64n16k32 fp8 wgmmas, f32 accumulate, K = 640 (five chunks of 128)
    Q8   = e4m3(q / q_scale) per head row, q_scale = max |q[head]| / 448   (quantized in the kernel, by WG0)
    sᵀ   = Sᵀ · head_scale                head_scale = q_scale(head) · kv_scale · softmax_scale · log2(e)
    sᵀ   = −inf where the key is invalid (index < 0 or ≥ num_slots)
    online softmax in base 2 down the columns (m per head; running sums l per (key, head), summed once at the end)
    Oᵀ  += Vᵀ · f16(Pᵀ)  [512, 16]        m64n16k16 f16 wgmmas (8 blocks of 64 latent columns), f32 accumulate
    out  = O · kv_scale / l,  lse = (m + log2 l) · ln 2

Shapes, dtypes, index conventions (kernel arguments, prepared by ``mla_pallas.ops.sparse_decode``)
--------------------------------------------------------------------------------------------------
    q    [num_tokens · q_stride, 576] bf16 or f32: flat, unpadded query rows (the op's q as it is), q_stride = H;
         with ``q_split`` two inputs instead, latent [.., 512] and rope [.., 64] (bf16 or f32 each).
         The CTA of token q quantizes rows [q · q_stride, (q + 1) · q_stride) into its 16-row fp8 tile (latent |
         64 zeros | rope; rows past H are zeros) with the bytes and row scales of the XLA pre-pass
         (``kernels/q_quant.py``: ``quantize_head_rows``; row scale amax · f32(1/448) · ((softmax_scale · kv_scale)
         · log2 e), ``softmax_scale`` static).
    kv   [num_slots, 576] fp8: the cache; idx [num_tokens, num_splits · tiles_per_split, 64] int32 row ids (any id
         outside [0, num_slots) is an invalid key: gathered as row num_slots, past the end, and masked).
    scal [1] f32: kv_scale.
    Returns o [num_tokens, num_splits, out_heads, 512] out_dtype (out_heads = H rounded up to 8; written through
    a transposed GMEM view) and lse [num_tokens, num_splits, out_heads] f32 (natural log), each split normalised
    by its own softmax sum.

Warpgroup roles (3 warpgroups, Lane semantics)
----------------------------------------------
* WG2 — loader (56 registers): the split's indices (``idx_bar``); then per tile the gather of its 64
  rows into the swizzled K buffer ``t % k_buffers`` by the warpgroup's threads (16-byte ``cp.async``,
  ``common.gather_tiles``, ``kernels/gather_threads.py``), with up to k_buffers - 1 tiles in flight.
* WG0 — softmax consumer (224 registers): first Q: each warp quantizes 4 of the token's rows from GMEM into the Q
  tile (raw PTX: two 16-byte loads per lane, a butterfly for the row max, 16-byte swizzled stores) and their max
  |q| into ``head_smem`` row 0, under the loader's index load and first gather; then per tile the five QKᵀ
  wgmmas (A = the K chunk, B = Q), release of the
  K buffer, the online softmax down the columns, and the hand-off of Pᵀ (f16 [64, 16]) and alpha ([16] f32) to WG1
  through the double-buffered ``p_sw`` / ``head_smem`` rows 1-2 (``p_full`` / ``p_empty``). After the last tile:
  kv_scale / l into ``head_smem`` row 3 (``p_full[2]``) and the lse store.
* WG1 — P·V consumer (224 registers): per tile its Vᵀ straight from the K tile into registers
  (``kernels/vt_registers.py``: 64-bit SMEM loads, byte permutes, e4m3x2 → f16x2), release of the K buffer, then
  after Pᵀ arrives the 32 P·V wgmmas with Vᵀ as the register A operand; at the end the O store (16-byte rows).
  Only WG0 runs a softmax: its reductions cross warps, and Mosaic GPU gives every warpgroup's cross-warp
  reductions the same SMEM scratch, so two softmax warpgroups would corrupt each other's partial results.

Interpret mode has no ``inline_mgpu``: there WG1 runs :func:`_pv_consumer_interpret_smem_v`, an interpret-only
stand-in that upcasts V into an f16 SMEM tile (chunks 0-1 before Pᵀ arrives, 2-3 under the first P·V wgmmas)
and multiplies from SMEM: the same products in the natural row order; and WG0 quantizes Q with Pallas array ops
(``q_quant.quantize_head_rows_interpret``, the same bytes). The register paths are checked by lowering and on the
GPU only (README: interpret-only code paths).

The softmax and P·V warpgroups also run the dense kernel's heads-on-N design (``kernels/dense_sm90.py``): the
softmax warpgroup takes the CTA's tiles as ``common.KeyTiles``, the P·V warpgroup a tile count.

Pipeline stages: gather of tile t + k_buffers - 1 ∥ QKᵀ + softmax of tile t (WG0) ∥ Vᵀ loads and P·V of tile
t - 1 or t (WG1).

SMEM budget (bytes, k_buffers = 4, tiles_per_split = 32; :meth:`TuningConfig.smem_budget`, 1 KB rounding)
-----------------------------------------------------------------------------------------------------------
    Q (fp8, swizzled, 5 × 16 × 128)                       10 240
    K (k_buffers × 5 × 64 × 128 fp8, swizzled)           163 840
    Pᵀ (2 × 64 × 16 f16)                                   4 096
    indices (tiles_per_split × 64 int32)                   8 192
    lse staging (16 f32)                                   1 024
    head_smem (4 × 32 f32: amax, alpha × 2, 1/l)           1 024
    barriers                                                 512
    Mosaic reduction scratch                               2 048
    total                                                190 976   (limit 232 448: one CTA per SM)
Interpret mode adds the f16 V tile (64 × 512, 65 536; no SMEM limit there).
Registers: 224 per consumer thread (WG1: 8 Oᵀ blocks of 64 × 16 f32 = 64, Vᵀ words 64), 56 for the loader.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common
from mla_pallas.kernels import q_quant
from mla_pallas.kernels import vt_registers
from mla_pallas.kernels.common import (CONSUMER_REGS, D_V, FP8, LOADER_REGS, SW_CHUNK, SW_CHUNKS, TILE,
                                       swizzled)

HEADS_N = 16     # N of the MMAs: H <= 16 padded to 16 columns (f16 operands need rows of at least 32 bytes)
HEAD_ROW = 32    # f32 entries per row of head_smem (one 128-byte row per use)
LOADER = 2       # warpgroup index of the loader; WG0 softmax, WG1 P·V
ALPHA_ROW = 1    # head_smem rows: 0 the heads' logit scales, 1 + b alpha of P buffer b, 3 kv_scale / l
INV_ROW = 3
V_BLOCKS = D_V // TILE   # 8 blocks of 64 latent columns (the Oᵀ accumulators)


@dataclasses.dataclass(frozen=True)
class TuningConfig(common.SparseSm90Config):
  """Config of the heads-on-N design: ``tiles_per_split``, ``k_buffers`` (2-4; 4 fills the SMEM the 16-row Q and
  the register Vᵀ leave)."""
  K_BUFFERS: ClassVar[tuple[int, ...]] = (2, 3, 4)
  k_buffers: int = 4

  def smem_budget(self) -> int:
    return common.smem_bytes(
        ((SW_CHUNKS, HEADS_N, SW_CHUNK), FP8),                  # Q (latent | 0 | rope)
        ((self.k_buffers, SW_CHUNKS, TILE, SW_CHUNK), FP8),     # K, gathered straight into the swizzled layout
        ((2, TILE, HEADS_N), jnp.float16),                      # Pᵀ
        ((self.tiles_per_split, TILE), jnp.int32),              # indices
        ((HEADS_N,), jnp.float32),                              # lse staging
        ((INV_ROW + 1, HEAD_ROW), jnp.float32),                 # head_smem
    ) + 64 * 8 + 2048   # barriers; Mosaic reduction scratch (CompilerParams default)


def _head_values(r: common.SparseRefs, row):
  """[16] f32 of head_smem row ``row``, one value per head (column of Sᵀ)."""
  return plgpu.load(r.head_smem.at[row, pl.ds(0, HEADS_N)], layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)


def _loader(cfg: TuningConfig, num_slots: int, interpret: bool, q_stride: int, r: common.SparseRefs):
  """WG2: the split's indices (``idx_bar``), then the gathers."""
  n_tiles = cfg.tiles_per_split
  plgpu.set_max_registers(LOADER_REGS, action="decrease")
  tile_q, split = lax.axis_index("q"), lax.axis_index("split")
  plgpu.copy_gmem_to_smem(r.idx_gmem.at[tile_q, pl.ds(split * n_tiles, n_tiles)], r.idx_smem, r.idx_bar)

  def wait_indices(t):
    @pl.when(t == 0)
    def _():
      plgpu.barrier_wait(r.idx_bar)
  common.gather_tiles(r.kv_gmem, r.k_sw, r.idx_smem, r.k_full, r.k_empty, num_slots=num_slots,
                      n_tiles=n_tiles, k_buffers=cfg.k_buffers, interpret=interpret, before_gather=wait_indices)


KEY_LAYOUT = plgpu.Layout.WGMMA.reduce(1)     # [64]: one value per key (row of Sᵀ)


def _softmax_consumer(cfg: common.SparseSm90Config, num_slots: int, q_stride: int, softmax_scale, interpret: bool, wg,
                      r: common.SparseRefs, keys=None):
  """WG0: Q quantized from the token's q rows (``q_quant.quantize_head_rows``, under the loader's index load and
  first gather), then per tile Sᵀ = K·Qᵀ, the online softmax down the columns, Pᵀ / alpha to WG1; kv_scale / l
  and lse at the end. ``keys``: a function returning the ``common.KeyTiles`` to run (masks in KEY_LAYOUT),
  called after Q (it waits for the dense kernel's table itself); None: the split's ``tiles_per_split`` tiles,
  each key masked by its id, the indices waited for before the first tile."""
  quantize = q_quant.quantize_head_rows_interpret if interpret else q_quant.quantize_head_rows
  quantize(r.q_gmem, r.q_sw, r.head_smem.at[0], lax.axis_index("q") * q_stride, q_stride)
  plgpu.commit_smem()   # the async-proxy fence and a warpgroup barrier: Q for the wgmmas, amax for the loads below
  head_scale = q_quant.row_scales(_head_values(r, 0), softmax_scale, r.scal_gmem[0])
  wait_indices = keys is None
  keys = common.id_key_tiles(cfg.tiles_per_split, r.idx_smem, num_slots, KEY_LAYOUT) if keys is None else keys()

  def step(mask, t, carry):
    m, l = carry
    kb = lax.rem(t, cfg.k_buffers)
    pb = lax.rem(t, 2)
    k_tiles = r.k_sw.at[kb]

    if wait_indices:
      @pl.when(t == 0)
      def _():
        plgpu.barrier_wait(r.idx_bar)
    plgpu.barrier_wait(r.k_full.at[kb])

    def qk(acc_ref):
      for c in range(SW_CHUNKS):
        plgpu.wgmma(acc_ref, k_tiles.at[c], r.q_sw.at[c].T)
      return acc_ref[...]
    st = pl.run_scoped(qk, plgpu.ACC((TILE, HEADS_N), jnp.float32))
    plgpu.barrier_arrive(r.k_empty.at[kb])

    p, alpha, m_new, l = common.online_softmax_tile(st, None if mask is None else mask(t), head_scale, m, l,
                                                    keys_axis=0)

    @pl.when(t >= 2)
    def _():
      plgpu.barrier_wait(r.p_empty.at[pb])   # WG1 is done with buffer pb (tile t - 2)
    r.p_sw.at[pb][...] = p.astype(jnp.float16)
    r.head_smem.at[ALPHA_ROW + pb, pl.ds(0, HEADS_N)][...] = alpha
    plgpu.commit_smem()
    plgpu.barrier_arrive(r.p_full.at[pb])
    return m_new, l

  m0 = plgpu.layout_cast(jnp.full((HEADS_N,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(0))
  l0 = plgpu.layout_cast(jnp.zeros((TILE, HEADS_N), jnp.float32), plgpu.Layout.WGMMA)   # per (key, head)
  m, l = m0, l0
  for lo, hi, mask in keys.segments:
    m, l = lax.fori_loop(lo, hi, functools.partial(step, mask), (m, l))
  l = l.sum(axis=0)
  inv = r.scal_gmem[0] / jnp.where(l == 0.0, 1.0, l)
  r.head_smem.at[INV_ROW, pl.ds(0, HEADS_N)][...] = inv
  plgpu.commit_smem()
  plgpu.barrier_arrive(r.p_full.at[2])
  tile_q, split = lax.axis_index("q"), lax.axis_index("split")
  common.store_lse(wg, m, l, r.lse_smem, r.lse_gmem.at[tile_q, split])
  common.drain(r.p_empty, keys.n_tiles, 2)


def _pv_loop(cfg: common.SparseSm90Config, r: common.SparseRefs, step, n_tiles=None):
  """The P.V consumer's tile loop, shared by both V paths: ``step(t, accs)`` over the split's tiles from zero Oᵀ
  accumulators (V_BLOCKS x [64 values of d, HEADS_N]), then the wait for 1/l (Pᵀ slot 2). Returns the normalised
  Oᵀ blocks and this CTA's O ref ``o_gmem[tile_q, split]``. ``n_tiles``: a function returning the number of
  tiles (int or traced), called first; None: ``tiles_per_split``."""
  n_tiles = cfg.tiles_per_split if n_tiles is None else n_tiles()
  acc0 = (plgpu.layout_cast(jnp.zeros((TILE, HEADS_N), jnp.float32), plgpu.Layout.WGMMA),) * V_BLOCKS
  accs = lax.fori_loop(0, n_tiles, step, acc0)
  plgpu.barrier_wait(r.p_full.at[2])
  inv = _head_values(r, INV_ROW)
  tile_q, split = lax.axis_index("q"), lax.axis_index("split")
  return [a * lax.broadcast_in_dim(inv, a.shape, [1]) for a in accs], r.o_gmem.at[tile_q, split]


def _pv_consumer(cfg: common.SparseSm90Config, r: common.SparseRefs, n_tiles=None):
  """WG1: Vᵀ from the K tile into registers, Oᵀ += Vᵀ·Pᵀ per tile (``vt_registers``), the O store at the end
  (``n_tiles``: :func:`_pv_loop`)."""

  def step(t, accs):
    kb = lax.rem(t, cfg.k_buffers)
    pb = lax.rem(t, 2)
    plgpu.barrier_wait(r.k_full.at[kb])
    words = vt_registers.load_v_words(r.k_sw.at[kb])
    plgpu.barrier_arrive(r.k_empty.at[kb])
    plgpu.barrier_wait(r.p_full.at[pb])
    accs = common.scale_columns(accs, _head_values(r, ALPHA_ROW + pb))
    accs = vt_registers.pv_wgmmas(words, r.p_sw, accs, 2 * HEADS_N, slot=pb)
    plgpu.barrier_arrive(r.p_empty.at[pb])
    return accs

  o_blocks, o_ref = _pv_loop(cfg, r, step, n_tiles)
  # block g holds the latent columns g, g + 8, ..., g + 504: 16-byte row stores
  vt_registers.store_o(o_blocks, o_ref)


def _pv_consumer_interpret_smem_v(cfg: common.SparseSm90Config, out_dtype, r: common.SparseRefs, n_tiles=None):
  """Interpret-mode stand-in for :func:`_pv_consumer` (no ``inline_mgpu`` there): WG1 upcasts V into the f16
  SMEM tile ``v16`` (chunks 0-1, then after Pᵀ arrives chunks 2-3 under the wgmmas of blocks 0-3) and runs
  Oᵀ[block] += Vᵀ[block]·Pᵀ with Vᵀ the transposed SMEM view; the O store is a transposed GMEM view per block
  (``n_tiles``: :func:`_pv_loop`)."""
  out_heads = r.o_gmem.shape[-2]

  def step(t, accs):
    kb = lax.rem(t, cfg.k_buffers)
    pb = lax.rem(t, 2)
    k_tiles = r.k_sw.at[kb]
    plgpu.barrier_wait(r.k_full.at[kb])
    common.stage_v16(k_tiles, r.v16, chunks=(0, 1))
    plgpu.commit_smem()
    plgpu.barrier_wait(r.p_full.at[pb])
    accs = common.scale_columns(accs, _head_values(r, ALPHA_ROW + pb))

    def pv(refs):
      for b, ref in enumerate(refs):
        if b == V_BLOCKS // 2:   # the second half of V, staged while the first blocks' wgmmas run
          common.stage_v16(k_tiles, r.v16, chunks=(2, 3))
          plgpu.commit_smem()
          plgpu.barrier_arrive(r.k_empty.at[kb])
        plgpu.wgmma(ref, r.v16.at[:, pl.ds(b * TILE, TILE)].T, r.p_sw.at[pb])
    accs = common.accumulate(pv, accs, True)
    plgpu.barrier_arrive(r.p_empty.at[pb])
    return accs

  o_blocks, o_ref = _pv_loop(cfg, r, step, n_tiles)
  for b, o in enumerate(o_blocks):
    out = plgpu.layout_cast(o, plgpu.Layout._WGMMA_ACC_32BIT)
    o_ref.at[:, pl.ds(b * TILE, TILE)].T[...] = out.astype(out_dtype)[:, :out_heads]


def _body(cfg, num_slots, out_dtype, interpret, q_stride, softmax_scale, q_split, *refs):
  if q_split:   # q as (latent [T · H, 512], rope [T · H, 64])
    refs = (refs[:2],) + refs[2:]
  q_gmem, kv_gmem, idx_gmem, scal_gmem, o_gmem, lse_gmem, q_sw, k_sw, *rest = refs
  v16, rest = (rest[0], rest[1:]) if interpret else (None, rest)
  p_sw, idx_smem, lse_smem, head_smem, idx_bar, k_full, k_empty, p_full, p_empty = rest
  # no row-scale input and no q_bar: WG0 makes Q and its scales itself
  r = common.SparseRefs(q_gmem=q_gmem, qs_gmem=None, kv_gmem=kv_gmem, idx_gmem=idx_gmem, scal_gmem=scal_gmem,
                        o_gmem=o_gmem, lse_gmem=lse_gmem, q_sw=q_sw, k_sw=k_sw, v16=v16, p_sw=p_sw, idx_smem=idx_smem,
                        lse_smem=lse_smem, head_smem=head_smem, q_bar=None, idx_bar=idx_bar, k_full=k_full,
                        k_empty=k_empty, p_full=p_full, p_empty=p_empty)
  wg = lax.axis_index("wg")

  @pl.when(wg == LOADER)
  def _():
    _loader(cfg, num_slots, interpret, q_stride, r)

  @pl.when(wg < LOADER)
  def _():
    plgpu.set_max_registers(CONSUMER_REGS, action="increase")

    @pl.when(wg == 0)
    def _():
      _softmax_consumer(cfg, num_slots, q_stride, softmax_scale, interpret, wg, r)

    @pl.when(wg == 1)
    def _():
      if interpret:
        _pv_consumer_interpret_smem_v(cfg, out_dtype, r)
      else:
        _pv_consumer(cfg, r)


@functools.lru_cache(maxsize=64)
def build(num_tokens: int, num_slots: int, num_splits: int, out_heads: int, q_stride: int, out_dtype_name: str,
          cfg: TuningConfig, softmax_scale: float, interpret=False, q_split: bool = False):
  """The kernel for these shapes (arguments and results: see the module docstring). ``out_heads``: heads stored
  (a multiple of 8 in (0, 16]); ``q_stride``: Q rows per token (H); ``softmax_scale``: folded into the row
  scales the kernel makes; ``interpret``: False, True or a ``plgpu.InterpretGPUParams``; ``q_split``: q comes as
  two inputs, latent [T · H, 512] and rope [T · H, 64] (bf16 or f32 each), instead of q [T · H, 576]."""
  if not (0 < out_heads <= HEADS_N and out_heads % 8 == 0):
    raise ValueError(f"out_heads must be a multiple of 8 in (0, {HEADS_N}]; got {out_heads}")
  if not 0 < q_stride <= HEADS_N:
    raise ValueError(f"q_stride must be in (0, {HEADS_N}] (the token's heads); got {q_stride}")
  out_dtype = jnp.dtype(out_dtype_name)
  interp = bool(interpret)
  body = functools.partial(_body, cfg, num_slots, out_dtype, interp, q_stride, float(softmax_scale), bool(q_split))
  # Vᵀ is the A operand of a wgmma whose B (Pᵀ, 16 f16 = 32-byte rows) fixes the swizzle at 32 bytes.
  v_scratch = [plgpu.SMEM((TILE, D_V), jnp.float16, transforms=swizzled(jnp.float16, 2 * HEADS_N))] if interp else []
  return plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((num_tokens, num_splits, out_heads, D_V), out_dtype),
                jax.ShapeDtypeStruct((num_tokens, num_splits, out_heads), jnp.float32)),
      grid=(num_tokens, num_splits), grid_names=("q", "split"),
      num_threads=LOADER + 1, thread_name="wg",
      scratch_types=[
          common.q_scratch(HEADS_N),                                                       # Q
          common.k_scratch(cfg.k_buffers),                                                 # K
          *v_scratch,                                                                      # V f16 (interpret)
          plgpu.SMEM((2, TILE, HEADS_N), jnp.float16, transforms=swizzled(jnp.float16, 2 * HEADS_N)),   # Pᵀ
          plgpu.SMEM((cfg.tiles_per_split, TILE), jnp.int32),                              # indices
          plgpu.SMEM((HEADS_N,), jnp.float32),                                             # lse
          plgpu.SMEM((INV_ROW + 1, HEAD_ROW), jnp.float32),                                # head_smem
          plgpu.Barrier(),                                                                 # idx_bar
          plgpu.Barrier(num_arrivals=common.k_full_arrivals(interp),
                        num_barriers=cfg.k_buffers),                                       # k_full
          plgpu.Barrier(num_arrivals=2, num_barriers=cfg.k_buffers),                       # k_empty
          plgpu.Barrier(num_barriers=3),                                                   # p_full
          plgpu.Barrier(num_barriers=2),                                                   # p_empty
      ],
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE),
      **common.interpret_kwargs(interpret),
  )
