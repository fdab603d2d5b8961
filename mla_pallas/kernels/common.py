"""Pieces shared by the Mosaic GPU kernels of mla_pallas.

* Constants of the latent row format (576 fp8 values = 9 chunks of 64 bytes).
* :class:`TuningConfigBase`: frozen tuning-config base whose subclasses validate themselves.
* SMEM transforms for wgmma-ready tiles, SMEM budget accounting.
* Helpers used inside kernel bodies: per-warp row issue, invalid-key handling, the interpret-mode barrier drain,
  one online-softmax step (:func:`online_softmax_tile`) and the interpret keyword of ``plgpu.kernel``
  (:func:`interpret_kwargs`).
* The pieces of the two sm_90 sparse decode designs (``sparse_sm90_heads_m``, ``sparse_sm90_heads_n``): their
  config base :class:`SparseSm90Config`, the swizzled row gather (:func:`gather_tiles`) and its SMEM views
  (:func:`k_scratch`, :func:`q_scratch`), the f16 V upcast (:func:`stage_v16`), register-seeded wgmma
  accumulation (:func:`accumulate`) and the lse store (:func:`store_lse`).
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import ClassVar, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

FP8 = jnp.float8_e4m3fn
D_QK = 576            # latent (512) + rope (64)
D_V = 512             # value = first 512 latent values
D_ROPE = D_QK - D_V   # 64 rope values
CHUNK = 64            # bytes per chunk of an fp8 row; wgmma K-chunk with 64-byte swizzle
N_CHUNKS = D_QK // CHUNK      # 9
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
SMEM_LIMIT = 227 * 1024       # usable dynamic SMEM per CTA on sm_90 / sm_100
P_SCALE = 256.0               # softmax P in [0, 1] is stored as fp8(256 p): exact power of two, max 256 < 448

# sm_90 sparse decode (both designs)
TILE = 64          # gathered keys per pipeline step; query rows per CTA of the heads-on-M design
SW_CHUNK = 128     # bytes per gathered TMA box / per wgmma K chunk (128-byte swizzle)
SW_CHUNKS = 5      # latent chunks 0-3 (columns 0-511) + tail (columns 448-575: latent 448-511 and rope)
SW_TAIL_COL = D_QK - SW_CHUNK      # 448: first cache column of the tail chunk
Q_SW_COLS = SW_CHUNKS * SW_CHUNK   # 640: Q as latent | 64 zeros | rope (the zeros meet latent 448-511 in the tail)
CONSUMER_REGS = 224   # 2 x 128 x 224 + 128 x 56 <= 65536 registers per SM (setmaxnreg within the launch allocation)
LOADER_REGS = 56

LANE = plgpu.LoweringSemantics.Lane
WARPGROUP = plgpu.LoweringSemantics.Warpgroup


def swizzled(dtype, swizzle: int = 64):
  """Transforms of a wgmma/tcgen05-ready SMEM tile: Tiling(8, swizzle bytes) + Swizzle."""
  return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))


@dataclasses.dataclass(frozen=True)
class TuningConfigBase:
  """Base of every kernel's frozen tuning config: subclasses implement ``validate`` (raise ValueError)."""

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if f.type in ("int", int) and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
        raise ValueError(f"{type(self).__name__}.{f.name} must be a positive int; got {v!r}")
    self.validate()

  def validate(self) -> None:  # pragma: no cover - overridden
    pass

  def check_smem(self, need: int, what: str = "") -> None:
    """Raise ValueError when this config needs more than SMEM_LIMIT bytes of SMEM (``need``)."""
    if need > SMEM_LIMIT:
      raise ValueError(f"{type(self).__name__} {self} needs {need} bytes of SMEM > {SMEM_LIMIT}{what}")

  def check_split(self, max_tiles: int = 256) -> None:
    """Raise ValueError when ``tiles_per_split`` exceeds the TMA box limit of the index copy."""
    if self.tiles_per_split > max_tiles:
      raise ValueError(f"{type(self).__name__}.tiles_per_split must be <= {max_tiles} (TMA box limit); "
                       f"got {self.tiles_per_split}")


