"""sparse_mla_decode / sparse_mla_prefill on the CPU: the XLA path, the sm_90 kernel in interpret mode (with race
detection), lowering of the kernel for CUDA at sm_90, argument checks and implementation choice.

Tolerances come from the FP8 error model of :func:`mla_pallas.testing.fp8_error_budget`: both implementations
round Q (per row) and P to e4m3 (unit roundoff 2^-4), the reference does not; the cache is fp8 for both.
"""
from __future__ import annotations

import dataclasses
import functools
import re
import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mla_pallas
from mla_pallas import _dispatch, reference, testing
from mla_pallas.kernels import gather_threads
from mla_pallas.kernels import common, sparse_sm90_heads_m as heads_m, sparse_sm90_heads_n as heads_n
from mla_pallas.ops import sparse_decode as sd

from _sparse_inputs import FP8, add_late_spike, logit_std, make_case, run_kernel

RACES = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=True)


def _budget(case, fp8_mma, quantized_p=True):
  # Q rounded to e4m3 in both implementations, P in the XLA path (the sm_90 kernels keep P in f16:
  # quantized_p=False); fp8_mma=False in interpret mode (exact f32 products) and for XLA on the CPU (fp8
  # operands are upcast).
  return testing.fp8_error_budget(split_partials_bf16=True, logit_std=logit_std(case), pv_length=case.indices.shape[-1],
                                  fp8_mma=fp8_mma, quantized_p=quantized_p)


def _ref(case):
  return reference.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=case.softmax_scale,
                                     kv_scale=case.kv_scale, topk_length=case.topk_length)


def _run(case, impl, interpret=False):
  return mla_pallas.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=case.softmax_scale,
                                      kv_scale=case.kv_scale, topk_length=case.topk_length, impl=impl,
                                      interpret=interpret)


def _check_against_reference(case, out, lse, budget):
  ref_out, ref_lse = _ref(case)
  testing.assert_close_fp8(out, ref_out, rel_l2=budget, min_cos=0.99, what="out")
  # lse: a logit error of RMS sigma moves lse by about sigma (natural log units); 0.1 = 3x the q-rounding
  # term at logit_std ~1.7. NaN/inf positions (rows with nothing valid: -inf) must match exactly.
  testing.assert_close_fp8(lse, ref_lse, rel_l2=None, max_abs=0.1, what="lse")
  valid_any = np.isfinite(np.asarray(ref_lse))
  assert np.all(np.asarray(out, np.float32)[~valid_any] == 0.0), "rows with no valid index must be exactly 0"
  assert not np.isnan(np.asarray(out, np.float32)).any(), "NaN leaked from a masked cache row"


@pytest.mark.parametrize("B,s_q,H,topk,page,tl", [
    (2, 1, 16, 37, 16, False),
    (2, 2, 64, 129, 64, True),
    (1, 3, 8, 5, 16, False),
])
def test_xla_path_matches_reference(rng, B, s_q, H, topk, page, tl):
  case = make_case(rng, B=B, s_q=s_q, H=H, topk=topk, page_size=page, num_pages=max(4, 1024 // page),
                   with_topk_length=tl, kv_scale=0.5)
  out, lse = _run(case, "xla")
  assert out.shape == (B, s_q, H, 512) and out.dtype == jnp.bfloat16
  assert lse.shape == (B, s_q, H) and lse.dtype == jnp.float32
  _check_against_reference(case, out, lse, _budget(case, fp8_mma=False))
  out2, _ = _run(case, "xla")
  assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(out2).view(np.uint16)), "not deterministic"


# BF16 attention's error model: mla_pallas.testing.BF16_ATTENTION_REL_L2.
BF16_ATTN_BUDGET = testing.BF16_ATTENTION_REL_L2


