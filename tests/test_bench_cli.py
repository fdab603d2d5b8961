"""Tests of the benchmark harness (mla_pallas.bench) and the mla-pallas console script (mla_pallas.cli)."""
import glob
import json
import os

import jax
import numpy as np
import pytest

from mla_pallas import bench, bench_engine, bench_specs, bench_timing, cli, testing

TINY = "B=1,s_q=1,H=8,topk=32,page=16,ctx=64"
ON_CPU = jax.default_backend() == "cpu"


@pytest.fixture(autouse=True)
def _compile_cache_in_tmp(tmp_path_factory, monkeypatch):
  # cli.main turns JAX's persistent compilation cache on: keep it out of the user's ~/.cache
  monkeypatch.setenv(cli.CACHE_ENV, str(tmp_path_factory.getbasetemp() / "jax-cache"))


def test_cli_bench_writes_json_and_png(tmp_path, capsys):
  rc = cli.main(["bench", "sparse_mla_decode", "--impl", "xla", "--shape", TINY, "--iters", "2",
                 "--out", tmp_path, "--no-progress"])
  assert rc == 0
  jsons = glob.glob(os.path.join(tmp_path, "sparse_mla_decode-*.json"))
  pngs = glob.glob(os.path.join(tmp_path, "sparse_mla_decode-*.png"))
  assert len(jsons) == 1 and len(pngs) == 1
  assert os.path.getsize(pngs[0]) > 1000
  doc = json.load(open(jsons[0]))
  assert doc["op"] == "sparse_mla_decode"
  assert doc["shape"]["B"] == 1 and doc["shape"]["topk"] == 32 and doc["shape"]["page"] == 16
  assert doc["shape"]["softmax_scale"] == pytest.approx(576 ** -0.5)
  for key in ("device_kind", "jax_version", "date", "git_commit", "command", "n_inputs", "iters"):
    assert key in doc
  assert doc["command"].startswith("mla-pallas bench sparse_mla_decode")
  (res,) = doc["results"]
  assert res["impl"] == "xla" and res["status"] == "ok"
  assert res["timer"] == ("wall" if ON_CPU else "cupti")
  n_samples = doc["iters"] * doc["n_inputs"] if ON_CPU else doc["iters"]
  assert len(res["samples_us"]) == n_samples and all(s > 0 for s in res["samples_us"])
  assert res["flops"] == 2 * 1 * 1 * 8 * 32 * (576 + 512)      # FlashMLA convention
  assert res["gathered_bytes"] == 1 * 1 * 32 * 576
  assert res["check_ok"] is True and res["rel_l2"] < res["tolerance"]
  out = capsys.readouterr().out
  assert "median µs" in out and "TFLOP/s" in out and "wrote json" in out


def test_cli_help(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["bench", "--help"])
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert "shape keys" in out and "sparse_mla_decode" in out and "ctx" in out
  with pytest.raises(SystemExit) as e:
    cli.main(["--help"])
  assert e.value.code == 0
  assert "demo" in capsys.readouterr().out


@pytest.mark.parametrize("shape, message", [
    ("B=1,bogus=3", "unknown shape key 'bogus'"),
    ("B=1,H", "key=value"),
    ("B=two", "must be int"),
    ("B=0", "must be positive"),
    ("page=24", "multiple of 16"),
    ("cache=fp16", "shape key 'cache' must be one of fp8, bf16"),
])
def test_cli_bad_shape_is_argparse_error(tmp_path, capsys, shape, message):
  with pytest.raises(SystemExit) as e:
    cli.main(["bench", "sparse_mla_decode", "--impl", "xla", "--shape", shape, "--out", tmp_path])
  assert e.value.code == 2
  assert message in capsys.readouterr().err
  assert not os.listdir(tmp_path)          # nothing was run or written


def test_cli_bad_impl(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["bench", "sparse_mla_decode", "--impl", "cuda"])
  assert e.value.code == 2
  assert "--impl" in capsys.readouterr().err


def test_shape_resolution_and_presets():
  spec = bench.get_spec("sparse_mla_decode")
  s = spec.shape({"B": "3"}, gpu=False)
  assert s["B"] == 3 and s["H"] == 16 and s["topk"] == 128
  g = spec.shape({}, preset="glm5", gpu=True)
  assert g["H"] == 64 and g["topk"] == 2048 and g["page"] == 64 and g["B"] == 128
  d = spec.shape({"H": "32"}, preset="deepseek_v32", gpu=False)
  assert d["H"] == 32 and d["topk"] == 2048            # --shape overrides the preset
  assert bench.parse_shape(" B=1, s_q=2 ,") == {"B": "1", "s_q": "2"}
  with pytest.raises(ValueError, match="no benchmark for op"):
    bench.get_spec("nope")


