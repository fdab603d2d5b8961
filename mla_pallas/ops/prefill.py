"""Variable-length MLA prefill attention (FlashAttention varlen semantics): ``mla_prefill``.

Semantics are exactly those of :func:`mla_pallas.reference.mla_prefill`. There is no Mosaic GPU kernel
(``impl="mosaic"`` raises ``NotImplementedError``; ``impl="auto"`` runs XLA). The XLA path has two backends, chosen
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

Shapes and index rules:
  q [T, H, Dqk], k [T, H, Dqk], v [T, H, Dv]: bfloat16 or float32 (each on its own); one key per head.
  cu_seqlens [B + 1] int32, non-decreasing: sequence b owns tokens [cu_seqlens[b], cu_seqlens[b+1]). Tokens
  outside [cu_seqlens[0], cu_seqlens[B]) belong to no sequence: their output is 0 and lse -inf, and they are
  never attended. cu_seqlens[B] must be <= T (tokens past T do not exist).
  causal (python bool): token at position i of its sequence attends positions <= i of the same sequence.
Returns out [T, H, Dv] bfloat16 and lse [T, H] float32 (natural log of the softmax denominator of
softmax_scale · q·k). Non-finite values never leak across sequences or from padding tokens; a non-finite value
among a query's own valid v rows makes that output element NaN (as in the reference).
"""
from __future__ import annotations

import functools
import logging

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mla_pallas import _checks, _dispatch

__all__ = ["mla_prefill", "xla_backend"]

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


def _check_args(q, k, v, cu_seqlens, softmax_scale, causal):
  _checks.check_array("q", q, ndim=3, dtypes=_ACT, expect="[T, H, Dqk]")
  t, h, dqk = q.shape
  if t < 1 or h < 1 or dqk < 1:
    raise ValueError(f"q must have shape [T, H, Dqk] with T, H, Dqk >= 1; got shape {tuple(q.shape)}")
  _checks.check_array("k", k, ndim=3, shape=(t, h, dqk), dtypes=_ACT, expect=f"[T, H, Dqk] = [{t}, {h}, {dqk}]")
  _checks.check_array("v", v, ndim=3, shape=(t, h, None), dtypes=_ACT, expect=f"[T, H, Dv] = [{t}, {h}, Dv]")
  if v.shape[2] < 1:
    raise ValueError(f"v must have shape [T, H, Dv] with Dv >= 1; got shape {tuple(v.shape)}")
  _checks.check_array("cu_seqlens", cu_seqlens, ndim=1, dtypes=(jnp.int32,), expect="[B + 1]")
  if cu_seqlens.shape[0] < 1:
    raise ValueError("cu_seqlens must have shape [B + 1] with B >= 0; got shape (0,)")
  _checks.check_scalar("softmax_scale", softmax_scale)
  if not isinstance(causal, (bool, np.bool_)):
    raise ValueError(f"causal must be a python bool; got {type(causal).__name__}")


# ----------------------------------------------------------------------------------------------------------
# backend choice
# ----------------------------------------------------------------------------------------------------------

def _cudnn_shape_reason(dtypes, t: int, h: int, dqk: int, dv: int, nseq: int) -> str | None:
  """Why the cuDNN backend cannot take these inputs (None: it can). Pure function of the static inputs."""
  if any(np.dtype(d) != np.dtype(jnp.bfloat16) for d in dtypes):
    return "cuDNN backend needs bfloat16 q, k, v (float32 inputs keep float32 math)"
  if dqk > _CUDNN_MAX_HEAD_DIM or dqk % 8 or dv % 8:
    return f"cuDNN needs Dqk <= {_CUDNN_MAX_HEAD_DIM} and Dqk, Dv multiples of 8; got Dqk {dqk}, Dv {dv}"
  if dv > dqk:
    return f"cuDNN backend pads v to Dqk and needs Dv <= Dqk; got Dqk {dqk}, Dv {dv}"
  if t * h * dqk >= 2 ** 31:
    return f"T · H · Dqk = {t * h * dqk} does not fit cuDNN's int32 element offsets"
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
      (q.dtype, k.dtype, v.dtype), t, h, dqk, v.shape[2], cu_seqlens.shape[0] - 1)


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


