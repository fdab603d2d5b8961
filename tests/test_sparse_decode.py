"""sparse_mla_decode / sparse_mla_prefill on the CPU: the XLA path, the sm_90 kernel in interpret mode (with race
detection), lowering of the kernel for CUDA at sm_90, argument checks and implementation choice.

Tolerances come from the FP8 error model of :func:`mla_pallas.testing.fp8_error_budget`: both implementations
round Q (per row) and P to e4m3 (unit roundoff 2^-4), the reference does not; the cache is fp8 for both.
"""
from __future__ import annotations

import functools
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import mla_pallas
from mla_pallas import _dispatch, reference, testing
from mla_pallas.kernels import sparse_decode_sm90 as sm90
from mla_pallas.ops import sparse_decode as sd

from _sparse_inputs import FP8, logit_std, make_case


def _budget(case, fp8_mma, quantized_p=True):
  # Q rounded to e4m3 in both implementations, P in the XLA path and the kernel's pv_dtype="fp8" design (the
  # default kernel keeps P in f16: quantized_p=False); fp8_mma=False in interpret mode (exact f32 products) and
  # for XLA on the CPU (fp8 operands are upcast).
  return testing.fp8_error_budget(logit_std=logit_std(case), pv_length=case.indices.shape[-1],
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


@pytest.mark.parametrize("B,s_q,H,topk,page,tl", [
    (1, 2, 16, 77, 16, False),      # H < 64: rows padded to the 64-row tile; odd top-k
    (2, 1, 64, 130, 64, True),      # topk_length; 3 tiles
    (1, 1, 128, 64, 16, False),     # H = 128: two query tiles per token
    (1, 1, 32, 512, 16, False),     # few CTAs: split-KV (2 splits) + combine
])
def test_kernel_interpret_matches_reference(rng, B, s_q, H, topk, page, tl):
  case = make_case(rng, B=B, s_q=s_q, H=H, topk=topk, page_size=page, num_pages=max(4, 1024 // page),
                   with_topk_length=tl)
  params = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=True)
  out, lse = _run(case, "mosaic", interpret=params)
  assert _dispatch.last_impl("sparse_mla_decode") == "mosaic-interpret"
  assert not testing.races_found(), "the interpreter found a data race in the kernel"
  _check_against_reference(case, out, lse, _budget(case, fp8_mma=False, quantized_p=False))
  # Same quantization of Q as the XLA path; the XLA path also rounds P to e4m3, the default kernel keeps P in
  # f16: the two differ by the P term of the error model (plus both bf16 output roundings).
  xla_out, _ = _run(case, "xla")
  testing.assert_close_fp8(out, xla_out, what="kernel vs XLA path", rel_l2=testing.fp8_error_budget(
      quantized_q=False, quantized_p=True, fp8_mma=False, pv_length=topk))


LINEAR = (("k_gather", "linear"),)   # per-row 640-byte TMA into a linear slot + K re-swizzle (default until v5)
FP8_PV = LINEAR + (("pv_dtype", "fp8"), ("stages", 2), ("k_buffers", 1))   # the FP8 P.V design (default until v4)


def _run_kernel(case, tuning, interpret):
  """The op's jitted Mosaic path on a make_case case with kernel TuningConfig overrides ``tuning``."""
  return sd._sparse_decode_jit(case.q, case.kv.reshape(-1, 576), case.indices, jnp.float32(case.kv_scale), None,
                               softmax_scale=case.softmax_scale, impl="mosaic", interpret=interpret, tuning=tuning)


@pytest.mark.parametrize("tuning", [
    FP8_PV,
    LINEAR + (("pv_dtype", "fp8"), ("stages", 1), ("k_buffers", 2)),
    FP8_PV + (("k_stager", "consumers"),),
    FP8_PV + (("v_stager", "loader"),),
    LINEAR + (("k_buffers", 1), ("stages", 1)),
    LINEAR,                                # v4: f16 P.V, double-buffered K, one linear slot
    (("k_buffers", 1),),                   # swizzled gather, one K buffer
])
def test_kernel_variants_interpret(rng, tuning):
  """Every non-default warpgroup arrangement of the kernel computes the same function (races checked)."""
  case = make_case(rng, B=2, s_q=1, H=32, topk=200, page_size=16, num_pages=64)
  params = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=True)
  out, lse = _run_kernel(case, tuning, params)
  assert not testing.races_found()
  # pv_dtype="f16" keeps P in f16 (rounding 2^-11): no P term in the error model.
  cfg = sm90.TuningConfig(**dict(tuning))
  budget = testing.fp8_error_budget(logit_std=logit_std(case), pv_length=200, fp8_mma=False,
                                    quantized_p=cfg.pv_dtype == "fp8")
  _check_against_reference(case, out, lse, budget)


