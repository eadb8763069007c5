// Owner-exact prototype (issue 24): the consumers of the shipping sm_90a kernel rewritten in the swapped shape,
// for QUILT plans at h = 8 and 16 (64 / h queries a program, bf16 in and out). The producer, the shared-memory
// plan, the barriers and the pair schedule are the shipping kernel's; only the products change:
//
//   S^T [64 kv rows x N] = K Q_span^T   (wgmma m64nNk16: A = the kv tile, B = the Q rows of the tile's owners)
//   O^T [d_v x 64]      += V^T P_span^T (m64nNk16 per 64-row d_v chunk: A = the kv tile read MN-major, B = P^T)
//
// where a tile's span is the smallest run of query slots holding every owner of its 64 columns (the OR of the
// member bits the producer stores), N = h x its length, and the span starts at column 8 j0 of the 64. A tile
// multiplies only against its span's Q rows; its accumulator registers are the span's part of full-width
// S^T and O^T arrays, so the span picks the wgmma instance from a switch (36 at h = 8, 10 at h = 16).
//
// The softmax bookkeeping runs per column (a query-head), 16 columns a thread, on full-width arrays with the
// span's groups active: the column max over the tile's 64 kv rows (shuffles in a warp, the four warps through
// shared memory), the running max handed 0 -> 1 -> 0 as today's row max, P^T stored with stmatrix .trans, the
// column sums reduce-scattered each tile (2 registers a thread). The epilogue turns O^T back into rows with
// movmatrix .trans and a quad transpose: 16-byte stores, as today's.
//
// Shared memory: the shipping plan plus 272 bytes (the common reference max, the two tiles' spans); each
// warpgroup's column-max scratch lives in its own tile's rope chunk once that tile's QK is done (warpgroup 0's
// is then overwritten by P^T0, after a warpgroup barrier); the epilogue's column-sum partials use P1's chunk.
// Measurement code: not part of the library; built by benchmarks/owner_exact/prototype.py.
#pragma once
#include <type_traits>

#include "../../quilt_attn/ops/csrc/sm90_consumer.cuh"
#include "wgmma_small.cuh"

namespace quilt_sm90 {
namespace swapped {
using namespace quilt_ptx;

constexpr int kOffRef = kSmemBytes;            // float [64]: warpgroup 1's published max, the pair's reference
constexpr int kOffSpan = kOffRef + kRows * 4;  // int [2]: each warpgroup's tile span, j0 | nj << 4 (0: empty)
constexpr int kExtraBytes = kRows * 4 + 16;
static_assert(kSmemBytes + kExtraBytes <= kSmemLimit, "shared memory budget");
static_assert(kOffRef % 16 == 0, "aligned");
enum : int { kBarWg0 = 6, kBarWg1 = 7 };  // warpgroup-local (128 threads)

__device__ __forceinline__ void bar_wg(int id) { asm volatile("bar.sync %0, 128;\n" ::"r"(id) : "memory"); }

// ------------------------------------------------------------------------------------------ the span's products
template <int J0, int NJ>
__device__ __forceinline__ float (&part(float (&d)[32]))[NJ * 4] {
  return *reinterpret_cast<float(*)[NJ * 4]>(&d[4 * J0]);
}

// S^T's span columns over chunks C0 .. C1 - 1 (first: the chunk range starts the accumulator)
template <int C0, int C1, int J0, int NJ>
__device__ __forceinline__ void qk_span(float (&s)[32], uint64_t dk, uint64_t dq, bool first) {
  const uint64_t dqs = desc_at(dq, J0 * 1024);  // the span's first Q row: 8 J0 rows of 128 bytes
#pragma unroll
  for (int c = C0; c < C1; ++c) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const uint32_t off = c * kChunkBytes + k * 32;
      owner_exact::WgSS<8 * NJ>::kq(part<J0, NJ>(s), desc_at(dk, off), desc_at(dqs, off),
                                    (first && c == C0 && k == 0) ? 0 : 1);
    }
  }
}

