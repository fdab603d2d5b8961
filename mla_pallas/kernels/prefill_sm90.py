"""Varlen prefill attention with an FP8 QKᵀ for sm_90a: the Mosaic GPU kernel of ``mla_prefill``.

One CTA computes one (query tile, head): a query tile is up to 128 consecutive query tokens of one sequence
(two consumer warpgroups of 64 rows), and it attends that sequence's keys in blocks of ``block_kv``:

    S  = Q8 · K8ᵀ                 fp8 wgmma (e4m3 x e4m3, K = Dqk, 64-byte swizzle), f32 accumulate
    S' = S · qs[h, i] · ks[h, j]  qs: softmax_scale · log2 e · q row i's e4m3 scale; ks: key row j's (base-2 logits)
    masked keys: past the sequence's Lk keys, and (causal) key position j > i + diag for query row i
    online softmax (base 2), P rounded to e4m3(256 p) (``pv_fp8``, the default) or bf16 through an SMEM slot
    O += P · V                    ``pv_fp8``: e4m3 wgmma with Vᵀ K-major (section "FP8 P·V"); else bf16 wgmma
                                  (V [block_kv, Dv] MN-major, 128-byte swizzle); f32 accumulate
    out = O / l (0 where l = 0), lse = (m + log2 l) · ln 2 (-inf where l = 0)

Shapes and index conventions (the op builds them, ``ops/prefill.py``):
  q8 [Tq_al, H, Dqk] float8_e4m3fn, k8 [Tk_al, H, Dqk] float8_e4m3fn (one e4m3 scale per row and head: qs, ks),
  v [Tv, H, Dv] bfloat16 (``pv_fp8``: Vᵀ [H, Dv, Tv] e4m3 and vs [H, Dv], section "FP8 P·V"), Tv a multiple of 8
  (finite: the op sanitizes non-finite values and poisons the outputs that see them, or passes its v as it is
  when every element is finite and its sequences start aligned),
  in an *aligned* packing: every sequence starts at a multiple of 8 rows and Tq_al, Tk_al are multiples of 8
  (Mosaic tiles the GMEM side of a TMA into the SMEM tile's 8-row tiling). Dqk and Dv multiples of 64 up to 256
  (DeepSeek-V3.2 192 / 128, GLM-5 256 / 256).
  tiles [n_tiles, 8] int32, one row per query tile: q0 (first query row in q8, a multiple of 8), nq (valid
  queries, 0..128; 0: an empty tile, nothing is stored), k0 (first key row of the sequence in k8 / v, a multiple
  of 8), nk (its keys), diag (causal: query row i of the tile sees key positions j <= i + diag, i.e.
  FlashAttention's bottom-right rule; ignored otherwise), o0 (the output row of the tile's first query: any row),
  v0 (first key row of the sequence in v, a multiple of 8: k0 when v is packed like k8, or the caller's row when
  it reads v as it is), and an unused field.
  qs [H, Tq_al] float32 (q row scale · softmax_scale · log2 e), ks [H, Tk_al] float32 (k row scale); rows past
  the arrays read as 0 (TMA zero fill), which only the thrown-away rows and masked keys see.
  out_rows: static, rows of the output (the caller's unaligned packing).
Returns out [out_rows, H, Dv] bfloat16 (rows o0 .. o0 + nq - 1 of each tile; every other row is left unwritten:
the O tile goes out through an untiled SMEM buffer, so its GMEM rows need no alignment) and lse_pad
[H, n_tiles · 128] float32 (natural log; entry [h, 128 t + i] belongs to row i of tile t).

Rows of a tile past the end of its sequence hold other tokens (or TMA's zero fill past Tq): they are computed
and thrown away. Keys past the sequence's end are read (zero fill past Tk) and masked before the softmax; their
v rows are finite, so P = 0 keeps them out of O.

Warpgroups (``num_threads=3``):
  * WG0, WG1 — consumers (232 registers): their 64 query rows and their qs; per key block: wait ``k_full``, the
    QKᵀ wgmma, the block's ks (one per column; a register load, so a proxy fence, ``commit_smem``, orders it
    before the loader's next TMA into the slot), release ``k_empty``; the key-bound and causal mask (only on the
    blocks past the first row's limit: two loops), online softmax, P to their slot ``p_sw[wg]``; wait
    ``v_full``, the P·V wgmma, release ``v_empty``. Epilogue: O through ``o_lin[wg]`` (untiled) to GMEM by one
    TMA for 64 valid rows or one per valid row otherwise (a tile's tail never overwrites the next sequence's
    rows); lse through ``lse_smem``.
  * WG2 — loader (40 registers): TMA of each key block's K with its ks, and of its V, into ``kv_stages`` ring
    slots, waiting for both consumers to release a slot before refilling it.

Ping-pong (``TuningConfig.pingpong``; FlashAttention-3's schedule, as in JAX's ``attention_mgpu.py``): a schedule
barrier of two arrivals orders the consumers' tensor-core work so that one's softmax runs while the other's
P·V and next QKᵀ run. Each consumer arrives and waits on it right after issuing a QKᵀ, and after its softmax
it arrives, waits for V and waits for the barrier before issuing its P·V; consumer 1 makes one rendezvous
before its first block and consumer 0 one after its last. Both visit the tile's ``steps`` blocks (the masked
blocks too), so the arrivals pair up: consumer 1's k-th with consumer 0's k-th (2 · steps + 1 each).

FP8 P·V (``TuningConfig.pv_fp8``): the P·V wgmma in e4m3 × e4m3 instead of bf16 (twice the rate on Hopper; at
GLM-5's 256 / 256 the bf16 P·V is two thirds of the tensor time). An fp8 B operand must be K-major, so the kernel
takes V transposed: ``v`` = Vᵀ [H, Dv, Tv] float8_e4m3fn (the op's pass, or an up-projection that emits it so),
every sequence's first key column a multiple of ``block_kv`` (the tile field v0; Mosaic tiles the GMEM side of the
[Dv, b] TMA box like its SMEM tile), with ``vs`` [H, Dv] float32 one scale per head and column (dequantized V[j,
d] = Vᵀ[h, d, j] · vs[h, d]: a column scale passes through the product, so O's columns take it at the end). P is
stored as e4m3(256 p) (p <= 1, so <= 256 < 448; the power of two comes off O exactly). The ring holds Vᵀ tiles
[Dv, b] (b-byte swizzle) and P slots [64, b] e4m3; each consumer TMAs its head's vs row beside its Q (``q_bar``: 3
arrivals). Error: P's and V's e4m3 roundings join q's and k's (``testing.fp8_error_budget(quantized_p=True)``).

SMEM (bytes; Dqk = dk, Dv = dv, block_kv = b, kv_stages = s): Q 2·64·dk + K s·b·dk + V 2·s·b·dv + P 2·2·64·b +
O 2·2·64·dv + lse and qs 2·2·64·4 + ks s·b·4 + barriers and Mosaic's reduction scratch (:func:`smem_budget`):
133 KB at 192 / 128 (b 64, s 2), 205 KB (b 128, s 2), 213 KB at 256 / 256 (b 64, s 2). With ``pv_fp8`` V and P
take half (+ vs 2·dv·4): 158 KB at 192 / 128 (b 128), 175 KB at 256 / 256 (b 64; b 128 does not fit: 247 KB).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas.kernels import common

FP8 = common.FP8
BLOCK_Q = 64                  # query rows per consumer warpgroup
CONSUMERS = 2
TILE_Q = BLOCK_Q * CONSUMERS  # query rows per CTA
TILE_FIELDS = 8               # int32 fields per tile row: q0, nq, k0, nk, diag, o0, (2 unused)
ALIGN = 8                     # q0, k0: multiples of 8 rows, Tq_al and Tk_al too (the SMEM tiles' 8-row tiling: Mosaic
                              # tiles the GMEM side of a TMA like its SMEM side)
CONSUMER_REGS = 232           # 2 x 128 x 232 + 128 x 40 <= 65536
LOADER_REGS = 40
ROW_LAYOUT = plgpu.Layout.WGMMA.reduce(1)   # [64]: one value per query row
COL_LAYOUT = plgpu.Layout.WGMMA.reduce(0)   # [block_kv] or [Dv]: one value per column (key, or O's column)
MAX_HEAD_DIM = 256            # wgmma N <= 256 (Dv); one QKᵀ wgmma of K = Dqk
P_FP8_SCALE = 256.0           # pv_fp8: P in [0, 1] is stored as e4m3(256 p) (an exact power of two; 256 < 448)


@dataclasses.dataclass(frozen=True)
class TuningConfig(common.TuningConfigBase):
  """block_kv: keys per pipeline step (64 or 128); kv_stages: K/V ring slots (2 or 3); pingpong: FA3's
  schedule between the consumers (module docstring, "Ping-pong"); pv_fp8: P·V as an fp8 wgmma over Vᵀ in e4m3
  with per-column scales (module docstring, "FP8 P·V"; :func:`default_config` turns it on: measured faster,
  with 1.2-1.9x the bf16 P·V's error). ``pingpong`` is a sweep candidate until measured beside the fp8 P·V. The
  field defaults are the plain form; the kernel's defaults come from :func:`default_config`."""
  block_kv: int = 64
  kv_stages: int = 2
  pingpong: bool = False
  pv_fp8: bool = False

  def validate(self):
    if self.block_kv not in (64, 128):
      raise ValueError(f"TuningConfig.block_kv must be 64 or 128; got {self.block_kv}")
    if self.kv_stages not in (2, 3):
      raise ValueError(f"TuningConfig.kv_stages must be 2 or 3; got {self.kv_stages}")


def check_head_dims(dqk: int, dv: int) -> None:
  """ValueError unless Dqk and Dv are multiples of 64 in [64, 256]."""
  for name, d in (("Dqk", dqk), ("Dv", dv)):
    if d % 64 or not 64 <= d <= MAX_HEAD_DIM:
      raise ValueError(f"the prefill kernel takes {name} a multiple of 64 in [64, {MAX_HEAD_DIM}]; got {d}")


def _pv_dtype(cfg: TuningConfig):
  """The dtype of P and V in the P·V wgmma: e4m3 with ``pv_fp8``, else bf16."""
  return FP8 if cfg.pv_fp8 else jnp.bfloat16


def smem_budget(cfg: TuningConfig, dqk: int, dv: int) -> int:
  """Bytes of SMEM of one CTA (module docstring)."""
  b, s = cfg.block_kv, cfg.kv_stages
  pv = _pv_dtype(cfg)
  vs = (((CONSUMERS, dv), jnp.float32),) if cfg.pv_fp8 else ()
  return common.smem_bytes(((CONSUMERS, BLOCK_Q, dqk), FP8), ((s, b, dqk), FP8), ((s, b, dv), pv),
                           ((CONSUMERS, BLOCK_Q, b), pv), ((CONSUMERS, BLOCK_Q, dv), jnp.bfloat16),
                           ((CONSUMERS, BLOCK_Q), jnp.float32), ((CONSUMERS, BLOCK_Q), jnp.float32),
                           ((s, b), jnp.float32), *vs) + 16 * 8 + 2048   # barriers; Mosaic reduction scratch


def default_config(dqk: int, dv: int) -> TuningConfig:
  """The kernel's default at head dims (Dqk, Dv): fp8 P·V over the op's Vᵀ in e4m3 (the kernel measured faster
  than with a bf16 P·V and than cuDNN's at both models' dims on the H200; its error is ~1.2-1.9x the bf16 P·V's:
  docs/kernels/prefill_sm90.md), 128-key blocks in two stages where they fit in SMEM (DeepSeek's 192 / 128),
  else 64-key blocks (GLM-5's 256 / 256). ``pv_fp8=False`` is the more accurate, slower form."""
  check_head_dims(dqk, dv)
  wide = TuningConfig(block_kv=128, kv_stages=2, pv_fp8=True)
  return wide if smem_budget(wide, dqk, dv) <= common.SMEM_LIMIT else TuningConfig(pv_fp8=True)


def check_config(cfg: TuningConfig, dqk: int, dv: int) -> None:
  check_head_dims(dqk, dv)
  cfg.check_smem(smem_budget(cfg, dqk, dv), f" at Dqk {dqk}, Dv {dv}")


def _key_steps(nq, nk, diag, block_kv: int, causal: bool):
  """Key blocks a tile visits: enough for its last valid query (nothing for an empty tile)."""
  keys = nk
  if causal:
    keys = jnp.clip(nq + diag, 0, nk)             # last valid row nq - 1 sees positions <= nq - 1 + diag
  keys = jnp.where(nq > 0, keys, 0)
  return (keys + block_kv - 1) // block_kv


class _Refs(NamedTuple):
  """The kernel's refs by name (:func:`prefill_sm90` builds it from ``plgpu.kernel``'s order: inputs, outputs,
  scratch; the ``pv_fp8`` ones are None without it)."""
  q_ref: object
  k_ref: object
  v_ref: object
  tiles_ref: object
  qs_ref: object
  ks_ref: object
  o_ref: object
  lse_ref: object
  q_sw: object
  k_sw: object
  v_sw: object
  p_sw: object
  o_lin: object
  lse_smem: object
  qs_smem: object
  ks_smem: object
  q_bar: object
  k_full: object
  v_full: object
  k_empty: object
  v_empty: object
  sched: object = None      # TuningConfig.pingpong: the consumers' schedule barrier (two arrivals)
  vs_ref: object = None     # TuningConfig.pv_fp8: V's column scales [H, Dv] f32 (GMEM) ...
  vs_smem: object = None    # ... and each consumer's copy of its head's row [CONSUMERS, Dv]


def _consumer(cfg: TuningConfig, causal: bool, interpret: bool, wg, t, h, r: _Refs):
  (q_ref, tiles_ref, o_ref, lse_ref, q_sw, k_sw, v_sw, p_sw, o_lin, lse_smem) = (
      r.q_ref, r.tiles_ref, r.o_ref, r.lse_ref, r.q_sw, r.k_sw, r.v_sw, r.p_sw, r.o_lin, r.lse_smem)
  q_bar, k_full, v_full, k_empty, v_empty = r.q_bar, r.k_full, r.v_full, r.k_empty, r.v_empty
  b = cfg.block_kv
  dv = v_sw.shape[-2] if cfg.pv_fp8 else v_sw.shape[-1]   # (pv_fp8: the ring holds Vᵀ [Dv, b])
  q0, nq, nk, diag = pl.multiple_of(tiles_ref[t, 0], ALIGN), tiles_ref[t, 1], tiles_ref[t, 3], tiles_ref[t, 4]
  o0 = tiles_ref[t, 5]
  steps = _key_steps(nq, nk, diag, b, causal)
  plgpu.set_max_registers(CONSUMER_REGS, action="increase")
  row0 = wg * BLOCK_Q
  plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(q0 + row0, BLOCK_Q), h], q_sw.at[wg], q_bar.at[wg])
  plgpu.copy_gmem_to_smem(r.qs_ref.at[h, pl.ds(q0 + row0, BLOCK_Q)], r.qs_smem.at[wg], q_bar.at[wg])
  if cfg.pv_fp8:
    plgpu.copy_gmem_to_smem(r.vs_ref.at[h], r.vs_smem.at[wg], q_bar.at[wg])
  plgpu.barrier_wait(q_bar.at[wg])
  row_scale = plgpu.load(r.qs_smem.at[wg], layout=ROW_LAYOUT, optimized=False)
  acc = plgpu.layout_cast(jnp.zeros((BLOCK_Q, dv), jnp.float32), plgpu.Layout.WGMMA)
  m = plgpu.layout_cast(jnp.full((BLOCK_Q,), -jnp.inf, jnp.float32), ROW_LAYOUT)
  l = plgpu.layout_cast(jnp.zeros((BLOCK_Q,), jnp.float32), ROW_LAYOUT)

  def rendezvous():       # pingpong: both consumers arrive, then both go on
    plgpu.barrier_arrive(r.sched)
    plgpu.barrier_wait(r.sched)

  if cfg.pingpong:        # consumer 1 starts half a step behind consumer 0
    pl.when(wg == 1)(rendezvous)

  def step(j, carry, masked: bool):
    acc, m, l = carry
    slot = lax.rem(j, cfg.kv_stages)
    plgpu.barrier_wait(k_full.at[slot])

    def qk(acc_ref):
      plgpu.wgmma(acc_ref, q_sw.at[wg], k_sw.at[slot].T)
      if cfg.pingpong:    # the other consumer's softmax is done: its P·V goes on the tensor cores after our QKᵀ
        rendezvous()
      return acc_ref[...]
    s = pl.run_scoped(qk, plgpu.ACC((BLOCK_Q, b), jnp.float32))
    ks = plgpu.load(r.ks_smem.at[slot], layout=COL_LAYOUT, optimized=False)
    plgpu.commit_smem()   # proxy fence: the loader's next TMA into this slot (async proxy) after our generic read
    plgpu.barrier_arrive(k_empty.at[slot])
    s = s * lax.broadcast_in_dim(ks, s.shape, [1])
    valid = None
    if masked:
      col = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, b), 1, layout=plgpu.Layout.WGMMA) + j * b
      valid = col < nk
      if causal:
        row = plgpu.broadcasted_iota(jnp.int32, (BLOCK_Q, b), 0, layout=plgpu.Layout.WGMMA) + row0
        valid = valid & (col <= row + diag)
    if valid is None:                       # every key of the block is in the sequence and seen by every row
      valid = plgpu.layout_cast(jnp.full((BLOCK_Q, b), True), plgpu.Layout.WGMMA)
    p, alpha, m, l = common.online_softmax_tile(s, valid, row_scale, m, l)
    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
    if cfg.pv_fp8:        # 256 p in e4m3 (<= 256 < 448; the power of two comes off at the end, exactly)
      p_sw.at[wg][...] = (p * P_FP8_SCALE).astype(FP8)
    else:
      p_sw.at[wg][...] = p.astype(jnp.bfloat16)
    plgpu.commit_smem()
    if cfg.pingpong:      # our softmax is done; issue P·V once the other consumer has issued its QKᵀ
      plgpu.barrier_arrive(r.sched)
    plgpu.barrier_wait(v_full.at[slot])
    if cfg.pingpong:
      plgpu.barrier_wait(r.sched)
    v_op = v_sw.at[slot].T if cfg.pv_fp8 else v_sw.at[slot]   # fp8: Vᵀ [Dv, b] stored, read as a K-major B
    (acc,) = common.accumulate(lambda refs: plgpu.wgmma(refs[0], p_sw.at[wg], v_op), (acc,), interpret)
    plgpu.barrier_arrive(v_empty.at[slot])
    return acc, m, l

  # Blocks before `full` need no mask: all their keys are < nk and (causal) <= row0 + diag, the first row's limit.
  limit = jnp.minimum(nk, row0 + diag + 1) if causal else nk
  full = jnp.clip(limit // b, 0, steps)
  carry = lax.fori_loop(0, full, functools.partial(step, masked=False), (acc, m, l))
  acc, m, l = lax.fori_loop(full, steps, functools.partial(step, masked=True), carry)
  if cfg.pingpong:        # consumer 0's last arrival pairs with consumer 1's last end of softmax
    pl.when(wg == 0)(rendezvous)
  has = l > 0
  inv = jnp.where(has, 1.0 / jnp.where(has, l, 1.0), 0.0)
  if cfg.pv_fp8:          # O's column scales: V's, and 1 / 256 for P's
    cols = plgpu.load(r.vs_smem.at[wg], layout=COL_LAYOUT, optimized=False) * (1.0 / P_FP8_SCALE)
    acc = acc * lax.broadcast_in_dim(cols, acc.shape, [1])
  o_lin.at[wg][...] = (acc * lax.broadcast_in_dim(inv, acc.shape, [0])).astype(jnp.bfloat16)
  lse_smem.at[wg][...] = jnp.where(has, (m + jnp.log2(jnp.where(has, l, 1.0))) * common.LN2, -jnp.inf)
  plgpu.commit_smem()
  rows = jnp.clip(nq - row0, 0, BLOCK_Q)

  @pl.when(rows == BLOCK_Q)
  def _():
    plgpu.copy_smem_to_gmem(o_lin.at[wg], o_ref.at[pl.ds(o0 + row0, BLOCK_Q), h])

  @pl.when((rows > 0) & (rows < BLOCK_Q))
  def _():
    @pl.loop(0, rows)
    def _(r):
      plgpu.copy_smem_to_gmem(o_lin.at[wg, pl.ds(r, 1)], o_ref.at[pl.ds(o0 + row0 + r, 1), h])

  plgpu.copy_smem_to_gmem(lse_smem.at[wg], lse_ref.at[h, pl.ds(t * TILE_Q + row0, BLOCK_Q)])
  plgpu.wait_smem_to_gmem(0)


def _loader(cfg: TuningConfig, causal: bool, t, h, r: _Refs):
  k_ref, v_ref, tiles_ref, k_sw, v_sw = r.k_ref, r.v_ref, r.tiles_ref, r.k_sw, r.v_sw
  k_full, v_full, k_empty, v_empty = r.k_full, r.v_full, r.k_empty, r.v_empty
  b, stages = cfg.block_kv, cfg.kv_stages
  nq, k0, nk, diag = tiles_ref[t, 1], pl.multiple_of(tiles_ref[t, 2], ALIGN), tiles_ref[t, 3], tiles_ref[t, 4]
  v0 = pl.multiple_of(tiles_ref[t, 6], b if cfg.pv_fp8 else ALIGN)   # Vᵀ's key columns: block-aligned
  steps = _key_steps(nq, nk, diag, b, causal)
  plgpu.set_max_registers(LOADER_REGS, action="decrease")

  @pl.loop(0, steps)
  def _(j):
    slot = lax.rem(j, stages)
    rows = pl.ds(k0 + j * b, b)

    @pl.when(j >= stages)
    def _():
      plgpu.barrier_wait(k_empty.at[slot])
    plgpu.copy_gmem_to_smem(k_ref.at[rows, h], k_sw.at[slot], k_full.at[slot])
    plgpu.copy_gmem_to_smem(r.ks_ref.at[h, rows], r.ks_smem.at[slot], k_full.at[slot])

    @pl.when(j >= stages)
    def _():
      plgpu.barrier_wait(v_empty.at[slot])
    if cfg.pv_fp8:        # Vᵀ [H, Dv, Tv]: the block's b key columns of head h
      plgpu.copy_gmem_to_smem(v_ref.at[h, :, pl.ds(v0 + j * b, b)], v_sw.at[slot], v_full.at[slot])
    else:
      plgpu.copy_gmem_to_smem(v_ref.at[pl.ds(v0 + j * b, b), h], v_sw.at[slot], v_full.at[slot])

  # Observe the last release of every slot used (the interpreter's barrier rule; harmless on hardware).
  @pl.loop(jnp.maximum(steps - stages, 0), steps)
  def _(j):
    slot = lax.rem(j, stages)
    plgpu.barrier_wait(k_empty.at[slot])
    plgpu.barrier_wait(v_empty.at[slot])


@functools.partial(jax.jit, static_argnames=("cfg", "causal", "out_rows", "interpret"))
def prefill_sm90(q8, k8, v, tiles, qs, ks, vs=None, *, cfg: TuningConfig, causal: bool, out_rows: int,
                 interpret=False):
  """The kernel (module docstring for shapes and conventions). With ``cfg.pv_fp8``: ``v`` is Vᵀ [H, Dv, Tv]
  float8_e4m3fn (Tv a multiple of block_kv; every sequence's first key column too) and ``vs`` [H, Dv] float32
  its column scales (module docstring, "FP8 P·V"). ``interpret``: False, True or ``plgpu.InterpretGPUParams``."""
  _, h, dqk = q8.shape
  for name, x in (("q8", q8), ("k8", k8)) + ((("v", v),) if not cfg.pv_fp8 else ()):
    if x.shape[0] % ALIGN:
      raise ValueError(f"{name} must have a multiple of {ALIGN} rows (aligned packing); got {x.shape[0]}")
  for name, x, rows in (("qs", qs, q8.shape[0]), ("ks", ks, k8.shape[0])):
    if x.shape != (h, rows) or x.dtype != jnp.float32:
      raise ValueError(f"{name} must be float32 [{h}, {rows}] (one scale per head and row); got "
                       f"{x.dtype.name}{list(x.shape)}")
  b, s = cfg.block_kv, cfg.kv_stages
  if cfg.pv_fp8:
    if v.ndim != 3 or v.shape[0] != h or v.dtype != FP8 or v.shape[2] % b:
      raise ValueError(f"v must be Vᵀ float8_e4m3fn [H={h}, Dv, Tv] with Tv a multiple of block_kv={b} "
                       f"(TuningConfig.pv_fp8); got {v.dtype.name}{list(v.shape)}")
    dv = v.shape[1]
    if vs is None or vs.shape != (h, dv) or vs.dtype != jnp.float32:
      raise ValueError(f"vs must be float32 [{h}, {dv}] (V's column scales, TuningConfig.pv_fp8); got "
                       f"{None if vs is None else (vs.dtype.name, list(vs.shape))}")
  else:
    if vs is not None:
      raise ValueError("vs (V's column scales) is for TuningConfig.pv_fp8 only")
    dv = v.shape[2]
  n_tiles = tiles.shape[0]
  check_config(cfg, dqk, dv)
  pv = _pv_dtype(cfg)
  inputs = (q8, k8, v, tiles, qs, ks) + ((vs,) if cfg.pv_fp8 else ())

  def body(*refs):
    n_in = len(inputs)
    named = dict(zip(_Refs._fields[:6], refs[:6]))
    if cfg.pv_fp8:
      named["vs_ref"] = refs[6]
    rest = list(refs[n_in:])
    for name in ("o_ref", "lse_ref", "q_sw", "k_sw", "v_sw", "p_sw", "o_lin", "lse_smem", "qs_smem", "ks_smem"):
      named[name] = rest.pop(0)
    if cfg.pv_fp8:
      named["vs_smem"] = rest.pop(0)
    for name in ("q_bar", "k_full", "v_full", "k_empty", "v_empty"):
      named[name] = rest.pop(0)
    if cfg.pingpong:
      named["sched"] = rest.pop(0)
    refs = _Refs(**named)
    t, hd, wg = lax.axis_index("tile"), lax.axis_index("head"), lax.axis_index("wg")

    @pl.when(wg < CONSUMERS)
    def _():
      _consumer(cfg, causal, bool(interpret), wg, t, hd, refs)

    @pl.when(wg == CONSUMERS)
    def _():
      _loader(cfg, causal, t, hd, refs)

  # V ring: [b keys, Dv] bf16 (128-byte swizzle), or with pv_fp8 Vᵀ [Dv, b keys] e4m3 (b-byte swizzle); P the same
  v_tile = ((s, dv, b), FP8, common.swizzled(FP8, b)) if cfg.pv_fp8 else \
      ((s, b, dv), jnp.bfloat16, common.swizzled(jnp.bfloat16, 128))
  p_swizzle = b if cfg.pv_fp8 else 128
  scratch = [
      plgpu.SMEM((CONSUMERS, BLOCK_Q, dqk), FP8, transforms=common.swizzled(FP8, 64)),
      plgpu.SMEM((s, b, dqk), FP8, transforms=common.swizzled(FP8, 64)),
      plgpu.SMEM(v_tile[0], v_tile[1], transforms=v_tile[2]),
      plgpu.SMEM((CONSUMERS, BLOCK_Q, b), pv, transforms=common.swizzled(pv, p_swizzle)),
      plgpu.SMEM((CONSUMERS, BLOCK_Q, dv), jnp.bfloat16),
      plgpu.SMEM((CONSUMERS, BLOCK_Q), jnp.float32),                          # lse_smem
      plgpu.SMEM((CONSUMERS, BLOCK_Q), jnp.float32),                          # qs_smem
      plgpu.SMEM((s, b), jnp.float32),                                        # ks_smem
      *([plgpu.SMEM((CONSUMERS, dv), jnp.float32)] if cfg.pv_fp8 else []),   # vs_smem
      plgpu.Barrier(num_arrivals=3 if cfg.pv_fp8 else 2, num_barriers=CONSUMERS),   # q_bar: q tile, qs (, vs)
      plgpu.Barrier(num_arrivals=2, num_barriers=s),                          # k_full: K block and its ks
      plgpu.Barrier(num_barriers=s),                                            # v_full
      plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=s),                    # k_empty
      plgpu.Barrier(num_arrivals=CONSUMERS, num_barriers=s),                    # v_empty
      *([plgpu.Barrier(num_arrivals=CONSUMERS)] if cfg.pingpong else []),      # sched
  ]
  return plgpu.kernel(
      body,
      out_type=(jax.ShapeDtypeStruct((out_rows, h, dv), jnp.bfloat16),
                jax.ShapeDtypeStruct((h, n_tiles * TILE_Q), jnp.float32)),
      scratch_types=scratch,
      grid=(n_tiles, h),
      grid_names=("tile", "head"),
      num_threads=CONSUMERS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      **common.interpret_kwargs(interpret),
  )(*inputs)
