// Owner-exact kernel study (issue 24): how long one 64-row kv tile takes on an H200 with every SM busy, in
// today's program shape and in the swapped (owner-exact) one. A shared-memory / tensor-core rate study:
// standalone (its own main, no torch), the tiles' data random bf16.
//
// Build and run (one device call; the run takes well under 60 s):
//   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -o /tmp/tile_rate benchmarks/owner_exact/tile_rate.cu
//   /tmp/tile_rate --json $OUT/tile_rate.json
// (nvcc 13's plain -arch=sm_90a also embeds compute_90 PTX, which ptxas refuses for wgmma: use -gencode.)
//
// Shapes, per 64-row kv tile (d_qk 576 = 512 latent + 64 rope, d_v 512 = the row's first 512 columns):
//   today    S = Q K^T: wgmma m64n64k16, A = Q (64 rows = queries x heads) and B = K from shared memory; P in
//            registers; O [64 x 512] += P V (m64n256k16, P from registers for a warpgroup's own tile, from shared
//            memory for the other's). Its device functions are the shipping kernel's (sm90_consumer.cuh),
//            driven by a block loop that follows consume(): two consumer warpgroups, a tile each of a pair,
//            the row max handed 0 -> 1 -> 0, P0 in buffer 0's rope chunk, the next QK under the last PV.
//   swapped  S^T = K Q^T: m64nNk16, A = K (64 kv rows), B = the first N rows of Q (N = h x owners); the mask,
//            then the column max over the 64 kv rows (within a warp by shuffles, across the warpgroup's four
//            warps through shared memory); exp2; P^T -> shared memory (stmatrix .trans, K-major, as wgmma's B
//            reads it); O^T [512 x N] += V^T P^T: d_v in 64-row chunks (a warpgroup holds 4 of the 8), A = V^T
//            (the same kv tile read MN-major: the transpose-a bit), B = P^T. The same pair schedule and max
//            hand-off as today. "split": the same product issued as one wgmma an owner (N = h each), the form
//            an arbitrary owner set needs.
//   real     the shipping kernel itself (quilt_sm90.cu, included below) on a synthetic plan: programs of 64
//            full tiles, columns of random rows of an L2-resident pool; calibrates the micro loop against it.
// Modes: gather 0 (compute only: the tiles stay in shared memory) and gather 1 (a producer warpgroup refills
// both buffers every pair with cp.async of random rows of an L2-resident pool, ready / free mbarriers per buffer:
// the shared-memory writes of a real gather).
//
// Simplified against a real kernel: one program for the whole run (no boundaries, epilogue once); owner masks
// static (written once; the real producer writes 64 words a tile); whole-tile mbarriers instead of halves; the
// swapped shape's owners are contiguous query slots 0 .. N/h - 1 fixed at compile time (no runtime owner
// switch) and it keeps no true max for max_logits (today's keeps its one fmax a row); the row / column sums are
// reduced once, at the end (as the real kernel does; at N = 64 the swapped shape reduce-scatters each tile's
// column sums instead, for registers). Each shape is checked once against a host reference of the same
// attention (n_pairs = 1: softmax over the pair's 128 kv rows with the owner masks).
// Registers (ptxas -v, consumers at 232): no spills, except 8-16 bytes in the per-owner N = 64 variants.
//
// Output: a table, then one JSON line (also written to --json FILE): ns per tile per SM (kernel time / tiles a
// CTA ran; one CTA an SM), SM clocks per tile (clock64 of CTA 0), TFLOP/s of the executed products (for the
// swapped shapes that is the useful work of their N columns).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../../quilt_attn/ops/csrc/quilt_sm90.cu"  // today's kernel (real), ptx.cuh, sm90_consumer.cuh helpers
#include "wgmma_small.cuh"

