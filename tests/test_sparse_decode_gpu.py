"""sparse_mla_decode on a Hopper GPU (sm_90a): both kernel designs against the reference, beside the XLA path.

The checks are in tests/_sparse_gpu_checks.py (shared with the Blackwell file). The op runs the heads-on-N design
(kernels/sparse_sm90_heads_n.py, Vᵀ in registers) for H <= 16 and the heads-on-M design
(kernels/sparse_sm90_heads_m.py) above; both keep P in f16 for P.V: no e4m3 P term in the error model. Their f16
P.V wgmmas accumulate in f32, and the error model's fp8 accumulation term still applies (conservative).

Quick selection (~4 minutes on an H200, both designs):
``pytest -q -m "gpu and not slow" tests/test_sparse_decode_gpu.py``.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas import reference, testing

import _sparse_gpu_checks as checks
from _sparse_inputs import add_late_spike, logit_std, make_case, run_kernel

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]


@pytest.mark.parametrize("H,s_q", checks.CASES)
def test_kernel_matches_reference(rng, H, s_q):
  """The op's default at every H (8, 16: heads on N; 32, 64, 128: heads on M) and s_q; the fast subset has one
  case per H."""
  checks.check_kernel_matches_reference(rng, H, s_q, quantized_p=False)


def test_split_kv_long_topk(rng):
  checks.check_split_kv_long_topk(rng, quantized_p=False)


def test_prefill_routes_through_kernel(rng):
  checks.check_prefill_routes_through_kernel(rng, quantized_p=False)


@pytest.mark.parametrize("H,s_q,tuning", [
    (64, 2, (("k_buffers", 1),)),                          # heads on M, one K buffer
    (8, 4, (("k_buffers", 3),)),                           # heads on N, three / two K buffers
    pytest.param(16, 2, (("k_buffers", 2),), marks=pytest.mark.slow),
    pytest.param(8, 1, (("tiles_per_split", 8),), marks=pytest.mark.slow),   # a split-length override
    (128, 2, (("tiles_per_split", 128),)),                 # the longest split (1 split of 2048 keys here)
])
def test_sweep_configs_match_reference(rng, H, s_q, tuning):
  """Non-default configs of the sweep (``sweep_configs``) compute the same function on the GPU."""
  checks.check_kernel_matches_reference(rng, H, s_q, quantized_p=False, tuning=tuning)


@pytest.mark.parametrize("H,T,topk,tl", [(128, 37, 2048, False), (64, 133, 2051, True)])
def test_sparse_prefill_heads_m(rng, H, T, topk, tl):
  """sparse_mla_prefill on the heads-on-M kernel at the long splits the op gives prefill ("producer_vt"), with T
  a multiple of nothing (37 tokens of 128 heads: 74 query tiles; 133 of 64), top-k 2048 / 2051 (a partial last
  tile), topk_length, invalid and out-of-range ids and an all-invalid token (make_case), NaN in unused rows;
  against reference.sparse_mla_prefill within the fp8 budget, bitwise deterministic."""
  import mla_pallas
  from mla_pallas import _dispatch
  case = make_case(rng, B=T, s_q=1, H=H, topk=topk, page_size=64, num_pages=16384 // 64, kv_scale=0.5,
                   with_topk_length=tl)
  kw = dict(softmax_scale=case.softmax_scale, kv_scale=case.kv_scale, topk_length=case.topk_length)
  out, lse = mla_pallas.sparse_mla_prefill(case.q[:, 0], case.kv, case.indices[:, 0], impl="mosaic", **kw)
  assert _dispatch.last_impl("sparse_mla_prefill") == "mosaic"
  again, lse2 = mla_pallas.sparse_mla_prefill(case.q[:, 0], case.kv, case.indices[:, 0], impl="mosaic", **kw)
  assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(again).view(np.uint16)), "not deterministic"
  assert np.array_equal(np.asarray(lse), np.asarray(lse2))
  ref_out, ref_lse = reference.sparse_mla_prefill(case.q[:, 0], case.kv, case.indices[:, 0], **kw)
  testing.assert_close_fp8(out, ref_out, rel_l2=checks._budget(case, topk, False), min_cos=0.99,
                           what="sparse prefill out")
  testing.assert_close_fp8(lse, ref_lse, rel_l2=None, max_abs=0.1, what="sparse prefill lse")
  assert np.all(np.asarray(out, np.float32)[~np.isfinite(np.asarray(ref_lse))] == 0)


@pytest.mark.parametrize("H,tile", [(64, 20), (128, 3)])
def test_producer_lazy_rescale(rng, H, tile):
  """"producer_vt" (lazy rescaling: the multipliers skip the rescale in tiles where no row's max grew by more
  than 2^8) with a key in tile ``tile`` of a 32-tile split whose logit for head 0 of token 0 is tens of nats above
  the earlier maximum: a rescale mid-split. Against the reference, against "twin" (eager rescaling) within the
  schedules' one bf16 ulp, bitwise deterministic."""
  case = add_late_spike(make_case(rng, B=2, s_q=2, H=H, topk=2048, page_size=64, num_pages=16384 // 64,
                                  kv_scale=0.5), tile=tile)
  tuning = (("tiles_per_split", 32),)
  ref_out, ref_lse = reference.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=case.softmax_scale,
                                                 kv_scale=case.kv_scale)
  out, lse = run_kernel(case, interpret=False, tuning=(("schedule", "producer_vt"),) + tuning)
  again, _ = run_kernel(case, interpret=False, tuning=(("schedule", "producer_vt"),) + tuning)
  assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(again).view(np.uint16)), "not deterministic"
  base, base_lse = run_kernel(case, interpret=False, tuning=(("schedule", "twin"),) + tuning)
  testing.assert_close_fp8(out, base, rel_l2=2.0 ** -8, what="lazy producer_vt vs twin")
  fin = np.isfinite(np.asarray(base_lse))
  assert np.array_equal(np.isfinite(np.asarray(lse)), fin)
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(base_lse)[fin], atol=1e-4)   # the same QKᵀ
  testing.assert_close_fp8(out, ref_out, rel_l2=checks._budget(case, 2048, False), min_cos=0.99,
                           what="lazy producer_vt out")
  got, want = np.asarray(lse, np.float64), np.asarray(ref_lse, np.float64)
  assert got[0, 0, 0] > got[0, 0, 1:].max() + 8                           # the spike did land in head 0
  # The spike's logit (tens of nats) is a same-sign sum of 576 fp8 products: Hopper's fp8 wgmma accumulation
  # truncates toward zero (~14 retained bits, DeepSeek-V3 report section 3.3.2), so its error does not average
  # out as the 0.1 bound for N(0, 1) logits assumes: up to K / 4 = 144 truncations of 2^-13 of the sum (1.8 %;
  # -1.0 % and -1.1 % on the H200, 2026-12-04; "twin" must agree, checked above).
  assert abs(got[0, 0, 0] - want[0, 0, 0]) <= 0.1 + 144 * 2.0 ** -13 * abs(want[0, 0, 0])
  rest = np.ones(got.shape, bool)
  rest[0, 0, 0] = False
  testing.assert_close_fp8(got[rest], want[rest], rel_l2=None, max_abs=0.1, what="lazy producer_vt lse")


