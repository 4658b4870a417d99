#!/usr/bin/env bash
# Exactly-once and identical replicas at many ranks on the 16-core device machine, in one call:
# the 16-rank launch of tests/test_many_ranks.py (every mode, 3 runs each), then a join-soak slice and
# a fault-soak slice with every trial at ELCHE_SOAK_RANKS (default 8) launch ranks. Usage:
#   tools/device_many_ranks.sh OUT SEED MANY_SECONDS JOIN_SECONDS FAULT_SECONDS
# Everything is packed into OUT/many.tar.gz (the device returns at most 8 files); the summaries are printed.
set -u
out=${1:?OUT}; seed=${2:?SEED}
export PYTHONPATH=$PWD ELCHE_SOAK_RANKS=${ELCHE_SOAK_RANKS:-8}
work=$(mktemp -d)
mkdir -p "$work/many" "$work/join" "$work/fault"
date -u > "$work/date"
timeout "${3:?MANY_SECONDS}" python3 -m pytest -m many_ranks tests/test_many_ranks.py -k "16-" -p no:cacheprovider -q -rfE \
  --basetemp=/tmp/many > "$work/many/pytest.log" 2>&1
echo "exit $?" >> "$work/many/pytest.log"
pkill -9 -f multirank_fits.py
ELCHE_SOAK_SEED=$seed SOAK_WORKERS=${JOIN_WORKERS:-3} SOAK_FILE=tests/test_join_soak.py \
  tools/device_soak.sh "$work/join" 0 40 "${4:?JOIN_SECONDS}" > "$work/join/report.txt" 2>&1
ELCHE_SOAK_SEED=$seed SOAK_WORKERS=${FAULT_WORKERS:-3} tools/device_soak.sh "$work/fault" 0 40 "${5:?FAULT_SECONDS}" \
  > "$work/fault/report.txt" 2>&1
tar -czf "$out/many.tar.gz" -C "$work" .
tail -n 4 "$work/many/pytest.log"; cat "$work/join/report.txt" "$work/fault/report.txt"
