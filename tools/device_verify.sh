#!/usr/bin/env bash
# The checks CI cannot run, on the device machine (one GPU, 16 cores): one-GPU tests, the
# many-rank matrix and the fault matrices. Usage: tools/device_verify.sh OUT_DIR PART...
# PART: gpu | many_ranks | faults. Each part's log is OUT_DIR/<part>.log, its exit status last.
set -u
out=${1:?OUT_DIR}; shift
export PYTHONPATH=$PWD NCCL_NVLS_ENABLE=0 RUN_GPU_TESTS=1
pytest=(python3 -m pytest -p no:cacheprovider -q -rfE)
run_part() {
  case "$1" in
    gpu) "${pytest[@]}" -m gpu tests/test_gpu_memory.py tests/test_gpu_round.py tests/test_gpu_micro_batch.py \
           "tests/test_gpu.py::test_zero_copy_round_on_one_gpu_nccl_premul_and_inductor" ;;
    many_ranks) "${pytest[@]}" -m many_ranks tests/test_many_ranks.py ;;
    faults) "${pytest[@]}" -m faults -n "${FAULT_WORKERS:-4}" tests/test_rank_loss.py tests/test_join.py \
              tests/test_stall.py tests/test_micro_batch.py ;;
    *) echo "unknown part $1"; return 2 ;;
  esac
}
for part in "$@"; do
  ( run_part "$part" > "$out/$part.log" 2>&1; echo "exit status $?" >> "$out/$part.log" ) &
done
wait
tail -n 4 "$out"/*.log
