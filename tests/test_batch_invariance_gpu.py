"""batch_invariant=True on the H200 (issue 24): the same sequence alone and inside batches of 2, 7, 64 and 128
with different neighbours gives bitwise equal out and lse, for sparse and dense decode (the kernels, impl
"mosaic"), s_q 1 and 4, H 8 and 128, top-k 2048 (two invariant splits)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas.ops.dense_decode import dense_mla_decode
from mla_pallas.ops.sparse_decode import sparse_mla_decode

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]
BATCHES = (2, 7, 64, 128)


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint16) if x.dtype == jnp.bfloat16 else x.view(np.uint32)


@pytest.mark.parametrize("h", [8, 128])
@pytest.mark.parametrize("s_q", [1, 4])
def test_sparse_decode_is_batch_invariant(rng, h, s_q):
  n, topk = 65536, 2048
  cache = jnp.asarray(rng.normal(size=(n, 576)), jnp.bfloat16).astype(jnp.float8_e4m3fn)
  q1 = jnp.asarray(rng.normal(size=(1, s_q, h, 576)), jnp.bfloat16)
  i1 = jnp.asarray(rng.integers(-3, n + 3, size=(1, s_q, topk)), jnp.int32)
  kw = dict(softmax_scale=576 ** -0.5, impl="mosaic", batch_invariant=True)
  o1, l1 = sparse_mla_decode(q1, cache, i1, **kw)
  for b in BATCHES:
    at = b // 2
    q = jnp.asarray(rng.normal(size=(b, s_q, h, 576)), jnp.bfloat16).at[at].set(q1[0])
    idx = jnp.asarray(rng.integers(-3, n + 3, size=(b, s_q, topk)), jnp.int32).at[at].set(i1[0])
    o, l = sparse_mla_decode(q, cache, idx, **kw)
    np.testing.assert_array_equal(_bits(o[at]), _bits(o1[0]), err_msg=f"out, batch {b}")
    np.testing.assert_array_equal(_bits(l[at]), _bits(l1[0]), err_msg=f"lse, batch {b}")


@pytest.mark.parametrize("h", [8, 128])
@pytest.mark.parametrize("s_q", [1, 4])
def test_dense_decode_is_batch_invariant(rng, h, s_q):
  """The sequence (3000 tokens, 47 pages of 64) alone, and in batches whose tables are as wide as neighbours of
  up to 8192 tokens."""
  page, num_pages = 64, 128 * 128 + 64
  pages = jnp.asarray(rng.normal(size=(num_pages, page, 576)), jnp.bfloat16).astype(jnp.float8_e4m3fn)
  own = rng.permutation(num_pages)[:47]
  q1 = jnp.asarray(rng.normal(size=(1, s_q, h, 576)), jnp.bfloat16)
  kw = dict(softmax_scale=576 ** -0.5, causal=True, impl="mosaic", batch_invariant=True)
  o1, l1 = dense_mla_decode(q1, pages, jnp.asarray(own[None], jnp.int32), jnp.asarray([3000], jnp.int32), **kw)
  for b in BATCHES:
    at = b - 1
    table = rng.integers(0, num_pages, size=(b, 128)).astype(np.int32)
    table[at] = np.r_[own, np.full(128 - 47, -1)]
    lens = rng.integers(1, 8193, size=b).astype(np.int32)
    lens[at] = 3000
    q = jnp.asarray(rng.normal(size=(b, s_q, h, 576)), jnp.bfloat16).at[at].set(q1[0])
    o, l = dense_mla_decode(q, pages, jnp.asarray(table), jnp.asarray(lens), **kw)
    np.testing.assert_array_equal(_bits(o[at]), _bits(o1[0]), err_msg=f"out, batch {b}")
    np.testing.assert_array_equal(_bits(l[at]), _bits(l1[0]), err_msg=f"lse, batch {b}")


@pytest.mark.parametrize("h", [8, 128])
def test_decode_branch_is_batch_invariant(rng, h):
  """The FP8 decode branch (impl "auto": the kernels where validated, the FP8 BMMs included) with
  batch_invariant=True: sequence 0 alone and in batches of 7 and 64 (neighbours write other slots)."""
  from mla_pallas import graph
  from mla_pallas.config import deepseek_v32
  cfg = deepseek_v32().replace(num_heads=h, page_size=64)
  nope = cfg.qk_nope_head_dim
  w = graph.MLAWeightsBF16(jnp.asarray(rng.normal(size=(h, nope, 512)) / nope ** 0.5, jnp.bfloat16),
                           jnp.asarray(rng.normal(size=(h, 512, cfg.v_head_dim)) / 512 ** 0.5, jnp.bfloat16),
                           jnp.asarray(1 + 0.1 * rng.normal(size=512), jnp.bfloat16)).to_fp8()
  cos, sin = cfg.rope_tables(8192)
  pages0 = jnp.asarray(rng.normal(size=(1024, 64, 576)) * 0.5, jnp.bfloat16).astype(jnp.float8_e4m3fn)

  def tokens(b):
    slots = np.arange(b) * 64 + 7
    idx = np.c_[slots[:, None], rng.integers(64 * 128, 64 * 1024, size=(b, 2047))]
    return dict(q_nope=jnp.asarray(rng.normal(size=(b, 1, h, nope)), jnp.bfloat16),
                q_rope=jnp.asarray(rng.normal(size=(b, 1, h, 64)), jnp.bfloat16),
                kv=jnp.asarray(rng.normal(size=(b, 1, 576)), jnp.bfloat16),
                positions=jnp.asarray(rng.integers(0, 8000, size=(b, 1)), jnp.int32),
                slots=jnp.asarray(slots[:, None], jnp.int32), indices=jnp.asarray(idx[:, None], jnp.int32))

  one = tokens(1)
  o1, _ = graph.mla_decode_branch_fp8(w, jnp.array(pages0, copy=True), 0.05, *(one[k] for k in (
      "q_nope", "q_rope", "kv", "positions", "slots")), cos, sin, cfg=cfg, indices=one["indices"],
      batch_invariant=True)
  for b in (7, 64):
    many = {k: (v.at[0].set(one[k][0]) if k != "slots" else v) for k, v in tokens(b).items()}
    o, _ = graph.mla_decode_branch_fp8(w, jnp.array(pages0, copy=True), 0.05, *(many[k] for k in (
        "q_nope", "q_rope", "kv", "positions", "slots")), cos, sin, cfg=cfg, indices=many["indices"],
        batch_invariant=True)
    np.testing.assert_array_equal(_bits(o[0]), _bits(o1[0]), err_msg=f"batch {b}: {graph.format_report()}")
