"""mla_prefill's Mosaic GPU kernel (kernels/prefill_sm90.py) on the CPU: interpret mode with race detection
against reference.mla_prefill (packed batches with ragged lengths, separate keys with context longer and shorter
than the queries, padding tokens, non-finite v, both causal forms), its aligned packing and tile table, the
config checks, the dispatch, and sm_90a lowering with instruction counts at both models' head dims.

Error model (interpret mode computes the wgmmas exactly): q and k are quantized to e4m3 with one scale per row
(token and head; RMS relative error <= 2^-4 / sqrt(3) each, acting on the logits times their std), P and the
output are rounded to bf16: ``testing.fp8_error_budget(quantized_q=True, quantized_kv=True, quantized_p=False, fp8_mma=False)``
(its v term over-counts: v stays bf16). lse: the logits move by ~logit_std * sqrt(2) * 2^-4 / sqrt(3) RMS; the
log-sum-exp, a smooth max, by at most their largest move: asserted <= 6 * logit_std * 2^-4 (3 sigma of the
largest of a few hundred logits).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas import _dispatch, reference as ref, testing
from mla_pallas.kernels import prefill_sm90 as kp
from mla_pallas.ops import prefill as pf
from mla_pallas.ops.prefill import mla_prefill

RACES = plgpu.InterpretGPUParams(detect_races=True)

# name: (T, cu_seqlens, Tk or None, cu_seqlens_k or None, bad v entries (key index, value))
CASES = {
    "ragged_self": (61, [0, 1, 2, 19, 19, 60, 61], None, None, ()),            # lengths 1, 1, 17, 0, 41, 1
    "two_tiles": (150, [0, 150], None, None, ()),                              # a full and a partial query tile
    "context": (12, [0, 5, 12], 200, [0, 130, 200], ()),                        # Lk - Lq = 125, 63 (3 key blocks)
    "ragged_context": (9, [0, 1, 1, 8, 9], 47, [0, 37, 40, 47, 47], ()),       # 1/37, 0/3, 7/7, 1/0
    "fewer_keys": (10, [0, 10], 4, [0, 4], ()),                                # 6 queries see nothing (causal)
    "padding_nonfinite": (18, [2, 9, 15], 35, [3, 20, 31],
                          [((0,), np.nan), ((33,), np.inf), ((10, 1, 3), np.nan)]),
}


def _inputs(rng, name, h=2, dqk=64, dv=64):
  t, cu, tk, cu_k, bad = CASES[name]
  q = jnp.asarray(rng.normal(size=(t, h, dqk)), jnp.bfloat16)
  k = jnp.asarray(rng.normal(size=(tk or t, h, dqk)), jnp.bfloat16)
  v = rng.normal(size=(tk or t, h, dv)).astype(np.float32)
  for idx, val in bad:
    v[idx] = val
  cu_k = None if cu_k is None else jnp.asarray(cu_k, jnp.int32)
  return q, k, jnp.asarray(v, jnp.bfloat16), jnp.asarray(cu, jnp.int32), cu_k


def zeros_of(avals):
  return [jnp.zeros(a.shape, a.dtype) for a in avals]


def _default_pv_fp8(q, v) -> bool:
  """Whether the op's default kernel config at these head dims runs the fp8 P·V (its error model has P and V in
  e4m3 then)."""
  return kp.default_config(q.shape[2], v.shape[2]).pv_fp8


def _check(out, lse, r_out, r_lse, *, dqk, pv_length, what, quantized_p=False):
  o, r = np.asarray(out, np.float64), np.asarray(r_out, np.float64)
  np.testing.assert_array_equal(np.isnan(o), np.isnan(r), err_msg=f"{what}: NaN pattern")
  g, w = np.asarray(lse, np.float64), np.asarray(r_lse, np.float64)
  np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w), err_msg=f"{what}: -inf lse pattern")
  empty = np.isneginf(w)
  assert np.all(o[empty] == 0), f"{what}: rows without keys must be 0"
  fin = np.isfinite(r)
  budget = testing.fp8_error_budget(quantized_q=True, quantized_kv=True, quantized_p=quantized_p, fp8_mma=False,
                                    d_qk=dqk, pv_length=pv_length, logit_std=1.0)
  rel = np.linalg.norm(o[fin] - r[fin]) / np.linalg.norm(r[fin])
  assert rel <= budget, f"{what}: out rel-L2 {rel:.3g} > {budget:.3g}"
  lf = np.isfinite(w)
  assert np.abs(g[lf] - w[lf]).max() <= 6 * 2.0 ** -4, f"{what}: lse"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("name", sorted(CASES))
def test_kernel_interpret_matches_reference(rng, name, causal):
  q, k, v, cu, cu_k = _inputs(rng, name)
  scale = q.shape[2] ** -0.5                                      # logits of std ~1
  out, lse = mla_prefill(q, k, v, cu, softmax_scale=scale, causal=causal, cu_seqlens_k=cu_k, impl="mosaic",
                         interpret=RACES)
  assert _dispatch.last_impl("mla_prefill") == "mosaic-interpret"
  assert out.shape == (q.shape[0], q.shape[1], v.shape[2]) and out.dtype == jnp.bfloat16
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
  assert not ipc.get_races().races_found
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=scale, causal=causal, cu_seqlens_k=cu_k)
  _check(out, lse, r_out, r_lse, dqk=q.shape[2], pv_length=k.shape[0], what=name, quantized_p=_default_pv_fp8(q, v))
  if name == "padding_nonfinite":
    assert np.all(np.asarray(out, np.float32)[list(range(2)) + [15, 16, 17]] == 0)   # padding tokens


def test_kernel_interpret_outlier_rows(rng):
  """One scale per row: a q row and a k row 10^5 times larger than the others (activation outliers) leave every
  other row's e4m3 error at the model's; one scale per head would push those rows below e4m3's normal range
  (|x| / scale ~ 0.002: most round to 0) and fail (checked by hand: the lse check fails). The outlier key
  dominates the rows that see it (p ~ 1 on it), which the reference computes too. The lse of a row that sees
  logits of std ~10^5 (the outlier query's, and head 0's rows that see the outlier key) gets the same error
  model at that logit std: <= 6 · 10^5 · 2^-4."""
  q, k, v, cu, cu_k = _inputs(rng, "two_tiles")
  q = q.at[7, 1].multiply(1e5)
  k = k.at[100, 0].multiply(1e5)
  scale = q.shape[2] ** -0.5
  out, lse = mla_prefill(q, k, v, cu, softmax_scale=scale, causal=True, impl="mosaic", interpret=True)
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=scale, causal=True)
  g, w = np.asarray(lse, np.float64), np.asarray(r_lse, np.float64)
  big = np.abs(w) > 100
  assert big.sum() >= 2 and np.all(np.abs(g[big] - w[big]) <= 6 * 1e5 * 2.0 ** -4)
  _check(out, np.where(big, w, g), r_out, r_lse, dqk=q.shape[2], pv_length=k.shape[0], what="outlier rows",
         quantized_p=_default_pv_fp8(q, v))


def test_kernel_interpret_model_head_dims_and_determinism(rng):
  """DeepSeek-V3.2's head dims (Dqk 192 = 3 K chunks of 64, Dv 128) with 128-key blocks (a tile spanning both
  consumers and a partial one), twice: bitwise the same."""
  t, tk, h, dqk, dv = 140, 300, 1, 192, 128
  q = jnp.asarray(rng.normal(size=(t, h, dqk)), jnp.bfloat16)
  k = jnp.asarray(rng.normal(size=(tk, h, dqk)), jnp.bfloat16)
  v = jnp.asarray(rng.normal(size=(tk, h, dv)), jnp.bfloat16)
  cu, cu_k = jnp.asarray([0, 140], jnp.int32), jnp.asarray([0, 300], jnp.int32)
  run = functools.partial(pf._mosaic_jit, q, k, v, cu, jnp.float32(dqk ** -0.5), causal=True, cu_seqlens_k=cu_k,
                          interpret=True, cfg=kp.TuningConfig(block_kv=128, kv_stages=2))
  out, lse = run()
  out2, lse2 = run()
  np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(out2).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=dqk ** -0.5, causal=True, cu_seqlens_k=cu_k)
  _check(out, lse, r_out, r_lse, dqk=dqk, pv_length=tk, what="deepseek dims")


@pytest.mark.parametrize("block_kv", [64, 128])
def test_slot_reuse_race_free(rng, block_kv):
  """64 queries over 300 keys: three (128-key blocks) or five (64) blocks through two ring slots, race-checked.
  The consumers read each slot's key scales with register loads (generic proxy) before the loader refills the
  slot by TMA (async proxy): without the consumer's proxy fence (``commit_smem``) between the load and its
  ``k_empty`` arrival the interpreter reports a race here (docs/kernels/prefill_sm90.md, "The key-scale ring's
  proxy fence"); with it, none. The result is checked against the reference too."""
  t, tk = 64, 300
  q = jnp.asarray(rng.normal(size=(t, 1, 64)), jnp.bfloat16)
  k = jnp.asarray(rng.normal(size=(tk, 1, 64)), jnp.bfloat16)
  v = jnp.asarray(rng.normal(size=(tk, 1, 64)), jnp.bfloat16)
  cu, cu_k = jnp.asarray([0, t], jnp.int32), jnp.asarray([0, tk], jnp.int32)
  testing.reset_interpreter()
  out, lse = pf._mosaic_jit(q, k, v, cu, jnp.float32(0.125), causal=False, cu_seqlens_k=cu_k, interpret=RACES,
                            cfg=kp.TuningConfig(block_kv=block_kv, kv_stages=2))
  jax.block_until_ready(out)
  assert not testing.races_found()
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=0.125, causal=False, cu_seqlens_k=cu_k)
  _check(out, lse, r_out, r_lse, dqk=64, pv_length=tk, what=f"slot reuse, block_kv {block_kv}")


