"""MLA attention graphs: the decode, prefill and sparse-prefill branches of one MLA layer, built from the public ops.

Each graph takes the per-token projections of a layer (``q_nope``, ``q_rope`` and the pre-norm latent row ``kv``),
writes the new tokens into the paged FP8 cache and returns the per-head attention output ``[..., H, v_head_dim]``
(before the output projection ``W_o``) and the new cache pages. The projections themselves (``W_q_a``, ``W_q_b``,
``W_kv_a``, ``W_o``) live in :mod:`mla_pallas.layer`.

Weights (frozen pytrees, :class:`MLAWeightsFP8` / :class:`MLAWeightsBF16`): ``W_kv_b [512, H*(nope+v)]`` split
per head into ``w_uk [H, nope, 512]`` (``w_uk[h] = W_kv_b[:, h, :nope].T``) and ``w_uv [H, 512, v]``
(``w_uv[h] = W_kv_b[:, h, nope:]``), plus the latent RMSNorm weight ``kv_norm_w [512]``. FP8 weights carry 128x128
block scales (``w_uk_scale [H, ceil(nope/128), 4]``, ``w_uv_scale [H, 4, ceil(v/128)]``), as produced by
:func:`mla_pallas.convert_bf16_to_fp8_e4m3fn`. The head count is taken from the weights' shapes (not from
``cfg.num_heads``), so the same graph runs one tensor-parallel shard's heads.

Branches (``t`` = tokens, ``T = B * s_q`` for decode):

* **decode** (absorbed, :func:`mla_decode_branch_fp8` / ``_bf16``):
  1. ``fused_rope_rmsnorm_quantization``: RMSNorm(latent) ‖ RoPE(k_rope), FP8 quantization, cache write at
     ``slots`` (pages donated), and RoPE(q_rope);
  2. ``q_latent = q_nope @ w_uk`` per head (``[T,H,nope] x [H,nope,512]``): FP8: ``quantize_and_bmm_fp8``
     (``w_uk`` read as ``[H, K, N]``); BF16: bf16 einsum;
  3. attention on ``q576 = q_latent ‖ q_rope_rot``: ``sparse_mla_decode`` with per-token top-k ``indices`` when
     given, else ``dense_mla_decode`` (causal: the ``s_q`` new tokens are the last of each sequence) from
     ``block_table`` and ``cache_seqlens`` (lengths *including* the new tokens); ``softmax_scale =
     cfg.softmax_scale = (nope + 64) ** -0.5``;
  4. ``out = o_latent @ w_uv`` per head (``[T,H,512] x [H,512,v]``): FP8: ``quantize_and_bmm_fp8``; BF16: einsum.
* **dense prefill** (not absorbed, :func:`mla_prefill_branch_fp8` / ``_bf16``): step 1 as above; then the new
  tokens' rows are gathered back from the cache (dequantized, float32: ``pages[slot] * kv_scale``) into a
  contiguous ``[T, 576]`` buffer; ``k_nope = latent @ w_uk^T`` (``[T,H,512] x [H,512,nope]``: FP8 through
  ``quantize_and_bmm_fp8`` reading ``w_uk`` as ``[H, N, K]`` with ``weight_layout="hnk"``), ``v = latent @ w_uv``;
  ``K = k_nope ‖ broadcast(k_rope_rot)`` (the rope part of the cached row), ``Q = q_nope ‖ q_rope_rot`` (head dim
  ``nope + 64``: 192 for DeepSeek-V3.2, 256 for GLM-5) and causal varlen ``mla_prefill(Q, K, V, cu_seqlens)``.
  The keys are the new tokens only: each sequence of the packed batch starts at position 0 (no chunked prefill
  over earlier context; use the sparse prefill or decode branches for that).
* **sparse prefill** (absorbed, :func:`mla_prefill_branch_sparse_fp8` / ``_bf16``): the decode branch on ``[T]``
  tokens with ``sparse_mla_prefill`` and per-token ``indices [T, topk]``.
* :func:`mla_prefill_decode_graph_fp8` / ``_bf16``: a static Python choice from ``max_seqlen`` (the largest
  number of new tokens of one sequence in the batch): ``> 1`` -> prefill (sparse when ``indices`` are given),
  ``== 1`` -> decode with ``B = T`` and ``s_q = 1`` (as MAX's graph does).

**FP8 vs BF16 variants.** Only the per-head matmuls differ: FP8 weights with ``quantize_and_bmm_fp8`` (per-token
dynamic FP8 quantization of the activation, FP8 x FP8 products, f32 accumulation, bf16 result) versus bf16
weights with ``jnp.einsum`` (bf16 operands, ``preferred_element_type=float32``, rounded to bf16). In the BF16
dense prefill the dequantized latent is rounded to bf16 before the matmuls (the FP8 variant quantizes it per
token inside the BMM). Both variants write the same FP8 cache (the cache format is FP8) through the same fused op
and run attention through the same ops (whose implementations quantize q and P to FP8, see
:mod:`mla_pallas.ops.sparse_decode`); ``mla_prefill`` is float32 math on bf16 inputs in both.

**Which implementation ran.** Every step goes through a public op with ``impl=`` (a string for all steps, or a
dict ``{op_name: impl, "default": impl}``); after the call :func:`graph_report` returns, for the last graph that
ran (or was traced inside an outer jit), each step with the op and the implementation it used
(:func:`mla_pallas.last_impl`): ``"xla"``, ``"mosaic"`` or ``"mosaic-interpret"``. Steps that are plain jax.numpy
(the cache gather, the bf16 einsums, concatenations) report ``"xla"``. :func:`format_report` prints it.

**Oracles.** :func:`reference_decode_branch`, :func:`reference_prefill_branch`,
:func:`reference_prefill_branch_sparse` and :func:`reference_prefill_decode_graph` compose
:mod:`mla_pallas.reference` functions in float32 on the same weights (FP8 weights through
``reference.quantize_and_bmm_fp8``, i.e. the same activation quantization; bf16 weights as float32 einsums at
``precision=HIGHEST``) and return ``(out float32, new_pages)``.

Every graph is a Python function around a ``jax.jit`` with static ``cfg`` / ``impl`` / ``interpret`` /
``interleaved`` and donated ``pages``; it can be called inside an outer ``jax.jit`` (donation is then up to the
outer jit) and under ``jax.shard_map``. No custom_vjp.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from mla_pallas import _dispatch, reference
from mla_pallas.config import MLAConfig
from mla_pallas.ops.bmm_fp8 import quantize_and_bmm_fp8
from mla_pallas.ops.dense_decode import dense_mla_decode
from mla_pallas.ops.prefill import mla_prefill
from mla_pallas.ops.rope_rmsnorm import fused_rope_rmsnorm_quantization
from mla_pallas.ops.sparse_decode import sparse_mla_decode, sparse_mla_prefill

__all__ = [
    "MLAWeightsFP8", "MLAWeightsBF16", "weights_from_kv_b",
    "mla_decode_branch_fp8", "mla_decode_branch_bf16", "mla_prefill_branch_fp8", "mla_prefill_branch_bf16",
    "mla_prefill_branch_sparse_fp8", "mla_prefill_branch_sparse_bf16", "mla_prefill_decode_graph_fp8",
    "mla_prefill_decode_graph_bf16", "choose_branch", "graph_report", "format_report",
    "reference_decode_branch", "reference_prefill_branch", "reference_prefill_branch_sparse",
    "reference_prefill_decode_graph",
]

D_QK = 576
D_V = 512
D_ROPE = 64
_HI = jax.lax.Precision.HIGHEST


# ----------------------------------------------------------------------------------------------------------
# weights
# ----------------------------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLAWeightsFP8:
  """Absorbed-attention weights of one layer in FP8 (128x128 block scales).

  Attributes:
    w_uk: float8_e4m3fn ``[H, nope, 512]`` (``q_latent = q_nope @ w_uk``).
    w_uk_scale: float32 ``[H, ceil(nope/128), 4]``.
    w_uv: float8_e4m3fn ``[H, 512, v]`` (``out = o_latent @ w_uv``).
    w_uv_scale: float32 ``[H, 4, ceil(v/128)]``.
    kv_norm_w: ``[512]`` bfloat16/float32, the latent RMSNorm (kv_a_layernorm) weight.
  """
  w_uk: jax.Array
  w_uk_scale: jax.Array
  w_uv: jax.Array
  w_uv_scale: jax.Array
  kv_norm_w: jax.Array

  @property
  def num_heads(self) -> int:
    return int(self.w_uk.shape[0])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLAWeightsBF16:
  """Absorbed-attention weights of one layer in bfloat16: ``w_uk [H, nope, 512]``, ``w_uv [H, 512, v]``,
  ``kv_norm_w [512]`` (see :class:`MLAWeightsFP8`)."""
  w_uk: jax.Array
  w_uv: jax.Array
  kv_norm_w: jax.Array

  @property
  def num_heads(self) -> int:
    return int(self.w_uk.shape[0])

  def to_fp8(self) -> MLAWeightsFP8:
    """Block-quantize ``w_uk`` and ``w_uv`` (128x128 blocks, :func:`mla_pallas.convert_bf16_to_fp8_e4m3fn`)."""
    from mla_pallas.ops.convert import convert_bf16_to_fp8_e4m3fn
    uk, uks = convert_bf16_to_fp8_e4m3fn(self.w_uk)
    uv, uvs = convert_bf16_to_fp8_e4m3fn(self.w_uv)
    return MLAWeightsFP8(uk, uks, uv, uvs, self.kv_norm_w)


def weights_from_kv_b(w_kv_b, kv_norm_w, cfg: MLAConfig) -> MLAWeightsBF16:
  """Split ``W_kv_b [512, H*(nope+v)]`` (bf16/f32) into :class:`MLAWeightsBF16` (``w_uk [H, nope, 512]``,
  ``w_uv [H, 512, v]``); H = ``W_kv_b.shape[1] // (nope + v)``."""
  nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
  w = jnp.asarray(w_kv_b).reshape(w_kv_b.shape[0], -1, nope + v)      # [512, H, nope+v]
  w_uk = jnp.transpose(w[:, :, :nope], (1, 2, 0))                      # [H, nope, 512]
  w_uv = jnp.transpose(w[:, :, nope:], (1, 0, 2))                      # [H, 512, v]
  return MLAWeightsBF16(w_uk.astype(jnp.bfloat16), w_uv.astype(jnp.bfloat16), kv_norm_w)


