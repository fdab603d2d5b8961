"""MLAAttention (mla_pallas.layer) on the CPU: init / to_fp8, and prefill followed by decode steps against the float32
reference layer (mla_pallas.layer.reference_prefill / reference_decode).

Tolerances (see also tests/test_graph.py):
* layer vs its own reference (same weights): the attention ops round q and P to e4m3 (fp8_error_budget terms); the
  layer keeps q/kv projections in bf16 where the reference keeps f32 (2^-8 relative, small next to 2^-4).
* FP8 layer vs the reference of the bf16 layer it came from: in addition every FP8 GEMM rounds its weight (block
  scales) and its activation (per token) to e4m3: two independent relative errors of RMS r8 = 2^-4/sqrt(3) per
  product term -> a relative error ~ sqrt(2) r8 = 0.051 of the GEMM output for generic data. The query goes
  through 3 GEMMs (W_q_a, W_q_b, W_uk), the key/value latent through 1 (W_kv_a), the output through 2 (W_uv,
  W_o); query/key errors act on the logits (times logit_std), the rest on the output 1:1. RMS^2 =
  logit_std^2 (3 + 1) g^2 + 3 g^2 + r8^2 (logit_std^2 + 1) with g = 0.051, times the safety factor 3 (0.71 at
  logit_std 2; measured ~0.10 rel-L2, cosine ~0.994 on these shapes, so the cosine bound 0.98 is the sharper check).
* logit_std: 2.0 bounds the logits' std at the plain scale qk_head_dim^-0.5 (q576 ~N(0, 1), RMS-normed rows:
  sqrt(576 / qk_head_dim) = 1.73 / 1.5); YaRN's softmax factor (x1.874 for DeepSeek-V3.2) multiplies it.
"""
from __future__ import annotations

import dataclasses

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas import layer as L, quant, reference, testing
from mla_pallas.config import deepseek_v32, glm5

CFGS = {
    "glm5": glm5().replace(num_heads=8, hidden_size=256, q_lora_rank=128, index_topk=64, page_size=16),
    "deepseek_v32": deepseek_v32().replace(num_heads=8, hidden_size=256, q_lora_rank=128, index_topk=64,
                                           page_size=16),
}
R8 = 2.0 ** -4 / math.sqrt(3)


def _logit_std(cfg):
  return 2.0 * cfg.softmax_scale * cfg.qk_head_dim ** 0.5     # 2.0 times YaRN's softmax factor (1 for plain rope)


def _same_weights_budget(cfg, ctx):
  return testing.fp8_error_budget(split_partials_bf16=True, logit_std=_logit_std(cfg), pv_length=ctx, fp8_mma=False)


def _fp8_vs_bf16_budget(cfg):
  g, ls = math.sqrt(2) * R8, _logit_std(cfg)
  rms2 = ls ** 2 * 4 * g ** 2 + 3 * g ** 2 + R8 ** 2 * (ls ** 2 + 1)
  return 3 * math.sqrt(rms2)


