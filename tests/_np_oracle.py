"""Independent float64 NumPy oracle for every formula in ``mla_pallas.reference`` and ``mla_pallas.quant``.

Written from the contract (``spec``), not from the jnp code: explicit Python loops over rows/heads and plain
float64 NumPy, a hand-written e4m3fn codec (bit decoding and round-to-nearest-even) instead of ``astype``.
Inputs may be jax or numpy arrays; outputs are float64 numpy arrays (uint8 bit patterns for fp8 writes).
"""
from __future__ import annotations

import math

import numpy as np

FP8_MAX = 448.0


# ------------------------------------------------------------------------------------------------------------
# conversions
# ------------------------------------------------------------------------------------------------------------

def f64(x) -> np.ndarray:
  """Any jax/numpy float array (bf16, f32, f16, ...) -> float64 numpy (exact for those dtypes)."""
  a = np.asarray(x)
  if "float8" in str(a.dtype):
    return e4m3_decode(a.view(np.uint8))
  return np.asarray(a.astype(np.float32) if a.dtype != np.float64 else a, dtype=np.float64)


def _decode_one(b: int) -> float:
  sign = -1.0 if b & 0x80 else 1.0
  e = (b >> 3) & 0xF
  m = b & 0x7
  if e == 0xF and m == 0x7:
    return math.nan
  if e == 0:
    return sign * m * 2.0 ** -9  # subnormal: 0.mmm * 2^-6
  return sign * (1.0 + m / 8.0) * 2.0 ** (e - 7)


_E4M3_TABLE = np.array([_decode_one(b) for b in range(256)], np.float64)


def e4m3_decode(bits) -> np.ndarray:
  """uint8 bit patterns of float8_e4m3fn -> float64 values (bias 7, no inf, S.1111.111 = NaN)."""
  return _E4M3_TABLE[np.asarray(bits, dtype=np.uint8)]


def fp8_bits(x8) -> np.ndarray:
  """float8_e4m3fn jax/numpy array -> its uint8 bit patterns."""
  return np.asarray(x8).view(np.uint8)


def e4m3_round(x) -> np.ndarray:
  """float64 -> nearest float8_e4m3fn value (ties to even), saturating to +-448; NaN stays NaN.

  |x| = m * 2^e2 with m in [0.5, 1) (frexp, exact), so the binade exponent is e2 - 1; below 2^-6 the grid
  is the subnormal one. The grid step of the binade is 2^(exponent - 3); np.rint rounds half to even.
  """
  x = np.asarray(x, np.float64)
  a = np.minimum(np.abs(x), FP8_MAX)
  _, e2 = np.frexp(a)
  step = np.exp2(np.maximum(e2 - 1, -6) - 3.0)
  r = np.minimum(np.rint(a / step) * step, FP8_MAX)
  return np.where(np.isnan(x), np.nan, np.copysign(r, x))


def quantize(x, scale) -> np.ndarray:
  """Value of clip(x / scale, +-448) rounded to e4m3 (float64). The quotient is formed in float32 exactly as
  mla_pallas.quant pins it down: x.astype(f32) * f32(1 / scale) (reciprocal rounded once to f32), so the
  values agree bitwise with a correct implementation."""
  inv = np.float32(1.0) / np.asarray(scale, np.float32)  # IEEE f32 reciprocal
  q = f64(x).astype(np.float32) * inv  # IEEE f32 product
  return e4m3_round(np.clip(q.astype(np.float64), -FP8_MAX, FP8_MAX))


def scale_of(vals) -> np.float32:
  """Dynamic scale of a group: float32(amax) * float32(1/448) (the pinned-down amax/448), 1.0 if all zero."""
  amax = np.float32(np.max(np.abs(f64(vals)))) if np.size(vals) else np.float32(0)
  s = np.float32(amax * np.float32(1.0 / 448.0))
  return np.float32(1.0) if s == 0 else s


def quantize_rows(x):
  """Per-row (last axis) dynamic quantization -> (values float64 on the e4m3 grid, scales float32)."""
  x = f64(x)
  vals = np.empty(x.shape, np.float64)
  scales = np.empty(x.shape[:-1], np.float32)
  for idx in np.ndindex(*x.shape[:-1]):
    s = scale_of(x[idx])
    scales[idx] = s
    vals[idx] = quantize(x[idx], s)
  return vals, scales


def quantize_tensor(x):
  s = scale_of(x)
  return quantize(x, s), s


