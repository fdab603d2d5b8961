"""The split-KV merge inside W_UV's FP8 bmm on a Hopper GPU (sm_90a): the producer's raw-PTX merge
(``kernels.bmm_row_quant.merge_rows``) against the float64 merge, and the decode graph that uses it against the
reference graph.

Error model. The kernel merges in float32 (exp, weighted sums over 4 warps, one division) and quantizes that
float32 row per (token, head) like the reference quantizes the float64 merge rounded to float32: the e4m3 bytes
differ only where the ~1e-7 relative difference of the two merges crosses an e4m3 rounding boundary (rare, one
e4m3 step of one value). The rest is tests/test_bmm_fp8_kernel_gpu.py's model (Hopper's fp8 wgmma accumulation,
the output's bf16 rounding): its tolerance holds. The graph against its reference: tests/test_graph.py's budget
(the merged rows skip the unfused path's bf16 rounding, which only removes an error term).
"""
from __future__ import annotations

import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas import _dispatch, graph, reference, testing
from mla_pallas.ops import bmm_fp8 as bmm_mod
from tests.test_bmm_fp8_kernel_gpu import _tolerance
from tests.test_merge_bmm import make_partials, merged_reference, weights

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

OP = "quantize_and_bmm_fp8"


@pytest.mark.parametrize("t,h,splits", [(1, 128, 32), (2, 128, 16), (4, 64, 7), (16, 128, 3), (3, 32, 5),
                                        (1, 64, 64)])
def test_merging_kernel_matches_reference(rng, t, h, splits):
  """Odd split counts (warps with fewer splits), 64 splits (two lse loads per lane), H 32 (NaN padding rows of the
  tile never read), an all-empty row (a = 0), 16 tokens (four rows per warp, both sum buffers reused)."""
  parts, lse = make_partials(rng, t, h, splits)
  w8, wt, ws = weights(rng, h)
  out = bmm_mod.merge_quantize_and_bmm_fp8(parts, lse, wt, ws, heads=h, impl="mosaic")
  assert _dispatch.last_impl(OP) == "mosaic"
  again = bmm_mod.merge_quantize_and_bmm_fp8(parts, lse, wt, ws, heads=h, impl="mosaic")
  np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(again).view(np.uint16))
  want = reference.quantize_and_bmm_fp8(jnp.asarray(merged_reference(parts, lse, h)), w8, ws)
  assert not np.isnan(np.asarray(out, np.float32)).any()
  np.testing.assert_array_equal(np.asarray(out, np.float32)[0, min(h, 64) - 1], 0.0)
  testing.assert_close_fp8(out, want, rel_l2=_tolerance(), min_cos=0.9999, what="merging kernel")


@pytest.mark.parametrize("b,s_q,h", [(1, 1, 128), (2, 2, 128), (1, 1, 64)])
def test_decode_graph_with_the_merging_kernel(rng, b, s_q, h):
  """The FP8 decode branch where the attention kernel leaves split partials: W_UV merges them (the report says
  so), within the graph's budget of the reference graph, and close to the graph with the op's XLA merge."""
  import tests.test_graph as tg
  cfg = tg.CFGS["deepseek_v32"].replace(num_heads=h, index_topk=512)
  w = tg._weights(rng, cfg, True)
  pages, kv_scale, case, kw = tg._decode_case(rng, cfg, sparse=True, B=b, s_q=s_q)
  ref_out, _ = graph.reference_decode_branch(w, jnp.array(pages, copy=True), kv_scale, **case, cfg=cfg, **kw)
  run = lambda: graph.mla_decode_branch_fp8(w, jnp.array(pages, copy=True), kv_scale, **case, cfg=cfg, **kw,
                                            impl="mosaic")[0]
  out = run()
  rep = graph.graph_report()
  assert "merge splits + o_latent @ w_uv" in [s["step"] for s in rep["steps"]], graph.format_report(rep)
  budget = tg._attention_budget(512, cfg)
  testing.assert_close_fp8(out, ref_out, rel_l2=budget, min_cos=0.97, what="graph, merge in W_UV")
  jax.clear_caches()
  with unittest.mock.patch.object(graph, "split_partials", lambda *a, **k: None):
    plain = run()
  testing.assert_close_fp8(plain, ref_out, rel_l2=budget, min_cos=0.97, what="graph, XLA merge")
  rel = float(np.linalg.norm(np.asarray(out, np.float32) - np.asarray(plain, np.float32))
              / np.linalg.norm(np.asarray(plain, np.float32)))
  print(f"\nB{b} s_q{s_q} H{h}: merge in W_UV vs XLA merge rel-L2 {rel:.2e}")
  assert rel < 0.03   # the bf16 rounding of the unfused rows moves ~1/16 of their e4m3 roundings by one step
