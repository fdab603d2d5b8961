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

import numpy as np

import jax.numpy as jnp
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, vector
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common
from mla_pallas.kernels.raw_mgpu import asm as _asm, c32 as _i32, swizzle as _swizzle, thread_in_warpgroup

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


def _key_words(k_tile, chunk, units, place):
  """The shared loop of :func:`load_words` / :func:`load_half_words`: for each of this thread's 16 keys
  8 (i // 2) + 2t + i % 2 and each 16-byte unit u of ``units`` (i32 values, before the swizzle), one
  ``ld.shared.v2.b32`` of the 8 bytes at byte (q % 2) * 8 of that unit in the key's row of K chunk ``chunk``,
  i.e. address base + chunk * CHUNK_BYTES + key * 128 + (u ^ (key % 8)) * 16 + (q % 2) * 8; ``place(regs, i, j,
  lo, hi)`` puts unit j's two words into the (64, 128) int32 WGMMA-layout container. The loads are
  side-effecting inline asm so that LLVM keeps them before the caller's release of the K buffer (an mbarrier
  arrive that follows them)."""
  i32 = ir.IntegerType.get_signless(32)
  _, q, t = _thread()
  base = llvm.ptrtoint(i32, mgpu_utils.memref_ptr(k_tile))
  regs = np.empty(fa.WGMMA_LAYOUT.registers_shape((TILE, 2 * TILE)), dtype=object)
  row0 = arith.addi(arith.addi(base, arith.muli(chunk, _i32(CHUNK_BYTES))),
                    arith.muli(arith.remui(q, _i32(2)), _i32(8)))
  for i in range(KEYS_PER_THREAD):
    key = arith.addi(arith.muli(t, _i32(2)), _i32(8 * (i // 2) + i % 2))
    row = arith.addi(row0, arith.muli(key, _i32(ROW_BYTES)))
    for j, unit in enumerate(units):
      addr = arith.addi(row, arith.muli(arith.xori(unit, arith.remui(key, _i32(8))), _i32(16)))
      pair = _asm(llvm.StructType.get_literal([i32, i32]), [addr], "ld.shared.v2.b32 {$0, $1}, [$2];", "=r,=r,r",
                  side_effects=True)
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
  return _key_words(k_tile, w, [unit, arith.addi(unit, _i32(4))], _put)


HALF_BLOCKS = 4     # M blocks of one multiplier half (256 latent columns) in the heads-on-M "producer_vt"


def latent_of_half_row(half: int, g: int, r):
  """The latent column held by row ``r`` of M block ``g`` (0-3) of multiplier ``half``'s Vᵀ (and Oᵀ): thread (w,
  q) holds rows 16w + q (h = 0) and 16w + 8 + q (h = 1), i.e. columns 256 half + 64w + 8q + 4h + g, so one
  64-bit load per key gives it both rows' bytes of all four blocks (:func:`load_half_words`) and one 16-byte
  store per head writes 8 consecutive columns (:func:`store_half_rows`)."""
  return 256 * half + 64 * (r // 16) + 8 * (r % 8) + 4 * ((r // 8) % 2) + g


def load_half_words(k_tile, half: int):
  """Multiplier ``half``'s bytes of V (latent columns 256 half ... 256 half + 255, :func:`latent_of_half_row`)
  from the K tile ``k_tile`` (Mosaic memref [5, 8, 1, 8, 128] fp8, 128-byte swizzle) in :func:`load_words`'
  container, read as word 0: register (i, h) holds, in both lanes, the 4 bytes (blocks 0-3) of key
  8 (i // 2) + 2t + i % 2 at columns 256 half + 64w + 8q + 4h + [0, 4). One ``ld.shared.v2.b32`` per key (16 per
  thread; chunk 2 half + w // 2, unit 4 (w % 2) + q // 2): the four keys of one instruction take 64 bytes of a
  row each, two on each half of the banks (2 wavefronts for 256 bytes, no conflict)."""
  w, q, _ = _thread()
  chunk = arith.addi(_i32(2 * half), arith.divui(w, _i32(2)))
  unit = arith.addi(arith.muli(arith.remui(w, _i32(2)), _i32(4)), arith.divui(q, _i32(2)))

  def place(regs, i, _, lo, hi):
    _put(regs, i, 0, lo, lo)
    _put(regs, i, 1, hi, hi)
  return _key_words(k_tile, chunk, [unit], place)


def store_half_rows(accs, o, half: int):
  """Stores multiplier ``half``'s Oᵀ: accs[g] (g = 0-3, f32 (64, N) WGMMA-layout arrays in the
  :func:`latent_of_half_row` order) to ``o`` (GMEM memref [out_heads, 512], bf16 or f32): for each of its heads
  8j + 2t + v a thread holds the 8 consecutive columns 256 half + 64w + 8q + [0, 8) (h = 0, 1 times blocks 0-3),
  one 16-byte (bf16) or two (f32) vector stores each."""
  assert len(accs) == HALF_BLOCKS, len(accs)
  w, q, _ = _thread()
  col = arith.addi(_i32(256 * half), arith.addi(arith.muli(w, _i32(64)), arith.muli(q, _i32(8))))
  _store_vectors(o, col, [(0, [(a, h) for h in range(2) for a in accs])])


def _fragments(words, blocks, per_prmt: int):
  """The A operands Vᵀ[M block g] for g in ``blocks`` from ``load_words``' container. Per (key pair, half) one
  ``prmt`` gathers byte b = g % 4 and b + 1 of the two keys' 32-bit words g // 4 into two (key, key) byte pairs,
  each converted by one ``cvt.rn.f16x2.e4m3x2``; ``per_prmt`` = 2 converts both (blocks g, g + 1: ``blocks`` a run
  of whole pairs), 1 only block g's."""
  i32 = ir.IntegerType.get_signless(32)
  f16x2 = ir.VectorType.get((2,), ir.F16Type.get())
  regs_shape = fa.WGMMA_LAYOUT.registers_shape((TILE, TILE))
  out = {g: np.empty(regs_shape, dtype=object) for g in blocks}
  wreg = words.registers
  cvt = "cvt.rn.f16x2.e4m3x2 $0, lo;\n" + ("cvt.rn.f16x2.e4m3x2 $1, hi;\n" if per_prmt == 2 else "")
  result = llvm.StructType.get_literal([i32, i32]) if per_prmt == 2 else i32
  for c in range(8):
    for h in range(2):
      wa = wreg[0, 2 * c, 0, 0, h, 0, 0, 0, 0]       # key 8c + 2t
      wb = wreg[0, 2 * c + 1, 0, 0, h, 0, 0, 0, 0]   # key 8c + 2t + 1
      for g in blocks[::per_prmt]:
        b, word = g % 4, g // 4
        sel = b | (4 + b) << 4 | (b + 1) << 8 | (4 + b + 1) << 12
        conv = _asm(result, [vector.extract(wa, [], [word]), vector.extract(wb, [], [word])],
                    "{\n.reg .b32 p;\n.reg .b16 lo, hi;\n"
                    f"prmt.b32 p, ${per_prmt}, ${per_prmt + 1}, {sel:#x};\nmov.b32 {{lo, hi}}, p;\n{cvt}}}",
                    ",".join(["=r"] * per_prmt + ["r", "r"]))
        vals = [llvm.extractvalue(i32, conv, [j]) for j in range(2)] if per_prmt == 2 else [conv]
        for j, val in enumerate(vals):
          idx = [0] * len(regs_shape)
          idx[1], idx[4] = c, h
          out[g + j][tuple(idx)] = vector.bitcast(f16x2, vector.from_elements(ir.VectorType.get((1,), i32), [val]))
  return [fa.FragmentedArray(_registers=out[g], _layout=fa.WGMMA_LAYOUT, _is_signed=None) for g in blocks]


def block_operands(words, blocks=ALL_BLOCKS):
  """The A operands Vᵀ[M block g] for g in ``blocks`` (f16 (64, 64) arrays, WGMMA layout) from ``load_words``'
  container; ``blocks`` is a run of whole pairs (2i, 2i + 1), e.g. all 8 or the 4 of one 32-bit word (one
  ``prmt`` per register pair of the two blocks)."""
  return _fragments(words, blocks, per_prmt=2)


def block_operand(words, g: int):
  """The A operand Vᵀ[M block g] alone (f16 (64, 64), WGMMA layout): one ``prmt`` and one ``cvt`` per register."""
  return _fragments(words, (g,), per_prmt=1)[0]


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


def store_half_o(accs, o_ref, half: int):
  """Pallas-level :func:`store_half_rows`: multiplier ``half``'s ``accs`` (4 f32 (64, N) arrays, WGMMA layout,
  already normalised) to ``o_ref`` (GMEM [out_heads, 512])."""
  @plgpu.inline_mgpu(arg_types=(tuple(plgpu.Layout.WGMMA for _ in accs), plgpu.RefType()))
  def f(ctx, accs, o):
    del ctx
    store_half_rows(accs, o, half)
  f(tuple(accs), o_ref)


def load_v_half_words(k_tile_ref, half: int):
  """Pallas-level :func:`load_half_words` of the K tile ``k_tile_ref`` ([5, 64, 128] fp8, 128-byte swizzled)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(common.swizzled(common.FP8, ROW_BYTES)),),
                     return_type=plgpu.ShapeDtypeStruct((TILE, 2 * TILE), jnp.int32, layout=plgpu.Layout.WGMMA))
  def f(ctx, k_tile):
    del ctx
    return load_half_words(k_tile, half)
  return f(k_tile_ref)


def load_v_words(k_tile_ref):
  """Pallas-level :func:`load_words` of the K tile ``k_tile_ref`` ([5, 64, 128] fp8, 128-byte swizzled)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(common.swizzled(common.FP8, ROW_BYTES)),),
                     return_type=plgpu.ShapeDtypeStruct((TILE, 2 * TILE), jnp.int32, layout=plgpu.Layout.WGMMA))
  def f(ctx, k_tile):
    del ctx
    return load_words(k_tile)
  return f(k_tile_ref)


def _issue_pv(words, pt, accs, swizzle: int, blocks, p_rows: bool, pipelined: bool):
  """Inside an ``inline_mgpu`` body: issue (and commit) accs[i] += Vᵀ[M block blocks[i]] · Pᵀ, one wgmma group per
  block; returns the accumulators (the last group's wgmmas in flight). ``pipelined``: block i's A fragments are
  built only after ``wgmma.wait_group 1`` has retired block i - 2's group (:func:`pv_wgmmas`)."""
  if p_rows:      # tiled memref (N/8, 1, 8, 64) of P -> the transposed (1, N/8, 64, 8) view of Pᵀ
    pt = mgpu_utils.memref_transpose(pt, (1, 0, 3, 2))
  a_ops = None if pipelined else block_operands(words, blocks)
  out = []
  for i, (g, acc) in enumerate(zip(blocks, accs)):
    if pipelined and i >= 2:
      _wait(1)     # block i - 2 done: its A registers are free for block i's
    a = block_operand(words, g) if pipelined else a_ops[i]
    out.append(mgpu.wgmma(mgpu.WGMMAAccumulator.from_registers(acc), a, pt, swizzle=swizzle))
    _commit()
  return out


def _commit():
  llvm.inline_asm(ir.Type.parse("!llvm.void"), [], "wgmma.commit_group.sync.aligned;", "", has_side_effects=True)


def _wait(pending: int):
  llvm.inline_asm(ir.Type.parse("!llvm.void"), [], f"wgmma.wait_group.sync.aligned {pending};", "",
                  has_side_effects=True)


def _acc_types(accs):
  return tuple(plgpu.ShapeDtypeStruct(a.shape, jnp.float32, layout=plgpu.Layout.WGMMA) for a in accs)


def pv_wgmmas(words, pt_ref, accs, swizzle: int, blocks=ALL_BLOCKS, p_rows: bool = False, pipelined: bool = False):
  """accs[i] (f32 (64, N), WGMMA layout) += Vᵀ[M block blocks[i]] · Pᵀ, A from ``words`` in registers,
  B = ``pt_ref``: Pᵀ [64 keys, N] f16, swizzled ``swizzle`` = 2N bytes, or with ``p_rows`` P [N, 64 keys] (rows
  of heads, 128-byte swizzle), read transposed (K-major B); waited for. Returns the new accumulators.

  Default: the A fragments of all ``blocks`` are built (``prmt`` + ``cvt``, two blocks per ``prmt``) and then
  the wgmmas issued, one group per block; with many accumulator registers live ptxas keeps every block's A alive
  across the wgmmas (16 registers per block). ``pipelined``: block i's fragments are built (one ``prmt`` per
  register) while block i - 1's wgmmas run, after a ``wgmma.wait_group 1`` has retired block i - 2, so at most
  two blocks' A are live: the form for a warpgroup with fewer registers than its accumulators and all A
  fragments need ("producer_vt"'s multipliers at 200; docs/kernels/sparse_decode_sm90.md measures both forms).

  The register operand is read asynchronously by the tensor cores; ptxas keeps those registers alive until the
  wait at the end (one ``wgmma.wait_group 0``), and the results pass an optimization barrier after it so that
  LLVM cannot move their uses above the wait."""
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(common.swizzled(jnp.float16, swizzle)),
                                tuple(plgpu.Layout.WGMMA for _ in accs)),
                     return_type=_acc_types(accs))
  def f(ctx, words, pt, accs):
    del ctx
    out = _issue_pv(words, pt, accs, swizzle, blocks, p_rows, pipelined)
    _wait(0)
    return tuple(fa.optimization_barrier(a.value) for a in out)
  return f(words, pt_ref, tuple(accs))


