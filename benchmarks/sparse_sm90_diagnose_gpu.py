"""Where the sparse sm_90 kernels spend their time (GPU): ptxas reports and ablations of the op's default kernel.

Two parts, for the cases of the peer kit (`../shared/peers`) or any ``--shape``:

1. **ptxas** (``--ptxas``): compiles the op's default kernel of each case with ``MOSAIC_GPU_DUMP_PTXAS=1`` and
   ``MOSAIC_GPU_DUMP_TO=<out>/ptxas_<case>`` and prints what ptxas says about it: registers per thread, spills,
   and any "wgmma ... serialized" performance warning (Mosaic GPU's own notes say that accumulators held as
   64-bit register pairs make ptxas insert wgmma waits).
2. **ablations** (default): the per-kernel device times of one call (the Mosaic kernel and the XLA pre- and
   post-passes: Q quantization, split merge), then the default kernel's time with one part replaced, by patching the kernel modules'
   functions for the duration of one row (the kernels are rebuilt and retraced per row). The ablated rows compute
   wrong results by design and are not checked; only their time counts (the row ``none`` is checked). The gather
   variants once here (L2::256B prefetch: no change; an evict-last policy: illegal instruction on the H200) are in
   docs/kernels/sparse_decode_sm90.md.

   | row | what is replaced |
   |---|---|
   | ``no_gather`` | the loader's ``cp.async`` gather of each K tile (the loader still waits, fences, arrives) |
   | ``no_qk`` | the five QKᵀ wgmmas of a tile (S = 0; the V upcast of "twin" still runs) |
   | ``no_softmax`` | the online softmax (P = S, alpha = 1) |
   | ``no_pv`` | the P·V wgmmas (every schedule, the bf16 cache's too) |
   | ``no_vt_words`` | the SMEM loads of Vᵀ in the heads-on-N kernel and "producer_vt"'s multipliers (Vᵀ = 0) |
   | ``no_gather+no_pv`` | both |

Usage on the H200 (the project's checkout; ~2-4 minutes per case)::

    python3 benchmarks/sparse_sm90_diagnose_gpu.py --cases P1,F1 --ptxas --out /tmp/diag
    python3 benchmarks/sparse_sm90_diagnose_gpu.py --shape B=64,s_q=1,H=64 --rows none,no_gather
    python3 benchmarks/sparse_sm90_diagnose_gpu.py --cases P1 --tuning schedule=twin    # another schedule
    python3 benchmarks/sparse_sm90_diagnose_gpu.py --shape B=128,s_q=2,H=128,topk=2048,page=64,ctx=32768,cache=bf16 \
        --tuning schedule=producer_vt,tiles_per_split=16 --timeline --timeline-space 48   # a bf16 cache (SMEM:
        # the profiler's buffers fit beside bf16 Q and K tiles only with 16-tile splits and few spans)

3. **timeline** (``--timeline``): the op's heads-on-M kernel built with Mosaic GPU's in-kernel profiler
   (``CompilerParams(profile_space=..., profile_dir=...)``), whose spans are the kernel's ``jax.named_scope``
   regions ("producer_vt": producer ``p_wait_k``, ``p_qk``, ``p_softmax``, ``p_wait_slot``, ``p_store``; each
   multiplier ``m_wait_k``, ``m_words``, ``m_wait_p``, ``m_pv``; loader ``l_wait_empty``, ``l_gather``), run once;
   prints per warpgroup the mean cycles per CTA and per tile of each region and the CTA's span, so that which
   warpgroup waits for which says the limiter (a producer waiting in ``p_wait_slot``: the multipliers limit;
   multipliers waiting in ``m_wait_p``: the producer does). The trace JSON stays in ``<out>/timeline_<case>``.
   Profiling adds ~12 cycles and one SMEM store per span edge. Large grids make large traces: F1's per-CTA work
   is ``--shape B=1056,s_q=1,H=128,topk=2048,page=64,ctx=8192`` (the same kernel at 16 waves).

On a CPU, ``--lower-only`` lowers every row for sm_90a at a small shape (a check that each patch still traces;
nothing is timed). Timing: the bench engine's CUPTI timer (median of ``--iters``, input sets rotated past L2).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import re
import sys
import unittest.mock

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, llvm, vector
from jax.experimental.mosaic.gpu import utils as mgpu_utils

from mla_pallas import bench, testing
from mla_pallas.bench_engine import format_table, run_spec
from mla_pallas.kernels import common, gather_threads, q_quant, vt_registers
from mla_pallas.kernels import sparse_sm90_heads_m as heads_m
from mla_pallas.kernels import sparse_sm90_heads_n as heads_n
from mla_pallas.ops import sparse_decode as sd
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

CASES = {   # the peer kit's sparse cases (bench spec, shape)
    "C0": ("sparse_mla_decode", dict(B=8, s_q=2, H=128, topk=2048, page=64, ctx=4096)),
    "P1": ("sparse_mla_decode", dict(B=128, s_q=2, H=128, topk=2048, page=64, ctx=32768)),
    "P2": ("sparse_mla_decode", dict(B=128, s_q=4, H=8, topk=2048, page=64, ctx=32768)),
    "P3": ("sparse_mla_decode", dict(B=64, s_q=1, H=64, topk=2048, page=64, ctx=32768)),
    "P4": ("sparse_mla_decode", dict(B=128, s_q=1, H=64, topk=2048, page=64, ctx=32768)),
    "P5": ("sparse_mla_decode", dict(B=148, s_q=2, H=128, topk=16384, page=64, ctx=32768)),
    "F1": ("sparse_mla_prefill", dict(T=4096, H=128, topk=2048, page=64, ctx=8192)),
}


# ---------------------------------------------------------------------------------------------------------------
# The replacements (each a dict {(module, name): replacement})

def _no_gather(*args, **kwargs):
  del args, kwargs


def _zero_s(k_tiles, stage_v, r):
  def body(acc_ref):
    if stage_v is not None:
      stage_v()
      plgpu.commit_smem()
    return acc_ref[...]
  return pl.run_scoped(body, plgpu.ACC((common.TILE, common.TILE), jnp.float32))


def _qk_20(cfg, k_tiles, r, interpret):
  """The producer's QKᵀ as five ``plgpu.wgmma`` chunks (20 k32 steps: the form before the thirty-first session;
  the default, ``heads_m._qk_fp8_18``, skips the two over Q's zero columns)."""
  del cfg, interpret
  return heads_m._qk_and_upcast(k_tiles, None, r)