@pytest.mark.slow
@pytest.mark.parametrize("H", [8, 128])
def test_cache_past_2gib(rng, H):
  """Both designs on a 2.4 GB cache with every index past byte offset 2^31 (the thread gather addresses rows
  with 64-bit byte offsets, kernels/gather_threads.py), against the reference; a few invalid ids among them."""
  import jax
  from _sparse_inputs import SparseCase
  page, num_pages = 64, 66_407                      # 4 250 048 slots x 576 B = 2.45 GB
  num_slots = page * num_pages
  kv = jax.random.normal(jax.random.key(3), (num_pages, page, 576), jnp.bfloat16).astype(jnp.float8_e4m3fn)
  lo = 2 ** 31 // 576 + 1                            # first slot whose byte offset does not fit in int32
  idx = rng.integers(lo, num_slots, (2, 2, 2048)).astype(np.int32)
  idx[0, 1, ::97] = -1
  idx[1, 0, 5] = num_slots                           # one past the end: masked, never read
  case = SparseCase(jnp.asarray(rng.standard_normal((2, 2, H, 576)), jnp.bfloat16), kv, jnp.asarray(idx), None,
                    192 ** -0.5, 1.0)
  out, _ = checks.run(case, "mosaic")
  ref_out, _ = reference.sparse_mla_decode(case.q, kv, case.indices, softmax_scale=case.softmax_scale)
  budget = testing.fp8_error_budget(
      split_partials_bf16=True, logit_std=logit_std(case), pv_length=2048, fp8_mma=True, quantized_p=False)
  testing.assert_close_fp8(out, ref_out, rel_l2=budget, min_cos=0.99, what=f"H={H}, cache past 2 GiB")


SCHEDULE_VARIANTS = {"twin": ((), (("k_buffers", 1),)), "producer_vt": ((), (("k_buffers", 3),))}


