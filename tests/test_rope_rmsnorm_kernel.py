"""fused_rope_rmsnorm_quantization / rope_rmsnorm through the Mosaic GPU kernel (mla_pallas.kernels.rope_rmsnorm)
on the CPU: interpret mode with race detection against the references (default grid and explicit TuningConfigs:
tokens per CTA, warpgroups, ring depth, warpgroup 0's q share), lowering for CUDA at sm_90 (test and benchmark
shapes, every knob), dispatch and argument checks.

Interpret mode runs each warpgroup on a thread and blocks a thread of XLA:CPU's callback pool per barrier wait:
on a 2-core machine three or more warpgroups can starve it (see ops.rope_rmsnorm.INTERPRET_MAX_WARPGROUPS), so the
in-process tests use at most 2 warpgroups and the 3- and 4-warpgroup configs run in a subprocess with 4 host
devices (more pool threads).

Tolerance (see :func:`assert_near_bitwise`): results equal the jitted reference bitwise except for a few elements
(at most 0.2 % here; typically 0-6 per case) one representable step away (bf16 ulp / e4m3 step) or within 2^-18
absolute: the kernel's RMS sum order differs from XLA's, and XLA:CPU contracts ``a*c - b*s`` into an FMA in the
jitted reference while the interpreter does not. Untouched cache rows are compared
bitwise (they hold NaN). The helpers here are also used by tests/test_rope_rmsnorm_kernel_gpu.py.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

import mla_pallas
from mla_pallas import _dispatch, testing
from mla_pallas import reference as ref
from mla_pallas.kernels import common
from mla_pallas.kernels import rope_rmsnorm as rk
from mla_pallas.ops import rope_rmsnorm as op

from _rope_inputs import FP8, REF_WRITE, bits, check_fused, check_unfused, make_case


def _fused(case, interleaved, impl="mosaic", interpret=True):
  return mla_pallas.fused_rope_rmsnorm_quantization(
      jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, eps=case.eps,
      kv_scale=case.kv_scale, slots=case.slots, interleaved=interleaved, impl=impl, interpret=interpret)


def _races():
  return plgpu.InterpretGPUParams(detect_races=True)


def _fused_tuned(case, interleaved, tuning, interpret=True):
  """The op's jitted Mosaic path with TuningConfig overrides (``tuning``: (name, value) pairs)."""
  return op._fused_mosaic(jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w,
                          jnp.float32(case.eps), jnp.float32(case.kv_scale), case.slots, interleaved=interleaved,
                          interpret=interpret, tuning=tuple(tuning))


def _unfused_tuned(case, interleaved, tuning, interpret=True):
  return op._rope_rmsnorm_mosaic(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w,
                                 jnp.float32(case.eps), interleaved=interleaved, interpret=interpret,
                                 tuning=tuple(tuning))


@pytest.mark.parametrize("t,h,interleaved", [
    (1, 64, True),      # one token: one CTA, a 4-row latent group with 3 rows past the end
    (1, 128, False),    # two 64-head tiles per token, NeoX pairing
    (5, 16, True),      # H < 64: one q tile holds 4 tokens; T * H < 64 (the q box reads past the end)
    (7, 128, True),     # odd T, one token per CTA (the default grid for T <= 132)
    (9, 4, True),       # H = 4: 16 tokens per q tile
])
def test_fused_kernel_interpret_matches_reference(rng, t, h, interleaved):
  """The public op with the default grid (one token per CTA at these T; at most 2 warpgroups in interpret)."""
  case = make_case(rng, t, h)
  new_pages, q_out = _fused(case, interleaved, interpret=_races())
  assert _dispatch.last_impl("fused_rope_rmsnorm_quantization") == "mosaic-interpret"
  assert not testing.races_found(), "the interpreter found a data race in the kernel"
  assert new_pages.shape == case.pages.shape and new_pages.dtype == FP8
  assert q_out.shape == (t, h, 64) and q_out.dtype == jnp.bfloat16
  check_fused(case, new_pages, q_out, interleaved, max_frac=2e-3)


