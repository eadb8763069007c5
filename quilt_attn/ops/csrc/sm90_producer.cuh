// The sm_90a kernel's producer warpgroup: kv rows and q gathered into shared memory with cp.async.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include "ptx.cuh"
#include "sm90_config.cuh"
#include "sm90_measure.cuh"
#include "sm90_program.cuh"

namespace quilt_sm90 {
using namespace quilt_ptx;

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
  int row[2][4];       // slot g + 16 j of tile 2b + buf: its kv row (-1: none), or a packed plan's raw word
  uint32_t bits[2][4];  // member bits (wide plan) or 1 (query-parallel); a packed word carries its own
};

// A slot's kv row and member bits. A packed word is decoded here, at use, not where it is loaded:
// decoding at the load made the producer wait out the load's latency once a block (measured: 25% slower
// kernel than the same plan in the wide format).
__device__ __forceinline__ void slot_of(const Params& p, const Slots& sl, int buf, int j, int& row, uint32_t& bits) {
  const int w = sl.row[buf][j];
  if (p.from_plan && p.tile_mask == nullptr) {  // packed: a padding word (-1) has row 0xFFFFFF >= s_kv: invalid
    row = w & 0xFFFFFF;
    bits = static_cast<uint32_t>(w) >> 24;
  } else {
    row = w;
    bits = sl.bits[buf][j];
  }
}

__device__ __forceinline__ void load_tile_ids(const Params& p, const Program& pr, int b, int (&tile)[2]) {
#pragma unroll
  for (int buf = 0; buf < 2; ++buf) {
    const int it = 2 * b + buf;
    // (no list: one program a group, so its tile it is the group's slot it)
    const long long at = static_cast<long long>(pr.pid) * p.prog_cap + it;
    tile[buf] = p.from_plan && it < pr.n_tiles ? (p.prog_tiles != nullptr ? p.prog_tiles[at] : static_cast<int>(at)) : -1;
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
        sl.row[buf][j] = tile[buf] >= 0 ? p.tile_kv[at] : -1;  // (packed: the raw word, see slot_of)
        sl.bits[buf][j] = tile[buf] >= 0 && p.tile_mask != nullptr ? static_cast<uint32_t>(p.tile_mask[at]) : 0u;
      } else {
        const int pos = (2 * b + buf) * kTile + slot;
        sl.row[buf][j] = pos < pr.n_valid ? p.indices[static_cast<long long>(pr.q0) * p.stride_idx + pos] : -1;
        sl.bits[buf][j] = 1u;
      }
    }
  }
}

// The DeepSeek FP8 cache row (656 bytes): 512 e4m3 latent values, 4 float32 scales (one per 128 values), 64 bf16
// rope values. kFp8 kernels read these rows and widen them on the way into shared memory, bf16 tiles as the
// dense path's: no expanded copy of the pool.
constexpr int kFp8RowBytes = 656;
constexpr int kFp8ScaleAt = 512;
constexpr int kFp8RopeAt = 528;
static_assert(kFp8ScaleAt == kDqk - 64 && kFp8RopeAt == kFp8ScaleAt + 4 * 4 &&
                  kFp8RowBytes == kFp8RopeAt + 64 * 2 && kFp8RopeAt % 16 == 0 && kFp8RowBytes % 16 == 0,
              "FP8 cache row: e4m3 latent, 4 float32 scales, 64 bf16 rope values, 16-byte aligned rope and rows");

// 2 e4m3 values times their scale as a bf16 pair (4 of them make a 16-byte unit of the widened chunk): e4m3 ->
// half is exact, and the float32 product rounds to bf16 as kv_cache.dequantize_fp8's (except products below
// 2^-126, which the library's fast-math build flushes to zero)
__device__ __forceinline__ uint32_t widen2(uint32_t two_bytes, float s) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two_bytes), __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  __nv_bfloat162 v = __floats2bfloat162_rn(f.x * s, f.y * s);
  return *reinterpret_cast<uint32_t*>(&v);
}

// One half of a kv buffer from FP8 cache rows: the latent chunks c0 .. c0 + 3 loaded to registers (8 bytes a
// unit), widened and stored (st.shared; the caller fences them for wgmma), and in half 1 the rope chunk by
// cp.async, as the dense path copies it. Invalid rows widen zeros (their loads are skipped).
__device__ __forceinline__ void fill_fp8(const Params& p, uint32_t dst, const int (&row)[4], const bool (&ok)[4],
                                         int g, int unit, int half) {
  const uint8_t* cache = static_cast<const uint8_t*>(p.kv);
  const int c0 = half ? 4 : 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // (row by row: four rows' loads in flight need ~40 of the producer's 72 registers)
    const uint8_t* base = cache + (ok[j] ? static_cast<long long>(row[j]) * p.stride_kv : 0);
    uint2 raw[4];
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
      raw[cc] = ok[j] ? __ldg(reinterpret_cast<const uint2*>(base + (c0 + cc) * 64 + unit * 8)) : make_uint2(0u, 0u);
    }
    const float2 sc = ok[j] ? __ldg(reinterpret_cast<const float2*>(base + kFp8ScaleAt + 4 * (c0 / 2)))
                            : make_float2(0.f, 0.f);
    if (half) {
      cp_async16(dst + (kChunks - 1) * kChunkBytes + swz(g + 16 * j, unit), base + kFp8RopeAt + unit * 16, ok[j]);
    }
