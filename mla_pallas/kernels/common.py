"""Pieces shared by the Mosaic GPU kernels of mla_pallas.

* Constants of the latent row format (576 fp8 values = 9 chunks of 64 bytes; TMA slots padded to 640 bytes).
* :class:`TuningConfigBase`: frozen tuning-config base whose subclasses validate themselves.
* SMEM transforms for wgmma-ready tiles, SMEM budget accounting.
* Row-gather and staging helpers used inside kernel bodies (per-row TMA into 128-byte-aligned slots, K re-swizzle,
  V transpose), the interpret-mode barrier drain, one online-softmax step (:func:`online_softmax_tile`) and the
  interpret keyword of ``plgpu.kernel`` (:func:`interpret_kwargs`).
"""
from __future__ import annotations

import dataclasses
import math

from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

FP8 = jnp.float8_e4m3fn
D_QK = 576            # latent (512) + rope (64)
D_V = 512             # value = first 512 latent values
CHUNK = 64            # bytes per chunk of an fp8 row; wgmma K-chunk with 64-byte swizzle
N_CHUNKS = D_QK // CHUNK      # 9
V_CHUNKS = D_V // CHUNK       # 8
SLOT_CHUNKS = N_CHUNKS + 1    # 640-byte slot: every per-row TMA destination is 128-byte aligned
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
SMEM_LIMIT = 227 * 1024       # usable dynamic SMEM per CTA on sm_90 / sm_100
P_SCALE = 256.0               # softmax P in [0, 1] is stored as fp8(256 p): exact power of two, max 256 < 448

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


def gather_rows(kv_rows, row_of, lin_slot, barrier, *, tile: int):
  """Issue one TMA per gathered row into a linear, 640-byte-padded SMEM slot.

  Args:
    kv_rows: GMEM ref of the cache viewed as [num_slots * 9, 64] fp8. Row ``i`` is chunks [9 i, 9 i + 9); the box
      copied is 10 chunks (640 bytes, the next row's first chunk rides along, zero-filled past the end). A row id
      of ``num_slots`` (the sanitised "invalid" marker) lies wholly past the end, so TMA zero-fills it: nothing is
      read out of bounds.
    row_of: function r -> scalar int32 row id of tile row ``r``.
    lin_slot: SMEM ref [tile, 10, 64] fp8 (one ring slot).
    barrier: barrier ref receiving one arrival per copy (``num_arrivals=tile``).
  """
  for_rows_per_warp(tile, lambda r: plgpu.copy_gmem_to_smem(
      kv_rows.at[pl.ds(row_of(r) * N_CHUNKS, SLOT_CHUNKS)], lin_slot.at[r], barrier))


def for_rows_per_warp(tile: int, issue_row) -> None:
  """Call ``issue_row(r)`` for the ``tile`` rows of a gather, issued per warp (warp w takes rows
  [w · tile/4, (w + 1) · tile/4)). In Lane semantics a warpgroup-level copy adds a warpgroup barrier and 128
  barrier arrivals per row, which made the first version issue-bound at ~12 us per 64-row tile on an H200
  (2026-11-29)."""
  per_warp = tile // 4

  @plgpu.warp_map
  def _(w):
    @pl.loop(0, per_warp)
    def _(r0):
      issue_row(w * per_warp + r0)


def stage_k(lin_slot, k_sw, chunks=range(N_CHUNKS)):
  """K re-swizzle: linear [T, 10, 64] fp8 rows -> nine swizzled [T, 64] tiles (k_sw [9, T, 64]), no dtype cast."""
  for c in chunks:
    k_sw.at[c][...] = plgpu.load(lin_slot.at[:, c], layout=plgpu.Layout.WGMMA_8BIT, optimized=False)


def stage_vt(k_sw, vt_sw, chunks=range(V_CHUNKS)):
  """V transpose: the first 512 values of the staged K tiles (k_sw [9, T, 64], swizzled) -> V^T [512, T].

  V^T is the K-major B operand of P.V that FP8 wgmma requires on Hopper. The transpose uses the vector-length-1
  layout (``Layout._WGMMA_ACC_32BIT``), the only FP8 transpose Mosaic GPU lowers on Hopper in JAX 0.11.2
  (../shared/mgpu/README.md section 6). It reads the *swizzled* K tiles, not the linear rows: linear rows are
  128-byte aligned, so a column of them sits in one SMEM bank (16-way conflicts); the 64-byte swizzle spreads
  a column over 8 banks groups. On an H200 the transpose from linear rows cost ~665 of 1172 us at the
  FlashMLA headline shape (ablation, 2026-11-29).
  """
  for c in chunks:
    vt_sw.at[pl.ds(c * CHUNK, CHUNK)].T[...] = plgpu.load(
        k_sw.at[c], layout=plgpu.Layout._WGMMA_ACC_32BIT, optimized=False)