def _no_softmax(s, m, l, row_scale, valid, rescale_threshold=None, scale_in_exponent=False):
  del row_scale, valid, rescale_threshold, scale_in_exponent
  return s, plgpu.layout_cast(jnp.ones(m.shape, jnp.float32), heads_m.ROW_LAYOUT), m, l


def _pv_bf16_identity(accs, p_op, k_tiles, half, interpret):
  del p_op, k_tiles, half, interpret
  return accs


def _pv_half_identity(acc, p_op, wg, interpret, r):
  del p_op, wg, interpret, r
  return acc


def _pv_wgmmas_identity(words, pt_ref, accs, swizzle, blocks=vt_registers.ALL_BLOCKS, p_rows=False,
                        pipelined=False, slot=None):
  del words, pt_ref, swizzle, blocks, p_rows, pipelined, slot  # the words' loads are side-effecting asm: they stay
  return tuple(accs)


_PV_WGMMAS = vt_registers.pv_wgmmas
_HEADS_M_TUNING = sd._heads_m_tuning


def _pv_forced(pipelined: bool):
  """``vt_registers.pv_wgmmas`` with its A fragments built one block at a time (``pipelined``) or all first."""
  def pv(*args, **kwargs):
    return _PV_WGMMAS(*args, **{**kwargs, "pipelined": pipelined})
  return pv


