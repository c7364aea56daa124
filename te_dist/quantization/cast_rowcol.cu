// The per-tensor FP8 cast of a stack of matrices writing both GEMM layouts from one read of x:
// out [B, R, C] (rowwise) and out_t [B, C, R] (each matrix transposed: a grouped weight's dgrad
// operand). Plain CUDA, no CUTLASS; te_dist.quantization.cuda_rowcol is its ctypes view.
//
// Why: a per-tensor weight cast that writes the rowwise copy and then transposes it moves
// 2 + 1 + 1 + 1 bytes per element; one read writing both moves 2 + 1 + 1.
//
// Semantics (those of triton_casts._cast_per_tensor_kernel, bit for bit): y = fp8(clamp(x * scale,
// -max, max)) with NaN kept (fp32 multiply, round to nearest even), scale read from device memory;
// optionally amax(x) as the int32 bits of |x| (NaN above Inf) merged into *amax_bits by atomicMax.
//
// Tiling: a block of 256 threads owns 64 rows x 128 columns of one matrix. Thread t loads a patch
// of 4 rows x 8 columns (four 16-byte loads of bf16), stores its four 8-byte rowwise pieces, and
// packs the patch column by column into 8 words (the byte of row 4q+i at bit 8i): the transposed
// tile goes through shared memory as whole words only. Then each thread writes 32 bytes (8 words)
// of one transposed row. Needs R % 64 == 0 and C % 128 == 0 (the host checks; other shapes take
// the Triton path).
//
// C ABI (launch on the given stream; 0 or a cudaError_t, see te_cr_last_error):
//   te_cr_cast(x, out, out_t, scale, amax_bits or NULL, B, R, C, fmt, fmt_max, stream)
//   fmt: 0 = E4M3, 1 = E5M2. x is bfloat16 (dtype 0) or float16 (dtype 1) or float32 (dtype 2).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

namespace {

constexpr int kTileRows = 64;
constexpr int kTileCols = 128;
constexpr int kThreads = 256;
constexpr int kWordsPerCol = kTileRows / 4;      // words of one transposed row within a tile
constexpr int kSmemStride = kWordsPerCol + 1;    // +1 word: column writes spread over the banks

char g_error[256] = "";

int record(cudaError_t err, const char* what) {
  if (err != cudaSuccess) snprintf(g_error, sizeof(g_error), "%s: %s", what, cudaGetErrorString(err));
  return static_cast<int>(err);
}

// Eight consecutive elements of x as float (one 16-byte load for 16-bit types, two for float).
__device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }

template <typename T>
struct Pair;  // the two-element vector type of a 16-bit T
template <>
struct Pair<__nv_bfloat16> { using type = __nv_bfloat162; };
template <>
struct Pair<__half> { using type = __half2; };

template <typename T>
__device__ __forceinline__ void load8(const T* p, float* v) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const auto* pairs = reinterpret_cast<const typename Pair<T>::type*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = to_float2(pairs[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

__device__ __forceinline__ void load8(const float* p, float* v) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
  v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// fp8 byte of clamp(v * scale, -max, max); NaN stays NaN (the comparisons are false for it).
template <__nv_fp8_interpretation_t kFmt>
__device__ __forceinline__ uint32_t fp8_byte(float v, float scale, float fmt_max) {
  float y = v * scale;
  y = y > fmt_max ? fmt_max : y;
  y = y < -fmt_max ? -fmt_max : y;
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, kFmt));
}

