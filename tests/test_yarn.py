"""YaRN rope scaling (mla_pallas.rope_scaling, MLAConfig.softmax_scale / rope_tables) against an independent float64
NumPy transcription of the published formulas: Hugging Face DeepSeek-V3 ``modeling_deepseek.py``
(``yarn_find_correction_dim``, ``yarn_find_correction_range``, ``yarn_linear_ramp_mask``, ``yarn_get_mscale``,
``DeepseekV3YarnRotaryEmbedding``: ``inv_freq = freq_inter * (1 - inv_freq_mask) + freq_extra * inv_freq_mask``,
cos / sin times ``mscale / mscale_all_dim`` ratio, softmax scale times ``mscale_all_dim``'s mscale squared) and
DeepSeek's ``inference/model.py`` (``precompute_freqs_cis``: ``freqs / factor * (1 - smooth) + freqs * smooth``).

Tolerance of the tables: library and oracle both evaluate in float64 (angles up to 2e5 rad: an absolute error of a
few 1e-11 each) and round once to float32, so they agree to one float32 spacing of the value (``np.spacing``).
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from mla_pallas import config, reference, rope_scaling
from mla_pallas.rope_scaling import RopeScaling

# ---- the oracle (Hugging Face DeepSeek-V3 names and structure, float64) ---------------------------------


def hf_yarn_find_correction_dim(num_rotations, dim, base=10000, max_position_embeddings=2048):
  return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def hf_yarn_find_correction_range(low_rot, high_rot, dim, base=10000, max_position_embeddings=2048):
  low = math.floor(hf_yarn_find_correction_dim(low_rot, dim, base, max_position_embeddings))
  high = math.ceil(hf_yarn_find_correction_dim(high_rot, dim, base, max_position_embeddings))
  return max(low, 0), min(high, dim - 1)


def hf_yarn_get_mscale(scale=1, mscale=1):
  if scale <= 1:
    return 1.0
  return 0.1 * mscale * math.log(scale) + 1.0


def hf_yarn_linear_ramp_mask(min_, max_, dim):
  if min_ == max_:
    max_ += 0.001
  linear_func = (np.arange(dim, dtype=np.float64) - min_) / (max_ - min_)
  return np.clip(linear_func, 0, 1)


def hf_inv_freq(dim, base, factor, original_max_position_embeddings, beta_fast, beta_slow):
  freq_extra = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
  freq_inter = 1.0 / (factor * base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
  low, high = hf_yarn_find_correction_range(beta_fast, beta_slow, dim, base, original_max_position_embeddings)
  inv_freq_mask = 1.0 - hf_yarn_linear_ramp_mask(low, high, dim // 2)
  return freq_inter * (1 - inv_freq_mask) + freq_extra * inv_freq_mask


def hf_cos_sin(positions, dim, base, s: dict):
  inv = hf_inv_freq(dim, base, s["factor"], s["original_max_position_embeddings"], s["beta_fast"], s["beta_slow"])
  freqs = np.outer(np.asarray(positions, np.float64), inv)
  m = hf_yarn_get_mscale(s["factor"], s["mscale"]) / hf_yarn_get_mscale(s["factor"], s["mscale_all_dim"])
  return np.cos(freqs) * m, np.sin(freqs) * m


def hf_softmax_scale(qk_head_dim, s: dict):
  m = hf_yarn_get_mscale(s["factor"], s["mscale_all_dim"]) if s.get("mscale_all_dim") else 1.0
  return qk_head_dim ** -0.5 * m * m


def deepseek_official_freqs(dim, base, factor, original_seq_len, beta_fast, beta_slow):
  """inference/model.py precompute_freqs_cis (the branch max_seq_len > original_seq_len)."""
  freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
  low, high = hf_yarn_find_correction_range(beta_fast, beta_slow, dim, base, original_seq_len)
  smooth = 1 - hf_yarn_linear_ramp_mask(low, high, dim // 2)
  return freqs / factor * (1 - smooth) + freqs * smooth


# ---- tests ---------------------------------------------------------------------------------------------

DEEPSEEK = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
CASES = {
    "deepseek_v3": (DEEPSEEK, 10000.0),
    "mscale_only_tables": (dict(DEEPSEEK, mscale_all_dim=0.0), 10000.0),      # HF default mscale_all_dim
    "v2_style": (dict(DEEPSEEK, mscale=0.707, mscale_all_dim=0.707, factor=4.0), 10000.0),
    "theta_1e6_factor_8": (dict(DEEPSEEK, factor=8.0, original_max_position_embeddings=8192), 1e6),
}


def _within_one_f32_spacing(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  tol = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
  bad = np.abs(got - want) > tol
  assert not bad.any(), f"{bad.sum()} entries off by more than one f32 spacing, max {np.abs(got - want).max():.3g}"


@pytest.mark.parametrize("case", list(CASES))
def test_yarn_tables_match_the_published_formulas(case):
  s, theta = CASES[case]
  max_pos = 163840 if case == "deepseek_v3" else 20000          # DeepSeek-V3's max_position_embeddings
  cos, sin = rope_scaling.yarn_rope_tables(max_pos, 64, theta, scaling=RopeScaling.from_dict(s))
  assert cos.shape == sin.shape == (max_pos, 32) and cos.dtype == sin.dtype == np.float32
  pos = np.r_[0:64, np.linspace(64, max_pos - 1, 200).astype(np.int64), max_pos - 1]
  want_cos, want_sin = hf_cos_sin(pos, 64, theta, s)
  _within_one_f32_spacing(np.asarray(cos)[pos], want_cos)
  _within_one_f32_spacing(np.asarray(sin)[pos], want_sin)
  # the two published formulations of the frequencies are the same numbers
  np.testing.assert_allclose(
      hf_inv_freq(64, theta, s["factor"], s["original_max_position_embeddings"], s["beta_fast"], s["beta_slow"]),
      deepseek_official_freqs(64, theta, s["factor"], s["original_max_position_embeddings"], s["beta_fast"],
                              s["beta_slow"]), rtol=1e-15)
  np.testing.assert_allclose(rope_scaling.yarn_inv_freq(64, theta, RopeScaling.from_dict(s)),
                             hf_inv_freq(64, theta, s["factor"], s["original_max_position_embeddings"],
                                         s["beta_fast"], s["beta_slow"]), rtol=1e-15)


def test_yarn_differs_from_plain_rope_where_the_formulas_say():
  """The check above can fail: the interpolated (low-frequency) dims of a YaRN table are far from plain rope's,
  the extrapolated (high-frequency) dims equal them."""
  s = RopeScaling.from_dict(DEEPSEEK)
  low, high = hf_yarn_find_correction_range(32, 1, 64, 10000.0, 4096)
  assert (low, high) == (10, 23)
  y_cos, _ = rope_scaling.yarn_rope_tables(8192, scaling=s)
  p_cos, _ = reference.rope_tables(8192)
  y_cos, p_cos = np.asarray(y_cos), np.asarray(p_cos)
  np.testing.assert_array_equal(y_cos[:, :low], p_cos[:, :low])
  assert np.abs(y_cos[:, high:] - p_cos[:, high:]).max() > 0.5
  with pytest.raises(AssertionError):
    _within_one_f32_spacing(p_cos[:, high:], y_cos[:, high:])


@pytest.mark.parametrize("case", list(CASES))
def test_softmax_scale_matches_the_published_formula(case):
  s, theta = CASES[case]
  cfg = config.deepseek_v32(rope_scaling=s, rope_theta=theta)
  assert cfg.softmax_scale == pytest.approx(hf_softmax_scale(192, s), rel=1e-14)
  glm = config.glm5(rope_scaling=s, rope_theta=theta)
  assert glm.softmax_scale == pytest.approx(hf_softmax_scale(256, s), rel=1e-14)


def test_deepseek_preset_numbers():
  cfg = config.deepseek_v32()
  assert cfg.softmax_scale / 192 ** -0.5 == pytest.approx(1.8739, abs=1e-4)     # the x1.874
  cos, sin = cfg.rope_tables(4096)
  want_cos, want_sin = hf_cos_sin(np.arange(4096), 64, 10000.0, DEEPSEEK)
  _within_one_f32_spacing(cos, want_cos)
  _within_one_f32_spacing(sin, want_sin)
  assert config.glm5().softmax_scale == 256 ** -0.5


def test_factor_one_is_plain_rope():
  cos, sin = rope_scaling.yarn_rope_tables(512, 64, 10000.0, scaling=RopeScaling(factor=1.0, mscale_all_dim=1.0))
  p_cos, p_sin = reference.rope_tables(512)
  np.testing.assert_array_equal(np.asarray(cos), np.asarray(p_cos))
  np.testing.assert_array_equal(np.asarray(sin), np.asarray(p_sin))
  assert rope_scaling.yarn_get_mscale(1.0, 5.0) == 1.0


def test_bad_table_arguments():
  s = RopeScaling(factor=4.0)
  with pytest.raises(ValueError, match="max_pos"):
    rope_scaling.yarn_rope_tables(0, scaling=s)
  with pytest.raises(ValueError, match="dim must be even"):
    rope_scaling.yarn_rope_tables(8, 63, scaling=s)
  with pytest.raises(ValueError, match="theta must be a finite number > 1"):
    rope_scaling.yarn_rope_tables(8, 64, 1.0, scaling=s)
  with pytest.raises(ValueError, match="scaling must be a RopeScaling"):
    rope_scaling.yarn_rope_tables(8, 64, scaling=DEEPSEEK)