def _p_view_sliced(pt, slot):
  """``vt_registers._p_view`` as before: the P slot sliced with the dynamic index, its descriptors built from it in
  every call (``mgpu.wgmma`` on ``p_sw.at[pb]``)."""
  if slot is None:
    return pt, 0
  return mgpu_utils.memref_slice(pt, arith.index_cast(ir.IndexType.get(), slot)), 0


def _block_operands_fused(words, blocks=vt_registers.ALL_BLOCKS):
  """``vt_registers.block_operands`` (the heads-on-N P·V's A operands, all blocks first) as at ``4cb55bb``: per
  (key pair, row half, block pair) one inline-asm block with the ``prmt`` and both ``cvt.rn.f16x2.e4m3x2``, where
  the default issues the ``prmt`` and each conversion as separate blocks (the same instructions; LLVM may order
  them differently)."""
  i32 = ir.IntegerType.get_signless(32)
  pairs = {}
  wreg = words.registers
  for c in range(8):
    for h in range(2):
      wa, wb = wreg[0, 2 * c, 0, 0, h, 0, 0, 0, 0], wreg[0, 2 * c + 1, 0, 0, h, 0, 0, 0, 0]
      for g in blocks[::2]:
        b, word = g % 4, g // 4
        sel = b | (4 + b) << 4 | (b + 1) << 8 | (4 + b + 1) << 12
        conv = vt_registers._asm(
            llvm.StructType.get_literal([i32, i32]), [vector.extract(wa, [], [word]), vector.extract(wb, [], [word])],
            "{\n.reg .b32 p;\n.reg .b16 lo, hi;\n"
            f"prmt.b32 p, $2, $3, {sel:#x};\nmov.b32 {{lo, hi}}, p;\ncvt.rn.f16x2.e4m3x2 $0, lo;\n"
            "cvt.rn.f16x2.e4m3x2 $1, hi;\n}", "=r,=r,r,r")
        pairs[c, h, g], pairs[c, h, g + 1] = (llvm.extractvalue(i32, conv, [j]) for j in range(2))
  return [vt_registers._operand(lambda c, h, g=g: pairs[c, h, g]) for g in blocks]


def _words_unpaired(words, blocks):
  del blocks
  return words


def _operand_per_register(words, g):
  """Block g's A operand straight from the words: one ``prmt`` and one ``cvt`` per register (the pipelined
  form before the thirty-second session)."""
  return vt_registers._operand(lambda c, h: vt_registers._convert_half(vt_registers._byte_pairs(words, c, h, g),
                                                                      False))


_KEY_WORDS = vt_registers._key_words


def _key_words_forced(shared: bool):
  """``vt_registers._key_words`` with one address form in both designs: per key (``shared=False``: the
  heads-on-M multipliers' form before the thirty-second session; the heads-on-N consumer's default) or two base
  registers and immediate offsets (True: the heads-on-N consumer's form from the thirty-second to the thirty-fifth
  session, P2 183.4 against 166.4 µs)."""
  def key_words(k_tile, chunk, units, place, *, shared_bases):
    del shared_bases
    return _KEY_WORDS(k_tile, chunk, units, place, shared_bases=shared)
  return key_words


def _zero_words(k_tile_ref, *args):
  del k_tile_ref, args
  return plgpu.layout_cast(jnp.zeros((common.TILE, 2 * common.TILE), jnp.int32), plgpu.Layout.WGMMA)


def _producer_k3(tiles_per_split: int) -> dict:
  return dict(_HEADS_M_TUNING(tiles_per_split), **({"k_buffers": 3} if tiles_per_split >= 8 else {}))


