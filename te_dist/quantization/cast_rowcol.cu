// The per-tensor FP8 cast of a stack of matrices writing both GEMM layouts from one read of x:
// out [B, R, C] (rowwise) and out_t [B, C, R] (each matrix transposed: a grouped weight's dgrad
// operand). Plain CUDA, no CUTLASS; te_dist.quantization.cuda_rowcol is its ctypes view.
//
// Why: a per-tensor weight cast that writes the rowwise copy and then transposes it moves
// 2 + 1 + 1 + 1 bytes per element; one read writing both moves 2 + 1 + 1.
//
// Semantics (those of triton_casts._cast_per_tensor_kernel, bit for bit): y = fp8(clamp(x * scale,
// -max, max)) with NaN kept (fp32 multiply, round to nearest even), scale read from device memory;
// optionally amax(x) as the int32 bits of |x| (NaN above Inf) merged into *amax_bits by atomicMax
// (one per block, where the block's amax exceeds the value read).
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
//   te_cr_cast_on_host(x, out, out_t, scale, amax_bits or NULL, B, R, C, fmt, fmt_max): the same two
//   phases on the host, for the CPU tests (bfloat16 x; host pointers; no CUDA call).

#include "cast_fp8_common.cuh"

namespace {

constexpr int kTileRows = 64;
constexpr int kTileCols = 128;
constexpr int kWordsPerCol = kTileRows / 4;      // words of one transposed row within a tile
constexpr int kSmemStride = kWordsPerCol + 1;    // +1 word: column writes spread over the banks

// Where block (b, r0, c0) sits: matrix b, rows r0.., columns c0.. of it.
struct Tile {
  int64_t b, r0, c0;
};

__host__ __device__ __forceinline__ Tile tile_of(int64_t block_x, int64_t block_y, int64_t R) {
  const int64_t tiles_r = R / kTileRows;
  const int64_t b = block_x / tiles_r;
  return Tile{b, (block_x - b * tiles_r) * kTileRows, block_y * kTileCols};
}

// Phase 1 of thread t: its 4 x 8 patch (octet j of the tile's columns, quad q of its rows) cast and
// stored rowwise, its columns packed into words in tile_t; returns the patch's amax bits.
template <typename T, __nv_fp8_interpretation_t kFmt>
__host__ __device__ __forceinline__ int cast_patch(const T* x, uint8_t* out, uint32_t* tile_t, float scale,
                                                   float fmt_max, int64_t R, int64_t C, Tile tile, int t) {
  const int j = t % (kTileCols / 8);
  const int q = t / (kTileCols / 8);
  const int64_t base = tile.b * R * C;
  uint32_t words[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int amax = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t offset = base + (tile.r0 + 4 * q + i) * C + tile.c0 + 8 * j;
    float v[8];
    load8(x + offset, v);
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t byte = fp8_byte<kFmt>(v[k], scale, fmt_max);
      if (k < 4) lo |= byte << (8 * k); else hi |= byte << (8 * (k - 4));
      words[k] |= byte << (8 * i);
      amax = max(amax, abs_bits(v[k]));
    }
    *reinterpret_cast<uint2*>(out + offset) = make_uint2(lo, hi);
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) tile_t[(8 * j + k) * kSmemStride + q] = words[k];
  return amax;
}

// Phase 2 of thread t: half h of transposed row c (32 bytes = words 8h .. 8h+7) from tile_t.
__host__ __device__ __forceinline__ void store_transposed(uint8_t* out_t, const uint32_t* tile_t, int64_t R,
                                                          int64_t C, Tile tile, int t) {
  const int c = t / 2;
  const int h = t % 2;
  uint32_t w[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = tile_t[c * kSmemStride + 8 * h + i];
  uint4* dst = reinterpret_cast<uint4*>(out_t + tile.b * C * R + (tile.c0 + c) * R + tile.r0 + 32 * h);
  dst[0] = make_uint4(w[0], w[1], w[2], w[3]);
  dst[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

template <typename T, __nv_fp8_interpretation_t kFmt, bool kAmax>
__global__ void __launch_bounds__(kThreads) cast_rowcol_kernel(const T* __restrict__ x, uint8_t* __restrict__ out,
                                                                 uint8_t* __restrict__ out_t,
                                                                 const float* __restrict__ scale_ptr,
                                                                 int* __restrict__ amax_bits, int64_t R, int64_t C,
                                                                 float fmt_max) {
  __shared__ uint32_t tile_t[kTileCols * kSmemStride];  // [column][word of 4 rows]
  __shared__ int warp_amax[kThreads / 32];
  const Tile tile = tile_of(blockIdx.x, blockIdx.y, R);
  const int amax = cast_patch<T, kFmt>(x, out, tile_t, *scale_ptr, fmt_max, R, C, tile, threadIdx.x);
  if (kAmax) {
    const unsigned w = __reduce_max_sync(0xFFFFFFFFu, static_cast<unsigned>(amax));
    if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = static_cast<int>(w);
  }
  __syncthreads();
  if (kAmax && threadIdx.x == 0) {
    // One atomic per block at most, and only when it raises the value read: atomics on one address
    // serialize, reads do not. The value only grows, so a stale read costs an extra atomic, never a
    // missed one.
    int block_amax = warp_amax[0];
#pragma unroll
    for (int i = 1; i < kThreads / 32; ++i) block_amax = max(block_amax, warp_amax[i]);
    if (block_amax > __ldcg(amax_bits)) atomicMax(amax_bits, block_amax);
  }
  store_transposed(out_t, tile_t, R, C, tile, threadIdx.x);
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

// The kernel's two phases run on the host, block by block and thread by thread (a block's phase 2
// after all of its phase 1, as __syncthreads orders them): what the CPU tests check the tiling,
// packing and layouts with. bfloat16 x only; amax_bits as in te_cr_cast (or NULL).
int te_cr_cast_on_host(const void* x, void* out, void* out_t, float scale, int* amax_bits, int64_t B, int64_t R,
                       int64_t C, int fmt, float fmt_max) {
  if (B <= 0 || R <= 0 || C <= 0 || R % kTileRows || C % kTileCols || (fmt != 0 && fmt != 1)) return 1;
  static uint32_t tile_t[kTileCols * kSmemStride];
  const __nv_bfloat16* xt = static_cast<const __nv_bfloat16*>(x);
  for (int64_t bx = 0; bx < B * (R / kTileRows); ++bx) {
    for (int64_t by = 0; by < C / kTileCols; ++by) {
      const Tile tile = tile_of(bx, by, R);
      for (int t = 0; t < kThreads; ++t) {
        const int amax = fmt == 0
            ? cast_patch<__nv_bfloat16, __NV_E4M3>(xt, static_cast<uint8_t*>(out), tile_t, scale, fmt_max, R, C, tile, t)
            : cast_patch<__nv_bfloat16, __NV_E5M2>(xt, static_cast<uint8_t*>(out), tile_t, scale, fmt_max, R, C, tile, t);
        if (amax_bits != nullptr && amax > *amax_bits) *amax_bits = amax;
      }
      for (int t = 0; t < kThreads; ++t) store_transposed(static_cast<uint8_t*>(out_t), tile_t, R, C, tile, t);
    }
  }
  return 0;
}

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