@pytest.mark.parametrize("ctx, topk", [(64, 32), (48, 40), (40, 57)])
def test_decode_inputs_index_own_slots(ctx, topk):
  # Indices: distinct positions < ctx of the row's own sequence, -1 past ctx (topk > ctx); page 16, B=3, s_q=2.
  spec = bench.get_spec("sparse_mla_decode")
  s = spec.shape({"B": 3, "s_q": 2, "H": 8, "topk": topk, "page": 16, "ctx": ctx}, gpu=False)
  q, cache, idx = spec.make_inputs(s, jax.random.key(1))
  pps = -(-ctx // 16)
  assert q.shape == (3, 2, 8, 576) and q.dtype == np.dtype("bfloat16")
  assert cache.shape == (3 * pps, 16, 576) and cache.dtype == np.dtype("float8_e4m3fn")
  assert idx.shape == (3, 2, topk) and idx.dtype == np.int32
  assert np.isfinite(np.asarray(cache, np.float32)).all()
  idx = np.asarray(idx)
  n_valid = min(topk, ctx)
  assert (idx[..., n_valid:] == -1).all()
  valid = idx[..., :n_valid]
  pages_of = valid // 16
  for b in range(3):
    # Each sequence reads from exactly its own pages (pages are shuffled, never shared between sequences).
    others = set(pages_of[np.arange(3) != b].ravel())
    assert not set(pages_of[b].ravel()) & others
    for t in range(2):
      assert len(set(valid[b, t])) == n_valid       # distinct slots
  assert valid.min() >= 0 and valid.max() < 3 * pps * 16


def test_run_reports_unavailable_mosaic_and_table():
  results = bench.run("sparse_mla_decode", ("xla", "mosaic"), bench.parse_shape(TINY), iters=1, n_inputs=1,
                      progress=False)
  xla, mosaic = results
  assert xla.ok and xla.speedup_vs_xla == pytest.approx(1.0)
  if ON_CPU:   # no kernel runs natively here: NotImplementedError becomes "unavailable: <reason>"
    assert mosaic.status.startswith("unavailable: ") and not mosaic.samples_us
    assert mosaic.available is False
  table = bench.format_table(results)
  for col in ("impl", "timer", "median µs", "p10 µs", "p90 µs", "TFLOP/s", "gath GB/s", "vs xla", "rel-L2"):
    assert col in table
  if ON_CPU:
    assert "mosaic: unavailable" in table


def test_run_prefill_xla():
  (res,) = bench.run("sparse_mla_prefill", ("xla",), {"T": 4, "H": 8, "topk": 40, "page": 16, "ctx": 32},
                     iters=1, n_inputs=1, progress=False)
  assert res.ok and res.check_ok, res.check
  assert res.flops == 2 * 4 * 8 * 40 * (576 + 512)


def test_run_dense_decode_xla_and_bytes():
  """The dense decode spec: every position of every sequence attended (checked against the reference), cache
  bytes read as the "gathered" bytes, the memory-bound default on a GPU, causal as a 0/1 key."""
  spec = bench.get_spec("dense_mla_decode")
  assert spec.shape(gpu=True)["ctx"] == 32768 and spec.shape(gpu=True)["H"] == 16
  shape = {"B": 2, "s_q": 2, "H": 8, "ctx": 40, "page": 16, "causal": 1}
  (res,) = bench.run("dense_mla_decode", ("xla",), shape, iters=1, n_inputs=1, progress=False)
  assert res.ok and res.check_ok, res.check
  assert res.flops == 2 * 2 * 2 * 8 * 40 * (576 + 512) and res.gathered_bytes == 2 * 40 * 576
  with pytest.raises(ValueError, match="causal"):
    bench.run("dense_mla_decode", ("xla",), {**shape, "causal": 2}, iters=1, n_inputs=1, progress=False)


@pytest.mark.parametrize("op,shape", [
    ("sparse_mla_decode", {"B": 2, "s_q": 1, "H": 8, "topk": 40, "page": 16, "ctx": 64}),
    ("dense_mla_decode", {"B": 2, "s_q": 2, "H": 8, "ctx": 40, "page": 16, "causal": 1}),
    ("sparse_mla_prefill", {"T": 4, "H": 8, "topk": 40, "page": 16, "ctx": 32}),
])
def test_bf16_cache_shape_key(op, shape):
  """cache=bf16: a bfloat16 cache (BF16 attention, held to testing.BF16_ATTENTION_REL_L2), 1152 bytes per row in
  the byte counts; the default stays fp8."""
  spec = bench.get_spec(op)
  assert spec.shape(shape)["cache"] == "fp8"
  full = spec.shape({**shape, "cache": "bf16"})
  inputs = spec.make_inputs(full, jax.random.key(0))
  assert inputs[1].dtype == np.dtype("bfloat16")
  assert spec.tolerance(full) == testing.BF16_ATTENTION_REL_L2
  assert spec.gathered_bytes(full) == 2 * spec.gathered_bytes(spec.shape(shape))
  (res,) = bench.run(op, ("xla",), full, iters=1, n_inputs=1, progress=False)
  assert res.ok and res.check_ok, res.check


def test_cli_cache_dtype_flag(tmp_path, capsys):
  rc = cli.main(["bench", "dense_mla_decode", "--impl", "xla", "--cache-dtype", "bf16", "--shape",
                 "B=1,H=8,ctx=32,page=16", "--iters", "1", "--inputs", "1", "--no-plot", "--no-progress",
                 "--out", tmp_path])
  assert rc == 0 and "cache=bf16" in capsys.readouterr().out
  with pytest.raises(SystemExit) as e:
    cli.main(["bench", "quantize_and_bmm_fp8", "--impl", "xla", "--cache-dtype", "bf16", "--out", tmp_path])
  assert e.value.code == 2 and "has no cache" in capsys.readouterr().err


@pytest.mark.skipif(not ON_CPU, reason="exercises the CPU interpret path of the demo")
def test_demo_cpu(capsys):
  # xla at a small shape (2 steps) plus the mosaic kernel in interpret mode at its tiny shape (a few seconds).
  rc = cli.main(["demo", "--batch", "1", "--steps", "2", "--topk", "64", "--ctx", "128", "--no-progress"])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "xla" in out and "mosaic" in out and "PASS" in out
  assert "interpret" in out
  # part 1: the MLA layer (prefill + 2 decode steps, dense then sparse), each stage checked and its graph's
  # implementations reported (all XLA on a CPU)
  assert "FAIL" not in out and "ERROR" not in out
  for stage in ("prefill", "decode 0 (dense)", "decode 1 (sparse)"):
    assert any(line.startswith(stage) and "PASS" in line for line in out.splitlines()), (stage, out)
  assert "mla_prefill=xla" in out and "dense_mla_decode=xla" in out and "sparse_mla_decode=xla" in out
  long = [line for line in out.splitlines() if len(line) > cli.WIDTH]
  assert not long, long
  assert "compile cache: " in out and "2nd call ms" in out
  # part 2's header names the shapes its rows run (here: --batch 1, --topk 64, --ctx 128, H 16; interpret: tiny)
  assert "xla at B1 s_q1 H16 k64 ctx128" in out or "xla and mosaic (interpret) at B1 s_q1 H16 k64 ctx128" in out


def test_time_cupti_aggregation_with_fake_profiler(monkeypatch):
  # CUPTI needs a GPU; check the bookkeeping with a stand-in for profiler.measure that reports two kernels per
  # call (the op is run on each of the 2 input sets per iteration, so 4 launches per iteration).
  from jax.experimental.mosaic.gpu import profiler
  calls = {}

  def fake_measure(f, *, aggregate=True, iterations=1):
    assert aggregate is False
    calls["iterations"] = iterations

    def wrapper(*args):
      out = f(*args)
      per_iter = [[("gather", 0.010 * (i + 1)), ("attn", 0.030), ("gather", 0.010 * (i + 1)), ("attn", 0.030)]
                  for i in range(iterations)]
      return out, (per_iter if iterations > 1 else per_iter[0])
    return wrapper

  monkeypatch.setattr(profiler, "measure", fake_measure)
  sets = [(jax.numpy.ones((4,)) * i,) for i in range(2)]
  samples, kernels = bench.time_cupti(lambda x: x * 2, sets, iters=3, warmup=1)
  assert calls["iterations"] == 3
  # Per call: (2 * gather + 2 * attn) / 2 sets = gather + attn, in microseconds.
  assert samples == pytest.approx([40.0, 50.0, 60.0])
  assert kernels == pytest.approx({"gather": 20.0, "attn": 30.0})
  samples, _ = bench.time_cupti(lambda x: x * 2, sets, iters=1, warmup=0)
  assert samples == pytest.approx([40.0])


# ----------------------------------------------------------------------------------------------------------
# quantize_and_bmm_fp8, rope (fused / unfused, with the device-copy baseline), one MLA decode step
# ----------------------------------------------------------------------------------------------------------

def _one_json(tmp_path, op):
  (path,) = glob.glob(os.path.join(tmp_path, f"{op}-*.json"))
  return json.load(open(path))


def test_cli_bench_bmm_lowercase_keys(tmp_path, capsys):
  rc = cli.main(["bench", "quantize_and_bmm_fp8", "--impl", "xla", "--shape", "t=5,h=2,k=192,n=256,hnk=0",
                 "--iters", "1", "--inputs", "1", "--no-plot", "--out", tmp_path, "--no-progress"])
  assert rc == 0
  doc = _one_json(tmp_path, "quantize_and_bmm_fp8")
  assert doc["shape"] == dict(T=5, H=2, K=192, N=256, hnk=0, per_tensor=0)
  assert doc["bytes_kind"] == "moved" and "2*T*H*K*N" in doc["conventions"]["flops"]
  (res,) = doc["results"]
  assert res["status"] == "ok" and res["check_ok"] is True
  assert res["flops"] == 2 * 5 * 2 * 192 * 256
  assert res["gathered_bytes"] == 5 * 2 * 192 * 2 + 2 * 192 * 256 + 2 * 2 * 2 * 4 + 5 * 2 * 256 * 2
  assert "moved GB/s" in capsys.readouterr().out


def test_bmm_presets_and_interpret_kernel():
  spec = bench.get_spec("quantize_and_bmm_fp8")
  assert spec.shape({}, preset="glm5", gpu=True) == dict(T=4096, H=64, K=192, N=512, hnk=1, per_tensor=0)
  with pytest.raises(ValueError, match="0 or 1"):
    spec.shape({"hnk": 2})
  # the kernel in interpret mode at a tiny shape ([H, N, K] weight, per-tensor scale), against the reference
  results = bench.run("quantize_and_bmm_fp8", ("xla", "mosaic"), dict(T=3, H=2, K=128, N=128, per_tensor=1),
                      iters=1, n_inputs=1, progress=False, interpret=True)
  for r in results:
    assert r.ok and r.check_ok, (r.label, r.status, r.check)
  assert results[1].label == "mosaic[interpret]"


def test_fused_rope_bench_with_copy_baseline():
  shape = dict(T=6, H=8, page=16, max_pos=64)
  results = bench.run("fused_rope_rmsnorm_quantization", ("xla", "copy"), shape, iters=2, n_inputs=1,
                      progress=False)
  xla, copy = results
  assert xla.ok and xla.check_ok and set(xla.check) == {"cache", "q_rope"}
  assert xla.rel_l2 == 0.0                                   # the XLA path is the reference's math, bitwise
  assert copy.ok and copy.check is None and copy.frac_of_copy == pytest.approx(1.0)
  assert xla.frac_of_copy == pytest.approx(copy.median_us / xla.median_us)
  t, h = 6, 8
  moved = t * 576 * 2 + 2 * t * h * 64 * 2 + t * 256 + t * 4 + 512 * 2 + t * 576 + t * 4
  assert xla.gathered_bytes == copy.gathered_bytes == moved and xla.flops == 0 and xla.tflops is None
  # the copy reads and writes half of the op's bytes each
  s = bench.get_spec("fused_rope_rmsnorm_quantization").shape(shape)
  buf = bench.get_spec("fused_rope_rmsnorm_quantization").make_inputs(s, jax.random.key(0))[-1]
  assert buf.nbytes == moved // 8 * 4
  table = bench.format_table(results)
  assert "% copy BW" in table and "moved GB/s" in table and "100%" in table


def test_cli_rope_rmsnorm_all_includes_copy(tmp_path, capsys):
  rc = cli.main(["bench", "rope_rmsnorm", "--impl", "all", "--shape", "T=4,H=4,interleaved=0", "--iters", "1",
                 "--inputs", "1", "--no-plot", "--out", tmp_path, "--no-progress"])
  assert rc == 0
  doc = _one_json(tmp_path, "rope_rmsnorm")
  impls = {r["impl"]: r for r in doc["results"]}
  assert list(impls) == ["xla", "mosaic", "copy"]
  assert impls["xla"]["check_ok"] is True and impls["copy"]["status"] == "ok"
  if ON_CPU:
    assert impls["mosaic"]["status"].startswith("unavailable")
  assert "copy" in doc["conventions"]
  with pytest.raises(SystemExit) as e:        # "copy" is only an impl of the rope specs
    cli.main(["bench", "sparse_mla_decode", "--impl", "copy"])
  assert e.value.code == 2


def test_cli_decode_step_reports_graph_impls(tmp_path, capsys):
  rc = cli.main(["bench", "mla_decode_step", "--impl", "xla", "--shape", "b=2,H=8,topk=32,ctx=128",
                 "--iters", "1", "--inputs", "1", "--no-plot", "--out", tmp_path, "--no-progress"])
  out = capsys.readouterr().out
  assert rc == 0, out
  doc = _one_json(tmp_path, "mla_decode_step")
  assert doc["shape"]["model"] == "deepseek_v32" and doc["shape"]["page"] == 64
  assert "mla_decode_branch_fp8" in doc["conventions"]["scope"]
  for res in doc["results"]:
    assert res["status"] == "ok" and res["check_ok"] is True and list(res["check"]) == ["out"]
    info = res["info"]
    assert info["graph"] == "mla_decode_branch_fp8" and info["heads_run"] == 8
    ops = [s["op"] for s in info["steps"]]
    assert ops == ["fused_rope_rmsnorm_quantization", "quantize_and_bmm_fp8", "sparse_mla_decode",
                   "quantize_and_bmm_fp8"]
    if ON_CPU:
      assert {s["impl"] for s in info["steps"]} == {"xla"}
    # FLOPs: attention (FlashMLA convention) + the two absorbed BMMs (nope 128, v 128)
    assert res["flops"] == 2 * 2 * 8 * 32 * (576 + 512) + 2 * 2 * 8 * 512 * (128 + 128)
  assert "xla ran: fused_rope_rmsnorm_quantization=xla" in out


def test_decode_step_shapes_from_model_and_tp():
  spec = bench.get_spec("mla_decode_step")
  g = spec.shape({"model": "glm5", "tp": "8", "H": "0", "topk": "0", "page": "0"}, gpu=False)
  assert (g["H"], g["topk"], g["page"]) == (64, 2048, 64)
  assert bench_specs._step_cfg(g).num_heads == 8 and bench_specs._step_cfg(g).qk_nope_head_dim == 192
  d = spec.shape({}, preset="deepseek_v32", gpu=True)
  assert (d["B"], d["s_q"], d["H"], d["topk"], d["ctx"]) == (128, 1, 128, 2048, 32768)
  with pytest.raises(ValueError, match="model"):
    spec.shape({"model": "llama"})
  with pytest.raises(ValueError, match="tp"):
    spec.shape({"H": "16", "tp": "3"})


def test_time_cupti_state_threads_donated_state(monkeypatch):
  # A stand-in for the CUPTI hooks: 2 kernels of the same name per call, 2 sets, 3 iterations. The state input is
  # donated and fed back (the counter advances once per call), and the caller's arrays stay usable (the state is
  # copied first).
  launches = []

  class FakeExt:
    def _cupti_init(self):
      launches.clear()

    def _cupti_get_timings(self, finalize):
      return [(name, ms) for i in range(len(launches)) for name, ms in (("mosaic", 0.002), ("mosaic", 0.004))]

  monkeypatch.setattr(bench_timing, "_cupti_ext", lambda: FakeExt())
  seen = []

  def fn(counter, x):
    jax.debug.callback(lambda c: (launches.append(1), seen.append(int(c))), counter)
    return counter + 1, x * 2

  sets = [(jax.numpy.int32(10 * i), jax.numpy.ones(3)) for i in range(2)]
  samples, kernels = bench.time_cupti_state(fn, sets, (0, 0), iters=3, warmup=1)
  assert samples == pytest.approx([6.0] * 3)                   # (2 + 4 µs) per call; 2 calls / 2 sets
  # a name repeated within one call (every Mosaic kernel is "anonymous_mosaic_gpu_kernel") is kept apart
  assert kernels == pytest.approx({"mosaic": 2.0, "mosaic#2": 4.0})
  assert seen[-6:] == [2, 12, 3, 13, 4, 14]                    # compile call + warm-up, then 3 timed passes
  assert int(sets[0][0]) == 0 and int(sets[1][0]) == 10        # not consumed


# ----------------------------------------------------------------------------------------------------------
# Module structure, sweeps, compilation cache, demo output width
# ----------------------------------------------------------------------------------------------------------

def test_engine_imports_no_specs():
  # bench_engine knows no op; bench_specs imports the engine, never bench; bench reaches the specs lazily.
  import subprocess
  import sys
  code = ("import sys; import mla_pallas.bench_engine, mla_pallas.bench; "
          "assert 'mla_pallas.bench_specs' not in sys.modules, 'imported eagerly'; "
          "from mla_pallas import bench; bench.specs(); assert 'mla_pallas.bench_specs' in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
  import ast
  for mod, banned in ((bench_engine, {"mla_pallas.bench", "mla_pallas.bench_specs"}),
                      (bench_timing, {"mla_pallas.bench", "mla_pallas.bench_specs", "mla_pallas.bench_engine"}),
                      (bench_specs, {"mla_pallas.bench"})):
    tree = ast.parse(open(mod.__file__).read())
    names = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    names |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
              for a in n.names}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not names & banned, (mod.__name__, names & banned)
  assert bench.SPECS is bench.specs() and bench.get_spec("sparse_mla_decode").name == "sparse_mla_decode"


def _fake_sweep(calls, module_name, cands):
  def sweep_configs(**kw):
    calls.append(("sweep_configs", module_name, kw))
    return cands
  return sweep_configs


def test_sweep_rows_pass_tuning_to_private_entry(monkeypatch, tmp_path, capsys):
  # --sweep on quantize_and_bmm_fp8: sweep_configs (monkeypatched: the contract's signature) gets the shape's
  # sizes; each candidate's tuning reaches _bmm_jit(..., impl="mosaic", tuning=) (the kernel in interpret mode),
  # rows are labelled by candidate and checked against the reference.
  from mla_pallas.ops import bmm_fp8
  calls = []
  cands = {"default": (), "regs": (("a_quant", "registers"),)}
  monkeypatch.setattr(bmm_fp8, "sweep_configs", _fake_sweep(calls, "bmm_fp8", cands), raising=False)
  real = bmm_fp8._bmm_jit
  seen = []

  def spy(*a, **kw):
    seen.append((kw.get("impl"), kw.get("tuning"), kw.get("interpret")))
    return real(*a, **kw)
  monkeypatch.setattr(bmm_fp8, "_bmm_jit", spy)
  rc = cli.main(["bench", "quantize_and_bmm_fp8", "--sweep", "--interpret", "--shape", "T=3,H=2,K=128,N=128",
                 "--iters", "1", "--inputs", "1", "--no-plot", "--out", tmp_path, "--no-progress",
                 "--no-compile-cache"])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert calls == [("sweep_configs", "bmm_fp8", dict(t=3, k=128, n=128, h=2))]
  assert ("mosaic", (), True) in seen and ("mosaic", (("a_quant", "registers"),), True) in seen
  doc = _one_json(tmp_path, "quantize_and_bmm_fp8")
  rows = [(r["impl"], r["candidate"], r["tuning"]) for r in doc["results"]]
  assert rows == [("xla", None, None), ("mosaic", "default", []), ("mosaic", "regs", [["a_quant", "registers"]])]
  assert all(r["status"] == "ok" and r["check_ok"] for r in doc["results"]), doc["results"]
  assert "mosaic:regs[interpret]" in out and "a_quant='registers'" in out


def test_sweep_only_keeps_the_default_and_matching_candidates(monkeypatch, tmp_path, capsys):
  from mla_pallas.ops import bmm_fp8
  cands = {"default": (), "regs": (("a_quant", "registers"),), "smem": (("a_quant", "smem"),)}
  monkeypatch.setattr(bmm_fp8, "sweep_configs", _fake_sweep([], "bmm_fp8", cands), raising=False)
  base = ["bench", "quantize_and_bmm_fp8", "--impl", "mosaic", "--interpret", "--shape", "T=3,H=2,K=128,N=128",
          "--iters", "1", "--inputs", "1", "--no-plot", "--out", tmp_path, "--no-progress", "--no-compile-cache"]
  assert cli.main(base + ["--sweep", "--sweep-only", "regs"]) == 0
  capsys.readouterr()
  rows = [r["candidate"] for r in _one_json(tmp_path, "quantize_and_bmm_fp8")["results"]]
  assert rows == ["default", "regs"]
  for extra, message in ((["--sweep-only", "regs"], "needs --sweep"),
                         (["--sweep", "--sweep-only", "nothing"], "matches no candidate")):
    with pytest.raises(SystemExit) as e:
      cli.main(base + extra)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_sweep_sparse_decode_xla_impl_and_unavailable_kernel(monkeypatch):
  # Sparse decode: sweep_configs gets h, batch_tokens = B * s_q, topk, arch; the candidate rows go through
  # _sparse_decode_jit with tuning=. Without interpret mode on a CPU they are "unavailable" (the plain mosaic
  # impl's NotImplementedError), with it they run (the fake entry point here computes the XLA path).
  from mla_pallas.ops import sparse_decode
  calls = []
  cands = {"default": (), "k3": (("k_buffers", 3),)}
  monkeypatch.setattr(sparse_decode, "sweep_configs", _fake_sweep(calls, "sparse_decode", cands), raising=False)
  real = sparse_decode._sparse_decode_jit
  seen = []

  def fake(q, kv, idx, kv_scale, topk_length, **kw):
    seen.append((kw["impl"], kw.get("tuning"), kw.get("arch")))
    return real(q, kv, idx, kv_scale, topk_length, **{**kw, "impl": "xla", "tuning": ()})
  monkeypatch.setattr(sparse_decode, "_sparse_decode_jit", fake)
  shape = bench.parse_shape("B=2,s_q=2,H=8,topk=32,page=16,ctx=64")
  results = bench.run("sparse_mla_decode", ("xla", "mosaic"), shape, sweep=True, iters=1, n_inputs=1,
                      progress=False, interpret=True)
  assert calls == [("sweep_configs", "sparse_decode", dict(h=8, batch_tokens=4, topk=32, arch="sm90",
                                                          cache_dtype="float8_e4m3fn"))]
  assert [r.label for r in results] == ["xla", "mosaic:default[interpret]", "mosaic:k3[interpret]"]
  assert all(r.ok and r.check_ok for r in results), [(r.label, r.status) for r in results]
  assert ("mosaic", (("k_buffers", 3),), "sm90") in seen
  if ON_CPU:
    results = bench.run("sparse_mla_decode", ("mosaic",), shape, sweep=True, iters=1, n_inputs=1, progress=False)
    assert [r.status.split(":")[0] for r in results] == ["unavailable", "unavailable"]
  # prefill: batch_tokens = T
  bench.run("sparse_mla_prefill", ("mosaic",), {"T": 3, "H": 8, "topk": 32, "page": 16, "ctx": 64}, sweep=True,
            iters=1, n_inputs=1, progress=False, interpret=True, check=False)
  assert calls[-1] == ("sweep_configs", "sparse_decode", dict(h=8, batch_tokens=3, topk=32, arch="sm90",
                                                             cache_dtype="float8_e4m3fn"))


def test_sweep_rope_ops_reach_their_entry_points(monkeypatch):
  from mla_pallas.ops import rope_rmsnorm as rr
  calls = []
  monkeypatch.setattr(rr, "sweep_configs", _fake_sweep(calls, "rope_rmsnorm", {"default": (), "x": (("a", 1),)}),
                      raising=False)
  seen = []
  monkeypatch.setattr(rr, "_rope_rmsnorm_mosaic", lambda kv, q, pos, cos, sin, w, eps, **kw: (
      seen.append(("unfused", kw.get("tuning"))), rr._rope_rmsnorm_jit(kv, q, pos, cos, sin, w, eps,
                                                                   interleaved=kw["interleaved"]))[1])
  monkeypatch.setattr(rr, "_fused_mosaic", lambda *a, **kw: (
      seen.append(("fused", kw.get("tuning"))), rr._fused_jit(*a, interleaved=kw["interleaved"]))[1])
  for op, fused in (("rope_rmsnorm", False), ("fused_rope_rmsnorm_quantization", True)):
    shape = dict(T=4, H=4, max_pos=64, **({"page": 16} if fused else {}))
    rows = bench.run(op, ("xla", "mosaic", "copy"), shape, sweep=True, iters=1, n_inputs=1, progress=False,
                     interpret=True)
    assert [r.label for r in rows] == ["xla", "mosaic:default[interpret]", "mosaic:x[interpret]", "copy"]
    assert calls[-1] == ("sweep_configs", "rope_rmsnorm", dict(t=4, h=4, fused=fused))
    assert ("fused" if fused else "unfused", (("a", 1),)) in seen
    assert all(r.ok for r in rows) and rows[2].check_ok, [(r.label, r.status, r.check) for r in rows]


def test_sweep_errors(monkeypatch, capsys):
  from mla_pallas.ops import bmm_fp8
  monkeypatch.delattr(bmm_fp8, "sweep_configs", raising=False)
  for op, message in (("mla_decode_step", "has no sweep candidates"),
                      ("quantize_and_bmm_fp8", "mla_pallas.ops.bmm_fp8 has no sweep_configs")):
    with pytest.raises(SystemExit) as e:
      cli.main(["bench", op, "--sweep", "--no-compile-cache"])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
  for bad, message in (({"x": ()}, "must start with 'default'"), ({"default": (), "y": ("a", 1)}, "pairs"),
                       ({}, "non-empty")):
    monkeypatch.setattr(bmm_fp8, "sweep_configs", lambda bad=bad, **kw: bad, raising=False)
    with pytest.raises(ValueError, match=message):
      bench.sweep_candidates("quantize_and_bmm_fp8", bench.get_spec("quantize_and_bmm_fp8").shape({}))


def test_compile_cache_folder_and_flag(tmp_path, monkeypatch):
  # The cache is on for the duration of main() (files appear in the folder), restored afterwards; the flag and
  # the defaults.
  import jax.numpy as jnp
  folder = tmp_path / "cc"
  before = jax.config.jax_compilation_cache_dir
  with cli.compile_cache(str(folder)) as got:
    assert got == str(folder) and jax.config.jax_compilation_cache_dir == str(folder)
    assert jax.config.jax_persistent_cache_min_compile_time_secs == 0
    jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.25)(jnp.arange(7.0)).block_until_ready()
  assert jax.config.jax_compilation_cache_dir == before
  assert cli._cache_files(str(folder)) > 0
  monkeypatch.delenv(cli.CACHE_ENV)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert cli.default_cache_dir() == str(tmp_path / "xdg" / "mla_pallas" / "jax")
  monkeypatch.setenv(cli.CACHE_ENV, str(tmp_path / "env"))
  assert cli.default_cache_dir() == str(tmp_path / "env")
  seen = []
  monkeypatch.setattr(cli, "_cmd_bench", lambda *a: seen.append(jax.config.jax_compilation_cache_dir) or 0)
  assert cli.main(["bench", "sparse_mla_decode"]) == 0
  assert cli.main(["bench", "sparse_mla_decode", "--no-compile-cache"]) == 0
  assert seen == [str(tmp_path / "env"), before]