def _ref_stores(fn):
  """``fn`` (a heads_m function with an ``interpret`` argument) in its interpret-mode form on the GPU too: Pallas
  ref stores, with their warpgroup barriers, instead of its raw Mosaic GPU stores."""
  def ref_form(*args):
    return fn(*args[:-1], True)
  return ref_form


_SOFTMAX_STEP = heads_m._softmax_step


def _softmax_step_scaled_logits(*args, **kwargs):
  """``heads_m._softmax_step`` with the row scale applied to the logits first (multiply, select, subtract)."""
  return _SOFTMAX_STEP(*args, **{**kwargs, "scale_in_exponent": False})


def _alpha_min(r, pb):
  """The multipliers' rescale test as the minimum of slot pb's 64 alphas (``common.alpha_is_one``)."""
  return common.alpha_is_one(plgpu.load(r.head_smem.at[pb], layout=heads_m.COL_LAYOUT, optimized=False))


class _ExactPlgpu:
  """``plgpu`` as ``sparse_sm90_heads_m`` sees it, with ``approx_math`` off in its CompilerParams (exp2 / log2 as
  the exact forms, with the subnormal fix-ups around each MUFU op)."""

  def __getattr__(self, name):
    return getattr(plgpu, name)

  def CompilerParams(self, **kwargs):  # noqa: N802 (plgpu's name)
    return plgpu.CompilerParams(**{**kwargs, "approx_math": False})


