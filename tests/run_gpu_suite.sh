#!/usr/bin/env bash
# Every GPU test of the project in one device call (2×H200 for the NCCL tests).
# Usage from the repo root, with the wheels in .whl/ (nvidia-cutlass, megatron-core for Python 3.12)
# and, optionally, a kernel cache in .kcache/:   bash tests/run_gpu_suite.sh
# Three pytest processes run side by side: quantization (torch.compile-heavy) on the second GPU,
# the other single-GPU tests on the first, and the multi-GPU (NCCL) tests on both. Logs go to $OUT.
set -u
source tests/device_env.sh
{ nvidia-smi -L; python3 -c "import torch, megatron.core as m; print(torch.__version__, torch.cuda.device_count(), 'mcore', m.__version__)"; } > "$OUT/gpu_env.txt" 2>&1
LIMIT=${LIMIT:-480}
LIMIT_MULTI=${LIMIT_MULTI:-$((LIMIT + 180))}  # the NCCL group runs each transport of the EP=2 tests
PYTEST="python3 -m pytest -q -p no:cacheprovider -rfEs --timeout 300 -m gpu"
status() { echo "[exit code $? of: $1]"; }  # 124: killed at its time limit
( CUDA_VISIBLE_DEVICES=1 timeout "$LIMIT" $PYTEST tests/quantization; status quantization ) > "$OUT/gpu_quant.txt" 2>&1 &
( CUDA_VISIBLE_DEVICES=0 timeout "$LIMIT" $PYTEST tests/kernels tests/ops tests/test_support.py tests/cli/test_env.py \
  tests/megatron/test_gpu.py -k "not ep2"; status single-GPU ) > "$OUT/gpu_single.txt" 2>&1 &
( timeout "$LIMIT_MULTI" $PYTEST tests/distributed tests/moe tests/cli/test_train_gpu.py; status NCCL
  timeout 200 $PYTEST tests/megatron/test_gpu.py -k ep2; status megatron-ep2 ) > "$OUT/gpu_multi.txt" 2>&1 &
wait
for f in "$OUT"/gpu_*.txt; do echo "== $f"; tail -n 25 "$f"; done
