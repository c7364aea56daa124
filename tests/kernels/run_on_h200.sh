#!/usr/bin/env bash
# One H200 session for issue 5: build every CUTLASS instance, run the GPU + CPU kernel tests,
# benchmark. Logs go to $OUT (or ./out). Usage from the repo root:
#   bash tests/kernels/run_on_h200.sh            (expects the nvidia-cutlass wheel in .whl/)
# A .kcache/ from an earlier run (carried) skips the ~2 min build: keys match when source,
# headers, flags and nvcc match.
set -u
OUT=${OUT:-$PWD/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import cutlass_library" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/nvidia_cutlass-*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export TE_DIST_CACHE=${TE_DIST_CACHE:-$PWD/.kcache}
mkdir -p "$TE_DIST_CACHE"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv; nvcc --version | tail -2;
  python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())"; } 2>&1 | tee "$OUT/env.txt"
timeout ${BUILD_TIMEOUT:-240} python3 -m cutlass_kernels --jobs 12 2>&1 | tee "$OUT/build.txt"
timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider --timeout 200 -rs tests/kernels/test_grouped_mm_gpu.py tests/test_support.py::test_real_device_answer 2>&1 | tee "$OUT/tests.txt"
timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/grouped_gemm.py --json "$OUT/grouped_gemm.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt"
timeout 120 python3 benchmarks/overhead.py support --real-device 2>&1 | tee "$OUT/support.txt"
[ -n "${SKIP_CACHE_TAR:-}" ] || tar czf "$OUT/kcache.tgz" -C "$TE_DIST_CACHE" . 2>/dev/null
exit 0
