#!/usr/bin/env bash
# One device call for the churn goal (issue 22 item 8) and the one-GPU checks (issue 25), on the
# 16-core GPU machine, in two phases:
#   phase A, SECONDS (default 180) per arm, side by side so that every arm sees the same load:
#     cores 0-3 elche_fault_free, 4-7 elche_joins, 8-11 elche_shrink (one bench run, --churn-cpus);
#     cores 12-15 the one-GPU round and memory checks (tools/device_gpu_round.sh).
#   phase B: cores 0-3 ddp_fault_free, 4-7 ddp_torchrun, the same schedule (a second bench run).
#   rigs (only when PHASES names it): the two cpu4 runs of tools/device_cpu_rigs.sh (LAYOUT=pair) until
#   RIGS_END (default 560) s after the start: the noise check of issue 25 item 4.
# PHASES (default "gpu elche ddp") picks the parts; SKIP_PROBE=1 skips the import probe; SHM_VENV=1 also times
# the import from a copy of the venv in /dev/shm, SHM_VENV=use then runs everything from that copy.
# RATE (default 1: three faults per 180 s arm, one per minute per four ranks), SEED (default 0) and
# DELAY (default 5 s) are those of tools/device_churn.sh. A replacement's start-up is timed
# (ELCHE_JOIN_TIMING, set by the bench) and the import time of a rank is probed first.
# Usage: COMMIT=<sha> tools/device_session.sh OUT [SECONDS]. Everything is packed into
# OUT/session.tar.gz (the device tool brings back at most 8 files); the summaries are printed.
set -u
out=${1:?OUT}; seconds=${2:-180}
export PYTHONPATH=$PWD
mkdir -p "$out/elche" "$out/ddp" "$out/gpu" "$out/rigs"
pin() { if command -v taskset > /dev/null; then taskset -c "$@"; else shift; "$@"; fi; }
churn() {  # churn OUT ARMS CPUS
  timeout $(( ${seconds%.*} + 150 )) python3 -m lightning_elche.bench --rig cpu4 --budget quick --churn "${RATE:-1}" \
    --churn-seconds "$seconds" --churn-delay "${DELAY:-5}" --churn-seed "${SEED:-0}" --commit "${COMMIT:-unknown}" \
    --churn-arms "$2" --churn-cpus "$3" --no-plots --out "$1" > "$1/churn.log" 2>&1
  echo "exit $?" >> "$1/churn.log"
  find "$1/cpu4-churn-runs" -name ckpt -type d -prune -exec rm -rf {} + 2>/dev/null
}
probe() {
  date -u; nproc; lscpu | grep -E "Model name|MHz" | head -3
  python3 -c "import sys; print(sys.executable, sys.prefix)"
  /usr/bin/time -f "%e s: python3 -c pass" python3 -c pass
  python3 -c "import time; t = time.perf_counter(); sum(i * i for i in range(10**7)); print(f'{time.perf_counter() - t:.2f} s: 1e7 squares in pure Python')"
  venv=$(python3 -c "import sys; print(sys.prefix)")
  echo "filesystems: venv $(stat -f -c %T "$venv"), repo $(stat -f -c %T "$PWD"), /dev/shm $(stat -f -c %T /dev/shm); venv $(du -sh "$venv" 2>/dev/null | cut -f1)"
  pin 0 python3 -X importtime -c "import lightning_elche.bench.churn_fit" 2>&1 | sort -t'|' -k2 -n | tail -8
  for i in 1 2; do /usr/bin/time -f "%e s: import of a churn rank (core 0)" taskset -c 0 python3 -c "import lightning_elche.bench.churn_fit"; done
  if [[ -n "${SHM_VENV:-}" ]]; then  # the same venv copied to memory: is the import the filesystem's or the CPU's?
    df -h /dev/shm | tail -1
    /usr/bin/time -f "%e s: copy of the venv to /dev/shm" cp -a "$venv" /dev/shm/venv
    for i in 1 2; do /usr/bin/time -f "%e s: import of a churn rank from /dev/shm (core 0)" taskset -c 0 /dev/shm/venv/bin/python3 -c "import lightning_elche.bench.churn_fit" && touch /dev/shm/venv.ok; done
  fi
}
[[ -n "${SKIP_PROBE:-}" ]] || probe > "$out/startup.txt" 2>&1
# SHM_VENV=use: every process of the run (ranks, replacements, restarts) imports from the copy in memory.
[[ "${SHM_VENV:-}" == use && -e /dev/shm/venv.ok ]] && { export PATH=/dev/shm/venv/bin:$PATH; echo "the run imports from /dev/shm/venv" >> "$out/startup.txt"; }
phases=" ${PHASES:-gpu elche ddp} "
start=$(date +%s)
[[ $phases == *" gpu "* ]] && { pin 12-15 bash tools/device_gpu_round.sh "$out/gpu" > "$out/gpu/summary.txt" 2>&1 & }
[[ $phases == *" elche "* ]] && churn "$out/elche" "${ARMS_A:-elche_fault_free,elche_joins,elche_shrink}" "${CPUS_A:-0-3/4-7/8-11}"
[[ $phases == *" ddp "* ]] && churn "$out/ddp" ddp_fault_free,ddp_torchrun "${CPUS_B:-0-3/4-7}"
wait
# rigs: the two cpu4 runs of tools/device_cpu_rigs.sh on halves of the machine, up to RIGS_END s after the start.
if [[ $phases == *" rigs "* ]]; then
  mkdir -p "$out/rigs"
  DEADLINE=$(( ${RIGS_END:-560} - $(date +%s) + start )) LAYOUT=pair bash tools/device_cpu_rigs.sh "$out/rigs" \
    > "$out/rigs/summary.txt" 2>&1
fi
tar -czf /tmp/session.tar.gz -C "$out" elche ddp gpu rigs startup.txt 2>/dev/null; mv /tmp/session.tar.gz "$out/session.tar.gz"
cat "$out/startup.txt" 2>/dev/null
for part in gpu elche ddp rigs; do echo "=== $part"; tail -n 30 "$out/$part/summary.txt" "$out/$part/churn.log" 2>/dev/null | grep -v "^How the numbers"; done
find "$out" -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} +
rm -f "$out/startup.txt"