@pytest.mark.parametrize("name,causal,block_kv", [("ragged_context", True, 64), ("padding_nonfinite", False, 64),
                                                   ("two_tiles", True, 128)])
def test_pingpong_interpret(rng, name, causal, block_kv):
  """TuningConfig.pingpong (FA3's schedule barrier between the consumers) changes only the order of the
  consumers' tensor-core work: race-checked, no deadlock over ragged tiles (empty ones: one rendezvous each,
  paired), bitwise the default schedule's result, and within the error model of the reference."""
  q, k, v, cu, cu_k = _inputs(rng, name)
  scale = q.shape[2] ** -0.5
  run = lambda pingpong, interp: pf._mosaic_jit(q, k, v, cu, jnp.float32(scale), causal=causal, cu_seqlens_k=cu_k,
                                                interpret=interp, cfg=kp.TuningConfig(block_kv=block_kv,
                                                                                      pingpong=pingpong))
  testing.reset_interpreter()
  out, lse = run(True, RACES)
  assert not testing.races_found()
  base, base_lse = run(False, True)
  np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(base).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(base_lse))
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=scale, causal=causal, cu_seqlens_k=cu_k)
  _check(out, lse, r_out, r_lse, dqk=q.shape[2], pv_length=k.shape[0], what=f"pingpong {name}")


