// QUILT sparse-attention prefill on Hopper (sm_90a): wgmma tiles over gathered kv rows.
//
// A CTA owns 64 matrix rows (QP neighbouring queries x HB heads, padded to 64) and streams tiles
// of 64 gathered kv rows (d_qk 576 = 512 latent + 64 rope; the values are the first 512 columns).
// Tiles come either from a QUILT plan's per-program work list (each tile column carries the member
// bits of the queries that own its row) or, query-parallel, from one query's own Top-K list.
//
// Warp-specialized, 384 threads; tiles go in pairs (a "block"): tile 2b to buffer 0, 2b+1 to buffer 1.
//   consumer warpgroup 0: S = Q K0^T (m64n64k16), softmax against the running max, then
//                         O[:, 0:256]   += P0 V0 (P0 from registers) + P1 V1 (P1 from shared memory)
//   consumer warpgroup 1: S = Q K1^T, softmax against warpgroup 0's new max, then
//                         O[:, 256:512] += P1 V1 (registers) + P0 V0 (shared memory)
// The two QK products run at the same time; the row max is handed 0 -> 1 -> 0 through shared
// memory (warpgroup 0 stores P0 at its own max, and again, rescaled, only where warpgroup 1 moved it). The
// "max" is a lazy reference: it moves only when a tile exceeds it by more than 2^8, so O and l are rarely
// rescaled (next_max; the true max is tracked apart for max_logits). A producer
// warpgroup gathers rows with 16-byte cp.async (zero-filled for invalid rows) in quarter tiles:
// each buffer's value half 0 (chunks 0-3) and half 1 (chunks 4-8) has its own ready / free
// mbarrier, so a half is refilled as soon as its last reader is done; its slot loads run a block
// ahead. The output goes from registers to global memory, 16 bytes a thread. (v2 split each
// tile's columns between the warpgroups and ran QK, softmax and PV one after another: 11.7 ms at 64
// heads query-parallel; this schedule: 8.3 ms. benchmarks/NOTES.md.)
//
// Persistent: a CTA an SM, each taking work items (a program x a head block; plan programs longest
// first, a query's head blocks next to each other) from a global counter as it finishes the last; query
// programs over more than 64 heads go round-robin instead (CTA x: items x, x + ctas, ...), which keeps a
// query's head blocks on neighbouring CTAs in step, so that the second's gathers meet the first's rows in
// L2 (ncu at h=128: L2 throughput 51% against FlashMLA's 34%, whose launch order pairs them the same way;
// measured -1.4% glm53-like, -4.3% random, benchmarks/NOTES.md session 11). The
// producer moves on to the next program as soon as it has issued the current one's copies: the next
// program's first kv block is gathered while the consumers finish this one, and its q (with the work
// item, through q_ready) once both consumer warpgroups' last QK of the program has completed (q_free):
// the next q then lands under the last PVs and the epilogue.
//
// Shared memory, 128-byte-swizzled 64-column chunks (the layout wgmma's descriptors expect):
//   Q 72 KB | kv buffer 0, 1: 72 KB each (P0 reuses buffer 0's
//   rope chunk once QK is done) | P1 8 KB | member bits, row max, row sums, mbarriers, work items.
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
constexpr int kChunks = kDqk / 64;              // 9
constexpr int kTileBytes = kChunks * kChunkBytes;  // 72 KB
constexpr int kThreads = 384;                   // 2 consumer warpgroups + 1 producer
constexpr float kMaxInit = -1e30f;              // finite start of the running max: no inf - inf

constexpr int kSmemQ = 0;
constexpr int kSmemKV = kSmemQ + kTileBytes;
constexpr int kSmemP0 = kSmemKV + 8 * kChunkBytes;    // buffer 0's rope chunk
constexpr int kSmemP1 = kSmemKV + 2 * kTileBytes;
constexpr int kSmemMask = kSmemP1 + kChunkBytes;      // uint32 [2][64]: member bits of each buffer's slots
constexpr int kSmemMax = kSmemMask + 2 * kTile * 4;   // float [64]: the running max handed between warpgroups
constexpr int kSmemSum = kSmemMax + kRows * 4;        // float [2][2][64]: row sums [program parity][warpgroup]
constexpr int kSmemTmax = kSmemSum + 4 * kRows * 4;   // float [2][64]: warpgroup 1's true row max [program parity]
constexpr int kSmemBar = kSmemTmax + 2 * kRows * 4;   // uint64 ready[2][2], free[2][2] ([buffer][half]), q ready, q free
constexpr int kSmemWork = kSmemBar + 10 * 8;          // int [2] producer's work items, int [2] consumers' ([k & 1])
constexpr int kSmemBytes = kSmemWork + 4 * 4;

static_assert(kRows * kUnitsPerRow % 256 == 0, "q copies must divide evenly over the consumers");
static_assert(kSmemBytes <= 232448, "shared memory budget of an H100/H200 CTA");

// named barriers between the two consumer warpgroups (0 is __syncthreads)
enum : int { kBarMax0 = 1, kBarMax1 = 2, kBarP0 = 3, kBarP1 = 4, kBarSum = 5 };

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
  const int* prog_order;    // plan: [n_progs] launch order (CTA x runs program prog_order[x]), or null
  const int* indices;       // query-parallel: [s_q, topk] (stride stride_idx)
  const int* topk_length;   // query-parallel: [s_q] or null
  long long stride_qs, stride_qh, stride_kv, stride_idx, stride_os, stride_oh;
  int s_q, s_kv, h, topk, prog_cap;
  int group_size, qp, hb;   // plan group size, queries a program, heads a program (qp * hb <= 64)
  int from_plan;
  int n_work, nhb;          // programs x head blocks (work item w: program w / nhb, head block w % nhb)
  int* work_counter;        // work items handed out after each CTA's first (zeroed by the launch)
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
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
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

