// QUILT planner on the GPU: one CTA a query group, its membership table in shared memory.
//
// The same plan as planner/plan.py (torch) and planner/triton_plan.py, computed in one pass over
// the indices: each thread holds 16 consecutive entries of one member's list from load to tile write,
// and every ordering question (the tail of a segment, a column's place in its tile) is a block-wide
// prefix sum. The group's membership table is an open-addressing hash table in shared memory keyed by
// kv row (1.5 slots an entry, so its size depends on the group's entries, never on s_kv: any slot id of
// a paged pool plans alike). Each entry finds its row's slot once (a CAS at its home slot; the warp's
// collisions are then probed by all its lanes together) and from then on carries the slot, so every
// later lookup is one byte load of the slot's member bits; the row itself is read back from the slot's
// key when the tiles are written. The rows that tile-aware clipping
// pushes down (at most tile - 1 a block and level) go to a small hash set with one flag bit a (level,
// block), except at the merge level: a row pushed from there makes a column of the block's
// representative only.
//
// A row repeated inside one query's list: the occurrence whose OR found the member bit already set is an
// entry of its own query alone (its mask is the query's own bit), so every entry counts once for its own
// query and the partners see the row once.
//
// Plans whose merge level is the group (the defaults at 8, 16 and 32 heads) take a shorter path, kFlat
// below: one lookup and one scan instead of levels, a clipping scan and a second lookup pass; at group 8
// over lists of more than 512 entries its threads hold two runs of 16 entries, so that two CTAs fit an SM.
//
// Scope: group sizes 1..8 (member bits in one byte), group_size * topk <= 16384 (the table's slots fit
// in 15 bits), any kv row below 2^31 - 1. Anything else runs the Triton planner.
//
// Output: tile_mask null packs each column as row | member bits << 24 (s_kv < 2^24, padding -1);
// otherwise tile_kv holds the row and tile_mask the member bits.

#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "abi.cuh"
#include "launch.cuh"
#include "ptx.cuh"
namespace quilt_plan {

struct PlanParams {
  const int* indices;      // [s_q, topk], row stride stride_idx
  const int* topk_length;  // [s_q] or null
  int* tile_kv;            // [n_groups, cap, tile], every slot written (past a group's tiles: -1)
  int* tile_mask;          // [n_groups, cap, tile], every slot written (past a group's tiles: 0); null: packed
  int* tile_level;         // [n_groups, cap], every slot written
  int* tile_members;       // [n_groups, cap], every slot written
  int* group_tiles;        // [n_groups]
  int* group_rows;         // [n_groups]
  int* group_valid;        // [n_groups]
  int* dropped;            // [s_q], every entry written
  int* priv_idx;           // [s_q, topk], kept private rows written with split (the rest left as set)
  int* priv_n;             // [s_q], written with split
  long long stride_idx;
  int s_q, s_kv, topk, n_groups, cap, tile, merge, iclip, split;
  int log_flags;           // log2(slots of the pushed-row set)
  int nslots;              // slots of the membership hash table (< kDup)
  float thr;               // clip_threshold * tile
};

// PlanParams' fields in order, for the library's layout table (quilt_plan_params_layout): Python's ctypes
// mirror is tested against it field by field.
#define QUILT_PLAN_PARAMS_FIELDS(X)                                                                         \
  X(indices) X(topk_length) X(tile_kv) X(tile_mask) X(tile_level) X(tile_members) X(group_tiles) X(group_rows) \
  X(group_valid) X(dropped) X(priv_idx) X(priv_n) X(stride_idx) X(s_q) X(s_kv) X(topk) X(n_groups) X(cap)     \
  X(tile) X(merge) X(iclip) X(split) X(log_flags) X(nslots) X(thr)

constexpr int kEpt = 16;          // list entries a thread
constexpr int kMaxThreads = 1024;
// An entry's reference once its row is in the table: the slot, kDup for a repeated (query, row); an invalid
// entry's is the spare slot nslots, whose member byte stays 0, so every lookup is one load without a branch.
constexpr int kDup = 1 << 15;
constexpr int kSlotMask = kDup - 1;
constexpr int kPackShift = 24;    // packed column words: row | member bits << 24
constexpr int kMaxSeg = 16;       // segments a group: 2G - 1 levels (+ G / M merged blocks), G <= 8
static_assert(kMaxSeg <= 32, "the segment table keeps a segment a lane");

__device__ __forceinline__ unsigned get_lvl(unsigned long long lv, int i) {
  return static_cast<unsigned>(lv >> (4 * i)) & 0xFu;
}
__device__ __forceinline__ void set_lvl(unsigned long long& lv, int i, unsigned v) {
  lv = (lv & ~(0xFull << (4 * i))) | (static_cast<unsigned long long>(v) << (4 * i));
}
__device__ __forceinline__ unsigned field(unsigned long long x, int f) {
  return static_cast<unsigned>(x >> (16 * f)) & 0xFFFFu;
}
__device__ __forceinline__ int ilog2(unsigned x) { return 31 - __clz(x); }
// how many of the 16 nibbles of x equal v (SWAR: a nibble's bits ORed into its lowest bit)
__device__ __forceinline__ unsigned count_nibbles(unsigned long long x, unsigned v) {
  x ^= 0x1111111111111111ull * v;
  x |= x >> 1;
  x |= x >> 2;
  return 16u - static_cast<unsigned>(__popcll(x & 0x1111111111111111ull));
}
__host__ __device__ constexpr int ilog2_c(int x) { return x > 1 ? 1 + ilog2_c(x / 2) : 0; }
// n / d for n < 2^20 without an integer division's ~20 instructions: with a reciprocal good to 2^-21 the
// truncated float quotient is exact or one low
__device__ __forceinline__ unsigned div_small(unsigned n, unsigned d) {
  const unsigned q = __float2uint_rz(__fmul_rz(__uint2float_rz(n), __fdividef(1.0f, static_cast<float>(d))));
  return q + (n - q * d >= d ? 1u : 0u);
}

// A thread's 16 ints of the rows area are four 16-byte pieces, kRowsStride pieces apart: piece i of a warp's
// lanes is one contiguous 512 bytes, so each 16-byte load or store of a warp takes the minimum 4 wavefronts
// (the lanes' pieces side by side, 64 bytes apart, took 16). A warp's stretch stays its own 2 KB.
#ifdef QUILT_PLAN_ROWS_CONTIGUOUS  // measurement only: the former layout, a thread's pieces side by side
constexpr int kRowsStride = 1;
#else
constexpr int kRowsStride = 32;
#endif
// this thread's 16 kv rows (-1: invalid entry), kept in shared memory between phases
__device__ __forceinline__ void load_rows(const int4* src, int (&r)[kEpt]) {
#pragma unroll
  for (int i = 0; i < kEpt / 4; ++i) {
    const int4 v = src[kRowsStride * i];
    r[4 * i] = v.x, r[4 * i + 1] = v.y, r[4 * i + 2] = v.z, r[4 * i + 3] = v.w;
  }
}
// member bits of an entry: its slot's byte, its own bit alone for a repeat, 0 for an invalid entry (the
// spare byte at slot nslots, never set)
__device__ __forceinline__ unsigned mask_at(const unsigned char* tab, int ref, unsigned own) {
  const unsigned m = tab[ref & kSlotMask];
  return (ref & kDup) ? own : m;
}

// The membership table: keys hold row + 1 (0: empty); home slot by a multiplicative hash scaled to nslots.
__device__ __forceinline__ unsigned row_home(unsigned key, int nslots) {
  return __umulhi(key * 2654435769u, static_cast<unsigned>(nslots));
}

// The slot of `key` past `at`, a slot holding another key: linear probing, claiming the first empty slot
__device__ __forceinline__ unsigned probe_on(unsigned* hkeys, unsigned at, unsigned key, int nslot) {
  for (;;) {
    at = at + 1u == static_cast<unsigned>(nslot) ? 0u : at + 1u;
    const unsigned w = atomicCAS(hkeys + at, 0u, key);
    if (w == 0u || w == key) return at;
  }
}

// the column word a slot reference and its member bits stage as until the tiles are written
__device__ __forceinline__ int stage_word(int ref, unsigned bits) {
  return (ref & kSlotMask) | static_cast<int>(bits << 16);
}
// a staged word's row (from its slot's key); a packed column word
__device__ __forceinline__ int staged_row(const unsigned* keys, int v) { return static_cast<int>(keys[v & 0xFFFF]) - 1; }
__device__ __forceinline__ int packed(int row, int bits) { return row | (bits << kPackShift); }
__device__ __forceinline__ void put_column(int* kv_out, int* mask_out, const unsigned* keys, int d, int v) {
  const int row = staged_row(keys, v), bits = v >> 16;
  if (mask_out == nullptr) {
    kv_out[d] = packed(row, bits);
  } else {
    kv_out[d] = row;
    mask_out[d] = bits;
  }
}

// run h of this thread's slot references (kH = 2 keeps two runs in the 16-bit halves of one int)
template <int kH>
__device__ __forceinline__ int ref_of(int raw, int h) {
  if constexpr (kH == 1) return raw;
  return (raw >> (16 * h)) & 0xFFFF;
}
template <int kH>
__device__ __forceinline__ void load_refs(const int4* src, int h, int (&r)[kEpt]) {
  load_rows(src, r);
#pragma unroll
  for (int i = 0; i < kEpt; ++i) r[i] = ref_of<kH>(r[i], h);
}

// The pushed-row set: open addressing over (row + 1) keys, a flag word per key.
__device__ __forceinline__ unsigned flag_hash(int row, int log_flags) {
  return (static_cast<unsigned>(row) * 2654435769u) >> (32 - log_flags);
}
__device__ __forceinline__ void flag_set(unsigned* keys, unsigned* vals, int log_flags, int row, unsigned bit) {
  const unsigned key = static_cast<unsigned>(row) + 1u, wrap = (1u << log_flags) - 1u;
  for (unsigned h = flag_hash(row, log_flags);; h = (h + 1u) & wrap) {
    const unsigned w = atomicCAS(keys + h, 0u, key);
    if (w == 0u || w == key) {
      atomicOr(vals + h, bit);
      return;
    }
  }
}
__device__ __forceinline__ unsigned flag_get(const unsigned* keys, const unsigned* vals, int log_flags, int row) {
  const unsigned key = static_cast<unsigned>(row) + 1u, wrap = (1u << log_flags) - 1u;
  for (unsigned h = flag_hash(row, log_flags);; h = (h + 1u) & wrap) {
    const unsigned w = keys[h];
    if (w == key) return vals[h];
    if (w == 0u) return 0u;
  }
}

// Prefix of ``v`` (packed 16-bit counters, no field overflows: <= 16384 entries) inside this thread's
// member list, exclusive, and the member's total. Members are whole warps
// (tpm a multiple of 32), so after one barrier every warp sums the totals of the warps before it itself
// (two 5-step reductions) instead of waiting on a second barrier for one warp's scan of them. ``wsum``
// alternates between two halves (``parity``): a warp may start the next scan while a slower one still
// reads this one's totals, and every thread passes a barrier of the next scan before the one after.
__device__ __forceinline__ unsigned long long member_scan(unsigned long long v, int k, int tpm,
                                                          unsigned long long* wsum, int parity,
                                                          unsigned long long& total) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, w0 = k * (tpm >> 5), w1 = w0 + (tpm >> 5);
  unsigned long long* ws = wsum + 32 * parity;
  unsigned long long x = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const unsigned long long y = __shfl_up_sync(0xFFFFFFFFu, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) ws[w] = x;
  __syncthreads();
  const unsigned long long t = lane < (blockDim.x >> 5) ? ws[lane] : 0ull;
  unsigned long long before = lane >= w0 && lane < w ? t : 0ull, all = lane >= w0 && lane < w1 ? t : 0ull;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) {
    before += __shfl_xor_sync(0xFFFFFFFFu, before, d);
    all += __shfl_xor_sync(0xFFFFFFFFu, all, d);
  }
  total = all;
  return before + x - v;
}

