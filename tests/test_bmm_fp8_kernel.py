"""quantize_and_bmm_fp8's sm_90 Mosaic kernel on the CPU: interpret mode (with race detection) against the
reference, lowering for CUDA at sm_90 with a count of the fp8 wgmma instructions, dispatch and argument checks.

Tolerance of the interpret-mode comparisons: the kernel quantizes ``a`` with the reference's own functions
(bitwise the same ``a8`` and scales) and the interpreter computes the fp8 x fp8 products exactly in f32 (no
Hopper accumulation error). Kernel and reference differ only in the f32 summation order (the kernel sums each
128-wide K block, scales it, then adds the blocks; the reference multiplies dequantized values and sums all of
K), about K 2^-24 relative to sum |terms|, and then both round to bf16. So an element differs by at most one bf16
ulp (2^-7 relative) plus a tiny absolute term near zero, and the rel-L2 difference stays below 2^-8 (the unit
roundoff of bf16).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mla_pallas
from mla_pallas import _dispatch, quant, reference, testing
from mla_pallas.kernels import bmm_fp8 as kbmm
from mla_pallas.ops import bmm_fp8 as bmm_mod

FP8 = jnp.float8_e4m3fn
OP = "quantize_and_bmm_fp8"


def make_inputs(rng, t, h, k, n):
  """a with rows of very different magnitudes and one all-zero row; w whose 128x128 blocks have scales spread
  over ~e^±2, so that a wrong block scale (or a wrong head/column/row offset) shows up."""
  a = rng.normal(size=(t, h, k)) * np.exp(rng.normal(size=(t, h, 1)))
  a[t // 2, h - 1] = 0.0
  kb, nb = -(-k // 128), -(-n // 128)
  mag = np.exp(rng.normal(size=(h, kb, nb)))
  mag = np.repeat(np.repeat(mag, 128, axis=1), 128, axis=2)[:, :k, :n]
  w = rng.normal(size=(h, k, n)) * 0.05 * mag
  w8, ws = quant.quantize_blocks_fp8(jnp.asarray(w, jnp.float32))
  return jnp.asarray(a, jnp.bfloat16), w8, ws


def assert_matches_reference(out, a, w8, ws, act_scale):
  want = reference.quantize_and_bmm_fp8(a, w8, ws, act_scale=act_scale)
  assert out.shape == want.shape and out.dtype == jnp.bfloat16
  g, r = np.asarray(out, np.float64), np.asarray(want, np.float64)
  assert np.all(np.isfinite(g))
  bad = np.abs(g - r) > 2.0 ** -7 * np.abs(r) + 1e-6 * np.abs(r).max()
  assert not bad.any(), f"{bad.sum()} elements off by more than one bf16 ulp, first at {np.argwhere(bad)[0]}"
  assert np.linalg.norm(g - r) <= 2.0 ** -8 * np.linalg.norm(r)


# (T, H, K, N, act_scale, weight_layout): T = 1, 5 (one partial M tile), 70 (T % 8 != 0: linear output staging,
# two M tiles), 16 (T % 8 == 0: swizzled output staging); K = 192 (a partial 64-wide last K block); K = 512
# (8 chunks: the 4-slot ring wraps twice); N = 256 (consumers split N) and 128 (consumers split M).
CASES = [
    (1, 2, 128, 256, "per_token", "hkn"),
    (5, 3, 192, 128, "per_tensor", "hkn"),
    (70, 2, 192, 256, "per_token", "hnk"),
    (70, 3, 128, 128, "per_token", "hkn"),
    (5, 2, 128, 256, "per_tensor", "hnk"),
    (16, 2, 512, 128, "per_token", "hnk"),
]


@pytest.mark.parametrize("t,h,k,n,act_scale,layout", CASES)
def test_kernel_interpret_matches_reference(rng, t, h, k, n, act_scale, layout):
  a, w8, ws = make_inputs(rng, t, h, k, n)
  w = w8 if layout == "hkn" else bmm_mod.prepare_weight(w8)
  params = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=True)
  testing.reset_interpreter()
  out = mla_pallas.quantize_and_bmm_fp8(a, w, ws, act_scale=act_scale, weight_layout=layout, impl="mosaic",
                                        interpret=params)
  out = jax.block_until_ready(out)
  assert _dispatch.last_impl(OP) == "mosaic-interpret"
  assert not testing.races_found(), "the interpreter found a data race in the kernel"
  assert_matches_reference(out, a, w8, ws, act_scale)


@pytest.mark.parametrize("wg_split,stages,fused", [("n", 4, 2), ("m", 3, False), ("m", 3, 1)])
def test_persistent_ctas_walk_several_tiles(rng, wg_split, stages, fused):
  """A grid of 2 CTAs over 2 x 2 x 3 (M, N, H) tiles: every CTA runs 6 tiles, the ring (3 chunks per tile, 3 or 4
  slots) wraps within and across tiles, and the output staging tile is reused; with in-kernel quantization the
  bf16 A tile and its barriers are reused across tiles too."""
  t, h, k, n = 70 if wg_split == "n" else 140, 3, 192, 512 if wg_split == "n" else 256
  a, w8, ws = make_inputs(rng, t, h, k, n)
  params = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=True)
  testing.reset_interpreter()
  out = bmm_mod._bmm_jit(a, bmm_mod.prepare_weight(w8), ws, act_scale="per_token", weight_layout="hnk",
                         impl="mosaic", interpret=params,
                         tuning=(("max_ctas", 2), ("stages", stages), ("wg_split", wg_split),
                                 ("quantize_k", k if fused else None)) + ((("a_buffers", fused),) if fused else ()))
  out = jax.block_until_ready(out)
  assert not testing.races_found(), "the interpreter found a data race in the kernel"
  assert_matches_reference(out, a, w8, ws, "per_token")


@pytest.mark.parametrize("t,k,fused,max_ctas", [(8, 128, True, 132), (1, 192, True, 132), (70, 192, False, 2)])
def test_two_sub_tiles_per_consumer_is_bitwise_the_default(rng, t, k, fused, max_ctas):
  """sub_n=2 (CTA tile 64 x 512: each consumer runs two 64 x 128 sub-tiles on the resident K chunks) computes the
  same products and promotions as the default 64 x 256 tiles, so the outputs are equal bit for bit; races checked.
  max_ctas=2 makes the CTAs walk several tiles (the ring's slots held across sub-tiles, then released)."""
  h, n = 3, 512
  a, w8, ws = make_inputs(rng, t, h, k, n)
  wt = bmm_mod.prepare_weight(w8)
  params = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=True)
  base = (("quantize_k", k if fused else None), ("max_ctas", max_ctas))
  run = functools.partial(bmm_mod._bmm_jit, a, wt, ws, act_scale="per_token", weight_layout="hnk", impl="mosaic")
  testing.reset_interpreter()
  two = jax.block_until_ready(run(interpret=params, tuning=base + (("sub_n", 2),)))
  assert not testing.races_found(), "the interpreter found a data race in the kernel"
  one = run(interpret=True, tuning=base + (("sub_n", 1),))
  assert np.array_equal(np.asarray(two, np.float32), np.asarray(one, np.float32))
  assert_matches_reference(two, a, w8, ws, "per_token")


