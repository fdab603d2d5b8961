"""mla_pallas.quant against the float64 NumPy oracle (tests/_np_oracle.py, hand-written e4m3 codec)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas import quant
try:
  from tests import _np_oracle as o
except ImportError:  # tests/ itself on sys.path (pytest rootdir-less runs)
  import _np_oracle as o

FP8 = quant.FP8


def _bits(x8):
  return o.fp8_bits(x8)


def _grid_bits(vals):
  """e4m3 grid values (float64) -> uint8 bit patterns via the oracle encoder."""
  return o.e4m3_encode(vals)


# ------------------------------------------------------------------------------------------------------------
# the oracle's codec itself (so that exact comparisons below mean something)
# ------------------------------------------------------------------------------------------------------------

def test_oracle_codec_matches_xla_cast_on_grid_midpoints_and_random():
  grid = o.e4m3_decode(np.arange(256, dtype=np.uint8))
  finite = np.unique(grid[np.isfinite(grid)])
  mids = (finite[:-1] + finite[1:]) / 2  # exact ties: must round to the even mantissa
  rng = np.random.default_rng(0)
  rand = rng.normal(size=2000) * np.exp2(rng.integers(-12, 10, size=2000))
  x = np.concatenate([finite, mids, mids + 1e-9, mids - 1e-9, rand, [500.0, -1e6, 448.0, 464.0]])
  x = x.astype(np.float32).astype(np.float64)  # XLA casts from f32; keep the inputs f32-exact
  got = _bits(jnp.clip(jnp.asarray(x, jnp.float32), -448, 448).astype(FP8))
  # exact: both are round-to-nearest-even onto the same grid
  np.testing.assert_array_equal(got, _grid_bits(o.e4m3_round(x)))


def test_fp8_constants():
  assert quant.FP8 == jnp.float8_e4m3fn
  assert quant.FP8_MAX == 448.0
  assert float(jnp.finfo(quant.FP8).max) == quant.FP8_MAX


# ------------------------------------------------------------------------------------------------------------
# quantize_fp8 / dequantize_fp8
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_fp8_matches_oracle_bitwise(dtype):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(7, 33)) * 30, dtype)
  scale = 0.173
  got = quant.quantize_fp8(x, scale)
  assert got.dtype == FP8 and got.shape == x.shape
  # exact: same f32 reciprocal and product (the pinned-down x/scale), then RNE onto the e4m3 grid
  np.testing.assert_array_equal(_bits(got), _grid_bits(o.quantize(x, scale)))


def test_quantize_fp8_saturates_and_keeps_nan():
  x = jnp.array([1e9, -1e9, jnp.inf, -jnp.inf, 449.0, 460.0, jnp.nan, 3.0], jnp.float32)
  got = np.asarray(quant.quantize_fp8(x, 1.0).astype(jnp.float32))
  # e4m3fn has no inf; an unclipped cast would give NaN, the contract clips to +-448
  np.testing.assert_array_equal(got[:6], [448, -448, 448, -448, 448, 448])
  assert np.isnan(got[6]) and got[7] == 3.0


def test_quantize_fp8_broadcast_scale():
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(5, 9)), jnp.float32)
  scale = jnp.asarray(rng.uniform(0.01, 0.1, size=(5, 1)), jnp.float32)
  got = quant.quantize_fp8(x, scale)
  np.testing.assert_array_equal(_bits(got), _grid_bits(o.quantize(x, np.asarray(scale))))


def test_dequantize_fp8_exact():
  rng = np.random.default_rng(3)
  x8 = jnp.asarray(rng.normal(size=(4, 6)) * 50, jnp.float32).astype(FP8)
  scale = np.float32(0.0371)
  got = quant.dequantize_fp8(x8, scale)
  assert got.dtype == jnp.float32
  # exact: a 4-bit-significand value times an f32 is exact in f64, so f32 rounding of it is the f32 product
  np.testing.assert_array_equal(np.asarray(got), (o.f64(x8) * np.float64(scale)).astype(np.float32))
  got16 = quant.dequantize_fp8(x8, scale, jnp.bfloat16)
  assert got16.dtype == jnp.bfloat16
  want = o.f64(x8) * np.float64(scale)
  # bf16 output: one rounding of the f32 product, relative error <= 2^-9 (+ the f32 product's 2^-24)
  np.testing.assert_allclose(o.f64(got16), want, rtol=2 ** -8, atol=0)


# ------------------------------------------------------------------------------------------------------------
# dynamic scales
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantize_rows_fp8(dtype):
  rng = np.random.default_rng(4)
  x = np.asarray(rng.normal(size=(3, 4, 37)) * rng.uniform(0.1, 100, size=(3, 4, 1)))
  x[1, 2] = 0.0  # an all-zero row gets scale 1
  x = jnp.asarray(x, dtype)
  x8, s = quant.quantize_rows_fp8(x)
  assert x8.dtype == FP8 and x8.shape == x.shape and s.shape == (3, 4) and s.dtype == jnp.float32
  want_vals, want_s = o.quantize_rows(x)
  # exact: scale = f32(amax) * f32(1/448) on both sides, then the same f32 quotient + RNE
  np.testing.assert_array_equal(np.asarray(s), want_s)
  assert float(s[1, 2]) == 1.0
  np.testing.assert_array_equal(_bits(x8), _grid_bits(want_vals))
  # every row's max element lands exactly on +-448 (amax / (amax/448) rounds to 448 or just above, clipped)
  amax_q = np.max(np.abs(o.f64(x8)), axis=-1)
  np.testing.assert_array_equal(np.delete(amax_q.reshape(-1), 1 * 4 + 2), 448.0)


def test_quantize_rows_fp8_other_axis():
  rng = np.random.default_rng(5)
  x = jnp.asarray(rng.normal(size=(6, 5)) * 7, jnp.float32)
  x8, s = quant.quantize_rows_fp8(x, axis=0)
  assert s.shape == (5,)
  want_vals, want_s = o.quantize_rows(np.asarray(x).T)
  # exact, same reasons as above
  np.testing.assert_array_equal(np.asarray(s), want_s)
  np.testing.assert_array_equal(_bits(x8), _grid_bits(want_vals.T))


def test_quantize_tensor_fp8():
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.normal(size=(3, 5, 7)) * 13, jnp.bfloat16)
  x8, s = quant.quantize_tensor_fp8(x)
  assert s.shape == () and s.dtype == jnp.float32
  want_vals, want_s = o.quantize_tensor(x)
  np.testing.assert_array_equal(np.float32(s), want_s)  # exact: same f32 formula
  np.testing.assert_array_equal(_bits(x8), _grid_bits(want_vals))
  _, s0 = quant.quantize_tensor_fp8(jnp.zeros((4,), jnp.float32))
  assert float(s0) == 1.0  # all-zero tensor: scale 1


# ------------------------------------------------------------------------------------------------------------
# blocks
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,block", [((2, 20, 37), (8, 16)), ((200, 130), (128, 128)),
                                         ((16, 32), (16, 32)), ((3, 5), (128, 128))])
def test_quantize_blocks_fp8_partial_edges(shape, block):
  rng = np.random.default_rng(7)
  w = rng.normal(size=shape) * rng.uniform(0.01, 10)
  w[..., : block[0], : block[1]] *= 100.0  # blocks of very different magnitude
  w = jnp.asarray(w, jnp.bfloat16)
  w8, sc = quant.quantize_blocks_fp8(w, block)
  kb, nb = -(-shape[-2] // block[0]), -(-shape[-1] // block[1])
  assert sc.shape == shape[:-2] + (kb, nb) and sc.dtype == jnp.float32
  want_vals, want_s = o.quantize_blocks(w, block)
  np.testing.assert_array_equal(np.asarray(sc), want_s)  # exact: same f32 amax * (1/448) per (partial) block
  np.testing.assert_array_equal(_bits(w8), _grid_bits(want_vals))  # exact: same f32 quotient + RNE
  back = quant.dequantize_blocks_fp8(w8, sc, block)
  # exact: f32 product of an e4m3 value and an f32 scale is the f64 product rounded once to f32
  np.testing.assert_array_equal(np.asarray(back), o.dequantize_blocks(w8, sc, block).astype(np.float32))


def test_quantize_blocks_zero_block_scale_one():
  rng = np.random.default_rng(8)
  w = rng.normal(size=(20, 20)).astype(np.float32)
  w[16:, :] = 0.0  # the partial bottom blocks are all zero
  w8, sc = quant.quantize_blocks_fp8(jnp.asarray(w), (16, 16))
  np.testing.assert_array_equal(np.asarray(sc[1]), [1.0, 1.0])
  assert np.all(o.f64(w8)[16:] == 0)


def test_blocks_round_trip_error_bound():
  rng = np.random.default_rng(9)
  w = jnp.asarray(rng.normal(size=(2, 150, 260)) * np.exp(rng.normal(size=(2, 150, 1))), jnp.bfloat16)
  w8, sc = quant.quantize_blocks_fp8(w)
  back = o.f64(quant.dequantize_blocks_fp8(w8, sc, dtype=jnp.bfloat16))
  w64 = o.f64(w)
  scale_full = np.asarray(quant.expand_block_scales(sc, w.shape))
  err = np.abs(back - w64)
  # e4m3 RNE: relative error <= 2^-4 for normals, absolute <= 2^-10 * scale in the subnormal range; the bf16
  # output adds one more rounding (2^-9 relative).
  bound = (2 ** -4 + 2 ** -9 + 2 ** -20) * np.abs(w64) + 2 ** -10 * scale_full * (1 + 2 ** -8)
  assert np.all(err <= bound)


# ------------------------------------------------------------------------------------------------------------
# validation / jit
# ------------------------------------------------------------------------------------------------------------

def test_validation_errors():
  w = jnp.ones((4, 4), jnp.float32)
  with pytest.raises(ValueError, match="block"):
    quant.quantize_blocks_fp8(w, (0, 4))
  with pytest.raises(ValueError, match="block"):
    quant.quantize_blocks_fp8(w, 4)
  with pytest.raises(ValueError, match="w "):
    quant.quantize_blocks_fp8(jnp.ones((4,), jnp.float32))
  with pytest.raises(ValueError, match="x "):
    quant.quantize_fp8(jnp.ones((4,), jnp.int32), 1.0)
  with pytest.raises(ValueError, match="x8"):
    quant.dequantize_fp8(w, 1.0)
  w8, sc = quant.quantize_blocks_fp8(w, (2, 2))
  with pytest.raises(ValueError, match="scales"):
    quant.dequantize_blocks_fp8(w8, sc[:1], (2, 2))
  with pytest.raises(ValueError, match="axis"):
    quant.quantize_rows_fp8(w, axis=2)


def test_jit():
  rng = np.random.default_rng(10)
  w = jnp.asarray(rng.normal(size=(40, 50)), jnp.float32)
  f = jax.jit(quant.quantize_blocks_fp8, static_argnums=1)
  w8, sc = f(w, (16, 16))
  w8e, sce = quant.quantize_blocks_fp8(w, (16, 16))
  np.testing.assert_array_equal(_bits(w8), _bits(w8e))  # exact: same ops
  np.testing.assert_array_equal(np.asarray(sc), np.asarray(sce))
  g = jax.jit(quant.quantize_rows_fp8)
  np.testing.assert_array_equal(_bits(g(w)[0]), _bits(quant.quantize_rows_fp8(w)[0]))