// the descriptor of the operand `bytes` further on: the start-address field (bits 0-13, address / 16) takes the
// offset without a carry, since every shared-memory address here is below 2^18. One 32-bit add where building
// each k-step's descriptor from its address cost ~10 uniform-datapath instructions (ncu: 14% of the kernel's).
__device__ __forceinline__ uint64_t desc_at(uint64_t d, uint32_t bytes) {
  uint64_t r;
  asm("mov.b64 %0, {%1, %2};\n" : "=l"(r) : "r"(static_cast<uint32_t>(d) + (bytes >> 4)), "r"(static_cast<uint32_t>(d >> 32)));
  return r;
}

template <typename T>
struct Mma;
template <>
struct Mma<__nv_bfloat16> {
  __device__ static void qk(float (&d)[32], uint64_t a, uint64_t b, int sc) { wgmma_qk_bf16(d, a, b, sc); }
  __device__ static void pv(float (&d)[128], uint64_t a, uint64_t b) { wgmma_pv_ss_bf16(d, a, b, 1); }
  __device__ static void pv(float (&d)[128], const uint32_t (&a)[4], uint64_t b) { wgmma_pv_rs_bf16(d, a, b, 1); }
  __device__ static uint32_t pack(float x, float y) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};
template <>
struct Mma<__half> {
  __device__ static void qk(float (&d)[32], uint64_t a, uint64_t b, int sc) { wgmma_qk_f16(d, a, b, sc); }
  __device__ static void pv(float (&d)[128], uint64_t a, uint64_t b) { wgmma_pv_ss_f16(d, a, b, 1); }
  __device__ static void pv(float (&d)[128], const uint32_t (&a)[4], uint64_t b) { wgmma_pv_rs_f16(d, a, b, 1); }
  __device__ static uint32_t pack(float x, float y) {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<uint32_t*>(&v);
  }
};

struct Program {
  int pid, q0, sub, n_tiles, n_valid;
};

// ------------------------------------------------------------------------------ barriers
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// one more arrival, made when this thread's cp.async copies issued so far have landed
__device__ __forceinline__ void mbar_arrive_copies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// waits on a kv half the producer filled; its cp.async writes then feed wgmma (async proxy)
__device__ __forceinline__ void wait_ready(uint32_t bar, int parity) {
  mbar_wait(bar, parity);
  fence_async_smem();
}
// named barriers over the 256 consumer threads (the producer warpgroup never joins)
template <int kId>
__device__ __forceinline__ void bar_sync() { asm volatile("bar.sync %0, 256;\n" ::"n"(kId) : "memory"); }
// QUILT_SANITIZER_SYNC (a compute-sanitizer build, benchmarks/sanitize_cuda.py --strict-sync): every
// hand-off becomes one racecheck models, a rendezvous instead of bar.arrive and the producer's copies
// waited for before plain arrivals instead of cp.async.mbarrier.arrive; the default build's racecheck
// reports are then told apart from real races.
template <int kId>
__device__ __forceinline__ void bar_arrive() {
#ifdef QUILT_SANITIZER_SYNC
  asm volatile("bar.sync %0, 256;\n" ::"n"(kId) : "memory");
#else
  asm volatile("bar.arrive %0, 256;\n" ::"n"(kId) : "memory");
#endif
}

// QUILT_TIMELINE (measurement build, benchmarks/boundary_timeline.py): clock64 stamps of one thread a role
// at a program's boundary, [CTA][program k][slot], read back with quilt_sm90_timeline()
#ifdef QUILT_TIMELINE
constexpr int kTlCtas = 132, kTlProgs = 512, kTlSlots = 10;
__device__ unsigned long long g_timeline[kTlCtas * kTlProgs * kTlSlots];
__device__ __forceinline__ void stamp(int k, int slot, unsigned long long v) {
  if (blockIdx.x < kTlCtas && k < kTlProgs) g_timeline[(blockIdx.x * kTlProgs + k) * kTlSlots + slot] = v;
}
#define QUILT_STAMP(k, slot) stamp((k), (slot), clock64())
#else
#define QUILT_STAMP(k, slot)
#endif

struct Bars {
  uint32_t base;
  __device__ uint32_t ready(int buf, int half) const { return base + (buf * 2 + half) * 8; }
  __device__ uint32_t free(int buf, int half) const { return base + 32 + (buf * 2 + half) * 8; }
  __device__ uint32_t q_ready() const { return base + 64; }  // q rows of the CTA's current program landed
  __device__ uint32_t q_free() const { return base + 72; }   // the previous program's QKs are done with q
};

// Work item w of a persistent CTA: program w / nhb (the plan's launch order: longest first), head block
// w % nhb. A query's head blocks are neighbours in the order, so at h > 64 they gather the same rows
// at about the same time and the second finds them in L2.
__device__ __forceinline__ Program program_of(const Params& p, int w, int& hblock) {
  Program pr;
  const int x = w / p.nhb;
  hblock = w - x * p.nhb;
  pr.pid = p.from_plan && p.prog_order != nullptr ? p.prog_order[x] : x;
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
  return pr;
}