// Largest aligned block holding member k whose members all selected the row (mask m): blocks nest,
// so it is the largest L whose block bits are all set (bm[e]: the bits of k's block of G >> e).
template <int G>
struct Blocks {
  unsigned bm[ilog2_c(G) + 1];
  __device__ explicit Blocks(int k) {
#pragma unroll
    for (int e = 0; e <= ilog2_c(G); ++e) {
      const int L = G >> e;
      bm[e] = ((1u << L) - 1u) << (k & ~(L - 1));
    }
  }
  __device__ __forceinline__ unsigned level(unsigned m) const {
    unsigned l = 1u;
#pragma unroll
    for (int e = ilog2_c(G) - 1; e >= 0; --e) l = (m & bm[e]) == bm[e] ? static_cast<unsigned>(G >> e) : l;
    return l;
  }
};

// This thread's member k, and its place in its merge block of M members (all powers of two, so
// per-entry work needs shifts, not divisions).
struct Member {
  int k, M;
  int mshift;      // first bit of k's merge block in a member mask
  unsigned mfull;  // the merge block's bits, shifted down
  unsigned mlow;   // k's bit inside its merge block
  __device__ Member(int k_, int M_) : k(k_), M(M_), mshift(k_ & ~(M_ - 1)), mfull((1u << M_) - 1u),
                                      mlow(1u << (k_ & (M_ - 1))) {}
  __device__ __forceinline__ unsigned merge_bits(unsigned m) const { return (m >> mshift) & mfull; }
};

// Which per-member counter a tile column uses (-1: the entry is not a column of this member):
// level L >= merge: field log2(G / L) when k represents its block; below the merge level: field 3
// when k is the block's lowest owner of the row (merge > 1 leaves at most 3 levels, fields 0..2).
template <int G>
__device__ __forceinline__ int column_field(unsigned lvl, unsigned m, const Member& me) {
  if (lvl == 0u || lvl == 15u) return -1;
  if (static_cast<int>(lvl) >= me.M) return (me.k & (lvl - 1u)) == 0u ? ilog2(G) - ilog2(lvl) : -1;
  const unsigned mb = me.merge_bits(m);
  return (mb & (0u - mb)) == me.mlow ? 3 : -1;
}

// plan_kernel's stages, in order: load_entries, membership, cascade_levels (or flat_column_kinds), clip_tiles,
// private_rows, column_counts, segments (with clip_flat), write_columns, write_tiles; the torch planner
// (planner/plan.py) takes the same steps. Each stage compiles to the code it had inside one kernel body
// (nvcc optimizes a stage before inlining it, so the stages are written for that): a parameter read under
// a condition is loaded unconditionally (p.thr), and a value two stages need is computed once in the kernel.
//
// What every stage reads: the shared-memory areas (layout in plan_kernel), this thread's member and the
// place of its entries in the member's list; an aggregate of values plan_kernel computes first, Member and
// Blocks by reference (copies of them here changed the generated code). The parameters and the static
// shared variables are arguments of their own.
template <int G, bool kFlat, int kH>
struct PlanCta {
  unsigned char* smem;       // the dynamic shared memory
  int tid, nt, tpm;          // thread, threads, threads a member
  int4* my_rows;             // this thread's first piece of the rows area (kRowsStride)
  unsigned* fkeys;           // the pushed-row set: keys, then flag words
  unsigned* fvals;
  unsigned* hkeys;           // the membership table: keys, then member bytes
  int nslot, nkeys;
  unsigned char* tab;
  int k, j0, g, q;           // member, its first list entry of this thread, group, query
  int M, T;                  // merge level, tile
  const Member& me;
  const Blocks<G>& blocks;
};

