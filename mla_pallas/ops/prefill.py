"""Variable-length MLA prefill attention (FlashAttention varlen semantics): ``mla_prefill``.

Semantics are exactly those of :func:`mla_pallas.reference.mla_prefill`. ``impl="mosaic"`` runs the sm_90a kernel
:mod:`mla_pallas.kernels.prefill_sm90` (FP8 QKᵀ with q and k quantized to e4m3 per row; by default FP8 P·V over
Vᵀ in e4m3 with per-column scales, which this op packs (:func:`_vt_fp8`), else bf16 P·V; bfloat16 q, k, v with
head dims multiples of 64 up to 256; docs/kernels/prefill_sm90.md) on a Hopper GPU or in interpret mode;
it passed its GPU tests on the H200, but the op (kernel plus its quantization and packing passes) is slower than
cuDNN there, so ``impl="auto"`` runs XLA on hardware (``_KERNEL_VALIDATED_ON``; with ``interpret=True`` it runs
the kernel in the interpreter, as for every op). The XLA path has two backends, chosen
per call at trace time by :func:`xla_backend`:

* ``"cudnn"``: cuDNN flash attention (the forward of ``jax.nn.dot_product_attention(implementation="cudnn")``) on a
  CUDA GPU of compute capability >= 9.0 with cuDNN >= 9.6, for bfloat16 q, k, v with Dqk <= 256, Dqk and Dv
  multiples of 8 and Dv <= Dqk (DeepSeek-V3.2 192/128 and GLM-5 256/256 qualify).
* ``"f32"``: everywhere else (CPU, other GPUs, float32 or mixed inputs, other head dims): the float32 flash scan
  described below.

cuDNN backend (see :func:`_cudnn_prefill`):
  * Packing: the packed batch goes to cuDNN as is, in its packed ("ragged") layout: q, k, v viewed as
    ``[1, T, H, D]`` (no copy), the sequences as M = max(B, 2) segments with token offsets ``cu_seqlens`` and
    lengths ``diff(cu_seqlens)`` (a zero-length segment is appended when B = 1: with one segment per batch row
    JAX ignores the offsets). Work is ``sum_b len_b^2`` (causal: half), as in the f32 path; no padding to the
    longest sequence.
  * V is zero-padded from Dv to Dqk when they differ: JAX's packed layout scales the token offsets of k and v by
    the same row stride (H · Dqk), so v and the output must have q's head dim. Cost: one copy of v
    ``[T, H, Dqk]`` and one slice of the output (DeepSeek-V3.2 at T = 8192, H = 128: 0.40 GB and 0.27 GB written)
    and Dqk / Dv times the P·V work.
  * lse comes from cuDNN's softmax statistics (natural log-sum-exp of the scaled logits, float32, the forward
    with ``return_residual``), laid out ``[M, H, T]`` by (segment, head, position in the segment) and gathered
    back to ``[T, H]``. The statistics buffer is M · H · T · 4 bytes; above ``_STATS_BUDGET`` the call takes the
    f32 backend.
  * One sequence (B = 1): the clean branch below calls cuDNN in its non-packed layout on the whole ``[1, T, H, D]``
    (no segments, causal or no mask) with v as is: cuDNN >= 9.10 takes Dv != Dqk there (its MLA support), so
    neither the V padding nor the output slice is paid, and the non-packed kernel is itself faster than the
    packed one (H200 numbers in docs/kernels/prefill_cudnn.md). The other branch keeps the packed layout.
  * Two branches under ``lax.cond``: when every v is finite and every token belongs to a sequence
    (``cu_seqlens[0] == 0`` and ``cu_seqlens[B] == T``) cuDNN's output is returned as is; otherwise v is
    sanitized (non-finite and padding rows set to 0, so that nothing leaks through 0 · NaN), padding tokens get
    out = 0 and lse = -inf, and the outputs that see a non-finite v element of their own sequence are set to NaN
    (prefix counts per sequence, as in the reference). The predicate costs one read of v.
  * softmax_scale is handed to cuDNN as a compile-time constant when it is a python number or a concrete array;
    a traced scale is folded into q instead (q · scale rounded to bfloat16: one more rounding of q, <= 2^-8
    relative).
  * Precision: bfloat16 operands, float32 softmax and accumulation, P rounded to bfloat16 for P·V (cuDNN);
    output rel-L2 ~4e-3 against the float32 reference (error model in ``tests/test_prefill_gpu.py``).

f32 backend: a flash-style computation over ``bq x bk`` tiles of the ``T x T`` score matrix with an online
softmax (float32 math, ``precision=HIGHEST`` matmuls). Query blocks run one after another (``lax.map``); for each, a
``lax.fori_loop`` with *dynamic* bounds visits only the key blocks that overlap the sequences of its tokens (and,
with ``causal``, only those up to its last token), so a packed batch of short sequences costs about
``sum_b len_b^2`` work, not ``T^2``. At most ``H · bq · bk`` logits are live (``bq = bk <= 512``, shrunk so that
``H · bq · bk <= 2**24``): T = 8192 with H = 16 needs ~16 MiB of logits, not the 4 GiB of a full ``[H, T, T]`` f32
tensor. Not differentiable in reverse mode (dynamic loop bounds).

Separate keys (``cu_seqlens_k``, prefill over cached context): k and v hold Tk packed key tokens of their own.
The f32 backend gives each query its key range directly. The cuDNN backend (whose causal mask is top-left)
splits each sequence of Lq queries and Lk keys: a non-causal call over its first Lk - n keys (n = min(Lq, Lk):
the context, which every query sees) and a causal call of its last n queries over its last n keys (equal
lengths: top-left is bottom-right), both in the packed layout over the same q, k, v with their own segment
lengths and offsets, merged by lse in float32 (each part rounded to bf16 by cuDNN first). A query segment
whose key segment is empty is passed with length 0; the one-sequence call is not used.

Shapes and index rules:
  q [T, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv]: bfloat16 or float32 (each on its own); one key per head.
  cu_seqlens [B + 1] int32, non-decreasing: sequence b owns query tokens [cu_seqlens[b], cu_seqlens[b+1]).
  Tokens outside [cu_seqlens[0], cu_seqlens[B]) belong to no sequence: their output is 0 and lse -inf, and they
  are never attended. cu_seqlens[B] must be <= T (tokens past T do not exist).
  cu_seqlens_k [B + 1] int32 (optional; default: cu_seqlens and Tk = T): sequence b's keys are tokens
  [cu_seqlens_k[b], cu_seqlens_k[b+1]) of k / v; keys outside every sequence are never attended.
  causal (python bool): the query at position i of its sequence (Lq queries, Lk keys) attends key positions
  j <= i + Lk - Lq (bottom-right, FlashAttention's varlen rule; with one array, j <= i); a query with no such
  key gets out 0 and lse -inf.
Returns out [T, H, Dv] bfloat16 and lse [T, H] float32 (natural log of the softmax denominator of
softmax_scale · q·k). Non-finite values never leak across sequences or from padding tokens; a non-finite value
among a query's own valid v rows makes that output element NaN (as in the reference).
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mla_pallas import _checks, _dispatch

__all__ = ["mla_prefill", "xla_backend", "sweep_configs"]

OP = "mla_prefill"
_ACT = (jnp.bfloat16, jnp.float32)
_HI = lax.Precision.HIGHEST
_MAX_BLOCK = 512
_LOGIT_BUDGET = 1 << 24     # H · bq · bk f32 logits live per tile step (64 MiB)
_CUDNN_MIN_VERSION = 90600  # packed (ragged) layout
_CUDNN_MLA_MIN_VERSION = 91000  # Dv != Dqk without padding (non-packed layout only)
_CUDNN_MAX_HEAD_DIM = 256   # Hopper and later
_STATS_BUDGET = 1 << 30     # bytes of cuDNN softmax statistics, M · H · T · 4
_log = logging.getLogger("mla_pallas")
LOG2E = float(np.log2(np.e))


def _check_args(q, k, v, cu_seqlens, softmax_scale, causal, cu_seqlens_k=None):
  _checks.check_array("q", q, ndim=3, dtypes=_ACT, expect="[T, H, Dqk]")
  t, h, dqk = q.shape
  if t < 1 or h < 1 or dqk < 1:
    raise ValueError(f"q must have shape [T, H, Dqk] with T, H, Dqk >= 1; got shape {tuple(q.shape)}")
  if cu_seqlens_k is None:
    _checks.check_array("k", k, ndim=3, shape=(t, h, dqk), dtypes=_ACT, expect=f"[T, H, Dqk] = [{t}, {h}, {dqk}]")
    tk = t
  else:
    _checks.check_array("k", k, ndim=3, shape=(None, h, dqk), dtypes=_ACT,
                        expect=f"[Tk, H, Dqk] = [Tk, {h}, {dqk}] (keys of cu_seqlens_k)")
    tk = k.shape[0]
    if tk < 1:
      raise ValueError(f"k must have shape [Tk, H, Dqk] with Tk >= 1; got shape {tuple(k.shape)}")
  _checks.check_array("v", v, ndim=3, shape=(tk, h, None), dtypes=_ACT, expect=f"[Tk, H, Dv] = [{tk}, {h}, Dv]")
  if v.shape[2] < 1:
    raise ValueError(f"v must have shape [Tk, H, Dv] with Dv >= 1; got shape {tuple(v.shape)}")
  _checks.check_array("cu_seqlens", cu_seqlens, ndim=1, dtypes=(jnp.int32,), expect="[B + 1]")
  if cu_seqlens.shape[0] < 1:
    raise ValueError("cu_seqlens must have shape [B + 1] with B >= 0; got shape (0,)")
  if cu_seqlens_k is not None:
    _checks.check_array("cu_seqlens_k", cu_seqlens_k, ndim=1, shape=cu_seqlens.shape, dtypes=(jnp.int32,),
                        expect=f"[B + 1] = [{cu_seqlens.shape[0]}] (as cu_seqlens)")
  _checks.check_scalar("softmax_scale", softmax_scale)
  if not isinstance(causal, (bool, np.bool_)):
    raise ValueError(f"causal must be a python bool; got {type(causal).__name__}")


# ----------------------------------------------------------------------------------------------------------
# backend choice
# ----------------------------------------------------------------------------------------------------------

def _cudnn_shape_reason(dtypes, t: int, h: int, dqk: int, dv: int, nseq: int, tk: int | None = None
                        ) -> str | None:
  """Why the cuDNN backend cannot take these inputs (None: it can). Pure function of the static inputs."""
  if any(np.dtype(d) != np.dtype(jnp.bfloat16) for d in dtypes):
    return "cuDNN backend needs bfloat16 q, k, v (float32 inputs keep float32 math)"
  if dqk > _CUDNN_MAX_HEAD_DIM or dqk % 8 or dv % 8:
    return f"cuDNN needs Dqk <= {_CUDNN_MAX_HEAD_DIM} and Dqk, Dv multiples of 8; got Dqk {dqk}, Dv {dv}"
  if dv > dqk:
    return f"cuDNN backend pads v to Dqk and needs Dv <= Dqk; got Dqk {dqk}, Dv {dv}"
  if max(t, tk or 0) * h * dqk >= 2 ** 31:
    return f"max(T, Tk) · H · Dqk = {max(t, tk or 0) * h * dqk} does not fit cuDNN's int32 element offsets"
  if nseq >= 1 and max(nseq, 2) * h * t * 4 > _STATS_BUDGET:
    return (f"cuDNN's softmax statistics [max(B, 2), H, T] would take {max(nseq, 2) * h * t * 4} bytes "
            f"(> {_STATS_BUDGET})")
  return None


def _cudnn_version() -> int | None:
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fa
    return int(fa.check_cudnn_version())
  except (ImportError, RuntimeError, AttributeError):
    return None


def _cudnn_device_reason() -> str | None:
  """Why cuDNN flash attention cannot run on the default device (None: it can)."""
  dev = jax.devices()[0]
  platform_version = getattr(getattr(dev, "client", None), "platform_version", "") or ""
  if dev.platform != "gpu" or "cuda" not in platform_version.lower():
    return f"not a CUDA GPU ({dev.device_kind!r})"
  arch = _dispatch.gpu_arch()
  if arch is None or arch < (9, 0):
    return f"cuDNN's packed layout needs compute capability >= 9.0; got {arch}"
  version = _cudnn_version()
  if version is None or version < _CUDNN_MIN_VERSION:
    return f"needs cuDNN >= {_CUDNN_MIN_VERSION}; found {version}"
  return None


def _backend_reason(q, k, v, cu_seqlens) -> str | None:
  t, h, dqk = q.shape
  return _cudnn_device_reason() or _cudnn_shape_reason(
      (q.dtype, k.dtype, v.dtype), t, h, dqk, v.shape[2], cu_seqlens.shape[0] - 1, k.shape[0])


def xla_backend(q, k, v, cu_seqlens) -> str:
  """The backend that ``mla_prefill(..., impl="xla")`` uses for these inputs here: "cudnn" or "f32"."""
  return "cudnn" if _backend_reason(q, k, v, cu_seqlens) is None else "f32"


# ----------------------------------------------------------------------------------------------------------
# f32 backend
# ----------------------------------------------------------------------------------------------------------

def _blocks(t: int, h: int) -> int:
  blk = min(_MAX_BLOCK, max(8, 1 << (t - 1).bit_length()))
  while h * blk * blk > _LOGIT_BUDGET and blk > 16:
    blk //= 2
  return blk


def _key_ranges(cu_q, cu_k, tq: int, tk: int, causal: bool):
  """Per query token: (inside a sequence, first key, one past the last key) over the packed keys ``[0, tk)``.

  Query token t of sequence b (``cu_q[b] <= t < cu_q[b+1]``, position ``i = t - cu_q[b]`` of ``Lq``) attends the
  keys ``[cu_k[b], cu_k[b] + n)`` with ``n = Lk`` (``causal=False``) or ``n = clip(i + Lk - Lq + 1, 0, Lk)``
  (bottom-right causal). Tokens outside every sequence get the empty range [0, 0). Both bounds lie in [0, tk].
  """
  tok = jnp.arange(tq, dtype=jnp.int32)
  last = cu_q.shape[0] - 1
  seq = jnp.searchsorted(cu_q, tok, side="right").astype(jnp.int32) - 1
  inside = (tok >= cu_q[0]) & (tok < cu_q[-1])
  b = jnp.clip(seq, 0, max(last - 1, 0))
  nxt = jnp.minimum(b + 1, last)
  start = cu_k[b]
  len_k = jnp.maximum(cu_k[nxt] - start, 0)
  n = len_k
  if causal:
    n = jnp.clip(tok - cu_q[b] + len_k - (cu_q[nxt] - cu_q[b]) + 1, 0, len_k)
  start = jnp.clip(start, 0, tk)
  end = jnp.clip(start + n, start, tk)
  return inside, jnp.where(inside, start, 0), jnp.where(inside, end, 0)


def _f32_prefill(q, k, v, cu_seqlens, cu_seqlens_k, softmax_scale, causal):
  tq, h, dqk = q.shape
  tk, dv = k.shape[0], v.shape[2]
  blk = _blocks(max(tq, tk), h)
  nbq, nbk = -(-tq // blk), -(-tk // blk)
  tqp, tkp = nbq * blk, nbk * blk
  _, start, end = _key_ranges(cu_seqlens, cu_seqlens_k, tq, tk, causal)
  pad_q = ((0, tqp - tq),)
  start, end = jnp.pad(start, pad_q), jnp.pad(end, pad_q)          # padded queries: empty range

  qf = jnp.pad(q.astype(jnp.float32), pad_q + ((0, 0), (0, 0))).reshape(nbq, blk, h, dqk)
  pad_k = ((0, tkp - tk), (0, 0), (0, 0))
  kf = jnp.pad(k.astype(jnp.float32), pad_k)
  v32 = jnp.pad(v.astype(jnp.float32), pad_k)
  v_ok = jnp.isfinite(v32)
  v_fin = jnp.where(v_ok, v32, 0.0)
  v_bad = (~v_ok).astype(jnp.float32)
  scale = jnp.asarray(softmax_scale, jnp.float32)

  def q_block(args):
    qb, lo_q, hi_q = args                                            # qb [blk, H, Dqk]; key ranges [blk]
    has_keys = hi_q > lo_q
    lo = jnp.min(jnp.where(has_keys, lo_q, tkp)) // blk
    hi = -(-jnp.max(jnp.where(has_keys, hi_q, 0)) // blk)
    hi = jnp.maximum(hi, lo)

    def body(j, carry):
      m, l, acc, bad = carry
      k0 = j * blk
      kb = lax.dynamic_slice_in_dim(kf, k0, blk, 0)
      vb = lax.dynamic_slice_in_dim(v_fin, k0, blk, 0)
      vbad = lax.dynamic_slice_in_dim(v_bad, k0, blk, 0)
      tok_k = k0 + jnp.arange(blk, dtype=jnp.int32)
      valid = (tok_k[None, :] >= lo_q[:, None]) & (tok_k[None, :] < hi_q[:, None])  # [bq, bk]
      s = jnp.einsum("qhd,khd->hqk", qb, kb, precision=_HI)
      s = jnp.where(valid[None], s * scale, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))                    # [H, bq]
      m_use = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      alpha = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - m_use))
      p = jnp.where(valid[None], jnp.exp(s - m_use[..., None]), 0.0)
      l = l * alpha + jnp.sum(p, axis=-1)
      acc = acc * alpha.T[..., None] + jnp.einsum("hqk,khd->qhd", p, vb, precision=_HI)
      bad = bad + jnp.einsum("qk,khd->qhd", valid.astype(jnp.float32), vbad, precision=_HI)
      return m_new, l, acc, bad

    init = (jnp.full((h, blk), -jnp.inf, jnp.float32), jnp.zeros((h, blk), jnp.float32),
            jnp.zeros((blk, h, dv), jnp.float32), jnp.zeros((blk, h, dv), jnp.float32))
    m, l, acc, bad = lax.fori_loop(lo, hi, body, init)
    has = (l > 0).T                                                  # [bq, H]
    d = jnp.where(has, l.T, 1.0)
    out = jnp.where(has[..., None], acc / d[..., None], 0.0)
    out = jnp.where(has[..., None] & (bad > 0), jnp.nan, out)
    m_t = jnp.where(jnp.isfinite(m), m, 0.0).T
    lse = jnp.where(has, jnp.log(d) + m_t, -jnp.inf)
    return out.astype(jnp.bfloat16), lse

  out, lse = lax.map(q_block, (qf, start.reshape(nbq, blk), end.reshape(nbq, blk)))
  return out.reshape(tqp, h, dv)[:tq], lse.reshape(tqp, h)[:tq]


@functools.partial(jax.jit, static_argnames=("causal",))
def _f32_jit(q, k, v, cu_seqlens, softmax_scale, *, causal, cu_seqlens_k=None):
  return _f32_prefill(q, k, v, cu_seqlens, cu_seqlens if cu_seqlens_k is None else cu_seqlens_k, softmax_scale,
                      causal)


# ----------------------------------------------------------------------------------------------------------
# cuDNN backend
# ----------------------------------------------------------------------------------------------------------

def _cudnn_attend(q4, k4, v4, q_lens, kv_lens, q_offsets, kv_offsets, *, scale: float, causal: bool):
  """cuDNN flash attention in JAX's packed layout: the only call into cuDNN's packed kernels.

  q4 [1, Tq, H, D], k4 and v4 [1, Tk, H, D] bfloat16 (one D); q_lens, kv_lens [1, M] int32 segment lengths;
  q_offsets, kv_offsets [1, M + 1] int32 token offsets of the segments in q4 and in k4 / v4 (non-decreasing,
  offsets[0, s] + lens[0, s] <= T). A segment with kv_lens 0 has q_lens 0 too (the callers' rule: cuDNN is never
  asked for a query without keys). ``causal``: query p of a segment attends keys <= p (the callers only pass
  causal segments with q_lens == kv_lens). Returns out [1, Tq, H, D] (rows outside every segment are not
  written: undefined) and stats [M, H, Tq] float32: stats[s, h, p] = natural lse of the scaled logits of the query
  at position p of segment s (undefined for p >= q_lens[s]).
  """
  from jax._src.cudnn import fused_attention_stablehlo as fa
  mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
  out, stats = fa.dot_product_attention(q4, k4, v4, None, None, q_lens, kv_lens, q_offsets, kv_offsets,
                                        scale=scale, mask_type=mask, qkv_layout="BTNH", return_residual=True)
  return out, stats


def _cudnn_attend_one(q4, k4, v4, *, scale: float, causal: bool):
  """cuDNN flash attention on one whole sequence (non-packed layout, no segments): the call of the clean branch
  when B = 1. q4, k4 [1, T, H, Dqk], v4 [1, T, H, Dv] bfloat16; Dv may differ from Dqk (cuDNN's MLA support,
  cuDNN >= 9.10), so v is not padded and the output is not sliced. Returns out [1, T, H, Dv] and stats [1, H, T]
  float32 (natural lse of the scaled logits of each query)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
  return fa.dot_product_attention(q4, k4, v4, None, None, None, None, None, None, scale=scale, mask_type=mask,
                                  qkv_layout="BTNH", return_residual=True)


