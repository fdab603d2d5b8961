"""Fixed costs of one small Pallas Mosaic GPU kernel on the GPU (CUPTI device time), to bound what a one-CTA
decode-size kernel (the rope op at T <= 8, the BMM at T = 1) can reach against XLA's fusions:

  empty            a 1-CTA kernel of 2 warpgroups that does nothing (its output is left unwritten)
  empty_smem       the same with 110 KB of dynamic SMEM (the rope kernel's size at T = 1)
  tma_load_store   one 64 x 64 bf16 TMA load into swizzled SMEM, wait, TMA store back, wait
  gather_store     the rope kernel's in-kernel table gather (position load, then 16-byte cos / sin loads;
                   kernels/rope_tables.py) into SMEM, then one TMA store of the 64 x 128 table tile
  xla_add1         XLA: x + 1 on the same 64 x 64 bf16 array (one fusion)

  PYTHONPATH=. python3 benchmarks/mosaic_floor_gpu.py    -> one line per kernel, JSON to $OUT (or results/)
"""
import json
import os
import statistics

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas import bench
from mla_pallas.kernels import common, rope_tables
from mla_pallas.kernels.common import swizzled

BF16 = jnp.bfloat16


def _kernel(body, out, scratch, threads=2):
  return plgpu.kernel(body, out_type=out, grid=(1,), grid_names=("c",), num_threads=threads, thread_name="wg",
                      scratch_types=scratch, compiler_params=plgpu.CompilerParams(lowering_semantics=common.LANE))


def _wg():
  return jax.lax.axis_index("wg")


def empty(smem_bytes=0):
  scratch = [plgpu.SMEM((smem_bytes,), jnp.uint8)] if smem_bytes else []

  def body(x, o, *scratch_refs):
    del x, o, scratch_refs
  k = _kernel(body, jax.ShapeDtypeStruct((64, 64), BF16), scratch)
  return lambda x, pos, cos, sin: k(x)


def tma_load_store():
  def body(x, o, buf, bar):
    @pl.when(_wg() == 0)
    def _():
      plgpu.copy_gmem_to_smem(x, buf, bar)
      plgpu.barrier_wait(bar)
      plgpu.copy_smem_to_gmem(buf, o)
      plgpu.wait_smem_to_gmem(0)
  k = _kernel(body, jax.ShapeDtypeStruct((64, 64), BF16),
              [plgpu.SMEM((64, 64), BF16, transforms=swizzled(BF16, 128)), plgpu.Barrier(num_arrivals=1)])
  return lambda x, pos, cos, sin: k(x)


def gather_store():
  def body(pos, cos, sin, o, tab):
    @pl.when(_wg() == 0)
    def _():
      rope_tables.gather_tables(pos, 0, cos, sin, tab, True)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(tab, o)
      plgpu.wait_smem_to_gmem(0)
  k = _kernel(body, jax.ShapeDtypeStruct((64, 128), jnp.int32), [plgpu.SMEM((64, 128), jnp.int32)])
  return lambda x, pos, cos, sin: k(pos, cos, sin)


def xla_add1():
  return lambda x, pos, cos, sin: x + jnp.asarray(1, BF16)


def main():
  out_dir = os.environ.get("OUT", "results")
  os.makedirs(out_dir, exist_ok=True)
  keys = jax.random.split(jax.random.key(0), 8)
  sets = []
  for k in keys:
    ka, kp = jax.random.split(k)
    x = jax.random.normal(ka, (64, 64), BF16)
    pos = jax.random.randint(kp, (64,), 0, 163840, jnp.int32)
    cos = jax.random.normal(kp, (163840, 32), jnp.float32)
    sets.append((x, pos, cos, cos + 1))
  jax.block_until_ready(sets)
  rows = {}
  for name, make in [("empty", empty), ("empty_smem", lambda: empty(110 * 1024)), ("tma_load_store", tma_load_store),
                     ("gather_store", gather_store), ("xla_add1", xla_add1)]:
    try:
      samples, kernels = bench.time_cupti(make(), sets, iters=20, warmup=2)
      rows[name] = dict(median_us=statistics.median(samples), kernels=kernels)
      print(f"{name:16s} {statistics.median(samples):6.2f} us   {kernels}", flush=True)
    except Exception as e:  # noqa: BLE001
      print(f"{name:16s} error: {type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True)
  with open(os.path.join(out_dir, "mosaic_floor.json"), "w") as fh:
    json.dump(dict(device=str(jax.devices()[0].device_kind), rows=rows), fh, indent=1)


if __name__ == "__main__":
  main()