@pytest.mark.parametrize("B,s_q,H,topk,page,tl", [(2, 2, 16, 129, 16, True), (1, 3, 64, 37, 64, False)])
def test_bf16_cache_xla_matches_reference(rng, B, s_q, H, topk, page, tl):
  """A bfloat16 cache (NaN in unused rows, invalid ids, an all-invalid row, topk_length) runs BF16 attention on
  the XLA path, and in interpret mode under impl="auto" on the bf16-cache kernel (heads on M at every H; H < 64
  zero-padded to the 64 MMA rows)."""
  case = make_case(rng, B=B, s_q=s_q, H=H, topk=topk, page_size=page, num_pages=max(4, 1024 // page),
                   with_topk_length=tl, kv_scale=0.5)
  case = dataclasses.replace(case, kv=case.kv.astype(jnp.bfloat16))
  ref_out, ref_lse = _ref(case)
  for impl, want in (("xla", "xla"), ("auto", "mosaic-interpret")):
    out, lse = _run(case, impl, interpret=True)
    assert _dispatch.last_impl("sparse_mla_decode") == want
    testing.assert_close_fp8(out, ref_out, rel_l2=BF16_ATTN_BUDGET, min_cos=0.9999, what=f"bf16 cache out, {want}")
    testing.assert_close_fp8(lse, ref_lse, rel_l2=None, max_abs=1e-4, what="bf16 cache lse")
    assert np.all(np.asarray(out, np.float32)[~np.isfinite(np.asarray(ref_lse))] == 0.0)
    assert not np.isnan(np.asarray(out, np.float32)).any()
  # prefill: the same computation with B = T tokens, s_q = 1
  q_t, idx_t = case.q.reshape(-1, H, 576), case.indices.reshape(-1, topk)
  tl_t = None if case.topk_length is None else jnp.repeat(case.topk_length, s_q)
  p_out, _ = mla_pallas.sparse_mla_prefill(q_t, case.kv, idx_t, softmax_scale=case.softmax_scale,
                                           kv_scale=case.kv_scale, topk_length=tl_t)
  r_out, _ = reference.sparse_mla_prefill(q_t, case.kv, idx_t, softmax_scale=case.softmax_scale,
                                          kv_scale=case.kv_scale, topk_length=tl_t)
  testing.assert_close_fp8(p_out, r_out, rel_l2=BF16_ATTN_BUDGET, min_cos=0.9999, what="bf16 cache prefill")


@pytest.mark.parametrize("B,s_q,H,topk,page,tl", [
    (1, 2, 16, 77, 16, False),      # H <= 16: heads on N; odd top-k
    (2, 1, 64, 130, 64, True),      # heads on M; topk_length; 3 tiles
    (2, 2, 8, 70, 16, True),        # heads on N with topk_length (the pre-pass masks the tail)
    (1, 1, 128, 64, 16, False),     # H = 128: two query tiles per token
    (1, 1, 32, 512, 16, False),     # few CTAs: split-KV (2 splits) + combine
])
def test_kernel_interpret_matches_reference(rng, B, s_q, H, topk, page, tl):
  case = make_case(rng, B=B, s_q=s_q, H=H, topk=topk, page_size=page, num_pages=max(4, 1024 // page),
                   with_topk_length=tl)
  testing.reset_interpreter()
  out, lse = _run(case, "mosaic", interpret=RACES)
  assert _dispatch.last_impl("sparse_mla_decode") == "mosaic-interpret"
  assert not testing.races_found(), "the interpreter found a data race in the kernel"
  _check_against_reference(case, out, lse, _budget(case, fp8_mma=False, quantized_p=False))
  # Same quantization of Q as the XLA path; the XLA path also rounds P to e4m3, the default kernel keeps P in
  # f16: the two differ by the P term of the error model (plus both bf16 output roundings).
  xla_out, _ = _run(case, "xla")
  testing.assert_close_fp8(out, xla_out, what="kernel vs XLA path", rel_l2=testing.fp8_error_budget(
      split_partials_bf16=True, quantized_q=False, quantized_p=True, fp8_mma=False, pv_length=topk))


def _assert_lse_close(lse, base_lse, atol=1e-4):
  """Two schedules' lse: -inf in the same rows, the rest within f32 summation order."""
  fin = np.isfinite(np.asarray(base_lse))
  assert np.array_equal(np.isfinite(np.asarray(lse)), fin)
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(base_lse)[fin], atol=atol)


def _interpret_budget(case):
  # P kept in f16 by both sm_90 designs (rounding 2^-11): no P term in the error model; exact products.
  return testing.fp8_error_budget(
      split_partials_bf16=True, logit_std=logit_std(case), pv_length=case.indices.shape[-1], fp8_mma=False,
      quantized_p=False)


@pytest.mark.parametrize("H,tuning", [
    (32, (("k_buffers", 1),)),      # heads on M, one K buffer
    (8, (("k_buffers", 2),)),       # heads on N, two and three K buffers
    (16, (("k_buffers", 3),)),
    (32, (("tiles_per_split", 2),)),   # a split-length override: 4 tiles -> 2 splits of 2
    # heads on M, the producer warpgroup handing P to two multipliers (4 warpgroups; interpret mode: with the f16
    # V tile)
    (64, (("schedule", "producer_vt"), ("k_buffers", 3))),
    (128, (("schedule", "producer_vt"), ("tiles_per_split", 2))),   # two query tiles per token, 2 splits, slots reused
    (32, (("schedule", "twin"), ("tiles_per_split", 4))),          # "twin", the op's choice for short splits
    # one-tile splits (the small-batch sweep's candidates): fewer tiles than K buffers, 4 partials per token
    (8, (("tiles_per_split", 1),)),
    (128, (("tiles_per_split", 1),)),
])
def test_kernel_tuning_interpret(rng, H, tuning):
  """The sweep's non-default configs compute the same function (races checked)."""
  case = make_case(rng, B=2, s_q=1, H=H, topk=200, page_size=16, num_pages=64)
  testing.reset_interpreter()
  out, lse = run_kernel(case, interpret=RACES, tuning=tuning)
  assert not testing.races_found()
  _check_against_reference(case, out, lse, _interpret_budget(case))


@pytest.mark.parametrize("B,s_q,H,topk,page", [
    (1, 2, 8, 77, 16),      # H = 8 padded to the 16 MMA columns; odd top-k (a partial tile)
    (2, 1, 16, 130, 64),    # H = 16: every column a head; 3 tiles
    (1, 1, 16, 320, 16),    # few CTAs: split-KV (5 tiles) + combine on the transposed output
])
def test_heads_on_n_interpret(rng, B, s_q, H, topk, page):
  """The heads-on-N design (Sᵀ = K·Qᵀ, Oᵀ = Vᵀ·Pᵀ; in interpret mode V upcast in SMEM) against the reference
  (races checked) and against the heads-on-M design on the same case: the same fp8 products and f16 P, so they
  differ only in f32 summation order."""
  case = make_case(rng, B=B, s_q=s_q, H=H, topk=topk, page_size=page, num_pages=max(4, 1024 // page))
  testing.reset_interpreter()
  out, lse = run_kernel(case, interpret=RACES)
  assert not testing.races_found()
  _check_against_reference(case, out, lse, _interpret_budget(case))
  base, base_lse = run_kernel(case, interpret=True, heads_on_n_max=0)
  # f32 summation order can flip the bf16 rounding of an output: at most one bf16 ulp (2^-8 relative) per value.
  testing.assert_close_fp8(out, base, what="heads on N vs heads on M", rel_l2=2.0 ** -8)
  fin = np.isfinite(np.asarray(base_lse))
  assert np.array_equal(np.isfinite(np.asarray(lse)), fin)
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(base_lse)[fin], atol=1e-4)


@pytest.mark.parametrize("H,s_q,q_dtype,tuning,races", [
    (128, 1, jnp.bfloat16, (), False),                          # two query tiles per token
    (64, 2, jnp.float32, (("tiles_per_split", 2),), True),      # several splits (races checked here only)
    (32, 3, jnp.bfloat16, (), False),                           # rows 32-63 padding: consumer 1 quantizes no q row
])
def test_heads_m_twin_quantizes_q(rng, H, s_q, q_dtype, tuning, races):
  """Heads on M, "twin" over an fp8 cache: the two consumers quantize their halves of the tile's q rows
  (interpret mode: q_quant.quantize_head_rows_interpret; its 16-row form is bitwise the XLA pre-pass in
  tests/test_q_quant.py, this half-tile form was bitwise the pre-pass's twin on the H200 before that path went) with
  races checked (in the several-splits case); an all-zero row and a 300x row among them; against the reference,
  and against "producer_vt" (whose multipliers quantize the same rows) within the schedules' one bf16 ulp of f32
  summation order."""
  case = make_case(rng, B=2, s_q=s_q, H=H, topk=150, page_size=16, num_pages=64, kv_scale=0.5)
  q = case.q.astype(q_dtype).at[0, 0, 1].set(0).at[-1, -1, H - 1].multiply(300)
  case = dataclasses.replace(case, q=q)
  testing.reset_interpreter()
  out, lse = run_kernel(case, interpret=RACES if races else True, tuning=(("schedule", "twin"),) + tuning)
  assert not testing.races_found()
  _check_against_reference(case, out, lse, _interpret_budget(case))
  base, base_lse = run_kernel(case, interpret=True, tuning=(("schedule", "producer_vt"),) + tuning)
  testing.assert_close_fp8(out, base, rel_l2=2.0 ** -8, what="twin vs producer_vt")
  _assert_lse_close(lse, base_lse)


def test_producer_lazy_rescale_interpret(rng):
  """"producer_vt" rescales lazily (heads_m.RESCALE_THRESHOLD: a row's max moves only when it grows by more than
  2^8; the multipliers skip the rescale where every alpha is 1): a key in the third of four tiles of one split,
  attended nowhere else by its token, whose logit for head 0 is tens of nats above the earlier tiles' maximum
  forces a rescale mid-split; against the reference and against "twin" (eager rescaling) within the schedules' one
  bf16 ulp of f32 summation order (P in f16 keeps 11 bits at any scale up to 2^8). A kernel that skips that
  rescale fails both (rel-L2 1-4)."""
  case = add_late_spike(make_case(rng, B=1, s_q=2, H=64, topk=256, page_size=16, num_pages=64, kv_scale=0.5),
                        tile=2)
  tuning = (("tiles_per_split", 4),)
  out, lse = run_kernel(case, interpret=True, tuning=(("schedule", "producer_vt"),) + tuning)
  _check_against_reference(case, out, lse, _interpret_budget(case))
  base, base_lse = run_kernel(case, interpret=True, tuning=(("schedule", "twin"),) + tuning)
  testing.assert_close_fp8(out, base, rel_l2=2.0 ** -8, what="lazy producer_vt vs twin")
  _assert_lse_close(lse, base_lse)
  assert np.asarray(lse)[0, 0, 0] > np.asarray(lse)[0, 0, 1:].max() + 8    # the spike did land in head 0


def test_online_softmax_column_residue_sums():
  """common.online_softmax_tile with l as [R, g] partial sums per column residue (the "producer_vt" producer's
  SUM_COLS form): the same p, alpha and m as with an [R] row sum, and after the caller's final sum the same l to
  f32 rounding, over lazily rescaled tiles with masked keys and a jump that moves one row's max."""
  r = np.random.default_rng(5)
  tiles = [r.normal(size=(8, 64)).astype(np.float32) * 3.0 for _ in range(3)]
  tiles[1][4, 9] += 40.0
  valid = jnp.asarray(r.random(64) > 0.2)
  scale = jnp.full((8,), 0.7, jnp.float32)
  m_row = m_res = jnp.full((8,), -jnp.inf, jnp.float32)
  l_row, l_res = jnp.zeros((8,), jnp.float32), jnp.zeros((8, 8), jnp.float32)
  for t in tiles:
    p1, a1, m_row, l_row = common.online_softmax_tile(jnp.asarray(t), valid, scale, m_row, l_row,
                                                      rescale_threshold=8.0, scale_in_exponent=True)
    p2, a2, m_res, l_res = common.online_softmax_tile(jnp.asarray(t), valid, scale, m_res, l_res,
                                                      rescale_threshold=8.0, scale_in_exponent=True)
    np.testing.assert_array_equal(np.asarray(p1), np.asarray(p2))
    np.testing.assert_array_equal(np.asarray(a1), np.asarray(a2))
  np.testing.assert_array_equal(np.asarray(m_row), np.asarray(m_res))
  np.testing.assert_allclose(np.asarray(l_res.sum(axis=1)), np.asarray(l_row), rtol=1e-6)   # summation order


def test_online_softmax_lazy_rescale():
  """common.online_softmax_tile with rescale_threshold over tiles of logits with a late jump: the normalised
  result equals the eager form's (to f32 rounding), p stays <= 2^t, alpha is exactly 1 in the rows whose max
  did not move, and a row with nothing valid keeps m = -inf, output 0 and alpha 1."""
  r = np.random.default_rng(3)
  tiles = [r.normal(size=(8, 16)).astype(np.float32) for _ in range(4)]
  tiles[2][1, 5] += 30.0                      # row 1 jumps by far more than the threshold in tile 2
  tiles[3][2, 0] += 3.0                       # row 2 grows a little: lazy keeps its max
  valid = np.ones(16, bool)
  valid[[3, 11]] = False
  scale = jnp.full((8,), 1.0, jnp.float32)
  dead = np.zeros((8,), bool)
  dead[7] = True                              # row 7: every key masked (per-element mask below)

  v = jnp.asarray(r.normal(size=(16, 16)), jnp.float32)
  mask = jnp.asarray(valid[None, :] & ~dead[:, None])

  def run(threshold):
    m = jnp.full((8,), -jnp.inf, jnp.float32)
    l = jnp.zeros((8,), jnp.float32)
    o = jnp.zeros((8, 16), jnp.float32)
    alphas = []
    for t in tiles:
      p, alpha, m, l = common.online_softmax_tile(jnp.asarray(t), mask, scale, m, l, rescale_threshold=threshold)
      o = o * alpha[:, None] + p @ v
      alphas.append(np.asarray(alpha))
      assert float(jnp.max(p)) <= 2.0 ** (threshold or 0.0)
    return np.asarray(o / jnp.where(l == 0, 1.0, l)[:, None]), np.asarray(m + jnp.log2(l)), alphas, np.asarray(m)

  eager_o, eager_lse, _, _ = run(None)
  lazy_o, lazy_lse, alphas, m = run(8.0)
  np.testing.assert_allclose(lazy_o, eager_o, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(lazy_lse[:7], eager_lse[:7], rtol=1e-6)
  assert np.isneginf(m[7]) and np.all(lazy_o[7] == 0) and all(a[7] == 1.0 for a in alphas[1:])
  assert alphas[2][1] < 2.0 ** -8 and np.all(alphas[2][[0, 2, 3, 4, 5, 6]] == 1.0)   # only row 1 moved in tile 2
  assert np.all(alphas[3] == 1.0)                                                   # row 2's +3 does not move it
  assert bool(common.alpha_is_one(jnp.asarray(alphas[3]))) and not bool(common.alpha_is_one(jnp.asarray(alphas[2])))


def test_heads_m_twin_q_config():
  """Both schedules over an fp8 cache quantize q in the kernel (needs H and softmax_scale, one more SMEM row); a
  bf16 cache's kernel does not."""
  assert heads_m.TuningConfig().q_in_kernel
  assert heads_m.TuningConfig(schedule="producer_vt").q_in_kernel
  assert not heads_m.TuningConfig(cache_dtype="bfloat16", tiles_per_split=16).q_in_kernel
  with pytest.raises(ValueError, match="heads and softmax_scale"):
    heads_m.build(2, 64, 1, 1, "bfloat16", heads_m.TuningConfig())
  assert heads_m.TuningConfig().smem_budget() == 201216


def test_heads_m_twin_lowers_for_sm90():
  """sm_90a lowering of "twin" (H 128, 2-tile splits), with counts: each consumer's branch quantizes 8 rows per
  warp (two 16-byte stores, one amax store and a 5-step butterfly per row: 2 x 8 x ...); the loader's only TMA
  is the indices'; the QKᵀ wgmmas unchanged."""
  S = jax.ShapeDtypeStruct
  kern = heads_m.build(4, 4096, 16, 2, "float32", heads_m.TuningConfig(tiles_per_split=2),
                       heads=128, softmax_scale=576 ** -0.5)
  low = testing.lower_for_cuda(kern, S((2 * 128, common.D_QK), jnp.bfloat16), S((4096, 576), FP8),
                               S((2, 32, 64), jnp.int32), S((1,), jnp.float32), arch=(9, 0))
  assert low.count(r"st\.shared\.v4\.b32") == 2 * 8 * 2 and low.count(r"st\.shared\.f32") == 2 * 8
  # (8 more butterflies are the softmax's)
  assert low.count(r"shfl\.sync\.bfly|nvvm\.shfl\.sync\s+bfly") == 8 + 2 * 8 * 5
  assert low.count(r"cp\.async\.bulk\.tensor") == 1
  assert low.count(r"wgmma\.mma_async[^ ]*e4m3\.e4m3") == 20


def test_default_config_rules():
  """The one shape -> kernel map: sm_90 H <= 16 on the heads-on-N design (4 K buffers), more heads on the
  heads-on-M design (2 K buffers), sm_100 its own kernel; the split plan inside."""
  for h in (8, 16):
    cfg = sd.default_config(h, 512, 2048)
    assert cfg.design == "sm90_heads_n" and cfg.module is heads_n
    assert cfg.kernel == heads_n.TuningConfig(tiles_per_split=32, k_buffers=4) and cfg.num_splits == 1
  for h in (32, 64, 128):     # splits of 8 tiles and more: "producer_vt"; shorter ones: "twin"
    cfg = sd.default_config(h, 256, 2048)
    assert cfg.design == "sm90_heads_m"
    assert cfg.kernel == heads_m.TuningConfig(tiles_per_split=32, k_buffers=2, schedule="producer_vt")
  assert sd.default_config(64, 64, 2048).kernel == heads_m.TuningConfig(tiles_per_split=16, k_buffers=2,
                                                                        schedule="producer_vt")
  assert sd.default_config(128, 16, 2048).kernel == heads_m.TuningConfig(tiles_per_split=8, k_buffers=2,
                                                                         schedule="producer_vt")
  assert sd.default_config(128, 2, 2048).kernel == heads_m.TuningConfig(tiles_per_split=2, k_buffers=2)
  # one token, 8 tiles: heads on M splits down to 1 tile (_min_split_tiles: 8 CTAs)
  assert sd.default_config(64, 1, 512).num_splits == 8 and sd.default_config(64, 1, 512).kernel.tiles_per_split == 1
  assert sd.default_config(8, 4, 2048, arch="sm100").design == "sm100"
  with pytest.raises(NotImplementedError, match="sm80"):
    sd.default_config(8, 4, 2048, arch="sm80")


@pytest.mark.parametrize("h,arch", [(8, "sm90"), (64, "sm90"), (64, "sm100")])
def test_sweep_configs_are_valid_tunings(h, arch):
  sweep = sd.sweep_configs(h, 8, 2048, arch)
  assert next(iter(sweep.items())) == ("default", ())
  assert len(sweep) >= 3
  for label, tuning in sweep.items():
    cfg = sd._config(h, 8, 2048, arch, tuning)
    assert cfg.kernel != sd.default_config(h, 8, 2048, arch).kernel or label == "default", label
    assert cfg.num_splits * cfg.kernel.tiles_per_split * 64 >= 2048


def test_tuning_errors():
  with pytest.raises(ValueError, match="head_axis"):
    sd._config(8, 4, 2048, "sm90", (("head_axis", "m"),))       # a deleted switch: names the fields
  with pytest.raises(ValueError, match="k_buffers"):
    heads_m.TuningConfig(k_buffers=3)           # the 64-row Q and the f16 V tile leave no SMEM for a third
  with pytest.raises(ValueError, match="k_buffers"):
    heads_n.TuningConfig(k_buffers=5)
  with pytest.raises(ValueError, match="tiles_per_split"):
    heads_n.TuningConfig(tiles_per_split=0)
  with pytest.raises(ValueError, match="SMEM"):
    heads_m.TuningConfig(tiles_per_split=256)   # 64 KB of indices do not fit beside Q, K and V
  with pytest.raises(ValueError, match="out_heads"):
    heads_n.build(2, 64, 1, 12, 12, "bfloat16", heads_n.TuningConfig(), 0.1)
  # "twin" over fp8: + the amax row of the Q it quantizes
  assert heads_m.TuningConfig().smem_budget() == 200192 + 1024 and heads_n.TuningConfig().smem_budget() == 190976
  with pytest.raises(ValueError, match="schedule"):
    heads_m.TuningConfig(schedule="triple")
  # "producer_vt": + two 8 KB P slots and 1 KB of alpha / 1/l / amax rows (1 KB rounding), without the V tile
  # (the head rows: 2 alpha slots, kv_scale / l, amax, the rescale flags: 5 x 256 B, 2 KB rounded)
  assert heads_m.TuningConfig(schedule="producer_vt").smem_budget() == 200192 + 2 * 8192 + 2048 - 65536
  assert heads_m.TuningConfig(schedule="producer_vt", k_buffers=3).smem_budget() == 194048


def test_registers_fit_the_launch_allocation():
  """setmaxnreg can only hand out what the loader gives back from the launch allocation (65536 / 384 threads,
  rounded down to 8: 168 per thread); asking for more hangs the kernel on the GPU."""
  r0 = 65536 // 384 // 8 * 8
  assert common.LOADER_REGS + 2 * common.CONSUMER_REGS <= 3 * r0 and common.CONSUMER_REGS % 8 == 0
  # "producer_vt": 512 threads, 128 each at launch; loader + producer + two multipliers
  loader, producer, multiplier = heads_m.PRODUCER_REGS
  assert loader + producer + 2 * multiplier <= 4 * (65536 // 512) and all(r % 8 == 0 for r in heads_m.PRODUCER_REGS)


@pytest.mark.parametrize("tokens,tiles_per_token,topk,plan", [
    (128, 1, 2048, (1, 32)),    # P4: 128 CTAs fill one wave; doubling to 256 CTAs of 16 tiles (2 waves) was slower
    (64, 1, 2048, (2, 16)),     # P3: 128 CTAs of 16 tiles rather than 256 of 8
    (16, 2, 2048, (4, 8)),      # C0
    (4096, 2, 2048, (1, 32)),   # F1: 63 waves; more splits only shorten the last wave
    (296, 2, 16384, (8, 32)),   # P5: the fewest splits that keep a split <= 2048 keys
    (512, 1, 2048, (1, 32)),    # P2
])
def test_plan_minimises_waves(tokens, tiles_per_token, topk, plan):
  """The split plan counts waves x (tiles + the CTA's fixed cost) on 132 SMs, one CTA per SM."""
  assert sd._plan(tokens, tiles_per_token, topk, num_sms=132) == plan


def test_plan_min_split_by_design():
  """Heads on M splits down to 1-tile splits while those make at most 64 CTAs (B1 H128: 32 splits of 1), else 2
  (B2 H128: 16 of 2), heads on N down to 4 (B8 H8: 8 of 4)."""
  assert sd.default_config(128, 1, 2048).num_splits == 32 and sd.default_config(128, 1, 2048).kernel.tiles_per_split == 1
  assert sd.default_config(8, 8, 2048).num_splits == 8 and sd.default_config(8, 8, 2048).kernel.tiles_per_split == 4
  assert sd.default_config(128, 2, 2048).num_splits == 16 and sd.default_config(128, 2, 2048).kernel.tiles_per_split == 2
  assert sd.default_config(64, 1, 2048).kernel.tiles_per_split == 1      # 32 CTAs
  assert sd._plan(1, 2, 2048, min_split_tiles=sd.HEADS_M_MIN_SPLIT_TILES) == (16, 2)
  assert sd._plan(8, 2, 2048, min_split_tiles=sd.HEADS_M_MIN_SPLIT_TILES) == (8, 4)   # 256 CTAs: two waves


def test_plan_splits_small_batches():
  splits, tps = sd._plan(batch_tokens=1, tiles_per_token=1, topk=512)
  assert splits == 2 and tps == 4
  splits, tps = sd._plan(batch_tokens=256, tiles_per_token=2, topk=2048)
  assert splits == 1 and tps == 32
  splits, tps = sd._plan(batch_tokens=8, tiles_per_token=1, topk=8192)   # > 2048 keys: at least 4 splits
  assert splits * tps * 64 >= 8192 and tps <= 32


def test_combine_splits_matches_logsumexp(rng):
  o = rng.standard_normal((3, 4, 5, 512)).astype(np.float32)
  lse = rng.standard_normal((3, 4, 5)).astype(np.float32)
  lse[0, :, 0] = -np.inf                      # one empty split
  lse[1, :, 1] = -np.inf                      # a row empty in every split
  got_o, got_lse = sd.combine_splits(jnp.asarray(o), jnp.asarray(lse))
  m = np.max(lse, axis=1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0)
  w = np.exp(lse - m)
  tot = w.sum(1)
  want_o = np.einsum("bsr,bsrd->brd", w, o) / np.where(tot == 0, 1, tot)[..., None]
  with np.errstate(divide="ignore"):
    want_lse = np.log(tot) + m[:, 0]
  np.testing.assert_allclose(np.asarray(got_o), want_o, rtol=1e-5, atol=1e-6)   # f32 arithmetic
  np.testing.assert_array_equal(np.isfinite(got_lse), np.isfinite(want_lse))
  np.testing.assert_allclose(np.asarray(got_lse)[np.isfinite(want_lse)], want_lse[np.isfinite(want_lse)],
                             rtol=1e-5)
  assert np.all(np.asarray(got_o)[1, 1] == 0)


def test_prefill_is_decode_with_one_token(rng):
  case = make_case(rng, B=5, s_q=1, H=8, topk=11)
  out_d, lse_d = _run(case, "xla")
  out_p, lse_p = mla_pallas.sparse_mla_prefill(case.q[:, 0], case.kv.reshape(-1, 576), case.indices[:, 0],
                                               softmax_scale=case.softmax_scale, impl="xla")
  np.testing.assert_array_equal(np.asarray(out_p, np.float32), np.asarray(out_d, np.float32)[:, 0])
  np.testing.assert_array_equal(np.asarray(lse_p), np.asarray(lse_d)[:, 0])
  assert _dispatch.last_impl("sparse_mla_prefill") == "xla"


def test_jit_with_traced_kv_scale(rng):
  case = make_case(rng, B=1, s_q=1, H=8, topk=9, kv_scale=0.25)
  f = jax.jit(lambda q, kv, i, s: mla_pallas.sparse_mla_decode(q, kv, i, softmax_scale=case.softmax_scale,
                                                               kv_scale=s, impl="xla"))
  out, _ = f(case.q, case.kv, case.indices, jnp.float32(0.25))
  _check_against_reference(case, out, _ref(case)[1], _budget(case, fp8_mma=False))


@settings(max_examples=15, deadline=None)
@given(st.lists(st.integers(-3, 40), min_size=1, max_size=9), st.integers(0, 10))
def test_xla_masking_fuzz(idx_list, tl):
  """Any index pattern (valid, negative, past the end) and topk_length: same result as the reference."""
  rng = np.random.default_rng(len(idx_list) * 100 + tl)
  num_slots = 32
  rows = rng.standard_normal((num_slots, 576)).astype(np.float32)
  named = {i for i in idx_list if 0 <= i < num_slots}
  rows[[i for i in range(num_slots) if i not in named]] = np.nan
  kv = jnp.asarray(rows).astype(FP8)
  idx = jnp.asarray(np.array(idx_list, np.int32)[None, None])
  q = jnp.asarray(rng.standard_normal((1, 1, 8, 576)), jnp.bfloat16)
  tlen = jnp.asarray([tl], jnp.int32)
  out, lse = mla_pallas.sparse_mla_decode(q, kv, idx, softmax_scale=0.05, topk_length=tlen, impl="xla")
  ref_out, ref_lse = reference.sparse_mla_decode(q, kv, idx, softmax_scale=0.05, topk_length=tlen)
  # logit_std = 0.05 * 24 = 1.2: budget from the error model, no MMA term (CPU).
  testing.assert_close_fp8(out, ref_out, rel_l2=testing.fp8_error_budget(logit_std=1.2, fp8_mma=False))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(np.asarray(ref_lse)))


@pytest.mark.parametrize("H,s_q,topk,splits,k_buffers,schedule", [
    (64, 1, 2048, 1, 2, "twin"), (128, 2, 2048, 1, 2, "twin"), (32, 4, 2051, 2, 1, "twin"),      # heads on M
    (128, 2, 2048, 1, 2, "producer_vt"), (128, 2, 2048, 1, 3, "producer_vt"), (64, 1, 2051, 2, 2, "producer_vt"),
    (128, 1, 16384, 2, 2, "producer_vt"), (64, 1, 16384, 2, 2, "twin"),      # 128-tile splits (long top-k)
    (8, 4, 2051, 2, 4, None), (16, 1, 2048, 1, 4, None), (8, 4, 2048, 1, 3, None),               # heads on N
    (16, 1, 2048, 32, 4, None), (128, 1, 2048, 32, 2, "twin"),     # one-tile splits: fewer tiles than K buffers
])
def test_kernel_lowers_for_sm90(H, s_q, topk, splits, k_buffers, schedule):
  """Every Python-side Mosaic GPU pass (layouts, FP8 wgmma K-major rule, swizzles, TMA, the thread gather and
  the raw-PTX Vᵀ path, which only exist outside interpret mode) at sm_90a, with instruction counts."""
  n_tok = 2 * s_q
  tps = -(-topk // (64 * splits))
  S = jax.ShapeDtypeStruct
  idx = S((n_tok, splits * tps, 64), jnp.int32)
  kv = S((4096, 576), FP8)
  out_dtype = sd._partials_dtype(splits, bf16_cache=False, twin=schedule == "twin")     # the op's choice
  if H > sd.HEADS_ON_N_MAX:
    tiles_per_token = max(1, H // 64)
    cfg = heads_m.TuningConfig(tiles_per_split=tps, k_buffers=k_buffers, schedule=schedule)
    kern = heads_m.build(n_tok * tiles_per_token, 4096, splits, tiles_per_token, out_dtype, cfg, heads=H,
                         softmax_scale=576 ** -0.5)
    if cfg.q_in_kernel:     # bf16 q, quantized by the consumers ("twin") or the multipliers ("producer_vt")
      q_aval, qs_aval = S((n_tok * H, common.D_QK), jnp.bfloat16), None
    else:
      q_aval = S((n_tok * tiles_per_token, 64, common.Q_SW_COLS), FP8)
      qs_aval = S((n_tok * tiles_per_token, 64), jnp.float32)
  else:
    cfg = heads_n.TuningConfig(tiles_per_split=tps, k_buffers=k_buffers)
    kern = heads_n.build(n_tok, 4096, splits, -(-H // 8) * 8, H, out_dtype, cfg, 576 ** -0.5)
    q_aval, qs_aval = S((n_tok * H, common.D_QK), jnp.bfloat16), None    # bf16 q, quantized by WG0
  q_args = (q_aval,) if qs_aval is None else (q_aval, qs_aval)
  low = testing.lower_for_cuda(kern, *q_args, kv, idx, S((1,), jnp.float32), arch=(9, 0))
  # QKᵀ: 5 chunks of 128 = 4 k32 steps each, in one code path (both consumers, or consumer 0 only); the
  # "producer_vt" producer skips the two steps over Q's zero columns (heads_m._qk_fp8_18: 18)
  assert low.count(r"wgmma\.mma_async[^ ]*e4m3\.e4m3") == (heads_m.QK_STEPS if schedule == "producer_vt" else 20)
  assert heads_m.QK_STEPS == 18
  if H > sd.HEADS_ON_N_MAX:
    if schedule == "producer_vt":
      # 4 warpgroups: the loader and the producer give registers back, the two multipliers take them
      assert low.count(r"setmaxnreg\.dec\.sync\.aligned\.u32 24;") == 1
      assert low.count(r"setmaxnreg\.dec\.sync\.aligned\.u32 88;") == 1
      assert low.count(r"setmaxnreg\.inc\.sync\.aligned\.u32 200;") == 1    # one code path for both multipliers
      # the producer's P / alpha hand-off in raw Mosaic GPU (heads_m._store_p_alpha): P by 4 stmatrix, one
      # warpgroup barrier per tile (the kernel's 11 with the producer's Q fence; Pallas ref stores made it 15);
      # exp2 / log2 as the approximate ftz forms (approx_math: no math.exp2 left), the lse's log2 on two paths
      assert low.count(r"stmatrix") == 4
      assert low.count(r"bar\.sync \$0, 128;") == 11
      assert low.count(r"ex2\.approx\.ftz\.f32") > 0 and low.count(r"math\.exp2") == 0
      assert low.count(r"lg2\.approx\.ftz\.f32") == 2
    else:   # "twin": exact exp2 (not measured with approx_math)
      assert low.count(r"ex2\.approx") == 0 and low.count(r"math\.exp2") > 0
    if schedule == "producer_vt":
      # Oᵀ (one code path for both multipliers): 4 blocks x 4 k16 steps of m64n64k16 with Vᵀ from registers: 16
      # 64-bit loads (one per key: both row halves of its 4 blocks), one byte permute per register pair of two
      # blocks (32, all made first), 64 e4m3x2 -> f16x2 conversions (one block at a time: block i - 2 retired by
      # a wait_group 1 before block i is converted); O in 16-byte bf16 pieces (8 head groups x 2 heads, 8
      # consecutive latent columns each)
      assert low.count(r"m64n64k16\.f32\.f16\.f16") == 16
      assert low.count(r"ld\.shared\.v2\.b32") == 16
      assert low.count(r"ld\.shared\.b32 ") == 4        # the thread gather's 4 row-id loads
      assert low.count(r"prmt\.b32") == 32
      assert low.count(r"cvt\.rn\.f16x2\.e4m3x2") == 64
      assert low.count(r"wgmma\.wait_group\.sync\.aligned 1;") == 2
      assert low.count(r"\{alignment = 16 : i64\} : vector<8xbf16>") == 8 * 2
      # Q quantized by the multipliers (q_quant.quantize_head_rows, 24 rows each: 6 rows per warp, one code
      # path) and the producer (16 rows: 4 per warp): a 16-byte store of latent and one of the tail chunk per
      # row and lane
      assert low.count(r"st\.shared\.v4\.b32") == (6 + 4) * 2
    else:
      # P·V ("twin"): 4 k16 steps of m64n256k16 in the one code path both consumers share, P from registers
      assert low.count(r"wgmma\.mma_async[^ ]*f16\.f16") == 4
      assert low.count(r"prmt\.b32") == 0
  else:   # P·V: 8 blocks of Oᵀ x 4 k16 steps of m64n16k16; Vᵀ from the K tile: 32 64-bit loads, 64 byte permutes
    assert low.count(r"m64n16k32\.f32\.e4m3\.e4m3") == 20 and low.count(r"m64n16k16\.f32\.f16\.f16") == 32
    assert low.count(r"ld\.shared\.v2\.b32") == 32 and low.count(r"prmt\.b32") == 64
    # O: per 8 stored heads, 2 heads x 2 halves of 8 consecutive latent columns per thread, one vector store each
    assert low.count(r"\{alignment = 16 : i64\} : vector<8x") == 4 * (-(-H // 8) * 8) // 8
    # Q quantized by WG0 (q_quant.quantize_head_rows): 4 rows per warp, each a 16-byte store of latent and one
    # of the tail chunk, a 5-step butterfly for the row max, lane 0's store of it
    assert low.count(r"st\.shared\.v4\.b32") == 4 * 2 and low.count(r"st\.shared\.f32") == 4
    # (24 more butterflies are the softmax's reductions, as with the XLA pre-pass)
    assert low.count(r"shfl\.sync\.bfly|nvvm\.shfl\.sync\s+bfly") == 24 + 4 * 5
    assert low.count(r"cp\.async\.bulk\.tensor") == 1    # the indices only (Q and its scales: none)
  if H > sd.HEADS_ON_N_MAX:   # the indices only (Q is quantized in the kernel)
    assert low.count(r"cp\.async\.bulk\.tensor") == 1
  # K gather by the loader's threads: 4 passes x 5 chunks of 16-byte cp.async per thread and tile, one group per
  # tile; a wait leaving k_buffers - 2 tiles in flight in the loop and a final wait for all
  lag = max(k_buffers - 2, 0)
  assert low.count(r"cp\.async\.cg\.shared\.global \[") == gather_threads.CP_ASYNC_PER_THREAD == 20
  assert low.count(r"cp\.async\.commit_group") == 1
  assert low.count(fr"cp\.async\.wait_group {lag};") == 1 + (lag == 0)
  assert low.count(r"cp\.async\.wait_group 0;") == 1 + (lag == 0)


@pytest.mark.parametrize("B,H,s_q,topk,tl,races", [
    (2, 32, 2, 77, False, False), (2, 64, 1, 200, True, True),
    pytest.param(1, 128, 2, 130, False, False, marks=pytest.mark.slow)])
def test_bf16_cache_kernel_interpret(rng, B, H, s_q, topk, tl, races):
  """The heads-on-M kernel over a bfloat16 cache (BF16 attention: bf16 wgmmas, P in bf16, V read from the K tile)
  against the reference within testing.BF16_ATTENTION_REL_L2 (races checked with the splits of H 64): NaN in
  unused rows, invalid and
  out-of-range ids, a duplicate, an all-invalid row, a partial last tile, topk_length, and several splits
  (topk 200: 4 tiles -> the plan splits); bitwise deterministic. H 128 (two query tiles per token, one sequence
  of 2 tokens) is marked slow: 133 s of the CPU suite, the kernel of H 64 with the query-tile arithmetic of the
  fp8 H 128 cases (test_kernel_tuning_interpret, test_heads_m_twin_quantizes_q)."""
  case = make_case(rng, B=B, s_q=s_q, H=H, topk=topk, page_size=16, num_pages=64, kv_scale=0.5,
                   with_topk_length=tl)
  case = dataclasses.replace(case, kv=case.kv.astype(jnp.bfloat16))
  testing.reset_interpreter()
  out, lse = _run(case, "mosaic", interpret=RACES if races else True)
  assert not testing.races_found()
  ref_out, ref_lse = _ref(case)
  testing.assert_close_fp8(out, ref_out, rel_l2=BF16_ATTN_BUDGET, min_cos=0.9999, what="bf16 kernel out")
  testing.assert_close_fp8(lse, ref_lse, rel_l2=None, max_abs=1e-4, what="bf16 kernel lse")
  assert np.all(np.asarray(out, np.float32)[~np.isfinite(np.asarray(ref_lse))] == 0.0)
  again, _ = _run(case, "mosaic", interpret=True)
  assert np.array_equal(np.asarray(again).view(np.uint16), np.asarray(out).view(np.uint16))


@pytest.mark.parametrize("b,s_q,h,topk,splits", [(128, 2, 128, 2048, 2), (8, 2, 64, 2051, 7), (4, 1, 32, 500, 2)])
def test_bf16_cache_kernel_lowers_for_sm90(b, s_q, h, topk, splits, monkeypatch):
  """The bf16-cache "twin" at sm_90a (the default where "producer_vt" over bf16 is not validated): QKᵀ as nine
  bf16 m64n64k16 x 4 wgmmas per tile, P·V as 4 blocks x 4, all in the one code path both consumers share; the
  loader's 4 x 9 16-byte cp.async per thread (1152-byte rows); splits of at most BF16_MAX_SPLIT_TILES tiles
  (SMEM: bf16 Q and two K tiles)."""
  monkeypatch.setattr(sd, "BF16_PRODUCER_VALIDATED_ON", ())
  jax.clear_caches()    # the op's jitted entry was perhaps traced under the shipped plan
  S = jax.ShapeDtypeStruct
  cfg = sd._config(h, b * s_q, topk, "sm90", (), "bfloat16")
  assert cfg.num_splits == splits and cfg.kernel.tiles_per_split <= sd.BF16_MAX_SPLIT_TILES
  assert cfg.kernel.schedule == "twin" and cfg.kernel.bf16
  fn = functools.partial(sd._sparse_decode_jit, softmax_scale=0.1, impl="mosaic", interpret=False, arch="sm90")
  low = testing.lower_for_cuda(lambda q, kv, i, sc: fn(q, kv, i, sc, None), S((b, s_q, h, 576), jnp.bfloat16),
                               S((4096 * 8, 576), jnp.bfloat16), S((b, s_q, topk), jnp.int32), S((), jnp.float32))
  assert len(low.mosaic) == 1                                   # no pre-pass kernel: q goes in as it is
  kernel = low.mosaic[0]
  assert low.count(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16") == 9 * 4 + 4 * 4
  assert low.count(r"e4m3") == 0
  assert kernel.count("cp.async.cg.shared.global") == 4 * 9


BF16_PRODUCER = (("schedule", "producer_vt"),)
SEESAW = (("schedule", "seesaw"),)


@pytest.mark.parametrize("B,H,s_q,topk,tl,tuning,races", [
    (2, 64, 1, 200, True, BF16_PRODUCER, True),                                   # the plan's splits, races checked
    (2, 32, 2, 77, False, BF16_PRODUCER + (("k_buffers", 1), ("tiles_per_split", 2)), False),   # rows 32-63 padding
    pytest.param(1, 128, 2, 130, False, BF16_PRODUCER + (("tiles_per_split", 1),), False, marks=pytest.mark.slow),
    (1, 32, 1, 150, True, SEESAW + (("tiles_per_split", 16),), True),       # 3 tiles: consumer 0 takes the last
    (2, 32, 2, 77, False, SEESAW + (("tiles_per_split", 1),), False),       # 1-tile splits: consumer 1 owns none
    (1, 64, 1, 200, False, SEESAW + (("tiles_per_split", 2),), False),      # 2-tile splits, several of them
])
def test_bf16_cache_schedules_interpret(rng, B, H, s_q, topk, tl, tuning, races):
  """The schedules that hand P between warpgroups over a bfloat16 cache against the reference within
  testing.BF16_ATTENTION_REL_L2, race-checked where marked: "producer_vt" (the producer's bf16 QKᵀ and softmax, P
  written into the K buffer's rope chunk, the multipliers' P·V from SMEM; several splits, one K buffer (the
  producer's P then waits for the multipliers of the tile before), two query tiles per token (H 128, slow)) and
  "seesaw" (consumer t % 2 computes tile t's S and softmax from the other's (m, l) and hands P, alpha, m, l over;
  odd and even tile counts per split (the last tile owned by either consumer), splits where consumer 1 owns no
  tile). NaN in unused rows, invalid and out-of-range ids, a duplicate, an all-invalid row, partial last tiles,
  topk_length; bitwise deterministic."""
  case = make_case(rng, B=B, s_q=s_q, H=H, topk=topk, page_size=16, num_pages=64, kv_scale=0.5,
                   with_topk_length=tl)
  case = dataclasses.replace(case, kv=case.kv.astype(jnp.bfloat16))
  testing.reset_interpreter()
  out, lse = run_kernel(case, interpret=RACES if races else True, tuning=tuning)
  assert not testing.races_found()
  ref_out, ref_lse = _ref(case)
  testing.assert_close_fp8(out, ref_out, rel_l2=BF16_ATTN_BUDGET, min_cos=0.9999, what=f"bf16 {tuning[0][1]} out")
  testing.assert_close_fp8(lse, ref_lse, rel_l2=None, max_abs=1e-4, what=f"bf16 {tuning[0][1]} lse")
  assert np.all(np.asarray(out, np.float32)[~np.isfinite(np.asarray(ref_lse))] == 0.0)
  again, _ = run_kernel(case, interpret=True, tuning=tuning)
  assert np.array_equal(np.asarray(again).view(np.uint16), np.asarray(out).view(np.uint16))


def test_bf16_cache_seesaw_lowers_for_sm90():
  """"seesaw" at P1's shape in one 32-tile split (no lse buffer, no reduction scratch: it fits): per own tile nine bf16 m64n64k16 x 4 wgmmas of QKᵀ, P by stmatrix,
  and per tile taken one m64n64k16 x 4 group per 64-column chunk of the consumer's half of V; consumer 0's first
  tile peeled (no tile before it) and its tail the other's last tile (16 tiles: 52 + 68 + 16 wgmmas in consumer
  0's code, 68 in consumer 1's, the counts of any even split length), no m64n256k16, no fp8; SMEM within the
  limit. The config's rules: bf16 only, two K buffers."""
  S = jax.ShapeDtypeStruct
  tuning = SEESAW + (("tiles_per_split", 32),)
  cfg = sd._config(128, 256, 2048, "sm90", tuning, "bfloat16")
  assert cfg.num_splits == 1 and cfg.kernel.seesaw and not cfg.kernel.p_slots(True)
  assert cfg.kernel.reduction_scratch == 0
  assert cfg.kernel.smem_budget() <= common.SMEM_LIMIT
  fn = jax.jit(lambda q, kv, i, sc: sd._mosaic_sparse_decode(q, kv, i, 0.1, sc, None, False, tuning, "sm90"))
  low = testing.lower_for_cuda(fn, S((128, 2, 128, 576), jnp.bfloat16), S((4096 * 8, 576), jnp.bfloat16),
                               S((128, 2, 2048), jnp.int32), S((), jnp.float32))
  assert len(low.mosaic) == 1
  assert low.count(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16") == (52 + 68 + 16) + 68
  assert low.count(r"m64n256k16") == 0 and low.count(r"e4m3") == 0
  assert low.count(r"stmatrix") == 3 * 4
  assert low.count(r"cp\.async\.cg\.shared\.global \[") == 4 * 9
  with pytest.raises(ValueError, match="seesaw"):
    sd._config(128, 256, 2048, "sm90", SEESAW, "float8_e4m3fn")
  with pytest.raises(ValueError, match="seesaw"):
    sd._config(128, 256, 2048, "sm90", SEESAW + (("k_buffers", 1), ("tiles_per_split", 16)), "bfloat16")
  sweep = sd.sweep_configs(128, 256, 2048, "sm90", "bfloat16")    # at the default plan's 32-tile split
  assert sd._config(128, 256, 2048, "sm90", sweep["schedule=seesaw"], "bfloat16") == cfg


def test_bf16_cache_producer_lowers_for_sm90():
  """"producer_vt" over a bf16 cache at P1's shape in 2 splits of 16 tiles: the producer's QKᵀ as nine bf16
  m64n64k16 x 4 wgmmas, the multipliers' P·V as one m64n64k16 x 4 group per 64-column chunk of V (one traced code
  path; no m64n256k16: ptxas compiles a 512-thread kernel within 128 registers per thread), P stored by stmatrix,
  no fp8; the loader's 4 x 9 cp.async per thread, the TMAs of Q's nine chunks and the indices; SMEM
  within the limit (no P slots: P sits in the K buffer)."""
  S = jax.ShapeDtypeStruct
  tuning = BF16_PRODUCER + (("tiles_per_split", 16),)
  cfg = sd._config(128, 256, 2048, "sm90", tuning, "bfloat16")
  assert cfg.num_splits == 2 and cfg.kernel.producer and cfg.kernel.bf16 and not cfg.kernel.p_slots()
  assert cfg.kernel.smem_budget() <= common.SMEM_LIMIT
  fn = jax.jit(lambda q, kv, i, sc: sd._mosaic_sparse_decode(q, kv, i, 0.1, sc, None, False, tuning, "sm90"))
  low = testing.lower_for_cuda(fn, S((128, 2, 128, 576), jnp.bfloat16), S((4096 * 8, 576), jnp.bfloat16),
                               S((128, 2, 2048), jnp.int32), S((), jnp.float32))
  assert len(low.mosaic) == 1
  assert low.count(r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16") == 9 * 4 + 4 * 4
  assert low.count(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16") == 0
  assert low.count(r"e4m3") == 0
  assert low.count(r"cp\.async\.cg\.shared\.global \[") == 4 * 9
  assert low.count(r"stmatrix") == 4
  assert low.count(r"cp\.async\.bulk\.tensor") == 9 + 1
  # F1's shape (T 4096, top-k 2048) in one 32-tile split: 8 KB of indices fit without Mosaic's reduction scratch
  f1 = BF16_PRODUCER + (("tiles_per_split", sd.BF16_PRODUCER_MAX_SPLIT_TILES),)
  cfg = sd._config(128, 4096, 2048, "sm90", f1, "bfloat16")
  assert cfg.num_splits == 1 and cfg.kernel.reduction_scratch == 0
  fn = jax.jit(lambda q, kv, i, sc: sd._mosaic_sparse_decode(q, kv, i, 0.1, sc, None, False, f1, "sm90"))
  low = testing.lower_for_cuda(fn, S((4096, 1, 128, 576), jnp.bfloat16), S((8192, 576), jnp.bfloat16),
                               S((4096, 1, 2048), jnp.int32), S((), jnp.float32))
  smem = int(re.search(r"dynamic_shared_memory_size %c(\d+)_i32", low.mosaic[0]).group(1))
  assert smem <= common.SMEM_LIMIT and smem <= cfg.kernel.smem_budget(), smem


def test_bf16_cache_configs():
  """A bfloat16 cache: heads on M at every H ("twin", splits <= BF16_MAX_SPLIT_TILES; the fp8 cache keeps heads on
  N at H <= 16); validated on sm_90 at every kernel head count (its GPU tests passed on the H200 at H 8-128,
  2026-12-02), so auto picks it there (validated_on). "producer_vt" over bf16 (splits up to
  BF16_PRODUCER_MAX_SPLIT_TILES): the default where BF16_PRODUCER_VALIDATED_ON names the family (sm_90, where it
  passed its GPU tests and beat "twin"), a sweep candidate elsewhere."""
  assert sd.BF16_PRODUCER_VALIDATED_ON == ("sm90",)
  twin_default = unittest.mock.patch.object(sd, "BF16_PRODUCER_VALIDATED_ON", ())
  assert sd.default_config(16, 8, 2048, "sm90", "bfloat16").design == "sm90_heads_m"
  assert sd.default_config(16, 8, 2048, "sm90").design == "sm90_heads_n"
  with pytest.raises(NotImplementedError, match="bfloat16-cache kernel"):
    sd.default_config(128, 8, 2048, "sm100", "bfloat16")
  assert sd._config(128, 256, 2048, "sm90", (("schedule", "producer_vt"),), "bfloat16").kernel.producer
  with pytest.raises(ValueError, match="k_buffers <= 2"):     # P and alpha slots tied to the K buffers
    sd._config(128, 256, 2048, "sm90", (("schedule", "producer_vt"), ("k_buffers", 3)), "bfloat16")
  with twin_default, pytest.raises(ValueError, match="SMEM"):
    sd._config(128, 256, 2048, "sm90", (("tiles_per_split", 32),), "bfloat16")
  # "producer_vt" over bf16: 32-tile splits fit (no P slots, no reduction scratch), 64 do not
  assert sd._config(128, 256, 2048, "sm90", (("schedule", "producer_vt"), ("tiles_per_split", 32)), "bfloat16")
  with pytest.raises(ValueError, match="SMEM"):
    sd._config(128, 256, 4096, "sm90", (("schedule", "producer_vt"), ("tiles_per_split", 64)), "bfloat16")
  assert sd.validated_on(jnp.bfloat16) == ("sm90",) and sd.validated_on(FP8) == ("sm90",)
  assert all(sd.validated_on(jnp.bfloat16, h) == ("sm90",) for h in sd.KERNEL_HEADS)
  assert sd.validated_on(jnp.bfloat16, 3) == () and sd.validated_on(FP8, 16) == ("sm90",)
  # "producer_vt" over bf16 is a sweep candidate where it is not validated on hardware, and the default where it is
  with twin_default:
    sweep = sd.sweep_configs(128, 256, 2048, "sm90", "bfloat16")
    assert ("schedule=producer_vt" in sweep) and not any(dict(t).get("k_buffers") == 3 for t in sweep.values())
    assert sd.default_config(128, 256, 2048, "sm90", "bfloat16").kernel.schedule == "twin"
    assert "schedule=producer_vt, tiles_per_split=32" in sd.sweep_configs(128, 4096, 2048, "sm90", "bfloat16")
  assert f"schedule=twin, tiles_per_split={sd.BF16_MAX_SPLIT_TILES}" in sd.sweep_configs(128, 256, 2048, "sm90",
                                                                                      "bfloat16")
  assert sd.PRODUCER_MIN_TILES <= sd.BF16_MAX_SPLIT_TILES   # a split too long for "twin" gets "producer_vt"
  with unittest.mock.patch.object(sd, "BF16_PRODUCER_VALIDATED_ON", ("sm90",)):
    assert sd.default_config(128, 256, 2048, "sm90", "bfloat16").kernel.schedule == "producer_vt"
    assert sd.default_config(128, 1, 256, "sm90", "bfloat16").kernel.schedule == "twin"    # 1-4-tile splits
    f1 = sd.default_config(128, 4096, 2048, "sm90", "bfloat16")    # F1: one split of 32 tiles, no merge
    assert f1.num_splits == 1 and f1.kernel.tiles_per_split == 32 and f1.kernel.producer


def test_argument_errors(rng):
  case = make_case(rng, B=1, s_q=1, H=8, topk=4)
  kw = dict(softmax_scale=0.1, impl="xla")
  with pytest.raises(ValueError, match=r"q must have shape \[B, s_q, H, 576\]"):
    mla_pallas.sparse_mla_decode(case.q[..., :512], case.kv, case.indices, **kw)
  with pytest.raises(ValueError, match="q must have dtype"):
    mla_pallas.sparse_mla_decode(case.q.astype(jnp.float16), case.kv, case.indices, **kw)
  with pytest.raises(ValueError, match="kv_cache must have dtype float8_e4m3fn"):   # or bfloat16; not float16
    mla_pallas.sparse_mla_decode(case.q, case.kv.astype(jnp.float16), case.indices, **kw)
  with pytest.raises(ValueError, match=r"indices must have rank 3 with shape \[B=1, s_q=1, topk\]"):
    mla_pallas.sparse_mla_decode(case.q, case.kv, case.indices[0], **kw)
  with pytest.raises(ValueError, match="indices must have dtype int32"):
    mla_pallas.sparse_mla_decode(case.q, case.kv, case.indices.astype(jnp.float32), **kw)
  with pytest.raises(ValueError, match="topk_length"):
    mla_pallas.sparse_mla_decode(case.q, case.kv, case.indices, topk_length=jnp.zeros((3,), jnp.int32), **kw)
  with pytest.raises(ValueError, match="softmax_scale"):
    mla_pallas.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=-1.0, impl="xla")
  with pytest.raises(ValueError, match="impl"):
    mla_pallas.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=0.1, impl="cuda")


def test_impl_choice_on_cpu(rng):
  case = make_case(rng, B=1, s_q=1, H=8, topk=4)
  if jax.default_backend() == "gpu":
    pytest.skip("CPU-only behaviour")
  with pytest.raises(NotImplementedError, match="compute capability"):
    _run(case, "mosaic")
  _run(case, "auto")
  assert _dispatch.last_impl("sparse_mla_decode") == "xla"
  case12 = make_case(rng, B=1, s_q=1, H=12, topk=4)          # H=12: no kernel
  with pytest.raises(NotImplementedError, match="H="):
    _run(case12, "mosaic", interpret=True)
  _run(case12, "auto", interpret=True)
  assert _dispatch.last_impl("sparse_mla_decode") == "xla"


def test_producer_interpret_needs_pool_threads(monkeypatch):
  """Interpret mode of the 4-warpgroup "producer_vt" with fewer XLA CPU pool threads than warpgroups raises
  (naming PJRT_NPROC) instead of risking a deadlock; "twin" (3 warpgroups) is not refused."""
  monkeypatch.setenv("PJRT_NPROC", "2")
  heads_m.build.cache_clear()
  q_in = dict(heads=64, softmax_scale=0.1)      # both schedules quantize q in the kernel
  with pytest.raises(RuntimeError, match="PJRT_NPROC=8"):
    heads_m.build(2, 64, 1, 1, "bfloat16", heads_m.TuningConfig(schedule="producer_vt"), interpret=True, **q_in)
  heads_m.build(2, 64, 1, 1, "bfloat16", heads_m.TuningConfig(), interpret=True, **q_in)
  heads_m.build(2, 64, 1, 1, "bfloat16", heads_m.TuningConfig(schedule="producer_vt"), interpret=False, **q_in)
  heads_m.build.cache_clear()
