"""Native-FP8 sparse MLA decode for Hopper (sm_90a), heads on the MMAs' M side (the op's design for H > 16).

What one CTA computes
---------------------
One *query tile* of 64 rows (the heads of one query token; H < 64 is zero-padded to 64 rows, H = 128 is two
tiles) against ``tiles_per_split`` tiles of 64 gathered KV rows (one split of the token's top-k):

    S    = Q8 · K8ᵀ                       fp8 wgmma, f32 accumulate, K = 640 (five chunks of 128, see below)
    s    = S · row_scale                  row_scale = q_scale(row) · kv_scale · softmax_scale · log2(e)
    s    = −inf where the key is invalid (index < 0 or ≥ num_slots)
    online softmax in base 2 (m, l per row)
    O   += f16(p) · f16(V8)               f16 wgmma, f32 accumulate; P in registers, V upcast exactly
    out  = O · kv_scale / l,  lse = (m + log2 l) · ln 2

Shapes, dtypes, index conventions (kernel arguments, prepared by ``mla_pallas.ops.sparse_decode``)
--------------------------------------------------------------------------------------------------
    q    [num_tokens · H, 576] bf16 or f32 (or, with ``q_split``, latent [.., 512] and rope [.., 64] as two
         inputs): the query rows, quantized in the kernel (section "Q in the kernel"); query tile q holds heads
         64 (q % tiles_per_token) ... of token q // tiles_per_token (rows past H: zeros).
    (bf16 cache only: q [num_q_tiles, 64, 576] bf16 as tiles and qs [num_q_tiles, 64] f32, see "BF16 cache".)
    kv   [num_slots, 576] fp8: the cache (latent 512 | rope 64; V = the first 512).
    idx  [num_tokens, num_splits · tiles_per_split, 64] int32 row ids; any id outside [0, num_slots) is an invalid
         key: gathered as row num_slots (wholly past the end, so the TMA zero-fills it) and masked to −inf.
    scal [1] f32: kv_scale (multiplies the output).
    Returns o [num_q_tiles, num_splits, 64, 512] out_dtype and lse [num_q_tiles, num_splits, 64] f32 (natural
    log), each split normalised by its own softmax sum (the op merges splits by lse).

Warpgroup roles of "twin" (3 warpgroups, Lane semantics; "producer_vt": see Schedules)
--------------------------------------------------------------------------------------
* WG2 — loader (56 registers): TMA of the split's indices (and of Q over a bf16 cache), then per 64-key tile,
  once the consumers have released K buffer ``t % k_buffers`` (``k_empty``), the gather of its 64 rows straight
  into the 128-byte-swizzled K tiles by the warpgroup's 128 threads, 20 16-byte ``cp.async`` each
  (``common.gather_tiles``, ``kernels/gather_threads.py``), published on ``k_full`` once landed.
* WG0, WG1 — consumers (224 registers each). Per tile: issue the five QKᵀ fp8 wgmmas (K chunks of 128; Q's tail
  chunk holds zeros against latent 448-511, so those columns count once); meanwhile stage their half of V (two
  128-column chunks) as an exact e4m3 → f16 upcast (16-bit wgmma takes an MN-major B, so no transpose). Read S,
  release the K buffer; online softmax; P·V for their 256 output columns (64 × 256 f32 accumulator = 128
  registers per thread) with P as an f16 register operand. S is computed by both consumers (no cross-warpgroup
  exchange of S or P). WG0 writes lse.

Schedules (``TuningConfig.schedule``; the op picks one by split length, ``ops.sparse_decode._heads_m_tuning``)
--------------------------------------------------------------------------------------------------------------
* "twin": as above, both consumers compute the same S and run the same softmax; nothing crosses between them.
  Over an fp8 cache the op's choice only for the 1-4-tile splits of small batches; slower than "producer_vt" at
  8-128-tile splits. The schedule of the bf16 cache.
* "producer_vt" (4 warpgroups; the op's choice over an fp8 cache): WG0 — the *producer* (88 registers) — alone
  computes S (one QKᵀ per tile: 18 fp8 m64n64k32 wgmmas, ``_qk_fp8_18``, the two k32 steps over Q's zero columns
  not issued), releases the K buffer, runs the online softmax and writes P (f16 [64, 64], 128-byte swizzled) and
  alpha into slot t % 2 of ``p_sw`` / ``head_smem`` (``p_full``; it runs up to two tiles ahead); after the last
  tile it publishes kv_scale / l (``p_full[2]``) and writes the lse. WG1 and WG2 — the *multipliers* (200
  registers; one code path, their half traced) — first quantize 24 rows of Q each, the producer 16 (section
  "Q in the kernel"), then each hold half of the transposed output, Oᵀ [512, 64 heads] = Vᵀ·Pᵀ: Vᵀ is the
  register A operand built from the fp8 K tile (``kernels/vt_registers.py``: one 64-bit SMEM load per key,
  ``prmt``, exact e4m3x2 → f16x2), Pᵀ the K-major view of P's slot; 4 Oᵀ blocks of 64 latent rows each
  (``vt_registers.latent_of_half_row``: thread (w, q) holds latent columns 256 half + 64w + 8q + [0, 8) in its
  rows of the 4 blocks; 4 × 32 f32 registers).
  The producer's softmax rescales lazily (``RESCALE_THRESHOLD``: a row's max moves only when it grows by more than
  2^8, so P <= 256 and alpha is 1 in most tiles), folds the row scale into exp2's argument (one fma per logit),
  uses approximate exp2 / log2 (``approx_math``: the kernel's only ones are the producer's) and stores P
  (stmatrix) and alpha in raw Mosaic GPU with one warpgroup barrier (``_store_p_alpha``). Per tile a multiplier
  loads its Vᵀ bytes, releases the K buffer, waits for the slot, rescales by alpha unless every alpha is 1
  (the producer's per-warp rescale flags, ``_all_alpha_one``), makes the byte pairs of its four blocks (32
  ``prmt``, ``vt_registers.paired_words``), issues its 16 m64n64k16 wgmmas one block at a time, each block
  converted under the previous one's wgmmas (``pv_wgmmas(pipelined=True)``: at most two blocks' A fragments
  live; with all four built first ptxas serialized the wgmmas even at 200 registers) and releases the slot
  (``p_empty``, two arrivals); at the end it stores its half of O in 16-byte (bf16) row pieces. WG3 loads. No
  f16 V tile and no upcast pass (k_buffers up to 3). Raw Mosaic GPU code: interpret mode runs the same hand-off
  with an f16 V tile instead (``_multiplier_interpret``: each multiplier upcasts its two V chunks and multiplies P
  from the slot; README: interpret-only code paths).
  Interpret mode runs one CPU thread per warpgroup, each blocking in barrier waits inside XLA's CPU thread
  pool: with fewer pool threads than warpgroups (2 on a 2-CPU machine) the run can deadlock; set
  ``PJRT_NPROC`` to 8 or more before JAX starts (tests/conftest.py does).

BF16 cache (``TuningConfig.cache_dtype="bfloat16"``; both schedules)
---------------------------------------------------------------------
BF16 attention over a bfloat16 cache ([num_slots, 576] bf16, 1152 bytes per row): q stays bf16 ([num_q_tiles, 64,
576], Q as nine 64-column chunks, 128-byte swizzled, TMA'd by the loader; ``qs`` = softmax_scale · kv_scale ·
log2 e for every row), the loader gathers each row's nine 128-byte chunks (``common.BF16_TILES``: 36 16-byte
``cp.async`` per thread and tile), S = Q·Kᵀ is nine bf16 wgmmas (K = 64 each), P is rounded to bf16, and V is the
K tile itself (a 16-bit wgmma takes the MN-major B, so there is no V copy).

* "twin": each consumer multiplies P (registers) with its four 64-column latent chunks (4 wgmmas of N = 64 into
  four [64, 64] f32 accumulators) and releases the K buffer after its P·V. SMEM: Q 73 728 + K 2 × 73 728 + indices
  (at most 16 tiles: 4 096) + lse, barriers, reduction scratch = 228 864 bytes.
* "producer_vt" (the same four roles as over fp8; no Vᵀ here, the name is the fp8 form's): the producer's QKᵀ is
  the nine bf16 wgmmas, and it writes P (bf16) into the rope chunk of the tile's own K buffer (``BF16_P_CHUNK``:
  after its QKᵀ only P lives there; FlashMLA's sparse prefill overlaps a P buffer with the rope part the same way),
  so the kernel has no P slots; alpha and the rescale flags go to ``head_smem`` slot t % 2 as over fp8. Each
  multiplier holds O [64 heads, 256 columns] (heads on its rows, 128 f32 registers) and per tile, after the
  slot's arrival, rescales it unless every alpha is 1 and adds P · V[:, 256 half ...] as one m64n64k16 × 4 group per
  64-column chunk (``_pv_bf16``: P from the rope chunk as A, V chunk 4 half + g as B), then releases the K buffer
  and the slot (``k_buffers`` <= 2: the P and alpha slots follow the buffers). SMEM: Q 73 728 + K 2 × 73 728 +
  indices + lse, alpha / 1/l / flag rows, barriers, and no Mosaic reduction scratch (``reduction_scratch``: every
  reduction here is within warps) = 227 840 bytes with 16-tile splits, 231 936 with 32 (the lowered kernel's own
  count: 231 512), so a top-k of 2048 runs as one split.

Seesaw (``schedule="seesaw"``, a bfloat16 cache only, k_buffers = 2; a sweep candidate until measured)
-------------------------------------------------------------------------------------------------------------
"twin"'s three warpgroups and O split (each consumer four [64, 64] f32 accumulators of its 256 columns), with
each tile's S computed once: consumer w owns tiles t ≡ w (mod 2), i.e. K buffer w. Per own tile it runs the
nine bf16 QKᵀ wgmmas, waits for the other consumer's tile t − 1 (``p_full[1 − w]``: its alpha, running max m and
sum l in ``head_smem``, :func:`_seesaw_rows`), runs the online softmax of tile t from that (m, l), writes P (bf16,
stmatrix) into the rope chunk of K buffer w (after the QKᵀ only P needs it, as in "producer_vt") and its alpha, m,
l, and arrives on ``p_full[w]``; then O takes tile t − 1 (rescaled by its alpha; P and V from K buffer 1 − w) and
tile t, and the consumer releases both buffers (``k_empty``, two arrivals each). The softmaxes alternate between
the consumers and each one's QKᵀ of tile t runs under the other's softmax of tile t − 1: the chain per tile is
one softmax and the hand-off, where "producer_vt"'s producer runs QKᵀ and softmax in series (FlashMLA's BF16
dense decode schedules its two warpgroups this way, its "seesaw"). Consumer 0's first tile is peeled (no tile
before it); the other's last tile, where it comes after a consumer's last own tile, is taken after the loop.
Each consumer's code is its own copy (which tiles it owns is static). SMEM: "twin"'s without the interpret-mode
P slots and without its lse buffer and reduction scratch (every reduction is within warps, as in "producer_vt"
over bf16), + (alpha, m, l) per K buffer and the lse staging row (1 792 bytes, 2 048 aligned) = 227 840 with
16-tile splits and 231 936 with 32 (one split at F1's and P1's top-k of 2048).

Q in the kernel (both schedules over an fp8 cache: ``TuningConfig.q_in_kernel``)
-------------------------------------------------------------------------------
The kernel takes the op's q ([num_tokens · H, 576] bf16 or f32, or with ``q_split`` its latent [.., 512] and rope
[.., 64] parts as two inputs; no ``qs``), not a pre-pass's tiles: "twin"'s two consumers (WG0 rows 0-31, WG1
32-63), or "producer_vt"'s producer (rows 0-15, ``PRODUCER_Q_ROWS``) and multipliers (which would otherwise wait
for the first P; rows 16-39 and 40-63) quantize the tile's 64 rows (rows past H are zeros) straight from GMEM
into ``q_sw`` and their max |q| into a [64] f32 SMEM row (raw PTX, ``q_quant.quantize_head_rows``: the
pre-pass's bytes), fence and arrive on ``q_bar`` (one arrival per quantizing warpgroup); the softmax warpgroups
wait for it and take the row scales as ``q_quant.row_scales(amax)``. The loader
then TMAs only the indices. SMEM: + the amax row ("twin": 1 024; "producer_vt": a fourth ``head_smem`` row, within
the 1 KB rounding). Only the bf16 cache takes the op's Q tiles (``q``, ``qs``) by TMA.

Measured alternatives and why they went: docs/kernels/sparse_decode_sm90.md.

The "producer_vt" producer and multipliers also run the dense kernel (``kernels/dense_sm90.py``): they take the
CTA's tiles as ``common.KeyTiles`` (a tile count, possibly traced, and the producer's ranges with or without a key
mask; here ``common.id_key_tiles``: every tile of the split, masked by its ids).

Pipeline stages: gather of tile t + 1 (k_buffers = 2) ∥ (QKᵀ of tile t ∥ V upcast of tile t) → softmax → P·V.
Interpret mode has no wgmma with a register A operand: there P goes through an SMEM tile [2, 64, 64] f16.
Lane semantics: see ../shared/mgpu/README.md section 6.

SMEM budget (bytes, k_buffers = 2, tiles_per_split = 32; :meth:`TuningConfig.smem_budget`, 1 KB rounding)
-----------------------------------------------------------------------------------------------------------
    Q (fp8, swizzled, 5 × 64 × 128)                       40 960
    K (k_buffers × 5 × 64 × 128 fp8, swizzled)            81 920
    V f16 (64 × 512)                                      65 536
    indices (tiles_per_split × 64 int32)                   8 192
    lse staging                                            1 024
    barriers                                                 512
    Mosaic reduction scratch                               2 048
    total                                                200 192   (limit 232 448: one CTA per SM)
    "twin" over fp8 (Q in the kernel): + the amax row 1 024 = 201 216
    "producer_vt": − V f16 65 536 + P slots (2 × 64 × 64 f16) 16 384 + alpha / 1/l / amax / rescale-flag rows
    1 280 (2 048 rounded) = 153 088; with k_buffers = 3: 194 048; 128-tile splits: + 24 576 of indices
    bf16 cache ("twin", 16-tile splits): Q 73 728 + K 2 × 73 728, no V tile, indices 4 096 = 228 864;
    "producer_vt": no P slots (P in the K buffer), + alpha / 1/l / flag rows 1 024, no reduction scratch
    − 2 048 = 227 840; 32-tile splits + 4 096 = 231 936
Registers ("twin", 384 threads): 224 per consumer thread (O 128, S 32, P, softmax state), 56 for the loader:
setmaxnreg moves registers within the CTA's launch allocation (168 per thread x 384 = 64 512), so 2 · 224 + 56 is
the most (a 64-register loader deadlocked the consumers' increase on the H200). "producer_vt" (512 threads, 128 per
thread at launch): loader 24, producer 88, multipliers 200 each (``PRODUCER_REGS``).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
from typing import ClassVar

import jax
from jax import lax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, vector
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental.mosaic.gpu import mma_utils, utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common, q_quant, raw_mgpu, vt_registers
from mla_pallas.kernels.common import CONSUMER_REGS, D_V, LOADER_REGS, TILE, swizzled

mgpu_wgmma = importlib.import_module("jax.experimental.mosaic.gpu.wgmma")   # the module (the package exports a function)

LOADER = 2   # "twin": warpgroup index of the loader; consumers are 0 and 1 ("producer_vt": 3; multipliers 1, 2)
# "producer_vt": loader, producer, each multiplier (24 + 88 + 2 · 200 = 4 · 128). With all four blocks' A fragments
# built before the P·V wgmmas, ptxas 13.0 serialized them at 184 (C7511) and at 200 (C7512); built one block at a
# time (pv_wgmmas(pipelined=True)) the kernel at 200 ran 11 % faster (docs/kernels/sparse_decode_sm90.md). The
# loader needs no more than 24, the producer spills below 88.
PRODUCER_REGS = (24, 88, 200)


# "producer_vt": lazy rescaling (common.online_softmax_tile): a row's running max moves only when the tile's max
# exceeds it by more than this (base-2 logits), so P <= 2^8 (f16 holds it with the same 11-bit precision) and most
# tiles leave every alpha at 1, where the multipliers skip the rescale of their 128 accumulator registers.
RESCALE_THRESHOLD = 8.0
P_BUFFERS = 2        # P / alpha slots of the hand-off
INV_SLOT = P_BUFFERS  # head_smem row of kv_scale / l (after the alpha rows)


@dataclasses.dataclass(frozen=True)
class TuningConfig(common.SparseSm90Config):
  """Config of the heads-on-M design: ``tiles_per_split``, ``k_buffers`` (1-3, within the SMEM budget: a third K
  tile fits only without the f16 V tile) and ``schedule`` (module docstring, "Schedules"): "twin" — both
  consumers compute the same S and run the same softmax; "producer_vt" — warpgroup 0 alone does and hands P (f16)
  and alpha to two multiplying warpgroups through SMEM, with O transposed (Oᵀ = Vᵀ·Pᵀ) and Vᵀ a register
  operand read from the fp8 K tile (``kernels/vt_registers.py``), so there is no f16 V tile; over a bf16 cache P
  (bf16) goes into the K buffer's rope chunk and the multipliers compute O = P·V from SMEM (module docstring,
  "BF16 cache"). ``tiles_per_split`` up to 128 (32 KB of indices) fits both schedules over fp8; over bf16 16
  ("twin") or 32 ("producer_vt": no P slots, no reduction scratch).
  Over an fp8 cache both quantize Q in the kernel (:attr:`q_in_kernel`)."""
  K_BUFFERS: ClassVar[tuple[int, ...]] = (1, 2, 3)
  SCHEDULES: ClassVar[tuple[str, ...]] = ("twin", "producer_vt", "seesaw")
  CACHE_DTYPES: ClassVar[tuple[str, ...]] = ("float8_e4m3fn", "bfloat16")
  k_buffers: int = 2
  schedule: str = "twin"
  cache_dtype: str = "float8_e4m3fn"   # the cache the kernel reads (module docstring, "BF16 cache")

  def validate(self):
    if self.schedule not in self.SCHEDULES:
      raise ValueError(f"TuningConfig.schedule must be one of {self.SCHEDULES}; got {self.schedule!r}")
    if self.cache_dtype not in self.CACHE_DTYPES:
      raise ValueError(f"TuningConfig.cache_dtype must be one of {self.CACHE_DTYPES}; got {self.cache_dtype!r}")
    if self.seesaw and (not self.bf16 or self.k_buffers != 2):
      raise ValueError(f"TuningConfig: \"seesaw\" runs over a bfloat16 cache with k_buffers = 2 (tile t's owner is "
                       f"consumer t % 2 and its P goes into K buffer t % 2); got {self}")
    if self.bf16 and self.producer and self.k_buffers > P_BUFFERS:
      raise ValueError(f"TuningConfig: over a bfloat16 cache \"producer_vt\" keeps P in the K buffers' rope chunk "
                       f"and alpha in {P_BUFFERS} slots, so k_buffers <= {P_BUFFERS}; got {self}")
    super().validate()

  @property
  def bf16(self) -> bool:
    """BF16 attention over a bfloat16 cache (no Q quantization, bf16 wgmmas, V read from the K tile)."""
    return self.cache_dtype == "bfloat16"

  @property
  def q_in_kernel(self) -> bool:
    """Over an fp8 cache (both schedules): two warpgroups ("twin": the consumers; "producer_vt": the multipliers)
    quantize the tile's q rows themselves, 32 each (``q_quant.quantize_head_rows``, the bytes of the XLA
    pre-pass), and the kernel takes q as it is; a bf16 cache's kernel takes the op's Q tiles through the
    loader's TMAs (module docstring, "Q in the kernel")."""
    return not self.bf16

  @property
  def layout(self) -> common.TileLayout:
    return common.tile_layout(self.cache_dtype)

  @property
  def producer(self) -> bool:
    """"producer_vt": WG0 only computes S, the softmax and P and hands P and alpha to WG1 and WG2, which only
    multiply (module docstring)."""
    return self.schedule == "producer_vt"

  @property
  def seesaw(self) -> bool:
    """"seesaw" (bf16 cache): consumer t % 2 alone computes tile t's S and softmax and hands P, alpha and the
    running (m, l) to the other through SMEM; both multiply every tile into their half of O (module docstring,
    "Seesaw")."""
    return self.schedule == "seesaw"

  @property
  def loader(self) -> int:
    """The loader's warpgroup index (the last one)."""
    return LOADER + 1 if self.producer else LOADER

  @property
  def head_rows(self) -> int:
    """"producer_vt": rows of ``head_smem`` [rows, 64] f32: the alpha slots, kv_scale / l, with Q in the kernel
    the rows' max |q|, and last the rescale flags (:func:`_flags`). "seesaw": (alpha, m, l) per K buffer
    (:func:`_seesaw_rows`) and the lse staging row."""
    if self.seesaw:     # + the lse staging row (the kernel's own [64] lse buffer would cost another 1 KB)
      return 3 * self.k_buffers + 1
    return INV_SLOT + (3 if self.q_in_kernel else 2)

  @property
  def p_dtype(self):
    """P's dtype in the P·V wgmmas: f16 over an fp8 cache (V upcast exactly), bf16 over a bf16 cache (V's own)."""
    return jnp.bfloat16 if self.bf16 else jnp.float16

  def p_slots(self, interpret: bool = False) -> bool:
    """Whether the kernel has the P SMEM slots ``p_sw``: "producer_vt" over an fp8 cache (the hand-off), "twin" in
    interpret mode (no register A operand there). "producer_vt" over a bf16 cache writes P into the rope chunk of
    the tile's own K buffer instead (:func:`_p_slot`)."""
    return (self.producer and not self.bf16) or (interpret and not self.producer and not self.seesaw)

  def v_tile(self, interpret: bool = False) -> bool:
    """The f16 V tile exists unless "producer_vt" reads Vᵀ into registers (interpret mode always upcasts) or the
    cache is bf16 (V is the K tile itself)."""
    return (not self.producer or interpret) and not self.bf16

  @property
  def reduction_scratch(self) -> int:
    """Bytes of Mosaic's cross-warp reduction scratch (``CompilerParams.reduction_scratch_bytes``): its default,
    2048, except "producer_vt" over a bf16 cache, which reduces only within warps (over the keys of a row and
    the producer's column residues) and needs the room for 32-tile splits' indices beside Q and two bf16 K
    tiles (a reduction that needed the scratch would fail to lower)."""
    return 0 if self.bf16 and (self.producer or self.seesaw) else 2048

  def smem_budget(self) -> int:
    lay = self.layout
    v_tile = (((TILE, D_V), jnp.float16),) if self.v_tile() else ()
    p_slots = (((P_BUFFERS, TILE, TILE), jnp.float16),) if self.p_slots() else ()
    slots = p_slots + (((self.head_rows, TILE), jnp.float32),) \
        if self.producer or self.seesaw else ((((TILE,), jnp.float32),) if self.q_in_kernel else ())   # or amax
    return common.smem_bytes(
        ((lay.chunks, TILE, lay.chunk_cols), lay.dtype),        # Q (fp8: latent | 0 | rope)
        ((self.k_buffers, lay.chunks, TILE, lay.chunk_cols), lay.dtype),   # K, gathered into the swizzled layout
        *v_tile,                                                # V f16
        ((self.tiles_per_split, TILE), jnp.int32),              # indices
        *((((TILE,), jnp.float32),) if not self.seesaw else ()),   # lse staging ("seesaw": a head_smem row)
        *slots,                                                 # P slots, alpha / (kv_scale / l) rows
    ) + 64 * 8 + self.reduction_scratch   # barriers; Mosaic reduction scratch


