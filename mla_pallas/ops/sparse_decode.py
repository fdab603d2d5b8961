"""Sparse (top-k) MLA decode and prefill: ``sparse_mla_decode`` and ``sparse_mla_prefill``.

Semantics are exactly those of :func:`mla_pallas.reference.sparse_mla_decode`; the implementations differ only in
where FP8 rounding happens (the error model is in :mod:`mla_pallas.testing`):

* ``impl="mosaic"``: the native-FP8 Mosaic GPU kernel of the device's family. sm_90a (validated on an H200):
  :mod:`mla_pallas.kernels.sparse_sm90_heads_n` for H <= 16 (the heads on the MMAs' N side) and
  :mod:`mla_pallas.kernels.sparse_sm90_heads_m` above (the heads on the 64 MMA rows); P·V in f16 (P kept in
  f16, V upcast exactly). sm_100a (:mod:`mla_pallas.kernels.sparse_decode_sm100`: lowered and interpreted only,
  never run on Blackwell silicon, so ``impl="auto"`` does not pick it on hardware): P·V in FP8 with P as
  fp8(256·p). Q is quantized to e4m3 per (token, head) row with a dynamic scale folded into the logits; QKᵀ
  runs on FP8 tensor cores with f32 accumulation. :func:`default_config` maps a shape to the kernel, its config
  and the split plan; :func:`sweep_configs` lists the tuning candidates beside it.
  In interpret mode the family is that of :func:`mla_pallas._dispatch.mosaic_arch` ("sm90" on a CPU; tests
  select "sm100" by faking ``_dispatch.gpu_arch``) or the ``arch=`` argument of ``_sparse_decode_jit``.
* ``impl="xla"``: the same quantization of Q and P with FP8 ``einsum``s in XLA (cuBLASLt on a GPU), so both paths
  can be compared like for like.

A bfloat16 cache (BF16 attention: q and P in bf16, f32 accumulation, no scales rounded) runs on the heads-on-M
kernel with ``cache_dtype="bfloat16"`` on sm_90 at every kernel head count (H < 64 zero-padded to the 64 MMA
rows: over a bf16 cache the gather of 1152-byte rows, not the MMAs, bounds small-H decode), and on the XLA path
elsewhere. ``impl="auto"`` picks it on hardware where it was validated there (:func:`validated_on`: every kernel head
count on the H200).

Shapes (decode): q [B, s_q, H, 576] bf16/f32; kv_cache [num_pages, page_size, 576] or [num_slots, 576]
float8_e4m3fn (or bfloat16); indices [B, s_q, topk] int32 flat slot ids (slot = page · page_size + offset; < 0 or ≥ num_slots
masked); topk_length [B] int32 or None (only the first topk_length[b] indices of batch b count). Returns
out [B, s_q, H, 512] bf16 and lse [B, s_q, H] f32 (natural log; −inf and out 0 where nothing is valid).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
from jax import lax
import jax.numpy as jnp

from mla_pallas import _checks, _dispatch, quant
from mla_pallas.kernels.common import D_QK, D_V, FP8, LOG2E, P_SCALE, Q_SW_COLS, TILE   # P_SCALE: XLA path's P

KERNEL_HEADS = (8, 16, 32, 64, 128)
CACHE_DTYPES = (FP8, jnp.bfloat16)    # bfloat16: BF16 attention (q and P in bf16), XLA path only
KERNEL_ARCHS = ("sm90", "sm100")
# Families on which the kernel ran and matched the reference on real hardware: impl="auto" picks the kernel
# natively only there. sm100: lowered and interpreted only (no Blackwell GPU has run it). The bf16-cache kernel
# (heads on M, sm_90): its GPU tests passed on the H200 at the head counts BF16_VALIDATED_HEADS
# (tests/test_sparse_decode_gpu.py::test_bf16_cache_kernel).
VALIDATED_ON = ("sm90",)
BF16_VALIDATED_ON: tuple[str, ...] = ("sm90",)
BF16_VALIDATED_HEADS = KERNEL_HEADS   # all five passed on the H200 (2026-12-02)


def validated_on(cache_dtype, h: int | None = None) -> tuple[str, ...]:
  """The kernel families validated on hardware for a cache dtype and head count (``_dispatch.choose``'s
  ``validated_on``; ``h=None``: the families validated at some head count)."""
  if jnp.dtype(cache_dtype) == FP8:
    return VALIDATED_ON
  return BF16_VALIDATED_ON if h is None or h in BF16_VALIDATED_HEADS else ()


Q_DTYPES = (jnp.bfloat16, jnp.float32)


def q_parts(q, lead: str = "B, s_q, H") -> tuple:
  """The query argument of the attention ops as a tuple of one or two arrays, checked: ``q`` [lead..., 576], or a
  pair ``(q_latent [lead..., 512], q_rope [lead..., 64])`` with the same leading dims (FlashInfer's q_nope / q_pe
  form; the row is their concatenation). Each part bfloat16 or float32. ``lead`` names the leading dims in
  messages. The pair lets a kernel that quantizes q itself read both parts where they are, with no concatenated
  copy (one XLA launch less per decode step)."""
  ndim = len(lead.split(",")) + 1
  if isinstance(q, (tuple, list)):
    if len(q) != 2:
      raise ValueError(f"q must be an array [{lead}, 576] or a pair (q_latent [{lead}, 512], q_rope [{lead}, 64]); "
                       f"got a sequence of {len(q)} items")
    lat, rope = q
    _checks.check_array("q[0] (q_latent)", lat, ndim=ndim, shape=(None,) * (ndim - 1) + (D_V,), dtypes=Q_DTYPES,
                        expect=f"[{lead}, {D_V}]")
    _checks.check_array("q[1] (q_rope)", rope, ndim=ndim, shape=tuple(lat.shape[:-1]) + (D_QK - D_V,),
                        dtypes=Q_DTYPES, expect=f"[{lead}, {D_QK - D_V}] with q_latent's leading dims "
                        f"{tuple(lat.shape[:-1])}")
    return (lat, rope)
  _checks.check_array("q", q, ndim=ndim, shape=(None,) * (ndim - 1) + (D_QK,), dtypes=Q_DTYPES,
                      expect=f"[{lead}, {D_QK}] (or a (q_latent, q_rope) pair)")
  return (q,)


def q_shape(parts) -> tuple:
  """The shape [..., 576] of the query that :func:`q_parts` ``parts`` make."""
  return tuple(parts[0].shape[:-1]) + (D_QK,)


def _as_parts(q) -> tuple:
  """An array or a (latent, rope) pair (already checked by :func:`q_parts`) as a tuple of one or two arrays."""
  return tuple(q) if isinstance(q, (tuple, list)) else (q,)


def join_q(q):
  """One [..., 576] array from an array or a (latent, rope) pair (:func:`q_parts`; float32 if either part is)."""
  parts = _as_parts(q)
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def _check_args(q, kv_cache, indices, topk_length, softmax_scale, kv_scale, *, prefill: bool):
  parts = q_parts(q, "T, H" if prefill else "B, s_q, H")
  shape = q_shape(parts)
  if prefill:
    _checks.check_array("indices", indices, ndim=2, shape=(shape[0], None), dtypes=(jnp.int32,),
                        expect=f"[T={shape[0]}, topk]")
  else:
    _checks.check_array("indices", indices, ndim=3, shape=(shape[0], shape[1], None), dtypes=(jnp.int32,),
                        expect=f"[B={shape[0]}, s_q={shape[1]}, topk]")
  lead = shape[0]
  _checks.check_array("kv_cache", kv_cache, ndim=(2, 3), dtypes=CACHE_DTYPES,
                      expect="[num_pages, page_size, 576] or [num_slots, 576]")
  if kv_cache.shape[-1] != D_QK:
    raise ValueError("kv_cache must have shape [num_pages, page_size, 576] or [num_slots, 576] and dtype "
                     f"float8_e4m3fn or bfloat16; got shape {tuple(kv_cache.shape)}")
  if kv_cache.ndim == 3:
    _checks.check_page_size("kv_cache.shape[1] (page_size)", kv_cache.shape[1])
  if indices.shape[-1] < 1:
    raise ValueError(f"indices must have topk >= 1 entries in its last axis; got shape {tuple(indices.shape)}")
  if topk_length is not None:
    _checks.check_array("topk_length", topk_length, shape=(lead,), dtypes=(jnp.int32,),
                        expect=f"[{'T' if prefill else 'B'}={lead}]")
  _checks.check_scalar("softmax_scale", softmax_scale, positive=True)
  _checks.check_scalar("kv_scale", kv_scale, positive=True)
  return parts


def _valid_mask(indices, num_slots, topk_length):
  """[..., topk] bool: index in range and (with topk_length [B]) position < topk_length[b]."""
  valid = (indices >= 0) & (indices < num_slots)
  if topk_length is not None:
    pos = lax.broadcasted_iota(jnp.int32, indices.shape, indices.ndim - 1)
    lens = topk_length.reshape(topk_length.shape + (1,) * (indices.ndim - 1))
    valid &= pos < lens
  return valid


def xla_operands(q, cache_dtype):
  """The XLA paths' arithmetic by cache dtype: (q operand, per-row q scale, P operand fn, P scale). FP8 cache: q
  in e4m3 per (token, head) row with its scale, P as fp8(P_SCALE p); bfloat16 cache (BF16 attention): q and P in
  bf16, no scales. Both multiply into f32 accumulators."""
  if cache_dtype == FP8:
    q8, q_scale = quant.quantize_rows_fp8(q)
    return q8, q_scale, lambda p: (p * P_SCALE).astype(FP8), P_SCALE
  return q.astype(jnp.bfloat16), jnp.ones(q.shape[:-1], jnp.float32), lambda p: p.astype(jnp.bfloat16), 1.0


def _xla_sparse_decode(q, kv_flat, indices, softmax_scale, kv_scale, topk_length):
  """XLA path. q [B, S, H, 576]; kv_flat [N, 576] fp8 or bf16; indices [B, S, K]."""
  num_slots = kv_flat.shape[0]
  valid = _valid_mask(indices, num_slots, topk_length)                      # [B, S, K]
  rows = jnp.take(kv_flat, jnp.where(valid, indices, 0), axis=0)           # [B, S, K, 576]
  rows = jnp.where(valid[..., None], rows, jnp.zeros((), rows.dtype))      # masked rows: exact zeros, never NaN
  q_op, q_scale, p_op, p_scale = xla_operands(q, kv_flat.dtype)
  s = jnp.einsum("bshd,bskd->bshk", q_op, rows, preferred_element_type=jnp.float32)
  s = s * (q_scale * (softmax_scale * kv_scale * LOG2E))[..., None]        # base-2 logits
  s = jnp.where(valid[:, :, None, :], s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  m_use = jnp.where(m == -jnp.inf, 0.0, m)
  p = jnp.exp2(s - m_use[..., None])
  l = jnp.sum(p, axis=-1)
  o = jnp.einsum("bshk,bskd->bshd", p_op(p), rows[..., :D_V], preferred_element_type=jnp.float32)
  o = o * (kv_scale / (p_scale * jnp.where(l == 0, 1.0, l)))[..., None]
  lse = (m + jnp.log2(l)) * math.log(2.0)
  return o.astype(jnp.bfloat16), lse


MAX_KERNEL_SLOTS = (2 ** 31 - 1) // 9 - 2    # the kernel addresses 64-byte chunks of the cache with int32


def _kernel_supported(q_shape, num_slots=None, interpret=False, cache_dtype=FP8):
  def check():
    _, s_q, h, _ = q_shape
    if num_slots is not None and num_slots > MAX_KERNEL_SLOTS:
      raise NotImplementedError(f"sparse_mla_decode kernel supports caches of up to {MAX_KERNEL_SLOTS} slots; "
                                f"got {num_slots}")
    arch = _dispatch.mosaic_arch(interpret)
    if arch not in KERNEL_ARCHS:
      raise NotImplementedError(f"sparse_mla_decode has Mosaic GPU kernels for {KERNEL_ARCHS} only; this device "
                                f"needs a {arch} kernel, which does not exist")
    if h not in KERNEL_HEADS:
      raise NotImplementedError(f"sparse_mla_decode kernel supports H in {KERNEL_HEADS}; got H={h}")
    if jnp.dtype(cache_dtype) != FP8 and arch != "sm90":
      raise NotImplementedError(f"sparse_mla_decode has a bfloat16-cache kernel for sm90 only; {arch} runs the "
                                f"XLA path")
  return check


# ----------------------------------------------------------------------------------------------------------------
# Shape -> kernel config (the one place), sweep candidates, split plan

HEADS_ON_N_MAX = 16     # sm_90: kernels/sparse_sm90_heads_n.py up to this many heads, sparse_sm90_heads_m.py above
MAX_SPLIT_TILES = 32    # <= 2048 keys per split: heads on N and sm_100 (index SMEM; longer splits not measured)
HEADS_M_MAX_SPLIT_TILES = 128   # heads on M: <= 8192 keys per split (32 KB of indices; P5 2 x 128 tiles measured)
BF16_MAX_SPLIT_TILES = 16   # bf16 cache: bf16 Q (72 KB) and two bf16 K tiles (144 KB) leave room for 4 KB of indices
# ... and 8 KB in "producer_vt" over bf16 (no P slots: P sits in the K buffer; no reduction scratch): a top-k of 2048
# in one split, so no split merge at prefill shapes such as F1.
BF16_PRODUCER_MAX_SPLIT_TILES = 32
MIN_SPLIT_TILES = 4     # splitting stops before a split would be shorter than 256 keys (heads on N, sm_100) ...
HEADS_M_MIN_SPLIT_TILES = 2   # ... or 128 keys (heads on M: B1 H128 top-k 2048 26.1 -> 21.7 us with 2-tile splits)
HEADS_M_ONE_TILE_MAX_CTAS = 64   # heads on M: one-tile splits where that grid has at most this many CTAs
CTA_OVERHEAD_TILES = 3  # a CTA's start and end (Q, first gather, O store, its share of the merge) in tile times
DESIGNS = ("sm90_heads_m", "sm90_heads_n", "sm100")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """A shape's kernel choice: ``design`` (one of DESIGNS, i.e. a kernel module), ``num_splits`` (top-k splits per
  query tile, merged by lse) and ``kernel``, that module's frozen ``TuningConfig`` (its ``tiles_per_split`` is the
  split length in 64-key tiles)."""
  design: str
  num_splits: int
  kernel: object

  @property
  def module(self):
    return _kernel_module(self.design)


def _kernel_module(design: str):
  if design == "sm90_heads_m":
    from mla_pallas.kernels import sparse_sm90_heads_m as mod
  elif design == "sm90_heads_n":
    from mla_pallas.kernels import sparse_sm90_heads_n as mod
  elif design == "sm100":
    from mla_pallas.kernels import sparse_decode_sm100 as mod
  else:
    raise ValueError(f"design must be one of {DESIGNS}; got {design!r}")
  return mod


def _design(h: int, arch: str, bf16: bool = False) -> str:
  """The kernel design: sm_100, or on sm_90 heads on N up to HEADS_ON_N_MAX heads and heads on M above; a bf16
  cache always heads on M (its only bf16 design)."""
  if arch == "sm100":
    return "sm100"
  if arch == "sm90":
    return "sm90_heads_n" if h <= HEADS_ON_N_MAX and not bf16 else "sm90_heads_m"
  raise NotImplementedError(f"sparse_mla_decode has Mosaic GPU kernels for {KERNEL_ARCHS} only; got {arch!r}")


def _tiles_per_token(h: int, design: str) -> int:
  """Query tiles per token: 64-row tiles of heads (H = 128: two), one with the heads on the MMAs' N side."""
  return 1 if design == "sm90_heads_n" else max(1, h // TILE)


def _max_split_tiles(design: str) -> int:
  """The longest split the plan makes for a design: HEADS_M_MAX_SPLIT_TILES on heads on M (P5, top-k 16384:
  2 splits of 128 tiles 2725 us, 4 of 64 2844, 8 of 32 3129; docs/kernels/sparse_decode_sm90.md, "Split plan"),
  MAX_SPLIT_TILES on the others (longer splits not measured there)."""
  return HEADS_M_MAX_SPLIT_TILES if design == "sm90_heads_m" else MAX_SPLIT_TILES


def _min_split_tiles(design: str, ctas: int, topk: int) -> int:
  """The shortest split the plan makes for a design and a grid of ``ctas`` query tiles over a top-k of ``topk``
  (fp8 cache, docs/kernels/sparse_decode_sm90.md "Split plan"): heads on M one tile while one-tile splits make at
  most HEADS_M_ONE_TILE_MAX_CTAS CTAs (with "twin" quantizing Q in the kernel, top-k 2048: B1 H128, 64 CTAs,
  2-tile splits 16.9 us, 1-tile 15.3; B1 H64 16.3 / 14.5; B2 H128, 128 CTAs: 18.0 / 19.1, the f32 partials of
  more splits cost more than the shorter CTAs save), else HEADS_M_MIN_SPLIT_TILES; the others MIN_SPLIT_TILES
  (heads on N B8 H8 / H16: 4-tile 17.3 / 18.3 us, 2-tile 17.2 / 18.9, 1-tile 23.1 / 26.5)."""
  if design != "sm90_heads_m":
    return MIN_SPLIT_TILES
  return 1 if ctas * max(1, -(-topk // TILE)) <= HEADS_M_ONE_TILE_MAX_CTAS else HEADS_M_MIN_SPLIT_TILES


def _plan(batch_tokens: int, tiles_per_token: int, topk: int, num_sms: int = 132,
          max_split_tiles: int = MAX_SPLIT_TILES, min_split_tiles: int = MIN_SPLIT_TILES):
  """Choose (num_splits, tiles_per_split): the least time in waves x (tiles per CTA + CTA_OVERHEAD_TILES).

  One CTA fits per SM (SMEM), so a grid of ``ctas · splits`` CTAs runs in ceil(ctas · splits / num_sms) waves,
  each CTA taking ``tiles_per_split`` tile times plus its fixed cost (CTA_OVERHEAD_TILES, fitted to the sweep of
  2026-12-02: one wave of 32 / 16 / 8 tiles against two of 16 / 8 / 4 at P4 / P3 / C0 gave 2.7-5.9 tiles).
  Splits range from the fewest that keep a split <= ``max_split_tiles`` tiles to the most that keep it >=
  ``min_split_tiles``; ties go to fewer splits (less partial output to merge). Doubling the splits until the CTAs
  reach ``num_sms`` (the plan before) turned grids just short of the SM count into two waves of half-length CTAs
  (docs/kernels/sparse_decode_sm90.md, "Split plan").
  """
  k_tiles = max(1, -(-topk // TILE))
  ctas = batch_tokens * tiles_per_token
  fewest = max(1, -(-k_tiles // max_split_tiles))
  most = max(fewest, k_tiles // min_split_tiles)
  cost = lambda n: (-(-ctas * n // num_sms)) * (-(-k_tiles // n) + CTA_OVERHEAD_TILES)
  splits = min(range(fewest, most + 1), key=lambda n: (cost(n), n))
  return splits, -(-k_tiles // splits)


def default_config(h: int, batch_tokens: int, topk: int, arch: str = "sm90",
                   cache_dtype: str = "float8_e4m3fn", batch_invariant: bool = False) -> KernelConfig:
  """The kernel, its config and the split plan for H heads, ``batch_tokens`` = B · s_q query tokens and a top-k
  of ``topk`` keys on kernel family ``arch`` ("sm90" | "sm100"), for this device's SM count
  (:func:`mla_pallas._dispatch.num_sms`). Rules: sm_90 puts H <= HEADS_ON_N_MAX heads on the MMAs' N side
  (sparse_sm90_heads_n, 4 K buffers), more on the 64 MMA rows (sparse_sm90_heads_m, 2 K buffers); the top-k is
  split (:func:`_plan`) until the CTAs fill the SMs or splits would get shorter than 256 keys. A bfloat16
  ``cache_dtype`` (heads on M only): splits of at most BF16_MAX_SPLIT_TILES (SMEM: bf16 Q and K tiles), "twin",
  or the fp8 cache's schedule rule where "producer_vt" over bf16 is validated (BF16_PRODUCER_VALIDATED_ON).
  ``batch_invariant``: splits of INVARIANT_SPLIT_TILES tiles whatever ``batch_tokens`` is (a row's reduction
  order then depends on its own top-k width only)."""
  bf16 = jnp.dtype(cache_dtype) != FP8
  design = _design(h, arch, bf16)
  if bf16 and design != "sm90_heads_m":
    raise NotImplementedError(f"no bfloat16-cache kernel for the {design} design (H={h}, {arch})")
  bf16_producer = bf16 and arch in BF16_PRODUCER_VALIDATED_ON
  if batch_invariant:
    tps = INVARIANT_SPLIT_TILES
    splits = -(-max(1, -(-topk // TILE)) // tps)
  else:
    tiles_per_token = _tiles_per_token(h, design)
    longest = BF16_PRODUCER_MAX_SPLIT_TILES if bf16_producer else BF16_MAX_SPLIT_TILES
    splits, tps = _plan(batch_tokens, tiles_per_token, topk, _dispatch.num_sms(),
                        longest if bf16 else _max_split_tiles(design),
                        MIN_SPLIT_TILES if bf16 else _min_split_tiles(design, batch_tokens * tiles_per_token, topk))
  if bf16:   # (a split longer than BF16_MAX_SPLIT_TILES gets "producer_vt": PRODUCER_MIN_TILES is below it)
    tuning = dict(cache_dtype="bfloat16", **(_heads_m_tuning(tps) if bf16_producer else {}))
  else:
    tuning = _heads_m_tuning(tps) if design == "sm90_heads_m" else {}
  return KernelConfig(design, splits, _kernel_module(design).TuningConfig(tiles_per_split=tps, **tuning))


# batch_invariant=True: every split is this many 64-key tiles whatever the batch (the split plan otherwise depends on
# the number of query tokens, and with it the order of each row's sums); 16 fits every design's limits.
INVARIANT_SPLIT_TILES = 16
PRODUCER_MIN_TILES = 8  # heads on M: "producer_vt" from splits this long; "twin" (Q quantized in the kernel) below
# Families where "producer_vt" over a bfloat16 cache (P in the K buffer's rope chunk, P·V from SMEM: kernels/
# sparse_sm90_heads_m.py) ran and matched the reference on hardware; elsewhere a bf16 cache runs "twin" (the
# sweep has both). On sm90 "producer_vt" with 32-tile splits took P1 443 -> 299 us and F1 7093 -> 4533 us
# against "twin" (benchmarks/RESULTS.md, thirty-sixth session).
BF16_PRODUCER_VALIDATED_ON: tuple[str, ...] = ("sm90",)


def _heads_m_tuning(tiles_per_split: int) -> dict:
  """The heads-on-M schedule for a split length (fp8 cache; docs/kernels/sparse_decode_sm90.md, "A P-producer
  warpgroup"): "producer_vt" was faster than "twin" at every split length measured, 8 to 128 tiles (C0 38.8 ->
  35.9 us, B32 H128 61.5 -> 53.5, B64 H64 61.6 -> 54.2), and than the earlier "handoff_vt" at 32 (P1 339.6 ->
  304.5); the 1-4-tile splits of small batches keep "twin" (not measured against it). Both quantize Q in the
  kernel."""
  if tiles_per_split >= PRODUCER_MIN_TILES:
    return dict(schedule="producer_vt")
  return {}


def _config(h: int, batch_tokens: int, topk: int, arch: str, tuning=(),
            cache_dtype: str = "float8_e4m3fn", batch_invariant: bool = False) -> KernelConfig:
  """:func:`default_config` with ``tuning`` ((field, value) pairs of the kernel's TuningConfig) applied; a
  ``tiles_per_split`` override re-plans the number of splits."""
  cfg = default_config(h, batch_tokens, topk, arch, cache_dtype, batch_invariant)
  kw = dict(tuning)
  if not kw:
    return cfg
  fields = {f.name for f in dataclasses.fields(cfg.kernel)}
  if set(kw) - fields:
    raise ValueError(f"tuning names {sorted(set(kw) - fields)}, which the {cfg.design} kernel's TuningConfig does "
                     f"not have (fields: {sorted(fields)})")
  kernel = dataclasses.replace(cfg.kernel, **kw)
  splits = -(-max(1, -(-topk // TILE)) // kernel.tiles_per_split) if "tiles_per_split" in kw else cfg.num_splits
  return KernelConfig(cfg.design, splits, kernel)


def sweep_configs(h: int, batch_tokens: int, topk: int, arch: str = "sm90",
                  cache_dtype: str = "float8_e4m3fn") -> dict[str, tuple[tuple[str, object], ...]]:
  """Labelled tuning overrides for benchmark sweeps (each a valid ``tuning=`` of :func:`_sparse_decode_jit`),
  first ``"default": ()``: the other K-buffer counts (sm_90) or gather ring depths (sm_100), the heads-on-M
  design's other schedules (``schedule``), and split lengths of 8-128 tiles where they differ from the default
  plan; where the default grid leaves SMs idle (small batches), also the splits shorter than MIN_SPLIT_TILES
  (1, 2 tiles: more CTAs, more partials to merge)."""
  cfg = default_config(h, batch_tokens, topk, arch, cache_dtype)
  out = {"default": ()}
  field = "stages" if cfg.design == "sm100" else "k_buffers"
  current = getattr(cfg.kernel, field)
  candidates = [((field, v),) for v in (1, 2, 3, 4) if v != current]
  if cfg.design == "sm90_heads_m":      # the other schedules (heads_m module docstring)
    schedules = cfg.module.TuningConfig.SCHEDULES
    candidates += [(("schedule", o),) for o in schedules if o != cfg.kernel.schedule]
    candidates += [(("schedule", o), ("k_buffers", 3)) for o in schedules if o != "twin"]   # no V tile: room
    if cfg.kernel.bf16:   # "producer_vt" / "seesaw" over bf16 take splits of up to BF16_PRODUCER_MAX_SPLIT_TILES
      candidates += [(("schedule", "producer_vt"), ("tiles_per_split", BF16_PRODUCER_MAX_SPLIT_TILES)),
                     (("schedule", "twin"), ("tiles_per_split", BF16_MAX_SPLIT_TILES)),
                     (("schedule", "seesaw"), ("tiles_per_split", BF16_PRODUCER_MAX_SPLIT_TILES))]
  k_tiles = max(1, -(-topk // TILE))
  # split lengths (64 and 128 tiles: a larger index buffer) only where the top-k is long enough to differ
  short = (1, 2, 4) if cfg.num_splits * batch_tokens * _tiles_per_token(h, cfg.design) < _dispatch.num_sms() else ()
  candidates += [(("tiles_per_split", t),) for t in short + (8, 16, 32, 64, 128)
                 if t != cfg.kernel.tiles_per_split and t < 2 * k_tiles]
  seen = {cfg}
  for tuning in candidates:
    try:
      cand = _config(h, batch_tokens, topk, arch, tuning, cache_dtype)
    except ValueError:      # not a valid config of this design (K_BUFFERS, SMEM, the bf16 cache's schedule)
      continue
    if cand not in seen:    # (e.g. "schedule=<the default>, k_buffers=3" is "k_buffers=3")
      seen.add(cand)
      out[", ".join(f"{k}={v}" for k, v in tuning)] = tuning
  return out


def _mosaic_sparse_decode(q, kv_flat, indices, softmax_scale, kv_scale, topk_length, interpret, tuning=(),
                          arch="sm90", batch_invariant=False):
  """The Mosaic path. ``q``: [B, s_q, H, 576] or a (latent, rope) pair (:func:`q_parts`): a kernel that quantizes q
  itself reads the pair's parts where they are; the other paths concatenate them (into their Q pre-pass)."""
  parts = _as_parts(q)
  b, s_q, h, _ = q_shape(parts)
  n_tok = b * s_q
  cfg = _config(h, n_tok, indices.shape[-1], arch, tuning, jnp.dtype(kv_flat.dtype).name, batch_invariant)
  o, lse = _mosaic_kernel(parts, kv_flat, indices, softmax_scale, kv_scale, topk_length, interpret, cfg, arch)
  tiles_per_token = _tiles_per_token(h, cfg.design)
  out_rows = o.shape[-2]   # 64, or with the heads on N out_heads (H rounded up to 8)
  if cfg.num_splits > 1 or batch_invariant:   # batch_invariant: always, so that a row's last rounding is the same
    o, lse = combine_splits(o, lse)           # whether its top-k width gives it one split or several
  else:
    o, lse = o[:, 0], lse[:, 0]
  o = o.reshape(n_tok, tiles_per_token * out_rows, D_V)[:, :h]
  lse = lse.reshape(n_tok, tiles_per_token * out_rows)[:, :h]
  return o.reshape(b, s_q, h, D_V).astype(jnp.bfloat16), lse.reshape(b, s_q, h)


def _mosaic_kernel(parts, kv_flat, indices, softmax_scale, kv_scale, topk_length, interpret, cfg: KernelConfig,
                   arch: str):
  """The attention kernel's own outputs under plan ``cfg``: split partials o [T · tiles, S, R, 512] (R = 64 rows of
  a heads-on-M tile, or the heads-on-N kernel's H rounded up to 8) and lse [T · tiles, S, R], not merged."""
  b, s_q, h, _ = q_shape(parts)
  topk = indices.shape[-1]
  num_slots = kv_flat.shape[0]
  n_tok = b * s_q
  heads_on_n = cfg.design == "sm90_heads_n"
  tiles_per_token = _tiles_per_token(h, cfg.design)
  splits, tps = cfg.num_splits, cfg.kernel.tiles_per_split
  k_pad = splits * tps * TILE

  # Pre-pass: Q in the kernel's layout (_kernel_q); the indices (fused XLA ops) only where needed: the sm_90
  # kernels mask ids outside [0, num_slots) themselves, so they pass through unless topk_length masks a tail or
  # the split grid needs padding (the sm_100 kernel takes sanitised unsigned ids).
  rows = indices
  if arch == "sm100" or topk_length is not None:
    rows = jnp.where(_valid_mask(indices, num_slots, topk_length), indices, num_slots)
  rows = rows.reshape(n_tok, topk)
  if k_pad > topk:
    rows = jnp.pad(rows, ((0, 0), (0, k_pad - topk)), constant_values=num_slots)
  rows = rows.reshape(n_tok, splits * tps, TILE)
  out_dtype = _partials_dtype(splits, bool(getattr(cfg.kernel, "bf16", False)),
                              getattr(cfg.kernel, "schedule", None) == "twin")
  q_in_kernel = heads_on_n or getattr(cfg.kernel, "q_in_kernel", False)
  q_split = q_in_kernel and len(parts) == 2
  if q_in_kernel:       # the kernel quantizes q itself (kernels/q_quant.quantize_head_rows), from its parts
    q_args = tuple(p.reshape(n_tok * h, p.shape[-1]) for p in parts)
  else:
    q_args = _kernel_q(join_q(parts).reshape(n_tok, h, D_QK), cfg, arch, tiles_per_token, softmax_scale, kv_scale)
  if heads_on_n:        # O [.., out_heads, 512]
    kern = cfg.module.build(n_tok, num_slots, splits, -(-h // 8) * 8, h, out_dtype, cfg.kernel, softmax_scale,
                            interpret=interpret, q_split=q_split)
  elif arch == "sm100":
    kern = cfg.module.build(n_tok * tiles_per_token, n_tok, num_slots, splits, tiles_per_token, out_dtype,
                            cfg.kernel, interpret=interpret)
  else:
    kern = cfg.module.build(n_tok * tiles_per_token, num_slots, splits, tiles_per_token, out_dtype, cfg.kernel,
                            interpret=interpret, heads=h, softmax_scale=softmax_scale, q_split=q_split)
  scal = jnp.asarray(kv_scale, jnp.float32).reshape(1)
  if arch == "sm100":   # gather4: 2-D cache, unsigned row ids (all in [0, num_slots])
    return kern(*q_args, kv_flat, rows.astype(jnp.uint32), scal)
  return kern(*q_args, kv_flat, rows, scal)


def _kernel_q(q, cfg: KernelConfig, arch: str, tiles_per_token: int, softmax_scale, kv_scale):
  """Q [T, H, 576] as the sm_100 kernel and the bf16-cache kernel read it (the sm_90 kernels over an fp8 cache
  quantize q themselves), with
  its per-row logit scales (q_scale · softmax_scale · kv_scale · log2 e, made as max |q| · f32(1/448) · ...:
  kernels/q_quant.row_scales): 64-row tiles ([T · tiles, 64, ...], H < 64 zero-padded); on sm_90 each row as
  latent | 64 zeros | rope (640 bytes: the zeros meet latent 448-511 in the 128-byte tail chunk).
  Made by :func:`_xla_kernel_q` (the sm_90 kernels over an fp8 cache quantize q themselves, ``q_in_kernel``).
  A bfloat16 cache's kernel takes q in bf16 as it is (64-row tiles) with softmax_scale · kv_scale · log2 e as
  every row's scale."""
  if getattr(cfg.kernel, "bf16", False):   # bf16 cache: q in bf16 as it is, one logit scale for every row
    return bf16_q_tiles(q, tiles_per_token, softmax_scale, kv_scale)
  return _xla_kernel_q(q, arch, tiles_per_token, softmax_scale, kv_scale)


def bf16_q_tiles(q, tiles_per_token: int, softmax_scale, kv_scale):
  """The bf16-cache kernels' Q inputs (sparse and dense, heads on M): q [T, H, 576] as bf16 64-row tiles [T ·
  tiles_per_token, 64, 576] (H < 64 zero-padded) and each row's logit scale softmax_scale · kv_scale · log2 e
  [T · tiles_per_token, 64] f32."""
  n_tok, h, _ = q.shape
  q16 = q.astype(jnp.bfloat16)
  if h < TILE:
    q16 = jnp.pad(q16, ((0, 0), (0, TILE - h), (0, 0)))
  tiles = n_tok * tiles_per_token
  scale = jnp.float32(softmax_scale) * jnp.asarray(kv_scale, jnp.float32) * jnp.float32(LOG2E)
  return q16.reshape(tiles, TILE, D_QK), jnp.full((tiles, TILE), scale, jnp.float32)


def _xla_kernel_q(q, arch: str, tiles_per_token: int, softmax_scale, kv_scale):
  """:func:`_kernel_q`'s FP8 result by fused XLA ops: quant.quantize_rows_fp8, the zero columns, and the row scale
  as max(|q| · k) over the row (kernels/q_quant.row_scales' amax · k: the same bits, rounding being monotonic), a
  second reduction of q beside the amax, which XLA can run in the same fusion instead of a separate product."""
  n_tok, h, _ = q.shape
  q8, _ = quant.quantize_rows_fp8(q)
  k = jnp.float32(quant._INV_FP8_MAX) * ((jnp.float32(softmax_scale) * jnp.asarray(kv_scale, jnp.float32))
                                        * jnp.float32(LOG2E))
  row_scale = jnp.max(jnp.abs(q.astype(jnp.float32)) * k, axis=-1)
  if arch == "sm90":
    zeros = jnp.zeros(q8.shape[:-1] + (Q_SW_COLS - D_QK,), q8.dtype)
    q8 = jnp.concatenate([q8[..., :D_V], zeros, q8[..., D_V:]], axis=-1)
  if h < TILE:
    q8 = jnp.pad(q8, ((0, 0), (0, TILE - h), (0, 0)))
    row_scale = jnp.pad(row_scale, ((0, 0), (0, TILE - h)))
  return q8.reshape(n_tok * tiles_per_token, TILE, q8.shape[-1]), row_scale.reshape(n_tok * tiles_per_token, TILE)


def _partials_dtype(splits: int, bf16_cache: bool, twin: bool = False) -> str:
  """The attention kernel's output dtype: bfloat16, except split partials over a bfloat16 cache or from the
  heads-on-M "twin" schedule (``twin``), which are float32.

  With an fp8 cache each split's normalised partial O is rounded to bf16 before the merge: one more rounding of ~2^-9
  relative, a tenth of the FP8 terms of the error model (``testing.fp8_error_terms``, ``partials_bf16``), for half the
  bytes the kernel writes and :func:`combine_splits` reads. Measured on the H200 against f32 partials
  (benchmarks/sparse_merge_ab_gpu.py; docs/kernels/sparse_decode_sm90.md, "Small batches"): heads on N B8 H8 12.1 ->
  10.8 us, B8 H16 13.4 -> 11.1, B4 s_q6 H8 19.5 -> 17.8; heads on M, the hand-off of the time, P5 2801 -> 2746; but
  "twin" (the short splits of small batches) got slower, its kernel by 2.3-2.6 us (B1 H128 17.5 -> 18.6, B8 H128 29.5
  -> 30.2, C0 43.7 -> 44.4): it stores O straight from the wgmma registers, 2 values per thread and row, which in bf16
  fill half of each 32-byte sector. BF16 attention (a bfloat16 cache) keeps f32 partials, as FlashMLA does, so that
  its error stays at bf16 rounding of P and the output."""
  return "float32" if splits > 1 and (bf16_cache or twin) else "bfloat16"


def combine_splits(o, lse):
  """Merge split-KV partial results: o [..., splits, R, 512] (each normalised; bf16 or f32), lse [..., splits, R]
  natural log. Returns (o [..., R, 512] f32, lse [..., R]).

  A fixed chain of elementwise ops over the splits in order (split 0 first) rather than reductions over the split
  axis: the bits of a row do not depend on how XLA would tile a reduction for the array's shape (batch-invariant
  mode), and XLA fused the chain into two launches (o, lse) where the reductions took three (H200 profiles at B8
  H128: docs/kernels/sparse_decode_sm90.md, "Small batches"). Splits with
  lse = −inf (nothing valid) get weight 0 and add exact zeros, so a row with extra empty splits gets the same bits;
  if every split is empty the result is o = 0, lse = −inf."""
  n = lse.shape[-2]
  m = lse[..., 0, :]
  for i in range(1, n):
    m = jnp.maximum(m, lse[..., i, :])
  m_use = jnp.where(m == -jnp.inf, 0.0, m)
  tot = jnp.zeros_like(m_use)
  acc = jnp.zeros(o.shape[:-3] + o.shape[-2:], jnp.float32)
  for i in range(n):
    w = jnp.exp(lse[..., i, :] - m_use)
    tot = tot + w
    acc = acc + w[..., None] * o[..., i, :, :].astype(jnp.float32)
  return acc / jnp.where(tot == 0, 1.0, tot)[..., None], jnp.log(tot) + m_use


def _xla_per_row(fn, q, *args):
  """``fn`` on one sequence at a time (``lax.map`` over the batch): every sequence runs the same program on
  arrays of the same shape, so its bits cannot depend on the others (batch-invariant XLA path). ``args``: arrays
  with the batch first, or None."""
  def one(xs):
    o, lse = fn(*(None if x is None else x[None] for x in xs))
    return o[0], lse[0]
  return lax.map(one, (q,) + args)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "impl", "interpret", "tuning", "arch",
                                             "batch_invariant"))
def _sparse_decode_jit(q, kv_flat, indices, kv_scale, topk_length, *, softmax_scale, impl, interpret,
                       tuning=(), arch=None, batch_invariant=False):
  """``tuning``: tuple of (field, value) overrides of the kernel's TuningConfig (benchmarks; see
  :func:`sweep_configs`), applied by :func:`_config` to :func:`default_config`.

  ``arch``: kernel family "sm90" | "sm100" (None: :func:`mla_pallas._dispatch.mosaic_arch` at trace time; pass it
  explicitly when the family can change between calls, since it is part of the jit cache key only when given).
  """
  if impl == "mosaic":
    arch = arch or _dispatch.mosaic_arch(interpret)
    return _mosaic_sparse_decode(q, kv_flat, indices, softmax_scale, kv_scale, topk_length, interpret, tuning,
                                 arch, batch_invariant)
  q = join_q(q)
  if batch_invariant:
    return _xla_per_row(lambda q1, i1, t1: _xla_sparse_decode(q1, kv_flat, i1, softmax_scale, kv_scale, t1),
                        q, indices, topk_length)
  return _xla_sparse_decode(q, kv_flat, indices, softmax_scale, kv_scale, topk_length)


def _checked_dispatch(q, kv_cache, indices, topk_length, softmax_scale, kv_scale, impl, interpret):
  """sparse_mla_decode's argument checks and impl choice: (q's parts, the flat cache [num_slots, 576], the impl)."""
  parts = _check_args(q, kv_cache, indices, topk_length, softmax_scale, kv_scale, prefill=False)
  shape = q_shape(parts)
  kv_flat = kv_cache.reshape(-1, D_QK)
  used = _dispatch.choose("sparse_mla_decode", impl, interpret=interpret,
                          supported=_kernel_supported(shape, kv_flat.shape[0], interpret, kv_flat.dtype),
                          validated_on=validated_on(kv_flat.dtype, shape[2]))
  return parts, kv_flat, used


def sparse_mla_decode(q, kv_cache, indices, *, softmax_scale, kv_scale=1.0, topk_length=None,
                      impl: str = "auto", interpret: bool = False, batch_invariant: bool = False):
  """Sparse (DSA top-k) MLA decode attention over a paged FP8 latent cache.

  Args:
    q: [B, s_q, H, 576] bfloat16 (or float32): absorbed queries (512 latent ‖ 64 rope), s_q query tokens per
      sequence (MTP); or the pair (q_latent [B, s_q, H, 512], q_rope [B, s_q, H, 64]) (:func:`q_parts`), which
      the kernels that quantize q themselves read without a concatenated copy.
    kv_cache: [num_pages, page_size, 576] float8_e4m3fn (or flat [num_slots, 576]); dequantized value = fp8 ·
      kv_scale; the value vector of a row is its first 512 entries. A bfloat16 cache gives BF16 attention (q
      and P in bf16, f32 accumulation: the bf16-cache kernel on sm_90, the XLA path otherwise; see the module
      docstring).
    indices: [B, s_q, topk] int32 flat slot ids (page · page_size + offset). Entries < 0 or ≥ num_slots are
      ignored (never read); duplicates count as often as they appear.
    softmax_scale: python float multiplying q·k (e.g. 1/sqrt(192) for DeepSeek-V3.2).
    kv_scale: per-tensor cache scale (python float or f32 scalar).
    topk_length: optional [B] int32; only the first topk_length[b] indices of batch b count.
    impl: "auto" | "mosaic" | "xla" (see :mod:`mla_pallas._dispatch`). On a Blackwell GPU (compute capability
      10.x) "auto" runs the XLA path: the sm_100a kernel has not been run on Blackwell silicon yet; "mosaic"
      runs it anyway.
    interpret: run the Mosaic kernel in Pallas' GPU interpret mode (CPU): True, or a
      ``plgpu.InterpretGPUParams`` (e.g. ``detect_races=True``).
    batch_invariant: python bool. True: the bits of a row's out and lse depend only on its own q, indices and
      topk_length (and the cache), not on the batch size or the other rows: the kernel splits every row's top-k
      into splits of INVARIANT_SPLIT_TILES · 64 keys whatever the batch (instead of the plan that fills the SMs)
      and merges them in a fixed order (:func:`combine_splits`); the XLA path runs one sequence at a
      time (``lax.map``). Costs: fewer CTAs at small batch, more splits at top-k > 1024.

  Returns:
    out [B, s_q, H, 512] bfloat16 and lse [B, s_q, H] float32 (natural log). A row with no valid index gives
    out = 0 and lse = −inf.
  """
  parts, kv_flat, used = _checked_dispatch(q, kv_cache, indices, topk_length, softmax_scale, kv_scale, impl,
                                           interpret)
  arch = _dispatch.mosaic_arch(interpret) if used == "mosaic" else None
  return _sparse_decode_jit(parts, kv_flat, indices, jnp.asarray(kv_scale, jnp.float32), topk_length,
                            softmax_scale=float(softmax_scale), impl=used, interpret=interpret, arch=arch,
                            batch_invariant=_checks.check_bool("batch_invariant", batch_invariant))


def split_partials(q, kv_cache, indices, *, softmax_scale, kv_scale=1.0, topk_length=None, impl: str = "auto",
                   interpret: bool = False):
  """:func:`sparse_mla_decode`'s attention kernel *before* its split-KV merge, for a consumer that merges the splits
  itself (the decode graph's W_UV product: :func:`mla_pallas.ops.bmm_fp8.merge_quantize_and_bmm_fp8`), or None
  where ``sparse_mla_decode`` would not run such a kernel here: the XLA path, an sm_100 or bf16-cache kernel, or a
  plan other than the heads-on-M "twin" schedule with several float32 splits (the small-batch plans at 64 and
  128 heads).

  Arguments as in :func:`sparse_mla_decode` (checked the same way; ``batch_invariant`` is not offered: that mode
  keeps the op's own merge).

  Returns None or ``(parts, lse)``: parts [B · s_q · ceil(H/64), S, 64, 512] float32, the S splits' normalised
  outputs, and lse [B · s_q · ceil(H/64), S, 64] float32 (natural log, −inf for an empty split); head h of query
  token t = b · s_q + i sits at tile t · ceil(H/64) + h // 64, row h % 64 (rows past H: padding).
  :func:`combine_splits` of the two, reshaped to [B, s_q, H, 512] and cast to bfloat16, is ``sparse_mla_decode``'s
  out.
  """
  parts, kv_flat, used = _checked_dispatch(q, kv_cache, indices, topk_length, softmax_scale, kv_scale, impl,
                                           interpret)
  if used != "mosaic" or _dispatch.mosaic_arch(interpret) != "sm90" or kv_flat.dtype != FP8:
    return None
  b, s_q, h, _ = q_shape(parts)
  cfg = _config(h, b * s_q, indices.shape[-1], "sm90", (), jnp.dtype(kv_flat.dtype).name, False)
  if cfg.design != "sm90_heads_m" or cfg.num_splits < 2 or getattr(cfg.kernel, "schedule", None) != "twin":
    return None
  return _split_partials_jit(parts, kv_flat, indices, jnp.asarray(kv_scale, jnp.float32), topk_length,
                             softmax_scale=float(softmax_scale), interpret=interpret, cfg=cfg)


@functools.partial(jax.jit, static_argnames=("softmax_scale", "interpret", "cfg"))
def _split_partials_jit(parts, kv_flat, indices, kv_scale, topk_length, *, softmax_scale, interpret, cfg):
  return _mosaic_kernel(parts, kv_flat, indices, softmax_scale, kv_scale, topk_length, interpret, cfg, "sm90")


def sparse_mla_prefill(q, kv_cache, indices, *, softmax_scale, kv_scale=1.0, topk_length=None,
                       impl: str = "auto", interpret: bool = False, batch_invariant: bool = False):
  """Sparse MLA prefill: the decode computation with B = T query tokens and s_q = 1.

  Args:
    q: [T, H, 576] bfloat16/float32, or a (q_latent [T, H, 512], q_rope [T, H, 64]) pair; kv_cache as in
      :func:`sparse_mla_decode`; indices [T, topk] int32;
    topk_length: optional [T] int32. Other arguments as in :func:`sparse_mla_decode` (``batch_invariant``: a
    token's bits do not depend on T or the other tokens).

  Returns:
    out [T, H, 512] bfloat16, lse [T, H] float32.
  """
  parts = _check_args(q, kv_cache, indices, topk_length, softmax_scale, kv_scale, prefill=True)
  q = tuple(p[:, None] for p in parts)
  out, lse = sparse_mla_decode(q if len(q) == 2 else q[0], kv_cache, indices[:, None], softmax_scale=softmax_scale,
                               kv_scale=kv_scale, topk_length=topk_length, impl=impl, interpret=interpret,
                               batch_invariant=batch_invariant)
  _dispatch.record("sparse_mla_prefill", _dispatch.last_impl("sparse_mla_decode"))
  return out[:, 0], lse[:, 0]
