"""batch_invariant=True (issue 24): a sequence's out and lse bits do not depend on the batch size, the other
sequences, their lengths or the block table's width, for sparse_mla_decode and dense_mla_decode on both paths
(the kernels in interpret mode here; tests/test_batch_invariance_gpu.py runs them on the H200) and through the
decode branch. Small top-k widths run with INVARIANT_SPLIT_TILES patched to 2, so that rows have several splits
(the merge order is exercised) without long interpret-mode runs.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas.ops import dense_decode as dd, sparse_decode as sd
from mla_pallas.ops.dense_decode import dense_mla_decode
from mla_pallas.ops.sparse_decode import sparse_mla_decode

N_SLOTS = 2048
PATHS = [("xla", False), ("mosaic", True)]


@pytest.fixture
def short_splits(monkeypatch):
  monkeypatch.setattr(sd, "INVARIANT_SPLIT_TILES", 2)
  sd._sparse_decode_jit.clear_cache()
  yield
  sd._sparse_decode_jit.clear_cache()


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint16) if x.dtype == jnp.bfloat16 else x.view(np.uint32)


def _cache(rng, n=N_SLOTS):
  return jnp.asarray(rng.normal(size=(n, 576)), jnp.bfloat16).astype(jnp.float8_e4m3fn)


@pytest.mark.parametrize("impl,interpret", PATHS, ids=["xla", "kernel"])
@pytest.mark.parametrize("h,s_q", [(16, 1), pytest.param(16, 4, marks=pytest.mark.slow),
                                   pytest.param(64, 2, marks=pytest.mark.slow)])
def test_sparse_decode_row_alone_and_in_batches(rng, short_splits, impl, interpret, h, s_q):
  cache = _cache(rng)
  topk = 192                                                   # 3 tiles: 2 splits of 2 tiles

  def batch(b):
    q = jnp.asarray(rng.normal(size=(b, s_q, h, 576)), jnp.bfloat16)
    idx = jnp.asarray(rng.integers(-3, N_SLOTS + 3, size=(b, s_q, topk)), jnp.int32)
    lens = jnp.asarray(rng.integers(0, topk + 1, size=(b,)), jnp.int32)
    return q, idx, lens

  q1, i1, l1 = batch(1)
  kw = dict(softmax_scale=576 ** -0.5, impl=impl, interpret=interpret, batch_invariant=True)
  o1, s1 = sparse_mla_decode(q1, cache, i1, topk_length=l1, **kw)
  for b, at in ((2, 1), (3, 0)):
    q, idx, lens = batch(b)                                    # different neighbours and lengths
    q, idx, lens = q.at[at].set(q1[0]), idx.at[at].set(i1[0]), lens.at[at].set(l1[0])
    o, s = sparse_mla_decode(q, cache, idx, topk_length=lens, **kw)
    np.testing.assert_array_equal(_bits(o[at]), _bits(o1[0]), err_msg=f"out, batch {b}")
    np.testing.assert_array_equal(_bits(s[at]), _bits(s1[0]), err_msg=f"lse, batch {b}")


@pytest.mark.parametrize("impl,interpret", PATHS, ids=["xla", "kernel"])
@pytest.mark.parametrize("s_q,causal", [(1, False), pytest.param(4, True, marks=pytest.mark.slow)])
def test_dense_decode_sequence_alone_and_in_batches(rng, short_splits, impl, interpret, s_q, causal):
  """The sequence alone has a block table of 3 pages; in a batch the table is as wide as its longest neighbour
  (7 pages, padded with -1 and with page ids past the cache for the sequence)."""
  page, h = 64, 16
  pages = _cache(rng, 24 * page).reshape(24, page, 576)
  perm = rng.permutation(24)
  own = perm[:3]
  q1 = jnp.asarray(rng.normal(size=(1, s_q, h, 576)), jnp.bfloat16)
  t1, c1 = jnp.asarray(own[None], jnp.int32), jnp.asarray([150], jnp.int32)
  kw = dict(softmax_scale=576 ** -0.5, causal=causal, impl=impl, interpret=interpret, batch_invariant=True)
  o1, s1 = dense_mla_decode(q1, pages, t1, c1, **kw)
  for b, at in ((2, 0), (3, 2)):
    q = jnp.asarray(rng.normal(size=(b, s_q, h, 576)), jnp.bfloat16).at[at].set(q1[0])
    table = np.asarray([rng.permutation(24)[:7] for _ in range(b)], np.int32)
    table[at] = np.r_[own, -1, 99, -1, 5]                       # past the sequence: anything
    lens = rng.integers(1, 7 * page, size=b).astype(np.int32)
    lens[at] = 150
    o, s = dense_mla_decode(q, pages, jnp.asarray(table), jnp.asarray(lens), **kw)
    np.testing.assert_array_equal(_bits(o[at]), _bits(o1[0]), err_msg=f"out, batch {b}")
    np.testing.assert_array_equal(_bits(s[at]), _bits(s1[0]), err_msg=f"lse, batch {b}")


def test_default_plan_depends_on_the_batch_and_invariant_plan_does_not():
  """Why the mode exists: at P1's shape the default plan splits a row's top-k by how many CTAs the batch makes (a
  different reduction order per batch size); the invariant plan depends on the top-k only."""
  plans = {b: sd.default_config(128, b * 2, 2048) for b in (1, 8, 128)}
  assert len({(c.num_splits, c.kernel.tiles_per_split) for c in plans.values()}) > 1
  inv = {b: sd.default_config(128, b * 2, 2048, batch_invariant=True) for b in (1, 8, 128)}
  assert {(c.num_splits, c.kernel.tiles_per_split) for c in inv.values()} == {(2, sd.INVARIANT_SPLIT_TILES)}


def test_combine_ignores_empty_splits_bitwise(rng):
  """The merge's fixed chain: one more empty split (lse -inf, o 0) at the end gives the same bits (a wider table
  in a batch); bf16 partials (the fp8-cache kernels' output) merge the same way. Its values against a logsumexp
  reference: tests/test_sparse_decode.py::test_combine_splits_matches_logsumexp."""
  o = jnp.asarray(rng.normal(size=(3, 4, 64, 512)), jnp.float32)
  lse = jnp.asarray(rng.normal(size=(3, 4, 64)), jnp.float32).at[1, 2].set(-jnp.inf)
  o = o.at[1, 2].set(0.0)
  for dtype in (jnp.float32, jnp.bfloat16):
    a, la = sd.combine_splits(o.astype(dtype), lse)
    o2 = jnp.concatenate([o, jnp.zeros((3, 1, 64, 512), jnp.float32)], axis=1).astype(dtype)
    l2 = jnp.concatenate([lse, jnp.full((3, 1, 64), -jnp.inf, jnp.float32)], axis=1)
    a2, la2 = sd.combine_splits(o2, l2)
    np.testing.assert_array_equal(_bits(a2), _bits(a))
    np.testing.assert_array_equal(_bits(la2), _bits(la))


def test_batch_invariant_must_be_a_bool(rng):
  cache = _cache(rng)
  q = jnp.zeros((1, 1, 16, 576), jnp.bfloat16)
  with pytest.raises(ValueError, match="batch_invariant must be a python bool"):
    sparse_mla_decode(q, cache, jnp.zeros((1, 1, 8), jnp.int32), softmax_scale=1.0, batch_invariant=1)
  with pytest.raises(ValueError, match="batch_invariant must be a python bool"):
    dense_mla_decode(q, cache.reshape(32, 64, 576), jnp.zeros((1, 2), jnp.int32), jnp.ones((1,), jnp.int32),
                     softmax_scale=1.0, batch_invariant="yes")
  assert dd.INVARIANT_CHUNK_KEYS % 64 == 0


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_decode_branch_row_alone_and_in_a_batch(rng, fp8):
  """The decode branch with batch_invariant=True on the XLA path (every step): sequence 0 alone and beside 4
  others (which write their own slots; sequence 0's top-k is its own new row and rows no neighbour writes) gives
  the same bits; the cache row it writes is the same too."""
  from mla_pallas import graph
  from mla_pallas.config import glm5
  cfg = glm5().replace(num_heads=8, hidden_size=256, q_lora_rank=128, index_topk=64, page_size=16)
  h, nope = cfg.num_heads, cfg.qk_nope_head_dim
  w16 = graph.MLAWeightsBF16(jnp.asarray(rng.normal(size=(h, nope, 512)) / nope ** 0.5, jnp.bfloat16),
                             jnp.asarray(rng.normal(size=(h, 512, cfg.v_head_dim)) / 512 ** 0.5, jnp.bfloat16),
                             jnp.asarray(1 + 0.1 * rng.normal(size=512), jnp.bfloat16))
  w = w16.to_fp8() if fp8 else w16
  cos, sin = cfg.rope_tables(256)
  pages0 = jnp.asarray(rng.normal(size=(40, 16, 576)) * 0.5, jnp.bfloat16).astype(jnp.float8_e4m3fn)

  def tokens(b):
    return dict(q_nope=jnp.asarray(rng.normal(size=(b, 1, h, nope)), jnp.bfloat16),
                q_rope=jnp.asarray(rng.normal(size=(b, 1, h, 64)), jnp.bfloat16),
                kv=jnp.asarray(rng.normal(size=(b, 1, 576)), jnp.bfloat16),
                positions=jnp.asarray(rng.integers(0, 100, size=(b, 1)), jnp.int32),
                slots=jnp.asarray((np.arange(b) * 8 + 3)[:, None], jnp.int32),
                indices=jnp.asarray(np.c_[np.arange(b)[:, None] * 8 + 3,                 # its own new row
                                          rng.integers(100, 640, size=(b, 63))][:, None], jnp.int32))

  one = tokens(1)
  many = {k: v.at[0].set(one[k][0]) if k != "slots" else v for k, v in tokens(5).items()}
  kw = dict(cfg=cfg, impl="xla", batch_invariant=True)
  fn = graph.mla_decode_branch_fp8 if fp8 else graph.mla_decode_branch_bf16
  args = lambda t: (t["q_nope"], t["q_rope"], t["kv"], t["positions"], t["slots"], cos, sin)
  o1, p1 = fn(w, jnp.array(pages0, copy=True), 0.05, *args(one), indices=one["indices"], **kw)
  o, p = fn(w, jnp.array(pages0, copy=True), 0.05, *args(many), indices=many["indices"], **kw)
  np.testing.assert_array_equal(_bits(o[0]), _bits(o1[0]))
  np.testing.assert_array_equal(np.asarray(p).view(np.uint8)[0, 3], np.asarray(p1).view(np.uint8)[0, 3])
