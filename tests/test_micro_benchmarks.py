"""The micro-benchmarks benchmarks/wgmma_rate_gpu.py and benchmarks/convert_rate_gpu.py on the CPU: each kind of
kernel they time lowers for sm_90a with the instructions its row names, as many as the rates assume (so a row
measures what it says)."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

from mla_pallas import testing

_BENCH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str):
  spec = importlib.util.spec_from_file_location(name, _BENCH / f"{name}.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.fixture(scope="module")
def rate():
  return _load("wgmma_rate_gpu")


@pytest.fixture(scope="module")
def conv():
  return _load("convert_rate_gpu")


@pytest.mark.parametrize("dtype,n,a_regs", [("f16", 64, False), ("fp8", 128, True), ("fp8", 256, False)])
def test_kernel_issues_the_named_wgmma(rate, dtype, n, a_regs):
  kern, k = rate.build(dtype, n, a_regs, warpgroups=2, reps=8, ctas=4)
  low = testing.lower_for_cuda(kern, *rate._inputs(dtype, n, k), arch=(9, 0))
  shape = f"m64n{n}k16\\.f32\\.f16\\.f16" if dtype == "f16" else f"m64n{n}k32\\.f32\\.e4m3\\.e4m3"
  assert low.count(shape) == 4          # one plgpu.wgmma call: 4 k-steps of the 128-byte operand (in the loop)
  assert low.count(r"wgmma\.mma_async") == 4
  # A from registers: the instruction's second operand is a register list ({$64,...}); from SMEM a descriptor ($64)
  regs_a = low.count(r"wgmma\.mma_async[^ ]* \{[^}]*\}, \{")
  assert regs_a == (4 if a_regs else 0)


@pytest.mark.parametrize("row", ["cvt.f16x2.e4m3x2", "ex2.approx.ftz+cvt.f16x2.f32", "prmt"])
def test_convert_kernel_issues_the_named_instructions(conv, row):
  """Per loop iteration every thread's 32 values take INNER instructions each, split evenly between the kinds."""
  kinds = row.split("+")
  low = testing.lower_for_cuda(conv.build(tuple(kinds), reps=4, ctas=2), arch=(9, 0))
  opcode = {"cvt.f16x2.e4m3x2": r"cvt\.rn\.f16x2\.e4m3x2", "cvt.f16x2.f32": r"cvt\.rn\.f16x2\.f32",
            "ex2.approx.ftz": r"ex2\.approx\.ftz\.f32", "prmt": r"prmt\.b32 \$0, \$1, \$1, 0x2103"}
  for kind in kinds:
    assert low.count(opcode[kind]) == 32 * conv.INNER // len(kinds)