@pytest.mark.parametrize("B,s_q,H,topk,page", [
    (1, 2, 8, 77, 16),      # H = 8 padded to the 16 MMA columns; odd top-k (a partial tile)
    (2, 1, 16, 130, 64),    # H = 16: every column a head; 3 tiles
    (1, 1, 16, 512, 16),    # few CTAs: split-KV + combine on the transposed output
    (1, 1, 32, 100, 16),    # H = 32: heads_n = 32 (64-byte rows of Pᵀ and V)
])
def test_heads_on_n_interpret(rng, B, s_q, H, topk, page):
  """head_axis="n" (heads on the MMA's N side, Sᵀ = K·Qᵀ and Oᵀ = Vᵀ·Pᵀ) computes the same function (races
  checked); against the default arrangement the only difference is the f32 summation order."""
  case = make_case(rng, B=B, s_q=s_q, H=H, topk=topk, page_size=page, num_pages=max(4, 1024 // page))
  params = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=True)
  run = functools.partial(_run_kernel, case)
  out, lse = run((("head_axis", "n"),), params)
  assert not testing.races_found()
  budget = testing.fp8_error_budget(logit_std=logit_std(case), pv_length=topk, fp8_mma=False, quantized_p=False)
  _check_against_reference(case, out, lse, budget)
  base, base_lse = run((("head_axis", "m"),), True)
  # Same Q quantization and P precision: the two arrangements differ only in f32 summation order, which can flip
  # the bf16 rounding of an output: at most one bf16 ulp (2^-8 relative) per value.
  testing.assert_close_fp8(out, base, what="head_axis n vs m", rel_l2=2.0 ** -8)
  fin = np.isfinite(np.asarray(base_lse))
  assert np.array_equal(np.isfinite(np.asarray(lse)), fin)
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(base_lse)[fin], atol=1e-4)


@pytest.mark.parametrize("tuning", [
    (("consumers", 4), ("k_buffers", 2)),
    (("consumers", 5), ("k_buffers", 3)),
    (("k_buffers", 3),),
    (("v_owners", ((), (0, 1, 2, 3))), ("l_partial", True)),   # consumer 0: QKᵀ + softmax only; lazy sums
])
def test_heads_on_n_consumers_interpret(rng, tuning):
  """head_axis="n" with the V upcast spread over 4 or 5 consumer warpgroups (V_CHUNK_OWNERS, or v_owners) and/or
  a third K buffer: the same wgmmas on the same operands per block of d, so equal to the head_axis="m" result
  within one bf16 ulp (l_partial only reorders the f32 sum of p); races checked (P / alpha hand-off through the
  p_full / p_empty buffers)."""
  case = make_case(rng, B=1, s_q=2, H=8, topk=77, page_size=16, num_pages=64)
  params = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=True)
  run = functools.partial(_run_kernel, case)
  testing.reset_interpreter()
  out, lse = run(tuning, params)
  assert not testing.races_found()
  base, base_lse = run((("head_axis", "m"),), True)
  testing.assert_close_fp8(out, base, what=f"{tuning} vs head_axis m", rel_l2=2.0 ** -8)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(base_lse), atol=1e-4)


