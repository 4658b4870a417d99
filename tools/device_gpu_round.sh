#!/usr/bin/env bash
# The round's own time and the memory bound on ONE GPU of the device machine (issue 25, items 1-2):
# tools/averaging_overhead.py first, on a quiet host (it times host gaps), then the one-GPU tests of
# the round and of the memory bound (the MLP and the transformer), keeping the benchmark's tables.
# Usage: tools/device_gpu_round.sh OUT. Writes at most 8 files (the device tool's limit).
# VARIANTS (comma-separated) limits the overhead tool to those variants.
set -u
out=${1:?OUT}
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 RUN_GPU_TESTS=1 ELCHE_BENCH_COMMIT=${COMMIT:-}  # the copied tree has no git of its own
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$out/machine.txt" 2>&1
python3 tools/averaging_overhead.py --iters 100 ${VARIANTS:+--variants "$VARIANTS"} --out "$out/averaging-overhead.json" > "$out/overhead.log" 2>&1
echo "exit status $?" >> "$out/overhead.log"
# Where the host's time goes in a round (on one rank the device waits for it): a table, in the same log.
python3 tools/round_host_time.py --iters 100 >> "$out/overhead.log" 2>&1
echo "round_host_time exit status $?" >> "$out/overhead.log"
ELCHE_KEEP_BENCH=$out python3 -m pytest -p no:cacheprovider -q -rfE -s -m gpu tests/test_gpu_round.py \
  "tests/test_gpu.py::test_zero_copy_round_on_one_gpu_nccl_premul_and_inductor" tests/test_gpu_memory.py > "$out/gpu.log" 2>&1
echo "exit status $?" >> "$out/gpu.log"
python3 - "$out/averaging-overhead.json" <<'PY'
import json, sys
result = json.load(open(sys.argv[1]))
print(f"{'case':28} {'own us':>8} {'watched own us':>15} {'kernel us':>10} {'drift us':>9} {'TB/s':>6} {'round own us':>13} {'kernels':>8} {'peak +MB':>9} collectives")
for name, row in result.items():
    if isinstance(row, dict) and "own_ms" in row:
        rate = row.get('drift_tb_per_s') or row.get('drift_read_tb_per_s') or 0.0
        print(f"{name:28} {1000 * row['own_ms']:8.1f} {1000 * row['watched_own_ms']:15.1f} {row['own_kernel_us']:10.1f} "
              f"{row.get('drift_kernel_us', 0.0):9.1f} {rate:6.2f} "
              f"{1000 * row['round_own_ms']:13.1f} {row['kernels_per_round']:8.1f} {row.get('round_peak_extra_mb', 0.0):9.2f} "
              f"{row.get('collectives_per_round', row.get('reduces_per_round'))}")
PY
tail -n 12 "$out/overhead.log"; tail -n 6 "$out/gpu.log"
