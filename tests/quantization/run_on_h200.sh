#!/usr/bin/env bash
# One H200 session for issue 3: the quantization tests on CUDA (cuda-parametrised and gpu-marked;
# the cast functions run through torch.compile there) and the throughput benchmark, compiled and
# eager. Logs go to $OUT (or ./out). Usage from the repo root:
#   bash tests/quantization/run_on_h200.sh
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv;
  python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"; } 2>&1 | tee "$OUT/env.txt"
timeout ${TEST_TIMEOUT:-420} python3 -m pytest -q -p no:cacheprovider --timeout 300 -rs -m gpu tests/quantization 2>&1 | tee "$OUT/quant_tests.txt"
timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/quantize.py casts ${BENCH_ARGS:-} 2>&1 | tee "$OUT/quant_bench.txt"
timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/quantize.py casts --eager ${BENCH_ARGS:-} 2>&1 | tee "$OUT/quant_bench_eager.txt"
exit 0
