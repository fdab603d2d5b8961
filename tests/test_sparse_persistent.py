"""kernels/sparse_sm90_persistent.py: "producer_vt" on persistent CTAs (``TuningConfig.persistent``, opt-in, not
yet timed on a GPU). Each CTA loops over work items (query tile, split) with the K ring and the P slots counted
across items, Q and the indices doubled by item parity, the next item's Q quantized by the multipliers. In
interpret mode (the multipliers' stand-in: V upcast in SMEM) the op's outputs are bitwise those of the one-item
CTAs (the same products in the same order), with races checked; lowered for sm_90a with instruction counts."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas import _dispatch, testing
from mla_pallas.kernels import common
from mla_pallas.kernels import sparse_sm90_heads_m as heads_m
from mla_pallas.kernels import sparse_sm90_persistent as persistent

from _sparse_inputs import make_case, run_kernel

RACES = plgpu.InterpretGPUParams(detect_races=True)


@pytest.mark.parametrize("B,s_q,H,topk,tps,ctas,races", [
    (2, 1, 64, 200, 3, 3, True),      # 4 tiles in splits of 3: 2 splits x 2 tokens = 4 items on 3 CTAs (one takes 2)
    (1, 2, 128, 260, 3, 3, False),    # two query tiles per token, 2 splits: 8 items on 3 CTAs (3, 3, 2)
])
def test_persistent_is_bitwise_the_one_item_ctas(rng, monkeypatch, B, s_q, H, topk, tps, ctas, races):
  case = make_case(rng, B=B, s_q=s_q, H=H, topk=topk, page_size=16, num_pages=64, kv_scale=0.5)
  tuning = (("schedule", "producer_vt"), ("tiles_per_split", tps))
  base, base_lse = run_kernel(case, interpret=True, tuning=tuning)
  monkeypatch.setattr(_dispatch, "num_sms", lambda: ctas)
  testing.reset_interpreter()
  out, lse = run_kernel(case, interpret=RACES if races else True, tuning=tuning + (("persistent", True),))
  assert not testing.races_found()
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(base, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(base_lse))


def test_persistent_lowers_for_sm90():
  """At sm_90a (P1's shape, 132 CTAs): the producer's 20 fp8 QKᵀ wgmmas, the multipliers' 16 m64n64k16 and 16
  64-bit V loads each, Q quantized twice per multiplier (the first item, then each next one: 16 16-byte stores
  per call), one TMA (the indices)."""
  S = jax.ShapeDtypeStruct
  cfg = heads_m.TuningConfig(tiles_per_split=32, schedule="producer_vt", persistent=True)
  kern = persistent.build(256, 4096, 1, 2, "bfloat16", cfg, num_ctas=132, heads=128, softmax_scale=0.04)
  low = testing.lower_for_cuda(kern, S((128 * 128, 576), jnp.bfloat16), S((4096, 576), common.FP8),
                               S((128, 32, 64), jnp.int32), S((1,), jnp.float32), arch=(9, 0))
  assert low.count(r"wgmma\.mma_async[^ ]*e4m3\.e4m3") == 20
  assert low.count(r"m64n64k16\.f32\.f16\.f16") == 2 * 16
  assert low.count(r"ld\.shared\.v2\.b32") == 2 * 16
  assert low.count(r"st\.shared\.v4\.b32") == 2 * 2 * 16
  assert low.count(r"cp\.async\.bulk\.tensor") == 1


def test_persistent_config():
  """Persistent CTAs run "producer_vt" over an fp8 cache with splits of 3 tiles or more; Q and the indices are
  doubled (SMEM), so 128-tile splits do not fit."""
  with pytest.raises(ValueError, match="persistent"):
    heads_m.TuningConfig(persistent=True)
  with pytest.raises(ValueError, match="persistent"):
    heads_m.TuningConfig(schedule="producer_vt", tiles_per_split=2, persistent=True)
  with pytest.raises(ValueError, match="SMEM"):
    heads_m.TuningConfig(schedule="producer_vt", tiles_per_split=128, persistent=True)
  one = heads_m.TuningConfig(schedule="producer_vt")
  both = heads_m.TuningConfig(schedule="producer_vt", persistent=True)
  # a second Q tile and index block, a second amax row (1 KB rounding)
  assert both.smem_budget() - one.smem_budget() == 40960 + 32 * 64 * 4 + 1024


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("B,s_q,H,ctas", [(8, 2, 128, 5), (16, 1, 64, 132)])
def test_persistent_gpu_is_bitwise_the_one_item_ctas(rng, monkeypatch, B, s_q, H, ctas):
  """On the H200: the persistent kernel (8-tile splits of top-k 2048; 5 CTAs looping over 64 items, or a full
  grid) gives the one-item CTAs' bits: the same products in the same order."""
  case = make_case(rng, B=B, s_q=s_q, H=H, topk=2048, page_size=64, num_pages=B * 64, kv_scale=0.5)
  tuning = (("schedule", "producer_vt"), ("tiles_per_split", 8))
  base, base_lse = run_kernel(case, interpret=False, tuning=tuning)
  monkeypatch.setattr(_dispatch, "num_sms", lambda: ctas)
  out, lse = run_kernel(case, interpret=False, tuning=tuning + (("persistent", True),))
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(base, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(base_lse))
