// te_dist FP8 grouped GEMM for Hopper (sm_90a), CUTLASS 3.x ptr-array TMA warp-specialized kernels: block scales
// (Float8BlockScaling) with blockwise promotion, or one scale per operand (Delayed, Float8CurrentScaling) in the epilogue.
//
// Every operand arrives K-major (FP8 wgmma reads both K-major), quantized along K in blocks of 128, with float32
// dequantization scales ("scale_inv"). One source, compiled per instance (-D macros, part of the JIT cache key):
//   TE_FB_KIND 0 fwd   : y[T,N]     = x[T,K] @ w[e]^T     A = x  rowwise  [T,K]  1x128 scales [T, K/128]
//                                                          B = w  rowwise  [E,N,K] 128x128 scales [E, N/128, K/128]
//              1 dgrad : dx[T,K]    = dy[T,N] @ w[e]      A = dy rowwise  [T,N]  1x128 scales [T, N/128]
//                                                          B = w^T (the columnwise copy) [E,K,N], same 128x128 scales
//              2 wgrad : dw[e][N,K] = dy_e^T @ x_e        A = dy^T (columnwise copy) [N,T], scales [T/128, N]
//                                                          B = x^T  (columnwise copy) [K,T], scales [T/128, K]
//                                                          every group's first row a multiple of 128
//   TE_FB_A_E5M2 / TE_FB_B_E5M2: the operand is e5m2 (HYBRID gradients) instead of e4m3.
//   TE_FB_OUT_F32: fp32 output instead of bf16.
//   TE_FB_ACCUMULATE (wgrad only): d += the product, in the epilogue (C = D); empty groups leave d as it is.
//   TE_FB_TENSOR_SCALES: sfa and sfb each point at ONE float (the per-tensor scale_inv); the
//     operands' layouts are as above, and wgrad's groups need only start on a 16-row boundary.
//   TE_FB_SCHEDULE, TE_FB_TILE_{M,N}, TE_FB_CLUSTER_{M,N}: the tile (TILE_K is the scale block, 128).
//   TE_FB_EPI_N: the epilogue's sub-tile is TILE_M x EPI_N; 0: CUTLASS's pick (128 x 32 for the cooperative tiles).
//
// Accumulation: the tensor cores accumulate each 128-long K block in their FP8 accumulator; the mainloop then
// multiplies it by the two blocks' scales and adds it into an fp32 accumulator (CUTLASS's blockwise "scale promotion",
// one promotion per scale block). With tensor scales the mainloop adds the tensor cores' accumulator into the fp32 one
// at the same interval (CUTLASS's FP8 mainloop, mma_promotion_interval 4 = every 128 elements of K), unscaled;
// schedules 2 and 3 (fast accumulation, TransformerEngine's default for the forward GEMM) never promote: all of K stays
// in the tensor cores' accumulator. Epilogue (per group e): out = row_scale[row] * acc + bias[e][col]; either may be
// null. With tensor scales acc is first multiplied by alpha = sfa * sfb, a product the prepare kernel writes into the
// workspace (so the cached kernel Params, which point at it, hold across calls).
//
// The 1x128 scales of A in fwd/dgrad are read per group M-major (CUTLASS derives a group's scale layout from its own
// row count), so te_fb_run first rewrites the caller's [T, K/128] scales into one [K/128, rows_e] block per group in
// the caller's scratch buffer (T*K/128 floats).
//
// C ABI only (no torch headers). Per-group shapes, pointers and strides are written on the device from the int32
// cumulative end offsets (no host sync, CUDA-graph capturable). Empty groups are legal; wgrad writes zeros for them.
#include "grouped_launch.cuh"  // CUTLASS's headers too

