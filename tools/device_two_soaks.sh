#!/usr/bin/env bash
# One device call: a fault-soak slice, then a join-soak slice, then the import timing of a rank, all
# packed into OUT/soaks.tar.gz (the device returns at most 8 files). Usage:
#   tools/device_two_soaks.sh OUT FAULT_SEED FAULT_TRIALS FAULT_SECONDS JOIN_SEED JOIN_TRIALS JOIN_SECONDS
set -u
out=${1:?OUT}
work=$(mktemp -d)
mkdir -p "$work/fault" "$work/join"
ELCHE_SOAK_SEED=$2 SOAK_WORKERS=${SOAK_WORKERS:-8} tools/device_soak.sh "$work/fault" 0 "$3" "$4" > "$work/fault/report.txt" 2>&1
ELCHE_SOAK_SEED=$5 SOAK_WORKERS=${JOIN_WORKERS:-7} SOAK_FILE=tests/test_join_soak.py \
  tools/device_soak.sh "$work/join" 0 "$6" "$7" > "$work/join/report.txt" 2>&1
{
  nproc; python3 -c "import sys; print(sys.version)"
  for i in 1 2; do /usr/bin/time -f "%e s: import of a churn rank ($i)" python3 -c "import lightning_elche.bench.churn_fit"; done
  python3 - <<'PY'
import importlib.util, os, lightning
root = os.path.dirname(lightning.__file__)
sources = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py")]
cached = [s for s in sources if os.path.exists(importlib.util.cache_from_source(s))]
print(f"lightning at {root}: {len(cached)} of {len(sources)} sources have a .pyc; writable: {os.access(root, os.W_OK)}")
PY
} > "$work/imports.txt" 2>&1
tar -czf "$out/soaks.tar.gz" -C "$work" .
cat "$work/fault/report.txt" "$work/join/report.txt" "$work/imports.txt"
