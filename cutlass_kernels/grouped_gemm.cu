// te_dist grouped GEMM for Hopper (sm_90a): CUTLASS 3.x ptr-array, TMA, warp-specialized.
//
// One source, compiled once per instance (-D macros below are part of the JIT cache key):
//   TE_GG_KIND    0 fwd   : y[T,N]  = x[T,K] @ w[e]      (A=x row-major, B=w [E,N,K] K-major)
//                 1 dgrad : dx[T,K] = dy[T,N] @ w[e]^T   (A=dy row-major, B=w [E,N,K] as N-major)
//                 2 wgrad : dw[e][N,K] = dy_e^T @ x_e    (A=dy M-major, B=x N-major, K=rows of e)
//   TE_GG_CONFIG  config id of cutlass_kernels/heuristics.py CONFIGS (reported by te_gg_config());
//                 its schedule/tile/cluster arrive as TE_GG_SCHEDULE, TE_GG_TILE_*, TE_GG_CLUSTER_*
//   TE_GG_OUT_F32 0 bf16 out, 1 fp32 out.   Inputs bf16, accumulate fp32.
// Epilogue (fused, per group e): out = row_scale[row] * acc + bias[e][col]; either may be null.
//
// C ABI only (no torch headers): pointers, sizes and the caller's cudaStream_t. Per-group
// problem shapes / pointers / strides are written ON THE DEVICE from the int32 cumulative end
// offsets by te_gg_prepare (no host sync, CUDA-graph capturable). Experts with zero rows get a
// zero-sized problem (no tiles); wgrad writes zeros for them (their dw is defined: 0).
#include <cstring>

#include "grouped_launch.cuh"  // CUTLASS's headers too

// Every instance macro comes from cutlass_kernels/build.py (Instance.macros): none has a default, so a
// library is never built as an instance other than the one its name and cache key say.
#if !defined(TE_GG_KIND) || !defined(TE_GG_CONFIG) || !defined(TE_GG_OUT_F32) || !defined(TE_GG_SCHEDULE) || \
    !defined(TE_GG_TILE_M) || !defined(TE_GG_TILE_N) || !defined(TE_GG_TILE_K) || !defined(TE_GG_CLUSTER_M) || \
    !defined(TE_GG_CLUSTER_N)
#error "define TE_GG_{KIND,CONFIG,OUT_F32,SCHEDULE}, TE_GG_TILE_{M,N,K} and TE_GG_CLUSTER_{M,N} (build.py does)"
#endif

using namespace cute;