def _is_fp8(weights) -> bool:
  if isinstance(weights, MLAWeightsFP8):
    return True
  if isinstance(weights, MLAWeightsBF16):
    return False
  raise ValueError(f"weights must be MLAWeightsFP8 or MLAWeightsBF16; got {type(weights).__name__}")


# ----------------------------------------------------------------------------------------------------------
# implementation report
# ----------------------------------------------------------------------------------------------------------

_REPORTS: dict[Any, dict] = {}
_LAST: dict[str, Any] = {"report": None}


def graph_report() -> dict | None:
  """Report of the last graph call: ``{"graph": name, "branch": "decode"|"prefill"|"sparse_prefill",
  "variant": "fp8"|"bf16", "steps": [{"step", "op", "impl"}, ...]}`` (None before any graph ran)."""
  r = _LAST["report"]
  return None if r is None else {**r, "steps": [dict(s) for s in r["steps"]]}


def format_report(report: dict | None = None) -> str:
  """One line per step: ``step  op  impl`` (of ``report``, default :func:`graph_report`)."""
  r = graph_report() if report is None else report
  if r is None:
    return "(no graph has run)"
  lines = [f"{r['graph']} (branch {r['branch']}, {r['variant']} weights)"]
  w1 = max(len(s["step"]) for s in r["steps"])
  w2 = max(len(s["op"]) for s in r["steps"])
  lines += [f"  {s['step']:<{w1}}  {s['op']:<{w2}}  {s['impl']}" for s in r["steps"]]
  return "\n".join(lines)


