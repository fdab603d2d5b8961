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


def cfg(t, k, n, h, tuning=(), fusable=True):
  """The op's kernel config on a 132-SM GPU."""
  return bmm_mod.default_config(t, k, n, h, fusable=fusable, tuning=(("max_ctas", 132),) + tuning)


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
  assert cfg(1, 128, 512, 128).quantize_k == 128                              # decode: no pre-pass launches
  assert cfg(bmm_mod.FUSED_QUANT_MAX_TOKENS + 1, 128, 512, 128).quantize_k is None
  assert cfg(1, 128, 512, 128, fusable=False).quantize_k is None              # per-tensor or float32 a
  assert cfg(8, 192, 512, 64).quantize_k == 192
  assert cfg(128, 512, 128, 128).quantize_k == 512   # wg_split "m": fits with the fp8 rows in registers
  assert cfg(200, 512, 256, 64, (("quantize_k", 512),)).quantize_k == 512     # explicit override
  with pytest.raises(ValueError, match="SMEM"):                                # bf16 A tile too big for SMEM
    cfg(8, 512, 128, 128, (("quantize_k", 512), ("a_quant", "smem"), ("wg_split", "m")))
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


def test_auto_takes_the_kernel_at_every_t_on_sm90(monkeypatch):
  """On an sm_90 GPU "auto" takes the kernel wherever it takes the shape, T = 1 included (no token threshold: the
  kernel measured faster than XLA at every measured T, docs/kernels/bmm_fp8.md); per-tensor scales too."""
  monkeypatch.setattr(_dispatch, "gpu_arch", lambda: (9, 0))
  for t, k, n, h, fusable in [(1, 128, 512, 128, True), (1, 512, 128, 128, False), (4096, 192, 512, 64, True)]:
    supported = bmm_mod._kernel_supported((t, h, k), n, fusable, False)
    assert _dispatch.choose(OP, "auto", interpret=False, supported=supported) == "mosaic", (t, k, n)
  assert _dispatch.choose(OP, "auto", interpret=False,
                          supported=bmm_mod._kernel_supported((1, 128, 200), 512, True, False)) == "xla"


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
  pre = functools.partial(cfg, fusable=False)
  assert pre(8, 128, 512, 128).sub_n == 2       # DeepSeek W_UK: 256 tiles (2 waves) -> 128 (1 wave)
  assert pre(1, 192, 512, 64).sub_n == 1        # GLM-5 W_UK: 128 tiles, one wave either way
  assert pre(8, 128, 512, 128, (("sub_n", 1),)).sub_n == 1
  assert pre(256, 192, 512, 64).sub_n == 2      # GLM-5 W_UK T = 256: 512 tiles (4 waves) -> 256 (2 waves)
  assert pre(4096, 128, 512, 128).sub_n == 1    # prefill sizes: not measured, 64 x 256 tiles
  assert pre(8, 512, 256, 128).sub_n == 1       # N % 512 != 0
  assert pre(8, 512, 512, 128).sub_n == 1       # K / 64 = 8 chunks > 4 ring slots
  # with the fp8 rows in registers (the default) two bf16 A tiles fit beside 64 x 512 tiles at K = 192; with the
  # fp8 SMEM tiles only one does
  assert (cfg(256, 192, 512, 64).sub_n, cfg(256, 192, 512, 64).a_buffers) == (2, 2)
  smem_a = (("a_quant", "smem"),)
  assert (cfg(256, 192, 512, 64, smem_a).sub_n, cfg(256, 192, 512, 64, smem_a).a_buffers) == (2, 1)
  # an explicit a_buffers=2 does not fit beside 64 x 512 SMEM-operand tiles at K = 192: 64 x 256 tiles, no error
  assert cfg(70, 192, 512, 3, (("max_ctas", 2), ("a_buffers", 2)) + smem_a).sub_n == 1


