"""MLA graphs (mla_pallas.graph) on the CPU: every branch, FP8 and BF16 weights, against the float32 reference graph.

Error model (tolerances). The graph and its oracle (:func:`mla_pallas.graph.reference_decode_branch` etc.) use the
same weights and the same cache format, so the weight quantization cancels; what differs:

* cache write: the fused op's XLA path is bitwise the reference -> the new pages must be bitwise equal.
* FP8 BMMs (``quantize_and_bmm_fp8``): both sides quantize the activation per token with the same formula and use
  the same FP8 weights; the op multiplies FP8 operands (products exact in f32), the reference the dequantized
  values in f32 -> equal up to f32 summation order; both round to bf16.
* absorbed attention (``sparse_mla_decode`` / ``dense_mla_decode``): the ops round q (per row) and P to e4m3, the
  reference does not: the terms of :func:`mla_pallas.testing.fp8_error_budget` (q_fp8 ~ 0.036 * logit_std,
  p_fp8 ~ 0.036, bf16 output), ``fp8_mma=False`` (XLA on the CPU upcasts the fp8 operands: exact products).
  The graph's q576 rope part is bf16, the reference's f32 (2^-8 relative, well below the q_fp8 term).
* the output BMM re-quantizes the attention output per token: an input perturbation d moves the e4m3 rounding by
  ~d on average, so the relative error carries through the linear map ~1:1 (random weights), plus one bf16
  rounding (covered by the safety factor 3 of the budget).
* dense prefill (not absorbed): no q/P quantization (``mla_prefill`` is f32 math on bf16 inputs on the CPU); the
  graph's Q/K rope parts and V are bf16 roundings of the reference's f32 values: RMS ~ 2^-8/sqrt(3) per rounded
  operand, times logit_std for Q/K -> budget 3 * sqrt((2 * logit_std)^2 + 2) * 2^-8/sqrt(3) (< 0.03 here). On a
  CUDA GPU ``mla_prefill`` runs cuDNN flash attention, which also rounds P to bf16 before P.V: one more rounded
  operand of the same RMS, so the 2 under the root becomes 3.
"""
from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas import cache as mcache, graph, quant, testing
from mla_pallas.config import deepseek_v32, glm5

FP8 = jnp.float8_e4m3fn
PAGE = 16
CFGS = {
    "glm5": glm5().replace(num_heads=8, hidden_size=256, q_lora_rank=128, index_topk=64, page_size=PAGE),
    "deepseek_v32": deepseek_v32().replace(num_heads=8, hidden_size=256, q_lora_rank=128, index_topk=64,
                                           page_size=PAGE),
}
# Logit std of these inputs: q576 entries ~N(0, 1) (q_latent = q_nope @ w_uk with w_uk ~ N(0, 1/nope)), cache rows
# RMS-normed to ~1, softmax_scale = (nope + 64)^-0.5 -> std ~ sqrt(576 / (nope + 64)) = 1.5 (GLM-5), 1.73
# (DeepSeek-V3.2); 2.0 is an upper estimate, times YaRN's softmax factor mscale^2 where the preset has rope scaling
# (cfg.softmax_scale * (nope + 64)^0.5: 1 for GLM-5, 1.874 for DeepSeek-V3.2).
def _logit_std(cfg):
  return 2.0 * cfg.softmax_scale * cfg.qk_head_dim ** 0.5


def _weights(rng, cfg, fp8):
  h, nope, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
  w_uk = rng.standard_normal((h, nope, 512)) / math.sqrt(nope)
  w_uv = rng.standard_normal((h, 512, v)) / math.sqrt(512)
  norm = 1.0 + 0.1 * rng.standard_normal(512)
  w = graph.MLAWeightsBF16(jnp.asarray(w_uk, jnp.bfloat16), jnp.asarray(w_uv, jnp.bfloat16),
                           jnp.asarray(norm, jnp.bfloat16))
  return w.to_fp8() if fp8 else w


def _bf16(rng, *shape, scale=1.0):
  return jnp.asarray(scale * rng.standard_normal(shape), jnp.bfloat16)


def _poisoned_cache(rng, num_pages, written_slots, kv_scale, dtype=FP8):
  """Cache of ``dtype`` (FP8 or bf16): random rows at ``written_slots``, NaN everywhere else."""
  rows = np.full((num_pages * PAGE, 576), np.nan, np.float32)
  rows[written_slots] = rng.standard_normal((len(written_slots), 576))
  return quant.encode_cache_rows(jnp.asarray(rows), kv_scale, dtype).reshape(num_pages, PAGE, 576)


def _bits(pages):
  """The pages' bytes, one row of 576 entries per line."""
  return np.asarray(pages).view(np.uint8).reshape(-1, 576 * jnp.dtype(pages.dtype).itemsize)


def _check_pages(new, want, old, slots):
  """new == want bitwise; rows differ from old only at ``slots`` (NaN-poisoned rows elsewhere stay NaN)."""
  nb, wb, ob = (_bits(x) for x in (new, want, old))
  np.testing.assert_array_equal(nb, wb)
  slots = np.asarray(slots).reshape(-1)
  slots = slots[slots >= 0]
  others = np.setdiff1d(np.arange(nb.shape[0]), slots)
  np.testing.assert_array_equal(nb[others], ob[others])
  assert not np.isnan(np.asarray(new, np.float32).reshape(-1, 576)[slots]).any()


def _attention_budget(pv_length, cfg):
  return testing.fp8_error_budget(
      split_partials_bf16=True, logit_std=_logit_std(cfg), pv_length=pv_length, fp8_mma=False)


def _bf16_budget(cfg, rounded=3):
  """BF16 end to end (bf16 weights and cache) against the float32 reference on the same weights and cache rows:
  the cache rows are exact on both sides; the graph rounds q576 (the q_latent einsum's output and the rope part)
  to bf16, which moves the logits by ~logit_std · 2^-8/sqrt(3), and ``rounded`` operands of the output path to
  bf16 (RMS 2^-8/sqrt(3) each, passing ~1:1 to the output): P (BF16 attention), the attention output, the
  w_uv einsum's output. Times the safety factor 3 (0.028 / 0.021 for DeepSeek-V3.2 / GLM-5 here)."""
  return 3 * math.sqrt(_logit_std(cfg) ** 2 + rounded) * 2.0 ** -8 / math.sqrt(3)


def _prefill_budget(cfg):
  rounded = 3 if jax.default_backend() == "gpu" else 2     # + P in bf16 under cuDNN (module docstring)
  return 3 * math.sqrt((2 * _logit_std(cfg)) ** 2 + rounded) * 2.0 ** -8 / math.sqrt(3)