class _Steps:
  def __init__(self):
    self.steps = []

  def op(self, step, op):
    self.steps.append(dict(step=step, op=op, impl=_dispatch.last_impl(op) or "?"))

  def xla(self, step, what):
    self.steps.append(dict(step=step, op=what, impl="xla"))


def _impl_for(impl, op):
  if isinstance(impl, str):
    return impl
  d = dict(impl)
  return d.get(op, d.get("default", "auto"))


def _freeze_impl(impl):
  if isinstance(impl, str):
    _dispatch.check_impl(impl)
    return impl
  if isinstance(impl, Mapping):
    for v in impl.values():
      _dispatch.check_impl(v)
    return tuple(sorted(impl.items()))
  raise ValueError(f"impl must be 'auto'|'mosaic'|'xla' or a dict op -> impl; got {impl!r}")


def _sig(tree):
  leaves, treedef = jax.tree_util.tree_flatten(tree)
  return (str(treedef), tuple((tuple(np.shape(x)), str(getattr(x, "dtype", type(x).__name__))) for x in leaves))


# ----------------------------------------------------------------------------------------------------------
# shared steps
# ----------------------------------------------------------------------------------------------------------

def _bf16_bmm(a, w):
  """[T,H,K] x [H,K,N] -> [T,H,N] bf16 (bf16 operands, f32 accumulation)."""
  a, w = a.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  if jax.default_backend() == "cpu":   # XLA:CPU has no bf16 x bf16 -> f32 dot; the f32 upcast is exact
    a, w = a.astype(jnp.float32), w.astype(jnp.float32)
  return jnp.einsum("thk,hkn->thn", a, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)


def _q_absorb(weights, q_nope, fp8, impl, interpret, rec):
  """q_nope [T,H,nope] -> q_latent [T,H,512] bf16."""
  if fp8:
    # w_uk [H, nope, 512] is [H, K, N] for this product
    out = quantize_and_bmm_fp8(q_nope, weights.w_uk, weights.w_uk_scale,
                               impl=_impl_for(impl, "quantize_and_bmm_fp8"), interpret=interpret)
    rec.op("q_nope @ w_uk (absorb)", "quantize_and_bmm_fp8")
    return out
  out = _bf16_bmm(q_nope, weights.w_uk)
  rec.xla("q_nope @ w_uk (absorb)", "jnp.einsum bf16")
  return out


def _v_up(weights, o_latent, fp8, impl, interpret, rec, step="o_latent @ w_uv"):
  """[T,H,512] -> [T,H,v] bf16."""
  if fp8:
    out = quantize_and_bmm_fp8(o_latent, weights.w_uv, weights.w_uv_scale,
                               impl=_impl_for(impl, "quantize_and_bmm_fp8"), interpret=interpret)
    rec.op(step, "quantize_and_bmm_fp8")
    return out
  out = _bf16_bmm(o_latent, weights.w_uv)
  rec.xla(step, "jnp.einsum bf16")
  return out