# (T, H, interleaved, TuningConfig overrides): several tokens per CTA, partial last CTAs, 1 and 2 warpgroups,
# ring depths, warpgroup 0's q share, latent groups of 4 and 8 rows.
TUNED = [
    (70, 64, False, dict(tokens_per_cta=16)),                       # 5 CTAs of 14 tokens
    (70, 32, True, dict(tokens_per_cta=8, warpgroups=1, stages=2)),  # one warpgroup does everything
    (37, 128, False, dict(tokens_per_cta=12, kv_share=1)),           # latent groups of 4 rows
    (128, 16, True, dict(tokens_per_cta=64, stages=2)),              # T = 128, H = 16: the T = 8192 grid shape
    (128, 128, True, dict(tokens_per_cta=64, stages=4, kv_share=4)),  # T = 128, H = 128: 128 q tiles per CTA
    (7, 128, False, dict(tokens_per_cta=4, warpgroups=1)),           # odd T, a 3-token last CTA
    (13, 16, True, dict(tokens_per_cta=4)),                          # H = 16: one q tile per CTA
    (70, 64, True, dict(ctas=3)),                                    # uneven ranges: 24, 23, 23 tokens
    (37, 16, False, dict(ctas=4, tokens_per_cta=12)),                # H = 16: 12, 12, 8 and 5 tokens
    (125, 64, True, dict(ctas=2, stages=2)),    # 63 + 62 tokens, t0 = 63: the second k_rope pass (d + n = 69 > 64)
]


@pytest.mark.parametrize("t,h,interleaved,tuning", TUNED)
def test_fused_kernel_tuning_interpret(rng, t, h, interleaved, tuning):
  case = make_case(rng, t, h, num_slots=2 * t + 64)
  new_pages, q_out = _fused_tuned(case, interleaved, tuning.items(), interpret=_races())
  assert not testing.races_found(), "the interpreter found a data race in the kernel"
  check_fused(case, new_pages, q_out, interleaved, max_frac=2e-3)


def test_fused_kernel_duplicate_and_skipped_slots(rng):
  """Duplicated slots: the last token wins (the op keeps only the last writer, so CTAs never race), within a CTA
  and across CTAs; -1 and out-of-range slots are skipped; a flat [num_slots, 576] cache and a float32 norm weight
  work too."""
  case = make_case(rng, 70, 64, skip=False)
  slots = np.asarray(case.slots).copy()
  slots[[3, 66, 10]] = slots[0]            # the same slot in two CTAs: token 66 (CTA 2) must win
  slots[[20, 21]] = slots[25]              # within one CTA: token 25 wins
  slots[[5, 40]] = [-1, 10 ** 6]
  case.slots = jnp.asarray(slots)
  case.pages = case.pages.reshape(-1, 576)
  case.w = case.w.astype(jnp.float32)
  new_pages, q_out = _fused_tuned(case, True, dict(tokens_per_cta=32).items(), interpret=_races())
  assert not testing.races_found()
  check_fused(case, new_pages, q_out, True, max_frac=2e-3)


@pytest.mark.parametrize("t,h,interleaved,tuning", [
    (5, 64, False, None),                                  # the public op, default grid
    (70, 64, True, dict(tokens_per_cta=16)),               # 14 tokens per CTA: latent groups of 8 and 6 rows
    (37, 16, True, dict(tokens_per_cta=12, warpgroups=1)),  # groups of 4 rows; 12, 12, 8 and 5 tokens
    (6, 128, False, dict(tokens_per_cta=6)),               # one latent group of 8 rows, 6 of them stored
    (45, 64, True, dict(ctas=4)),                          # uneven ranges (12, 11, 11, 11): per-row stores
    (125, 64, False, dict(ctas=2, stages=2)),              # t0 = 63: k_rope window from 56, second pass
])
def test_unfused_kernel_interpret_matches_reference(rng, t, h, interleaved, tuning):
  case = make_case(rng, t, h)
  if tuning is None:
    kv_out, q_out = mla_pallas.rope_rmsnorm(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w,
                                            eps=case.eps, interleaved=interleaved, impl="mosaic",
                                            interpret=_races())
    assert _dispatch.last_impl("rope_rmsnorm") == "mosaic-interpret"
  else:
    kv_out, q_out = _unfused_tuned(case, interleaved, tuning.items(), interpret=_races())
  assert not testing.races_found(), "the interpreter found a data race in the kernel"
  assert kv_out.shape == (t, 576)
  check_unfused(case, kv_out, q_out, interleaved, max_frac=2e-3)


