// Inline-PTX wrappers (sm_90a): shared-memory addresses and the 128-byte swizzle, cp.async, mbarriers, proxy
// fences, wgmma fence / commit / wait and shared-memory descriptors. The wgmma instructions themselves, with
// their long operand lists, are generated: wgmma_ops.cuh. (Of these the planner, quilt_plan.cu, needs only the
// programmatic-dependent-launch pair, for its order kernel: it synchronizes with atomics, shuffles and
// __syncthreads.)
#pragma once
#include <cuda_runtime.h>
#include <stdint.h>

namespace quilt_ptx {

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// byte offset of 16-byte unit `unit` (0..7) of row `row` in a 128-byte-swizzled chunk
__device__ __forceinline__ uint32_t swz(int row, int unit) {
  return row * 128 + ((unit ^ (row & 7)) << 4);
}

// ------------------------------------------------------------------------------ async copies, fences
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void st_shared_v4(uint32_t dst, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(dst), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
// generic-proxy writes (cp.async, st.shared) -> visible to wgmma's async-proxy reads
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
template <int N>
__device__ __forceinline__ void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// wgmma shared-memory descriptor, 128-byte swizzle. K-major operands: SBO = 1024 (8 rows of 128 B),
// LBO unused. N-major B (V): LBO = distance between 64-column chunks, SBO = 8 kv rows.
__device__ __forceinline__ uint64_t desc_sw128(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32) | (1ull << 62);
}

// the descriptor of the operand `bytes` further on: the start-address field (bits 0-13, address / 16) takes the
// offset without a carry, since every shared-memory address here is below 2^18. One 32-bit add where building
// each k-step's descriptor from its address cost ~10 uniform-datapath instructions (ncu: 14% of the kernel's).
__device__ __forceinline__ uint64_t desc_at(uint64_t d, uint32_t bytes) {
  uint64_t r;
  asm("mov.b64 %0, {%1, %2};\n" : "=l"(r) : "r"(static_cast<uint32_t>(d) + (bytes >> 4)), "r"(static_cast<uint32_t>(d >> 32)));
  return r;
}

// ------------------------------------------------------------------------------ programmatic dependent launch
// Waits until the grid ahead of this one in the stream has completed and its writes are visible: a no-op for
// a grid not launched as a programmatic dependent. Every read of another kernel's output comes after it.
__device__ __forceinline__ void grid_dependency_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
// Lets the next grid in the stream be scheduled (onto SMs as this grid's CTAs leave them) once every CTA of
// this one has passed here; that grid still waits for this one's completion before it reads anything.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

// ------------------------------------------------------------------------------ mbarriers
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
// makes the initialized barriers visible to the other threads (and the async proxy)
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
// one more arrival, made when this thread's cp.async copies issued so far have landed
__device__ __forceinline__ void mbar_arrive_copies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, int parity) {
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// waits on data cp.async filled; its writes then feed wgmma (async proxy)
__device__ __forceinline__ void wait_ready(uint32_t bar, int parity) {
  mbar_wait(bar, parity);
  fence_async_smem();
}

}  // namespace quilt_ptx
