"""mla_prefill's cuDNN backend on a Hopper GPU against reference.mla_prefill (float32 math on the same bf16 inputs):
random inputs with ragged lengths (incl. 0 and 1), separate keys (cu_seqlens_k: context longer and shorter than
the queries), both presets' head dims (DeepSeek-V3.2 qk 192 / v 128, GLM-5
256 / 256), causal and not, padding tokens and non-finite v (the general branch), one sequence, no sequence, a
traced softmax scale, and the lse; at the models' head counts and 2 x 4096 tokens against the float32 backend.

Error model (bf16 operands; u = 2^-8, bf16's unit roundoff). cuDNN computes the logits from the same bf16 q, k with
f32 accumulation and the softmax in f32, but rounds P to bf16 for P·V: each weight p_j is off by <= u relative, so
an output moves by <= u · sum_j p_j |v_j| / l <= u · max |v| (worst case) and by ~u / sqrt(3) relative in RMS
(independent roundings). Both outputs are then rounded to bf16 (<= u relative each). Hence
  * per element: |out - ref| <= 2u · |ref| + u · max|v| (+ 1e-5 absolute);
  * rel-L2: three independent terms of RMS u / sqrt(3) each: sqrt(3) · u / sqrt(3) = u ~ 3.9e-3; asserted <= 3u.
lse: cuDNN's f32 softmax statistics; the logits are summed in another order than the reference's: each off by
<= Dqk · 2^-24 · scale · sum_d |q_d k_d| (f32 accumulation bound), and the log-sum-exp moves by at most the largest
logit error; with exp2 / log2 arithmetic in between, asserted <= 4 · Dqk · 2^-24 · scale · max sum_d |q_d k_d|
+ 1e-5.

Run with ``-s`` to see the measured errors.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas import reference as ref
from mla_pallas.ops import prefill as pf
from mla_pallas.ops.prefill import mla_prefill

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

U = 2.0 ** -8
PRESETS = {"deepseek_v32": (16, 192, 128), "glm5": (8, 256, 256)}     # (H, Dqk, Dv); fewer heads than the models
LENS = [1, 517, 1, 300, 0, 381]                                       # T = 1200
MODEL_T = 8192                                                        # two sequences of 4096


def _inputs(rng, t, h, dqk, dv, cu, bad=()):
  q = jnp.asarray(rng.normal(size=(t, h, dqk)), jnp.bfloat16)
  k = jnp.asarray(rng.normal(size=(t, h, dqk)), jnp.bfloat16)
  v = rng.normal(size=(t, h, dv)).astype(np.float32)
  for idx, val in bad:
    v[idx] = val
  return q, k, jnp.asarray(v, jnp.bfloat16), jnp.asarray(np.asarray(cu, np.int32))


def _cu(lens, lead=0):
  return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32) + lead


def _logit_l1(q, k):
  """max_{i,j,h} sum_d |q_id k_jd| (on the GPU: [H, T, T] in f32)."""
  qa, ka = jnp.abs(q.astype(jnp.float32)), jnp.abs(k.astype(jnp.float32))
  return float(jnp.max(jnp.einsum("ihd,jhd->hij", qa, ka, precision=jax.lax.Precision.HIGHEST)))


def _check(out, lse, r_out, r_lse, q, k, v, scale, *, extra_logit_err=0.0, parts=1):
  o, r = np.asarray(out, np.float64), np.asarray(r_out, np.float64)
  np.testing.assert_array_equal(np.isnan(o), np.isnan(r))
  fin = np.isfinite(r)
  assert np.all(np.isfinite(o[fin]))
  vals = np.asarray(v, np.float64)
  vmax = np.max(np.abs(vals[np.isfinite(vals)]))
  d = np.abs(o[fin] - r[fin])
  # extra_logit_err (a traced scale folded into q): weights move by a factor within e^(+-2 eps)
  # parts = 2 (separate keys, causal): each part's output is rounded to bf16 before the merge, <= U max|v| more
  bound = 2 * U * np.abs(r[fin]) + (parts * U + np.expm1(2 * extra_logit_err)) * vmax + 1e-5
  rel_l2 = np.linalg.norm(o[fin] - r[fin]) / max(np.linalg.norm(r[fin]), 1e-30)
  g, w = np.asarray(lse, np.float64), np.asarray(r_lse, np.float64)
  np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w))
  lfin = np.isfinite(w)
  assert np.all(np.isfinite(g[lfin]))
  lse_err = np.max(np.abs(g[lfin] - w[lfin]), initial=0.0)
  lse_tol = 4 * q.shape[2] * 2.0 ** -24 * scale * _logit_l1(q, k) + extra_logit_err + 1e-5
  print(f"out rel-L2 {rel_l2:.2e} (<= {3 * U:.2e}), max excess over bound {np.max(d - bound, initial=-1):.2e}; "
        f"lse max err {lse_err:.2e} (<= {lse_tol:.2e})")
  assert np.all(d <= bound), np.max(d - bound)
  if fin.any() and np.linalg.norm(r[fin]) > 0:
    assert rel_l2 <= (2 + parts) * U
  assert lse_err <= lse_tol


def test_backend_is_cudnn_and_lowers_to_cudnn(rng):
  h, dqk, dv = PRESETS["deepseek_v32"]
  q, k, v, cu = _inputs(rng, 64, h, dqk, dv, _cu([30, 34]))
  assert pf.xla_backend(q, k, v, cu) == "cudnn", pf._backend_reason(q, k, v, cu)
  fn = jax.jit(lambda *a: mla_prefill(*a, softmax_scale=0.1, impl="xla"))
  assert "custom_call @__cudnn$fmhaSoftmax" in fn.lower(q, k, v, cu).as_text()
  jax.block_until_ready(fn(q, k, v, cu))                             # XLA builds the cuDNN graphs and runs them
  assert pf.xla_backend(q.astype(jnp.float32), k, v, cu) == "f32"   # float32 inputs keep float32 math


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_cudnn_matches_reference(rng, preset, causal):
  h, dqk, dv = PRESETS[preset]
  cu = _cu(LENS)
  q, k, v, cu = _inputs(rng, int(cu[-1]), h, dqk, dv, cu)
  scale = dqk ** -0.5
  out, lse = mla_prefill(q, k, v, cu, softmax_scale=scale, causal=causal, impl="xla")
  assert out.shape == v.shape and out.dtype == jnp.bfloat16 and lse.shape == q.shape[:2]
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=scale, causal=causal)
  _check(out, lse, r_out, r_lse, q, k, v, scale)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_cudnn_padding_tokens_and_nonfinite_v(rng, preset, causal):
  h, dqk, dv = PRESETS[preset]
  cu = _cu([200, 1, 0, 331], lead=5)                                 # tokens 0-4 and 537-599: padding
  t = 600
  bad = [((slice(0, 5),), np.nan), ((slice(540, 600),), np.inf),      # padding: must not leak
         ((250, 1, 7), np.inf), ((400, 0, 3), np.nan), ((210, 2, 0), -np.inf)]
  q, k, v, cu = _inputs(rng, t, h, dqk, dv, cu, bad=bad)
  scale = dqk ** -0.5
  out, lse = mla_prefill(q, k, v, cu, softmax_scale=scale, causal=causal, impl="xla")
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=scale, causal=causal)
  _check(out, lse, r_out, r_lse, q, k, v, scale)


# separate keys (prefill over cached context): query lengths, key lengths (context = Lk - Lq; Lk < Lq: the first
# Lq - Lk queries see nothing), leading padding queries / keys
CONTEXT = {"ragged": ([1, 37, 600, 0, 9], [300, 37, 1000, 5, 4], 0, 0), "padding": ([64, 200], [700, 333], 3, 7)}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", sorted(CONTEXT))
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_cudnn_separate_keys_match_reference(rng, preset, case, causal):
  """cu_seqlens_k: the context call (PADDING) and the causal call over each sequence's last min(Lq, Lk) keys
  (PADDING_CAUSAL), merged by lse; with padding tokens on both sides the general branch (NaN / inf in padding
  keys' v must not leak)."""
  h, dqk, dv = PRESETS[preset]
  lq, lk, lead_q, lead_k = CONTEXT[case]
  cu, cu_k = _cu(lq, lead_q), _cu(lk, lead_k)
  t, tk = int(cu[-1]) + 2 * lead_q, int(cu_k[-1]) + lead_k
  q, _, _, cu = _inputs(rng, t, h, dqk, dv, cu)
  bad = [((slice(0, lead_k),), np.nan)] if lead_k else []
  _, k, v, cu_k = _inputs(rng, tk, h, dqk, dv, cu_k, bad=bad)
  scale = dqk ** -0.5
  out, lse = mla_prefill(q, k, v, cu, softmax_scale=scale, causal=causal, cu_seqlens_k=cu_k, impl="xla")
  assert pf.xla_backend(q, k, v, cu) == "cudnn" and out.shape == (t, h, dv)
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=scale, causal=causal, cu_seqlens_k=cu_k)
  _check(out, lse, r_out, r_lse, q, k, v, scale, parts=2 if causal else 1)


