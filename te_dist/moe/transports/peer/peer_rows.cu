// Row moves between the GPUs of one expert-parallel group through peer-mapped (symmetric) memory:
// the device side of te_dist.moe.transports.peer (rows.py; ctypes view: library.py). Plain CUDA, no
// CUTLASS: cutlass_kernels' build compiles it into the same kernel cache.
//
// Why: a variable-split all-to-all over NCCL needs its split sizes on the host, so the dispatch
// reads the exchanged counts first and the GPU idles while the host launches the token move. Here
// the counts travel to every rank on the device, each rank computes every row's destination from
// them on the device, and the rows move with no host read in between: the host reads the counts
// only to size what comes after, while the rows are already moving.
//
// Layout. Every rank holds one symmetric buffer: a counts region [R, E] int64 (row r = the counts
// rank r sends to each global expert, written by rank r) and a rows region that holds this rank's
// own rows in its send order (sorted by global expert; expert e's rows of rank r start at
// send_start_r(e) = sum over e' < e of M[r, e']). Every move is run by the receiving side of the
// dispatch, over its N received rows, which it keeps grouped by (local expert l, source rank r):
// the grouped GEMMs' order, so no sort follows. Block b = l*R + r holds M[r, e] rows (e = d*El + l),
// and its row n reads row
//     n + src_base[b],   src_base[b] = send_start_r(e) - block_start(b)
// of rank r's rows region. A pull reads the senders' regions into local rows (dispatch, and the
// combine's backward); a push writes local rows into them (combine, and the dispatch's backward).
// The senders pack their rows into their own region and read the results from there, so no move
// needs a copy into or out of a region.
//
// Ordering: every move is bracketed by a barrier over the symmetric memory's signal pads, with the
// protocol of torch's symmetric-memory barrier (put: CAS 0 -> 1 into the peer's slot for this rank;
// wait: CAS 1 -> 0 on this rank's slot for the peer), made release/acquire at system scope by
// fences; pushes end with a system fence of their own. A barrier that waits longer than its
// timeout prints the ranks and traps (an error, not a silent hang).
//
// C ABI (all launches on the given stream; return 0 or a cudaError_t, see te_pr_last_error):
//   te_pr_barrier     the barrier above
//   te_pr_plan        counts region [R, E] -> block_end [E], src_base [E] (the map above), this
//                     rank's local expert sizes (int64) and cumulative end offsets (int32); the
//                     host checks the matrix (negative counts, region size) before any move
//   te_pr_move        pull (senders' regions -> local rows) or push (local rows -> senders' regions)
//                     of this rank's N received rows; a local row is up to two contiguous column
//                     blocks (e.g. x [N, H] and the probabilities' 16-byte tail [N, 16 B])
//   te_pr_exchange    the count exchange in one kernel (barrier, counts [E] into row `me` of every
//                     rank's counts region, barrier, plan, the count matrix and a header of four
//                     numbers (exchange_kernel) into pinned host memory, then a sequence number into
//                     a pinned host flag), then records `done`, an event of te_pr_new_event. The
//                     kernel gets the host memory's device addresses (te_pr_device_address, taken
//                     once per buffer).
//   te_pr_wait_counts spins on the flag (its host address) for at most a slice of time (then returns
//                     cudaErrorNotReady: call again), querying `done` now and then to report a
//                     kernel that failed

#include <cuda_runtime.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

namespace {

thread_local char g_error[256] = "";

int record(cudaError_t err, const char* where) {
  if (err != cudaSuccess) {
    snprintf(g_error, sizeof(g_error), "%s: %s", where, cudaGetErrorString(err));
    return static_cast<int>(err);
  }
  return 0;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : : "memory");
  return t;
}