def _k_up(weights, latent, fp8, impl, interpret, rec):
  """latent [T,H,512] -> k_nope [T,H,nope] bf16 (w_uk read as [H, N=nope, K=512])."""
  if fp8:
    scale_t = jnp.swapaxes(weights.w_uk_scale, 1, 2)   # [H, 4, ceil(nope/128)] = [H, KB, NB]
    out = quantize_and_bmm_fp8(latent, weights.w_uk, scale_t, weight_layout="hnk",
                               impl=_impl_for(impl, "quantize_and_bmm_fp8"), interpret=interpret)
    rec.op("latent @ w_uk^T (k_nope)", "quantize_and_bmm_fp8")
    return out
  out = _bf16_bmm(latent, jnp.swapaxes(weights.w_uk, 1, 2))
  rec.xla("latent @ w_uk^T (k_nope)", "jnp.einsum bf16")
  return out


def _cache_write(weights, pages, kv_scale, kv, q_rope, positions, slots, cos, sin, cfg, impl, interpret,
                 interleaved, unique_slots, rec):
  new_pages, q_rot = fused_rope_rmsnorm_quantization(
      pages, kv, q_rope, positions, cos, sin, weights.kv_norm_w, eps=cfg.rms_norm_eps, kv_scale=kv_scale,
      slots=slots, interleaved=interleaved, unique_slots=unique_slots,
      impl=_impl_for(impl, "fused_rope_rmsnorm_quantization"),
      interpret=interpret)
  rec.op("rmsnorm+rope+fp8 cache write", "fused_rope_rmsnorm_quantization")
  return new_pages, q_rot


def _check_cfg(cfg):
  if not isinstance(cfg, MLAConfig):
    raise ValueError(f"cfg must be an MLAConfig; got {type(cfg).__name__}")


# ----------------------------------------------------------------------------------------------------------
# graph bodies (traced under jax.jit)
# ----------------------------------------------------------------------------------------------------------

def _decode_body(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, indices, topk_length,
                 block_table, cache_seqlens, *, cfg, impl, interpret, interleaved, key, graph,
                 unique_slots=False):
  rec = _Steps()
  fp8 = _is_fp8(weights)
  b, s_q, h, nope = q_nope.shape
  t = b * s_q
  new_pages, q_rot = _cache_write(weights, pages, kv_scale, kv.reshape(t, D_QK), q_rope.reshape(t, h, D_ROPE),
                                  positions.reshape(t), slots.reshape(t), cos, sin, cfg, impl, interpret,
                                  interleaved, unique_slots, rec)
  q_lat = _q_absorb(weights, q_nope.reshape(t, h, nope), fp8, impl, interpret, rec)
  q576 = jnp.concatenate([q_lat, q_rot.astype(jnp.bfloat16)], axis=-1).reshape(b, s_q, h, D_QK)
  if indices is not None:
    o, _ = sparse_mla_decode(q576, new_pages, indices, softmax_scale=cfg.softmax_scale, kv_scale=kv_scale,
                             topk_length=topk_length, impl=_impl_for(impl, "sparse_mla_decode"),
                             interpret=interpret)
    rec.op("attention (sparse top-k)", "sparse_mla_decode")
  else:
    o, _ = dense_mla_decode(q576, new_pages, block_table, cache_seqlens, softmax_scale=cfg.softmax_scale,
                            kv_scale=kv_scale, causal=True, impl=_impl_for(impl, "dense_mla_decode"),
                            interpret=interpret)
    rec.op("attention (dense, paged)", "dense_mla_decode")
  out = _v_up(weights, o.reshape(t, h, D_V), fp8, impl, interpret, rec)
  _REPORTS[key] = dict(graph=graph, branch="decode", variant="fp8" if fp8 else "bf16", steps=rec.steps)
  return out.reshape(b, s_q, h, -1), new_pages


def _sparse_prefill_body(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, indices,
                         topk_length, *, cfg, impl, interpret, interleaved, key, graph,
                 unique_slots=False):
  rec = _Steps()
  fp8 = _is_fp8(weights)
  new_pages, q_rot = _cache_write(weights, pages, kv_scale, kv, q_rope, positions, slots, cos, sin, cfg, impl,
                                  interpret, interleaved, unique_slots, rec)
  q_lat = _q_absorb(weights, q_nope, fp8, impl, interpret, rec)
  q576 = jnp.concatenate([q_lat, q_rot.astype(jnp.bfloat16)], axis=-1)
  o, _ = sparse_mla_prefill(q576, new_pages, indices, softmax_scale=cfg.softmax_scale, kv_scale=kv_scale,
                            topk_length=topk_length, impl=_impl_for(impl, "sparse_mla_prefill"),
                            interpret=interpret)
  rec.op("attention (sparse top-k prefill)", "sparse_mla_prefill")
  out = _v_up(weights, o, fp8, impl, interpret, rec)
  _REPORTS[key] = dict(graph=graph, branch="sparse_prefill", variant="fp8" if fp8 else "bf16", steps=rec.steps)
  return out, new_pages


def _gather_latent(pages, slots, kv_scale):
  """Dequantized float32 cache rows [T, 576] at ``slots`` (invalid slots give zero rows)."""
  flat = pages.reshape(-1, D_QK)
  n = flat.shape[0]
  ok = (slots >= 0) & (slots < n)
  rows = jnp.take(flat, jnp.clip(slots, 0, n - 1), axis=0).astype(jnp.float32) * kv_scale
  return jnp.where(ok[:, None], rows, 0.0)