@pytest.mark.parametrize("t,cu", [(700, [0, 700]), (1, [0, 1]), (9, [0]), (50, [0, 0, 50, 50])],
                         ids=["one_sequence", "one_token", "no_sequence", "empty_ends"])
def test_cudnn_edge_batches(rng, t, cu):
  h, dqk, dv = PRESETS["deepseek_v32"]
  q, k, v, cu = _inputs(rng, t, h, dqk, dv, cu)
  scale = dqk ** -0.5
  out, lse = mla_prefill(q, k, v, cu, softmax_scale=scale, impl="xla")
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=scale)
  _check(out, lse, r_out, r_lse, q, k, v, scale)


def test_cudnn_traced_scale(rng):
  h, dqk, dv = PRESETS["deepseek_v32"]
  cu = _cu(LENS)
  q, k, v, cu = _inputs(rng, int(cu[-1]), h, dqk, dv, cu)
  scale = dqk ** -0.5
  out, lse = jax.jit(lambda q, k, v, cu, s: mla_prefill(q, k, v, cu, softmax_scale=s, impl="xla"))(
      q, k, v, cu, jnp.float32(scale))
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=scale)
  # the scale is folded into q (q · scale rounded to bf16, <= u relative per element): logits move by <= eps
  eps = U * scale * _logit_l1(q, k)
  _check(out, lse, r_out, r_lse, q, k, v, scale, extra_logit_err=eps)


