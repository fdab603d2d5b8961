"""Native-FP8 dense (paged) MLA decode for Hopper (sm_90a): the sparse heads-on-M kernel's attention core over
whole 64-key tiles of a sequence's pages.

What one CTA computes
---------------------
One *query tile* of 64 rows (the heads of one query token; H < 64 is zero-padded to 64 rows, H = 128 is two
tiles) against the 64-key tiles of one *split* of its sequence: split s covers positions
[64 · tiles_per_split · s, 64 · tiles_per_split · (s + 1)), and the CTA runs only the tiles that hold a position
below the token's limit (``n_tiles``, 0 to tiles_per_split; with 0 it writes O = 0 and lse = −inf). The products
and the softmax are those of ``sparse_sm90_heads_m``'s "producer_vt" schedule (its docstring: FP8 QKᵀ, f32
online softmax with lazy rescaling, f16 P, Oᵀ = Vᵀ·Pᵀ with Vᵀ as a register operand read from the fp8 K tile);
only the keys differ: they are the rows of the sequence's pages, in order, instead of gathered top-k rows.

Shapes, dtypes, index conventions (kernel arguments, prepared by ``mla_pallas.ops.dense_decode``)
-----------------------------------------------------------------------------------------------
    q    [num_tokens · H, 576] bf16 or f32 (or, with ``q_split``, latent [.., 512] and rope [.., 64] as two
         inputs): the query rows, quantized in the kernel (``sparse_sm90_heads_m``, "Q in the kernel"); query
         tile q holds heads 64 (q % tiles_per_token) ... of token q // tiles_per_token.
    kv   [num_slots, 576] fp8: the paged cache flattened (slot = page · page_size + offset; latent 512 | rope 64;
         V = the first 512).
    tab  [num_tokens · num_splits, TAB] int32, row ``token · num_splits + split`` (:func:`table_width`: TAB =
         HEADER + tiles_per_split rounded up to 32 entries, one 128-byte TMA per 32):
         [0] ``n_full``: the leading tiles whose 64 keys all count (inside the limit, on a valid page): run
             without a key mask;
         [1] ``n_tiles``: the tiles the CTA runs (0 ... tiles_per_split);
         [2] ``rel``: the token's limit minus the split's first position (positions p with p − first < rel
             count; may be <= 0 or past the split);
         [3] unused;
         [HEADER + t] the cache slot of tile t's first key: ``page · page_size + offset`` (page_size a multiple of
             64, so a tile never crosses a page), or ``num_slots`` where the page id is outside [0, num_pages)
             (the loader reads nothing there: the rows are zero-filled; the tile's keys are masked).
    scal [1] f32: kv_scale (multiplies the output).
    Returns o [num_q_tiles, num_splits, 64, 512] bf16 and lse [num_q_tiles, num_splits, 64] f32 (natural log),
    each split normalised by its own softmax sum (the op merges splits by lse, ``sparse_decode.combine_splits``).

Warpgroup roles ("producer_vt"; 4 warpgroups, Lane semantics)
--------------------------------------------------------------
* WG3 — loader (24 registers): the CTA's table row by TMA (``tab_bar``), then per tile t < n_tiles, once the K
  buffer t % k_buffers is free (``k_empty``), the tile's rows: slots first ... first + 63 (first from the table),
  into the sparse kernel's K tile layout (chunks of cache columns 0, 128, 256, 384 and the tail 448-575, 128-byte
  swizzled) by the warpgroup's 128 threads, 20 16-byte ``cp.async`` each (``common.gather_tiles`` with runs,
  ``gather_threads.issue_tile(run=...)``), published on ``k_full``. Rows at or past the limit (``rel − 64 t``)
  are zero-filled, not read: cache rows past a sequence may hold anything, NaN included, and P = 0 times NaN is
  NaN. (TMA boxes of whole pages do not lower: docs/kernels/dense_decode_sm90.md.)
* WG0 — producer (88 registers), WG1 / WG2 — multipliers (200 each): ``sparse_sm90_heads_m._producer`` and
  ``_multiplier`` with the tiles of this CTA (``KeyTiles``): the producer runs tiles [0, n_full) without a key
  mask and [n_full, n_tiles) with the mask ``key < rel − 64 t`` (and none on a page outside the cache); the
  multipliers run n_tiles tiles. Interpret mode: ``_multiplier_interpret`` (the f16 V tile), per-row copies.

BF16 cache (``TuningConfig.cache_dtype="bfloat16"``; heads on M at every H, as the sparse op's bf16 kernel)
------------------------------------------------------------------------------------------------------------
BF16 attention over a bfloat16 cache ([num_slots, 576] bf16, 1152 bytes per row), the sparse heads-on-M kernel's
bf16 "producer_vt" (its module docstring, "BF16 cache"): the kernel takes q as bf16 tiles [num_q_tiles, 64, 576]
(H < 64 zero-padded) and ``qs`` [num_q_tiles, 64] f32 (softmax_scale · kv_scale · log2 e) in place of the q rows,
which the loader TMAs (nine 64-column chunks on ``q_bar``) before the table; the tiles land as nine 64-column chunks
(36 ``cp.async`` per thread and tile); the producer's QKᵀ is nine bf16 wgmmas and it writes P (bf16) into the tile's
rope chunk; the multipliers hold O [64 heads, 256] and add P·V (m64n64k16 per 64-column chunk, both operands in the
K buffer). o is float32 where the op merges splits. SMEM (k_buffers = 2, the only count that fits): Q 73 728 + K 147
456 + table 1 024 + lse 1 024 + alpha / 1/l / flag rows 1 024 + barriers and scratch 2 560 = 226 816.

"seesaw" over a BF16 cache (``TuningConfig.schedule="seesaw"``; a sweep candidate until measured)
----------------------------------------------------------------------------------------------------
``sparse_sm90_heads_m``'s "seesaw" (its module docstring, "Seesaw") with this kernel's tiles: three warpgroups,
WG0 / WG1 the consumers (consumer t % 2 computes tile t's S and softmax from the other's (m, l) and hands P, alpha,
m, l over; both multiply every tile into their 256 output columns), WG2 this module's loader (``LOADER_REGS``).
The tile count is the table row's (traced), so consumer 0's first tile and a consumer's tail (the other's last
tile) run under ``lax.cond``, and each consumer runs its own tiles of [0, n_full) unmasked and of
[n_full, n_tiles) masked (``common.tile_mask`` for the first tile, whichever range holds it); a CTA with no tile
writes O = 0 and lse = −inf. SMEM: as "producer_vt"'s, without the lse buffer (head_smem's last row stages it):
Q 73 728 + K 147 456 + table 1 024 + (alpha, m, l) × 2 and the lse row 2 048 + barriers and scratch 2 560 =
226 816.

Heads on N (H <= 16: :func:`build_heads_n`, :class:`HeadsNConfig`)
------------------------------------------------------------------
One CTA per (query token, split), the token's H heads as the N = 16 columns of the MMAs: ``sparse_sm90_heads_n``'s
softmax warpgroup (WG0: Q quantized from the token's rows, Sᵀ = K·Qᵀ, softmax down the columns, Pᵀ to WG1) and
P·V warpgroup (WG1: Vᵀ from the K tile in registers) with this module's tables and loader (WG2, 56 registers);
the softmax warpgroup waits for the table after Q, then runs [0, n_full) unmasked and [n_full, n_tiles) masked
(KEY_LAYOUT). Returns o [num_tokens, num_splits, out_heads, 512] bf16 (out_heads = H rounded up to 8) and lse
[num_tokens, num_splits, out_heads]. SMEM (k_buffers = 4, the default): Q 10 240 + K 163 840 + Pᵀ 4 096 + table
1 024 + lse 1 024 + head rows 1 024 + barriers and scratch 2 560 = 183 808 (k_buffers = 5: 224 768).

SMEM budget (bytes, 1 KB rounding; :meth:`TuningConfig.smem_budget`)
--------------------------------------------------------------------
    Q (fp8, swizzled, 5 × 64 × 128)                       40 960
    K (k_buffers × 5 × 64 × 128 fp8, swizzled)            81 920   (k_buffers = 2; 3: 122 880)
    P slots (2 × 64 × 64 f16)                             16 384
    table row (TAB int32, <= 160 entries)                  1 024
    lse staging                                            1 024
    alpha / (kv_scale / l) / amax / rescale-flag rows      2 048
    barriers                                                 512
    Mosaic reduction scratch                               2 048
    total (k_buffers = 2)                                145 920   (3: 186 880; limit 232 448)
    bf16 cache: section "BF16 cache" (226 816)
Registers: as ``sparse_sm90_heads_m`` "producer_vt" (``PRODUCER_REGS``: 24, 88, 200, 200).
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

from mla_pallas.kernels import common, sparse_sm90_heads_m as heads_m, sparse_sm90_heads_n as heads_n
from mla_pallas.kernels.common import CONSUMER_REGS, D_V, LOADER_REGS, TILE, swizzled

# Table row: header entries, then one first slot per tile (module docstring).
N_FULL, N_TILES, REL = 0, 1, 2
HEADER = 4
TABLE_ALIGN = 32    # entries per 128 bytes: a warpgroup's TMA moves a multiple of 128 bytes


def table_width(tiles_per_split: int) -> int:
  """Entries of a table row: HEADER + one per tile, rounded up to TABLE_ALIGN."""
  return -(-(HEADER + tiles_per_split) // TABLE_ALIGN) * TABLE_ALIGN


@dataclasses.dataclass(frozen=True)
class _DenseConfig(common.SparseSm90Config):
  """Base of the two designs' configs: ``tiles_per_split`` up to MAX_TILES (at most 160 table entries)."""
  MAX_TILES: ClassVar[int] = 128

  def validate(self):
    if self.tiles_per_split > self.MAX_TILES:
      raise ValueError(f"{type(self).__name__}.tiles_per_split must be <= {self.MAX_TILES}; "
                       f"got {self.tiles_per_split}")
    super().validate()