MANY_WG_SCRIPT = r"""
import sys
import numpy as np
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu
sys.path.insert(0, "tests")
from mla_pallas import testing
from mla_pallas.ops import rope_rmsnorm as op
from _rope_inputs import check_fused, check_unfused, make_case
rng = np.random.default_rng(int(sys.argv[1]))
races = plgpu.InterpretGPUParams(detect_races=True)
for t, h, il, fused, tuning in [(37, 128, True, True, (("tokens_per_cta", 12), ("warpgroups", 3))),
                                (70, 32, False, True, (("tokens_per_cta", 16),)),
                                (9, 64, True, False, (("tokens_per_cta", 8), ("warpgroups", 3)))]:
  tuning = tuning + ((("warpgroups", 4),) if dict(tuning).get("warpgroups") is None else ())
  case = make_case(rng, t, h)
  if fused:
    pages, q = op._fused_mosaic(jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin,
                                case.w, jnp.float32(case.eps), jnp.float32(case.kv_scale), case.slots,
                                interleaved=il, interpret=races, tuning=tuning)
    check_fused(case, pages, q, il, max_frac=2e-3)
  else:
    kv, q = op._rope_rmsnorm_mosaic(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w,
                                    jnp.float32(case.eps), interleaved=il, interpret=races, tuning=tuning)
    check_unfused(case, kv, q, il, max_frac=2e-3)
  assert not testing.races_found()
print("MANY WG OK")
"""


