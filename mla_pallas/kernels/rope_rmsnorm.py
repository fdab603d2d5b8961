"""RoPE + RMS norm of new MLA tokens, with an optional fused FP8 quantization and paged-cache write (sm_90a).

Version v3 (validated on an H200, 2026-11-30: tests/test_rope_rmsnorm_kernel_gpu.py passes; measured at the end).
The "tiled" kernel: since 2026-11-30 (tenth session) the op's default on the GPU is :mod:`.rope_direct` (GMEM ->
registers -> GMEM, faster at every measured shape); this kernel runs in interpret mode (the direct kernel is raw
Mosaic GPU), where T · H · 8 >= 2^31, and on request (``tuning`` ("kernel", "tiled")).

What the CTAs compute
---------------------
The grid is 1-D (``TuningConfig.ctas`` CTAs). The tokens are split into that many contiguous ranges of whole q tiles,
as equal as possible (:func:`_token_range`), of at most ``TPC`` = ``tokens_per_cta`` tokens (which sizes the SMEM);
CTA ``c`` owns the tokens ``t0 .. t0 + n_valid`` and everything they produce, so no two CTAs write the same bytes.
A CTA has ``NW`` warpgroups (``TuningConfig.warpgroups``, default 4):

    latent  y = x · rsqrt(sum(x²)/512 + eps) · w          x = kv[t, :512] (bf16 → f32), RMS over 512, f32 math
    k_rope  y = x · C + swap(x) · S                         x = kv[t, 512:]
    q_rope  y = x · C + swap(x) · S                         every head of q_rope[t]

    fused:   fp8(clip(y · f32(1/kv_scale), ±448)) → pages[slot[t]]: two TMA stores per row (512 B of latent from a
             [TPC, 8, 64] fp8 buffer, 64 B of k_rope from a [64, 128] fp8 buffer), issued by the 4 warps in turn
    unfused: kv_out[t] = bf16(y): one TMA store per latent group and one for the k_rope rows
    both:    q_out[t]  = bf16(q_rope)

* q: the CTA's q tiles (64-row tiles of the flat ``[T · H, 64]`` view of q_rope; H % 64 == 0: H / 64 tiles per
  token; H | 64: a tile holds the heads of 64 / H tokens) are split into contiguous ranges, one per warpgroup, in
  proportion to the weights ``kv_share`` (warpgroup 0) and 4 (the others; :func:`_q_range`). Each warpgroup runs
  its range through its own ring of ``stages`` swizzled SMEM tiles: TMA in, one wgmma for swap(x), the result
  written back into the same slot (in place) and stored from there by TMA; the slot is refilled one step later,
  once its store has read it (``wait_smem_to_gmem(1, read_only)``).
* latent: the CTA's rows are processed in groups of 8 (4 when TPC is not a multiple of 8), group j by warpgroup
  j % NW, in a register layout with one warp per row (``LAT_LAYOUT``: lanes over 4 chunks × 8 column groups,
  vectors of 8): the RMS sum is a reduction inside one warp, so groups of 4 rows work (the WGMMA layout would
  need 64 rows per group).
* k_rope: warpgroup 0 rotates the CTA's k_rope rows as one 64-row tile (rows past TPC are computed, never stored).
  The tile (and the tables with it) starts at the 8-aligned token a0 = t0 − t0 % 8, not at t0: a TMA into a tiled
  (swizzled) SMEM ref tiles the GMEM side too, so a box that starts inside an 8-row tile reads its rows past that
  tile as zeros (H200, 2026-11-30: k_rope columns of every CTA with t0 % 8 != 0 wrong, rows j % 8 >= 8 − t0 % 8;
  interpret mode and lowering cannot see it). The CTA's row j is tile / table row j + t0 % 8; when that passes 64
  (tokens_per_cta > 56), a second pass rotates the tile one 8-row tile lower for the last rows.
* Warpgroup 0 issues the CTA's shared loads (P, the tables with the slots, the latent rows, the norm weight, the
  k_rope rows).

Why (v2c's measured limits, benchmarks/RESULTS.md): v2c ran one warpgroup per SM (one ~207 KB CTA per SM), and a
q tile's chain (TMA wait → load → wgmma → store → fence → TMA) took ~1 µs: 8192 tiles / 132 SMs at T = 4096,
H = 128 make 62 µs, as measured (59 µs). v3 overlaps four such chains per SM (4 warpgroups, 12 ring slots, up to
96 KB of q loads in flight per SM). v2c's CTA 0 of each 64-token block also ran the latent of all 64 tokens as one
serial chain (9 loads, RMS, 64 row stores issued by one thread) while its other CTAs did q tiles: that chain was
the whole time at T = 128 and dominated at H = 16. In v3 a CTA's kv rows are its own tokens only, spread over its
warpgroups. Default grid (:func:`default_config`): one CTA per SM, ``ctas = min(SMs, T)``, each with
ceil(T / SMs) tokens or one fewer (1 at T = 128: 128 CTAs; 31-32 at T = 4096, H = 16 and 60-64 at T = 8192, H = 16:
132 CTAs), stages = 2 where 64 tokens per CTA need the SMEM; beyond ~8400 tokens, waves of 64-token CTAs. Two
measured exceptions: CTAs of at most 8 tokens run 2 warpgroups (faster at small T), and at H >= 128, T >= 4096 the
q rings are 4 deep with the 15-16 tokens per CTA that then fit (several waves; 76-80 % of copy BW instead of 71-75 %).

RoPE as a permutation: ``swap`` exchanges the two members of every rotation pair (DeepSeek interleaved pairs
(2i, 2i+1), or NeoX halves (i, i+32)); C and S are the per-token tables arranged per column, S carrying the sign
(interleaved: C = [c0 c0 c1 c1 ..], S = [−s0 s0 −s1 s1 ..]; NeoX: C = [c ‖ c], S = [−s ‖ s]). Then
``y = x·C + swap(x)·S`` performs exactly the reference's float32 operations ``(a cos − b sin, a sin + b cos)``
(negation is exact and f32 addition commutes), so it is bitwise equal wherever neither side contracts a product
and a sum into an FMA (XLA:CPU does in the jitted reference; interpret mode does not). The pair swap is done by
the tensor cores: one bf16 wgmma ``x @ P`` with the 0/1 permutation matrix P (64 × 64) gives swap(x) exactly (one
product by 1, the rest exact zeros, f32 accumulator). Alternatives that do not work in JAX 0.11.2: register
layouts have no intra-thread shuffle; strided SMEM slices (``pl.ds(0, 32, stride=2)``) do not lower ("Strided
slices not implemented"); a [.., 32, 2] view needs a GMEM stride of 4 bytes (TMA needs 16); SMEM ref bitcasts
lower only from i8, and XLA copies width-changing bitcasts. Caveat: a NaN/inf in one rope value poisons its whole
64-wide row (NaN·0 in the permutation product) where the reference poisons only its pair.

Tables at T <= GATHER_TABLES_MAX_TOKENS (the op's default outside interpret mode, ``TuningConfig.gather_tables``):
the kernel builds the C ‖ S rows itself from the positions and the cos / sin tables, and with the cache write
also keeps only the last writer of each slot (:mod:`mla_pallas.kernels.rope_tables`); the fused op is then this
kernel alone. The gather (two dependent global loads) runs on the last warpgroup while warpgroup 0 waits for the
slots (and runs the duplicate check) and the latent rows are normalised; k_rope and the q tiles wait for the tables
(``overlap_gather``; H200 2026-11-30i: 0.2-0.7 us faster than gathering on warpgroup 0 before anything else, e.g.
fused T = 8, H = 128 4.3 -> 4.0 us, T = 256 7.0 -> 6.3). The in-kernel table rows are 136 words apart
(``TAB_COLS_GATHER``), not 128: the k_rope tile reads its tables in the WGMMA layout, and with 512-byte rows a
warp's 8 rows hit the same banks (8-way conflicts; H200 2026-11-30i: the padding took fused T = 1-256 down by
0.3-0.5 us, e.g. T = 8, H = 128 3.9 -> 3.6 us). Otherwise:

Inputs are prepared by :mod:`mla_pallas.ops.rope_rmsnorm`: one fused XLA gather + concatenate of the tables per
token (positions clamped), C ‖ S as the int32 bits of their f32 values, ``[T, 128]``; the fused op appends the
sanitised slot of each token (−1 for skipped tokens and for every token but the last of a duplicated slot, so no
two CTAs write the same slot) as column 128 of ``[T, 132]``, which saves the pre-pass a kernel (int32, because
warp-level code, which issues the row stores, cannot bitcast). TMA boxes that run past the end of an array read
zeros and stores past it are dropped, so kv, q_rope and the outputs are plain reshapes ([T, 9, 64], [T · H, 64]),
except that a TMA into a swizzled tile needs a GMEM row count below 8 or a multiple of 8: kv is zero padded for
T > 8 not a multiple of 8, q_rope only for H < 8 (:func:`kv_rows_for`, :func:`q_rows_for`). The norm weight is
passed in its own dtype, ``eps`` and ``kv_scale`` as 1-element arrays (1/kv_scale is an f32 division in the
kernel, as in :func:`mla_pallas.quant.quantize_fp8`). The cache update is in place: the op passes ``pages`` as a
mutable ref (``jax.new_ref``), which ``plgpu.kernel`` turns into an input/output alias of the custom call, and
donates it.

Summation order: the RMS sum is a per-warp tree (vectors, then lanes); XLA's order differs, so ``rsqrt`` may
differ by an f32 ulp and, rarely, a quantized value lands one e4m3 step (or a bf16 output one ulp) away from the
reference. On the GPU the compiler may also contract ``x·C + swap·S`` into an FMA.

Lowering semantics: Lane. The first version used Warpgroup semantics and failed on the H200 (2026-11-30): fp8 rows
stored into strided SMEM views were misplaced by JAX 0.11.2's Warpgroup lowering (../shared/mgpu/README.md
section 6); interpret mode and CPU lowering cannot see it. Lane handles strided views correctly. Register layouts
are explicit (``Layout.WGMMA`` tiles, ``WGMMA.reduce(0)`` column vectors, ``LAT_LAYOUT``); the unswizzled f32
tables and the latent rows are loaded with ``optimized=False``.

Interpret mode runs each warpgroup on its own thread and parks a thread of XLA:CPU's callback pool in every
barrier wait: on a 2-core host, 3 or 4 warpgroups waiting on warpgroup 0's copies can starve the pool (a hang, not
a protocol deadlock; tests/test_sparse_decode_sm100.py saw the same). The op's default config therefore takes
2 warpgroups in interpret mode; the tests run 3 and 4 in a subprocess with 4 host devices.

SMEM budget (bytes; NW = 4, stages = 3, TPC = 32; :func:`smem_budget`, checked against lowering)
------------------------------------------------------------------------------------------------
    P (64 × 64 bf16, swizzled)                       8 192
    tables C ‖ S (‖ slot) (64 × 132 int32)          33 792   (unfused: 64 × 128; gather_tables: 64 × 136;
                                                              72 rows when TPC > 56)
    q rings (NW · stages × 64 × 64 bf16, swizzled)  98 304   (in place: no separate output ring)
    k_rope tile (64 × 64 bf16, swizzled)             8 192
    k_rope out (64 × 128 fp8 | 64 × 64 bf16)         8 192
    latent rows (TPC × 8 × 64 bf16)                 32 768   (unfused: also the kv_out staging)
    fp8 latent rows (TPC × 8 × 64, fused only)      16 384
    norm weight, barriers, reserved                  ~4 000
    lowered: 210 040 fused, 192 632 unfused (limit 232 448); T = 8192, H = 16 (TPC = 64, stages = 2): 231 512

Measured (H200, CUPTI, same-run XLA path and device copy of the same bytes; benchmarks/RESULTS.md, 2026-11-30),
with the default configs: fused T = 4096, H = 128 45.1 µs = 76 % of copy BW (2.12× XLA), of which 5.4 µs are the
XLA pre-pass; T = 8192, H = 128 80 % (2.15×); unfused T = 4096 81 % (2.05×); T = 8192, H = 16 40 % (1.41×; kernel
23.4 µs + pre-pass 6.6 µs); T = 512 1.79×, T = 128 1.33× (H = 128) / 1.02× (H = 16); T = 1-64 0.84-1.00× (the
kernel alone takes 3.2-3.5 µs, the pre-pass 0.9-2.3 µs). v2c (the previous version) reached 50 % / 57 % at
T = 4096 and was slower than XLA at T = 128 and at H = 16.
"""
from __future__ import annotations

