"""Per-head FP8 GEMM with dynamic activation quantization (MLA's absorbed W_UK / W_UV): ``quantize_and_bmm_fp8``.

Semantics are those of :func:`mla_pallas.reference.quantize_and_bmm_fp8` (same quantization of ``a``; the
reference multiplies the dequantized operands in float32, this op multiplies the fp8 operands).

XLA path (real FP8 operands):
  1. ``a [T, H, K]`` is quantized to float8_e4m3fn with :func:`mla_pallas.quant.quantize_rows_fp8` (one scale per
     (t, h) row of K values, ``act_scale="per_token"``) or :func:`mla_pallas.quant.quantize_tensor_fp8`
     (``"per_tensor"``).
  2. For every 128-wide K block ``kb`` (the last one may be partial): an fp8 x fp8 ``lax.dot_general`` with
     ``preferred_element_type=float32`` that consumes ``a8[:, :, kb]`` as ``[H, T, K_kb]`` through its batch
     dimension (H is batch dim 1 of ``a``, dim 0 of ``w``; no explicit transpose of ``a``) and gives
     ``[H, T, N]``. Products of two e4m3 values are exact in float32, so each block's partial sum only carries
     float32 accumulation error.
  3. Each partial is multiplied by its weight block scale ``w_scale[h, kb, n // 128]`` (broadcast over the 128
     columns of an N block) and summed over ``kb`` in float32; then the activation scale is applied:
     ``out[t, h, n] = a_scale[t, h] * sum_kb w_scale[h, kb, n // 128] * (a8[t, h, kb] . w8[h, kb, n])``.
  4. Cast to bfloat16, layout ``[T, H, N]``.

Mosaic path (``impl="mosaic"``, sm_90 or ``interpret=True``): :mod:`mla_pallas.kernels.bmm_fp8`, with the
TuningConfig of :func:`default_config` (the one place that maps a shape to the kernel's config; benchmark
sweeps take :func:`sweep_configs`).
  * bf16 ``a`` with per-token scales at T <= FUSED_QUANT_MAX_TOKENS, where the A tiles fit in SMEM: the kernel
    quantizes ``a`` itself (same float32 operations, bitwise the pre-pass result) and no pre-pass runs; the
    producer warpgroup quantizes the T real rows (``a_quant="producer"``) at T <= PRODUCER_QUANT_MAX_TOKENS
    (PRODUCER_QUANT_MAX_TOKENS_K512 at K = 512) where every CTA gets one output tile, else the consumers keep the
    quantized rows in registers (``"registers"``, K <= 512) or in SMEM (``"smem"``).
  * Otherwise activation quantization is one fused XLA pre-pass (the same :mod:`mla_pallas.quant` calls as
    above, so ``a8`` and its scales are bitwise those of the reference; ``"per_tensor"`` needs a global amax
    before any tile can be quantized), which zero-pads ``a8`` to a multiple of 8 rows (Mosaic GPU's TMA
    constraint for swizzled tiles) and writes the row scales as ``[H, T_pad]`` f32.
  * CTA tiles: 64 x 128 (``tile_n=64``) where they make at most one wave over the SMs at T <= SUB_N_MAX_TOKENS,
    else 64 x 512 (``sub_n=2``) where that saves a wave, else 64 x 256 (N % 256 == 0) or 128 x 128.
  * The kernel reads ``a`` in place (TMA boxes with the head index fixed: the [H, T, K] view costs no
    transpose), applies block scales per 128-wide K block to a separate f32 wgmma accumulator (promotion) and
    stores the output straight into ``[T, H, N]``.
  * **Weight layout.** FP8 wgmma on Hopper only takes K-major operands, so the kernel needs the weight as
    ``[H, N, K]``. Weights are static, so convert them once: ``w_t = prepare_weight(w)`` and call with
    ``weight_layout="hnk"`` (``w_scale`` keeps its ``[H, ceil(K/128), ceil(N/128)]`` shape). With the default
    ``weight_layout="hkn"`` the op transposes the weight on every call inside its jit: one extra read and
    write of ``H * K * N`` bytes (8 MiB for DeepSeek-V3.2's W_UK), which dominates at small T (decode). The XLA
    path takes either layout without a transpose (it contracts the right dimension of ``w``).
  * Kernel coverage: K % 64 == 0 and K <= 2048, N % 128 == 0 (every 128-column output tile is one scale
    block); other valid shapes raise NotImplementedError under ``impl="mosaic"`` and run XLA under ``"auto"``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp

from mla_pallas import _checks, _dispatch, quant

__all__ = ["quantize_and_bmm_fp8", "merge_quantize_and_bmm_fp8", "prepare_weight", "default_config", "sweep_configs", "BLOCK", "WEIGHT_LAYOUTS"]

OP = "quantize_and_bmm_fp8"
BLOCK = 128
_ACT = (jnp.bfloat16, jnp.float32)
_ACT_SCALES = ("per_token", "per_tensor")
WEIGHT_LAYOUTS = ("hkn", "hnk")


def prepare_weight(w):
  """Convert a ``[H, K, N]`` fp8 weight once to the K-major ``[H, N, K]`` layout the Mosaic kernel reads.

  Pass the result with ``weight_layout="hnk"`` (and the unchanged ``w_scale``). Works on any array
  ``[..., K, N]`` (swaps the last two axes).
  """
  _checks.check_array("w", w, dtypes=(quant.FP8,), expect="[H, K, N]")
  if w.ndim < 2:
    raise ValueError(f"w must have rank >= 2 (shape [H, K, N]); got shape {tuple(w.shape)}")
  return jnp.swapaxes(w, -1, -2)


def _check_args(a, w, w_scale, act_scale, weight_layout="hkn"):
  if act_scale not in _ACT_SCALES:
    raise ValueError(f"act_scale must be 'per_token' or 'per_tensor'; got {act_scale!r}")
  if weight_layout not in WEIGHT_LAYOUTS:
    raise ValueError(f"weight_layout must be 'hkn' ([H, K, N]) or 'hnk' ([H, N, K]); got {weight_layout!r}")
  _checks.check_array("a", a, ndim=3, dtypes=_ACT, expect="[T, H, K]")
  t, h, k = a.shape
  if h < 1 or k < 1:
    raise ValueError(f"a must have shape [T, H, K] with H, K >= 1; got shape {tuple(a.shape)}")
  if weight_layout == "hkn":
    _checks.check_array("w", w, ndim=3, shape=(h, k, None), dtypes=(quant.FP8,),
                        expect=f"[H, K, N] = [{h}, {k}, N]")
    n = w.shape[2]
  else:
    _checks.check_array("w", w, ndim=3, shape=(h, None, k), dtypes=(quant.FP8,),
                        expect=f"[H, N, K] = [{h}, N, {k}] (weight_layout='hnk')")
    n = w.shape[1]
  if n < 1:
    raise ValueError(f"w must have N >= 1; got shape {tuple(w.shape)}")
  kb, nb = -(-k // BLOCK), -(-n // BLOCK)
  _checks.check_array("w_scale", w_scale, ndim=3, shape=(h, kb, nb), dtypes=(jnp.float32,),
                      expect=f"[H, ceil(K/128), ceil(N/128)] = [{h}, {kb}, {nb}]")


def _xla_bmm(a, w, w_scale, act_scale, weight_layout="hkn"):
  t, h, k = a.shape
  n = w.shape[2] if weight_layout == "hkn" else w.shape[1]
  if act_scale == "per_token":
    a8, a_s = quant.quantize_rows_fp8(a, axis=-1)              # [T, H, K] fp8, [T, H] f32
  else:
    a8, a_s = quant.quantize_tensor_fp8(a)                     # [] f32
  # The barrier keeps a's e4m3 rounding: where XLA:GPU upcasts the fp8 operand rather than calling an FP8 GEMM
  # (T = 1), its excess-precision simplification would fold f32 -> f8 -> f32 away and multiply unquantized a
  # (rel-L2 2.6e-2 from the reference on the H200; benchmarks/xla_bmm_check_gpu.py).
  a8 = lax.optimization_barrier(a8)
  # w_scale [H, KB, NB] -> per-column scales [H, KB, N]
  ws_cols = jnp.repeat(w_scale, BLOCK, axis=2)[:, :, :n]
  # a8 [T, H, K_kb] x w8 [H, K_kb, N]: batch H (a dim 1, w dim 0), contract K (a dim 2, w dim 1) -> [H, T, N]
  # ("hnk": contract w's dim 2 instead; same products, no transpose)
  dims = (((2,), (1 if weight_layout == "hkn" else 2,)), ((1,), (0,)))
  acc = jnp.zeros((h, t, n), jnp.float32)
  for kb in range(-(-k // BLOCK)):
    k0, k1 = kb * BLOCK, min(k, (kb + 1) * BLOCK)
    w_kb = w[:, k0:k1, :] if weight_layout == "hkn" else w[:, :, k0:k1]
    part = lax.dot_general(a8[:, :, k0:k1], w_kb, dims, preferred_element_type=jnp.float32)
    acc = acc + part * ws_cols[:, kb, None, :]
  out = jnp.swapaxes(acc, 0, 1)                                # [T, H, N]; XLA folds it into the scaling pass
  if act_scale == "per_token":
    out = out * a_s[..., None]
  else:
    out = out * a_s
  return out.astype(jnp.bfloat16)


# ---- Kernel config: default_config is the one place that maps a shape to the kernel's TuningConfig -----------
# (the measurements behind each threshold: docs/kernels/bmm_fp8.md)
FUSED_QUANT_MAX_TOKENS = 256        # in-kernel quantization of bf16 per-token ``a`` up to this T, where it fits
SUB_N_MAX_TOKENS = 256              # 64 x 128 / 64 x 512 CTA tiles are considered up to this T
PRODUCER_QUANT_MAX_TOKENS = 8       # a_quant="producer" up to this T ...
PRODUCER_QUANT_MAX_TOKENS_K512 = 16   # ... and up to this T at K = 512


def _wide_tiles_save_a_wave(t, h, k, n, kw) -> bool:
  """64 x 512 CTA tiles (sub_n=2): T <= SUB_N_MAX_TOKENS, wg_split "n", N % 512 == 0, all K / 64 chunks fit in
  the ring, and halving the tile count saves a wave of CTAs."""
  if t > SUB_N_MAX_TOKENS or kw.get("wg_split") != "n" or n % 512 or k // 64 > kw.get("stages", 4):
    return False
  tiles = -(-t // 64) * h * (n // 256)     # 64 x 256 tiles (64 rows of one head's tokens each)
  sms = kw["max_ctas"]
  return -(-tiles // sms) > -(-(tiles // 2) // sms)


def _narrow_tiles_make_one_wave(t, h, n, kw) -> bool:
  """64 x 128 CTA tiles (two 64 x 64 consumer tiles, ``tile_n=64``): at most one wave of them over the SMs at
  T <= SUB_N_MAX_TOKENS, unless the tuning fixes the tile shape. At the MLA shapes only the output projections
  (N = 128 / 256) qualify."""
  if t > SUB_N_MAX_TOKENS or n % 128 or any(key in kw for key in ("tile_n", "wg_split", "sub_n")):
    return False
  return -(-t // 64) * h * (n // 128) <= kw["max_ctas"]


def _producer_quant_is_faster(t, k) -> bool:
  from mla_pallas.kernels import bmm_row_quant
  if k > bmm_row_quant.MAX_K:
    return False
  return t <= (PRODUCER_QUANT_MAX_TOKENS_K512 if k == bmm_row_quant.MAX_K else PRODUCER_QUANT_MAX_TOKENS)


def default_config(t: int, k: int, n: int, h: int, *, fusable: bool = True, tuning=()):
  """The kernel's TuningConfig for ``a [T, H, K]``, ``w [H, N, K]``.

  ``fusable``: ``a`` is bfloat16 with per-token scales (the kernel may quantize it; else the XLA pre-pass).
  ``tuning``: tuple of (field, value) overrides (tests, :func:`sweep_configs`); the fields they name are kept and
  the rules below pick the others.

  Rules: ``max_ctas`` = the SM count; 64 x 128 tiles (``tile_n=64``) where :func:`_narrow_tiles_make_one_wave`;
  wg_split "n" where N % (2 tile_n) == 0, else "m"; in-kernel quantization (``quantize_k=K``) when ``fusable``
  and T <= FUSED_QUANT_MAX_TOKENS, by the producer (``a_quant="producer"``, wg_split "n") where
  :func:`_producer_quant_is_faster` and every CTA gets one output tile, else in registers for K <= 512; 64 x 512
  tiles (``sub_n=2``) where :func:`_wide_tiles_save_a_wave` and they fit in SMEM; two A buffers where they fit,
  else one, else (unless ``quantize_k`` is given) the pre-pass.
  Raises ValueError for overrides that make no valid config.
  """
  cfg = _apply_rules(t, k, n, h, fusable, tuning, producer_ok=True)
  if (cfg.a_quant == "producer" and "a_quant" not in dict(tuning)
      and -(-t // cfg.cta_m) * h * (n // cfg.cta_n) > cfg.max_ctas):   # measured / GPU-tested: one tile per CTA
    cfg = _apply_rules(t, k, n, h, fusable, tuning, producer_ok=False)
  return cfg


def _apply_rules(t, k, n, h, fusable, tuning, *, producer_ok: bool):
  from mla_pallas.kernels import bmm_fp8 as kbmm
  kw = dict(max_ctas=_dispatch.num_sms())
  kw.update(dict(tuning))
  if _narrow_tiles_make_one_wave(t, h, n, kw):
    kw["tile_n"] = 64
  kw.setdefault("wg_split", "n" if n % (2 * kw.get("tile_n", kbmm.TILE_N)) == 0 else "m")
  explicit = "quantize_k" in kw
  if not explicit and fusable and t <= FUSED_QUANT_MAX_TOKENS:
    kw["quantize_k"] = k
  if kw.get("quantize_k") is not None and "a_quant" not in kw:
    if kw["wg_split"] == "n" and producer_ok and _producer_quant_is_faster(t, kw["quantize_k"]):
      kw["a_quant"] = "producer"
    elif kw["quantize_k"] <= kbmm.MAX_REGISTER_K:
      kw["a_quant"] = "registers"
  keep_quant = "a_quant" in dict(tuning)
  if "sub_n" not in kw and kw.get("tile_n", kbmm.TILE_N) == kbmm.TILE_N and _wide_tiles_save_a_wave(t, h, k, n, kw):
    try:
      return _fit_a_buffers(kbmm, dict(kw, sub_n=2), drop_quantize=False, keep_quant=keep_quant)
    except ValueError:
      pass     # e.g. an explicit a_buffers=2 next to 64 x 512 tiles exceeds SMEM: keep 64 x 256 tiles
  return _fit_a_buffers(kbmm, kw, drop_quantize=not explicit, keep_quant=keep_quant)


def _fit_a_buffers(kbmm, kw: dict, *, drop_quantize: bool, keep_quant: bool):
  """TuningConfig(**kw) with two A buffers where they fit in SMEM, else one (unless ``a_buffers`` is given);
  where neither fits, in-kernel quantization is dropped (the XLA pre-pass) if ``drop_quantize`` (and with it a
  derived ``a_quant``)."""
  if kw.get("quantize_k") is not None and "a_buffers" not in kw:
    for a_buffers in (2, 1):
      try:
        return kbmm.TuningConfig(**kw, a_buffers=a_buffers)
      except ValueError:
        pass
    if drop_quantize:
      kw = dict(kw, quantize_k=None)
      if not keep_quant:
        kw.pop("a_quant", None)
  return kbmm.TuningConfig(**kw)


def sweep_configs(t: int, k: int, n: int, h: int) -> dict[str, tuple[tuple[str, object], ...]]:
  """Labelled ``tuning`` overrides for a benchmark sweep of bf16 per-token ``a [T, H, K]`` against
  ``w [H, N, K]``: ``"default": ()`` first, then every alternative design and tile of the kernel that makes a
  valid config for this shape and differs from the default and from the earlier entries (pre-pass vs in-kernel
  quantization, who quantizes, tile shape, ring depth, A buffers). Each value is accepted by ``_bmm_jit(...,
  tuning=...)``."""
  from mla_pallas.kernels import bmm_fp8 as kbmm
  candidates = {
      "default": (),
      "prepass": (("quantize_k", None),),
      "a_quant=smem": (("quantize_k", k), ("a_quant", "smem")),
      "a_quant=registers": (("quantize_k", k), ("a_quant", "registers")),
      "a_quant=producer": (("quantize_k", k), ("a_quant", "producer")),
      "tile_n=64": (("tile_n", 64),),
      "tile_n=128": (("tile_n", 128),),
      "wg_split=m": (("wg_split", "m"),),
      "sub_n=1": (("sub_n", 1),),
      "sub_n=2": (("sub_n", 2),),
      "stages=3": (("stages", 3),),
      "stages=6": (("stages", 6),),
      "stages=8": (("stages", 8),),
      "a_buffers=1": (("a_buffers", 1),),
  }
  out, seen = {}, set()
  for label, tuning in candidates.items():
    try:
      cfg = default_config(t, k, n, h, tuning=tuning)
      kbmm.check_shapes(t, h, k, n, cfg)
    except (ValueError, NotImplementedError):
      continue
    if cfg not in seen:
      seen.add(cfg)
      out[label] = tuning
  return out


def _kernel_supported(a_shape, n: int, fusable: bool, interpret):
  def check():
    from mla_pallas.kernels import bmm_fp8 as kbmm
    arch = _dispatch.mosaic_arch(interpret)
    if arch != "sm90":
      raise NotImplementedError(f"{OP} has a Mosaic GPU kernel for sm_90 (Hopper) only; this device needs the "
                                f"{arch} kernel, which does not exist yet")
    t, h, k = a_shape
    kbmm.check_shapes(t, h, k, n, default_config(t, k, n, h, fusable=fusable))
  return check


def in_kernel_a(a):
  """bf16 ``a [T, H, K]`` as the in-kernel-quantization designs read it: swizzled TMA boxes need a GMEM row count
  below 8 or a multiple of 8, so zero rows (sliced off by the store) for T > 8 only; T < 8 (decode) launches no
  pad kernel."""
  t = a.shape[0]
  t8 = t if t < 8 else -(-t // 8) * 8
  return a if t8 == t else jnp.pad(a, ((0, t8 - t), (0, 0), (0, 0)))


def _mosaic_bmm(a, w, w_scale, act_scale, weight_layout, interpret, tuning=()):
  from mla_pallas.kernels import bmm_fp8 as kbmm
  t, h, k = a.shape
  w_t = jnp.swapaxes(w, 1, 2) if weight_layout == "hkn" else w   # [H, N, K]; see the module doc for the cost
  n = w_t.shape[1]
  fusable = act_scale == "per_token" and a.dtype == jnp.bfloat16
  cfg = default_config(t, k, n, h, fusable=fusable, tuning=tuning)
  if cfg.quantize_k is not None:   # the kernel quantizes a (the float32 operations of quant.quantize_rows_fp8)
    if not fusable:
      raise NotImplementedError(f"{OP}: in-kernel quantization (quantize_k) needs bfloat16 a and per-token scales")
    return kbmm.build(t, h, k, n, True, cfg, interpret=interpret)(in_kernel_a(a), w_t, w_scale)
  # Pre-pass (one fused XLA op): a quantized exactly as in the reference, zero-padded to a multiple of 8 rows.
  t8 = -(-t // 8) * 8
  if act_scale == "per_token":
    a8, a_s = quant.quantize_rows_fp8(a, axis=-1)              # [T, H, K] fp8, [T, H] f32
    t_pad = -(-t // cfg.cta_m) * cfg.cta_m
    scales = jnp.pad(a_s.T, ((0, 0), (0, t_pad - t)), constant_values=1.0)   # [H, T_pad]
  else:
    a8, a_s = quant.quantize_tensor_fp8(a)
    scales = a_s.reshape(1)
  a8 = jnp.pad(a8, ((0, t8 - t), (0, 0), (0, 0)))
  kern = kbmm.build(t, h, k, n, act_scale == "per_token", cfg, interpret=interpret)
  return kern(a8, scales, w_t, w_scale)


@functools.partial(jax.jit, static_argnames=("act_scale", "weight_layout", "impl", "interpret", "tuning"))
def _bmm_jit(a, w, w_scale, *, act_scale, weight_layout="hkn", impl="xla", interpret=False,
             tuning=()):
  """``tuning``: tuple of (field, value) overrides of the kernel's TuningConfig (:func:`default_config`; tests,
  :func:`sweep_configs`)."""
  if impl == "mosaic":
    return _mosaic_bmm(a, w, w_scale, act_scale, weight_layout, interpret, tuning)
  return _xla_bmm(a, w, w_scale, act_scale, weight_layout)


def checked_dispatch(a, w, w_scale, act_scale, weight_layout, impl, interpret) -> str:
  """:func:`quantize_and_bmm_fp8`'s argument checks and its choice of path (recorded): "mosaic" or "xla"."""
  _dispatch.check_impl(impl)
  _check_args(a, w, w_scale, act_scale, weight_layout)
  n = w.shape[2] if weight_layout == "hkn" else w.shape[1]
  fusable = act_scale == "per_token" and a.dtype == jnp.bfloat16
  return _dispatch.choose(OP, impl, interpret=interpret, supported=_kernel_supported(a.shape, n, fusable, interpret),
                          validated_on=("sm90",))


