"""fused_rope_rmsnorm_quantization / rope_rmsnorm: the sm_90 Mosaic GPU kernel on a Hopper GPU at real sizes, against
the references (same tolerance as the CPU tests: bitwise except for rare one-step differences), plus a bandwidth
report (run with ``-s``): kernel vs XLA path vs a plain device copy of the same number of bytes, CUPTI times.
"""
from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import pytest

import mla_pallas
from mla_pallas import _dispatch
from mla_pallas.ops import rope_rmsnorm as op

from _rope_inputs import check_fused, check_unfused, make_case

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]


@pytest.mark.parametrize("t,h,interleaved", [
    (1, 128, True), (37, 64, False), (1000, 128, True), (4096, 128, False), (8192, 128, True), (8192, 64, False),
    (8192, 16, True), (333, 32, False),
])
def test_fused_kernel_matches_reference(rng, t, h, interleaved):
  case = make_case(rng, t, h, num_slots=4 * t + 64, page_size=64)
  new_pages, q_out = mla_pallas.fused_rope_rmsnorm_quantization(
      jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, eps=case.eps,
      kv_scale=case.kv_scale, slots=case.slots, interleaved=interleaved, impl="mosaic")
  assert _dispatch.last_impl("fused_rope_rmsnorm_quantization") == "mosaic"
  n8, nq = check_fused(case, new_pages, q_out, interleaved)
  print(f"T={t} H={h} interleaved={interleaved}: {n8} fp8 / {nq} q values one step off")


@pytest.mark.parametrize("t,h,interleaved", [(5, 64, True), (777, 128, False), (8192, 128, True)])
def test_unfused_kernel_matches_reference(rng, t, h, interleaved):
  case = make_case(rng, t, h)
  kv_out, q_out = mla_pallas.rope_rmsnorm(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w,
                                          eps=case.eps, interleaved=interleaved, impl="mosaic")
  assert _dispatch.last_impl("rope_rmsnorm") == "mosaic"
  nk, nq = check_unfused(case, kv_out, q_out, interleaved)
  print(f"T={t} H={h} interleaved={interleaved}: {nk} kv / {nq} q values one step off")


def _cupti(f, *args, iters=20):
  from jax.experimental.mosaic.gpu import profiler
  jax.block_until_ready(f(*args))
  _, ts = profiler.measure(f, iterations=iters)(*args)
  return statistics.median(ts) / 1e3


@pytest.mark.parametrize("t,h", [(4096, 128), (8192, 128), (8192, 16)])
def test_bandwidth_report(rng, t, h):
  """Not a pass/fail gate: prints the fused op's useful bytes / time for impl mosaic and xla, and the bandwidth of a
  device copy. The cache has T slots (the timed functions do not donate it, so XLA copies it per call: T * 576 B
  each way, small next to q_rope's H * 256 B per token)."""
  case = make_case(rng, t, h, num_slots=t, page_size=64, skip=False)
  pages = jnp.asarray(case.pages)
  args = (pages, case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, jnp.float32(case.eps),
          jnp.float32(case.kv_scale), case.slots)
  useful = t * (576 * 2 + 576 + 2 * 2 * h * 64)   # kv read, fp8 row written, q_rope read + written
  rows = [("copy", None)]
  for impl in ("mosaic", "xla"):
    if impl == "mosaic":
      f = jax.jit(lambda *a: op._fused_mosaic(*a, interleaved=True, interpret=False))
    else:
      f = jax.jit(lambda *a: op._fused_jit(*a, interleaved=True))
    rows.append((impl, _cupti(f, *args)))
  x = jnp.zeros((useful // 2,), jnp.uint8)
  t_copy = _cupti(jax.jit(lambda v: v + jnp.uint8(1)), x)   # reads and writes useful / 2 bytes each
  rows[0] = ("copy", t_copy)
  for name, sec in rows:
    print(f"T={t} H={h} {name:7s} {sec * 1e6:8.1f} us  {useful / sec / 1e12:6.2f} TB/s")