import dataclasses
import functools
import types

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic.gpu import fragmented_array as mgpu_fa
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common, rope_tables
from mla_pallas.kernels.common import CHUNK, FP8, N_CHUNKS, swizzled
from mla_pallas.quant import FP8_MAX

TILE = 64           # rows of a q / k_rope tile (the wgmma M)
TB = TILE           # (v2 name)
D_ROPE = 64
LAT_CHUNKS = N_CHUNKS - 1     # 8 chunks of 64 latent values
MAX_TPC = 64        # tokens per CTA: the k_rope rows of a CTA form one 64-row tile
TAB_COLS_FUSED = 2 * 64 + 4   # fused: C | S (f32 bits) | the token's sanitised slot | 3 unused (16-byte rows)
DEFAULT_SMS = 132   # H100 SXM / H200
BF16 = jnp.bfloat16
# Explicit register layouts: with inference alone, lowering (layout inference) did not finish in 10 minutes.
TILE_LAYOUT = plgpu.Layout.WGMMA            # every [64, 64] register tile
COL_LAYOUT = plgpu.Layout.WGMMA.reduce(0)   # a [64] vector broadcast along rows (per-column values)


def _lat_layout():
  """[4k, 8, 64] latent rows: warp w holds rows 4j + w; its 32 lanes hold 4 chunks × 8 column groups; vectors of 8
  (16 bytes of bf16); the two halves of a row (chunks 0-3, 4-7) are two registers. Per-row sums stay in a warp."""
  lay = mgpu_fa.TiledLayout(mgpu_fa.Tiling(((4, LAT_CHUNKS, CHUNK), (1, 4, CHUNK), (8,))), warp_dims=(-7,),
                            lane_dims=(-3, -2), vector_dim=-1, _check_canonical=False).canonicalize()
  return plgpu.Layout.TILED(lay.tiling, warp_dims=lay.warp_dims, lane_dims=lay.lane_dims,
                            vector_dim=lay.vector_dim)


