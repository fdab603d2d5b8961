"""Paged FP8 latent cache: slot math, writes, quantization bounds, FlashMLA V3.2 import/export."""
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mla_pallas import cache

E4M3 = ml_dtypes.float8_e4m3fn
BF16 = ml_dtypes.bfloat16
# e4m3: 3 mantissa bits -> round-to-nearest moves a normal value by <= half an ulp = 2**-4 relative;
# below the smallest normal 2**-6 the spacing is 2**-9, i.e. <= 2**-10 absolute (in scaled units).
# The f32 division / multiplication by the scale add ~2 f32 roundings (2**-24 each): 2**-22 slack.
E4M3_REL = 2.0 ** -4
E4M3_SUB_ABS = 2.0 ** -10
F32_SLACK = 2.0 ** -22


def _fp8_bound(x, scale):
  """Max |dequantize(quantize(x, scale)) - x| allowed (see the e4m3 error model above)."""
  return E4M3_REL * np.abs(x) + E4M3_SUB_ABS * scale + F32_SLACK * np.abs(x)


def _u8(a):
  """Bytes of an array (bitwise view; NaN payloads compare exactly)."""
  a = np.asarray(a)
  return a.view(np.uint8).reshape(*a.shape, -1)


def _random_pages(rng, num_pages, page_size, nan_rows=()):
  """Random finite fp8 pages (never zeros) with the flat rows ``nan_rows`` poisoned with NaN."""
  x = rng.standard_normal((num_pages * page_size, 576)).astype(np.float32)
  x = np.where(x == 0, 1.0, x).astype(E4M3)
  x[list(nan_rows)] = np.nan
  return x.reshape(num_pages, page_size, 576)


def _np_quantize(rows, scale):
  # the library's convention (quant.quantize_fp8): rows * f32(1 / scale), clip, RNE cast
  inv = np.float32(1) / np.float32(scale)
  return np.clip(np.asarray(rows, np.float32) * inv, -448, 448).astype(E4M3)


# ---- allocate / shapes ---------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_allocate(page_size):
  p = cache.allocate(3, page_size)
  assert p.shape == (3, page_size, 576) and p.dtype == jnp.float8_e4m3fn
  assert cache.num_slots(p) == 3 * page_size
  assert cache.page_size_of(p) == page_size
  assert cache.flat_view(p).shape == (3 * page_size, 576)
  assert cache.num_slots(cache.flat_view(p)) == 3 * page_size
  assert cache.page_size_of(cache.flat_view(p)) is None
  assert cache.allocate(1, 16, dtype=jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("page_size", [0, -16, 8, 24, 65, 16.0, True])
def test_page_size_rejected(page_size):
  with pytest.raises(ValueError, match="page_size must be a positive multiple of 16"):
    cache.allocate(2, page_size)
  if isinstance(page_size, int) and page_size > 0:
    with pytest.raises(ValueError, match=r"pages.shape\[1\] \(page_size\) must be a positive multiple"):
      cache.num_slots(jnp.zeros((2, page_size, 576), jnp.float8_e4m3fn))
    with pytest.raises(ValueError, match="page_size"):
      cache.slots_for_positions(jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32), page_size)


def test_allocate_and_shape_errors():
  with pytest.raises(ValueError, match="num_pages must be a positive int"):
    cache.allocate(0, 64)
  with pytest.raises(ValueError, match="dtype must be one of"):
    cache.allocate(1, 64, dtype=jnp.int8)
  with pytest.raises(ValueError, match=r"pages must have shape \[num_pages, page_size, 576\]"):
    cache.flat_view(jnp.zeros((2, 16, 512), jnp.float8_e4m3fn))
  with pytest.raises(ValueError, match="pages must have"):
    cache.num_slots(jnp.zeros((576,), jnp.float8_e4m3fn))


# ---- slot math -----------------------------------------------------------------------------------