def test_demo_formatting_fits_and_names_shapes():
  spec = bench.get_spec("sparse_mla_decode")
  big = spec.shape(dict(B=16, s_q=1, H=128, topk=2048, page=64, ctx=8192), gpu=False)
  tiny = spec.shape(dict(cli._INTERPRET_SHAPE), gpu=False)
  head = cli._part2_header("deepseek_v32", [("xla", False, big, 3), ("mosaic", True, tiny, 1)])
  assert "xla at B16 s_q1 H128 k2048 ctx8192" in head and "mosaic (interpret) at B1 s_q1 H16 k64 ctx128" in head
  assert "xla and mosaic at B16" in cli._part2_header("glm5", [("xla", False, big, 3), ("mosaic", False, big, 3)])
  row = dict(impl="mosaic", mode="native", ran="mosaic-interpret", shape=big, steps=3, rel_l2=1e-2, cos=0.999,
             tol=0.2, check="PASS", first_ms=123456.7, timer="cupti", median_us=12345678.9, note="n " * 200)
  text = cli._demo_table([row, dict(row, impl="xla")])
  assert max(len(line) for line in text.splitlines()) <= cli.WIDTH, text
  wrapped = cli.fit("  " + "word " * 60)
  assert all(len(line) <= cli.WIDTH for line in wrapped.splitlines()) and wrapped.count("\n") >= 2


