"""W_UK's product and the cache write in one launch (mla_pallas.ops.prologue) on the CPU: sm_90 lowering (one
custom call that holds both kernels' work: the product's TMAs and wgmmas, the cache write's stores) and where the
op declines (returns None, so the graph runs the two ops). Bitwise against the two ops: tests/test_prologue_gpu.py."""
from __future__ import annotations

import re

import jax.numpy as jnp
from jax import ShapeDtypeStruct as S
import numpy as np
import pytest

from mla_pallas import _dispatch, testing
from mla_pallas.kernels import bmm_fp8 as kbmm, rope_direct as rd
from mla_pallas.ops import bmm_fp8 as bmm_mod, prologue, rope_rmsnorm as rr
from tests._rope_inputs import make_case

FP8 = jnp.float8_e4m3fn


def _write_avals(t, h, num_slots=6400):
  return [S((num_slots // 64, 64, 576), FP8), S((t, 576), jnp.bfloat16), S((t, h, 64), jnp.bfloat16),
          S((t,), jnp.int32), S((4096, 32), jnp.float32), S((4096, 32), jnp.float32), S((512,), jnp.bfloat16),
          S((), jnp.float32), S((), jnp.float32), S((t,), jnp.int32)]


def _count(text, pat):
  return len(re.findall(pat, text))


@pytest.mark.parametrize("t,h,unique", [(1, 128, False), (4, 64, False), (8, 16, True)])
def test_co_launch_lowers_as_one_kernel_with_both_parts(t, h, unique):
  """One custom call (the cache aliased in place) whose Mosaic module has exactly the product's TMAs and wgmmas,
  and the stores of both kernels (the product's own, the cache write's): neither part lost or doubled."""
  side = rr.cache_write_ctas(t, h, 6400, True, unique)
  assert side is not None and side.dedupe == (t > 1 and not unique)
  cfg = bmm_mod.default_config(t, 128, 512, h)
  bmm_avals = [S((t, h, 128), jnp.bfloat16), S((h, 512, 128), FP8), S((h, 1, 4), jnp.float32)]
  both = testing.lower_for_cuda(lambda *a: prologue._launch(*a, side=side), *_write_avals(t, h), *bmm_avals,
                                arch=(9, 0))
  assert both.hlo.count("stablehlo.custom_call") == 1 and "output_operand_aliases" in both.hlo
  alone = testing.lower_for_cuda(kbmm.build(t, h, 128, 512, True, cfg), *bmm_avals, arch=(9, 0))
  write = testing.lower_for_cuda(lambda pages, *a: rr._fused_mosaic(pages, *a, interleaved=True,
                                                                     unique_slots=unique),
                                 *_write_avals(t, h), arch=(9, 0))
  m_both, m_alone, m_write = both.mosaic[0], alone.mosaic[0], write.mosaic[0]
  for pat in (r"nvvm\.cp\.async\.bulk\.tensor", r"wgmma", r"setmaxnreg"):
    assert _count(m_both, pat) == _count(m_alone, pat), pat
  assert _count(m_both, r"llvm\.store") == _count(m_alone, r"llvm\.store") + _count(m_write, r"llvm\.store")
  assert _count(m_write, r"llvm\.store") > 0


def test_side_ctas_follow_the_product_grid():
  side = rr.cache_write_ctas(2, 128, 6400, True, False)
  assert side.ctas == sum(rd.grid_for(side.cfg, 2, 128))
  assert side.out_types()[0].shape == (2 * 128, 64)
  # the measured range: up to B8 H128 (1 kv CTA per 4 tokens, T · H · 8 / 512 q CTAs); B128 is far above it
  assert rr.cache_write_ctas(8, 128, 6400, True, False).ctas == prologue.CO_LAUNCH_MAX_SIDE_CTAS == 18
  assert rr.cache_write_ctas(128, 128, 1 << 16, True, False).ctas > prologue.CO_LAUNCH_MAX_SIDE_CTAS


def test_declines_where_the_pair_cannot_share_a_launch():
  """None (nothing donated, the ops' choices recorded) on the CPU and in interpret mode; the cache write's bitmap
  mode (T above its warp-scan limit) has no side-job form; bad arguments still raise."""
  rng = np.random.default_rng(0)
  case = make_case(rng, 3, 8)
  q_nope = jnp.asarray(rng.normal(size=(3, 8, 128)), jnp.bfloat16)
  w8 = jnp.asarray(rng.normal(size=(8, 512, 128)) * 0.1, FP8)
  ws = jnp.ones((8, 1, 4), jnp.float32)
  pages = jnp.asarray(case.pages)
  kw = dict(eps=case.eps, kv_scale=case.kv_scale, slots=case.slots)
  args = (pages, case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, q_nope, w8, ws)
  assert prologue.cache_write_and_absorb(*args, **kw) is None
  assert _dispatch.last_impl("quantize_and_bmm_fp8") == "xla"
  assert prologue.cache_write_and_absorb(*args, **kw, absorb_impl="mosaic", interpret=True) is None
  assert _dispatch.last_impl("fused_rope_rmsnorm_quantization") == "xla"
  assert not pages.is_deleted()
  with pytest.raises(ValueError, match="w_scale"):
    prologue.cache_write_and_absorb(*args[:-1], jnp.ones((8, 1, 3), jnp.float32), **kw)
  with pytest.raises(ValueError, match="slots"):
    prologue.cache_write_and_absorb(*args, eps=case.eps, kv_scale=case.kv_scale, slots=case.slots[:2])
  cfg = rr._config(4096, 8, True)
  assert rr.cache_write_ctas(cfg.warp_scan_max_tokens + 1, 8, 1 << 20, True, False) is None
  with pytest.raises(ValueError, match="bitmap"):
    rd.CacheWriteCTAs(cfg.warp_scan_max_tokens + 1, 8, 1 << 20, cfg, True, True)


def test_side_job_needs_a_gpu():
  side = rr.cache_write_ctas(1, 8, 6400, True, False)
  with pytest.raises(NotImplementedError, match="interpret"):
    kbmm.build(1, 8, 128, 512, True, bmm_mod.default_config(1, 128, 512, 8), interpret=True, side=side)


@pytest.mark.parametrize("t,h,launches", [(1, 128, True), (8, 128, True), (9, 128, False), (16, 8, True),
                                          (128, 8, False), (128, 128, False)])
def test_launch_rule(monkeypatch, t, h, launches):
  """Where both ops would run their kernels, the pair shares a launch up to CO_LAUNCH_MAX_SIDE_CTAS cache-write CTAs
  (the measured range); above, None (two launches). Dispatch is mocked: this machine has no GPU."""
  monkeypatch.setattr(rr, "checked_fused_dispatch", lambda *a: ("mosaic", True, False))
  monkeypatch.setattr(bmm_mod, "checked_dispatch", lambda *a: "mosaic")
  monkeypatch.setattr(prologue, "_launch", lambda *a, side: ("launched", side))
  f32 = jnp.float32
  got = prologue.cache_write_and_absorb(
      jnp.zeros((100, 64, 576), FP8), jnp.zeros((t, 576), jnp.bfloat16), jnp.zeros((t, h, 64), jnp.bfloat16),
      jnp.zeros((t,), jnp.int32), jnp.zeros((64, 32), f32), jnp.zeros((64, 32), f32), jnp.ones((512,), f32),
      jnp.zeros((t, h, 128), jnp.bfloat16), jnp.zeros((h, 512, 128), FP8), jnp.ones((h, 1, 4), f32), eps=1e-6,
      kv_scale=1.0, slots=jnp.zeros((t,), jnp.int32))
  assert (got is not None) == launches
  if launches:
    assert got[1].ctas <= prologue.CO_LAUNCH_MAX_SIDE_CTAS
