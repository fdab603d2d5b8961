"""RoPE, RMS norm and the fused MLA cache write: ``rope``, ``rms_norm``, ``rope_rmsnorm``,
``fused_rope_rmsnorm_quantization``.

Semantics are exactly those of :func:`mla_pallas.reference.rope`, :func:`~mla_pallas.reference.rms_norm`,
:func:`~mla_pallas.reference.rope_rmsnorm` and :func:`~mla_pallas.reference.rope_rmsnorm_quantize_write`; the XLA
paths use the reference's float32 formulations (elementwise math that XLA fuses into one pass), so results are
bitwise those of the reference.

One Mosaic GPU kernel serves :func:`rope_rmsnorm` and :func:`fused_rope_rmsnorm_quantization`:
:mod:`mla_pallas.kernels.rope_direct` (sm_90a, bf16 ``kv`` / ``q_rope``, any T and H): GMEM -> registers -> GMEM
in one launch; it gathers the cos/sin rows and finds each slot's last writer itself. Other dtypes raise
``NotImplementedError`` under ``impl="mosaic"`` and run XLA under ``impl="auto"``; ``auto`` takes the kernel at
every supported shape on a Hopper GPU. The kernel sums the RMS in a different order than XLA, so a few values can
differ from the reference by one bf16 ulp / one e4m3 step (kernel docstring).

Interpret mode: the kernel is raw Mosaic GPU (``plgpu.inline_mgpu``), which Pallas' interpreter cannot run, so with
``interpret=True`` both ops run their XLA path under every ``impl`` (``"mosaic"`` included, so that a whole graph can
run in interpret mode); :func:`mla_pallas.last_impl` / ``graph_report`` then say ``"xla"``. CPU tests therefore
check the XLA path against the reference and the kernel by sm_90 lowering; its numbers are checked on the GPU only.

``rope`` and ``rms_norm`` alone have no kernel (XLA). :func:`default_config` maps a shape to the kernel's config and
:func:`sweep_configs` lists benchmark overrides; the private jitted entry points (``_rope_rmsnorm_mosaic``,
``_fused_mosaic``) take ``tuning``: (name, value) pairs of the kernel's TuningConfig fields.

Conventions:
* Latent row: 576 values, [0, 512) latent (RMS-normed), [512, 576) the key's rope part (rotated).
* RoPE tables ``cos``/``sin`` float32 [max_pos, D/2] (:func:`mla_pallas.reference.rope_tables`); positions are int32
  and clamped to [0, max_pos) before the lookup. ``interleaved=True``: DeepSeek pairing (x[2i], x[2i+1]);
  ``interleaved=False``: NeoX / HF half-split pairing (x[i], x[i + D/2]). Rotation (a, b) -> (a cos - b sin,
  a sin + b cos), float32 math.
* RMS norm: x · rsqrt(mean(x²) + eps) · weight, float32 math, output in x's dtype.
* Cache write: row quantized as clip(row / kv_scale, -448, 448) -> float8_e4m3fn (computed as row · f32(1/kv_scale),
  see :mod:`mla_pallas.quant`), row kept in float32 until then; flat slot = page · page_size + offset.
"""
from __future__ import annotations

import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from mla_pallas import _checks, _dispatch, quant, reference

_log = logging.getLogger("mla_pallas")

__all__ = ["rope", "rms_norm", "rope_rmsnorm", "fused_rope_rmsnorm_quantization"]

D_QK = 576
D_V = 512
D_ROPE = 64
_ACT = (jnp.bfloat16, jnp.float32)


_check_bool = _checks.check_bool


def _check_tables(cos, sin, half):
  _checks.check_array("cos", cos, ndim=2, shape=(None, half), dtypes=(jnp.float32,), expect=f"[max_pos, {half}]")
  if cos.shape[0] < 1:
    raise ValueError(f"cos must have shape [max_pos, {half}] with max_pos >= 1; got shape {tuple(cos.shape)}")
  _checks.check_array("sin", sin, ndim=2, shape=tuple(cos.shape), dtypes=(jnp.float32,),
                      expect=f"[max_pos, {half}] = {list(cos.shape)} (as cos)")