// 0. this thread's list entries, loaded first: their latency runs under the clear of the pushed-row set
//    and the membership table that follows
template <int G, bool kFlat, int kH>
__device__ __forceinline__ void load_entries(const PlanParams& p, const PlanCta<G, kFlat, kH>& c, int (&ent)[kH][kEpt],
                                             int& n_valid, unsigned& pushed) {
  const int q = c.q, tid = c.tid, nt = c.nt;
  const int* list = p.indices + static_cast<long long>(q < p.s_q ? q : 0) * p.stride_idx;
  int lim = 0;
  if (q < p.s_q) {
    lim = p.topk;
    if (p.topk_length != nullptr) lim = min(lim, p.topk_length[q]);
  }
  auto load16 = [&](int j, int (&r)[kEpt]) {  // entries j .. j + 15 of this member's list (-1 from lim on)
    if (j + kEpt <= lim && (reinterpret_cast<uintptr_t>(list + j) & 15u) == 0u) {
#pragma unroll
      for (int i = 0; i < kEpt; i += 4) {
        const int4 v = __ldg(reinterpret_cast<const int4*>(list + j + i));
        r[i] = v.x, r[i + 1] = v.y, r[i + 2] = v.z, r[i + 3] = v.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < kEpt; ++i) r[i] = j + i < lim ? __ldg(list + j + i) : -1;
    }
  };
  const int run = c.tpm * kEpt;  // list entries between a thread's runs (kH > 1)
#pragma unroll
  for (int h = 0; h < kH; ++h) load16(c.j0 + h * run, ent[h]);
  {  // clear the flag set and the membership table (16-byte stores)
    const int n16 = ((8 << p.log_flags) + 4 * c.nkeys + c.nslot + 1 + 15) / 16;  // (+1: the spare byte at slot nslots)
    uint4* z = reinterpret_cast<uint4*>(c.fkeys);
#pragma unroll 1
    for (int i0 = tid; i0 < n16; i0 += 4 * nt) {  // (unrolled by hand: no trip count, so no division by nt)
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if (i0 + u * nt < n16) z[i0 + u * nt] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }
  if (tid == 0) n_valid = 0, pushed = 0u;
  __syncthreads();
}

// 1. membership: every valid entry finds (or claims) its row's slot, then ORs its member bit into the
//    slot's byte; from here on an entry is its slot reference (ent[h][i]), also kept in the rows area
template <int G, bool kFlat, int kH>
__device__ __forceinline__ void membership(const PlanParams& p, const PlanCta<G, kFlat, kH>& c, int (&ent)[kH][kEpt],
                                           int& n_valid) {
  const int k = c.k, tid = c.tid, nslot = c.nslot;
  unsigned* hkeys = c.hkeys;
  int4* my_rows = c.my_rows;
  int cnt = 0;
#pragma unroll
  for (int h = 0; h < kH; ++h) {
    unsigned coll = 0u;  // entries whose home slot holds another row
#pragma unroll
    for (int i = 0; i < kEpt; ++i) {  // first probes, independent of each other and branch-free: an
      // invalid entry writes the spare key at slot nslot, which no probe and no column reads. From here an
      // entry holds its slot, or its key (row + 1) while it still collides.
      const bool ok = static_cast<unsigned>(ent[h][i]) < static_cast<unsigned>(p.s_kv);
      const unsigned key = static_cast<unsigned>(ent[h][i]) + 1u;
      const unsigned hashed = row_home(key, nslot);  // (for every entry: no predicated hash)
      const unsigned home = ok ? hashed : static_cast<unsigned>(nslot);
      const unsigned w = atomicCAS(hkeys + home, 0u, key);
      const bool cl = ok && w != 0u && w != key;
      coll |= static_cast<unsigned>(cl) << i;
      ent[h][i] = static_cast<int>(cl ? key : home);
    }
    // The warp's colliding entries are probed by all its lanes at once, from a list in the warp's part of
    // the rows area (free until the references are stored below; 16 ints a lane, as many as a lane's
    // entries). Probing each lane's own entries instead runs 16 divergent loops a warp, a few lanes each.
    {
      const int lane = tid & 31;
      unsigned* wl = reinterpret_cast<unsigned*>(c.smem) + (tid - lane) * kEpt;
      const int mine = __popc(coll);
      int off = mine;  // inclusive scan of the lanes' counts
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const int v = __shfl_up_sync(0xFFFFFFFFu, off, d);
        if (lane >= d) off += v;
      }
      const int total = __shfl_sync(0xFFFFFFFFu, off, 31);
      off -= mine;
      if (total != 0) {  // (warp-uniform)
        unsigned* wp = wl + off;
#pragma unroll
        for (int i = 0; i < kEpt; ++i) {
          if ((coll >> i) & 1u) *wp++ = static_cast<unsigned>(ent[h][i]);
        }
        __syncwarp();
        for (int j = lane; j < total; j += 32) {
          const unsigned key = wl[j];
          wl[j] = probe_on(hkeys, row_home(key, nslot), key, nslot);
        }
        __syncwarp();
        const unsigned* rp = wl + off;
#pragma unroll
        for (int i = 0; i < kEpt; ++i) {
          if ((coll >> i) & 1u) ent[h][i] = static_cast<int>(*rp++);
        }
      }
      __syncwarp();  // (the next run's list, or the references below, overwrite the list)
    }
#pragma unroll
    for (int i = 0; i < kEpt; ++i) {  // branch-free: an invalid entry ORs 0 into the spare byte's word
      const int sl = ent[h][i];
      const bool ok = sl != nslot;
      // own << 8 * (sl & 3): a funnel shift takes its count mod 32
      const unsigned bit = ok ? __funnelshift_l(0u, 1u << k, static_cast<unsigned>(sl) << 3) : 0u;
      const unsigned old = atomicOr(reinterpret_cast<unsigned*>(c.tab) + (sl >> 2), bit);
      ent[h][i] = (old & bit) != 0u ? sl | kDup : sl;
      cnt += ok;
    }
  }
  // the entries' references wait in shared memory (kH = 2: run 0 in the low, run 1 in the high 16 bits)
#pragma unroll
  for (int i = 0; i < kEpt / 4; ++i) {
    int v[4];
#pragma unroll
    for (int c4 = 0; c4 < 4; ++c4) {
      v[c4] = kH == 1 ? ent[0][4 * i + c4] : (ent[0][4 * i + c4] & 0xFFFF) | (ent[kH - 1][4 * i + c4] << 16);
    }
    my_rows[kRowsStride * i] = make_int4(v[0], v[1], v[2], v[3]);
  }
#pragma unroll
  for (int d = 16; d > 0; d /= 2) cnt += __shfl_xor_sync(0xFFFFFFFFu, cnt, d);
  if ((tid & 31) == 0 && cnt) atomicAdd(&n_valid, cnt);
  __syncthreads();
}

// 2-5 at once (kFlat): each entry's column kind as two bit masks of a run's entries, fk[h]: bit i a level-G
// column (member 0's), bit 16 + i a merged column (its lowest owner's); and its member mask, a byte an entry
// in mk[h]
template <int G, bool kFlat, int kH>
__device__ __forceinline__ void flat_column_kinds(const PlanCta<G, kFlat, kH>& c, unsigned own, unsigned (&fk)[kH],
                                                  unsigned (&mk)[kH][kEpt / 4]) {
  constexpr unsigned kAll = (1u << G) - 1u;
  const unsigned upto = 2u * own - 1u;  // member bits 0 .. k: the mask's lowest owner is k when they are k's alone
#pragma unroll
  for (int h = 0; h < kH; ++h) {
    int rr[kEpt];
    load_refs<kH>(c.my_rows, h, rr);  // (frees the entries' registers across the barrier)
    unsigned all = 0u, lowest = 0u;
#pragma unroll
    for (int i = 0; i < kEpt; ++i) {
      const unsigned m = mask_at(c.tab, rr[i], own);
      all |= static_cast<unsigned>(m == kAll) << i;
      lowest |= static_cast<unsigned>((m & upto) == own) << i;
      mk[h][i / 4] |= m << (8 * (i % 4));
    }
    fk[h] = (c.k == 0 ? all : 0u) | ((lowest & ~all) << 16);
  }
}