def _is_clean(v, cu_q, cu_k, tq: int):
  """True when every v element is finite and every query and key token belongs to a sequence (clipped cu's)."""
  return (jnp.all(jnp.isfinite(v)) & (cu_q[0] == 0) & (cu_q[-1] == tq) & (cu_k[0] == 0)
          & (cu_k[-1] == v.shape[0]))


def _keys_in(cu_k, tk: int):
  """[Tk] bool: key token inside [cu_k[0], cu_k[-1]) (in some sequence)."""
  ktok = jnp.arange(tk, dtype=jnp.int32)
  return (ktok >= cu_k[0]) & (ktok < cu_k[-1])


def _nonfinite_v_rule(out, v, k_in, k_start, k_end):
  """The module docstring's rules on ``out`` [Tq, H, Dv] computed from sanitized v: a query without keys
  (``k_end <= k_start``, padding tokens included) gets 0, and an element whose keys hold a non-finite v element
  gets NaN (exclusive prefix counts of the non-finite elements over the keys, differenced per query range)."""
  has = (k_end > k_start)[:, None, None]
  out = jnp.where(has, out, jnp.zeros((), out.dtype))
  n_bad = jnp.cumsum((~jnp.isfinite(v) & k_in[:, None, None]).astype(jnp.int32), axis=0)
  n_bad = jnp.concatenate([jnp.zeros((1,) + v.shape[1:], jnp.int32), n_bad])
  seen = n_bad[k_end] - n_bad[k_start]
  return jnp.where(has & (seen > 0), jnp.asarray(jnp.nan, out.dtype), out)


