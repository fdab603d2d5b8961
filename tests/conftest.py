"""Shared pytest setup: device markers with auto-skip, the --runslow switch, and seeded random fixtures.

Markers (also declared in pyproject.toml):
  gpu    needs a CUDA GPU as JAX's default backend.
  sm90   needs a GPU of compute capability 9.0 (Hopper).
  sm100  needs a GPU of compute capability 10.x (Blackwell).
  slow   takes more than ~20 s on CPU; runs only with ``--runslow`` or ``MLA_PALLAS_SLOW=1``.
Tests carrying a marker whose requirement is not met are skipped with the reason, never failed.

Fixtures:
  seed   int in [0, 2**32), derived from the test's node id (so a failure reproduces by rerunning that test,
         and every test, every parametrization, gets different data). ``MLA_PALLAS_SEED=N`` shifts all seeds,
         to run the suite on other data.
  rng    ``numpy.random.Generator`` seeded with ``seed``, new for each test.
  key    ``jax.random.key(seed)``, new for each test.
The seed of a failed test is printed in its report.

Hypothesis: deadlines are off (the first example of a test pays for JIT compilation); under CI (``CI`` set)
examples are derandomized, so a CI run does not depend on luck.
"""
from __future__ import annotations

import hashlib
import os

# Interpret mode runs one CPU thread per warpgroup, each blocking in barrier waits on a thread of XLA's CPU pool
# (PJRT_NPROC threads, else one per CPU): the 4-warpgroup "producer_vt" kernel can deadlock with fewer pool
# threads than warpgroups (it did on the 2-CPU CI machine). Set before JAX creates its CPU client.
os.environ.setdefault("PJRT_NPROC", "8")

import jax  # noqa: E402
import numpy as np
import pytest

MARKERS = {
    "gpu": "needs a CUDA GPU as JAX's default backend (skipped otherwise)",
    "sm90": "needs a GPU of compute capability 9.0 (Hopper, sm_90a; skipped otherwise)",
    "sm100": "needs a GPU of compute capability 10.x (Blackwell, sm_100a; skipped otherwise)",
    "slow": "takes more than ~20 s on CPU; runs only with --runslow or MLA_PALLAS_SLOW=1",
}

try:  # hypothesis is a test extra; keep conftest importable without it.
  from hypothesis import settings as _hyp_settings

  _hyp_settings.register_profile("mla-pallas", deadline=None, print_blob=True)
  _hyp_settings.register_profile("mla-pallas-ci", deadline=None, print_blob=True, derandomize=True)
  _hyp_settings.load_profile("mla-pallas-ci" if os.environ.get("CI") else "mla-pallas")
except ImportError:  # pragma: no cover
  pass


def pytest_addoption(parser):
  parser.addoption("--runslow", action="store_true", default=False,
                   help="also run tests marked slow (same as MLA_PALLAS_SLOW=1)")


def pytest_configure(config):
  declared = {line.split(":")[0].split("(")[0].strip() for line in config.getini("markers")}
  for name, description in MARKERS.items():
    if name not in declared:  # pyproject.toml declares them too; this covers other config files
      config.addinivalue_line("markers", f"{name}: {description}")


def _slow_enabled(config) -> bool:
  return bool(config.getoption("--runslow")) or os.environ.get("MLA_PALLAS_SLOW") == "1"


def _device():
  """(backend, (major, minor) compute capability or None, device kind) of JAX's default device."""
  backend = jax.default_backend()
  dev = jax.devices()[0]
  cc = getattr(dev, "compute_capability", None) if dev.platform == "gpu" else None
  arch = None
  if cc:
    try:
      arch = tuple(int(x) for x in str(cc).split(".")[:2])
    except ValueError:
      arch = None
  return backend, arch, dev.device_kind


def pytest_collection_modifyitems(config, items):
  device_marks = ("gpu", "sm90", "sm100")
  needs_device = any(item.get_closest_marker(m) for item in items for m in device_marks)
  backend, arch, kind = _device() if needs_device else (None, None, None)
  here = f"{kind}{f' (compute capability {arch[0]}.{arch[1]})' if arch else ''}"
  skips = {
      "gpu": None if backend == "gpu" else pytest.mark.skip(reason=f"needs a CUDA GPU; running on {here}"),
      "sm90": None if arch == (9, 0) else pytest.mark.skip(
          reason=f"needs compute capability 9.0 (Hopper); running on {here}"),
      "sm100": None if arch is not None and arch[0] == 10 else pytest.mark.skip(
          reason=f"needs compute capability 10.x (Blackwell); running on {here}"),
      "slow": None if _slow_enabled(config) else pytest.mark.skip(
          reason="slow: run with --runslow or MLA_PALLAS_SLOW=1"),
  }
  for item in items:
    for name, skip in skips.items():
      if skip is not None and item.get_closest_marker(name):
        item.add_marker(skip)
        break


def _seed_for(nodeid: str) -> int:
  digest = hashlib.sha256(nodeid.encode()).digest()
  shift = int(os.environ.get("MLA_PALLAS_SEED", "0"))
  return (int.from_bytes(digest[:4], "little") + shift) % 2**32


@pytest.fixture
def seed(request) -> int:
  s = _seed_for(request.node.nodeid)
  request.node.user_properties.append(("seed", s))
  return s


@pytest.fixture
def rng(seed) -> np.random.Generator:
  return np.random.default_rng(seed)


@pytest.fixture
def key(seed):
  return jax.random.key(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
  outcome = yield
  report = outcome.get_result()
  if report.failed:
    for name, value in item.user_properties:
      if name == "seed":
        shift = os.environ.get("MLA_PALLAS_SEED")
        report.sections.append(("mla-pallas seed", f"seed={value} (from the node id"
                                f"{f', MLA_PALLAS_SEED={shift}' if shift else ''})"))
        break