def _prefill_body(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cu_seqlens, *, cfg,
                  impl, interpret, interleaved, key, graph, unique_slots=False):
  rec = _Steps()
  fp8 = _is_fp8(weights)
  t, h, nope = q_nope.shape
  new_pages, q_rot = _cache_write(weights, pages, kv_scale, kv, q_rope, positions, slots, cos, sin, cfg, impl,
                                  interpret, interleaved, unique_slots, rec)
  rows = _gather_latent(new_pages, slots, kv_scale)                                 # [T, 576] f32
  rec.xla("gather new rows from the cache (dequantized)", "jnp.take")
  latent = rows[:, :D_V] if fp8 else rows[:, :D_V].astype(jnp.bfloat16)
  latent_h = jnp.broadcast_to(latent[:, None, :], (t, h, D_V))
  k_nope = _k_up(weights, latent_h, fp8, impl, interpret, rec)                     # [T, H, nope]
  v = _v_up(weights, latent_h, fp8, impl, interpret, rec, step="latent @ w_uv (v)")  # [T, H, v]
  k_rope = jnp.broadcast_to(rows[:, None, D_V:].astype(jnp.bfloat16), (t, h, D_ROPE))
  q = jnp.concatenate([q_nope.astype(jnp.bfloat16), q_rot.astype(jnp.bfloat16)], axis=-1)
  k = jnp.concatenate([k_nope, k_rope], axis=-1)
  out, _ = mla_prefill(q, k, v, cu_seqlens, softmax_scale=cfg.softmax_scale, causal=True,
                       impl=_impl_for(impl, "mla_prefill"), interpret=interpret)
  rec.op("attention (causal varlen)", "mla_prefill")
  _REPORTS[key] = dict(graph=graph, branch="prefill", variant="fp8" if fp8 else "bf16", steps=rec.steps)
  return out, new_pages


_STATIC = ("cfg", "impl", "interpret", "interleaved", "key", "graph", "unique_slots")
_decode_jit = jax.jit(_decode_body, static_argnames=_STATIC, donate_argnames=("pages",))
_sparse_prefill_jit = jax.jit(_sparse_prefill_body, static_argnames=_STATIC, donate_argnames=("pages",))
_prefill_jit = jax.jit(_prefill_body, static_argnames=_STATIC, donate_argnames=("pages",))


def _run(jitted, graph, dyn, cfg, impl, interpret, interleaved, unique_slots=False):
  _check_cfg(cfg)
  impl = _freeze_impl(impl)
  key = (graph, _sig(dyn), cfg, impl, interpret, interleaved, unique_slots)
  out = jitted(*dyn, cfg=cfg, impl=impl, interpret=interpret, interleaved=bool(interleaved), key=key,
               graph=graph, unique_slots=unique_slots)
  _LAST["report"] = _REPORTS.get(key)
  return out


def _check_variant(weights, fp8, name):
  if _is_fp8(weights) != fp8:
    want = "MLAWeightsFP8" if fp8 else "MLAWeightsBF16"
    raise ValueError(f"{name} needs {want} weights; got {type(weights).__name__}")


# ----------------------------------------------------------------------------------------------------------
# public graphs
# ----------------------------------------------------------------------------------------------------------

def _decode(fp8, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, *, cfg, indices=None,
            topk_length=None, block_table=None, cache_seqlens=None, impl="auto", interpret=False,
            interleaved=True, unique_slots=False):
  name = f"mla_decode_branch_{'fp8' if fp8 else 'bf16'}"
  _check_variant(weights, fp8, name)
  if indices is None and (block_table is None or cache_seqlens is None):
    raise ValueError(f"{name} needs indices (sparse) or block_table and cache_seqlens (dense)")
  if indices is not None:
    block_table = cache_seqlens = None
  dyn = (weights, pages, jnp.asarray(kv_scale, jnp.float32), q_nope, q_rope, kv, positions, slots, cos, sin,
         indices, topk_length, block_table, cache_seqlens)
  return _run(_decode_jit, name, dyn, cfg, impl, interpret, interleaved, unique_slots)


_DECODE_DOC = """MLA decode branch ({variant} weights, absorbed form); see the module doc for the steps.

  Args:
    weights: :class:`{wcls}`.
    pages: float8_e4m3fn cache ``[num_pages, page_size, 576]``. DONATED (do not use it afterwards).
    kv_scale: per-tensor cache scale (python float or f32 scalar).
    q_nope: ``[B, s_q, H, nope]`` bf16; q_rope: ``[B, s_q, H, 64]`` bf16 (before RoPE).
    kv: ``[B, s_q, 576]`` bf16, the new tokens' rows before RMSNorm/RoPE (``x @ W_kv_a``).
    positions: ``[B, s_q]`` int32 token positions; slots: ``[B, s_q]`` int32 flat cache slots of the new tokens
      (-1: not written).
    cos, sin: float32 ``[max_pos, 32]`` (:func:`mla_pallas.reference.rope_tables`).
    cfg: :class:`~mla_pallas.config.MLAConfig` (static; eps, softmax_scale, dims).
    indices: ``[B, s_q, topk]`` int32 flat slot ids (sparse attention), with optional ``topk_length [B]``; or
    block_table: ``[B, P]`` int32 and cache_seqlens: ``[B]`` int32 lengths including the new tokens (dense).
    impl: "auto" | "mosaic" | "xla", or a dict ``{{op: impl, "default": impl}}``; interpret: Pallas interpret mode.
    interleaved: RoPE pairing (True: DeepSeek's interleaved pairs).
    unique_slots: python bool; True promises that no two new tokens share a valid slot (as ``unique_indices`` of a
      JAX scatter), which skips the cache write's duplicate-slot scan (fused_rope_rmsnorm_quantization).

  Returns:
    ``(out [B, s_q, H, v] bfloat16, new_pages)``. :func:`graph_report` says which implementation each step ran.
  """


