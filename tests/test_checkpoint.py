"""mla_pallas.checkpoint: one MLA layer from a Hugging Face safetensors file (names, torch [out, in] layout, FP8 with
weight_scale_inv 128x128 block scales, bf16), against MLAAttention.from_checkpoint of the same dequantized arrays.

The files are written with the ``safetensors`` package (its NumPy API) in DeepSeek-V3 / GLM-MoE-DSA naming, with
unrelated tensors (indexer, MLP, another layer) beside them. The FP8 tensors are quantized here in NumPy, block by
block (``scale_inv = amax / 448``, ``W8 = e4m3(W / scale_inv)``), and the expected layer is built from
``W8 * scale_inv`` computed here, so loader and expectation share nothing but the file. Comparisons are exact:
both sides form the same float32 products and round them once to bfloat16.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import safetensors
from safetensors.numpy import load_file, save_file

import jax.numpy as jnp

from mla_pallas import checkpoint
from mla_pallas.config import deepseek_v32, glm5
from mla_pallas.layer import MLAAttention

PREFIX = "model.layers.3.self_attn."
E4M3 = ml_dtypes.float8_e4m3fn
# q_lora_rank 192 and H*(nope+64) = 384: partial 128-blocks on both axes of q_a_proj / q_b_proj.
CFG = deepseek_v32(num_heads=2, hidden_size=320, q_lora_rank=192, index_topk=64, page_size=16)
FIELDS = ("w_q_a", "q_a_norm", "w_q_b", "w_kv_a", "kv_a_norm", "w_uk", "w_uv", "w_o")


def _torch_weights(rng, cfg):
  """Random float32 weights in torch's [out, in] layout, by module name."""
  out = {}
  for m, shape in checkpoint.hf_attention_shapes(cfg).items():
    out[m] = (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1
              else rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
  return out


def _quantize_blocks(w):
  """DeepSeek's checkpoint format, in NumPy: (W8 e4m3 [out, in], scale_inv f32 [ceil(out/128), ceil(in/128)])."""
  o, i = w.shape
  ob, ib = -(-o // 128), -(-i // 128)
  s = np.ones((ob, ib), np.float32)
  for a in range(ob):
    for b in range(ib):
      amax = np.abs(w[a * 128:(a + 1) * 128, b * 128:(b + 1) * 128]).max()
      s[a, b] = amax / 448.0 if amax > 0 else 1.0
  full = np.repeat(np.repeat(s, 128, 0), 128, 1)[:o, :i]
  return (w / full).astype(E4M3), s


def _dequant(w8, s):
  o, i = w8.shape
  return w8.astype(np.float32) * np.repeat(np.repeat(s, 128, 0), 128, 1)[:o, :i]


def _unrelated(rng):
  return {PREFIX + "indexer.wq_b.weight": rng.standard_normal((8, 4)).astype(ml_dtypes.bfloat16),
          "model.layers.3.mlp.gate.weight": rng.standard_normal((4, 4)).astype(np.float32),
          "model.layers.4.self_attn.o_proj.weight": rng.standard_normal((3, 3)).astype(np.float32)}


def _write(tmp_path, tensors, name="layer.safetensors"):
  path = tmp_path / name
  save_file(tensors, str(path))
  return path


def _expected(cfg, torch_w, dtype=jnp.bfloat16):
  t = {m: jnp.asarray(w.T if w.ndim == 2 else w, dtype) for m, w in torch_w.items()}
  lora = cfg.q_lora_rank is not None
  return MLAAttention.from_checkpoint(
      cfg, w_q_a=t["q_a_proj"] if lora else None, q_a_norm=t["q_a_layernorm"] if lora else None,
      w_q_b=t["q_b_proj"] if lora else t["q_proj"], w_kv_a=t["kv_a_proj_with_mqa"], kv_a_norm=t["kv_a_layernorm"],
      w_kv_b=t["kv_b_proj"], w_o=t["o_proj"])


def _assert_same_layer(got, want):
  assert not got.fp8 and got.cfg == want.cfg
  for f in FIELDS:
    a, b = getattr(got, f), getattr(want, f)
    if b is None:
      assert a is None, f
      continue
    assert a.dtype == b.dtype and a.shape == b.shape, (f, a.dtype, a.shape, b.dtype, b.shape)
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=f)


def test_fp8_checkpoint_with_block_scales(tmp_path, rng):
  w = _torch_weights(rng, CFG)
  tensors, deq = _unrelated(rng), {}
  for m, x in w.items():
    if x.ndim == 1:
      tensors[PREFIX + m + ".weight"] = x.astype(ml_dtypes.bfloat16)
      deq[m] = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    else:
      w8, s = _quantize_blocks(x)
      tensors[PREFIX + m + ".weight"], tensors[PREFIX + m + ".weight_scale_inv"] = w8, s
      deq[m] = _dequant(w8, s)
  path = _write(tmp_path, tensors)
  got = checkpoint.load_hf_attention(CFG, path, prefix=PREFIX)
  _assert_same_layer(got, _expected(CFG, deq))
  # the FP8 round trip is the checkpoint's, not an identity: the dequantized weights differ from the originals
  assert not np.array_equal(deq["q_b_proj"], w["q_b_proj"])
  got32 = checkpoint.load_hf_attention(CFG, str(path), prefix=PREFIX, dtype=jnp.float32)
  _assert_same_layer(got32, _expected(CFG, deq, jnp.float32))


def test_bf16_checkpoint_shards_and_dicts(tmp_path, rng):
  w = {m: x.astype(ml_dtypes.bfloat16) for m, x in _torch_weights(rng, CFG).items()}
  tensors = {PREFIX + m + ".weight": x for m, x in w.items()} | _unrelated(rng)
  want = _expected(CFG, {m: x.astype(np.float32) for m, x in w.items()})
  path = _write(tmp_path, tensors)
  _assert_same_layer(checkpoint.load_hf_attention(CFG, path, prefix=PREFIX), want)
  # two shards, the layer's tensors split across them
  names = sorted(tensors)
  a = _write(tmp_path, {n: tensors[n] for n in names[::2]}, "model-00001-of-00002.safetensors")
  b = _write(tmp_path, {n: tensors[n] for n in names[1::2]}, "model-00002-of-00002.safetensors")
  _assert_same_layer(checkpoint.load_hf_attention(CFG, [a, b], prefix=PREFIX), want)
  # tensors read by the caller
  _assert_same_layer(checkpoint.load_hf_attention(CFG, load_file(str(path)), prefix=PREFIX), want)


def test_reader_agrees_with_the_safetensors_package(tmp_path, rng):
  w8, s = _quantize_blocks(rng.standard_normal((130, 200)).astype(np.float32))
  tensors = {"w8": w8, "s": s, "b16": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
             "i32": np.arange(7, dtype=np.int32), "empty": np.zeros((0, 4), np.float32)}
  path = _write(tmp_path, tensors)
  ours = checkpoint.read_safetensors(path)
  with safetensors.safe_open(str(path), "numpy") as f:
    assert set(f.keys()) == set(ours)
    for n in ("s", "b16", "i32", "empty"):
      theirs = f.get_tensor(n)
      assert ours[n].dtype == theirs.dtype and ours[n].shape == theirs.shape
      np.testing.assert_array_equal(np.asarray(ours[n]), theirs)
  # safetensors 0.8's NumPy reader cannot return float8; compare the raw bytes of its deserializer instead
  raw = dict(safetensors.deserialize(path.read_bytes()))["w8"]
  assert raw["dtype"] == "F8_E4M3" and ours["w8"].dtype == E4M3 and list(ours["w8"].shape) == raw["shape"]
  assert np.asarray(ours["w8"]).tobytes() == bytes(raw["data"])
  np.testing.assert_array_equal(np.asarray(ours["w8"]).astype(np.float32), w8.astype(np.float32))
  assert set(checkpoint.read_safetensors(path, ["s", "missing"])) == {"s"}
  bad = tmp_path / "bad.safetensors"
  bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
  with pytest.raises(ValueError, match="not a safetensors file"):
    checkpoint.read_safetensors(bad)


def test_no_q_lora_glm_naming(tmp_path, rng):
  cfg = glm5(num_heads=2, hidden_size=256, q_lora_rank=None, index_topk=64, page_size=16)
  w = {m: x.astype(ml_dtypes.bfloat16) for m, x in _torch_weights(rng, cfg).items()}
  assert "q_proj" in w and "q_a_proj" not in w
  path = _write(tmp_path, {"model.layers.0.self_attn." + m + ".weight": x for m, x in w.items()})
  got = checkpoint.load_hf_attention(cfg, path)   # default prefix: layer 0
  _assert_same_layer(got, _expected(cfg, {m: x.astype(np.float32) for m, x in w.items()}))
  assert got.w_q_a is None and got.w_q_b.shape == (2, 256, 192 + 64)


def _fp8_tensors(rng):
  tensors = {}
  for m, x in _torch_weights(rng, CFG).items():
    if x.ndim == 1:
      tensors[PREFIX + m + ".weight"] = x
    else:
      tensors[PREFIX + m + ".weight"], tensors[PREFIX + m + ".weight_scale_inv"] = _quantize_blocks(x)
  return tensors


@pytest.mark.parametrize("edit,msg", [
    (lambda t: t.pop(PREFIX + "o_proj.weight"),
     r"no tensor 'model\.layers\.3\.self_attn\.o_proj\.weight' \(expected shape \[320, 256\]\)"),
    (lambda t: t.pop(PREFIX + "kv_a_layernorm.weight"), r"no tensor '.*kv_a_layernorm\.weight'"),
    (lambda t: t.pop(PREFIX + "kv_b_proj.weight_scale_inv"),
     r"no tensor '.*kv_b_proj\.weight_scale_inv' \(expected float32 shape \[4, 4\]"),
    (lambda t: t.update({PREFIX + "q_b_proj.weight": t[PREFIX + "q_b_proj.weight"].T}),
     r"'.*q_b_proj\.weight' must have shape \[384, 192\] \(torch \[out, in\]\); got \[192, 384\]"),
    (lambda t: t.update({PREFIX + "q_a_proj.weight_scale_inv": np.ones((1, 1), np.float32)}),
     r"'.*q_a_proj\.weight_scale_inv' must have shape \[2, 3\]"),
    (lambda t: t.update({PREFIX + "o_proj.weight": np.zeros((320, 256), np.int32)}),
     r"'.*o_proj\.weight' must be float8_e4m3fn .* got int32"),
])
def test_errors_name_the_tensor(tmp_path, rng, edit, msg):
  tensors = _fp8_tensors(rng)
  edit(tensors)
  path = _write(tmp_path, tensors)
  with pytest.raises(ValueError, match=msg):
    checkpoint.load_hf_attention(CFG, path, prefix=PREFIX)


def test_bad_arguments(tmp_path, rng):
  path = _write(tmp_path, _fp8_tensors(rng))
  with pytest.raises(ValueError, match="no tensor 'model.layers.0.self_attn.q_a_proj.weight'"):
    checkpoint.load_hf_attention(CFG, path)                     # wrong (default) prefix
  with pytest.raises(ValueError, match="cfg must be an MLAConfig"):
    checkpoint.load_hf_attention({"num_heads": 2}, path)
  with pytest.raises(ValueError, match="dtype must be bfloat16 or float32"):
    checkpoint.load_hf_attention(CFG, path, prefix=PREFIX, dtype=jnp.float16)
  with pytest.raises(ValueError, match="source must be a safetensors path"):
    checkpoint.load_hf_attention(CFG, 3, prefix=PREFIX)
