"""One MLA attention layer (DeepSeek-V3.2 / GLM-5) as a plain frozen-dataclass pytree, on top of :mod:`mla_pallas.graph`.

``MLAAttention`` holds the weights of one layer for an :class:`~mla_pallas.config.MLAConfig`:

=============  =======================================  =======================================================
field          shape                                    role
=============  =======================================  =======================================================
``w_q_a``      ``[hidden, q_lora_rank]``                ``q_a = x @ w_q_a`` (None when ``q_lora_rank`` is None)
``q_a_norm``   ``[q_lora_rank]``                        RMSNorm of ``q_a`` (None when ``q_lora_rank`` is None)
``w_q_b``      ``[H, q_lora_rank or hidden, nope+64]``  per-head query up-projection (W_q_b, or W_q)
``w_kv_a``     ``[hidden, 576]``                        ``kv = x @ w_kv_a`` (512 latent ‖ 64 k_rope)
``kv_a_norm``  ``[512]``                                latent RMSNorm (inside the fused cache write)
``w_uk``       ``[H, nope, 512]``                       W_kv_b's key part, absorbed form
``w_uv``       ``[H, 512, v]``                          W_kv_b's value part
``w_o``        ``[H, v, hidden]``                       output projection (W_o ``[H*v, hidden]`` per head)
=============  =======================================  =======================================================

Per-head weights keep the head axis first so that tensor parallelism is a split of axis 0 (:meth:`tp_specs`); the
head count is read from the weights, so a shard's slice of the layer runs unchanged inside ``jax.shard_map``,
and the output projection's partial sums (over the shard's heads) are combined with ``psum`` over ``tp_axis``.

``.to_fp8()`` converts every weight matrix to float8_e4m3fn with 128x128 block scales
(:func:`mla_pallas.convert_bf16_to_fp8_e4m3fn`; the ``*_scale`` fields, ``fp8=True``) and stores it K-major
(``kernel_layout=True``: each matrix above transposed in its last two axes, ``[.., N, K]``, the FP8 matmul
kernel's layout, so no call transposes a weight; the scales keep their ``[.., ceil(K/128), ceil(N/128)]`` shape;
:meth:`MLAAttention.matrix` gives any matrix in the table's layout). Every matmul of an FP8
layer goes through ``quantize_and_bmm_fp8`` (per-token dynamic activation quantization; the 2-D projections as a
1-head BMM, the per-head ones with the activation broadcast over heads); a bf16 layer uses bf16 einsums with f32
accumulation. The attention part is :mod:`mla_pallas.graph` (the FP8 or BF16 graph by the flag); its softmax scale
is ``cfg.softmax_scale`` (YaRN's mscale included when ``cfg.rope_scaling`` is set) and its rope tables default to
``cfg.rope_tables(capacity)`` (YaRN tables under ``cfg.rope_scaling``), ``capacity = block_table.shape[1] *
page_size`` positions; pass ``cos`` / ``sin`` built once with :meth:`MLAAttention.rope_tables` to avoid rebuilding
them (as jit constants) per traced call.

:func:`mla_pallas.checkpoint.load_hf_attention` builds a layer from a Hugging Face safetensors checkpoint.

:class:`PagedCache` bundles the pages (FP8, or bf16 for a BF16 layer's BF16 attention), the per-tensor scale, the
block table and the sequence lengths.
:func:`reference_prefill` / :func:`reference_decode` are the float32 oracles of :meth:`MLAAttention.prefill` /
:meth:`MLAAttention.decode` (the reference graph of :mod:`mla_pallas.graph`, float32 projections).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from mla_pallas import _checks, cache as _cache, graph, reference
from mla_pallas.config import MLAConfig
from mla_pallas.ops.bmm_fp8 import quantize_and_bmm_fp8
from mla_pallas.ops.convert import convert_bf16_to_fp8_e4m3fn
from mla_pallas.ops.rope_rmsnorm import rms_norm

__all__ = ["MLAAttention", "PagedCache", "reference_prefill", "reference_decode", "token_slots"]

_HI = jax.lax.Precision.HIGHEST
_PER_HEAD = ("w_q_b", "w_uk", "w_uv", "w_o")
_MATRICES = ("w_q_a", "w_q_b", "w_kv_a", "w_uk", "w_uv", "w_o")


# ----------------------------------------------------------------------------------------------------------
# cache
# ----------------------------------------------------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedCache:
  """Paged latent cache of a batch (layout: :mod:`mla_pallas.cache`).

  Attributes:
    pages: ``[num_pages, page_size, 576]`` float8_e4m3fn (576 B per token), or bfloat16 (1152 B per token) for a
      BF16 layer's BF16 attention (an FP8 layer needs float8_e4m3fn).
    kv_scale: float32 scalar (per-tensor scale).
    block_table: int32 ``[B, max_pages_per_seq]``.
    seq_lens: int32 ``[B]`` tokens already in the cache per sequence.
  """
  pages: jax.Array
  kv_scale: jax.Array
  block_table: jax.Array
  seq_lens: jax.Array

  @staticmethod
  def create(cfg: MLAConfig, batch: int, max_len: int, *, kv_scale: float | None = None, num_pages=None,
             shuffle_key=None, dtype=_cache.FP8) -> "PagedCache":
    """An empty cache for ``batch`` sequences of up to ``max_len`` tokens (``page_size = cfg.page_size``).

    Sequence b owns pages ``block_table[b]`` (consecutive, or a random permutation with ``shuffle_key``).
    ``dtype``: float8_e4m3fn (default) or bfloat16 (:mod:`mla_pallas.cache`). ``kv_scale``: the per-tensor scale
    (default 1/16 for FP8: the RMS-normed latent is O(1), and 1/16 keeps values up to 28 in range; 1 for bf16,
    which needs no scale).
    """
    per_seq = -(-max_len // cfg.page_size)
    n = num_pages or batch * per_seq
    ids = np.arange(n) if shuffle_key is None else np.asarray(jax.random.permutation(shuffle_key, n))
    pages = _cache.allocate(n, cfg.page_size, dtype=dtype)
    if kv_scale is None:
      kv_scale = 1.0 / 16 if pages.dtype == _cache.FP8 else 1.0
    return PagedCache(pages, jnp.asarray(kv_scale, jnp.float32),
                      jnp.asarray(ids[:batch * per_seq].reshape(batch, per_seq), jnp.int32),
                      jnp.zeros((batch,), jnp.int32))

  def replace(self, **kw) -> "PagedCache":
    return dataclasses.replace(self, **kw)

  @property
  def page_size(self) -> int:
    return int(self.pages.shape[1])


def token_slots(block_table, cu_seqlens, positions, page_size: int):
  """Flat cache slots ``[T]`` of packed tokens: token t of sequence b (``cu_seqlens[b] <= t < cu_seqlens[b+1]``)
  at position ``positions[t]`` -> ``block_table[b, p // page_size] * page_size + p % page_size``; -1 for tokens
  outside ``[cu_seqlens[0], cu_seqlens[-1])`` or past the block table."""
  t = positions.shape[0]
  tok = jnp.arange(t, dtype=jnp.int32)
  seq = jnp.searchsorted(cu_seqlens, tok, side="right").astype(jnp.int32) - 1
  inside = (tok >= cu_seqlens[0]) & (tok < cu_seqlens[-1])
  seq = jnp.clip(seq, 0, block_table.shape[0] - 1)
  slots = _cache.slots_for_positions(block_table[seq], positions[:, None], page_size)[:, 0]
  return jnp.where(inside, slots, -1)


# ----------------------------------------------------------------------------------------------------------
# layer
# ----------------------------------------------------------------------------------------------------------

def _mm_cpu_safe(spec, a, w):
  a, w = a.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  if jax.default_backend() == "cpu":   # XLA:CPU has no bf16 x bf16 -> f32 dot; the f32 upcast is exact
    a, w = a.astype(jnp.float32), w.astype(jnp.float32)
  return jnp.einsum(spec, a, w, preferred_element_type=jnp.float32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MLAAttention:
  """Weights of one MLA layer (table in the module doc); ``cfg`` and ``fp8`` are static pytree metadata."""
  w_q_a: jax.Array | None
  q_a_norm: jax.Array | None
  w_q_b: jax.Array
  w_kv_a: jax.Array
  kv_a_norm: jax.Array
  w_uk: jax.Array
  w_uv: jax.Array
  w_o: jax.Array
  w_q_a_scale: jax.Array | None = None
  w_q_b_scale: jax.Array | None = None
  w_kv_a_scale: jax.Array | None = None
  w_uk_scale: jax.Array | None = None
  w_uv_scale: jax.Array | None = None
  w_o_scale: jax.Array | None = None
  cfg: MLAConfig = dataclasses.field(default=None, metadata=dict(static=True))
  fp8: bool = dataclasses.field(default=False, metadata=dict(static=True))
  kernel_layout: bool = dataclasses.field(default=False, metadata=dict(static=True))

  # ---- construction ------------------------------------------------------------------------------------

  @staticmethod
  def init(key, cfg: MLAConfig, dtype=jnp.bfloat16) -> "MLAAttention":
    """Random weights with std ``1/sqrt(fan_in)`` (activations stay O(1) for x ~ N(0, 1)); norms ~1."""
    h, nope, v, hid = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.hidden_size
    ks = jax.random.split(key, 8)

    def nrm(k, shape, fan_in):
      return (jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)).astype(dtype)

    def norm_w(k, n):
      return (1.0 + 0.1 * jax.random.normal(k, (n,), jnp.float32)).astype(dtype)

    q_in = cfg.q_lora_rank or hid
    return MLAAttention(
        w_q_a=None if cfg.q_lora_rank is None else nrm(ks[0], (hid, cfg.q_lora_rank), hid),
        q_a_norm=None if cfg.q_lora_rank is None else norm_w(ks[1], cfg.q_lora_rank),
        w_q_b=nrm(ks[2], (h, q_in, nope + cfg.qk_rope_head_dim), q_in),
        w_kv_a=nrm(ks[3], (hid, cfg.latent_dim), hid),
        kv_a_norm=norm_w(ks[4], cfg.kv_lora_rank),
        w_uk=nrm(ks[5], (h, nope, cfg.kv_lora_rank), nope),
        w_uv=nrm(ks[6], (h, cfg.kv_lora_rank, v), cfg.kv_lora_rank),
        w_o=nrm(ks[7], (h, v, hid), h * v),
        cfg=cfg, fp8=False)

  @staticmethod
  def from_checkpoint(cfg: MLAConfig, *, w_q_a, q_a_norm, w_q_b, w_kv_a, kv_a_norm, w_kv_b, w_o) -> "MLAAttention":
    """From the usual (in, out)-layout bf16 matrices: ``w_q_b [q_lora, H*(nope+64)]``, ``w_kv_b [512,
    H*(nope+v)]``, ``w_o [H*v, hidden]`` (transpose torch's ``[out, in]`` weights first)."""
    h, nope, v = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    gw = graph.weights_from_kv_b(w_kv_b, kv_a_norm, cfg)
    return MLAAttention(
        w_q_a=w_q_a, q_a_norm=q_a_norm,
        w_q_b=jnp.transpose(w_q_b.reshape(w_q_b.shape[0], h, nope + cfg.qk_rope_head_dim), (1, 0, 2)),
        w_kv_a=w_kv_a, kv_a_norm=kv_a_norm, w_uk=gw.w_uk, w_uv=gw.w_uv, w_o=w_o.reshape(h, v, -1),
        cfg=cfg, fp8=False)

  def to_fp8(self) -> "MLAAttention":
    """Every weight matrix to float8_e4m3fn + 128x128 block scales (``fp8=True``), stored K-major
    (``kernel_layout=True``, module doc); norms are kept."""
    if self.fp8:
      return self
    kw = {}
    for name in _MATRICES:
      w = getattr(self, name)
      if w is None:
        continue
      w8, s = convert_bf16_to_fp8_e4m3fn(w)
      kw[name], kw[name + "_scale"] = jnp.swapaxes(w8, -1, -2), s
    return dataclasses.replace(self, fp8=True, kernel_layout=True, **kw)

  def matrix(self, name: str):
    """Weight matrix ``name`` in the layout of the module doc's table (``[.., K, N]``), whatever it is stored as."""
    w = getattr(self, name)
    return jnp.swapaxes(w, -1, -2) if self.kernel_layout and w is not None else w

  def _fp8_bmm(self, a, name: str, impl, interpret, two_d: bool = False):
    """``quantize_and_bmm_fp8(a, matrix(name), scale)`` without transposing a K-major weight per call."""
    w, s = getattr(self, name), getattr(self, name + "_scale")
    if two_d:
      w, s = w[None], s[None]
    layout = "hnk" if self.kernel_layout else "hkn"
    return quantize_and_bmm_fp8(a, w, s, weight_layout=layout, impl=impl, interpret=interpret)

  def dequantized(self, dtype=jnp.bfloat16) -> "MLAAttention":
    """The bf16 layer of an FP8 layer (weights ``w8 * scale``); a bf16 layer is returned as is."""
    if not self.fp8:
      return self
    from mla_pallas import quant
    kw = {}
    for name in _MATRICES:
      w = self.matrix(name)
      if w is None:
        continue
      kw[name] = quant.dequantize_blocks_fp8(w, getattr(self, name + "_scale"), dtype=dtype)
      kw[name + "_scale"] = None
    return dataclasses.replace(self, fp8=False, kernel_layout=False, **kw)

  def rope_tables(self, max_pos: int):
    """``cfg.rope_tables(max_pos)``: the rope tables ``(cos, sin)`` float32 ``[max_pos, 32]`` of this layer's
    config (YaRN under ``cfg.rope_scaling``, plain rope otherwise)."""
    return self.cfg.rope_tables(max_pos)

  def graph_weights(self):
    """The attention graph's weights (:class:`~mla_pallas.graph.MLAWeightsFP8` or ``MLAWeightsBF16``)."""
    if self.fp8:   # the [K, N] forms are transposes the branches do not read when the kernel layouts are given
      t = self.kernel_layout
      return graph.MLAWeightsFP8(self.matrix("w_uk"), self.w_uk_scale, self.matrix("w_uv"), self.w_uv_scale,
                                 self.kv_a_norm, w_uk_t=self.w_uk if t else None, w_uv_t=self.w_uv if t else None)
    return graph.MLAWeightsBF16(self.w_uk, self.w_uv, self.kv_a_norm)

  def tp_specs(self, axis: str = "tp") -> "MLAAttention":
    """PartitionSpecs for ``jax.shard_map``: per-head weights (and their scales) split on axis 0 over
    ``axis``, the rest replicated."""
    kw = {}
    for f in dataclasses.fields(self):
      if f.metadata.get("static"):
        continue
      v = getattr(self, f.name)
      if v is None:
        continue
      kw[f.name] = P(axis) if f.name.replace("_scale", "") in _PER_HEAD else P()
    return dataclasses.replace(self, **kw)

  @property
  def num_heads(self) -> int:
    """Heads held by this (possibly sharded) layer: ``w_uk.shape[0]``."""
    return int(self.w_uk.shape[0])

  # ---- projections -------------------------------------------------------------------------------------

  def _linear(self, x, name, impl, interpret):
    """x [T, K] @ w [K, N] -> [T, N] bf16."""
    if self.fp8:
      return self._fp8_bmm(x[:, None], name, impl, interpret, two_d=True)[:, 0]
    return _mm_cpu_safe("tk,kn->tn", x, getattr(self, name)).astype(jnp.bfloat16)

  def _project(self, x, impl, interpret):
    """x [T, hidden] -> (q_nope [T,H,nope], q_rope [T,H,64], kv [T,576]) bf16."""
    cfg = self.cfg
    t = x.shape[0]
    h = self.num_heads
    if self.w_q_a is not None:
      q_in = self._linear(x, "w_q_a", impl, interpret)
      q_in = rms_norm(q_in, self.q_a_norm, cfg.rms_norm_eps, impl=impl, interpret=interpret)
    else:
      q_in = x.astype(jnp.bfloat16)
    if self.fp8:
      q = self._fp8_bmm(jnp.broadcast_to(q_in[:, None], (t, h, q_in.shape[-1])), "w_q_b", impl, interpret)
    else:
      q = _mm_cpu_safe("tk,hkn->thn", q_in, self.w_q_b).astype(jnp.bfloat16)
    kv = self._linear(x, "w_kv_a", impl, interpret)
    nope = cfg.qk_nope_head_dim
    return q[..., :nope], q[..., nope:], kv

  def _out_proj(self, o, impl, interpret, tp_axis):
    """o [T, H, v] -> y [T, hidden] bf16 (f32 sum over heads, psum over tp_axis)."""
    if self.fp8:
      y = self._fp8_bmm(o, "w_o", impl, interpret)  # [T, H, hidden]
      y = jnp.sum(y.astype(jnp.float32), axis=1)
    else:
      y = _mm_cpu_safe("thv,hvd->td", o, self.w_o)
    if tp_axis is not None:
      y = jax.lax.psum(y, tp_axis)
    return y.astype(jnp.bfloat16)

  # ---- forward -----------------------------------------------------------------------------------------

  def prefill(self, x, positions, cache: PagedCache, cu_seqlens, *, cos=None, sin=None, indices=None,
              topk_length=None, max_keys=None, impl="auto", interpret=False, tp_axis=None, interleaved=True):
    """Prefill a packed batch; sequence b continues from position ``cache.seq_lens[b]`` (0 for a new prompt).

    The dense branch attends each sequence's cached tokens and its new ones (prefill over cached context:
    :func:`mla_pallas.graph.mla_prefill_branch_fp8` with ``block_table`` and ``context_lens = seq_lens``), so a
    prompt prefilled in chunks gives the output of one call up to the order of float32 sums.

    Args:
      x: ``[T, hidden]`` bf16 packed hidden states; positions: ``[T]`` int32 (sequence b's tokens at
        ``seq_lens[b] + 0, 1, ...``).
      cache: :class:`PagedCache` (its pages are DONATED).
      cu_seqlens: ``[B + 1]`` int32 (tokens of sequence b: ``[cu_seqlens[b], cu_seqlens[b+1])``).
      cos, sin: rope tables ``[max_pos, 32]`` float32 (:meth:`rope_tables`), or both None: the config's tables
        for the cache's capacity (``block_table.shape[1] * page_size`` positions).
      indices: optional ``[T, topk]`` int32 flat slot ids: the sparse (absorbed) prefill branch; without it the
        dense (un-absorbed) branch.
      max_keys: dense branch: static size of the key buffer (>= the cached plus new tokens of all sequences). None:
        when ``seq_lens`` and ``cu_seqlens`` are concrete (outside ``jax.jit``), the next power of two of what
        they need (at most the cache's capacity); inside a trace, the capacity ``B * max_pages_per_seq *
        page_size``.
      impl, interpret: as in :mod:`mla_pallas.graph` (``impl`` also applies to the projections).
      tp_axis: mesh axis name to ``psum`` the output projection over (inside ``jax.shard_map``), or None.

    Returns:
      ``(y [T, hidden] bf16, new_cache)`` (``seq_lens`` advanced by each sequence's token count).
    """
    cos, sin = _tables(self.cfg, cache, cos, sin)
    q_nope, q_rope, kv = self._project(x, _proj_impl(impl), interpret)
    slots = token_slots(cache.block_table, cu_seqlens, positions, cache.page_size)
    gw = self.graph_weights()
    args = (gw, cache.pages, cache.kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin)
    common = dict(cfg=self.cfg, impl=impl, interpret=interpret, interleaved=interleaved)
    if indices is not None:
      fn = graph.mla_prefill_branch_sparse_fp8 if self.fp8 else graph.mla_prefill_branch_sparse_bf16
      o, pages = fn(*args, indices, topk_length=topk_length, **common)
    else:
      fn = graph.mla_prefill_branch_fp8 if self.fp8 else graph.mla_prefill_branch_bf16
      o, pages = fn(*args, cu_seqlens, block_table=cache.block_table, context_lens=cache.seq_lens,
                    max_keys=_key_budget(cache, cu_seqlens, max_keys), **common)
    y = self._out_proj(o, _proj_impl(impl), interpret, tp_axis)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).astype(jnp.int32)
    return y, cache.replace(pages=pages, seq_lens=cache.seq_lens + lens)

  def decode(self, x, positions, cache: PagedCache, *, cos=None, sin=None, indices=None, topk_length=None,
             impl="auto", interpret=False, tp_axis=None, interleaved=True, batch_invariant=False):
    """Decode ``s_q`` new tokens per sequence.

    Args:
      x: ``[B, s_q, hidden]`` bf16; positions: ``[B, s_q]`` int32 (normally ``cache.seq_lens[:, None] +
        arange(s_q)``).
      cache: :class:`PagedCache` (pages DONATED).
      indices: optional ``[B, s_q, topk]`` int32 flat slot ids (sparse attention, with optional ``topk_length
        [B]``); without it dense attention over the block table and ``cache.seq_lens + s_q``.
      cos, sin, impl, interpret, tp_axis: as in :meth:`prefill`.
      batch_invariant: the attention step's batch-invariant mode (:func:`mla_pallas.graph.mla_decode_branch_fp8`).

    Returns:
      ``(y [B, s_q, hidden] bf16, new_cache)`` (``seq_lens + s_q``).
    """
    b, s_q, hid = x.shape
    cos, sin = _tables(self.cfg, cache, cos, sin)
    q_nope, q_rope, kv = self._project(x.reshape(b * s_q, hid), _proj_impl(impl), interpret)
    h = self.num_heads
    q_nope = q_nope.reshape(b, s_q, h, -1)
    q_rope = q_rope.reshape(b, s_q, h, -1)
    kv = kv.reshape(b, s_q, -1)
    slots = _cache.slots_for_positions(cache.block_table, positions, cache.page_size)
    new_lens = cache.seq_lens + s_q
    fn = graph.mla_decode_branch_fp8 if self.fp8 else graph.mla_decode_branch_bf16
    kw = dict(indices=indices, topk_length=topk_length) if indices is not None else \
        dict(block_table=cache.block_table, cache_seqlens=new_lens)
    o, pages = fn(self.graph_weights(), cache.pages, cache.kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin,
                  cfg=self.cfg, impl=impl, interpret=interpret, interleaved=interleaved,
                  batch_invariant=batch_invariant, **kw)
    y = self._out_proj(o.reshape(b * s_q, h, -1), _proj_impl(impl), interpret, tp_axis)
    return y.reshape(b, s_q, -1), cache.replace(pages=pages, seq_lens=new_lens)


def _key_budget(cache: PagedCache, cu_seqlens, max_keys):
  """The dense prefill's key-buffer size (see :meth:`MLAAttention.prefill`'s ``max_keys``)."""
  if max_keys is not None:
    return max_keys
  capacity = max(1, cache.block_table.shape[0] * cache.block_table.shape[1] * cache.page_size)
  lens, cu = _checks.concrete(cache.seq_lens), _checks.concrete(cu_seqlens)
  if lens is None or cu is None:                                  # traced: the bound that always holds
    return capacity
  if cu.ndim != 1 or cu.size < 1 or lens.ndim != 1:
    return capacity                                               # malformed: the graph's checks will say so
  need = int(np.maximum(lens, 0).sum()) + int(np.maximum(np.diff(cu), 0).sum())
  return min(capacity, 1 << max(need - 1, 0).bit_length())


def _tables(cfg: MLAConfig, cache: PagedCache, cos, sin):
  """The rope tables to use: ``(cos, sin)`` as given, or the config's for the cache's capacity when both are None."""
  if (cos is None) != (sin is None):
    raise ValueError("cos and sin must be given together (or both None: the config's tables)")
  if cos is None:
    return cfg.rope_tables(int(cache.block_table.shape[1]) * cache.page_size)
  return cos, sin


def _proj_impl(impl):
  return impl if isinstance(impl, str) else dict(impl).get("quantize_and_bmm_fp8", dict(impl).get("default", "auto"))


# ----------------------------------------------------------------------------------------------------------
# float32 reference layer
# ----------------------------------------------------------------------------------------------------------

def _ref_linear(layer, x, name):
  w = layer.matrix(name)
  x = x.astype(jnp.float32)
  if layer.fp8:
    return reference.quantize_and_bmm_fp8(x[:, None], w[None], getattr(layer, name + "_scale")[None])[:, 0] \
        .astype(jnp.float32)
  return jnp.einsum("tk,kn->tn", x, w.astype(jnp.float32), precision=_HI)


def _ref_project(layer, x):
  cfg = layer.cfg
  t, h = x.shape[0], layer.num_heads
  if layer.w_q_a is not None:
    q_in = reference.rms_norm(_ref_linear(layer, x, "w_q_a"), layer.q_a_norm.astype(jnp.float32), cfg.rms_norm_eps)
  else:
    q_in = x.astype(jnp.float32)
  if layer.fp8:
    q = reference.quantize_and_bmm_fp8(jnp.broadcast_to(q_in[:, None], (t, h, q_in.shape[-1])),
                                       layer.matrix("w_q_b"), layer.w_q_b_scale).astype(jnp.float32)
  else:
    q = jnp.einsum("tk,hkn->thn", q_in, layer.w_q_b.astype(jnp.float32), precision=_HI)
  kv = _ref_linear(layer, x, "w_kv_a")
  nope = cfg.qk_nope_head_dim
  return q[..., :nope], q[..., nope:], kv


def _ref_out(layer, o):
  if layer.fp8:
    y = reference.quantize_and_bmm_fp8(o.astype(jnp.float32), layer.matrix("w_o"),
                                       layer.w_o_scale).astype(jnp.float32)
    return jnp.sum(y, axis=1)
  return jnp.einsum("thv,hvd->td", o.astype(jnp.float32), layer.w_o.astype(jnp.float32), precision=_HI)


def reference_prefill(layer: MLAAttention, x, positions, cache: PagedCache, cu_seqlens, *, cos=None, sin=None,
                      indices=None, topk_length=None, max_keys=None, interleaved=True):
  """Float32 oracle of :meth:`MLAAttention.prefill`: ``(y float32 [T, hidden], new_cache)`` (nothing donated)."""
  cos, sin = _tables(layer.cfg, cache, cos, sin)
  q_nope, q_rope, kv = _ref_project(layer, x)
  slots = token_slots(cache.block_table, cu_seqlens, positions, cache.page_size)
  args = (layer.graph_weights(), cache.pages, cache.kv_scale, q_nope, q_rope, kv, positions, slots, cos, sin)
  if indices is not None:
    o, pages = graph.reference_prefill_branch_sparse(*args, indices, cfg=layer.cfg, topk_length=topk_length,
                                                     interleaved=interleaved)
  else:
    o, pages = graph.reference_prefill_branch(*args, cu_seqlens, cfg=layer.cfg, interleaved=interleaved,
                                              block_table=cache.block_table, context_lens=cache.seq_lens,
                                              max_keys=_key_budget(cache, cu_seqlens, max_keys))
  lens = (cu_seqlens[1:] - cu_seqlens[:-1]).astype(jnp.int32)
  return _ref_out(layer, o), cache.replace(pages=pages, seq_lens=cache.seq_lens + lens)


def reference_decode(layer: MLAAttention, x, positions, cache: PagedCache, *, cos=None, sin=None, indices=None,
                     topk_length=None, interleaved=True):
  """Float32 oracle of :meth:`MLAAttention.decode`: ``(y float32 [B, s_q, hidden], new_cache)``."""
  cos, sin = _tables(layer.cfg, cache, cos, sin)
  b, s_q, hid = x.shape
  q_nope, q_rope, kv = _ref_project(layer, x.reshape(b * s_q, hid))
  h = layer.num_heads
  slots = _cache.slots_for_positions(cache.block_table, positions, cache.page_size)
  new_lens = cache.seq_lens + s_q
  kw = dict(indices=indices, topk_length=topk_length) if indices is not None else \
      dict(block_table=cache.block_table, cache_seqlens=new_lens)
  o, pages = graph.reference_decode_branch(
      layer.graph_weights(), cache.pages, cache.kv_scale, q_nope.reshape(b, s_q, h, -1),
      q_rope.reshape(b, s_q, h, -1), kv.reshape(b, s_q, -1), positions, slots, cos, sin, cfg=layer.cfg,
      interleaved=interleaved, **kw)
  y = _ref_out(layer, o.reshape(b * s_q, h, -1))
  return y.reshape(b, s_q, -1), cache.replace(pages=pages, seq_lens=new_lens)
