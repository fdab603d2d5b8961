"""One-call GPU session for the sm_90 sparse decode kernel: correctness sweep + CUPTI timings beside XLA.

  PYTHONPATH=. python benchmarks/sm90_sparse_decode_gpu.py [--check] [--bench] [--cases a,b,c]

Prints one line per case; writes JSON to $OUT (or results/) when set.
"""
import argparse, json, os, statistics, sys, time

import jax
import jax.numpy as jnp
import numpy as np

from mla_pallas.ops import sparse_decode as sd

F8 = jnp.float8_e4m3fn
# VARIANTS: comma-separated TuningConfig overrides, "name=value+name=value" each; "default" for none.
# Separated by ";" instead when any value holds a comma (e.g. v_owners=((),(0,1,2,3))).
_V = os.environ.get("VARIANTS", "default")
VARIANTS = _V.split(";" if ";" in _V else ",")


def _tuning(spec):
  if spec in ("", "default"):
    return ()
  import ast
  def val(v):
    try:
      return ast.literal_eval(v)
    except (ValueError, SyntaxError):
      return v
  return tuple((k, val(v)) for k, v in (kv.split("=") for kv in spec.split("+")))
ABLATE = [a for a in os.environ.get("ABLATE", "").split(",") if a]
INTERPRET = os.environ.get("INTERPRET", "0") == "1"     # CPU dry run of --check (first case only)


def ref64(q, kv8, idx, scale, kv_scale=1.0):
  qf = np.asarray(q, np.float64)
  kvf = np.asarray(kv8.astype(jnp.float32), np.float64) * kv_scale
  B, S, H, _ = qf.shape
  n = kvf.shape[0]
  out = np.zeros((B, S, H, 512)); lse = np.full((B, S, H), -np.inf)
  for b in range(B):
    for s in range(S):
      v = [i for i in idx[b, s] if 0 <= i < n]
      if not v:
        continue
      k = kvf[v]; lg = qf[b, s] @ k.T * scale
      m = lg.max(-1, keepdims=True); p = np.exp(lg - m); l = p.sum(-1, keepdims=True)
      out[b, s] = p @ k[:, :512] / l; lse[b, s] = (m + np.log(l))[:, 0]
  return out, lse


def stats(o, r):
  o = np.asarray(o, np.float64); r = np.asarray(r, np.float64)
  d = o - r
  rel = np.linalg.norm(d) / max(np.linalg.norm(r), 1e-30)
  cos = float((o * r).sum() / max(np.linalg.norm(o) * np.linalg.norm(r), 1e-30))
  return rel, float(np.abs(d).max()), cos


