// The 1x128 block cast (Float8BlockScaling's activations and gradients) writing both copies from one read:
// each row's 1x128 blocks scaled by their own amax (out [R, C], scales [R, C/128]), and each column's
// 128x1 blocks (out_t [C, R], scales [C, R/128] or M-major [R/128 + 1, C] with a zero last row, the FP8
// wgrad kernel's layout). Semantics of triton_casts._cast_tile_kernel with G = 128 (its _block_scale):
// scale = fmt_max * (1 / amax) (reciprocal correctly rounded, +Inf -> FLT_MAX, amax 0 / Inf / NaN -> 1),
// optionally rounded down to a power of two; the stored scale is 1 / scale. A gather index makes row r
// source row idx[r] (negative: a zero row), so gathered rows are never written in bf16. Plain CUDA, no
// CUTLASS; te_dist.quantization.cuda_blocks is its ctypes view.
//
// Tiling: 128 x 128 tiles; persistent blocks of 256 threads (two per SM) walk them, the next tile copied into a
// double buffer in shared memory (cp.async) while this one is cast. Thread t reads rows 8q..8q+7 (q = t / 16)
// of column octet j = t % 16 from the buffer. The row and column amaxes reduce through shared memory (thread
// t < 128 finishes row t, t >= 128 column t - 128), then each thread writes its rowwise bytes and packs its
// columns into words for the transposed tile, whose rows go out as 128 contiguous bytes. 16-bit x only.
//
// C ABI (launch on the given stream; 0 or a cudaError_t, see te_cb_last_error):
//   te_cb_blocks(x, idx or NULL, out or NULL, row_s, out_t, col_s, R, C, dtype, fmt, fmt_max, pow2,
//                col_scales_t, launch, stream): R % 128 == 0 and C % 128 == 0 (R: the rows cast, idx's length);
//                launch 1 converts two values at a time (the same bytes, about half the instructions), launch 2
//                also takes the amaxes from 16-bit magnitude bits two at a time
//   te_cb_blocks_on_host(x, ..., R, C, dtype, fmt, ..., launch): its phases on the host, for the CPU tests.

#include "cast_fp8_common.cuh"

namespace {

constexpr int kBlk = 128;                   // block length, tile rows and tile columns
constexpr int kBlkStride = kBlk / 4 + 1;    // words of one transposed tile row, +1 against bank conflicts

struct BlockSmem {
  union {  // the partial amaxes (phases 1-2), then the transposed tile (phases 3-4): a barrier apart
    struct {
      int row_part[kBlk][17];               // [row][column octet]: the octet's amax bits (+1: banks)
      int col_part[16][kBlk];               // [row group][column]: the group's 8-row amax bits
    } amax;
    uint32_t tile_t[kBlk * kBlkStride];      // [column][word of 4 rows]
  };
  float row_mult[kBlk], col_mult[kBlk];
};

struct BlockArgs {
  const int64_t* idx;                       // the gather index or nullptr
  uint8_t* out;                             // rowwise copy or nullptr
  float* row_s;
  uint8_t* out_t;
  float* col_s;
  int64_t R, C;
  float fmt_max;
  bool pow2, col_scales_t;
};

__host__ __device__ __forceinline__ float bits_float(int bits) {
  float f;
  memcpy(&f, &bits, sizeof(f));
  return f;
}

__host__ __device__ __forceinline__ int float_bits(float f) {
  int bits;
  memcpy(&bits, &f, sizeof(bits));
  return bits;
}

// The launch that runs for a requested one: the paired conversions of launches 1 and 2 saturate at the format's
// largest finite value (E4M3 448, E5M2 57344), which is fp8_byte's clamp only where fmt_max is that value; else 0.
__host__ __device__ __forceinline__ int block_launch_for(int launch, int fmt, float fmt_max) {
  return launch >= 1 && fmt_max == (fmt == 0 ? 448.0f : 57344.0f) ? launch : 0;
}

// The multiplier of a block from its amax bits: triton_fp8_math._fp8_scale (margin 0, fallback 1).
__host__ __device__ __forceinline__ float block_mult(int amax_bits, float fmt_max, bool pow2) {
  const int bits = amax_bits & 0x7FFFFFFF;
  const bool valid = bits > 0 && bits < 0x7F800000;
  float scale = static_cast<float>(1.0 / static_cast<double>(valid ? bits_float(bits) : 1.0f)) * fmt_max;
  if (float_bits(scale) == 0x7F800000) scale = 3.4028234663852886e38f;
  if (!valid) scale = 1.0f;
  if (pow2) scale = bits_float(max(float_bits(scale), 0x00800000) & 0x7F800000);
  return scale;
}

// Where thread t's 16 bytes of row i of its patch sit: source row (negative: a zero row) and column.
__host__ __device__ __forceinline__ int64_t source_row(const BlockArgs& a, int64_t r0, int t, int i) {
  const int64_t r = r0 + 8 * (t / 16) + i;
  return a.idx == nullptr ? r : a.idx[r];
}

// The prefetch of thread t: its 8 rows x 8 columns of tile (r0, c0) into the tile buffer (x 16-bit, [R, C]),
// 16 bytes a row, zeros for a zero row. On the GPU an asynchronous copy (cp.async, completed by the caller's
// wait and barrier); on the host a plain copy.
template <typename T>
__host__ __device__ __forceinline__ void blocks_prefetch(const T* x, const BlockArgs& a, T* buf, int64_t r0,
                                                         int64_t c0, int t) {
  const int j = t % 16, q = t / 16;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t src = source_row(a, r0, t, i);
    T* dst = buf + (8 * q + i) * kBlk + 8 * j;
    const T* from = x + (src < 0 ? 0 : src) * a.C + c0 + 8 * j;
#ifdef __CUDA_ARCH__
    const unsigned dst_s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_s), "l"(from), "r"(src < 0 ? 0 : 16));
