"""The benchmark cases, one runner: ``python benchmarks/run.py CASE [options]`` (``CASE --help``: its options).

Each case prints a short table and (with ``--out``) writes a JSON of its rows with the GPU, commit and versions
(``quilt_bench.bench.environment``); every timed output is checked against the float32 reference in the same
run. The cases are GPU-only unless their help says otherwise; each is also a script of its own
(``benchmarks/<module>.py``). The evaluation report and the benchmark grid with custom configurations are
``quilt-bench report`` / ``quilt-bench bench`` (``benchmarks/quilt_bench``).
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

# case -> (module in benchmarks/, what it answers); the module's ``main(argv, prog)`` runs it
CASES = {
    "grid": ("run_grid", "the recorded benchmark grid (quilt_bench.bench.GRID), all backends"),
    "engine-shapes": ("engine_shapes", "the call as engines make it: paged slot ids, varlen, chunked prefill"),
    "flashmla": ("flashmla_baseline", "FlashMLA's sm90 sparse prefill beside the CUDA kernel, interleaved"),
    "plan-timing": ("plan_timing", "planner time by backend and mask method (--device cpu: a smoke run)"),
    "fp8-cache": ("fp8_cache", "the FP8 cache on the CUDA backend: expanded once a call vs widened in the kernel"),
    "call-breakdown": ("call_breakdown", "GPU time per kernel of a call (torch profiler), bf16 and an FP8 pool"),
    "triton-ptx": ("triton_ptx", "the Triton kernel's PTX compiled for sm_90 without a GPU: compare two trees (CPU)"),
    "fp8-mark-ab": ("fp8_mark_ab", "variants of the FP8 compaction's mark pass, interleaved"),
    "repair-cost": ("repair_cost", "the repair pass's cost to a QUILT call (empty queue, NaN rows), interleaved"),
    "ab-cuda": ("ab_cuda", "CUDA kernel variants (libraries, CTA counts, program orders, groups), interleaved"),
    "cp-split": ("cp_split", "context-parallel query splits: zigzag vs round-robin (--cpu: tile counts only)"),
    "sanitize-cuda": ("sanitize_cuda", "a small CUDA-kernel run for compute-sanitizer"),
    "sanitize-triton": ("sanitize_triton", "a small run of every Triton path for compute-sanitizer memcheck"),
    "sanitize-plan": ("sanitize_plan", "a small CUDA-planner run for compute-sanitizer"),
    "boundary-timeline": ("boundary_timeline", "clock64 stamps of the CUDA kernel's program boundaries"),
    "profile": ("profile_cuda", "one launch for Nsight Compute, and its stall summary"),
    "owner-exact-prototype": ("owner_exact.prototype", "the swapped (owner-exact) program on real plans beside "
                              "today's kernel, interleaved"),
    "owner-exact": ("owner_exact.predict", "swapped (owner-exact) tiles: model x plan owner counts (CPU; "
                    "--measured: tile_rate.cu's JSON)"),
    "fp8-mma": ("fp8_mma", "the FP8 tensor-core mode (precision='fp8') beside the exact bf16 kernel, interleaved"),
    "fp8-accuracy": ("fp8_accuracy", "FP8 tensor-core mode (CPU emulation) against the exact path: q / P "
                     "granularities, accumulator bits, layer proxy (CPU)"),
}


def usage() -> str:
    width = max(map(len, CASES))
    lines = [__doc__.strip(), "", "usage: python benchmarks/run.py CASE [options]", "", "cases:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in CASES.items()]
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in CASES:
        print(f"run.py: error: unknown case {name!r} (choose from {', '.join(CASES)})", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # the case modules beside this file
    module = importlib.import_module(CASES[name][0])
    return module.main(rest, prog=f"run.py {name}")


if __name__ == "__main__":
    sys.exit(main())
