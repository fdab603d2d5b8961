"""The merge of split-KV partial results in one Mosaic GPU kernel (sm_90), for the heads-on-M sparse design.

The sparse kernels split a long top-k into ``num_splits`` parts; each writes its part's normalised output and
lse. This kernel merges them in the float32 arithmetic of :func:`mla_pallas.ops.sparse_decode.combine_splits`
(the XLA merge, which XLA runs as several small fusions):

    m    = max_s lse[s]                  (0 where every split is empty: m = −inf)
    w_s  = exp(lse[s] − m)               (0 for an empty split)
    tot  = Σ_s w_s
    out  = Σ_s (w_s / tot) · o[s]        (0 where tot = 0), stored as bf16
    lse  = log(tot) + m                  (−inf where tot = 0)

Shapes: o [num_q_tiles, num_splits, 64, 512] f32 or bf16 (the heads-on-M kernel's partials: one query tile of 64
rows per index of the first axis), lse [num_q_tiles, num_splits, 64] f32. Returns out [num_q_tiles, 64, 512] bf16
and lse [num_q_tiles, 64] f32.

Grid: (query tile, 128-column chunk of the output): one warpgroup per CTA (Lane semantics) loads the tile's
``num_splits`` lse rows and, split by split, its [64, 128] piece of each partial straight from GMEM into registers
(WGMMA layout: each thread 2 consecutive f32 of 2 rows per 8 x 8 block), accumulates the weighted sum in f32
registers (64 per thread) and stores the bf16 piece; the CTAs of chunk 0 also write the merged lse (through SMEM
and one TMA). No SMEM beyond the 256-byte lse row.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common

ROWS = common.TILE       # rows per query tile
COLS = 128               # output columns per CTA
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)


def _body(num_splits: int, o_gmem, lse_gmem, out_gmem, lse_out_gmem, lse_smem):
  q = lax.axis_index("q")
  chunk = lax.axis_index("chunk")
  lses = [plgpu.load(lse_gmem.at[q, s], layout=ROW_LAYOUT, optimized=False) for s in range(num_splits)]
  m = functools.reduce(jnp.maximum, lses)
  m_use = jnp.where(m == -jnp.inf, 0.0, m)
  ws = [jnp.exp(x - m_use) for x in lses]
  tot = functools.reduce(jnp.add, ws)
  inv = 1.0 / jnp.where(tot == 0.0, 1.0, tot)
  cols = pl.ds(chunk * COLS, COLS)
  acc = None
  for s in range(num_splits):
    part = plgpu.load(o_gmem.at[q, s, :, cols], layout=plgpu.Layout.WGMMA, optimized=False).astype(jnp.float32)
    term = part * lax.broadcast_in_dim(ws[s] * inv, part.shape, [0])
    acc = term if acc is None else acc + term
  out_gmem.at[q, :, cols][...] = acc.astype(out_gmem.dtype)

  @pl.when(chunk == 0)
  def _():
    lse_smem[...] = jnp.log(tot) + m_use
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lse_smem, lse_out_gmem.at[q])
    plgpu.wait_smem_to_gmem(0)


@functools.lru_cache(maxsize=32)
def build(num_q_tiles: int, num_splits: int, interpret=False):
  """The merge kernel for these shapes (module docstring); ``interpret``: False, True or an
  ``plgpu.InterpretGPUParams``."""
  return plgpu.kernel(
      functools.partial(_body, num_splits),
      out_type=(jax.ShapeDtypeStruct((num_q_tiles, ROWS, common.D_V), jnp.bfloat16),
                jax.ShapeDtypeStruct((num_q_tiles, ROWS), jnp.float32)),
      grid=(num_q_tiles, common.D_V // COLS), grid_names=("q", "chunk"),
      scratch_types=[plgpu.SMEM((ROWS,), jnp.float32)],
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE),
      **common.interpret_kwargs(interpret),
  )


def combine(o, lse, interpret=False):
  """Merge ``o`` [num_q_tiles, num_splits, 64, 512] (f32 or bf16) and ``lse`` [num_q_tiles, num_splits, 64] f32
  into (out [num_q_tiles, 64, 512] bf16, lse [num_q_tiles, 64] f32); module docstring."""
  num_q_tiles, num_splits = o.shape[:2]
  if o.shape[2:] != (ROWS, common.D_V) or lse.shape != (num_q_tiles, num_splits, ROWS):
    raise ValueError(f"o must be [num_q_tiles, num_splits, {ROWS}, {common.D_V}] and lse [num_q_tiles, num_splits, "
                     f"{ROWS}]; got {tuple(o.shape)} and {tuple(lse.shape)}")
  return build(num_q_tiles, num_splits, interpret)(o, lse)