def test_mla_prefill_bench_spec():
  """mla_prefill: the models' head dims, causal pairs counted as FlashAttention does, separate keys with ctx > 0;
  the XLA row checked against the float32 backend; cudnn / mosaic rows unavailable on a CPU."""
  spec = bench.get_spec("mla_prefill")
  assert spec.shape({}, preset="glm5", gpu=True) == dict(model="glm5", H=64, seqs=2, T=4096, ctx=0, causal=1)
  with pytest.raises(ValueError, match="ctx"):
    spec.shape({"ctx": -1})
  shape = dict(model="glm5", H=2, seqs=3, T=9, ctx=20, causal=1)
  s = spec.shape(shape)
  assert spec.flops(s) == 2.0 * 3 * (9 * 20 + 9 * 10 / 2) * 2 * (256 + 256)
  results = bench.run("mla_prefill", ("xla", "mosaic", "cudnn", "f32"), shape, iters=1, n_inputs=1,
                      progress=False)
  xla, mosaic, cudnn, f32 = results
  assert xla.ok and xla.check_ok and f32.ok
  assert mosaic.status.startswith("unavailable")
  if ON_CPU:
    assert cudnn.status.startswith("unavailable")
  else:                      # no bottom-right causal mask in jax.nn's cuDNN call
    assert "bottom-right" in cudnn.status