def test_three_and_four_warpgroups_interpret(rng):
  """The GPU's default of 4 warpgroups (and 3) in interpret mode, in a subprocess with 4 host devices: more
  XLA:CPU pool threads, so that warpgroups blocked in barrier waits cannot starve the one they wait for."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
             PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, "-c", MANY_WG_SCRIPT, str(int(rng.integers(2 ** 31)))], env=env,
                        cwd=root, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and "MANY WG OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_swap_matrix_and_tables_reproduce_reference_rope(rng):
  """The kernel's formulation y = x*C + (x @ P)*S, evaluated in numpy f32 without FMA, equals the reference's
  pairing for both conventions (checks P and the table arrangement independently of the kernel)."""
  cos, sin = ref.rope_tables(128)
  x = np.asarray(rng.normal(size=(9, 64)), np.float32)
  pos = jnp.asarray(rng.integers(0, 128, size=9), jnp.int32)
  for interleaved in (True, False):
    c_tab, s_tab = (np.asarray(a) for a in op._kernel_tables(pos, cos, sin, interleaved, 9))
    swapped = x @ np.asarray(op._swap_matrix(interleaved), np.float32)
    got = x * c_tab + swapped * s_tab
    want = np.asarray(ref.rope(jnp.asarray(x), pos, cos, sin, interleaved=interleaved))
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def _avals(t, h, fused, num_slots=4096, w_dtype=jnp.bfloat16):
  s = jax.ShapeDtypeStruct
  av = [s((rk.kv_rows_for(t), 9, 64), jnp.bfloat16), s((rk.q_rows_for(t, h), 64), jnp.bfloat16),
        s((t, 132 if fused else 128), jnp.int32), s((8, 64), w_dtype),
        s((64, 64), jnp.bfloat16), s((1,), jnp.float32)]
  if fused:
    return av + [s((1,), jnp.float32), s((num_slots, 9, 64), FP8)]
  return av


def _lower(t, h, fused, cfg=None, w_dtype=jnp.bfloat16):
  kern = rk.build(t, h, 4096 if fused else 0, fused, cfg, w_dtype=w_dtype)
  if fused:
    def f(*a):
      cache = jax.new_ref(a[-1])
      return kern(*a[:-1], cache), jax.freeze(cache)
  else:
    f = kern
  return testing.lower_for_cuda(f, *_avals(t, h, fused, w_dtype=w_dtype), arch=(9, 0))


@pytest.mark.parametrize("t,h,fused", [(5, 64, True), (8192, 128, True), (70, 128, False), (8192, 64, False),
                                        (8192, 16, True), (37, 32, False),
                                        # the benchmark shapes (benchmarks/rope_v3_gpu.sh)
                                        (1, 128, True), (128, 128, True), (4096, 128, True), (4096, 128, False),
                                        (128, 16, True), (20000, 128, True)])
def test_kernel_lowers_for_sm90(t, h, fused):
  low = _lower(t, h, fused)
  assert "mosaic_gpu" in low.hlo
  # fused: the cache is an input/output alias of the custom call (updated in place)
  assert ("output_operand_aliases" in low.hlo) == fused
  assert low.count("wgmma") > 0


@pytest.mark.parametrize("cfg", [
    rk.TuningConfig(warpgroups=1, stages=2, tokens_per_cta=64), rk.TuningConfig(warpgroups=2, stages=8),
    rk.TuningConfig(warpgroups=3, tokens_per_cta=16, kv_share=1), rk.TuningConfig(stages=4, tokens_per_cta=8),
    rk.TuningConfig(tokens_per_cta=1), rk.TuningConfig(tokens_per_cta=6), rk.TuningConfig(ctas=100),
    rk.TuningConfig(ctas=64, tokens_per_cta=64, stages=2),
])
@pytest.mark.parametrize("fused", [True, False])
def test_every_knob_lowers_for_sm90(cfg, fused):
  assert "mosaic_gpu" in _lower(4096, 128, fused, cfg, w_dtype=jnp.float32).hlo


def test_lowered_smem_matches_the_budget():
  """The dynamic SMEM Mosaic allocates is at most what :func:`smem_budget` counts (within 1.5 KB) and fits the
  limit."""
  import re
  for t, h, fused in [(4096, 128, True), (8192, 16, True), (4096, 128, False), (128, 128, True)]:
    cfg = rk.default_config(t, h, fused)
    low = _lower(t, h, fused, cfg, w_dtype=jnp.float32)
    smem = int(re.search(r"dynamic_shared_memory_size %c(\d+)_i32", low.mosaic[0]).group(1))
    assert smem <= common.SMEM_LIMIT
    assert 0 <= rk.smem_budget(cfg, fused) - smem <= 1536, (t, h, fused, smem, rk.smem_budget(cfg, fused))


def test_fused_op_donates_and_aliases_the_cache():
  s = jax.ShapeDtypeStruct
  t, h = 70, 64
  args = (s((64, 16, 576), FP8), s((t, 576), jnp.bfloat16), s((t, h, 64), jnp.bfloat16), s((t,), jnp.int32),
          s((128, 32), jnp.float32), s((128, 32), jnp.float32), s((512,), jnp.bfloat16), s((), jnp.float32),
          s((), jnp.float32), s((t,), jnp.int32))
  with _target_sm90():
    hlo = op._fused_mosaic.trace(*args, interleaved=True, interpret=False).lower(
        lowering_platforms=("cuda",)).as_text()
  assert "tf.aliasing_output = 0" in hlo, "pages is not donated into output 0"
  assert "output_operand_aliases" in hlo


def _target_sm90():
  from jax.experimental.mosaic.gpu import utils as mgpu_utils

  @contextlib.contextmanager
  def ctx():
    old = mgpu_utils._infer_arch
    mgpu_utils._infer_arch = lambda: (9, 0)
    try:
      yield
    finally:
      mgpu_utils._infer_arch = old
  return ctx()


def test_dispatch_and_unsupported_inputs(rng):
  case = make_case(rng, 3, 48)
  # H = 48 is neither a multiple nor a divisor of 64: "mosaic" raises, "auto" falls back to XLA (bitwise the ref)
  with pytest.raises(NotImplementedError, match="divisor of 64"):
    _fused(case, True, impl="mosaic", interpret=True)
  new_pages, q_out = _fused(case, True, impl="auto", interpret=True)
  assert _dispatch.last_impl("fused_rope_rmsnorm_quantization") == "xla"
  r_pages, r_q = REF_WRITE(jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin,
                           case.w, eps=case.eps, kv_scale=case.kv_scale, slots=case.slots, interleaved=True)
  np.testing.assert_array_equal(bits(new_pages), bits(r_pages))
  np.testing.assert_array_equal(bits(q_out), bits(r_q))
  # float32 activations: no kernel
  case64 = make_case(rng, 3, 64)
  with pytest.raises(NotImplementedError, match="bfloat16"):
    mla_pallas.rope_rmsnorm(case64.kv.astype(jnp.float32), case64.q_rope, case64.positions, case64.cos,
                            case64.sin, case64.w, eps=1e-6, impl="mosaic", interpret=True)
  # no GPU here and no interpret: "mosaic" raises, "auto" runs XLA
  if _dispatch.mosaic_arch(False) is None:
    with pytest.raises(NotImplementedError):
      _fused(case64, True, impl="mosaic", interpret=False)
    _fused(case64, True, impl="auto", interpret=False)
    assert _dispatch.last_impl("fused_rope_rmsnorm_quantization") == "xla"


def test_bad_inputs_raise_value_error_before_dispatch(rng):
  case = make_case(rng, 4, 64)
  kw = dict(eps=1e-6, impl="mosaic", interpret=True)
  with pytest.raises(ValueError, match="kv"):
    mla_pallas.rope_rmsnorm(case.kv[:, :512], case.q_rope, case.positions, case.cos, case.sin, case.w, **kw)
  with pytest.raises(ValueError, match="q_rope"):
    mla_pallas.rope_rmsnorm(case.kv, case.q_rope[:, :, :32], case.positions, case.cos, case.sin, case.w, **kw)
  with pytest.raises(ValueError, match="positions"):
    mla_pallas.rope_rmsnorm(case.kv, case.q_rope, case.positions.astype(jnp.float32), case.cos, case.sin, case.w,
                            **kw)
  with pytest.raises(ValueError, match="interleaved"):
    mla_pallas.rope_rmsnorm(case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, interleaved=1, **kw)
  pages = jnp.asarray(case.pages)
  with pytest.raises(ValueError, match="kv_scale"):
    mla_pallas.fused_rope_rmsnorm_quantization(pages, case.kv, case.q_rope, case.positions, case.cos, case.sin,
                                               case.w, kv_scale=0.0, slots=case.slots, **kw)
  with pytest.raises(ValueError, match="slots"):
    mla_pallas.fused_rope_rmsnorm_quantization(pages, case.kv, case.q_rope, case.positions, case.cos, case.sin,
                                               case.w, kv_scale=1.0, slots=case.slots[:2], **kw)
  with pytest.raises(ValueError, match="pages"):
    mla_pallas.fused_rope_rmsnorm_quantization(pages.astype(jnp.bfloat16), case.kv, case.q_rope, case.positions,
                                               case.cos, case.sin, case.w, kv_scale=1.0, slots=case.slots, **kw)


def test_tuning_config_validates():
  cfg = rk.TuningConfig()
  assert (cfg.stages, cfg.warpgroups, cfg.tokens_per_cta, cfg.ctas, cfg.kv_share) == (3, 4, None, None, 3)
  for bad in (0, 1, -1, 9):
    with pytest.raises(ValueError, match="stages"):
      rk.TuningConfig(stages=bad)
  for bad in (0, 5):
    with pytest.raises(ValueError, match="warpgroups"):
      rk.TuningConfig(warpgroups=bad)
  for bad in (0, 65, 2.0, True):
    with pytest.raises(ValueError, match="tokens_per_cta"):
      rk.TuningConfig(tokens_per_cta=bad)
  for bad in (0, -3, 1.5):
    with pytest.raises(ValueError, match="ctas"):
      rk.TuningConfig(ctas=bad)
  for bad in (0, 5):
    with pytest.raises(ValueError, match="kv_share"):
      rk.TuningConfig(kv_share=bad)
  with pytest.raises(ValueError, match="SMEM"):      # 4 rings of 8 slots + 64 latent rows
    rk.TuningConfig(stages=8, tokens_per_cta=64)
  with pytest.raises(ValueError, match="SMEM"):      # fits unfused, not fused
    rk.build(4096, 128, 4096, True, rk.TuningConfig(stages=3, tokens_per_cta=64))
  with pytest.raises(ValueError, match="multiple of 4"):   # H = 16: 4 tokens per q tile
    rk.build(70, 16, 128, True, rk.TuningConfig(tokens_per_cta=6))


@pytest.mark.parametrize("t,h,fused,want", [
    (1, 128, True, (2, 1, 1, 2)),            # (stages, tokens_per_cta, ctas, warpgroups); 2 q tiles: stages 2
    (128, 128, True, (2, 1, 128, 2)),        # one token per CTA; <= SMALL_TPC tokens: 2 warpgroups
    (128, 16, True, (2, 4, 32, 2)),          # H = 16: whole q tiles (4 tokens) per CTA
    (384, 128, True, (3, 3, 132, 2)),        # 5-6 q tiles per CTA: the 3-deep ring
    (2048, 128, True, (3, 16, 132, 4)),      # one CTA per SM: 15 or 16 tokens each
    (4096, 16, False, (3, 32, 132, 4)),      # 31 or 32 tokens each
    (4096, 128, True, (4, 16, 256, 4)),      # H >= 128, T >= 4096: stages = 4, the tokens per CTA that fit
    (4096, 128, False, (4, 32, 132, 4)),
    (8192, 16, True, (2, 64, 132, 4)),       # 60-64 tokens per CTA fit with stages = 2: one wave
    (8192, 128, True, (4, 15, 547, 4)),
    (10 ** 6, 16, True, (2, 64, 15625, 4)),  # many waves of 64-token CTAs
])
def test_default_config_fills_the_gpu_and_fits(t, h, fused, want):
  cfg = rk.default_config(t, h, fused)
  assert (cfg.stages, cfg.tokens_per_cta, cfg.ctas, cfg.warpgroups) == want
  assert rk.grid_for(cfg, t, h, fused) == (cfg.tokens_per_cta, cfg.ctas)
  assert rk.smem_budget(cfg, fused) <= common.SMEM_LIMIT
  assert rk.default_tokens_per_cta(t, h, fused) <= rk.MAX_TPC


@pytest.mark.parametrize("t,h,tpc,ctas", [(4096, 128, 32, 132), (70, 64, 24, 3), (37, 16, 12, 4), (1, 128, 1, 1),
                                           (8192, 16, 64, 132), (333, 32, 6, 57), (10 ** 6, 128, 64, 15625)])
def test_token_ranges_partition_the_tokens(t, h, tpc, ctas):
  """The CTAs' token ranges tile [0, T) in order, each at most tokens_per_cta long and starting on a q tile."""
  g = max(64 // h, 1)
  assert rk.grid_for(rk.TuningConfig(tokens_per_cta=tpc, ctas=ctas, stages=2), t, h, True) == (tpc, ctas)
  c = jnp.arange(ctas, dtype=jnp.int32)
  t0, n = (np.asarray(v) for v in rk._token_range(c, t, h, ctas))
  assert t0[0] == 0 and np.all(t0[1:] == t0[:-1] + n[:-1]) and t0[-1] + n[-1] == t
  assert np.all((n >= 1) & (n <= tpc)) and np.all(t0 % g == 0)


@pytest.mark.parametrize("t,h,fused", [(4096, 128, True), (4096, 128, False), (8192, 16, True), (8192, 128, True),
                                        (128, 128, True), (70, 64, False), (5, 16, True), (10 ** 6, 128, True)])
def test_k_rope_window_is_tile_aligned(t, h, fused):
  """The k_rope rows go by TMA into a swizzled tile, whose (8, 64) tiling Mosaic applies to the GMEM side too: a
  box starting at row t0 reads rows past the 8-row tile t0 // 8 as zeros on the GPU (H200, 2026-11-30: every CTA
  with t0 % 8 != 0 had zero k_rope rows; interpret mode keeps logical layouts and cannot see it). So the window
  starts at a0 = t0 - t0 % 8, and the CTA's rows (tile rows d .. d + n) fit in the loaded span: in one 64-row tile,
  or in two passes (from a0 and a0 + 8) when d + n > 64."""
  cfg = rk.default_config(t, h, fused)
  c = jnp.arange(cfg.ctas, dtype=jnp.int32)
  t0, n = (np.asarray(v) for v in rk._token_range(c, t, h, cfg.ctas))
  d = t0 % 8
  a0 = t0 - d
  span = rk._kr_span(cfg.tokens_per_cta)
  assert np.all(a0 % 8 == 0) and span % 8 == 0 and np.all(d + n <= span) and span <= rk.TILE + 8
  assert np.all(d + n - 8 <= rk.TILE)                      # the second pass (window a0 + 8) reaches the last row
  assert rk._tab_rows(cfg.tokens_per_cta) >= max(span, rk.TILE)
  if (t, h, fused) == (4096, 128, False):
    assert np.any(d > 0)   # the failing H200 grid (132 CTAs, 31-32 tokens; now the unfused default): misaligned CTAs


def test_grid_knobs_derive_each_other():
  cfg = rk.TuningConfig(tokens_per_cta=16)
  assert rk.grid_for(cfg, 4096, 128, True) == (16, 256)
  assert rk.grid_for(rk.TuningConfig(ctas=100), 4096, 128, True) == (41, 100)
  assert rk.grid_for(rk.TuningConfig(ctas=1000), 70, 64, True) == (1, 70)       # at most one CTA per token
  with pytest.raises(ValueError, match="tokens_per_cta"):
    rk.grid_for(rk.TuningConfig(tokens_per_cta=8, ctas=100), 4096, 128, True)  # 41 tokens do not fit in 8
  with pytest.raises(ValueError, match="tokens_per_cta"):
    rk.grid_for(rk.TuningConfig(ctas=10), 4096, 128, True)                     # 410 tokens per CTA > 64


def test_q_tiles_split_by_weight():
  """Contiguous q ranges cover [0, n) exactly; warpgroup 0 gets kv_share / 4 of another warpgroup's share and is
  left out first at small n (it also does the k_rope tile)."""
  for nw in (1, 2, 3, 4):
    for share in (1, 2, 3, 4):
      for n in (0, 1, 2, 3, 7, 64, 129):
        ranges = [tuple(int(v) for v in rk._q_range(jnp.int32(w), nw, share, jnp.int32(n))) for w in range(nw)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])) and all(a <= b for a, b in ranges)
  assert [tuple(int(v) for v in rk._q_range(jnp.int32(w), 4, 3, jnp.int32(2))) for w in range(4)] == [
      (0, 0), (0, 0), (0, 1), (1, 2)]


