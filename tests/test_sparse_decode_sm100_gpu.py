"""sparse_mla_decode on a Blackwell GPU (sm_100a): the native FP8 kernel against the reference, beside the XLA path.

Never run yet: no Blackwell GPU was available when the kernel was written (it is lowered and interpreted only).
These tests are skipped unless JAX's default device has compute capability 10.x. On such a device
``impl="auto"`` still runs XLA (the kernel is not validated on sm100 hardware); the tests ask for
``impl="mosaic"``. Run with ``-s`` to see the error metrics. The tolerance is the FP8 error model
(:func:`mla_pallas.testing.fp8_error_budget`) with the Hopper-measured fp8 MMA accumulation term, to be
re-measured on Blackwell.
"""
from __future__ import annotations

import itertools

import numpy as np
import pytest

import mla_pallas
from mla_pallas import _dispatch, reference, testing

from _sparse_inputs import logit_std, make_case

pytestmark = [pytest.mark.gpu, pytest.mark.sm100]

HEADS = (8, 16, 32, 64, 128)
S_Q = (1, 2, 4, 6)
TOPKS = (2048, 2051, 2176)
FAST = [(8, 4), (16, 6), (32, 1), (64, 2), (128, 2)]
CASES = [pytest.param(h, s, marks=() if (h, s) in FAST else pytest.mark.slow)
         for h, s in itertools.product(HEADS, S_Q)]


def _metrics(got, want):
  g = np.asarray(got, np.float64)
  w = np.asarray(want, np.float64)
  rel = np.linalg.norm(g - w) / np.linalg.norm(w)
  cos = float((g * w).sum() / (np.linalg.norm(g) * np.linalg.norm(w)))
  return rel, float(np.abs(g - w).max()), cos


def _run(case, impl):
  return mla_pallas.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=case.softmax_scale,
                                      kv_scale=case.kv_scale, topk_length=case.topk_length, impl=impl)


def test_auto_does_not_pick_unvalidated_kernel(rng):
  case = make_case(rng, B=1, s_q=1, H=8, topk=64)
  _run(case, "auto")
  assert _dispatch.last_impl("sparse_mla_decode") == "xla"


@pytest.mark.parametrize("H,s_q", CASES)
def test_kernel_matches_reference(rng, H, s_q):
  topk = TOPKS[(HEADS.index(H) + S_Q.index(s_q)) % len(TOPKS)]
  page = 64 if (H + s_q) % 2 else 128
  case = make_case(rng, B=2, s_q=s_q, H=H, topk=topk, page_size=page, num_pages=16384 // page,
                   with_topk_length=(H == 32), kv_scale=0.5 if H == 16 else 1.0)
  ref_out, ref_lse = reference.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=case.softmax_scale,
                                                 kv_scale=case.kv_scale, topk_length=case.topk_length)
  out, lse = _run(case, "mosaic")
  assert _dispatch.last_impl("sparse_mla_decode") == "mosaic"
  out2, lse2 = _run(case, "mosaic")
  xla_out, _ = _run(case, "xla")
  k, x = _metrics(out, ref_out), _metrics(xla_out, ref_out)
  print(f"\nH={H} s_q={s_q} topk={topk} page={page}: kernel rel-L2 {k[0]:.4f} max-abs {k[1]:.4f} cos {k[2]:.5f}"
        f" | xla rel-L2 {x[0]:.4f} max-abs {x[1]:.4f} cos {x[2]:.5f}")
  budget = testing.fp8_error_budget(logit_std=logit_std(case), pv_length=topk, fp8_mma=True)
  testing.assert_close_fp8(out, ref_out, rel_l2=budget, min_cos=0.99, what="kernel out")
  testing.assert_close_fp8(lse, ref_lse, rel_l2=None, max_abs=0.1, what="kernel lse")
  assert np.all(np.asarray(out, np.float32)[~np.isfinite(np.asarray(ref_lse))] == 0)
  assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(out2).view(np.uint16)), "not deterministic"
  assert np.array_equal(np.asarray(lse), np.asarray(lse2)), "lse not deterministic"


def test_split_kv_long_topk(rng):
  """Few query tokens and a long top-k: several splits per token, merged by lse."""
  case = make_case(rng, B=1, s_q=1, H=64, topk=8192, page_size=64, num_pages=512)
  ref_out, _ = reference.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=case.softmax_scale)
  out, _ = _run(case, "mosaic")
  budget = testing.fp8_error_budget(logit_std=logit_std(case), pv_length=8192, fp8_mma=True)
  testing.assert_close_fp8(out, ref_out, rel_l2=budget, min_cos=0.99)


def test_prefill_routes_through_kernel(rng):
  case = make_case(rng, B=64, s_q=1, H=16, topk=300, page_size=64, num_pages=64)
  out, _ = mla_pallas.sparse_mla_prefill(case.q[:, 0], case.kv, case.indices[:, 0],
                                         softmax_scale=case.softmax_scale, impl="mosaic")
  assert _dispatch.last_impl("sparse_mla_prefill") == "mosaic"
  ref_out, _ = reference.sparse_mla_prefill(case.q[:, 0], case.kv, case.indices[:, 0],
                                            softmax_scale=case.softmax_scale)
  budget = testing.fp8_error_budget(logit_std=logit_std(case), pv_length=300, fp8_mma=True)
  testing.assert_close_fp8(out, ref_out, rel_l2=budget, min_cos=0.99)