#define CK(x)                                                                                       \
  do {                                                                                              \
    cudaError_t e_ = (x);                                                                           \
    if (e_ != cudaSuccess) {                                                                        \
      std::fprintf(stderr, "CUDA error %s at %s:%d: %s\n", #x, __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

namespace owner_exact {
using namespace quilt_ptx;
namespace qs = quilt_sm90;
using T = __nv_bfloat16;

constexpr int kDqk = 576, kDv = 512;
constexpr int kChunk = qs::kChunkBytes, kChunks = qs::kChunks, kTileBytes = qs::kTileBytes;
constexpr int kThreads = 384;

// Shared memory: Q | kv buffer 0 | kv buffer 1 | P1 | mbarriers | masks | hand-off maxima | column maxima.
// P0 (P^T0) lives in buffer 0's rope chunk once that tile's QK is done, as in the shipping kernel.
constexpr int kOffQ = 0, kOffKV = kTileBytes, kOffP0 = kOffKV + 8 * kChunk, kOffP1 = kOffKV + 2 * kTileBytes;
constexpr int kOffBar = kOffP1 + kChunk;           // ready[2] (+0, +8), free[2] (+16, +24)
constexpr int kOffMask = kOffBar + 32;             // today: uint32 [2][64]; swapped: uint8 [2][64]
constexpr int kOffTodayRed = kOffMask + 2 * 64 * 4;  // today: the row max handed between warpgroups, f32 [64]
constexpr int kOffRed = kOffMask + 2 * 64;         // swapped: column maxima handed 0 -> 1 and 1 -> 0, f32 [2][64]
constexpr int kOffColMax = kOffRed + 2 * 64 * 4;   // swapped: per-warp column maxima, f32 [2 wg][4 warps][64]
constexpr int kSmemBytes = kOffColMax + 2 * 4 * 64 * 4;
static_assert(kOffP0 == qs::kSmemP0 && kOffP1 == qs::kSmemP1 && kOffQ == qs::kSmemQ && kOffKV == qs::kSmemKV,
              "softmax_publish_pv stores P0 at the shipping layout's offset");
static_assert(kOffTodayRed + 64 * 4 <= kSmemBytes && kSmemBytes <= qs::kSmemLimit, "shared-memory budget");

// named barriers: the shipping kernel's 1-4 (max 0 / 1, P0 / P1 ready), and these
enum : int { kBarP0Free = 6, kBarWg0 = 7, kBarWg1 = 8 };

struct Args {
  const T* q;             // [64, 576]: the program's rows (queries x heads)
  const T* pool;          // [pool_rows, 576]: kv rows to gather (L2-resident)
  const uint32_t* masks;  // [2][64]: owner bits of each buffer's columns
  float* out;             // [ctas][64 x 512]: raw O (not normalized): today row-major (row = query-head),
                          // swapped in accumulator order (swapped_to_rows)
  float* lsum;            // [ctas][2][64]: each warpgroup's row / column sums (zeroed before the launch)
  long long* clocks;      // [ctas]: clock64 ticks of the loop (thread 0)
  int pool_rows;          // a power of two
  int n_pairs;            // tile pairs a CTA runs
  int gather;             // 1: the producer refills both buffers every pair
  float scale2;           // sm_scale * log2(e)
};

__device__ __forceinline__ uint32_t bar_ready(uint32_t base, int b) { return base + 8 * b; }
__device__ __forceinline__ uint32_t bar_free(uint32_t base, int b) { return base + 16 + 8 * b; }
__device__ __forceinline__ void bar_wg(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }

__device__ __forceinline__ uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// The producer warpgroup (gather 1): both buffers refilled every pair with rows of the pool, the shipping
// producer's mapping (8 threads a row's 128-byte chunk, rows g, g+16, g+32, g+48), one ready / free pair a buffer.
__device__ void produce(const Args& a, uint8_t* smem) {
  const int t = threadIdx.x - 256, unit = t % 8, g = t / 8;
  const uint32_t bars = smem_u32(smem + kOffBar);
  for (int it = 0; it < a.n_pairs; ++it) {
#pragma unroll 1
    for (int buf = 0; buf < 2; ++buf) {
      mbar_wait(bar_free(bars, buf), (it & 1) ^ 1);
      const uint32_t dst = smem_u32(smem + kOffKV + buf * kTileBytes);
#pragma unroll 1
      for (int j = 0; j < 4; ++j) {
        const int r = g + 16 * j;
        const uint32_t row = mix(blockIdx.x * 0x9E3779B1u + it * 0x85EBCA77u + (buf * 64 + r) * 0xC2B2AE3Du) &
                             static_cast<uint32_t>(a.pool_rows - 1);
        const T* src = a.pool + static_cast<long long>(row) * kDqk + unit * 8;
#pragma unroll
        for (int c = 0; c < kChunks; ++c) cp_async16(dst + c * kChunk + swz(r, unit), src + c * 64, true);
      }
      mbar_arrive_copies(bar_ready(bars, buf));
    }
  }
  cp_async_commit();
  cp_async_wait<0>();
}

// ------------------------------------------------------------------------------------------ today's shape
struct Today {
  static constexpr bool kToday = true;
  static constexpr int kN = 64;
  static constexpr bool kSplit = false;
  static constexpr int kH = 8;

  template <int kWg>
  __device__ static void consume(const Args& a, uint8_t* smem) {
    const int tid = threadIdx.x, warp = (tid % 128) / 32, lane = tid % 32;
    const int r0 = warp * 16 + lane / 4;
    const uint32_t rowbit[2] = {1u << (r0 >> 3), 1u << ((r0 + 8) >> 3)};  // 8 queries x 8 heads
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(smem + kOffMask);
    float* red = reinterpret_cast<float*>(smem + kOffTodayRed);
    const uint32_t sq = smem_u32(smem + kOffQ), skv0 = smem_u32(smem + kOffKV), skv1 = skv0 + kTileBytes;
    const uint32_t sp0 = smem_u32(smem + kOffP0), sp1 = smem_u32(smem + kOffP1);
    const uint32_t bars = smem_u32(smem + kOffBar);
    const int n = a.n_pairs;
    const bool gather = a.gather != 0;
    const float scale2 = a.scale2;

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    float m[2] = {qs::kMaxInit, qs::kMaxInit}, l[2] = {0.f, 0.f}, mt[2] = {-INFINITY, -INFINITY};
    float s[32];
    uint32_t pk[16];
    long long t0 = clock64();

    if constexpr (kWg == 0) {
      if (gather) wait_ready(bar_ready(bars, 0), 0);
      wgmma_fence();
      qs::qk_chunks<T>(s, sq, skv0, 0, kChunks, true);
      qs::qk_done<true>(s);
      for (int it = 0; it < n; ++it) {
        float mx[2], m_new[2];
        qs::mask_max(s, mx, bits, rowbit, scale2, lane);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          m_new[i] = qs::next_max(m[i], mx[i]);
          mt[i] = fmaxf(mt[i], mx[i]);
        }
        if (!gather && it > 0) qs::bar_sync<kBarP0Free>();  // warpgroup 1 is done with the last P0
        qs::softmax_publish_pv<T, true, qs::kBarMax0>(s, o, m, l, m_new, scale2, pk, red, r0, lane, skv0, 0, true,
                                                      smem);
        wgmma_wait<0>();
        fence_regs(o);
        qs::bar_sync<qs::kBarMax1>();
        float f[2];
        const bool same = qs::adopt_max(m, l, f, red, r0);
        if (!same) {
          qs::pack_p<T>(pk, s, f);
          qs::store_p(smem, kOffP0, pk, r0, lane);
        }
        fence_async_smem();
        qs::bar_arrive<qs::kBarP0>();
        if (gather) mbar_arrive(bar_free(bars, 0));
        if (!same) qs::scale_rows(o, f);
        qs::bar_sync<qs::kBarP1>();
        wgmma_fence();
        qs::pv_smem<T>(o, sp1, skv1, 0);
        wgmma_commit();
        if (it + 1 < n) {  // the next QK under the last PV
          if (gather) wait_ready(bar_ready(bars, 0), (it + 1) & 1);
          qs::qk_chunks<T>(s, sq, skv0, 0, kChunks, true);
          wgmma_commit();
          wgmma_wait<1>();
          if (gather) mbar_arrive(bar_free(bars, 1));
          qs::qk_done<true>(s);
        } else {
          wgmma_wait<0>();
          if (gather) mbar_arrive(bar_free(bars, 1));
        }
        fence_regs(o);
      }
      if (!gather && n > 0) qs::bar_sync<kBarP0Free>();  // (warpgroup 1's last arrival)
    } else {
      for (int it = 0; it < n; ++it) {
        if (gather) wait_ready(bar_ready(bars, 1), it & 1);
        wgmma_fence();
        qs::qk_chunks<T>(s, sq, skv1, 0, kChunks, true);
        qs::qk_done<true>(s);
        float mx[2], m_new[2];
        qs::mask_max(s, mx, bits + 64, rowbit, scale2, lane);
#pragma unroll
        for (int i = 0; i < 2; ++i) mt[i] = fmaxf(mt[i], mx[i]);
        qs::bar_sync<qs::kBarMax0>();
#pragma unroll
        for (int i = 0; i < 2; ++i) m_new[i] = qs::next_max(red[r0 + 8 * i], mx[i]);
        __syncwarp();
        qs::softmax_publish_pv<T, true, qs::kBarMax1>(s, o, m, l, m_new, scale2, pk, red, r0, lane, skv1, 1, true,
                                                      smem);
        qs::store_p(smem, kOffP1, pk, r0, lane);
        qs::bar_sync<qs::kBarP0>();
        wgmma_fence();
        qs::pv_smem<T>(o, sp0, skv0, 1);
        wgmma_commit();
        fence_async_smem();
        qs::bar_arrive<qs::kBarP1>();
        wgmma_wait<1>();
        if (gather) mbar_arrive(bar_free(bars, 1));
        wgmma_wait<0>();
        fence_regs(o);
        if (gather) {
          mbar_arrive(bar_free(bars, 0));
        } else {
          qs::bar_arrive<kBarP0Free>();
        }
      }
    }
    if (tid == 0) a.clocks[blockIdx.x] = clock64() - t0;

    // raw O and the row sums (normalized on the host); max_logits' true max kept alive
    float* out = a.out + static_cast<long long>(blockIdx.x) * 64 * kDv + kWg * 256;
    const int quad = lane % 4;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int r = r0 + 8 * i;
#pragma unroll
      for (int j = 0; j < 32; ++j) {
        *reinterpret_cast<float2*>(out + r * kDv + j * 8 + quad * 2) = make_float2(o[j * 4 + i * 2], o[j * 4 + i * 2 + 1]);
      }
      float li = l[i];
      li += __shfl_xor_sync(0xffffffff, li, 1);
      li += __shfl_xor_sync(0xffffffff, li, 2);
      if (quad == 0) a.lsum[(blockIdx.x * 2 + kWg) * 64 + r] = li + (mt[i] > 1e30f ? 1.f : 0.f);
    }
  }
};

// ------------------------------------------------------------------------------------------ swapped shape
template <int N, int H, bool kSplitIssue>
struct Swapped {
  static_assert(N % 8 == 0 && N >= 8 && N <= 64, "N: a multiple of 8 up to 64");
  static_assert(H % 8 == 0 && N % H == 0, "N: whole owners of H columns");
  static constexpr bool kToday = false;
  static constexpr int kN = N, kH = H;
  static constexpr bool kSplit = kSplitIssue;
  static constexpr int kRegs = N / 2;   // accumulators a thread of an m64nN tile
  static constexpr int kCols = N / 4;   // distinct columns a thread holds (2 a column group)
  static constexpr int kGroups = N / 8;  // 8-column groups
  // The running column sums l: a thread's part of its kCols columns (its two kv rows), reduced across the warp
  // and the warpgroup once, at the end. At N = 64 those 16 registers made ptxas spill: there each tile's sums are
  // reduce-scattered over the 8 lanes that share a column set (8 + 4 + 2 shuffles) and a lane keeps 2 columns.
  static constexpr bool kScatter = N == 64;
  static constexpr int kL = kScatter ? kCols / 8 : kCols;
  // the column (of this thread's kCols) that entry i of a scattered l holds
  __device__ static __forceinline__ int scat_col(int lane, int i) {
    return ((lane >> 4) & 1) * (kCols / 2) + ((lane >> 3) & 1) * (kCols / 4) + ((lane >> 2) & 1) * (kCols / 8) + i;
  }
  // one reduce-scatter step over lane bit kMask: v[0 .. kLen) -> v[0 .. kLen / 2), the half this lane keeps
  template <int kLen, int kMask>
  __device__ static __forceinline__ void halve(float (&v)[kCols], int lane) {
    const bool up = lane & kMask;
#pragma unroll
    for (int i = 0; i < kLen / 2; ++i) {
      const float send = up ? v[i] : v[i + kLen / 2], keep = up ? v[i + kLen / 2] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffff, send, kMask);
    }
  }
  // l of column c times x
  __device__ static __forceinline__ void scale_l(float (&l)[kL], int c, float x, int lane) {
    if constexpr (kScatter) {
#pragma unroll
      for (int i = 0; i < kL; ++i) l[i] *= scat_col(lane, i) == c ? x : 1.f;
    } else {
      l[c] *= x;
    }
  }

  template <int kW>
  __device__ static __forceinline__ float (&sub(float (&d)[kRegs], int ow))[kW / 2] {
    return *reinterpret_cast<float(*)[kW / 2]>(&d[ow * kW / 2]);
  }

  // S^T [64 kv x N] = K Q^T over d_qk: 9 chunks x 4 k-steps
  __device__ static __forceinline__ void qk(float (&s)[kRegs], uint32_t skv, uint32_t sq) {
    const uint64_t dk = desc_sw128(skv, 16, 1024), dq = desc_sw128(sq, 16, 1024);
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint32_t off = c * kChunk + k * 32;
        const int sc = (c | k) ? 1 : 0;
        if constexpr (kSplit) {
#pragma unroll
          for (int ow = 0; ow < N / H; ++ow)
            WgSS<H>::kq(sub<H>(s, ow), desc_at(dk, off), desc_at(dq, off + ow * H * 128), sc);
        } else {
          WgSS<N>::kq(s, desc_at(dk, off), desc_at(dq, off), sc);
        }
      }
    }
  }

  // O^T [this warpgroup's 4 d_v chunks x N] += V^T P^T over the tile's 64 kv rows (4 k-steps of 16)
  template <int kWg>
  __device__ static __forceinline__ void pv(float (&o)[4][kRegs], uint32_t skv, uint32_t sp) {
    const uint64_t dp = desc_sw128(sp, 16, 1024);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const uint64_t dv = desc_sw128(skv + (4 * kWg + c) * kChunk, kChunk, 1024);
        if constexpr (kSplit) {
#pragma unroll
          for (int ow = 0; ow < N / H; ++ow)
            WgSS<H>::vp(sub<H>(o[c], ow), desc_at(dv, k * 16 * 128), desc_at(dp, k * 32 + ow * H * 128), 1);
        } else {
          WgSS<N>::vp(o[c], desc_at(dv, k * 16 * 128), desc_at(dp, k * 32), 1);
        }
      }
    }
  }

  // masks (column group j belongs to query slot 8j / H) and this warpgroup's column maxima, scaled (base 2):
  // over the warp's 16 kv rows by shuffles, then over the four warps through shared memory (cm: this
  // warpgroup's [4][64])
  __device__ static __forceinline__ void mask_colmax(float (&s)[kRegs], float (&mx)[kCols], const uint8_t* bits,
                                                     float* cm, int warp, int lane, int bar_id, float scale2) {
    const int r0 = warp * 16 + lane / 4;
    const uint32_t b0 = bits[r0], b1 = bits[r0 + 8];
    float v[kCols];
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      const uint32_t qb = 1u << (8 * j / H);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x0 = s[4 * j + e];
        float& x1 = s[4 * j + 2 + e];
        x0 = (b0 & qb) ? x0 : -INFINITY;
        x1 = (b1 & qb) ? x1 : -INFINITY;
        v[2 * j + e] = fmaxf(x0, x1);
      }
    }
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
#pragma unroll
      for (int sh = 4; sh <= 16; sh *= 2) v[c] = fmaxf(v[c], __shfl_xor_sync(0xffffffff, v[c], sh));
    }
    if (lane < 4) {
#pragma unroll
      for (int j = 0; j < kGroups; ++j) {
        cm[warp * 64 + 8 * j + 2 * lane] = v[2 * j];
        cm[warp * 64 + 8 * j + 2 * lane + 1] = v[2 * j + 1];
      }
    }
    bar_wg(bar_id);
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = 8 * j + 2 * (lane % 4) + e;
        mx[2 * j + e] = fmaxf(fmaxf(cm[col], cm[64 + col]), fmaxf(cm[128 + col], cm[192 + col])) * scale2;
      }
    }
  }

  // O^T's column c (this thread's c-th) and its sum times x
  __device__ static __forceinline__ void scale_col(float (&o)[4][kRegs], float (&l)[kL], int c, float x, int lane) {
    scale_l(l, c, x, lane);
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) o[k][4 * (c / 2) + 2 * hf + c % 2] *= x;
  }

  // s <- 2^(s scale2 - mn) per column, l += this thread's part of the column sums, m <- mn; where a maximum
  // moved (rare: next_max's slack), l and O^T are rescaled first. No array of factors is kept: registers are
  // this shape's tight resource (O^T 2N, s N/2, m and l N/4 each, a thread).
  __device__ static __forceinline__ void softmax(float (&s)[kRegs], float (&o)[4][kRegs], float (&m)[kCols],
                                                 float (&l)[kL], const float (&mn)[kCols], float scale2, int lane) {
    bool same = true;
#pragma unroll
    for (int c = 0; c < kCols; ++c) same = same && mn[c] == m[c];
    if (!__all_sync(0xffffffff, same)) {
#pragma unroll
      for (int c = 0; c < kCols; ++c) scale_col(o, l, c, exp2f(m[c] - mn[c]), lane);
    }
#pragma unroll
    for (int c = 0; c < kCols; ++c) m[c] = mn[c];
    float v[kCols];  // this tile's column sums over the thread's two rows
#pragma unroll
    for (int j = 0; j < kGroups; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x0 = s[4 * j + e];
        float& x1 = s[4 * j + 2 + e];
        x0 = exp2f(fmaf(x0, scale2, -m[2 * j + e]));
        x1 = exp2f(fmaf(x1, scale2, -m[2 * j + e]));
        v[2 * j + e] = x0 + x1;
      }
    if constexpr (kScatter) {
      halve<kCols, 16>(v, lane);
      halve<kCols / 2, 8>(v, lane);
      halve<kCols / 4, 4>(v, lane);
    }
#pragma unroll
    for (int i = 0; i < kL; ++i) l[i] += v[i];
  }

  // the rare case of the hand-off (warpgroup 1 moved a maximum): P^T0 in shared memory times its column's
  // factor, in place (row n of P^T is column n); the factors go through this warpgroup's column-max scratch cm,
  // free here (its next writes follow the P1 barrier)
  __device__ static __forceinline__ void rescale_pt(uint8_t* smem, int off, float* cm, int bar_id) {
    bar_wg(bar_id);
    for (int i = threadIdx.x % 128; i < N * 8; i += 128) {
      uint4* ptr = reinterpret_cast<uint4*>(smem + off + i * 16);
      uint4 v = *ptr;
      const float x = cm[i / 8];
      uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 f2 = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&w[k]));
        w[k] = pack2(f2.x * x, f2.y * x);
      }
      *ptr = v;
    }
  }

  __device__ static __forceinline__ uint32_t pack2(float x, float y) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
  // the bf16 pair of accumulator block (group j, half hf)
  __device__ static __forceinline__ uint32_t packed(const float (&s)[kRegs], int j, int hf) {
    return pack2(s[4 * j + 2 * hf], s[4 * j + 2 * hf + 1]);
  }

  // P^T (this warp's 16 kv rows of it) -> shared memory as wgmma's K-major B reads it: row n (a
  // query-head) holds the tile's 64 kv values, 128-byte swizzled. stmatrix .trans stores each 8x8 accumulator
  // block (kv rows x columns) transposed: block (group j, half hf) -> rows 8j .. 8j+7, 16-byte unit 2 warp + hf;
  // an x4 takes blocks (2g, 0), (2g, 1), (2g+1, 0), (2g+1, 1), lane 8 mi + jr giving row jr of block mi.
  // (Packed a group at a time: fewer live registers.)
  __device__ static __forceinline__ void store_pt(uint8_t* smem, int off, const float (&s)[kRegs], int warp,
                                                  int lane) {
    const int mi = lane / 8, jr = lane % 8;
#pragma unroll
    for (int g = 0; g < kGroups / 2; ++g) {
      const int nrow = 8 * (2 * g + (mi >> 1)) + jr, unit = 2 * warp + (mi & 1);
      const uint32_t addr = smem_u32(smem + off + nrow * 128 + ((unit ^ jr) << 4));
      asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                   "r"(packed(s, 2 * g, 0)), "r"(packed(s, 2 * g, 1)), "r"(packed(s, 2 * g + 1, 0)),
                   "r"(packed(s, 2 * g + 1, 1))
                   : "memory");
    }
    if constexpr (kGroups % 2 == 1) {
      constexpr int j = kGroups - 1;
      const int nrow = 8 * j + jr, unit = 2 * warp + (mi & 1);
      const uint32_t addr = smem_u32(smem + off + nrow * 128 + ((unit ^ jr) << 4));
      asm volatile("stmatrix.sync.aligned.m8n8.x2.trans.shared.b16 [%0], {%1, %2};\n" ::"r"(addr),
                   "r"(packed(s, j, 0)), "r"(packed(s, j, 1))
                   : "memory");
    }
  }

  __device__ static __forceinline__ void qk_done(float (&s)[kRegs]) {
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(s);
  }

  __device__ static __forceinline__ void fence_o(float (&o)[4][kRegs]) {
#pragma unroll
    for (int c = 0; c < 4; ++c) fence_regs(o[c]);
  }

  template <int kWg>
  __device__ static void consume(const Args& a, uint8_t* smem) {
    const int tid = threadIdx.x, warp = (tid % 128) / 32, lane = tid % 32;
    const uint32_t sq = smem_u32(smem + kOffQ), skv0 = smem_u32(smem + kOffKV), skv1 = skv0 + kTileBytes;
    const uint32_t sp0 = smem_u32(smem + kOffP0), sp1 = smem_u32(smem + kOffP1);
    const uint32_t bars = smem_u32(smem + kOffBar);
    const uint8_t* bits = smem + kOffMask + kWg * 64;
    float* red0 = reinterpret_cast<float*>(smem + kOffRed);  // warpgroup 0's max -> 1
    float* red1 = red0 + 64;                                 // warpgroup 1's max -> 0
    float* cm = reinterpret_cast<float*>(smem + kOffColMax) + kWg * 256;
    const int n = a.n_pairs;
    const bool gather = a.gather != 0;
    const float scale2 = a.scale2;
    const int q4 = lane % 4;

    float o[4][kRegs];
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int i = 0; i < kRegs; ++i) o[c][i] = 0.f;
    float m[kCols], l[kL];
