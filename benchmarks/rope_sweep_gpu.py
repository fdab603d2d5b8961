"""TuningConfig sweep of the rope/RMSNorm kernel (mla_pallas/kernels/rope_rmsnorm.py) on a GPU: per shape the XLA
path and a device copy of the same bytes, then each variant's op time (pre-pass + kernel), kernel-only time and
pre-pass time (CUPTI, cache donated as in the bench), each checked near-bitwise against the XLA path.

  PYTHONPATH=. python3 benchmarks/rope_sweep_gpu.py OUT_DIR [PLAN]
      PLAN: v3 (default) | small_t | defaults | unique | gather | gather_small | overlap | small_share | small_defaults
            | direct | direct_large | bitmap | direct_defaults | scan

Stops at ROPE_V3_DEADLINE (epoch seconds) if set, printing what it measured so far; writes JSON to OUT_DIR.
Called by benchmarks/rope_v3_gpu.sh.
"""
import json, os, statistics, sys, time
sys.path.insert(0, "tests")
import jax
import jax.numpy as jnp
import numpy as np
from mla_pallas import bench
from mla_pallas.bench_specs import _copy
from mla_pallas.kernels import rope_rmsnorm as rk
from mla_pallas.ops import rope_rmsnorm as op
from _rope_inputs import assert_near_bitwise

deadline = float(os.environ.get("ROPE_V3_DEADLINE", "1e18"))
out_dir = sys.argv[1]
plan_name = sys.argv[2] if len(sys.argv) > 2 else "v3"
KERNEL = "anonymous_mosaic_gpu_kernel"
EPS, KV_SCALE = 1e-6, 1.0
rows = []


def sets_for(spec, shape, n=None):
  shape = spec.shape(shape)
  n = n or min(bench._default_n_inputs(spec, shape), 8)
  sets = [tuple(spec.make_inputs(shape, k)) for k in jax.random.split(jax.random.key(0), n)]
  jax.block_until_ready(sets)
  return shape, sets


def fused(impl, tuning=()):
  """The fused op; a ("unique_slots", True) entry of ``tuning`` is the op's argument, not a TuningConfig knob."""
  unique = dict(tuning).get("unique_slots", False)
  tuning = tuple((k, v) for k, v in tuning if k != "unique_slots")

  def f(pages, kv, q, pos, cos, sin, w, slots, buf):
    if impl == "copy":
      return pages, _copy(buf)
    if impl == "xla":
      return op._fused_jit(pages, kv, q, pos, cos, sin, w, jnp.float32(EPS), jnp.float32(KV_SCALE), slots,
                           interleaved=True, unique_slots=unique)
    return op._fused_mosaic(pages, kv, q, pos, cos, sin, w, jnp.float32(EPS), jnp.float32(KV_SCALE), slots,
                            interleaved=True, interpret=False, tuning=tuning, unique_slots=unique)
  return f


def unfused(impl, tuning=()):
  def f(kv, q, pos, cos, sin, w, buf):
    if impl == "copy":
      return _copy(buf)
    if impl == "xla":
      return op._rope_rmsnorm_jit(kv, q, pos, cos, sin, w, jnp.float32(EPS), interleaved=True)
    return op._rope_rmsnorm_mosaic(kv, q, pos, cos, sin, w, jnp.float32(EPS), interleaved=True, interpret=False,
                                   tuning=tuning)
  return f


def check(f, ref, s, is_fused):
  """Near-bitwise comparison with the XLA path on set 0 (no donation: fresh copies)."""
  try:
    a = jax.jit(f)(*jax.tree.map(jnp.copy, s))
    b = jax.jit(ref)(*jax.tree.map(jnp.copy, s))
    n = 0
    for x, y, what in zip(a, b, ("cache" if is_fused else "kv", "q")):
      n += assert_near_bitwise(np.asarray(x), np.asarray(y), what=what)
    return f"ok ({n} one-step)"
  except AssertionError as e:
    return "MISMATCH " + " ".join(str(e).split())[:160]


