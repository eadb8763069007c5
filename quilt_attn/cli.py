"""Command line: ``quilt-attn`` (or ``python -m quilt_attn``).

Subcommands::

    quilt-attn overlap --workload glm53-like --plot overlap.png --json overlap.json
    quilt-attn plan    --workload ds32-like --group-size 8 --tile 64 --merge-level 4
    quilt-attn demo                       # plan + QUILT + query-parallel, checked against the reference
    quilt-attn bench   --heads 16,64 --workloads glm53-like --kv bf16    # GPU only
    quilt-attn report  --out-dir DIR      # evaluation: GPU grid + layer proxy + sweeps (context lengths,
                                          # group x threshold, time breakdown) + BENCHMARKS.md;
                                          # CPU: overlap profiles + clipping study only

Results go to stdout; progress lines (``[  12.3s] step ...``) go to stderr (``--quiet`` drops them).

CPU runs and the Triton interpreter: without a CUDA device the Triton kernels can only run in
Triton's interpreter, which is chosen by the environment variable ``TRITON_INTERPRET=1`` when a
kernel is *defined* (when ``quilt_attn.ops`` is imported). So ``main`` sets
``TRITON_INTERPRET=1`` in ``os.environ`` first thing, when no CUDA device is present and the
variable is unset, before any kernel module is imported; the setting stays for the rest of the
process. A variable you set yourself is left alone. Interpreter timings measure the interpreter
and say nothing about kernel speed.

Exit codes: 0 success; 1 a correctness check failed (``demo``) or a benchmark configuration
failed or missed its tolerance (``bench``) or a grid configuration failed (``report``); 2 bad
arguments, or no CUDA device for ``bench``, or a ``ValueError`` / ``TypeError`` / ``OSError`` met while
running (an unreadable file, an output folder that is a file): one line on stderr, no traceback.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

PROG = "quilt-attn"

# Full-size defaults (DeepSeek-V3.2 / GLM-5 prefill: Top-2048 over a 64K context).
GPU_SIZES = dict(s_q=16384, s_kv=65536, topk=2048)
# CPU defaults of overlap / plan: the production topk / s_kv ratio, fewer queries.
CPU_SIZES = dict(s_q=2048, s_kv=65536, topk=2048)
# demo: full size on a GPU; a tiny problem on the CPU (Triton interpreter, 2 cores, seconds).
DEMO_GPU = dict(s_q=16384, s_kv=65536, topk=2048, heads=16, d_v=512, d_rope=64, dtype="bf16", tile=64)
DEMO_CPU = dict(s_q=32, s_kv=2048, topk=64, heads=8, d_v=64, d_rope=16, dtype="fp16", tile=16)
TOLERANCE = {"fp16": 2e-3, "bf16": 1e-2}  # relative L2 error of out against the float32 reference

BENCH_METHODS = ("query_parallel", "quilt", "quilt+iclip")
BENCH_KV = ("bf16", "fp8")
BENCH_CONFIG_KEYS = {"num_warps": int, "num_stages": int, "dv_split": int, "group_size": int,
                     "merge_level": int, "clip_threshold": float, "backend": str}


class UsageError(Exception):
    """A bad argument value found after parsing; reported as ``<prog>: error: ...`` with exit 2."""


# ------------------------------------------------------------------------------------ helpers

class Progress:
    """Progress lines on stderr, each with the time since the command started."""

    def __init__(self, quiet: bool = False):
        self.t0 = time.perf_counter()
        self.quiet = quiet

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{self.elapsed():7.1f}s] {msg}", file=sys.stderr, flush=True)


def _ensure_interpreter() -> None:
    """Set ``TRITON_INTERPRET=1`` when there is no CUDA device and the variable is unset."""
    if "TRITON_INTERPRET" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _int_at_least(minimum: int, what: str):
    """An argparse type: an int >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return parse


_pos_int = _int_at_least(1, "a positive integer")
_nonneg_int = _int_at_least(0, "an integer >= 0")


def _unit_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


def _pow2(text: str) -> int:
    value = _pos_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"expected a power of two, got {value}")
    return value


def _group(text: str) -> int:
    value = _pow2(text)
    if value > 16:
        raise argparse.ArgumentTypeError(f"expected a power of two in [1, 16], got {value}")
    return value


def _check_merge_level(merge_level, group_size) -> None:
    if merge_level is not None and merge_level > group_size:
        raise UsageError(f"argument --merge-level: must be <= --group-size ({group_size}), got {merge_level}")


def _int_list(text: str) -> list[int]:
    items = [t for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError("expected a comma-separated list of positive integers")
    return [_pos_int(t.strip()) for t in items]


def _choice_list(choices):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(choices)}")
        bad = [t for t in items if t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(map(repr, bad))} (choose from {', '.join(choices)})")
        return list(dict.fromkeys(items))

    return parse


def _bench_config(text: str) -> dict:
    """``key=value[,key=value...]`` with keys from ``BENCH_CONFIG_KEYS`` (run_case keyword arguments)."""
    cfg = {}
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or key not in BENCH_CONFIG_KEYS:
            raise argparse.ArgumentTypeError(
                f"bad config item {item!r}: expected key=value with key in {', '.join(BENCH_CONFIG_KEYS)}")
        try:
            cfg[key] = BENCH_CONFIG_KEYS[key](value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"bad value in config item {item!r}") from None
    return cfg


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UsageError("argument --device: cuda requested but no CUDA device is available")
    return torch.device(name)


def _write_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def gpu_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


# ---------------------------------------------------------------------- workload arguments

def _add_workload_args(p: argparse.ArgumentParser, sizes_note: str) -> None:
    from .workloads import WORKLOADS

    g = p.add_argument_group("workload (generated, or loaded with --indices)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--workload", choices=WORKLOADS, default="glm53-like", metavar="NAME",
                     help=f"generated workload, one of: {', '.join(WORKLOADS)} (default: glm53-like)")
    src.add_argument("--indices", metavar="PATH",
                     help="load int32 [s_q, topk] indices from a .npy, .pt or .safetensors file instead "
                          "(s_q and topk come from the file)")
    g.add_argument("--s-q", type=_pos_int, default=None, metavar="N",
                   help=f"queries (the last s_q positions of the context); {sizes_note}")
    g.add_argument("--s-kv", type=_pos_int, default=None, metavar="N",
                   help="context length; with --indices, entries >= s_kv are ignored (default there: "
                        "only -1 entries are)")
    g.add_argument("--topk", type=_pos_int, default=None, metavar="K", help="selected kv rows per query")
    g.add_argument("--seed", type=_nonneg_int, default=0, help="random seed of the generator (default: 0)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where indices are generated and processed (default: auto = cuda when available)")


