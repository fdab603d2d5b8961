"""Try to get the sm_100a sparse decode kernel through ptxas on a machine without a Blackwell GPU (e.g. an H200).

Nothing here runs the kernel: the only GPU code that could be launched is a binary for sm_100a, which an sm_90
device cannot load. Run it on the GPU machine from the repository root:

    python benchmarks/sm100_ptxas_attempt.py [--out DIR] [--arch sm_100a] [--spoof 10.0] [--timeout S]

and read what it prints. It goes step by step and says exactly what happened at each:

1. Python-side Mosaic GPU lowering at sm_100a (what the CPU tests check): layouts, tcgen05, TMA gather4.
2. The real JAX/Mosaic GPU compile pipeline (LLVM NVPTX -> PTX -> ptxas) for sm_100a. That pipeline lives in
   C++ (``jaxlib/mosaic/gpu/custom_call.cc``: ``Compile`` -> ``GetSmVersion(cc.major, cc.minor)`` ->
   ``nvvm-attach-target{chip=sm_...}`` -> ``mosaic-gpu-assembly-to-binary``) and takes the target from the
   *device's* compute capability (``cuDeviceGetAttribute``), not from the Python-side ``mosaic_gpu.arch_major``
   module attribute; no Python knob overrides it. So this step runs in a child process with a small
   ``LD_PRELOAD`` shim (built here with the host C compiler) that makes ``cuDeviceGetAttribute`` report compute
   capability 10.0; ``MOSAIC_GPU_DUMP_TO`` dumps the PTX, ptxas log and SASS. The child calls the kernel once on
   host-transferred inputs (``jax.device_put``, no XLA kernels): Mosaic compiles it on first use; loading the
   sm_100a binary then fails on the sm_90 device, so nothing runs. (Step 4 never calls the kernel: it only
   compiles.)
3. The CUDA toolkit's own ``ptxas -arch=sm_100a`` on every PTX file dumped by step 2 (independent of how step 2
   ended), with its exact output, and a count of the Blackwell instructions in the resulting SASS.
4. Without the shim (or if it cannot be built): the same compile at the device's own architecture, to show what
   the unmodified pipeline says (expected: the NVPTX backend rejects tcgen05 / gather4 below sm_100a).

Tested on the CPU only: step 1, the shim build (``--cpu-check``), and the shim against a stand-in libcuda (both the
``dlsym`` and the ``cuGetProcAddress`` routes report 10.0; JAX on the CPU runs normally under it). Steps 2-4 have
never run. If the child prints a compute capability other than 10.0, the shim did not take (XLA found the
attribute another way) and step 2 is a compile at the device's own architecture.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPE = dict(H=64, s_q=1, topk=256, splits=1, num_slots=4096, batch=2)

SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
/* Reports compute capability SPOOF_MAJOR.SPOOF_MINOR from cuDeviceGetAttribute, whether the caller links libcuda,
   dlsym()s it (XLA's driver stub) or asks cuGetProcAddress (the CUDA runtime). Everything else is forwarded. */
typedef int (*attr_fn)(int *, int, int);
typedef int (*gpa_fn)(const char *, void **, int, uint64_t, void *);
static void *(*real_dlsym)(void *, const char *);
static attr_fn real_attr;
static gpa_fn real_gpa, real_gpa2;
static int major_ = 10, minor_ = 0, calls_;
static void init(void) {
  if (!real_dlsym) {
    real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
    if (!real_dlsym) real_dlsym = (void *(*)(void *, const char *))dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
    const char *s = getenv("SPOOF_CC");
    if (s) sscanf(s, "%d.%d", &major_, &minor_);
  }
}
static void *cuda(const char *name) {
  init();
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  return h ? real_dlsym(h, name) : NULL;
}
static int spoof_attr(int *pi, int attrib, int dev) {
  if (!real_attr) real_attr = (attr_fn)cuda("cuDeviceGetAttribute");
  int r = real_attr(pi, attrib, dev);
  if (r == 0 && attrib == 75) { *pi = major_; if (!calls_++) fprintf(stderr, "[shim] compute capability -> %d.%d\n", major_, minor_); }
  if (r == 0 && attrib == 76) *pi = minor_;
  return r;
}
static int spoof_gpa_common(gpa_fn real, const char *sym, void **pfn, int v, uint64_t f, void *st) {
  int r = real(sym, pfn, v, f, st);
  if (r == 0 && sym && strcmp(sym, "cuDeviceGetAttribute") == 0 && pfn) {
    if (!real_attr) real_attr = (attr_fn)*pfn;
    *pfn = (void *)spoof_attr;
  }
  return r;
}
static int spoof_gpa(const char *s, void **p, int v, uint64_t f, void *st) {
  if (!real_gpa) real_gpa = (gpa_fn)cuda("cuGetProcAddress");
  return spoof_gpa_common(real_gpa, s, p, v, f, st);
}
static int spoof_gpa2(const char *s, void **p, int v, uint64_t f, void *st) {
  if (!real_gpa2) real_gpa2 = (gpa_fn)cuda("cuGetProcAddress_v2");
  return spoof_gpa_common(real_gpa2, s, p, v, f, st);
}
int cuDeviceGetAttribute(int *pi, int attrib, int dev) { return spoof_attr(pi, attrib, dev); }
int cuGetProcAddress(const char *s, void **p, int v, uint64_t f, void *st) { return spoof_gpa(s, p, v, f, st); }
int cuGetProcAddress_v2(const char *s, void **p, int v, uint64_t f, void *st) { return spoof_gpa2(s, p, v, f, st); }
void *dlsym(void *handle, const char *name) {
  init();
  if (name && strcmp(name, "cuDeviceGetAttribute") == 0) return (void *)spoof_attr;
  if (name && strcmp(name, "cuGetProcAddress") == 0) return (void *)spoof_gpa;
  if (name && strcmp(name, "cuGetProcAddress_v2") == 0) return (void *)spoof_gpa2;
  return real_dlsym(handle, name);
}
"""


