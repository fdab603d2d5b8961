"""The split-KV merge inside W_UV's FP8 bmm (``ops.bmm_fp8.merge_quantize_and_bmm_fp8``, the producer's
``kernels.bmm_row_quant.merge_rows``) and the decode graph's use of it, on the CPU.

The merging kernel is raw PTX (``inline_mgpu``): interpret mode cannot run it, so here the op runs its fallback
(:func:`mla_pallas.ops.sparse_decode.combine_splits`, bf16, ``quantize_and_bmm_fp8``: the unfused graph's
computation, so the graph's bits do not change where the kernel cannot run), the kernel is checked by sm_90
lowering with instruction counts, and its numbers on the GPU (tests/test_merge_bmm_gpu.py).
"""
from __future__ import annotations

import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas import graph, quant, reference, testing
from mla_pallas.kernels import bmm_fp8 as kbmm, bmm_row_quant
from mla_pallas.ops import bmm_fp8 as bmm_mod, sparse_decode as sd

FP8 = jnp.float8_e4m3fn
S = jax.ShapeDtypeStruct


def make_partials(rng, t, h, splits, k=512):
  """Partials [T · ceil(H/64), S, 64, K] f32 and lse [.., S, 64] as the attention kernel leaves them: finite
  outputs, lse spread over ~±6 with empty splits (−inf, output 0), one row with every split empty; the padding
  rows of a tile (H < 64) are NaN (never read)."""
  tpt = -(-h // 64)
  parts = rng.standard_normal((t * tpt, splits, 64, k)).astype(np.float32)
  lse = (3.0 * rng.standard_normal((t * tpt, splits, 64))).astype(np.float32)
  empty = rng.random(lse.shape) < 0.2
  lse[empty] = -np.inf
  parts[empty] = 0.0
  lse[0, :, min(h, 64) - 1] = -np.inf                          # every split empty: a = 0
  parts[0, :, min(h, 64) - 1] = 0.0
  if h < 64:
    parts[:, :, h:] = np.nan
    lse[:, :, h:] = np.nan
  return jnp.asarray(parts), jnp.asarray(lse)


def merged_reference(parts, lse, h):
  """The merge in float64 (numpy), as [T, H, K] float32."""
  p, l = np.asarray(parts, np.float64), np.asarray(lse, np.float64)
  m = l.max(axis=1, keepdims=True)
  m = np.where(np.isneginf(m), 0.0, m)
  w = np.exp(l - m)
  tot = w.sum(axis=1)
  a = (w[..., None] * np.where(w[..., None] > 0, p, 0.0)).sum(axis=1) / np.where(tot == 0, 1.0, tot)[..., None]
  tiles = a.shape[0]
  t = tiles // -(-h // 64)
  return a.reshape(t, -1, a.shape[-1])[:, :h].astype(np.float32)


def weights(rng, h, k=512, n=128):
  w8, ws = quant.quantize_blocks_fp8(jnp.asarray(0.05 * rng.standard_normal((h, k, n)), jnp.float32))
  return w8, bmm_mod.prepare_weight(w8), ws


@pytest.mark.parametrize("t,h,splits", [(1, 128, 32), (3, 64, 7), (2, 32, 5)])
def test_fallback_is_the_unfused_computation(rng, t, h, splits):
  """Where the merging kernel cannot run (here: the CPU, and interpret mode) the op is combine_splits, the bf16
  cast and quantize_and_bmm_fp8: bitwise that chain, and within the bmm's error model of the float64 merge
  (the bf16 rounding of a moves its e4m3 rounding: ~2^-9 relative, a fraction of the e4m3 step)."""
  parts, lse = make_partials(rng, t, h, splits)
  w8, wt, ws = weights(rng, h)
  # the interpret-mode leg at H 64 and 32 only: at H 128 it ran the same kernel path at twice the heads (~60 s of
  # the CPU suite)
  legs = (("xla", False), ("auto", False)) + ((("mosaic", True),) if h <= 64 else ())
  for impl, interpret in legs:
    out = bmm_mod.merge_quantize_and_bmm_fp8(parts, lse, wt, ws, heads=h, impl=impl, interpret=interpret)
    o, _ = sd.combine_splits(parts, lse)
    a = o.reshape(t, -1, 512)[:, :h].astype(jnp.bfloat16)
    want = bmm_mod.quantize_and_bmm_fp8(a, wt, ws, weight_layout="hnk", impl=impl, interpret=interpret)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(want).view(np.uint16))
  ref = reference.quantize_and_bmm_fp8(jnp.asarray(merged_reference(parts, lse, h)), w8, ws)
  assert not np.isnan(np.asarray(out, np.float32)).any()
  np.testing.assert_array_equal(np.asarray(out, np.float32)[0, min(h, 64) - 1], 0.0)   # the all-empty row
  testing.assert_close_fp8(out, ref, rel_l2=0.02, min_cos=0.999, what="fallback vs the float64 merge")


