"""GPU benchmark of the sparse-prefill kernels (``quilt-bench bench``, ``benchmarks/run.py``) and the pieces the
harness shares: inputs (``Case``, ``make_inputs``), the reference check, timing, result files.

Inputs are built outside the timed region; times are the median of ``triton.testing.do_bench``
over two rotating input sets (each larger than L2); every timed configuration is checked
against the float32 reference on a sample of queries in the same run.
"""
from __future__ import annotations

import dataclasses
import math
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field

import torch

from quilt_attn.cli_args import write_json  # (re-exported: the harness's result files)

D_QK, D_V = 576, 512
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def useful_flops(s_q: int, topk: int, h: int, d_qk: int = D_QK, d_v: int = D_V) -> float:
    """2 * s_q * topk * h * (d_qk + d_v): the matrix work of query-parallel attention."""
    return 2.0 * s_q * topk * h * (d_qk + d_v)


def environment() -> dict:
    import triton

    commit = os.environ.get("QUILT_COMMIT", "")  # set by callers whose copy of the tree has no git history
    if not commit:
        try:
            here = os.path.dirname(__file__)
            commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=here).stdout.strip()
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, cwd=here).stdout.strip()
            if len(commit) == 40 and dirty:
                commit += "+dirty"
        except OSError:
            commit = ""
    if not commit or not 7 <= len(commit.split("+")[0]) <= 40:  # a full or abbreviated hash
        commit = "unknown"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "versions": {"torch": torch.__version__, "triton": triton.__version__,
                         "cuda": torch.version.cuda, "python": platform.python_version()}}


@dataclass
class Case:
    workload: str
    h: int
    kv: str = "bf16"  # or "fp8"
    s_q: int = 16384
    s_kv: int = 65536
    topk: int = 2048
    seed: int = 0
    dtype: str = "bf16"  # q and the dense kv; "fp16" for the CPU interpreter (its bf16 dot is wrong)


@dataclass
class Inputs:
    case: Case
    indices: torch.Tensor
    sets: list = field(default_factory=list)  # [(q, kv)] rotated between calls


def make_inputs(case: Case, n_sets: int = 2, device="cuda") -> Inputs:
    from quilt_attn.kv_cache import quantize_fp8
    from quilt_attn.workloads import generate

    indices = generate(case.workload, case.s_q, case.s_kv, case.topk, seed=case.seed, device=device)
    g = torch.Generator(device=device).manual_seed(case.seed + 1)
    sets, dtype = [], DTYPES[case.dtype]
    for _ in range(n_sets):
        q = torch.randn(case.s_q, case.h, D_QK, device=device, dtype=dtype, generator=g)
        kv = torch.randn(case.s_kv, D_QK, device=device, dtype=dtype, generator=g)
        sets.append((q, quantize_fp8(kv) if case.kv == "fp8" else kv))
    return Inputs(case, indices, sets)


def check(inputs: Inputs, out, max_logits, lse, n_check: int = 256, set_index: int = 0, dropped=None, *,
          base2: bool = False, rows: torch.Tensor | None = None) -> dict:
    """Relative L2 error of ``out``, max |d lse| and max |d max_logits| against the float32 reference on
    sampled queries (``rows``: these queries instead). ``base2``: the statistics come from a raw kernel launch
    (``cuda_call``, ``cuda_backend.launch``, ``launch_sparse_attention_cuda``), which keeps them in base 2; else
    natural log, as ``sparse_prefill`` returns them."""
    from quilt_attn.reference import LOG2E, sparse_prefill_reference

    q, kv = inputs.sets[set_index]
    s_q = q.shape[0]
    if rows is None:
        g = torch.Generator(device="cpu").manual_seed(123)
        rows = torch.randperm(s_q, generator=g)[:n_check].to(q.device)
    ro, rm, rl = sparse_prefill_reference(q[rows], kv, inputs.indices[rows], compute_dtype=torch.float32)
    if base2:
        rm, rl = rm * LOG2E, rl * LOG2E
    o = out[rows].float()
    err = ((o - ro).norm() / ro.norm()).item()
    fin = torch.isfinite(rl)
    fin_m = torch.isfinite(rm)
    res = {"rel_err": err, "lse_err": (lse[rows] - rl)[fin].abs().max().item() if fin.any() else 0.0,
           "max_logits_err": (max_logits[rows] - rm)[fin_m].abs().max().item() if fin_m.any() else 0.0,
           "nan": bool(torch.isnan(out[rows]).any().item())}
    return res


def rows_selected_once(indices: torch.Tensor, s_kv: int, n: int) -> torch.Tensor:
    """The first ``n`` kv rows (ascending) that exactly one valid entry of ``indices`` selects: where a NaN reaches
    one query only, and under QUILT that query's tile partners too (the repair pass's cases)."""
    ok = (indices >= 0) & (indices < s_kv)
    counts = torch.bincount(indices[ok].long(), minlength=s_kv)
    return (counts == 1).nonzero().flatten()[:n]