def _segment_calls(cu_q, cu_k, context: bool, causal: bool):
  """The packed-layout calls that make up the attention: a list of (q_lens, kv_lens, q_offsets, kv_offsets,
  causal) with lens [M] and offsets [M + 1] (cu_q, cu_k: clipped, M + 1 entries).

  Without separate keys, one call (each sequence attends itself). With separate keys (``context``) and
  ``causal``: sequence b's Lq queries are its last Lq tokens, so they attend its first ``Lk - n`` keys (the
  context, n = min(Lq, Lk)) without a mask and its last n keys causally with its last n queries (equal lengths:
  cuDNN's top-left causal mask is then the bottom-right one); the two parts are merged by their lse. A query
  segment whose key segment is empty is given length 0."""
  len_q = jnp.maximum(cu_q[1:] - cu_q[:-1], 0)
  len_k = jnp.maximum(cu_k[1:] - cu_k[:-1], 0)
  if not context:
    return [(len_q, len_q, cu_q, cu_q, causal)]
  if not causal:
    return [(jnp.where(len_k > 0, len_q, 0), len_k, cu_q, cu_k, False)]
  n_new = jnp.minimum(len_q, len_k)
  n_old = len_k - n_new
  q_new = jnp.concatenate([cu_q[:-1] + len_q - n_new, cu_q[-1:]])
  k_new = jnp.concatenate([cu_k[:-1] + len_k - n_new, cu_k[-1:]])
  return [(jnp.where(n_old > 0, len_q, 0), n_old, cu_q, cu_k, False), (n_new, n_new, q_new, k_new, True)]


