"""fused_rope_rmsnorm_quantization / rope_rmsnorm on the CPU: the XLA path against the references (bitwise: it is
the reference's float32 math), interpret mode (which runs the XLA path under every impl: the kernel,
mla_pallas.kernels.rope_direct, is raw Mosaic GPU), dispatch, argument checks, the XLA duplicate-slot check, the
unique_slots promise, and the cache donation / in-place aliasing of the kernel path (lowered for sm_90). The kernel's
lowering is tested in tests/test_rope_direct_kernel.py and its numbers on the GPU in
tests/test_rope_rmsnorm_kernel_gpu.py, which also uses the helpers of tests/_rope_inputs.py.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mla_pallas
from mla_pallas import _dispatch
from mla_pallas.ops import rope_rmsnorm as op

from _rope_inputs import FP8, REF_ROPE_RMSNORM, REF_WRITE, bits, make_case


def _fused(case, interleaved, impl="mosaic", interpret=True, **kw):
  return mla_pallas.fused_rope_rmsnorm_quantization(
      jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, eps=case.eps,
      kv_scale=case.kv_scale, slots=case.slots, interleaved=interleaved, impl=impl, interpret=interpret, **kw)


def _unfused(case, interleaved, impl="mosaic", interpret=True):
  return mla_pallas.rope_rmsnorm(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, eps=case.eps,
                                 interleaved=interleaved, impl=impl, interpret=interpret)


def _want_fused(case, interleaved):
  return REF_WRITE(jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w,
                   eps=case.eps, kv_scale=case.kv_scale, slots=case.slots, interleaved=interleaved)


@pytest.mark.parametrize("impl", ["auto", "mosaic", "xla"])
@pytest.mark.parametrize("t,h,interleaved", [(1, 128, True), (37, 48, False), (300, 16, True), (9, 1, False)])
def test_interpret_mode_runs_the_xla_path(rng, impl, t, h, interleaved):
  """interpret=True under every impl: the XLA path (recorded as "xla"), bitwise the reference, duplicated / skipped
  / out-of-range slots and a NaN-poisoned cache included (make_case; duplicates added here)."""
  case = make_case(rng, t, h)
  if t >= 8:
    slots = np.asarray(case.slots).copy()
    slots[[0, t // 2, t - 1]] = slots[1]
    case.slots = jnp.asarray(slots)
  new_pages, q_out = _fused(case, interleaved, impl=impl)
  assert _dispatch.last_impl("fused_rope_rmsnorm_quantization") == "xla"
  r_pages, r_q = _want_fused(case, interleaved)
  np.testing.assert_array_equal(bits(new_pages), bits(r_pages))
  np.testing.assert_array_equal(bits(q_out), bits(r_q))
  kv_out, q_out = _unfused(case, interleaved, impl=impl)
  assert _dispatch.last_impl("rope_rmsnorm") == "xla"
  r_kv, r_q = REF_ROPE_RMSNORM(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, eps=case.eps,
                               interleaved=interleaved)
  np.testing.assert_array_equal(bits(kv_out), bits(r_kv))
  np.testing.assert_array_equal(bits(q_out), bits(r_q))


def test_dispatch_without_a_gpu(rng):
  """No Hopper GPU and no interpret: "mosaic" raises NotImplementedError, "auto" runs XLA (bitwise the reference);
  float32 activations have no kernel."""
  if _dispatch.mosaic_arch(False) is not None:
    pytest.skip("a Mosaic-capable GPU is present")
  case = make_case(rng, 3, 64)
  for fn, name in ((_fused, "fused_rope_rmsnorm_quantization"), (_unfused, "rope_rmsnorm")):
    with pytest.raises(NotImplementedError, match="no Mosaic GPU kernel"):
      fn(case, True, impl="mosaic", interpret=False)
    fn(case, True, impl="auto", interpret=False)
    assert _dispatch.last_impl(name) == "xla"
  new_pages, q_out = _fused(case, True, impl="auto", interpret=False)
  r_pages, r_q = _want_fused(case, True)
  np.testing.assert_array_equal(bits(new_pages), bits(r_pages))
  np.testing.assert_array_equal(bits(q_out), bits(r_q))


def test_kernel_support_check(monkeypatch):
  """The kernel takes bfloat16 kv / q_rope, T, H >= 1 and a non-empty cache on sm_90; other inputs and devices
  raise NotImplementedError naming the reason (a simulated device: _dispatch.mosaic_arch patched)."""
  s = jax.ShapeDtypeStruct
  kv, q = s((4, 576), jnp.bfloat16), s((4, 8, 64), jnp.bfloat16)
  monkeypatch.setattr(_dispatch, "mosaic_arch", lambda interpret=False: "sm90")
  op._kernel_supported("op", kv, q, 64)()
  with pytest.raises(NotImplementedError, match="bfloat16"):
    op._kernel_supported("op", s((4, 576), jnp.float32), q)()
  with pytest.raises(NotImplementedError, match="T = 0"):
    op._kernel_supported("op", s((0, 576), jnp.bfloat16), s((0, 8, 64), jnp.bfloat16))()
  with pytest.raises(NotImplementedError, match="empty cache"):
    op._kernel_supported("op", kv, q, 0)()
  monkeypatch.setattr(_dispatch, "mosaic_arch", lambda interpret=False: "sm100")
  with pytest.raises(NotImplementedError, match="sm_90"):
    op._kernel_supported("op", kv, q, 64)()


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
    mla_pallas.fused_rope_rmsnorm_quantization(pages.astype(jnp.float16), case.kv, case.q_rope, case.positions,
                                               case.cos, case.sin, case.w, kv_scale=1.0, slots=case.slots, **kw)


@pytest.mark.parametrize("t", [1, 37, op.PAIRWISE_MAX_T, op.PAIRWISE_MAX_T + 88])   # both branches
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


@pytest.mark.parametrize("impl", ["xla", "mosaic"])
def test_unique_slots_promise_skips_the_scan_and_changes_nothing(rng, impl):
  """unique_slots=True (the caller promises distinct valid slots, as unique_indices of a JAX scatter) gives bitwise
  the same cache and q as the default duplicate-slot scan when the slots are distinct (make_case draws a
  permutation, plus -1 / out-of-range entries), and the op jaxpr then has no scan: no [T, T] compare, no scatter-max."""
  case = make_case(rng, 70, 16)
  outs = []
  for unique in (False, True):
    outs.append(mla_pallas.fused_rope_rmsnorm_quantization(
        jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, eps=case.eps,
        kv_scale=case.kv_scale, slots=case.slots, unique_slots=unique, impl=impl, interpret=True))
  for a, b in zip(*outs):
    assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  num_slots = case.pages.size // 576
  promised = jax.make_jaxpr(lambda s: op._dest_slots(s, num_slots, True, -1))(case.slots)
  scanned = jax.make_jaxpr(lambda s: op._dest_slots(s, num_slots, False, -1))(case.slots)
  assert len(promised.eqns) < len(scanned.eqns)
  with pytest.raises(ValueError, match="unique_slots"):
    mla_pallas.fused_rope_rmsnorm_quantization(
        jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, eps=case.eps,
        kv_scale=case.kv_scale, slots=case.slots, unique_slots=1, impl=impl, interpret=True)


def test_fused_op_donates_and_aliases_the_cache():
  s = jax.ShapeDtypeStruct
  t, h = 70, 64
  args = (s((64, 16, 576), FP8), s((t, 576), jnp.bfloat16), s((t, h, 64), jnp.bfloat16), s((t,), jnp.int32),
          s((128, 32), jnp.float32), s((128, 32), jnp.float32), s((512,), jnp.bfloat16), s((), jnp.float32),
          s((), jnp.float32), s((t,), jnp.int32))
  with _target_sm90():
    hlo = op._fused_mosaic.trace(*args, interleaved=True).lower(
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