@pytest.mark.parametrize("nseq", [2, 1])
@pytest.mark.parametrize("preset,h", [("deepseek_v32", 128), ("glm5", 64)])
def test_cudnn_matches_f32_path_at_model_size(preset, h, nseq):
  """Two causal 4096-token sequences (packed layout) or one of 8192 (non-packed call, v unpadded) with the models'
  head counts (the benchmark shapes), against the float32 backend (the reference's [H, T, T] logits would take
  32 GiB; the f32 backend agrees with the reference within one bf16 ulp, tests/test_prefill.py), same error
  model."""
  _, dqk, dv = PRESETS[preset]
  t = MODEL_T
  kq, kk, kv = jax.random.split(jax.random.key(7), 3)
  q = jax.random.normal(kq, (t, h, dqk), jnp.bfloat16)
  k = jax.random.normal(kk, (t, h, dqk), jnp.bfloat16)
  v = jax.random.normal(kv, (t, h, dv), jnp.bfloat16)
  cu = jnp.asarray([0, t // 2, t] if nseq == 2 else [0, t], jnp.int32)
  scale = dqk ** -0.5
  assert pf.xla_backend(q, k, v, cu) == "cudnn"
  assert (pf._one_sequence_call(q, v, cu) is not None) == (nseq == 1)
  out, lse = mla_prefill(q, k, v, cu, softmax_scale=scale, impl="xla")
  r_out, r_lse = pf._f32_jit(q, k, v, cu, jnp.float32(scale), causal=True)
  o, r = out.astype(jnp.float32), r_out.astype(jnp.float32)
  rel_l2 = float(jnp.linalg.norm(o - r) / jnp.linalg.norm(r))
  excess = float(jnp.max(jnp.abs(o - r) - (2 * U * jnp.abs(r) + U * jnp.max(jnp.abs(v.astype(jnp.float32))) + 1e-5)))
  # lse bound of the module docstring with sum_d |q_d k_d| <= |q|_2 |k|_2 (Cauchy-Schwarz; no [H, T, T] tensor)
  norms = lambda x: jnp.linalg.norm(x.astype(jnp.float32), axis=-1)                 # [T, H]
  l1 = float(jnp.max(jnp.max(norms(q), axis=0) * jnp.max(norms(k), axis=0)))
  lse_err = float(jnp.max(jnp.abs(lse - r_lse)))
  lse_tol = 4 * dqk * 2.0 ** -24 * scale * l1 + 2e-4        # + the f32 backend's own lse tolerance (1e-4, twice)
  print(f"{preset} H{h} B{nseq}: out rel-L2 {rel_l2:.2e} (<= {3 * U:.2e}), max excess over bound {excess:.2e}; "
        f"lse max err {lse_err:.2e} (<= {lse_tol:.2e})")
  assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(lse)))
  assert excess <= 0 and rel_l2 <= 3 * U and lse_err <= lse_tol