#else
    if (src < 0) memset(dst, 0, 16);
    else memcpy(dst, from, 16);
#endif
  }
}

// Phase 1 of thread t: its 8 x 8 patch from the tile buffer into raw, its row and column partial amaxes.
template <typename T>
__host__ __device__ __forceinline__ void blocks_load(const T* buf, BlockSmem& sm, int t, Raw8<T> (&raw)[8]) {
  const int j = t % 16, q = t / 16;
  int col_amax[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    raw[i].load(buf + (8 * q + i) * kBlk + 8 * j);
    float v[8];
    raw[i].get(v);
    int row_amax = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const int b = abs_bits(v[k]);
      row_amax = max(row_amax, b);
      col_amax[k] = max(col_amax[k], b);
    }
    sm.amax.row_part[8 * q + i][j] = row_amax;
  }
#pragma unroll
  for (int k = 0; k < 8; ++k) sm.amax.col_part[q][8 * j + k] = col_amax[k];
}

// Per 16-bit lane, the larger of a and b as unsigned integers (one instruction on sm_90).
__host__ __device__ __forceinline__ uint32_t max_u16x2(uint32_t a, uint32_t b) {
#ifdef __CUDA_ARCH__
  return __vmaxu2(a, b);
#else
  const uint32_t lo = max(a & 0xFFFFu, b & 0xFFFFu), hi = max(a >> 16, b >> 16);
  return lo | (hi << 16);
#endif
}

// abs_bits of the float of a 16-bit value from its magnitude bits (sign cleared). Magnitude bits order like the
// values (NaN above Inf), so the largest of them widened is abs_bits of the largest value: amax from integers.
__host__ __device__ __forceinline__ int widen_bits(uint32_t bits, __nv_bfloat16*) { return static_cast<int>(bits << 16); }
__host__ __device__ __forceinline__ int widen_bits(uint32_t bits, __half*) {
  __half_raw h;
  h.x = static_cast<unsigned short>(bits);
  return abs_bits(__half2float(__half(h)));
}