// 2. cascade levels from the member masks: each entry's level, 4 bits an entry in lv (invalid: 0)
template <int G, bool kFlat, int kH>
__device__ __forceinline__ void cascade_levels(const PlanCta<G, kFlat, kH>& c, unsigned own, const int (&ent)[kH][kEpt],
                                               unsigned long long& lv) {
#pragma unroll
  for (int i = 0; i < kEpt; ++i) {
    const unsigned l = c.blocks.level(mask_at(c.tab, ent[0][i], own));  // invalid: level 0
    lv |= static_cast<unsigned long long>(ent[0][i] != c.nslot ? l : 0u) << (4 * i);
  }
}

// 3. tile-aware clipping, top level first: a block's representative (its first member) pushes the
//    r lowest-ranked rows of its level-L segment down when r = n % T is below the threshold; the
//    other members learn which rows moved from the pushed-row set. `scans`: member scans so far.
template <int G, bool kFlat, int kH>
__device__ __forceinline__ int clip_tiles(const PlanParams& p, const PlanCta<G, kFlat, kH>& c,
                                          unsigned long long (&wsum)[2 * 32], unsigned& pushed, unsigned long long& lv,
                                          int scans) {
  const int k = c.k, tid = c.tid, tpm = c.tpm, M = c.M, T = c.T;
  int e = 0;
#pragma unroll 1
  for (int L = G; !kFlat && L >= 2 && L >= M; L /= 2, ++e) {
    const float thr = p.thr;  // (loaded unconditionally: the load is hoisted out of the loop)
    unsigned cnt = 0;
#pragma unroll
    for (int i = 0; i < kEpt; ++i) cnt += get_lvl(lv, i) == static_cast<unsigned>(L);
    unsigned long long tot;
    const unsigned pos0 = static_cast<unsigned>(member_scan(cnt, k, tpm, wsum, scans++ & 1, tot));
    const unsigned fbit = 1u << ((1 << e) - 1 + (k >> ilog2(L)));  // flag of (level, block)
    const unsigned n = static_cast<unsigned>(tot), r = n % T;
    const bool push = (k & (L - 1)) == 0 && r > 0u && static_cast<float>(r) < thr;
    if (L == M) {
      // Pushed below the merge level, a row joins the block's merged segment, where its column belongs to
      // its lowest owner: the representative, who moves its own entries. The other members' entries of
      // the row make no column either way, so they need not learn of it (no pushed-row set, no barrier).
      if (push) {
        unsigned pos = pos0;
#pragma unroll
        for (int i = 0; i < kEpt; ++i) {
          if (get_lvl(lv, i) == static_cast<unsigned>(L)) {
            if (pos >= n - r) set_lvl(lv, i, L / 2);
            ++pos;
          }
        }
      }
    } else if (__syncthreads_or(push)) {
      int rows[kEpt];
      load_rows(c.my_rows, rows);
      if (push) {
        if (tid % tpm == 0) atomicOr(&pushed, fbit);
        unsigned pos = pos0;
#pragma unroll
        for (int i = 0; i < kEpt; ++i) {
          if (get_lvl(lv, i) == static_cast<unsigned>(L)) {
            if (pos >= n - r) flag_set(c.fkeys, c.fvals, p.log_flags, rows[i] & kSlotMask, fbit);
            ++pos;
          }
        }
      }
      __syncthreads();
      if (pushed & fbit) {  // (only the members of a block that pushed have rows to move)
#pragma unroll
        for (int i = 0; i < kEpt; ++i) {
          if (get_lvl(lv, i) == static_cast<unsigned>(L) &&
              (flag_get(c.fkeys, c.fvals, p.log_flags, rows[i] & kSlotMask) & fbit)) {
            set_lvl(lv, i, L / 2);
          }
        }
      }
    }
  }
  return scans;
}

// 4. private rows: importance-aware clipping drops the lowest-ranked r; split lists the rest per query
template <int G, bool kFlat, int kH>
__device__ __forceinline__ void private_rows(const PlanParams& p, const PlanCta<G, kFlat, kH>& c, unsigned own,
                                             unsigned long long (&wsum)[2 * 32], const int (&rows)[kEpt],
                                             unsigned long long& lv, int& scans) {
  const int q = c.q, M = c.M, T = c.T;
  unsigned pmask = 0u;
#pragma unroll
  for (int i = 0; i < kEpt; ++i) {
    const unsigned l = get_lvl(lv, i);
    bool priv;
    if (M == 1) {
      priv = l == 1u;
    } else {
      const unsigned mb = c.me.merge_bits(mask_at(c.tab, rows[i], own));
      priv = l > 0u && static_cast<int>(l) < M && (mb & (mb - 1u)) == 0u;
    }
    pmask |= static_cast<unsigned>(priv) << i;
  }
  unsigned long long tot;
  unsigned pos = static_cast<unsigned>(member_scan(__popc(pmask), c.k, c.tpm, wsum, scans++ & 1, tot));
  const unsigned n = static_cast<unsigned>(tot), r = n % T;
  const bool clip = p.iclip && r > 0u && static_cast<float>(r) < p.thr;
  const unsigned keep_n = n - (clip ? r : 0u);
#pragma unroll
  for (int i = 0; i < kEpt; ++i) {
    if ((pmask >> i) & 1u) {
      if (pos >= keep_n) {
        set_lvl(lv, i, 0u);
      } else if (p.split) {
        p.priv_idx[static_cast<long long>(q) * p.topk + pos] = static_cast<int>(c.hkeys[rows[i] & kSlotMask]) - 1;
        set_lvl(lv, i, 15u);  // in no tile
      }
      ++pos;
    }
  }
  if (c.tid % c.tpm == 0 && q < p.s_q) {
    if (p.iclip) p.dropped[q] = static_cast<int>(n - keep_n);
    if (p.split) p.priv_n[q] = static_cast<int>(keep_n);
  }
}

// 5a. columns counted per member and kind: c64 holds this thread's count of each kind in a 16-bit field
//     (kFlat, kH = 1: fields 0 and 3, level G and merged; kH = 2: field 2h + (merged) for run h); the
//     non-flat path turns lv into each entry's column kind on the way (15: no column)
template <int G, bool kFlat, int kH>
__device__ __forceinline__ unsigned long long column_counts(const PlanCta<G, kFlat, kH>& c, unsigned own,
                                                            const int (&rows)[kEpt],
                                                            const unsigned (&fk)[kH],
                                                            unsigned long long& lv) {
  unsigned long long c64 = 0ull;
  if constexpr (!kFlat) {
    unsigned kinds = 0u;
#pragma unroll
    for (int i = 0; i < kEpt; ++i) {  // from here on lv holds each entry's column kind (15: no column)
      const unsigned l = get_lvl(lv, i);
      const unsigned m = mask_at(c.tab, rows[i], own);
      const int f = column_field<G>(l, m, c.me);
      kinds |= (f < 0 ? 15u : static_cast<unsigned>(f)) << (4 * (i % 8));
      if (i % 8 == 7) {
        lv = (lv & ~(0xFFFFFFFFull << (4 * (i - 7)))) | (static_cast<unsigned long long>(kinds) << (4 * (i - 7)));
        kinds = 0u;
      }
    }
  }
  if constexpr (kFlat) {
#pragma unroll
    for (int h = 0; h < kH; ++h) {
      c64 |= static_cast<unsigned long long>(__popc(fk[h] & 0xFFFFu)) << (16 * (kH == 1 ? 0 : 2 * h));
      c64 |= static_cast<unsigned long long>(__popc(fk[h] >> 16)) << (16 * (kH == 1 ? 3 : 2 * h + 1));
    }
  } else {
#pragma unroll
    for (int ff = 0; ff < 4; ++ff) c64 |= static_cast<unsigned long long>(count_nibbles(lv, ff)) << (16 * ff);
  }
  return c64;
}

