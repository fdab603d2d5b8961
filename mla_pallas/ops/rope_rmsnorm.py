"""RoPE, RMS norm and the fused MLA cache write: ``rope``, ``rms_norm``, ``rope_rmsnorm``,
``fused_rope_rmsnorm_quantization``.

Semantics are exactly those of :func:`mla_pallas.reference.rope`, :func:`~mla_pallas.reference.rms_norm`,
:func:`~mla_pallas.reference.rope_rmsnorm` and :func:`~mla_pallas.reference.rope_rmsnorm_quantize_write`; the XLA
paths use the reference's float32 formulations (elementwise math that XLA fuses into one pass), so results are
bitwise those of the reference.

Mosaic GPU kernels for :func:`rope_rmsnorm` and :func:`fused_rope_rmsnorm_quantization` (bf16 ``kv``/``q_rope``;
other dtypes raise ``NotImplementedError`` under ``impl="mosaic"`` and run XLA under ``impl="auto"``):

* :mod:`mla_pallas.kernels.rope_direct` (sm_90a; the default): GMEM -> registers -> GMEM, any H, no XLA work
  around it (the kernel gathers the cos/sin rows and finds each slot's last writer itself). Raw Mosaic GPU
  (``plgpu.inline_mgpu``), so it does not run in interpret mode.
* :mod:`mla_pallas.kernels.rope_rmsnorm` (the tiled kernel: TMA, a wgmma for the pair swap, SMEM staging; sm_90a or
  interpret mode): runs in interpret mode, where T · H · 8 >= 2^31, and on request; needs ``H % 64 == 0`` or
  ``64 % H == 0``. Its XLA pre-pass (outside its in-kernel-table range, T > 256) is the per-token table gather
  ([T, 128], f32 bits as int32; with the cache write, the sanitised slots ride in a 129th column, so the gather and
  the end of the duplicate-slot check (:func:`_last_writer`) are one XLA kernel); kv is padded only for T > 8 not a
  multiple of 8 and q_rope only for H < 8.

Both sum the RMS in a different order than XLA, so a few values can differ from the reference by one bf16 ulp / one
e4m3 step (see the kernel docstrings). ``rope`` and ``rms_norm`` alone have no kernel (XLA). The private jitted
entry points take ``tuning`` for tests and benchmarks: (name, value) pairs of either kernel's TuningConfig, and
("kernel", "direct" | "tiled") to pick one (:func:`_direct_config`).

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

import jax
import jax.numpy as jnp
import numpy as np

from mla_pallas import _checks, _dispatch, quant, reference

__all__ = ["rope", "rms_norm", "rope_rmsnorm", "fused_rope_rmsnorm_quantization"]

D_QK = 576
D_V = 512
D_ROPE = 64
_ACT = (jnp.bfloat16, jnp.float32)


# "auto" takes a kernel only where it measured faster than XLA (benchmarks/RESULTS.md, H200). The tiled kernel
# (v3, 2026-11-30) was at parity or slower at T < 128 (unfused T = 1 0.95x even after its last changes), so auto
# started at T = 128, H = 16. The direct kernel (the default outside interpret mode since 2026-11-30j) measured
# faster at every shape tried, same-run XLA: fused T = 1 3.3-3.4x (H = 1, 8, 16, 128), T = 8 2.9x, T = 128 4.5-4.6x,
# T = 4096 H = 128 2.7x, T = 8192 H = 16 2.9x, T = 4096 H = 8 2.2x; unfused T = 1 2.5x, T = 8 2.8x, T = 8192 2.5x.
# Hence no threshold: auto takes the kernel at every T and H (where it is supported).
_VALIDATED_ON: tuple[str, ...] = ("sm90",)
AUTO_MIN_TOKENS = 1
AUTO_MIN_HEADS = 1


def _slower_than_xla(op: str, tokens: int, heads: int):
  def reason():
    if tokens < AUTO_MIN_TOKENS or heads < AUTO_MIN_HEADS:
      return (f"{op}: the kernel is used automatically only for T >= {AUTO_MIN_TOKENS} and H >= {AUTO_MIN_HEADS} "
              f"(where it measured faster than XLA); got T={tokens}, H={heads}")
    return None
  return reason


def _check_bool(name, v):
  if not isinstance(v, (bool, np.bool_)):
    raise ValueError(f"{name} must be a python bool; got {type(v).__name__}")
  return bool(v)


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
# Mosaic GPU kernel plumbing (mla_pallas.kernels.rope_rmsnorm)
# ---------------------------------------------------------------------------------------------------------

KERNEL_HEAD_MULTIPLE = 64   # the kernel processes q_rope in tiles of 64 rows: H % 64 == 0 or 64 % H == 0


def _kernel_supported(op, kv, q_rope, interpret, num_slots=None):
  """``supported`` callable for :func:`_dispatch.choose`: raises NotImplementedError for inputs the kernel lacks."""
  def check():
    arch = _dispatch.mosaic_arch(interpret)
    if arch != "sm90":
      raise NotImplementedError(f"{op} has a Mosaic GPU kernel for sm_90 (Hopper) only; this device needs the "
                                f"{arch} kernel, which does not exist yet")
    if kv.dtype != jnp.bfloat16 or q_rope.dtype != jnp.bfloat16:
      raise NotImplementedError(f"{op}: no Mosaic GPU kernel for these inputs: it takes bfloat16 kv and q_rope; "
                                f"got {np.dtype(kv.dtype).name} and {np.dtype(q_rope.dtype).name}")
    t, h = q_rope.shape[:2]
    if t == 0 or h == 0:
      raise NotImplementedError(f"{op}: no Mosaic GPU kernel for T = 0 or H = 0; got T={t}, H={h}")
    tiled = interpret or not _direct_fits(t, h)   # the direct kernel takes any H; the tiled one runs otherwise
    if tiled and h % KERNEL_HEAD_MULTIPLE and KERNEL_HEAD_MULTIPLE % h:
      raise NotImplementedError(f"{op}: no Mosaic GPU kernel for these inputs: the tiled kernel (interpret mode, "
                                f"or T * H * 8 >= 2^31) needs H a multiple or a divisor of {KERNEL_HEAD_MULTIPLE}; "
                                f"got T={t}, H={h}")
    if num_slots is not None and num_slots == 0:
      raise NotImplementedError(f"{op}: no Mosaic GPU kernel for an empty cache")
  return check


def _swap_matrix(interleaved):
  """[64, 64] bf16 0/1 matrix P with (x @ P)[:, n] = x[:, partner(n)] (the other member of n's rotation pair)."""
  n = np.arange(D_ROPE)
  partner = n ^ 1 if interleaved else (n + D_ROPE // 2) % D_ROPE
  p = np.zeros((D_ROPE, D_ROPE), np.float32)
  p[partner, n] = 1.0
  return jnp.asarray(p, jnp.bfloat16)


def _kernel_tables(positions, cos, sin, interleaved, rows=None):
  """Per-token tables arranged per column, [T, 64] f32 each: y = x * C + swap(x) * S (see the kernel doc)."""
  half = D_ROPE // 2
  p = jnp.clip(positions, 0, cos.shape[0] - 1)
  if rows is not None and rows != p.shape[0]:
    p = jnp.pad(p, (0, rows - p.shape[0]))
  c = jnp.take(cos, p, axis=0, mode="clip")
  s = jnp.take(sin, p, axis=0, mode="clip")
  if interleaved:
    return jnp.repeat(c, 2, axis=1), jnp.stack([-s, s], axis=-1).reshape(p.shape[0], 2 * half)
  return jnp.concatenate([c, c], axis=1), jnp.concatenate([-s, s], axis=1)


def _num_sms() -> int:
  """SM count of the default GPU (one CTA per SM); 132 (H100 SXM / H200) without a GPU."""
  dev = jax.devices()[0]
  return int(getattr(dev, "core_count", 0) or 132) if dev.platform == "gpu" else 132


# Interpret mode runs each warpgroup on its own thread, and a barrier wait blocks a thread of XLA:CPU's callback
# pool (about one per core): with more warpgroups than that waiting on each other's copies, the interpreter can
# starve (tests/test_sparse_decode_sm100.py saw the same). The default config takes at most this many warpgroups
# in interpret mode; an explicit ``warpgroups`` is kept.
INTERPRET_MAX_WARPGROUPS = 2


def _kernel_config(t, h, fused, tuning=(), interpret=False):
  """The kernel's TuningConfig: :func:`~mla_pallas.kernels.rope_rmsnorm.default_config` for the shape, then
  ``tuning`` ((name, value) pairs: tests, benchmarks) overrides; the grid (tokens_per_cta, ctas) is re-derived for
  the overridden config (:func:`~mla_pallas.kernels.rope_rmsnorm.grid_for`) unless given, and without an explicit
  ``stages`` the deepest ring (default's, 3, 2) that fits the overridden grid is taken. Outside interpret mode
  ``gather_tables`` is on at T <= GATHER_TABLES_MAX_TOKENS (the kernel module's measured rule)."""
  from mla_pallas.kernels import rope_rmsnorm as rk
  kw = dict(tuning)
  if interpret and "warpgroups" not in kw:
    kw["warpgroups"] = min(rk.TuningConfig().warpgroups, INTERPRET_MAX_WARPGROUPS)
  cfg = rk.default_config(t, h, fused, _num_sms())
  if not interpret and t <= rk.GATHER_TABLES_MAX_TOKENS:   # interpret mode has no inline_mgpu: the pre-pass
    cfg = dataclasses.replace(cfg, gather_tables=True)
  if kw:
    kw.setdefault("tokens_per_cta", None)
    kw.setdefault("ctas", None)
    if "stages" not in kw:   # a grid override may need a shallower ring than the default's to fit in SMEM
      for stages in sorted({cfg.stages, 3, 2}, reverse=True):
        c = dataclasses.replace(cfg, **kw, stages=stages)
        try:
          rk.grid_for(c, t, h, fused, _num_sms())     # raises ValueError when the grid's SMEM does not fit
          return c
        except ValueError:
          if stages == 2:
            raise
    cfg = dataclasses.replace(cfg, **kw)
  return cfg


# Two kernels: the direct one (kernels/rope_direct.py, GMEM -> registers -> GMEM; raw Mosaic GPU, so not in
# interpret mode) and the tiled one (kernels/rope_rmsnorm.py: TMA, wgmma pair swap, SMEM staging). H200,
# 2026-11-30j (benchmarks/RESULTS.md "rope direct"): the direct kernel was faster at every measured shape, T = 1 to
# 20000, H = 1 to 128 (e.g. fused T = 1 1.2 vs 3.5 us, T = 4096 H = 128 36.5 vs 44.7 us, T = 8192 H = 16 15.0 vs
# 30.6 us), so it is the default wherever it runs; the tiled kernel runs in interpret mode, past the direct
# kernel's int32 item count, and on request. ``tuning`` may pick either: ("kernel", "direct" | "tiled"); the
# direct kernel's knobs are the fields of rope_direct.TuningConfig.


def _direct_fits(t, h):
  from mla_pallas.kernels import rope_direct as rd
  return rd.fits(t, h)


def _direct_config(t, tuning=(), interpret=False, h=1):
  """The direct kernel's TuningConfig when the op runs it for T = t tokens of H = h heads, else None (the tiled
  kernel): by default outside interpret mode (which has no ``inline_mgpu``) while T · H · 8 fits in int32, unless
  ``tuning`` sets a knob of the tiled kernel; ``tuning``'s ("kernel", ..) entry overrides the choice."""
  from mla_pallas.kernels import rope_direct as rd
  kw = dict(tuning)
  kernel = kw.pop("kernel", None)
  if kernel not in (None, "direct", "tiled"):
    raise ValueError(f"tuning's kernel must be 'direct' or 'tiled'; got {kernel!r}")
  own = rd.knobs()
  if kernel == "direct":
    if interpret:
      raise NotImplementedError("the direct rope kernel needs plgpu.inline_mgpu, which interpret mode lacks")
    if set(kw) - own:
      raise ValueError(f"tuning for the direct rope kernel takes {sorted(own)}; got {sorted(kw)}")
  elif kernel == "tiled" or interpret or not _direct_fits(t, h) or set(kw) - own:
    return None
  return rd.TuningConfig(**kw)


def _tiled_tuning(tuning):
  """``tuning`` without the kernel choice and the direct kernel's knobs (the tiled kernel's overrides)."""
  from mla_pallas.kernels import rope_direct as rd
  return tuple((k, v) for k, v in tuning if k != "kernel" and k not in rd.knobs())


def _kernel_common(kv, q_rope, positions, cos, sin, norm_weight, interleaved, dest=None, gather=False):
  """The kernel's inputs: views of kv / q_rope (copies only where a row count needs padding to a multiple of 8:
  odd T > 8, and H < 8), then the tables: C | S as int32 bits, [T, 128], with (fused) the sanitised slots ``dest``
  in column 128 of [T, 132] (one fused XLA gather + concatenate: one kernel, not two); with ``gather``
  (TuningConfig.gather_tables) the raw positions, cos, sin (and ``dest``) instead, no XLA work."""
  from mla_pallas.kernels import rope_rmsnorm as rk
  t, h, _ = q_rope.shape
  if gather:
    tables = (positions, cos, sin) + ((dest,) if dest is not None else ())
  else:
    c_tab, s_tab = _kernel_tables(positions, cos, sin, interleaved)
    cols = [jax.lax.bitcast_convert_type(c_tab, jnp.int32), jax.lax.bitcast_convert_type(s_tab, jnp.int32)]
    if dest is not None:
      cols += [dest[:, None], jnp.zeros((t, rk.TAB_COLS_FUSED - 2 * D_ROPE - 1), jnp.int32)]
    tables = (jnp.concatenate(cols, axis=1),)
  w = norm_weight.reshape(D_V // 64, 64)
  kv_rows, q_rows = rk.kv_rows_for(t), rk.q_rows_for(t, h)
  kv_in = jnp.pad(kv, ((0, kv_rows - t), (0, 0))) if kv_rows != t else kv
  q2 = q_rope.reshape(t * h, D_ROPE)
  q_in = jnp.pad(q2, ((0, q_rows - t * h), (0, 0))) if q_rows != t * h else q2
  return (kv_in.reshape(kv_rows, D_QK // 64, 64), q_in, *tables, w, _swap_matrix(interleaved))


def _q_out(q_out, t, h):
  return (q_out[:t * h] if q_out.shape[0] != t * h else q_out).reshape(t, h, D_ROPE)


@functools.partial(jax.jit, static_argnames=("interleaved", "interpret", "tuning"))
def _rope_rmsnorm_mosaic(kv, q_rope, positions, cos, sin, norm_weight, eps, *, interleaved, interpret, tuning=()):
  from mla_pallas.kernels import rope_direct as rd
  from mla_pallas.kernels import rope_rmsnorm as rk
  t, h, _ = q_rope.shape
  dcfg = _direct_config(t, tuning, interpret, h)
  if dcfg is not None:
    kern = rd.build(t, h, 0, False, dcfg, interleaved=interleaved)
    q_out, kv_out = kern(kv, q_rope.reshape(t * h, D_ROPE), positions, cos, sin, norm_weight,
                         eps.astype(jnp.float32).reshape(1))
    return kv_out, q_out.reshape(t, h, D_ROPE)
  cfg = _kernel_config(t, h, False, _tiled_tuning(tuning), interpret)
  args = _kernel_common(kv, q_rope, positions, cos, sin, norm_weight, interleaved, gather=cfg.gather_tables)
  kern = rk.build(t, h, 0, False, cfg, interpret=interpret, w_dtype=norm_weight.dtype, num_sms=_num_sms(),
                  interleaved=interleaved)
  q_out, kv_out = kern(*args, eps.astype(jnp.float32).reshape(1))
  return kv_out.reshape(t, D_QK), _q_out(q_out, t, h)


def _dest_slots(slots, num_slots, unique_slots: bool, invalid: int):
  """[T] int32: each token's slot, or ``invalid`` where it writes nothing (out of range, or, unless the caller
  promised ``unique_slots``, a later token writes the same slot: at most one writer per slot, no races)."""
  keep = (slots >= 0) & (slots < num_slots) if unique_slots else _last_writer(slots, num_slots)
  return jnp.where(keep, slots, invalid)


@functools.partial(jax.jit, static_argnames=("interleaved", "interpret", "tuning", "unique_slots"),
                   donate_argnums=(0,))
def _fused_mosaic(pages, kv, q_rope, positions, cos, sin, norm_weight, eps, kv_scale, slots, *, interleaved,
                  interpret, tuning=(), unique_slots=False):
  from mla_pallas.kernels import rope_direct as rd
  from mla_pallas.kernels import rope_rmsnorm as rk
  t, h, _ = q_rope.shape
  num_slots = pages.size // D_QK
  from mla_pallas.kernels import rope_tables
  dcfg = _direct_config(t, tuning, interpret, h)
  if dcfg is not None:
    in_kernel = t <= dcfg.warp_scan_max_tokens or dcfg.bitmap_dedupe
    # raw slots where the kernel needs no help (one writer per slot promised, or its own last-writer check)
    dest = slots if unique_slots or in_kernel else _dest_slots(slots, num_slots, False, -1)
    kern = rd.build(t, h, num_slots, True, dcfg, interleaved=interleaved,
                    dedupe=in_kernel and t > 1 and not unique_slots)
    cache = jax.new_ref(pages.reshape(num_slots, D_QK))   # mutable ref: aliased in place by the kernel
    (q_out,) = kern(kv, q_rope.reshape(t * h, D_ROPE), positions, cos, sin, norm_weight,
                    eps.astype(jnp.float32).reshape(1), kv_scale.astype(jnp.float32).reshape(1), dest, cache)
    return jax.freeze(cache).reshape(pages.shape), q_out.reshape(t, h, D_ROPE)
  tuning = _tiled_tuning(tuning)
  cfg = _kernel_config(t, h, True, tuning, interpret)
  dedupe = cfg.gather_tables and not unique_slots and 1 < t <= rope_tables.DEDUPE_MAX_TOKENS
  if cfg.gather_tables and (unique_slots or t <= rope_tables.DEDUPE_MAX_TOKENS):
    # raw slots, no XLA work: one writer per slot (the kernel's range check is all the sanitising), or the kernel
    # finds each slot's last writer itself (dedupe)
    dest = slots
  else:
    dest = _dest_slots(slots, num_slots, unique_slots, -1)
  args = _kernel_common(kv, q_rope, positions, cos, sin, norm_weight, interleaved, dest, gather=cfg.gather_tables)
  kern = rk.build(t, h, num_slots, True, cfg, interpret=interpret, w_dtype=norm_weight.dtype, num_sms=_num_sms(),
                  interleaved=interleaved, dedupe=dedupe)
  cache = jax.new_ref(pages.reshape(num_slots, D_QK // 64, 64))   # mutable ref: aliased in place by the kernel
  (q_out,) = kern(*args, eps.astype(jnp.float32).reshape(1), kv_scale.astype(jnp.float32).reshape(1), cache)
  return jax.freeze(cache).reshape(pages.shape), _q_out(q_out, t, h)


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
    impl: "auto" | "mosaic" | "xla". "mosaic": the sm_90 kernels for bfloat16 kv/q_rope (module docstring: on a
      Hopper GPU the direct kernel, any H; with ``interpret`` the tiled kernel, H % 64 == 0 or 64 % H == 0); otherwise
      NotImplementedError ("auto" then runs XLA). The kernel's results may differ from the XLA path by one bf16
      ulp / e4m3 step in a few values (RMS summation order, FMA contraction).
    interpret: run the kernel in Pallas' GPU interpret mode (CPU): True or a ``plgpu.InterpretGPUParams``.

  Returns:
    (kv_out [T, 576] in kv's dtype, q_rope_out [T, H, 64] in q_rope's dtype):
    kv_out = rms_norm(kv[:, :512], norm_weight, eps) ‖ rope(kv[:, 512:], positions); q_rope_out =
    rope(q_rope, positions) (positions broadcast over H). Float32 math.
  """
  _dispatch.check_impl(impl)
  interleaved = _check_kv_rope(kv, q_rope, positions, cos, sin, norm_weight, eps, interleaved)
  used = _dispatch.choose("rope_rmsnorm", impl, interpret=interpret,
                          supported=_kernel_supported("rope_rmsnorm", kv, q_rope, interpret),
                          validated_on=_VALIDATED_ON,
                          slower_than_xla=_slower_than_xla("rope_rmsnorm", kv.shape[0], q_rope.shape[1]))
  if used == "mosaic":
    return _rope_rmsnorm_mosaic(kv, q_rope, positions, cos, sin, norm_weight, jnp.asarray(eps, jnp.float32),
                                interleaved=interleaved, interpret=interpret)
  return _rope_rmsnorm_jit(kv, q_rope, positions, cos, sin, norm_weight, jnp.asarray(eps, jnp.float32),
                           interleaved=interleaved)


# ---------------------------------------------------------------------------------------------------------
# fused rope + rms norm + fp8 quantization + cache write
# ---------------------------------------------------------------------------------------------------------

# Up to this many tokens the duplicate check compares all pairs (T^2 booleans). H200 (2026-11-30): standalone the
# pairwise form was faster up to T = 1024, but XLA fuses it into the table gather of the pre-pass, which then took
# 8.3 us at T = 512 (H = 128) against 3.6 us for the scatter-max form's three kernels at T = 1024; at T = 128 the
# fused pairwise form added ~1 us.
PAIRWISE_MAX_T = 128


def _last_writer(slots, num_slots, pairwise_max_t=None):
  """[T] bool: slot in [0, num_slots) and no later token (higher t) writes the same slot.

  No sort (an argsort of 4096 slots took 32 us on an H200, a third of the fused op): for T <= PAIRWISE_MAX_T all
  pairs are compared; beyond, a scatter-max of the token index over a [num_slots] int32 array (a memset of
  4 · num_slots bytes plus T scattered writes) finds each slot's last writer. ``pairwise_max_t`` overrides
  PAIRWISE_MAX_T (benchmarks/rope_v3_gpu.sh times both forms).
  """
  t = slots.shape[0]
  in_range = (slots >= 0) & (slots < num_slots)
  tok = jnp.arange(t, dtype=jnp.int32)
  if t <= (PAIRWISE_MAX_T if pairwise_max_t is None else pairwise_max_t):
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
  rows8 = quant.quantize_fp8(rows, kv_scale)
  flat = pages.reshape(-1, D_QK)
  num_slots = flat.shape[0]
  dest = _dest_slots(slots, num_slots, unique_slots, num_slots)   # out of bounds -> dropped by the scatter
  flat = flat.at[dest].set(rows8, mode="drop", unique_indices=True)
  return flat.reshape(pages.shape), q_out


def fused_rope_rmsnorm_quantization(pages, kv, q_rope, positions, cos, sin, norm_weight, *, eps, kv_scale,
                                    slots, interleaved: bool = True, unique_slots: bool = False,
                                    impl: str = "auto", interpret: bool = False):
  """Fused MLA cache write: :func:`rope_rmsnorm`, FP8 quantization and a scatter into the paged cache.

  Args:
    pages: float8_e4m3fn cache [num_pages, page_size, 576] or flat [num_slots, 576]. DONATED: both paths are
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
      slot in [0, num_slots) (a serving engine's fresh slots), which skips the duplicate-slot check (in the direct
      kernel; H200: 0.4-2.0 µs at T = 512-8192; the XLA path's scan is 1-3 small kernels). If
      the promise is broken, the duplicated slots' rows are unspecified (possibly parts of different tokens' rows);
      other slots are exact.
    impl: "auto" | "mosaic" | "xla". "mosaic": the sm_90 kernels for bfloat16 kv/q_rope (module docstring: on a
      Hopper GPU the direct kernel, any H; with ``interpret`` the tiled kernel, H % 64 == 0 or 64 % H == 0); otherwise
      NotImplementedError ("auto" then runs XLA). The kernel's results may differ from the XLA path by one bf16
      ulp / e4m3 step in a few values (RMS summation order, FMA contraction).
    interpret: run the kernel in Pallas' GPU interpret mode (CPU): True or a ``plgpu.InterpretGPUParams``.

  Returns:
    (new_pages, q_rope_out): new_pages has pages' shape and dtype with
    ``new_pages[slot[t]] = clip(row[t] / kv_scale, -448, 448).astype(float8_e4m3fn)``, where
    ``row = rms_norm(kv[:, :512], norm_weight, eps) ‖ rope(kv[:, 512:], positions)`` is kept in float32 (not
    rounded to bfloat16 first); q_rope_out [T, H, 64] in q_rope's dtype = rope(q_rope, positions).
  """
  _dispatch.check_impl(impl)
  _checks.check_array("pages", pages, ndim=(2, 3), dtypes=(quant.FP8,),
                      expect="[num_pages, page_size, 576] or [num_slots, 576]")
  if pages.shape[-1] != D_QK:
    raise ValueError("pages must have shape [num_pages, page_size, 576] or [num_slots, 576] and dtype "
                     f"float8_e4m3fn; got shape {tuple(pages.shape)}")
  interleaved = _check_kv_rope(kv, q_rope, positions, cos, sin, norm_weight, eps, interleaved)
  t = kv.shape[0]
  _checks.check_array("slots", slots, ndim=1, shape=(t,), dtypes=(jnp.int32,), expect=f"[T] = [{t}]")
  _checks.check_scalar("kv_scale", kv_scale, positive=True)
  unique_slots = _check_bool("unique_slots", unique_slots)
  num_slots = pages.size // D_QK
  used = _dispatch.choose("fused_rope_rmsnorm_quantization", impl, interpret=interpret,
                          supported=_kernel_supported("fused_rope_rmsnorm_quantization", kv, q_rope, interpret,
                                                      num_slots),
                          validated_on=_VALIDATED_ON,
                          slower_than_xla=_slower_than_xla("fused_rope_rmsnorm_quantization", t,
                                                           q_rope.shape[1]))
  if used == "mosaic":
    return _fused_mosaic(pages, kv, q_rope, positions, cos, sin, norm_weight, jnp.asarray(eps, jnp.float32),
                         jnp.asarray(kv_scale, jnp.float32), slots, interleaved=interleaved, interpret=interpret,
                         unique_slots=unique_slots)
  return _fused_jit(pages, kv, q_rope, positions, cos, sin, norm_weight, jnp.asarray(eps, jnp.float32),
                    jnp.asarray(kv_scale, jnp.float32), slots, interleaved=interleaved, unique_slots=unique_slots)
