#!/usr/bin/env bash
# One device call (one H200): build the kernels the FP8 work needs, run the FP8 GPU tests, then the
# FP8 grouped-GEMM and MoE-layer benchmarks. Logs and JSON go to $OUT; the built kernel cache comes
# back as $OUT/kcache.tgz (unpack into .kcache/ and carry it to skip the build next time).
# Usage from the repo root, with nvidia-cutlass's wheel in .whl/:   bash benchmarks/run_fp8_h200.sh
set -u
source tests/device_env.sh
nvidia-smi -L > "$OUT/env.txt" 2>&1
BF16="" ; for d in fwd dgrad wgrad; do for c in 0 1 2 3 10; do BF16="$BF16 te_gg_${d}_c${c}_bf16"; done; done
FP8=$(python3 -c "from cutlass_kernels.fp8_block import all_fp8_instances as a; print(' '.join(i.name for i in a()))")
timeout 420 python3 -m cutlass_kernels --jobs 16 --only $BF16 $FP8 > "$OUT/build.txt" 2>&1
tail -n 30 "$OUT/build.txt"
tar czf "$OUT/kcache.tgz" .kcache/*.so .kcache/*.sha256 2>/dev/null
timeout ${TEST_LIMIT:-240} python3 -m pytest -q -p no:cacheprovider -rfEs --timeout 200 -m gpu ${TESTS:-tests/kernels/test_fp8_grouped_gpu.py} > "$OUT/tests.txt" 2>&1
tail -n 25 "$OUT/tests.txt"
timeout ${GEMM_LIMIT:-200} python3 benchmarks/fp8_grouped_gemm.py ${GEMM_ARGS:-} --json "$OUT/fp8_gemm.json" > "$OUT/fp8_gemm.txt" 2>&1
tail -n 40 "$OUT/fp8_gemm.txt"
timeout ${LAYER_LIMIT:-200} python3 benchmarks/fp8_layer.py ${LAYER_ARGS:-} --json "$OUT/fp8_layer.json" > "$OUT/fp8_layer.txt" 2>&1
tail -n 20 "$OUT/fp8_layer.txt"