def banner(title):
  print(f"\n=== {title} " + "=" * max(0, 100 - len(title)), flush=True)


def kernel_and_avals():
  import jax
  import jax.numpy as jnp
  from mla_pallas.kernels import sparse_decode_sm100 as sm100
  s = SHAPE
  tpt = max(1, s["H"] // 64)
  n_tok = s["batch"] * s["s_q"]
  tps = -(-s["topk"] // (64 * s["splits"]))
  cfg = sm100.TuningConfig(tiles_per_split=tps)
  kern = sm100.build(n_tok * tpt, n_tok, s["num_slots"], s["splits"], tpt,
                     "bfloat16" if s["splits"] == 1 else "float32", cfg)
  S = jax.ShapeDtypeStruct
  f8 = jnp.float8_e4m3fn
  avals = (S((n_tok * tpt, 64, 576), f8), S((n_tok * tpt, 64), jnp.float32), S((s["num_slots"], 576), f8),
           S((n_tok, s["splits"] * tps, 64), jnp.uint32), S((1,), jnp.float32))
  return kern, avals


def step1_lowering():
  banner("1. Python-side Mosaic GPU lowering at sm_100a")
  from mla_pallas import testing
  kern, avals = kernel_and_avals()
  try:
    low = testing.lower_for_cuda(kern, *avals, arch=(10, 0))
  except Exception as e:   # noqa: BLE001 - report whatever the lowering raises
    print(f"FAILED: {type(e).__name__}: {e}")
    return False
  print(f"OK: shape {SHAPE}; tcgen05.mma kind::f8f6f4: {low.count('kind::f8f6f4')}, tile::gather4: "
        f"{low.count('tile::gather4')}, tcgen05.ld: {low.count('tcgen05.ld')}, tcgen05.st: {low.count('tcgen05.st')}")
  return True


def build_shim(workdir):
  cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
  if not cc:
    print("no C compiler (cc/gcc/clang) on PATH: cannot build the compute-capability shim")
    return None
  src = os.path.join(workdir, "cc_shim.c")
  so = os.path.join(workdir, "cc_shim.so")
  with open(src, "w") as f:
    f.write(SHIM_C)
  r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", so, src, "-ldl"], capture_output=True, text=True)
  if r.returncode:
    print(f"shim build failed ({cc}):\n{r.stdout}{r.stderr}")
    return None
  print(f"shim built: {so} ({cc})")
  return so


CHILD = r"""
import os, sys, traceback
sys.path.insert(0, {root!r})
import numpy as np
import jax, jax.numpy as jnp
dev = jax.devices()[0]
print("[child] device:", dev.device_kind, "compute capability:", getattr(dev, "compute_capability", None), flush=True)
sys.path.insert(0, {here!r})
import sm100_ptxas_attempt as A
kern, avals = A.kernel_and_avals()
args = [jax.device_put(np.zeros(a.shape, a.dtype)) for a in avals]   # host -> device copies, no XLA kernels
f = jax.jit(kern)
try:
  lowered = f.lower(*args)
  compiled = lowered.compile()
  print("[child] XLA compile returned (Mosaic compiles its kernel at XLA compile time or on first use)", flush=True)
  if os.environ.get("SM100_EXECUTE") == "1":   # only with the spoofed arch: an sm_100a binary cannot load on sm_90
    out = compiled(*args)
    jax.block_until_ready(out)
    print("[child] UNEXPECTED: the call returned; the kernel was loaded and ran on this device", flush=True)
except Exception as e:
  print("[child] call ended with", type(e).__name__ + ":", str(e)[:4000], flush=True)
"""


def run_child(dump_dir, shim, spoof, timeout):
  env = dict(os.environ)
  env["MOSAIC_GPU_DUMP_TO"] = dump_dir
  env.setdefault("NCCL_NVLS_ENABLE", "0")
  env.pop("SM100_EXECUTE", None)
  if shim:
    env["LD_PRELOAD"] = shim + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    env["SPOOF_CC"] = spoof
    env["SM100_EXECUTE"] = "1"
  code = CHILD.format(root=ROOT, here=os.path.dirname(os.path.abspath(__file__)))
  try:
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    out, rc = r.stdout + r.stderr, r.returncode
  except subprocess.TimeoutExpired as e:
    def text(b):
      return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
    out, rc = text(e.stdout) + text(e.stderr), f"timeout after {timeout} s"
  with open(os.path.join(dump_dir, "child_output.txt"), "w") as f:
    f.write(out)
  print(f"child exit code: {rc}")
  interesting = [l for l in out.splitlines()
                 if re.search(r"\[child\]|\[shim\]|ptxas|error|Error|sm_\d+|FAILED|fatal", l)]
  print("\n".join(interesting[-60:]) if interesting else out[-6000:])
  files = sorted(glob.glob(os.path.join(dump_dir, "*")))
  print(f"dumped files in {dump_dir}: {[os.path.basename(p) for p in files]}")
  for p in files:
    if p.endswith(".ptxas"):
      print(f"--- {os.path.basename(p)} ---\n" + open(p).read()[-3000:])
  for p in files:
    if p.endswith(".ptx"):
      txt = open(p).read()
      m = re.search(r"^\.target\s+(\S+)", txt, re.M)
      print(f"{os.path.basename(p)}: .target {m.group(1) if m else '?'}; tcgen05.mma {txt.count('tcgen05.mma')}, "
            f"gather4 {txt.count('gather4')}, {len(txt)} chars")
  return out


def find_ptxas():
  cands = [shutil.which("ptxas")]
  for root in (os.environ.get("MOSAIC_GPU_CUDA_ROOT"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
    if root:
      cands.append(os.path.join(root, "bin", "ptxas"))
  cands += glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "nvidia", "*", "bin", "ptxas"))
  return next((c for c in cands if c and os.path.exists(c)), None)


def step3_ptxas(dump_dir, arch):
  banner(f"3. the toolkit's ptxas -arch={arch} on the dumped PTX")
  ptxas = find_ptxas()
  ptx = sorted(glob.glob(os.path.join(dump_dir, "*.ptx")))
  if not ptxas:
    print("no ptxas found (PATH, $MOSAIC_GPU_CUDA_ROOT/bin, $CUDA_HOME/bin, /usr/local/cuda/bin, nvidia/*/bin)")
    return False
  if not ptx:
    print("no PTX was dumped by step 2: nothing to assemble (see step 2's output for where the pipeline stopped)")
    return False
  ok = True
  print(subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1])
  for p in ptx:
    cubin = p[:-4] + f".{arch}.cubin"
    r = subprocess.run([ptxas, f"-arch={arch}", "-v", p, "-o", cubin], capture_output=True, text=True)
    print(f"$ ptxas -arch={arch} -v {os.path.basename(p)}  -> exit {r.returncode}\n{(r.stdout + r.stderr)[-4000:]}")
    ok &= r.returncode == 0
    tool = shutil.which("cuobjdump") or (os.path.join(os.path.dirname(ptxas), "cuobjdump"))
    if r.returncode == 0 and os.path.exists(tool):
      sass = subprocess.run([tool, "-sass", cubin], capture_output=True, text=True).stdout
      n_mma = len(re.findall(r"UTC\w*MMA", sass))
      print(f"SASS: {len(sass.splitlines())} lines; UTC*MMA (tcgen05.mma): {n_mma}, UTMALDG (TMA loads incl. gather4): {sass.count('UTMALDG')}, "
            f"LDTM/STTM (tcgen05.ld/st): {sass.count('LDTM')}/{sass.count('STTM')}")
  return ok


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--out", default=None, help="dump directory (default: a fresh temporary directory)")
  ap.add_argument("--arch", default="sm_100a")
  ap.add_argument("--spoof", default="10.0", help="compute capability the shim reports")
  ap.add_argument("--timeout", type=int, default=400)
  ap.add_argument("--cpu-check", action="store_true", help="only step 1 and the shim build (no GPU needed)")
  a = ap.parse_args()
  out = a.out or tempfile.mkdtemp(prefix="sm100_ptxas_")
  os.makedirs(out, exist_ok=True)
  print(f"dump directory: {out}")
  ok1 = step1_lowering()
  shim = build_shim(out)
  if a.cpu_check:
    print("\n--cpu-check: stopping before the GPU steps.", "step 1 OK" if ok1 else "step 1 FAILED")
    return 0 if ok1 and shim else 1

  import jax
  dev = jax.devices()[0]
  print(f"device: {dev.device_kind}, compute capability {getattr(dev, 'compute_capability', None)}; "
        f"jax {jax.__version__}")
  spoofed_dir = os.path.join(out, "spoofed")
  os.makedirs(spoofed_dir, exist_ok=True)
  if shim:
    banner(f"2. Mosaic GPU compile pipeline with the device reported as {a.spoof} (LD_PRELOAD shim)")
    run_child(spoofed_dir, shim, a.spoof, a.timeout)
  ok3 = step3_ptxas(spoofed_dir, a.arch)

  banner("4. the same compile at the device's own architecture (no shim), for comparison")
  native_dir = os.path.join(out, "native")
  os.makedirs(native_dir, exist_ok=True)
  run_child(native_dir, None, None, a.timeout)
  banner("summary")
  print(textwrap.dedent(f"""\
      step 1 (Python lowering at sm_100a): {'OK' if ok1 else 'FAILED'}
      step 2/3 (ptxas {a.arch} on the pipeline's PTX): {'OK' if ok3 else 'not achieved: see above'}
      outputs kept in {out}"""))
  return 0 if ok1 and ok3 else 1


if __name__ == "__main__":
  sys.exit(main())