@dataclasses.dataclass(frozen=True)
class TuningConfig(_DenseConfig):
  """Config of the dense kernel with the heads on M: ``tiles_per_split`` (64-key tiles per split, up to 128),
  ``k_buffers`` (K tiles in flight, 2 or 3; a bf16 cache: 2), ``cache_dtype`` (the cache it reads: float8_e4m3fn
  or bfloat16, module docstring "BF16 cache") and ``schedule``, ``sparse_sm90_heads_m``'s: "producer_vt" (module
  docstring) or, over a bf16 cache, "seesaw" (module docstring, "Seesaw over a BF16 cache")."""
  K_BUFFERS: ClassVar[tuple[int, ...]] = (2, 3)
  CACHE_DTYPES: ClassVar[tuple[str, ...]] = heads_m.TuningConfig.CACHE_DTYPES
  SCHEDULES: ClassVar[tuple[str, ...]] = ("producer_vt", "seesaw")
  k_buffers: int = 2
  cache_dtype: str = "float8_e4m3fn"
  schedule: str = "producer_vt"

  def validate(self):
    if self.cache_dtype not in self.CACHE_DTYPES:
      raise ValueError(f"TuningConfig.cache_dtype must be one of {self.CACHE_DTYPES}; got {self.cache_dtype!r}")
    if self.schedule not in self.SCHEDULES:
      raise ValueError(f"TuningConfig.schedule must be one of {self.SCHEDULES}; got {self.schedule!r}")
    super().validate()   # (its SMEM budget builds the core config, which checks itself: bf16 k_buffers <= 2,
                         # "seesaw" over bf16 only)

  @property
  def core(self) -> heads_m.TuningConfig:
    """The heads-on-M config whose producer and multipliers this kernel runs. Its ``tiles_per_split`` is 1: the
    roles take their tiles from the table here (``keys``, ``n_tiles``), and the sparse kernel's index tile that
    the field sizes is not allocated."""
    return heads_m.TuningConfig(tiles_per_split=1, k_buffers=self.k_buffers, schedule=self.schedule,
                                cache_dtype=self.cache_dtype)

  def smem_budget(self) -> int:
    core = self.core
    lay = core.layout
    p_slots = (((heads_m.P_BUFFERS, TILE, TILE), jnp.float16),) if core.p_slots() else ()
    return common.smem_bytes(
        ((lay.chunks, TILE, lay.chunk_cols), lay.dtype),                            # Q
        ((self.k_buffers, lay.chunks, TILE, lay.chunk_cols), lay.dtype),            # K
        *p_slots,                                                                   # P slots (fp8 cache)
        ((table_width(self.tiles_per_split),), jnp.int32),                          # table row
        *((((TILE,), jnp.float32),) if not core.seesaw else ()),                    # lse ("seesaw": a head row)
        ((core.head_rows, TILE), jnp.float32),                                      # alpha, kv_scale / l, ...
    ) + 64 * 8 + 2048   # barriers; Mosaic reduction scratch