// Matrix row r (0..63) of a program: query q0 + r / hb, head hblock * hb + r % hb (hb a power of two:
// shifts instead of divisions); ok is false for padding rows and rows past s_q or h.
struct RowOf {
  int qq, head;
  bool ok;
};
__device__ __forceinline__ RowOf row_of(const Params& p, const Program& pr, int hblock, int r) {
  const int lhb = __ffs(p.hb) - 1;
  RowOf x;
  x.head = hblock * p.hb + (r & (p.hb - 1));
  x.qq = pr.q0 + (r >> lhb);
  x.ok = r < p.qp * p.hb && x.qq < p.s_q && x.head < p.h;
  return x;
}

// ------------------------------------------------------------------------------ producer
// Warpgroup 2 gathers: 8 threads cover one row's 128-byte chunk (a warp request = 4 whole chunks),
// thread group g (0..15) owns slots g, g+16, g+32, g+48 of both tiles of a block. Halves go in
// the order the consumers need them: buffer 0 half 0, buffer 1 half 1, buffer 0 half 1, buffer 1
// half 0 (warpgroup 0 starts QK on chunks 0-3, warpgroup 1 on chunks 4-8). A ready barrier counts
// 128 plain arrivals (after the member bits are stored) and 128 copy-completion arrivals.
//
// The slot loads run ahead so that their latency stays off the producer's path (profiled: with
// each block's rows loaded and checked just before its copies, both consumer warpgroups spent most
// of their time waiting for the producer): a block's kv rows and member bits are loaded while the
// block before it is copied, a plan's tile ids two blocks ahead, and rows are checked at use.
struct Slots {
  int row[2][4];       // raw kv row of slot g + 16 j of tile 2b + buf (-1: none)
  uint32_t bits[2][4];  // member bits (plan) or 1 (query-parallel)
};

__device__ __forceinline__ void load_tile_ids(const Params& p, const Program& pr, int b, int (&tile)[2]) {
#pragma unroll
  for (int buf = 0; buf < 2; ++buf) {
    const int it = 2 * b + buf;
    tile[buf] = p.from_plan && it < pr.n_tiles ? p.prog_tiles[static_cast<long long>(pr.pid) * p.prog_cap + it] : -1;
  }
}

__device__ __forceinline__ void load_slots(const Params& p, const Program& pr, int b, int g, const int (&tile)[2],
                                           Slots& sl) {
#pragma unroll
  for (int buf = 0; buf < 2; ++buf) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int slot = g + 16 * j;
      if (p.from_plan) {
        const long long at = static_cast<long long>(tile[buf]) * kTile + slot;
        sl.row[buf][j] = tile[buf] >= 0 ? p.tile_kv[at] : -1;
        sl.bits[buf][j] = tile[buf] >= 0 ? static_cast<uint32_t>(p.tile_mask[at]) : 0u;
      } else {
        const int pos = (2 * b + buf) * kTile + slot;
        sl.row[buf][j] = pos < pr.n_valid ? p.indices[static_cast<long long>(pr.q0) * p.stride_idx + pos] : -1;
        sl.bits[buf][j] = 1u;
      }
    }
  }
}

// Program k of this CTA (work item w: program pr, head block hblock): q rows -> shared memory (zero
// rows for padding) once the previous program's QKs are done with it, then the work item
// for the consumers; q_ready completes when both have landed. w >= n_work tells the consumers to stop.
template <typename T>
__device__ __forceinline__ void hand_over(const Params& p, int w, const Program& pr, int hblock, int k, int t,
                                          uint8_t* smem, const Bars& bars) {
  mbar_wait(bars.q_free(), (k & 1) ^ 1);
  if (t == 0) QUILT_STAMP(k, 4);
  if (w < p.n_work) {
    // as the kv gather: 8 threads a row's 128-byte chunk, rows g, g + 16, g + 32, g + 48 (a row's address
    // once, not a division a copy: the boundary timeline had this loop at ~4300 cycles)
    const T* q = static_cast<const T*>(p.q);
    const uint32_t dst0 = smem_u32(smem + kSmemQ);
    const int unit = t % 8, g = t / 8;
#pragma unroll 1
    for (int j = 0; j < 4; ++j) {  // (not unrolled: the producer has 72 registers)
      const int r = g + 16 * j;
      const RowOf x = row_of(p, pr, hblock, r);
      const T* src = q + (x.ok ? x.qq * p.stride_qs + x.head * p.stride_qh : 0) + unit * 8;
#pragma unroll
      for (int c = 0; c < kChunks; ++c) cp_async16(dst0 + c * kChunkBytes + swz(r, unit), src + c * 64, x.ok);
    }
#ifdef QUILT_SANITIZER_SYNC
    cp_async_commit();
    cp_async_wait<0>();
    fence_async_smem();
    mbar_arrive(bars.q_ready());
#else
    mbar_arrive_copies(bars.q_ready());
#endif
    if (t == 0) QUILT_STAMP(k, 5);
  } else {
    mbar_arrive(bars.q_ready());
  }
  if (t == 0) {
    reinterpret_cast<int*>(smem + kSmemWork)[2 + (k & 1)] = w;
    mbar_arrive(bars.q_ready());
  }
}