// Every instance macro comes from cutlass_kernels/fp8_block.py (Fp8Instance.macros): none has a default,
// so a library is never built as an instance other than the one its name and cache key say.
#if !defined(TE_FB_KIND) || !defined(TE_FB_A_E5M2) || !defined(TE_FB_B_E5M2) || !defined(TE_FB_OUT_F32) || \
    !defined(TE_FB_TENSOR_SCALES) || !defined(TE_FB_CONFIG) || !defined(TE_FB_SCHEDULE) || !defined(TE_FB_TILE_M) || \
    !defined(TE_FB_TILE_N) || !defined(TE_FB_CLUSTER_M) || !defined(TE_FB_CLUSTER_N) || !defined(TE_FB_EPI_N) || !defined(TE_FB_ACCUMULATE)
#error "define TE_FB_{KIND,A_E5M2,B_E5M2,OUT_F32,TENSOR_SCALES,CONFIG,SCHEDULE,EPI_N,ACCUMULATE}, TE_FB_TILE_{M,N}, TE_FB_CLUSTER_{M,N}"
#endif

using namespace cute;

namespace te_fb {

constexpr int kFwd = 0, kDgrad = 1, kWgrad = 2;
constexpr int kKind = TE_FB_KIND;
constexpr bool kTensorScales = TE_FB_TENSOR_SCALES != 0;
constexpr bool kAccumulate = TE_FB_ACCUMULATE != 0;
static_assert(!kAccumulate || kKind == kWgrad, "TE_FB_ACCUMULATE: wgrad only");
constexpr int kBlock = 128;  // the recipe's scale block along K (and the 128x128 weight blocks)

using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K) per group
using ElementA = cute::conditional_t<TE_FB_A_E5M2 != 0, cutlass::float_e5m2_t, cutlass::float_e4m3_t>;
using ElementB = cute::conditional_t<TE_FB_B_E5M2 != 0, cutlass::float_e5m2_t, cutlass::float_e4m3_t>;
using ElementD = cute::conditional_t<TE_FB_OUT_F32 != 0, float, cutlass::bfloat16_t>;
using ElementAcc = float;

using LayoutA = cutlass::layout::RowMajor;     // M x K, K contiguous
using LayoutB = cutlass::layout::ColumnMajor;  // N x K, K contiguous
using LayoutD = cutlass::layout::RowMajor;
constexpr int kAlignAB = 16;  // 16 bytes of FP8
constexpr int kAlignD = 128 / cutlass::sizeof_bits<ElementD>::value;

using TileShape = Shape<Int<TE_FB_TILE_M>, Int<TE_FB_TILE_N>, Int<kBlock>>;
using ClusterShape = Shape<Int<TE_FB_CLUSTER_M>, Int<TE_FB_CLUSTER_N>, _1>;

// Scale granularity (M, N, K): A always 1 x 128; B 128 x 128 (weights) except in wgrad, where B is
// x^T with one scale per feature row and 128-token block.
constexpr int kScaleN = kKind == kWgrad ? 1 : kBlock;
using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kScaleN, kBlock>;
using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());

static_assert(TE_FB_SCHEDULE >= 0 && TE_FB_SCHEDULE <= 3, "TE_FB_SCHEDULE: 0 cooperative, 1 ping-pong, 2/3 fast");
constexpr bool kCooperative = TE_FB_SCHEDULE % 2 == 0, kFastAccum = TE_FB_SCHEDULE >= 2;
static_assert(!kFastAccum || kTensorScales, "fast accumulation is built for tensor scales only");
using TensorSchedule = cute::conditional_t<
    kFastAccum,
    cute::conditional_t<kCooperative, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8FastAccum,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8FastAccum>,
    cute::conditional_t<kCooperative, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                        cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong>>;
using BlockSchedule = cute::conditional_t<kCooperative, cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise,
                                          cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8Blockwise>;
using KernelSchedule = cute::conditional_t<kTensorScales, TensorSchedule, BlockSchedule>;
using EpilogueSchedule = cute::conditional_t<kCooperative, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
                                             cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong>;