def _load_workload(args, log: Progress):
    """Indices and a description of where they came from, per the workload arguments."""
    from .workloads import generate, load_indices

    dev = _device(args.device)
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
    from .overlap import overlap_profile

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
        prof.plot(args.plot, title=f"{name}: s_q={prof.s_q}, topk={prof.topk}, s_kv={prof.s_kv}")
        print(f"plot written to {args.plot}")
    if args.json:
        _write_json(args.json, {"source": source, "profile": prof.to_dict()})
        print(f"profile written to {args.json}")
    log("done")
    return 0


# ---------------------------------------------------------------------------------- plan

def cmd_plan(args, log: Progress) -> int:
    from .planner import plan as make_plan

    _check_merge_level(args.merge_level, args.group_size)
    if args.importance_clip and args.merge_level != 1:
        raise UsageError("argument --importance-clip: needs --merge-level 1 (it clips the private level)")
    indices, s_kv, source = _load_workload(args, log)
    log(f"planning: group_size={args.group_size} tile={args.tile} clip_threshold={args.clip_threshold} "
        f"importance_clip={args.importance_clip} merge_level={args.merge_level} method={args.method} "
        f"backend={args.backend}")
    t0 = time.perf_counter()
    try:
        pl = make_plan(indices, s_kv=s_kv, group_size=args.group_size, tile=args.tile,
                       clip_threshold=args.clip_threshold, importance_clip=args.importance_clip,
                       merge_level=args.merge_level, method=args.method, backend=args.backend)
        stats = pl.stats  # syncs with the device
    except ValueError as err:
        raise UsageError(str(err)) from None
    plan_s = time.perf_counter() - t0
    print(pl.summary())
    print(f"  planning time            : {plan_s * 1e3:.1f} ms (first call, {indices.device}; includes any compilation)")
    if args.json:
        settings = dict(group_size=pl.group_size, tile=pl.tile, clip_threshold=pl.clip_threshold,
                        importance_clip=pl.importance_clip, merge_level=pl.merge_level, method=pl.method,
                        backend=args.backend)
        _write_json(args.json, {"source": source, "settings": settings,
                                "stats": {k: ({str(a): b for a, b in v.items()} if isinstance(v, dict) else v)
                                          for k, v in stats.items()}})
        print(f"stats written to {args.json}")
    log("done")
    return 0


# ---------------------------------------------------------------------------------- demo

def _check(out, lse, ref_out, ref_lse, tol: float) -> dict:
    import torch

    o = out.float()
    err = float((o - ref_out).norm() / ref_out.norm().clamp_min(1e-30))
    fin = torch.isfinite(ref_lse)
    lse_err = float((lse - ref_lse)[fin].abs().max()) if bool(fin.any()) else 0.0
    nan = bool(torch.isnan(o).any())
    return {"rel_err": err, "lse_err": lse_err, "nan": nan, "ok": (not nan) and math.isfinite(err) and err <= tol}