// O^T's span columns of this warpgroup's 4 d_v chunks += V^T P^T over the tile's 64 kv rows
template <int J0, int NJ>
__device__ __forceinline__ void pv_span(float (&o)[4][32], uint32_t skv_wg, uint32_t sp) {
  const uint64_t dp = desc_at(desc_sw128(sp, 16, 1024), J0 * 1024);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const uint64_t dv = desc_sw128(skv_wg + c * kChunkBytes, kChunkBytes, 1024);
      owner_exact::WgSS<8 * NJ>::vp(part<J0, NJ>(o[c]), desc_at(dv, k * 16 * 128), desc_at(dp, k * 32), 1);
    }
  }
}

// The spans the products take, (j0, nj) in 8-column groups. At h = 16 every run of whole queries (10); at h = 8
// prefixes only (8: a span from slot 0 to the last owner): the 36 runs of whole queries there made ptxas spill
// 24-30 KB (and aligned blocks, 15, 11 KB), so the h = 8 prototype computes each tile from slot 0 on.
#define OE_SPANS_8(X) X(0, 1) X(0, 2) X(0, 3) X(0, 4) X(0, 5) X(0, 6) X(0, 7) X(0, 8)
#define OE_SPANS_16(X) X(0, 2) X(0, 4) X(0, 6) X(0, 8) X(2, 2) X(2, 4) X(2, 6) X(4, 2) X(4, 4) X(6, 2)
template <int H>
constexpr bool kPrefix = H == 8;

// OE_FORM (a build switch): 0 the spans above; 1 every tile at full width (N = 64, the span still masks the
// softmax), one wgmma shape as today's; 2 the same with a second shape in a case never taken, meant to make ptxas
// serialize the kernel's wgmma as it does form 0's (C7511). It did so in a consumer compiled alone at h = 8, not
// in the library (measured: form 2 costs its dead code only).
#ifndef OE_FORM
#define OE_FORM 0
#endif

// The switch cases issue, commit and wait for their products: a wgmma group in flight across the join of cases
// of other shapes made ptxas serialize every wgmma of the kernel ("C7511 ... insufficient register resources for
// the wgmma pipeline"), and so did the other warpgroup's PV in flight under the next tile's QK. So, unlike
// today's kernel, a warpgroup's PV and its next QK do not overlap (the two warpgroups' still do).
//
// S^T of a tile (span > 0): chunks C0 .. C1 - 1 once the caller has waited for their half, the rest once `ready_b`
// (parity) says theirs has landed
template <int H, int C0, int C1, int C2, int C3>
__device__ __forceinline__ void qk(int span, float (&s)[32], uint64_t dk, uint64_t dq, uint32_t ready_b, int parity) {
#define OE_QK(j0, nj)                                  \
  case (j0) | (nj) << 4:                               \
    qk_span<C0, C1, j0, nj>(s, dk, dq, true);          \
    wait_ready(ready_b, parity);                       \
    qk_span<C2, C3, j0, nj>(s, dk, dq, false);         \
    wgmma_commit();                                    \
    wgmma_wait<0>();                                   \
    break;
#if OE_FORM == 0
  if constexpr (H == 8) {
    switch (span) { OE_SPANS_8(OE_QK) default: break; }
  } else {
    switch (span) { OE_SPANS_16(OE_QK) default: break; }
  }
#else
  switch (span == 0 ? 0 : OE_FORM == 2 && span == 0x7f ? 0x20 : 0x80) { OE_QK(0, 8) OE_QK(0, 2) default: break; }
#endif
#undef OE_QK
  fence_regs(s);
}

// O^T += V^T P^T of a tile (span 0: nothing), awaited
template <int H>
__device__ __forceinline__ void pv(int span, float (&o)[4][32], uint32_t skv_wg, uint32_t sp) {
#define OE_PV(j0, nj)                    \
  case (j0) | (nj) << 4:                 \
    pv_span<j0, nj>(o, skv_wg, sp);      \
    wgmma_commit();                      \
    wgmma_wait<0>();                     \
    break;
#if OE_FORM == 0
  if constexpr (H == 8) {
    switch (span) { OE_SPANS_8(OE_PV) default: break; }
  } else {
    switch (span) { OE_SPANS_16(OE_PV) default: break; }
  }
#else
  switch (span == 0 ? 0 : OE_FORM == 2 && span == 0x7f ? 0x20 : 0x80) { OE_PV(0, 8) OE_PV(0, 2) default: break; }
#endif
#undef OE_PV
#pragma unroll
  for (int c = 0; c < 4; ++c) fence_regs(o[c]);
}

