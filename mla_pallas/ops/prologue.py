"""The decode step's first two kernels in one launch: W_UK's FP8 product (q absorption) and the fused cache write.

The two are independent (W_UK's product reads q_nope, the cache write kv and q_rope), and at serving batch sizes
each is a short chain of GMEM latencies, so a launch of its own costs about as much as its work. Here the product's
kernel (:mod:`mla_pallas.kernels.bmm_fp8`) runs the cache write's CTAs beside its own: ``build(side=...)`` with
``kernels.rope_direct.CacheWriteCTAs`` appends the cache write's CTAs to the product's grid, where warpgroup 0 runs
the cache-write kernel's body unchanged (the other two warpgroups idle). Both parts compute exactly what their own
kernels compute, so the results are bitwise those of :func:`mla_pallas.ops.rope_rmsnorm.fused_rope_rmsnorm_quantization`
followed by :func:`mla_pallas.ops.bmm_fp8.quantize_and_bmm_fp8` (GPU test: tests/test_prologue_gpu.py).

:func:`cache_write_and_absorb` returns None wherever either op would not run its own kernel here, or the pair cannot
share a launch (float32 q_nope, a batch so large that the cache write needs its SMEM duplicate check, or more cache
write CTAs than CO_LAUNCH_MAX_SIDE_CTAS); the caller then runs the two ops (the decode graph does).
Measurements: docs/kernels/bmm_fp8.md, "The cache write in W_UK's launch".
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from mla_pallas.ops import bmm_fp8, rope_rmsnorm
from mla_pallas.ops.rope_rmsnorm import D_QK, D_ROPE
# The most cache-write CTAs measured to gain from sharing W_UK's launch (B8 H128: 18, of which 14 wait for a product
# CTA to retire, one CTA per SM at the product's SMEM); B128 H128 would add 288 (three waves of full-SM CTAs) and
# has not been measured, so larger cache writes keep their own kernel (docs/kernels/bmm_fp8.md).
CO_LAUNCH_MAX_SIDE_CTAS = 18


def cache_write_and_absorb(pages, kv, q_rope, positions, cos, sin, norm_weight, q_nope, w_t, w_scale, *, eps,
                           kv_scale, slots, interleaved: bool = True, unique_slots: bool = False,
                           write_impl: str = "auto", absorb_impl: str = "auto", interpret: bool = False):
  """``fused_rope_rmsnorm_quantization(pages, kv, q_rope, positions, cos, sin, norm_weight, ...)`` and
  ``quantize_and_bmm_fp8(q_nope, w_t, w_scale, weight_layout="hnk")`` in one kernel launch, or
  None where that launch does not apply (module docstring).

  Args:
    pages .. slots, interleaved, unique_slots: as in :func:`mla_pallas.ops.rope_rmsnorm.fused_rope_rmsnorm_quantization`
      (``pages`` is DONATED when the launch runs, as there; when None is returned it is untouched).
    q_nope: [T, H_a, K] bfloat16 (per-token activation scales); w_t: float8_e4m3fn [H_a, N, K] (K-major, from
      :func:`mla_pallas.ops.bmm_fp8.prepare_weight`); w_scale: float32 [H_a, ceil(K/128), N/128].
    write_impl, absorb_impl: each op's ``impl``; the launch runs only where both resolve to "mosaic".
    interpret: as for the two ops; interpret mode cannot run the raw cache write, so it returns None.

  Returns:
    None, or ``(new_pages, q_rope_out, q_latent)``: the cache write's two results and the product's [T, H_a, N]
    bfloat16, bitwise those of the two ops. Both ops' choices are recorded (``_dispatch.last_impl``).

  Raises:
    ValueError: bad arguments of either op (the message names the argument).
  """
  write_used, interleaved, unique_slots = rope_rmsnorm.checked_fused_dispatch(
      pages, kv, q_rope, positions, cos, sin, norm_weight, eps, kv_scale, slots, interleaved, unique_slots,
      write_impl, interpret)
  absorb_used = bmm_fp8.checked_dispatch(q_nope, w_t, w_scale, "per_token", "hnk", absorb_impl, interpret)
  # (interpret mode: the raw cache write resolves to "xla", so None)
  if write_used != "mosaic" or absorb_used != "mosaic" or q_nope.dtype != jnp.bfloat16:
    return None
  t, h, _ = q_rope.shape
  if q_nope.shape[0] != t:
    raise ValueError(f"q_nope must have shape [T, H, K] with T = {t} (kv's tokens); got {tuple(q_nope.shape)}")
  side = rope_rmsnorm.cache_write_ctas(t, h, pages.size // D_QK, interleaved, unique_slots)
  _, h_a, k = q_nope.shape
  if (side is None or side.ctas > CO_LAUNCH_MAX_SIDE_CTAS
      or bmm_fp8.default_config(t, k, w_t.shape[1], h_a).quantize_k is None):
    return None
  return _launch(pages, kv, q_rope, positions, cos, sin, norm_weight, jnp.asarray(eps, jnp.float32),
                 jnp.asarray(kv_scale, jnp.float32), slots, q_nope, w_t, w_scale, side=side)


@functools.partial(jax.jit, static_argnames=("side",), donate_argnums=(0,))
def _launch(pages, kv, q_rope, positions, cos, sin, norm_weight, eps, kv_scale, slots, q_nope, w_t, w_scale, *,
            side):
  from mla_pallas.kernels import bmm_fp8 as kbmm
  t, h_a, k = q_nope.shape
  n = w_t.shape[1]
  kern = kbmm.build(t, h_a, k, n, True, bmm_fp8.default_config(t, k, n, h_a), side=side)
  cache = jax.new_ref(pages.reshape(side.num_slots, D_QK))   # mutable ref: aliased in place by the kernel
  q_lat, q_out = kern(bmm_fp8.in_kernel_a(q_nope), w_t, w_scale,
                      kv, q_rope.reshape(t * side.heads, D_ROPE), positions, cos, sin, norm_weight, eps.reshape(1),
                      kv_scale.reshape(1), slots, cache)
  return jax.freeze(cache).reshape(pages.shape), q_out.reshape(q_rope.shape), q_lat