// The producer runs ahead of the consumers across programs: the next program's first kv block is
// gathered while the consumers finish the current one, and its q as soon as their last QK is done.
template <typename T>
__device__ void produce(const Params& p, uint8_t* smem, const Bars& bars) {
  const int t = threadIdx.x - 256, unit = t % 8, g = t / 8;
  const T* kv = static_cast<const T*>(p.kv);
  uint32_t* masks = reinterpret_cast<uint32_t*>(smem + kSmemMask);
  Slots cur, nxt;
  int tile_n[2], tile_nn[2];  // plan tile ids of blocks b + 1, b + 2
  auto fill = [&](int buf, int half, int phase) {
    mbar_wait(bars.free(buf, half), phase ^ 1);
    bool ok[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) ok[j] = cur.row[buf][j] >= 0 && cur.row[buf][j] < p.s_kv;
    if (half == buf && unit == 0) {  // the half each buffer's consumer waits for first carries the bits
#pragma unroll
      for (int j = 0; j < 4; ++j) masks[buf * kTile + g + 16 * j] = ok[j] ? cur.bits[buf][j] : 0u;
    }
    const int c0 = half ? 4 : 0, c1 = half ? kChunks : 4;
    if (!(p.skip & 1)) {
      const uint32_t dst = smem_u32(smem + kSmemKV + buf * kTileBytes);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = g + 16 * j;
        const T* src = kv + (ok[j] ? static_cast<long long>(cur.row[buf][j]) * p.stride_kv : 0) + unit * 8;
#pragma unroll
        for (int c = c0; c < c1; ++c) cp_async16(dst + c * kChunkBytes + swz(r, unit), src + c * 64, ok[j]);
      }
    }
#ifdef QUILT_SANITIZER_SYNC
    cp_async_commit();
    cp_async_wait<0>();
    fence_async_smem();
    mbar_arrive(bars.ready(buf, half));
    mbar_arrive(bars.ready(buf, half));
#else
    mbar_arrive(bars.ready(buf, half));
    mbar_arrive_copies(bars.ready(buf, half));
#endif
  };
  int gb = 0;  // kv blocks of the CTA's earlier programs: the ready / free barriers' phase
  volatile int* next = reinterpret_cast<int*>(smem + kSmemWork);
  const bool round_robin = !p.from_plan && p.nhb > 1;
  for (int k = 0;; ++k) {
    // work items: blockIdx.x first, then whatever is left (longest programs first), one at a time; or
    // round-robin (query programs in head blocks: equal lengths up to topk_length, pairs kept in step)
    if (t == 0) {
      next[k & 1] = k == 0 ? blockIdx.x
                  : round_robin ? blockIdx.x + k * gridDim.x
                                : gridDim.x + atomicAdd(p.work_counter, 1);
    }
    asm volatile("bar.sync 9, 128;\n" ::: "memory");
    const int w = next[k & 1];
    if (w >= p.n_work) {
      hand_over<T>(p, w, Program{}, 0, k, t, smem, bars);
      break;
    }
    int hblock;
    const Program pr = program_of(p, w, hblock);
    const int n_blocks = (pr.n_tiles + 1) / 2;
    int tile0[2];
    load_tile_ids(p, pr, 0, tile0);
    load_tile_ids(p, pr, 1, tile_n);
    load_slots(p, pr, 0, g, tile0, cur);
    // q first: the consumers free its shared memory after their last QK of the previous program, before
    // the last PVs that free the kv buffers, so its wait is the shorter one
    hand_over<T>(p, w, pr, hblock, k, t, smem, bars);
    for (int b = 0; b < n_blocks; ++b) {
      const int phase = (gb + b) & 1;
      load_slots(p, pr, b + 1, g, tile_n, nxt);  // (past the end: no loads, all slots -1)
      load_tile_ids(p, pr, b + 2, tile_nn);
      fill(0, 0, phase);
      fill(1, 1, phase);
      fill(0, 1, phase);
      fill(1, 0, phase);
      cur = nxt;
      tile_n[0] = tile_nn[0];
      tile_n[1] = tile_nn[1];
    }
    gb += n_blocks;
  }
  cp_async_wait<0>();
}

// ------------------------------------------------------------------------------ consumers
template <typename T>
__device__ __forceinline__ void qk_chunks(float (&s)[32], uint32_t sq, uint32_t skv, int c0, int c1, bool first) {
  const uint64_t dq = desc_sw128(sq, 16, 1024), dkv = desc_sw128(skv, 16, 1024);
#pragma unroll
  for (int c = c0; c < c1; ++c) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t off = c * kChunkBytes + k * 32;
      Mma<T>::qk(s, desc_at(dq, off), desc_at(dkv, off), (first && c == c0 && k == 0) ? 0 : 1);
    }
  }
}

// O[:, 256 wg ...] += P V with P (64 x 64) in registers, as the QK accumulator layout gives it
template <typename T>
__device__ __forceinline__ void pv_regs(float (&o)[128], const uint32_t (&pk)[16], uint32_t skv, int wg) {
  const uint64_t dv = desc_sw128(skv + wg * 4 * kChunkBytes, kChunkBytes, 1024);
#pragma unroll
  for (int k = 0; k < 4; ++k) {  // 16 kv rows a step
    const uint32_t a[4] = {pk[4 * k], pk[4 * k + 1], pk[4 * k + 2], pk[4 * k + 3]};
    Mma<T>::pv(o, a, desc_at(dv, k * 16 * 128));
  }
}

// the same with P in shared memory (the other warpgroup's tile)
template <typename T>
__device__ __forceinline__ void pv_smem(float (&o)[128], uint32_t sp, uint32_t skv, int wg) {
  const uint64_t dp = desc_sw128(sp, 16, 1024), dv = desc_sw128(skv + wg * 4 * kChunkBytes, kChunkBytes, 1024);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    Mma<T>::pv(o, desc_at(dp, k * 32), desc_at(dv, k * 16 * 128));
  }
}

