"""Runs one op's implementation a few times on bench-spec inputs, for a profiler to attach to (no timing here).

  PYTHONPATH=. ncu --clock-control none -k regex:mosaic --launch-skip 2 --launch-count 1 --section SpeedOfLight \
      python3 benchmarks/ncu_driver.py sparse_mla_decode --shape B=128,s_q=4,H=8 [--impl mosaic] [--calls 3]

Every call is synchronised; the first calls compile and warm up, so profile with ``--launch-skip``. Used by
benchmarks/ncu_profile_gpu.sh.
"""
import argparse

import jax

from mla_pallas import bench


def main():
  p = argparse.ArgumentParser()
  p.add_argument("op")
  p.add_argument("--shape", default=None, help="shape overrides, as for `mla-pallas bench --shape`")
  p.add_argument("--impl", default="mosaic")
  p.add_argument("--calls", type=int, default=3)
  a = p.parse_args()
  spec = bench.get_spec(a.op)
  shape = spec.shape(bench.parse_shape(a.shape))
  args = tuple(spec.make_inputs(shape, jax.random.key(0)))
  fn = spec.op(a.impl, shape, interpret=False)
  if spec.state is not None:   # a donated cache, as in the bench: each call's output feeds the next call
    step, s = bench._state_step(fn, spec.state), bench._state_sets([args], spec.state)[0]
    call = lambda: step(s)   # noqa: E731
  else:
    f = jax.jit(fn)
    call = lambda: f(*args)   # noqa: E731
  for _ in range(a.calls):
    jax.block_until_ready(call())
  print(f"{a.op} {a.impl} {shape}: {a.calls} calls done")


if __name__ == "__main__":
  main()
