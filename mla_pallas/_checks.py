"""Shared argument validation: every public op raises ``ValueError`` naming the argument and what it expects."""
from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _dtype_name(dt) -> str:
  return np.dtype(dt).name


def check_array(name: str, x, *, ndim: int | Sequence[int] | None = None,
                shape: Sequence[int | None] | None = None, dtypes: Sequence | None = None,
                expect: str | None = None) -> None:
  """Raise ValueError unless ``x`` is an array with the given rank, shape (None = any) and dtype.

  ``expect`` is the human description used in the message, e.g. "[B, s_q, H, 576]".
  """
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"{name} must be an array{_want(shape, dtypes, expect)}; got {type(x).__name__}")
  got = f"got shape {tuple(x.shape)} {_dtype_name(x.dtype)}"
  if ndim is not None:
    ndims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if x.ndim not in ndims:
      raise ValueError(f"{name} must have rank {' or '.join(map(str, ndims))}"
                       f"{_want(shape, dtypes, expect)}; {got}")
  if shape is not None:
    if len(shape) != x.ndim or any(s is not None and s != d for s, d in zip(shape, x.shape)):
      raise ValueError(f"{name} must have shape {expect or _fmt(shape)}{_want(None, dtypes, None)}; {got}")
  if dtypes is not None:
    names = [_dtype_name(d) for d in dtypes]
    if _dtype_name(x.dtype) not in names:
      raise ValueError(f"{name} must have dtype {'/'.join(names)}{_want(shape, None, expect)}; {got}")


def _fmt(shape) -> str:
  return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def _want(shape, dtypes, expect) -> str:
  parts = []
  if expect or shape is not None:
    parts.append(f"shape {expect or _fmt(shape)}")
  if dtypes is not None:
    parts.append("dtype " + "/".join(_dtype_name(d) for d in dtypes))
  return (" with " + " and ".join(parts)) if parts else ""


def check_positive_int(name: str, v) -> int:
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
    raise ValueError(f"{name} must be a positive int; got {v!r}")
  return int(v)


def concrete(x) -> np.ndarray | None:
  """``x`` as a numpy array when its value is known outside any trace (numbers, numpy and concrete JAX arrays),
  else None (a tracer inside ``jax.jit``)."""
  try:
    return np.asarray(x)
  except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError, TypeError):
    return None


def check_bool(name: str, v) -> bool:
  """v as a python bool; ValueError naming ``name`` for anything else (a traced or array value included)."""
  if not isinstance(v, (bool, np.bool_)):
    raise ValueError(f"{name} must be a python bool; got {type(v).__name__}")
  return bool(v)


def check_multiple(name: str, v: int, m: int) -> int:
  v = check_positive_int(name, v)
  if v % m:
    raise ValueError(f"{name} must be a positive multiple of {m}; got {v}")
  return v


def check_scalar(name: str, v, *, positive: bool = False):
  """A python number or a 0-d array (f32-castable); returns it as a float or an f32 0-d array.

  ``positive=True``: the value must be finite and > 0 wherever it is known when the op is called — python numbers,
  NumPy values and concrete (non-traced) JAX arrays. A traced value (inside ``jax.jit``) cannot be checked.
  """
  if hasattr(v, "shape"):
    if tuple(v.shape) != ():
      raise ValueError(f"{name} must be a scalar (python float or 0-d array); got shape {tuple(v.shape)}")
    if positive and not isinstance(v, jax.core.Tracer):
      _check_positive_finite(name, float(np.asarray(v, np.float64)))
    return jnp.asarray(v, jnp.float32)
  if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
    raise ValueError(f"{name} must be a scalar (python float or 0-d array); got {type(v).__name__}")
  if positive:
    _check_positive_finite(name, float(v))
  return float(v)


def _check_positive_finite(name: str, v: float) -> None:
  if not (math.isfinite(v) and v > 0):
    raise ValueError(f"{name} must be finite and > 0; got {v!r}")


# Tokens per KV-cache page: one rule for the cache, the config and every op that takes a paged cache.
PAGE_MULTIPLE = 16


def check_page_size(name: str, page_size) -> int:
  """``page_size`` must be a positive multiple of :data:`PAGE_MULTIPLE` (16) tokens."""
  if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size <= 0 \
      or page_size % PAGE_MULTIPLE:
    raise ValueError(f"{name} must be a positive multiple of {PAGE_MULTIPLE}; got {page_size!r}")
  return int(page_size)