ROWS = {
    "none": {},
    "no_gather": {(gather_threads, "gather_tile"): _no_gather},
    "no_qk": {(heads_m, "_qk_and_upcast"): _zero_s,
              (heads_m, "_qk_producer"): lambda cfg, k_tiles, r, interpret: _zero_s(k_tiles, None, r)},
    "no_softmax": {(heads_m, "_softmax_step"): _no_softmax},
    "no_pv": {(heads_m, "_pv_half"): _pv_half_identity, (vt_registers, "pv_wgmmas"): _pv_wgmmas_identity,
              (heads_m, "_pv_bf16"): _pv_bf16_identity},
    "no_vt_words": {(vt_registers, "load_v_words"): _zero_words, (vt_registers, "load_v_half_words"): _zero_words},
    "no_gather+no_pv": {(gather_threads, "gather_tile"): _no_gather, (heads_m, "_pv_half"): _pv_half_identity,
                        (vt_registers, "pv_wgmmas"): _pv_wgmmas_identity, (heads_m, "_pv_bf16"): _pv_bf16_identity},
    # real variants (checked): every P·V from registers with its A fragments built one block at a time (wait_group
    # 1 between blocks; "producer_vt"'s form) or all first (the others' form)
    "pv_pipelined": {(vt_registers, "pv_wgmmas"): _pv_forced(True)},
    "pv_all_blocks": {(vt_registers, "pv_wgmmas"): _pv_forced(False)},
    # register splits of "producer_vt" (loader, producer, each multiplier)
    "regs_56_88_184": {(heads_m, "PRODUCER_REGS"): (56, 88, 184)},
    "regs_24_72_208": {(heads_m, "PRODUCER_REGS"): (24, 72, 208)},
    # "producer_vt" with three P slots (the producer up to three tiles ahead of the multipliers; + 8 KB of SMEM)
    "p_slots_3": {(heads_m, "P_BUFFERS"): 3, (heads_m, "INV_SLOT"): 3},
    # the in-kernel Q quantization one row at a time per warp (before the batched loads; within 0.5 % of them at
    # P1, C0 and F1, twenty-seventh session)
    "q_rows_serial": {(q_quant, "Q_LOAD_REGS"): 0},
    # "producer_vt" with three K buffers (slower: 285.9 against 278.3 us at P1, twenty-sixth session)
    "k_buffers_3": {(sd, "_heads_m_tuning"): _producer_k3},
    # "producer_vt"'s three parts adopted in the twenty-ninth session (each measured alone and all together on the
    # lazy default, call 1: P1 none 244.2, raw store 241.2, approx 241.5, fma 247.3, all three 238.5 us; F1 median
    # (p10) 3799.6 (3655.3), 3883.4 (3596.8), 3862.9 (3583.4), 3908.9 (3746.8), 3781.2 (3510.0)), reverted one at
    # a time and all together: the P / alpha store as Pallas ref stores (5 warpgroup barriers per tile, not 1);
    # exact exp2 / log2 (approx_math off); the row scale on the logits before the exponent
    "p_store_ref": {(heads_m, "_store_p_alpha"): _ref_stores(heads_m._store_p_alpha)},
    "exact_math": {(heads_m, "plgpu"): _ExactPlgpu()},
    "scaled_logits": {(heads_m, "_softmax_step"): _softmax_step_scaled_logits},
    "before_s29": {(heads_m, "_store_p_alpha"): _ref_stores(heads_m._store_p_alpha),
                   (heads_m, "plgpu"): _ExactPlgpu(), (heads_m, "_softmax_step"): _softmax_step_scaled_logits},
    # "producer_vt" rescaling eagerly (threshold 0: the running max moves whenever it grows; the multipliers still
    # skip the rescale in a tile where no row grew): 261.1 against 245.3 us lazily at P1, twenty-eighth session;
    # 258.5 against 244.2, twenty-ninth session call 1
    "eager_rescale": {(heads_m, "RESCALE_THRESHOLD"): 0.0},
    # the producer's QKᵀ with the two k32 steps over Q's zero columns (20 wgmmas, not 18; bitwise the same S)
    "qk_20": {(heads_m, "_qk_producer"): _qk_20},
    # the pipelined P·V's A fragments with one prmt per register from the words (the form before the thirty-second
    # session; the default makes the byte pairs of two blocks with one prmt first)
    "pv_prmt_each": {(vt_registers, "paired_words"): _words_unpaired,
                     (vt_registers, "paired_operand"): _operand_per_register},
    # the Vᵀ words' SMEM addresses computed per key (the form before the thirty-second session)
    "key_words_each": {(vt_registers, "_key_words"): _key_words_forced(False)},
    # the heads-on-N consumer's V word addresses as the multipliers' (two bases and immediate offsets)
    "key_words_shared": {(vt_registers, "_key_words"): _key_words_forced(True)},
    # both of the above: the multipliers' V words and fragments as before the thirty-second session's second change
    "s32_base": {(vt_registers, "paired_words"): _words_unpaired,
                 (vt_registers, "paired_operand"): _operand_per_register,
                 (vt_registers, "_key_words"): _key_words_forced(False)},
    # the heads-on-N P·V's fragments as one asm block per prmt and its two conversions (as at 4cb55bb, the kit run
    # with P2 at 167.2 us), and that plus the V word addresses per key and the P descriptors per call (its form then)
    "fragments_fused": {(vt_registers, "block_operands"): _block_operands_fused},
    "heads_n_4cb55bb": {(vt_registers, "block_operands"): _block_operands_fused,
                        (vt_registers, "_key_words"): _key_words_forced(False),
                        (vt_registers, "_p_view"): _p_view_sliced},
    # the P·V B descriptors built from the dynamically sliced P slot in every call (the form before)
    "p_desc_per_call": {(vt_registers, "_p_view"): _p_view_sliced},
    # the multipliers quantize all of Q, 32 rows each (the form before; the default gives the producer 16)
    "q_rows_multipliers": {(heads_m, "PRODUCER_Q_ROWS"): 0},
    # each multiplier reduces the slot's 64 alphas itself (the default before; the producer still writes its flags)
    "alpha_min": {(heads_m, "_all_alpha_one"): _alpha_min},
}
CHECKED = ("none", "pv_pipelined", "pv_all_blocks", "regs_56_88_184", "regs_24_72_208", "p_slots_3",
           "k_buffers_3", "q_rows_serial", "eager_rescale", "p_store_ref", "exact_math", "scaled_logits",
           "before_s29", "qk_20", "alpha_min", "pv_prmt_each", "key_words_each", "s32_base",
           "p_desc_per_call", "q_rows_multipliers", "fragments_fused", "heads_n_4cb55bb", "key_words_shared")


