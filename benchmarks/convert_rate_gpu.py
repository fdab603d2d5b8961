"""Throughput of the conversions and ex2 the sparse kernels issue, alone and mixed (a micro-benchmark, GPU).

Why: in the sparse heads-on-M kernel the producer's softmax (32 ``ex2.approx.ftz`` and 16 f32 -> f16x2
conversions per thread and tile) shares each SMSP with two multiplier warps that convert 64 e4m3x2 -> f16x2 per
thread and tile. When the multipliers stopped converting ("producer_vt8x2", thirtieth session; since deleted,
docs/kernels/sparse_decode_sm90.md) the softmax took 1193 instead of 1432 cycles per tile, and when the producer
took 48 more conversions per thread its store grew by 268 cycles (RESULTS.md, thirtieth session). Both fit a
quarter-rate pipe that conversions and ex2 would share; this measured it. Result (H200, thirty-first session,
benchmarks/raw/gpu_s31_2026-12-04/call1/convert_rate.txt): conversions and ex2 do not share a pipe. Half ex2,
half cvt.f16x2.e4m3x2 run 31.8 instructions per clock per SM, the same as ex2 + fma (31.7); ex2 alone 16.0,
cvt.f16x2.e4m3x2 alone 51.0.

Each CTA (one per SM, ``--waves`` per SM) runs 4 warpgroups; every thread runs 16 independent chains (the
registers of an f32 (64, 64) WGMMA-layout array) of ``--reps`` x 8 instructions of one kind, or half of its
chains of each of two kinds ("a+b"). Reported: instructions (per thread) completed per clock per SM
at the measured SM clock, against the CUDA guide's 16 (conversions, MUFU) or 64-128 (ALU) per clock per SM.

    python3 benchmarks/convert_rate_gpu.py               # ~30 s on the H200
    python3 benchmarks/convert_rate_gpu.py --lower-only  # CPU: lower every kernel for sm_90a
"""
from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src.lib.mlir import ir
from jax._src.lib.mlir.dialects import arith, vector
from jax.experimental.mosaic.gpu import fragmented_array as fa
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas import bench_timing, testing
from mla_pallas.kernels import common
from mla_pallas.kernels.raw_mgpu import asm

SMS = 132
INNER = 8
# one instruction of each kind on an f32 register's bits, the result fed back as the next input (a chain)
KINDS = {
    "cvt.f16x2.e4m3x2": "{\n.reg .b16 l, h;\nmov.b32 {l, h}, $1;\ncvt.rn.f16x2.e4m3x2 $0, l;\n}",
    "cvt.f16x2.f32": "cvt.rn.f16x2.f32 $0, $1, $1;",
    "cvt.e4m3x2.f32": "{\n.reg .b16 d;\ncvt.rn.satfinite.e4m3x2.f32 d, $1, $1;\nmov.b32 $0, {d, d};\n}",
    "cvt.e4m3x2.f16x2": "{\n.reg .b16 d;\ncvt.rn.satfinite.e4m3x2.f16x2 d, $1;\nmov.b32 $0, {d, d};\n}",
    "ex2.approx.ftz": "ex2.approx.ftz.f32 $0, $1;",
    "fma.f32": "fma.rn.f32 $0, $1, $1, $1;",
    "prmt": "prmt.b32 $0, $1, $1, 0x2103;",   # a byte rotation (no identity to fold away)
}
DEFAULT_ROWS = ("cvt.f16x2.e4m3x2", "cvt.f16x2.f32", "cvt.e4m3x2.f32", "cvt.e4m3x2.f16x2", "ex2.approx.ftz",
                "fma.f32", "prmt", "ex2.approx.ftz+cvt.f16x2.e4m3x2", "ex2.approx.ftz+cvt.f16x2.f32",
                "ex2.approx.ftz+fma.f32")


def _apply(x, kinds):
  """Inside ``inline_mgpu``: INNER instructions on each value of ``x`` (f32 (64, 64), WGMMA layout: 16 registers
  of two values per thread); register i takes ``kinds[i % len(kinds)]``."""
  f32 = ir.F32Type.get()
  regs = x.registers.copy()
  for i, pos in enumerate(np.ndindex(regs.shape)):
    kind = kinds[i % len(kinds)]
    vals = [vector.extract(regs[pos], [], [j]) for j in range(2)]
    for _ in range(INNER):
      vals = [_one(kind, v) for v in vals]
    regs[pos] = vector.from_elements(ir.VectorType.get((2,), f32), vals)
  return fa.FragmentedArray(_registers=regs, _layout=x.layout, _is_signed=None)


def _one(kind: str, v):
  """One instruction of ``kind`` on the f32 value ``v`` (its bits reinterpreted where the instruction is not an
  f32 one)."""
  f32, i32 = ir.F32Type.get(), ir.IntegerType.get_signless(32)
  if kind.startswith(("ex2", "fma")):
    return asm(f32, [v], KINDS[kind], "=f,f")
  return arith.bitcast(f32, asm(i32, [arith.bitcast(i32, v)], KINDS[kind], "=r,r"))


def build(kinds: tuple[str, ...], reps: int, ctas: int):
  """The kernel: out [ctas, 64, 64] f32 (every thread's final registers, so no chain is dead code)."""
  def body(o_gmem):
    x = plgpu.layout_cast(jnp.full((64, 64), 0.75, jnp.float32), plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                       return_type=plgpu.ShapeDtypeStruct((64, 64), jnp.float32, layout=plgpu.Layout.WGMMA))
    def step_fn(ctx, x):
      del ctx
      return _apply(x, kinds)

    x = lax.fori_loop(0, reps, lambda i, x: step_fn(x), x)

    @pl.when(lax.axis_index("wg") == 0)
    def _():
      o_gmem.at[lax.axis_index("c")][...] = x

  return plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((ctas, 64, 64), jnp.float32), grid=(ctas,),
                      grid_names=("c",), num_threads=4, thread_name="wg",
                      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--rows", default=",".join(DEFAULT_ROWS))
  p.add_argument("--reps", type=int, default=4096)
  p.add_argument("--waves", type=int, default=2)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--clock-mhz", type=float, default=1980.0, help="SM clock for the per-clock rates")
  p.add_argument("--lower-only", action="store_true")
  a = p.parse_args(argv)
  ctas = SMS * a.waves
  for row in a.rows.split(","):
    kinds = tuple(row.split("+"))
    kern = build(kinds, 4 if a.lower_only else a.reps, ctas)
    if a.lower_only:
      testing.lower_for_cuda(kern, arch=(9, 0))
      print(f"{row}: lowered", flush=True)
      continue
    us = statistics.median(bench_timing.time_cupti(kern, [()], iters=a.iters, warmup=1)[0])
    instr = ctas * 512 * 32 * a.reps * INNER          # thread-level instructions (32 f32 values per thread)
    per_clk = instr / SMS / (us * 1e-6 * a.clock_mhz * 1e6)
    print(f"{row:36s} {us:9.1f} us  {per_clk:6.1f} per clock per SM", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
