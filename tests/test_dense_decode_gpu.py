"""dense_mla_decode with impl="mosaic" on a Hopper GPU (sm_90a) against the float32 reference.

The op turns the block table into flat slot ids and runs the sparse kernels (heads on N for H <= 16, on M above),
so the error model is theirs: Q in e4m3 per row, P kept in f16, FP8 wgmma accumulation
(:func:`mla_pallas.testing.fp8_error_budget`, ``quantized_p=False``, ``fp8_mma=True``).

Inputs (``_case``): N(0, 1) queries, a cache of e4m3(N(0, 1)) rows with NaN in every slot no query may read,
ragged lengths including 0 (out 0, lse -inf), 1 and a partial last page, block-table entries past each
sequence's pages set to -1 or to a page id past the cache (never read), causal and non-causal, s_q 1-4, page 64
and 128. Each case also runs twice: the outputs must be bitwise equal.

Quick selection: ``pytest -q -m "gpu and not slow" tests/test_dense_decode_gpu.py``.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas import _dispatch, reference, testing
from mla_pallas.ops.dense_decode import dense_mla_decode

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

D = 576
FP8 = jnp.float8_e4m3fn


def _case(rng, *, lens, s_q, H, page, max_pages):
  """(q, pages, block_table, cache_seqlens): module docstring."""
  B = len(lens)
  num_pages = B * max_pages + 3
  table = rng.permutation(num_pages)[: B * max_pages].reshape(B, max_pages).astype(np.int32)
  for b, n in enumerate(lens):
    used = -(-n // page)
    table[b, used:] = -1 if b % 2 else num_pages + 7      # past the sequence: masked, never read
  keep = np.zeros(num_pages * page, bool)
  for b, n in enumerate(lens):
    for p in range(min(n, max_pages * page)):
      keep[table[b, p // page] * page + p % page] = True
  rows = np.asarray(jnp.asarray(rng.standard_normal((num_pages * page, D)), jnp.float32).astype(FP8))
  bits = rows.view(np.uint8).copy()
  bits[~keep] = 0x7F                                         # NaN in every slot nothing may read
  pages = jnp.asarray(bits.view(rows.dtype).reshape(num_pages, page, D))
  q = jnp.asarray(rng.standard_normal((B, s_q, H, D)), jnp.bfloat16)
  return q, pages, jnp.asarray(table), jnp.asarray(np.asarray(lens, np.int32))


CASES = [   # H, s_q, page, causal, lengths (max_pages = the longest length's pages + 1)
    (8, 1, 64, False, (0, 1, 63, 64, 1000, 4096)),
    (16, 4, 64, True, (5, 130, 2048, 4099)),
    (64, 2, 128, True, (1, 127, 129, 3000)),
    (128, 1, 64, False, (0, 65, 2047, 4096)),
    (128, 2, 128, True, (2, 700, 4096, 4100)),
    pytest.param(32, 3, 64, True, (4, 64, 1500), marks=pytest.mark.slow),
    pytest.param(64, 1, 64, False, (8192, 1, 5000, 0), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("H,s_q,page,causal,lens", CASES)
def test_dense_matches_reference(rng, H, s_q, page, causal, lens):
  max_pages = -(-max(lens) // page) + 1
  q, pages, table, seqlens = _case(rng, lens=lens, s_q=s_q, H=H, page=page, max_pages=max_pages)
  kw = dict(softmax_scale=D ** -0.5, kv_scale=0.75, causal=causal)
  out, lse = dense_mla_decode(q, pages, table, seqlens, impl="mosaic", **kw)
  assert _dispatch.last_impl("dense_mla_decode") == "mosaic"
  out2, lse2 = dense_mla_decode(q, pages, table, seqlens, impl="mosaic", **kw)
  assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(out2).view(np.uint16)), "not deterministic"
  assert np.array_equal(np.asarray(lse), np.asarray(lse2)), "lse not deterministic"
  ref_out, ref_lse = reference.dense_mla_decode(q, pages, table, seqlens, **kw)
  # logits of std softmax_scale * sqrt(576) * kv_scale = 0.75 on N(0, 1) data; P·V over up to max(lens) keys
  budget = testing.fp8_error_budget(
      split_partials_bf16=True, logit_std=0.75, pv_length=max(lens), fp8_mma=True, quantized_p=False)
  testing.assert_close_fp8(out, ref_out, rel_l2=budget, min_cos=0.99, what=f"dense H={H} s_q={s_q}")
  # lse: a logit error of RMS sigma moves lse by about sigma (natural log units); see tests/test_sparse_decode.py
  testing.assert_close_fp8(lse, ref_lse, rel_l2=None, max_abs=0.1, what="dense lse")
  empty = ~np.isfinite(np.asarray(ref_lse))
  assert np.array_equal(~np.isfinite(np.asarray(lse)), empty)
  assert np.all(np.asarray(out, np.float32)[empty] == 0)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