# ---------------------------------------------------------------------------------------------------------------
# P·V in fp8 with P as the sum of two e4m3 terms (schedule "producer_vt8x2" of kernels/sparse_sm90_heads_m.py)
#
# P (f32, scaled by 2^P8_EXP_OFFSET so that it stays <= 256) becomes P_hi (P rounded to e4m3's 4 significant bits)
# and P_lo = e4m3(P - P_hi);
# P_hi + P_lo carries ~8 significant bits where the f16 P has 11 and one e4m3 term 4, and the products
# Vᵀ·P_hiᵀ + Vᵀ·P_loᵀ are fp8 wgmmas (m64nNk32: as many instructions as the f16 k16 form, the same tensor time)
# whose A operand is the fp8 tile's bytes as they are: per register one 4 x 4 byte transpose share (2 ``prmt``),
# no ``cvt``, 32 A registers for all four M blocks of a multiplier (the f16 form: 64). docs/kernels/
# sparse_decode_sm90.md ("producer_vt8x2") has the error model and the measurements.
#
# Key order. An fp8 A fragment register (c, h) holds K positions 16c + 4t + [0, 4); the words of
# :func:`load_half_words` hold keys 8 (i // 2) + 2t + i % 2 (the f16 fragment's). Position 16c + 4t + j of both
# operands is therefore key 16c + 8 (j // 2) + 2t + j % 2 (:func:`p8_position_of_key` inverts it): the A fragment
# takes words 4c .. 4c + 3, and the producer stores P's key pair (8 j' + 2t, 8 j' + 2t + 1), j' = 2c + e, at
# bytes 16c + 4t + 2e of the head's row (:func:`store_p8_pair_rows`), so every thread writes 4 consecutive bytes.

