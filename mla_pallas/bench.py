"""Side-by-side benchmarks of the implementations of one op (XLA vs the Mosaic GPU kernel).

Usage (Python)::

  from mla_pallas import bench
  results = bench.run("sparse_mla_decode", impls=("xla", "mosaic"), shape={"B": 64, "H": 64})
  print(bench.format_table(results))
  bench.write_outputs(results, "results/")          # JSON with every sample + PNG bar plot
  bench.run("quantize_and_bmm_fp8", ("xla", "mosaic"), sweep=True)   # one row per sweep candidate

or the console script ``mla-pallas bench sparse_mla_decode --impl all --preset glm5 [--sweep]``
(:mod:`mla_pallas.cli`).

Modules: :mod:`mla_pallas.bench_engine` (:class:`BenchSpec`, :class:`Result`, tables, JSON; knows no op) with its
timing in :mod:`mla_pallas.bench_timing`; :mod:`mla_pallas.bench_specs` (one spec per op; imports the engine); and
this one, the registry accessor (:func:`specs`, :func:`get_spec`; imports the specs on first use) and the per-op
entry points :func:`run`, :func:`sweep_candidates`, :func:`write_outputs`. Timing and conventions: see :mod:`mla_pallas.bench_engine`.

Sweeps: ``sweep=True`` (``--sweep``) runs the op's Mosaic GPU kernel once per candidate of
``mla_pallas.ops.<module>.sweep_configs(...)`` (labelled TuningConfig overrides, the first ``"default": ()``), each
passed as ``tuning=`` to the op's jitted private entry point, each row labelled ``mosaic:<candidate>``.
"""
from __future__ import annotations

from typing import Any, Sequence

from mla_pallas import bench_engine as _engine
from mla_pallas.bench_engine import (D_QK, D_V, IMPLS, BenchSpec, Result, environment, format_table,  # noqa: F401
                                     parse_shape, plot, run_spec)
from mla_pallas.bench_timing import (l2_bytes, time_cupti, time_cupti_state, time_wall,  # noqa: F401
                                     time_wall_state)

__all__ = ["BenchSpec", "Result", "specs", "get_spec", "sweep_candidates", "parse_shape", "run", "format_table",
           "plot", "write_outputs", "environment", "time_wall", "time_cupti", "time_wall_state", "time_cupti_state",
           "IMPLS", "D_QK", "D_V"]


def specs() -> dict[str, BenchSpec]:
  """Op name -> :class:`BenchSpec` of every benchmark (:mod:`mla_pallas.bench_specs`, imported on first use)."""
  from mla_pallas import bench_specs
  return bench_specs.SPECS


def get_spec(op: str) -> BenchSpec:
  """The spec of ``op``; ValueError naming the available ops otherwise."""
  table = specs()
  if op not in table:
    raise ValueError(f"no benchmark for op {op!r}; available: {', '.join(sorted(table))}")
  return table[op]


def __getattr__(name: str):
  if name == "SPECS":          # bench.SPECS: the registry, imported lazily like specs()
    return specs()
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def sweep_ops() -> tuple[str, ...]:
  """The ops whose spec has sweep candidates (``--sweep``)."""
  return tuple(name for name, spec in specs().items() if spec.sweep is not None)


def sweep_candidates(op: str, shape: dict[str, Any]) -> dict[str, tuple]:
  """{label: tuning} of ``op`` at the full ``shape`` (:meth:`BenchSpec.shape`): the op module's ``sweep_configs``.

  Raises ValueError when ``op`` has no sweep (naming the ops that have one), when its module does not define
  ``sweep_configs``, or when that returns something other than a non-empty dict whose first entry is
  ``"default": ()`` and whose values are tuples of (field name, value) pairs.
  """
  spec = get_spec(op)
  if spec.sweep is None:
    raise ValueError(f"{op} has no sweep candidates; --sweep works for: {', '.join(sweep_ops())}")
  cands = spec.sweep(shape)
  if not isinstance(cands, dict) or not cands:
    raise ValueError(f"sweep_configs of {op} must return a non-empty dict; got {cands!r}")
  first = next(iter(cands.items()))
  if first != ("default", ()):
    raise ValueError(f"sweep_configs of {op} must start with 'default': (); got {first!r}")
  for label, tuning in cands.items():
    ok = isinstance(label, str) and isinstance(tuning, tuple) and all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in tuning)
    if not ok:
      raise ValueError(f"sweep_configs of {op}: entry {label!r} must be a tuple of (field name, value) pairs; "
                       f"got {tuning!r}")
  return cands


def run(op: str, impls: Sequence[str] = ("xla", "mosaic"), shape: dict[str, Any] | None = None, *,
        preset: str | None = None, sweep: bool = False, **kw) -> list[Result]:
  """Benchmark ``impls`` of ``op`` side by side on the same input sets (:func:`mla_pallas.bench_engine.run_spec`).

  Args:
    op: a key of :func:`specs` ("sparse_mla_decode", "sparse_mla_prefill", "dense_mla_decode", "mla_prefill",
      "quantize_and_bmm_fp8", "fused_rope_rmsnorm_quantization", "rope_rmsnorm", "mla_decode_step",
      "mla_prefill_step", "mla_layer_decode").
    impls, shape, preset, kw (iters, warmup, n_inputs, check, seed, progress, interpret, timer): see
      :func:`~mla_pallas.bench_engine.run_spec`.
    sweep: replace the "mosaic" row by one row per candidate of :func:`sweep_candidates` (appended when
      ``impls`` has no "mosaic").
  """
  spec = get_spec(op)
  full = spec.shape(shape, preset=preset)
  cands = sweep_candidates(op, full) if sweep else None
  return run_spec(spec, impls, full, candidates=cands, **kw)


def write_outputs(results: Sequence[Result], out_dir: str, **kw) -> dict[str, str]:
  """:func:`mla_pallas.bench_engine.write_outputs` with the conventions of the results' op."""
  if not results:
    raise ValueError("results must not be empty")
  spec = specs().get(results[0].op)
  return _engine.write_outputs(results, out_dir, conventions=spec.conventions if spec else None, **kw)