def check(B, S, H, K, N, seed, invalid=True):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((B, S, H, 576)), jnp.bfloat16)
  kv = rng.standard_normal((N, 576)).astype(np.float32)
  kv[N // 2:] = np.nan                      # unused rows poisoned
  kv8 = jnp.asarray(kv).astype(F8)
  idx = rng.integers(0, N // 2, (B, S, K)).astype(np.int32)
  if invalid:
    idx[0, 0, :5] = [-1, N, N + 7, -100, idx[0, 0, 5]]     # invalid + duplicate
    if B > 1:
      idx[1, 0, :] = -1                       # all-invalid row
  scale = 192 ** -0.5
  o_r, lse_r = ref64(q, kv8, idx, scale)
  res = {}
  variants = [(f"mosaic[{v}]", "mosaic", _tuning(v)) for v in VARIANTS] + [("xla", "xla", ())]
  for name, impl, tuning in variants:
    def run():
      return sd._sparse_decode_jit(q, kv8.reshape(-1, 576), jnp.asarray(idx), jnp.float32(1.0), None,
                                   softmax_scale=scale, impl=impl, interpret=INTERPRET, tuning=tuning)
    o, lse = run()
    o2, _ = run()
    det = bool(np.array_equal(np.asarray(o).view(np.uint16), np.asarray(o2).view(np.uint16)))
    lse = np.asarray(lse)
    fin = np.isfinite(lse_r)
    lse_ok = bool(np.array_equal(np.isfinite(lse), fin)) and float(np.abs(lse - lse_r)[fin].max()) < 0.1
    res[name] = stats(o, o_r) + (det, lse_ok, int(np.isnan(np.asarray(o, np.float32)).sum()))
  return res


def bench(B, S, H, K, ctx, iters=20):
  from jax.experimental.mosaic.gpu import profiler
  rng = np.random.default_rng(0)
  N = B * ctx
  kv8 = jax.random.normal(jax.random.key(1), (N, 576), jnp.float32).astype(F8)
  q = jax.random.normal(jax.random.key(2), (B, S, H, 576), jnp.bfloat16)
  base = (np.arange(B) * ctx)[:, None, None]
  idx = jnp.asarray((rng.integers(0, ctx, (B, S, K)) + base).astype(np.int32))
  out = {}
  res = {}
  variants = [(f"mosaic[{v}]", "mosaic", _tuning(v)) for v in VARIANTS] + [("xla", "xla", ())]
  for ab in ABLATE:
    variants.append((f"ablate[{ab}]", "mosaic", _tuning(VARIANTS[0]) + (("ablate", tuple(ab.split("+"))),)))
  for name, impl, tuning in variants:
    f = jax.jit(lambda q, kv, i, impl=impl, tuning=tuning: sd._sparse_decode_jit(
        q, kv, i, jnp.float32(1.0), None, softmax_scale=192 ** -0.5, impl=impl, interpret=False,
        tuning=tuning))
    try:
      r, ts = profiler.measure(f, iterations=iters)(q, kv8, idx)
      out[name] = statistics.median(ts) * 1e3  # us
      res[name] = r
    except Exception as e:  # noqa
      out[name] = f"ERR {type(e).__name__}: {str(e)[:200]}"
  flops = 2 * B * S * H * K * (576 + 512)
  gbytes = B * S * K * 576
  rel = {k: round(stats(v[0], res["xla"][0])[0], 4) for k, v in res.items() if k.startswith("mosaic") and "xla" in res}
  return out, flops, gbytes, rel


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--check", action="store_true")
  ap.add_argument("--bench", action="store_true")
  ap.add_argument("--cases", default="")
  a = ap.parse_args()
  print("jax", jax.__version__, jax.devices())
  log = {"check": [], "bench": []}
  if a.check:
    cases = [(2, 1, 64, 256, 8192), (2, 2, 128, 2051, 8192), (2, 4, 8, 2176, 8192), (2, 6, 16, 100, 4096),
             (2, 1, 32, 2048, 8192), (1, 3, 64, 4096, 16384)]
    for c in cases[:1] if INTERPRET else cases:
      t = time.time()
      try:
        r = check(*c, seed=sum(c))
        for impl, v in r.items():
          print(f"CHECK B,S,H,K,N={c} {impl:28s} rel {v[0]:.4f} maxabs {v[1]:.4f} cos {v[2]:.5f} det {v[3]} "
                f"lse_ok {v[4]} nans {v[5]} ({time.time()-t:.1f}s)", flush=True)
        log["check"].append({"case": c, **{k: list(v) for k, v in r.items()}})
      except Exception as e:  # noqa
        print(f"CHECK {c} ERROR {type(e).__name__}: {str(e)[:400]}", flush=True)
  if a.bench:
    cases = {"a": (128, 2, 128, 2048, 32768), "b": (128, 4, 8, 2048, 32768), "c64": (64, 1, 64, 2048, 32768),
             "c128": (128, 1, 64, 2048, 32768),
             "h16": (128, 2, 16, 2048, 32768), "h32": (128, 1, 32, 2048, 32768),
             "b1": (128, 1, 8, 2048, 32768)}    # b1: GLM-5 TP-8 with s_q = 1 (the mla_decode_step shape)
    sel = a.cases.split(",") if a.cases else list(cases)
    for name in sel:
      out, flops, gbytes, rel = bench(*cases[name])
      row = {"case": name, "shape": cases[name], "us": out, "rel_vs_xla": rel}
      msg = []
      for impl, us in out.items():
        if isinstance(us, float):
          msg.append(f"{impl} {us:8.1f} us {flops/us/1e6:6.1f} TFLOP/s {gbytes/us/1e6:5.2f} TB/s")
        else:
          msg.append(f"{impl} {us}")
      print(f"BENCH {name} {cases[name]}: " + " | ".join(msg) + f" | rel vs xla {rel}", flush=True)
      log["bench"].append(row)
  d = os.environ.get("OUT", "results")
  os.makedirs(d, exist_ok=True)
  json.dump(log, open(os.path.join(d, "sm90_sparse_decode.json"), "w"), indent=1, default=str)


if __name__ == "__main__":
  main()
