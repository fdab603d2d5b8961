"""The sparse sm_90 kernels' query pre-pass in one Mosaic GPU kernel: per-row FP8 quantization of Q into the
heads-on-M layout, with the folded logit scale (sm_90; a candidate for ``ops.sparse_decode``'s XLA pre-pass).

Per query row (one head of one token), in the float32 arithmetic of :func:`mla_pallas.quant.quantize_rows_fp8`:

    amax      = max |q[row, :576]|
    scale     = amax · f32(1/448)   (1 for an all-zero row)
    q8[row]   = e4m3(clip(q · (1 / scale), ±448))  as latent (512) | 64 zeros | rope (64)   (640 bytes)
    rs[row]   = amax · k,  k = f32(1/448) · ((softmax_scale · kv_scale) · log2 e)   (:func:`row_scales`)

so the bytes and scales equal the XLA pre-pass's (``ops.sparse_decode._xla_kernel_q``: ``quantize_rows_fp8``,
the concatenation with zeros, and rs as max |q| · k, a second reduction XLA can fuse with the first).

Shapes: q [num_tokens, H, 576] bf16 or f32 with H a multiple of 64; scal [1] f32 = kv_scale. Returns q8
[num_tokens · H / 64, 64, 640] fp8 and rs [num_tokens · H / 64, 64] f32 (tile t = heads 64 (t % (H / 64)) ... of
token t // (H / 64)).

One warpgroup per 64-row tile (Lane semantics): TMAs bring the tile [64, 576] into SMEM as 128-byte-swizzled
chunks (nine [64, 64] for bf16, eighteen [64, 32] for f32), so that the register loads (WGMMA layout) are free
of bank conflicts; a first pass over nine 64-column chunks takes the row maxima, a second converts them and
stores the fp8 tile as five swizzled [64, 128] boxes (two chunks each; the last is 64 zeros | rope), which five
TMAs write out beside one for the row scales. SMEM: q 72 KB (bf16; 144 KB for f32) + q8 40 KB + 256 B.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common
from mla_pallas.quant import FP8_MAX, _INV_FP8_MAX

ROWS = common.TILE
CHUNK = 64                 # columns per register pass
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)


def _body(tiles_per_token: int, softmax_scale: float, q_gmem, scal_gmem, q8_gmem, rs_gmem, q_smem, q8_smem,
          rs_smem, bar):
  t = lax.axis_index("t")
  token, head0 = lax.div(t, tiles_per_token), lax.rem(t, tiles_per_token) * ROWS
  src = q_gmem.at[token, pl.ds(head0, ROWS)]
  chunk_cols = q_smem.shape[-1]            # 128 bytes of q per chunk: 64 bf16 or 32 f32 columns
  n_chunks = common.D_QK // chunk_cols
  for c in range(n_chunks):
    plgpu.copy_gmem_to_smem(src.at[:, pl.ds(c * chunk_cols, chunk_cols)], q_smem.at[c], bar)

  plgpu.barrier_wait(bar)

  def chunk(c):             # q columns [64 c, 64 c + 64) as f32 registers (swizzled chunks: conflict-free)
    per = CHUNK // chunk_cols
    parts = [plgpu.load(q_smem.at[c * per + i], layout=plgpu.Layout.WGMMA).astype(jnp.float32)
             for i in range(per)]
    return parts[0] if per == 1 else jnp.concatenate(parts, axis=1)

  amax = tile_amax(chunk)
  scale = amax * _INV_FP8_MAX
  scale = jnp.where(scale == 0.0, 1.0, scale)
  store_boxes(chunk, 1.0 / scale, q8_smem)
  rs_smem[...] = row_scales(amax, softmax_scale, scal_gmem[0])
  plgpu.commit_smem()
  for b in range(common.SW_CHUNKS):
    plgpu.copy_smem_to_gmem(q8_smem.at[b], q8_gmem.at[t, :, pl.ds(b * common.SW_CHUNK, common.SW_CHUNK)])
  plgpu.copy_smem_to_gmem(rs_smem, rs_gmem.at[t])
  plgpu.wait_smem_to_gmem(0)


def tile_amax(chunk):
  """max |q| of each row, [64] f32 in the row layout, of one 64-row tile of q: ``chunk(c)`` returns q's columns
  [64 c, 64 c + 64) as f32 [64, 64] (WGMMA layout), c = 0..8."""
  amax = None
  for c in range(common.D_QK // CHUNK):
    m = jnp.abs(chunk(c)).max(axis=1)
    amax = m if amax is None else jnp.maximum(amax, m)
  return amax


def store_boxes(chunk, inv, q8_ref, boxes=range(common.SW_CHUNKS)):
  """Write the fp8 tile's 128-column boxes ``boxes`` (of five: latent 0-511 in pairs of 64-column chunks, then
  64 zeros | rope, the zeros meeting latent 448-511 in the attention kernel's tail chunk, ``common.Q_SW_COLS``)
  into ``q8_ref`` [5, 64, 128] fp8 (128-byte swizzled); ``chunk`` as in :func:`tile_scales`, ``inv`` its 1 / scale.
  The caller fences (``plgpu.commit_smem``) before an async-proxy reader."""
  def quantized(c):         # q8 of columns [64 c, 64 c + 64)
    return jnp.clip(chunk(c) * lax.broadcast_in_dim(inv, (ROWS, CHUNK), [0]), -FP8_MAX, FP8_MAX).astype(common.FP8)

  zeros = plgpu.layout_cast(jnp.zeros((ROWS, CHUNK), common.FP8), plgpu.Layout.WGMMA)
  for b in boxes:
    lo, hi = (quantized(2 * b), quantized(2 * b + 1)) if b < common.SW_CHUNKS - 1 else (zeros, quantized(2 * b))
    q8_ref.at[b][...] = jnp.concatenate([lo, hi], axis=1)


def row_scales(amax, softmax_scale: float, kv_scale):
  """The attention kernels' per-row logit scale from a row's max |q|: amax · k with k = f32(1/448) · ((softmax_scale
  · kv_scale) · log2 e), in this order (the XLA pre-pass computes max(|q| · k) over the row, the same bits since
  rounding is monotonic). It equals q's scale · (softmax_scale · kv_scale · log2 e) up to one rounding; an all-zero
  row gets 0 instead (its logits are 0 either way)."""
  k = jnp.float32(_INV_FP8_MAX) * ((jnp.float32(softmax_scale) * kv_scale) * jnp.float32(common.LOG2E))
  return amax * k


def _chunk_cols(dtype_name: str) -> int:
  """Columns of q in one 128-byte-swizzled SMEM chunk (one TMA box)."""
  return 128 // jnp.dtype(dtype_name).itemsize


@functools.lru_cache(maxsize=32)
def build(num_tokens: int, heads: int, dtype_name: str, softmax_scale: float, interpret=False):
  """The kernel for these shapes (module docstring); ``interpret``: False, True or a ``plgpu.InterpretGPUParams``."""
  if heads % ROWS:
    raise NotImplementedError(f"q_quant handles H in multiples of {ROWS}; got H={heads}")
  tiles = num_tokens * (heads // ROWS)
  return plgpu.kernel(
      functools.partial(_body, heads // ROWS, softmax_scale),
      out_type=(jax.ShapeDtypeStruct((tiles, ROWS, common.Q_SW_COLS), common.FP8),
                jax.ShapeDtypeStruct((tiles, ROWS), jnp.float32)),
      grid=(tiles,), grid_names=("t",),
      scratch_types=[plgpu.SMEM((common.D_QK // _chunk_cols(dtype_name), ROWS, _chunk_cols(dtype_name)),
                                jnp.dtype(dtype_name), transforms=common.swizzled(jnp.dtype(dtype_name), 128)),
                     plgpu.SMEM((common.SW_CHUNKS, ROWS, common.SW_CHUNK), common.FP8,
                                transforms=common.swizzled(common.FP8, common.SW_CHUNK)),
                     plgpu.SMEM((ROWS,), jnp.float32),
                     plgpu.Barrier(num_arrivals=common.D_QK // _chunk_cols(dtype_name))],
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE),
      **common.interpret_kwargs(interpret),
  )


def quantize_q(q, kv_scale, softmax_scale: float, interpret=False):
  """(q8 [T · H / 64, 64, 640] fp8, rs [T · H / 64, 64] f32) of ``q`` [T, H, 576] (module docstring); kv_scale
  a float32 scalar (array or number)."""
  num_tokens, heads, d = q.shape
  if d != common.D_QK:
    raise ValueError(f"q must have shape [T, H, {common.D_QK}]; got {tuple(q.shape)}")
  scal = jnp.asarray(kv_scale, jnp.float32).reshape(1)
  return build(num_tokens, heads, jnp.dtype(q.dtype).name, float(softmax_scale), interpret)(q, scal)