// P (fp32 accumulator layout, times `f`) -> packed 16-bit A fragments: k-step k takes columns
// 16k..16k+15, i.e. accumulator column groups 2k and 2k+1
template <typename T>
__device__ __forceinline__ void pack_p(uint32_t (&pk)[16], const float (&s)[32], const float (&f)[2]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    pk[2 * j] = Mma<T>::pack(s[j * 4 + 0] * f[0], s[j * 4 + 1] * f[0]);
    pk[2 * j + 1] = Mma<T>::pack(s[j * 4 + 2] * f[1], s[j * 4 + 3] * f[1]);
  }
}
// wgmma A fragment order per k-step: (row r, cols c..c+1), (row r+8, c..), (row r, c+8..), (row r+8, c+8..)
// = pk[4k], pk[4k+1], pk[4k+2], pk[4k+3] with the packing above (groups 2k -> 4k, 4k+1; 2k+1 -> 4k+2, 4k+3).

// P (this warp's 16 rows of it) -> shared memory, 128-byte-swizzled as wgmma reads it: four stmatrix x4, each
// storing 8 x 8 blocks (rows 0-7 / 8-15 of the warp) x (16-byte column units 2jj, 2jj + 1), whose fragments are
// the accumulator layout's (lane l: row l / 4, columns 2 (l % 4) + {0, 1}). Lanes 8m .. 8m + 7 give the rows of
// block m. (Sixteen 4-byte stores a thread before.)
__device__ __forceinline__ void store_p(uint8_t* smem, int sp_off, const uint32_t (&pk)[16], int r0, int lane) {
  const int m = lane / 8, row = (r0 & ~15) + (m & 1) * 8 + lane % 8;
#pragma unroll
  for (int jj = 0; jj < 4; ++jj) {
    const uint32_t addr = smem_u32(smem + sp_off + swz(row, 2 * jj + (m >> 1)));
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(pk[4 * jj]),
                 "r"(pk[4 * jj + 1]), "r"(pk[4 * jj + 2]), "r"(pk[4 * jj + 3])
                 : "memory");
  }
}

// mask by member bits (invalid slots carry none; row i answers to bit mask rowbit[i]) and the tile's row maxima
// in base-2 logits. The logits stay unscaled: the softmax scales them inside its exponent (one fma).
__device__ __forceinline__ void mask_max(float (&s)[32], float (&mx)[2], const uint32_t* bits, const uint32_t (&rowbit)[2],
                                         float scale2, int lane) {
  mx[0] = mx[1] = -INFINITY;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const uint32_t b = bits[j * 8 + (lane % 4) * 2 + e];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float& x = s[j * 4 + i * 2 + e];
        x = (b & rowbit[i]) ? x : -INFINITY;
        mx[i] = fmaxf(mx[i], x);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffff, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffff, mx[i], 2));
    mx[i] *= scale2;  // (scale2 > 0: the max of the scaled logits)
  }
}

// The running max (the softmax's reference) after a tile whose max is mx: it moves only when the tile
// exceeds it by more than kRescaleSlack (base-2 units), so that O and l are rarely rescaled. Exact up to
// rounding: P <= 2^slack, and O, l and the lse share the reference; the true max is kept apart for
// max_logits. (Measured 1-5% faster than moving it with every larger logit: benchmarks/NOTES.md.)
constexpr float kRescaleSlack = 8.f;
__device__ __forceinline__ float next_max(float m, float mx) {
  return mx > m + kRescaleSlack ? mx : m;
}

// true when every row of the warp keeps its reference (f == 1 exactly): multiplying by f changes nothing
__device__ __forceinline__ bool warp_unchanged(const float (&f)[2]) {
  return __all_sync(0xffffffff, f[0] == 1.f && f[1] == 1.f);
}

// O's two rows of this thread times f[0], f[1] (accumulator layout of m64n256)
__device__ __forceinline__ void scale_rows(float (&o)[128], const float (&f)[2]) {
#pragma unroll
  for (int j = 0; j < 32; ++j) {
    o[j * 4 + 0] *= f[0];
    o[j * 4 + 1] *= f[0];
    o[j * 4 + 2] *= f[1];
    o[j * 4 + 3] *= f[1];
  }
}

// s <- 2^(s scale2 - m_new) (s: unscaled logits); l, o rescaled to m_new and l += row sums; m <- m_new
__device__ __forceinline__ void softmax_step(float (&s)[32], float (&o)[128], float (&m)[2], float (&l)[2],
                                             const float (&m_new)[2], float scale2) {
  float alpha[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    alpha[i] = exp2f(m[i] - m_new[i]);
    m[i] = m_new[i];
    l[i] *= alpha[i];
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      s[j * 4 + i * 2] = exp2f(fmaf(s[j * 4 + i * 2], scale2, -m_new[i]));
      s[j * 4 + i * 2 + 1] = exp2f(fmaf(s[j * 4 + i * 2 + 1], scale2, -m_new[i]));
      l[i] += s[j * 4 + i * 2] + s[j * 4 + i * 2 + 1];
    }
  }
  if (!warp_unchanged(alpha)) scale_rows(o, alpha);
}

