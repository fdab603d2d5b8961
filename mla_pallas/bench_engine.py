"""The benchmark engine of :mod:`mla_pallas.bench`: :class:`BenchSpec`, timing, :class:`Result`, tables, JSON.

This module knows no op: the specs live in :mod:`mla_pallas.bench_specs` (which imports this module) and
:mod:`mla_pallas.bench` is the public entry point (registry accessor, ``run(op, ...)``). :func:`run_spec` runs one
spec.

Timing (the functions are in :mod:`mla_pallas.bench_timing`):

* **GPU: CUPTI** (``jax.experimental.mosaic.gpu.profiler.measure``): device time of every kernel launched by the
  op, no dispatch overhead. The input sets are *rotated*: one jitted program runs the op once on each of the
  ``n_inputs`` sets in sequence, sized so that their combined traffic exceeds twice the L2, and each CUPTI
  iteration yields one sample = (sum of all kernel times) / ``n_inputs``. Measuring the sets one at a time would
  not do: ``measure`` runs a warm-up call on the same inputs right before it, which leaves them in L2.
  Samples per impl = ``iters``; the per-kernel breakdown (median over iterations, per call) is kept in the JSON.
* **CPU (or no CUPTI): wall clock** around ``block_until_ready`` of single calls, labelled ``wall`` everywhere;
  samples per impl = ``iters * n_inputs``. Wall-clock figures include dispatch and are not comparable to CUPTI
  figures.

Conventions: FLOPs follow FlashMLA, 2 * H * (576 + 512) per query token and attended key; "gathered bytes"
count one 576-byte fp8 row per query token and top-k entry (FlashMLA's convention: each query token's gather
is counted, even when tokens of a sequence share rows).

Ops that update a buffer in place (the fp8 cache: ``BenchSpec.state``) are timed with that buffer donated and each
call's output fed to the next call (:func:`time_cupti_state`, :func:`time_wall_state`), as a serving loop runs
them; otherwise XLA would copy the whole cache in every call. In the CUPTI per-kernel breakdown a kernel name
repeated within one call gets ``#2``, ``#3``, ... in launch order (every Mosaic kernel is
"anonymous_mosaic_gpu_kernel"), so the stages of a graph stay apart.

Sweeps: ``run_spec(..., candidates={label: tuning})`` replaces the "mosaic" row by one row per candidate (impl
"mosaic", ``Result.candidate`` = label, ``Result.tuning`` = the (field, value) pairs), each built by the spec's
``tuned_op`` and checked against the reference like any other row.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import subprocess
import sys
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mla_pallas import testing
from mla_pallas.bench_timing import l2_bytes, time_cupti, time_cupti_state, time_wall, time_wall_state

__all__ = ["BenchSpec", "Result", "parse_shape", "run_spec", "format_table", "plot", "write_outputs",
           "environment", "l2_bytes", "time_wall", "time_cupti", "time_wall_state", "time_cupti_state", "IMPLS",
           "D_QK", "D_V"]

D_QK = 576
D_V = 512
FP8 = jnp.float8_e4m3fn
#: implementations a benchmark can compare ("auto" resolves inside the op).
IMPLS = ("xla", "mosaic", "auto")
_MIN_GPU_ITERS = 10


# ----------------------------------------------------------------------------------------------------------
# Op lookup
# ----------------------------------------------------------------------------------------------------------

def _public_op(name: str, module: str | None = None) -> Callable:
  """The public op ``mla_pallas.<name>`` (``op(*args, ..., impl=, interpret=)``), else ``module.<name>``.

  Raises NotImplementedError (reported as "unavailable") when neither exists yet.
  """
  import importlib
  import mla_pallas
  fn = getattr(mla_pallas, name, None)
  if fn is None and module:
    try:
      fn = getattr(importlib.import_module(module), name, None)
    except ImportError:
      fn = None
  if fn is None:
    raise NotImplementedError(f"mla_pallas.{name} is not importable")
  return fn


def _reference(name: str) -> Callable:
  from mla_pallas import reference
  return getattr(reference, name)


# ----------------------------------------------------------------------------------------------------------
# Specs
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class BenchSpec:
  """How to benchmark one op.

  Attributes:
    name: public op name (``mla_pallas.<name>``).
    keys: shape key -> (type, description); ``int`` or ``float``.
    cpu_defaults, gpu_defaults: default shape on a CPU / a GPU (every key).
    preset: (preset name) -> shape overrides (e.g. the heads and top-k of the model).
    validate: (shape) -> None, raises ValueError naming the key.
    make_inputs: (shape, PRNG key) -> tuple of arrays (the positional args of the op); jit-able.
    op_kwargs: (shape) -> static keyword args of the op and the reference (softmax_scale, ...).
    flops, gathered_bytes: (shape) -> number, for TFLOP/s and GB/s.
    set_bytes: (shape) -> bytes allocated by one input set.
    touched_bytes: (shape) -> bytes one call reads and writes (decides how many sets to rotate through).
    tolerance: (shape) -> rel-L2 tolerance of the output against the reference.
    outputs: names of the op's outputs (first one is the main output).
    module: module defining the op, used while ``mla_pallas/__init__.py`` does not export it.
  """
  name: str
  keys: dict[str, tuple[type, str]]
  cpu_defaults: dict[str, Any]
  gpu_defaults: dict[str, Any]
  preset: Callable[[str], dict[str, Any]]
  validate: Callable[[dict], None]
  make_inputs: Callable[[dict, jax.Array], tuple]
  op_kwargs: Callable[[dict], dict]
  flops: Callable[[dict], float]
  gathered_bytes: Callable[[dict], float]
  set_bytes: Callable[[dict], float]
  touched_bytes: Callable[[dict], float]
  tolerance: Callable[[dict], float]
  outputs: tuple[str, ...] = ("out",)
  module: str | None = None
  #: optional (shape) -> keyword args of the op only, not of the reference (e.g. batch_invariant).
  op_only_kwargs: Callable[[dict], dict] | None = None
  #: optional (impl, shape, interpret) -> callable, instead of ``partial(mla_pallas.<name>, **op_kwargs, impl=)``.
  make_op: Callable[[str, dict, Any], Callable] | None = None
  #: optional (shape) -> callable, instead of ``partial(mla_pallas.reference.<name>, **op_kwargs)``.
  make_reference: Callable[[dict], Callable] | None = None
  #: implementations besides IMPLS that only this spec has (e.g. "copy": a device copy of the op's bytes); they
  #: are part of ``--impl all``.
  extra_impls: tuple[str, ...] = ()
  #: (input index, output index): the op consumes (donates) that input and returns its new value at that output
  #: (a cache updated in place). Timing then donates it and feeds each call's output to the next call, as a
  #: serving loop does; without this, XLA would copy the whole buffer in every call.
  state: tuple[int, int] | None = None
  #: what ``gathered_bytes`` counts: "gathered" (FlashMLA's convention) or "moved" (bytes read + written).
  bytes_kind: str = "gathered"
  #: conventions written to the JSON (default: FlashMLA's FLOPs / gathered bytes).
  conventions: dict[str, str] | None = None
  #: optional (impl, shape) -> dict, called after an impl ran: extra facts for the JSON (e.g. graph_report()).
  info: Callable[[str, dict], dict] | None = None
  #: evaluate the reference on the CPU backend (its float32 math is not float32-accurate when XLA:GPU compiles
  #: it: reference.quantize_and_bmm_fp8 came out 2.5e-2 rel-L2 off a float64 evaluation on an H200).
  reference_on_cpu: bool = False
  #: optional (shape) -> {label: tuning}: the op module's ``sweep_configs`` for this shape (``--sweep``).
  sweep: Callable[[dict], dict[str, tuple]] | None = None
  #: optional (shape, tuning, interpret) -> callable ``f(*inputs)``: the kernel with those TuningConfig overrides
  #: (the op's jitted private entry point that takes ``tuning=``); required with ``sweep``.
  tuned_op: Callable[[dict, tuple, Any], Callable] | None = None

  def shape(self, overrides: dict[str, Any] | None = None, *, preset: str | None = None,
            gpu: bool | None = None) -> dict[str, Any]:
    """Full shape dict: platform defaults, then the preset, then ``overrides`` (values may be strings).

    Raises ValueError for an unknown key (listing the valid ones) or a bad value.
    """
    if gpu is None:
      gpu = _on_gpu()
    shape = dict(self.gpu_defaults if gpu else self.cpu_defaults)
    if preset:
      shape.update(self.preset(preset))
    for k, v in (overrides or {}).items():
      if k not in self.keys:   # accept another case when it is unambiguous (t= for T=)
        folded = [key for key in self.keys if key.lower() == str(k).lower()]
        if len(folded) != 1:
          raise ValueError(f"unknown shape key {k!r} for {self.name}; valid keys: {', '.join(self.keys)}")
        k = folded[0]
      typ = self.keys[k][0]
      try:
        if typ is str:
          shape[k] = str(v)
        elif typ is int:
          fv = float(v)
          if not fv.is_integer():
            raise ValueError
          shape[k] = int(fv)
        else:
          shape[k] = float(v)
      except (TypeError, ValueError):
        raise ValueError(f"shape key {k!r} of {self.name} must be {typ.__name__}; got {v!r}") from None
    self.validate(shape)
    return shape

  def op(self, impl: str, shape: dict, *, interpret: bool = False) -> Callable:
    """Callable ``f(*inputs)`` running implementation ``impl`` of the op (traceable; not jitted)."""
    if self.make_op is not None:
      return self.make_op(impl, shape, interpret)
    extra = self.op_only_kwargs(shape) if self.op_only_kwargs is not None else {}
    return functools.partial(_public_op(self.name, self.module), **self.op_kwargs(shape), **extra, impl=impl,
                             interpret=interpret)

  def reference(self, shape: dict) -> Callable:
    """Callable ``f(*inputs)`` of the float32 reference (mla_pallas.reference)."""
    if self.make_reference is not None:
      return self.make_reference(shape)
    return functools.partial(_reference(self.name), **self.op_kwargs(shape))

  @property
  def impls(self) -> tuple[str, ...]:
    """Every implementation name this spec accepts."""
    return IMPLS + tuple(i for i in self.extra_impls if i not in IMPLS)

  @property
  def all_impls(self) -> tuple[str, ...]:
    """What ``--impl all`` runs: xla, mosaic, then the spec's extra impls."""
    return ("xla", "mosaic") + tuple(i for i in self.extra_impls if i not in ("xla", "mosaic"))


