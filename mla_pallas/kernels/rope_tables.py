"""In-kernel gather of the per-token RoPE tables for :mod:`mla_pallas.kernels.rope_rmsnorm` (sm_90, raw Mosaic GPU).

The rope kernel rotates a 64-wide row as ``y = x · C + swap(x) · S`` with per-token tables arranged per column
(interleaved / DeepSeek pairs: ``C = [c0 c0 c1 c1 ..]``, ``S = [−s0 s0 −s1 s1 ..]``; NeoX halves: ``C = [c ‖ c]``,
``S = [−s ‖ s]``), where ``c = cos[pos]``, ``s = sin[pos]`` are rows of the [max_pos, 32] f32 tables. Above
T = ``rope_rmsnorm.GATHER_TABLES_MAX_TOKENS`` and in interpret mode the op builds those rows in an XLA pre-pass (a
[T, 128] gather + expansion written to and re-read from HBM, one extra kernel launch). With
``TuningConfig.gather_tables`` (the default at smaller T) the kernel builds them itself: each of one warpgroup's
128 threads takes (row, part) items, part = 4 consecutive table entries: it loads the row's position from GMEM
(``ld.global``; rows past T read token T - 1's, never used), clamps it to [0, max_pos), loads 16 bytes of ``cos``
and of ``sin`` (vectorised ``ld.global``) and writes the expanded, signed values as 16-byte SMEM stores into the
row of the kernel's table tile ([rows, 136] int32: the f32 bits of C ‖ S in columns 0-127, rows padded by 8 words
against SMEM bank conflicts, see rope_rmsnorm.TAB_COLS_GATHER). (The first version loaded the
positions by TMA into SMEM first: one more round trip before the table loads; H200 2026-11-30h: +1.1 us on the
kernel at T = 1.) The values are the same f32 values as the pre-pass's (a gather, a duplication and a negation
are exact), so the kernel's output is bitwise the same (H200: tests/test_rope_rmsnorm_kernel_gpu.py).

With the cache write and T <= DEDUPE_MAX_TOKENS the op also leaves the duplicate-slot check to the kernel
(:func:`drop_overwritten`: each window row's slot against every later token's, from a TMA of all T slots), so the
op launches the kernel alone.

Interpret mode has no ``plgpu.inline_mgpu``: the op keeps the XLA pre-pass there; this module is checked by sm_90
lowering on the CPU (tests/test_rope_rmsnorm_kernel.py) and numerically on the GPU
(tests/test_rope_rmsnorm_kernel_gpu.py).
"""
from __future__ import annotations

from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, scf, vector
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels.raw_mgpu import SCALAR_LAYOUT, THREADS, byte_ptr, c32, scalar_array, scalar_value
from mla_pallas.kernels.raw_mgpu import thread_in_warpgroup

D_ROPE = 64
HALF = D_ROPE // 2
PART = 4                      # table entries per item (one 16-byte load per table)
PARTS = HALF // PART          # items per row


def _expand(c4, s4, part, interleaved: bool):
  """[(column, 4 f32 values)] of the row's C ‖ S (128 columns) made from cos/sin entries 4·part .. 4·part + 3."""
  f32 = ir.F32Type.get()
  v4 = ir.VectorType.get((PART,), f32)
  c = [vector.extract(c4, [], [j]) for j in range(PART)]
  s = [vector.extract(s4, [], [j]) for j in range(PART)]
  neg = [arith.negf(x) for x in s]
  col = arith.muli(part, c32(2 * PART if interleaved else PART))
  if interleaved:   # entry i -> columns 2i, 2i + 1
    out = [(col, [c[0], c[0], c[1], c[1]]), (arith.addi(col, c32(PART)), [c[2], c[2], c[3], c[3]]),
           (arith.addi(col, c32(D_ROPE)), [neg[0], s[0], neg[1], s[1]]),
           (arith.addi(col, c32(D_ROPE + PART)), [neg[2], s[2], neg[3], s[3]])]
  else:             # entry i -> columns i and i + 32
    out = [(col, c), (arith.addi(col, c32(HALF)), c),
           (arith.addi(col, c32(D_ROPE)), neg), (arith.addi(col, c32(D_ROPE + HALF)), s)]
  return [(k, vector.from_elements(v4, vals)) for k, vals in out]