// kMma = false (measurement only, results invalid) leaves out the matrix products; a compile-time
// switch, since ptxas serializes wgmma issued under a runtime branch of this kind
// softmax of this warpgroup's tile against `m_new`, the new running max published for the other
// warpgroup (named barrier kBarDone), then O += P V over this warpgroup's own tile (P from registers);
// warpgroup 0 also stores its P to shared memory (P0, for warpgroup 1) before that PV
template <typename T, bool kMma, int kBarDone>
__device__ __forceinline__ void softmax_publish_pv(float (&s)[32], float (&o)[128], float (&m)[2], float (&l)[2],
                                                   const float (&m_new)[2], float scale2, uint32_t (&pk)[16],
                                                   float* red_max, int r0, int lane, uint32_t skv, int wg,
                                                   bool own_tile, uint8_t* smem) {
  softmax_step(s, o, m, l, m_new, scale2);
  if (lane % 4 == 0) {
    red_max[r0] = m[0];
    red_max[r0 + 8] = m[1];
  }
  bar_arrive<kBarDone>();
  const float one[2] = {1.f, 1.f};
  pack_p<T>(pk, s, one);
  // warpgroup 0 stores P0 for warpgroup 1's P0 V0 now, at its own max: the block's max rarely moves
  // (next_max), and the store is then off the hand-off path (measured -0.3 to -3%)
  if constexpr (kBarDone == kBarMax0) store_p(smem, kSmemP0, pk, r0, lane);
  wgmma_fence();
  if (kMma && own_tile) pv_regs<T>(o, pk, skv, wg);
  wgmma_commit();
}

// 4 x 4 transpose of 32-bit words across a quad (lanes 4n..4n+3), two butterfly steps: lane q's v[c] becomes
// lane c's v[q]. Applied to packed output pairs it turns four 4-byte pieces of four column groups into one
// 16-byte piece of one group.
__device__ __forceinline__ void quad_transpose(uint32_t (&v)[4], int q) {
#pragma unroll
  for (int m = 1; m <= 2; m *= 2) {
    const bool up = q & m;
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (c & m) continue;
      const uint32_t got = __shfl_xor_sync(0xffffffff, up ? v[c] : v[c ^ m], m);
      if (up) {
        v[c] = got;
      } else {
        v[c ^ m] = got;
      }
    }
  }
}

// after a QK batch: wait for it and hand its accumulators to ordinary code
template <bool kMma>
__device__ __forceinline__ void qk_done(float (&s)[32]) {
  wgmma_commit();
  wgmma_wait<0>();
  if constexpr (!kMma) {
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.f;
  }
  fence_regs(s);
}