_PAIR_LO, _PAIR_HI = 0x5140, 0x7362     # prmt selectors: [x.0, y.0, x.1, y.1], [x.2, y.2, x.3, y.3]
_HALF_LO, _HALF_HI = 0x5410, 0x7632     # [x.0, x.1, y.0, y.1], [x.2, x.3, y.2, y.3]
P8_SWIZZLE = 64                          # one [heads, 64 keys] fp8 row: the K-major B operand's swizzle


def p8_position_of_key(key):
  """The byte (K position) of ``key`` (0-63) in a row of the fp8 P slots: key 16c + 8e + 2t + b sits at
  16c + 4t + 2e + b (numpy-friendly; for the tests)."""
  c, rest = key // 16, key % 16
  e, t, b = rest // 8, (rest % 8) // 2, rest % 2
  return 16 * c + 4 * t + 2 * e + b


def _prmt(a, b, sel: int):
  return _asm(ir.IntegerType.get_signless(32), [a, b], f"prmt.b32 $0, $1, $2, {sel:#x};", "=r,r,r")


def half_block_operands8(words):
  """The fp8 A operands Vᵀ[M block g] (g = 0-3, float8_e4m3fn (64, 64), ``WGMMA_LAYOUT_8BIT``) of a multiplier
  half from :func:`load_half_words`' container (word 0 of register (i, h): blocks 0-3 of key
  8 (i // 2) + 2t + i % 2). Register (c, h) of block g holds byte g of words 4c .. 4c + 3 (the key order of the
  module's fp8 section): one 4 x 4 byte transpose (8 ``prmt``) per (c, h) makes the registers of all four blocks."""
  f8 = ir.Float8E4M3FNType.get()
  v4f8 = ir.VectorType.get((4,), f8)
  v1i32 = ir.VectorType.get((1,), ir.IntegerType.get_signless(32))
  regs_shape = fa.WGMMA_LAYOUT_8BIT.registers_shape((TILE, TILE))
  out = [np.empty(regs_shape, dtype=object) for _ in range(HALF_BLOCKS)]
  wreg = words.registers
  for c in range(TILE // 16):
    for h in range(2):
      a = [vector.extract(wreg[0, 4 * c + j, 0, 0, h, 0, 0, 0, 0], [], [0]) for j in range(4)]
      lo01, hi01 = _prmt(a[0], a[1], _PAIR_LO), _prmt(a[0], a[1], _PAIR_HI)
      lo23, hi23 = _prmt(a[2], a[3], _PAIR_LO), _prmt(a[2], a[3], _PAIR_HI)
      blocks = (_prmt(lo01, lo23, _HALF_LO), _prmt(lo01, lo23, _HALF_HI),
                _prmt(hi01, hi23, _HALF_LO), _prmt(hi01, hi23, _HALF_HI))
      for g, val in enumerate(blocks):
        idx = [0] * len(regs_shape)
        idx[1], idx[4] = c, h
        out[g][tuple(idx)] = vector.bitcast(v4f8, vector.from_elements(v1i32, [val]))
  return [fa.FragmentedArray(_registers=regs, _layout=fa.WGMMA_LAYOUT_8BIT, _is_signed=None) for regs in out]


def pv_wgmmas8x2(words, p8_ref, accs):
  """A multiplier half's accs[g] (g = 0-3, f32 (64, N) WGMMA layout) += Vᵀ[g] · P_hiᵀ + Vᵀ[g] · P_loᵀ: A the fp8
  fragments of :func:`half_block_operands8` (all four blocks built first: 32 registers), B = ``p8_ref`` (SMEM
  [2, N, 64] float8_e4m3fn: P_hi, P_lo as rows of heads in the section's key order, 64-byte swizzle, read as
  the K-major B); 16 m64nNk32 wgmmas in one commit group per block, one ``wgmma.wait_group 0`` at the end.
  Returns the new accumulators."""
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(common.swizzled(common.FP8, P8_SWIZZLE)),
                                tuple(plgpu.Layout.WGMMA for _ in accs)),
                     return_type=_acc_types(accs))
  def f(ctx, words, p8, accs):
    del ctx
    a_ops = half_block_operands8(words)
    # tiled memref (2, N/8, 1, 8, 64) -> per term the transposed (1, N/8, 64, 8) view of Pᵀ
    terms = [mgpu_utils.memref_transpose(mgpu_utils.memref_slice(p8, i), (1, 0, 3, 2)) for i in range(2)]
    out = []
    for a, acc in zip(a_ops, accs):
      acc = mgpu.WGMMAAccumulator.from_registers(acc)
      for term in terms:
        acc = mgpu.wgmma(acc, a, term, swizzle=P8_SWIZZLE)
      _commit()
      out.append(acc)
    _wait(0)
    return tuple(fa.optimization_barrier(a.value) for a in out)
  return f(words, p8_ref, tuple(accs))


