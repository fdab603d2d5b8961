"""Test helpers shared by the tests, the benchmarks and the demo.

* :func:`compare_fp8` / :func:`assert_close_fp8` / :class:`Report`: compare an FP8-path result with a float32
  oracle by relative L2 error, max abs error and cosine similarity; NaN and inf positions must match exactly.
* :func:`fp8_error_budget` (alias :func:`fp8_budget`): the documented error model that gives the rel-L2 tolerance
  of an FP8 attention output against the float32 reference.
* :func:`interpret_mode` / :func:`races_found`: Pallas Mosaic GPU interpret mode (runs ``plgpu.kernel`` on the
  CPU) and its race detector.
* :func:`lower_for_cuda` -> :class:`Lowered`: run every Python-side Mosaic GPU pass for sm_90a or sm_100a without
  a GPU and return the HLO and the final Mosaic GPU module text (for grepping instructions).
* :func:`device_kind`: a short description of the default device ("NVIDIA H200", "cpu", ...).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import re
from typing import Any, Callable, Iterator

import jax
import numpy as np

__all__ = [
    "Report", "compare_fp8", "assert_close_fp8", "fp8_error_terms", "fp8_error_budget", "fp8_budget",
    "E4M3_UNIT_ROUNDOFF", "BF16_UNIT_ROUNDOFF", "WGMMA_FP8_MAX_ABS_ERROR",
    "interpret_mode", "races_found", "reset_interpreter", "Lowered", "lower_for_cuda", "device_kind",
]


# ----------------------------------------------------------------------------------------------------------
# Comparison
# ----------------------------------------------------------------------------------------------------------

def _fmt(x: float | None) -> str:
  return "-" if x is None else f"{x:.3g}"


@dataclasses.dataclass
class Report:
  """Result of :func:`compare_fp8`.

  Attributes:
    what: label of the compared quantity (used in :meth:`summary`).
    shape: shape of ``got`` (``want_shape`` when it differs).
    rel_l2: ||got - want||_2 / ||want||_2 over the entries finite in both (0 when both are all zero; inf when
      ``want`` is zero there and ``got`` is not).
    max_abs: max |got - want| over the entries finite in both (0 when there are none).
    cosine: cosine similarity of got and want over the entries finite in both (1 when both are zero there).
    nan_mismatch: number of positions where exactly one of got/want is NaN.
    inf_mismatch: number of positions (neither NaN) where exactly one is infinite, or both are infinite with
      different signs.
    n_finite: number of entries finite in both (the ones the norms are taken over).
    worst: (index, got, want) of the largest abs difference among them, or None.
    tol_rel_l2, tol_max_abs, tol_min_cos: the thresholds (None = not checked).
    error: set when the comparison could not be made (shape mismatch); ``ok`` is then False.
  """
  what: str
  shape: tuple[int, ...]
  rel_l2: float
  max_abs: float
  cosine: float
  nan_mismatch: int
  inf_mismatch: int
  n_finite: int
  worst: tuple[tuple[int, ...], float, float] | None
  tol_rel_l2: float | None
  tol_max_abs: float | None = None
  tol_min_cos: float | None = None
  want_shape: tuple[int, ...] | None = None
  error: str | None = None

  @property
  def failures(self) -> list[str]:
    """Human-readable list of the violated conditions (empty when ``ok``)."""
    if self.error:
      return [self.error]
    out = []
    if self.nan_mismatch:
      out.append(f"{self.nan_mismatch} NaN position mismatch(es)")
    if self.inf_mismatch:
      out.append(f"{self.inf_mismatch} inf position/sign mismatch(es)")
    if self.tol_rel_l2 is not None and not self.rel_l2 <= self.tol_rel_l2:
      out.append(f"rel_l2 {self.rel_l2:.3g} > {self.tol_rel_l2:.3g}")
    if self.tol_max_abs is not None and not self.max_abs <= self.tol_max_abs:
      out.append(f"max_abs {self.max_abs:.3g} > {self.tol_max_abs:.3g}")
    if self.tol_min_cos is not None and not self.cosine >= self.tol_min_cos:
      out.append(f"cosine {self.cosine:.6f} < {self.tol_min_cos:.6f}")
    return out

  @property
  def ok(self) -> bool:
    return not self.failures

  def __bool__(self) -> bool:
    return self.ok

  def summary(self) -> str:
    """One line: PASS/FAIL, label, metrics with their thresholds, and the reasons of a failure."""
    tag = "PASS" if self.ok else "FAIL"
    name = f" {self.what}" if self.what else ""
    if self.error:
      return f"[{tag}]{name}: {self.error}"
    parts = [
        f"rel_l2={_fmt(self.rel_l2)}"
        + (f" (<= {_fmt(self.tol_rel_l2)})" if self.tol_rel_l2 is not None else ""),
        f"max_abs={_fmt(self.max_abs)}" + (f" (<= {_fmt(self.tol_max_abs)})" if self.tol_max_abs is not None
                                           else ""),
        f"cos={self.cosine:.6f}" + (f" (>= {self.tol_min_cos:.6f})" if self.tol_min_cos is not None else ""),
        f"nan_mismatch={self.nan_mismatch}", f"inf_mismatch={self.inf_mismatch}",
        f"finite={self.n_finite}", f"shape={self.shape}",
    ]
    if self.worst is not None and self.max_abs > 0:
      idx, g, w = self.worst
      parts.append(f"worst at {idx}: got {g:.6g} want {w:.6g}")
    s = f"[{tag}]{name}: " + ", ".join(parts)
    if not self.ok:
      s += " -- " + "; ".join(self.failures)
    return s

  def as_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["ok"] = self.ok
    return d


def _to_f64(x) -> np.ndarray:
  # np.asarray handles jax arrays of every dtype (bf16/fp8 come back as ml_dtypes arrays).
  return np.asarray(x).astype(np.float64)


def compare_fp8(got, want, *, rel_l2: float | None, max_abs: float | None = None,
                min_cos: float | None = None, what: str = "") -> Report:
  """Compare ``got`` (e.g. a kernel's bf16 output) with ``want`` (e.g. the float32 reference).

  Both are converted to float64 on the host. The norms, max abs error and cosine are taken over the entries that
  are finite in both; NaN positions must match exactly, and so must inf positions and signs (e.g. ``lse = -inf``
  of rows with nothing to attend to). Shapes must be equal (no broadcasting).

  Args:
    got, want: arrays of the same shape, any float dtype (bf16, fp8, f32, ...).
    rel_l2: tolerance on ||got - want|| / ||want|| (None: not checked); see :func:`fp8_error_budget`.
    max_abs: optional tolerance on max |got - want|.
    min_cos: optional lower bound on the cosine similarity.
    what: label for :meth:`Report.summary`.
  Returns:
    a :class:`Report`; ``report.ok`` tells whether every check passed.
  """
  g, w = _to_f64(got), _to_f64(want)
  common = dict(what=what, tol_rel_l2=rel_l2, tol_max_abs=max_abs, tol_min_cos=min_cos)
  if g.shape != w.shape:
    return Report(shape=g.shape, want_shape=w.shape, rel_l2=math.inf, max_abs=math.inf, cosine=0.0,
                  nan_mismatch=0, inf_mismatch=0, n_finite=0, worst=None,
                  error=f"shape mismatch: got {g.shape}, want {w.shape}", **common)
  g_nan, w_nan = np.isnan(g), np.isnan(w)
  nan_mismatch = int(np.count_nonzero(g_nan != w_nan))
  g_inf, w_inf = np.isinf(g), np.isinf(w)
  both_inf = g_inf & w_inf
  inf_mismatch = int(np.count_nonzero((g_inf != w_inf) & ~g_nan & ~w_nan)
                     + np.count_nonzero(both_inf & (np.sign(g) != np.sign(w))))
  fin = np.isfinite(g) & np.isfinite(w)
  gf, wf = g[fin], w[fin]
  diff = gf - wf
  n_diff, n_want, n_got = (float(np.linalg.norm(v)) for v in (diff, wf, gf))
  if n_want > 0:
    rel = n_diff / n_want
  else:
    rel = 0.0 if n_diff == 0 else math.inf
  if n_want > 0 and n_got > 0:
    cos = float(np.dot(gf, wf) / (n_got * n_want))
  else:
    cos = 1.0 if n_want == n_got == 0 else 0.0
  worst = None
  mabs = 0.0
  if diff.size:
    k = int(np.argmax(np.abs(diff)))
    mabs = float(abs(diff[k]))
    idx = tuple(int(i) for i in np.argwhere(fin)[k])
    worst = (idx, float(gf[k]), float(wf[k]))
  return Report(shape=g.shape, rel_l2=rel, max_abs=mabs, cosine=cos, nan_mismatch=nan_mismatch,
                inf_mismatch=inf_mismatch, n_finite=int(fin.sum()), worst=worst, **common)


def assert_close_fp8(got, want, *, rel_l2: float | None, max_abs: float | None = None,
                     min_cos: float | None = None, what: str = "") -> Report:
  """:func:`compare_fp8`, raising ``AssertionError(report.summary())`` on failure; returns the report."""
  rep = compare_fp8(got, want, rel_l2=rel_l2, max_abs=max_abs, min_cos=min_cos, what=what)
  if not rep.ok:
    raise AssertionError(rep.summary())
  return rep


# ----------------------------------------------------------------------------------------------------------
# Error model
# ----------------------------------------------------------------------------------------------------------

#: float8_e4m3fn: 3 explicit mantissa bits; round-to-nearest gives relative error <= 2^-4 for normal numbers.
E4M3_UNIT_ROUNDOFF = 2.0 ** -4
#: bfloat16: 7 explicit mantissa bits -> relative error <= 2^-8.
BF16_UNIT_ROUNDOFF = 2.0 ** -8
#: Hopper FP8 wgmma (f32 accumulator, reduced-precision internal accumulation): max |error| against an exact f32
#: product for N(0, 1) fp8 inputs, by reduction length K (H200; ``../shared/mgpu/README.md`` section 11).
WGMMA_FP8_MAX_ABS_ERROR = {128: 0.011, 512: 0.05, 576: 0.09}


def _wgmma_rel_error(k: int) -> float:
  """Relative accumulation error of one fp8 wgmma chain of reduction length ``k``.

  The measured max abs errors of :data:`WGMMA_FP8_MAX_ABS_ERROR` are divided by sqrt(K), the standard deviation
  of a length-K dot product of N(0, 1) values, which makes them relative to the result's typical magnitude
  (1.0e-3 at K=128, 2.2e-3 at K=512, 3.8e-3 at K=576). Between the measured points the value is interpolated
  linearly in K; beyond 576 it is extrapolated proportionally to K (the error grows with the number of
  reduced-precision additions), below 128 proportionally as well. Using a *max* as an RMS is conservative.
  """
  pts = sorted((kk, e / math.sqrt(kk)) for kk, e in WGMMA_FP8_MAX_ABS_ERROR.items())
  if k <= pts[0][0]:
    return pts[0][1] * k / pts[0][0]
  if k >= pts[-1][0]:
    return pts[-1][1] * k / pts[-1][0]
  return float(np.interp(k, [p[0] for p in pts], [p[1] for p in pts]))


def fp8_error_terms(*, quantized_q: bool = True, quantized_kv: bool = False, quantized_p: bool = True,
                    fp8_mma: bool = True, d_qk: int = 576, pv_length: int = 2048,
                    logit_std: float = 1.0, bf16_output: bool = True,
                    split_partials_bf16: bool = False) -> dict[str, float]:
  """The RMS relative-error contributions of :func:`fp8_error_budget`, by source (see there for the model).

  Returns a dict name -> RMS relative error of the attention output; zero terms are included for clarity.
  """
  if d_qk <= 0 or pv_length <= 0:
    raise ValueError(f"d_qk and pv_length must be positive; got d_qk={d_qk}, pv_length={pv_length}")
  if logit_std < 0:
    raise ValueError(f"logit_std must be >= 0; got {logit_std}")
  r8 = E4M3_UNIT_ROUNDOFF / math.sqrt(3.0)    # RMS relative rounding error of one e4m3 value
  return {
      "q_fp8": logit_std * r8 if quantized_q else 0.0,
      "k_fp8": logit_std * r8 if quantized_kv else 0.0,
      "v_fp8": r8 if quantized_kv else 0.0,
      "p_fp8": r8 if quantized_p else 0.0,
      "qk_mma": logit_std * _wgmma_rel_error(d_qk) if fp8_mma else 0.0,
      "pv_mma": _wgmma_rel_error(pv_length) if fp8_mma else 0.0,
      # got and want are both rounded to bf16: difference of two independent roundings.
      "out_bf16": math.sqrt(2.0) * BF16_UNIT_ROUNDOFF / math.sqrt(3.0) if bf16_output else 0.0,
      # the kernel's split partials rounded to bf16 before the merge (a third rounding of the same size)
      "partials_bf16": BF16_UNIT_ROUNDOFF / math.sqrt(3.0) if split_partials_bf16 else 0.0,
  }


#: Rel-L2 tolerance of BF16 attention (a bfloat16 cache; q and P in bf16, f32 accumulation) against the float32
#: reference on the same bf16 rows: q and the rows are exact; P is rounded to bf16 for P·V and both outputs to
#: bf16 (unit roundoff 2^-8, RMS <= 2^-8/sqrt(3) relative each), three independent terms: sqrt(3) · 2^-8 / sqrt(3)
#: = 2^-8, times a safety factor of 3 (~0.012). The lse sees only f32 rounding of the logits.
BF16_ATTENTION_REL_L2 = 3.0 * 2.0 ** -8


def fp8_error_budget(*, quantized_q: bool = True, quantized_kv: bool = False, quantized_p: bool = True,
                     fp8_mma: bool = True, d_qk: int = 576, pv_length: int = 2048,
                     logit_std: float = 1.0, bf16_output: bool = True, split_partials_bf16: bool = False,
                     safety: float = 3.0) -> float:
  r"""Rel-L2 tolerance of an FP8 attention output against the float32 reference on the same (dequantized) inputs.

  Returns ``safety * sqrt(sum_i t_i^2)`` with the RMS terms ``t_i`` of :func:`fp8_error_terms`.

  **Rounding.** float8_e4m3fn has 3 mantissa bits, so round-to-nearest has unit roundoff u = 2^-4: the relative
  error of a normal number is at most 2^-4. Within a binade the rounding error is close to uniform on
  [-ulp/2, ulp/2], whose RMS is (ulp/2)/sqrt(3); relative to the value this is at most u/sqrt(3) ~= 0.036 (the
  bound is reached at the bottom of the binade, so it is an upper bound on the RMS). Independent errors add in
  quadrature, hence sqrt(sum of squares).

  **From an input error to the output.** With logits s_j = c * q.k_j, weights p_j = softmax(s)_j and output
  o = sum_j p_j v_j:

  * a relative error e_d of RMS r on the entries of q (or of k_j) perturbs each logit by
    ds_j = c * sum_d e_d q_d k_jd, of RMS r * std(s) for generic data (the terms are independent), i.e.
    ``r * logit_std``. A logit perturbation of RMS sigma changes the weights by dp_j = p_j (ds_j - sum_i p_i ds_i)
    and the output by do = sum_j p_j (ds_j - <ds>) (v_j - o). For generic (random-like) values both ||do|| and
    ||o|| scale like ||v|| / sqrt(n_eff) (n_eff = effective number of attended keys), so the relative output
    error is about sigma. Terms ``q_fp8`` (the kernel quantizes q) and ``k_fp8``.
  * a relative error of RMS r on the values v_j or on the weights p_j (P quantized to fp8 for the PV product,
    the row sum taken in f32) gives do = sum_j p_j e_j v_j, again ~ r relative. Terms ``v_fp8`` and ``p_fp8``.
  * K/V are already fp8 in the cache and the reference reads the same dequantized rows, so ``quantized_kv`` is
    False by default (0 contribution); set it when comparing against unquantized bf16 keys/values.
  * Hopper fp8 wgmma accumulates with reduced precision. The measured max abs errors (H200, N(0, 1) fp8 inputs:
    0.011 at K=128, ~0.05 at K=512, 0.09 at K=576) divided by sqrt(K) give the error relative to the result's
    typical magnitude; see ``_wgmma_rel_error``. The QK^T product (K = d_qk) acts on the logits (times
    ``logit_std``), the PV product (K = ``pv_length``: keys accumulated in one fp8 wgmma chain; the whole top-k
    unless the kernel promotes to separate f32 accumulators per tile) on the output. Terms ``qk_mma`` and
    ``pv_mma``. Interpret mode computes these products exactly; the term is then a (small) overestimate.
  * both outputs are rounded to bf16: sqrt(2) * 2^-8 / sqrt(3) (term ``out_bf16``); the sparse and dense decode
    kernels over an fp8 cache may also round each split's partial output to bf16 before the merge
    (``ops.sparse_decode._partials_dtype``): 2^-8 / sqrt(3) more (term ``partials_bf16``,
    ``split_partials_bf16=True``; counted whether or not the call splits).

  **Assumptions and safety.** The model is first order and assumes generic inputs: q and latent rows with
  N(0, 1)-like entries, logits of standard deviation ``logit_std`` (1.0 for N(0, 1) data with
  softmax_scale = 576**-0.5), no catastrophic cancellation in o, no subnormal flushing. P entries below 2^-6
  become subnormal in e4m3 and are rounded more coarsely, the wgmma figures are maxima of a few runs, and
  per-row errors fluctuate; ``safety`` (default 3) covers these. For the full FP8 path at the defaults the terms
  are q 0.036, p 0.036, qk 0.0038, pv 0.013, out 0.0033 -> sqrt(sum) ~= 0.053 -> bound ~= 0.16; for a kernel
  with bf16 q and P and f32 MMAs (``quantized_q=quantized_p=fp8_mma=False``) only the output rounding remains
  (bound ~= 0.01).

  Args:
    quantized_q: the implementation rounds q to e4m3 before QK^T.
    quantized_kv: the reference uses unquantized keys/values while the implementation uses fp8 ones.
    quantized_p: the implementation rounds the softmax weights P to e4m3 before PV.
    fp8_mma: the implementation uses Hopper fp8 wgmma (reduced-precision accumulation).
    d_qk: reduction length of QK^T (576 for MLA).
    pv_length: reduction length of one fp8 PV accumulation chain (top-k, or the tile size).
    logit_std: standard deviation of the logits (softmax_scale * q.k).
    bf16_output: both outputs are bf16.
    safety: multiplier on the RMS estimate.
  Returns:
    the rel-L2 bound (a float) to pass as ``rel_l2=`` to :func:`compare_fp8`.
  """
  if safety <= 0:
    raise ValueError(f"safety must be positive; got {safety}")
  terms = fp8_error_terms(quantized_q=quantized_q, quantized_kv=quantized_kv, quantized_p=quantized_p,
                          fp8_mma=fp8_mma, d_qk=d_qk, pv_length=pv_length, logit_std=logit_std,
                          bf16_output=bf16_output, split_partials_bf16=split_partials_bf16)
  return safety * math.sqrt(sum(t * t for t in terms.values()))


fp8_budget = fp8_error_budget  # the name used in the session contract


# ----------------------------------------------------------------------------------------------------------
# Interpret mode and lowering
# ----------------------------------------------------------------------------------------------------------

def _ipc():
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call
  return interpret_pallas_call


def reset_interpreter() -> None:
  """Reset Pallas' GPU interpreter state (required after any exception inside the interpreter)."""
  _ipc().reset_gpu_interpret_mode_state()


@contextlib.contextmanager
def interpret_mode(detect_races: bool = False, **params) -> Iterator[None]:
  """Run every ``plgpu.kernel`` *traced* inside this context in Pallas' GPU interpret mode (works on the CPU).

  Kernels must be traced inside the context: a function jitted and traced before it keeps its native lowering.
  The interpreter state is reset on entry and, when an exception escapes, on exit (the interpreter is left
  inconsistent otherwise). ``params`` go to ``plgpu.InterpretGPUParams`` (e.g. ``uninitialized_memory="nan"``).
  After a ``detect_races=True`` run, :func:`races_found` tells whether the interpreter saw a race.
  """
  from jax.experimental.pallas import mosaic_gpu as plgpu
  reset_interpreter()
  try:
    with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(detect_races=detect_races, **params)):
      yield
  except BaseException:
    reset_interpreter()
    raise