def _loader(cfg: TuningConfig, num_slots: int, interpret: bool, tile_q, split, token, r: common.SparseRefs):
  """WG2 (WG3 in "producer_vt"): Q's chunks (bf16 cache only; over fp8 the kernel quantizes Q) and the split's
  indices, then the gathers of every tile (``common.gather_tiles``)."""
  plgpu.set_max_registers(PRODUCER_REGS[0] if cfg.producer else LOADER_REGS, action="decrease")
  lay = cfg.layout
  if not cfg.q_in_kernel:
    load_q_tile(tile_q, r, lay)
  n_tiles = cfg.tiles_per_split
  plgpu.copy_gmem_to_smem(r.idx_gmem.at[token, pl.ds(split * n_tiles, n_tiles)], r.idx_smem, r.idx_bar)
  plgpu.barrier_wait(r.idx_bar)
  common.gather_tiles(r.kv_gmem, r.k_sw, r.idx_smem, r.k_full, r.k_empty, num_slots=num_slots,
                      n_tiles=n_tiles, k_buffers=cfg.k_buffers, interpret=interpret, layout=lay)


def load_q_tile(tile_q, r: common.SparseRefs, lay: common.TileLayout):
  """The loader's TMAs of query tile ``tile_q``'s chunks (``q_gmem`` [num_q_tiles, 64, 576] bf16, a bf16 cache's
  kernels) into ``q_sw``, one arrival each on ``q_bar``."""
  for c in range(lay.chunks):
    plgpu.copy_gmem_to_smem(r.q_gmem.at[tile_q, :, pl.ds(c * lay.chunk_cols, lay.chunk_cols)], r.q_sw.at[c],
                            r.q_bar)


ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)   # [64]: one value per head row
COL_LAYOUT = plgpu.Layout.WGMMA.reduce(0)   # [64]: one value per key