def _np_slots(block_table, positions, page_size, cache_seqlens=None):
  bt = np.asarray(block_table).astype(np.int64)
  pos = np.asarray(positions).astype(np.int64)
  out = np.full(pos.shape, -1, np.int64)
  for idx in np.ndindex(pos.shape):
    b, p = idx[0], int(pos[idx])
    if p < 0 or p // page_size >= bt.shape[1]:
      continue
    if cache_seqlens is not None and p >= int(cache_seqlens[b]):
      continue
    page = int(bt[b, p // page_size])
    if page < 0:
      continue
    out[idx] = page * page_size + p % page_size
  return out


@pytest.mark.parametrize("page_size", [16, 64, 128])
def test_slots_for_positions_vs_numpy(page_size):
  rng = np.random.default_rng(page_size)
  b, max_pages, num_pages = 3, 4, 12
  bt = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
  bt[1, 3] = -1  # unused entry past sequence 1
  seqlens = np.array([4 * page_size, 2 * page_size + 5, 1], np.int32)
  pos = rng.integers(-3, max_pages * page_size + 7, size=(b, 2, 9)).astype(np.int32)
  pos[1, 0, 0] = 3 * page_size + 1  # hits the -1 block-table entry
  got = cache.slots_for_positions(jnp.asarray(bt), jnp.asarray(pos), page_size)
  assert got.dtype == jnp.int32 and got.shape == pos.shape
  np.testing.assert_array_equal(np.asarray(got), _np_slots(bt, pos, page_size))
  got = cache.slots_for_positions(jnp.asarray(bt), jnp.asarray(pos), page_size,
                                  cache_seqlens=jnp.asarray(seqlens))
  np.testing.assert_array_equal(np.asarray(got), _np_slots(bt, pos, page_size, seqlens))
  # [B] positions (e.g. the next write position = cache_seqlens) work too, and under jit.
  f = jax.jit(cache.slots_for_positions, static_argnums=2)
  np.testing.assert_array_equal(np.asarray(f(jnp.asarray(bt), jnp.asarray(seqlens), page_size)),
                                _np_slots(bt, seqlens, page_size))

  # sequence_slots: positions 0..max_len-1, -1 beyond each length.
  max_len = max_pages * page_size + 3
  got = cache.sequence_slots(jnp.asarray(bt), jnp.asarray(seqlens), max_len, page_size)
  want = _np_slots(bt, np.broadcast_to(np.arange(max_len), (b, max_len)), page_size, seqlens)
  np.testing.assert_array_equal(np.asarray(got), want)
  assert (want[0, : 4 * page_size] >= 0).all() and (want[2, 1:] == -1).all()


@pytest.mark.parametrize("page_size", [16, 64])
def test_flat_vs_paged_rows(page_size):
  rng = np.random.default_rng(1)
  pages = _random_pages(rng, 3, page_size, nan_rows=[5])
  flat = np.asarray(cache.flat_view(jnp.asarray(pages)))
  for slot in rng.integers(0, 3 * page_size, size=20).tolist() + [5]:
    np.testing.assert_array_equal(_u8(flat[slot]), _u8(pages[slot // page_size, slot % page_size]))


def test_slot_errors():
  bt = jnp.zeros((2, 3), jnp.int32)
  with pytest.raises(ValueError, match="positions must have shape \\[B, ...\\] with B=2"):
    cache.slots_for_positions(bt, jnp.zeros((3, 4), jnp.int32), 64)
  with pytest.raises(ValueError, match="positions must have an integer dtype"):
    cache.slots_for_positions(bt, jnp.zeros((2,), jnp.float32), 64)
  with pytest.raises(ValueError, match="block_table must have rank 2"):
    cache.slots_for_positions(jnp.zeros((6,), jnp.int32), jnp.zeros((2,), jnp.int32), 64)
  with pytest.raises(ValueError, match="cache_seqlens must have shape \\[B\\] with B=2"):
    cache.sequence_slots(bt, jnp.zeros((3,), jnp.int32), 8, 64)
  with pytest.raises(ValueError, match="max_len must be a positive int"):
    cache.sequence_slots(bt, jnp.zeros((2,), jnp.int32), 0, 64)


# ---- quantization --------------------------------------------------------------------------------

def test_quantize_dequantize_error_bound():
  rng = np.random.default_rng(2)
  # Magnitudes log-uniform over 2**-14 .. 2**6 so both the normal and the subnormal e4m3 ranges of
  # x / scale are exercised.
  x = (rng.choice([-1.0, 1.0], size=(40, 576)) * 2.0 ** rng.uniform(-14, 6, size=(40, 576)))
  x = x.astype(np.float32)
  scale = cache.choose_scale(jnp.asarray(x))
  assert scale.dtype == jnp.float32
  np.testing.assert_allclose(float(scale), np.abs(x).max() / 448, rtol=1e-6)  # f32 division
  q = cache.quantize_rows(jnp.asarray(x), scale)
  assert q.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(_u8(q), _u8(_np_quantize(x, scale)))  # same RNE cast as ml_dtypes
  d = np.asarray(cache.dequantize(q, scale))
  err = np.abs(d.astype(np.float64) - x)
  assert (err <= _fp8_bound(x, float(scale))).all(), err.max()
  # the bound is not vacuous: the relative error does reach ~2**-4 for some normal values
  normal = np.abs(x) / float(scale) >= 2.0 ** -6
  assert (err[normal] / np.abs(x[normal])).max() > 2.0 ** -5


def test_choose_scale_edge_cases():
  assert float(cache.choose_scale(jnp.zeros((2, 576)))) == 1.0
  x = np.full((3, 576), 0.5, np.float32)
  x[1] = np.nan  # poisoned rows do not affect the scale
  x[2, 0] = np.inf
  assert float(cache.choose_scale(jnp.asarray(x))) == pytest.approx(0.5 / 448, rel=1e-7)
  assert float(cache.choose_scale(jnp.asarray(x, jnp.bfloat16))) == pytest.approx(0.5 / 448, rel=1e-7)


def test_quantize_clips_and_keeps_nan():
  x = np.full((2, 576), 3.0, np.float32)
  x[0, :3] = [1e6, -1e6, np.nan]
  q = np.asarray(cache.quantize_rows(jnp.asarray(x), 0.001)).astype(np.float32)
  assert q[0, 0] == 448 and q[0, 1] == -448 and np.isnan(q[0, 2])
  with pytest.raises(ValueError, match="kv_scale must be finite and > 0"):
    cache.quantize_rows(jnp.asarray(x), 0.0)
  with pytest.raises(ValueError, match=r"rows must have shape \[..., 576\]"):
    cache.quantize_rows(jnp.zeros((2, 512)), 1.0)
  with pytest.raises(ValueError, match="rows must have dtype"):
    cache.quantize_rows(jnp.zeros((2, 576), jnp.int32), 1.0)
  with pytest.raises(ValueError, match=r"pages must have shape \[..., 576\]"):
    cache.dequantize(jnp.zeros((2, 575), jnp.float8_e4m3fn), 1.0)


# ---- write ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("row_dtype", [np.float32, BF16])
def test_write_random_slots(page_size, row_dtype):
  rng = np.random.default_rng(page_size + (row_dtype is BF16))
  num_pages = 3
  n = num_pages * page_size
  nan_rows = rng.choice(n, size=5, replace=False)
  pages0 = _random_pages(rng, num_pages, page_size, nan_rows)
  targets = rng.choice(n, size=7, replace=False)  # random, out of order
  targets[0] = nan_rows[0]  # overwrite one poisoned row
  slots = np.concatenate([targets[:3], [-1, n, n + 5, -(2 ** 31)], targets[3:]]).astype(np.int32)
  rows = (rng.standard_normal((slots.size, 576)) * 3).astype(row_dtype)
  kv_scale = 0.02

  want = pages0.reshape(n, 576).copy()
  valid = (slots >= 0) & (slots < n)
  want[slots[valid]] = _np_quantize(rows[valid].astype(np.float32), kv_scale)

  donor = jnp.asarray(pages0)
  got = cache.write(donor, jnp.asarray(slots), jnp.asarray(rows), kv_scale=kv_scale)
  # donor was donated: on CPU it may or may not be deleted; only the result matters.
  assert got.shape == pages0.shape and got.dtype == jnp.float8_e4m3fn
  np.testing.assert_array_equal(_u8(got).reshape(n, -1), _u8(want).reshape(n, -1))
  untouched = np.setdiff1d(np.arange(n), slots[valid])
  still_nan = np.setdiff1d(nan_rows, slots[valid])
  assert np.isnan(np.asarray(got).reshape(n, 576)[still_nan].astype(np.float32)).all()
  np.testing.assert_array_equal(_u8(np.asarray(got).reshape(n, 576)[untouched]),
                                _u8(pages0.reshape(n, 576)[untouched]))

  # flat cache and kv_scale as an f32 array give the same bytes
  got_flat = cache.write(jnp.asarray(pages0.reshape(n, 576)), jnp.asarray(slots),
                         jnp.asarray(rows), kv_scale=jnp.float32(kv_scale))
  np.testing.assert_array_equal(_u8(got_flat), _u8(want))


def test_write_under_jit_and_donation():
  rng = np.random.default_rng(3)
  pages0 = _random_pages(rng, 2, 64, nan_rows=[0, 100])
  slots = jnp.asarray([7, -1, 70], jnp.int32)
  rows = jnp.asarray(rng.standard_normal((3, 576)), jnp.float32)
  want = pages0.reshape(128, 576).copy()
  want[[7, 70]] = _np_quantize(np.asarray(rows)[[0, 2]], 0.05)

  step = jax.jit(lambda p, s, r, k: cache.write(p, s, r, kv_scale=k), donate_argnums=0)
  got = step(jnp.asarray(pages0), slots, rows, 0.05)
  np.testing.assert_array_equal(_u8(got).reshape(128, -1), _u8(want).reshape(128, -1))
  # chaining writes on the returned (new) buffer
  got2 = cache.write(got, jnp.asarray([0], jnp.int32), rows[:1], kv_scale=0.05)
  want[0] = _np_quantize(np.asarray(rows)[:1], 0.05)
  np.testing.assert_array_equal(_u8(got2).reshape(128, -1), _u8(want).reshape(128, -1))


def test_write_duplicates_last_wins():
  rng = np.random.default_rng(4)
  pages0 = _random_pages(rng, 1, 16)
  slots = np.array([5, 7, 5, 5, -1, 7, 2], np.int32)
  rows = rng.standard_normal((7, 576)).astype(np.float32) + 10 * np.arange(7)[:, None]
  got = np.asarray(cache.write(jnp.asarray(pages0), jnp.asarray(slots), jnp.asarray(rows),
                               kv_scale=0.1)).reshape(16, 576)
  for slot, t in ((5, 3), (7, 5), (2, 6)):
    np.testing.assert_array_equal(_u8(got[slot]), _u8(_np_quantize(rows[t], 0.1)))


def test_write_all_invalid_and_empty():
  rng = np.random.default_rng(5)
  pages0 = _random_pages(rng, 2, 16, nan_rows=[3])
  rows = jnp.asarray(rng.standard_normal((3, 576)), jnp.bfloat16)
  got = cache.write(jnp.asarray(pages0), jnp.asarray([-1, 32, 1000], jnp.int32), rows)
  np.testing.assert_array_equal(_u8(got), _u8(pages0))
  got = cache.write(jnp.asarray(pages0), jnp.zeros((0,), jnp.int32), jnp.zeros((0, 576)))
  np.testing.assert_array_equal(_u8(got), _u8(pages0))


def test_write_fp8_rows_bitwise_and_bf16_cache():
  rng = np.random.default_rng(6)
  pages0 = _random_pages(rng, 1, 16)
  rows8 = _random_pages(rng, 1, 2).reshape(2, 576)
  got = cache.write(jnp.asarray(pages0), jnp.asarray([9, 1], jnp.int32), jnp.asarray(rows8),
                    kv_scale=123.0)  # kv_scale is not applied to fp8 rows
  np.testing.assert_array_equal(_u8(np.asarray(got)[0, [9, 1]]), _u8(rows8))
  # bf16 cache: stored = (row / kv_scale) in bf16, no clipping
  p = cache.allocate(1, 16, dtype=jnp.bfloat16)
  rows = rng.standard_normal((1, 576)).astype(np.float32) * 1e3
  got = cache.write(p, jnp.asarray([4], jnp.int32), jnp.asarray(rows), kv_scale=0.5)
  np.testing.assert_array_equal(_u8(np.asarray(got)[0, 4]),
                                _u8((rows[0] * (np.float32(1) / np.float32(0.5))).astype(BF16)))


def test_write_errors():
  p = cache.allocate(1, 16)
  rows = jnp.ones((2, 576), jnp.float32)
  with pytest.raises(ValueError, match="slots must have an integer dtype"):
    cache.write(p, jnp.zeros((2,), jnp.float32), rows)
  with pytest.raises(ValueError, match="slots must have rank 1"):
    cache.write(p, jnp.zeros((2, 1), jnp.int32), rows)
  with pytest.raises(ValueError, match=r"rows must have shape \[T, 576\] with T=3"):
    cache.write(p, jnp.zeros((3,), jnp.int32), rows)
  with pytest.raises(ValueError, match="rows must have dtype"):
    cache.write(p, jnp.zeros((2,), jnp.int32), rows.astype(jnp.int32))
  with pytest.raises(ValueError, match="pages must have dtype"):
    cache.write(jnp.zeros((16, 576), jnp.int8), jnp.zeros((2,), jnp.int32), rows)
  with pytest.raises(ValueError, match=r"pages.shape\[1\] \(page_size\) must be a positive multiple"):
    cache.write(jnp.zeros((1, 24, 576), jnp.float8_e4m3fn), jnp.zeros((2,), jnp.int32), rows)
  with pytest.raises(ValueError, match="kv_scale must be finite and > 0"):
    cache.write(p, jnp.zeros((2,), jnp.int32), rows, kv_scale=-1.0)
  with pytest.raises(ValueError, match="only be written into a float8_e4m3fn cache"):
    cache.write(cache.allocate(1, 16, dtype=jnp.float32), jnp.zeros((2,), jnp.int32),
                rows.astype(jnp.float8_e4m3fn))


# ---- FlashMLA V3.2 656-byte format ---------------------------------------------------------------

def _np_pack_v32(latent8, scales, rope):
  """Independent NumPy packer: e4m3 bytes ‖ 4 little-endian f32 ‖ 64 little-endian bf16."""
  lead = latent8.shape[:-1]
  return np.concatenate([
      latent8.view(np.uint8),
      np.ascontiguousarray(scales.astype("<f4")).view(np.uint8).reshape(*lead, 16),
      np.ascontiguousarray(rope.view(np.uint16).astype("<u2")).view(np.uint8).reshape(*lead, 128),
  ], axis=-1)


def _random_flashmla(rng, n):
  """Random FlashMLA records: finite e4m3 latent, positive f32 tile scales (not powers of two,
  spanning 2**-12 .. 2**2), bf16 rope. Returns (packed uint8 [n, 656], float64 dequantized)."""
  latent8 = (rng.standard_normal((n, 512)) * 100).clip(-448, 448).astype(E4M3)
  scales = (2.0 ** rng.uniform(-12, 2, size=(n, 4))).astype(np.float32)
  rope = rng.standard_normal((n, 64)).astype(BF16)
  packed = _np_pack_v32(latent8, scales, rope)
  deq = np.concatenate([
      (latent8.astype(np.float64).reshape(n, 4, 128) * scales[..., None].astype(np.float64))
      .reshape(n, 512),
      rope.astype(np.float64)], axis=-1)
  return packed, deq


def test_np_packer_matches_struct():
  # cross-check the NumPy packer against struct's explicit little-endian byte layout
  rng = np.random.default_rng(7)
  latent8 = rng.standard_normal((1, 512)).astype(E4M3)
  scales = rng.uniform(0.1, 2, size=(1, 4)).astype(np.float32)
  rope = rng.standard_normal((1, 64)).astype(BF16)
  want = struct.pack("<512B4f64H", *latent8.view(np.uint8)[0].tolist(), *scales[0].tolist(),
                     *rope.view(np.uint16)[0].tolist())
  assert len(want) == cache.FLASHMLA_V32_BYTES == 656
  assert _np_pack_v32(latent8, scales, rope)[0].tobytes() == want


@pytest.mark.parametrize("page_size", [16, 64])
def test_from_flashmla_v32(page_size):
  rng = np.random.default_rng(page_size)
  num_pages = 2
  packed, deq = _random_flashmla(rng, num_pages * page_size)

  # exact decode: only the f32 rounding of fp8 * scale (2**-24 relative; 2**-23 for margin)
  got = np.asarray(cache.dequantize_flashmla_v32(jnp.asarray(packed)))
  np.testing.assert_allclose(got, deq, rtol=2.0 ** -23, atol=0)

  pages, kv_scale = cache.from_flashmla_v32(jnp.asarray(packed.reshape(num_pages, page_size, 656)))
  assert pages.shape == (num_pages, page_size, 576) and pages.dtype == jnp.float8_e4m3fn
  assert kv_scale.shape == () and kv_scale.dtype == jnp.float32
  np.testing.assert_allclose(float(kv_scale), np.abs(deq).max() / 448, rtol=1e-6)  # f32 math
  back = np.asarray(cache.dequantize(pages, kv_scale), np.float64).reshape(-1, 576)
  # requantization error: the e4m3 bound with the new per-tensor scale
  err = np.abs(back - deq)
  assert (err <= _fp8_bound(deq, float(kv_scale))).all(), err.max()

  # same bytes for FlashMLA's [P, S, 1, 656] shape, a float8_e4m3fn-typed view, a flat cache, jit
  pages4, _ = cache.from_flashmla_v32(jnp.asarray(packed.reshape(num_pages, page_size, 1, 656)))
  pages8, _ = cache.from_flashmla_v32(jnp.asarray(packed.view(E4M3).reshape(num_pages, page_size, 656)))
  flat, _ = cache.from_flashmla_v32(jnp.asarray(packed))
  pj, sj = jax.jit(cache.from_flashmla_v32)(jnp.asarray(packed.reshape(num_pages, page_size, 656)))
  for other in (pages4, pages8, flat, pj):
    np.testing.assert_array_equal(_u8(other).reshape(-1), _u8(pages).reshape(-1))
  assert float(sj) == float(kv_scale)

  # explicit kv_scale
  p2, s2 = cache.from_flashmla_v32(jnp.asarray(packed), kv_scale=2 * float(kv_scale))
  assert float(s2) == np.float32(2 * float(kv_scale))
  back2 = np.asarray(cache.dequantize(p2, s2), np.float64)
  assert (np.abs(back2 - deq) <= _fp8_bound(deq, float(s2))).all()


def test_to_flashmla_v32_layout_and_round_trip():
  rng = np.random.default_rng(8)
  n = 48
  # tiles of very different magnitude; one all-zero tile
  x = rng.standard_normal((n, 576)) * 2.0 ** rng.integers(-8, 6, size=(n, 1))
  x = x.astype(np.float32)
  x[3, 128:256] = 0
  packed = np.asarray(cache.to_flashmla_v32(jnp.asarray(x.reshape(3, 16, 576))))
  assert packed.shape == (3, 16, 656) and packed.dtype == np.uint8
  packed = packed.reshape(n, 656)

  # decode the bytes independently in NumPy
  lat8 = packed[:, :512].copy().view(E4M3)
  scales = packed[:, 512:528].copy().view("<f4")
  rope = packed[:, 528:].copy().view("<u2").astype(np.uint16).view(BF16)
  amax = np.abs(x[:, :512].reshape(n, 4, 128)).max(-1)
  want_scale = np.maximum(amax / np.float32(448), np.float32(1e-4))
  mant, _ = np.frexp(scales)
  assert (mant == 0.5).all()  # powers of two, as FlashMLA's tests/quant.py
  assert (scales >= want_scale).all() and (scales < 2 * want_scale).all()
  assert scales[3, 1] == 2.0 ** -13  # all-zero tile: 1e-4 floor rounded up
  np.testing.assert_array_equal(rope.view(np.uint16), x[:, 512:].astype(BF16).view(np.uint16))
  lat = (lat8.astype(np.float64).reshape(n, 4, 128) * scales[..., None]).reshape(n, 512)
  tile_scale = np.repeat(scales, 128, axis=-1)
  assert (np.abs(lat - x[:, :512]) <= _fp8_bound(x[:, :512], tile_scale)).all()

  # round trip: to -> from; the FlashMLA values requantized with one per-tensor scale
  fm = np.asarray(cache.dequantize_flashmla_v32(jnp.asarray(packed)), np.float64)
  np.testing.assert_array_equal(fm[:, 512:], rope.astype(np.float64))
  pages, kv_scale = cache.from_flashmla_v32(jnp.asarray(packed))
  back = np.asarray(cache.dequantize(pages, kv_scale), np.float64)
  assert (np.abs(back - fm) <= _fp8_bound(fm, float(kv_scale))).all()

  # ours -> FlashMLA -> ours: a (on our per-tensor FP8 grid) -> FlashMLA (latent: e4m3 per tile;
  # rope: bf16, round to nearest with 8 significant bits, <= 2**-8 relative) -> our FP8 again.
  s = cache.choose_scale(jnp.asarray(x))
  a = np.asarray(cache.dequantize(cache.quantize_rows(jnp.asarray(x), s), s), np.float64)
  packed2 = cache.to_flashmla_v32(jnp.asarray(a, jnp.float32))
  tile2 = np.repeat(np.asarray(packed2)[:, 512:528].copy().view("<f4"), 128, axis=-1)
  rt, s_rt = cache.from_flashmla_v32(packed2)
  b = np.asarray(cache.dequantize(rt, s_rt), np.float64)
  step1 = np.concatenate([_fp8_bound(a[:, :512], tile2), 2.0 ** -8 * np.abs(a[:, 512:])], -1)
  # the second quantization of v = a + d (|d| <= step1) errs by <= _fp8_bound(v, s_rt), which is
  # <= _fp8_bound(a, s_rt) + (2**-4 + 2**-22) * step1
  bound = step1 + _fp8_bound(a, float(s_rt)) + (E4M3_REL + F32_SLACK) * step1
  assert (np.abs(b - a) <= bound).all()


def test_from_flashmla_v32_to_bf16():
  """The bf16 import: exact where FlashMLA's tile scales are powers of two (its quantizer's, to_flashmla_v32's
  default: an e4m3 value times 2^k is a bf16 value, the rope part is bf16 already), one bf16 rounding (<= 2^-8
  relative) with other scales; kv_scale 1 unless given; a bad dtype names the argument."""
  rng = np.random.default_rng(11)
  x = (rng.standard_normal((2, 16, 576)) * 2.0 ** rng.integers(-6, 4, size=(2, 16, 1))).astype(np.float32)
  packed = cache.to_flashmla_v32(jnp.asarray(x))                     # power-of-two tile scales
  pages, kv_scale = cache.from_flashmla_v32(packed, dtype=jnp.bfloat16)
  assert pages.shape == (2, 16, 576) and pages.dtype == jnp.bfloat16 and float(kv_scale) == 1.0
  fm = np.asarray(cache.dequantize_flashmla_v32(packed), np.float32)
  np.testing.assert_array_equal(np.asarray(pages, np.float32), fm)
  p2, s2 = cache.from_flashmla_v32(packed, dtype=jnp.bfloat16, kv_scale=0.25)
  np.testing.assert_array_equal(np.asarray(cache.dequantize(p2, s2), np.float32), fm)   # 4 · fm is exact too
  rough = cache.to_flashmla_v32(jnp.asarray(x), power_of_two_scales=False)
  p3, _ = cache.from_flashmla_v32(rough, dtype=jnp.bfloat16)
  fm3 = np.asarray(cache.dequantize_flashmla_v32(rough), np.float64)
  assert (np.abs(np.asarray(p3, np.float64) - fm3) <= 2.0 ** -8 * np.abs(fm3)).all()
  with pytest.raises(ValueError, match="dtype must be float8_e4m3fn or bfloat16"):
    cache.from_flashmla_v32(packed, dtype=jnp.float16)


def test_to_flashmla_v32_exact_scales():
  rng = np.random.default_rng(9)
  x = rng.standard_normal((4, 576)).astype(np.float32)
  x[1, :128] = 0
  packed = np.asarray(cache.to_flashmla_v32(jnp.asarray(x, jnp.bfloat16), power_of_two_scales=False))
  scales = packed[:, 512:528].copy().view("<f4")
  xb = x.astype(BF16).astype(np.float32)
  # the library computes amax * f32(1/448) (XLA's rewrite of the division; within 1 ulp of it)
  want = np.abs(xb[:, :512].reshape(4, 4, 128)).max(-1) * np.float32(1 / 448)
  want[1, 0] = 1.0  # all-zero tile
  np.testing.assert_array_equal(scales, want)
  got = np.asarray(cache.dequantize_flashmla_v32(jnp.asarray(packed)), np.float64)
  assert (np.abs(got[:, :512] - xb[:, :512]) <= _fp8_bound(xb[:, :512], np.repeat(scales, 128, -1))).all()


def test_flashmla_errors():
  with pytest.raises(ValueError, match=r"packed must have shape \[num_pages, page_size, 656\]"):
    cache.from_flashmla_v32(jnp.zeros((16, 655), jnp.uint8))
  with pytest.raises(ValueError, match="packed must have dtype uint8/int8/float8_e4m3fn"):
    cache.from_flashmla_v32(jnp.zeros((16, 656), jnp.float32))
  with pytest.raises(ValueError, match=r"packed.shape\[1\] \(page_size\) must be a positive multiple"):
    cache.from_flashmla_v32(jnp.zeros((2, 24, 656), jnp.uint8))
  with pytest.raises(ValueError, match=r"rows must have shape \[..., 576\]"):
    cache.to_flashmla_v32(jnp.zeros((2, 512)))
  with pytest.raises(ValueError, match="kv_scale must be finite and > 0"):
    cache.from_flashmla_v32(jnp.zeros((16, 656), jnp.uint8), kv_scale=0.0)
