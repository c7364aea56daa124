#!/usr/bin/env bash
# The FP8 work's device calls (one H100 or H200). Logs and JSON go to $OUT.
#   bash benchmarks/run_fp8_gpu.sh build   # build the kernels the FP8 layer runs; $OUT/kcache_*.tgz bring
#                                          # them back (put them in .kcache/ and carry it: device_env.sh unpacks)
#   bash benchmarks/run_fp8_gpu.sh tests   # the FP8 GPU tests (casts, weight copy, layer, off-grid)
#   bash benchmarks/run_fp8_gpu.sh bench   # the weight cast and the training-step benchmarks
#   bash benchmarks/run_fp8_gpu.sh switches  # the paths landed off by default (docs/settings.md): their GPU
#                                          # tests with the switch on, then the benchmarks on against off
#   CONFIG=mixtral_like STEPS=30 bash benchmarks/run_fp8_gpu.sh train  # te-dist train tokens/s on this GPU,
#                                          # bf16 against block and current (STEPS=300: the loss check;
#                                          # TRAIN_ARGS=--fp8-dense: attention and LM head quantized too)
#   bash benchmarks/run_fp8_gpu.sh tiles   # the FP8 tile sweep (TILE_ARGS; its instances built first), then the FP8
#                                          # grouped GPU tests with fp8_fprop_fast_accum on
#   bash benchmarks/run_fp8_gpu.sh fast    # the training step with fp8_fprop_fast_accum off, then on
#   bash benchmarks/run_fp8_gpu.sh wgrad_tile  # a candidate wgrad tile (WGRAD_TILE, default 0, the former rule; docs/kernels.md "FP8
#                                          # tiles"): the layer's training step with the rule's wgrad tile, then with it
#                                          # (te_dist.settings.fp8_wgrad_tile); its tile sweep first: TILE_ARGS=... tiles
#   bash benchmarks/run_fp8_gpu.sh copies     # the optimizer's FP8 weight copies: GPU tests, the layer's step with the
#                                          # :copies arms, te-dist train without / with train.fp8_optimizer_copies
#   bash benchmarks/run_fp8_gpu.sh head_loss  # fp8_head_loss: its GPU tests, the job's step on against off, then
#                                          # te-dist train with it on (CONFIG=deepseek_like STEPS=300 by default)
#   bash benchmarks/run_fp8_gpu.sh lane_max   # head_loss_lane_max (on by default): the head-loss GPU tests with it
#                                          # on, then the job's step off against on (CONFIG=deepseek_like)
#   bash benchmarks/run_fp8_gpu.sh early      # early_weight_casts (on by default): its GPU tests with it on, the job's
#                                          # step off against on, then where the step idles (CONFIG=deepseek_like)
#   bash benchmarks/run_fp8_gpu.sh block_launch  # cuda_block_cast_launch (2 by default): the block-cast GPU tests
#                                          # (every launch), each launch's cast time, the job's block step per launch
#   bash benchmarks/run_fp8_gpu.sh wgrad_acc  # fp8_wgrad_accumulation (on by default): the accumulating wgrad's GPU
#                                          # test, the layer's :acc and :copies+acc rows at M = 4, then te-dist train at 4
#                                          # micro-batches with it off, then on
#                                          # (CONFIG=deepseek_like; the accumulating instances built first; the
#                                          # Megatron test needs megatron-core's wheel in .whl/ too)
#   (the headline rows of every area: benchmarks/run_suite.sh)
# Run from the repo root with nvidia-cutlass's wheel in .whl/ (tests/device_env.sh installs it).
set -u
source tests/device_env.sh
nvidia-smi -L > "$OUT/env.txt" 2>&1
# switch_ab NAME SETTING RECIPE [train.py switch options]: the job's step with SETTING at its value in force and
# flipped (or at --values), against bf16, in one process (CONFIG, default deepseek_like); $OUT/NAME.{txt,json}
switch_ab() {
  local name=$1 setting=$2 recipe=$3
  shift 3
  timeout ${SWITCH_LIMIT:-150} python3 benchmarks/train.py switch --setting "$setting" \
    --config launchers/configs/${CONFIG:-deepseek_like}.yaml --recipes "$recipe" "$@" --json "$OUT/$name.json" \
    > "$OUT/$name.txt" 2>&1
  tail -n 6 "$OUT/$name.txt"
}
case "${1:-all}" in
build|all)
  # bf16 grouped GEMMs with bf16 and float32 output (tests/kernels/test_grouped_mm_gpu.py runs both)
  BF16=$(python3 -c "from cutlass_kernels.build import all_instances as a; print(' '.join(i.name for i in a()))")
  FP8=$(python3 -c "from cutlass_kernels.fp8_block import all_fp8_instances as a; print(' '.join(i.name for i in a()))")
  timeout ${BUILD_LIMIT:-400} python3 -m cutlass_kernels --jobs 16 --only $FP8 $BF16 > "$OUT/build.txt" 2>&1
  tail -n 4 "$OUT/build.txt"
  (cd .kcache && tar czf "$OUT/kcache_bf16.tgz" te_gg_*.so te_gg_*.sha256 && tar czf "$OUT/kcache_fp8.tgz" te_fb_*.so te_fb_*.sha256)
  ;;&
