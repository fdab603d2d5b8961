"""wgmma throughput on the H200 by N, operand source, dtype and issuing warpgroups (a micro-benchmark, GPU).

Why: the sparse heads-on-M kernel issues 52 N = 64 wgmmas per 64-key tile (20 fp8 m64n64k32 for QKᵀ, 32 f16
m64n64k16 for P·V) and its tile takes about what 52 such instructions at half the peak rate would
(docs/kernels/sparse_decode_sm90.md, "producer_vt8x2"). Whether wider wgmmas (N = 128 / 256) run closer to the
peak per FLOP decides the next design, so this measures it directly: every CTA (one per SM, ``--waves`` of them
per SM) runs ``--warpgroups`` warpgroups, each accumulating ``--reps`` x 4 wgmmas (one K = 128-byte operand
pair per ``plgpu.wgmma`` call: 4 k-steps) into its own accumulator from SMEM operands that never change; A from
SMEM (SS) or registers (RS). Reported: achieved TFLOP/s (2·M·N·K per instruction) against the H200's dense
peaks (989 f16, 1979 fp8) and ns per instruction per SM. CUPTI device time, median of ``--iters``.

    python3 benchmarks/wgmma_rate_gpu.py                 # the default grid (~1 minute on the H200)
    python3 benchmarks/wgmma_rate_gpu.py --lower-only    # CPU: lower every kernel for sm_90a
"""
from __future__ import annotations

import argparse
import itertools
import statistics

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas import bench_timing, testing
from mla_pallas.kernels import common

M = 64
SMS = 132
PEAK = {"f16": 989.0, "fp8": 1979.0}   # H200 dense TFLOP/s


def _dtype(name: str):
  return jnp.float16 if name == "f16" else jnp.float8_e4m3fn


def build(dtype: str, n: int, a_regs: bool, warpgroups: int, reps: int, ctas: int):
  """The kernel: out [ctas, warpgroups, 64, 8] f32 (a slice of each accumulator, so nothing is dead code)."""
  dt = _dtype(dtype)
  k = 128 // jnp.dtype(dt).itemsize         # one 128-byte swizzled K chunk: 64 f16 or 128 fp8 (4 k-steps)

  def body(a_gmem, b_gmem, o_gmem, a_smem, b_smem, bar):
    wg = lax.axis_index("wg")

    @pl.when(wg == 0)
    def _():
      plgpu.copy_gmem_to_smem(a_gmem, a_smem, bar)
      plgpu.copy_gmem_to_smem(b_gmem, b_smem, bar)
    plgpu.barrier_wait(bar)
    layout = plgpu.Layout.WGMMA_8BIT if dtype == "fp8" else plgpu.Layout.WGMMA
    a_op = plgpu.load(a_smem, layout=layout, optimized=False) if a_regs else a_smem

    def scope(acc_ref):
      def step(i, carry):
        plgpu.wgmma(acc_ref, a_op, b_smem.T)
        plgpu.wgmma_wait(1)
        return carry
      lax.fori_loop(0, reps, step, 0)
      plgpu.wgmma_wait(0)
      return acc_ref[...]
    acc = pl.run_scoped(scope, plgpu.ACC((M, n), jnp.float32))
    o_gmem.at[lax.axis_index("c"), wg][...] = acc[:, :8]

  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((ctas, warpgroups, M, 8), jnp.float32), grid=(ctas,), grid_names=("c",),
      num_threads=warpgroups, thread_name="wg",
      scratch_types=[plgpu.SMEM((M, k), dt, transforms=common.swizzled(dt, 128)),
                     plgpu.SMEM((n, k), dt, transforms=common.swizzled(dt, 128)),
                     plgpu.Barrier(num_arrivals=2)],
      compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE)), k


def _inputs(dtype: str, n: int, k: int):
  dt = _dtype(dtype)
  a = (jax.random.normal(jax.random.key(0), (M, k), jnp.float32) * 0.1).astype(dt)
  b = (jax.random.normal(jax.random.key(1), (n, k), jnp.float32) * 0.1).astype(dt)
  return a, b


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--dtypes", default="f16,fp8")
  p.add_argument("--n", default="64,128,256")
  p.add_argument("--a", default="smem,regs")
  p.add_argument("--warpgroups", default="1,2,3")
  p.add_argument("--reps", type=int, default=2048)
  p.add_argument("--waves", type=int, default=2)
  p.add_argument("--iters", type=int, default=10)
  p.add_argument("--lower-only", action="store_true")
  a = p.parse_args(argv)
  for dtype, n, src, w in itertools.product(a.dtypes.split(","), [int(x) for x in a.n.split(",")],
                                            a.a.split(","), [int(x) for x in a.warpgroups.split(",")]):
    ctas = SMS * a.waves
    kern, k = build(dtype, n, src == "regs", w, 8 if a.lower_only else a.reps, ctas)
    args = _inputs(dtype, n, k)
    name = f"{dtype} m64n{n}k{k // 4} A {src:4s} x{w} WG"
    if a.lower_only:
      testing.lower_for_cuda(kern, *args, arch=(9, 0))
      print(f"{name}: lowered", flush=True)
      continue
    us = statistics.median(bench_timing.time_cupti(kern, [args], iters=a.iters, warmup=1)[0])
    instr = ctas * w * a.reps * 4                 # wgmma instructions in all
    tflops = instr * 2 * M * n * (k // 4) / (us * 1e-6) / 1e12
    ns = us * 1e3 / (instr / SMS)
    print(f"{name}: {us:9.1f} us  {tflops:7.1f} TFLOP/s ({100 * tflops / PEAK[dtype]:5.1f} % of peak)  "
          f"{ns:6.2f} ns/instr/SM", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