def mla_decode_branch_fp8(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, **kw):
  return _decode(True, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, **kw)


def mla_decode_branch_bf16(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, **kw):
  return _decode(False, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, **kw)


mla_decode_branch_fp8.__doc__ = _DECODE_DOC.format(variant="FP8", wcls="MLAWeightsFP8")
mla_decode_branch_bf16.__doc__ = _DECODE_DOC.format(variant="BF16", wcls="MLAWeightsBF16")


def _prefill(fp8, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cu_seqlens, *, cfg,
             impl="auto", interpret=False, interleaved=True, unique_slots=False):
  name = f"mla_prefill_branch_{'fp8' if fp8 else 'bf16'}"
  _check_variant(weights, fp8, name)
  dyn = (weights, pages, jnp.asarray(kv_scale, jnp.float32), q_nope, q_rope, kv, positions, slots, cos, sin,
         cu_seqlens)
  return _run(_prefill_jit, name, dyn, cfg, impl, interpret, interleaved, unique_slots)


_PREFILL_DOC = """MLA dense prefill branch ({variant} weights, not absorbed); see the module doc.

  Args:
    weights: :class:`{wcls}`; pages (DONATED), kv_scale, cos, sin, cfg, impl, interpret, interleaved,
      unique_slots: as in the decode branch.
    q_nope: ``[T, H, nope]``, q_rope: ``[T, H, 64]``, kv: ``[T, 576]`` (bf16), positions: ``[T]`` int32 (each
      sequence from 0), slots: ``[T]`` int32 (packed batch).
    cu_seqlens: ``[B + 1]`` int32: sequence b owns tokens ``[cu_seqlens[b], cu_seqlens[b+1])``.

  Returns:
    ``(out [T, H, v] bfloat16, new_pages)``.
  """


def mla_prefill_branch_fp8(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cu_seqlens,
                           **kw):
  return _prefill(True, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cu_seqlens,
                  **kw)


def mla_prefill_branch_bf16(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cu_seqlens,
                            **kw):
  return _prefill(False, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cu_seqlens,
                  **kw)


mla_prefill_branch_fp8.__doc__ = _PREFILL_DOC.format(variant="FP8", wcls="MLAWeightsFP8")
mla_prefill_branch_bf16.__doc__ = _PREFILL_DOC.format(variant="BF16", wcls="MLAWeightsBF16")


def _sparse_prefill(fp8, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, indices, *,
                    cfg, topk_length=None, impl="auto", interpret=False, interleaved=True, unique_slots=False):
  name = f"mla_prefill_branch_sparse_{'fp8' if fp8 else 'bf16'}"
  _check_variant(weights, fp8, name)
  dyn = (weights, pages, jnp.asarray(kv_scale, jnp.float32), q_nope, q_rope, kv, positions, slots, cos, sin,
         indices, topk_length)
  return _run(_sparse_prefill_jit, name, dyn, cfg, impl, interpret, interleaved, unique_slots)


_SPARSE_PREFILL_DOC = """MLA sparse prefill branch ({variant} weights, absorbed); see the module doc.

  Args: as :func:`mla_prefill_branch_{v}` without cu_seqlens, plus indices: ``[T, topk]`` int32 flat slot ids
    per token (e.g. the indexer's top-k, which may include the token's own slot: the cache write comes first),
    optional topk_length ``[T]`` int32.

  Returns:
    ``(out [T, H, v] bfloat16, new_pages)``.
  """


def mla_prefill_branch_sparse_fp8(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                                  indices, **kw):
  return _sparse_prefill(True, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, indices,
                         **kw)


def mla_prefill_branch_sparse_bf16(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                                   indices, **kw):
  return _sparse_prefill(False, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                         indices, **kw)


mla_prefill_branch_sparse_fp8.__doc__ = _SPARSE_PREFILL_DOC.format(variant="FP8", wcls="MLAWeightsFP8", v="fp8")
mla_prefill_branch_sparse_bf16.__doc__ = _SPARSE_PREFILL_DOC.format(variant="BF16", wcls="MLAWeightsBF16",
                                                                    v="bf16")


def choose_branch(max_seqlen: int, *, sparse: bool = False) -> str:
  """The static branch of :func:`mla_prefill_decode_graph_fp8`: "prefill" / "sparse_prefill" when
  ``max_seqlen > 1`` (some sequence brings more than one new token), else "decode"."""
  if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, np.integer)) or max_seqlen < 1:
    raise ValueError(f"max_seqlen must be a positive python int (static); got {max_seqlen!r}")
  if max_seqlen > 1:
    return "sparse_prefill" if sparse else "prefill"
  return "decode"