@contextlib.contextmanager
def patched(row: str):
  """The kernel modules with ``row``'s replacements, rebuilt and retraced inside."""
  with contextlib.ExitStack() as stack:
    for (mod, name), new in ROWS[row].items():
      stack.enter_context(unittest.mock.patch.object(mod, name, new))
    _fresh()
    try:
      yield
    finally:
      _fresh()


def _fresh():
  heads_m.build.cache_clear()
  heads_n.build.cache_clear()
  jax.clear_caches()


# ---------------------------------------------------------------------------------------------------------------

def _full_shape(op: str, shape: dict) -> tuple:
  spec = bench.get_spec(op)
  return spec, spec.shape({k: str(v) for k, v in shape.items()})


def ptxas_report(name: str, op: str, shape: dict, out: str, tuning=()) -> dict:
  """Compile one case's kernel (the default, with ``tuning`` applied) with ptxas dumps on; returns {registers,
  spills, warnings}."""
  spec, full = _full_shape(op, shape)
  folder = os.path.join(out, f"ptxas_{name}")
  os.makedirs(folder, exist_ok=True)
  env = {"MOSAIC_GPU_DUMP_PTXAS": "1", "MOSAIC_GPU_DUMP_TO": folder}
  with unittest.mock.patch.dict(os.environ, env):
    _fresh()
    inputs = spec.make_inputs(full, jax.random.key(0))
    jax.block_until_ready(spec.tuned_op(full, tuning, False)(*inputs))
  text = "\n".join(open(f, errors="replace").read() for f in sorted(glob.glob(os.path.join(folder, "**", "*"),
                                                                              recursive=True))
                   if os.path.isfile(f) and "ptxas" in os.path.basename(f).lower())
  lines = [ln.strip() for ln in text.splitlines()]
  return dict(case=name, folder=folder,
              registers=[ln for ln in lines if re.search(r"Used \d+ registers", ln)],
              spills=[ln for ln in lines if "spill" in ln.lower() and not re.search(r"\b0 bytes spill", ln)],
              warnings=[ln for ln in lines if "serializ" in ln.lower() or "performance" in ln.lower()])


class _ProfiledPlgpu:
  """``plgpu`` as ``sparse_sm90_heads_m`` sees it, with the in-kernel profiler switched on in its CompilerParams."""

  def __init__(self, space: int, folder: str):
    self._space, self._folder = space, folder

  def __getattr__(self, name):
    return getattr(plgpu, name)

  def CompilerParams(self, **kwargs):  # noqa: N802 (plgpu's name)
    return plgpu.CompilerParams(**kwargs, profile_space=self._space, profile_dir=self._folder,
                                profile_bounds_check=True)


def timeline_summary(trace: dict, roles=("producer", "multiplier 0", "multiplier 1", "loader")) -> list[dict]:
  """Per warpgroup (``tid`` - 1 modulo the warpgroups of a block) and region: mean cycles per CTA, mean count per
  CTA, mean cycles per span; plus each warpgroup's span per CTA (first begin to last end). The profiler's
  timestamps are ``(globaltimer start + clock cycles) / 1e3``, so differences within a trace are cycles / 1e3."""
  opened, per = {}, collections.defaultdict(lambda: collections.defaultdict(list))
  first, last = {}, {}
  for ev in trace["traceEvents"]:
    tid, name, ts = ev["tid"], ev["name"], ev["ts"] * 1e3
    first.setdefault(tid, ts)
    last[tid] = ts
    if ev["ph"] == "B":
      opened[(tid, name)] = ts
    elif (tid, name) in opened:
      per[tid][name].append(ts - opened.pop((tid, name)))
  n_wg = len(roles)
  rows = []
  for wg in range(n_wg):
    tids = [t for t in first if (t - 1) % n_wg == wg]
    if not tids:
      continue
    names = sorted({n for t in tids for n in per[t]})
    span = sum(last[t] - first[t] for t in tids) / len(tids)
    for name in names:
      spans = [sum(per[t][name]) for t in tids]
      counts = [len(per[t][name]) for t in tids]
      total = sum(spans) / len(tids)
      count = sum(counts) / len(tids)
      rows.append(dict(warpgroup=wg, role=roles[wg], region=name, cycles_per_cta=total, count_per_cta=count,
                       cycles_per_span=total / max(1e-9, count), share_of_span=total / span if span else 0.0,
                       span_cycles=span, ctas=len(tids)))
  return rows