def test_mla_prefill_step_bench_spec():
  """The dense prefill branch as a bench: with cached context (block_table / context_lens) and without, checked
  against the graph's reference; the cache is donated and fed back (state)."""
  spec = bench.get_spec("mla_prefill_step")
  assert spec.shape({}, preset="glm5", gpu=True)["H"] == 64
  for ctx in (0, 21):
    shape = dict(model="glm5", seqs=2, T=9, ctx=ctx, H=4, page=16)
    (res,) = bench.run("mla_prefill_step", ("xla",), shape, iters=1, n_inputs=1, progress=False)
    assert res.ok and res.check_ok, (res.status, res.check)
    ops = [st["step"] for st in res.info["steps"]]
    assert any("cached context" in op for op in ops) == (ctx > 0), ops


def test_mla_layer_decode_bench_spec():
  """One FP8 layer's decode (projections included) as a bench: K-major weights as to_fp8 stores them, the cache
  donated and fed back, checked against the layer's float32 reference; the GPU default is DeepSeek-V3.2 B1."""
  spec = bench.get_spec("mla_layer_decode")
  assert spec.shape({}, preset="deepseek_v32", gpu=True)["H"] == 128
  shape = dict(model="glm5", B=2, s_q=2, H=8, topk=24, page=16, ctx=64)
  (res,) = bench.run("mla_layer_decode", ("xla",), shape, iters=2, n_inputs=1, progress=False)
  assert res.ok and res.check_ok, (res.status, res.check)
  lay = bench.get_spec("mla_layer_decode").make_inputs(spec.shape(shape), jax.random.key(0))[0]
  assert lay.fp8 and lay.kernel_layout
  with pytest.raises(ValueError, match="tp"):
    spec.shape(dict(shape, tp=3))