def quantize_and_bmm_fp8(a, w, w_scale, *, act_scale: str = "per_token", weight_layout: str = "hkn",
                         impl: str = "auto", interpret: bool = False):
  """Batched (per-head) FP8 GEMM with dynamic activation quantization.

  Args:
    a: [T, H, K] bfloat16 (or float32) activations.
    w: [H, K, N] float8_e4m3fn weights (e.g. from :func:`mla_pallas.convert_bf16_to_fp8_e4m3fn` or
      :func:`mla_pallas.ops.convert.load_block_scaled_checkpoint`), or [H, N, K] with ``weight_layout="hnk"``
      (from :func:`prepare_weight`; the layout the Mosaic kernel reads).
    w_scale: [H, ceil(K/128), ceil(N/128)] float32 128x128 block scales:
      ``deq(w)[h, k, n] = w[h, k, n] * w_scale[h, k // 128, n // 128]``.
    act_scale: python str, "per_token" (one scale per (t, h) row of K values, max(|row|) / 448, all-zero rows 1)
      or "per_tensor" (one scale for all of a).
    weight_layout: "hkn" (w is [H, K, N], default) or "hnk" (w is [H, N, K], K-major). The Mosaic kernel needs
      "hnk"; with "hkn" it transposes the weight on every call (see the module doc). Same result either way.
    impl: "auto" | "mosaic" | "xla" (see :mod:`mla_pallas._dispatch`). The kernel runs on sm_90 (or with
      ``interpret=True``) for K % 64 == 0, K <= 2048, N % 128 == 0.
    interpret: run the Mosaic kernel in Pallas' GPU interpret mode (CPU): True, or a
      ``plgpu.InterpretGPUParams`` (e.g. ``detect_races=True``).

  Returns:
    [T, H, N] bfloat16: ``out[t, h] = deq(a8)[t, h] @ deq(w)[h]``, fp8 products accumulated in float32.

  Raises:
    ValueError: bad shape/dtype (the message names the argument), unknown act_scale, weight_layout or impl.
    NotImplementedError: ``impl="mosaic"`` when the kernel cannot run here or does not take these shapes.
  """
  used = checked_dispatch(a, w, w_scale, act_scale, weight_layout, impl, interpret)
  return _bmm_jit(a, w, w_scale, act_scale=act_scale,
                  weight_layout=weight_layout, impl=used, interpret=interpret if used == "mosaic" else False)


