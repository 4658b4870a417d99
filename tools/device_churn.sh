#!/usr/bin/env bash
# Goodput under churn on the 16-core device machine (issue 22 item 8; docs/benchmarks.md, "Goodput
# under churn"): the five arms of `python -m lightning_elche.bench --rig cpu4 --churn RATE` one after
# the other, SECONDS of measured wall time each (default 40; the whole script takes about
# ARMS x (SECONDS + 10) s plus the stop of each arm's processes; it is boxed at ARMS x (SECONDS + 40) s,
# at most 590 s, so that an arm that ended is always written). Usage: tools/device_churn.sh OUT [SECONDS]
# Environment: RATE (faults per minute per four ranks, default 4: three faults per 40 s arm; the goal
# rate is 1, one fault per 60 s arm), DELAY (replacement delay, default 5 s), SEED (default 0),
# COMMIT (stamped into the report: the copied tree has no git), ARMS (--churn-arms, default all five).
# CPUS (a taskset list such as 0-7): pin the arms' processes to those cores, so that two runs can
# share the machine (the ElChe arms on half the cores, the DDP arms on the other half).
# The goal's own reading, two arms at the goal rate: ARMS=elche_fault_free,elche_joins RATE=1 tools/device_churn.sh OUT 120
# Writes four files: churn.log (with the date and the cores), cpu4-churn.md, cpu4-churn.json, runs.tar.gz.
set -u
out=${1:?OUT}; seconds=${2:-40}
mkdir -p "$out"
export PYTHONPATH=$PWD
pin=()
[[ -n "${CPUS:-}" ]] && command -v taskset > /dev/null && pin=(taskset -c "$CPUS")
{ date -u; echo "nproc $(nproc); pinned to: ${CPUS:-all cores}"; } > "$out/churn.log"
arms=${ARMS:-elche_fault_free,elche_joins,elche_shrink,ddp_fault_free,ddp_torchrun}
box=$(( $(tr ',' '\n' <<< "$arms" | grep -c .) * (${seconds%.*} + 40) ))
(( box > 590 )) && box=590
timeout "$box" "${pin[@]}" python3 -m lightning_elche.bench --rig cpu4 --budget quick --churn "${RATE:-4}" \
  --churn-seconds "$seconds" --churn-delay "${DELAY:-5}" --churn-seed "${SEED:-0}" --commit "${COMMIT:-unknown}" \
  ${ARMS:+--churn-arms "$ARMS"} --no-plots --out "$out" >> "$out/churn.log" 2>&1
echo "exit $?" >> "$out/churn.log"
# The arms' records and logs, without the DDP checkpoints.
find "$out/cpu4-churn-runs" -name ckpt -type d -prune -exec rm -rf {} + 2>/dev/null
tar -czf "$out/runs.tar.gz" -C "$out" cpu4-churn-runs 2>/dev/null && rm -rf "$out/cpu4-churn-runs"
tail -25 "$out/churn.log"