def _prefill_decode(fp8, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, *, cfg,
                    max_seqlen, cu_seqlens=None, block_table=None, cache_seqlens=None, indices=None,
                    topk_length=None, impl="auto", interpret=False, interleaved=True, unique_slots=False):
  branch = choose_branch(max_seqlen, sparse=indices is not None)
  common = dict(cfg=cfg, impl=impl, interpret=interpret, interleaved=interleaved, unique_slots=unique_slots)
  if branch == "prefill":
    if cu_seqlens is None:
      raise ValueError("the prefill branch (max_seqlen > 1) needs cu_seqlens")
    out, pages = _prefill(fp8, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                          cu_seqlens, **common)
  elif branch == "sparse_prefill":
    out, pages = _sparse_prefill(fp8, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                                 indices, topk_length=topk_length, **common)
  else:  # one new token per sequence: B = T, s_q = 1
    t = q_nope.shape[0]
    out, pages = _decode(fp8, weights, pages, kv_scale, q_nope[:, None], q_rope[:, None], kv[:, None],
                         positions[:, None], slots[:, None], cos, sin,
                         indices=None if indices is None else indices[:, None], topk_length=topk_length,
                         block_table=block_table, cache_seqlens=cache_seqlens, **common)
    out = out.reshape(t, *out.shape[2:])
  rep = _LAST["report"]
  if rep is not None:
    _LAST["report"] = {**rep, "graph": f"mla_prefill_decode_graph_{'fp8' if fp8 else 'bf16'}"}
  return out, pages


_PD_DOC = """Prefill-or-decode MLA graph ({variant} weights): a static choice from ``max_seqlen``.

  Args:
    weights, pages (DONATED), kv_scale, cos, sin, cfg, impl, interpret, interleaved, unique_slots: as in the
      branches.
    q_nope ``[T, H, nope]``, q_rope ``[T, H, 64]``, kv ``[T, 576]``, positions ``[T]``, slots ``[T]``: packed
      tokens (decode: one per sequence, ``T = B``).
    max_seqlen: python int (static), the most new tokens of one sequence: ``> 1`` -> prefill (dense with
      ``cu_seqlens``, or sparse with ``indices [T, topk]``), ``1`` -> decode (``indices [T, topk]``, or
      ``block_table [T, P]`` and ``cache_seqlens [T]``).

  Returns:
    ``(out [T, H, v] bfloat16, new_pages)``; :func:`graph_report` names the branch and the implementations.
  """


def mla_prefill_decode_graph_fp8(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, **kw):
  return _prefill_decode(True, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, **kw)


def mla_prefill_decode_graph_bf16(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, **kw):
  return _prefill_decode(False, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, **kw)


mla_prefill_decode_graph_fp8.__doc__ = _PD_DOC.format(variant="FP8")
mla_prefill_decode_graph_bf16.__doc__ = _PD_DOC.format(variant="BF16")


# ----------------------------------------------------------------------------------------------------------
# reference graph (float32 oracles)
# ----------------------------------------------------------------------------------------------------------

def _ref_bmm(weights, a, which):
  """Reference per-head product in float32: which = "uk" ([T,H,nope] @ w_uk), "uk_t" ([T,H,512] @ w_uk^T),
  "uv" ([T,H,512] @ w_uv)."""
  a = a.astype(jnp.float32)
  if isinstance(weights, MLAWeightsFP8):
    w, s = {"uk": (weights.w_uk, weights.w_uk_scale), "uv": (weights.w_uv, weights.w_uv_scale),
            "uk_t": (jnp.swapaxes(weights.w_uk, 1, 2), jnp.swapaxes(weights.w_uk_scale, 1, 2))}[which]
    return reference.quantize_and_bmm_fp8(a, w, s).astype(jnp.float32)
  w = {"uk": weights.w_uk, "uv": weights.w_uv, "uk_t": jnp.swapaxes(weights.w_uk, 1, 2)}[which]
  return jnp.einsum("thk,hkn->thn", a, w.astype(jnp.float32), precision=_HI)


def _ref_write(weights, pages, kv_scale, kv, q_rope, positions, slots, cos, sin, cfg, interleaved):
  return reference.rope_rmsnorm_quantize_write(pages, kv, q_rope, positions, cos, sin, weights.kv_norm_w,
                                               eps=cfg.rms_norm_eps, kv_scale=kv_scale, slots=slots,
                                               interleaved=interleaved)


