"""Float32 reference implementations (the oracles every kernel and XLA path is tested against).

Pure ``jax.numpy``; all arithmetic in float32 (matmuls with ``precision=HIGHEST`` so GPUs do not drop to
TF32 / bf16 passes), outputs cast at the end. Every function is jit-able; arguments that change control flow
or shapes must be static under ``jax.jit``: ``causal`` (:func:`mla_prefill` only -- in
:func:`dense_mla_decode` it may be traced), ``interleaved``, ``act_scale``, ``block``. Scalars such as
``softmax_scale``, ``kv_scale`` and ``eps`` may be python floats or traced float32 scalars (the
``kv_scale > 0`` check of :func:`rope_rmsnorm_quantize_write` only applies to python numbers).

Big inputs: the attention references gather float32 rows chunk by chunk over the batch (``jax.lax.map``)
so that at most ~1 GiB of gathered rows is live; :func:`mla_prefill` is O(T^2 H) memory.

Layout conventions (see also :mod:`mla_pallas.cache`):

* Latent row: 576 values, ``[0, 512)`` latent ("nope", also the value ``V``), ``[512, 576)`` rope.
  ``D_QK = 576``, ``D_V = 512``.
* KV cache: float8_e4m3fn, paged ``[num_pages, page_size, 576]`` or flat ``[num_slots, 576]``; flat slot
  ``= page * page_size + offset``, ``num_slots = num_pages * page_size``. Dequantized row
  ``= row.astype(f32) * kv_scale``. The references also accept bfloat16 / float32 caches (same formula).
* Masking: a masked (invalid) key never contributes, even when its cache row holds NaN/inf: the gathered rows
  and logits are selected with ``jnp.where`` (never multiplied by a 0/1 mask) and out-of-range slot ids are
  clamped before the gather, so nothing is read out of bounds.
* A query row with no valid key: ``out = 0`` and ``lse = -inf``.
* ``lse`` is the natural log of ``sum(exp(logits))`` over valid keys, where ``logits = softmax_scale * q.k``
  (the scale is included; no log2).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mla_pallas import quant
from mla_pallas._checks import check_array, check_positive_int, check_scalar

__all__ = [
    "D_QK", "D_V", "D_ROPE",
    "sparse_mla_decode", "sparse_mla_prefill", "dense_mla_decode", "mla_prefill",
    "rope", "rope_tables", "rms_norm", "rope_rmsnorm", "rope_rmsnorm_quantize_write",
    "quantize_and_bmm_fp8", "convert_bf16_to_fp8_e4m3fn", "convert_fp8_e4m3fn_to_bf16",
]

D_QK = 576
D_V = 512
D_ROPE = D_QK - D_V

_HI = jax.lax.Precision.HIGHEST
_Q_DTYPES = (jnp.bfloat16, jnp.float32)
_CACHE_DTYPES = (quant.FP8, jnp.bfloat16, jnp.float32)
_ACT_DTYPES = (jnp.bfloat16, jnp.float32)


# ----------------------------------------------------------------------------------------------------------
# attention core
# ----------------------------------------------------------------------------------------------------------

def _flat_cache(name: str, kv_cache):
  """Validate a paged [P, page, 576] or flat [S, 576] cache; return the flat view."""
  check_array(name, kv_cache, ndim=(2, 3), dtypes=_CACHE_DTYPES,
              expect="[num_pages, page_size, 576] or [num_slots, 576]")
  if kv_cache.shape[-1] != D_QK:
    raise ValueError(f"{name} must have shape [num_pages, page_size, 576] or [num_slots, 576]; "
                     f"got shape {tuple(kv_cache.shape)} {np.dtype(kv_cache.dtype).name}")
  return kv_cache.reshape(-1, D_QK)


# Gathered f32 rows per chunk of the batch are kept under this many elements (1 GiB) so that big references
# (dense decode over long contexts) do not materialize [B, s_q, K, 576] f32 at once.
_GATHER_BUDGET = 1 << 28


def _attend_slots(q, flat, slots, valid, softmax_scale, kv_scale):
  """Attention of q [B, s_q, H, 576] over gathered keys, chunked over B (see _GATHER_BUDGET).

  slots [B, s_q, K] int32 flat slot ids, valid [B, s_q, K] bool (slots of invalid entries may be anything).
  Returns (out [B, s_q, H, 512] bf16, lse [B, s_q, H] f32).
  """
  b, s_q, k = slots.shape
  per_b = max(s_q * k * D_QK, 1)
  chunk = max(1, _GATHER_BUDGET // per_b)
  if chunk >= b:
    return _attend_slots_1(q, flat, slots, valid, softmax_scale, kv_scale)

  def one(args):
    qb, sb, vb = args
    out, lse = _attend_slots_1(qb[None], flat, sb[None], vb[None], softmax_scale, kv_scale)
    return out[0], lse[0]

  return jax.lax.map(one, (q, slots, valid), batch_size=chunk)


def _attend_slots_1(q, flat, slots, valid, softmax_scale, kv_scale):
  """Unchunked body of _attend_slots."""
  num_slots = flat.shape[0]
  safe = jnp.clip(jnp.where(valid, slots, 0), 0, max(num_slots - 1, 0))  # never gather out of bounds
  rows = jnp.take(flat, safe, axis=0, mode="clip").astype(jnp.float32) * kv_scale  # [B, s_q, K, 576]
  rows = jnp.where(valid[..., None], rows, 0.0)  # NaN/inf in masked rows must not leak
  logits = jnp.einsum("bshd,bskd->bshk", q.astype(jnp.float32), rows, precision=_HI)
  logits = logits * softmax_scale
  vmask = valid[:, :, None, :]
  logits = jnp.where(vmask, logits, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(vmask, jnp.exp(logits - m), 0.0)
  denom = jnp.sum(p, axis=-1)  # [B, s_q, H]
  acc = jnp.einsum("bshk,bskd->bshd", p, rows[..., :D_V], precision=_HI)
  has = denom > 0
  out = jnp.where(has[..., None], acc / jnp.where(has, denom, 1.0)[..., None], 0.0)
  lse = jnp.where(has, jnp.log(jnp.where(has, denom, 1.0)) + m[..., 0], -jnp.inf)
  return out.astype(jnp.bfloat16), lse.astype(jnp.float32)


def sparse_mla_decode(q, kv_cache, indices, *, softmax_scale, kv_scale=1.0, topk_length=None):
  """Sparse (top-k) MLA decode attention over an FP8 latent cache (DeepSeek-V3.2 DSA / FlashMLA sparse).

  Args:
    q: ``[B, s_q, H, 576]`` bfloat16 or float32 (latent-space query: absorbed nope part ``[0, 512)`` then rope
      part ``[512, 576)``).
    kv_cache: float8_e4m3fn ``[num_pages, page_size, 576]`` or ``[num_slots, 576]`` (bf16/f32 also accepted).
    indices: int32 ``[B, s_q, topk]`` flat slot ids. Entry ``j`` of row ``(b, s)`` is valid iff
      ``0 <= indices[b, s, j] < num_slots`` and (when ``topk_length`` is given) ``j < topk_length[b]``.
      Duplicated valid ids count as many times as they appear.
    softmax_scale: python float or f32 scalar.
    kv_scale: python float or f32 scalar; key/value row = ``kv_cache[slot].astype(f32) * kv_scale``.
    topk_length: optional int32 ``[B]``; values <= 0 mask the whole row, values >= topk mask nothing.
  Returns:
    ``(out, lse)``: ``out`` bfloat16 ``[B, s_q, H, 512]`` = softmax-weighted sum of the first 512 dims of the
    valid rows; ``lse`` float32 ``[B, s_q, H]`` = ``log(sum_j exp(softmax_scale * q . k_j))`` over valid ``j``
    (natural log). Rows with no valid entry: ``out = 0``, ``lse = -inf``.
  """
  check_array("q", q, shape=(None, None, None, D_QK), dtypes=_Q_DTYPES, expect="[B, s_q, H, 576]")
  b, s_q = q.shape[:2]
  flat = _flat_cache("kv_cache", kv_cache)
  check_array("indices", indices, shape=(b, s_q, None), dtypes=(jnp.int32,), expect="[B, s_q, topk]")
  softmax_scale = check_scalar("softmax_scale", softmax_scale)
  kv_scale = check_scalar("kv_scale", kv_scale)
  num_slots = flat.shape[0]
  valid = (indices >= 0) & (indices < num_slots)
  if topk_length is not None:
    check_array("topk_length", topk_length, shape=(b,), dtypes=(jnp.int32,), expect="[B]")
    pos = jnp.arange(indices.shape[-1], dtype=jnp.int32)
    valid = valid & (pos[None, None, :] < topk_length[:, None, None])
  return _attend_slots(q, flat, indices, valid, softmax_scale, kv_scale)


def sparse_mla_prefill(q, kv, indices, *, softmax_scale, kv_scale=1.0, topk_length=None):
  """Sparse MLA prefill: :func:`sparse_mla_decode` with ``B = T`` and ``s_q = 1``.

  Args:
    q: ``[T, H, 576]`` bfloat16 or float32.
    kv: float8_e4m3fn ``[num_slots, 576]`` or paged ``[num_pages, page_size, 576]``.
    indices: int32 ``[T, topk]`` flat slot ids (masking as in :func:`sparse_mla_decode`).
    softmax_scale, kv_scale: as in :func:`sparse_mla_decode`.
    topk_length: optional int32 ``[T]``: only the first ``topk_length[t]`` entries of row ``t`` count.
  Returns:
    ``(out bfloat16 [T, H, 512], lse float32 [T, H])``; rows with no valid entry: ``out = 0``, ``lse = -inf``.
  """
  check_array("q", q, shape=(None, None, D_QK), dtypes=_Q_DTYPES, expect="[T, H, 576]")
  t = q.shape[0]
  check_array("indices", indices, shape=(t, None), dtypes=(jnp.int32,), expect="[T, topk]")
  if topk_length is not None:
    check_array("topk_length", topk_length, shape=(t,), dtypes=(jnp.int32,), expect="[T]")
  out, lse = sparse_mla_decode(q[:, None], kv, indices[:, None], softmax_scale=softmax_scale,
                               kv_scale=kv_scale, topk_length=topk_length)
  return out[:, 0], lse[:, 0]


def dense_mla_decode(q, kv_cache, block_table, cache_seqlens, *, softmax_scale, kv_scale=1.0,
                     causal=False):
  """Dense MLA decode attention over a paged FP8 latent cache (FlashMLA dense decode).

  Args:
    q: ``[B, s_q, H, 576]`` bfloat16 or float32; the ``s_q`` query tokens are the last ``s_q`` tokens of
      each sequence.
    kv_cache: float8_e4m3fn ``[num_pages, page_size, 576]`` (paged only: the block table needs the page size).
    block_table: int32 ``[B, P]`` page ids; position ``p`` of sequence ``b`` lives at flat slot
      ``block_table[b, p // page_size] * page_size + p % page_size``. Entries past the sequence may be
      anything (e.g. -1).
    cache_seqlens: int32 ``[B]``; sequence ``b`` has positions ``[0, cache_seqlens[b])`` (only the first
      ``P * page_size`` positions are addressable; longer lengths are truncated to that).
    softmax_scale, kv_scale: as in :func:`sparse_mla_decode`.
    causal: bool (may be traced). False: every query token attends all positions ``< cache_seqlens[b]``.
      True: query token ``i`` attends positions ``< cache_seqlens[b] - s_q + i + 1`` (nothing when that is
      <= 0).
  A position whose page id is outside ``[0, num_pages)`` is treated as masked (never read).
  Returns:
    ``(out bfloat16 [B, s_q, H, 512], lse float32 [B, s_q, H])``; rows with no valid position (e.g.
    ``cache_seqlens[b] == 0``): ``out = 0``, ``lse = -inf``.
  """
  check_array("q", q, shape=(None, None, None, D_QK), dtypes=_Q_DTYPES, expect="[B, s_q, H, 576]")
  b, s_q = q.shape[:2]
  check_array("kv_cache", kv_cache, shape=(None, None, D_QK), dtypes=_CACHE_DTYPES,
              expect="[num_pages, page_size, 576]")
  num_pages, page_size = kv_cache.shape[:2]
  check_array("block_table", block_table, shape=(b, None), dtypes=(jnp.int32,), expect="[B, P]")
  check_array("cache_seqlens", cache_seqlens, shape=(b,), dtypes=(jnp.int32,), expect="[B]")
  softmax_scale = check_scalar("softmax_scale", softmax_scale)
  kv_scale = check_scalar("kv_scale", kv_scale)
  n_pos = block_table.shape[1] * page_size
  pos = jnp.arange(n_pos, dtype=jnp.int32)
  page = block_table[:, pos // page_size]  # [B, n_pos]
  slots = page * page_size + pos % page_size
  page_ok = (page >= 0) & (page < num_pages)
  limit = jnp.broadcast_to(cache_seqlens[:, None], (b, s_q))  # [B, s_q] exclusive bound on positions
  causal_limit = cache_seqlens[:, None] - s_q + jnp.arange(s_q, dtype=jnp.int32)[None, :] + 1
  limit = jnp.where(jnp.asarray(causal, bool), jnp.minimum(limit, causal_limit), limit)
  valid = page_ok[:, None, :] & (pos[None, None, :] < limit[:, :, None])  # [B, s_q, n_pos]
  slots = jnp.broadcast_to(slots[:, None, :], valid.shape)
  return _attend_slots(q, kv_cache.reshape(-1, D_QK), slots, valid, softmax_scale, kv_scale)


def mla_prefill(q, k, v, cu_seqlens, *, softmax_scale, causal=True, cu_seqlens_k=None):
  """Variable-length multi-head attention for MLA prefill (FlashAttention varlen semantics).

  Args:
    q: ``[T, H, Dqk]`` bfloat16 or float32.
    k: ``[Tk, H, Dqk]`` (same dtype rules), one key per head (no sharing); ``Tk = T`` without ``cu_seqlens_k``.
    v: ``[Tk, H, Dv]``.
    cu_seqlens: int32 ``[B + 1]`` non-decreasing; sequence ``b`` owns query tokens ``[cu_seqlens[b],
      cu_seqlens[b+1])``. Tokens outside ``[cu_seqlens[0], cu_seqlens[B])`` belong to no sequence: their
      output is 0 and lse -inf, and they are never attended.
    softmax_scale: python float or f32 scalar.
    causal: static bool; True: the query at position ``i`` of its sequence (``Lq`` queries, ``Lk`` keys) attends
      key positions ``j <= i + Lk - Lq`` of the same sequence (FlashAttention's bottom-right alignment: the
      queries are the sequence's last ``Lq`` tokens; with ``Lk = Lq``, ``j <= i``); queries with no such key
      get out 0 and lse -inf. False: the whole sequence.
    cu_seqlens_k: optional int32 ``[B + 1]`` non-decreasing, the key tokens ``[cu_seqlens_k[b],
      cu_seqlens_k[b+1])`` of sequence ``b`` in ``k`` / ``v`` (keys outside every sequence are never attended).
      None: the keys are the query tokens (``cu_seqlens_k = cu_seqlens``).
  Non-finite values never leak across sequences or from padding tokens (masked pairs are selected out with
  ``jnp.where``); a non-finite value among a query's own valid ``v`` rows makes that output element NaN (also
  for +-inf, where IEEE arithmetic might give +-inf).
  Returns:
    ``(out bfloat16 [T, H, Dv], lse float32 [T, H])`` (lse: natural log of the softmax denominator of the
    scaled logits). Memory is O(T Tk H) (a reference, not a kernel).
  """
  check_array("q", q, ndim=3, dtypes=_ACT_DTYPES, expect="[T, H, Dqk]")
  t, h, dqk = q.shape
  tk = t if cu_seqlens_k is None else k.shape[0]
  check_array("k", k, shape=(tk, h, dqk), dtypes=_ACT_DTYPES, expect=f"[Tk, H, Dqk] = [{tk}, {h}, {dqk}]")
  check_array("v", v, shape=(tk, h, None), dtypes=_ACT_DTYPES, expect=f"[Tk, H, Dv] = [{tk}, {h}, Dv]")
  check_array("cu_seqlens", cu_seqlens, ndim=1, dtypes=(jnp.int32,), expect="[B + 1]")
  if cu_seqlens.shape[0] < 1:
    raise ValueError("cu_seqlens must have shape [B + 1] with B >= 0; got shape (0,)")
  if cu_seqlens_k is None:
    cu_seqlens_k = cu_seqlens
  check_array("cu_seqlens_k", cu_seqlens_k, shape=cu_seqlens.shape, dtypes=(jnp.int32,),
              expect=f"[B + 1] = {list(cu_seqlens.shape)} (as cu_seqlens)")
  softmax_scale = check_scalar("softmax_scale", softmax_scale)

  def seq_and_pos(cu, n):
    """sequence id (-1: none) and position within it of each of n packed tokens."""
    tok = jnp.arange(n, dtype=jnp.int32)
    seq = jnp.searchsorted(cu, tok, side="right").astype(jnp.int32) - 1
    inside = (tok >= cu[0]) & (tok < cu[-1])
    seq = jnp.where(inside, seq, -1)
    return seq, tok - cu[jnp.clip(seq, 0, cu.shape[0] - 1)]

  seq_q, pos_q = seq_and_pos(cu_seqlens, t)
  seq_k, pos_k = seq_and_pos(cu_seqlens_k, tk)
  valid = (seq_q[:, None] == seq_k[None, :]) & (seq_q[:, None] >= 0)  # [Tq, Tk]
  if causal:
    last = cu_seqlens.shape[0] - 1
    b = jnp.clip(seq_q, 0, max(last - 1, 0))
    len_q = cu_seqlens[jnp.minimum(b + 1, last)] - cu_seqlens[b]                # [Tq]
    len_k = cu_seqlens_k[jnp.minimum(b + 1, last)] - cu_seqlens_k[b]
    # aligned at the end: key position j is visible to query position i when j - Lk <= i - Lq
    valid = valid & (pos_k[None, :] - len_k[:, None] <= (pos_q - len_q)[:, None])
  logits = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), k.astype(jnp.float32), precision=_HI)
  logits = jnp.where(valid[None], logits * softmax_scale, -jnp.inf)
  m = jnp.max(logits, axis=-1, keepdims=True, initial=-jnp.inf)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(valid[None], jnp.exp(logits - m), 0.0)
  denom = jnp.sum(p, axis=-1)  # [H, T]
  # p is 0 for masked pairs, but 0 * NaN = NaN: multiply by finite values only, and make an output NaN where
  # one of its *valid* keys has a non-finite value (so nothing leaks across sequences or from padding).
  v32 = v.astype(jnp.float32)
  v_ok = jnp.isfinite(v32)
  acc = jnp.einsum("hqk,khd->qhd", p, jnp.where(v_ok, v32, 0.0), precision=_HI)
  n_bad = jnp.einsum("qk,khd->qhd", valid.astype(jnp.float32), (~v_ok).astype(jnp.float32), precision=_HI)
  has = (denom > 0).T  # [T, H]
  d = jnp.where(has, denom.T, 1.0)
  out = jnp.where(has[..., None], acc / d[..., None], 0.0)
  out = jnp.where(has[..., None] & (n_bad > 0), jnp.nan, out)
  lse = jnp.where(has, jnp.log(d) + m[..., 0].T, -jnp.inf)
  return out.astype(jnp.bfloat16), lse.astype(jnp.float32)


# ----------------------------------------------------------------------------------------------------------
# rope / rms norm / cache write
# ----------------------------------------------------------------------------------------------------------

def rope_tables(max_pos: int, dim: int = 64, theta: float = 10000.0):
  """Rotary tables ``(cos, sin)``, float32 ``[max_pos, dim // 2]``.

  ``angle[p, i] = p * theta ** (-2 i / dim)``; computed in float64 (numpy) and rounded once to float32, so at
  large positions they are more accurate than tables computed in float32 (as DeepSeek's and HF's code do).
  Plain RoPE only; YaRN tables (DeepSeek-V3 / V3.2 checkpoints) of the same layout come from
  :func:`mla_pallas.rope_scaling.yarn_rope_tables` or :meth:`mla_pallas.config.MLAConfig.rope_tables`.
  """
  max_pos = check_positive_int("max_pos", max_pos)
  dim = check_positive_int("dim", dim)
  if dim % 2:
    raise ValueError(f"dim must be even; got {dim}")
  inv = float(theta) ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
  ang = np.arange(max_pos, dtype=np.float64)[:, None] * inv[None, :]
  return jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)


def _check_rope_args(x, positions, cos, sin, x_name="x"):
  check_array(x_name, x, dtypes=_ACT_DTYPES, expect="[..., D] (D even)")
  if x.ndim < 1 or x.shape[-1] % 2:
    raise ValueError(f"{x_name} must have shape [..., D] with D even; got shape {tuple(x.shape)}")
  half = x.shape[-1] // 2
  check_array("positions", positions, dtypes=(jnp.int32,), expect="a prefix of x.shape[:-1]")
  if positions.ndim > x.ndim - 1 or tuple(positions.shape) != tuple(x.shape[:positions.ndim]):
    raise ValueError(f"positions must have shape equal to a prefix of {x_name}.shape[:-1] = "
                     f"{tuple(x.shape[:-1])}; got shape {tuple(positions.shape)}")
  check_array("cos", cos, shape=(None, half), dtypes=(jnp.float32,), expect=f"[max_pos, {half}]")
  check_array("sin", sin, shape=tuple(cos.shape), dtypes=(jnp.float32,), expect=f"[max_pos, {half}]")


def _rope_f32(x, positions, cos, sin, interleaved):
  """Rotated x in float32 (no validation)."""
  half = x.shape[-1] // 2
  p = jnp.clip(positions, 0, cos.shape[0] - 1)
  c = jnp.take(cos, p, axis=0, mode="clip")  # [*pos, half]
  s = jnp.take(sin, p, axis=0, mode="clip")
  extra = x.ndim - 1 - positions.ndim
  c = c.reshape(c.shape[:-1] + (1,) * extra + (half,))
  s = s.reshape(s.shape[:-1] + (1,) * extra + (half,))
  x = x.astype(jnp.float32)
  if interleaved:
    x0, x1 = x[..., 0::2], x[..., 1::2]
    y0, y1 = x0 * c - x1 * s, x0 * s + x1 * c
    return jnp.stack([y0, y1], axis=-1).reshape(x.shape)
  x0, x1 = x[..., :half], x[..., half:]
  return jnp.concatenate([x0 * c - x1 * s, x1 * c + x0 * s], axis=-1)


def rope(x, positions, cos, sin, *, interleaved=True):
  """Rotary position embedding.

  Args:
    x: ``[..., D]`` bfloat16 or float32, ``D`` even (64 for MLA).
    positions: int32 whose shape is a prefix of ``x.shape[:-1]`` (e.g. ``[T]`` for ``x [T, H, 64]``); it is
      broadcast over the remaining axes. Positions are clamped to ``[0, max_pos)`` before the table lookup.
    cos, sin: float32 ``[max_pos, D // 2]`` (see :func:`rope_tables`).
    interleaved: static bool. True (DeepSeek's official inference code, complex-number form): pair
      ``(x[2i], x[2i+1])`` is rotated by angle ``positions * theta_i``. False (NeoX / HF "rotate_half"): pair
      ``(x[i], x[i + D/2])``.
  Returns:
    rotated ``x``, same shape and dtype; math in float32:
    ``(a, b) -> (a cos - b sin, a sin + b cos)``.
  """
  _check_rope_args(x, positions, cos, sin)
  return _rope_f32(x, positions, cos, sin, interleaved).astype(x.dtype)


def _rms_norm_f32(x, weight, eps):
  x = x.astype(jnp.float32)
  ms = jnp.mean(x * x, axis=-1, keepdims=True)
  return x * jax.lax.rsqrt(ms + eps) * weight.astype(jnp.float32)


def rms_norm(x, weight, eps):
  """RMS norm: ``x * rsqrt(mean(x**2, -1) + eps) * weight``, math in float32.

  Args:
    x: ``[..., N]`` bfloat16 or float32.
    weight: ``[N]`` bfloat16 or float32.
    eps: python float or f32 scalar.
  Returns:
    same shape and dtype as ``x``.
  """
  check_array("x", x, dtypes=_ACT_DTYPES, expect="[..., N]")
  if x.ndim < 1:
    raise ValueError(f"x must have shape [..., N]; got shape {tuple(x.shape)}")
  check_array("weight", weight, shape=(x.shape[-1],), dtypes=_ACT_DTYPES, expect=f"[N] = [{x.shape[-1]}]")
  eps = check_scalar("eps", eps)
  return _rms_norm_f32(x, weight, eps).astype(x.dtype)


def _check_kv_rope(kv, q_rope, positions, cos, sin, norm_weight):
  check_array("kv", kv, shape=(None, D_QK), dtypes=_ACT_DTYPES, expect="[T, 576]")
  t = kv.shape[0]
  check_array("q_rope", q_rope, shape=(t, None, D_ROPE), dtypes=_ACT_DTYPES, expect=f"[T, H, 64] (T = {t})")
  check_array("positions", positions, shape=(t,), dtypes=(jnp.int32,), expect=f"[T] = [{t}]")
  check_array("cos", cos, shape=(None, D_ROPE // 2), dtypes=(jnp.float32,), expect="[max_pos, 32]")
  check_array("sin", sin, shape=tuple(cos.shape), dtypes=(jnp.float32,), expect="[max_pos, 32]")
  check_array("norm_weight", norm_weight, shape=(D_V,), dtypes=_ACT_DTYPES, expect="[512]")


def _kv_rows_f32(kv, positions, cos, sin, norm_weight, eps, interleaved):
  nope = _rms_norm_f32(kv[:, :D_V], norm_weight, eps)
  pe = _rope_f32(kv[:, D_V:], positions, cos, sin, interleaved)
  return jnp.concatenate([nope, pe], axis=-1)


def rope_rmsnorm(kv, q_rope, positions, cos, sin, norm_weight, *, eps, interleaved=True):
  """Unfused MLA pre-cache step: RMS-norm the latent, rotate the rope parts of kv and q.

  Args:
    kv: ``[T, 576]`` bfloat16 (or float32): ``[0, 512)`` compressed latent, ``[512, 576)`` the key's rope
      part.
    q_rope: ``[T, H, 64]`` bfloat16 (or float32): the queries' rope parts.
    positions: int32 ``[T]``.
    cos, sin: float32 ``[max_pos, 32]``.
    norm_weight: ``[512]`` bfloat16/float32 (the kv_a_layernorm weight).
    eps: python float or f32 scalar.
    interleaved: static bool, see :func:`rope`.
  Returns:
    ``(kv_out [T, 576], q_rope_out [T, H, 64])`` in the input dtypes (bfloat16 for bfloat16 inputs):
    ``kv_out = rms_norm(kv[:, :512], norm_weight, eps) ‖ rope(kv[:, 512:], positions)``,
    ``q_rope_out = rope(q_rope, positions)`` (positions broadcast over H). Math in float32.
  """
  _check_kv_rope(kv, q_rope, positions, cos, sin, norm_weight)
  eps = check_scalar("eps", eps)
  rows = _kv_rows_f32(kv, positions, cos, sin, norm_weight, eps, interleaved)
  q_out = _rope_f32(q_rope, positions, cos, sin, interleaved)
  return rows.astype(kv.dtype), q_out.astype(q_rope.dtype)


def rope_rmsnorm_quantize_write(pages, kv, q_rope, positions, cos, sin, norm_weight, *, eps, kv_scale,
                                slots, interleaved=True):
  """Fused MLA cache write: :func:`rope_rmsnorm`, FP8 quantization and a scatter into the cache.

  Args:
    pages: float8_e4m3fn cache ``[num_pages, page_size, 576]`` or flat ``[num_slots, 576]`` (or bfloat16:
      rows stored as ``quant.encode_cache_rows``, rounded, not clipped).
    kv, q_rope, positions, cos, sin, norm_weight, eps, interleaved: as in :func:`rope_rmsnorm`.
    kv_scale: python float or f32 scalar (per-tensor cache scale).
    slots: int32 ``[T]`` flat slot ids. A slot outside ``[0, num_slots)`` (e.g. -1, padding tokens) is
      skipped; every slot not written is left bitwise untouched. Duplicate slots: the last token (highest t)
      wins.
  Returns:
    ``(new_pages, q_rope_out)``: ``new_pages`` same shape/dtype as ``pages`` with
    ``new_pages[slot[t]] = clip(row[t] / kv_scale, -448, 448).astype(fp8)`` where
    ``row = rms_norm(kv[:, :512]) ‖ rope(kv[:, 512:])`` is kept in float32 (not rounded to bf16 first, as a
    fused kernel keeps it in registers); ``q_rope_out`` as in :func:`rope_rmsnorm`.
  """
  check_array("pages", pages, ndim=(2, 3), dtypes=(quant.FP8, jnp.bfloat16),
              expect="[num_pages, page_size, 576] or [num_slots, 576]")
  if pages.shape[-1] != D_QK:
    raise ValueError(f"pages must have shape [num_pages, page_size, 576] or [num_slots, 576]; "
                     f"got shape {tuple(pages.shape)}")
  _check_kv_rope(kv, q_rope, positions, cos, sin, norm_weight)
  t = kv.shape[0]
  check_array("slots", slots, shape=(t,), dtypes=(jnp.int32,), expect=f"[T] = [{t}]")
  eps = check_scalar("eps", eps)
  kv_scale = check_scalar("kv_scale", kv_scale, positive=True)
  rows = _kv_rows_f32(kv, positions, cos, sin, norm_weight, eps, interleaved)
  rows8 = quant.encode_cache_rows(rows, kv_scale, pages.dtype)
  q_out = _rope_f32(q_rope, positions, cos, sin, interleaved).astype(q_rope.dtype)
  flat = pages.reshape(-1, D_QK)
  num_slots = flat.shape[0]
  tt = jnp.arange(t)
  later_dup = jnp.any((slots[None, :] == slots[:, None]) & (tt[None, :] > tt[:, None]), axis=1)
  keep = (slots >= 0) & (slots < num_slots) & ~later_dup  # now every kept slot is unique
  dest = jnp.where(keep, slots, num_slots)  # out of bounds -> dropped
  flat = flat.at[dest].set(rows8, mode="drop", unique_indices=False)
  return flat.reshape(pages.shape), q_out


# ----------------------------------------------------------------------------------------------------------
# FP8 GEMM / weight conversion
# ----------------------------------------------------------------------------------------------------------

def quantize_and_bmm_fp8(a, w, w_scale, *, act_scale="per_token"):
  """Batched (per-head) FP8 GEMM with dynamic activation quantization (MLA's absorbed W_UK / W_UV).

  Args:
    a: ``[T, H, K]`` bfloat16 (or float32) activations.
    w: float8_e4m3fn ``[H, K, N]`` weights.
    w_scale: float32 ``[H, ceil(K/128), ceil(N/128)]`` 128x128 block scales:
      ``deq(w)[h, k, n] = w[h, k, n] * w_scale[h, k // 128, n // 128]``.
    act_scale: static ``"per_token"`` (one scale per ``(t, h)`` row of K values,
      ``max(|row|) / 448``, all-zero rows scale 1) or ``"per_tensor"`` (one scale for all of ``a``).
  Returns:
    bfloat16 ``[T, H, N]``: ``out[t, h] = deq(a8)[t, h] @ deq(w)[h]`` accumulated in float32.
  """
  if act_scale not in ("per_token", "per_tensor"):
    raise ValueError(f"act_scale must be 'per_token' or 'per_tensor'; got {act_scale!r}")
  check_array("a", a, ndim=3, dtypes=_ACT_DTYPES, expect="[T, H, K]")
  _, h, k = a.shape
  check_array("w", w, shape=(h, k, None), dtypes=(quant.FP8,), expect=f"[H, K, N] = [{h}, {k}, N]")
  n = w.shape[2]
  check_array("w_scale", w_scale, shape=(h, -(-k // 128), -(-n // 128)), dtypes=(jnp.float32,),
              expect=f"[H, ceil(K/128), ceil(N/128)] = [{h}, {-(-k // 128)}, {-(-n // 128)}]")
  if act_scale == "per_token":
    a8, s = quant.quantize_rows_fp8(a, axis=-1)
    a_deq = quant.dequantize_fp8(a8, s[..., None])
  else:
    a8, s = quant.quantize_tensor_fp8(a)
    a_deq = quant.dequantize_fp8(a8, s)
  w_deq = quant.dequantize_blocks_fp8(w, w_scale, (128, 128))
  out = jnp.einsum("thk,hkn->thn", a_deq, w_deq, precision=_HI)
  return out.astype(jnp.bfloat16)


def convert_bf16_to_fp8_e4m3fn(w, block=(128, 128)):
  """Block-quantize a weight ``[..., K, N]`` (bfloat16 or float32) to float8_e4m3fn.

  Returns ``(w8 float8_e4m3fn [..., K, N], scales float32 [..., ceil(K/bk), ceil(N/bn)])`` with
  ``scale = max(|block|) / 448`` (all-zero block: 1); partial edge blocks when K or N is not a multiple.
  See :func:`mla_pallas.quant.quantize_blocks_fp8`.
  """
  check_array("w", w, dtypes=_ACT_DTYPES, expect="[..., K, N]")
  return quant.quantize_blocks_fp8(w, block)


def convert_fp8_e4m3fn_to_bf16(w8, scales, block=(128, 128)):
  """Inverse of :func:`convert_bf16_to_fp8_e4m3fn`: bfloat16 ``[..., K, N]`` =
  ``w8[..., k, n] * scales[..., k // bk, n // bn]`` (product in float32, then rounded to bfloat16)."""
  return quant.dequantize_blocks_fp8(w8, scales, block, jnp.bfloat16)
