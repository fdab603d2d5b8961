"""YaRN rope scaling as real DeepSeek-V3 / V3.2 checkpoints use it: the config record and the cos/sin tables.

A YaRN checkpoint changes two things against plain rope (Hugging Face DeepSeek-V3 ``modeling_deepseek.py``:
``yarn_find_correction_range``, ``yarn_linear_ramp_mask``, ``yarn_get_mscale``; DeepSeek's ``inference/model.py``
``precompute_freqs_cis`` blends the same frequencies):

* the rotary frequencies: with ``d = qk_rope_head_dim`` and ``i in [0, d/2)``, ``f_i = theta ** (-2 i / d)``;
  the dims rotating fewer than ``beta_slow`` times over ``original_max_position_embeddings`` positions are
  interpolated (``f_i / factor``), those rotating more than ``beta_fast`` times are kept, and a linear ramp over
  the index range ``[low, high]`` in between blends the two::

      corr(r)   = d * ln(L_orig / (2 pi r)) / (2 ln theta)
      low, high = max(floor(corr(beta_fast)), 0), min(ceil(corr(beta_slow)), d - 1)
      ramp_i    = clip((i - low) / (high - low), 0, 1)            (high += 0.001 when low == high)
      inv_freq  = f_i / factor * ramp_i + f_i * (1 - ramp_i)

* the magnitudes: ``cos`` / ``sin`` are multiplied by ``mscale(factor, mscale) / mscale(factor,
  mscale_all_dim)`` and the softmax scale by ``mscale(factor, mscale_all_dim) ** 2``
  (:meth:`mla_pallas.config.MLAConfig.softmax_scale`), with
  ``mscale(s, m) = 0.1 * m * ln(s) + 1`` for ``s > 1`` (1 otherwise). DeepSeek-V3 / V3.2 publish
  ``mscale = mscale_all_dim = 1``: tables of magnitude 1 and a softmax scale ``1.3689 ** 2 = 1.874`` times
  ``qk_head_dim ** -0.5``.

The tables have the layout of :func:`mla_pallas.reference.rope_tables` (float32 ``[max_pos, d // 2]``, computed in
float64 and rounded once), so they drop into every rope op, the graph and :class:`mla_pallas.MLAAttention`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from mla_pallas import reference
from mla_pallas._checks import check_positive_int

__all__ = ["RopeScaling", "yarn_get_mscale", "yarn_inv_freq", "yarn_rope_tables", "rope_tables"]

# Rope scaling types of Hugging Face configs that this library does not implement (valid, but unsupported).
_OTHER_HF_TYPES = ("linear", "dynamic", "longrope", "llama3", "su", "ntk", "mrope")


def _real(name, v, *, lo=None, lo_open=False):
  if not isinstance(v, (int, float, np.integer, np.floating)) or isinstance(v, (bool, np.bool_)) \
      or not math.isfinite(v) or (lo is not None and (v <= lo if lo_open else v < lo)):
    bound = "" if lo is None else f" {'>' if lo_open else '>='} {lo:g}"
    raise ValueError(f"RopeScaling.{name} must be a finite number{bound}; got {v!r}")
  return float(v)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """YaRN rope scaling of a checkpoint (the ``rope_scaling`` entry of its ``config.json``).

  Attributes:
    type: ``"yarn"`` (the only type implemented; Hugging Face's other types raise ``NotImplementedError``).
    factor: context extension factor (>= 1; DeepSeek-V3 / V3.2: 40).
    original_max_position_embeddings: context the model was pre-trained for (DeepSeek: 4096).
    beta_fast, beta_slow: rotation counts bounding the frequency ramp (``beta_fast > beta_slow > 0``; 32 and 1).
    mscale, mscale_all_dim: magnitude corrections (>= 0); the tables are scaled by ``mscale(factor, mscale) /
      mscale(factor, mscale_all_dim)``, the softmax by ``mscale(factor, mscale_all_dim) ** 2``. Hugging Face's
      defaults when a key is missing: 1 and 0.

  Raises:
    ValueError: naming the field; ``NotImplementedError`` for another Hugging Face scaling type.
  """
  type: str = "yarn"
  factor: float
  original_max_position_embeddings: int = 4096
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  mscale: float = 1.0
  mscale_all_dim: float = 0.0

  def __post_init__(self):
    if self.type in _OTHER_HF_TYPES:
      raise NotImplementedError(f"RopeScaling.type {self.type!r} is not implemented (only 'yarn')")
    if self.type != "yarn":
      raise ValueError(f"RopeScaling.type must be 'yarn'; got {self.type!r}")
    set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
    set_("factor", _real("factor", self.factor, lo=1.0))
    n = self.original_max_position_embeddings
    if not isinstance(n, (int, np.integer)) or isinstance(n, (bool, np.bool_)) or n <= 0:
      raise ValueError(f"RopeScaling.original_max_position_embeddings must be a positive int; got {n!r}")
    set_("original_max_position_embeddings", int(n))
    set_("beta_slow", _real("beta_slow", self.beta_slow, lo=0.0, lo_open=True))
    set_("beta_fast", _real("beta_fast", self.beta_fast, lo=0.0, lo_open=True))
    if self.beta_fast <= self.beta_slow:
      raise ValueError(f"RopeScaling.beta_fast must be > beta_slow; got beta_fast={self.beta_fast:g}, "
                       f"beta_slow={self.beta_slow:g}")
    set_("mscale", _real("mscale", self.mscale, lo=0.0))
    set_("mscale_all_dim", _real("mscale_all_dim", self.mscale_all_dim, lo=0.0))

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> "RopeScaling":
    """From a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict (``type`` or ``rope_type``; missing keys
    take Hugging Face's DeepSeek-V3 defaults; ``rope_theta`` is ignored: it is :attr:`MLAConfig.rope_theta`).

    Raises:
      ValueError: ``d`` is not a mapping, or has a key this record does not know (named).
    """
    if not isinstance(d, Mapping):
      raise ValueError(f"rope_scaling must be a RopeScaling, a dict or None; got {type(d).__name__}")
    d = dict(d)
    d.pop("rope_theta", None)
    if "rope_type" in d:
      rt = d.pop("rope_type")
      if d.setdefault("type", rt) != rt:
        raise ValueError(f"rope_scaling has type {d['type']!r} and rope_type {rt!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    extra = sorted(set(d) - names)
    if extra:
      raise ValueError(f"rope_scaling has unknown key(s) {', '.join(map(repr, extra))}; known: "
                       f"{', '.join(sorted(names))}")
    if d.get("type", "yarn") == "yarn" and "factor" not in d:
      raise ValueError("rope_scaling of type 'yarn' needs 'factor'")
    return cls(**d)

  def as_dict(self) -> dict[str, Any]:
    """The Hugging Face ``rope_scaling`` dict of this record."""
    return dataclasses.asdict(self)

  @property
  def attention_factor(self) -> float:
    """``mscale(factor, mscale_all_dim) ** 2``: the factor on the softmax scale (1.874 for DeepSeek-V3)."""
    return yarn_get_mscale(self.factor, self.mscale_all_dim) ** 2

  @property
  def table_factor(self) -> float:
    """``mscale(factor, mscale) / mscale(factor, mscale_all_dim)``: the factor on cos / sin (1 for DeepSeek)."""
    return yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
  """``0.1 * mscale * ln(scale) + 1`` for ``scale > 1``, else 1."""
  return 1.0 if scale <= 1 else 0.1 * float(mscale) * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, theta: float, scaling: RopeScaling) -> np.ndarray:
  """YaRN's blended inverse frequencies, float64 ``[dim // 2]`` (formulas in the module docstring)."""
  dim = check_positive_int("dim", dim)
  half = dim // 2
  f = float(theta) ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
  l_orig = scaling.original_max_position_embeddings

  def corr(rot):
    return dim * math.log(l_orig / (rot * 2 * math.pi)) / (2 * math.log(theta))

  low = max(math.floor(corr(scaling.beta_fast)), 0)
  high = min(math.ceil(corr(scaling.beta_slow)), dim - 1)
  ramp = np.clip((np.arange(half, dtype=np.float64) - low) / ((high + 0.001 if low == high else high) - low), 0, 1)
  return f / scaling.factor * ramp + f * (1.0 - ramp)


def _check_table_args(max_pos, dim, theta):
  max_pos = check_positive_int("max_pos", max_pos)
  dim = check_positive_int("dim", dim)
  if dim % 2:
    raise ValueError(f"dim must be even; got {dim}")
  if isinstance(theta, bool) or not isinstance(theta, (int, float, np.integer, np.floating)) \
      or not math.isfinite(theta) or theta <= 1:
    raise ValueError(f"theta must be a finite number > 1 (YaRN divides by ln theta); got {theta!r}")
  return max_pos, dim, float(theta)


def yarn_rope_tables(max_pos: int, dim: int = 64, theta: float = 10000.0, *, scaling: RopeScaling):
  """YaRN rotary tables ``(cos, sin)``, float32 ``[max_pos, dim // 2]`` (layout of
  :func:`mla_pallas.reference.rope_tables`): ``cos[p, i] = cos(p * inv_freq_i) * table_factor`` (same for sin),
  computed in float64 and rounded once to float32."""
  max_pos, dim, theta = _check_table_args(max_pos, dim, theta)
  if not isinstance(scaling, RopeScaling):
    raise ValueError(f"scaling must be a RopeScaling; got {type(scaling).__name__}")
  ang = np.arange(max_pos, dtype=np.float64)[:, None] * yarn_inv_freq(dim, theta, scaling)[None, :]
  m = scaling.table_factor
  return jnp.asarray(np.cos(ang) * m, jnp.float32), jnp.asarray(np.sin(ang) * m, jnp.float32)


def rope_tables(max_pos: int, dim: int = 64, theta: float = 10000.0, scaling: RopeScaling | None = None):
  """Plain rope tables (:func:`mla_pallas.reference.rope_tables`) when ``scaling`` is None, else
  :func:`yarn_rope_tables`. :meth:`mla_pallas.config.MLAConfig.rope_tables` calls this with the config's fields."""
  if scaling is None:
    return reference.rope_tables(max_pos, dim, theta)
  return yarn_rope_tables(max_pos, dim, theta, scaling=scaling)
