// Row moves between the GPUs of one expert-parallel group through peer-mapped (symmetric) memory:
// the device-side transport of te_dist.distributed.peer_rows. Plain CUDA, no CUTLASS.
//
// Why: a variable-split all-to-all over NCCL needs its split sizes on the host, so the dispatch
// reads the exchanged counts first and the GPU idles while the host launches the token move. Here
// the counts travel to every rank on the device, each rank computes every row's destination from
// them on the device, and the rows move with no host read in between: the host reads the counts
// only to size what comes after, while the rows are already moving.
//
// Layout. Every rank holds one symmetric buffer: a counts region [R, E] int64 (row r = the counts
// rank r sends to each global expert, written by rank r) and a rows region. Rank d receives its
// rows grouped by (local expert, source rank): rows of local expert l from rank r start at
//     base_d(l) + prefix_r(e),   e = d*El + l,
//     base_d(l)   = sum over local experts l' < l of d, over all ranks r', of M[r', d*El + l'],
//     prefix_r(e) = sum over ranks r' < r of M[r', e],
// which is the order the grouped GEMMs need, so no sort by local expert follows the move. Row i of
// the sender's rows (sorted by global expert; expert e's rows start at send_start(e)) goes to row
//     i + dst_base[e],   dst_base[e] = base_d(l) + prefix_me(e) - send_start(e)
// of rank d = e / El. A pull reads the same rows back through the same map.
//
// Ordering: every move is bracketed by a barrier over the symmetric memory's signal pads, with the
// protocol of torch's symmetric-memory barrier (put: CAS 0 -> 1 into the peer's slot for this rank;
// wait: CAS 1 -> 0 on this rank's slot for the peer), made release/acquire at system scope by
// fences; pushes end with a system fence of their own. A barrier that waits longer than its
// timeout prints the ranks and traps (an error, not a silent hang).
//
// C ABI (all launches on the given stream; return 0 or a cudaError_t, see te_pr_last_error):
//   te_pr_barrier     the barrier above
//   te_pr_put_counts  counts [E] -> counts region row `me` of every rank
//   te_pr_plan        counts region [R, E] -> dst_base [E], send_end [E], this rank's local
//                     expert sizes (int64) and cumulative end offsets (int32), status (int32)
//   te_pr_move        push (local rows -> peers) or pull (peers -> local rows) of S rows
//   te_pr_dispatch    the dispatch's whole device sequence in one host call (barrier, put counts,
//                     barrier, plan, count matrix -> pinned host memory + event, push, barrier);
//                     te_pr_wait_counts then waits for that event only

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

namespace {

thread_local char g_error[256] = "";

int record(cudaError_t err, const char* where) {
  if (err != cudaSuccess) {
    snprintf(g_error, sizeof(g_error), "%s: %s", where, cudaGetErrorString(err));
    return static_cast<int>(err);
  }
  return 0;
}

// Status bits of the plan (identical on every rank: every rank reads the same count matrix).
constexpr int kNegativeCount = 1;  // a rank flagged invalid routing (in-band error, see dispatcher)
constexpr int kOverflow = 2;       // some rank would receive more rows than its rows region holds

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : : "memory");
  return t;
}

// One block; thread t < world (t != rank) signals rank t and waits for its signal.
__global__ void barrier_kernel(uint32_t* const* __restrict__ pads, int channel, int rank, int world,
                               uint64_t timeout_ns) {
  const int t = threadIdx.x;
  if (t >= world || t == rank) return;
  uint32_t* out = pads[t] + world * channel + rank;
  uint32_t* in = pads[rank] + world * channel + t;
  const uint64_t deadline = global_timer_ns() + timeout_ns;
  __threadfence_system();  // release: everything before this barrier, before the signal
  while (atomicCAS_system(out, 0u, 1u) != 0u) {
    if (global_timer_ns() > deadline) {
      printf("te_dist peer_rows: rank %d timed out signalling rank %d (channel %d)\n", rank, t, channel);
      __trap();
    }
  }
  while (atomicCAS_system(in, 1u, 0u) != 1u) {
    if (global_timer_ns() > deadline) {
      printf("te_dist peer_rows: rank %d timed out waiting for rank %d (channel %d)\n", rank, t, channel);
      __trap();
    }
  }
  __threadfence_system();  // acquire: the peer's writes before its signal, before what follows
}

__global__ void put_counts_kernel(const int64_t* __restrict__ counts, int E, int R, int me,
                                  int64_t* const* __restrict__ peer_counts) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < R * E; i += gridDim.x * blockDim.x) {
    int d = i / E, e = i % E;
    peer_counts[d][static_cast<int64_t>(me) * E + e] = counts[e];
  }
  __threadfence_system();
}

