"""RoPE + RMS norm of new MLA tokens, with an optional fused FP8 quantization and paged-cache write (sm_90a).

What the CTAs compute (grid (b, j): b = blocks of ``TB = 64`` tokens, j < q_splits; one warpgroup per CTA)
--------------------------------------------------------------------------------------------------------
For the tokens ``t0 = b · 64 .. t0 + n_valid`` (``n_valid = min(64, T − t0)``), CTA (b, 0) computes the latent and
k_rope rows, and CTA (b, j) the q tiles j, j + q_splits, ... of the block:

    latent  y = x · rsqrt(sum(x²)/512 + eps) · w          x = kv[t, :512] (bf16 → f32), RMS over 512, f32 math
    k_rope  y = x · C + swap(x) · S                         x = kv[t, 512:]
    q_rope  y = x · C + swap(x) · S                         every head of q_rope[t]

    fused:   row8 = fp8(clip((latent ‖ k_rope) · f32(1/kv_scale), ±448)) → pages[slot[t]] (per-row TMA, 576 B)
    unfused: kv_out[t] = bf16(latent ‖ k_rope)
    both:    q_out[t]  = bf16(q_rope)

q_rope is processed as 64-row tiles of its flat [T · H, 64] view through a ring of ``stages`` SMEM tiles (TMA in,
TMA out): H % 64 == 0 gives H/64 tiles per token; for H | 64 a tile holds the heads of 64/H consecutive tokens and
its table tile is assembled from 64/H broadcast rows with selects on the row index.

RoPE as a permutation: ``swap`` exchanges the two members of every rotation pair (DeepSeek interleaved pairs
(2i, 2i+1), or NeoX halves (i, i+32)); C and S are the per-token tables arranged per column, S carrying the sign
(interleaved: C = [c0 c0 c1 c1 ..], S = [−s0 s0 −s1 s1 ..]; NeoX: C = [c ‖ c], S = [−s ‖ s]). Then
``y = x·C + swap(x)·S`` performs exactly the reference's float32 operations ``(a cos − b sin, a sin + b cos)``
(negation is exact and f32 addition commutes), so it is bitwise equal wherever neither side contracts a product
and a sum into an FMA (XLA:CPU does in the jitted reference; interpret mode does not). The pair swap is done by
the tensor cores: one bf16 wgmma ``x @ P`` with the 0/1 permutation matrix P (64 × 64) gives swap(x) exactly (one
product by 1, the rest exact zeros, f32 accumulator).
Register layouts have no intra-thread column shuffle, and the alternatives (u32 views of bf16 pairs) need
width-changing bitcasts that XLA materialises as copies. Caveat: a NaN/inf in one rope value poisons its whole
64-wide row (NaN·0 in the permutation product) where the reference poisons only its pair.

Inputs are prepared by :mod:`mla_pallas.ops.rope_rmsnorm` (one small fused XLA pre-pass): the tables are gathered
per token (positions clamped) and arranged as C/S above, ``[Tp, 64]`` f32 with ``Tp = 64 · num_blocks``; kv is
padded to a multiple of 8 rows (>= 64) when T is not (TMA into a swizzled tile needs it; a copy of kv only then);
slots are
sanitised (−1 for skipped tokens, and for every token but the last of a duplicated slot, so no two CTAs write the
same slot). The cache update is in place: the op passes ``pages`` as a mutable ref (``jax.new_ref``), which
``plgpu.kernel`` turns into an input/output alias of the custom call, and donates it.

Summation order: the RMS sum is a per-64-column tree reduction, then a sum over the 8 chunks; XLA's order differs,
so ``rsqrt`` may differ by an f32 ulp and, rarely, a quantized value lands one e4m3 step (or a bf16 output one
ulp) away from the reference. On the GPU the compiler may also contract ``x·C + swap·S`` into an FMA.

Memory-bound target: per token the kernel reads 1152 B (kv) + 512 B (tables) + H·128 B (q) and writes 576 B
(fp8 row) or 1152 B (kv_out) + H·128 B (q_out): at H = 128, ~34 KB per token, dominated by q_rope. Goal (issue 4):
≥ 80 % of the device-copy bandwidth for T ≥ 4096. Expected limiter: one warpgroup per CTA and a 3-deep ring of
8 KB q tiles (24 KB of loads in flight per SM; ~35 KB are needed to cover HBM latency at 4.8 TB/s on 132 SMs),
so a first version should reach roughly 60-80 %; more stages (or a smaller latent buffer, two CTAs per SM)
are the knobs. Measured on an H200 (2026-11-30, benchmarks/RESULTS.md; GPU tests pass): at T = 4096, H = 128
50 % (fused) / 57 % (unfused) of the same-run copy bandwidth, 1.39x / 1.44x faster than XLA; slower than XLA at
T = 128 (19.2 vs 8.9 µs: CTA 0's serial latent chain is the whole time) and at H = 16 (88.6 vs 85.4 µs at
T = 8192: the latent part dominates and runs on one CTA per 64 tokens). ``impl="auto"`` uses the kernel only
for T >= 4096 with H >= 128. Next: split the latent rows of a block over its CTAs, a persistent grid.

Lowering semantics: Lane. The first version used Warpgroup semantics and failed on the H200 (2026-11-30): the fp8
rows are stored into the strided views ``rows.at[:, c]`` of the 640-byte-slot staging buffer, and JAX 0.11.2's
Warpgroup lowering writes chunks c >= 2 to the wrong place (the same defect as its strided *loads*,
../shared/mgpu/README.md section 6); interpret mode and CPU lowering cannot see it. Lane handles strided views
correctly. Register layouts are given explicitly (``Layout.WGMMA`` tiles, ``WGMMA.reduce(0)`` column vectors); the
unswizzled f32 table tiles are loaded with ``optimized=False`` (Lane finds no bank-conflict-free plan for them).
The q loop reads its token's table row from the SMEM tables (under Warpgroup semantics such a row load sent
layout inference into an endless search; Lane has no layout inference), and the fused row loop reads the slots
from SMEM: the first H200 run read both from GMEM and paid ~1 µs of exposed latency per row/tile.

SMEM budget (bytes, TB = 64, stages = 3)
----------------------------------------
    kv block (9 × 64 × 64 bf16, swizzled)          73 728   (unfused: reused as the kv_out staging)
    C, S tables (2 × 64 × 64 f32)                  32 768
    norm weight (8 × 64 f32)                        2 048
    P (64 × 64 bf16, swizzled)                      8 192
    q ring (stages × 64 × 64 bf16, swizzled)       24 576
    q_out ring (stages × 64 × 64 bf16, swizzled)   24 576
    fp8 rows (64 × 640, fused only)                40 960
    slots (64 int32, fused only)                      256
    barriers, scalars                                ~100
    total                                         ~207 KB fused, ~166 KB unfused (limit 227 KB)
"""
from __future__ import annotations

