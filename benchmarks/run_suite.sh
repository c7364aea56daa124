#!/usr/bin/env bash
# The headline rows of docs/benchmarks.md in one device call: bash benchmarks/run_suite.sh --gpu (one GPU)
# or --gpu2 (two GPUs of one host), from the repo root, wheels in .whl/ (nvidia-cutlass, megatron-core
# for the device's Python) and the kernel cache in .kcache/ (bash benchmarks/run_fp8_gpu.sh build).
# The device tool brings back at most 8 files from $OUT, so JSON, plots and logs travel packed:
# $OUT/suite.tgz holds data/, img/ and logs/ (unpack it, then copy data/ and img/ into docs/);
# $OUT/suite.txt is the run's printout and $OUT/env.txt the GPU.
set -u
source tests/device_env.sh
STAGE=$(mktemp -d)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/env.txt" 2>&1
python3 benchmarks/suite.py "${@:---gpu}" --data "$STAGE/data" --img "$STAGE/img" --logs "$STAGE/logs" \
  > "$OUT/suite.txt" 2>&1
status=$?
tar czf "$OUT/suite.tgz" -C "$STAGE" . && tail -n 20 "$OUT/suite.txt"
exit $status
