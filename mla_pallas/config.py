"""Model configuration for Multi-head Latent Attention (MLA) with DeepSeek Sparse Attention.

``MLAConfig`` holds the attention-relevant hyper-parameters of one MLA layer. It is a frozen
dataclass: build variants with :meth:`MLAConfig.replace`, :meth:`MLAConfig.with_heads` or
:meth:`MLAConfig.shard` (tensor parallelism splits the query heads).

MLA in the "absorbed" (MQA) form that the decode kernels use: every token stores one latent row of
``latent_dim = kv_lora_rank + qk_rope_head_dim`` values (576 for both presets): ``[0, kv_lora_rank)``
is the compressed latent ("nope" part, also the value V) and ``[kv_lora_rank, latent_dim)`` the
shared rope key. The queries are projected into the same 576-wide space, so a query-key logit is one
576-long dot product and the output is 512 wide (``d_v = kv_lora_rank``) before the per-head
``v_head_dim`` up-projection. The softmax scale is ``qk_head_dim ** -0.5`` with
``qk_head_dim = qk_nope_head_dim + qk_rope_head_dim`` (the head dim of the un-absorbed model), not
``576 ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` when the config has a
``rope_scaling`` (:mod:`mla_pallas.rope_scaling`; x1.874 for DeepSeek-V3 / V3.2). The rope tables of a
config come from :meth:`MLAConfig.rope_tables` (YaRN tables under ``rope_scaling``, plain ones otherwise).

Norm epsilon: the layer's two RMSNorms (``q_a_layernorm``, ``kv_a_layernorm``) use ``rms_norm_eps``. The
published model code builds both with eps 1e-6 whatever the checkpoint's ``config.json`` says
(``rms_norm_eps`` there is the decoder layers' norms' eps: 1e-5 for GLM-5), so the presets and
:meth:`MLAConfig.from_hf_config` set 1e-6.

The kernels need ``kv_lora_rank == 512`` and ``qk_rope_head_dim == 64`` (576-wide rows); other
values are valid configurations, but the ops raise ``NotImplementedError`` for them (see
:meth:`MLAConfig.check_kernel_supported`).

Presets (the published checkpoints' values):
  * :func:`deepseek_v32` -- DeepSeek-V3.2: 128 heads, q_lora_rank 1536, qk_nope 128, v_head 128,
    index_topk 2048, hidden 7168, rope_theta 10000, YaRN (factor 40, original 4096 positions, beta_fast 32,
    beta_slow 1, mscale 1, mscale_all_dim 1).
  * :func:`glm5` -- GLM-5: 64 heads, q_lora_rank 2048, qk_nope 192, v_head 256, index_topk 2048,
    hidden 6144, rope_theta 1e6, plain rope.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import numpy as np

from mla_pallas import rope_scaling as _rs
from mla_pallas.rope_scaling import RopeScaling

__all__ = ["MLAConfig", "RopeScaling", "deepseek_v32", "glm5", "PRESETS", "preset", "from_hf_config",
           "KERNEL_KV_LORA_RANK", "KERNEL_ROPE_DIM", "DTYPES"]

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
    rms_norm_eps: epsilon of the layer's q_a and kv_a RMSNorms (> 0; 1e-6 in the published model code, see
      the module docstring).
    rope_theta: rope base (> 0; > 1 with ``rope_scaling``).
    rope_scaling: :class:`~mla_pallas.rope_scaling.RopeScaling` (YaRN), a Hugging Face ``rope_scaling`` dict
      (converted), or None for plain rope.
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
  rope_scaling: RopeScaling | None = None
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
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      set_("rope_scaling", RopeScaling.from_dict(self.rope_scaling))
    if self.rope_scaling is not None and self.rope_theta <= 1:
      raise ValueError(f"{field_name('rope_theta')} must be > 1 with rope_scaling (YaRN divides by "
                       f"ln rope_theta); got {self.rope_theta!r}")
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
    """``qk_head_dim ** -0.5`` (the un-absorbed head dim, not 576), times ``mscale(factor, mscale_all_dim)
    ** 2`` under YaRN (:attr:`RopeScaling.attention_factor`: 1.874 for DeepSeek-V3 / V3.2)."""
    scale = self.qk_head_dim ** -0.5
    if self.rope_scaling is not None:
      scale *= self.rope_scaling.attention_factor
    return scale

  def rope_tables(self, max_pos: int):
    """Rope tables ``(cos, sin)`` float32 ``[max_pos, qk_rope_head_dim // 2]`` of this config: YaRN tables
    (:func:`mla_pallas.rope_scaling.yarn_rope_tables`) under ``rope_scaling``, plain ones otherwise."""
    return _rs.rope_tables(max_pos, self.qk_rope_head_dim, self.rope_theta, self.rope_scaling)

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
    def shown(name):
      v = getattr(self, name)
      if name == "rope_scaling" and v is not None:
        return (f"{v.type} factor={v.factor:g} original_max_pos={v.original_max_position_embeddings} "
                f"beta_fast/slow={v.beta_fast:g}/{v.beta_slow:g} mscale/all_dim={v.mscale:g}/{v.mscale_all_dim:g}")
      return v

    rows = [(f.name, shown(f.name)) for f in dataclasses.fields(self)]
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


# DeepSeek-V3 / V3.2 config.json ``rope_scaling`` (also DeepSeek's inference/model.py ModelArgs defaults).
_DEEPSEEK_YARN = RopeScaling(factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=1.0)


def deepseek_v32(**overrides: Any) -> MLAConfig:
  """DeepSeek-V3.2 MLA layer: 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128,
  qk_rope 64, v_head 128, index_topk 2048, hidden 7168, rope_theta 10000 with YaRN (factor 40,
  original_max_position_embeddings 4096, beta_fast 32, beta_slow 1, mscale 1, mscale_all_dim 1),
  norm eps 1e-6 (``overrides`` replace fields)."""
  return MLAConfig(num_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                   qk_rope_head_dim=64, v_head_dim=128, index_topk=2048, hidden_size=7168,
                   rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=_DEEPSEEK_YARN).replace(**overrides)


def glm5(**overrides: Any) -> MLAConfig:
  """GLM-5 MLA layer: 64 heads, q_lora_rank 2048, kv_lora_rank 512, qk_nope 192, qk_rope 64,
  v_head 256, index_topk 2048, hidden 6144, plain rope with rope_theta 1e6, norm eps 1e-6
  (``overrides`` replace fields)."""
  # rope_theta 1e6: the GLM-5 training recipes (THUDM/slime, radixark/miles scripts/models/glm5-744B-A40B.sh:
  # --rotary-base 1000000, no rope scaling); zai-org/GLM-5's config.json itself was not read. The q_a / kv_a
  # norms: GlmMoeDsaRMSNorm(q_lora_rank) / (kv_lora_rank) with the default eps 1e-6 in transformers'
  # modeling_glm_moe_dsa.py (its config's rms_norm_eps, 1e-5, is for the decoder-layer norms).
  return MLAConfig(num_heads=64, q_lora_rank=2048, kv_lora_rank=512, qk_nope_head_dim=192,
                   qk_rope_head_dim=64, v_head_dim=256, index_topk=2048, hidden_size=6144,
                   rms_norm_eps=1e-6, rope_theta=1e6, rope_scaling=None).replace(**overrides)


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


def from_hf_config(hf: Mapping[str, Any], **overrides: Any) -> MLAConfig:
  """An :class:`MLAConfig` from a Hugging Face ``config.json`` dict (DeepSeek-V3 / V3.2, GLM-MoE-DSA).

  Reads ``num_attention_heads``, ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
  ``v_head_dim``, ``index_topk``, ``hidden_size``, ``rope_theta`` and ``rope_scaling`` (or the newer
  ``rope_parameters``, whose ``rope_type: "default"`` means plain rope). ``rms_norm_eps`` is NOT read: the q_a /
  kv_a norms use 1e-6 in the published model code (module docstring). ``overrides`` replace fields (e.g.
  ``page_size``, ``dtype``, or ``index_topk`` for a config without one).

  Raises:
    ValueError: a needed key is missing (named) or a value is invalid.
  """
  if not isinstance(hf, Mapping):
    raise ValueError(f"hf must be a dict (a parsed config.json); got {type(hf).__name__}")
  keys = {"num_heads": "num_attention_heads", "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
          "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim",
          "v_head_dim": "v_head_dim", "index_topk": "index_topk", "hidden_size": "hidden_size"}
  kw: dict[str, Any] = {"rms_norm_eps": 1e-6}
  for field, key in keys.items():
    if key in hf:
      kw[field] = hf[key]
    elif field not in overrides:
      raise ValueError(f"hf config has no {key!r} (pass {field}= to supply it)")
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling")
  if scaling is None and params.get("rope_type", params.get("type", "default")) != "default":
    scaling = params
  if scaling is not None and scaling.get("rope_type", scaling.get("type")) == "default":
    scaling = None
  kw["rope_theta"] = hf.get("rope_theta", params.get("rope_theta", 10000.0))
  kw["rope_scaling"] = scaling
  kw.update(overrides)
  return MLAConfig(**kw)