// Spins until `slot` goes from `from` to `to` (one system-scope CAS per try); past `deadline` it
// prints what it was doing and traps (an error, not a silent hang).
__device__ void swap_or_trap(uint32_t* slot, uint32_t from, uint32_t to, uint64_t deadline, const char* doing,
                             int rank, int peer, int channel) {
  while (atomicCAS_system(slot, from, to) != from) {
    if (global_timer_ns() > deadline) {
      printf("te_dist peer_rows: rank %d timed out %s rank %d (channel %d)\n", rank, doing, peer, channel);
      __trap();
    }
  }
}

// The calling block signals every peer, then waits for every peer's signal (thread t serves peers
// t, t + blockDim.x, ...). Every thread of the block calls it; it begins and ends with __syncthreads.
__device__ void block_barrier(uint32_t* const* __restrict__ pads, int channel, int rank, int world,
                              uint64_t timeout_ns) {
  __syncthreads();
  const uint64_t deadline = global_timer_ns() + timeout_ns;
  __threadfence_system();  // release: everything before this barrier, before the signals
  for (int t = threadIdx.x; t < world; t += blockDim.x) {
    if (t != rank) swap_or_trap(pads[t] + world * channel + rank, 0u, 1u, deadline, "signalling", rank, t, channel);
  }
  for (int t = threadIdx.x; t < world; t += blockDim.x) {
    if (t != rank) swap_or_trap(pads[rank] + world * channel + t, 1u, 0u, deadline, "waiting for", rank, t, channel);
  }
  __threadfence_system();  // acquire: the peers' writes before their signals, before what follows
  __syncthreads();
}

__global__ void barrier_kernel(uint32_t* const* __restrict__ pads, int channel, int rank, int world,
                               uint64_t timeout_ns) {
  block_barrier(pads, channel, rank, world, timeout_ns);
}

// The calling block writes counts [E] into row `me` of every rank's counts region.
__device__ void put_counts(const int64_t* __restrict__ counts, int E, int R, int me,
                           int64_t* const* __restrict__ peer_counts) {
  for (int i = threadIdx.x; i < R * E; i += blockDim.x) {
    int d = i / E, e = i % E;
    peer_counts[d][static_cast<int64_t>(me) * E + e] = counts[e];
  }
  __threadfence_system();
}

// Thread 0 of make_plan: block starts in (local expert, source rank) order.
__device__ void finish_plan(const int64_t* M, int R, int E, int first, int El,
                            int64_t* __restrict__ block_end, int64_t* __restrict__ src_base,
                            int64_t* __restrict__ local_sizes, int32_t* __restrict__ local_offsets) {
  int64_t end = 0, prev = 0;
  for (int l = 0; l < El; ++l) {
    for (int r = 0; r < R; ++r) {
      const int b = l * R + r;
      src_base[b] -= end;  // send_start_r(e) - block_start(b)
      end += M[static_cast<int64_t>(r) * E + first + l];
      block_end[b] = end;
    }
    local_sizes[l] = end - prev;
    local_offsets[l] = static_cast<int32_t>(end);
    prev = end;
  }
}

// One block (a multiple of 32 threads). Shared memory: R int64 (each source rank's rows before this
// rank's first expert). M is not __restrict__: in the exchange kernel the peers write it while the
// kernel runs (before its second barrier), so its loads must not go through the read-only cache.
__device__ void make_plan(const int64_t* M, int R, int E, int me, int64_t* __restrict__ block_end,
                          int64_t* __restrict__ src_base, int64_t* __restrict__ local_sizes,
                          int32_t* __restrict__ local_offsets) {
  extern __shared__ int64_t before[];
  const int El = E / R, first = me * El;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int r = warp; r < R; r += warps) {  // a warp per source rank: its rows before expert `first`
    const int64_t* row = M + static_cast<int64_t>(r) * E;
    int64_t sum = 0;
    for (int e = lane; e < first; e += 32) sum += row[e];
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, off);
    if (lane == 0) before[r] = sum;
  }
  __syncthreads();
  for (int r = threadIdx.x; r < R; r += blockDim.x) {  // send_start_r(e) of this rank's experts, per block
    int64_t start = before[r];
    for (int l = 0; l < El; ++l) {
      src_base[l * R + r] = start;
      start += M[static_cast<int64_t>(r) * E + first + l];
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) finish_plan(M, R, E, first, El, block_end, src_base, local_sizes, local_offsets);
  __syncthreads();
}