def _f32_prefill(q, k, v, cu_seqlens, softmax_scale, causal):
  t, h, dqk = q.shape
  dv = v.shape[2]
  blk = _blocks(t, h)
  nb = -(-t // blk)
  tp = nb * blk
  tok = jnp.arange(tp, dtype=jnp.int32)
  seq = jnp.searchsorted(cu_seqlens, tok, side="right").astype(jnp.int32) - 1
  in_any = (tok >= cu_seqlens[0]) & (tok < cu_seqlens[-1]) & (tok < t)
  seq = jnp.where(in_any, seq, -1)
  nseq = cu_seqlens.shape[0] - 1
  start = jnp.where(in_any, cu_seqlens[jnp.clip(seq, 0, max(nseq - 1, 0))], tp)         # first key of token's seq
  end = jnp.where(in_any, cu_seqlens[jnp.clip(seq + 1, 0, nseq)], 0)                   # one past its last key
  if causal:
    end = jnp.where(in_any, tok + 1, 0)

  pad = ((0, tp - t), (0, 0), (0, 0))
  qf = jnp.pad(q.astype(jnp.float32), pad).reshape(nb, blk, h, dqk)
  kf = jnp.pad(k.astype(jnp.float32), pad)
  v32 = jnp.pad(v.astype(jnp.float32), pad)
  v_ok = jnp.isfinite(v32)
  v_fin = jnp.where(v_ok, v32, 0.0)
  v_bad = (~v_ok).astype(jnp.float32)
  scale = jnp.asarray(softmax_scale, jnp.float32)

  def q_block(args):
    qb, seq_q, in_q, tok_q, lo_tok, hi_tok = args                    # qb [blk, H, Dqk]
    lo = jnp.minimum(lo_tok, tp) // blk
    hi = jnp.where(hi_tok > 0, -(-hi_tok // blk), 0)
    hi = jnp.maximum(hi, lo)

    def body(j, carry):
      m, l, acc, bad = carry
      k0 = j * blk
      kb = lax.dynamic_slice_in_dim(kf, k0, blk, 0)
      vb = lax.dynamic_slice_in_dim(v_fin, k0, blk, 0)
      vbad = lax.dynamic_slice_in_dim(v_bad, k0, blk, 0)
      seq_k = lax.dynamic_slice_in_dim(seq, k0, blk, 0)
      in_k = lax.dynamic_slice_in_dim(in_any, k0, blk, 0)
      tok_k = k0 + jnp.arange(blk, dtype=jnp.int32)
      valid = (seq_q[:, None] == seq_k[None, :]) & in_q[:, None] & in_k[None, :]       # [bq, bk]
      if causal:
        valid = valid & (tok_k[None, :] <= tok_q[:, None])
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

  lo_tok = jnp.min(start.reshape(nb, blk), axis=1)
  hi_tok = jnp.max(end.reshape(nb, blk), axis=1)
  out, lse = lax.map(q_block, (qf, seq.reshape(nb, blk), in_any.reshape(nb, blk), tok.reshape(nb, blk),
                               lo_tok, hi_tok))
  return out.reshape(tp, h, dv)[:t], lse.reshape(tp, h)[:t]



@functools.partial(jax.jit, static_argnames=("causal",))
def _f32_jit(q, k, v, cu_seqlens, softmax_scale, *, causal):
  return _f32_prefill(q, k, v, cu_seqlens, softmax_scale, causal)


# ----------------------------------------------------------------------------------------------------------
# cuDNN backend
# ----------------------------------------------------------------------------------------------------------

def _cudnn_attend(q4, k4, v4, lens, offsets, *, scale: float, causal: bool):
  """cuDNN flash attention in JAX's packed layout: the only call into cuDNN.

  q4, k4, v4 [1, T, H, D] bfloat16 (one D); lens [1, M] int32 segment lengths; offsets [1, M + 1] int32 token
  offsets of the segments (offsets[0, s] + lens[0, s] <= T). Returns out [1, T, H, D] (rows outside every segment
  are not written: undefined) and stats [M, H, T] float32: stats[s, h, p] = natural lse of the scaled logits of
  the query at position p of segment s (undefined for p >= lens[s]).
  """
  from jax._src.cudnn import fused_attention_stablehlo as fa
  mask = fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
  out, stats = fa.dot_product_attention(q4, k4, v4, None, None, lens, lens, offsets, offsets, scale=scale,
                                        mask_type=mask, qkv_layout="BTNH", return_residual=True)
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


def _is_clean(v, cu):
  """True when every v element is finite and every token of v belongs to a sequence (cu: clipped cu_seqlens)."""
  return jnp.all(jnp.isfinite(v)) & (cu[0] == 0) & (cu[-1] == v.shape[0])


def _cudnn_prefill(q, k, v, cu_seqlens, softmax_scale, *, causal: bool, scale: float | None, attend=_cudnn_attend,
                   attend_one=None):
  """The cuDNN backend (module docstring). ``scale``: static softmax scale, or None to fold the traced
  ``softmax_scale`` into q. ``attend``: the packed-layout attention (``_cudnn_attend``; tests pass a stand-in).
  ``attend_one``: the whole-sequence attention (``_cudnn_attend_one``) that the clean branch of a one-sequence
  batch calls, or None to use the packed layout there too."""
  t, h, dqk = q.shape
  dv = v.shape[2]
  nseq = cu_seqlens.shape[0] - 1
  if nseq == 0:                                                   # no sequence: every token is padding
    return jnp.zeros((t, h, dv), jnp.bfloat16), jnp.full((t, h), -jnp.inf, jnp.float32)
  if scale is None:
    q = (q.astype(jnp.float32) * jnp.asarray(softmax_scale, jnp.float32)).astype(jnp.bfloat16)
    scale = 1.0
  cu = jnp.clip(cu_seqlens, 0, t)
  if nseq == 1:                                                   # JAX's packed layout needs >= 2 segments
    cu = jnp.concatenate([cu, cu[-1:]])
  lens = jnp.maximum(cu[1:] - cu[:-1], 0)
  tok = jnp.arange(t, dtype=jnp.int32)
  seq = jnp.searchsorted(cu, tok, side="right").astype(jnp.int32) - 1
  in_any = (tok >= cu[0]) & (tok < cu[-1])
  seg = jnp.clip(seq, 0, lens.shape[0] - 1)
  pos = jnp.clip(tok - cu[seg], 0, t - 1)
  q4, k4 = q[None], k[None]
  pad_v = ((0, 0), (0, 0), (0, dqk - dv))

  def run(v_padded):
    out, stats = attend(q4, k4, v_padded[None], lens[None], cu[None], scale=float(scale), causal=causal)
    lse = stats[seg, :, pos]                                      # [T, H]
    return out[0, :, :, :dv], lse

  def clean(v, v_padded):                                         # every token in a sequence, v finite
    if attend_one is not None:                                    # B = 1: the sequence is tokens [0, T)
      out, stats = attend_one(q4, k4, v[None], scale=float(scale), causal=causal)
      return out[0], stats[0].T
    return run(v_padded)

  def general(v, v_padded):
    del v_padded
    finite = jnp.isfinite(v)
    out, lse = run(jnp.pad(jnp.where(finite & in_any[:, None, None], v, jnp.zeros_like(v)), pad_v))
    out = jnp.where(in_any[:, None, None], out, jnp.zeros_like(out))
    # non-finite v elements among each query's keys: exclusive prefix counts, differenced per sequence
    n_bad = jnp.cumsum((~finite & in_any[:, None, None]).astype(jnp.int32), axis=0)
    n_bad = jnp.concatenate([jnp.zeros((1, h, dv), jnp.int32), n_bad])
    start = cu[seg]
    stop = tok + 1 if causal else cu[seg + 1]
    seen = n_bad[jnp.clip(stop, 0, t)] - n_bad[start]
    out = jnp.where(in_any[:, None, None] & (seen > 0), jnp.asarray(jnp.nan, out.dtype), out)
    return out, jnp.where(in_any[:, None], lse, -jnp.inf)

  # The padded v of the common (clean) case is made outside the branches, beside the finiteness test that reads
  # the same v, so that XLA can fuse the two reads of v into one pass.
  v_padded = v if attend_one is not None else jnp.pad(v, pad_v)   # (the clean branch of B = 1 takes v as is)
  out, lse = lax.cond(_is_clean(v, cu), clean, general, v, v_padded)
  return out.astype(jnp.bfloat16), lse.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("causal", "scale", "attend", "attend_one"))
def _cudnn_jit(q, k, v, cu_seqlens, softmax_scale, *, causal, scale, attend=_cudnn_attend, attend_one=None):
  return _cudnn_prefill(q, k, v, cu_seqlens, softmax_scale, causal=causal, scale=scale, attend=attend,
                        attend_one=attend_one)


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


def mla_prefill(q, k, v, cu_seqlens, *, softmax_scale, causal: bool = True, impl: str = "auto",
                interpret: bool = False):
  """Variable-length multi-head attention for MLA prefill (packed batch, FlashAttention varlen semantics).

  Args:
    q: [T, H, Dqk] bfloat16 or float32 (e.g. Dqk = 192 = 128 nope + 64 rope for DeepSeek-V3).
    k: [T, H, Dqk] bfloat16 or float32, one key per head (no sharing).
    v: [T, H, Dv] bfloat16 or float32 (e.g. Dv = 128).
    cu_seqlens: [B + 1] int32, non-decreasing, cu_seqlens[B] <= T: sequence b owns tokens
      [cu_seqlens[b], cu_seqlens[b+1]). Tokens outside [cu_seqlens[0], cu_seqlens[B]) get out = 0, lse = -inf
      and are never attended. (Monotonicity is not checked: it would need the values on the host.)
    softmax_scale: python float or f32 scalar multiplying q·k.
    causal: python bool. True: a token at position i of its sequence attends positions <= i of the same
      sequence; False: the whole sequence.
    impl: "auto" | "mosaic" | "xla". There is no Mosaic kernel yet: "mosaic" raises NotImplementedError and
      "auto" runs XLA, whose backend is :func:`xla_backend` (cuDNN flash attention on a CUDA GPU for bfloat16
      inputs, float32 math elsewhere; module docstring).
    interpret: accepted for API uniformity (no kernel).

  Returns:
    out [T, H, Dv] bfloat16 and lse [T, H] float32 (natural log).

  Raises:
    ValueError: bad shape/dtype of an argument (the message names it) or an unknown ``impl``.
    NotImplementedError: ``impl="mosaic"``.
  """
  _dispatch.check_impl(impl)
  _check_args(q, k, v, cu_seqlens, softmax_scale, causal)
  _dispatch.choose(OP, impl, interpret=interpret, supported=None)
  reason = _backend_reason(q, k, v, cu_seqlens)
  if reason is None:
    return _cudnn_jit(q, k, v, cu_seqlens, jnp.asarray(softmax_scale, jnp.float32), causal=bool(causal),
                      scale=_static_scale(softmax_scale), attend_one=_one_sequence_call(q, v, cu_seqlens))
  _log.debug("%s: float32 XLA backend: %s", OP, reason)
  return _f32_jit(q, k, v, cu_seqlens, jnp.asarray(softmax_scale, jnp.float32), causal=bool(causal))
