// The sm_90a attention kernel's shape: tile constants, the shared-memory plan (a typed layout whose
// offsets the code uses), named barriers, the parameter block and the mbarrier slots.
#pragma once
#include <stddef.h>
#include <stdint.h>

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
constexpr int kSmemLimit = 232448;              // shared memory of an H100/H200 CTA

// Shared memory, in order; the kernel addresses it by the byte offsets below (a plain struct of naturally
// aligned members: no padding, so each offset is the sum of the members' sizes before it). The 64-column
// chunks are 128-byte-swizzled, as wgmma's descriptors expect.
struct SharedStorage {
  uint8_t q[kTileBytes];          // Q: the program's 64 rows, 9 chunks
  uint8_t kv[2][kTileBytes];      // kv buffers 0, 1 (P0 reuses buffer 0's rope chunk once QK is done)
  uint8_t p1[kChunkBytes];        // P1: warpgroup 1's probabilities, for warpgroup 0's P1 V1
  uint32_t mask[2][kTile];        // member bits of each buffer's slots
  float max[kRows];               // the running max handed between warpgroups
  float sum[2][2][kRows];         // row sums [program parity][warpgroup]
  float tmax[2][kRows];           // warpgroup 1's true row max [program parity]
  uint64_t bar[10];               // mbarriers: ready[2][2], free[2][2] ([buffer][half]), q ready, q free (Bars)
  int work[2][2];                 // work items: the producer's [k & 1], the consumers' [k & 1]
};

constexpr int kSmemQ = offsetof(SharedStorage, q);
constexpr int kSmemKV = offsetof(SharedStorage, kv);
constexpr int kSmemP0 = kSmemKV + (kChunks - 1) * kChunkBytes;  // buffer 0's rope chunk
constexpr int kSmemP1 = offsetof(SharedStorage, p1);
constexpr int kSmemMask = offsetof(SharedStorage, mask);
constexpr int kSmemMax = offsetof(SharedStorage, max);
constexpr int kSmemSum = offsetof(SharedStorage, sum);
constexpr int kSmemTmax = offsetof(SharedStorage, tmax);
constexpr int kSmemBar = offsetof(SharedStorage, bar);
constexpr int kSmemWork = offsetof(SharedStorage, work);
constexpr int kSmemBytes = sizeof(SharedStorage);

// the layout the kernel was written against, member by member
static_assert(kSmemQ == 0 && kSmemKV == kSmemQ + kTileBytes && kSmemP0 == kSmemKV + 8 * kChunkBytes &&
              kSmemP1 == kSmemKV + 2 * kTileBytes && kSmemMask == kSmemP1 + kChunkBytes &&
              kSmemMax == kSmemMask + 2 * kTile * 4 && kSmemSum == kSmemMax + kRows * 4 &&
              kSmemTmax == kSmemSum + 4 * kRows * 4 && kSmemBar == kSmemTmax + 2 * kRows * 4 &&
              kSmemWork == kSmemBar + 10 * 8 && kSmemBytes == kSmemWork + 4 * 4,
              "shared-memory offsets");
static_assert(kSmemBytes == 231776, "shared-memory total");
static_assert(kSmemQ % 1024 == 0 && kSmemKV % 1024 == 0 && kSmemP0 % 1024 == 0 && kSmemP1 % 1024 == 0,
              "swizzled chunks start on 1024-byte boundaries (the 128-byte swizzle's period)");
static_assert(kSmemBar % 8 == 0, "mbarriers are 8-byte aligned");
static_assert(kSmemBytes <= kSmemLimit, "shared memory budget of an H100/H200 CTA");
static_assert(kRows * kUnitsPerRow % 256 == 0, "q copies must divide evenly over the consumers");

// named barriers between the two consumer warpgroups (0 is __syncthreads; the producer's own is kBarProducer)
enum : int { kBarMax0 = 1, kBarMax1 = 2, kBarP0 = 3, kBarP1 = 4, kBarSum = 5, kBarProducer = 9 };