def _cudnn_prefill(q, k, v, cu_seqlens, softmax_scale, *, causal: bool, scale: float | None, cu_seqlens_k=None,
                   attend=_cudnn_attend, attend_one=None):
  """The cuDNN backend (module docstring). ``scale``: static softmax scale, or None to fold the traced
  ``softmax_scale`` into q. ``cu_seqlens_k``: the keys' sequences (None: the queries'). ``attend``: the
  packed-layout attention (``_cudnn_attend``; tests pass a stand-in). ``attend_one``: the whole-sequence attention
  (``_cudnn_attend_one``) that the clean branch of a one-sequence batch without separate keys calls, or None to
  use the packed layout there too."""
  tq, h, dqk = q.shape
  tk, dv = k.shape[0], v.shape[2]
  nseq = cu_seqlens.shape[0] - 1
  context = cu_seqlens_k is not None
  if nseq == 0:                                                   # no sequence: every token is padding
    return jnp.zeros((tq, h, dv), jnp.bfloat16), jnp.full((tq, h), -jnp.inf, jnp.float32)
  if scale is None:
    q = (q.astype(jnp.float32) * jnp.asarray(softmax_scale, jnp.float32)).astype(jnp.bfloat16)
    scale = 1.0
  cu_q = jnp.clip(cu_seqlens, 0, tq)
  cu_k = cu_q if not context else jnp.clip(cu_seqlens_k, 0, tk)
  if nseq == 1:                                                   # JAX's packed layout needs >= 2 segments
    cu_q, cu_k = jnp.concatenate([cu_q, cu_q[-1:]]), jnp.concatenate([cu_k, cu_k[-1:]])
  inside, k_start, k_end = _key_ranges(cu_q, cu_k, tq, tk, causal)
  tok = jnp.arange(tq, dtype=jnp.int32)
  seg = jnp.clip(jnp.searchsorted(cu_q, tok, side="right").astype(jnp.int32) - 1, 0, cu_q.shape[0] - 2)
  calls = _segment_calls(cu_q, cu_k, context, causal)
  q4, k4 = q[None], k[None]
  pad_v = ((0, 0), (0, 0), (0, dqk - dv))

  def run(v_padded):
    parts = []
    for q_lens, kv_lens, q_offs, kv_offs, c in calls:
      out, stats = attend(q4, k4, v_padded[None], q_lens[None], kv_lens[None], q_offs[None], kv_offs[None],
                          scale=float(scale), causal=c)
      pos = tok - q_offs[seg]
      mine = inside & (pos >= 0) & (pos < q_lens[seg])           # [Tq] the query is in this call's segment
      lse = jnp.where(mine[:, None], stats[seg, :, jnp.clip(pos, 0, tq - 1)], -jnp.inf)   # [Tq, H]
      parts.append((jnp.where(mine[:, None, None], out[0, :, :, :dv], jnp.zeros((), out.dtype)), lse))
    if len(parts) == 1:
      return parts[0]
    (o_a, l_a), (o_b, l_b) = parts
    m = jnp.maximum(l_a, l_b)
    m_use = jnp.where(jnp.isfinite(m), m, 0.0)
    w_a, w_b = jnp.exp(l_a - m_use), jnp.exp(l_b - m_use)        # 0 for a part without keys (lse -inf)
    den = w_a + w_b
    has = den > 0
    out = (o_a.astype(jnp.float32) * w_a[..., None] + o_b.astype(jnp.float32) * w_b[..., None]) \
        / jnp.where(has, den, 1.0)[..., None]
    return out, jnp.where(has, m_use + jnp.log(jnp.where(has, den, 1.0)), -jnp.inf)

  def clean(v, v_padded):                                         # every token in a sequence, v finite
    if attend_one is not None:                                    # B = 1: the sequence is tokens [0, T)
      out, stats = attend_one(q4, k4, v[None], scale=float(scale), causal=causal)
      return out[0], stats[0].T
    return run(v_padded)

  def general(v, v_padded):
    del v_padded
    k_in = _keys_in(cu_k, tk)
    out, lse = run(jnp.pad(jnp.where(jnp.isfinite(v) & k_in[:, None, None], v, jnp.zeros_like(v)), pad_v))
    out = _nonfinite_v_rule(out, v, k_in, k_start, k_end)
    return out, jnp.where((k_end > k_start)[:, None], lse, -jnp.inf)

  # The padded v of the common (clean) case is made outside the branches, beside the finiteness test that reads
  # the same v, so that XLA can fuse the two reads of v into one pass.
  v_padded = v if attend_one is not None else jnp.pad(v, pad_v)   # (the clean branch of B = 1 takes v as is)
  out, lse = lax.cond(_is_clean(v, cu_q, cu_k, tq), clean, general, v, v_padded)
  return out.astype(jnp.bfloat16), lse.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "attend", "attend_one"))
