"""Native-FP8 sparse MLA decode for Hopper (sm_90a), heads on the MMAs' M side (the op's design for H > 16).

What one CTA computes
---------------------
One *query tile* of 64 rows (the heads of one query token; H < 64 is zero-padded to 64 rows, H = 128 is two
tiles) against ``tiles_per_split`` tiles of 64 gathered KV rows (one split of the token's top-k):

    S    = Q8 · K8ᵀ                       fp8 wgmma, f32 accumulate, K = 640 (five chunks of 128, see below)
    s    = S · row_scale                  row_scale = q_scale(row) · kv_scale · softmax_scale · log2(e)
    s    = −inf where the key is invalid (index < 0 or ≥ num_slots)
    online softmax in base 2 (m, l per row)
    O   += f16(p) · f16(V8)               f16 wgmma, f32 accumulate; P in registers, V upcast exactly
    out  = O · kv_scale / l,  lse = (m + log2 l) · ln 2

Shapes, dtypes, index conventions (kernel arguments, prepared by ``mla_pallas.ops.sparse_decode``)
--------------------------------------------------------------------------------------------------
    q8   [num_q_tiles, 64, 640] fp8: quantized query rows as latent (512) | 64 zeros | rope (64); tile q holds
         heads 64 (q % tiles_per_token) ... of token q // tiles_per_token.
    qs   [num_q_tiles, 64] f32: per-row logit scale (q_scale · softmax_scale · log2 e · kv_scale).
    kv   [num_slots, 576] fp8: the cache (latent 512 | rope 64; V = the first 512).
    idx  [num_tokens, num_splits · tiles_per_split, 64] int32 row ids; any id outside [0, num_slots) is an invalid
         key: gathered as row num_slots (wholly past the end, so the TMA zero-fills it) and masked to −inf.
    scal [1] f32: kv_scale (multiplies the output).
    Returns o [num_q_tiles, num_splits, 64, 512] out_dtype and lse [num_q_tiles, num_splits, 64] f32 (natural
    log), each split normalised by its own softmax sum (the op merges splits by lse).

Warpgroup roles (3 warpgroups, Lane semantics)
----------------------------------------------
* WG2 — loader (56 registers): TMA of Q (five 128-column boxes) and of the split's indices, then per 64-key tile,
  once the consumers have released K buffer ``t % k_buffers`` (``k_empty``), the gather of its 64 rows straight
  into the 128-byte-swizzled K tiles by the warpgroup's 128 threads, 20 16-byte ``cp.async`` each
  (``common.gather_tiles``, ``kernels/gather_threads.py``), published on ``k_full`` once landed.
* WG0, WG1 — consumers (224 registers each). Per tile: issue the five QKᵀ fp8 wgmmas (K chunks of 128; Q's tail
  chunk holds zeros against latent 448-511, so those columns count once); meanwhile stage their half of V (two
  128-column chunks) as an exact e4m3 → f16 upcast (16-bit wgmma takes an MN-major B, so no transpose). Read S,
  release the K buffer; online softmax; P·V for their 256 output columns (64 × 256 f32 accumulator = 128
  registers per thread) with P as an f16 register operand. S is computed by both consumers (no cross-warpgroup
  exchange of S or P). WG0 writes lse.

Pipeline stages: gather of tile t + 1 (k_buffers = 2) ∥ (QKᵀ of tile t ∥ V upcast of tile t) → softmax → P·V.
Interpret mode has no wgmma with a register A operand: there P goes through an SMEM tile [2, 64, 64] f16.
Lane semantics: see ../shared/mgpu/README.md section 6.

SMEM budget (bytes, k_buffers = 2, tiles_per_split = 32; :meth:`TuningConfig.smem_budget`, 1 KB rounding)
-----------------------------------------------------------------------------------------------------------
    Q (fp8, swizzled, 5 × 64 × 128)                       40 960
    K (k_buffers × 5 × 64 × 128 fp8, swizzled)            81 920
    V f16 (64 × 512)                                      65 536
    indices (tiles_per_split × 64 int32)                   8 192
    lse staging                                            1 024
    barriers                                                 512
    Mosaic reduction scratch                               2 048
    total                                                200 192   (limit 232 448: one CTA per SM)
Registers: 224 per consumer thread (O 128, S 32, P, softmax state), 56 for the loader.
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
from mla_pallas.kernels.common import (CONSUMER_REGS, D_V, FP8, LOADER_REGS, SW_CHUNK, SW_CHUNKS, TILE,
                                       swizzled)

LOADER = 2   # warpgroup index of the loader; consumers are 0 and 1


@dataclasses.dataclass(frozen=True)
class TuningConfig(common.SparseSm90Config):
  """Config of the heads-on-M design: ``tiles_per_split``, ``k_buffers`` (1 or 2; a third K tile does not fit
  beside the 64-row Q and the f16 V tile)."""
  K_BUFFERS: ClassVar[tuple[int, ...]] = (1, 2)
  k_buffers: int = 2

  def smem_budget(self) -> int:
    return common.smem_bytes(
        ((SW_CHUNKS, TILE, SW_CHUNK), FP8),                     # Q (latent | 0 | rope)
        ((self.k_buffers, SW_CHUNKS, TILE, SW_CHUNK), FP8),     # K, gathered straight into the swizzled layout
        ((TILE, D_V), jnp.float16),                             # V f16
        ((self.tiles_per_split, TILE), jnp.int32),              # indices
        ((TILE,), jnp.float32),                                 # lse staging
    ) + 64 * 8 + 2048   # barriers; Mosaic reduction scratch (CompilerParams default)


@dataclasses.dataclass(frozen=True)
class _Refs:
  """The kernel's GMEM and SMEM refs and barriers, by name."""
  q_gmem: object
  qs_gmem: object
  kv_gmem: object
  idx_gmem: object
  scal_gmem: object
  o_gmem: object
  lse_gmem: object
  q_sw: object
  k_sw: object
  v16: object
  p_sw: object       # interpret mode only: P through SMEM
  idx_smem: object
  lse_smem: object
  q_bar: object
  idx_bar: object
  k_full: object
  k_empty: object


