#!/usr/bin/env bash
# Nsight Compute profiles (hardware counters) of one launch of the Mosaic kernels whose limiter the benchmarks left
# open: sparse decode (b) GLM-5 TP-8 and (a) FlashMLA's headline shape, and the fused rope kernel at T = 8192,
# H = 16 (40% of copy BW). Sections: speed of light, compute / memory workload (with the shared-memory table),
# warp states, scheduler, occupancy, launch, instruction stats. Clocks left alone (--clock-control none).
# Usage (repo root, one H200): PYTHONPATH=. bash benchmarks/ncu_profile_gpu.sh -> ${OUT:-results}/ncu_*.txt
set -u
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-.}
NCU="ncu --clock-control none -k regex:mosaic --launch-skip 2 --launch-count 1 --section SpeedOfLight
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables
  --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats
  --section InstructionStats"
prof() {   # prof NAME OP SHAPE
  echo "== $1 ($2 $3)"
  timeout 120 $NCU python3 benchmarks/ncu_driver.py "$2" --shape "$3" > "$OUT/ncu_$1.txt" 2>&1
  echo "exit code $?"
  grep -E "Duration|Memory Throughput|Compute \(SM\) Throughput|L1/TEX Hit|Shared|Bank|Stall|Issue Slots|Registers|Achieved Occupancy|Executed Ipc|==ERROR==|==WARNING==" \
    "$OUT/ncu_$1.txt" | head -n 40
}
prof sparse_b sparse_mla_decode B=128,s_q=4,H=8,topk=2048,page=64,ctx=32768
# prof sparse_a sparse_mla_decode B=128,s_q=2,H=128,topk=2048,page=64,ctx=32768   # (a): same per-tile chain as (b) (RESULTS run 11); enable when there is device time
prof rope_T8192_H16 fused_rope_rmsnorm_quantization T=8192,H=16
