"""Run one DeepSeek-V3.2 decode step (B 128, top-k 2048, the mla_decode_step bench inputs) with exactly one op on
its Mosaic kernel and every other op on XLA, to find which kernel fails inside the graph.

  PYTHONPATH=. python3 benchmarks/decode_step_isolate_gpu.py OP     (OP: an op name, "all" or "none")

Prints one line: OP, OK/FAIL, rel-L2 against the all-XLA step.
"""
import sys

import jax
import numpy as np

from mla_pallas import bench_specs as bs, graph

op = sys.argv[1]
s = dict(model="deepseek_v32", B=128, s_q=1, H=0, tp=1, topk=0, page=0, ctx=32768, kv_scale=1.0)
if len(sys.argv) > 2:        # a smaller context for a CPU dry run
  s.update(B=int(sys.argv[2]), ctx=int(sys.argv[3]))
bs._step_validate(s)         # resolves H, topk, page from the preset
args = bs._step_inputs_jit(tuple(sorted(s.items())), jax.random.key(0))
impl = {"none": "xla", "all": "mosaic"}.get(op, {"default": "xla", op: "mosaic"})


def run(impl):
  cfg = bs._step_cfg(s)
  (pages, kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin, indices, w_uk, uks, w_uv, uvs, norm_w) = args
  w = graph.MLAWeightsFP8(w_uk, uks, w_uv, uvs, norm_w)
  y, _ = graph.mla_decode_branch_fp8(w, jax.numpy.copy(pages), kv_scale, q_nope, q_rope, kv, positions, slots, cos,
                                     sin, cfg=cfg, indices=indices, impl=impl)
  return np.asarray(jax.block_until_ready(y), np.float32)


try:
  ref = run("xla")
  y = run(impl)
  rel = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
  print(f"ISOLATE {op}: OK rel-L2 vs xla {rel:.3e}; ran: {graph.format_report(graph.graph_report())!r}", flush=True)
except Exception as e:   # noqa: BLE001
  print(f"ISOLATE {op}: FAIL {type(e).__name__}: {str(e)[:300]}", flush=True)