def test_mla_prefill_sweep_runs_the_kernel_candidates_in_interpret_mode():
  from mla_pallas.ops import prefill as pf
  cands = pf.sweep_configs(192, 128)
  assert list(cands)[0] == "default" and "block_kv=64,kv_stages=2" in cands     # the default is 128-key blocks
  # at 256 / 256 (fp8 P·V, 64-key blocks by default) three stages fit, 128-key blocks do not; the other schedule
  # (pingpong) and the bf16 P·V
  assert pf.sweep_configs(256, 256) == {"default": (), "block_kv=64,kv_stages=3": (("block_kv", 64), ("kv_stages", 3)),
                                        "pingpong=True": (("pingpong", True),),
                                        "block_kv=64,pv_fp8=False": (("block_kv", 64), ("pv_fp8", False))}
  results = bench.run("mla_prefill", ("mosaic",), dict(H=1, seqs=1, T=64, ctx=0, causal=1), iters=1, n_inputs=1,
                      progress=False, interpret=True, sweep=True)
  assert len(results) == len(cands)
  for r in results:
    assert r.ok and r.check_ok, (r.label, r.status, r.check)


def test_invariant_shape_key_reaches_the_op_not_the_reference(rng):
  """invariant=1 runs the op with batch_invariant=True (the reference takes no such keyword); other values are a
  shape error naming the key."""
  spec = bench.get_spec("sparse_mla_decode")
  s = spec.shape(dict(invariant=1, B=2, topk=64, ctx=128))
  import functools
  op = spec.op("xla", s)
  assert isinstance(op, functools.partial) and op.keywords["batch_invariant"] is True
  assert "batch_invariant" not in spec.reference(s).keywords
  with pytest.raises(ValueError, match="invariant"):
    spec.shape(dict(invariant=2))
  (res,) = bench.run("dense_mla_decode", ("xla",), dict(invariant=1, B=2, ctx=128), iters=1, n_inputs=1,
                     progress=False)
  assert res.ok and res.check_ok