template <typename T, __nv_fp8_interpretation_t kFmt, bool kAmax>
__global__ void __launch_bounds__(kThreads) cast_rowcol_kernel(const T* __restrict__ x, uint8_t* __restrict__ out,
                                                                 uint8_t* __restrict__ out_t,
                                                                 const float* __restrict__ scale_ptr,
                                                                 int* __restrict__ amax_bits, int64_t R, int64_t C,
                                                                 float fmt_max) {
  __shared__ uint32_t tile_t[kTileCols * kSmemStride];  // [column][word of 4 rows]
  const int64_t tiles_r = R / kTileRows;
  const int64_t b = blockIdx.x / tiles_r;
  const int64_t r0 = (blockIdx.x - b * tiles_r) * kTileRows;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTileCols;
  const float scale = *scale_ptr;
  const int t = threadIdx.x;

  // Phase 1: a 4 x 8 patch per thread; octet j of the tile's columns, quad q of its rows.
  const int j = t % (kTileCols / 8);
  const int q = t / (kTileCols / 8);
  const int64_t base = b * R * C;
  uint32_t words[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int amax = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t offset = base + (r0 + 4 * q + i) * C + c0 + 8 * j;
    float v[8];
    load8(x + offset, v);
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t byte = fp8_byte<kFmt>(v[k], scale, fmt_max);
      if (k < 4) lo |= byte << (8 * k); else hi |= byte << (8 * (k - 4));
      words[k] |= byte << (8 * i);
      if (kAmax) amax = max(amax, __float_as_int(v[k]) & 0x7FFFFFFF);
    }
    *reinterpret_cast<uint2*>(out + offset) = make_uint2(lo, hi);
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) tile_t[(8 * j + k) * kSmemStride + q] = words[k];
  if (kAmax) {
    amax = __reduce_max_sync(0xFFFFFFFFu, static_cast<unsigned>(amax));
    if ((t & 31) == 0) atomicMax(amax_bits, amax);
  }
  __syncthreads();

  // Phase 2: thread t writes half h of transposed row c (32 bytes = words 8h .. 8h+7).
  const int c = t / 2;
  const int h = t % 2;
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = tile_t[c * kSmemStride + 8 * h + i];
  uint4* dst = reinterpret_cast<uint4*>(out_t + b * C * R + (c0 + c) * R + r0 + 32 * h);
  dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
  dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

template <typename T, __nv_fp8_interpretation_t kFmt>
int launch(const void* x, void* out, void* out_t, const float* scale, int* amax_bits, int64_t B, int64_t R,
           int64_t C, float fmt_max, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(B * (R / kTileRows)), static_cast<unsigned>(C / kTileCols));
  const T* xt = static_cast<const T*>(x);
  uint8_t* o = static_cast<uint8_t*>(out);
  uint8_t* ot = static_cast<uint8_t*>(out_t);
  if (amax_bits != nullptr)
    cast_rowcol_kernel<T, kFmt, true><<<grid, kThreads, 0, stream>>>(xt, o, ot, scale, amax_bits, R, C, fmt_max);
  else
    cast_rowcol_kernel<T, kFmt, false><<<grid, kThreads, 0, stream>>>(xt, o, ot, scale, amax_bits, R, C, fmt_max);
  return record(cudaGetLastError(), "te_cr_cast");
}

template <typename T>
int launch_fmt(int fmt, const void* x, void* out, void* out_t, const float* scale, int* amax_bits, int64_t B,
               int64_t R, int64_t C, float fmt_max, cudaStream_t stream) {
  if (fmt == 0) return launch<T, __NV_E4M3>(x, out, out_t, scale, amax_bits, B, R, C, fmt_max, stream);
  return launch<T, __NV_E5M2>(x, out, out_t, scale, amax_bits, B, R, C, fmt_max, stream);
}

}  // namespace

extern "C" {

const char* te_cr_last_error() { return g_error; }

int te_cr_cast(const void* x, void* out, void* out_t, const float* scale, int* amax_bits, int64_t B, int64_t R,
               int64_t C, int dtype, int fmt, float fmt_max, cudaStream_t stream) {
  if (B <= 0 || R <= 0 || C <= 0 || R % kTileRows || C % kTileCols || (fmt != 0 && fmt != 1) || dtype < 0 ||
      dtype > 2 || B * (R / kTileRows) > 0x7FFFFFFF || C / kTileCols > 65535) {
    snprintf(g_error, sizeof(g_error),
             "te_cr_cast: B=%lld R=%lld C=%lld dtype=%d fmt=%d (R %% %d == 0, C %% %d == 0, dtype 0-2, fmt 0-1 needed)",
             static_cast<long long>(B), static_cast<long long>(R), static_cast<long long>(C), dtype, fmt, kTileRows,
             kTileCols);
    return static_cast<int>(cudaErrorInvalidValue);
  }
  switch (dtype) {
    case 0: return launch_fmt<__nv_bfloat16>(fmt, x, out, out_t, scale, amax_bits, B, R, C, fmt_max, stream);
    case 1: return launch_fmt<__half>(fmt, x, out, out_t, scale, amax_bits, B, R, C, fmt_max, stream);
    default: return launch_fmt<float>(fmt, x, out, out_t, scale, amax_bits, B, R, C, fmt_max, stream);
  }
}

}  // extern "C"
