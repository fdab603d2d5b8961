"""sparse_mla_decode on a Hopper GPU (sm_90a): the native FP8 kernel against the reference, beside the XLA path.

The checks are in tests/_sparse_gpu_checks.py (shared with the Blackwell file). The default kernel keeps P in f16
for P.V (pv_dtype="f16"): no e4m3 P term in the error model; its f16 P.V wgmma accumulates in f32, and the error
model's fp8 accumulation term still applies to it (conservative).
"""
from __future__ import annotations

import numpy as np
import pytest

from mla_pallas import testing
from mla_pallas.kernels import sparse_decode_sm90 as sm90
from mla_pallas.ops import sparse_decode as sd

import _sparse_gpu_checks as checks
from _sparse_inputs import make_case

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

QUANTIZED_P = sm90.TuningConfig().pv_dtype == "fp8"


@pytest.mark.parametrize("H,s_q", checks.CASES)
def test_kernel_matches_reference(rng, H, s_q):
  checks.check_kernel_matches_reference(rng, H, s_q, quantized_p=QUANTIZED_P)


def test_split_kv_long_topk(rng):
  checks.check_split_kv_long_topk(rng, quantized_p=QUANTIZED_P)


def test_prefill_routes_through_kernel(rng):
  checks.check_prefill_routes_through_kernel(rng, quantized_p=QUANTIZED_P)


@pytest.mark.parametrize("H,s_q", [(8, 4), (16, 6), (8, 1), (16, 2), (32, 1), (32, 4)])
def test_heads_on_n_matches_reference(rng, H, s_q):
  """head_axis="n" (H <= 32: heads on the MMAs' N side, P kept in f16): the op's default for H <= 16."""
  checks.check_kernel_matches_reference(rng, H, s_q, quantized_p=False, tuning=(("head_axis", "n"),))


@pytest.mark.parametrize("H,s_q", [(8, 4), (16, 2)])
def test_heads_on_m_matches_reference(rng, H, s_q):
  """head_axis="m" at H <= 16 (the heads padded to the MMAs' 64 rows): the default there until 2026-11-30."""
  checks.check_kernel_matches_reference(rng, H, s_q, quantized_p=False, tuning=(("head_axis", "m"),))


@pytest.mark.parametrize("H,s_q,tuning", [(8, 4, (("consumers", 4),)), (16, 2, (("consumers", 5), ("k_buffers", 3))),
                                          (8, 1, (("k_buffers", 3),))])
def test_heads_on_n_consumers_match_reference(rng, H, s_q, tuning):
  """head_axis="n" with the V upcast over 4 / 5 consumer warpgroups and / or 3 K buffers (opt-in variants)."""
  checks.check_kernel_matches_reference(rng, H, s_q, quantized_p=False, tuning=(("head_axis", "n"),) + tuning)


@pytest.mark.parametrize("H,s_q", [(8, 4), (16, 2), (32, 1)])
def test_head_axes_agree(rng, H, s_q):
  """Both arrangements (and the consumer / K-buffer variants; at H <= 16 the default Vᵀ in registers against the
  SMEM-staged f16 V tile) compute the same fp8 products and the same f16 P, so
  they differ only in f32 summation order: at most about one bf16 ulp (2^-8 relative) apart, as in interpret mode.
  Much tighter than the error budget against the reference, which a racing first head_axis="n" version (two
  warpgroups sharing Mosaic's cross-warp reduction scratch) passed at N = 16 while it was 0.035 rel-L2 off XLA."""
  case = make_case(rng, B=2, s_q=s_q, H=H, topk=2051, page_size=64, num_pages=16384 // 64)
  base, base_lse = checks.run(case, "mosaic", (("head_axis", "m"),))
  variants = [(("head_axis", "n"),), (("head_axis", "n"), ("k_buffers", 3))]
  if H <= 16:   # the op's default (Vᵀ in registers, 4 K buffers), the same with V staged in SMEM, 4 consumers
    variants += [(), (("v_regs", False),), (("head_axis", "n"), ("consumers", 4))]
  for tuning in variants:
    out, lse = checks.run(case, "mosaic", tuning)
    testing.assert_close_fp8(out, base, rel_l2=2.0 ** -8, what=f"{tuning} vs head_axis m")
    fin = np.isfinite(np.asarray(base_lse))
    assert np.array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(base_lse)[fin], atol=1e-4)


@pytest.mark.parametrize("H,s_q,sms", [(8, 4, 3), (16, 2, 3), (8, 1, 5)])
def test_persistent_matches_reference(rng, monkeypatch, H, s_q, sms):
  """TuningConfig.persistent (opt-in; measured no faster, benchmarks/RESULTS.md runs 17 and 19) with the SM count
  patched so that every CTA works through several items (and some one more than others): the full reference
  check. At s_q = 1 the splits are 8 tiles long, too short for the default 4 K buffers (the index prefetch needs
  tiles_per_split >= 2 k_buffers + 2): the op then takes 3."""
  monkeypatch.setattr(sd, "_num_sms", lambda: sms)
  checks.check_kernel_matches_reference(rng, H, s_q, quantized_p=False, tuning=(("persistent", True),))


def test_persistent_is_bitwise_one_item_per_cta(rng, monkeypatch):
  """Per item the persistent kernel runs the same operations in the same order as one CTA per item: bitwise equal
  on a case with 2 splits per token (odd top-k), 7 "SMs" for 64 items, NaN rows and invalid indices."""
  monkeypatch.setattr(sd, "_num_sms", lambda: 7)
  case = make_case(rng, B=8, s_q=4, H=8, topk=2051, page_size=64, num_pages=16384 // 64)
  out, lse = checks.run(case, "mosaic", (("persistent", True),))
  base, base_lse = checks.run(case, "mosaic", (("persistent", False),))
  assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(base).view(np.uint16))
  assert np.array_equal(np.asarray(lse), np.asarray(base_lse), equal_nan=True)