@pytest.mark.parametrize("t,k,n", [(1, 128, 256), (70, 192, 256), (9, 512, 256)])
def test_in_kernel_quantization_is_bitwise_the_prepass(rng, t, k, n):
  """quantize_k: the kernel quantizes bf16 a itself with quant.quantize_rows_fp8's float32 operations, so its
  output equals the pre-pass path's bit for bit (same fp8 operands, same wgmma and promotion order)."""
  a, w8, ws = make_inputs(rng, t, 2, k, n)
  wt = bmm_mod.prepare_weight(w8)
  run = functools.partial(bmm_mod._bmm_jit, a, wt, ws, act_scale="per_token", weight_layout="hnk", impl="mosaic",
                          interpret=True)
  fused, pre = run(tuning=(("quantize_k", k),)), run(tuning=(("quantize_k", None),))
  assert np.array_equal(np.asarray(fused, np.float32), np.asarray(pre, np.float32))
  assert_matches_reference(fused, a, w8, ws, "per_token")


def test_in_kernel_quantization_default_rule():
  cfg = bmm_mod._kernel_config
  assert cfg(512, t=1, k=128, fusable=True).quantize_k == 128                 # decode: no pre-pass launches
  assert cfg(512, t=bmm_mod.FUSED_QUANT_MAX_TOKENS + 1, k=128, fusable=True).quantize_k is None
  assert cfg(512, t=1, k=128, fusable=False).quantize_k is None               # per-tensor or float32 a
  assert cfg(512, t=8, k=192, fusable=True).quantize_k == 192
  assert cfg(256, t=8, k=512, fusable=True).quantize_k == 512                 # one bf16 A buffer
  assert cfg(128, t=8, k=512, fusable=True).quantize_k == 512   # wg_split "m": fits with the fp8 rows in registers
  assert cfg(128, (("a_registers", False),), t=8, k=512, fusable=True).quantize_k is None   # fp8 tiles: no room
  assert cfg(256, (("quantize_k", 512),), t=8, k=512).quantize_k == 512        # explicit override
  with pytest.raises(ValueError, match="SMEM"):                                # bf16 A tile too big for SMEM
    cfg(128, (("quantize_k", 512), ("a_registers", False)), t=8, k=512)
  with pytest.raises(ValueError, match="quantize_k"):
    kbmm.TuningConfig(quantize_k=100)
  with pytest.raises(ValueError, match="quantize_k=128 must equal K=192"):
    kbmm.check_shapes(1, 2, 192, 256, kbmm.TuningConfig(quantize_k=128))


