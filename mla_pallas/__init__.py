"""mla-pallas: FP8 Multi-head Latent Attention for JAX, with Pallas Mosaic GPU kernels (Hopper sm_90a).

Public API (flat). Every op takes ``impl="auto" | "mosaic" | "xla"`` and ``interpret=False``; see
:mod:`mla_pallas._dispatch`. Float32 oracles for every op live in :mod:`mla_pallas.reference`.
"""
from mla_pallas import cache, checkpoint, config, graph, layer, quant, reference, rope_scaling, testing
from mla_pallas._dispatch import last_impl
from mla_pallas.checkpoint import load_hf_attention
from mla_pallas.config import MLAConfig, deepseek_v32, from_hf_config, glm5
from mla_pallas.graph import MLAWeightsBF16, MLAWeightsFP8, graph_report
from mla_pallas.layer import MLAAttention, PagedCache
from mla_pallas.ops.bmm_fp8 import quantize_and_bmm_fp8
from mla_pallas.ops.convert import (convert_bf16_to_fp8_e4m3fn, convert_fp8_e4m3fn_to_bf16,
                                    load_block_scaled_checkpoint)
from mla_pallas.ops.dense_decode import dense_mla_decode
from mla_pallas.ops.prefill import mla_prefill
from mla_pallas.ops.rope_rmsnorm import fused_rope_rmsnorm_quantization, rms_norm, rope, rope_rmsnorm
from mla_pallas.ops.sparse_decode import sparse_mla_decode, sparse_mla_prefill
from mla_pallas.rope_scaling import RopeScaling, yarn_rope_tables

__version__ = "0.1.0"

__all__ = [
    "MLAAttention", "MLAConfig", "MLAWeightsBF16", "MLAWeightsFP8", "PagedCache", "RopeScaling", "cache",
    "checkpoint", "config", "graph", "graph_report", "layer", "convert_bf16_to_fp8_e4m3fn",
    "convert_fp8_e4m3fn_to_bf16", "deepseek_v32", "dense_mla_decode", "from_hf_config",
    "fused_rope_rmsnorm_quantization", "glm5", "last_impl", "load_block_scaled_checkpoint", "load_hf_attention",
    "mla_prefill", "quant", "quantize_and_bmm_fp8", "reference", "rms_norm", "rope", "rope_rmsnorm",
    "rope_scaling", "sparse_mla_decode", "sparse_mla_prefill", "testing", "yarn_rope_tables",
]