// a buffer's span from its 64 member-bit words (the same in every lane; shuffled from lane 0 so that ptxas sees
// a warp-uniform value: wgmma under a branch it cannot prove uniform is serialized)
template <int H>
__device__ __forceinline__ int tile_span(const uint32_t* bits, int lane) {
  uint32_t b = bits[lane] | bits[lane + 32];
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) b |= __shfl_xor_sync(0xffffffff, b, d);
  // branch-free (a branch here, between wgmma issued and awaited, serialized the kernel's wgmma): b == 0 gives 0
  const int hi = 31 - __clz(b), lo = kPrefix<H> ? 0 : __ffs(b) - 1;
  const int span = ((lo * (H / 8)) | (((hi - lo + 1) * (H / 8)) << 4)) & -static_cast<int>(b != 0u);
  return __shfl_sync(0xffffffff, span, 0);
}
// x as the same in every lane. ptxas serializes every wgmma of a kernel ("C7520 ... WG.AR in divergent path") when
// code between a wgmma's issue and its wait runs under a branch it cannot prove uniform, which is why the span's
// effects below are selects, not branches, and shared stores are made by every thread.
__device__ __forceinline__ int uniform(int x) { return __shfl_sync(0xffffffff, x, 0); }
__device__ __forceinline__ bool active(int span, int j) {
  const int j0 = span & 15, nj = span >> 4;
  return j >= j0 && j < j0 + nj;
}

// ------------------------------------------------------------------------------------------ column softmax
// The running column sums, reduce-scattered: each half of a thread's 16 columns (groups 0-3, 4-7) is halved over
// lane bits 16, 8, 4, after which a lane keeps the warp's sum of one column of each half: l[i] is column
// scat_col(lane, i) (16 registers of sums, or 16 of a tile's at once, made ptxas spill).
__device__ __forceinline__ int scat_col(int lane, int i) {
  return 8 * i + ((lane >> 4) & 1) * 4 + ((lane >> 3) & 1) * 2 + ((lane >> 2) & 1);
}
template <int kLen, int kMask>
__device__ __forceinline__ void halve(float (&v)[8], int lane) {
  const bool up = lane & kMask;
#pragma unroll
  for (int i = 0; i < kLen / 2; ++i) {
    const float send = up ? v[i] : v[i + kLen / 2], keep = up ? v[i + kLen / 2] : v[i];
    v[i] = keep + __shfl_xor_sync(0xffffffff, send, kMask);
  }
}
// column c's sum (c of this thread's 16) times x
__device__ __forceinline__ void scale_l(float (&l)[2], int c, float x, int lane) {
#pragma unroll
  for (int i = 0; i < 2; ++i) l[i] *= scat_col(lane, i) == c ? x : 1.f;
}
// O^T's column c (this thread's c-th: group c / 2, column 2 (lane % 4) + c % 2) times x
__device__ __forceinline__ void scale_col(float (&o)[4][32], int c, float x) {
#pragma unroll
  for (int k = 0; k < 4; ++k)
#pragma unroll
    for (int i = 0; i < 2; ++i) o[k][4 * (c / 2) + 2 * i + c % 2] *= x;
}