def parse_shape(text: str | None) -> dict[str, str]:
  """Parse ``"B=1,s_q=1,H=8"`` into ``{"B": "1", ...}`` (values converted by :meth:`BenchSpec.shape`)."""
  out: dict[str, str] = {}
  if not text:
    return out
  for item in text.split(","):
    item = item.strip()
    if not item:
      continue
    if "=" not in item:
      raise ValueError(f"--shape entries must look like key=value; got {item!r}")
    k, v = (s.strip() for s in item.split("=", 1))
    if not k or not v:
      raise ValueError(f"--shape entries must look like key=value; got {item!r}")
    out[k] = v
  return out


# ----------------------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------------------

def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def _git_info() -> dict[str, Any]:
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  info: dict[str, Any] = {"git_commit": None, "git_dirty": None}
  try:
    info["git_commit"] = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                                        text=True, timeout=10, check=True).stdout.strip() or None
    status = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True, timeout=10, check=True).stdout
    info["git_dirty"] = bool(status.strip())
  except (OSError, subprocess.SubprocessError):
    pass
  return info


def environment() -> dict[str, Any]:
  """Device kind, platform, jax/jaxlib versions, UTC date and git commit, for the JSON and RESULTS.md."""
  import jaxlib
  from mla_pallas import _dispatch
  return {
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "device_kind": testing.device_kind(),
      "platform": jax.default_backend(),
      "gpu_arch": _dispatch.gpu_arch(),
      "jax_version": jax.__version__,
      "jaxlib_version": getattr(jaxlib, "__version__", None),
      "python": sys.version.split()[0],
      **_git_info(),
  }


