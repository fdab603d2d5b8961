"""sparse_mla_decode on a Hopper GPU (sm_90a): the native FP8 kernel against the reference, beside the XLA path.

The checks are in tests/_sparse_gpu_checks.py (shared with the Blackwell file). The default kernel keeps P in f16
for P.V (pv_dtype="f16"): no e4m3 P term in the error model; its f16 P.V wgmma accumulates in f32, and the error
model's fp8 accumulation term still applies to it (conservative).
"""
from __future__ import annotations

import pytest

from mla_pallas.kernels import sparse_decode_sm90 as sm90

import _sparse_gpu_checks as checks

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

QUANTIZED_P = sm90.TuningConfig().pv_dtype == "fp8"


@pytest.mark.parametrize("H,s_q", checks.CASES)
def test_kernel_matches_reference(rng, H, s_q):
  checks.check_kernel_matches_reference(rng, H, s_q, quantized_p=QUANTIZED_P)


def test_split_kv_long_topk(rng):
  checks.check_split_kv_long_topk(rng, quantized_p=QUANTIZED_P)


def test_prefill_routes_through_kernel(rng):
  checks.check_prefill_routes_through_kernel(rng, quantized_p=QUANTIZED_P)


@pytest.mark.parametrize("H,s_q", [(8, 4), (16, 6), (8, 1), (16, 2), (32, 1)])
def test_heads_on_n_matches_reference(rng, H, s_q):
  """head_axis="n" (H <= 32: heads on the MMAs' N side, P kept in f16); not the default until this passes here."""
  checks.check_kernel_matches_reference(rng, H, s_q, quantized_p=False, tuning=(("head_axis", "n"),))
