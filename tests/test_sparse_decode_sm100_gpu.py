"""sparse_mla_decode on a Blackwell GPU (sm_100a): the native FP8 kernel against the reference, beside the XLA path.

Never run yet: no Blackwell GPU was available when the kernel was written (it is lowered, interpreted and compiled
by ptxas only). These tests are skipped unless JAX's default device has compute capability 10.x. On such a device
``impl="auto"`` still runs XLA (the kernel is not validated on sm100 hardware); the checks ask for
``impl="mosaic"``. The checks are in tests/_sparse_gpu_checks.py (shared with the Hopper file); the kernel rounds P
to e4m3, and the fp8 MMA accumulation term of the error model is Hopper's, to be re-measured on Blackwell.
"""
from __future__ import annotations

import pytest

from mla_pallas import _dispatch

import _sparse_gpu_checks as checks
from _sparse_inputs import make_case

pytestmark = [pytest.mark.gpu, pytest.mark.sm100]


def test_auto_does_not_pick_unvalidated_kernel(rng):
  case = make_case(rng, B=1, s_q=1, H=8, topk=64)
  checks.run(case, "auto")
  assert _dispatch.last_impl("sparse_mla_decode") == "xla"


@pytest.mark.parametrize("H,s_q", checks.CASES)
def test_kernel_matches_reference(rng, H, s_q):
  checks.check_kernel_matches_reference(rng, H, s_q, quantized_p=True)


def test_split_kv_long_topk(rng):
  checks.check_split_kv_long_topk(rng, quantized_p=True)


def test_prefill_routes_through_kernel(rng):
  checks.check_prefill_routes_through_kernel(rng, quantized_p=True)
