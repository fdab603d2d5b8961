"""One MLA layer from a Hugging Face safetensors checkpoint (DeepSeek-V3 / V3.2, GLM-MoE-DSA naming).

:func:`load_hf_attention` reads the attention tensors of one decoder layer, ``<prefix><module>.weight`` with
``prefix`` e.g. ``"model.layers.0.self_attn."``:

======================  ====================================  ==============================================
module                  torch shape ``[out, in]``             becomes (:meth:`MLAAttention.from_checkpoint`)
======================  ====================================  ==============================================
``q_a_proj``            ``[q_lora_rank, hidden]``             ``w_q_a = W.T``
``q_a_layernorm``       ``[q_lora_rank]``                     ``q_a_norm``
``q_b_proj``            ``[H * (nope + rope), q_lora_rank]``  ``w_q_b = W.T``
``q_proj``              ``[H * (nope + rope), hidden]``       ``w_q_b = W.T`` (only when ``q_lora_rank`` is None)
``kv_a_proj_with_mqa``  ``[kv_lora_rank + rope, hidden]``     ``w_kv_a = W.T``
``kv_a_layernorm``      ``[kv_lora_rank]``                    ``kv_a_norm``
``kv_b_proj``           ``[H * (nope + v), kv_lora_rank]``    ``w_kv_b = W.T`` (split into ``w_uk`` / ``w_uv``)
``o_proj``              ``[hidden, H * v]``                   ``w_o = W.T``
======================  ====================================  ==============================================

``H = cfg.num_heads`` (the whole model's heads; shard afterwards with :meth:`MLAAttention.tp_specs`). A projection
is float32 / bfloat16 / float16, or float8_e4m3fn with ``<module>.weight_scale_inv`` float32 ``[ceil(out/128),
ceil(in/128)]`` (DeepSeek's 128x128 blocks: ``W[o, i] = W8[o, i] * weight_scale_inv[o // 128, i // 128]``,
:func:`mla_pallas.load_block_scaled_checkpoint`). FP8 projections are dequantized in float32 and every weight is
cast to ``dtype``: the layer is a bf16 :class:`MLAAttention`; ``.to_fp8()`` re-quantizes it in the layer's own
block layout (the per-head splits of ``q_b_proj`` / ``kv_b_proj`` do not fall on the checkpoint's 128-blocks).
Other tensors in the file (the indexer, the MLP, other layers) are not read.

The file is read with the safetensors format's own layout (an 8-byte little-endian header size, a JSON header, the
raw tensor bytes), memory-mapped, so only the layer's bytes are touched and no framework is needed; safetensors
0.8's NumPy / Flax readers cannot return float8 tensors.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any, Mapping, Sequence

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from mla_pallas import quant
from mla_pallas.config import MLAConfig
from mla_pallas.layer import MLAAttention
from mla_pallas.ops.convert import CHECKPOINT_BLOCK, load_block_scaled_checkpoint

__all__ = ["load_hf_attention", "read_safetensors", "hf_attention_shapes"]

_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
}
_FLOAT_WEIGHTS = (np.float32, np.float16, ml_dtypes.bfloat16)
_FP8 = np.dtype(ml_dtypes.float8_e4m3fn)


def _header(path: str) -> tuple[dict, int]:
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) != 8:
      raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header size)")
    (n,) = struct.unpack("<Q", head)
    if n > os.path.getsize(path) - 8:
      raise ValueError(f"{path}: not a safetensors file (header size {n} past the end of the file)")
    try:
      header = json.loads(f.read(n))
    except ValueError as e:
      raise ValueError(f"{path}: not a safetensors file (its header is not JSON: {e})") from None
  header.pop("__metadata__", None)
  return header, 8 + n


def read_safetensors(path: str | os.PathLike, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
  """Tensors of a safetensors file as read-only NumPy arrays (memory-mapped), float8 / bfloat16 as ml_dtypes.

  Args:
    path: the ``.safetensors`` file.
    names: the tensors to return (default all); names not in the file are left out (the caller checks).

  Raises:
    ValueError: not a safetensors file, an unknown dtype, or a tensor whose byte range does not match its shape.
  """
  path = os.fspath(path)
  header, start = _header(path)
  out = {}
  for name in (header if names is None else [n for n in names if n in header]):
    info = header[name]
    if info.get("dtype") not in _DTYPES:
      raise ValueError(f"{path}: tensor {name!r} has dtype {info.get('dtype')!r}; readable: {', '.join(_DTYPES)}")
    dt = np.dtype(_DTYPES[info["dtype"]])
    shape = tuple(int(d) for d in info["shape"])
    b, e = (int(x) for x in info["data_offsets"])
    if e - b != int(np.prod(shape, dtype=np.int64)) * dt.itemsize:
      raise ValueError(f"{path}: tensor {name!r} has {e - b} bytes for shape {list(shape)} {info['dtype']}")
    if e == b:
      out[name] = np.zeros(shape, dt)
    else:
      out[name] = np.memmap(path, dtype=dt, mode="r", offset=start + b, shape=shape)
  return out


def hf_attention_shapes(cfg: MLAConfig) -> dict[str, tuple[int, ...]]:
  """The torch shapes ``[out, in]`` of the attention modules of ``cfg`` (module table above), by module name."""
  h, nope, rope, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
  shapes = {}
  if cfg.q_lora_rank is None:
    shapes["q_proj"] = (h * (nope + rope), cfg.hidden_size)
  else:
    shapes["q_a_proj"] = (cfg.q_lora_rank, cfg.hidden_size)
    shapes["q_a_layernorm"] = (cfg.q_lora_rank,)
    shapes["q_b_proj"] = (h * (nope + rope), cfg.q_lora_rank)
  shapes["kv_a_proj_with_mqa"] = (cfg.kv_lora_rank + rope, cfg.hidden_size)
  shapes["kv_a_layernorm"] = (cfg.kv_lora_rank,)
  shapes["kv_b_proj"] = (h * (nope + v), cfg.kv_lora_rank)
  shapes["o_proj"] = (cfg.hidden_size, h * v)
  return shapes


def _gather(source, names: list[str]) -> dict[str, Any]:
  if isinstance(source, Mapping):
    return {n: source[n] for n in names if n in source}
  paths = [source] if isinstance(source, (str, os.PathLike)) else \
      list(source) if isinstance(source, (list, tuple)) else []
  if not paths or not all(isinstance(p, (str, os.PathLike)) for p in paths):
    raise ValueError("source must be a safetensors path, a list of paths (shards) or a dict of arrays; got "
                     f"{type(source).__name__}")
  found: dict[str, Any] = {}
  for p in paths:
    found.update(read_safetensors(p, [n for n in names if n not in found]))
  return found


def _dtype_name(a) -> str:
  return np.dtype(a.dtype).name


def _weight(tensors, name: str, want: tuple[int, ...], prefix: str) -> np.ndarray:
  """The dequantized float32 ``[in, out]`` matrix of projection ``name`` (or the float32 norm vector)."""
  key = prefix + name + ".weight"
  if key not in tensors:
    raise ValueError(f"checkpoint has no tensor {key!r} (expected shape {list(want)})")
  w = tensors[key]
  if tuple(w.shape) != want:
    raise ValueError(f"checkpoint tensor {key!r} must have shape {list(want)} (torch [out, in]); got "
                     f"{list(w.shape)}")
  if len(want) == 1:
    if np.dtype(w.dtype) not in [np.dtype(d) for d in _FLOAT_WEIGHTS]:
      raise ValueError(f"checkpoint tensor {key!r} must be float32 / bfloat16 / float16; got {_dtype_name(w)}")
    return np.asarray(w, np.float32)
  skey = prefix + name + ".weight_scale_inv"
  if np.dtype(w.dtype) == _FP8:
    sw = (-(-want[0] // CHECKPOINT_BLOCK), -(-want[1] // CHECKPOINT_BLOCK))
    if skey not in tensors:
      raise ValueError(f"checkpoint has no tensor {skey!r} (expected float32 shape {list(sw)}: the block scales "
                       f"of the float8_e4m3fn {key!r})")
    s = tensors[skey]
    if tuple(s.shape) != sw:
      raise ValueError(f"checkpoint tensor {skey!r} must have shape {list(sw)} (ceil([out, in] / 128)); got "
                       f"{list(s.shape)}")
    w8, scales = load_block_scaled_checkpoint(jnp.asarray(w), jnp.asarray(np.asarray(s, np.float32)))
    return np.asarray(quant.dequantize_blocks_fp8(w8, scales, dtype=jnp.float32))
  if np.dtype(w.dtype) not in [np.dtype(d) for d in _FLOAT_WEIGHTS]:
    raise ValueError(f"checkpoint tensor {key!r} must be float8_e4m3fn (with {skey!r}), bfloat16, float16 or "
                     f"float32; got {_dtype_name(w)}")
  return np.asarray(w, np.float32).T


def load_hf_attention(cfg: MLAConfig, source, *, prefix: str = "model.layers.0.self_attn.",
                      dtype=jnp.bfloat16) -> MLAAttention:
  """One layer's :class:`MLAAttention` from Hugging Face checkpoint tensors (module table above).

  Args:
    cfg: the layer's :class:`MLAConfig` (e.g. :func:`mla_pallas.config.from_hf_config` of the ``config.json``);
      it fixes every expected shape.
    source: a ``.safetensors`` path, a list of paths (the shards of a checkpoint; the first that holds a tensor
      wins), or a dict ``name -> array`` (torch layout, e.g. tensors you read yourself).
    prefix: the layer's name prefix, ``"model.layers.<i>.self_attn."`` in DeepSeek / GLM checkpoints.
    dtype: the weights' dtype in the returned layer (bfloat16, the layer's usual weight dtype, or float32).

  Returns:
    a bf16 (``fp8=False``) :class:`MLAAttention`, equal to :meth:`MLAAttention.from_checkpoint` of the dequantized,
    transposed matrices cast to ``dtype``.

  Raises:
    ValueError: a missing tensor, or one of the wrong shape or dtype, named with its expected shape.
  """
  if not isinstance(cfg, MLAConfig):
    raise ValueError(f"cfg must be an MLAConfig; got {type(cfg).__name__}")
  if not isinstance(prefix, str):
    raise ValueError(f"prefix must be a str such as 'model.layers.0.self_attn.'; got {prefix!r}")
  if np.dtype(dtype) not in (np.dtype(jnp.bfloat16), np.dtype(jnp.float32)):
    raise ValueError(f"dtype must be bfloat16 or float32; got {np.dtype(dtype).name}")
  shapes = hf_attention_shapes(cfg)
  names = [prefix + m + suffix for m in shapes for suffix in (".weight", ".weight_scale_inv")]
  tensors = _gather(source, names)
  w = {m: jnp.asarray(_weight(tensors, m, shape, prefix), dtype) for m, shape in shapes.items()}
  lora = cfg.q_lora_rank is not None
  return MLAAttention.from_checkpoint(
      cfg, w_q_a=w["q_a_proj"] if lora else None, q_a_norm=w["q_a_layernorm"] if lora else None,
      w_q_b=w["q_b_proj"] if lora else w["q_proj"], w_kv_a=w["kv_a_proj_with_mqa"], kv_a_norm=w["kv_a_layernorm"],
      w_kv_b=w["kv_b_proj"], w_o=w["o_proj"])
