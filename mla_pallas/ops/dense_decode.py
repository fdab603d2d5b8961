"""Dense MLA decode attention over a paged FP8 latent cache: ``dense_mla_decode``.

Semantics are those of :func:`mla_pallas.reference.dense_mla_decode`; the implementations differ only in where
FP8 rounding happens (error model: :func:`mla_pallas.testing.fp8_error_budget`).

* ``impl="mosaic"``, two routes (:func:`mosaic_route`):
  - "dense": the dense kernel (``kernels/dense_sm90.py``; sm_90, an fp8 or bf16 cache, H in DENSE_KERNEL_HEADS, a
    page size that is a multiple of 64): the sparse kernels' attention cores (over fp8 heads on N for H <= 16, on
    M above; over bf16 heads on M at every H, "producer_vt" with bf16 MMAs) over
    whole 64-key tiles of the sequence's pages (copied by the loader warpgroup's threads, rows past the limit
    zero-filled), each CTA running only the tiles below its token's limit. Its inputs are a per-(token, split)
    table (:func:`dense_tile_table`) of each tile's first cache slot and the split's tile
    counts, made by a few fused XLA ops.
  - "sparse": the sparse top-k kernel. The block table and the cache lengths are turned into per-token flat slot
    ids ``indices [B, s_q, P * page_size]`` (position ``p`` of sequence ``b`` ->
    ``block_table[b, p // page_size] * page_size + p % page_size``; ``-1`` for positions past the sequence, past
    the token's causal limit, or whose page id is outside ``[0, num_pages)``) and handed to the sparse op's
    kernel (:mod:`mla_pallas.ops.sparse_decode`, its default config), which gathers the rows of every 64-key tile
    like any top-k; its key count is the whole block table (``P * page_size``), whatever the lengths are.
  In both, Q is quantized to e4m3 per (token, head) row and QKᵀ runs on FP8 tensor cores; on sm_90 P·V is f16 (P
  kept in f16, the e4m3 V upcast exactly), f32 accumulation throughout (the sparse op's docstring has the sm_100
  variant). Size the block table to the longest sequence of the batch (it sets the split plan).
* ``impl="xla"``: Q and P quantized to e4m3 (P as fp8(256 p)) with FP8 ``dot_general``s in XLA, as a
  flash-style scan over chunks of pages (online softmax), so at most ~256 MiB of logits and gathered fp8 rows
  (one chunk) are live at a time, never a ``[B, s_q, H, P * page_size]`` tensor for long contexts.

Shapes and index rules:
  q [B, s_q, H, 576] bfloat16/float32 (absorbed query: latent [0, 512) ‖ rope [512, 576)); the s_q query tokens
  are the last s_q tokens of each sequence (MTP).
  kv_cache [num_pages, page_size, 576] float8_e4m3fn, or bfloat16 for BF16 attention (on sm_90 the dense kernel's
  bf16 form or the sparse op's bf16-cache kernel, the XLA path elsewhere); paged only
  (the block table needs the page size);
  dequantized row = fp8 · kv_scale; the value of a row is its first 512 entries.
  block_table [B, P] int32 page ids; entries past the sequence may be anything (e.g. -1); page ids outside
  [0, num_pages) are masked (never read).
  cache_seqlens [B] int32: sequence b has positions [0, cache_seqlens[b]); lengths beyond P · page_size are
  truncated to that; lengths <= 0 give an empty row.
  causal (python bool): query token i attends positions < cache_seqlens[b] - s_q + i + 1.
Returns out [B, s_q, H, 512] bfloat16 and lse [B, s_q, H] float32 (natural log of the softmax denominator of
softmax_scale · q·k); a row with nothing to attend to gives out = 0, lse = -inf.
"""
from __future__ import annotations

import functools
import math

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from mla_pallas import _checks, _dispatch
from mla_pallas.kernels.common import D_QK, D_V, FP8, LOG2E, TILE
from mla_pallas.ops import sparse_decode as _sparse

__all__ = ["dense_mla_decode", "dense_indices", "dense_tile_table"]

OP = "dense_mla_decode"
# Bytes live per scan step of the XLA path (logits, p and fp8 p of [B, s_q, H, chunk], plus the gathered fp8 rows,
# per token with causal s_q > 1): 2**28 = 256 MiB (at least one page per step).
_STEP_BYTES = 1 << 28