__global__ void plan_kernel(const int64_t* __restrict__ M, int R, int E, int me, int64_t* __restrict__ block_end,
                            int64_t* __restrict__ src_base, int64_t* __restrict__ local_sizes,
                            int32_t* __restrict__ local_offsets) {
  make_plan(M, R, E, me, block_end, src_base, local_sizes, local_offsets);
}

// The whole count exchange in one block: barrier | counts into row `me` of every rank's counts region
// | barrier | plan | the count matrix and a header into pinned host memory, then `seq` into the host
// flag. The host spins on the flag (te_pr_wait_counts): no copy-engine transfer and no event sit
// between the plan and the host's read, which the pull waits for. The header, host_matrix[R*E + i],
// is what the host needs before the pull, so it reads 4 numbers there instead of summing the matrix:
// [0] rows this rank sends, [1] rows it receives, [2] the most rows any rank sends, [3] the smallest
// count (negative: the in-band error flag). Shared memory: 3R int64.
__global__ void exchange_kernel(uint32_t* const* __restrict__ pads, int me, int R, uint64_t timeout_ns,
                                const int64_t* __restrict__ counts, int E, int64_t* const* __restrict__ peer_counts,
                                const int64_t* M, int64_t* __restrict__ block_end,
                                int64_t* __restrict__ src_base, int64_t* __restrict__ local_sizes,
                                int32_t* __restrict__ local_offsets, int64_t* __restrict__ host_matrix,
                                volatile int64_t* host_flag, int64_t seq) {
  extern __shared__ int64_t smem[];  // make_plan's R | rows sent per rank | smallest count per rank
  int64_t* sent = smem + R;
  int64_t* low = smem + 2 * R;
  block_barrier(pads, 0, me, R, timeout_ns);
  put_counts(counts, E, R, me, peer_counts);
  block_barrier(pads, 0, me, R, timeout_ns);
  make_plan(M, R, E, me, block_end, src_base, local_sizes, local_offsets);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  for (int r = warp; r < R; r += warps) {  // a warp per rank: its row's sum and minimum
    const int64_t* row = M + static_cast<int64_t>(r) * E;
    long long sum = 0, least = LLONG_MAX;
    for (int e = lane; e < E; e += 32) {
      const long long v = row[e];
      sum += v;
      least = v < least ? v : least;
    }
    for (int off = 16; off > 0; off >>= 1) {
      sum += __shfl_down_sync(0xffffffffu, sum, off);
      const long long other = __shfl_down_sync(0xffffffffu, least, off);
      least = other < least ? other : least;
    }
    if (lane == 0) {
      sent[r] = sum;
      low[r] = least;
    }
  }
  for (int i = threadIdx.x; i < R * E; i += blockDim.x) host_matrix[i] = M[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    int64_t most = 0, least = E > 0 ? LLONG_MAX : 0;
    for (int r = 0; r < R; ++r) {
      most = sent[r] > most ? sent[r] : most;
      least = low[r] < least ? low[r] : least;
    }
    int64_t* header = host_matrix + static_cast<int64_t>(R) * E;
    header[0] = sent[me];
    header[1] = E > 0 ? block_end[E - 1] : 0;
    header[2] = most;
    header[3] = least;
  }
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();  // the matrix and the header before the flag
    *host_flag = seq;
  }
}

// First block b with block_end[b] > row (block_end is non-decreasing and ends at N > row).
__device__ __forceinline__ int block_of_row(const int64_t* __restrict__ block_end, int blocks, int64_t row) {
  int lo = 0, hi = blocks - 1;
  while (lo < hi) {
    int mid = (lo + hi) >> 1;
    if (block_end[mid] > row) hi = mid; else lo = mid + 1;
  }
  return lo;
}

