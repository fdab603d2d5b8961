"""mla_prefill's XLA backends on the CPU: the dispatch picks the float32 path here and it is the one that always ran
(its tests against the reference, argument validation); the cuDNN backend's packing / unpacking (segments, V
padding, lse gather, padding tokens, non-finite v, the two ``lax.cond`` branches) against the reference with a jnp
stand-in for the cuDNN call.

The stand-in (:func:`_attend_standin`) implements what ``_cudnn_attend`` is documented to return (packed layout:
out rows outside every segment unwritten, softmax statistics ``[M, H, T]`` by segment and position) and is
deliberately hostile where that contract leaves things undefined: unwritten output rows and unused statistics are
NaN, and it multiplies *every* key's v by its (possibly 0) probability, so a non-finite v anywhere in the packed
batch reaches every output unless the backend sanitized it. The real cuDNN call is lowered for CUDA here (JAX's
shape / layout checks and the custom call's operand and result types: packed layout, padded v, statistics
``[M, H, T]``) and compared with the reference on a GPU in tests/test_prefill_gpu.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas import _dispatch, reference as ref
from mla_pallas.ops import prefill as pf
from mla_pallas.ops.prefill import mla_prefill

_HI = jax.lax.Precision.HIGHEST


def _attend_standin(q4, k4, v4, q_lens, kv_lens, q_offsets, kv_offsets, *, scale, causal):
  """float32 jnp model of ``_cudnn_attend`` (see the module docstring). Segments that break the callers' rules (a
  query segment without keys; a causal segment with q_lens != kv_lens) answer NaN out and statistics."""
  _, tq, h, d = q4.shape
  tk = k4.shape[1]
  assert k4.shape == (1, tk, h, d) and v4.shape == k4.shape, "the cuDNN backend must hand cuDNN one head dim"
  m = q_lens.shape[1]
  assert kv_lens.shape == (1, m) and q_offsets.shape == kv_offsets.shape == (1, m + 1) and m >= 2
  q_lens, kv_lens, q_offs, kv_offs = q_lens[0], kv_lens[0], q_offsets[0, :m], kv_offsets[0, :m]
  broken = ((kv_lens == 0) & (q_lens > 0)) | ((q_lens != kv_lens) & causal)          # [M]
  pq, pk = jnp.arange(tq), jnp.arange(tk)
  in_q = pq[None, :] < q_lens[:, None]                                   # [M, Pq]
  in_k = pk[None, :] < kv_lens[:, None]                                  # [M, Pk]
  rows_q = jnp.clip(q_offs[:, None] + pq[None, :], 0, tq - 1)            # [M, Pq] token of (segment, position)
  rows_k = jnp.clip(kv_offs[:, None] + pk[None, :], 0, tk - 1)
  qs = q4[0].astype(jnp.float32)[rows_q]                                 # [M, Pq, H, D]
  ks = k4[0].astype(jnp.float32)[rows_k]
  valid = in_q[:, :, None] & in_k[:, None, :]                            # [M, Pq, Pk]
  if causal:
    valid = valid & (pk[None, None, :] <= pq[None, :, None])
  s = jnp.einsum("mqhd,mkhd->mhqk", qs, ks, precision=_HI) * scale
  s = jnp.where(valid[:, None], s, -jnp.inf)
  mx = jnp.max(s, axis=-1, keepdims=True)
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  p = jnp.where(valid[:, None], jnp.exp(s - mx), 0.0)
  l = jnp.sum(p, axis=-1)                                                # [M, H, Pq]
  stats = jnp.where(in_q[:, None, :], jnp.log(l) + mx[..., 0], jnp.nan)
  stats = jnp.where(broken[:, None, None], jnp.nan, stats)
  # hostile P·V: every key of the packed batch, weight 0 outside the segment (0 * NaN = NaN leaks)
  w = jnp.zeros((m, h, tq, tk), jnp.float32)
  w = w.at[jnp.arange(m)[:, None, None, None], jnp.arange(h)[None, :, None, None],
           pq[None, None, :, None], rows_k[:, None, None, :]].add(p)
  o = jnp.einsum("mhqk,khd->mqhd", w, v4[0].astype(jnp.float32), precision=_HI)
  o = o / jnp.where(l > 0, l, 1.0).transpose(0, 2, 1)[..., None]
  o = jnp.where(broken[:, None, None, None], jnp.nan, o)
  out = jnp.full((tq, h, d), jnp.nan, jnp.float32)
  dest = jnp.where(in_q, rows_q, tq)                                     # rows past the segment: dropped
  out = out.at[dest].set(o, mode="drop")
  return out[None].astype(q4.dtype), stats


def _attend_one_standin(q4, k4, v4, *, scale, causal):
  """float32 jnp model of ``_cudnn_attend_one``: one whole sequence, Dv may differ from Dqk."""
  _, t, h, d = q4.shape
  assert k4.shape == q4.shape and v4.shape[:3] == q4.shape[:3]
  s = jnp.einsum("qhd,khd->hqk", q4[0].astype(jnp.float32), k4[0].astype(jnp.float32), precision=_HI) * scale
  if causal:
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool))[None], s, -jnp.inf)
  mx = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.exp(s - mx)
  l = jnp.sum(p, axis=-1)                                                # [H, T]
  o = jnp.einsum("hqk,khd->qhd", p, v4[0].astype(jnp.float32), precision=_HI) / l.T[..., None]
  return o[None].astype(q4.dtype), (jnp.log(l) + mx[..., 0])[None]


def _case(rng, t, h, dqk, dv, cu, dtype=jnp.bfloat16, bad=()):
  q = jnp.asarray(rng.normal(size=(t, h, dqk)), dtype)
  k = jnp.asarray(rng.normal(size=(t, h, dqk)), dtype)
  v = rng.normal(size=(t, h, dv)).astype(np.float32)
  for idx, val in bad:
    v[idx] = val
  return q, k, jnp.asarray(v, dtype), jnp.asarray(np.asarray(cu, np.int32))


def _assert_close(out, lse, r_out, r_lse, *, out_rel, lse_abs):
  o, r = np.asarray(out, np.float64), np.asarray(r_out, np.float64)
  np.testing.assert_array_equal(np.isnan(o), np.isnan(r))
  fin = np.isfinite(r)
  assert np.all(np.isfinite(o[fin]))
  err = np.abs(o[fin] - r[fin])
  assert np.all(err <= out_rel * np.abs(r[fin]) + 1e-5), err.max()
  g, w = np.asarray(lse, np.float64), np.asarray(r_lse, np.float64)
  np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w))
  fin = np.isfinite(w)
  assert np.all(np.isfinite(g[fin]))
  assert np.all(np.abs(g[fin] - w[fin]) <= lse_abs), np.max(np.abs(g[fin] - w[fin]))


def _standin(q, k, v, cu, scale, causal, static=True, one=False, cu_k=None):
  """The cuDNN backend with the stand-ins; ``one``: a one-sequence batch's clean branch takes the non-packed call;
  ``cu_k``: separate keys."""
  return pf._cudnn_jit(q, k, v, cu, jnp.float32(scale), causal=causal, scale=float(scale) if static else None,
                       cu_seqlens_k=cu_k, attend=_attend_standin, attend_one=_attend_one_standin if one else None)


# ------------------------------------------------------------------------------------------------------------
# dispatch: the float32 path on the CPU
# ------------------------------------------------------------------------------------------------------------

@pytest.fixture
def f32_backend(monkeypatch):
  """The float32 backend even on a GPU host (the tests below are about that path)."""
  monkeypatch.setattr(pf, "_cudnn_device_reason", lambda: "forced float32 backend (test)")


def _padding_poisoned(rng, t, h, dqk, dv, cu, dtype=jnp.bfloat16):
  """Inputs whose padding tokens (outside [cu[0], cu[-1])) carry NaN / inf v, which must never leak."""
  bad = [((slice(0, cu[0]),), np.nan), ((slice(cu[-1], t),), np.inf)]
  return _case(rng, t, h, dqk, dv, cu, dtype=dtype, bad=bad)


@pytest.mark.parametrize("impl", ["auto", "xla"])
def test_cpu_runs_the_f32_path_unchanged(rng, impl):
  q, k, v, cu = _case(rng, 40, 2, 16, 8, [2, 9, 30, 37])
  assert pf.xla_backend(q, k, v, cu) == "f32"
  assert "CUDA" in pf._backend_reason(q, k, v, cu)
  out, lse = mla_prefill(q, k, v, cu, softmax_scale=0.3, impl=impl)
  assert _dispatch.last_impl("mla_prefill") == "xla"
  f_out, f_lse = pf._f32_jit(q, k, v, cu, jnp.float32(0.3), causal=True)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(f_out, np.float32))   # the same program
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(f_lse))


# f32 math in both, in a different order (~1e-6 relative), then both rounded to bf16: outputs at most one bf16 ulp
# apart (2^-7 relative, + 1e-5 absolute near 0); lse: f32 log-sum-exp of O(1) logits, ~1e-6 apart.
EXACT = dict(out_rel=2.0 ** -7, lse_abs=1e-4)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("blk", [None, 16])
def test_f32_backend_matches_reference(rng, monkeypatch, f32_backend, causal, blk):
  if blk is not None:                   # several query and key blocks, sequences straddling block edges
    monkeypatch.setattr(pf, "_MAX_BLOCK", blk)
  t, h = 53, 3
  cu = [3, 10, 10, 31, 50]              # 3 leading padding tokens, an empty sequence, 3 trailing padding tokens
  q, k, v, cu = _padding_poisoned(rng, t, h, 24, 16, cu)
  v = v.at[12, 1, 5].set(jnp.nan)      # NaN inside sequence 2: its own queries' outputs (that see it) are NaN
  out, lse = mla_prefill(q, k, v, cu, softmax_scale=0.3, causal=causal, impl="xla")
  assert _dispatch.last_impl("mla_prefill") == "xla"
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=0.3, causal=causal)
  assert out.shape == (t, h, 16) and out.dtype == jnp.bfloat16 and lse.shape == (t, h)
  _assert_close(out, lse, r_out, r_lse, **EXACT)


def test_f32_inputs_single_sequence(rng, monkeypatch):
  monkeypatch.setattr(pf, "_MAX_BLOCK", 32)
  q, k, v, cu = _padding_poisoned(rng, 70, 2, 8, 8, [0, 70], dtype=jnp.float32)
  assert pf.xla_backend(q, k, v, cu) == "f32"                # float32 inputs keep float32 math on every device
  out, lse = mla_prefill(q, k, v, cu, softmax_scale=0.5, impl="auto")
  assert _dispatch.last_impl("mla_prefill") == "xla"      # no kernel: auto runs XLA
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=0.5)
  _assert_close(out, lse, r_out, r_lse, **EXACT)


def test_dispatch_and_validation(rng):
  q, k, v, cu = _case(rng, 8, 2, 8, 4, [0, 8])
  with pytest.raises(NotImplementedError, match="multiple of 64"):        # the kernel's head dims (64..256)
    mla_prefill(q, k, v, cu, softmax_scale=1.0, impl="mosaic", interpret=True)
  with pytest.raises(ValueError, match="impl"):
    mla_prefill(q, k, v, cu, softmax_scale=1.0, impl="triton")
  for name, args in [("q", (q[0], k, v, cu)), ("k", (q, k[:, :1], v, cu)), ("v", (q, k, v[:4], cu)),
                     ("cu_seqlens", (q, k, v, cu.astype(jnp.float32))), ("cu_seqlens", (q, k, v, cu[:0]))]:
    with pytest.raises(ValueError, match=name):
      mla_prefill(*args, softmax_scale=1.0, impl="xla")
  with pytest.raises(ValueError, match="causal"):
    mla_prefill(q, k, v, cu, softmax_scale=1.0, causal=None, impl="xla")


def test_cudnn_shape_rules():
  bf, f32 = jnp.bfloat16, jnp.float32
  assert pf._cudnn_shape_reason((bf,) * 3, 8192, 128, 192, 128, 2) is None         # DeepSeek-V3.2
  assert pf._cudnn_shape_reason((bf,) * 3, 8192, 64, 256, 256, 2) is None          # GLM-5
  assert "bfloat16" in pf._cudnn_shape_reason((bf, bf, f32), 64, 2, 64, 64, 1)
  assert "multiples of 8" in pf._cudnn_shape_reason((bf,) * 3, 64, 2, 264, 64, 1)
  assert "multiples of 8" in pf._cudnn_shape_reason((bf,) * 3, 64, 2, 60, 64, 1)
  assert "multiples of 8" in pf._cudnn_shape_reason((bf,) * 3, 64, 2, 64, 20, 1)
  assert "Dv <= Dqk" in pf._cudnn_shape_reason((bf,) * 3, 64, 2, 64, 128, 1)
  assert "int32" in pf._cudnn_shape_reason((bf,) * 3, 2 ** 20, 128, 256, 256, 1)
  assert "statistics" in pf._cudnn_shape_reason((bf,) * 3, 8192, 128, 192, 128, 1024)


def test_static_scale():
  assert pf._static_scale(0.5) == 0.5 and pf._static_scale(jnp.float32(0.25)) == 0.25
  assert jax.jit(lambda s: jnp.float32(pf._static_scale(s) is None))(jnp.float32(1.0)) == 1.0


# ------------------------------------------------------------------------------------------------------------
# cuDNN backend: packing and unpacking with the stand-in
# ------------------------------------------------------------------------------------------------------------

CASES = {
    # name: (T, cu_seqlens, bad v entries (index, value), (Dqk, Dv)); Dv < Dqk: v zero-padded for cuDNN
    "ragged": (61, [0, 1, 2, 19, 19, 60, 61], (), (24, 16)),                 # lengths 1, 1, 17, 0, 41, 1
    "one_sequence": (33, [0, 33], (), (16, 16)),                             # B = 1: a zero-length 2nd segment
    "single_token": (1, [0, 1], (), (24, 16)),
    "padding_tokens": (40, [3, 10, 10, 31, 37], (), (16, 16)),               # leading / trailing padding tokens
    "nonfinite_v": (45, [0, 12, 30, 45], [((14, 1, 3), np.inf), ((31, 0, 0), np.nan)], (24, 16)),
    "nonfinite_padding": (30, [2, 20, 26], [((0,), np.nan), ((28,), np.inf), ((5, 0, 1), -np.inf)], (16, 16)),
}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", sorted(CASES))
def test_standin_matches_reference(rng, name, causal):
  t, cu, bad, (dqk, dv) = CASES[name]
  q, k, v, cu = _case(rng, t, 2, dqk, dv, cu, bad=bad)
  out, lse = _standin(q, k, v, cu, 0.3, causal)
  assert out.shape == (t, 2, dv) and out.dtype == jnp.bfloat16 and lse.shape == (t, 2) and lse.dtype == jnp.float32
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=0.3, causal=causal)
  _assert_close(out, lse, r_out, r_lse, **EXACT)


# Separate keys (cu_seqlens_k): (T, cu_seqlens, Tk, cu_seqlens_k, bad v entries (key index, value), (Dqk, Dv))
CONTEXT_CASES = {
    "chunk_after_context": (12, [0, 5, 12], 40, [0, 20, 40], (), (24, 16)),              # Lk - Lq = 15, 13
    "ragged": (9, [0, 1, 1, 8, 9], 47, [0, 37, 40, 47, 47], (), (24, 16)),             # 1/37, 0/3, 7/7, 1/0
    "fewer_keys": (10, [0, 10], 4, [0, 4], (), (16, 16)),                                # 6 queries see nothing
    "one_sequence": (16, [0, 16], 50, [0, 50], (), (16, 8)),
    "padding_both": (18, [2, 9, 15], 35, [3, 20, 31],
                     [((0,), np.nan), ((33,), np.inf), ((34, 1, 2), np.nan)], (16, 16)),
    "nonfinite_context": (12, [0, 5, 12], 40, [0, 20, 40],                             # context key 3: every
                          [((3, 0, 1), np.nan), ((38, 1, 0), np.inf)], (24, 16)),      # query of seq 0; key 38:
}                                                                                        # the last 5 of seq 1


def _context_case(rng, name):
  t, cu, tk, cu_k, bad, (dqk, dv) = CONTEXT_CASES[name]
  q, _, _, cu = _case(rng, t, 2, dqk, dv, cu)
  _, k, v, cu_k = _case(rng, tk, 2, dqk, dv, cu_k, bad=bad)
  return q, k, v, cu, cu_k


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", sorted(CONTEXT_CASES))
def test_standin_separate_keys_matches_reference(rng, name, causal):
  """The cuDNN backend's context split (a non-causal call over each sequence's first Lk - n keys, a causal call
  over the last n keys with the last n queries, merged by lse) against the reference. Error model: each part
  o_A, o_B (a convex combination of its v rows, so |o_X| <= max|v|) is rounded to bf16 by the stand-in (as by
  cuDNN: <= 2^-8 |o_X|) before the f32 merge w_A o_A + w_B o_B (w_A + w_B = 1): <= 2^-8 max|v| absolute, however
  much the two parts cancel; then the sum is rounded to bf16 (<= 2^-8 |out|), and the reference itself is one
  bf16 rounding away from the exact value (2^-8 |r|). lse: f32 log-sum-exp of O(1) logits (1e-4)."""
  q, k, v, cu, cu_k = _context_case(rng, name)
  out, lse = _standin(q, k, v, cu, 0.3, causal, cu_k=cu_k)
  assert out.shape == (q.shape[0], 2, v.shape[2]) and out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=0.3, causal=causal, cu_seqlens_k=cu_k)
  vmax = np.nanmax(np.where(np.isfinite(np.asarray(v, np.float64)), np.abs(np.asarray(v, np.float64)), 0))
  o, r = np.asarray(out, np.float64), np.asarray(r_out, np.float64)
  np.testing.assert_array_equal(np.isnan(o), np.isnan(r))
  fin = np.isfinite(r)
  assert np.all(np.abs(o[fin] - r[fin]) <= 2.0 ** -8 * vmax + 2.0 ** -7 * np.abs(r[fin]) + 1e-5)
  _assert_close(r_out, lse, r_out, r_lse, out_rel=0, lse_abs=1e-4)                 # lse (and its -inf rows)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", sorted(CONTEXT_CASES))
def test_f32_backend_separate_keys_matches_reference(rng, f32_backend, name, causal):
  q, k, v, cu, cu_k = _context_case(rng, name)
  out, lse = mla_prefill(q, k, v, cu, softmax_scale=0.3, causal=causal, cu_seqlens_k=cu_k)
  assert pf.xla_backend(q, k, v, cu) == "f32"
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=0.3, causal=causal, cu_seqlens_k=cu_k)
  _assert_close(out, lse, r_out, r_lse, **EXACT)


def test_f32_backend_separate_keys_small_blocks(rng, monkeypatch, f32_backend):
  """Many query and key blocks (block 8): the per-block key-range bounds of the loop."""
  monkeypatch.setattr(pf, "_MAX_BLOCK", 8)
  q, k, v, cu, cu_k = _context_case(rng, "ragged")
  for causal in (True, False):
    out, lse = pf._f32_jit(q, k, v, cu, jnp.float32(0.3), causal=causal, cu_seqlens_k=cu_k)
    r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=0.3, causal=causal, cu_seqlens_k=cu_k)
    _assert_close(out, lse, r_out, r_lse, **EXACT)


def test_separate_keys_validation(rng):
  q, k, v, cu, cu_k = _context_case(rng, "chunk_after_context")
  with pytest.raises(ValueError, match=r"k must have shape \[T, H, Dqk\]"):          # Tk != T needs cu_seqlens_k
    mla_prefill(q, k, v, cu, softmax_scale=0.3)
  with pytest.raises(ValueError, match="cu_seqlens_k"):
    mla_prefill(q, k, v, cu, softmax_scale=0.3, cu_seqlens_k=cu_k[:-1])
  with pytest.raises(ValueError, match="cu_seqlens_k"):
    mla_prefill(q, k, v, cu, softmax_scale=0.3, cu_seqlens_k=cu_k.astype(jnp.int64) if jax.config.x64_enabled
                else cu_k.astype(jnp.float32))
  with pytest.raises(ValueError, match=r"v must have shape \[Tk, H, Dv\]"):
    mla_prefill(q, k, v[:-1], cu, softmax_scale=0.3, cu_seqlens_k=cu_k)


ONE_SEQUENCE = {
    # B = 1, (T, cu_seqlens, bad v entries, (Dqk, Dv)): the non-packed call in the clean branch, the packed one else
    "whole": (47, [0, 47], (), (24, 16)),
    "whole_mla_dims": (40, [0, 40], (), (192, 128)),
    "single_token": (1, [0, 1], (), (24, 16)),
    "leading_padding": (30, [3, 30], [((0,), np.nan)], (24, 16)),           # general branch (packed)
    "trailing_padding": (30, [0, 21], [((25,), np.inf)], (16, 16)),
    "nonfinite_v": (36, [0, 36], [((9, 1, 2), np.nan)], (24, 16)),
}


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", sorted(ONE_SEQUENCE))
def test_standin_one_sequence_call(rng, name, causal):
  t, cu, bad, (dqk, dv) = ONE_SEQUENCE[name]
  q, k, v, cu = _case(rng, t, 2, dqk, dv, cu, bad=bad)
  out, lse = _standin(q, k, v, cu, dqk ** -0.5, causal, one=True)
  assert out.shape == (t, 2, dv) and out.dtype == jnp.bfloat16 and lse.shape == (t, 2)
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=dqk ** -0.5, causal=causal)
  _assert_close(out, lse, r_out, r_lse, **EXACT)


def test_one_sequence_call_choice(monkeypatch):
  q16, v8 = jnp.zeros((4, 2, 16), jnp.bfloat16), jnp.zeros((4, 2, 8), jnp.bfloat16)
  one, two = jnp.zeros((2,), jnp.int32), jnp.zeros((3,), jnp.int32)
  monkeypatch.setattr(pf, "_cudnn_version", lambda: 91000)
  assert pf._one_sequence_call(q16, v8, one) is pf._cudnn_attend_one
  assert pf._one_sequence_call(q16, q16, one) is pf._cudnn_attend_one
  assert pf._one_sequence_call(q16, v8, two) is None                   # packed layout for B > 1
  monkeypatch.setattr(pf, "_cudnn_version", lambda: 90900)             # no MLA head dims before cuDNN 9.10
  assert pf._one_sequence_call(q16, v8, one) is None
  assert pf._one_sequence_call(q16, q16, one) is pf._cudnn_attend_one


def test_standin_no_sequences(rng):
  q, k, v, cu = _case(rng, 9, 2, 16, 8, [0])
  out, lse = _standin(q, k, v, cu, 0.3, True)
  assert np.all(np.asarray(out, np.float32) == 0) and np.all(np.isneginf(np.asarray(lse)))


def test_clean_predicate(rng):
  """The clean branch (cuDNN's rows returned as they are) only where no token is padding and v is finite; the
  cases above with padding tokens or non-finite v fail against the hostile stand-in unless the general branch ran."""
  v = jnp.ones((20, 2, 8), jnp.bfloat16)
  cu = lambda c: jnp.asarray(c, jnp.int32)
  clean = lambda v, c, ck=None: bool(pf._is_clean(v, cu(c), cu(c if ck is None else ck), 20))
  assert clean(v, [0, 10, 20])
  assert not clean(v, [1, 10, 20])
  assert not clean(v, [0, 10, 19])
  assert not clean(v.at[3, 1, 2].set(jnp.inf), [0, 10, 20])
  v30 = jnp.ones((30, 2, 8), jnp.bfloat16)                             # separate keys: both packings count
  assert clean(v30, [0, 10, 20], [0, 12, 30])
  assert not clean(v30, [0, 10, 20], [0, 12, 29])
  assert not clean(v30, [0, 10, 19], [0, 12, 30])


def test_cudnn_never_sees_nonfinite_v(rng):
  seen = []

  def spy(q4, k4, v4, *segments, scale, causal):
    jax.debug.callback(lambda fin: seen.append(bool(fin)), jnp.all(jnp.isfinite(v4)))
    return _attend_standin(q4, k4, v4, *segments, scale=scale, causal=causal)

  for cu, bad in [([0, 10, 20], ()), ([1, 10, 20], [((0,), np.nan)]), ([0, 10, 20], [((4, 0, 0), np.inf)])]:
    q, k, v, cu = _case(rng, 20, 2, 16, 16, cu, bad=bad)
    out, lse = pf._cudnn_jit(q, k, v, cu, jnp.float32(0.3), causal=True, scale=0.3, attend=spy)
    r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=0.3)
    _assert_close(out, lse, r_out, r_lse, **EXACT)
  assert len(seen) == 3 and all(seen)


def test_standin_traced_scale(rng):
  scale = 0.3
  q, k, v, cu = _case(rng, 50, 2, 24, 16, [0, 7, 50])
  out, lse = jax.jit(lambda q, k, v, cu, s: _standin(q, k, v, cu, s, True, static=False))(q, k, v, cu, scale)
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=scale)
  # Error model: q · scale is rounded to bf16 (each element off by <= u = 2^-8 relative), so a logit q·k moves by
  # at most eps = u · scale · max_{i,j} sum_d |q_id k_jd|. lse is a smooth max of the logits: off by <= eps (plus
  # f32 rounding, 1e-5). Each softmax weight moves by a factor within e^(+-2 eps), so an output moves by
  # <= (e^(2 eps) - 1) · max |v|, on top of one bf16 ulp (2^-7 relative) between the two roundings to bf16.
  qa, ka = np.abs(np.asarray(q, np.float64)), np.abs(np.asarray(k, np.float64))
  eps = 2.0 ** -8 * scale * np.einsum("ihd,jhd->hij", qa, ka).max()
  o, r = np.asarray(out, np.float64), np.asarray(r_out, np.float64)
  bound = 2.0 ** -7 * np.abs(r) + np.expm1(2 * eps) * np.abs(np.asarray(v, np.float64)).max() + 1e-5
  assert np.all(np.abs(o - r) <= bound), np.max(np.abs(o - r) - bound)
  assert np.all(np.abs(np.asarray(lse) - np.asarray(r_lse)) <= eps + 1e-5)


# ------------------------------------------------------------------------------------------------------------
# cuDNN backend: the real call, lowered for CUDA on the CPU (JAX's own shape / layout checks run; cuDNN does not)
# ------------------------------------------------------------------------------------------------------------

@pytest.fixture
def cuda_lowering(monkeypatch):
  """Pretend cuDNN 9.10 on an sm_90 GPU for JAX's trace-time checks, so the call can be lowered for CUDA here."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
  monkeypatch.setattr(fa, "check_compute_capability", lambda capability: True)
  monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", lambda capability: False)


def _fmha_calls(t, h, dqk, dv, nseq, *, causal, scale, attend_one=None):
  avals = (jax.ShapeDtypeStruct((t, h, dqk), jnp.bfloat16), jax.ShapeDtypeStruct((t, h, dqk), jnp.bfloat16),
           jax.ShapeDtypeStruct((t, h, dv), jnp.bfloat16), jax.ShapeDtypeStruct((nseq + 1,), jnp.int32),
           jax.ShapeDtypeStruct((), jnp.float32))
  fn = jax.jit(lambda q, k, v, cu, s: pf._cudnn_jit(q, k, v, cu, s, causal=causal, scale=scale,
                                                    attend_one=attend_one))
  hlo = fn.trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
  return [line for line in hlo.splitlines() if "custom_call @__cudnn$fmha" in line]


@pytest.mark.parametrize("t,h,dqk,dv,nseq,causal", [(64, 4, 192, 128, 3, True), (48, 2, 256, 256, 1, False)])
def test_cudnn_call_lowers_for_cuda(cuda_lowering, t, h, dqk, dv, nseq, causal):
  calls = _fmha_calls(t, h, dqk, dv, nseq, causal=causal, scale=0.125)
  m = max(nseq, 2)
  assert len(calls) == 2                                     # one per lax.cond branch
  for c in calls:
    assert "custom_call @__cudnn$fmhaSoftmax(" in c           # forward with softmax statistics, no bias/dropout
    assert f"max_seg_per_batch\\22: {m}" in c                  # packed layout, M segments
    assert ("PADDING_CAUSAL" if causal else "PADDING\\22") in c
    assert "fmha_scale\\22: 0.125" in c
    qkv = f"tensor<1x{t}x{h}x{dqk}xbf16>"                     # v zero-padded to Dqk
    assert f"({qkv}, {qkv}, {qkv}, tensor<1x{m}xi32>, tensor<1x{m}xi32>, tensor<1x{m + 1}xi32>, " \
           f"tensor<1x{m + 1}xi32>) -> (tensor<1x{h}x{t}x{dqk}xbf16>, tensor<{m}x{h}x{t}xf32>" in c


@pytest.mark.parametrize("causal", [True, False])
def test_cudnn_context_calls_lower_for_cuda(cuda_lowering, causal):
  """Separate keys: q [1, Tq] and k, v [1, Tk] in one packed call per part; causal: a PADDING call (context) and
  a PADDING_CAUSAL call (the last n keys) in each lax.cond branch; non-causal: one PADDING call."""
  tq, tk, h, dqk, dv, nseq = 48, 80, 2, 64, 32, 3
  avals = (jax.ShapeDtypeStruct((tq, h, dqk), jnp.bfloat16), jax.ShapeDtypeStruct((tk, h, dqk), jnp.bfloat16),
           jax.ShapeDtypeStruct((tk, h, dv), jnp.bfloat16), jax.ShapeDtypeStruct((nseq + 1,), jnp.int32),
           jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((nseq + 1,), jnp.int32))
  fn = jax.jit(lambda q, k, v, cu, s, cu_k: pf._cudnn_jit(q, k, v, cu, s, causal=causal, scale=0.125,
                                                          cu_seqlens_k=cu_k))
  text = fn.trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
  calls = [ln for ln in text.splitlines() if "__cudnn$fmha" in ln and "custom_call" in ln]
  assert len(calls) == (4 if causal else 2)                     # per part, one per lax.cond branch
  masks = sorted("PADDING_CAUSAL" if "PADDING_CAUSAL" in c else "PADDING" for c in calls)
  assert masks == (["PADDING"] * 2 + ["PADDING_CAUSAL"] * 2 if causal else ["PADDING"] * 2)
  qt, kt = f"tensor<1x{tq}x{h}x{dqk}xbf16>", f"tensor<1x{tk}x{h}x{dqk}xbf16>"   # v zero-padded to Dqk
  for c in calls:
    assert f"({qt}, {kt}, {kt}, tensor<1x{nseq}xi32>, tensor<1x{nseq}xi32>, tensor<1x{nseq + 1}xi32>, " \
           f"tensor<1x{nseq + 1}xi32>) -> (tensor<1x{h}x{tq}x{dqk}xbf16>, tensor<{nseq}x{h}x{tq}xf32>" in c


def test_cudnn_call_traced_scale_folds_into_q(cuda_lowering):
  calls = _fmha_calls(32, 2, 64, 64, 2, causal=True, scale=None)
  assert len(calls) == 2 and all("fmha_scale\\22: 1.0" in c for c in calls)


@pytest.mark.parametrize("causal", [True, False])
def test_one_sequence_call_lowers_for_cuda(cuda_lowering, causal):
  """B = 1 with MLA head dims: the clean branch is one non-packed call on the unpadded v (output [.., Dv]), the
  general branch the packed call on the padded v."""
  t, h, dqk, dv = 64, 4, 192, 128
  calls = _fmha_calls(t, h, dqk, dv, 1, causal=causal, scale=0.125, attend_one=pf._cudnn_attend_one)
  assert len(calls) == 2
  one = [c for c in calls if "max_seg_per_batch\\22: 1" in c or "max_seg_per_batch" not in c]
  packed = [c for c in calls if "max_seg_per_batch\\22: 2" in c]
  assert len(one) == 1 and len(packed) == 1, calls
  q = f"tensor<1x{t}x{h}x{dqk}xbf16>"
  assert f"({q}, {q}, tensor<1x{t}x{h}x{dv}xbf16>) -> (tensor<1x{h}x{t}x{dv}xbf16>, tensor<1x{h}x{t}xf32>" \
      in one[0], one[0]
  assert ("CAUSAL" if causal else "NO_MASK") in one[0] and "PADDING" not in one[0]
