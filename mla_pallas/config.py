"""Model configuration for Multi-head Latent Attention (MLA) with DeepSeek Sparse Attention.

``MLAConfig`` holds the attention-relevant hyper-parameters of one MLA layer. It is a frozen
dataclass: build variants with :meth:`MLAConfig.replace`, :meth:`MLAConfig.with_heads` or
:meth:`MLAConfig.shard` (tensor parallelism splits the query heads).

MLA in the "absorbed" (MQA) form that the decode kernels use: every token stores one latent row of
``latent_dim = kv_lora_rank + qk_rope_head_dim`` values (576 for both presets): ``[0, kv_lora_rank)``
is the compressed latent ("nope" part, also the value V) and ``[kv_lora_rank, latent_dim)`` the
shared rope key. The queries are projected into the same 576-wide space, so a query-key logit is one
576-long dot product and the output is 512 wide (``d_v = kv_lora_rank``) before the per-head
``v_head_dim`` up-projection. The softmax scale is still ``qk_head_dim ** -0.5`` with
``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim`` (the head dim of the un-absorbed model),
not ``576 ** -0.5`` (YaRN's mscale correction, when a checkpoint uses it, is applied by the caller).

The kernels need ``kv_lora_rank == 512`` and ``qk_rope_head_dim == 64`` (576-wide rows); other
values are valid configurations, but the ops raise ``NotImplementedError`` for them (see
:meth:`MLAConfig.check_kernel_supported`).

Presets (the numbers fixed by the project contract for the two target models):
  * :func:`deepseek_v32` -- DeepSeek-V3.2: 128 heads, q_lora_rank 1536, qk_nope 128, v_head 128,
    index_topk 2048, hidden 7168.
  * :func:`glm5` -- GLM-5: 64 heads, q_lora_rank 2048, qk_nope 192, v_head 256, index_topk 2048,
    hidden 6144.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

__all__ = ["MLAConfig", "deepseek_v32", "glm5", "PRESETS", "preset", "KERNEL_KV_LORA_RANK",
           "KERNEL_ROPE_DIM", "DTYPES"]

# What the Mosaic GPU kernels are written for.
KERNEL_KV_LORA_RANK = 512
KERNEL_ROPE_DIM = 64
# Activation dtypes a config may name (``MLAConfig.dtype``).
DTYPES = ("bfloat16", "float16", "float32")
_PAGE_MULTIPLE = 16


def _is_int(v) -> bool:
  return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _is_real(v) -> bool:
  return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAConfig:
  """Hyper-parameters of one MLA layer (keyword-only construction).

  Attributes:
    num_heads: query heads of the layer (per model, or per shard after :meth:`shard`).
    q_lora_rank: rank of the low-rank query projection (``None``: the model projects queries
      directly from the hidden state, as DeepSeek-V2-Lite does).
    kv_lora_rank: width of the compressed latent (the "nope" part of a cache row and the value).
    qk_nope_head_dim: per-head query/key dim without rope (un-absorbed form).
    qk_rope_head_dim: rope dim, shared by all heads (the last dims of a cache row).
    v_head_dim: per-head value dim after the up-projection of the 512-wide attention output.
    index_topk: tokens kept per query by the sparse-attention indexer (DSA top-k).
    hidden_size: model width.
    page_size: tokens per KV-cache page; a positive multiple of 16.
    rms_norm_eps: epsilon of the latent RMSNorm (> 0).
    rope_theta: rope base (> 0).
    dtype: activation dtype name, one of ``DTYPES`` (a numpy/jax dtype is normalized to its name).

  Raises:
    ValueError: naming the field, e.g. ``MLAConfig.num_heads must be a positive int; got 0``.
  """
  num_heads: int
  q_lora_rank: int | None
  kv_lora_rank: int = 512
  qk_nope_head_dim: int
  qk_rope_head_dim: int = 64
  v_head_dim: int
  index_topk: int
  hidden_size: int
  page_size: int = 64
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  dtype: str = "bfloat16"

  def __post_init__(self):
    def field_name(name):
      return f"MLAConfig.{name}"

    def set_(name, v):
      object.__setattr__(self, name, v)

    for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                 "index_topk", "hidden_size", "page_size"):
      v = getattr(self, name)
      if not _is_int(v) or v <= 0:
        raise ValueError(f"{field_name(name)} must be a positive int; got {v!r}")
      set_(name, int(v))
    if self.q_lora_rank is not None:
      v = self.q_lora_rank
      if not _is_int(v) or v <= 0:
        raise ValueError(f"{field_name('q_lora_rank')} must be a positive int or None; got {v!r}")
      set_("q_lora_rank", int(v))
    if self.page_size % _PAGE_MULTIPLE:
      raise ValueError(f"{field_name('page_size')} must be a positive multiple of {_PAGE_MULTIPLE}; "
                       f"got {self.page_size}")
    if self.qk_rope_head_dim % 2:
      raise ValueError(f"{field_name('qk_rope_head_dim')} must be even (rope rotates pairs); "
                       f"got {self.qk_rope_head_dim}")
    for name in ("rms_norm_eps", "rope_theta"):
      v = getattr(self, name)
      if not _is_real(v) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{field_name(name)} must be a finite number > 0; got {v!r}")
      set_(name, float(v))
    try:
      dt = np.dtype(self.dtype).name if not isinstance(self.dtype, str) else self.dtype
    except TypeError:
      dt = None
    if dt not in DTYPES:
      raise ValueError(f"{field_name('dtype')} must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
    set_("dtype", dt)

  # ---- derived sizes -------------------------------------------------------------------------

  @property
  def qk_head_dim(self) -> int:
    """Per-head query/key dim of the un-absorbed model: ``qk_nope_head_dim + qk_rope_head_dim``."""
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def latent_dim(self) -> int:
    """Width of one KV-cache row: ``kv_lora_rank + qk_rope_head_dim`` (576 for the presets)."""
    return self.kv_lora_rank + self.qk_rope_head_dim

  @property
  def d_qk(self) -> int:
    """Query/key width in the absorbed (MQA) form; equal to :attr:`latent_dim`."""
    return self.latent_dim

  @property
  def d_v(self) -> int:
    """Attention output width in the absorbed form (the latent part): ``kv_lora_rank``."""
    return self.kv_lora_rank

  @property
  def softmax_scale(self) -> float:
    """``qk_head_dim ** -0.5`` (the un-absorbed head dim, not 576)."""
    return self.qk_head_dim ** -0.5

  @property
  def kv_bytes_per_token(self) -> int:
    """Bytes of one FP8 cache row (one byte per latent value; the scale is per tensor)."""
    return self.latent_dim

  @property
  def kernel_supported(self) -> bool:
    """Whether the Mosaic GPU kernels accept this config (576-wide rows: 512 latent + 64 rope)."""
    return (self.kv_lora_rank == KERNEL_KV_LORA_RANK and self.qk_rope_head_dim == KERNEL_ROPE_DIM)

  def check_kernel_supported(self) -> None:
    """Raise ``NotImplementedError`` unless :attr:`kernel_supported`."""
    if not self.kernel_supported:
      raise NotImplementedError(
          f"the kernels need kv_lora_rank={KERNEL_KV_LORA_RANK} and qk_rope_head_dim="
          f"{KERNEL_ROPE_DIM} (576-wide cache rows); got kv_lora_rank={self.kv_lora_rank}, "
          f"qk_rope_head_dim={self.qk_rope_head_dim}")

  def kv_cache_bytes(self, num_tokens: int) -> int:
    """Bytes of an FP8 latent cache holding ``num_tokens`` tokens, rounded up to whole pages."""
    if not _is_int(num_tokens) or num_tokens < 0:
      raise ValueError(f"num_tokens must be a non-negative int; got {num_tokens!r}")
    pages = -(-int(num_tokens) // self.page_size)
    return pages * self.page_size * self.kv_bytes_per_token

  # ---- variants ------------------------------------------------------------------------------

  def replace(self, **changes: Any) -> "MLAConfig":
    """A copy with ``changes`` applied (validated again). Unknown field -> ValueError."""
    names = [f.name for f in dataclasses.fields(self)]
    for k in changes:
      if k not in names:
        raise ValueError(f"MLAConfig has no field {k!r}; fields: {', '.join(names)}")
    return dataclasses.replace(self, **changes)

  def heads_per_shard(self, tp: int) -> int:
    """Query heads on each of ``tp`` tensor-parallel shards: ``num_heads // tp``.

    Raises:
      ValueError: ``tp`` is not a positive int or does not divide ``num_heads``.
    """
    if not _is_int(tp) or tp <= 0:
      raise ValueError(f"tp must be a positive int; got {tp!r}")
    if self.num_heads % tp:
      raise ValueError(f"tp={tp} must divide MLAConfig.num_heads={self.num_heads}")
    return self.num_heads // int(tp)

  def with_heads(self, num_heads: int) -> "MLAConfig":
    """A copy with ``num_heads`` replaced (e.g. the heads of one shard)."""
    return self.replace(num_heads=num_heads)

  def shard(self, tp: int) -> "MLAConfig":
    """The per-shard config under ``tp``-way tensor parallelism (``num_heads // tp`` heads)."""
    return self.with_heads(self.heads_per_shard(tp))

  # ---- display -------------------------------------------------------------------------------

  def summary(self, name: str | None = None) -> str:
    """A small aligned table of the fields and derived sizes (for logs and the demo)."""
    rows = [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]
    rows += [
        ("qk_head_dim", self.qk_head_dim),
        ("latent_dim (d_qk)", self.latent_dim),
        ("d_v", self.d_v),
        ("softmax_scale", f"{self.softmax_scale:.6g}"),
        ("kv bytes/token (fp8)", self.kv_bytes_per_token),
        ("kernel supported", self.kernel_supported),
    ]
    width = max(len(k) for k, _ in rows)
    title = f"MLAConfig{' ' + name if name else ''}"
    lines = [title, "-" * max(len(title), width + 12)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.summary()


def deepseek_v32(**overrides: Any) -> MLAConfig:
  """DeepSeek-V3.2 MLA layer: 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128,
  qk_rope 64, v_head 128, index_topk 2048, hidden 7168 (``overrides`` replace fields)."""
  return MLAConfig(num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, index_topk=2048,
                   hidden_size=7168).replace(**overrides)


def glm5(**overrides: Any) -> MLAConfig:
  """GLM-5 MLA layer: 64 heads, q_lora_rank 2048, kv_lora_rank 512, qk_nope 192, qk_rope 64,
  v_head 256, index_topk 2048, hidden 6144 (``overrides`` replace fields)."""
  return MLAConfig(num_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
                   qk_rope_head_dim=64, v_head_dim=256, index_topk=2048,
                   hidden_size=6144).replace(**overrides)


PRESETS: dict[str, Callable[..., MLAConfig]] = {"deepseek_v32": deepseek_v32, "glm5": glm5}


def preset(name: str, **overrides: Any) -> MLAConfig:
  """The preset called ``name`` (a key of ``PRESETS``; case, ``-``, ``_`` and ``.`` are ignored,
  so ``"deepseek-v3.2"`` and ``"GLM-5"`` work). Unknown name -> ValueError listing the presets."""
  def norm(s):
    return s.lower().replace("-", "").replace("_", "").replace(".", "")

  by_norm = {norm(k): k for k in PRESETS}
  key = by_norm.get(norm(name)) if isinstance(name, str) else None
  if key is None:
    raise ValueError(f"preset must be one of {', '.join(PRESETS)}; got {name!r}")
  return PRESETS[key](**overrides)