def _check_args(q, kv_cache, block_table, cache_seqlens, softmax_scale, kv_scale, causal):
  parts = _sparse.q_parts(q)
  b = parts[0].shape[0]
  _checks.check_array("kv_cache", kv_cache, ndim=3, shape=(None, None, D_QK), dtypes=_sparse.CACHE_DTYPES,
                      expect="[num_pages, page_size, 576]")
  if kv_cache.shape[0] < 1:
    raise ValueError(f"kv_cache must have num_pages >= 1; got shape {tuple(kv_cache.shape)}")
  _checks.check_page_size("kv_cache.shape[1] (page_size)", kv_cache.shape[1])
  _checks.check_array("block_table", block_table, ndim=2, shape=(b, None), dtypes=(jnp.int32,),
                      expect=f"[B={b}, max_pages_per_seq]")
  if block_table.shape[1] < 1:
    raise ValueError(f"block_table must have at least one column; got shape {tuple(block_table.shape)}")
  _checks.check_array("cache_seqlens", cache_seqlens, ndim=1, shape=(b,), dtypes=(jnp.int32,),
                      expect=f"[B={b}]")
  _checks.check_scalar("softmax_scale", softmax_scale, positive=True)
  if hasattr(softmax_scale, "shape"):
    raise ValueError("softmax_scale must be a python float (it is a compile-time constant of the kernel); "
                     f"got an array of shape {tuple(softmax_scale.shape)}")
  _checks.check_scalar("kv_scale", kv_scale, positive=True)
  if not isinstance(causal, (bool, np.bool_)):
    raise ValueError(f"causal must be a python bool; got {type(causal).__name__}")
  return parts


def _limits(cache_seqlens, s_q, n_pos, causal):
  """[B, s_q] int32 exclusive bound on the positions query token i of sequence b attends."""
  lens = jnp.minimum(cache_seqlens, n_pos)[:, None]
  limit = jnp.broadcast_to(lens, (cache_seqlens.shape[0], s_q))
  if causal:
    lim_c = cache_seqlens[:, None] - s_q + 1 + jnp.arange(s_q, dtype=jnp.int32)[None, :]
    limit = jnp.minimum(limit, lim_c)
  return limit