#pragma unroll
    for (int cc = 0; cc < 4; ++cc) {
      const float s = cc < 2 ? sc.x : sc.y;  // chunks 2k, 2k + 1 share scale k
      st_shared_v4(dst + (c0 + cc) * kChunkBytes + swz(g + 16 * j, unit), widen2(raw[cc].x & 0xFFFFu, s),
                   widen2(raw[cc].x >> 16, s), widen2(raw[cc].y & 0xFFFFu, s), widen2(raw[cc].y >> 16, s));
    }
  }
}

// The CTA's k-th work item, for every producer thread (t: the thread's index in the producer warpgroup; next:
// the two shared-memory slots it passes through): blockIdx.x first, then whatever is left (longest programs
// first), one at a time; or round-robin (query programs in head blocks: equal lengths up to topk_length, pairs
// kept in step)
__device__ __forceinline__ int next_work_item(const Params& p, int k, int t, volatile int* next) {
  const bool round_robin = !p.from_plan && p.nhb > 1;
  if (t == 0) {
    int w = k == 0 ? blockIdx.x : round_robin ? blockIdx.x + k * gridDim.x : gridDim.x + atomicAdd(p.work_counter, 1);
    // a repair pass ends at the queue's count (written by the passes before it; p.n_work bounds any count)
    if (p.queue != nullptr && w < p.n_work && w >= p.queue[0] * p.nhb) w = p.n_work;
    next[k & 1] = w;
  }
  asm volatile("bar.sync %0, 128;\n" ::"n"(static_cast<int>(kBarProducer)) : "memory");  // (producer only)
  return next[k & 1];
}

// Program k of this CTA (work item w: program pr, head block hblock): q rows -> shared memory (zero
// rows for padding) once the previous program's QKs are done with it, then the work item
// for the consumers; q_ready completes when both have landed. w >= n_work tells the consumers to stop.
template <typename T>
__device__ __forceinline__ void hand_over(const Params& p, int w, const Program& pr, int hblock, int k, int t,
                                          uint8_t* smem, const Bars& bars) {
  mbar_wait(bars.q_free(), (k & 1) ^ 1);
  if (t == 0) QUILT_STAMP(k, kTlQFreeSeen);
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
    if (t == 0) QUILT_STAMP(k, kTlQIssued);
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
template <typename T, bool kFp8>
__device__ void produce(const Params& p, uint8_t* smem, const Bars& bars) {
  const int t = threadIdx.x - 256, unit = t % 8, g = t / 8;
  const T* kv = static_cast<const T*>(p.kv);
  uint32_t* masks = reinterpret_cast<uint32_t*>(smem + kSmemMask);
  Slots cur, nxt;
  int tile_n[2], tile_nn[2];  // plan tile ids of blocks b + 1, b + 2
  auto fill = [&](int buf, int half, int phase) {
    mbar_wait(bars.free(buf, half), phase ^ 1);
    bool ok[4];
    int row[4];
    uint32_t bits[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      slot_of(p, cur, buf, j, row[j], bits[j]);
      ok[j] = row[j] >= 0 && row[j] < p.s_kv;
    }
    if (half == buf && unit == 0) {  // the half each buffer's consumer waits for first carries the bits
#pragma unroll
      for (int j = 0; j < 4; ++j) masks[buf * kTile + g + 16 * j] = ok[j] ? bits[j] : 0u;
    }
    const int c0 = half ? 4 : 0, c1 = half ? kChunks : 4;
    if (!(p.skip & kSkipGather)) {
      const uint32_t dst = smem_u32(smem + kSmemKV + buf * kTileBytes);
      if constexpr (kFp8) {
        fill_fp8(p, dst, row, ok, g, unit, half);
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int r = g + 16 * j;
          const T* src = kv + (ok[j] ? static_cast<long long>(row[j]) * p.stride_kv : 0) + unit * 8;
#pragma unroll
          for (int c = c0; c < c1; ++c) cp_async16(dst + c * kChunkBytes + swz(r, unit), src + c * 64, ok[j]);
        }
      }
    }
#ifdef QUILT_SANITIZER_SYNC
    cp_async_commit();
    cp_async_wait<0>();
    fence_async_smem();
    mbar_arrive(bars.ready(buf, half));
    mbar_arrive(bars.ready(buf, half));
#else
    if constexpr (kFp8) {
      fence_async_smem();  // the widened rows (st.shared) -> wgmma's async-proxy reads
      mbar_arrive(bars.ready(buf, half));
      if (half) {
        mbar_arrive_copies(bars.ready(buf, half));  // the rope chunk's cp.async
      } else {
        mbar_arrive(bars.ready(buf, half));
      }
    } else {
      mbar_arrive(bars.ready(buf, half));
      mbar_arrive_copies(bars.ready(buf, half));
    }
#endif
  };
  int gb = 0;  // kv blocks of the CTA's earlier programs: the ready / free barriers' phase
  volatile int* next = reinterpret_cast<int*>(smem + kSmemWork);
  for (int k = 0;; ++k) {
    const int w = next_work_item(p, k, t, next);
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


}  // namespace quilt_sm90
