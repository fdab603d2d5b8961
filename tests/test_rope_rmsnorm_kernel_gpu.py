"""fused_rope_rmsnorm_quantization / rope_rmsnorm: the sm_90 Mosaic GPU kernel on a Hopper GPU at real sizes, against
the references (same tolerance as the CPU tests: bitwise except for rare one-step differences), with the default
grid and with explicit TuningConfigs (tokens per CTA, grid size, warpgroups, ring depth, warpgroup 0's q share), plus a
bandwidth report (run with ``-s``): kernel vs XLA path vs a plain device copy of the same number of bytes, CUPTI
times.
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


# Every knob away from its default, at sizes where it matters (grids of several waves, partial CTAs).
TUNED = [
    (2048, 128, dict(warpgroups=1, stages=4, tokens_per_cta=8)),
    (2048, 128, dict(warpgroups=2, stages=2)),
    (4096, 128, dict(warpgroups=3, kv_share=1)),
    (2048, 128, dict(tokens_per_cta=16, kv_share=4)),
    (4095, 128, dict(tokens_per_cta=64, stages=2)),         # odd T: kv padded; 63 CTAs of 64 tokens, one of 63
    (8192, 16, dict(tokens_per_cta=32)),                    # two waves
    (8192, 16, dict(warpgroups=3, stages=3)),
    (1001, 32, dict(tokens_per_cta=6)),                     # 6 tokens per CTA (a group of 8 rows), the last 5
    (129, 128, dict(tokens_per_cta=2, warpgroups=2)),
    (4096, 128, dict(ctas=100)),                            # uneven ranges of 40-41 tokens
    (333, 32, dict(ctas=50, warpgroups=3)),                 # H = 32: ranges of 6 or 8 tokens
    (8192, 128, dict(stages=2)),                            # 62-63 tokens from unaligned t0: second k_rope pass
    (125, 64, dict(ctas=2, stages=2)),                      # t0 = 63 (d = 7): k_rope window from 56, two passes
]


@pytest.mark.parametrize("t,h,tuning", TUNED)
def test_fused_kernel_tuning_matches_reference(rng, t, h, tuning):
  case = make_case(rng, t, h, num_slots=4 * t + 64, page_size=64)
  new_pages, q_out = op._fused_mosaic(jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos,
                                      case.sin, case.w, jnp.float32(case.eps), jnp.float32(case.kv_scale),
                                      case.slots, interleaved=True, interpret=False, tuning=tuple(tuning.items()))
  n8, nq = check_fused(case, new_pages, q_out, True)
  print(f"T={t} H={h} {tuning}: {n8} fp8 / {nq} q values one step off")


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
    (2048, 128, True, dict(warpgroups=3)), (1001, 128, False, dict(tokens_per_cta=6, warpgroups=2)),
    (2048, 128, False, dict(ctas=100)),
])
def test_unfused_kernel_matches_reference(rng, t, h, interleaved, tuning):
  case = make_case(rng, t, h)
  if tuning is None:
    kv_out, q_out = mla_pallas.rope_rmsnorm(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w,
                                            eps=case.eps, interleaved=interleaved, impl="mosaic")
    assert _dispatch.last_impl("rope_rmsnorm") == "mosaic"
  else:
    kv_out, q_out = op._rope_rmsnorm_mosaic(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w,
                                            jnp.float32(case.eps), interleaved=interleaved, interpret=False,
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
  each way, small next to q_rope's H * 256 B per token). benchmarks/rope_v3_gpu.sh times with the cache donated."""
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


# TuningConfig.gather_tables (kernels/rope_tables.py): the kernel gathers and expands the cos/sin rows itself. Same
# f32 table values as the XLA pre-pass, so the outputs must equal the pre-pass path's bit for bit.
# ``extra``: more TuningConfig overrides for both paths: the gather on warpgroup 0 before everything else (the first
# arrangement, overlap_gather=False), one and three warpgroups (the gathering warpgroup is the last one).
@pytest.mark.parametrize("t,h,interleaved,unique,extra", [
    (1, 128, True, False, ()), (1, 16, False, False, ()), (70, 16, False, False, ()), (128, 128, True, True, ()),
    (4096, 128, True, False, ()), (4096, 128, False, True, ()), (8192, 16, True, True, ()), (125, 64, True, False, ()),
    (8, 128, True, False, (("overlap_gather", False),)),
    (37, 64, False, False, (("warpgroups", 3), ("tokens_per_cta", 8))),
    (9, 128, True, False, (("warpgroups", 1),)),
])
def test_gather_tables_is_bitwise_the_prepass(rng, t, h, interleaved, unique, extra):
  import numpy as np
  case = make_case(rng, t, h, num_slots=4 * t + 64, page_size=64)
  pos = np.asarray(case.positions).copy()
  pos[0], pos[-1] = -5, 10 ** 6      # clamped to [0, max_pos) by both paths
  case.positions = jnp.asarray(pos)

  def run(gather):
    tuning = (("gather_tables", gather),) + extra   # explicit: the op's default is gather_tables at T <= 256
    return op._fused_mosaic(jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin,
                            case.w, jnp.float32(case.eps), jnp.float32(case.kv_scale), case.slots,
                            interleaved=interleaved, interpret=False, tuning=tuning, unique_slots=unique)
  pages_g, q_g = run(True)
  pages_d, q_d = run(False)
  np.testing.assert_array_equal(np.asarray(q_g).view(np.uint16), np.asarray(q_d).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(pages_g).view(np.uint8), np.asarray(pages_d).view(np.uint8))
  kv_g, qu_g = op._rope_rmsnorm_mosaic(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w,
                                       jnp.float32(case.eps), interleaved=interleaved, interpret=False,
                                       tuning=(("gather_tables", True),) + extra)
  kv_d, qu_d = op._rope_rmsnorm_mosaic(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w,
                                       jnp.float32(case.eps), interleaved=interleaved, interpret=False,
                                       tuning=(("gather_tables", False),) + extra)
  np.testing.assert_array_equal(np.asarray(kv_g).view(np.uint16), np.asarray(kv_d).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(qu_g).view(np.uint16), np.asarray(qu_d).view(np.uint16))