# ----------------------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Result:
  """Benchmark result of one implementation.

  ``status`` is "ok", "unavailable: <reason>" (the op raised NotImplementedError) or "error: <exception>".
  ``samples_us``: per-call times in microseconds (see the module docstring for what one sample is).
  ``check``: comparison with the float32 reference on input set 0 (output name -> Report.as_dict()), or None.
  ``kernels``: CUPTI only: kernel name -> median microseconds per call.
  ``interpret``: the op ran with ``interpret=True`` (the mosaic kernel in interpret mode; times meaningless).
  ``gathered_bytes`` / ``gathered_gbps``: bytes per call as ``bytes_kind`` says ("gathered": FlashMLA's gathered
  rows; "moved": bytes the op must read and write), and those bytes over the median time.
  """
  op: str
  impl: str
  shape: dict[str, Any]
  status: str = "ok"
  timer: str = ""
  samples_us: list[float] = dataclasses.field(default_factory=list)
  n_inputs: int = 0
  iters: int = 0
  warmup: int = 0
  flops: float = 0.0
  gathered_bytes: float = 0.0
  tolerance: float | None = None
  check: dict[str, Any] | None = None
  kernels: dict[str, float] | None = None
  speedup_vs_xla: float | None = None
  interpret: bool = False
  #: what ``gathered_bytes`` counts ("gathered" or "moved"; see BenchSpec.bytes_kind).
  bytes_kind: str = "gathered"
  #: specs with a "copy" impl: this impl's GB/s as a fraction of the copy's (same bytes, same run).
  frac_of_copy: float | None = None
  #: extra facts from BenchSpec.info (e.g. the graph's per-step implementations).
  info: dict[str, Any] | None = None
  #: sweeps: the candidate's label (a key of the op's ``sweep_configs``) and its (field, value) overrides.
  candidate: str | None = None
  tuning: tuple[tuple[str, Any], ...] | None = None

  @property
  def label(self) -> str:
    """impl name (``mosaic:<candidate>`` in a sweep), marked when the kernel ran in interpret mode."""
    name = f"{self.impl}:{self.candidate}" if self.candidate is not None else self.impl
    return f"{name}[interpret]" if self.interpret else name

  @property
  def ok(self) -> bool:
    return self.status == "ok"

  @property
  def available(self) -> bool:
    return not self.status.startswith("unavailable")

  def _pct(self, q: float) -> float | None:
    if not self.samples_us:
      return None
    return float(np.percentile(self.samples_us, q))

  @property
  def median_us(self) -> float | None:
    return self._pct(50)

  @property
  def p10_us(self) -> float | None:
    return self._pct(10)

  @property
  def p90_us(self) -> float | None:
    return self._pct(90)

  @property
  def tflops(self) -> float | None:
    m = self.median_us
    return self.flops / (m * 1e-6) / 1e12 if m and self.flops else None

  @property
  def gathered_gbps(self) -> float | None:
    m = self.median_us
    return self.gathered_bytes / (m * 1e-6) / 1e9 if m else None

  @property
  def rel_l2(self) -> float | None:
    if not self.check:
      return None
    return next(iter(self.check.values()))["rel_l2"]

  @property
  def check_ok(self) -> bool | None:
    if not self.check:
      return None
    return all(r["ok"] for r in self.check.values())

  def as_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d.update(median_us=self.median_us, p10_us=self.p10_us, p90_us=self.p90_us, tflops=self.tflops,
             gathered_gbps=self.gathered_gbps, rel_l2=self.rel_l2, check_ok=self.check_ok)
    return d