// mask by member bits (column group j holds query slot j * 8 / H; inactive groups: all -inf), each warp's column
// maxima over its 16 kv rows into `cm` (this warpgroup's scratch, [4][64] floats; lanes 0-3 of a warp hold all 64
// columns)
template <int H>
__device__ __forceinline__ void mask_warp_max(float (&s)[32], const uint32_t* bits, int span, float* cm, int warp,
                                              int lane) {
  const int r0 = warp * 16 + lane / 4;
  const uint32_t b0 = bits[r0], b1 = bits[r0 + 8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const uint32_t qb = active(span, j) ? 1u << (j * 8 / H) : 0u;  // (inactive: all masked, no branch)
    float v[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& x0 = s[4 * j + e];
      float& x1 = s[4 * j + 2 + e];
      x0 = (b0 & qb) ? x0 : -INFINITY;
      x1 = (b1 & qb) ? x1 : -INFINITY;
      v[e] = fmaxf(x0, x1);
#pragma unroll
      for (int sh = 4; sh <= 16; sh *= 2) v[e] = fmaxf(v[e], __shfl_xor_sync(0xffffffff, v[e], sh));
    }
    if (lane < 4) *reinterpret_cast<float2*>(cm + warp * 64 + 8 * j + 2 * lane) = make_float2(v[0], v[1]);
  }
}

// a warpgroup barrier that also ORs a flag over its 128 threads
__device__ __forceinline__ bool bar_wg_or(int id, bool v) {
  uint32_t r;
  asm volatile("{\n.reg .pred p, q;\nsetp.ne.u32 q, %2, 0;\nbar.red.or.pred p, %1, 128, q;\nselp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(r) : "r"(id), "r"(static_cast<uint32_t>(v)) : "memory");
  return __any_sync(0xffffffff, r != 0);  // (the same in every lane; a vote makes that visible to ptxas)
}

// Warp 0 of a warpgroup (lane l: columns 2l, 2l + 1) turns the four warps' maxima into the tile's column maxima
// (scaled, base 2), updates the true maxima `tm` and writes the new reference mn = next_max(base, max) to
// `dst`; where mn moved from `old` (null: the program's first block, kMaxInit) it writes 2^(old - mn) to `alpha`
// (if given). Returns to every thread of the warpgroup whether any column moved (the barrier publishes dst).
// The reference lives in shared memory, not registers: 16 more registers a thread made ptxas spill.
__device__ __forceinline__ bool next_reference(const float* cm, int span, float scale2, float* tm, bool first,
                                               const float* base, const float* old, float* dst, float* alpha,
                                               int warp, int lane, int bar_id) {
  bool moved = false;
  if (warp == 0) {
    const int col = 2 * lane;
    float2 mx = make_float2(-INFINITY, -INFINITY);
    if (active(span, col / 8)) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        const float2 x = *reinterpret_cast<const float2*>(cm + w * 64 + col);
        mx.x = fmaxf(mx.x, x.x), mx.y = fmaxf(mx.y, x.y);
      }
      mx.x *= scale2, mx.y *= scale2;
    }
    float2* t = reinterpret_cast<float2*>(tm + col);
    const float2 was = first ? make_float2(-INFINITY, -INFINITY) : *t;
    *t = make_float2(fmaxf(was.x, mx.x), fmaxf(was.y, mx.y));
    const float2 bs = base ? *reinterpret_cast<const float2*>(base + col) : make_float2(kMaxInit, kMaxInit);
    const float2 od = old ? *reinterpret_cast<const float2*>(old + col) : make_float2(kMaxInit, kMaxInit);
    const float2 mn = make_float2(next_max(bs.x, mx.x), next_max(bs.y, mx.y));
    moved = mn.x != od.x || mn.y != od.y;
    if (alpha != nullptr) *reinterpret_cast<float2*>(alpha + col) = make_float2(exp2f(od.x - mn.x), exp2f(od.y - mn.y));
    *reinterpret_cast<float2*>(dst + col) = mn;
  }
  return bar_wg_or(bar_id, moved);
}

// the thread's column c (of its 16) among the 64
__device__ __forceinline__ int col_of(int c, int lane) { return 8 * (c / 2) + 2 * (lane % 4) + c % 2; }

// O^T and l times alpha (per column, shared memory)
__device__ __forceinline__ void rescale(float (&o)[4][32], float (&l)[2], const float* alpha, int lane) {
#pragma unroll
  for (int c = 0; c < 16; ++c) {
    const float x = alpha[col_of(c, lane)];
    scale_col(o, c, x);
    scale_l(l, c, x, lane);
  }
}