// Phase 1 as blocks_load, the amaxes from the patch's magnitude bits two lanes at a time (launch 2): an AND and an
// integer max per pair of elements and direction, no conversion to float (the same amax bits).
template <typename T>
__host__ __device__ __forceinline__ void blocks_load_packed(const T* buf, BlockSmem& sm, int t, Raw8<T> (&raw)[8]) {
  const int j = t % 16, q = t / 16;
  uint32_t col[4] = {0, 0, 0, 0};  // lanes: columns 8j + 2k (low) and 8j + 2k + 1 (high)
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    raw[i].load(buf + (8 * q + i) * kBlk + 8 * j);
    const uint32_t w[4] = {raw[i].bits.x & 0x7FFF7FFFu, raw[i].bits.y & 0x7FFF7FFFu, raw[i].bits.z & 0x7FFF7FFFu,
                           raw[i].bits.w & 0x7FFF7FFFu};
#pragma unroll
    for (int k = 0; k < 4; ++k) col[k] = max_u16x2(col[k], w[k]);
    const uint32_t r = max_u16x2(max_u16x2(w[0], w[1]), max_u16x2(w[2], w[3]));
    sm.amax.row_part[8 * q + i][j] = widen_bits(max(r & 0xFFFFu, r >> 16), static_cast<T*>(nullptr));
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    sm.amax.col_part[q][8 * j + 2 * k] = widen_bits(col[k] & 0xFFFFu, static_cast<T*>(nullptr));
    sm.amax.col_part[q][8 * j + 2 * k + 1] = widen_bits(col[k] >> 16, static_cast<T*>(nullptr));
  }
}

// Phase 2 of thread t: row t's (t < 128) or column t - 128's amax, its multiplier and its stored scale.
__host__ __device__ __forceinline__ void blocks_scale(const BlockArgs& a, BlockSmem& sm, int64_t r0, int64_t c0,
                                                      int t) {
  int amax = 0;
  if (t < kBlk) {
    for (int j = 0; j < 16; ++j) amax = max(amax, sm.amax.row_part[t][j]);
    const float mult = block_mult(amax, a.fmt_max, a.pow2);
    sm.row_mult[t] = mult;
    if (a.out != nullptr)
      a.row_s[(r0 + t) * (a.C / kBlk) + c0 / kBlk] = static_cast<float>(1.0 / static_cast<double>(mult));
  } else {
    const int c = t - kBlk;
    for (int q = 0; q < 16; ++q) amax = max(amax, sm.amax.col_part[q][c]);
    const float mult = block_mult(amax, a.fmt_max, a.pow2);
    sm.col_mult[c] = mult;
    const int64_t at = a.col_scales_t ? (r0 / kBlk) * a.C + c0 + c : (c0 + c) * (a.R / kBlk) + r0 / kBlk;
    a.col_s[at] = static_cast<float>(1.0 / static_cast<double>(mult));
    if (a.col_scales_t && r0 + kBlk == a.R) a.col_s[(a.R / kBlk) * a.C + c0 + c] = 0.0f;  // the zero row
  }
}

// The end of phase 3: thread (j, q)'s packed columns, words[k] = rows 8q..8q+7 of column 8j + k, into tile_t.
__host__ __device__ __forceinline__ void blocks_store_words(BlockSmem& sm, int j, int q,
                                                          const uint32_t (&words)[8][2]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    sm.tile_t[(8 * j + k) * kBlkStride + 2 * q] = words[k][0];
    sm.tile_t[(8 * j + k) * kBlkStride + 2 * q + 1] = words[k][1];
  }
}

// Phase 3 of thread t: its rowwise bytes (8-byte stores), its columns packed into words in tile_t.
template <typename T, __nv_fp8_interpretation_t kFmt>
__host__ __device__ __forceinline__ void blocks_store_rows(const BlockArgs& a, BlockSmem& sm, int64_t r0, int64_t c0,
                                                           int t, const Raw8<T> (&raw)[8]) {
  const int j = t % 16, q = t / 16;
  uint32_t words[8][2] = {};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float rm = sm.row_mult[8 * q + i];
    float v[8];
    raw[i].get(v);
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const uint32_t rb = fp8_byte<kFmt>(v[k], rm, a.fmt_max);
      if (k < 4) lo |= rb << (8 * k); else hi |= rb << (8 * (k - 4));
      words[k][i / 4] |= fp8_byte<kFmt>(v[k], sm.col_mult[8 * j + k], a.fmt_max) << (8 * (i % 4));
    }
    if (a.out != nullptr) *reinterpret_cast<uint2*>(a.out + (r0 + 8 * q + i) * a.C + c0 + 8 * j) = make_uint2(lo, hi);
  }
  blocks_store_words(sm, j, q, words);
}

