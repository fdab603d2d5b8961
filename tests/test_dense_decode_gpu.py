"""dense_mla_decode's two Mosaic routes on a Hopper GPU (sm_90a) against the float32 reference.

"dense" (``impl="mosaic"`` where the dense kernel takes the input: page a multiple of 64) runs kernels/dense_sm90.py
(heads on N for H <= 16, on M above); "sparse" (``dense_decode.sparse_route``) turns the block table into flat slot
ids and runs the sparse kernels (heads on N for H <= 16, on M above). Both have the sparse kernel's error model:
Q in e4m3 per row, P kept in f16, FP8 wgmma accumulation (:func:`mla_pallas.testing.fp8_error_budget`,
``quantized_p=False``, ``fp8_mma=True``).

Inputs (``_dense_inputs.dense_case``): N(0, 1) queries, a cache of e4m3(N(0, 1)) rows with NaN in every slot no
query may read, ragged lengths including 0 (out 0, lse -inf), 1 and a partial last page, block-table entries past
each sequence's pages set to -1 or to a page id past the cache (never read), in some cases such entries inside a
sequence too (masked), causal and non-causal, s_q 1-4, page 64 and 128. Each case also runs twice: the outputs
must be bitwise equal.

Quick selection: ``pytest -q -m "gpu and not slow" tests/test_dense_decode_gpu.py``.
"""
from __future__ import annotations

import numpy as np
import pytest

from mla_pallas import _dispatch, reference, testing
from mla_pallas.ops import dense_decode
from mla_pallas.ops.dense_decode import dense_mla_decode

from _dense_inputs import check_bf16, dense_case

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

D = 576


CASES = [   # H, s_q, page, causal, lengths (max_pages = the longest length's pages + 1), bad pages inside
    (8, 1, 64, False, (0, 1, 63, 64, 1000, 4096), False),
    (16, 4, 64, True, (5, 130, 2048, 4099), True),
    (64, 2, 128, True, (1, 127, 129, 3000), False),
    (128, 1, 64, False, (0, 65, 2047, 4096), True),
    (128, 2, 128, True, (2, 700, 4096, 4100), False),
    (64, 1, 64, False, (3, 4096, 191, 2000, 64, 128, 4095), True),     # an odd batch; full and partial tails
    pytest.param(32, 3, 64, True, (4, 64, 1500), False, marks=pytest.mark.slow),
    pytest.param(64, 1, 64, False, (8192, 1, 5000, 0), False, marks=pytest.mark.slow),
]


def _run(route, q, pages, table, seqlens, **kw):
  if route == "seesaw":     # the dense kernel's other bf16 schedule (a sweep candidate until measured)
    kv_scale = kw.pop("kv_scale")
    return dense_decode._dense_kernel_jit(q, pages, table, seqlens, np.float32(kv_scale), interpret=False,
                                          tuning=(("schedule", "seesaw"),), **kw)
  if route == "dense":
    assert dense_decode.mosaic_route(q.shape, pages, "mosaic", False) == "dense"
    out = dense_mla_decode(q, pages, table, seqlens, impl="mosaic", **kw)
    assert _dispatch.last_impl("dense_mla_decode") == "mosaic"
    return out
  return dense_decode.sparse_route(q, pages, table, seqlens, kw.pop("kv_scale"), interpret=False, **kw)


@pytest.mark.parametrize("route", ["dense", "sparse"])
@pytest.mark.parametrize("H,s_q,page,causal,lens,bad_inside", CASES)
def test_dense_matches_reference(rng, route, H, s_q, page, causal, lens, bad_inside):
  max_pages = -(-max(lens) // page) + 1
  q, pages, table, seqlens = dense_case(rng, lens=lens, s_q=s_q, H=H, page=page, max_pages=max_pages,
                                        bad_inside=bad_inside)
  kw = dict(softmax_scale=D ** -0.5, kv_scale=0.75, causal=causal)
  out, lse = _run(route, q, pages, table, seqlens, **kw)
  out2, lse2 = _run(route, q, pages, table, seqlens, **kw)
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


BF16_CASES = [   # H, s_q, page, causal, lengths, bad pages inside
    (128, 1, 64, False, (0, 65, 2047, 4096), True),
    (64, 2, 128, True, (1, 127, 129, 3000), False),
    (16, 4, 64, True, (5, 130, 2048, 4099), True),      # heads on M with rows zero-padded
    pytest.param(8, 1, 64, False, (0, 1, 63, 64, 1000, 4096), False, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("route", ["dense", "seesaw", "sparse"])
@pytest.mark.parametrize("H,s_q,page,causal,lens,bad_inside", BF16_CASES)
def test_bf16_cache_matches_reference(rng, route, H, s_q, page, causal, lens, bad_inside):
  """A bfloat16 cache (BF16 attention) through both routes: "dense" runs the dense kernel's bf16 form ("producer_vt"
  over bf16: P in the K buffer's rope chunk, the multipliers' P·V as m64n64k16 wgmmas from SMEM), "seesaw" the dense
  kernel's "seesaw" schedule (the consumers alternate tiles; traced tile counts), "sparse" the
  sparse op's bf16 kernel. Error model: testing.BF16_ATTENTION_REL_L2 (P and the output in bf16, f32
  accumulation); NaN in every unread slot, bad pages, lengths 0 / 1 and partial tails; bitwise deterministic."""
  import jax.numpy as jnp
  max_pages = -(-max(lens) // page) + 1
  q, pages, table, seqlens = dense_case(rng, lens=lens, s_q=s_q, H=H, page=page, max_pages=max_pages,
                                        bad_inside=bad_inside)
  pages = pages.astype(jnp.bfloat16)
  kw = dict(softmax_scale=D ** -0.5, kv_scale=0.75, causal=causal)
  out, lse = _run(route, q, pages, table, seqlens, **kw)
  out2, _ = _run(route, q, pages, table, seqlens, **kw)
  assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(out2).view(np.uint16)), "not deterministic"
  ref_out, ref_lse = reference.dense_mla_decode(q, pages, table, seqlens, **kw)
  check_bf16(out, lse, ref_out, ref_lse, f"bf16 {route} H={H} s_q={s_q}", lse_atol=1e-3)