// Tensor scales: out = fma(row_scale, alpha * acc, bias), alpha read once per CTA from the workspace.
template <class TileShape_, class ElementD_>
using TensorScaleEpilogue = cutlass::epilogue::fusion::Sm90EVT<
    cutlass::epilogue::fusion::Sm90Compute<cutlass::multiply_add, ElementD_, float,
                                           cutlass::FloatRoundStyle::round_to_nearest>,
    cutlass::epilogue::fusion::Sm90ColBroadcast<0, TileShape_, float*, float, Stride<_1, _0, _0>, 1>,
    cutlass::epilogue::fusion::Sm90EVT<
        cutlass::epilogue::fusion::Sm90Compute<cutlass::multiplies, float, float,
                                               cutlass::FloatRoundStyle::round_to_nearest>,
        cutlass::epilogue::fusion::Sm90ScalarBroadcast<float>, cutlass::epilogue::fusion::Sm90AccFetch>,
    cutlass::epilogue::fusion::Sm90RowBroadcast<0, TileShape_, float*, float, Stride<_0, _1, _0>, 4>>;

using AccumulateEpilogue = cutlass::epilogue::fusion::LinearCombination<ElementD, float, ElementD, float>;  // d += alpha*acc
using Epilogue = cute::conditional_t<kAccumulate, AccumulateEpilogue, cute::conditional_t<
    kTensorScales, TensorScaleEpilogue<TileShape, ElementD>, te_grouped::RowScaleBiasEpilogue<TileShape, ElementD>>>;
using ElementC = cute::conditional_t<kAccumulate, ElementD, void>;

// The mainloop's operand layouts: with block scales each operand's layout travels with its scales'.
using MainloopLayoutA = cute::conditional_t<kTensorScales, LayoutA*, cute::tuple<LayoutA*, LayoutSFA*>>;
using MainloopLayoutB = cute::conditional_t<kTensorScales, LayoutB*, cute::tuple<LayoutB*, LayoutSFB*>>;

using EpilogueTile = cute::conditional_t<TE_FB_EPI_N == 0, cutlass::epilogue::collective::EpilogueTileAuto,
                                         Shape<Int<TE_FB_TILE_M>, Int<TE_FB_EPI_N == 0 ? 32 : TE_FB_EPI_N>>>;
using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape, EpilogueTile, ElementAcc, float,
    ElementC, LayoutD*, kAlignD, ElementD, LayoutD*, kAlignD, EpilogueSchedule, Epilogue>::CollectiveOp;

using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
    ElementA, MainloopLayoutA, kAlignAB,
    ElementB, MainloopLayoutB, kAlignAB,
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
  size_t shapes, ptr_a, ptr_b, ptr_d, stride_a, stride_b, stride_d, ptr_sfa, ptr_sfb, layout_sfa, layout_sfb,
      ptr_scale, ptr_bias, alpha, cutlass_ws, total;
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
  l.ptr_sfa = take(e * sizeof(void*));
  l.ptr_sfb = take(e * sizeof(void*));
  l.layout_sfa = take(e * sizeof(LayoutSFA));
  l.layout_sfb = take(e * sizeof(LayoutSFB));
  l.ptr_scale = take(e * sizeof(void*));
  l.ptr_bias = take(e * sizeof(void*));
  l.alpha = take(sizeof(float));
  l.cutlass_ws = take(cutlass_bytes);
  l.total = carve.offset;
  return l;
}

struct DevicePtrs {
  UnderlyingShape* shapes;
  const ElementA** ptr_a;
  const ElementB** ptr_b;
  ElementD** ptr_d;
  StrideA* stride_a;
  StrideB* stride_b;
  StrideD* stride_d;
  const float** ptr_sfa;
  const float** ptr_sfb;
  LayoutSFA* layout_sfa;
  LayoutSFB* layout_sfb;
  const float** ptr_scale;
  const float** ptr_bias;
  float* alpha;  // tensor scales: sfa * sfb
};

