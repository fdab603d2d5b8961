"""Implementation choice shared by every public op.

Every public op takes ``impl: "auto" | "mosaic" | "xla"`` and ``interpret: bool``:

* ``"xla"``: the pure-XLA path (runs anywhere).
* ``"mosaic"``: the Mosaic GPU kernel. Needs a CUDA GPU of compute capability 9.0 (Hopper, sm_90a) or 10.x
  (Blackwell, sm_100a), or ``interpret=True`` (Pallas' GPU interpret mode, on any backend). Raises
  ``NotImplementedError`` when no kernel can run here or the kernel does not take this input.
* ``"auto"``: the kernel when ``"mosaic"`` would succeed *and* the kernel has been validated on this GPU family
  (``validated_on``; a kernel so far only checked in interpret mode and by lowering is not chosen automatically
  on hardware) *and* it has not been measured slower than XLA for such an input (``slower_than_xla``); the XLA
  path otherwise (the reason is logged at INFO). With ``interpret=True`` the kernel runs.

Which implementation ran is recorded per op (:func:`last_impl`), so that a graph, the demo and the benchmarks can
say which steps ran a kernel and which ran XLA.
"""
from __future__ import annotations

import logging
from typing import Callable, Literal

import jax

Impl = Literal["auto", "mosaic", "xla"]
IMPLS: tuple[str, ...] = ("auto", "mosaic", "xla")

_log = logging.getLogger("mla_pallas")
_last: dict[str, str] = {}
_kernel: dict[str, str] = {}


def check_impl(impl: str) -> None:
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")


def gpu_arch() -> tuple[int, int] | None:
  """(major, minor) compute capability of the default device, or None when it is not a CUDA GPU."""
  try:
    dev = jax.devices()[0]
  except RuntimeError:  # pragma: no cover - no backend at all
    return None
  if dev.platform != "gpu":
    return None
  cc = getattr(dev, "compute_capability", None)
  if not cc:
    return None
  major, minor = (int(x) for x in str(cc).split(".")[:2])
  return major, minor


def num_sms() -> int:
  """Streaming multiprocessors of the default GPU (the kernels' grid sizes: one CTA per SM); 132 (H100 SXM /
  H200) when the default device is not a GPU or does not say."""
  dev = jax.devices()[0]
  return int(getattr(dev, "core_count", 0) or 132) if dev.platform == "gpu" else 132


def mosaic_arch(interpret: bool = False) -> str | None:
  """The kernel family that can run here: "sm90", "sm100", or None.

  Under ``interpret=True`` the family is the one of the local GPU if there is one, else "sm90" (the interpreter
  ignores the architecture; Blackwell kernels pick their own family explicitly).
  """
  arch = gpu_arch()
  if arch == (9, 0):
    return "sm90"
  if arch is not None and arch[0] == 10:
    return "sm100"
  return "sm90" if interpret else None


def choose(op: str, impl: str, *, interpret: bool,
           supported: Callable[[], None] | None = None,
           validated_on: tuple[str, ...] = ("sm90",),
           slower_than_xla: Callable[[], str | None] | None = None) -> str:
  """Resolve ``impl`` to "mosaic" or "xla" for one call of ``op``.

  Args:
    op: public op name, used in messages and in :func:`last_impl`.
    impl: "auto" | "mosaic" | "xla".
    interpret: run the Mosaic kernel in GPU interpret mode.
    supported: raises NotImplementedError(reason) when the kernel cannot take this input; None means the op
      has no kernel yet.
    validated_on: kernel families ("sm90", "sm100") on which this op's kernel has been run and checked against the
      reference on real hardware; "auto" picks the kernel natively only there.
    slower_than_xla: for "auto" on hardware: returns a reason (a measurement) when the kernel is known to be
      slower than the XLA path for this input, else None; "auto" then takes XLA. "mosaic" ignores it.
  """
  check_impl(impl)
  if impl == "xla":
    return record(op, "xla")
  reason = None
  if supported is None:
    reason = f"{op} has no Mosaic GPU kernel yet"
  elif mosaic_arch(interpret) is None:
    reason = (f"{op}: no Mosaic GPU kernel can run on {jax.devices()[0].device_kind!r} "
              "(needs compute capability 9.0 or 10.x, or interpret=True)")
  else:
    try:
      supported()
    except NotImplementedError as e:
      reason = str(e)
  if reason is None and impl == "auto" and not interpret and mosaic_arch(False) not in validated_on:
    reason = (f"{op}: the Mosaic GPU kernel has not been validated on {mosaic_arch(False)} hardware yet "
              "(use impl='mosaic' to run it anyway)")
  if reason is None and impl == "auto" and not interpret and slower_than_xla is not None:
    reason = slower_than_xla()
  if reason is None:
    record(op, "mosaic-interpret" if interpret else "mosaic")
    return "mosaic"
  if impl == "mosaic":
    raise NotImplementedError(reason)
  _log.info("%s: impl='auto' falls back to XLA: %s", op, reason)
  return record(op, "xla")


def record(op: str, used: str) -> str:
  """Remember which implementation ``op`` used last; returns ``used``. Forgets the op's last kernel name
  (:func:`record_kernel`)."""
  _last[op] = used
  _kernel.pop(op, None)
  return used


def record_kernel(op: str, kernel: str) -> None:
  """Name the kernel an op with several Mosaic routes ran in its last call (after :func:`record`), e.g.
  ``dense_mla_decode``'s "dense_sm90" or "sparse route"."""
  _kernel[op] = kernel


def last_kernel(op: str) -> str | None:
  """The kernel named by :func:`record_kernel` for the last call of ``op`` (None: not named, or XLA ran)."""
  return _kernel.get(op)


def last_impl(op: str | None = None):
  """Implementation used by the last call of ``op`` ("mosaic", "mosaic-interpret" or "xla"), or a dict of all."""
  if op is None:
    return dict(_last)
  return _last.get(op)