def run(op_name, shape, variants):
  spec = bench.get_spec(op_name)
  is_fused = op_name == "fused_rope_rmsnorm_quantization"
  mk = fused if is_fused else unfused
  shape, sets = sets_for(spec, shape)
  label = f"{op_name} T={shape['T']} H={shape['H']}"
  timer = ((lambda f: bench.time_cupti_state(f, sets, (0, 0), iters=20, warmup=2)) if is_fused else
           (lambda f: bench.time_cupti(f, sets, iters=20, warmup=2)))
  base = {}
  for impl in ("copy", "xla"):
    samples, kernels = timer(mk(impl))
    base[impl] = statistics.median(samples)
  print(f"\n{label}: copy {base['copy']:.1f} us, xla {base['xla']:.1f} us ({len(sets)} input sets)", flush=True)
  print(f"  {'tuning -> resolved config':58s} {'op us':>8s} {'kernel':>8s} {'pre':>6s} {'%copy':>6s} "
        f"{'vs xla':>6s}  check", flush=True)
  for tuning in variants:
    if time.time() > deadline:
      print("  (time budget reached: remaining variants skipped)", flush=True)
      return
    t0 = time.time()
    try:
      f = mk("mosaic", tuple(tuning))
      samples, kernels = timer(f)
      tot = statistics.median(samples)
      kern = sum(v for k, v in kernels.items() if k.startswith(KERNEL))
      chk = check(f, mk("xla"), sets[0], is_fused)
      knobs = tuple((k, v) for k, v in tuning if k != "unique_slots")
      dcfg = op._direct_config(shape["T"], knobs)
      if dcfg is not None:
        cfg = dcfg
        resolved = f" -> direct ipt{dcfg.items_per_thread}"
      else:
        cfg = op._kernel_config(shape["T"], shape["H"], is_fused, op._tiled_tuning(knobs))
        tpc, ctas = rk.grid_for(cfg, shape["T"], shape["H"], is_fused, op._num_sms())
        resolved = f" -> wg{cfg.warpgroups} s{cfg.stages} tpc{tpc} ctas{ctas} ks{cfg.kv_share}"
      name = (" ".join(f"{k}={v}" for k, v in tuning) or "default") + resolved
      print(f"  {name:58s} {tot:8.1f} {kern:8.1f} {tot - kern:6.1f} {100 * base['copy'] / tot:5.0f}% "
            f"{base['xla'] / tot:5.2f}x  {chk}  [{time.time() - t0:.0f} s]", flush=True)
      if not tuning:
        print("    kernels (us): " + ", ".join(f"{k} {v:.1f}" for k, v in kernels.items()), flush=True)
      rows.append(dict(op=op_name, shape=shape, tuning=dict(tuning), op_us=tot, kernel_us=kern, copy_us=base["copy"],
                       xla_us=base["xla"], kernels=kernels, check=chk, config=str(cfg)))
    except Exception as e:  # noqa: BLE001
      print(f"  {str(dict(tuning)):58s} error: {type(e).__name__}: {' '.join(str(e).split())[:300]}", flush=True)


F, U = "fused_rope_rmsnorm_quantization", "rope_rmsnorm"
W = lambda **k: tuple(k.items())   # noqa: E731
PLANS = {
    "v3": [   # most important first: the sweep stops at the time budget
        (F, dict(T=4096, H=128), [(), W(warpgroups=3), W(warpgroups=2), W(stages=2), W(stages=4), W(ctas=128),
                                  W(tokens_per_cta=16), W(kv_share=1), W(tokens_per_cta=64, stages=2)]),
        (F, dict(T=8192, H=16), [(), W(tokens_per_cta=32), W(tokens_per_cta=32, stages=3), W(warpgroups=3)]),
        (F, dict(T=128, H=128), [(), W(tokens_per_cta=2), W(tokens_per_cta=4), W(warpgroups=2)]),
        (U, dict(T=4096, H=128), [(), W(warpgroups=3)]),
        (F, dict(T=1, H=128), [(), W(warpgroups=2)]),
        (F, dict(T=8192, H=128), [()]),
    ],
    # Small T (the auto threshold) and the warpgroup count / stages there; stages=4 at the large shapes.
    "small_t": [
        (F, dict(T=1, H=128), [(), W(warpgroups=2), W(warpgroups=1)]),
        (F, dict(T=8, H=128), [(), W(warpgroups=2)]),
        (F, dict(T=32, H=128), [(), W(warpgroups=2)]),
        (F, dict(T=64, H=128), [(), W(warpgroups=2)]),
        (F, dict(T=128, H=16), [(), W(warpgroups=2)]),
        (F, dict(T=1, H=16), [(), W(warpgroups=2)]),
        (F, dict(T=32, H=16), [(), W(warpgroups=2)]),
        (F, dict(T=512, H=128), [(), W(warpgroups=2)]),
        (F, dict(T=1024, H=16), [(), W(warpgroups=2)]),
        (F, dict(T=8192, H=128), [(), W(stages=4)]),
        (U, dict(T=128, H=128), [(), W(warpgroups=2)]),
    ],
}
# The op's default config (after the small-T / deep-ring rules) at the issue-4 shapes and the small-T grid.
PLANS["defaults"] = [(F, dict(T=t, H=h), [()]) for t, h in ((1, 128), (8, 128), (64, 128), (128, 128), (512, 128),
                                                          (4096, 128), (8192, 128), (1, 16), (128, 16), (8192, 16))
                     ] + [(U, dict(T=4096, H=128), [()]), (U, dict(T=128, H=128), [()])]