@pytest.mark.parametrize("name,causal,block_kv,pingpong", [("ragged_context", True, 64, False),
                                                            ("padding_nonfinite", False, 64, True),
                                                            ("two_tiles", True, 128, False)])
def test_pv_fp8_interpret(rng, name, causal, block_kv, pingpong):
  """TuningConfig.pv_fp8 (P·V as an fp8 wgmma over Vᵀ in e4m3 with per-column scales; the op's Vᵀ packing puts
  every sequence at a multiple of block_kv key columns): race-checked against the reference within the error model
  with P and V quantized too, the NaN rule of non-finite v and padding kept, bitwise deterministic."""
  q, k, v, cu, cu_k = _inputs(rng, name)
  scale = q.shape[2] ** -0.5
  cfg = kp.TuningConfig(block_kv=block_kv, pv_fp8=True, pingpong=pingpong)
  run = lambda interp: pf._mosaic_jit(q, k, v, cu, jnp.float32(scale), causal=causal, cu_seqlens_k=cu_k,
                                      interpret=interp, cfg=cfg)
  testing.reset_interpreter()
  out, lse = run(RACES)
  assert not testing.races_found()
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=scale, causal=causal, cu_seqlens_k=cu_k)
  _check(out, lse, r_out, r_lse, dqk=q.shape[2], pv_length=k.shape[0], what=f"pv_fp8 {name}", quantized_p=True)
  again, _ = run(True)
  np.testing.assert_array_equal(np.asarray(again).view(np.uint16), np.asarray(out).view(np.uint16))