def _cudnn_jit(q, k, v, cu_seqlens, softmax_scale, *, causal, scale, cu_seqlens_k=None, attend=_cudnn_attend,
               attend_one=None):
  return _cudnn_prefill(q, k, v, cu_seqlens, softmax_scale, causal=causal, scale=scale, cu_seqlens_k=cu_seqlens_k,
                        attend=attend, attend_one=attend_one)


# ----------------------------------------------------------------------------------------------------------
# Mosaic GPU kernel (kernels/prefill_sm90.py): FP8 QKᵀ, FP8 (default) or bf16 P·V
# ----------------------------------------------------------------------------------------------------------

# Families on which the kernel passed its GPU tests and the op measured faster than the XLA path ("auto" picks it
# only there). sm90: passed, but slower than cuDNN (docs/kernels/prefill_sm90.md, "Measured").
_KERNEL_VALIDATED_ON: tuple[str, ...] = ()
_FP8_MAX = 448.0


def _kernel_supported(q, k, v):
  """``supported`` callable for :func:`_dispatch.choose`: NotImplementedError for inputs the kernel lacks."""
  def check():
    from mla_pallas.kernels import prefill_sm90 as kp
    if _dispatch.mosaic_arch(False) == "sm100":
      raise NotImplementedError(f"{OP}: the prefill kernel is sm_90a only (no Blackwell kernel yet)")
    if any(x.dtype != jnp.bfloat16 for x in (q, k, v)):
      raise NotImplementedError(f"{OP}: the Mosaic GPU kernel takes bfloat16 q, k, v; got "
                                f"{q.dtype.name}, {k.dtype.name}, {v.dtype.name}")
    try:
      kp.check_config(kp.TuningConfig(), q.shape[2], v.shape[2])
    except ValueError as e:
      raise NotImplementedError(f"{OP}: {e}") from None
  return check