# unique_slots=True (no duplicate-slot scan in the pre-pass) beside the default, at the issue-4 shapes.
PLANS["unique"] = [(F, dict(T=t, H=h), [(), W(unique_slots=True)])
                   for t, h in ((4096, 128), (8192, 128), (8192, 16), (512, 128), (128, 128), (1, 128))]
# TuningConfig.gather_tables (the kernel builds its table rows itself; at T <= 256 also the duplicate-slot check)
# beside the default, at the small-T grid and the issue-4 large shapes.
G = W(gather_tables=True)
PLANS["gather"] = [(F, dict(T=t, H=h), [(), G]) for t, h in ((1, 128), (8, 128), (64, 128), (128, 128), (256, 128),
                                                             (4096, 128), (8192, 16), (1, 16), (128, 16), (512, 128),
                                                             (8192, 128))
                   ] + [(F, dict(T=4096, H=128), [W(unique_slots=True), G + W(unique_slots=True)]),
                        (U, dict(T=4096, H=128), [(), G]), (U, dict(T=8, H=128), [(), G])]
PLANS["gather_small"] = [(F, dict(T=t, H=h), [(), G]) for t, h in ((1, 128), (8, 128), (64, 128), (128, 128),
                                                                   (256, 128), (128, 16), (4096, 128))
                         ] + [(U, dict(T=8, H=128), [(), G])]
# TuningConfig.overlap_gather (default: the last warpgroup gathers the tables while the latent rows are normalised)
# against the first arrangement (warpgroup 0 gathers before anything else), and 3 warpgroups, at T <= 256.
O = W(overlap_gather=False)
PLANS["overlap"] = [(F, dict(T=t, H=h), [(), O] + ([W(warpgroups=3)] if t <= 8 else []))
                    for t, h in ((1, 128), (8, 128), (64, 128), (128, 128), (256, 128), (1, 16), (8, 16), (128, 16))
                    ] + [(U, dict(T=t, H=128), [(), O]) for t in (1, 8)]
# Warpgroup 0's q share at T <= 8 (kv_share=4: at one token per CTA and H = 128 each warpgroup takes one q tile),
# and a 2-deep ring (16 KB less SMEM); the in-kernel tables (now overlapped) at the large shapes.
PLANS["small_share"] = [(F, dict(T=t, H=h), [(), W(kv_share=4), W(kv_share=4, warpgroups=3), W(stages=2),
                                              W(stages=2, kv_share=4)])
                        for t, h in ((1, 128), (8, 128), (8, 16))
                        ] + [(U, dict(T=t, H=128), [(), W(kv_share=4)]) for t in (1, 8)] + [
                            (F, dict(T=t, H=h), [(), G]) for t, h in ((4096, 128), (8192, 16))]
# The op's defaults at T <= 256 (after the shallow-ring rule), with XLA and a device copy in the same run.
PLANS["small_defaults"] = [(F, dict(T=t, H=h), [()]) for t, h in ((1, 128), (8, 128), (64, 128), (128, 128),
                                                                  (256, 128), (1, 16), (8, 16), (128, 16))
                           ] + [(U, dict(T=t, H=128), [()]) for t in (1, 8)]
# The direct kernel (kernels/rope_direct.py) against the tiled one, and its items_per_thread, from T = 1 to the
# issue-4 large shapes (where it is not the default).
D, TL = W(kernel="direct"), W(kernel="tiled")
PLANS["direct"] = [(F, dict(T=t, H=h), [TL, D, D + W(items_per_thread=4)])
                   for t, h in ((1, 128), (8, 128), (64, 128), (128, 128), (256, 128), (1, 16), (8, 16), (128, 16))
                   ] + [(U, dict(T=t, H=h), [TL, D, D + W(items_per_thread=4)])
                        for t, h in ((1, 128), (8, 128), (64, 128), (256, 128), (8, 16))
                        ] + [(F, dict(T=t, H=h), [(), D + W(items_per_thread=4), D + W(items_per_thread=8),
                                                  D + W(items_per_thread=4, unique_slots=True)])
                             for t, h in ((512, 128), (4096, 128), (8192, 16))
                             ] + [(U, dict(T=4096, H=128), [(), D + W(items_per_thread=4)])]