def _qk_and_upcast(k_tiles, stage_v, r: common.SparseRefs):
  """S = Q·Kᵀ of one tile (one wgmma per chunk: five fp8 of K = 128, or nine bf16 of K = 64); ``stage_v()`` (the
  f16 upcast of V chunks, or None) is issued under the asynchronous wgmmas and committed. Returns S [64, 64] f32
  (WGMMA layout)."""
  def qk(acc_ref):
    for c in range(r.q_sw.shape[0]):
      plgpu.wgmma(acc_ref, r.q_sw.at[c], k_tiles.at[c].T)
    if stage_v is not None:
      stage_v()
      plgpu.commit_smem()
    return acc_ref[...]
  return pl.run_scoped(qk, plgpu.ACC((TILE, TILE), jnp.float32))


def _qk_producer(cfg: TuningConfig, k_tiles, r: common.SparseRefs, interpret: bool):
  """The producer's S = Q·Kᵀ of one tile, waited for: over an fp8 cache :func:`_qk_fp8_18` on hardware and in
  interpret mode (no ``inline_mgpu`` there) :func:`_qk_and_upcast`'s five wgmmas (the same S); over a bf16 cache
  :func:`_qk_and_upcast`'s nine bf16 wgmmas."""
  if interpret or cfg.bf16:
    return _qk_and_upcast(k_tiles, None, r)
  return _qk_fp8_18(r.q_sw, k_tiles)


QK_STEPS = 4 * common.SW_CHUNKS - 2   # k32 steps of the producer's QKᵀ: all but the two over Q's zero columns