// kFlat: each run's columns before it in rank order (pos0: level G, pos3: merged) and its counts
template <int kH>
struct FlatRuns {
  unsigned pos0[kH] = {}, pos3[kH] = {}, cnt0[kH] = {}, cnt3[kH] = {};
};

// The group's segments (levels G .. M by block, then the merged blocks), lane j of every warp holding
// segment j: its columns n, first tile, end tile incl, level and member bits; and this thread's place.
struct Segments {
  unsigned long long mine;  // this member's columns before this thread's, by kind (16-bit fields)
  int n_lev, ns;            // level fields 0 .. n_lev - 1 (merged: field 3); segments
  int n, lvl, bits;         // lane's segment: columns, level, member bits
  int my_mstart;            // this thread's member's first column inside its block's merged segment
  int first, incl;          // lane's segment: first tile, last tile + 1
  int n_tiles;              // the group's tiles
};

// 5b (kFlat). tile-aware clipping of the level-G segment (member 0's kind-0 columns, n of them): its last
//     r = n % T rows by rank move to member 0's merged columns, so every count and prefix of member 0
//     moves by what lies past the cut. mt: lane j < G holds member j's column counts by kind.
template <int G, bool kFlat, int kH>
__device__ __forceinline__ void clip_flat(const PlanParams& p, const PlanCta<G, kFlat, kH>& c, unsigned long long& mt,
                                          int lane, FlatRuns<kH>& fr, unsigned (&fk)[kH]) {
  constexpr unsigned kFull = 0xFFFFFFFFu;
  const int T = c.T;
  unsigned(&pos0)[kH] = fr.pos0;
  unsigned(&pos3)[kH] = fr.pos3;
  unsigned(&cnt0)[kH] = fr.cnt0;
  unsigned(&cnt3)[kH] = fr.cnt3;
  const unsigned n0 = field(__shfl_sync(kFull, mt, 0), 0), cut = div_small(n0, T) * T, r0 = n0 - cut;
  const float thr = p.thr;
  if (r0 > 0u && static_cast<float>(r0) < thr) {  // (block-uniform)
    if (lane == 0) mt += (static_cast<unsigned long long>(r0) << 48) - r0;
    if (c.k == 0) {
#pragma unroll
      for (int h = 0; h < kH; ++h) {
        unsigned pos = pos0[h], moved = 0u;
#pragma unroll
        for (int i = 0; i < kEpt; ++i) {
          if ((fk[h] >> i) & 1u) {
            if (pos >= cut) fk[h] ^= (1u << i) | (1u << (16 + i)), ++moved;
            ++pos;
          }
        }
        const unsigned past = pos0[h] > cut ? pos0[h] - cut : 0u;
        pos0[h] -= past, pos3[h] += past, cnt0[h] -= moved, cnt3[h] += moved;
      }
    }
  }
}

// 5. segments: the columns placed by prefix sums. A member scan gives this thread's columns before it;
//    the segment table (a lane a segment) is built by every warp itself from the scan's warp totals (in
//    wsum since the scan's barrier), so no barrier waits for one warp to publish it. Shuffle sources are
//    warp-uniform or per lane; every lane runs every shuffle. Writes the group's tile, row and valid counts.
template <int G, bool kFlat, int kH>
__device__ __forceinline__ Segments segments(const PlanParams& p, const PlanCta<G, kFlat, kH>& c,
                                             unsigned long long (&wsum)[2 * 32], const int& n_valid,
                                             unsigned long long c64, int& scans, FlatRuns<kH>& fr,
                                             unsigned (&fk)[kH]) {
  const int k = c.k, tid = c.tid, tpm = c.tpm, M = c.M, T = c.T, g = c.g;
  unsigned(&pos0)[kH] = fr.pos0;
  unsigned(&pos3)[kH] = fr.pos3;
  unsigned(&cnt0)[kH] = fr.cnt0;
  unsigned(&cnt3)[kH] = fr.cnt3;
  Segments sg;
  unsigned long long tot64;
  // this member's columns before mine
  unsigned long long mine = member_scan(c64, k, tpm, wsum, scans++ & 1, tot64);
  sg.mine = mine;
  constexpr unsigned kFull = 0xFFFFFFFFu;
  const int n_lev = ilog2(G) - ilog2(M) + 1;  // level fields 0 .. n_lev - 1; merged: field 3
  const int lane = tid & 31, n_lvl_seg = (1 << n_lev) - 1, ns = n_lvl_seg + (M > 1 ? G / M : 0);
  sg.n_lev = n_lev, sg.ns = ns;
  unsigned long long mt = 0ull;  // lane j < G: member j's column counts by kind
  {
    const unsigned long long* ws = wsum + 32 * ((scans - 1) & 1);
    const int wpm = tpm >> 5;
    if (lane < G) {
      for (int w = 0; w < wpm; ++w) mt += ws[lane * wpm + w];
    }
  }
  if constexpr (kFlat) {
    if constexpr (kH == 1) {
      pos0[0] = field(mine, 0), pos3[0] = field(mine, 3), cnt0[0] = field(c64, 0), cnt3[0] = field(c64, 3);
    } else {  // every thread's run h precedes every run h + 1 of its member
      unsigned b0 = 0u, b3 = 0u;
#pragma unroll
      for (int h = 0; h < kH; ++h) {
        pos0[h] = b0 + field(mine, 2 * h), pos3[h] = b3 + field(mine, 2 * h + 1);
        cnt0[h] = field(c64, 2 * h), cnt3[h] = field(c64, 2 * h + 1);
        b0 += field(tot64, 2 * h), b3 += field(tot64, 2 * h + 1);
      }
      if (lane < G) mt = (field(mt, 0) + field(mt, 2)) | static_cast<unsigned long long>(field(mt, 1) + field(mt, 3)) << 48;
    }
    clip_flat(p, c, mt, lane, fr, fk);
  }
  const bool lvl_lane = lane < n_lvl_seg, mrg_lane = lane >= n_lvl_seg && lane < ns;
  const int sf = lvl_lane ? ilog2(lane + 1) : 0, sb = lvl_lane ? lane + 1 - (1 << sf) : lane - n_lvl_seg;
  const unsigned long long mrep = __shfl_sync(kFull, mt, lvl_lane ? sb * (G >> sf) : 0);
  int n = 0, lvl = 0, bits = 0;
  if (lvl_lane) {
    const int L = G >> sf;
    n = static_cast<int>(field(mrep, sf));
    lvl = L, bits = ((1 << L) - 1) << (sb * L);
  }
  int my_mstart = 0;  // this thread's member's first column inside its block's merged segment
  if constexpr (kFlat) {  // one merged block: a scan of the members' merged counts (lane j: member j)
    const int f3 = lane < G ? static_cast<int>(field(mt, 3)) : 0;
    int inc = f3;
#pragma unroll
    for (int d = 1; d < G; d <<= 1) {
      const int y = __shfl_up_sync(kFull, inc, d);
      if (lane >= d) inc += y;
    }
    my_mstart = __shfl_sync(kFull, inc - f3, k);
    const int n_mrg = __shfl_sync(kFull, inc, G - 1);
    if (mrg_lane) n = n_mrg, bits = (1 << G) - 1;
  } else if (M > 1) {
#pragma unroll 1
    for (int j = 0; j < M; ++j) {
      const unsigned long long mj = __shfl_sync(kFull, mt, mrg_lane ? sb * M + j : 0);
      const unsigned long long mk = __shfl_sync(kFull, mt, (k & ~(M - 1)) + j);  // (k: warp-uniform)
      if (mrg_lane) n += static_cast<int>(field(mj, 3));
      if (j < (k & (M - 1))) my_mstart += static_cast<int>(field(mk, 3));
    }
    if (mrg_lane) bits = ((1 << M) - 1) << (sb * M);
  }
  const int tiles = static_cast<int>(div_small(static_cast<unsigned>(n + T - 1), T));
  int incl = tiles;  // the segment's last tile + 1
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(kFull, incl, d);
    if (lane >= d) incl += y;
  }
  const int first = incl - tiles;                             // the segment's first tile
  const int n_tiles = __shfl_sync(kFull, incl, ns - 1);       // the group's tiles
  {
    const int rows_all = __reduce_add_sync(kFull, n);
    if (tid == 0) {
      p.group_tiles[g] = n_tiles;
      p.group_rows[g] = rows_all;
      p.group_valid[g] = n_valid;
    }
  }
  sg.n = n, sg.lvl = lvl, sg.bits = bits, sg.my_mstart = my_mstart;
  sg.first = first, sg.incl = incl, sg.n_tiles = n_tiles;
  return sg;
}

