"""Block-scaled FP8 weight conversion: ``convert_bf16_to_fp8_e4m3fn``, ``convert_fp8_e4m3fn_to_bf16`` and
``load_block_scaled_checkpoint`` (DeepSeek-style checkpoint tensors -> our layout).

Our weight convention (used by :func:`mla_pallas.quantize_and_bmm_fp8`): a weight is ``[..., K, N]`` (input
features K, output features N, so ``y = x @ w``), stored as float8_e4m3fn ``w8 [..., K, N]`` with float32 block
scales ``scales [..., ceil(K/bk), ceil(N/bn)]``: ``w[..., k, n] = w8[..., k, n] * scales[..., k // bk, n // bn]``
(``block = (bk, bn)``, default (128, 128); edge blocks may be partial). Quantization: ``scale = max(|block|) / 448``
(all-zero block: 1), ``w8 = clip(w / scale, -448, 448)`` rounded to nearest even (see :mod:`mla_pallas.quant`).

The conversions are XLA only: ``impl="mosaic"`` raises ``NotImplementedError``; ``impl="auto"`` runs XLA.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mla_pallas import _checks, _dispatch, quant

__all__ = ["convert_bf16_to_fp8_e4m3fn", "convert_fp8_e4m3fn_to_bf16", "load_block_scaled_checkpoint",
           "CHECKPOINT_BLOCK"]

CHECKPOINT_BLOCK = 128
_FLOAT = (jnp.bfloat16, jnp.float16, jnp.float32)


def _check_block(block):
  ok = (isinstance(block, (tuple, list)) and len(block) == 2
        and all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) and b > 0 for b in block))
  if not ok:
    raise ValueError(f"block must be a pair of positive ints (bk, bn); got {block!r}")
  return int(block[0]), int(block[1])


def _check_weight(name, w, dtypes):
  _checks.check_array(name, w, dtypes=dtypes, expect="[..., K, N]")
  if w.ndim < 2:
    raise ValueError(f"{name} must have rank >= 2 (shape [..., K, N]); got shape {tuple(w.shape)}")


@functools.partial(jax.jit, static_argnames=("block",))
def _quantize_jit(w, *, block):
  return quant.quantize_blocks_fp8(w, block)


@functools.partial(jax.jit, static_argnames=("block",))
def _dequantize_jit(w8, scales, *, block):
  return quant.dequantize_blocks_fp8(w8, scales, block, jnp.bfloat16)


def convert_bf16_to_fp8_e4m3fn(w, block=(128, 128), *, impl: str = "auto", interpret: bool = False):
  """Block-quantize a weight to float8_e4m3fn.

  Args:
    w: [..., K, N] bfloat16 (or float16/float32) weight, rank >= 2.
    block: (bk, bn) pair of positive python ints, default (128, 128); K and N need not be multiples.
    impl: "auto" | "mosaic" | "xla"; no kernel ("mosaic" raises NotImplementedError).
    interpret: accepted for API uniformity.

  Returns:
    (w8 float8_e4m3fn [..., K, N], scales float32 [..., ceil(K/bk), ceil(N/bn)]) with
    ``scales[..., i, j] = max(|tile(i, j)|) / 448`` (1 for an all-zero tile) and
    ``w8 = clip(w / scale, -448, 448)`` rounded to nearest even.
  """
  _dispatch.check_impl(impl)
  _check_weight("w", w, _FLOAT)
  block = _check_block(block)
  _dispatch.choose("convert_bf16_to_fp8_e4m3fn", impl, interpret=interpret, supported=None)
  return _quantize_jit(w, block=block)


def convert_fp8_e4m3fn_to_bf16(w8, scales, block=(128, 128), *, impl: str = "auto", interpret: bool = False):
  """Inverse of :func:`convert_bf16_to_fp8_e4m3fn`.

  Args:
    w8: [..., K, N] float8_e4m3fn, rank >= 2.
    scales: [..., ceil(K/bk), ceil(N/bn)] float32 (same leading dims as w8).
    block: (bk, bn) pair of positive python ints, default (128, 128).
    impl: "auto" | "mosaic" | "xla"; no kernel ("mosaic" raises NotImplementedError).
    interpret: accepted for API uniformity.

  Returns:
    bfloat16 [..., K, N] = ``w8[..., k, n] * scales[..., k // bk, n // bn]`` (product in float32, then rounded to
    bfloat16).
  """
  _dispatch.check_impl(impl)
  _check_weight("w8", w8, (quant.FP8,))
  bk, bn = _check_block(block)
  k, n = w8.shape[-2:]
  want = tuple(w8.shape[:-2]) + (-(-k // bk), -(-n // bn))
  _checks.check_array("scales", scales, shape=want, dtypes=(jnp.float32,),
                      expect="[..., ceil(K/bk), ceil(N/bn)] = " + str(list(want)))
  _dispatch.choose("convert_fp8_e4m3fn_to_bf16", impl, interpret=interpret, supported=None)
  return _dequantize_jit(w8, scales, block=(bk, bn))


@jax.jit
def _transpose_jit(w, s):
  return jnp.swapaxes(w, -1, -2), jnp.swapaxes(s, -1, -2)


def load_block_scaled_checkpoint(weight_fp8, scale_inv):
  """Convert a DeepSeek-style block-scaled FP8 checkpoint tensor to our ``[K, N]`` layout and scales.

  DeepSeek-V3 / V3.2 checkpoints store an FP8 linear layer as two tensors (safetensors names ``<layer>.weight``
  and ``<layer>.weight_scale_inv``):

  * ``weight``: float8_e4m3fn ``[N_out, K_in]`` (torch ``nn.Linear`` layout: output features first, ``y = x @
    W.T``). ``uint8`` / ``int8`` arrays holding the raw e4m3fn bytes are accepted and bit-cast.
  * ``weight_scale_inv``: float32 ``[ceil(N_out/128), ceil(K_in/128)]``; despite the name it is a multiplier:
    ``dequantized[o, i] = weight[o, i] * weight_scale_inv[o // 128, i // 128]`` (128 x 128 blocks, partial at the
    edges).

  Leading batch dimensions (e.g. per-head stacks ``[H, N_out, K_in]`` with scales ``[H, ...]``) are allowed.

  Transposition: our convention is ``y = x @ w`` with ``w [K, N]`` and ``scales [ceil(K/128), ceil(N/128)]``, so
  ``w8 = weight.T`` (``w8[k, n] = weight[n, k]``) and ``scales = weight_scale_inv.T``
  (``scales[kb, nb] = weight_scale_inv[nb, kb]``); then ``w8[k, n] * scales[k // 128, n // 128] ==
  weight[n, k] * weight_scale_inv[n // 128, k // 128]`` exactly (no value changes, only the layout).

  Args:
    weight_fp8: [..., N_out, K_in] float8_e4m3fn (or uint8/int8 raw bytes).
    scale_inv: [..., ceil(N_out/128), ceil(K_in/128)] float32 (bfloat16/float16 are upcast exactly).

  Returns:
    (w8 float8_e4m3fn [..., K_in, N_out], scales float32 [..., ceil(K_in/128), ceil(N_out/128)]), ready for
    :func:`convert_fp8_e4m3fn_to_bf16` (block (128, 128)) or, per head, :func:`mla_pallas.quantize_and_bmm_fp8`.
  """
  _checks.check_array("weight_fp8", weight_fp8, dtypes=(quant.FP8, jnp.uint8, jnp.int8), expect="[..., N_out, K_in]")
  if weight_fp8.ndim < 2:
    raise ValueError(f"weight_fp8 must have rank >= 2 (shape [..., N_out, K_in]); got shape "
                     f"{tuple(weight_fp8.shape)}")
  n_out, k_in = weight_fp8.shape[-2:]
  want = tuple(weight_fp8.shape[:-2]) + (-(-n_out // CHECKPOINT_BLOCK), -(-k_in // CHECKPOINT_BLOCK))
  _checks.check_array("scale_inv", scale_inv, shape=want, dtypes=(jnp.float32, jnp.bfloat16, jnp.float16),
                      expect="[..., ceil(N_out/128), ceil(K_in/128)] = " + str(list(want)))
  if weight_fp8.dtype != quant.FP8:
    weight_fp8 = jax.lax.bitcast_convert_type(weight_fp8, quant.FP8)
  return _transpose_jit(weight_fp8, scale_inv.astype(jnp.float32))
