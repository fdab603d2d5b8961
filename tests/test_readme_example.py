"""The README's "Quick start in Python" example runs as written, so README and code cannot drift.

The code block is taken from README.md by its section heading and executed in a fresh namespace. The example's own
assertions compare its jitted sparse decode and the layer's decode step against the float32 references, with the
tolerances of :func:`mla_pallas.testing.fp8_error_budget` (error model in its docstring: the ops round q and P to
e4m3, the references do not). This test also checks what the example leaves behind: output shapes, dtypes and
finiteness, the cache lengths, which graph branch ran, and that the donated cache buffer was consumed.
On a GPU the same code runs the Mosaic GPU kernels (``impl="auto"``).
"""
from __future__ import annotations

import pathlib
import re

import jax.numpy as jnp
import numpy as np

from mla_pallas import graph

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
HEADING = "## Quick start in Python"


def readme_example() -> str:
  """The one ```python block of the README section titled HEADING."""
  text = README.read_text()
  assert text.count(HEADING + "\n") == 1, f"README.md must have exactly one section {HEADING!r}"
  section = text.split(HEADING + "\n", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) == 1, f"section {HEADING!r} must hold exactly one python code block; found {len(blocks)}"
  return blocks[0]


def test_readme_example_is_a_short_read():
  lines = [line for line in readme_example().splitlines() if line.strip()]
  assert 20 <= len(lines) <= 30, f"the quick start should stay 20-30 lines of Python; it has {len(lines)}"
  assert max(len(line) for line in lines) <= 120


def test_readme_example_runs(capsys):
  ns = {"__name__": "readme_quick_start"}
  exec(compile(readme_example(), f"README.md ({HEADING})", "exec"), ns)
  cfg, b, ctx = ns["cfg"], ns["B"], ns["ctx"]
  h = cfg.num_heads
  out, y = ns["out"], ns["y"]
  assert out.shape == (b, 1, h, 512) and out.dtype == jnp.bfloat16
  assert y.shape == (b, 1, cfg.hidden_size) and y.dtype == jnp.bfloat16
  for name, a in (("out", out), ("y", y)):
    a = np.asarray(a, np.float32)
    assert np.isfinite(a).all() and np.abs(a).max() > 0, f"{name} must be finite and not all zero"
  # ctx cached tokens, the jitted step's token, the layer's token
  np.testing.assert_array_equal(np.asarray(ns["kvc"].seq_lens), np.full(b, ctx + 2))
  assert ns["pages"].is_deleted(), "the layer's decode donates the cache pages it was given"
  rep = graph.graph_report()
  assert rep["graph"] == "mla_decode_branch_fp8" and rep["branch"] == "decode"
  assert [s["op"] for s in rep["steps"]] == ["fused_rope_rmsnorm_quantization", "quantize_and_bmm_fp8",
                                            "dense_mla_decode", "quantize_and_bmm_fp8"]
  assert graph.format_report(rep) in capsys.readouterr().out