def quantize_blocks(w, block=(128, 128)):
  """Block dynamic quantization of [..., K, N] with partial edge blocks -> (values, scales float32)."""
  w = f64(w)
  bk, bn = block
  k, n = w.shape[-2:]
  kb, nb = -(-k // bk), -(-n // bn)
  vals = np.empty(w.shape, np.float64)
  scales = np.empty(w.shape[:-2] + (kb, nb), np.float32)
  for lead in np.ndindex(*w.shape[:-2]):
    for i in range(kb):
      for j in range(nb):
        blk = w[lead + (slice(i * bk, (i + 1) * bk), slice(j * bn, (j + 1) * bn))]
        s = scale_of(blk)
        scales[lead + (i, j)] = s
        vals[lead + (slice(i * bk, (i + 1) * bk), slice(j * bn, (j + 1) * bn))] = quantize(blk, s)
  return vals, scales


def dequantize_blocks(w8, scales, block=(128, 128)):
  w = f64(w8)
  s = np.asarray(scales, np.float64)
  bk, bn = block
  out = np.empty(w.shape, np.float64)
  for idx in np.ndindex(*w.shape):
    lead, k, n = idx[:-2], idx[-2], idx[-1]
    out[idx] = w[idx] * s[lead + (k // bk, n // bn)]
  return out


# ------------------------------------------------------------------------------------------------------------
# attention
# ------------------------------------------------------------------------------------------------------------

def _softmax_row(logits, values):
  """logits [n], values [n, Dv] (only the valid keys) -> (out [Dv], lse); empty -> (0, -inf)."""
  if len(logits) == 0:
    return np.zeros(values.shape[-1]), -np.inf
  m = np.max(logits)
  w = np.exp(logits - m)
  z = w.sum()
  return (w[:, None] * values).sum(0) / z, m + np.log(z)


def sparse_decode(q, cache, indices, softmax_scale, kv_scale=1.0, topk_length=None, dv=512):
  """q [B, s_q, H, D], cache [num_slots, D] or [P, page, D], indices [B, s_q, topk]."""
  q = f64(q)
  flat = f64(cache).reshape(-1, q.shape[-1]) * float(kv_scale)
  idx = np.asarray(indices)
  b_, s_, h_, _ = q.shape
  num_slots = flat.shape[0]
  out = np.zeros((b_, s_, h_, dv))
  lse = np.full((b_, s_, h_), -np.inf)
  for b in range(b_):
    for s in range(s_):
      keys = []
      for j, slot in enumerate(idx[b, s]):
        if topk_length is not None and j >= int(np.asarray(topk_length)[b]):
          break
        if 0 <= int(slot) < num_slots:
          keys.append(flat[int(slot)])
      kmat = np.array(keys).reshape(len(keys), q.shape[-1])
      for h in range(h_):
        logits = softmax_scale * (kmat @ q[b, s, h])
        out[b, s, h], lse[b, s, h] = _softmax_row(logits, kmat[:, :dv])
  return out, lse


def dense_decode(q, pages, block_table, cache_seqlens, softmax_scale, kv_scale=1.0, causal=False, dv=512):
  """q [B, s_q, H, D], pages [P, page, D], block_table [B, maxp], cache_seqlens [B]."""
  q = f64(q)
  pg = f64(pages) * float(kv_scale)
  page_size = pg.shape[1]
  bt = np.asarray(block_table)
  sl = np.asarray(cache_seqlens)
  b_, s_, h_, _ = q.shape
  out = np.zeros((b_, s_, h_, dv))
  lse = np.full((b_, s_, h_), -np.inf)
  for b in range(b_):
    n = min(int(sl[b]), bt.shape[1] * page_size)
    for i in range(s_):
      last = n if not causal else min(n, int(sl[b]) - s_ + i + 1)
      keys = []
      for p in range(max(last, 0)):
        page = int(bt[b, p // page_size])
        if 0 <= page < pg.shape[0]:
          keys.append(pg[page, p % page_size])
      kmat = np.array(keys).reshape(len(keys), q.shape[-1])
      for h in range(h_):
        out[b, i, h], lse[b, i, h] = _softmax_row(softmax_scale * (kmat @ q[b, i, h]), kmat[:, :dv])
  return out, lse


def varlen_attention(q, k, v, cu_seqlens, softmax_scale, causal=True, cu_seqlens_k=None):
  """q [T, H, Dqk], k [Tk, H, Dqk], v [Tk, H, Dv]; per sequence attention; tokens outside every sequence ->
  0 / -inf. With ``cu_seqlens_k`` the keys of sequence b are its own rows of k / v and causal is bottom-right:
  its last query sees every key, its query i sees keys up to i + Lk - Lq (none when that is negative)."""
  q, k, v = f64(q), f64(k), f64(v)
  t, h_, _ = q.shape
  out = np.zeros((t, h_, v.shape[-1]))
  lse = np.full((t, h_), -np.inf)
  cu = [int(c) for c in np.asarray(cu_seqlens)]
  cuk = cu if cu_seqlens_k is None else [int(c) for c in np.asarray(cu_seqlens_k)]
  for b in range(len(cu) - 1):
    start, end = cu[b], cu[b + 1]
    k0, k1 = cuk[b], cuk[b + 1]
    for i in range(start, end):
      stop = k0 + (i - start) + (k1 - k0) - (end - start) + 1 if causal else k1
      if stop <= k0:
        continue                                     # no key: out 0, lse -inf
      for h in range(h_):
        logits = softmax_scale * (k[k0:stop, h] @ q[i, h])
        out[i, h], lse[i, h] = _softmax_row(logits, v[k0:stop, h])
  return out, lse


# ------------------------------------------------------------------------------------------------------------
# rope / norm / cache write
# ------------------------------------------------------------------------------------------------------------

def rope_tables(max_pos, dim=64, theta=10000.0):
  cos = np.empty((max_pos, dim // 2))
  sin = np.empty((max_pos, dim // 2))
  for p in range(max_pos):
    for i in range(dim // 2):
      ang = p / theta ** (2 * i / dim)
      cos[p, i], sin[p, i] = math.cos(ang), math.sin(ang)
  return cos, sin


def rope_interleaved_complex(x, positions, cos, sin):
  """DeepSeek's form: view consecutive pairs as complex numbers and multiply by e^{i angle}."""
  x = f64(x)
  c, s = f64(cos), f64(sin)
  pos = np.asarray(positions)
  out = np.empty_like(x)
  for idx in np.ndindex(*x.shape[:-1]):
    p = int(pos[idx[:pos.ndim]])
    z = x[idx][0::2] + 1j * x[idx][1::2]
    r = z * (c[p] + 1j * s[p])
    out[idx][0::2] = r.real
    out[idx][1::2] = r.imag
  return out


def rope_half_split(x, positions, cos, sin):
  """NeoX / HF form: out = x * cos_full + rotate_half(x) * sin_full, loops over pairs (i, i + D/2)."""
  x = f64(x)
  c, s = f64(cos), f64(sin)
  pos = np.asarray(positions)
  half = x.shape[-1] // 2
  out = np.empty_like(x)
  for idx in np.ndindex(*x.shape[:-1]):
    p = int(pos[idx[:pos.ndim]])
    for i in range(half):
      a, b = x[idx + (i,)], x[idx + (i + half,)]
      out[idx + (i,)] = a * c[p, i] - b * s[p, i]
      out[idx + (i + half,)] = b * c[p, i] + a * s[p, i]
  return out


def rope(x, positions, cos, sin, interleaved=True):
  return (rope_interleaved_complex if interleaved else rope_half_split)(x, positions, cos, sin)


def rms_norm(x, weight, eps):
  x = f64(x)
  w = f64(weight)
  out = np.empty_like(x)
  for idx in np.ndindex(*x.shape[:-1]):
    row = x[idx]
    out[idx] = row / math.sqrt(float(np.mean(row ** 2)) + eps) * w
  return out


def rope_rmsnorm(kv, q_rope, positions, cos, sin, norm_weight, eps, interleaved=True):
  kv = f64(kv)
  rows = np.concatenate([rms_norm(kv[:, :512], norm_weight, eps),
                         rope(kv[:, 512:], positions, cos, sin, interleaved)], axis=-1)
  return rows, rope(q_rope, positions, cos, sin, interleaved)


def e4m3_encode(vals) -> np.ndarray:
  """float64 values already on the e4m3 grid -> uint8 bit patterns (NaN -> 0x7f / 0xff)."""
  vals = np.asarray(vals, np.float64)
  pos = _E4M3_TABLE[:0x7F]  # codes 0x00..0x7e: the non-negative finite values, increasing
  a = np.where(np.isnan(vals), 0.0, np.abs(vals))
  code = np.searchsorted(pos, a)
  code = np.minimum(code, 0x7E)
  if not np.all(pos[code] == a):
    raise ValueError("e4m3_encode: value not on the e4m3 grid")
  code = np.where(np.isnan(vals), 0x7F, code)
  return (code | np.where(np.signbit(vals), 0x80, 0)).astype(np.uint8)
