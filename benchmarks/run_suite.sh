#!/usr/bin/env bash
# The headline rows of docs/benchmarks.md in one device call: bash benchmarks/run_suite.sh --gpu (one GPU)
# or --gpu2 (two GPUs of one host), from the repo root, wheels in .whl/ (nvidia-cutlass, megatron-core
# for the device's Python) and the kernel cache in .kcache/ (bash benchmarks/run_fp8_gpu.sh build).
# JSON, plots and logs go to $OUT/data, $OUT/img and $OUT/logs; copy data/ and img/ into docs/.
set -u
source tests/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/env.txt" 2>&1
python3 benchmarks/suite.py "${@:---gpu}" --data "$OUT/data" --img "$OUT/img" --logs "$OUT/logs"