def dense_indices(block_table, cache_seqlens, *, page_size: int, num_pages: int, s_q: int, causal: bool):
  """Flat slot ids ``[B, s_q, P * page_size]`` int32 of every attended position, -1 elsewhere.

  Entry ``[b, i, p]`` is ``block_table[b, p // page_size] * page_size + p % page_size`` when ``p`` is below the
  attention limit of query token ``i`` (``cache_seqlens[b]``, or with ``causal`` ``cache_seqlens[b] - s_q + i + 1``)
  and the page id is in ``[0, num_pages)``; -1 otherwise. Jit-able (all sizes static).
  """
  b, max_pages = block_table.shape
  n_pos = max_pages * page_size
  pos = jnp.arange(n_pos, dtype=jnp.int32)
  page = block_table[:, pos // page_size]                                  # [B, n_pos]
  page_ok = (page >= 0) & (page < num_pages)
  slots = page * page_size + pos % page_size
  limit = _limits(cache_seqlens, s_q, n_pos, causal)                       # [B, s_q]
  valid = page_ok[:, None, :] & (pos[None, None, :] < limit[:, :, None])
  return jnp.where(valid, slots[:, None, :], -1).astype(jnp.int32)


def _chunk_pages(b, s_q, h, page_size, max_pages, causal):
  rows = D_QK * (1 + (s_q if causal and s_q > 1 else 0))        # gathered rows (+ per-token masked copies)
  per_page = max(1, b * page_size * (s_q * h * 9 + rows))       # s, p f32 + p8 fp8 per logit
  return int(max(1, min(max_pages, _STEP_BYTES // per_page)))


def _xla_dense_decode(q, kv_cache, block_table, cache_seqlens, kv_scale, softmax_scale, causal, cp=None):
  """XLA path (FP8, or BF16 attention for a bfloat16 cache: ``sparse_decode.xla_operands``): online softmax over
  chunks of ``cp`` pages (a ``lax.scan``; None: as many as fit the step budget)."""
  b, s_q, h, _ = q.shape
  num_pages, page_size, _ = kv_cache.shape
  max_pages = block_table.shape[1]
  n_pos = max_pages * page_size
  if cp is None:
    cp = _chunk_pages(b, s_q, h, page_size, max_pages, causal)
  n_chunks = -(-max_pages // cp)
  table = jnp.pad(block_table, ((0, 0), (0, n_chunks * cp - max_pages)), constant_values=-1)
  table = table.reshape(b, n_chunks, cp).transpose(1, 0, 2)               # [n_chunks, B, cp]
  limit = _limits(cache_seqlens, s_q, n_pos, causal)                       # [B, s_q]
  row_limit = jnp.max(limit, axis=1)                                       # [B]: rows any token may read

  q8, q_scale, p_op, p_scale = _sparse.xla_operands(q, kv_cache.dtype)     # [B, s_q, H, 576], [B, s_q, H]
  logit_scale = (q_scale * (softmax_scale * kv_scale * LOG2E))[..., None]  # base-2 logits
  c = cp * page_size
  offs = jnp.arange(c, dtype=jnp.int32)
  zero8 = jnp.zeros((), kv_cache.dtype)

  def step(carry, xs):
    m, l, acc = carry
    ci, pages = xs                                                         # pages [B, cp]
    page_ok = (pages >= 0) & (pages < num_pages)
    rows = jnp.take(kv_cache, jnp.where(page_ok, pages, 0), axis=0)        # [B, cp, page, 576]
    rows = rows.reshape(b, c, D_QK)
    pos = ci * c + offs                                                    # [c]
    ok = jnp.repeat(page_ok, page_size, axis=1)                            # [B, c]
    row_ok = ok & (pos[None, :] < row_limit[:, None])
    rows = jnp.where(row_ok[..., None], rows, zero8)                       # unread rows: exact zeros, never NaN
    valid = ok[:, None, :] & (pos[None, None, :] < limit[:, :, None])      # [B, s_q, c]
    if causal and s_q > 1:   # per-token masking so that a row past token i's limit cannot leak a NaN into it
      rows_t = jnp.where(valid[..., None], rows[:, None], zero8)           # [B, s_q, c, 576]
      s = jnp.einsum("bshd,bscd->bshc", q8, rows_t, preferred_element_type=jnp.float32)
    else:
      rows_t = None
      s = jnp.einsum("bshd,bcd->bshc", q8, rows, preferred_element_type=jnp.float32)
    s = jnp.where(valid[:, :, None, :], s * logit_scale, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp2(m - m_use)                                            # 0 while m = -inf
    p = jnp.exp2(s - m_use[..., None])                                     # 0 where masked
    l = l * alpha + jnp.sum(p, axis=-1)
    p8 = p_op(p)
    if rows_t is not None:
      pv = jnp.einsum("bshc,bscd->bshd", p8, rows_t[..., :D_V], preferred_element_type=jnp.float32)
    else:
      pv = jnp.einsum("bshc,bcd->bshd", p8, rows[..., :D_V], preferred_element_type=jnp.float32)
    acc = acc * alpha[..., None] + pv
    return (m_new, l, acc), None

  init = (jnp.full((b, s_q, h), -jnp.inf, jnp.float32), jnp.zeros((b, s_q, h), jnp.float32),
          jnp.zeros((b, s_q, h, D_V), jnp.float32))
  (m, l, acc), _ = lax.scan(step, init, (jnp.arange(n_chunks, dtype=jnp.int32), table))
  has = l > 0
  o = acc * (kv_scale / (p_scale * jnp.where(has, l, 1.0)))[..., None]
  o = jnp.where(has[..., None], o, 0.0)
  lse = jnp.where(has, (m + jnp.log2(jnp.where(has, l, 1.0))) * math.log(2.0), -jnp.inf)
  return o.astype(jnp.bfloat16), lse


# batch_invariant: the XLA path's chunk of pages, fixed (the default depends on the batch and the table width)
INVARIANT_CHUNK_KEYS = 2048


@functools.partial(jax.jit, static_argnames=("softmax_scale", "causal", "batch_invariant"))
def _xla_jit(q, kv_cache, block_table, cache_seqlens, kv_scale, *, softmax_scale, causal, batch_invariant=False):
  q = _sparse.join_q(q)      # an array or a (latent, rope) pair
  if not batch_invariant:
    return _xla_dense_decode(q, kv_cache, block_table, cache_seqlens, kv_scale, softmax_scale, causal)
  # one sequence at a time with a fixed chunk: extra (masked) chunks of a wider table add exact zeros
  cp = max(1, INVARIANT_CHUNK_KEYS // kv_cache.shape[1])
  return _sparse._xla_per_row(
      lambda q1, t1, l1: _xla_dense_decode(q1, kv_cache, t1, l1, kv_scale, softmax_scale, causal, cp),
      q, block_table, cache_seqlens)


@functools.partial(jax.jit, static_argnames=("page_size", "num_pages", "s_q", "causal"))
def _indices_jit(block_table, cache_seqlens, *, page_size, num_pages, s_q, causal):
  return dense_indices(block_table, cache_seqlens, page_size=page_size, num_pages=num_pages, s_q=s_q,
                       causal=causal)


def _kernel_supported(q_shape, num_slots=None, interpret=False, cache_dtype=FP8):
  sparse_check = _sparse._kernel_supported(q_shape, num_slots, interpret, cache_dtype)

  def check():
    try:
      sparse_check()
    except NotImplementedError as e:
      raise NotImplementedError(f"{OP} runs on the sparse_mla_decode kernel: {e}") from None
  return check


# The dense kernel (kernels/dense_sm90.py): heads on N up to sparse_decode.HEADS_ON_N_MAX (16), on M above.
DENSE_KERNEL_HEADS = (8, 16, 32, 64, 128)
DENSE_PAGE_MULTIPLE = TILE     # a 64-key tile never crosses a page
# Families where the dense kernel ran and matched the reference on hardware, per cache dtype ("auto" takes the
# sparse route elsewhere; "mosaic" runs the dense kernel wherever it can). The bf16-cache form (heads on M at every
# H, "producer_vt" over bf16: kernels/dense_sm90.py) is validated separately. Measured on sm90: the same speed as
# the sparse route with heads on M, faster with heads on N; the bf16 form 35 % faster than the bf16 sparse route
# of that time (docs/kernels/dense_decode_sm90.md).
DENSE_VALIDATED_ON: tuple[str, ...] = ("sm90",)
DENSE_BF16_VALIDATED_ON: tuple[str, ...] = ("sm90",)
DENSE_KERNEL, SPARSE_ROUTE = "dense kernel", "sparse kernel"     # the routes' names in graph_report()


def _dense_kernel_supported(q_shape, kv_cache, arch: str | None):
  """Raise NotImplementedError where the dense kernel cannot take this input (the op then takes the sparse
  route)."""
  h = q_shape[2]
  if arch != "sm90":
    raise NotImplementedError(f"the dense decode kernel is sm_90 only; the kernel family here is {arch!r}")
  if jnp.dtype(kv_cache.dtype) not in (jnp.dtype(FP8), jnp.dtype(jnp.bfloat16)):
    raise NotImplementedError(f"the dense decode kernel reads a float8_e4m3fn or bfloat16 cache; got "
                              f"{kv_cache.dtype}")
  if h not in DENSE_KERNEL_HEADS:
    raise NotImplementedError(f"the dense decode kernel takes H in {DENSE_KERNEL_HEADS}; got H={h}")
  if kv_cache.shape[1] % DENSE_PAGE_MULTIPLE:
    raise NotImplementedError(f"the dense decode kernel needs a page size that is a multiple of "
                              f"{DENSE_PAGE_MULTIPLE}; got {kv_cache.shape[1]}")


def mosaic_route(q_shape, kv_cache, impl: str, interpret: bool) -> str:
  """The Mosaic route of one call: "dense" (the dense kernel) where it can take the input and either ``impl`` is
  "mosaic", or it runs in interpret mode, or it has been validated on this GPU family (DENSE_VALIDATED_ON);
  "sparse" (the sparse kernel on per-token slot ids) otherwise."""
  arch = _dispatch.mosaic_arch(interpret)
  try:
    _dense_kernel_supported(q_shape, kv_cache, arch)
  except NotImplementedError:
    return "sparse"
  validated = DENSE_BF16_VALIDATED_ON if _is_bf16(kv_cache.dtype) else DENSE_VALIDATED_ON
  return "dense" if impl == "mosaic" or interpret or arch in validated else "sparse"


def _is_bf16(cache_dtype) -> bool:
  return jnp.dtype(cache_dtype) == jnp.dtype(jnp.bfloat16)


def _heads_on_n(h: int, cache_dtype=FP8) -> bool:
  """The dense kernel's design: heads on N up to sparse_decode.HEADS_ON_N_MAX heads over an fp8 cache; heads on M
  otherwise (a bf16 cache at every H, as the sparse op's bf16 kernel)."""
  return h <= _sparse.HEADS_ON_N_MAX and not _is_bf16(cache_dtype)


def dense_plan(h: int, batch_tokens: int, n_pos: int, batch_invariant: bool = False, cache_dtype=FP8):
  """(num_splits, tiles_per_split) of the dense kernel for H heads, B · s_q query tokens and a block table of
  ``n_pos`` positions: the sparse op's plan for the same design (``sparse_decode._plan``, waves × (tiles + CTA
  overhead), with its longest and shortest splits) with the table's width as the top-k; ``batch_invariant``:
  splits of ``sparse_decode.INVARIANT_SPLIT_TILES`` tiles."""
  k_tiles = max(1, -(-n_pos // TILE))
  if batch_invariant:
    tps = _sparse.INVARIANT_SPLIT_TILES
    return -(-k_tiles // tps), tps
  design = "sm90_heads_n" if _heads_on_n(h, cache_dtype) else "sm90_heads_m"
  tiles_per_token = _sparse._tiles_per_token(h, design)
  ctas = batch_tokens * tiles_per_token
  return _sparse._plan(batch_tokens, tiles_per_token, n_pos, _dispatch.num_sms(), _sparse._max_split_tiles(design),
                       _sparse._min_split_tiles(design, ctas, n_pos))


def sweep_configs(h: int, batch_tokens: int, n_pos: int, page: int = 64,
                  cache_dtype: str = "float8_e4m3fn") -> dict[str, tuple[tuple[str, object], ...]]:
  """Labelled candidates for benchmark sweeps of the Mosaic routes: ``"default": ()`` (the dense kernel with its
  plan), ``"route=sparse"`` (label ``(("route", "sparse"),)``: the sparse-kernel route, which the bench spec runs
  through :func:`sparse_route`), and the dense kernel with its design's other K-buffer counts and the other split
  lengths (8-128 tiles) where the table is long enough to differ; over a bf16 cache also
  ``"schedule=seesaw"``. Only the sparse route where the dense kernel
  cannot take the input (H, page size, cache dtype)."""
  from mla_pallas.kernels import dense_sm90
  out = {"route=sparse": (("route", "sparse"),)}
  pages = jax.ShapeDtypeStruct((1, page, D_QK), cache_dtype)
  try:
    _dense_kernel_supported((1, 1, h, D_QK), pages, "sm90")
  except NotImplementedError:
    return out
  _, tps = dense_plan(h, batch_tokens, n_pos, cache_dtype=cache_dtype)
  k_tiles = max(1, -(-n_pos // TILE))
  design = dense_sm90.HeadsNConfig if _heads_on_n(h, cache_dtype) else dense_sm90.TuningConfig
  extra = dict(cache_dtype=jnp.dtype(cache_dtype).name) if design is dense_sm90.TuningConfig else {}
  out = {"default": (), **out}
  for k in design.K_BUFFERS:
    if k != design.k_buffers:
      try:
        design(tiles_per_split=tps, k_buffers=k, **extra)
      except ValueError:     # not with this cache (SMEM: a bf16 cache has room for two K tiles)
        continue
      out[f"k_buffers={k}"] = (("k_buffers", k),)
  if _is_bf16(cache_dtype):    # the heads-on-M core's other bf16 schedule (kernels/sparse_sm90_heads_m.py "Seesaw")
    out["schedule=seesaw"] = (("schedule", "seesaw"),)
  for t in (8, 16, 32, 64, 128):
    if t != tps and t < 2 * k_tiles:
      out[f"tiles_per_split={t}"] = (("tiles_per_split", t),)
  return out


def dense_tile_table(block_table, cache_seqlens, *, page_size: int, num_pages: int, s_q: int, causal: bool,
                     num_splits: int, tiles_per_split: int):
  """The dense kernel's table ``[B · s_q · num_splits, TAB]`` int32 (``kernels/dense_sm90.py``, module docstring),
  row ``(b · s_q + i) · num_splits + s`` for query token i of sequence b and split s: ``n_full`` (leading tiles
  wholly inside the token's limit and on valid pages), ``n_tiles`` (tiles holding a position below the limit,
  at most ``tiles_per_split``), ``rel`` (the limit minus the split's first position), 0, then each tile's first
  cache slot ``block_table[b, p // page_size] * page_size + p % page_size`` (p = 64 · tile), or num_slots where
  the page id is outside [0, num_pages) or past the table; zeros to the row's width. Jit-able."""
  from mla_pallas.kernels import dense_sm90
  if page_size % TILE:
    raise ValueError(f"page_size must be a multiple of {TILE} for the dense kernel's table; got {page_size}")
  b, max_pages = block_table.shape
  n_pos = max_pages * page_size
  num_slots = num_pages * page_size
  tps = tiles_per_split
  pos0 = jnp.arange(num_splits * tps, dtype=jnp.int32) * TILE                 # each tile's first position
  col = pos0 // page_size
  page = block_table[:, jnp.minimum(col, max_pages - 1)]                      # [B, tiles]
  ok = (col < max_pages)[None] & (page >= 0) & (page < num_pages)
  first = jnp.where(ok, page * page_size + pos0 % page_size, num_slots)
  # the split's first tile on a bad page, relative to the split's start (tps where none): the one reduction
  bad = jnp.min(jnp.where(ok.reshape(b, num_splits, tps), tps, jnp.arange(tps, dtype=jnp.int32)), axis=-1)
  limit = _limits(cache_seqlens, s_q, n_pos, causal)                          # [B, s_q]
  rel = limit[:, :, None] - jnp.arange(num_splits, dtype=jnp.int32) * (tps * TILE)   # [B, s_q, S]
  # the leading run of tiles on good pages and wholly below the limit
  n_full = jnp.minimum(jnp.clip(rel // TILE, 0, tps), bad[:, None, :])
  n_tiles = jnp.clip(-(-rel // TILE), 0, tps)
  # the row as one elementwise expression of its column (header, the tiles' first slots, zeros), so that XLA
  # writes it in one fusion after the reduction (a concatenate of the parts took two more launches)
  width = dense_sm90.table_width(tps)
  c = jnp.arange(width, dtype=jnp.int32)
  head = dense_sm90.HEADER
  rows = jnp.pad(first.reshape(b, 1, num_splits, tps), ((0, 0), (0, 0), (0, 0), (head, width - head - tps)))
  table = jnp.where(c == 0, n_full[..., None], jnp.where(c == 1, n_tiles[..., None],
                                                         jnp.where(c == 2, rel[..., None], rows)))  # column 3: 0
  return table.reshape(b * s_q * num_splits, width)


def _mosaic_dense_decode(parts, kv_cache, block_table, cache_seqlens, kv_scale, softmax_scale, causal, interpret,
                         batch_invariant=False, tuning=()):
  """The dense kernel's route: the table, the kernel, the split merge. ``tuning``: (field, value) pairs of
  ``dense_sm90.TuningConfig`` over the plan's (a ``tiles_per_split`` re-plans the splits)."""
  from mla_pallas.kernels import dense_sm90
  b, s_q, h, _ = _sparse.q_shape(parts)
  num_pages, page_size, _ = kv_cache.shape
  n_pos = block_table.shape[1] * page_size
  n_tok = b * s_q
  bf16 = _is_bf16(kv_cache.dtype)
  splits, tps = dense_plan(h, n_tok, n_pos, batch_invariant, kv_cache.dtype)
  kw = dict(tuning)
  if "tiles_per_split" in kw:
    tps = kw["tiles_per_split"]
    splits = -(-max(1, -(-n_pos // TILE)) // tps)
  table = dense_tile_table(block_table, cache_seqlens, page_size=page_size, num_pages=num_pages, s_q=s_q,
                           causal=causal, num_splits=splits, tiles_per_split=tps)
  num_slots = num_pages * page_size
  build = dict(softmax_scale=softmax_scale, interpret=interpret, q_split=len(parts) == 2 and not bf16, heads=h)
  if _heads_on_n(h, kv_cache.dtype):      # one CTA per token and split, out_heads = H rounded up to 8 rows of O
    tiles_per_token, out_rows = 1, -(-h // 8) * 8
    cfg = dense_sm90.HeadsNConfig(**{"tiles_per_split": tps, **kw})
    kern = dense_sm90.build_heads_n(n_tok, num_slots, splits, out_rows, cfg, **build)
  else:                   # 64-row query tiles: H / 64 per token (H < 64 zero-padded)
    tiles_per_token, out_rows = max(1, h // TILE), TILE
    cfg = dense_sm90.TuningConfig(**{"tiles_per_split": tps, "cache_dtype": jnp.dtype(kv_cache.dtype).name, **kw})
    out_dtype = _sparse._partials_dtype(splits, bf16)
    kern = dense_sm90.build(n_tok * tiles_per_token, num_slots, splits, tiles_per_token, cfg,
                            out_dtype_name=out_dtype, **build)
  if bf16:                # the bf16 kernel takes Q tiles (bf16, H < 64 zero-padded) and each row's logit scale
    q_args = _sparse.bf16_q_tiles(_sparse.join_q(parts).reshape(n_tok, h, D_QK), tiles_per_token,
                                  softmax_scale, kv_scale)
  else:
    q_args = tuple(p.reshape(n_tok * h, p.shape[-1]) for p in parts)
  o, lse = kern(*q_args, kv_cache.reshape(-1, D_QK), table, jnp.asarray(kv_scale, jnp.float32).reshape(1))
  if splits > 1 or batch_invariant:
    o, lse = _sparse.combine_splits(o, lse)
  else:
    o, lse = o[:, 0], lse[:, 0]
  o = o.reshape(n_tok, tiles_per_token * out_rows, D_V)[:, :h]
  lse = lse.reshape(n_tok, tiles_per_token * out_rows)[:, :h]
  return o.reshape(b, s_q, h, D_V).astype(jnp.bfloat16), lse.reshape(b, s_q, h)


def sparse_route(q, kv_cache, block_table, cache_seqlens, kv_scale, *, softmax_scale, causal, interpret,
                 batch_invariant=False):
  """The "sparse" Mosaic route (:func:`mosaic_route`): per-token slot ids (:func:`dense_indices`) through the
  sparse op's kernel. Arguments as :func:`dense_mla_decode` (checked there)."""
  parts = _sparse._as_parts(q)
  num_pages, page_size, _ = kv_cache.shape
  indices = _indices_jit(block_table, cache_seqlens, page_size=int(page_size), num_pages=int(num_pages),
                         s_q=int(_sparse.q_shape(parts)[1]), causal=causal)
  return _sparse._sparse_decode_jit(parts, kv_cache.reshape(-1, D_QK), indices, jnp.asarray(kv_scale, jnp.float32),
                                    None, softmax_scale=float(softmax_scale), impl="mosaic", interpret=interpret,
                                    arch=_dispatch.mosaic_arch(interpret), batch_invariant=batch_invariant)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "causal", "interpret", "batch_invariant", "tuning"))
def _dense_kernel_jit(q, kv_cache, block_table, cache_seqlens, kv_scale, *, softmax_scale, causal, interpret,
                      batch_invariant=False, tuning=()):
  return _mosaic_dense_decode(_sparse._as_parts(q), kv_cache, block_table, cache_seqlens, kv_scale, softmax_scale,
                              causal, interpret, batch_invariant, tuning)


def dense_mla_decode(q, kv_cache, block_table, cache_seqlens, *, softmax_scale, kv_scale=1.0,
                     causal: bool = False, impl: str = "auto", interpret: bool = False,
                     batch_invariant: bool = False):
  """Dense (whole-context) MLA decode attention over a paged FP8 latent cache (FlashMLA dense decode).

  Args:
    q: [B, s_q, H, 576] bfloat16 (or float32): absorbed queries (512 latent ‖ 64 rope); the s_q query tokens are
      the last s_q tokens of each sequence. Or the pair (q_latent [B, s_q, H, 512], q_rope [B, s_q, H, 64]), as
      in :func:`mla_pallas.ops.sparse_decode.sparse_mla_decode`.
    kv_cache: [num_pages, page_size, 576] float8_e4m3fn; dequantized value = fp8 · kv_scale; the value vector of
      a row is its first 512 entries. A bfloat16 cache gives BF16 attention (q and P in bf16, f32
      accumulation): on sm_90 the dense kernel's bf16 form (``impl="mosaic"``; ``auto`` where it was validated,
      DENSE_BF16_VALIDATED_ON) or the sparse op's bf16-cache kernel, otherwise the XLA path.
    block_table: [B, P] int32 page ids; position p of sequence b is at flat slot
      ``block_table[b, p // page_size] * page_size + p % page_size``. Entries past the sequence may be anything
      (e.g. -1); a page id outside [0, num_pages) is masked (never read).
    cache_seqlens: [B] int32; sequence b attends positions [0, cache_seqlens[b]) (truncated to P · page_size).
    softmax_scale: python float > 0 multiplying q·k.
    kv_scale: per-tensor cache scale (python float or f32 scalar).
    causal: python bool. False: every query token attends every position < cache_seqlens[b]. True: query token
      i (0-based among s_q) attends positions < cache_seqlens[b] - s_q + i + 1 (nothing when that is <= 0).
    impl: "auto" | "mosaic" | "xla" (see :mod:`mla_pallas._dispatch`). "mosaic" runs the dense kernel where it
      takes the input (sm_90, fp8 or bf16 cache, H in DENSE_KERNEL_HEADS, page size a multiple of 64), else the sparse
      top-k kernel on per-token slot ids built from the block table (top-k = P · page_size)
      (:func:`mosaic_route`); "auto" prefers a kernel when it can run, the dense one only where it has been
      validated on hardware (DENSE_VALIDATED_ON; a bf16 cache: DENSE_BF16_VALIDATED_ON). ``graph_report()``
      names the kernel that ran.
    interpret: run the Mosaic kernel in Pallas' GPU interpret mode (CPU).
    batch_invariant: python bool. True: a sequence's bits do not depend on the batch size, the other sequences,
      their lengths or the block table's width (padding entries past its pages): the kernel runs splits of
      ``sparse_decode.INVARIANT_SPLIT_TILES`` · 64 positions merged in a fixed order (positions past a sequence
      are masked and add exact zeros); the XLA path runs one sequence at a time over fixed chunks of
      ``INVARIANT_CHUNK_KEYS`` positions.

  Returns:
    out [B, s_q, H, 512] bfloat16 and lse [B, s_q, H] float32 (natural log). A row with nothing to attend to
    gives out = 0 and lse = -inf.

  Raises:
    ValueError: bad shape/dtype/value of an argument (the message names it) or an unknown ``impl``.
    NotImplementedError: ``impl="mosaic"`` when no kernel can run here or H is not one of the kernel's head
      counts (8, 16, 32, 64, 128).
  """
  _dispatch.check_impl(impl)
  parts = _check_args(q, kv_cache, block_table, cache_seqlens, softmax_scale, kv_scale, causal)
  shape = _sparse.q_shape(parts)
  causal = bool(causal)
  batch_invariant = _checks.check_bool("batch_invariant", batch_invariant)
  num_slots = kv_cache.shape[0] * kv_cache.shape[1]
  used = _dispatch.choose(OP, impl, interpret=interpret,
                          supported=_kernel_supported(shape, num_slots, interpret, kv_cache.dtype),
                          validated_on=_sparse.validated_on(kv_cache.dtype, shape[2]))
  kv_scale_arr = jnp.asarray(kv_scale, jnp.float32)
  route = mosaic_route(shape, kv_cache, impl, interpret) if used == "mosaic" else None
  if route is not None:
    _dispatch.record_kernel(OP, DENSE_KERNEL if route == "dense" else SPARSE_ROUTE)
  if route == "dense":
    return _dense_kernel_jit(parts, kv_cache, block_table, cache_seqlens, kv_scale_arr,
                             softmax_scale=float(softmax_scale), causal=causal, interpret=interpret,
                             batch_invariant=batch_invariant)
  if route == "sparse":
    return sparse_route(parts, kv_cache, block_table, cache_seqlens, kv_scale_arr, softmax_scale=softmax_scale,
                        causal=causal, interpret=interpret, batch_invariant=batch_invariant)
  return _xla_jit(parts, kv_cache, block_table, cache_seqlens, kv_scale_arr, softmax_scale=float(softmax_scale),
                  causal=causal, batch_invariant=batch_invariant)