def test_bad_inputs_raise_value_error(rng):
  parts, lse = make_partials(rng, 1, 128, 4)
  _, wt, ws = weights(rng, 128)
  f = bmm_mod.merge_quantize_and_bmm_fp8
  with pytest.raises(ValueError, match="parts"):
    f(parts.astype(jnp.bfloat16), lse, wt, ws, heads=128)
  with pytest.raises(ValueError, match="parts"):
    f(parts, lse, wt, ws, heads=192)                   # 2 tiles do not hold T tokens of 3 tiles
  with pytest.raises(ValueError, match="lse"):
    f(parts, lse[:, :3], wt, ws, heads=128)
  with pytest.raises(ValueError, match="w must"):
    f(parts, lse, wt[:64], ws, heads=128)
  with pytest.raises(ValueError, match="w_scale"):
    f(parts, lse, wt, ws[:, :2], heads=128)
  with pytest.raises(NotImplementedError):             # the CPU has no Mosaic GPU: no kernel, fused or plain
    f(parts, lse, wt, ws, heads=128, impl="mosaic")


def test_merge_runs_where_it_was_measured_faster():
  """The producer merges only where it needs at most MERGE_MAX_ROUNDS load rounds (the step A/B on the H200:
  faster at 2-4 rounds, slower at 8)."""
  assert bmm_row_quant.merge_rounds(1, 32) == (2, 8) and bmm_row_quant.merge_rounds(8, 16) == (8, 8)
  assert bmm_mod._merge_is_faster(1, 32) and bmm_mod._merge_is_faster(2, 16) and bmm_mod._merge_is_faster(8, 8)
  assert bmm_mod._merge_is_faster(4, 16) and not bmm_mod._merge_is_faster(8, 16)


def test_merge_config_and_support():
  cfg = bmm_mod.merge_config(1, 512, 128, 128)
  assert cfg.a_quant == "producer" and cfg.stages == 512 // kbmm.CHUNK
  with pytest.raises(NotImplementedError, match="producer"):
    bmm_mod.merge_config(64, 512, 128, 128)            # beyond the producer design: the op merges in XLA
  with pytest.raises(NotImplementedError, match="a_quant='producer'"):
    kbmm.build(1, 128, 512, 128, True, bmm_mod.default_config(1, 512, 128, 128, tuning=(("a_quant", "smem"),)),
               merge=(4, 2))
  with pytest.raises(NotImplementedError, match="interpret"):
    kbmm.build(1, 128, 512, 128, True, cfg, interpret=True, merge=(4, 2))


