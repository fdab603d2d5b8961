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

from mla_pallas.kernels import common, sparse_sm90_heads_m as heads_m
from mla_pallas.kernels.common import D_V, TILE, swizzled

# Table row: header entries, then one first slot per tile (module docstring).
N_FULL, N_TILES, REL = 0, 1, 2
HEADER = 4
TABLE_ALIGN = 32    # entries per 128 bytes: a warpgroup's TMA moves a multiple of 128 bytes


def table_width(tiles_per_split: int) -> int:
  """Entries of a table row: HEADER + one per tile, rounded up to TABLE_ALIGN."""
  return -(-(HEADER + tiles_per_split) // TABLE_ALIGN) * TABLE_ALIGN


@dataclasses.dataclass(frozen=True)
class TuningConfig(common.SparseSm90Config):
  """Config of the dense kernel: ``tiles_per_split`` (64-key tiles per split, up to 128: at most 160 table
  entries) and ``k_buffers`` (K tiles in flight, 2 or 3). The schedule is "producer_vt" of
  ``sparse_sm90_heads_m`` (module docstring)."""
  K_BUFFERS: ClassVar[tuple[int, ...]] = (2, 3)
  MAX_TILES: ClassVar[int] = 128
  k_buffers: int = 2

  def validate(self):
    if self.tiles_per_split > self.MAX_TILES:
      raise ValueError(f"TuningConfig.tiles_per_split must be <= {self.MAX_TILES}; got {self.tiles_per_split}")
    super().validate()

  @property
  def core(self) -> heads_m.TuningConfig:
    """The heads-on-M config whose producer and multipliers this kernel runs."""
    return heads_m.TuningConfig(tiles_per_split=self.tiles_per_split, k_buffers=self.k_buffers,
                                schedule="producer_vt")

  def smem_budget(self, interpret: bool = False) -> int:
    v_tile = (((TILE, D_V), jnp.float16),) if interpret else ()
    return common.smem_bytes(
        ((common.SW_CHUNKS, TILE, common.SW_CHUNK), common.FP8),                    # Q
        ((self.k_buffers, common.SW_CHUNKS, TILE, common.SW_CHUNK), common.FP8),    # K
        *v_tile,                                                                    # V f16 (interpret mode)
        ((heads_m.P_BUFFERS, TILE, TILE), jnp.float16),                             # P slots
        ((table_width(self.tiles_per_split),), jnp.int32),                          # table row
        ((TILE,), jnp.float32),                                                     # lse
        ((self.core.head_rows, TILE), jnp.float32),                                 # alpha, kv_scale / l, ...
    ) + 64 * 8 + 2048   # barriers; Mosaic reduction scratch


def _header(r: common.SparseRefs, entry: int):
  return r.idx_smem[entry]


def _key_tiles(num_slots: int, r: common.SparseRefs) -> heads_m.KeyTiles:
  """The producer's tiles, read from the table row (after its wait on ``tab_bar``): [0, n_full) unmasked,
  [n_full, n_tiles) with key k of tile t counting where k < rel − 64 t and the tile's page is in the cache."""
  n_full, n_tiles, rel = (_header(r, e) for e in (N_FULL, N_TILES, REL))

  def mask(t):
    first = r.idx_smem[HEADER + t]
    count = jnp.where(first < num_slots, rel - t * TILE, 0)
    keys = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (TILE,), 0), heads_m.COL_LAYOUT)
    return keys < count
  return heads_m.KeyTiles(n_tiles, ((0, n_full, None), (n_full, n_tiles, mask)))


def _multiplier_tiles(r: common.SparseRefs):
  """A multiplier's tile count: n_tiles from the table row, once it has landed."""
  plgpu.barrier_wait(r.idx_bar)
  return _header(r, N_TILES)


def _loader(cfg: TuningConfig, num_slots: int, interpret: bool, tab_row, r: common.SparseRefs):
  """WG3: the table row, then per tile its rows (``common.gather_tiles`` with runs: on hardware 16-byte
  ``cp.async`` by the warpgroup's threads, rows past the limit zero-filled)."""
  plgpu.set_max_registers(heads_m.PRODUCER_REGS[0], action="decrease")
  plgpu.copy_gmem_to_smem(r.idx_gmem.at[tab_row], r.idx_smem, r.idx_bar)
  plgpu.barrier_wait(r.idx_bar)
  rel = _header(r, REL)
  common.gather_tiles(r.kv_gmem, r.k_sw, None, r.k_full, r.k_empty, num_slots=num_slots,
                      n_tiles=_header(r, N_TILES), k_buffers=cfg.k_buffers, interpret=interpret,
                      runs=lambda t: (r.idx_smem[HEADER + t], rel - t * TILE))