tests|all)
  timeout ${TEST_LIMIT:-300} python3 -m pytest -q -p no:cacheprovider -rfEs --timeout 200 -m gpu \
    ${TESTS:-tests/ops/test_weight_copy.py tests/ops/test_off_grid_features.py tests/kernels/test_fp8_grouped_gpu.py \
    tests/quantization/test_triton_casts.py} > "$OUT/tests.txt" 2>&1
  tail -n 15 "$OUT/tests.txt"
  ;;&
bench|all)
  timeout ${CAST_LIMIT:-100} python3 benchmarks/quantize.py weights ${CAST_ARGS:-} > "$OUT/weight_cast.txt" 2>&1
  tail -n 12 "$OUT/weight_cast.txt"
  timeout ${LAYER_LIMIT:-330} python3 benchmarks/fp8_layer.py ${LAYER_ARGS:---fixed} --json "$OUT/fp8_layer.json" \
    > "$OUT/fp8_layer.txt" 2>&1
  tail -n 45 "$OUT/fp8_layer.txt"
  ;;
train)
  timeout ${TRAIN_LIMIT:-560} python3 benchmarks/train.py throughput --nproc 1 --device cuda --seed 1 \
    --config launchers/configs/${CONFIG:-mixtral_like}.yaml --steps ${STEPS:-30} --variants none:1 block:1 current:1 ${TRAIN_ARGS:-} \
    --json "$OUT/train_${CONFIG:-mixtral_like}.json" > "$OUT/train_${CONFIG:-mixtral_like}.txt" 2>&1
  tail -n 12 "$OUT/train_${CONFIG:-mixtral_like}.txt"
  ;;
tiles)
  NAMES=$(cd benchmarks && python3 fp8_gemm.py tiles --instances ${TILE_ARGS:-})
  timeout ${BUILD_LIMIT:-300} python3 -m cutlass_kernels --jobs 16 --only $NAMES > "$OUT/tiles_build.txt" 2>&1
  tail -n 2 "$OUT/tiles_build.txt"
  timeout ${TILE_LIMIT:-300} python3 benchmarks/fp8_gemm.py tiles ${TILE_ARGS:-} --json "$OUT/fp8_tiles.json" \
    > "$OUT/fp8_tiles.txt" 2>&1
  grep -v "^row " "$OUT/fp8_tiles.txt" | tail -n 40
  TE_DIST_FP8_FPROP_FAST_ACCUM=1 timeout ${TEST_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider -rfEs \
    --timeout 150 -m gpu ${TESTS:-tests/kernels/test_fp8_grouped_gpu.py} > "$OUT/fast_tests.txt" 2>&1
  tail -n 6 "$OUT/fast_tests.txt"
  ;;
fast)
  for fast in 0 1; do
    TE_DIST_FP8_FPROP_FAST_ACCUM=$fast timeout ${LAYER_LIMIT:-250} python3 benchmarks/fp8_layer.py ${LAYER_ARGS:-} \
      --json "$OUT/fp8_layer_fast$fast.json" > "$OUT/fp8_layer_fast$fast.txt" 2>&1
    tail -n 14 "$OUT/fp8_layer_fast$fast.txt"
  done
  ;;
