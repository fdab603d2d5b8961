"""FP8 (float8_e4m3fn) quantization helpers, pure ``jax.numpy``.

Used by :mod:`mla_pallas.reference`, the XLA paths of the ops and the kernels' pre-passes.

Conventions (shared by every function here):

* ``FP8 = jnp.float8_e4m3fn``: 1 sign, 4 exponent (bias 7), 3 mantissa bits; finite range ``[-448, 448]``,
  smallest normal ``2**-6``, subnormal step ``2**-9``; no infinities, one NaN pattern per sign
  (``0x7f`` / ``0xff``). Relative rounding error of a normal value is at most ``2**-4``.
* Quantization: ``q = clip(x.astype(f32) * (1 / scale), -448, 448).astype(FP8)``, i.e. ``x / scale`` with the
  float32 rounding pinned down: the reciprocal ``1 / scale`` is rounded once to float32 and then multiplied.
  (XLA:CPU evaluates ``x / s`` exactly like that, XLA:GPU with a correctly rounded division; writing the
  reciprocal explicitly makes the result bitwise identical on every backend. It differs from a correctly
  rounded ``x / scale`` by at most 1 f32 ulp, which changes the e4m3 result only when the quotient lies
  within that ulp of an e4m3 rounding midpoint.) The clip matters: e4m3fn has no infinity and XLA turns an
  out-of-range cast into NaN. The cast rounds to nearest, ties to even. NaN inputs stay NaN; +-inf inputs
  saturate to +-448.
* Dequantization: ``q.astype(f32) * scale`` (then cast to the requested dtype).
* Dynamic scales (rows, tensor, blocks): ``scale = amax / 448`` where ``amax`` is the largest ``|x|`` of the
  group, computed in float32 as ``amax * f32(1/448)`` (again pinned down; within 1 ulp of ``amax / 448``).
  A group whose ``amax`` is 0 (all zeros) -- or whose ``amax / 448`` underflows to 0 -- gets ``scale = 1.0``.
  Scales are float32. A group holding NaN gets a NaN scale (garbage in, garbage out); a group holding inf
  gets an inf scale.
* Blocks: ``[..., K, N]`` weights are cut into ``block = (bk, bn)`` tiles along the last two axes; tile
  ``(i, j)`` covers rows ``[i*bk, min((i+1)*bk, K))`` and columns ``[j*bn, min((j+1)*bn, N))``. ``K`` and
  ``N`` need not be multiples of the block: edge tiles are partial and ``scales`` has shape
  ``[..., ceil(K/bk), ceil(N/bn)]``. Element ``w[..., k, n]`` uses ``scales[..., k // bk, n // bn]``.
"""
from __future__ import annotations

from typing import Sequence

import jax.numpy as jnp
import numpy as np

from mla_pallas._checks import check_array

__all__ = [
    "FP8", "FP8_MAX", "DEFAULT_BLOCK",
    "quantize_fp8", "dequantize_fp8",
    "quantize_rows_fp8", "quantize_tensor_fp8",
    "quantize_blocks_fp8", "dequantize_blocks_fp8",
    "amax_to_scale", "expand_block_scales", "encode_cache_rows",
]

FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0
DEFAULT_BLOCK = (128, 128)

# f32(1/448): scales are amax * _INV_FP8_MAX (see module doc)
_INV_FP8_MAX = np.float32(1.0 / FP8_MAX)


def _is_float(x) -> bool:
  return jnp.issubdtype(x.dtype, jnp.floating)


def _check_float(name: str, x, **kw) -> None:
  check_array(name, x, **kw)
  if not _is_float(x) or x.dtype == FP8:
    raise ValueError(f"{name} must have a floating dtype (float32/bfloat16/float16); "
                     f"got shape {tuple(x.shape)} {np.dtype(x.dtype).name}")


