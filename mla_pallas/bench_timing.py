"""Timing of the benchmark engine (:mod:`mla_pallas.bench_engine`): wall clock and CUPTI, plain and stateful.

* :func:`time_wall` / :func:`time_cupti`: ``fn(*set)`` rotated over the input sets (see the engine's docstring for
  what one sample is).
* :func:`time_wall_state` / :func:`time_cupti_state`: an op that updates one input in place (``BenchSpec.state``):
  that input is donated and each call's output feeds the next call on the same set, as a serving loop runs it.
* :func:`l2_bytes`: the L2 size by device kind (how many input sets to rotate through).
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from mla_pallas import testing

__all__ = ["time_wall", "time_cupti", "time_wall_state", "time_cupti_state", "l2_bytes"]

# L2 sizes by device_kind substring (bytes); unknown GPUs get 128 MiB (rotating more sets only costs memory).
# H200: 60 MB as PyTorch reported it on this workplace's machines (KINDS.md).
_L2_BYTES = (("H100", 50 << 20), ("H200", 60 << 20), ("H800", 50 << 20), ("H20", 60 << 20),
             ("GH200", 50 << 20), ("B200", 126 << 20), ("B300", 126 << 20), ("GB200", 126 << 20),
             ("A100", 40 << 20))


def l2_bytes(kind: str | None = None) -> int:
  kind = kind if kind is not None else testing.device_kind()
  for name, size in _L2_BYTES:
    if name in kind:
      return size
  return 128 << 20


def time_wall(fn: Callable, sets: Sequence[tuple], *, iters: int, warmup: int,
              progress: Callable[[], None] | None = None) -> list[float]:
  """Wall-clock microseconds of ``fn(*set)`` (jitted; block_until_ready), rotating over the sets.

  ``warmup`` rounds over all sets first (the first one compiles); returns ``iters * len(sets)`` samples.
  """
  f = jax.jit(fn)
  for i, s in enumerate(sets):
    jax.block_until_ready(f(*s))
    if progress:
      progress()
  for _ in range(max(warmup - 1, 0)):
    for s in sets:
      jax.block_until_ready(f(*s))
  samples = []
  for _ in range(iters):
    for s in sets:
      t0 = time.perf_counter()
      jax.block_until_ready(f(*s))
      samples.append((time.perf_counter() - t0) * 1e6)
  return samples


def time_cupti(fn: Callable, sets: Sequence[tuple], *, iters: int, warmup: int,
               progress: Callable[[], None] | None = None) -> tuple[list[float], dict[str, float]]:
  """CUPTI device time per call in microseconds, rotating over ``sets`` (see the module docstring).

  Returns (samples, kernels): one sample per CUPTI iteration = total kernel time of one pass over all sets
  divided by ``len(sets)``; kernels = kernel name -> median microseconds per call.
  """
  from jax.experimental.mosaic.gpu import profiler
  single = jax.jit(fn)
  for s in sets:                      # compile, surface errors, touch every set once
    jax.block_until_ready(single(*s))
    if progress:
      progress()
  n = len(sets)
  rotated = jax.jit(lambda all_sets: [fn(*s) for s in all_sets])
  for _ in range(max(warmup, 1)):
    jax.block_until_ready(rotated(list(sets)))
  _, timings = profiler.measure(rotated, aggregate=False, iterations=iters)(list(sets))
  if timings is None:
    raise RuntimeError("CUPTI recorded no kernel launches")
  if iters == 1:
    timings = [timings]
  return _aggregate_cupti(timings, n)


def _state_sets(sets: Sequence[tuple], state: tuple[int, int]) -> list[list]:
  """Mutable copies of the input sets whose state input is a fresh copy (the callers' arrays stay valid)."""
  i_in, _ = state
  out = []
  for s in sets:
    s = list(s)
    s[i_in] = jax.tree.map(jnp.copy, s[i_in])
    out.append(s)
  jax.block_until_ready(out)
  return out


def _state_step(fn: Callable, state: tuple[int, int]) -> Callable[[list], Any]:
  """``step(set)``: one call of ``fn`` with the state input donated; the set's state becomes the new value."""
  i_in, i_out = state
  f = jax.jit(fn, donate_argnums=(i_in,))

  def step(s):
    out = f(*s)
    s[i_in] = out[i_out]
    return out
  return step


def _state_warm_up(fn, sets, state, warmup: int, progress):
  """The donating step and fresh state copies; one compiling call per set, then ``warmup - 1`` more passes."""
  step = _state_step(fn, state)
  sets = _state_sets(sets, state)
  for s in sets:
    jax.block_until_ready(step(s))
    if progress:
      progress()
  for _ in range(max(warmup - 1, 0)):
    for s in sets:
      step(s)
  jax.block_until_ready(sets)
  return step, sets


def time_wall_state(fn: Callable, sets: Sequence[tuple], state: tuple[int, int], *, iters: int, warmup: int,
                    progress: Callable[[], None] | None = None) -> list[float]:
  """:func:`time_wall` for an op that updates one input in place (``BenchSpec.state``): that input is donated
  and each call's output feeds the next call on the same set."""
  step, sets = _state_warm_up(fn, sets, state, warmup, progress)
  samples = []
  for _ in range(iters):
    for s in sets:
      t0 = time.perf_counter()
      jax.block_until_ready(step(s))
      samples.append((time.perf_counter() - t0) * 1e6)
  return samples


def _aggregate_cupti(iter_timings: Sequence[Sequence[tuple[str, float]]], n: int
                     ) -> tuple[list[float], dict[str, float]]:
  """Samples (µs per call) and kernel name -> median µs per call, from ``iter_timings`` (per iteration, the
  (name, ms) launches of one pass over ``n`` input sets).

  Where the pass splits into ``n`` equal runs of the same names (each set's call launched on its own), a name that
  occurs again within a call (every Mosaic GPU kernel is "anonymous_mosaic_gpu_kernel") gets "#2", "#3", ... in
  launch order, so that the stages of a graph stay apart. Where it does not (XLA compiled the pass as one program
  and interleaved the sets' launches), stages cannot be told from sets: every name gets its total per call, and
  repeated stages of one name are summed under it."""
  samples, per_kernel = [], {}
  for it in iter_timings:
    samples.append(sum(ms for _, ms in it) * 1e3 / n)
    per_call = len(it) // n if n and len(it) % n == 0 else 0
    calls = [it[i0:i0 + per_call] for i0 in range(0, len(it), per_call)] if per_call else []
    staged = bool(calls) and all([nm for nm, _ in c] == [nm for nm, _ in calls[0]] for c in calls)
    acc: dict[str, float] = {}
    for call in (calls if staged else [it]):
      seen: dict[str, int] = {}
      for name, ms in call:
        seen[name] = seen.get(name, 0) + 1
        label = name if seen[name] == 1 or not staged else f"{name}#{seen[name]}"
        acc[label] = acc.get(label, 0.0) + ms * 1e3 / n
    for name, us in acc.items():
      per_kernel.setdefault(name, []).append(us)
  return samples, {k: statistics.median(v) for k, v in per_kernel.items()}


def _cupti_ext():
  """The Mosaic GPU extension whose CUPTI hooks ``profiler.measure`` uses (RuntimeError without a CUDA build)."""
  try:
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib
    return mosaic_gpu_lib._mosaic_gpu_ext
  except (ImportError, AttributeError) as e:
    raise RuntimeError(f"CUPTI profiling is not available: {e}") from None


def time_cupti_state(fn: Callable, sets: Sequence[tuple], state: tuple[int, int], *, iters: int, warmup: int,
                     progress: Callable[[], None] | None = None) -> tuple[list[float], dict[str, float]]:
  """:func:`time_cupti` for an op that updates one input in place (``BenchSpec.state``).

  ``profiler.measure`` calls its function again and again on the same arguments, so it cannot donate; this runs
  the same CUPTI session around a Python loop instead: per iteration, one call on each set (state donated, the
  output fed to the next call on that set). One sample = kernel time of one pass over the sets / ``len(sets)``.
  """
  ext = _cupti_ext()
  step, sets = _state_warm_up(fn, sets, state, warmup + 1, progress)
  n = len(sets)
  ext._cupti_init()
  try:
    for _ in range(iters):
      for s in sets:
        step(s)
    jax.block_until_ready(sets)
  finally:
    timings = ext._cupti_get_timings(True)
  if not timings:
    raise RuntimeError("CUPTI recorded no kernel launches")
  if len(timings) % iters:
    raise RuntimeError(f"CUPTI recorded {len(timings)} kernel launches, not a multiple of iters={iters}")
  per = len(timings) // iters
  return _aggregate_cupti([timings[i * per:(i + 1) * per] for i in range(iters)], n)