// One block. Shared memory: 2 * E int64 (column sums, this rank's counts).
__global__ void plan_kernel(const int64_t* __restrict__ M, int R, int E, int me, int64_t capacity_rows,
                            int64_t* __restrict__ dst_base, int64_t* __restrict__ send_end,
                            int64_t* __restrict__ local_sizes, int32_t* __restrict__ local_offsets,
                            int32_t* __restrict__ status) {
  extern __shared__ int64_t smem[];
  int64_t* colsum = smem;
  int64_t* mine = smem + E;
  __shared__ int bad;
  if (threadIdx.x == 0) bad = 0;
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int64_t total = 0, prefix = 0;
    for (int r = 0; r < R; ++r) {
      int64_t v = M[static_cast<int64_t>(r) * E + e];
      if (v < 0) atomicOr(&bad, kNegativeCount);
      total += v;
      if (r < me) prefix += v;
    }
    colsum[e] = total;
    mine[e] = M[static_cast<int64_t>(me) * E + e];
    dst_base[e] = prefix;  // completed below
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  const int El = E / R;
  int64_t sent = 0;
  int flags = bad;
  for (int d = 0; d < R; ++d) {
    int64_t base = 0;
    for (int l = 0; l < El; ++l) {
      const int e = d * El + l;
      dst_base[e] += base - sent;  // base_d(l) + prefix_me(e) - send_start(e)
      sent += mine[e];
      send_end[e] = sent;
      base += colsum[e];
      if (d == me) {
        local_sizes[l] = colsum[e];
        local_offsets[l] = static_cast<int32_t>(base);
      }
    }
    if (base > capacity_rows) flags |= kOverflow;
  }
  *status = flags;
}

// First expert e with send_end[e] > row (send_end is non-decreasing and ends at S > row).
__device__ __forceinline__ int expert_of_row(const int64_t* __restrict__ send_end, int E, int64_t row) {
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    int mid = (lo + hi) >> 1;
    if (send_end[mid] > row) hi = mid; else lo = mid + 1;
  }
  return lo;
}

constexpr int kWarps = 16;   // warps per block; one warp moves one row at a time
constexpr int kUnroll = 4;   // 16-byte vectors in flight per lane

template <bool kPush>
__global__ void __launch_bounds__(kWarps * 32)
move_kernel(uint8_t* __restrict__ local_rows, int64_t S, int64_t row_bytes, const int64_t* __restrict__ dst_base,
            const int64_t* __restrict__ send_end, int E, int El, uint8_t* const* __restrict__ peer_rows,
            const int32_t* __restrict__ status) {
  if (status != nullptr && *status != 0) return;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t num_warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t vecs = row_bytes / 16;
  for (int64_t row = warp; row < S; row += num_warps) {
    const int e = expert_of_row(send_end, E, row);
    const int d = e / El;
    uint4* remote = reinterpret_cast<uint4*>(peer_rows[d] + (row + dst_base[e]) * row_bytes);
    uint4* local = reinterpret_cast<uint4*>(local_rows + row * row_bytes);
    const uint4* src = kPush ? local : remote;
    uint4* dst = kPush ? remote : local;
    int64_t v = lane;
    for (; v + 32 * (kUnroll - 1) < vecs; v += 32 * kUnroll) {
      uint4 buf[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) buf[u] = src[v + 32 * u];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) dst[v + 32 * u] = buf[u];
    }
    for (; v < vecs; v += 32) dst[v] = src[v];
  }
  if (kPush) __threadfence_system();
}

int launch_barrier(uint32_t* const* pads, int channel, int rank, int world, uint64_t timeout_ns,
                   cudaStream_t stream) {
  barrier_kernel<<<1, 32, 0, stream>>>(pads, channel, rank, world, timeout_ns);
  return record(cudaGetLastError(), "te_pr_barrier");
}

constexpr int kMaxDevices = 64;
cudaEvent_t g_counts_ready[kMaxDevices] = {};  // per device: the count matrix reached the host

}  // namespace