// One program of a consumer warpgroup: its kv blocks, then normalize and write the output. `gb`: kv
// blocks of the CTA's earlier programs (the barriers' phase), `k`: the CTA's earlier programs.
template <typename T, typename OutT, bool kMma, int wg>
__device__ __forceinline__ void consume(const Params& p, const Program& pr, int hblock, int k, int gb,
                                        uint8_t* smem, const Bars& bars) {
  const int tid = threadIdx.x, warp = (tid % 128) / 32, lane = tid % 32;
  const int n_blocks = (pr.n_tiles + 1) / 2;

  // this thread's two rows (of the 64) and the member bit each row answers to (as a mask)
  const int r0 = warp * 16 + lane / 4;
  uint32_t rowbit[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = r0 + 8 * i;
    rowbit[i] = r < p.qp * p.hb ? 1u << (pr.sub * p.qp + r / p.hb) : 0u;  // (padding rows: no member)
  }

  float o[128];
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  float m[2] = {kMaxInit, kMaxInit}, l[2] = {0.f, 0.f};
  float mt[2] = {-INFINITY, -INFINITY};  // true max of this warpgroup's logits (m may lag it: next_max)
  float* red_max = reinterpret_cast<float*>(smem + kSmemMax);
  // (parity-buffered: a next program's sums may be written before the other warpgroup has read these
  // when that program has no blocks)
  float* red_sum = reinterpret_cast<float*>(smem + kSmemSum) + (k & 1) * 2 * kRows;
  float* red_tmax = reinterpret_cast<float*>(smem + kSmemTmax) + (k & 1) * kRows;
  const uint32_t* masks = reinterpret_cast<const uint32_t*>(smem + kSmemMask);
  const uint32_t sq = smem_u32(smem + kSmemQ);
  const uint32_t skv0 = smem_u32(smem + kSmemKV), skv1 = skv0 + kTileBytes;
  float s[32];
  uint32_t pk[16];

  if constexpr (wg == 0) {
    // S = Q K0^T for block 0 (later blocks are issued under the previous block's last PV)
    if (n_blocks > 0) {
      wgmma_fence();
      wait_ready(bars.ready(0, 0), gb & 1);
      if constexpr (kMma) qk_chunks<T>(s, sq, skv0, 0, 4, true);
      wait_ready(bars.ready(0, 1), gb & 1);
      if constexpr (kMma) qk_chunks<T>(s, sq, skv0, 4, kChunks, false);
      qk_done<kMma>(s);
      if (tid == 0) QUILT_STAMP(k, 3);
    }
    for (int b = 0, phase = gb & 1; b < n_blocks; ++b, phase ^= 1) {
      const bool has1 = 2 * b + 1 < pr.n_tiles;
      if (b == n_blocks - 1) mbar_arrive(bars.q_free());  // every QK of the program is done
      float mx[2], m_new[2];
      mask_max(s, mx, masks, rowbit, p.scale2, lane);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        m_new[i] = next_max(m[i], mx[i]);
        mt[i] = fmaxf(mt[i], mx[i]);
      }
      softmax_publish_pv<T, kMma, kBarMax0>(s, o, m, l, m_new, p.scale2, pk, red_max, r0, lane, skv0, 0, true, smem);
      wgmma_wait<0>();
      fence_regs(o);
      mbar_arrive(bars.free(0, 0));

      // warpgroup 1's max is the block's: rescale P0 to it, publish P0, then take P1 V1
      bar_sync<kBarMax1>();
      float f[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float mb = red_max[r0 + 8 * i];
        f[i] = exp2f(m[i] - mb);
        m[i] = mb;
        l[i] *= f[i];
      }
      const bool same = warp_unchanged(f);
      if (!same) {  // (else P0 in shared memory is already at this max)
        pack_p<T>(pk, s, f);
        store_p(smem, kSmemP0, pk, r0, lane);
      }
      fence_async_smem();
      bar_arrive<kBarP0>();
      mbar_arrive(bars.free(0, 1));
      if (!same) scale_rows(o, f);
      bar_sync<kBarP1>();
      wgmma_fence();
      if (kMma && has1) pv_smem<T>(o, smem_u32(smem + kSmemP1), skv1, 0);
      wgmma_commit();
      if (b + 1 < n_blocks) {
        wait_ready(bars.ready(0, 0), phase ^ 1);
        if constexpr (kMma) qk_chunks<T>(s, sq, skv0, 0, 4, true);
        wgmma_commit();
        wgmma_wait<1>();
        mbar_arrive(bars.free(1, 0));
        wait_ready(bars.ready(0, 1), phase ^ 1);
        if constexpr (kMma) qk_chunks<T>(s, sq, skv0, 4, kChunks, false);
        qk_done<kMma>(s);
      } else {
        wgmma_wait<0>();
        mbar_arrive(bars.free(1, 0));
      }
      fence_regs(o);
    }
  } else {
    for (int b = 0, phase = gb & 1; b < n_blocks; ++b, phase ^= 1) {
      const bool has1 = 2 * b + 1 < pr.n_tiles;
      float mx[2];
      if (has1) {
        wgmma_fence();
        wait_ready(bars.ready(1, 1), phase);
        if constexpr (kMma) qk_chunks<T>(s, sq, skv1, 4, kChunks, true);
        wait_ready(bars.ready(1, 0), phase);
        if constexpr (kMma) qk_chunks<T>(s, sq, skv1, 0, 4, false);
        qk_done<kMma>(s);
        if (tid == 128 && b == 0) QUILT_STAMP(k, 6);
        mask_max(s, mx, masks + kTile, rowbit, p.scale2, lane);
#pragma unroll
        for (int i = 0; i < 2; ++i) mt[i] = fmaxf(mt[i], mx[i]);
      } else {  // padding tile: nothing to add
#pragma unroll
        for (int i = 0; i < 32; ++i) s[i] = -INFINITY;
        mx[0] = mx[1] = -INFINITY;
      }
      if (b == n_blocks - 1) mbar_arrive(bars.q_free());
      bar_sync<kBarMax0>();
      float m_new[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) m_new[i] = next_max(red_max[r0 + 8 * i], mx[i]);
      __syncwarp();
      softmax_publish_pv<T, kMma, kBarMax1>(s, o, m, l, m_new, p.scale2, pk, red_max, r0, lane, skv1, 1, has1, smem);
      if (has1) store_p(smem, kSmemP1, pk, r0, lane);  // (P1 V1 runs meanwhile)
      bar_sync<kBarP0>();
      wgmma_fence();
      if constexpr (kMma) pv_smem<T>(o, smem_u32(smem + kSmemP0), skv0, 1);
      wgmma_commit();
      fence_async_smem();
      bar_arrive<kBarP1>();
      wgmma_wait<1>();
      mbar_arrive(bars.free(1, 1));
      wgmma_wait<0>();
      fence_regs(o);
      mbar_arrive(bars.free(0, 1));
    }
  }

  if (tid == 128) QUILT_STAMP(k, 9);
  if (tid == 0) {
    QUILT_STAMP(k, 0);
#ifdef QUILT_TIMELINE
    stamp(k, 7, static_cast<unsigned long long>(n_blocks));
#endif
  }
  // this thread's rows again, from a thread index read here: ptxas hoisted the rows' query / head to the
  // consumer's start and spilled them across the block loop (reloaded from local memory in every epilogue)
  int tid_here;
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid_here));
  const int r0e = (tid_here % 128) / 32 * 16 + (tid_here % 32) / 4;  // = r0
  // the two warpgroups' row sums -> l (both hold the same reference max); normalize and write
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffff, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffff, l[i], 2);
    if (lane % 4 == 0) red_sum[wg * kRows + r0e + 8 * i] = l[i];
    if (wg == 1 && lane % 4 == 0) red_tmax[r0e + 8 * i] = mt[i];
  }
  bar_sync<kBarSum>();
  if (tid == 0) QUILT_STAMP(k, 8);
  if (n_blocks == 0) mbar_arrive(bars.q_free());  // (no QK: arrived here instead)
  constexpr bool kPartial = sizeof(OutT) == 4;
  const int quad = lane % 4;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = r0e + 8 * i;
    const RowOf x = row_of(p, pr, hblock, r);  // (a quad's four lanes share the row: shuffles below)
    const int qq = x.qq, head = x.head;
    const bool ok = x.ok;
    const float lt = red_sum[r] + red_sum[kRows + r];
    const bool empty = lt == 0.f;
    const float lse = empty ? INFINITY : m[i] + log2f(lt);
    float fac = empty ? 0.f : 1.f / lt;
    if (!kPartial && p.sink != nullptr && !empty && ok) {
      fac *= 1.f / (1.f + expf(p.sink[head] - lse * 0.6931471805599453f));
    }
    OutT* out = static_cast<OutT*>(p.out) + (ok ? qq * p.stride_os + head * p.stride_oh : 0) + wg * 256;
    if constexpr (kPartial) {
      if (ok) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          *reinterpret_cast<float2*>(out + j * 8 + quad * 2) =
              make_float2(o[j * 4 + i * 2] * fac, o[j * 4 + i * 2 + 1] * fac);
        }
      }
    } else {
      // straight from registers, 16 bytes a thread (no stage: q's shared memory already holds the next q)
#pragma unroll
      for (int a = 0; a < 8; ++a) {
        uint32_t v[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          v[c] = Mma<T>::pack(o[(4 * a + c) * 4 + i * 2] * fac, o[(4 * a + c) * 4 + i * 2 + 1] * fac);
        }
        quad_transpose(v, quad);
        if (ok) *reinterpret_cast<uint4*>(out + (4 * a + quad) * 8) = make_uint4(v[0], v[1], v[2], v[3]);
      }
    }
    if (ok && wg == 0 && quad == 0) {
      const float mlog = fmaxf(mt[i], red_tmax[r]);
      p.max_logits[static_cast<long long>(qq) * p.h + head] = empty ? -INFINITY : mlog;
      p.lse[static_cast<long long>(qq) * p.h + head] = lse;
    }
  }
  if (tid == 0) QUILT_STAMP(k, 1);
}