#pragma unroll
    for (int c = 0; c < kCols; ++c) m[c] = qs::kMaxInit;
#pragma unroll
    for (int i = 0; i < kL; ++i) l[i] = 0.f;
    float s[kRegs];
    long long t0 = clock64();

    if constexpr (kWg == 0) {
      if (gather) wait_ready(bar_ready(bars, 0), 0);
      wgmma_fence();
      qk(s, skv0, sq);
      qk_done(s);
      for (int it = 0; it < n; ++it) {
        float mx[kCols];  // the tile's column maxima, then the new running maxima
        mask_colmax(s, mx, bits, cm, warp, lane, kBarWg0, scale2);
#pragma unroll
        for (int c = 0; c < kCols; ++c) mx[c] = qs::next_max(m[c], mx[c]);
        softmax(s, o, m, l, mx, scale2, lane);
        if (warp == 0 && lane < 4) {
#pragma unroll
          for (int j = 0; j < kGroups; ++j) {
            red0[8 * j + 2 * lane] = m[2 * j];
            red0[8 * j + 2 * lane + 1] = m[2 * j + 1];
          }
        }
        qs::bar_arrive<qs::kBarMax0>();
        if (!gather && it > 0) qs::bar_sync<kBarP0Free>();  // warpgroup 1 is done with the last P^T0
        store_pt(smem, kOffP0, s, warp, lane);
        fence_async_smem();
        bar_wg(kBarWg0);  // the whole warpgroup's P^T0 written before its own PV reads it
        wgmma_fence();
        pv<0>(o, skv0, sp0);
        wgmma_commit();
        wgmma_wait<0>();
        fence_o(o);
        qs::bar_sync<qs::kBarMax1>();
        bool same = true;
#pragma unroll
        for (int j = 0; j < kGroups; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) same = same && red1[8 * j + 2 * q4 + e] == m[2 * j + e];
        // (every warp holds every column: the same answer in all four, so the warpgroup branches as one)
        if (!__all_sync(0xffffffff, same)) {
#pragma unroll
          for (int j = 0; j < kGroups; ++j)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int c = 2 * j + e;
              const float mb = red1[8 * j + 2 * q4 + e], x = exp2f(m[c] - mb);
              scale_col(o, l, c, x, lane);
              m[c] = mb;
              if (warp == 0 && lane < 4) cm[8 * j + 2 * lane + e] = x;
            }
          rescale_pt(smem, kOffP0, cm, kBarWg0);
        }
        fence_async_smem();
        qs::bar_arrive<qs::kBarP0>();
        if (gather) mbar_arrive(bar_free(bars, 0));
        qs::bar_sync<qs::kBarP1>();
        wgmma_fence();
        pv<0>(o, skv1, sp1);
        wgmma_commit();
        if (it + 1 < n) {
          if (gather) wait_ready(bar_ready(bars, 0), (it + 1) & 1);
          qk(s, skv0, sq);
          wgmma_commit();
          wgmma_wait<1>();
          if (gather) mbar_arrive(bar_free(bars, 1));
          qk_done(s);
        } else {
          wgmma_wait<0>();
          if (gather) mbar_arrive(bar_free(bars, 1));
        }
        fence_o(o);
      }
      if (!gather && n > 0) qs::bar_sync<kBarP0Free>();
    } else {
      for (int it = 0; it < n; ++it) {
        if (gather) wait_ready(bar_ready(bars, 1), it & 1);
        wgmma_fence();
        qk(s, skv1, sq);
        qk_done(s);
        float mx[kCols];
        mask_colmax(s, mx, bits, cm, warp, lane, kBarWg1, scale2);
        qs::bar_sync<qs::kBarMax0>();
#pragma unroll
        for (int j = 0; j < kGroups; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) mx[2 * j + e] = qs::next_max(red0[8 * j + 2 * q4 + e], mx[2 * j + e]);
        softmax(s, o, m, l, mx, scale2, lane);
        if (warp == 0 && lane < 4) {
#pragma unroll
          for (int j = 0; j < kGroups; ++j) {
            red1[8 * j + 2 * lane] = m[2 * j];
            red1[8 * j + 2 * lane + 1] = m[2 * j + 1];
          }
        }
        qs::bar_arrive<qs::kBarMax1>();
        store_pt(smem, kOffP1, s, warp, lane);
        fence_async_smem();
        bar_wg(kBarWg1);
        wgmma_fence();
        pv<1>(o, skv1, sp1);
        wgmma_commit();
        qs::bar_arrive<qs::kBarP1>();
        qs::bar_sync<qs::kBarP0>();
        wgmma_fence();
        pv<1>(o, skv0, sp0);
        wgmma_commit();
        wgmma_wait<1>();
        if (gather) mbar_arrive(bar_free(bars, 1));
        wgmma_wait<0>();
        fence_o(o);
        if (gather) {
          mbar_arrive(bar_free(bars, 0));
        } else {
          qs::bar_arrive<kBarP0Free>();
        }
      }
    }
    if (tid == 0) a.clocks[blockIdx.x] = clock64() - t0;

    // raw O^T in accumulator order, each thread's 2N values contiguous (the host maps them back: swapped_to_rows;
    // scattered row-major stores made ptxas spill), and the column sums. The addresses come from a thread index
    // read here: computed from the one above, ptxas hoists them to the consumer's start.
    int tid_here;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid_here));
    const int lane_e = tid_here % 32;
    float* out = a.out + static_cast<long long>(blockIdx.x) * 64 * kDv + tid_here * 128;