def timeline(name: str, op: str, shape: dict, out: str, space: int, tuning=()) -> list[dict]:
  """Run one call of the op with the profiled heads-on-M kernel; print and return :func:`timeline_summary`."""
  spec, full = _full_shape(op, shape)
  folder = os.path.join(out, f"timeline_{name}")
  os.makedirs(folder, exist_ok=True)
  with unittest.mock.patch.object(heads_m, "plgpu", _ProfiledPlgpu(space, folder)):
    _fresh()
    inputs = spec.make_inputs(full, jax.random.key(0))
    jax.block_until_ready(spec.tuned_op(full, tuning, False)(*inputs))
  _fresh()
  files = sorted(glob.glob(os.path.join(folder, "*trace.json")))
  if not files:
    print(f"## timeline {name}: no trace written (the case does not run the heads-on-M kernel?)", flush=True)
    return []
  with open(files[-1]) as f:
    rows = timeline_summary(json.load(f))
  print(f"## timeline {name} {shape} ({files[-1]})", flush=True)
  print(f"{'warpgroup':<14} {'region':<14} {'cycles/CTA':>11} {'spans/CTA':>9} {'cycles/span':>11} "
        f"{'of span':>7}", flush=True)
  for r in rows:
    print(f"{r['role']:<14} {r['region']:<14} {r['cycles_per_cta']:>11.0f} {r['count_per_cta']:>9.1f} "
          f"{r['cycles_per_span']:>11.0f} {r['share_of_span']:>7.1%}", flush=True)
  spans = {r["role"]: r["span_cycles"] for r in rows}
  print("spans per CTA (cycles): " + ", ".join(f"{k} {v:.0f}" for k, v in spans.items()), flush=True)
  for r in rows:
    r["case"] = name
  return rows


def time_rows(name: str, op: str, shape: dict, rows, iters: int, tuning=()) -> list:
  spec, full = _full_shape(op, shape)
  results = []
  for row in rows:
    with patched(row):
      res = run_spec(spec, (), full, candidates={row: tuning}, check=row in CHECKED,
                     iters=iters, progress=False)
    results += res
  print(f"## {name} {shape}", flush=True)
  print(format_table(results), flush=True)
  for r in results:      # per-kernel device time of a call: the Mosaic kernel beside the XLA pre- and post-passes
    if r.kernels:
      parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r.kernels.items(), key=lambda kv: -kv[1]))
      print(f"  {r.candidate} kernels (us): {parts}", flush=True)
  return [dict(case=name, row=r.candidate, median_us=r.median_us, p10_us=r.p10_us, p90_us=r.p90_us,
               status=r.status, check=r.check, kernels=r.kernels) for r in results]


def lower_rows(op: str, shape: dict, rows, tuning=()) -> None:
  """CPU check: every row's patched op lowers for sm_90a (small shape)."""
  spec, full = _full_shape(op, shape)
  inputs = spec.make_inputs(full, jax.random.key(0))
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in inputs]
  for row in rows:
    with patched(row):
      low = testing.lower_for_cuda(spec.tuned_op(full, tuning, False), *avals)
    print(f"{row}: lowered ({sum(len(m) for m in low.mosaic)} characters of Mosaic GPU IR)", flush=True)


