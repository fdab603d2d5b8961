"""Implementation choice (mla_pallas._dispatch) with a simulated GPU: auto / mosaic / xla, validation gating."""
from __future__ import annotations

import pytest

from mla_pallas import _dispatch


@pytest.fixture
def fake_arch(monkeypatch):
  def set_arch(arch):
    monkeypatch.setattr(_dispatch, "gpu_arch", lambda: arch)
  return set_arch


def _ok():
  return None


def _unsupported():
  raise NotImplementedError("not for this input")


def test_auto_uses_validated_kernel(fake_arch):
  fake_arch((9, 0))
  assert _dispatch.choose("op_a", "auto", interpret=False, supported=_ok) == "mosaic"
  assert _dispatch.last_impl("op_a") == "mosaic"


def test_auto_skips_kernel_not_validated_on_hardware(fake_arch):
  fake_arch((9, 0))
  assert _dispatch.choose("op_b", "auto", interpret=False, supported=_ok, validated_on=()) == "xla"
  assert _dispatch.last_impl("op_b") == "xla"
  # explicit requests still run it, and interpret mode is an explicit request too
  assert _dispatch.choose("op_b", "mosaic", interpret=False, supported=_ok, validated_on=()) == "mosaic"
  assert _dispatch.choose("op_b", "auto", interpret=True, supported=_ok, validated_on=()) == "mosaic"
  assert _dispatch.last_impl("op_b") == "mosaic-interpret"


def test_unsupported_input(fake_arch):
  fake_arch((9, 0))
  assert _dispatch.choose("op_c", "auto", interpret=False, supported=_unsupported) == "xla"
  with pytest.raises(NotImplementedError, match="not for this input"):
    _dispatch.choose("op_c", "mosaic", interpret=False, supported=_unsupported)


def test_no_kernel_and_no_gpu(fake_arch):
  fake_arch(None)
  with pytest.raises(NotImplementedError, match="compute capability"):
    _dispatch.choose("op_d", "mosaic", interpret=False, supported=_ok)
  assert _dispatch.choose("op_d", "auto", interpret=False, supported=_ok) == "xla"
  with pytest.raises(NotImplementedError, match="no Mosaic GPU kernel yet"):
    _dispatch.choose("op_d", "mosaic", interpret=True, supported=None)


def test_blackwell_family(fake_arch):
  fake_arch((10, 0))
  assert _dispatch.mosaic_arch() == "sm100"
  assert _dispatch.choose("op_e", "auto", interpret=False, supported=_ok) == "xla"   # validated on sm90 only
  fake_arch((8, 0))
  assert _dispatch.mosaic_arch() is None


def test_bad_impl():
  with pytest.raises(ValueError, match="impl must be one of"):
    _dispatch.choose("op_f", "triton", interpret=False, supported=_ok)


def test_auto_skips_kernel_measured_slower(fake_arch):
  fake_arch((9, 0))
  slow = lambda: "measured slower here"        # noqa: E731
  fast = lambda: None                          # noqa: E731
  assert _dispatch.choose("op_f", "auto", interpret=False, supported=_ok, slower_than_xla=slow) == "xla"
  assert _dispatch.choose("op_f", "auto", interpret=False, supported=_ok, slower_than_xla=fast) == "mosaic"
  # an explicit request and interpret mode ignore the measurement
  assert _dispatch.choose("op_f", "mosaic", interpret=False, supported=_ok, slower_than_xla=slow) == "mosaic"
  assert _dispatch.choose("op_f", "auto", interpret=True, supported=_ok, slower_than_xla=slow) == "mosaic"
