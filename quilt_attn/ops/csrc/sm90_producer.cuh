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
    tile[buf] = p.from_plan && it < pr.n_tiles ? p.prog_tiles[static_cast<long long>(pr.pid) * p.prog_cap + it] : -1;
  }
}

// kBits: a wide plan's member bits are loaded ahead with the rows (kFp8 kernels load them at use instead, see
// produce: the widening needs the registers)
template <bool kBits>
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
        sl.bits[buf][j] = kBits && tile[buf] >= 0 && p.tile_mask != nullptr ? static_cast<uint32_t>(p.tile_mask[at]) : 0u;
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

// FP8 rows go through shared memory in place: a half's raw bytes are copied (cp.async) into the very chunk rows
// they widen into, then each producer warp widens its own rows there once its copies have landed (the landed
// barriers), while the next halves' copies are in flight. Lane `unit` of a row owns 16 e4m3 values of each of
// chunks ca, ca + 1 (ca = c0 + 2 (unit / 4), 16-byte pieces k = unit % 4): in each 128-byte chunk row the raw
// pieces sit in its first 64 bytes and, in chunk ca's, the pair's scale at byte 64 + 4 k (each lane reads only
// what it copied itself). Loading rows to registers instead left at most two rows' loads in flight (the
// producer's 72 registers): twice the bf16 kernel's time.
__device__ __forceinline__ void issue_fp8(const Params& p, uint32_t dst, const int (&row)[4], const bool (&ok)[4],
                                          int g, int unit, int half) {
  const uint8_t* cache = static_cast<const uint8_t*>(p.kv);
  const int k = unit & 3, ca = (half ? 4 : 0) + 2 * (unit >> 2);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int r = g + 16 * j;
    const uint8_t* src = cache + (ok[j] ? static_cast<long long>(row[j]) * p.stride_kv : 0);
    const uint32_t row0 = dst + ca * kChunkBytes + r * 128;
    cp_async16(row0 + 16 * k, src + ca * 64 + 16 * k, ok[j]);
    cp_async16(row0 + kChunkBytes + 16 * k, src + (ca + 1) * 64 + 16 * k, ok[j]);
    cp_async4(row0 + 64 + 4 * k, src + kFp8ScaleAt + 4 * (ca / 2), ok[j]);  // chunks 2s, 2s + 1 share scale s
    if (half) cp_async16(dst + (kChunks - 1) * kChunkBytes + swz(r, unit), src + kFp8RopeAt + unit * 16, ok[j]);
  }
}