def _loader(cfg: TuningConfig, num_slots: int, interpret: bool, tile_q, split, token, r: _Refs):
  """WG2: Q and the split's indices, then the gathers of every tile (``common.gather_tiles``)."""
  plgpu.set_max_registers(LOADER_REGS, action="decrease")
  for c in range(SW_CHUNKS):
    plgpu.copy_gmem_to_smem(r.q_gmem.at[tile_q, :, pl.ds(c * SW_CHUNK, SW_CHUNK)], r.q_sw.at[c], r.q_bar)
  n_tiles = cfg.tiles_per_split
  plgpu.copy_gmem_to_smem(r.idx_gmem.at[token, pl.ds(split * n_tiles, n_tiles)], r.idx_smem, r.idx_bar)
  plgpu.barrier_wait(r.idx_bar)
  common.gather_tiles(r.kv_gmem, r.k_sw, r.idx_smem, r.k_full, r.k_empty, num_slots=num_slots,
                      n_tiles=n_tiles, k_buffers=cfg.k_buffers, interpret=interpret)


def _consumer(cfg: TuningConfig, num_slots: int, out_dtype, interpret: bool, wg, tile_q, split, r: _Refs):
  """WG0 / WG1: QKᵀ and the upcast of their half of V, online softmax, P·V into their 256 output columns."""
  plgpu.set_max_registers(CONSUMER_REGS, action="increase")
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  plgpu.barrier_wait(r.q_bar)
  plgpu.barrier_wait(r.idx_bar)
  row_scale = plgpu.load(r.qs_gmem.at[tile_q], layout=row_layout, optimized=False)
  kv_scale = r.scal_gmem[0]

  def step(t, carry):
    acc, m, l = carry
    kb = lax.rem(t, cfg.k_buffers)
    k_tiles = r.k_sw.at[kb]
    plgpu.barrier_wait(r.k_full.at[kb])

    def qk(acc_ref):
      for c in range(SW_CHUNKS):
        plgpu.wgmma(acc_ref, r.q_sw.at[c], k_tiles.at[c].T)
      for w in range(2):   # overlap the V upcast with the asynchronous QK wgmmas: chunks 2w, 2w + 1
        @pl.when(wg == w)
        def _():
          common.stage_v16(k_tiles, r.v16, chunks=range(2 * w, 2 * w + 2))
      plgpu.commit_smem()
      return acc_ref[...]
    s = pl.run_scoped(qk, plgpu.ACC((TILE, TILE), jnp.float32))
    plgpu.barrier_arrive(r.k_empty.at[kb])

    cols = plgpu.load(r.idx_smem.at[t], layout=col_layout, optimized=False)
    p, alpha, m_new, l = common.online_softmax_tile(s, common.valid_keys(cols, num_slots), row_scale, m, l)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    p_op, v_op = p.astype(jnp.float16), r.v16.at[:, pl.ds(wg * 256, 256)]
    if interpret:     # the interpreter has no wgmma with A in registers: P goes through SMEM there
      r.p_sw.at[wg][...] = p_op
      plgpu.commit_smem()
      p_op = r.p_sw.at[wg]

    def pv(acc_refs):
      plgpu.wgmma(acc_refs[0], p_op, v_op)
    (acc,) = common.accumulate(pv, (acc,), interpret)
    return acc, m_new, l

  acc0 = plgpu.layout_cast(jnp.zeros((TILE, 256), jnp.float32), plgpu.Layout.WGMMA)
  m0 = plgpu.layout_cast(jnp.full((TILE,), -jnp.inf, jnp.float32), row_layout)
  l0 = plgpu.layout_cast(jnp.zeros((TILE,), jnp.float32), row_layout)
  acc, m, l = lax.fori_loop(0, cfg.tiles_per_split, step, (acc0, m0, l0))

  inv = kv_scale / jnp.where(l == 0.0, 1.0, l)
  out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
  r.o_gmem.at[tile_q, split, :, pl.ds(wg * 256, 256)][...] = out.astype(out_dtype)
  common.store_lse(wg, m, l, r.lse_smem, r.lse_gmem.at[tile_q, split])