# ----------------------------------------------------------------------------------------------------------
# Run
# ----------------------------------------------------------------------------------------------------------

def _default_n_inputs(spec: BenchSpec, shape: dict) -> int:
  if not _on_gpu():
    return 2
  n = max(2, math.ceil(2 * l2_bytes() / max(spec.touched_bytes(shape), 1.0)))
  n = min(n, 64)
  try:
    limit = jax.devices()[0].memory_stats().get("bytes_limit")
  except Exception:  # noqa: BLE001 - memory_stats is optional
    limit = None
  if limit:  # keep the sets within 40% of device memory
    n = min(n, max(1, int(0.4 * limit // max(spec.set_bytes(shape), 1.0))))
  return n


def _progress_bar(total: int, desc: str, enabled: bool):
  if not enabled:
    return None
  try:
    from tqdm.auto import tqdm
  except ImportError:  # pragma: no cover
    return None
  return tqdm(total=total, desc=desc, unit="set", leave=False, file=sys.stderr)


def _check(spec: BenchSpec, shape: dict, fn: Callable, inputs: tuple, tol: float,
           ref_out=None) -> dict[str, Any]:
  got = jax.jit(fn)(*inputs)
  if ref_out is None:
    ref_out = jax.jit(spec.reference(shape))(*inputs)
  got = got if isinstance(got, (tuple, list)) else (got,)
  want = ref_out if isinstance(ref_out, (tuple, list)) else (ref_out,)
  reports = {}
  for name, g, w in zip(spec.outputs, got, want):   # only the outputs named in spec.outputs are compared
    t = tol.get(name) if isinstance(tol, dict) else tol
    reports[name] = testing.compare_fp8(g, w, rel_l2=t, what=f"{spec.name} {name}").as_dict()
  return reports


def _reference_out(spec: BenchSpec, shape: dict, inputs: tuple):
  ref = jax.jit(spec.reference(shape))
  if spec.reference_on_cpu and jax.default_backend() != "cpu":
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
      return ref(*jax.device_put(inputs, cpu))
  return ref(*inputs)


def _main_tol(spec: BenchSpec, tol) -> float | None:
  """The tolerance of the main output (``tolerance`` may return one float or {output name: float})."""
  if isinstance(tol, dict):
    return tol.get(spec.outputs[0])
  return tol


def _rows(spec: BenchSpec, impls: Sequence[str], candidates: dict[str, tuple] | None):
  """(impl, candidate label, tuning) per result row: ``impls`` in order, "mosaic" replaced by one row per
  candidate (appended at the end when ``impls`` has no "mosaic")."""
  if candidates is None:
    return [(i, None, None) for i in impls]
  if spec.tuned_op is None:
    raise ValueError(f"{spec.name} has no tuned_op: it cannot run sweep candidates")
  swept = [("mosaic", label, tuple(tuning)) for label, tuning in candidates.items()]
  rows = []
  for i in impls:
    rows += swept if i == "mosaic" else [(i, None, None)]
  return rows if "mosaic" in impls else rows + swept


def _mosaic_gate(spec: BenchSpec, shape: dict, inputs: tuple, interpret) -> Exception | None:
  """None when the plain "mosaic" impl traces on ``inputs`` (the op's own argument and support checks pass), else
  the exception it raised (NotImplementedError: no kernel can run here / for this input)."""
  try:
    jax.eval_shape(spec.op("mosaic", shape, interpret=interpret), *inputs)
  except Exception as e:  # noqa: BLE001 - the candidate rows report it
    return e
  return None


def run_spec(spec: BenchSpec, impls: Sequence[str] = ("xla", "mosaic"), shape: dict[str, Any] | None = None, *,
             preset: str | None = None, iters: int | None = None, warmup: int | None = None,
             n_inputs: int | None = None, check: bool = True, seed: int = 0, progress: bool = True,
             interpret: bool = False, timer: str | None = None,
             candidates: dict[str, tuple] | None = None) -> list[Result]:
  """Benchmark ``impls`` of ``spec``'s op side by side on the same input sets.

  Args:
    spec: the op's :class:`BenchSpec` (:func:`mla_pallas.bench.get_spec`).
    impls: implementations, each "xla", "mosaic" or "auto" (passed as ``impl=`` to ``mla_pallas.<op>``), or one of
      the spec's ``extra_impls`` ("copy": a device copy of the op's bytes).
    shape: overrides of the shape keys (see ``spec.keys``); the rest are platform defaults.
    preset: "deepseek_v32" or "glm5": sets H, topk and page from :mod:`mla_pallas.config` (before ``shape``).
    iters: timed iterations (GPU default 20, at least 10 recommended; CPU default 3).
    warmup: warm-up rounds (default 2 on GPU, 1 on CPU; the first compiles).
    n_inputs: input sets to rotate through (default: enough to exceed 2x L2 on a GPU, >= 2; 2 on a CPU).
    check: compare each implementation's outputs with mla_pallas.reference on input set 0.
    seed: PRNG seed of the inputs.
    progress: tqdm bar over (impl, input set) on stderr.
    interpret: pass ``interpret=True`` to the op (the mosaic kernel in GPU interpret mode: correctness only,
      the timings are meaningless).
    timer: "cupti" or "wall"; default cupti on a GPU, wall otherwise.
    candidates: sweep: {label: tuning} (the op module's ``sweep_configs``); the "mosaic" row becomes one row per
      candidate, run through ``spec.tuned_op`` (see :func:`_rows`). A candidate row is "unavailable" where the
      plain "mosaic" impl is (checked by tracing it once with ``jax.eval_shape``).
  Returns:
    one :class:`Result` per row, in order; ``speedup_vs_xla`` filled when "xla" ran.
  """
  op = spec.name
  shape = spec.shape(shape, preset=preset)
  gpu = _on_gpu()
  for impl in impls:
    if impl not in spec.impls:
      raise ValueError(f"impls entries must be one of {spec.impls}; got {impl!r}")
  if timer is None:
    timer = "cupti" if gpu else "wall"
  if timer == "cupti" and iters is not None and iters < _MIN_GPU_ITERS:
    print(f"warning: iters={iters} < {_MIN_GPU_ITERS}: medians of so few CUPTI samples are noisy",
          file=sys.stderr)
  if timer not in ("cupti", "wall"):
    raise ValueError(f"timer must be 'cupti' or 'wall'; got {timer!r}")
  iters = iters if iters is not None else (20 if gpu else 3)
  warmup = warmup if warmup is not None else (2 if gpu else 1)
  if iters < 1 or warmup < 0:
    raise ValueError(f"iters must be >= 1 and warmup >= 0; got iters={iters}, warmup={warmup}")
  n_inputs = n_inputs if n_inputs is not None else _default_n_inputs(spec, shape)
  if n_inputs < 1:
    raise ValueError(f"n_inputs must be >= 1; got {n_inputs}")

  keys = jax.random.split(jax.random.key(seed), n_inputs)
  sets = [tuple(spec.make_inputs(shape, k)) for k in keys]
  jax.block_until_ready(sets)
  tol = spec.tolerance(shape)
  ref_out = None
  if check:
    ref_out = _reference_out(spec, shape, sets[0])

  results = []
  rows = _rows(spec, impls, candidates)
  gate: list = []            # sweeps: the outcome of tracing the plain "mosaic" impl once (None: it traces)
  bar = _progress_bar(len(rows) * n_inputs, f"{op}", progress)
  for impl, candidate, tuning in rows:
    res = Result(op=op, impl=impl, shape=dict(shape), timer=timer, n_inputs=n_inputs, iters=iters,
                 warmup=warmup, flops=spec.flops(shape), gathered_bytes=spec.gathered_bytes(shape),
                 tolerance=_main_tol(spec, tol), interpret=interpret and impl in ("mosaic", "auto"),
                 bytes_kind=spec.bytes_kind, candidate=candidate, tuning=tuning)
    if bar is not None:
      bar.set_postfix_str(res.label)
    done = [0]

    def step():
      done[0] += 1
      if bar is not None:
        bar.update(1)

    try:
      if candidate is None:
        fn = spec.op(impl, shape, interpret=res.interpret)
      else:
        if not gate:
          gate.append(_mosaic_gate(spec, shape, sets[0], res.interpret))
        if gate[0] is not None:
          raise gate[0]
        fn = spec.tuned_op(shape, tuning, res.interpret)
      if spec.state is not None:
        t_cupti = functools.partial(time_cupti_state, state=spec.state)
        t_wall = functools.partial(time_wall_state, state=spec.state)
      else:
        t_cupti, t_wall = time_cupti, time_wall
      if timer == "cupti":
        try:
          res.samples_us, res.kernels = t_cupti(fn, sets, iters=iters, warmup=warmup, progress=step)
        except RuntimeError as e:
          if "CUPTI" not in str(e):
            raise
          print(f"warning: CUPTI unavailable ({e}); using wall clock", file=sys.stderr)
          res.timer = "wall"
          res.samples_us = t_wall(fn, sets, iters=iters, warmup=0)
      else:
        res.samples_us = t_wall(fn, sets, iters=iters, warmup=warmup, progress=step)
      if check and impl in IMPLS:      # extra impls (a device copy) compute something else
        res.check = _check(spec, shape, fn, sets[0], tol, ref_out)
      if spec.info is not None:
        res.info = spec.info(impl, shape)
    except NotImplementedError as e:
      res.status = f"unavailable: {' '.join(str(e).split())}"
      res.samples_us = []
    except Exception as e:  # noqa: BLE001 - report, keep benchmarking the other impls
      res.status = f"error: {type(e).__name__}: {' '.join(str(e).split())[:500]}"
      res.samples_us = []
    if bar is not None and done[0] < n_inputs:
      bar.update(n_inputs - done[0])
    results.append(res)
  if bar is not None:
    bar.close()

  base = next((r for r in results if r.impl == "xla" and r.ok), None)
  copy = next((r for r in results if r.impl == "copy" and r.ok and r.median_us), None)
  for r in results:
    if base is not None and r.ok and r.median_us:
      r.speedup_vs_xla = base.median_us / r.median_us
    if copy is not None and r.ok and r.median_us:
      r.frac_of_copy = copy.median_us / r.median_us     # same bytes: GB/s ratio = time ratio
  return results


# ----------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------

def _num(x, fmt):
  return "-" if x is None else format(x, fmt)


_KIND_SHORT = {"gathered": "gath", "moved": "moved"}


def format_table(results: Sequence[Result]) -> str:
  """Plain-text table: impl, timer, median/p10/p90 µs, TFLOP/s, gathered GB/s, speedup vs xla, rel-L2."""
  kind = results[0].bytes_kind if results else "gathered"
  with_copy = any(r.frac_of_copy is not None for r in results)
  head = ["impl", "timer", "median µs", "p10 µs", "p90 µs", "TFLOP/s", f"{_KIND_SHORT.get(kind, kind)} GB/s",
          "vs xla"]
  head += ["% copy BW"] if with_copy else []
  head += ["rel-L2", "check"]
  rows = []
  notes = []
  for r in results:
    if not r.ok:
      rows.append([r.label, r.timer] + ["-"] * (len(head) - 2))
      notes.append(f"  {r.label}: {r.status}")
      continue
    chk = "-" if r.check_ok is None else ("PASS" if r.check_ok else "FAIL")
    row = [r.label, r.timer, _num(r.median_us, ".1f"), _num(r.p10_us, ".1f"), _num(r.p90_us, ".1f"),
           _num(r.tflops, ".3g"), _num(r.gathered_gbps, ".4g"),
           "-" if r.speedup_vs_xla is None else f"{r.speedup_vs_xla:.3g}x"]
    if with_copy:
      row.append("-" if r.frac_of_copy is None else f"{100 * r.frac_of_copy:.0f}%")
    rows.append(row + [_num(r.rel_l2, ".2e"), chk])
  widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
  line = lambda cells: "  ".join(str(c).rjust(w) if i > 1 else str(c).ljust(w)  # noqa: E731
                                 for i, (c, w) in enumerate(zip(cells, widths)))
  out = [line(head), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]
  if results:
    r0 = results[0]
    shape = ",".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in r0.shape.items())
    out.insert(0, f"{r0.op}  [{shape}]  inputs={r0.n_inputs} iters={r0.iters}  "
                  f"GFLOP/call={r0.flops / 1e9:.3f}  {kind} MB/call={r0.gathered_bytes / 1e6:.2f}  "
                  f"tol rel-L2={_num(r0.tolerance, '.3g')}")
  for r in results:   # sweeps: each candidate's TuningConfig overrides
    if r.candidate is not None:
      out.append(f"  {r.label} = " + (", ".join(f"{k}={v!r}" for k, v in r.tuning) if r.tuning else "the op's default"))
  for r in results:   # which implementation each step of a graph ran (BenchSpec.info)
    steps = (r.info or {}).get("steps")
    if steps:
      out.append(f"  {r.label} ran: " + ", ".join(f"{st['op']}={st['impl']}" for st in steps))
  if notes:
    out.append("not run:")
    out += notes
  return "\n".join(out)


def _stem(op: str) -> str:
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S-%f")
  return f"{op}-{stamp}"


def plot(results: Sequence[Result], path: str, *, title: str = "") -> str:
  """Bar plot of median time (p10-p90 whiskers) and TFLOP/s per impl, written to ``path`` (PNG)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = [r.label for r in results]
  med = [r.median_us or 0.0 for r in results]
  lo = [max((r.median_us or 0.0) - (r.p10_us or 0.0), 0.0) for r in results]
  hi = [max((r.p90_us or 0.0) - (r.median_us or 0.0), 0.0) for r in results]
  by_bytes = not any(r.flops for r in results)      # memory-bound op without FLOPs: plot GB/s instead
  tf = [(r.gathered_gbps if by_bytes else r.tflops) or 0.0 for r in results]
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  x = np.arange(len(results))
  timers = sorted({r.timer for r in results if r.ok}) or ["-"]
  axes[0].bar(x, med, yerr=[lo, hi], capsize=4, color="tab:blue")
  axes[0].set_ylabel(f"median µs per call ({'/'.join(timers)}; whiskers p10-p90)")
  axes[1].bar(x, tf, color="tab:orange")
  axes[1].set_ylabel(f"{results[0].bytes_kind} GB/s" if by_bytes else "TFLOP/s")
  for ax in axes:
    ax.set_xticks(x, names)
  for i, r in enumerate(results):
    if not r.ok:
      for ax in axes:
        ax.text(i, 0, r.status.split(":")[0], ha="center", va="bottom", rotation=90, fontsize=8)
    elif r.speedup_vs_xla is not None:
      axes[0].text(i, med[i], f"{r.speedup_vs_xla:.3g}x", ha="center", va="bottom", fontsize=8)
  fig.suptitle(title, fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


_TIMER_CONVENTION = "cupti = device time of all kernels of one call; wall = host wall clock"


def _conventions(conventions: dict[str, str] | None) -> dict[str, str]:
  if conventions is not None:
    return {**conventions, "timer": _TIMER_CONVENTION}
  return {"flops": "2*H*(576+512) per query token and attended key (FlashMLA)",
          "gathered_bytes": "576 B per query token and top-k entry (FlashMLA)",
          "timer": _TIMER_CONVENTION}


def write_outputs(results: Sequence[Result], out_dir: str, *, make_plot: bool = True,
                  command: str | None = None, extra: dict[str, Any] | None = None,
                  conventions: dict[str, str] | None = None) -> dict[str, str]:
  """Write ``<op>-<UTC stamp>.json`` (every sample, shape, environment) and, unless disabled, a ``.png``.

  ``conventions``: the spec's ``BenchSpec.conventions`` (default: FlashMLA's FLOPs and gathered bytes).
  Returns {"json": path, "png": path (if written)}.
  """
  if not results:
    raise ValueError("results must not be empty")
  os.makedirs(out_dir, exist_ok=True)
  r0 = results[0]
  stem = os.path.join(out_dir, _stem(r0.op))
  env = environment()
  doc = {
      "op": r0.op, "shape": r0.shape, "command": command, **env,
      "n_inputs": r0.n_inputs, "iters": r0.iters, "warmup": r0.warmup, "flops": r0.flops,
      "gathered_bytes": r0.gathered_bytes,
      "bytes_kind": r0.bytes_kind,
      "conventions": _conventions(conventions),
      "results": [r.as_dict() for r in results],
      **(extra or {}),
  }
  paths = {"json": stem + ".json"}
  with open(paths["json"], "w") as f:
    json.dump(doc, f, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
  if make_plot:
    shape = ",".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r0.shape.items())
    title = f"{r0.op} [{shape}]\n{env['device_kind']}, jax {env['jax_version']}, {env['date']}"
    paths["png"] = plot(results, stem + ".png", title=title)
  return paths