// The in-place widening of one half (after issue_fp8's copies have landed), a row at a time; invalid rows were
// zero-filled, raw bytes and scale, and widen to zeros.
__device__ __forceinline__ void widen_fp8(uint32_t dst, int g, int unit, int half) {
  const int k = unit & 3, ca = (half ? 4 : 0) + 2 * (unit >> 2);
  const uint32_t lo = ((2 * k) ^ (g & 7)) << 4, hi = ((2 * k + 1) ^ (g & 7)) << 4;  // rows g + 16 j: row & 7 = g & 7
#pragma unroll 1  // (a row at a time: the producer has 72 registers)
  for (int j = 0; j < 4; ++j) {
    const uint32_t row0 = dst + ca * kChunkBytes + (g + 16 * j) * 128, row1 = row0 + kChunkBytes;
    const uint4 a = ld_shared_v4(row0 + 16 * k), b = ld_shared_v4(row1 + 16 * k);
    const float s = ld_shared_f32(row0 + 64 + 4 * k);
    __syncwarp();  // the row's 8 lanes (one warp) have read their raw bytes before any lane overwrites them
#ifdef QUILT_FP8_NO_WIDEN  // measurement: raw bytes stored unconverted (results invalid)
    st_shared_v4(row0 + lo, a.x, a.y, a.z, a.w);
    st_shared_v4(row0 + hi, a.x, a.y, a.z, __float_as_uint(s));
    st_shared_v4(row1 + lo, b.x, b.y, b.z, b.w);
    st_shared_v4(row1 + hi, b.x, b.y, b.z, b.w);
    continue;
#endif
    st_shared_v4(row0 + lo, widen2(a.x & 0xFFFFu, s), widen2(a.x >> 16, s), widen2(a.y & 0xFFFFu, s), widen2(a.y >> 16, s));
    st_shared_v4(row0 + hi, widen2(a.z & 0xFFFFu, s), widen2(a.z >> 16, s), widen2(a.w & 0xFFFFu, s), widen2(a.w >> 16, s));
    st_shared_v4(row1 + lo, widen2(b.x & 0xFFFFu, s), widen2(b.x >> 16, s), widen2(b.y & 0xFFFFu, s), widen2(b.y >> 16, s));
    st_shared_v4(row1 + hi, widen2(b.z & 0xFFFFu, s), widen2(b.z >> 16, s), widen2(b.w & 0xFFFFu, s), widen2(b.w >> 16, s));
  }
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
  int tile_c[2];              // kFp8: block b's, for its member bits
  // FP8: halves are numbered in fill order across the CTA's programs (seq 4 (gb + b) + i, i over the block's
  // fill order below); `issued` have had their copies issued, `widened` have been widened and handed over
  int issued = 0, widened = 0;
  const int warp = t / 32;
  auto half_of = [](int s, int& buf, int& half) {  // fill order (0, 0), (1, 1), (0, 1), (1, 0)
    buf = s & 1;
    half = ((s >> 1) ^ s) & 1;
  };
  auto widen_next = [&]() {
    int buf, half;
    half_of(widened, buf, half);
#ifdef QUILT_SANITIZER_SYNC
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();
#else
    mbar_wait(bars.landed(buf, half, warp), (widened >> 2) & 1);
#endif
    if (!(p.skip & kSkipGather)) widen_fp8(smem_u32(smem + kSmemKV + buf * kTileBytes), g, unit, half);
    fence_async_smem();  // the widened rows (st.shared) and the rope's cp.async -> wgmma's async-proxy reads
    mbar_arrive(bars.ready(buf, half));
    mbar_arrive(bars.ready(buf, half));
    ++widened;
  };
  auto fill = [&](int buf, int half, int phase) {
    if constexpr (kFp8) {
      // wait for the half to be free, widening whatever has landed meanwhile (warp-uniform decisions: every
      // lane that goes on has seen the barrier complete itself)
#ifdef QUILT_FP8_LAG  // measurement: a fixed lag (half i widened after half i + 1 is issued), no polling
      mbar_wait(bars.free(buf, half), phase ^ 1);
#else
      for (;;) {
        if (__all_sync(0xffffffffu, mbar_test(bars.free(buf, half), phase ^ 1))) break;
        if (widened < issued) {
          int wb, wh;
          half_of(widened, wb, wh);
          if (__all_sync(0xffffffffu, mbar_test(bars.landed(wb, wh, warp), (widened >> 2) & 1))) widen_next();
        }
      }
#endif
    } else {
      mbar_wait(bars.free(buf, half), phase ^ 1);
    }
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
      for (int j = 0; j < 4; ++j) {
        if constexpr (kFp8) {  // a wide plan's bits, loaded here (the loads' latency: 4 lanes of 32, twice a block)
          if (p.from_plan && p.tile_mask != nullptr)
            bits[j] = tile_c[buf] >= 0 ? static_cast<uint32_t>(p.tile_mask[static_cast<long long>(tile_c[buf]) * kTile + g + 16 * j]) : 0u;
        }
        masks[buf * kTile + g + 16 * j] = ok[j] ? bits[j] : 0u;
      }
    }
    const uint32_t dst = smem_u32(smem + kSmemKV + buf * kTileBytes);
    if constexpr (kFp8) {
      if (!(p.skip & kSkipGather)) issue_fp8(p, dst, row, ok, g, unit, half);
#ifdef QUILT_SANITIZER_SYNC
      ++issued;
      widen_next();
#else
      mbar_arrive_copies(bars.landed(buf, half, warp));
      ++issued;
#ifdef QUILT_FP8_LAG
      if (issued - widened > 1) widen_next();
#endif
#endif
      return;
    } else {
      const int c0 = half ? 4 : 0, c1 = half ? kChunks : 4;
      if (!(p.skip & kSkipGather)) {
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
    }
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
    asm volatile("bar.sync %0, 128;\n" ::"n"(static_cast<int>(kBarProducer)) : "memory");  // (producer only)
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
    load_slots<!kFp8>(p, pr, 0, g, tile0, cur);
    tile_c[0] = tile0[0];
    tile_c[1] = tile0[1];
    // q first: the consumers free its shared memory after their last QK of the previous program, before
    // the last PVs that free the kv buffers, so its wait is the shorter one
    hand_over<T>(p, w, pr, hblock, k, t, smem, bars);
    for (int b = 0; b < n_blocks; ++b) {
      const int phase = (gb + b) & 1;
      load_slots<!kFp8>(p, pr, b + 1, g, tile_n, nxt);  // (past the end: no loads, all slots -1)
      load_tile_ids(p, pr, b + 2, tile_nn);
      fill(0, 0, phase);
      fill(1, 1, phase);
      fill(0, 1, phase);
      fill(1, 0, phase);
      cur = nxt;
      tile_c[0] = tile_n[0];
      tile_c[1] = tile_n[1];
      tile_n[0] = tile_nn[0];
      tile_n[1] = tile_nn[1];
    }
    gb += n_blocks;
    if constexpr (kFp8) {
      // the program's last halves before the next program's q: the consumers free q only after their last QK
      while (widened < issued) widen_next();
    }
  }
  cp_async_wait<0>();
}


}  // namespace quilt_sm90
