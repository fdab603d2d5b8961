"""Random inputs for the sparse MLA decode tests (shared by the CPU and GPU test files).

Every case draws fresh N(0, 1) data; the cache holds NaN in every row that no valid index names, and the indices
mix valid slots with invalid ones (-1, num_slots, large, negative), duplicates, and (with ``all_invalid_row``)
one query token whose indices are all invalid.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

FP8 = jnp.float8_e4m3fn


@dataclasses.dataclass
class SparseCase:
  q: jnp.ndarray            # [B, s_q, H, 576] bf16
  kv: jnp.ndarray           # [num_pages, page_size, 576] fp8 (NaN in unused rows)
  indices: jnp.ndarray      # [B, s_q, topk] int32
  topk_length: jnp.ndarray | None
  softmax_scale: float
  kv_scale: float


def make_case(rng: np.random.Generator, *, B=2, s_q=1, H=16, topk=37, page_size=16, num_pages=32,
              kv_scale=1.0, softmax_scale=192 ** -0.5, with_topk_length=False,
              all_invalid_row=True) -> SparseCase:
  num_slots = num_pages * page_size
  used = num_slots // 2                     # rows [used, num_slots) are never named by a valid index
  rows = rng.standard_normal((num_slots, 576)).astype(np.float32)
  rows[used:] = np.nan
  kv = jnp.asarray(rows.reshape(num_pages, page_size, 576)).astype(FP8)
  idx = rng.integers(0, used, (B, s_q, topk)).astype(np.int32)
  bad = np.array([-1, num_slots, num_slots + 3, -(2 ** 31), 2 ** 31 - 1], np.int32)
  flat = idx.reshape(-1)
  pos = rng.choice(flat.size, size=min(flat.size // 4, 4 * len(bad)), replace=False)
  flat[pos] = bad[np.arange(len(pos)) % len(bad)]
  if topk > 2:
    idx[0, 0, 1] = idx[0, 0, 0]            # a duplicate
  if all_invalid_row and B * s_q > 1:
    idx[-1, -1, :] = -1
  q = jnp.asarray(rng.standard_normal((B, s_q, H, 576)), jnp.bfloat16)
  tl = None
  if with_topk_length:
    tl = jnp.asarray(rng.integers(1, topk + 1, (B,)), jnp.int32).at[0].set(topk)
  return SparseCase(q, kv, jnp.asarray(idx), tl, softmax_scale, kv_scale)


def add_late_spike(case: SparseCase, tile: int, head: int = 0, scale: float = 1.0) -> SparseCase:
  """``case`` with key ``64 tile + 3`` of query token (0, 0) made a valid row equal to e4m3(scale · q) of
  ``head``: its logit for that head is ~ softmax_scale · kv_scale · scale · 576 (tens of nats), far
  above the running maximum of the earlier tiles, so a lazy softmax must rescale in the middle of a split."""
  idx = np.array(case.indices)
  kv = np.array(case.kv.astype(jnp.float32)).reshape(-1, 576)
  used = kv.shape[0] // 2
  start = int(idx[0, 0, 0]) if 0 <= idx[0, 0, 0] < used else 5
  # a row the token attends nowhere else: an earlier tile holding it would move the max before the split's middle
  taken = set(np.asarray(idx[0, 0]).ravel().tolist())
  row = next(r for r in ((start + 7 + i) % used for i in range(used)) if r not in taken)
  idx[0, 0, 64 * tile + 3] = row
  kv[row] = np.asarray(case.q[0, 0, head], np.float32) * scale
  kv = jnp.asarray(kv.reshape(case.kv.shape)).astype(FP8)
  return dataclasses.replace(case, kv=kv, indices=jnp.asarray(idx))


def logit_std(case: SparseCase) -> float:
  """Standard deviation of the logits for N(0, 1) q and rows: softmax_scale * sqrt(576) * kv_scale."""
  return case.softmax_scale * 576 ** 0.5 * case.kv_scale


def run_kernel(case: SparseCase, *, interpret, tuning=(), heads_on_n_max: int | None = None):
  """The op's Mosaic path (sm_90 kernels) on ``case`` with kernel TuningConfig overrides ``tuning``, traced afresh.

  ``heads_on_n_max``: the op's rule HEADS_ON_N_MAX for this call; 0 runs the heads-on-M design at any H (the
  same products as the heads-on-N design, for cross-checks between the two designs). The function is jitted
  anew on every call, so no trace made under another rule is reused.
  """
  import unittest.mock

  import jax
  from mla_pallas.ops import sparse_decode as sd

  rule = sd.HEADS_ON_N_MAX if heads_on_n_max is None else heads_on_n_max
  with unittest.mock.patch.object(sd, "HEADS_ON_N_MAX", rule):
    fn = jax.jit(lambda q, kv, idx, scale, tl: sd._mosaic_sparse_decode(
        q, kv, idx, case.softmax_scale, scale, tl, interpret, tuple(tuning), "sm90"))
    return fn(case.q, case.kv.reshape(-1, case.kv.shape[-1]), case.indices, jnp.float32(case.kv_scale),
              case.topk_length)