import dataclasses
import functools
import types

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common
from mla_pallas.kernels.common import CHUNK, D_QK, FP8, N_CHUNKS, SLOT_CHUNKS, swizzled
from mla_pallas.quant import FP8_MAX

TB = 64            # tokens per CTA (rows of the latent tile) = rows of one q tile (64 heads)
D_ROPE = 64
BF16 = jnp.bfloat16
# Explicit register layouts: with inference alone, lowering (layout inference) did not finish in 10 minutes.
TILE_LAYOUT = plgpu.Layout.WGMMA            # every [64, 64] register tile
COL_LAYOUT = plgpu.Layout.WGMMA.reduce(0)   # a [64] vector broadcast along rows (per-column values)


def _tile(ref, optimized=True):
  return plgpu.load(ref, layout=TILE_LAYOUT, optimized=optimized)


def _cols(ref, optimized=True):
  return plgpu.load(ref, layout=COL_LAYOUT, optimized=optimized)


@dataclasses.dataclass(frozen=True)
class TuningConfig(common.TuningConfigBase):
  """Tuning knobs of the rope/rmsnorm kernel.

  stages: depth of the q-tile ring (64 × 64 bf16 tiles in and out).
  q_splits: CTAs per 64-token block (grid axis "j"); CTA j takes q tiles j, j + q_splits, ...; CTA 0 also does
    the latent/k_rope part. None: chosen by :func:`default_q_splits` from T and H to fill the SMs.
  """
  stages: int = 3
  q_splits: int | None = None

  def validate(self):
    if self.stages > 8:
      raise ValueError(f"TuningConfig.stages must be <= 8; got {self.stages}")
    if self.q_splits is not None and not 1 <= self.q_splits <= 64:
      raise ValueError(f"TuningConfig.q_splits must be None or in [1, 64]; got {self.q_splits}")
    for fused in (False, True):
      self.check_smem(smem_budget(self, fused), f" (fused={fused})")