def _qk_fp8_18(q_sw, k_tiles):
  """S = Q·Kᵀ [64, 64] f32 (WGMMA layout) from the fp8 Q tile ``q_sw`` and K tile ``k_tiles`` ([5, 64, 128] fp8
  each, 128-byte swizzled) with 18 m64n64k32 wgmmas instead of 20: in the fifth chunk Q holds 64 zero columns
  against cache columns 448-511 (which chunk 3 already multiplies) and then the rope, so its first two k32 steps
  add exact zeros and are not issued (S is bit for bit the five-chunk product's). The wgmmas are issued from one
  pair of descriptors, chunk 0's (``mma_utils.create_descriptor``): chunk c's are those plus c · 8192 bytes, a
  k32 step 32 more (the descriptors' address fields count 16-byte units), so each wgmma costs one 64-bit add per
  operand instead of a descriptor built from its chunk's address (``mgpu.wgmma`` per chunk: ~80 uniform-datapath
  instructions per tile). ``wgmma.wgmma_m64`` issues the steps (its ``swizzle`` argument sets how many: 128 bytes
  = 4, 64 = 2; the descriptors keep the tiles' 128-byte swizzle). One commit group, waited for before
  returning."""
  sw = plgpu.RefType(swizzled(common.FP8, common.SW_CHUNK))

  @plgpu.inline_mgpu(arg_types=(sw, sw), return_type=plgpu.ShapeDtypeStruct((TILE, TILE), jnp.float32,
                                                                               layout=plgpu.Layout.WGMMA))
  def qk(ctx, q8, k8):
    del ctx
    acc = mgpu.WGMMAAccumulator.zero(TILE, TILE)
    a = mgpu_utils.memref_slice(q8, 0)
    b = mgpu_utils.memref_transpose(mgpu_utils.memref_slice(k8, 0), (1, 0, 3, 2))
    (a_desc, a_k), _, a_fast = mma_utils.create_descriptor(a, swizzle=common.SW_CHUNK, large_tile=(TILE, 128),
                                                           group_size=(TILE, 128), logical_k_major=False)
    (b_desc, b_k), _, b_fast = mma_utils.create_descriptor(b, swizzle=common.SW_CHUNK, large_tile=(128, 128),
                                                           group_size=(128, TILE), logical_k_major=True)
    a_k, b_k = a_k[1][0], b_k[1][0]
    i64 = ir.IntegerType.get_signless(64)

    def at(desc, nbytes):   # the descriptor nbytes further on (address field in 16-byte units)
      if not nbytes:
        return desc
      return llvm.add(desc, llvm.ConstantOp(i64, ir.IntegerAttr.get(i64, nbytes >> 4)),
                      overflow_flags=llvm.IntegerOverflowFlags.none)
    f8 = ir.Float8E4M3FNType.get()
    regs = acc._value.registers.copy()     # in the accumulator's own (32-bit ACC) layout, as mgpu.wgmma keeps it
    chunk_bytes = TILE * common.SW_CHUNK
    last = common.SW_CHUNKS - 1
    for c in range(common.SW_CHUNKS):
      skip = 2 if c == last else 0      # the fifth chunk: only its last two k32 steps
      regs[0:1] = mgpu_wgmma.wgmma_m64(
          regs[0:1], at(a_desc, c * chunk_bytes + skip * a_k), at(b_desc, c * chunk_bytes + skip * b_k),
          a_transpose=a_fast != mma_utils.Dim.K, b_transpose=b_fast != mma_utils.Dim.K, a_k_stride=a_k,
          b_k_stride=b_k, n=TILE, swizzle=64 if c == last else common.SW_CHUNK, a_element_type=f8,
          b_element_type=f8)
    raw_mgpu.wgmma_commit()
    raw_mgpu.wgmma_wait(0)
    return fa.optimization_barrier(raw_mgpu.with_registers(acc, regs).value)
  return qk(q_sw, k_tiles)


def _upcast_half(k_tiles, wg, r: common.SparseRefs):
  """Consumer ``wg`` stages the f16 V columns it multiplies: chunks 2 wg, 2 wg + 1 (``wg`` traced)."""
  for w in range(2):
    @pl.when(wg == w)
    def _():
      common.stage_v16(k_tiles, r.v16, chunks=range(2 * w, 2 * w + 2))


def _pv_half(acc, p_op, wg, interpret: bool, r: common.SparseRefs):
  """acc [64, 256] f32 += P · V[:, 256 wg : 256 wg + 256] (f16 wgmma; P in registers or an SMEM ref)."""
  v_op = r.v16.at[:, pl.ds(wg * 256, 256)]

  def pv(acc_refs):
    plgpu.wgmma(acc_refs[0], p_op, v_op)
  (acc,) = common.accumulate(pv, (acc,), interpret)
  return acc


def _store_half(acc, inv, wg, out_dtype, tile_q, split, r: common.SparseRefs):
  """O columns 256 wg ... 256 wg + 255 = acc [64, 256] scaled by ``inv`` per row."""
  out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
  r.o_gmem.at[tile_q, split, :, pl.ds(wg * 256, 256)][...] = out.astype(out_dtype)


def _store_blocks(accs, inv, half, out_dtype, tile_q, split, r: common.SparseRefs):
  """A bf16 consumer's O columns 256 half ... from its four [64, 64] accumulators (:func:`_store_half`)."""
  _store_half(jnp.concatenate(accs, axis=1), inv, half, out_dtype, tile_q, split, r)


def _zero_state():
  acc0 = plgpu.layout_cast(jnp.zeros((TILE, 256), jnp.float32), plgpu.Layout.WGMMA)
  m0 = plgpu.layout_cast(jnp.full((TILE,), -jnp.inf, jnp.float32), ROW_LAYOUT)
  l0 = plgpu.layout_cast(jnp.zeros((TILE,), jnp.float32), ROW_LAYOUT)
  return acc0, m0, l0


def _softmax_step(s, m, l, row_scale, valid, rescale_threshold=None, scale_in_exponent: bool = False):
  """The online softmax of one tile; ``valid``: its key mask or None (``rescale_threshold``: lazy rescaling;
  ``scale_in_exponent``: the row scale folded into exp2's argument; all ``common.online_softmax_tile``)."""
  return common.online_softmax_tile(s, valid, row_scale, m, l,
                                    rescale_threshold=rescale_threshold, scale_in_exponent=scale_in_exponent)


def _softmax_prologue(tile_q, r: common.SparseRefs, q_in=None, regs: tuple[int, str] = (CONSUMER_REGS, "increase"),
                      quantize: bool = True):
  """A softmax consumer's start: its registers (``regs``: count and setmaxnreg action), Q and the indices landed;
  returns (row_scale [64], kv_scale). ``q_in`` (``TuningConfig.q_in_kernel``): (wg, heads, softmax_scale,
  interpret); with ``quantize`` this consumer quantizes its half of the tile's rows first
  (:func:`_quantize_q_half`), else (the "producer_vt" producer) its ``PRODUCER_Q_ROWS`` and the multipliers the
  rest; the rows' max |q| is read from :func:`_amax_row`."""
  plgpu.set_max_registers(regs[0], action=regs[1])
  if q_in is not None and quantize:
    wg, heads, _, interpret = q_in
    _quantize_q_half(tile_q, r, wg, heads, interpret)
  elif q_in is not None and PRODUCER_Q_ROWS:
    _, heads, _, interpret = q_in
    _quantize_q_rows(tile_q, r, 0, PRODUCER_Q_ROWS, heads, interpret, load_regs=PRODUCER_Q_LOAD_REGS)
  plgpu.barrier_wait(r.q_bar)
  plgpu.barrier_wait(r.idx_bar)
  if q_in is None:
    return plgpu.load(r.qs_gmem.at[tile_q], layout=ROW_LAYOUT, optimized=False), r.scal_gmem[0]
  amax = plgpu.load(_amax_row(r), layout=ROW_LAYOUT, optimized=False)
  return q_quant.row_scales(amax, q_in[2], r.scal_gmem[0]), r.scal_gmem[0]


def _amax_row(r: common.SparseRefs):
  """The [64] f32 SMEM row of the Q tile rows' max |q|: ``head_smem`` itself ("twin") or its row after
  kv_scale / l ("producer_vt", whose head_smem also holds the alpha and kv_scale / l rows)."""
  return r.head_smem if len(r.head_smem.shape) == 1 else r.head_smem.at[INV_SLOT + 1]


# "producer_vt": tile rows of Q the producer quantizes (rows [0, PRODUCER_Q_ROWS); each multiplier half of the
# rest), with at most PRODUCER_Q_LOAD_REGS registers of q loads in flight (it has 88); the warpgroups' shares of
# the CTA's start (the multipliers alone: ~8 k cycles, 8 rows per warp) even out.
PRODUCER_Q_ROWS = 16
PRODUCER_Q_LOAD_REGS = 32


def _q_arrivals(cfg) -> int:
  """Arrivals on ``q_bar`` where the kernel quantizes Q: one per quantizing warpgroup."""
  return 3 if cfg.producer and PRODUCER_Q_ROWS else 2