@pytest.mark.parametrize("t,h,k,n,tuning", [
    (3, 2, 512, 128, (("tile_n", 64), ("a_quant", "registers"))),     # DeepSeek W_UV's tile at decode
    # 3 tiles per CTA through 2 bf16 A buffers: the producer's TMA refills a buffer the consumers read with register
    # loads (without the proxy fence before their a_empty arrival the interpreter reports a race)
    (9, 3, 192, 256, (("tile_n", 64), ("a_quant", "registers"), ("max_ctas", 2))),
    (9, 3, 192, 256, (("tile_n", 64), ("a_quant", "smem"), ("max_ctas", 2))),   # 3 tiles per CTA
    (70, 3, 128, 256, (("a_quant", "smem"), ("max_ctas", 2))),                   # 2 M tiles, 3 tiles per CTA
    (5, 2, 192, 512, (("a_quant", "smem"),)),                          # one SMEM pass (K <= 512)
    (5, 2, 576, 128, ()),          # the default at K = 576: "smem" with two SMEM passes (K > 512), one A buffer
    # runs the consumers' SMEM-tile quantization here (interpret mode has no inline_mgpu; see the lowering test)
    (4, 2, 512, 256, (("a_quant", "producer"), ("tile_n", 64))),
])
def test_quantization_variants_are_bitwise_the_prepass(rng, t, h, k, n, tuning):
  """64-column consumer tiles, several tiles per CTA, one or two SMEM passes: same fp8 operands and wgmma chains as
  the pre-pass path, so the same bits; races checked. "producer" runs the "smem" design here, "registers" its
  register loads and quantization and its fenced release of the bf16 tile, with the fp8 chunks then staged in SMEM
  (interpret mode has neither a register-A wgmma nor inline_mgpu; see the lowering tests below and
  tests/test_bmm_fp8_kernel_gpu.py)."""
  if k > kbmm.MAX_REGISTER_K:
    c = cfg(t, k, n, h, tuning)
    assert (c.quantize_k, c.a_quant, c.register_quant, c.a_buffers) == (k, "smem", False, 1)
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
  """The op's decode defaults past the producer sizes keep the quantized rows in registers: every fp8 wgmma
  takes its A operand from registers (four 32-bit registers, not an SMEM descriptor) and the fp8 values are made
  by e4m3x2 conversions in registers."""
  S = jax.ShapeDtypeStruct
  fn = lambda a, w, s: bmm_mod._mosaic_bmm(a, w, s, "per_token", "hnk", False)
  low = testing.lower_for_cuda(fn, S((t, h, k), jnp.bfloat16), S((h, n, k), FP8),
                               S((h, -(-k // 128), n // 128), jnp.float32), arch=(9, 0))
  c = bmm_mod.default_config(t, k, n, h)
  assert c.a_quant == "registers"
  shape = f"m64n{c.tile_n}k32"
  per_consumer = c.sub_n * k // 32
  register_a = r"\{\$\d+,\$\d+,\$\d+,\$\d+\}"        # four 32-bit registers, not an SMEM descriptor
  wgmma = rf"wgmma\.mma_async\.sync\.aligned\.{shape}\.f32\.e4m3\.e4m3 \{{[^}}]*\}}, "
  assert low.count(wgmma + register_a) == per_consumer
  assert low.count(r"wgmma\.mma_async") == per_consumer
  # 32 values of each 64 x 64 chunk per thread -> 16 paired conversions per chunk (one code path per consumer)
  assert low.count(r"cvt\.rn\.satfinite\.e4m3x2\.f32") == 16 * (k // 64)
  # proxy fences (commit_smem): one before the release of the bf16 A tile (its register loads, then the producer's
  # TMA refill), one per sub-tile's output staging
  assert low.count(r"nvvm\.fence\.proxy <async\.shared>") == 1 + c.sub_n


def test_quantization_knobs_and_narrow_tile_rule():
  """tile_n / a_quant validation, and the op's defaults: the producer quantizes the rows at T <= 8 (T <= 16 at
  K = 512), the fp8 rows in registers elsewhere wherever quantize_k <= 512; 64 x 128 CTA tiles where they make
  one wave."""
  with pytest.raises(ValueError, match="tile_n"):
    kbmm.TuningConfig(tile_n=32)
  with pytest.raises(ValueError, match="a_quant"):
    kbmm.TuningConfig(quantize_k=128, a_quant="shared")
  with pytest.raises(ValueError, match="a_quant='registers' needs in-kernel"):
    kbmm.TuningConfig(a_quant="registers")                    # no in-kernel quantization
  with pytest.raises(ValueError, match="quantize_k <= 512"):
    kbmm.TuningConfig(a_quant="registers", quantize_k=576, a_buffers=1)
  assert kbmm.TuningConfig(quantize_k=512, a_buffers=1).register_quant      # "smem": one SMEM pass
  assert not kbmm.TuningConfig(quantize_k=576, a_buffers=1, tile_n=64).register_quant   # two passes
  uv = cfg(8, 512, 128, 128)                                  # DeepSeek W_UV: 128 tiles of 64 x 128
  assert (uv.tile_n, uv.wg_split, uv.quantize_k, uv.a_quant) == (64, "n", 512, "producer")
  for t, k, n, h, pq in [(16, 512, 128, 128, True), (17, 512, 128, 128, False), (8, 128, 512, 128, True),
                         (9, 192, 512, 64, False), (1, 192, 512, 64, True), (64, 512, 256, 64, False)]:
    assert cfg(t, k, n, h).a_quant == ("producer" if pq else "registers"), (t, k, n, h)
  assert cfg(8, 512, 128, 128, (("a_quant", "registers"),)).a_quant == "registers"   # an explicit a_quant wins
  # one output tile per CTA only (as measured): H = 256: 256 tiles of 64 x 512 over 132 CTAs
  assert cfg(4, 192, 512, 256).a_quant == "registers"
  assert cfg(4, 192, 512, 256, (("a_quant", "producer"),)).a_quant == "producer"
  assert cfg(8, 512, 128, 128, (("quantize_k", None),)).quantize_k is None
  assert cfg(64, 512, 256, 64).tile_n == 64                   # GLM-5 W_UV T = 64: 128 tiles
  assert cfg(65, 512, 256, 64).tile_n == 128                  # 256 tiles: two waves
  uv128 = cfg(128, 512, 128, 128)          # two waves of 64 x 128: 128 x 128, in-kernel quantization in registers
  assert (uv128.tile_n, uv128.wg_split, uv128.quantize_k, uv128.a_quant, uv128.a_buffers) == (128, "m", 512,
                                                                                              "registers", 1)
  assert cfg(128, 512, 128, 128, (("a_quant", "smem"),)).quantize_k is None   # fp8 SMEM tiles: no room
  uk = cfg(1, 128, 512, 128)                                  # DeepSeek W_UK: 512 narrow tiles; 64 x 512 stays
  assert (uk.tile_n, uk.sub_n, uk.a_quant) == (128, 2, "producer")
  assert cfg(8, 512, 128, 128, (("wg_split", "m"),)).tile_n == 128      # an explicit tile shape wins
  assert cfg(5, 576, 128, 2).a_quant == "smem"                # K > 512: the consumers' fp8 SMEM tiles


def test_in_kernel_quantization_buffers():
  """Two bf16 A buffers where they fit (K <= 192; K = 512 with the fp8 rows in registers), one at K = 512 with the
  fp8 SMEM tiles; a_buffers is checked."""
  assert cfg(8, 128, 512, 128).a_buffers == 2
  assert cfg(32, 512, 256, 64, (("quantize_k", 512),)).a_buffers == 2
  assert cfg(32, 512, 256, 64, (("quantize_k", 512), ("a_quant", "smem"))).a_buffers == 1
  with pytest.raises(ValueError, match="a_buffers"):
    kbmm.TuningConfig(a_buffers=3)


def test_default_config_and_sweep_configs():
  """default_config is what the op runs (the MLA shapes' designs at decode and prefill sizes); sweep_configs
  starts with "default": (), and every entry is a distinct valid config of the op's tuning keyword."""
  designs = {(t, k, n, h): (c.quantize_k is not None, c.a_quant, c.tile_n, c.sub_n, c.wg_split)
             for t in (1, 64, 4096) for k, n, h in [(128, 512, 128), (512, 128, 128)]
             for c in [bmm_mod.default_config(t, k, n, h)]}
  assert designs == {
      (1, 128, 512, 128): (True, "producer", 128, 2, "n"), (1, 512, 128, 128): (True, "producer", 64, 1, "n"),
      (64, 128, 512, 128): (True, "registers", 128, 2, "n"), (64, 512, 128, 128): (True, "registers", 64, 1, "n"),
      (4096, 128, 512, 128): (False, "smem", 128, 1, "n"), (4096, 512, 128, 128): (False, "smem", 128, 1, "m")}
  for t, k, n, h in [(1, 128, 512, 128), (8, 512, 128, 128), (256, 192, 512, 64), (4096, 512, 256, 64)]:
    sweep = bmm_mod.sweep_configs(t, k, n, h)
    assert next(iter(sweep.items())) == ("default", ())
    cfgs = [bmm_mod.default_config(t, k, n, h, tuning=v) for v in sweep.values()]
    for c in cfgs:
      kbmm.check_shapes(t, h, k, n, c)
    assert len(set(cfgs)) == len(cfgs) >= 4, sweep
    if t <= 256:
      assert "prepass" in sweep and "a_quant=smem" in sweep
  assert "a_quant=registers" in bmm_mod.sweep_configs(1, 128, 512, 128)


@pytest.mark.parametrize("k,n,t,h", [(512, 128, 1, 128), (512, 256, 8, 64), (128, 512, 16, 128), (192, 512, 3, 64)])
def test_producer_quant_lowers_for_sm90(k, n, t, h):
  """TuningConfig.a_quant="producer" (kernels/bmm_row_quant.py, raw Mosaic GPU): the producer quantizes the T rows, one
  warp per row in rounds of 4 rows (unrolled: one 16-byte swizzled SMEM store and 8 paired e4m3 conversions per
  round), and every fp8 wgmma reads A from SMEM (a descriptor operand, not registers). Its numbers are checked on
  the GPU (tests/test_bmm_fp8_kernel_gpu.py, bitwise against the pre-pass path)."""
  S = jax.ShapeDtypeStruct
  tuning = (("a_quant", "producer"),)
  fn = lambda a, w, s: bmm_mod._mosaic_bmm(a, w, s, "per_token", "hnk", False, tuning)
  low = testing.lower_for_cuda(fn, S((t, h, k), jnp.bfloat16), S((h, n, k), FP8),
                               S((h, -(-k // 128), n // 128), jnp.float32), arch=(9, 0))
  c = bmm_mod.default_config(t, k, n, h, tuning=tuning)
  assert c.a_quant == "producer" and c.quantize_k == k
  rounds = -(-t // 4)
  assert low.count(r"st\.shared\.v4\.b32") == rounds
  assert low.count(r"cvt\.rn\.satfinite\.e4m3x2\.f32") == 8 * rounds
  wgmma = rf"wgmma\.mma_async\.sync\.aligned\.m64n{c.tile_n}k32\.f32\.e4m3\.e4m3 \{{[^}}]*\}}, \$\d+, \$\d+, p"
  assert low.count(wgmma) == low.count(r"wgmma\.mma_async") == c.sub_n * k // 32   # SMEM descriptors for A


def test_producer_quant_config_checks():
  with pytest.raises(ValueError, match="a_quant='producer' needs quantize_k <= 512"):
    kbmm.TuningConfig(quantize_k=576, a_quant="producer", a_buffers=1)
  with pytest.raises(ValueError, match="a_quant='producer'"):
    kbmm.TuningConfig(quantize_k=512, a_quant="producer", wg_split="m", a_buffers=1)
  with pytest.raises(ValueError, match="a_quant='producer'"):
    kbmm.TuningConfig(a_quant="producer")                       # needs in-kernel quantization
  with pytest.raises(NotImplementedError, match="a_quant='producer'"):
    kbmm.check_shapes(17, 128, 512, 128, kbmm.TuningConfig(quantize_k=512, a_quant="producer", tile_n=64))