def test_vt_fp8_packing(rng):
  """The op's Vᵀ for pv_fp8: every sequence's keys start at a multiple of block_kv columns, padding and
  non-finite elements are 0, and Vᵀ · vs dequantizes to v within e4m3's rounding (relative 2^-4 of the column's
  scale range)."""
  v = rng.normal(size=(70, 2, 64)).astype(np.float32)
  v[3, 1, 5] = np.inf
  cu = jnp.asarray([0, 5, 5, 70], jnp.int32)
  starts, src, n = pf._aligned_packing(cu, 70, 3, 64)
  assert n % 64 == 0 and list(np.asarray(starts)) == [0, 64, 64, 192]
  vt8, vs = pf._vt_fp8(jnp.asarray(v, jnp.bfloat16), src)
  assert vt8.shape == (2, 64, n) and vt8.dtype == jnp.float8_e4m3fn and vs.shape == (2, 64)
  deq = np.asarray(vt8, np.float32) * np.asarray(vs)[:, :, None]                   # [H, Dv, n]
  want = np.zeros((n, 2, 64), np.float32)
  s = np.asarray(src)
  want[s >= 0] = np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32)[s[s >= 0]]
  want[~np.isfinite(want)] = 0
  want = want.transpose(1, 2, 0)
  assert np.all(np.abs(deq - want) <= 2.0 ** -4 * np.abs(want) + 2.0 ** -10 * np.asarray(vs)[:, :, None] + 1e-7)


def test_aligned_packing_and_tiles():
  """Every sequence at a multiple of 8 rows in the kernel's packing, each row's source token; one tile per 128
  queries of a sequence with its rows, keys and bottom-right diagonal."""
  cu = jnp.asarray([2, 5, 5, 140], jnp.int32)                     # lengths 3, 0, 135; token 0, 1 padding
  starts, src, n_al = pf._aligned_packing(cu, 141, 3)
  assert n_al % 8 == 0 and n_al >= 8 + 0 + 136
  np.testing.assert_array_equal(np.asarray(starts), [0, 8, 8, 144])
  s = np.asarray(src)
  np.testing.assert_array_equal(s[:8], [2, 3, 4, -1, -1, -1, -1, -1])
  np.testing.assert_array_equal(s[8:143], np.arange(5, 140))
  assert np.all(s[143:] == -1)
  cu_k = jnp.asarray([0, 10, 10, 400], jnp.int32)
  k_starts, _, _ = pf._aligned_packing(cu_k, 400, 3)
  v_starts = jnp.asarray([40, 48, 56], jnp.int32)                # any rows (multiples of 8) of the kernel's v
  tiles, tile_start = pf._kernel_tiles(cu, cu_k, starts, k_starts, v_starts, 141, 3, causal=True)
  t = np.asarray(tiles)
  np.testing.assert_array_equal(np.asarray(tile_start), [0, 1, 1, 3])
  # fields q0, nq, k0, nk, diag, o0, v0
  np.testing.assert_array_equal(t[0, :7], [0, 3, 0, 10, 10 - 3, 2, 40])
  np.testing.assert_array_equal(t[1, :7], [8, 128, 16, 390, 390 - 135, 5, 56])
  np.testing.assert_array_equal(t[2, :7], [136, 7, 16, 390, 128 + 390 - 135, 133, 56])
  assert np.all(t[3:, 1] == 0)                                    # empty tiles: nothing stored