@pytest.mark.parametrize("consumers", sorted(sm90.V_CHUNK_OWNERS))
def test_consumer_registers_fit_the_launch_allocation(consumers):
  """setmaxnreg can only hand out what the loader gives back from the launch allocation (65536 / threads per
  thread, a multiple of 8); asking for more hangs the kernel on the GPU."""
  cfg = sm90.TuningConfig(head_axis="n", consumers=consumers)
  threads = 128 * (consumers + 1)
  r0 = 65536 // threads // 8 * 8
  regs = sm90._consumer_regs(cfg)
  assert regs % 8 == 0 and regs >= r0 and sm90.LOADER_REGS + consumers * regs <= r0 * (consumers + 1)
  assert sm90._consumer_regs(sm90.TuningConfig()) == sm90.CONSUMER_REGS == 224


def test_default_tuning_puts_few_heads_on_n():
  """sm_90: H <= HEADS_ON_N_MAX -> head_axis="n", consumer 1 owning all of V with Vᵀ in registers and 4 K buffers
  (3 when v_regs is turned off), lazy softmax sums; explicit choices and other H / arches kept."""
  v8 = {"v_owners": ((), (0, 1, 2, 3)), "v_regs": True, "l_partial": True, "v_overlap": True}
  assert sd._default_tuning("sm90", 8) == {"head_axis": "n", "k_buffers": 4, **v8}
  assert sd._default_tuning("sm90", 16, (("k_buffers", 2),)) == {"head_axis": "n", "k_buffers": 2, **v8}
  assert sd._default_tuning("sm90", 8, (("v_regs", False),)) == {"head_axis": "n", "k_buffers": 3,
                                                                  **v8, "v_regs": False}
  assert sd._default_tuning("sm90", 16, (("consumers", 4),)) == {"head_axis": "n", "k_buffers": 3, "consumers": 4,
                                                                  "l_partial": True, "v_overlap": True}
  assert sd._default_tuning("sm90", 8, (("head_axis", "m"),)) == {"head_axis": "m"}
  assert sd._default_tuning("sm90", 8, (("k_gather", "linear"),)) == {"k_gather": "linear"}
  assert sd._default_tuning("sm90", 32) == {} and sd._default_tuning("sm90", 128) == {}
  assert sd._default_tuning("sm100", 8) == {}


def test_persistent_interpret(rng, monkeypatch):
  """TuningConfig.persistent: with 2 "SMs", 3 items (query tokens) on 2 CTAs, the first working through two items
  in one pipeline (next item's Q and index halves prefetched, K / P buffers rotating across items). Races checked;
  per item the same operations in the same order as one CTA per item, so bitwise equal to persistent=False."""
  monkeypatch.setattr(sd, "_num_sms", lambda: 2)
  case = make_case(rng, B=1, s_q=3, H=8, topk=500, page_size=16, num_pages=64)   # 8 tiles, the last partial
  testing.reset_interpreter()
  params = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=True)
  out, lse = _run_kernel(case, (("persistent", True),), params)
  assert not testing.races_found()
  base, base_lse = _run_kernel(case, (("persistent", False),), True)
  assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(base).view(np.uint16))
  assert np.array_equal(np.asarray(lse), np.asarray(base_lse), equal_nan=True)
  budget = testing.fp8_error_budget(logit_std=logit_std(case), pv_length=500, fp8_mma=False, quantized_p=False)
  _check_against_reference(case, out, lse, budget)


def test_heads_on_n_rejects_many_heads(rng):
  def run(h, tuning):
    case = make_case(rng, B=1, s_q=1, H=h, topk=64, page_size=16, num_pages=8)
    sd._sparse_decode_jit(case.q, case.kv.reshape(-1, 576), case.indices, jnp.float32(1.0), None,
                          softmax_scale=case.softmax_scale, impl="mosaic", interpret=True, tuning=tuning)
  with pytest.raises(ValueError, match="head_axis"):
    run(64, (("head_axis", "n"),))
  with pytest.raises(ValueError, match="heads_n"):
    run(32, (("head_axis", "n"), ("heads_n", 16)))
  with pytest.raises(ValueError, match="heads_n"):
    sm90.TuningConfig(head_axis="n", heads_n=8)
  with pytest.raises(ValueError, match="consumers"):
    sm90.TuningConfig(consumers=4)                   # head_axis="m" has exactly 2 consumers
  with pytest.raises(ValueError, match="consumers"):
    sm90.TuningConfig(head_axis="n", consumers=3)
  with pytest.raises(ValueError, match="k_buffers"):
    sm90.TuningConfig(k_buffers=3)


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


