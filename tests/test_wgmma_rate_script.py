"""benchmarks/wgmma_rate_gpu.py on the CPU: each kind of kernel it times lowers for sm_90a with the wgmma shape and
operand source its row names (so a row measures what it says)."""
from __future__ import annotations

import importlib.util
import pathlib

import pytest

from mla_pallas import testing

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "wgmma_rate_gpu.py"


@pytest.fixture(scope="module")
def rate():
  spec = importlib.util.spec_from_file_location("wgmma_rate_gpu", _PATH)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


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
