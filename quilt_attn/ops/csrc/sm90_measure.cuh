// Measurement switches of the sm_90a kernel: what the shipping build leaves out or never uses.
//
// QUILT_TIMELINE (a measurement build, benchmarks/boundary_timeline.py): clock64 stamps of one thread a
// role at fixed points of each program, [CTA][program k][slot], read back with quilt_sm90_timeline(). The
// slots are named here once; the library exports their names in slot order (quilt_sm90_timeline_slots),
// which the script reads. Without QUILT_TIMELINE the stamps compile to nothing.
//
// QUILT_NO_NAN_QUEUE (a measurement build, benchmarks/repair_cost.py): the epilogue leaves out its NaN test, so
// no query is ever queued for the repair pass; the A/B of what the test costs.
//
// Params::skip (kSkip* bits) and the kernel's kMma template switch are runtime / template switches of
// every build, not behind QUILT_TIMELINE: the field is part of the parameter block Python sends, and the
// no-product kernel (kMma = false) is an instantiation of the shipping library.
#pragma once
#include "sm90_config.cuh"

namespace quilt_sm90 {

// Params::skip (measurement only, results invalid): stages a launch leaves out
enum : int {
  kSkipGather = 1,  // no kv gather: the producer signals its halves ready without copying
  kSkipMma = 2,     // no matrix products: the kMma = false kernel (bf16, final output only)
};

// (slot, its name in boundary_timeline.py): what the stamping thread has just done
#define QUILT_TIMELINE_SLOTS(X)                                                                          \
  X(kTlWg0Done, wg0_done)         /* warpgroup 0 (thread 0): its program's last block done            */ \
  X(kTlOutWritten, out_written)   /* thread 0: its output rows written (the epilogue's end)           */ \
  X(kTlQReady, q_ready)           /* thread 0: past q_ready (q and the work item landed)              */ \
  X(kTlWg0FirstQk, wg0_first_qk)  /* thread 0: the program's first S = Q K0^T done                   */ \
  X(kTlQFreeSeen, q_free_seen)    /* producer (thread 256): past its q_free wait                      */ \
  X(kTlQIssued, q_issued)         /* producer: the program's q copies issued                          */ \
  X(kTlWg1FirstQk, wg1_first_qk)  /* warpgroup 1 (thread 128): its first S = Q K1^T done             */ \
  X(kTlBlocks, n_blocks)          /* a value, not a time: the program's kv blocks                     */ \
  X(kTlSumsDone, sums_done)       /* thread 0: both warpgroups' row sums exchanged                     */ \
  X(kTlWg1Done, wg1_done)         /* warpgroup 1 (thread 128): its program's last block done          */

enum TimelineSlot : int {
#define QUILT_TL_ENUM(slot, name) slot,
  QUILT_TIMELINE_SLOTS(QUILT_TL_ENUM)
#undef QUILT_TL_ENUM
  kTlSlots
};

#ifdef QUILT_TIMELINE
constexpr int kTlCtas = 132, kTlProgs = 512;
__device__ unsigned long long g_timeline[kTlCtas * kTlProgs * kTlSlots];
__device__ __forceinline__ void stamp(int k, int slot, unsigned long long v) {
  if (blockIdx.x < kTlCtas && k < kTlProgs) g_timeline[(blockIdx.x * kTlProgs + k) * kTlSlots + slot] = v;
}
#define QUILT_STAMP(k, slot) stamp((k), (slot), clock64())
#define QUILT_STAMP_VALUE(k, slot, v) stamp((k), (slot), static_cast<unsigned long long>(v))
#else
#define QUILT_STAMP(k, slot)
#define QUILT_STAMP_VALUE(k, slot, v)
#endif

}  // namespace quilt_sm90
