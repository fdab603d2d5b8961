"""Variable-length MLA prefill attention (FlashAttention varlen semantics): ``mla_prefill``.

Semantics are exactly those of :func:`mla_pallas.reference.mla_prefill`. Only an XLA path exists for now
(``impl="mosaic"`` raises ``NotImplementedError``; ``impl="auto"`` runs XLA).

The XLA path is memory-efficient: a flash-style computation over ``bq x bk`` tiles of the ``T x T`` score matrix
with an online softmax (float32 math, ``precision=HIGHEST`` matmuls). Query blocks run one after another
(``lax.map``); for each, a ``lax.fori_loop`` with *dynamic* bounds visits only the key blocks that overlap the
sequences of its tokens (and, with ``causal``, only those up to its last token), so a packed batch of short
sequences costs about ``sum_b len_b^2`` work, not ``T^2``. At most ``H · bq · bk`` logits are live
(``bq = bk <= 512``, shrunk so that ``H · bq · bk <= 2**24``): T = 8192 with H = 16 needs ~16 MiB of logits, not the
4 GiB of a full ``[H, T, T]`` f32 tensor. Not differentiable in reverse mode (dynamic loop bounds).

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

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mla_pallas import _checks, _dispatch

__all__ = ["mla_prefill"]

OP = "mla_prefill"
_ACT = (jnp.bfloat16, jnp.float32)
_HI = lax.Precision.HIGHEST
_MAX_BLOCK = 512
_LOGIT_BUDGET = 1 << 24     # H · bq · bk f32 logits live per tile step (64 MiB)


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


def _blocks(t: int, h: int) -> int:
  blk = min(_MAX_BLOCK, max(8, 1 << (t - 1).bit_length()))
  while h * blk * blk > _LOGIT_BUDGET and blk > 16:
    blk //= 2
  return blk


def _xla_prefill(q, k, v, cu_seqlens, softmax_scale, causal):
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
def _xla_jit(q, k, v, cu_seqlens, softmax_scale, *, causal):
  return _xla_prefill(q, k, v, cu_seqlens, softmax_scale, causal)


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
      "auto" runs XLA.
    interpret: accepted for API uniformity (no kernel).

  Returns:
    out [T, H, Dv] bfloat16 and lse [T, H] float32 (natural log). Float32 math throughout.

  Raises:
    ValueError: bad shape/dtype of an argument (the message names it) or an unknown ``impl``.
    NotImplementedError: ``impl="mosaic"``.
  """
  _dispatch.check_impl(impl)
  _check_args(q, k, v, cu_seqlens, softmax_scale, causal)
  _dispatch.choose(OP, impl, interpret=interpret, supported=None)
  return _xla_jit(q, k, v, cu_seqlens, jnp.asarray(softmax_scale, jnp.float32), causal=bool(causal))