@pytest.mark.parametrize("t,h,splits", [(1, 128, 32), (2, 128, 16), (3, 64, 7), (8, 128, 4), (16, 128, 2)])
def test_merging_kernel_lowers_for_sm90(t, h, splits):
  """The producer's merge (raw PTX) lowers, in the layout bmm_row_quant.merge_rounds picks: warps sharing each row
  (each weighs ceil(S / 4) partials, one exp each; sums met behind a warpgroup barrier; one warp quantizes the
  row: 8 paired e4m3 conversions, one 16-byte swizzled store) or a warp per row (all S partials; one quantization
  per round of 4 rows); the wgmmas read A from SMEM."""
  k, n = 512, 128
  cfg = bmm_mod.merge_config(t, k, n, h)
  tpt = -(-h // 64)
  fn = lambda p, l, w, s: kbmm.build(t, h, k, n, True, cfg, merge=(splits, tpt))(p, l, w, s)
  low = testing.lower_for_cuda(fn, S((t * tpt, splits, 64, k), jnp.float32), S((t * tpt, splits, 64), jnp.float32),
                               S((h, n, k), FP8), S((h, k // 128, n // 128), jnp.float32), arch=(9, 0))
  shared, per_warp = bmm_row_quant.merge_rounds(t, splits)
  if per_warp <= shared:
    rounds = -(-t // 4)
    assert low.count("math.exp") == rounds * splits
  else:
    rounds = t
    assert low.count("math.exp") == t * -(-splits // 4)
  assert (per_warp <= shared) == (t >= 3), (shared, per_warp)   # at these shapes
  assert low.count(r"st\.shared\.v4\.b32") == rounds
  assert low.count(r"cvt\.rn\.satfinite\.e4m3x2\.f32") == 8 * rounds
  wgmma = rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg.tile_n}k32\.f32\.e4m3\.e4m3 \{{[^}}]*\}}, \$\d+, \$\d+, p"
  assert low.count(wgmma) == low.count(r"wgmma\.mma_async") == cfg.sub_n * k // 32


def test_split_partials_where_the_twin_runs(rng):
  """split_partials gives the kernel's unmerged outputs only where sparse_mla_decode runs the heads-on-M "twin"
  with several splits (interpret mode here), and None elsewhere (XLA, heads on N, one split); merged, they are
  sparse_mla_decode's out bit for bit."""
  from tests._sparse_inputs import make_case
  c = make_case(rng, B=1, s_q=1, H=64, topk=256, num_pages=32)
  q, kv, idx = c.q, c.kv, c.indices
  kw = dict(softmax_scale=c.softmax_scale, kv_scale=c.kv_scale)
  assert sd.split_partials(q, kv, idx, **kw, impl="xla") is None
  assert sd.split_partials(q, kv, idx, **kw) is None                           # auto on the CPU: XLA
  c8 = make_case(rng, B=1, s_q=1, H=8, topk=256, num_pages=32)
  assert sd.split_partials(c8.q, c8.kv, c8.indices, **kw, impl="mosaic", interpret=True) is None   # heads on N
  parts = sd.split_partials(q, kv, idx, **kw, impl="mosaic", interpret=True)
  assert parts is not None
  p, lse = parts
  cfg = sd.default_config(64, 1, 256)
  assert p.shape == (1, cfg.num_splits, 64, 512) and p.dtype == jnp.float32 and lse.shape == p.shape[:3]
  out, _ = sd.sparse_mla_decode(q, kv, idx, **kw, impl="mosaic", interpret=True)
  o, _ = sd.combine_splits(p, lse)
  np.testing.assert_array_equal(np.asarray(o.reshape(out.shape).astype(jnp.bfloat16)).view(np.uint16),
                                np.asarray(out).view(np.uint16))


def test_decode_graph_merges_in_w_uv_where_partials_exist(rng):
  """The FP8 decode branch with the twin's split partials (H 64, B 1) takes split_partials and the merging W_UV
  op; where the kernel cannot run (interpret mode) that is the unfused computation, so the output is bitwise the
  graph with split_partials disabled. batch_invariant keeps the op's own merge."""
  import tests.test_graph as tg
  cfg = tg.CFGS["deepseek_v32"].replace(num_heads=64, index_topk=128)
  w = tg._weights(rng, cfg, True)
  pages, kv_scale, case, kw = tg._decode_case(rng, cfg, sparse=True, B=1, s_q=1)
  impl = {"sparse_mla_decode": "mosaic", "default": "xla"}
  run = lambda **extra: graph.mla_decode_branch_fp8(w, jnp.array(pages, copy=True), kv_scale, **case, cfg=cfg, **kw,
                                                    impl=impl, interpret=True, **extra)[0]
  out = run()
  steps = [s["step"] for s in graph.graph_report()["steps"]]
  assert "merge splits + o_latent @ w_uv" in steps, steps
  jax.clear_caches()   # the graph's jit would reuse the trace above
  with unittest.mock.patch.object(graph, "split_partials", lambda *a, **k: None):
    plain = run()
  assert "o_latent @ w_uv" in [s["step"] for s in graph.graph_report()["steps"]]
  np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(plain).view(np.uint16))
  run(batch_invariant=True)
  assert "merge splits + o_latent @ w_uv" not in [s["step"] for s in graph.graph_report()["steps"]]