// 6a. the columns: a segment's tiles are contiguous, so its column pos lands at slot (segment's first
//     tile) * T + pos. Columns leave through this warp's 512-int stretch of the rows area (its references
//     are in registers now): a warp lies inside one member's list, so each kind's columns of the warp
//     fill one contiguous range of slots; staged there in order, they are written with whole-warp
//     (coalesced) stores.
template <int G, bool kFlat, int kH>
__device__ __forceinline__ void write_columns(const PlanParams& p, const PlanCta<G, kFlat, kH>& c, unsigned own,
                                              long long gbase, const Segments& sg,
                                              const FlatRuns<kH>& fr, const unsigned (&fk)[kH],
                                              const unsigned (&mk)[kH][kEpt / 4], unsigned long long lv,
                                              int (&rows)[kEpt], unsigned long long c64) {
  constexpr unsigned kFull = 0xFFFFFFFFu;
  constexpr int kLevels = ilog2_c(G) + 1;
  const int k = c.k, tid = c.tid, M = c.M, T = c.T, lane = tid & 31;
  const int n_lev = sg.n_lev, my_mstart = sg.my_mstart;
  const int first = sg.first, bits = sg.bits;
  const unsigned long long mine = sg.mine;
  const unsigned(&pos0)[kH] = fr.pos0;
  const unsigned(&pos3)[kH] = fr.pos3;
  const unsigned(&cnt0)[kH] = fr.cnt0;
  const unsigned(&cnt3)[kH] = fr.cnt3;
  const Member& me = c.me;
  unsigned* hkeys = c.hkeys;
  int* kv_out = p.tile_kv + gbase * T;
  int* mask_out = p.tile_mask == nullptr ? nullptr : p.tile_mask + gbase * T;
  int* stage = reinterpret_cast<int*>(c.smem) + (tid - lane) * kEpt;
  if constexpr (kFlat) {  // run by run: two kinds, one pass; an entry's member bits are its mask
    const int off0 = __shfl_sync(kFull, first, 0) * T, off3 = __shfl_sync(kFull, first, 1) * T + my_mstart;
    int raw[kEpt];  // every run's slot references, read before the staging below overwrites them
    load_rows(c.my_rows, raw);
#pragma unroll
    for (int h = 0; h < kH; ++h) {
      int rr[kEpt];  // (an entry with a column is valid)
#pragma unroll
      for (int i = 0; i < kEpt; ++i) rr[i] = ref_of<kH>(raw[i], h);
      const int d0 = off0 + static_cast<int>(pos0[h]), d3 = off3 + static_cast<int>(pos3[h]);
      const int w0 = static_cast<int>(__reduce_add_sync(kFull, cnt0[h]));
      const int w3 = static_cast<int>(__reduce_add_sync(kFull, cnt3[h]));
      const int s0 = __shfl_sync(kFull, d0, 0), s3 = __shfl_sync(kFull, d3, 0);
      int* p0 = stage + (d0 - s0);
      int* p3 = stage + w0 + (d3 - s3);
      __syncwarp();  // (the stretch held this warp's rows, or the last run's columns)
#pragma unroll
      for (int i = 0; i < kEpt; ++i) {
        const int v = stage_word(rr[i], (mk[h][i / 4] >> (8 * (i % 4))) & 0xFFu);
        if ((fk[h] >> i) & 1u) *p0++ = v;
        if ((fk[h] >> (16 + i)) & 1u) *p3++ = v;
      }
      __syncwarp();
      const int b3 = s3 - w0;  // staged column x lands at slot x + (x < w0 ? s0 : b3)
      if (mask_out == nullptr) {  // (uniform) the packed words, the default: a loop without the test
        for (int x = lane; x < w0 + w3; x += 32) {
          const int v = stage[x];
          kv_out[static_cast<unsigned>(x + (x < w0 ? s0 : b3))] = packed(staged_row(hkeys, v), v >> 16);
        }
      } else {
        for (int x = lane; x < w0 + w3; x += 32) put_column(kv_out, mask_out, hkeys, x + (x < w0 ? s0 : b3), stage[x]);
      }
    }
  } else {
    load_rows(c.my_rows, rows);  // reloaded, not held in registers across the scan
    int dst[4], fbits[4];        // next slot of this thread's columns and their member bits, per kind
#pragma unroll
    for (int f = 0; f < 4; ++f) {
      int sid = -1, extra = 0;
      if (f < n_lev && f < kLevels) {
        if ((k & ((G >> f) - 1)) == 0) sid = (1 << f) - 1 + (k >> (ilog2_c(G) - f));
      } else if (f == 3 && M > 1) {
        sid = 2 * G / M - 1 + (k >> ilog2(M));
        extra = my_mstart;
      }
      const int off = __shfl_sync(kFull, first, sid < 0 ? 0 : sid), sbits = __shfl_sync(kFull, bits, sid < 0 ? 0 : sid);
      dst[f] = sid < 0 ? 0 : off * T + static_cast<int>(field(mine, f)) + extra;
      fbits[f] = sid < 0 ? 0 : sbits;
    }
    const bool merged3 = M > 1;  // kind 3 is the merged segment (else level 1)
    int wstart[4], wcnt[4], local[4];
    {
      int acc = 0;
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        wcnt[f] = static_cast<int>(__reduce_add_sync(0xFFFFFFFFu, field(c64, f)));
        wstart[f] = __shfl_sync(0xFFFFFFFFu, dst[f], 0);
        local[f] = acc + dst[f] - wstart[f];
        acc += wcnt[f];
      }
    }
    __syncwarp();
    // kind by kind (compile-time kinds: no per-entry selects among the four counters), in entry order
#pragma unroll
    for (int f = 0; f < 4; ++f) {
      if (wcnt[f] == 0) continue;  // (warp-uniform)
      int* sp = stage + local[f];
      const unsigned fb = static_cast<unsigned>(fbits[f]);
#pragma unroll
      for (int i = 0; i < kEpt; ++i) {
        if (get_lvl(lv, i) == static_cast<unsigned>(f)) {
          unsigned b = fb;
          if (f == 3 && merged3) b = me.merge_bits(mask_at(c.tab, rows[i], own)) << me.mshift;
          *sp++ = stage_word(rows[i], b);
        }
      }
    }
    __syncwarp();
    {
      int acc = 0;
#pragma unroll
      for (int f = 0; f < 4; ++f) {
        for (int x = lane; x < wcnt[f]; x += 32) {
          const int v = stage[acc + x];
          put_column(kv_out, mask_out, hkeys, wstart[f] + x, v);
        }
        acc += wcnt[f];
      }
    }
  }
}