def _check_min_rank(name: str, x, rank: int, expect: str) -> None:
  if x.ndim < rank:
    raise ValueError(f"{name} must have rank >= {rank} (shape {expect}); "
                     f"got shape {tuple(x.shape)} {np.dtype(x.dtype).name}")


def _check_block(block) -> tuple[int, int]:
  ok = (isinstance(block, (tuple, list)) and len(block) == 2
        and all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b > 0 for b in block))
  if not ok:
    raise ValueError(f"block must be a pair of positive ints (bk, bn); got {block!r}")
  return int(block[0]), int(block[1])


def amax_to_scale(amax):
  """float32 scale ``amax * f32(1/448)`` with 1.0 where that is 0 (all-zero group). Any shape; float32."""
  amax = jnp.asarray(amax, jnp.float32)
  scale = amax * _INV_FP8_MAX
  return jnp.where(scale == 0, jnp.float32(1.0), scale)


def quantize_fp8(x, scale):
  """Quantize ``x`` with a given scale: ``clip(x * (1 / scale), -448, 448).astype(float8_e4m3fn)``.

  Args:
    x: floating array (float32/bfloat16/float16), any shape.
    scale: python float or float32 array broadcastable against ``x`` (e.g. ``[..., 1]`` for per-row scales);
      must be > 0 (not checked: a 0 scale gives +-448 / NaN).
  Returns:
    float8_e4m3fn array of ``x``'s shape (broadcast shape). Reciprocal, product and clip in float32, round
    to nearest even by the cast.
  """
  _check_float("x", x)
  inv = 1.0 / jnp.asarray(scale, jnp.float32)  # f32 reciprocal, then a multiply (see module doc)
  q = x.astype(jnp.float32) * inv
  return jnp.clip(q, -FP8_MAX, FP8_MAX).astype(FP8)


def encode_cache_rows(rows, kv_scale, dtype):
  """Cache rows as stored in a cache of ``dtype`` with per-tensor scale ``kv_scale`` (stored · kv_scale = row):
  float8_e4m3fn: :func:`quantize_fp8` (clip to ±448, round to nearest even); bfloat16 / float32:
  ``(rows · f32(1 / kv_scale)).astype(dtype)`` (no clip; with kv_scale 1 only the rounding)."""
  if jnp.dtype(dtype) == FP8:
    return quantize_fp8(rows, kv_scale)
  return (rows.astype(jnp.float32) * (1.0 / jnp.asarray(kv_scale, jnp.float32))).astype(dtype)


def dequantize_fp8(x8, scale, dtype=jnp.float32):
  """``(x8.astype(float32) * scale).astype(dtype)``.

  Args:
    x8: float8_e4m3fn array, any shape.
    scale: python float or float32 array broadcastable against ``x8`` (per-row scales from
      :func:`quantize_rows_fp8` need ``jnp.expand_dims(scale, axis)``).
    dtype: output dtype (default float32).
  """
  check_array("x8", x8, dtypes=(FP8,))
  return (x8.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)).astype(dtype)


def quantize_rows_fp8(x, axis: int = -1):
  """Dynamic per-row (per-token) quantization along ``axis``.

  Args:
    x: floating array ``[..., K]`` (the reduced axis is ``axis``, default last).
    axis: the axis holding one row's ``K`` values.
  Returns:
    ``(x8, scale)``: ``x8`` float8_e4m3fn of ``x``'s shape; ``scale`` float32 of ``x``'s shape with ``axis``
    removed, ``scale = max(|row|) / 448`` (1.0 for all-zero rows). ``x ~= x8 * expand_dims(scale, axis)``.
  """
  _check_float("x", x)
  _check_min_rank("x", x, 1, "[..., K]")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis must be in [-{x.ndim}, {x.ndim}) for x of shape {tuple(x.shape)}; got {axis}")
  amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=axis, keepdims=True)
  scale = amax_to_scale(amax)
  return quantize_fp8(x, scale), jnp.squeeze(scale, axis)


