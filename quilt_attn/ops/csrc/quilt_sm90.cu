// QUILT sparse-attention prefill on Hopper (sm_90a): wgmma tiles over gathered kv rows.
//
// A CTA owns 64 matrix rows (QP neighbouring queries x HB heads, padded to 64) and streams tiles
// of 64 gathered kv rows (d_qk 576 = 512 latent + 64 rope; the values are the first 512 columns).
// Tiles come either from a QUILT plan's per-program work list (each tile column carries the member
// bits of the queries that own its row) or, query-parallel, from one query's own Top-K list.
//
// Warp-specialized, 384 threads; tiles go in pairs (a "block"): tile 2b to buffer 0, 2b+1 to buffer 1.
//   consumer warpgroup 0: S = Q K0^T (m64n64k16), softmax against the running max, then
//                         O[:, 0:256]   += P0 V0 (P0 from registers) + P1 V1 (P1 from shared memory)
//   consumer warpgroup 1: S = Q K1^T, softmax against warpgroup 0's new max, then
//                         O[:, 256:512] += P1 V1 (registers) + P0 V0 (shared memory)
// The two QK products run at the same time; the row max is handed 0 -> 1 -> 0 through shared
// memory (warpgroup 0 stores P0 at its own max, and again, rescaled, only where warpgroup 1 moved it). The
// "max" is a lazy reference: it moves only when a tile exceeds it by more than 2^8, so O and l are rarely
// rescaled (next_max; the true max is tracked apart for max_logits). A producer
// warpgroup gathers rows with 16-byte cp.async (zero-filled for invalid rows) in quarter tiles:
// each buffer's value half 0 (chunks 0-3) and half 1 (chunks 4-8) has its own ready / free
// mbarrier, so a half is refilled as soon as its last reader is done; its slot loads run a block
// ahead. The output goes from registers to global memory, 16 bytes a thread. (v2 split each
// tile's columns between the warpgroups and ran QK, softmax and PV one after another: 11.7 ms at 64
// heads query-parallel; this schedule: 8.3 ms. docs/learned.md.)
//
// Persistent: a CTA an SM, each taking work items (a program x a head block; plan programs longest
// first, a query's head blocks next to each other) from a global counter as it finishes the last; query
// programs over more than 64 heads go round-robin instead (CTA x: items x, x + ctas, ...), which keeps a
// query's head blocks on neighbouring CTAs in step, so that the second's gathers meet the first's rows in
// L2 (ncu at h=128: L2 throughput 51% against FlashMLA's 34%, whose launch order pairs them the same way;
// measured -1.4% glm53-like, -4.3% random, docs/learned.md). The
// producer moves on to the next program as soon as it has issued the current one's copies: the next
// program's first kv block is gathered while the consumers finish this one, and its q (with the work
// item, through q_ready) once both consumer warpgroups' last QK of the program has completed (q_free):
// the next q then lands under the last PVs and the epilogue.
//
// Shared memory, 128-byte-swizzled 64-column chunks (the layout wgmma's descriptors expect):
//   Q 72 KB | kv buffer 0, 1: 72 KB each (P0 reuses buffer 0's
//   rope chunk once QK is done) | P1 8 KB | member bits, row max, row sums, mbarriers, work items
// (SharedStorage in sm90_config.cuh).
//
// Sources by role: ptx.cuh (PTX wrappers: cp.async, mbarriers, fences, wgmma sync, descriptors),
// wgmma_ops.cuh (generated wgmma wrappers), sm90_config.cuh (constants, shared-memory layout, Params,
// barriers), sm90_program.cuh (work items -> programs and rows), sm90_producer.cuh, sm90_consumer.cuh,
// sm90_measure.cuh (measurement switches), abi.cuh (parameter-block layout tables); this file: the kernel
// entry, its launch and the library's C interface. No torch dependency: it builds into a plain shared
// library driven through ctypes (quilt_attn/ops/cuda_backend.py), and compiles alone with nvcc for a
// build check.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "abi.cuh"
#include "launch.cuh"
#include "ptx.cuh"
#include "sm90_config.cuh"
#include "sm90_consumer.cuh"
#include "sm90_fp8mma.cuh"
#include "sm90_measure.cuh"
#include "sm90_producer.cuh"

