// The FP8 compaction's mark pass on the GPU (ops/fp8_compact.py): a byte set for every pool row that a run of
// column words references.
//
// Why not one global store an entry: a call's 33.5M index entries (s_q 16384, Top-2048) reference ~44K rows,
// so the stores are random single bytes into a few of the pool's sectors, and their count bounds the pass.
// Neighbouring index lists select mostly the same rows (16 lists of glm53-like: ~5,300 distinct rows of 32,768
// entries), so each CTA first puts its span's rows into a hash set in shared memory and stores a mark only for
// a row it has not seen. The set is a cache, not a record: an entry whose probes all find other rows marks its
// row itself, so any number of distinct rows is marked correctly, only with less saving.
//
// Words are rows (a negative word or one >= s_kv references none) or, packed, plan columns
// row | member bits << 24 (padding -1, whose row field 0xFFFFFF is >= s_kv).

#include <cuda_runtime.h>
#include <stdint.h>

namespace quilt_compact {

constexpr int kThreads = 512;
constexpr int kLogSlots = 14;
constexpr int kSlots = 1 << kLogSlots;  // 64 KB of keys: three CTAs an SM
constexpr int kProbes = 8;
constexpr int kEpt = 8;                  // words a thread loads at once, kThreads apart (coalesced)
constexpr int kEmpty = -1;               // never a row
constexpr int kSpan = 32768;             // words a CTA: 16 lists of 2048

__global__ void __launch_bounds__(kThreads, 3)
mark_kernel(const int* __restrict__ words, long long n, int s_kv, int packed, int log_grid, uint8_t* mark) {
  extern __shared__ int keys[];
  // CTAs in bit-reversed order of their spans: the CTAs in flight together hold lists far apart, so they do not
  // store the same marks at once
  unsigned cta = __brev(blockIdx.x) >> (32 - log_grid);
  if (log_grid == 0) cta = 0;
  const long long b0 = static_cast<long long>(cta) * kSpan;
  if (b0 >= n) return;
  const long long b1 = b0 + kSpan < n ? b0 + kSpan : n;
  for (int i = threadIdx.x; i < kSlots; i += kThreads) keys[i] = kEmpty;
  __syncthreads();
  for (long long c = b0; c < b1; c += kThreads * kEpt) {
    int w[kEpt];
#pragma unroll
    for (int e = 0; e < kEpt; ++e) {
      const long long i = c + e * kThreads + threadIdx.x;
      w[e] = i < b1 ? __ldg(words + i) : kEmpty;
    }
#pragma unroll
    for (int e = 0; e < kEpt; ++e) {
      const int r = packed ? (w[e] & 0xFFFFFF) : w[e];
      if (static_cast<unsigned>(r) >= static_cast<unsigned>(s_kv)) continue;
      unsigned h = (static_cast<unsigned>(r) * 2654435761u) >> (32 - kLogSlots);
      bool store = true;  // (every probe taken by other rows: mark it anyway)
      for (int k = 0; k < kProbes; ++k) {
        int seen = keys[h];
        if (seen == kEmpty) seen = atomicCAS(&keys[h], kEmpty, r);
        if (seen == kEmpty) break;            // this entry put the row in: it marks
        if (seen == r) { store = false; break; }  // a row this CTA has marked already
        h = (h + 1) & (kSlots - 1);
      }
      if (store) mark[r] = 1;
    }
  }
}

}  // namespace quilt_compact

extern "C" {

// mark [s_kv] (uint8, zeroed by the caller): mark[r] = 1 for every row r that words [n] reference; no host sync
int quilt_compact_mark_launch(const int* words, long long n, int s_kv, int packed, uint8_t* mark, void* stream) {
  using namespace quilt_compact;
  if (n < 0 || s_kv < 0) return static_cast<int>(cudaErrorInvalidValue);
  if (n == 0) return 0;
  const long long spans = (n + kSpan - 1) / kSpan;
  int log_grid = 0;
  while ((1ll << log_grid) < spans) ++log_grid;
  if (log_grid > 30) return static_cast<int>(cudaErrorInvalidValue);
  const int smem = kSlots * static_cast<int>(sizeof(int));
  cudaError_t err = cudaFuncSetAttribute(mark_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return static_cast<int>(err);
  mark_kernel<<<1u << log_grid, kThreads, smem, static_cast<cudaStream_t>(stream)>>>(words, n, s_kv, packed,
                                                                                      log_grid, mark);
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
