"""Public ops of mla_pallas.ops (dense decode, rope/rms norm, fused cache write, FP8 bmm, weight conversion)
against the float32 references in mla_pallas.reference, plus dispatch and validation.

Tolerance model (the reason is also written next to each assertion):
* FP8 attention (dense decode, both the XLA path and the sparse kernel in interpret mode): Q is quantized to e4m3
  per (token, head) row and P to e4m3 as fp8(256 p) (unit roundoff 2^-4); both products are exact in f32 on CPU.
  Output rel-L2 bound from :func:`mla_pallas.testing.fp8_budget` (fp8_mma=False: no wgmma accumulation error) ~0.1.
  lse only sees the Q rounding (the row sum is taken on unquantized p): |d lse| <= max_j |d s_j| <=
  2^-4 * softmax_scale * kv_scale * max_j sum_d |q_d k_jd| (plus f32 noise).
* Same math in a different order (bmm fp8 products vs dequantized f32 products):
  f32 accumulation differences ~1e-6 relative, then both rounded to bf16: at most one bf16 ulp apart
  (<= 2^-7 relative per element, rel-L2 <= 2^-8).
* Elementwise ops that call the reference formulation (rope, rms norm, fused write, conversion): bitwise equal to
  the *jitted* reference (same HLO; eager op-by-op evaluation may differ by an f32 ulp where XLA fuses a*c - b*s
  into an FMA).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from mla_pallas import _dispatch, quant, testing
from mla_pallas import reference as ref
from mla_pallas.ops import bmm_fp8 as bmm_mod
from mla_pallas.ops import dense_decode as dd_mod
from mla_pallas.ops.bmm_fp8 import quantize_and_bmm_fp8
from mla_pallas.ops.convert import (convert_bf16_to_fp8_e4m3fn, convert_fp8_e4m3fn_to_bf16,
                                    load_block_scaled_checkpoint)
from mla_pallas.ops.dense_decode import dense_mla_decode
from mla_pallas.ops.rope_rmsnorm import fused_rope_rmsnorm_quantization, rms_norm, rope, rope_rmsnorm

FP8 = quant.FP8
D = 576
DV = 512
SCALE = D ** -0.5
NO_MOSAIC_HERE = _dispatch.mosaic_arch(False) is None


# ------------------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------------------

def fp8_pages(rng, num_pages, page_size, sigma=1.5):
  x = np.clip(rng.normal(size=(num_pages, page_size, D)) * sigma, -448, 448).astype(np.float32)
  return np.asarray(jnp.asarray(x).astype(FP8))


def poison_pages(pages, keep_slots):
  """NaN (0x7f) in every flat slot not in keep_slots."""
  bits = pages.view(np.uint8).reshape(-1, D).copy()
  keep = np.zeros(bits.shape[0], bool)
  keep[np.asarray(sorted(keep_slots), np.int64)] = True
  bits[~keep] = 0x7F
  return bits.view(pages.dtype).reshape(pages.shape)


def dense_case(rng, *, b=5, s_q=2, h=8, page_size=16, num_pages=16, max_pages=3):
  """Random dense-decode inputs (b >= 4): sequence 0 has a -1 page past its end, sequence 1 a page id >= num_pages
  past its end, sequence 2 a length past the block table (truncated), sequence 3 a -1 page inside its length (a
  masked hole), sequences 4.. are empty. NaN in every cache slot no query may read."""
  assert b >= 4 and num_pages >= b * max_pages
  table = rng.permutation(num_pages)[: b * max_pages].reshape(b, max_pages).astype(np.int32)
  table[0, -1] = -1
  table[1, -1] = num_pages + 3
  table[3, 0] = -1
  lens = np.array([rng.integers(page_size + 1, 2 * page_size), rng.integers(1, 2 * page_size),
                   max_pages * page_size + 5, 2 * page_size - 3] + [0] * (b - 4), np.int32)
  keep = set()
  for bi in range(b):
    for p in range(min(int(lens[bi]), max_pages * page_size)):
      pg = int(table[bi, p // page_size])
      if 0 <= pg < num_pages:
        keep.add(pg * page_size + p % page_size)
  pages = poison_pages(fp8_pages(rng, num_pages, page_size), keep)
  q = jnp.asarray(rng.normal(size=(b, s_q, h, D)), jnp.bfloat16)
  return q, jnp.asarray(pages), jnp.asarray(table), jnp.asarray(lens)


def lse_bound(q, pages, table, lens, kv_scale):
  """2^-4 * softmax_scale * kv_scale * max_j sum_d |q_d k_jd| over all (readable) keys + f32 noise."""
  qf = np.abs(np.asarray(q, np.float32))
  kf = np.abs(np.nan_to_num(np.asarray(pages, np.float32).reshape(-1, D), nan=0.0))
  m = np.max(np.einsum("bshd,kd->bshk", qf, kf))
  return 2.0 ** -4 * SCALE * kv_scale * m * 1.01 + 1e-4


def assert_lse_close(got, want, tol):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want))  # empty rows: -inf in both
  fin = np.isfinite(want)
  assert np.all(np.abs(got[fin] - want[fin]) <= tol), np.max(np.abs(got[fin] - want[fin]))


FP8_ATTN_BUDGET = testing.fp8_budget(fp8_mma=False, pv_length=64)


# ------------------------------------------------------------------------------------------------------------
# dense_mla_decode
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("s_q,causal,page_size", [(1, False, 16), (2, True, 16), (3, False, 32), (2, False, 16)])
def test_dense_decode_xla_matches_reference(rng, s_q, causal, page_size):
  q, pages, table, lens = dense_case(rng, s_q=s_q, page_size=page_size)
  kv_scale = 0.75
  out, lse = dense_mla_decode(q, pages, table, lens, softmax_scale=SCALE, kv_scale=kv_scale, causal=causal,
                              impl="xla")
  assert _dispatch.last_impl("dense_mla_decode") == "xla"
  r_out, r_lse = ref.dense_mla_decode(q, pages, table, lens, softmax_scale=SCALE, kv_scale=kv_scale,
                                      causal=causal)
  assert out.shape == r_out.shape and out.dtype == jnp.bfloat16 and lse.dtype == jnp.float32
  # Q and P rounded to e4m3 (unit roundoff 2^-4): rel-L2 within the FP8 budget (~0.1); NaN rows never leak.
  testing.assert_close_fp8(out, r_out, rel_l2=FP8_ATTN_BUDGET, what="dense xla out")
  # lse sees only the rounding of Q: |d lse| <= 2^-4 * scale * kv_scale * max sum |q k|.
  assert_lse_close(lse, r_lse, lse_bound(q, pages, table, lens, kv_scale))
  # the empty sequence (and any row with nothing valid): out exactly 0
  empty = np.asarray(r_lse) == -np.inf
  assert np.all(np.asarray(out, np.float32)[empty] == 0)


# BF16 attention's error model: mla_pallas.testing.BF16_ATTENTION_REL_L2.
BF16_ATTN_BUDGET = testing.BF16_ATTENTION_REL_L2


@pytest.mark.parametrize("s_q,causal,h,impl,want", [(1, False, 8, "xla", "xla"), (3, True, 8, "auto", "mosaic-interpret"),
                                                 (2, True, 64, "mosaic", "mosaic-interpret")])
def test_dense_decode_bf16_cache_matches_reference(rng, s_q, causal, h, impl, want):
  """A bfloat16 cache (NaN in unread slots, -1 / out-of-range pages, a hole, empty sequences) runs BF16 attention:
  on the XLA path, and on the bf16-cache kernel (heads on M; at H = 8 with the rows zero-padded to 64) in
  interpret mode under impl="auto" and "mosaic"."""
  q, pages, table, lens = dense_case(rng, s_q=s_q, h=h, page_size=16)
  pages = pages.astype(jnp.bfloat16)
  kw = dict(softmax_scale=SCALE, kv_scale=0.5, causal=causal)
  out, lse = dense_mla_decode(q, pages, table, lens, impl=impl, interpret=True, **kw)
  assert _dispatch.last_impl("dense_mla_decode") == want
  r_out, r_lse = ref.dense_mla_decode(q, pages, table, lens, **kw)
  testing.assert_close_fp8(out, r_out, rel_l2=BF16_ATTN_BUDGET, what=f"dense bf16 cache out ({want})")
  assert_lse_close(lse, r_lse, 1e-4)     # only f32 rounding of the logits
  assert not np.isnan(np.asarray(out, np.float32)).any()


def test_dense_decode_xla_chunked_scan_matches_reference(rng, monkeypatch):
  """Force one page per scan step (several online-softmax steps) and compare with the reference."""
  q, pages, table, lens = dense_case(rng, s_q=2)
  monkeypatch.setattr(dd_mod, "_STEP_BYTES", 1)        # read at trace time: call the unjitted body
  out, lse = dd_mod._xla_dense_decode(q, pages, table, lens, jnp.float32(1.25), SCALE, True)
  r_out, r_lse = ref.dense_mla_decode(q, pages, table, lens, softmax_scale=SCALE, kv_scale=1.25, causal=True)
  # same FP8 error model as the unchunked path (P is quantized against the running max instead of the final one,
  # which changes only which e4m3 grid the p values land on).
  testing.assert_close_fp8(out, r_out, rel_l2=FP8_ATTN_BUDGET, what="dense xla chunked")
  assert_lse_close(lse, r_lse, lse_bound(q, pages, table, lens, 1.25))


def test_dense_indices_match_slot_formula(rng):
  page_size, num_pages, s_q = 16, 6, 3
  table = np.array([[4, 0, -1], [2, 9, 5]], np.int32)
  lens = np.array([20, 45], np.int32)
  for causal in (False, True):
    idx = np.asarray(dd_mod.dense_indices(jnp.asarray(table), jnp.asarray(lens), page_size=page_size,
                                          num_pages=num_pages, s_q=s_q, causal=causal))
    assert idx.shape == (2, s_q, 3 * page_size) and idx.dtype == np.int32
    for b in range(2):
      for i in range(s_q):
        lim = lens[b] - s_q + i + 1 if causal else lens[b]
        for p in range(3 * page_size):
          pg = table[b, p // page_size]
          want = pg * page_size + p % page_size if (p < lim and 0 <= pg < num_pages) else -1
          assert idx[b, i, p] == want, (b, i, p)


def test_dense_decode_mosaic_interpret_matches_reference(rng):
  """The sparse Mosaic kernel (GPU interpret mode, on CPU) runs dense decode from block-table-derived indices."""
  q, pages, table, lens = dense_case(rng, b=4, s_q=2, h=16, page_size=16)
  out, lse = dense_mla_decode(q, pages, table, lens, softmax_scale=SCALE, kv_scale=0.5, causal=True,
                              impl="mosaic", interpret=True)
  assert _dispatch.last_impl("dense_mla_decode") == "mosaic-interpret"
  r_out, r_lse = ref.dense_mla_decode(q, pages, table, lens, softmax_scale=SCALE, kv_scale=0.5, causal=True)
  # Q and P quantized to e4m3 (unit roundoff 2^-4) in the kernel; interpret mode multiplies exactly:
  # rel-L2 within the FP8 budget (~0.1). NaN-poisoned unread slots and the -1 page must not leak.
  testing.assert_close_fp8(out, r_out, rel_l2=FP8_ATTN_BUDGET, what="dense via sparse kernel (interpret)")
  assert_lse_close(lse, r_lse, lse_bound(q, pages, table, lens, 0.5))
  # impl="auto" with interpret=True prefers the kernel (same shapes: the compiled kernel is reused).
  out2, _ = dense_mla_decode(q, pages, table, lens, softmax_scale=SCALE, kv_scale=0.5, causal=True,
                             impl="auto", interpret=True)
  assert _dispatch.last_impl("dense_mla_decode") == "mosaic-interpret"
  np.testing.assert_array_equal(np.asarray(out2, np.float32), np.asarray(out, np.float32))


@pytest.mark.parametrize("h,s_q,page_size,causal,races", [(64, 1, 64, False, True), (64, 2, 128, True, False),
                                                          (8, 3, 32, True, False)])
def test_dense_decode_kernel_cases_interpret(rng, h, s_q, page_size, causal, races):
  """The sparse kernel on block-table ids (each 64-key tile gathered row by row) within the FP8 budget of the
  reference, heads on M (H 64) and on N (H 8), pages of 64 / 128 / 32 rows. dense_case: a tail tile, a -1
  hole page, -1 and out-of-range pages past the ends, empty sequences (out 0, lse -inf), NaN in every unread
  slot (must not leak). Races checked in interpret mode at H 64, s_q 1 (the block-table ids are the only part of
  its own: tests/test_sparse_decode.py checks races of both designs, incl. H 128's two query tiles per token,
  which cost 127 s here)."""
  q, pages, table, lens = dense_case(rng, s_q=s_q, h=h, page_size=page_size)
  kw = dict(softmax_scale=SCALE, kv_scale=0.5, causal=causal)
  testing.reset_interpreter()
  out, lse = dense_mla_decode(q, pages, table, lens, impl="mosaic",
                              interpret=plgpu.InterpretGPUParams(detect_races=races), **kw)
  assert not testing.races_found()
  assert _dispatch.last_impl("dense_mla_decode") == "mosaic-interpret"
  out_f = np.asarray(out, np.float32)
  assert np.all(np.isfinite(out_f))
  assert np.all(out_f[np.asarray(lens) <= 0] == 0)
  r_out, r_lse = ref.dense_mla_decode(q, pages, table, lens, **kw)
  testing.assert_close_fp8(out, r_out, rel_l2=FP8_ATTN_BUDGET, what="dense, row gather (interpret)")
  assert_lse_close(lse, r_lse, lse_bound(q, pages, table, lens, 0.5))


def test_dense_decode_dispatch(rng):
  q, pages, table, lens = dense_case(rng, h=3)
  kw = dict(softmax_scale=SCALE)
  # H=3 is not a kernel head count: auto falls back to XLA even in interpret mode, mosaic refuses.
  dense_mla_decode(q, pages, table, lens, impl="auto", interpret=True, **kw)
  assert _dispatch.last_impl("dense_mla_decode") == "xla"
  with pytest.raises(NotImplementedError, match="H="):
    dense_mla_decode(q, pages, table, lens, impl="mosaic", interpret=True, **kw)
  if NO_MOSAIC_HERE:
    q8, pages8, table8, lens8 = dense_case(rng, h=8)
    with pytest.raises(NotImplementedError):
      dense_mla_decode(q8, pages8, table8, lens8, impl="mosaic", **kw)
    dense_mla_decode(q8, pages8, table8, lens8, impl="auto", **kw)
    assert _dispatch.last_impl("dense_mla_decode") == "xla"
  with pytest.raises(ValueError, match="impl"):
    dense_mla_decode(q, pages, table, lens, impl="cuda", **kw)


def test_dense_decode_validation(rng):
  q, pages, table, lens = dense_case(rng)
  kw = dict(softmax_scale=SCALE, impl="xla")
  cases = [
      ("q", (q[..., :512], pages, table, lens), kw),
      ("kv_cache", (q, pages.reshape(-1, D), table, lens), kw),
      ("kv_cache", (q, pages.astype(jnp.float16), table, lens), kw),     # float8_e4m3fn or bfloat16 only
      ("block_table", (q, pages, table[:2], lens), kw),
      ("block_table", (q, pages, table.astype(jnp.int16), lens), kw),
      ("cache_seqlens", (q, pages, table, lens[:2]), kw),
      ("softmax_scale", (q, pages, table, lens), dict(kw, softmax_scale=-1.0)),
      ("kv_scale", (q, pages, table, lens), dict(kw, kv_scale=0.0)),
      ("causal", (q, pages, table, lens), dict(kw, causal="yes")),
  ]
  for name, args, kwargs in cases:
    with pytest.raises(ValueError, match=name):
      dense_mla_decode(*args, **kwargs)


def test_dense_decode_under_jit(rng):
  q, pages, table, lens = dense_case(rng, s_q=1)
  f = jax.jit(lambda q, p, t, l: dense_mla_decode(q, p, t, l, softmax_scale=SCALE, impl="xla"))
  out, lse = f(q, pages, table, lens)
  out2, lse2 = dense_mla_decode(q, pages, table, lens, softmax_scale=SCALE, impl="xla")
  # same computation traced twice: identical
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(out2, np.float32))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse2))


# ------------------------------------------------------------------------------------------------------------
# rope / rms norm / rope_rmsnorm / fused write
# ------------------------------------------------------------------------------------------------------------

def rope_inputs(rng, t=7, h=3, max_pos=64):
  cos, sin = ref.rope_tables(max_pos)
  kv = jnp.asarray(rng.normal(size=(t, D)) * 2, jnp.bfloat16)
  q_rope = jnp.asarray(rng.normal(size=(t, h, 64)), jnp.bfloat16)
  positions = jnp.asarray(rng.integers(0, max_pos, t), jnp.int32)
  w = jnp.asarray(rng.normal(size=(DV,)) * 0.3 + 1, jnp.bfloat16)
  return kv, q_rope, positions, cos, sin, w


REF = dict(
    rope=jax.jit(ref.rope, static_argnames=("interleaved",)),
    rms_norm=jax.jit(ref.rms_norm),
    rope_rmsnorm=jax.jit(ref.rope_rmsnorm, static_argnames=("interleaved",)),
    write=jax.jit(ref.rope_rmsnorm_quantize_write, static_argnames=("interleaved",)),
)


def bits(x):
  return np.asarray(x).view(np.uint8 if np.asarray(x).dtype.itemsize == 1 else np.uint16
                            if np.asarray(x).dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_norm_ops_match_reference_bitwise(rng, interleaved):
  kv, q_rope, positions, cos, sin, w = rope_inputs(rng)
  # XLA paths use the reference formulation (f32 elementwise math): bitwise equal to the jitted reference.
  got = rope(q_rope, positions, cos, sin, interleaved=interleaved, impl="xla")
  np.testing.assert_array_equal(bits(got), bits(REF['rope'](q_rope, positions, cos, sin, interleaved=interleaved)))
  x32 = jnp.asarray(rng.normal(size=(5, 64)), jnp.float32)
  got = rope(x32, positions[:5], cos, sin, interleaved=interleaved, impl="auto")
  assert _dispatch.last_impl("rope") == "xla"
  np.testing.assert_array_equal(bits(got), bits(REF['rope'](x32, positions[:5], cos, sin, interleaved=interleaved)))
  got = rms_norm(kv[:, :DV], w, 1e-6, impl="auto")
  assert _dispatch.last_impl("rms_norm") == "xla"
  np.testing.assert_array_equal(bits(got), bits(REF['rms_norm'](kv[:, :DV], w, 1e-6)))
  kv_o, q_o = rope_rmsnorm(kv, q_rope, positions, cos, sin, w, eps=1e-6, interleaved=interleaved, impl="auto")
  assert _dispatch.last_impl("rope_rmsnorm") == "xla"
  r_kv, r_q = REF['rope_rmsnorm'](kv, q_rope, positions, cos, sin, w, eps=1e-6, interleaved=interleaved)
  np.testing.assert_array_equal(bits(kv_o), bits(r_kv))
  np.testing.assert_array_equal(bits(q_o), bits(r_q))


@pytest.mark.parametrize("paged", [True, False])
def test_fused_write_matches_reference_and_touches_only_its_slots(rng, paged):
  kv, q_rope, positions, cos, sin, w = rope_inputs(rng, t=9)
  num_pages, page_size = 4, 16
  n = num_pages * page_size
  # NaN-poisoned cache with a few finite rows (those must stay bitwise too)
  base = np.full((num_pages, page_size, D), 0x7F, np.uint8)
  base[1, 3] = np.asarray(jnp.asarray(rng.normal(size=D), jnp.float32).astype(FP8)).view(np.uint8)
  base = base.view(FP8)
  if not paged:
    base = base.reshape(n, D)
  slots = np.array([5, -1, 40, n, 5, 63, -7, 0, 2 ** 31 - 1], np.int32)  # dup 5 (last wins), -1, >= n skipped
  kv_scale = 0.37
  pages_in = jnp.asarray(base)
  new_pages, q_out = fused_rope_rmsnorm_quantization(
      pages_in, kv, q_rope, positions, cos, sin, w, eps=1e-6, kv_scale=kv_scale, slots=jnp.asarray(slots),
      impl="auto")
  assert _dispatch.last_impl("fused_rope_rmsnorm_quantization") == "xla"
  assert new_pages.shape == base.shape and new_pages.dtype == FP8
  r_pages, r_q = REF['write'](jnp.asarray(base), kv, q_rope, positions, cos, sin, w, eps=1e-6,
                                                 kv_scale=kv_scale, slots=jnp.asarray(slots))
  got = np.asarray(new_pages).view(np.uint8).reshape(n, D)
  # same f32 rows, same quantization formula: bitwise equal to the jitted reference
  np.testing.assert_array_equal(got, np.asarray(r_pages).view(np.uint8).reshape(n, D))
  np.testing.assert_array_equal(bits(q_out), bits(r_q))
  written = {5, 40, 63, 0}
  untouched = np.array([s for s in range(n) if s not in written])
  # every slot not written is bitwise unchanged (NaN stays NaN, the finite row stays)
  np.testing.assert_array_equal(got[untouched], base.view(np.uint8).reshape(n, D)[untouched])
  # duplicate slot 5: token 4 (the later one) wins
  row4 = REF['rope_rmsnorm'](kv.astype(jnp.float32), q_rope, positions, cos, sin, w, eps=1e-6)[0][4]
  np.testing.assert_array_equal(got[5], np.asarray(quant.quantize_fp8(row4, kv_scale)).view(np.uint8))
  assert not np.isnan(np.asarray(new_pages, np.float32).reshape(n, D)[sorted(written)]).any()


def test_fused_write_bf16_cache(rng):
  """A bfloat16 cache: the rows are stored rounded to bf16 (``quant.encode_cache_rows``: rows / kv_scale, no clip),
  bitwise the jitted reference's; unwritten slots (NaN here) stay bitwise; the kernel's support check takes FP8 and
  bf16 caches only."""
  kv, q_rope, positions, cos, sin, w = rope_inputs(rng, t=5)
  base = np.full((2, 16, D), np.nan, np.float32).astype(jnp.bfloat16)
  slots = jnp.asarray([3, -1, 17, 3, 31], jnp.int32)              # dup 3 (last wins), -1 skipped
  new_pages, q_out = fused_rope_rmsnorm_quantization(jnp.asarray(base), kv, q_rope, positions, cos, sin, w,
                                                     eps=1e-6, kv_scale=0.5, slots=slots, impl="auto")
  assert _dispatch.last_impl("fused_rope_rmsnorm_quantization") == "xla" and new_pages.dtype == jnp.bfloat16
  r_pages, r_q = REF['write'](jnp.asarray(base), kv, q_rope, positions, cos, sin, w, eps=1e-6, kv_scale=0.5,
                              slots=slots)
  np.testing.assert_array_equal(bits(new_pages), bits(r_pages))
  np.testing.assert_array_equal(bits(q_out), bits(r_q))
  got = np.asarray(new_pages, np.float32).reshape(-1, D)
  assert np.isnan(got[[s for s in range(32) if s not in (3, 17, 31)]]).all()
  assert np.isfinite(got[[3, 17, 31]]).all()
  from mla_pallas.ops import rope_rmsnorm as rr
  with pytest.raises(NotImplementedError, match="float8_e4m3fn and bfloat16 caches"):   # other dtypes: XLA only
    rr._kernel_supported("fused_rope_rmsnorm_quantization", kv, q_rope, 32, jnp.float16)()
  with pytest.raises(NotImplementedError) as e:        # a bf16 cache passes the dtype check; CPU fails the arch one
    rr._kernel_supported("fused_rope_rmsnorm_quantization", kv, q_rope, 32, jnp.bfloat16)()
  assert "caches" not in str(e.value) and "sm_90" in str(e.value)


def test_fused_write_all_slots_invalid_leaves_cache_unchanged(rng):
  kv, q_rope, positions, cos, sin, w = rope_inputs(rng, t=3)
  base = np.asarray(jnp.asarray(rng.normal(size=(2, 16, D)), jnp.float32).astype(FP8))
  new_pages, _ = fused_rope_rmsnorm_quantization(
      jnp.asarray(base), kv, q_rope, positions, cos, sin, w, eps=1e-6, kv_scale=1.0,
      slots=jnp.asarray([-1, 32, -5], jnp.int32), impl="xla")
  np.testing.assert_array_equal(np.asarray(new_pages).view(np.uint8), base.view(np.uint8))


def test_rope_ops_dispatch_and_validation(rng):
  kv, q_rope, positions, cos, sin, w = rope_inputs(rng)
  pages = jnp.zeros((2, 16, D), FP8)
  slots = jnp.zeros((kv.shape[0],), jnp.int32)
  calls = {
      "rope": lambda **k: rope(q_rope, positions, cos, sin, **k),
      "rms_norm": lambda **k: rms_norm(kv, jnp.ones((D,), jnp.float32), 1e-6, **k),
      "rope_rmsnorm": lambda **k: rope_rmsnorm(kv, q_rope, positions, cos, sin, w, eps=1e-6, **k),
      "fused": lambda **k: fused_rope_rmsnorm_quantization(jnp.array(pages, copy=True), kv, q_rope, positions, cos,
                                                           sin, w, eps=1e-6, kv_scale=1.0, slots=slots, **k),
  }
  for name, call in calls.items():
    if name in ("rope", "rms_norm"):   # no kernel at all
      with pytest.raises(NotImplementedError, match="no Mosaic GPU kernel"):
        call(impl="mosaic", interpret=True)
    else:                              # the kernel is raw Mosaic GPU: interpret mode runs the XLA path
      call(impl="mosaic", interpret=True)
      assert _dispatch.last_impl({"fused": "fused_rope_rmsnorm_quantization"}.get(name, name)) == "xla"
    with pytest.raises(ValueError, match="impl"):
      call(impl="pallas")
  bad = [
      ("x", lambda: rope(q_rope[..., :63], positions, cos, sin)),
      ("positions", lambda: rope(q_rope, positions[:3], cos, sin)),
      ("positions", lambda: rope(q_rope, positions.astype(jnp.float32), cos, sin)),
      ("cos", lambda: rope(q_rope, positions, cos[:, :16], sin)),
      ("sin", lambda: rope(q_rope, positions, cos, sin[:5])),
      ("interleaved", lambda: rope(q_rope, positions, cos, sin, interleaved=1)),
      ("weight", lambda: rms_norm(kv, w, 1e-6)),
      ("x", lambda: rms_norm(kv.astype(jnp.int32), w, 1e-6)),
      ("kv", lambda: rope_rmsnorm(kv[:, :512], q_rope, positions, cos, sin, w, eps=1e-6)),
      ("q_rope", lambda: rope_rmsnorm(kv, q_rope[:2], positions, cos, sin, w, eps=1e-6)),
      ("norm_weight", lambda: rope_rmsnorm(kv, q_rope, positions, cos, sin, w[:64], eps=1e-6)),
      ("pages", lambda: fused_rope_rmsnorm_quantization(pages.astype(jnp.float16), kv, q_rope, positions, cos,
                                                        sin, w, eps=1e-6, kv_scale=1.0, slots=slots)),
      ("slots", lambda: fused_rope_rmsnorm_quantization(pages, kv, q_rope, positions, cos, sin, w, eps=1e-6,
                                                        kv_scale=1.0, slots=slots[:2])),
      ("kv_scale", lambda: fused_rope_rmsnorm_quantization(pages, kv, q_rope, positions, cos, sin, w, eps=1e-6,
                                                           kv_scale=-2.0, slots=slots)),
  ]
  for name, call in bad:
    with pytest.raises(ValueError, match=name):
      call()


# ------------------------------------------------------------------------------------------------------------
# quantize_and_bmm_fp8
# ------------------------------------------------------------------------------------------------------------

def bmm_inputs(rng, t=5, h=3, k=200, n=136):
  a = jnp.asarray(rng.normal(size=(t, h, k)) * np.exp(rng.normal(size=(t, h, 1))), jnp.bfloat16)
  a = a.at[1, 2].set(0)                                   # an all-zero row (scale 1)
  w = jnp.asarray(rng.normal(size=(h, k, n)) * 0.05, jnp.float32)
  w8, ws = quant.quantize_blocks_fp8(w)
  return a, w8, ws


@pytest.mark.parametrize("act_scale", ["per_token", "per_tensor"])
@pytest.mark.parametrize("k,n", [(200, 136), (128, 64), (64, 300)])
def test_bmm_fp8_matches_reference(rng, act_scale, k, n):
  a, w8, ws = bmm_inputs(rng, k=k, n=n)
  out = quantize_and_bmm_fp8(a, w8, ws, act_scale=act_scale, impl="auto")
  assert _dispatch.last_impl("quantize_and_bmm_fp8") == "xla"
  want = ref.quantize_and_bmm_fp8(a, w8, ws, act_scale=act_scale)
  assert out.shape == want.shape and out.dtype == jnp.bfloat16
  g, r = np.asarray(out, np.float64), np.asarray(want, np.float64)
  # Same quantization of a; fp8 x fp8 products are exact in f32, so only the f32 accumulation order differs
  # (~K 2^-24 relative to sum |terms|), then both are rounded to bf16: at most one bf16 ulp apart (2^-7
  # relative per element) and rel-L2 <= 2^-8.
  assert np.all(np.abs(g - r) <= 2.0 ** -7 * np.abs(r) + 1e-6 * np.abs(r).max())
  assert np.linalg.norm(g - r) <= 2.0 ** -8 * np.linalg.norm(r)


def test_bmm_fp8_uses_fp8_operands_per_k_block(rng):
  a, w8, ws = bmm_inputs(rng, k=300, n=64)
  jaxpr = jax.make_jaxpr(lambda a, w, s: bmm_mod._xla_bmm(a, w, s, "per_token"))(a, w8, ws)
  dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
  assert len(dots) == 3                                   # ceil(300 / 128) K blocks
  for e in dots:
    assert all(v.aval.dtype == FP8 for v in e.invars)
    assert e.params["preferred_element_type"] == jnp.float32
    assert e.params["dimension_numbers"][1] == ((1,), (0,))   # a consumed as [H, T, K] via its batch dim
  assert not any(e.primitive.name == "transpose" and e.invars[0].aval.dtype == FP8 for e in jaxpr.eqns)


def test_bmm_fp8_dispatch_and_validation(rng):
  a, w8, ws = bmm_inputs(rng, k=64, n=64)
  with pytest.raises(NotImplementedError, match="no Mosaic GPU kernel"):
    quantize_and_bmm_fp8(a, w8, ws, impl="mosaic", interpret=True)
  with pytest.raises(ValueError, match="impl"):
    quantize_and_bmm_fp8(a, w8, ws, impl="gpu")
  for name, args, kw in [("a", (a[0], w8, ws), {}), ("w", (a, w8.astype(jnp.float32), ws), {}),
                         ("w", (a, w8[:, :32], ws), {}), ("w_scale", (a, w8, ws[:, :, :0]), {}),
                         ("act_scale", (a, w8, ws), dict(act_scale="per_row"))]:
    with pytest.raises(ValueError, match=name):
      quantize_and_bmm_fp8(*args, impl="xla", **kw)


# ------------------------------------------------------------------------------------------------------------
# conversion
# ------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [(128, 128), (32, 64)])
def test_convert_matches_reference_bitwise(rng, block):
  w = jnp.asarray(rng.normal(size=(2, 150, 200)) * 0.02, jnp.bfloat16)
  w = w.at[0, :32, :64].set(0)                            # an all-zero block
  w8, s = convert_bf16_to_fp8_e4m3fn(w, block, impl="auto")
  assert _dispatch.last_impl("convert_bf16_to_fp8_e4m3fn") == "xla"
  r8, rs = ref.convert_bf16_to_fp8_e4m3fn(w, block)
  # same quantization formula (mla_pallas.quant): bitwise
  np.testing.assert_array_equal(np.asarray(w8).view(np.uint8), np.asarray(r8).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(s), np.asarray(rs))
  back = convert_fp8_e4m3fn_to_bf16(w8, s, block, impl="auto")
  assert _dispatch.last_impl("convert_fp8_e4m3fn_to_bf16") == "xla"
  np.testing.assert_array_equal(bits(back), bits(ref.convert_fp8_e4m3fn_to_bf16(w8, s, block)))
  # round trip: e4m3 rounding (2^-4 relative) + subnormal step of the block (2^-10 * scale) + bf16 rounding
  wf, bf = np.asarray(w, np.float64), np.asarray(back, np.float64)
  scale = np.asarray(quant.expand_block_scales(s, w.shape, block))
  assert np.all(np.abs(bf - wf) <= 2.0 ** -4 * np.abs(wf) * (1 + 2.0 ** -7) + 2.0 ** -10 * scale + 1e-12)


def test_load_block_scaled_checkpoint(rng):
  n_out, k_in = 300, 200
  w_torch = jnp.asarray(rng.normal(size=(n_out, k_in)) * 0.01, jnp.float32)   # nn.Linear layout [N_out, K_in]
  weight, scale_inv = quant.quantize_blocks_fp8(w_torch)                     # DeepSeek: 128x128 over [N_out, K_in]
  assert scale_inv.shape == (3, 2)
  w8, scales = load_block_scaled_checkpoint(weight, scale_inv)
  assert w8.shape == (k_in, n_out) and w8.dtype == FP8 and scales.shape == (2, 3) and scales.dtype == jnp.float32
  # pure relayout: dequantized values identical (exact f32 products), transposed
  deq_ours = np.asarray(quant.dequantize_blocks_fp8(w8, scales))
  deq_ck = np.asarray(weight, np.float32) * np.asarray(quant.expand_block_scales(scale_inv, weight.shape))
  np.testing.assert_array_equal(deq_ours, deq_ck.T)
  # raw bytes (uint8) are bit-cast; stacked leading dims allowed
  w8b, _ = load_block_scaled_checkpoint(jnp.asarray(np.asarray(weight).view(np.uint8)), scale_inv)
  np.testing.assert_array_equal(np.asarray(w8b).view(np.uint8), np.asarray(w8).view(np.uint8))
  w8s, ss = load_block_scaled_checkpoint(jnp.stack([weight, weight]), jnp.stack([scale_inv, scale_inv]))
  assert w8s.shape == (2, k_in, n_out) and ss.shape == (2, 2, 3)
  # y = x @ deq(W).T of the checkpoint == x @ deq(w8) of ours, through the converter
  x = jnp.asarray(rng.normal(size=(4, k_in)), jnp.float32)
  y_ck = x @ jnp.asarray(deq_ck).T
  y = x @ convert_fp8_e4m3fn_to_bf16(w8, scales).astype(jnp.float32)
  # ours goes through bf16 weights: 2^-8 relative per weight -> well within 2^-6 of |x| @ |W|
  bound = 2.0 ** -6 * (np.abs(np.asarray(x)) @ np.abs(deq_ck).T)
  assert np.all(np.abs(np.asarray(y) - np.asarray(y_ck)) <= bound + 1e-6)
  with pytest.raises(ValueError, match="scale_inv"):
    load_block_scaled_checkpoint(weight, scale_inv.T)
  with pytest.raises(ValueError, match="weight_fp8"):
    load_block_scaled_checkpoint(w_torch, scale_inv)


def test_convert_dispatch_and_validation(rng):
  w = jnp.asarray(rng.normal(size=(64, 64)), jnp.bfloat16)
  w8, s = convert_bf16_to_fp8_e4m3fn(w)
  with pytest.raises(NotImplementedError, match="no Mosaic GPU kernel"):
    convert_bf16_to_fp8_e4m3fn(w, impl="mosaic", interpret=True)
  with pytest.raises(NotImplementedError, match="no Mosaic GPU kernel"):
    convert_fp8_e4m3fn_to_bf16(w8, s, impl="mosaic", interpret=True)
  with pytest.raises(ValueError, match="impl"):
    convert_bf16_to_fp8_e4m3fn(w, impl="fast")
  with pytest.raises(ValueError, match="w"):
    convert_bf16_to_fp8_e4m3fn(w[0])
  with pytest.raises(ValueError, match="block"):
    convert_bf16_to_fp8_e4m3fn(w, (128,))
  with pytest.raises(ValueError, match="w8"):
    convert_fp8_e4m3fn_to_bf16(w, s)
  with pytest.raises(ValueError, match="scales"):
    convert_fp8_e4m3fn_to_bf16(w8, s[:, :0])


def test_mosaic_refused_without_interpret_on_cpu(rng):
  """On a machine with no Mosaic-capable GPU, impl="mosaic" raises even for dense decode (no interpret)."""
  if not NO_MOSAIC_HERE:
    pytest.skip("a Mosaic-capable GPU is present")
  a, w8, ws = bmm_inputs(rng, k=64, n=64)
  with pytest.raises(NotImplementedError):
    quantize_and_bmm_fp8(a, w8, ws, impl="mosaic")
  q, pages, table, lens = dense_case(rng, h=16)
  with pytest.raises(NotImplementedError, match="compute capability"):
    dense_mla_decode(q, pages, table, lens, softmax_scale=SCALE, impl="mosaic")