def lower_timeline(op: str, shape: dict, out: str, space: int, tuning=()) -> None:
  """CPU check: the profiled kernel (named regions, profiler buffers) lowers for sm_90a."""
  spec, full = _full_shape(op, shape)
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in spec.make_inputs(full, jax.random.key(0))]
  with unittest.mock.patch.object(heads_m, "plgpu", _ProfiledPlgpu(space, out)):
    _fresh()
    try:
      testing.lower_for_cuda(spec.tuned_op(full, tuning, False), *avals)
    except ValueError as e:   # the kernel lowered; the dump is a host callback, which needs a CUDA backend
      if "different from the lowering platform cuda" not in str(e):
        raise
  _fresh()
  print("timeline: the profiled kernel lowered (its trace dump, a host callback, lowers only on a GPU)", flush=True)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--cases", default="P1,F1", help=f"comma-separated among {','.join(CASES)}")
  p.add_argument("--shape", default=None, help="one sparse_mla_decode shape instead of --cases (B=..,s_q=..)")
  p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated among {','.join(ROWS)}")
  p.add_argument("--tuning", default="", help="TuningConfig overrides for every row, e.g. schedule=twin")
  p.add_argument("--ptxas", action="store_true", help="also compile each case's default kernel with ptxas dumps")
  p.add_argument("--iters", type=int, default=20)
  p.add_argument("--out", default="results/diagnose")
  p.add_argument("--lower-only", action="store_true", help="CPU: lower every row for sm_90a, time nothing")
  p.add_argument("--timeline", action="store_true",
                 help="instead of the rows: one profiled call per case, per-warpgroup region times")
  p.add_argument("--timeline-space", type=int, default=200,
                 help="profiler spans per warpgroup (5 per tile; longer traces are truncated)")
  a = p.parse_args(argv)
  rows = a.rows.split(",")
  value = lambda v: int(v) if v.isdigit() else {"True": True, "False": False}.get(v, v)
  tuning = tuple((k, value(v)) for k, v in (kv.split("=") for kv in a.tuning.split(",") if kv))
  for row in rows:
    if row not in ROWS:
      p.error(f"--rows: unknown row {row!r}; one of {', '.join(ROWS)}")
  if a.shape:
    cases = {"shape": ("sparse_mla_decode", dict(kv.split("=") for kv in a.shape.split(",")))}
  else:
    cases = {c: CASES[c] for c in a.cases.split(",")}
  os.makedirs(a.out, exist_ok=True)
  if a.lower_only:
    for name, (op, shape) in cases.items():
      lower_rows(op, shape, rows, tuning)
      if a.timeline:
        lower_timeline(op, shape, a.out, a.timeline_space, tuning)
    return 0
  if a.timeline:   # every requested row, ablations too (a timeline checks no values)
    report = []
    for name, (op, shape) in cases.items():
      for row in rows:
        with patched(row):
          report += timeline(name if row == "none" else f"{name}_{row}", op, shape, a.out, a.timeline_space,
                             tuning)
      with open(os.path.join(a.out, "timeline.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    return 0
  report = []
  for name, (op, shape) in cases.items():
    if a.ptxas:
      for row in [r for r in rows if r in CHECKED]:
        with patched(row):
          rep = ptxas_report(name if row == "none" else f"{name}_{row}", op, shape, a.out, tuning)
        print(json.dumps(rep, indent=1), flush=True)
        report.append(rep)
    report += time_rows(name, op, shape, rows, a.iters, tuning)
    with open(os.path.join(a.out, "diagnose.json"), "w") as f:
      json.dump(report, f, indent=1, default=str)
  return 0


if __name__ == "__main__":
  sys.exit(main())