# The direct kernel's default (in-kernel bitmap duplicate check above T = 256) against the XLA pre-pass check,
# unique_slots and the tiled kernel at the issue-4 large shapes; small H (auto's threshold); T = 20000.
NB = W(bitmap_dedupe=False)
PLANS["direct_large"] = [
    (F, dict(T=4096, H=128), [(), NB, W(unique_slots=True), TL]),
    (F, dict(T=8192, H=16), [(), NB, W(unique_slots=True), W(items_per_thread=2), W(items_per_thread=8), TL]),
    (F, dict(T=8192, H=128), [(), W(unique_slots=True), TL]),
    (U, dict(T=8192, H=128), [(), TL]),
    (F, dict(T=512, H=128), [(), NB]),
    (F, dict(T=1024, H=16), [(), TL]),
    (F, dict(T=1, H=8), [(), TL]), (F, dict(T=4096, H=8), [(), TL]), (F, dict(T=1, H=1), [()]),
    (F, dict(T=20000, H=16), [D, TL]),
]
# The bitmap mode's kv CTA shape (tokens per CTA, tokens in flight per warp, scan unroll) against unique_slots.
PLANS["bitmap"] = [(F, dict(T=t, H=h), [W(unique_slots=True), (), W(bitmap_group=2), W(bitmap_group=1),
                                        W(bitmap_tokens=16, bitmap_group=1), W(bitmap_tokens=16, bitmap_group=2,
                                                                               scan_unroll=4),
                                        W(bitmap_tokens=64, bitmap_group=2), W(bitmap_group=1, items_per_thread=8)])
                   for t, h in ((8192, 16), (8192, 128), (4096, 128), (512, 128))]
# The op's defaults after the direct kernel (2026-11-30j): every issue-4 shape, XLA and a device copy in the same run.
PLANS["direct_defaults"] = [(F, dict(T=t, H=h), [()]) for t, h in (
    (1, 128), (8, 128), (64, 128), (128, 128), (256, 128), (512, 128), (4096, 128), (8192, 128),
    (1, 16), (8, 16), (128, 16), (1024, 16), (8192, 16))] + [
    (U, dict(T=t, H=h), [()]) for t, h in ((1, 128), (8, 128), (64, 128), (256, 128), (4096, 128), (8192, 128),
                                           (8, 16), (8192, 16))]
# Where the duplicate-slot check should switch from one warp's scan of the later slots per token to the bitmap.
PLANS["scan"] = [(F, dict(T=t, H=h), [(), W(warp_scan_max_tokens=1024), W(warp_scan_max_tokens=2048),
                                      W(warp_scan_max_tokens=8192), W(unique_slots=True)])
                 for t, h in ((512, 128), (1024, 16), (1024, 128), (2048, 16), (4096, 16), (4096, 128), (8192, 16))]
PLAN = PLANS[plan_name]
for op_name, shape, variants in PLAN:
  if time.time() > deadline:
    print(f"\n(time budget reached: {op_name} {shape} skipped)", flush=True)
    continue
  run(op_name, shape, variants)

# The duplicate-slot pre-pass (ops.rope_rmsnorm._last_writer): all pairs vs scatter-max, 2T slots.
if plan_name == "v3" and time.time() < deadline:
  print("\n_last_writer (us, CUPTI): T, pairwise, scatter-max", flush=True)
  for t in (512, 1024, 4096, 8192):
    slots = jax.random.permutation(jax.random.key(1), 2 * t)[:t].astype(jnp.int32)
    res = []
    for pmax in (10 ** 9, 0):
      f = lambda s, pmax=pmax: op._last_writer(s, 2 * t, pairwise_max_t=pmax)   # noqa: E731
      samples, _ = bench.time_cupti(f, [(slots,)], iters=20, warmup=2)
      res.append(statistics.median(samples))
    print(f"  T={t}: {res[0]:.1f} / {res[1]:.1f}", flush=True)
    rows.append(dict(op="_last_writer", T=t, pairwise_us=res[0], scatter_us=res[1]))

path = os.path.join(out_dir, f"rope_sweep_{plan_name}-{time.strftime('%Y%m%d-%H%M%S')}.json")
with open(path, "w") as fh:
  json.dump(dict(device=str(jax.devices()[0].device_kind), rows=rows), fh, indent=1, default=str)
print(f"\nwrote {path}")