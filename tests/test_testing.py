"""Tests of mla_pallas.testing: FP8 comparison, error model, interpret mode and CUDA lowering helpers."""
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas import testing


def _rand(shape, seed=0, dtype=np.float32):
  return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# ---- compare_fp8 -----------------------------------------------------------------------------------------

def test_identical_passes_with_matching_nan_and_inf():
  x = _rand((4, 3, 64), seed=1)
  x[0, 1, 5] = np.nan
  x[2, 0, :] = -np.inf         # e.g. lse of a row with nothing to attend to
  x[3, 2, 7] = np.inf
  rep = testing.compare_fp8(x, x.copy(), rel_l2=0.0, max_abs=0.0, min_cos=1.0 - 1e-12, what="same")
  assert rep.ok, rep.summary()
  assert rep.rel_l2 == 0.0 and rep.max_abs == 0.0
  assert rep.nan_mismatch == 0 and rep.inf_mismatch == 0
  assert rep.n_finite == x.size - 1 - 64 - 1
  assert "[PASS] same" in rep.summary()


def test_nan_position_mismatch_detected():
  want = _rand((8, 32), seed=2)
  got = want.copy()
  got[3, 4] = np.nan           # NaN where the reference has a number
  want[5, 6] = np.nan          # and a reference NaN the result does not reproduce
  rep = testing.compare_fp8(got, want, rel_l2=1.0)
  assert not rep.ok
  assert rep.nan_mismatch == 2
  assert "NaN" in rep.summary() and "[FAIL]" in rep.summary()
  # The finite entries still agree exactly: the failure is only the NaN positions.
  assert rep.rel_l2 == 0.0


def test_inf_position_and_sign_mismatch_detected():
  want = _rand((16,), seed=3)
  want[0] = -np.inf
  want[1] = np.inf
  got = want.copy()
  got[0] = np.inf              # sign flip
  got[1] = 1.0                 # finite where the reference is inf
  got[2] = -np.inf             # inf where the reference is finite
  rep = testing.compare_fp8(got, want, rel_l2=1.0)
  assert rep.inf_mismatch == 3
  assert not rep.ok


def test_perturbed_tensor_fails_and_small_perturbation_passes():
  want = _rand((2, 4, 16, 512), seed=4)
  noise = _rand(want.shape, seed=5)
  big = want + 0.1 * noise     # rel-L2 ~ 0.1 (independent N(0,1) noise of 10% the size)
  small = want + 0.01 * noise  # rel-L2 ~ 0.01
  rep_big = testing.compare_fp8(big, want, rel_l2=0.05)
  rep_small = testing.compare_fp8(small, want, rel_l2=0.05)
  assert not rep_big.ok and 0.09 < rep_big.rel_l2 < 0.11, rep_big.summary()
  assert rep_small.ok and 0.009 < rep_small.rel_l2 < 0.011, rep_small.summary()
  # Exact metric values against a direct computation.
  d = (big - want).astype(np.float64)
  assert rep_big.rel_l2 == pytest.approx(np.linalg.norm(d) / np.linalg.norm(want.astype(np.float64)))
  assert rep_big.max_abs == pytest.approx(np.abs(d).max())
  g64, w64 = big.astype(np.float64).ravel(), want.astype(np.float64).ravel()
  assert rep_big.cosine == pytest.approx(g64 @ w64 / (np.linalg.norm(g64) * np.linalg.norm(w64)))
  idx, g, w = rep_big.worst
  assert abs(g - w) == pytest.approx(rep_big.max_abs)
  assert big[idx] == pytest.approx(g)


def test_bf16_and_fp8_inputs_and_thresholds():
  want = _rand((64, 64), seed=6)
  got = jnp.asarray(want).astype(jnp.float8_e4m3fn)   # e4m3 rounding: rel-L2 ~ 0.02-0.04
  rep = testing.compare_fp8(got, jnp.asarray(want, jnp.bfloat16), rel_l2=0.05, min_cos=0.99)
  assert rep.ok, rep.summary()
  assert not testing.compare_fp8(got, want, rel_l2=0.05, max_abs=1e-3).ok   # max_abs is checked too
  assert not testing.compare_fp8(got, want, rel_l2=0.05, min_cos=0.99999).ok