def _header(r: common.SparseRefs, entry: int):
  return r.idx_smem[entry]


def _key_tiles(num_slots: int, r: common.SparseRefs, layout=heads_m.COL_LAYOUT) -> common.KeyTiles:
  """The producer's tiles, read from the table row (after its wait on ``tab_bar``): [0, n_full) unmasked,
  [n_full, n_tiles) with key k of tile t counting where k < rel − 64 t and the tile's page is in the cache."""
  n_full, n_tiles, rel = (_header(r, e) for e in (N_FULL, N_TILES, REL))

  def mask(t):
    first = r.idx_smem[HEADER + t]
    count = jnp.where(first < num_slots, rel - t * TILE, 0)
    keys = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (TILE,), 0), layout)
    return keys < count
  return common.KeyTiles(n_tiles, ((0, n_full, None), (n_full, n_tiles, mask)))


def _multiplier_tiles(r: common.SparseRefs):
  """A multiplier's (or the heads-on-N P·V warpgroup's) tile count: n_tiles from the table row, once it has
  landed."""
  plgpu.barrier_wait(r.idx_bar)
  return _header(r, N_TILES)


def _table_key_tiles(num_slots: int, r: common.SparseRefs, layout):
  """:func:`_key_tiles` after the wait for the table row (the heads-on-N softmax warpgroup has no prologue that
  waits for it)."""
  plgpu.barrier_wait(r.idx_bar)
  return _key_tiles(num_slots, r, layout)


