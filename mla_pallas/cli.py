"""The ``mla-pallas`` console script.

  mla-pallas bench OP [--impl xla,mosaic|all] [--sweep] [--shape k=v,...] [--preset deepseek_v32|glm5]
                      [--iters N] [--warmup N] [--inputs N] [--out DIR] [--no-plot] [--no-check] [--interpret]
                      [--seed N] [--no-compile-cache]
  mla-pallas demo [--preset glm5|deepseek_v32] [--batch N] [--steps N] [--topk N] [--heads N] [--ctx N]
                  [--no-interpret] [--seed N] [--no-compile-cache]

``bench`` times the implementations of one op side by side (:mod:`mla_pallas.bench`), prints a table, writes
JSON (every sample) and a PNG into ``--out``; ``--sweep`` replaces the "mosaic" row by one row per candidate of
the op module's ``sweep_configs`` (:func:`mla_pallas.bench.sweep_candidates`). ``demo`` runs one FP8 MLA layer
(:class:`mla_pallas.layer.MLAAttention`) at a reduced but real shape of the preset: a prefill and ``--steps`` decode steps (dense and sparse top-k attention
alternating), each checked against the float32 reference layer, with per-stage timings and the implementation every
graph step ran (:func:`mla_pallas.graph.graph_report`); then a kernel check: sparse MLA decode through every
implementation available here (on a CPU the Mosaic GPU kernel in interpret mode at a tiny shape). Both exit with
status 1 when an implementation fails its check or raises (an implementation that is merely unavailable here does
not fail), and 2 on bad arguments. Every line the demo prints fits :data:`WIDTH` columns.

Both commands use JAX's persistent compilation cache (:func:`compile_cache`): folder ``$MLA_PALLAS_COMPILE_CACHE``,
else ``$XDG_CACHE_HOME/mla_pallas/jax``, else ``~/.cache/mla_pallas/jax``; ``--no-compile-cache`` turns it off.
Every compiled program is cached (no minimum compile time or entry size), Mosaic GPU kernels included, so a second
run skips the compilation of every shape the first one ran.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap
from typing import Iterator, Sequence

OPS_HELP = "op to benchmark"
#: the demo's output width (columns).
WIDTH = 120
#: environment variable naming the compilation cache folder.
CACHE_ENV = "MLA_PALLAS_COMPILE_CACHE"


def default_cache_dir() -> str:
  """``$MLA_PALLAS_COMPILE_CACHE``, else ``$XDG_CACHE_HOME/mla_pallas/jax``, else ``~/.cache/mla_pallas/jax``."""
  if os.environ.get(CACHE_ENV):
    return os.environ[CACHE_ENV]
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "mla_pallas", "jax")


_CACHE_OPTIONS = {                      # jax config name -> value while the cache is on
    "jax_compilation_cache_dir": None,  # the folder
    "jax_persistent_cache_min_compile_time_secs": 0.0,   # default 1 s would skip most small kernels
    "jax_persistent_cache_min_entry_size_bytes": -1,      # no size limit
}


@contextlib.contextmanager
def compile_cache(folder: str | None) -> Iterator[str | None]:
  """JAX's persistent compilation cache in ``folder`` (created) for the duration of the block; None: off.

  Sets ``jax_compilation_cache_dir``, a zero minimum compile time and no minimum entry size, and restores the
  previous settings afterwards (the cache is re-initialised on both ends, so this works in a process that has
  compiled before, e.g. a test). Yields the folder.
  """
  if folder is None:
    yield None
    return
  import jax
  from jax.experimental.compilation_cache import compilation_cache as cc
  os.makedirs(folder, exist_ok=True)
  old = {k: getattr(jax.config, k) for k in _CACHE_OPTIONS}
  try:
    for k, v in _CACHE_OPTIONS.items():
      jax.config.update(k, folder if v is None else v)
    cc.reset_cache()
    yield folder
  finally:
    for k, v in old.items():
      jax.config.update(k, v)
    cc.reset_cache()


def _cache_files(folder: str | None) -> int:
  if folder is None or not os.path.isdir(folder):
    return 0
  return sum(len(files) for _, _, files in os.walk(folder))


def _cache_line(folder: str | None) -> str:
  if folder is None:
    return "compile cache: off (--no-compile-cache)"
  return f"compile cache: {folder} ({_cache_files(folder)} files before this run; {CACHE_ENV} sets the folder)"


def fit(text: str, width: int = WIDTH) -> str:
  """``text`` with every line longer than ``width`` wrapped (continuation lines indented by 4 more columns)."""
  out = []
  for line in text.splitlines() or [""]:
    if len(line) <= width:
      out.append(line)
      continue
    lead = line[:len(line) - len(line.lstrip())]
    out += textwrap.wrap(line, width, initial_indent="", subsequent_indent=lead + "    ",
                         break_long_words=True, break_on_hyphens=False)
  return "\n".join(out)


def _say(text: str = "") -> None:
  print(fit(text))


def _bench_epilog() -> str:
  from mla_pallas import bench
  lines = ["shape keys (--shape k=v,...; defaults: CPU | GPU):"]
  for name, spec in bench.specs().items():
    lines.append(f"  {name}:")
    for k, (typ, desc) in spec.keys.items():
      cpu, gpu = spec.cpu_defaults[k], spec.gpu_defaults[k]
      fmt = (lambda v: f"{v:.6g}") if typ is float else str
      lines.append(f"    {k:<14} {desc} [{fmt(cpu)} | {fmt(gpu)}]")
    extra = [i for i in spec.all_impls if i not in ("xla", "mosaic")]
    if extra:
      lines.append(f"    --impl all = {','.join(spec.all_impls)}")
  lines.append("presets set the model's sizes from mla_pallas.config (sparse decode/prefill: H, topk, page; "
               "quantize_and_bmm_fp8: H, K=qk_nope, N=512; rope: H (, page); mla_decode_step, mla_prefill: model); --shape "
               "entries override them. Shape keys are case-insensitive when unambiguous.")
  lines.append("timer: cupti (device time, GPU) or wall (host wall clock incl. dispatch, CPU); "
               "never compare the two.")
  lines.append(f"--sweep (ops: {', '.join(bench.sweep_ops())}): one 'mosaic:<candidate>' row per entry of the op "
               "module's sweep_configs(...), run with tuning=<its overrides>; the other --impl entries run as usual.")
  lines.append(f"compile cache: {default_cache_dir()} (${CACHE_ENV}; --no-compile-cache: off)")
  return "\n".join(lines)


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
  from mla_pallas import bench
  p = argparse.ArgumentParser(prog="mla-pallas", description="FP8 Multi-head Latent Attention kernels (JAX "
                              "Pallas Mosaic GPU): benchmarks and demo.")
  sub = p.add_subparsers(dest="command", metavar="{bench,demo}")
  sub.required = True

  b = sub.add_parser("bench", help="time implementations of one op side by side",
                     epilog=_bench_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
  b.add_argument("op", choices=sorted(bench.specs()), help=OPS_HELP)
  b.add_argument("--impl", default="xla,mosaic",
                 help="comma-separated implementations among xla, mosaic, auto (and the op's extras, e.g. copy); "
                      "'all' = xla,mosaic plus the op's extras (default: %(default)s)")
  b.add_argument("--shape", default="",
                 help="shape overrides, e.g. B=128,s_q=2,H=128,topk=2048,page=64,ctx=32768")
  b.add_argument("--preset", choices=("deepseek_v32", "glm5"), help="model preset (sizes of the model)")
  b.add_argument("--cache-dtype", choices=("fp8", "bf16"), default=None,
                 help="the attention ops' cache dtype (shape key cache=; default fp8)")
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
  b.add_argument("--sweep", action="store_true",
                 help="run the kernel once per candidate of the op's sweep_configs (rows mosaic:<candidate>)")
  b.add_argument("--sweep-only", default=None, metavar="TEXT[,TEXT...]",
                 help="with --sweep: only the default and the candidates whose label contains one of these "
                      "comma-separated texts (e.g. schedule=twin,tiles_per_split=64)")
  _cache_flag(b)

  d = sub.add_parser("demo", help="run one FP8 MLA layer (prefill + decode steps) and the kernels, checked "
                     "against the reference")
  d.add_argument("--preset", choices=("glm5", "deepseek_v32"), default="glm5", help="model preset")
  d.add_argument("--batch", type=int, default=None,
                 help="sequences (default 2 on CPU; on GPU 4 for the layer, 16 for the kernel check)")
  d.add_argument("--steps", type=int, default=3, help="decode steps of the layer (and kernel-check steps)")
  d.add_argument("--topk", type=int, default=None,
                 help="top-k of the sparse steps (default 64 layer / 256 kernel check on CPU, the preset's on GPU)")
  d.add_argument("--heads", type=int, default=None, help="query heads (default 16 on CPU, the preset's on GPU)")
  d.add_argument("--ctx", type=int, default=None,
                 help="prompt tokens per sequence of the layer / cache tokens of the kernel check (default "
                      "64 / 1024 on CPU, 256 / 8192 on GPU)")
  d.add_argument("--no-interpret", action="store_true",
                 help="on a machine without a supported GPU, skip the interpret-mode run of the kernel")
  d.add_argument("--no-progress", action="store_true", help="no progress bar")
  d.add_argument("--seed", type=int, default=0, help="PRNG seed")
  _cache_flag(d)
  return p, {"bench": b, "demo": d}


def _cache_flag(p: argparse.ArgumentParser) -> None:
  p.add_argument("--no-compile-cache", action="store_true",
                 help=f"do not use JAX's persistent compilation cache (default folder: ${CACHE_ENV}, else "
                      "$XDG_CACHE_HOME/mla_pallas/jax or ~/.cache/mla_pallas/jax)")


def _parse_impls(text: str, spec=None) -> tuple[str, ...]:
  from mla_pallas import bench
  known = spec.impls if spec is not None else bench.IMPLS
  if text.strip() == "all":
    return spec.all_impls if spec is not None else ("xla", "mosaic")
  impls = tuple(s.strip() for s in text.split(",") if s.strip())
  bad = [i for i in impls if i not in known]
  if not impls or bad:
    raise ValueError(f"--impl must be 'all' or a comma-separated list of {', '.join(known)}; got {text!r}")
  return impls


def _cmd_bench(args, parser, argv) -> int:
  from mla_pallas import bench
  try:
    spec = bench.get_spec(args.op)
    impls = _parse_impls(args.impl, spec)
    overrides = bench.parse_shape(args.shape)
    if args.cache_dtype is not None:
      if "cache" not in spec.keys:
        raise ValueError(f"--cache-dtype applies to the attention ops over a cache; {args.op} has no cache")
      overrides["cache"] = args.cache_dtype
    shape = spec.shape(overrides, preset=args.preset)
    for name in ("iters", "inputs"):
      v = getattr(args, name)
      if v is not None and v < 1:
        raise ValueError(f"--{name} must be >= 1; got {v}")
    if args.warmup is not None and args.warmup < 0:
      raise ValueError(f"--warmup must be >= 0; got {args.warmup}")
    cands = bench.sweep_candidates(args.op, shape) if args.sweep else None
    if args.sweep_only is not None:
      if cands is None:
        raise ValueError("--sweep-only needs --sweep")
      wanted = [w.strip() for w in args.sweep_only.split(",") if w.strip()]
      cands = {k: v for k, v in cands.items() if k == "default" or any(w in k for w in wanted)}
      if len(cands) == 1:
        raise ValueError(f"--sweep-only {args.sweep_only!r} matches no candidate of {args.op} at this shape; "
                         f"candidates: {', '.join(bench.sweep_candidates(args.op, shape))}")
  except ValueError as e:
    parser.error(str(e))   # exits with status 2
  results = bench.run_spec(spec, impls, shape, iters=args.iters, warmup=args.warmup, n_inputs=args.inputs,
                           check=not args.no_check, seed=args.seed, progress=not args.no_progress,
                           interpret=args.interpret, candidates=cands)
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
  import time

  import jax
  from mla_pallas import _dispatch, bench, testing
  op = spec.name
  row = dict(impl=impl, mode="interpret" if interpret else "native", shape=shape, steps=steps, ran="-",
             rel_l2=None, cos=None, tol=spec.tolerance(shape), check="-", timer="-", median_us=None,
             first_ms=None, note="")
  keys = jax.random.split(jax.random.key(seed), steps)
  sets = [tuple(spec.make_inputs(shape, k)) for k in keys]
  ref = jax.jit(spec.reference(shape))
  done = 0
  try:
    fn = spec.op(impl, shape, interpret=interpret)
    f = jax.jit(fn)
    reports = []
    for s in sets:
      t0 = time.perf_counter()
      got = jax.block_until_ready(f(*s))
      if row["first_ms"] is None:      # the first call: tracing + compilation (or a compile-cache hit) + run
        row["first_ms"] = 1e3 * (time.perf_counter() - t0)
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


def _shape_text(s) -> str:
  """The shape of a sparse decode row, e.g. ``B16 s_q1 H128 k2048 ctx8192`` (k: top-k, ctx: cache tokens)."""
  return f"B{s['B']} s_q{s['s_q']} H{s['H']} k{s['topk']} ctx{s['ctx']}"


def _table(head, cells) -> list[str]:
  widths = [max(len(x) for x in col) for col in zip(head, *cells)]
  fmt = lambda c: "  ".join(x.ljust(w) for x, w in zip(c, widths)).rstrip()  # noqa: E731
  return [fmt(head), "  ".join("-" * w for w in widths)] + [fmt(c) for c in cells]


def _ms(v) -> str:
  return "-" if v is None else f"{v:.1f}"


def _demo_table(rows) -> str:
  head = ["impl", "ran", "shape", "steps", "rel-L2 max", "cos min", "tol", "check", "1st ms", "timer",
          "median µs"]
  cells = []
  for r in rows:
    cells.append([r["impl"], r["ran"], _shape_text(r["shape"]), str(r["steps"]),
                  "-" if r["rel_l2"] is None else f"{r['rel_l2']:.3e}",
                  "-" if r["cos"] is None else f"{r['cos']:.6f}", f"{r['tol']:.3g}", r["check"],
                  _ms(r["first_ms"]), r["timer"], _ms(r["median_us"])])
  out = _table(head, cells)
  out.append("(1st ms: the first call, wall clock, incl. compilation or a compile-cache hit; median µs: of the "
             "next calls)")
  notes = [f"  {r['impl']} ({r['mode']}): {r['note']}" for r in rows if r["note"]]
  if notes:
    out += ["notes:"] + notes
  return fit("\n".join(out))


def _fmt_ms(s: float) -> str:
  return f"{1e3 * s:.1f}"


def _demo_layer(args, cfg, gpu) -> tuple[list[dict], str]:
  """Prefill + ``args.steps`` decode steps of one FP8 MLA layer, each checked against the float32 reference layer.

  Returns (rows, text). Reduced shape on the CPU (16 heads, hidden 512, q_lora_rank 256) so that it runs in
  seconds; on a GPU the preset's layer (heads from --heads).
  """
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np
  from mla_pallas import cache as mcache, graph, layer as L, reference, testing
  # the float32 reference prefill is O(T^2 H) memory: keep the packed prompt at ~1k tokens by default on a GPU
  batch = args.batch or (4 if gpu else 2)
  heads = args.heads or (cfg.num_heads if gpu else 16)
  ctx = args.ctx or (256 if gpu else 64)
  if gpu:
    lcfg = cfg.with_heads(heads)
  else:
    lcfg = cfg.replace(num_heads=heads, hidden_size=512, q_lora_rank=256)
  topk = min(args.topk or (cfg.index_topk if gpu else 64), ctx)
  steps = args.steps
  lines = [f"layer: {args.preset}{'' if gpu else ' reduced'}: H={lcfg.num_heads} hidden={lcfg.hidden_size} "
           f"q_lora_rank={lcfg.q_lora_rank} nope={lcfg.qk_nope_head_dim} v={lcfg.v_head_dim} "
           f"page={lcfg.page_size}; FP8 weights (128x128 block scales)",
           f"FP8 cache; batch {batch}, prompt {ctx} tokens/sequence, {steps} decode steps (even: dense, odd: "
           f"sparse top-{topk})"]
  k = jax.random.split(jax.random.key(args.seed), 4 + steps)
  layer = L.MLAAttention.init(k[0], lcfg).to_fp8()
  cos, sin = lcfg.rope_tables(ctx + steps + 1)   # YaRN tables where the preset has rope scaling
  cache = L.PagedCache.create(lcfg, batch, ctx + steps, shuffle_key=k[1])
  ref_cache = jax.tree.map(jnp.copy, cache)
  lens = np.full(batch, ctx)
  cu = jnp.asarray(np.r_[0, np.cumsum(lens)], jnp.int32)
  pos = jnp.asarray(np.concatenate([np.arange(n) for n in lens]), jnp.int32)
  x = jax.random.normal(k[2], (int(lens.sum()), lcfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
  logit_std = 2.0   # upper estimate: ~N(0, 1) queries, RMS-normed latent rows, scale (nope + 64)^-0.5
  rows = []

  def stage(name, run, run_ref, pv_length, cache_in):
    spare = jax.tree.map(jnp.copy, cache_in)   # the graph donates the cache: a copy for the second, timed run
    t0 = time.perf_counter()
    y, new_cache = run(cache_in)
    jax.block_until_ready(y)
    dt = time.perf_counter() - t0
    rep = graph.graph_report()
    t0 = time.perf_counter()   # same step again, compiled: dispatch + device time of one call
    jax.block_until_ready(run(spare))
    dt_run = time.perf_counter() - t0
    want, new_ref = run_ref()
    tol = testing.fp8_error_budget(split_partials_bf16=True, logit_std=logit_std, pv_length=pv_length, fp8_mma=gpu)
    r = testing.compare_fp8(y, want, rel_l2=tol, min_cos=0.97, what=name)
    impls = ", ".join(f"{s['op']}={s['impl']}" for s in rep["steps"]) if rep else "-"
    rows.append(dict(stage=name, seconds=dt, run_seconds=dt_run, rel_l2=r.rel_l2, cos=r.cosine, tol=tol,
                     check="PASS" if r.ok else "FAIL", impls=impls, report=graph.format_report(rep)))
    return new_cache, new_ref

  cache, ref_cache = stage(
      "prefill", lambda c: layer.prefill(x, pos, c, cu, cos=cos, sin=sin),
      lambda: L.reference_prefill(layer, x, pos, ref_cache, cu, cos=cos, sin=sin), ctx, cache)
  rng = np.random.default_rng(args.seed)
  for i in range(steps):
    xd = jax.random.normal(k[4 + i], (batch, 1, lcfg.hidden_size), jnp.float32).astype(jnp.bfloat16)
    p = cache.seq_lens[:, None]
    kw, name, pv = {}, f"decode {i} (dense)", ctx + i + 1
    if i % 2:
      n_now = np.asarray(cache.seq_lens) + 1
      tok = np.stack([np.r_[n - 1, rng.integers(0, n - 1, topk - 1)] for n in n_now])   # incl. the new token
      kw = dict(indices=mcache.slots_for_positions(cache.block_table, jnp.asarray(tok[:, None], jnp.int32),
                                                   lcfg.page_size))
      name, pv = f"decode {i} (sparse)", topk
    cache, ref_cache = stage(
        name, lambda c: layer.decode(xd, p, c, cos=cos, sin=sin, **kw),
        lambda: L.reference_decode(layer, xd, p, ref_cache, cos=cos, sin=sin, **kw), pv, cache)
  head = ["stage", "1st call ms", "2nd call ms", "rel-L2", "cos", "tol", "check"]
  cells = [[r["stage"], _fmt_ms(r["seconds"]), _fmt_ms(r["run_seconds"]), f"{r['rel_l2']:.3e}",
            f"{r['cos']:.6f}", f"{r['tol']:.3g}", r["check"]] for r in rows]
  lines += _table(head, cells)
  lines.append("(wall clock. 1st call: tracing, compilation or a compile-cache hit, and the run, the first time a")
  lines.append(" graph shape runs; 2nd call: the same step again, compiled, on a copy of its input cache)")
  lines.append("implementation per step (graph_report(): xla = XLA path, mosaic = Mosaic GPU kernel, "
               "mosaic-interpret = interpret mode):")
  lines += [f"  {r['stage']}: {r['impls']}" for r in rows]
  lines.append("last graph:\n" + rows[-1]["report"])
  return rows, fit("\n".join(lines))


def _cmd_demo(args, parser, cache_dir: str | None = None) -> int:
  import jax
  from mla_pallas import _dispatch, bench, config, testing
  for name in ("batch", "steps", "topk", "heads", "ctx"):
    v = getattr(args, name)
    if v is not None and v < 1:
      parser.error(f"--{name} must be >= 1; got {v}")
  cfg = config.preset(args.preset)
  gpu = jax.default_backend() == "gpu"
  native = _dispatch.mosaic_arch(False)
  _say(f"mla-pallas demo: preset {args.preset}; device: {testing.device_kind()}, jax {jax.__version__}")
  _say(f"native Mosaic GPU kernels: {native or 'none (needs compute capability 9.0 or 10.x)'}")
  _say(_cache_line(cache_dir))
  _say("== part 1: one MLA layer (mla_pallas.layer.MLAAttention), checked against the float32 reference layer ==")
  try:
    layer_rows, text = _demo_layer(args, cfg, gpu)
    _say(text)
    layer_failed = [r for r in layer_rows if r["check"] != "PASS"]
  except Exception as e:  # noqa: BLE001 - report and fail the demo
    _say(f"layer: ERROR {type(e).__name__}: {' '.join(str(e).split())[:500]}")
    layer_failed = [e]
  spec = bench.get_spec("sparse_mla_decode")
  overrides = dict(
      B=args.batch or (16 if gpu else 2), s_q=1,
      H=args.heads or (cfg.num_heads if gpu else 16),
      topk=args.topk or (cfg.index_topk if gpu else 256),
      page=cfg.page_size, ctx=max(args.ctx or (8192 if gpu else 1024), args.topk or 0),
      softmax_scale=cfg.softmax_scale)
  try:
    shape = spec.shape(overrides)
  except ValueError as e:
    parser.error(str(e))
  plan = [("xla", False, shape, args.steps)]
  if native:
    plan.append(("mosaic", False, shape, args.steps))
  elif not args.no_interpret:
    tiny = spec.shape(dict(_INTERPRET_SHAPE, softmax_scale=cfg.softmax_scale))
    plan.append(("mosaic", True, tiny, 1))
  _say(_part2_header(args.preset, plan))
  _say(f"preset {args.preset}: {cfg.num_heads} heads, top-k {cfg.index_topk}; softmax_scale "
       f"{shape['softmax_scale']:.5g}")
  terms = testing.fp8_error_terms(pv_length=shape["topk"], logit_std=shape["softmax_scale"] * 24.0)
  _say("error model (RMS relative terms): " + ", ".join(f"{k} {v:.2g}" for k, v in terms.items() if v))
  _say(f"tolerance = 3 x sqrt(sum of squares) = {spec.tolerance(shape):.3g}")
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
  _say(_demo_table(rows))
  failed = [r for r in rows if r["check"] in ("FAIL", "ERROR")] + layer_failed
  _say("demo: " + ("FAILED" if failed else "the layer and all available implementations match the reference"))
  return 1 if failed else 0


def _part2_header(preset: str, plan) -> str:
  """Part 2's header, naming the shapes the rows run (``plan``: (impl, interpret, shape, steps) per row)."""
  runs: dict[str, list[str]] = {}          # shape -> the rows that run it
  for impl, interp, shp, _ in plan:
    runs.setdefault(_shape_text(shp), []).append(f"{impl}{' (interpret)' if interp else ''}")
  at = ", ".join(f"{' and '.join(impls)} at {shp}" for shp, impls in runs.items())
  return f"== part 2: sparse MLA decode kernel check ({preset}): {at} =="


def main(argv: Sequence[str] | None = None) -> int:
  """Entry point of the ``mla-pallas`` console script; returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  argv = [str(a) for a in argv]     # allow pathlib.Path values
  parser, subparsers = _parser()
  args = parser.parse_args(argv)
  with compile_cache(None if args.no_compile_cache else default_cache_dir()) as folder:
    if args.command == "bench":
      print(_cache_line(folder), file=sys.stderr)
      return _cmd_bench(args, subparsers["bench"], argv)
    return _cmd_demo(args, subparsers["demo"], folder)


if __name__ == "__main__":
  sys.exit(main())