# ---- A from split-KV attention partials: the merge inside the kernel's producer ----------------------------------

def merge_config(t: int, k: int, n: int, h: int):
  """The kernel's TuningConfig when its producer merges split partials into A (``kbmm.build(merge=...)``):
  :func:`default_config` where that is the "producer" design (else NotImplementedError), with every K chunk of
  the weight tile in flight (``stages = K / 64``: the merge takes longer than the plain row loads, so the whole
  weight tile loads while it runs)."""
  cfg = default_config(t, k, n, h)
  if cfg.a_quant != "producer":
    raise NotImplementedError(f"{OP}: the merge of split partials runs in the 'producer' design only (T <= "
                              f"{PRODUCER_QUANT_MAX_TOKENS_K512} at K = 512, one tile per CTA); got {cfg}")
  from mla_pallas.kernels import bmm_fp8 as kbmm
  return dataclasses.replace(cfg, stages=max(cfg.stages, k // kbmm.CHUNK))


MERGE_MAX_ROUNDS = 4   # the producer's merge only where it takes at most this many load rounds (merge_rounds)


def _merge_is_faster(t: int, splits: int) -> bool:
  """Whether merging in W_UV's producer beats the XLA merge: at most MERGE_MAX_ROUNDS load rounds
  (kernels.bmm_row_quant.merge_rounds, the better of its two layouts). Measured in the decode step on the H200
  (benchmarks/step_split_ab_gpu.py, W_UV's growth against the XLA merge's two launches; docs/kernels/bmm_fp8.md):
  W_UV's growth / the merge launches saved: 2 rounds (DeepSeek-V3.2 B1, 32 splits) +1.9 / -4.5 us, B2 (16 splits)
  +2.6 / -3.9, 4 rounds (B4 16 splits, B8 8 splits) +2.8 / -5.5 and +2.9 / -4.8 (steps -3.6 / -3.1 us); 8 rounds
  (GLM-5 H64 B8, 16 splits) +5.0 / -5.3, the step 1.1 us slower."""
  from mla_pallas.kernels import bmm_row_quant
  return min(bmm_row_quant.merge_rounds(t, splits)) <= MERGE_MAX_ROUNDS


def _merge_supported(t, h, k, n, splits, interpret):
  def check():
    from mla_pallas.kernels import bmm_fp8 as kbmm, bmm_row_quant
    if _dispatch.mosaic_arch(interpret) != "sm90" or interpret:
      raise NotImplementedError(f"{OP}: the in-kernel merge of split partials is raw PTX for sm_90 (no interpret "
                                "mode)")
    if k != bmm_row_quant.MAX_K:
      raise NotImplementedError(f"{OP}: the in-kernel merge of split partials needs K = {bmm_row_quant.MAX_K}")
    if not _merge_is_faster(t, splits):
      raise NotImplementedError(f"{OP}: merging {splits} splits of {t} tokens in the producer takes more than "
                                f"{MERGE_MAX_ROUNDS} load rounds (measured slower than the XLA merge)")
    cfg = merge_config(t, k, n, h)
    kbmm.check_shapes(t, h, k, n, cfg)
    cfg.check_smem(kbmm.smem_budget(cfg) + kbmm.merge_scratch_bytes(k), " with the merge's scratch")
  return check


def _merged_a(parts, lse, heads):
  """The merge of split partials as the [T, H, K] bf16 activations of the unfused graph
  (:func:`mla_pallas.ops.sparse_decode.combine_splits`, then sparse_mla_decode's bf16 out)."""
  from mla_pallas.ops.sparse_decode import combine_splits
  o, _ = combine_splits(parts, lse)                     # [T · tiles, 64, K] f32
  tiles, rows, k = o.shape
  t = tiles * rows // (-(-heads // rows) * rows)
  return o.reshape(t, -1, k)[:, :heads].astype(jnp.bfloat16)


@functools.partial(jax.jit, static_argnames=("heads",))
def _merge_bmm_jit(parts, lse, w, w_scale, *, heads):
  """The merging kernel (sm_90; :func:`merge_quantize_and_bmm_fp8` has checked that it runs here)."""
  from mla_pallas.kernels import bmm_fp8 as kbmm
  tiles, splits, _, k = parts.shape
  t = tiles // -(-heads // 64)
  n = w.shape[1]
  cfg = merge_config(t, k, n, heads)
  return kbmm.build(t, heads, k, n, True, cfg, merge=(splits, tiles // t))(parts, lse, w, w_scale)


def merge_quantize_and_bmm_fp8(parts, lse, w, w_scale, *, heads: int, impl: str = "auto", interpret: bool = False):
  """:func:`quantize_and_bmm_fp8` of the split-KV merge of attention partials (the decode graph's W_UV product
  after sparse attention): the kernel's producer merges the splits of each (token, head) row, so the merged
  activations never go through GMEM and no merge launches run.

  Args:
    parts: [T · ceil(H/64), S, 64, K] float32 and lse: [T · ceil(H/64), S, 64] float32, as
      :func:`mla_pallas.ops.sparse_decode.split_partials` returns them (head h of token t at tile
      t · ceil(H/64) + h // 64, row h % 64).
    w: [H, N, K] float8_e4m3fn weights in the kernel's layout (:func:`prepare_weight`), w_scale:
      [H, ceil(K/128), ceil(N/128)] float32.
    heads: python int H.
    impl, interpret: as in :func:`quantize_and_bmm_fp8`. Where the merging kernel cannot run (another arch,
      interpret mode, K != 512, T beyond the "producer" design) the op merges with
      :func:`~mla_pallas.ops.sparse_decode.combine_splits` into bf16 activations and runs
      :func:`quantize_and_bmm_fp8`, which is what the unfused graph computes.

  Returns:
    [T, H, N] bfloat16: per (t, h) row, ``a = Σ_s exp(lse_s − m) parts_s / Σ_s exp(lse_s − m)`` (m the row's max
    lse, 0 when every split is empty; a = 0 then), quantized per row to e4m3 and multiplied as in
    :func:`quantize_and_bmm_fp8`. The merging kernel quantizes the float32 merge (the fallback its bf16 rounding):
    the two differ by that rounding only.

  Raises:
    ValueError: bad shapes or dtypes (the message names the argument).
    NotImplementedError: ``impl="mosaic"`` where neither the merging kernel nor the plain kernel can run.
  """
  _dispatch.check_impl(impl)
  heads = int(heads)
  _checks.check_array("parts", parts, ndim=4, dtypes=(jnp.float32,), expect="[T * ceil(H/64), S, 64, K]")
  tiles, splits, rows, k = parts.shape
  tpt = -(-heads // 64)
  if heads < 1 or rows != 64 or tiles % tpt or tiles == 0:
    raise ValueError(f"parts must have shape [T * ceil(H/64), S, 64, K] with H = heads = {heads}; got shape "
                     f"{tuple(parts.shape)}")
  _checks.check_array("lse", lse, ndim=3, shape=(tiles, splits, 64), dtypes=(jnp.float32,),
                      expect=f"[T * ceil(H/64), S, 64] = [{tiles}, {splits}, 64]")
  _checks.check_array("w", w, ndim=3, shape=(heads, None, k), dtypes=(quant.FP8,),
                      expect=f"[H, N, K] = [{heads}, N, {k}]")
  n = w.shape[1]
  _checks.check_array("w_scale", w_scale, ndim=3, shape=(heads, -(-k // BLOCK), -(-n // BLOCK)),
                      dtypes=(jnp.float32,), expect=f"[H, ceil(K/128), ceil(N/128)] = [{heads}, {-(-k // BLOCK)}, "
                      f"{-(-n // BLOCK)}]")
  t = tiles // tpt
  used = None
  if impl != "xla":
    try:
      _merge_supported(t, heads, k, n, splits, interpret)()
      used = _dispatch.choose(OP, impl, interpret=interpret, supported=lambda: None, validated_on=("sm90",))
    except NotImplementedError:
      pass
  if used != "mosaic":   # the unfused computation: merge, bf16, then the op's own dispatch
    return quantize_and_bmm_fp8(_merged_a(parts, lse, heads), w, w_scale, weight_layout="hnk",
                                impl="xla" if used == "xla" else impl, interpret=interpret)
  return _merge_bmm_jit(parts, lse, w, w_scale, heads=heads)