def cmd_demo(args, log: Progress) -> int:
    import torch

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    base = DEMO_GPU if cuda else DEMO_CPU
    val = {k: (getattr(args, k) if getattr(args, k, None) is not None else v) for k, v in base.items()}
    s_q, s_kv, topk, h = val["s_q"], val["s_kv"], val["topk"], val["heads"]
    d_v, d_rope, dtype_name, tile = val["d_v"], val["d_rope"], val["dtype"], val["tile"]
    d_qk = d_v + d_rope
    if s_q > s_kv:
        raise UsageError(f"argument --s-q: s_q ({s_q}) must be <= --s-kv ({s_kv})")
    if h > 128:
        raise UsageError(f"argument --heads: the kernels take 1..128 heads, got {h}")
    if tile < 16:
        raise UsageError(f"argument --tile: the kernel needs a power of two >= 16, got {tile}")
    for name, v in (("--d-v", d_v), ("--d-rope", d_rope)):
        if v < 16:
            raise UsageError(f"argument {name}: the kernels need a power of two >= 16, got {v}")
    if not cuda and not _interpreting():
        raise UsageError("no CUDA device and TRITON_INTERPRET is not 1: the Triton kernels cannot run "
                         "(unset TRITON_INTERPRET so that quilt-attn sets it, or set it to 1)")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    tol = TOLERANCE[dtype_name]

    from .api import sparse_prefill
    from .ops import sparse_attention as ops
    from .planner import plan as make_plan
    from .reference import sparse_prefill_reference
    from .workloads import generate

    if not cuda and type(ops._sparse_attention_kernel).__name__ != "InterpretedFunction":
        raise UsageError("the Triton kernels were imported before TRITON_INTERPRET=1 was set, so they cannot "
                         "run on the CPU; run quilt-attn in a fresh process (or set TRITON_INTERPRET=1 first)")
    if not cuda and dtype == torch.bfloat16:
        print("warning: Triton's CPU interpreter computes bf16 dot products wrongly; expect the check to fail "
              "(use --dtype fp16 on the CPU)", file=sys.stderr)

    from . import dispatch

    try:
        backend = dispatch.choose_backend(args.backend, torch.empty(1, h, d_qk, dtype=dtype, device=dev),
                                          torch.empty(1, d_qk, dtype=dtype, device=dev), d_v, tile=tile)
    except ValueError as err:
        raise UsageError(f"argument --backend: {err}") from None
    group_size = args.group_size if args.group_size is not None else ops.default_group_size(h)
    _check_merge_level(args.merge_level, group_size)
    qp, hb = ops.program_shape(h, group_size)
    try:  # the plan sparse_prefill builds for this backend (CUDA: private rows stay in the 64-row tiles)
        settings = dispatch.plan_settings(h, backend, group_size=group_size, tile=tile,
                                          clip_threshold=args.clip_threshold, merge_level=args.merge_level)
    except ValueError as err:
        raise UsageError(f"argument --tile: {err}") from None
    merge_level = settings["merge_level"]
    mode = ("GPU: " + torch.cuda.get_device_name()) if cuda else "CPU: Triton interpreter (TRITON_INTERPRET=1)"
    print(f"quilt-attn demo on {mode}")
    print(f"  workload {args.workload}: s_q={s_q} s_kv={s_kv} topk={topk} seed={args.seed}")
    print(f"  q [{s_q}, {h}, {d_qk}] {dtype_name}, kv [{s_kv}, {d_qk}] (d_qk = {d_v} + {d_rope}, d_v = {d_v}); "
          f"QUILT group_size={group_size} tile={tile} clip_threshold={args.clip_threshold} "
          f"merge_level={merge_level}; program = {qp} queries x {min(hb, h)} heads; backend {backend}")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    log(f"generating workload {args.workload} on {dev}")
    try:
        indices = generate(args.workload, s_q, s_kv, topk, seed=args.seed, device=dev)
    except ValueError as err:
        raise UsageError(f"workload {args.workload!r}: {err}") from None
    log("generating q and kv")
    g = torch.Generator(device=dev).manual_seed(args.seed + 1)
    q = torch.randn(s_q, h, d_qk, generator=g, device=dev, dtype=torch.float32).to(dtype)
    kv = torch.randn(s_kv, d_qk, generator=g, device=dev, dtype=torch.float32).to(dtype)

    log("planning" + (" (the first call compiles the Triton planner)" if cuda else " (torch planner)"))
    t0 = time.perf_counter()
    try:
        pl = make_plan(indices, s_kv=s_kv, **settings)
        st = pl.stats
    except ValueError as err:
        raise UsageError(str(err)) from None
    plan_first_ms = (time.perf_counter() - t0) * 1e3

    results, first_ms = {}, {}
    for method in ("quilt", "query_parallel"):
        log(f"running {method}" + (" (Triton interpreter)" if not cuda else " (first call compiles)"))
        # the QUILT kernels themselves, even where sparse_prefill would fall back (reported below)
        kw = dict(plan=pl, fallback=False) if method == "quilt" else {}
        t0 = time.perf_counter()
        try:
            results[method] = sparse_prefill(q, kv, indices, method=method, d_v=d_v, backend=backend, **kw)
        except ValueError as err:
            raise UsageError(f"{method}: {err}") from None
        sync()
        first_ms[method] = (time.perf_counter() - t0) * 1e3

    n_check = min(args.check_rows, s_q)
    log(f"float32 reference on {n_check} of {s_q} queries")
    rows = torch.randperm(s_q, generator=torch.Generator().manual_seed(123))[:n_check].to(dev)
    ref_out, _, ref_lse = sparse_prefill_reference(q[rows], kv, indices[rows], d_v=d_v, compute_dtype=torch.float32)
    checks = {m: _check(o[rows], lse[rows], ref_out, ref_lse, tol) for m, (o, _, lse) in results.items()}

    # KV reduction (the plan's logical rows and tiles against query-parallel's)
    valid = (indices >= 0) & (indices < s_kv)
    qp_pairs = int(valid.sum())
    qp_tiles = int(((valid.sum(1) + tile - 1) // tile).sum())
    _, ntiles = pl.work_list(qp)
    quilt_loads = int(ntiles.sum()) * math.ceil(h / hb)
    qp_loads = s_q * math.ceil(topk / 64) * math.ceil(h / ops.program_shape(h, 1)[1])

    print()
    print(f"check against the float32 reference ({n_check} of {s_q} queries; tolerance rel L2 err <= {tol:g} "
          f"for {dtype_name}):")
    for m, c in checks.items():
        print(f"  {m:<15} rel L2 err {c['rel_err']:.2e}   max |d lse| {c['lse_err']:.2e}"
              f"{'   NaN in output' if c['nan'] else ''}   {'OK' if c['ok'] else 'FAIL'}")
    print()
    print("KV reduction (plan statistics):")
    print(f"  kv rows processed : quilt {st['rows_processed']} vs query-parallel {qp_pairs} "
          f"-> {st['rows_processed'] / max(1, qp_pairs):.3f}x (reduction {st['reduction']:.1%})")
    print(f"  tiles of {tile:<9}: quilt {st['tiles']} vs query-parallel {qp_tiles} "
          f"-> {st['tiles'] / max(1, qp_tiles):.3f}x   (tile utilization {st['tile_utilization']:.1%}, "
          f"per level {st['tiles_per_level']})")
    priv_loads = (0 if pl.priv_n is None  # no private split (CUDA backend): those rows are in the tiles
                  else int(((pl.priv_n + 63) // 64).sum()) * math.ceil(h / ops.program_shape(h, 1)[1]))
    print(f"  kernel tile loads : quilt {quilt_loads} x {tile} rows shared + {priv_loads} x 64 rows private vs "
          f"query-parallel {qp_loads} x 64 rows -> gathered kv rows "
          f"{(quilt_loads * tile + priv_loads * 64) / max(1, qp_loads * 64):.3f}x")
    # sparse_prefill decides from the settings (dispatch.decide); the measured tile-cost rule is an opt-in
    # (fallback="cost"; the demo passes the resolved backend, so no automatic switch to Triton)
    runs = dispatch.decide(backend, "quilt", h, plan=pl)
    cost = dispatch.decide(backend, "quilt", h, plan=pl, fallback="cost", auto=args.backend == "auto")
    print(f"  sparse_prefill(method='quilt') at this size runs: "
          f"{'the QUILT kernels' if runs.quilt else 'query-parallel (one query fills a 64-row tile)'}; "
          f"the tile-cost rule (fallback='cost') would run "
          f"{'the QUILT kernels' if cost.quilt else 'query-parallel (sharing would not pay off)'}")
    print()
    if cuda:
        import triton.testing

        log("timing with triton.testing.do_bench (median)")

        def bench(fn):
            return float(triton.testing.do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median"))

        pkw = dict(s_kv=s_kv, **settings)
        run = dict(d_v=d_v, backend=backend)
        t_plan = bench(lambda: make_plan(indices, **pkw))
        t_quilt = bench(lambda: sparse_prefill(q, kv, indices, method="quilt", plan=pl, **run))
        t_e2e = bench(lambda: sparse_prefill(q, kv, indices, method="quilt", plan=make_plan(indices, **pkw), **run))
        t_qp = bench(lambda: sparse_prefill(q, kv, indices, method="query_parallel", **run))
        flops = 2.0 * s_q * topk * h * (d_qk + d_v)
        print("timing (triton.testing.do_bench median; first call includes compilation):")
        print(f"  plan                  {t_plan:9.3f} ms")
        print(f"  quilt kernel          {t_quilt:9.3f} ms  ({flops / t_quilt / 1e9:6.1f} TFLOP/s useful)   "
              f"first call {first_ms['quilt']:.0f} ms")
        print(f"  quilt plan + kernel   {t_e2e:9.3f} ms")
        print(f"  query_parallel        {t_qp:9.3f} ms  ({flops / t_qp / 1e9:6.1f} TFLOP/s useful)   "
              f"first call {first_ms['query_parallel']:.0f} ms")
        print(f"  speedup vs query_parallel: kernel {t_qp / t_quilt:.2f}x, with planning {t_qp / t_e2e:.2f}x")
    else:
        print("timing (CPU, Triton interpreter: these times measure the interpreter and mean NOTHING about "
              "kernel speed):")
        print(f"  plan (torch planner)  {plan_first_ms:9.1f} ms wall")
        print(f"  quilt                 {first_ms['quilt']:9.1f} ms wall (one call)")
        print(f"  query_parallel        {first_ms['query_parallel']:9.1f} ms wall (one call)")
    print()
    failed = [m for m, c in checks.items() if not c["ok"]]
    if failed:
        print(f"demo: FAIL ({', '.join(failed)} above the {dtype_name} tolerance {tol:g})")
    else:
        print("demo: PASS (quilt and query_parallel match the reference)")
    log("done")
    return 1 if failed else 0


# --------------------------------------------------------------------------------- bench

def add_speedups(rows: list[dict]) -> None:
    """Set ``speedup`` = query_parallel ms / row ms on rows with a query_parallel partner.

    The partner is the fastest successful query_parallel row of the same workload, kv and h
    (over the ``--configs`` tried); rows without one (or error rows) get no field.
    """
    best: dict = {}
    for r in rows:
        if r.get("method") == "query_parallel" and "error" not in r and r.get("ms"):
            key = (r["workload"], r["kv"], r["h"])
            best[key] = min(best.get(key, math.inf), r["ms"])
    for r in rows:
        key = (r.get("workload"), r.get("kv"), r.get("h"))
        if "error" not in r and r.get("ms") and key in best:
            r["speedup"] = best[key] / r["ms"]


def _config_text(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items()) or "defaults"


def cmd_bench(args, log: Progress) -> int:
    import torch

    if not torch.cuda.is_available():
        print(f"{PROG} bench: error: bench needs a CUDA GPU (torch.cuda.is_available() is False); it times the "
              f"Triton kernels, which the CPU interpreter cannot do meaningfully. Try '{PROG} demo' on the CPU.",
              file=sys.stderr)
        return 2
    from . import bench

    if args.s_q > args.s_kv:
        raise UsageError(f"argument --s-q: s_q ({args.s_q}) must be <= --s-kv ({args.s_kv})")
    bad_h = [h for h in args.heads if h > 128]
    if bad_h:
        raise UsageError(f"argument --heads: the kernels take 1..128 heads, got {bad_h}")
    out = args.out or os.path.join("benchmarks", "results", f"{gpu_slug(torch.cuda.get_device_name())}.json")
    configs = args.configs or [{}]
    # (method, run_case name, importance_clip, kwargs, config as given); query_parallel ignores planner
    # keys, so configurations that differ only there run once for it.
    runs, seen = [], set()
    for method in args.methods:
        name, iclip = ("quilt", True) if method == "quilt+iclip" else (method, False)
        for cfg in configs:
            kw = dict(cfg)
            if name == "query_parallel":
                kw = {k: v for k, v in kw.items() if k not in ("group_size", "merge_level", "clip_threshold")}
            key = (method, tuple(sorted(kw.items())))
            if key not in seen:
                seen.add(key)
                runs.append((method, name, iclip, kw, cfg))
    combos = [(w, h, kv) for w in args.workloads for h in args.heads for kv in args.kv]
    n_total = len(combos) * len(runs)
    extra = {"grid": {"workloads": args.workloads, "heads": args.heads, "kv": args.kv, "methods": args.methods,
                      "configs": configs, "s_q": args.s_q, "s_kv": args.s_kv, "topk": args.topk,
                      "seed": args.seed, "check_rows": args.check_rows}}
    rows: list[dict] = []
    n = 0
    log(f"bench: {n_total} configurations on {torch.cuda.get_device_name()}, results to {out}")
    try:
        for workload, h, kv in combos:
            case = bench.Case(workload=workload, h=h, kv=kv, s_q=args.s_q, s_kv=args.s_kv, topk=args.topk,
                              seed=args.seed)
            base = dict(workload=workload, kv=kv, h=h, s_q=args.s_q, s_kv=args.s_kv, topk=args.topk)
            log(f"inputs: workload={workload} h={h} kv={kv}")
            try:
                inputs = bench.make_inputs(case)
            except Exception as err:  # noqa: BLE001 -- record and go on
                msg = f"{type(err).__name__}: {err}"
                print(f"  inputs failed for workload={workload} h={h} kv={kv}: {msg}", file=sys.stderr)
                for method, _, _, kw, _ in runs:
                    n += 1
                    rows.append({**base, "method": method, "config": kw, "error": f"make_inputs: {msg}"})
                _release()
                continue
            for method, name, iclip, kw, cfg in runs:
                n += 1
                what = f"[{n}/{n_total}] {method:<15} {workload} {kv} h={h} {_config_text(kw)}"
                try:
                    row = bench.run_case(inputs, name, importance_clip=iclip, check_rows=args.check_rows, **kw)
                except Exception as err:  # noqa: BLE001 -- a failing configuration is a row, not a crash
                    msg = f"{type(err).__name__}: {err}"
                    rows.append({**base, "method": method, "config": kw, "error": msg})
                    print(f"{what}: ERROR {msg}", file=sys.stderr, flush=True)
                    _release()
                    continue
                rows.append(row)
                log(f"{what}: {row['ms']:.3f} ms  rel_err {row['rel_err']:.1e}")
            del inputs
            _release()
            add_speedups(rows)
            bench.save(rows, out, extra)  # after every input set, so an interrupted run keeps its rows
    finally:
        add_speedups(rows)
        if rows:
            bench.save(rows, out, extra)

    ok_rows = [r for r in rows if "error" not in r]
    err_rows = [r for r in rows if "error" in r]
    print(bench.format_rows(ok_rows))
    sp = [r for r in ok_rows if "speedup" in r and r["method"] != "query_parallel"]
    if sp:
        print("\nspeedup vs query_parallel (fastest query_parallel row of the same workload / kv / h):")
        for r in sp:
            print(f"  {r['method']:<15} {r['workload']:<15} {r['kv']:<5} h={r['h']:<4} {r['speedup']:6.2f}x  "
                  f"({_config_text(r['config'])})")
    bad = [r for r in ok_rows if not r["method"].endswith("+iclip")
           and not (r["rel_err"] <= TOLERANCE["bf16"])]  # iclip drops rows: approximate by design
    for r in bad:
        print(f"check FAILED: {r['method']} {r['workload']} {r['kv']} h={r['h']}: rel_err {r['rel_err']:.2e} "
              f"> {TOLERANCE['bf16']:g}")
    if err_rows:
        print(f"\n{len(err_rows)} configuration(s) failed:")
        for r in err_rows:
            print(f"  {r['method']:<15} {r['workload']:<15} {r['kv']:<5} h={r['h']:<4} "
                  f"{_config_text(r['config'])}: {r['error']}")
    print(f"\nresults saved to {out}")
    log("done")
    return 1 if (err_rows or bad) else 0


def _release() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -------------------------------------------------------------------------------- report

REPORT_PARTS = ("grid", "overlap", "clip", "layer", "context", "sweep", "breakdown")
REPORT_GPU_PARTS = ("grid", "layer", "context", "sweep", "breakdown")
# clipping study: the recorded size on a GPU machine (it runs on the CPU either way), a small one CPU-only
CLIP_GPU = dict(s_q=256, s_kv=65536, topk=2048, heads=16)
CLIP_CPU = dict(s_q=32, s_kv=8192, topk=512, heads=16)
QUICK_S_Q = 4096  # --quick: queries of every GPU part (a smoke run), the clipping study at CLIP_CPU


class _Part:
    """``with _Part(log, name, estimate_s):`` logs a part's start (with a rough estimate) and its elapsed time."""

    def __init__(self, log: Progress, name: str, estimate_s: float | None = None):
        self.log, self.name, self.estimate_s = log, name, estimate_s

    def __enter__(self):
        self.t0 = self.log.elapsed()
        est = f" (estimate ~{self.estimate_s:.0f} s on an H200)" if self.estimate_s is not None else ""
        self.log(f"part {self.name}: start{est}")
        return self

    def __exit__(self, *exc):
        self.log(f"part {self.name}: {'failed' if exc[0] else 'done'} in {self.log.elapsed() - self.t0:.0f} s")
        return False


def _sweep_kwargs(args, part: str) -> dict:
    """Keyword arguments of ``quilt_attn.sweeps.<part>_rows`` from the report options (``--quick``: s_q 4096)."""
    def s_q(given):
        return given if given is not None else (QUICK_S_Q if args.quick else GPU_SIZES["s_q"])

    common = dict(workload=args.sweeps_workload, topk=GPU_SIZES["topk"], dtype="bf16", device="cuda")
    if part in ("context", "sweep"):
        common["backend"] = args.sweeps_backend
    if part == "context":
        return dict(common, context_lens=tuple(args.context_lens), heads=tuple(args.context_heads),
                    s_q=s_q(args.context_s_q))
    if part == "sweep":
        return dict(common, group_sizes=tuple(args.sweep_group_sizes), thresholds=tuple(args.sweep_thresholds),
                    h=args.sweep_heads, s_q=s_q(args.sweep_s_q), s_kv=args.sweep_s_kv)
    return dict(common, heads=tuple(args.breakdown_heads), s_q=s_q(args.breakdown_s_q), s_kv=GPU_SIZES["s_kv"])


def _report_md(path, env: dict, command: str, sections: dict, skipped: list[str]) -> None:
    from .sweeps import MD, PARTS

    lines = ["# quilt-attn report", "", f"Command: `{command}`", "",
             f"GPU: {env['gpu']}; commit `{env['commit']}`; {env['date']}; versions {env['versions']}.", ""]
    if skipped:
        lines += [f"Skipped (need a CUDA GPU): {', '.join(skipped)}.", ""]
    if "overlap" in sections:
        lines += ["## Overlap profiles of the presets", ""]
        for e in sections["overlap"]:
            lines += [f"### {e['workload']} (s_q {e['s_q']}, s_kv {e['s_kv']}, topk {e['topk']})", "", "```",
                      e["table"], "```", ""]
    if "clip" in sections:
        lines += ["## Importance-aware clipping accuracy (float64 reference, indexer-aligned q / kv)", "",
                  "| workload | tau | s_q / s_kv / topk / h | pairs dropped | dropped mass mean / max | rel-L2 | "
                  "min cosine | tiles saved |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in sections["clip"]:
            lines.append(f"| {r['workload']} | {r['clip_threshold']:g} | {r['s_q']} / {r['s_kv']} / {r['topk']} / "
                         f"{r['heads']} | {r['dropped_pair_fraction']:.2%} | {r['dropped_mass_mean']:.1e} / "
                         f"{r['dropped_mass_max']:.1e} | {r['rel_err']:.1e} | {r['cosine_min']:.5f} | "
                         f"{r['tiles_saved_fraction']:.1%} |")
        lines.append("")
    if "layer" in sections:
        lines += ["## DSA layer proxy (one layer, random weights, no MoE / FFN / communication: "
                  "attention's share of one layer, not TTFT)", "",
                  "| h | workload | method | total ms | attention ms | share | layer speedup vs query-parallel |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for r in sections["layer"]:
            sp = r.get("layer_speedup_vs_query_parallel")
            lines.append(f"| {r['heads']} | {r['workload']} | {r['method']} | {r['stages_ms']['total']:.2f} | "
                         f"{r['stages_ms']['attention']:.2f} | {r['attention_share']:.0%} | "
                         f"{f'{sp:.2f}x' if sp else ''} |")
        lines.append("")
    for part in PARTS:  # quilt_attn.sweeps: sections[part] = (rows, png name or None)
        if part in sections:
            lines += MD[part](*sections[part])
    with open(path, "w") as f:
        f.write("\n".join(lines))


def cmd_report(args, log: Progress) -> int:
    import torch

    from .bench import environment
    from .report import REPO_ROOT, clip_accuracy, overlap_presets, write_benchmarks_md, write_json
    from .sweeps import PARTS as SWEEP_PARTS
    from .sweeps import estimate_seconds, run_part

    gpu = torch.cuda.is_available() and not args.cpu_only
    command = " ".join([PROG, *args.argv])
    parts = [p for p in REPORT_PARTS if p not in (args.skip or [])]
    skipped = [] if gpu else [p for p in parts if p in REPORT_GPU_PARTS]
    parts = [p for p in parts if gpu or p not in REPORT_GPU_PARTS]
    if args.out_dir is None:
        if args.quick:
            raise UsageError("argument --quick: needs --out-dir (a smoke run never writes into benchmarks/results)")
        if not gpu:
            raise UsageError("argument --out-dir: required without a CUDA GPU (a CPU run never writes into the "
                             "repository's benchmarks/results or BENCHMARKS.md)")
        out_dir = REPO_ROOT / "benchmarks" / "results"
    else:
        from pathlib import Path

        out_dir = Path(args.out_dir).resolve()
        recorded = (REPO_ROOT.resolve(), (REPO_ROOT / "benchmarks" / "results").resolve())
        if (not gpu or args.quick) and out_dir in recorded:
            raise UsageError(f"argument --out-dir: a {'quick' if args.quick else 'CPU'} run does not write into "
                             f"{out_dir} (recorded GPU results)")
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"argument --out-dir: {str(out_dir)!r} exists and is not a folder")
    os.makedirs(out_dir, exist_ok=True)
    env = environment()
    meta = dict(env, command=command)
    clip_sizes = dict(CLIP_GPU if gpu and not args.quick else CLIP_CPU)
    clip_sizes.update({k: getattr(args, f"clip_{k}") for k in clip_sizes if getattr(args, f"clip_{k}") is not None})
    log(f"report on {env['gpu']}: parts {', '.join(parts) or 'none'}; skipped {', '.join(skipped) or 'none'}; "
        f"output in {out_dir}")
    sections, written, status, grid_json = {}, [], 0, None

    if "grid" in parts:
        from .bench import format_rows, run_grid

        grid_json = out_dir / f"{gpu_slug(env['gpu'])}.json"
        log(f"benchmark grid -> {grid_json}")
        with _Part(log, "grid"):
            rows = run_grid(str(grid_json), only=args.only, extra={"command": command}, log=log,
                            **({"case_kwargs": {"s_q": QUICK_S_Q}} if args.quick else {}))
        print(format_rows([r for r in rows if "ms" in r]))
        written.append(str(grid_json))
        if any("error" in r for r in rows):
            status = 1

    if "overlap" in parts:
        dev = "cuda" if gpu else "cpu"
        log(f"overlap profiles of {', '.join(args.overlap_workloads)}: s_q={args.overlap_s_q} "
            f"s_kv={args.overlap_s_kv} topk={args.overlap_topk} on {dev}")
        with _Part(log, "overlap"):
            prof = overlap_presets(args.overlap_workloads, s_q=args.overlap_s_q, s_kv=args.overlap_s_kv,
                                   topk=args.overlap_topk, device=dev, plot_dir=None if args.no_plots else out_dir)
        for e in prof:
            print(f"workload: {e['workload']}")
            print(e["table"])
            written += [e["plot"]] if "plot" in e else []
        sections["overlap"] = prof
        path = out_dir / "overlap_presets.json"
        write_json(path, dict(meta, rows=[{k: v for k, v in e.items() if k != "table"} for e in prof]))
        written.append(str(path))

    if "clip" in parts:
        log(f"clipping accuracy: {clip_sizes}, thresholds {args.clip_thresholds}")
        with _Part(log, "clip"):
            rows = clip_accuracy(args.clip_workloads, args.clip_thresholds, log=log, **clip_sizes)
        sections["clip"] = rows
        path = out_dir / ("clip_accuracy.json" if gpu else "clip_accuracy_small.json")
        write_json(path, dict(meta, rows=rows))
        written.append(str(path))

    if "layer" in parts:
        from .layer import layer_proxy

        log(f"DSA layer proxy: heads {args.layer_heads}, query_parallel vs quilt, {args.layer_indexer} indexer")
        with _Part(log, "layer"):
            rows = layer_proxy(heads=args.layer_heads, workloads=args.layer_workloads, reps=args.layer_reps, log=log,
                               indexer=args.layer_indexer, **({"s_q": QUICK_S_Q} if args.quick else {}))
        sections["layer"] = rows
        path = out_dir / "layer_proxy.json"
        write_json(path, dict(meta, rows=rows))
        written.append(str(path))

    for part in SWEEP_PARTS:  # quilt_attn.sweeps: context lengths, group x threshold sweep, time breakdown
        if part not in parts:
            continue
        kw = _sweep_kwargs(args, part)
        sizes = {k: v for k, v in kw.items() if k not in ("workload", "dtype", "device")}
        log(f"{part}: {sizes}")
        with _Part(log, part, estimate_seconds(part, **sizes)):
            rows, files = run_part(part, out_dir, meta, plots=not args.no_plots, log=log, **kw)
        sections[part] = (rows, os.path.basename(files[1]) if len(files) > 1 else None)
        written += files
        if any("error" in r for r in rows):
            status = 1

    if grid_json is not None:  # after the sweeps: BENCHMARKS.md shows those recorded next to the grid
        if args.no_benchmarks_md or args.only or args.quick:
            log("BENCHMARKS.md not written (--no-benchmarks-md, --quick, or a partial grid with --only)")
        else:
            target = write_benchmarks_md(str(grid_json))
            written.append(str(target))
            print(f"{target} written")

    md = out_dir / "report.md"
    _report_md(md, env, command, sections, skipped)
    written.append(str(md))
    index = out_dir / "report.json"
    write_json(index, dict(meta, parts=parts, skipped_need_gpu=skipped, files=written))
    if skipped:
        print(f"skipped (need a CUDA GPU): {', '.join(skipped)}")
    print(f"report written to {out_dir}: {', '.join(os.path.basename(w) for w in written + [str(index)])}")
    log("done")
    return status


# -------------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .workloads import INDEXER_WORKLOADS, WORKLOADS

    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog=PROG, formatter_class=fmt,
        description="QUILT: shared-query execution for top-K sparse-attention prefill "
                    "(DeepSeek-V3.2 / GLM-5 MLA), Triton kernels.",
        epilog="Run '%(prog)s COMMAND --help' for the options of a command. Without a CUDA device the "
               "kernels run in Triton's interpreter: quilt-attn sets TRITON_INTERPRET=1 itself when it is "
               "unset (interpreter timings mean nothing).")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def common(sp):
        sp.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr")

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
    sp.add_argument("--group-sizes", type=_int_list, default=[2, 4, 8, 16], metavar="G,G,...",
                    help="group sizes to report, powers of two in [1, 16] (default: 2,4,8,16)")
    sp.add_argument("--cascade-group", type=_group, default=8, metavar="C",
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
    pg.add_argument("--group-size", type=_group, default=8, metavar="G",
                    help="queries a group, power of two in [1, 16] (default: 8)")
    pg.add_argument("--tile", type=_pos_int, default=64, metavar="T", help="kv rows a tile (default: 64)")
    pg.add_argument("--clip-threshold", type=_unit_float, default=0.5, metavar="TAU",
                    help="tile-aware clipping threshold in [0, 1]: a segment tail of r < TAU * tile rows is "
                         "pushed down a level instead of padded (default: 0.5)")
    pg.add_argument("--importance-clip", action="store_true",
                    help="drop each query's lowest-ranked private tail rows that would fill a last tile below "
                         "the threshold (approximate; needs --merge-level 1)")
    pg.add_argument("--merge-level", type=_pow2, default=1, metavar="M",
                    help="the cascade stops at blocks of M members; smaller sharing and private rows are packed "
                         "into member-masked tiles of the block (default: 1 = full cascade; the kernels use the "
                         "queries a program holds, 64 // heads)")
    pg.add_argument("--method", choices=("bitmap", "sort"), default="bitmap",
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
    sp.add_argument("--s-q", type=_pos_int, metavar="N",
                    help=f"queries (default: {g_['s_q']} on a GPU, {c_['s_q']} on the CPU)")
    sp.add_argument("--s-kv", type=_pos_int, metavar="N",
                    help=f"context length (default: {g_['s_kv']} on a GPU, {c_['s_kv']} on the CPU)")
    sp.add_argument("--topk", type=_pos_int, metavar="K",
                    help=f"selected kv rows per query (default: {g_['topk']} on a GPU, {c_['topk']} on the CPU)")
    sp.add_argument("--heads", type=_pos_int, metavar="H",
                    help=f"query heads, 1..128 (default: {g_['heads']} on a GPU, {c_['heads']} on the CPU)")
    sp.add_argument("--d-v", type=_pow2, metavar="D",
                    help=f"value / latent width, power of two >= 16 (default: {g_['d_v']} on a GPU, "
                         f"{c_['d_v']} on the CPU)")
    sp.add_argument("--d-rope", type=_pow2, metavar="D",
                    help=f"rope width, power of two >= 16; d_qk = d_v + d_rope (default: {g_['d_rope']} on a GPU, "
                         f"{c_['d_rope']} on the CPU)")
    sp.add_argument("--dtype", choices=("bf16", "fp16"),
                    help="q / kv dtype (default: bf16 on a GPU, fp16 on the CPU)")
    sp.add_argument("--seed", type=_nonneg_int, default=0, help="seed of the workload and of q / kv (default: 0)")
    sp.add_argument("--group-size", type=_group, metavar="G",
                    help="QUILT group size, power of two in [1, 16] (default: the queries one kernel program "
                         "holds, 64 // heads, at most 8; 8 from 64 heads)")
    sp.add_argument("--tile", type=_pow2, metavar="T",
                    help=f"kv rows a plan tile, power of two >= 16 (default: {g_['tile']} on a GPU, "
                         f"{c_['tile']} on the CPU)")
    sp.add_argument("--clip-threshold", type=_unit_float, default=0.5, metavar="TAU",
                    help="tile-aware clipping threshold in [0, 1] (default: 0.5)")
    sp.add_argument("--merge-level", type=_pow2, metavar="M",
                    help="where the cascade stops (default: the queries one kernel program holds, 64 // heads)")
    sp.add_argument("--check-rows", type=_pos_int, default=256, metavar="N",
                    help="queries sampled for the float32 reference check (default: 256)")
    sp.add_argument("--warmup", type=_pos_int, default=25, metavar="MS", help="do_bench warmup, GPU (default: 25)")
    sp.add_argument("--rep", type=_pos_int, default=100, metavar="MS",
                    help="do_bench repetition time, GPU (default: 100)")
    sp.add_argument("--backend", choices=("auto", "triton", "cuda"), default="auto",
                    help="kernel backend (default: auto = the sm_90a CUDA kernel where it runs, else Triton)")
    common(sp)
    sp.set_defaults(func=cmd_demo)

    # bench
    sp = sub.add_parser(
        "bench", formatter_class=fmt, help="GPU benchmark grid (quilt_attn.bench), saved as JSON",
        description="Time the kernels over a grid of workloads x heads x kv formats x methods x configs "
                    "(quilt_attn.bench: inputs built outside the timed region, do_bench medians, every "
                    "configuration checked against the float32 reference). A failing configuration is printed "
                    "and recorded as an error row; the run goes on. Rows get speedup = query_parallel ms / ms. "
                    "Needs a CUDA GPU (exit 2 without one). Exit code 1 when a configuration failed or missed "
                    "the bf16 tolerance.")
    sp.add_argument("--heads", type=_int_list, default=[8, 16, 32, 64, 128], metavar="H,H,...",
                    help="head counts (default: 8,16,32,64,128)")
    sp.add_argument("--workloads", type=_choice_list(WORKLOADS),
                    default=["glm53-like", "ds32-like", "qasper-like", "random"], metavar="W,W,...",
                    help=f"workloads, from: {', '.join(WORKLOADS)} (default: glm53-like,ds32-like,qasper-like,random)")
    sp.add_argument("--kv", type=_choice_list(BENCH_KV), default=list(BENCH_KV), metavar="F,F,...",
                    help="kv cache formats: bf16 (dense) and/or fp8 (656-byte FlashMLA rows) (default: bf16,fp8)")
    sp.add_argument("--methods", type=_choice_list(BENCH_METHODS), default=list(BENCH_METHODS), metavar="M,M,...",
                    help="methods: query_parallel, quilt, quilt+iclip (quilt with importance-aware clipping, "
                         "approximate) (default: all three)")
    sp.add_argument("--s-q", type=_pos_int, default=GPU_SIZES["s_q"], metavar="N",
                    help=f"queries (default: {GPU_SIZES['s_q']})")
    sp.add_argument("--s-kv", type=_pos_int, default=GPU_SIZES["s_kv"], metavar="N",
                    help=f"context length (default: {GPU_SIZES['s_kv']})")
    sp.add_argument("--topk", type=_pos_int, default=GPU_SIZES["topk"], metavar="K",
                    help=f"selected kv rows per query (default: {GPU_SIZES['topk']})")
    sp.add_argument("--seed", type=_nonneg_int, default=0, help="workload and input seed (default: 0)")
    sp.add_argument("--configs", type=_bench_config, nargs="+", metavar="KEY=V[,KEY=V]",
                    help="kernel / planner configurations to try, each a comma list of key=value with keys "
                         f"{', '.join(BENCH_CONFIG_KEYS)} (run_case keyword arguments; planner keys are ignored "
                         "for query_parallel), e.g. --configs num_warps=8,num_stages=2 num_warps=4,dv_split=2 "
                         "(default: one configuration, run_case's defaults)")
    sp.add_argument("--check-rows", type=_pos_int, default=256, metavar="N",
                    help="queries checked against the reference per configuration (default: 256)")
    sp.add_argument("--out", metavar="PATH",
                    help="JSON results (default: benchmarks/results/<gpu-slug>.json, e.g. nvidia-h200.json); "
                         "written after every input set and at the end, with GPU, commit and versions")
    common(sp)
    sp.set_defaults(func=cmd_bench)

    # report
    from . import sweeps
    from .report import OVERLAP_PRESETS

    def unit_floats(text: str) -> list[float]:
        return [_unit_float(x.strip()) for x in text.split(",") if x.strip()]

    def groups(text: str) -> list[int]:
        return [_group(x.strip()) for x in text.split(",") if x.strip()]

    def csv(values) -> str:
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)

    sp = sub.add_parser(
        "report", formatter_class=fmt, help="benchmark grid, overlap, clipping accuracy, layer proxy; BENCHMARKS.md",
        description="Run the project's evaluation and write it to --out-dir (JSON with command, GPU, commit and "
                    "versions; report.md; plots).\n\n"
                    "With a CUDA GPU: the benchmark grid (quilt_attn.bench.GRID, as benchmarks/run_grid.py), the "
                    "overlap profiles of the presets, the importance-clipping accuracy study (as "
                    "benchmarks/clip_accuracy.py; float64 on the CPU), and the DSA layer proxy "
                    "(quilt_attn.layer: one layer, random weights, query_parallel vs quilt with preset indices); "
                    "the sweeps of quilt_attn.sweeps: context (latency and kv tiles by context length), sweep "
                    "(QUILT group size x tile-aware clipping threshold, fallback off), breakdown (where the "
                    "query-parallel kernel's time goes: kv load + gather, FP8 dequant, compute, from variants "
                    "that leave a stage out); each writes a JSON and a PNG; then BENCHMARKS.md from the grid and "
                    "the sweeps (as benchmarks/make_benchmarks_md.py; hand-written text below its marker is "
                    "kept). Default --out-dir there: benchmarks/results. --quick shrinks every GPU part to "
                    f"s_q {QUICK_S_Q} (and the clipping study to its CPU size) for a smoke run.\n"
                    "Without one (or with --cpu-only): only the overlap profiles and the clipping study at a small "
                    f"size (s_q {CLIP_CPU['s_q']}, s_kv {CLIP_CPU['s_kv']}, topk {CLIP_CPU['topk']}); the GPU "
                    "parts are listed as skipped; --out-dir is required and BENCHMARKS.md and benchmarks/results "
                    "are never written.\n\nExit code 1 when a configuration of the grid or of a sweep failed.")
    sp.add_argument("--out-dir", metavar="DIR", help="output folder (required without a GPU; default on a GPU: "
                                                     "benchmarks/results)")
    sp.add_argument("--cpu-only", action="store_true", help="run the CPU parts only, even with a GPU")
    sp.add_argument("--skip", type=_choice_list(REPORT_PARTS), metavar="P,P,...",
                    help=f"parts to leave out, from: {', '.join(REPORT_PARTS)}")
    sp.add_argument("--only", type=_choice_list(WORKLOADS), metavar="W,W,...",
                    help="grid: keep these workloads (a partial grid does not rewrite BENCHMARKS.md)")
    sp.add_argument("--no-benchmarks-md", action="store_true", help="GPU: do not rewrite BENCHMARKS.md")
    sp.add_argument("--no-plots", action="store_true", help="no PNGs (overlap profiles, sweeps)")
    sp.add_argument("--quick", action="store_true",
                    help=f"smoke run: every GPU part at s_q {QUICK_S_Q} (sizes given explicitly win), the clipping "
                         "study at its CPU size; needs --out-dir; BENCHMARKS.md is not written")
    og = sp.add_argument_group("overlap profiles")
    og.add_argument("--overlap-workloads", type=_choice_list(WORKLOADS), default=list(OVERLAP_PRESETS),
                    metavar="W,W,...", help=f"(default: {','.join(OVERLAP_PRESETS)})")
    og.add_argument("--overlap-s-q", type=_pos_int, default=CPU_SIZES["s_q"], metavar="N",
                    help=f"(default: {CPU_SIZES['s_q']})")
    og.add_argument("--overlap-s-kv", type=_pos_int, default=CPU_SIZES["s_kv"], metavar="N",
                    help=f"(default: {CPU_SIZES['s_kv']})")
    og.add_argument("--overlap-topk", type=_pos_int, default=CPU_SIZES["topk"], metavar="K",
                    help=f"(default: {CPU_SIZES['topk']})")
    cg = sp.add_argument_group("clipping accuracy")
    cg.add_argument("--clip-workloads", type=_choice_list(INDEXER_WORKLOADS), default=["glm53-like", "ds32-like"],
                    metavar="W,W,...", help=f"indexer-model workloads, from: {', '.join(INDEXER_WORKLOADS)} "
                                            "(q / kv follow their scores) (default: glm53-like,ds32-like)")
    cg.add_argument("--clip-thresholds", type=unit_floats,
                    default=[0.25, 0.5, 0.75, 1.0], metavar="T,T,...", help="(default: 0.25,0.5,0.75,1.0)")
    for k in ("s_q", "s_kv", "topk", "heads"):
        cg.add_argument(f"--clip-{k.replace('_', '-')}", type=_pos_int, metavar="N",
                        help=f"(default: {CLIP_GPU[k]} with a GPU, {CLIP_CPU[k]} without)")
    lg = sp.add_argument_group("layer proxy (GPU)")
    lg.add_argument("--layer-heads", type=_int_list, default=[16, 128], metavar="H,H,...", help="(default: 16,128)")
    lg.add_argument("--layer-workloads", type=_choice_list(WORKLOADS), default=["glm53-like", "ds32-like"],
                    metavar="W,W,...", help="preset indices injected (default: glm53-like,ds32-like)")
    lg.add_argument("--layer-reps", type=_pos_int, default=5, metavar="N", help="timed calls, median (default: 5)")
    lg.add_argument("--layer-indexer", choices=("torch", "triton"), default="torch",
                    help="lightning-indexer scores: the unfused torch reference or the fused Triton kernel "
                         "(quilt_attn.ops.indexer) (default: torch)")
    wg = sp.add_argument_group("sweeps (GPU): context, sweep, breakdown; top-k 2048, bf16, do_bench "
                               f"warmup {sweeps.TIMING['warmup']} / rep {sweeps.TIMING['rep']} ms")
    wg.add_argument("--sweeps-workload", choices=WORKLOADS, default="glm53-like", metavar="W",
                    help="workload of the three sweeps (default: glm53-like)")
    wg.add_argument("--sweeps-backend", choices=("triton", "auto", "cuda"), default="triton",
                    help="sparse_prefill backend of context and sweep (breakdown runs the Triton kernel's "
                         "variants, and on Hopper the CUDA kernel's too) (default: triton)")
    wg.add_argument("--context-lens", type=_int_list, default=list(sweeps.CONTEXT_LENS), metavar="N,N,...",
                    help=f"context: context lengths s_kv (default: {csv(sweeps.CONTEXT_LENS)})")
    wg.add_argument("--context-heads", type=_int_list, default=[16], metavar="H,H,...",
                    help="context: head counts (default: 16)")
    wg.add_argument("--context-s-q", type=_pos_int, metavar="N",
                    help=f"context: queries, capped at each s_kv (default: {GPU_SIZES['s_q']}; --quick {QUICK_S_Q})")
    wg.add_argument("--sweep-group-sizes", type=groups, default=list(sweeps.SWEEP_GROUP_SIZES), metavar="G,G,...",
                    help=f"sweep: group sizes, powers of two in [1, 16] (default: {csv(sweeps.SWEEP_GROUP_SIZES)})")
    wg.add_argument("--sweep-thresholds", type=unit_floats, default=list(sweeps.SWEEP_THRESHOLDS), metavar="T,T,...",
                    help=f"sweep: tile-aware clipping thresholds in [0, 1] (default: {csv(sweeps.SWEEP_THRESHOLDS)})")
    wg.add_argument("--sweep-heads", type=_pos_int, default=16, metavar="H", help="sweep: heads (default: 16)")
    wg.add_argument("--sweep-s-q", type=_pos_int, metavar="N",
                    help=f"sweep: queries (default: {GPU_SIZES['s_q']}; --quick {QUICK_S_Q})")
    wg.add_argument("--sweep-s-kv", type=_pos_int, default=GPU_SIZES["s_kv"], metavar="N",
                    help=f"sweep: context length (default: {GPU_SIZES['s_kv']})")
    wg.add_argument("--breakdown-heads", type=_int_list, default=list(sweeps.BREAKDOWN_HEADS), metavar="H,H,...",
                    help=f"breakdown: head counts (default: {csv(sweeps.BREAKDOWN_HEADS)})")
    wg.add_argument("--breakdown-s-q", type=_pos_int, metavar="N",
                    help=f"breakdown: queries (default: {GPU_SIZES['s_q']}; --quick {QUICK_S_Q})")
    common(sp)
    sp.set_defaults(func=cmd_report)
    return p


def main(argv=None) -> int:
    """Entry point of ``quilt-attn`` / ``python -m quilt_attn``; returns the exit status.

    Sets ``TRITON_INTERPRET=1`` first when there is no CUDA device and the variable is unset
    (see the module docstring).
    """
    _ensure_interpreter()
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    log = Progress(quiet=getattr(args, "quiet", False))
    try:
        return args.func(args, log)
    except UsageError as err:
        print(f"{PROG} {args.command}: error: {err}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, OSError) as err:  # a bad value, file or folder found while running: one line
        msg = " ".join(str(err).split()) or type(err).__name__
        print(f"{PROG} {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
