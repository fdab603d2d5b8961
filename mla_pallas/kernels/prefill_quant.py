"""The prefill kernel's q / k pre-pass in one Mosaic GPU launch (sm_90): per-row FP8 quantization of x [T, H, D]
gathered into the kernel's aligned packing (``ops.prefill._aligned_packing``), reading x once.

For aligned row a (token src[a], or a zero row where src[a] = -1) and head h, in the float32 arithmetic of
``ops.prefill._fp8_per_row`` (the XLA pre-pass this replaces, which XLA runs as two passes over x: a row-max
reduction and a converting pass, 300 + 447 µs on the H200 at 2 × 4096 tokens with DeepSeek's dims):

    amax      = max over the row's finite |x| (0 if none)
    scale     = amax / 448, or 1 where amax is 0
    x8[a, h]  = e4m3(clip(x / scale, ±448))       (a true division, as the XLA pre-pass; NaN stays NaN)

Shapes: x [T, H, D] bf16 or f32 with H a multiple of 64 and D a multiple of 64; src [n_al] int32 in [-1, T).
Returns x8 [n_al, H, D] float8_e4m3fn and scale [n_al, H] float32 (the caller transposes it to the kernel's
[H, n_al]).

One warpgroup per (aligned row, 64 heads) (Lane semantics; grid (n_al, H / 64)): D / 64 TMAs bring the token's
[64, D] slab into SMEM as 64-column chunks with the 128-byte swizzle (bf16; f32: 32-column chunks), so the
register loads (WGMMA layout) are free of bank conflicts; a zero row reads token 0 and selects zeros. A first
pass takes the row maxima of the finite values, a second divides, clips and converts, and writes [64, 64] fp8
chunks (64-byte swizzle) that D / 64 TMAs store beside one for the scales. SMEM: x 64 · D · 2 (bf16) + x8 64 · D
+ 256 bytes; at D = 192 ~37 KB, so several CTAs share an SM.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common, q_quant

ROWS = common.TILE         # heads per CTA
CHUNK = q_quant.CHUNK      # columns per register pass and per fp8 output chunk
FP8_MAX = 448.0
F32_MAX = float(jnp.finfo(jnp.float32).max)


def _body(x_gmem, src_gmem, x8_gmem, scale_gmem, x_smem, x8_smem, scale_smem, bar):
  a, hb = lax.axis_index("row"), lax.axis_index("heads")
  tok = src_gmem[a]
  keep = tok >= 0           # a zero row reads token 0 and selects zeros (+0: the XLA pre-pass's bytes)
  q_quant.stage_rows(x_gmem.at[jnp.maximum(tok, 0), pl.ds(hb * ROWS, ROWS)], x_smem, bar)

  def chunk(c):             # x columns [64 c, 64 c + 64) as f32 registers
    return jnp.where(keep, q_quant.f32_columns(x_smem, c), 0.0)

  n_chunks = x8_smem.shape[0]
  amax = None
  for c in range(n_chunks):
    ax = jnp.abs(chunk(c))
    m = jnp.where(ax <= F32_MAX, ax, 0.0).max(axis=1)    # finite values only (inf and NaN fail the comparison)
    amax = m if amax is None else jnp.maximum(amax, m)
  scale = jnp.where(amax > 0.0, amax / FP8_MAX, 1.0)
  div = lax.broadcast_in_dim(scale, (ROWS, CHUNK), [0])
  for c in range(n_chunks):
    x8_smem.at[c][...] = jnp.clip(chunk(c) / div, -FP8_MAX, FP8_MAX).astype(common.FP8)
  scale_smem[...] = scale
  plgpu.commit_smem()
  for c in range(n_chunks):
    plgpu.copy_smem_to_gmem(x8_smem.at[c], x8_gmem.at[a, pl.ds(hb * ROWS, ROWS), pl.ds(c * CHUNK, CHUNK)])
  plgpu.copy_smem_to_gmem(scale_smem, scale_gmem.at[a, pl.ds(hb * ROWS, ROWS)])
  plgpu.wait_smem_to_gmem(0)


@functools.lru_cache(maxsize=32)
def build(tokens: int, heads: int, d: int, n_al: int, dtype_name: str, interpret=False):
  """The kernel for these shapes (module docstring); ``interpret``: False, True or a ``plgpu.InterpretGPUParams``."""
  if heads % ROWS or d % CHUNK:
    raise NotImplementedError(f"prefill_quant handles H and D in multiples of {ROWS} / {CHUNK}; got H={heads}, "
                              f"D={d}")
  dtype = jnp.dtype(dtype_name)
  chunk_cols = 128 // dtype.itemsize        # 128 bytes of x per TMA box (64 bf16, 32 f32)
  return plgpu.kernel(
      _body,
      out_type=(jax.ShapeDtypeStruct((n_al, heads, d), common.FP8), jax.ShapeDtypeStruct((n_al, heads), jnp.float32)),
      grid=(n_al, heads // ROWS), grid_names=("row", "heads"),
      scratch_types=[plgpu.SMEM((d // chunk_cols, ROWS, chunk_cols), dtype, transforms=common.swizzled(dtype, 128)),
                     plgpu.SMEM((d // CHUNK, ROWS, CHUNK), common.FP8, transforms=common.swizzled(common.FP8, 64)),
                     plgpu.SMEM((ROWS,), jnp.float32),
                     plgpu.Barrier(num_arrivals=d // chunk_cols)],
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE),
      **common.interpret_kwargs(interpret),
  )


def quantize_rows(x, src, interpret=False):
  """(x8 [n_al, H, D] fp8, scale [n_al, H] f32) of ``x`` [T, H, D] gathered by ``src`` [n_al] (module docstring)."""
  t, h, d = x.shape
  return build(t, h, d, src.shape[0], jnp.dtype(x.dtype).name, interpret)(x, src.astype(jnp.int32))