// Measurement hooks, for a study that runs another consumer of the same producer (benchmarks/owner_exact/
// swapped_sm90.cu defines both before including this file): the consumers' loop and the shared memory a CTA
// takes. The library's own build defines neither.
#ifndef QUILT_CONSUMERS
#define QUILT_CONSUMERS consume_programs
#endif
#ifndef QUILT_SMEM_BYTES
#define QUILT_SMEM_BYTES kSmemBytes
#endif

namespace quilt_sm90 {
using namespace quilt_ptx;

template <typename T, typename OutT, bool kMma, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1) quilt_sm90_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(1024) uint8_t smem[];
  grid_dependency_wait();  // (a chained launch: the plan, its order, run_flag and the queue are earlier kernels' outputs)
  launch_dependents();     // the next launch (the repair pass) takes each SM this grid's CTA leaves
  if (p.run_flag != nullptr && __ldg(p.run_flag) != p.run_when) return;  // the other launch of a pair runs
  const int tid = threadIdx.x;
  // warpgroup index, visibly warp-uniform: ptxas serializes wgmma issued under a branch it cannot prove uniform
  const int wg = __shfl_sync(0xffffffff, tid / 128, 0);
  const Bars bars{smem_u32(smem + kSmemBar)};
  if (tid == 0) {
    for (int i = 0; i < 4; ++i) {
      mbar_init(bars.ready(i / 2, i % 2), 256);
      // buffer 0's half 1 also holds P0: warpgroup 0 (P0 written) and 1 (P0 V0 done) both release it
      mbar_init(bars.free(i / 2, i % 2), i == 1 ? 256 : 128);
    }
    mbar_init(bars.q_ready(), 129);  // the copies of 128 producer threads, the work item
    mbar_init(bars.q_free(), 256);
    mbar_init_fence();
  }
  __syncthreads();

  if (wg == 2) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 72;\n");
    produce<T, kFp8>(p, smem, bars);
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 216;\n");
  // persistent: the producer hands over each program's work item with its q (a loop a warpgroup:
  // with both in one loop body ptxas spilled the accumulators)
  if (wg == 0) {
    QUILT_CONSUMERS<T, OutT, kMma, 0>(p, smem, bars);
  } else {
    QUILT_CONSUMERS<T, OutT, kMma, 1>(p, smem, bars);
  }
}

template <typename T, typename OutT, bool kMma = true, bool kFp8 = false>
int launch(const Params& p, int ctas, cudaStream_t stream) {
  auto kernel = quilt_sm90_kernel<T, OutT, kMma, kFp8>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, QUILT_SMEM_BYTES);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (!(p.launch_flags & kLaunchCounterZeroed)) {
    err = cudaMemsetAsync(p.work_counter, 0, sizeof(int), stream);
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  err = quilt_launch::launch(kernel, ctas, kThreads, QUILT_SMEM_BYTES, stream, (p.launch_flags & kLaunchChained) != 0, p);
  return static_cast<int>(err != cudaSuccess ? err : cudaGetLastError());
}

// Params' fields in order and their byte offsets (quilt_sm90_params_layout)
#define QUILT_OFFSET_OF(f) QUILT_ABI_FIELD_OFFSET(Params, f)
constexpr char kParamsFields[] = QUILT_SM90_PARAMS_FIELDS(QUILT_ABI_FIELD_NAME);
constexpr int kParamsOffsets[] = {QUILT_SM90_PARAMS_FIELDS(QUILT_OFFSET_OF)};
#undef QUILT_OFFSET_OF
static_assert(quilt_abi::rising(kParamsOffsets, sizeof(kParamsOffsets) / sizeof(int)),
              "QUILT_SM90_PARAMS_FIELDS: declaration order");

#define QUILT_TL_NAME(slot, name) #name ","
constexpr char kTimelineSlots[] = QUILT_TIMELINE_SLOTS(QUILT_TL_NAME);
#undef QUILT_TL_NAME

}  // namespace quilt_sm90