@pytest.mark.parametrize("preset", list(CFGS))
def test_init_shapes_and_fp8_round_trip(key, preset):
  cfg = CFGS[preset]
  lay = L.MLAAttention.init(key, cfg)
  h, nope, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
  assert lay.w_q_a.shape == (256, 128) and lay.w_q_b.shape == (h, 128, nope + 64)
  assert lay.w_kv_a.shape == (256, 576) and lay.w_uk.shape == (h, nope, 512) and lay.w_uv.shape == (h, 512, v)
  assert lay.w_o.shape == (h, v, 256) and lay.num_heads == h and not lay.fp8
  l8 = lay.to_fp8()
  assert l8.fp8 and l8.w_uk.dtype == quant.FP8 and l8.w_uk_scale.shape == (h, -(-nope // 128), 4)
  # stored K-major (the FP8 matmul kernel's layout); matrix() gives the table's layout
  assert l8.kernel_layout and l8.w_uk.shape == (h, 512, nope) and l8.matrix("w_uk").shape == (h, nope, 512)
  assert l8.w_q_a.shape == (128, 256) and l8.matrix("w_q_a").shape == (256, 128) and lay.matrix("w_q_a") is lay.w_q_a
  assert l8.to_fp8() is l8
  back = l8.dequantized()
  assert not back.kernel_layout
  for name in ("w_q_a", "w_q_b", "w_kv_a", "w_uk", "w_uv", "w_o"):
    a = np.asarray(getattr(lay, name), np.float64)
    b = np.asarray(getattr(back, name), np.float64)
    # e4m3 round to nearest: |err| <= 2^-4 |w| (normal range) + 2^-10 * block scale (subnormals) + bf16 rounding
    scale = np.asarray(quant.expand_block_scales(getattr(l8, name + "_scale"), a.shape))
    assert np.all(np.abs(a - b) <= 2.0 ** -4 * np.abs(a) * (1 + 2.0 ** -7) + 2.0 ** -10 * scale + 2.0 ** -8 * np.abs(b))
    rel = np.linalg.norm(a - b) / np.linalg.norm(a)
    assert rel < 1.5 * R8, (name, rel)
  # pytree: cfg and fp8 are static metadata; None fields are empty subtrees
  leaves = jax.tree_util.tree_leaves(l8)
  assert len(leaves) == 8 + 6
  no_lora = L.MLAAttention.init(key, cfg.replace(q_lora_rank=None))
  assert no_lora.w_q_a is None and no_lora.w_q_b.shape == (h, 256, nope + 64)


def _prefill_inputs(key, cfg, lens):
  cu = jnp.asarray(np.r_[0, np.cumsum(lens)], jnp.int32)
  pos = jnp.asarray(np.concatenate([np.arange(n) for n in lens]), jnp.int32)
  x = jax.random.normal(key, (int(sum(lens)), cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
  return x, pos, cu


def test_kernel_layout_changes_no_bits(key):
  """The FP8 layer stored K-major (to_fp8's default: no weight transposed per call) computes bitwise what the same
  FP8 weights stored [.., K, N] compute (weight_layout "hkn", one transpose per matmul), prefill and decode."""
  cfg = CFGS["glm5"]
  k0, k1, k2, k3 = jax.random.split(key, 4)
  l8 = L.MLAAttention.init(k0, cfg).to_fp8()
  kn = dataclasses.replace(l8, kernel_layout=False,
                           **{n: l8.matrix(n) for n in ("w_q_a", "w_q_b", "w_kv_a", "w_uk", "w_uv", "w_o")})
  x, pos, cu = _prefill_inputs(k1, cfg, [5, 11])
  xd = jax.random.normal(k2, (2, 1, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
  outs = []
  for lay in (l8, kn):
    cache = L.PagedCache.create(cfg, 2, 64, shuffle_key=k3)
    y, cache = lay.prefill(x, pos, cache, cu)
    yd, cache = lay.decode(xd, cache.seq_lens[:, None], cache)
    outs.append((y, yd, cache.pages))
  for a, b in zip(*outs):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("preset,fp8", [("glm5", True), ("deepseek_v32", False), ("deepseek_v32", True)])
def test_prefill_then_decode_matches_reference(key, preset, fp8):
  cfg = CFGS[preset]
  k0, k1, k2, k3 = jax.random.split(key, 4)
  lay16 = L.MLAAttention.init(k0, cfg)
  lay = lay16.to_fp8() if fp8 else lay16
  cos, sin = cfg.rope_tables(256)   # YaRN tables for DeepSeek-V3.2, plain (theta 1e6) for GLM-5
  lens = [9, 20]
  cache = L.PagedCache.create(cfg, 2, 64, shuffle_key=k3)
  ref_cache = ref16_cache = cache
  x, pos, cu = _prefill_inputs(k1, cfg, lens)
  steps = []
  ref_y, ref_cache = L.reference_prefill(lay, x, pos, ref_cache, cu, cos=cos, sin=sin)
  ref16_y, ref16_cache = L.reference_prefill(lay16, x, pos, ref16_cache, cu, cos=cos, sin=sin)
  y, cache = lay.prefill(x, pos, jax.tree.map(jnp.copy, cache), cu, cos=cos, sin=sin)
  steps.append(("prefill", y, ref_y, ref16_y, max(lens)))
  np.testing.assert_array_equal(np.asarray(cache.seq_lens), lens)
  for i, kk in enumerate(jax.random.split(k2, 2)):
    xd = jax.random.normal(kk, (2, 1, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    p = cache.seq_lens[:, None]
    kw = {}
    if i == 1:   # the second step: sparse attention over a causal top-k of each sequence (incl. the new token)
      topk = 16
      rng = np.random.default_rng(int(jax.random.randint(kk, (), 0, 2**31 - 1)))
      lens_now = np.asarray(cache.seq_lens) + 1
      tok = np.stack([np.r_[n - 1, rng.integers(0, n - 1, topk - 1)] for n in lens_now])
      from mla_pallas import cache as mcache
      kw = dict(indices=mcache.slots_for_positions(cache.block_table, jnp.asarray(tok[:, None], jnp.int32), 16))
    ref_yd, ref_cache = L.reference_decode(lay, xd, p, ref_cache, cos=cos, sin=sin, **kw)
    ref16_yd, ref16_cache = L.reference_decode(lay16, xd, p, ref16_cache, cos=cos, sin=sin, **kw)
    yd, cache = lay.decode(xd, p, cache, cos=cos, sin=sin, **kw)
    steps.append((f"decode {i}", yd, ref_yd, ref16_yd, 64))
  np.testing.assert_array_equal(np.asarray(cache.seq_lens), np.asarray(lens) + 2)
  # the FP8 cache holds the same bits as the reference layer's (fused write of the same kv rows; the layer's kv
  # projection is bf16, the reference's f32, so compare the dequantized rows loosely)
  a = np.asarray(cache.pages, np.float32)
  b = np.asarray(ref_cache.pages, np.float32)
  assert np.linalg.norm(a - b) / np.linalg.norm(b) < 2 * R8
  for name, got, want, want16, ctx in steps:
    assert got.dtype == jnp.bfloat16 and got.shape == want.shape
    testing.assert_close_fp8(got, want, rel_l2=_same_weights_budget(cfg, ctx), min_cos=0.97,
                             what=f"{name} vs ref")
    if fp8:
      testing.assert_close_fp8(got, want16, rel_l2=_fp8_vs_bf16_budget(cfg), min_cos=0.98,
                               what=f"{name} fp8 layer vs bf16 reference")


@pytest.mark.parametrize("preset,fp8,cache_dtype", [("deepseek_v32", True, quant.FP8),
                                                     ("glm5", False, jnp.bfloat16)])
def test_chunked_prefill_through_the_layer(key, preset, fp8, cache_dtype):
  """Two prompts (23 and 14 tokens) prefilled in one call, and in three calls of chunks (the layer continues each
  sequence from cache.seq_lens): the same cache bits, and outputs equal up to rounding (bitwise on the CPU). Error
  model for the GPU: the chunked attention differs from the one call by bf16 roundings (cuDNN's context split,
  tests/test_graph.py::test_chunked_prefill_equals_one_call); an FP8 layer then re-quantizes the attention output
  to e4m3 before W_o, where a bf16 change (2^-8) crosses an e4m3 rounding boundary (ulp ~2^-3.5 relative) with
  probability ~2^-8 / 2^-3.5 ~ 0.045 per changed element and moves it by ~2^-3.5: RMS ~0.088 sqrt(0.045 / 2)
  ~ 0.013 relative; asserted rel-L2 <= 2^-5. Each chunked call also matches the reference layer over the same
  cache (same budget as the one-call prefill)."""
  cfg = CFGS[preset]
  k0, k1, k3 = jax.random.split(key, 3)
  lay = L.MLAAttention.init(k0, cfg)
  lay = lay.to_fp8() if fp8 else lay
  cos, sin = cfg.rope_tables(256)
  lens = [23, 14]
  cache0 = L.PagedCache.create(cfg, 2, 64, shuffle_key=k3, dtype=cache_dtype)
  x, pos, cu = _prefill_inputs(k1, cfg, lens)
  whole, whole_cache = lay.prefill(x, pos, jax.tree.map(jnp.copy, cache0), cu, cos=cos, sin=sin)
  cache = jax.tree.map(jnp.copy, cache0)
  got = np.zeros(whole.shape, np.float32)
  done = [0, 0]
  for chunk in ((7, 4), (16, 1), (0, 9)):                   # a sequence with no new tokens in the last call
    rows = np.concatenate([np.arange(done[b], done[b] + chunk[b]) + (0, lens[0])[b] for b in range(2)])
    cu_c = jnp.asarray([0, chunk[0], chunk[0] + chunk[1]], jnp.int32)
    ref_y, _ = L.reference_prefill(lay, x[rows], pos[rows], cache, cu_c, cos=cos, sin=sin)
    y, cache = lay.prefill(x[rows], pos[rows], cache, cu_c, cos=cos, sin=sin)
    testing.assert_close_fp8(y, ref_y, rel_l2=_same_weights_budget(cfg, 64), min_cos=0.97, what=f"chunk {chunk}")
    got[rows] = np.asarray(y, np.float32)
    done = [done[b] + chunk[b] for b in range(2)]
  np.testing.assert_array_equal(np.asarray(cache.seq_lens), lens)
  np.testing.assert_array_equal(np.asarray(cache.pages).view(np.uint8), np.asarray(whole_cache.pages).view(np.uint8))
  want = np.asarray(whole, np.float32)
  assert np.linalg.norm(got - want) <= 2.0 ** -5 * np.linalg.norm(want)


def test_layer_key_budget():
  """max_keys of the dense prefill: explicit wins; concrete lengths give the next power of two of cached + new
  tokens (capped at the capacity B * pages * page_size); traced ones the capacity."""
  cfg = CFGS["glm5"]
  cache = L.PagedCache.create(cfg, 2, 64)                   # capacity 2 * 4 * 16 = 128
  cu = jnp.asarray([0, 5, 9], jnp.int32)
  assert L._key_budget(cache, cu, 77) == 77
  assert L._key_budget(cache, cu, None) == 16
  assert L._key_budget(cache.replace(seq_lens=jnp.asarray([30, 20], jnp.int32)), cu, None) == 64
  assert L._key_budget(cache.replace(seq_lens=jnp.asarray([60, 60], jnp.int32)), cu, None) == 128
  assert jax.jit(lambda c, u: jnp.int32(L._key_budget(c, u, None)))(cache, cu) == 128


def _bf16_layer_budget(cfg):
  """A bf16 layer on a bf16 cache against its float32 reference (same weights; the reference's projections in
  f32): every bf16 rounding has RMS 2^-8/sqrt(3) relative. On the logits (times logit_std): the query's three
  projections and q576, the kv projection (the cached rows differ by its rounding), the un-absorbed k_nope in
  prefill: 6. On the output (1:1): P, the attention output, v or w_uv's output, w_o's output, the kv rounding in
  V: 5. Times the safety factor 3 (0.064 / 0.036 for DeepSeek-V3.2 / GLM-5: BF16 end to end, where the same
  layer on an FP8 cache is held to fp8_error_budget, ~0.2)."""
  return 3 * math.sqrt(6 * _logit_std(cfg) ** 2 + 5) * 2.0 ** -8 / math.sqrt(3)


@pytest.mark.parametrize("preset", list(CFGS))
def test_bf16_layer_on_a_bf16_cache(key, preset):
  """MLAAttention in BF16 with PagedCache.create(dtype=bfloat16): prefill, a dense and a sparse decode step against
  the float32 reference layer within the bf16 error model; an FP8 layer refuses the bf16 cache."""
  cfg = CFGS[preset]
  k0, k1, k2, k3 = jax.random.split(key, 4)
  lay = L.MLAAttention.init(k0, cfg)
  cos, sin = cfg.rope_tables(256)
  cache = L.PagedCache.create(cfg, 2, 64, shuffle_key=k3, dtype=jnp.bfloat16)
  assert cache.pages.dtype == jnp.bfloat16 and float(cache.kv_scale) == 1.0
  lens = [9, 20]
  x, pos, cu = _prefill_inputs(k1, cfg, lens)
  ref_y, ref_cache = L.reference_prefill(lay, x, pos, cache, cu, cos=cos, sin=sin)
  y, cache = lay.prefill(x, pos, jax.tree.map(jnp.copy, cache), cu, cos=cos, sin=sin)
  steps = [("prefill", y, ref_y)]
  from mla_pallas import cache as mcache
  for i, kk in enumerate(jax.random.split(k2, 2)):
    xd = jax.random.normal(kk, (2, 1, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    p = cache.seq_lens[:, None]
    kw = {}
    if i == 1:     # sparse: the new token and 7 earlier positions of each sequence
      rng = np.random.default_rng(i)
      n = np.asarray(cache.seq_lens) + 1
      tok = np.stack([np.r_[m - 1, rng.integers(0, m - 1, 7)] for m in n])
      kw = dict(indices=mcache.slots_for_positions(cache.block_table, jnp.asarray(tok[:, None], jnp.int32), 16))
    ref_yd, ref_cache = L.reference_decode(lay, xd, p, ref_cache, cos=cos, sin=sin, **kw)
    yd, cache = lay.decode(xd, p, cache, cos=cos, sin=sin, **kw)
    steps.append((f"decode {i}", yd, ref_yd))
  assert cache.pages.dtype == jnp.bfloat16
  for name, got, want in steps:
    testing.assert_close_fp8(got, want, rel_l2=_bf16_layer_budget(cfg), min_cos=0.999, what=f"{name} (bf16 cache)")
  xd = jnp.zeros((2, 1, cfg.hidden_size), jnp.bfloat16)
  with pytest.raises(ValueError, match="pages must have dtype float8_e4m3fn"):
    lay.to_fp8().decode(xd, cache.seq_lens[:, None], cache, cos=cos, sin=sin)


def test_from_checkpoint_splits_heads_like_the_unabsorbed_math(rng):
  cfg = CFGS["deepseek_v32"]
  h, nope, v, hid, ql = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.hidden_size, cfg.q_lora_rank
  f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
  w_q_b, w_kv_b, w_o = f32(ql, h * (nope + 64)), f32(512, h * (nope + v)), f32(h * v, hid)
  lay = L.MLAAttention.from_checkpoint(cfg, w_q_a=f32(hid, ql), q_a_norm=f32(ql), w_q_b=w_q_b,
                                       w_kv_a=f32(hid, 576), kv_a_norm=f32(512), w_kv_b=w_kv_b, w_o=w_o)
  qa, c, o = f32(3, ql), f32(3, 512), f32(3, h, v)
  hi = jax.lax.Precision.HIGHEST
  np.testing.assert_allclose(np.asarray(jnp.einsum("tk,hkn->thn", qa, lay.w_q_b, precision=hi)),
                             np.asarray(jnp.dot(qa, w_q_b, precision=hi)).reshape(3, h, nope + 64), rtol=1e-5, atol=1e-4)
  w_kv_b16 = w_kv_b.astype(jnp.bfloat16).astype(jnp.float32)   # w_uk / w_uv are stored in bf16
  kv_full = np.asarray(jnp.dot(c, w_kv_b16, precision=hi)).reshape(3, h, nope + v)
  w_uk = lay.w_uk.astype(jnp.float32)
  np.testing.assert_allclose(np.asarray(jnp.einsum("tc,hnc->thn", c, w_uk, precision=hi)), kv_full[..., :nope],
                             rtol=1e-5, atol=1e-3)
  np.testing.assert_allclose(np.asarray(jnp.einsum("tc,hcv->thv", c, lay.w_uv.astype(jnp.float32), precision=hi)),
                             kv_full[..., nope:], rtol=1e-5, atol=1e-3)
  np.testing.assert_allclose(np.asarray(jnp.einsum("thv,hvd->td", o, lay.w_o, precision=hi)),
                             np.asarray(jnp.dot(o.reshape(3, h * v), w_o, precision=hi)), rtol=1e-5, atol=1e-3)


# ----------------------------------------------------------------------------------------------------------
# the layer against the published model code (float64), YaRN included
# ----------------------------------------------------------------------------------------------------------

try:
  from tests import _np_oracle as o
except ImportError:  # tests/ itself on sys.path
  import _np_oracle as o

# The published softmax scales, written out: DeepSeek-V3.2 qk_head_dim^-0.5 * (0.1 * mscale_all_dim * ln 40 + 1)^2
# (HF modeling_deepseek / inference/model.py), GLM-5 qk_head_dim^-0.5 (modeling_glm_moe_dsa: no rope scaling).
PUBLISHED_SCALE = {"deepseek_v32": 192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, "glm5": 256 ** -0.5}


def _published_prefill(w, x, cfg, softmax_scale, kv_scale):
  """DeepSeek-V3.2's MLA forward (inference/model.py, MHA prefill branch; GLM-MoE-DSA's is the same math) in
  float64 for one causal sequence at positions 0..T-1: q_a -> RMSNorm(eps 1e-6) -> q_b, kv_a -> RMSNorm(eps 1e-6)
  of the latent, interleaved rope on q_pe / k_pe with the config's tables (checked against the published YaRN
  formulas in tests/test_yarn.py), kv_b expansion, causal softmax, o_proj. The one addition is this library's FP8
  cache: the latent and k_pe are rounded to e4m3 at kv_scale before they are used (as the layer reads them)."""
  t = x.shape[0]
  h, nope, rope, vd, r = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
  w = {k: o.f64(v) for k, v in w.items()}
  x, pos = o.f64(x), np.arange(t)
  cos, sin = (np.asarray(a, np.float64) for a in cfg.rope_tables(t))
  q = (o.rms_norm(x @ w["q_a_proj"].T, w["q_a_layernorm"], 1e-6) @ w["q_b_proj"].T).reshape(t, h, nope + rope)
  q = np.concatenate([q[..., :nope], o.rope_interleaved_complex(q[..., nope:], pos, cos, sin)], axis=-1)
  kv = x @ w["kv_a_proj_with_mqa"].T
  c = o.quantize(o.rms_norm(kv[:, :r], w["kv_a_layernorm"], 1e-6), kv_scale) * kv_scale
  k_pe = o.quantize(o.rope_interleaved_complex(kv[:, r:], pos, cos, sin), kv_scale) * kv_scale
  kvb = (c @ w["kv_b_proj"].T).reshape(t, h, nope + vd)
  k = np.concatenate([kvb[..., :nope], np.broadcast_to(k_pe[:, None], (t, h, rope))], axis=-1)
  out, _ = o.varlen_attention(q, k, kvb[..., nope:], [0, t], softmax_scale, causal=True)
  return out.reshape(t, h * vd) @ w["o_proj"].T


@pytest.mark.parametrize("preset", list(CFGS))
def test_layer_agrees_with_the_published_model_code(rng, preset):
  """Error model: the checkpoint is bf16 (as published), so the layer's bf16 copies of W_kv_b are exact; the
  float32 reference rounds its attention output to bf16 (reference.mla_prefill returns bf16): a relative error of
  RMS 2^-8 / sqrt(3) * sqrt(E[1/m^2], m in [1, 2)) = 1.6e-3 per element, which o_proj carries 1:1 into y's
  rel-L2 (measured 1.6e-3 / 1.7e-3); float32 arithmetic (~1e-6) and the rare latent element whose float32 and
  float64 values round to different e4m3 neighbours add far less. Bound: 3x the RMS, 4.8e-3. The same model with
  the plain scale qk_head_dim^-0.5 (no YaRN mscale) must miss by far (measured 0.46 rel-L2; bound 0.1): the
  check can fail."""
  from mla_pallas import checkpoint
  cfg = CFGS[preset]
  w = {m: (1.0 + 0.1 * rng.standard_normal(s) if len(s) == 1 else rng.standard_normal(s) / math.sqrt(s[1]))
       .astype(jnp.bfloat16) for m, s in checkpoint.hf_attention_shapes(cfg).items()}
  lay = checkpoint.load_hf_attention(cfg, {"model.layers.0.self_attn." + m + ".weight": v for m, v in w.items()},
                                     dtype=jnp.float32)
  t = 24
  x = jnp.asarray(rng.standard_normal((t, cfg.hidden_size)), jnp.bfloat16)
  cache = L.PagedCache.create(cfg, 1, 32)
  y, _ = L.reference_prefill(lay, x, jnp.arange(t, dtype=jnp.int32), cache, jnp.asarray([0, t], jnp.int32))
  kv_scale = float(cache.kv_scale)
  want = _published_prefill(w, x, cfg, PUBLISHED_SCALE[preset], kv_scale)
  rel = np.linalg.norm(np.asarray(y, np.float64) - want) / np.linalg.norm(want)
  assert rel < 3 * 1.6e-3, rel
  if cfg.rope_scaling is not None:
    plain = _published_prefill(w, x, cfg, cfg.qk_head_dim ** -0.5, kv_scale)
    assert np.linalg.norm(np.asarray(y, np.float64) - plain) / np.linalg.norm(plain) > 0.1


def test_default_rope_tables_are_the_configs(key):
  cfg = CFGS["deepseek_v32"]
  lay = L.MLAAttention.init(key, cfg)
  cache = L.PagedCache.create(cfg, 1, 32)
  x = jax.random.normal(key, (5, cfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
  pos, cu = jnp.arange(5, dtype=jnp.int32), jnp.asarray([0, 5], jnp.int32)
  y0, _ = L.reference_prefill(lay, x, pos, cache, cu)
  cos, sin = lay.rope_tables(32)            # capacity: 2 pages of 16
  y1, _ = L.reference_prefill(lay, x, pos, cache, cu, cos=cos, sin=sin)
  np.testing.assert_array_equal(np.asarray(y0), np.asarray(y1))
  p_cos, p_sin = reference.rope_tables(32, 64, cfg.rope_theta)
  y2, _ = L.reference_prefill(lay, x, pos, cache, cu, cos=p_cos, sin=p_sin)
  assert not np.array_equal(np.asarray(y0), np.asarray(y2))
  with pytest.raises(ValueError, match="cos and sin must be given together"):
    L.reference_prefill(lay, x, pos, cache, cu, cos=cos)