constexpr int kWarps = 16;   // warps per block; one warp moves one row at a time
constexpr int kUnroll = 4;   // 16-byte vectors in flight per lane

// Row n of this rank's N received rows: local columns [a_bytes | b_bytes] (two contiguous blocks,
// b may be empty) <-> row n + src_base[b] of the source rank's rows region (a_bytes + b_bytes wide).
template <bool kPush>
__global__ void __launch_bounds__(kWarps * 32)
move_kernel(uint8_t* __restrict__ a, int64_t a_bytes, uint8_t* __restrict__ b, int64_t b_bytes, int64_t N,
            const int64_t* __restrict__ block_end, const int64_t* __restrict__ src_base, int blocks, int R,
            uint8_t* const* __restrict__ peer_rows) {
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t va = a_bytes / 16, vecs = (a_bytes + b_bytes) / 16;
  for (int64_t row = warp; row < N; row += num_warps) {
    const int blk = block_of_row(block_end, blocks, row);
    uint4* remote = reinterpret_cast<uint4*>(peer_rows[blk % R] + (row + src_base[blk]) * (a_bytes + b_bytes));
    uint4* la = reinterpret_cast<uint4*>(a + row * a_bytes);
    uint4* lb = reinterpret_cast<uint4*>(b + row * b_bytes) - va;  // lb[v] for v >= va
    for (int64_t v0 = lane; v0 < vecs; v0 += 32 * kUnroll) {
      uint4 buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + 32 * u;
        if (v < vecs) buf[u] = kPush ? (v < va ? la[v] : lb[v]) : remote[v];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int64_t v = v0 + 32 * u;
        if (v < vecs) {
          if (kPush) remote[v] = buf[u];
          else if (v < va) la[v] = buf[u];
          else lb[v] = buf[u];
        }
      }
    }
  }
  if (kPush) __threadfence_system();
}

int launch_barrier(uint32_t* const* pads, int channel, int rank, int world, uint64_t timeout_ns,
                   cudaStream_t stream) {
  const int threads = world < 1024 ? (world + 31) / 32 * 32 : 1024;
  barrier_kernel<<<1, threads, 0, stream>>>(pads, channel, rank, world, timeout_ns);
  return record(cudaGetLastError(), "te_pr_barrier");
}

}  // namespace

