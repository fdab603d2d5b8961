"""The sm_100a (Blackwell) sparse decode kernel on the CPU: interpret mode and lowering for CUDA at sm_100a.

No Blackwell GPU has run this kernel. What is checked here:

* interpret mode (``_dispatch.gpu_arch`` faked to (10, 0), so ``sparse_mla_decode(..., impl="mosaic",
  interpret=...)`` picks the sm_100 kernel): the whole kernel (warp-specialised pipeline, tcgen05 MMAs into TMEM,
  O correction in TMEM, masking, split-KV) against the reference, with race detection on one case. The one
  difference from hardware: the interpreter has no TMA gather4, so the loader gathers with one TMA per row and
  64-byte chunk into the same linear buffer (``sparse_decode_sm100._gather``).
  H = 128 (two query tiles, i.e. two CTAs, per token) runs in a subprocess with 4 host devices: with the default
  single host device its interpretation stalls on a 2-core machine (XLA:CPU thread starvation, see the test).
* lowering for CUDA at sm_100a (every Python-side Mosaic GPU pass: layouts, tcgen05 shape/swizzle rules, TMA
  gather4, TMEM loads and stores), with instruction counts.
* the TuningConfig checks and the implementation choice on a (faked) Blackwell device.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import mla_pallas
from mla_pallas import _dispatch, reference, testing
from mla_pallas.kernels import common
from mla_pallas.kernels import sparse_decode_sm100 as sm100
from mla_pallas.ops import sparse_decode as sd

from _sparse_inputs import FP8, logit_std, make_case

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def blackwell(monkeypatch):
  """Make the dispatcher see a compute-capability-10.0 device (interpret mode then runs the sm_100 kernel)."""
  monkeypatch.setattr(_dispatch, "gpu_arch", lambda: (10, 0))
  calls = []
  real_build = sm100.build

  def build(*a, **kw):
    calls.append(a)
    return real_build(*a, **kw)
  monkeypatch.setattr(sm100, "build", build)
  sd._sparse_decode_jit.clear_cache()     # the kernel must be traced (and built) again under the fake arch
  yield calls
  sd._sparse_decode_jit.clear_cache()


def _run(case, impl, interpret=False):
  return mla_pallas.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=case.softmax_scale,
                                      kv_scale=case.kv_scale, topk_length=case.topk_length, impl=impl,
                                      interpret=interpret)


@pytest.mark.parametrize("B,s_q,H,topk,page,tl,races", [
    pytest.param(1, 1, 16, 67, 16, False, True, id="H16-2tiles-races"),    # tail of 3 keys; race detection
    pytest.param(2, 1, 64, 130, 64, True, False, id="H64-3tiles-topk_length"),   # odd tile count, ring wrap
    pytest.param(1, 1, 64, 64, 16, False, False, id="H64-1tile"),          # a single tile (no pair loop)
    pytest.param(1, 2, 8, 77, 128, False, False, id="H8-s_q2-page128"),    # MTP; token with no valid index
    pytest.param(1, 1, 32, 512, 16, False, False, id="H32-split"),         # 2 splits of 4 tiles + combine
])
def test_sm100_kernel_interpret_matches_reference(rng, blackwell, B, s_q, H, topk, page, tl, races):
  case = make_case(rng, B=B, s_q=s_q, H=H, topk=topk, page_size=page, num_pages=max(8, 1024 // page),
                   with_topk_length=tl)
  params = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=races)
  out, lse = _run(case, "mosaic", interpret=params)
  assert blackwell, "the sm_100 kernel was not built"
  assert _dispatch.last_impl("sparse_mla_decode") == "mosaic-interpret"
  if races:
    assert not testing.races_found(), "the interpreter found a data race in the kernel"
  ref_out, ref_lse = reference.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=case.softmax_scale,
                                                 kv_scale=case.kv_scale, topk_length=case.topk_length)
  # Q and P rounded to e4m3 (as in the XLA path); interpret mode computes the fp8 products exactly.
  budget = testing.fp8_error_budget(split_partials_bf16=True, logit_std=logit_std(case), pv_length=topk, fp8_mma=False)
  testing.assert_close_fp8(out, ref_out, rel_l2=budget, min_cos=0.99, what="out")
  testing.assert_close_fp8(lse, ref_lse, rel_l2=None, max_abs=0.1, what="lse")
  assert np.all(np.asarray(out, np.float32)[~np.isfinite(np.asarray(ref_lse))] == 0.0)
  assert not np.isnan(np.asarray(out, np.float32)).any(), "NaN leaked from a masked cache row"
  # Same quantization of Q and P as the XLA path: they differ by f32 summation order and the e4m3 rounding of
  # the few P entries that flips.
  xla_out, _ = _run(case, "xla")
  testing.assert_close_fp8(out, xla_out, rel_l2=0.02, what="sm100 kernel vs XLA path")


def _lower(H, s_q, topk, splits, stages=2, num_slots=4096):
  tiles_per_token = max(1, H // 64)
  n_tok = 2 * s_q
  tps = -(-topk // (64 * splits))
  cfg = sm100.TuningConfig(tiles_per_split=tps, stages=stages)
  kern = sm100.build(n_tok * tiles_per_token, n_tok, num_slots, splits, tiles_per_token,
                     sd._partials_dtype(splits, bf16_cache=False), cfg)     # the op's choice: bf16 partials
  S = jax.ShapeDtypeStruct
  low = testing.lower_for_cuda(kern, S((n_tok * tiles_per_token, 64, 576), FP8),
                               S((n_tok * tiles_per_token, 64), jnp.float32), S((num_slots, 576), FP8),
                               S((n_tok, splits * tps, 64), jnp.uint32), S((1,), jnp.float32), arch=(10, 0))
  return low, tps


@pytest.mark.parametrize("H,s_q,topk,splits,stages", [
    (64, 1, 2048, 1, 2),
    (8, 2, 2051, 1, 2),       # 33 tiles: odd tail
    (128, 2, 256, 2, 2),      # two query tiles per token, split-KV (bf16 partial outputs)
    (64, 1, 1024, 4, 1),      # one linear stage
])
def test_sm100_kernel_lowers(H, s_q, topk, splits, stages):
  """Every Python-side Mosaic GPU pass at sm_100a; count the FP8 MMAs, gathers and TMEM accesses emitted."""
  low, tps = _lower(H, s_q, topk, splits, stages)
  odd = tps % 2
  # QK^T call sites: 2 in the pair loop (+1 tail); each K = 576 in 32-byte swizzle steps (18) x 2 TMEM lane
  # groups (M = 64). P.V call sites: 2 in the loop + the last one (+1 tail); 4 O blocks x 2 k-steps x 2.
  assert low.count(r"tcgen05\.mma\.cta_group::1\.kind::f8f6f4") == (2 + odd) * 36 + (3 + odd) * 16
  # gather4: prologue sites (min(stages, tiles)) + the refill loop (emitted even when it runs 0 times); 9 chunks x
  # 4 registers of 4 indices each (TMA_INDICES: the 64 indices spread over 4 warps).
  sites = min(stages, tps) + 1
  assert low.count(r"tile::gather4") == sites * 9 * 4
  assert low.count(r"tcgen05\.ld") > 0 and low.count(r"tcgen05\.st") > 0
  assert low.count(r"tcgen05\.commit") > 0


def test_tuning_config_rejects_bad_values():
  with pytest.raises(ValueError, match="stages"):
    sm100.TuningConfig(stages=0)
  with pytest.raises(ValueError, match="SMEM"):
    sm100.TuningConfig(stages=3)           # 3 linear stages do not fit next to Q and two swizzled KV tiles
  with pytest.raises(ValueError, match="tiles_per_split"):
    sm100.TuningConfig(tiles_per_split=300)
  assert sm100.smem_budget(sm100.TuningConfig()) <= common.SMEM_LIMIT


def test_blackwell_dispatch(rng, blackwell):
  """On a compute-capability-10.x device impl='auto' never runs the unvalidated sm_100 kernel; 'mosaic' would."""
  case = make_case(rng, B=1, s_q=1, H=8, topk=4)
  assert _dispatch.mosaic_arch() == "sm100"
  _run(case, "auto")
  assert _dispatch.last_impl("sparse_mla_decode") == "xla"
  assert not blackwell
  used = _dispatch.choose("sparse_mla_decode", "mosaic", interpret=False, validated_on=sd.VALIDATED_ON,
                          supported=sd._kernel_supported(case.q.shape, 512, False))
  assert used == "mosaic"
  with pytest.raises(NotImplementedError, match="H="):
    sd._kernel_supported((1, 1, 12, 576), 512, False)()


H128_SCRIPT = textwrap.dedent("""
    import sys
    sys.path.insert(0, "tests")
    import jax, jax.numpy as jnp, numpy as np
    from mla_pallas import _dispatch, reference, testing
    from mla_pallas.ops import sparse_decode as sd
    from _sparse_inputs import logit_std, make_case
    _dispatch.gpu_arch = lambda: (10, 0)          # the dispatcher sees a Blackwell device: sm_100 kernel
    case = make_case(np.random.default_rng(int(sys.argv[1])), B=1, s_q=1, H=128, topk=130, page_size=16,
                     num_pages=64)
    args = (case.q, case.kv.reshape(-1, 576), case.indices, jnp.float32(case.kv_scale), None)
    out, lse = sd._sparse_decode_jit(*args, softmax_scale=case.softmax_scale, impl="mosaic", interpret=True,
                                     arch="sm100")
    ref_out, ref_lse = reference.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=case.softmax_scale,
                                                   kv_scale=case.kv_scale)
    budget = testing.fp8_error_budget(split_partials_bf16=True, logit_std=logit_std(case), pv_length=130, fp8_mma=False)
    testing.assert_close_fp8(out, ref_out, rel_l2=budget, min_cos=0.99, what="out")
    testing.assert_close_fp8(lse, ref_lse, rel_l2=None, max_abs=0.1, what="lse")
    xla_out, _ = sd._sparse_decode_jit(*args, softmax_scale=case.softmax_scale, impl="xla", interpret=False)
    testing.assert_close_fp8(out, xla_out, rel_l2=0.02, what="sm100 kernel vs XLA path")
    print("H128 OK")
""")


def test_sm100_kernel_interpret_h128_two_ctas_per_token(rng):
  """H = 128: two query tiles (two CTAs) per token, top-k 130 (3 tiles, a tail of 2 keys).

  Run in a subprocess with 4 host devices: on a 2-core machine the interpreted kernel stalls in the first CTA
  with the re-swizzle/MMA warpgroup's thread never reaching its first barrier while the other two block in
  barrier-wait callbacks (thread starvation of XLA:CPU's pool, not a protocol deadlock: the same kernel passes
  once the host platform has more devices, hence more threads). XLA_FLAGS must be set before JAX starts.
  """
  flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()
  env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, "-c", H128_SCRIPT, str(int(rng.integers(2 ** 31)))], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0 and "H128 OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]