def _aligned_packing(cu, n_rows: int, nseq: int, align: int = 8):
  """The kernel's aligned packing of a packed batch (``cu`` clipped, [nseq + 1]): sequence b starts at row
  ``starts[b]``, a multiple of ``align`` (8; the key block for ``pv_fp8``'s Vᵀ). Returns (starts [nseq + 1], src
  [n_al]: the token of each aligned row or -1, n_al: static rows, a multiple of ``align``)."""
  lens = jnp.maximum(cu[1:] - cu[:-1], 0)
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                            jnp.cumsum((lens + align - 1) // align * align).astype(jnp.int32)])
  n_al = -(-(n_rows + (align - 1) * nseq) // align) * align
  r = jnp.arange(n_al, dtype=jnp.int32)
  b = jnp.clip(jnp.searchsorted(starts, r, side="right").astype(jnp.int32) - 1, 0, nseq - 1)
  off = r - starts[b]
  ok = (off < lens[b]) & (r < starts[-1])
  return starts, jnp.where(ok, cu[b] + off, -1), n_al


def _fp8_per_row(x, src):
  """x [T, H, D] gathered into the aligned rows ``src`` (-1: zero row) and quantized to e4m3 with one scale per
  row and head (its largest finite |x| / 448; 1 for a row without any): row-local, but XLA runs the row maxima
  and the conversion as two passes over x (H200: 300 + 447 µs at 2 × 4096 tokens, DeepSeek dims). Returns
  (x8 [n_al, H, D], scale [H, n_al] float32)."""
  ok = src >= 0
  rows = jnp.take(x, jnp.maximum(src, 0), axis=0).astype(jnp.float32)
  rows = jnp.where(ok[:, None, None], rows, 0.0)
  amax = jnp.max(jnp.where(jnp.isfinite(rows), jnp.abs(rows), 0.0), axis=2)
  scale = jnp.where(amax > 0, amax / _FP8_MAX, 1.0)
  x8 = jnp.clip(rows / scale[:, :, None], -_FP8_MAX, _FP8_MAX).astype(jnp.float8_e4m3fn)
  return x8, scale.T


def _prepass_kernel(x) -> bool:
  """Whether :func:`_quantize_rows` runs kernels/prefill_quant.py (one launch reading x once) instead of the XLA
  ops of :func:`_fp8_per_row`: x [T, H, D] with H and D multiples of 64. The same bytes and scales (tested bitwise);
  predicted ~600 µs less at 2 × 4096 tokens with DeepSeek's dims (docs/kernels/prefill_sm90.md), to be measured
  (benchmarks/prefill_prepass_ab_gpu.py)."""
  from mla_pallas.kernels import prefill_quant
  return x.shape[1] % prefill_quant.ROWS == 0 and x.shape[2] % prefill_quant.CHUNK == 0


def _quantize_rows(x, src, interpret=False):
  """:func:`_fp8_per_row`'s (x8 [n_al, H, D], scale [H, n_al]) by kernels/prefill_quant.py where
  :func:`_prepass_kernel` says so, else by the XLA ops."""
  if not _prepass_kernel(x):
    return _fp8_per_row(x, src)
  from mla_pallas.kernels import prefill_quant
  x8, scale = prefill_quant.quantize_rows(x, src, interpret)
  return x8, scale.T


def _vt_fp8(v, src):
  """``TuningConfig.pv_fp8``'s V: the rows ``src`` of v [Tk, H, Dv] (-1: a zero row; non-finite elements 0, as in
  the packed bf16 v) as Vᵀ [H, Dv, n] float8_e4m3fn with one scale per head and column (its largest |v| over the
  keys / 448; 1 for a column of zeros): P·V's column scale comes off O at the end. Returns (vt8, vs [H, Dv]
  float32). Three passes that XLA runs at memory speed: the column amax over v's own rows (those that ``src``
  names), the gathered rows quantized in row order, and a transpose of the e4m3 bytes. (One fusion of gather,
  reduction and transpose ran at ~0.3 TB/s on the H200: 1.8 ms at 2 × 4096 tokens.)"""
  tk = v.shape[0]
  ok = src >= 0
  used = jnp.zeros((tk,), bool).at[jnp.where(ok, src, tk)].set(True, mode="drop")
  mag = jnp.where(used[:, None, None] & jnp.isfinite(v), jnp.abs(v.astype(jnp.float32)), 0.0)
  amax = jnp.max(mag, axis=0, initial=0.0)                                 # [H, Dv]
  vs = jnp.where(amax > 0, amax * jnp.float32(1.0 / _FP8_MAX), 1.0)
  rows = jnp.take(v, jnp.maximum(src, 0), axis=0).astype(jnp.float32)
  rows = jnp.where(ok[:, None, None] & jnp.isfinite(rows), rows, 0.0)
  rows8 = jnp.clip(rows / vs[None], -_FP8_MAX, _FP8_MAX).astype(jnp.float8_e4m3fn)
  rows8 = lax.optimization_barrier(rows8)        # the transpose on its own: a tiled transpose of bytes
  return jnp.transpose(rows8, (1, 2, 0)), vs.astype(jnp.float32)


def _kernel_tiles(cu_q, cu_k, q_starts, k_starts, v_starts, tq: int, nseq: int, causal: bool):
  """The kernel's tile table [n_max, 8] (kernels/prefill_sm90.py) and (tile_start [nseq + 1]): tile i of
  sequence b covers its queries 128 j .. 128 j + 127, j = i - tile_start[b]; its keys start at row k_starts[b]
  of k8 and v_starts[b] of the kernel's v."""
  from mla_pallas.kernels import prefill_sm90 as kp
  tile_q = kp.TILE_Q
  len_q = jnp.maximum(cu_q[1:] - cu_q[:-1], 0)
  len_k = jnp.maximum(cu_k[1:] - cu_k[:-1], 0)
  tile_start = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                                jnp.cumsum((len_q + tile_q - 1) // tile_q).astype(jnp.int32)])
  n_max = -(-tq // tile_q) + nseq
  i = jnp.arange(n_max, dtype=jnp.int32)
  b = jnp.clip(jnp.searchsorted(tile_start, i, side="right").astype(jnp.int32) - 1, 0, nseq - 1)
  j = i - tile_start[b]
  live = i < tile_start[-1]
  lq, lk = len_q[b], len_k[b]
  diag = tile_q * j + lk - lq if causal else jnp.zeros_like(j)
  z = jnp.zeros_like(i)
  tiles = jnp.stack([jnp.where(live, q_starts[b] + tile_q * j, 0),
                     jnp.where(live, jnp.minimum(tile_q, lq - tile_q * j), 0),
                     jnp.where(live, k_starts[b], 0), jnp.where(live, lk, 0), jnp.where(live, diag, 0),
                     jnp.where(live, cu_q[b] + tile_q * j, 0), jnp.where(live, v_starts[b], 0), z], axis=1)
  return tiles, tile_start


def _mosaic_prefill(q, k, v, cu_seqlens, softmax_scale, *, causal: bool, cu_seqlens_k=None, interpret=False,
                    cfg=None):
  """``mla_prefill`` on the Mosaic GPU kernel: q and k quantized to e4m3 per row and laid out in the kernel's
  aligned packing (every sequence at a multiple of 8 rows; one gather fused with the quantization), v as Vᵀ in
  e4m3 (``cfg.pv_fp8``: :func:`_vt_fp8`, every sequence at a multiple of ``block_kv`` key columns) or sanitized into
  the same packing, the kernel, then the lse gathered back and the non-finite-v and padding rules of the module
  docstring applied. Under ``lax.cond`` on :func:`_is_clean` (every v finite, every token in a sequence): a clean
  call skips the rules, and with a bf16 P·V, when moreover every key sequence starts at a multiple of 8 rows (and
  Tk is one: :func:`_v_direct`), the kernel reads v as it is, with no packed copy. ``cfg``: the kernel's TuningConfig
  (None: ``default_config`` of the head dims)."""
  from mla_pallas.kernels import prefill_sm90 as kp
  cfg = kp.default_config(q.shape[2], v.shape[2]) if cfg is None else cfg
  tq, h, _ = q.shape
  tk, dv = k.shape[0], v.shape[2]
  nseq = cu_seqlens.shape[0] - 1
  if nseq == 0:
    return jnp.zeros((tq, h, dv), jnp.bfloat16), jnp.full((tq, h), -jnp.inf, jnp.float32)
  cu_q = jnp.clip(cu_seqlens, 0, tq)
  cu_k = cu_q if cu_seqlens_k is None else jnp.clip(cu_seqlens_k, 0, tk)
  q_starts, q_src, _ = _aligned_packing(cu_q, tq, nseq)
  k_starts, k_src, _ = _aligned_packing(cu_k, tk, nseq)
  q8, q_scale = _quantize_rows(q, q_src, interpret)
  k8, k_scale = _quantize_rows(k, k_src, interpret)
  qs = (jnp.asarray(softmax_scale, jnp.float32) * LOG2E * q_scale).astype(jnp.float32)
  clean = _is_clean(v, cu_q, cu_k, tq)

  def attend(v_kernel, v_starts, vs=None):
    tiles, tile_start = _kernel_tiles(cu_q, cu_k, q_starts, k_starts, v_starts, tq, nseq, causal)
    out, lse_pad = kp.prefill_sm90(q8, k8, v_kernel, tiles, qs, k_scale, vs, cfg=cfg, causal=causal, out_rows=tq,
                                   interpret=interpret)
    return out, lse_pad, tile_start

  def packed_v(_):        # v sanitized (padding and non-finite elements 0) into k8's packing
    k_ok = k_src >= 0
    v_rows = jnp.take(v, jnp.maximum(k_src, 0), axis=0)
    return attend(jnp.where(k_ok[:, None, None] & jnp.isfinite(v_rows), v_rows, jnp.zeros((), v.dtype)),
                  k_starts)

  if cfg.pv_fp8:          # Vᵀ in e4m3 with column scales, every sequence at a multiple of block_kv key columns
    vt_starts, vt_src, _ = _aligned_packing(cu_k, tk, nseq, cfg.block_kv)
    vt8, vs = _vt_fp8(v, vt_src)
    out, lse_pad, tile_start = attend(vt8, vt_starts, vs)
  elif _v_direct(tk):
    out, lse_pad, tile_start = lax.cond(_v_in_place(clean, cu_k), lambda _: attend(v, cu_k[:-1]), packed_v, None)
  else:
    out, lse_pad, tile_start = packed_v(None)
  inside, k_start, k_end = _key_ranges(cu_q, cu_k, tq, tk, causal)
  tok = jnp.arange(tq, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(cu_q, tok, side="right").astype(jnp.int32) - 1, 0, nseq - 1)
  pos = tok - cu_q[seq]
  col = jnp.where(inside, (tile_start[seq] + pos // kp.TILE_Q) * kp.TILE_Q + pos % kp.TILE_Q, 0)
  lse = jnp.where(inside[:, None], lse_pad[:, col].T, -jnp.inf)
  # rows of padding tokens were never written: the general branch zeroes them (no keys) with the NaN rule
  out = lax.cond(clean, lambda o: o, lambda o: _nonfinite_v_rule(o, v, _keys_in(cu_k, tk), k_start, k_end), out)
  return out, lse


def _v_in_place(clean, cu_k):
  """Traced bool: a clean call (:func:`_is_clean`) whose key sequences all start at multiples of 8 rows."""
  from mla_pallas.kernels import prefill_sm90 as kp
  return clean & jnp.all(cu_k[:-1] % kp.ALIGN == 0)


def _v_direct(tk: int) -> bool:
  """Whether the kernel may read v [Tk, H, Dv] in place (when the call is clean and its key sequences start at
  multiples of 8 rows): Tk a multiple of 8, the row count Mosaic's tiled TMA needs."""
  from mla_pallas.kernels import prefill_sm90 as kp
  return tk % kp.ALIGN == 0


@functools.partial(jax.jit, static_argnames=("causal", "interpret", "cfg"))
def _mosaic_jit(q, k, v, cu_seqlens, softmax_scale, *, causal, cu_seqlens_k=None, interpret=False, cfg=None):
  return _mosaic_prefill(q, k, v, cu_seqlens, softmax_scale, causal=causal, cu_seqlens_k=cu_seqlens_k,
                         interpret=interpret, cfg=cfg)


def sweep_configs(dqk: int, dv: int) -> dict[str, tuple[tuple[str, object], ...]]:
  """Labelled ``tuning`` overrides of the prefill kernel for benchmark sweeps at head dims (Dqk, Dv), ``"default":
  ()`` first: every (block_kv, kv_stages) pair that fits in SMEM (with the default's P·V and schedule), the
  default with the other ``pingpong`` setting, then each block size with the other P·V (``pv_fp8``)."""
  from mla_pallas.kernels import prefill_sm90 as kp
  kp.check_head_dims(dqk, dv)
  default = kp.default_config(dqk, dv)
  out: dict[str, tuple[tuple[str, object], ...]] = {"default": ()}
  for b in (64, 128):
    for st in (2, 3):
      cfg = dataclasses.replace(default, block_kv=b, kv_stages=st)
      if cfg != default and kp.smem_budget(cfg, dqk, dv) <= kp.common.SMEM_LIMIT:
        out[f"block_kv={b},kv_stages={st}"] = (("block_kv", b), ("kv_stages", st))
  out[f"pingpong={not default.pingpong}"] = (("pingpong", not default.pingpong),)
  for b in (64, 128):   # the other P·V: bf16 V takes twice the SMEM, so 128-key blocks may fit only in e4m3
    cfg = dataclasses.replace(default, block_kv=b, pv_fp8=not default.pv_fp8)
    if kp.smem_budget(cfg, dqk, dv) <= kp.common.SMEM_LIMIT:
      out[f"block_kv={b},pv_fp8={cfg.pv_fp8}"] = (("block_kv", b), ("pv_fp8", cfg.pv_fp8))
  return out


def _tuned_config(tuning, dqk: int, dv: int):
  """The kernel's default TuningConfig at head dims (Dqk, Dv) with ``tuning``'s (name, value) overrides."""
  from mla_pallas.kernels import prefill_sm90 as kp
  return dataclasses.replace(kp.default_config(dqk, dv), **dict(tuning))


def _one_sequence_call(q, v, cu_seqlens):
  """``_cudnn_attend_one`` when the batch has one sequence and cuDNN can take its head dims unpadded (Dv == Dqk,
  or cuDNN >= 9.10 for Dv != Dqk), else None (the packed layout everywhere)."""
  if cu_seqlens.shape[0] != 2:
    return None
  if v.shape[2] != q.shape[2] and (_cudnn_version() or 0) < _CUDNN_MLA_MIN_VERSION:
    return None
  return _cudnn_attend_one


def _static_scale(softmax_scale) -> float | None:
  """softmax_scale as a python float when it is known at trace time, else None."""
  if isinstance(softmax_scale, (int, float, np.integer, np.floating)):
    return float(softmax_scale)
  try:
    return float(np.asarray(softmax_scale))
  except (TypeError, jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
    return None


def mla_prefill(q, k, v, cu_seqlens, *, softmax_scale, causal: bool = True, cu_seqlens_k=None, impl: str = "auto",
                interpret: bool = False):
  """Variable-length multi-head attention for MLA prefill (packed batch, FlashAttention varlen semantics).

  Args:
    q: [T, H, Dqk] bfloat16 or float32 (e.g. Dqk = 192 = 128 nope + 64 rope for DeepSeek-V3).
    k: [Tk, H, Dqk] bfloat16 or float32, one key per head (no sharing); Tk = T without ``cu_seqlens_k``.
    v: [Tk, H, Dv] bfloat16 or float32 (e.g. Dv = 128).
    cu_seqlens: [B + 1] int32, non-decreasing, cu_seqlens[B] <= T: sequence b owns query tokens
      [cu_seqlens[b], cu_seqlens[b+1]). Tokens outside [cu_seqlens[0], cu_seqlens[B]) get out = 0, lse = -inf
      and are never attended. (Monotonicity is not checked: it would need the values on the host.)
    softmax_scale: python float or f32 scalar multiplying q·k.
    causal: python bool. True: the query at position i of its sequence (Lq queries, Lk keys) attends the key
      positions j <= i + Lk - Lq of the same sequence (bottom-right alignment, as FlashAttention's varlen: the
      queries are the sequence's last Lq tokens, e.g. new tokens after Lk - Lq cached ones; queries with no such
      key, when Lk < Lq, get out 0 and lse -inf); with Lk = Lq, j <= i. False: the whole sequence.
    cu_seqlens_k: optional [B + 1] int32, non-decreasing, cu_seqlens_k[B] <= Tk: sequence b's keys are tokens
      [cu_seqlens_k[b], cu_seqlens_k[b+1]) of k and v (keys outside every sequence are never attended). None:
      the keys are the query tokens (k and v have T rows and share cu_seqlens).
    impl: "auto" | "mosaic" | "xla". "mosaic": the sm_90a kernel (module docstring; NotImplementedError where it
      cannot run or lacks the inputs' dtypes / head dims); "auto" runs the XLA path on hardware until the kernel is
      validated on a GPU; the XLA backend is :func:`xla_backend` (cuDNN flash attention on a CUDA GPU for
      bfloat16 inputs, float32 math elsewhere; module docstring).
    interpret: run the kernel in Pallas' GPU interpret mode (True or a ``plgpu.InterpretGPUParams``).

  Returns:
    out [T, H, Dv] bfloat16 and lse [T, H] float32 (natural log).

  Raises:
    ValueError: bad shape/dtype of an argument (the message names it) or an unknown ``impl``.
    NotImplementedError: ``impl="mosaic"`` where the kernel cannot run (no sm_90 GPU and no ``interpret``) or
      does not take the inputs.
  """
  _dispatch.check_impl(impl)
  _check_args(q, k, v, cu_seqlens, softmax_scale, causal, cu_seqlens_k)
  if _dispatch.choose(OP, impl, interpret=interpret, supported=_kernel_supported(q, k, v),
                      validated_on=_KERNEL_VALIDATED_ON) == "mosaic":
    return _mosaic_jit(q, k, v, cu_seqlens, jnp.asarray(softmax_scale, jnp.float32), causal=bool(causal),
                       cu_seqlens_k=cu_seqlens_k, interpret=interpret)
  reason = _backend_reason(q, k, v, cu_seqlens)
  if reason is None:
    one = _one_sequence_call(q, v, cu_seqlens) if cu_seqlens_k is None else None
    return _cudnn_jit(q, k, v, cu_seqlens, jnp.asarray(softmax_scale, jnp.float32), causal=bool(causal),
                      scale=_static_scale(softmax_scale), cu_seqlens_k=cu_seqlens_k, attend_one=one)
  _log.debug("%s: float32 XLA backend: %s", OP, reason)
  return _f32_jit(q, k, v, cu_seqlens, jnp.asarray(softmax_scale, jnp.float32), causal=bool(causal),
                  cu_seqlens_k=cu_seqlens_k)