// fp8 bytes of (a * scale, b * scale), a in the low byte, from one conversion. The conversion's saturation is
// fp8_byte's clamp where fmt_max is the format's largest finite value (block_launch_for takes this path only then);
// NaN stays NaN.
template <__nv_fp8_interpretation_t kFmt>
__host__ __device__ __forceinline__ uint32_t fp8_pair(float a, float b, float scale) {
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(a * scale, b * scale), __NV_SATFINITE, kFmt));
}

// Phase 3 as blocks_store_rows, the same bytes with half the conversions and no clamps: two columns of a row, or
// two rows of a column, in one; the rowwise bytes only where the rowwise copy is written.
template <typename T, __nv_fp8_interpretation_t kFmt>
__host__ __device__ __forceinline__ void blocks_store_rows_paired(const BlockArgs& a, BlockSmem& sm, int64_t r0,
                                                                  int64_t c0, int t, const Raw8<T> (&raw)[8]) {
  const int j = t % 16, q = t / 16;
  float col_mult[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) col_mult[k] = sm.col_mult[8 * j + k];
  uint32_t words[8][2] = {};
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    float v0[8], v1[8];
    raw[i].get(v0);
    raw[i + 1].get(v1);
    if (a.out != nullptr) {
      const float rm0 = sm.row_mult[8 * q + i], rm1 = sm.row_mult[8 * q + i + 1];
      uint32_t p0[4], p1[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        p0[k] = fp8_pair<kFmt>(v0[2 * k], v0[2 * k + 1], rm0);
        p1[k] = fp8_pair<kFmt>(v1[2 * k], v1[2 * k + 1], rm1);
      }
      uint8_t* row = a.out + (r0 + 8 * q + i) * a.C + c0 + 8 * j;
      *reinterpret_cast<uint2*>(row) = make_uint2(p0[0] | (p0[1] << 16), p0[2] | (p0[3] << 16));
      *reinterpret_cast<uint2*>(row + a.C) = make_uint2(p1[0] | (p1[1] << 16), p1[2] | (p1[3] << 16));
    }
#pragma unroll
    for (int k = 0; k < 8; ++k) words[k][i / 4] |= fp8_pair<kFmt>(v0[k], v1[k], col_mult[k]) << (8 * (i % 4));
  }
  blocks_store_words(sm, j, q, words);
}

