"""The dense decode kernel (kernels/dense_sm90.py) on the CPU: interpret mode against the float32 reference (with
race detection), its table against a numpy oracle, its route choice, and its sm_90 lowering with instruction counts.

Inputs (``_dense_inputs.dense_case``): N(0, 1) queries, an e4m3 cache with NaN in every slot no query may read
(rows past a sequence's length in its last page, pages past it, pages no sequence uses), block-table entries past
each sequence's pages set to -1 or past the cache, and in some cases such entries inside a sequence (masked);
lengths 0, 1, 63, 64, 65 and longer; causal (s_q > 1) and not; page 64 and 128; several splits per sequence, a
split wholly past a short sequence (zero tiles: lse -inf, merged with weight 0).

Error model (interpret mode): Q in e4m3 per row and P in f16 as on the GPU, exact products
(``testing.fp8_error_budget(fp8_mma=False, quantized_p=False)``), bf16 split partials.
"""
from __future__ import annotations

import re

from hypothesis import given, settings, strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas import _dispatch, reference, testing
from mla_pallas.kernels import dense_sm90
from mla_pallas.ops import dense_decode

from _dense_inputs import check_bf16, dense_case

D = 576
RACES = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=True)
SCALE = D ** -0.5
KV_SCALE = 0.75


def _check(out, lse, ref_out, ref_lse, lens, what):
  # logits of std softmax_scale * sqrt(576) * kv_scale = 0.75 on N(0, 1) data; P·V over up to max(lens) keys
  budget = testing.fp8_error_budget(split_partials_bf16=True, logit_std=0.75, pv_length=max(max(lens), 1),
                                    fp8_mma=False, quantized_p=False)
  testing.assert_close_fp8(out, ref_out, rel_l2=budget, min_cos=0.99, what=what)
  # lse: a logit error of RMS sigma moves lse by about sigma (natural log units); see tests/test_sparse_decode.py
  testing.assert_close_fp8(lse, ref_lse, rel_l2=None, max_abs=0.1, what=f"{what} lse")
  empty = ~np.isfinite(np.asarray(ref_lse))
  assert np.array_equal(~np.isfinite(np.asarray(lse)), empty)
  assert np.all(np.asarray(out, np.float32)[empty] == 0)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))


CASES = [   # H, s_q, page, causal, lengths, bad pages inside, tuning (default: the plan's, one tile per split
            # here), race detection (slower: one case)
    (64, 1, 64, False, (150, 37, 0), True, (), True),
    (128, 2, 128, True, (0, 1, 127, 300), False, (("tiles_per_split", 4),), False),
    (64, 3, 64, True, (4, 65, 200), True, (("tiles_per_split", 2),), False),
    (32, 1, 64, False, (1, 63, 64, 500), False, (("tiles_per_split", 4), ("k_buffers", 3)), False),
    (8, 1, 64, False, (150, 37, 0), True, (), True),                     # heads on N
    (16, 3, 128, True, (0, 1, 127, 300), False, (("tiles_per_split", 2), ("k_buffers", 2)), False),
    pytest.param(128, 1, 64, False, (256, 191, 700), True, (("tiles_per_split", 8),), True,
                 marks=pytest.mark.slow),
]