namespace te_gg {

constexpr int kFwd = 0, kDgrad = 1, kWgrad = 2;
constexpr int kKind = TE_GG_KIND;

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using ElementA = cutlass::bfloat16_t;
using ElementB = cutlass::bfloat16_t;
using ElementD = cute::conditional_t<TE_GG_OUT_F32 != 0, float, cutlass::bfloat16_t>;
using ElementAcc = float;

// Layout tags (CUTLASS convention: A is MxK, B is NxK, D is MxN).
using LayoutA = cute::conditional_t<kKind == kWgrad, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
using LayoutB = cute::conditional_t<kKind == kFwd, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignAB = 8;                      // 16 bytes of bf16
constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

// Tile configuration: schedule, CTA tile and cluster come from macros that
// cutlass_kernels/heuristics.py (CONFIGS) writes for config TE_GG_CONFIG, so the table lives in one
// place and a new configuration needs no edit here.
//   TE_GG_SCHEDULE 0 cooperative (two consumer warpgroups share one tile), 1 ping-pong (alternate tiles)
using TileShape = Shape<Int<TE_GG_TILE_M>, Int<TE_GG_TILE_N>, Int<TE_GG_TILE_K>>;
using ClusterShape = Shape<Int<TE_GG_CLUSTER_M>, Int<TE_GG_CLUSTER_N>, _1>;
#if TE_GG_SCHEDULE == 0
using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
#elif TE_GG_SCHEDULE == 1
using KernelSchedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
using EpilogueSchedule = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
#else
#error "TE_GG_SCHEDULE must be 0 (cooperative) or 1 (ping-pong)"
#endif

using Epilogue = te_grouped::RowScaleBiasEpilogue<TileShape, ElementD>;  // out = fma(row_scale, acc, bias)

using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
    cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, float,
    void, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD, EpilogueSchedule, Epilogue>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementA, LayoutA*, kAlignAB, ElementB, LayoutB*, kAlignAB,
    ElementAcc, TileShape, ClusterShape,
    cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
    KernelSchedule>::CollectiveOp;

using GemmKernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, CollectiveMainloop, CollectiveEpilogue>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GemmKernel>;

using StrideA = typename Gemm::GemmKernel::InternalStrideA;
using StrideB = typename Gemm::GemmKernel::InternalStrideB;
using StrideD = typename Gemm::GemmKernel::InternalStrideD;
using UnderlyingShape = typename ProblemShape::UnderlyingProblemShape;

// ----------------------------------------------------------------------------- workspace layout

struct WsLayout {
  size_t shapes, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, ptr_scale, ptr_bias, cutlass_ws, total;
};

static WsLayout make_layout_for(int num_groups, size_t cutlass_bytes) {
  WsLayout l{};
  te_grouped::WorkspaceCarver carve;
  auto take = [&](size_t bytes) { return carve.take(bytes); };
  size_t e = static_cast<size_t>(num_groups);
  l.shapes = take(e * sizeof(UnderlyingShape));
  l.ptr_a = take(e * sizeof(void*));
  l.ptr_b = take(e * sizeof(void*));
  l.ptr_d = take(e * sizeof(void*));
  l.stride_a = take(e * sizeof(StrideA));
  l.stride_b = take(e * sizeof(StrideB));
  l.stride_d = take(e * sizeof(StrideD));
  l.ptr_scale = take(e * sizeof(void*));
  l.ptr_bias = take(e * sizeof(void*));
  l.cutlass_ws = take(cutlass_bytes);
  l.total = carve.offset;
  return l;
}

// ----------------------------------------------------------------------------- device-side preparation

// One thread per group: (M, N, K), pointers and packed strides from the cumulative end offsets.
// `n` and `k` are the user-level N (out features) and K (in features).
__global__ void prepare_kernel(const int32_t* __restrict__ offsets, int num_groups, int n, int k,
                               const ElementA* a, const ElementB* b, ElementD* d, const float* scale,
                               const float* bias, UnderlyingShape* shapes, const ElementA** ptr_a,
                               const ElementB** ptr_b, ElementD** ptr_d, StrideA* stride_a, StrideB* stride_b,
                               StrideD* stride_d, const float** ptr_scale, const float** ptr_bias) {
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= num_groups) return;
  int64_t start = e == 0 ? 0 : offsets[e - 1];
  int rows = static_cast<int>(offsets[e] - start);
  int gm, gn, gk;
  if constexpr (kKind == kFwd) {
    gm = rows; gn = n; gk = k;
    ptr_a[e] = a + start * k;
    ptr_b[e] = b + static_cast<int64_t>(e) * n * k;
    ptr_d[e] = d + start * n;
  } else if constexpr (kKind == kDgrad) {
    gm = rows; gn = k; gk = n;
    ptr_a[e] = a + start * n;
    ptr_b[e] = b + static_cast<int64_t>(e) * n * k;
    ptr_d[e] = d + start * k;
  } else {
    // a = dy [T, N] read as M-major (M = N); b = x [T, K] read as N-major; K of the GEMM = rows.
    gm = n; gn = k; gk = rows;
    ptr_a[e] = a + start * n;
    ptr_b[e] = b + start * k;
    ptr_d[e] = d + static_cast<int64_t>(e) * n * k;
    if (rows == 0) { gm = 0; gn = 0; }  // no tiles; zeros written by zero_empty_kernel
  }
  if (rows == 0 && kKind != kWgrad) { gm = 0; }
  shapes[e] = UnderlyingShape{gm, gn, gk};
  // Packed strides use the full (non-empty) extents so TMA descriptors stay valid.
  int sm = kKind == kWgrad ? n : max(gm, 1);
  int sn = kKind == kWgrad ? k : gn;
  int sk = max(gk, 1);
  stride_a[e] = cutlass::make_cute_packed_stride(StrideA{}, make_shape(sm, sk, 1));
  stride_b[e] = cutlass::make_cute_packed_stride(StrideB{}, make_shape(sn, sk, 1));
  stride_d[e] = cutlass::make_cute_packed_stride(StrideD{}, make_shape(sm, sn, 1));
  if (ptr_scale != nullptr) ptr_scale[e] = scale + start;
  if (ptr_bias != nullptr) ptr_bias[e] = bias + static_cast<int64_t>(e) * n;
}

