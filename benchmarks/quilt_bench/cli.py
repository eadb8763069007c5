"""Command line of the benchmark harness: ``quilt-bench`` (or ``python -m quilt_bench``).

Subcommands::

    quilt-bench bench   --heads 16,64 --workloads glm53-like --kv bf16    # GPU only: a grid -> JSON
    quilt-bench report  --out-dir DIR      # evaluation: GPU grid + layer proxy + sweeps (context lengths,
                                           # group x threshold, time breakdown); CPU: overlap profiles +
                                           # clipping study only

BENCHMARKS.md is generated from the recorded result files by ``benchmarks/make_benchmarks_md.py``.

Results go to stdout; progress lines (``[  12.3s] step ...``) go to stderr (``--quiet`` drops them). Nothing is
written inside an installed package: every output path is given, or relative to the current directory. Without a
CUDA device ``main`` sets ``TRITON_INTERPRET=1`` first, as ``quilt-attn`` does (``quilt_attn.cli``).

Exit codes: 0 success; 1 a benchmark configuration failed or missed its tolerance (``bench``) or a grid or sweep
configuration failed (``report``); 2 bad arguments, or no CUDA device for ``bench``, or a ``ValueError`` /
``TypeError`` / ``OSError`` met while running: one line on stderr, no traceback.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path

import torch

from quilt_attn.cli import CPU_SIZES, GPU_SIZES
from quilt_attn.cli_args import (Progress, UsageError, choice_list, group_size_arg, int_list, nonneg_int, pos_int,
                                 new_parser, run_command, unit_float)
from quilt_attn.demo import TOLERANCE

from . import bench, layer, report, sweeps

PROG = "quilt-bench"

BENCH_METHODS = ("query_parallel", "quilt", "quilt+iclip")
BENCH_KV = ("bf16", "fp8")
BENCH_CONFIG_KEYS = {"num_warps": int, "num_stages": int, "dv_split": int, "group_size": int,
                     "merge_level": int, "clip_threshold": float, "backend": str}


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


def gpu_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"``."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


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
    if not torch.cuda.is_available():
        print(f"{PROG} bench: error: bench needs a CUDA GPU (torch.cuda.is_available() is False); it times the "
              f"Triton kernels, which the CPU interpreter cannot do meaningfully. Try 'quilt-attn demo' on the CPU.",
              file=sys.stderr)
        return 2
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
    """Keyword arguments of ``quilt_bench.sweeps.<part>_rows`` from the report options (``--quick``: s_q 4096)."""
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
    for part in sweeps.PARTS:  # quilt_bench.sweeps: sections[part] = (rows, png name or None)
        if part in sections:
            lines += sweeps.MD[part](*sections[part])
    with open(path, "w") as f:
        f.write("\n".join(lines))


def holds_gpu_results(folder: Path) -> bool:
    """Whether ``folder`` holds a result file recorded on a GPU (a JSON whose ``gpu`` is not ``"cpu"``): where a
    CPU or smoke run must not write (it would overwrite recorded plots and tables)."""
    import json

    for path in folder.glob("*.json") if folder.is_dir() else ():
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict) and doc.get("gpu") not in (None, "cpu"):
            return True
    return False


def cmd_report(args, log: Progress) -> int:
    gpu = torch.cuda.is_available() and not args.cpu_only
    command = " ".join([PROG, *args.argv])
    parts = [p for p in REPORT_PARTS if p not in (args.skip or [])]
    skipped = [] if gpu else [p for p in parts if p in REPORT_GPU_PARTS]
    parts = [p for p in parts if gpu or p not in REPORT_GPU_PARTS]
    if args.out_dir is None:
        raise UsageError("argument --out-dir: required: the folder the report's files go to (e.g. "
                         "benchmarks/results for a recorded GPU run)")
    out_dir = Path(args.out_dir).resolve()
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"argument --out-dir: {str(out_dir)!r} exists and is not a folder")
    if (not gpu or args.quick) and holds_gpu_results(out_dir):
        raise UsageError(f"argument --out-dir: a {'quick' if args.quick else 'CPU'} run does not write into "
                         f"{out_dir}: it holds results recorded on a GPU")
    os.makedirs(out_dir, exist_ok=True)
    env = bench.environment()
    meta = dict(env, command=command)
    clip_sizes = dict(CLIP_GPU if gpu and not args.quick else CLIP_CPU)
    clip_sizes.update({k: getattr(args, f"clip_{k}") for k in clip_sizes if getattr(args, f"clip_{k}") is not None})
    log(f"report on {env['gpu']}: parts {', '.join(parts) or 'none'}; skipped {', '.join(skipped) or 'none'}; "
        f"output in {out_dir}")
    sections, written, status, grid_json = {}, [], 0, None

    if "grid" in parts:
        grid_json = out_dir / f"{gpu_slug(env['gpu'])}.json"
        log(f"benchmark grid -> {grid_json}")
        with _Part(log, "grid"):
            rows = bench.run_grid(str(grid_json), only=args.only, extra={"command": command}, log=log,
                            **({"case_kwargs": {"s_q": QUICK_S_Q}} if args.quick else {}))
        print(bench.format_rows([r for r in rows if "ms" in r]))
        written.append(str(grid_json))
        if any("error" in r for r in rows):
            status = 1

    if "overlap" in parts:
        dev = "cuda" if gpu else "cpu"
        log(f"overlap profiles of {', '.join(args.overlap_workloads)}: s_q={args.overlap_s_q} "
            f"s_kv={args.overlap_s_kv} topk={args.overlap_topk} on {dev}")
        with _Part(log, "overlap"):
            prof = report.overlap_presets(args.overlap_workloads, s_q=args.overlap_s_q, s_kv=args.overlap_s_kv,
                                   topk=args.overlap_topk, device=dev, plot_dir=None if args.no_plots else out_dir)
        for e in prof:
            print(f"workload: {e['workload']}")
            print(e["table"])
            written += [e["plot"]] if "plot" in e else []
        sections["overlap"] = prof
        path = out_dir / "overlap_presets.json"
        bench.write_json(path, dict(meta, rows=[{k: v for k, v in e.items() if k != "table"} for e in prof]))
        written.append(str(path))

    if "clip" in parts:
        log(f"clipping accuracy: {clip_sizes}, thresholds {args.clip_thresholds}")
        with _Part(log, "clip"):
            rows = report.clip_accuracy(args.clip_workloads, args.clip_thresholds, log=log, **clip_sizes)
        sections["clip"] = rows
        path = out_dir / ("clip_accuracy.json" if gpu else "clip_accuracy_small.json")
        bench.write_json(path, dict(meta, rows=rows))
        written.append(str(path))

    if "layer" in parts:
        log(f"DSA layer proxy: heads {args.layer_heads}, query_parallel vs quilt, {args.layer_indexer} indexer")
        with _Part(log, "layer"):
            rows = layer.layer_proxy(heads=args.layer_heads, workloads=args.layer_workloads, reps=args.layer_reps,
                                     log=log, indexer=args.layer_indexer,
                                     **({"s_q": QUICK_S_Q} if args.quick else {}))
        sections["layer"] = rows
        path = out_dir / "layer_proxy.json"
        bench.write_json(path, dict(meta, rows=rows))
        written.append(str(path))

    for part in sweeps.PARTS:  # quilt_bench.sweeps: context lengths, group x threshold sweep, time breakdown
        if part not in parts:
            continue
        kw = _sweep_kwargs(args, part)
        sizes = {k: v for k, v in kw.items() if k not in ("workload", "dtype", "device")}
        log(f"{part}: {sizes}")
        with _Part(log, part, sweeps.estimate_seconds(part, **sizes)):
            rows, files = sweeps.run_part(part, out_dir, meta, plots=not args.no_plots, log=log, **kw)
        sections[part] = (rows, os.path.basename(files[1]) if len(files) > 1 else None)
        written += files
        if any("error" in r for r in rows):
            status = 1


    md = out_dir / "report.md"
    _report_md(md, env, command, sections, skipped)
    written.append(str(md))
    index = out_dir / "report.json"
    bench.write_json(index, dict(meta, parts=parts, skipped_need_gpu=skipped, files=written))
    if skipped:
        print(f"skipped (need a CUDA GPU): {', '.join(skipped)}")
    print(f"report written to {out_dir}: {', '.join(os.path.basename(w) for w in written + [str(index)])}")
    log("done")
    return status


# -------------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    from quilt_attn.workloads import INDEXER_WORKLOADS, WORKLOADS

    fmt = argparse.RawDescriptionHelpFormatter
    p, sub, common = new_parser(PROG, "The benchmark harness of quilt-attn: GPU benchmark grids and the evaluation "
                                      "report (the named benchmark cases: python benchmarks/run.py --help; "
                                      "BENCHMARKS.md: benchmarks/make_benchmarks_md.py).")

    # bench
    sp = sub.add_parser(
        "bench", formatter_class=fmt, help="GPU benchmark grid (quilt_bench.bench), saved as JSON",
        description="Time the kernels over a grid of workloads x heads x kv formats x methods x configs "
                    "(quilt_bench.bench: inputs built outside the timed region, do_bench medians, every "
                    "configuration checked against the float32 reference). A failing configuration is printed "
                    "and recorded as an error row; the run goes on. Rows get speedup = query_parallel ms / ms. "
                    "Needs a CUDA GPU (exit 2 without one). Exit code 1 when a configuration failed or missed "
                    "the bf16 tolerance.")
    sp.add_argument("--heads", type=int_list, default=[8, 16, 32, 64, 128], metavar="H,H,...",
                    help="head counts (default: 8,16,32,64,128)")
    sp.add_argument("--workloads", type=choice_list(WORKLOADS),
                    default=["glm53-like", "ds32-like", "qasper-like", "random"], metavar="W,W,...",
                    help=f"workloads, from: {', '.join(WORKLOADS)} (default: glm53-like,ds32-like,qasper-like,random)")
    sp.add_argument("--kv", type=choice_list(BENCH_KV), default=list(BENCH_KV), metavar="F,F,...",
                    help="kv cache formats: bf16 (dense) and/or fp8 (656-byte FlashMLA rows) (default: bf16,fp8)")
    sp.add_argument("--methods", type=choice_list(BENCH_METHODS), default=list(BENCH_METHODS), metavar="M,M,...",
                    help="methods: query_parallel, quilt, quilt+iclip (quilt with importance-aware clipping, "
                         "approximate) (default: all three)")
    sp.add_argument("--s-q", type=pos_int, default=GPU_SIZES["s_q"], metavar="N",
                    help=f"queries (default: {GPU_SIZES['s_q']})")
    sp.add_argument("--s-kv", type=pos_int, default=GPU_SIZES["s_kv"], metavar="N",
                    help=f"context length (default: {GPU_SIZES['s_kv']})")
    sp.add_argument("--topk", type=pos_int, default=GPU_SIZES["topk"], metavar="K",
                    help=f"selected kv rows per query (default: {GPU_SIZES['topk']})")
    sp.add_argument("--seed", type=nonneg_int, default=0, help="workload and input seed (default: 0)")
    sp.add_argument("--configs", type=_bench_config, nargs="+", metavar="KEY=V[,KEY=V]",
                    help="kernel / planner configurations to try, each a comma list of key=value with keys "
                         f"{', '.join(BENCH_CONFIG_KEYS)} (run_case keyword arguments; planner keys are ignored "
                         "for query_parallel), e.g. --configs num_warps=8,num_stages=2 num_warps=4,dv_split=2 "
                         "(default: one configuration, run_case's defaults)")
    sp.add_argument("--check-rows", type=pos_int, default=256, metavar="N",
                    help="queries checked against the reference per configuration (default: 256)")
    sp.add_argument("--out", metavar="PATH",
                    help="JSON results (default: benchmarks/results/<gpu-slug>.json, e.g. nvidia-h200.json); "
                         "written after every input set and at the end, with GPU, commit and versions")
    common(sp)
    sp.set_defaults(func=cmd_bench)

    # report
    def unit_floats(text: str) -> list[float]:
        return [unit_float(x.strip()) for x in text.split(",") if x.strip()]

    def groups(text: str) -> list[int]:
        return [group_size_arg(x.strip()) for x in text.split(",") if x.strip()]

    def csv(values) -> str:
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)

    sp = sub.add_parser(
        "report", formatter_class=fmt, help="benchmark grid, overlap, clipping accuracy, layer proxy, sweeps",
        description="Run the project's evaluation and write it to --out-dir (JSON with command, GPU, commit and "
                    "versions; report.md; plots).\n\n"
                    "With a CUDA GPU: the benchmark grid (quilt_bench.bench.GRID, as benchmarks/run.py grid), the "
                    "overlap profiles of the presets, the importance-clipping accuracy study (float64 on the "
                    "CPU), and the DSA layer proxy (quilt_bench.layer: one layer, random weights, query_parallel "
                    "vs quilt with preset indices); the sweeps of quilt_bench.sweeps: context (latency and kv "
                    "tiles by context length), sweep (QUILT group size x tile-aware clipping threshold, fallback "
                    "off), breakdown (where the query-parallel kernel's time goes: kv load + gather, FP8 dequant, "
                    "compute, from variants that leave a stage out); each writes a JSON and a PNG (BENCHMARKS.md "
                    "is then regenerated from them by benchmarks/make_benchmarks_md.py). --quick shrinks every "
                    "GPU part to "
                    f"s_q {QUICK_S_Q} (and the clipping study to its CPU size) for a smoke run.\n"
                    "Without one (or with --cpu-only): only the overlap profiles and the clipping study at a small "
                    f"size (s_q {CLIP_CPU['s_q']}, s_kv {CLIP_CPU['s_kv']}, topk {CLIP_CPU['topk']}); the GPU "
                    "parts are listed as skipped. A CPU or quick run refuses an --out-dir that holds results "
                    "recorded on a GPU.\n\nExit code 1 when a configuration of the grid or of a sweep failed.")
    sp.add_argument("--out-dir", metavar="DIR", help="output folder (required; e.g. benchmarks/results for a "
                                                     "recorded GPU run)")
    sp.add_argument("--cpu-only", action="store_true", help="run the CPU parts only, even with a GPU")
    sp.add_argument("--skip", type=choice_list(REPORT_PARTS), metavar="P,P,...",
                    help=f"parts to leave out, from: {', '.join(REPORT_PARTS)}")
    sp.add_argument("--only", type=choice_list(WORKLOADS), metavar="W,W,...",
                    help="grid: keep these workloads")
    sp.add_argument("--no-plots", action="store_true", help="no PNGs (overlap profiles, sweeps)")
    sp.add_argument("--quick", action="store_true",
                    help=f"smoke run: every GPU part at s_q {QUICK_S_Q} (sizes given explicitly win), the clipping "
                         "study at its CPU size")
    og = sp.add_argument_group("overlap profiles")
    og.add_argument("--overlap-workloads", type=choice_list(WORKLOADS), default=list(report.OVERLAP_PRESETS),
                    metavar="W,W,...", help=f"(default: {','.join(report.OVERLAP_PRESETS)})")
    og.add_argument("--overlap-s-q", type=pos_int, default=CPU_SIZES["s_q"], metavar="N",
                    help=f"(default: {CPU_SIZES['s_q']})")
    og.add_argument("--overlap-s-kv", type=pos_int, default=CPU_SIZES["s_kv"], metavar="N",
                    help=f"(default: {CPU_SIZES['s_kv']})")
    og.add_argument("--overlap-topk", type=pos_int, default=CPU_SIZES["topk"], metavar="K",
                    help=f"(default: {CPU_SIZES['topk']})")
    cg = sp.add_argument_group("clipping accuracy")
    cg.add_argument("--clip-workloads", type=choice_list(INDEXER_WORKLOADS), default=["glm53-like", "ds32-like"],
                    metavar="W,W,...", help=f"indexer-model workloads, from: {', '.join(INDEXER_WORKLOADS)} "
                                            "(q / kv follow their scores) (default: glm53-like,ds32-like)")
    cg.add_argument("--clip-thresholds", type=unit_floats,
                    default=[0.25, 0.5, 0.75, 1.0], metavar="T,T,...", help="(default: 0.25,0.5,0.75,1.0)")
    for k in ("s_q", "s_kv", "topk", "heads"):
        cg.add_argument(f"--clip-{k.replace('_', '-')}", type=pos_int, metavar="N",
                        help=f"(default: {CLIP_GPU[k]} with a GPU, {CLIP_CPU[k]} without)")
    lg = sp.add_argument_group("layer proxy (GPU)")
    lg.add_argument("--layer-heads", type=int_list, default=[16, 128], metavar="H,H,...", help="(default: 16,128)")
    lg.add_argument("--layer-workloads", type=choice_list(WORKLOADS), default=["glm53-like", "ds32-like"],
                    metavar="W,W,...", help="preset indices injected (default: glm53-like,ds32-like)")
    lg.add_argument("--layer-reps", type=pos_int, default=5, metavar="N", help="timed calls, median (default: 5)")
    lg.add_argument("--layer-indexer", choices=("torch", "triton"), default="torch",
                    help="lightning-indexer scores: the unfused torch reference or the fused Triton kernel "
                         "(quilt_bench.indexer) (default: torch)")
    wg = sp.add_argument_group("sweeps (GPU): context, sweep, breakdown; top-k 2048, bf16, do_bench "
                               f"warmup {sweeps.TIMING['warmup']} / rep {sweeps.TIMING['rep']} ms")
    wg.add_argument("--sweeps-workload", choices=WORKLOADS, default="glm53-like", metavar="W",
                    help="workload of the three sweeps (default: glm53-like)")
    wg.add_argument("--sweeps-backend", choices=("triton", "auto", "cuda"), default="triton",
                    help="sparse_prefill backend of context and sweep (breakdown runs the Triton kernel's "
                         "variants, and on Hopper the CUDA kernel's too) (default: triton)")
    wg.add_argument("--context-lens", type=int_list, default=list(sweeps.CONTEXT_LENS), metavar="N,N,...",
                    help=f"context: context lengths s_kv (default: {csv(sweeps.CONTEXT_LENS)})")
    wg.add_argument("--context-heads", type=int_list, default=[16], metavar="H,H,...",
                    help="context: head counts (default: 16)")
    wg.add_argument("--context-s-q", type=pos_int, metavar="N",
                    help=f"context: queries, capped at each s_kv (default: {GPU_SIZES['s_q']}; --quick {QUICK_S_Q})")
    wg.add_argument("--sweep-group-sizes", type=groups, default=list(sweeps.SWEEP_GROUP_SIZES), metavar="G,G,...",
                    help=f"sweep: group sizes, powers of two in [1, 16] (default: {csv(sweeps.SWEEP_GROUP_SIZES)})")
    wg.add_argument("--sweep-thresholds", type=unit_floats, default=list(sweeps.SWEEP_THRESHOLDS), metavar="T,T,...",
                    help=f"sweep: tile-aware clipping thresholds in [0, 1] (default: {csv(sweeps.SWEEP_THRESHOLDS)})")
    wg.add_argument("--sweep-heads", type=pos_int, default=16, metavar="H", help="sweep: heads (default: 16)")
    wg.add_argument("--sweep-s-q", type=pos_int, metavar="N",
                    help=f"sweep: queries (default: {GPU_SIZES['s_q']}; --quick {QUICK_S_Q})")
    wg.add_argument("--sweep-s-kv", type=pos_int, default=GPU_SIZES["s_kv"], metavar="N",
                    help=f"sweep: context length (default: {GPU_SIZES['s_kv']})")
    wg.add_argument("--breakdown-heads", type=int_list, default=list(sweeps.BREAKDOWN_HEADS), metavar="H,H,...",
                    help=f"breakdown: head counts (default: {csv(sweeps.BREAKDOWN_HEADS)})")
    wg.add_argument("--breakdown-s-q", type=pos_int, metavar="N",
                    help=f"breakdown: queries (default: {GPU_SIZES['s_q']}; --quick {QUICK_S_Q})")
    common(sp)
    sp.set_defaults(func=cmd_report)
    return p


def main(argv=None) -> int:
    """Entry point of ``quilt-bench`` / ``python -m quilt_bench``; returns the exit status.

    Sets ``TRITON_INTERPRET=1`` first when there is no CUDA device and the variable is unset.
    """
    return run_command(PROG, build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