#pragma unroll
    for (int c = 0; c < 4; ++c)
#pragma unroll
      for (int i = 0; i < kRegs; i += 2) *reinterpret_cast<float2*>(out + c * kRegs + i) = make_float2(o[c][i], o[c][i + 1]);
    float* lsum = a.lsum + (blockIdx.x * 2 + kWg) * 64;
    if constexpr (kScatter) {
#pragma unroll
      for (int i = 0; i < kL; ++i) {
        const int c = scat_col(lane_e, i);
        atomicAdd(lsum + 8 * (c / 2) + 2 * (lane_e % 4) + (c % 2), l[i]);
      }
    } else {
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        float lc = l[c];
#pragma unroll
        for (int sh = 4; sh <= 16; sh *= 2) lc += __shfl_xor_sync(0xffffffff, lc, sh);
        if (lane_e < 4) atomicAdd(lsum + 8 * (c / 2) + 2 * lane_e + (c % 2), lc);
      }
    }
  }
};

// ------------------------------------------------------------------------------------------ the kernel
template <class Shape>
__global__ void __launch_bounds__(kThreads, 1) rate_kernel(const __grid_constant__ Args a) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x;
  const int wg = __shfl_sync(0xffffffff, tid / 128, 0);
  const uint32_t bars = smem_u32(smem + kOffBar);
  if (tid == 0) {
    for (int b = 0; b < 2; ++b) {
      mbar_init(bar_ready(bars, b), 128);  // the producer threads' copy arrivals
      mbar_init(bar_free(bars, b), 256);   // every consumer thread, once a pair
    }
    mbar_init_fence();
  }
  // Q and the first two tiles (pool rows 0-63, 64-127), 128-byte-swizzled chunks; the owner bits
  for (int i = tid; i < 3 * 64 * (kDqk / 8); i += kThreads) {
    const int t = i / (64 * (kDqk / 8)), rem = i % (64 * (kDqk / 8)), r = rem / (kDqk / 8), u = rem % (kDqk / 8);
    const T* src = t == 0 ? a.q + r * kDqk : a.pool + ((t - 1) * 64 + r) * kDqk;
    const uint4 v = *reinterpret_cast<const uint4*>(src + u * 8);
    *reinterpret_cast<uint4*>(smem + t * kTileBytes + (u / 8) * kChunk + swz(r, u % 8)) = v;
  }
  if (tid < 128) {
    if constexpr (Shape::kToday) {
      reinterpret_cast<uint32_t*>(smem + kOffMask)[tid] = a.masks[tid];
    } else {
      smem[kOffMask + tid] = static_cast<uint8_t>(a.masks[tid]);
    }
  }
  fence_async_smem();
  __syncthreads();

  if (wg == 2) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (a.gather) produce(a, smem);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  if (wg == 0) {
    Shape::template consume<0>(a, smem);
  } else {
    Shape::template consume<1>(a, smem);
  }
}

}  // namespace owner_exact