// P = 2^(s scale2 - mn) over the span (mn: the reference, shared memory; 0 elsewhere), l += its column sums
__device__ __forceinline__ void exp_sums(float (&s)[32], float (&l)[2], const float* mn, int span, float scale2,
                                         int lane) {
#pragma unroll
  for (int hf = 0; hf < 2; ++hf) {
    float v[8];
#pragma unroll
    for (int jj = 0; jj < 4; ++jj) {
      const int j = 4 * hf + jj;
      const bool act = active(span, j);
      const float2 m2 = *reinterpret_cast<const float2*>(mn + 8 * j + 2 * (lane % 4));
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& x0 = s[4 * j + e];
        float& x1 = s[4 * j + 2 + e];
        const float me = e ? m2.y : m2.x;
        x0 = act ? exp2f(fmaf(x0, scale2, -me)) : 0.f;  // (selects, no branch: see uniform())
        x1 = act ? exp2f(fmaf(x1, scale2, -me)) : 0.f;
        v[2 * jj + e] = x0 + x1;
      }
    }
    halve<8, 16>(v, lane);
    halve<4, 8>(v, lane);
    halve<2, 4>(v, lane);
    l[hf] += v[0];
  }
}

__device__ __forceinline__ uint32_t pack2(float x, float y) {
  __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<uint32_t*>(&v);
}

// P^T (this warp's 16 kv rows) -> shared memory as wgmma's K-major B reads it: row n (a column of S^T) holds the
// tile's 64 kv values, 128-byte swizzled; stmatrix .trans stores each 8x8 accumulator block transposed: block
// (group j, half i) -> rows 8j .. 8j+7, 16-byte unit 2 warp + i. All 64 rows (inactive ones are not read).
__device__ __forceinline__ void store_pt(uint8_t* smem, int off, const float (&s)[32], int span, int warp, int lane) {
  const int mi = lane / 8, jr = lane % 8;
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    const int nrow = 8 * (2 * g + (mi >> 1)) + jr, unit = 2 * warp + (mi & 1);
    const uint32_t addr = smem_u32(smem + off + nrow * 128 + ((unit ^ jr) << 4));
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                 "r"(pack2(s[8 * g], s[8 * g + 1])), "r"(pack2(s[8 * g + 2], s[8 * g + 3])),
                 "r"(pack2(s[8 * g + 4], s[8 * g + 5])), "r"(pack2(s[8 * g + 6], s[8 * g + 7]))
                 : "memory");
  }
}

// the rare case of the hand-off (warpgroup 1 moved a maximum): P^T0 in shared memory, row n times
// 2^(old[n] - ref[n]), in place (this warpgroup's 128 threads)
__device__ __forceinline__ void rescale_pt(uint8_t* smem, int off, const float* old, const float* ref, int span) {
  const int j0 = span & 15, nj = span >> 4;
  for (int i = threadIdx.x % 128 + j0 * 64; i < (j0 + nj) * 64; i += 128) {  // 8 units a row, 8 rows a group
    uint4* ptr = reinterpret_cast<uint4*>(smem + off + i * 16);
    uint4 v = *ptr;
    const float x = exp2f(old[i / 8] - ref[i / 8]);
    uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f2 = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&w[k]));
      w[k] = pack2(f2.x * x, f2.y * x);
    }
    *ptr = v;
  }
}

__device__ __forceinline__ void fence_o(float (&o)[4][32]) {
#pragma unroll
  for (int c = 0; c < 4; ++c) fence_regs(o[c]);
}