def test_shape_mismatch_and_zero_reference():
  rep = testing.compare_fp8(np.zeros((2, 3)), np.zeros((3, 2)), rel_l2=1.0)
  assert not rep.ok and "shape mismatch" in rep.summary()
  zeros = np.zeros((5,))
  assert testing.compare_fp8(zeros, zeros, rel_l2=0.0).ok             # 0 vs 0: rel-L2 0, cosine 1
  rep = testing.compare_fp8(np.ones((5,)), zeros, rel_l2=1e9)
  assert not rep.ok and math.isinf(rep.rel_l2)


def test_assert_close_fp8_raises_with_summary():
  want = _rand((32,), seed=7)
  assert testing.assert_close_fp8(want, want, rel_l2=0.0).ok
  with pytest.raises(AssertionError, match=r"\[FAIL\] out: .*rel_l2"):
    testing.assert_close_fp8(want + 1.0, want, rel_l2=0.01, what="out")


# ---- error model -----------------------------------------------------------------------------------------

def test_e4m3_rounding_rms_within_model():
  # The model's basic assumption: RMS relative error of e4m3 round-to-nearest <= u/sqrt(3) = 0.036, max <= u.
  # Values drawn log-uniformly over [2^-6, 256] (normal e4m3 range, away from 448) so every binade is covered.
  rng = np.random.default_rng(8)
  x = np.exp2(rng.uniform(-6, 8, size=200_000)) * rng.choice([-1, 1], size=200_000)
  x8 = x.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
  rel = (x8 - x) / x
  assert np.max(np.abs(rel)) <= testing.E4M3_UNIT_ROUNDOFF * (1 + 1e-12)
  rms = np.sqrt(np.mean(rel ** 2))
  assert 0.5 * testing.E4M3_UNIT_ROUNDOFF / math.sqrt(3) < rms <= testing.E4M3_UNIT_ROUNDOFF / math.sqrt(3)


def test_fp8_error_budget_values():
  terms = testing.fp8_error_terms()
  assert terms["k_fp8"] == terms["v_fp8"] == 0.0          # the cache is already fp8 in the reference
  assert terms["q_fp8"] == pytest.approx(2.0 ** -4 / math.sqrt(3))
  # QK^T at K=576: measured max abs 0.09 over sqrt(576) = 24 (relative to the dot product's std).
  assert terms["qk_mma"] == pytest.approx(0.09 / 24)
  full = testing.fp8_error_budget()
  assert full == pytest.approx(3.0 * math.sqrt(sum(t * t for t in terms.values())))
  assert 0.1 < full < 0.2
  bf16_only = testing.fp8_error_budget(quantized_q=False, quantized_p=False, fp8_mma=False)
  assert bf16_only == pytest.approx(3 * math.sqrt(2) * 2.0 ** -8 / math.sqrt(3))
  assert testing.fp8_error_budget(quantized_kv=True) > full
  assert testing.fp8_error_budget(logit_std=2.0) > full
  assert testing.fp8_budget is testing.fp8_error_budget
  with pytest.raises(ValueError, match="safety"):
    testing.fp8_error_budget(safety=0)