def _loader(cfg, num_slots: int, interpret: bool, tab_row, r: common.SparseRefs, regs: int, tile_q=None,
            layout: common.TileLayout = common.FP8_TILES):
  """The loader warpgroup (``regs`` registers): over a bf16 cache (``tile_q`` given) first the query tile's Q
  chunks by TMA (``q_bar``), then the table row, then per tile its rows (``common.gather_tiles`` with runs: on
  hardware 16-byte ``cp.async`` by the warpgroup's threads, rows past the limit zero-filled)."""
  plgpu.set_max_registers(regs, action="decrease")
  if tile_q is not None:
    heads_m.load_q_tile(tile_q, r, layout)
  plgpu.copy_gmem_to_smem(r.idx_gmem.at[tab_row], r.idx_smem, r.idx_bar)
  plgpu.barrier_wait(r.idx_bar)
  rel = _header(r, REL)
  common.gather_tiles(r.kv_gmem, r.k_sw, None, r.k_full, r.k_empty, num_slots=num_slots,
                      n_tiles=_header(r, N_TILES), k_buffers=cfg.k_buffers, interpret=interpret, layout=layout,
                      runs=lambda t: (r.idx_smem[HEADER + t], rel - t * TILE))


def _body(cfg: TuningConfig, num_slots, tiles_per_token, num_splits, out_dtype, interpret, q_in, q_split, *refs):
  core = cfg.core
  if q_split:           # q as (latent [T · H, 512], rope [T · H, 64])
    refs = (refs[:2],) + refs[2:]
  if core.q_in_kernel:  # q as it is, no row-scale input
    refs = refs[:1] + (None,) + refs[1:]
  q_gmem, qs_gmem, kv_gmem, tab_gmem, scal_gmem, o_gmem, lse_gmem, q_sw, k_sw, *rest = refs
  v16, rest = (rest[0], rest[1:]) if core.v_tile(interpret) else (None, rest)
  p_sw, rest = (rest[0], rest[1:]) if core.p_slots(interpret) else (None, rest)
  tab_smem, *rest = rest
  lse_smem, rest = (None, rest) if core.seesaw else (rest[0], rest[1:])
  head_smem, q_bar, tab_bar, k_full, k_empty, p_full, *rest = rest
  p_empty = None if core.seesaw else rest[0]     # ("seesaw" stages the lse in head_smem's last row itself)
  r = common.SparseRefs(q_gmem, qs_gmem, kv_gmem, tab_gmem, scal_gmem, o_gmem, lse_gmem, q_sw, k_sw, v16, p_sw,
                        tab_smem, lse_smem, head_smem, q_bar, tab_bar, k_full, k_empty, p_full, p_empty)
  wg = lax.axis_index("wg")
  tile_q = lax.axis_index("q")
  split = lax.axis_index("split")

  @pl.when(wg == core.loader)
  def _():
    _loader(cfg, num_slots, interpret, lax.div(tile_q, tiles_per_token) * num_splits + split, r,
            LOADER_REGS if core.seesaw else heads_m.PRODUCER_REGS[0], tile_q=None if core.q_in_kernel else tile_q,
            layout=core.layout)

  if core.seesaw:       # the two consumers' code differs in which tiles they own: one copy each
    for w in range(2):
      @pl.when(wg == w)
      def _():
        heads_m._seesaw_consumer(core, num_slots, out_dtype, interpret, w, tile_q, split, r,
                                 keys=lambda: _key_tiles(num_slots, r))
    return

  @pl.when(wg == 0)
  def _():
    heads_m._producer(core, num_slots, interpret, tile_q, split, r,
                      (0,) + q_in + (interpret,) if core.q_in_kernel else None,
                      keys=lambda: _key_tiles(num_slots, r))

  n_tiles = lambda: _multiplier_tiles(r)
  if core.bf16:   # P·V from SMEM, one code path (interpret mode too)
    @pl.when((wg == 1) | (wg == 2))
    def _():
      heads_m._multiplier_bf16(core, out_dtype, tile_q, split, r, wg - 1, interpret, n_tiles=n_tiles)
    return
  q_mult = (q_in[0], interpret)
  if interpret:
    for half in range(2):
      @pl.when(wg == 1 + half)
      def _():
        heads_m._multiplier_interpret(core, out_dtype, tile_q, split, r, half=half, q_in=q_mult, n_tiles=n_tiles)
  else:
    @pl.when((wg == 1) | (wg == 2))
    def _():
      heads_m._multiplier(core, tile_q, split, r, half=wg - 1, q_in=q_mult, n_tiles=n_tiles)


