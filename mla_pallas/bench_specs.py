"""The benchmark specs of :mod:`mla_pallas.bench`: one :class:`~mla_pallas.bench.BenchSpec` per op.

``sparse_mla_decode``, ``dense_mla_decode`` (cache bytes read as "gathered" bytes: the memory-bound figure of
merit), ``sparse_mla_prefill``; ``mla_prefill`` (varlen attention of the dense prefill branch at the models' head
dims, optionally over ``ctx`` cached tokens; extra impls ``cudnn``: ``jax.nn.dot_product_attention`` on the
equal-length batch with V zero-padded, and ``f32``: the op's float32 backend); ``quantize_and_bmm_fp8`` (XLA = fp8 ``dot_general``, i.e. cuBLASLt on
a GPU; FLOPs 2*T*H*K*N, "moved" bytes; reference evaluated on the CPU, see ``BenchSpec.reference_on_cpu``);
``fused_rope_rmsnorm_quantization`` and ``rope_rmsnorm`` ("moved" bytes = what the op must read and write; extra
impl ``copy``: a device copy of the same bytes in the same run, reported as "% copy BW"); ``mla_decode_step``: one
decode step of :func:`mla_pallas.graph.mla_decode_branch_fp8` (fused cache write, q absorb, sparse attention,
v up-projection) with the graph's ``impl=`` argument, ``info.steps`` = the graph's
:func:`~mla_pallas.graph.graph_report` per impl.

:data:`SPECS` maps each op name to its spec; use it through :func:`mla_pallas.bench.specs` /
:func:`~mla_pallas.bench.get_spec`. This module imports only the engine (:mod:`mla_pallas.bench_engine`).

Sweeps (``BenchSpec.sweep`` / ``tuned_op``): the sparse ops, the FP8 BMM and the two rope ops call their op
module's ``sweep_configs(...)`` with the shape's sizes and run each candidate through the op's jitted private
entry point that takes ``tuning=`` (``ops/sparse_decode._sparse_decode_jit``, ``ops/bmm_fp8._bmm_jit``,
``ops/rope_rmsnorm._rope_rmsnorm_mosaic`` / ``_fused_mosaic``), with ``impl="mosaic"``.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp

from mla_pallas import testing
from mla_pallas.bench_engine import D_QK, D_V, FP8, IMPLS, BenchSpec, _on_gpu

#: op name -> its spec (filled below by :func:`register`, in this order).
SPECS: dict[str, BenchSpec] = {}


def register(spec: BenchSpec) -> BenchSpec:
  if spec.sweep is not None and spec.tuned_op is None:
    raise ValueError(f"spec {spec.name}: sweep needs tuned_op")
  SPECS[spec.name] = spec
  return spec


def _op_attr(module: str, name: str) -> Callable:
  """``mla_pallas.ops.<module>.<name>``; ValueError (a clear message for ``--sweep``) when it does not exist."""
  fn = getattr(importlib.import_module(f"mla_pallas.ops.{module}"), name, None)
  if fn is None:
    raise ValueError(f"mla_pallas.ops.{module} has no {name}: this op's sweep is not available in this version")
  return fn


def _sweep(module: str, args: Callable[[dict], dict]) -> Callable[[dict], dict]:
  """BenchSpec.sweep: ``mla_pallas.ops.<module>.sweep_configs(**args(shape))``."""
  return lambda s: _op_attr(module, "sweep_configs")(**args(s))


def _model_preset(name: str) -> dict[str, Any]:
  from mla_pallas import config
  cfg = config.preset(name)
  return {"H": cfg.num_heads, "topk": cfg.index_topk, "page": cfg.page_size}


def _check_positive(shape, *names):
  for n in names:
    if shape[n] <= 0:
      raise ValueError(f"shape key {n!r} must be positive; got {shape[n]}")


def _check_page(shape):
  if shape["page"] % 16:
    raise ValueError(f"shape key 'page' must be a positive multiple of 16; got {shape['page']}")


CACHE_DTYPES = {"fp8": FP8, "bf16": jnp.bfloat16}   # shape key "cache"
_INVARIANT_KEY = (int, "1: the op's batch_invariant=True (splits of a fixed key count; sweeps run the default plan)")


def _invariant_kwargs(s):
  if s["invariant"] not in (0, 1):
    raise ValueError(f"shape key 'invariant' must be 0 or 1; got {s['invariant']}")
  return {"batch_invariant": bool(s["invariant"])}
_CACHE_KEY = (str, "cache dtype: fp8 (float8_e4m3fn, 576 B per token) or bf16 (bfloat16, 1152 B per token: BF16 "
                   "attention: the sm_90 bf16 kernels and the XLA path)")


def _cache_dtype(s):
  return CACHE_DTYPES[s["cache"]]


def _row_bytes(s):
  """Bytes per cache row of the shape's cache dtype."""
  return D_QK * jnp.dtype(_cache_dtype(s)).itemsize


def _check_cache(s):
  if s["cache"] not in CACHE_DTYPES:
    raise ValueError(f"shape key 'cache' must be one of {', '.join(CACHE_DTYPES)}; got {s['cache']!r}")


def _random_cache(key, num_pages, page, dtype=FP8):
  # N(0, 1) latent rows in the cache dtype (rounded to e4m3 for fp8: |x| < 448 always holds for normals).
  return jax.random.normal(key, (num_pages, page, D_QK), jnp.bfloat16).astype(dtype)


