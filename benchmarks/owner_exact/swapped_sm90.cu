// Owner-exact prototype (issue 24): the shipping kernel library with its consumers swapped for the owner-exact
// program (swapped_consumer.cuh) where it applies; the same C interface, so the library's Python launcher drives
// it (cuda_backend.use_library). Built with the planner unit by benchmarks/owner_exact/prototype.py.
#include "swapped_consumer.cuh"

#define QUILT_CONSUMERS consume_programs_swapped
#define QUILT_SMEM_BYTES (kSmemBytes + swapped::kExtraBytes)
#include "../../quilt_attn/ops/csrc/quilt_sm90.cu"
