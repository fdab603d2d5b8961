"""MLAConfig: preset numbers, validation messages, sharding helpers, rope scaling, Hugging Face configs."""
import dataclasses
import math

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
  # YaRN (DeepSeek-V3 / V3.2 config.json): softmax scale 192^-0.5 * (0.1 * 1 * ln 40 + 1)^2 = x1.8739
  ys = c.rope_scaling
  assert (ys.type, ys.factor, ys.original_max_position_embeddings, ys.beta_fast, ys.beta_slow, ys.mscale,
          ys.mscale_all_dim) == ("yarn", 40.0, 4096, 32.0, 1.0, 1.0, 1.0)
  assert c.rope_theta == 10000.0 and c.rms_norm_eps == 1e-6
  assert c.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-14)
  assert c.softmax_scale * 192 ** 0.5 == pytest.approx(1.8739, abs=1e-4)
  assert c.replace(rope_scaling=None).softmax_scale == pytest.approx(192 ** -0.5, rel=1e-15)
  assert c.page_size == 64 and c.dtype == "bfloat16"
  assert c.kernel_supported


def test_glm5_numbers():
  c = config.glm5()
  assert (c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim,
          c.v_head_dim, c.index_topk, c.hidden_size) == (64, 2048, 512, 192, 64, 256, 2048, 6144)
  assert c.qk_head_dim == 256
  assert c.latent_dim == 576
  assert c.softmax_scale == 1 / 16          # plain rope: no mscale
  assert c.rope_scaling is None and c.rope_theta == 1e6 and c.rms_norm_eps == 1e-6
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
  d = config.deepseek_v32().summary("deepseek_v32")
  assert d.startswith("MLAConfig deepseek_v32") and "yarn factor=40" in d
  assert max(len(line) for line in d.splitlines()) <= 120


def test_rope_scaling_field_accepts_hf_dicts_and_validates():
  hf = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn"}
  c = _base(rope_scaling=hf)
  assert c.rope_scaling == config.deepseek_v32().rope_scaling and isinstance(c.rope_scaling, config.RopeScaling)
  hash(c)   # static jit metadata: must stay hashable
  assert _base(rope_scaling=dict(hf, rope_type="yarn", rope_theta=10000.0)) == c   # rope_parameters style
  # Hugging Face's defaults for missing keys: mscale 1, mscale_all_dim 0 -> no softmax correction
  d = _base(rope_scaling={"type": "yarn", "factor": 40})
  assert d.rope_scaling.mscale_all_dim == 0.0 and d.softmax_scale == pytest.approx(192 ** -0.5, rel=1e-15)
  assert d.rope_scaling.table_factor == pytest.approx(0.1 * math.log(40) + 1, rel=1e-15)
  for bad, msg in [({"type": "yarn", "factor": 0.5}, "RopeScaling.factor"),
                   ({"type": "yarn"}, "needs 'factor'"),
                   ({"type": "yarn", "factor": 4, "beta_fast": 1, "beta_slow": 2}, "beta_fast must be > beta_slow"),
                   ({"type": "yarn", "factor": 4, "mscale": float("nan")}, "RopeScaling.mscale"),
                   ({"type": "yarn", "factor": 4, "original_max_position_embeddings": 0}, "original_max_position"),
                   ({"type": "yarn", "factor": 4, "alpha": 1}, "unknown key"),
                   ({"type": "rotary", "factor": 4}, "must be 'yarn'"),
                   ("yarn", "rope_scaling must be")]:
    with pytest.raises(ValueError, match=msg):
      _base(rope_scaling=bad)
  with pytest.raises(NotImplementedError, match="'linear' is not implemented"):
    _base(rope_scaling={"type": "linear", "factor": 4})
  with pytest.raises(ValueError, match="rope_theta must be > 1 with rope_scaling"):
    _base(rope_theta=1.0, rope_scaling=hf)


def test_rope_tables_of_a_config():
  from mla_pallas import reference, rope_scaling
  g = config.glm5()
  for a, b in zip(g.rope_tables(16), reference.rope_tables(16, 64, 1e6)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  d = config.deepseek_v32()
  for a, b in zip(d.rope_tables(16), rope_scaling.yarn_rope_tables(16, 64, 1e4, scaling=d.rope_scaling)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert not np.array_equal(np.asarray(d.rope_tables(16)[0]), np.asarray(reference.rope_tables(16)[0]))


def test_from_hf_config_reads_the_attention_fields_but_not_rms_norm_eps():
  ds = {"num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "index_topk": 2048, "hidden_size": 7168, "rms_norm_eps": 1e-6,
        "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                               "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                               "type": "yarn"}}
  assert config.from_hf_config(ds) == config.deepseek_v32()
  glm = {"num_attention_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
         "qk_rope_head_dim": 64, "v_head_dim": 256, "index_topk": 2048, "hidden_size": 6144, "rms_norm_eps": 1e-5,
         "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}}
  c = config.from_hf_config(glm, page_size=128)
  assert c == config.glm5(page_size=128) and c.rms_norm_eps == 1e-6   # not the config.json's 1e-5
  assert config.from_hf_config(dict(glm, rope_parameters={"rope_theta": 1e6, "rope_type": "yarn", "factor": 4})) \
      .rope_scaling == config.RopeScaling(factor=4.0)
  no_topk = {k: v for k, v in ds.items() if k != "index_topk"}     # DeepSeek-V3 (dense attention) has none
  with pytest.raises(ValueError, match="no 'index_topk'"):
    config.from_hf_config(no_topk)
  assert config.from_hf_config(no_topk, index_topk=64).index_topk == 64
