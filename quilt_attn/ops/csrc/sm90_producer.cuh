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

// An FP8 half of a kv buffer is staged, then widened in place. The staging area is the half's own last two
// chunks (c0 + 2, c0 + 3: 16 KB, the 64 rows x 256 e4m3 bytes of the half's latent), filled by cp.async (no
// registers hold data in flight, one round trip a half; the register path loaded row by row and waited four);
// the widening writes chunks c0, c0 + 1 from it, then, once every producer thread has read the rest, c0 + 2,
// c0 + 3. Row r's 16-byte unit u sits at r * 256 + (u ^ 4 (r & 1)) * 16: a warp's 8-byte reads (four rows)
// take two wavefronts. Invalid rows copy nothing (zero-filled) and have scale 0.
__device__ __forceinline__ uint32_t fp8_stage_at(int r, int u) { return r * 256 + (((u ^ ((r & 1) << 2)) & 15) << 4); }

__device__ __forceinline__ uint2 lds64(uint32_t a) {
  uint2 v;
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ void producer_bar() {
  asm volatile("bar.sync %0, 128;\n" ::"n"(static_cast<int>(kBarProducer)) : "memory");
}
__device__ __forceinline__ bool mbar_done(uint32_t bar, int parity) {  // (does not wait)
  uint32_t done;
  asm volatile(
      "{\n.reg .pred p;\nmbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

// the copies of half `half` of buffer buf (rows, validity as slot_of gives them) and its two block scales a row
__device__ __forceinline__ void stage_fp8(const Params& p, uint32_t dst, const int (&row)[4], const bool (&ok)[4],
                                          int g, int unit, int half, float2 (&sc)[4]) {
  const uint8_t* cache = static_cast<const uint8_t*>(p.kv);
  const int c0 = half ? 4 : 0;
  const uint32_t stage = dst + (c0 + 2) * kChunkBytes;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = g + 16 * j;
    const uint8_t* base = cache + (ok[j] ? static_cast<long long>(row[j]) * p.stride_kv : 0);
    cp_async16(stage + fp8_stage_at(r, unit), base + c0 * 64 + unit * 16, ok[j]);
    cp_async16(stage + fp8_stage_at(r, unit + 8), base + c0 * 64 + (unit + 8) * 16, ok[j]);
    if (half) cp_async16(dst + (kChunks - 1) * kChunkBytes + swz(r, unit), base + kFp8RopeAt + unit * 16, ok[j]);
    sc[j] = ok[j] ? __ldg(reinterpret_cast<const float2*>(base + kFp8ScaleAt + 4 * (c0 / 2))) : make_float2(0.f, 0.f);
  }
}

// the staged half widened in place (the caller has waited for its copies and synchronized the producer)
__device__ __forceinline__ void widen_fp8(uint32_t dst, int g, int unit, int half, const float2 (&sc)[4]) {
  const int c0 = half ? 4 : 0;
  const uint32_t stage = dst + (c0 + 2) * kChunkBytes;
  auto store = [&](int c, int r, uint2 x, float s) {
    st_shared_v4(dst + c * kChunkBytes + swz(r, unit), widen2(x.x & 0xFFFFu, s), widen2(x.x >> 16, s),
                 widen2(x.y & 0xFFFFu, s), widen2(x.y >> 16, s));
  };
#pragma unroll
  for (int j = 0; j < 4; ++j) {  // chunks c0, c0 + 1: outside the staging area
    const int r = g + 16 * j;
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) {
      store(c0 + cc, r, lds64(stage + fp8_stage_at(r, cc * 4 + unit / 2) + (unit & 1) * 8), sc[j].x);
    }
  }
  uint2 y[4][2];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = g + 16 * j;
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) y[j][cc] = lds64(stage + fp8_stage_at(r, (cc + 2) * 4 + unit / 2) + (unit & 1) * 8);
  }
  producer_bar();  // every thread has read the staging area before it is overwritten
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int cc = 0; cc < 2; ++cc) store(c0 + 2 + cc, g + 16 * j, y[j][cc], sc[j].y);
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
template <typename T>
__device__ void produce_bf16(const Params& p, uint8_t* smem, const Bars& bars) {
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
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int r = g + 16 * j;
        const T* src = kv + (ok[j] ? static_cast<long long>(row[j]) * p.stride_kv : 0) + unit * 8;
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


// The producer over an FP8 cache: the bf16 producer's fills in its order, each staged by cp.async and widened
// in place (stage_fp8, widen_fp8). A fill's copies are issued before the fill before it is widened when its
// buffer half is already free (never waited for: the consumer frees buffer 1's half 0 only after buffer 0's
// next half 0 is ready), so one fill's gather overlaps the other's widening; the scales of both are in registers.
__device__ void produce_fp8(const Params& p, uint8_t* smem, const Bars& bars) {
  const int t = threadIdx.x - 256, unit = t % 8, g = t / 8;
  uint32_t* masks = reinterpret_cast<uint32_t*>(smem + kSmemMask);
  Slots cur, nxt;
  int tile_n[2], tile_nn[2];
  float2 sc[2][4];  // the block scales of the fills in flight, by fill parity
  auto issue = [&](const Slots& sl, int buf, int half, int phase, float2(&s)[4]) {
    mbar_wait(bars.free(buf, half), phase ^ 1);
    bool ok[4];
    int row[4];
    uint32_t bits[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      slot_of(p, sl, buf, j, row[j], bits[j]);
      ok[j] = row[j] >= 0 && row[j] < p.s_kv;
    }
    if (half == buf && unit == 0) {
#pragma unroll
      for (int j = 0; j < 4; ++j) masks[buf * kTile + g + 16 * j] = ok[j] ? bits[j] : 0u;
    }
    if (!(p.skip & kSkipGather)) stage_fp8(p, smem_u32(smem + kSmemKV + buf * kTileBytes), row, ok, g, unit, half, s);
    cp_async_commit();
  };
  auto finish = [&](int buf, int half, bool pending, const float2(&s)[4]) {
    if (pending) {
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    producer_bar();  // every thread's copies of the half have landed
    if (!(p.skip & kSkipGather)) widen_fp8(smem_u32(smem + kSmemKV + buf * kTileBytes), g, unit, half, s);
    fence_async_smem();  // the widened rows (st.shared) -> wgmma's async-proxy reads
    mbar_arrive(bars.ready(buf, half));
    mbar_arrive(bars.ready(buf, half));
  };
  constexpr int kBuf[4] = {0, 1, 0, 1}, kHalf[4] = {0, 1, 1, 0};  // the bf16 producer's order
  int gb = 0;
  volatile int* next = reinterpret_cast<int*>(smem + kSmemWork);
  for (int k = 0;; ++k) {
    const int w = next_work_item(p, k, t, next);
    if (w >= p.n_work) {
      hand_over<__nv_bfloat16>(p, w, Program{}, 0, k, t, smem, bars);
      break;
    }
    int hblock;
    const Program pr = program_of(p, w, hblock);
    const int n_blocks = (pr.n_tiles + 1) / 2;
    int tile0[2];
    load_tile_ids(p, pr, 0, tile0);
    load_tile_ids(p, pr, 1, tile_n);
    load_slots(p, pr, 0, g, tile0, cur);
    hand_over<__nv_bfloat16>(p, w, pr, hblock, k, t, smem, bars);
    if (n_blocks > 0) issue(cur, 0, 0, gb & 1, sc[0]);
    bool issued = true;  // fill 0 of the block is issued
    for (int b = 0; b < n_blocks; ++b) {
      const int phase = (gb + b) & 1;
      load_slots(p, pr, b + 1, g, tile_n, nxt);  // (past the end: no loads, all slots -1)
      load_tile_ids(p, pr, b + 2, tile_nn);
      if (!issued) issue(cur, 0, 0, phase, sc[0]);
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        // the next fill: this block's f + 1, or the next block's first
        const bool more = f < 3 || b + 1 < n_blocks;
        const int nb = f < 3 ? kBuf[f + 1] : 0, nh = f < 3 ? kHalf[f + 1] : 0;
        const int nphase = f < 3 ? phase : phase ^ 1;
        const bool early = more && __shfl_sync(0xffffffff, mbar_done(bars.free(nb, nh), nphase ^ 1), 0);
        if (early) issue(f < 3 ? cur : nxt, nb, nh, nphase, sc[(f + 1) & 1]);
        finish(kBuf[f], kHalf[f], early, sc[f & 1]);
        if (f < 3 && !early) issue(cur, nb, nh, nphase, sc[(f + 1) & 1]);
        if (f == 3) issued = early;
      }
      cur = nxt;
      tile_n[0] = tile_nn[0];
      tile_n[1] = tile_nn[1];
    }
    gb += n_blocks;
  }
  cp_async_wait<0>();
}

template <typename T, bool kFp8>
__device__ void produce(const Params& p, uint8_t* smem, const Bars& bars) {
  if constexpr (kFp8) {
    produce_fp8(p, smem, bars);
  } else {
    produce_bf16<T>(p, smem, bars);
  }
}


}  // namespace quilt_sm90
