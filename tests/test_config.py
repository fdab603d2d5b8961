"""MLAConfig: preset numbers, validation messages, sharding helpers."""
import dataclasses

import jax
import numpy as np
import pytest

from mla_pallas import config
from mla_pallas.config import MLAConfig


def _base(**kw):
  args = dict(num_heads=16, q_lora_rank=1536, qk_nope_head_dim=128, v_head_dim=128, index_topk=2048,
              hidden_size=7168)
  args.update(kw)
  return MLAConfig(**args)


def test_deepseek_v32_numbers():
  c = config.deepseek_v32()
  assert (c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
          c.v_head_dim, c.index_topk, c.hidden_size) == (128, 1536, 512, 128, 64, 128, 2048, 7168)
  assert c.qk_head_dim == 192
  assert c.latent_dim == c.d_qk == 576
  assert c.d_v == 512
  assert c.softmax_scale == pytest.approx(192 ** -0.5, rel=1e-15)
  assert c.page_size == 64 and c.dtype == "bfloat16"
  assert c.kernel_supported


def test_glm5_numbers():
  c = config.glm5()
  assert (c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
          c.v_head_dim, c.index_topk, c.hidden_size) == (64, 2048, 512, 192, 64, 256, 2048, 6144)
  assert c.qk_head_dim == 256
  assert c.latent_dim == 576
  assert c.softmax_scale == 1 / 16
  assert c.kernel_supported


def test_preset_overrides_and_lookup():
  assert config.deepseek_v32(page_size=128).page_size == 128
  assert config.preset("deepseek-v3.2") == config.deepseek_v32()
  assert config.preset("GLM-5", num_heads=8) == config.glm5().with_heads(8)
  with pytest.raises(ValueError, match="preset must be one of deepseek_v32, glm5"):
    config.preset("llama")
  with pytest.raises(ValueError, match="MLAConfig.page_size"):
    config.glm5(page_size=20)


def test_num_heads_message_exact():
  with pytest.raises(ValueError) as e:
    _base(num_heads=0)
  assert str(e.value) == "MLAConfig.num_heads must be a positive int; got 0"


@pytest.mark.parametrize("field,value,msg", [
    ("num_heads", -4, "positive int"),
    ("num_heads", 2.0, "positive int"),
    ("num_heads", True, "positive int"),
    ("q_lora_rank", 0, "positive int or None"),
    ("kv_lora_rank", 0, "positive int"),
    ("qk_nope_head_dim", "128", "positive int"),
    ("qk_rope_head_dim", 0, "positive int"),
    ("qk_rope_head_dim", 63, "even"),
    ("v_head_dim", -1, "positive int"),
    ("index_topk", 0, "positive int"),
    ("hidden_size", None, "positive int"),
    ("page_size", 0, "positive int"),
    ("page_size", 24, "multiple of 16"),
    ("page_size", 8, "multiple of 16"),
    ("rms_norm_eps", 0.0, "> 0"),
    ("rms_norm_eps", float("nan"), "> 0"),
    ("rope_theta", -1.0, "> 0"),
    ("rope_theta", float("inf"), "> 0"),
    ("dtype", "int8", "one of bfloat16, float16, float32"),
    ("dtype", 3, "one of"),
])
def test_validation_names_field(field, value, msg):
  with pytest.raises(ValueError, match=f"MLAConfig\\.{field} must .*{msg}"):
    _base(**{field: value})


def test_normalization():
  c = _base(num_heads=np.int64(8), q_lora_rank=None, dtype=np.dtype("float32"), rope_theta=50000)
  assert c.num_heads == 8 and type(c.num_heads) is int
  assert c.q_lora_rank is None
  assert c.dtype == "float32"
  assert c.rope_theta == 50000.0 and type(c.rope_theta) is float
  assert _base(dtype=jax.numpy.bfloat16).dtype == "bfloat16"


def test_frozen_hashable_keyword_only():
  c = config.deepseek_v32()
  with pytest.raises(dataclasses.FrozenInstanceError):
    c.num_heads = 4
  assert hash(c) == hash(config.deepseek_v32())  # usable as a static jit argument
  with pytest.raises(TypeError):
    MLAConfig(128, 1536)  # keyword-only construction


def test_replace():
  c = config.deepseek_v32()
  d = c.replace(index_topk=512, page_size=128)
  assert (d.index_topk, d.page_size, d.num_heads) == (512, 128, 128)
  assert c.index_topk == 2048  # original untouched
  with pytest.raises(ValueError, match="MLAConfig has no field 'heads'"):
    c.replace(heads=4)
  with pytest.raises(ValueError, match="MLAConfig.v_head_dim"):
    c.replace(v_head_dim=0)


@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16, 32, 64, 128])
def test_heads_per_shard(tp):
  c = config.deepseek_v32()
  assert c.heads_per_shard(tp) == 128 // tp
  s = c.shard(tp)
  assert s.num_heads == 128 // tp
  assert s.replace(num_heads=128) == c  # nothing else changes


@pytest.mark.parametrize("tp", [3, 0, -2, 256, 2.0])
def test_heads_per_shard_rejects(tp):
  with pytest.raises(ValueError, match="tp"):
    config.deepseek_v32().heads_per_shard(tp)


def test_glm5_shards_and_with_heads():
  c = config.glm5()
  assert [c.heads_per_shard(tp) for tp in (1, 2, 4, 8)] == [64, 32, 16, 8]
  with pytest.raises(ValueError, match="must divide MLAConfig.num_heads=64"):
    c.shard(128)
  assert c.with_heads(5).num_heads == 5
  with pytest.raises(ValueError, match="MLAConfig.num_heads"):
    c.with_heads(0)


def test_kernel_support_and_sizes():
  c = config.deepseek_v32(kv_lora_rank=256)
  assert c.latent_dim == 320 and not c.kernel_supported
  with pytest.raises(NotImplementedError, match="kv_lora_rank=512"):
    c.check_kernel_supported()
  config.glm5().check_kernel_supported()
  d = config.deepseek_v32()
  assert d.kv_bytes_per_token == 576
  assert d.kv_cache_bytes(0) == 0
  assert d.kv_cache_bytes(65) == 2 * 64 * 576  # rounded up to whole pages
  with pytest.raises(ValueError, match="num_tokens"):
    d.kv_cache_bytes(-1)


def test_summary():
  s = str(config.glm5())
  assert s.splitlines()[0] == "MLAConfig"
  for needle in ("num_heads", "64", "latent_dim", "576", "softmax_scale", "0.0625"):
    assert needle in s
  assert config.deepseek_v32().summary("deepseek_v32").startswith("MLAConfig deepseek_v32")
