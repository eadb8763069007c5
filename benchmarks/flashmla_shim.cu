// A C entry point over FlashMLA's sm90 sparse prefill (its current release: `SparseAttnFwdParams` and
// `sm90::fwd::run_fwd_phase1_kernel<576, HAVE_TOPK_LENGTH>`), so that the benchmarks can time it through
// ctypes beside this package's kernels on the same inputs. Built against a FlashMLA source tree and CUTLASS
// headers the user provides (see benchmarks/flashmla.py); nothing of FlashMLA is part of this repository.
#include "params.h"
#include "sm90/prefill/sparse/phase1.h"

extern "C" int flashmla_sparse_prefill(void* q, void* kv, int* indices, void* out, float* max_logits, float* lse,
                                       float* attn_sink, int* topk_length, int s_q, int s_kv, int h, int topk,
                                       long long stride_q_s, long long stride_q_h, long long stride_kv,
                                       long long stride_idx, float sm_scale, int num_sm, void* stream) {
  SparseAttnFwdParams p{};
  p.s_q = s_q;
  p.s_kv = s_kv;
  p.h_q = h;
  p.h_kv = 1;
  p.d_qk = 576;
  p.d_v = 512;
  p.topk = topk;
  p.sm_scale = sm_scale;
  p.sm_scale_div_log2 = sm_scale * 1.4426950408889634f;
  p.q = static_cast<cutlass::bfloat16_t*>(q);
  p.kv = static_cast<cutlass::bfloat16_t*>(kv);
  p.indices = indices;
  p.attn_sink = attn_sink;
  p.topk_length = topk_length;
  p.stride_q_s_q = static_cast<int>(stride_q_s);
  p.stride_q_h_q = static_cast<int>(stride_q_h);
  p.stride_kv_s_kv = static_cast<int>(stride_kv);
  p.stride_kv_h_kv = static_cast<int>(stride_kv);
  p.stride_indices_s_q = static_cast<int>(stride_idx);
  p.stride_indices_h_kv = static_cast<int>(stride_idx);
  p.out = static_cast<cutlass::bfloat16_t*>(out);
  p.max_logits = max_logits;
  p.lse = lse;
  p.num_sm = num_sm;
  p.stream = static_cast<cudaStream_t>(stream);
  if (topk_length != nullptr) {
    sm90::fwd::run_fwd_phase1_kernel<576, true>(p);
  } else {
    sm90::fwd::run_fwd_phase1_kernel<576, false>(p);
  }
  return static_cast<int>(cudaGetLastError());
}