extern "C" {

// dtype: 0 bf16, 1 fp16, 2 bf16 q with kv the FP8 cache (uint8 rows of 656 bytes, stride_kv in bytes, widened
// in the kernel); partial: write float32 normalized out (a later pass continues it), no sink;
// ctas: persistent CTAs (one an SM; p->n_work of them run one work item each)
int quilt_sm90_launch(const quilt_sm90::Params* p, int dtype, int partial, int ctas, void* stream) {
  using namespace quilt_sm90;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  if (p->skip & kSkipMma) {  // measurement only: bf16, final output only
    if (dtype != 0 || partial) return static_cast<int>(cudaErrorInvalidValue);
    return launch<__nv_bfloat16, __nv_bfloat16, false>(*p, ctas, s);
  }
  if (dtype == 2) return partial ? launch<__nv_bfloat16, float, true, true>(*p, ctas, s)
                                 : launch<__nv_bfloat16, __nv_bfloat16, true, true>(*p, ctas, s);
  if (dtype == 0) return partial ? launch<__nv_bfloat16, float>(*p, ctas, s)
                                 : launch<__nv_bfloat16, __nv_bfloat16>(*p, ctas, s);
  return partial ? launch<__half, float>(*p, ctas, s) : launch<__half, __half>(*p, ctas, s);
}

// The FP8 tensor-core mode (sm90_fp8mma.cuh): q is quilt_fp8_quantize_q's output (p->q its 640-byte rows,
// stride_qs / stride_qh in bytes, p->q_scale its scales), kv the FP8 cache; bf16 out, no partial mode
int quilt_sm90_fp8mma_launch(const quilt_sm90::Params* p, int ctas, void* stream) {
  using namespace quilt_sm90;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  cudaError_t err = cudaFuncSetAttribute(f8::kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, f8::kSmemBytes);
  if (err != cudaSuccess) return static_cast<int>(err);
  err = cudaMemsetAsync(p->work_counter, 0, sizeof(int), s);
  if (err != cudaSuccess) return static_cast<int>(err);
  f8::kernel<<<ctas, kThreads, f8::kSmemBytes, s>>>(*p);
  return static_cast<int>(cudaGetLastError());
}

// q [s_q, h, 576] bf16 (strides in elements, unit last stride, 16-byte aligned rows) -> out uint8 [s_q, h, 640],
// scale float32 [s_q, h] (the FP8 mode's q, sm90_fp8mma.cuh)
int quilt_fp8_quantize_q(const void* q, long long stride_qs, long long stride_qh, int s_q, int h, void* out,
                         float* scale, void* stream) {
  const long long rows = static_cast<long long>(s_q) * h;
  if (rows == 0) return 0;
  constexpr int kWarps = 8;
  const unsigned blocks = static_cast<unsigned>((rows + kWarps - 1) / kWarps);
  quilt_sm90::f8::quantize_q<<<blocks, kWarps * 32, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const __nv_bfloat16*>(q), stride_qs, stride_qh, s_q, h, static_cast<uint8_t*>(out), scale);
  return static_cast<int>(cudaGetLastError());
}
int quilt_sm90_fp8mma_smem_bytes() { return quilt_sm90::f8::kSmemBytes; }

#ifdef QUILT_TIMELINE
// copies the stamps to host memory `dst` (kTlCtas * kTlProgs * kTlSlots uint64)
int quilt_sm90_timeline(unsigned long long* dst) {
  return static_cast<int>(cudaMemcpyFromSymbol(dst, quilt_sm90::g_timeline, sizeof(quilt_sm90::g_timeline)));
}
int quilt_sm90_timeline_reset() {
  void* ptr = nullptr;
  cudaError_t err = cudaGetSymbolAddress(&ptr, quilt_sm90::g_timeline);
  if (err != cudaSuccess) return static_cast<int>(err);
  return static_cast<int>(cudaMemset(ptr, 0, sizeof(quilt_sm90::g_timeline)));
}
int quilt_sm90_timeline_shape(int* dims) {
  dims[0] = quilt_sm90::kTlCtas, dims[1] = quilt_sm90::kTlProgs, dims[2] = quilt_sm90::kTlSlots;
  return 0;
}
#endif
// the timeline slots' names in slot order, comma-separated (benchmarks/boundary_timeline.py reads them)
const char* quilt_sm90_timeline_slots() { return quilt_sm90::kTimelineSlots; }
int quilt_sm90_params_size() { return static_cast<int>(sizeof(quilt_sm90::Params)); }
// Params' layout (the ABI test checks Python's ctypes mirror against it): *names = its fields in order,
// comma-separated; offsets[i] = field i's byte offset (up to cap of them); returns the field count
int quilt_sm90_params_layout(const char** names, int* offsets, int cap) {
  return quilt_abi::copy_layout(quilt_sm90::kParamsFields, quilt_sm90::kParamsOffsets, names, offsets, cap);
}
int quilt_sm90_smem_bytes() { return quilt_sm90::kSmemBytes; }
const char* quilt_sm90_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // extern "C"
