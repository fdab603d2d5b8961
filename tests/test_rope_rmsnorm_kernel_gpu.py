"""fused_rope_rmsnorm_quantization / rope_rmsnorm: the sm_90 kernel (mla_pallas.kernels.rope_direct) on a Hopper
GPU at real sizes, against the references (tests/_rope_inputs.assert_near_bitwise: bitwise except for rare one-step
differences, its error model in that docstring), with the default config and explicit TuningConfigs, duplicated /
skipped / out-of-range slots, a NaN-poisoned cache, run twice for determinism; the i64 item index at
T * H * 8 >= 2^31 (slow); plus a bandwidth report (run with ``-s``): kernel vs XLA path vs a plain device copy of the
same number of bytes, CUPTI times.
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
    (1, 128, True), (37, 64, False), (4096, 128, False), (8192, 16, True), (333, 32, False), (128, 128, True),
    (7, 4, False), (20000, 16, True),      # T = 20000: several waves of 64-token CTAs
])
def test_fused_kernel_matches_reference(rng, t, h, interleaved):
  case = make_case(rng, t, h, num_slots=4 * t + 64, page_size=64)
  new_pages, q_out = mla_pallas.fused_rope_rmsnorm_quantization(
      jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, eps=case.eps,
      kv_scale=case.kv_scale, slots=case.slots, interleaved=interleaved, impl="mosaic")
  assert _dispatch.last_impl("fused_rope_rmsnorm_quantization") == "mosaic"
  n8, nq = check_fused(case, new_pages, q_out, interleaved)
  print(f"T={t} H={h} interleaved={interleaved}: {n8} fp8 / {nq} q values one step off")


@pytest.mark.parametrize("t,h,interleaved", [(1, 128, True), (333, 32, False), (4096, 16, True)])
def test_fused_kernel_bf16_cache(rng, t, h, interleaved):
  """The kernel's bfloat16-cache write (bf16(row · f32(1 / kv_scale)), quant.encode_cache_rows) against the
  reference write, NaN-poisoned bf16 cache, skipped / out-of-range slots; passed on the H200, so
  ops.rope_rmsnorm._BF16_PAGES_VALIDATED_ON names sm90 (impl="auto" picks the kernel there)."""
  import numpy as np
  case = make_case(rng, t, h, num_slots=4 * t + 64, page_size=64)
  case.pages = np.asarray(jnp.asarray(case.pages, jnp.float32).astype(jnp.bfloat16))   # NaN stays NaN
  case.kv_scale = 0.75
  new_pages, q_out = mla_pallas.fused_rope_rmsnorm_quantization(
      jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, eps=case.eps,
      kv_scale=case.kv_scale, slots=case.slots, interleaved=interleaved, impl="mosaic")
  assert _dispatch.last_impl("fused_rope_rmsnorm_quantization") == "mosaic"
  assert new_pages.dtype == jnp.bfloat16
  check_fused(case, new_pages, q_out, interleaved)


@pytest.mark.parametrize("t,h", [(4096, 128), (128, 16)])
def test_fused_kernel_unique_slots(rng, t, h):
  """unique_slots=True (no duplicate-slot scan; make_case draws distinct slots plus skipped ones) checks against
  the reference like the default path."""
  case = make_case(rng, t, h, num_slots=4 * t + 64, page_size=64)
  new_pages, q_out = mla_pallas.fused_rope_rmsnorm_quantization(
      jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, eps=case.eps,
      kv_scale=case.kv_scale, slots=case.slots, interleaved=True, unique_slots=True, impl="mosaic")
  check_fused(case, new_pages, q_out, True)


def test_fused_kernel_duplicates_and_f32_weight(rng):
  """Duplicated slots across and within CTAs (the last token wins), skipped slots, a float32 norm weight."""
  import numpy as np
  case = make_case(rng, 2048, 128, num_slots=4096, page_size=64, skip=False)
  slots = np.asarray(case.slots).copy()
  slots[[5, 1000, 2047]] = slots[7]
  slots[[100, 101]] = slots[102]
  slots[[9, 1500]] = [-1, 10 ** 7]
  case.slots = jnp.asarray(slots)
  case.w = case.w.astype(jnp.float32)
  new_pages, q_out = mla_pallas.fused_rope_rmsnorm_quantization(
      jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, eps=case.eps,
      kv_scale=case.kv_scale, slots=case.slots, interleaved=True, impl="mosaic")
  check_fused(case, new_pages, q_out, True)


@pytest.mark.parametrize("t,h,interleaved,tuning", [
    (5, 64, True, None), (777, 128, False, None), (4096, 128, True, None), (4099, 16, False, None),
    (2048, 128, True, dict(items_per_thread=1)), (1001, 128, False, dict(items_per_thread=8)),
])
def test_unfused_kernel_matches_reference(rng, t, h, interleaved, tuning):
  case = make_case(rng, t, h)
  if tuning is None:
    kv_out, q_out = mla_pallas.rope_rmsnorm(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w,
                                            eps=case.eps, interleaved=interleaved, impl="mosaic")
    assert _dispatch.last_impl("rope_rmsnorm") == "mosaic"
  else:
    kv_out, q_out = op._rope_rmsnorm_mosaic(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w,
                                            jnp.float32(case.eps), interleaved=interleaved,
                                            tuning=tuple(tuning.items()))
  nk, nq = check_unfused(case, kv_out, q_out, interleaved)
  print(f"T={t} H={h} interleaved={interleaved} {tuning}: {nk} kv / {nq} q values one step off")


def _cupti(f, *args, iters=20):
  from jax.experimental.mosaic.gpu import profiler
  jax.block_until_ready(f(*args))
  _, ts = profiler.measure(f, iterations=iters)(*args)
  return statistics.median(ts) / 1e3


@pytest.mark.parametrize("t,h", [(4096, 128), (8192, 128), (8192, 16)])
def test_bandwidth_report(rng, t, h):
  """Not a pass/fail gate: prints the fused op's useful bytes / time for impl mosaic and xla, and the bandwidth of a
  device copy. The cache has T slots (the timed functions do not donate it, so XLA copies it per call: T * 576 B
  each way, small next to q_rope's H * 256 B per token). ``mla-pallas bench`` times with the cache donated."""
  case = make_case(rng, t, h, num_slots=t, page_size=64, skip=False)
  pages = jnp.asarray(case.pages)
  args = (pages, case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, jnp.float32(case.eps),
          jnp.float32(case.kv_scale), case.slots)
  useful = t * (576 * 2 + 576 + 2 * 2 * h * 64)   # kv read, fp8 row written, q_rope read + written
  rows = [("copy", None)]
  for impl in ("mosaic", "xla"):
    if impl == "mosaic":
      f = jax.jit(lambda *a: op._fused_mosaic(*a, interleaved=True))
    else:
      f = jax.jit(lambda *a: op._fused_jit(*a, interleaved=True))
    rows.append((impl, _cupti(f, *args)))
  x = jnp.zeros((useful // 2,), jnp.uint8)
  t_copy = _cupti(jax.jit(lambda v: v + jnp.uint8(1)), x)   # reads and writes useful / 2 bytes each
  rows[0] = ("copy", t_copy)
  for name, sec in rows:
    print(f"T={t} H={h} {name:7s} {sec * 1e6:8.1f} us  {useful / sec / 1e12:6.2f} TB/s")


# Every path of the kernel: duplicated slots (the last token wins), skipped and out-of-range slots, clamped
# positions, a NaN-poisoned cache, H = 1 (one q row per token) and H = 48, a float32 norm weight, and a second run
# for determinism.
@pytest.mark.parametrize("t,h,interleaved,fused,extra", [
    (1, 128, True, True, ()), (1, 16, False, True, ()), (7, 64, True, True, ()), (37, 128, False, True, ()),
    (64, 16, True, True, ()), (256, 128, True, True, ()),
    (300, 16, False, True, (("items_per_thread", 4),)),
    (5, 1, True, True, (("items_per_thread", 1),)), (9, 128, True, True, (("unique_slots", True),)),
    (37, 48, False, True, ()), (1000, 48, True, False, ()),   # H = 48: neither a multiple nor a divisor of 64
    (1, 128, True, False, ()), (3, 128, False, False, ()), (33, 16, False, False, (("items_per_thread", 8),)),
    (256, 128, True, False, ()),
    # above warp_scan_max_tokens: the kv CTAs' bitmap check (default), and the XLA pre-pass (bitmap_dedupe=False)
    (4099, 16, False, True, ()), (8192, 16, True, True, (("items_per_thread", 2),)),
    (2048, 128, True, True, (("bitmap_dedupe", False), ("warp_scan_max_tokens", 256))), (4096, 128, True, False, ()),
    (1000, 16, True, True, (("bitmap_tokens", 32), ("bitmap_group", 4), ("scan_unroll", 3),
                            ("warp_scan_max_tokens", 256))),
    # the warp scan in a loop (T > UNROLLED_SCAN_MAX) instead of the bitmap
    (1000, 128, False, True, (("warp_scan_max_tokens", 1000),)),
    (4096, 16, True, True, (("warp_scan_max_tokens", 8192),)),
])
def test_direct_kernel_matches_reference(rng, t, h, interleaved, fused, extra):
  import numpy as np
  extra = dict(extra)
  unique = extra.pop("unique_slots", False)
  case = make_case(rng, t, h, num_slots=4 * t + 64, page_size=64, skip=not unique)
  pos = np.asarray(case.positions).copy()
  pos[0], pos[-1] = -5, 10 ** 6      # clamped to [0, max_pos)
  case.positions = jnp.asarray(pos)
  if t >= 8 and not unique:
    slots = np.asarray(case.slots).copy()
    slots[[0, t // 2, t - 1]] = slots[1]
    slots[[2, 3]] = slots[4]
    slots[5] = -1
    if t > 256:   # many more: across kv CTAs (32 tokens each in the bitmap mode) and inside them
      dst, src = rng.choice(t, t // 8, replace=False), rng.choice(t, t // 8)
      slots[dst] = slots[src]
    case.slots = jnp.asarray(slots)
  if t % 2:
    case.w = case.w.astype(jnp.float32)
  tuning = tuple(extra.items())
  op._config(t, h, fused, tuning)   # a valid tuning

  def run():
    if fused:
      return op._fused_mosaic(jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin,
                              case.w, jnp.float32(case.eps), jnp.float32(case.kv_scale), case.slots,
                              interleaved=interleaved, tuning=tuning, unique_slots=unique)
    return op._rope_rmsnorm_mosaic(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w,
                                   jnp.float32(case.eps), interleaved=interleaved, tuning=tuning)
  a, b = run()
  a2, b2 = run()
  for x, y in ((a, a2), (b, b2)):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
  n = (check_fused if fused else check_unfused)(case, a, b, interleaved)
  print(f"direct T={t} H={h} interleaved={interleaved} fused={fused} {tuning}: {n} values one step off")


@pytest.mark.parametrize("t,h,extra", [(1, 128, ()), (37, 16, ()), (3000, 16, ())])
def test_direct_kernel_writes_nothing_for_all_invalid_slots(rng, t, h, extra):
  """Every slot -1 or past the cache (the warp scan and, at T = 3000, the bitmap mode): the cache is returned
  bitwise unchanged (NaN rows stay NaN) and q_rope is still rotated."""
  import numpy as np
  case = make_case(rng, t, h, num_slots=4 * t + 64, page_size=64, skip=False)
  num_slots = case.pages.size // 576
  slots = np.where(np.arange(t) % 2 == 0, -1, num_slots + np.arange(t)).astype(np.int32)
  case.slots = jnp.asarray(slots)
  pages, q_out = op._fused_mosaic(jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin,
                                  case.w, jnp.float32(case.eps), jnp.float32(case.kv_scale), case.slots,
                                  interleaved=True, tuning=extra)
  np.testing.assert_array_equal(np.asarray(pages).view(np.uint8), np.asarray(case.pages).view(np.uint8))
  check_fused(case, pages, q_out, True)


def _hash_bf16(shape, salt):
  """Deterministic values in [-4, 4) (bf16), a distinct pre-hash word per element of a [rows, cols] array with
  rows < 2^32 (row · odd + col · odd mod 2^32 is injective in row), generated on the device in one fused pass: no
  float32 copy of a 32 GiB array, and no period that could hide a wrapped (i32) row index."""
  rows = jax.lax.broadcasted_iota(jnp.uint32, shape, 0)
  cols = jax.lax.broadcasted_iota(jnp.uint32, shape, 1)
  v = rows * jnp.uint32(0x9E3779B1) + cols * jnp.uint32(0x85EBCA77) + jnp.uint32(salt)
  v = (v ^ (v >> 15)) * jnp.uint32(0x2C1B3C6D)
  v = (v ^ (v >> 12)) * jnp.uint32(0x297A2D39)
  v = v ^ (v >> 15)
  return ((v >> 8).astype(jnp.float32) * (8.0 / 2 ** 24) - 4.0).astype(jnp.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("interleaved", [True, False])
def test_i64_item_index_at_two_to_the_31_items(rng, interleaved):
  """T * H * 8 >= 2^31 q items (T = 2^20 + 5, H = 256: q_rope in and out 32 GiB each, ~67 GiB in all): the kernel's
  i64 item index (kernels/rope_direct.needs_i64). The fused op (default config: the bitmap duplicate check) runs on
  the whole batch; its outputs are compared with the references on the tokens around item 2^31 (token 2^20), the
  first and last tokens and every 65537th token (each row's data is distinct, so a wrapped index would read another
  row's values), with the tolerance of :func:`_rope_inputs.assert_near_bitwise`."""
  from mla_pallas.kernels import rope_direct as rd
  assert rd.needs_i64(2 ** 20 + 5, 256)
  _check_sampled_tokens(rng, 2 ** 20 + 5, 256, interleaved, "mosaic")


def _check_sampled_tokens(rng, t, h, interleaved, impl):
  """The fused op on [T, H] hashed inputs against the references on sampled tokens (see the test above)."""
  import numpy as np
  from _rope_inputs import REF_WRITE, assert_near_bitwise
  from mla_pallas import reference as ref
  max_pos = 4096
  num_slots = -(-(t + 64) // 64) * 64
  make = jax.jit(lambda: (_hash_bf16((t, 576), 1), _hash_bf16((t * h, 64), 2).reshape(t, h, 64)))
  kv, q_rope = make()
  tok = jnp.arange(t, dtype=jnp.int32)
  positions = ((tok % 65521) * 7919 + 11) % (max_pos + 40) - 20   # no i32 overflow; some clamped at both ends
  slots = jnp.asarray(rng.permutation(num_slots)[:t].astype(np.int32))
  cos, sin = ref.rope_tables(max_pos)
  w = jnp.asarray(rng.normal(size=512) * 0.5 + 1.0, jnp.bfloat16)
  pages = jnp.full((num_slots // 64, 64, 576), jnp.nan, jnp.float32).astype(jnp.float8_e4m3fn)
  new_pages, q_out = mla_pallas.fused_rope_rmsnorm_quantization(
      pages, kv, q_rope, positions, cos, sin, w, eps=1e-6, kv_scale=0.7, slots=slots, interleaved=interleaved,
      impl=impl)
  assert _dispatch.last_impl("fused_rope_rmsnorm_quantization") == impl
  mid = min(2 ** 31 // (h * 8), t - 4)   # the token holding q item 2^31
  pick = np.unique(np.concatenate([np.arange(4), np.arange(mid - 3, mid + 4), np.arange(t - 4, t),
                                   np.arange(0, t, 65537)])).astype(np.int32)
  sel = jnp.asarray(pick)
  sub = [jnp.take(a, sel, axis=0) for a in (kv, q_rope, positions, slots)]
  small = jnp.full((num_slots, 576), jnp.nan, jnp.float32).astype(jnp.float8_e4m3fn)
  r_pages, r_q = REF_WRITE(small, sub[0], sub[1], sub[2], cos, sin, w, eps=1e-6, kv_scale=0.7, slots=sub[3],
                           interleaved=interleaved)
  assert_near_bitwise(jnp.take(q_out, sel, axis=0), r_q, what="q_rope_out")
  got_rows = jnp.take(new_pages.reshape(num_slots, 576), sub[3], axis=0)
  assert_near_bitwise(got_rows, jnp.take(r_pages, sub[3], axis=0), what="fp8 rows")
  untouched = np.setdiff1d(np.arange(num_slots), np.asarray(slots))   # the slots no token writes
  assert np.all(np.isnan(np.asarray(jnp.take(new_pages.reshape(num_slots, 576), jnp.asarray(untouched), axis=0),
                                    np.float32))), "a slot that is not written changed"