static DevicePtrs device_ptrs(char* ws, const WsLayout& l, bool has_scale, bool has_bias) {
  return DevicePtrs{reinterpret_cast<UnderlyingShape*>(ws + l.shapes),
                    reinterpret_cast<const ElementA**>(ws + l.ptr_a),
                    reinterpret_cast<const ElementB**>(ws + l.ptr_b),
                    reinterpret_cast<ElementD**>(ws + l.ptr_d),
                    reinterpret_cast<StrideA*>(ws + l.stride_a),
                    reinterpret_cast<StrideB*>(ws + l.stride_b),
                    reinterpret_cast<StrideD*>(ws + l.stride_d),
                    reinterpret_cast<const float**>(ws + l.ptr_sfa),
                    reinterpret_cast<const float**>(ws + l.ptr_sfb),
                    reinterpret_cast<LayoutSFA*>(ws + l.layout_sfa),
                    reinterpret_cast<LayoutSFB*>(ws + l.layout_sfb),
                    has_scale ? reinterpret_cast<const float**>(ws + l.ptr_scale) : nullptr,
                    has_bias ? reinterpret_cast<const float**>(ws + l.ptr_bias) : nullptr,
                    reinterpret_cast<float*>(ws + l.alpha)};
}

// ----------------------------------------------------------------------------- device-side preparation

using te_grouped::group_start;

// fwd/dgrad: [T, KB] row-major scales -> one [KB, rows_e] block per group at start_e * KB.
__global__ void group_scales_kernel(const float* __restrict__ in, const int32_t* __restrict__ offsets, int num_groups,
                                    int64_t num_rows, int kb, float* __restrict__ out) {
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= num_rows * kb) return;
  int64_t t = i / kb;
  int b = static_cast<int>(i - t * kb);
  int lo = 0, hi = num_groups - 1;  // first group whose end offset exceeds t
  while (lo < hi) {
    int mid = (lo + hi) >> 1;
    if (offsets[mid] > t) hi = mid; else lo = mid + 1;
  }
  int64_t start = group_start(offsets, lo);
  int64_t rows = offsets[lo] - start;
  out[start * kb + b * rows + (t - start)] = in[i];
}