// ------------------------------------------------------------------------------------------ one program
template <int H, int wg>
__device__ __forceinline__ void consume(const Params& p, const Program& pr, int hblock, int gb, uint8_t* smem,
                                        const Bars& bars) {
  const int tid = threadIdx.x, warp = (tid % 128) / 32, lane = tid % 32;
  const int n_tiles = uniform(pr.n_tiles), n_blocks = (n_tiles + 1) / 2;
  const uint32_t* masks = reinterpret_cast<const uint32_t*>(smem + kSmemMask);
  float* red0 = reinterpret_cast<float*>(smem + kSmemMax);  // warpgroup 0's published max
  float* ref = reinterpret_cast<float*>(smem + kOffRef);    // warpgroup 1's: the pair's reference after a block
  int* spans = reinterpret_cast<int*>(smem + kOffSpan);
  float* tmax = reinterpret_cast<float*>(smem + kSmemTmax) + wg * kRows;  // this warpgroup's true column max
  // the column-max scratch: this warpgroup's tile's rope chunk, free once its QK is done
  float* cm = reinterpret_cast<float*>(smem + kSmemKV + wg * kTileBytes + (kChunks - 1) * kChunkBytes);
  const uint32_t sq = smem_u32(smem + kSmemQ);
  const uint32_t skv0 = smem_u32(smem + kSmemKV), skv1 = skv0 + kTileBytes;
  const uint32_t sp0 = smem_u32(smem + kSmemP0), sp1 = smem_u32(smem + kSmemP1);
  const uint64_t dq = desc_sw128(sq, 16, 1024);
  const float scale2 = p.scale2;

  float o[4][32];
#pragma unroll
  for (int c = 0; c < 4; ++c)
#pragma unroll
    for (int i = 0; i < 32; ++i) o[c][i] = 0.f;
  float l[2] = {0.f, 0.f}, s[32];

  if constexpr (wg == 0) {
    int span = 0;
    if (n_blocks > 0) {
      const uint64_t dk = desc_sw128(skv0, 16, 1024);
      wgmma_fence();
      wait_ready(bars.ready(0, 0), gb & 1);
      span = tile_span<H>(masks, lane);
      qk<H, 0, 4, 4, kChunks>(span, s, dk, dq, bars.ready(0, 1), gb & 1);
    }
    for (int b = 0, phase = gb & 1; b < n_blocks; ++b, phase ^= 1) {
      span = uniform(span);
      if (b == n_blocks - 1) mbar_arrive(bars.q_free());
      mask_warp_max<H>(s, masks, span, cm, warp, lane);
      bar_wg(kBarWg0);
      // the new reference from the pair's last one (ref; none in a program's first block), published as red0
      const float* old = b == 0 ? nullptr : ref;
      if (next_reference(cm, span, scale2, tmax, b == 0, old, old, red0, nullptr, warp, lane, kBarWg0)) {
#pragma unroll
        for (int c = 0; c < 16; ++c) {
          const float x = exp2f((old ? old[col_of(c, lane)] : kMaxInit) - red0[col_of(c, lane)]);
          scale_col(o, c, x);
          scale_l(l, c, x, lane);
        }
      }
      exp_sums(s, l, red0, span, scale2, lane);
      spans[0] = span;  // (by every thread: a store under a branch here serialized the kernel's wgmma)
      bar_arrive<kBarMax0>();
      // (every warp is past next_reference: the scratch is free for P^T0)
      store_pt(smem, kSmemP0, s, span, warp, lane);
      fence_async_smem();
      bar_wg(kBarWg0);  // the whole P^T0 stored before this warpgroup's PV reads it
      wgmma_fence();
      pv<H>(span, o, skv0, sp0);
      mbar_arrive(bars.free(0, 0));

      // warpgroup 1's reference is the block's: O^T, l and P^T0 to it, publish P^T0, then P^T1 V1^T
      bar_sync<kBarMax1>();
      const int span1 = uniform(spans[1]);
      bool moved = false;
      if (warp == 0) {
        const float2 a = *reinterpret_cast<const float2*>(ref + 2 * lane), c = *reinterpret_cast<const float2*>(red0 + 2 * lane);
        moved = a.x != c.x || a.y != c.y;
      }
      if (bar_wg_or(kBarWg0, moved)) {
#pragma unroll
        for (int c = 0; c < 16; ++c) {
          const float x = exp2f(red0[col_of(c, lane)] - ref[col_of(c, lane)]);
          scale_col(o, c, x);
          scale_l(l, c, x, lane);
        }
        rescale_pt(smem, kSmemP0, red0, ref, span);
      }
      fence_async_smem();
      bar_arrive<kBarP0>();
      mbar_arrive(bars.free(0, 1));
      bar_sync<kBarP1>();
      wgmma_fence();
      pv<H>(span1, o, skv1, sp1);
      mbar_arrive(bars.free(1, 0));
      if (b + 1 < n_blocks) {
        const uint64_t dk = desc_sw128(skv0, 16, 1024);
        wgmma_fence();
        wait_ready(bars.ready(0, 0), phase ^ 1);
        span = tile_span<H>(masks, lane);
        qk<H, 0, 4, 4, kChunks>(span, s, dk, dq, bars.ready(0, 1), phase ^ 1);
      }
    }
  } else {
    float* alpha = cm + 4 * 64;  // (the scratch's fifth row of 64: this warpgroup's rescale factors)
    for (int b = 0, phase = gb & 1; b < n_blocks; ++b, phase ^= 1) {
      const bool has1 = 2 * b + 1 < n_tiles;
      int span = 0;
      if (has1) {
        const uint64_t dk = desc_sw128(skv1, 16, 1024);
        wgmma_fence();
        wait_ready(bars.ready(1, 1), phase);
        span = tile_span<H>(masks + kTile, lane);
        qk<H, 4, kChunks, 0, 4>(span, s, dk, dq, bars.ready(1, 0), phase);
        mask_warp_max<H>(s, masks + kTile, span, cm, warp, lane);
      }
      span = uniform(span);
      if (b == n_blocks - 1) mbar_arrive(bars.q_free());
      bar_sync<kBarMax0>();  // (also orders the scratch's writes before warp 0 reads them)
      const int span0 = uniform(spans[0]);
      // the new reference from warpgroup 0's (red0), against this warpgroup's last one (ref), published as ref
      if (next_reference(cm, span, scale2, tmax, b == 0, red0, b == 0 ? nullptr : ref, ref, alpha, warp, lane,
                         kBarWg1)) {
        rescale(o, l, alpha, lane);
      }
      exp_sums(s, l, ref, span, scale2, lane);
      spans[1] = span;
      bar_arrive<kBarMax1>();
      if (span != 0) {
        store_pt(smem, kSmemP1, s, span, warp, lane);
        fence_async_smem();
        bar_wg(kBarWg1);  // the whole P^T1 stored before this warpgroup's PV reads it
        wgmma_fence();
        pv<H>(span, o, skv1 + 4 * kChunkBytes, sp1);
      }
      mbar_arrive(bars.free(1, 1));
      fence_async_smem();
      bar_arrive<kBarP1>();
      bar_sync<kBarP0>();
      wgmma_fence();
      pv<H>(span0, o, skv0 + 4 * kChunkBytes, sp0);
      mbar_arrive(bars.free(0, 1));
    }
  }

  // ---- epilogue: column sums over both warpgroups, normalize, O^T back to rows, 16-byte stores
  int tid_here;  // (the thread's rows from a fresh read of %tid: ptxas hoists them otherwise, as in today's)
  asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid_here));
  const int lane_e = tid_here % 32, warp_e = (tid_here % 128) / 32, q4 = lane_e % 4;
  float* part = reinterpret_cast<float*>(smem + kSmemP1);  // [wg][warp][64] partial column sums
  bar_sync<kBarSum>();  // both warpgroups done with every tile (P^T1's chunk is free)
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int c = scat_col(lane_e, i);
    part[(wg * 4 + warp_e) * 64 + 8 * (c / 2) + 2 * q4 + c % 2] = l[i];
  }
  bar_sync<kBarSum>();
  if (n_blocks == 0) mbar_arrive(bars.q_free());  // (no QK: arrived here instead)
  const float* tm0 = reinterpret_cast<const float*>(smem + kSmemTmax);
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    // this thread's two columns of group j: their sums over both warpgroups, the normalizing factors, and (lanes
    // 0-3 of warpgroup 0's warp 0, which hold every column) max_logits and lse
    float fac[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int col = 8 * j + 2 * q4 + e;
      float lt = 0.f;
#pragma unroll
      for (int w = 0; w < 8; ++w) lt += part[w * 64 + col];
      const bool empty = lt == 0.f;
      const float lse = empty ? INFINITY : ref[col] + log2f(lt);  // (both warpgroups' reference after the last block)
      fac[e] = empty ? 0.f : 1.f / lt;
      const RowOf x = row_of(p, pr, hblock, col);
      if (p.sink != nullptr && !empty && x.ok) fac[e] *= 1.f / (1.f + expf(p.sink[x.head] - lse * 0.6931471805599453f));
      if (wg == 0 && warp_e == 0 && lane_e < 4 && x.ok) {
        const long long at = static_cast<long long>(x.qq) * p.h + x.head;
        p.max_logits[at] = empty ? -INFINITY : fmaxf(tm0[col], tm0[kRows + col]);
        p.lse[at] = lse;
      }
    }
    // pieces (chunk k, half i): after movmatrix .trans lane holds column 8 j + lane / 4, d_v rows
    // 64 (4 wg + k) + 16 warp + 8 i + 2 q4 + {0, 1}
    uint32_t y[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const uint32_t x = pack2(o[k][4 * j + 2 * i] * fac[0], o[k][4 * j + 2 * i + 1] * fac[1]);
        asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y[2 * k + i]) : "r"(x));
      }
    }
    const int col = 8 * j + lane_e / 4;
    const RowOf x = row_of(p, pr, hblock, col);
    __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) + (x.ok ? x.qq * p.stride_os + x.head * p.stride_oh : 0);
    bool nan = false;