wgrad_tile)
  for tile in rule ${WGRAD_TILE:-0}; do
    env $([ "$tile" = rule ] || echo "TE_DIST_FP8_WGRAD_TILE=$tile") timeout ${LAYER_LIMIT:-200} python3 benchmarks/fp8_layer.py \
      ${LAYER_ARGS:---configs deepseek,qwen3_235b --recipes current,block --micro-batches 1,4 --iters 4 --warmup 2} \
      --json "$OUT/fp8_layer_wgrad_$tile.json" > "$OUT/fp8_layer_wgrad_$tile.txt" 2>&1
    tail -n 14 "$OUT/fp8_layer_wgrad_$tile.txt"
  done
  ;;
copies)
  # the optimizer's FP8 weight copies (docs/quantization.md "Weight copies written by the optimizer"): their GPU
  # tests, the layer's training step with the :copies arms, then te-dist train under block and current scaling
  # without and with train.fp8_optimizer_copies (on by default; CONFIG, default deepseek_like)
  timeout ${TEST_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider -rfEs --timeout 120 -m gpu \
    tests/ops/test_optimizer_copies.py tests/ops/test_weight_copy.py > "$OUT/copies_tests.txt" 2>&1
  tail -n 3 "$OUT/copies_tests.txt"
  timeout ${LAYER_LIMIT:-300} python3 benchmarks/fp8_layer.py ${LAYER_ARGS:---configs mixtral,qwen3_30b,qwen3_235b,deepseek,gptoss \
    --recipes ${RECIPES:-delayed,block,current} --optimizer-copies --micro-batches 1,4 --iters 4 --warmup 2} \
    --json "$OUT/fp8_layer_copies.json" > "$OUT/fp8_layer_copies.txt" 2>&1
  grep -v "^row " "$OUT/fp8_layer_copies.txt" | tail -n 42
  timeout ${TRAIN_LIMIT:-400} python3 benchmarks/train.py throughput --nproc 1 --device cuda --seed 1 \
    --config launchers/configs/${CONFIG:-deepseek_like}.yaml --steps ${STEPS:-100} --fp8-dense --variants none:1 \
    block:1:train.fp8_optimizer_copies=false block:1 current:1:train.fp8_optimizer_copies=false current:1 \
    ${TRAIN_ARGS:-} --json "$OUT/train_copies.json" > "$OUT/train_copies.txt" 2>&1
  tail -n 8 "$OUT/train_copies.txt"
  ;;
switches)
  # the switches measured before they are flipped (docs/settings.md): megatron_row_padding (its test turns it
  # on itself) and fp8_pad_lean_copies (the off-grid tests with it on, then gpt-oss-like's training step off
  # against on)
  timeout ${TEST_LIMIT:-300} python3 -m pytest -q -p no:cacheprovider -rfEs --timeout 200 -m gpu \
    tests/ops/test_off_grid_native.py tests/megatron/test_gpu.py > "$OUT/switch_tests.txt" 2>&1
  TE_DIST_FP8_PAD_LEAN_COPIES=1 timeout ${TEST_LIMIT:-300} python3 -m pytest -q -p no:cacheprovider -rfEs \
    --timeout 200 -m gpu tests/ops/test_off_grid_native.py >> "$OUT/switch_tests.txt" 2>&1
  tail -n 15 "$OUT/switch_tests.txt"
  for lean in 0 1; do
    TE_DIST_FP8_PAD_LEAN_COPIES=$lean timeout ${LAYER_LIMIT:-120} python3 benchmarks/fp8_layer.py --configs gptoss \
      ${LAYER_ARGS:-} --json "$OUT/fp8_layer_lean$lean.json" > "$OUT/fp8_layer_lean$lean.txt" 2>&1
    tail -n 9 "$OUT/fp8_layer_lean$lean.txt"
  done
  ;;