def test_auto_runs_kernel_in_interpret_mode_and_falls_back(rng):
  a, w8, ws = make_inputs(rng, 3, 2, 128, 128)
  out = mla_pallas.quantize_and_bmm_fp8(a, w8, ws, impl="auto", interpret=True)
  assert _dispatch.last_impl(OP) == "mosaic-interpret"
  assert_matches_reference(out, a, w8, ws, "per_token")
  # Valid shapes the kernel does not take: K % 64 != 0, N % 128 != 0 -> XLA under "auto", an error under "mosaic".
  for k, n, what in [(200, 128, "K=200"), (128, 136, "N=136")]:
    a, w8, ws = make_inputs(rng, 3, 2, k, n)
    out = mla_pallas.quantize_and_bmm_fp8(a, w8, ws, impl="auto", interpret=True)
    assert _dispatch.last_impl(OP) == "xla"
    assert_matches_reference(out, a, w8, ws, "per_token")
    with pytest.raises(NotImplementedError, match=what):
      mla_pallas.quantize_and_bmm_fp8(a, w8, ws, impl="mosaic", interpret=True)


def test_weight_layouts_agree_on_xla_path(rng):
  a, w8, ws = make_inputs(rng, 7, 3, 192, 256)
  for act_scale in ("per_token", "per_tensor"):
    x = mla_pallas.quantize_and_bmm_fp8(a, w8, ws, act_scale=act_scale, impl="xla")
    y = mla_pallas.quantize_and_bmm_fp8(a, bmm_mod.prepare_weight(w8), ws, act_scale=act_scale,
                                        weight_layout="hnk", impl="xla")
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
  # The "hnk" XLA path contracts w's last axis: no transpose of the fp8 weight.
  jaxpr = jax.make_jaxpr(lambda a, w, s: bmm_mod._xla_bmm(a, w, s, "per_token", "hnk"))(
      a, bmm_mod.prepare_weight(w8), ws)
  assert not any(e.primitive.name == "transpose" and e.invars[0].aval.dtype == FP8 for e in jaxpr.eqns)


def test_bad_inputs_raise_value_error_through_the_op(rng):
  a, w8, ws = make_inputs(rng, 3, 2, 128, 128)
  wt = bmm_mod.prepare_weight(w8)
  bad = [
      ("weight_layout", (a, w8, ws), dict(weight_layout="nk")),
      ("w", (a, w8[:, :, :64], ws), dict(weight_layout="hnk")),        # [H, K, N'] given as "hnk": K mismatch
      ("w", (a, wt[:, :, :64], ws), dict(weight_layout="hnk")),
      ("w", (a, wt.astype(jnp.bfloat16), ws), dict(weight_layout="hnk")),
      ("w_scale", (a, wt, ws[:, :, :0]), dict(weight_layout="hnk")),
      ("a", (a[0], w8, ws), {}),
      ("act_scale", (a, w8, ws), dict(act_scale="per_row")),
  ]
  for name, args, kw in bad:
    with pytest.raises(ValueError, match=name):
      mla_pallas.quantize_and_bmm_fp8(*args, impl="mosaic", interpret=True, **kw)
  with pytest.raises(ValueError, match="w"):
    bmm_mod.prepare_weight(w8.astype(jnp.float32))