def gather_rows(pos, first, cos, sin, tab, interleaved: bool):
  """Raw Mosaic GPU body: fill columns 0-127 of row r of ``tab`` (SMEM memref [rows, >= 128] int32) with C ‖ S of token
  min(first + r, T - 1)'s position, ``pos`` (GMEM memref [T] int32, unclamped), from ``cos`` / ``sin`` (GMEM
  memrefs [max_pos, 32] f32); ``first``: i32 value. Every thread of the warpgroup takes items tid, tid + 128, ..;
  the caller makes the stores visible (a warpgroup barrier) before any thread reads ``tab``."""
  i32 = ir.IntegerType.get_signless(32)
  f32 = ir.F32Type.get()
  rows = ir.MemRefType(tab.type).shape[0]
  max_pos = ir.MemRefType(cos.type).shape[0]
  num_tokens = ir.MemRefType(pos.type).shape[0]
  cols = ir.MemRefType(tab.type).shape[1]
  assert cols >= 2 * D_ROPE and cols % 4 == 0 and ir.MemRefType(cos.type).shape[1] == HALF, (tab.type, cos.type)
  tid, _, _ = thread_in_warpgroup()
  pos_base, cos_base = mgpu_utils.memref_ptr(pos), mgpu_utils.memref_ptr(cos)
  sin_base, tab_base = mgpu_utils.memref_ptr(sin), mgpu_utils.memref_ptr(tab)
  v4 = ir.VectorType.get((PART,), f32)
  items = rows * PARTS
  for it in range(-(-items // THREADS)):
    item = arith.addi(tid, c32(it * THREADS))

    def body(item=item):
      row = arith.divui(item, c32(PARTS))
      part = arith.remui(item, c32(PARTS))
      tok = arith.minsi(arith.addi(first, row), c32(num_tokens - 1))
      p = llvm.load(i32, byte_ptr(pos_base, arith.muli(tok, c32(4))))
      p = arith.maxsi(arith.minsi(p, c32(max_pos - 1)), c32(0))
      off = arith.muli(arith.addi(arith.muli(p, c32(HALF)), arith.muli(part, c32(PART))), c32(4))
      c4 = llvm.load(v4, byte_ptr(cos_base, off), alignment=16)
      s4 = llvm.load(v4, byte_ptr(sin_base, off), alignment=16)
      row_off = arith.muli(row, c32(cols * 4))
      for col, vals in _expand(c4, s4, part, interleaved):
        llvm.store(vals, byte_ptr(tab_base, arith.addi(row_off, arith.muli(col, c32(4)))), alignment=16)

    if (it + 1) * THREADS <= items:
      body()
    else:                                   # the last round covers only part of the warpgroup
      guard = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, item, c32(items)))
      with ir.InsertionPoint(guard.then_block):
        body()
        scf.yield_([])


def gather_tables(pos_ref, first, cos_ref, sin_ref, tab_ref, interleaved: bool):
  """Pallas-level :func:`gather_rows` (run by one warpgroup): ``pos_ref`` GMEM [T] int32, ``first`` the window's
  first token (int32 scalar, traced), ``cos_ref`` / ``sin_ref`` GMEM [max_pos, 32] f32, ``tab_ref`` SMEM
  [rows, >= 128] int32 (columns 0-127 written)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), SCALAR_LAYOUT, plgpu.RefType(), plgpu.RefType(),
                                plgpu.RefType()))
  def f(ctx, pos, first_fa, cos, sin, tab):
    del ctx
    gather_rows(pos, scalar_value(first_fa), cos, sin, tab, interleaved)
  f(pos_ref, scalar_array(first), cos_ref, sin_ref, tab_ref)


# In-kernel duplicate-slot check (the op's ``_last_writer`` for small T): every token of the CTA's table window is
# compared with every later token's slot; T is static and small, so the loop is unrolled (16-byte SMEM loads).
DEDUPE_MAX_TOKENS = 256


def drop_overwritten_rows(win, all_slots, first, num_tokens: int):
  """Raw Mosaic GPU body: ``win`` (SMEM [L] int32) holds the slots of the window rows r (token first + r);
  ``all_slots`` (SMEM [>= T rounded up to 4] int32; entries past T unspecified) the slots of all T tokens.
  Thread r of the warpgroup (r < min(L, 128)) sets ``win[r] = -1`` when a later token j (first + r < j < T) has
  the same slot, so that exactly the last writer of each slot stays. ``first``: i32 value (the window's first
  token). The caller makes the stores visible (a warpgroup barrier) before they are read."""
  i32 = ir.IntegerType.get_signless(32)
  i1 = ir.IntegerType.get_signless(1)
  rows = min(ir.MemRefType(win.type).shape[0], THREADS)
  assert num_tokens <= DEDUPE_MAX_TOKENS and ir.MemRefType(all_slots.type).shape[0] >= -(-num_tokens // 4) * 4
  r, _, _ = thread_in_warpgroup()
  win_base, all_base = mgpu_utils.memref_ptr(win), mgpu_utils.memref_ptr(all_slots)
  v4 = ir.VectorType.get((4,), i32)
  guard = scf.IfOp(arith.cmpi(arith.CmpIPredicate.ult, r, c32(rows)))
  with ir.InsertionPoint(guard.then_block):
    row_ptr = byte_ptr(win_base, arith.muli(r, c32(4)))
    mine = llvm.load(i32, row_ptr)
    tok = arith.addi(first, r)
    hit = arith.constant(i1, 0)
    for k in range(-(-num_tokens // 4)):
      vals = llvm.load(v4, byte_ptr(all_base, c32(16 * k)), alignment=16)
      for e in range(4):
        j = 4 * k + e
        if j >= num_tokens:
          break
        same = arith.cmpi(arith.CmpIPredicate.eq, vector.extract(vals, [], [e]), mine)
        later = arith.cmpi(arith.CmpIPredicate.sgt, c32(j), tok)
        hit = arith.ori(hit, arith.andi(same, later))
    drop = scf.IfOp(hit)
    with ir.InsertionPoint(drop.then_block):
      llvm.store(c32(-1), row_ptr)
      scf.yield_([])
    scf.yield_([])


def drop_overwritten(win_ref, all_ref, first, num_tokens: int):
  """Pallas-level :func:`drop_overwritten_rows` (run by one warpgroup); ``first`` an int32 scalar (traced)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), SCALAR_LAYOUT))
  def f(ctx, win, all_slots, first_fa):
    del ctx
    drop_overwritten_rows(win, all_slots, scalar_value(first_fa), num_tokens)
  f(win_ref, all_ref, scalar_array(first))