def smem_bytes(*buffers: tuple[tuple[int, ...], object], align: int = 1024) -> int:
  """Total bytes of SMEM buffers given as (shape, dtype) pairs, each rounded up to ``align`` bytes (Mosaic GPU
  aligns scratch buffers; 1024 bytes is the 128-byte-swizzle atom)."""
  return sum(-(-math.prod(s) * jnp.dtype(d).itemsize // align) * align for s, d in buffers)


def for_rows_per_warp(tile: int, issue_row) -> None:
  """Call ``issue_row(r)`` for the ``tile`` rows of a gather, issued per warp (warp w takes rows
  [w · tile/4, (w + 1) · tile/4)). In Lane semantics a warpgroup-level copy adds a warpgroup barrier and 128
  barrier arrivals per row, which made the first version issue-bound at ~12 us per 64-row tile on an H200
  (docs/kernels/sparse_decode_sm90.md)."""
  per_warp = tile // 4

  @plgpu.warp_map
  def _(w):
    @pl.loop(0, per_warp)
    def _(r0):
      issue_row(w * per_warp + r0)



def safe_row(i, num_slots: int):
  """Scalar row id to gather for a raw top-k entry ``i``: itself when 0 <= i < num_slots, else ``num_slots`` (one
  row past the end of the cache, so its TMA box is zero-filled and nothing is read out of bounds)."""
  return jnp.where((i < 0) | (i >= num_slots), num_slots, i)


def valid_keys(ids, num_slots: int):
  """Mask of the keys that count: raw top-k entries (or sanitised ones) inside [0, num_slots)."""
  return (ids >= 0) & (ids < num_slots)


def drain(barrier, n_steps, n_slots: int):
  """Observe the last completed phase of each ring slot (required by the interpret-mode barrier rule; harmless on
  hardware): wait once more on the 'consumed' barrier of the last ``min(n_steps, n_slots)`` steps, in order.
  ``n_steps``: a Python int, or traced (a CTA's own step count)."""
  if isinstance(n_steps, int):
    for s in range(max(n_steps - n_slots, 0), n_steps):
      plgpu.barrier_wait(barrier.at[s % n_slots])
    return
  for back in range(n_slots, 0, -1):
    step = n_steps - back

    @pl.when(step >= 0)
    def _():
      plgpu.barrier_wait(barrier.at[lax.rem(step, n_slots)])

def running_max_step(m, tile_max, rescale_threshold: float | None = None):
  """The running max of an online softmax after a tile whose per-row max of the (scaled, masked) logits is
  ``tile_max`` ([R]): (m_new, m_use = m_new with -inf as 0 for the exponent, alpha = 2^(m - m_new)); lazy with a
  ``rescale_threshold`` as in :func:`online_softmax_tile` (alpha exactly 1 where m stays)."""
  m_max = jnp.maximum(m, tile_max)
  if rescale_threshold is None:
    m_new = m_max
  else:
    moved = m_max > m + rescale_threshold
    m_new = jnp.where(moved, m_max, m)
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m - m_use)
  if rescale_threshold is not None:
    alpha = jnp.where(moved, alpha, 1.0)
  return m_new, m_use, alpha


def alpha_is_one(alpha):
  """True (a warpgroup-uniform scalar) where every entry of the [64] vector ``alpha`` is 1: a lazy softmax step
  (``online_softmax_tile(rescale_threshold=...)``) moved no row's maximum, so the output needs no rescale. With
  the heads on the columns (``Layout.WGMMA.reduce(0)``) every warp holds all entries: the minimum is a shuffle
  reduction within each warp, no SMEM."""
  return jnp.min(alpha) == 1.0


def online_softmax_tile(s, valid_cols, row_scale, m, l, keys_axis: int = 1,
                        rescale_threshold: float | None = None, scale_in_exponent: bool = False):
  """One online-softmax step in base 2 over a [rows, keys] f32 tile of raw logits ``s`` (register values).

  Args:
    s: [R, T] f32 raw Q.K products (``keys_axis=0``: the transposed tile Sᵀ [T, R], heads on the columns);
    valid_cols: [T] bool (False: masked key), or a mask of the shape of ``s`` (per element: causal masks), or None
      (every key counts: no masking);
    row_scale: [R] f32 (folds q_scale, kv_scale, softmax_scale and
    log2 e); m, l: [R] running max (base-2 logits) and running sum; ``l`` may also have the shape of ``s``
    (running sums per element: no reduction over the keys in this step, the caller sums once at the end), or
    [R, g] with g dividing T (keys_axis 1: sums per column residue mod g, in-thread adds of the tile's g-column
    slices where a warp layout gives each thread whole slices: no cross-lane reduction until the caller's sum).
    rescale_threshold: None: m is the running maximum. A float t (lazy rescaling): m moves to the new maximum only
      where that exceeds m by more than t (or m is -inf), so p <= 2^t and alpha is exactly 1 in the rows that
      keep their m (a tile where no row moves needs no rescale of the output: ``alpha_is_one``).
    scale_in_exponent: fold the row scale into the exponent: mask the raw logits, scale their row max, and
      p = exp2(fma(s, scale, -m)) (one fma per logit where the default multiplies,
      selects and subtracts). Needs row_scale >= 0 (a max commutes with a non-negative scale only); a zero row
      scale is taken as 1, which is exact only where that row's logits are all 0 (an all-zero q row, a padding
      row), so a masked -inf never meets a 0 scale (NaN). Same p up to the fma's single rounding.
  Returns:
    (p [R, T] (or [T, R]) = 2^(s' - m_new) in [0, 1] (lazy: [0, 2^t]), alpha [R] = 2^(m - m_new) to rescale the
    running output, m_new, l_new). A row with nothing valid so far keeps m = -inf and gets p = 0, alpha = 0
    (lazy: 1; never NaN).
  """
  head_axis = 1 - keys_axis
  if valid_cols is None:
    mask = lambda x: x
  else:
    valid = valid_cols if valid_cols.ndim == s.ndim else lax.broadcast_in_dim(valid_cols, s.shape, [keys_axis])
    mask = lambda x: jnp.where(valid, x, -jnp.inf)
  if scale_in_exponent:
    scale = jnp.where(row_scale == 0.0, 1.0, row_scale)
    s = mask(s)
    m_new, m_use, alpha = running_max_step(m, s.max(axis=keys_axis) * scale, rescale_threshold)
    p = jnp.exp2(s * lax.broadcast_in_dim(scale, s.shape, [head_axis])
                 - lax.broadcast_in_dim(m_use, s.shape, [head_axis]))
  else:
    s = mask(s * lax.broadcast_in_dim(row_scale, s.shape, [head_axis]))
    m_new, m_use, alpha = running_max_step(m, s.max(axis=keys_axis), rescale_threshold)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [head_axis]))
  if l.ndim == s.ndim and l.shape == s.shape:   # running sums per element (summed over the keys by the caller)
    return p, alpha, m_new, l * lax.broadcast_in_dim(alpha, s.shape, [head_axis]) + p
  if l.ndim == s.ndim:   # [R, g] running sums per column residue (keys k = j (mod g); the caller sums once)
    g = l.shape[1]
    assert keys_axis == 1 and s.shape[1] % g == 0, (l.shape, s.shape, keys_axis)
    part = p[:, :g]
    for j in range(1, s.shape[1] // g):
      part = part + p[:, j * g:(j + 1) * g]
    return p, alpha, m_new, l * lax.broadcast_in_dim(alpha, l.shape, [0]) + part
  return p, alpha, m_new, l * alpha + p.sum(axis=keys_axis)


def interpret_kwargs(interpret) -> dict:
  """``plgpu.kernel`` keyword arguments for ``interpret``: False/None -> {} (native), True -> default
  ``InterpretGPUParams``, an ``InterpretGPUParams`` (e.g. with ``detect_races=True``) -> itself."""
  if not interpret:
    return {}
  return {"interpret": interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()}


def cpu_pool_threads() -> int:
  """The threads of XLA's CPU client pool as XLA sizes it (``PJRT_NPROC``, else ``NPROC``, else the CPUs this
  process may run on), read from the environment of this process."""
  for name in ("PJRT_NPROC", "NPROC"):
    value = os.environ.get(name, "")
    if value.strip().isdigit():
      return int(value)
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_interpret_threads(interpret, warpgroups: int, what: str) -> None:
  """Interpret mode runs each warpgroup as a thread that blocks in barrier waits on a thread of XLA's CPU pool;
  with fewer pool threads than warpgroups the kernel can deadlock (a 4-warpgroup kernel on 2 CPUs did). Raises
  RuntimeError naming the fix instead of hanging."""
  if interpret and cpu_pool_threads() < warpgroups:
    raise RuntimeError(
        f"interpret mode of {what} runs {warpgroups} warpgroup threads, but XLA's CPU pool has "
        f"{cpu_pool_threads()} threads and the run can deadlock; set PJRT_NPROC={max(8, warpgroups)} in the "
        "environment before JAX starts")


# ----------------------------------------------------------------------------------------------------------------
# sm_90 sparse decode: shared by kernels/sparse_sm90_heads_m.py and kernels/sparse_sm90_heads_n.py


@dataclasses.dataclass(frozen=True)
class SparseSm90Config(TuningConfigBase):
  """Config of an sm_90 sparse decode design.

  tiles_per_split: 64-key tiles one CTA processes (the split length is 64 · tiles_per_split keys; the op's split
    plan sets it).
  k_buffers: gathered K tiles in flight (the loader runs k_buffers - 1 tiles ahead of the consumers); one of the
    design's ``K_BUFFERS``.
  """
  K_BUFFERS: ClassVar[tuple[int, ...]] = ()
  tiles_per_split: int = 32
  k_buffers: int = 2

  def validate(self):
    if self.k_buffers not in self.K_BUFFERS:
      raise ValueError(f"{type(self).__name__}.k_buffers must be one of {self.K_BUFFERS}; got {self.k_buffers}")
    self.check_split()
    self.check_smem(self.smem_budget())

  def smem_budget(self) -> int:  # pragma: no cover - overridden
    raise NotImplementedError


class KeyTiles(NamedTuple):
  """The key tiles one CTA of an sm_90 design runs: ``n_tiles`` (a Python int, or traced: the dense kernels' own
  count per CTA) and the softmax warpgroup's ``segments``, consecutive ranges ``(lo, hi, mask)`` covering
  [0, n_tiles), ``mask(t)`` tile t's key mask ([64] bool in the design's key layout) or None (every key counts:
  no masking code in that range's loop)."""
  n_tiles: object
  segments: tuple


def id_mask(idx_smem, t, num_slots: int, layout):
  """Tile t's key mask [64] bool in ``layout``: its ids ``idx_smem[t]`` (SMEM [n_tiles, 64] int32) inside
  [0, num_slots) (the sparse kernels' masks)."""
  return valid_keys(plgpu.load(idx_smem.at[t], layout=layout, optimized=False), num_slots)


def id_key_tiles(n_tiles: int, idx_smem, num_slots: int, layout) -> KeyTiles:
  """A sparse split's tiles: all ``n_tiles``, each key masked by its id (:func:`id_mask`)."""
  return KeyTiles(n_tiles, ((0, n_tiles, lambda t: id_mask(idx_smem, t, num_slots, layout)),))


def tile_mask(keys: KeyTiles, t):
  """Tile t's key mask from whichever of ``keys``' segments holds it (None where that is an unmasked range, known
  statically): a schedule that runs one tile outside its segment loops (a peeled first tile)."""
  valid = None
  for lo, hi, mask in keys.segments:
    if mask is None:
      continue
    inside = (lo <= t) & (t < hi)
    if isinstance(inside, bool):
      if inside:
        return mask(t)
      continue
    here = mask(t) | ~inside                 # every key counts outside this (masked) range
    valid = here if valid is None else valid & here
  return valid


# Loop and branch helpers over tile counts that are Python ints (the sparse kernels: static code, as written) or
# traced scalars (the dense kernels' per-CTA counts: scf.while / scf.if).

def _static(*xs) -> bool:
  return all(isinstance(x, (bool, int)) for x in xs)


def when(pred, fn, carry):
  """``fn(carry)`` where ``pred`` holds, else ``carry``: a Python ``if`` for a static ``pred``, else ``lax.cond``."""
  if _static(pred):
    return fn(carry) if pred else carry
  return lax.cond(pred, fn, lambda c: c, carry)


def fori_loop(lo, hi, body, carry):
  """``lax.fori_loop``, with static bounds that leave no iteration returning ``carry`` unchanged."""
  if _static(lo, hi) and hi <= lo:
    return carry
  return lax.fori_loop(lo, hi, body, carry)


def half_up(x):
  """ceil(x / 2) of an int x >= -1, static or traced."""
  return -(-x // 2) if _static(x) else lax.div(x + 1, 2)


def maximum(a, b):
  return max(a, b) if _static(a, b) else jnp.maximum(a, b)


def rem(a, b: int):
  return a % b if _static(a) else lax.rem(a, b)


@dataclasses.dataclass(frozen=True)
class SparseRefs:
  """The GMEM and SMEM refs and barriers of an sm_90 sparse design's kernel, by name (a design leaves the ones it
  does not allocate as None; what each holds is in the design's module docstring).

  GMEM: q_gmem, qs_gmem (row scales), kv_gmem, idx_gmem, scal_gmem (kv_scale), o_gmem, lse_gmem. SMEM: q_sw, k_sw
  (K tiles), v16 (f16 V tile), p_sw (P or Pᵀ slots), idx_smem, lse_smem, head_smem (per-head rows: alpha,
  kv_scale / l). Barriers: q_bar, idx_bar, k_full / k_empty (K tiles), p_full / p_empty (P slots; slot 2 of
  p_full: kv_scale / l written).
  """
  q_gmem: object
  qs_gmem: object
  kv_gmem: object
  idx_gmem: object
  scal_gmem: object
  o_gmem: object
  lse_gmem: object
  q_sw: object
  k_sw: object
  v16: object
  p_sw: object
  idx_smem: object
  lse_smem: object
  head_smem: object
  q_bar: object
  idx_bar: object
  k_full: object
  k_empty: object
  p_full: object
  p_empty: object


def scale_columns(accs, values):
  """Each [R, C] register tile of ``accs`` times a per-column [C] vector (heads on the columns: alpha, 1/l)."""
  return tuple(a * lax.broadcast_in_dim(values, a.shape, [1]) for a in accs)


def scale_rows(accs, values):
  """Each [R, C] register tile of ``accs`` times a per-row [R] vector (heads on the rows: alpha, 1/l)."""
  return tuple(a * lax.broadcast_in_dim(values, a.shape, [0]) for a in accs)


@dataclasses.dataclass(frozen=True)
class TileLayout:
  """How the cache rows of one dtype sit in a gathered K tile (and Q in its tile): ``chunks`` column chunks of 128
  bytes, [chunks, 64, chunk_cols] of ``dtype`` with the 128-byte swizzle (wgmma-ready), chunk c holding cache
  columns ``cols[c]`` to ``cols[c] + chunk_cols``. float8_e4m3fn (:data:`FP8_TILES`): 5 chunks of 128 columns,
  the last one the tail 448-575 (Q as latent | 64 zeros | rope, 640 columns, so latent 448-511 counts once);
  bfloat16 (:data:`BF16_TILES`): 9 chunks of 64 columns, Q as it is (576)."""
  dtype_name: str
  cols: tuple[int, ...]

  @property
  def dtype(self):
    return jnp.dtype(self.dtype_name)

  @property
  def chunks(self) -> int:
    return len(self.cols)

  @property
  def chunk_cols(self) -> int:
    return SW_CHUNK // self.dtype.itemsize


FP8_TILES = TileLayout("float8_e4m3fn", (0, 128, 256, 384, SW_TAIL_COL))
BF16_TILES = TileLayout("bfloat16", tuple(range(0, D_QK, 64)))


def tile_layout(dtype) -> TileLayout:
  """The :class:`TileLayout` of a cache dtype (float8_e4m3fn or bfloat16)."""
  name = jnp.dtype(dtype).name
  for lay in (FP8_TILES, BF16_TILES):
    if lay.dtype_name == name:
      return lay
  raise ValueError(f"no K-tile layout for cache dtype {name}; expected float8_e4m3fn or bfloat16")


def q_scratch(rows: int, layout: TileLayout = FP8_TILES):
  """Q as the layout's chunks [chunks, rows, chunk_cols] (fp8: five 128-column chunks of latent | 0 | rope),
  128-byte swizzled: wgmma-ready."""
  return plgpu.SMEM((layout.chunks, rows, layout.chunk_cols), layout.dtype,
                    transforms=swizzled(layout.dtype, SW_CHUNK))


def k_scratch(k_buffers: int, layout: TileLayout = FP8_TILES):
  """The gathered K tiles [k_buffers, chunks, 64, chunk_cols] (fp8: [k_buffers, 5, 64, 128]), 128-byte swizzled
  (wgmma operands; see :func:`gather_tiles`)."""
  return plgpu.SMEM((k_buffers, layout.chunks, TILE, layout.chunk_cols), layout.dtype,
                    transforms=swizzled(layout.dtype, SW_CHUNK))


def k_full_arrivals(interpret: bool, layout: TileLayout = FP8_TILES) -> int:
  """Arrivals per tile on ``k_full`` for :func:`gather_tiles`: one of the loader warpgroup on hardware, one per
  row copy in interpret mode."""
  return layout.chunks * TILE if interpret else 1


def gather_tiles(kv_gmem, k_sw, idx_smem, k_full, k_empty, *, num_slots: int, n_tiles, k_buffers: int,
                 interpret: bool, before_gather=lambda t: None, layout: TileLayout = FP8_TILES, runs=None):
  """The loader's gathers: per 64-key tile t, once the consumers have released K buffer ``t % k_buffers``
  (``k_empty``), the rows ``idx_smem[t]`` of ``kv_gmem`` [num_slots, 576] land in the 128-byte-swizzled K tile
  (chunks 0-3: cache columns 0-511; chunk 4: columns 448-575) and ``k_full`` is signalled. An id outside
  [0, num_slots) is an invalid key: its row is zero-filled and nothing outside the cache is read.
  ``before_gather(t)`` runs after buffer t % k_buffers is free and before tile t's gather. ``layout``: the
  cache dtype's :class:`TileLayout` (the chunks above are fp8's; bf16 rows land in nine 64-column chunks).
  ``runs`` (``idx_smem`` unused): tile t is instead the ``count`` consecutive rows from ``first``,
  ``(first, count) = runs(t)`` (traced scalars; rows count ... 63 zero-filled, all of them where ``first`` is
  outside [0, num_slots)): the dense kernel's tiles of pages. ``n_tiles``: a Python int, or traced.

  On hardware the loader warpgroup's 128 threads gather each tile with 16-byte ``cp.async`` loads
  (``kernels/gather_threads.py``: 20 per thread and tile, one group per tile) and keep ``k_buffers - 2`` tiles in
  flight behind the newest: after issuing tile t they wait until tile t - lag has landed and arrive on its
  ``k_full`` (one arrival of the warpgroup). No deadlock: the next ``k_empty`` wait (tile t + 1 - k_buffers) is for
  a tile already published since lag <= k_buffers - 1.

  Interpret mode (no ``inline_mgpu``) copies each row instead: five 128-byte copies into one-row slices of
  ``k_sw``, issued per warp, each arriving on ``k_full`` (5 · 64 arrivals); an invalid id copies row
  ``num_slots``, wholly past the end of ``kv_gmem``, which the copy zero-fills.
  """
  def tiles(gather):     # per tile t: wait for its buffer, before_gather(t), gather(t, buffer)
    @pl.loop(0, n_tiles)
    def _(t):
      kb = lax.rem(t, k_buffers)

      with jax.named_scope("l_wait_empty"):     # named regions: spans of the in-kernel profiler (no-ops without it)
        @pl.when(t >= k_buffers)
        def _():
          plgpu.barrier_wait(k_empty.at[kb])
      before_gather(t)
      with jax.named_scope("l_gather"):
        gather(t, kb)

  if not interpret:
    from mla_pallas.kernels import gather_threads   # raw Mosaic GPU code: imported where it is used

    lag = max(k_buffers - 2, 0)     # tiles left in flight behind the newest one

    def gather_by_threads(t, kb):
      if runs is None:
        gather_threads.gather_tile(kv_gmem, k_sw.at[kb], idx_smem, t, num_slots=num_slots, layout=layout)
      else:
        gather_threads.copy_run(kv_gmem, k_sw.at[kb], *runs(t), num_slots=num_slots, layout=layout)
      gather_threads.wait_tiles(lag)

      @pl.when(t >= lag)
      def _():
        plgpu.barrier_arrive(k_full.at[lax.rem(t - lag, k_buffers)])
    tiles(gather_by_threads)
    gather_threads.wait_tiles(0)
    if isinstance(n_tiles, int):
      for tile in range(max(n_tiles - lag, 0), n_tiles):
        plgpu.barrier_arrive(k_full.at[tile % k_buffers])
    else:
      for back in range(lag, 0, -1):
        tile = n_tiles - back

        @pl.when(tile >= 0)
        def _():
          plgpu.barrier_arrive(k_full.at[lax.rem(tile, k_buffers)])
  else:
    def gather_rows(t, kb):
      run = None if runs is None else runs(t)

      def issue_row(r):
        if run is None:
          rid = safe_row(idx_smem[t, r], num_slots)
        else:
          first, count = run
          rid = jnp.where((r < count) & (first >= 0) & (first < num_slots - r), first + r, num_slots)
        row = kv_gmem.at[pl.ds(rid, 1)]
        for c in range(layout.chunks):
          src = row.at[:, pl.ds(layout.cols[c], layout.chunk_cols)]
          plgpu.copy_gmem_to_smem(src, k_sw.at[kb, c, pl.ds(r, 1)], k_full.at[kb])
      for_rows_per_warp(TILE, issue_row)
    tiles(gather_rows)
  drain(k_empty, n_tiles, k_buffers)


def stage_v16(k_tiles, v16, chunks):
  """V as float16, un-transposed: the 128-column ``chunks`` of the swizzled K tiles (k_tiles [5, T, 128] fp8) ->
  the same columns of v16 [T, 512] f16.

  16-bit wgmma accepts an MN-major operand, so P.V in f16 needs no transpose: a vectorised load of each chunk, an
  exact e4m3 -> f16 conversion (every e4m3 value is an f16 value) and a store. (e4m3 -> bf16 has no hardware
  conversion on sm_90 with this ptxas; f16 has.)
  """
  for c in chunks:
    v16.at[:, pl.ds(c * SW_CHUNK, SW_CHUNK)][...] = plgpu.load(
        k_tiles.at[c], layout=plgpu.Layout.WGMMA_8BIT, optimized=False).astype(jnp.float16)


def accumulate(issue, accs, interpret: bool):
  """``accs`` (f32 register tiles, WGMMA layout) plus the wgmmas ``issue(acc_refs)`` issues into them, waited for.

  On hardware the accumulators are seeded from the registers and the wgmmas accumulate in place (a second
  64 x 256 f32 accumulator would spill); the interpreter cannot seed an accumulator from registers, so there the
  wgmmas go into fresh zero accumulators that are then added.
  """
  if interpret:
    def fresh(*refs):
      issue(refs)
      return tuple(r[...] for r in refs)
    return tuple(a + f for a, f in zip(accs, pl.run_scoped(fresh, *[plgpu.ACC(a.shape, jnp.float32)
                                                                    for a in accs])))

  def in_place(refs):
    issue(refs)
    plgpu.wgmma_wait(0)
  return tuple(pl.run_state(in_place)(tuple(plgpu.ACC.init(a) for a in accs)))


def store_lse(wg, m, l, lse_smem, lse_dst):
  """Consumer 0 writes the split's lse = (m + log2 l) · ln 2 (natural log) through SMEM and one TMA (of the first
  ``lse_dst.shape[0]`` rows)."""
  @pl.when(wg == 0)
  def _():
    lse_smem[...] = (m + jnp.log2(l)) * LN2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, lse_dst.shape[0])], lse_dst)
    plgpu.wait_smem_to_gmem(0)
