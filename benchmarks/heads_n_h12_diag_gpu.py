"""One-off (H200): at H 12 (not a kernel head count) the heads-on-N kernel's two Q paths differed in 4 heads of
one token. Which one is off the reference? Prints per-(token, head) rel-L2 of each path against the reference."""
import sys
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, "tests")
from _sparse_inputs import make_case, run_kernel  # noqa: E402
from mla_pallas import reference  # noqa: E402

rng = np.random.default_rng(0)
for H in (12, 8):
  case = make_case(rng, B=2, s_q=2, H=H, topk=2051, page_size=64, num_pages=256, kv_scale=0.5)
  ref, _ = reference.sparse_mla_decode(case.q, case.kv, case.indices, softmax_scale=case.softmax_scale,
                                       kv_scale=case.kv_scale)
  ref = np.asarray(ref, np.float32)
  for tuning in ((), (("q_in_kernel", False),)):
    out, _ = run_kernel(case, interpret=False, tuning=tuning)
    out = np.asarray(out, np.float32)
    err = np.linalg.norm(out - ref, axis=-1) / (np.linalg.norm(ref, axis=-1) + 1e-30)
    bad = np.argwhere(err > 0.1)
    print(f"H={H} {tuning or 'q_in_kernel'}: max per-head rel-L2 {err.max():.3e}; heads over 0.1: {bad.tolist()}")
