"""Argument checks shared by every op: scales (finite and > 0 wherever the value is known) and the page-size rule."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mla_pallas as mp
from mla_pallas import _checks, cache

BAD_SCALES = [-1.0, 0.0, float("nan"), float("inf")]


def _bad_scale_forms(v):
  """The same bad value as a python float, a NumPy scalar, and concrete JAX arrays (f32 / bf16)."""
  return [v, np.float32(v), jnp.float32(v), jnp.asarray(v, jnp.bfloat16)]


def _sparse_inputs(rng, page_size=16):
  pages = cache.allocate(4, page_size)
  q = jnp.asarray(rng.standard_normal((1, 1, 8, 576)), jnp.bfloat16)
  idx = jnp.asarray(rng.integers(0, 4 * page_size, (1, 1, 5)), jnp.int32)
  return q, pages, idx


@pytest.mark.parametrize("v", BAD_SCALES)
def test_scalar_check_rejects_concrete_bad_scales(v):
  for form in _bad_scale_forms(v):
    with pytest.raises(ValueError, match="kv_scale must be finite and > 0"):
      _checks.check_scalar("kv_scale", form, positive=True)


def test_scalar_check_accepts_traced_scales():
  # Inside jit the value is unknown when the op is called: no check, no error (the value is data).
  out = jax.jit(lambda s: _checks.check_scalar("kv_scale", s, positive=True) * 2)(jnp.float32(0.5))
  assert float(out) == 1.0


@pytest.mark.parametrize("v", BAD_SCALES)
def test_sparse_and_dense_decode_reject_bad_kv_scale(rng, v):
  q, pages, idx = _sparse_inputs(rng)
  bt = jnp.asarray([[0, 1]], jnp.int32)
  lens = jnp.asarray([20], jnp.int32)
  for form in _bad_scale_forms(v):
    with pytest.raises(ValueError, match="kv_scale"):
      mp.sparse_mla_decode(q, pages, idx, softmax_scale=0.1, kv_scale=form, impl="xla")
    with pytest.raises(ValueError, match="kv_scale"):
      mp.sparse_mla_prefill(q[0], pages, idx[0], softmax_scale=0.1, kv_scale=form, impl="xla")
    with pytest.raises(ValueError, match="kv_scale"):
      mp.dense_mla_decode(q, pages, bt, lens, softmax_scale=0.1, kv_scale=form, impl="xla")


@pytest.mark.parametrize("v", BAD_SCALES)
def test_cache_write_rejects_bad_kv_scale(rng, v):
  pages = cache.allocate(2, 16)
  rows = jnp.asarray(rng.standard_normal((3, 576)), jnp.float32)
  with pytest.raises(ValueError, match="kv_scale"):
    cache.write(pages, jnp.arange(3, dtype=jnp.int32), rows, kv_scale=jnp.float32(v))


@pytest.mark.parametrize("v", [-1.0, float("nan"), float("inf")])
def test_softmax_scale_must_be_finite_and_positive(rng, v):
  q, pages, idx = _sparse_inputs(rng)
  with pytest.raises(ValueError, match="softmax_scale"):
    mp.sparse_mla_decode(q, pages, idx, softmax_scale=v, impl="xla")


def test_valid_array_kv_scale_is_accepted(rng):
  q, pages, idx = _sparse_inputs(rng)
  o, lse = mp.sparse_mla_decode(q, pages, idx, softmax_scale=0.1, kv_scale=jnp.float32(0.5), impl="xla")
  assert o.shape == (1, 1, 8, 512) and lse.shape == (1, 1, 8)
@pytest.mark.parametrize("page_size", [8, 24, 0])
def test_page_size_rule_is_the_same_everywhere(rng, page_size):
  with pytest.raises(ValueError, match="multiple of 16"):
    cache.allocate(2, page_size)
  if page_size == 0:
    return
  # A hand-made paged cache with a page size the cache refuses is refused by the ops too.
  pages = jnp.zeros((4, page_size, 576), jnp.float8_e4m3fn)
  q = jnp.asarray(rng.standard_normal((1, 1, 8, 576)), jnp.bfloat16)
  idx = jnp.zeros((1, 1, 3), jnp.int32)
  with pytest.raises(ValueError, match="page_size.*multiple of 16"):
    mp.sparse_mla_decode(q, pages, idx, softmax_scale=0.1, impl="xla")
  with pytest.raises(ValueError, match="page_size.*multiple of 16"):
    mp.dense_mla_decode(q, pages, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32), softmax_scale=0.1,
                        impl="xla")
  # The flat [num_slots, 576] form has no page size and stays accepted by the sparse ops.
  flat = cache.flat_view(cache.allocate(2, 16))
  mp.sparse_mla_decode(q, flat, idx, softmax_scale=0.1, impl="xla")