LAT_LAYOUT = _lat_layout()
LAT_W_LAYOUT = LAT_LAYOUT.reduce(0)         # the [8, 64] norm weight, broadcast along rows


def _tile(ref, optimized=True):
  return plgpu.load(ref, layout=TILE_LAYOUT, optimized=optimized)


def _cols(ref, optimized=True):
  return plgpu.load(ref, layout=COL_LAYOUT, optimized=optimized)


def _f32(x):
  """The tables are stored as int32 bits (so that the slot column needs no bitcast in warp code)."""
  return lax.bitcast_convert_type(x, jnp.float32)


@dataclasses.dataclass(frozen=True)
class TuningConfig(common.TuningConfigBase):
  """Tuning knobs of the rope/rmsnorm kernel.

  stages: depth of each warpgroup's q-tile ring (64 × 64 bf16 tiles, in place), 2-8.
  warpgroups: warpgroups per CTA (1-4); warpgroup 0 also issues the shared loads and does the k_rope tile.
  tokens_per_cta: the most tokens one CTA takes (1-64; sizes its SMEM).
  ctas: the grid. The tokens are split into ``ctas`` contiguous ranges of whole q tiles, as equal as possible.
    Both None: :func:`grid_for` (one CTA per SM while at most 64 tokens each fit, else CTAs of the largest TPC
    that fits); one None: derived from the other.
  kv_share: warpgroup 0's share of the CTA's q tiles in quarters of another warpgroup's (1-4): warpgroup 0 also
    does the k_rope tile and its row stores.
  gather_tables: the kernel builds its C ‖ S table rows itself from ``positions`` and the [max_pos, 32] cos / sin
    tables (:mod:`mla_pallas.kernels.rope_tables`: one warpgroup loads the positions, gathers and expands the
    rows), and with the cache write takes the slots as a separate [T] int32 array, instead of the op's XLA
    pre-pass [T, 128 (+4)] table array. Not in interpret mode (no ``inline_mgpu``; the op keeps the pre-pass
    there). The op's default at T <= GATHER_TABLES_MAX_TOKENS (below).
  overlap_gather: with gather_tables, the last warpgroup gathers the tables while warpgroup 0 checks the slots and
    the latent rows (which need no tables) are normalised; k_rope and the q tiles wait for the tables. False:
    warpgroup 0 gathers the tables and checks the slots before any warpgroup starts (the first version).
  """
  stages: int = 3
  warpgroups: int = 4
  tokens_per_cta: int | None = None
  ctas: int | None = None
  kv_share: int = 3
  gather_tables: bool = False
  overlap_gather: bool = True

  def validate(self):
    if not 2 <= self.stages <= 8:
      raise ValueError(f"TuningConfig.stages must be in [2, 8]; got {self.stages}")
    if not 1 <= self.warpgroups <= 4:
      raise ValueError(f"TuningConfig.warpgroups must be in [1, 4]; got {self.warpgroups}")
    if self.kv_share > 4:
      raise ValueError(f"TuningConfig.kv_share must be in [1, 4]; got {self.kv_share}")
    for name, hi in (("tokens_per_cta", MAX_TPC), ("ctas", 2 ** 31 - 1)):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi):
        raise ValueError(f"TuningConfig.{name} must be None or an int in [1, {hi}]; got {v!r}")
    # The unfused kernel needs less SMEM; build() checks the kernel it builds. None: chosen (and checked) per shape.
    tpc = self.tokens_per_cta or 4
    self.check_smem(smem_budget(self, False, tpc), f" (tokens_per_cta={tpc})")


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


TAB_COLS_GATHER = 2 * 64 + 8   # gather_tables: C | S and 8 unused words, so that rows are 544 bytes apart


def _tab_cols(fused: bool, gather: bool = False) -> int:
  """Columns of the SMEM tables: C ‖ S, and with the cache write the slot column (unless the slots come as their
  own array, ``gather_tables``). The in-kernel tables pad each row by 8 words: the k_rope tile reads its tables in
  the WGMMA layout (a warp's request covers 8 rows x 8 words), and with 512-byte rows all 8 rows fall in the same
  banks (8-way conflicts); 544-byte rows spread them over all 32 banks (2 wavefronts)."""
  if gather:
    return TAB_COLS_GATHER
  return TAB_COLS_FUSED if fused else 2 * D_ROPE


def _lat_rows(tpc: int) -> int:
  return _round_up(tpc, 4)


def _kr_span(tpc: int) -> int:
  """Rows of the CTA's 8-aligned k_rope / table window: tokens a0 .. a0 + span with a0 = t0 - t0 % 8 (a CTA's first
  token t0 need not be a multiple of 8, so its rows are tile rows d .. d + n_valid, d = t0 % 8 <= 7). At most
  TILE + 8: the tile rows past 64 (only when d + n_valid > 64) take a second k_rope pass one 8-row tile lower."""
  return min(_round_up(tpc + 7, 8), TILE + 8)


def _tab_rows(tpc: int) -> int:
  """Rows of the SMEM tables: the k_rope window, and at least the 64 rows the k_rope tile reads."""
  return max(_kr_span(tpc), TILE)


def _idx_len(tpc: int) -> int:
  """Entries of the SMEM slots of the table window (gather_tables, fused): the window's rows rounded up to 32
  (a Lane-semantics TMA moves a multiple of 128 bytes)."""
  return _round_up(_tab_rows(tpc), 32)


def _all_len(num_tokens: int) -> int:
  """Entries of every token's slot loaded for the in-kernel duplicate check: T rounded up to 32 (128 bytes)."""
  return _round_up(num_tokens, 32)


def _lat_group(tpc: int) -> int:
  """Latent rows per group (one group = one warpgroup's unit of work; group j goes to warpgroup j % NW)."""
  return 8 if _lat_rows(tpc) % 8 == 0 else 4