def test_fp8_budget_covers_simulated_fp8_attention():
  # Simulate the FP8 path in numpy (q and P rounded to e4m3, exact products) on random data and check that the
  # observed rel-L2 lies below the budget but within a factor ~6 of it (the model is not absurdly loose).
  rng = np.random.default_rng(9)
  h, k, scale = 16, 256, 576 ** -0.5
  q = rng.standard_normal((h, 576))
  kv = rng.standard_normal((k, 576)).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)

  def attend(qq, quant):
    s = scale * qq @ kv.T
    p = np.exp(s - s.max(-1, keepdims=True))
    l = p.sum(-1, keepdims=True)
    if quant:
      p = (p * 256).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) / 256
    return p @ kv[:, :512] / l

  amax = np.abs(q).max(-1, keepdims=True) / 448
  q8 = (q / amax).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * amax
  got, want = attend(q8, True), attend(q, False)
  rel = np.linalg.norm(got - want) / np.linalg.norm(want)
  budget = testing.fp8_error_budget(fp8_mma=False, bf16_output=False, pv_length=k)
  assert rel < budget
  assert rel > budget / 6


# ---- interpret mode and lowering -------------------------------------------------------------------------

def _tma_add_kernel():
  """o = x + y through TMA copies into SMEM (128x128 f32)."""
  def body(x_gmem, y_gmem, o_gmem, x_smem, y_smem, bars):
    plgpu.copy_gmem_to_smem(x_gmem, x_smem, bars.at[0])
    plgpu.copy_gmem_to_smem(y_gmem, y_smem, bars.at[1])
    plgpu.barrier_wait(bars.at[0])
    plgpu.barrier_wait(bars.at[1])
    x_smem[...] = x_smem[...] + y_smem[...]
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(x_smem, o_gmem)
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((128, 128), jnp.float32),
                      scratch_types=[plgpu.SMEM((128, 128), jnp.float32)] * 2
                      + [plgpu.Barrier(num_barriers=2)])


AVAL = jax.ShapeDtypeStruct((128, 128), jnp.float32)


@pytest.mark.parametrize("arch", [(9, 0), (10, 0)])
def test_lower_for_cuda(arch):
  low = testing.lower_for_cuda(_tma_add_kernel(), AVAL, AVAL, arch=arch)
  assert "mosaic_gpu" in low.hlo
  assert len(low.mosaic) == 1
  assert low.count(rf"mosaic_gpu\.arch_major = {arch[0]} ") == 1
  assert low.count(r"cp\.async\.bulk") > 0      # the TMA copies made it into the module


def test_lower_for_cuda_does_not_reuse_cached_arch():
  kernel = _tma_add_kernel()
  a = testing.lower_for_cuda(kernel, AVAL, AVAL, arch=(9, 0))
  b = testing.lower_for_cuda(kernel, AVAL, AVAL, arch=(10, 0))
  assert a.count(r"arch_major = 9 ") == 1 and b.count(r"arch_major = 10 ") == 1


def test_interpret_mode_runs_kernel_without_races():
  x = jnp.asarray(_rand((128, 128), seed=10))
  y = jnp.asarray(_rand((128, 128), seed=11))
  with testing.interpret_mode(detect_races=True):
    out = jax.jit(_tma_add_kernel())(x, y)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(x) + np.asarray(y))   # f32 add: exact
  assert not testing.races_found()


def test_interpret_mode_resets_state_on_error(monkeypatch):
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
  calls = []
  orig = ipc.reset_gpu_interpret_mode_state
  monkeypatch.setattr(ipc, "reset_gpu_interpret_mode_state", lambda: (calls.append(1), orig())[1])
  with pytest.raises(RuntimeError, match="boom"):
    with testing.interpret_mode():
      raise RuntimeError("boom")
  assert len(calls) == 2   # on entry and after the error


def test_device_kind():
  kind = testing.device_kind()
  assert isinstance(kind, str) and kind
  if jax.default_backend() == "cpu":
    assert kind == "cpu"


def test_module_cites_shared_notes_not_a_machine_path():
  # The shared Mosaic GPU notes are cited by their path relative to the repository (../shared/mgpu/README.md);
  # no absolute machine path and no dated history lines in the module.
  import re
  src = open(testing.__file__).read()
  assert "/work/" not in src
  assert "../shared/mgpu/README.md" in src
  assert not re.search(r"\b20\d\d-\d\d-\d\d", src)