@pytest.mark.parametrize("fused", [True, False])
def test_gather_tables_default_rule(fused):
  """The op gathers the tables in the kernel at T <= GATHER_TABLES_MAX_TOKENS on a GPU (not in interpret mode,
  which has no inline_mgpu; not above, where the pre-pass path measured faster); an explicit knob wins; the
  config fits in SMEM at every such shape."""
  cut = rk.GATHER_TABLES_MAX_TOKENS
  for t in (1, 7, 64, cut):
    for h in (16, 64, 128):
      cfg = op._kernel_config(t, h, fused)
      assert cfg.gather_tables, (t, h)
      assert rk.smem_budget(cfg, fused) <= common.SMEM_LIMIT
      assert not op._kernel_config(t, h, fused, interpret=True).gather_tables
  assert not op._kernel_config(8, 128, fused, (("gather_tables", False),)).gather_tables
  assert not op._kernel_config(cut + 1, 128, fused).gather_tables
  assert op._kernel_config(4096, 128, fused, (("gather_tables", True),)).gather_tables


def test_interpret_default_caps_warpgroups():
  assert op._kernel_config(4096, 128, True, (), interpret=True).warpgroups == op.INTERPRET_MAX_WARPGROUPS
  assert op._kernel_config(4096, 128, True, (("warpgroups", 4),), interpret=True).warpgroups == 4
  assert op._kernel_config(4096, 128, True, ()).warpgroups == 4


