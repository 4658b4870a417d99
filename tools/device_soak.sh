#!/usr/bin/env bash
# A slice of the fault soak on the device machine's cores (tests/test_soak.py), time-boxed, with the
# directories of failed trials packed for reading here. Usage: tools/device_soak.sh OUT FIRST TRIALS [SECONDS]
# SOAK_FILE=tests/test_join_soak.py runs the join soak instead (same variables, same report).
set -u
out=${1:?OUT}; first=${2:?FIRST}; trials=${3:?TRIALS}; seconds=${4:-540}
export PYTHONPATH=$PWD
date -u > "$out/date"
ELCHE_SOAK_FIRST=$first ELCHE_SOAK_TRIALS=$trials ELCHE_SOAK_SEED=${ELCHE_SOAK_SEED:-0} ELCHE_SOAK_REPORT=$out/soak.jsonl \
  timeout "$seconds" python3 -m pytest -m faults "${SOAK_FILE:-tests/test_soak.py}" -n "${SOAK_WORKERS:-7}" -p no:cacheprovider -q -rfE \
  --basetemp=/tmp/soak > "$out/soak.log" 2>&1
echo "exit $?" >> "$out/soak.log"
pkill -9 -f fault_fit.py  # trials cut off by the time box (they are not in the report)
python3 - "$out" <<'PY'
import json, os, sys, tarfile
out = sys.argv[1]
rows = [json.loads(line) for line in open(os.path.join(out, "soak.jsonl"))]
with tarfile.open(os.path.join(out, "failed.tar.gz"), "w:gz") as tar:
    for row in rows:
        if row["outcome"] != "passed" and os.path.isdir(row["out"]):
            tar.add(row["out"], arcname=os.path.basename(row["out"]))
PY
python3 tools/soak_report.py "$out/soak.jsonl" | head -40