@functools.lru_cache(maxsize=64)
def build(num_q_tiles: int, num_slots: int, num_splits: int, tiles_per_token: int, cfg: TuningConfig, *,
          heads: int, softmax_scale: float, interpret=False, q_split: bool = False, out_dtype_name: str = "bfloat16"):
  """The kernel for these shapes (arguments and results: module docstring): ``num_q_tiles`` = num_tokens ·
  tiles_per_token query tiles of 64 rows, each against ``num_splits`` splits of ``cfg.tiles_per_split`` tiles;
  ``heads`` (H) and ``softmax_scale`` for the in-kernel Q quantization (fp8 cache); ``q_split``: q as two inputs
  (latent, rope; fp8 cache only); ``interpret``: False, True or a ``plgpu.InterpretGPUParams``;
  ``out_dtype_name``: o's dtype (bfloat16; float32 for a bf16 cache's split partials)."""
  interp = bool(interpret)
  core = cfg.core
  if q_split and not core.q_in_kernel:
    raise ValueError("q_split needs an fp8 cache (the kernel quantizes q); a bf16 cache's kernel takes Q tiles")
  common.check_interpret_threads(interp, core.loader + 1, "the dense decode kernel")
  body = functools.partial(_body, cfg, num_slots, tiles_per_token, num_splits, jnp.dtype(out_dtype_name), interp,
                           (heads, float(softmax_scale)), bool(q_split))
  v_scratch = [plgpu.SMEM((TILE, D_V), jnp.float16, transforms=swizzled(jnp.float16, 128))] \
      if core.v_tile(interp) else []
  p_scratch = [plgpu.SMEM((heads_m.P_BUFFERS, TILE, TILE), jnp.float16, transforms=swizzled(jnp.float16, 128))] \
      if core.p_slots(interp) else []
  lay = core.layout
  return _kernel(body, (num_q_tiles, num_splits, TILE), core.loader + 1, interpret, approx_math=True,
                 out_dtype=jnp.dtype(out_dtype_name), scratch=[
      common.q_scratch(TILE, lay),                                                         # Q
      common.k_scratch(cfg.k_buffers, lay),                                                # K
      *v_scratch,                                                                          # V f16 (interpret)
      *p_scratch,                                                                          # P slots (fp8)
      plgpu.SMEM((table_width(cfg.tiles_per_split),), jnp.int32),                          # table row
      *([] if core.seesaw else [plgpu.SMEM((TILE,), jnp.float32)]),                        # lse
      plgpu.SMEM((core.head_rows, TILE), jnp.float32),                                     # alpha, 1/l, ...
      plgpu.Barrier(num_arrivals=heads_m._q_arrivals(core) if core.q_in_kernel else lay.chunks),   # q_bar
      plgpu.Barrier(),                                                                     # tab_bar
      plgpu.Barrier(num_arrivals=common.k_full_arrivals(interp, lay),
                    num_barriers=cfg.k_buffers),                                           # k_full
      plgpu.Barrier(num_arrivals=2 if core.seesaw else 3, num_barriers=cfg.k_buffers),     # k_empty
      *([plgpu.Barrier(num_barriers=2)] if core.seesaw else                                # p_full ("seesaw":
        [plgpu.Barrier(num_barriers=heads_m.P_BUFFERS + 1),                                #   per K buffer)
         plgpu.Barrier(num_arrivals=2, num_barriers=heads_m.P_BUFFERS)]),                  # p_empty
  ])


