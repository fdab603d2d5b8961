"""benchmarks/sparse_sm90_diagnose_gpu.py on the CPU: every ablation / variant row patches a function that exists
(``unittest.mock.patch.object`` raises otherwise) and the patched kernels still lower for sm_90a, each to other IR
than the unpatched kernel (so a patch that no longer reaches the kernel fails here, not on the GPU)."""
from __future__ import annotations

import importlib.util
import pathlib
import re

import jax
import pytest

from mla_pallas import bench, testing

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "sparse_sm90_diagnose_gpu.py"


@pytest.fixture(scope="module")
def diag():
  spec = importlib.util.spec_from_file_location("sparse_sm90_diagnose_gpu", _PATH)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.parametrize("H,tuning", [(128, (("schedule", "producer_vt"),)), (64, (("schedule", "twin"),)),
                                      (8, ())])
def test_rows_patch_the_kernel(diag, H, tuning):
  spec = bench.get_spec("sparse_mla_decode")
  full = spec.shape({"B": "2", "s_q": "1", "H": str(H), "topk": "2048", "ctx": "4096"})
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in spec.make_inputs(full, jax.random.key(0))]

  def ir(row):
    with diag.patched(row):
      return "".join(testing.lower_for_cuda(spec.tuned_op(full, tuning, False), *avals).mosaic)
  base = ir("none")
  # which rows reach which schedule: the QKᵀ and softmax patches are heads-on-M functions, the Vᵀ words exist
  # in "producer_vt" and the heads-on-N design
  rows = ["no_gather", "no_pv"]
  rows += ["no_qk", "no_softmax"] if H > 16 else []
  vt = H <= 16 or tuning == (("schedule", "producer_vt"),)
  rows += ["no_vt_words", "pv_all_blocks" if tuning and tuning[0][1] == "producer_vt" else "pv_pipelined"] if vt else []
  producer_rows = ["regs_56_88_184", "regs_24_72_208", "p_slots_3", "eager_rescale", "p_store_ref", "exact_math",
                   "scaled_logits", "before_s29", "qk_20", "alpha_min", "pv_prmt_each", "key_words_each", "s32_base",
                   "p_desc_per_call", "q_rows_multipliers"]
  rows += producer_rows if tuning == (("schedule", "producer_vt"),) else []
  # the heads-on-N P·V's fragment forms (vt_registers.block_operands, which only the heads-on-N kernel calls)
  # (the heads-on-N consumer's V words are per key: key_words_shared reverts them; key_words_each, the
  # multipliers', is then a no-op there)
  rows += ["fragments_fused", "heads_n_4cb55bb", "key_words_shared", "p_desc_per_call"] if H <= 16 else []
  for row in rows:
    assert ir(row) != base, row


@pytest.fixture(scope="module")
def lowered_row(diag):
  """``lowered_row(row)``: the op's "producer_vt" kernel (B2 s_q1 H128 top-k 2048) with ``row`` patched in,
  lowered for sm_90a (cached per row)."""
  spec = bench.get_spec("sparse_mla_decode")
  full = spec.shape({"B": "2", "s_q": "1", "H": "128", "topk": "2048", "ctx": "4096"})
  avals = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in spec.make_inputs(full, jax.random.key(0))]
  tuning = (("schedule", "producer_vt"),)
  cache = {}

  def lowered(row):
    if row not in cache:
      with diag.patched(row):
        cache[row] = testing.lower_for_cuda(spec.tuned_op(full, tuning, False), *avals)
    return cache[row]
  return lowered


def test_qk_20_issues_the_zero_steps(lowered_row):
  """Row qk_20: the producer's QKᵀ as five full chunks, 20 fp8 m64n64k32 wgmmas per tile against the default's 18
  (``heads_m._qk_fp8_18`` skips the first two k32 steps of the fifth chunk, which meet Q's zero columns)."""
  qk = r"m64n64k32\.f32\.e4m3\.e4m3"
  assert lowered_row("none").count(qk) == 18 and lowered_row("qk_20").count(qk) == 20


