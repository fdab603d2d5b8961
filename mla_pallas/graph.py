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
  The keys are the new tokens, or, with ``block_table`` and ``context_lens`` (prefill over cached context:
  chunked prefill, a cached prefix, a later turn), every token of each sequence, old and new, read through its
  block table into a packed ``[max_keys, 576]`` buffer and attended bottom-right causally
  (``mla_prefill(..., cu_seqlens_k=...)``: new token i of a sequence with c cached tokens sees positions
  ``<= c + i``).
* **sparse prefill** (absorbed, :func:`mla_prefill_branch_sparse_fp8` / ``_bf16``): the decode branch on ``[T]``
  tokens with ``sparse_mla_prefill`` and per-token ``indices [T, topk]``.
* :func:`mla_prefill_decode_graph_fp8` / ``_bf16``: a static Python choice from ``max_seqlen`` (the largest
  number of new tokens of one sequence in the batch): ``> 1`` -> prefill (sparse when ``indices`` are given),
  ``== 1`` -> decode with ``B = T`` and ``s_q = 1`` (as MAX's graph does).

**FP8 vs BF16 variants.** Only the per-head matmuls differ: FP8 weights with ``quantize_and_bmm_fp8`` (per-token
dynamic FP8 quantization of the activation, FP8 x FP8 products, f32 accumulation, bf16 result) versus bf16
weights with ``jnp.einsum`` (bf16 operands, ``preferred_element_type=float32``, rounded to bf16). In the BF16
dense prefill the dequantized latent is rounded to bf16 before the matmuls (the FP8 variant quantizes it per
token inside the BMM).

**Cache dtype.** The FP8 branches take a float8_e4m3fn cache (``pages``). The BF16 branches take a bfloat16
cache (BF16 end to end: the fused op only rounds the new rows to bf16, and the attention ops keep q and P in
bf16 with f32 accumulation, :mod:`mla_pallas.ops.sparse_decode`) or, as before, a float8_e4m3fn one (the
attention ops then quantize q and P to FP8). ``mla_prefill`` runs cuDNN flash attention on a CUDA GPU (bf16
operands, P rounded to bf16) and float32 math elsewhere (:mod:`mla_pallas.ops.prefill`).

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

**Calling convention.** Every graph and oracle takes the tensors positionally (``weights, pages, kv_scale,
q_nope, q_rope, kv, positions, slots, cos, sin``, then ``cu_seqlens`` or ``indices`` for the prefill branches)
and the rest by keyword only: ``cfg`` (required), the attention choice (``indices=`` / ``topk_length=`` for
top-k attention, ``block_table=`` / ``cache_seqlens=`` for dense decode), ``impl="auto"``, ``interpret=False``,
``interleaved=True``, ``unique_slots=False``. The arguments are checked before tracing: a missing or
contradictory argument, a wrong weights class or a shape / dtype that does not fit raises ``ValueError`` that
starts with the public function's name and names the argument (``TypeError`` for a missing ``cfg``).

Every graph is a Python function around a ``jax.jit`` with static ``cfg`` / ``impl`` / ``interpret`` /
``interleaved`` and donated ``pages``; it can be called inside an outer ``jax.jit`` (donation is then up to the
outer jit) and under ``jax.shard_map``. No custom_vjp.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from mla_pallas import _checks, _dispatch, reference
from mla_pallas.config import MLAConfig
from mla_pallas.ops.bmm_fp8 import merge_quantize_and_bmm_fp8, quantize_and_bmm_fp8
from mla_pallas.ops.dense_decode import dense_mla_decode
from mla_pallas.ops.prefill import mla_prefill
from mla_pallas.ops.prologue import cache_write_and_absorb
from mla_pallas.ops.rope_rmsnorm import fused_rope_rmsnorm_quantization
from mla_pallas.ops.sparse_decode import sparse_mla_decode, sparse_mla_prefill, split_partials

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
    w_uk_t, w_uv_t: None, or ``w_uk`` / ``w_uv`` transposed per head (``[H, 512, nope]``, ``[H, v, 512]``): the
      FP8 kernel's K-major layout (``quantize_and_bmm_fp8(..., weight_layout="hnk")``). Without them the
      decode path's two per-head products transpose their weight on every call (8 MiB each for
      DeepSeek-V3.2's H 128: ~5.4 µs each on the H200, a fifth of a one-token decode step); with them the
      weights take twice their bytes. :meth:`with_kernel_layouts` adds them; ``MLAWeightsBF16.to_fp8`` does.
  """
  w_uk: jax.Array
  w_uk_scale: jax.Array
  w_uv: jax.Array
  w_uv_scale: jax.Array
  kv_norm_w: jax.Array
  w_uk_t: jax.Array | None = None
  w_uv_t: jax.Array | None = None

  def with_kernel_layouts(self) -> "MLAWeightsFP8":
    """These weights with ``w_uk_t`` and ``w_uv_t`` (transposed once, here)."""
    from mla_pallas.ops.bmm_fp8 import prepare_weight
    return dataclasses.replace(self, w_uk_t=prepare_weight(self.w_uk), w_uv_t=prepare_weight(self.w_uv))

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
    """Block-quantize ``w_uk`` and ``w_uv`` (128x128 blocks, :func:`mla_pallas.convert_bf16_to_fp8_e4m3fn`), with
    their kernel layouts (:meth:`MLAWeightsFP8.with_kernel_layouts`)."""
    from mla_pallas.ops.convert import convert_bf16_to_fp8_e4m3fn
    uk, uks = convert_bf16_to_fp8_e4m3fn(self.w_uk)
    uv, uvs = convert_bf16_to_fp8_e4m3fn(self.w_uv)
    return MLAWeightsFP8(uk, uks, uv, uvs, self.kv_norm_w).with_kernel_layouts()


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
  "variant": "fp8"|"bf16" (the weights), "cache_dtype": "float8_e4m3fn"|"bfloat16", "steps": [{"step", "op",
  "impl"}, ...]}`` (None before any graph ran)."""
  r = _LAST["report"]
  return None if r is None else {**r, "steps": [dict(s) for s in r["steps"]]}


def format_report(report: dict | None = None) -> str:
  """One line per step: ``step  op  impl`` (of ``report``, default :func:`graph_report`)."""
  r = graph_report() if report is None else report
  if r is None:
    return "(no graph has run)"
  lines = [f"{r['graph']} (branch {r['branch']}, {r['variant']} weights, {r['cache_dtype']} cache)"]
  w1 = max(len(s["step"]) for s in r["steps"])
  w2 = max(len(s["op"]) for s in r["steps"])
  lines += [f"  {s['step']:<{w1}}  {s['op']:<{w2}}  {s['impl']}" for s in r["steps"]]
  return "\n".join(lines)


class _Steps:
  def __init__(self):
    self.steps = []

  def op(self, step, op):
    impl = _dispatch.last_impl(op) or "?"
    if (kernel := _dispatch.last_kernel(op)) is not None:
      impl = f"{impl} ({kernel})"
    self.steps.append(dict(step=step, op=op, impl=impl))

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

def _bf16_bmm(a, w, per_row: bool = False):
  """[T,H,K] x [H,K,N] -> [T,H,N] bf16 (bf16 operands, f32 accumulation). ``per_row``: one token at a time
  (``lax.map``), so that a row's bits do not depend on T (XLA rewrites a dot of one row into a reduction, whose
  summation order differs from the GEMM's)."""
  a, w = a.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  if jax.default_backend() == "cpu":   # XLA:CPU has no bf16 x bf16 -> f32 dot; the f32 upcast is exact
    a, w = a.astype(jnp.float32), w.astype(jnp.float32)
  mm = lambda x: jnp.einsum("thk,hkn->thn", x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
  if per_row:
    return jax.lax.map(lambda row: mm(row[None])[0], a)
  return mm(a)


def _fp8_bmm(a, w, w_t, scale, impl, interpret):
  """[T,H,K] x [H,K,N] with ``w`` (or its kernel layout ``w_t`` [H,N,K] when given: no per-call transpose)."""
  kw = dict(impl=_impl_for(impl, "quantize_and_bmm_fp8"), interpret=interpret)
  if w_t is None:
    return quantize_and_bmm_fp8(a, w, scale, **kw)
  return quantize_and_bmm_fp8(a, w_t, scale, weight_layout="hnk", **kw)


def _q_absorb(weights, q_nope, fp8, impl, interpret, rec, per_row=False):
  """q_nope [T,H,nope] -> q_latent [T,H,512] bf16 (``per_row``: the bf16 product row by row, _bf16_bmm)."""
  if fp8:
    # w_uk [H, nope, 512] is [H, K, N] for this product; w_uk_t [H, N, K] spares the per-call transpose
    out = _fp8_bmm(q_nope, weights.w_uk, weights.w_uk_t, weights.w_uk_scale, impl, interpret)
    rec.op("q_nope @ w_uk (absorb)", "quantize_and_bmm_fp8")
    return out
  out = _bf16_bmm(q_nope, weights.w_uk, per_row)
  rec.xla("q_nope @ w_uk (absorb)", "jnp.einsum bf16")
  return out


def _v_up(weights, o_latent, fp8, impl, interpret, rec, step="o_latent @ w_uv", per_row=False):
  """[T,H,512] -> [T,H,v] bf16 (``per_row``: as in :func:`_q_absorb`)."""
  if fp8:
    out = _fp8_bmm(o_latent, weights.w_uv, weights.w_uv_t, weights.w_uv_scale, impl, interpret)
    rec.op(step, "quantize_and_bmm_fp8")
    return out
  out = _bf16_bmm(o_latent, weights.w_uv, per_row)
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


def _cache_kind(pages):
  return "fp8" if pages.dtype == _FP8 else "bf16"


def _cache_write(weights, pages, kv_scale, kv, q_rope, positions, slots, cos, sin, cfg, impl, interpret,
                 interleaved, unique_slots, rec):
  new_pages, q_rot = fused_rope_rmsnorm_quantization(
      pages, kv, q_rope, positions, cos, sin, weights.kv_norm_w, eps=cfg.rms_norm_eps, kv_scale=kv_scale,
      slots=slots, interleaved=interleaved, unique_slots=unique_slots,
      impl=_impl_for(impl, "fused_rope_rmsnorm_quantization"),
      interpret=interpret)
  rec.op(f"rmsnorm+rope+{_cache_kind(pages)} cache write", "fused_rope_rmsnorm_quantization")
  return new_pages, q_rot


# ----------------------------------------------------------------------------------------------------------
# argument checks (outside jit: every error names the public function and its argument)
# ----------------------------------------------------------------------------------------------------------

_ACT = (jnp.bfloat16, jnp.float32)
_I32 = (jnp.int32,)
_FP8 = jnp.float8_e4m3fn
_CACHE = {True: (_FP8,), False: (_FP8, jnp.bfloat16), None: (_FP8, jnp.bfloat16)}   # pages dtypes by variant
_BOTH = "pass either indices= (sparse) or block_table= and cache_seqlens= (dense)"


@contextlib.contextmanager
def _named(fn: str):
  """ValueErrors raised inside (by the checks below or :mod:`mla_pallas._checks`) start with ``fn: ``."""
  try:
    yield
  except ValueError as e:
    raise ValueError(f"{fn}: {e}") from None


def _check_cfg(cfg):
  if not isinstance(cfg, MLAConfig):
    raise ValueError(f"cfg must be an MLAConfig (e.g. mla_pallas.deepseek_v32()); got {type(cfg).__name__}")


_check_bool = _checks.check_bool


def _check_weights(weights, cfg, fp8):
  """Weights of the variant ``fp8`` (None: either) whose dims match ``cfg``; returns H (from the weights)."""
  if _is_fp8(weights) != fp8 and fp8 is not None:
    want = "MLAWeightsFP8" if fp8 else "MLAWeightsBF16"
    raise ValueError(f"weights must be {want}; got {type(weights).__name__}")
  nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
  _checks.check_array("weights.w_uk", weights.w_uk, ndim=3, shape=(None, nope, D_V),
                      expect=f"[H, nope={nope} (cfg.qk_nope_head_dim), 512]")
  h = int(weights.w_uk.shape[0])
  _checks.check_array("weights.w_uv", weights.w_uv, ndim=3, shape=(h, D_V, v),
                      expect=f"[H={h}, 512, v={v} (cfg.v_head_dim)]")
  for name, shape, what in (("w_uk_t", (h, D_V, nope), "w_uk transposed per head"),
                            ("w_uv_t", (h, v, D_V), "w_uv transposed per head")):
    w_t = getattr(weights, name, None)
    if w_t is not None:
      _checks.check_array(f"weights.{name}", w_t, shape=shape, dtypes=(_FP8,),
                          expect=f"{list(shape)} float8_e4m3fn ({what}; MLAWeightsFP8.with_kernel_layouts)")
  return h


def _check_tokens(weights, cfg, fp8, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, *,
                  decode: bool):
  """The tensors every branch takes; returns the token axes: ``(B, s_q)`` (decode) or ``(T,)``."""
  _check_cfg(cfg)
  h = _check_weights(weights, cfg, fp8)
  nope = cfg.qk_nope_head_dim
  if decode:
    _checks.check_array("q_nope", q_nope, ndim=4, shape=(None, None, h, nope), dtypes=_ACT,
                        expect=f"[B, s_q, H={h}, nope={nope}]")
    lead = tuple(q_nope.shape[:2])
    axes = f"B={lead[0]}, s_q={lead[1]}"
  else:
    _checks.check_array("q_nope", q_nope, ndim=3, shape=(None, h, nope), dtypes=_ACT,
                        expect=f"[T, H={h}, nope={nope}]")
    lead = tuple(q_nope.shape[:1])
    axes = f"T={lead[0]}"
  _checks.check_array("q_rope", q_rope, shape=lead + (h, D_ROPE), dtypes=_ACT, expect=f"[{axes}, H={h}, 64]")
  _checks.check_array("kv", kv, shape=lead + (D_QK,), dtypes=_ACT, expect=f"[{axes}, 576]")
  _checks.check_array("positions", positions, shape=lead, dtypes=_I32, expect=f"[{axes}]")
  _checks.check_array("slots", slots, shape=lead, dtypes=_I32, expect=f"[{axes}]")
  _checks.check_array("pages", pages, ndim=3, shape=(None, None, D_QK), dtypes=_CACHE[fp8],
                      expect="[num_pages, page_size, 576]")
  _checks.check_scalar("kv_scale", kv_scale, positive=True)
  _checks.check_array("cos", cos, ndim=2, shape=(None, D_ROPE // 2), dtypes=(jnp.float32,),
                      expect="[max_pos, 32]")
  _checks.check_array("sin", sin, shape=tuple(cos.shape), dtypes=(jnp.float32,), expect=f"{list(cos.shape)} (as cos)")
  return lead


def _check_sparse(indices, topk_length, lead, axes):
  _checks.check_array("indices", indices, shape=tuple(lead) + (None,), dtypes=_I32, expect=f"[{axes}, topk]")
  if indices.shape[-1] < 1:
    raise ValueError(f"indices must have topk >= 1 entries in its last axis; got shape {tuple(indices.shape)}")
  if topk_length is not None:
    _checks.check_array("topk_length", topk_length, shape=lead[:1], dtypes=_I32, expect=f"[{axes.split(',')[0]}]")


def _check_decode_attention(lead, indices, topk_length, block_table, cache_seqlens):
  """indices (sparse) XOR block_table + cache_seqlens (dense), for decode token axes ``lead = (B, s_q)``."""
  dense = [n for n, x in (("block_table=", block_table), ("cache_seqlens=", cache_seqlens)) if x is not None]
  if indices is not None and dense:
    raise ValueError(f"{_BOTH}, not both; got indices= and {' and '.join(dense)}")
  axes = f"B={lead[0]}, s_q={lead[1]}"
  if indices is not None:
    _check_sparse(indices, topk_length, lead, axes)
    return
  if not dense:
    raise ValueError(f"{_BOTH}; got neither")
  if len(dense) == 1:
    raise ValueError(f"{_BOTH}; got {dense[0]} without "
                     f"{'cache_seqlens=' if block_table is not None else 'block_table='}")
  if topk_length is not None:
    raise ValueError("topk_length= applies to sparse attention only (it counts the first topk_length[b] "
                     "entries of indices=); dense attention reads cache_seqlens=")
  _checks.check_array("block_table", block_table, ndim=2, shape=(lead[0], None), dtypes=_I32,
                      expect=f"[B={lead[0]}, max_pages_per_seq]")
  _checks.check_array("cache_seqlens", cache_seqlens, shape=(lead[0],), dtypes=_I32, expect=f"[B={lead[0]}]")


def _check_cu_seqlens(cu_seqlens):
  _checks.check_array("cu_seqlens", cu_seqlens, ndim=1, dtypes=_I32, expect="[B + 1]")
  if cu_seqlens.shape[0] < 2:
    raise ValueError(f"cu_seqlens must have shape [B + 1] with B >= 1; got shape {tuple(cu_seqlens.shape)}")


def _check_context(block_table, context_lens, max_keys, cu_seqlens, pages):
  """Prefill over cached context: checks ``block_table`` / ``context_lens`` / ``max_keys`` and returns the key
  buffer's static size (None: no context, the keys are the new tokens)."""
  if (block_table is None) != (context_lens is None):
    given = "block_table=" if block_table is not None else "context_lens="
    raise ValueError(f"prefill over cached context needs both block_table= and context_lens=; got only {given}")
  if block_table is None:
    if max_keys is not None:
      raise ValueError("max_keys= applies to prefill over cached context (with block_table= and context_lens=)")
    return None
  b = cu_seqlens.shape[0] - 1
  _checks.check_array("block_table", block_table, ndim=2, shape=(b, None), dtypes=_I32,
                      expect=f"[B={b}, max_pages_per_seq] (B from cu_seqlens)")
  _checks.check_array("context_lens", context_lens, shape=(b,), dtypes=_I32, expect=f"[B={b}]")
  ctx = _checks.concrete(context_lens)
  if ctx is not None and ctx.size and ctx.min() < 0:
    raise ValueError(f"context_lens must be >= 0 (tokens already cached per sequence); got {ctx.tolist()}")
  if max_keys is None:
    return max(1, b * block_table.shape[1] * pages.shape[1])
  return _checks.check_positive_int("max_keys", max_keys)


# ----------------------------------------------------------------------------------------------------------
# graph bodies (traced under jax.jit)
# ----------------------------------------------------------------------------------------------------------

def _decode_body(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, indices, topk_length,
                 block_table, cache_seqlens, *, cfg, impl, interpret, interleaved, key, graph,
                 unique_slots=False, batch_invariant=False):
  rec = _Steps()
  fp8 = _is_fp8(weights)
  b, s_q, h, nope = q_nope.shape
  t = b * s_q
  kv_t, q_rope_t, positions_t, slots_t = (kv.reshape(t, D_QK), q_rope.reshape(t, h, D_ROPE), positions.reshape(t),
                                          slots.reshape(t))
  both = None
  if fp8 and weights.w_uk_t is not None:
    # W_UK's product and the cache write in one launch where both run their kernels (ops.prologue)
    both = cache_write_and_absorb(
        pages, kv_t, q_rope_t, positions_t, cos, sin, weights.kv_norm_w, q_nope.reshape(t, h, nope), weights.w_uk_t,
        weights.w_uk_scale, eps=cfg.rms_norm_eps, kv_scale=kv_scale, slots=slots_t, interleaved=interleaved,
        unique_slots=unique_slots, write_impl=_impl_for(impl, "fused_rope_rmsnorm_quantization"),
        absorb_impl=_impl_for(impl, "quantize_and_bmm_fp8"), interpret=interpret)
  if both is not None:
    new_pages, q_rot, q_lat = both
    rec.op(f"rmsnorm+rope+{_cache_kind(pages)} cache write (in W_UK's launch)", "fused_rope_rmsnorm_quantization")
    rec.op("q_nope @ w_uk (absorb)", "quantize_and_bmm_fp8")
  else:
    new_pages, q_rot = _cache_write(weights, pages, kv_scale, kv_t, q_rope_t, positions_t, slots_t, cos, sin, cfg,
                                    impl, interpret, interleaved, unique_slots, rec)
    q_lat = _q_absorb(weights, q_nope.reshape(t, h, nope), fp8, impl, interpret, rec, per_row=batch_invariant)
  # q as the (latent, rope) pair: kernels that quantize q themselves read both where they are (no concatenation)
  q576 = (q_lat.reshape(b, s_q, h, -1), q_rot.astype(jnp.bfloat16).reshape(b, s_q, h, D_ROPE))
  parts = None
  if indices is not None and fp8 and weights.w_uv_t is not None and not batch_invariant:
    # Where the attention kernel leaves split partials (small batches at 64 / 128 heads), W_UV's kernel merges
    # them in its producer: no merge launches, the merged rows never in GMEM (ops.bmm_fp8.merge_quantize_and_bmm_fp8)
    parts = split_partials(q576, new_pages, indices, softmax_scale=cfg.softmax_scale, kv_scale=kv_scale,
                           topk_length=topk_length, impl=_impl_for(impl, "sparse_mla_decode"), interpret=interpret)
  if parts is not None:
    rec.op("attention (sparse top-k, split partials)", "sparse_mla_decode")
    out = merge_quantize_and_bmm_fp8(*parts, weights.w_uv_t, weights.w_uv_scale, heads=h,
                                     impl=_impl_for(impl, "quantize_and_bmm_fp8"), interpret=interpret)
    rec.op("merge splits + o_latent @ w_uv", "quantize_and_bmm_fp8")
  else:
    if indices is not None:
      o, _ = sparse_mla_decode(q576, new_pages, indices, softmax_scale=cfg.softmax_scale, kv_scale=kv_scale,
                               topk_length=topk_length, impl=_impl_for(impl, "sparse_mla_decode"),
                               interpret=interpret, batch_invariant=batch_invariant)
      rec.op("attention (sparse top-k)", "sparse_mla_decode")
    else:
      o, _ = dense_mla_decode(q576, new_pages, block_table, cache_seqlens, softmax_scale=cfg.softmax_scale,
                              kv_scale=kv_scale, causal=True, impl=_impl_for(impl, "dense_mla_decode"),
                              interpret=interpret, batch_invariant=batch_invariant)
      rec.op("attention (dense, paged)", "dense_mla_decode")
    out = _v_up(weights, o.reshape(t, h, D_V), fp8, impl, interpret, rec, per_row=batch_invariant)
  _REPORTS[key] = dict(graph=graph, branch="decode", variant="fp8" if fp8 else "bf16",
                      cache_dtype=jnp.dtype(pages.dtype).name, steps=rec.steps)
  return out.reshape(b, s_q, h, -1), new_pages


def _sparse_prefill_body(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, indices,
                         topk_length, *, cfg, impl, interpret, interleaved, key, graph,
                 unique_slots=False):
  rec = _Steps()
  fp8 = _is_fp8(weights)
  new_pages, q_rot = _cache_write(weights, pages, kv_scale, kv, q_rope, positions, slots, cos, sin, cfg, impl,
                                  interpret, interleaved, unique_slots, rec)
  q_lat = _q_absorb(weights, q_nope, fp8, impl, interpret, rec)
  q576 = (q_lat, q_rot.astype(jnp.bfloat16))     # the (latent, rope) pair, as in _decode_body
  o, _ = sparse_mla_prefill(q576, new_pages, indices, softmax_scale=cfg.softmax_scale, kv_scale=kv_scale,
                            topk_length=topk_length, impl=_impl_for(impl, "sparse_mla_prefill"),
                            interpret=interpret)
  rec.op("attention (sparse top-k prefill)", "sparse_mla_prefill")
  out = _v_up(weights, o, fp8, impl, interpret, rec)
  _REPORTS[key] = dict(graph=graph, branch="sparse_prefill", variant="fp8" if fp8 else "bf16",
                      cache_dtype=jnp.dtype(pages.dtype).name, steps=rec.steps)
  return out, new_pages


def _gather_latent(pages, slots, kv_scale):
  """Dequantized float32 cache rows [T, 576] at ``slots`` (invalid slots give zero rows)."""
  flat = pages.reshape(-1, D_QK)
  n = flat.shape[0]
  ok = (slots >= 0) & (slots < n)
  rows = jnp.take(flat, jnp.clip(slots, 0, n - 1), axis=0).astype(jnp.float32) * kv_scale
  return jnp.where(ok[:, None], rows, 0.0)


def _context_rows(pages, kv_scale, block_table, cu_seqlens, context_lens, max_keys: int):
  """The keys of prefill over cached context, read from the pages after the write.

  Sequence b (its new tokens ``[cu_seqlens[b], cu_seqlens[b+1])``, n_b of them) has ``L_b = context_lens[b] + n_b``
  keys: its positions ``0 .. L_b - 1``, read through ``block_table[b]``, packed in sequence order into a buffer of
  ``max_keys`` rows. Returns ``rows [max_keys, 576]`` float32 (dequantized; 0 where no row is read),
  ``missing [max_keys]`` (a key position whose page is past the block table or out of range: never read),
  ``cu_seqlens_k [B + 1]`` and ``ok [B]`` (False: ``context_lens[b] < 0``, or the sequence's keys do not fit in
  ``max_keys``; its outputs are then NaN)."""
  num_pages, page, _ = pages.shape
  b, per_seq = block_table.shape
  n_new = jnp.maximum(cu_seqlens[1:] - cu_seqlens[:-1], 0)
  ok = context_lens >= 0
  ends = jnp.cumsum(jnp.where(ok, context_lens + n_new, 0))
  ok = ok & (ends <= max_keys)
  cu_k = jnp.clip(jnp.concatenate([jnp.zeros((1,), ends.dtype), ends]), 0, max_keys).astype(jnp.int32)
  j = jnp.arange(max_keys, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(cu_k, j, side="right").astype(jnp.int32) - 1, 0, b - 1)
  inside = j < cu_k[-1]
  pos = j - cu_k[seq]
  page_idx = pos // page
  page_id = block_table[seq, jnp.clip(page_idx, 0, per_seq - 1)]
  found = inside & (page_idx < per_seq) & (page_id >= 0) & (page_id < num_pages)
  slot = jnp.where(found, page_id * page + pos % page, 0)
  rows = jnp.take(pages.reshape(-1, D_QK), slot, axis=0).astype(jnp.float32) * kv_scale
  return jnp.where(found[:, None], rows, 0.0), inside & ~found, cu_k, ok


def _poison_sequences(out, cu_seqlens, ok):
  """NaN for the outputs of the sequences with ``ok[b]`` False (a contract the call broke: never garbage)."""
  t = out.shape[0]
  tok = jnp.arange(t, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(cu_seqlens, tok, side="right").astype(jnp.int32) - 1, 0, ok.shape[0] - 1)
  bad = (tok >= cu_seqlens[0]) & (tok < cu_seqlens[-1]) & ~ok[seq]
  return jnp.where(bad[:, None, None], jnp.asarray(jnp.nan, out.dtype), out)


def _prefill_body(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cu_seqlens,
                  block_table, context_lens, *, cfg, impl, interpret, interleaved, key, graph, unique_slots=False,
                  max_keys=None):
  rec = _Steps()
  fp8 = _is_fp8(weights)
  t, h, nope = q_nope.shape
  new_pages, q_rot = _cache_write(weights, pages, kv_scale, kv, q_rope, positions, slots, cos, sin, cfg, impl,
                                  interpret, interleaved, unique_slots, rec)
  if max_keys is None:                                                             # keys: the new tokens
    rows = _gather_latent(new_pages, slots, kv_scale)                               # [T, 576] f32
    rec.xla("gather new rows from the cache (dequantized)", "jnp.take")
    cu_k = missing = ok = None
  else:                                                                            # keys: context + new tokens
    rows, missing, cu_k, ok = _context_rows(new_pages, kv_scale, block_table, cu_seqlens, context_lens, max_keys)
    rec.xla("gather context + new rows from the cache (dequantized)", "jnp.take")
  tk = rows.shape[0]
  latent = rows[:, :D_V] if fp8 else rows[:, :D_V].astype(jnp.bfloat16)
  latent_h = jnp.broadcast_to(latent[:, None, :], (tk, h, D_V))
  k_nope = _k_up(weights, latent_h, fp8, impl, interpret, rec)                     # [Tk, H, nope]
  v = _v_up(weights, latent_h, fp8, impl, interpret, rec, step="latent @ w_uv (v)")  # [Tk, H, v]
  if missing is not None:                                                          # unread keys: NaN, never 0
    v = jnp.where(missing[:, None, None], jnp.asarray(jnp.nan, v.dtype), v)
  k_rope = jnp.broadcast_to(rows[:, None, D_V:].astype(jnp.bfloat16), (tk, h, D_ROPE))
  q = jnp.concatenate([q_nope.astype(jnp.bfloat16), q_rot.astype(jnp.bfloat16)], axis=-1)
  k = jnp.concatenate([k_nope, k_rope], axis=-1)
  out, _ = mla_prefill(q, k, v, cu_seqlens, softmax_scale=cfg.softmax_scale, causal=True, cu_seqlens_k=cu_k,
                       impl=_impl_for(impl, "mla_prefill"), interpret=interpret)
  rec.op("attention (causal varlen" + (", cached context)" if cu_k is not None else ")"), "mla_prefill")
  if ok is not None:
    out = _poison_sequences(out, cu_seqlens, ok)
  _REPORTS[key] = dict(graph=graph, branch="prefill", variant="fp8" if fp8 else "bf16",
                      cache_dtype=jnp.dtype(pages.dtype).name, steps=rec.steps)
  return out, new_pages


_STATIC = ("cfg", "impl", "interpret", "interleaved", "key", "graph", "unique_slots")
_decode_jit = jax.jit(_decode_body, static_argnames=_STATIC + ("batch_invariant",), donate_argnames=("pages",))
_sparse_prefill_jit = jax.jit(_sparse_prefill_body, static_argnames=_STATIC, donate_argnames=("pages",))
_prefill_jit = jax.jit(_prefill_body, static_argnames=_STATIC + ("max_keys",), donate_argnames=("pages",))


def _run(jitted, graph, dyn, cfg, impl, interpret, interleaved, unique_slots, **static):
  impl = _freeze_impl(impl)
  key = (graph, _sig(dyn), cfg, impl, interpret, interleaved, unique_slots, tuple(sorted(static.items())))
  out = jitted(*dyn, cfg=cfg, impl=impl, interpret=interpret, interleaved=interleaved, key=key,
               graph=graph, unique_slots=unique_slots, **static)
  _LAST["report"] = _REPORTS.get(key)
  return out


def _check_options(interleaved, unique_slots):
  return _check_bool("interleaved", interleaved), _check_bool("unique_slots", unique_slots)


# ----------------------------------------------------------------------------------------------------------
# public graphs
# ----------------------------------------------------------------------------------------------------------

def _decode(fp8, fn, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, *, cfg, indices,
            topk_length, block_table, cache_seqlens, impl, interpret, interleaved, unique_slots,
            batch_invariant=False):
  with _named(fn):
    lead = _check_tokens(weights, cfg, fp8, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                         decode=True)
    _check_decode_attention(lead, indices, topk_length, block_table, cache_seqlens)
    interleaved, unique_slots = _check_options(interleaved, unique_slots)
    batch_invariant = _check_bool("batch_invariant", batch_invariant)
  dyn = (weights, pages, jnp.asarray(kv_scale, jnp.float32), q_nope, q_rope, kv, positions, slots, cos, sin,
         indices, topk_length, block_table, cache_seqlens)
  return _run(_decode_jit, f"mla_decode_branch_{'fp8' if fp8 else 'bf16'}", dyn, cfg, impl, interpret,
              interleaved, unique_slots, batch_invariant=batch_invariant)


_DECODE_DOC = """MLA decode branch ({variant} weights, absorbed form): ``s_q`` new tokens per sequence.

  Attention is sparse with ``indices=`` (``sparse_mla_decode``) or dense with ``block_table=`` and
  ``cache_seqlens=`` (``dense_mla_decode``, causal); exactly one of the two must be given.

  Args:
    weights: :class:`{wcls}` (``H = weights.w_uk.shape[0]``: all heads, or one tensor-parallel shard's).
    pages: cache ``[num_pages, page_size, 576]`` (layout: :mod:`mla_pallas.cache`): float8_e4m3fn, or for the
      BF16 branch also bfloat16 (BF16 attention; module docstring, "Cache dtype"). DONATED: do not use it after
      the call (inside an outer jit the donation is up to that jit).
    kv_scale: per-tensor cache scale, python float > 0 or float32 scalar (``dequantized = stored * kv_scale``).
    q_nope: ``[B, s_q, H, nope]`` bfloat16/float32 (``nope = cfg.qk_nope_head_dim``).
    q_rope: ``[B, s_q, H, 64]`` bfloat16/float32, before RoPE.
    kv: ``[B, s_q, 576]`` bfloat16/float32, the new tokens' rows before RMSNorm / RoPE (``x @ W_kv_a``: 512 latent
      ‖ 64 k_rope).
    positions: ``[B, s_q]`` int32 token positions (0-based within the sequence; RoPE and, for dense attention,
      the causal limit).
    slots: ``[B, s_q]`` int32 flat cache slots of the new tokens (``slot = page * page_size + offset``,
      :func:`mla_pallas.cache.slots_for_positions`); a slot outside ``[0, num_slots)`` (e.g. -1) is not written.
    cos, sin: float32 ``[max_pos, 32]`` RoPE tables (:func:`mla_pallas.reference.rope_tables`), rows indexed by
      position.
    cfg: :class:`~mla_pallas.config.MLAConfig` (static): ``rms_norm_eps``, ``softmax_scale``, head dims.
    indices: sparse attention: ``[B, s_q, topk]`` int32 flat slot ids per new token (the indexer's top-k, which may
      include the token's own slot: the cache write comes first); entries outside ``[0, num_slots)`` are masked,
      duplicates count as often as they appear.
    topk_length: sparse only, optional ``[B]`` int32: only the first ``topk_length[b]`` indices of sequence b count.
    block_table: dense attention: ``[B, max_pages_per_seq]`` int32 page ids of each sequence.
    cache_seqlens: dense attention: ``[B]`` int32 tokens of each sequence *including* the ``s_q`` new ones (which
      are its last tokens: new token j of sequence b sees positions ``< cache_seqlens[b] - s_q + j + 1``).
    impl: "auto" | "mosaic" | "xla", or a dict ``{{op_name: impl, "default": impl}}`` (per step).
    interpret: run the Mosaic GPU kernels in Pallas' GPU interpret mode (tests, CPU).
    interleaved: python bool, the RoPE pairing (True: DeepSeek's interleaved pairs ``(2i, 2i+1)``; False: halves).
    unique_slots: python bool; True promises that no two new tokens share a valid slot (as ``unique_indices`` of a
      JAX scatter), which skips the cache write's duplicate-slot scan (fused_rope_rmsnorm_quantization).
    batch_invariant: python bool; True runs the attention step batch-invariant (``sparse_mla_decode`` /
      ``dense_mla_decode``'s keyword: a sequence's attention bits do not depend on the batch) and the BF16
      branch's einsums one token at a time. The other steps work row by row (the cache write, the per-token FP8
      quantization of the BMMs); that the FP8 BMMs' GEMMs keep a row's bits whatever the batch is checked on the
      CPU (XLA path) and, by tests/test_batch_invariance_gpu.py, on the H200.

  Returns:
    ``(out [B, s_q, H, v] bfloat16, new_pages)`` (``v = cfg.v_head_dim``; out is before ``W_o``).
    :func:`graph_report` says which implementation each step ran.

  Raises:
    TypeError: ``cfg`` missing. ValueError naming this function and the argument: wrong weights variant, a
      shape / dtype that does not match, both or neither of ``indices=`` / ``block_table=`` + ``cache_seqlens=``.
  """


def mla_decode_branch_fp8(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, *,
                          cfg: MLAConfig, indices=None, topk_length=None, block_table=None, cache_seqlens=None,
                          impl="auto", interpret=False, interleaved: bool = True, unique_slots: bool = False,
                          batch_invariant: bool = False):
  return _decode(True, "mla_decode_branch_fp8", weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots,
                 cos, sin, cfg=cfg, indices=indices, topk_length=topk_length, block_table=block_table,
                 cache_seqlens=cache_seqlens, impl=impl, interpret=interpret, interleaved=interleaved,
                 unique_slots=unique_slots, batch_invariant=batch_invariant)


def mla_decode_branch_bf16(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, *,
                           cfg: MLAConfig, indices=None, topk_length=None, block_table=None, cache_seqlens=None,
                           impl="auto", interpret=False, interleaved: bool = True, unique_slots: bool = False,
                           batch_invariant: bool = False):
  return _decode(False, "mla_decode_branch_bf16", weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots,
                 cos, sin, cfg=cfg, indices=indices, topk_length=topk_length, block_table=block_table,
                 cache_seqlens=cache_seqlens, impl=impl, interpret=interpret, interleaved=interleaved,
                 unique_slots=unique_slots, batch_invariant=batch_invariant)


mla_decode_branch_fp8.__doc__ = _DECODE_DOC.format(variant="FP8", wcls="MLAWeightsFP8")
mla_decode_branch_bf16.__doc__ = _DECODE_DOC.format(variant="BF16", wcls="MLAWeightsBF16")


def _prefill(fp8, fn, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cu_seqlens, *,
             cfg, impl, interpret, interleaved, unique_slots, block_table=None, context_lens=None, max_keys=None):
  with _named(fn):
    _check_tokens(weights, cfg, fp8, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                  decode=False)
    _check_cu_seqlens(cu_seqlens)
    max_keys = _check_context(block_table, context_lens, max_keys, cu_seqlens, pages)
    interleaved, unique_slots = _check_options(interleaved, unique_slots)
  dyn = (weights, pages, jnp.asarray(kv_scale, jnp.float32), q_nope, q_rope, kv, positions, slots, cos, sin,
         cu_seqlens, block_table, context_lens)
  return _run(_prefill_jit, f"mla_prefill_branch_{'fp8' if fp8 else 'bf16'}", dyn, cfg, impl, interpret,
              interleaved, unique_slots, max_keys=max_keys)


_PREFILL_DOC = """MLA dense prefill branch ({variant} weights, not absorbed): a packed batch of ``T`` new tokens.

  The new tokens are written into the cache first; then the keys are read back from the cache (dequantized),
  up-projected per head, and each new token attends causally to its sequence's keys. Without ``block_table`` the
  keys are the new tokens themselves (every sequence starts at position 0). With ``block_table`` and
  ``context_lens`` (chunked prefill, a cached prompt prefix, a later turn) sequence b already holds
  ``context_lens[b]`` tokens: its keys are positions ``0 .. context_lens[b] + n_b - 1`` read through
  ``block_table[b]``, and its i-th new token (position ``context_lens[b] + i``) attends positions
  ``<= context_lens[b] + i`` (bottom-right causal, ``mla_prefill(..., cu_seqlens_k=...)``). One call over a whole
  prompt and several calls over its chunks give the same output up to the order of float32 sums.

  Args:
    weights: :class:`{wcls}`; pages (DONATED), kv_scale, cos, sin: as in :func:`mla_decode_branch_{v}`.
    q_nope: ``[T, H, nope]``, q_rope: ``[T, H, 64]``, kv: ``[T, 576]``: bfloat16/float32, the packed tokens.
    positions: ``[T]`` int32 (sequence b's new tokens at ``context_lens[b] + 0, 1, ...``, or ``0, 1, ...``);
      slots: ``[T]`` int32 flat cache slots of those positions (-1: padding, not written;
      :func:`mla_pallas.layer.token_slots`).
    cu_seqlens: ``[B + 1]`` int32, nondecreasing: sequence b owns tokens ``[cu_seqlens[b], cu_seqlens[b+1])``;
      tokens outside ``[cu_seqlens[0], cu_seqlens[B])`` get out = 0.
    block_table: optional ``[B, max_pages_per_seq]`` int32 page ids of each sequence (with ``context_lens``).
      A key position whose page is past the table or out of range is never read: the outputs that attend it
      are NaN.
    context_lens: optional ``[B]`` int32 >= 0, tokens of each sequence already in the cache before this call.
    max_keys: optional python int (static), the size of the key buffer: at least ``sum_b (context_lens[b] +
      n_b)``; default ``B * max_pages_per_seq * page_size`` (always enough). The up-projections and the
      attention's key loads scale with it, so pass a tight bound when the cache is large. A sequence whose keys
      do not fit (or with ``context_lens[b] < 0`` inside a trace) gets NaN outputs.
    cfg, impl, interpret, interleaved, unique_slots: as in :func:`mla_decode_branch_{v}` (keyword-only).

  Returns:
    ``(out [T, H, v] bfloat16, new_pages)``.

  Raises:
    TypeError: ``cfg`` missing; ValueError naming this function and the argument (shapes, dtypes, weights, only
      one of ``block_table`` / ``context_lens``, negative concrete ``context_lens``).
  """


def mla_prefill_branch_fp8(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cu_seqlens,
                           *, cfg: MLAConfig, block_table=None, context_lens=None, max_keys: int | None = None,
                           impl="auto", interpret=False, interleaved: bool = True, unique_slots: bool = False):
  return _prefill(True, "mla_prefill_branch_fp8", weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots,
                  cos, sin, cu_seqlens, cfg=cfg, impl=impl, interpret=interpret, interleaved=interleaved,
                  unique_slots=unique_slots, block_table=block_table, context_lens=context_lens,
                  max_keys=max_keys)


def mla_prefill_branch_bf16(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cu_seqlens,
                            *, cfg: MLAConfig, block_table=None, context_lens=None, max_keys: int | None = None,
                            impl="auto", interpret=False, interleaved: bool = True, unique_slots: bool = False):
  return _prefill(False, "mla_prefill_branch_bf16", weights, pages, kv_scale, q_nope, q_rope, kv, positions,
                  slots, cos, sin, cu_seqlens, cfg=cfg, impl=impl, interpret=interpret, interleaved=interleaved,
                  unique_slots=unique_slots, block_table=block_table, context_lens=context_lens,
                  max_keys=max_keys)


mla_prefill_branch_fp8.__doc__ = _PREFILL_DOC.format(variant="FP8", wcls="MLAWeightsFP8", v="fp8")
mla_prefill_branch_bf16.__doc__ = _PREFILL_DOC.format(variant="BF16", wcls="MLAWeightsBF16", v="bf16")


def _sparse_prefill(fp8, fn, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, indices,
                    *, cfg, topk_length, impl, interpret, interleaved, unique_slots):
  with _named(fn):
    lead = _check_tokens(weights, cfg, fp8, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                         decode=False)
    _check_sparse(indices, topk_length, lead, f"T={lead[0]}")
    interleaved, unique_slots = _check_options(interleaved, unique_slots)
  dyn = (weights, pages, jnp.asarray(kv_scale, jnp.float32), q_nope, q_rope, kv, positions, slots, cos, sin,
         indices, topk_length)
  return _run(_sparse_prefill_jit, f"mla_prefill_branch_sparse_{'fp8' if fp8 else 'bf16'}", dyn, cfg, impl,
              interpret, interleaved, unique_slots)


_SPARSE_PREFILL_DOC = """MLA sparse prefill branch ({variant} weights, absorbed): ``T`` packed tokens, top-k attention.

  Args:
    weights, pages (DONATED), kv_scale, q_nope ``[T, H, nope]``, q_rope ``[T, H, 64]``, kv ``[T, 576]``, positions
      ``[T]``, slots ``[T]``, cos, sin: as in :func:`mla_prefill_branch_{v}` (positions are absolute, so a
      sequence may continue earlier context).
    indices: ``[T, topk]`` int32 flat slot ids per token (e.g. the indexer's top-k, which may include the token's
      own slot: the cache write comes first); entries outside ``[0, num_slots)`` are masked.
    topk_length: optional ``[T]`` int32: only the first ``topk_length[t]`` indices of token t count.
    cfg, impl, interpret, interleaved, unique_slots: as in :func:`mla_decode_branch_{v}` (keyword-only).

  Returns:
    ``(out [T, H, v] bfloat16, new_pages)``.

  Raises:
    TypeError: ``cfg`` missing; ValueError naming this function and the argument (shapes, dtypes, weights).
  """


def mla_prefill_branch_sparse_fp8(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                                  indices, *, cfg: MLAConfig, topk_length=None, impl="auto", interpret=False,
                                  interleaved: bool = True, unique_slots: bool = False):
  return _sparse_prefill(True, "mla_prefill_branch_sparse_fp8", weights, pages, kv_scale, q_nope, q_rope, kv,
                         positions, slots, cos, sin, indices, cfg=cfg, topk_length=topk_length, impl=impl,
                         interpret=interpret, interleaved=interleaved, unique_slots=unique_slots)


def mla_prefill_branch_sparse_bf16(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                                   indices, *, cfg: MLAConfig, topk_length=None, impl="auto", interpret=False,
                                   interleaved: bool = True, unique_slots: bool = False):
  return _sparse_prefill(False, "mla_prefill_branch_sparse_bf16", weights, pages, kv_scale, q_nope, q_rope, kv,
                         positions, slots, cos, sin, indices, cfg=cfg, topk_length=topk_length, impl=impl,
                         interpret=interpret, interleaved=interleaved, unique_slots=unique_slots)


mla_prefill_branch_sparse_fp8.__doc__ = _SPARSE_PREFILL_DOC.format(variant="FP8", v="fp8")
mla_prefill_branch_sparse_bf16.__doc__ = _SPARSE_PREFILL_DOC.format(variant="BF16", v="bf16")


def choose_branch(max_seqlen: int, *, sparse: bool = False) -> str:
  """The static branch of :func:`mla_prefill_decode_graph_fp8`: "prefill" / "sparse_prefill" when
  ``max_seqlen > 1`` (some sequence brings more than one new token), else "decode"."""
  if isinstance(max_seqlen, bool) or not isinstance(max_seqlen, (int, np.integer)) or max_seqlen < 1:
    raise ValueError(f"max_seqlen must be a positive python int (static); got {max_seqlen!r}")
  if max_seqlen > 1:
    return "sparse_prefill" if sparse else "prefill"
  return "decode"


def _pd_plan(fn, max_seqlen, cu_seqlens, block_table, cache_seqlens, indices, topk_length):
  """The branch of a prefill-decode call and the attention arguments it uses (the others are dropped)."""
  with _named(fn):
    branch = choose_branch(max_seqlen, sparse=indices is not None)
    if indices is None and topk_length is not None:
      raise ValueError("topk_length= applies to sparse attention only (with indices=)")
    if branch == "prefill" and cu_seqlens is None:
      raise ValueError("the dense prefill branch (max_seqlen > 1, no indices=) needs cu_seqlens=")
    if branch == "decode" and indices is None and (block_table is None or cache_seqlens is None):
      got = [n for n, x in (("block_table=", block_table), ("cache_seqlens=", cache_seqlens)) if x is not None]
      raise ValueError(f"the decode branch (max_seqlen == 1) needs indices= (sparse) or block_table= and "
                       f"cache_seqlens= (dense); got {got[0] if got else 'neither'}")
  if indices is not None:
    block_table = cache_seqlens = None
  return branch, dict(cu_seqlens=cu_seqlens, block_table=block_table, cache_seqlens=cache_seqlens,
                      indices=indices, topk_length=topk_length)


def _pd_check(fn, fp8, branch, a, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cfg):
  """Checks of a prefill-decode call at its own shapes (``[T, ...]``, also for the decode branch)."""
  with _named(fn):
    lead = _check_tokens(weights, cfg, fp8, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                         decode=False)
    if a["indices"] is not None:
      _check_sparse(a["indices"], a["topk_length"], lead, f"T={lead[0]}")
    elif branch == "prefill":
      _check_cu_seqlens(a["cu_seqlens"])
    else:
      _checks.check_array("block_table", a["block_table"], ndim=2, shape=(lead[0], None), dtypes=_I32,
                          expect=f"[T={lead[0]}, max_pages_per_seq] (decode: one sequence per token)")
      _checks.check_array("cache_seqlens", a["cache_seqlens"], shape=lead, dtypes=_I32, expect=f"[T={lead[0]}]")


def _prefill_context(a, context_lens, max_keys):
  """The dense prefill branch's context arguments in a prefill-decode call: the block table is read only with
  ``context_lens`` (else it is the decode branch's and ignored)."""
  if context_lens is None:
    return dict(max_keys=max_keys)
  return dict(block_table=a["block_table"], context_lens=context_lens, max_keys=max_keys)


def _prefill_decode(fp8, fn, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, *, cfg,
                    max_seqlen, cu_seqlens, block_table, cache_seqlens, indices, topk_length, impl, interpret,
                    interleaved, unique_slots, context_lens=None, max_keys=None):
  branch, a = _pd_plan(fn, max_seqlen, cu_seqlens, block_table, cache_seqlens, indices, topk_length)
  _pd_check(fn, fp8, branch, a, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cfg)
  common = dict(cfg=cfg, impl=impl, interpret=interpret, interleaved=interleaved, unique_slots=unique_slots)
  v = "fp8" if fp8 else "bf16"
  if branch == "prefill":
    ctx = _prefill_context(a, context_lens, max_keys)
    out, pages = _prefill(fp8, fn, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                          a["cu_seqlens"], **ctx, **common)
  elif branch == "sparse_prefill":
    out, pages = _sparse_prefill(fp8, fn, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos,
                                 sin, a["indices"], topk_length=a["topk_length"], **common)
  else:  # one new token per sequence: B = T, s_q = 1
    t = q_nope.shape[0]
    idx = a["indices"]
    out, pages = _decode(fp8, fn, weights, pages, kv_scale, q_nope[:, None], q_rope[:, None], kv[:, None],
                         positions[:, None], slots[:, None], cos, sin,
                         indices=None if idx is None else idx[:, None], topk_length=a["topk_length"],
                         block_table=a["block_table"], cache_seqlens=a["cache_seqlens"], **common)
    out = out.reshape(t, *out.shape[2:])
  rep = _LAST["report"]
  if rep is not None:
    _LAST["report"] = {**rep, "graph": f"mla_prefill_decode_graph_{v}"}
  return out, pages


_PD_DOC = """Prefill-or-decode MLA graph ({variant} weights): a static choice from ``max_seqlen``.

  One call site for both phases: ``indices=`` selects sparse attention in either branch; the arrays the chosen
  branch does not read are ignored (``cu_seqlens`` in decode, ``block_table`` / ``cache_seqlens`` in prefill, both
  with ``indices=``), so an engine may pass everything it has.

  Args:
    weights, pages (DONATED), kv_scale, cos, sin: as in :func:`mla_decode_branch_{v}`.
    q_nope ``[T, H, nope]``, q_rope ``[T, H, 64]``, kv ``[T, 576]`` (bfloat16/float32), positions ``[T]`` int32,
      slots ``[T]`` int32: packed tokens (decode: one per sequence, ``T = B``).
    cfg: :class:`~mla_pallas.config.MLAConfig` (static).
    max_seqlen: python int (static), the most new tokens of one sequence: ``> 1`` -> prefill (dense with
      ``cu_seqlens [B + 1]``, or sparse with ``indices [T, topk]``); ``1`` -> decode (sparse with
      ``indices [T, topk]``, or dense with ``block_table [T, P]`` and ``cache_seqlens [T]``, lengths including the
      new token).
    topk_length: sparse only, optional ``[T]`` int32.
    context_lens, max_keys: dense prefill over cached context (:func:`mla_prefill_branch_{v}`): with
      ``context_lens [B]`` the prefill branch reads ``block_table [B, P]`` (else the block table is the dense
      decode branch's).
    impl, interpret, interleaved, unique_slots: as in the branches.

  Returns:
    ``(out [T, H, v] bfloat16, new_pages)``; :func:`graph_report` names the branch and the implementations.

  Raises:
    TypeError: ``cfg`` or ``max_seqlen`` missing; ValueError naming this function and the argument (e.g. the
      dense prefill branch without ``cu_seqlens=``, the dense decode branch without ``block_table=``).
  """


def mla_prefill_decode_graph_fp8(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, *,
                                 cfg: MLAConfig, max_seqlen: int, cu_seqlens=None, block_table=None,
                                 cache_seqlens=None, indices=None, topk_length=None, context_lens=None,
                                 max_keys: int | None = None, impl="auto", interpret=False,
                                 interleaved: bool = True, unique_slots: bool = False):
  return _prefill_decode(True, "mla_prefill_decode_graph_fp8", weights, pages, kv_scale, q_nope, q_rope, kv,
                         positions, slots, cos, sin, cfg=cfg, max_seqlen=max_seqlen, cu_seqlens=cu_seqlens,
                         block_table=block_table, cache_seqlens=cache_seqlens, indices=indices,
                         topk_length=topk_length, impl=impl, interpret=interpret, interleaved=interleaved,
                         unique_slots=unique_slots, context_lens=context_lens, max_keys=max_keys)


def mla_prefill_decode_graph_bf16(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, *,
                                  cfg: MLAConfig, max_seqlen: int, cu_seqlens=None, block_table=None,
                                  cache_seqlens=None, indices=None, topk_length=None, context_lens=None,
                                  max_keys: int | None = None, impl="auto", interpret=False,
                                  interleaved: bool = True, unique_slots: bool = False):
  return _prefill_decode(False, "mla_prefill_decode_graph_bf16", weights, pages, kv_scale, q_nope, q_rope, kv,
                         positions, slots, cos, sin, cfg=cfg, max_seqlen=max_seqlen, cu_seqlens=cu_seqlens,
                         block_table=block_table, cache_seqlens=cache_seqlens, indices=indices,
                         topk_length=topk_length, impl=impl, interpret=interpret, interleaved=interleaved,
                         unique_slots=unique_slots, context_lens=context_lens, max_keys=max_keys)


mla_prefill_decode_graph_fp8.__doc__ = _PD_DOC.format(variant="FP8", v="fp8")
mla_prefill_decode_graph_bf16.__doc__ = _PD_DOC.format(variant="BF16", v="bf16")


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


def reference_decode_branch(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, *,
                            cfg: MLAConfig, indices=None, topk_length=None, block_table=None, cache_seqlens=None,
                            interleaved: bool = True):
  """Float32 oracle of :func:`mla_decode_branch_fp8` / ``_bf16`` (jitted; nothing donated).

  Same arguments, shapes and checks as the graph (either ``indices=`` or ``block_table=`` + ``cache_seqlens=``),
  without ``impl`` / ``interpret`` / ``unique_slots``, which choose implementations the oracle does not have.
  Returns ``(out float32 [B, s_q, H, v], new_pages)``."""
  with _named("reference_decode_branch"):
    lead = _check_tokens(weights, cfg, None, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                         decode=True)
    _check_decode_attention(lead, indices, topk_length, block_table, cache_seqlens)
    interleaved = _check_bool("interleaved", interleaved)
  return _ref_decode_jit(weights, pages, jnp.asarray(kv_scale, jnp.float32), q_nope, q_rope, kv, positions, slots,
                         cos, sin, indices, topk_length, block_table, cache_seqlens, cfg=cfg,
                         interleaved=interleaved)


def reference_prefill_branch_sparse(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                                    indices, *, cfg: MLAConfig, topk_length=None, interleaved: bool = True):
  """Float32 oracle of :func:`mla_prefill_branch_sparse_fp8` / ``_bf16`` (same arguments and checks, without
  ``impl`` / ``interpret`` / ``unique_slots``): ``(out float32 [T, H, v], new_pages)``."""
  with _named("reference_prefill_branch_sparse"):
    lead = _check_tokens(weights, cfg, None, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                         decode=False)
    _check_sparse(indices, topk_length, lead, f"T={lead[0]}")
    interleaved = _check_bool("interleaved", interleaved)
  out, new_pages = _ref_decode_jit(
      weights, pages, jnp.asarray(kv_scale, jnp.float32), q_nope[:, None], q_rope[:, None], kv[:, None],
      positions[:, None], slots[:, None], cos, sin, indices[:, None], topk_length, None, None, cfg=cfg,
      interleaved=interleaved)
  return out[:, 0], new_pages


def _ref_prefill_body(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cu_seqlens,
                      block_table, context_lens, *, cfg, interleaved, max_keys=None):
  fp8 = _is_fp8(weights)
  h = q_nope.shape[1]
  new_pages, q_rot = _ref_write(weights, pages, kv_scale, kv.astype(jnp.float32), q_rope.astype(jnp.float32),
                                positions, slots, cos, sin, cfg, interleaved)
  if max_keys is None:
    rows, missing, cu_k, ok = _gather_latent(new_pages, slots, kv_scale), None, None, None
  else:
    rows, missing, cu_k, ok = _context_rows(new_pages, kv_scale, block_table, cu_seqlens, context_lens, max_keys)
  tk = rows.shape[0]
  latent = rows[:, :D_V] if fp8 else rows[:, :D_V].astype(jnp.bfloat16).astype(jnp.float32)
  latent_h = jnp.broadcast_to(latent[:, None, :], (tk, h, D_V))
  k_nope = _ref_bmm(weights, latent_h, "uk_t")
  v = _ref_bmm(weights, latent_h, "uv")
  if missing is not None:
    v = jnp.where(missing[:, None, None], jnp.nan, v)
  q = jnp.concatenate([q_nope.astype(jnp.float32), q_rot], axis=-1)
  k = jnp.concatenate([k_nope, jnp.broadcast_to(rows[:, None, D_V:], (tk, h, D_ROPE))], axis=-1)
  out, _ = reference.mla_prefill(q, k, v, cu_seqlens, softmax_scale=cfg.softmax_scale, causal=True,
                                 cu_seqlens_k=cu_k)
  out = out.astype(jnp.float32)
  if ok is not None:
    out = _poison_sequences(out, cu_seqlens, ok)
  return out, new_pages


_ref_prefill_jit = jax.jit(_ref_prefill_body, static_argnames=("cfg", "interleaved", "max_keys"))


def reference_prefill_branch(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                             cu_seqlens, *, cfg: MLAConfig, block_table=None, context_lens=None,
                             max_keys: int | None = None, interleaved: bool = True):
  """Float32 oracle of :func:`mla_prefill_branch_fp8` / ``_bf16`` (jitted; same arguments and checks, without
  ``impl`` / ``interpret`` / ``unique_slots``): ``(out float32 [T, H, v], new_pages)``."""
  with _named("reference_prefill_branch"):
    _check_tokens(weights, cfg, None, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                  decode=False)
    _check_cu_seqlens(cu_seqlens)
    max_keys = _check_context(block_table, context_lens, max_keys, cu_seqlens, pages)
    interleaved = _check_bool("interleaved", interleaved)
  return _ref_prefill_jit(weights, pages, jnp.asarray(kv_scale, jnp.float32), q_nope, q_rope, kv, positions,
                          slots, cos, sin, cu_seqlens, block_table, context_lens, cfg=cfg, interleaved=interleaved,
                          max_keys=max_keys)


def reference_prefill_decode_graph(weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, *,
                                   cfg: MLAConfig, max_seqlen: int, cu_seqlens=None, block_table=None,
                                   cache_seqlens=None, indices=None, topk_length=None, context_lens=None,
                                   max_keys: int | None = None, interleaved: bool = True):
  """Float32 oracle of :func:`mla_prefill_decode_graph_fp8` / ``_bf16`` (same arguments, branch choice and checks,
  without ``impl`` / ``interpret`` / ``unique_slots``): ``(out float32 [T, H, v], new_pages)``."""
  fn = "reference_prefill_decode_graph"
  branch, a = _pd_plan(fn, max_seqlen, cu_seqlens, block_table, cache_seqlens, indices, topk_length)
  _pd_check(fn, None, branch, a, weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, cfg)
  args = (weights, pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin)
  if branch == "prefill":
    return reference_prefill_branch(*args, a["cu_seqlens"], cfg=cfg, interleaved=interleaved,
                                    **_prefill_context(a, context_lens, max_keys))
  if branch == "sparse_prefill":
    return reference_prefill_branch_sparse(*args, a["indices"], cfg=cfg, topk_length=a["topk_length"],
                                           interleaved=interleaved)
  idx = a["indices"]
  out, new_pages = reference_decode_branch(
      weights, pages, kv_scale, q_nope[:, None], q_rope[:, None], kv[:, None], positions[:, None],
      slots[:, None], cos, sin, cfg=cfg, indices=None if idx is None else idx[:, None],
      topk_length=a["topk_length"], block_table=a["block_table"], cache_seqlens=a["cache_seqlens"],
      interleaved=interleaved)
  return out[:, 0], new_pages
