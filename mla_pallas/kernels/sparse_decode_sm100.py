"""Native-FP8 sparse MLA decode for Blackwell (sm_100a): TMA gather4, FP8 re-swizzle, FP8 tcgen05 MMA into TMEM.

Status: **lowered for sm_100a, run in interpret mode, and compiled by ptxas for sm_100a — never run on Blackwell
silicon** (details: docs/kernels/sparse_decode_sm100.md). ``impl="auto"`` therefore never picks it on hardware
(``mla_pallas.ops.sparse_decode``: ``validated_on=("sm90",)``); ``impl="mosaic"`` on a compute-capability-10.x GPU
runs it.

What one CTA computes (same semantics and outputs as the sm_90 kernels)
----------------------------------------------------------------------
One *query tile* of 64 rows (the heads of one query token; H < 64 is zero-padded to 64 rows, H = 128 is two tiles)
against ``tiles_per_split`` tiles of 64 gathered KV rows (one split of the token's top-k):

    S    = Q8 · K8ᵀ                       tcgen05 kind::f8f6f4, M = 64, N = 64, K = 576, f32 accumulator in TMEM
    s    = S · row_scale                  row_scale = q_scale(row) · kv_scale · softmax_scale · log2(e)
    s    = −inf where the key is invalid (index < 0, ≥ num_slots, or past topk_length)
    online softmax in base 2 (m, l per row); O in TMEM rescaled by 2^(m_old − m_new) before each P·V
    P8   = fp8(256 · 2^(s − m))           P in [0, 1] scaled by 256 into e4m3's range
    O   += P8 · V8                        tcgen05 kind::f8f6f4, B = the swizzled KV tile itself: V is MN-major
                                          (tokens, 512), which FP8 tcgen05 accepts; no V transpose (unlike Hopper)
    out  = O · kv_scale / (256 · l),  lse = (m + log2 l) · ln 2

Inputs are prepared by ``mla_pallas.ops.sparse_decode`` (the same fused XLA pre-pass as for sm_90): Q quantized
per row, indices sanitised (every invalid entry replaced by ``num_slots``, top-k padded to the split grid with the
same marker) and passed as uint32 (gather4 takes unsigned indices). A row id of ``num_slots`` lies wholly past
the end of the cache, so its TMA box is zero-filled by the hardware: the kernel never reads out of bounds, and the
softmax masks those columns to −inf. Outputs (o in the op's dtype, bf16 for this fp8
cache also when split; lse f32) have the sm_90 kernel's shapes, so ``combine_splits`` and the op wrapper are shared.

Warpgroup roles (``num_threads=3``, Lane semantics)
---------------------------------------------------
* WG2 — loader (120 registers): TMA of Q (one copy into the 32-byte-swizzled tile) and of the split's indices; then
  per tile the KV gather into the linear ring: 9 ``copy_gmem_to_smem(kv.at[idxs, pl.ds(64 c, 64)], lin.at[slot,
  c])`` (one per 64-byte column chunk), ``idxs`` a uint32 register array of layout ``Layout.TMA_INDICES``;
  Mosaic issues them as ``tile::gather4`` (4 rows per instruction, 16 instructions per chunk, all 4 warps
  issuing). No swizzle: each chunk lands contiguously as a linear [64, 64] FP8 block.
  **Interpret mode only** (the interpreter does not model gather4): one per-row TMA per row and chunk into the same
  linear buffer; this is the kernel's only interpret-mode switch besides the barrier arrival count.
* WG1 — re-swizzle + MMA issue (160 registers). Per tile t: wait for the linear slot; permute its 9 linear chunks
  into the 32-byte-swizzled KV tile ``kv_sw[t % 2]`` (FP8 → FP8 register round trip, ``Layout.WGMMA_8BIT``, no
  dtype cast), release the slot, issue QKᵀ(t) into ``S[t % 2]`` (TMEM), then P·V(t − 1) once the softmax
  warpgroup has published P(t − 1) and rescaled O (``p_full``). The MMAs run asynchronously on the tensor core;
  their completion arrives on ``s_full`` / ``pv_done`` (``orders_tensor_core=True``).
* WG0 — softmax, correction, epilogue (232 registers). Per tile: wait S(t), load it from TMEM (``WGMMA`` register
  layout, which is what an M = 64 TMEM accumulator loads as), mask, online softmax; wait P·V(t − 1); rescale O in
  TMEM (4 column blocks of 128: load, multiply, ``async_store_tmem``, ``commit_tmem``); write P(t) as fp8 to SMEM;
  arrive ``p_full``. Epilogue: O / l from TMEM straight to GMEM, lse through SMEM + TMA.

Interpret mode runs per-row TMAs in place of gather4 (above); what the interpreter models and what it does not,
and why the kernel is built this way (32-byte swizzle, four O accumulators, a loader warpgroup): see
docs/kernels/sparse_decode_sm100.md.

Pipeline stages: ``stages`` linear slots (gather ahead of the re-swizzle), 2 swizzled KV tiles (re-swizzle of t + 1
and QKᵀ(t + 1) overlap softmax(t) and P·V(t)), 2 S accumulators, 1 P tile, 1 O accumulator.

SMEM budget (bytes; defaults stages=2, 64-token tiles, top-k split of up to 2048 keys)
--------------------------------------------------------------------------------------
    Q (64 × 576 fp8, swizzled)                    36 864
    linear KV ring (stages × 9 × 64 × 64 fp8)     73 728
    swizzled KV tiles (2 × 64 × 576 fp8)          73 728
    P (64 × 64 fp8, swizzled)                      4 096
    indices (tiles_per_split × 64 uint32)          8 192   (2048 keys per split)
    lse staging (64 f32) + barriers               ~1 100
    Mosaic reduction scratch                       2 048   (CompilerParams.reduction_scratch_bytes default)
    total (smem_budget, buffers rounded to 1 KB) 200 704   (stages=1: 163 840; limit 232 448: one CTA per SM;
                                                            stages=3 does not fit)
TMEM budget (columns of 128 lanes × 32 bit; a 64-row f32 accumulator of N columns takes N / 2):
    S: 2 × (64 × 64) = 64;  O: 4 × (64 × 128) = 256;  320 used, allocated as 512 (power of two; 1 CTA per SM).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common
from mla_pallas.kernels.common import CHUNK, D_QK, D_V, FP8, LN2, N_CHUNKS, P_SCALE, swizzled

TILE = 64            # query rows per CTA and gathered keys per pipeline step (tcgen05 M = 64, N = 64)
SWIZZLE = 32         # bytes; the largest B swizzle Mosaic GPU accepts for M = 64, N = 64 (see the docstring)

O_BLOCK = 128        # columns per O accumulator
O_BLOCKS = D_V // O_BLOCK
KV_BUFFERS = 2       # swizzled KV tiles = S accumulators
SOFTMAX_REGS = 232   # 232 + 160 + 120 = 512: 3 x 128 threads x 512 / 3 registers per SM
STAGER_REGS = 160
LOADER_REGS = 120


@dataclasses.dataclass(frozen=True)
class TuningConfig(common.TuningConfigBase):
  """Tuning knobs of the sm_100 sparse decode kernel.

  stages: linear gather ring slots (each 64 rows × 576 B).
  tiles_per_split: 64-key tiles one CTA processes (the split length is 64 · tiles_per_split keys).
  approx_math: CompilerParams(approx_math=...).
  """
  stages: int = 2
  tiles_per_split: int = 32
  approx_math: bool = False

  def validate(self):
    self.check_split()
    self.check_smem(smem_budget(self))


def smem_budget(cfg: TuningConfig) -> int:
  return common.smem_bytes(
      ((TILE, D_QK), FP8),                                 # Q
      ((cfg.stages, N_CHUNKS, TILE, CHUNK), FP8),          # linear ring
      ((KV_BUFFERS, TILE, D_QK), FP8),                     # swizzled KV
      ((TILE, TILE), FP8),                                 # P
      ((cfg.tiles_per_split, TILE), jnp.uint32),           # indices
      ((TILE,), jnp.float32),                              # lse staging
  ) + 64 * 16 + 2048   # barriers; Mosaic reduction scratch (CompilerParams default)


def _gather(interpret, kv_gmem, idx_smem, lin_slot, barrier, t):
  """Gather the 64 cache rows named by ``idx_smem[t]`` into the linear slot ``lin_slot`` [9, 64, 64] (chunk-major).

  Hardware: TMA gather4, one copy per 64-byte chunk (Mosaic emits 16 ``tile::gather4`` per copy, 4 rows each).
  Interpret mode (no gather4 there): one TMA per row and chunk. Either way an index of ``num_slots`` reads past the
  end of the cache, which TMA zero-fills.
  """
  if not interpret:
    idxs = plgpu.load(idx_smem.at[t], layout=plgpu.Layout.TMA_INDICES, optimized=False)
    for c in range(N_CHUNKS):
      plgpu.copy_gmem_to_smem(kv_gmem.at[idxs, pl.ds(c * CHUNK, CHUNK)], lin_slot.at[c], barrier)
    return

  @pl.loop(0, TILE)
  def _(r):
    i = idx_smem[t, r].astype(jnp.int32)
    for c in range(N_CHUNKS):
      plgpu.copy_gmem_to_smem(kv_gmem.at[pl.ds(i, 1), pl.ds(c * CHUNK, CHUNK)], lin_slot.at[c, pl.ds(r, 1)],
                              barrier)


def _body(cfg: TuningConfig, num_slots: int, tiles_per_token: int, out_dtype, interpret: bool,
          q_gmem, qs_gmem, kv_gmem, idx_gmem, scal_gmem,          # inputs
          o_gmem, lse_gmem,                                       # outputs
          q_sw, lin, kv_sw, p_sw, idx_smem, lse_smem, s_tmem, o_tmem,   # scratch
          q_bar, idx_bar, lin_full, lin_empty, s_full, p_full, pv_done):
  tile_q = lax.axis_index("q")
  split = lax.axis_index("split")
  token = lax.div(tile_q, tiles_per_token)
  wg = lax.axis_index("wg")
  n_tiles = cfg.tiles_per_split
  stages = cfg.stages

  def pairs(step):
    """Run step(t, b) for t in [0, n_tiles) with the static buffer index b = t % 2 (TMEM refs are picked
    statically), as a loop over pairs plus a static tail."""
    @pl.loop(0, n_tiles // 2)
    def _(i):
      step(2 * i, 0)
      step(2 * i + 1, 1)
    if n_tiles % 2:
      step(n_tiles - 1, 0)

  @pl.when(wg == 2)
  def _loader():
    plgpu.set_max_registers(LOADER_REGS, action="decrease")
    plgpu.copy_gmem_to_smem(q_gmem.at[tile_q], q_sw, q_bar)
    plgpu.copy_gmem_to_smem(idx_gmem.at[token, pl.ds(split * n_tiles, n_tiles)], idx_smem, idx_bar)
    plgpu.barrier_wait(idx_bar)
    for t0 in range(min(stages, n_tiles)):      # prologue: fill the ring
      _gather(interpret, kv_gmem, idx_smem, lin.at[t0], lin_full.at[t0], t0)

    @pl.loop(0, max(n_tiles - stages, 0))
    def _(t):
      slot = lax.rem(t, stages)
      plgpu.barrier_wait(lin_empty.at[slot])
      _gather(interpret, kv_gmem, idx_smem, lin.at[slot], lin_full.at[slot], t + stages)
    common.drain(lin_empty, n_tiles, stages)

  @pl.when(wg == 1)
  def _stager_and_mma():
    plgpu.set_max_registers(STAGER_REGS, action="decrease")
    plgpu.barrier_wait(q_bar)

    def issue_pv(u, b):
      plgpu.barrier_wait(p_full)
      for j in range(O_BLOCKS):
        plgpu.tcgen05_mma(o_tmem[j], p_sw, kv_sw.at[b, :, pl.ds(j * O_BLOCK, O_BLOCK)], accumulate=u > 0)
      # One arrival once all four have completed (tcgen05.commit tracks every earlier MMA of this thread; the
      # interpreter models the barrier argument of tcgen05_mma as tracking that one MMA only).
      plgpu.tcgen05_commit_arrive(pv_done.at[b])

    def step(t, b):
      slot = lax.rem(t, stages)
      plgpu.barrier_wait(lin_full.at[slot])

      @pl.when(t >= KV_BUFFERS)
      def _():
        plgpu.barrier_wait(pv_done.at[b])       # P.V(t - 2) has finished reading kv_sw[b]
      for c in range(N_CHUNKS):
        kv_sw.at[b, :, pl.ds(c * CHUNK, CHUNK)][...] = plgpu.load(
            lin.at[slot, c], layout=plgpu.Layout.WGMMA_8BIT, optimized=False)
      plgpu.commit_smem()   # fence + warpgroup barrier: visible to the tensor core, slot fully read
      plgpu.barrier_arrive(lin_empty.at[slot])
      plgpu.tcgen05_mma(s_tmem[b], q_sw, kv_sw.at[b].T, s_full.at[b], accumulate=False)

      @pl.when(t > 0)
      def _():
        issue_pv(t - 1, 1 - b)

    pairs(step)
    issue_pv(n_tiles - 1, (n_tiles - 1) % 2)
    common.drain(pv_done, n_tiles, KV_BUFFERS)   # observe the last P.V completions (interpret-mode rule)

  @pl.when(wg == 0)
  def _softmax():
    plgpu.set_max_registers(SOFTMAX_REGS, action="increase")
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    plgpu.barrier_wait(idx_bar)
    row_scale = plgpu.load(qs_gmem.at[tile_q], layout=row_layout, optimized=False)
    kv_scale = scal_gmem[0]

    def step(t, b, m, l):
      plgpu.barrier_wait(s_full.at[b])
      s = plgpu.async_load_tmem(s_tmem[b], layout=plgpu.Layout.WGMMA)
      plgpu.wait_load_tmem()
      cols = plgpu.load(idx_smem.at[t], layout=col_layout, optimized=False)
      p, alpha, m_new, l = common.online_softmax_tile(s, cols != num_slots, row_scale, m, l)

      @pl.when(t > 0)
      def _():
        plgpu.barrier_wait(pv_done.at[1 - b])   # P.V(t - 1) done: O is stable and P may be overwritten
        for j in range(O_BLOCKS):
          o = plgpu.async_load_tmem(o_tmem[j], layout=plgpu.Layout.WGMMA)
          plgpu.wait_load_tmem()    # the load must complete before the same columns are overwritten
          plgpu.async_store_tmem(o_tmem[j], o * lax.broadcast_in_dim(alpha, o.shape, [0]))
        plgpu.commit_tmem()         # stores visible to the next P.V (p_full orders the tensor core)
      p_sw[...] = (p * P_SCALE).astype(FP8)
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_full)
      return m_new, l

    def body(i, carry):
      m, l = step(2 * i, 0, *carry)
      return step(2 * i + 1, 1, m, l)

    m0 = plgpu.layout_cast(jnp.full((TILE,), -jnp.inf, jnp.float32), row_layout)
    l0 = plgpu.layout_cast(jnp.zeros((TILE,), jnp.float32), row_layout)
    m, l = lax.fori_loop(0, n_tiles // 2, body, (m0, l0))
    if n_tiles % 2:
      m, l = step(n_tiles - 1, 0, m, l)
    plgpu.barrier_wait(pv_done.at[(n_tiles - 1) % 2])

    l_safe = jnp.where(l == 0.0, 1.0, l)
    inv = kv_scale / (P_SCALE * l_safe)
    for j in range(O_BLOCKS):
      o = plgpu.async_load_tmem(o_tmem[j], layout=plgpu.Layout.WGMMA)
      o_gmem.at[tile_q, split, :, pl.ds(j * O_BLOCK, O_BLOCK)][...] = (
          o * lax.broadcast_in_dim(inv, o.shape, [0])).astype(out_dtype)
    plgpu.wait_load_tmem()
    lse_smem[...] = (m + jnp.log2(l)) * LN2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lse_smem, lse_gmem.at[tile_q, split])
    plgpu.wait_smem_to_gmem(0)


@functools.lru_cache(maxsize=64)
def build(num_q_tiles: int, num_tokens: int, num_slots: int, num_splits: int, tiles_per_token: int,
          out_dtype_name: str, cfg: TuningConfig, interpret=False):
  """Build the kernel for given shapes.

  Kernel arguments (as the sm_90 kernel's, except for the views of kv and idx):
    q8   [num_q_tiles, 64, 576] fp8: quantized query rows (tile = token · tiles_per_token + head_block).
    qs   [num_q_tiles, 64] f32: per-row logit scale (q_scale · softmax_scale · log2 e; kv_scale folded in too).
    kv   [num_slots, 576] fp8: the cache (2-D: gather4 gathers rows of a 2-D tensor).
    idx  [num_tokens, num_splits · tiles_per_split, 64] uint32: sanitised row ids (num_slots = invalid).
    scal [1] f32: kv_scale (multiplies the output).
  Returns (o [num_q_tiles, num_splits, 64, 512] out_dtype, lse [num_q_tiles, num_splits, 64] f32 natural log),
  each split's output normalised by its own softmax sum (merge splits by lse).
  """
  out_dtype = jnp.dtype(out_dtype_name)
  n_tiles = cfg.tiles_per_split
  body = functools.partial(_body, cfg, num_slots, tiles_per_token, out_dtype, bool(interpret))
  # gather4: one arrival per copy (9 per tile); interpret-mode per-row TMA: one per row and chunk.
  gather_arrivals = N_CHUNKS * (TILE if interpret else 1)
  return plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((num_q_tiles, num_splits, TILE, D_V), out_dtype),
                jax.ShapeDtypeStruct((num_q_tiles, num_splits, TILE), jnp.float32)),
      grid=(num_q_tiles, num_splits), grid_names=("q", "split"),
      num_threads=3, thread_name="wg",
      scratch_types=[
          plgpu.SMEM((TILE, D_QK), FP8, transforms=swizzled(FP8, SWIZZLE)),             # Q
          plgpu.SMEM((cfg.stages, N_CHUNKS, TILE, CHUNK), FP8),                          # linear ring
          plgpu.SMEM((KV_BUFFERS, TILE, D_QK), FP8, transforms=swizzled(FP8, SWIZZLE)),  # swizzled KV
          plgpu.SMEM((TILE, TILE), FP8, transforms=swizzled(FP8, SWIZZLE)),             # P
          plgpu.SMEM((n_tiles, TILE), jnp.uint32),                                       # indices
          plgpu.SMEM((TILE,), jnp.float32),                                              # lse
          tuple(plgpu.TMEM((TILE, TILE), jnp.float32) for _ in range(KV_BUFFERS)),       # S
          tuple(plgpu.TMEM((TILE, O_BLOCK), jnp.float32) for _ in range(O_BLOCKS)),      # O
          plgpu.Barrier(),                                                     # q_bar
          plgpu.Barrier(),                                                     # idx_bar
          plgpu.Barrier(num_arrivals=gather_arrivals, num_barriers=cfg.stages),   # lin_full
          plgpu.Barrier(num_barriers=cfg.stages),                              # lin_empty
          plgpu.Barrier(num_barriers=KV_BUFFERS, orders_tensor_core=True),     # s_full (QK done)
          plgpu.Barrier(orders_tensor_core=True),                              # p_full (P written, O rescaled)
          plgpu.Barrier(num_barriers=KV_BUFFERS, orders_tensor_core=True),     # pv_done
      ],
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE, approx_math=cfg.approx_math),
      **common.interpret_kwargs(interpret),
  )
