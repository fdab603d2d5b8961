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
      part  = a8[rows, h, kb] · w8[h, cols, kb]ᵀ     fp8 wgmma into a fresh f32 accumulator (64 x tile_n)
      total = total + part · w_scale[h, kb, nb]       promotion in f32 registers (DeepSeek style)
    out = bf16(total · a_scale)                       a_scale per row or one scalar

so each fp8 wgmma chain is at most 128 long (Hopper's fp8 accumulation is below f32 precision, see
../shared/mgpu/README.md section 11) and the block sums are added in f32, in the same order as the XLA path of
:mod:`mla_pallas.ops.bmm_fp8`.

Operands
--------
* ``w [H, N, K]`` fp8, **K-major**: FP8 wgmma on Hopper only takes K-major operands (B stored (N, K), passed as
  ``.T``; ../shared/mgpu/README.md section 5). :func:`mla_pallas.ops.bmm_fp8.prepare_weight` makes this layout.
* ``w_scale [H, ceil(K/128), N/128]`` f32, read as scalars.
* ``a``: either fp8 quantized by the op's XLA pre-pass (``quantize_k=None``) or bf16 quantized in the kernel
  (``quantize_k=K``, per-token scales; ``a_quant`` picks who quantizes, see below). Either way ``a`` is read *in
  place* as ``a.at[rows, h, k-chunk]`` TMA boxes or loads (the [H, T, K] view costs no transpose).

K is consumed in 64-wide chunks (64-byte swizzle), so K % 64 == 0 needs no padding (K = 192: blocks of 2 and 1
chunks). Outputs go through SMEM and one TMA store per sub-tile into ``out [T, H, N]`` bf16 directly; the TMA unit
clips rows past T.

Quantization of ``a`` (one of four designs per launch)
------------------------------------------------------
Every in-kernel design computes the float32 operations of :func:`mla_pallas.quant.quantize_rows_fp8` (row amax,
``scale = amax · f32(1/448)`` or 1 for an all-zero row, ``fp8(x · (1 / scale))`` saturated to ±448), so the fp8
bytes, and the outputs, are bitwise those of the pre-pass design.

* pre-pass (``quantize_k=None``): the producer TMAs the A chunk of all CTA rows next to the B chunk into each
  ring slot; row scales come from GMEM ([H, T_pad] f32) or one per-tensor scalar.
* ``a_quant="smem"``: per tile the producer TMAs the CTA's bf16 rows of all of K (``a_buffers`` 128-byte-swizzled
  tiles, so the next tile's rows load during this one's MMAs); each consumer quantizes its 64 rows into its own
  64-byte-swizzled fp8 SMEM tile (one SMEM pass holding the bf16 chunks in registers for K <= MAX_REGISTER_K, two
  passes above), keeps the row scales in registers and fences before its wgmmas. The ring carries only B chunks.
* ``a_quant="registers"`` (K <= MAX_REGISTER_K): as "smem", but each consumer loads its rows in
  ``Layout.WGMMA_8BIT`` (16 registers per 64-wide chunk per thread), quantizes in registers
  (``cvt.rn.satfinite.e4m3x2``) and passes the fp8 chunks as the wgmmas' *register* A operand: no fp8 tile, no
  SMEM stores; the bf16 tile is released as soon as it is in registers, after a proxy fence (``commit_smem``: the
  producer's next TMA into the tile, async proxy, must follow the consumers' register loads, generic proxy).
* ``a_quant="producer"`` (T <= bmm_row_quant.MAX_ROWS, K <= bmm_row_quant.MAX_K): after issuing the first ring-full
  of B chunks, the producer warpgroup quantizes only the T real rows straight from GMEM
  (:mod:`mla_pallas.kernels.bmm_row_quant`, one warp per row) into an fp8 SMEM tile plus a [64] f32 scale row,
  fences and arrives on ``a_full``; both consumers read that tile as their SMEM A operand and release it
  (``a_empty``) after their last block. Tile rows past T are never written: their output rows are dropped by the
  TMA store.