def smem_budget(cfg: TuningConfig, fused: bool) -> int:
  return common.smem_bytes(
      ((N_CHUNKS, TB, CHUNK), BF16),                     # kv block
      ((2, TB, D_ROPE), jnp.float32),                    # C, S
      ((N_CHUNKS - 1, CHUNK), jnp.float32),              # norm weight
      ((D_ROPE, D_ROPE), BF16),                          # P
      ((2 * cfg.stages, TB, D_ROPE), BF16),              # q in / out rings
  ) + (common.smem_bytes(((TB, SLOT_CHUNKS, CHUNK), FP8), ((TB,), jnp.int32)) if fused else 0) + 128


def default_q_splits(num_tokens: int, heads: int, num_sms: int = 132) -> int:
  """CTAs per token block: enough for about two CTAs per SM, at most one per 4 q tiles of a block."""
  n_blocks = -(-num_tokens // TB)
  q_tiles = -(-min(num_tokens, TB) * heads // TB)          # q tiles of the first block
  return max(1, min(-(-2 * num_sms // n_blocks), q_tiles // 4, 64))


def _swap(x_sw, p_sw):
  """swap(x) = x @ P, exact in f32 (P a 0/1 permutation): one 64 × 64 × 64 bf16 wgmma."""
  def mma(acc):
    plgpu.wgmma(acc, x_sw, p_sw)
    return acc[...]
  return pl.run_scoped(mma, plgpu.ACC((TB, D_ROPE), jnp.float32))


def _unpack(fused: bool, refs) -> types.SimpleNamespace:
  """Name the kernel's refs: inputs, outputs, scratch (see :func:`build`)."""
  gmem = (("kv", "q", "c", "s", "w", "p", "slots", "scal", "pages", "qo") if fused else
          ("kv", "q", "c", "s", "w", "p", "scal", "qo", "kvo"))
  scratch = ("kv_sw", "cs_smem", "w_smem", "p_sw", "q_sw", "qo_sw") + (("rows", "slots_smem") if fused else ())
  names = gmem + scratch + ("in_bar", "p_bar", "q_full")
  return types.SimpleNamespace(**dict(zip(names, refs, strict=True)))


def _body(fused: bool, num_tokens: int, heads: int, num_slots: int, cfg: TuningConfig, *refs):
  r = _unpack(fused, refs)
  n_split = cfg.q_splits
  b = lax.axis_index("b")
  j = lax.axis_index("j")       # this CTA's share of the block's q tiles: j, j + n_split, ...
  t0 = b * TB
  n_valid = jnp.minimum(TB, num_tokens - t0)
  n_tiles = (n_valid * heads + TB - 1) // TB     # q tiles of this block (the last one may be partial)
  n_steps = (n_tiles - j + n_split - 1) // n_split   # q tiles of this CTA

  # ---- inputs: P and the block's tables (every CTA: p_bar, 3 arrivals); kv (9 chunks), weight and (fused) the
  # block's slots (CTA 0 of the block: in_bar, 10 or 11 arrivals) ----
  plgpu.copy_gmem_to_smem(r.p, r.p_sw, r.p_bar)
  plgpu.copy_gmem_to_smem(r.c.at[pl.ds(t0, TB)], r.cs_smem.at[0], r.p_bar)
  plgpu.copy_gmem_to_smem(r.s.at[pl.ds(t0, TB)], r.cs_smem.at[1], r.p_bar)

  @pl.when(j == 0)
  def _():
    for c in range(N_CHUNKS):
      plgpu.copy_gmem_to_smem(r.kv.at[pl.ds(t0, TB), pl.ds(c * CHUNK, CHUNK)], r.kv_sw.at[c], r.in_bar)
    plgpu.copy_gmem_to_smem(r.w, r.w_smem, r.in_bar)
    if fused:
      plgpu.copy_gmem_to_smem(r.slots.at[pl.ds(t0, TB)], r.slots_smem, r.in_bar)

  def q_row(k):   # first row of this CTA's k-th q tile in the [T * H, 64] view
    return t0 * heads + (j + k * n_split) * TB

  def issue_q(k, slot):
    plgpu.copy_gmem_to_smem(r.q.at[pl.ds(q_row(k), TB)], r.q_sw.at[slot], r.q_full.at[slot])

  for s in range(cfg.stages):      # prologue: fill the q ring while the latent is processed
    @pl.when(s < n_steps)
    def _():
      issue_q(s, s)

  plgpu.barrier_wait(r.p_bar)    # once per CTA (each wait expects the barrier's next phase)

  @pl.when(j == 0)
  def _():
    _latent_and_k_rope(fused, num_slots, r, t0, n_valid)

  _q_rope(heads, cfg.stages, n_split, r, j, n_steps, q_row, issue_q)


def _latent_and_k_rope(fused, num_slots, r, t0, n_valid):
  """RMS norm of the latent and RoPE of k_rope for the block's tokens; fp8 rows to the cache or bf16 kv_out."""
  kv_sw = r.kv_sw
  plgpu.barrier_wait(r.in_bar)
  inv_scale = r.scal[0]
  eps = r.scal[1]

  # ---- RMS norm of the latent (8 chunks of 64 columns) ----
  ss = None
  for c in range(N_CHUNKS - 1):
    x = _tile(kv_sw.at[c]).astype(jnp.float32)
    part = jnp.sum(x * x, axis=1)
    ss = part if ss is None else ss + part
  inv = lax.rsqrt(ss * (1.0 / 512.0) + eps)

  def emit(c, y):   # y: [TB, 64] f32 values of chunk c of the rows
    if fused:
      q8 = jnp.clip(y * inv_scale, -FP8_MAX, FP8_MAX).astype(FP8)
      r.rows.at[:, c][...] = q8
    else:
      kv_sw.at[c][...] = y.astype(BF16)    # in place: each thread rewrites the elements it just read

  for c in range(N_CHUNKS - 1):
    x = _tile(kv_sw.at[c]).astype(jnp.float32)
    w = _cols(r.w_smem.at[c])
    y = x * lax.broadcast_in_dim(inv, x.shape, [0]) * lax.broadcast_in_dim(w, x.shape, [1])
    emit(c, y)

  # ---- RoPE of the key's rope part ----
  xr = _tile(kv_sw.at[N_CHUNKS - 1]).astype(jnp.float32)
  sw = _swap(kv_sw.at[N_CHUNKS - 1], r.p_sw)
  emit(N_CHUNKS - 1, xr * _tile(r.cs_smem.at[0], False) + sw * _tile(r.cs_smem.at[1], False))
  plgpu.commit_smem()

  if fused:
    @pl.loop(0, n_valid)
    def _(row):
      slot = r.slots_smem[row]   # from SMEM: a scalar GMEM load per row exposed ~1 us of latency each

      @pl.when((slot >= 0) & (slot < num_slots))
      def _():
        plgpu.copy_smem_to_gmem(r.rows.at[pl.ds(row, 1), pl.ds(0, N_CHUNKS)], r.pages.at[pl.ds(slot, 1)])
  else:
    for c in range(N_CHUNKS):
      plgpu.copy_smem_to_gmem(kv_sw.at[c], r.kvo.at[pl.ds(t0, TB), pl.ds(c * CHUNK, CHUNK)])


def _q_rope(heads, stages, n_split, r, j, n_steps, q_row, issue_q):
  """RoPE of this CTA's q tiles through the ring.

  q is processed as tiles of 64 consecutive rows of the flat [T · H, 64] view: H >= 64 (H % 64 == 0): H / 64
  tiles per token; H < 64 (H | 64): one tile holds the heads of g = 64 / H consecutive tokens.
  """
  q_sw, qo_sw, q_full = r.q_sw, r.qo_sw, r.q_full
  hb = max(heads // TB, 1)                  # q tiles per token (H >= 64)
  g = max(TB // heads, 1)                   # tokens per q tile (H < 64)

  @pl.loop(0, n_steps)
  def _(k):
    i = j + k * n_split                     # the tile's index within the block
    slot = lax.rem(k, stages)
    plgpu.barrier_wait(q_full.at[slot])
    x = _tile(q_sw.at[slot]).astype(jnp.float32)
    sw = _swap(q_sw.at[slot], r.p_sw)
    # The token's table row (block-local token index), read from the SMEM tables.
    def table(tab_smem):
      def row(tok):
        return lax.broadcast_in_dim(_cols(tab_smem.at[tok], optimized=False), x.shape, [1])
      if g == 1:
        return row(i // hb)
      head_row = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, x.shape, 0), TILE_LAYOUT)
      out = row(i * g)
      for u in range(1, g):   # rows [u H, (u + 1) H) belong to the tile's u-th token
        out = jnp.where(head_row >= u * heads, row(i * g + u), out)
      return out
    c = table(r.cs_smem.at[0])
    s = table(r.cs_smem.at[1])
    y = (x * c + sw * s).astype(BF16)
    plgpu.wait_smem_to_gmem(stages - 1, wait_read_only=True)   # the store issued from this slot has read it
    qo_sw[slot] = y
    plgpu.commit_smem()   # fence + warpgroup barrier: q_sw[slot] fully read, qo_sw[slot] visible to TMA
    plgpu.copy_smem_to_gmem(qo_sw.at[slot], r.qo.at[pl.ds(q_row(k), TB)])

    @pl.when(k + stages < n_steps)
    def _():
      issue_q(k + stages, slot)

  plgpu.wait_smem_to_gmem(0)


def kv_rows_for(num_tokens: int) -> int:
  """Rows of the kv argument: T rounded up to a multiple of 8 (TMA into the swizzled tile needs it), >= 64."""
  return max(-(-num_tokens // 8) * 8, TB)


def q_rows_for(num_tokens: int, heads: int) -> int:
  """Rows of the flat q argument/result: T · H rounded up to a multiple of 8, >= 64 (a copy only for small H)."""
  return max(-(-(num_tokens * heads) // 8) * 8, TB)


@functools.lru_cache(maxsize=64)
def build(num_tokens: int, heads: int, num_slots: int, fused: bool, cfg: TuningConfig = TuningConfig(),
          interpret=False):
  """Build the kernel for T = num_tokens tokens of H = heads query heads (H % 64 == 0 or 64 % H == 0).

  Kernel arguments (Tk >= T rows of kv; Tp = 64 · ceil(T / 64)):
    kv    [Tk, 576] bf16, Tk = kv_rows_for(T) (the op pads; rows past Tk of the last block are TMA zero-fill).
    q     [Tq, 64] bf16: q_rope flattened, Tq = q_rows_for(T, H) >= T · H (zero padded by the op).
    C, S  [Tp, 64] f32: per-token RoPE tables arranged per column (module docstring).
    w     [8, 64] f32: norm weight.
    P     [64, 64] bf16: the pair-swap permutation.
    fused only: slots [Tp] int32 (sanitised, −1 = skip); pages ref [num_slots, 9, 64] fp8 (aliased, written).
    scal  [2] f32: (1 / kv_scale rounded to f32, eps).
  Returns q_out [Tq, 64] bf16 (rows past T · H are padding), and (unfused) kv_out [Tk, 576] bf16.
  """
  if heads % TB and TB % heads:
    raise ValueError(f"heads must be a multiple or a divisor of {TB}; got {heads}")
  if cfg.q_splits is None:
    cfg = dataclasses.replace(cfg, q_splits=default_q_splits(num_tokens, heads))
  body = functools.partial(_body, bool(fused), num_tokens, heads, num_slots, cfg)
  kwargs = common.interpret_kwargs(interpret)
  n_blocks = -(-num_tokens // TB)
  kv_rows = kv_rows_for(num_tokens)
  out_type = [jax.ShapeDtypeStruct((q_rows_for(num_tokens, heads), D_ROPE), BF16)]
  if not fused:
    out_type.append(jax.ShapeDtypeStruct((kv_rows, D_QK), BF16))
  scratch = [
      plgpu.SMEM((N_CHUNKS, TB, CHUNK), BF16, transforms=swizzled(BF16, 128)),       # kv block
      plgpu.SMEM((2, TB, D_ROPE), jnp.float32),                                      # C, S
      plgpu.SMEM((N_CHUNKS - 1, CHUNK), jnp.float32),                                # norm weight
      plgpu.SMEM((D_ROPE, D_ROPE), BF16, transforms=swizzled(BF16, 128)),            # P
      plgpu.SMEM((cfg.stages, TB, D_ROPE), BF16, transforms=swizzled(BF16, 128)),   # q ring
      plgpu.SMEM((cfg.stages, TB, D_ROPE), BF16, transforms=swizzled(BF16, 128)),   # q_out ring
  ]
  if fused:
    scratch += [plgpu.SMEM((TB, SLOT_CHUNKS, CHUNK), FP8),                          # fp8 rows, 640-B slots
                plgpu.SMEM((TB,), jnp.int32)]                                        # the block's slots
  scratch += [plgpu.Barrier(num_arrivals=N_CHUNKS + 1 + int(fused)),                 # in_bar
              plgpu.Barrier(num_arrivals=3),                                         # p_bar
              plgpu.Barrier(num_barriers=cfg.stages)]                                # q_full
  return plgpu.kernel(
      body,
      out_type=tuple(out_type),
      grid=(n_blocks, cfg.q_splits), grid_names=("b", "j"),
      scratch_types=scratch,
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE),
      **kwargs,
  )