static typename Gemm::Arguments make_arguments(int num_groups, const WsLayout& l, char* ws, bool has_scale,
                                               bool has_bias, int sm_count, int device_id) {
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = device_id;
  hw_info.sm_count = sm_count;
  auto fusion = te_grouped::row_scale_bias_arguments<Epilogue>(
      has_scale ? reinterpret_cast<const float* const*>(ws + l.ptr_scale) : nullptr,
      has_bias ? reinterpret_cast<const float* const*>(ws + l.ptr_bias) : nullptr);
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {num_groups, reinterpret_cast<UnderlyingShape*>(ws + l.shapes), nullptr},
      {reinterpret_cast<const ElementA**>(ws + l.ptr_a), reinterpret_cast<StrideA*>(ws + l.stride_a),
       reinterpret_cast<const ElementB**>(ws + l.ptr_b), reinterpret_cast<StrideB*>(ws + l.stride_b)},
      {fusion, nullptr, reinterpret_cast<StrideD*>(ws + l.stride_d), reinterpret_cast<ElementD**>(ws + l.ptr_d),
       reinterpret_cast<StrideD*>(ws + l.stride_d)},
      hw_info};
  return args;
}

// Kernel Params per launch key, per host thread (te_grouped::LaunchKey says why they can be reused).
static thread_local te_grouped::PreparedLaunches<WsLayout, typename GemmKernel::Params> t_prepared;

// The workspace layout of a call: CUTLASS sizes its own part from Arguments that point into the layout,
// so a probe layout without that part comes first.
static WsLayout layout_for(int num_groups, int sm_count, int device_id) {
  WsLayout probe = make_layout_for(num_groups, 0);
  auto args = make_arguments(num_groups, probe, reinterpret_cast<char*>(256), true, true, sm_count, device_id);
  return make_layout_for(num_groups, Gemm::get_workspace_size(args));
}

}  // namespace te_gg

extern "C" {

// Which instance this library is (lets the loader check it loaded what it asked for).
int te_gg_kind() { return TE_GG_KIND; }
int te_gg_config() { return TE_GG_CONFIG; }
int te_gg_out_f32() { return TE_GG_OUT_F32; }

const char* te_gg_last_error() { return te_grouped::g_error; }

// Bytes of device workspace te_gg_run needs for `num_groups` groups on a GPU with `sm_count` SMs.
int te_gg_workspace_bytes(int num_groups, int sm_count, size_t* bytes) {
  *bytes = te_gg::layout_for(num_groups, sm_count, 0).total;
  return 0;
}

// Launch on `stream`: prepare per-group arguments on the device, then the grouped GEMM.
// a/b/d per TE_GG_KIND (see top of file); n, k are the user-level out/in features.
int te_gg_run(const void* a, const void* b, void* d, const int32_t* offsets, int num_groups, int n, int k,
              const float* row_scale, const float* bias, void* workspace, size_t workspace_bytes, int sm_count,
              int device_id, cudaStream_t stream) {
  using namespace te_gg;
  using te_grouped::fail;
  if (num_groups <= 0) return 0;
  char* ws = static_cast<char*>(workspace);
  bool has_scale = row_scale != nullptr, has_bias = bias != nullptr;
  te_grouped::LaunchKey key{workspace, num_groups, sm_count, device_id, has_scale, has_bias};
  auto* prepared = t_prepared.find(key);
  WsLayout l = prepared != nullptr ? prepared->layout : layout_for(num_groups, sm_count, device_id);
  if (workspace_bytes < l.total) return fail("te_gg_run", "workspace too small");

  int threads = 128, blocks = (num_groups + threads - 1) / threads;
  prepare_kernel<<<blocks, threads, 0, stream>>>(
      offsets, num_groups, n, k, static_cast<const ElementA*>(a), static_cast<const ElementB*>(b),
      static_cast<ElementD*>(d), row_scale, bias, reinterpret_cast<UnderlyingShape*>(ws + l.shapes),
      reinterpret_cast<const ElementA**>(ws + l.ptr_a), reinterpret_cast<const ElementB**>(ws + l.ptr_b),
      reinterpret_cast<ElementD**>(ws + l.ptr_d), reinterpret_cast<StrideA*>(ws + l.stride_a),
      reinterpret_cast<StrideB*>(ws + l.stride_b), reinterpret_cast<StrideD*>(ws + l.stride_d),
      has_scale ? reinterpret_cast<const float**>(ws + l.ptr_scale) : nullptr,
      has_bias ? reinterpret_cast<const float**>(ws + l.ptr_bias) : nullptr);
  if constexpr (kKind == kWgrad) {
    int64_t vec16 = static_cast<int64_t>(n) * k * sizeof(ElementD) / 16;
    te_grouped::zero_empty_kernel<<<dim3(num_groups, 16), 256, 0, stream>>>(offsets, vec16, static_cast<uint4*>(d));
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return fail("prepare launch", cudaGetErrorString(err));

  return te_grouped::launch_grouped<Gemm>(
      t_prepared, prepared, key, l, ws + l.cutlass_ws,
      [&] { return make_arguments(num_groups, l, ws, has_scale, has_bias, sm_count, device_id); }, stream);
}

}  // extern "C"
