// QUILT sparse-attention prefill on Hopper (sm_90a): wgmma tiles over gathered kv rows.
//
// A CTA owns 64 matrix rows (QP neighbouring queries x HB heads, padded to 64) and streams tiles
// of 64 gathered kv rows (d_qk 576 = 512 latent + 64 rope; the values are the first 512 columns).
// Tiles come either from a QUILT plan's per-program work list (each tile column carries the member
// bits of the queries that own its row) or, query-parallel, from one query's own Top-K list.
//
// Warp-specialized, 384 threads. Two consumer warpgroups (232 registers each) share the 64 rows:
//   S = Q K^T   warpgroup w computes kv columns [32w, 32w + 32)   (wgmma m64n32k16, Q and K in smem)
//   softmax     row maxima are exchanged through shared memory, P (bf16) is written to shared memory
//   O += P V    warpgroup w accumulates value columns [256w, 256w + 256) (wgmma m64n256k16, V = K tile
//               read N-major from the same shared memory)
// A producer warpgroup (40 registers) gathers the next tile with 16-byte cp.async (zero-filled for
// invalid rows) into the other shared-memory stage while the current one is computed; mbarriers
// full[2] / empty[2] hand the stages over. (Gathering from the consumer warps instead measured
// 15.8 ms against 11.7 at 64 heads: issuing the copies stalled the matrix work, benchmarks/NOTES.md.)
//
// Shared memory, 128-byte-swizzled 64-column chunks (the layout wgmma's descriptors expect):
//   Q 72 KB | KV stage 0, 1: 72 KB each | P 8 KB | member bits, row max, row sum, mbarriers.
// This file has no torch dependency: it builds into a plain shared library driven through ctypes
// (quilt_attn/ops/cuda_backend.py), and compiles alone with nvcc for a build check.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "wgmma_ops.cuh"