def _random_slots(key, block_table, rows_shape, ctx, topk, page):
  """Random distinct positions in [0, ctx) per row, mapped to flat slots through ``block_table`` [B, pages].

  rows_shape = (B, s_q); returns int32 [B, s_q, topk]; entries past ctx (topk > ctx) are -1, as DSA emits.
  """
  b, s_q = rows_shape
  k = min(topk, ctx)
  # top_k of uniform noise = k distinct positions in random order (the indexer's top-k is not position-sorted).
  _, pos = jax.lax.top_k(jax.random.uniform(key, (b, s_q, ctx)), k)
  pos = pos.astype(jnp.int32)
  pages = jnp.take_along_axis(block_table[:, None, :], pos // page, axis=2)
  slots = pages * page + pos % page
  if topk > k:
    slots = jnp.concatenate([slots, jnp.full((b, s_q, topk - k), -1, jnp.int32)], axis=-1)
  return slots


# ---- sparse_mla_decode -----------------------------------------------------------------------------------

_DECODE_KEYS = {
    "B": (int, "batch (sequences)"),
    "s_q": (int, "query tokens per sequence (MTP: 2)"),
    "H": (int, "query heads"),
    "topk": (int, "indexer top-k: keys per query token (entries past ctx are -1)"),
    "page": (int, "KV-cache page size (multiple of 16)"),
    "ctx": (int, "cache tokens per sequence (the cache holds B * ceil(ctx/page) pages, shuffled)"),
    "softmax_scale": (float, "softmax scale (default 576**-0.5: logits of std 1 on N(0,1) data)"),
    "kv_scale": (float, "per-tensor dequantization scale of the cache"),
    "cache": _CACHE_KEY,
    "invariant": _INVARIANT_KEY,
}
_SCALE_DEFAULTS = {"softmax_scale": D_QK ** -0.5, "kv_scale": 1.0, "cache": "fp8", "invariant": 0}


def _decode_validate(s):
  _invariant_kwargs(s)
  _check_positive(s, "B", "s_q", "H", "topk", "page", "ctx")
  _check_page(s)
  _check_cache(s)
  if not (s["softmax_scale"] > 0 and s["kv_scale"] > 0):
    raise ValueError("shape keys 'softmax_scale' and 'kv_scale' must be positive")


def _pages_per_seq(s):
  return -(-s["ctx"] // s["page"])


@functools.partial(jax.jit, static_argnums=(0,))
def _decode_inputs_jit(shape_items, key):
  s = dict(shape_items)
  b, s_q, h, page = s["B"], s["s_q"], s["H"], s["page"]
  pps = _pages_per_seq(s)
  k_cache, k_perm, k_idx, k_q = jax.random.split(key, 4)
  cache = _random_cache(k_cache, b * pps, page, _cache_dtype(s))
  # sequence b owns pages block_table[b] of a shuffled page pool (as a paged allocator would leave them).
  block_table = jax.random.permutation(k_perm, b * pps).astype(jnp.int32).reshape(b, pps)
  indices = _random_slots(k_idx, block_table, (b, s_q), s["ctx"], s["topk"], page)
  q = jax.random.normal(k_q, (b, s_q, h, D_QK), jnp.bfloat16)
  return q, cache, indices


def _decode_inputs(s, key):
  return _decode_inputs_jit(tuple(sorted(s.items())), key)


def _scales(s):
  return {"softmax_scale": float(s["softmax_scale"]), "kv_scale": float(s["kv_scale"])}


def _sparse_arch(interpret):
  from mla_pallas import _dispatch
  return _dispatch.mosaic_arch(bool(interpret)) or "sm90"


def _sparse_tuned(prefill: bool):
  """BenchSpec.tuned_op of the sparse ops: ``_sparse_decode_jit(..., impl="mosaic", tuning=)``."""
  def make(s, tuning, interpret):
    jitted = _op_attr("sparse_decode", "_sparse_decode_jit")
    kw = dict(softmax_scale=float(s["softmax_scale"]), impl="mosaic", interpret=interpret, tuning=tuple(tuning),
              arch=_sparse_arch(interpret))
    kv_scale = jnp.float32(s["kv_scale"])

    def f(q, cache, indices):
      if prefill:      # the prefill op is the decode op with B = T, s_q = 1
        out, lse = jitted(q[:, None], cache.reshape(-1, D_QK), indices[:, None], kv_scale, None, **kw)
        return out[:, 0], lse[:, 0]
      return jitted(q, cache.reshape(-1, D_QK), indices, kv_scale, None, **kw)
    return f
  return make


def _sparse_sweep(prefill: bool):
  def args(s):
    tokens = s["T"] if prefill else s["B"] * s["s_q"]
    return dict(h=s["H"], batch_tokens=tokens, topk=s["topk"], arch=_sparse_arch(False),
                cache_dtype=jnp.dtype(_cache_dtype(s)).name)
  return _sweep("sparse_decode", args)


def _attn_tolerance(s, pv_length):
  # Full FP8 kernel path (q and P in e4m3, fp8 wgmma); logits have std softmax_scale*sqrt(576)*kv_scale on
  # N(0,1) data. Loose on purpose: the XLA path is held to the same bound. A bf16 cache: BF16 attention
  # (testing.BF16_ATTENTION_REL_L2: P and the outputs rounded to bf16).
  if s["cache"] == "bf16":
    return testing.BF16_ATTENTION_REL_L2
  logit_std = s["softmax_scale"] * math.sqrt(D_QK) * s["kv_scale"]
  return testing.fp8_error_budget(split_partials_bf16=True, pv_length=pv_length, logit_std=logit_std)


register(BenchSpec(
    name="sparse_mla_decode",
    keys=_DECODE_KEYS,
    op_only_kwargs=_invariant_kwargs,
    cpu_defaults=dict(B=2, s_q=1, H=16, topk=128, page=64, ctx=512, **_SCALE_DEFAULTS),
    gpu_defaults=dict(B=128, s_q=2, H=128, topk=2048, page=64, ctx=32768, **_SCALE_DEFAULTS),
    preset=_model_preset,
    validate=_decode_validate,
    make_inputs=_decode_inputs,
    op_kwargs=_scales,
    flops=lambda s: 2.0 * s["B"] * s["s_q"] * s["H"] * s["topk"] * (D_QK + D_V),
    gathered_bytes=lambda s: float(s["B"] * s["s_q"] * s["topk"] * _row_bytes(s)),
    set_bytes=lambda s: float(s["B"] * _pages_per_seq(s) * s["page"] * _row_bytes(s)
                              + s["B"] * s["s_q"] * (s["H"] * D_QK * 2 + s["topk"] * 4)),
    touched_bytes=lambda s: float(
        min(s["B"] * s["s_q"] * s["topk"], s["B"] * s["ctx"]) * _row_bytes(s)  # gathered rows
        + s["B"] * s["s_q"] * (s["H"] * D_QK * 2 + s["topk"] * 4)             # q, indices
        + s["B"] * s["s_q"] * s["H"] * (D_V * 2 + 4)),                        # out, lse
    tolerance=lambda s: _attn_tolerance(s, s["topk"]),
    outputs=("out", "lse"),
    module="mla_pallas.ops.sparse_decode",
    sweep=_sparse_sweep(prefill=False),
    tuned_op=_sparse_tuned(prefill=False),
))


# ---- dense_mla_decode -----------------------------------------------------------------------------------

_DENSE_KEYS = {
    "B": (int, "batch (sequences)"),
    "s_q": (int, "query tokens per sequence (the last s_q tokens of each sequence)"),
    "H": (int, "query heads"),
    "ctx": (int, "cache tokens per sequence, all attended (the cache holds B * ceil(ctx/page) pages, shuffled)"),
    "page": (int, "KV-cache page size (multiple of 16)"),
    "causal": (int, "1: query token i attends positions < ctx - s_q + i + 1; 0: all ctx positions"),
    "softmax_scale": (float, "softmax scale (default 576**-0.5: logits of std 1 on N(0,1) data)"),
    "kv_scale": (float, "per-tensor dequantization scale of the cache"),
    "cache": _CACHE_KEY,
    "invariant": _INVARIANT_KEY,
}


def _dense_validate(s):
  _invariant_kwargs(s)
  _check_positive(s, "B", "s_q", "H", "page", "ctx")
  _check_page(s)
  _check_cache(s)
  if s["causal"] not in (0, 1):
    raise ValueError(f"shape key 'causal' must be 0 or 1; got {s['causal']}")
  if not (s["softmax_scale"] > 0 and s["kv_scale"] > 0):
    raise ValueError("shape keys 'softmax_scale' and 'kv_scale' must be positive")


@functools.partial(jax.jit, static_argnums=(0,))
def _dense_inputs_jit(shape_items, key):
  s = dict(shape_items)
  b, s_q, h, page = s["B"], s["s_q"], s["H"], s["page"]
  pps = _pages_per_seq(s)
  k_cache, k_perm, k_q = jax.random.split(key, 3)
  cache = _random_cache(k_cache, b * pps, page, _cache_dtype(s))
  block_table = jax.random.permutation(k_perm, b * pps).astype(jnp.int32).reshape(b, pps)
  cache_seqlens = jnp.full((b,), s["ctx"], jnp.int32)
  q = jax.random.normal(k_q, (b, s_q, h, D_QK), jnp.bfloat16)
  return q, cache, block_table, cache_seqlens


def _dense_kwargs(s):
  return {**_scales(s), "causal": bool(s["causal"])}


def _dense_tuned(s, tuning, interpret):
  """BenchSpec.tuned_op of dense_mla_decode: the dense kernel (``_dense_kernel_jit(tuning=)``), or with the label
  ``(("route", "sparse"),)`` of ``dense_decode.sweep_configs`` the sparse-kernel route (``sparse_route``)."""
  kw = dict(softmax_scale=float(s["softmax_scale"]), causal=bool(s["causal"]), interpret=interpret)
  kv_scale = jnp.float32(s["kv_scale"])
  if tuple(tuning) == (("route", "sparse"),):
    route = _op_attr("dense_decode", "sparse_route")
    return lambda q, cache, table, lens: route(q, cache, table, lens, kv_scale, **kw)
  jitted = _op_attr("dense_decode", "_dense_kernel_jit")
  return lambda q, cache, table, lens: jitted(q, cache, table, lens, kv_scale, tuning=tuple(tuning), **kw)


register(BenchSpec(
    name="dense_mla_decode",
    keys=_DENSE_KEYS,
    op_only_kwargs=_invariant_kwargs,
    cpu_defaults=dict(B=2, s_q=1, H=16, ctx=512, page=64, causal=0, **_SCALE_DEFAULTS),
    # memory-bound default (the peer kit's D3): 1.2 GB of FP8 cache read per call
    gpu_defaults=dict(B=64, s_q=1, H=16, ctx=32768, page=64, causal=0, **_SCALE_DEFAULTS),
    preset=lambda name: {k: v for k, v in _model_preset(name).items() if k in ("H", "page")},
    validate=_dense_validate,
    make_inputs=lambda s, key: _dense_inputs_jit(tuple(sorted(s.items())), key),
    op_kwargs=_dense_kwargs,
    flops=lambda s: 2.0 * s["B"] * s["s_q"] * s["H"] * s["ctx"] * (D_QK + D_V),
    # "gath GB/s" = cache bytes the call must read (every attended row once) per second
    gathered_bytes=lambda s: float(s["B"] * s["ctx"] * _row_bytes(s)),
    set_bytes=lambda s: float(s["B"] * _pages_per_seq(s) * s["page"] * _row_bytes(s)
                              + s["B"] * (s["s_q"] * s["H"] * D_QK * 2 + _pages_per_seq(s) * 4 + 4)),
    touched_bytes=lambda s: float(s["B"] * s["ctx"] * _row_bytes(s)
                                  + s["B"] * s["s_q"] * s["H"] * (D_QK * 2 + D_V * 2 + 4)),
    tolerance=lambda s: _attn_tolerance(s, s["ctx"]),
    outputs=("out", "lse"),
    module="mla_pallas.ops.dense_decode",
    sweep=_sweep("dense_decode", lambda s: dict(h=s["H"], batch_tokens=s["B"] * s["s_q"],
                                                n_pos=_pages_per_seq(s) * s["page"], page=s["page"],
                                                cache_dtype=jnp.dtype(_cache_dtype(s)).name)),
    tuned_op=_dense_tuned,
    conventions={"flops": "2*B*s_q*H*ctx*(576+512) (non-causal count)",
                 "gathered_bytes": "cache bytes read: B*ctx*576 (FP8 rows; 1152 for bf16), each once"},
))


# ---- sparse_mla_prefill ----------------------------------------------------------------------------------

_PREFILL_KEYS = {
    "T": (int, "query tokens"),
    "H": (int, "query heads"),
    "topk": (int, "indexer top-k per token (entries past ctx are -1)"),
    "page": (int, "KV page size (multiple of 16); the kv is passed paged"),
    "ctx": (int, "kv tokens (ceil(ctx/page) shuffled pages)"),
    "softmax_scale": _DECODE_KEYS["softmax_scale"],
    "kv_scale": _DECODE_KEYS["kv_scale"],
    "cache": _CACHE_KEY,
    "invariant": _INVARIANT_KEY,
}


def _prefill_validate(s):
  _invariant_kwargs(s)
  _check_positive(s, "T", "H", "topk", "page", "ctx")
  _check_page(s)
  _check_cache(s)
  if not (s["softmax_scale"] > 0 and s["kv_scale"] > 0):
    raise ValueError("shape keys 'softmax_scale' and 'kv_scale' must be positive")


@functools.partial(jax.jit, static_argnums=(0,))
def _prefill_inputs_jit(shape_items, key):
  s = dict(shape_items)
  t, h, page = s["T"], s["H"], s["page"]
  pps = _pages_per_seq(s)
  k_cache, k_perm, k_idx, k_q = jax.random.split(key, 4)
  kv = _random_cache(k_cache, pps, page, _cache_dtype(s))
  block_table = jax.random.permutation(k_perm, pps).astype(jnp.int32).reshape(1, pps)
  indices = _random_slots(k_idx, block_table, (1, t), s["ctx"], s["topk"], page)[0]
  q = jax.random.normal(k_q, (t, h, D_QK), jnp.bfloat16)
  return q, kv, indices


register(BenchSpec(
    name="sparse_mla_prefill",
    keys=_PREFILL_KEYS,
    op_only_kwargs=_invariant_kwargs,
    cpu_defaults=dict(T=8, H=16, topk=128, page=64, ctx=512, **_SCALE_DEFAULTS),
    gpu_defaults=dict(T=4096, H=128, topk=2048, page=64, ctx=32768, **_SCALE_DEFAULTS),
    preset=_model_preset,
    validate=_prefill_validate,
    make_inputs=lambda s, key: _prefill_inputs_jit(tuple(sorted(s.items())), key),
    op_kwargs=_scales,
    flops=lambda s: 2.0 * s["T"] * s["H"] * s["topk"] * (D_QK + D_V),
    gathered_bytes=lambda s: float(s["T"] * s["topk"] * _row_bytes(s)),
    set_bytes=lambda s: float(_pages_per_seq(s) * s["page"] * _row_bytes(s)
                              + s["T"] * (s["H"] * D_QK * 2 + s["topk"] * 4)),
    touched_bytes=lambda s: float(
        min(s["T"] * s["topk"], s["ctx"]) * _row_bytes(s)
        + s["T"] * (s["H"] * D_QK * 2 + s["topk"] * 4)
        + s["T"] * s["H"] * (D_V * 2 + 4)),
    tolerance=lambda s: _attn_tolerance(s, s["topk"]),
    outputs=("out", "lse"),
    module="mla_pallas.ops.sparse_decode",
    sweep=_sparse_sweep(prefill=True),
    tuned_op=_sparse_tuned(prefill=True),
))


def _resolve_model(s, fields: dict[str, str]):
  """Check shape key 'model' (a preset of mla_pallas.config) and replace the keys of ``fields`` (key -> MLAConfig
  attribute) that are 0 by the model's values, in place, so that the JSON and the table show what ran."""
  from mla_pallas import config
  if s["model"] not in config.PRESETS:
    raise ValueError(f"shape key 'model' must be one of {', '.join(config.PRESETS)}; got {s['model']!r}")
  cfg = config.preset(s["model"])
  for key, attr in fields.items():
    if s[key] == 0:
      s[key] = getattr(cfg, attr)


# ---- mla_prefill: varlen attention of the dense prefill branch ---------------------------------------------

_MLA_PREFILL_KEYS = {
    "model": (str, "head dims of: deepseek_v32 (H 128, qk 192 / v 128) or glm5 (H 64, qk 256 / v 256)"),
    "H": (int, "query heads (0: the model's)"),
    "seqs": (int, "sequences in the packed batch"),
    "T": (int, "new tokens (queries) per sequence"),
    "ctx": (int, "cached tokens per sequence before the new ones: keys = ctx + T (> 0: cu_seqlens_k)"),
    "causal": (int, "1: causal (bottom-right with ctx > 0); 0: every key of the sequence"),
}


def _mla_prefill_cfg(s):
  from mla_pallas import config
  return config.preset(s["model"])


def _mla_prefill_validate(s):
  _resolve_model(s, {"H": "num_heads"})
  _check_positive(s, "H", "seqs", "T")
  if s["ctx"] < 0:
    raise ValueError(f"shape key 'ctx' must be >= 0; got {s['ctx']}")
  if s["causal"] not in (0, 1):
    raise ValueError(f"shape key 'causal' must be 0 or 1; got {s['causal']}")


def _mla_prefill_dims(s):
  cfg = _mla_prefill_cfg(s)
  return cfg.qk_head_dim, cfg.v_head_dim, cfg.softmax_scale


@functools.partial(jax.jit, static_argnums=(0,))
def _mla_prefill_inputs_jit(shape_items, key):
  s = dict(shape_items)
  dqk, dv, _ = _mla_prefill_dims(s)
  n, t, tk, h = s["seqs"], s["T"], s["ctx"] + s["T"], s["H"]
  kq, kk, kv = jax.random.split(key, 3)
  q = jax.random.normal(kq, (n * t, h, dqk), jnp.bfloat16)
  k = jax.random.normal(kk, (n * tk, h, dqk), jnp.bfloat16)
  v = jax.random.normal(kv, (n * tk, h, dv), jnp.bfloat16)
  cu = jnp.arange(n + 1, dtype=jnp.int32) * t
  cu_k = jnp.arange(n + 1, dtype=jnp.int32) * tk
  return q, k, v, cu, cu_k


def _mla_prefill_op(impl, s, interpret):
  from mla_pallas.ops import prefill as pf
  _, dv, scale = _mla_prefill_dims(s)
  causal, ctx = bool(s["causal"]), s["ctx"] > 0
  if impl in IMPLS:
    return lambda q, k, v, cu, cu_k: pf.mla_prefill(q, k, v, cu, softmax_scale=scale, causal=causal,
                                                    cu_seqlens_k=cu_k if ctx else None, impl=impl,
                                                    interpret=interpret)
  if impl == "f32":                  # the float32 XLA backend (what runs off CUDA), on the same bf16 inputs
    return lambda q, k, v, cu, cu_k: pf._f32_jit(q, k, v, cu, jnp.float32(scale), causal=causal,
                                                 cu_seqlens_k=cu_k if ctx else None)
  if impl == "cudnn":                # cuDNN through jax.nn on the equal-length batch, V zero-padded to Dqk
    reason = pf._cudnn_device_reason()
    if reason is not None:
      raise NotImplementedError(f"cudnn: {reason}")
    if ctx and causal:
      raise NotImplementedError("cudnn: jax.nn.dot_product_attention has no bottom-right causal mask (ctx > 0)")
    n = s["seqs"]

    @jax.jit
    def f(q, k, v, cu, cu_k):
      del cu, cu_k
      dqk = q.shape[-1]
      vp = jnp.pad(v, ((0, 0), (0, 0), (0, dqk - dv)))
      o = jax.nn.dot_product_attention(q.reshape(n, -1, *q.shape[1:]), k.reshape(n, -1, *k.shape[1:]),
                                       vp.reshape(n, -1, *vp.shape[1:]), scale=scale, is_causal=causal,
                                       implementation="cudnn")
      return o.reshape(q.shape[0], q.shape[1], dqk)[..., :dv]
    return f
  raise ValueError(f"mla_prefill has no impl {impl!r}")


def _mla_prefill_tuned(s, tuning, interpret):
  """BenchSpec.tuned_op of mla_prefill: the kernel with ``tuning`` (``ops/prefill._mosaic_jit(cfg=...)``)."""
  from mla_pallas.ops import prefill as pf
  dqk, dv, scale = _mla_prefill_dims(s)
  causal, ctx = bool(s["causal"]), s["ctx"] > 0
  cfg = pf._tuned_config(tuning, dqk, dv)
  return lambda q, k, v, cu, cu_k: pf._mosaic_jit(q, k, v, cu, jnp.float32(scale), causal=causal,
                                                  cu_seqlens_k=cu_k if ctx else None, interpret=interpret, cfg=cfg)


def _mla_prefill_reference(s):
  # the float32 flash backend (tested against reference.mla_prefill): the reference's [H, T, Tk] logits would not
  # fit at the GPU default (128 x 8192 x 8192 x 4 B = 34 GB per temporary)
  return _mla_prefill_op("f32", s, False)


def _mla_prefill_tolerance(s):
  """The loosest row's error model, the kernel's (q and k in e4m3 per row, tests/test_prefill_kernel_gpu.py; P and
  V in e4m3 too for the sweep's ``pv_fp8`` rows): the logits of N(0, 1) q, k have std softmax_scale * sqrt(Dqk).
  cuDNN's own model is <= 4 * 2^-8 (tests/test_prefill_gpu.py); the f32 path rounds once to bf16."""
  dqk, _, scale = _mla_prefill_dims(s)
  return testing.fp8_error_budget(quantized_q=True, quantized_kv=True, quantized_p=True, fp8_mma=_on_gpu(),
                                  d_qk=dqk, pv_length=s["ctx"] + s["T"], logit_std=scale * math.sqrt(dqk))


def _mla_prefill_pairs(s):
  """(query, key) pairs attended: per sequence T * (ctx + T), or T * ctx + T (T + 1) / 2 causal."""
  t, c = s["T"], s["ctx"]
  per_seq = t * c + t * (t + 1) / 2 if s["causal"] else t * (c + t)
  return s["seqs"] * per_seq


def _mla_prefill_bytes(s):
  dqk, dv, _ = _mla_prefill_dims(s)
  n, t, tk, h = s["seqs"], s["T"], s["ctx"] + s["T"], s["H"]
  return float(n * h * (t * dqk * 2 + tk * (dqk + dv) * 2 + t * (dv * 2 + 4)))


register(BenchSpec(
    name="mla_prefill",
    keys=_MLA_PREFILL_KEYS,
    cpu_defaults=dict(model="deepseek_v32", H=4, seqs=2, T=128, ctx=0, causal=1),
    gpu_defaults=dict(model="deepseek_v32", H=0, seqs=2, T=4096, ctx=0, causal=1),
    preset=lambda name: {"model": name, "H": 0},
    validate=_mla_prefill_validate,
    make_inputs=lambda s, key: _mla_prefill_inputs_jit(tuple(sorted(s.items())), key),
    op_kwargs=lambda s: {},
    flops=lambda s: 2.0 * _mla_prefill_pairs(s) * s["H"] * sum(_mla_prefill_dims(s)[:2]),
    gathered_bytes=_mla_prefill_bytes,
    set_bytes=_mla_prefill_bytes,
    touched_bytes=_mla_prefill_bytes,
    tolerance=_mla_prefill_tolerance,
    outputs=("out", "lse"),
    make_op=_mla_prefill_op,
    make_reference=_mla_prefill_reference,
    extra_impls=("cudnn", "f32"),
    sweep=_sweep("prefill", lambda s: dict(dqk=_mla_prefill_dims(s)[0], dv=_mla_prefill_dims(s)[1])),
    tuned_op=_mla_prefill_tuned,
    bytes_kind="moved",
    conventions={"flops": "2 * attended (query, key) pairs * H * (Dqk + Dv): causal counts the triangle "
                          "(T * ctx + T (T + 1) / 2 per sequence), as FlashAttention does",
                 "gathered_bytes": "bf16 q, k, v read once and out + lse written once"},
))


# ---- quantize_and_bmm_fp8 --------------------------------------------------------------------------------

_BMM_KEYS = {
    "T": (int, "tokens (rows of a [T, H, K])"),
    "H": (int, "heads (the batch of the BMM)"),
    "K": (int, "reduction dim (W_UK: qk_nope 128 DeepSeek-V3.2 / 192 GLM-5; W_UV: 512)"),
    "N": (int, "output dim (W_UK: 512; W_UV: v_head_dim 128 / 256)"),
    "hnk": (int, "1: weight prepared once as [H, N, K] (what the kernel reads); 0: [H, K, N] (the kernel path "
                 "then transposes it in every call)"),
    "per_tensor": (int, "1: one activation scale for all of a; 0: per-token (per (t, h) row) scales"),
}


def _bmm_preset(name: str) -> dict[str, Any]:
  from mla_pallas import config
  cfg = config.preset(name)     # the absorbed q_nope @ W_UK of the model (K = qk_nope, N = kv_lora_rank)
  return {"H": cfg.num_heads, "K": cfg.qk_nope_head_dim, "N": cfg.kv_lora_rank}


def _check_flags(shape, *names):
  for n in names:
    if shape[n] not in (0, 1):
      raise ValueError(f"shape key {n!r} must be 0 or 1; got {shape[n]}")


def _bmm_validate(s):
  _check_positive(s, "T", "H", "K", "N")
  _check_flags(s, "hnk", "per_tensor")


@functools.partial(jax.jit, static_argnums=(0,))
def _bmm_inputs_jit(shape_items, key):
  from mla_pallas import quant
  s = dict(shape_items)
  t, h, k, n = s["T"], s["H"], s["K"], s["N"]
  k_a, k_w = jax.random.split(key)
  a = jax.random.normal(k_a, (t, h, k), jnp.bfloat16)
  w8, ws = quant.quantize_blocks_fp8(jax.random.normal(k_w, (h, k, n), jnp.float32) * k ** -0.5)
  if s["hnk"]:
    w8 = jnp.swapaxes(w8, 1, 2)       # mla_pallas.ops.bmm_fp8.prepare_weight, done once (weights are static)
  return a, w8, ws


def _bmm_kwargs(s):
  return dict(act_scale="per_tensor" if s["per_tensor"] else "per_token")


def _bmm_op(impl, s, interpret):
  from mla_pallas.ops.bmm_fp8 import quantize_and_bmm_fp8
  return functools.partial(quantize_and_bmm_fp8, **_bmm_kwargs(s), weight_layout="hnk" if s["hnk"] else "hkn",
                           impl=impl, interpret=interpret)


def _bmm_tuned(s, tuning, interpret):
  return functools.partial(_op_attr("bmm_fp8", "_bmm_jit"), **_bmm_kwargs(s),
                           weight_layout="hnk" if s["hnk"] else "hkn", impl="mosaic", interpret=interpret,
                           tuning=tuple(tuning))


def _bmm_reference(s):
  from mla_pallas import reference

  def ref(a, w, w_scale):
    return reference.quantize_and_bmm_fp8(a, jnp.swapaxes(w, 1, 2) if s["hnk"] else w, w_scale, **_bmm_kwargs(s))
  return ref


def _bmm_bytes(s):
  t, h, k, n = s["T"], s["H"], s["K"], s["N"]
  return float(t * h * k * 2 + h * k * n + h * (-(-k // 128)) * (-(-n // 128)) * 4 + t * h * n * 2)


def _bmm_tolerance(s):
  # Both paths quantize a exactly as the reference does (bitwise the same fp8 operands), so what is left is the
  # accumulation of the fp8 products (Hopper fp8 wgmma / cuBLASLt: the error model's "qk_mma" term with reduction
  # length K on N(0, 1)-like data) and the bf16 rounding of both outputs ("out_bf16"); no q/P quantization term.
  return testing.fp8_error_budget(quantized_q=False, quantized_p=False, fp8_mma=True, d_qk=s["K"], pv_length=1,
                                  logit_std=1.0)


register(BenchSpec(
    name="quantize_and_bmm_fp8",
    keys=_BMM_KEYS,
    cpu_defaults=dict(T=8, H=4, K=128, N=256, hnk=1, per_tensor=0),
    gpu_defaults=dict(T=4096, H=128, K=128, N=512, hnk=1, per_tensor=0),
    preset=_bmm_preset,
    validate=_bmm_validate,
    make_inputs=lambda s, key: _bmm_inputs_jit(tuple(sorted(s.items())), key),
    op_kwargs=_bmm_kwargs,
    flops=lambda s: 2.0 * s["T"] * s["H"] * s["K"] * s["N"],
    gathered_bytes=_bmm_bytes,
    set_bytes=_bmm_bytes,
    touched_bytes=_bmm_bytes,
    tolerance=_bmm_tolerance,
    make_op=_bmm_op,
    make_reference=_bmm_reference,
    reference_on_cpu=True,
    bytes_kind="moved",
    conventions={"flops": "2*T*H*K*N", "gathered_bytes": "moved bytes: a bf16 [T,H,K] in, fp8 weight and its "
                 "block scales in, bf16 [T,H,N] out (the minimum; the Mosaic path also writes and re-reads a8)"},
    module="mla_pallas.ops.bmm_fp8",
    sweep=_sweep("bmm_fp8", lambda s: dict(t=s["T"], k=s["K"], n=s["N"], h=s["H"])),
    tuned_op=_bmm_tuned,
))


# ---- fused_rope_rmsnorm_quantization / rope_rmsnorm ------------------------------------------------------

_ROPE_KEYS = {
    "T": (int, "tokens (decode: B * s_q)"),
    "H": (int, "query heads (of the q_rope [T, H, 64] rotated alongside)"),
    "interleaved": (int, "1: DeepSeek interleaved RoPE pairs; 0: NeoX half-split pairs"),
    "page": (int, "cache page size (multiple of 16); the cache holds ceil(2T/page) pages"),
    "max_pos": (int, "rows of the cos/sin tables (positions are random in [0, max_pos))"),
    "kv_scale": (float, "per-tensor scale of the fp8 cache"),
}
_ROPE_EPS = 1e-6


def _rope_validate(s):
  _check_positive(s, "T", "H", "page", "max_pos")
  _check_page(s)
  _check_flags(s, "interleaved")
  if not s["kv_scale"] > 0:
    raise ValueError("shape key 'kv_scale' must be positive")


def _rope_num_pages(s):
  return -(-2 * s["T"] // s["page"])


def _rope_moved(s, fused):
  """Bytes the op must read and write: kv [T,576] bf16 in, q_rope [T,H,64] bf16 in and out, the cos/sin rows of
  the T positions (2 x 32 f32), positions (+ slots) int32, the norm weight; then fp8 rows [T,576] out (fused) or
  bf16 kv rows [T,576] out (unfused)."""
  t, h = s["T"], s["H"]
  b = t * D_QK * 2 + 2 * t * h * 64 * 2 + t * 2 * 32 * 4 + t * 4 + D_V * 2
  return float(b + (t * D_QK + t * 4 if fused else t * D_QK * 2))


def _copy_words(s, fused):
  # "copy" reads and writes half of the op's bytes each: a uint32 buffer of moved / 8 elements.
  return max(1, int(_rope_moved(s, fused)) // 8)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _rope_inputs_jit(shape_items, fused, key):
  from mla_pallas import reference
  s = dict(shape_items)
  t, h = s["T"], s["H"]
  k_kv, k_q, k_p, k_w, k_s, k_b = jax.random.split(key, 6)
  kv = (jax.random.normal(k_kv, (t, D_QK), jnp.float32) * 2.0).astype(jnp.bfloat16)
  q_rope = jax.random.normal(k_q, (t, h, 64), jnp.bfloat16)
  positions = jax.random.randint(k_p, (t,), 0, s["max_pos"], jnp.int32)
  cos, sin = reference.rope_tables(s["max_pos"])
  norm_w = (1.0 + 0.1 * jax.random.normal(k_w, (D_V,), jnp.float32)).astype(jnp.bfloat16)
  buf = jax.random.bits(k_b, (_copy_words(s, fused),), jnp.uint32)
  if not fused:
    return kv, q_rope, positions, cos, sin, norm_w, buf
  num_pages = _rope_num_pages(s)
  pages = jnp.zeros((num_pages, s["page"], D_QK), FP8)
  slots = jax.random.permutation(k_s, num_pages * s["page"])[:t].astype(jnp.int32)   # distinct, scattered
  return pages, kv, q_rope, positions, cos, sin, norm_w, slots, buf


def _copy(buf):
  # A read + write of buf's bytes that XLA cannot elide or turn into a no-op (x + 0 / x * 1 would be folded).
  return jnp.bitwise_not(buf)


def _fused_op(impl, s, interpret):
  kw = dict(eps=_ROPE_EPS, kv_scale=float(s["kv_scale"]), interleaved=bool(s["interleaved"]))
  if impl == "copy":
    return lambda pages, kv, q, pos, cos, sin, w, slots, buf: (pages, _copy(buf))
  from mla_pallas.ops.rope_rmsnorm import fused_rope_rmsnorm_quantization

  def f(pages, kv, q, pos, cos, sin, w, slots, buf):
    return fused_rope_rmsnorm_quantization(pages, kv, q, pos, cos, sin, w, slots=slots, impl=impl,
                                           interpret=interpret, **kw)
  return f


def _fused_reference(s):
  from mla_pallas import reference

  def ref(pages, kv, q, pos, cos, sin, w, slots, buf):
    return reference.rope_rmsnorm_quantize_write(pages, kv, q, pos, cos, sin, w, eps=_ROPE_EPS,
                                                 kv_scale=float(s["kv_scale"]), slots=slots,
                                                 interleaved=bool(s["interleaved"]))
  return ref


def _fused_tuned(s, tuning, interpret):
  jitted = _op_attr("rope_rmsnorm", "_fused_mosaic")

  def f(pages, kv, q, pos, cos, sin, w, slots, buf):
    return jitted(pages, kv, q, pos, cos, sin, w, jnp.float32(_ROPE_EPS), jnp.float32(s["kv_scale"]), slots,
                  interleaved=bool(s["interleaved"]), tuning=tuple(tuning))
  return f


def _unfused_tuned(s, tuning, interpret):
  jitted = _op_attr("rope_rmsnorm", "_rope_rmsnorm_mosaic")

  def f(kv, q, pos, cos, sin, w, buf):
    return jitted(kv, q, pos, cos, sin, w, jnp.float32(_ROPE_EPS), interleaved=bool(s["interleaved"]),
                  tuning=tuple(tuning))
  return f


def _rope_sweep(fused: bool):
  return _sweep("rope_rmsnorm", lambda s: dict(t=s["T"], h=s["H"], fused=fused))


def _unfused_op(impl, s, interpret):
  if impl == "copy":
    return lambda kv, q, pos, cos, sin, w, buf: _copy(buf)
  from mla_pallas.ops.rope_rmsnorm import rope_rmsnorm

  def f(kv, q, pos, cos, sin, w, buf):
    return rope_rmsnorm(kv, q, pos, cos, sin, w, eps=_ROPE_EPS, interleaved=bool(s["interleaved"]), impl=impl,
                        interpret=interpret)
  return f


def _unfused_reference(s):
  from mla_pallas import reference

  def ref(kv, q, pos, cos, sin, w, buf):
    return reference.rope_rmsnorm(kv, q, pos, cos, sin, w, eps=_ROPE_EPS, interleaved=bool(s["interleaved"]))
  return ref


# The XLA paths are bitwise the reference; the kernel differs in a few values by one bf16 ulp / one e4m3 step
# (RMS summation order; tests/_rope_inputs.py checks that near-bitwise). The tolerance here is the RMS of one
# rounding to the output format (testing's unit roundoffs / sqrt(3)): an implementation may not be worse than
# re-rounding every element once.
_E4M3_ROUNDING = testing.E4M3_UNIT_ROUNDOFF / math.sqrt(3.0)
_BF16_ROUNDING = testing.BF16_UNIT_ROUNDOFF / math.sqrt(3.0)
_ROPE_CONVENTIONS = {
    "flops": "0 (memory-bound op)",
    "gathered_bytes": "moved bytes: kv [T,576] bf16 in, q_rope [T,H,64] bf16 in and out, cos/sin rows of the T "
                      "positions (2 x 32 f32), positions/slots int32, norm weight; fp8 [T,576] rows out (fused) "
                      "or bf16 [T,576] out (rope_rmsnorm)",
    "copy": "impl 'copy': bitwise_not of a uint32 buffer of moved/2 bytes (reads and writes the op's bytes) in "
            "the same run; frac_of_copy = copy time / impl time",
}

register(BenchSpec(
    name="fused_rope_rmsnorm_quantization",
    keys=_ROPE_KEYS,
    cpu_defaults=dict(T=16, H=16, interleaved=1, page=64, max_pos=4096, kv_scale=1.0),
    gpu_defaults=dict(T=4096, H=128, interleaved=1, page=64, max_pos=32768, kv_scale=1.0),
    preset=lambda name: {k: v for k, v in _model_preset(name).items() if k in ("H", "page")},
    validate=_rope_validate,
    make_inputs=lambda s, key: _rope_inputs_jit(tuple(sorted(s.items())), True, key),
    op_kwargs=lambda s: {},
    flops=lambda s: 0.0,
    gathered_bytes=lambda s: _rope_moved(s, True),
    set_bytes=lambda s: float(_rope_moved(s, True) * 1.5 + _rope_num_pages(s) * s["page"] * D_QK
                              + 2 * s["max_pos"] * 32 * 4),
    touched_bytes=lambda s: 2.0 * _rope_moved(s, True),      # the op's bytes, then the copy's
    tolerance=lambda s: {"cache": _E4M3_ROUNDING, "q_rope": _BF16_ROUNDING},
    outputs=("cache", "q_rope"),
    make_op=_fused_op,
    make_reference=_fused_reference,
    extra_impls=("copy",),
    state=(0, 0),
    bytes_kind="moved",
    conventions=_ROPE_CONVENTIONS,
    module="mla_pallas.ops.rope_rmsnorm",
    sweep=_rope_sweep(fused=True),
    tuned_op=_fused_tuned,
))

register(BenchSpec(
    name="rope_rmsnorm",
    keys={k: v for k, v in _ROPE_KEYS.items() if k not in ("page", "kv_scale")},
    cpu_defaults=dict(T=16, H=16, interleaved=1, max_pos=4096),
    gpu_defaults=dict(T=4096, H=128, interleaved=1, max_pos=32768),
    preset=lambda name: {"H": _model_preset(name)["H"]},
    validate=lambda s: (_check_positive(s, "T", "H", "max_pos"), _check_flags(s, "interleaved")),
    make_inputs=lambda s, key: _rope_inputs_jit(tuple(sorted(s.items())), False, key),
    op_kwargs=lambda s: {},
    flops=lambda s: 0.0,
    gathered_bytes=lambda s: _rope_moved(s, False),
    set_bytes=lambda s: float(_rope_moved(s, False) * 1.5 + 2 * s["max_pos"] * 32 * 4),
    touched_bytes=lambda s: 2.0 * _rope_moved(s, False),
    tolerance=lambda s: {"kv": _BF16_ROUNDING, "q_rope": _BF16_ROUNDING},
    outputs=("kv", "q_rope"),
    make_op=_unfused_op,
    make_reference=_unfused_reference,
    extra_impls=("copy",),
    bytes_kind="moved",
    conventions=_ROPE_CONVENTIONS,
    module="mla_pallas.ops.rope_rmsnorm",
    sweep=_rope_sweep(fused=False),
    tuned_op=_unfused_tuned,
))


# ---- mla_decode_step: one decode step of an MLA layer's attention graph --------------------------------------

_STEP_KEYS = {
    "model": (str, "model config: deepseek_v32 or glm5 (mla_pallas.config)"),
    "B": (int, "batch (sequences)"),
    "s_q": (int, "new tokens per sequence (MTP: 2)"),
    "H": (int, "query heads of the whole model (0: the model's); the step runs H / tp of them"),
    "tp": (int, "tensor-parallel degree: the step runs one shard's H / tp heads"),
    "topk": (int, "indexer top-k (0: the model's index_topk)"),
    "page": (int, "cache page size (0: the model's page_size)"),
    "ctx": (int, "cache tokens per sequence, the new ones included (the cache holds B * ceil(ctx/page) pages)"),
    "kv_scale": (float, "per-tensor scale of the fp8 cache"),
}


def _step_cfg(s):
  from mla_pallas import config
  cfg = config.preset(s["model"]).replace(page_size=s["page"])
  return cfg.with_heads(s["H"] // s["tp"])


def _step_validate(s):
  _resolve_model(s, {"H": "num_heads", "topk": "index_topk", "page": "page_size"})
  _check_positive(s, "B", "s_q", "H", "tp", "topk", "page", "ctx")
  _check_page(s)
  if s["H"] % s["tp"]:
    raise ValueError(f"shape key 'tp' must divide H={s['H']}; got {s['tp']}")
  if s["s_q"] > s["ctx"]:
    raise ValueError(f"shape key 'ctx' must be >= s_q (the cache holds the new tokens); got {s['ctx']}")
  if not s["kv_scale"] > 0:
    raise ValueError("shape key 'kv_scale' must be positive")


@functools.partial(jax.jit, static_argnums=(0,))
def _step_inputs_jit(shape_items, key):
  from mla_pallas import quant, reference
  s = dict(shape_items)
  cfg = _step_cfg(s)
  b, s_q, h, page, ctx = s["B"], s["s_q"], cfg.num_heads, s["page"], s["ctx"]
  nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
  pps = _pages_per_seq(s)
  ks = jax.random.split(key, 10)
  pages = _random_cache(ks[0], b * pps, page)
  block_table = jax.random.permutation(ks[1], b * pps).astype(jnp.int32).reshape(b, pps)
  indices = _random_slots(ks[2], block_table, (b, s_q), ctx, s["topk"], page)
  positions = jnp.broadcast_to(ctx - s_q + jnp.arange(s_q, dtype=jnp.int32), (b, s_q))   # the last tokens
  from mla_pallas import cache as mcache
  slots = mcache.slots_for_positions(block_table, positions, page)
  q_nope = jax.random.normal(ks[3], (b, s_q, h, nope), jnp.bfloat16)
  q_rope = jax.random.normal(ks[4], (b, s_q, h, 64), jnp.bfloat16)
  kv = jax.random.normal(ks[5], (b, s_q, D_QK), jnp.bfloat16)
  cos, sin = cfg.rope_tables(ctx)                 # YaRN tables where the preset has rope scaling
  # weights with std 1/sqrt(fan_in): q_latent ~ N(0, 1) like the cache rows
  w_uk, uks = quant.quantize_blocks_fp8(jax.random.normal(ks[6], (h, nope, D_V), jnp.float32) * nope ** -0.5)
  w_uv, uvs = quant.quantize_blocks_fp8(jax.random.normal(ks[7], (h, D_V, v), jnp.float32) * D_V ** -0.5)
  norm_w = (1.0 + 0.1 * jax.random.normal(ks[8], (D_V,), jnp.float32)).astype(jnp.bfloat16)
  kv_scale = jnp.asarray(s["kv_scale"], jnp.float32)
  return (pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, indices,
          _fp8_weights(w_uk, uks, w_uv, uvs, norm_w))


def _fp8_weights(w_uk, uks, w_uv, uvs, norm_w):
  """The graph's FP8 weights as a model holds them: with the kernel layouts, transposed once (outside the timing)."""
  from mla_pallas import graph
  return graph.MLAWeightsFP8(w_uk, uks, w_uv, uvs, norm_w).with_kernel_layouts()


def _step_op(impl, s, interpret):
  if impl not in IMPLS:
    raise ValueError(f"mla_decode_step has no impl {impl!r}")
  from mla_pallas import graph
  cfg = _step_cfg(s)

  def f(pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, indices, w):
    return graph.mla_decode_branch_fp8(w, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                                       cfg=cfg, indices=indices, impl=impl, interpret=interpret)
  return f


def _step_reference(s):
  from mla_pallas import graph
  cfg = _step_cfg(s)

  def ref(pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, indices, w):
    return graph.reference_decode_branch(w, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                                         cfg=cfg, indices=indices)
  return ref


def _step_info(impl, s):
  from mla_pallas import graph
  cfg = _step_cfg(s)
  rep = graph.graph_report()
  return {"steps": rep["steps"] if rep else None, "graph": rep["graph"] if rep else None,
          "heads_run": cfg.num_heads, "qk_nope_head_dim": cfg.qk_nope_head_dim, "v_head_dim": cfg.v_head_dim,
          "softmax_scale": cfg.softmax_scale, "impl_argument": impl}


def _step_flops(s):
  cfg = _step_cfg(s)
  t, h = s["B"] * s["s_q"], cfg.num_heads
  return (2.0 * t * h * s["topk"] * (D_QK + D_V)
          + 2.0 * t * h * D_V * (cfg.qk_nope_head_dim + cfg.v_head_dim))


def _step_weight_bytes(s):
  cfg = _step_cfg(s)
  return float(cfg.num_heads * D_V * (cfg.qk_nope_head_dim + cfg.v_head_dim))


def _step_tolerance(s):
  cfg = _step_cfg(s)
  # q_latent and the cache rows are ~N(0, 1): logits of std softmax_scale * sqrt(576) * kv_scale. The BMMs add
  # only fp8 accumulation error (their activation quantization is the reference's); the attention term dominates.
  return testing.fp8_error_budget(
      split_partials_bf16=True, logit_std=cfg.softmax_scale * math.sqrt(D_QK) * s["kv_scale"],
      pv_length=s["topk"], fp8_mma=_on_gpu())


_DECODE_STEP = register(BenchSpec(
    name="mla_decode_step",
    keys=_STEP_KEYS,
    cpu_defaults=dict(model="deepseek_v32", B=2, s_q=1, H=16, tp=1, topk=64, page=64, ctx=256, kv_scale=1.0),
    gpu_defaults=dict(model="deepseek_v32", B=128, s_q=1, H=0, tp=1, topk=0, page=0, ctx=32768, kv_scale=1.0),
    preset=lambda name: {"model": name, "H": 0, "topk": 0, "page": 0},
    validate=_step_validate,
    make_inputs=lambda s, key: _step_inputs_jit(tuple(sorted(s.items())), key),
    op_kwargs=lambda s: {},
    flops=_step_flops,
    gathered_bytes=lambda s: float(s["B"] * s["s_q"] * s["topk"] * D_QK),
    set_bytes=lambda s: float(s["B"] * _pages_per_seq(s) * s["page"] * D_QK + _step_weight_bytes(s)
                              + s["B"] * s["s_q"] * s["topk"] * 4),
    touched_bytes=lambda s: float(min(s["B"] * s["s_q"] * s["topk"], s["B"] * s["ctx"]) * D_QK
                                  + _step_weight_bytes(s)),
    tolerance=_step_tolerance,
    outputs=("out",),                  # the new cache (output 1) is not compared: it can be gigabytes
    make_op=_step_op,
    make_reference=_step_reference,
    extra_impls=("auto",),
    state=(0, 1),
    conventions={
        "flops": "attention 2*T*H*topk*(576+512) (FlashMLA) + the two absorbed BMMs 2*T*H*512*(nope+v); "
                 "H = heads run (H/tp), T = B*s_q",
        "gathered_bytes": "576 B per query token and top-k entry (FlashMLA)",
        "scope": "mla_pallas.graph.mla_decode_branch_fp8 (sparse top-k): fused rope+rmsnorm+fp8 cache write, "
                 "q_nope @ W_UK, sparse_mla_decode, o @ W_UV; the projections (W_q_a/W_q_b/W_kv_a/W_o) and the "
                 "indexer are not included. Cache donated and updated in place; impl = the graph's impl argument; "
                 "results[].info.steps = graph_report() (which implementation each step ran)",
    },
    info=_step_info,
    module="mla_pallas.graph",
))


# ---- mla_layer_decode: one FP8 MLAAttention layer's decode (projections included) ------------------------------

@functools.partial(jax.jit, static_argnums=(0,))
def _layer_inputs_jit(shape_items, key):
  from mla_pallas import layer as L
  s = dict(shape_items)
  cfg = _step_cfg(s)
  b, s_q, page, ctx = s["B"], s["s_q"], s["page"], s["ctx"]
  pps = _pages_per_seq(s)
  ks = jax.random.split(key, 5)
  lay = L.MLAAttention.init(ks[0], cfg).to_fp8()       # K-major FP8 weights, as a served model holds them
  block_table = jax.random.permutation(ks[1], b * pps).astype(jnp.int32).reshape(b, pps)
  cache = L.PagedCache(_random_cache(ks[2], b * pps, page), jnp.asarray(s["kv_scale"], jnp.float32), block_table,
                       jnp.full((b,), ctx - s_q, jnp.int32))
  x = jax.random.normal(ks[3], (b, s_q, cfg.hidden_size), jnp.bfloat16)
  positions = cache.seq_lens[:, None] + jnp.arange(s_q, dtype=jnp.int32)
  indices = _random_slots(ks[4], block_table, (b, s_q), ctx, s["topk"], page)
  return lay, x, positions, cache, indices


def _layer_call(decode, s, **kw):
  def f(lay, x, positions, cache, indices):
    return decode(lay, x, positions, cache, indices=indices, **kw)
  return f


def _layer_op(impl, s, interpret):
  if impl not in IMPLS:
    raise ValueError(f"mla_layer_decode has no impl {impl!r}")
  from mla_pallas import layer as L
  return _layer_call(L.MLAAttention.decode, s, impl=impl, interpret=interpret)


def _layer_reference(s):
  from mla_pallas import layer as L
  return _layer_call(L.reference_decode, s)


def _layer_weight_bytes(s):
  cfg = _step_cfg(s)
  h, hid, q_in = cfg.num_heads, cfg.hidden_size, cfg.q_lora_rank or cfg.hidden_size
  lora = hid * cfg.q_lora_rank if cfg.q_lora_rank else 0
  return float(lora + h * q_in * (cfg.qk_nope_head_dim + 64) + hid * D_QK + _step_weight_bytes(s)
               + h * cfg.v_head_dim * hid)


def _layer_flops(s):
  return _step_flops(s) + 2.0 * s["B"] * s["s_q"] * _layer_weight_bytes(s)   # one fp8 byte = one MAC per token


# the step's keys, presets, checks, tolerance and graph report; its own inputs, op, reference and byte counts
register(dataclasses.replace(
    _DECODE_STEP,
    name="mla_layer_decode",
    cpu_defaults=dict(model="glm5", B=2, s_q=1, H=8, tp=1, topk=32, page=16, ctx=64, kv_scale=1.0),
    gpu_defaults=dict(model="deepseek_v32", B=1, s_q=1, H=0, tp=1, topk=0, page=0, ctx=32768, kv_scale=1.0),
    make_inputs=lambda s, key: _layer_inputs_jit(tuple(sorted(s.items())), key),
    flops=_layer_flops,
    set_bytes=lambda s: float(s["B"] * _pages_per_seq(s) * s["page"] * D_QK + _layer_weight_bytes(s)),
    touched_bytes=lambda s: float(min(s["B"] * s["s_q"] * s["topk"], s["B"] * s["ctx"]) * D_QK
                                  + _layer_weight_bytes(s)),
    make_op=_layer_op,
    make_reference=_layer_reference,
    state=(3, 1),
    conventions={
        "flops": "mla_decode_step's + 2 per token and fp8 weight byte of the projections",
        "gathered_bytes": _DECODE_STEP.conventions["gathered_bytes"],
        "scope": "mla_pallas.MLAAttention.decode of an FP8 layer (to_fp8: K-major weights) with sparse top-k "
                 "indices: the projections (W_q_a, W_q_b, W_kv_a, W_o), the fused cache write, the absorbed BMMs "
                 "and sparse attention; H / tp heads of the model's hidden size. Cache donated; impl as the "
                 "layer's impl argument (the projections take the BMM's entry); results[].info.steps = "
                 "graph_report() of its attention graph.",
    },
    module="mla_pallas.layer",
))


# ---- mla_prefill_step: the dense prefill branch of one MLA layer, optionally over cached context -------------

_PSTEP_KEYS = {
    "model": _STEP_KEYS["model"],
    "seqs": (int, "sequences"),
    "T": (int, "new tokens per sequence"),
    "ctx": (int, "tokens per sequence already in the cache (0: a fresh prompt, the branch without context)"),
    "H": _STEP_KEYS["H"],
    "tp": _STEP_KEYS["tp"],
    "page": _STEP_KEYS["page"],
    "kv_scale": _STEP_KEYS["kv_scale"],
}


def _pstep_validate(s):
  _resolve_model(s, {"H": "num_heads", "page": "page_size"})
  _check_positive(s, "seqs", "T", "H", "tp", "page")
  _check_page(s)
  if s["ctx"] < 0:
    raise ValueError(f"shape key 'ctx' must be >= 0; got {s['ctx']}")
  if s["H"] % s["tp"]:
    raise ValueError(f"shape key 'tp' must divide H={s['H']}; got {s['tp']}")
  if not s["kv_scale"] > 0:
    raise ValueError("shape key 'kv_scale' must be positive")


def _pstep_pages(s):
  return -(-(s["ctx"] + s["T"]) // s["page"])


@functools.partial(jax.jit, static_argnums=(0,))
def _pstep_inputs_jit(shape_items, key):
  from mla_pallas import quant
  s = dict(shape_items)
  cfg = _step_cfg(s)
  n, t, c, h, page = s["seqs"], s["T"], s["ctx"], cfg.num_heads, s["page"]
  nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
  pps = _pstep_pages(s)
  ks = jax.random.split(key, 10)
  pages = _random_cache(ks[0], n * pps, page)              # the context rows (and rows the write overwrites)
  block_table = jax.random.permutation(ks[1], n * pps).astype(jnp.int32).reshape(n, pps)
  positions = jnp.tile(c + jnp.arange(t, dtype=jnp.int32), n)
  from mla_pallas import cache as mcache
  seq = jnp.repeat(jnp.arange(n, dtype=jnp.int32), t)
  slots = mcache.slots_for_positions(block_table[seq], positions[:, None], page)[:, 0]
  q_nope = jax.random.normal(ks[3], (n * t, h, nope), jnp.bfloat16)
  q_rope = jax.random.normal(ks[4], (n * t, h, 64), jnp.bfloat16)
  kv = jax.random.normal(ks[5], (n * t, D_QK), jnp.bfloat16)
  cos, sin = cfg.rope_tables(c + t)
  w_uk, uks = quant.quantize_blocks_fp8(jax.random.normal(ks[6], (h, nope, D_V), jnp.float32) * nope ** -0.5)
  w_uv, uvs = quant.quantize_blocks_fp8(jax.random.normal(ks[7], (h, D_V, v), jnp.float32) * D_V ** -0.5)
  norm_w = (1.0 + 0.1 * jax.random.normal(ks[8], (D_V,), jnp.float32)).astype(jnp.bfloat16)
  cu = jnp.arange(n + 1, dtype=jnp.int32) * t
  context_lens = jnp.full((n,), c, jnp.int32)
  return (pages, jnp.asarray(s["kv_scale"], jnp.float32), q_nope, q_rope, kv, positions, slots, cos, sin, cu,
          block_table, context_lens, _fp8_weights(w_uk, uks, w_uv, uvs, norm_w))


def _pstep_call(graph_fn, s, **kw):
  cfg = _step_cfg(s)

  def f(pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cu, block_table, context_lens, w):
    extra = {}
    if s["ctx"]:          # prefill over the cached context: the branch's block table path
      extra = dict(block_table=block_table, context_lens=context_lens, max_keys=s["seqs"] * (s["ctx"] + s["T"]))
    return graph_fn(w, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cu, cfg=cfg, **extra, **kw)
  return f


def _pstep_op(impl, s, interpret):
  if impl not in IMPLS:
    raise ValueError(f"mla_prefill_step has no impl {impl!r}")
  from mla_pallas import graph
  return _pstep_call(graph.mla_prefill_branch_fp8, s, impl=impl, interpret=interpret)


def _pstep_reference(s):
  from mla_pallas import graph
  return _pstep_call(graph.reference_prefill_branch, s)


def _pstep_flops(s):
  cfg = _step_cfg(s)
  n, t, c, h = s["seqs"], s["T"], s["ctx"], cfg.num_heads
  pairs = n * (t * c + t * (t + 1) / 2)
  up = 2.0 * n * (c + t) * h * D_V * (cfg.qk_nope_head_dim + cfg.v_head_dim)     # k_nope and v of every key
  return 2.0 * pairs * h * (cfg.qk_head_dim + cfg.v_head_dim) + up


def _pstep_tolerance(s):
  """tests/test_graph.py's prefill budget: the graph's bf16 roundings of q and k (logits: 2 x logit_std, with
  logit_std = 2 softmax_scale sqrt(qk_head_dim), YaRN's factor included) and 3 of the output path (v, P under
  cuDNN, out), RMS 2^-8 / sqrt(3) each, times the safety factor 3."""
  cfg = _step_cfg(s)
  logit_std = 2.0 * cfg.softmax_scale * cfg.qk_head_dim ** 0.5
  return 3 * math.sqrt((2 * logit_std) ** 2 + 3) * 2.0 ** -8 / math.sqrt(3)


def _pstep_bytes(s):
  cfg = _step_cfg(s)
  n, t, c, h = s["seqs"], s["T"], s["ctx"], cfg.num_heads
  return float(n * (c + t) * D_QK + n * t * (h * (cfg.qk_nope_head_dim + 64) * 2 + D_QK * 2)
               + n * t * h * cfg.v_head_dim * 2 + _step_weight_bytes(s))


register(BenchSpec(
    name="mla_prefill_step",
    keys=_PSTEP_KEYS,
    cpu_defaults=dict(model="deepseek_v32", seqs=2, T=64, ctx=32, H=8, tp=1, page=64, kv_scale=1.0),
    gpu_defaults=dict(model="deepseek_v32", seqs=2, T=4096, ctx=0, H=0, tp=1, page=0, kv_scale=1.0),
    preset=lambda name: {"model": name, "H": 0, "page": 0},
    validate=_pstep_validate,
    make_inputs=lambda s, key: _pstep_inputs_jit(tuple(sorted(s.items())), key),
    op_kwargs=lambda s: {},
    flops=_pstep_flops,
    gathered_bytes=_pstep_bytes,
    set_bytes=lambda s: float(s["seqs"] * _pstep_pages(s) * s["page"] * D_QK) + _pstep_bytes(s),
    touched_bytes=_pstep_bytes,
    tolerance=_pstep_tolerance,
    outputs=("out",),
    make_op=_pstep_op,
    make_reference=_pstep_reference,
    extra_impls=("auto",),
    state=(0, 1),
    bytes_kind="moved",
    conventions={
        "flops": "attention 2 * causal pairs * H * (Dqk + Dv) (pairs: T * ctx + T (T + 1) / 2 per sequence) + the "
                 "up-projections of every key 2 * seqs * (ctx + T) * H * 512 * (nope + v)",
        "gathered_bytes": "cache rows read (576 B per key) + q, kv in + out",
        "scope": "mla_pallas.graph.mla_prefill_branch_fp8: fused rope+rmsnorm+fp8 cache write, the key gather "
                 "(with block_table / context_lens when ctx > 0), k_nope and v up-projections (FP8 BMMs), "
                 "mla_prefill (cuDNN on a GPU). The reference is graph.reference_prefill_branch, whose attention "
                 "is O(T * Tk * H) float32 memory: at 2 x 4096 tokens and H 128 use --no-check",
    },
    info=_step_info,
    module="mla_pallas.graph",
))