@pytest.mark.parametrize("t", [1, 37, op.PAIRWISE_MAX_T + 88])   # both branches of the duplicate check
def test_last_writer_matches_python_oracle(rng, t):
  num_slots = max(t // 2, 4)                  # many duplicates
  slots = rng.integers(-3, num_slots + 3, size=t).astype(np.int32)   # -3..-1 and >= num_slots: skipped
  want = np.zeros(t, bool)
  seen = set()
  for i in range(t - 1, -1, -1):              # the last token of each in-range slot wins
    s = int(slots[i])
    if 0 <= s < num_slots and s not in seen:
      want[i] = True
      seen.add(s)
  got = np.asarray(jax.jit(op._last_writer, static_argnums=1)(jnp.asarray(slots), num_slots))
  np.testing.assert_array_equal(got, want)


def test_grid_override_takes_a_ring_that_fits():
  """A grid override (ctas / tokens_per_cta) without ``stages`` keeps the default ring only if it still fits in
  SMEM: T = 4096, H = 128 defaults to stages = 4 with 16 tokens per CTA, and 100 CTAs (41 tokens each) need 3."""
  base = op._kernel_config(4096, 128, True)
  assert base.stages == 4
  cfg = op._kernel_config(4096, 128, True, (("ctas", 100),))
  assert (cfg.stages, cfg.ctas) == (3, 100)
  tpc, _ = rk.grid_for(cfg, 4096, 128, True)
  assert rk.smem_budget(cfg, True, tpc) <= common.SMEM_LIMIT
  assert op._kernel_config(4096, 128, True, (("warpgroups", 3),)).stages == 4   # no grid change: ring kept
  with pytest.raises(ValueError, match="SMEM"):     # an explicit ring that cannot fit is reported, not replaced
    rk.grid_for(op._kernel_config(4096, 128, True, (("ctas", 100), ("stages", 8))), 4096, 128, True)


@pytest.mark.parametrize("impl", ["xla", "mosaic"])
def test_unique_slots_promise_skips_the_scan_and_changes_nothing(rng, impl):
  """unique_slots=True (the caller promises distinct valid slots, as unique_indices of a JAX scatter) gives bitwise
  the same cache and q as the default duplicate-slot scan when the slots are distinct (make_case draws a
  permutation, plus -1 / out-of-range entries), and the op jaxpr then has no scan: no [T, T] compare, no scatter-max."""
  case = make_case(rng, 70, 16)
  outs = []
  for unique in (False, True):
    outs.append(mla_pallas.fused_rope_rmsnorm_quantization(
        jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, eps=case.eps,
        kv_scale=case.kv_scale, slots=case.slots, unique_slots=unique, impl=impl, interpret=True))
  for a, b in zip(*outs):
    assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
  num_slots = case.pages.size // 576
  promised = jax.make_jaxpr(lambda s: op._dest_slots(s, num_slots, True, -1))(case.slots)
  scanned = jax.make_jaxpr(lambda s: op._dest_slots(s, num_slots, False, -1))(case.slots)
  assert len(promised.eqns) < len(scanned.eqns)
  with pytest.raises(ValueError, match="unique_slots"):
    mla_pallas.fused_rope_rmsnorm_quantization(
        jnp.asarray(case.pages), case.kv, case.q_rope, case.positions, case.cos, case.sin, case.w, eps=case.eps,
        kv_scale=case.kv_scale, slots=case.slots, unique_slots=1, impl=impl, interpret=True)


@pytest.mark.parametrize("t,h,fused,interleaved,unique,overlap", [
    (1, 128, True, True, False, True), (70, 16, True, False, False, True), (4096, 128, True, True, True, True),
    (128, 128, False, True, False, True), (8192, 16, True, False, False, True), (1, 16, False, False, False, True),
    (256, 128, True, True, False, True), (257, 16, True, False, False, True),
    (8, 128, True, True, False, False), (1, 128, True, False, False, False),   # the first arrangement
])
def test_gather_tables_lowers_for_sm90(t, h, fused, interleaved, unique, overlap):
  """TuningConfig.gather_tables (kernels/rope_tables.py, raw Mosaic GPU: not runnable in interpret mode) lowers
  for sm_90, with the table rows loaded as 16-byte vectors from GMEM in the kernel and no XLA table pre-pass: with
  one writer per slot (T = 1, unique_slots), with the in-kernel duplicate check (T <= 256) or without the cache
  write the op is the kernel alone; with the gather on the last warpgroup (overlap_gather, default) and on
  warpgroup 0 before everything else (the first arrangement). The SMEM it allocates is within the budget. Its numbers are checked on the GPU
  (tests/test_rope_rmsnorm_kernel_gpu.py, bitwise against the pre-pass path)."""
  import re
  s = jax.ShapeDtypeStruct
  tuning = (("gather_tables", True), ("overlap_gather", overlap))
  common_args = [s((t, 576), jnp.bfloat16), s((t, h, 64), jnp.bfloat16), s((t,), jnp.int32),
                 s((4096, 32), jnp.float32), s((4096, 32), jnp.float32), s((512,), jnp.bfloat16),
                 s((), jnp.float32)]
  if fused:
    fn = lambda pages, *a: op._fused_mosaic(pages, *a, interleaved=interleaved, interpret=False, tuning=tuning,
                                            unique_slots=unique)
    low = testing.lower_for_cuda(fn, s((1000, 64, 576), FP8), *common_args, s((), jnp.float32),
                                 s((t,), jnp.int32), arch=(9, 0))
  else:
    fn = lambda *a: op._rope_rmsnorm_mosaic(*a, interleaved=interleaved, interpret=False, tuning=tuning)
    low = testing.lower_for_cuda(fn, *common_args, arch=(9, 0))
  assert low.hlo.count("stablehlo.custom_call") == 1
  cfg = op._kernel_config(t, h, fused, tuning)
  tpc, _ = rk.grid_for(cfg, t, h, fused)
  # 8 items (4 table entries each) per table row, 128 threads, one cos and one sin load per item
  assert low.count(r"llvm\.load .* -> vector<4xf32>") == 2 * -(-rk._tab_rows(tpc) * 8 // 128)
  from mla_pallas.kernels import rope_tables
  small = t <= rope_tables.DEDUPE_MAX_TOKENS
  # the in-kernel duplicate check: every token's slot read as 16-byte vectors (unrolled over T)
  dedupe = fused and not unique and 1 < t and small
  assert low.count(r"llvm\.load .* -> vector<4xi32>") == (-(-t // 4) if dedupe else 0)
  no_prepass = not fused or unique or small
  assert (re.search(r"stablehlo\.(concatenate|gather|scatter|compare)", low.hlo) is None) == no_prepass
  smem = int(re.search(r"dynamic_shared_memory_size %c(\d+)_i32", low.mosaic[0]).group(1))
  assert 0 <= rk.smem_budget(cfg, fused, tpc) - smem <= 3072    # the budget's reserve for barriers and alignment


def test_gather_tables_is_not_available_in_interpret_mode():
  with pytest.raises(NotImplementedError, match="gather_tables"):
    rk.build(8, 128, 0, False, rk.TuningConfig(gather_tables=True), interpret=True)