def plans_equal(a, b) -> bool:
    """Whether two plans hold the same tensors, field by field (a field None in one and not the other differs);
    the plans may live on different devices."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y.to(x.device))):
                return False
    return True


def cuda_work(inputs: Inputs, h: int, group_size: int | None = None) -> dict:
    """The CUDA kernel's work argument for ``inputs`` at ``h`` heads, as the backend runs it
    (``dispatch.decide`` / ``plan_settings``): up to 32 heads a plan at merge level ``64 // h`` (``plan=``,
    query programs of that many queries; group ``group_size``, default ``sparse_prefill``'s), else
    ``indices=``. Its launch (``cuda_call``) leaves max_logits / lse in base 2 (``check(base2=True)``)."""
    from quilt_attn import dispatch
    from quilt_attn.planner import plan as make_plan

    settings = dispatch.PlanSettings(group_size=group_size)
    if dispatch.decide("cuda", "quilt", h, settings).quilt:
        pkw = dispatch.plan_settings(h, "cuda", settings)
        return dict(plan=make_plan(inputs.indices, s_kv=inputs.case.s_kv, **pkw))
    return dict(indices=inputs.indices)


def cuda_call(inputs: Inputs, h: int, work: dict, **launch_kw):
    """``(call, out, max_logits, lse)`` for the tools that time the CUDA kernel directly: ``call(q, kv)``
    launches it on one input set with ``work`` (``cuda_work``) and ``launch_kw`` (``_skip``, ``_ctas``) into
    these outputs; ``out`` starts NaN-poisoned, so an element the kernel leaves unwritten fails ``check``
    (``base2=True``: a raw launch keeps max_logits / lse in base 2)."""
    from quilt_attn.ops import cuda_backend

    q0 = inputs.sets[0][0]
    s_q = q0.shape[0]
    out = torch.full((s_q, h, D_V), float("nan"), dtype=q0.dtype, device=q0.device)
    max_logits = torch.empty(s_q, h, dtype=torch.float32, device=q0.device)
    lse = torch.empty_like(max_logits)

    def call(q, kv):
        cuda_backend.launch(q, kv, D_QK ** -0.5, out, max_logits, lse, **work, **launch_kw)

    return call, out, max_logits, lse


def earlier_build(csrc_dir):
    """The kernel library built from an earlier copy of ``quilt_attn/ops/csrc`` (a directory holding its units),
    cached beside the package's build as ``quilt_sm90_base``: the "base" of an A/B in one process."""
    from pathlib import Path

    from quilt_attn.ops import cuda_backend

    base = Path(csrc_dir)
    units = tuple(base / u for u in cuda_backend.UNITS if (base / u).exists())  # (an earlier tree: fewer units)
    return cuda_backend.build(units=units, name="quilt_sm90_base")


def time_ms(fn, warmup: int = 50, rep: int = 300) -> float:
    """Median ms of ``fn`` by ``triton.testing.do_bench`` (warmup / rep in ms).

    Without CUDA (the Triton interpreter): the wall time of one call, so that the benchmark code
    runs in CPU tests; such a time measures the interpreter and means nothing.
    """
    import triton

    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def interleaved_rounds(fns: dict, rounds: int, warmup: int = 20, rep: int = 100) -> dict:
    """``{name: [ms, one a round]}`` for the functions of ``fns`` (name -> no-argument callable), each timed once a
    round by ``time_ms``, every round in the other order from the round before: clock and thermal drift between
    timings otherwise favour whichever runs first (a fixed order showed +-7% that alternating rounds did not)."""
    times = {name: [] for name in fns}
    for rnd in range(rounds):
        for name in (list(fns) if rnd % 2 == 0 else list(fns)[::-1]):
            times[name].append(time_ms(fns[name], warmup=warmup, rep=rep))
    return times


def ab_row_text(workload: str, h: int, name: str, row: dict, width: int = 20) -> str:
    """One timed variant of an A/B run as a log line: median ms, the rounds, and the row's reference check."""
    return (f"{workload:<11} h={h:<4} {name:<{width}} {row['ms']:7.3f} ms  rounds {['%.3f' % x for x in row['rounds_ms']]}"
            f"  rel_err {row['rel_err']:.2e}  lse_err {row['lse_err']:.1e}  ml_err {row['max_logits_err']:.1e}"
            f"  nan {row['nan']}")


def rotating(inputs: Inputs, call):
    """A no-argument function calling ``call(q, kv)`` on the next of ``inputs.sets`` each time
    (rotating sets larger than L2 keeps the timed calls from reading a warm cache)."""
    state = {"i": 0}

    def fn():
        q, kv = inputs.sets[state["i"] % len(inputs.sets)]
        state["i"] += 1
        return call(q, kv)

    return fn


