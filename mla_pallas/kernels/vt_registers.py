"""Vᵀ as a register A operand of the f16 P·V wgmmas, read straight from a gathered fp8 K tile (sm_90).

The sm_90 sparse decode kernel with the heads on the MMAs' N side (``kernels/sparse_sm90_heads_n.py``) computes Oᵀ
[512, N] += Vᵀ [512, 64 keys] · Pᵀ [64 keys, N]. Vᵀ is the A operand. From SMEM it has to be an f16 copy of the tile
(fp8 wgmma takes only K-major operands, and the gathered tile is [keys, latent], MN-major for Vᵀ), which costs an
upcast pass with 64 KB of bank-conflicted SMEM stores per tile and a 64 KB buffer. A register A operand has no
major-ness: each thread only has to hold its elements of the WGMMA fragment. So the consumer loads its bytes of the
tile with 64-bit SMEM loads, pairs the bytes of two keys with one ``prmt`` and converts them with one
``cvt.rn.f16x2.e4m3x2`` per f16 pair (exact: every e4m3 value is an f16 value).

Row permutation (why the loads are wide): the A fragment gives thread (warp w, lane 4q + t) rows
16w + q and 16w + 8 + q of each 64-row M block, with keys 8c + 2t and 8c + 2t + 1 (c = 0..7) as K. A row of Vᵀ is
a latent column, and which latent column a row holds is ours to choose as long as the output is stored the same
way. Here **row r of M block g holds latent column 8r + g** (g = 0..7): thread (w, q) then needs, for each of its
keys, the 8 consecutive bytes 128w + 8q + [0, 8) (h = 0) and 128w + 64 + 8q + [0, 8) (h = 1) of the key's row,
two 64-bit loads (conflict-free: the four keys of one load instruction pair up on the two halves of the banks,
2 wavefronts for 256 bytes). The same permutation makes the output store wide: over the 8 M blocks a thread holds
8 consecutive latent columns of each of its heads, one 16-byte row store each (:func:`store_rows`).

Per thread and 64 x 512 tile: 32 ``ld.shared.v2.b32``, 64 ``prmt``, 128 ``cvt.rn.f16x2.e4m3x2`` and the 32
m64nNk16 wgmmas (8 M blocks x 4 k16 steps). What it measured: docs/kernels/sparse_decode_sm90.md (v8).

The heads-on-M design's "producer_vt" (``kernels/sparse_sm90_heads_m.py``) uses the same operand with N = 64
heads and half of the M blocks per multiplier (``word``, ``blocks``, ``p_rows``; ``pv_wgmmas(pipelined=True)``).

Everything here is raw Mosaic GPU (``plgpu.inline_mgpu``, inline PTX). Interpret mode has no ``inline_mgpu``: the
kernel keeps the SMEM upcast there (same products, natural row order), so this module is checked by lowering on
the CPU and numerically on the GPU (tests/test_vt_registers.py, tests/test_sparse_decode_gpu.py).
"""
from __future__ import annotations

import importlib

import numpy as np

import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, vector
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import mma_utils, utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common
from mla_pallas.kernels.raw_mgpu import (SCALAR_LAYOUT, asm as _asm, c32 as _i32, scalar_array, scalar_value,
                                         thread_in_warpgroup, wgmma_commit as _commit, wgmma_wait as _wait,
                                         with_registers as _with_registers)

mgpu_wgmma = importlib.import_module("jax.experimental.mosaic.gpu.wgmma")   # the module (the package exports a function)

D_V = 512            # latent columns of V
TILE = 64            # keys per tile; rows per M block
M_BLOCKS = 8         # 512 latent columns = 8 M blocks of 64 rows
KEYS_PER_THREAD = 16  # 8 key pairs (c = 0..7) x 2
ROW_BYTES = 128      # bytes per row of a 128-byte-swizzled K chunk
CHUNK_BYTES = TILE * ROW_BYTES   # one [64, 128] K chunk


