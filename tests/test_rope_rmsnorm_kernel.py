"""fused_rope_rmsnorm_quantization / rope_rmsnorm through the Mosaic GPU kernel (mla_pallas.kernels.rope_rmsnorm)
on the CPU: interpret mode with race detection against the references, lowering for CUDA at sm_90, dispatch and
argument checks.

Tolerance (see :func:`assert_near_bitwise`): results equal the jitted reference bitwise except for a few elements
(at most 0.2 % here; typically 0-6 per case) one representable step away (bf16 ulp / e4m3 step) or within 2^-18
absolute: the kernel's RMS sum order differs from XLA's, and XLA:CPU contracts ``a*c - b*s`` into an FMA in the
jitted reference while the interpreter does not. Untouched cache rows are compared
bitwise (they hold NaN). The helpers here are also used by tests/test_rope_rmsnorm_kernel_gpu.py.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import mla_pallas
from mla_pallas import _dispatch, testing
from mla_pallas import reference as ref
from mla_pallas.kernels import common
from mla_pallas.kernels import rope_rmsnorm as rk
from mla_pallas.ops import rope_rmsnorm as op

from _rope_inputs import FP8, REF_WRITE, bits, check_fused, check_unfused, make_case


def _fused(case, interleaved, impl="mosaic", interpret=True):
  return mla_pallas.fused_rope_rmsnorm_quantization(
      jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, eps=case.eps,
      kv_scale=case.kv_scale, slots=case.slots, interleaved=interleaved, impl=impl, interpret=interpret)


def _races():
  return plgpu.InterpretGPUParams(detect_races=True)


@pytest.mark.parametrize("t,h,interleaved", [
    (1, 64, True),      # one token, one partial block
    (5, 128, False),    # two 64-head tiles per token, NeoX pairing
    (37, 64, True),     # odd T
    (70, 64, False),    # two blocks, the second partial (kv rows padded to a multiple of 8)
    (5, 16, True),      # H < 64: one q tile holds 4 tokens; T * H < 64 (q padded to one tile)
    (70, 32, False),    # H < 64, two blocks, a partial last q tile
    (9, 4, True),       # H = 4: 16 tokens per q tile
])
def test_fused_kernel_interpret_matches_reference(rng, t, h, interleaved):
  case = make_case(rng, t, h)
  new_pages, q_out = _fused(case, interleaved, interpret=_races())
  assert _dispatch.last_impl("fused_rope_rmsnorm_quantization") == "mosaic-interpret"
  assert not testing.races_found(), "the interpreter found a data race in the kernel"
  assert new_pages.shape == case.pages.shape and new_pages.dtype == FP8
  assert q_out.shape == (t, h, 64) and q_out.dtype == jnp.bfloat16
  check_fused(case, new_pages, q_out, interleaved, max_frac=2e-3)


def test_fused_kernel_duplicate_and_skipped_slots(rng):
  """Duplicated slots: the last token wins (the op keeps only the last writer, so CTAs never race); -1 and
  out-of-range slots are skipped; a flat [num_slots, 576] cache works too."""
  case = make_case(rng, 70, 64, skip=False)
  slots = np.asarray(case.slots).copy()
  slots[[3, 66, 10]] = slots[0]            # the same slot from both blocks: token 66 (block 1) must win
  slots[[5, 40]] = [-1, 10 ** 6]
  case.slots = jnp.asarray(slots)
  case.pages = case.pages.reshape(-1, 576)
  new_pages, q_out = _fused(case, True)
  check_fused(case, new_pages, q_out, True, max_frac=2e-3)


@pytest.mark.parametrize("t,h,interleaved", [(5, 64, False), (70, 64, True), (37, 16, True)])
def test_unfused_kernel_interpret_matches_reference(rng, t, h, interleaved):
  case = make_case(rng, t, h)
  kv_out, q_out = mla_pallas.rope_rmsnorm(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w,
                                          eps=case.eps, interleaved=interleaved, impl="mosaic", interpret=_races())
  assert _dispatch.last_impl("rope_rmsnorm") == "mosaic-interpret"
  assert not testing.races_found(), "the interpreter found a data race in the kernel"
  assert kv_out.shape == (t, 576)
  check_unfused(case, kv_out, q_out, interleaved, max_frac=2e-3)


def test_swap_matrix_and_tables_reproduce_reference_rope(rng):
  """The kernel's formulation y = x*C + (x @ P)*S, evaluated in numpy f32 without FMA, equals the reference's
  pairing for both conventions (checks P and the table arrangement independently of the kernel)."""
  cos, sin = ref.rope_tables(128)
  x = np.asarray(rng.normal(size=(9, 64)), np.float32)
  pos = jnp.asarray(rng.integers(0, 128, size=9), jnp.int32)
  for interleaved in (True, False):
    c_tab, s_tab = (np.asarray(a) for a in op._kernel_tables(pos, cos, sin, interleaved, 9))
    swapped = x @ np.asarray(op._swap_matrix(interleaved), np.float32)
    got = x * c_tab + swapped * s_tab
    want = np.asarray(ref.rope(jnp.asarray(x), pos, cos, sin, interleaved=interleaved))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def _avals(t, h, fused, num_slots=4096):
  s = jax.ShapeDtypeStruct
  tp = -(-t // rk.TB) * rk.TB
  av = [s((rk.kv_rows_for(t), 576), jnp.bfloat16), s((rk.q_rows_for(t, h), 64), jnp.bfloat16),
        s((tp, 64), jnp.float32), s((tp, 64), jnp.float32), s((8, 64), jnp.float32), s((64, 64), jnp.bfloat16)]
  if fused:
    return av + [s((tp,), jnp.int32), s((2,), jnp.float32), s((num_slots, 9, 64), FP8)]
  return av + [s((2,), jnp.float32)]


@pytest.mark.parametrize("t,h,fused", [(5, 64, True), (8192, 128, True), (70, 128, False), (8192, 64, False),
                                        (8192, 16, True), (37, 32, False)])
def test_kernel_lowers_for_sm90(t, h, fused):
  kern = rk.build(t, h, 4096 if fused else 0, fused)
  if fused:
    def f(*a):
      cache = jax.new_ref(a[-1])
      return kern(*a[:-1], cache), jax.freeze(cache)
  else:
    f = kern
  low = testing.lower_for_cuda(f, *_avals(t, h, fused), arch=(9, 0))
  assert "mosaic_gpu" in low.hlo
  # fused: the cache is an input/output alias of the custom call (updated in place)
  assert ("output_operand_aliases" in low.hlo) == fused
  assert low.count("wgmma") > 0


def test_fused_op_donates_and_aliases_the_cache():
  s = jax.ShapeDtypeStruct
  t, h = 70, 64
  args = (s((64, 16, 576), FP8), s((t, 576), jnp.bfloat16), s((t, h, 64), jnp.bfloat16), s((t,), jnp.int32),
          s((128, 32), jnp.float32), s((128, 32), jnp.float32), s((512,), jnp.bfloat16), s((), jnp.float32),
          s((), jnp.float32), s((t,), jnp.int32))
  with _target_sm90():
    hlo = op._fused_mosaic.trace(*args, interleaved=True, interpret=False).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "tf.aliasing_output = 0" in hlo, "pages is not donated into output 0"
  assert "output_operand_aliases" in hlo


def _target_sm90():
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  @contextlib.contextmanager
  def ctx():
    old = mgpu_utils._infer_arch
    mgpu_utils._infer_arch = lambda: (9, 0)
    try:
      yield
    finally:
      mgpu_utils._infer_arch = old
  return ctx()


def test_dispatch_and_unsupported_inputs(rng):
  case = make_case(rng, 3, 48)
  # H = 48 is neither a multiple nor a divisor of 64: "mosaic" raises, "auto" falls back to XLA (bitwise the ref)
  with pytest.raises(NotImplementedError, match="divisor of 64"):
    _fused(case, True, impl="mosaic", interpret=True)
  new_pages, q_out = _fused(case, True, impl="auto", interpret=True)
  assert _dispatch.last_impl("fused_rope_rmsnorm_quantization") == "xla"
  r_pages, r_q = REF_WRITE(jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin,
                           case.w, eps=case.eps, kv_scale=case.kv_scale, slots=case.slots, interleaved=True)
  np.testing.assert_array_equal(bits(new_pages), bits(r_pages))
  np.testing.assert_array_equal(bits(q_out), bits(r_q))
  # float32 activations: no kernel
  case64 = make_case(rng, 3, 64)
  with pytest.raises(NotImplementedError, match="bfloat16"):
    mla_pallas.rope_rmsnorm(case64.kv.astype(jnp.float32), case64.q_rope, case64.positions, case64.cos,
                            case64.sin, case64.w, eps=1e-6, impl="mosaic", interpret=True)
  # no GPU here and no interpret: "mosaic" raises, "auto" runs XLA
  if _dispatch.mosaic_arch(False) is None:
    with pytest.raises(NotImplementedError):
      _fused(case64, True, impl="mosaic", interpret=False)
    _fused(case64, True, impl="auto", interpret=False)
    assert _dispatch.last_impl("fused_rope_rmsnorm_quantization") == "xla"


def test_bad_inputs_raise_value_error_before_dispatch(rng):
  case = make_case(rng, 4, 64)
  kw = dict(eps=1e-6, impl="mosaic", interpret=True)
  with pytest.raises(ValueError, match="kv"):
    mla_pallas.rope_rmsnorm(case.kv[:, :512], case.q_rope, case.positions, case.cos, case.sin, case.w, **kw)
  with pytest.raises(ValueError, match="q_rope"):
    mla_pallas.rope_rmsnorm(case.kv, case.q_rope[:, :, :32], case.positions, case.cos, case.sin, case.w, **kw)
  with pytest.raises(ValueError, match="positions"):
    mla_pallas.rope_rmsnorm(case.kv, case.q_rope, case.positions.astype(jnp.float32), case.cos, case.sin, case.w,
                            **kw)
  with pytest.raises(ValueError, match="interleaved"):
    mla_pallas.rope_rmsnorm(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, interleaved=1, **kw)
  pages = jnp.asarray(case.pages)
  with pytest.raises(ValueError, match="kv_scale"):
    mla_pallas.fused_rope_rmsnorm_quantization(pages, case.kv, case.q_rope, case.positions, case.cos, case.sin,
                                               case.w, kv_scale=0.0, slots=case.slots, **kw)
  with pytest.raises(ValueError, match="slots"):
    mla_pallas.fused_rope_rmsnorm_quantization(pages, case.kv, case.q_rope, case.positions, case.cos, case.sin,
                                               case.w, kv_scale=1.0, slots=case.slots[:2], **kw)
  with pytest.raises(ValueError, match="pages"):
    mla_pallas.fused_rope_rmsnorm_quantization(pages.astype(jnp.bfloat16), case.kv, case.q_rope, case.positions,
                                               case.cos, case.sin, case.w, kv_scale=1.0, slots=case.slots, **kw)


def test_tuning_config_validates():
  assert rk.TuningConfig().stages == 3
  for bad in (0, -1, 9):
    with pytest.raises(ValueError):
      rk.TuningConfig(stages=bad)
  for bad in (0, 65):
    with pytest.raises(ValueError, match="q_splits"):
      rk.TuningConfig(q_splits=bad)


def test_default_q_splits_fill_the_gpu_and_keep_work_per_cta():
  assert rk.default_q_splits(1, 128) == 1              # 2 q tiles: no split
  assert rk.default_q_splits(4096, 128) == 5          # 64 blocks x 5 >= 2 x 132 CTAs
  assert rk.default_q_splits(8192, 16) == 3           # 16 q tiles per block: at least 4 each
  assert rk.default_q_splits(10 ** 6, 128) == 1       # plenty of blocks
  assert rk.smem_budget(rk.TuningConfig(), True) <= common.SMEM_LIMIT


@pytest.mark.parametrize("t", [1, 37, op.PAIRWISE_MAX_T + 88])   # both branches of the duplicate check
def test_last_writer_matches_python_oracle(rng, t):
  num_slots = max(t // 2, 4)                  # many duplicates
  slots = rng.integers(-3, num_slots + 3, size=t).astype(np.int32)   # -3..-1 and >= num_slots: skipped
  want = np.zeros(t, bool)
  seen = set()
  for i in range(t - 1, -1, -1):              # the last token of each in-range slot wins
    s = int(slots[i])
    if 0 <= s < num_slots and s not in seen:
      want[i] = True
      seen.add(s)
  got = np.asarray(jax.jit(op._last_writer, static_argnums=1)(jnp.asarray(slots), num_slots))
  np.testing.assert_array_equal(got, want)
