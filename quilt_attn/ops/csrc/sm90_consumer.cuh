// The sm_90a kernel's two consumer warpgroups: QK, the online softmax with the row max handed between
// them, PV, and the epilogue that writes a program's output.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>

#include "ptx.cuh"
#include "sm90_config.cuh"
#include "sm90_measure.cuh"
#include "sm90_program.cuh"
#include "wgmma_ops.cuh"

namespace quilt_sm90 {
using namespace quilt_ptx;

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
// max_logits. (Measured 1-5% faster than moving it with every larger logit: docs/learned.md.)
constexpr float kRescaleSlack = 8.f;
__device__ __forceinline__ float next_max(float m, float mx) {
  return mx > m + kRescaleSlack ? mx : m;
}

// true when every row of the warp keeps its reference (f == 1 exactly): multiplying by f changes nothing
__device__ __forceinline__ bool warp_unchanged(const float (&f)[2]) {
  return __all_sync(0xffffffff, f[0] == 1.f && f[1] == 1.f);
}

// this thread's two rows' reference max -> the hand-off array (a quad's lane 0 writes it)
__device__ __forceinline__ void publish_max(float* red_max, const float (&m)[2], int r0, int lane) {
  if (lane % 4 == 0) {
    red_max[r0] = m[0];
    red_max[r0 + 8] = m[1];
  }
}

// take the other warpgroup's reference (red_max): f = 2^(m - theirs), l rescaled; true when no row moved
__device__ __forceinline__ bool adopt_max(float (&m)[2], float (&l)[2], float (&f)[2], const float* red_max, int r0) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const float mb = red_max[r0 + 8 * i];
    f[i] = exp2f(m[i] - mb);
    m[i] = mb;
    l[i] *= f[i];
  }
  return warp_unchanged(f);
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
  publish_max(red_max, m, r0, lane);
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

// A program's end for one consumer warpgroup: the two warpgroups' row sums -> l, then normalize and write
// out, max_logits and lse. o and l are relative to 2^m_lse (base 2); mt is this warpgroup's true row max.
template <typename T, typename OutT, int wg, typename B>
__device__ __forceinline__ void write_program(const Params& p, const Program& pr, int hblock, int k, int n_blocks,
                                              float (&o)[128], const float (&m_lse)[2], float (&l)[2],
                                              const float (&mt)[2], float* red_sum, float* red_tmax,
                                              const B& bars) {
  const int tid = threadIdx.x, lane = tid % 32;
  if (tid == 128) QUILT_STAMP(k, kTlWg1Done);
  if (tid == 0) {
    QUILT_STAMP(k, kTlWg0Done);
    QUILT_STAMP_VALUE(k, kTlBlocks, n_blocks);
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
  if (tid == 0) QUILT_STAMP(k, kTlSumsDone);
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
    const float lse = empty ? INFINITY : m_lse[i] + log2f(lt);
    float fac = empty ? 0.f : 1.f / lt;
    if (!kPartial && p.sink != nullptr && !empty && ok) {
      fac *= 1.f / (1.f + expf(p.sink[head] - lse * 0.6931471805599453f));
    }
    // an empty row writes zeros, not o * 0: a selected row whose logits are all -inf may still carry an inf in
    // V, and P = 0 times it left NaN in o
    auto fin = [empty, fac](float x) { return empty ? 0.f : x * fac; };
    OutT* out = static_cast<OutT*>(p.out) + (ok ? qq * p.stride_os + head * p.stride_oh : 0) + wg * 256;
    if constexpr (kPartial) {
      if (ok) {
#pragma unroll
        for (int j = 0; j < 32; ++j) {
          *reinterpret_cast<float2*>(out + j * 8 + quad * 2) =
              make_float2(fin(o[j * 4 + i * 2]), fin(o[j * 4 + i * 2 + 1]));
        }
      }
    } else {
      // |x| bits, their max over the row's values: above +inf's only if one is a NaN (bits: fast math cannot drop it)
      uint32_t nan_bits = 0;
      // straight from registers, 16 bytes a thread (no stage: q's shared memory already holds the next q)
#pragma unroll
      for (int a = 0; a < 8; ++a) {
        uint32_t v[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float x0 = fin(o[(4 * a + c) * 4 + i * 2]), x1 = fin(o[(4 * a + c) * 4 + i * 2 + 1]);
#ifndef QUILT_NO_NAN_QUEUE
          nan_bits = max(nan_bits, max(__float_as_uint(x0) & 0x7fffffffu, __float_as_uint(x1) & 0x7fffffffu));
#endif
          v[c] = Mma<T>::pack(x0, x1);
        }
        quad_transpose(v, quad);
        if (ok) *reinterpret_cast<uint4*>(out + (4 * a + quad) * 8) = make_uint4(v[0], v[1], v[2], v[3]);
      }
      // a NaN may be a shared tile's 0 x inf from a partner's row: the repair pass redoes this query
      if (p.repair != nullptr && ok && nan_bits > 0x7f800000u) queue_for_repair(p.repair, p.s_q, qq);
    }
    if (ok && wg == 0 && quad == 0) {
      const float mlog = fmaxf(mt[i], red_tmax[r]);
      p.max_logits[static_cast<long long>(qq) * p.h + head] = empty ? -INFINITY : mlog;
      p.lse[static_cast<long long>(qq) * p.h + head] = lse;
    }
  }
  if (tid == 0) QUILT_STAMP(k, kTlOutWritten);
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
      if (tid == 0) QUILT_STAMP(k, kTlWg0FirstQk);
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
      const bool same = adopt_max(m, l, f, red_max, r0);
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
        if (tid == 128 && b == 0) QUILT_STAMP(k, kTlWg1FirstQk);
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

  write_program<T, OutT, wg>(p, pr, hblock, k, n_blocks, o, m, l, mt, red_sum, red_tmax, bars);
}

// A consumer warpgroup's programs, until the producer hands over the end
template <typename T, typename OutT, bool kMma, int wg>
__device__ __forceinline__ void consume_programs(const Params& p, uint8_t* smem, const Bars& bars) {
  const volatile int* work = reinterpret_cast<const int*>(smem + kSmemWork) + 2;
  for (int k = 0, gb = 0;; ++k) {
    wait_ready(bars.q_ready(), k & 1);
    if (threadIdx.x == 0) QUILT_STAMP(k, kTlQReady);
    const int w = work[k & 1];
    if (w >= p.n_work) break;
    int hblock;
    const Program pr = program_of(p, w, hblock);
    consume<T, OutT, kMma, wg>(p, pr, hblock, k, gb, smem, bars);
    gb += (pr.n_tiles + 1) / 2;
  }
}

}  // namespace quilt_sm90
