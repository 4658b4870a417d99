#!/usr/bin/env bash
# The N-rank CPU rigs on the 16-core device machine (issue 25, items 3-4): two runs of cpu4 on
# cores 0-3 and 4-7 (the same commit twice, side by side: the noise check) and one cpu8 on cores
# 8-15, at the full budget, speeds spread 4.5x, PASSES (default 1) interleaved passes each with
# solos before and after the arms; the bench skips a pass that would end after DEADLINE s
# (default 470).
# Usage: tools/device_cpu_rigs.sh OUT. Writes at most seven files: a/cpu4.{md,json}, b/cpu4.{md,json},
# c/cpu8.{md,json} and logs.tar.gz. COMMIT is stamped into the reports (the copied tree has no git).
set -u
out=${1:?OUT}
export PYTHONPATH=$PWD
deadline=${DEADLINE:-470}
[[ "${LAYOUT:-}" == pinab ]] && unset PIN  # its two runs choose for themselves
common=(--budget full --seeds 0 --only-headline --tp-arms ddp,nccl_cadence,cpu_cadence,cpu_async --no-plots
        --commit "${COMMIT:-unknown}" --deadline-s "$deadline" ${PIN:+--pin-ranks})  # PIN=1: each rank on one core
pin() { if command -v taskset > /dev/null; then taskset -c "$@"; else shift; "$@"; fi; }
mkdir -p "$out/a" "$out/b" "$out/c" /tmp/rig-logs
date -u > /tmp/rig-logs/date
# Which logical CPUs share a physical core: the layouts above assume the pinned sets do not.
{ lscpu -e=CPU,CORE,SOCKET,NODE 2> /dev/null || cat /proc/cpuinfo; } > /tmp/rig-logs/cpus.txt
# PIN=1 pins each rank to one core of its run's set (--pin-ranks); LAYOUT=pinab runs cpu8 twice at
# once, pinned on cores 0-7 and free on 8-15 (PASSES each, default 1): the pinning's A/B in one run.
# LAYOUT=eight: cpu8 on cores 0-7, one cpu4 on 8-11 and, with GPU_ROUND=1, tools/device_gpu_round.sh
# on 12-15, all at once (one call for all three when device time is short); PASSES (default 1) each.
# LAYOUT=pair: only the two cpu4 runs, on halves of the machine (0-7 and 8-15), nothing else; PASSES (default 3) each.
# LAYOUT=cpu8: cpu8 alone on cores 0-7 (with GPU_ROUND=1, tools/device_gpu_round.sh on 12-15); PASSES (default 1).
# LAYOUT=alone: the two cpu4 runs one after the other on cores 0-7, nothing else on the machine but,
# with GPU_ROUND=1, tools/device_gpu_round.sh on cores 12-15 during the first; PASSES (default 1) each.
cpu4() {  # cpu4 RUN CORES PASSES
  pin "$2" python3 -m lightning_elche.bench --rig cpu4 "${common[@]}" --rank-slowdowns 1,2,3,4.5 --throughput-seeds "$3" \
    --out "$out/$1" > "/tmp/rig-logs/cpu4-$1.log" 2>&1
}
cpu8() {  # cpu8 CORES [RUN [EXTRA FLAGS]]
  local run=${2:-c}
  pin "$1" python3 -m lightning_elche.bench --rig cpu8 "${common[@]}" "${@:3}" \
    --rank-slowdowns 1,2,3,4.5,1,2,3,4.5 --throughput-seeds "${PASSES:-1}" --out "$out/$run" > "/tmp/rig-logs/cpu8-$run.log" 2>&1
}
gpu=/tmp/rig-logs/gpu
gpu_round() { mkdir -p "$gpu"; [[ -z "${GPU_ROUND:-}" ]] || { pin 12-15 bash tools/device_gpu_round.sh "$gpu" > "$gpu/summary.txt" 2>&1 & }; }
if [[ "${LAYOUT:-}" == alone ]]; then
  rmdir "$out/c"; gpu_round
  cpu4 a 0-7 "${PASSES:-1}"
  cpu4 b 0-7 "${PASSES:-1}"
elif [[ "${LAYOUT:-}" == cpu8 ]]; then
  rmdir "$out/a" "$out/b"; gpu_round
  cpu8 0-7
elif [[ "${LAYOUT:-}" == pinab ]]; then
  rmdir "$out/a" "$out/b"; mkdir -p "$out/d"; gpu_round
  cpu8 0-7 c --pin-ranks &
  cpu8 8-15 d &
elif [[ "${LAYOUT:-}" == eight ]]; then
  rmdir "$out/b"; gpu_round
  cpu4 a 8-11 "${PASSES:-1}" &
  cpu8 0-7 &
elif [[ "${LAYOUT:-}" == pair ]]; then
  cpu4 a 0-7 "${PASSES:-3}" & cpu4 b 8-15 "${PASSES:-3}" &
else
  cpu4 a 0-3 "${PASSES:-1}" & cpu4 b 4-7 "${PASSES:-1}" &
  cpu8 8-15 &
fi
wait
tar -czf "$out/logs.tar.gz" -C /tmp rig-logs
for f in "$out"/a/cpu4.md "$out"/b/cpu4.md "$out"/c/cpu8.md "$out"/d/cpu8.md; do [[ -f "$f" ]] || continue; echo "== $f"; grep -E "efficiency|share error|slowdown|warning" "$f" | head -12; done
tail -n 3 /tmp/rig-logs/*.log
echo "cpu:core $(awk 'NR > 1 {printf "%s:%s ", $1, $2}' /tmp/rig-logs/cpus.txt)"
[[ -f "$gpu/summary.txt" ]] && tail -n 30 "$gpu/summary.txt"
exit 0