def smem_budget(cfg: TuningConfig, fused: bool, tokens_per_cta: int | None = None) -> int:
  """SMEM bytes of a CTA (norm weight counted as f32)."""
  tpc = tokens_per_cta or cfg.tokens_per_cta or MAX_TPC
  lat = _lat_rows(tpc)
  bufs = [((D_ROPE, D_ROPE), BF16),                                  # P
          ((_tab_rows(tpc), _tab_cols(fused, cfg.gather_tables)), jnp.int32),   # tables C | S (| slot), int32 bits
          ((cfg.warpgroups * cfg.stages, TILE, D_ROPE), BF16),       # q rings
          ((TILE, D_ROPE), BF16),                                    # k_rope tile
          ((TILE, 2 * D_ROPE), FP8) if fused else ((TILE, D_ROPE), BF16),   # k_rope out
          ((lat, LAT_CHUNKS, CHUNK), BF16),                          # latent rows
          ((LAT_CHUNKS, CHUNK), jnp.float32)]                        # norm weight
  if fused:
    bufs += [((lat, LAT_CHUNKS, CHUNK), FP8)]
  if cfg.gather_tables and fused:                                    # slots of the window; all slots (dedupe)
    bufs += [((_idx_len(tpc),), jnp.int32), ((rope_tables.DEDUPE_MAX_TOKENS,), jnp.int32)]
  return common.smem_bytes(*bufs) + 3072      # barriers, a 1 KB reserved block, alignment (checked by lowering)