def _body(cfg, num_slots, tiles_per_token, out_dtype, interpret, q_gmem, qs_gmem, kv_gmem, idx_gmem, scal_gmem,
          o_gmem, lse_gmem, q_sw, k_sw, v16, *rest):
  p_sw, rest = (rest[0], rest[1:]) if interpret else (None, rest)
  r = _Refs(q_gmem, qs_gmem, kv_gmem, idx_gmem, scal_gmem, o_gmem, lse_gmem, q_sw, k_sw, v16, p_sw, *rest)
  wg = lax.axis_index("wg")
  tile_q = lax.axis_index("q")
  split = lax.axis_index("split")
  token = lax.div(tile_q, tiles_per_token)

  @pl.when(wg == LOADER)
  def _():
    _loader(cfg, num_slots, interpret, tile_q, split, token, r)

  @pl.when(wg < LOADER)
  def _():
    _consumer(cfg, num_slots, out_dtype, interpret, wg, tile_q, split, r)


@functools.lru_cache(maxsize=64)
def build(num_q_tiles: int, num_slots: int, num_splits: int, tiles_per_token: int, out_dtype_name: str,
          cfg: TuningConfig, interpret=False):
  """The kernel for these shapes (arguments and results: see the module docstring); ``interpret``: False, True or
  a ``plgpu.InterpretGPUParams``."""
  out_dtype = jnp.dtype(out_dtype_name)
  interp = bool(interpret)
  body = functools.partial(_body, cfg, num_slots, tiles_per_token, out_dtype, interp)
  p_scratch = [plgpu.SMEM((2, TILE, TILE), jnp.float16, transforms=swizzled(jnp.float16, 128))] if interp else []
  return plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((num_q_tiles, num_splits, TILE, D_V), out_dtype),
                jax.ShapeDtypeStruct((num_q_tiles, num_splits, TILE), jnp.float32)),
      grid=(num_q_tiles, num_splits), grid_names=("q", "split"),
      num_threads=LOADER + 1, thread_name="wg",
      scratch_types=[
          common.q_scratch(TILE),                                                          # Q
          common.k_scratch(cfg.k_buffers),                                         # K
          plgpu.SMEM((TILE, D_V), jnp.float16, transforms=swizzled(jnp.float16, 128)),     # V f16
          *p_scratch,                                                                      # P (interpret)
          plgpu.SMEM((cfg.tiles_per_split, TILE), jnp.int32),                              # indices
          plgpu.SMEM((TILE,), jnp.float32),                                                # lse
          plgpu.Barrier(num_arrivals=SW_CHUNKS),                                           # q_bar
          plgpu.Barrier(),                                                                 # idx_bar
          plgpu.Barrier(num_arrivals=common.k_full_arrivals(interp),
                        num_barriers=cfg.k_buffers),                                       # k_full
          plgpu.Barrier(num_arrivals=2, num_barriers=cfg.k_buffers),                       # k_empty
      ],
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE),
      **common.interpret_kwargs(interpret),
  )