HI_ROUND, HI_MASK = 1 << 19, 0xFFF00000   # f32 bits: round half up to 4 significant bits (3 of 23 mantissa bits)


def _split8_pair(x_lo, x_hi):
  """Two f32 values (keys k, k + 1; in [0, 256]) -> (hi, lo) as two e4m3x2 half-words (key k in the low byte):
  hi = x rounded half up to e4m3's 4 significant bits by integer operations on its f32 bits (exact in e4m3 for
  x >= 2^-6), lo = e4m3(x - hi) (the difference is exact in f32). Two conversions per pair (the f16 P of
  "producer_vt" takes one): conversions may share a quarter-rate pipe with the producer's ex2 (a reading of the
  thirtieth session's timelines, RESULTS.md; ``benchmarks/convert_rate_gpu.py`` measures it), so the split uses
  integer and f32 operations wherever it can."""
  i16 = ir.IntegerType.get_signless(16)
  res = _asm(llvm.StructType.get_literal([i16, i16]), [x_lo, x_hi],
             "{\n.reg .b32 ua, ub;\n.reg .f32 ha, hb, ra, rb;\n"
             "mov.b32 ua, $2;\nmov.b32 ub, $3;\n"
             f"add.u32 ua, ua, {HI_ROUND:#x};\nadd.u32 ub, ub, {HI_ROUND:#x};\n"
             f"and.b32 ua, ua, {HI_MASK:#x};\nand.b32 ub, ub, {HI_MASK:#x};\n"
             "mov.b32 ha, ua;\nmov.b32 hb, ub;\n"
             "sub.f32 ra, $2, ha;\nsub.f32 rb, $3, hb;\n"
             "cvt.rn.satfinite.e4m3x2.f32 $0, hb, ha;\n"
             "cvt.rn.satfinite.e4m3x2.f32 $1, rb, ra;\n}",
             "=h,=h,f,f")
  return llvm.extractvalue(i16, res, [0]), llvm.extractvalue(i16, res, [1])