// Phase 4 of thread t: half h of transposed row c (64 bytes = words 16h .. 16h+15).
__host__ __device__ __forceinline__ void blocks_store_cols(const BlockArgs& a, const BlockSmem& sm, int64_t r0,
                                                           int64_t c0, int t) {
  const int c = t / 2, h = t % 2;
  uint4* dst = reinterpret_cast<uint4*>(a.out_t + (c0 + c) * a.R + r0 + 64 * h);
  const uint32_t* w = sm.tile_t + c * kBlkStride + 16 * h;
#pragma unroll
  for (int i = 0; i < 4; ++i) dst[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
}

// Persistent blocks (two per SM), each walking tiles blockIdx.x, + gridDim.x, ...: while a tile is reduced and
// stored, the next one is already on its way into the other half of a shared-memory double buffer (cp.async), so
// loads and stores overlap; the four phases of a tile are a barrier apart. kLaunch (te_cb_blocks' launch:
// cuda_blocks.BLOCK_LAUNCHES, settings.cuda_block_cast_launch): 1 and 2 run phase 3 by blocks_store_rows_paired,
// 2 phase 1 by blocks_load_packed.
constexpr int kTileBytes = kBlk * kBlk * 2;  // one 16-bit tile
constexpr int kBlockSmem = 2 * kTileBytes + static_cast<int>(sizeof(BlockSmem));

template <typename T, __nv_fp8_interpretation_t kFmt, int kLaunch>
__global__ void __launch_bounds__(kThreads, 2) cast_blocks_kernel(const T* __restrict__ x, BlockArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  T* bufs = reinterpret_cast<T*>(smem);
  BlockSmem& sm = *reinterpret_cast<BlockSmem*>(smem + 2 * kTileBytes);
  const int64_t tiles_c = a.C / kBlk, tiles = (a.R / kBlk) * tiles_c;
  const int t = threadIdx.x;
  int64_t tile = blockIdx.x;
  if (tile < tiles) blocks_prefetch(x, a, bufs, (tile / tiles_c) * kBlk, (tile % tiles_c) * kBlk, t);
  asm volatile("cp.async.commit_group;\n" ::);
  for (int it = 0; tile < tiles; ++it, tile += gridDim.x) {
    const int64_t next = tile + gridDim.x;
    T* buf = bufs + (it & 1) * kBlk * kBlk;
    if (next < tiles)
      blocks_prefetch(x, a, bufs + ((it + 1) & 1) * kBlk * kBlk, (next / tiles_c) * kBlk, (next % tiles_c) * kBlk, t);
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.wait_group 1;\n" ::);  // this tile's copies landed (the next one's may be in flight)
    __syncthreads();
    const int64_t r0 = (tile / tiles_c) * kBlk, c0 = (tile % tiles_c) * kBlk;
    Raw8<T> raw[8];
    if (kLaunch == 2) blocks_load_packed(buf, sm, t, raw);
    else blocks_load(buf, sm, t, raw);
    __syncthreads();
    blocks_scale(a, sm, r0, c0, t);
    __syncthreads();
    if (kLaunch >= 1) blocks_store_rows_paired<T, kFmt>(a, sm, r0, c0, t, raw);
    else blocks_store_rows<T, kFmt>(a, sm, r0, c0, t, raw);
    __syncthreads();
    blocks_store_cols(a, sm, r0, c0, t);
    __syncthreads();  // tile_t and this buffer are free again
  }
}

constexpr int kNumBlockLaunches = 3;  // 0: blocks_store_rows; 1: blocks_store_rows_paired; 2: 1 + blocks_load_packed

template <typename T, __nv_fp8_interpretation_t kFmt, int kLaunch>
cudaError_t launch_blocks_as(const void* x, const BlockArgs& a, int sms, cudaStream_t stream) {
  auto kernel = cast_blocks_kernel<T, kFmt, kLaunch>;
  const int64_t tiles = (a.R / kBlk) * (a.C / kBlk), most = 2 * static_cast<int64_t>(sms);
  const unsigned grid = static_cast<unsigned>(tiles < most ? tiles : most);
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBlockSmem);
  if (err != cudaSuccess) return err;
  kernel<<<grid, kThreads, kBlockSmem, stream>>>(static_cast<const T*>(x), a);
  return cudaGetLastError();
}

template <typename T, __nv_fp8_interpretation_t kFmt>
cudaError_t launch_blocks_fmt(int launch, const void* x, const BlockArgs& a, int sms, cudaStream_t stream) {
  return launch == 2   ? launch_blocks_as<T, kFmt, 2>(x, a, sms, stream)
         : launch == 1 ? launch_blocks_as<T, kFmt, 1>(x, a, sms, stream)
                       : launch_blocks_as<T, kFmt, 0>(x, a, sms, stream);
}

template <typename T>
int launch_blocks(int fmt, int launch, const void* x, const BlockArgs& a, cudaStream_t stream) {
  static int sm_count[64] = {};  // per device, asked once
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess && (device < 0 || device >= 64)) err = cudaErrorInvalidDevice;
  if (err == cudaSuccess && sm_count[device] == 0)
    err = cudaDeviceGetAttribute(&sm_count[device], cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return record(err, "te_cb_blocks (device query)");
  err = fmt == 0 ? launch_blocks_fmt<T, __NV_E4M3>(launch, x, a, sm_count[device], stream)
                 : launch_blocks_fmt<T, __NV_E5M2>(launch, x, a, sm_count[device], stream);
  return record(err, "te_cb_blocks");
}

BlockArgs block_args(const void* idx, void* out, void* row_s, void* out_t, void* col_s, int64_t R, int64_t C,
                     float fmt_max, int pow2, int col_scales_t) {
  return BlockArgs{static_cast<const int64_t*>(idx), static_cast<uint8_t*>(out), static_cast<float*>(row_s),
                   static_cast<uint8_t*>(out_t), static_cast<float*>(col_s), R, C, fmt_max, pow2 != 0,
                   col_scales_t != 0};
}