// ------------------------------------------------------------------------------------------ host
namespace {
using namespace owner_exact;

struct Lcg {
  uint64_t s;
  explicit Lcg(uint64_t seed) : s(seed * 6364136223846793005ULL + 1442695040888963407ULL) {}
  uint32_t next() {
    s = s * 6364136223846793005ULL + 1442695040888963407ULL;
    return static_cast<uint32_t>(s >> 33);
  }
  float uniform() { return (next() & 0xFFFFFF) / 16777216.0f * 2.f - 1.f; }  // [-1, 1)
};

struct Config {
  std::string shape;
  int n, h;
  bool split;
  void (*kernel)(Args);
};

template <class S>
Config make(const char* name) {
  return Config{name, S::kN, S::kH, S::kSplit, rate_kernel<S>};
}

struct Host {
  std::vector<float> q, pool;  // bf16-rounded values (the host reference reads these)
  std::vector<uint32_t> masks;
  int pool_rows;
};

// the attention the check run (n_pairs 1, no gather) computes: rows 0 .. n_rows - 1 of Q over the pair's 128 kv
// rows (pool rows 0-127), column r of tile t owned by query slot row / h when bit (row / h) of masks[t][r] is set
double check(const Host& hd, const std::vector<float>& out, const std::vector<float>& lsum, int n_rows, int h,
             float scale2, bool* ok) {
  double max_err = 0.0, max_ref = 0.0;
  bool finite = true;
  std::vector<double> z(128), ref(kDv);
  for (int n = 0; n < n_rows; ++n) {
    const int slot = n / h;
    double zmax = -INFINITY;
    for (int r = 0; r < 128; ++r) {
      const bool own = (hd.masks[r] >> slot) & 1u;  // masks [2][64] = 128 entries, tile r / 64
      double acc = 0.0;
      for (int d = 0; d < kDqk; ++d) acc += static_cast<double>(hd.q[n * kDqk + d]) * hd.pool[r * kDqk + d];
      z[r] = own ? acc * scale2 : -INFINITY;
      zmax = std::max(zmax, z[r]);
    }
    double sum = 0.0;
    std::fill(ref.begin(), ref.end(), 0.0);
    for (int r = 0; r < 128; ++r) {
      if (z[r] == -INFINITY) continue;
      const double p = std::exp2(z[r] - zmax);
      sum += p;
      for (int d = 0; d < kDv; ++d) ref[d] += p * hd.pool[r * kDqk + d];
    }
    const double lk = static_cast<double>(lsum[n]) + lsum[64 + n];
    for (int d = 0; d < kDv; ++d) {
      const double got = out[n * kDv + d] / lk, want = ref[d] / sum;
      if (!std::isfinite(got)) finite = false;
      max_err = std::max(max_err, std::fabs(got - want));
      max_ref = std::max(max_ref, std::fabs(want));
    }
  }
  const double rel = max_err / std::max(max_ref, 1e-30);
  *ok = finite && rel < 3e-2;  // P is rounded to bf16 before PV
  return rel;
}

// a swapped kernel's raw output (thread t's O^T fragments at t * 128: chunk c, group j, half hf, pair e) -> O
// [64 x 512] row-major, row = query-head (the inverse of the m64nN accumulator layout)
std::vector<float> swapped_to_rows(const std::vector<float>& raw, int n) {
  std::vector<float> o(64 * kDv, 0.f);
  const int regs = n / 2;
  for (int t = 0; t < 256; ++t) {
    const int wg = t / 128, warp = (t % 128) / 32, lane = t % 32;
    for (int c = 0; c < 4; ++c)
      for (int j = 0; j < n / 8; ++j)
        for (int hf = 0; hf < 2; ++hf)
          for (int e = 0; e < 2; ++e) {
            const int col = 8 * j + 2 * (lane % 4) + e, dv = 64 * (4 * wg + c) + 16 * warp + lane / 4 + 8 * hf;
            o[col * kDv + dv] = raw[t * 128 + c * regs + 4 * j + 2 * hf + e];
          }
  }
  return o;
}

// --host-check (no GPU): the host side against itself. The reference attention, written as each shape's kernel
// writes it (today row-major, swapped in accumulator order), must pass check(); one wrong value must fail it.
// (It checks the host's layout mapping and tolerance, not the kernels.)
int host_self_test(const Host& hd, float scale2) {
  int failures = 0;
  struct Case {
    const char* shape;
    int n, h;
  };
  for (const Case& c : {Case{"today", 64, 8}, Case{"swapped", 8, 8}, Case{"swapped", 24, 8}, Case{"swapped", 48, 16},
                        Case{"swapped", 64, 8}}) {
    const bool is_today = std::string(c.shape) == "today";
    std::vector<float> rows(64 * kDv, 0.f), lsum(128, 0.f);
    for (int r = 0; r < c.n; ++r) {  // unnormalized O at the row's max, its sum split between the warpgroups
      const int slot = r / c.h;
      std::vector<double> z(128);
      double zmax = -INFINITY;
      for (int k = 0; k < 128; ++k) {
        double acc = 0.0;
        for (int d = 0; d < kDqk; ++d) acc += static_cast<double>(hd.q[r * kDqk + d]) * hd.pool[k * kDqk + d];
        z[k] = ((hd.masks[k] >> slot) & 1u) ? acc * scale2 : -INFINITY;
        zmax = std::max(zmax, z[k]);
      }
      for (int k = 0; k < 128; ++k) {
        if (z[k] == -INFINITY) continue;
        const double pk = std::exp2(z[k] - zmax);
        lsum[(k < 64 ? 0 : 64) + r] += static_cast<float>(pk);
        for (int d = 0; d < kDv; ++d) rows[r * kDv + d] += static_cast<float>(pk * hd.pool[k * kDqk + d]);
      }
    }
    std::vector<float> out = rows;
    if (!is_today) {  // rows -> accumulator order (the inverse of swapped_to_rows)
      const int regs = c.n / 2;
      for (int t = 0; t < 256; ++t) {
        const int wg = t / 128, warp = (t % 128) / 32, lane = t % 32;
        for (int k = 0; k < 4; ++k)
          for (int j = 0; j < c.n / 8; ++j)
            for (int hf = 0; hf < 2; ++hf)
              for (int e = 0; e < 2; ++e) {
                const int col = 8 * j + 2 * (lane % 4) + e, dv = 64 * (4 * wg + k) + 16 * warp + lane / 4 + 8 * hf;
                out[t * 128 + k * regs + 4 * j + 2 * hf + e] = rows[col * kDv + dv];
              }
      }
    }
    bool ok = false;
    const double rel = check(hd, is_today ? out : swapped_to_rows(out, c.n), lsum, c.n, c.h, scale2, &ok);
    std::vector<float> bad = rows;  // (check reads rows)
    bad[(c.n - 1) * kDv + 7] += 1.f;
    bool ok_bad = true;
    check(hd, bad, lsum, c.n, c.h, scale2, &ok_bad);
    std::printf("host check %-8s N=%-2d h=%-2d: reference %s (rel %.1e), corrupted %s\n", c.shape, c.n, c.h,
                ok ? "passes" : "FAILS", rel, ok_bad ? "PASSES" : "fails");
    failures += (!ok) + ok_bad;
  }
  return failures ? 3 : 0;
}

// waits for `ev`, giving up (exit 4) after `limit_s`: a protocol bug hangs a kernel, and this names where
void wait_or_die(cudaEvent_t ev, const std::string& what, double limit_s = 30.0) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t e = cudaEventQuery(ev);
    if (e == cudaSuccess) return;
    if (e != cudaErrorNotReady) {
      std::fprintf(stderr, "CUDA error in %s: %s\n", what.c_str(), cudaGetErrorString(e));
      std::exit(1);
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > limit_s) {
      std::fprintf(stderr, "TIMEOUT: %s did not finish in %.0f s (a hang); giving up\n", what.c_str(), limit_s);
      std::fflush(stdout);
      std::_Exit(4);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Row {
  std::string shape;
  int n, h;
  bool split;
  int gather;
  double ns_tile, clk_tile, tflops, mhz;
  bool valid;
  double rel_err;
};

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  int pairs = 4096, reps = 5;
  bool host_check = false;
  for (int i = 1; i < argc; ++i) {
    const std::string s = argv[i];
    if (s == "--json" && i + 1 < argc) {
      json_path = argv[++i];
    } else if (s == "--pairs" && i + 1 < argc) {
      pairs = std::atoi(argv[++i]);
    } else if (s == "--reps" && i + 1 < argc) {
      reps = std::atoi(argv[++i]);
    } else if (s == "--quick") {
      pairs = 256, reps = 3;
    } else if (s == "--host-check") {
      host_check = true;
    } else {
      std::fprintf(stderr, "usage: %s [--json FILE] [--pairs N] [--reps R] [--quick] [--host-check]\n", argv[0]);
      return 2;
    }
  }
  if (pairs < 1 || reps < 1) {
    std::fprintf(stderr, "--pairs and --reps must be >= 1\n");
    return 2;
  }
  // data: Q [64 x 576], a pool of 16384 kv rows (18.9 MB: L2-resident on an H200), owner bits (3/4 dense, each
  // tile's column 0 owned by all, so no query has an empty row)
  const int pool_rows = 16384;
  Host hd;
  hd.pool_rows = pool_rows;
  Lcg rng(20240601);
  std::vector<T> q_bf(64 * kDqk), pool_bf(static_cast<size_t>(pool_rows) * kDqk);
  hd.q.resize(q_bf.size());
  hd.pool.resize(pool_bf.size());
  for (size_t i = 0; i < q_bf.size(); ++i) {
    q_bf[i] = __float2bfloat16(rng.uniform());
    hd.q[i] = __bfloat162float(q_bf[i]);
  }
  for (size_t i = 0; i < pool_bf.size(); ++i) {
    pool_bf[i] = __float2bfloat16(rng.uniform());
    hd.pool[i] = __bfloat162float(pool_bf[i]);
  }
  hd.masks.resize(128);
  for (int i = 0; i < 128; ++i) {
    uint32_t b = 0;
    for (int k = 0; k < 8; ++k) b |= ((rng.next() & 3) != 0 ? 1u : 0u) << k;
    hd.masks[i] = (i % 64 == 0) ? 0xFFu : b;
  }
  const float scale2 = 1.4426950408889634f / std::sqrt(static_cast<float>(kDqk)) * 4.f;  // (x4: a peakier softmax)
  if (host_check) return host_self_test(hd, scale2);

  int dev = 0, sms = 0, clock_khz = 0, major = 0;
  CK(cudaGetDevice(&dev));
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  CK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  if (major != 9) {
    std::fprintf(stderr, "needs a Hopper GPU (sm_90a); found %s\n", prop.name);
    return 2;
  }


  T *d_q, *d_pool;
  uint32_t* d_masks;
  float *d_out, *d_lsum;
  long long* d_clocks;
  CK(cudaMalloc(&d_q, q_bf.size() * sizeof(T)));
  CK(cudaMalloc(&d_pool, pool_bf.size() * sizeof(T)));
  CK(cudaMalloc(&d_masks, 128 * sizeof(uint32_t)));
  CK(cudaMalloc(&d_out, static_cast<size_t>(sms) * 64 * kDv * sizeof(float)));
  CK(cudaMalloc(&d_lsum, static_cast<size_t>(sms) * 2 * 64 * sizeof(float)));
  CK(cudaMalloc(&d_clocks, sms * sizeof(long long)));
  CK(cudaMemcpy(d_q, q_bf.data(), q_bf.size() * sizeof(T), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_pool, pool_bf.data(), pool_bf.size() * sizeof(T), cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_masks, hd.masks.data(), 128 * sizeof(uint32_t), cudaMemcpyHostToDevice));

  std::vector<Config> configs = {
      make<Today>("today"),
      make<Swapped<8, 8, false>>("swapped"),
      make<Swapped<16, 8, false>>("swapped"),
      make<Swapped<24, 8, false>>("swapped"),
      make<Swapped<32, 8, false>>("swapped"),
      make<Swapped<48, 8, false>>("swapped"),
      make<Swapped<64, 8, false>>("swapped"),
      make<Swapped<16, 8, true>>("swapped"),
      make<Swapped<32, 8, true>>("swapped"),
      make<Swapped<64, 8, true>>("swapped"),
      make<Swapped<32, 16, true>>("swapped"),
      make<Swapped<64, 16, true>>("swapped"),
  };

  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<Row> rows;
  std::vector<float> out(64 * kDv), lsum(128);
  std::vector<long long> clocks(sms);
  for (const Config& c : configs) {
    const std::string name = c.shape + " N=" + std::to_string(c.n) + " h=" + std::to_string(c.h) +
                             (c.split ? " (one wgmma an owner)" : "");
    std::printf("running %s\n", name.c_str());
    std::fflush(stdout);
    CK(cudaFuncSetAttribute(c.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    Args a{d_q, d_pool, d_masks, d_out, d_lsum, d_clocks, pool_rows, 1, 0, scale2};
    // check: one pair, one CTA, no gather
    CK(cudaMemset(d_out, 0xFF, 64 * kDv * sizeof(float)));  // NaN until written
    CK(cudaMemset(d_lsum, 0, 128 * sizeof(float)));
    c.kernel<<<1, kThreads, kSmemBytes>>>(a);
    CK(cudaGetLastError());
    CK(cudaEventRecord(e1));
    wait_or_die(e1, name + " check run");
    CK(cudaMemcpy(out.data(), d_out, out.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(lsum.data(), d_lsum, lsum.size() * sizeof(float), cudaMemcpyDeviceToHost));
    bool ok = false;
    const double rel = check(hd, c.shape == "today" ? out : swapped_to_rows(out, c.n), lsum, c.n, c.h, scale2, &ok);

    for (int gather = 0; gather <= 1; ++gather) {
      a.gather = gather;
      a.n_pairs = std::max(1, pairs / 8);  // warm-up
      c.kernel<<<sms, kThreads, kSmemBytes>>>(a);
      CK(cudaGetLastError());
      CK(cudaEventRecord(e1));
      wait_or_die(e1, name + " warm-up, gather " + std::to_string(gather));
      a.n_pairs = pairs;
      std::vector<double> ms;
      for (int r = 0; r < reps; ++r) {
        CK(cudaEventRecord(e0));
        c.kernel<<<sms, kThreads, kSmemBytes>>>(a);
        CK(cudaEventRecord(e1));
        wait_or_die(e1, name + ", gather " + std::to_string(gather));
        CK(cudaGetLastError());
        float t = 0.f;
        CK(cudaEventElapsedTime(&t, e0, e1));
        ms.push_back(t);
      }
      CK(cudaMemcpy(clocks.data(), d_clocks, sms * sizeof(long long), cudaMemcpyDeviceToHost));
      const double t_ms = median(ms);
      const double tiles_cta = 2.0 * pairs;
      const double flop_tile = 2.0 * 64 * c.n * (kDqk + kDv);
      Row row{c.shape, c.n, c.h, c.split, gather, t_ms * 1e6 / tiles_cta, clocks[0] / tiles_cta,
              flop_tile * tiles_cta * sms / (t_ms * 1e-3) / 1e12, clocks[0] / (t_ms * 1e3), ok, rel};
      rows.push_back(row);
    }
  }

  // the shipping kernel on a synthetic plan: 4 programs an SM of 64 full tiles each, random pool rows, random
  // owner bits; gather on, and off (Params::skip = kSkipGather: its compute alone, results invalid)
  struct RealRow {
    int h, gather;
    double ms, ns_tile;
  };
  std::vector<RealRow> real;
  {
    const int progs = 4 * sms, tiles_prog = 64, n_tiles = progs * tiles_prog;
    std::vector<int> words(static_cast<size_t>(n_tiles) * 64), prog_tiles(n_tiles), prog_n(progs, tiles_prog);
    for (int t = 0; t < n_tiles; ++t) {
      for (int r = 0; r < 64; ++r) {
        const uint32_t row = rng.next() & (pool_rows - 1);
        const uint32_t bits = r == 0 ? 0xFFu : (rng.next() | rng.next()) & 0xFFu;
        words[static_cast<size_t>(t) * 64 + r] = static_cast<int>(row | (bits << 24));
      }
      prog_tiles[t] = t;
    }
    int *d_words, *d_prog_tiles, *d_prog_n, *d_counter;
    CK(cudaMalloc(&d_words, words.size() * sizeof(int)));
    CK(cudaMalloc(&d_prog_tiles, prog_tiles.size() * sizeof(int)));
    CK(cudaMalloc(&d_prog_n, prog_n.size() * sizeof(int)));
    CK(cudaMalloc(&d_counter, sizeof(int)));
    CK(cudaMemcpy(d_words, words.data(), words.size() * sizeof(int), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_prog_tiles, prog_tiles.data(), prog_tiles.size() * sizeof(int), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_prog_n, prog_n.data(), prog_n.size() * sizeof(int), cudaMemcpyHostToDevice));
    for (int h : {8, 16}) {
      const int qp = 64 / h, s_q = progs * qp;
      T *d_rq, *d_rout;
      float *d_ml, *d_lse;
      CK(cudaMalloc(&d_rq, static_cast<size_t>(s_q) * h * kDqk * sizeof(T)));
      CK(cudaMalloc(&d_rout, static_cast<size_t>(s_q) * h * kDv * sizeof(T)));
      CK(cudaMalloc(&d_ml, static_cast<size_t>(s_q) * h * sizeof(float)));
      CK(cudaMalloc(&d_lse, static_cast<size_t>(s_q) * h * sizeof(float)));
      {
        std::vector<T> rq(static_cast<size_t>(s_q) * h * kDqk);
        for (auto& x : rq) x = __float2bfloat16(rng.uniform());
        CK(cudaMemcpy(d_rq, rq.data(), rq.size() * sizeof(T), cudaMemcpyHostToDevice));
      }
      qs::Params p;
      std::memset(&p, 0, sizeof(p));
      p.q = d_rq;
      p.kv = d_pool;
      p.out = d_rout;
      p.max_logits = d_ml;
      p.lse = d_lse;
      p.tile_kv = d_words;
      p.prog_tiles = d_prog_tiles;
      p.prog_ntiles = d_prog_n;
      p.stride_qs = static_cast<long long>(h) * kDqk;
      p.stride_qh = kDqk;
      p.stride_kv = kDqk;
      p.stride_os = static_cast<long long>(h) * kDv;
      p.stride_oh = kDv;
      p.s_q = s_q;
      p.s_kv = pool_rows;
      p.h = h;
      p.topk = 2048;
      p.prog_cap = tiles_prog;
      p.group_size = qp;
      p.qp = qp;
      p.hb = h;
      p.from_plan = 1;
      p.n_work = progs;
      p.nhb = 1;
      p.work_counter = d_counter;
      p.scale2 = scale2;
      for (int gather = 1; gather >= 0; --gather) {
        p.skip = gather ? 0 : qs::kSkipGather;
        std::printf("running real h=%d gather %d\n", h, gather);
        std::fflush(stdout);
        CK(cudaError_t(qs::launch<T, T>(p, sms, 0)));  // warm-up
        std::vector<double> ms;
        for (int r = 0; r < 2 * reps; ++r) {
          CK(cudaEventRecord(e0));
          CK(cudaError_t(qs::launch<T, T>(p, sms, 0)));
          CK(cudaEventRecord(e1));
          wait_or_die(e1, "real kernel h=" + std::to_string(h));
          float t = 0.f;
          CK(cudaEventElapsedTime(&t, e0, e1));
          ms.push_back(t);
        }
        const double t_ms = median(ms);
        real.push_back(RealRow{h, gather, t_ms, t_ms * 1e6 * sms / n_tiles});
      }
      CK(cudaFree(d_rq));
      CK(cudaFree(d_rout));
      CK(cudaFree(d_ml));
      CK(cudaFree(d_lse));
    }
    CK(cudaFree(d_words));
    CK(cudaFree(d_prog_tiles));
    CK(cudaFree(d_prog_n));
    CK(cudaFree(d_counter));
  }

  std::printf("owner-exact tile rates: %s, %d SMs, max clock %d MHz, %d pairs a CTA, median of %d\n", prop.name, sms,
              clock_khz / 1000, pairs, reps);
  std::printf("%-8s %3s %3s %-5s %6s %9s %9s %9s %7s %6s %9s\n", "shape", "N", "h", "issue", "gather", "ns/tile",
              "clk/tile", "TFLOP/s", "MHz", "check", "rel_err");
  for (const Row& r : rows) {
    std::printf("%-8s %3d %3d %-5s %6d %9.1f %9.0f %9.1f %7.0f %6s %9.2e\n", r.shape.c_str(), r.n, r.h,
                r.split ? "owner" : "one", r.gather, r.ns_tile, r.clk_tile, r.tflops, r.mhz, r.valid ? "ok" : "FAIL",
                r.rel_err);
  }
  for (const RealRow& r : real) {
    std::printf("real     h=%-3d gather %d: %.3f ms for %d tiles, %.1f ns/tile/SM\n", r.h, r.gather, r.ms,
                4 * sms * 64, r.ns_tile);
  }
  std::string js = "{\"device\": \"" + std::string(prop.name) + "\", \"sms\": " + std::to_string(sms) +
                   ", \"max_clock_mhz\": " + std::to_string(clock_khz / 1000) + ", \"pairs\": " + std::to_string(pairs) +
                   ", \"reps\": " + std::to_string(reps) + ", \"rows\": [";
  char buf[512];
  for (size_t i = 0; i < rows.size(); ++i) {
    const Row& r = rows[i];
    std::snprintf(buf, sizeof(buf),
                  "%s{\"shape\": \"%s\", \"n\": %d, \"h\": %d, \"issue\": \"%s\", \"gather\": %d, \"ns_per_tile\": %.2f, "
                  "\"clk_per_tile\": %.1f, \"tflops\": %.2f, \"mhz\": %.0f, \"valid\": %s, \"rel_err\": %.3e}",
                  i ? ", " : "", r.shape.c_str(), r.n, r.h, r.split ? "owner" : "one", r.gather, r.ns_tile, r.clk_tile,
                  r.tflops, r.mhz, r.valid ? "true" : "false", r.rel_err);
    js += buf;
  }
  js += "], \"real\": [";
  for (size_t i = 0; i < real.size(); ++i) {
    std::snprintf(buf, sizeof(buf), "%s{\"h\": %d, \"gather\": %d, \"ms\": %.4f, \"ns_per_tile\": %.2f}", i ? ", " : "",
                  real[i].h, real[i].gather, real[i].ms, real[i].ns_tile);
    js += buf;
  }
  js += "]}";
  std::printf("%s\n", js.c_str());
  if (!json_path.empty()) {
    FILE* f = std::fopen(json_path.c_str(), "w");
    if (f == nullptr) {
      std::fprintf(stderr, "cannot write %s\n", json_path.c_str());
      return 1;
    }
    std::fprintf(f, "%s\n", js.c_str());
    std::fclose(f);
  }
  bool all_ok = true;
  for (const Row& r : rows) all_ok = all_ok && r.valid;
  return all_ok ? 0 : 3;
}