@pytest.mark.parametrize("H,s_q,topk,splits,pv_dtype", [
    (64, 1, 2048, 1, "f16"), (8, 4, 2051, 1, "f16"), (128, 2, 256, 2, "f16"), (64, 2, 1024, 1, "fp8"),
    (128, 2, 2048, 1, "swizzled"), (8, 4, 2051, 2, "swizzled"), (8, 4, 2051, 1, "heads_n"),
    (16, 1, 2048, 2, "heads_n"), (32, 2, 2048, 1, "heads_n"), (8, 4, 2048, 1, "heads_n_c4"),
    (16, 1, 2048, 1, "heads_n_c5"), (8, 4, 2048, 1, "heads_n_v1"), (8, 4, 2051, 1, "heads_n_persistent"),
    (8, 4, 2051, 2, "heads_n_vregs"), (32, 1, 2048, 1, "heads_n_vregs")])
def test_kernel_lowers_for_sm90(H, s_q, topk, splits, pv_dtype):
  """Every Python-side Mosaic GPU pass (layouts, FP8 wgmma K-major rule, swizzles, TMA) at sm_90a.
  "swizzled": k_gather="swizzled" (f16 P.V), whose RefUnion row view only exists outside interpret mode."""
  tiles_per_token = max(1, H // 64)
  n_tok = 2 * s_q
  tps = -(-topk // (64 * splits))
  extra = {"fp8": dict(pv_dtype="fp8", stages=2, k_buffers=1, k_gather="linear"), "f16": dict(k_gather="linear"),
           "swizzled": {}, "heads_n": dict(head_axis="n", heads_n=16 if H <= 16 else 32),
           "heads_n_c4": dict(head_axis="n", consumers=4),                  # 4 consumers: one V chunk each
           "heads_n_c5": dict(head_axis="n", consumers=5, k_buffers=3),     # + a softmax-only consumer 0
           "heads_n_v1": dict(head_axis="n", k_buffers=3, v_owners=((), (0, 1, 2, 3)), l_partial=True),
           "heads_n_persistent": dict(head_axis="n", k_buffers=3, v_owners=((), (0, 1, 2, 3)), l_partial=True,
                                      v_overlap=True, persistent=True),
           "heads_n_vregs": dict(head_axis="n", k_buffers=4, v_owners=((), (0, 1, 2, 3)), l_partial=True,
                                 v_regs=True)}
  heads_n = pv_dtype.startswith("heads_n")
  cfg = sm90.TuningConfig(tiles_per_split=tps, **extra.get(pv_dtype, {}))
  kern = sm90.build(n_tok * tiles_per_token, n_tok, 4096, splits, tiles_per_token,
                    "bfloat16" if splits == 1 else "float32", cfg)
  S = jax.ShapeDtypeStruct
  swz = pv_dtype == "swizzled" or heads_n
  q_cols, kv_shape = (sm90.Q_SW_COLS, (4096, 576)) if swz else (576, (4096 * 9, 64))
  q_aval, qs_aval = S((n_tok * tiles_per_token, 64, q_cols), FP8), S((n_tok * tiles_per_token, 64), jnp.float32)
  if heads_n:     # flat Q rows and scales, q_stride = heads_n rows per token
    q_aval, qs_aval = S((n_tok * cfg.heads_n, q_cols), FP8), S((n_tok * cfg.heads_n,), jnp.float32)
  low = testing.lower_for_cuda(kern, q_aval, qs_aval, S(kv_shape, FP8),
                               S((n_tok, splits * tps, 64), jnp.int32), S((1,), jnp.float32), arch=(9, 0))
  # 9 QK chunks x 2 k32 steps (+ one N=256 fp8 PV wgmma = 2 k32 steps); f16 PV: 4 k16 steps;
  # swizzled: 5 QK chunks of 128 x 4 k32 steps; heads_n: the same as m64nN (Sᵀ = K·Qᵀ, consumer 0 only), and
  # P·V as four 64-row blocks of Oᵀ x 4 k16 steps of m64nN f16 wgmmas (Vᵀ the transposed A operand), emitted
  # once in each consumer's code (consumer 0 runs the softmax, consumer 1 waits for its Pᵀ).
  assert low.count(r"wgmma\.mma_async[^ ]*e4m3\.e4m3") == {"fp8": 20, "f16": 18}.get(pv_dtype, 20)
  # heads_n: 8 blocks of 64 values of d x 4 k16 steps, split over the consumers' code
  assert low.count(r"wgmma\.mma_async[^ ]*f16\.f16") == (32 if heads_n else {"fp8": 0}.get(pv_dtype, 4))
  if heads_n:
    n = cfg.heads_n
    assert low.count(rf"m64n{n}k32\.f32\.e4m3\.e4m3") == 20 and low.count(rf"m64n{n}k16\.f32\.f16\.f16") == 32
  if cfg.v_regs:   # Vᵀ from the K tile in registers, per 64 x 512 tile per thread: 32 64-bit loads, 64 byte permutes
    assert low.count(r"ld\.shared\.v2\.b32") == 32 and low.count(r"prmt\.b32") == 64
    # O: per 8 stored heads, 2 heads x 2 halves of 8 consecutive latent columns per thread, one vector store each
    assert low.count(r"\{alignment = 16 : i64\} : vector<8x") == 4 * cfg.heads_n // 8
  assert low.count(r"cp\.async\.bulk\.tensor") > 0


def test_tuning_config_rejects_bad_values():
  with pytest.raises(ValueError, match="stages"):
    sm90.TuningConfig(stages=0)
  with pytest.raises(ValueError, match="SMEM"):
    sm90.TuningConfig(stages=3, k_gather="linear")   # 3 x 40 KB linear slots do not fit next to Q, K, V, P
  with pytest.raises(ValueError, match="k_gather"):
    sm90.TuningConfig(stages=2)             # the default swizzled gather has no linear ring
  with pytest.raises(ValueError, match="k_gather"):
    sm90.TuningConfig(k_gather="direct")
  with pytest.raises(ValueError, match="v_stager"):
    sm90.TuningConfig(v_stager="somewhere")
  with pytest.raises(ValueError, match="head_axis"):
    sm90.TuningConfig(head_axis="k")
  with pytest.raises(ValueError, match="head_axis"):
    sm90.TuningConfig(head_axis="n", k_gather="linear")
  with pytest.raises(ValueError, match="v_owners"):
    sm90.TuningConfig(head_axis="n", v_owners=((0, 1), (2,)))          # chunk 3 has no owner
  with pytest.raises(ValueError, match="v_owners"):
    sm90.TuningConfig(v_owners=((0, 1), (2, 3)))                       # head_axis="m"
  with pytest.raises(ValueError, match="l_partial"):
    sm90.TuningConfig(l_partial=True)
  with pytest.raises(ValueError, match="persistent"):
    sm90.TuningConfig(head_axis="n", persistent=True, tiles_per_split=7, k_buffers=3)   # < 2 k_buffers + 2
  with pytest.raises(ValueError, match="persistent"):
    sm90.TuningConfig(persistent=True)                                  # head_axis="m"


def test_argument_errors(rng):
  case = make_case(rng, B=1, s_q=1, H=8, topk=4)
  kw = dict(softmax_scale=0.1, impl="xla")
  with pytest.raises(ValueError, match=r"q must have shape \[B, s_q, H, 576\]"):
    mla_pallas.sparse_mla_decode(case.q[..., :512], case.kv, case.indices, **kw)
  with pytest.raises(ValueError, match="q must have dtype"):
    mla_pallas.sparse_mla_decode(case.q.astype(jnp.float16), case.kv, case.indices, **kw)
  with pytest.raises(ValueError, match="kv_cache must have dtype float8_e4m3fn"):
    mla_pallas.sparse_mla_decode(case.q, case.kv.astype(jnp.bfloat16), case.indices, **kw)
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
