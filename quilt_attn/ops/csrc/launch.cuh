// Host side: one kernel launch, chained or not. A chained launch is a programmatic dependent launch (PDL): the
// grid may be scheduled while the kernel ahead of it in the stream still runs, onto SMs as that kernel's CTAs
// leave them, so its launch latency and set-up overlap that kernel's tail. Correct only for kernels that call
// quilt_ptx::grid_dependency_wait() before their first read of another kernel's output: the attention kernel
// and the order kernel, the two launched chained, do so first thing (the wait is a no-op when a launch is not
// chained); the planner, the FP8 mode's kernel and q's quantization are never launched chained.
#pragma once
#include <cuda_runtime.h>

namespace quilt_launch {

template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), unsigned grid, unsigned block, size_t smem, cudaStream_t stream,
                   bool chained, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = chained ? 1 : 0;
  return cudaLaunchKernelEx(&cfg, kernel, static_cast<Args&&>(args)...);
}

}  // namespace quilt_launch