// 6b. the rest of the tiles: padding slots of each segment's last tile (a warp a segment), the tiles past
//     the group's last (kv -1, mask 0), and every tile's level and member bits
template <int G, bool kFlat, int kH>
__device__ __forceinline__ void write_tiles(const PlanParams& p, const PlanCta<G, kFlat, kH>& c, long long gbase,
                                            const Segments& sg) {
  constexpr unsigned kFull = 0xFFFFFFFFu;
  const int tid = c.tid, nt = c.nt, T = c.T, lane = tid & 31;
  const int ns = sg.ns, n = sg.n, first = sg.first, incl = sg.incl, n_tiles = sg.n_tiles;
  const int lvl = sg.lvl, bits = sg.bits;
  const int warp = tid >> 5, n_warps = nt >> 5;
  for (int s = warp; s < ns; s += n_warps) {  // (warp-uniform)
    const int sn = __shfl_sync(kFull, n, s), s0 = __shfl_sync(kFull, first, s), s1 = __shfl_sync(kFull, incl, s);
    for (int pp = sn + lane; pp < (s1 - s0) * T; pp += 32) {
      const long long d = (gbase + s0) * T + pp;
      p.tile_kv[d] = -1;
      if (p.tile_mask != nullptr) p.tile_mask[d] = 0;
    }
  }
  // the tiles past the group's last: kv -1, mask 0 (the Plan's contract; the buffers come uninitialized,
  // which saves a fill of the whole worst-case allocation before the launch)
  {
    const long long from = (gbase + n_tiles) * T, nfill = static_cast<long long>(p.cap - n_tiles) * T;
    if (T % 4 == 0) {  // 16-byte aligned: (gbase + tiles) * T ints
      int4* kz = reinterpret_cast<int4*>(p.tile_kv + from);
      int4* mz = p.tile_mask == nullptr ? nullptr : reinterpret_cast<int4*>(p.tile_mask + from);
      for (long long i = tid; i < nfill / 4; i += nt) {
        kz[i] = make_int4(-1, -1, -1, -1);
        if (mz != nullptr) mz[i] = make_int4(0, 0, 0, 0);
      }
    } else {
      for (long long i = tid; i < nfill; i += nt) {
        p.tile_kv[from + i] = -1;
        if (p.tile_mask != nullptr) p.tile_mask[from + i] = 0;
      }
    }
  }
  for (int t0 = warp * 32; t0 < p.cap; t0 += nt) {  // (warp-uniform: the shuffles below run on every lane)
    const int t = t0 + lane;
    int tl = -1, tb = 0;
    for (int s = 0; s < ns; ++s) {
      const int s0 = __shfl_sync(kFull, first, s), s1 = __shfl_sync(kFull, incl, s);
      const int sl = __shfl_sync(kFull, lvl, s), sbt = __shfl_sync(kFull, bits, s);
      if (t >= s0 && t < s1) tl = sl, tb = sbt;
    }
    if (t < p.cap) {
      p.tile_level[gbase + t] = tl;
      p.tile_members[gbase + t] = tb;
    }
  }
}

// kFlat: merge level == G >= 2, no importance clipping, no split (the default plans at 8, 16 and 32 heads).
// There a row is either in every member's list (level G, a column of member 0) or in the merged segment,
// where it is a column of its lowest owner; clipping can only move member 0's own level-G rows into the
// merged segment. So one lookup an entry gives its column kind, and one scan places every column:
// member 0's clipping is decided from the scan's totals and folded into its prefixes afterwards.
// kH (kFlat only): a thread holds kH runs of 16 entries, run h at list position j0 + h * (16 * tpm). With
// kH = 2 a group of 8 takes 512 threads instead of 1024, and the two runs' slot references share the ints of
// the rows area (16 bits each), so the rows area is halved.
template <int G, bool kFlat, int kH = 1>
__global__ void __launch_bounds__(kMaxThreads / kH, 1) plan_kernel(const __grid_constant__ PlanParams p) {
  extern __shared__ __align__(16) unsigned char smem[];
  __shared__ unsigned long long wsum[2 * 32];
  __shared__ int n_valid;
  __shared__ unsigned pushed;  // flag bits of the (level, block)s that pushed rows down

  // shared memory: [entries' slot references, int, 16 a thread (kRowsStride)] [flag keys] [flag words]
  //                [table keys, nslots + 1 rounded to 4] [member bits, a byte a slot + a spare, rounded to 16]
  const int tid = threadIdx.x, nt = blockDim.x, tpm = nt / G;
  int4* my_rows = reinterpret_cast<int4*>(smem) + (kEpt / 4) * (tid - tid % kRowsStride) + tid % kRowsStride;
  unsigned* fkeys = reinterpret_cast<unsigned*>(smem + kEpt * 4 * nt);
  unsigned* fvals = fkeys + (1 << p.log_flags);
  unsigned* hkeys = fvals + (1 << p.log_flags);
  const int nslot = p.nslots, nkeys = (nslot + 1 + 3) & ~3;
  unsigned char* tab = reinterpret_cast<unsigned char*>(hkeys + nkeys);
  int k = 0;  // tid / tpm, without a division by the runtime tpm
#pragma unroll
  for (int j = 1; j < G; ++j) k += tid >= j * tpm;
  const int j0 = (tid - k * tpm) * kEpt;
  const int g = blockIdx.x, q = g * G + k;
  const int M = kFlat ? G : p.merge, T = p.tile;
  const Member me(k, M);
  const Blocks<G> blocks(k);
  const PlanCta<G, kFlat, kH> c{smem, tid, nt, tpm, my_rows, fkeys, fvals, hkeys, nslot,
                                nkeys, tab, k, j0, g, q, M, T, me, blocks};

  int ent[kH][kEpt];
  load_entries(p, c, ent, n_valid, pushed);
  unsigned long long lv = 0ull;     // 16 cascade levels of 4 bits (0: invalid / dropped, 15: in no tile)
  unsigned fk[kH] = {};             // kFlat: each run's column kinds (flat_column_kinds)
  unsigned mk[kH][kEpt / 4] = {};   // kFlat: the entries' member masks, a byte each
  const unsigned own = 1u << k;
  membership(p, c, ent, n_valid);
  if constexpr (kFlat) {
    flat_column_kinds(c, own, fk, mk);
  } else {
    cascade_levels(c, own, ent, lv);
  }
  int scans = 0;  // member scans so far: their wsum half
  if constexpr (!kFlat) scans = clip_tiles(p, c, wsum, pushed, lv, scans);
  int rows[kEpt];  // (non-flat) the entries' slot references again, from the rows area
  if constexpr (!kFlat) load_rows(my_rows, rows);
  if (!kFlat && (p.iclip || p.split)) private_rows(p, c, own, wsum, rows, lv, scans);
  const unsigned long long c64 = column_counts(c, own, rows, fk, lv);
  FlatRuns<kH> fr;
  const Segments sg = segments(p, c, wsum, n_valid, c64, scans, fr, fk);
  const long long gbase = static_cast<long long>(g) * p.cap;
  write_columns(p, c, own, gbase, sg, fr, fk, mk, lv, rows, c64);
  write_tiles(p, c, gbase, sg);
  if (!p.iclip && j0 == 0 && q < p.s_q) p.dropped[q] = 0;  // (nothing dropped; the buffer comes unset)
}