def _quantize_q_rows(tile_q, r: common.SparseRefs, first, count: int, heads: int, interpret: bool,
                     load_regs: int | None = None):
  """``TuningConfig.q_in_kernel``: this warpgroup quantizes tile rows [first, first + count) of query tile
  ``tile_q`` (heads 64 (tile_q % tiles) + r of token tile_q // tiles; rows past H are zeros) from q [T · H, 576]
  into ``q_sw`` and their max |q| into :func:`_amax_row`, fences them and arrives on ``q_bar`` (:func:`_q_arrivals`:
  the tile is complete when every quantizing warpgroup has). ``first``: a Python int or traced (the
  multipliers' one code path); ``count`` a multiple of 4; ``load_regs``: ``q_quant.quantize_head_rows``'."""
  tiles = max(1, heads // TILE)
  row0 = lax.div(tile_q, tiles) * heads + lax.rem(tile_q, tiles) * TILE
  quantize = q_quant.quantize_head_rows_interpret if interpret else q_quant.quantize_head_rows
  quantize(r.q_gmem, r.q_sw, _amax_row(r), row0, min(heads, TILE), first=first, count=count, load_regs=load_regs)
  plgpu.commit_smem()
  plgpu.barrier_arrive(r.q_bar)


def _quantize_q_half(tile_q, r: common.SparseRefs, wg, heads: int, interpret: bool):
  """"twin": consumer ``wg`` (traced) quantizes its half of the rows (:func:`_quantize_q_rows`)."""
  for w in range(2):
    @pl.when(wg == w)
    def _():
      _quantize_q_rows(tile_q, r, w * (TILE // 2), TILE // 2, heads, interpret)


def _p_operand(p, dtype, wg, interpret: bool, r: common.SparseRefs):
  """"twin": P as the A operand of consumer ``wg``'s P·V wgmmas, in ``dtype`` (f16, or bf16 over a bf16 cache):
  registers on hardware; the interpreter has no wgmma with A in registers, so there P goes through its SMEM
  slot ``p_sw[wg]``."""
  p_op = p.astype(dtype)
  if not interpret:
    return p_op
  r.p_sw.at[wg][...] = p_op
  plgpu.commit_smem()
  return r.p_sw.at[wg]


def _consumer(cfg: TuningConfig, num_slots: int, out_dtype, interpret: bool, wg, tile_q, split,
              r: common.SparseRefs, q_in=None):
  """schedule "twin", WG0 / WG1: QKᵀ and the upcast of their half of V, online softmax, P·V into their 256
  output columns."""
  row_scale, kv_scale = _softmax_prologue(tile_q, r, (wg,) + q_in if cfg.q_in_kernel else None)
  if cfg.bf16:
    return _consumer_bf16(cfg, num_slots, out_dtype, interpret, row_scale, kv_scale, wg, tile_q, split, r)

  def step(t, carry):
    acc, m, l = carry
    kb = lax.rem(t, cfg.k_buffers)
    k_tiles = r.k_sw.at[kb]
    plgpu.barrier_wait(r.k_full.at[kb])
    s = _qk_and_upcast(k_tiles, lambda: _upcast_half(k_tiles, wg, r), r)
    plgpu.barrier_arrive(r.k_empty.at[kb])
    p, alpha, m_new, l = _softmax_step(s, m, l, row_scale, common.id_mask(r.idx_smem, t, num_slots, COL_LAYOUT))
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    return _pv_half(acc, _p_operand(p, jnp.float16, wg, interpret, r), wg, interpret, r), m_new, l

  acc, m, l = lax.fori_loop(0, cfg.tiles_per_split, step, _zero_state())
  _store_half(acc, kv_scale / jnp.where(l == 0.0, 1.0, l), wg, out_dtype, tile_q, split, r)
  common.store_lse(wg, m, l, r.lse_smem, r.lse_gmem.at[tile_q, split])


BF16_V_BLOCKS = 4   # bf16 cache: P·V per consumer as 4 wgmmas of N = 64 (its 4 chunks of the K tile's latent)


def _consumer_bf16(cfg: TuningConfig, num_slots: int, out_dtype, interpret: bool, row_scale, kv_scale, wg, tile_q,
                   split, r: common.SparseRefs):
  """schedule "twin" over a bfloat16 cache, WG0 / WG1: S = Q·Kᵀ (nine bf16 wgmmas), online softmax, P (bf16) ·
  V into output columns 256 wg ... 256 wg + 255, V being chunks 4 wg ... 4 wg + 3 of the K tile itself (a 16-bit
  wgmma takes the MN-major B, so no copy), four m64n64 accumulators; the K buffer is released after the P·V."""
  def step(t, carry):
    accs, m, l = carry
    kb = lax.rem(t, cfg.k_buffers)
    k_tiles = r.k_sw.at[kb]
    plgpu.barrier_wait(r.k_full.at[kb])
    s = _qk_and_upcast(k_tiles, None, r)
    p, alpha, m_new, l = _softmax_step(s, m, l, row_scale, common.id_mask(r.idx_smem, t, num_slots, COL_LAYOUT))
    accs = _pv_bf16(common.scale_rows(accs, alpha), _p_operand(p, jnp.bfloat16, wg, interpret, r), k_tiles, wg,
                    interpret)
    plgpu.barrier_arrive(r.k_empty.at[kb])
    return accs, m_new, l

  _, m0, l0 = _zero_state()
  accs, m, l = lax.fori_loop(0, cfg.tiles_per_split, step, (_zero_blocks(), m0, l0))
  _store_blocks(accs, kv_scale / jnp.where(l == 0.0, 1.0, l), wg, out_dtype, tile_q, split, r)
  common.store_lse(wg, m, l, r.lse_smem, r.lse_gmem.at[tile_q, split])


def _seesaw_rows(r: common.SparseRefs, kb):
  """"seesaw": the ``head_smem`` rows of the tile in K buffer ``kb``: (alpha, m, l) [64] f32 each (no rescale
  flags: every alpha is applied). The last row stages the lse."""
  return r.head_smem.at[3 * kb], r.head_smem.at[3 * kb + 1], r.head_smem.at[3 * kb + 2]


def _seesaw_consumer(cfg: TuningConfig, num_slots: int, out_dtype, interpret: bool, w: int, tile_q, split,
                     r: common.SparseRefs, keys=None):
  """schedule "seesaw" over a bfloat16 cache, consumer ``w`` (0 or 1, static): it owns tiles t = w, w + 2, ...
  (K buffer t % 2 = w). Per own tile: S = Q·Kᵀ (nine bf16 wgmmas), the other consumer's tile t - 1's (m, l) from
  SMEM (``p_full[1 - w]``), the online softmax of tile t from there, then P (bf16, into the rope chunk of K buffer
  w, which after the QKᵀ only P needs), alpha, m and l into its rows (:func:`_seesaw_rows`) and ``p_full[w]``;
  then O's columns 256 w ... (four [64, 64] accumulators) take tile t - 1 (rescaled by its alpha, P from K
  buffer 1 - w) and tile t (rescaled by alpha), and both K buffers are released. So a consumer's QKᵀ of tile t
  runs while the other runs the softmax of tile t - 1, and the softmaxes alternate between the consumers (the
  chain per tile: one softmax and the hand-off, instead of QKᵀ + softmax). After its last own tile it takes the
  other's last tile if that comes later, and the final (m, l) is the last tile's.
  ``keys``: as :func:`_producer`'s (the dense kernel's tiles: a traced count and an unmasked and a masked range;
  the first tile and the tail then run under ``lax.cond``); None: the split's ``common.id_key_tiles``."""
  row_scale, kv_scale = _softmax_prologue(tile_q, r)
  keys = common.id_key_tiles(cfg.tiles_per_split, r.idx_smem, num_slots, COL_LAYOUT) if keys is None else keys()
  n = keys.n_tiles
  other = 1 - w

  def take(accs, kb, alpha):     # O += tile's P · V, P from the tile's rope chunk; then the buffer's release
    if kb == other:       # the other's tile: landed for this consumer too (each consumer waits every phase once)
      plgpu.barrier_wait(r.k_full.at[kb])
    k_tiles = r.k_sw.at[kb]
    accs = _pv_bf16(common.scale_rows(accs, alpha), k_tiles.at[BF16_P_CHUNK], k_tiles, w, interpret)
    if interpret:         # the interpreter reads V through the generic proxy: fenced before the release
      plgpu.commit_smem()
    plgpu.barrier_arrive(r.k_empty.at[kb])
    return accs

  def stats(kb):          # the other consumer's tile in K buffer kb, once published: (alpha, m, l)
    plgpu.barrier_wait(r.p_full.at[kb])
    return tuple(plgpu.load(row, layout=ROW_LAYOUT, optimized=False) for row in _seesaw_rows(r, kb))

  def own(t, accs, m, l, prev, valid):   # prev: the other's tile t - 1's alpha, or None (t = 0)
    plgpu.barrier_wait(r.k_full.at[w])
    s = _qk_and_upcast(r.k_sw.at[w], None, r)
    p, alpha, m, l = _softmax_step(s, m, l, row_scale, valid)
    alpha_ref, m_ref, l_ref = _seesaw_rows(r, w)
    m_ref[...] = m
    l_ref[...] = l
    _store_p_alpha(p.astype(jnp.bfloat16), alpha, r.k_sw.at[w, BF16_P_CHUNK], alpha_ref, None, interpret)
    plgpu.barrier_arrive(r.p_full.at[w])
    if prev is not None:
      accs = take(accs, other, prev)
    return take(accs, w, alpha), m, l

  _, m, l = _zero_state()
  carry = (_zero_blocks(), m, l)
  if w == 0:              # tile 0: no tile before it
    carry = common.when(n > 0, lambda c: own(0, *c, None, common.tile_mask(keys, 0)), carry)

  def step(mask, j, carry):       # own tile t = 2 j + w, after the other's t - 1
    accs, _, _ = carry
    alpha_prev, m_prev, l_prev = stats(other)
    t = 2 * j + w
    return own(t, accs, m_prev, l_prev, alpha_prev, None if mask is None else mask(t))

  for lo, hi, mask in keys.segments:    # the own tiles of [lo, hi) past tile 0: j in [ceil((lo - w) / 2), ...)
    j0, j1 = (common.half_up(x - w) for x in (lo, hi))
    carry = common.fori_loop(common.maximum(j0, 1 - w), j1, functools.partial(step, mask), carry)

  def tail(carry):        # the other's last tile, after this consumer's last
    accs, _, _ = carry
    alpha_prev, m, l = stats(other)
    return take(accs, other, alpha_prev), m, l
  accs, m, l = common.when((n > 0) & (common.rem(n - 1, 2) == other), tail, carry)
  _store_blocks(accs, kv_scale / jnp.where(l == 0.0, 1.0, l), w, out_dtype, tile_q, split, r)
  common.store_lse(w, m, l, r.head_smem.at[r.head_smem.shape[0] - 1], r.lse_gmem.at[tile_q, split])


def _landed(t, cfg: TuningConfig, r: common.SparseRefs):
  """"producer_vt": tile t once its K tile has landed: (K buffer, P slot, the K tiles ref)."""
  kb = lax.rem(t, cfg.k_buffers)
  plgpu.barrier_wait(r.k_full.at[kb])
  return kb, lax.rem(t, P_BUFFERS), r.k_sw.at[kb]


def _flags(r: common.SparseRefs, pb):
  """Slot pb's rescale flags: entries 4 pb ... 4 pb + 3 of ``head_smem``'s last row, one per producer warp (1.0
  where one of the warp's 16 rows moved its maximum, i.e. has alpha != 1; else 0.0)."""
  return r.head_smem.at[r.head_smem.shape[0] - 1, pl.ds(4 * pb, 4)]


def _all_alpha_one(r: common.SparseRefs, pb):
  """True (a scalar) where slot pb's alpha is 1 in every row: the sum of the producer warps' four flags is 0
  (four scalar SMEM loads, instead of each multiplier loading the 64 alphas and reducing them)."""
  flags = _flags(r, pb)
  return (flags[0] + flags[1]) + (flags[2] + flags[3]) == 0.0


def _store_p_alpha(p16, alpha, p_ref, alpha_ref, flags_ref, interpret: bool):
  """P ([64, 64] f16, or bf16 over a bf16 cache) into its 128-byte swizzled slot, alpha ([64]) into its row and the
  slot's rescale flags (:func:`_flags`, ``flags_ref`` [4] f32) committed for the async proxy (the multipliers read P
  through wgmma after the arrival that follows). On the GPU in raw Mosaic GPU (``stmatrix`` of P, plain stores of
  alpha, a warp vote per producer warp and lane 0's store of its flag, the proxy fence and one warpgroup barrier):
  Pallas's ``ref[...] = x`` puts a warpgroup barrier before and after each store (four of the five barriers per
  tile in the SASS), where every producer thread only writes, into a slot it has waited for itself. Interpret
  mode: the ref stores (all four flags the warpgroup's). ``flags_ref`` None: no flags ("seesaw" applies every
  alpha)."""
  if interpret:
    p_ref[...] = p16
    alpha_ref[...] = alpha
    if flags_ref is not None:
      flag = jnp.where(common.alpha_is_one(alpha), 0.0, 1.0).astype(jnp.float32)
      for w in range(4):    # scalar stores (a [4] array store has no warpgroup layout on hardware)
        flags_ref[w] = flag
    plgpu.commit_smem()
    return

  flags = () if flags_ref is None else (flags_ref,)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, ROW_LAYOUT, plgpu.RefType(swizzled(p16.dtype, 128)),
                                plgpu.RefType()) + (plgpu.RefType(),) * len(flags))
  def store(ctx, p, a, p_smem, a_smem, *f_smem):
    del ctx
    p.store_tiled(p_smem, swizzle=128, tiling_rank=2)
    a.store_untiled(a_smem, optimized=False)
    for f in f_smem:
      _store_warp_flag(a, f)
    mgpu.commit_shared()
  store(p16, alpha, p_ref, alpha_ref, *flags)


def _store_warp_flag(a, f_smem):
  """Inside an ``inline_mgpu`` body: lane 0 of each warp stores 1.0 at ``f_smem[warp]`` (SMEM memref [4] f32)
  where any of the warp's rows has alpha != 1 (``a``: the ROW_LAYOUT alpha, this thread's rows' values;
  ``vote.sync.any``), else 0.0."""
  f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
  one = arith.constant(f32, 1.0)
  moved = None
  for reg in a.registers.flat:
    vals = [vector.extract(reg, [], [k]) for k in range(ir.VectorType(reg.type).shape[0])] \
        if str(reg.type).startswith("vector") else [reg]
    for v in vals:
      m = arith.cmpf(arith.CmpFPredicate.UNE, v, one)
      moved = m if moved is None else arith.ori(moved, m)
  any_moved = raw_mgpu.asm(i32, [arith.extui(i32, moved)],
                           "{\n.reg .pred p, q;\nsetp.ne.u32 p, $1, 0;\nvote.sync.any.pred q, p, 0xffffffff;\n"
                           "selp.u32 $0, 1, 0, q;\n}", "=r,r", side_effects=True)
  _, warp, lane = raw_mgpu.thread_in_warpgroup()
  flag = arith.uitofp(f32, any_moved)
  base = llvm.ptrtoint(i32, mgpu_utils.memref_ptr(f_smem))
  addr = arith.addi(base, arith.muli(warp, raw_mgpu.c32(4)))
  raw_mgpu.when(arith.cmpi(arith.CmpIPredicate.eq, lane, raw_mgpu.c32(0)),
                lambda: raw_mgpu.st_shared_f32(addr, flag))


# "producer_vt" over a bf16 cache: P of tile t goes into the last chunk of its K buffer (the rope columns 512-575,
# [64 keys, 64] bf16: the shape and swizzle of P [64 heads, 64 keys]), which only the producer's QKᵀ reads; the
# multipliers read V from chunks 0-7 and P from there, and release the buffer after their P·V. (FlashMLA's
# sparse prefill overlaps one P buffer with the K tile's rope part the same way.) SMEM: no P slots, so Q and two
# bf16 K tiles fit.
BF16_P_CHUNK = common.BF16_TILES.chunks - 1


def _p_slot(cfg: TuningConfig, r: common.SparseRefs, kb, pb):
  """Where the producer writes tile t's P (K buffer kb, slot pb): ``p_sw[pb]`` (f16) over an fp8 cache; over a
  bf16 cache the rope chunk of K buffer kb (:data:`BF16_P_CHUNK`)."""
  return r.k_sw.at[kb, BF16_P_CHUNK] if cfg.bf16 else r.p_sw.at[pb]


def _publish_p(t, pb, p16, alpha, p_ref, r: common.SparseRefs, interpret: bool):
  """The producer hands tile t's P ([64, 64] into ``p_ref``, :func:`_p_slot`) and alpha (slot pb) to the
  multipliers once slot pb is free (both multipliers released it; over a bf16 cache already implied by the K
  buffer's release, which the producer waited for before its QKᵀ)."""
  with jax.named_scope("p_wait_slot"):
    @pl.when(t >= P_BUFFERS)
    def _():
      plgpu.barrier_wait(r.p_empty.at[pb])   # the multipliers are done with slot pb (tile t - 2)
  with jax.named_scope("p_store"):
    _store_p_alpha(p16, alpha, p_ref, r.head_smem.at[pb], _flags(r, pb), interpret)
  plgpu.barrier_arrive(r.p_full.at[pb])


def _finish_softmax(n_tiles, kv_scale, m, l, tile_q, split, r: common.SparseRefs):
  """The producer after the last of its ``n_tiles`` tiles: kv_scale / l for the multipliers (``p_full[2]``), the
  lse, the final observation of the P slots."""
  inv = kv_scale / jnp.where(l == 0.0, 1.0, l)
  r.head_smem.at[INV_SLOT][...] = inv
  plgpu.commit_smem()
  plgpu.barrier_arrive(r.p_full.at[INV_SLOT])
  common.store_lse(lax.axis_index("wg"), m, l, r.lse_smem, r.lse_gmem.at[tile_q, split])
  common.drain(r.p_empty, n_tiles, P_BUFFERS)


def _multiplier_start(tile_q, r: common.SparseRefs, half, q_in):
  """A multiplier's registers (``PRODUCER_REGS[2]``) and, where the kernel quantizes Q (``q_in``: heads,
  interpret), its half of the tile's rows first."""
  plgpu.set_max_registers(PRODUCER_REGS[2], action="increase")
  if q_in is not None:
    rows = (TILE - PRODUCER_Q_ROWS) // 2      # the producer quantizes rows [0, PRODUCER_Q_ROWS)
    with jax.named_scope("m_quantize_q"):
      _quantize_q_rows(tile_q, r, PRODUCER_Q_ROWS + half * rows, rows, *q_in)


def _multiplier_interpret(cfg: TuningConfig, out_dtype, tile_q, split, r: common.SparseRefs, half: int, q_in=None,
                          n_tiles=None):
  """"producer_vt" in interpret mode (the interpreter runs neither its raw Mosaic GPU Vᵀ loads nor a wgmma with A
  in registers), multiplier WG1 + ``half``: the same hand-off and the same products with V upcast to the f16 V
  tile (``TuningConfig.v_tile(interpret=True)``): per tile the upcast of V chunks 2 half, 2 half + 1, the K
  buffer's release, then after slot t % 2 arrives the rescale by the producer's alpha (skipped where every alpha
  is 1) and O half += P · V half (:func:`_pv_half`, P read from the slot), and the slot's release; at the end its
  half of O (not transposed), scaled by the producer's kv_scale / l. ``q_in`` (heads, interpret) where the kernel
  quantizes Q: first its half of the rows (:func:`_quantize_q_rows`). ``n_tiles``: a function returning the
  number of tiles to run (int or traced), called after the start; None: ``tiles_per_split``."""
  _multiplier_start(tile_q, r, half, q_in)
  n_tiles = cfg.tiles_per_split if n_tiles is None else n_tiles()

  def step(t, acc):
    kb, pb, k_tiles = _landed(t, cfg, r)
    common.stage_v16(k_tiles, r.v16, chunks=(2 * half, 2 * half + 1))
    plgpu.commit_smem()
    plgpu.barrier_arrive(r.k_empty.at[kb])
    plgpu.barrier_wait(r.p_full.at[pb])
    acc = lax.cond(_all_alpha_one(r, pb), lambda a: a, lambda a: a * lax.broadcast_in_dim(
        plgpu.load(r.head_smem.at[pb], layout=ROW_LAYOUT, optimized=False), a.shape, [0]), acc)
    acc = _pv_half(acc, r.p_sw.at[pb], half, True, r)
    plgpu.barrier_arrive(r.p_empty.at[pb])
    return acc

  acc = lax.fori_loop(0, n_tiles, step, _zero_state()[0])
  plgpu.barrier_wait(r.p_full.at[INV_SLOT])
  inv = plgpu.load(r.head_smem.at[INV_SLOT], layout=ROW_LAYOUT, optimized=False)
  _store_half(acc, inv, half, out_dtype, tile_q, split, r)


def _zero_blocks():
  """Four zero [64, 64] f32 accumulators (WGMMA layout): a multiplier's Oᵀ blocks, or a bf16 consumer's O
  chunks (vt_registers.HALF_BLOCKS = BF16_V_BLOCKS = 4)."""
  return (plgpu.layout_cast(jnp.zeros((TILE, TILE), jnp.float32), plgpu.Layout.WGMMA),) * vt_registers.HALF_BLOCKS


def _pv_vt(accs, words, pb, r: common.SparseRefs):
  """A multiplier's four Oᵀ blocks, rescaled by slot pb's alpha (skipped where every alpha is 1: the producer's
  lazy rescaling), plus Vᵀ[its blocks] · Pᵀ (P of slot pb read as K-major B, Vᵀ built in registers from
  ``words`` one block at a time: ``pv_wgmmas(pipelined=True)``)."""
  accs = lax.cond(_all_alpha_one(r, pb), lambda a: a, lambda a: common.scale_columns(
      a, plgpu.load(r.head_smem.at[pb], layout=COL_LAYOUT, optimized=False)), tuple(accs))
  return tuple(vt_registers.pv_wgmmas(words, r.p_sw, accs, 2 * TILE, blocks=tuple(range(vt_registers.HALF_BLOCKS)),
                                      p_rows=True, pipelined=True, slot=pb))


def _multiplier(cfg: TuningConfig, tile_q, split, r: common.SparseRefs, half, q_in=None, n_tiles=None):
  """"producer_vt" (hardware), multiplier WG1 + ``half`` (traced: both multipliers run this code): per tile its
  bytes of V (latent columns 256 half ... 256 half + 255, ``vt_registers.load_v_half_words``) from the K tile,
  the K buffer's release, then after slot t % 2 arrives its four Oᵀ blocks += Vᵀ · Pᵀ and the release of the
  slot; at the end its half of O (16-byte row pieces). ``q_in`` (heads, interpret) where the kernel quantizes
  Q: first its half of the rows (:func:`_quantize_q_rows`; the multipliers would otherwise wait for the first
  P). ``n_tiles``: a function returning the number of tiles to run (int or traced), called after the start;
  None: ``tiles_per_split``."""
  _multiplier_start(tile_q, r, half, q_in)
  n_tiles = cfg.tiles_per_split if n_tiles is None else n_tiles()

  def step(t, accs):
    with jax.named_scope("m_wait_k"):
      kb, pb, k_tiles = _landed(t, cfg, r)
    with jax.named_scope("m_words"):
      words = vt_registers.load_v_half_words(k_tiles, half)
    plgpu.barrier_arrive(r.k_empty.at[kb])
    with jax.named_scope("m_wait_p"):
      plgpu.barrier_wait(r.p_full.at[pb])
    with jax.named_scope("m_pv"):
      accs = _pv_vt(accs, words, pb, r)
    plgpu.barrier_arrive(r.p_empty.at[pb])
    return accs

  accs = lax.fori_loop(0, n_tiles, step, _zero_blocks())
  with jax.named_scope("m_store"):
    plgpu.barrier_wait(r.p_full.at[INV_SLOT])
    inv = plgpu.load(r.head_smem.at[INV_SLOT], layout=COL_LAYOUT, optimized=False)
    vt_registers.store_half_o(common.scale_columns(accs, inv), r.o_gmem.at[tile_q, split], half)


def _pv_bf16(accs, p_op, k_tiles, half, interpret: bool):
  """Both schedules over a bf16 cache: accs (four [64 heads, 64] f32, WGMMA layout) += P · V[:, 256 half + 64 g
  ...], P ``p_op`` [64 heads, 64 keys] bf16 (registers, or a ref: "producer_vt"'s rope chunk, :func:`_p_slot`) as
  the A operand and V chunk 4 half + g of the K tile ``k_tiles`` as the MN-major B (a 16-bit wgmma takes it as
  stored): one m64n64k16 x 4 group per chunk, waited for; ``half`` may be traced. Not one m64n256k16 group into a
  [64, 256] accumulator: ptxas refuses an instruction whose operands need more registers than the launch count
  (65536 / 512 threads = 128 in "producer_vt"), even in a region ``setmaxnreg`` raised to 200 (where the code
  around it may use up to 200), and one m64n256k16 needs its 128 accumulators plus its operands ("Insufficient
  registers (128) ... 154"; docs/kernels)."""
  def pv(acc_refs):
    for g, a in enumerate(acc_refs):
      plgpu.wgmma(a, p_op, k_tiles.at[BF16_V_BLOCKS * half + g])
  return common.accumulate(pv, accs, interpret)


def _multiplier_bf16(cfg: TuningConfig, out_dtype, tile_q, split, r: common.SparseRefs, half, interpret: bool,
                     n_tiles=None):
  """"producer_vt" over a bf16 cache, multiplier WG1 + ``half`` (traced: both multipliers run this code): per tile,
  once slot t % 2 has arrived, its half of O [64 heads, 256 columns] rescaled by the producer's alpha (skipped
  where every alpha is 1) plus P · V (:func:`_pv_bf16`, both operands in the K buffer), then the release of the K
  buffer and the slot; at the end its half of O scaled by the producer's kv_scale / l. No Vᵀ words: O keeps the
  heads on its rows (four [64, 64] accumulators). ``n_tiles``: as :func:`_multiplier`."""
  plgpu.set_max_registers(PRODUCER_REGS[2], action="increase")
  n_tiles = cfg.tiles_per_split if n_tiles is None else n_tiles()

  def rescaled(accs, pb):
    return common.scale_rows(accs, plgpu.load(r.head_smem.at[pb], layout=ROW_LAYOUT, optimized=False))

  def step(t, accs):
    with jax.named_scope("m_wait_k"):
      kb, pb, k_tiles = _landed(t, cfg, r)
    with jax.named_scope("m_wait_p"):
      plgpu.barrier_wait(r.p_full.at[pb])
    with jax.named_scope("m_pv"):
      accs = lax.cond(_all_alpha_one(r, pb), lambda a: a, lambda a: rescaled(a, pb), accs)
      accs = _pv_bf16(accs, k_tiles.at[BF16_P_CHUNK], k_tiles, half, interpret)   # P in the rope chunk
      if interpret:       # the interpreter reads V through the generic proxy: fenced before the release
        plgpu.commit_smem()
    plgpu.barrier_arrive(r.k_empty.at[kb])
    plgpu.barrier_arrive(r.p_empty.at[pb])
    return accs

  accs = lax.fori_loop(0, n_tiles, step, _zero_blocks())
  with jax.named_scope("m_store"):
    plgpu.barrier_wait(r.p_full.at[INV_SLOT])
    inv = plgpu.load(r.head_smem.at[INV_SLOT], layout=ROW_LAYOUT, optimized=False)
    _store_blocks(accs, inv, half, out_dtype, tile_q, split, r)


def _producer(cfg: TuningConfig, num_slots: int, interpret: bool, tile_q, split, r: common.SparseRefs, q_in=None,
              keys=None):
  """schedule "producer_vt", WG0: per tile QKᵀ, the K buffer's release (the multipliers read V from it
  themselves), the online softmax (lazy rescaling, the row scale in the exponent), P (f16) and alpha into slot
  t % 2 (``_publish_p``: it runs up to two tiles ahead of the multipliers); at the end kv_scale / l for WG1 / WG2
  and the lse. It holds no O (88 registers).
  ``q_in`` (wg, heads, softmax_scale, interpret): it quantizes Q rows [0, PRODUCER_Q_ROWS) first; the row scales
  from the max |q| row the three quantizing warpgroups write.
  ``keys``: a function returning the ``common.KeyTiles`` to run, called after the prologue's waits (the dense
  kernel reads them from the table the loader copies); None: ``common.id_key_tiles`` of the split."""
  with jax.named_scope("p_prologue"):
    row_scale, kv_scale = _softmax_prologue(tile_q, r, q_in, regs=(PRODUCER_REGS[1], "decrease"), quantize=False)
  keys = common.id_key_tiles(cfg.tiles_per_split, r.idx_smem, num_slots, COL_LAYOUT) if keys is None else keys()

  def step(mask, t, carry):
    m, l = carry
    with jax.named_scope("p_wait_k"):
      kb, pb, k_tiles = _landed(t, cfg, r)
      # the tile's key mask (None: an unmasked range) before its QKᵀ is waited for: the index loads' latency off
      # the head of the softmax chain (the indices are in SMEM from the start)
      valid = None if mask is None else mask(t)
    with jax.named_scope("p_qk"):
      s = _qk_producer(cfg, k_tiles, r, interpret)
    plgpu.barrier_arrive(r.k_empty.at[kb])
    with jax.named_scope("p_softmax"):
      p, alpha, m_new, l = _softmax_step(s, m, l, row_scale, valid, RESCALE_THRESHOLD, scale_in_exponent=True)
      p16 = p.astype(cfg.p_dtype)
    _publish_p(t, pb, p16, alpha, _p_slot(cfg, r, kb, pb), r, interpret)
    return m_new, l

  _, m0, _ = _zero_state()
  m, l = m0, _producer_l0()
  for lo, hi, mask in keys.segments:
    m, l = lax.fori_loop(lo, hi, functools.partial(step, mask), (m, l))
  with jax.named_scope("p_finish"):
    _finish_softmax(keys.n_tiles, kv_scale, m, l.sum(axis=1), tile_q, split, r)


# The producer's running softmax sum: [64, SUM_COLS] partial sums per column residue (each thread adds its own
# columns' slices; the quad's shuffle reduction once after the last tile, not per tile; docs/kernels: a [64] row
# sum reduced in every tile was slower).
SUM_COLS = 8


def _producer_l0():
  """The producer's initial running sum: zeros [64, SUM_COLS] (WGMMA layout)."""
  return plgpu.layout_cast(jnp.zeros((TILE, SUM_COLS), jnp.float32), plgpu.Layout.WGMMA)


def _body(cfg, num_slots, tiles_per_token, out_dtype, interpret, q_in, q_split, *refs):
  if q_split:           # q as (latent [T · H, 512], rope [T · H, 64])
    refs = (refs[:2],) + refs[2:]
  if cfg.q_in_kernel:   # q as it is, no row-scale input
    refs = refs[:1] + (None,) + refs[1:]
  q_gmem, qs_gmem, kv_gmem, idx_gmem, scal_gmem, o_gmem, lse_gmem, q_sw, k_sw, *rest = refs
  producer = cfg.producer
  v16, rest = (rest[0], rest[1:]) if cfg.v_tile(interpret) else (None, rest)
  p_sw, rest = (rest[0], rest[1:]) if cfg.p_slots(interpret) else (None, rest)
  idx_smem, *rest = rest
  lse_smem, rest = (None, rest) if cfg.seesaw else (rest[0], rest[1:])
  head_smem, rest = (rest[0], rest[1:]) if producer or cfg.seesaw or cfg.q_in_kernel else (None, rest)
  q_bar, idx_bar, k_full, k_empty, *rest = rest
  p_full, p_empty = rest if producer else (rest[0], None) if cfg.seesaw else (None, None)
  r = common.SparseRefs(q_gmem, qs_gmem, kv_gmem, idx_gmem, scal_gmem, o_gmem, lse_gmem, q_sw, k_sw, v16, p_sw, idx_smem,
            lse_smem, head_smem, q_bar, idx_bar, k_full, k_empty, p_full, p_empty)
  wg = lax.axis_index("wg")
  tile_q = lax.axis_index("q")
  split = lax.axis_index("split")
  token = lax.div(tile_q, tiles_per_token)

  @pl.when(wg == cfg.loader)
  def _():
    _loader(cfg, num_slots, interpret, tile_q, split, token, r)

  if producer:
    @pl.when(wg == 0)
    def _():
      _producer(cfg, num_slots, interpret, tile_q, split, r,
                (0,) + q_in + (interpret,) if cfg.q_in_kernel else None)

    q_mult = (q_in[0], interpret) if cfg.q_in_kernel else None
    if cfg.bf16:    # bf16 cache: P·V from SMEM, one code path (and in interpret mode the same hand-off)
      @pl.when((wg == 1) | (wg == 2))
      def _():
        _multiplier_bf16(cfg, out_dtype, tile_q, split, r, wg - 1, interpret)
    elif interpret:   # interpret mode's multipliers: the same products with V upcast to the f16 tile
      for half in range(2):
        @pl.when(wg == 1 + half)
        def _():
          _multiplier_interpret(cfg, out_dtype, tile_q, split, r, half=half, q_in=q_mult)
    else:   # one code path for both multipliers, the half traced (WG1: 0, WG2: 1; docs/kernels: a copy per half
            # made the second one's Q quantization 4 k cycles longer)
      @pl.when((wg == 1) | (wg == 2))
      def _():
        _multiplier(cfg, tile_q, split, r, half=wg - 1, q_in=q_mult)
  elif cfg.seesaw:     # the two consumers' code differs in which tiles they own: one copy each
    for w in range(2):
      @pl.when(wg == w)
      def _():
        _seesaw_consumer(cfg, num_slots, out_dtype, interpret, w, tile_q, split, r)
  else:
    @pl.when(wg < LOADER)
    def _():
      _consumer(cfg, num_slots, out_dtype, interpret, wg, tile_q, split, r,
                q_in + (interpret,) if cfg.q_in_kernel else None)


@functools.lru_cache(maxsize=64)
def build(num_q_tiles: int, num_slots: int, num_splits: int, tiles_per_token: int, out_dtype_name: str,
          cfg: TuningConfig, interpret=False, heads: int | None = None, softmax_scale: float | None = None,
          q_split: bool = False):
  """The kernel for these shapes (arguments and results: see the module docstring); ``interpret``: False, True or
  a ``plgpu.InterpretGPUParams``; ``heads`` (H) and ``softmax_scale``: needed where ``cfg.q_in_kernel`` (an fp8
  cache); ``q_split`` (only with ``cfg.q_in_kernel``): q comes as two inputs, latent [T · H, 512] and
  rope [T · H, 64] (bf16 or f32 each), instead of q [T · H, 576]."""
  if cfg.q_in_kernel and (heads is None or softmax_scale is None):
    raise ValueError(f"heads and softmax_scale are needed where the kernel quantizes q (TuningConfig.q_in_kernel: "
                     f"schedule {cfg.schedule!r} over an fp8 cache); got heads={heads}, softmax_scale={softmax_scale}")
  if q_split and not cfg.q_in_kernel:
    raise ValueError("q_split needs a config whose kernel quantizes q (TuningConfig.q_in_kernel: an fp8 cache); "
                     f"got schedule={cfg.schedule!r}, bf16={cfg.bf16}")
  out_dtype = jnp.dtype(out_dtype_name)
  interp = bool(interpret)
  if cfg.producer:   # (the 3-warpgroup "twin" has run on 2-CPU machines without deadlocks)
    common.check_interpret_threads(interp, cfg.loader + 1, f"schedule {cfg.schedule!r}")
  q_in = (heads, float(softmax_scale)) if cfg.q_in_kernel else None
  body = functools.partial(_body, cfg, num_slots, tiles_per_token, out_dtype, interp, q_in, bool(q_split))
  producer = cfg.producer
  v_scratch = [plgpu.SMEM((TILE, D_V), jnp.float16, transforms=swizzled(jnp.float16, 128))] \
      if cfg.v_tile(interp) else []
  p_dtype = cfg.p_dtype
  p_scratch = [plgpu.SMEM((P_BUFFERS, TILE, TILE), p_dtype, transforms=swizzled(p_dtype, 128))] \
      if cfg.p_slots(interp) else []
  head_scratch = [plgpu.SMEM((cfg.head_rows, TILE), jnp.float32)] if producer or cfg.seesaw else \
      [plgpu.SMEM((TILE,), jnp.float32)] if cfg.q_in_kernel else []
  producer_barriers = [plgpu.Barrier(num_barriers=P_BUFFERS + 1),                    # p_full (P slots, 1/l)
                       plgpu.Barrier(num_arrivals=2, num_barriers=P_BUFFERS)] if producer else \
      [plgpu.Barrier(num_barriers=2)] if cfg.seesaw else []                               # "seesaw": p_full
  return plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((num_q_tiles, num_splits, TILE, D_V), out_dtype),
                jax.ShapeDtypeStruct((num_q_tiles, num_splits, TILE), jnp.float32)),
      grid=(num_q_tiles, num_splits), grid_names=("q", "split"),
      num_threads=cfg.loader + 1, thread_name="wg",
      scratch_types=[
          common.q_scratch(TILE, cfg.layout),                                              # Q
          common.k_scratch(cfg.k_buffers, cfg.layout),                                     # K
          *v_scratch,                                                                      # V f16
          *p_scratch,                                                                      # P slots
          plgpu.SMEM((cfg.tiles_per_split, TILE), jnp.int32),                              # indices
          *([] if cfg.seesaw else [plgpu.SMEM((TILE,), jnp.float32)]),                     # lse
          *head_scratch,                                                                   # alpha, 1/l
          plgpu.Barrier(num_arrivals=_q_arrivals(cfg) if cfg.q_in_kernel else cfg.layout.chunks),   # q_bar
          plgpu.Barrier(),                                                                 # idx_bar
          plgpu.Barrier(num_arrivals=common.k_full_arrivals(interp, cfg.layout),
                        num_barriers=cfg.k_buffers),                                       # k_full
          plgpu.Barrier(num_arrivals=3 if cfg.producer else 2, num_barriers=cfg.k_buffers),  # k_empty
          *producer_barriers,
      ],
      # "producer_vt": exp2 / log2 as ex2 / lg2.approx.ftz (no subnormal fix-up around each MUFU op; P, alpha and
      # the lse differ from the exact forms by about one f32 ulp, far below P's f16 rounding)
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE, approx_math=producer,
                                           reduction_scratch_bytes=cfg.reduction_scratch),
      **common.interpret_kwargs(interpret),
  )