@pytest.mark.parametrize("poison", [False, True])
def test_kernel_interpret_reads_v_in_place(rng, monkeypatch, poison):
  """Key sequences at rows 0, 24, 64 of Tk = 72 (multiples of 8) and every v finite: the bf16 P·V kernel reads v
  as it is (no packed copy; tile field v0 = the caller's row); bitwise the packed path's result (the same products in
  the same order) and within the model of the reference. With a NaN in v the call is not clean and takes the
  packed path and the NaN rule."""
  t, tk, h, d = 40, 72, 2, 64
  cu, cu_k = jnp.asarray([0, 9, 40], jnp.int32), jnp.asarray([0, 24, 72], jnp.int32)
  q = jnp.asarray(rng.normal(size=(t, h, d)), jnp.bfloat16)
  k = jnp.asarray(rng.normal(size=(tk, h, d)), jnp.bfloat16)
  v = rng.normal(size=(tk, h, d)).astype(np.float32)
  if poison:
    v[30, 1, 5] = np.nan
  v = jnp.asarray(v, jnp.bfloat16)
  assert pf._v_direct(tk) and not pf._v_direct(tk - 1)
  assert bool(pf._v_in_place(pf._is_clean(v, cu, cu_k, t), cu_k)) == (not poison)
  assert not pf._v_in_place(True, jnp.asarray([0, 20, 72], jnp.int32))
  seen = []
  real = kp.prefill_sm90

  def spy(q8, k8, v_kernel, *a, **kw):
    seen.append(v_kernel.shape[0])
    return real(q8, k8, v_kernel, *a, **kw)
  monkeypatch.setattr(kp, "prefill_sm90", spy)
  bf16_pv = dataclasses.replace(kp.default_config(d, d), pv_fp8=False)    # v in place is the bf16 P·V's
  run = functools.partial(pf._mosaic_prefill, q, k, v, cu, jnp.float32(d ** -0.5), causal=True, cu_seqlens_k=cu_k,
                          interpret=RACES, cfg=bf16_pv)
  out, lse = run()
  assert sorted(seen) == [tk, pf._aligned_packing(cu_k, tk, 2)[2]]   # both branches of the cond are traced
  r_out, r_lse = ref.mla_prefill(q, k, v, cu, softmax_scale=d ** -0.5, causal=True, cu_seqlens_k=cu_k)
  _check(out, lse, r_out, r_lse, dqk=d, pv_length=tk, what="v in place")
  monkeypatch.setattr(pf, "_v_direct", lambda tk: False)                # the packed path only
  out_p, lse_p = run()
  np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(out_p).view(np.uint16))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_p))


def test_config_checks():
  with pytest.raises(ValueError, match="block_kv"):
    kp.TuningConfig(block_kv=32)
  with pytest.raises(ValueError, match="kv_stages"):
    kp.TuningConfig(kv_stages=4)
  with pytest.raises(ValueError, match="Dqk a multiple of 64"):
    kp.check_config(kp.TuningConfig(), 576, 512)
  with pytest.raises(ValueError, match="SMEM"):
    kp.check_config(kp.TuningConfig(block_kv=128, kv_stages=3), 256, 256)
  assert kp.smem_budget(kp.TuningConfig(), 192, 128) < kp.smem_budget(kp.TuningConfig(), 256, 256) <= 227 * 1024


def test_default_config_and_sweep():
  """128-key blocks where two stages of them fit (DeepSeek's 192 / 128), 64-key blocks at GLM-5's 256 / 256; the
  sweep lists the default once, as "default", and only configs that fit."""
  from mla_pallas.ops import prefill as pf
  assert kp.default_config(192, 128) == kp.TuningConfig(block_kv=128, kv_stages=2, pv_fp8=True)
  assert kp.default_config(256, 256) == kp.TuningConfig(pv_fp8=True)
  for dqk, dv in ((192, 128), (256, 256)):
    sweep = pf.sweep_configs(dqk, dv)
    assert list(sweep)[0] == "default" and sweep["default"] == ()
    cfgs = [pf._tuned_config(t, dqk, dv) for t in sweep.values()]
    assert len(set(cfgs)) == len(cfgs) and cfgs[0] == kp.default_config(dqk, dv)
    assert all(kp.smem_budget(c, dqk, dv) <= kp.common.SMEM_LIMIT for c in cfgs)
    assert sweep["pingpong=True"] == (("pingpong", True),)     # the schedule candidate, at the default blocks
    assert sweep["block_kv=64,pv_fp8=False"] == (("block_kv", 64), ("pv_fp8", False))   # bf16 P·V: fits at both
  assert "block_kv=128,pv_fp8=False" in pf.sweep_configs(192, 128)
  assert "block_kv=128,pv_fp8=False" not in pf.sweep_configs(256, 256)     # bf16 V: too much SMEM
  assert "block_kv=128,kv_stages=2" not in pf.sweep_configs(256, 256)      # fp8 P·V at 128-key blocks: 247 KB
  with pytest.raises(ValueError, match="Dv a multiple of 64"):
    kp.default_config(192, 100)