def _kernel(body, out_rows: tuple[int, int, int], warpgroups: int, interpret, *, approx_math: bool, scratch,
            out_dtype=jnp.bfloat16):
  """``plgpu.kernel`` over the grid (CTAs, splits) = ``out_rows[:2]``, returning o [*out_rows, 512] ``out_dtype``
  and lse [*out_rows] f32 (``approx_math``: the heads-on-M producer's exp2 / log2, as its sparse kernel)."""
  ctas, splits, _ = out_rows
  return plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct(out_rows + (D_V,), out_dtype), jax.ShapeDtypeStruct(out_rows, jnp.float32)),
      grid=(ctas, splits), grid_names=("q", "split"), num_threads=warpgroups, thread_name="wg",
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE, approx_math=approx_math),
      **common.interpret_kwargs(interpret),
  )


# ---- heads on N (H <= 16): sparse_sm90_heads_n's consumers over the same tables ---------------------------------


@dataclasses.dataclass(frozen=True)
class HeadsNConfig(_DenseConfig):
  """Config of the dense kernel with the heads on the MMAs' N side (H <= 16; ``sparse_sm90_heads_n``'s softmax
  and P·V warpgroups, which take this config as theirs: they read only ``k_buffers`` when the tiles come from
  the table): ``tiles_per_split`` (up to 128) and ``k_buffers`` (2-5; five fit because the table row replaces
  the sparse kernel's index tile, a candidate where the loader's tiles in flight limit, D3)."""
  K_BUFFERS: ClassVar[tuple[int, ...]] = (2, 3, 4, 5)
  k_buffers: int = 4

  def smem_budget(self) -> int:
    return common.smem_bytes(
        ((common.SW_CHUNKS, heads_n.HEADS_N, common.SW_CHUNK), common.FP8),         # Q
        ((self.k_buffers, common.SW_CHUNKS, TILE, common.SW_CHUNK), common.FP8),    # K
        ((2, TILE, heads_n.HEADS_N), jnp.float16),                                  # Pᵀ
        ((table_width(self.tiles_per_split),), jnp.int32),                          # table row
        ((heads_n.HEADS_N,), jnp.float32),                                          # lse
        ((heads_n.INV_ROW + 1, heads_n.HEAD_ROW), jnp.float32),                     # head_smem
    ) + 64 * 8 + 2048


