#!/usr/bin/env bash
# The peer kit (FlashMLA beside mla-pallas, one run, one table) with a heads-on-M schedule candidate in place of the
# op's "producer_vt" (its choice from 8-tile splits), without changing the library: a throw-away project folder whose
# sitecustomize.py patches ops.sparse_decode._heads_m_tuning in the kit's JAX worker. For a candidate that the
# sweeps found faster, so that its FlashMLA ratios come from the kit as every claim must.
#
#   SCHEDULE=twin CASES=P1,P5,F1,D1 bash benchmarks/peers_with_schedule.sh   # on the GPU, OUT as for the kit
#
# Needs the kit copied into .peers (benchmarks/pending_gpu.sh's header says how; carry .peers).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SCHEDULE=${SCHEDULE:?set SCHEDULE, e.g. twin}
PROJ_DIR=$(mktemp -d /tmp/proj_schedule.XXXXXX)
ln -s "$PWD/mla_pallas" "$PROJ_DIR/mla_pallas"
cat > "$PROJ_DIR/sitecustomize.py" <<PY
from mla_pallas.ops import sparse_decode as _sd
from mla_pallas.kernels import sparse_sm90_heads_m as _hm
assert "$SCHEDULE" in _hm.TuningConfig.SCHEDULES, "$SCHEDULE"
_orig = _sd._heads_m_tuning
def _patched(tiles_per_split):
  t = dict(_orig(tiles_per_split))
  if t.get("schedule") == "producer_vt":
    t["schedule"] = "$SCHEDULE"
  return t
_sd._heads_m_tuning = _patched
print("[peers_with_schedule] long splits run schedule $SCHEDULE", flush=True)
PY
PROJ=$PROJ_DIR bash .peers/run_on_h200.sh