def quantize_tensor_fp8(x):
  """Dynamic per-tensor quantization.

  Args:
    x: floating array, any shape (at least one element).
  Returns:
    ``(x8, scale)``: ``x8`` float8_e4m3fn of ``x``'s shape, ``scale`` float32 ``[]`` = ``max(|x|) / 448``
    (1.0 when ``x`` is all zeros).
  """
  _check_float("x", x)
  scale = amax_to_scale(jnp.max(jnp.abs(x.astype(jnp.float32))))
  return quantize_fp8(x, scale), scale


def expand_block_scales(scales, shape: Sequence[int], block=DEFAULT_BLOCK):
  """Broadcast ``scales [..., ceil(K/bk), ceil(N/bn)]`` to per-element float32 scales ``[..., K, N]``."""
  bk, bn = _check_block(block)
  k, n = int(shape[-2]), int(shape[-1])
  full = jnp.repeat(jnp.repeat(jnp.asarray(scales, jnp.float32), bk, axis=-2), bn, axis=-1)
  return full[..., :k, :n]


def _check_scales(scales, w_shape, bk, bn, name="scales"):
  kb, nb = -(-w_shape[-2] // bk), -(-w_shape[-1] // bn)
  want = tuple(w_shape[:-2]) + (kb, nb)
  check_array(name, scales, shape=want, dtypes=(jnp.float32,),
              expect="[..., ceil(K/bk), ceil(N/bn)] = " + str(list(want)))


def quantize_blocks_fp8(w, block=DEFAULT_BLOCK):
  """Dynamic block-wise quantization of ``w [..., K, N]`` (DeepSeek's 128x128 weight format).

  Args:
    w: floating array ``[..., K, N]`` (rank >= 2).
    block: ``(bk, bn)`` tile shape (default ``(128, 128)``); ``K``/``N`` need not be multiples (partial edge
      tiles).
  Returns:
    ``(w8, scales)``: ``w8`` float8_e4m3fn ``[..., K, N]``; ``scales`` float32
    ``[..., ceil(K/bk), ceil(N/bn)]``, ``scales[..., i, j] = max(|tile(i, j)|) / 448`` (1.0 for an all-zero
    tile).
  """
  bk, bn = _check_block(block)
  _check_float("w", w)
  _check_min_rank("w", w, 2, "[..., K, N]")
  k, n = w.shape[-2], w.shape[-1]
  kb, nb = -(-k // bk), -(-n // bn)
  a = jnp.abs(w.astype(jnp.float32))
  pad = [(0, 0)] * (w.ndim - 2) + [(0, kb * bk - k), (0, nb * bn - n)]
  a = jnp.pad(a, pad)  # zeros do not change a tile's amax
  a = a.reshape(a.shape[:-2] + (kb, bk, nb, bn))
  scales = amax_to_scale(jnp.max(a, axis=(-3, -1)))
  return quantize_fp8(w, expand_block_scales(scales, w.shape, (bk, bn))), scales


def dequantize_blocks_fp8(w8, scales, block=DEFAULT_BLOCK, dtype=jnp.float32):
  """Inverse of :func:`quantize_blocks_fp8`: ``w[..., k, n] = w8[..., k, n] * scales[..., k//bk, n//bn]``.

  Args:
    w8: float8_e4m3fn ``[..., K, N]``.
    scales: float32 ``[..., ceil(K/bk), ceil(N/bn)]``.
    block: ``(bk, bn)``, default ``(128, 128)``.
    dtype: output dtype (default float32); the product is formed in float32 and then cast.
  """
  bk, bn = _check_block(block)
  check_array("w8", w8, dtypes=(FP8,))
  _check_min_rank("w8", w8, 2, "[..., K, N]")
  _check_scales(scales, w8.shape, bk, bn)
  return dequantize_fp8(w8, expand_block_scales(scales, w8.shape, (bk, bn)), dtype)