def _units(num_tokens: int, heads: int) -> tuple[int, int]:
  """(g, U): tokens per q tile (1 for H >= 64) and the number of such token units (the grid splits whole units)."""
  g = max(TILE // heads, 1)
  return g, -(-num_tokens // g)


def grid_for(cfg: TuningConfig, num_tokens: int, heads: int, fused: bool,
             num_sms: int = DEFAULT_SMS) -> tuple[int, int]:
  """(tokens_per_cta, ctas) of ``cfg`` for a shape, filling in what is None.

  Both None: one CTA per SM (``min(SMs, units)`` CTAs of at most ceil(T / SMs) tokens, rounded up to whole q
  tiles) while that is at most 64 tokens and fits in SMEM; otherwise the largest such tokens_per_cta that fits
  (halving), with as many CTAs as it takes. Raises ValueError for an inconsistent or oversized config.
  """
  g, units = _units(num_tokens, heads)
  tpc, ctas = cfg.tokens_per_cta, cfg.ctas
  if tpc is None and ctas is None:
    ctas = min(num_sms, units)
    tpc = g * -(-units // ctas)
    if tpc > MAX_TPC or smem_budget(cfg, fused, tpc) > common.SMEM_LIMIT:
      tpc, ctas = min(tpc, g * (MAX_TPC // g)), None
      while tpc > g and smem_budget(cfg, fused, tpc) > common.SMEM_LIMIT:
        tpc = max(_round_up(tpc // 2, g), g)
  if ctas is None:
    ctas = -(-units // (tpc // g)) if tpc >= g else units
  if tpc is None:
    tpc = g * -(-units // ctas)
  ctas = min(ctas, units)
  if tpc % g or tpc > MAX_TPC or g * -(-units // ctas) > tpc:
    raise ValueError(f"{cfg}: tokens_per_cta must be a multiple of {g} (the tokens of one q tile for H = {heads}), "
                     f"at most {MAX_TPC}, and hold ceil(T / ctas) tokens rounded up to it (T = {num_tokens}); "
                     f"got tokens_per_cta={tpc}, ctas={ctas}")
  cfg.check_smem(smem_budget(cfg, fused, tpc), f" (fused={fused}, tokens_per_cta={tpc})")
  return tpc, ctas


# Default-config rules measured on an H200 (2026-11-30, benchmarks/RESULTS.md, rope v3 sweeps):
# * up to SMALL_TPC tokens per CTA, 2 warpgroups: faster than 4 at T = 1-128 (H = 16 and 128; e.g. T = 1: 4.2 vs
#   4.6 us, T = 128: 6.4 vs 6.9 us) and at T = 1024, H = 16 (8.2 vs 8.8 us), equal at T = 512, H = 128;
# * H >= DEEP_RING_MIN_HEADS and T >= DEEP_RING_MIN_TOKENS, stages = 4 with the tokens per CTA that fit (15-16,
#   several waves): T = 4096 44.3 vs 46.4 us, T = 8192 85.8 vs 96.0 us (78-79 % of copy BW instead of 71-75 %).
# * at most SHALLOW_RING_MAX_TILES q tiles per CTA (e.g. one token of H = 128): stages = 2, the SMEM of a third
#   ring slot that no tile would use saved (H200, 2026-11-30i, fused H = 128 T = 1 3.8 vs 4.0 us, T = 8 3.9 vs 4.0;
#   H = 16 T = 8 3.8 vs 3.8);
# * T <= GATHER_TABLES_MAX_TOKENS: gather_tables (no XLA pre-pass; with the in-kernel duplicate-slot check the
#   fused op is one kernel launch). H200 (benchmarks/RESULTS.md, 2026-11-30h, op time against the pre-pass path,
#   bitwise equal): fused H = 128 T = 1 4.2 vs 4.2 us, T = 8 4.3 vs 4.6, T = 64 4.9 vs 5.7, T = 128 5.4 vs 6.4,
#   T = 256 7.1 vs 8.2; H = 16 T = 128 4.8 vs 6.0; unfused H = 128 T = 8 4.4 vs 4.9. Slower at T = 512 (11.5 vs
#   10.2, the positions-TMA version) and T = 4096 (48.6 vs 45.2): every CTA's q and k_rope work waits for the
#   in-kernel gather, where the pre-pass's table arrives by TMA.
SMALL_TPC = 8
SHALLOW_RING_MAX_TILES = 2
GATHER_TABLES_MAX_TOKENS = 256
DEEP_RING_MIN_HEADS = 128
DEEP_RING_MIN_TOKENS = 4096


def default_config(num_tokens: int, heads: int, fused: bool, num_sms: int = DEFAULT_SMS) -> TuningConfig:
  """The default config for a shape. Large q-bound shapes (H >= DEEP_RING_MIN_HEADS, T >= DEEP_RING_MIN_TOKENS):
  stages = 4 with the tokens per CTA that fit in SMEM (several waves). Otherwise one CTA per SM
  (ctas = min(SMs, token units)) with stages = 3, or with stages = 2 where only that fits one wave (e.g.
  T = 8192, H = 16: 60-64 tokens per CTA); beyond one wave (T > ~8400) stages = 2 and 64 tokens per CTA; and
  2 warpgroups instead of 4 when a CTA has at most SMALL_TPC tokens."""
  g, units = _units(num_tokens, heads)
  if heads >= DEEP_RING_MIN_HEADS and num_tokens >= DEEP_RING_MIN_TOKENS:
    cfg = TuningConfig(stages=4)
    tpc, ctas = grid_for(cfg, num_tokens, heads, fused, num_sms)
    return dataclasses.replace(cfg, tokens_per_cta=tpc, ctas=ctas)
  ctas = min(num_sms, units)
  want = g * -(-units // ctas)
  if want > MAX_TPC:
    ctas, want = None, g * (MAX_TPC // g)
  wgs = 2 if want <= SMALL_TPC else TuningConfig.warpgroups
  # at most SHALLOW_RING_MAX_TILES q tiles per CTA: the prologue issues them all with a 2-deep ring already, and
  # a third slot would only cost SMEM (measured: 0.1-0.2 us at T = 1 / 8, H = 128)
  shallow = -(-want * heads // TILE) <= SHALLOW_RING_MAX_TILES
  for stages in ((2,) if shallow else (3, 2)):
    cfg = TuningConfig(stages=stages, warpgroups=wgs)
    if smem_budget(cfg, fused, want) <= common.SMEM_LIMIT:
      tpc, ctas = grid_for(dataclasses.replace(cfg, tokens_per_cta=want, ctas=ctas), num_tokens, heads, fused,
                           num_sms)
      return dataclasses.replace(cfg, tokens_per_cta=tpc, ctas=ctas)
  cfg = TuningConfig(warpgroups=wgs)
  tpc, ctas = grid_for(cfg, num_tokens, heads, fused, num_sms)
  return dataclasses.replace(cfg, tokens_per_cta=tpc, ctas=ctas)


def default_tokens_per_cta(num_tokens: int, heads: int, fused: bool = True, num_sms: int = DEFAULT_SMS,
                           cfg: TuningConfig | None = None) -> int:
  """The tokens_per_cta :func:`grid_for` picks for ``cfg`` (default: TuningConfig()) when it has none."""
  cfg = cfg or TuningConfig()
  return grid_for(dataclasses.replace(cfg, tokens_per_cta=None, ctas=None), num_tokens, heads, fused, num_sms)[0]


def _swap(x_sw, p_sw):
  """swap(x) = x @ P, exact in f32 (P a 0/1 permutation): one 64 × 64 × 64 bf16 wgmma."""
  def mma(acc):
    plgpu.wgmma(acc, x_sw, p_sw)
    return acc[...]
  return pl.run_scoped(mma, plgpu.ACC((TILE, D_ROPE), jnp.float32))


def _unpack(fused: bool, gather: bool, dedupe: bool, refs, overlap: bool = False) -> types.SimpleNamespace:
  """Name the kernel's refs: inputs, outputs, scratch (see :func:`build`)."""
  tables = (("pos", "cos", "sin") + (("slots",) if fused else ())) if gather else ("cs",)
  gmem = (("kv", "q") + tables + (("w", "p", "eps", "ks", "pages", "qo") if fused else
                                  ("w", "p", "eps", "qo", "kvo")))
  scratch = ("p_sw", "tab", "q_sw", "kr_sw", "kr_out", "lat", "w_smem") + (("rows",) if fused else ())
  if gather:
    scratch += (("slot_smem",) if fused else ()) + (("all_smem",) if dedupe else ())
  names = gmem + scratch + ("sh_bar", "kv_bar", "kr_bar", "q_full") + (
      (("idx_bar",) if fused else ()) + ("tab_bar",) if gather else ()) + (
      ("slot_bar",) if overlap and fused else ())
  return types.SimpleNamespace(**dict(zip(names, refs, strict=True)))


def _q_range(wg, nw: int, kv_share: int, n_tiles):
  """[start, end) of the CTA's q tiles for warpgroup ``wg``: contiguous ranges in proportion to the weights
  kv_share (warpgroup 0, which also does the k_rope tile) and 4 (every other warpgroup)."""
  if nw == 1:
    return 0, n_tiles
  total = kv_share + 4 * (nw - 1)

  def cum(w):   # weight of the warpgroups before w
    return jnp.where(w == 0, 0, kv_share + 4 * (w - 1))
  return n_tiles * cum(wg) // total, n_tiles * cum(wg + 1) // total


def _token_range(c, num_tokens: int, heads: int, ctas: int):
  """(t0, n_valid) of CTA c: the token units (whole q tiles) split into ``ctas`` contiguous ranges, the first
  U % ctas of them one unit longer (int32-safe: no c * U product)."""
  g, units = _units(num_tokens, heads)
  q, rem = divmod(units, ctas)
  u0 = c * q + jnp.minimum(c, rem)
  n_units = q + (c < rem).astype(jnp.int32)
  t0 = u0 * g
  return t0, jnp.minimum(n_units * g, num_tokens - t0)


def _body(fused: bool, num_tokens: int, heads: int, num_slots: int, cfg: TuningConfig, interleaved: bool,
          dedupe: bool, *refs):
  gather = cfg.gather_tables
  r = _unpack(fused, gather, dedupe, refs, gather and cfg.overlap_gather)
  nw, stages, tpc = cfg.warpgroups, cfg.stages, cfg.tokens_per_cta
  wg = lax.axis_index("wg") if nw > 1 else 0
  t0, n_valid = _token_range(lax.axis_index("c"), num_tokens, heads, cfg.ctas)
  n_tiles = (n_valid * heads + TILE - 1) // TILE       # q tiles of this CTA (the last one may be partial)
  q_start, q_end = _q_range(wg, nw, cfg.kv_share, n_tiles)
  n_steps = q_end - q_start
  # The k_rope rows go by TMA into a swizzled tile, whose (8, 64) tiling Mosaic also applies to the GMEM side: a
  # box start t0 becomes (tile t0 // 8, row t0 % 8) and rows past the 8 of that tile read as zeros (the H200 failure
  # of 2026-11-30; interpret mode does not model tiling). So the k_rope rows, and the tables with them, are loaded
  # from the 8-aligned a0 = t0 - d, and the CTA's row j is tile / table row j + d.
  d = lax.rem(t0, 8)
  a0 = t0 - d
  span = _kr_span(tpc)                                 # table rows loaded from a0 (8 | span)

  def on_wg(w):   # decorator: run on warpgroup w only
    return (lambda f: f()) if nw == 1 else pl.when(wg == w)

  def q_row(k):   # first row of this warpgroup's k-th q tile in the flat [T * H, 64] view
    return t0 * heads + (q_start + k) * TILE

  def ring(slot):
    return wg * stages + slot

  def issue_q(k, slot):
    plgpu.copy_gmem_to_smem(r.q.at[pl.ds(q_row(k), TILE)], r.q_sw.at[ring(slot)], r.q_full.at[ring(slot)])

  @on_wg(0)
  def _():
    plgpu.copy_gmem_to_smem(r.p, r.p_sw, r.sh_bar)
    if gather:   # the window's slots (warpgroup 0 builds the tables from the positions in GMEM below)
      idx = _idx_len(tpc)   # Lane semantics copies whole 128-byte multiples; entries past T read as zeros
      if fused:
        plgpu.copy_gmem_to_smem(r.slots.at[pl.ds(a0, idx)], r.slot_smem, r.idx_bar)
      if dedupe:   # every token's slot (raw): the duplicate check runs below
        plgpu.copy_gmem_to_smem(r.slots.at[pl.ds(0, _all_len(num_tokens))],
                                r.all_smem.at[pl.ds(0, _all_len(num_tokens))], r.idx_bar)
    else:
      plgpu.copy_gmem_to_smem(r.cs.at[pl.ds(a0, span)], r.tab.at[pl.ds(0, span)], r.sh_bar)
    plgpu.copy_gmem_to_smem(r.kv.at[pl.ds(t0, _lat_rows(tpc)), pl.ds(0, LAT_CHUNKS)], r.lat, r.kv_bar)
    plgpu.copy_gmem_to_smem(r.w, r.w_smem, r.kv_bar)
    kr = min(span, TILE)
    plgpu.copy_gmem_to_smem(r.kv.at[pl.ds(a0, kr), LAT_CHUNKS], r.kr_sw.at[pl.ds(0, kr)], r.kr_bar)

  for s in range(stages):      # prologue: fill this warpgroup's q ring
    @pl.when(s < n_steps)
    def _():
      issue_q(s, s)

  overlap = gather and cfg.overlap_gather
  if overlap:
    # The table gather (two dependent global loads) on the last warpgroup, the slots (and the duplicate check) on
    # warpgroup 0: the latent rows wait only for their rows and slots, k_rope and q for the tables.
    @on_wg(nw - 1)
    def _():   # rows past T take token T - 1's position: valid reads, never used
      rope_tables.gather_tables(r.pos, a0, r.cos, r.sin, r.tab, interleaved)
      plgpu.commit_smem()            # warpgroup barrier: every thread's table stores are done
      plgpu.barrier_arrive(r.tab_bar)
    if fused:
      @on_wg(0)
      def _():
        plgpu.barrier_wait(r.idx_bar)   # the window's slots (and all slots), read by the stores / the dedupe
        if dedupe:   # -1 for every window row that a later token overwrites (the last writer of a slot stays)
          rope_tables.drop_overwritten(r.slot_smem, r.all_smem, a0, num_tokens)
        plgpu.commit_smem()
        plgpu.barrier_arrive(r.slot_bar)
  elif gather:
    @on_wg(0)
    def _():   # rows past T take token T - 1's position: valid reads, never used
      rope_tables.gather_tables(r.pos, a0, r.cos, r.sin, r.tab, interleaved)
      if fused:
        plgpu.barrier_wait(r.idx_bar)   # the window's slots (and all slots), read by the stores / the dedupe
      if dedupe:   # -1 for every window row that a later token overwrites (the last writer of a slot stays)
        rope_tables.drop_overwritten(r.slot_smem, r.all_smem, a0, num_tokens)
      plgpu.commit_smem()            # warpgroup barrier: every thread's table (and slot) stores are done
      plgpu.barrier_arrive(r.tab_bar)
  plgpu.barrier_wait(r.sh_bar)     # P and (without gather_tables) the tables (every warpgroup once)
  if gather and not overlap:
    plgpu.barrier_wait(r.tab_bar)
  n_groups = (n_valid + _lat_group(tpc) - 1) // _lat_group(tpc)

  @pl.when(wg < n_groups)          # latent rows and norm weight (the warpgroups with latent rows, once)
  def _():
    plgpu.barrier_wait(r.kv_bar)
    if overlap and fused:
      plgpu.barrier_wait(r.slot_bar)
  _kv_rows(fused, num_slots, tpc, r, wg, nw, on_wg, t0, n_valid, d, a0, overlap)
  if overlap:   # warpgroup 0 waited for the tables before its k_rope rows
    @pl.when((wg != 0) & (n_steps > 0))
    def _():
      plgpu.barrier_wait(r.tab_bar)
  _q_rope(heads, stages, r, q_start, n_steps, q_row, ring, issue_q, d)
  plgpu.wait_smem_to_gmem(0)       # every TMA store of this warpgroup (and of its warps) has completed


def _kv_rows(fused, num_slots, tpc, r, wg, nw, on_wg, t0, n_valid, d, a0, overlap=False):
  """The CTA's kv rows: RMS norm of the latent (groups of 8 or 4 rows, round-robin over the warpgroups) and RoPE
  of the k_rope rows (one 64-row tile, warpgroup 0); fp8 rows to the cache or bf16 rows to kv_out, one TMA store
  per row and part (latent, k_rope), issued by the 4 warps in turn (a CTA's range need not fill a group)."""
  eps = r.eps[0]
  inv_scale = (1.0 / r.ks[0]) if fused else None     # f32 reciprocal, then a multiply (quant.quantize_fp8)

  def fp8(y):
    return jnp.clip(y * inv_scale, -FP8_MAX, FP8_MAX).astype(FP8)

  def valid_slot(row):                  # row: the CTA's row (token t0 + row) = table row row + d
    if hasattr(r, "slot_smem"):         # gather_tables: the slots' own SMEM array
      slot = r.slot_smem[row + d]
    else:
      slot = r.tab[row + d, 2 * D_ROPE]   # the slot column of the tables (int32; warp code cannot bitcast)
    return slot, (slot >= 0) & (slot < num_slots)

  # ---- RoPE of the key's rope part (warpgroup 0): 64-row tiles of the 8-aligned window from a0 (see _body) ----
  # Pass 0: tile rows = tokens a0 .. a0 + 64 (the CTA's rows 0 .. 64 - d). Pass 1, only when d + n_valid > 64
  # (tokens_per_cta > 56 and t0 % 8 != 0): tokens a0 + 8 .. a0 + 72 for the CTA's rows 64 - d .. n_valid.
  span = _kr_span(tpc)

  def kr_pass(p, lo, hi):
    """Rotate tile rows of tokens a0 + 8p .. a0 + 8p + 64 (in kr_sw) and store the CTA's rows [lo, hi)."""
    plgpu.barrier_wait(r.kr_bar)
    x = _tile(r.kr_sw).astype(jnp.float32)
    sw = _swap(r.kr_sw, r.p_sw)
    tab = r.tab.at[pl.ds(8 * p, TILE)]
    y = x * _f32(_tile(tab.at[:, pl.ds(0, D_ROPE)], False)) + sw * _f32(_tile(tab.at[:, pl.ds(D_ROPE, D_ROPE)],
                                                                              False))
    if fused:
      r.kr_out.at[:, pl.ds(0, D_ROPE)][...] = fp8(y)
    else:
      r.kr_out[...] = y.astype(BF16)
    plgpu.commit_smem()   # also: every thread has read kr_sw (a next pass may reload it)

    @plgpu.warp_map
    def _(warp):
      @pl.loop(lo + warp, hi, step=4)
      def _(row):
        src = row + d - 8 * p           # the row's tile row in this pass
        if fused:
          slot, ok = valid_slot(row)

          @pl.when(ok)
          def _():
            plgpu.copy_smem_to_gmem(r.kr_out.at[pl.ds(src, 1), pl.ds(0, D_ROPE)],
                                    r.pages.at[pl.ds(slot, 1), LAT_CHUNKS])
        else:
          plgpu.copy_smem_to_gmem(r.kr_out.at[pl.ds(src, 1)], r.kvo.at[pl.ds(t0 + row, 1), LAT_CHUNKS])

  def k_rope():
    @on_wg(0)
    def _():
      if overlap:   # the tables come from the gathering warpgroup (warpgroup 0 waits for them here, once)
        plgpu.barrier_wait(r.tab_bar)
      if span <= TILE:        # d + n_valid <= span <= 64: one pass
        kr_pass(0, 0, n_valid)
        return
      n0 = jnp.minimum(n_valid, TILE - d)
      kr_pass(0, 0, n0)

      @pl.when(n0 < n_valid)
      def _():
        plgpu.copy_gmem_to_smem(r.kv.at[pl.ds(a0 + 8, TILE), LAT_CHUNKS], r.kr_sw, r.kr_bar)

        @plgpu.warp_map
        def _(warp):   # each warp's pass-0 row stores have read kr_out (the warps issued them: wait per warp) ...
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        plgpu.commit_smem()   # ... and (warpgroup barrier) all four have, before pass 1 rewrites kr_out
        kr_pass(1, n0, n_valid)

  # ---- RMS norm of the latent: group j of rows goes to warpgroup j % nw ----
  grp = _lat_group(tpc)

  def latent():
    @pl.when(wg < (n_valid + grp - 1) // grp)     # this warpgroup has latent rows (it waited for kv_bar)
    def _():
      _latent_groups(fused, tpc, r, wg, nw, t0, n_valid, eps, fp8, valid_slot)

  # With ``overlap`` the latent rows (which need no tables) go first, while the tables are gathered.
  for part in ((latent, k_rope) if overlap else (k_rope, latent)):
    part()


def _latent_groups(fused, tpc, r, wg, nw, t0, n_valid, eps, fp8, valid_slot):
  lat_rows, grp = _lat_rows(tpc), _lat_group(tpc)
  w = plgpu.load(r.w_smem, layout=LAT_W_LAYOUT, optimized=False).astype(jnp.float32)
  for j, g0 in enumerate(range(0, lat_rows, grp)):
    mine = (g0 < n_valid) if nw == 1 else (wg == j % nw) & (g0 < n_valid)

    @pl.when(mine)
    def _():
      xg = plgpu.load(r.lat.at[pl.ds(g0, grp)], layout=LAT_LAYOUT, optimized=False).astype(jnp.float32)
      ss = jnp.sum(jnp.sum(xg * xg, axis=2), axis=1)
      inv = lax.rsqrt(ss * (1.0 / 512.0) + eps)
      yg = (xg * plgpu.layout_cast(lax.broadcast_in_dim(inv, xg.shape, [0]), LAT_LAYOUT)
            * plgpu.layout_cast(lax.broadcast_in_dim(w, xg.shape, [1, 2]), LAT_LAYOUT))
      if fused:
        r.rows.at[pl.ds(g0, grp)][...] = fp8(yg)
      else:
        r.lat.at[pl.ds(g0, grp)][...] = yg.astype(BF16)   # in place: each thread rewrites what it read
      plgpu.commit_smem()

      @plgpu.warp_map           # one TMA store per row (never past the CTA's tokens), the 4 warps in turn
      def _(warp):
        for rr in range(0, grp, 4):
          row = g0 + rr + warp
          if fused:
            slot, ok = valid_slot(row)

            @pl.when((row < n_valid) & ok)
            def _():
              plgpu.copy_smem_to_gmem(r.rows.at[pl.ds(row, 1)], r.pages.at[pl.ds(slot, 1), pl.ds(0, LAT_CHUNKS)])
          else:
            @pl.when(row < n_valid)
            def _():
              plgpu.copy_smem_to_gmem(r.lat.at[pl.ds(row, 1)], r.kvo.at[pl.ds(t0 + row, 1), pl.ds(0, LAT_CHUNKS)])


def _q_rope(heads, stages, r, q_start, n_steps, q_row, ring, issue_q, d):
  """RoPE of this warpgroup's q tiles through its ring (in place).

  q is processed as tiles of 64 consecutive rows of the flat [T · H, 64] view: H >= 64 (H % 64 == 0): H / 64
  tiles per token; H < 64 (H | 64): one tile holds the heads of g = 64 / H consecutive tokens.
  """
  hb = max(heads // TILE, 1)                  # q tiles per token (H >= 64)
  g = max(TILE // heads, 1)                   # tokens per q tile (H < 64)

  @pl.loop(0, n_steps)
  def _(k):
    i = q_start + k                           # the tile's index within the CTA
    slot = lax.rem(k, stages)
    buf = r.q_sw.at[ring(slot)]
    plgpu.barrier_wait(r.q_full.at[ring(slot)])
    x = _tile(buf).astype(jnp.float32)
    sw = _swap(buf, r.p_sw)

    def table(col0):   # the tile's C (col0 = 0) or S (col0 = 64) values, from the CTA's SMEM tables
      def row(tok):    # tok: the CTA's token index (table row tok + d)
        v = _f32(_cols(r.tab.at[tok + d, pl.ds(col0, D_ROPE)], optimized=False))
        return lax.broadcast_in_dim(v, x.shape, [1])
      if g == 1:
        return row(i // hb)
      head_row = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, x.shape, 0), TILE_LAYOUT)
      out = row(i * g)
      for u in range(1, g):   # rows [u H, (u + 1) H) belong to the tile's u-th token
        out = jnp.where(head_row >= u * heads, row(i * g + u), out)
      return out

    y = (x * table(0) + sw * table(D_ROPE)).astype(BF16)
    buf[...] = y          # in place (the wgmma that read the slot has completed)
    plgpu.commit_smem()   # fence + warpgroup barrier: the slot is visible to TMA
    plgpu.copy_smem_to_gmem(buf, r.qo.at[pl.ds(q_row(k), TILE)])
    plgpu.wait_smem_to_gmem(1, wait_read_only=True)   # the previous step's store has read its slot

    @pl.when((k >= 1) & (k - 1 + stages < n_steps))
    def _():
      issue_q(k - 1 + stages, lax.rem(k - 1, stages))


def _rows_for_swizzled_tma(rows: int) -> int:
  """A TMA into a swizzled SMEM tile needs the GMEM row count to be below 8 or a multiple of 8."""
  return rows if rows < 8 or rows % 8 == 0 else _round_up(rows, 8)


def kv_rows_for(num_tokens: int) -> int:
  """Rows of the kv argument: T, or T rounded up to a multiple of 8 when T > 8 is not one (the op pads; the
  k_rope rows go by TMA into a swizzled tile)."""
  return _rows_for_swizzled_tma(num_tokens)


def q_rows_for(num_tokens: int, heads: int) -> int:
  """Rows of the flat q argument / result: T · H, rounded up to a multiple of 8 only for H < 8 (the op pads)."""
  return _rows_for_swizzled_tma(num_tokens * heads)


@functools.lru_cache(maxsize=64)
def build(num_tokens: int, heads: int, num_slots: int, fused: bool, cfg: TuningConfig | None = None,
          interpret=False, w_dtype=jnp.float32, num_sms: int = DEFAULT_SMS, interleaved: bool = True,
          dedupe: bool = False):
  """Build the kernel for T = num_tokens tokens of H = heads query heads (H % 64 == 0 or 64 % H == 0).

  Kernel arguments:
    kv    [Tk, 9, 64] bf16: kv [T, 576] reshaped, Tk = kv_rows_for(T) >= T (zero padded by the op when T > 8 is not
          a multiple of 8).
    q     [Tq, 64] bf16: q_rope flattened, Tq = q_rows_for(T, H) >= T · H (padded only for H < 8).
    cs    [T, 128] (unfused) / [T, 132] (fused) int32: the f32 bits of the per-token RoPE tables C ‖ S arranged
          per column (module docstring); fused: column 128 holds the token's sanitised slot (−1 = skip; no two kept
          tokens share a slot), columns 129-131 are unused.
          With ``cfg.gather_tables`` instead: ``positions`` [T] int32 (clamped in the kernel), ``cos``, ``sin``
          [max_pos, 32] f32 (``interleaved`` picks the column arrangement), and (fused) ``slots`` [T] int32 (the
          sanitised slots as above, or raw slots where no two tokens can share one: out-of-range ones are skipped
          by the kernel's range check, or, with ``dedupe`` (T <= rope_tables.DEDUPE_MAX_TOKENS), raw slots that
          the kernel itself reduces to the last writer of each slot).
    w     [8, 64] ``w_dtype`` (bf16 or f32): norm weight.
    P     [64, 64] bf16: the pair-swap permutation.
    eps   [1] f32.
    fused only: kv_scale [1] f32; pages ref [num_slots, 9, 64] fp8 (aliased, written).
  Returns q_out [Tq, 64] bf16 (rows past T · H are padding), and (unfused) kv_out [T, 9, 64] bf16.
  ``cfg``: None (:func:`default_config`) or a TuningConfig whose tokens_per_cta / ctas may be None
  (:func:`grid_for` fills them in).
  """
  if heads % TILE and TILE % heads:
    raise ValueError(f"heads must be a multiple or a divisor of {TILE}; got {heads}")
  fused = bool(fused)
  if cfg is None:
    cfg = default_config(num_tokens, heads, fused, num_sms)
  tpc, ctas = grid_for(cfg, num_tokens, heads, fused, num_sms)
  cfg = dataclasses.replace(cfg, tokens_per_cta=tpc, ctas=ctas)
  if cfg.gather_tables and interpret:
    raise NotImplementedError("TuningConfig.gather_tables needs plgpu.inline_mgpu, which interpret mode lacks")
  if dedupe and not (fused and cfg.gather_tables and num_tokens <= rope_tables.DEDUPE_MAX_TOKENS):
    raise ValueError(f"dedupe needs the cache write, gather_tables and T <= {rope_tables.DEDUPE_MAX_TOKENS}; got "
                     f"fused={fused}, gather_tables={cfg.gather_tables}, T={num_tokens}")
  body = functools.partial(_body, fused, num_tokens, heads, num_slots, cfg, bool(interleaved), bool(dedupe))
  kwargs = common.interpret_kwargs(interpret)
  lat = _lat_rows(tpc)
  out_type = [jax.ShapeDtypeStruct((q_rows_for(num_tokens, heads), D_ROPE), BF16)]
  if not fused:
    out_type.append(jax.ShapeDtypeStruct((num_tokens, N_CHUNKS, CHUNK), BF16))
  scratch = [
      plgpu.SMEM((D_ROPE, D_ROPE), BF16, transforms=swizzled(BF16, 128)),                       # P
      plgpu.SMEM((_tab_rows(tpc), _tab_cols(fused, cfg.gather_tables)), jnp.int32),            # C | S (| slot)
      plgpu.SMEM((cfg.warpgroups * cfg.stages, TILE, D_ROPE), BF16, transforms=swizzled(BF16, 128)),  # q rings
      plgpu.SMEM((TILE, D_ROPE), BF16, transforms=swizzled(BF16, 128)),                         # k_rope tile
      plgpu.SMEM((TILE, 2 * D_ROPE), FP8) if fused else plgpu.SMEM((TILE, D_ROPE), BF16),       # k_rope out
      plgpu.SMEM((lat, LAT_CHUNKS, CHUNK), BF16),                                               # latent rows
      plgpu.SMEM((LAT_CHUNKS, CHUNK), w_dtype),                                                 # norm weight
  ]
  if fused:
    scratch += [plgpu.SMEM((lat, LAT_CHUNKS, CHUNK), FP8)]                                      # fp8 latent
  if cfg.gather_tables and fused:
    scratch += [plgpu.SMEM((_idx_len(tpc),), jnp.int32)]                                       # window slots
    scratch += [plgpu.SMEM((rope_tables.DEDUPE_MAX_TOKENS,), jnp.int32)] if dedupe else []      # all slots
  scratch += [plgpu.Barrier(num_arrivals=1 if cfg.gather_tables else 2),                        # sh_bar
              plgpu.Barrier(num_arrivals=2),                                                    # kv_bar
              plgpu.Barrier(num_arrivals=1),                                                    # kr_bar
              plgpu.Barrier(num_barriers=cfg.warpgroups * cfg.stages)]                          # q_full
  if cfg.gather_tables:
    scratch += [plgpu.Barrier(num_arrivals=1 + dedupe)] if fused else []                      # idx_bar: slots
    scratch += [plgpu.Barrier(num_arrivals=1)]                                                  # tab_bar
    if cfg.overlap_gather and fused:
      scratch += [plgpu.Barrier(num_arrivals=1)]                                                # slot_bar
  extra = dict(num_threads=cfg.warpgroups, thread_name="wg") if cfg.warpgroups > 1 else {}
  return plgpu.kernel(
      body,
      out_type=tuple(out_type),
      grid=(ctas,), grid_names=("c",),
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE),
      **extra,
      **kwargs,
  )
