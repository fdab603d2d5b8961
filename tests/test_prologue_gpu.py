"""W_UK's product and the cache write in one launch (mla_pallas.ops.prologue) on a Hopper GPU (sm_90a): bitwise the
two ops' own kernels, one after the other (both parts run unchanged code on the same inputs, so no tolerance: any
difference is a bug of the co-launch: a wrong ref, a lost or doubled CTA, a race between the parts), and the decode
graph with it bitwise the graph without it."""
from __future__ import annotations

import unittest.mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas import _dispatch, graph
from mla_pallas.ops import bmm_fp8 as bmm_mod, prologue, rope_rmsnorm as rr
from tests._rope_inputs import bits, make_case

pytestmark = [pytest.mark.gpu, pytest.mark.sm90]

FP8 = jnp.float8_e4m3fn


def _weights(rng, h, k=128, n=512):
  w8 = jnp.asarray(rng.normal(size=(h, k, n)) * 0.05, FP8)
  ws = jnp.asarray(rng.uniform(0.5, 2.0, size=(h, k // 128, n // 128)), jnp.float32)
  return bmm_mod.prepare_weight(w8), ws


@pytest.mark.parametrize("t,h,dup,bf16_pages", [(1, 128, False, False), (2, 128, True, False), (8, 128, False, False),
                                                (1, 64, False, False), (5, 64, True, False), (8, 16, True, False),
                                                (3, 8, False, True), (48, 8, True, False)])
def test_co_launch_is_bitwise_the_two_kernels(rng, t, h, dup, bf16_pages):
  """Tokens 1-48 (48: the product's "registers" design), H 8-128, -1 / out-of-range slots, a duplicated slot (the
  later token wins), NaN rows that must stay NaN, an fp8 and a bf16 cache; twice (deterministic)."""
  case = make_case(rng, t, h, num_slots=max(4 * t, 256), page_size=64)
  slots = np.asarray(case.slots).copy()
  if dup and t >= 2:
    slots[t - 1] = slots[0] if slots[0] >= 0 else slots[1]
  pages_np = case.pages.astype(np.float32).astype(jnp.bfloat16) if bf16_pages else case.pages
  q_nope = jnp.asarray(rng.normal(size=(t, h, 128)) * 2.0, jnp.bfloat16)
  wt, ws = _weights(rng, h)
  kw = dict(eps=case.eps, kv_scale=case.kv_scale, slots=jnp.asarray(slots))
  write_args = (case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w)
  pages_sep, q_rot_sep = rr.fused_rope_rmsnorm_quantization(jnp.asarray(pages_np), *write_args, **kw, impl="mosaic")
  q_lat_sep = bmm_mod.quantize_and_bmm_fp8(q_nope, wt, ws, weight_layout="hnk", impl="mosaic")
  for _ in range(2):
    got = prologue.cache_write_and_absorb(jnp.asarray(pages_np), *write_args, q_nope, wt, ws, **kw,
                                          write_impl="mosaic", absorb_impl="mosaic")
    assert got is not None, "the co-launch declined"
    assert _dispatch.last_impl("fused_rope_rmsnorm_quantization") == "mosaic"
    pages, q_rot, q_lat = got
    np.testing.assert_array_equal(bits(pages), bits(pages_sep), err_msg="cache pages")
    np.testing.assert_array_equal(bits(q_rot), bits(q_rot_sep), err_msg="q_rope_out")
    np.testing.assert_array_equal(bits(q_lat), bits(q_lat_sep), err_msg="q_latent")
  assert np.isnan(np.asarray(pages, np.float32)).any()   # rows not written stay NaN


@pytest.mark.parametrize("model,b,s_q", [("deepseek_v32", 1, 1), ("deepseek_v32", 3, 2), ("glm5", 2, 1)])
def test_decode_graph_is_bitwise_the_graph_without_it(rng, model, b, s_q):
  """The FP8 decode branch reports the co-launch and gives the bits (out and the new cache) of the branch that
  runs the two ops."""
  import tests.test_graph as tg
  cfg = tg.CFGS[model]
  w = tg._weights(rng, cfg, True)
  pages, kv_scale, case, kw = tg._decode_case(rng, cfg, sparse=True, B=b, s_q=s_q)
  run = lambda: graph.mla_decode_branch_fp8(w, jnp.array(pages, copy=True), kv_scale, **case, cfg=cfg, **kw,
                                            impl="mosaic")
  out, new_pages = run()
  steps = [s["step"] for s in graph.graph_report()["steps"]]
  assert any("in W_UK's launch" in s for s in steps), steps
  jax.clear_caches()
  with unittest.mock.patch.object(graph, "cache_write_and_absorb", lambda *a, **k: None):
    out_sep, pages_sep = run()
  np.testing.assert_array_equal(bits(out), bits(out_sep))
  np.testing.assert_array_equal(bits(new_pages), bits(pages_sep))
