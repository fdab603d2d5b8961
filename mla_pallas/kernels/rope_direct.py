"""RoPE + RMS norm of new MLA tokens (+ FP8 quantization and paged-cache write) straight from GMEM to registers to
GMEM: no TMA, no tensor cores, SMEM only for the bitmap duplicate check (sm_90a, raw Mosaic GPU through
``plgpu.inline_mgpu``). The kernel of :mod:`mla_pallas.ops.rope_rmsnorm` at every T and H. Design history and
measurements: docs/kernels/rope_direct.md.

Work split (1-D grid of ``kv_ctas + q_ctas`` CTAs of one warpgroup, :func:`grid_for`); every thread loads with
vector ``ld.global``, computes in registers and stores with ``st.global``:

* kv CTAs ``c < kv_ctas``: warp ``w`` takes token ``t = 4 c + w``. Lane ``l`` holds latent values
  ``[16 l, 16 l + 16)`` (two 16-byte loads): sum of squares per lane, then a butterfly over the warp;
  ``y = x · rsqrt(sum / 512 + eps) · w``. Lanes 0-7 also rotate the 8 k_rope values ``[8 l, 8 l + 8)``.
  fused: ``fp8(clip(y · f32(1 / kv_scale), ±448))`` (16 bytes per lane, 8 of k_rope) — or, into a bfloat16
  cache, ``bf16(y · f32(1 / kv_scale))`` (32 bytes per lane, 16 of k_rope) — to ``pages[slot[t]]`` when
  the slot is in range and (``dedupe``) no later token has the same slot (each lane compares 1/32 of the later
  tokens' slots, then an OR over the warp); unfused: bf16 to ``kv_out[t]``.
* q CTAs: thread items of 8 values (16 bytes) of the flat ``[T · H, 64]`` q_rope, ``items_per_thread`` per
  thread, consecutive threads on consecutive 16-byte pieces (coalesced): all loads first (position, q values,
  then the table entries), then the math and the stores.
* Duplicate slots (``dedupe``): up to ``warp_scan_max_tokens`` each kv warp compares its token's slot with every
  later token's (unrolled up to UNROLLED_SCAN_MAX, then rounds of SCAN_ROUND loads per lane). Above (the bitmap
  mode, :func:`_bitmap_kv_cta`) a kv CTA takes ``bitmap_tokens`` tokens, hashes their slots into a 2^14-bit SMEM
  bitmap, scans the later tokens' slots against it (exact comparison only on a bit hit) and marks its overwritten
  tokens; its warps then process their tokens ``bitmap_group`` at a time.

Index width: token, slot and position indices are i32 (T and num_slots < 2^31); every byte offset (kv / q rows,
table rows, ``slot · 576``) is i64. The q item index is i32 while T · H · 8 < 2^31 and i64 from there
(:func:`needs_i64`), so the kernel serves every T and H whose grid fits CUDA's 2^31 - 1 CTAs.

Budget: the kv and q branches share one register allocation, so the kv branch's registers set every CTA's
occupancy. ptxas (sm_90a): 63 registers per thread without the bitmap mode, 71 with it at ``bitmap_group = 1``
(the default; 4 tokens in flight per warp took 114). SMEM: none outside the bitmap mode; in it 2 KiB of bitmap
+ 2 · ``bitmap_tokens`` · 4 B (own slots, drop flags).

RoPE of 8 values ``x = row[8 p, 8 p + 8)`` of a 64-wide row at position ``pos`` (clamped to [0, max_pos)):
``y = x · C + swap(x) · S`` (interleaved / DeepSeek: ``C = [c0 c0 c1 c1 ..]``, ``S = [−s0 s0 −s1 s1 ..]`` from
``cos / sin[pos, 4 p .. 4 p + 4)``, swap(x) a shuffle inside the vector; NeoX halves: ``C = c[8 (p % 4) ..]``,
``S = ∓s[..]``, swap(x) the 8 values of piece ``p ^ 4`` of the row, a second load). These are the reference's
float32 operations; ptxas may contract a product and a sum into an FMA, and the RMS sum runs in another order than
XLA's, so a value can be one bf16 ulp / e4m3 step away from the reference (tests/_rope_inputs.assert_near_bitwise).

Interpret mode has no ``inline_mgpu``, so this module is checked by sm_90 lowering on the CPU
(tests/test_rope_direct_kernel.py: load / store counts, SMEM, barriers, the i64 item index) and against the
references on the GPU (tests/test_rope_rmsnorm_kernel_gpu.py); the op runs its XLA path in interpret mode.
"""
from __future__ import annotations

import dataclasses
import functools
import types

import jax
from jax import lax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, math as math_dialect, scf, vector
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common
from mla_pallas.kernels.raw_mgpu import SCALAR_LAYOUT, THREADS, byte_ptr64, c32, c64, convert_vectors, i32
from mla_pallas.kernels.raw_mgpu import scalar_array, scalar_value, thread_in_warpgroup, wide
from mla_pallas.quant import FP8_MAX

