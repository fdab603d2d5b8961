"""Per-head FP8 GEMM with dynamic activation quantization (MLA's absorbed W_UK / W_UV): ``quantize_and_bmm_fp8``.

Semantics are those of :func:`mla_pallas.reference.quantize_and_bmm_fp8` (same quantization of ``a``; the
reference multiplies the dequantized operands in float32, this op multiplies the fp8 operands).

XLA path (real FP8 operands):
  1. ``a [T, H, K]`` is quantized to float8_e4m3fn with :func:`mla_pallas.quant.quantize_rows_fp8` (one scale per
     (t, h) row of K values, ``act_scale="per_token"``) or :func:`mla_pallas.quant.quantize_tensor_fp8`
     (``"per_tensor"``).
  2. For every 128-wide K block ``kb`` (the last one may be partial): an fp8 x fp8 ``lax.dot_general`` with
     ``preferred_element_type=float32`` that consumes ``a8[:, :, kb]`` as ``[H, T, K_kb]`` through its batch
     dimension (H is batch dim 1 of ``a``, dim 0 of ``w``; no explicit transpose of ``a``) and gives
     ``[H, T, N]``. Products of two e4m3 values are exact in float32, so each block's partial sum only carries
     float32 accumulation error.
  3. Each partial is multiplied by its weight block scale ``w_scale[h, kb, n // 128]`` (broadcast over the 128
     columns of an N block) and summed over ``kb`` in float32; then the activation scale is applied:
     ``out[t, h, n] = a_scale[t, h] * sum_kb w_scale[h, kb, n // 128] * (a8[t, h, kb] . w8[h, kb, n])``.
  4. Cast to bfloat16, layout ``[T, H, N]``.
There is no Mosaic kernel yet: ``impl="mosaic"`` raises ``NotImplementedError``; ``impl="auto"`` runs XLA.
"""
from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp

from mla_pallas import _checks, _dispatch, quant

__all__ = ["quantize_and_bmm_fp8", "BLOCK"]

OP = "quantize_and_bmm_fp8"
BLOCK = 128
_ACT = (jnp.bfloat16, jnp.float32)
_ACT_SCALES = ("per_token", "per_tensor")


def _check_args(a, w, w_scale, act_scale):
  if act_scale not in _ACT_SCALES:
    raise ValueError(f"act_scale must be 'per_token' or 'per_tensor'; got {act_scale!r}")
  _checks.check_array("a", a, ndim=3, dtypes=_ACT, expect="[T, H, K]")
  t, h, k = a.shape
  if h < 1 or k < 1:
    raise ValueError(f"a must have shape [T, H, K] with H, K >= 1; got shape {tuple(a.shape)}")
  _checks.check_array("w", w, ndim=3, shape=(h, k, None), dtypes=(quant.FP8,), expect=f"[H, K, N] = [{h}, {k}, N]")
  n = w.shape[2]
  if n < 1:
    raise ValueError(f"w must have shape [H, K, N] with N >= 1; got shape {tuple(w.shape)}")
  kb, nb = -(-k // BLOCK), -(-n // BLOCK)
  _checks.check_array("w_scale", w_scale, ndim=3, shape=(h, kb, nb), dtypes=(jnp.float32,),
                      expect=f"[H, ceil(K/128), ceil(N/128)] = [{h}, {kb}, {nb}]")


def _xla_bmm(a, w, w_scale, act_scale):
  t, h, k = a.shape
  n = w.shape[2]
  if act_scale == "per_token":
    a8, a_s = quant.quantize_rows_fp8(a, axis=-1)              # [T, H, K] fp8, [T, H] f32
  else:
    a8, a_s = quant.quantize_tensor_fp8(a)                     # [] f32
  # w_scale [H, KB, NB] -> per-column scales [H, KB, N]
  ws_cols = jnp.repeat(w_scale, BLOCK, axis=2)[:, :, :n]
  # a8 [T, H, K_kb] x w8 [H, K_kb, N]: batch H (a dim 1, w dim 0), contract K (a dim 2, w dim 1) -> [H, T, N]
  dims = (((2,), (1,)), ((1,), (0,)))
  acc = jnp.zeros((h, t, n), jnp.float32)
  for kb in range(-(-k // BLOCK)):
    k0, k1 = kb * BLOCK, min(k, (kb + 1) * BLOCK)
    part = lax.dot_general(a8[:, :, k0:k1], w[:, k0:k1, :], dims, preferred_element_type=jnp.float32)
    acc = acc + part * ws_cols[:, kb, None, :]
  out = jnp.swapaxes(acc, 0, 1)                                # [T, H, N]; XLA folds it into the scaling pass
  if act_scale == "per_token":
    out = out * a_s[..., None]
  else:
    out = out * a_s
  return out.astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("act_scale",))
def _xla_jit(a, w, w_scale, *, act_scale):
  return _xla_bmm(a, w, w_scale, act_scale)


def quantize_and_bmm_fp8(a, w, w_scale, *, act_scale: str = "per_token", impl: str = "auto",
                         interpret: bool = False):
  """Batched (per-head) FP8 GEMM with dynamic activation quantization.

  Args:
    a: [T, H, K] bfloat16 (or float32) activations.
    w: [H, K, N] float8_e4m3fn weights (e.g. from :func:`mla_pallas.convert_bf16_to_fp8_e4m3fn` or
      :func:`mla_pallas.ops.convert.load_block_scaled_checkpoint`).
    w_scale: [H, ceil(K/128), ceil(N/128)] float32 128x128 block scales:
      ``deq(w)[h, k, n] = w[h, k, n] * w_scale[h, k // 128, n // 128]``.
    act_scale: python str, "per_token" (one scale per (t, h) row of K values, max(|row|) / 448, all-zero rows 1)
      or "per_tensor" (one scale for all of a).
    impl: "auto" | "mosaic" | "xla"; no kernel yet ("mosaic" raises NotImplementedError).
    interpret: accepted for API uniformity.

  Returns:
    [T, H, N] bfloat16: ``out[t, h] = deq(a8)[t, h] @ deq(w)[h]``, fp8 products accumulated in float32.

  Raises:
    ValueError: bad shape/dtype (the message names the argument), unknown act_scale or impl.
    NotImplementedError: ``impl="mosaic"``.
  """
  _dispatch.check_impl(impl)
  _check_args(a, w, w_scale, act_scale)
  _dispatch.choose(OP, impl, interpret=interpret, supported=None)
  return _xla_jit(a, w, w_scale, act_scale=act_scale)