def races_found() -> bool:
  """Whether the last ``detect_races=True`` interpret-mode run found a race."""
  races = _ipc().get_races()
  return bool(getattr(races, "races_found", False))


@contextlib.contextmanager
def _target_arch(arch: tuple[int, int]) -> Iterator[None]:
  from jax.experimental.mosaic.gpu import utils as mgpu_utils
  old = mgpu_utils._infer_arch
  mgpu_utils._infer_arch = lambda: tuple(arch)
  try:
    yield
  finally:
    mgpu_utils._infer_arch = old


@dataclasses.dataclass
class Lowered:
  """Result of :func:`lower_for_cuda`.

  Attributes:
    hlo: StableHLO text of the jitted function (holds the ``mosaic_gpu_v2`` custom call(s)).
    mosaic: text of every Mosaic GPU module after the Python-side passes (NVVM/LLVM dialect level), in order.
    arch: the (major, minor) lowered for.
  """
  hlo: str
  mosaic: list[str]
  arch: tuple[int, int] = (9, 0)

  def count(self, pattern: str) -> int:
    """Number of regex matches of ``pattern`` over all Mosaic GPU modules."""
    return sum(len(re.findall(pattern, m)) for m in self.mosaic)


def lower_for_cuda(fn: Callable, *avals, arch: tuple[int, int] = (9, 0)) -> Lowered:
  """Lower ``fn(*avals)`` for CUDA at compute capability ``arch`` without a GPU (works on the CPU).

  Runs layout inference, the Mosaic GPU dialect lowering and its wgmma/tcgen05/TMA checks, and raises on any
  Mosaic GPU error; PTX generation and ptxas run only on a GPU, so their errors are not caught here, nor are
  runtime faults (TMA alignment) or arch checks that ptxas does (e.g. gather4 at sm_90).

  Args:
    fn: a ``plgpu.kernel`` or any function calling Mosaic GPU kernels.
    avals: ``jax.ShapeDtypeStruct`` (or arrays) of the arguments.
    arch: (9, 0) for sm_90a, (10, 0) for sm_100a.
  """
  import jax.experimental.mosaic.gpu.core as mgpu_core
  arch = tuple(int(a) for a in arch)
  if len(arch) != 2:
    raise ValueError(f"arch must be (major, minor); got {arch}")
  captured: list[str] = []
  orig = mgpu_core.lower_mgpu_module

  def capture(module, *a, **kw):
    res = orig(module, *a, **kw)
    captured.append(str(module))
    return res

  mgpu_core.lower_mgpu_module = capture
  try:
    with _target_arch(arch):
      # A fresh wrapper on every call: JAX caches lowerings per function, and a cached lowering would silently
      # keep the arch of an earlier call.
      wrapped = jax.jit(lambda *a: fn(*a))
      hlo = wrapped.trace(*avals).lower(lowering_platforms=("cuda",)).as_text()
  finally:
    mgpu_core.lower_mgpu_module = orig
  return Lowered(hlo=hlo, mosaic=captured, arch=arch)


def device_kind() -> str:
  """``device_kind`` of the default device ("NVIDIA H200", "cpu", ...), with the compute capability on a GPU."""
  try:
    dev = jax.devices()[0]
  except RuntimeError:  # pragma: no cover
    return "none"
  kind = str(getattr(dev, "device_kind", dev.platform))
  cc = getattr(dev, "compute_capability", None)
  if dev.platform == "gpu" and cc:
    kind += f" (cc {cc})"
  return kind