def _check_report(expect_attention_op, interpret_attention=False):
  rep = graph.graph_report()
  assert rep is not None
  for s in rep["steps"]:
    if interpret_attention and s["op"] == expect_attention_op:   # "mosaic-interpret" or with its kernel named
      assert s["impl"].split(" (")[0] == "mosaic-interpret", graph.format_report(rep)
    elif jax.default_backend() == "cpu":
      assert s["impl"] == "xla", graph.format_report(rep)
  assert expect_attention_op in [s["op"] for s in rep["steps"]], graph.format_report(rep)
  return rep


# ----------------------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------------------

def _decode_case(rng, cfg, *, B=2, s_q=2, sparse, num_pages=12, kv_scale=0.05, cache_dtype=FP8):
  h, nope = cfg.num_heads, cfg.qk_nope_head_dim
  max_pages = 4
  perm = rng.permutation(num_pages)[:B * max_pages].reshape(B, max_pages)
  block_table = jnp.asarray(perm, jnp.int32)
  prev = rng.integers(8, max_pages * PAGE - s_q, size=B)
  new_lens = prev + s_q
  ctx_pos = [np.arange(p) for p in prev]
  ctx_slots = np.concatenate([perm[b, ps // PAGE] * PAGE + ps % PAGE for b, ps in enumerate(ctx_pos)])
  pages = _poisoned_cache(rng, num_pages, ctx_slots, kv_scale, cache_dtype)
  positions = jnp.asarray(prev[:, None] + np.arange(s_q)[None], jnp.int32)        # [B, s_q]
  slots = mcache.slots_for_positions(block_table, positions, PAGE)
  cos, sin = cfg.rope_tables(512)
  case = dict(q_nope=_bf16(rng, B, s_q, h, nope), q_rope=_bf16(rng, B, s_q, h, 64), kv=_bf16(rng, B, s_q, 576),
              positions=positions, slots=slots, cos=cos, sin=sin)
  kw = {}
  if sparse:
    topk = cfg.index_topk
    # causal top-k positions of each new token (some -1), then slots
    lim = prev[:, None] + np.arange(s_q)[None] + 1                                   # [B, s_q]
    pos = (rng.random((B, s_q, topk)) * lim[..., None]).astype(np.int32)
    pos[..., -3:] = -1
    pos[:, :, 0] = lim - 1                                                            # the token itself
    idx = mcache.slots_for_positions(block_table, jnp.asarray(pos), PAGE)
    kw = dict(indices=idx)
  else:
    kw = dict(block_table=block_table, cache_seqlens=jnp.asarray(new_lens, jnp.int32))
  return pages, kv_scale, case, kw


@pytest.mark.parametrize("preset", list(CFGS))
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_decode_branch_matches_reference(rng, preset, fp8, sparse):
  cfg = CFGS[preset]
  w = _weights(rng, cfg, fp8)
  pages, kv_scale, case, kw = _decode_case(rng, cfg, sparse=sparse)
  old = jnp.array(pages, copy=True)
  ref_out, ref_pages = graph.reference_decode_branch(w, old, kv_scale, **case, cfg=cfg, **kw)
  fn = graph.mla_decode_branch_fp8 if fp8 else graph.mla_decode_branch_bf16
  out, new_pages = fn(w, pages, kv_scale, **case, cfg=cfg, impl="auto", **kw)
  assert out.shape == case["q_nope"].shape[:3] + (cfg.v_head_dim,) and out.dtype == jnp.bfloat16
  _check_pages(new_pages, ref_pages, old, case["slots"])
  pv = kw["indices"].shape[-1] if sparse else int(kw["block_table"].shape[1] * PAGE)
  testing.assert_close_fp8(out, ref_out, rel_l2=_attention_budget(pv, cfg), min_cos=0.97, what="decode out")
  rep = _check_report("sparse_mla_decode" if sparse else "dense_mla_decode")
  assert rep["branch"] == "decode" and rep["variant"] == ("fp8" if fp8 else "bf16")
  ops = [s["op"] for s in rep["steps"]]
  assert ops[0] == "fused_rope_rmsnorm_quantization"
  assert ops.count("quantize_and_bmm_fp8") == (2 if fp8 else 0)


def test_decode_branch_under_outer_jit_and_donation(rng):
  cfg = CFGS["glm5"]
  w = _weights(rng, cfg, True)
  pages, kv_scale, case, kw = _decode_case(rng, cfg, sparse=True, B=1, s_q=1)
  ref_out, _ = graph.reference_decode_branch(w, jnp.array(pages, copy=True), kv_scale, **case, cfg=cfg, **kw)

  @jax.jit
  def f(w, pages, case, kw):
    return graph.mla_decode_branch_fp8(w, pages, kv_scale, **case, cfg=cfg, impl="xla", **kw)

  out, _ = f(w, pages, case, kw)
  testing.assert_close_fp8(out, ref_out, rel_l2=_attention_budget(64, cfg), what="decode out (outer jit)")
  assert graph.graph_report()["graph"] == "mla_decode_branch_fp8"
  # the standalone graph donates the cache
  pages2, _, case2, kw2 = _decode_case(rng, cfg, sparse=True, B=1, s_q=1)
  graph.mla_decode_branch_fp8(w, pages2, kv_scale, **case2, cfg=cfg, **kw2)
  assert pages2.is_deleted()


def test_decode_branch_unique_slots(rng):
  """unique_slots=True (the caller promises distinct slots: skips the duplicate-slot scan) writes the same cache and
  returns the same output as the default for distinct slots; a non-bool is a ValueError naming it."""
  cfg = CFGS["glm5"]
  w = _weights(rng, cfg, True)
  pages, kv_scale, case, kw = _decode_case(rng, cfg, sparse=True)
  outs = [graph.mla_decode_branch_fp8(w, jnp.array(pages, copy=True), kv_scale, **case, cfg=cfg, impl="xla",
                                      unique_slots=u, **kw) for u in (False, True)]
  np.testing.assert_array_equal(np.asarray(outs[0][0], np.float32), np.asarray(outs[1][0], np.float32))
  np.testing.assert_array_equal(_bits(outs[0][1]), _bits(outs[1][1]))
  with pytest.raises(ValueError, match="unique_slots"):
    graph.mla_decode_branch_fp8(w, pages, kv_scale, **case, cfg=cfg, impl="xla", unique_slots="yes", **kw)


def test_wrong_weights_and_missing_attention_inputs(rng):
  cfg = CFGS["glm5"]
  w = _weights(rng, cfg, False)
  pages, kv_scale, case, kw = _decode_case(rng, cfg, sparse=True, B=1, s_q=1)
  with pytest.raises(ValueError, match="MLAWeightsFP8"):
    graph.mla_decode_branch_fp8(w, pages, kv_scale, **case, cfg=cfg, **kw)
  with pytest.raises(ValueError, match="block_table"):
    graph.mla_decode_branch_bf16(w, pages, kv_scale, **case, cfg=cfg)


# ----------------------------------------------------------------------------------------------------------
# prefill
# ----------------------------------------------------------------------------------------------------------

def _prefill_case(rng, cfg, *, lens=(5, 11), num_pages=10, kv_scale=0.05, pad=2, sparse=False, cache_dtype=FP8):
  h, nope = cfg.num_heads, cfg.qk_nope_head_dim
  B = len(lens)
  max_pages = 2
  perm = rng.permutation(num_pages)[:B * max_pages].reshape(B, max_pages)
  pages = _poisoned_cache(rng, num_pages, np.zeros(0, np.int64), kv_scale, cache_dtype)        # all NaN
  positions = np.concatenate([np.arange(n) for n in lens] + [np.zeros(pad, np.int64)]).astype(np.int32)
  seq = np.concatenate([np.full(n, b) for b, n in enumerate(lens)] + [np.zeros(pad, np.int64)])
  slots = perm[seq, positions // PAGE] * PAGE + positions % PAGE
  slots[sum(lens):] = -1                                                           # padding tokens
  t = len(positions)
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  cos, sin = cfg.rope_tables(512)
  case = dict(q_nope=_bf16(rng, t, h, nope), q_rope=_bf16(rng, t, h, 64), kv=_bf16(rng, t, 576),
              positions=jnp.asarray(positions), slots=jnp.asarray(slots, jnp.int32), cos=cos, sin=sin)
  extra = dict(cu_seqlens=cu)
  if sparse:   # top-k among the token's own sequence prefix (causal), as slots
    topk = 8
    idx = np.full((t, topk), -1, np.int32)
    for i in range(sum(lens)):
      b, p = seq[i], positions[i]
      cand = rng.permutation(p + 1)[:topk]
      idx[i, :len(cand)] = perm[b, cand // PAGE] * PAGE + cand % PAGE
    extra = dict(indices=jnp.asarray(idx))
  return pages, kv_scale, case, extra, max(lens)


@pytest.mark.parametrize("preset", list(CFGS))
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_prefill_branch_matches_reference(rng, preset, fp8):
  cfg = CFGS[preset]
  w = _weights(rng, cfg, fp8)
  pages, kv_scale, case, extra, _ = _prefill_case(rng, cfg)
  old = jnp.array(pages, copy=True)
  ref_out, ref_pages = graph.reference_prefill_branch(w, old, kv_scale, **case, **extra, cfg=cfg)
  fn = graph.mla_prefill_branch_fp8 if fp8 else graph.mla_prefill_branch_bf16
  out, new_pages = fn(w, pages, kv_scale, **case, **extra, cfg=cfg)
  assert out.shape == (case["q_nope"].shape[0], cfg.num_heads, cfg.v_head_dim)
  _check_pages(new_pages, ref_pages, old, case["slots"])
  testing.assert_close_fp8(out, ref_out, rel_l2=_prefill_budget(cfg), min_cos=0.999, what="prefill out")
  assert np.all(np.asarray(out, np.float32)[-2:] == 0), "padding tokens (outside cu_seqlens) give 0"
  rep = _check_report("mla_prefill")
  assert rep["branch"] == "prefill"
  # head dim of the un-absorbed attention: nope + 64 (192 DeepSeek-V3.2, 256 GLM-5)
  assert cfg.qk_head_dim == {"glm5": 256, "deepseek_v32": 192}[preset]


# ----------------------------------------------------------------------------------------------------------
# dense prefill over cached context
# ----------------------------------------------------------------------------------------------------------

def _context_case(rng, cfg, *, ctx=(19, 0, 7), new=(6, 5, 1), max_pages=3, num_pages=12, kv_scale=0.05, pad=2,
                  cache_dtype=FP8):
  """Sequences that already hold ``ctx[b]`` tokens (random rows in the cache at their block-table slots, NaN in
  every other row) and bring ``new[b]`` tokens (+ ``pad`` padding tokens, slot -1) at positions ctx[b] + i."""
  h, nope = cfg.num_heads, cfg.qk_nope_head_dim
  B = len(ctx)
  table = rng.permutation(num_pages)[:B * max_pages].reshape(B, max_pages).astype(np.int32)
  slot = lambda b, p: table[b, p // PAGE] * PAGE + p % PAGE
  cached = [slot(b, p) for b in range(B) for p in range(ctx[b])]
  pages = _poisoned_cache(rng, num_pages, np.asarray(cached, np.int64), kv_scale, cache_dtype)
  seq = np.concatenate([np.full(n, b) for b, n in enumerate(new)]).astype(np.int64)
  positions = np.concatenate([ctx[b] + np.arange(n) for b, n in enumerate(new)] + [np.zeros(pad)]).astype(np.int32)
  slots = np.concatenate([[slot(b, p) for b, p in zip(seq, positions)], np.full(pad, -1)]).astype(np.int32)
  t = len(positions)
  cos, sin = cfg.rope_tables(512)
  case = dict(q_nope=_bf16(rng, t, h, nope), q_rope=_bf16(rng, t, h, 64), kv=_bf16(rng, t, 576),
              positions=jnp.asarray(positions), slots=jnp.asarray(slots), cos=cos, sin=sin)
  extra = dict(cu_seqlens=jnp.asarray(np.concatenate([[0], np.cumsum(new)]), jnp.int32),
               block_table=jnp.asarray(table), context_lens=jnp.asarray(ctx, jnp.int32))
  return pages, kv_scale, case, extra


@pytest.mark.parametrize("preset", list(CFGS))
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_prefill_over_cached_context_matches_reference(rng, preset, fp8):
  """New tokens attend their sequence's cached rows and themselves (bottom-right causal), read through the block
  table; the NaN rows of the cache (other sequences' pages, unwritten slots) are never read. Same error budget as
  the prefill without context (the keys are cache rows on both sides)."""
  cfg = CFGS[preset]
  w = _weights(rng, cfg, fp8)
  pages, kv_scale, case, extra = _context_case(rng, cfg, cache_dtype=FP8 if fp8 else jnp.bfloat16)
  old = jnp.array(pages, copy=True)
  ref_out, ref_pages = graph.reference_prefill_branch(w, old, kv_scale, **case, **extra, cfg=cfg)
  fn = graph.mla_prefill_branch_fp8 if fp8 else graph.mla_prefill_branch_bf16
  out, new_pages = fn(w, pages, kv_scale, **case, **extra, cfg=cfg)
  _check_pages(new_pages, ref_pages, old, case["slots"])
  o = np.asarray(out, np.float32)
  assert np.isfinite(o).all() and np.all(o[-2:] == 0), "padding tokens give 0; no NaN row of the cache is read"
  testing.assert_close_fp8(out, ref_out, rel_l2=_prefill_budget(cfg), min_cos=0.999, what="prefill out")
  rep = _check_report("mla_prefill")
  assert any("cached context" in s["step"] for s in rep["steps"]), graph.format_report(rep)
  # the context matters: without it (keys = the new tokens only) the output is a different one
  no_ctx, _ = graph.reference_prefill_branch(w, jnp.array(old, copy=True), kv_scale, **case,
                                             cu_seqlens=extra["cu_seqlens"], cfg=cfg)
  assert np.abs(np.asarray(no_ctx)[:6] - np.asarray(ref_out)[:6]).max() > 0.05


def _graph_prefill(fn, w, pages, kv_scale, case, rows, cfg, **kw):
  """fn on the tokens ``rows`` of ``case`` (a slice of the packed batch)."""
  sub = {k: (v if k in ("cos", "sin") else v[rows]) for k, v in case.items()}
  return fn(w, pages, kv_scale, **sub, cfg=cfg, **kw)


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_chunked_prefill_equals_one_call(rng, fp8):
  """Two prompts (13 and 21 tokens) prefilled in one call, and in three calls of chunks (5 + 9, 6 + 7, 2 + 5
  tokens) over the cache the earlier calls wrote: the same cache bits, and outputs that differ only in rounding
  (bitwise equal on the CPU). Error model for the GPU: the chunked calls' attention is cuDNN's context call plus
  its causal call, each rounded to bf16 (<= 2^-9 max|v| each, half an ulp) before the f32 merge, where the one
  call rounds once; an up-projected k or v element may also round the other way (2^-8 relative). With max|v| ~
  max|out| (a sequence's first token attends only itself) every element stays within 2^-6 of the largest, and
  with outputs ~3x smaller than v in RMS (tens of keys averaged) rel-L2 <= 2^-6."""
  cfg = CFGS["deepseek_v32"]
  w = _weights(rng, cfg, fp8)
  lens = (13, 21)
  pages0, kv_scale, case, extra = _context_case(rng, cfg, ctx=(0, 0), new=lens, pad=0,
                                                cache_dtype=FP8 if fp8 else jnp.bfloat16)
  fn = graph.mla_prefill_branch_fp8 if fp8 else graph.mla_prefill_branch_bf16
  table = extra["block_table"]
  whole, whole_pages = fn(w, jnp.array(pages0, copy=True), kv_scale, **case, **extra, cfg=cfg)
  pages = jnp.array(pages0, copy=True)
  done = [0, 0]
  got = np.zeros(np.shape(whole), np.float32)
  for chunk in ((5, 9), (6, 7), (2, 5)):
    rows = np.concatenate([np.arange(done[b], done[b] + chunk[b]) + (0, lens[0])[b] for b in range(2)])
    cu = jnp.asarray([0, chunk[0], chunk[0] + chunk[1]], jnp.int32)
    out, pages = _graph_prefill(fn, w, pages, kv_scale, case, rows, cfg, cu_seqlens=cu, block_table=table,
                                context_lens=jnp.asarray(done, jnp.int32))
    got[rows] = np.asarray(out, np.float32)
    done = [done[b] + chunk[b] for b in range(2)]
  np.testing.assert_array_equal(_bits(pages), _bits(whole_pages))
  want = np.asarray(whole, np.float32)
  assert np.linalg.norm(got - want) <= 2.0 ** -6 * np.linalg.norm(want)
  assert np.abs(got - want).max() <= 2.0 ** -6 * np.abs(want).max()


def test_prefill_context_missing_pages_and_overflow_are_nan(rng):
  """A key position whose page is not in the block table (-1, or an id past the cache) is never read: the outputs
  that attend it are NaN, the others exact. A key buffer too small for a sequence (max_keys) makes that sequence's
  outputs NaN; the sequences before it are unchanged."""
  cfg = CFGS["glm5"]
  w = _weights(rng, cfg, True)
  pages, kv_scale, case, extra = _context_case(rng, cfg, ctx=(19, 0, 7), new=(6, 5, 1))
  ok_out, _ = graph.mla_prefill_branch_fp8(w, jnp.array(pages, copy=True), kv_scale, **case, **extra, cfg=cfg)
  ok_out = np.asarray(ok_out, np.float32)
  table = np.asarray(extra["block_table"]).copy()
  table[0, 0] = -1                   # sequence 0's positions 0..15: every one of its queries sees them
  table[2, 0] = 99                   # sequence 2's page 0 (positions 0..6 cached): out of range
  out, _ = graph.mla_prefill_branch_fp8(w, jnp.array(pages, copy=True), kv_scale, **case,
                                        **{**extra, "block_table": jnp.asarray(table)}, cfg=cfg)
  o = np.asarray(out, np.float32)
  assert np.isnan(o[:6]).all() and np.isnan(o[11]).all()        # sequences 0 and 2
  np.testing.assert_array_equal(o[6:11], ok_out[6:11])           # sequence 1 (no context) unchanged
  assert np.all(o[12:] == 0)                                     # padding
  need = 19 + 6 + 0 + 5                                          # sequences 0 and 1 fit, sequence 2 does not
  out, _ = graph.mla_prefill_branch_fp8(w, jnp.array(pages, copy=True), kv_scale, **case, **extra, cfg=cfg,
                                        max_keys=need)
  o = np.asarray(out, np.float32)
  assert np.isnan(o[11]).all() and np.isfinite(o[:11]).all()
  np.testing.assert_allclose(o[:11], ok_out[:11], rtol=2.0 ** -7, atol=2.0 ** -6 * np.abs(ok_out).max())


def test_prefill_context_argument_errors(rng):
  cfg = CFGS["glm5"]
  w = _weights(rng, cfg, True)
  pages, kv_scale, case, extra = _context_case(rng, cfg)
  fn = graph.mla_prefill_branch_fp8
  cu, table, ctx = extra["cu_seqlens"], extra["block_table"], extra["context_lens"]
  _raises(ValueError, "mla_prefill_branch_fp8: prefill over cached context needs both .* got only block_table=",
          fn, w, pages, kv_scale, **case, cu_seqlens=cu, block_table=table, cfg=cfg)
  _raises(ValueError, "needs both .* got only context_lens=", fn, w, pages, kv_scale, **case, cu_seqlens=cu,
          context_lens=ctx, cfg=cfg)
  _raises(ValueError, r"block_table must have shape \[B=3, max_pages_per_seq\]", fn, w, pages, kv_scale, **case,
          cu_seqlens=cu, block_table=table[:2], context_lens=ctx, cfg=cfg)
  _raises(ValueError, r"context_lens must have shape \[B=3\]", fn, w, pages, kv_scale, **case, cu_seqlens=cu,
          block_table=table, context_lens=ctx[:2], cfg=cfg)
  _raises(ValueError, r"context_lens must be >= 0 .* \[19, -1, 7\]", fn, w, pages, kv_scale, **case,
          cu_seqlens=cu, block_table=table, context_lens=ctx.at[1].set(-1), cfg=cfg)
  _raises(ValueError, "max_keys= applies to prefill over cached context", fn, w, pages, kv_scale, **case,
          cu_seqlens=cu, max_keys=64, cfg=cfg)
  _raises(ValueError, "max_keys must be a positive int", fn, w, pages, kv_scale, **case, cu_seqlens=cu,
          block_table=table, context_lens=ctx, max_keys=0, cfg=cfg)
  _raises(ValueError, "reference_prefill_branch: prefill over cached context needs both",
          graph.reference_prefill_branch, w, pages, kv_scale, **case, cu_seqlens=cu, block_table=table, cfg=cfg)
  assert not pages.is_deleted()


def test_prefill_decode_graph_passes_the_context(rng):
  """mla_prefill_decode_graph's prefill branch reads block_table only with context_lens (else the block table is
  the decode branch's and ignored), and then equals the prefill branch called directly."""
  cfg = CFGS["glm5"]
  w = _weights(rng, cfg, True)
  pages, kv_scale, case, extra = _context_case(rng, cfg)
  want, _ = graph.mla_prefill_branch_fp8(w, jnp.array(pages, copy=True), kv_scale, **case, **extra, cfg=cfg)
  out, _ = graph.mla_prefill_decode_graph_fp8(w, jnp.array(pages, copy=True), kv_scale, **case, **extra, cfg=cfg,
                                              max_seqlen=6)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
  ref, _ = graph.reference_prefill_decode_graph(w, jnp.array(pages, copy=True), kv_scale, **case, **extra,
                                                cfg=cfg, max_seqlen=6)
  r2, _ = graph.reference_prefill_branch(w, jnp.array(pages, copy=True), kv_scale, **case, **extra, cfg=cfg)
  np.testing.assert_array_equal(np.asarray(ref), np.asarray(r2))
  no_ctx = {k: v for k, v in extra.items() if k != "context_lens"}
  plain, _ = graph.mla_prefill_decode_graph_fp8(w, jnp.array(pages, copy=True), kv_scale, **case, **no_ctx,
                                                cfg=cfg, max_seqlen=6)
  want_plain, _ = graph.mla_prefill_branch_fp8(w, jnp.array(pages, copy=True), kv_scale, **case,
                                               cu_seqlens=extra["cu_seqlens"], cfg=cfg)
  np.testing.assert_array_equal(np.asarray(plain, np.float32), np.asarray(want_plain, np.float32))


@pytest.mark.parametrize("preset", list(CFGS))
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_sparse_prefill_branch_matches_reference(rng, preset, fp8):
  cfg = CFGS[preset]
  w = _weights(rng, cfg, fp8)
  pages, kv_scale, case, extra, _ = _prefill_case(rng, cfg, sparse=True)
  old = jnp.array(pages, copy=True)
  ref_out, ref_pages = graph.reference_prefill_branch_sparse(w, old, kv_scale, **case, **extra, cfg=cfg)
  fn = graph.mla_prefill_branch_sparse_fp8 if fp8 else graph.mla_prefill_branch_sparse_bf16
  out, new_pages = fn(w, pages, kv_scale, **case, **extra, cfg=cfg)
  _check_pages(new_pages, ref_pages, old, case["slots"])
  testing.assert_close_fp8(out, ref_out, rel_l2=_attention_budget(8, cfg), min_cos=0.97, what="sparse prefill out")
  rep = _check_report("sparse_mla_prefill")
  assert rep["branch"] == "sparse_prefill"


@pytest.mark.parametrize("preset", list(CFGS))
@pytest.mark.parametrize("branch", ["decode_sparse", "decode_dense", "prefill", "sparse_prefill"])
def test_bf16_branches_with_bf16_cache(rng, preset, branch):
  """The BF16 branches on a bf16 cache: BF16 end to end (the cache write only rounds, attention keeps q and P in
  bf16), within the bf16 error model of the float32 reference (``_bf16_budget``; the FP8 cache's budget is ~4x
  larger), NaN-poisoned unused rows, invalid ids; the report names the cache dtype."""
  cfg = CFGS[preset]
  w = _weights(rng, cfg, False)
  if branch.startswith("decode"):
    pages, kv_scale, case, kw = _decode_case(rng, cfg, sparse=branch == "decode_sparse", kv_scale=0.5,
                                             cache_dtype=jnp.bfloat16)
    ref_fn, fn, op = graph.reference_decode_branch, graph.mla_decode_branch_bf16, (
        "sparse_mla_decode" if branch == "decode_sparse" else "dense_mla_decode")
  else:
    pages, kv_scale, case, kw, _ = _prefill_case(rng, cfg, sparse=branch == "sparse_prefill", kv_scale=0.5,
                                                 cache_dtype=jnp.bfloat16)
    ref_fn, fn, op = (graph.reference_prefill_branch_sparse, graph.mla_prefill_branch_sparse_bf16,
                      "sparse_mla_prefill") if branch == "sparse_prefill" else (
                          graph.reference_prefill_branch, graph.mla_prefill_branch_bf16, "mla_prefill")
  old = jnp.array(pages, copy=True)
  ref_out, ref_pages = ref_fn(w, old, kv_scale, **case, **kw, cfg=cfg)
  out, new_pages = fn(w, pages, kv_scale, **case, **kw, cfg=cfg)
  assert new_pages.dtype == jnp.bfloat16 and out.dtype == jnp.bfloat16
  _check_pages(new_pages, ref_pages, old, case["slots"])
  budget = _prefill_budget(cfg) if branch == "prefill" else _bf16_budget(cfg)
  testing.assert_close_fp8(out, ref_out, rel_l2=budget, min_cos=0.999, what=f"{branch} out (bf16 cache)")
  rep = _check_report(op)
  assert rep["cache_dtype"] == "bfloat16" and rep["variant"] == "bf16"
  assert rep["steps"][0]["step"] == "rmsnorm+rope+bf16 cache write"
  assert "bf16 cache" in graph.format_report(rep)


def test_fp8_branch_refuses_a_bf16_cache(rng):
  cfg = CFGS["glm5"]
  pages, kv_scale, case, kw = _decode_case(rng, cfg, sparse=True, cache_dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match=r"mla_decode_branch_fp8: pages must have dtype float8_e4m3fn"):
    graph.mla_decode_branch_fp8(_weights(rng, cfg, True), pages, kv_scale, **case, cfg=cfg, **kw)


# ----------------------------------------------------------------------------------------------------------
# prefill_decode_graph
# ----------------------------------------------------------------------------------------------------------

def test_choose_branch_is_static():
  assert graph.choose_branch(1) == "decode"
  assert graph.choose_branch(7) == "prefill"
  assert graph.choose_branch(7, sparse=True) == "sparse_prefill"
  with pytest.raises(ValueError, match="max_seqlen"):
    graph.choose_branch(0)
  with pytest.raises(ValueError, match="max_seqlen"):
    graph.choose_branch(jnp.int32(3))


@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_prefill_decode_graph_picks_branch(rng, fp8):
  cfg = CFGS["deepseek_v32"]
  w = _weights(rng, cfg, fp8)
  fn = graph.mla_prefill_decode_graph_fp8 if fp8 else graph.mla_prefill_decode_graph_bf16
  # prefill: max_seqlen 11 > 1
  pages, kv_scale, case, extra, max_len = _prefill_case(rng, cfg)
  ref_out, _ = graph.reference_prefill_decode_graph(w, jnp.array(pages, copy=True), kv_scale, **case, **extra,
                                                    cfg=cfg, max_seqlen=max_len)
  out, _ = fn(w, pages, kv_scale, **case, **extra, cfg=cfg, max_seqlen=max_len)
  rep = graph.graph_report()
  assert rep["branch"] == "prefill" and rep["graph"].startswith("mla_prefill_decode_graph")
  testing.assert_close_fp8(out, ref_out, rel_l2=_prefill_budget(cfg), what="pd graph prefill")
  # decode: one new token per sequence (B = T)
  pages, kv_scale, case, kw = _decode_case(rng, cfg, sparse=False, B=3, s_q=1)
  flat = {k: (v[:, 0] if k not in ("cos", "sin") else v) for k, v in case.items()}
  ref_out, _ = graph.reference_prefill_decode_graph(w, jnp.array(pages, copy=True), kv_scale, **flat, **kw,
                                                    cfg=cfg, max_seqlen=1)
  out, _ = fn(w, pages, kv_scale, **flat, **kw, cfg=cfg, max_seqlen=1)
  assert out.shape == (3, cfg.num_heads, cfg.v_head_dim)
  rep = graph.graph_report()
  assert rep["branch"] == "decode" and "dense_mla_decode" in [s["op"] for s in rep["steps"]]
  testing.assert_close_fp8(out, ref_out, rel_l2=_attention_budget(64, cfg), what="pd graph decode")


# ----------------------------------------------------------------------------------------------------------
# interpret mode: the attention kernel inside the graph
# ----------------------------------------------------------------------------------------------------------

def test_kernel_layout_weights_change_no_bits(rng):
  """MLAWeightsFP8 with w_uk_t / w_uv_t (to_fp8 adds them: the FP8 matmul kernel's [H, N, K] layout, no per-call
  weight transpose) gives bitwise the outputs and pages of the same weights without them (XLA path; the kernel's
  "hnk" layout against "hkn" is tests/test_bmm_fp8_kernel.py's); wrong kernel layouts raise before tracing."""
  import dataclasses
  cfg = CFGS["glm5"]
  w = _weights(rng, cfg, True)
  assert w.w_uk_t.shape == (cfg.num_heads, 512, cfg.qk_nope_head_dim) and w.w_uv_t.dtype == FP8
  plain = dataclasses.replace(w, w_uk_t=None, w_uv_t=None)
  pages, kv_scale, case, kw = _decode_case(rng, cfg, sparse=True, B=1, s_q=2)
  runs = [graph.mla_decode_branch_fp8(x, jnp.array(pages, copy=True), kv_scale, **case, cfg=cfg, **kw, impl="xla")
          for x in (w, plain)]
  (out, new), (out_p, new_p) = runs
  np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(out_p).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(new).view(np.uint8), np.asarray(new_p).view(np.uint8))
  bad = dataclasses.replace(w, w_uv_t=w.w_uk_t)
  with pytest.raises(ValueError, match=r"weights.w_uv_t .*with_kernel_layouts"):
    graph.mla_decode_branch_fp8(bad, pages, kv_scale, **case, cfg=cfg, **kw)


@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_decode_graph_runs_attention_kernel_in_interpret_mode(rng, sparse):
  """The attention op's kernel in interpret mode inside the graph; graph_report() names the dense op's kernel
  (8 heads, page 16 here: the sparse kernel's route)."""
  cfg = CFGS["glm5"]
  w = _weights(rng, cfg, True)
  pages, kv_scale, case, kw = _decode_case(rng, cfg, sparse=sparse, B=1, s_q=1)
  ref_out, _ = graph.reference_decode_branch(w, jnp.array(pages, copy=True), kv_scale, **case, cfg=cfg, **kw)
  op = "sparse_mla_decode" if sparse else "dense_mla_decode"
  t0 = time.perf_counter()
  out, _ = graph.mla_decode_branch_fp8(w, pages, kv_scale, **case, cfg=cfg, **kw,
                                       impl={op: "mosaic", "default": "xla"}, interpret=True)
  jax.block_until_ready(out)
  assert time.perf_counter() - t0 < 60
  rep = _check_report(op, interpret_attention=True)
  if not sparse:
    assert [s["impl"] for s in rep["steps"] if s["op"] == op] == ["mosaic-interpret (sparse kernel)"], rep
  pv = 64 if sparse else int(kw["block_table"].shape[1] * PAGE)
  testing.assert_close_fp8(out, ref_out, rel_l2=_attention_budget(pv, cfg), min_cos=0.97, what="interpret decode")


# ----------------------------------------------------------------------------------------------------------
# signatures and argument errors (raised before tracing: nothing compiles, nothing is donated)
# ----------------------------------------------------------------------------------------------------------

_DECODE_KW = ["indices", "topk_length", "block_table", "cache_seqlens"]
_CONTEXT_KW = ["block_table", "context_lens", "max_keys"]
_PD_KW = ["max_seqlen", "cu_seqlens", "block_table", "cache_seqlens", "indices", "topk_length", "context_lens",
          "max_keys"]
# public function -> (positional arguments after the ten tensors, keyword-only attention arguments)
SIGNATURES = {
    "mla_decode_branch_fp8": ([], _DECODE_KW), "mla_decode_branch_bf16": ([], _DECODE_KW),
    "reference_decode_branch": ([], _DECODE_KW),
    "mla_prefill_branch_fp8": (["cu_seqlens"], _CONTEXT_KW), "mla_prefill_branch_bf16": (["cu_seqlens"], _CONTEXT_KW),
    "reference_prefill_branch": (["cu_seqlens"], _CONTEXT_KW),
    "mla_prefill_branch_sparse_fp8": (["indices"], ["topk_length"]),
    "mla_prefill_branch_sparse_bf16": (["indices"], ["topk_length"]),
    "reference_prefill_branch_sparse": (["indices"], ["topk_length"]),
    "mla_prefill_decode_graph_fp8": ([], _PD_KW), "mla_prefill_decode_graph_bf16": ([], _PD_KW),
    "reference_prefill_decode_graph": ([], _PD_KW),
}
TENSORS = ["weights", "pages", "kv_scale", "q_nope", "q_rope", "kv", "positions", "slots", "cos", "sin"]


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_public_signatures_are_explicit(name):
  """Tensors positional, then keyword-only cfg (required), the attention choice and the options; no **kw."""
  import inspect
  P = inspect.Parameter
  params = inspect.signature(getattr(graph, name)).parameters
  kinds = {n: p.kind for n, p in params.items()}
  assert P.VAR_KEYWORD not in kinds.values() and P.VAR_POSITIONAL not in kinds.values()
  more, attention = SIGNATURES[name]
  assert [n for n, k in kinds.items() if k == P.POSITIONAL_OR_KEYWORD] == TENSORS + more
  assert kinds["cfg"] == P.KEYWORD_ONLY and params["cfg"].default is P.empty
  assert params["interleaved"].default is True
  for a in attention:
    assert kinds[a] == P.KEYWORD_ONLY, a
    assert params[a].default is (P.empty if a == "max_seqlen" else None), a
  if name.startswith("reference_"):   # the oracles have no implementations to choose
    assert not {"impl", "interpret", "unique_slots"} & set(params)
  else:
    assert params["impl"].default == "auto" and params["interpret"].default is False
    assert params["unique_slots"].default is False
  assert name in graph.__all__


def _error_case(rng, fp8=True):
  cfg = CFGS["glm5"]
  w = _weights(rng, cfg, fp8)
  pages, kv_scale, case, kw = _decode_case(rng, cfg, sparse=False, B=2, s_q=1)
  idx = jnp.zeros((2, 1, 4), jnp.int32)
  return cfg, w, pages, kv_scale, case, kw, idx


def _raises(exc, match, fn, *args, **kw):
  with pytest.raises(exc, match=match):
    fn(*args, **kw)


def test_decode_argument_errors_name_the_public_argument(rng):
  cfg, w, pages, kv_scale, case, dense, idx = _error_case(rng)
  f = graph.mla_decode_branch_fp8
  both = "mla_decode_branch_fp8: pass either indices= \\(sparse\\) or block_table= and cache_seqlens= \\(dense\\)"
  _raises(TypeError, "mla_decode_branch_fp8.*'cfg'", f, w, pages, kv_scale, **case, indices=idx)
  _raises(ValueError, both + "; got neither", f, w, pages, kv_scale, **case, cfg=cfg)
  _raises(ValueError, both + ", not both", f, w, pages, kv_scale, **case, cfg=cfg, indices=idx, **dense)
  _raises(ValueError, both + ", not both; got indices= and cache_seqlens=", f, w, pages, kv_scale, **case,
          cfg=cfg, indices=idx, cache_seqlens=dense["cache_seqlens"])
  _raises(ValueError, both + "; got block_table= without cache_seqlens=", f, w, pages, kv_scale, **case, cfg=cfg,
          block_table=dense["block_table"])
  _raises(ValueError, both + "; got cache_seqlens= without block_table=", f, w, pages, kv_scale, **case, cfg=cfg,
          cache_seqlens=dense["cache_seqlens"])
  _raises(ValueError, "mla_decode_branch_fp8: topk_length= applies to sparse attention only", f, w, pages,
          kv_scale, **case, cfg=cfg, topk_length=jnp.ones((2,), jnp.int32), **dense)
  _raises(ValueError, "mla_decode_branch_fp8: cfg must be an MLAConfig", f, w, pages, kv_scale, **case,
          cfg="glm5", indices=idx)
  _raises(ValueError, "mla_decode_branch_fp8: weights must be MLAWeightsFP8; got MLAWeightsBF16", f,
          _weights(rng, cfg, False), pages, kv_scale, **case, cfg=cfg, indices=idx)
  # cfg of another model (nope 128, the weights have 192)
  _raises(ValueError, r"mla_decode_branch_fp8: weights.w_uk must have shape \[H, nope=128", f, w, pages,
          kv_scale, **case, cfg=CFGS["deepseek_v32"], indices=idx)
  bad = {
      "q_nope": (case["q_nope"][:, :, :4], r"q_nope must have shape \[B, s_q, H=8, nope=192\]"),
      "q_rope": (case["q_rope"][0], r"q_rope must have shape \[B=2, s_q=1, H=8, 64\]"),
      "kv": (case["kv"][..., :512], r"kv must have shape \[B=2, s_q=1, 576\]"),
      "positions": (case["positions"].astype(jnp.float32), "positions must have dtype int32"),
      "slots": (case["slots"][:, 0], r"slots must have shape \[B=2, s_q=1\]"),
      "cos": (case["cos"][:, :16], r"cos must have shape \[max_pos, 32\]"),
  }
  for arg, (value, match) in bad.items():
    _raises(ValueError, "mla_decode_branch_fp8: " + match, f, w, pages, kv_scale, **{**case, arg: value}, cfg=cfg,
            indices=idx)
  _raises(ValueError, r"mla_decode_branch_fp8: indices must have shape \[B=2, s_q=1, topk\]", f, w, pages,
          kv_scale, **case, cfg=cfg, indices=idx[:, 0])
  _raises(ValueError, r"mla_decode_branch_fp8: topk_length must have shape \[B=2\]", f, w, pages, kv_scale,
          **case, cfg=cfg, indices=idx, topk_length=jnp.ones((3,), jnp.int32))
  _raises(ValueError, r"mla_decode_branch_fp8: block_table must have shape \[B=2, max_pages_per_seq\]", f, w,
          pages, kv_scale, **case, cfg=cfg, **{**dense, "block_table": dense["block_table"][:1]})
  _raises(ValueError, "mla_decode_branch_fp8: pages must have", f, w, pages.astype(jnp.bfloat16), kv_scale,
          **case, cfg=cfg, indices=idx)
  _raises(ValueError, "mla_decode_branch_fp8: kv_scale must be finite and > 0", f, w, pages, -1.0, **case, cfg=cfg,
          indices=idx)
  _raises(ValueError, "mla_decode_branch_fp8: interleaved must be a python bool", f, w, pages, kv_scale, **case,
          cfg=cfg, indices=idx, interleaved=1)
  # the oracle checks the same way, under its own name
  _raises(ValueError, "reference_decode_branch: pass either indices=", graph.reference_decode_branch, w, pages,
          kv_scale, **case, cfg=cfg, indices=idx, **dense)
  _raises(TypeError, "reference_decode_branch.*'cfg'", graph.reference_decode_branch, w, pages, kv_scale, **case,
          indices=idx)
  assert not pages.is_deleted(), "a call refused by its checks must not consume the cache"


def test_prefill_argument_errors_name_the_public_argument(rng):
  cfg = CFGS["glm5"]
  w = _weights(rng, cfg, False)
  pages, kv_scale, case, extra, max_len = _prefill_case(rng, cfg)
  cu = extra["cu_seqlens"]
  idx = jnp.zeros((case["q_nope"].shape[0], 4), jnp.int32)
  _raises(TypeError, "mla_prefill_branch_bf16.*'cfg'", graph.mla_prefill_branch_bf16, w, pages, kv_scale, **case,
          cu_seqlens=cu)
  _raises(ValueError, r"mla_prefill_branch_bf16: cu_seqlens must have dtype int32", graph.mla_prefill_branch_bf16,
          w, pages, kv_scale, **case, cu_seqlens=cu.astype(jnp.float32), cfg=cfg)
  _raises(ValueError, r"mla_prefill_branch_bf16: q_nope must have rank 3 with shape \[T, H=8, nope=192\]",
          graph.mla_prefill_branch_bf16, w, pages, kv_scale, **{**case, "q_nope": case["q_nope"][None]},
          cu_seqlens=cu, cfg=cfg)
  _raises(ValueError, r"mla_prefill_branch_sparse_bf16: indices must have shape \[T=18, topk\]",
          graph.mla_prefill_branch_sparse_bf16, w, pages, kv_scale, **case, indices=idx[:, 0], cfg=cfg)
  _raises(ValueError, r"mla_prefill_branch_sparse_bf16: topk_length must have shape \[T=18\]",
          graph.mla_prefill_branch_sparse_bf16, w, pages, kv_scale, **case, indices=idx, cfg=cfg,
          topk_length=jnp.ones((2,), jnp.int32))
  _raises(ValueError, "reference_prefill_branch_sparse: indices must have",
          graph.reference_prefill_branch_sparse, w, pages, kv_scale, **case, indices=idx[:, 0], cfg=cfg)
  pd = graph.mla_prefill_decode_graph_bf16
  _raises(TypeError, "mla_prefill_decode_graph_bf16.*'max_seqlen'", pd, w, pages, kv_scale, **case, cfg=cfg,
          cu_seqlens=cu)
  _raises(ValueError, "mla_prefill_decode_graph_bf16: the dense prefill branch .* needs cu_seqlens=", pd, w, pages,
          kv_scale, **case, cfg=cfg, max_seqlen=max_len)
  _raises(ValueError, "mla_prefill_decode_graph_bf16: the decode branch .* got neither", pd, w, pages, kv_scale,
          **case, cfg=cfg, max_seqlen=1, cu_seqlens=cu)
  _raises(ValueError, "mla_prefill_decode_graph_bf16: the decode branch .* got block_table=", pd, w, pages,
          kv_scale, **case, cfg=cfg, max_seqlen=1, block_table=jnp.zeros((18, 2), jnp.int32))
  _raises(ValueError, r"mla_prefill_decode_graph_bf16: cache_seqlens must have shape \[T=18\]", pd, w, pages,
          kv_scale, **case, cfg=cfg, max_seqlen=1, block_table=jnp.zeros((18, 2), jnp.int32),
          cache_seqlens=jnp.ones((2,), jnp.int32))
  _raises(ValueError, "mla_prefill_decode_graph_bf16: topk_length= applies to sparse attention only", pd, w, pages,
          kv_scale, **case, cfg=cfg, max_seqlen=max_len, cu_seqlens=cu, topk_length=jnp.ones((18,), jnp.int32))
  _raises(ValueError, "mla_prefill_decode_graph_bf16: max_seqlen must be a positive python int", pd, w, pages,
          kv_scale, **case, cfg=cfg, max_seqlen=0, cu_seqlens=cu)
  _raises(ValueError, "reference_prefill_decode_graph: the dense prefill branch",
          graph.reference_prefill_decode_graph, w, pages, kv_scale, **case, cfg=cfg, max_seqlen=max_len)
  assert not pages.is_deleted()


def test_prefill_decode_graph_ignores_arrays_the_branch_does_not_read(rng):
  """One call site for both phases: with indices= the decode branch is sparse even when the dense arrays (and
  cu_seqlens) are passed too, and equals the sparse decode branch called directly."""
  cfg = CFGS["glm5"]
  w = _weights(rng, cfg, True)
  pages, kv_scale, case, kw = _decode_case(rng, cfg, sparse=True, B=2, s_q=1)
  _, _, _, dense = _decode_case(rng, cfg, sparse=False, B=2, s_q=1)
  flat = {k: (v[:, 0] if k not in ("cos", "sin") else v) for k, v in case.items()}
  want, _ = graph.mla_decode_branch_fp8(w, jnp.array(pages, copy=True), kv_scale, **case, cfg=cfg, impl="xla", **kw)
  out, _ = graph.mla_prefill_decode_graph_fp8(w, pages, kv_scale, **flat, cfg=cfg, max_seqlen=1, impl="xla",
                                              indices=kw["indices"][:, 0], cu_seqlens=jnp.arange(3, dtype=jnp.int32),
                                              **dense)
  rep = graph.graph_report()
  assert rep["branch"] == "decode" and "sparse_mla_decode" in [s["op"] for s in rep["steps"]]
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want[:, 0], np.float32))