def test_sweep_dense_decode_runs_both_routes_in_interpret_mode():
  # Dense decode: sweep_configs gets h, batch_tokens, n_pos (pages · page), page, cache dtype; the candidates are
  # the dense kernel (default, k_buffers=3) and the sparse-kernel route, each checked against the reference.
  shape = bench.parse_shape("B=2,s_q=1,H=64,ctx=100,page=64")
  results = bench.run("dense_mla_decode", ("mosaic",), shape, sweep=True, iters=1, n_inputs=1, progress=False,
                      interpret=True)
  assert [r.label for r in results] == ["mosaic:default[interpret]", "mosaic:route=sparse[interpret]",
                                        "mosaic:k_buffers=3[interpret]"]
  assert all(r.ok and r.check_ok for r in results), [(r.label, r.status) for r in results]
  from mla_pallas.ops import dense_decode
  # bf16 cache: the dense kernel's bf16 form (heads on M at every H, two K buffers only), the sparse route and the
  # bf16 form's other schedule
  assert list(dense_decode.sweep_configs(16, 2, 128, cache_dtype="bfloat16")) == ["default", "route=sparse",
                                                                                  "schedule=seesaw"]
  results = bench.run("dense_mla_decode", ("mosaic",), bench.parse_shape("B=2,s_q=1,H=16,ctx=100,page=64,cache=bf16"),
                      sweep=True, iters=1, n_inputs=1, progress=False, interpret=True)
  assert [r.label for r in results] == ["mosaic:default[interpret]", "mosaic:route=sparse[interpret]",
                                        "mosaic:schedule=seesaw[interpret]"]
  assert all(r.ok and r.check_ok for r in results), [(r.label, r.status) for r in results]
  assert list(dense_decode.sweep_configs(16, 2, 128)) == ["default", "route=sparse", "k_buffers=2", "k_buffers=3",
                                                          "k_buffers=5"]


