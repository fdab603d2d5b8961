"""Native-FP8 sparse MLA decode for Hopper (sm_90a): per-row TMA gather, FP8 staging warpgroup, FP8 wgmma.

What one CTA computes
---------------------
One *query tile* of 64 rows (the heads of one query token; H < 64 is zero-padded to 64 rows, H = 128 is two
tiles) against ``tiles_per_split`` tiles of 64 gathered KV rows (one split of the token's top-k):

    S    = Q8 · K8ᵀ                       fp8 wgmma, f32 accumulate, K = 576 (default: 5 chunks of 128, see below)
    s    = S · row_scale                  row_scale = q_scale(row) · kv_scale · softmax_scale · log2(e)
    s    = −inf where the key is invalid (index < 0, ≥ num_slots, or past topk_length)
    online softmax in base 2 (m, l per row)
    default (pv_dtype="f16"):  O += f16(p) · f16(V8)   f16 wgmma, f32 accumulate; P in registers, V upcast exactly
    pv_dtype="fp8":            O += P8 · V8, P8 = fp8(256 · p)   FA3-style scaling of P into e4m3's range
    out  = O · kv_scale / (256 · l or l),  lse = (m + log2 l) · ln 2

Inputs are prepared by ``mla_pallas.ops.sparse_decode`` (one fused XLA pre-pass): Q quantized per row; the indices
pass through untouched unless ``topk_length`` is given (entries past it become ``num_slots``) or the top-k needs
padding to the split grid (with ``num_slots``). The kernel treats every id outside [0, num_slots) as invalid: the
loader gathers row ``num_slots`` instead, which lies wholly past the end of the cache, so its TMA box is
zero-filled by the hardware (the kernel never reads out of bounds), and the consumer masks that key to −inf.

Warpgroup roles (``num_threads=3``, Lane semantics), default TuningConfig (k_gather="swizzled", k_buffers=2,
pv_dtype="f16")
-------------------------------------------------------------------------------------------------------------
* WG2 — loader (56 registers): TMA of Q (five 128-column boxes of the 640-wide ``latent | 0 | rope`` rows the op
  prepares) and of the split's indices; then per 64-key tile, once the consumers have released K buffer
  ``t % 2`` (``k_empty``), **five 128-byte TMAs per gathered row straight into the 128-byte-swizzled K tiles**
  (chunks 0-3: cache columns 0-511; chunk 4, the tail: columns 448-575, i.e. latent 448-511 and rope), issued by
  its 4 warps (16 rows each), all arriving on ``k_full``. No linear slot and no register re-swizzle: the TMA unit
  applies the swizzle from the destination address. The destination is a swizzle-only view
  [2, 5, 8, 8, 128] of the same SMEM as the tiled K buffers [2, 5, 64, 128] (a ``plgpu.RefUnion``); interpret
  mode keeps union members apart, so there each row is copied into a one-row slice of the tiled buffer instead.
* WG0, WG1 — consumers (224 registers each). Per tile: issue the five QKᵀ fp8 wgmmas (K chunks of 128; Q's tail
  chunk holds zeros against latent 448-511, so those columns count once); meanwhile stage their half of V (two
  128-column chunks) as an exact e4m3 → f16 upcast (16-bit wgmma takes an MN-major B, so no transpose). Read S,
  release the K buffer (``k_empty``); online softmax; P·V for their 256 output columns (64 × 256 f32 accumulator =
  128 registers per thread) with P as an f16 register operand. S is computed by both consumers (redundant, but no
  cross-warpgroup exchange of S or P). WG0 writes lse.
* ``head_axis="n"`` (v6; the op's default for H <= 16, with ``k_buffers=3``; opt-in at H <= 32): the heads go on
  the MMAs' N side instead of being padded to 64 rows; N = ``heads_n`` = 16 for H <= 16, 32 for H <= 32 (f16
  operands need rows of at least 32 bytes). Loader as above, but Q's first N rows only (Q is 10 KB at N = 16, which
  leaves room for a third K buffer: the loader runs two tiles ahead). Consumer 0 computes Sᵀ [64 keys, N] = K·Qᵀ
  (m64nNk32 fp8 wgmmas, A = the K tile, B = Q) and the online softmax down the columns, and hands Pᵀ (f16 [64 keys,
  N]) and the rescale factors to consumer 1 through double-buffered SMEM; each consumer stages its half of V and
  accumulates Oᵀ [its 256 values of d, N] += Vᵀ·Pᵀ as four m64nNk16 f16 wgmmas (Vᵀ the transposed f16 V tile; the
  2N-byte rows of Pᵀ fix the V buffer's swizzle at 2N bytes). MMA work per tile drops 64/N-fold; the V upcast
  stays. Only consumer 0 runs a softmax because its reductions cross warps, and Mosaic GPU gives every warpgroup's
  cross-warp reductions the same SMEM scratch (see ``_consumer_heads_on_n``). ``consumers=4`` / ``5`` spread the V
  upcast over more warpgroups (measured no faster). H200 (benchmarks/RESULTS.md runs 14-16): (b) 353.6 µs =
  1.71 TB/s against 422.4 µs for head_axis="m" in the same run; at H = 32 (N = 32) no faster than "m" (131.4
  against 129.7 µs), so the op keeps "m" there.
  v7 (the op's defaults for H <= 16 since 2026-11-30, RESULTS run 17): consumer 0 runs only QKᵀ and the softmax,
  consumer 1 upcasts all of V, the second half under the P.V wgmmas of the first (``v_owners=((), (0, 1, 2, 3))``,
  ``v_overlap``); the softmax sums stay per (key, head) element until the last tile (``l_partial``: one cross-warp
  reduction per tile fewer). Q comes as flat, unpadded rows (``q_stride`` = H; the heads_n - H extra rows a CTA
  reads are the next token's heads, whose MMA columns are never stored) with its logit scales by TMA into
  ``head_smem``; raw indices are masked in the kernel; O is written [out_heads, 512] through a transposed GMEM view
  (vector-length-1 layout), so nothing is transposed or sliced after the kernel. (b) 353.6 -> 305.6-310 µs
  (1.96-1.98 TB/s; the XLA pre-pass around the kernel went from 36 to ~4 µs). ``persistent`` (one CTA per SM
  working through several items with Q / index prefetch) is correct and tested but measured no faster.
  **v8** (the op's defaults for H <= 16 since 2026-11-30, sixth session; RESULTS run 19): ``v_regs`` — consumer 1
  no longer upcasts V into an f16 SMEM tile: it loads its bytes of V straight from the K tile into registers (32
  64-bit loads per thread), releases the K buffer at once, and builds Vᵀ as the *register* A operand of the P.V
  wgmmas with byte permutes and e4m3x2 -> f16x2 conversions (``kernels/vt_registers.py``; rows of Vᵀ are
  permuted so that the loads and the O stores are 8 bytes / 16 bytes wide). The 64 KB f16 V tile is gone, and a
  fourth K buffer takes its place (``k_buffers=4``). (b) 305.5 -> 278.2 µs (2.17 TB/s), H = 16 158.3 -> 146.3,
  s_q = 1 89.8 -> 83.7 µs (same run). Interpret mode runs the SMEM upcast instead (no ``inline_mgpu`` there).
* ``k_gather="linear"`` (v4, the default until 2026-11-30): one 640-byte TMA per row into a linear slot, which the
  loader re-swizzles into nine 64-byte-swizzled 64 × 64 tiles through registers (``Layout.WGMMA_8BIT``) before
  refilling the slot; ``pv_dtype="fp8"`` (P as fp8(256 p) through SMEM, V transposed into the K-major Vᵀ FP8
  wgmma needs) and the other stager arrangements exist only on this path.

Why the swizzled gather (H200, 2026-11-30, benchmarks/RESULTS.md run 10): the linear path's loader chain per tile
was gather latency + K re-swizzle (~1.1 µs), with one slot (SMEM was full) nothing overlapped it; gathering into
the swizzled layout removes the re-swizzle and the 40 KB slot, and the second K buffer keeps the next tile's
gather in flight while the consumers work. FlashMLA headline shape: 429.6 µs (340 TFLOP/s) against 562.9 µs for
v4 in the same run, identical outputs on every check case. Cost: 320 TMAs per tile instead of 64, and QKᵀ over
640 columns instead of 576 (+11% of the QK MMAs).
Limiter of v5 (benchmarks/RESULTS.md runs 11-13): the per-tile chain, not bytes or FLOPs — (a) and (b) take the same
time for the same tile count. At (b) (H = 8) removing the QKᵀ wgmmas saves 78 of 421 µs, the V upcast 76, P·V 23;
the loader alone takes 283 µs (320 TMAs per tile); under Nsight Compute the tensor pipe is the busiest (41 % of the
cycles) although 56 of every 64 MMA rows are padding there; that is what ``head_axis="n"`` (above) removed.
Limiter of v6 at (b) (run 14, head_axis="n" with 2 K buffers, 372 µs): without the V upcast 301.5 µs (2.0 TB/s),
without QKᵀ 337 µs, loader alone 261 µs: the V upcast (e4m3 -> f16 through registers, 64 KB of f16 per tile) is
now the largest consumer cost; a third K buffer took the default to 353.6 µs.

Why P·V in f16 by default (measured on an H200, 2026-11-30, benchmarks/RESULTS.md): it removes the slow FP8
transpose of V (vector-length-1 layout) and the P round trip through SMEM; at the FlashMLA headline shape it ran
562.7 µs against 616.1 µs for the FP8 P·V design (same run), and P keeps 11 bits instead of 3 (smaller error).
V is still the cache's e4m3 values (the upcast is exact); QKᵀ stays native FP8. The FP8 P·V design remains as
``pv_dtype="fp8"`` (tested in interpret mode and on the H200).
Limiter of the linear path (ablations, 2026-11-29): the chain K re-swizzle → (QKᵀ ∥ V staging) → softmax + P·V
costs ~1.2 µs per 64-key tile each; the gather alone takes a third of the time. Alternatives measured slower and kept as
switches: V staged by the loader (``v_stager="loader"``), K re-swizzled by the consumers (``k_stager="consumers"``).
Why not a fourth warpgroup: with 512 threads ptxas caps registers at 128 per thread at entry and rejects the
m64n256 f32 wgmma ("Insufficient registers (128) ... 154 or higher"); three warpgroups give a cap of 170.
Why V is staged from the swizzled K tiles: a column of the 128-byte-aligned linear rows lies in one SMEM
bank; transposing from the linear ring cost ~665 of 1172 µs at the FlashMLA headline shape.

Lane semantics: JAX 0.11.2's Warpgroup semantics miscompiles register loads from the strided column views of the
linear ring on an H200 (../shared/mgpu/README.md section 6); Lane is correct. Lane needs TMA copies in multiples of
128 bytes, hence the 640-byte row box from the cache viewed as [num_slots · 9, 64].

SMEM budget (bytes, 64-token tiles, top-k split of up to 2048 keys)
--------------------------------------------------------------------
                                     swizzled gather, H > 16     head_axis="n", N = 16,     k_gather="linear" (v4)
                                     (head_axis="m")             k_buffers=3 (v7)
    Q (fp8, swizzled)                   40 960 (5 × 64 × 128)      10 240 (5 × 16 × 128)      36 864 (9 × 64 × 64)
    linear ring (stages × 64 × 640)          0                          0                     40 960
    K (k_buffers × tile, swizzled)      81 920 (2 × 5 × 64 × 128) 122 880 (3 × 5 × 64 × 128) 73 728 (2 × 9 × 64 × 64)
    V f16 (64 × 512)                    65 536                     65 536                     65 536
    Pᵀ (2 × 64 × 16 f16), scales / alpha / 1/l   0                  4 096 + 1 024                   0
    indices (tiles_per_split × 64 int32) 8 192                      8 192                      8 192
    lse staging, barriers, placeholders   ~3 600                     ~2 600                     ~600
    Mosaic reduction scratch             2 048                      2 048                      2 048
    total (smem_budget, 1 KB rounding) 203 264                    216 576                    229 888
v8 (the default for H <= 16: head_axis="n", v_regs, k_buffers=4): the v7 column without the 65 536 of the V
tile and with a fourth K buffer (+40 960): 193 024 (203 264 with ``persistent``).
(limit 232 448: one CTA per SM; a third K buffer with the 64-row Q would need 243 KB; ``pv_dtype="fp8"`` with
``stages=2, k_buffers=1`` on the linear path: 208 384; head_axis="n" with ``persistent``: a second Q buffer,
226 816.)
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common
from mla_pallas.kernels import vt_registers
from mla_pallas.kernels.common import CHUNK, D_QK, D_V, FP8, LN2, N_CHUNKS, P_SCALE, SLOT_CHUNKS, swizzled

TILE = 64          # query rows per CTA and gathered keys per pipeline step
SW_CHUNK = 128     # k_gather="swizzled": bytes per TMA box / per wgmma K chunk (128-byte swizzle)
SW_CHUNKS = 5      # latent chunks 0-3 (columns 0-511) + tail (columns 448-575: latent 448-511 and rope)
SW_TAIL_COL = D_QK - SW_CHUNK   # 448: first cache column of the tail chunk
Q_SW_COLS = SW_CHUNKS * SW_CHUNK   # 640: Q as latent | 64 zeros | rope (the zeros meet latent 448-511 in the tail)
HEADS_ON_N = (16, 32)   # head_axis="n": the MMAs' N (TuningConfig.heads_n; f16 operands need >= 32-byte rows)
HEAD_ROW = 32      # head_axis="n": f32 entries per row of head_smem (a 128-byte TMA box: Lane copies need a
                   # multiple of 128 bytes; rows hold heads_n <= 32 values)
CONSUMER_REGS = 224   # 2 x 128 x 224 + 128 x 56 <= 65536 registers per SM
LOADER_REGS = 56
# head_axis="n": which 128-column chunks of V (d = 128 c ... 128 c + 127) each consumer warpgroup stages and owns in
# P.V, by TuningConfig.consumers. Consumer 0 also runs QKᵀ and the softmax, so it gets the fewest.
V_CHUNK_OWNERS = {2: ((0, 1), (2, 3)), 4: ((0,), (1,), (2,), (3,)), 5: ((), (0,), (1,), (2,), (3,))}


@dataclasses.dataclass(frozen=True)
class TuningConfig(common.TuningConfigBase):
  """Tuning knobs of the sm_90 sparse decode kernel.

  stages: linear gather ring slots (each 64 rows × 640 B).
  tiles_per_split: 64-key tiles one CTA processes (the split length is 64 · tiles_per_split keys).
  """
  stages: int = 1
  tiles_per_split: int = 32
  v_stager: str = "consumers"
  k_stager: str = "loader"
  k_buffers: int = 2            # 2: double-buffered K tiles (needs stages=1 to fit in SMEM); 3: head_axis="n" only
  pv_dtype: str = "f16"         # "f16": P.V in float16 (V upcast exactly, no transpose; P in f16 registers);
                                # "fp8": P as fp8(256 p) through SMEM, V transposed to fp8 V^T (FP8 wgmma)
  auto_barriers: bool = True    # False: CompilerParams(unsafe_no_auto_barriers=True); see the module docstring
  approx_math: bool = False
  # "linear": per-row 640-byte TMA into a linear slot, re-swizzled by the loader (validated design);
  # "swizzled": five 128-byte TMAs per row straight into 128-byte-swizzled K tiles (no linear slot, no
  # re-swizzle; see "Swizzled gather" in the module docstring). Needs the defaults otherwise.
  k_gather: str = "swizzled"
  # "m": the 64 query rows (heads) are the MMA's M side (S = Q·Kᵀ, O = P·V; H < 64 is padded to 64 rows).
  # "n" (H <= 32, with k_gather="swizzled"): the heads are the MMAs' N side — Sᵀ = K·Qᵀ (m64nN fp8 wgmmas),
  # Oᵀ = Vᵀ·Pᵀ (m64nN f16 wgmmas, Vᵀ the transposed f16 V tile), N = heads_n — so N MMA columns instead of
  # 64 MMA rows per head group. The op picks "n" (and k_buffers=3) for H <= 16 (ops/sparse_decode.py).
  head_axis: str = "m"
  heads_n: int = 16             # head_axis="n": N of the MMAs, H padded to 16 or 32 (the op sets it from H)
  # Consumer warpgroups (the loader is one more). 2, or with head_axis="n" 4 or 5: more warpgroups share the V
  # upcast (V_CHUNK_OWNERS); registers per consumer thread drop to 104 (4) or 80 (5), see _consumer_regs.
  consumers: int = 2
  # head_axis="n": which 128-column chunks of V (0-3) each consumer stages and multiplies, one tuple per consumer
  # (consumer 0 also runs QKᵀ and the softmax); () = V_CHUNK_OWNERS[consumers]. E.g. ((), (0, 1, 2, 3)): consumer
  # 0 only QKᵀ + softmax, consumer 1 all of V.
  v_owners: tuple = ()
  # head_axis="n": keep the softmax's running sums per (key, head) element and sum them down the keys once after
  # the last tile (one cross-warp reduction per tile fewer; a different summation order, same math).
  l_partial: bool = False
  # head_axis="n": a consumer owning 2+ chunks of V stages the first half, waits for Pᵀ, then stages the second
  # half while the P.V wgmmas of the first half run (the upcast overlaps the MMAs instead of preceding them).
  # No effect with v_regs (nothing is staged), except in interpret mode, which stages V even then.
  v_overlap: bool = False
  # head_axis="n": one CTA per SM (``num_ctas`` of build, the op passes the SM count) working through the items
  # (query tile, split) c, c + num_ctas, ... in one pipeline: the next item's Q and indices are prefetched and its
  # first gathers overlap this item's last tiles (see _loader_heads_on_n). Opt-in: on the H200 it measured no
  # faster at (b), H = 16 or s_q = 1 (benchmarks/RESULTS.md runs 17 and 19), although fewer, longer CTAs are faster
  # (benchmarks/sparse_split_length_probe_gpu.py): what a CTA costs per item is not its start-up.
  persistent: bool = False
  # head_axis="n" with consumer 1 owning all of V (v_owners=((), (0, 1, 2, 3))): Vᵀ is the P.V wgmmas' A operand
  # in registers, read from the K tile with 64-bit loads, byte permutes and e4m3x2 -> f16x2 conversions
  # (kernels/vt_registers.py): no f16 V tile in SMEM (64 KB freed: k_buffers=4 fits), no upcast stores, and
  # consumer 1 releases the K buffer as soon as its loads are done. Interpret mode keeps the SMEM upcast.
  v_regs: bool = False
  # Benchmark-only ablations (wrong results!): any of "k_stage", "v_stage" (skip that staging), "hbm" (gather
  # every row from slot 0, so it stays in L2), "qk", "pv" (skip those wgmmas). Used to place time in the kernel.
  ablate: tuple = ()

  def validate(self):
    if self.k_stager not in ("loader", "consumers"):
      raise ValueError(f"TuningConfig.k_stager must be 'loader' or 'consumers'; got {self.k_stager!r}")
    if self.k_stager == "consumers" and self.v_stager != "consumers":
      raise ValueError("TuningConfig.k_stager='consumers' needs v_stager='consumers'")
    if self.k_buffers not in ((1, 2, 3, 4) if self.v_regs else (1, 2, 3)):
      raise ValueError(f"TuningConfig.k_buffers must be 1, 2 or 3 (4 with v_regs); got {self.k_buffers}")
    if self.k_buffers > 1 and (self.k_stager != "loader" or self.v_stager != "consumers"):
      raise ValueError("TuningConfig.k_buffers=2 needs k_stager='loader' and v_stager='consumers'")
    if self.pv_dtype not in ("fp8", "f16"):
      raise ValueError(f"TuningConfig.pv_dtype must be 'fp8' or 'f16'; got {self.pv_dtype!r}")
    if self.pv_dtype == "f16" and self.v_stager != "consumers":
      raise ValueError("TuningConfig.pv_dtype='f16' needs v_stager='consumers'")
    if self.v_stager not in ("loader", "consumers"):
      raise ValueError(f"TuningConfig.v_stager must be 'loader' or 'consumers'; got {self.v_stager!r}")
    if self.k_gather not in ("linear", "swizzled"):
      raise ValueError(f"TuningConfig.k_gather must be 'linear' or 'swizzled'; got {self.k_gather!r}")
    if self.k_gather == "swizzled" and (self.pv_dtype != "f16" or self.k_stager != "loader"
                                        or self.v_stager != "consumers" or self.stages != 1):
      raise ValueError("TuningConfig.k_gather='swizzled' (the default) has no linear ring: it needs "
                       "pv_dtype='f16', k_stager='loader', v_stager='consumers', stages=1; use "
                       "k_gather='linear' for the other arrangements")
    if self.head_axis not in ("m", "n"):
      raise ValueError(f"TuningConfig.head_axis must be 'm' or 'n'; got {self.head_axis!r}")
    if self.head_axis == "n" and self.k_gather != "swizzled":
      raise ValueError("TuningConfig.head_axis='n' needs k_gather='swizzled'")
    if self.heads_n not in HEADS_ON_N:
      raise ValueError(f"TuningConfig.heads_n must be one of {HEADS_ON_N}; got {self.heads_n}")
    allowed = (2,) if self.head_axis != "n" else tuple(range(2, 6)) if self.v_owners else tuple(V_CHUNK_OWNERS)
    if self.consumers not in allowed:
      raise ValueError(f"TuningConfig.consumers must be one of {allowed} (head_axis='n': 2-5 with v_owners, else "
                       f"one of {tuple(V_CHUNK_OWNERS)}); got {self.consumers}")
    if self.v_owners:
      flat = sorted(c for w in self.v_owners for c in w)
      if self.head_axis != "n" or len(self.v_owners) != self.consumers or flat != [0, 1, 2, 3]:
        raise ValueError("TuningConfig.v_owners needs head_axis='n' and one tuple of V chunks per consumer that "
                         f"together hold each of the chunks 0-3 once; got {self.v_owners} for {self.consumers} "
                         "consumers")
    if self.l_partial and self.head_axis != "n":
      raise ValueError("TuningConfig.l_partial needs head_axis='n'")
    if self.v_overlap and self.head_axis != "n":
      raise ValueError("TuningConfig.v_overlap needs head_axis='n'")
    if self.persistent and (self.head_axis != "n" or self.tiles_per_split < 2 * self.k_buffers + 2):
      raise ValueError("TuningConfig.persistent needs head_axis='n' and tiles_per_split >= 2 * k_buffers + 2 (the "
                       f"index prefetch schedule); got head_axis={self.head_axis!r}, tiles_per_split="
                       f"{self.tiles_per_split}, k_buffers={self.k_buffers}")
    if self.v_regs and (self.head_axis != "n" or self.consumers != 2 or self.v_owners != ((), (0, 1, 2, 3))):
      raise ValueError("TuningConfig.v_regs needs head_axis='n', consumers=2 and v_owners=((), (0, 1, 2, 3)); got "
                       f"head_axis={self.head_axis!r}, consumers={self.consumers}, v_owners={self.v_owners}")
    if self.k_buffers >= 3 and self.head_axis != "n":
      raise ValueError(f"TuningConfig.k_buffers={self.k_buffers} needs head_axis='n' (the 64-row Q leaves no SMEM "
                       "for it)")
    self.check_split()
    self.check_smem(smem_budget(self))


def smem_budget(cfg: TuningConfig) -> int:
  if cfg.k_gather == "swizzled":
    rows = _q_rows(cfg)
    return common.smem_bytes(
        ((2 if cfg.persistent else 1, SW_CHUNKS, rows, SW_CHUNK), FP8),   # Q (latent | 0 | rope), per Q buffer
        ((cfg.k_buffers, SW_CHUNKS, TILE, SW_CHUNK), FP8),   # K, gathered straight into the swizzled layout
        ((128,), jnp.uint8) if cfg.v_regs else ((TILE, D_V), jnp.float16),   # V f16 (none with v_regs)
        ((cfg.tiles_per_split, TILE), jnp.int32),            # indices
        ((rows,), jnp.float32),                              # lse staging
        ((128,), jnp.uint8),                                 # placeholder (linear ring)
        ((2, TILE, rows), jnp.float16) if cfg.head_axis == "n" else ((128,), jnp.uint8),   # Pᵀ (head_axis "n")
        ((5, HEAD_ROW), jnp.float32) if cfg.head_axis == "n" else ((128,), jnp.uint8),   # qs, alpha, 1/l ("n")
    ) + 64 * 8 + 2048
  return common.smem_bytes(
      ((N_CHUNKS, TILE, CHUNK), FP8),                      # Q
      ((cfg.stages, TILE, SLOT_CHUNKS, CHUNK), FP8),       # linear ring
      ((cfg.k_buffers, N_CHUNKS, TILE, CHUNK), FP8),       # K swizzled
      ((D_V, TILE), FP8) if cfg.pv_dtype == "fp8" else ((TILE, D_V), jnp.float16),   # V^T fp8 / V f16
      ((2, TILE, TILE), FP8) if cfg.pv_dtype == "fp8" else ((128,), jnp.uint8),      # P (f16: in registers)
      ((cfg.tiles_per_split, TILE), jnp.int32),            # indices
      ((TILE,), jnp.float32),                              # lse staging
  ) + 64 * 8 + 2048   # barriers; Mosaic reduction scratch (CompilerParams default)


def _consumer_regs(cfg: TuningConfig) -> int:
  """Registers per consumer thread after ``setmaxnreg`` (a multiple of 8).

  ``setmaxnreg`` only moves registers within the CTA's launch allocation: R0 per thread for all 128 (consumers + 1)
  threads, R0 = 65536 / threads rounded down to a multiple of 8 (168 with 3 warpgroups, 96 with 5, 80 with 6).
  The loader gives back down to LOADER_REGS and the consumers may take at most what that frees; asking for more
  makes ``setmaxnreg.inc`` wait forever (on the H200, 2026-11-30, 4 consumers at 112 registers hung)."""
  threads = 128 * (cfg.consumers + 1)
  r0 = 65536 // threads // 8 * 8
  return min(256, (r0 * (cfg.consumers + 1) - LOADER_REGS) // cfg.consumers // 8 * 8)


def _q_rows(cfg: TuningConfig) -> int:
  """Query rows a CTA loads and computes: the 64-row tile, or heads_n (the MMAs' N) with head_axis="n"."""
  return cfg.heads_n if cfg.head_axis == "n" else TILE


def _v_owners(cfg: TuningConfig) -> tuple:
  """head_axis="n": the 128-column chunks of V each consumer warpgroup stages and multiplies (P.V)."""
  return cfg.v_owners or V_CHUNK_OWNERS[cfg.consumers]


def _body(cfg: TuningConfig, num_slots: int, tiles_per_token: int, out_dtype, interpret: bool, q_stride: int,
          num_splits: int, num_items: int, num_ctas: int,
          q_gmem, qs_gmem, kv_gmem, idx_gmem, scal_gmem,            # inputs
          o_gmem, lse_gmem,                                         # outputs
          q_sw, lin, k_sw, vt_sw, p_sw, idx_smem, lse_smem, head_smem,   # scratch
          q_bar, idx_bar, lin_full, lin_empty, k_full, k_empty, v_full, v_empty, p_full, p_empty):
  wg = lax.axis_index("wg")
  swz = cfg.k_gather == "swizzled"
  if swz and not interpret:   # the tiled view (wgmma operands) and a swizzle-only view of the same bytes (TMA rows)
    k_sw, k_rows = k_sw
  if cfg.head_axis == "n":
    items = _Items(cfg, num_splits, num_items, num_ctas)
    _loader_heads_on_n(cfg, num_slots, interpret, q_stride, items, wg, q_gmem, qs_gmem, kv_gmem, idx_gmem, q_sw,
                       k_sw, None if interpret else k_rows, idx_smem, head_smem, q_bar, idx_bar, k_full, k_empty)

    @pl.when(wg < cfg.consumers)
    def _():
      _consumer_heads_on_n(cfg, num_slots, out_dtype, interpret, items, wg, scal_gmem, o_gmem, lse_gmem, q_sw,
                           k_sw, vt_sw, p_sw, idx_smem, lse_smem, head_smem, q_bar, idx_bar, k_full, k_empty,
                           p_full, p_empty)
    return

  tile_q = lax.axis_index("q")
  split = lax.axis_index("split")
  token = lax.div(tile_q, tiles_per_token)
  n_tiles = cfg.tiles_per_split
  stages = cfg.stages
  k_buffers = cfg.k_buffers

  @pl.when(wg == cfg.consumers)
  def _loader():
    plgpu.set_max_registers(LOADER_REGS, action="decrease")
    q_width = SW_CHUNK if swz else CHUNK
    for c in range(q_sw.shape[0]):    # Q: 9 boxes of 64 columns, or 5 of 128 (latent | 0 | rope) when swizzled
      plgpu.copy_gmem_to_smem(q_gmem.at[tile_q, :, pl.ds(c * q_width, q_width)], q_sw.at[c], q_bar)
    plgpu.copy_gmem_to_smem(idx_gmem.at[token, pl.ds(split * n_tiles, n_tiles)], idx_smem, idx_bar)
    plgpu.barrier_wait(idx_bar)
    if swz:
      _swizzled_loader(cfg, num_slots, interpret, kv_gmem, k_sw, None if interpret else k_rows, idx_smem, k_full,
                       k_empty)
      return

    def gather(t, slot):
      row_of = (lambda r: 0) if 'hbm' in cfg.ablate else (lambda r: common.safe_row(idx_smem[t, r], num_slots))
      common.gather_rows(kv_gmem, row_of, lin.at[slot], lin_full.at[slot], tile=TILE)

    for t0 in range(min(stages, n_tiles)):      # prologue: fill the ring
      gather(t0, t0)

    if cfg.k_stager == "consumers":
      # The consumers stage K themselves; the loader only refills a slot once both have staged it.
      @pl.loop(0, max(n_tiles - stages, 0))
      def _(t):
        slot = lax.rem(t, stages)
        plgpu.barrier_wait(lin_empty.at[slot])
        gather(t + stages, slot)
      common.drain(lin_empty, n_tiles, stages)
    elif cfg.v_stager == "loader":
      @pl.loop(0, n_tiles)
      def _(t):
        slot = lax.rem(t, stages)
        plgpu.barrier_wait(lin_full.at[slot])

        @pl.when(t > 0)
        def _():
          plgpu.barrier_wait(k_empty.at[0])
        if 'k_stage' not in cfg.ablate:
          common.stage_k(lin.at[slot], k_sw.at[0])
        plgpu.commit_smem()
        plgpu.barrier_arrive(k_full.at[0])

        @pl.when(t > 0)
        def _():
          plgpu.barrier_wait(v_empty)
        if 'v_stage' not in cfg.ablate:
          common.stage_vt(k_sw.at[0], vt_sw)
        plgpu.commit_smem()   # fence + warpgroup barrier: every thread has read the slot before it is refilled
        plgpu.barrier_arrive(v_full)

        @pl.when(t + stages < n_tiles)
        def _():
          gather(t + stages, slot)

      plgpu.barrier_wait(k_empty.at[0])     # drain: observe the consumers' last releases (interpret-mode rule)
      plgpu.barrier_wait(v_empty)
    else:
      # Consumers transpose their own V half (from the swizzled K tiles) while their QK wgmma runs, so the linear
      # slot is free as soon as K is staged, and it is refilled right away. With k_buffers=2 the next K
      # re-swizzle overlaps the consumers' work on this one.
      @pl.loop(0, n_tiles)
      def _(t):
        slot = lax.rem(t, stages)
        kb = lax.rem(t, k_buffers)
        plgpu.barrier_wait(lin_full.at[slot])

        @pl.when(t >= k_buffers)
        def _():
          plgpu.barrier_wait(k_empty.at[kb])
        if 'k_stage' not in cfg.ablate:
          common.stage_k(lin.at[slot], k_sw.at[kb])
        plgpu.commit_smem()   # fence + warpgroup barrier: every thread has read the slot before it is refilled
        plgpu.barrier_arrive(k_full.at[kb])

        @pl.when(t + stages < n_tiles)
        def _():
          gather(t + stages, slot)

      common.drain(k_empty, n_tiles, k_buffers)

  @pl.when(wg < 2)
  def _consumer():
    plgpu.set_max_registers(CONSUMER_REGS, action="increase")
    row_layout = plgpu.Layout.WGMMA.reduce(1)
    col_layout = plgpu.Layout.WGMMA.reduce(0)
    plgpu.barrier_wait(q_bar)
    plgpu.barrier_wait(idx_bar)
    row_scale = plgpu.load(qs_gmem.at[tile_q], layout=row_layout, optimized=False)
    kv_scale = scal_gmem[0]

    def step(t, carry):
      acc, m, l = carry
      if cfg.k_stager == "consumers":   # each consumer re-swizzles half of K, then both meet on k_full
        slot = lax.rem(t, stages)
        plgpu.barrier_wait(lin_full.at[slot])

        @pl.when(t > 0)
        def _():
          plgpu.barrier_wait(k_empty.at[0])
        for w in range(2):
          @pl.when(wg == w)
          def _():
            if 'k_stage' not in cfg.ablate:
              common.stage_k(lin.at[slot], k_sw.at[0], chunks=range(w * 5, min(w * 5 + 5, N_CHUNKS)))
        plgpu.commit_smem()
        plgpu.barrier_arrive(lin_empty.at[slot])
        plgpu.barrier_arrive(k_full.at[0])
      kb = lax.rem(t, k_buffers)
      k_tiles = k_sw.at[kb]
      plgpu.barrier_wait(k_full.at[kb])

      def qk(acc_ref):
        for c in range((SW_CHUNKS if swz else N_CHUNKS) if 'qk' not in cfg.ablate else 0):
          plgpu.wgmma(acc_ref, q_sw.at[c], k_tiles.at[c].T)
        if cfg.v_stager == "consumers":   # overlap the V transpose with the asynchronous QK wgmma
          for w in range(2):
            @pl.when(wg == w)
            def _():
              if 'v_stage' not in cfg.ablate:
                if swz:     # 128-wide chunks: this consumer's 256 columns are chunks 2w, 2w + 1
                  common.stage_v16(k_tiles, vt_sw, chunks=range(2 * w, 2 * w + 2), width=SW_CHUNK)
                elif cfg.pv_dtype == "fp8":
                  common.stage_vt(k_tiles, vt_sw, chunks=range(w * 4, w * 4 + 4))
                else:
                  common.stage_v16(k_tiles, vt_sw, chunks=range(w * 4, w * 4 + 4))
          plgpu.commit_smem()
        return acc_ref[...]
      s = pl.run_scoped(qk, plgpu.ACC((TILE, TILE), jnp.float32))
      plgpu.barrier_arrive(k_empty.at[kb])

      cols = plgpu.load(idx_smem.at[t], layout=col_layout, optimized=False)
      p, alpha, m_new, l = common.online_softmax_tile(s, common.valid_keys(cols, num_slots), row_scale, m, l)
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      if cfg.pv_dtype == "fp8":
        p_sw.at[wg][...] = (p * P_SCALE).astype(FP8)
        plgpu.commit_smem()
        p_op, v_op = p_sw.at[wg], vt_sw.at[pl.ds(wg * 256, 256)].T
      else:
        p_op, v_op = p.astype(jnp.float16), vt_sw.at[:, pl.ds(wg * 256, 256)]
        if interpret:     # the interpreter has no wgmma with A in registers: P goes through SMEM there
          p_sw.at[wg][...] = p_op
          plgpu.commit_smem()
          p_op = p_sw.at[wg]
      if cfg.v_stager == "loader":
        plgpu.barrier_wait(v_full)

      def pv(acc_refs):
        if 'pv' not in cfg.ablate:
          plgpu.wgmma(acc_refs[0], p_op, v_op)
      (acc,) = _accumulate(pv, (acc,), interpret)
      if cfg.v_stager == "loader":
        plgpu.barrier_arrive(v_empty)
      return acc, m_new, l

    acc0 = plgpu.layout_cast(jnp.zeros((TILE, 256), jnp.float32), plgpu.Layout.WGMMA)
    m0 = plgpu.layout_cast(jnp.full((TILE,), -jnp.inf, jnp.float32), row_layout)
    l0 = plgpu.layout_cast(jnp.zeros((TILE,), jnp.float32), row_layout)
    acc, m, l = lax.fori_loop(0, n_tiles, step, (acc0, m0, l0))
    if cfg.k_stager == "consumers":
      plgpu.barrier_wait(k_empty.at[0])     # drain: observe the other consumer's last release

    l_safe = jnp.where(l == 0.0, 1.0, l)
    inv = kv_scale / ((P_SCALE if cfg.pv_dtype == "fp8" else 1.0) * l_safe)
    out = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
    o_gmem.at[tile_q, split, :, pl.ds(wg * 256, 256)][...] = out.astype(out_dtype)
    _store_lse(wg, m, l, lse_smem, lse_gmem.at[tile_q, split])


class _Items:
  """head_axis="n": the work items (query tile, split) a CTA processes. Default: one, the CTA's grid position
  (grid (q, split)). ``persistent``: grid (num_ctas,), CTA c takes items c, c + num_ctas, ... (item = tile_q ·
  num_splits + split), one after the other through the same pipeline.

  Index rows arrive in ``parts``: two halves per item when persistent (the loader refills each half for the next
  item as soon as consumer 0 has read the masks of this item's half), one block otherwise. ``n_qbuf`` Q buffers
  (2 when persistent: the next item's Q lands while this one's is in use)."""

  def __init__(self, cfg, num_splits, num_items, num_ctas):
    t = cfg.tiles_per_split
    self.num_splits = num_splits
    self.persistent = cfg.persistent
    if cfg.persistent:   # (axis indices are read where they are used: inside each warpgroup's code)
      self.count = lambda: lax.div(num_items - lax.axis_index("cta") + num_ctas - 1, jnp.int32(num_ctas))
      self.item = lambda j: lax.axis_index("cta") + j * num_ctas
      self.parts = ((0, t // 2), (t // 2, t))
      self.n_qbuf = 2
    else:
      self.count = lambda: 1
      self.parts = ((0, t),)
      self.n_qbuf = 1

  def position(self, j):
    """(tile_q, split) of this CTA's item j."""
    if not self.persistent:
      return lax.axis_index("q"), lax.axis_index("split")
    item = self.item(j)
    return lax.div(item, jnp.int32(self.num_splits)), lax.rem(item, jnp.int32(self.num_splits))

  def qbuf(self, j):
    return lax.rem(j, 2) if self.n_qbuf == 2 else 0

  @staticmethod
  def pick(ref, i, n):
    """ref.at[i] when ref holds n > 1 buffers / barriers, else ref itself."""
    return ref.at[i] if n > 1 else ref

  def wait_indices(self, t, idx_bar):
    """At tile t of an item: wait for the index part that starts there."""
    for part, (lo, _) in enumerate(self.parts):
      @pl.when(t == lo)
      def _():
        plgpu.barrier_wait(self.pick(idx_bar, part, len(self.parts)))


def _for_items(items, body):
  """body(j, None) for each of the CTA's items (a Python call when there is exactly one)."""
  count = items.count()
  if isinstance(count, int):
    for j in range(count):
      body(j, None)
  else:
    lax.fori_loop(0, count, body, None)


def _loader_heads_on_n(cfg, num_slots, interpret, q_stride, items, wg, q_gmem, qs_gmem, kv_gmem, idx_gmem, q_sw,
                       k_sw, k_rows, idx_smem, head_smem, q_bar, idx_bar, k_full, k_empty):
  """Loader of head_axis="n": per item, Q (heads_n flat rows from row tile_q · q_stride, five 128-column boxes) and
  the heads' logit scales (a 128-byte box into head_smem row ``qbuf``), both on ``q_bar[qbuf]``; the item's
  indices (``items.parts``, on ``idx_bar[part]``); then the swizzled gathers of every tile of every item.

  Persistent prefetch schedule, at tile t of item j (after the loader has waited for the K buffer of tile t, i.e.
  consumer 0 has finished QKᵀ of tile t - k_buffers of this CTA and read every mask before it):
    t == k_buffers:            indices of j, second half (consumer 0 is past item j - 1), and Q / scales of j + 1
                               into the other Q buffer (consumer 0 is past item j - 1's QKᵀ);
    t == T/2 + k_buffers:      indices of j + 1, first half (consumer 0 is past the first half of item j).
  So the next item's first gathers never wait for an index load (TuningConfig.validate: T >= 2 k_buffers + 2)."""
  n_tiles = cfg.tiles_per_split
  kbuf = cfg.k_buffers
  rows = _q_rows(cfg)

  @pl.when(wg == cfg.consumers)
  def _():
    plgpu.set_max_registers(LOADER_REGS, action="decrease")

    def load_q(j):
      tile_q, _ = items.position(j)
      qb = items.qbuf(j)
      bar = items.pick(q_bar, qb, items.n_qbuf)
      plgpu.copy_gmem_to_smem(qs_gmem.at[pl.ds(tile_q * q_stride, HEAD_ROW)], head_smem.at[qb], bar)
      q_rows = q_gmem.at[pl.ds(tile_q * q_stride, rows)]
      for c in range(SW_CHUNKS):
        plgpu.copy_gmem_to_smem(q_rows.at[:, pl.ds(c * SW_CHUNK, SW_CHUNK)],
                                items.pick(q_sw, qb, items.n_qbuf).at[c], bar)

    def load_indices(j, part):
      tile_q, split = items.position(j)    # head_axis="n": one query tile per token
      lo, hi = items.parts[part]
      plgpu.copy_gmem_to_smem(idx_gmem.at[tile_q, pl.ds(split * n_tiles + lo, hi - lo)],
                              idx_smem.at[pl.ds(lo, hi - lo)], items.pick(idx_bar, part, len(items.parts)))

    load_q(0)
    for part in range(len(items.parts)):
      load_indices(0, part)

    def before_gather(g):
      j, t = lax.div(g, n_tiles), lax.rem(g, n_tiles)
      if items.persistent:
        half = items.parts[1][0]

        @pl.when((t == kbuf) & (j >= 1))
        def _():
          load_indices(j, 1)

        @pl.when((t == kbuf) & (j + 1 < items.count()))
        def _():
          load_q(j + 1)

        @pl.when((t == half + kbuf) & (j + 1 < items.count()))
        def _():
          load_indices(j + 1, 0)
      items.wait_indices(t, idx_bar)

    _swizzled_loader(cfg, num_slots, interpret, kv_gmem, k_sw, k_rows, idx_smem, k_full, k_empty,
                     n_steps=items.count() * n_tiles, before_gather=before_gather)


def _consumer_heads_on_n(cfg, num_slots, out_dtype, interpret, items, wg, scal_gmem, o_gmem, lse_gmem, q_sw,
                         k_sw, v16, p_sw, idx_smem, lse_smem, head_smem, q_bar, idx_bar, k_full, k_empty, p_full,
                         p_empty):
  """Consumers of head_axis="n" (H <= N = heads_n, 16 or 32): the heads on the MMAs' N side, everything transposed.

  Per 64-key tile, consumer 0 (WG0) computes Sᵀ [64 keys, N] = K · Qᵀ (five m64nNk128 fp8 wgmmas: A = the
  swizzled K chunk, K-major; B = Q's N rows, K-major) while it stages its chunks of V as f16 (if it owns any),
  releases the K buffer, runs the online softmax down the columns (keys_axis=0; masked keys are rows) and hands Pᵀ
  (f16 [64 keys, N]) and alpha ([N] f32) to the other consumers through the SMEM buffer ``g % 2`` (g: the CTA's
  tile count; ``p_full``; each of them frees it on ``p_empty``). Consumers 1.. stage their chunks of V
  (``_v_owners``: 128 columns of d each; with v_overlap half of them under the P.V wgmmas) and release the K buffer,
  then wait for Pᵀ. Each accumulates Oᵀ[d-block] += Vᵀ[d-block] · Pᵀ for the 64-wide blocks of d of its chunks
  (m64nNk16 f16 wgmmas: A = the transposed f16 V tile, its swizzle matching Pᵀ's 2N-byte rows). After an item's
  last tile consumer 0 hands over kv_scale / l (``p_full[2]``) and writes lse; every consumer writes its blocks of
  O [out_heads, 512] (a transposed store). ``head_smem`` rows: [0, n_qbuf) the heads' logit scales per Q buffer
  (TMA, on ``q_bar``), then alpha of P buffer 0 / 1, then kv_scale / l.

  ``v_regs`` (consumer 1 owns all of V): consumer 1 loads its bytes of V from the K buffer into registers, releases
  the buffer, waits for Pᵀ and runs the P.V wgmmas with Vᵀ as a register A operand (``vt_registers``); its Oᵀ
  blocks hold the latent columns g, g + 8, ... (block g), stored as 16-byte rows by ``vt_registers.store_o``.

  Why one softmax, not one per consumer: the softmax reduces Sᵀ down its rows, i.e. across the 4 warps, and Mosaic
  GPU's cross-warp reductions all use one SMEM scratch at a fixed offset, shared by every warpgroup. Two consumers
  reducing at the same time corrupt each other's partial maxima / sums: on the H200 the first version (both
  consumers ran the same softmax) failed at N = 32 (cosine 0.988) although interpret mode and N = 16 passed.
  """
  plgpu.set_max_registers(_consumer_regs(cfg), action="increase")
  n = _q_rows(cfg)                              # heads_n: the MMAs' N
  key_layout = plgpu.Layout.WGMMA.reduce(1)     # [64]: one value per key (row of Sᵀ)
  head_layout = plgpu.Layout.WGMMA.reduce(0)    # [n]: one value per head (column of Sᵀ)
  n_tiles = cfg.tiles_per_split
  owners = _v_owners(cfg)
  out_heads = o_gmem.shape[-2]                  # heads stored (<= n): O [.., out_heads, 512], written transposed
  blocks_per_chunk = SW_CHUNK // TILE
  alpha_row = items.n_qbuf                      # head_smem rows alpha_row + pb: alpha; alpha_row + 2: kv_scale / l
  n_steps = items.count() * n_tiles
  v_regs = cfg.v_regs and not interpret   # interpret mode has no inline_mgpu: it keeps the SMEM upcast

  def blocks(w):     # consumer w's 64-wide blocks of d
    return [c * blocks_per_chunk + i for c in owners[w] for i in range(blocks_per_chunk)]

  def acc0(w):
    return (plgpu.layout_cast(jnp.zeros((TILE, n), jnp.float32), plgpu.Layout.WGMMA),) * len(blocks(w))

  def stage_v(k_tiles, w, chunks=None):    # consumer w's chunks of V (or ``chunks`` of them) as f16
    chunks = owners[w] if chunks is None else chunks
    if 'v_stage' not in cfg.ablate and chunks:
      common.stage_v16(k_tiles, v16, chunks=chunks, width=SW_CHUNK)

  def groups(w):   # v_overlap: w's chunks in two halves, the first staged before P.V starts, the second under the
    chunks = owners[w]   # wgmmas of the first (each chunk in a group of its own measured no faster, run 17)
    if not (cfg.v_overlap and len(chunks) >= 2):
      return [chunks]
    return [chunks[:len(chunks) // 2], chunks[len(chunks) // 2:]]

  def pv_step(g, accs, alpha, w, mids=None):   # rescale, then Oᵀ[w's d-blocks] += Vᵀ · Pᵀ(g), waited for;
    if not accs:                                # ``mids``: {block index: fn}, fn() runs before that block's wgmma
      return accs
    accs = tuple(a * lax.broadcast_in_dim(alpha, a.shape, [1]) for a in accs)
    mids = mids or {}

    def pv(refs):
      for i, (b, ref) in enumerate(zip(blocks(w), refs)):
        if i in mids:
          mids[i]()
        if 'pv' not in cfg.ablate:
          plgpu.wgmma(ref, v16.at[:, pl.ds(b * TILE, TILE)].T, p_sw.at[lax.rem(g, 2)])
    return _accumulate(pv, accs, interpret)

  def store(accs, inv, w, j):   # Oᵀ block [64 d, n] -> O[:out_heads, 64 d] (a transposed GMEM view; the WGMMA
    tile_q, split = items.position(j)   # layout cannot be stored transposed, its vector-length-1 twin can)
    if v_regs and w == 1:    # block b holds the latent columns b, b + 8, ..., b + 504: 16-byte row stores
      vt_registers.store_o([a * lax.broadcast_in_dim(inv, a.shape, [1]) for a in accs], o_gmem.at[tile_q, split])
      return
    for b, a in zip(blocks(w), accs):
      out = plgpu.layout_cast(a * lax.broadcast_in_dim(inv, a.shape, [1]), plgpu.Layout._WGMMA_ACC_32BIT)
      o_gmem.at[tile_q, split, :, pl.ds(b * TILE, TILE)].T[...] = out.astype(out_dtype)[:, :out_heads]

  @pl.when(wg == 0)
  def _softmax_consumer():
    def item(j, _):
      qb = items.qbuf(j)
      q_tiles = items.pick(q_sw, qb, items.n_qbuf)
      plgpu.barrier_wait(items.pick(q_bar, qb, items.n_qbuf))
      head_scale = plgpu.load(head_smem.at[qb, pl.ds(0, n)], layout=head_layout, optimized=False)

      def step(t, carry):
        accs, m, l = carry
        g = j * n_tiles + t
        kb = lax.rem(g, cfg.k_buffers)
        pb = lax.rem(g, 2)
        k_tiles = k_sw.at[kb]
        items.wait_indices(t, idx_bar)
        plgpu.barrier_wait(k_full.at[kb])

        def qk(acc_ref):
          for c in range(SW_CHUNKS if 'qk' not in cfg.ablate else 0):
            plgpu.wgmma(acc_ref, k_tiles.at[c], q_tiles.at[c].T)
          if owners[0]:
            stage_v(k_tiles, 0)    # while the wgmmas run
            plgpu.commit_smem()
          return acc_ref[...]
        st = pl.run_scoped(qk, plgpu.ACC((TILE, n), jnp.float32))
        plgpu.barrier_arrive(k_empty.at[kb])

        keys = plgpu.load(idx_smem.at[t], layout=key_layout, optimized=False)
        p, alpha, m_new, l = common.online_softmax_tile(st, common.valid_keys(keys, num_slots), head_scale, m, l,
                                                        keys_axis=0)

        @pl.when(g >= 2)
        def _():
          plgpu.barrier_wait(p_empty.at[pb])   # the other consumers are done with buffer pb (tile g - 2)
        p_sw.at[pb][...] = p.astype(jnp.float16)
        head_smem.at[alpha_row + pb, pl.ds(0, n)][...] = alpha
        plgpu.commit_smem()
        plgpu.barrier_arrive(p_full.at[pb])
        return pv_step(g, accs, alpha, 0), m_new, l

      m0 = plgpu.layout_cast(jnp.full((n,), -jnp.inf, jnp.float32), head_layout)
      if cfg.l_partial:   # running sums per (key row, head), summed down the keys once after the last tile
        l0 = plgpu.layout_cast(jnp.zeros((TILE, n), jnp.float32), plgpu.Layout.WGMMA)
      else:
        l0 = plgpu.layout_cast(jnp.zeros((n,), jnp.float32), head_layout)
      accs, m, l = lax.fori_loop(0, n_tiles, step, (acc0(0), m0, l0))
      if cfg.l_partial:
        l = l.sum(axis=0)
      inv = scal_gmem[0] / jnp.where(l == 0.0, 1.0, l)
      head_smem.at[alpha_row + 2, pl.ds(0, n)][...] = inv
      plgpu.commit_smem()
      plgpu.barrier_arrive(p_full.at[2])
      store(accs, inv, 0, j)
      tile_q, split = items.position(j)
      _store_lse(wg, m, l, lse_smem, lse_gmem.at[tile_q, split])

    _for_items(items, item)
    common.drain(p_empty, n_steps, 2)

  for w in range(1, cfg.consumers):
    @pl.when(wg == w)
    def _pv_consumer():
      grouped = groups(w)

      def item(j, _):
        def step_regs(t, accs):   # v_regs: Vᵀ straight from the K tile into registers (vt_registers)
          g = j * n_tiles + t
          kb = lax.rem(g, cfg.k_buffers)
          pb = lax.rem(g, 2)
          plgpu.barrier_wait(k_full.at[kb])
          words = vt_registers.load_v_words(k_sw.at[kb])
          plgpu.barrier_arrive(k_empty.at[kb])
          plgpu.barrier_wait(p_full.at[pb])
          alpha = plgpu.load(head_smem.at[alpha_row + pb, pl.ds(0, n)], layout=head_layout, optimized=False)
          accs = tuple(a * lax.broadcast_in_dim(alpha, a.shape, [1]) for a in accs)
          if 'pv' not in cfg.ablate:
            accs = vt_registers.pv_wgmmas(words, p_sw.at[pb], accs, 2 * n)
          plgpu.barrier_arrive(p_empty.at[pb])
          return accs

        def step(t, accs):
          g = j * n_tiles + t
          kb = lax.rem(g, cfg.k_buffers)
          pb = lax.rem(g, 2)
          plgpu.barrier_wait(k_full.at[kb])

          def stage_group(k):   # group k of w's V chunks; the K buffer is released after the last group
            stage_v(k_sw.at[kb], w, grouped[k])
            plgpu.commit_smem()
            if k == len(grouped) - 1:
              plgpu.barrier_arrive(k_empty.at[kb])
          stage_group(0)
          plgpu.barrier_wait(p_full.at[pb])
          alpha = plgpu.load(head_smem.at[alpha_row + pb, pl.ds(0, n)], layout=head_layout, optimized=False)
          starts = [sum(len(c) for c in grouped[:k]) * blocks_per_chunk for k in range(len(grouped))]
          mids = {starts[k]: functools.partial(stage_group, k) for k in range(1, len(grouped))}
          accs = pv_step(g, accs, alpha, w, mids=mids)
          plgpu.barrier_arrive(p_empty.at[pb])
          return accs

        accs = lax.fori_loop(0, n_tiles, step_regs if v_regs else step, acc0(w))
        plgpu.barrier_wait(p_full.at[2])
        store(accs, plgpu.load(head_smem.at[alpha_row + 2, pl.ds(0, n)], layout=head_layout, optimized=False),
              w, j)

      _for_items(items, item)


def _accumulate(issue, accs, interpret):
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


def _store_lse(wg, m, l, lse_smem, lse_dst):
  """Consumer 0 writes the split's lse = (m + log2 l) · ln 2 (natural log) through SMEM and one TMA (of the first
  ``lse_dst.shape[0]`` rows)."""
  @pl.when(wg == 0)
  def _():
    lse_smem[...] = (m + jnp.log2(l)) * LN2
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, lse_dst.shape[0])], lse_dst)
    plgpu.wait_smem_to_gmem(0)


def _swizzled_loader(cfg, num_slots, interpret, kv_gmem, k_sw, k_rows, idx_smem, k_full, k_empty, n_steps=None,
                     before_gather=lambda g: None):
  """Gathers of ``k_gather="swizzled"`` (after the loader has loaded Q and the split's indices): per 64-key tile,
  five 128-byte TMAs per row straight into the 128-byte-swizzled K tiles of buffer ``t % k_buffers`` (arriving
  on ``k_full``), once the consumers have released it (``k_empty``).

  On hardware a row lands through ``k_rows``, a swizzle-only view [k_buffers, 5, 8, 8, 128] of the same bytes as
  the tiled ``k_sw`` [k_buffers, 5, 64, 128] (a ``RefUnion``): the TMA unit applies the 128-byte swizzle from the
  destination address, so a one-row box lands where the tiled view expects it. Interpret mode keeps the members of
  a ``RefUnion`` apart, so there the rows are copied into one-row slices of ``k_sw`` itself.

  ``n_steps`` (default tiles_per_split): tiles gathered in all, step g from idx_smem row g % tiles_per_split (a
  persistent CTA's items one after the other); ``before_gather(g)`` runs after buffer g % k_buffers is free and
  before step g's gather (the persistent kernel's index / Q prefetches).
  """
  n_tiles = cfg.tiles_per_split
  k_buffers = cfg.k_buffers
  n_steps = n_tiles if n_steps is None else n_steps

  def gather(t, kb):
    def issue_row(r):
      row = kv_gmem.at[pl.ds(common.safe_row(idx_smem[t, r], num_slots), 1)]
      for c in range(SW_CHUNKS):
        src = row.at[:, pl.ds(c * SW_CHUNK if c < SW_CHUNKS - 1 else SW_TAIL_COL, SW_CHUNK)]
        if interpret:
          dst = k_sw.at[kb, c, pl.ds(r, 1)]
        else:
          dst = k_rows.at[kb, c, lax.div(r, 8), pl.ds(lax.rem(r, 8), 1)]
        plgpu.copy_gmem_to_smem(src, dst, k_full.at[kb])
    common.for_rows_per_warp(TILE, issue_row)

  @pl.loop(0, n_steps)
  def _(g):
    kb = lax.rem(g, k_buffers)

    @pl.when(g >= k_buffers)
    def _():
      plgpu.barrier_wait(k_empty.at[kb])
    before_gather(g)
    gather(lax.rem(g, n_tiles), kb)

  common.drain(k_empty, n_steps, k_buffers)


def _q_lin_k_scratch(cfg, interpret):
  """Scratch for Q, the linear ring and K: [Q, lin, K] (K a RefUnion of two views for k_gather="swizzled")."""
  if cfg.k_gather == "swizzled":
    k_tiled = plgpu.SMEM((cfg.k_buffers, SW_CHUNKS, TILE, SW_CHUNK), FP8, transforms=swizzled(FP8, SW_CHUNK))
    k_rows = plgpu.SMEM((cfg.k_buffers, SW_CHUNKS, TILE // 8, 8, SW_CHUNK), FP8,
                        transforms=(plgpu.SwizzleTransform(SW_CHUNK),))
    q_shape = (SW_CHUNKS, _q_rows(cfg), SW_CHUNK)
    if cfg.persistent:      # two Q buffers: the next item's Q lands while this one's is in use
      q_shape = (2,) + q_shape
    return [plgpu.SMEM(q_shape, FP8, transforms=swizzled(FP8, SW_CHUNK)),                      # Q
            plgpu.SMEM((128,), jnp.uint8),                                                       # (no linear ring)
            k_tiled if interpret else plgpu.RefUnion(k_tiled, k_rows)]                           # K
  return [plgpu.SMEM((N_CHUNKS, TILE, CHUNK), FP8, transforms=swizzled(FP8, 64)),             # Q
          plgpu.SMEM((cfg.stages, TILE, SLOT_CHUNKS, CHUNK), FP8),                             # linear ring
          plgpu.SMEM((cfg.k_buffers, N_CHUNKS, TILE, CHUNK), FP8, transforms=swizzled(FP8, 64))]   # K


def _v_scratch(cfg, interpret):
  if cfg.v_regs and not interpret:
    return plgpu.SMEM((128,), jnp.uint8)     # unused placeholder: Vᵀ goes from the K tile to registers
  if cfg.pv_dtype == "fp8":
    return plgpu.SMEM((D_V, TILE), FP8, transforms=swizzled(FP8, 64))
  # head_axis="n": Vᵀ is the A operand of a wgmma whose B (Pᵀ, N f16 = 2N-byte rows) fixes the swizzle at 2N.
  swizzle = 2 * cfg.heads_n if cfg.head_axis == "n" else 128
  return plgpu.SMEM((TILE, D_V), jnp.float16, transforms=swizzled(jnp.float16, swizzle))


def _p_scratch(cfg, interpret):
  if cfg.head_axis == "n":   # Pᵀ [64 keys, heads_n] f16, buffer t % 2 (MN-major B of the Oᵀ wgmmas)
    return plgpu.SMEM((2, TILE, cfg.heads_n), jnp.float16, transforms=swizzled(jnp.float16, 2 * cfg.heads_n))
  if cfg.pv_dtype == "fp8":
    return plgpu.SMEM((2, TILE, TILE), FP8, transforms=swizzled(FP8, 64))
  if interpret:
    return plgpu.SMEM((2, TILE, TILE), jnp.float16, transforms=swizzled(jnp.float16, 128))
  return plgpu.SMEM((128,), jnp.uint8)     # unused placeholder: on hardware f16 P stays in registers


@functools.lru_cache(maxsize=64)
def build(num_q_tiles: int, num_tokens: int, num_slots: int, num_splits: int, tiles_per_token: int,
          out_dtype_name: str, cfg: TuningConfig, interpret=False, out_heads: int | None = None,
          q_stride: int | None = None, num_ctas: int | None = None):
  """Build the kernel for given shapes.

  Kernel arguments:
    q8   [num_q_tiles, 64, 576] fp8: quantized query rows (tile = token · tiles_per_token + head_block);
         k_gather="swizzled": [num_q_tiles, 64, 640] = latent (512) | 64 zeros | rope (64).
         head_axis="n": flat rows [num_q_tiles · q_stride, 640] (q_stride = the token's heads, default heads_n):
         the CTA of tile q reads rows [q · q_stride, q · q_stride + heads_n). With q_stride < heads_n the rows
         past the token's own are the next token's heads (or zero-filled past the end): they only feed MMA
         columns whose results are never stored (every column of Sᵀ, P and Oᵀ is computed independently).
    qs   [num_q_tiles, 64] f32: per-row logit scale (q_scale · softmax_scale · log2 e; kv_scale folded in too);
         head_axis="n": flat [num_q_tiles · q_stride], read by a TMA (zero-filled past the end).
    kv   [num_slots · 9, 64] fp8: the cache (free reshape of [num_slots, 576]); k_gather="swizzled":
         [num_slots, 576].
    idx  [num_tokens, num_splits · tiles_per_split, 64] int32: row ids; any id outside [0, num_slots) is an
         invalid key (masked; gathered as row num_slots, past the end, so the TMA zero-fills it).
    scal [1] f32: kv_scale (multiplies the output).
  Returns (o [num_q_tiles, num_splits, 64, 512] out_dtype, lse [num_q_tiles, num_splits, 64] f32 natural log),
  each split's output normalised by its own softmax sum (merge splits by lse). head_axis="n": o holds the first
  ``out_heads`` rows (default heads_n; a multiple of 8), [num_q_tiles, num_splits, out_heads, 512], and lse is
  [num_q_tiles, num_splits, out_heads].
  """
  out_dtype = jnp.dtype(out_dtype_name)
  out_heads = cfg.heads_n if out_heads is None else out_heads
  q_stride = cfg.heads_n if q_stride is None else q_stride
  if cfg.head_axis == "n" and not (0 < out_heads <= cfg.heads_n and out_heads % 8 == 0):
    raise ValueError(f"out_heads must be a multiple of 8 in (0, heads_n={cfg.heads_n}]; got {out_heads}")
  n_tiles = cfg.tiles_per_split
  swz = cfg.k_gather == "swizzled"
  num_items = num_q_tiles * num_splits
  num_ctas = min(num_items, num_ctas or 132) if cfg.persistent else num_items
  body = functools.partial(_body, cfg, num_slots, tiles_per_token, out_dtype, bool(interpret), q_stride,
                           num_splits, num_items, num_ctas)
  n_qbuf = 2 if cfg.persistent else 1
  kwargs = common.interpret_kwargs(interpret)
  return plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((num_q_tiles, num_splits, out_heads, D_V) if cfg.head_axis == "n" else
                                     (num_q_tiles, num_splits, TILE, D_V), out_dtype),
                jax.ShapeDtypeStruct((num_q_tiles, num_splits, out_heads if cfg.head_axis == "n" else TILE),
                                     jnp.float32)),
      grid=(num_ctas,) if cfg.persistent else (num_q_tiles, num_splits),
      grid_names=("cta",) if cfg.persistent else ("q", "split"),
      num_threads=cfg.consumers + 1, thread_name="wg",
      scratch_types=_q_lin_k_scratch(cfg, bool(interpret)) + [
          _v_scratch(cfg, bool(interpret)),                                              # V^T (fp8) / V (f16)
          _p_scratch(cfg, bool(interpret)),                                              # P
          plgpu.SMEM((n_tiles, TILE), jnp.int32),                                        # indices
          plgpu.SMEM((_q_rows(cfg),), jnp.float32),                                      # lse
          plgpu.SMEM((n_qbuf + 3, HEAD_ROW), jnp.float32) if cfg.head_axis == "n" else
          plgpu.SMEM((128,), jnp.uint8),      # head_axis "n": qs (per Q buffer), alpha (2 buffers), kv_scale / l
          plgpu.Barrier(num_arrivals=(SW_CHUNKS + (cfg.head_axis == "n")) if swz else N_CHUNKS,
                        num_barriers=2 if cfg.persistent else ()),   # q_bar (+ qs), per Q buffer
          plgpu.Barrier(num_barriers=2 if cfg.persistent else ()),   # idx_bar (persistent: per half of the indices)
          plgpu.Barrier(num_arrivals=TILE, num_barriers=cfg.stages),   # lin_full
          plgpu.Barrier(num_arrivals=2, num_barriers=cfg.stages),   # lin_empty (k_stager="consumers")
          plgpu.Barrier(num_arrivals=SW_CHUNKS * TILE if swz else 2 if cfg.k_stager == "consumers" else 1,
                        num_barriers=cfg.k_buffers),             # k_full
          plgpu.Barrier(num_arrivals=cfg.consumers, num_barriers=cfg.k_buffers),   # k_empty
          plgpu.Barrier(),                                       # v_full
          plgpu.Barrier(num_arrivals=2),                         # v_empty
          plgpu.Barrier(num_barriers=3),                         # p_full (head_axis "n": P^T, alpha; [2]: 1/l)
          plgpu.Barrier(num_arrivals=cfg.consumers - 1, num_barriers=2),   # p_empty (head_axis "n")
      ],
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE,
                                           unsafe_no_auto_barriers=not cfg.auto_barriers,
                                           approx_math=cfg.approx_math),
      **kwargs,
  )