#pragma unroll
    for (int g = 0; g < 2; ++g) {
      uint32_t v[4] = {y[4 * g], y[4 * g + 1], y[4 * g + 2], y[4 * g + 3]};
      quad_transpose(v, q4);  // lane q4 now holds piece 4 g + q4 whole: d_v rows + 0 .. 7
      const int pc = 4 * g + q4, d = 64 * (4 * wg + pc / 2) + 16 * warp_e + 8 * (pc % 2);
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        nan = nan || (v[u] & 0x7fffu) > 0x7f80u || ((v[u] >> 16) & 0x7fffu) > 0x7f80u;
      }
      if (x.ok) *reinterpret_cast<uint4*>(out + d) = make_uint4(v[0], v[1], v[2], v[3]);
    }
    if (p.repair != nullptr && x.ok && nan) queue_for_repair(p.repair, p.s_q, x.qq);
  }
  bar_sync<kBarSum>();  // the partials and true maxima read before the next program writes them
}

template <int H, int wg>
__device__ __forceinline__ void consume_loop(const Params& p, uint8_t* smem, const Bars& bars) {
  const volatile int* work = reinterpret_cast<const int*>(smem + kSmemWork) + 2;
  for (int k = 0, gb = 0;; ++k) {
    wait_ready(bars.q_ready(), k & 1);
    const int w = work[k & 1];
    if (w >= p.n_work) break;
    int hblock;
    const Program pr = program_of(p, w, hblock);
    consume<H, wg>(p, pr, hblock, gb, smem, bars);
    gb += (pr.n_tiles + 1) / 2;
  }
}

}  // namespace swapped

