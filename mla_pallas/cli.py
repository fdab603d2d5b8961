"""The ``mla-pallas`` console script.

  mla-pallas bench OP [--impl xla,mosaic|all] [--shape k=v,...] [--preset deepseek_v32|glm5] [--iters N]
                      [--warmup N] [--inputs N] [--out DIR] [--no-plot] [--no-check] [--interpret] [--seed N]
  mla-pallas demo [--preset glm5|deepseek_v32] [--batch N] [--steps N] [--topk N] [--heads N] [--ctx N]
                  [--no-interpret] [--seed N]

``bench`` times the implementations of one op side by side (:mod:`mla_pallas.bench`), prints a table, writes
JSON (every sample) and a PNG into ``--out``. ``demo`` runs sparse MLA decode at a reduced preset shape through
every implementation available here, checks each against :mod:`mla_pallas.reference` with
:func:`mla_pallas.testing.compare_fp8`, and prints a comparison and timing table. Both exit with status 1 when
an implementation fails its check or raises (an implementation that is merely unavailable here does not fail),
and 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

OPS_HELP = "op to benchmark"


def _bench_epilog() -> str:
  from mla_pallas import bench
  lines = ["shape keys (--shape k=v,...; defaults: CPU | GPU):"]
  for name, spec in bench.SPECS.items():
    lines.append(f"  {name}:")
    for k, (typ, desc) in spec.keys.items():
      cpu, gpu = spec.cpu_defaults[k], spec.gpu_defaults[k]
      fmt = (lambda v: f"{v:.6g}") if typ is float else str
      lines.append(f"    {k:<14} {desc} [{fmt(cpu)} | {fmt(gpu)}]")
  lines.append("presets set H, topk and page from mla_pallas.config; --shape entries override them.")
  lines.append("timer: cupti (device time, GPU) or wall (host wall clock incl. dispatch, CPU); "
               "never compare the two.")
  return "\n".join(lines)


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
  from mla_pallas import bench
  p = argparse.ArgumentParser(prog="mla-pallas", description="FP8 Multi-head Latent Attention kernels (JAX "
                              "Pallas Mosaic GPU): benchmarks and demo.")
  sub = p.add_subparsers(dest="command", metavar="{bench,demo}")
  sub.required = True

  b = sub.add_parser("bench", help="time implementations of one op side by side",
                     epilog=_bench_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
  b.add_argument("op", choices=sorted(bench.SPECS), help=OPS_HELP)
  b.add_argument("--impl", default="xla,mosaic",
                 help="comma-separated implementations among xla, mosaic, auto; 'all' = xla,mosaic "
                      "(default: %(default)s)")
  b.add_argument("--shape", default="",
                 help="shape overrides, e.g. B=128,s_q=2,H=128,topk=2048,page=64,ctx=32768")
  b.add_argument("--preset", choices=("deepseek_v32", "glm5"), help="model preset (H, topk, page)")
  b.add_argument("--iters", type=int, default=None, help="timed iterations (default 20 on GPU, 3 on CPU)")
  b.add_argument("--warmup", type=int, default=None, help="warm-up rounds (default 2 on GPU, 1 on CPU)")
  b.add_argument("--inputs", type=int, default=None,
                 help="input sets to rotate through (default: > 2x L2 on GPU, 2 on CPU)")
  b.add_argument("--out", default="results", help="output folder for JSON and PNG (default: %(default)s)")
  b.add_argument("--no-plot", action="store_true", help="do not write the PNG")
  b.add_argument("--no-check", action="store_true", help="skip the comparison with mla_pallas.reference")
  b.add_argument("--no-progress", action="store_true", help="no progress bar")
  b.add_argument("--interpret", action="store_true",
                 help="run the mosaic kernel in GPU interpret mode (correctness only; times are meaningless)")
  b.add_argument("--seed", type=int, default=0, help="PRNG seed of the inputs")

  d = sub.add_parser("demo", help="run sparse MLA decode through every available implementation and check it")
  d.add_argument("--preset", choices=("glm5", "deepseek_v32"), default="glm5", help="model preset")
  d.add_argument("--batch", type=int, default=None, help="sequences (default 2 on CPU, 16 on GPU)")
  d.add_argument("--steps", type=int, default=3, help="decode steps (fresh q and top-k each)")
  d.add_argument("--topk", type=int, default=None, help="top-k (default 256 on CPU, the preset's on GPU)")
  d.add_argument("--heads", type=int, default=None, help="query heads (default 16 on CPU, the preset's on GPU)")
  d.add_argument("--ctx", type=int, default=None, help="cache tokens per sequence (default 1024 CPU, 8192 GPU)")
  d.add_argument("--no-interpret", action="store_true",
                 help="on a machine without a supported GPU, skip the interpret-mode run of the kernel")
  d.add_argument("--no-progress", action="store_true", help="no progress bar")
  d.add_argument("--seed", type=int, default=0, help="PRNG seed")
  return p, {"bench": b, "demo": d}


def _parse_impls(text: str) -> tuple[str, ...]:
  from mla_pallas import bench
  if text.strip() == "all":
    return ("xla", "mosaic")
  impls = tuple(s.strip() for s in text.split(",") if s.strip())
  bad = [i for i in impls if i not in bench.IMPLS]
  if not impls or bad:
    raise ValueError(f"--impl must be 'all' or a comma-separated list of {', '.join(bench.IMPLS)}; "
                     f"got {text!r}")
  return impls


def _cmd_bench(args, parser, argv) -> int:
  from mla_pallas import bench
  try:
    impls = _parse_impls(args.impl)
    spec = bench.get_spec(args.op)
    shape = spec.shape(bench.parse_shape(args.shape), preset=args.preset)
    for name in ("iters", "inputs"):
      v = getattr(args, name)
      if v is not None and v < 1:
        raise ValueError(f"--{name} must be >= 1; got {v}")
    if args.warmup is not None and args.warmup < 0:
      raise ValueError(f"--warmup must be >= 0; got {args.warmup}")
  except ValueError as e:
    parser.error(str(e))   # exits with status 2
  results = bench.run(args.op, impls, shape, iters=args.iters, warmup=args.warmup, n_inputs=args.inputs,
                      check=not args.no_check, seed=args.seed, progress=not args.no_progress,
                      interpret=args.interpret)
  print(bench.format_table(results))
  command = "mla-pallas " + " ".join(argv)
  paths = bench.write_outputs(results, args.out, make_plot=not args.no_plot, command=command)
  for kind, path in paths.items():
    print(f"wrote {kind}: {path}")
  failed = [r for r in results if r.available and (not r.ok or r.check_ok is False)]
  for r in failed:
    why = r.status if not r.ok else "check against the reference failed"
    print(f"FAILED: {r.label}: {why}", file=sys.stderr)
  return 1 if failed else 0


# ----------------------------------------------------------------------------------------------------------
# demo
# ----------------------------------------------------------------------------------------------------------

# Interpret mode executes the kernel op by op on the CPU (seconds per call even when tiny).
_INTERPRET_SHAPE = dict(B=1, s_q=1, H=16, topk=64, page=64, ctx=128)


def _demo_rows(spec, shape, impl, *, interpret, steps, seed, bar):
  """Run ``impl`` on ``steps`` fresh input sets; returns a result row (dict)."""
  import jax
  from mla_pallas import _dispatch, bench, testing
  op = spec.name
  row = dict(impl=impl, mode="interpret" if interpret else "native", shape=shape, steps=steps, ran="-",
             rel_l2=None, cos=None, tol=spec.tolerance(shape), check="-", timer="-", median_us=None,
             note="")
  keys = jax.random.split(jax.random.key(seed), steps)
  sets = [tuple(spec.make_inputs(shape, k)) for k in keys]
  ref = jax.jit(spec.reference(shape))
  done = 0
  try:
    fn = spec.op(impl, shape, interpret=interpret)
    f = jax.jit(fn)
    reports = []
    for s in sets:
      got = f(*s)
      want = ref(*s)
      reports.append([testing.compare_fp8(g, w, rel_l2=row["tol"], what=f"{impl} {name}")
                      for name, g, w in zip(spec.outputs, got, want)])
      done += 1
      if bar is not None:
        bar.update(1)
    row["ran"] = _dispatch.last_impl(op) or impl
    row["rel_l2"] = max(r[0].rel_l2 for r in reports)
    row["cos"] = min(r[0].cosine for r in reports)
    bad = [rep for rs in reports for rep in rs if not rep.ok]
    row["check"] = "FAIL" if bad else "PASS"
    if bad:
      row["note"] = bad[0].summary()
    if interpret:   # one more warm call (compiled already): interpret mode is slow, time a single one
      row["timer"], row["median_us"] = "wall", bench.time_wall(fn, sets[:1], iters=1, warmup=1)[0]
    elif jax.default_backend() == "gpu":
      samples, _ = bench.time_cupti(fn, sets, iters=10, warmup=1)
      row["timer"], row["median_us"] = "cupti", float(sorted(samples)[len(samples) // 2])
    else:
      samples = bench.time_wall(fn, sets, iters=3, warmup=1)
      row["timer"], row["median_us"] = "wall", float(sorted(samples)[len(samples) // 2])
  except NotImplementedError as e:
    row["check"] = "n/a"
    row["note"] = "not available: " + " ".join(str(e).split())
  except Exception as e:  # noqa: BLE001 - report and fail the demo
    row["check"] = "ERROR"
    row["note"] = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
  if bar is not None and done < steps:
    bar.update(steps - done)
  return row


def _demo_table(rows) -> str:
  head = ["impl", "mode", "ran", "shape", "steps", "rel-L2 max", "cos min", "tol", "check", "timer",
          "median µs"]
  cells = []
  for r in rows:
    s = r["shape"]
    shp = f"B{s['B']} s_q{s['s_q']} H{s['H']} k{s['topk']} ctx{s['ctx']}"
    cells.append([r["impl"], r["mode"], r["ran"], shp, str(r["steps"]),
                  "-" if r["rel_l2"] is None else f"{r['rel_l2']:.3e}",
                  "-" if r["cos"] is None else f"{r['cos']:.6f}", f"{r['tol']:.3g}", r["check"], r["timer"],
                  "-" if r["median_us"] is None else f"{r['median_us']:.1f}"])
  widths = [max(len(x) for x in col) for col in zip(head, *cells)]
  fmt = lambda c: "  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip()  # noqa: E731
  out = [fmt(head), "  ".join("-" * w for w in widths)] + [fmt(c) for c in cells]
  notes = [f"  {r['impl']} ({r['mode']}): {r['note']}" for r in rows if r["note"]]
  if notes:
    out += ["notes:"] + notes
  return "\n".join(out)


def _cmd_demo(args, parser) -> int:
  import jax
  from mla_pallas import _dispatch, bench, config, testing
  for name in ("batch", "steps", "topk", "heads", "ctx"):
    v = getattr(args, name)
    if v is not None and v < 1:
      parser.error(f"--{name} must be >= 1; got {v}")
  cfg = config.preset(args.preset)
  gpu = jax.default_backend() == "gpu"
  native = _dispatch.mosaic_arch(False)
  spec = bench.get_spec("sparse_mla_decode")
  overrides = dict(
      B=args.batch or (16 if gpu else 2), s_q=1,
      H=args.heads or (cfg.num_heads if gpu else 16),
      topk=args.topk or (cfg.index_topk if gpu else 256),
      page=cfg.page_size, ctx=args.ctx or (8192 if gpu else 1024),
      softmax_scale=cfg.softmax_scale)
  try:
    shape = spec.shape(overrides)
  except ValueError as e:
    parser.error(str(e))
  print(f"mla-pallas demo: sparse MLA decode, preset {args.preset} ({cfg.num_heads} heads, top-k "
        f"{cfg.index_topk}, softmax_scale {cfg.softmax_scale:.5g})")
  print(f"device: {testing.device_kind()}, jax {jax.__version__}; native Mosaic GPU kernels: "
        f"{native or 'none (needs compute capability 9.0 or 10.x)'}")
  terms = testing.fp8_error_terms(pv_length=shape["topk"], logit_std=shape["softmax_scale"] * 24.0)
  print("error model (RMS relative terms): " + ", ".join(f"{k} {v:.2g}" for k, v in terms.items() if v)
        + f"; tolerance = 3 x sqrt(sum of squares) = {spec.tolerance(shape):.3g}")

  plan = [("xla", False, shape, args.steps)]
  if native:
    plan.append(("mosaic", False, shape, args.steps))
  elif not args.no_interpret:
    tiny = spec.shape(dict(_INTERPRET_SHAPE, softmax_scale=cfg.softmax_scale))
    plan.append(("mosaic", True, tiny, 1))
  bar = None
  if not args.no_progress:
    try:
      from tqdm.auto import tqdm
      bar = tqdm(total=sum(p[3] for p in plan), desc="demo", unit="step", leave=False, file=sys.stderr)
    except ImportError:  # pragma: no cover
      bar = None
  rows = []
  for impl, interp, shp, steps in plan:
    if bar is not None:
      bar.set_postfix_str(f"{impl}{' (interpret)' if interp else ''}")
    rows.append(_demo_rows(spec, shp, impl, interpret=interp, steps=steps, seed=args.seed, bar=bar))
  if bar is not None:
    bar.close()
  if not native and args.no_interpret:
    rows.append(dict(impl="mosaic", mode="-", ran="-", shape=shape, steps=0, rel_l2=None, cos=None,
                     tol=spec.tolerance(shape), check="n/a", timer="-", median_us=None,
                     note="skipped (--no-interpret)"))
  print(_demo_table(rows))
  failed = [r for r in rows if r["check"] in ("FAIL", "ERROR")]
  print("demo: " + ("FAILED" if failed else "all available implementations match the reference"))
  return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of the ``mla-pallas`` console script; returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  argv = [str(a) for a in argv]     # allow pathlib.Path values
  parser, subparsers = _parser()
  args = parser.parse_args(argv)
  if args.command == "bench":
    return _cmd_bench(args, subparsers["bench"], argv)
  return _cmd_demo(args, subparsers["demo"])


if __name__ == "__main__":
  sys.exit(main())
