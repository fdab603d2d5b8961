"""Inputs and near-bitwise comparisons for the rope / rmsnorm / FP8-write kernel tests (CPU and GPU files)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mla_pallas import reference as ref

FP8 = jnp.float8_e4m3fn

REF_ROPE_RMSNORM = jax.jit(ref.rope_rmsnorm, static_argnames=("interleaved",))
REF_WRITE = jax.jit(ref.rope_rmsnorm_quantize_write, static_argnames=("interleaved",))


@dataclasses.dataclass
class Case:
  kv: jax.Array
  q_rope: jax.Array
  positions: jax.Array
  cos: jax.Array
  sin: jax.Array
  w: jax.Array
  slots: jax.Array
  pages: np.ndarray      # host copy (the op donates the device buffer)
  eps: float = 1e-6
  kv_scale: float = 0.7


def make_case(rng, t, h, *, num_slots=None, max_pos=4096, page_size=16, skip=True):
  """T tokens, H heads; a NaN-poisoned paged cache; slots in random order with some -1 / out-of-range ones."""
  cos, sin = ref.rope_tables(max_pos)
  kv = jnp.asarray(rng.normal(size=(t, 576)) * 2.0, jnp.bfloat16)
  q_rope = jnp.asarray(rng.normal(size=(t, h, 64)), jnp.bfloat16)
  positions = jnp.asarray(rng.integers(-3, max_pos + 50, size=t), jnp.int32)   # some clamped at both ends
  w = jnp.asarray(rng.normal(size=512) * 0.5 + 1.0, jnp.bfloat16)
  num_slots = num_slots or max(2 * t, 64)
  num_slots = -(-num_slots // page_size) * page_size
  slots = rng.permutation(num_slots)[:t].astype(np.int32)
  if skip and t >= 3:
    slots[rng.integers(0, t)] = -1
    slots[rng.integers(0, t)] = num_slots + int(rng.integers(0, 5))
  pages = np.full((num_slots // page_size, page_size, 576), np.nan, np.float32).astype(FP8)
  return Case(kv, q_rope, positions, cos, sin, w, jnp.asarray(slots), pages)


def bits(x):
  a = np.asarray(x)
  return a.view(np.uint8 if a.dtype.itemsize == 1 else np.uint16)


def ulp_steps(got, want):
  """Per element: how many representable values apart got and want are (same sign assumed; inf when signs differ
  and neither is zero)."""
  g, w = bits(got).astype(np.int64), bits(want).astype(np.int64)
  sign = 1 << (8 * np.asarray(got).dtype.itemsize - 1)
  same_sign = (g & sign) == (w & sign)
  d = np.abs((g & (sign - 1)) - (w & (sign - 1)))
  return np.where(same_sign, d, np.where((g & (sign - 1)) + (w & (sign - 1)) <= 1, 1, np.iinfo(np.int64).max))


def assert_near_bitwise(got, want, *, what, max_frac=1e-3, max_steps=1, min_allowed=4, atol=2.0 ** -18):
  """got == want bitwise except for a few elements that are ``max_steps`` representable values apart, or closer
  than ``atol``.

  Why not exactly bitwise: the kernel sums the RMS in another order than XLA (and the GPU may contract
  x*c + y*s into an FMA, XLA:CPU in the jitted reference does), so an f32 intermediate can differ by an ulp; after
  rounding to bf16 / e4m3 that shows up only where the value lies next to a rounding boundary: one step, rarely.
  Where a*c - b*s cancels, an FMA-vs-no-FMA difference (an f32 ulp of the products, ~2^-21 for |a|, |b| < 8) can
  be several bf16 ulps of the tiny result: ``atol`` (2^-18) covers that.
  """
  assert np.asarray(got).shape == np.asarray(want).shape, (what, np.asarray(got).shape, np.asarray(want).shape)
  steps = ulp_steps(got, want)
  close = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64)) <= atol
  steps = np.where(close & (steps > 0), 1, steps)
  n_bad = int(np.count_nonzero(steps))
  allowed = max(min_allowed, int(max_frac * steps.size))
  worst = int(steps.max()) if steps.size else 0
  assert worst <= max_steps and n_bad <= allowed, (
      f"{what}: {n_bad} of {steps.size} elements differ (allowed {allowed}), worst {worst} steps "
      f"(allowed {max_steps}); first at {np.argwhere(steps)[:3].tolist()}")
  return n_bad


def check_fused(case, new_pages, q_out, interleaved, *, max_frac=1e-3):
  """Compare a fused-op result with the reference; returns (fp8 mismatches, q mismatches)."""
  r_pages, r_q = REF_WRITE(jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w,
                           eps=case.eps, kv_scale=case.kv_scale, slots=case.slots, interleaved=interleaved)
  got, want = bits(new_pages).reshape(-1, 576), bits(r_pages).reshape(-1, 576)
  untouched = np.all(bits(case.pages).reshape(-1, 576) == want, axis=1)
  assert np.array_equal(got[untouched], want[untouched]), "a slot that is not written changed"
  n8 = assert_near_bitwise(np.asarray(new_pages).reshape(-1, 576)[~untouched],
                           np.asarray(r_pages).reshape(-1, 576)[~untouched], what="fp8 rows", max_frac=max_frac)
  nq = assert_near_bitwise(q_out, r_q, what="q_rope_out", max_frac=max_frac)
  return n8, nq


def check_unfused(case, kv_out, q_out, interleaved, *, max_frac=1e-3):
  r_kv, r_q = REF_ROPE_RMSNORM(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, eps=case.eps,
                               interleaved=interleaved)
  assert kv_out.dtype == jnp.bfloat16 and q_out.dtype == jnp.bfloat16
  return (assert_near_bitwise(kv_out, r_kv, what="kv_out", max_frac=max_frac),
          assert_near_bitwise(q_out, r_q, what="q_rope_out", max_frac=max_frac))


# ---------------------------------------------------------------------------------------------------------------
# Tests (CPU)
# ---------------------------------------------------------------------------------------------------------------