def _ref_decode_body(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, indices,
                     topk_length, block_table, cache_seqlens, *, cfg, interleaved):
  b, s_q, h, nope = q_nope.shape
  t = b * s_q
  q_rope = q_rope.astype(jnp.float32)
  new_pages, q_rot = _ref_write(weights, pages, kv_scale, kv.reshape(t, D_QK).astype(jnp.float32),
                                q_rope.reshape(t, h, D_ROPE), positions.reshape(t), slots.reshape(t), cos, sin,
                                cfg, interleaved)
  q_lat = _ref_bmm(weights, q_nope.reshape(t, h, nope), "uk")
  q576 = jnp.concatenate([q_lat, q_rot], axis=-1).reshape(b, s_q, h, D_QK)
  if indices is not None:
    o, _ = reference.sparse_mla_decode(q576, new_pages, indices, softmax_scale=cfg.softmax_scale,
                                       kv_scale=kv_scale, topk_length=topk_length)
  else:
    o, _ = reference.dense_mla_decode(q576, new_pages, block_table, cache_seqlens, softmax_scale=cfg.softmax_scale,
                                      kv_scale=kv_scale, causal=True)
  out = _ref_bmm(weights, o.reshape(t, h, D_V), "uv")
  return out.reshape(b, s_q, h, -1), new_pages


_ref_decode_jit = jax.jit(_ref_decode_body, static_argnames=("cfg", "interleaved"))


def reference_decode_branch(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, *, cfg,
                            indices=None, topk_length=None, block_table=None, cache_seqlens=None,
                            interleaved=True):
  """Float32 oracle of :func:`mla_decode_branch_fp8` / ``_bf16`` (same arguments, nothing donated; jitted).
  Returns ``(out float32 [B, s_q, H, v], new_pages)``."""
  _is_fp8(weights)
  if indices is not None:
    block_table = cache_seqlens = None
  return _ref_decode_jit(weights, pages, jnp.asarray(kv_scale, jnp.float32), q_nope, q_rope, kv, positions, slots,
                         cos, sin, indices, topk_length, block_table, cache_seqlens, cfg=cfg,
                         interleaved=bool(interleaved))


def reference_prefill_branch_sparse(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                                    indices, *, cfg, topk_length=None, interleaved=True):
  """Float32 oracle of :func:`mla_prefill_branch_sparse_fp8` / ``_bf16``: ``(out f32 [T, H, v], new_pages)``."""
  out, new_pages = reference_decode_branch(
      weights, pages, kv_scale, q_nope[:, None], q_rope[:, None], kv[:, None], positions[:, None],
      slots[:, None], cos, sin, cfg=cfg, indices=indices[:, None], topk_length=topk_length,
      interleaved=interleaved)
  return out[:, 0], new_pages


def _ref_prefill_body(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cu_seqlens, *,
                      cfg, interleaved):
  fp8 = _is_fp8(weights)
  t, h, _ = q_nope.shape
  new_pages, q_rot = _ref_write(weights, pages, kv_scale, kv.astype(jnp.float32), q_rope.astype(jnp.float32),
                                positions, slots, cos, sin, cfg, interleaved)
  rows = _gather_latent(new_pages, slots, kv_scale)
  latent = rows[:, :D_V] if fp8 else rows[:, :D_V].astype(jnp.bfloat16).astype(jnp.float32)
  latent_h = jnp.broadcast_to(latent[:, None, :], (t, h, D_V))
  k_nope = _ref_bmm(weights, latent_h, "uk_t")
  v = _ref_bmm(weights, latent_h, "uv")
  q = jnp.concatenate([q_nope.astype(jnp.float32), q_rot], axis=-1)
  k = jnp.concatenate([k_nope, jnp.broadcast_to(rows[:, None, D_V:], (t, h, D_ROPE))], axis=-1)
  out, _ = reference.mla_prefill(q, k, v, cu_seqlens, softmax_scale=cfg.softmax_scale, causal=True)
  return out.astype(jnp.float32), new_pages


_ref_prefill_jit = jax.jit(_ref_prefill_body, static_argnames=("cfg", "interleaved"))


def reference_prefill_branch(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                             cu_seqlens, *, cfg, interleaved=True):
  """Float32 oracle of :func:`mla_prefill_branch_fp8` / ``_bf16`` (jitted): ``(out f32 [T, H, v], new_pages)``."""
  _is_fp8(weights)
  return _ref_prefill_jit(weights, pages, jnp.asarray(kv_scale, jnp.float32), q_nope, q_rope, kv, positions,
                          slots, cos, sin, cu_seqlens, cfg=cfg, interleaved=bool(interleaved))


def reference_prefill_decode_graph(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, *,
                                   cfg, max_seqlen, cu_seqlens=None, block_table=None, cache_seqlens=None,
                                   indices=None, topk_length=None, interleaved=True):
  """Float32 oracle of :func:`mla_prefill_decode_graph_fp8` / ``_bf16``: ``(out f32 [T, H, v], new_pages)``."""
  branch = choose_branch(max_seqlen, sparse=indices is not None)
  if branch == "prefill":
    return reference_prefill_branch(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                                    cu_seqlens, cfg=cfg, interleaved=interleaved)
  if branch == "sparse_prefill":
    return reference_prefill_branch_sparse(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos,
                                           sin, indices, cfg=cfg, topk_length=topk_length,
                                           interleaved=interleaved)
  out, new_pages = reference_decode_branch(
      weights, pages, kv_scale, q_nope[:, None], q_rope[:, None], kv[:, None], positions[:, None],
      slots[:, None], cos, sin, cfg=cfg, indices=None if indices is None else indices[:, None],
      topk_length=topk_length, block_table=block_table, cache_seqlens=cache_seqlens, interleaved=interleaved)
  return out[:, 0], new_pages