def test_cupti_breakdown_by_stage_and_when_sets_interleave():
  """bench_timing._aggregate_cupti: sets launched one after another keep a graph's repeated kernel names apart as
  stages ("#2"); sets that XLA interleaved in one program give each name its total per call (stages merged), so a
  kernel that ran once per call is never reported as two half-time stages. The samples are the same either way."""
  from mla_pallas import bench_timing
  k, f = "anonymous_mosaic_gpu_kernel", "loop_fusion"
  grouped = [[(f, 0.001), (k, 0.1), (k, 0.05), (f, 0.001), (k, 0.1), (k, 0.05)]] * 3     # 2 sets, 3 iterations
  samples, kernels = bench_timing._aggregate_cupti(grouped, 2)
  assert samples == [pytest.approx(151.0)] * 3
  assert kernels == pytest.approx({f: 1.0, k: 100.0, f"{k}#2": 50.0})
  interleaved = [[(f, 0.001), (f, 0.001), (k, 0.2), (k, 0.2)]] * 3                    # one kernel per call
  samples, kernels = bench_timing._aggregate_cupti(interleaved, 2)
  assert samples == [pytest.approx(201.0)] * 3
  assert kernels == pytest.approx({f: 1.0, k: 200.0})
  ragged = [[(f, 0.001), (k, 0.2), (k, 0.2)]] * 3                                     # not divisible by the sets
  assert bench_timing._aggregate_cupti(ragged, 2)[1] == pytest.approx({f: 0.5, k: 200.0})
