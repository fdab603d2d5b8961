"""The GPU checks of sparse_mla_decode shared by the Hopper and Blackwell test files (tests/test_sparse_decode*_gpu.py).

Every check runs ``impl="mosaic"`` on the device's kernel family, prints rel-L2, max-abs and cosine of the kernel
and of the XLA path (identical Q quantization) against the float32 reference on the same dequantized cache (run
with ``-s``), and bounds the kernel by the FP8 error model (:func:`mla_pallas.testing.fp8_error_budget`) with the
fp8 MMA accumulation term measured on Hopper. ``quantized_p``: the kernel rounds P to e4m3 for P.V.
"""
from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

import mla_pallas
from mla_pallas import _dispatch, reference, testing

from _sparse_inputs import logit_std, make_case

HEADS = (8, 16, 32, 64, 128)
S_Q = (1, 2, 4, 6)
TOPKS = (2048, 2051, 2176)
# Each case compiles its own kernel, XLA path and reference (~16 s on an H200): one case per H and per s_q runs by
# default; the full H x s_q product is marked slow (make test-all).
FAST = [(8, 4), (16, 6), (32, 1), (64, 2), (128, 2)]
CASES = [pytest.param(h, s, marks=() if (h, s) in FAST else pytest.mark.slow)
         for h, s in itertools.product(HEADS, S_Q)]


def metrics(got, want):
  g = np.asarray(got, np.float64)
  w = np.asarray(want, np.float64)
  rel = np.linalg.norm(g - w) / np.linalg.norm(w)
  cos = float((g * w).sum() / (np.linalg.norm(g) * np.linalg.norm(w)))
  return rel, float(np.abs(g - w).max()), cos


def run(case, impl, tuning=()):
  """The public op; with ``tuning`` (kernel TuningConfig overrides) the op's jitted implementation instead."""
  if tuning:
    from mla_pallas.ops import sparse_decode as sd
    return sd._sparse_decode_jit(case.q, case.kv.reshape(-1, case.kv.shape[-1]), case.indices,
                                 jnp.float32(case.kv_scale), case.topk_length, softmax_scale=case.softmax_scale,
                                 impl=impl, interpret=False, tuning=tuple(tuning))
  return mla_pallas.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=case.softmax_scale,
                                      kv_scale=case.kv_scale, topk_length=case.topk_length, impl=impl)


def _budget(case, pv_length, quantized_p):
  return testing.fp8_error_budget(
      split_partials_bf16=True, logit_std=logit_std(case), pv_length=pv_length, fp8_mma=True,
      quantized_p=quantized_p)


def check_kernel_matches_reference(rng, H, s_q, *, quantized_p, tuning=()):
  """Random data with NaN-poisoned unused rows, invalid/duplicate indices, an all-invalid row (make_case); odd top-k,
  page 64/128, topk_length at H = 32, kv_scale 0.5 at H = 16; bitwise determinism across two runs. ``tuning``:
  kernel TuningConfig overrides (a non-default arrangement)."""
  topk = TOPKS[(HEADS.index(H) + S_Q.index(s_q)) % len(TOPKS)]
  page = 64 if (H + s_q) % 2 else 128
  case = make_case(rng, B=2, s_q=s_q, H=H, topk=topk, page_size=page, num_pages=16384 // page,
                   with_topk_length=(H == 32), kv_scale=0.5 if H == 16 else 1.0)
  ref_out, ref_lse = reference.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=case.softmax_scale,
                                                 kv_scale=case.kv_scale, topk_length=case.topk_length)
  out, lse = run(case, "mosaic", tuning)
  if not tuning:   # (the op's jitted implementation, which ``tuning`` calls, does not record the dispatch)
    assert _dispatch.last_impl("sparse_mla_decode") == "mosaic"
  out2, lse2 = run(case, "mosaic", tuning)
  xla_out, _ = run(case, "xla")
  k, x = metrics(out, ref_out), metrics(xla_out, ref_out)
  print(f"\nH={H} s_q={s_q} topk={topk} page={page}: kernel rel-L2 {k[0]:.4f} max-abs {k[1]:.4f} cos {k[2]:.5f}"
        f" | xla rel-L2 {x[0]:.4f} max-abs {x[1]:.4f} cos {x[2]:.5f}")
  testing.assert_close_fp8(out, ref_out, rel_l2=_budget(case, topk, quantized_p), min_cos=0.99, what="kernel out")
  # lse: a logit error of RMS sigma moves lse by about sigma (natural log units); see tests/test_sparse_decode.py
  testing.assert_close_fp8(lse, ref_lse, rel_l2=None, max_abs=0.1, what="kernel lse")
  assert np.all(np.asarray(out, np.float32)[~np.isfinite(np.asarray(ref_lse))] == 0)
  assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(out2).view(np.uint16)), "not deterministic"
  assert np.array_equal(np.asarray(lse), np.asarray(lse2)), "lse not deterministic"


def check_split_kv_long_topk(rng, *, quantized_p):
  """Few query tokens and a long top-k: several splits per token, merged by lse."""
  case = make_case(rng, B=1, s_q=1, H=64, topk=8192, page_size=64, num_pages=512)
  ref_out, _ = reference.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=case.softmax_scale)
  out, _ = run(case, "mosaic")
  testing.assert_close_fp8(out, ref_out, rel_l2=_budget(case, 8192, quantized_p), min_cos=0.99)


def check_prefill_routes_through_kernel(rng, *, quantized_p):
  case = make_case(rng, B=64, s_q=1, H=16, topk=300, page_size=64, num_pages=64)
  out, _ = mla_pallas.sparse_mla_prefill(case.q[:, 0], case.kv, case.indices[:, 0],
                                         softmax_scale=case.softmax_scale, impl="mosaic")
  assert _dispatch.last_impl("sparse_mla_prefill") == "mosaic"
  ref_out, _ = reference.sparse_mla_prefill(case.q[:, 0], case.kv, case.indices[:, 0],
                                            softmax_scale=case.softmax_scale)
  testing.assert_close_fp8(out, ref_out, rel_l2=_budget(case, 300, quantized_p), min_cos=0.99)