// One thread per group: shapes, pointers, strides and scale pointers from the cumulative end offsets.
// n, k are the user-level out/in features; num_rows is T (the leading dim of the wgrad operands).
__global__ void prepare_kernel(const int32_t* __restrict__ offsets, int num_groups, int n, int k, int64_t num_rows,
                               const ElementA* a, const ElementB* b, ElementD* d, const float* sfa,
                               const float* sfb, const float* scale, const float* bias, DevicePtrs p) {
  int e = blockIdx.x * blockDim.x + threadIdx.x;
  if constexpr (kTensorScales) {
    if (e == 0) *p.alpha = *sfa * *sfb;
  }
  if (e >= num_groups) return;
  int64_t start = group_start(offsets, e);
  int rows = static_cast<int>(offsets[e] - start);
  int gm, gn, gk;
  int64_t lda, ldb;
  if constexpr (kKind == kFwd) {
    gm = rows; gn = n; gk = k; lda = k; ldb = k;
    p.ptr_a[e] = a + start * k;
    p.ptr_b[e] = b + static_cast<int64_t>(e) * n * k;
    p.ptr_d[e] = d + start * n;
    p.ptr_sfa[e] = sfa + start * (k / kBlock);
    p.ptr_sfb[e] = sfb + static_cast<int64_t>(e) * (n / kBlock) * (k / kBlock);
  } else if constexpr (kKind == kDgrad) {
    gm = rows; gn = k; gk = n; lda = n; ldb = n;
    p.ptr_a[e] = a + start * n;
    p.ptr_b[e] = b + static_cast<int64_t>(e) * n * k;
    p.ptr_d[e] = d + start * k;
    p.ptr_sfa[e] = sfa + start * (n / kBlock);
    p.ptr_sfb[e] = sfb + static_cast<int64_t>(e) * (n / kBlock) * (k / kBlock);
  } else {
    // A = dy^T [N, T], B = x^T [K, T]: this group's columns start..start+rows, leading dim T.
    gm = n; gn = k; gk = rows; lda = num_rows; ldb = num_rows;
    p.ptr_a[e] = a + start;
    p.ptr_b[e] = b + start;
    p.ptr_d[e] = d + static_cast<int64_t>(e) * n * k;
    p.ptr_sfa[e] = sfa + (start / kBlock) * n;
    p.ptr_sfb[e] = sfb + (start / kBlock) * k;
    if (rows == 0) { gm = 0; gn = 0; }  // no tiles; zeros written by zero_empty_kernel
  }
  p.shapes[e] = UnderlyingShape{gm, gn, gk};
  int sm = max(gm, 1), sn = kKind == kWgrad ? k : gn, sk = max(gk, 1);
  StrideA sa = cutlass::make_cute_packed_stride(StrideA{}, make_shape(sm, sk, 1));
  StrideB sb = cutlass::make_cute_packed_stride(StrideB{}, make_shape(sn, sk, 1));
  get<0>(sa) = lda;
  get<0>(sb) = ldb;
  p.stride_a[e] = sa;
  p.stride_b[e] = sb;
  p.stride_d[e] = cutlass::make_cute_packed_stride(StrideD{}, make_shape(kKind == kWgrad ? n : sm, sn, 1));
  if constexpr (!kTensorScales) {
    p.layout_sfa[e] = ScaleConfig::tile_atom_to_shape_SFA(make_shape(gm, gn, gk, 1));
    p.layout_sfb[e] = ScaleConfig::tile_atom_to_shape_SFB(make_shape(gm, gn, gk, 1));
  }
  if (p.ptr_scale != nullptr) p.ptr_scale[e] = scale + start;
  if (p.ptr_bias != nullptr) p.ptr_bias[e] = bias + static_cast<int64_t>(e) * n;
}

static auto source_of(ElementD** d) { if constexpr (kAccumulate) return const_cast<const ElementD**>(d); else return nullptr; }

static typename Gemm::Arguments make_arguments(int num_groups, const WsLayout& l, char* ws, bool has_scale,
                                               bool has_bias, int sm_count, int device_id) {
  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = device_id;
  hw_info.sm_count = sm_count;
  DevicePtrs p = device_ptrs(ws, l, has_scale, has_bias);
#if TE_FB_ACCUMULATE  // the branches' Arguments differ in shape: a constexpr if would compile them all
  typename CollectiveEpilogue::FusionCallbacks::Arguments fusion{1.0f, 1.0f, kTensorScales ? p.alpha : nullptr};
#elif TE_FB_TENSOR_SCALES
  typename Epilogue::Arguments fusion{{p.ptr_scale, 1.0f, {}}, {{{1.0f}, {p.alpha}, {}}, {}, {}}, {p.ptr_bias, 0.0f, {}}, {}};
#else
  auto fusion = te_grouped::row_scale_bias_arguments<Epilogue>(p.ptr_scale, p.ptr_bias);
#endif
#if TE_FB_TENSOR_SCALES
  typename GemmKernel::MainloopArguments mainloop{p.ptr_a, p.stride_a, p.ptr_b, p.stride_b};
#else
  typename GemmKernel::MainloopArguments mainloop{p.ptr_a, p.stride_a, p.ptr_b, p.stride_b, p.ptr_sfa, p.layout_sfa, p.ptr_sfb,
                                            p.layout_sfb};
#endif
  return typename Gemm::Arguments{cutlass::gemm::GemmUniversalMode::kGrouped,
                                  {num_groups, p.shapes, nullptr},
                                  mainloop,
                                  {fusion, source_of(p.ptr_d), p.stride_d, p.ptr_d, p.stride_d},
                                  hw_info};
}