def _check_rope(x, positions, cos, sin, interleaved, x_name="x"):
  _checks.check_array(x_name, x, dtypes=_ACT, expect="[..., D] (D even)")
  if x.ndim < 1 or x.shape[-1] < 2 or x.shape[-1] % 2:
    raise ValueError(f"{x_name} must have shape [..., D] with D even and >= 2; got shape {tuple(x.shape)}")
  _checks.check_array("positions", positions, dtypes=(jnp.int32,), expect=f"a prefix of {x_name}.shape[:-1]")
  if positions.ndim > x.ndim - 1 or tuple(positions.shape) != tuple(x.shape[:positions.ndim]):
    raise ValueError(f"positions must have shape equal to a prefix of {x_name}.shape[:-1] = "
                     f"{tuple(x.shape[:-1])} and dtype int32; got shape {tuple(positions.shape)}")
  _check_tables(cos, sin, x.shape[-1] // 2)
  return _check_bool("interleaved", interleaved)


def _check_kv_rope(kv, q_rope, positions, cos, sin, norm_weight, eps, interleaved):
  _checks.check_array("kv", kv, ndim=2, shape=(None, D_QK), dtypes=_ACT, expect="[T, 576]")
  t = kv.shape[0]
  _checks.check_array("q_rope", q_rope, ndim=3, shape=(t, None, D_ROPE), dtypes=_ACT,
                      expect=f"[T, H, 64] (T = {t})")
  _checks.check_array("positions", positions, ndim=1, shape=(t,), dtypes=(jnp.int32,), expect=f"[T] = [{t}]")
  _check_tables(cos, sin, D_ROPE // 2)
  _checks.check_array("norm_weight", norm_weight, ndim=1, shape=(D_V,), dtypes=_ACT, expect="[512]")
  _checks.check_scalar("eps", eps)
  return _check_bool("interleaved", interleaved)


# ---------------------------------------------------------------------------------------------------------
# The direct kernel (mla_pallas.kernels.rope_direct): kernel choice, configs, jitted entry points
# ---------------------------------------------------------------------------------------------------------

_VALIDATED_ON: tuple[str, ...] = ("sm90",)
# The fused kernel's bfloat16-cache write (rows bf16(y · f32(1 / kv_scale))): "auto" picks it on the families where
# tests/test_rope_rmsnorm_kernel_gpu.py's bf16 cases passed (sm90: the H200, 2026-12-02).
_BF16_PAGES_VALIDATED_ON: tuple[str, ...] = ("sm90",)


def _check_shape(t, h):
  ints = all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in (t, h))
  if not ints or t < 1 or h < 1:
    raise ValueError(f"t and h must be ints >= 1 (tokens, query heads); got t={t!r}, h={h!r}")


def default_config(t: int, h: int, fused: bool):
  """The direct kernel's frozen :class:`~mla_pallas.kernels.rope_direct.TuningConfig` for T = t tokens of H = h
  query heads, with (``fused``) or without the cache write. The same config serves every shape: the kernel derives
  its grid (:func:`~mla_pallas.kernels.rope_direct.grid_for`), its duplicate-slot mode
  (:func:`~mla_pallas.kernels.rope_direct.uses_bitmap`) and its index width
  (:func:`~mla_pallas.kernels.rope_direct.needs_i64`) from T and H."""
  from mla_pallas.kernels import rope_direct as rd
  _check_shape(t, h)
  _check_bool("fused", fused)
  return rd.TuningConfig()


def sweep_configs(t: int, h: int, fused: bool) -> dict[str, tuple[tuple[str, object], ...]]:
  """Labelled ``tuning`` overrides of the direct kernel for benchmark sweeps at (t, h, fused), ``"default": ()``
  first: q items per thread, and (fused, T above the warp-scan limit) the bitmap's tokens per kv CTA, loads in
  flight and scan unroll, the warp scan instead of the bitmap, and the XLA last-writer pre-pass."""
  from mla_pallas.kernels import rope_direct as rd
  cfg = default_config(t, h, fused)
  out: dict[str, tuple[tuple[str, object], ...]] = {"default": ()}
  for ipt in (1, 2, 8):
    out[f"items_per_thread={ipt}"] = (("items_per_thread", ipt),)
  if fused and rd.uses_bitmap(cfg, True, t, True):
    out["bitmap_tokens=32"] = (("bitmap_tokens", 32),)
    out["bitmap_group=2"] = (("bitmap_group", 2),)
    out["scan_unroll=4"] = (("scan_unroll", 4),)
    out["warp_scan"] = (("warp_scan_max_tokens", t),)
    out["xla_last_writer"] = (("bitmap_dedupe", False),)
  elif fused and t > rd.UNROLLED_SCAN_MAX:
    out["bitmap"] = (("warp_scan_max_tokens", rd.UNROLLED_SCAN_MAX),)
  return out


def _config(t, h, fused, tuning=()):
  """:func:`default_config` with ``tuning``'s (name, value) overrides (names: the TuningConfig fields)."""
  from mla_pallas.kernels import rope_direct as rd
  kw = dict(tuning)
  if set(kw) - rd.knobs():
    raise ValueError(f"tuning for the direct rope kernel takes {sorted(rd.knobs())}; got {sorted(kw)}")
  return dataclasses.replace(default_config(t, h, fused), **kw)


def _kernel_supported(op, kv, q_rope, num_slots=None, pages_dtype=quant.FP8):
  """``supported`` callable for :func:`_dispatch.choose`: raises NotImplementedError for inputs the kernel lacks."""
  def check():
    if pages_dtype not in (quant.FP8, jnp.bfloat16):
      raise NotImplementedError(f"{op}: the Mosaic GPU kernel writes float8_e4m3fn and bfloat16 caches; a "
                                f"{np.dtype(pages_dtype).name} cache runs on the XLA path")
    arch = _dispatch.mosaic_arch(False)
    if arch != "sm90":
      raise NotImplementedError(f"{op} has a Mosaic GPU kernel for sm_90 (Hopper) only; this device needs the "
                                f"{arch} kernel, which does not exist yet")
    if kv.dtype != jnp.bfloat16 or q_rope.dtype != jnp.bfloat16:
      raise NotImplementedError(f"{op}: no Mosaic GPU kernel for these inputs: it takes bfloat16 kv and q_rope; "
                                f"got {np.dtype(kv.dtype).name} and {np.dtype(q_rope.dtype).name}")
    t, h = q_rope.shape[:2]
    if t == 0 or h == 0:
      raise NotImplementedError(f"{op}: no Mosaic GPU kernel for T = 0 or H = 0; got T={t}, H={h}")
    if num_slots is not None and num_slots == 0:
      raise NotImplementedError(f"{op}: no Mosaic GPU kernel for an empty cache")
  return check


def _choose(op, impl, interpret, supported, validated_on=_VALIDATED_ON):
  """"mosaic" or "xla" for one call (recorded by :func:`_dispatch.last_impl`). The kernel is raw Mosaic GPU
  (``plgpu.inline_mgpu``), which interpret mode cannot run: with ``interpret`` every impl takes the XLA path (so a
  graph run in interpret mode with ``impl="mosaic"`` runs its other kernels and reports this step as "xla")."""
  if interpret and impl != "xla":
    _dispatch.check_impl(impl)
    _log.info("%s: interpret mode runs the XLA path (the kernel is raw Mosaic GPU, not interpretable)", op)
    return _dispatch.record(op, "xla")
  return _dispatch.choose(op, impl, interpret=False, supported=supported, validated_on=validated_on)


@functools.partial(jax.jit, static_argnames=("interleaved", "tuning"))
def _rope_rmsnorm_mosaic(kv, q_rope, positions, cos, sin, norm_weight, eps, *, interleaved, tuning=()):
  from mla_pallas.kernels import rope_direct as rd
  t, h, _ = q_rope.shape
  kern = rd.build(t, h, 0, False, _config(t, h, False, tuning), interleaved=interleaved)
  q_out, kv_out = kern(kv, q_rope.reshape(t * h, D_ROPE), positions, cos, sin, norm_weight,
                       eps.astype(jnp.float32).reshape(1))
  return kv_out, q_out.reshape(t, h, D_ROPE)


def _dest_slots(slots, num_slots, unique_slots: bool, invalid: int):
  """[T] int32: each token's slot, or ``invalid`` where it writes nothing (out of range, or, unless the caller
  promised ``unique_slots``, a later token writes the same slot: at most one writer per slot, no races)."""
  keep = (slots >= 0) & (slots < num_slots) if unique_slots else _last_writer(slots, num_slots)
  return jnp.where(keep, slots, invalid)


@functools.partial(jax.jit, static_argnames=("interleaved", "tuning", "unique_slots"), donate_argnums=(0,))
def _fused_mosaic(pages, kv, q_rope, positions, cos, sin, norm_weight, eps, kv_scale, slots, *, interleaved,
                  tuning=(), unique_slots=False):
  from mla_pallas.kernels import rope_direct as rd
  t, h, _ = q_rope.shape
  num_slots = pages.size // D_QK
  cfg = _config(t, h, True, tuning)
  in_kernel = t <= cfg.warp_scan_max_tokens or cfg.bitmap_dedupe
  # raw slots where the kernel needs no help (one writer per slot promised, or its own last-writer check)
  dest = slots if unique_slots or in_kernel else _dest_slots(slots, num_slots, False, -1)
  kern = rd.build(t, h, num_slots, True, cfg, interleaved=interleaved, dedupe=in_kernel and t > 1 and not unique_slots)
  cache = jax.new_ref(pages.reshape(num_slots, D_QK))   # mutable ref: aliased in place by the kernel
  (q_out,) = kern(kv, q_rope.reshape(t * h, D_ROPE), positions, cos, sin, norm_weight,
                  eps.astype(jnp.float32).reshape(1), kv_scale.astype(jnp.float32).reshape(1), dest, cache)
  return jax.freeze(cache).reshape(pages.shape), q_out.reshape(t, h, D_ROPE)


# ---------------------------------------------------------------------------------------------------------
# rope
# ---------------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("interleaved",))
def _rope_jit(x, positions, cos, sin, *, interleaved):
  return reference.rope(x, positions, cos, sin, interleaved=interleaved)


def rope(x, positions, cos, sin, *, interleaved: bool = True, impl: str = "auto", interpret: bool = False):
  """Rotary position embedding.

  Args:
    x: [..., D] bfloat16 or float32, D even (64 for MLA's rope parts).
    positions: int32 whose shape is a prefix of ``x.shape[:-1]`` (e.g. [T] for x [T, H, 64]), broadcast over the
      remaining axes; clamped to [0, max_pos) before the table lookup.
    cos, sin: float32 [max_pos, D // 2] (:func:`mla_pallas.reference.rope_tables`).
    interleaved: python bool. True: DeepSeek pairing, (x[2i], x[2i+1]) rotated by angle positions · theta_i.
      False: NeoX / HF "rotate_half" pairing (x[i], x[i + D/2]).
    impl: "auto" | "mosaic" | "xla"; no kernel yet ("mosaic" raises NotImplementedError).
    interpret: accepted for API uniformity.

  Returns:
    rotated x, same shape and dtype; (a, b) -> (a cos - b sin, a sin + b cos) in float32.
  """
  _dispatch.check_impl(impl)
  interleaved = _check_rope(x, positions, cos, sin, interleaved)
  _dispatch.choose("rope", impl, interpret=interpret, supported=None)
  return _rope_jit(x, positions, cos, sin, interleaved=interleaved)


# ---------------------------------------------------------------------------------------------------------
# rms norm
# ---------------------------------------------------------------------------------------------------------

@jax.jit
def _rms_norm_jit(x, weight, eps):
  return reference.rms_norm(x, weight, eps)


def rms_norm(x, weight, eps, *, impl: str = "auto", interpret: bool = False):
  """RMS norm over the last axis: ``x * rsqrt(mean(x**2, -1) + eps) * weight``, float32 math.

  Args:
    x: [..., N] bfloat16 or float32 (N >= 1).
    weight: [N] bfloat16 or float32.
    eps: python float or f32 scalar.
    impl: "auto" | "mosaic" | "xla"; no kernel yet ("mosaic" raises NotImplementedError).
    interpret: accepted for API uniformity.

  Returns:
    same shape and dtype as x.
  """
  _dispatch.check_impl(impl)
  _checks.check_array("x", x, dtypes=_ACT, expect="[..., N]")
  if x.ndim < 1 or x.shape[-1] < 1:
    raise ValueError(f"x must have shape [..., N] with N >= 1; got shape {tuple(x.shape)}")
  _checks.check_array("weight", weight, ndim=1, shape=(x.shape[-1],), dtypes=_ACT,
                      expect=f"[N] = [{x.shape[-1]}]")
  eps = _checks.check_scalar("eps", eps)
  _dispatch.choose("rms_norm", impl, interpret=interpret, supported=None)
  return _rms_norm_jit(x, weight, jnp.asarray(eps, jnp.float32))


# ---------------------------------------------------------------------------------------------------------
# rope + rms norm (unfused variant)
# ---------------------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("interleaved",))
def _rope_rmsnorm_jit(kv, q_rope, positions, cos, sin, norm_weight, eps, *, interleaved):
  return reference.rope_rmsnorm(kv, q_rope, positions, cos, sin, norm_weight, eps=eps, interleaved=interleaved)


def rope_rmsnorm(kv, q_rope, positions, cos, sin, norm_weight, *, eps, interleaved: bool = True,
                 impl: str = "auto", interpret: bool = False):
  """MLA pre-cache step (unfused): RMS-norm the latent and rotate the rope parts of kv and q.

  Args:
    kv: [T, 576] bfloat16 (or float32): [0, 512) compressed latent, [512, 576) the key's rope part.
    q_rope: [T, H, 64] bfloat16 (or float32): the queries' rope parts.
    positions: [T] int32 (clamped to [0, max_pos)).
    cos, sin: float32 [max_pos, 32].
    norm_weight: [512] bfloat16/float32 (kv_a_layernorm weight).
    eps: python float or f32 scalar.
    interleaved: python bool, see :func:`rope`.
    impl: "auto" | "mosaic" | "xla". "mosaic": the sm_90 kernel for bfloat16 kv/q_rope, any T and H, on a Hopper
      GPU; otherwise NotImplementedError ("auto" then runs XLA). The kernel's results may differ from the XLA path
      by one bf16 ulp / e4m3 step in a few values (RMS summation order, FMA contraction).
    interpret: True (or a ``plgpu.InterpretGPUParams``): the XLA path under every impl, recorded as "xla" (the
      kernel is raw Mosaic GPU, which interpret mode cannot run; module docstring).

  Returns:
    (kv_out [T, 576] in kv's dtype, q_rope_out [T, H, 64] in q_rope's dtype):
    kv_out = rms_norm(kv[:, :512], norm_weight, eps) ‖ rope(kv[:, 512:], positions); q_rope_out =
    rope(q_rope, positions) (positions broadcast over H). Float32 math.
  """
  _dispatch.check_impl(impl)
  interleaved = _check_kv_rope(kv, q_rope, positions, cos, sin, norm_weight, eps, interleaved)
  used = _choose("rope_rmsnorm", impl, interpret, _kernel_supported("rope_rmsnorm", kv, q_rope))
  if used == "mosaic":
    return _rope_rmsnorm_mosaic(kv, q_rope, positions, cos, sin, norm_weight, jnp.asarray(eps, jnp.float32),
                                interleaved=interleaved)
  return _rope_rmsnorm_jit(kv, q_rope, positions, cos, sin, norm_weight, jnp.asarray(eps, jnp.float32),
                           interleaved=interleaved)


# ---------------------------------------------------------------------------------------------------------
# fused rope + rms norm + fp8 quantization + cache write
# ---------------------------------------------------------------------------------------------------------

# Up to this many tokens the XLA duplicate check compares all pairs (T^2 booleans); above, a scatter-max over the
# slots (docs/kernels/rope_direct.md).
PAIRWISE_MAX_T = 128


def _last_writer(slots, num_slots):
  """[T] bool: slot in [0, num_slots) and no later token (higher t) writes the same slot. No sort: for
  T <= PAIRWISE_MAX_T all pairs are compared; beyond, a scatter-max of the token index over a [num_slots] int32
  array (a memset of 4 · num_slots bytes plus T scattered writes) finds each slot's last writer."""
  t = slots.shape[0]
  in_range = (slots >= 0) & (slots < num_slots)
  tok = jnp.arange(t, dtype=jnp.int32)
  if t <= PAIRWISE_MAX_T:
    later_same = (slots[None, :] == slots[:, None]) & (tok[None, :] > tok[:, None])   # [t, t'] t' > t, same slot
    return in_range & ~jnp.any(later_same, axis=1)
  safe = jnp.where(in_range, slots, num_slots)                        # out of range: dropped by the scatter
  last = jnp.full((num_slots,), -1, jnp.int32).at[safe].max(tok, mode="drop")
  return in_range & (last.at[safe].get(mode="fill", fill_value=-1) == tok)


@functools.partial(jax.jit, static_argnames=("interleaved", "unique_slots"), donate_argnums=(0,))
def _fused_jit(pages, kv, q_rope, positions, cos, sin, norm_weight, eps, kv_scale, slots, *, interleaved,
               unique_slots=False):
  # kv in float32 -> rows stay float32 (the reference casts to float32 first, so this is bitwise its math)
  rows, q_out = reference.rope_rmsnorm(kv.astype(jnp.float32), q_rope, positions, cos, sin, norm_weight,
                                       eps=eps, interleaved=interleaved)
  rows8 = quant.encode_cache_rows(rows, kv_scale, pages.dtype)   # e4m3 (clipped), or bf16 rounding
  flat = pages.reshape(-1, D_QK)
  num_slots = flat.shape[0]
  dest = _dest_slots(slots, num_slots, unique_slots, num_slots)   # out of bounds -> dropped by the scatter
  flat = flat.at[dest].set(rows8, mode="drop", unique_indices=True)
  return flat.reshape(pages.shape), q_out


def checked_fused_dispatch(pages, kv, q_rope, positions, cos, sin, norm_weight, eps, kv_scale, slots,
                           interleaved, unique_slots, impl, interpret):
  """:func:`fused_rope_rmsnorm_quantization`'s argument checks and its choice of path (recorded): returns
  ("mosaic" | "xla", interleaved, unique_slots) as python values."""
  _dispatch.check_impl(impl)
  _checks.check_array("pages", pages, ndim=(2, 3), dtypes=(quant.FP8, jnp.bfloat16),
                      expect="[num_pages, page_size, 576] or [num_slots, 576]")
  if pages.shape[-1] != D_QK:
    raise ValueError("pages must have shape [num_pages, page_size, 576] or [num_slots, 576] and dtype "
                     f"float8_e4m3fn or bfloat16; got shape {tuple(pages.shape)}")
  interleaved = _check_kv_rope(kv, q_rope, positions, cos, sin, norm_weight, eps, interleaved)
  t = kv.shape[0]
  _checks.check_array("slots", slots, ndim=1, shape=(t,), dtypes=(jnp.int32,), expect=f"[T] = [{t}]")
  _checks.check_scalar("kv_scale", kv_scale, positive=True)
  unique_slots = _check_bool("unique_slots", unique_slots)
  num_slots = pages.size // D_QK
  used = _choose("fused_rope_rmsnorm_quantization", impl, interpret,
                 _kernel_supported("fused_rope_rmsnorm_quantization", kv, q_rope, num_slots, pages.dtype),
                 _VALIDATED_ON if pages.dtype == quant.FP8 else _BF16_PAGES_VALIDATED_ON)
  return used, interleaved, unique_slots


def cache_write_ctas(t: int, h: int, num_slots: int, interleaved: bool, unique_slots: bool):
  """The kernel's cache write for T tokens and H q heads as extra CTAs of another launch
  (``kernels.rope_direct.CacheWriteCTAs``, the same work and bits as :func:`fused_rope_rmsnorm_quantization`'s
  kernel with raw slots), or None above its warp-scan limit (T > ``warp_scan_max_tokens``: the kernel's SMEM
  bitmap duplicate check, or the XLA pre-pass)."""
  from mla_pallas.kernels import rope_direct as rd
  cfg = _config(t, h, True)
  if t > cfg.warp_scan_max_tokens:
    return None
  return rd.CacheWriteCTAs(t, h, num_slots, cfg, bool(interleaved), t > 1 and not unique_slots)


def fused_rope_rmsnorm_quantization(pages, kv, q_rope, positions, cos, sin, norm_weight, *, eps, kv_scale,
                                    slots, interleaved: bool = True, unique_slots: bool = False,
                                    impl: str = "auto", interpret: bool = False):
  """Fused MLA cache write: :func:`rope_rmsnorm`, FP8 quantization and a scatter into the paged cache.

  Args:
    pages: float8_e4m3fn cache [num_pages, page_size, 576] or flat [num_slots, 576], or a bfloat16 one (rows
      stored as ``quant.encode_cache_rows``: ``bf16(row · f32(1 / kv_scale))``, not clipped; the XLA path, or the
      kernel with impl="mosaic" until its bf16 write has been validated on a GPU). DONATED: both paths are
      jitted with ``donate_argnums=0`` (the kernel writes the donated buffer in place, through an input/output
      alias), so on backends that support donation (GPU, TPU, CPU) the buffer passed in
      is consumed and must not be used afterwards; keep a copy if you need the old contents.
    kv: [T, 576] bfloat16 (or float32): latent [0, 512) ‖ key rope part [512, 576).
    q_rope: [T, H, 64] bfloat16 (or float32).
    positions: [T] int32.
    cos, sin: float32 [max_pos, 32].
    norm_weight: [512] bfloat16/float32.
    eps: python float or f32 scalar.
    kv_scale: per-tensor cache scale, python float > 0 or f32 scalar.
    slots: [T] int32 flat slot ids (page · page_size + offset). A slot outside [0, num_slots) (e.g. -1 for
      padding tokens) is skipped; every slot not written is left bitwise untouched (NaN stays NaN). Duplicate
      slots: the last token (highest t) wins.
    interleaved: python bool, see :func:`rope`.
    unique_slots: python bool, like ``unique_indices`` of JAX scatters: True promises that no two tokens share a
      slot in [0, num_slots) (a serving engine's fresh slots), which skips the duplicate-slot check (in the kernel
      and in the XLA path). If the promise is broken, the duplicated slots' rows are unspecified (possibly parts of
      different tokens' rows); other slots are exact.
    impl: "auto" | "mosaic" | "xla". "mosaic": the sm_90 kernel for bfloat16 kv/q_rope, any T and H, on a Hopper
      GPU; otherwise NotImplementedError ("auto" then runs XLA). The kernel's results may differ from the XLA path
      by one bf16 ulp / e4m3 step in a few values (RMS summation order, FMA contraction).
    interpret: True (or a ``plgpu.InterpretGPUParams``): the XLA path under every impl, recorded as "xla" (the
      kernel is raw Mosaic GPU, which interpret mode cannot run; module docstring).

  Returns:
    (new_pages, q_rope_out): new_pages has pages' shape and dtype with
    ``new_pages[slot[t]] = clip(row[t] / kv_scale, -448, 448).astype(float8_e4m3fn)``, where
    ``row = rms_norm(kv[:, :512], norm_weight, eps) ‖ rope(kv[:, 512:], positions)`` is kept in float32 (not
    rounded to bfloat16 first); q_rope_out [T, H, 64] in q_rope's dtype = rope(q_rope, positions).
  """
  used, interleaved, unique_slots = checked_fused_dispatch(pages, kv, q_rope, positions, cos, sin, norm_weight, eps,
                                                          kv_scale, slots, interleaved, unique_slots, impl,
                                                          interpret)
  if used == "mosaic":
    return _fused_mosaic(pages, kv, q_rope, positions, cos, sin, norm_weight, jnp.asarray(eps, jnp.float32),
                         jnp.asarray(kv_scale, jnp.float32), slots, interleaved=interleaved,
                         unique_slots=unique_slots)
  return _fused_jit(pages, kv, q_rope, positions, cos, sin, norm_weight, jnp.asarray(eps, jnp.float32),
                    jnp.asarray(kv_scale, jnp.float32), slots, interleaved=interleaved, unique_slots=unique_slots)