def stage_v16(k_sw, v16, chunks=range(V_CHUNKS), width: int = CHUNK):
  """V as float16, un-transposed: swizzled K tiles (k_sw [9, T, 64] fp8, or [5, T, 128] with ``width=128``) ->
  v16 [T, 512] f16 (swizzle 128).

  16-bit wgmma accepts an MN-major B operand, so P.V in f16 needs no transpose: a vectorised load of each 64 x 64
  fp8 tile, an exact e4m3 -> f16 conversion (every e4m3 value is an f16 value) and a store. (e4m3 -> bf16 has no
  hardware conversion on sm_90 with this ptxas; f16 has.)
  """
  for c in chunks:
    v16.at[:, pl.ds(c * width, width)][...] = plgpu.load(
        k_sw.at[c], layout=plgpu.Layout.WGMMA_8BIT, optimized=False).astype(jnp.float16)


def safe_row(i, num_slots: int):
  """Scalar row id to gather for a raw top-k entry ``i``: itself when 0 <= i < num_slots, else ``num_slots`` (one
  row past the end of the cache, so its TMA box is zero-filled and nothing is read out of bounds)."""
  return jnp.where((i < 0) | (i >= num_slots), num_slots, i)


def valid_keys(ids, num_slots: int):
  """Mask of the keys that count: raw top-k entries (or sanitised ones) inside [0, num_slots)."""
  return (ids >= 0) & (ids < num_slots)


def drain(barrier, n_steps, n_slots: int, slot_of=lambda s: s):
  """Observe the last completed phase of each ring slot (required by the interpret-mode barrier rule; harmless on
  hardware): wait once more on the 'consumed' barrier of the last ``min(n_steps, n_slots)`` steps. ``n_steps``
  may be a traced int32 (a persistent kernel's step count)."""
  if isinstance(n_steps, int):
    for s in range(max(n_steps - n_slots, 0), n_steps):
      plgpu.barrier_wait(barrier.at[slot_of(s) % n_slots])
    return
  for i in range(n_slots):
    s = n_steps - n_slots + i

    @pl.when(s >= 0)
    def _():
      plgpu.barrier_wait(barrier.at[lax.rem(slot_of(s), n_slots)])


def online_softmax_tile(s, valid_cols, row_scale, m, l, keys_axis: int = 1):
  """One online-softmax step in base 2 over a [rows, keys] f32 tile of raw logits ``s`` (register values).

  Args:
    s: [R, T] f32 raw Q.K products (``keys_axis=0``: the transposed tile Sᵀ [T, R], heads on the columns);
    valid_cols: [T] bool (False: masked key); row_scale: [R] f32 (folds q_scale, kv_scale, softmax_scale and
    log2 e); m, l: [R] running max (base-2 logits) and running sum; ``l`` may also have the shape of ``s``
    (running sums per element: no reduction over the keys in this step, the caller sums once at the end).
  Returns:
    (p [R, T] (or [T, R]) = 2^(s' - m_new) in [0, 1], alpha [R] = 2^(m - m_new) to rescale the running output,
    m_new, l_new). A row with nothing valid so far keeps m = -inf and gets p = 0, alpha = 0 (never NaN).
  """
  head_axis = 1 - keys_axis
  valid = lax.broadcast_in_dim(valid_cols, s.shape, [keys_axis])
  s = s * lax.broadcast_in_dim(row_scale, s.shape, [head_axis])
  s = jnp.where(valid, s, -jnp.inf)
  m_new = jnp.maximum(m, s.max(axis=keys_axis))
  m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
  alpha = jnp.exp2(m - m_use)
  p = jnp.exp2(s - lax.broadcast_in_dim(m_use, s.shape, [head_axis]))
  if l.ndim == s.ndim:   # running sums kept per element (summed over the keys by the caller, after the last tile)
    return p, alpha, m_new, l * lax.broadcast_in_dim(alpha, s.shape, [head_axis]) + p
  return p, alpha, m_new, l * alpha + p.sum(axis=keys_axis)


def interpret_kwargs(interpret) -> dict:
  """``plgpu.kernel`` keyword arguments for ``interpret``: False/None -> {} (native), True -> default
  ``InterpretGPUParams``, an ``InterpretGPUParams`` (e.g. with ``detect_races=True``) -> itself."""
  if not interpret:
    return {}
  return {"interpret": interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()}
