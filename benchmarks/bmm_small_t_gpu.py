"""One-call GPU session for quantize_and_bmm_fp8 at decode sizes: CUPTI timings of XLA, the kernel with the XLA
quantization pre-pass (``quantize_k=None``) and with in-kernel quantization (``quantize_k=K``), same run.

  PYTHONPATH=. python3 benchmarks/bmm_small_t_gpu.py [--tokens 1,8,64,128,256] [--iters 50] [--shapes 0,2]
      [--variants "stages=2;max_ctas=256+stages=2"]

``--variants``: extra kernel configs (TuningConfig overrides, ``name=value`` joined by ``+``, separated by ``;``;
``default``: none), each timed beside the op's default config and checked bitwise against it.

Every timed variant is first compared with the XLA path (bitwise for the two kernel variants: same fp8 operands).
Prints one line per (shape, T) and writes JSON to $OUT (or results/).
"""
import argparse
import datetime
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from mla_pallas import bench, quant
from mla_pallas.ops import bmm_fp8 as B

# (name, H, K, N): q_nope @ W_UK and o_latent @ W_UV of DeepSeek-V3.2 (H 128) and GLM-5 (H 64)
SHAPES = [("deepseek W_UK", 128, 128, 512), ("deepseek W_UV", 128, 512, 128),
          ("glm5 W_UK", 64, 192, 512), ("glm5 W_UV", 64, 512, 256)]


def inputs(t, h, k, n, seed=0):
  ka, kw = jax.random.split(jax.random.key(seed))
  a = jax.random.normal(ka, (t, h, k), jnp.bfloat16)
  w8, ws = quant.quantize_blocks_fp8(jax.random.normal(kw, (h, k, n), jnp.float32) * k ** -0.5)
  return a, B.prepare_weight(w8), ws


def _val(v):
  import ast
  try:
    return ast.literal_eval(v)
  except (ValueError, SyntaxError):
    return v


def main():
  p = argparse.ArgumentParser()
  p.add_argument("--tokens", default="1,8,64,128,256")
  p.add_argument("--iters", type=int, default=50)
  p.add_argument("--shapes", default="0,1,2,3", help="indices into SHAPES")
  p.add_argument("--variants", default="")
  args = p.parse_args()
  pair = not args.variants      # without --variants: the pre-pass and in-kernel quantization paths side by side
  variants = [tuple((kv.split("=")[0], _val(kv.split("=")[1])) for kv in v.split("+"))
              for v in args.variants.split(";") if v and v != "default"]
  out_dir = os.environ.get("OUT", "results")
  os.makedirs(out_dir, exist_ok=True)
  rows = []
  for name, h, k, n in [SHAPES[int(i)] for i in args.shapes.split(",")]:
    for t in map(int, args.tokens.split(",")):
      sets = [inputs(t, h, k, n, seed) for seed in range(2)]
      fns = {"xla": lambda a, w, s: B._bmm_jit(a, w, s, act_scale="per_token", weight_layout="hnk", impl="xla")}
      for label, qk in ((("kernel+prepass", None), ("kernel fused-quant", k)) if pair else ()):
        try:
          B._kernel_config(n, (("quantize_k", qk),))
        except ValueError as e:      # does not fit in SMEM
          print(f"{name} T={t} {label}: skipped ({str(e)[-40:]})")
          continue
        fns[label] = (lambda qk: lambda a, w, s: B._bmm_jit(a, w, s, act_scale="per_token", weight_layout="hnk",
                                                             impl="mosaic", tuning=(("quantize_k", qk),)))(qk)
      fns["kernel default"] = lambda a, w, s: B._bmm_jit(a, w, s, act_scale="per_token", weight_layout="hnk",
                                                         impl="mosaic")
      for v in variants:
        fns["kernel " + "+".join(f"{a}={b}" for a, b in v)] = (
            lambda v: lambda a, w, s: B._bmm_jit(a, w, s, act_scale="per_token", weight_layout="hnk",
                                                 impl="mosaic", tuning=v))(v)
      ref = np.asarray(jax.jit(fns["xla"])(*sets[0]), np.float32)
      res = {}
      for label, f in fns.items():
        try:
          got = np.asarray(jax.jit(f)(*sets[0]), np.float32)
        except Exception as e:  # noqa: BLE001 -- a variant that does not build/fit: report and go on
          print(f"{name} T={t} {label}: {type(e).__name__}: {' '.join(str(e).split())[:160]}", flush=True)
          continue
        rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        samples, kernels = bench.time_cupti(f, sets, iters=args.iters, warmup=2)
        res[label] = dict(us=float(np.median(samples)), rel_vs_xla=rel, kernels=kernels,
                          bitwise_vs_prepass=None)
      if "kernel default" in res:
        d = np.asarray(jax.jit(fns["kernel default"])(*sets[1]), np.float32)
        for label in res:
          if label.startswith("kernel ") and label != "kernel default":
            res[label]["bitwise_vs_default"] = bool(np.array_equal(
                np.asarray(jax.jit(fns[label])(*sets[1]), np.float32), d))
      if "kernel+prepass" in fns and "kernel fused-quant" in fns:
        a = np.asarray(jax.jit(fns["kernel+prepass"])(*sets[1]), np.float32)
        b = np.asarray(jax.jit(fns["kernel fused-quant"])(*sets[1]), np.float32)
        res["kernel fused-quant"]["bitwise_vs_prepass"] = bool(np.array_equal(a, b))
      x = res["xla"]["us"]
      line = f"{name:14s} T={t:5d} H={h} {k}->{n}: xla {x:7.1f} us"
      for label, r in res.items():
        if label != "xla":
          extra = [f"rel {r['rel_vs_xla']:.1e}"]
          if r["bitwise_vs_prepass"] is not None:
            extra.append(f"bitwise {r['bitwise_vs_prepass']}")
          if "bitwise_vs_default" in r:
            extra.append(f"= default {r['bitwise_vs_default']}")
          line += f" | {label} {r['us']:7.1f} us ({x / r['us']:.2f}x, {', '.join(extra)})"
      print(line, flush=True)
      rows.append(dict(shape=name, T=t, H=h, K=k, N=n, results=res))
  dev = jax.devices()[0]
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
  with open(os.path.join(out_dir, f"bmm_small_t-{stamp}.json"), "w") as f:
    json.dump(dict(device=dev.device_kind, jax=jax.__version__, iters=args.iters, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()