// The consumers of this build: the swapped program for bf16 plans of 64 / h queries at h = 8 or 16 (every such
// work item; the caller passes only those), today's for everything else.
// OE_ONLY_H (a build switch): 8 or 16 builds that head count's program alone. ptxas decides once a kernel whether
// its wgmma are serialized, so the h = 16 span program (serialized) would otherwise slow the h = 8 one.
#ifndef OE_ONLY_H
#define OE_ONLY_H 0
#endif
template <typename T, typename OutT, bool kMma, int wg>
__device__ __forceinline__ void consume_programs_swapped(const Params& p, uint8_t* smem, const Bars& bars) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value && std::is_same<OutT, __nv_bfloat16>::value && kMma) {
    if constexpr (OE_ONLY_H != 16) {
      if (p.from_plan && p.qp * p.hb == kRows && p.hb == 8) {
        swapped::consume_loop<8, wg>(p, smem, bars);
        return;
      }
    }
    if constexpr (OE_ONLY_H != 8) {
      if (p.from_plan && p.qp * p.hb == kRows && p.hb == 16) {
        swapped::consume_loop<16, wg>(p, smem, bars);
        return;
      }
    }
  }
  consume_programs<T, OutT, kMma, wg>(p, smem, bars);
}

}  // namespace quilt_sm90
