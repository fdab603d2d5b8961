"""kernels/split_combine.py: the merge of split partials against ops.sparse_decode.combine_splits (the XLA merge),
in interpret mode with race detection and lowered for sm_90a; on a GPU the same comparison natively."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mla_pallas import testing
from mla_pallas.kernels import split_combine
from mla_pallas.ops import sparse_decode as sd

RACES = jax.experimental.pallas.mosaic_gpu.InterpretGPUParams(detect_races=True)


def _inputs(rng, q_tiles, splits, dtype):
  o = jnp.asarray(rng.standard_normal((q_tiles, splits, 64, 512)), jnp.float32).astype(dtype)
  lse = rng.standard_normal((q_tiles, splits, 64)).astype(np.float32) * 3
  lse[0, 1, :] = -np.inf          # a split with nothing valid (weight 0)
  lse[-1, :, 5] = -np.inf         # a row with nothing valid in any split: out 0, lse -inf
  return o, jnp.asarray(lse)


def _check(out, lse, ref_out, ref_lse):
  assert out.shape == ref_out.shape and out.dtype == jnp.bfloat16 and lse.shape == ref_lse.shape
  # the same f32 arithmetic summed in split order: at most about one bf16 rounding apart (2^-8 relative)
  testing.assert_close_fp8(out, ref_out.astype(jnp.bfloat16), rel_l2=2.0 ** -8, what="merge kernel vs XLA")
  fin = np.isfinite(np.asarray(ref_lse))
  assert np.array_equal(np.isfinite(np.asarray(lse)), fin)
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(ref_lse)[fin], rtol=1e-6, atol=1e-6)
  assert np.all(np.asarray(out, np.float32)[~fin] == 0)


@pytest.mark.parametrize("q_tiles,splits,dtype", [(3, 4, jnp.float32), (2, 2, jnp.bfloat16), (1, 8, jnp.float32)])
def test_matches_xla_merge_interpret(rng, q_tiles, splits, dtype):
  o, lse = _inputs(rng, q_tiles, splits, dtype)
  testing.reset_interpreter()
  out, out_lse = split_combine.combine(o, lse, interpret=RACES)
  assert not testing.races_found()
  _check(out, out_lse, *sd.combine_splits(o, lse))


def test_shape_errors():
  with pytest.raises(ValueError, match="num_splits, 64, 512"):
    split_combine.combine(jnp.zeros((2, 2, 32, 512)), jnp.zeros((2, 2, 32)))
  with pytest.raises(ValueError, match="lse"):
    split_combine.combine(jnp.zeros((2, 2, 64, 512)), jnp.zeros((2, 3, 64)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_sm90(dtype):
  S = jax.ShapeDtypeStruct
  low = testing.lower_for_cuda(split_combine.build(32, 4), S((32, 4, 64, 512), dtype), S((32, 4, 64), jnp.float32))
  txt = "".join(low.mosaic)
  # per thread: 4 splits x 64 partial values in pairs (8-byte f32 / 4-byte bf16 loads) + the lse rows; 32 bf16
  # pair stores of the merged piece
  assert txt.count("llvm.load") >= 4 * 32
  assert txt.count("cp.async.bulk") >= 1 or txt.count("nvvm.cp.async.bulk") >= 1


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("splits,dtype", [(4, jnp.float32), (8, jnp.bfloat16)])
def test_matches_xla_merge_gpu(rng, splits, dtype):
  o, lse = _inputs(rng, 40, splits, dtype)
  _check(*split_combine.combine(o, lse), *jax.jit(sd.combine_splits)(o, lse))