def store_p8_pair_rows(p, p8):
  """The producer's store of P (f32 (64, 64) WGMMA layout, rows = heads, values in [0, 256]) as P_hi and P_lo
  into ``p8`` (SMEM memref [2, 64, 64] float8_e4m3fn, tiled, 64-byte swizzle) in the section's key order: per
  thread and (c, h) one ``st.shared.b32`` per term of the 4 bytes 16c + 4t + [0, 4) of row 16w + 8h + q (key
  pairs j' = 2c and 2c + 1). 16 stores per thread; a warp's store covers 16 bytes of each of 8 rows, which the
  swizzle puts on distinct banks. The caller fences (``mgpu.commit_shared``)."""
  i32 = ir.IntegerType.get_signless(32)
  w, q, t = _thread()
  base = llvm.ptrtoint(i32, mgpu_utils.memref_ptr(p8))
  term_bytes = TILE * TILE
  for h in range(2):
    row = arith.addi(arith.muli(w, _i32(16)), arith.addi(q, _i32(8 * h)))
    row_addr = arith.addi(base, arith.addi(arith.muli(row, _i32(TILE)), arith.muli(t, _i32(4))))
    for c in range(TILE // 16):
      halves = []
      for e in range(2):
        pair = p.registers[0, 2 * c + e, 0, 0, h, 0, 0, 0, 0]
        halves.append(_split8_pair(vector.extract(pair, [], [0]), vector.extract(pair, [], [1])))
      for term in range(2):
        lo16, hi16 = (arith.extui(i32, halves[e][term]) for e in range(2))
        word = arith.ori(lo16, arith.shli(hi16, _i32(16)))
        addr = _swizzle(arith.addi(row_addr, _i32(term * term_bytes + 16 * c)), P8_SWIZZLE)
        _asm(ir.Type.parse("!llvm.void"), [addr, word], "st.shared.b32 [$0], $1;", "r,r", side_effects=True)


def store_p8(p, p8_ref):
  """Pallas-level :func:`store_p8_pair_rows` of ``p`` (f32 (64, 64), WGMMA layout) into ``p8_ref`` (SMEM
  [2, 64, 64] float8_e4m3fn, 64-byte swizzle), fenced for the async proxy (``mgpu.commit_shared``: the fence and
  one warpgroup barrier)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.RefType(common.swizzled(common.FP8, P8_SWIZZLE))))
  def f(ctx, p, p8):
    del ctx
    store_p8_pair_rows(p, p8)
    mgpu.commit_shared()
  f(p, p8_ref)


def split8_value(p):
  """The value P_hi + P_lo that :func:`store_p8_pair_rows` stores for ``p`` (a jax or numpy float array of values
  in [0, 256]), as f32, computed as :func:`_split8_pair` does: hi32 = p rounded half up to 4 significant bits
  (f32 bit operations), hi = e4m3(hi32) (equal to it for p >= 2^-6), lo = e4m3(p - hi32). |error| <= 2^-8 p
  (lo's rounding) + 2^-9 (e4m3's subnormal steps below 2^-6). For the tests and for interpret mode, whose f16 P
  slot holds this value exactly (at most 8 significant bits within f16's range)."""
  x = jnp.asarray(p, jnp.float32)
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  hi32 = lax.bitcast_convert_type((bits + jnp.uint32(HI_ROUND)) & jnp.uint32(HI_MASK), jnp.float32)
  hi = hi32.astype(common.FP8).astype(jnp.float32)
  lo = (x - hi32).astype(common.FP8).astype(jnp.float32)
  return hi + lo