def test_multiplier_pv_instruction_counts(lowered_row):
  """The multipliers' Vᵀ fragments per tile (lowered default): 32 ``prmt`` (one per register pair of two blocks,
  made before the first wgmma), 64 e4m3x2 → f16x2 conversions (of a pair register's low or high half), 16 P·V
  wgmmas and two ``wait_group 1`` (one block at a time); row pv_prmt_each builds each block from the words, 64
  ``prmt``. The 16 V loads per tile take their key's offset as an immediate (2 base registers), row key_words_each
  an address register per key."""
  low, each = lowered_row("none"), lowered_row("pv_prmt_each")
  assert low.count(r"prmt.b32") == 32 and each.count(r"prmt.b32") == 64
  for text in (low, each):
    assert text.count(r"cvt.rn.f16x2.e4m3x2") == 64 and text.count(r"m64n64k16.f32.f16.f16") == 16
    assert text.count(r"wgmma.wait_group.sync.aligned 1;") == 2
  loads = re.findall(r"ld\.shared\.v2\.b32 \{\$0, \$1\}, \[\$2(\+\d+)?\]", "\n".join(low.mosaic))
  assert sorted(loads, key=lambda o: int(o[1:])) == [f"+{1024 * (i // 2)}" for i in range(16)], loads
  assert lowered_row("key_words_each").count(r"ld\.shared\.v2\.b32 \{\$0, \$1\}, \[\$2\]") == 16


def test_cli_lower_only(diag, capsys):
  assert diag.main(["--lower-only", "--shape", "B=2,s_q=1,H=64,topk=256,ctx=512", "--rows", "none,no_pv"]) == 0
  assert "no_pv: lowered" in capsys.readouterr().out


def test_timeline_summary(diag):
  """The timeline's per-warpgroup table from a trace in the profiler's format (tid = 1 + warpgroup + 4 · block,
  ts = (start ns + cycles) / 1e3): two blocks, the producer's regions twice per block, a multiplier's once."""
  ev = []
  for block in range(2):
    t0 = 1000.0 * block
    for i, (name, a, b) in enumerate([("p_qk", 0, 100), ("p_softmax", 100, 250), ("p_qk", 300, 400)]):
      ev += [dict(name=name, ph="B", ts=(t0 + a) / 1e3, tid=1 + 4 * block, pid=1),
             dict(name=name, ph="E", ts=(t0 + b) / 1e3, tid=1 + 4 * block, pid=1)]
    ev += [dict(name="m_wait_p", ph="B", ts=(t0 + 10) / 1e3, tid=2 + 4 * block, pid=1),
           dict(name="m_wait_p", ph="E", ts=(t0 + 60) / 1e3, tid=2 + 4 * block, pid=1)]
  rows = {(r["role"], r["region"]): r for r in diag.timeline_summary({"traceEvents": ev})}
  qk = rows[("producer", "p_qk")]
  assert qk["cycles_per_cta"] == pytest.approx(200) and qk["count_per_cta"] == 2 and qk["ctas"] == 2
  assert qk["cycles_per_span"] == pytest.approx(100) and qk["share_of_span"] == pytest.approx(0.5)
  assert rows[("producer", "p_softmax")]["cycles_per_cta"] == pytest.approx(150)
  assert rows[("multiplier 0", "m_wait_p")]["share_of_span"] == pytest.approx(1.0)
  assert not any(r["role"] == "loader" for r in rows.values())


def test_timeline_lowers(diag, capsys):
  """The profiled "producer_vt" kernel (named regions, profiler buffers) lowers for sm_90a."""
  assert diag.main(["--lower-only", "--timeline", "--shape", "B=2,s_q=1,H=128,topk=1024,ctx=4096",
                    "--rows", "none", "--tuning", "schedule=producer_vt"]) == 0
  assert "timeline: the profiled kernel lowered" in capsys.readouterr().out
