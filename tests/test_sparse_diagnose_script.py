"""benchmarks/sparse_sm90_diagnose_gpu.py on the CPU: every ablation / variant row patches a function that exists
(``unittest.mock.patch.object`` raises otherwise) and the patched kernels still lower for sm_90a, each to other IR
than the unpatched kernel (so a patch that no longer reaches the kernel fails here, not on the GPU)."""
from __future__ import annotations

import importlib.util
import pathlib

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
  rows += ["regs_56_88_184", "regs_24_72_208"] if tuning == (("schedule", "producer_vt"),) else []
  for row in rows:
    assert ir(row) != base, row


def test_cli_lower_only(diag, capsys):
  assert diag.main(["--lower-only", "--shape", "B=2,s_q=1,H=64,topk=256,ctx=512", "--rows", "none,no_pv"]) == 0
  assert "no_pv: lowered" in capsys.readouterr().out