extern "C" {

const char* te_pr_last_error() { return g_error; }

int te_pr_barrier(uint32_t* const* pads, int channel, int rank, int world, uint64_t timeout_ns, cudaStream_t stream) {
  return launch_barrier(pads, channel, rank, world, timeout_ns, stream);
}

int te_pr_put_counts(const int64_t* counts, int E, int R, int me, int64_t* const* peer_counts, cudaStream_t stream) {
  int threads = 256;
  int blocks = (R * E + threads - 1) / threads;
  put_counts_kernel<<<blocks > 0 ? blocks : 1, threads, 0, stream>>>(counts, E, R, me, peer_counts);
  return record(cudaGetLastError(), "te_pr_put_counts");
}

int te_pr_plan(const int64_t* M, int R, int E, int me, int64_t capacity_rows, int64_t* dst_base, int64_t* send_end,
               int64_t* local_sizes, int32_t* local_offsets, int32_t* status, cudaStream_t stream) {
  size_t smem = 2 * static_cast<size_t>(E) * sizeof(int64_t);
  if (smem > 48 * 1024) {
    snprintf(g_error, sizeof(g_error), "te_pr_plan: %d experts need %zu bytes of shared memory (max 49152)", E, smem);
    return static_cast<int>(cudaErrorInvalidValue);
  }
  plan_kernel<<<1, 256, smem, stream>>>(M, R, E, me, capacity_rows, dst_base, send_end, local_sizes, local_offsets,
                                        status);
  return record(cudaGetLastError(), "te_pr_plan");
}

int te_pr_move(int push, void* local_rows, int64_t S, int64_t row_bytes, const int64_t* dst_base,
               const int64_t* send_end, int E, int El, void* const* peer_rows, const int32_t* status, int max_blocks,
               cudaStream_t stream) {
  if (row_bytes % 16 != 0) {
    snprintf(g_error, sizeof(g_error), "te_pr_move: row_bytes=%lld is not a multiple of 16", (long long)row_bytes);
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (S == 0) return 0;
  int64_t want = (S + kWarps - 1) / kWarps;
  int blocks = static_cast<int>(want < max_blocks ? want : max_blocks);
  auto rows = reinterpret_cast<uint8_t* const*>(peer_rows);
  auto local = static_cast<uint8_t*>(local_rows);
  if (push) {
    move_kernel<true><<<blocks, kWarps * 32, 0, stream>>>(local, S, row_bytes, dst_base, send_end, E, El, rows, status);
  } else {
    move_kernel<false><<<blocks, kWarps * 32, 0, stream>>>(local, S, row_bytes, dst_base, send_end, E, El, rows, status);
  }
  return record(cudaGetLastError(), "te_pr_move");
}

int te_pr_dispatch(uint32_t* const* pads, int rank, int world, uint64_t timeout_ns, const int64_t* counts, int E,
                   int64_t* const* peer_counts, int64_t* matrix, int64_t capacity_rows, int64_t* dst_base,
                   int64_t* send_end, int64_t* local_sizes, int32_t* local_offsets, int32_t* status,
                   int64_t* host_matrix, void* rows, int64_t S, int64_t row_bytes, void* const* peer_rows,
                   int max_blocks, cudaStream_t stream) {
  int device = 0;
  int rc = record(cudaGetDevice(&device), "te_pr_dispatch: cudaGetDevice");
  if (rc) return rc;
  if (device >= kMaxDevices) {
    snprintf(g_error, sizeof(g_error), "te_pr_dispatch: device %d >= %d", device, kMaxDevices);
    return static_cast<int>(cudaErrorInvalidDevice);
  }
  if (g_counts_ready[device] == nullptr) {
    rc = record(cudaEventCreateWithFlags(&g_counts_ready[device], cudaEventDisableTiming), "te_pr_dispatch: event");
    if (rc) return rc;
  }
  if ((rc = launch_barrier(pads, 0, rank, world, timeout_ns, stream))) return rc;
  if ((rc = te_pr_put_counts(counts, E, world, rank, peer_counts, stream))) return rc;
  if ((rc = launch_barrier(pads, 0, rank, world, timeout_ns, stream))) return rc;
  if ((rc = te_pr_plan(matrix, world, E, rank, capacity_rows, dst_base, send_end, local_sizes, local_offsets, status,
                       stream))) return rc;
  rc = record(cudaMemcpyAsync(host_matrix, matrix, sizeof(int64_t) * world * E, cudaMemcpyDeviceToHost, stream),
              "te_pr_dispatch: count matrix to host");
  if (rc) return rc;
  if ((rc = record(cudaEventRecord(g_counts_ready[device], stream), "te_pr_dispatch: event record"))) return rc;
  if ((rc = te_pr_move(1, rows, S, row_bytes, dst_base, send_end, E, E / world, peer_rows, status, max_blocks,
                       stream))) return rc;
  return launch_barrier(pads, 0, rank, world, timeout_ns, stream);
}

int te_pr_wait_counts() {
  int device = 0;
  int rc = record(cudaGetDevice(&device), "te_pr_wait_counts: cudaGetDevice");
  if (rc) return rc;
  if (device >= kMaxDevices || g_counts_ready[device] == nullptr) {
    snprintf(g_error, sizeof(g_error), "te_pr_wait_counts: no dispatch was queued on device %d", device);
    return static_cast<int>(cudaErrorInvalidResourceHandle);
  }
  return record(cudaEventSynchronize(g_counts_ready[device]), "te_pr_wait_counts");
}

}  // extern "C"
