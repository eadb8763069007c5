// Work items of the persistent sm_90a kernel: which program (queries, tiles) and head block a CTA runs,
// and which query and head each of its 64 matrix rows is. Used by the producer and the consumers alike.
#pragma once
#include "sm90_config.cuh"

namespace quilt_sm90 {

struct Program {
  int pid, q0, sub, n_tiles, n_valid;
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
    pr.q0 = p.queue != nullptr ? p.queue[1 + p.s_q + pr.pid] : pr.pid;  // (a repair pass: the queued queries)
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

// Queue query qq for the repair pass, once whatever the threads and programs that ask: repair = the count, a
// flag a query, the queued queries (sparse_attention.repair_buffer).
__device__ __forceinline__ void queue_for_repair(int* repair, int s_q, int qq) {
  if (atomicExch(repair + 1 + qq, 1) == 0) repair[1 + s_q + atomicAdd(repair, 1)] = qq;
}

}  // namespace quilt_sm90
