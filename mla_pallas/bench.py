"""Side-by-side benchmarks of the implementations of one op (XLA vs the Mosaic GPU kernel).

Usage (Python)::

  from mla_pallas import bench
  results = bench.run("sparse_mla_decode", impls=("xla", "mosaic"), shape={"B": 64, "H": 64})
  print(bench.format_table(results))
  bench.write_outputs(results, "results/")          # JSON with every sample + PNG bar plot

or the console script ``mla-pallas bench sparse_mla_decode --impl all --preset glm5`` (:mod:`mla_pallas.cli`).

Every op is described by a :class:`BenchSpec` in :data:`SPECS` (see :func:`register`): its shape keys and
defaults (small on the CPU, production-sized on a GPU), how to build one random input set, the callable of each
implementation, the float32 reference, FLOPs and bytes.

Timing:

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
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mla_pallas import testing

__all__ = ["BenchSpec", "Result", "SPECS", "register", "get_spec", "parse_shape", "run", "format_table",
           "write_outputs", "environment", "IMPLS", "D_QK", "D_V"]

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
      if k not in self.keys:
        raise ValueError(f"unknown shape key {k!r} for {self.name}; valid keys: {', '.join(self.keys)}")
      typ = self.keys[k][0]
      try:
        if typ is int:
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
    return functools.partial(_public_op(self.name, self.module), **self.op_kwargs(shape), impl=impl,
                             interpret=interpret)

  def reference(self, shape: dict) -> Callable:
    """Callable ``f(*inputs)`` of the float32 reference (mla_pallas.reference)."""
    return functools.partial(_reference(self.name), **self.op_kwargs(shape))


SPECS: dict[str, BenchSpec] = {}


def register(spec: BenchSpec) -> BenchSpec:
  SPECS[spec.name] = spec
  return spec


def get_spec(op: str) -> BenchSpec:
  if op not in SPECS:
    raise ValueError(f"no benchmark for op {op!r}; available: {', '.join(sorted(SPECS))}")
  return SPECS[op]


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


def _model_preset(name: str) -> dict[str, Any]:
  from mla_pallas import config
  cfg = config.preset(name)
  return {"H": cfg.num_heads, "topk": cfg.index_topk, "page": cfg.page_size}


def _check_positive(shape, *names):
  for n in names:
    if shape[n] <= 0:
      raise ValueError(f"shape key {n!r} must be positive; got {shape[n]}")


def _check_page(shape):
  if shape["page"] % 16:
    raise ValueError(f"shape key 'page' must be a positive multiple of 16; got {shape['page']}")


def _random_cache(key, num_pages, page):
  # N(0, 1) latent rows rounded to e4m3 (|x| < 448 always holds for normals).
  return jax.random.normal(key, (num_pages, page, D_QK), jnp.bfloat16).astype(FP8)


def _random_slots(key, block_table, rows_shape, ctx, topk, page):
  """Random distinct positions in [0, ctx) per row, mapped to flat slots through ``block_table`` [B, pages].

  rows_shape = (B, s_q); returns int32 [B, s_q, topk]; entries past ctx (topk > ctx) are -1, as DSA emits.
  """
  b, s_q = rows_shape
  k = min(topk, ctx)
  # top_k of uniform noise = k distinct positions in random order (the indexer's top-k is not position-sorted).
  _, pos = jax.lax.top_k(jax.random.uniform(key, (b, s_q, ctx)), k)
  pos = pos.astype(jnp.int32)
  pages = jnp.take_along_axis(block_table[:, None, :], pos // page, axis=2)
  slots = pages * page + pos % page
  if topk > k:
    slots = jnp.concatenate([slots, jnp.full((b, s_q, topk - k), -1, jnp.int32)], axis=-1)
  return slots


# ---- sparse_mla_decode -----------------------------------------------------------------------------------

_DECODE_KEYS = {
    "B": (int, "batch (sequences)"),
    "s_q": (int, "query tokens per sequence (MTP: 2)"),
    "H": (int, "query heads"),
    "topk": (int, "indexer top-k: keys per query token (entries past ctx are -1)"),
    "page": (int, "KV-cache page size (multiple of 16)"),
    "ctx": (int, "cache tokens per sequence (the cache holds B * ceil(ctx/page) pages, shuffled)"),
    "softmax_scale": (float, "softmax scale (default 576**-0.5: logits of std 1 on N(0,1) data)"),
    "kv_scale": (float, "per-tensor dequantization scale of the fp8 cache"),
}
_SCALE_DEFAULTS = {"softmax_scale": D_QK ** -0.5, "kv_scale": 1.0}


def _decode_validate(s):
  _check_positive(s, "B", "s_q", "H", "topk", "page", "ctx")
  _check_page(s)
  if not (s["softmax_scale"] > 0 and s["kv_scale"] > 0):
    raise ValueError("shape keys 'softmax_scale' and 'kv_scale' must be positive")


def _pages_per_seq(s):
  return -(-s["ctx"] // s["page"])


@functools.partial(jax.jit, static_argnums=(0,))
def _decode_inputs_jit(shape_items, key):
  s = dict(shape_items)
  b, s_q, h, page = s["B"], s["s_q"], s["H"], s["page"]
  pps = _pages_per_seq(s)
  k_cache, k_perm, k_idx, k_q = jax.random.split(key, 4)
  cache = _random_cache(k_cache, b * pps, page)
  # sequence b owns pages block_table[b] of a shuffled page pool (as a paged allocator would leave them).
  block_table = jax.random.permutation(k_perm, b * pps).astype(jnp.int32).reshape(b, pps)
  indices = _random_slots(k_idx, block_table, (b, s_q), s["ctx"], s["topk"], page)
  q = jax.random.normal(k_q, (b, s_q, h, D_QK), jnp.bfloat16)
  return q, cache, indices


def _decode_inputs(s, key):
  return _decode_inputs_jit(tuple(sorted(s.items())), key)


def _scales(s):
  return {"softmax_scale": float(s["softmax_scale"]), "kv_scale": float(s["kv_scale"])}


def _attn_tolerance(s, pv_length):
  # Full FP8 kernel path (q and P in e4m3, fp8 wgmma); logits have std softmax_scale*sqrt(576)*kv_scale on
  # N(0,1) data. Loose on purpose: the XLA path is held to the same bound.
  logit_std = s["softmax_scale"] * math.sqrt(D_QK) * s["kv_scale"]
  return testing.fp8_error_budget(pv_length=pv_length, logit_std=logit_std)


register(BenchSpec(
    name="sparse_mla_decode",
    keys=_DECODE_KEYS,
    cpu_defaults=dict(B=2, s_q=1, H=16, topk=128, page=64, ctx=512, **_SCALE_DEFAULTS),
    gpu_defaults=dict(B=128, s_q=2, H=128, topk=2048, page=64, ctx=32768, **_SCALE_DEFAULTS),
    preset=_model_preset,
    validate=_decode_validate,
    make_inputs=_decode_inputs,
    op_kwargs=_scales,
    flops=lambda s: 2.0 * s["B"] * s["s_q"] * s["H"] * s["topk"] * (D_QK + D_V),
    gathered_bytes=lambda s: float(s["B"] * s["s_q"] * s["topk"] * D_QK),
    set_bytes=lambda s: float(s["B"] * _pages_per_seq(s) * s["page"] * D_QK
                              + s["B"] * s["s_q"] * (s["H"] * D_QK * 2 + s["topk"] * 4)),
    touched_bytes=lambda s: float(
        min(s["B"] * s["s_q"] * s["topk"], s["B"] * s["ctx"]) * D_QK          # gathered rows
        + s["B"] * s["s_q"] * (s["H"] * D_QK * 2 + s["topk"] * 4)             # q, indices
        + s["B"] * s["s_q"] * s["H"] * (D_V * 2 + 4)),                        # out, lse
    tolerance=lambda s: _attn_tolerance(s, s["topk"]),
    outputs=("out", "lse"),
    module="mla_pallas.ops.sparse_decode",
))


# ---- sparse_mla_prefill ----------------------------------------------------------------------------------

_PREFILL_KEYS = {
    "T": (int, "query tokens"),
    "H": (int, "query heads"),
    "topk": (int, "indexer top-k per token (entries past ctx are -1)"),
    "page": (int, "KV page size (multiple of 16); the kv is passed paged"),
    "ctx": (int, "kv tokens (ceil(ctx/page) shuffled pages)"),
    "softmax_scale": _DECODE_KEYS["softmax_scale"],
    "kv_scale": _DECODE_KEYS["kv_scale"],
}


def _prefill_validate(s):
  _check_positive(s, "T", "H", "topk", "page", "ctx")
  _check_page(s)
  if not (s["softmax_scale"] > 0 and s["kv_scale"] > 0):
    raise ValueError("shape keys 'softmax_scale' and 'kv_scale' must be positive")


@functools.partial(jax.jit, static_argnums=(0,))
def _prefill_inputs_jit(shape_items, key):
  s = dict(shape_items)
  t, h, page = s["T"], s["H"], s["page"]
  pps = _pages_per_seq(s)
  k_cache, k_perm, k_idx, k_q = jax.random.split(key, 4)
  kv = _random_cache(k_cache, pps, page)
  block_table = jax.random.permutation(k_perm, pps).astype(jnp.int32).reshape(1, pps)
  indices = _random_slots(k_idx, block_table, (1, t), s["ctx"], s["topk"], page)[0]
  q = jax.random.normal(k_q, (t, h, D_QK), jnp.bfloat16)
  return q, kv, indices


register(BenchSpec(
    name="sparse_mla_prefill",
    keys=_PREFILL_KEYS,
    cpu_defaults=dict(T=8, H=16, topk=128, page=64, ctx=512, **_SCALE_DEFAULTS),
    gpu_defaults=dict(T=4096, H=128, topk=2048, page=64, ctx=32768, **_SCALE_DEFAULTS),
    preset=_model_preset,
    validate=_prefill_validate,
    make_inputs=lambda s, key: _prefill_inputs_jit(tuple(sorted(s.items())), key),
    op_kwargs=_scales,
    flops=lambda s: 2.0 * s["T"] * s["H"] * s["topk"] * (D_QK + D_V),
    gathered_bytes=lambda s: float(s["T"] * s["topk"] * D_QK),
    set_bytes=lambda s: float(_pages_per_seq(s) * s["page"] * D_QK
                              + s["T"] * (s["H"] * D_QK * 2 + s["topk"] * 4)),
    touched_bytes=lambda s: float(
        min(s["T"] * s["topk"], s["ctx"]) * D_QK
        + s["T"] * (s["H"] * D_QK * 2 + s["topk"] * 4)
        + s["T"] * s["H"] * (D_V * 2 + 4)),
    tolerance=lambda s: _attn_tolerance(s, s["topk"]),
    outputs=("out", "lse"),
    module="mla_pallas.ops.sparse_decode",
))


# ----------------------------------------------------------------------------------------------------------
# Environment
# ----------------------------------------------------------------------------------------------------------

def _on_gpu() -> bool:
  return jax.default_backend() == "gpu"


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

  @property
  def label(self) -> str:
    """impl name, marked when the kernel ran in interpret mode."""
    return f"{self.impl}[interpret]" if self.interpret else self.impl

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
    return self.flops / (m * 1e-6) / 1e12 if m else None

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
# Timing
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
  samples, per_kernel = [], {}
  for it in timings:
    samples.append(sum(ms for _, ms in it) * 1e3 / n)
    acc: dict[str, float] = {}
    for name, ms in it:
      acc[name] = acc.get(name, 0.0) + ms * 1e3 / n
    for name, us in acc.items():
      per_kernel.setdefault(name, []).append(us)
  kernels = {k: statistics.median(v) for k, v in per_kernel.items()}
  return samples, kernels


# ----------------------------------------------------------------------------------------------------------
# Run
# ----------------------------------------------------------------------------------------------------------

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
  for name, g, w in zip(spec.outputs, got, want):
    reports[name] = testing.compare_fp8(g, w, rel_l2=tol, what=f"{spec.name} {name}").as_dict()
  return reports


def run(op: str, impls: Sequence[str] = ("xla", "mosaic"), shape: dict[str, Any] | None = None, *,
        preset: str | None = None, iters: int | None = None, warmup: int | None = None,
        n_inputs: int | None = None, check: bool = True, seed: int = 0, progress: bool = True,
        interpret: bool = False, timer: str | None = None) -> list[Result]:
  """Benchmark ``impls`` of ``op`` side by side on the same input sets.

  Args:
    op: a key of :data:`SPECS` ("sparse_mla_decode", "sparse_mla_prefill").
    impls: implementations, each "xla", "mosaic" or "auto" (passed as ``impl=`` to ``mla_pallas.<op>``).
    shape: overrides of the shape keys (see ``SPECS[op].keys``); the rest are platform defaults.
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
  Returns:
    one :class:`Result` per impl, in order; ``speedup_vs_xla`` filled when "xla" ran.
  """
  spec = get_spec(op)
  shape = spec.shape(shape, preset=preset)
  gpu = _on_gpu()
  for impl in impls:
    if impl not in IMPLS:
      raise ValueError(f"impls entries must be one of {IMPLS}; got {impl!r}")
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
    ref_out = jax.jit(spec.reference(shape))(*sets[0])

  results = []
  bar = _progress_bar(len(impls) * n_inputs, f"{op}", progress)
  for impl in impls:
    if bar is not None:
      bar.set_postfix_str(impl)
    res = Result(op=op, impl=impl, shape=dict(shape), timer=timer, n_inputs=n_inputs, iters=iters,
                 warmup=warmup, flops=spec.flops(shape), gathered_bytes=spec.gathered_bytes(shape),
                 tolerance=tol, interpret=interpret and impl != "xla")
    done = [0]

    def step():
      done[0] += 1
      if bar is not None:
        bar.update(1)

    try:
      fn = spec.op(impl, shape, interpret=res.interpret)
      if timer == "cupti":
        try:
          res.samples_us, res.kernels = time_cupti(fn, sets, iters=iters, warmup=warmup, progress=step)
        except RuntimeError as e:
          if "CUPTI" not in str(e):
            raise
          print(f"warning: CUPTI unavailable ({e}); using wall clock", file=sys.stderr)
          res.timer = "wall"
          res.samples_us = time_wall(fn, sets, iters=iters, warmup=0)
      else:
        res.samples_us = time_wall(fn, sets, iters=iters, warmup=warmup, progress=step)
      if check:
        res.check = _check(spec, shape, fn, sets[0], tol, ref_out)
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
  for r in results:
    if base is not None and r.ok and r.median_us:
      r.speedup_vs_xla = base.median_us / r.median_us
  return results


# ----------------------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------------------

def _num(x, fmt):
  return "-" if x is None else format(x, fmt)


def format_table(results: Sequence[Result]) -> str:
  """Plain-text table: impl, timer, median/p10/p90 µs, TFLOP/s, gathered GB/s, speedup vs xla, rel-L2."""
  head = ["impl", "timer", "median µs", "p10 µs", "p90 µs", "TFLOP/s", "gath GB/s", "vs xla", "rel-L2",
          "check"]
  rows = []
  notes = []
  for r in results:
    if not r.ok:
      rows.append([r.label, r.timer] + ["-"] * 8)
      notes.append(f"  {r.label}: {r.status}")
      continue
    chk = "-" if r.check_ok is None else ("PASS" if r.check_ok else "FAIL")
    rows.append([r.label, r.timer, _num(r.median_us, ".1f"), _num(r.p10_us, ".1f"), _num(r.p90_us, ".1f"),
                 _num(r.tflops, ".3g"), _num(r.gathered_gbps, ".4g"),
                 "-" if r.speedup_vs_xla is None else f"{r.speedup_vs_xla:.3g}x", _num(r.rel_l2, ".2e"), chk])
  widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
  line = lambda cells: "  ".join(str(c).rjust(w) if i > 1 else str(c).ljust(w)  # noqa: E731
                                 for i, (c, w) in enumerate(zip(cells, widths)))
  out = [line(head), "  ".join("-" * w for w in widths)] + [line(r) for r in rows]
  if results:
    r0 = results[0]
    shape = ",".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in r0.shape.items())
    out.insert(0, f"{r0.op}  [{shape}]  inputs={r0.n_inputs} iters={r0.iters}  "
                  f"GFLOP/call={r0.flops / 1e9:.3f}  gathered MB/call={r0.gathered_bytes / 1e6:.2f}  "
                  f"tol rel-L2={_num(r0.tolerance, '.3g')}")
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
  tf = [r.tflops or 0.0 for r in results]
  fig, axes = plt.subplots(1, 2, figsize=(10, 4))
  x = np.arange(len(results))
  timers = sorted({r.timer for r in results if r.ok}) or ["-"]
  axes[0].bar(x, med, yerr=[lo, hi], capsize=4, color="tab:blue")
  axes[0].set_ylabel(f"median µs per call ({'/'.join(timers)}; whiskers p10-p90)")
  axes[1].bar(x, tf, color="tab:orange")
  axes[1].set_ylabel("TFLOP/s (FlashMLA convention)")
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


def write_outputs(results: Sequence[Result], out_dir: str, *, make_plot: bool = True,
                  command: str | None = None, extra: dict[str, Any] | None = None) -> dict[str, str]:
  """Write ``<op>-<UTC stamp>.json`` (every sample, shape, environment) and, unless disabled, a ``.png``.

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
      "conventions": {"flops": "2*H*(576+512) per query token and attended key (FlashMLA)",
                      "gathered_bytes": "576 B per query token and top-k entry (FlashMLA)",
                      "timer": "cupti = device time of all kernels of one call; wall = host wall clock"},
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