struct Params {
  const void* q;            // [s_q, h, 576] (strides stride_qs, stride_qh; unit stride last)
  const void* kv;           // [s_kv, 576] (stride stride_kv)
  void* out;                // [s_q, h, 512] of q's dtype, or float32 in partial mode
  float* max_logits;        // [s_q, h] base-2 logits
  float* lse;               // [s_q, h] base 2
  const float* sink;        // [h] natural-log units, or null
  const int* tile_kv;       // plan: [n_tiles_total, 64] kv rows, or packed words row | member bits << 24
  const int* tile_mask;     // plan: [n_tiles_total, 64] member bits; null: tile_kv is packed
  const int* prog_tiles;    // plan: [n_progs, prog_cap] tile ids, or null: one program a group (tile pid * prog_cap + i)
  const int* prog_ntiles;   // plan: [n_progs]
  const int* prog_order;    // plan: [n_progs] launch order (CTA x runs program prog_order[x]), or null
  const int* indices;       // query-parallel: [s_q, topk] (stride stride_idx)
  const int* topk_length;   // query-parallel: [s_q] or null
  long long stride_qs, stride_qh, stride_kv, stride_idx, stride_os, stride_oh;
  int s_q, s_kv, h, topk, prog_cap;
  int group_size, qp, hb;   // plan group size, queries a program, heads a program (qp * hb <= 64)
  int from_plan;
  int n_work, nhb;          // programs x head blocks (work item w: program w / nhb, head block w % nhb)
  int* work_counter;        // work items handed out after each CTA's first (zeroed by the launch, or before it:
                            //   kLaunchCounterZeroed)
  float scale2;             // sm_scale * log2(e)
  int skip;                 // measurement only (sm90_measure.cuh, kSkip*): results invalid
  const int* run_flag;      // or null: the launch does nothing unless *run_flag == run_when (one of two
  int run_when;             //   launches chosen on the device, no host sync: ops/fp8_compact.py)
  int* repair;              // or null: the repair queue (count | a flag a query | queued queries), into which a
                            //   final-output pass queues each query whose output holds a NaN (run_plan_passes)
  const float* q_scale;     // FP8 mode only: [s_q, h] q's power-of-two scales (q is then quilt_fp8_quantize_q's
                            //   rows: 512 e4m3 latent bytes, 64 bf16 rope values divided by the scale)
  const int* queue;         // or null: the repair pass, query programs over indices for the queries a repair
                            //   queue holds (its count read here, on the device), program i its i-th query
  int launch_flags;         // kLaunch* below: how the launch is made (the kernel itself reads none of them)
};

// launch_flags. kLaunchChained: a programmatic dependent launch (PDL): the grid may be scheduled while the
// kernel ahead of it in the stream still runs, and waits for it (griddepcontrol.wait) before its first read.
// kLaunchCounterZeroed: work_counter comes zeroed (one fill of the call's control words), no memset of its own,
// which would stand between this launch and the one before it and so end the chain.
enum : int { kLaunchChained = 1, kLaunchCounterZeroed = 2 };

// Params' fields in order, for the library's layout table (quilt_sm90_params_layout): Python's ctypes
// mirror is tested against it field by field.
#define QUILT_SM90_PARAMS_FIELDS(X)                                                                          \
  X(q) X(kv) X(out) X(max_logits) X(lse) X(sink) X(tile_kv) X(tile_mask) X(prog_tiles) X(prog_ntiles)          \
  X(prog_order) X(indices) X(topk_length) X(stride_qs) X(stride_qh) X(stride_kv) X(stride_idx) X(stride_os)     \
  X(stride_oh) X(s_q) X(s_kv) X(h) X(topk) X(prog_cap) X(group_size) X(qp) X(hb) X(from_plan) X(n_work) X(nhb) \
  X(work_counter) X(scale2) X(skip) X(run_flag) X(run_when) X(repair) X(q_scale) X(queue) X(launch_flags)

// The mbarriers (SharedStorage::bar) by role.
struct Bars {
  uint32_t base;
  __device__ uint32_t ready(int buf, int half) const { return base + (buf * 2 + half) * 8; }
  __device__ uint32_t free(int buf, int half) const { return base + 32 + (buf * 2 + half) * 8; }
  __device__ uint32_t q_ready() const { return base + 64; }  // q rows of the CTA's current program landed
  __device__ uint32_t q_free() const { return base + 72; }   // the previous program's QKs are done with q
};

}  // namespace quilt_sm90