def _body_heads_n(cfg: HeadsNConfig, num_slots, num_splits, out_dtype, interpret, q_stride, softmax_scale, q_split,
                  *refs):
  if q_split:
    refs = (refs[:2],) + refs[2:]
  q_gmem, kv_gmem, tab_gmem, scal_gmem, o_gmem, lse_gmem, q_sw, k_sw, *rest = refs
  v16, rest = (rest[0], rest[1:]) if interpret else (None, rest)
  p_sw, tab_smem, lse_smem, head_smem, tab_bar, k_full, k_empty, p_full, p_empty = rest
  r = common.SparseRefs(q_gmem, None, kv_gmem, tab_gmem, scal_gmem, o_gmem, lse_gmem, q_sw, k_sw, v16, p_sw,
                        tab_smem, lse_smem, head_smem, None, tab_bar, k_full, k_empty, p_full, p_empty)
  wg = lax.axis_index("wg")

  @pl.when(wg == heads_n.LOADER)
  def _():
    _loader(cfg, num_slots, interpret, lax.axis_index("q") * num_splits + lax.axis_index("split"), r, LOADER_REGS)

  @pl.when(wg < heads_n.LOADER)
  def _():
    plgpu.set_max_registers(CONSUMER_REGS, action="increase")

    @pl.when(wg == 0)
    def _():
      heads_n._softmax_consumer(cfg, num_slots, q_stride, softmax_scale, interpret, wg, r,
                                keys=lambda: _table_key_tiles(num_slots, r, heads_n.KEY_LAYOUT))

    @pl.when(wg == 1)
    def _():
      n_tiles = lambda: _multiplier_tiles(r)
      if interpret:
        heads_n._pv_consumer_interpret_smem_v(cfg, out_dtype, r, n_tiles)
      else:
        heads_n._pv_consumer(cfg, r, n_tiles)


@functools.lru_cache(maxsize=64)
def build_heads_n(num_tokens: int, num_slots: int, num_splits: int, out_heads: int, cfg: HeadsNConfig, *,
                  heads: int, softmax_scale: float, interpret=False, q_split: bool = False):
  """The heads-on-N kernel: one CTA per (query token, split), H = ``heads`` <= 16 heads as the N = 16 columns;
  o [num_tokens, num_splits, out_heads, 512] bf16 (``out_heads``: H rounded up to 8) and lse [num_tokens,
  num_splits, out_heads]; the other arguments as :func:`build` (q rows: ``heads`` per token, unpadded)."""
  if not (0 < heads <= out_heads <= heads_n.HEADS_N and out_heads % 8 == 0):
    raise ValueError(f"heads-on-N: need 0 < heads <= out_heads <= {heads_n.HEADS_N}, out_heads a multiple of 8; "
                     f"got heads={heads}, out_heads={out_heads}")
  interp = bool(interpret)
  body = functools.partial(_body_heads_n, cfg, num_slots, num_splits, jnp.dtype(jnp.bfloat16), interp, heads,
                           float(softmax_scale), bool(q_split))
  pt_sw = swizzled(jnp.float16, 2 * heads_n.HEADS_N)    # Pᵀ rows of 16 f16: the 32-byte swizzle
  v_scratch = [plgpu.SMEM((TILE, D_V), jnp.float16, transforms=pt_sw)] if interp else []
  return _kernel(body, (num_tokens, num_splits, out_heads), heads_n.LOADER + 1, interpret, approx_math=False,
                 scratch=[
      common.q_scratch(heads_n.HEADS_N),                                                   # Q
      common.k_scratch(cfg.k_buffers),                                                     # K
      *v_scratch,                                                                          # V f16 (interpret)
      plgpu.SMEM((2, TILE, heads_n.HEADS_N), jnp.float16, transforms=pt_sw),               # Pᵀ
      plgpu.SMEM((table_width(cfg.tiles_per_split),), jnp.int32),                          # table row
      plgpu.SMEM((heads_n.HEADS_N,), jnp.float32),                                         # lse
      plgpu.SMEM((heads_n.INV_ROW + 1, heads_n.HEAD_ROW), jnp.float32),                    # head_smem
      plgpu.Barrier(),                                                                     # tab_bar
      plgpu.Barrier(num_arrivals=common.k_full_arrivals(interp), num_barriers=cfg.k_buffers),       # k_full
      plgpu.Barrier(num_arrivals=2, num_barriers=cfg.k_buffers),                           # k_empty
      plgpu.Barrier(num_barriers=3),                                                       # p_full
      plgpu.Barrier(num_barriers=2),                                                       # p_empty
  ])