@pytest.mark.parametrize("schedule", [pytest.param("twin", marks=pytest.mark.slow), "producer_vt"])
@pytest.mark.parametrize("H,s_q", [(128, 2), (64, 1), (32, 4)])
def test_heads_m_schedules(rng, H, s_q, schedule):
  """Each heads-on-M schedule (the op picks one by split length; the others are sweep candidates) against the
  reference (the error model of the default: the same fp8 products and f16 P), and against "twin" on the same
  case with each of its K-buffer variants: the same products summed in another order, so about one bf16 ulp
  (2^-8 relative) apart. top-k 2051: a partial last tile."""
  tuning = (("schedule", schedule),)
  checks.check_kernel_matches_reference(rng, H, s_q, quantized_p=False, tuning=tuning)
  case = make_case(rng, B=2, s_q=s_q, H=H, topk=2051, page_size=64, num_pages=16384 // 64)
  base, base_lse = run_kernel(case, interpret=False, tuning=(("schedule", "twin"),))
  for extra in SCHEDULE_VARIANTS[schedule]:
    out, lse = run_kernel(case, interpret=False, tuning=tuning + extra)
    testing.assert_close_fp8(out, base, rel_l2=2.0 ** -8, what=f"{schedule}{extra} vs twin")
    fin = np.isfinite(np.asarray(base_lse))
    assert np.array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(base_lse)[fin], atol=1e-4)


@pytest.mark.parametrize("H,s_q,q_dtype", [(128, 1, jnp.bfloat16), (64, 2, jnp.float32), (32, 4, jnp.bfloat16)])
def test_heads_m_twin_quantizes_q(rng, H, s_q, q_dtype):
  """"twin" (the consumers quantize the tile's q rows in raw PTX, 32 each; the bytes of the XLA pre-pass:
  tests/test_q_quant.py for the 16-row form) with one and several splits, an all-zero row and a 300x row, H 32 leaving the second
  consumer's rows all padding: against "producer_vt" (its multipliers quantize the same rows) within the schedules' one bf16 ulp,
  and against the reference. (Bitwise equal to "twin" with the pre-pass on the H200 before that path was
  deleted: docs/kernels/sparse_decode_sm90.md, "Q in the heads-on-M twin".)"""
  import dataclasses
  case = make_case(rng, B=2, s_q=s_q, H=H, topk=2051, page_size=64, num_pages=16384 // 64, kv_scale=0.5)
  q = case.q.astype(q_dtype).at[0, 0, 1].set(0).at[-1, -1, H - 1].multiply(300)
  case = dataclasses.replace(case, q=q)
  for tps in (4, 2):
    out, lse = run_kernel(case, interpret=False, tuning=(("tiles_per_split", tps),))
    base, base_lse = run_kernel(case, interpret=False, tuning=(("tiles_per_split", tps), ("schedule", "producer_vt")))
    testing.assert_close_fp8(out, base, rel_l2=2.0 ** -8, what=f"twin vs producer_vt, {tps}-tile splits")
    fin = np.isfinite(np.asarray(base_lse))
    assert np.array_equal(np.isfinite(np.asarray(lse)), fin)
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(base_lse)[fin], atol=1e-4)
  checks.check_kernel_matches_reference(rng, H, s_q, quantized_p=False, tuning=(("schedule", "twin"),))


@pytest.mark.parametrize("H,s_q", [(8, 4), (16, 2)])
def test_designs_agree(rng, H, s_q):
  """At H <= 16 the default heads-on-N design (Vᵀ in registers) and the heads-on-M design (forced through the op's
  rule) compute the same fp8 products and the same f16 P, so they differ only in f32 summation order: at most
  about one bf16 ulp (2^-8 relative) apart, as in interpret mode. Much tighter than the error budget against the
  reference, which a racing early heads-on-N version (two warpgroups sharing Mosaic's cross-warp reduction
  scratch) passed at N = 16 while it was 0.035 rel-L2 off XLA (docs/kernels/sparse_decode_sm90.md)."""
  case = make_case(rng, B=2, s_q=s_q, H=H, topk=2051, page_size=64, num_pages=16384 // 64)
  base, base_lse = run_kernel(case, interpret=False, heads_on_n_max=0)
  out, lse = run_kernel(case, interpret=False)
  testing.assert_close_fp8(out, base, rel_l2=2.0 ** -8, what="heads on N vs heads on M")
  fin = np.isfinite(np.asarray(base_lse))
  assert np.array_equal(np.isfinite(np.asarray(lse)), fin)
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(base_lse)[fin], atol=1e-4)


PRODUCER, SEESAW = (("schedule", "producer_vt"),), (("schedule", "seesaw"),)


