#!/usr/bin/env bash
# The GPU benchmarks of docs/benchmarks.md in one device call on 2×H200 (plus a re-run of the GPU
# tests named in RETEST). Usage from the repo root, wheels in .whl/ (nvidia-cutlass, megatron-core
# for Python 3.12), optional kernel cache in .kcache/:   bash benchmarks/run_h200x2.sh
# Phase 1 runs single-GPU work side by side (the re-tests use both GPUs briefly; benchmarks on GPU 0); phase 2 the
# two-GPU (NCCL) benchmarks alone. Logs go to $OUT, at most 8 files.
set -u
source tests/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$OUT/bench_env.txt" 2>&1
TORCHRUN="python3 -m torch.distributed.run --standalone --nproc-per-node 2"

# PHASES picks phases (a device call is limited to 10 minutes); EXTRA=1 adds the Megatron and training
# benchmarks, CONSENSUS=1 the consensus one (each a few minutes).
PHASES=${PHASES:-"1 2"}
# Phase 1
if [[ " $PHASES " == *" 1 "* ]]; then
if [ -n "${RETEST:-}" ]; then
  timeout 230 python3 -m pytest -q -p no:cacheprovider -rfEs --timeout 200 -m gpu $RETEST \
    > "$OUT/retest.txt" 2>&1 &
fi
( CUDA_VISIBLE_DEVICES=0 timeout 130 python3 benchmarks/quantize.py > "$OUT/bench_quantize.txt" 2>&1
  [ -n "${EXTRA:-}" ] && CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/megatron_experts.py --preset deepseek \
    --dispatcher alltoall > "$OUT/bench_megatron.txt" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 benchmarks/support_overhead.py --real-device > "$OUT/bench_support.txt" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 benchmarks/fuser_overhead.py --device cuda > "$OUT/bench_fuser.txt" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 90 python3 benchmarks/swiglu_backward.py >> "$OUT/bench_fuser.txt" 2>&1 ) &
CUDA_VISIBLE_DEVICES=1 timeout 330 python3 benchmarks/grouped_gemm.py ${GG_ARGS:-} > "$OUT/bench_gemm.txt" 2>&1 &
wait
fi
# Phase 2
if [[ " $PHASES " == *" 2 "* ]]; then
timeout 150 $TORCHRUN benchmarks/moe_layer.py --backend nccl > "$OUT/bench_moe.txt" 2>&1
[ -n "${CONSENSUS:-}" ] && timeout 70 python3 benchmarks/consensus_overhead.py --backend nccl --steps 300 >> "$OUT/bench_moe.txt" 2>&1
[ -n "${EXTRA:-}" ] && timeout 110 python3 benchmarks/train_throughput.py --nproc 2 --config launchers/configs/mixtral_like.yaml --steps 12 \
  --variants none:2 none:1 > "$OUT/bench_train.txt" 2>&1
fi
for f in "$OUT"/*.txt; do echo "== $f"; tail -n 30 "$f"; done