def test_tuning_config_validation():
  with pytest.raises(ValueError, match="wg_split"):
    kbmm.TuningConfig(wg_split="k")
  with pytest.raises(ValueError, match="stages"):
    kbmm.TuningConfig(stages=0)
  with pytest.raises(ValueError, match="SMEM"):
    kbmm.TuningConfig(stages=12)
  assert kbmm.smem_budget(kbmm.TuningConfig()) <= 120 * 1024   # default fits with room to spare
  with pytest.raises(ValueError, match="sub_n"):
    kbmm.TuningConfig(sub_n=3)
  with pytest.raises(ValueError, match="sub_n"):
    kbmm.TuningConfig(sub_n=2, wg_split="m")
  with pytest.raises(ValueError, match="stages"):   # 8 resident K chunks do not fit a 4-slot ring
    kbmm.check_shapes(8, 128, 512, 512, kbmm.TuningConfig(sub_n=2))


# The real shapes: DeepSeek-V3.2 q_nope @ W_UK (K 128 -> N 512), GLM-5 (K 192 -> 512), output projections
# (K 512 -> N 128 / 256). Each consumer warpgroup issues K / 32 m64n128k32 e4m3 wgmmas (one code path, shared by
# both consumers).
@pytest.mark.parametrize("k,n,t,act_scale,sub_n", [
    (128, 512, 4096, "per_token", 1),
    (192, 512, 4096, "per_tensor", 1),
    (512, 128, 4096, "per_token", 1),
    (512, 256, 70, "per_token", 1),      # T % 8 != 0: linear output staging
    (128, 512, 8, "per_token", 2),       # two sub-tiles per consumer (in-kernel quantization at T = 8)
    (192, 512, 1, "per_token", 2),
])
def test_lowers_for_sm90(k, n, t, act_scale, sub_n):
  h = 128
  S = jax.ShapeDtypeStruct
  fn = lambda a, w, s: bmm_mod._mosaic_bmm(a, w, s, act_scale, "hnk", False,   # (pre-pass +) kernel
                                           tuning=(("sub_n", sub_n),) if sub_n > 1 else ())
  low = testing.lower_for_cuda(fn, S((t, h, k), jnp.bfloat16), S((h, n, k), FP8),
                               S((h, -(-k // 128), n // 128), jnp.float32), arch=(9, 0))
  assert "mosaic_gpu" in low.hlo
  # each consumer: K / 32 m64n128k32 wgmmas per sub-tile
  assert low.count(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3") == sub_n * k // 32
  assert low.count(r"wgmma\.mma_async") == sub_n * k // 32


def test_default_sub_n_where_it_saves_a_wave():
  """sub_n=2 (64 x 512 CTA tiles) is the default only at T <= SUB_N_MAX_TOKENS, N % 512 == 0, K / 64 <= stages,
  and where halving the tile count saves a wave over the SMs; an explicit sub_n always wins."""
  cfg = lambda n, t, k, h, tuning=(): bmm_mod._kernel_config(n, (("max_ctas", 132),) + tuning, t=t, k=k, h=h)
  assert cfg(512, 8, 128, 128).sub_n == 2       # DeepSeek W_UK: 256 tiles (2 waves) -> 128 (1 wave)
  assert cfg(512, 1, 192, 64).sub_n == 1        # GLM-5 W_UK: 128 tiles, one wave either way
  assert cfg(512, 8, 128, 128, (("sub_n", 1),)).sub_n == 1
  assert cfg(512, 256, 192, 64).sub_n == 2      # GLM-5 W_UK T = 256: 512 tiles (4 waves) -> 256 (2 waves)
  assert cfg(512, 4096, 128, 128).sub_n == 1    # prefill sizes: not measured, 64 x 256 tiles
  assert cfg(256, 8, 512, 128).sub_n == 1       # N % 512 != 0
  assert cfg(512, 8, 512, 128).sub_n == 1       # K / 64 = 8 chunks > 4 ring slots
  fused = lambda n, t, k, h, tuning=(): bmm_mod._kernel_config(n, (("max_ctas", 132),) + tuning, t=t, k=k, h=h,
                                                               fusable=True)
  # with the fp8 rows in registers (the default) two bf16 A tiles fit beside 64 x 512 tiles at K = 192; with the
  # fp8 SMEM tiles only one does
  assert (fused(512, 256, 192, 64).sub_n, fused(512, 256, 192, 64).a_buffers) == (2, 2)
  smem_a = (("a_registers", False),)
  assert (fused(512, 256, 192, 64, smem_a).sub_n, fused(512, 256, 192, 64, smem_a).a_buffers) == (2, 1)
  # an explicit a_buffers=2 does not fit beside 64 x 512 SMEM-operand tiles at K = 192: 64 x 256 tiles, no error
  assert fused(512, 70, 192, 3, (("max_ctas", 2), ("a_buffers", 2)) + smem_a).sub_n == 1


@pytest.mark.parametrize("t,h,k,n,tuning", [
    (3, 2, 512, 128, (("tile_n", 64), ("a_registers", True))),        # DeepSeek W_UV's default tile at decode
    (9, 3, 192, 256, (("tile_n", 64), ("share_quant", True), ("max_ctas", 2))),   # shared fp8 tile, 3 tiles/CTA
    (70, 3, 128, 256, (("share_quant", True), ("max_ctas", 2), ("quant_passes", 2))),
    (5, 2, 192, 512, (("quant_passes", 1), ("a_registers", False))),
    # runs the consumers' SMEM-tile quantization here (interpret mode has no inline_mgpu; see the lowering test)
    (4, 2, 512, 256, (("producer_quant", True), ("a_registers", False), ("tile_n", 64))),
])
def test_quantization_variants_are_bitwise_the_prepass(rng, t, h, k, n, tuning):
  """64-column consumer tiles, the quantization split over the consumers (a barrier, one fp8 tile per tile
  parity), one or two SMEM passes: same fp8 operands and wgmma chains as the pre-pass path, so the same bits;
  races checked. ``a_registers`` runs the SMEM tile path here (interpret mode has no register-A wgmma; see the
  lowering test below and tests/test_bmm_fp8_kernel_gpu.py)."""
  a, w8, ws = make_inputs(rng, t, h, k, n)
  wt = bmm_mod.prepare_weight(w8)
  run = functools.partial(bmm_mod._bmm_jit, a, wt, ws, act_scale="per_token", weight_layout="hnk", impl="mosaic")
  params = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=True)
  testing.reset_interpreter()
  got = jax.block_until_ready(run(interpret=params, tuning=tuning + (("quantize_k", k),)))
  assert not testing.races_found(), "the interpreter found a data race in the kernel"
  pre = run(interpret=True, tuning=(("quantize_k", None),))
  assert np.array_equal(np.asarray(got, np.float32), np.asarray(pre, np.float32))
  assert_matches_reference(got, a, w8, ws, "per_token")


@pytest.mark.parametrize("k,n,t,h", [(512, 128, 24, 128), (512, 256, 17, 64), (128, 512, 9, 128)])
def test_register_a_operand_lowers_for_sm90(k, n, t, h):
  """The op's decode defaults past the producer_quant sizes keep the quantized rows in registers: every fp8 wgmma takes its A operand from
  registers (four 32-bit registers, not an SMEM descriptor) and the fp8 values are made by e4m3x2 conversions
  in registers."""
  S = jax.ShapeDtypeStruct
  fn = lambda a, w, s: bmm_mod._mosaic_bmm(a, w, s, "per_token", "hnk", False)
  low = testing.lower_for_cuda(fn, S((t, h, k), jnp.bfloat16), S((h, n, k), FP8),
                               S((h, -(-k // 128), n // 128), jnp.float32), arch=(9, 0))
  cfg = bmm_mod._kernel_config(n, t=t, k=k, h=h, fusable=True)
  assert cfg.a_registers
  shape = f"m64n{cfg.tile_n}k32"
  per_consumer = cfg.sub_n * k // 32
  register_a = r"\{\$\d+,\$\d+,\$\d+,\$\d+\}"        # four 32-bit registers, not an SMEM descriptor
  wgmma = rf"wgmma\.mma_async\.sync\.aligned\.{shape}\.f32\.e4m3\.e4m3 \{{[^}}]*\}}, "
  assert low.count(wgmma + register_a) == per_consumer
  assert low.count(r"wgmma\.mma_async") == per_consumer
  # 32 values of each 64 x 64 chunk per thread -> 16 paired conversions per chunk (one code path per consumer)
  assert low.count(r"cvt\.rn\.satfinite\.e4m3x2\.f32") == 16 * (k // 64)


def test_quantization_knobs_and_narrow_tile_rule():
  """tile_n / a_registers / quant_passes / share_quant validation, and the op's defaults: the producer quantizes
  the rows at T <= 8 (T <= 16 at K = 512), the fp8 rows in registers elsewhere wherever quantize_k <= 512 with
  wg_split "n"; 64 x 128 CTA tiles where they make one wave."""
  with pytest.raises(ValueError, match="tile_n"):
    kbmm.TuningConfig(tile_n=32)
  with pytest.raises(ValueError, match="quant_passes"):
    kbmm.TuningConfig(quant_passes=3)
  with pytest.raises(ValueError, match="quant_passes=1"):
    kbmm.TuningConfig(quant_passes=1, quantize_k=1024, a_buffers=1, stages=2)
  with pytest.raises(ValueError, match="share_quant"):
    kbmm.TuningConfig(share_quant=True)                       # no in-kernel quantization
  with pytest.raises(ValueError, match="share_quant"):
    kbmm.TuningConfig(share_quant=True, quantize_k=128, wg_split="m")
  with pytest.raises(ValueError, match="a_registers"):
    kbmm.TuningConfig(a_registers=True)                       # no in-kernel quantization
  with pytest.raises(ValueError, match="a_registers"):
    kbmm.TuningConfig(a_registers=True, quantize_k=128, share_quant=True)
  assert kbmm.TuningConfig(quantize_k=512, a_buffers=1).register_quant
  assert not kbmm.TuningConfig(quantize_k=512, a_buffers=1, quant_passes=2).register_quant
  cfg = lambda n, t, k, h, tuning=(): bmm_mod._kernel_config(n, (("max_ctas", 132),) + tuning, t=t, k=k, h=h,
                                                             fusable=True)
  uv = cfg(128, 8, 512, 128)                                  # DeepSeek W_UV: 128 tiles of 64 x 128
  assert (uv.tile_n, uv.wg_split, uv.quantize_k, uv.a_registers, uv.producer_quant) == (64, "n", 512, False, True)
  for t, k, n, h, pq in [(16, 512, 128, 128, True), (17, 512, 128, 128, False), (8, 128, 512, 128, True),
                         (9, 192, 512, 64, False), (1, 192, 512, 64, True), (64, 512, 256, 64, False)]:
    c = cfg(n, t, k, h)
    assert (c.producer_quant, c.a_registers) == (pq, not pq), (t, k, n, h)
  assert not cfg(128, 8, 512, 128, (("a_registers", True),)).producer_quant   # an explicit quantization knob wins
  # one output tile per CTA only (as measured): H = 256: 256 tiles of 64 x 512 over 132 CTAs
  many = cfg(512, 4, 192, 256)
  assert (many.producer_quant, many.a_registers) == (False, True)
  assert cfg(512, 4, 192, 256, (("producer_quant", True), ("a_registers", False))).producer_quant
  assert cfg(128, 8, 512, 128, (("quantize_k", None),)).quantize_k is None
  assert cfg(256, 64, 512, 64).tile_n == 64                   # GLM-5 W_UV T = 64: 128 tiles
  assert cfg(256, 65, 512, 64).tile_n == 128                  # 256 tiles: two waves
  uv128 = cfg(128, 128, 512, 128)          # two waves of 64 x 128: 128 x 128, in-kernel quantization in registers
  assert (uv128.tile_n, uv128.wg_split, uv128.quantize_k, uv128.a_registers, uv128.a_buffers) == (128, "m", 512,
                                                                                                  True, 1)
  assert cfg(128, 128, 512, 128, (("a_registers", False),)).quantize_k is None   # fp8 SMEM tiles: no room
  uk = cfg(512, 1, 128, 128)                                  # DeepSeek W_UK: 512 narrow tiles; 64 x 512 stays
  assert (uk.tile_n, uk.sub_n, uk.producer_quant) == (128, 2, True)
  assert cfg(128, 8, 512, 128, (("wg_split", "m"),)).tile_n == 128      # an explicit tile shape wins
  assert not cfg(512, 8, 128, 128, (("share_quant", True),)).a_registers


def test_in_kernel_quantization_buffers():
  """Two bf16 A buffers where they fit (K <= 192; K = 512 with the fp8 rows in registers), one at K = 512 with the
  fp8 SMEM tiles; a_buffers is checked."""
  cfg = bmm_mod._kernel_config
  assert cfg(512, t=8, k=128, fusable=True).a_buffers == 2
  assert cfg(256, (("quantize_k", 512),), t=8, k=512).a_buffers == 2
  assert cfg(256, (("quantize_k", 512), ("a_registers", False)), t=8, k=512).a_buffers == 1
  with pytest.raises(ValueError, match="a_buffers"):
    kbmm.TuningConfig(a_buffers=3)


@pytest.mark.parametrize("k,n,t,h", [(512, 128, 1, 128), (512, 256, 8, 64), (128, 512, 16, 128), (192, 512, 3, 64)])
def test_producer_quant_lowers_for_sm90(k, n, t, h):
  """TuningConfig.producer_quant (kernels/bmm_row_quant.py, raw Mosaic GPU): the producer quantizes the T rows, one
  warp per row in rounds of 4 rows (unrolled: one 16-byte swizzled SMEM store and 8 paired e4m3 conversions per
  round), and every fp8 wgmma reads A from SMEM (a descriptor operand, not registers). Its numbers are checked on
  the GPU (tests/test_bmm_fp8_kernel_gpu.py, bitwise against the pre-pass path)."""
  S = jax.ShapeDtypeStruct
  tuning = (("producer_quant", True), ("a_registers", False))
  fn = lambda a, w, s: bmm_mod._mosaic_bmm(a, w, s, "per_token", "hnk", False, tuning)
  low = testing.lower_for_cuda(fn, S((t, h, k), jnp.bfloat16), S((h, n, k), FP8),
                               S((h, -(-k // 128), n // 128), jnp.float32), arch=(9, 0))
  cfg = bmm_mod._kernel_config(n, tuning, t=t, k=k, h=h, fusable=True)
  assert cfg.producer_quant and cfg.quantize_k == k
  rounds = -(-t // 4)
  assert low.count(r"st\.shared\.v4\.b32") == rounds
  assert low.count(r"cvt\.rn\.satfinite\.e4m3x2\.f32") == 8 * rounds
  wgmma = rf"wgmma\.mma_async\.sync\.aligned\.m64n{cfg.tile_n}k32\.f32\.e4m3\.e4m3 \{{[^}}]*\}}, \$\d+, \$\d+, p"
  assert low.count(wgmma) == low.count(r"wgmma\.mma_async") == cfg.sub_n * k // 32   # SMEM descriptors for A


def test_producer_quant_config_checks():
  with pytest.raises(ValueError, match="producer_quant"):
    kbmm.TuningConfig(quantize_k=512, producer_quant=True, a_registers=True)
  with pytest.raises(ValueError, match="producer_quant"):
    kbmm.TuningConfig(quantize_k=512, producer_quant=True, wg_split="m", a_buffers=1)
  with pytest.raises(ValueError, match="producer_quant"):
    kbmm.TuningConfig(producer_quant=True)                       # needs in-kernel quantization
  with pytest.raises(NotImplementedError, match="producer_quant"):
    kbmm.check_shapes(17, 128, 512, 128, kbmm.TuningConfig(quantize_k=512, producer_quant=True, tile_n=64))