def _interpret_run(rng, H, s_q, page, causal, lens, bad_inside, tuning, races, cache_dtype=jnp.float8_e4m3fn):
  """The dense kernel in interpret mode on a fresh case (race-checked where ``races``): returns (out, lse,
  ref_out, ref_lse, rerun), ``rerun()`` the same call again without race detection."""
  max_pages = -(-max(lens) // page) + 1
  q, pages, table, seqlens = dense_case(rng, lens=lens, s_q=s_q, H=H, page=page, max_pages=max_pages,
                                        bad_inside=bad_inside)
  pages = pages.astype(cache_dtype)
  testing.reset_interpreter()
  run = lambda interp: dense_decode._dense_kernel_jit(q, pages, table, seqlens, jnp.float32(KV_SCALE),
                                                      softmax_scale=SCALE, causal=causal, interpret=interp,
                                                      tuning=tuning)
  out, lse = run(RACES if races else True)
  assert not testing.races_found(), "the interpreter found a data race in the kernel"
  ref_out, ref_lse = reference.dense_mla_decode(q, pages, table, seqlens, softmax_scale=SCALE, kv_scale=KV_SCALE,
                                                causal=causal)
  return out, lse, ref_out, ref_lse, lambda: run(True)


@pytest.mark.parametrize("H,s_q,page,causal,lens,bad_inside,tuning,races", CASES)
def test_kernel_interpret_matches_reference(rng, H, s_q, page, causal, lens, bad_inside, tuning, races):
  out, lse, ref_out, ref_lse, _ = _interpret_run(rng, H, s_q, page, causal, lens, bad_inside, tuning, races)
  _check(out, lse, ref_out, ref_lse, lens, f"dense kernel H={H} s_q={s_q}")


SEESAW = (("schedule", "seesaw"),)

BF16_CASES = [   # H, s_q, page, causal, lengths, bad pages inside, tuning, race detection
    (64, 2, 64, True, (150, 37, 0), True, (("tiles_per_split", 2),), True),
    (16, 1, 128, False, (0, 1, 127, 300), False, (), False),      # heads on M with rows 16-63 zero-padded
    pytest.param(128, 1, 64, False, (70, 5, 260), True, (("tiles_per_split", 1),), False, marks=pytest.mark.slow),
    # "seesaw" (the consumers alternate tiles; traced tile counts: tile 0 and the tail under lax.cond): splits of 3
    # tiles (consumer 0 owns the last), of 2 and 1 (consumer 1's last or no tile), zero-tile splits, a bad page
    # inside a sequence (the masked range starts at tile 0 or later)
    (64, 2, 64, True, (150, 37, 0), True, SEESAW + (("tiles_per_split", 3),), True),
    (32, 1, 128, False, (0, 1, 127, 300), True, SEESAW + (("tiles_per_split", 2),), False),
    pytest.param(128, 3, 64, True, (70, 5, 260), True, SEESAW + (("tiles_per_split", 1),), False,
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("H,s_q,page,causal,lens,bad_inside,tuning,races", BF16_CASES)
def test_bf16_kernel_interpret_matches_reference(rng, H, s_q, page, causal, lens, bad_inside, tuning, races):
  """A bfloat16 cache (BF16 attention: "producer_vt" over bf16, heads on M at every H, Q tiles by TMA, P in the K
  buffer's rope chunk, f32 split partials) against the float32 reference within testing.BF16_ATTENTION_REL_L2 (P
  and the output rounded to bf16; the lse sees only f32 rounding): NaN in every unread slot (the e4m3 case's rows
  as bf16), bad pages inside and past sequences, lengths 0 / 1 / 127 and longer, causal; bitwise deterministic."""
  out, lse, ref_out, ref_lse, rerun = _interpret_run(rng, H, s_q, page, causal, lens, bad_inside, tuning, races,
                                                     jnp.bfloat16)
  check_bf16(out, lse, ref_out, ref_lse, f"bf16 dense kernel H={H}", lse_atol=1e-4)
  again, _ = rerun()
  assert np.array_equal(np.asarray(again).view(np.uint16), np.asarray(out).view(np.uint16))


def test_op_takes_the_dense_route_in_interpret_mode(rng):
  """impl="mosaic" with interpret=True runs the dense kernel (the route), the q pair form included, and gives the
  same bits as calling the route itself."""
  q, pages, table, seqlens = dense_case(rng, lens=(70, 5), s_q=1, H=64, page=64, max_pages=3)
  kw = dict(softmax_scale=SCALE, kv_scale=KV_SCALE, causal=False)
  assert dense_decode.mosaic_route(q.shape, pages, "mosaic", True) == "dense"
  out, lse = dense_decode.dense_mla_decode(q, pages, table, seqlens, impl="mosaic", interpret=True, **kw)
  assert _dispatch.last_impl("dense_mla_decode") == "mosaic-interpret"
  pair = (q[..., :512], q[..., 512:])
  out_p, lse_p = dense_decode.dense_mla_decode(pair, pages, table, seqlens, impl="mosaic", interpret=True, **kw)
  assert np.array_equal(np.asarray(out).view(np.uint16), np.asarray(out_p).view(np.uint16))
  ref_out, ref_lse = reference.dense_mla_decode(q, pages, table, seqlens, **kw)
  _check(out, lse, ref_out, ref_lse, (70, 5), "dense op")


@pytest.mark.parametrize("h,page,dtype,impl,interpret,want", [
    (64, 64, jnp.float8_e4m3fn, "mosaic", True, "dense"),
    (128, 128, jnp.float8_e4m3fn, "auto", True, "dense"),
    (32, 256, jnp.float8_e4m3fn, "mosaic", True, "dense"),
    (16, 64, jnp.float8_e4m3fn, "mosaic", True, "dense"),       # heads on N
    (24, 64, jnp.float8_e4m3fn, "mosaic", True, "sparse"),      # not a kernel head count (the sparse op says so)
    (64, 16, jnp.float8_e4m3fn, "mosaic", True, "sparse"),      # a tile would cross pages
    (64, 64, jnp.bfloat16, "mosaic", True, "dense"),            # BF16 attention: the kernel's bf16 form
    (16, 64, jnp.bfloat16, "mosaic", True, "dense"),            # (heads on M at every H)
    (64, 16, jnp.bfloat16, "mosaic", True, "sparse"),
    (64, 64, jnp.float16, "mosaic", True, "sparse"),            # no f16 cache kernel (the op refuses f16 anyway)
])
def test_mosaic_route(h, page, dtype, impl, interpret, want):
  pages = jax.ShapeDtypeStruct((4, page, D), dtype)
  assert dense_decode.mosaic_route((2, 1, h, D), pages, impl, interpret) == want


def test_auto_keeps_the_sparse_route_until_validated(monkeypatch):
  """On hardware "auto" takes the dense kernel only where it was validated (DENSE_VALIDATED_ON)."""
  pages = jax.ShapeDtypeStruct((4, 64, D), jnp.float8_e4m3fn)
  monkeypatch.setattr(_dispatch, "mosaic_arch", lambda interpret=False: "sm90")
  monkeypatch.setattr(dense_decode, "DENSE_VALIDATED_ON", ())
  assert dense_decode.mosaic_route((2, 1, 64, D), pages, "auto", False) == "sparse"
  assert dense_decode.mosaic_route((2, 1, 64, D), pages, "mosaic", False) == "dense"
  monkeypatch.setattr(dense_decode, "DENSE_VALIDATED_ON", ("sm90",))
  assert dense_decode.mosaic_route((2, 1, 64, D), pages, "auto", False) == "dense"
  monkeypatch.setattr(_dispatch, "mosaic_arch", lambda interpret=False: "sm100")
  assert dense_decode.mosaic_route((2, 1, 64, D), pages, "mosaic", False) == "sparse"


def test_auto_keeps_the_sparse_route_for_bf16_until_validated(monkeypatch):
  """The bf16-cache form has its own validation list (DENSE_BF16_VALIDATED_ON): the fp8 one does not cover it."""
  pages = jax.ShapeDtypeStruct((4, 64, D), jnp.bfloat16)
  monkeypatch.setattr(_dispatch, "mosaic_arch", lambda interpret=False: "sm90")
  monkeypatch.setattr(dense_decode, "DENSE_VALIDATED_ON", ("sm90",))
  monkeypatch.setattr(dense_decode, "DENSE_BF16_VALIDATED_ON", ())
  assert dense_decode.mosaic_route((2, 1, 64, D), pages, "auto", False) == "sparse"
  assert dense_decode.mosaic_route((2, 1, 64, D), pages, "mosaic", False) == "dense"
  monkeypatch.setattr(dense_decode, "DENSE_BF16_VALIDATED_ON", ("sm90",))
  assert dense_decode.mosaic_route((2, 1, 64, D), pages, "auto", False) == "dense"


def _table_oracle(table, lens, *, page, num_pages, s_q, causal, splits, tps):
  """numpy: the table row of every (token, split) (kernels/dense_sm90.py, module docstring)."""
  b, max_pages = table.shape
  n_pos, num_slots = max_pages * page, num_pages * page
  width = dense_sm90.table_width(tps)
  out = np.zeros((b, s_q, splits, width), np.int32)
  for bi in range(b):
    for i in range(s_q):
      limit = min(lens[bi], n_pos)
      if causal:
        limit = min(limit, lens[bi] - s_q + 1 + i)
      for s in range(splits):
        firsts, full_run, n_tiles = [], 0, 0
        for t in range(tps):
          p0 = (s * tps + t) * 64
          col = p0 // page
          pid = table[bi, col] if col < max_pages else -1
          ok = 0 <= pid < num_pages
          firsts.append(pid * page + p0 % page if ok else num_slots)
          if p0 < limit:
            n_tiles += 1
          if ok and p0 + 64 <= limit and full_run == t:
            full_run += 1
        out[bi, i, s, :4] = (full_run, n_tiles, limit - s * tps * 64, 0)
        out[bi, i, s, 4:4 + tps] = firsts
  return out.reshape(b * s_q * splits, width)


@pytest.mark.parametrize("page,s_q,causal,tps,splits", [(64, 1, False, 2, 3), (128, 3, True, 3, 2),
                                                        (64, 2, True, 1, 5)])
def test_tile_table_matches_oracle(rng, page, s_q, causal, tps, splits):
  lens = (0, 1, 64, 65, 130, 1000)
  max_pages = 4
  _, _, table, seqlens = dense_case(rng, lens=lens, s_q=1, H=8, page=page, max_pages=max_pages, bad_inside=True)
  num_pages = len(lens) * max_pages + 3
  got = dense_decode.dense_tile_table(table, seqlens, page_size=page, num_pages=num_pages, s_q=s_q, causal=causal,
                                      num_splits=splits, tiles_per_split=tps)
  want = _table_oracle(np.asarray(table), lens, page=page, num_pages=num_pages, s_q=s_q, causal=causal,
                       splits=splits, tps=tps)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_lowers_for_sm90_with_expected_instructions():
  """D1's shape (B128 H128, 4096 positions; 2 splits of 32 tiles): the kernel lowers at sm_90 with the sparse
  core's products (the producer's 18-step QKᵀ twice: in its unmasked and its masked loop; the multipliers' 16
  P·V wgmmas as one traced path: 52 wgmma), the loader's 20 cp.async per thread and tile, the table's one TMA and
  the multipliers' 32 prmt per tile. D3's shape (B64 H16, 32768 positions; 16 splits of 32 tiles) with the heads
  on N: the five QKᵀ wgmmas (20 k32 instructions) in both loops and 32 P·V wgmmas (72), 64 prmt."""
  S = jax.ShapeDtypeStruct
  cfg = dense_sm90.TuningConfig(tiles_per_split=32)
  kern = dense_sm90.build(256, 8192 * 64, 2, 2, cfg, heads=128, softmax_scale=0.1)
  low = testing.lower_for_cuda(kern, S((128 * 128, D), jnp.bfloat16), S((8192 * 64, D), jnp.float8_e4m3fn),
                               S((128 * 2, dense_sm90.table_width(32)), jnp.int32), S((1,), jnp.float32))
  counts = {p: low.count(re.escape(p)) for p in ("wgmma.mma_async", "cp.async.cg", "cp.async.bulk.tensor", "prmt",
                                                  "setmaxnreg")}
  assert counts == {"wgmma.mma_async": 52, "cp.async.cg": 20, "cp.async.bulk.tensor": 1, "prmt": 32,
                    "setmaxnreg": 3}, counts
  cfg_n = dense_sm90.HeadsNConfig(tiles_per_split=32)
  kern_n = dense_sm90.build_heads_n(64, 32768 * 64, 16, 16, cfg_n, heads=16, softmax_scale=0.1)
  low_n = testing.lower_for_cuda(kern_n, S((64 * 16, D), jnp.bfloat16), S((32768 * 64, D), jnp.float8_e4m3fn),
                                 S((64 * 16, dense_sm90.table_width(32)), jnp.int32), S((1,), jnp.float32))
  counts_n = {p: low_n.count(re.escape(p)) for p in counts}
  assert counts_n == {"wgmma.mma_async": 72, "cp.async.cg": 20, "cp.async.bulk.tensor": 1, "prmt": 64,
                      "setmaxnreg": 2}, counts_n
  five = dense_sm90.build_heads_n(64, 32768 * 64, 16, 16, dense_sm90.HeadsNConfig(tiles_per_split=32, k_buffers=5),
                                  heads=16, softmax_scale=0.1)     # 5 K buffers: 3 tiles in flight behind the newest
  low_5 = testing.lower_for_cuda(five, S((64 * 16, D), jnp.bfloat16), S((32768 * 64, D), jnp.float8_e4m3fn),
                                 S((64 * 16, dense_sm90.table_width(32)), jnp.int32), S((1,), jnp.float32))
  assert low_5.count(re.escape("cp.async.wait_group 3")) == 1


def test_bf16_lowers_for_sm90_with_expected_instructions():
  """D1's shape over a bf16 cache (2 splits of 32 tiles, f32 partials): the producer's QKᵀ as nine bf16 m64n64k16 x 4
  wgmmas in its unmasked and its masked loop (72), the multipliers' P·V as one m64n64k16 x 4 group per 64-column
  chunk of V (16, one traced path; no m64n256k16, which ptxas cannot fit in 128 registers), P by stmatrix (4 per
  loop), no fp8 and no byte permutes; the loader's 4 x 9 cp.async per thread and tile (1152-byte rows), the TMAs of
  Q's nine chunks and of the table row; the sweep offers no third K buffer."""
  S = jax.ShapeDtypeStruct
  cfg = dense_sm90.TuningConfig(tiles_per_split=32, cache_dtype="bfloat16")
  assert cfg.smem_budget() <= 232448 and not cfg.core.p_slots()
  kern = dense_sm90.build(256, 8192 * 64, 2, 2, cfg, heads=128, softmax_scale=0.1, out_dtype_name="float32")
  low = testing.lower_for_cuda(kern, S((256, 64, D), jnp.bfloat16), S((256, 64), jnp.float32),
                               S((8192 * 64, D), jnp.bfloat16), S((128 * 2, dense_sm90.table_width(32)), jnp.int32),
                               S((1,), jnp.float32))
  counts = {p: low.count(re.escape(p)) for p in ("m64n64k16.f32.bf16.bf16", "m64n256k16.f32.bf16.bf16",
                                                  "wgmma.mma_async", "cp.async.cg", "cp.async.bulk.tensor", "prmt",
                                                  "stmatrix", "e4m3", "setmaxnreg")}
  assert counts == {"m64n64k16.f32.bf16.bf16": 72 + 16, "m64n256k16.f32.bf16.bf16": 0, "wgmma.mma_async": 88,
                    "cp.async.cg": 36, "cp.async.bulk.tensor": 10, "prmt": 0, "stmatrix": 8, "e4m3": 0,
                    "setmaxnreg": 3}, counts
  sweep = dense_decode.sweep_configs(128, 128, 4096, 64, "bfloat16")
  assert "default" in sweep and "route=sparse" in sweep and "k_buffers=3" not in sweep


def test_bf16_seesaw_lowers_for_sm90_with_expected_instructions():
  """D1's shape over a bf16 cache with "seesaw" (2 splits of 32 tiles): consumer 0's tile 0 under lax.cond (36 QKᵀ +
  16 P·V wgmmas), its unmasked and masked loops (each 36 + 2 x 16: its own tile and the other's before it) and its
  tail (the other's last tile: 16) = 204; consumer 1's two loops and tail = 152; P by stmatrix once per own-tile
  copy (5 x 4); the loader's 4 x 9 cp.async and ten TMAs as "producer_vt"'s; three warpgroups; SMEM within the
  limit; the sweep offers it over a bf16 cache only."""
  S = jax.ShapeDtypeStruct
  cfg = dense_sm90.TuningConfig(tiles_per_split=32, cache_dtype="bfloat16", schedule="seesaw")
  assert cfg.core.seesaw and cfg.smem_budget() <= 232448
  kern = dense_sm90.build(256, 8192 * 64, 2, 2, cfg, heads=128, softmax_scale=0.1, out_dtype_name="float32")
  low = testing.lower_for_cuda(kern, S((256, 64, D), jnp.bfloat16), S((256, 64), jnp.float32),
                               S((8192 * 64, D), jnp.bfloat16), S((128 * 2, dense_sm90.table_width(32)), jnp.int32),
                               S((1,), jnp.float32))
  counts = {p: low.count(re.escape(p)) for p in ("m64n64k16.f32.bf16.bf16", "wgmma.mma_async", "cp.async.cg",
                                                  "cp.async.bulk.tensor", "stmatrix", "e4m3", "setmaxnreg")}
  assert counts == {"m64n64k16.f32.bf16.bf16": 204 + 152, "wgmma.mma_async": 356, "cp.async.cg": 36,
                    "cp.async.bulk.tensor": 10, "stmatrix": 20, "e4m3": 0, "setmaxnreg": 3}, counts
  assert "schedule=seesaw" in dense_decode.sweep_configs(128, 128, 4096, 64, "bfloat16")
  assert "schedule=seesaw" not in dense_decode.sweep_configs(128, 128, 4096, 64)
  with pytest.raises(ValueError, match="seesaw"):
    dense_sm90.TuningConfig(schedule="seesaw")          # fp8 cache
  with pytest.raises(ValueError, match="schedule"):
    dense_sm90.TuningConfig(schedule="twin", cache_dtype="bfloat16")


def test_config_checks():
  with pytest.raises(ValueError, match="tiles_per_split must be <= 128"):
    dense_sm90.TuningConfig(tiles_per_split=256)
  with pytest.raises(ValueError, match="k_buffers <= 2"):     # bf16: P in the K buffers, two of them fit
    dense_sm90.TuningConfig(k_buffers=3, cache_dtype="bfloat16")
  with pytest.raises(ValueError, match="cache_dtype"):
    dense_sm90.TuningConfig(cache_dtype="float16")
  assert dense_sm90.TuningConfig(tiles_per_split=128, cache_dtype="bfloat16").smem_budget() < 232448
  with pytest.raises(ValueError, match="q_split"):
    dense_sm90.build(2, 4096, 1, 1, dense_sm90.TuningConfig(cache_dtype="bfloat16"), heads=64, softmax_scale=0.1,
                     q_split=True)
  with pytest.raises(ValueError, match="k_buffers must be one of"):
    dense_sm90.TuningConfig(k_buffers=1)
  assert dense_sm90.table_width(28) == 32 and dense_sm90.table_width(29) == 64
  assert dense_sm90.TuningConfig(tiles_per_split=128, k_buffers=3).smem_budget() < 232448
  assert dense_sm90.HeadsNConfig(tiles_per_split=128, k_buffers=5).smem_budget() < 232448
  with pytest.raises(ValueError, match="heads-on-N"):
    dense_sm90.build_heads_n(4, 4096, 1, 8, dense_sm90.HeadsNConfig(), heads=12, softmax_scale=0.1)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_tile_table_fuzzed_against_oracle(data):
  """Random page sizes (multiples of 64), block tables with entries in and out of [0, num_pages), lengths from
  below 0 to past the table, s_q 1-3, causal or not, any split shape covering the table (or one split more)."""
  page = data.draw(st.sampled_from([64, 128, 192]), "page")
  b, max_pages = data.draw(st.integers(1, 3), "B"), data.draw(st.integers(1, 5), "max_pages")
  s_q, causal = data.draw(st.integers(1, 3), "s_q"), data.draw(st.booleans(), "causal")
  num_pages = data.draw(st.integers(1, 10), "num_pages")
  tps = data.draw(st.integers(1, 6), "tiles_per_split")
  k_tiles = -(-max_pages * page // 64)
  splits = -(-k_tiles // tps) + data.draw(st.integers(0, 1), "extra split")
  table = np.asarray(data.draw(st.lists(st.integers(-2, num_pages + 2), min_size=b * max_pages,
                                        max_size=b * max_pages), "table"), np.int32).reshape(b, max_pages)
  lens = data.draw(st.lists(st.integers(-3, max_pages * page + 70), min_size=b, max_size=b), "lens")
  got = dense_decode.dense_tile_table(jnp.asarray(table), jnp.asarray(np.asarray(lens, np.int32)), page_size=page,
                                      num_pages=num_pages, s_q=s_q, causal=causal, num_splits=splits,
                                      tiles_per_split=tps)
  want = _table_oracle(table, lens, page=page, num_pages=num_pages, s_q=s_q, causal=causal, splits=splits, tps=tps)
  np.testing.assert_array_equal(np.asarray(got), want)
