// Helpers the plain CUDA FP8 casts share (cast_rowcol.cu, cast_blocks.cu; each compiles into its own library):
// the error text of the C ABI, 16-bit loads kept raw and turned into floats on demand, and the clamped FP8 byte.

#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

namespace {

constexpr int kThreads = 256;

char g_error[256] = "";

int record(cudaError_t err, const char* what) {
  if (err != cudaSuccess) snprintf(g_error, sizeof(g_error), "%s: %s", what, cudaGetErrorString(err));
  return static_cast<int>(err);
}

// Eight consecutive elements of x as float (one 16-byte load for 16-bit types, two for float).
__host__ __device__ __forceinline__ float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
__host__ __device__ __forceinline__ float2 to_float2(__half2 v) { return __half22float2(v); }

template <typename T>
struct Pair;  // the two-element vector type of a 16-bit T
template <>
struct Pair<__nv_bfloat16> { using type = __nv_bfloat162; };
template <>
struct Pair<__half> { using type = __half2; };

// Eight consecutive elements of x as loaded (one 16-byte load for 16-bit types, two for float), turned
// into floats on demand: the block cast keeps its patch this way, in half the registers.
template <typename T>
struct Raw8 {
  uint4 bits;
  __host__ __device__ __forceinline__ void load(const T* p) { bits = *reinterpret_cast<const uint4*>(p); }
  __host__ __device__ __forceinline__ void get(float* v) const {
    typename Pair<T>::type pairs[4];
    memcpy(pairs, &bits, sizeof(bits));  // register moves; a pointer cast here breaks host strict aliasing
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = to_float2(pairs[i]);
      v[2 * i] = f.x;
      v[2 * i + 1] = f.y;
    }
  }
};

template <>
struct Raw8<float> {
  float4 a, b;
  __host__ __device__ __forceinline__ void load(const float* p) {
    a = reinterpret_cast<const float4*>(p)[0];
    b = reinterpret_cast<const float4*>(p)[1];
  }
  __host__ __device__ __forceinline__ void get(float* v) const {
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
  }
};

template <typename T>
__host__ __device__ __forceinline__ void load8(const T* p, float* v) {
  Raw8<T> raw;
  raw.load(p);
  raw.get(v);
}

// fp8 byte of clamp(v * scale, -max, max); NaN stays NaN (the comparisons are false for it).
template <__nv_fp8_interpretation_t kFmt>
__host__ __device__ __forceinline__ uint32_t fp8_byte(float v, float scale, float fmt_max) {
  float y = v * scale;
  y = y > fmt_max ? fmt_max : y;
  y = y < -fmt_max ? -fmt_max : y;
  return static_cast<uint32_t>(__nv_cvt_float_to_fp8(y, __NV_SATFINITE, kFmt));
}

__host__ __device__ __forceinline__ int abs_bits(float v) {
  int bits;
  memcpy(&bits, &v, sizeof(bits));
  return bits & 0x7FFFFFFF;
}

}  // namespace
