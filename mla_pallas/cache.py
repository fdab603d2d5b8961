"""Paged FP8 latent KV cache: layout, slot math, quantized writes and FlashMLA V3.2 import/export.

Format
------
One cache row per token, 576 values: ``[0, 512)`` the compressed latent (the "nope" part, also the
value V) followed by ``[512, 576)`` the rope key.

* ``pages``: ``[num_pages, page_size, 576]`` ``float8_e4m3fn``; ``page_size`` is any positive
  multiple of 16 (64 and 128 are the tested ones). The flat view ``[num_slots, 576]`` (``num_slots =
  num_pages * page_size``) is accepted wherever pages are, and :func:`flat_view` is a free reshape.
* One per-tensor ``kv_scale`` (python float or f32 scalar; 1.0 allowed):
  ``dequantized = pages.astype(float32) * kv_scale`` and a row is stored as
  ``clip(row / kv_scale, -448, 448).astype(float8_e4m3fn)`` (round to nearest even), computed by
  :func:`mla_pallas.quant.quantize_fp8` as ``row * f32(1 / kv_scale)`` so every path of the library
  (reference, ops, this module) produces the same bits on every backend.
* Flat slot id: ``slot = page * page_size + offset``; row ``slot`` of the flat view is
  ``pages[slot // page_size, slot % page_size]``. A slot outside ``[0, num_slots)`` (-1 by
  convention) is invalid: reads mask it, :func:`write` skips it.
* ``block_table``: ``[B, max_pages_per_seq]`` int32 page ids; ``cache_seqlens``: ``[B]`` int32.
  Token ``p`` of sequence ``b`` lives at slot ``block_table[b, p // page_size] * page_size +
  p % page_size`` (entries of the block table past the sequence may be anything, e.g. -1).
  Slot ids are int32, so ``num_slots`` must stay below 2**31.

A bf16/f32 cache (``allocate(..., dtype=jnp.bfloat16)``) uses the same layout and the same
``stored = row * f32(1 / kv_scale)`` convention without clipping or FP8 rounding.

FP8 error model (used by the tests): ``e4m3fn`` has 3 mantissa bits, so round-to-nearest moves a
value ``v = x / kv_scale`` with ``2**-6 <= |v| <= 448`` (the normal range) by at most half an ulp,
``2**-4 * |v|``; below ``2**-6`` the spacing is the subnormal step ``2**-9``, an absolute error of
at most ``2**-10``. Hence ``|dequantize(quantize_rows(x, s)) - x| <= 2**-4 * |x| + 2**-10 * s``
for ``|x| <= 448 * s`` (plus float32 rounding of the division and multiplication, ~2**-23 |x|).

FlashMLA DeepSeek-V3.2 FP8 format ("FP8 with scale", 656 bytes per token)
--------------------------------------------------------------------------
FlashMLA's sparse decode kernel reads a ``[num_blocks, page_block_size, 1, 656]`` cache, each token
a contiguous 656-byte record:

==============  =======  =====================================================================
bytes           count    content
==============  =======  =====================================================================
``[0, 512)``    512 x 1  ``float8_e4m3`` (fn) quantized latent ("quantized NoPE") values 0..511
``[512, 516)``  1 x 4    float32 little-endian scale of latent values ``[0, 128)``
``[516, 520)``  1 x 4    float32 scale of latent values ``[128, 256)``
``[520, 524)``  1 x 4    float32 scale of latent values ``[256, 384)``
``[524, 528)``  1 x 4    float32 scale of latent values ``[384, 512)``
``[528, 656)``  64 x 2   bfloat16 little-endian rope values 0..63 (not quantized)
==============  =======  =====================================================================

Dequantized: ``latent[i] = float(fp8[i]) * scale[i // 128]`` and ``rope[j] = float(bf16[j])``;
the row is ``latent ‖ rope`` (576 values), the same row our format stores.

Where this was checked (deepseek-ai/FlashMLA, read through the code index): ``README.md`` ("FP8 KV
Cache" section: 656 bytes, first 512 bytes 512 float8_e4m3 "quantized NoPE" values, next 16 bytes
four float32 scales, the first for the first 128 values and so on, last 128 bytes 64 bfloat16
"RoPE" values, not quantized); the docstring of ``flash_mla_with_kvcache`` in
``flash_mla/flash_mla_interface.py`` (same layout, ``k_cache`` shape ``(num_blocks,
page_block_size, 1, head_dim)``, h_k must be 1); and ``tests/quant.py`` (``FP8KVCacheLayout.
V32_FP8Sparse``: d=576, d_nope=512, d_rope=64, tile 128, 4 tiles; its ``quantize_k_cache`` /
``dequantize_k_cache`` reference). How FlashMLA's reference quantizes a 128-value tile: ``scale =
amax(|tile|) / 448`` rounded *up* to a power of two (``2 ** ceil(log2(max(scale, 1e-4)))``, a
UE8M0-style scale; the 1e-4 floor gives an all-zero tile the scale ``2**-13``), stored as float32,
and ``fp8 = (tile / scale).astype(e4m3fn)``. :func:`to_flashmla_v32` follows that by default
(``power_of_two_scales=True``). The README and ``dequantize_k_cache`` treat the stored float32 as a
plain multiplier (any positive scale decodes there); whether the CUDA kernels rely on power-of-two
values was not checked, so keep the default when exporting for FlashMLA. That reference also allocates ``page_block_size + 1`` tokens per block and
slices, i.e. blocks need not be contiguous in torch; a JAX array is always dense, so export a
contiguous copy (``k_cache.contiguous()``) before handing it over (e.g. through DLPack). A torch
FP8 cache arrives typed ``float8_e4m3fn`` with last dim 656: :func:`from_flashmla_v32` accepts it as
is (it bit-casts to bytes), as well as ``uint8``/``int8``.

Converting FlashMLA -> ours (:func:`from_flashmla_v32`) dequantizes to float32 and requantizes with
one per-tensor scale ``amax / 448`` (over all finite values of the input). This is lossy: on top
of FlashMLA's own quantization each value moves by at most ``2**-4 * |v| + 2**-10 * kv_scale``
(the e4m3 bound above with the new scale), and values with ``|v| < 2**-10 * kv_scale`` flush to
zero, so tiles whose amax is far below the global amax lose relative precision. Rope values (bf16
in FlashMLA) are quantized to FP8 too.

All functions are pure ``jax.numpy`` / ``lax`` and jit-able (shapes are static; validation runs at
trace time and raises ``ValueError`` naming the argument).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax
import numpy as np

from mla_pallas import _checks
from mla_pallas import quant

__all__ = [
    "FP8", "FP8_MAX", "D_QK", "D_V", "D_ROPE", "PAGE_MULTIPLE", "FLASHMLA_V32_BYTES",
    "FLASHMLA_V32_TILE", "allocate", "num_slots", "page_size_of", "flat_view",
    "slots_for_positions", "sequence_slots", "quantize_rows", "dequantize", "choose_scale", "write",
    "from_flashmla_v32", "to_flashmla_v32", "dequantize_flashmla_v32",
]

FP8 = quant.FP8
FP8_MAX = quant.FP8_MAX
D_QK = 576          # cache row width: latent ‖ rope
D_V = 512           # latent width (the value)
D_ROPE = D_QK - D_V  # 64
PAGE_MULTIPLE = _checks.PAGE_MULTIPLE

FLASHMLA_V32_BYTES = 656  # bytes per token of FlashMLA's V3.2 FP8 cache
FLASHMLA_V32_TILE = 128   # latent values per float32 scale
_FM_NUM_TILES = D_V // FLASHMLA_V32_TILE           # 4
_FM_SCALE_OFF = D_V                                # 512
_FM_ROPE_OFF = _FM_SCALE_OFF + 4 * _FM_NUM_TILES   # 528
# amax / 448 is computed as amax * float32(1/448) (within 1 ulp of the quotient), as in quant.py:
# XLA rewrites a division by a constant into that product under jit, so eager and jit agree bitwise.
_INV_FP8_MAX = np.float32(1.0 / FP8_MAX)
_FM_SCALE_FLOOR = 1e-4  # FlashMLA tests/quant.py clamps the scale below at 1e-4 before rounding

_CACHE_DTYPES = (FP8, jnp.bfloat16, jnp.float32)
_ROW_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, FP8)
_FLOAT_ROW_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


# ---- shape helpers ------------------------------------------------------------------------------

def _check_pages(name, pages, dtypes=_CACHE_DTYPES):
  _checks.check_array(name, pages, ndim=(2, 3), dtypes=dtypes,
                      expect="[num_pages, page_size, 576] or [num_slots, 576]")
  if pages.shape[-1] != D_QK:
    raise ValueError(f"{name} must have shape [num_pages, page_size, 576] or [num_slots, 576]; "
                     f"got shape {tuple(pages.shape)} {np.dtype(pages.dtype).name}")
  if pages.ndim == 3:
    _check_page_size(f"{name}.shape[1] (page_size)", pages.shape[1])


_check_page_size = _checks.check_page_size   # one page-size rule (16-token multiples) for cache, config and ops


def _check_int_array(name, x, *, ndim=None, expect=None):
  _checks.check_array(name, x, ndim=ndim, expect=expect)
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must have an integer dtype (int32){' and shape ' + expect if expect else ''}"
                     f"; got shape {tuple(x.shape)} {np.dtype(x.dtype).name}")


def num_slots(pages) -> int:
  """Number of token slots: ``num_pages * page_size`` (paged) or ``num_slots`` (flat)."""
  _check_pages("pages", pages)
  return int(np.prod(pages.shape[:-1]))


def page_size_of(pages) -> int | None:
  """``page_size`` of a paged cache; ``None`` for a flat ``[num_slots, 576]`` cache."""
  _check_pages("pages", pages)
  return int(pages.shape[1]) if pages.ndim == 3 else None


def allocate(num_pages: int, page_size: int, *, dtype=FP8) -> jax.Array:
  """A zero-filled cache ``[num_pages, page_size, 576]`` of ``dtype`` (float8_e4m3fn by default;
  bfloat16 and float32 are also allowed). ``page_size``: positive multiple of 16."""
  num_pages = _checks.check_positive_int("num_pages", num_pages)
  page_size = _check_page_size("page_size", page_size)
  names = [np.dtype(d).name for d in _CACHE_DTYPES]
  try:
    dname = np.dtype(dtype).name
  except TypeError:
    dname = None
  if dname not in names:
    raise ValueError(f"dtype must be one of {'/'.join(names)}; got {dtype!r}")
  return jnp.zeros((num_pages, page_size, D_QK), dtype)


def flat_view(pages) -> jax.Array:
  """``pages`` as ``[num_slots, 576]`` (row ``page * page_size + offset``); free reshape."""
  _check_pages("pages", pages)
  return pages.reshape(-1, D_QK)


# ---- slot math ----------------------------------------------------------------------------------

def slots_for_positions(block_table, positions, page_size: int, *, cache_seqlens=None) -> jax.Array:
  """Flat slot ids of token positions of each sequence (logical position -> physical slot).

  Args:
    block_table: ``[B, max_pages_per_seq]`` int page ids.
    positions: ``[B, ...]`` int token positions within sequence ``b`` (e.g. ``[B]`` the next write
      position, ``[B, topk]`` indexer top-k positions, ``[B, s_q, topk]``).
    page_size: positive multiple of 16.
    cache_seqlens: optional ``[B]`` int; positions ``>= cache_seqlens[b]`` then map to -1.

  Returns:
    int32, shape of ``positions``: ``block_table[b, p // page_size] * page_size + p % page_size``;
    -1 where ``p < 0``, ``p // page_size >= max_pages_per_seq``, the block-table entry is negative,
    or (with ``cache_seqlens``) ``p >= cache_seqlens[b]``.
  """
  page_size = _check_page_size("page_size", page_size)
  _check_int_array("block_table", block_table, ndim=2, expect="[B, max_pages_per_seq]")
  _check_int_array("positions", positions, expect="[B, ...]")
  b, max_pages = block_table.shape
  if positions.ndim < 1 or positions.shape[0] != b:
    raise ValueError(f"positions must have shape [B, ...] with B={b} (block_table.shape[0]); "
                     f"got shape {tuple(positions.shape)}")
  if cache_seqlens is not None:
    _check_int_array("cache_seqlens", cache_seqlens, ndim=1, expect=f"[B] with B={b}")
    if cache_seqlens.shape[0] != b:
      raise ValueError(f"cache_seqlens must have shape [B] with B={b}; got shape "
                       f"{tuple(cache_seqlens.shape)}")
  bt = block_table.astype(jnp.int32)
  pos = positions.astype(jnp.int32)
  flat_pos = pos.reshape(b, -1)
  page_idx = flat_pos // page_size
  valid = (flat_pos >= 0) & (page_idx < max_pages)
  page = jnp.take_along_axis(bt, jnp.clip(page_idx, 0, max_pages - 1), axis=1)
  valid &= page >= 0
  if cache_seqlens is not None:
    valid &= flat_pos < cache_seqlens.astype(jnp.int32)[:, None]
  slots = jnp.where(valid, page * page_size + flat_pos % page_size, -1)
  return slots.reshape(pos.shape).astype(jnp.int32)


def sequence_slots(block_table, cache_seqlens, max_len: int, page_size: int) -> jax.Array:
  """Slots of positions ``0 .. max_len-1`` of every sequence: ``[B, max_len]`` int32.

  Entry ``[b, p]`` is the slot of token ``p`` of sequence ``b`` (see :func:`slots_for_positions`)
  and -1 for ``p >= cache_seqlens[b]`` or past the block table. ``max_len`` is static.
  """
  max_len = _checks.check_positive_int("max_len", max_len)
  _check_int_array("block_table", block_table, ndim=2, expect="[B, max_pages_per_seq]")
  b = block_table.shape[0]
  positions = jnp.broadcast_to(jnp.arange(max_len, dtype=jnp.int32), (b, max_len))
  return slots_for_positions(block_table, positions, page_size, cache_seqlens=cache_seqlens)


# ---- quantization -------------------------------------------------------------------------------

def _scale_arg(name, kv_scale):
  return _checks.check_scalar(name, kv_scale, positive=True)


def _quantize(x, scale):
  # x * f32(1/scale), clipped to the finite e4m3 range, round-to-nearest-even; NaN stays NaN.
  return quant.quantize_fp8(x, scale)


def quantize_rows(rows, kv_scale=1.0) -> jax.Array:
  """``clip(rows / kv_scale, -448, 448).astype(float8_e4m3fn)``; ``rows`` ``[..., 576]``
  bfloat16/float16/float32; returns the same shape in float8_e4m3fn."""
  _checks.check_array("rows", rows, dtypes=_FLOAT_ROW_DTYPES, expect="[..., 576]")
  if rows.ndim < 1 or rows.shape[-1] != D_QK:
    raise ValueError(f"rows must have shape [..., 576]; got shape {tuple(rows.shape)}")
  return _quantize(rows, _scale_arg("kv_scale", kv_scale))


def dequantize(pages, kv_scale=1.0) -> jax.Array:
  """``pages.astype(float32) * kv_scale``; ``pages`` ``[..., 576]`` (any cache dtype)."""
  _checks.check_array("pages", pages, dtypes=_ROW_DTYPES, expect="[..., 576]")
  if pages.ndim < 1 or pages.shape[-1] != D_QK:
    raise ValueError(f"pages must have shape [..., 576]; got shape {tuple(pages.shape)}")
  return pages.astype(jnp.float32) * _scale_arg("kv_scale", kv_scale)


def choose_scale(rows) -> jax.Array:
  """Per-tensor scale ``amax / 448`` (float32 scalar) over the finite values of ``rows``; 1.0 when
  there is no nonzero finite value. NaN/inf (e.g. poisoned unused rows) are ignored. Computed as
  ``amax * float32(1/448)`` (within 1 ulp of the quotient; identical eager and under jit)."""
  _checks.check_array("rows", rows, dtypes=_ROW_DTYPES)
  a = jnp.abs(rows.astype(jnp.float32))
  amax = jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), initial=0.0)
  return quant.amax_to_scale(amax)


# ---- writes -------------------------------------------------------------------------------------

def _last_occurrence(slots, n):
  """Bool [T]: True for valid slots that no later entry writes again (last write wins)."""
  t = slots.shape[0]
  order = jnp.argsort(slots, stable=True)     # equal slots keep their original (time) order
  s = slots[order]
  last_sorted = jnp.concatenate([s[:-1] != s[1:], jnp.ones((min(t, 1),), bool)])
  is_last = jnp.zeros((t,), bool).at[order].set(last_sorted)
  return is_last & (slots >= 0) & (slots < n)


def _write_impl(pages, slots, rows, kv_scale):
  shape = pages.shape
  flat = pages.reshape(-1, D_QK)
  n = flat.shape[0]
  vals = rows if rows.dtype == pages.dtype else quant.encode_cache_rows(rows, kv_scale, pages.dtype)
  slots = slots.astype(jnp.int32)
  keep = _last_occurrence(slots, n)
  # Invalid and overwritten entries point one past the end; mode="drop" discards them.
  idx = jnp.where(keep, slots, n)
  flat = flat.at[idx].set(vals, mode="drop")
  return flat.reshape(shape)


_write_jit = jax.jit(_write_impl, donate_argnums=0)


def write(pages, slots, rows, *, kv_scale=1.0) -> jax.Array:
  """Write ``rows`` at flat ``slots`` of the cache; returns the new pages.

  Args:
    pages: ``[num_pages, page_size, 576]`` (page_size a positive multiple of 16) or
      ``[num_slots, 576]``, float8_e4m3fn (or bfloat16/float32). **Donated**: the call runs under
      ``jax.jit(..., donate_argnums=0)`` so XLA updates the buffer in place; do not use ``pages``
      after the call (on backends that honour donation it is deleted).
    slots: ``[T]`` int flat slot ids ``page * page_size + offset``. A slot outside
      ``[0, num_slots)`` (e.g. -1) is skipped. Duplicate slots: the last write (largest t) wins.
    rows: ``[T, 576]``. bfloat16/float16/float32 rows are quantized here as
      ``clip(row / kv_scale, -448, 448).astype(float8_e4m3fn)``; float8_e4m3fn rows are taken as
      already quantized and written bit for bit (``kv_scale`` is not applied to them).
    kv_scale: the cache's per-tensor scale (python float or f32 scalar).

  Every slot not written keeps its bits, NaN included. Jit-able (inside an outer jit the donation
  is up to the outer jit).
  """
  _check_pages("pages", pages)
  _check_int_array("slots", slots, ndim=1, expect="[T]")
  t = slots.shape[0]
  _checks.check_array("rows", rows, ndim=2, shape=(t, D_QK), dtypes=_ROW_DTYPES,
                      expect=f"[T, 576] with T={t} (len(slots))")
  if rows.dtype == FP8 and pages.dtype != FP8:
    raise ValueError(f"rows of dtype float8_e4m3fn can only be written into a float8_e4m3fn cache; "
                     f"pages has dtype {np.dtype(pages.dtype).name}")
  kv_scale = _scale_arg("kv_scale", kv_scale)
  return _write_jit(pages, slots, rows, kv_scale)


# ---- FlashMLA DeepSeek-V3.2 656-byte format -----------------------------------------------------

def _as_bytes(name, packed):
  _checks.check_array(name, packed, dtypes=(jnp.uint8, jnp.int8, FP8),
                      expect="[num_pages, page_size, 656] or [num_slots, 656]")
  if packed.ndim == 4 and packed.shape[2] == 1:   # FlashMLA's [num_blocks, block_size, h_k=1, 656]
    packed = packed[:, :, 0]
  if packed.ndim not in (2, 3) or packed.shape[-1] != FLASHMLA_V32_BYTES:
    raise ValueError(f"{name} must have shape [num_pages, page_size, 656] (or FlashMLA's "
                     f"[num_pages, page_size, 1, 656]) or [num_slots, 656]; got shape "
                     f"{tuple(packed.shape)} {np.dtype(packed.dtype).name}")
  if packed.ndim == 3:
    _check_page_size(f"{name}.shape[1] (page_size)", packed.shape[1])
  if packed.dtype != jnp.uint8:
    packed = lax.bitcast_convert_type(packed, jnp.uint8)
  return packed


def _unpack_v32(packed):
  """uint8 [..., 656] -> (fp8 latent [..., 512], f32 scales [..., 4], bf16 rope [..., 64])."""
  lead = packed.shape[:-1]
  latent = lax.bitcast_convert_type(packed[..., :D_V], FP8)
  scales = lax.bitcast_convert_type(
      packed[..., _FM_SCALE_OFF:_FM_ROPE_OFF].reshape(*lead, _FM_NUM_TILES, 4), jnp.float32)
  rope = lax.bitcast_convert_type(
      packed[..., _FM_ROPE_OFF:].reshape(*lead, D_ROPE, 2), jnp.bfloat16)
  return latent, scales, rope


def dequantize_flashmla_v32(packed) -> jax.Array:
  """FlashMLA V3.2 656-byte records ``[..., 656]`` (uint8/int8/float8_e4m3fn; paged or flat) ->
  float32 rows ``[..., 576]``: ``fp8[i] * scale[i // 128]`` ‖ ``float(bf16 rope)``. Exact up to
  the float32 rounding of the product."""
  latent, scales, rope = _unpack_v32(_as_bytes("packed", packed))
  lead = latent.shape[:-1]
  lat = (latent.astype(jnp.float32).reshape(*lead, _FM_NUM_TILES, FLASHMLA_V32_TILE)
         * scales[..., None]).reshape(*lead, D_V)
  return jnp.concatenate([lat, rope.astype(jnp.float32)], axis=-1)


def from_flashmla_v32(packed, *, kv_scale=None, dtype=FP8) -> tuple[jax.Array, jax.Array]:
  """Convert a FlashMLA DeepSeek-V3.2 FP8 cache (656 bytes/token) to this library's format, FP8 or bfloat16.

  Args:
    packed: ``[num_pages, page_size, 656]`` (also FlashMLA's ``[num_pages, page_size, 1, 656]``)
      or ``[num_slots, 656]``; uint8, int8 or float8_e4m3fn (bytes are reinterpreted). Layout in
      the module docstring.
    kv_scale: optional per-tensor scale to requantize with. Default: for float8_e4m3fn :func:`choose_scale`
      of the dequantized values (``amax / 448`` over finite values; pass one when unused slots hold garbage
      that would otherwise inflate the amax), for bfloat16 1.
    dtype: the cache dtype, float8_e4m3fn (default, 576 B per token) or bfloat16 (1152 B per token).

  Returns:
    ``(pages, kv_scale)``: pages ``[num_pages, page_size, 576]`` (or ``[num_slots, 576]``) of ``dtype`` with
    ``pages * kv_scale ~= dequantize_flashmla_v32(packed)`` and kv_scale a float32 scalar. float8_e4m3fn is
    lossy: each value moves by at most ``2**-4 * |v| + 2**-10 * kv_scale`` more (the rope part, bf16 in
    FlashMLA, is now FP8 as well). bfloat16 with kv_scale 1 is exact where FlashMLA's tile scales are powers of
    two (as its own quantizer makes them: an e4m3 value times a power of two is a bf16 value; the rope part is
    bf16 already); other scales round once to bf16.
  """
  if jnp.dtype(dtype) not in (jnp.dtype(FP8), jnp.dtype(jnp.bfloat16)):
    raise ValueError(f"dtype must be float8_e4m3fn or bfloat16; got {dtype!r}")
  deq = dequantize_flashmla_v32(packed)
  if kv_scale is None:
    scale = choose_scale(deq) if jnp.dtype(dtype) == FP8 else jnp.float32(1.0)
  else:
    scale = jnp.asarray(_scale_arg("kv_scale", kv_scale), jnp.float32)
  return quant.encode_cache_rows(deq, scale, dtype), scale


def _pow2_ceil(s):
  """Smallest power of two >= s for s > 0 (exact, via frexp: s = m * 2**e, m in [0.5, 1))."""
  m, e = jnp.frexp(s)
  e = jnp.where(m == 0.5, e - 1, e)
  return jnp.ldexp(jnp.ones_like(s), e)


def to_flashmla_v32(rows, *, power_of_two_scales: bool = True) -> jax.Array:
  """Pack float rows ``[..., 576]`` into FlashMLA's DeepSeek-V3.2 656-byte records (uint8).

  Per 128-value latent tile: ``scale = amax(|tile|) / 448``; with ``power_of_two_scales`` (the
  default, as FlashMLA's ``tests/quant.py`` does) it is first floored at 1e-4 and then rounded up to
  a power of two; otherwise an all-zero tile gets scale 1. ``fp8 = clip(tile / scale, -448,
  448).astype(e4m3fn)`` (computed as ``tile * f32(1 / scale)``, exact for power-of-two scales).
  The rope part is cast to bfloat16. Accepts pages (e.g. ``dequantize(pages, kv_scale)``) or flat
  rows (float32/bfloat16/float16/float8_e4m3fn); returns ``[..., 656]`` uint8 (byte layout in the module docstring;
  little-endian, as on every JAX platform). To hand it to FlashMLA, view the bytes as torch's
  float8_e4m3fn and add the ``h_k = 1`` axis: ``[num_pages, page_size, 1, 656]``.
  """
  _checks.check_array("rows", rows, dtypes=_ROW_DTYPES, expect="[..., 576]")
  if rows.ndim < 1 or rows.shape[-1] != D_QK:
    raise ValueError(f"rows must have shape [..., 576]; got shape {tuple(rows.shape)}")
  lead = rows.shape[:-1]
  x = rows.astype(jnp.float32)
  tiles = x[..., :D_V].reshape(*lead, _FM_NUM_TILES, FLASHMLA_V32_TILE)
  amax = jnp.max(jnp.abs(tiles), axis=-1)
  if power_of_two_scales:
    scales = _pow2_ceil(jnp.maximum(amax * _INV_FP8_MAX, _FM_SCALE_FLOOR))
  else:
    scales = jnp.where(amax > 0, amax * _INV_FP8_MAX, 1.0)
  scales = scales.astype(jnp.float32)
  # power-of-two scales: the reciprocal is exact, so this equals FlashMLA's tile / scale bitwise
  q = _quantize(tiles, scales[..., None]).reshape(*lead, D_V)
  parts = [
      lax.bitcast_convert_type(q, jnp.uint8),
      lax.bitcast_convert_type(scales, jnp.uint8).reshape(*lead, 4 * _FM_NUM_TILES),
      lax.bitcast_convert_type(x[..., D_V:].astype(jnp.bfloat16), jnp.uint8).reshape(*lead, 2 * D_ROPE),
  ]
  return jnp.concatenate(parts, axis=-1)