namespace quilt_sm90 {

constexpr int kRows = 64;                       // matrix rows a CTA (queries x heads)
constexpr int kTile = 64;                       // kv rows a tile
constexpr int kDqk = 576;
constexpr int kUnitsPerRow = kDqk / 8;          // 16-byte units of a bf16 row: 72
constexpr int kChunkBytes = 64 * 128;           // 64 rows x 64 columns x 2 bytes
constexpr int kTileBytes = (kDqk / 64) * kChunkBytes;  // 9 chunks: 72 KB
constexpr int kThreads = 256;                   // consumer threads (+ one producer warpgroup)

constexpr int kSmemQ = 0;
constexpr int kSmemKV = kSmemQ + kTileBytes;
constexpr int kSmemP = kSmemKV + 2 * kTileBytes;
constexpr int kSmemMask = kSmemP + kChunkBytes;       // uint32 [2][64]: member bits of each stage's slots
constexpr int kSmemMax = kSmemMask + 2 * kTile * 4;   // float [2][64]: row max of each warpgroup's half
constexpr int kSmemSum = kSmemMax + 2 * kRows * 4;   // float [2][64]: row sum of each warpgroup's half
constexpr int kSmemBar = kSmemSum + 2 * kRows * 4;   // uint64 full[2], empty[2]
constexpr int kSmemBytes = kSmemBar + 4 * 8;          // 230944 of 232448

static_assert(kRows * kUnitsPerRow % (kThreads + 128) == 0, "q copies must divide evenly");
static_assert(kSmemBytes <= 232448, "shared memory budget of an H100/H200 CTA");

struct Params {
  const void* q;            // [s_q, h, 576] (strides stride_qs, stride_qh; unit stride last)
  const void* kv;           // [s_kv, 576] (stride stride_kv)
  void* out;                // [s_q, h, 512] of q's dtype, or float32 in partial mode
  float* max_logits;        // [s_q, h] base-2 logits
  float* lse;               // [s_q, h] base 2
  const float* sink;        // [h] natural-log units, or null
  const int* tile_kv;       // plan: [n_tiles_total, 64]
  const int* tile_mask;     // plan: [n_tiles_total, 64]
  const int* prog_tiles;    // plan: [n_progs, prog_cap] tile ids
  const int* prog_ntiles;   // plan: [n_progs]
  const int* indices;       // query-parallel: [s_q, topk] (stride stride_idx)
  const int* topk_length;   // query-parallel: [s_q] or null
  long long stride_qs, stride_qh, stride_kv, stride_idx, stride_os, stride_oh;
  int s_q, s_kv, h, topk, prog_cap;
  int group_size, qp, hb;   // plan group size, queries a program, heads a program (qp * hb <= 64)
  int from_plan;
  float scale2;             // sm_scale * log2(e)
  int skip;                 // measurement only: 1 = no kv gather, 2 = no matrix products (results invalid)
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// byte offset of 16-byte unit `unit` (0..7) of row `row` in a 128-byte-swizzled chunk
__device__ __forceinline__ uint32_t swz(int row, int unit) {
  return row * 128 + ((unit ^ (row & 7)) << 4);
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
// generic-proxy writes (cp.async, st.shared) -> visible to wgmma's async-proxy reads
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// wgmma shared-memory descriptor, 128-byte swizzle. K-major operands: SBO = 1024 (8 rows of 128 B),
// LBO unused. N-major B (V): LBO = distance between 64-column chunks, SBO = 8 kv rows.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (1ull << 62);
}

template <typename T>
struct Mma;
template <>
struct Mma<__nv_bfloat16> {
  __device__ static void qk(float (&d)[16], uint64_t a, uint64_t b, int sc) { wgmma_qk_bf16(d, a, b, sc); }
  __device__ static void pv(float (&d)[128], uint64_t a, uint64_t b) { wgmma_pv_bf16(d, a, b, 1); }
  __device__ static uint32_t pack(float x, float y) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <>
struct Mma<__half> {
  __device__ static void qk(float (&d)[16], uint64_t a, uint64_t b, int sc) { wgmma_qk_f16(d, a, b, sc); }
  __device__ static void pv(float (&d)[128], uint64_t a, uint64_t b) { wgmma_pv_f16(d, a, b, 1); }
  __device__ static uint32_t pack(float x, float y) {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

struct Program {
  int pid, q0, sub, n_tiles, n_valid;
};

// kv row and member bits of slot `slot` of tile `it` (-1 / 0 when the slot holds no valid row)
__device__ __forceinline__ void tile_slot(const Params& p, const Program& pr, int it, int slot, int& row,
                                          uint32_t& bits) {
  if (p.from_plan) {
    const long long t = p.prog_tiles[static_cast<long long>(pr.pid) * p.prog_cap + it];
    row = p.tile_kv[t * kTile + slot];
    bits = static_cast<uint32_t>(p.tile_mask[t * kTile + slot]);
  } else {
    const int pos = it * kTile + slot;
    row = pos < pr.n_valid ? p.indices[static_cast<long long>(pr.q0) * p.stride_idx + pos] : -1;
    bits = 1u;
  }
  if (row < 0 || row >= p.s_kv) {
    row = -1;
    bits = 0u;
  }
}

// ------------------------------------------------------------------------------ mbarriers
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// the 256 consumer threads only (the producer warpgroup never joins)
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, 256;\n" ::: "memory"); }

// ------------------------------------------------------------------------------ producer
// Warpgroup 2 gathers tiles: two threads a kv row, 36 16-byte units each (alternating units so a
// warp's request covers 16 rows x 32 bytes). Tile `it` goes to stage `it & 1` once the consumers
// released the tile two back; its copies land, are fenced for wgmma, and `full[stage]` flips.
// The work-list / index loads of the next tile are issued before waiting, so their dependent
// latency hides behind the current copies.
template <typename T>
__device__ void produce(const Params& p, const Program& pr, uint8_t* smem, uint32_t full, uint32_t empty) {
  const int t = threadIdx.x - 2 * 128;
  const int r = t / 2, half = t % 2;
  const T* kv = static_cast<const T*>(p.kv);
  uint32_t* masks = reinterpret_cast<uint32_t*>(smem + kSmemMask);
  int row = -1;
  uint32_t bits = 0u;
  if (pr.n_tiles > 0) tile_slot(p, pr, 0, r, row, bits);
  for (int it = 0; it < pr.n_tiles; ++it) {
    const int stage = it & 1;
    if (it >= 2) mbar_wait(empty + stage * 8, ((it - 2) >> 1) & 1);
    if (half == 0) masks[stage * kTile + r] = bits;
    const uint32_t dst = smem_u32(smem + kSmemKV + stage * kTileBytes) + r * 128;
    if (!(p.skip & 1)) {
      const T* src = kv + (row >= 0 ? static_cast<long long>(row) * p.stride_kv : 0);
#pragma unroll 4
      for (int k = 0; k < kUnitsPerRow / 2; ++k) {
        const int u = 2 * k + half;
        cp_async16(dst + (u / 8) * kChunkBytes + (((u % 8) ^ (r & 7)) << 4), src + u * 8, row >= 0);
      }
    }
    cp_async_commit();
    if (it + 1 < pr.n_tiles) tile_slot(p, pr, it + 1, r, row, bits);
    cp_async_wait<0>();
    fence_async_smem();
    mbar_arrive(full + stage * 8);
  }
}

template <typename T, typename OutT>
__global__ void __launch_bounds__(kThreads + 128, 1) quilt_sm90_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x, wg = tid / 128, warp = (tid % 128) / 32, lane = tid % 32;
  const int hblock = blockIdx.y;
  const uint32_t full = smem_u32(smem + kSmemBar), empty = full + 16;  // two stages each, 8 bytes a barrier

  Program pr;
  pr.pid = blockIdx.x;
  if (p.from_plan) {
    const int nsub = p.group_size / p.qp;
    pr.sub = pr.pid % nsub;
    pr.q0 = (pr.pid / nsub) * p.group_size + pr.sub * p.qp;
    pr.n_tiles = p.prog_ntiles[pr.pid];
    pr.n_valid = 0;
  } else {
    pr.sub = 0;
    pr.q0 = pr.pid;
    int nv = p.topk;
    if (p.topk_length != nullptr) nv = min(max(p.topk_length[pr.q0], 0), p.topk);
    pr.n_valid = nv;
    pr.n_tiles = (nv + kTile - 1) / kTile;
  }

  // q rows -> shared memory (zero rows for padding), all 384 threads; barriers initialized
  {
    const T* q = static_cast<const T*>(p.q);
    const uint32_t dst0 = smem_u32(smem + kSmemQ);
#pragma unroll
    for (int k = 0; k < kRows * kUnitsPerRow / (kThreads + 128); ++k) {
      const int i = tid + k * (kThreads + 128);
      const int r = i / kUnitsPerRow, u = i % kUnitsPerRow;
      const int mem = r / p.hb, head = hblock * p.hb + r % p.hb, qq = pr.q0 + mem;
      const bool ok = r < p.qp * p.hb && qq < p.s_q && head < p.h;
      const T* src = q + (ok ? qq * p.stride_qs + head * p.stride_qh : 0) + u * 8;
      cp_async16(dst0 + (u / 8) * kChunkBytes + swz(r, u % 8), src, ok);
    }
    cp_async_commit();
    if (tid == 0) {
      for (int st = 0; st < 2; ++st) {
        mbar_init(full + st * 8, 128);
        mbar_init(empty + st * 8, kThreads);
      }
    }
    cp_async_wait<0>();
    fence_async_smem();
    __syncthreads();
  }

  if (wg == 2) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    produce<T>(p, pr, smem, full, empty);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");

  // this thread's two rows (of the warpgroup's 64) and the member bit each row answers to
  const int r0 = warp * 16 + lane / 4;
  int bit[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = r0 + 8 * i;
    bit[i] = r < p.qp * p.hb ? pr.sub * p.qp + r / p.hb : 31;  // bit 31: never set (groups <= 16)
  }

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float* red_max = reinterpret_cast<float*>(smem + kSmemMax);
  float* red_sum = reinterpret_cast<float*>(smem + kSmemSum);
  const uint32_t sq = smem_u32(smem + kSmemQ), sp = smem_u32(smem + kSmemP);

  for (int it = 0; it < pr.n_tiles; ++it) {
    const int stage = it & 1;
    mbar_wait(full + stage * 8, (it >> 1) & 1);
    const uint32_t skv = smem_u32(smem + kSmemKV + stage * kTileBytes);
    float s[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) s[i] = 0.f;
    wgmma_fence();
    if (!(p.skip & 2)) {
#pragma unroll
      for (int c = 0; c < kDqk / 64; ++c) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const uint64_t da = desc_sw128(sq + c * kChunkBytes + k * 32, 16, 1024);
          const uint64_t db = desc_sw128(skv + c * kChunkBytes + wg * 32 * 128 + k * 32, 16, 1024);
          Mma<T>::qk(s, da, db, (c | k) != 0);
        }
      }
    }
    wgmma_commit();
    wgmma_wait0();
    fence_regs(s);