def latent_of_row(g: int, r):
  """The latent column held by row ``r`` of M block ``g`` of Vᵀ (and of Oᵀ)."""
  return 8 * r + g


def _thread():
  """(w, q, t) of this thread in its warpgroup: warp, lane // 4, lane % 4 (i32 values)."""
  _, warp, lane = thread_in_warpgroup()
  return warp, arith.divui(lane, _i32(4)), arith.remui(lane, _i32(4))


ALL_BLOCKS = tuple(range(M_BLOCKS))


def _key_words(k_tile, chunk, units, place, *, shared_bases: bool):
  """The shared loop of :func:`load_words` / :func:`load_half_words`: for each of this thread's 16 keys
  8 (i // 2) + 2t + i % 2 and each 16-byte unit u of ``units`` (i32 values, before the swizzle), one
  ``ld.shared.v2.b32`` of the 8 bytes at byte (q % 2) * 8 of that unit in the key's row of K chunk ``chunk``,
  i.e. address base + chunk * CHUNK_BYTES + key * 128 + (u ^ (key % 8)) * 16 + (q % 2) * 8; ``place(regs, i, j,
  lo, hi)`` puts unit j's two words into the (64, 128) int32 WGMMA-layout container.

  Two address forms, each the faster one where it is used (docs/kernels/sparse_decode_sm90.md, "Vᵀ word
  addresses"): ``shared_bases=True`` uses that key % 8 is 2t + i % 2 (the 8 (i // 2) drops out), so each (unit,
  i % 2) has one base register and the keys differ from it by constants (8 (i // 2) · 128 bytes) that become the
  loads' immediate offsets (the heads-on-M multipliers, whose loop ptxas otherwise kept 16 per-key offsets live
  across, partly in local memory); ``shared_bases=False`` computes each key's swizzled address from the key (the
  heads-on-N consumer, which holds no other state across its loop). The loads are side-effecting inline asm so
  that LLVM keeps them before the caller's release of the K buffer (an mbarrier arrive that follows them)."""
  i32 = ir.IntegerType.get_signless(32)
  _, q, t = _thread()
  base = llvm.ptrtoint(i32, mgpu_utils.memref_ptr(k_tile))
  regs = np.empty(fa.WGMMA_LAYOUT.registers_shape((TILE, 2 * TILE)), dtype=object)
  row0 = arith.addi(arith.addi(base, arith.muli(chunk, _i32(CHUNK_BYTES))),
                    arith.muli(arith.remui(q, _i32(2)), _i32(8)))

  def row_unit(key_mod8, row, unit):     # the swizzled address of ``unit`` in ``row`` (key % 8 given)
    return arith.addi(row, arith.muli(arith.xori(unit, key_mod8), _i32(16)))

  bases = {}
  if shared_bases:
    for parity in range(2):
      key_mod8 = arith.addi(arith.muli(t, _i32(2)), _i32(parity))      # key % 8 of keys 8m + 2t + parity (t <= 3)
      row = arith.addi(row0, arith.muli(key_mod8, _i32(ROW_BYTES)))
      for j, unit in enumerate(units):
        bases[parity, j] = row_unit(key_mod8, row, unit)
  for i in range(KEYS_PER_THREAD):
    if not shared_bases:
      key = arith.addi(arith.muli(t, _i32(2)), _i32(8 * (i // 2) + i % 2))
      row = arith.addi(row0, arith.muli(key, _i32(ROW_BYTES)))
    for j, unit in enumerate(units):
      if shared_bases:
        addr, at = bases[i % 2, j], f"[$2+{8 * (i // 2) * ROW_BYTES}]"
      else:
        addr, at = row_unit(arith.remui(key, _i32(8)), row, unit), "[$2]"
      pair = _asm(llvm.StructType.get_literal([i32, i32]), [addr], f"ld.shared.v2.b32 {{$0, $1}}, {at};",
                  "=r,=r,r", side_effects=True)
      place(regs, i, j, llvm.extractvalue(i32, pair, [0]), llvm.extractvalue(i32, pair, [1]))
  return fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT, _is_signed=True)


def _put(regs, i: int, h: int, lo, hi):
  """Container register (i, h) := the two words (lo, hi)."""
  idx = [0] * regs.ndim
  idx[1], idx[4] = i, h
  regs[tuple(idx)] = vector.from_elements(ir.VectorType.get((2,), ir.IntegerType.get_signless(32)), [lo, hi])


def load_words(k_tile):
  """This thread's bytes of V from the K tile ``k_tile`` (Mosaic memref [5, 8, 1, 8, 128] fp8: chunks 0-3 hold
  latent columns 0-511, 128-byte rows, 128-byte swizzle), as an int32 (64, 128) array in WGMMA layout used as a
  plain container: register (i, h) (i = 0..15, h = 0..1) holds the 8 bytes of key 8 (i // 2) + 2t + i % 2 at
  latent columns 128w + 64h + 8q + [0, 8) (two 32-bit words): chunk w, units 4h + q // 2."""
  w, q, _ = _thread()
  unit = arith.divui(q, _i32(2))
  return _key_words(k_tile, w, [unit, arith.addi(unit, _i32(4))], _put, shared_bases=False)


HALF_BLOCKS = 4     # M blocks of one multiplier half (256 latent columns) in the heads-on-M "producer_vt"


def latent_of_half_row(half: int, g: int, r):
  """The latent column held by row ``r`` of M block ``g`` (0-3) of multiplier ``half``'s Vᵀ (and Oᵀ): thread (w,
  q) holds rows 16w + q (h = 0) and 16w + 8 + q (h = 1), i.e. columns 256 half + 64w + 8q + 4h + g, so one
  64-bit load per key gives it both rows' bytes of all four blocks (:func:`load_half_words`) and one 16-byte
  store per head writes 8 consecutive columns (:func:`store_half_rows`)."""
  return 256 * half + 64 * (r // 16) + 8 * (r % 8) + 4 * ((r // 8) % 2) + g


def load_half_words(k_tile, half):
  """Multiplier ``half``'s bytes of V (latent columns 256 half ... 256 half + 255, :func:`latent_of_half_row`)
  from the K tile ``k_tile`` (Mosaic memref [5, 8, 1, 8, 128] fp8, 128-byte swizzle) in :func:`load_words`'
  container, read as word 0: register (i, h) holds, in both lanes, the 4 bytes (blocks 0-3) of key
  8 (i // 2) + 2t + i % 2 at columns 256 half + 64w + 8q + 4h + [0, 4). One ``ld.shared.v2.b32`` per key (16 per
  thread; chunk 2 half + w // 2, unit 4 (w % 2) + q // 2): the four keys of one instruction take 64 bytes of a
  row each, two on each half of the banks (2 wavefronts for 256 bytes, no conflict). ``half``: an i32 value (0 or
  1: one code path for both multipliers)."""
  w, q, _ = _thread()
  chunk = arith.addi(arith.muli(half, _i32(2)), arith.divui(w, _i32(2)))
  unit = arith.addi(arith.muli(arith.remui(w, _i32(2)), _i32(4)), arith.divui(q, _i32(2)))

  def place(regs, i, _, lo, hi):
    _put(regs, i, 0, lo, lo)
    _put(regs, i, 1, hi, hi)
  return _key_words(k_tile, chunk, [unit], place, shared_bases=True)


def store_half_rows(accs, o, half):
  """Stores multiplier ``half``'s Oᵀ: accs[g] (g = 0-3, f32 (64, N) WGMMA-layout arrays in the
  :func:`latent_of_half_row` order) to ``o`` (GMEM memref [out_heads, 512], bf16 or f32): for each of its heads
  8j + 2t + v a thread holds the 8 consecutive columns 256 half + 64w + 8q + [0, 8) (h = 0, 1 times blocks 0-3),
  one 16-byte (bf16) or two (f32) vector stores each. ``half``: an i32 value (0 or 1)."""
  assert len(accs) == HALF_BLOCKS, len(accs)
  w, q, _ = _thread()
  col = arith.addi(arith.muli(half, _i32(256)), arith.addi(arith.muli(w, _i32(64)), arith.muli(q, _i32(8))))
  _store_vectors(o, col, [(0, [(a, h) for h in range(2) for a in accs])])


def _byte_pairs(words, c: int, h: int, g: int):
  """One ``prmt`` (an i32 value): the (key 8c + 2t, key 8c + 2t + 1) bytes of M block g in the low 16 bits and of
  block g + 1 in the high 16 bits, from row half h of ``load_words``' container (byte b = g % 4 of the keys'
  32-bit words g // 4)."""
  wreg = words.registers
  wa = wreg[0, 2 * c, 0, 0, h, 0, 0, 0, 0]       # key 8c + 2t
  wb = wreg[0, 2 * c + 1, 0, 0, h, 0, 0, 0, 0]   # key 8c + 2t + 1
  b, word = g % 4, g // 4
  sel = b | (4 + b) << 4 | (b + 1) << 8 | (4 + b + 1) << 12
  return _asm(ir.IntegerType.get_signless(32), [vector.extract(wa, [], [word]), vector.extract(wb, [], [word])],
              f"prmt.b32 $0, $1, $2, {sel:#x};", "=r,r,r")


def _convert_half(pair, high: bool):
  """One ``cvt.rn.f16x2.e4m3x2`` of the low or high 16 bits of ``pair`` (SASS ``F2FP ... R.H1``: no extra
  instruction for the high half)."""
  half = "hi" if high else "lo"
  return _asm(ir.IntegerType.get_signless(32), [pair],
              f"{{\n.reg .b16 lo, hi;\nmov.b32 {{lo, hi}}, $1;\ncvt.rn.f16x2.e4m3x2 $0, {half};\n}}", "=r,r")


def _operand(value):
  """An A operand (f16 (64, 64), WGMMA layout) whose register (c, h) is the f16x2 i32 ``value(c, h)``."""
  i32 = ir.IntegerType.get_signless(32)
  f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
  regs_shape = fa.WGMMA_LAYOUT.registers_shape((TILE, TILE))
  out = np.empty(regs_shape, dtype=object)
  for c in range(8):
    for h in range(2):
      idx = [0] * len(regs_shape)
      idx[1], idx[4] = c, h
      out[tuple(idx)] = vector.bitcast(f16x2, vector.from_elements(ir.VectorType.get((1,), i32), [value(c, h)]))
  return fa.FragmentedArray(_registers=out, _layout=fa.WGMMA_LAYOUT, _is_signed=None)


def paired_words(words, blocks):
  """The byte pairs of ``blocks`` (a run of whole pairs (2i, 2i + 1)) from ``load_words``' container, one ``prmt``
  per (key pair c, row half h, block pair): {(c, h, g): i32} for even g (:func:`_byte_pairs`). The words die as
  their pairs are made, and each pair register dies with the second block's conversion, so building the blocks
  one at a time from them holds fewer registers than from the words (which every block reads)."""
  assert all(g % 2 == 0 and g + 1 in blocks for g in blocks[::2]), blocks
  return {(c, h, g): _byte_pairs(words, c, h, g) for c in range(8) for h in range(2) for g in blocks[::2]}


def paired_operand(paired, g: int):
  """The A operand Vᵀ[M block g] (f16 (64, 64), WGMMA layout) from :func:`paired_words`: one
  ``cvt.rn.f16x2.e4m3x2`` per register, of the low (even g) or high (odd g) half of its pair register."""
  return _operand(lambda c, h: _convert_half(paired[c, h, g - g % 2], g % 2 == 1))


def block_operands(words, blocks=ALL_BLOCKS):
  """The A operands Vᵀ[M block g] for g in ``blocks`` (f16 (64, 64) arrays, WGMMA layout) from ``load_words``'
  container; ``blocks`` is a run of whole pairs (2i, 2i + 1), e.g. all 8 or the 4 of one 32-bit word (one
  ``prmt`` per register pair of the two blocks, :func:`paired_words`)."""
  paired = paired_words(words, blocks)
  return [paired_operand(paired, g) for g in blocks]


def _store_vectors(o, col, vectors) -> None:
  """For each head 8j + 2t + v of ``o`` (GMEM memref [out_heads, 512], bf16 or f32) and each (offset, parts) of
  ``vectors``: one vector store at latent column ``col`` + offset of the values ``parts`` ((f32 (64, N) WGMMA
  array, h) pairs: the array's element at that head in row half h), 16-byte aligned."""
  out_heads = ir.MemRefType(o.type).shape[0]
  dtype = ir.MemRefType(o.type).element_type
  nbytes = mgpu_utils.bytewidth(dtype)
  i64 = ir.IntegerType.get_signless(64)
  _, _, t = _thread()
  base = mgpu_utils.memref_ptr(o)
  for j in range(out_heads // 8):
    for v in range(2):
      head = arith.addi(arith.muli(t, _i32(2)), _i32(8 * j + v))
      for offset, parts in vectors:
        vals = [vector.extract(a.registers[0, j, 0, 0, h, 0, 0, 0, 0], [], [v]) for a, h in parts]
        vec = vector.from_elements(ir.VectorType.get((len(vals),), ir.F32Type.get()), vals)
        if dtype != ir.F32Type.get():
          vec = arith.truncf(ir.VectorType.get((len(vals),), dtype), vec)
        elem = arith.addi(arith.muli(head, _i32(D_V)), arith.addi(col, _i32(offset)))
        off = arith.extui(i64, arith.muli(elem, _i32(nbytes)))
        ptr = mgpu_utils.getelementptr(base, [off], ir.IntegerType.get_signless(8))
        llvm.store(vec, ptr, alignment=16)


def store_rows(accs, o):
  """Stores Oᵀ: accs[g] (f32 (64, N) WGMMA-layout arrays, row r = latent column 8r + g) to ``o`` (GMEM memref
  [out_heads, 512], bf16 or f32; out_heads a multiple of 8, <= N). Across the 8 blocks a thread holds, for each of
  its heads 8j + 2t + v and halves h, the 8 consecutive latent columns 128w + 64h + 8q + [0, 8): one 16-byte (bf16)
  or two (f32) vector stores each, instead of 64 single-element stores of a transposed view."""
  w, q, _ = _thread()
  col = arith.addi(arith.muli(w, _i32(128)), arith.muli(q, _i32(8)))
  _store_vectors(o, col, [(64 * h, [(a, h) for a in accs]) for h in range(2)])


def store_o(accs, o_ref):
  """Pallas-level :func:`store_rows`: ``accs`` (8 f32 (64, N) arrays, WGMMA layout, already normalised) to
  ``o_ref`` (GMEM [out_heads, 512])."""
  @plgpu.inline_mgpu(arg_types=(tuple(plgpu.Layout.WGMMA for _ in accs), plgpu.RefType()))
  def f(ctx, accs, o):
    del ctx
    store_rows(accs, o)
  f(tuple(accs), o_ref)


def store_half_o(accs, o_ref, half):
  """Pallas-level :func:`store_half_rows`: multiplier ``half``'s ``accs`` (4 f32 (64, N) arrays, WGMMA layout,
  already normalised) to ``o_ref`` (GMEM [out_heads, 512]); ``half`` an int32 scalar (traced or a Python int)."""
  @plgpu.inline_mgpu(arg_types=(tuple(plgpu.Layout.WGMMA for _ in accs), plgpu.RefType(), SCALAR_LAYOUT))
  def f(ctx, accs, o, half_arr):
    del ctx
    store_half_rows(accs, o, scalar_value(half_arr))
  f(tuple(accs), o_ref, scalar_array(half))


def load_v_half_words(k_tile_ref, half):
  """Pallas-level :func:`load_half_words` of the K tile ``k_tile_ref`` ([5, 64, 128] fp8, 128-byte swizzled);
  ``half`` an int32 scalar (traced or a Python int)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(common.swizzled(common.FP8, ROW_BYTES)), SCALAR_LAYOUT),
                     return_type=plgpu.ShapeDtypeStruct((TILE, 2 * TILE), jnp.int32, layout=plgpu.Layout.WGMMA))
  def f(ctx, k_tile, half_arr):
    del ctx
    return load_half_words(k_tile, scalar_value(half_arr))
  return f(k_tile_ref, scalar_array(half))


def load_v_words(k_tile_ref):
  """Pallas-level :func:`load_words` of the K tile ``k_tile_ref`` ([5, 64, 128] fp8, 128-byte swizzled)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(common.swizzled(common.FP8, ROW_BYTES)),),
                     return_type=plgpu.ShapeDtypeStruct((TILE, 2 * TILE), jnp.int32, layout=plgpu.Layout.WGMMA))
  def f(ctx, k_tile):
    del ctx
    return load_words(k_tile)
  return f(k_tile_ref)


def _p_view(pt, slot):
  """The P tile whose descriptor the P·V wgmmas are built from, and the byte offset (an i64 value, or 0) of the
  tile they read from it: with ``slot`` (an i32 value), slot 0 of ``pt`` ([slots, ...]: a static view, so its
  descriptor does not depend on the loop and LLVM hoists it) and slot · slot bytes; without, ``pt`` itself."""
  if slot is None:
    return pt, 0
  strides, _ = ir.MemRefType(pt.type).get_strides_and_offset()
  slot_bytes = strides[0] * 2      # f16
  i64 = ir.IntegerType.get_signless(64)
  offset = arith.muli(arith.extui(i64, slot), arith.constant(i64, slot_bytes))
  return mgpu_utils.memref_slice(pt, 0), offset


def _issue_pv(words, pt, accs, swizzle: int, blocks, p_rows: bool, pipelined: bool, slot=None):
  """Inside an ``inline_mgpu`` body: issue (and commit) accs[i] += Vᵀ[M block blocks[i]] · Pᵀ, one wgmma group per
  block; returns the accumulators (the last group's wgmmas in flight). ``pipelined``: the byte pairs of all blocks
  first (:func:`paired_words`), then block i's A fragments converted only after ``wgmma.wait_group 1`` has retired
  block i - 2's group (:func:`pv_wgmmas`). ``slot``: P is slot ``slot`` of ``pt`` (:func:`_p_view`). The B
  descriptors (one per 16-key group of P) are built once, as ``mgpu.wgmma`` builds them, and shared by the
  blocks."""
  view, offset = _p_view(pt, slot)
  if p_rows:      # tiled memref (N/8, 1, 8, 64) of P -> the transposed (1, N/8, 64, 8) view of Pᵀ
    view = mgpu_utils.memref_transpose(view, (1, 0, 3, 2))
  (_, n), _ = mma_utils.tiled_memref_shape(view)
  k_group = swizzle // 2                     # f16 keys per swizzled row of Pᵀ
  (desc, k_step), (_, k_group_stride), fastest = mma_utils.create_descriptor(
      view, swizzle=swizzle, large_tile=(k_group,) * 2, group_size=(k_group, n), logical_k_major=True)
  i64 = ir.IntegerType.get_signless(64)
  if not isinstance(offset, int):
    desc = llvm.add(desc, arith.shrui(offset, arith.constant(i64, 4)), overflow_flags=llvm.IntegerOverflowFlags.none)
  b_descs = [desc if not g else llvm.add(desc, arith.constant(i64, mma_utils.encode_addr(g * k_group_stride)),
                                         overflow_flags=llvm.IntegerOverflowFlags.none)
             for g in range(TILE // k_group)]
  f16 = ir.F16Type.get()
  out = []
  a_ops = None if pipelined else block_operands(words, blocks)
  paired = paired_words(words, blocks) if pipelined else None
  for i, (g, acc) in enumerate(zip(blocks, accs)):
    if pipelined and i >= 2:
      _wait(1)     # block i - 2 done: its A registers are free for block i's
    a = mgpu_wgmma.wgmma_fence(paired_operand(paired, g) if pipelined else a_ops[i])
    acc = mgpu.WGMMAAccumulator.from_registers(acc)
    regs = acc._value.registers.copy()
    for kg, b_desc in enumerate(b_descs):
      regs[0:1] = mgpu_wgmma.wgmma_m64(regs[0:1], a[:, kg * k_group:(kg + 1) * k_group], b_desc, a_transpose=None,
                                       b_transpose=fastest != mma_utils.Dim.K, a_k_stride=None,
                                       b_k_stride=k_step[1][0], n=n, swizzle=swizzle, a_element_type=f16,
                                       b_element_type=f16)
    out.append(_with_registers(acc, regs))
    _commit()
  return out


def _acc_types(accs):
  return tuple(plgpu.ShapeDtypeStruct(a.shape, jnp.float32, layout=plgpu.Layout.WGMMA) for a in accs)


def pv_wgmmas(words, pt_ref, accs, swizzle: int, blocks=ALL_BLOCKS, p_rows: bool = False, pipelined: bool = False,
              slot=None):
  """accs[i] (f32 (64, N), WGMMA layout) += Vᵀ[M block blocks[i]] · Pᵀ, A from ``words`` in registers,
  B = ``pt_ref``: Pᵀ [64 keys, N] f16, swizzled ``swizzle`` = 2N bytes, or with ``p_rows`` P [N, 64 keys] (rows
  of heads, 128-byte swizzle), read transposed (K-major B); waited for. Returns the new accumulators. ``slot`` (an
  int32 scalar): ``pt_ref`` holds P slots on its first axis and the product reads slot ``slot``; its B
  descriptors are slot 0's (loop-invariant) plus the slot's offset, not built from a dynamically sliced ref in
  every call.

  Default: the A fragments of all ``blocks`` are built (``prmt`` + ``cvt``, two blocks per ``prmt``) and then
  the wgmmas issued, one group per block; with many accumulator registers live ptxas keeps every block's A alive
  across the wgmmas (16 registers per block). ``pipelined`` (``blocks`` a run of whole pairs): the byte pairs of
  every two blocks first (one ``prmt`` per register pair, :func:`paired_words`), then block i's fragments
  converted while block i - 1's wgmmas run, after a ``wgmma.wait_group 1`` has retired block i - 2, so at most
  two blocks' A are live: the form for a warpgroup with fewer registers than its accumulators and all A
  fragments need ("producer_vt"'s multipliers at 200; docs/kernels/sparse_decode_sm90.md measures the forms,
  among them a ``prmt`` per register built from the words and two blocks at a time after a full wait).

  The register operand is read asynchronously by the tensor cores; ptxas keeps those registers alive until the
  wait at the end (one ``wgmma.wait_group 0``), and the results pass an optimization barrier after it so that
  LLVM cannot move their uses above the wait."""
  slot_types = (SCALAR_LAYOUT,) if slot is not None else ()

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(common.swizzled(jnp.float16, swizzle)),
                                tuple(plgpu.Layout.WGMMA for _ in accs)) + slot_types,
                     return_type=_acc_types(accs))
  def f(ctx, words, pt, accs, *slot_arr):
    del ctx
    out = _issue_pv(words, pt, accs, swizzle, blocks, p_rows, pipelined,
                    scalar_value(slot_arr[0]) if slot_arr else None)
    _wait(0)
    return tuple(fa.optimization_barrier(a.value) for a in out)
  return f(words, pt_ref, tuple(accs), *((scalar_array(slot),) if slot is not None else ()))

