"""Per-head FP8 GEMM with 128x128 block-scaled weights for Hopper (sm_90a): ``out[t, h] = a8[t, h] @ w8[h]``.

What one CTA computes
---------------------
The output is cut into tiles of one head ``h``, ``64 · wm`` tokens and ``tile_n · wn · sub_n`` columns
(``wm · wn = 2``: two consumer warpgroups, each owning 64 x ``tile_n`` sub-tiles; ``TuningConfig.wg_split`` picks
"n" (64 x 256, for N % 256 == 0) or "m" (128 x 128); ``tile_n=64`` makes the "n" tile 64 x 128, both consumers'
sub-tiles then lying in one weight scale block; ``sub_n=2`` makes it 64 x 512). The grid is persistent
(``max_ctas`` CTAs, the SM count): CTA ``pid`` walks the tiles pid, pid + grid, ... (M tiles fastest, so
concurrently running CTAs share one head's weight tile in L2), and its K-chunk ring runs on across tiles, so the
next tile's loads overlap the current tile's epilogue.
A sub-tile (128 or 64 columns) lies in exactly one weight scale block, so its block scale is a scalar per K
block:

    for each 128-wide K block kb (the last one may be partial):
      part  = a8[rows, h, kb] · w8[h, cols, kb]ᵀ     fp8 wgmma into a fresh f32 accumulator (64 x 128)
      total = total + part · w_scale[h, kb, nb]       promotion in f32 registers (DeepSeek style)
    out = bf16(total · a_scale)                       a_scale per row ([H, T_pad]) or one scalar

so each fp8 wgmma chain is at most 128 long (Hopper's fp8 accumulation is below f32 precision, see
../shared/mgpu/README.md section 11) and the block sums are added in f32, in the same order as the XLA path of
:mod:`mla_pallas.ops.bmm_fp8`.

Inputs are prepared by :mod:`mla_pallas.ops.bmm_fp8` (one fused XLA pre-pass): ``a`` quantized to e4m3 per (t, h)
row or per tensor with :mod:`mla_pallas.quant` (bitwise the reference's quantization), row scales as
[H, T_pad] f32 (padded with 1.0). The kernel reads:

* ``a8 [T8, H, K]`` fp8 *in place*: each TMA box is ``a8.at[rows, h, k-chunk]`` (the head index fixed), i.e. the
  array is consumed as [H, T, K] through the GMEM ref view, with no transpose pass. T8 is T rounded up to a
  multiple of 8 by the pre-pass (Mosaic GPU tiles the GMEM rows of a swizzled TMA box by 8 and rejects other
  row counts); rows past T8 in the last M tile are zero-filled by the TMA unit.
* ``w [H, N, K]`` fp8, **K-major**: FP8 wgmma on Hopper only takes K-major operands (B stored (N, K), passed as
  ``.T``; ../shared/mgpu/README.md section 5), so the weight must be stored transposed relative to the
  reference's [H, K, N]. The op accepts that layout directly (``weight_layout="hnk"``, see
  :func:`mla_pallas.ops.bmm_fp8.prepare_weight`) or transposes per call.
* ``w_scale [H, ceil(K/128), N/128]`` f32, read as scalars.

K is consumed in 64-wide chunks (64-byte swizzle), so K % 64 == 0 needs no padding (K = 192: blocks of 2 and 1
chunks). Outputs go through SMEM and one TMA store per sub-tile into ``out [T, H, N]`` bf16 directly; the TMA unit
clips rows past T.

In-kernel quantization (``TuningConfig.quantize_k = K``, per-token scales, bf16 ``a``)
-------------------------------------------------------------------------------------
The kernel then reads ``a [T, H, K]`` bf16 itself: per tile the producer loads the CTA's rows of all of K (K/64
TMA boxes into a 128-byte-swizzled bf16 tile; ``a`` padded by the op to a multiple of 8 rows, rows past it are
zero-filled), each consumer quantizes its 64 rows with
the float32 operations of :func:`mla_pallas.quant.quantize_rows_fp8` (two passes over SMEM: row amax, then
``fp8(clip(x * (1 / scale), ±448))`` into its own 64-byte-swizzled fp8 tile) and keeps the row scales in
registers for the epilogue; the ring then carries only B chunks, and ``a_buffers=2`` bf16 tiles let the next
tile's rows load during this one's MMAs. No pre-pass launches. On an H200 the output was bitwise equal to the
pre-pass path at every measured shape, and faster at T = 8-256 (the op's default up to
``ops/bmm_fp8.FUSED_QUANT_MAX_TOKENS``). History (benchmarks/RESULTS.md): a linear (unswizzled) bf16 tile made the
two register passes bank-conflicted and the in-kernel path slower than the pre-pass at K = 512 and T >= 128; the
128-byte-swizzled tile (``a`` padded to 8-row multiples by the op) fixed that. SMEM adds
``a_buffers · cta_m · K · 2 + 2 · 64 · K`` bytes (K = 512 needs ``a_buffers=1``; with ``wg_split="m"`` it does not
fit).

**Register A operand** (``a_registers=True``, the op's default for K <= 512; 2026-11-30): each consumer loads its
64 rows of all of K once from the bf16 tile in ``Layout.WGMMA_8BIT`` (16 registers per 64-wide chunk per thread),
takes the row amax (elementwise over the chunks, then one cross-lane reduction per row), quantizes in registers
(``x · (1 / scale)`` then ``cvt.rn.satfinite.e4m3x2``, whose saturation is the clip) and passes the fp8 chunks
to the wgmmas as their *register* A operand (an 8-bit register operand of the WGMMA_8BIT layout is K-major by
construction). No fp8 SMEM tile, no SMEM stores, no proxy
fence; the bf16 tile is released as soon as it is in registers; the SMEM saved (``2 · 64 · K``) lets K = 512 use
two bf16 buffers, or in-kernel quantization at all with ``wg_split="m"``. The fp8 bytes and wgmma products are
those of the SMEM path, so the outputs are bitwise equal (H200: tests/test_bmm_fp8_kernel_gpu.py). Interpret mode
has no register-A wgmma; there the kernel runs the SMEM tile path. Measured (benchmarks/RESULTS.md, 2026-11-30g):
0.1-0.2 us faster at K = 128 / 192, 0.6-0.9 us at K = 512 (T <= 64), and 13.4 / 22.1 against 25.4 / 46.0 us for
DeepSeek W_UV at T = 128 / 256 (in-kernel quantization instead of the XLA pre-pass).

**Producer quantization** (``producer_quant=True``, the op's default at T <= 8, and T <= 16 at K = 512;
2026-11-30i): at decode sizes the register path quantizes all 64 rows of the tile twice (once per consumer), and a
WGMMA_8BIT fragment spreads every 16-row group over one warp, so at T = 1 the 63 empty rows cost as much as the real
one. Instead the producer warpgroup, after issuing the first ring-full of B chunks, quantizes only the T real rows
straight from GMEM (:mod:`mla_pallas.kernels.bmm_row_quant`: one warp per row, the same float32 operations) into an
fp8 SMEM tile (64-byte swizzle) plus a [64] f32 scale row, fences, and arrives on ``a_full``; both consumers' wgmmas
read that tile as their SMEM A operand and release it (``a_empty``) after their last block. No bf16 A tile, no TMA
for A. Tile rows past T are never written: the output rows they feed are past T and dropped by the TMA store.
The producer then needs more than 40 registers: the split is 56 / 224 (a setmaxnreg split must satisfy
p + 2 c <= 504 or the consumers' increase waits forever: 64 / 224 hung on the H200). Measured (H200, same-run XLA):
T = 1 W_UV 6.2 -> 3.8 us (DeepSeek) and 5.9 -> 3.8 (GLM-5), W_UK 4.4 -> 4.1-4.2 / 4.4 -> 3.6; bitwise the register
path.

Warpgroup roles (``num_threads=3``, Lane semantics)
---------------------------------------------------
* WG2 — producer (40 registers): for every tile and K chunk (ring position g), waits for slot ``g % stages`` to
  be released, then issues two TMAs (the A chunk of all CTA rows, the B chunk of all CTA columns) arriving on
  ``full[slot]``; finally drains ``empty`` (interpret-mode barrier rule).
* WG0, WG1 — consumers (232 registers): per tile, first load the weight block scales (and the row scales) so
  that their GMEM latency overlaps the operand waits; per K block, wait the chunks' ``full`` barriers, issue the
  wgmmas, read the block accumulator (which waits for them), release the chunks (``empty``), promote into
  ``total`` (64 registers + 64 for the block accumulator); then scale, cast, wait until the previous tile's TMA
  store has read the staging tile, stage and store.

SMEM budget (bytes, default stages=4)
-------------------------------------
    ring (stages x (64 wm + 128 wn) x 64 fp8)    wg_split "n": 4 x 20 480 = 81 920; "m": 4 x 16 384 = 65 536
    output staging (2 x 64 x tile_n bf16)        32 768 (tile_n = 128)
    barriers, Mosaic reduction scratch           ~2 100
    total                                        ~117 KB ("n") / ~100 KB ("m")
One CTA per SM (the 232/40 register split takes the whole register file); latency is hidden by the persistent
ring instead of by co-resident CTAs.

Measured on an H200 (2026-11-30, benchmarks/RESULTS.md): the correctness tests of
tests/test_bmm_fp8_kernel_gpu.py pass (T 1-4096, the four MLA (K, N) pairs, partial M tiles, every in-kernel
quantization variant bitwise against the pre-pass path). Against XLA's FP8 dot_general in the same run, with the
op's defaults (2026-11-30g, 2026-11-30h for the register quantization without the clip, 2026-11-30i for the
producer quantization): 1.7-3.6x at T = 4096 (117-232 TFLOP/s, earlier run), 3.1-5.6x at T = 64-256, 2.5-3.6x at
T = 16, 1.69-3.45x at T = 2-8, 1.53-2.13x at T = 1 (3.6-4.2 us; XLA computes the product as one reduction fusion
of 6.4-8.1 us). ``impl="auto"`` takes the kernel at every T.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import bmm_row_quant, common
from mla_pallas.kernels.common import FP8, swizzled
from mla_pallas.quant import FP8_MAX, _INV_FP8_MAX

TILE_M = 64        # token rows per consumer warpgroup (wgmma M)
TILE_N = 128       # default output columns per consumer warpgroup = one weight scale block (TuningConfig.tile_n)
SCALE_BLOCK = 128  # weight block-scale granularity along K and N
CHUNK = 64         # K elements per TMA box / wgmma operand tile (64-byte swizzle)
B_BOX_ROWS = 256   # a TMA box spans at most 256 elements per dimension: wider B chunks take several boxes
MAX_K = 2048       # K blocks are unrolled in Python; beyond this the op falls back to XLA
CONSUMER_REGS = 232
PRODUCER_REGS = 40
# With producer_quant the producer runs the row quantization (bmm_row_quant) and the consumers hold no fp8 rows.
# A setmaxnreg split of the 384 threads must give back at least what it takes: 128 (168 - p) >= 256 (c - 168),
# i.e. p + 2 c <= 504 (168 = the launch's 65536 / 384 rounded down to 8); otherwise the consumers' increase waits
# forever (H200, 2026-11-30i: 64 / 224 hung the kernel).
PQ_CONSUMER_REGS = 224
PQ_PRODUCER_REGS = 56
assert PRODUCER_REGS + 2 * CONSUMER_REGS <= 504 and PQ_PRODUCER_REGS + 2 * PQ_CONSUMER_REGS <= 504
MAX_REGISTER_K = 512   # quant_passes=1 / a_registers: 8 chunks x 16 registers of bf16 pairs per thread


@dataclasses.dataclass(frozen=True)
class TuningConfig(common.TuningConfigBase):
  """Tuning knobs of the sm_90 FP8 bmm kernel.

  stages: ring slots, each one 64-wide K chunk of the CTA's A rows and B columns.
  wg_split: "n" (the two consumers split 256 columns: CTA tile 64 x 256, needs N % 256 == 0) or "m" (they split
    128 rows: CTA tile 128 x 128).
  max_ctas: persistent grid size (the op passes the device's SM count; 132 on an H100 SXM / H200). Each CTA
    walks the output tiles pid, pid + grid, ...; the ring continues across tiles, so the producer loads the next
    tile's first chunks while the consumers finish and store the current one.
  quantize_k: None (the kernel reads ``a`` already quantized by the op's XLA pre-pass) or K: the kernel reads
    ``a`` in bfloat16 and quantizes it per (t, h) row itself (per-token scales only; see "In-kernel
    quantization" in the module docstring). The value is K, so that the SMEM budget can be checked here.
  a_buffers: bf16 A tiles in flight with ``quantize_k`` (2: the next tile's rows load while this one is
    multiplied; 1 where two do not fit in SMEM, e.g. K = 512). Ignored without ``quantize_k``.
  sub_n: 64 x ``tile_n`` sub-tiles per consumer along N (wg_split "n" only): 2 makes the CTA tile 64 x 512, so at
    decode sizes a CTA covers one head's N = 512 with one A load / quantization and one tile hand-off instead of
    two tiles (the slots of the tile's K chunks stay in the ring until the last sub-tile: needs K / 64 <= stages).
    The op's default where halving the tile count saves a wave of CTAs at T <= 256 (ops/bmm_fp8.py,
    ``SUB_N_MAX_TOKENS``; H200: DeepSeek W_UK T = 8 4.8 against 6.5 us).
  tile_n: columns of a consumer's sub-tile (its wgmma N): 128 (one weight scale block) or 64 (the two consumers'
    sub-tiles of wg_split "n" then share one scale block: CTA tile 64 x 128). 64 doubles the CTAs at decode sizes
    where 64 x 256 tiles leave SMs idle (GLM-5 W_UV: 64 -> 128 CTAs) and, with one 64-row A tile per CTA, leaves
    SMEM for in-kernel quantization at N = 128 (DeepSeek W_UV, where wg_split "m" does not fit it).
  quant_passes: in-kernel quantization reads the bf16 rows from SMEM once (1: they stay in registers, 16 per
    64-wide chunk per thread, between the row amax and the quantization; K <= 512) or twice (2: amax pass, then a
    quantization pass). None: 1 where K <= 512.
  share_quant: with wg_split "n" both consumers multiply the same 64 rows; True splits their quantization (each
    takes every row amax but writes only every other fp8 chunk, into one tile per tile parity) and syncs the two
    on a barrier before the wgmmas, instead of each quantizing all of K into its own tile.
  a_registers: in-kernel quantization leaves the fp8 rows in registers (``Layout.WGMMA_8BIT``) as the wgmmas'
    register A operand: no fp8 SMEM tile, no stores, no proxy fence (K <= 512). Interpret mode has no register-A
    wgmma; there the kernel runs the SMEM tile path (same products; the register path is checked by sm_90
    lowering and on the GPU).
  producer_quant: in-kernel quantization of the T <= bmm_row_quant.MAX_ROWS real rows of the (single) M tile by
    the producer warpgroup, straight from GMEM (:mod:`mla_pallas.kernels.bmm_row_quant`: one warp per row, the
    float32 operations of the register path) into an fp8 SMEM tile that both consumers' wgmmas read: no bf16
    tile, and the empty rows of the tile are not quantized (at T = 1 the register path quantizes 64 rows twice).
    Needs quantize_k <= 512, wg_split "n", a_registers=False, share_quant=False. Interpret mode has no
    ``inline_mgpu``: there the consumers quantize (the SMEM tile path).
  """
  stages: int = 4
  wg_split: str = "n"
  max_ctas: int = 132
  quantize_k: int | None = None
  a_buffers: int = 2
  sub_n: int = 1
  tile_n: int = 128
  quant_passes: int | None = None
  share_quant: bool = False
  a_registers: bool = False
  producer_quant: bool = False

  def validate(self):
    if self.wg_split not in ("n", "m"):
      raise ValueError(f"TuningConfig.wg_split must be 'n' or 'm'; got {self.wg_split!r}")
    if self.stages > 16:
      raise ValueError(f"TuningConfig.stages must be <= 16; got {self.stages}")
    if self.a_buffers > 2:
      raise ValueError(f"TuningConfig.a_buffers must be 1 or 2; got {self.a_buffers}")
    if self.sub_n not in (1, 2):
      raise ValueError(f"TuningConfig.sub_n must be 1 or 2; got {self.sub_n}")
    if self.sub_n > 1 and self.wg_split != "n":
      raise ValueError("TuningConfig.sub_n=2 needs wg_split='n'")
    if self.tile_n not in (64, 128):
      raise ValueError(f"TuningConfig.tile_n must be 64 or 128; got {self.tile_n}")
    if self.quantize_k is not None and (self.quantize_k <= 0 or self.quantize_k % CHUNK):
      raise ValueError(f"TuningConfig.quantize_k must be None or a positive multiple of {CHUNK}; "
                       f"got {self.quantize_k!r}")
    if self.quant_passes not in (None, 1, 2):
      raise ValueError(f"TuningConfig.quant_passes must be None, 1 or 2; got {self.quant_passes!r}")
    if self.quant_passes == 1 and self.quantize_k is not None and self.quantize_k > MAX_REGISTER_K:
      raise ValueError(f"TuningConfig.quant_passes=1 keeps the bf16 rows in registers: needs quantize_k <= "
                       f"{MAX_REGISTER_K}; got {self.quantize_k}")
    if self.share_quant and (self.wg_split != "n" or self.quantize_k is None):
      raise ValueError("TuningConfig.share_quant=True needs wg_split='n' and in-kernel quantization (quantize_k)")
    if self.a_registers and (self.quantize_k is None or self.quantize_k > MAX_REGISTER_K or self.share_quant):
      raise ValueError(f"TuningConfig.a_registers=True needs in-kernel quantization with quantize_k <= "
                       f"{MAX_REGISTER_K} and share_quant=False; got quantize_k={self.quantize_k}, "
                       f"share_quant={self.share_quant}")
    if self.producer_quant and (self.quantize_k is None or self.quantize_k > bmm_row_quant.MAX_K
                                or self.wg_split != "n" or self.a_registers or self.share_quant):
      raise ValueError(f"TuningConfig.producer_quant=True needs in-kernel quantization with quantize_k <= "
                       f"{bmm_row_quant.MAX_K}, wg_split='n', a_registers=False and share_quant=False; got "
                       f"quantize_k={self.quantize_k}, wg_split={self.wg_split!r}, a_registers={self.a_registers}, "
                       f"share_quant={self.share_quant}")
    self.check_smem(smem_budget(self))

  @property
  def register_quant(self) -> bool:
    """In-kernel quantization keeps the bf16 rows in registers (one SMEM pass)."""
    if self.quant_passes is None:
      return self.quantize_k is not None and self.quantize_k <= MAX_REGISTER_K
    return self.quant_passes == 1

  @property
  def wm(self) -> int:
    return 2 if self.wg_split == "m" else 1

  @property
  def wn(self) -> int:
    return 2 if self.wg_split == "n" else 1

  @property
  def cta_m(self) -> int:
    return TILE_M * self.wm

  @property
  def cta_n(self) -> int:
    return self.tile_n * self.wn * self.sub_n


def smem_budget(cfg: TuningConfig) -> int:
  if cfg.quantize_k is None:
    a_bufs = (((cfg.stages, cfg.cta_m, CHUNK), FP8),)                         # A ring (fp8 chunks)
  elif cfg.producer_quant:
    a_bufs = (((cfg.a_buffers, cfg.quantize_k // CHUNK, TILE_M, CHUNK), FP8),  # fp8 A tiles (producer's rows)
              ((cfg.a_buffers, TILE_M), jnp.float32))                          # their row scales
  else:
    k_chunks = cfg.quantize_k // CHUNK
    a_bufs = (((cfg.a_buffers, k_chunks, cfg.cta_m, CHUNK), jnp.bfloat16),)   # bf16 A tiles (whole K)
    if not cfg.a_registers:
      a_bufs += (((2, k_chunks, TILE_M, CHUNK), FP8),)                        # fp8 A per consumer
  return common.smem_bytes(
      *a_bufs,
      ((cfg.stages, cfg.cta_n, CHUNK), FP8),            # B ring
      ((2, TILE_M, cfg.tile_n), jnp.bfloat16),          # output staging
  ) + 2 * 16 * 8 + 2 * 8 + 2048   # barriers; Mosaic reduction scratch (CompilerParams default)


def check_shapes(t: int, h: int, k: int, n: int, cfg: TuningConfig) -> None:
  """Raise NotImplementedError when the kernel cannot take these (valid) shapes."""
  if cfg.quantize_k is not None and cfg.quantize_k != k:
    raise ValueError(f"TuningConfig.quantize_k={cfg.quantize_k} must equal K={k}")
  if t < 1:
    raise NotImplementedError(f"quantize_and_bmm_fp8: no Mosaic GPU kernel for T={t} (empty grid)")
  if k % CHUNK or k > MAX_K:
    raise NotImplementedError(f"quantize_and_bmm_fp8: no Mosaic GPU kernel for K={k} "
                              f"(needs K % {CHUNK} == 0 and K <= {MAX_K})")
  if n % cfg.cta_n:
    raise NotImplementedError(f"quantize_and_bmm_fp8: no Mosaic GPU kernel for N={n} "
                              f"(needs N % {cfg.cta_n} == 0 with wg_split={cfg.wg_split!r}, sub_n={cfg.sub_n}, "
                              f"tile_n={cfg.tile_n})")
  if cfg.producer_quant and t > bmm_row_quant.MAX_ROWS:
    raise NotImplementedError(f"TuningConfig.producer_quant quantizes at most {bmm_row_quant.MAX_ROWS} rows (one "
                              f"M tile); got T={t}")
  if cfg.sub_n > 1 and k // CHUNK > cfg.stages:
    raise ValueError(f"TuningConfig.sub_n={cfg.sub_n} keeps all K / 64 = {k // CHUNK} chunks of a tile in the ring: "
                     f"needs stages >= {k // CHUNK}; got stages={cfg.stages}")
  del t, h


def _tile_coords(cfg: TuningConfig, lin, m_tiles: int, n_tiles: int):
  """Linear tile id -> (m0, n_idx, h); M tiles vary fastest, so CTAs running at the same time share the weight
  tile of one (head, N tile) through L2."""
  m_idx = lax.rem(lin, m_tiles)
  rest = lax.div(lin, m_tiles)
  return m_idx * cfg.cta_m, lax.rem(rest, n_tiles), lax.div(rest, n_tiles)


def _row_scales(amax):
  """(scale, 1 / scale) per row from the row amax, as :func:`mla_pallas.quant.quantize_rows_fp8`: amax · f32(1/448),
  1 for an all-zero row."""
  scale = amax * _INV_FP8_MAX
  scale = jnp.where(scale == 0, jnp.float32(1.0), scale)
  return scale, jnp.float32(1.0) / scale


def _quantize_rows(a_bf, a8, rows, *, half_of=None, in_registers=False):
  """In-kernel per-row quantization of one consumer's 64 rows (``rows``) of the bf16 tile ``a_bf``
  ([K/64, cta_m, 64], linear) into its fp8 tile ``a8`` ([K/64, 64, 64], 64-byte swizzle), with exactly the
  float32 operations of :func:`mla_pallas.quant.quantize_rows_fp8`: amax = max |x| over the row,
  scale = amax * f32(1/448) (1 for an all-zero row), x8 = fp8(clip(x * (1 / scale), ±448)).

  ``half_of``: None (quantize and store every 64-wide chunk) or this consumer's index w (traced): store only the
  chunks c with c % 2 == w (the amax always covers all of K).
  ``in_registers``: keep the bf16 chunks in registers between the amax and the quantization (16 registers per
  chunk per thread, one SMEM pass); otherwise two passes over SMEM keep the registers at one 64 x 64 f32 tile.

  Returns the row scales, [64] f32 in the row layout of the wgmma accumulator (``Layout.WGMMA.reduce(1)``).
  """
  k_chunks = a_bf.shape[0]

  def load(c):
    return plgpu.load(a_bf.at[c, rows], layout=plgpu.Layout.WGMMA)

  held = [load(c) for c in range(k_chunks)] if in_registers else None
  amax = None
  for c in range(k_chunks):
    m = jnp.max(jnp.abs((held[c] if in_registers else load(c)).astype(jnp.float32)), axis=1)
    amax = m if amax is None else jnp.maximum(amax, m)
  scale, inv = _row_scales(amax)

  def store(chunks):
    for c in chunks:
      x = (held[c] if in_registers else load(c)).astype(jnp.float32)
      q = x * lax.broadcast_in_dim(inv, x.shape, [0])
      a8.at[c][...] = jnp.clip(q, -FP8_MAX, FP8_MAX).astype(FP8)

  if half_of is None:
    store(range(k_chunks))
  else:
    for w in (0, 1):
      pl.when(half_of == w)(functools.partial(store, range(w, k_chunks, 2)))
  return scale


def _quantize_rows_to_registers(a_bf, rows):
  """:func:`_quantize_rows` (same float32 operations, so the same fp8 values) into registers: returns the K/64
  quantized chunks, [64, 64] float8_e4m3fn each in ``Layout.WGMMA_8BIT`` (an fp8 wgmma's register A operand),
  and the row scales ([64] f32). The bf16 chunks are held in registers (16 per chunk per thread) while the row
  amax is taken, elementwise over the chunks first and then once across each row (max is exact, so the order
  does not change the result)."""
  k_chunks = a_bf.shape[0]
  held = [plgpu.load(a_bf.at[c, rows], layout=plgpu.Layout.WGMMA_8BIT) for c in range(k_chunks)]
  amax_el = jnp.abs(held[0])
  for x in held[1:]:
    amax_el = jnp.maximum(amax_el, jnp.abs(x))
  scale, inv = _row_scales(jnp.max(amax_el.astype(jnp.float32), axis=1))
  inv = plgpu.layout_cast(lax.broadcast_in_dim(inv, (TILE_M, CHUNK), [0]), plgpu.Layout.WGMMA_8BIT)
  # No clip: Mosaic GPU converts f32 -> e4m3 with cvt.rn.satfinite (finite values above 448 and +-inf go to
  # +-448, NaN stays NaN), which is what clip(., +-448) followed by the conversion gives; |x * inv| <= 448 (1 + 2e-7)
  # anyway for finite rows. The clip's two instructions per element were ~1 us of the K = 512 decode-size kernel
  # (H200, 2026-11-30h: 7.0 -> 6.0 us). The SMEM path keeps the clip: interpret mode converts with XLA, where
  # values past the e4m3 range become NaN.
  chunks = [(x.astype(jnp.float32) * inv).astype(FP8) for x in held]
  return chunks, scale


def _body(cfg: TuningConfig, k: int, per_token: bool, m_tiles: int, n_tiles: int, num_tiles: int, grid: int,
          regs: bool, pq_rows: int, *refs):
  fuse = cfg.quantize_k is not None
  pq = pq_rows > 0     # producer_quant (outside interpret mode): the producer quantizes the first pq_rows rows
  if pq:   # a is bf16 [T, H, K]; fp8 A tiles and their row scales, written by the producer
    (a_gmem, w_gmem, ws_gmem, o_gmem, a8, a_sc, b_ring, o_smem, full, empty, a_full, a_empty) = refs
    as_gmem = a_ring = a_bf = None
  elif fuse:   # a is bf16 [T, H, K]; no scale input; no fp8 A tile when the fp8 rows stay in registers (regs)
    if regs:
      refs = refs[:5] + (None,) + refs[5:]
    (a_gmem, w_gmem, ws_gmem, o_gmem, a_bf, a8, b_ring, o_smem, full, empty, a_full, a_empty, *q_ready) = refs
    as_gmem = a_ring = None
  else:
    (a_gmem, as_gmem, w_gmem, ws_gmem, o_gmem, a_ring, b_ring, o_smem, full, empty) = refs
  pid = lax.axis_index("cta")
  wg = lax.axis_index("wg")
  stages = cfg.stages
  n_chunks = k // CHUNK
  per_block = SCALE_BLOCK // CHUNK
  n_blocks = -(-n_chunks // per_block)
  my_tiles = lax.div(num_tiles - 1 - pid, grid) + 1   # tiles pid, pid + grid, ... (grid <= num_tiles: >= 1)

  @pl.when(wg == 2)
  def _producer():
    plgpu.set_max_registers(PQ_PRODUCER_REGS if pq else PRODUCER_REGS, action="decrease")

    def quantize_a(i, m0, h):   # producer_quant: the tile's rows into the fp8 buffer, then a_full
      ab = lax.rem(i, cfg.a_buffers)

      @pl.when(i >= cfg.a_buffers)
      def _():
        plgpu.barrier_wait(a_empty.at[ab])
      bmm_row_quant.quantize_rows(a_gmem, a8.at[ab], a_sc.at[ab], m0, h, pq_rows)
      plgpu.commit_smem()        # every thread's SMEM stores, visible to the wgmmas (async proxy)
      plgpu.barrier_arrive(a_full.at[ab])

    @pl.loop(0, my_tiles)
    def _(i):
      m0, n_idx, h = _tile_coords(cfg, pid + i * grid, m_tiles, n_tiles)
      n0 = n_idx * cfg.cta_n
      # producer_quant: after the first ring-full of B chunks (their loads then overlap the row loads; the later
      # chunks wait for slots that the consumers free only once they have this tile's A)
      pq_at = min(stages, n_chunks) if pq else None
      if fuse and not pq:   # the whole bf16 A tile, once both consumers have used the buffer's previous tile
        ab = lax.rem(i, cfg.a_buffers)

        @pl.when(i >= cfg.a_buffers)
        def _():
          plgpu.barrier_wait(a_empty.at[ab])
        for c in range(n_chunks):
          plgpu.copy_gmem_to_smem(a_gmem.at[pl.ds(m0, cfg.cta_m), h, pl.ds(c * CHUNK, CHUNK)], a_bf.at[ab, c],
                                  a_full.at[ab])
      for c in range(n_chunks):
        if c == pq_at:
          quantize_a(i, m0, h)
        g = i * n_chunks + c          # ring position, continuing across tiles
        slot = lax.rem(g, stages)

        @pl.when(g >= stages)
        def _():
          plgpu.barrier_wait(empty.at[slot])
        ks = pl.ds(c * CHUNK, CHUNK)
        if not fuse:
          plgpu.copy_gmem_to_smem(a_gmem.at[pl.ds(m0, cfg.cta_m), h, ks], a_ring.at[slot], full.at[slot])
        if cfg.cta_n <= B_BOX_ROWS:
          plgpu.copy_gmem_to_smem(w_gmem.at[h, pl.ds(n0, cfg.cta_n), ks], b_ring.at[slot], full.at[slot])
        else:                                           # TMA boxes hold at most 256 rows
          for b0 in range(0, cfg.cta_n, B_BOX_ROWS):
            plgpu.copy_gmem_to_smem(w_gmem.at[h, pl.ds(n0 + b0, B_BOX_ROWS), ks],
                                    b_ring.at[slot, pl.ds(b0, B_BOX_ROWS)], full.at[slot])
      if pq_at == n_chunks:
        quantize_a(i, m0, h)

    # Drain: observe the consumers' last release of every slot (interpret-mode barrier rule; harmless on hardware).
    end = my_tiles * n_chunks
    for s in range(stages):
      g = end - stages + s

      @pl.when(g >= 0)
      def _():
        plgpu.barrier_wait(empty.at[lax.rem(g, stages)])
    if fuse:
      for s in range(cfg.a_buffers):
        i = my_tiles - cfg.a_buffers + s

        @pl.when(i >= 0)
        def _():
          plgpu.barrier_wait(a_empty.at[lax.rem(i, cfg.a_buffers)])

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(PQ_CONSUMER_REGS if pq else CONSUMER_REGS, action="increase")
    wi_m = wg if cfg.wg_split == "m" else 0
    wi_n = wg if cfg.wg_split == "n" else 0
    rows = pl.ds(wi_m * TILE_M, TILE_M)
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    @pl.loop(0, my_tiles)
    def _(i):
      m0, n_idx, h = _tile_coords(cfg, pid + i * grid, m_tiles, n_tiles)
      # This consumer's 128-column sub-tiles (indices within the CTA tile; written so that sub_n = 1 traces the
      # same operations as before the knob existed).
      subs = [wi_n] if cfg.sub_n == 1 else [wi_n * cfg.sub_n + s for s in range(cfg.sub_n)]
      # Scales first: their GMEM latency then overlaps the waits for the operands. Sub-tile ``sub`` starts at
      # column n_idx * cta_n + sub * tile_n, inside scale block (that column) // 128.
      if cfg.tile_n == SCALE_BLOCK:
        nbs = [n_idx * (cfg.wn * cfg.sub_n) + sub for sub in subs]
      else:
        nbs = [lax.div(n_idx * cfg.cta_n + sub * cfg.tile_n, SCALE_BLOCK) for sub in subs]
      w_scales = [[ws_gmem[h, kb, nb] for kb in range(n_blocks)] for nb in nbs]
      if fuse:
        ab = lax.rem(i, cfg.a_buffers)
        plgpu.barrier_wait(a_full.at[ab])
        if pq:   # the producer's fp8 rows and their scales (rows past T: never written, their outputs dropped)
          a8_tile = a8.at[ab]
          a_scale = plgpu.load(a_sc.at[ab], layout=row_layout, optimized=False)
        elif regs:
          a_chunks, a_scale = _quantize_rows_to_registers(a_bf.at[ab], rows)
          plgpu.barrier_arrive(a_empty.at[ab])   # the bf16 tile is in registers: it may be overwritten
        elif cfg.share_quant:   # this consumer writes every other chunk of the tile parity's shared fp8 tile
          a8_tile = a8.at[lax.rem(i, 2)]
          a_scale = _quantize_rows(a_bf.at[ab], a8_tile, rows, half_of=wg, in_registers=cfg.register_quant)
        else:
          a8_tile = a8.at[wg]
          a_scale = _quantize_rows(a_bf.at[ab], a8_tile, rows, in_registers=cfg.register_quant)
        if not regs and not pq:
          plgpu.commit_smem()               # the fp8 stores are visible to the wgmma (async proxy)
        if cfg.share_quant:   # both halves written. The parity's tile is rewritten two tiles on, after both
          # consumers passed this barrier for the tile in between, i.e. after their wgmmas on this tile completed.
          plgpu.barrier_arrive(q_ready[0])
          plgpu.barrier_wait(q_ready[0])
      elif per_token:
        a_scale = plgpu.load(as_gmem.at[h, pl.ds(m0 + wi_m * TILE_M, TILE_M)], layout=row_layout,
                             optimized=False)
      else:
        a_scale = as_gmem[0]
      for si, sub in enumerate(subs):
        cols = pl.ds(sub * cfg.tile_n, cfg.tile_n)
        last_sub = si == len(subs) - 1
        total = plgpu.layout_cast(jnp.zeros((TILE_M, cfg.tile_n), jnp.float32), plgpu.Layout.WGMMA)
        for kb in range(n_blocks):
          chunks = range(kb * per_block, min((kb + 1) * per_block, n_chunks))

          def block(acc_ref):
            for c in chunks:
              slot = lax.rem(i * n_chunks + c, stages)
              if si == 0:   # a slot's phase is waited once; later sub-tiles reuse the resident chunk
                plgpu.barrier_wait(full.at[slot])
              a_op = (a_chunks[c] if regs else a8_tile.at[c]) if fuse else a_ring.at[slot, rows]
              plgpu.wgmma(acc_ref, a_op, b_ring.at[slot, cols].T)
            return acc_ref[...]   # waits for the wgmmas
          part = pl.run_scoped(block, plgpu.ACC((TILE_M, cfg.tile_n), jnp.float32))
          if last_sub:      # every sub-tile has read these chunks: release their slots
            for c in chunks:
              plgpu.barrier_arrive(empty.at[lax.rem(i * n_chunks + c, stages)])
          if pq and last_sub and kb == n_blocks - 1:   # every wgmma of the tile has read the fp8 rows
            plgpu.barrier_arrive(a_empty.at[ab])
          if fuse and not regs and not pq and kb == 0 and si == 0:
            # The bf16 tile may be overwritten. Released after the first block's wgmmas have completed rather than
            # right after the quantization: interpret mode does not order this arrive after the SMEM loads
            # without a data dependence (it reported a race); on the GPU the two places are equivalent.
            plgpu.barrier_arrive(a_empty.at[ab])
          total = total + part * w_scales[si][kb]

        if fuse or per_token:
          out = total * plgpu.layout_cast(lax.broadcast_in_dim(a_scale, total.shape, [0]), plgpu.Layout.WGMMA)
        else:
          out = total * a_scale
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the previous store has read the staging tile
        o_smem.at[wg][...] = out.astype(jnp.bfloat16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            o_smem.at[wg], o_gmem.at[pl.ds(m0 + wi_m * TILE_M, TILE_M), h,
                                     pl.ds(n_idx * cfg.cta_n + sub * cfg.tile_n, cfg.tile_n)])

    plgpu.wait_smem_to_gmem(0)


@functools.lru_cache(maxsize=64)
def build(t: int, h: int, k: int, n: int, per_token: bool, cfg: TuningConfig, interpret=False):
  """Build the kernel for given shapes.

  Kernel arguments (``cfg.quantize_k is None``):
    a8  [T8, H, K] fp8: quantized activations, T8 = T rounded up to a multiple of 8 (zero rows): the TMA box of
      a swizzled tile tiles the GMEM rows by 8 and Mosaic GPU rejects a row count that is not a multiple.
    as_ [H, T_pad] f32 (per_token; T_pad = T rounded up to the CTA's rows, padded with 1.0) or [1] f32.
    w   [H, N, K] fp8: K-major weights.
    ws  [H, ceil(K/128), N/128] f32: weight block scales.
  With ``cfg.quantize_k == K`` (per_token only): ``a [T8, H, K]`` bfloat16 (T8 = T for T < 8, else T rounded up
  to a multiple of 8 with zero rows: a GMEM row count below 8 is accepted, the box's rows past it read zeros),
  ``w``, ``ws``.
  Returns out [T, H, N] bfloat16.
  Raises NotImplementedError for shapes the kernel does not take (see :func:`check_shapes`).
  """
  check_shapes(t, h, k, n, cfg)
  fuse = cfg.quantize_k is not None
  if fuse and not per_token:
    raise ValueError("TuningConfig.quantize_k needs per-token activation scales (act_scale='per_token')")
  kwargs = common.interpret_kwargs(interpret)
  m_tiles, n_tiles = -(-t // cfg.cta_m), n // cfg.cta_n
  num_tiles = m_tiles * n_tiles * h
  grid = min(num_tiles, cfg.max_ctas)
  regs = fuse and cfg.a_registers and not interpret   # interpret mode has no register-A wgmma: the SMEM path
  # interpret mode has no inline_mgpu: producer_quant runs the consumers' SMEM-tile quantization there
  pq_rows = t if cfg.producer_quant and not interpret else 0
  body = functools.partial(_body, cfg, k, bool(per_token), m_tiles, n_tiles, num_tiles, grid, regs, pq_rows)
  # A swizzled output tile avoids 8-way bank conflicts in the register -> SMEM store, but its TMA store tiles the
  # GMEM rows by 8, which Mosaic GPU only accepts when T % 8 == 0 or T < 8; other T use a linear staging tile.
  out_transforms = swizzled(jnp.bfloat16, 128) if t % 8 == 0 or t < 8 else ()
  k_chunks = k // CHUNK
  if pq_rows:
    a_scratch = [
        plgpu.SMEM((cfg.a_buffers, k_chunks, TILE_M, CHUNK), FP8, transforms=swizzled(FP8, CHUNK)),   # fp8 A
        plgpu.SMEM((cfg.a_buffers, TILE_M), jnp.float32),                                           # row scales
    ]
  elif fuse:
    a_scratch = [
        plgpu.SMEM((cfg.a_buffers, k_chunks, cfg.cta_m, CHUNK), jnp.bfloat16,
                   transforms=swizzled(jnp.bfloat16, 128)),                                      # bf16 A tiles
    ]
    if not regs:
      a_scratch += [plgpu.SMEM((2, k_chunks, TILE_M, CHUNK), FP8, transforms=swizzled(FP8, CHUNK))]   # fp8 A
  else:
    a_scratch = [plgpu.SMEM((cfg.stages, cfg.cta_m, CHUNK), FP8, transforms=swizzled(FP8, CHUNK))]   # A ring
  barriers = [
      plgpu.Barrier(num_arrivals=(0 if fuse else 1) + -(-cfg.cta_n // B_BOX_ROWS),   # full: the chunk's TMAs
                    num_barriers=cfg.stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=cfg.stages),   # empty: both consumers released it
  ]
  if fuse:
    barriers += [plgpu.Barrier(num_arrivals=1 if pq_rows else k_chunks,               # a_full: the A tile's TMAs
                               num_barriers=cfg.a_buffers),                          # (or the producer's rows)
                 plgpu.Barrier(num_arrivals=2, num_barriers=cfg.a_buffers)]          # a_empty: both consumers
    if cfg.share_quant and not regs:
      barriers += [plgpu.Barrier(num_arrivals=2, num_barriers=1)]                     # q_ready: both halves
  return plgpu.kernel(
      body,
      out_type=jax.ShapeDtypeStruct((t, h, n), jnp.bfloat16),
      grid=(grid,), grid_names=("cta",),
      num_threads=3, thread_name="wg",
      scratch_types=a_scratch + [
          plgpu.SMEM((cfg.stages, cfg.cta_n, CHUNK), FP8, transforms=swizzled(FP8, CHUNK)),   # B ring
          plgpu.SMEM((2, TILE_M, cfg.tile_n), jnp.bfloat16, transforms=out_transforms),           # out
      ] + barriers,
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE),
      **kwargs,
  )
