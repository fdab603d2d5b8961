"""mla_prefill's Mosaic GPU kernel (kernels/prefill_sm90.py) on an H200 against reference.mla_prefill: both
models' head dims, ragged sequences (1, 37, 600 and 0 tokens), cached context lengths that are not multiples of
a tile or a page, fewer keys than queries, padding tokens and non-finite v, a clean batch whose key sequences
start at multiples of 8 (v read in place), both causal forms, determinism.

Error model: tests/test_prefill_kernel.py's (q and k in e4m3 with per-row scales, P and the output in bf16) plus
Hopper's reduced-precision fp8 accumulation of QKᵀ (``fp8_mma=True``; its P·V term over-counts: P·V is a bf16
wgmma with f32 accumulation).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas import _dispatch, reference as ref, testing
from mla_pallas.ops.prefill import mla_prefill

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

DIMS = {"deepseek_v32": (16, 192, 128), "glm5": (8, 256, 256)}        # (H, Dqk, Dv)
# (query lengths, key lengths or None, leading padding queries, trailing padding queries)
CASES = {
    "ragged": ([1, 37, 600, 0], None, 0, 0),
    "context": ([1, 37, 600, 0, 50], [301, 37, 1000, 5, 20], 0, 0),      # context 300, 0, 400, 5; 50 > 20 keys
    "padding": ([64, 200], [700, 333], 3, 9),
    "aligned": ([256, 40, 300], [256, 48, 560], 0, 0),                  # clean, key starts 0/256/304: v read in place
}


def _cu(lens, lead=0):
  return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32) + lead


def _inputs(rng, h, dqk, dv, case):
  lq, lk, lead, trail = CASES[case]
  cu = _cu(lq, lead)
  t = int(cu[-1]) + trail
  cu_k = None if lk is None else _cu(lk, lead)
  tk = t if lk is None else int(cu_k[-1]) + trail
  q = jnp.asarray(rng.normal(size=(t, h, dqk)), jnp.bfloat16)
  k = jnp.asarray(rng.normal(size=(tk, h, dqk)), jnp.bfloat16)
  v = rng.normal(size=(tk, h, dv)).astype(np.float32)
  if lead:
    v[:lead] = np.nan                                                 # padding keys: must not leak
    v[lead + 5, 1, 3] = np.inf                                        # a real key of sequence 0
  v = jnp.asarray(v, jnp.bfloat16)
  return q, k, v, jnp.asarray(cu), None if cu_k is None else jnp.asarray(cu_k)


def _check(q, k, v, cu, cu_k, causal, run, what, quantized_p=False):
  """``run()`` twice (bitwise the same) and against reference.mla_prefill within the error model above
  (``quantized_p``: P and V in e4m3 too, TuningConfig.pv_fp8)."""
  dqk, tk = q.shape[2], k.shape[0]
  scale = dqk ** -0.5
  out, lse = run()
  out2, lse2 = run()
  np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(out2).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=scale, causal=causal, cu_seqlens_k=cu_k)
  o, r = np.asarray(out, np.float64), np.asarray(r_out, np.float64)
  np.testing.assert_array_equal(np.isnan(o), np.isnan(r))
  g, w = np.asarray(lse, np.float64), np.asarray(r_lse, np.float64)
  np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w))
  assert np.all(o[np.isneginf(w)] == 0)
  fin = np.isfinite(r)
  budget = testing.fp8_error_budget(quantized_q=True, quantized_kv=True, quantized_p=quantized_p, fp8_mma=True,
                                    d_qk=dqk, pv_length=tk, logit_std=1.0)
  rel = np.linalg.norm(o[fin] - r[fin]) / np.linalg.norm(r[fin])
  lf = np.isfinite(w)
  lse_err = np.abs(g[lf] - w[lf]).max()
  print(f"{what}: out rel-L2 {rel:.3g} (<= {budget:.3g}), lse max err {lse_err:.3g}")
  assert rel <= budget
  assert lse_err <= 6 * 2.0 ** -4


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("model", sorted(DIMS))
def test_kernel_matches_reference(rng, model, case, causal):
  h, dqk, dv = DIMS[model]
  q, k, v, cu, cu_k = _inputs(rng, h, dqk, dv, case)
  scale = dqk ** -0.5

  def run():
    out = mla_prefill(q, k, v, cu, softmax_scale=scale, causal=causal, cu_seqlens_k=cu_k, impl="mosaic")
    assert _dispatch.last_impl("mla_prefill") == "mosaic"
    return out
  from mla_pallas.kernels import prefill_sm90 as kp
  _check(q, k, v, cu, cu_k, causal, run, f"{model} {case} causal={causal}", kp.default_config(dqk, dv).pv_fp8)


def _check_config(rng, h, model, case, causal, cfg, what):
  """The op's kernel path (``ops.prefill._mosaic_jit``) with ``cfg`` on a fresh case, through :func:`_check` (with
  P and V in e4m3 in the error model where ``cfg.pv_fp8``)."""
  import functools
  from mla_pallas.ops import prefill as pf
  _, dqk, dv = DIMS[model]
  q, k, v, cu, cu_k = _inputs(rng, h, dqk, dv, case)
  run = functools.partial(pf._mosaic_jit, q, k, v, cu, jnp.float32(dqk ** -0.5), causal=causal, cu_seqlens_k=cu_k,
                          cfg=cfg)
  _check(q, k, v, cu, cu_k, causal, run, what, cfg.pv_fp8)
  return q, k


@pytest.mark.parametrize("model", sorted(DIMS))
def test_prepass_kernel_matches_reference(rng, model):
  """64 heads, so that q and k go through kernels/prefill_quant.py (H a multiple of 64), with the default config:
  ragged sequences with cached context, causal."""
  from mla_pallas.kernels import prefill_sm90 as kp
  from mla_pallas.ops import prefill as pf
  _, dqk, dv = DIMS[model]
  q, k = _check_config(rng, 64, model, "context", True, kp.default_config(dqk, dv), f"{model} H64")
  assert pf._prepass_kernel(q) and pf._prepass_kernel(k)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", ["context", "padding"])
@pytest.mark.parametrize("model", sorted(DIMS))
def test_pingpong_matches_reference(rng, model, case, causal):
  """TuningConfig.pingpong (FA3's schedule barrier between the two consumers) against the reference, with ragged
  tiles, empty tiles (the paired rendezvous), cached context and padding; bitwise deterministic."""
  import dataclasses
  from mla_pallas.kernels import prefill_sm90 as kp
  h, dqk, dv = DIMS[model]
  cfg = dataclasses.replace(kp.default_config(dqk, dv), pingpong=True)
  _check_config(rng, h, model, case, causal, cfg, f"pingpong {model} {case} causal={causal}")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", ["context", "padding"])
@pytest.mark.parametrize("model", sorted(DIMS))
def test_pv_fp8_matches_reference(rng, model, case, causal):
  """TuningConfig.pv_fp8 (fp8 P·V over the op's Vᵀ in e4m3 with column scales; 128-key blocks at DeepSeek's dims,
  64 at GLM-5's, with the ping-pong at GLM-5) against the reference within the error model with P and V in e4m3;
  ragged tiles, cached context, padding and non-finite v; bitwise deterministic."""
  from mla_pallas.kernels import prefill_sm90 as kp
  h, dqk, _ = DIMS[model]
  cfg = kp.TuningConfig(block_kv=128 if dqk == 192 else 64, pv_fp8=True, pingpong=dqk != 192)
  _check_config(rng, h, model, case, causal, cfg, f"pv_fp8 {model} {case} causal={causal}")


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("model", sorted(DIMS))
def test_pv_bf16_matches_reference(rng, model, causal):
  """``pv_fp8=False`` (bf16 P·V over v as it is or packed; the default before the fp8 P·V), the accurate form:
  cached context, ragged tiles, within the error model with P and V unrounded; bitwise deterministic."""
  import dataclasses
  from mla_pallas.kernels import prefill_sm90 as kp
  h, dqk, dv = DIMS[model]
  cfg = dataclasses.replace(kp.default_config(dqk, dv), pv_fp8=False)
  _check_config(rng, h, model, "context", causal, cfg, f"pv_bf16 {model} causal={causal}")