template <int G>
int launch(const PlanParams& p, int threads, int smem, cudaStream_t stream) {
  const bool flat = G >= 2 && p.merge == G && !p.iclip && !p.split;
  auto kernel = flat ? plan_kernel<G, G >= 2> : plan_kernel<G, false>;
  if constexpr (G == 8) {
    // a 1024-thread group: two runs a thread, 512 threads, no rows area (members stay whole warps)
    if (flat && (threads / G) % 64 == 0) {
      kernel = plan_kernel<8, true, 2>;
      smem -= kEpt * 4 * (threads / 2);
      threads /= 2;
    }
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return static_cast<int>(err);
  kernel<<<p.n_groups, threads, smem, stream>>>(p);
  return static_cast<int>(cudaGetLastError());
}

// The attention kernel's launch order of a plan's programs: ids by descending tile count, equal counts by id
// (torch.argsort(descending=True, stable=True) of the counts), so that long programs start first. One CTA, a
// counting sort by bin (max_tiles - count): warp w takes the w-th of 32 contiguous id ranges and counts its
// ids by bin in its own row of a [32, bins] table; the rows are turned into each (range, bin)'s first place
// (the bin's start plus the ranges before it); then every warp places its range's ids 32 at a time in id order,
// ids of one bin among the 32 in lane order (__match_any_sync). So the sort is stable.
constexpr int kOrderWarps = 32;
constexpr int kOrderMaxBins = 1536;  // the table: 32 x 1536 ints, 192 KB

__global__ void __launch_bounds__(32 * kOrderWarps, 1) order_kernel(const int* ntiles, int n, int max_tiles,
                                                                   int* order) {
  extern __shared__ __align__(16) int cnt[];  // [kOrderWarps][nb]: counts by range and bin, then first places
  __shared__ int wtot[kOrderWarps];           // the block scan's warp totals
  quilt_ptx::grid_dependency_wait();  // (a chained launch: the counts are the planner's output)
  quilt_ptx::launch_dependents();     // the attention's CTAs take the SMs this one leaves free
  const int nb = max_tiles + 1, tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
  const int per = (n + kOrderWarps - 1) / kOrderWarps, lo = min(n, w * per), hi = min(n, lo + per);
  int* row = cnt + w * nb;
  auto bin_of = [&](int i) { return max_tiles - min(max(ntiles[i], 0), max_tiles); };
  for (int b = lane; b < nb; b += 32) row[b] = 0;
  __syncwarp();
  for (int i = lo + lane; i < hi; i += 32) atomicAdd(row + bin_of(i), 1);
  __syncthreads();
  // each bin's first place: the bins before it (a block scan of the bins' totals), then the ranges before
  // this one; thread t holds the bins t * k .. t * k + k - 1 (k = ceil(nb / 1024), at most 2)
  constexpr int kMaxPer = (kOrderMaxBins + 32 * kOrderWarps - 1) / (32 * kOrderWarps);
  const int k = (nb + 32 * kOrderWarps - 1) / (32 * kOrderWarps), b0 = tid * k;
  int tot[kMaxPer], mine = 0;
#pragma unroll
  for (int j = 0; j < kMaxPer; ++j) {
    tot[j] = 0;
    if (j < k && b0 + j < nb) {
      for (int r = 0; r < kOrderWarps; ++r) tot[j] += cnt[r * nb + b0 + j];
    }
    mine += tot[j];
  }
  int x = mine;  // inclusive scan over the block
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const int y = __shfl_up_sync(0xFFFFFFFFu, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) wtot[w] = x;
  __syncthreads();
  int before = 0;
  for (int r = 0; r < w; ++r) before += wtot[r];
  int start = before + x - mine;  // the first place of bin b0
#pragma unroll
  for (int j = 0; j < kMaxPer; ++j) {
    if (j < k && b0 + j < nb) {
      int at = start;
      for (int r = 0; r < kOrderWarps; ++r) {
        const int c = cnt[r * nb + b0 + j];
        cnt[r * nb + b0 + j] = at;
        at += c;
      }
      start += tot[j];
    }
  }
  __syncthreads();
  for (int i0 = lo; i0 < hi; i0 += 32) {
    const int i = i0 + lane;
    const int b = i < hi ? bin_of(i) : nb;  // (nb: no id)
    const unsigned peers = __match_any_sync(0xFFFFFFFFu, b);
    const int leader = __ffs(peers) - 1, rank = __popc(peers & ((1u << lane) - 1u));
    int base = 0;
    if (lane == leader && b < nb) {
      base = row[b];
      row[b] = base + __popc(peers);
    }
    base = __shfl_sync(0xFFFFFFFFu, base, leader);
    if (b < nb) order[base + rank] = i;
    __syncwarp();
  }
}

// PlanParams' fields in order and their byte offsets (quilt_plan_params_layout)
#define QUILT_OFFSET_OF(f) QUILT_ABI_FIELD_OFFSET(PlanParams, f)
constexpr char kPlanParamsFields[] = QUILT_PLAN_PARAMS_FIELDS(QUILT_ABI_FIELD_NAME);
constexpr int kPlanParamsOffsets[] = {QUILT_PLAN_PARAMS_FIELDS(QUILT_OFFSET_OF)};
#undef QUILT_OFFSET_OF
static_assert(quilt_abi::rising(kPlanParamsOffsets, sizeof(kPlanParamsOffsets) / sizeof(int)),
              "QUILT_PLAN_PARAMS_FIELDS: declaration order");

}  // namespace quilt_plan

extern "C" {

// threads = group_size * topk padded / 16 (a multiple of 32, <= 1024);
// smem = 64 bytes a thread (its 16 slot references, later its columns) + the pushed-row set (8 bytes a slot)
// + the membership table (nslots + 1 keys rounded to 4, then a byte a slot and a spare byte, rounded to 16):
// cuda_backend.plan_launch_shape
int quilt_plan_launch(const quilt_plan::PlanParams* p, int group_size, int threads, int smem, void* stream) {
  using namespace quilt_plan;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (threads < 32 || threads > kMaxThreads || threads % 32 || threads % group_size) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  switch (group_size) {
    case 1: return launch<1>(*p, threads, smem, s);
    case 2: return launch<2>(*p, threads, smem, s);
    case 4: return launch<4>(*p, threads, smem, s);
    case 8: return launch<8>(*p, threads, smem, s);
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
}

// order [n] of the ids 0..n-1 by descending ntiles [n] (each in 0..max_tiles), equal counts by id; no host sync;
// chained: a programmatic dependent launch (launch.cuh)
int quilt_program_order_launch(const int* ntiles, int n, int max_tiles, int* order, int chained, void* stream) {
  using namespace quilt_plan;
  if (n < 0 || max_tiles < 0 || max_tiles + 1 > kOrderMaxBins) return static_cast<int>(cudaErrorInvalidValue);
  if (n == 0) return 0;
  const int smem = 4 * kOrderWarps * (max_tiles + 1);
  cudaError_t err = cudaFuncSetAttribute(order_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return static_cast<int>(err);
  err = quilt_launch::launch(order_kernel, 1, 32 * kOrderWarps, smem, static_cast<cudaStream_t>(stream), chained != 0,
                             ntiles, n, max_tiles, order);
  return static_cast<int>(err != cudaSuccess ? err : cudaGetLastError());
}

int quilt_plan_params_size() { return static_cast<int>(sizeof(quilt_plan::PlanParams)); }
// PlanParams' layout (the ABI test checks Python's ctypes mirror against it), as quilt_sm90_params_layout
int quilt_plan_params_layout(const char** names, int* offsets, int cap) {
  return quilt_abi::copy_layout(quilt_plan::kPlanParamsFields, quilt_plan::kPlanParamsOffsets, names, offsets, cap);
}

}  // extern "C"