def test_dispatch(rng):
  """On this CPU: impl="mosaic" without interpret has no device to run on; "auto" runs XLA (and keeps XLA on
  hardware until the kernel's GPU tests pass); inputs the kernel lacks say why."""
  q, k, v, cu, _ = _inputs(rng, "ragged_self")
  with pytest.raises(NotImplementedError, match="no Mosaic GPU kernel can run"):
    mla_prefill(q, k, v, cu, softmax_scale=1.0, impl="mosaic")
  mla_prefill(q, k, v, cu, softmax_scale=1.0, impl="auto")
  assert _dispatch.last_impl("mla_prefill") == "xla"
  assert pf._KERNEL_VALIDATED_ON == ()
  with pytest.raises(NotImplementedError, match="bfloat16 q, k, v"):
    mla_prefill(q.astype(jnp.float32), k, v, cu, softmax_scale=1.0, impl="mosaic", interpret=True)
  with pytest.raises(NotImplementedError, match="multiple of 64"):
    mla_prefill(q[..., :24], k[..., :24], v, cu, softmax_scale=1.0, impl="mosaic", interpret=True)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dims", [(192, 128), (256, 256)], ids=["deepseek_v32", "glm5"])
def test_kernel_lowers_for_sm90(dims, causal):
  """Mosaic's layout inference, wgmma and TMA checks at both models' head dims: per key block one fp8 QKᵀ
  (Dqk / 32 wgmma instructions of K = 32) and, with ``pv_fp8=False``, one bf16 P·V (block_kv / 16 of K = 16), in
  each of the two key loops (blocks without and with a mask); setmaxnreg up and down; the per-row scales' shape
  check; the default's fp8 P·V below."""
  dqk, dv = dims
  S = jax.ShapeDtypeStruct
  tq, tk, h, nt = 304, 512, 4, 5
  avals = (S((tq, h, dqk), kp.FP8), S((tk, h, dqk), kp.FP8), S((tk, h, dv), jnp.bfloat16), S((nt, 8), jnp.int32),
           S((h, tq), jnp.float32), S((h, tk), jnp.float32))
  cfg = dataclasses.replace(kp.default_config(dqk, dv), pv_fp8=False)
  low = testing.lower_for_cuda(functools.partial(kp.prefill_sm90, cfg=cfg, causal=causal, out_rows=300), *avals)
  assert low.count(r"wgmma.mma_async") == 2 * (dqk // 32 + cfg.block_kv // 16)   # the unmasked and masked loops
  assert low.count(r"e4m3") > 0 and low.count("setmaxnreg") == 2
  if causal:   # the ping-pong schedule lowers too, with the same products
    pp = testing.lower_for_cuda(functools.partial(kp.prefill_sm90, cfg=dataclasses.replace(cfg, pingpong=True),
                                                  causal=causal, out_rows=300), *avals)
    assert pp.count(r"wgmma.mma_async") == low.count(r"wgmma.mma_async")
    # pv_fp8: P·V as e4m3 wgmmas of K = 32 (block_kv / 32 per block) reading Vᵀ [H, Dv, Tv]; at 256 / 256 only
    # 64-key blocks fit
    b = 128 if dqk == 192 else 64
    assert kp.default_config(dqk, dv) == kp.TuningConfig(block_kv=b, pv_fp8=True)
    fp8 = testing.lower_for_cuda(functools.partial(kp.prefill_sm90, cfg=kp.TuningConfig(block_kv=b, pv_fp8=True),
                                                   causal=causal, out_rows=300),
                                 *avals[:2], S((h, dv, tk), kp.FP8), *avals[3:], S((h, dv), jnp.float32))
    assert fp8.count(rf"m64n{dv}k32\.f32\.e4m3\.e4m3") == 2 * (b // 32) + (2 * dqk // 32 if b == dv else 0)
    assert fp8.count(r"wgmma.mma_async") == 2 * (dqk // 32 + b // 32)
    with pytest.raises(ValueError, match="multiple of block_kv"):
      kp.prefill_sm90(*zeros_of(avals[:2]), jnp.zeros((h, dv, tk - 8), kp.FP8), *zeros_of(avals[3:]),
                      jnp.ones((h, dv), jnp.float32), cfg=kp.TuningConfig(block_kv=b, pv_fp8=True), causal=causal,
                      out_rows=300)
  with pytest.raises(ValueError, match="multiple of 8 rows"):
    kp.prefill_sm90(jnp.zeros((300, h, dqk), kp.FP8), *[jnp.zeros(a.shape, a.dtype) for a in avals[1:]], cfg=cfg,
                    causal=causal, out_rows=300)
  zeros = [jnp.zeros(a.shape, a.dtype) for a in avals]
  with pytest.raises(ValueError, match=r"ks must be float32 \[4, 512\]"):
    kp.prefill_sm90(*zeros[:5], jnp.zeros((h,), jnp.float32), cfg=cfg, causal=causal, out_rows=300)