def run_case(inputs: Inputs, method: str, *, group_size=None, merge_level=None, importance_clip=False,
             clip_threshold=0.5, split_private=True, fallback=True, dv_split=1, num_warps=None,
             num_stages=None, check_rows=256, warmup=50, rep=300, backend=None, fp8_expand=None) -> dict:
    """Time one configuration; returns a result row (attention time with a prebuilt plan, plan time apart).

    ``warmup`` / ``rep``: do_bench budgets (ms) of the attention timing. ``backend``: passed to
    ``sparse_prefill`` (None: its default, ``"auto"``); the kernel that ran is the row's ``backend``. The plan
    and what runs it are ``sparse_prefill``'s (``quilt_attn.dispatch``): with the CUDA backend a plan keeps its
    private rows in 64-row tiles (``split_private`` only under importance clipping), and QUILT runs query
    programs only where one query fills a program (h > 32) or as ``fallback="cost"`` says.
    """
    from quilt_attn import dispatch, sparse_prefill
    from quilt_attn import plan as make_plan
    from quilt_attn.ops.sparse_attention import LAST_COMPILED, default_group_size, program_shape

    c = inputs.case
    if group_size is None:  # sparse_prefill's default
        group_size = default_group_size(c.h)
    tuning = dispatch.triton_tuning(dict(dv_split=dv_split, num_warps=num_warps, num_stages=num_stages,
                                         fp8_expand=fp8_expand))
    settings = dispatch.PlanSettings(group_size=group_size, tile=64, clip_threshold=clip_threshold,
                                     importance_clip=importance_clip, merge_level=merge_level,
                                     split_private=split_private, fallback=fallback)
    requested = backend or "auto"
    backend = dispatch.choose_backend(requested, inputs.sets[0][0], inputs.sets[0][1], D_V,
                                      triton_knobs=dispatch.triton_knobs(tuning))
    kw = dict(backend=requested, settings=settings, _triton=tuning)
    pl, plan_ms, kv_tiles = None, 0.0, None
    if method == "quilt":
        pkw = dispatch.plan_settings(c.h, backend, settings)
        merge_level, split_private = pkw["merge_level"], pkw["split_private"]
        plan_ms = time_ms(lambda: make_plan(inputs.indices, s_kv=c.s_kv, **pkw), warmup=5, rep=50)
        pl = make_plan(inputs.indices, s_kv=c.s_kv, **pkw)
        qp, hb = program_shape(c.h, group_size)
        _, ntiles = pl.work_list(qp)
        kv_tiles = int(ntiles.sum()) * math.ceil(c.h / hb)
        if pl.split_private:  # plus the private pass, query by query
            kv_tiles += int(((pl.priv_n + 63) // 64).sum()) * math.ceil(c.h / program_shape(c.h, 1)[1])
        kw["plan"] = pl
    ran = dispatch.decide(backend, method, c.h, settings, plan=pl, auto=requested == "auto")
    backend, ran_fallback = ran.kernel, method == "quilt" and not ran.quilt
    if not ran.quilt:
        kv_tiles = c.s_q * math.ceil(c.topk / 64) * math.ceil(c.h / program_shape(c.h, 1)[1])
    fn = rotating(inputs, lambda q, kv: sparse_prefill(q, kv, inputs.indices, method=method, **kw))
    q, kv = inputs.sets[0]
    out, ml, lse = sparse_prefill(q, kv, inputs.indices, method=method, **kw)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    chk = check(inputs, out, ml, lse, n_check=check_rows)
    k = LAST_COMPILED.get("kernel")
    ms = time_ms(fn, warmup=warmup, rep=rep)
    row = {
        "method": method + ("+iclip" if importance_clip else ""), "backend": backend,
        "backend_requested": requested, "workload": c.workload,
        "kv": c.kv, "h": c.h, "dtype": c.dtype,
        "s_q": c.s_q, "s_kv": c.s_kv, "topk": c.topk, "ms": ms,
        "tflops": useful_flops(c.s_q, c.topk, c.h) / ms / 1e9, "rel_err": chk["rel_err"], "lse_err": chk["lse_err"],
        "kv_tiles": kv_tiles, "plan_ms": plan_ms,
        "config": {"group_size": group_size if method == "quilt" else 1, "merge_level": merge_level,
                   "split_private": split_private if method == "quilt" else None,
                   "fell_back_to_query_parallel": ran_fallback,
                   "dv_split": dv_split, "num_warps": num_warps, "num_stages": num_stages,
                   "clip_threshold": clip_threshold},
        "regs": getattr(k, "n_regs", None), "spills": getattr(k, "n_spills", None),
    }
    if pl is not None:
        st = pl.stats
        row.update(rows_processed=st["rows_processed"], reduction=st["reduction"],
                   tile_utilization=st["tile_utilization"], dropped_pairs=st["dropped_pairs"])
    return row


def format_rows(rows) -> str:
    hdr = f"{'method':<16}{'backend':<8}{'workload':<15}{'kv':<5}{'h':>4}{'ms':>9}{'TFLOP/s':>9}{'tiles':>10}{'rel_err':>10}{'plan_ms':>9}  config"
    lines = [hdr]
    for r in rows:
        cfg = r["config"]
        lines.append(f"{r['method']:<16}{r.get('backend', ''):<8}{r['workload']:<15}{r['kv']:<5}{r['h']:>4}{r['ms']:>9.3f}{r['tflops']:>9.1f}"
                     f"{r['kv_tiles']:>10}{r['rel_err']:>10.2e}{r['plan_ms']:>9.3f}  "
                     f"G={cfg['group_size']} m={cfg['merge_level']} sp={cfg.get('split_private')} "
                     f"w={cfg['num_warps']} s={cfg['num_stages']} "
                     f"dvs={cfg['dv_split']} regs={r.get('regs')} spills={r.get('spills')}")
    return "\n".join(lines)


def save(rows, path: str, extra: dict | None = None) -> None:
    """A result file: ``environment()``, then ``extra``, then ``rows``."""
    doc = environment()
    if extra:
        doc.update(extra)
    doc["rows"] = rows
    write_json(path, doc)


def run_case_or_error(inputs: Inputs, method: str, *, log=None, **kw) -> dict:
    """``run_case`` (``method`` may end in ``+iclip`` and then ``@backend``), or an error row when it
    raises: a failing configuration is recorded, not hidden, and the caller's sweep goes on."""
    c = inputs.case
    method, _, backend = method.partition("@")
    if backend:
        kw["backend"] = backend
    try:
        return run_case(inputs, method.replace("+iclip", ""), importance_clip=method.endswith("+iclip"), **kw)
    except Exception as e:
        r = {"method": method, "backend": backend or "auto", "workload": c.workload, "kv": c.kv, "h": c.h,
             "s_q": c.s_q, "s_kv": c.s_kv,
             "topk": c.topk, "error": f"{type(e).__name__}: {e}"[:400]}
        if log:
            log(f"ERROR {r}")
        return r


# The recorded benchmark grid (benchmarks/results/<gpu>.json): realistic workloads first.
# Methods are "<method>[+iclip]@<backend>"; speedups are over query_parallel@triton. With the CUDA
# backend at h >= 64 "quilt" runs the CUDA query-parallel kernel (one query fills a program).
_BOTH = ("query_parallel@triton", "quilt@triton", "quilt@cuda")
GRID = [  # (workload, kv, heads, methods)
    ("glm53-like", "bf16", (8, 16, 32, 64, 128), _BOTH),
    ("glm53-like", "bf16", (8, 16), ("quilt+iclip@triton", "quilt+iclip@cuda")),
    ("ds32-like", "bf16", (8, 16, 32), _BOTH),
    ("qasper-like", "bf16", (8, 16), _BOTH),
    ("random", "bf16", (16,), (*_BOTH, "quilt@auto")),
    ("random", "bf16", (64, 128), _BOTH),
    ("glm53-like", "fp8", (8, 16, 64), _BOTH),
]


def run_grid(out: str, *, grid=None, only=None, extra: dict | None = None, log=None, case_kwargs=None) -> list[dict]:
    """Run ``grid`` (default ``GRID``), one input set per (workload, kv, h), then its methods.

    Speedup = query-parallel ms / ms. A failing configuration is recorded as an error row and the
    run goes on. Rows are saved to ``out`` (with ``environment()`` and ``extra``) after every input
    set. ``only``: workloads to keep (None: all). ``case_kwargs``: extra ``Case`` fields (s_q, ...).
    GPU only.
    """
    log = log or (lambda msg: print(msg, flush=True))
    rows: list[dict] = []
    t0 = time.time()
    for wl, kv, heads, methods in (GRID if grid is None else grid):
        if only and wl not in only:
            continue
        for h in heads:
            inp = make_inputs(Case(wl, h, kv=kv, **(case_kwargs or {})))
            for m in methods:
                r = run_case_or_error(inp, m, log=log)
                if "error" in r:
                    rows.append(r)
                    continue
                base = [x for x in rows if x.get("method") == "query_parallel" and x.get("backend") == "triton"
                        and x["workload"] == wl and x["kv"] == kv and x["h"] == h and "ms" in x]
                if base:
                    r["speedup_vs_query_parallel"] = base[0]["ms"] / r["ms"]
                rows.append(r)
                log(f"[{time.time() - t0:6.1f}s] " + format_rows([r]).splitlines()[1])
            del inp
            torch.cuda.empty_cache()
            save(rows, out, extra)
    return rows