// A consumer warpgroup's programs, until the producer hands over the end
template <typename T, typename OutT, bool kMma, int wg>
__device__ __forceinline__ void consume_programs(const Params& p, uint8_t* smem, const Bars& bars) {
  const volatile int* work = reinterpret_cast<const int*>(smem + kSmemWork) + 2;
  for (int k = 0, gb = 0;; ++k) {
    wait_ready(bars.q_ready(), k & 1);
    if (threadIdx.x == 0) QUILT_STAMP(k, 2);
    const int w = work[k & 1];
    if (w >= p.n_work) break;
    int hblock;
    const Program pr = program_of(p, w, hblock);
    consume<T, OutT, kMma, wg>(p, pr, hblock, k, gb, smem, bars);
    gb += (pr.n_tiles + 1) / 2;
  }
}

template <typename T, typename OutT, bool kMma>
__global__ void __launch_bounds__(kThreads, 1) quilt_sm90_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x;
  // warpgroup index, visibly warp-uniform: ptxas serializes wgmma issued under a branch it cannot prove uniform
  const int wg = __shfl_sync(0xffffffff, tid / 128, 0);
  const Bars bars{smem_u32(smem + kSmemBar)};
  if (tid == 0) {
    for (int i = 0; i < 4; ++i) {
      mbar_init(bars.ready(i / 2, i % 2), 256);
      // buffer 0's half 1 also holds P0: warpgroup 0 (P0 written) and 1 (P0 V0 done) both release it
      mbar_init(bars.free(i / 2, i % 2), i == 1 ? 256 : 128);
    }
    mbar_init(bars.q_ready(), 129);  // the copies of 128 producer threads, the work item
    mbar_init(bars.q_free(), 256);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 2) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 72;\n");
    produce<T>(p, smem, bars);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 216;\n");
  // persistent: the producer hands over each program's work item with its q (a loop a warpgroup:
  // with both in one loop body ptxas spilled the accumulators)
  if (wg == 0) {
    consume_programs<T, OutT, kMma, 0>(p, smem, bars);
  } else {
    consume_programs<T, OutT, kMma, 1>(p, smem, bars);
  }
}

template <typename T, typename OutT, bool kMma = true>
int launch(const Params& p, int ctas, cudaStream_t stream) {
  auto kernel = quilt_sm90_kernel<T, OutT, kMma>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (err != cudaSuccess) return static_cast<int>(err);
  err = cudaMemsetAsync(p.work_counter, 0, sizeof(int), stream);
  if (err != cudaSuccess) return static_cast<int>(err);
  kernel<<<ctas, kThreads, kSmemBytes, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace quilt_sm90

extern "C" {

// dtype: 0 bf16, 1 fp16; partial: write float32 normalized out (a later pass continues it), no sink;
// ctas: persistent CTAs (one an SM; p->n_work of them run one work item each)
int quilt_sm90_launch(const quilt_sm90::Params* p, int dtype, int partial, int ctas, void* stream) {
  using namespace quilt_sm90;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p->skip & 2) {  // measurement build: bf16, final output only
    if (dtype != 0 || partial) return static_cast<int>(cudaErrorInvalidValue);
    return launch<__nv_bfloat16, __nv_bfloat16, false>(*p, ctas, s);
  }
  if (dtype == 0) return partial ? launch<__nv_bfloat16, float>(*p, ctas, s)
                                 : launch<__nv_bfloat16, __nv_bfloat16>(*p, ctas, s);
  return partial ? launch<__half, float>(*p, ctas, s) : launch<__half, __half>(*p, ctas, s);
}

#ifdef QUILT_TIMELINE
// copies the stamps to host memory `dst` (kTlCtas * kTlProgs * kTlSlots uint64)
int quilt_sm90_timeline(unsigned long long* dst) {
  return static_cast<int>(cudaMemcpyFromSymbol(dst, quilt_sm90::g_timeline, sizeof(quilt_sm90::g_timeline)));
}
int quilt_sm90_timeline_reset() {
  void* ptr = nullptr;
  cudaError_t err = cudaGetSymbolAddress(&ptr, quilt_sm90::g_timeline);
  if (err != cudaSuccess) return static_cast<int>(err);
  return static_cast<int>(cudaMemset(ptr, 0, sizeof(quilt_sm90::g_timeline)));
}
int quilt_sm90_timeline_shape(int* dims) {
  dims[0] = quilt_sm90::kTlCtas, dims[1] = quilt_sm90::kTlProgs, dims[2] = quilt_sm90::kTlSlots;
  return 0;
}
#endif
int quilt_sm90_params_size() { return static_cast<int>(sizeof(quilt_sm90::Params)); }
int quilt_sm90_smem_bytes() { return quilt_sm90::kSmemBytes; }
const char* quilt_sm90_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
