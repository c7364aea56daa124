// What the two grouped GEMM sources share (grouped_gemm.cu: bf16; fp8_block_gemm.cu: block-scaled
// FP8): the row-scale + bias epilogue, the workspace carving, the empty-expert zeroing of wgrad,
// the thread-local error text of the C ABI, and the cache of CUTLASS kernel Params per launch key.
// Why one header: these pieces must behave alike in both libraries (the Python side reads their
// errors and sizes their workspaces the same way); a fix in one copy used to miss the other.
// Part of every instance's cache key (cutlass_kernels/build.py SHARED_HEADERS).
#pragma once

#include <cuda_runtime.h>
#include <cstdint>
#include <cstdio>

#include "cute/tensor.hpp"  // every CUTLASS header the two sources read
#include "cutlass/cutlass.h"
#include "cutlass/functional.h"
#include "cutlass/numeric_types.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/util/packed_stride.hpp"

namespace te_grouped {

// Sub-ranges of one device workspace, each 256-byte aligned, handed out in order.
struct WorkspaceCarver {
  size_t offset = 0;
  size_t take(size_t bytes) {
    size_t at = offset;
    offset = (offset + bytes + 255) / 256 * 256;
    return at;
  }
};

__device__ __forceinline__ int64_t group_start(const int32_t* offsets, int e) { return e == 0 ? 0 : offsets[e - 1]; }

// wgrad only: dw[e] = 0 for experts without rows (grid.x = group, grid.y strides the block).
__global__ void zero_empty_kernel(const int32_t* __restrict__ offsets, int64_t group_vec16, uint4* dw) {
  int e = blockIdx.x;
  if (offsets[e] != group_start(offsets, e)) return;
  uint4* base = dw + static_cast<int64_t>(e) * group_vec16;
  for (int64_t i = blockIdx.y * blockDim.x + threadIdx.x; i < group_vec16; i += int64_t(gridDim.y) * blockDim.x) {
    base[i] = make_uint4(0, 0, 0, 0);
  }
}

// out = fma(row_scale[row], acc, bias[e][col]): per-row (M) scale, per-column (N) bias, one pointer
// per group; a null pointer array means scale 1 / bias 0. Alignment 1 for the scale: a group's first
// row can start anywhere.
template <class TileShape, class ElementD>
using RowScaleBiasEpilogue = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::multiply_add, ElementD, float,
                                           cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape, float*, float, cute::Stride<cute::_1, cute::_0, cute::_0>, 1>,
    cutlass::epilogue::fusion::Sm90AccFetch,
    cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape, float*, float, cute::Stride<cute::_0, cute::_1, cute::_0>, 4>>;

template <class Epilogue>
typename Epilogue::Arguments row_scale_bias_arguments(const float* const* scale, const float* const* bias) {
  return typename Epilogue::Arguments{{scale, 1.0f, {}}, {}, {bias, 0.0f, {}}, {}};
}

// The C ABI's last error, per host thread (te_*_last_error returns it).
static thread_local char g_error[512] = {0};

static int fail(const char* what, const char* detail) {
  snprintf(g_error, sizeof(g_error), "%s: %s", what, detail);
  return 1;
}

// CUTLASS's initialize() turns the Arguments into kernel Params (TMA descriptors encoded on the
// host, the scheduler's grid, a cudaFuncSetAttribute call). Our Arguments hold nothing but the
// workspace's sub-pointers, the group count, whether scale/bias are present and the SM count: the
// same key gives the same Params, and the per-call data (operand pointers, group sizes) reaches
// the kernel through the device arrays the prepare kernel writes. So a call whose key matches an
// earlier one launches with that call's Params. The caching allocator hands the workspace back at
// the same address call after call, so the key repeats in a training step.
struct LaunchKey {
  const void* workspace;
  int num_groups, sm_count, device_id;
  bool has_scale, has_bias;
  bool operator==(const LaunchKey& o) const {
    return workspace == o.workspace && num_groups == o.num_groups && sm_count == o.sm_count &&
           device_id == o.device_id && has_scale == o.has_scale && has_bias == o.has_bias;
  }
};

template <class Layout, class Params>
struct PreparedLaunches {
  struct Slot {
    LaunchKey key{};
    bool valid = false;
    Layout layout{};
    Params params{};
  };
  static constexpr int kSlots = 8;  // distinct (workspace, groups, scale/bias) keys of one step, with room
  Slot slots[kSlots];
  int next = 0;

  Slot* find(const LaunchKey& key) {
    for (auto& slot : slots) {
      if (slot.valid && slot.key == key) return &slot;
    }
    return nullptr;
  }
};

// The tail of every te_*_run: on a key's first call CUTLASS checks and builds the Params from
// make_args() (the cutlass part of the workspace at cutlass_ws); every call then launches them.
template <class Gemm, class Launches, class Layout, class MakeArgs>
int launch_grouped(Launches& launches, typename Launches::Slot* prepared, const LaunchKey& key, const Layout& layout,
                   void* cutlass_ws, MakeArgs make_args, cudaStream_t stream) {
  if (prepared == nullptr) {
    auto args = make_args();
    Gemm gemm;
    cutlass::Status st = gemm.can_implement(args);
    if (st != cutlass::Status::kSuccess) return fail("can_implement", cutlassGetStatusString(st));
    st = gemm.initialize(args, cutlass_ws, stream);
    if (st != cutlass::Status::kSuccess) return fail("initialize", cutlassGetStatusString(st));
    prepared = &launches.slots[launches.next];
    launches.next = (launches.next + 1) % Launches::kSlots;
    prepared->key = key;
    prepared->layout = layout;
    prepared->params = gemm.params();
    prepared->valid = true;
  }
  cutlass::Status st = Gemm::run(prepared->params, stream);
  if (st != cutlass::Status::kSuccess) return fail("run", cutlassGetStatusString(st));
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return fail("gemm launch", cudaGetErrorString(err));
  return 0;
}

}  // namespace te_grouped
