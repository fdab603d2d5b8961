"""The rope kernel (mla_pallas.kernels.rope_direct: GMEM -> registers -> GMEM, raw Mosaic GPU) on the CPU: sm_90
lowering of every path (fused / unfused, DeepSeek / NeoX pairs, in-kernel duplicate check, bf16 / f32 norm weight,
H = 1 .. 128, the i64 q-item index where T * H * 8 >= 2^31) with the loads and stores counted, the op's configs
(default_config, sweep_configs, tuning overrides), and argument checks. Interpret mode has no ``inline_mgpu``, so
its numbers are checked on the GPU only (tests/test_rope_rmsnorm_kernel_gpu.py, against the references).
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from mla_pallas import testing
from mla_pallas.kernels import rope_direct as rd
from mla_pallas.ops import rope_rmsnorm as op

FP8 = jnp.float8_e4m3fn
S = jax.ShapeDtypeStruct


def _lower(t, h, fused, *, interleaved=True, dedupe=False, w_dtype=jnp.bfloat16, cfg=None, num_slots=4096,
           pages_dtype=FP8):
  kern = rd.build(t, h, num_slots if fused else 0, fused, cfg, interleaved=interleaved, dedupe=dedupe)
  avals = [S((t, 576), jnp.bfloat16), S((t * h, 64), jnp.bfloat16), S((t,), jnp.int32), S((4096, 32), jnp.float32),
           S((4096, 32), jnp.float32), S((512,), w_dtype), S((1,), jnp.float32)]
  if fused:
    def f(*a):
      cache = jax.new_ref(a[-1])
      return kern(*a[:-1], cache), jax.freeze(cache)
    avals += [S((1,), jnp.float32), S((t,), jnp.int32), S((num_slots, 576), pages_dtype)]
  else:
    f = kern
  return testing.lower_for_cuda(f, *avals, arch=(9, 0))


def _count(low, pattern):
  return len(re.findall(pattern, low.mosaic[0]))


@pytest.mark.parametrize("t,h,fused,interleaved,dedupe,w_dtype,ipt", [
    (1, 128, True, True, False, jnp.bfloat16, 2), (8, 16, True, False, True, jnp.float32, 4),
    (37, 128, False, True, False, jnp.bfloat16, 4), (5, 1, True, True, True, jnp.bfloat16, 1),
    (256, 64, False, False, False, jnp.float32, 8), (4096, 128, True, True, False, jnp.bfloat16, 4),
])
def test_lowers_for_sm90(t, h, fused, interleaved, dedupe, w_dtype, ipt):
  """One custom call (the cache aliased in place when fused), no SMEM, and the loads and stores the module
  docstring describes: per kv warp two 16-byte latent loads, two of the weight, the k_rope piece (and its NeoX
  partner) with its cos / sin rows; per q item the same rope loads; stores: latent + k_rope, and one per q item."""
  low = _lower(t, h, fused, interleaved=interleaved, dedupe=dedupe, w_dtype=w_dtype,
               cfg=rd.TuningConfig(items_per_thread=ipt))
  assert low.hlo.count("stablehlo.custom_call") == 1
  assert ("output_operand_aliases" in low.hlo) == fused
  assert "wgmma" not in low.mosaic[0] and "cp.async.bulk" not in low.mosaic[0]
  assert re.search(r"dynamic_shared_memory_size %c0_i32", low.mosaic[0]) or "dynamic_shared_memory_size" not in \
      low.mosaic[0]
  rope_x = 1 if interleaved else 2                     # bf16 loads of a rope item (NeoX: + its partner piece)
  w_bf16 = 2 if w_dtype == jnp.bfloat16 else 0
  assert _count(low, r"llvm\.load .* -> vector<8xbf16>") == 2 + w_bf16 + rope_x * (1 + ipt)
  table = r"llvm\.load .* -> vector<4xf32>" if interleaved else r"llvm\.load .* -> vector<8xf32>"
  assert _count(low, table) == 2 * (1 + ipt) + (0 if interleaved or w_dtype == jnp.bfloat16 else 2)
  assert _count(low, r"llvm\.store") == (2 if fused else 3) + ipt
  slot_loads = _count(low, r"llvm\.load .* -> i32")    # positions (kv warp + one per q item), slots
  scan = (-(-t // 32) if t <= rd.UNROLLED_SCAN_MAX else rd.SCAN_ROUND) if dedupe else 0
  assert slot_loads == 1 + ipt + (1 + scan if fused else 0)


@pytest.mark.parametrize("t,h,dedupe", [(1, 128, False), (300, 16, True)])
def test_bf16_cache_write_lowers_for_sm90(t, h, dedupe):
  """Into a bfloat16 cache the fused kernel writes bf16(y · f32(1 / kv_scale)) (quant.encode_cache_rows): per kv
  warp two 16-byte stores of 8 bf16 latent values per lane and one of the lane's k_rope piece, at 1152-byte rows;
  no e4m3 conversion or clip; the same loads as the e4m3 write."""
  low = _lower(t, h, True, dedupe=dedupe, pages_dtype=jnp.bfloat16, cfg=rd.TuningConfig(items_per_thread=2))
  base = _lower(t, h, True, dedupe=dedupe, cfg=rd.TuningConfig(items_per_thread=2))
  assert "e4m3" not in low.mosaic[0] and "e4m3" in base.mosaic[0]
  assert _count(low, r"llvm\.store") == _count(base, r"llvm\.store") + 1 == 3 + 2   # latent 2, rope 1, q items 2
  assert _count(low, r"llvm\.load") == _count(base, r"llvm\.load")
  assert "1152" in low.mosaic[0]                                   # the bf16 row stride (bytes)
  for name in ("fused_rope_rmsnorm_quantization",):
    with pytest.raises(NotImplementedError, match="float8_e4m3fn and bfloat16"):
      op._kernel_supported(name, jnp.zeros((1, 576), jnp.bfloat16), jnp.zeros((1, 1, 64), jnp.bfloat16),
                           16, jnp.float16)()


@pytest.mark.parametrize("t,h,interleaved", [(2049, 16, True), (8192, 16, False), (4099, 128, True)])
def test_bitmap_dedupe_lowers_for_sm90(t, h, interleaved):
  """Above TuningConfig.warp_scan_max_tokens the kv CTAs take TuningConfig.bitmap_tokens tokens each and check
  duplicate slots with an SMEM bitmap: one atomic OR per own slot, three CTA barriers, the scan loop, at most 4 KB
  of SMEM."""
  low = _lower(t, h, True, interleaved=interleaved, dedupe=True)
  m = low.mosaic[0]
  assert m.count("llvm.atomicrmw _or") == 1
  assert m.count("bar.sync") == 3
  assert int(re.search(r"dynamic_shared_memory_size %c(\d+)_i32", m).group(1)) <= 4096
  assert rd.grid_for(rd.TuningConfig(), t, h, bitmap=True)[0] == -(-t // rd.TuningConfig().bitmap_tokens)
  cfg = rd.TuningConfig()
  assert rd.uses_bitmap(cfg, True, t, True) and not rd.uses_bitmap(cfg, True, t, False)
  assert not rd.uses_bitmap(cfg, True, cfg.warp_scan_max_tokens, True)
  assert not rd.uses_bitmap(rd.TuningConfig(warp_scan_max_tokens=t), True, t, True)


def test_warp_scan_loop_lowers_for_sm90():
  """Above UNROLLED_SCAN_MAX (and up to warp_scan_max_tokens) a warp scans the later slots in a loop of
  SCAN_ROUND loads per lane; no bitmap, no SMEM."""
  low = _lower(2048, 16, True, dedupe=True, cfg=rd.TuningConfig(warp_scan_max_tokens=4096))
  m = low.mosaic[0]
  assert "atomicrmw" not in m and "bar.sync" not in m and "scf.for" in m
  assert _count(low, r"llvm\.load .* -> i32") == 1 + 4 + 1 + rd.SCAN_ROUND


def test_grid():
  assert rd.grid_for(rd.TuningConfig(items_per_thread=2), 1, 128) == (1, 4)
  assert rd.grid_for(rd.TuningConfig(), 4096, 16, bitmap=True) == (256, 1024)
  assert rd.grid_for(rd.TuningConfig(items_per_thread=4), 4096, 128) == (1024, 8192)
  assert rd.grid_for(rd.TuningConfig(items_per_thread=1), 5, 1) == (2, 1)


def test_config_and_build_checks():
  with pytest.raises(ValueError, match="items_per_thread"):
    rd.TuningConfig(items_per_thread=0)
  with pytest.raises(ValueError, match="items_per_thread"):
    rd.TuningConfig(items_per_thread=17)
  with pytest.raises(ValueError, match="bitmap_tokens"):
    rd.TuningConfig(bitmap_tokens=18)
  with pytest.raises(ValueError, match="bitmap_tokens"):
    rd.TuningConfig(bitmap_tokens=132)
  with pytest.raises(ValueError, match="bitmap_group"):
    rd.TuningConfig(bitmap_tokens=16, bitmap_group=3)
  with pytest.raises(ValueError, match="scan_unroll"):
    rd.TuningConfig(scan_unroll=0)
  with pytest.raises(ValueError, match="dedupe"):
    rd.build(8, 16, 0, False, dedupe=True)
  with pytest.raises(NotImplementedError, match="int32"):
    rd.build(2 ** 31, 1, 4096, True)
  with pytest.raises(NotImplementedError, match="int32"):
    rd.build(8, 1, 2 ** 31, True)
  with pytest.raises(NotImplementedError, match="grid"):
    rd.build(2 ** 30, 2 ** 20, 0, False)


def test_default_config_and_tuning():
  """One frozen config for every shape; ``tuning`` overrides its fields and nothing else; bad shapes raise."""
  for t, h, fused in [(1, 1, True), (8, 128, False), (4096, 128, True), (2 ** 20, 256, True)]:
    assert op.default_config(t, h, fused) == rd.TuningConfig()
  assert op._config(8, 16, True, (("bitmap_tokens", 32), ("bitmap_group", 2))) == rd.TuningConfig(
      bitmap_tokens=32, bitmap_group=2)
  assert op._config(8, 16, False, (("items_per_thread", 8),)) == rd.TuningConfig(items_per_thread=8)
  with pytest.raises(ValueError, match="direct rope kernel takes"):
    op._config(8, 16, True, (("stages", 2),))
  with pytest.raises(ValueError, match="direct rope kernel takes"):
    op._config(8, 16, True, (("kernel", "direct"),))
  with pytest.raises(ValueError, match="items_per_thread"):
    op._config(8, 16, True, (("items_per_thread", 0),))
  for bad in [(0, 16), (8, 0), (8.0, 16)]:
    with pytest.raises(ValueError, match="t and h"):
      op.default_config(*bad, True)
  with pytest.raises(ValueError, match="fused"):
    op.default_config(8, 16, 1)


@pytest.mark.parametrize("t,h,fused", [(1, 128, True), (300, 16, True), (8192, 16, True), (8192, 128, False)])
def test_sweep_configs_are_valid_tunings(t, h, fused):
  """"default": () first; every entry is a valid ``tuning`` of the op's entry points; the bitmap knobs appear where
  the kernel runs the bitmap mode (fused, T > warp_scan_max_tokens), the bitmap mode itself where the warp scan
  loops (UNROLLED_SCAN_MAX < T <= warp_scan_max_tokens)."""
  sweep = op.sweep_configs(t, h, fused)
  assert next(iter(sweep)) == "default" and sweep["default"] == ()
  cfgs = [op._config(t, h, fused, tuning) for tuning in sweep.values()]
  assert len(set(cfgs)) == len(cfgs)                 # no two labels give the same config
  bitmap = fused and t > rd.TuningConfig().warp_scan_max_tokens
  assert ("bitmap_tokens=32" in sweep) == bitmap and ("xla_last_writer" in sweep) == bitmap
  assert ("bitmap" in sweep) == (fused and rd.UNROLLED_SCAN_MAX < t <= rd.TuningConfig().warp_scan_max_tokens)
  if bitmap:
    assert not rd.uses_bitmap(op._config(t, h, fused, sweep["warp_scan"]), True, t, True)


@pytest.mark.parametrize("t,h,fused,unique,bitmap", [
    (1, 128, True, False, True), (200, 16, True, False, True), (3000, 16, True, False, True),
    (3000, 16, True, False, False), (3000, 16, True, True, False), (300, 16, True, False, False),
    (64, 128, False, False, True)])
def test_op_lowers_with_the_direct_kernel(t, h, fused, unique, bitmap):
  """The op is the kernel alone (no table pre-pass, no padding), except for the XLA duplicate-slot scan at
  T > warp_scan_max_tokens with bitmap_dedupe=False (and without unique_slots)."""
  tuning = (("bitmap_dedupe", bitmap),)
  common_args = [S((t, 576), jnp.bfloat16), S((t, h, 64), jnp.bfloat16), S((t,), jnp.int32),
                 S((4096, 32), jnp.float32), S((4096, 32), jnp.float32), S((512,), jnp.bfloat16), S((), jnp.float32)]
  if fused:
    fn = lambda pages, *a: op._fused_mosaic(pages, *a, interleaved=True, tuning=tuning,  # noqa: E731
                                            unique_slots=unique)
    low = testing.lower_for_cuda(fn, S((100, 64, 576), FP8), *common_args, S((), jnp.float32), S((t,), jnp.int32),
                                 arch=(9, 0))
  else:
    fn = lambda *a: op._rope_rmsnorm_mosaic(*a, interleaved=True, tuning=tuning)  # noqa: E731
    low = testing.lower_for_cuda(fn, *common_args, arch=(9, 0))
  assert low.hlo.count("stablehlo.custom_call") == 1
  assert "wgmma" not in low.mosaic[0]
  prepass = fused and not unique and not bitmap and t > rd.TuningConfig().warp_scan_max_tokens
  assert (re.search(r"stablehlo\.(scatter|compare|pad|concatenate)", low.hlo) is not None) == prepass


def test_index_width_boundary():
  """i32 q-item index below T * H * 8 = 2^31, i64 from there."""
  assert not rd.needs_i64(2 ** 28 - 1, 1) and rd.needs_i64(2 ** 28, 1)
  assert not rd.needs_i64(2 ** 20 - 1, 256) and rd.needs_i64(2 ** 20, 256)
  assert not rd.needs_i64(4096, 128) and not rd.needs_i64(8192, 128)


def _item_index_ops(low, width):
  """Counts of the q-item index arithmetic at ``width`` ("i32" / "i64"): the validity compare against the item
  count, the row and piece of the item, the token of the row."""
  m = low.mosaic[0]
  return dict(compare=len(re.findall(rf"arith\.cmpi ult, %\S+, %c\d+_{width}(?:_\d+)? : {width}\n", m)),
              divui=len(re.findall(rf"arith\.divui .* : {width}\n", m)),
              remui=len(re.findall(rf"arith\.remui .* : {width}\n", m)),
              trunci=len(re.findall(r"arith\.trunci .* : i64 to i32\n", m)))


@pytest.mark.parametrize("t,h,fused,ipt", [(2 ** 20, 256, True, 4), (2 ** 21 + 3, 128, False, 2),
                                            (2 ** 28, 1, True, 1)])
def test_lowers_with_i64_item_index(t, h, fused, ipt):
  """T * H * 8 >= 2^31 (abstract avals: nothing allocated; q_rope alone would be 32-64 GiB): per q item the
  compare against T * H * 8, the division into row and piece and the row's token are i64 (two truncations to i32:
  piece, token), and the loads and stores are those of the i32 path. The same kernel below 2^31 has no i64 item
  arithmetic (its MLIR is that of the i32 path)."""
  cfg = rd.TuningConfig(items_per_thread=ipt)
  low = _lower(t, h, fused, dedupe=False, cfg=cfg)
  got = _item_index_ops(low, "i64")
  assert got == dict(compare=ipt, divui=2 * ipt, remui=ipt, trunci=2 * ipt), got
  assert re.search(rf"%c{t * h * 8}_i64", low.mosaic[0]) and re.search(rf"%c{t * h * 8 - 1}_i64", low.mosaic[0])
  assert _count(low, r"llvm\.load .* -> vector<8xbf16>") == 2 + 2 + (1 + ipt)
  assert _count(low, r"llvm\.store") == (2 if fused else 3) + ipt
  small = _lower(1024, h if h <= 128 else 128, fused, dedupe=False, cfg=cfg)
  assert _item_index_ops(small, "i64") == dict(compare=0, divui=0, remui=0, trunci=0)
  assert _item_index_ops(small, "i32")["divui"] == 2 * ipt + 1     # + the thread's warp, tid / 32
  assert _item_index_ops(low, "i32")["divui"] == 1


def test_op_lowers_at_i64_size():
  """The fused op at T * H * 8 = 2^31 (default config: the bitmap duplicate check, T > 2048) is the kernel alone."""
  t, h = 2 ** 20, 256
  fn = lambda pages, *a: op._fused_mosaic(pages, *a, interleaved=False)  # noqa: E731
  low = testing.lower_for_cuda(fn, S((1 << 16, 64, 576), FP8), S((t, 576), jnp.bfloat16), S((t, h, 64), jnp.bfloat16),
                               S((t,), jnp.int32), S((4096, 32), jnp.float32), S((4096, 32), jnp.float32),
                               S((512,), jnp.bfloat16), S((), jnp.float32), S((), jnp.float32), S((t,), jnp.int32),
                               arch=(9, 0))
  assert low.hlo.count("stablehlo.custom_call") == 1 and "output_operand_aliases" in low.hlo
  assert low.mosaic[0].count("llvm.atomicrmw _or") == 1
  assert _item_index_ops(low, "i64")["compare"] == rd.TuningConfig().items_per_thread