D_QK, D_V, D_ROPE = 576, 512, 64
HALF = D_ROPE // 2
PIECE = 8                     # values per rope item (16 bytes of bf16)
PIECES = D_ROPE // PIECE      # items per 64-wide rope row
LANE_VALUES = D_V // 32       # latent values per lane
TOKENS_PER_KV_CTA = 4         # one warp per token
UNROLLED_SCAN_MAX = 256       # up to this T a warp's scan of the later slots is unrolled (T / 32 loads per lane)
SCAN_ROUND = 8                # above, rounds of 8 slots per lane (256 per warp) in a loop
BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class TuningConfig(common.TuningConfigBase):
  """Frozen config (the op's default: :func:`mla_pallas.ops.rope_rmsnorm.default_config`).

  items_per_thread: q items (8 values, 16 bytes) per thread of a q CTA, all loaded before any is computed.
  bitmap_dedupe: above ``warp_scan_max_tokens``, the op lets the kernel find each slot's last writer (the kv CTAs'
  bitmaps) rather than an XLA pre-pass (its scatter-max ``_last_writer``).
  warp_scan_max_tokens: up to this T, each kv warp compares its token's slot with every later token's (one
  token per warp, latency-friendly); above, the bitmap mode.
  bitmap_tokens: tokens of a kv CTA in the bitmap mode (a multiple of 4, at most THREADS).
  bitmap_group: tokens of one warp whose loads are in flight together in the bitmap mode (divides
  bitmap_tokens / 4): more hide more latency, but the kv branch's registers limit every CTA's occupancy.
  scan_unroll: later slots per thread loaded together in the bitmap mode's scan."""
  items_per_thread: int = 4
  bitmap_dedupe: bool = True
  warp_scan_max_tokens: int = 2048
  bitmap_tokens: int = 16
  bitmap_group: int = 1
  scan_unroll: int = 8

  def validate(self):
    if not 1 <= self.items_per_thread <= 16:
      raise ValueError(f"TuningConfig.items_per_thread must be in [1, 16]; got {self.items_per_thread}")
    if self.bitmap_tokens % 4 or self.bitmap_tokens > THREADS:
      raise ValueError(f"TuningConfig.bitmap_tokens must be a multiple of 4 and at most {THREADS}; got "
                       f"{self.bitmap_tokens}")
    if (self.bitmap_tokens // 4) % self.bitmap_group:
      raise ValueError(f"TuningConfig.bitmap_group must divide bitmap_tokens / 4 = {self.bitmap_tokens // 4}; got "
                       f"{self.bitmap_group}")
    if not 1 <= self.scan_unroll <= 16:
      raise ValueError(f"TuningConfig.scan_unroll must be in [1, 16]; got {self.scan_unroll}")


def needs_i64(num_tokens: int, heads: int) -> bool:
  """Whether the T · H · 8 q items need an i64 item index (T · H · 8 >= 2^31); below, the kernel indexes them with
  i32. Every byte offset (kv / q rows, table rows, cache slots · 576) is i64 at every size."""
  return num_tokens * heads * PIECES >= 2 ** 31


def knobs() -> frozenset[str]:
  """The names of the TuningConfig fields (the op's ``tuning`` keys that belong to this kernel)."""
  return frozenset(f.name for f in dataclasses.fields(TuningConfig))


def uses_bitmap(cfg: TuningConfig, fused: bool, num_tokens: int, dedupe: bool) -> bool:
  """Whether the kernel checks duplicate slots with the kv CTAs' bitmaps (T > ``cfg.warp_scan_max_tokens``) rather
  than with one warp's scan of the later slots per token."""
  return bool(fused and dedupe and num_tokens > cfg.warp_scan_max_tokens)


def grid_for(cfg: TuningConfig, num_tokens: int, heads: int, bitmap: bool = False) -> tuple[int, int]:
  """(kv_ctas, q_ctas): one warp per token (``bitmap``: ``cfg.bitmap_tokens`` per kv CTA), ``THREADS ·
  items_per_thread`` q items per q CTA."""
  kv_ctas = -(-num_tokens // (cfg.bitmap_tokens if bitmap else TOKENS_PER_KV_CTA))
  q_ctas = -(-num_tokens * heads * PIECES // (THREADS * cfg.items_per_thread))
  return kv_ctas, q_ctas


def _types():
  f32, bf16 = ir.F32Type.get(), ir.BF16Type.get()
  return types.SimpleNamespace(f32=f32, bf16=bf16, v8f=ir.VectorType.get((8,), f32),
                               v4f=ir.VectorType.get((4,), f32), v8b=ir.VectorType.get((8,), bf16),
                               v4i=ir.VectorType.get((4,), i32()), v2i=ir.VectorType.get((2,), i32()))


def _load(ty, base, off, align=16):
  return llvm.load(ty, byte_ptr64(base, off), alignment=align)


def _store(val, base, off, align=16):
  llvm.store(val, byte_ptr64(base, off), alignment=align)


def _if(cond, body):
  """``body()`` under ``cond`` (an i1 value)."""
  op = scf.IfOp(cond)
  with ir.InsertionPoint(op.then_block):
    body()
    scf.yield_([])


def _bf16_to_f32(ty, v8b):
  return arith.extf(ty.v8f, v8b)


def _f32_to_bf16_bytes(ty, vals):
  """vector<8 x f32> values -> vector<4 x i32> words of their bf16 values (16 bytes each)."""
  return [vector.bitcast(ty.v4i, v) for v in convert_vectors(vals, ty.bf16)]


class _Refs:
  """Base pointers of the kernel's GMEM arguments and the scalars every thread needs."""

  def __init__(self, fused, refs):
    names = ("kv", "q", "pos", "cos", "sin", "w", "eps") + (("ks", "slots", "pages", "qo") if fused else
                                                            ("qo", "kvo"))
    self.mem = dict(zip(names, refs, strict=True))
    self.ptr = {k: mgpu_utils.memref_ptr(v) for k, v in self.mem.items()}
    self.max_pos = ir.MemRefType(self.mem["cos"].type).shape[0]
    self.w_type = ir.MemRefType(self.mem["w"].type).element_type
    # fused: a bfloat16 cache (1152-byte rows of bf16(y · f32(1 / kv_scale))) or an e4m3 one (576-byte rows)
    self.pages_bf16 = fused and isinstance(ir.MemRefType(self.mem["pages"].type).element_type, ir.BF16Type)


def _position(r, tok):
  """Token ``tok``'s position clamped to [0, max_pos) (i32)."""
  ty = i32()
  p = llvm.load(ty, byte_ptr64(r.ptr["pos"], arith.muli(wide(tok), c64(4))))
  return arith.maxsi(arith.minsi(p, c32(r.max_pos - 1)), c32(0))


def _slot_of(r, tok):
  """Token ``tok``'s raw slot (i32)."""
  return llvm.load(i32(), byte_ptr64(r.ptr["slots"], arith.muli(wide(tok), c64(4))))


def _in_range(slot, num_slots):
  return arith.andi(arith.cmpi(arith.CmpIPredicate.sge, slot, c32(0)),
                    arith.cmpi(arith.CmpIPredicate.slt, slot, c32(num_slots)))


def _rope_loads(ty, r, base, row_off, piece, pos, interleaved):
  """The loads of one rope item: (x, partner or None, C-source, S-source) (see :func:`_rope_math`)."""
  x = _load(ty.v8b, base, arith.addi(row_off, wide(arith.muli(piece, c32(16)))))
  table_row = arith.muli(wide(pos), c64(HALF * 4))   # byte offset of row pos of cos / sin (i64: any max_pos)
  if interleaved:   # cos / sin[pos, 4 p .. 4 p + 4)
    off = arith.addi(table_row, wide(arith.muli(piece, c32(PIECE // 2 * 4))))
    return x, None, _load(ty.v4f, r.ptr["cos"], off), _load(ty.v4f, r.ptr["sin"], off)
  partner = arith.xori(piece, c32(PIECES // 2))      # NeoX: values 8 (p ^ 4) .. of the row pair with these
  xp = _load(ty.v8b, base, arith.addi(row_off, wide(arith.muli(partner, c32(16)))))
  off = arith.addi(table_row, wide(arith.muli(arith.andi(piece, c32(PIECES // 2 - 1)), c32(PIECE * 4))))
  return x, xp, _load(ty.v8f, r.ptr["cos"], off), _load(ty.v8f, r.ptr["sin"], off)


def _rope_math(ty, loaded, piece, interleaved):
  """y = x · C + swap(x) · S (vector<8 x f32>) from :func:`_rope_loads`' values."""
  x, xp, c, s = loaded
  x = _bf16_to_f32(ty, x)
  if interleaved:
    cc = vector.shuffle(c, c, [0, 0, 1, 1, 2, 2, 3, 3])
    ss = vector.shuffle(arith.negf(s), s, [0, 4, 1, 5, 2, 6, 3, 7])
    sw = vector.shuffle(x, x, [1, 0, 3, 2, 5, 4, 7, 6])
  else:
    first_half = arith.cmpi(arith.CmpIPredicate.ult, piece, c32(PIECES // 2))
    cc, ss = c, arith.select(first_half, arith.negf(s), s)
    sw = _bf16_to_f32(ty, xp)
  return arith.addf(arith.mulf(x, cc), arith.mulf(sw, ss))


def _fp8_words(ty, vals, inv_scale):
  """clip(v · inv_scale, ±448) -> e4m3 bytes of each vector<8 x f32>, as vector<2 x i32> words (8 bytes each)."""
  inv = vector.broadcast(ty.v8f, inv_scale)
  lo, hi = (vector.broadcast(ty.v8f, arith.constant(ty.f32, v)) for v in (-FP8_MAX, FP8_MAX))
  clipped = [arith.minimumf(arith.maximumf(arith.mulf(v, inv), lo), hi) for v in vals]
  return [vector.bitcast(ty.v2i, v) for v in convert_vectors(clipped, ir.Float8E4M3FNType.get())]


def _keep_slot(r, t, lane, num_tokens, num_slots, dedupe):
  """(slot, keep): token t's slot and whether it writes it (in range and, with ``dedupe``, no later token has the
  same slot; lane l compares tokens l, l + 32, .. > t; warp-uniform result)."""
  ty = i32()
  slot = _slot_of(r, t)
  keep = _in_range(slot, num_slots)
  if not dedupe:
    return slot, keep

  def compare(hit, js):   # OR into hit: a token j in js with t < j < T has the same slot (loads first)
    others = [_slot_of(r, arith.minui(j, c32(num_tokens - 1))) for j in js]
    for j, other in zip(js, others):
      later = arith.andi(arith.cmpi(arith.CmpIPredicate.ugt, j, t),
                         arith.cmpi(arith.CmpIPredicate.ult, j, c32(num_tokens)))
      same = arith.andi(later, arith.cmpi(arith.CmpIPredicate.eq, other, slot))
      hit = arith.ori(hit, arith.extui(ty, same))
    return hit

  if num_tokens <= UNROLLED_SCAN_MAX:   # every token, unrolled
    hit = compare(c32(0), [arith.addi(lane, c32(32 * k)) for k in range(-(-num_tokens // 32))])
  else:                                 # the later tokens only, in rounds of SCAN_ROUND slots per lane
    span = 32 * SCAN_ROUND
    first = arith.addi(t, c32(1))
    rounds = arith.divui(arith.addi(arith.subi(c32(num_tokens), first), c32(span - 1)), c32(span))
    idx = ir.IndexType.get()
    loop = scf.ForOp(arith.constant(idx, 0), arith.index_cast(idx, rounds), arith.constant(idx, 1), [c32(0)])
    with ir.InsertionPoint(loop.body):
      base = arith.addi(arith.addi(first, lane), arith.muli(arith.index_cast(ty, loop.induction_variable),
                                                            c32(span)))
      scf.yield_([compare(loop.inner_iter_args[0], [arith.addi(base, c32(32 * u)) for u in range(SCAN_ROUND)])])
    hit = loop.results[0]
  for d in (16, 8, 4, 2, 1):
    hit = arith.ori(hit, mgpu_utils.shfl_bfly(hit, d))
  return slot, arith.andi(keep, arith.cmpi(arith.CmpIPredicate.eq, hit, c32(0)))


def _kv_constants(ty, r, lane, fused):
  """Per-warp values of the kv rows: the lane's 16 norm weights (f32), eps and (fused) f32(1 / kv_scale)."""
  if isinstance(r.w_type, ir.BF16Type):
    w_off = wide(arith.muli(lane, c32(2 * LANE_VALUES)))
    ws = [_bf16_to_f32(ty, _load(ty.v8b, r.ptr["w"], arith.addi(w_off, c64(16 * j)))) for j in range(2)]
  else:
    w_off = wide(arith.muli(lane, c32(4 * LANE_VALUES)))
    ws = [_load(ty.v8f, r.ptr["w"], arith.addi(w_off, c64(32 * j))) for j in range(2)]
  eps = llvm.load(ty.f32, r.ptr["eps"])
  inv_scale = None
  if fused:   # f32 reciprocal, then a multiply (quant.quantize_fp8)
    inv_scale = arith.divf(arith.constant(ty.f32, 1.0), llvm.load(ty.f32, r.ptr["ks"]))
  return ws, eps, inv_scale


def _kv_loads(ty, r, t, lane, interleaved):
  """The loads of token t's kv row for this lane: (row offset, latent vectors, k_rope piece, its rope loads)."""
  row = arith.muli(wide(t), c64(D_QK * 2))                  # bf16 row of kv / kv_out
  lane_off = arith.addi(row, wide(arith.muli(lane, c32(2 * LANE_VALUES))))
  xs = [_load(ty.v8b, r.ptr["kv"], arith.addi(lane_off, c64(16 * j))) for j in range(2)]
  piece = arith.andi(lane, c32(PIECES - 1))                 # lanes 0-7: k_rope piece (the others compute a copy)
  kr = _rope_loads(ty, r, r.ptr["kv"], arith.addi(row, c64(2 * D_V)), piece, _position(r, t), interleaved)
  return row, xs, piece, kr


def _kv_finish(ty, r, loaded, consts, lane, fused, interleaved, slot=None, keep=None):
  """RMS norm + RoPE of a row from :func:`_kv_loads` (one warp) and its stores: fused, to ``pages[slot]`` where
  ``keep`` (warp-uniform i1); unfused, to kv_out where ``keep`` (None: always)."""
  row, xs, piece, kr = loaded
  ws, eps, inv_scale = consts
  xs = [_bf16_to_f32(ty, x) for x in xs]
  sq = arith.addf(arith.mulf(xs[0], xs[0]), arith.mulf(xs[1], xs[1]))
  ssum = vector.reduction(ty.f32, vector.CombiningKind.ADD, sq)
  for d in (16, 8, 4, 2, 1):
    ssum = arith.addf(ssum, mgpu_utils.shfl_bfly(ssum, d))
  inv = math_dialect.rsqrt(arith.addf(arith.mulf(ssum, arith.constant(ty.f32, 1.0 / D_V)), eps))
  inv_v = vector.broadcast(ty.v8f, inv)
  ys = [arith.mulf(arith.mulf(x, inv_v), w) for x, w in zip(xs, ws)]
  yk = _rope_math(ty, kr, piece, interleaved)
  is_rope_lane = arith.cmpi(arith.CmpIPredicate.ult, lane, c32(PIECES))
  if fused and r.pages_bf16:     # quant.encode_cache_rows for bf16: bf16(y · f32(1 / kv_scale)), no clip
    inv_v = vector.broadcast(ty.v8f, inv_scale)
    lat16 = _f32_to_bf16_bytes(ty, [arith.mulf(y, inv_v) for y in ys])
    kr16 = _f32_to_bf16_bytes(ty, [arith.mulf(yk, inv_v)])[0]

    def write():
      dst = arith.muli(wide(slot), c64(D_QK * 2))
      lane_off = arith.addi(dst, wide(arith.muli(lane, c32(2 * LANE_VALUES))))
      for j, word in enumerate(lat16):
        _store(word, r.ptr["pages"], arith.addi(lane_off, c64(16 * j)))
      _if(is_rope_lane, lambda: _store(kr16, r.ptr["pages"], arith.addi(dst, arith.addi(
          c64(2 * D_V), wide(arith.muli(piece, c32(16)))))))
  elif fused:
    lat8 = _fp8_words(ty, ys, inv_scale)
    kr8 = _fp8_words(ty, [yk], inv_scale)[0]

    def write():
      dst = arith.muli(wide(slot), c64(D_QK))
      words = [vector.extract(v, [], [j]) for v in lat8 for j in range(2)]
      _store(vector.from_elements(ty.v4i, words), r.ptr["pages"],
             arith.addi(dst, wide(arith.muli(lane, c32(LANE_VALUES)))))
      _if(is_rope_lane, lambda: _store(kr8, r.ptr["pages"],
                                       arith.addi(dst, arith.addi(c64(D_V), wide(arith.muli(piece, c32(PIECE))))),
                                       align=8))
  else:
    def write():
      lane_off = arith.addi(row, wide(arith.muli(lane, c32(2 * LANE_VALUES))))
      for j, word in enumerate(_f32_to_bf16_bytes(ty, ys)):
        _store(word, r.ptr["kvo"], arith.addi(lane_off, c64(16 * j)))
      kr16 = _f32_to_bf16_bytes(ty, [yk])[0]
      _if(is_rope_lane, lambda: _store(kr16, r.ptr["kvo"], arith.addi(row, arith.addi(
          c64(2 * D_V), wide(arith.muli(piece, c32(16)))))))
  if keep is None:
    write()
  else:
    _if(keep, write)


def _kv_token(ty, r, t, lane, fused, num_tokens, num_slots, interleaved, dedupe):
  """Token t's kv row by one warp (module docstring); ``dedupe``: the warp's scan of the later slots."""
  consts = _kv_constants(ty, r, lane, fused)
  loaded = _kv_loads(ty, r, t, lane, interleaved)
  slot = keep = None
  if fused:
    slot, keep = _keep_slot(r, t, lane, num_tokens, num_slots, dedupe)
  _kv_finish(ty, r, loaded, consts, lane, fused, interleaved, slot, keep)


# ---- The duplicate-slot check above cfg.warp_scan_max_tokens: kv CTAs of cfg.bitmap_tokens tokens ----
LOG_BITS = 14                 # the CTA's slots hashed into 2^14 bits (2 KB of SMEM)
# Fibonacci hashing: bit = (slot · 0x9E3779B1 mod 2^32) >> (32 - LOG_BITS); the multiplier as a signed i32 constant
_HASH = 0x9E3779B1 - (1 << 32)


def _bit_of(slot):
  """(word index, bit mask) of ``slot`` in the bitmap."""
  h = arith.shrui(arith.muli(slot, c32(_HASH)), c32(32 - LOG_BITS))
  return arith.shrui(h, c32(5)), arith.shli(c32(1), arith.andi(h, c32(31)))


def _for(lo, hi, body):
  """``for i in range(lo, hi): body(i)`` (i32 bounds, dynamic trip count)."""
  idx = ir.IndexType.get()
  loop = scf.ForOp(arith.index_cast(idx, lo), arith.index_cast(idx, hi), arith.constant(idx, 1))
  with ir.InsertionPoint(loop.body):
    body(arith.index_cast(i32(), loop.induction_variable))
    scf.yield_([])


def _bitmap_kv_cta(ty, r, cfg, cta, tid, warp, lane, fused, num_tokens, num_slots, interleaved, smem):
  """kv CTA ``cta`` of the bitmap mode: tokens t0 .. t0 + K, t0 = cta · K, K = ``cfg.bitmap_tokens``.

  1. Own slots: thread i < K keeps token t0 + i's slot (-1 when out of range or past T) in SMEM, clears
     its drop flag and sets the slot's bit (after the whole bitmap is zeroed).
  2. Scan: every later token j (t0 < j < T) is tested against the bitmap; on a hit (a real duplicate, or a hash
     collision, ~K / 2^LOG_BITS of the lookups) the thread compares j's slot with the CTA's slots and
     sets the drop flag of every own token i with the same slot and t0 + i < j.
  3. Rows: warp w takes tokens w, w + 4, .., ``cfg.bitmap_group`` at a time (their loads in flight together),
     and writes a row where its slot is in range and not dropped.
  """
  bitmap, own, drop = (mgpu_utils.memref_ptr(m) for m in smem)
  words = (1 << LOG_BITS) // 32
  K = cfg.bitmap_tokens   # noqa: N806
  t0 = arith.muli(cta, c32(K))
  zero4 = vector.from_elements(ty.v4i, [c32(0)] * 4)
  for k in range(-(-words // (4 * THREADS))):          # 1. zero the bitmap (16 bytes per thread and round)
    w4 = arith.addi(tid, c32(k * THREADS))
    _if(arith.cmpi(arith.CmpIPredicate.ult, w4, c32(words // 4)),
        lambda w4=w4: llvm.store(zero4, byte_ptr64(bitmap, wide(arith.muli(w4, c32(16)))), alignment=16))
  mine = arith.cmpi(arith.CmpIPredicate.ult, tid, c32(K))
  tok = arith.addi(t0, tid)
  tok_c = arith.minui(tok, c32(num_tokens - 1))
  slot = _slot_of(r, tok_c)
  ok = arith.andi(_in_range(slot, num_slots), arith.cmpi(arith.CmpIPredicate.ult, tok, c32(num_tokens)))
  slot = arith.select(ok, slot, c32(-1))

  def own_slot():
    off = wide(arith.muli(tid, c32(4)))
    llvm.store(slot, byte_ptr64(own, off))
    llvm.store(c32(0), byte_ptr64(drop, off))
  _if(mine, own_slot)
  mgpu_utils.warpgroup_barrier()                       # the bitmap is zero

  def set_bit():
    word, mask = _bit_of(slot)
    llvm.atomicrmw(llvm.AtomicBinOp._or, byte_ptr64(bitmap, wide(arith.muli(word, c32(4)))), mask,
                   llvm.AtomicOrdering.monotonic)
  _if(arith.andi(mine, ok), set_bit)
  mgpu_utils.warpgroup_barrier()                       # every own slot's bit is set

  first = arith.addi(t0, c32(1))                       # 2. scan the later tokens
  span = THREADS * cfg.scan_unroll
  n_later = arith.maxsi(arith.subi(c32(num_tokens), first), c32(0))
  rounds = arith.divui(arith.addi(n_later, c32(span - 1)), c32(span))

  def scan_round(k):
    base = arith.addi(first, arith.addi(arith.muli(k, c32(span)), tid))
    js = [arith.addi(base, c32(u * THREADS)) for u in range(cfg.scan_unroll)]
    others = [_slot_of(r, arith.minui(j, c32(num_tokens - 1))) for j in js]
    for j, other in zip(js, others):
      word, mask = _bit_of(other)
      bits = llvm.load(i32(), byte_ptr64(bitmap, wide(arith.muli(word, c32(4)))))
      hit = arith.andi(arith.andi(arith.cmpi(arith.CmpIPredicate.ult, j, c32(num_tokens)),
                                  _in_range(other, num_slots)),
                       arith.cmpi(arith.CmpIPredicate.ne, arith.andi(bits, mask), c32(0)))

      def compare(j=j, other=other):
        def each(i):
          off = wide(arith.muli(i, c32(4)))
          same = arith.andi(arith.cmpi(arith.CmpIPredicate.eq, llvm.load(i32(), byte_ptr64(own, off)), other),
                            arith.cmpi(arith.CmpIPredicate.ult, arith.addi(t0, i), j))
          _if(same, lambda: llvm.store(c32(1), byte_ptr64(drop, off)))
        _for(c32(0), c32(K), each)
      _if(hit, compare)
  _for(c32(0), rounds, scan_round)
  mgpu_utils.warpgroup_barrier()                       # every drop flag is final

  consts = _kv_constants(ty, r, lane, fused)           # 3. the rows
  for g0 in range(0, K // 4, cfg.bitmap_group):
    idx = [arith.addi(warp, c32(4 * (g0 + g))) for g in range(cfg.bitmap_group)]
    toks = [arith.addi(t0, i) for i in idx]
    loaded = [_kv_loads(ty, r, arith.minui(t, c32(num_tokens - 1)), lane, interleaved) for t in toks]
    for i, t, ld in zip(idx, toks, loaded):
      off = wide(arith.muli(i, c32(4)))
      own_slot_i = llvm.load(i32(), byte_ptr64(own, off))
      keep = arith.andi(arith.andi(arith.cmpi(arith.CmpIPredicate.ult, t, c32(num_tokens)),
                                   arith.cmpi(arith.CmpIPredicate.sge, own_slot_i, c32(0))),
                        arith.cmpi(arith.CmpIPredicate.eq, llvm.load(i32(), byte_ptr64(drop, off)), c32(0)))
      _kv_finish(ty, r, ld, consts, lane, fused, interleaved, own_slot_i, keep)


def _q_items(ty, r, q_cta, tid, num_tokens, heads, items, interleaved):
  """The q items ``q_cta · THREADS · items + k · THREADS + tid`` (k < items) of one thread (module docstring).

  The item index is i32 (unsigned compares and divisions: exact up to 2^32, past the last CTA's end) while
  T · H · 8 < 2^31, else i64 (:func:`needs_i64`); the byte offsets are i64 either way."""
  n_items = num_tokens * heads * PIECES
  if needs_i64(num_tokens, heads):
    ext, const, row_off_of = wide, c64, lambda q_row: arith.muli(q_row, c64(2 * D_ROPE))
    narrow = lambda x: arith.trunci(i32(), x)   # noqa: E731  (a piece < 8, a token < T < 2^31)
  else:
    ext, const, row_off_of = (lambda x: x), c32, lambda q_row: arith.muli(wide(q_row), c64(2 * D_ROPE))
    narrow = lambda x: x                        # noqa: E731
  first = arith.muli(ext(q_cta), const(THREADS * items))
  work = []
  for k in range(items):   # all loads first
    item = arith.addi(first, arith.addi(ext(tid), const(k * THREADS)))
    valid = arith.cmpi(arith.CmpIPredicate.ult, item, const(n_items))
    item_c = arith.minui(item, const(n_items - 1))
    q_row = arith.divui(item_c, const(PIECES))
    piece = narrow(arith.remui(item_c, const(PIECES)))
    pos = _position(r, narrow(arith.divui(q_row, const(heads))))
    row_off = row_off_of(q_row)
    work.append((valid, piece, row_off, _rope_loads(ty, r, r.ptr["q"], row_off, piece, pos, interleaved)))
  for valid, piece, row_off, loaded in work:
    word = _f32_to_bf16_bytes(ty, [_rope_math(ty, loaded, piece, interleaved)])[0]
    _if(valid, lambda word=word, row_off=row_off, piece=piece: _store(
        word, r.ptr["qo"], arith.addi(row_off, wide(arith.muli(piece, c32(16))))))


def _raw_body(fused, num_tokens, heads, num_slots, cfg, interleaved, dedupe, cta, refs):
  ty = _types()
  bitmap = uses_bitmap(cfg, fused, num_tokens, dedupe)
  smem = refs[-3:] if bitmap else ()
  r = _Refs(fused, refs[:-3] if bitmap else refs)
  kv_ctas, _ = grid_for(cfg, num_tokens, heads, bitmap)
  tid, warp, lane = thread_in_warpgroup()
  branch = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, cta, c32(kv_ctas)), has_else=True)
  with ir.InsertionPoint(branch.then_block):
    if bitmap:
      _bitmap_kv_cta(ty, r, cfg, cta, tid, warp, lane, fused, num_tokens, num_slots, interleaved, smem)
    else:
      t = arith.addi(arith.muli(cta, c32(TOKENS_PER_KV_CTA)), warp)
      _if(arith.cmpi(arith.CmpIPredicate.ult, t, c32(num_tokens)),      # warp-uniform
          lambda: _kv_token(ty, r, t, lane, fused, num_tokens, num_slots, interleaved, dedupe))
    scf.yield_([])
  with ir.InsertionPoint(branch.else_block):
    _q_items(ty, r, arith.subi(cta, c32(kv_ctas)), tid, num_tokens, heads, cfg.items_per_thread, interleaved)
    scf.yield_([])


@dataclasses.dataclass(frozen=True)
class CacheWriteCTAs:
  """The fused cache write (``build(fused=True)``) as extra CTAs of another kernel's launch: ``ctas`` CTAs whose
  first warpgroup runs this kernel's body as CTA 0 .. ctas - 1 would (the host kernel's other warpgroups do
  nothing there). ``kernels/bmm_fp8.build(side=...)`` takes it, so that the decode step's W_UK product and cache
  write share one launch (:mod:`mla_pallas.ops.prologue`).

  The host kernel passes ``N_INPUTS`` more inputs, in :func:`build`'s fused order (kv, q, positions, cos, sin, w,
  eps, kv_scale, slots, pages ref), and returns :meth:`out_types` more outputs (q_out [T · H, 64] bf16). Only
  modes without SMEM run this way: no bitmap duplicate check (:func:`uses_bitmap` False), else ValueError."""
  num_tokens: int
  heads: int
  num_slots: int
  cfg: TuningConfig
  interleaved: bool = True
  dedupe: bool = False

  N_INPUTS = 10

  def __post_init__(self):
    if uses_bitmap(self.cfg, True, self.num_tokens, self.dedupe):
      raise ValueError(f"CacheWriteCTAs: T = {self.num_tokens} needs the bitmap duplicate check (SMEM scratch); "
                       f"it runs as its own kernel (build)")

  @property
  def ctas(self) -> int:
    return sum(grid_for(self.cfg, self.num_tokens, self.heads))

  def out_types(self):
    return (jax.ShapeDtypeStruct((self.num_tokens * self.heads, D_ROPE), BF16),)

  def run(self, cta, refs):
    """Pallas level, in one warpgroup: CTA ``cta``'s (int32 scalar, traced) work on the 11 GMEM refs (inputs,
    then q_out)."""
    _run(True, self.num_tokens, self.heads, self.num_slots, self.cfg, self.interleaved, self.dedupe, cta, refs)


def _run(fused, num_tokens, heads, num_slots, cfg, interleaved, dedupe, cta, refs):
  @plgpu.inline_mgpu(arg_types=(SCALAR_LAYOUT,) + (plgpu.RefType(),) * len(refs))
  def f(ctx, cta_fa, *mrefs):
    del ctx
    _raw_body(fused, num_tokens, heads, num_slots, cfg, interleaved, dedupe, scalar_value(cta_fa), mrefs)
  f(scalar_array(cta), *refs)


@functools.lru_cache(maxsize=64)
def build(num_tokens: int, heads: int, num_slots: int, fused: bool, cfg: TuningConfig | None = None,
          interleaved: bool = True, dedupe: bool = False):
  """Build the kernel for T = num_tokens tokens of H = heads query heads (any H >= 1).

  Kernel arguments:
    kv    [T, 576] bf16.
    q     [T · H, 64] bf16: q_rope flattened.
    positions [T] int32 (clamped in the kernel); cos, sin [max_pos, 32] f32 (``interleaved``: DeepSeek pairs,
          else NeoX halves).
    w     [512] bf16 or f32: norm weight.
    eps   [1] f32.
    fused only: kv_scale [1] f32; slots [T] int32 (raw: out-of-range slots are skipped; with ``dedupe`` only the
          last token of a duplicated slot writes it (module docstring); without, no two in-range slots may be
          equal, e.g. the op's sanitised slots); pages ref [num_slots, 576] fp8 or bf16 (aliased, written; its
          dtype selects the row encoding).
  Returns q_out [T · H, 64] bf16, and (unfused) kv_out [T, 576] bf16.
  """
  if num_tokens < 1 or heads < 1:
    raise ValueError(f"num_tokens and heads must be >= 1; got {num_tokens}, {heads}")
  if num_tokens >= 2 ** 31 or num_slots >= 2 ** 31:
    raise NotImplementedError(f"rope_direct indexes tokens and cache slots with int32: T and num_slots < 2^31; got "
                              f"T={num_tokens}, num_slots={num_slots}")
  if dedupe and not fused:
    raise ValueError("dedupe needs the cache write (fused=True)")
  cfg = cfg or TuningConfig()
  fused, interleaved, dedupe = bool(fused), bool(interleaved), bool(dedupe)
  bitmap = uses_bitmap(cfg, fused, num_tokens, dedupe)
  kv_ctas, q_ctas = grid_for(cfg, num_tokens, heads, bitmap)
  if kv_ctas + q_ctas >= 2 ** 31:
    raise NotImplementedError(f"rope_direct: a grid of {kv_ctas} + {q_ctas} CTAs exceeds CUDA's 2^31 - 1 "
                              f"(T={num_tokens}, H={heads}, items_per_thread={cfg.items_per_thread})")
  scratch = [plgpu.SMEM(((1 << LOG_BITS) // 32,), jnp.int32), plgpu.SMEM((cfg.bitmap_tokens,), jnp.int32),
             plgpu.SMEM((cfg.bitmap_tokens,), jnp.int32)] if bitmap else []   # bitmap, own slots, drop flags

  def body(*refs):
    _run(fused, num_tokens, heads, num_slots, cfg, interleaved, dedupe, lax.axis_index("c"), refs)

  out_type = [jax.ShapeDtypeStruct((num_tokens * heads, D_ROPE), BF16)]
  if not fused:
    out_type.append(jax.ShapeDtypeStruct((num_tokens, D_QK), BF16))
  return plgpu.kernel(body, out_type=tuple(out_type), grid=(kv_ctas + q_ctas,), grid_names=("c",),
                      scratch_types=scratch, compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE))