head_loss)
  # fp8_head_loss (on by default): its GPU tests, the job's step on against off (in-process, interleaved), then
  # te-dist train with it on (CONFIG, STEPS as for train)
  timeout ${TEST_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider -rfEs --timeout 120 -m gpu \
    tests/cli/test_head_loss.py tests/cli/test_cross_entropy.py > "$OUT/head_loss_tests.txt" 2>&1
  tail -n 4 "$OUT/head_loss_tests.txt"
  switch_ab head_loss_switch fp8_head_loss current
  TE_DIST_FP8_HEAD_LOSS=1 timeout ${TRAIN_LIMIT:-300} python3 benchmarks/train.py throughput --nproc 1 --device cuda \
    --seed 1 --config launchers/configs/${CONFIG:-deepseek_like}.yaml --steps ${STEPS:-300} --variants none:1 current:1 \
    --fp8-dense --json "$OUT/head_loss_train.json" > "$OUT/head_loss_train.txt" 2>&1
  tail -n 6 "$OUT/head_loss_train.txt"
  ;;
lane_max)
  TE_DIST_HEAD_LOSS_LANE_MAX=1 timeout ${TEST_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider -rfEs --timeout 120 \
    -m gpu tests/cli/test_head_loss.py > "$OUT/lane_max_tests.txt" 2>&1
  tail -n 4 "$OUT/lane_max_tests.txt"
  switch_ab lane_max_switch head_loss_lane_max current
  ;;
early)
  TE_DIST_EARLY_WEIGHT_CASTS=1 timeout ${TEST_LIMIT:-150} python3 -m pytest -q -p no:cacheprovider -rfEs --timeout 120 \
    -m gpu tests/ops/test_weight_copy.py tests/moe/test_layer.py > "$OUT/early_tests.txt" 2>&1
  tail -n 4 "$OUT/early_tests.txt"
  switch_ab early_switch early_weight_casts current
  TE_DIST_EARLY_WEIGHT_CASTS=1 timeout ${IDLE_LIMIT:-150} python3 benchmarks/train.py idle \
    --config launchers/configs/${CONFIG:-deepseek_like}.yaml --json "$OUT/idle.json" > "$OUT/idle.txt" 2>&1
  grep -v Warn "$OUT/idle.txt" | cut -c1-200 | head -n 60
  ;;
block_launch)
  timeout ${TEST_LIMIT:-120} python3 -m pytest -q -p no:cacheprovider -rfEs --timeout 100 -m gpu \
    tests/quantization/test_cuda_block_cast.py > "$OUT/block_launch_tests.txt" 2>&1
  tail -n 4 "$OUT/block_launch_tests.txt"
  timeout ${CAST_LIMIT:-120} python3 benchmarks/quantize.py blocks --json "$OUT/block_launch.json" \
    > "$OUT/block_launch.txt" 2>&1
  tail -n 14 "$OUT/block_launch.txt"
  switch_ab block_launch_switch cuda_block_cast_launch block --values 0,1,2 --rounds 5 --steps 10
  ;;
wgrad_acc)
  ACC=$(python3 -c "from cutlass_kernels.fp8_block import all_fp8_instances as a; print(' '.join(i.name for i in a() if i.accumulate))")
  timeout ${BUILD_LIMIT:-300} python3 -m cutlass_kernels --jobs 16 --only $ACC > "$OUT/wgrad_acc_build.txt" 2>&1
  tail -n 2 "$OUT/wgrad_acc_build.txt"
  TE_DIST_FP8_WGRAD_ACCUMULATION=1 timeout ${TEST_LIMIT:-200} python3 -m pytest -q -p no:cacheprovider -rfEs --timeout 150 \
    -m gpu tests/kernels/test_fp8_grouped_gpu.py $(python3 -c "import megatron.core" 2>/dev/null && echo \
    tests/megatron/test_gpu.py) -k "accumulating or accumulation_fusion" > "$OUT/wgrad_acc_tests.txt" 2>&1
  tail -n 4 "$OUT/wgrad_acc_tests.txt"
  timeout ${LAYER_LIMIT:-200} python3 benchmarks/fp8_layer.py ${LAYER_ARGS:---configs mixtral,deepseek,gptoss --recipes delayed,block \
    --micro-batches 4 --iters 4 --warmup 2} --wgrad-accumulation --optimizer-copies --json "$OUT/fp8_layer_wgrad_acc.json" \
    > "$OUT/fp8_layer_wgrad_acc.txt" 2>&1
  grep -v "^row " "$OUT/fp8_layer_wgrad_acc.txt" | tail -n 27
  for acc in 0 1; do
    TE_DIST_FP8_WGRAD_ACCUMULATION=$acc timeout ${TRAIN_LIMIT:-200} python3 benchmarks/train.py throughput --nproc 1 \
      --device cuda --seed 1 --config launchers/configs/${CONFIG:-deepseek_like}.yaml --steps ${STEPS:-30} --fp8-dense \
      --variants none:1:train.micro_batches=4 block:1:train.micro_batches=4 current:1:train.micro_batches=4 \
      --json "$OUT/train_wgrad_acc$acc.json" > "$OUT/train_wgrad_acc$acc.txt" 2>&1
    tail -n 5 "$OUT/train_wgrad_acc$acc.txt"
  done
  ;;
esac
