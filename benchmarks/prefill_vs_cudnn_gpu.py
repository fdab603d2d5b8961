"""mla_prefill on the H200: CUPTI device time of the old float32 XLA path, the op (cuDNN backend) and a bare
jax.nn.dot_product_attention(implementation="cudnn") on the same data (V zero-padded to Dqk, [B, S, H, D]), for two
causal sequences of 4096 tokens (packed layout) and one of 8192 (the op's non-packed call), DeepSeek-V3.2 (H128,
qk 192, v 128) and GLM-5 (H64, 256/256); for Dv != Dqk also cuDNN's MLA call on the unpadded V. Checked for
correctness first (op vs the float32 path, bare vs op). Prints a table and the ratio op / cuDNN (goal <= 1.2).

Usage (repository root, on the GPU):  PYTHONPATH=. python3 benchmarks/prefill_vs_cudnn_gpu.py [--iters 20]   (numbers: benchmarks/CURRENT.md)
Every row is guarded (an error prints and the script goes on); a watchdog ends the script after --budget seconds.
"""
from __future__ import annotations

import argparse
import faulthandler
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from mla_pallas.ops import prefill as pf
from mla_pallas.ops.prefill import mla_prefill

U = 2.0 ** -8
SHAPES = {"DeepSeek-V3.2": (128, 192, 128), "GLM-5": (64, 256, 256)}
LAYOUTS = "2x4096,1x8192"  # sequences x tokens per sequence


def cupti_ms(fn, args, iters):
  from jax.experimental.mosaic.gpu import profiler
  _, times = profiler.measure(fn, aggregate=True, iterations=iters)(*args)
  if times is None:
    raise RuntimeError("CUPTI recorded no kernel launches")
  times = times if isinstance(times, list) else [times]
  return statistics.median(times)


def wall_ms(fn, args, iters):
  jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(iters):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append((time.perf_counter() - t0) * 1e3)
  return statistics.median(samples)


