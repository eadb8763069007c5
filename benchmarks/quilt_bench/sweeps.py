"""Paper-style evaluation sweeps of ``quilt-bench report`` (GPU parts; on the CPU they run through
Triton's interpreter, at tiny sizes, for the tests).

* ``context``: kernel latency and processed kv tiles by method over context lengths ``s_kv``
  (the queries are the last ``s_q`` tokens of the context).
* ``sweep``: QUILT group size x tile-aware clipping threshold: latency, planner time, tiles, tile
  utilization and kv-row reduction (the plan statistics are kept even when a timing fails).
* ``breakdown``: where the query-parallel kernel's time goes (the paper's Figure 2: kv loading and
  dequantization), measured by variants that leave a stage out: FP8 cache (dequantization),
  contiguous indices (no scattered gather), no kv loads at all (compute + softmax only). Where the
  CUDA backend runs (Hopper), the CUDA kernel's own stage variants are added (``cuda_breakdown_rows``:
  the same launch without the kv gather and / or the matrix products).

Each part has ``<part>_rows(...)`` (measure; returns rows), ``plot_<part>(rows, png)``,
``<part>_md(rows, png)`` (markdown lines, for report.md) and
``run_<part>(out_dir, meta, ...)``, which does all three and writes ``<FILES[part]>.json`` / ``.png``.
Timings reuse ``quilt_bench.bench`` (``make_inputs``, ``run_case``: do_bench median, every timed
configuration but the no-kv-load one checked against the float32 reference in the same run).
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import torch

from . import bench
from .bench import Case, Inputs, make_inputs, run_case_or_error, write_json

PARTS = ("context", "sweep", "breakdown")
FILES = {"context": "context_lengths", "sweep": "group_clip_sweep", "breakdown": "kernel_breakdown"}
CONTEXT_LENS = (8192, 32768, 65536, 131072)
SWEEP_GROUP_SIZES = (2, 4, 8, 16)
SWEEP_THRESHOLDS = (0.0, 0.25, 0.5, 0.75, 1.0)
BREAKDOWN_HEADS = (16, 64)
# do_bench budgets (ms) of the sweeps: ~40 timed points, so shorter than the grid's 50 / 300
TIMING = dict(warmup=25, rep=100)
BREAKDOWN_VARIANTS = {
    "full": "query-parallel, workload indices, dense kv",
    "fp8": "query-parallel, workload indices, FP8 cache (656-byte rows dequantized on load, fp8_expand=False)",
    "contiguous": "query-parallel, each query's own window of topk rows ending at its position (no scattered gather)",
    "no_kv_load": "query-parallel, no kv loads: synthetic tiles from registers (compute + softmax + index reads)",
}
NOT_CHECKED = "not applicable: synthetic kv tiles, outputs meaningless"
# The CUDA kernel's stage variants: the launch's measurement-only ``_skip`` code and what it leaves out
CUDA_BREAKDOWN_VARIANTS = {
    "cuda_full": (0, "the CUDA kernel as it runs"),
    "cuda_no_gather": (1, "no kv gather (the tiles hold whatever shared memory held)"),
    "cuda_no_matmul": (2, "no QK / PV matrix products (softmax on zeros)"),
    "cuda_neither": (3, "neither: barriers, softmax, index loads, epilogue"),
}
CUDA_NOT_CHECKED = "not applicable: a stage left out, outputs meaningless"


def backend_kwargs(backend: str = "triton") -> dict:
    """``run_case`` keywords that select ``sparse_prefill``'s backend (``"triton"``, ``"auto"``, ``"cuda"``).

    Pinning one backend keeps a sweep's rows comparable (query-parallel and QUILT on the same kernel family).
    """
    return {"backend": backend}


def _log(log):
    return log or (lambda msg: None)


def _release() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _inputs(case: Case, methods, device, log) -> tuple[Inputs | None, list[dict]]:
    """``make_inputs(case)``, or ``(None, one error row per method)`` when building them fails."""
    try:
        return make_inputs(case, device=device), []
    except Exception as e:  # e.g. out of memory at a long context: recorded, the sweep goes on
        err = f"make_inputs: {type(e).__name__}: {e}"[:400]
        _log(log)(f"ERROR {case}: {err}")
        return None, [{"method": m, "workload": case.workload, "kv": case.kv, "h": case.h, "s_q": case.s_q,
                       "s_kv": case.s_kv, "topk": case.topk, "error": err} for m in methods]


def _speedups(rows: list[dict], keys: tuple[str, ...]) -> None:
    """``speedup_vs_query_parallel`` on successful rows that have a query-parallel row with the same ``keys``."""
    base = {tuple(r[k] for k in keys): r["ms"] for r in rows if r.get("method") == "query_parallel" and "ms" in r}
    for r in rows:
        b = base.get(tuple(r.get(k) for k in keys))
        if "ms" in r and b and r.get("method") != "query_parallel":
            r["speedup_vs_query_parallel"] = b / r["ms"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, png) -> str:
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    _pyplot().close(fig)
    return str(png)


def _fmt(x, spec: str) -> str:
    return format(x, spec) if isinstance(x, (int, float)) else ""


def _image(png) -> list[str]:
    return [f"![]({png})", ""] if png else []


# ----------------------------------------------------------------------------- rough estimates

def estimate_seconds(part: str, **sizes) -> float:
    """A rough H200 wall-time estimate of one part (for the progress log, not a promise).

    Model: building an input set ~1.5 s per 16384 x 65536 (workload generation), a timed point
    ~1 s (check, do_bench with ``TIMING``, planning), a first Triton compilation ~6 s.
    """
    def inputs(s_q, s_kv):
        return 0.5 + 1.5 * (s_q / 16384) * (s_kv / 65536)

    s_q = sizes.get("s_q", 16384)
    if part == "context":
        lens, heads = sizes.get("context_lens", CONTEXT_LENS), sizes.get("heads", (16,))
        return sum(len(heads) * (inputs(min(s_q, n), n) + 2 * 1.0) for n in lens)
    if part == "sweep":
        g, t = sizes.get("group_sizes", SWEEP_GROUP_SIZES), sizes.get("thresholds", SWEEP_THRESHOLDS)
        return inputs(s_q, sizes.get("s_kv", 65536)) + (1 + len(g) * len(t)) * 1.2 + 6 * len(g)
    if part == "breakdown":  # (+ the CUDA kernel's four variants where it runs: inputs, a build, 4 points)
        heads = sizes.get("heads", BREAKDOWN_HEADS)
        return sum(2 * inputs(s_q, sizes.get("s_kv", 65536)) + 8 * 1.5 * max(1, h / 16) ** 0.5 + 12 for h in heads)
    raise ValueError(f"part must be one of {PARTS}, got {part!r}")


# ------------------------------------------------------------------------------------ context

def context_rows(context_lens=CONTEXT_LENS, heads=(16,), *, workload: str = "glm53-like", s_q: int = 16384,
                 topk: int = 2048, methods=("query_parallel", "quilt"), dtype: str = "bf16", device="cuda",
                 check_rows: int = 256, timing: dict | None = None, backend: str = "triton",
                 log=None) -> list[dict]:
    """Latency and processed kv tiles by method for each context length ``s_kv`` in ``context_lens``.

    The queries are the last ``min(s_q, s_kv)`` tokens of the context (``bench.Case``), q
    ``[s_q, h, 576]``, kv ``[s_kv, 576]`` of ``dtype``, indices int32 ``[s_q, topk]`` of ``workload``.
    Rows are ``bench.run_case`` rows (``ms``, ``kv_tiles``, ``rel_err``, plan statistics for quilt)
    plus ``ms_per_1k_queries`` and ``kv_tiles_per_query`` (comparable when ``s_q`` was capped at
    ``s_kv``) and ``speedup_vs_query_parallel``; a failing point is an error row. ``backend``: of
    ``sparse_prefill`` (``backend_kwargs``), recorded in each row's ``config``.
    """
    log, rows, t0 = _log(log), [], time.time()
    for s_kv in context_lens:
        for h in heads:
            case = Case(workload, h, s_q=min(s_q, s_kv), s_kv=s_kv, topk=topk, dtype=dtype)
            inp, errors = _inputs(case, methods, device, log)
            rows += errors
            for m in methods if inp is not None else ():
                r = run_case_or_error(inp, m, log=log, check_rows=check_rows, **backend_kwargs(backend),
                                      **(timing or TIMING))
                if "ms" in r:
                    r.update(ms_per_1k_queries=r["ms"] * 1024 / case.s_q, kv_tiles_per_query=r["kv_tiles"] / case.s_q)
                    log(f"[{time.time() - t0:6.1f}s] context s_kv={s_kv} h={h} {m}: {r['ms']:.3f} ms, "
                        f"{r['kv_tiles']} kv tiles, rel_err {r['rel_err']:.1e}")
                rows.append(r)
            del inp
            _release()
    _speedups(rows, ("s_kv", "h"))
    return rows


def plot_context(rows: list[dict], png) -> str:
    """Two panels over s_kv (log 2): ms per 1024 queries, and kv tiles a query, one line per (method, h)."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    good = [r for r in rows if "ms" in r]
    for key in sorted({(r["method"], r["h"]) for r in good}):
        pts = sorted((r["s_kv"], r["ms_per_1k_queries"], r["kv_tiles_per_query"]) for r in good
                     if (r["method"], r["h"]) == key)
        style = "o--" if key[0] == "query_parallel" else "o-"
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{key[0]} h={key[1]}")
        ax2.plot([p[0] for p in pts], [p[2] for p in pts], style, label=f"{key[0]} h={key[1]}")
    for ax, what in ((ax1, "ms per 1024 queries"), (ax2, "kv tiles (64 rows) per query")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length s_kv")
        ax.set_ylabel(what)
        ax.legend(fontsize=7)
    wl = good[0]["workload"] if good else ""
    fig.suptitle(f"sparse prefill by context length ({wl}, top-{good[0]['topk'] if good else ''})", fontsize=10)
    return _save(fig, png)


def context_md(rows: list[dict], png=None) -> list[str]:
    lines = ["## Latency by context length", "",
             "Queries are the last s_q tokens of the context (s_q capped at s_kv); `ms` is the attention "
             "kernel(s) with a prebuilt plan; kv tiles = 64-row tiles gathered (x head blocks).", "",
             "| s_kv | s_q | h | method | ms | ms / 1K queries | kv tiles / query | vs query-parallel | rel_err |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['s_kv']} | {r['s_q']} | {r['h']} | {r['method']} | error: {r['error'][:80]} | | | | |")
            continue
        sp = r.get("speedup_vs_query_parallel")
        lines.append(f"| {r['s_kv']} | {r['s_q']} | {r['h']} | {r['method']} | {r['ms']:.3f} | "
                     f"{r['ms_per_1k_queries']:.3f} | {r['kv_tiles_per_query']:.1f} | {_fmt(sp, '.2f')}"
                     f"{'x' if sp else ''} | {r['rel_err']:.1e} |")
    return lines + [""] + _image(png)


# -------------------------------------------------------------------------------------- sweep

def plan_point(indices: torch.Tensor, *, s_kv: int, h: int, group_size: int, clip_threshold: float) -> dict:
    """Plan statistics of one sweep point, planned as ``bench.run_case`` plans it (tile 64, private
    rows split off, merge level = the queries a program holds, ``program_shape(h, G)``, always <= G),
    and whether the measured tile-cost rule (``sparse_prefill(fallback="cost")``, ``dispatch.quilt_pays_off``)
    would run query-parallel instead."""
    from quilt_attn.dispatch import quilt_pays_off
    from quilt_attn.ops.sparse_attention import program_shape
    from quilt_attn.planner import plan

    merge = program_shape(h, group_size)[0]
    pl = plan(indices, s_kv=s_kv, group_size=group_size, tile=64, clip_threshold=clip_threshold,
              merge_level=merge, split_private=True)
    st = pl.stats
    keep = ("valid_pairs", "rows_processed", "reduction", "tiles", "private_tiles", "tile_utilization",
            "padded_slots", "tiles_per_level")
    return {"merge_level": merge, "would_fall_back": not quilt_pays_off(pl, h),
            **{k: ({str(a): b for a, b in st[k].items()} if k == "tiles_per_level" else st[k]) for k in keep}}


def sweep_rows(group_sizes=SWEEP_GROUP_SIZES, thresholds=SWEEP_THRESHOLDS, *, workload: str = "glm53-like",
               h: int = 16, s_q: int = 16384, s_kv: int = 65536, topk: int = 2048, dtype: str = "bf16",
               device="cuda", check_rows: int = 256, timing: dict | None = None, backend: str = "triton",
               log=None) -> list[dict]:
    """QUILT over group size x tile-aware clipping threshold on one input set (plus one query-parallel row).

    Every point is timed with ``fallback=False`` (``"timed": "quilt kernels"``), so the QUILT kernels
    run even where the tile-cost rule would fall back (``plan["would_fall_back"]`` says where).
    ``plan`` holds the plan statistics of ``plan_point``, computed before the timing, so a failing
    timing still leaves them (its row then carries ``error``). Rows: ``group_size``,
    ``clip_threshold``, ``ms``, ``plan_ms``, ``kv_tiles``, ``tile_utilization``, ``rows_processed``,
    ``reduction``, ``rel_err``, ``speedup_vs_query_parallel``, ``plan``. ``backend``: of
    ``sparse_prefill`` (``backend_kwargs``); the statistics are those of the plan the Triton kernels run.
    """
    log, t0 = _log(log), time.time()
    case = Case(workload, h, s_q=s_q, s_kv=s_kv, topk=topk, dtype=dtype)
    inp, rows = _inputs(case, ["query_parallel"], device, log)
    if inp is None:
        return rows
    kw = dict(log=log, check_rows=check_rows, **backend_kwargs(backend), **(timing or TIMING))
    rows.append(run_case_or_error(inp, "query_parallel", **kw))
    for G in group_sizes:
        for tau in map(float, thresholds):
            try:
                point = {"plan": plan_point(inp.indices, s_kv=s_kv, h=h, group_size=G, clip_threshold=tau)}
            except Exception as e:  # the timing below plans again and records its own error
                point = {"plan": {"error": f"{type(e).__name__}: {e}"[:400]}}
            r = run_case_or_error(inp, "quilt", group_size=G, clip_threshold=tau, fallback=False, **kw)
            r.update(point, group_size=G, clip_threshold=tau, timed="quilt kernels (fallback=False)")
            rows.append(r)
            if "ms" in r:
                log(f"[{time.time() - t0:6.1f}s] sweep G={G} tau={tau:g}: {r['ms']:.3f} ms "
                    f"(plan {r['plan_ms']:.2f} ms), "
                    f"{r['kv_tiles']} tiles, utilization {r['tile_utilization']:.3f}, rel_err {r['rel_err']:.1e}")
    del inp
    _release()
    _speedups(rows, ("h",))
    return rows


def plot_sweep(rows: list[dict], png) -> str:
    """ms and tile utilization by clipping threshold, one line per group size (utilization from the
    plan statistics, drawn even for points whose timing failed)."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    pts = [r for r in rows if r.get("method") == "quilt"]
    for G in sorted({r["group_size"] for r in pts}):
        mine = sorted((r for r in pts if r["group_size"] == G), key=lambda r: r["clip_threshold"])
        timed = [r for r in mine if "ms" in r]
        ax1.plot([r["clip_threshold"] for r in timed], [r["ms"] for r in timed], "o-", label=f"G={G}")
        planned = [r for r in mine if "tile_utilization" in r["plan"]]
        ax2.plot([r["clip_threshold"] for r in planned], [r["plan"]["tile_utilization"] for r in planned], "o-",
                 label=f"G={G}")
    qp = [r["ms"] for r in rows if r.get("method") == "query_parallel" and "ms" in r]
    if qp:
        ax1.axhline(qp[0], color="k", ls=":", label="query-parallel")
    ax1.set_ylabel("ms (QUILT kernels, fallback off)")
    ax2.set_ylabel("tile utilization (shared tiles)")
    for ax in (ax1, ax2):
        ax.set_xlabel("tile-aware clipping threshold tau")
        ax.legend(fontsize=7)
    r0 = pts[0] if pts else {}
    fig.suptitle(f"group size x clipping threshold ({r0.get('workload', '')}, h={r0.get('h', '')}, "
                 f"s_q {r0.get('s_q', '')}, s_kv {r0.get('s_kv', '')})", fontsize=10)
    return _save(fig, png)


def sweep_md(rows: list[dict], png=None) -> list[str]:
    qp = [r for r in rows if r.get("method") == "query_parallel"]
    lines = ["## Group size x tile-aware clipping threshold (QUILT kernels, fallback off)", ""]
    if qp and "ms" in qp[0]:
        lines += [f"Query-parallel on the same input: {qp[0]['ms']:.3f} ms, {qp[0]['kv_tiles']} kv tiles.", ""]
    lines += ["| G | merge | tau | ms | plan ms | vs query-parallel | kv tiles | tile utilization | rows processed | "
              "reduction | default would fall back | rel_err |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if r.get("method") != "quilt":
            continue
        p, sp = r["plan"], r.get("speedup_vs_query_parallel")
        ms = f"{r['ms']:.3f}" if "ms" in r else f"error: {r['error'][:60]}"
        lines.append(f"| {r['group_size']} | {p.get('merge_level', '')} | {r['clip_threshold']:g} | {ms} | "
                     f"{_fmt(r.get('plan_ms'), '.2f')} | {_fmt(sp, '.2f')}{'x' if sp else ''} | "
                     f"{r.get('kv_tiles', '')} | {_fmt(p.get('tile_utilization'), '.3f')} | "
                     f"{p.get('rows_processed', '')} | {_fmt(p.get('reduction'), '.1%')} | "
                     f"{p.get('would_fall_back', '')} | {_fmt(r.get('rel_err'), '.1e')} |")
    return lines + [""] + _image(png)


# ---------------------------------------------------------------------------------- breakdown

def window_indices(s_q: int, s_kv: int, topk: int, device=None) -> torch.Tensor:
    """int32 ``[s_q, topk]``: query ``i`` (position ``p = s_kv - s_q + i``) selects rows
    ``p - topk + 1 .. p`` in ascending order (-1 before row 0): contiguous, causal, its own window."""
    pos = torch.arange(s_kv - s_q, s_kv, device=device)[:, None]
    rows = pos - topk + 1 + torch.arange(topk, device=device)[None, :]
    return torch.where(rows >= 0, rows, -1).to(torch.int32)


def _no_kv_load_row(inp: Inputs, timing: dict) -> dict:
    """Time the query-parallel kernel with ``_skip_kv`` (no kv loads, synthetic tiles); not checked."""
    from quilt_attn.ops.sparse_attention import launch_sparse_attention

    c = inp.case
    q0, kv0 = inp.sets[0]
    scale = q0.shape[-1] ** -0.5

    def call(q, kv):
        return launch_sparse_attention(q, kv, scale, bench.D_V, indices=inp.indices, _skip_kv=True)

    out = call(q0, kv0)[0]  # compiles outside the timing
    ms = bench.time_ms(bench.rotating(inp, call), **timing)
    return {"method": "query_parallel", "backend": "triton", "workload": c.workload, "kv": c.kv, "h": c.h,
            "dtype": c.dtype, "s_q": c.s_q, "s_kv": c.s_kv, "topk": c.topk, "ms": ms,
            "tflops": bench.useful_flops(c.s_q, c.topk, c.h) / ms / 1e9, "check": NOT_CHECKED,
            "config": {"skip_kv": True},
            "outputs_finite": bool(torch.isfinite(out).all())}


def breakdown_rows(heads=BREAKDOWN_HEADS, *, workload: str = "glm53-like", s_q: int = 16384, s_kv: int = 65536,
                   topk: int = 2048, dtype: str = "bf16", device="cuda", check_rows: int = 256,
                   timing: dict | None = None, log=None) -> list[dict]:
    """The query-parallel kernel and three variants that leave a stage out, per head count.

    Variants (``BREAKDOWN_VARIANTS``): ``full`` (a); ``fp8`` (b) the same q / kv quantized to the FP8
    cache; ``contiguous`` (c) indices replaced by ``window_indices``, checked against a reference
    on those indices; ``no_kv_load`` (d) the kernel's private ``_skip_kv`` mode, not checked
    (``"check": NOT_CHECKED``). (a)-(c) carry ``rel_err`` against the float32 reference. All run
    the Triton kernel, the only one with the no-kv-load mode.
    """
    from quilt_attn.kv_cache import quantize_fp8

    log, rows, t0 = _log(log), [], time.time()
    kw = dict(log=log, check_rows=check_rows, **backend_kwargs("triton"), **(timing or TIMING))
    for h in heads:
        case = Case(workload, h, s_q=s_q, s_kv=s_kv, topk=topk, dtype=dtype)
        inp, errors = _inputs(case, ["query_parallel"] * len(BREAKDOWN_VARIANTS), device, log)
        for r, v in zip(errors, BREAKDOWN_VARIANTS):
            rows.append(dict(r, variant=v))
        if inp is None:
            continue
        builders = {
            "full": lambda: inp,
            # the same q / kv quantized: the FP8 bar differs from the dense one by the cache format only
            "fp8": lambda: Inputs(replace(case, kv="fp8"), inp.indices,
                                  [(q, quantize_fp8(kv)) for q, kv in inp.sets]),
            "contiguous": lambda: Inputs(case, window_indices(s_q, s_kv, topk, device=inp.indices.device),
                                         inp.sets),
        }
        for v in BREAKDOWN_VARIANTS:
            try:
                if v == "no_kv_load":
                    r = _no_kv_load_row(inp, timing or TIMING)
                else:
                    variant = builders[v]()
                    # the FP8 bar dequantizes gathered rows in the kernel (not the once-per-call expansion)
                    r = run_case_or_error(variant, "query_parallel", **kw, **({"fp8_expand": False} if v == "fp8" else {}))
                    if "ms" in r:
                        r["check"] = f"float32 reference, {check_rows} sampled queries, the variant's own kv / indices"
                    variant = None
            except Exception as e:  # building a variant failed: recorded, the others go on
                r = {"method": "query_parallel", "workload": workload, "kv": case.kv, "h": h, "s_q": s_q,
                     "s_kv": s_kv, "topk": topk, "error": f"{type(e).__name__}: {e}"[:400]}
            r.update(variant=v, what=BREAKDOWN_VARIANTS[v])
            rows.append(r)
            if "ms" in r:
                log(f"[{time.time() - t0:6.1f}s] breakdown h={h} {v}: {r['ms']:.3f} ms")
            _release()
        inp = builders = None  # free this head count's inputs before the next
        _release()
    from quilt_attn.ops import cuda_backend

    why = cuda_backend.unavailable_reason(torch.device(device))
    if why is None:
        rows += cuda_breakdown_rows([(workload, h) for h in heads], s_q=s_q, s_kv=s_kv, topk=topk, device=device,
                                    check_rows=check_rows, timing=timing, log=log)
    else:
        log(f"breakdown: no CUDA-kernel rows ({why})")
    return rows


def cuda_breakdown_rows(cases, *, s_q: int = 16384, s_kv: int = 65536, topk: int = 2048, dtype: str = "bf16",
                        device="cuda", check_rows: int = 256, timing: dict | None = None, log=None, libs=None,
                        variants=tuple(CUDA_BREAKDOWN_VARIANTS)) -> list[dict]:
    """The CUDA kernel's time by stage: one launch (``cuda_backend.launch``, bf16) and the same launch
    with the kv gather and / or the matrix products left out (``CUDA_BREAKDOWN_VARIANTS``).

    ``cases``: ``(workload, h)`` pairs; a case runs QUILT with ``sparse_prefill``'s plan (group and merge
    level the queries a program holds, 64 / h) when that is above 1, else the query programs (``method``). ``cuda_full`` is checked against the float32 reference (NaN-poisoned output
    first); the other variants are not (``check``: ``CUDA_NOT_CHECKED``). ``libs``: ``[(name, path)]``
    prebuilt kernel libraries to compare on the same inputs (e.g. builds with -D switches), default the
    package's build; each row names its ``lib``. The no-matmul variants exist for bf16 only (the
    measurement build of the kernel).
    """
    from quilt_attn.ops import cuda_backend

    log, rows, t0, timing = _log(log), [], time.time(), timing or TIMING
    for wl, h in cases:
        case = Case(wl, h, s_q=s_q, s_kv=s_kv, topk=topk, dtype=dtype)
        inp = make_inputs(case, device=device)
        q, kv = inp.sets[0]
        kw = bench.cuda_work(inp, h)  # the plan sparse_prefill runs, or indices= from 64 heads
        pl = kw.get("plan")
        out = torch.empty(s_q, h, bench.D_V, dtype=q.dtype, device=q.device)
        ml = torch.empty(s_q, h, dtype=torch.float32, device=q.device)
        lse = torch.empty_like(ml)
        scale = bench.D_QK ** -0.5
        try:
            for lib, path in (libs or [("package", None)]):
                cuda_backend.use_library(path)
                out.fill_(float("nan"))
                cuda_backend.launch(q, kv, scale, out, ml, lse, **kw)
                chk = bench.check(inp, out, ml, lse, n_check=check_rows, base2=True)  # a raw launch: base 2
                for v in variants:
                    skip, what = CUDA_BREAKDOWN_VARIANTS[v]
                    ms = bench.time_ms(lambda: cuda_backend.launch(q, kv, scale, out, ml, lse, _skip=skip, **kw),
                                       **timing)
                    r = dict(method="quilt" if pl is not None else "query_parallel", backend="cuda", lib=lib,
                             workload=wl, kv="bf16", dtype=dtype, h=h, s_q=s_q, s_kv=s_kv, topk=topk, variant=v, what=what, ms=ms,
                             tflops=bench.useful_flops(s_q, topk, h) / ms / 1e9)
                    if skip == 0:
                        r.update(rel_err=chk["rel_err"], check=f"float32 reference, {check_rows} sampled queries")
                    else:
                        r["check"] = CUDA_NOT_CHECKED
                    rows.append(r)
                    log(f"[{time.time() - t0:6.1f}s] cuda breakdown {wl} h={h} {lib} {v}: {ms:.3f} ms")
        finally:
            cuda_backend.use_library(None)
        inp = pl = kw = None
        _release()
    return rows


def breakdown_summary(rows: list[dict]) -> list[dict]:
    """Per head count, the stage times from the variants' ms (a full, b fp8, c contiguous, d no kv load).

    ``compute_ms = d``; ``load_gather_ms = a - d`` (kv loads and the scattered gather);
    ``gather_ms = a - c`` (what scattered rows cost over a contiguous window, whose neighbouring
    queries mostly hit L2); ``stream_load_ms = c - d``; ``dequant_ms = b - a``: FP8 dequantization
    minus what the smaller rows (656 vs 1152 bytes) save in loads, so a lower bound of the dequant
    cost, negative when the saving wins. Shares are of ``a`` (of ``b`` for dequant). Stages whose
    variants failed are left out.
    """
    out, rows = [], [r for r in rows if r["variant"] in BREAKDOWN_VARIANTS]
    for h in sorted({r["h"] for r in rows}):
        ms = {r["variant"]: r["ms"] for r in rows if r["h"] == h and "ms" in r}
        a, b, c, d = (ms.get(v) for v in ("full", "fp8", "contiguous", "no_kv_load"))
        e = {"h": h, "full_ms": a, "fp8_ms": b, "contiguous_ms": c, "no_kv_load_ms": d}
        if a is not None and d is not None and d >= a:
            # building the synthetic tile in registers cost more than the load it replaces: this variant
            # does not isolate the compute (measured so on the H200: 14.3 vs 8.5 ms at h = 16)
            e["no_kv_load_invalid"] = True
        elif a is not None and d is not None:
            e.update(compute_ms=d, load_gather_ms=a - d, compute_share=d / a, load_gather_share=(a - d) / a)
        if a is not None and c is not None:
            e.update(gather_ms=a - c, gather_share=(a - c) / a)
        if c is not None and d is not None and "compute_ms" in e:
            e["stream_load_ms"] = c - d
        if a is not None and b is not None:
            e.update(dequant_ms=b - a, dequant_share_of_fp8=(b - a) / b)
        out.append(e)
    return out


def breakdown_bars(summary: list[dict]) -> list[tuple[str, list[tuple[str, float]]]]:
    """Stacked bars ``(label, [(stage, ms)])``: for each h a dense-kv bar (compute, contiguous load,
    scattered gather) and an FP8 bar (compute, load + gather, dequant; when FP8 is faster than dense,
    one load + gather + dequant segment). Where the no-kv-load variant does not isolate the compute,
    compute and contiguous loads share one segment. Negative differences (noise) are drawn as 0."""
    bars = []
    for e in summary:
        if e.get("compute_ms") is None:
            # the no-kv-load variant did not isolate the compute: draw what was measured, the
            # contiguous-window time (compute + streamed loads), the scattered gather and the dequant
            if e.get("gather_ms") is None:
                continue
            base = [("compute + kv load (contiguous)", e["contiguous_ms"]), ("scattered gather", e["gather_ms"])]
            bars.append((f"h={e['h']} dense", [(k, max(0.0, v)) for k, v in base]))
            if e.get("fp8_ms") is not None:
                bars.append((f"h={e['h']} fp8", [(k, max(0.0, v)) for k, v in base + [("dequant", e["dequant_ms"])]]))
            continue
        d = e["compute_ms"]
        if "gather_ms" in e:
            dense = [("compute", d), ("kv load (contiguous)", e["stream_load_ms"]),
                     ("scattered gather", e["gather_ms"])]
        else:
            dense = [("compute", d), ("kv load + gather", e["load_gather_ms"])]
        bars.append((f"h={e['h']} dense", [(k, max(0.0, v)) for k, v in dense]))
        if e.get("fp8_ms") is not None:
            if e["dequant_ms"] >= 0:
                fp8 = [("compute", d), ("kv load + gather", e["load_gather_ms"]), ("dequant", e["dequant_ms"])]
            else:
                fp8 = [("compute", d), ("kv load + gather + dequant", e["fp8_ms"] - d)]
            bars.append((f"h={e['h']} fp8", [(k, max(0.0, v)) for k, v in fp8]))
    return bars


def plot_breakdown(rows: list[dict], png) -> str:
    plt = _pyplot()
    colors = {"compute": "C0", "kv load (contiguous)": "C1", "scattered gather": "C1", "kv load + gather": "C1",
              "compute + kv load (contiguous)": "C2",
              "dequant": "C3", "kv load + gather + dequant": "C4"}
    hatch = {"scattered gather": "//"}
    bars = breakdown_bars(breakdown_summary(rows))
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(bars) + 2), 4.5))
    seen = set()
    for i, (label, segs) in enumerate(bars):
        bottom = 0.0
        for k, v in segs:
            ax.bar(i, v, bottom=bottom, color=colors[k], hatch=hatch.get(k), edgecolor="k", linewidth=0.5,
                   label=None if k in seen else k)
            seen.add(k)
            bottom += v
    ax.set_xticks(range(len(bars)), [b[0] for b in bars])
    ax.set_ylabel("ms (query-parallel kernel)")
    r0 = next((r for r in rows if "ms" in r), {})
    ax.set_title(f"where query-parallel time goes ({r0.get('workload', '')}, s_q {r0.get('s_q', '')}, "
                 f"s_kv {r0.get('s_kv', '')}, top-{r0.get('topk', '')})", fontsize=9)
    ax.legend(fontsize=7)
    return _save(fig, png)


def breakdown_md(rows: list[dict], png=None) -> list[str]:
    lines = ["## Where the query-parallel kernel's time goes (variants that leave a stage out)", "",
             "`no_kv_load` runs the kernel with kv tiles made in registers (its outputs are not checked); "
             "`contiguous` reads each query's own causal window of topk rows (coalesced; neighbours share most "
             "rows, so mostly L2 hits). Dequant = FP8 - dense: dequantization minus what the 656-byte rows save "
             "in loads over 1152-byte ones, a lower bound.", "",
             "| h | variant | kv | ms | TFLOP/s | check | what |", "| --- | --- | --- | --- | --- | --- | --- |"]
    cuda = [r for r in rows if r["variant"] in CUDA_BREAKDOWN_VARIANTS]
    rows = [r for r in rows if r["variant"] in BREAKDOWN_VARIANTS]
    for r in rows:
        res = f"{r['ms']:.3f} | {r['tflops']:.0f}" if "ms" in r else f"error: {r['error'][:60]} | "
        chk = f"rel_err {r['rel_err']:.1e}" if "rel_err" in r else ("not checked" if "ms" in r else "")
        lines.append(f"| {r['h']} | {r['variant']} | {r['kv']} | {res} | {chk} | {BREAKDOWN_VARIANTS[r['variant']]} |")
    lines += ["", "| h | compute (no kv load) | kv load + gather | of which scattered gather | dequant (FP8 - dense) |",
              "| --- | --- | --- | --- | --- |"]

    def cell(e, ms, share):
        return f"{e[ms]:.3f} ms ({e[share]:.0%})" if e.get(ms) is not None and e.get(share) is not None else ""

    summary = breakdown_summary(rows)
    for e in summary:
        lines.append(f"| {e['h']} | {cell(e, 'compute_ms', 'compute_share')} | "
                     f"{cell(e, 'load_gather_ms', 'load_gather_share')} | {cell(e, 'gather_ms', 'gather_share')} | "
                     f"{cell(e, 'dequant_ms', 'dequant_share_of_fp8')} |")
    bad = [str(e["h"]) for e in summary if e.get("no_kv_load_invalid")]
    if bad:
        lines += ["", f"At h = {', '.join(bad)} the no-kv-load variant took longer than the full kernel: making the "
                  "tile in registers costs more than loading it, so it does not isolate the compute and no "
                  "compute / load split is given there."]
    return lines + [""] + _image(png) + cuda_breakdown_md(cuda)


def cuda_breakdown_md(rows: list[dict]) -> list[str]:
    """Markdown of ``cuda_breakdown_rows``: per case and library, the four variants' ms and what the
    gather and the matrix products add over the kernel without them (empty without rows)."""
    if not rows:
        return []
    lines = ["### The CUDA kernel (the same launch without the kv gather and / or the matrix products)", "",
             "Only `full` is checked (rel-L2 against the float32 reference); the other variants' outputs are "
             "meaningless. Exposed gather = full - no gather; exposed matrix products = full - no matmul.", "",
             "| workload | h | method | lib | full ms | no gather | no matmul | neither | exposed gather | "
             "exposed matmul | rel_err |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    keys = []
    for r in rows:
        k = (r["workload"], r["h"], r.get("lib", "package"))
        if k not in keys:
            keys.append(k)
    for wl, h, lib in keys:
        ms = {r["variant"]: r for r in rows if (r["workload"], r["h"], r.get("lib", "package")) == (wl, h, lib)}

        def t(v):
            return f"{ms[v]['ms']:.3f}" if v in ms and "ms" in ms[v] else ""

        def diff(a, b):
            return f"{ms[a]['ms'] - ms[b]['ms']:.3f}" if t(a) and t(b) else ""

        method = next(iter(ms.values())).get("method", "")
        err = f"{ms['cuda_full']['rel_err']:.1e}" if "rel_err" in ms.get("cuda_full", {}) else ""
        lines.append(f"| {wl} | {h} | {method} | {lib} | {t('cuda_full')} | {t('cuda_no_gather')} | "
                     f"{t('cuda_no_matmul')} | {t('cuda_neither')} | {diff('cuda_full', 'cuda_no_gather')} | "
                     f"{diff('cuda_full', 'cuda_no_matmul')} | {err} |")
    return lines + [""]


# ------------------------------------------------------------------------------------ parts

_ROWS = {"context": context_rows, "sweep": sweep_rows, "breakdown": breakdown_rows}
_PLOT = {"context": plot_context, "sweep": plot_sweep, "breakdown": plot_breakdown}
MD = {"context": context_md, "sweep": sweep_md, "breakdown": breakdown_md}


def run_part(part: str, out_dir, meta: dict, *, plots: bool = True, log=None, **kwargs) -> tuple[list[dict], list[str]]:
    """Run one part (``context``, ``sweep`` or ``breakdown``) with ``kwargs`` of its ``*_rows`` function
    and write ``<out_dir>/<FILES[part]>.json`` (``meta``, e.g. ``bench.environment()`` and the command,
    plus the arguments and the rows) and, with ``plots``, the PNG next to it.

    Returns ``(rows, paths written)``.
    """
    if part not in _ROWS:
        raise ValueError(f"part must be one of {PARTS}, got {part!r}")
    out_dir = Path(out_dir)
    rows = _ROWS[part](log=log, **kwargs)
    path = out_dir / f"{FILES[part]}.json"
    args = {k: (list(v) if isinstance(v, tuple) else v) for k, v in kwargs.items() if k != "device"}
    write_json(path, dict(meta, part=part, arguments=args, rows=rows))
    written = [str(path)]
    if plots:
        written.append(_PLOT[part](rows, path.with_suffix(".png")))
    return rows, written


def run_context(out_dir, meta: dict, **kwargs):
    """``run_part("context", ...)``; kwargs of ``context_rows``."""
    return run_part("context", out_dir, meta, **kwargs)


def run_sweep(out_dir, meta: dict, **kwargs):
    """``run_part("sweep", ...)``; kwargs of ``sweep_rows``."""
    return run_part("sweep", out_dir, meta, **kwargs)


def run_breakdown(out_dir, meta: dict, **kwargs):
    """``run_part("breakdown", ...)``; kwargs of ``breakdown_rows``."""
    return run_part("breakdown", out_dir, meta, **kwargs)
