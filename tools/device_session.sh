#!/usr/bin/env bash
# One device call for the measurements that fit one lease (issues 22 and 25), side by side on
# disjoint cores of the 16-core GPU machine:
#   cores 0-5:   the ElChe churn arms (fault-free, joins, shrink-only) at RATE faults per minute per
#                four ranks, SECONDS each (tools/device_churn.sh);
#   cores 6-11:  the Lightning DDP churn arms (fault-free, torchrun with restarts), the same schedule;
#   cores 12-15: the one-GPU round and memory checks (tools/device_gpu_round.sh; the overhead tool
#                runs first, while the churn arms start up).
# Usage: COMMIT=<sha> tools/device_session.sh OUT [SECONDS]. Everything is packed into
# OUT/session.tar.gz (the device tool brings back at most 8 files); the summaries are printed.
set -u
out=${1:?OUT}; seconds=${2:-100}
mkdir -p "$out/elche" "$out/ddp" "$out/gpu"
pin() { if command -v taskset > /dev/null; then taskset -c "$@"; else shift; "$@"; fi; }
CPUS=0-5 ARMS=elche_fault_free,elche_joins,elche_shrink RATE=${RATE:-1} \
  tools/device_churn.sh "$out/elche" "$seconds" > "$out/elche/summary.txt" 2>&1 &
CPUS=6-11 ARMS=ddp_fault_free,ddp_torchrun RATE=${RATE:-1} \
  tools/device_churn.sh "$out/ddp" "$seconds" > "$out/ddp/summary.txt" 2>&1 &
pin 12-15 bash tools/device_gpu_round.sh "$out/gpu" > "$out/gpu/summary.txt" 2>&1 &
wait
tar -czf /tmp/session.tar.gz -C "$out" elche ddp gpu && rm -rf "$out/elche/runs.tar.gz" "$out/ddp/runs.tar.gz"
mv /tmp/session.tar.gz "$out/session.tar.gz"
for part in gpu elche ddp; do echo "=== $part"; tail -n 30 "$out/$part/summary.txt"; done
find "$out" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