def _body(cfg: TuningConfig, num_slots, tiles_per_token, num_splits, out_dtype, interpret, q_in, q_split, *refs):
  if q_split:           # q as (latent [T · H, 512], rope [T · H, 64])
    refs = (refs[:2],) + refs[2:]
  q_gmem, kv_gmem, tab_gmem, scal_gmem, o_gmem, lse_gmem, q_sw, k_sw, *rest = refs
  v16, rest = (rest[0], rest[1:]) if interpret else (None, rest)
  p_sw, tab_smem, lse_smem, head_smem, q_bar, tab_bar, k_full, k_empty, p_full, p_empty = rest
  r = common.SparseRefs(q_gmem, None, kv_gmem, tab_gmem, scal_gmem, o_gmem, lse_gmem, q_sw, k_sw, v16, p_sw,
                        tab_smem, lse_smem, head_smem, q_bar, tab_bar, k_full, k_empty, p_full, p_empty)
  core = cfg.core
  wg = lax.axis_index("wg")
  tile_q = lax.axis_index("q")
  split = lax.axis_index("split")

  @pl.when(wg == core.loader)
  def _():
    _loader(cfg, num_slots, interpret, lax.div(tile_q, tiles_per_token) * num_splits + split, r)

  @pl.when(wg == 0)
  def _():
    heads_m._producer(core, num_slots, interpret, tile_q, split, r, (0,) + q_in + (interpret,),
                      keys=lambda: _key_tiles(num_slots, r))

  q_mult = (q_in[0], interpret)
  n_tiles = lambda: _multiplier_tiles(r)
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
          heads: int, softmax_scale: float, interpret=False, q_split: bool = False):
  """The kernel for these shapes (arguments and results: module docstring): ``num_q_tiles`` = num_tokens ·
  tiles_per_token query tiles of 64 rows, each against ``num_splits`` splits of ``cfg.tiles_per_split`` tiles;
  ``heads`` (H) and ``softmax_scale`` for the in-kernel Q quantization; ``q_split``: q as two inputs (latent,
  rope); ``interpret``: False, True or a ``plgpu.InterpretGPUParams``."""
  interp = bool(interpret)
  core = cfg.core
  common.check_interpret_threads(interp, core.loader + 1, "the dense decode kernel")
  body = functools.partial(_body, cfg, num_slots, tiles_per_token, num_splits, jnp.dtype(jnp.bfloat16), interp,
                           (heads, float(softmax_scale)), bool(q_split))
  v_scratch = [plgpu.SMEM((TILE, D_V), jnp.float16, transforms=swizzled(jnp.float16, 128))] if interp else []
  lay = common.FP8_TILES
  return plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((num_q_tiles, num_splits, TILE, D_V), jnp.bfloat16),
                jax.ShapeDtypeStruct((num_q_tiles, num_splits, TILE), jnp.float32)),
      grid=(num_q_tiles, num_splits), grid_names=("q", "split"),
      num_threads=core.loader + 1, thread_name="wg",
      scratch_types=[
          common.q_scratch(TILE, lay),                                                     # Q
          common.k_scratch(cfg.k_buffers, lay),                                            # K
          *v_scratch,                                                                      # V f16 (interpret)
          plgpu.SMEM((heads_m.P_BUFFERS, TILE, TILE), jnp.float16,
                     transforms=swizzled(jnp.float16, 128)),                               # P slots
          plgpu.SMEM((table_width(cfg.tiles_per_split),), jnp.int32),                      # table row
          plgpu.SMEM((TILE,), jnp.float32),                                                # lse
          plgpu.SMEM((core.head_rows, TILE), jnp.float32),                                 # alpha, 1/l, ...
          plgpu.Barrier(num_arrivals=2),                                                   # q_bar
          plgpu.Barrier(),                                                                 # tab_bar
          plgpu.Barrier(num_arrivals=common.k_full_arrivals(interp, lay),
                        num_barriers=cfg.k_buffers),                                       # k_full
          plgpu.Barrier(num_arrivals=3, num_barriers=cfg.k_buffers),                       # k_empty
          plgpu.Barrier(num_barriers=heads_m.P_BUFFERS + 1),                               # p_full
          plgpu.Barrier(num_arrivals=2, num_barriers=heads_m.P_BUFFERS),                   # p_empty
      ],
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE, approx_math=True),
      **common.interpret_kwargs(interpret),
  )