// te_cb_blocks_on_host's body for one 16-bit type (launch: the one block_launch_for picked).
template <typename T>
void blocks_on_host(const T* x, const BlockArgs& a, int fmt, int launch) {
  static BlockSmem sm;
  static T buf[kBlk * kBlk];
  static Raw8<T> raw[kThreads][8];
  for (int64_t r0 = 0; r0 < a.R; r0 += kBlk) {
    for (int64_t c0 = 0; c0 < a.C; c0 += kBlk) {
      for (int t = 0; t < kThreads; ++t) blocks_prefetch(x, a, buf, r0, c0, t);
      for (int t = 0; t < kThreads; ++t) {
        if (launch == 2) blocks_load_packed(buf, sm, t, raw[t]);
        else blocks_load(buf, sm, t, raw[t]);
      }
      for (int t = 0; t < kThreads; ++t) blocks_scale(a, sm, r0, c0, t);
      for (int t = 0; t < kThreads; ++t) {
        if (launch >= 1 && fmt == 0) blocks_store_rows_paired<T, __NV_E4M3>(a, sm, r0, c0, t, raw[t]);
        else if (launch >= 1) blocks_store_rows_paired<T, __NV_E5M2>(a, sm, r0, c0, t, raw[t]);
        else if (fmt == 0) blocks_store_rows<T, __NV_E4M3>(a, sm, r0, c0, t, raw[t]);
        else blocks_store_rows<T, __NV_E5M2>(a, sm, r0, c0, t, raw[t]);
      }
      for (int t = 0; t < kThreads; ++t) blocks_store_cols(a, sm, r0, c0, t);
    }
  }
}

}  // namespace

extern "C" {

const char* te_cb_last_error() { return g_error; }

// The block kernel's four phases on the host, block by block and thread by thread, each phase over all
// threads before the next (as __syncthreads orders them): the CPU tests' check. dtype 0 bfloat16, 1 float16.
int te_cb_blocks_on_host(const void* x, const void* idx, void* out, void* row_s, void* out_t, void* col_s, int64_t R,
                         int64_t C, int dtype, int fmt, float fmt_max, int pow2, int col_scales_t, int launch) {
  if (R <= 0 || C <= 0 || R % kBlk || C % kBlk || (fmt != 0 && fmt != 1) || dtype < 0 || dtype > 1 || launch < 0 ||
      launch >= kNumBlockLaunches)
    return 1;
  const BlockArgs a = block_args(idx, out, row_s, out_t, col_s, R, C, fmt_max, pow2, col_scales_t);
  launch = block_launch_for(launch, fmt, fmt_max);
  if (dtype == 0) blocks_on_host(static_cast<const __nv_bfloat16*>(x), a, fmt, launch);
  else blocks_on_host(static_cast<const __half*>(x), a, fmt, launch);
  return 0;
}

// launch: cuda_blocks.BLOCK_LAUNCHES (1 and 2 where fmt_max is the format's largest value; else 0).
int te_cb_blocks(const void* x, const void* idx, void* out, void* row_s, void* out_t, void* col_s, int64_t R,
                 int64_t C, int dtype, int fmt, float fmt_max, int pow2, int col_scales_t, int launch,
                 cudaStream_t stream) {
  if (R <= 0 || C <= 0 || R % kBlk || C % kBlk || (fmt != 0 && fmt != 1) || dtype < 0 || dtype > 1 || launch < 0 ||
      launch >= kNumBlockLaunches) {
    snprintf(g_error, sizeof(g_error),
             "te_cb_blocks: R=%lld C=%lld dtype=%d fmt=%d launch=%d (R %% %d == 0, C %% %d == 0, dtype 0-1, fmt 0-1, "
             "launch 0-%d needed)",
             static_cast<long long>(R), static_cast<long long>(C), dtype, fmt, launch, kBlk, kBlk,
             kNumBlockLaunches - 1);
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const BlockArgs a = block_args(idx, out, row_s, out_t, col_s, R, C, fmt_max, pow2, col_scales_t);
  launch = block_launch_for(launch, fmt, fmt_max);
  return dtype == 0 ? launch_blocks<__nv_bfloat16>(fmt, launch, x, a, stream)
                    : launch_blocks<__half>(fmt, launch, x, a, stream);
}

}  // extern "C"