@pytest.mark.parametrize("H,s_q,tuning", [
    (128, 2, PRODUCER), (64, 1, PRODUCER + (("tiles_per_split", 2),)), (16, 2, PRODUCER + (("k_buffers", 1),)),
    pytest.param(32, 4, PRODUCER, marks=pytest.mark.slow),
    (128, 2, SEESAW + (("tiles_per_split", 32),)), (64, 1, SEESAW + (("tiles_per_split", 3),)),
    (16, 2, SEESAW + (("tiles_per_split", 1),)), pytest.param(32, 4, SEESAW + (("tiles_per_split", 2),),
                                                              marks=pytest.mark.slow)])
def test_bf16_cache_producer(rng, H, s_q, tuning):
  """The schedules that hand P between warpgroups over a bfloat16 cache (kernels/sparse_sm90_heads_m.py) against
  the reference within testing.BF16_ATTENTION_REL_L2: "producer_vt" (the producer's bf16 QKᵀ and softmax, P into
  the K buffer's rope chunk, the multipliers' P·V as m64n64k16 wgmmas, one group per 64-column chunk of V; the
  plan's splits, 2-tile splits, one K buffer: passing here is what BF16_PRODUCER_VALIDATED_ON records) and
  "seesaw" (the consumers alternate tiles for QKᵀ and softmax; splits of 32 (even), 3 (odd: consumer 0 owns the
  last tile) and 1 tile (consumer 1 owns none)). Top-k 2051 (a partial last tile), NaN rows, invalid ids, an
  all-invalid row; bitwise deterministic."""
  import dataclasses
  case = make_case(rng, B=3, s_q=s_q, H=H, topk=2051, page_size=64, num_pages=16384 // 64, kv_scale=0.5)
  case = dataclasses.replace(case, kv=case.kv.astype(jnp.bfloat16))
  out, lse = run_kernel(case, interpret=False, tuning=tuning)
  ref_out, ref_lse = reference.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=case.softmax_scale,
                                                 kv_scale=case.kv_scale)
  testing.assert_close_fp8(out, ref_out, rel_l2=testing.BF16_ATTENTION_REL_L2, min_cos=0.9999, what=f"bf16 {tuning[0][1]}")
  testing.assert_close_fp8(lse, ref_lse, rel_l2=None, max_abs=1e-3, what=f"bf16 {tuning[0][1]} lse")
  assert np.all(np.asarray(out, np.float32)[~np.isfinite(np.asarray(ref_lse))] == 0.0)
  again, _ = run_kernel(case, interpret=False, tuning=tuning)
  assert np.array_equal(np.asarray(again).view(np.uint16), np.asarray(out).view(np.uint16))


@pytest.mark.parametrize("H,s_q", [(128, 2), (64, 1), (16, 2), (8, 4), pytest.param(32, 4, marks=pytest.mark.slow)])
def test_bf16_cache_kernel(rng, H, s_q):
  """The heads-on-M kernel over a bfloat16 cache (BF16 attention, impl="mosaic"; H <= 32 rows zero-padded to 64;
  passed on the H200 at every head count: ops.sparse_decode.BF16_VALIDATED_HEADS) against the
  reference within testing.BF16_ATTENTION_REL_L2 (P and the outputs in bf16, f32 accumulation): top-k 2051 (a
  partial last tile, several 16-tile splits), NaN rows, invalid ids, an all-invalid row; bitwise deterministic."""
  import dataclasses

  import mla_pallas
  case = make_case(rng, B=3, s_q=s_q, H=H, topk=2051, page_size=64, num_pages=16384 // 64, kv_scale=0.5)
  case = dataclasses.replace(case, kv=case.kv.astype(jnp.bfloat16))
  kw = dict(softmax_scale=case.softmax_scale, kv_scale=case.kv_scale, impl="mosaic")
  out, lse = mla_pallas.sparse_mla_decode(case.q, case.kv, case.indices, **kw)
  assert mla_pallas.last_impl("sparse_mla_decode") == "mosaic"
  ref_out, ref_lse = reference.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=case.softmax_scale,
                                                 kv_scale=case.kv_scale)
  testing.assert_close_fp8(out, ref_out, rel_l2=testing.BF16_ATTENTION_REL_L2, min_cos=0.9999, what="bf16 kernel")
  testing.assert_close_fp8(lse, ref_lse, rel_l2=None, max_abs=1e-3, what="bf16 kernel lse")
  assert np.all(np.asarray(out, np.float32)[~np.isfinite(np.asarray(ref_lse))] == 0.0)
  again, _ = mla_pallas.sparse_mla_decode(case.q, case.kv, case.indices, **kw)
  assert np.array_equal(np.asarray(again).view(np.uint16), np.asarray(out).view(np.uint16))