    // mask (member bits, invalid slots) and scale to base-2 logits; this warpgroup's row maxima
    const uint32_t* bits = reinterpret_cast<const uint32_t*>(smem + kSmemMask) + stage * kTile;
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint32_t b = bits[wg * 32 + j * 8 + (lane % 4) * 2 + e];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          float& x = s[j * 4 + i * 2 + e];
          x = ((b >> bit[i]) & 1u) ? x * p.scale2 : -INFINITY;
          mx[i] = fmaxf(mx[i], x);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffff, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffff, mx[i], 2));
      if (lane % 4 == 0) red_max[wg * kRows + r0 + 8 * i] = mx[i];
    }
    consumer_sync();  // (also: both warpgroups are done reading the previous tile's P)
    float alpha[2], m_use[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m_new = fmaxf(m[i], fmaxf(mx[i], red_max[(1 - wg) * kRows + r0 + 8 * i]));
      m_use[i] = m_new == -INFINITY ? 0.f : m_new;
      alpha[i] = exp2f(m[i] - m_use[i]);
      m[i] = m_new;
      l[i] *= alpha[i];
    }
    // P = 2^(S - m) -> shared memory (this warpgroup's 32 columns), row sums, rescale O
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float p0 = exp2f(s[j * 4 + i * 2] - m_use[i]);
        const float p1 = exp2f(s[j * 4 + i * 2 + 1] - m_use[i]);
        l[i] += p0 + p1;
        const int row = r0 + 8 * i, col = wg * 32 + j * 8 + (lane % 4) * 2;
        *reinterpret_cast<uint32_t*>(smem + kSmemP + swz(row, col / 8) + (col % 8) * 2) = Mma<T>::pack(p0, p1);
      }
    }
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      o[j * 4 + 0] *= alpha[0];
      o[j * 4 + 1] *= alpha[0];
      o[j * 4 + 2] *= alpha[1];
      o[j * 4 + 3] *= alpha[1];
    }
    fence_async_smem();
    consumer_sync();

    wgmma_fence();
    if (!(p.skip & 2)) {
#pragma unroll
      for (int k = 0; k < 4; ++k) {  // 16 kv rows a step
        const uint64_t da = desc_sw128(sp + k * 32, 16, 1024);
        const uint64_t db = desc_sw128(skv + wg * 4 * kChunkBytes + k * 16 * 128, kChunkBytes, 1024);
        Mma<T>::pv(o, da, db);
      }
    }
    wgmma_commit();
    wgmma_wait0();
    fence_regs(o);
    mbar_arrive(empty + stage * 8);  // this stage may be refilled
  }

  // the two warpgroups' row sums -> l; normalize and write
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffff, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffff, l[i], 2);
    if (lane % 4 == 0) red_sum[wg * kRows + r0 + 8 * i] = l[i];
  }
  consumer_sync();
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = r0 + 8 * i;
    const int mem = r / p.hb, head = hblock * p.hb + r % p.hb, qq = pr.q0 + mem;
    if (!(r < p.qp * p.hb && qq < p.s_q && head < p.h)) continue;
    const float lt = red_sum[r] + red_sum[kRows + r];
    const bool empty = lt == 0.f;
    const float lse = empty ? INFINITY : m[i] + log2f(lt);
    float fac = empty ? 0.f : 1.f / lt;
    constexpr bool kPartial = sizeof(OutT) == 4;
    if (!kPartial && p.sink != nullptr && !empty) {
      fac *= 1.f / (1.f + expf(p.sink[head] - lse * 0.6931471805599453f));
    }
    OutT* out = static_cast<OutT*>(p.out) + qq * p.stride_os + head * p.stride_oh + wg * 256 + (lane % 4) * 2;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      const float x = o[j * 4 + i * 2] * fac, y = o[j * 4 + i * 2 + 1] * fac;
      if constexpr (kPartial) {
        *reinterpret_cast<float2*>(out + j * 8) = make_float2(x, y);
      } else {
        *reinterpret_cast<uint32_t*>(out + j * 8) = Mma<T>::pack(x, y);
      }
    }
    if (wg == 0 && lane % 4 == 0) {
      p.max_logits[static_cast<long long>(qq) * p.h + head] = m[i];
      p.lse[static_cast<long long>(qq) * p.h + head] = lse;
    }
  }
}

template <typename T, typename OutT>
int launch(const Params& p, int grid_x, int grid_y, cudaStream_t stream) {
  auto kernel = quilt_sm90_kernel<T, OutT>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return static_cast<int>(err);
  kernel<<<dim3(grid_x, grid_y), kThreads + 128, kSmemBytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace quilt_sm90

extern "C" {

// dtype: 0 bf16, 1 fp16; partial: write float32 normalized out (a later pass continues it), no sink
int quilt_sm90_launch(const quilt_sm90::Params* p, int dtype, int partial, int grid_x, int grid_y, void* stream) {
  using namespace quilt_sm90;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (dtype == 0) return partial ? launch<__nv_bfloat16, float>(*p, grid_x, grid_y, s)
                                 : launch<__nv_bfloat16, __nv_bfloat16>(*p, grid_x, grid_y, s);
  return partial ? launch<__half, float>(*p, grid_x, grid_y, s) : launch<__half, __half>(*p, grid_x, grid_y, s);
}

int quilt_sm90_params_size() { return static_cast<int>(sizeof(quilt_sm90::Params)); }
int quilt_sm90_smem_bytes() { return quilt_sm90::kSmemBytes; }
const char* quilt_sm90_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