@pytest.mark.parametrize("t,h", [(200, 128), (256, 16), (7, 64)])
def test_gather_tables_in_kernel_dedupe_is_bitwise_the_prepass(rng, t, h):
  """T <= 256 with gather_tables: the kernel finds each slot's last writer itself (rope_tables.drop_overwritten)
  instead of the XLA scan. Duplicates inside one CTA's window and across CTAs, skipped and out-of-range slots."""
  import numpy as np
  case = make_case(rng, t, h, num_slots=4 * t + 64, page_size=64, skip=False)
  slots = np.asarray(case.slots).copy()
  slots[[0, t // 2, t - 1]] = slots[1]
  slots[[2, 3]] = slots[4]
  slots[5 % t] = -1
  slots[6 % t] = 10 ** 7
  case.slots = jnp.asarray(slots)

  def run(gather):
    tuning = (("gather_tables", gather),)   # explicit: the op's default is gather_tables at T <= 256
    return op._fused_mosaic(jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin,
                            case.w, jnp.float32(case.eps), jnp.float32(case.kv_scale), case.slots,
                            interleaved=True, interpret=False, tuning=tuning)
  pages_g, q_g = run(True)
  pages_d, q_d = run(False)
  np.testing.assert_array_equal(np.asarray(pages_g).view(np.uint8), np.asarray(pages_d).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(q_g).view(np.uint16), np.asarray(q_d).view(np.uint16))
  check_fused(case, pages_g, q_g, True)


# The direct kernel (kernels/rope_direct.py: GMEM -> registers -> GMEM, no SMEM): the op's default at
# every T outside interpret mode (("kernel", "direct") also overrides tiled knobs).
# Duplicated slots (the last token wins), skipped and out-of-range slots, clamped positions, a NaN-poisoned cache,
# H = 1 (one q row per token), a float32 norm weight, and a second run for determinism.
@pytest.mark.parametrize("t,h,interleaved,fused,extra", [
    (1, 128, True, True, ()), (1, 16, False, True, ()), (7, 64, True, True, ()), (37, 128, False, True, ()),
    (64, 16, True, True, ()), (256, 128, True, True, (("kernel", "direct"),)),
    (300, 16, False, True, (("kernel", "direct"), ("items_per_thread", 4))),
    (5, 1, True, True, (("items_per_thread", 1),)), (9, 128, True, True, (("unique_slots", True),)),
    (37, 48, False, True, ()), (1000, 48, True, False, ()),   # H = 48: only the direct kernel takes it
    (1, 128, True, False, ()), (3, 128, False, False, ()), (33, 16, False, False, (("items_per_thread", 8),)),
    (256, 128, True, False, (("kernel", "direct"),)),
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
  assert op._direct_config(t, tuning) is not None

  def run():
    if fused:
      return op._fused_mosaic(jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin,
                              case.w, jnp.float32(case.eps), jnp.float32(case.kv_scale), case.slots,
                              interleaved=interleaved, interpret=False, tuning=tuning, unique_slots=unique)
    return op._rope_rmsnorm_mosaic(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w,
                                   jnp.float32(case.eps), interleaved=interleaved, interpret=False, tuning=tuning)
  a, b = run()
  a2, b2 = run()
  for x, y in ((a, a2), (b, b2)):
    np.testing.assert_array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
  n = (check_fused if fused else check_unfused)(case, a, b, interleaved)
  print(f"direct T={t} H={h} interleaved={interleaved} fused={fused} {tuning}: {n} values one step off")


@pytest.mark.parametrize("t,h,extra", [(1, 128, ()), (37, 16, ()), (3000, 16, ())])
def test_direct_kernel_writes_nothing_for_all_invalid_slots(rng, t, h, extra):
  """Every slot -1 or past the cache (the warp scan and, at T = 3000, the bitmap mode): the cache is returned
  bitwise unchanged (NaN rows stay NaN) and q_rope is still rotated. (Added 2026-11-30, tenth session, after the
  session's GPU time was spent: first run pending.)"""
  import numpy as np
  case = make_case(rng, t, h, num_slots=4 * t + 64, page_size=64, skip=False)
  num_slots = case.pages.size // 576
  slots = np.where(np.arange(t) % 2 == 0, -1, num_slots + np.arange(t)).astype(np.int32)
  case.slots = jnp.asarray(slots)
  pages, q_out = op._fused_mosaic(jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin,
                                  case.w, jnp.float32(case.eps), jnp.float32(case.kv_scale), case.slots,
                                  interleaved=True, interpret=False, tuning=extra)
  np.testing.assert_array_equal(np.asarray(pages).view(np.uint8), np.asarray(case.pages).view(np.uint8))
  check_fused(case, pages, q_out, True)
