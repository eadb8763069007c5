"""Command line: ``quilt-attn`` (or ``python -m quilt_attn``).

Subcommands::

    quilt-attn overlap --workload glm53-like --plot overlap.png --json overlap.json
    quilt-attn plan    --workload ds32-like --group-size 8 --tile 64 --merge-level 4
    quilt-attn demo                       # plan + QUILT + query-parallel, checked against the reference

The benchmark grid and the evaluation report are the development harness's (``quilt-bench``,
``benchmarks/quilt_bench``), not the library's.

Results go to stdout; progress lines (``[  12.3s] step ...``) go to stderr (``--quiet`` drops them).

CPU runs and the Triton interpreter: without a CUDA device the Triton kernels can only run in
Triton's interpreter, which is chosen by the environment variable ``TRITON_INTERPRET=1`` when a
kernel is *defined* (when ``quilt_attn.ops`` is imported). So ``main`` sets
``TRITON_INTERPRET=1`` in ``os.environ`` first thing, when no CUDA device is present and the
variable is unset, before any kernel module is imported; the setting stays for the rest of the
process. A variable you set yourself is left alone. Interpreter timings measure the interpreter
and say nothing about kernel speed.

Exit codes: 0 success; 1 a correctness check failed (``demo``); 2 bad arguments, or a ``ValueError`` /
``TypeError`` / ``OSError`` met while running (an unreadable file, an output folder that is a file): one line
on stderr, no traceback.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from .cli_args import (Progress, UsageError, check_merge_level, device_arg, group_size_arg, int_list, nonneg_int,
                       new_parser, pos_int, pow2, run_command, unit_float, write_json)
from .demo import DEMO_CPU, DEMO_GPU, TOLERANCE, cmd_demo
from .overlap import overlap_profile
from .planner import plan as make_plan
from .workloads import WORKLOADS, generate, load_indices

PROG = "quilt-attn"

# Full-size defaults (DeepSeek-V3.2 / GLM-5 prefill: Top-2048 over a 64K context).
GPU_SIZES = dict(s_q=16384, s_kv=65536, topk=2048)
# CPU defaults of overlap / plan: the production topk / s_kv ratio, fewer queries.
CPU_SIZES = dict(s_q=2048, s_kv=65536, topk=2048)


# ---------------------------------------------------------------------- workload arguments

def _add_workload_args(p: argparse.ArgumentParser, sizes_note: str) -> None:
    g = p.add_argument_group("workload (generated, or loaded with --indices)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=WORKLOADS, default="glm53-like", metavar="NAME",
                     help=f"generated workload, one of: {', '.join(WORKLOADS)} (default: glm53-like)")
    src.add_argument("--indices", metavar="PATH",
                     help="load int32 [s_q, topk] indices from a .npy, .pt or .safetensors file instead "
                          "(s_q and topk come from the file)")
    g.add_argument("--s-q", type=pos_int, default=None, metavar="N",
                   help=f"queries (the last s_q positions of the context); {sizes_note}")
    g.add_argument("--s-kv", type=pos_int, default=None, metavar="N",
                   help="context length; with --indices, entries >= s_kv are ignored (default there: "
                        "only -1 entries are)")
    g.add_argument("--topk", type=pos_int, default=None, metavar="K", help="selected kv rows per query")
    g.add_argument("--seed", type=nonneg_int, default=0, help="random seed of the generator (default: 0)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where indices are generated and processed (default: auto = cuda when available)")


def _load_workload(args, log: Progress):
    """Indices and a description of where they came from, per the workload arguments."""
    dev = device_arg(args.device)
    if args.indices:
        if args.s_q is not None or args.topk is not None:
            raise UsageError("argument --indices: --s-q and --topk come from the file; leave them out")
        log(f"loading indices from {args.indices}")
        try:
            indices = load_indices(args.indices).to(dev)
        except (OSError, ValueError, TypeError) as err:
            raise UsageError(f"argument --indices: {err}") from None
        s_q, topk = indices.shape
        source = dict(indices=str(args.indices), s_q=s_q, s_kv=args.s_kv, topk=topk)
        log(f"loaded indices [{s_q}, {topk}] on {dev}")
        return indices, args.s_kv, source
    base = GPU_SIZES if dev.type == "cuda" else CPU_SIZES
    s_q = args.s_q if args.s_q is not None else base["s_q"]
    s_kv = args.s_kv if args.s_kv is not None else base["s_kv"]
    topk = args.topk if args.topk is not None else base["topk"]
    if s_q > s_kv:
        raise UsageError(f"argument --s-q: s_q ({s_q}) must be <= --s-kv ({s_kv}): the queries are the last "
                         f"s_q positions of the context")
    log(f"generating workload {args.workload}: s_q={s_q} s_kv={s_kv} topk={topk} seed={args.seed} on {dev}")
    try:
        indices = generate(args.workload, s_q, s_kv, topk, seed=args.seed, device=dev)
    except ValueError as err:
        raise UsageError(f"workload {args.workload!r}: {err}") from None
    source = dict(workload=args.workload, s_q=s_q, s_kv=s_kv, topk=topk, seed=args.seed)
    return indices, s_kv, source


# ------------------------------------------------------------------------------- overlap

def cmd_overlap(args, log: Progress) -> int:
    indices, s_kv, source = _load_workload(args, log)
    log(f"profiling group sizes {args.group_sizes}, cascade from {args.cascade_group}")
    try:
        prof = overlap_profile(indices, s_kv=s_kv, group_sizes=args.group_sizes, cascade_group=args.cascade_group)
    except ValueError as err:
        raise UsageError(f"argument --group-sizes/--cascade-group: {err}") from None
    name = source.get("workload") or os.path.basename(source["indices"])
    print(f"workload: {name}")
    print(prof.table())
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        try:
            prof.plot(args.plot, title=f"{name}: s_q={prof.s_q}, topk={prof.topk}, s_kv={prof.s_kv}")
        except ImportError as err:  # matplotlib: not a dependency of the library
            raise UsageError(f"argument --plot: {err}") from None
        print(f"plot written to {args.plot}")
    if args.json:
        write_json(args.json, {"source": source, "profile": prof.to_dict()})
        print(f"profile written to {args.json}")
    log("done")
    return 0


# ---------------------------------------------------------------------------------- plan

def cmd_plan(args, log: Progress) -> int:
    check_merge_level(args.merge_level, args.group_size)
    if args.importance_clip and args.merge_level != 1:
        raise UsageError("argument --importance-clip: needs --merge-level 1 (it clips the private level)")
    indices, s_kv, source = _load_workload(args, log)
    log(f"planning: group_size={args.group_size} tile={args.tile} clip_threshold={args.clip_threshold} "
        f"importance_clip={args.importance_clip} merge_level={args.merge_level} mask_method={args.mask_method} "
        f"backend={args.backend}")
    t0 = time.perf_counter()
    try:
        pl = make_plan(indices, s_kv=s_kv, group_size=args.group_size, tile=args.tile,
                       clip_threshold=args.clip_threshold, importance_clip=args.importance_clip,
                       merge_level=args.merge_level, mask_method=args.mask_method, backend=args.backend)
        stats = pl.stats  # syncs with the device
    except ValueError as err:
        raise UsageError(str(err)) from None
    plan_s = time.perf_counter() - t0
    print(pl.summary())
    print(f"  planning time            : {plan_s * 1e3:.1f} ms (first call, {indices.device}; includes any compilation)")
    if args.json:
        settings = dict(group_size=pl.group_size, tile=pl.tile, clip_threshold=pl.clip_threshold,
                        importance_clip=pl.importance_clip, merge_level=pl.merge_level, mask_method=pl.mask_method,
                        backend=args.backend)
        write_json(args.json, {"source": source, "settings": settings,
                                "stats": {k: ({str(a): b for a, b in v.items()} if isinstance(v, dict) else v)
                                          for k, v in stats.items()}})
        print(f"stats written to {args.json}")
    log("done")
    return 0


# -------------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p, sub, common = new_parser(PROG, "QUILT: shared-query execution for top-K sparse-attention prefill "
                                      "(DeepSeek-V3.2 / GLM-5 MLA), Triton kernels.")

    gpu, cpu = GPU_SIZES, CPU_SIZES
    sizes_note = (f"defaults: {gpu['s_q']} / {gpu['s_kv']} / {gpu['topk']} (s_q / s_kv / topk) on cuda, "
                  f"{cpu['s_q']} / {cpu['s_kv']} / {cpu['topk']} on the cpu")

    # overlap
    sp = sub.add_parser("overlap", formatter_class=fmt,
                        help="how much neighbouring queries of a workload could share",
                        description="Overlap profile of a top-K workload: for aligned groups of G neighbouring "
                                    "queries, the fraction of rows shared by all members and the kv rows a fixed "
                                    "group, the union and cascaded sharing would process, relative to "
                                    "query-parallel (quilt_attn.overlap.overlap_profile).")
    _add_workload_args(sp, sizes_note)
    sp.add_argument("--group-sizes", type=int_list, default=[2, 4, 8, 16], metavar="G,G,...",
                    help="group sizes to report, powers of two in [1, 16] (default: 2,4,8,16)")
    sp.add_argument("--cascade-group", type=group_size_arg, default=8, metavar="C",
                    help="first (largest) group of cascaded sharing C -> C/2 -> ... -> 1 (default: 8)")
    sp.add_argument("--plot", metavar="PATH", help="write a PNG plot of the profile to PATH")
    sp.add_argument("--json", metavar="PATH", help="write the profile (and where the workload came from) as JSON")
    common(sp)
    sp.set_defaults(func=cmd_overlap)

    # plan
    sp = sub.add_parser("plan", formatter_class=fmt, help="build a QUILT plan and print its summary",
                        description="Build a QUILT execution plan (quilt_attn.plan) for a workload and print "
                                    "Plan.summary(): rows processed, tiles per cascade level, padding, drops.")
    _add_workload_args(sp, sizes_note)
    pg = sp.add_argument_group("planner")
    pg.add_argument("--group-size", type=group_size_arg, default=8, metavar="G",
                    help="queries a group, power of two in [1, 16] (default: 8)")
    pg.add_argument("--tile", type=pos_int, default=64, metavar="T", help="kv rows a tile (default: 64)")
    pg.add_argument("--clip-threshold", type=unit_float, default=0.5, metavar="TAU",
                    help="tile-aware clipping threshold in [0, 1]: a segment tail of r < TAU * tile rows is "
                         "pushed down a level instead of padded (default: 0.5)")
    pg.add_argument("--importance-clip", action="store_true",
                    help="drop each query's lowest-ranked private tail rows that would fill a last tile below "
                         "the threshold (approximate; needs --merge-level 1)")
    pg.add_argument("--merge-level", type=pow2, default=1, metavar="M",
                    help="the cascade stops at blocks of M members; smaller sharing and private rows are packed "
                         "into member-masked tiles of the block (default: 1 = full cascade; the kernels use the "
                         "queries a program holds, 64 // heads)")
    pg.add_argument("--mask-method", choices=("bitmap", "sort"), default="bitmap",
                    help="member masks by membership bitmap or by sorting (SCSD); same plan (default: bitmap)")
    pg.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto",
                    help="planner implementation: fused Triton kernel, vectorised torch, or auto "
                         "(Triton on cuda) (default: auto)")
    sp.add_argument("--json", metavar="PATH", help="write the plan settings and statistics as JSON")
    common(sp)
    sp.set_defaults(func=cmd_plan)

    # demo
    g_, c_ = DEMO_GPU, DEMO_CPU
    sp = sub.add_parser(
        "demo", formatter_class=fmt, help="plan + QUILT + query-parallel, checked against the reference",
        description="Generate a workload, plan it, run the sparse prefill with method='quilt' and "
                    "method='query_parallel', check both against the float32 reference (relative L2 error of "
                    "out, max |d lse| on a random sample of queries), and print the KV reduction and timings.\n\n"
                    f"On a GPU the defaults are full size: s_q {g_['s_q']}, s_kv {g_['s_kv']}, topk {g_['topk']}, "
                    f"{g_['heads']} heads, d_qk {g_['d_v'] + g_['d_rope']} = {g_['d_v']} + {g_['d_rope']}, bf16, "
                    "tile 64; times are triton.testing.do_bench medians.\n"
                    f"On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set automatically) "
                    f"at a tiny size: s_q {c_['s_q']}, s_kv {c_['s_kv']}, topk {c_['topk']}, {c_['heads']} heads, "
                    f"d_qk {c_['d_v'] + c_['d_rope']} = {c_['d_v']} + {c_['d_rope']}, fp16 (the interpreter's "
                    f"bf16 dot is wrong), tile {c_['tile']}; CPU times are the interpreter's and mean nothing.\n\n"
                    f"Exit code 1 when a relative error exceeds the tolerance (fp16 {TOLERANCE['fp16']:g}, "
                    f"bf16 {TOLERANCE['bf16']:g}).")
    sp.add_argument("--workload", choices=WORKLOADS, default="glm53-like", metavar="NAME",
                    help=f"generated workload, one of: {', '.join(WORKLOADS)} (default: glm53-like)")
    sp.add_argument("--s-q", type=pos_int, metavar="N",
                    help=f"queries (default: {g_['s_q']} on a GPU, {c_['s_q']} on the CPU)")
    sp.add_argument("--s-kv", type=pos_int, metavar="N",
                    help=f"context length (default: {g_['s_kv']} on a GPU, {c_['s_kv']} on the CPU)")
    sp.add_argument("--topk", type=pos_int, metavar="K",
                    help=f"selected kv rows per query (default: {g_['topk']} on a GPU, {c_['topk']} on the CPU)")
    sp.add_argument("--heads", type=pos_int, metavar="H",
                    help=f"query heads, 1..128 (default: {g_['heads']} on a GPU, {c_['heads']} on the CPU)")
    sp.add_argument("--d-v", type=pow2, metavar="D",
                    help=f"value / latent width, power of two >= 16 (default: {g_['d_v']} on a GPU, "
                         f"{c_['d_v']} on the CPU)")
    sp.add_argument("--d-rope", type=pow2, metavar="D",
                    help=f"rope width, power of two >= 16; d_qk = d_v + d_rope (default: {g_['d_rope']} on a GPU, "
                         f"{c_['d_rope']} on the CPU)")
    sp.add_argument("--dtype", choices=("bf16", "fp16"),
                    help="q / kv dtype (default: bf16 on a GPU, fp16 on the CPU)")
    sp.add_argument("--seed", type=nonneg_int, default=0, help="seed of the workload and of q / kv (default: 0)")
    sp.add_argument("--group-size", type=group_size_arg, metavar="G",
                    help="QUILT group size, power of two in [1, 16] (default: the queries one kernel program "
                         "holds, 64 // heads, at most 8; 8 from 64 heads)")
    sp.add_argument("--tile", type=pow2, metavar="T",
                    help=f"kv rows a plan tile, power of two >= 16 (default: {g_['tile']} on a GPU, "
                         f"{c_['tile']} on the CPU)")
    sp.add_argument("--clip-threshold", type=unit_float, default=0.5, metavar="TAU",
                    help="tile-aware clipping threshold in [0, 1] (default: 0.5)")
    sp.add_argument("--merge-level", type=pow2, metavar="M",
                    help="where the cascade stops (default: the queries one kernel program holds, 64 // heads)")
    sp.add_argument("--check-rows", type=pos_int, default=256, metavar="N",
                    help="queries sampled for the float32 reference check (default: 256)")
    sp.add_argument("--warmup", type=pos_int, default=25, metavar="MS", help="do_bench warmup, GPU (default: 25)")
    sp.add_argument("--rep", type=pos_int, default=100, metavar="MS",
                    help="do_bench repetition time, GPU (default: 100)")
    sp.add_argument("--backend", choices=("auto", "triton", "cuda"), default="auto",
                    help="kernel backend (default: auto = the sm_90a CUDA kernel where it runs, else Triton)")
    common(sp)
    sp.set_defaults(func=cmd_demo)

    return p



def main(argv=None) -> int:
    """Entry point of ``quilt-attn`` / ``python -m quilt_attn``; returns the exit status.

    Sets ``TRITON_INTERPRET=1`` first when there is no CUDA device and the variable is unset
    (see the module docstring).
    """
    return run_command(PROG, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