extern "C" {

const char* te_pr_last_error() { return g_error; }

int te_pr_barrier(uint32_t* const* pads, int channel, int rank, int world, uint64_t timeout_ns, cudaStream_t stream) {
  return launch_barrier(pads, channel, rank, world, timeout_ns, stream);
}

int te_pr_plan(const int64_t* M, int R, int E, int me, int64_t* block_end, int64_t* src_base, int64_t* local_sizes,
               int32_t* local_offsets, cudaStream_t stream) {
  size_t smem = static_cast<size_t>(R) * sizeof(int64_t);
  if (R <= 0 || E % R != 0 || smem > 48 * 1024) {
    snprintf(g_error, sizeof(g_error), "te_pr_plan: %d experts over %d ranks (E %% R == 0 and R <= 6144 needed)", E, R);
    return static_cast<int>(cudaErrorInvalidValue);
  }
  plan_kernel<<<1, 256, smem, stream>>>(M, R, E, me, block_end, src_base, local_sizes, local_offsets);
  return record(cudaGetLastError(), "te_pr_plan");
}

int te_pr_move(int push, void* a, int64_t a_bytes, void* b, int64_t b_bytes, int64_t N, const int64_t* block_end,
               const int64_t* src_base, int blocks, int R, void* const* peer_rows, int max_blocks,
               cudaStream_t stream) {
  if (a_bytes % 16 != 0 || b_bytes % 16 != 0) {
    snprintf(g_error, sizeof(g_error), "te_pr_move: column blocks of %lld and %lld bytes (multiples of 16 needed)",
             (long long)a_bytes, (long long)b_bytes);
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (N == 0 || a_bytes + b_bytes == 0) return 0;
  int64_t want = (N + kWarps - 1) / kWarps;
  int grid = static_cast<int>(want < max_blocks ? want : max_blocks);
  auto rows = reinterpret_cast<uint8_t* const*>(peer_rows);
  auto la = static_cast<uint8_t*>(a);
  auto lb = static_cast<uint8_t*>(b);
  if (push) {
    move_kernel<true><<<grid, kWarps * 32, 0, stream>>>(la, a_bytes, lb, b_bytes, N, block_end, src_base, blocks, R, rows);
  } else {
    move_kernel<false><<<grid, kWarps * 32, 0, stream>>>(la, a_bytes, lb, b_bytes, N, block_end, src_base, blocks, R, rows);
  }
  return record(cudaGetLastError(), "te_pr_move");
}

int te_pr_exchange(uint32_t* const* pads, int rank, int world, uint64_t timeout_ns, const int64_t* counts, int E,
                   int64_t* const* peer_counts, int64_t* matrix, int64_t* block_end, int64_t* src_base,
                   int64_t* local_sizes, int32_t* local_offsets, int64_t* host_matrix, int64_t* host_flag, int64_t seq,
                   cudaEvent_t done, cudaStream_t stream) {
  // host_matrix [R*E + 4], host_flag: pinned host memory at the address the device sees (te_pr_device_address).
  const size_t smem = 3 * static_cast<size_t>(world) * sizeof(int64_t);
  if (world <= 0 || E % world != 0 || smem > 48 * 1024) {
    snprintf(g_error, sizeof(g_error), "te_pr_exchange: %d experts over %d ranks (E %% R == 0 and R <= 2048 needed)",
             E, world);
    return static_cast<int>(cudaErrorInvalidValue);
  }
  exchange_kernel<<<1, 256, smem, stream>>>(pads, rank, world, timeout_ns, counts, E, peer_counts, matrix, block_end,
                                            src_base, local_sizes, local_offsets, host_matrix, host_flag, seq);
  const int rc = record(cudaGetLastError(), "te_pr_exchange");
  if (rc) return rc;
  // Only for te_pr_wait_counts to tell a failed kernel (a barrier timeout traps) from a slow one.
  return record(cudaEventRecord(done, stream), "te_pr_exchange: event record");
}

int te_pr_device_address(void* host, void** device) {
  return record(cudaHostGetDevicePointer(device, host, 0), "te_pr_device_address: not pinned host memory");
}

int te_pr_new_event(cudaEvent_t* event) {
  return record(cudaEventCreateWithFlags(event, cudaEventDisableTiming), "te_pr_new_event");
}

int te_pr_wait_counts(const volatile int64_t* host_flag, int64_t seq, cudaEvent_t done, int64_t slice_ns) {
  timespec start{}, now{};
  clock_gettime(CLOCK_MONOTONIC, &start);
  for (uint32_t spin = 1;; ++spin) {
    if (*host_flag == seq) return 0;
    if (spin % 4096 == 0) {  // now and then: has the kernel failed, or finished without the flag?
      cudaError_t state = cudaEventQuery(done);
      if (state == cudaSuccess && *host_flag != seq) {
        snprintf(g_error, sizeof(g_error), "te_pr_wait_counts: the exchange finished but flag %lld != %lld",
                 (long long)*host_flag, (long long)seq);
        return static_cast<int>(cudaErrorUnknown);
      }
      if (state != cudaSuccess && state != cudaErrorNotReady) return record(state, "te_pr_wait_counts");
      clock_gettime(CLOCK_MONOTONIC, &now);
      if ((now.tv_sec - start.tv_sec) * 1000000000LL + (now.tv_nsec - start.tv_nsec) > slice_ns) {
        return static_cast<int>(cudaErrorNotReady);  // not yet: the caller may handle signals and call again
      }
    }
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

}  // extern "C"
