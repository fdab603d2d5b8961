"""Inputs of the dense decode tests (CPU interpret mode and GPU): a paged e4m3 cache with NaN in every slot no
query may read, a block table with entries past each sequence's pages set to -1 or to a page id past the cache
(never read), optionally such entries inside a sequence too (``bad_inside``: those positions are masked), and
N(0, 1) queries."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

D = 576
FP8 = jnp.float8_e4m3fn


def dense_case(rng, *, lens, s_q, H, page, max_pages, bad_inside: bool = False):
  """(q [B, s_q, H, 576] bf16, pages [num_pages, page, 576] e4m3, block_table [B, max_pages], cache_seqlens [B])."""
  B = len(lens)
  num_pages = B * max_pages + 3
  table = rng.permutation(num_pages)[: B * max_pages].reshape(B, max_pages).astype(np.int32)
  for b, n in enumerate(lens):
    used = min(-(-n // page), max_pages)
    table[b, used:] = -1 if b % 2 else num_pages + 7      # past the sequence: masked, never read
    if bad_inside and used >= 2:                           # a page inside the sequence that is not in the cache
      table[b, used // 2] = -1 if b % 2 == 0 else num_pages + 1
  keep = np.zeros(num_pages * page, bool)
  for b, n in enumerate(lens):
    for p in range(min(n, max_pages * page)):
      pid = table[b, p // page]
      if 0 <= pid < num_pages:
        keep[pid * page + p % page] = True
  rows = np.asarray(jnp.asarray(rng.standard_normal((num_pages * page, D)), jnp.float32).astype(FP8))
  bits = rows.view(np.uint8).copy()
  bits[~keep] = 0x7F                                         # NaN in every slot nothing may read
  pages = jnp.asarray(bits.view(rows.dtype).reshape(num_pages, page, D))
  q = jnp.asarray(rng.standard_normal((B, s_q, H, D)), jnp.bfloat16)
  return q, pages, jnp.asarray(table), jnp.asarray(np.asarray(lens, np.int32))


def check_bf16(out, lse, ref_out, ref_lse, what: str, *, lse_atol: float):
  """BF16 attention (a bfloat16 cache) against the float32 reference: out within testing.BF16_ATTENTION_REL_L2 (P
  and the output rounded to bf16, f32 accumulation), lse within ``lse_atol`` (f32 rounding of the logits; the GPU's
  approximate exp2 / log2 adds ~1e-6 per term), empty rows exactly (out 0, lse -inf), no NaN from unread slots."""
  from mla_pallas import testing
  testing.assert_close_fp8(out, ref_out, rel_l2=testing.BF16_ATTENTION_REL_L2, min_cos=0.9999, what=what)
  testing.assert_close_fp8(lse, ref_lse, rel_l2=None, max_abs=lse_atol, what=f"{what} lse")
  empty = ~np.isfinite(np.asarray(ref_lse))
  assert np.array_equal(~np.isfinite(np.asarray(lse)), empty)
  assert np.all(np.asarray(out, np.float32)[empty] == 0)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