* "producer" with ``build(merge=(S, tiles_per_token))`` (the decode graph's W_UV after split-KV attention): A's
  rows are the lse-weighted merge of S attention partials (f32, [T · tiles, S, 64, K]) that the producer's four
  warps read and weigh (bmm_row_quant.merge_rows: each warp a quarter of the splits, sums met in a [2, 4, K + 4]
  f32 SMEM scratch, one warp per row quantizing); ``stages = K / 64`` (ops.bmm_fp8.merge_config) so that the whole
  weight tile loads while it runs. The merged rows never go to GMEM and no merge launch runs.

Interpret mode has neither a register-A wgmma nor ``inline_mgpu``: there "producer" runs the "smem" design (same
fp8 bytes), and "registers" runs its register quantization and its fenced release of the bf16 tile (so the race
check covers them) but stores the fp8 chunks into the consumer's SMEM tile for SMEM-operand wgmmas; the register
A operand and "producer" are checked by sm_90 lowering on the CPU and bitwise on the GPU.

Another kernel's CTAs in the same launch (``build(side=...)``)
------------------------------------------------------------
An independent one-warpgroup job (the decode step's cache write, ``kernels.rope_direct.CacheWriteCTAs``) can run
as ``side.ctas`` extra CTAs after the product's grid: their warpgroup 0 runs the job's body, the other two do
nothing; they hold the product's SMEM allocation like every CTA of the launch (one CTA per SM at its budget), so
the op keeps the job small (``ops.prologue.CO_LAUNCH_MAX_SIDE_CTAS``). No barrier or SMEM is shared with the
product.

Warpgroup roles (``num_threads=3``, Lane semantics)
---------------------------------------------------
* WG2 — producer (40 registers; 56 with ``a_quant="producer"``, 120 when it merges): for every tile and K chunk (ring position g),
  waits for slot ``g % stages`` to be released, then issues the chunk's TMAs arriving on ``full[slot]`` (the bf16
  A tile's TMAs arrive on ``a_full``); finally drains ``empty`` / ``a_empty`` (interpret-mode barrier rule).
* WG0, WG1 — consumers (232 registers; 224 with "producer", 192 with the merge): per tile, first load the weight block scales (and
  the row scales) so that their GMEM latency overlaps the operand waits; quantize their rows (in-kernel designs);
  per K block, wait the chunks' ``full`` barriers, issue the wgmmas, read the block accumulator (which waits for
  them), release the chunks (``empty``, after the last sub-tile), promote into ``total``; then scale, cast, wait
  until the previous tile's TMA store has read the staging tile, stage and store.
A setmaxnreg split of the 384 threads must satisfy ``p + 2 c <= 504`` (asserted below), or the consumers'
increase waits forever.

Pipeline: ``stages`` ring slots of one 64-wide K chunk each (the A chunk too with the pre-pass), continuing
across tiles; ``a_buffers`` bf16 A tiles (or fp8 tiles with "producer") with ``a_full`` / ``a_empty`` barriers.

SMEM budget (bytes; :func:`smem_budget`, checked at construction against 227 KB)
--------------------------------------------------------------------------------
    B ring             stages · cta_n · 64 fp8           4 x 256 x 64 = 65 536 ("n"), 4 x 128 x 64 = 32 768 ("m")
    A ring (pre-pass)  stages · cta_m · 64 fp8           4 x 64 x 64 = 16 384 ("n"), 32 768 ("m")
    bf16 A tiles       a_buffers · cta_m · K · 2         "smem" / "registers"; K = 512, 64 rows: 65 536 per buffer
    fp8 A tiles        2 · 64 · K ("smem"), a_buffers · 64 · K + 256 ("producer")
    output staging     2 · 64 · tile_n bf16              32 768 (tile_n = 128)
    merge sums         2 · 4 · (K + 4) f32               16 512 (K = 512; only with ``merge``)
    barriers, Mosaic reduction scratch                   ~2 100
Default pre-pass config: ~117 KB ("n") / ~100 KB ("m"). One CTA per SM (the register split takes the whole
register file); latency is hidden by the persistent ring instead of by co-resident CTAs.
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
PQ_CONSUMER_REGS = 224   # a_quant="producer": the producer runs bmm_row_quant, the consumers hold no fp8 rows
PQ_PRODUCER_REGS = 56
MERGE_CONSUMER_REGS = 192   # merge=: the producer holds MERGE_SPLITS_PER_LOAD partials' loads (64 registers) ...
MERGE_PRODUCER_REGS = 120   # ... besides its sums
# setmaxnreg: 128 (168 - p) >= 256 (c - 168), 168 = the launch's 65536 / 384 rounded down to 8
assert PRODUCER_REGS + 2 * CONSUMER_REGS <= 504 and PQ_PRODUCER_REGS + 2 * PQ_CONSUMER_REGS <= 504
assert MERGE_PRODUCER_REGS + 2 * MERGE_CONSUMER_REGS <= 504
MAX_REGISTER_K = 512   # bf16 rows held in registers: 8 chunks x 16 registers of bf16 pairs per thread
A_QUANTS = ("smem", "registers", "producer")


@dataclasses.dataclass(frozen=True)
class TuningConfig(common.TuningConfigBase):
  """Frozen config of the sm_90 FP8 bmm kernel (checked at construction, SMEM included).

  stages: ring slots, each one 64-wide K chunk of the CTA's B columns (and A rows with the pre-pass).
  wg_split: "n" (the two consumers split the columns: CTA tile 64 x 2 tile_n sub_n) or "m" (they split 128 rows:
    CTA tile 128 x tile_n).
  tile_n: columns of a consumer's sub-tile (its wgmma N): 128 (one weight scale block) or 64 (the two consumers'
    sub-tiles of wg_split "n" then share one scale block: CTA tile 64 x 128).
  sub_n: 64 x ``tile_n`` sub-tiles per consumer along N (wg_split "n" only): 2 makes the CTA tile 64 x 512, the
    tile's K chunks staying in the ring until the last sub-tile (needs K / 64 <= stages).
  max_ctas: persistent grid size (the op passes the device's SM count).
  quantize_k: None (``a`` quantized by the op's XLA pre-pass) or K: the kernel reads bf16 ``a`` and quantizes it
    per (t, h) row (per-token scales only). The value is K, so that the SMEM budget can be checked here.
  a_quant: who quantizes with ``quantize_k`` (module docstring): "smem" (each consumer, into its fp8 SMEM tile),
    "registers" (each consumer, into the wgmmas' register A operand; quantize_k <= MAX_REGISTER_K) or "producer"
    (the producer warpgroup, the T <= bmm_row_quant.MAX_ROWS real rows of the single M tile; wg_split "n",
    quantize_k <= bmm_row_quant.MAX_K). Must be "smem" without ``quantize_k``.
  a_buffers: A tiles in flight with ``quantize_k`` (2: the next tile's rows load while this one is multiplied;
    1 where two do not fit in SMEM). Ignored without ``quantize_k``.
  """
  stages: int = 4
  wg_split: str = "n"
  tile_n: int = 128
  sub_n: int = 1
  max_ctas: int = 132
  quantize_k: int | None = None
  a_quant: str = "smem"
  a_buffers: int = 2

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
    if self.a_quant not in A_QUANTS:
      raise ValueError(f"TuningConfig.a_quant must be one of {A_QUANTS}; got {self.a_quant!r}")
    if self.a_quant != "smem" and self.quantize_k is None:
      raise ValueError(f"TuningConfig.a_quant={self.a_quant!r} needs in-kernel quantization (quantize_k=K)")
    if self.a_quant == "registers" and self.quantize_k > MAX_REGISTER_K:
      raise ValueError(f"TuningConfig.a_quant='registers' needs quantize_k <= {MAX_REGISTER_K}; "
                       f"got {self.quantize_k}")
    if self.a_quant == "producer" and (self.quantize_k > bmm_row_quant.MAX_K or self.wg_split != "n"):
      raise ValueError(f"TuningConfig.a_quant='producer' needs quantize_k <= {bmm_row_quant.MAX_K} and "
                       f"wg_split='n'; got quantize_k={self.quantize_k}, wg_split={self.wg_split!r}")
    self.check_smem(smem_budget(self))

  @property
  def register_quant(self) -> bool:
    """The "smem" design holds the bf16 rows in registers between row amax and quantization (one SMEM pass)."""
    return self.quantize_k is not None and self.quantize_k <= MAX_REGISTER_K

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
  elif cfg.a_quant == "producer":
    a_bufs = (((cfg.a_buffers, cfg.quantize_k // CHUNK, TILE_M, CHUNK), FP8),  # fp8 A tiles (producer's rows)
              ((cfg.a_buffers, TILE_M), jnp.float32))                          # their row scales
  else:
    k_chunks = cfg.quantize_k // CHUNK
    a_bufs = (((cfg.a_buffers, k_chunks, cfg.cta_m, CHUNK), jnp.bfloat16),)   # bf16 A tiles (whole K)
    if cfg.a_quant == "smem":
      a_bufs += (((2, k_chunks, TILE_M, CHUNK), FP8),)                        # fp8 A per consumer
  return common.smem_bytes(
      *a_bufs,
      ((cfg.stages, cfg.cta_n, CHUNK), FP8),            # B ring
      ((2, TILE_M, cfg.tile_n), jnp.bfloat16),          # output staging
  ) + 2 * 16 * 8 + 2 * 8 + 2048   # barriers; Mosaic reduction scratch (CompilerParams default)


def merge_scratch_bytes(k: int) -> int:
  """SMEM of the producer's merge sums (``build(merge=...)``): [2, 4, K + 4] f32."""
  return 2 * 4 * (k + 4) * 4


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
  if cfg.a_quant == "producer" and t > bmm_row_quant.MAX_ROWS:
    raise NotImplementedError(f"TuningConfig.a_quant='producer' quantizes at most {bmm_row_quant.MAX_ROWS} rows (one "
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


def _quantize_rows(a_bf, a8, rows, *, in_registers=False):
  """In-kernel per-row quantization of one consumer's 64 rows (``rows``) of the bf16 tile ``a_bf``
  ([K/64, cta_m, 64], linear) into its fp8 tile ``a8`` ([K/64, 64, 64], 64-byte swizzle), with exactly the
  float32 operations of :func:`mla_pallas.quant.quantize_rows_fp8`: amax = max |x| over the row,
  scale = amax * f32(1/448) (1 for an all-zero row), x8 = fp8(clip(x * (1 / scale), ±448)).

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

  for c in range(k_chunks):
    x = (held[c] if in_registers else load(c)).astype(jnp.float32)
    q = x * lax.broadcast_in_dim(inv, x.shape, [0])
    a8.at[c][...] = jnp.clip(q, -FP8_MAX, FP8_MAX).astype(FP8)
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
  # +-448, NaN stays NaN), which is what clip(., +-448) followed by the conversion gives. The SMEM design keeps the
  # clip: interpret mode converts with XLA, where values past the e4m3 range become NaN.
  chunks = [(x.astype(jnp.float32) * inv).astype(FP8) for x in held]
  return chunks, scale


def _body_with_side(side, n_inputs: int, grid: int, body, *refs):
  """CTAs below ``grid`` run ``body`` (the product) on their refs; the ``side.ctas`` CTAs after them run
  ``side.run`` in warpgroup 0 on the side's refs (:func:`build`'s ``side``). ``refs``: the product's
  ``n_inputs`` inputs, the side's inputs, the product's output, the side's outputs, the scratch."""
  refs = list(refs)
  n_side_in, n_side_out = side.N_INPUTS, len(side.out_types())
  out_at = n_inputs + n_side_in
  side_refs = refs[n_inputs:out_at] + refs[out_at + 1:out_at + 1 + n_side_out]
  own = refs[:n_inputs] + [refs[out_at]] + refs[out_at + 1 + n_side_out:]
  pid = lax.axis_index("cta")

  @pl.when(pid < grid)
  def _():
    body(*own)

  @pl.when(jnp.logical_and(pid >= grid, lax.axis_index("wg") == 0))
  def _():
    side.run(pid - grid, side_refs)


def _body(cfg: TuningConfig, k: int, per_token: bool, m_tiles: int, n_tiles: int, num_tiles: int, grid: int,
          design: str, t: int, interpret: bool, merge, *refs):
  """Kernel body; ``design``: "prepass" or the a_quant design that runs here (interpret mode: "smem" for
  "producer"; "registers" with its fp8 chunks staged in SMEM for the wgmmas, ``interpret``); ``merge``: None, or
  (splits, tiles_per_token) when "producer" merges split-KV partials into its rows (:func:`build`)."""
  fuse = design != "prepass"
  pq = design == "producer"
  regs = design == "registers"
  if merge is not None:   # A = the merge of attention partials [T tiles, S, 64, K] f32 by their lse
    (parts_gmem, lse_gmem, w_gmem, ws_gmem, o_gmem, a8, a_sc, acc_smem, b_ring, o_smem, full, empty, a_full,
     a_empty) = refs
  elif fuse:   # a is bf16 [T, H, K]; no scale input
    (a_gmem, w_gmem, ws_gmem, o_gmem, *a_tiles, b_ring, o_smem, full, empty, a_full, a_empty) = refs
    if pq:       # fp8 A tiles and their row scales, written by the producer
      a8, a_sc = a_tiles
    elif regs and not interpret:   # bf16 A tiles only (the fp8 rows stay in registers)
      (a_bf,) = a_tiles
    else:        # bf16 A tiles, the consumers' fp8 tiles
      a_bf, a8 = a_tiles
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
    plgpu.set_max_registers(MERGE_PRODUCER_REGS if merge is not None else PQ_PRODUCER_REGS if pq else PRODUCER_REGS,
                            action="decrease")

    def quantize_a(i, m0, h):   # "producer": the tile's rows into the fp8 buffer, then a_full
      ab = lax.rem(i, cfg.a_buffers)

      @pl.when(i >= cfg.a_buffers)
      def _():
        plgpu.barrier_wait(a_empty.at[ab])
      if merge is not None:
        bmm_row_quant.merge_rows(parts_gmem, lse_gmem, a8.at[ab], a_sc.at[ab], acc_smem, m0, h, t, merge[1])
      else:
        bmm_row_quant.quantize_rows(a_gmem, a8.at[ab], a_sc.at[ab], m0, h, t)
      plgpu.commit_smem()        # every thread's SMEM stores, visible to the wgmmas (async proxy)
      plgpu.barrier_arrive(a_full.at[ab])

    @pl.loop(0, my_tiles)
    def _(i):
      m0, n_idx, h = _tile_coords(cfg, pid + i * grid, m_tiles, n_tiles)
      n0 = n_idx * cfg.cta_n
      # "producer": after the first ring-full of B chunks (their loads then overlap the row loads; the later
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
    plgpu.set_max_registers(MERGE_CONSUMER_REGS if merge is not None else PQ_CONSUMER_REGS if pq else CONSUMER_REGS,
                            action="increase")
    wi_m = wg if cfg.wg_split == "m" else 0
    wi_n = wg if cfg.wg_split == "n" else 0
    rows = pl.ds(wi_m * TILE_M, TILE_M)
    row_layout = plgpu.Layout.WGMMA.reduce(1)

    @pl.loop(0, my_tiles)
    def _(i):
      m0, n_idx, h = _tile_coords(cfg, pid + i * grid, m_tiles, n_tiles)
      # This consumer's sub-tiles (indices within the CTA tile; sub_n = 1 traces no index arithmetic).
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
          if interpret:   # no register-A wgmma: the fp8 chunks go to this consumer's SMEM tile (fenced below)
            a8_tile = a8.at[wg]
            for c, x in enumerate(a_chunks):
              a8_tile.at[c][...] = x
          # The bf16 tile is in registers: it may be overwritten. The producer's next TMA into it (async proxy)
          # follows our register loads (generic proxy), so a proxy fence goes before the release (on hardware no
          # other fence is on that path; docs/kernels/bmm_fp8.md, "The A tile's proxy fence").
          plgpu.commit_smem()
          plgpu.barrier_arrive(a_empty.at[ab])
        else:
          a8_tile = a8.at[wg]
          a_scale = _quantize_rows(a_bf.at[ab], a8_tile, rows, in_registers=cfg.register_quant)
          plgpu.commit_smem()               # the fp8 stores are visible to the wgmma (async proxy)
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
              a_op = (a_chunks[c] if regs and not interpret else a8_tile.at[c]) if fuse else a_ring.at[slot, rows]
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
def build(t: int, h: int, k: int, n: int, per_token: bool, cfg: TuningConfig, interpret=False,
          merge: tuple[int, int] | None = None, side=None):
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
  With ``merge = (S, tiles_per_token)`` (``a_quant="producer"``, K = bmm_row_quant.MAX_K, not interpret mode: the
  merge is raw PTX): ``parts [T · tiles_per_token, S, 64, K]`` f32 and ``lse [T · tiles_per_token, S, 64]`` f32,
  split-KV attention partials that the producer merges into A's rows (bmm_row_quant.merge_rows), ``w``, ``ws``.
  With ``side`` (e.g. ``kernels.rope_direct.CacheWriteCTAs``: an independent one-warpgroup job with ``side.ctas``
  CTAs, ``side.N_INPUTS`` inputs and ``side.out_types()`` outputs, run by ``side.run(cta, refs)``): the grid gets
  ``side.ctas`` more CTAs after the product's, whose warpgroup 0 runs the side job (the others idle); its inputs
  follow the product's and its outputs follow ``out``. Not in interpret mode (the side jobs are raw PTX).
  Returns out [T, H, N] bfloat16 (with ``side``: the tuple (out, *side outputs)).
  Raises NotImplementedError for shapes the kernel does not take (see :func:`check_shapes`).
  """
  check_shapes(t, h, k, n, cfg)
  fuse = cfg.quantize_k is not None
  if fuse and not per_token:
    raise ValueError("TuningConfig.quantize_k needs per-token activation scales (act_scale='per_token')")
  if merge is not None and (cfg.a_quant != "producer" or k != bmm_row_quant.MAX_K or interpret):
    raise NotImplementedError(f"quantize_and_bmm_fp8: merging split partials needs a_quant='producer', "
                              f"K={bmm_row_quant.MAX_K} and a GPU (raw PTX); got a_quant={cfg.a_quant!r}, K={k}, "
                              f"interpret={bool(interpret)}")
  if merge is not None:
    cfg.check_smem(smem_budget(cfg) + merge_scratch_bytes(k), " with the merge's scratch")
  if side is not None and interpret:
    raise NotImplementedError("quantize_and_bmm_fp8: a side job (raw PTX) cannot run in interpret mode")
  kwargs = common.interpret_kwargs(interpret)
  m_tiles, n_tiles = -(-t // cfg.cta_m), n // cfg.cta_n
  num_tiles = m_tiles * n_tiles * h
  grid = min(num_tiles, cfg.max_ctas)
  # interpret mode has neither a register-A wgmma nor inline_mgpu: "producer" runs "smem" there, "registers" its
  # register quantization and release of the bf16 tile, then stages the fp8 chunks in SMEM for the wgmmas
  design = "prepass" if not fuse else "smem" if interpret and cfg.a_quant == "producer" else cfg.a_quant
  body = functools.partial(_body, cfg, k, bool(per_token), m_tiles, n_tiles, num_tiles, grid, design, t,
                           bool(interpret), merge)
  out_type = jax.ShapeDtypeStruct((t, h, n), jnp.bfloat16)
  launch = grid
  if side is not None:   # the product's inputs: (a | a8, as_ | parts, lse), w, ws
    n_inputs = 3 if fuse and merge is None else 4
    body = functools.partial(_body_with_side, side, n_inputs, grid, body)
    out_type = (out_type, *side.out_types())
    launch = grid + side.ctas
  # A swizzled output tile avoids 8-way bank conflicts in the register -> SMEM store, but its TMA store tiles the
  # GMEM rows by 8, which Mosaic GPU only accepts when T % 8 == 0 or T < 8; other T use a linear staging tile.
  out_transforms = swizzled(jnp.bfloat16, 128) if t % 8 == 0 or t < 8 else ()
  k_chunks = k // CHUNK
  if design == "producer":
    a_scratch = [
        plgpu.SMEM((cfg.a_buffers, k_chunks, TILE_M, CHUNK), FP8, transforms=swizzled(FP8, CHUNK)),   # fp8 A
        plgpu.SMEM((cfg.a_buffers, TILE_M), jnp.float32),                                           # row scales
    ]
    if merge is not None:
      a_scratch += [plgpu.SMEM((2, 4, k + 4), jnp.float32)]   # the producer warps' merge sums (merge_rows)
  elif fuse:
    a_scratch = [
        plgpu.SMEM((cfg.a_buffers, k_chunks, cfg.cta_m, CHUNK), jnp.bfloat16,
                   transforms=swizzled(jnp.bfloat16, 128)),                                      # bf16 A tiles
    ]
    if design == "smem" or interpret:
      a_scratch += [plgpu.SMEM((2, k_chunks, TILE_M, CHUNK), FP8, transforms=swizzled(FP8, CHUNK))]   # fp8 A
  else:
    a_scratch = [plgpu.SMEM((cfg.stages, cfg.cta_m, CHUNK), FP8, transforms=swizzled(FP8, CHUNK))]   # A ring
  barriers = [
      plgpu.Barrier(num_arrivals=(0 if fuse else 1) + -(-cfg.cta_n // B_BOX_ROWS),   # full: the chunk's TMAs
                    num_barriers=cfg.stages),
      plgpu.Barrier(num_arrivals=2, num_barriers=cfg.stages),   # empty: both consumers released it
  ]
  if fuse:
    barriers += [plgpu.Barrier(num_arrivals=1 if design == "producer" else k_chunks,   # a_full: the A tile's
                               num_barriers=cfg.a_buffers),                  # TMAs (or the producer's rows)
                 plgpu.Barrier(num_arrivals=2, num_barriers=cfg.a_buffers)]          # a_empty: both consumers
  return plgpu.kernel(
      body,
      out_type=out_type,
      grid=(launch,), grid_names=("cta",),
      num_threads=3, thread_name="wg",
      scratch_types=a_scratch + [
          plgpu.SMEM((cfg.stages, cfg.cta_n, CHUNK), FP8, transforms=swizzled(FP8, CHUNK)),   # B ring
          plgpu.SMEM((2, TILE_M, cfg.tile_n), jnp.bfloat16, transforms=out_transforms),           # out
      ] + barriers,
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE),
      **kwargs,
  )