def rel_l2(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def flops(h, dqk, dv, causal_pairs):
  return 2.0 * h * causal_pairs * (dqk + dv)


def diagnose(q, k, v, cu, scale):
  """After a failure of the op: the packed cuDNN call with the other mask types, to say which one cuDNN takes."""
  from jax._src.cudnn import fused_attention_stablehlo as fa
  for mask in ("CAUSAL", "NO_MASK", "PADDING_CAUSAL"):
    def attend(q4, k4, v4, lens, offsets, *, scale, causal, mask=mask):
      return fa.dot_product_attention(q4, k4, v4, None, None, lens, lens, offsets, offsets, scale=scale,
                                      mask_type=fa.MaskType[mask], qkv_layout="BTNH", return_residual=True)
    try:
      out, lse = pf._cudnn_jit(q, k, v, cu, jnp.float32(scale), causal=True, scale=scale, attend=attend)
      r_out, r_lse = pf._f32_jit(q, k, v, cu, jnp.float32(scale), causal=True)
      print(f"  diagnose: packed cuDNN with mask {mask}: rel-L2 {rel_l2(out, r_out):.2e} "
            f"lse max abs {float(jnp.max(jnp.abs(lse - r_lse))):.2e}", flush=True)
    except Exception as e:                                      # noqa: BLE001
      print(f"  diagnose: packed cuDNN with mask {mask}: {type(e).__name__}: {str(e)[:300]}", flush=True)


def run_shape(name, h, dqk, dv, iters, rows, nseq, seq):
  t = seq * nseq
  name = f"{name} {nseq}x{seq}"
  scale = dqk ** -0.5
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (t, h, dqk), jnp.bfloat16)
  k = jax.random.normal(kk, (t, h, dqk), jnp.bfloat16)
  v = jax.random.normal(kv, (t, h, dv), jnp.bfloat16)
  cu = jnp.arange(nseq + 1, dtype=jnp.int32) * seq
  print(f"\n== {name}: T = {nseq} x {seq} causal, H {h}, qk {dqk}, v {dv}; backend {pf.xla_backend(q, k, v, cu)} "
        f"({pf._backend_reason(q, k, v, cu) or 'cuDNN'})", flush=True)
  qb, kb = q.reshape(nseq, seq, h, dqk), k.reshape(nseq, seq, h, dqk)
  vb = jnp.pad(v, ((0, 0), (0, 0), (0, dqk - dv))).reshape(nseq, seq, h, dqk)

  f32 = jax.jit(lambda q, k, v, cu: pf._f32_jit(q, k, v, cu, jnp.float32(scale), causal=True))
  op = jax.jit(lambda q, k, v, cu: mla_prefill(q, k, v, cu, softmax_scale=scale, causal=True, impl="xla"))
  bare = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                              implementation="cudnn"))
  bare_lse = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                                  implementation="cudnn", return_residual=True))
  fns = {"float32 XLA path (old)": (f32, (q, k, v, cu), 3),
         "mla_prefill (cuDNN backend)": (op, (q, k, v, cu), iters),
         "bare cuDNN (V padded)": (bare, (qb, kb, vb), iters),
         "bare cuDNN + lse (bf16)": (bare_lse, (qb, kb, vb), iters)}
  if dv != dqk:
    vu = v.reshape(nseq, seq, h, dv)
    padded = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, dqk - dv))), scale=scale, is_causal=True,
        implementation="cudnn")[..., :dv])
    fns["cuDNN incl. V pad + out slice"] = (padded, (qb, kb, vu), iters)
    from jax._src.cudnn import fused_attention_stablehlo as fa
    mla = jax.jit(lambda q, k, v: fa.dot_product_attention(
        q, k, v, None, None, None, None, None, None, scale=scale, mask_type=fa.MaskType.CAUSAL, qkv_layout="BTNH"))
    fns["bare cuDNN MLA (V unpadded)"] = (mla, (qb, kb, vu), iters)

  ok = False
  try:
    r_out, r_lse = f32(q, k, v, cu)
    o_out, o_lse = op(q, k, v, cu)
    e_op, e_lse = rel_l2(o_out, r_out), float(jnp.max(jnp.abs(o_lse - r_lse)))
    fin = bool(jnp.all(jnp.isfinite(o_out.astype(jnp.float32)))) and bool(jnp.all(jnp.isfinite(o_lse)))
    # error model of tests/test_prefill_gpu.py: rel-L2 <= 3u against f32 math on the same inputs
    ok = fin and e_op <= 3 * U and e_lse <= 1e-3
    print(f"check: op vs float32 path rel-L2 {e_op:.2e}, lse max abs {e_lse:.2e}, finite {fin} -> "
          f"{'OK' if ok else 'FAILED'}", flush=True)
    b_out = bare(qb, kb, vb).reshape(t, h, dqk)[..., :dv]
    e_bare = rel_l2(b_out, o_out)
    ok = ok and e_bare <= 3 * U
    print(f"check: bare cuDNN vs op rel-L2 {e_bare:.2e}", flush=True)
  except Exception:                                             # noqa: BLE001 - report and go on
    traceback.print_exc()
    diagnose(q, k, v, cu, scale)
  pairs = nseq * seq * (seq + 1) / 2
  res = {}
  for label, (fn, args, n) in fns.items():
    try:
      dev = cupti_ms(fn, args, n)
      wall = wall_ms(fn, args, min(n, 10))
      res[label] = dev
      fl = flops(h, dqk, dv, pairs)                             # useful work (V's padding not counted)
      rows.append((name, label, dev, wall, fl / dev / 1e9, ok))
      print(f"  {label:30s} device {dev:9.3f} ms   wall {wall:9.3f} ms   {fl / dev / 1e9:7.1f} TFLOP/s", flush=True)
    except Exception:                                           # noqa: BLE001
      print(f"  {label}: FAILED", flush=True)
      traceback.print_exc()
  a, b = res.get("mla_prefill (cuDNN backend)"), res.get("bare cuDNN (V padded)")
  if a and b:
    print(f"  ratio op / bare cuDNN = {a / b:.3f} (goal <= 1.2); old float32 / op = "
          f"{res.get('float32 XLA path (old)', float('nan')) / a:.1f}x", flush=True)
  m = res.get("bare cuDNN MLA (V unpadded)")
  if a and m:
    print(f"  ratio op / bare cuDNN MLA (V unpadded) = {a / m:.3f}", flush=True)
  c = res.get("cuDNN incl. V pad + out slice")
  if a and c:
    print(f"  ratio op / (cuDNN incl. V pad + out slice) = {a / c:.3f}", flush=True)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--iters", type=int, default=20)
  ap.add_argument("--layouts", default=LAYOUTS, help="comma-separated NSEQxSEQ (smaller: a smoke test)")
  ap.add_argument("--heads", type=float, default=1.0, help="scale the head counts (smoke test)")
  ap.add_argument("--budget", type=int, default=240, help="watchdog: seconds before the script is ended")
  args = ap.parse_args()
  faulthandler.dump_traceback_later(args.budget, exit=True)
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, cuDNN {pf._cudnn_version()}", flush=True)
  rows = []
  for layout in args.layouts.split(","):
    nseq, seq = (int(x) for x in layout.split("x"))
    for name, (h, dqk, dv) in SHAPES.items():
      run_shape(name, max(1, int(h * args.heads)), dqk, dv, args.iters, rows, nseq, seq)
  print("\n| shape | path | device ms (median) | wall ms | TFLOP/s | checked |\n|---|---|---|---|---|---|")
  for name, label, dev, wall, tf, ok in rows:
    print(f"| {name} | {label} | {dev:.3f} | {wall:.3f} | {tf:.0f} | {'yes' if ok else 'NO'} |")
  faulthandler.cancel_dump_traceback_later()
  return 0


if __name__ == "__main__":
  sys.exit(main())
