"""mla_pallas.reference (float32 jnp) against the independent float64 NumPy oracle in tests/_np_oracle.py.

Tolerance model (used throughout, with the reason written next to each assertion):
* float32 math vs float64: dot products of length K carry a relative error ~K * 2^-24 of sum |a_i b_i|; for
  our tiny shapes 1e-5 relative (plus the same absolute amount of the operand scale) is a safe bound.
* bfloat16 outputs: one final rounding, relative error <= 2^-9; we allow 2^-8.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st, HealthCheck

from mla_pallas import quant
from mla_pallas import reference as ref

try:
  from tests import _np_oracle as o
except ImportError:  # tests/ itself on sys.path
  import _np_oracle as o

FP8 = quant.FP8
D = 576
DV = 512
SCALE = D ** -0.5
BAD = [-1, -7, -2 ** 31, 2 ** 31 - 1]  # always invalid; num_slots (+k) are added per test


# jitted entry points (one compile per shape instead of one per primitive; eager use is covered by the
# validation tests and test_eager_matches_jit)
sparse_decode = jax.jit(ref.sparse_mla_decode)
sparse_prefill = jax.jit(ref.sparse_mla_prefill)
dense_decode = jax.jit(ref.dense_mla_decode)
mla_prefill = jax.jit(ref.mla_prefill, static_argnames=("causal",))
rope = jax.jit(ref.rope, static_argnames=("interleaved",))
rms_norm = jax.jit(ref.rms_norm)
rope_rmsnorm = jax.jit(ref.rope_rmsnorm, static_argnames=("interleaved",))
quantize_write = jax.jit(ref.rope_rmsnorm_quantize_write, static_argnames=("interleaved",))
bmm = jax.jit(ref.quantize_and_bmm_fp8, static_argnames=("act_scale",))


# ------------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------------

def fp8_cache(rng, shape, sigma=1.5):
  x = np.clip(rng.normal(size=shape) * sigma, -448, 448).astype(np.float32)
  return jnp.asarray(x).astype(FP8)


def poison(cache, keep_slots):
  """NaN (bit pattern 0x7f) in every flat slot not in keep_slots; same shape/dtype."""
  a = np.asarray(cache)
  bits = a.view(np.uint8).reshape(-1, D).copy()
  keep = np.zeros(bits.shape[0], bool)
  keep[np.asarray(sorted(keep_slots), np.int64)] = True
  bits[~keep] = 0x7F
  return jnp.asarray(bits.view(a.dtype).reshape(a.shape))


def used_sparse_slots(indices, num_slots, topk_length=None):
  idx = np.asarray(indices)
  used = set()
  for b in range(idx.shape[0]):
    lim = idx.shape[-1] if topk_length is None else int(np.asarray(topk_length)[b])
    for s in range(idx.shape[1]):
      for j, v in enumerate(idx[b, s]):
        if j < lim and 0 <= v < num_slots:
          used.add(int(v))
  return used


def random_indices(rng, shape, num_slots, invalid_frac=0.3):
  idx = rng.integers(0, num_slots, size=shape).astype(np.int64)
  bad = np.array(BAD + [num_slots, num_slots + 1, num_slots + 1000])
  mask = rng.random(shape) < invalid_frac
  idx[mask] = rng.choice(bad, size=int(mask.sum()))
  if shape[-1] > 2:
    idx[..., 1] = idx[..., 0]  # duplicates count twice
  return idx.astype(np.int32)


def assert_out(got, want, *, what):
  """bf16 attention output vs float64: bf16 rounding (2^-8 rel) + f32 accumulation (1e-5 of the scale)."""
  assert got.dtype == jnp.bfloat16, what
  g = o.f64(got)
  assert not np.isnan(g).any(), f"{what}: NaN leaked"
  atol = 1e-5 * max(np.max(np.abs(want)), 1e-30)
  np.testing.assert_allclose(g, want, rtol=2 ** -8, atol=atol, err_msg=what)


def assert_lse(got, want, *, what):
  """f32 lse vs float64: f32 dot products of length <= 576 and exp/log sums, ~1e-6 relative; 1e-5 allowed.
  -inf positions (rows with nothing valid) must match exactly."""
  assert got.dtype == jnp.float32, what
  g = np.asarray(got, np.float64)
  np.testing.assert_array_equal(np.isneginf(g), np.isneginf(want), err_msg=what)
  fin = np.isfinite(want)
  assert np.all(np.isfinite(g[fin])), what
  np.testing.assert_allclose(g[fin], want[fin], rtol=1e-5, atol=1e-5, err_msg=what)


def assert_empty_rows(out, lse, want_lse):
  """Rows with no valid key: out exactly 0 and lse exactly -inf (contract)."""
  empty = np.isneginf(want_lse)
  assert np.all(o.f64(out)[empty] == 0.0)
  assert np.all(np.isneginf(np.asarray(lse)[empty]))
  return int(empty.sum())


# ------------------------------------------------------------------------------------------------------------
# sparse decode / prefill
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size,s_q,topk,qdtype,seed", [
    (16, 1, 5, jnp.bfloat16, 11),
    (64, 2, 37, jnp.float32, 12),
    (16, 3, 37, jnp.bfloat16, 13),
    (64, 1, 1, jnp.bfloat16, 14),
])
def test_sparse_decode_matches_oracle(page_size, s_q, topk, qdtype, seed):
  rng = np.random.default_rng(seed)
  b, h, num_pages = 3, 3, 4
  num_slots = num_pages * page_size
  cache = fp8_cache(rng, (num_pages, page_size, D))
  q = jnp.asarray(rng.normal(size=(b, s_q, h, D)), qdtype)
  idx = random_indices(rng, (b, s_q, topk), num_slots)
  idx[0, 0, :] = -1  # one row with nothing valid
  topk_length = np.array([topk + 3, 0, max(topk // 2, 1)], np.int32)  # > topk, 0, partial
  if topk > 1:
    idx[2, -1, topk // 2:] = rng.integers(0, num_slots, size=topk - topk // 2)  # valid ids past the length
  kv_scale = 0.37
  cache = poison(cache, used_sparse_slots(idx, num_slots, topk_length))  # NaN wherever nothing may read
  out, lse = sparse_decode(q, cache, jnp.asarray(idx), softmax_scale=SCALE, kv_scale=kv_scale,
                                   topk_length=jnp.asarray(topk_length))
  assert out.shape == (b, s_q, h, DV) and lse.shape == (b, s_q, h)
  want_out, want_lse = o.sparse_decode(q, cache, idx, SCALE, kv_scale, topk_length)
  assert_out(out, want_out, what="out")
  assert_lse(lse, want_lse, what="lse")
  assert assert_empty_rows(out, lse, want_lse) >= 1 + s_q * h  # row (0,0) and all of batch 1 (length 0)


def test_sparse_decode_without_topk_length_and_paged_vs_flat_identical():
  rng = np.random.default_rng(21)
  b, s_q, h, topk, num_pages, page_size = 2, 2, 4, 37, 3, 64
  num_slots = num_pages * page_size
  idx = random_indices(rng, (b, s_q, topk), num_slots)
  cache = poison(fp8_cache(rng, (num_pages, page_size, D)), used_sparse_slots(idx, num_slots))
  q = jnp.asarray(rng.normal(size=(b, s_q, h, D)), jnp.bfloat16)
  paged = sparse_decode(q, cache, jnp.asarray(idx), softmax_scale=SCALE)
  flat = sparse_decode(q, cache.reshape(num_slots, D), jnp.asarray(idx), softmax_scale=SCALE)
  # identical: the paged cache is just a reshape of the flat one (slot = page * page_size + offset)
  np.testing.assert_array_equal(o.f64(paged[0]), o.f64(flat[0]))
  np.testing.assert_array_equal(np.asarray(paged[1]), np.asarray(flat[1]))
  want_out, want_lse = o.sparse_decode(q, cache, idx, SCALE)
  assert_out(paged[0], want_out, what="out")
  assert_lse(paged[1], want_lse, what="lse")


def test_sparse_decode_all_invalid_is_zero_and_neg_inf():
  rng = np.random.default_rng(22)
  num_slots = 32
  cache = poison(fp8_cache(rng, (num_slots, D)), [])  # every row NaN: nothing may be read
  idx = np.array(BAD + [num_slots, num_slots + 3], np.int32).reshape(1, 1, 6)
  q = jnp.asarray(rng.normal(size=(1, 1, 2, D)), jnp.float32)
  out, lse = sparse_decode(q, cache, jnp.asarray(idx), softmax_scale=SCALE)
  # contract: exactly 0 and -inf, no NaN from the poisoned rows
  assert np.all(o.f64(out) == 0.0) and np.all(np.isneginf(np.asarray(lse)))


def test_sparse_decode_duplicates_count_twice():
  rng = np.random.default_rng(23)
  cache = fp8_cache(rng, (16, D))
  q = jnp.asarray(rng.normal(size=(1, 1, 1, D)), jnp.float32)
  o1, l1 = sparse_decode(q, cache, jnp.asarray([[[3, 3, 5]]], jnp.int32), softmax_scale=SCALE)
  want_out, want_lse = o.sparse_decode(q, cache, np.array([[[3, 3, 5]]]), SCALE)
  assert_out(o1, want_out, what="dup out")
  assert_lse(l1, want_lse, what="dup lse")
  # and a duplicate really changes the result vs. listing the slot once (weights 2:1, not 1:1)
  o2, _ = sparse_decode(q, cache, jnp.asarray([[[3, 5, -1]]], jnp.int32), softmax_scale=SCALE)
  assert np.max(np.abs(o.f64(o1) - o.f64(o2))) > 1e-2


def test_sparse_prefill_matches_oracle():
  rng = np.random.default_rng(24)
  t, h, topk, num_slots = 6, 2, 5, 48
  kv = fp8_cache(rng, (num_slots, D))
  idx = random_indices(rng, (t, topk), num_slots)
  tl = np.array([5, 0, 3, 9, 1, 2], np.int32)
  kv = poison(kv, used_sparse_slots(idx[:, None], num_slots, tl))
  q = jnp.asarray(rng.normal(size=(t, h, D)), jnp.bfloat16)
  out, lse = sparse_prefill(q, kv, jnp.asarray(idx), softmax_scale=SCALE, kv_scale=1.25,
                                    topk_length=jnp.asarray(tl))
  assert out.shape == (t, h, DV) and lse.shape == (t, h)
  want_out, want_lse = o.sparse_decode(np.asarray(q.astype(jnp.float32))[:, None], kv, idx[:, None], SCALE,
                                       1.25, tl)
  assert_out(out, want_out[:, 0], what="out")
  assert_lse(lse, want_lse[:, 0], what="lse")
  assert assert_empty_rows(out, lse, want_lse[:, 0]) >= h  # token 1 has topk_length 0
  # paged view of the same cache gives bitwise the same result
  out2, lse2 = sparse_prefill(q, kv.reshape(3, 16, D), jnp.asarray(idx), softmax_scale=SCALE,
                                      kv_scale=1.25, topk_length=jnp.asarray(tl))
  np.testing.assert_array_equal(o.f64(out2), o.f64(out))
  np.testing.assert_array_equal(np.asarray(lse2), np.asarray(lse))


@settings(max_examples=25, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_sparse_decode_masking(data):
  b, s_q, h, topk, num_slots = 2, 2, 2, 6, 32
  choices = st.one_of(st.integers(0, num_slots - 1),
                      st.sampled_from([-1, -2, num_slots, num_slots + 1, 2 ** 31 - 1, -2 ** 31]))
  flat = data.draw(st.lists(choices, min_size=b * s_q * topk, max_size=b * s_q * topk))
  idx = np.array(flat, np.int64).reshape(b, s_q, topk).astype(np.int32)
  use_len = data.draw(st.booleans())
  tl = np.array(data.draw(st.lists(st.integers(-2, topk + 2), min_size=b, max_size=b)), np.int32)
  tl = tl if use_len else None
  rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 16)))
  cache = poison(fp8_cache(rng, (2, 16, D)), used_sparse_slots(idx, num_slots, tl))
  q = jnp.asarray(rng.normal(size=(b, s_q, h, D)), jnp.bfloat16)
  out, lse = _jit_sparse(q, cache, jnp.asarray(idx), None if tl is None else jnp.asarray(tl))
  want_out, want_lse = o.sparse_decode(q, cache, idx, SCALE, 0.5, tl)
  assert_out(out, want_out, what="fuzz out")
  assert_lse(lse, want_lse, what="fuzz lse")
  assert_empty_rows(out, lse, want_lse)


@jax.jit
def _jit_sparse(q, cache, idx, tl):
  return ref.sparse_mla_decode(q, cache, idx, softmax_scale=SCALE, kv_scale=0.5, topk_length=tl)


# ------------------------------------------------------------------------------------------------------------
# dense decode
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("s_q", [1, 3])
@pytest.mark.parametrize("causal", [False, True])
def test_dense_decode_matches_oracle(page_size, s_q, causal):
  rng = np.random.default_rng(100 + page_size + 10 * s_q + int(causal))
  h, num_pages = 2, 7
  seqlens = np.array([1, page_size + 1, 2 * page_size + 5, 0, 2], np.int32)
  b, max_pages = len(seqlens), 3
  perm = rng.permutation(num_pages)
  table = np.full((b, max_pages), -1, np.int32)
  used, nxt = set(), 0
  for i, n in enumerate(seqlens):
    npg = -(-int(n) // page_size)
    for j in range(npg):
      # pages are shared round-robin among sequences (allowed: a prefix cache can share pages)
      table[i, j] = perm[nxt % num_pages]
      nxt += 1
      for p in range(j * page_size, min(n, (j + 1) * page_size)):
        used.add(int(table[i, j]) * page_size + p % page_size)
  cache = poison(fp8_cache(rng, (num_pages, page_size, D)), used)  # NaN past every sequence end
  q = jnp.asarray(rng.normal(size=(b, s_q, h, D)), jnp.bfloat16)
  out, lse = dense_decode(q, cache, jnp.asarray(table), jnp.asarray(seqlens), softmax_scale=SCALE,
                                  kv_scale=0.8, causal=causal)
  assert out.shape == (b, s_q, h, DV) and lse.shape == (b, s_q, h)
  want_out, want_lse = o.dense_decode(q, cache, table, seqlens, SCALE, 0.8, causal)
  assert_out(out, want_out, what="out")
  assert_lse(lse, want_lse, what="lse")
  n_empty = assert_empty_rows(out, lse, want_lse)
  # seqlen 0 gives empty rows; causal with seqlen < s_q too (seqlen 1 and 2 with s_q 3)
  assert n_empty == s_q * h + (h * (2 + 1) if causal and s_q == 3 else 0)


def test_dense_decode_causal_last_token_equals_noncausal():
  rng = np.random.default_rng(31)
  cache = fp8_cache(rng, (4, 16, D))
  table = jnp.asarray([[2, 0, 3], [1, -1, -1]], jnp.int32)
  seqlens = jnp.asarray([40, 9], jnp.int32)
  q = jnp.asarray(rng.normal(size=(2, 2, 2, D)), jnp.float32)
  oc, lc = dense_decode(q, cache, table, seqlens, softmax_scale=SCALE, causal=True)
  on, ln = dense_decode(q, cache, table, seqlens, softmax_scale=SCALE, causal=False)
  # the last query token sees the whole sequence either way: identical computation
  np.testing.assert_array_equal(o.f64(oc[:, -1]), o.f64(on[:, -1]))
  np.testing.assert_array_equal(np.asarray(lc[:, -1]), np.asarray(ln[:, -1]))
  # the first one sees one position less
  assert np.max(np.abs(np.asarray(lc[:, 0]) - np.asarray(ln[:, 0]))) > 1e-4


# ------------------------------------------------------------------------------------------------------------
# varlen prefill
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_mla_prefill_matches_oracle(causal, dtype):
  rng = np.random.default_rng(40 + int(causal))
  cu = np.array([0, 3, 3, 10, 17], np.int32)  # lengths 3, 0, 7, 7; tokens 17, 18 belong to no sequence
  t, h, dqk, dv = 19, 2, 24, 16
  q = jnp.asarray(rng.normal(size=(t, h, dqk)), dtype)
  k = jnp.asarray(rng.normal(size=(t, h, dqk)), dtype)
  v = jnp.asarray(rng.normal(size=(t, h, dv)), dtype)
  sc = dqk ** -0.5
  out, lse = mla_prefill(q, k, v, jnp.asarray(cu), softmax_scale=sc, causal=causal)
  assert out.shape == (t, h, dv) and lse.shape == (t, h)
  want_out, want_lse = o.varlen_attention(q, k, v, cu, sc, causal)
  assert_out(out, want_out, what="out")
  assert_lse(lse, want_lse, what="lse")
  assert assert_empty_rows(out, lse, want_lse) == 2 * h  # the two trailing tokens


@pytest.mark.parametrize("causal", [True, False])
def test_mla_prefill_separate_keys_matches_oracle(causal):
  """cu_seqlens_k: keys packed on their own; sequences with context (Lk > Lq), none (Lk = Lq), fewer keys than
  queries (Lk < Lq: the first Lq - Lk queries attend nothing under causal), no queries, no keys; padding on both
  sides."""
  rng = np.random.default_rng(44 + int(causal))
  cu = np.array([1, 4, 4, 11, 17, 18], np.int32)       # Lq 3, 0, 7, 6, 1; tokens 0, 18, 19 padding
  cu_k = np.array([0, 20, 23, 30, 33, 33], np.int32)   # Lk 20, 3, 7, 3, 0; keys 33, 34 padding
  t, tk, h, dqk, dv = 20, 35, 2, 24, 16
  q = jnp.asarray(rng.normal(size=(t, h, dqk)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(tk, h, dqk)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(tk, h, dv)), jnp.float32)
  out, lse = mla_prefill(q, k, v, jnp.asarray(cu), softmax_scale=0.3, causal=causal, cu_seqlens_k=jnp.asarray(cu_k))
  assert out.shape == (t, h, dv) and lse.shape == (t, h)
  want_out, want_lse = o.varlen_attention(q, k, v, cu, 0.3, causal, cu_seqlens_k=cu_k)
  assert_out(out, want_out, what="out")
  assert_lse(lse, want_lse, what="lse")
  # padding tokens 0, 18, 19, the keyless sequence 4 and (causal) the first 3 queries of sequence 3
  assert assert_empty_rows(out, lse, want_lse) == (3 + 1 + 3 * int(causal)) * h
  # the same keys passed as the query tokens: cu_seqlens_k = cu_seqlens is the one-array form
  same, same_lse = mla_prefill(q, q, q[..., :dv], jnp.asarray(cu), softmax_scale=0.3, causal=causal,
                               cu_seqlens_k=jnp.asarray(cu))
  one, one_lse = mla_prefill(q, q, q[..., :dv], jnp.asarray(cu), softmax_scale=0.3, causal=causal)
  np.testing.assert_array_equal(o.f64(same), o.f64(one))
  np.testing.assert_array_equal(np.asarray(same_lse), np.asarray(one_lse))


def test_mla_prefill_sequences_do_not_interact():
  rng = np.random.default_rng(42)
  cu = jnp.asarray([0, 4, 9], jnp.int32)
  q, k, v = (jnp.asarray(rng.normal(size=(9, 2, 8)), jnp.float32) for _ in range(3))
  out, _ = mla_prefill(q, k, v, cu, softmax_scale=0.3, causal=False)
  v2 = v.at[4:].set(jnp.nan)  # poison sequence 1; sequence 0 must not see it
  k2 = k.at[4:].set(1e4)
  out2, lse2 = mla_prefill(q, k2, v2, cu, softmax_scale=0.3, causal=False)
  np.testing.assert_array_equal(o.f64(out2[:4]), o.f64(out[:4]))  # same computation for sequence 0
  assert np.all(np.isnan(o.f64(out2[4:])))  # sequence 1's own NaN values do reach its own outputs
  # padding tokens (outside cu_seqlens) holding NaN are never read either
  cu_pad = jnp.asarray([0, 4, 7], jnp.int32)
  ref_out, _ = mla_prefill(q, k, v, cu_pad, softmax_scale=0.3, causal=True)
  nan_out, nan_lse = mla_prefill(q.at[7:].set(jnp.nan), k.at[7:].set(jnp.nan), v.at[7:].set(jnp.nan),
                                     cu_pad, softmax_scale=0.3, causal=True)
  np.testing.assert_array_equal(o.f64(nan_out), o.f64(ref_out))  # same ops on the same valid values
  assert np.all(o.f64(nan_out[7:]) == 0) and np.all(np.isneginf(np.asarray(nan_lse[7:])))


# ------------------------------------------------------------------------------------------------------------
# rope / rms norm
# ------------------------------------------------------------------------------------------------------------

def test_rope_tables_match_oracle():
  cos, sin = ref.rope_tables(50, 64, 10000.0)
  assert cos.shape == (50, 32) and cos.dtype == jnp.float32
  wc, ws = o.rope_tables(50, 64, 10000.0)
  # float64 values rounded once to f32: relative 2^-24 (2^-23 allows for libm ulp differences in f64)
  np.testing.assert_allclose(np.asarray(cos, np.float64), wc, rtol=2 ** -23, atol=1e-300)
  np.testing.assert_allclose(np.asarray(sin, np.float64), ws, rtol=2 ** -23, atol=1e-300)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rope_matches_oracle(interleaved, dtype):
  rng = np.random.default_rng(50 + int(interleaved))
  max_pos = 300
  cos, sin = ref.rope_tables(max_pos)
  x = jnp.asarray(rng.normal(size=(5, 3, 64)) * 3, dtype)
  pos = jnp.asarray(rng.integers(0, max_pos, size=5), jnp.int32)
  got = rope(x, pos, cos, sin, interleaved=interleaved)
  assert got.dtype == dtype and got.shape == x.shape
  want = (o.rope_interleaved_complex if interleaved else o.rope_half_split)(x, pos, cos, sin)
  amax = np.max(np.abs(o.f64(x)))
  if dtype == jnp.float32:
    # f32: two products and a sum per component, ~2 ulp of |x|
    np.testing.assert_allclose(o.f64(got), want, rtol=1e-6, atol=1e-6 * amax)
  else:
    # bf16 output rounding 2^-9 relative (+ f32 cancellation noise)
    np.testing.assert_allclose(o.f64(got), want, rtol=2 ** -8, atol=1e-6 * amax)
  # full-shape positions give the same result as broadcast ones
  full = rope(x, jnp.broadcast_to(pos[:, None], (5, 3)), cos, sin, interleaved=interleaved)
  # same ops on the same values (up to FMA contraction choices: a few f32 ulps, then bf16 rounding)
  np.testing.assert_allclose(o.f64(full), o.f64(got), rtol=2 ** -8 if dtype == jnp.bfloat16 else 1e-6,
                             atol=1e-6 * amax)


def test_rope_pairings_are_permutations_of_each_other():
  rng = np.random.default_rng(52)
  cos, sin = ref.rope_tables(64)
  x = jnp.asarray(rng.normal(size=(4, 64)), jnp.float32)
  pos = jnp.asarray([0, 5, 17, 63], jnp.int32)
  perm = np.concatenate([np.arange(0, 64, 2), np.arange(1, 64, 2)])  # interleaved -> half-split order
  a = rope(x, pos, cos, sin, interleaved=True)
  b = rope(x[:, perm], pos, cos, sin, interleaved=False)
  # same arithmetic on permuted lanes; XLA may contract a*c - b*s into an FMA differently for the two
  # layouts, so allow 4 f32 ulps of the largest |x| (< 4 here)
  assert np.abs(np.asarray(x)).max() < 4
  np.testing.assert_allclose(np.asarray(a)[:, perm], np.asarray(b), rtol=0,
                             atol=4 * np.spacing(np.float32(4)))
  # and position 0 is the identity
  np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(x[0]))


def test_rope_clamps_out_of_range_positions():
  cos, sin = ref.rope_tables(8)
  x = jnp.asarray(np.random.default_rng(53).normal(size=(3, 64)), jnp.float32)
  got = rope(x, jnp.asarray([100, -4, 7], jnp.int32), cos, sin)
  want = rope(x, jnp.asarray([7, 0, 7], jnp.int32), cos, sin)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # documented clamp to [0, max_pos)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_rms_norm_matches_oracle(dtype):
  rng = np.random.default_rng(60)
  x = jnp.asarray(rng.normal(size=(4, 3, 512)) * 5 + 1, dtype)
  w = jnp.asarray(rng.uniform(0.5, 1.5, size=512), dtype)
  got = rms_norm(x, w, 1e-6)
  assert got.dtype == dtype and got.shape == x.shape
  want = o.rms_norm(x, w, 1e-6)
  # f32: a 512-term mean (~1e-6 rel) and an rsqrt (few ulp); bf16: output rounding 2^-9
  rtol = 1e-5 if dtype == jnp.float32 else 2 ** -8
  np.testing.assert_allclose(o.f64(got), want, rtol=rtol, atol=0)


def test_rope_rmsnorm_matches_oracle():
  rng = np.random.default_rng(61)
  t, h = 6, 4
  cos, sin = ref.rope_tables(100)
  kv = jnp.asarray(rng.normal(size=(t, D)) * 2, jnp.bfloat16)
  qr = jnp.asarray(rng.normal(size=(t, h, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.uniform(0.5, 1.5, size=512), jnp.bfloat16)
  pos = jnp.asarray(rng.integers(0, 100, size=t), jnp.int32)
  for inter in (True, False):
    kv_out, q_out = rope_rmsnorm(kv, qr, pos, cos, sin, w, eps=1e-6, interleaved=inter)
    assert kv_out.dtype == jnp.bfloat16 and kv_out.shape == (t, D) and q_out.shape == (t, h, 64)
    want_kv, want_q = o.rope_rmsnorm(kv, qr, pos, cos, sin, w, 1e-6, inter)
    # bf16 outputs: 2^-8 relative; rope components can cancel, so + f32 noise of the input scale
    np.testing.assert_allclose(o.f64(kv_out), want_kv, rtol=2 ** -8, atol=1e-5)
    np.testing.assert_allclose(o.f64(q_out), want_q, rtol=2 ** -8, atol=1e-5)


def _write_inputs(rng, t, h=2):
  cos, sin = ref.rope_tables(128)
  kv = jnp.asarray(rng.normal(size=(t, D)) * 2, jnp.bfloat16)
  qr = jnp.asarray(rng.normal(size=(t, h, 64)), jnp.bfloat16)
  w = jnp.asarray(rng.uniform(0.5, 1.5, size=512), jnp.bfloat16)
  pos = jnp.asarray(rng.integers(0, 128, size=t), jnp.int32)
  return kv, qr, pos, cos, sin, w


def _check_written_row(got_bits, want_vals, what):
  """fp8 written row vs oracle: the reference rounds f32 rows, the oracle f64 rows, so a value lying within
  ~1e-6 relative of an e4m3 midpoint may land on the neighbouring code. Allow a handful of such flips, each
  exactly one code apart; everything else bitwise."""
  want_bits = o.e4m3_encode(want_vals)
  diff = got_bits.astype(np.int32) - want_bits.astype(np.int32)
  assert np.all(np.abs(diff) <= 1), what
  assert np.count_nonzero(diff) <= max(2, diff.size // 1000), what


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_rmsnorm_quantize_write(paged, interleaved):
  rng = np.random.default_rng(70 + 2 * int(paged) + int(interleaved))
  num_pages, page_size, t = 4, 16, 7
  num_slots = num_pages * page_size
  pages = fp8_cache(rng, (num_pages, page_size, D), sigma=20.0)
  pages = poison(pages, set(range(num_slots)) - {3, 40, 41})  # a few NaN rows that must stay NaN
  if not paged:
    pages = pages.reshape(num_slots, D)
  slots = np.array([37, -1, 5, 60, 12, -1, 0], np.int32)  # out of order, with skipped (-1) tokens
  kv, qr, pos, cos, sin, w = _write_inputs(rng, t)
  kv_scale = 0.01  # small enough that the largest rows exceed 448 and get clipped
  before = np.asarray(pages).view(np.uint8).reshape(num_slots, D).copy()
  new_pages, q_out = quantize_write(pages, kv, qr, pos, cos, sin, w, eps=1e-6,
                                                     kv_scale=kv_scale, slots=jnp.asarray(slots),
                                                     interleaved=interleaved)
  assert new_pages.shape == pages.shape and new_pages.dtype == FP8
  after = np.asarray(new_pages).view(np.uint8).reshape(num_slots, D)
  written = slots[slots >= 0]
  untouched = np.setdiff1d(np.arange(num_slots), written)
  np.testing.assert_array_equal(after[untouched], before[untouched])  # bitwise untouched (incl. NaN rows)
  rows, want_q = o.rope_rmsnorm(kv, qr, pos, cos, sin, w, 1e-6, interleaved)
  for tok, s in enumerate(slots):
    if s >= 0:
      _check_written_row(after[s], o.e4m3_round(rows[tok] / kv_scale), f"token {tok} slot {s}")
  assert np.abs(rows / kv_scale).max() > 448  # the clip to +-448 was exercised
  # q rope output: bf16 rounding 2^-8 relative + f32 noise
  np.testing.assert_allclose(o.f64(q_out), want_q, rtol=2 ** -8, atol=1e-5)


def test_quantize_write_duplicates_last_wins_and_out_of_range_skipped():
  rng = np.random.default_rng(75)
  pages = fp8_cache(rng, (2, 16, D))
  kv, qr, pos, cos, sin, w = _write_inputs(rng, 4)
  slots = jnp.asarray([9, 9, 32, 1000], jnp.int32)  # 32 == num_slots and 1000 are skipped
  new, _ = quantize_write(pages, kv, qr, pos, cos, sin, w, eps=1e-6, kv_scale=1.0,
                                           slots=slots)
  solo, _ = quantize_write(pages, kv[1:2], qr[1:2], pos[1:2], cos, sin, w, eps=1e-6,
                                            kv_scale=1.0, slots=slots[1:2])
  # bitwise: only token 1's row lands in slot 9, nothing else changes
  np.testing.assert_array_equal(np.asarray(new).view(np.uint8), np.asarray(solo).view(np.uint8))


# ------------------------------------------------------------------------------------------------------------
# FP8 GEMM and weight conversion
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("act_scale", ["per_token", "per_tensor"])
def test_quantize_and_bmm_fp8(act_scale):
  rng = np.random.default_rng(80 + (act_scale == "per_tensor"))
  t, h, k, n = 3, 2, 200, 130  # K, N not multiples of 128: partial weight blocks
  a = rng.normal(size=(t, h, k)) * rng.uniform(0.1, 10, size=(t, h, 1))
  a[1, 0] = 0.0  # all-zero row: per-token scale 1, output row 0
  a = jnp.asarray(a, jnp.bfloat16)
  w8, ws = quant.quantize_blocks_fp8(jnp.asarray(rng.normal(size=(h, k, n)) * 0.02, jnp.float32))
  got = bmm(a, w8, ws, act_scale=act_scale)
  assert got.shape == (t, h, n) and got.dtype == jnp.bfloat16
  if act_scale == "per_token":
    av, asc = o.quantize_rows(a)
    a_deq = av * asc[..., None].astype(np.float64)
  else:
    av, asc = o.quantize_tensor(a)
    a_deq = av * np.float64(asc)
  w_deq = o.dequantize_blocks(w8, ws)
  want = np.einsum("thk,hkn->thn", a_deq, w_deq)
  bound = np.einsum("thk,hkn->thn", np.abs(a_deq), np.abs(w_deq))
  # bf16 output 2^-8 relative; f32 accumulation over K terms: <= K * 2^-24 * sum |a||w| (elementwise)
  err = np.abs(o.f64(got) - want)
  assert np.all(err <= 2 ** -8 * np.abs(want) + k * 2 ** -24 * bound + 1e-30)
  assert np.all(o.f64(got)[1, 0] == 0)


def test_convert_round_trip_and_oracle():
  rng = np.random.default_rng(90)
  w = rng.normal(size=(2, 200, 130)) * np.exp(rng.normal(size=(2, 200, 1)))
  w[0, 128:, 128:] = 0.0  # an all-zero (partial) block: scale 1
  w = jnp.asarray(w, jnp.bfloat16)
  w8, sc = ref.convert_bf16_to_fp8_e4m3fn(w)
  assert w8.dtype == FP8 and sc.shape == (2, 2, 2) and sc.dtype == jnp.float32
  assert float(sc[0, 1, 1]) == 1.0
  want_vals, want_s = o.quantize_blocks(w)
  np.testing.assert_array_equal(np.asarray(sc), want_s)  # exact: same f32 amax * (1/448)
  np.testing.assert_array_equal(o.fp8_bits(w8), o.e4m3_encode(want_vals))  # exact: same f32 quotient + RNE
  back = ref.convert_fp8_e4m3fn_to_bf16(w8, sc)
  assert back.dtype == jnp.bfloat16 and back.shape == w.shape
  w64, b64 = o.f64(w), o.f64(back)
  bk = bn = 128
  for lead in range(2):
    for i in range(2):
      for j in range(2):
        blk = (lead, slice(i * bk, (i + 1) * bk), slice(j * bn, (j + 1) * bn))
        amax = np.max(np.abs(w64[blk]))
        # e4m3 relative error 2^-4 of the block max, + the bf16 output rounding (2^-9 relative)
        assert np.max(np.abs(b64[blk] - w64[blk])) <= (2 ** -4 + 2 ** -9) * amax


# ------------------------------------------------------------------------------------------------------------
# the comparisons can fail (mutation sanity)
# ------------------------------------------------------------------------------------------------------------

def test_mutations_are_detected():
  rng = np.random.default_rng(99)
  num_slots, topk = 64, 9
  cache = fp8_cache(rng, (num_slots, D))
  idx = random_indices(rng, (2, 1, topk), num_slots, invalid_frac=0.2)
  q = jnp.asarray(rng.normal(size=(2, 1, 2, D)), jnp.float32)
  want_out, want_lse = o.sparse_decode(q, cache, idx, SCALE)

  def fails(out, lse):
    try:
      assert_out(out, want_out, what="m")
      assert_lse(lse, want_lse, what="m")
    except AssertionError:
      return True
    return False

  ok = sparse_decode(q, cache, jnp.asarray(idx), softmax_scale=SCALE)
  assert not fails(*ok)
  # 2 % wrong softmax scale
  assert fails(*sparse_decode(q, cache, jnp.asarray(idx), softmax_scale=SCALE * 1.02))
  # rope part of q dropped
  assert fails(*sparse_decode(q.at[..., DV:].set(0), cache, jnp.asarray(idx), softmax_scale=SCALE))
  # kv_scale ignored
  assert fails(*sparse_decode(q, cache, jnp.asarray(idx), softmax_scale=SCALE, kv_scale=1.01))
  # one extra (masked) index treated as valid
  idx2 = idx.copy()
  idx2[idx2 < 0] = 0
  idx2[idx2 >= num_slots] = 0
  assert fails(*sparse_decode(q, cache, jnp.asarray(idx2), softmax_scale=SCALE))
  # wrong rope pairing
  cos, sin = ref.rope_tables(32)
  x = jnp.asarray(rng.normal(size=(3, 64)), jnp.float32)
  pos = jnp.asarray([3, 9, 30], jnp.int32)
  with pytest.raises(AssertionError):
    np.testing.assert_allclose(o.f64(rope(x, pos, cos, sin, interleaved=False)),
                               o.rope_interleaved_complex(x, pos, cos, sin), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------------------
# validation and jit
# ------------------------------------------------------------------------------------------------------------

def test_validation_errors_name_the_argument():
  cache = jnp.zeros((2, 16, D), FP8)
  q = jnp.zeros((1, 1, 2, D), jnp.bfloat16)
  idx = jnp.zeros((1, 1, 4), jnp.int32)
  with pytest.raises(ValueError, match="^q "):
    ref.sparse_mla_decode(q[..., :512], cache, idx, softmax_scale=1.0)
  with pytest.raises(ValueError, match="^kv_cache"):
    ref.sparse_mla_decode(q, cache[..., :512], idx, softmax_scale=1.0)
  with pytest.raises(ValueError, match="^kv_cache"):
    ref.sparse_mla_decode(q, jnp.zeros((32, D), jnp.int8), idx, softmax_scale=1.0)
  with pytest.raises(ValueError, match="^indices"):
    ref.sparse_mla_decode(q, cache, idx.astype(jnp.float32), softmax_scale=1.0)
  with pytest.raises(ValueError, match="^indices"):
    ref.sparse_mla_decode(q, cache, idx[0], softmax_scale=1.0)
  with pytest.raises(ValueError, match="^topk_length"):
    ref.sparse_mla_decode(q, cache, idx, softmax_scale=1.0, topk_length=jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match="^kv_cache"):
    ref.dense_mla_decode(q, cache.reshape(32, D), jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32),
                         softmax_scale=1.0)
  with pytest.raises(ValueError, match="^block_table"):
    ref.dense_mla_decode(q, cache, jnp.zeros((2, 2), jnp.int32), jnp.ones((1,), jnp.int32), softmax_scale=1.0)
  with pytest.raises(ValueError, match="^act_scale"):
    ref.quantize_and_bmm_fp8(jnp.zeros((1, 1, 8), jnp.bfloat16), jnp.zeros((1, 8, 8), FP8),
                             jnp.ones((1, 1, 1), jnp.float32), act_scale="per_row")
  with pytest.raises(ValueError, match="^w_scale"):
    ref.quantize_and_bmm_fp8(jnp.zeros((1, 1, 8), jnp.bfloat16), jnp.zeros((1, 8, 8), FP8),
                             jnp.ones((1, 2, 1), jnp.float32))
  cos, sin = ref.rope_tables(8)
  with pytest.raises(ValueError, match="^positions"):
    ref.rope(jnp.zeros((3, 64)), jnp.zeros((4,), jnp.int32), cos, sin)
  with pytest.raises(ValueError, match="^cos"):
    ref.rope(jnp.zeros((3, 64)), jnp.zeros((3,), jnp.int32), cos[:, :16], sin)
  with pytest.raises(ValueError, match="^weight"):
    ref.rms_norm(jnp.zeros((3, 64)), jnp.zeros((32,)), 1e-6)
  with pytest.raises(ValueError, match="^cu_seqlens"):
    ref.mla_prefill(jnp.zeros((4, 1, 8)), jnp.zeros((4, 1, 8)), jnp.zeros((4, 1, 8)),
                    jnp.zeros((2,), jnp.float32), softmax_scale=1.0)
  with pytest.raises(ValueError, match="^slots"):
    ref.rope_rmsnorm_quantize_write(cache, jnp.zeros((2, D), jnp.bfloat16),
                                    jnp.zeros((2, 1, 64), jnp.bfloat16),
                                    jnp.zeros((2,), jnp.int32), cos, sin, jnp.ones((512,), jnp.bfloat16),
                                    eps=1e-6, kv_scale=1.0, slots=jnp.zeros((3,), jnp.int32))


def test_jit_with_traced_scalars():
  rng = np.random.default_rng(110)
  cache = fp8_cache(rng, (2, 16, D))
  q = jnp.asarray(rng.normal(size=(1, 2, 2, D)), jnp.bfloat16)
  table = jnp.asarray([[1, 0]], jnp.int32)
  lens = jnp.asarray([20], jnp.int32)

  @jax.jit
  def dense(q, cache, table, lens, sm, kvs, causal):
    return ref.dense_mla_decode(q, cache, table, lens, softmax_scale=sm, kv_scale=kvs, causal=causal)

  for causal in (False, True):
    got = dense(q, cache, table, lens, jnp.float32(SCALE), jnp.float32(0.7), jnp.asarray(causal))
    want_out, want_lse = o.dense_decode(q, cache, table, lens, SCALE, 0.7, causal)
    assert_out(got[0], want_out, what="jit dense out")
    assert_lse(got[1], want_lse, what="jit dense lse")

  f = jax.jit(ref.mla_prefill, static_argnames=("causal",))
  x = jnp.asarray(rng.normal(size=(5, 1, 8)), jnp.float32)
  out, _ = f(x, x, x, jnp.asarray([0, 2, 5], jnp.int32), softmax_scale=0.5, causal=True)
  want, _ = o.varlen_attention(x, x, x, [0, 2, 5], 0.5, True)
  assert_out(out, want, what="jit prefill")
  g = jax.jit(ref.quantize_and_bmm_fp8, static_argnames=("act_scale",))
  w8, ws = ref.convert_bf16_to_fp8_e4m3fn(jnp.asarray(rng.normal(size=(2, 16, 8)), jnp.bfloat16))
  a = jnp.asarray(rng.normal(size=(3, 2, 16)), jnp.bfloat16)
  np.testing.assert_array_equal(  # same ops jitted or not
      o.f64(g(a, w8, ws, act_scale="per_tensor")),
      o.f64(ref.quantize_and_bmm_fp8(a, w8, ws, act_scale="per_tensor")))


def test_eager_matches_jit():
  rng = np.random.default_rng(111)
  cache = fp8_cache(rng, (32, D))
  q = jnp.asarray(rng.normal(size=(2, 1, 2, D)), jnp.bfloat16)
  idx = jnp.asarray(random_indices(rng, (2, 1, 5), 32))
  tl = jnp.asarray([4, 5], jnp.int32)
  e = ref.sparse_mla_decode(q, cache, idx, softmax_scale=SCALE, kv_scale=0.9, topk_length=tl)
  j = sparse_decode(q, cache, idx, softmax_scale=SCALE, kv_scale=0.9, topk_length=tl)
  # same float32 ops; XLA may fuse differently under jit: f32 noise, then bf16 rounding (2^-8)
  np.testing.assert_allclose(o.f64(e[0]), o.f64(j[0]), rtol=2 ** -8, atol=1e-6)
  np.testing.assert_allclose(np.asarray(e[1]), np.asarray(j[1]), rtol=1e-6, atol=1e-6)


def test_batch_chunking_matches_unchunked(monkeypatch):
  """Big references are chunked over the batch (lax.map); force a tiny budget and compare with one shot."""
  rng = np.random.default_rng(112)
  cache = fp8_cache(rng, (3, 16, D))
  q = jnp.asarray(rng.normal(size=(5, 2, 2, D)), jnp.bfloat16)
  table = jnp.asarray(rng.integers(-1, 3, size=(5, 3)), jnp.int32)
  lens = jnp.asarray([0, 1, 17, 33, 48], jnp.int32)
  whole = jax.jit(lambda q: ref.dense_mla_decode(q, cache, table, lens, softmax_scale=SCALE, causal=True))(q)
  # 2 batch rows per chunk -> 3 chunks, the last one partial
  monkeypatch.setattr(ref, "_GATHER_BUDGET", 2 * 48 * D * 2)
  fn = lambda q: ref.dense_mla_decode(q, cache, table, lens, softmax_scale=SCALE, causal=True)
  assert "scan" in str(jax.make_jaxpr(fn)(q))  # the chunked path (lax.map) is really taken
  chunked = jax.jit(fn)(q)
  # same math per row; only the batching differs (f32 noise at most), then bf16 rounding
  np.testing.assert_allclose(o.f64(chunked[0]), o.f64(whole[0]), rtol=2 ** -8, atol=1e-6)
  np.testing.assert_allclose(np.asarray(chunked[1]), np.asarray(whole[1]), rtol=1e-6, atol=1e-6)
  want_out, want_lse = o.dense_decode(q, cache, table, lens, SCALE, 1.0, True)
  assert_out(chunked[0], want_out, what="chunked out")
  assert_lse(chunked[1], want_lse, what="chunked lse")
