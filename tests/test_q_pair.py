"""The attention ops' (q_latent [.., 512], q_rope [.., 64]) query form (ops/sparse_decode.q_parts): the kernels that
quantize q themselves (heads on N; heads on M "twin" over an fp8 cache) read both parts where they are, the other
paths concatenate them. Every path must give bitwise the outputs of the concatenated q (the kernels convert each
part to f32 before the row amax and the quantization, exactly as they convert the concatenated row), the pair's
kernels lower for sm_90a with no concatenation left in the graph, and bad pairs raise ValueError naming the part."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas import testing
from mla_pallas.kernels import common
from mla_pallas.ops import dense_decode as dd
from mla_pallas.ops import sparse_decode as sd

from _sparse_inputs import make_case

RACES = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=True)
FP8 = jnp.float8_e4m3fn


def _pair(q, rope_dtype=None):
  rope = q[..., common.D_V:]
  return q[..., :common.D_V], rope if rope_dtype is None else rope.astype(rope_dtype)


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)


def _assert_same(got, want):
  for a, b in zip(got, want):
    assert a.shape == b.shape and a.dtype == b.dtype
    assert np.array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("H,schedule", [(16, None), (128, None), (64, "producer_vt")])
def test_sparse_decode_pair_is_bitwise_the_concatenation(rng, H, schedule):
  """Heads on N (H 16) and heads on M ("twin" at H 128, "producer_vt" at H 64, whose multipliers quantize Q) read
  the pair in the kernel (race-checked): each gives the bits of the [.., 576] q."""
  case = make_case(rng, B=1, s_q=2, H=H, topk=75, page_size=16, num_pages=32)
  tuning = () if schedule is None else (("schedule", schedule),)
  fn = functools.partial(sd._sparse_decode_jit, softmax_scale=case.softmax_scale, impl="mosaic", arch="sm90",
                         tuning=tuning)
  kv = case.kv.reshape(-1, 576)
  scale = jnp.float32(case.kv_scale)
  want = fn(case.q, kv, case.indices, scale, None, interpret=True)
  testing.reset_interpreter()
  got = fn(_pair(case.q), kv, case.indices, scale, None, interpret=RACES)
  assert not testing.races_found()
  _assert_same(got, want)


def test_pair_with_f32_rope_is_the_f32_concatenation(rng):
  """A float32 rope part beside a bf16 latent: the row is their concatenation in float32 (jnp.concatenate's
  promotion), in the kernel as in the concatenated path."""
  case = make_case(rng, B=1, s_q=1, H=8, topk=64, page_size=16, num_pages=16)
  q32 = case.q.astype(jnp.float32)
  q32 = q32.at[..., common.D_V:].add(jnp.float32(1e-3))       # rope values that bf16 cannot hold
  lat, rope = q32[..., :common.D_V].astype(jnp.bfloat16), q32[..., common.D_V:]
  kw = dict(softmax_scale=case.softmax_scale, impl="mosaic", interpret=True)
  want = sd.sparse_mla_decode(jnp.concatenate([lat.astype(jnp.float32), rope], -1), case.kv, case.indices, **kw)
  got = sd.sparse_mla_decode((lat, rope), case.kv, case.indices, **kw)
  _assert_same(got, want)


@pytest.mark.parametrize("impl", ["mosaic", "xla"])
def test_prefill_and_dense_take_the_pair(rng, impl):
  """sparse_mla_prefill ([T, H, ..] parts) and dense_mla_decode (causal, ragged lengths) on the pair: bitwise their
  results on the concatenated q, on both paths."""
  case = make_case(rng, B=3, s_q=1, H=16, topk=40, page_size=16, num_pages=32)
  q = case.q[:, 0]
  kw = dict(softmax_scale=case.softmax_scale, impl=impl, interpret=True)
  _assert_same(sd.sparse_mla_prefill(_pair(q), case.kv, case.indices[:, 0], **kw),
               sd.sparse_mla_prefill(q, case.kv, case.indices[:, 0], **kw))
  qd = jnp.asarray(rng.standard_normal((2, 2, 16, 576)), jnp.bfloat16)
  pages = jnp.asarray(rng.standard_normal((8, 16, 576)), jnp.float32).astype(FP8)
  table = jnp.asarray([[3, 1, 0], [2, 5, -1]], jnp.int32)
  lens = jnp.asarray([37, 20], jnp.int32)
  kw = dict(kw, causal=True)
  _assert_same(dd.dense_mla_decode(_pair(qd), pages, table, lens, **kw),
               dd.dense_mla_decode(qd, pages, table, lens, **kw))


@pytest.mark.parametrize("H", [16, 128])
def test_pair_lowers_for_sm90_without_a_concatenation(H):
  """The op on the pair at sm_90a: one Mosaic kernel (no Q pre-pass), which loads the rope part from its own
  input (the same 16-byte loads as from a [.., 576] row), and no concatenate left in the XLA graph."""
  S = jax.ShapeDtypeStruct
  b, s_q, topk = 2, 1, 2048
  fn = functools.partial(sd._sparse_decode_jit, softmax_scale=0.1, impl="mosaic", interpret=False, arch="sm90")
  low = testing.lower_for_cuda(lambda lat, rope, kv, i, sc: fn((lat, rope), kv, i, sc, None),
                               S((b, s_q, H, 512), jnp.bfloat16), S((b, s_q, H, 64), jnp.bfloat16),
                               S((4096 * 8, 576), FP8), S((b, s_q, topk), jnp.int32), S((), jnp.float32))
  assert len(low.mosaic) == 1
  assert "concatenate" not in low.hlo
  whole = testing.lower_for_cuda(lambda q, kv, i, sc: fn(q, kv, i, sc, None), S((b, s_q, H, 576), jnp.bfloat16),
                                 S((4096 * 8, 576), FP8), S((b, s_q, topk), jnp.int32), S((), jnp.float32))
  load = r"llvm\.load[^\n]*vector<8xbf16>"
  assert low.count(load) == whole.count(load) > 0


def test_pair_errors():
  """Bad pairs raise ValueError naming the part and the expected shape."""
  case_q = jnp.zeros((2, 1, 16, 576), jnp.bfloat16)
  kv = jnp.zeros((4, 16, 576), FP8)
  idx = jnp.zeros((2, 1, 8), jnp.int32)
  kw = dict(softmax_scale=0.1, impl="xla")
  with pytest.raises(ValueError, match=r"q\[1\] \(q_rope\).*\[B, s_q, H, 64\]"):
    sd.sparse_mla_decode((case_q[..., :512], case_q[..., :32]), kv, idx, **kw)
  with pytest.raises(ValueError, match=r"q\[0\] \(q_latent\)"):
    sd.sparse_mla_decode((case_q, case_q[..., 512:]), kv, idx, **kw)
  with pytest.raises(ValueError, match=r"q\[1\] \(q_rope\).*leading dims"):
    sd.sparse_mla_decode((case_q[..., :512], case_q[:1, ..., 512:]), kv, idx, **kw)
  with pytest.raises(ValueError, match="pair"):
    sd.sparse_mla_decode((case_q,), kv, idx, **kw)
  with pytest.raises(ValueError, match=r"q\[1\] \(q_rope\).*dtype"):
    sd.sparse_mla_decode((case_q[..., :512], case_q[..., 512:].astype(jnp.int32)), kv, idx, **kw)
  with pytest.raises(ValueError, match=r"indices"):
    sd.sparse_mla_decode((case_q[..., :512], case_q[..., 512:]), kv, idx[:1], **kw)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("B,s_q,H", [(3, 2, 8), (2, 1, 16), (1, 1, 128), (8, 1, 64), (2, 4, 128)])
def test_pair_gpu_is_bitwise_the_concatenation(rng, B, s_q, H):
  """On the H200 (the raw-PTX quantizer, kernels/q_quant.quantize_head_rows_raw, reading the latent and rope parts
  from their own arrays): heads on N (H 8, 16) and heads on M "twin" (H 64, 128; one- and two-tile split plans)
  give bitwise the out and lse of the concatenated q; a float32 rope part beside a bf16 latent too."""
  case = make_case(rng, B=B, s_q=s_q, H=H, topk=2051, page_size=64, num_pages=256)
  kw = dict(softmax_scale=case.softmax_scale, kv_scale=case.kv_scale, impl="mosaic")
  fn = jax.jit(lambda q, kv, i: sd.sparse_mla_decode(q, kv, i, **kw))
  _assert_same(fn(_pair(case.q), case.kv, case.indices), fn(case.q, case.kv, case.indices))
  q32 = case.q.astype(jnp.float32).at[..., common.D_V:].add(jnp.float32(1e-3))
  lat, rope = q32[..., :common.D_V].astype(jnp.bfloat16), q32[..., common.D_V:]
  _assert_same(fn((lat, rope), case.kv, case.indices),
               fn(jnp.concatenate([lat.astype(jnp.float32), rope], -1), case.kv, case.indices))