// Kernel Params per launch key, per host thread (te_grouped::LaunchKey says why they can be reused).
static thread_local te_grouped::PreparedLaunches<WsLayout, typename GemmKernel::Params> t_prepared;

static WsLayout layout_for(int num_groups, int sm_count, int device_id) {
  WsLayout probe = make_layout_for(num_groups, 0);
  auto args = make_arguments(num_groups, probe, reinterpret_cast<char*>(256), true, true, sm_count, device_id);
  return make_layout_for(num_groups, Gemm::get_workspace_size(args));
}

}  // namespace te_fb

extern "C" {

int te_fb_kind() { return TE_FB_KIND; }
int te_fb_config() { return TE_FB_CONFIG; }
int te_fb_formats() {
  return (TE_FB_A_E5M2 ? 1 : 0) | (TE_FB_B_E5M2 ? 2 : 0) | (TE_FB_OUT_F32 ? 4 : 0) | (TE_FB_TENSOR_SCALES ? 8 : 0) |
         (TE_FB_ACCUMULATE ? 16 : 0);
}

const char* te_fb_last_error() { return te_grouped::g_error; }

int te_fb_workspace_bytes(int num_groups, int sm_count, size_t* bytes) {
  *bytes = te_fb::layout_for(num_groups, sm_count, 0).total;
  return 0;
}

// Launch on `stream`. a/b/sfa/sfb per TE_FB_KIND (see the top of this file); `sfa_scratch` holds
// num_rows * (contraction / 128) floats for block-scaled fwd/dgrad (unused by wgrad and by tensor
// scales); n, k are the user-level out/in features and num_rows is T.
int te_fb_run(const void* a, const void* b, void* d, const float* sfa, const float* sfb, float* sfa_scratch,
              const int32_t* offsets, int num_groups, int n, int k, int64_t num_rows, const float* row_scale,
              const float* bias, void* workspace, size_t workspace_bytes, int sm_count, int device_id,
              cudaStream_t stream) {
  using namespace te_fb;
  using te_grouped::fail;
  if (num_groups <= 0) return 0;
  if (!kTensorScales && (n % kBlock != 0 || k % kBlock != 0)) return fail("te_fb_run", "N and K must be multiples of 128");
  if (n % 16 != 0 || k % 16 != 0) return fail("te_fb_run", "N and K must be multiples of 16");
  char* ws = static_cast<char*>(workspace);
  bool has_scale = row_scale != nullptr, has_bias = bias != nullptr;
  te_grouped::LaunchKey key{workspace, num_groups, sm_count, device_id, has_scale, has_bias};
  auto* prepared = t_prepared.find(key);
  WsLayout l = prepared != nullptr ? prepared->layout : layout_for(num_groups, sm_count, device_id);
  if (workspace_bytes < l.total) return fail("te_fb_run", "workspace too small");

  const float* sfa_used = sfa;
  if constexpr (kKind != kWgrad && !kTensorScales) {
    int kb = (kKind == kFwd ? k : n) / kBlock;
    int64_t total = num_rows * kb;
    if (total > 0) {
      int threads = 256;
      int64_t blocks = (total + threads - 1) / threads;
      group_scales_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(sfa, offsets, num_groups, num_rows, kb,
                                                                                 sfa_scratch);
    }
    sfa_used = sfa_scratch;
  }
  DevicePtrs p = device_ptrs(ws, l, has_scale, has_bias);
  int threads = 128, blocks = (num_groups + threads - 1) / threads;
  prepare_kernel<<<blocks, threads, 0, stream>>>(offsets, num_groups, n, k, num_rows, static_cast<const ElementA*>(a),
                                                 static_cast<const ElementB*>(b), static_cast<ElementD*>(d), sfa_used,
                                                 sfb, row_scale, bias, p);
  if constexpr (kKind == kWgrad && !kAccumulate) {
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
