"""Write BENCHMARKS.md (and the grid's plot) from recorded result files; no GPU needed.

    python benchmarks/make_benchmarks_md.py            # from the recorded files named in DEFAULTS
    python benchmarks/make_benchmarks_md.py GRID [--repeat F] [--flashmla F ...] [--plan-overlap F]
        [--plan-beside F] [--clip F] [--engine F] [--out BENCHMARKS.md] [--no-plot]

``write_benchmarks_md(grid, ...)`` does the work. It reads only JSON files (``{"gpu", "commit", "date",
"versions", "command", "rows": [...]}``, as ``quilt_bench.bench.save`` writes them) and imports neither torch nor
the package, so the harness may call it from anywhere. Hand-written text below ``MARKER`` in an existing
BENCHMARKS.md is kept. What was learned on the way to these numbers is in docs/learned.md.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MARKER = "<!-- hand-written below -->"

# The recorded files this BENCHMARKS.md is generated from (the latest of each kind).
DEFAULTS = dict(
    grid=RESULTS / "h200.json",
    repeats=[RESULTS / "h200_grid_9a86f42_rep1.json"],
    flashmla=[RESULTS / "h200_flashmla_baseline_9a86f42.json", RESULTS / "h200_flashmla_baseline_9a86f42_rep1.json"],
    plan_overlap=RESULTS / "h200_plan_overlap_cuda_v11.json",
    plan_beside=RESULTS / "h200_plan_reserved_sms_v11.json",
    clip=RESULTS / "clip_accuracy_cpu.json",
    # newest first; the first is the current code's run, the others earlier runs (the last one beside FlashMLA)
    engine=[RESULTS / "h200_engine_shapes_99e00e4.json", RESULTS / "h200_engine_shapes_6c5dfa7.json"],
    fp8_mode=RESULTS / "fp8_accuracy_cpu.json",
    fp8_cache=[RESULTS / "h200_fp8_cache_f5c21d4.json"],
    repair=RESULTS / "h200_repair_cost_00482d8.json",
)

# Changes in the tree since the recorded files were measured. Empty this list once every file above has been
# re-measured on the current code; while it is not empty, BENCHMARKS.md says so at its top.
UNMEASURED_CHANGES = [
    "the CUDA planner's membership table is a hash table in shared memory sized by a group's entries (it was a "
    "byte per kv row), and the Triton planner's a hash table per program (it was s_kv int32 per program);",
    "plan columns are packed (`row | member bits << 24`, one int32 per column) while the kv pool has fewer than "
    "2^24 rows;",
    "`lse` and `max_logits` are natural-log at the public boundary (one element-wise launch per call; measured in "
    "the engine-shape section);",
    "`quilt_attn.dispatch` decides what runs from the settings alone, with no host sync (the plan's tile counts "
    "are no longer read back by default);",
    "the Triton kernel masks its kv loads of padding and invalid columns (they read row 0 before);",
    "the CUDA sources are split by role into headers (the generated SASS is identical, by cuobjdump diff);",
    "the CUDA planner probes a warp's colliding membership entries with all its lanes together (measured in the "
    "engine-shape section);",
    "the CUDA kernel's epilogue writes zeros for an empty row instead of o * 0 (measured in the engine-shape "
    "section: the kernel rows unchanged);",
    "the CUDA backend's availability check is cached (host time of a call 0.56 -> 0.34 ms at s_q 4096, h = 16; "
    "measured in the engine-shape section);",
    "the Triton kernels address gathered kv rows and q rows in 64 bits (pools of 3.3M+ FP8 or 3.7M+ bf16 rows, "
    "and s_q x h x 576 past 2^31, wrapped in int32; not measured: the Triton rows of the grid predate it);",
    "the CUDA kernel returns at once when a launch's device flag says the other launch of a pair runs (a null "
    "check otherwise; the FP8-cache section's bf16-kernel rows ran with it);",
    "a QUILT call queues the queries whose output holds a NaN and runs the repair pass over them (measured in "
    "the repair-pass, FP8-cache and engine-shape sections; the grid predates it);",
    "a call launches 7 GPU operations where it launched 17: the planner's rows area in warp pieces, the launch "
    "order by one small kernel, no work list for one program a group, `valid_pairs` summed when read (measured "
    "in the engine-shape section; the grid predates them);",
    "the CUDA backend's repair pass runs on its own kernel (query programs over the queued queries, their count "
    "read on the device) instead of a Triton launch (host time of the launch 52-61 -> 29-36 us, "
    "`h200_call_timeline_3539286.txt`; measured in the engine-shape section);",
    "the FP8 compaction widens only the rows a call references, keeps a byte a pool row in its mark pass (read "
    "before stored, programs in bit-reversed order), and a plan keeps the numbering of its rows (all measured in "
    "the FP8-cache section);",
    "the FP8 compaction renumbers a plan made in the call in place, not into a copy of its columns (measured in "
    "the FP8-cache section);",
    "the CUDA planner's invalid entries reference a spare table slot (a lookup is one load), its colliding "
    "entries are listed by pointer, and its flat path keeps column kinds as two bit masks (-8% / -12% planning "
    "at 16 / 8 heads, `h200_plan_spare_slot_ab_fdd6416.json`; measured in the engine-shape section, the "
    "planner-overlap rows predate it);",
    "the CUDA planner hashes without predication, forms a member bit by a funnel shift and divides by no runtime "
    "value (-1% planning, `h200_plan_nodiv_ab_2b324a0.json`; measured in the engine-shape section, the "
    "planner-overlap rows predate it);",
    "a call's order kernel, attention and repair pass are chained launches (programmatic dependent launches) and "
    "the attention's and the repair pass's work counters are zeroed with the repair queue: 6 GPU operations a call "
    "where there were 8, spans 8-13 us shorter (`h200_call_timeline_6c5dfa7.txt` against "
    "`h200_call_timeline_unchained_6c5dfa7.txt`; measured in the engine-shape and FP8-cache sections);",
    "the FP8 compaction marks rows by a CUDA kernel (a hash set in shared memory per CTA before any store) and "
    "renumbers in place only the words that reference a row (measured in the FP8-cache section; "
    "`h200_fp8_mark_ab_f5c21d4.txt`);",
    "the default CUDA call (a plan made in the call, dense kv) takes a short host path, `ops/cuda_call.py`: "
    "layouts worked out once a shape, the plan written into one workspace, the same kernels and parameter "
    "blocks (measured in the engine-shape section, `--general` beside it).",
]
STATUS_CODE_COMMIT = "3c8818e"  # the commit that made the changes above
# What ran at the commits of the recorded files (a result file names its commit only); results of these commits
# predate UNMEASURED_CHANGES.
CODE_OF = {"9a86f42": "CUDA kernel v8 with round-robin head blocks, planner 2c8d48d",
           "465a192": "CUDA kernel v6, planner 2c8d48d"}
# What the recorded FlashMLA runs built (benchmarks/flashmla_shim.cu now builds FlashMLA's current release).
FLASHMLA_RELEASE = "its first public release"
PARITY = 0.02  # "at parity": within the board's run-to-run spread either way

# Issue 6 (the CUDA backend), glm53-like, bf16, kernel time with a prebuilt plan: minimum / goal, ms.
CUDA_MIN_MS = {8: 2.5, 16: 3.5, 32: 5.5, 64: 8.0, 128: 16.0}
CUDA_GOAL_MS = {8: 1.8, 16: 3.0, 32: 4.8, 64: 7.6, 128: 15.5}
# FlashMLA sm90 on another H200 (../shared/HOPPER-NOTES.md): correlated indices (8-32 heads padded to 64), random.
FLASHMLA_NOTES_MS = {8: 7.98, 16: 7.98, 32: 7.98, 64: 7.98, 128: 15.6}
FLASHMLA_NOTES_RANDOM_MS = {64: 9.19, 128: 17.2}

# ../shared/ENGINES.md, "Measured here" (one H200, 2026-12-01, beside FlashMLA's current release): the baseline
# that the unmeasured changes above aim at. (case, kernel with a prebuilt plan, whole call, FlashMLA) in ms.
ENGINE_BASELINE = [
    ("s_q 16384, 64K context, 16 heads", "3.36", "3.74", "8.05"),
    ("same, global slot ids in a 256K / 1M / 4M-row pool", "3.40 / 3.36 / 3.38", "5.07 / 5.07 / 5.10",
     "7.66 / 7.92 / 8.05"),
    ("s_q 8192, 128K / 256K / 1M context, 8 heads", "1.12 / 1.20 / 1.42", "1.38 / 2.81 / 3.04",
     "3.62 / 3.77 / 3.90"),
    ("s_q 8192, 128K / 256K / 1M context, 16 heads", "1.81 / 1.89 / 2.11", "2.04 / 3.29 / 3.73",
     "3.78 / 3.69 / 3.95"),
    ("varlen batch, 5 requests of 517-7000 queries, 164K kv, 16 heads", "", "3.61", "7.85"),
    ("FP8 cache, s_q 16384, 64K, 16 heads (extra device memory: 596 MiB; bf16: 524)", "", "3.65 (bf16 3.77)", ""),
]


def _load(path):
    return json.loads(Path(path).read_text()) if path is not None and Path(path).exists() else None


def _rel(path, root: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def _find(rows, workload, h, method="quilt", backend="cuda", kv="bf16", requested=None):
    for r in rows:
        if (r.get("workload"), r.get("h"), r.get("method"), r.get("backend", "triton"), r.get("kv", "bf16")) == (
                workload, h, method, backend, kv) and "ms" in r:
            if requested is None or r.get("backend_requested", r.get("backend")) == requested:
                return r
    return None


def _num(x, fmt="{:.3f}") -> str:
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


def _ms(r) -> str:
    return f"{r['ms']:.2f}" if r else "-"


def _verdict(ok) -> str:
    return {True: "met", False: "**not met**", None: "not measured"}[ok]


def _slower(ratio) -> str:
    return "met" if ratio <= 1 else f"**not met**: up to {100 * (ratio - 1):.1f}% slower"


def _span(values, fmt="{:.3f}") -> str:
    lo, hi = (fmt.format(v) for v in (min(values), max(values))) if values else ("-", "-")
    return lo if lo == hi else f"{lo}-{hi}"


def _header_lines(doc, path, root) -> str:
    code = CODE_OF.get(doc.get("commit"))
    return (f"`{_rel(path, root)}` ({doc.get('gpu')}, commit `{doc.get('commit')}`"
            f"{': ' + code if code else ''}, {doc.get('date')})")


def _status(docs) -> list[str]:
    old = sorted({d["commit"] for d in docs if d and d.get("commit") in CODE_OF})
    if not UNMEASURED_CHANGES or not old:
        return []
    commits = ", ".join(f"`{c}`" for c in old)
    lines = [
        "## Status of these numbers: measured on older code",
        "",
        f"> The grid, FlashMLA-beside and planner-overlap numbers below were measured before commit "
        f"`{STATUS_CODE_COMMIT}`, on the code of commits {commits}",
        "> (kernel `9a86f42`: CUDA kernel v8 with round-robin head blocks; planner `2c8d48d`). The engine-shape",
        "> section measures newer code (its commit is named there). What changed after the older numbers:",
        ">",
    ]
    lines += [f"> - {c}" for c in UNMEASURED_CHANGES]
    lines += [
        ">",
        "> The engine-shape run (without the items that say its rows predate them) measured the kernel with a "
        "prebuilt plan at the old",
        "> grid's time within 1-2% (3.44-3.46 / 2.15-2.17 ms at 16 / 8 heads, pools of 64K-4M rows; grid 3.40 / 2.13) "
        "and the "
        "CUDA planner at",
        "> 0.21-0.22 / 0.23 ms (the old byte-table planner: 0.19 at a 64K context only; `docs/design-log.md`). Re-run",
        "> the grid before quoting a grid number as the current code's.",
        "",
    ]
    return lines


def _method(grid_doc) -> list[str]:
    v = grid_doc.get("versions", {})
    return [
        "## What is measured and how",
        "",
        f"- **Board.** One {grid_doc.get('gpu')} (132 SMs), torch {v.get('torch')}, Triton {v.get('triton')}, "
        f"CUDA {v.get('cuda')}. It runs at its 700 W power limit (690-692 W, SM clock 1635-1695 MHz while a case "
        "runs), so its clock, and every figure, moves 1-3% with the board's state between runs an hour "
        "apart.",
        "- **Shape.** s_q 16384 queries at the end of a 65536-token context, Top-K 2048, d_qk 576 (512 latent + "
        "64 rope), d_v 512, q and kv random normal (bf16, or the 656-byte DeepSeek FP8 cache quantized from them).",
        "- **Indices.** Causal Top-K workloads of `quilt_attn.workloads`: `glm53-like` and `ds32-like`, fitted to "
        "the paper's processed-KV table (cascaded sharing 0.44 and 0.71 of query-parallel's rows, against the "
        "paper's 0.455 and 0.701), `qasper-like` (more sharing), and `random` (none).",
        "- **Timing.** `ms` is the median of `triton.testing.do_bench` for the attention with a prebuilt plan; "
        "`plan ms` is `quilt_attn.plan` alone. Two q / kv sets alternate between timed calls, so that no call "
        "finds the previous one's rows in L2. TFLOP/s = useful work 2 * s_q * topk * h * (d_qk + d_v) / time.",
        "- **Checks.** Every timed configuration is checked in the same run against the float32 reference "
        "(`quilt_attn/reference.py`) on 256 sampled queries: `rel_err` is the relative L2 error of `out` "
        "(bf16 outputs: ~2e-3); the A/B and FlashMLA runs also start from NaN-poisoned outputs and compare "
        "`lse` and `max_logits`.",
        "- **Comparisons.** A kernel change is judged by an interleaved A/B run (`benchmarks/run.py ab-cuda`): "
        "the variants alternate over 6 rounds, each round in the other order from the round before, and the "
        "median round counts. A fixed order showed differences of up to 7% between identical kernels, and two "
        "rounds +6.4%. FlashMLA is timed the same way beside this package's kernel, in one process on the same "
        "inputs (`benchmarks/run.py flashmla`); grids of separate runs are not compared to decide anything.",
        "",
    ]


def _grid(rows, grid_path, png, root) -> list[str]:
    lines = [
        "## The grid",
        "",
        f"Raw rows: `{_rel(grid_path, root)}`. `vs QP` is Triton query-parallel's time over the row's. `quilt` rows "
        "noted \"query programs\" ran one query per program: at 64 and 128 heads, where one query fills a 64-row "
        "tile (the CUDA backend runs its own query programs), and on Triton where the measured tile-cost rule of "
        "that code found that the plan shares too little. `plan ms` is one `do_bench` median of `quilt_attn.plan` "
        "(5 ms of warm-up; the planning runs below time it more carefully). `quilt+iclip` adds importance-aware "
        "clipping (approximate; its error here is large because q / kv are unrelated to the ranking).",
        "",
        "| workload | kv | h | method | backend | ms | TFLOP/s | kv tiles | vs QP | plan ms | rel_err | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        cfg = r.get("config", {})
        fell = cfg.get("fell_back_to_query_parallel")
        note = "query programs" if fell else ""
        if r.get("dropped_pairs"):
            note = f"dropped {r['dropped_pairs']} pairs"
        if r.get("backend_requested") == "auto":
            note = (note + "; " if note else "") + f"`auto` chose {r.get('backend')}"
        sp = r.get("speedup_vs_query_parallel")
        is_base = (r["method"], r.get("backend")) == ("query_parallel", "triton")
        vs_qp = f"{sp:.2f}x" if sp and not is_base else ""
        plan_ms = f"{r['plan_ms']:.2f}" if r.get("plan_ms") and not fell else ""
        lines.append(f"| {r['workload']} | {r['kv']} | {r['h']} | {r['method']} | {r.get('backend', 'triton')} | "
                     f"{r['ms']:.2f} | {r['tflops']:.0f} | {r['kv_tiles']} | {vs_qp} | {plan_ms} | "
                     f"{r['rel_err']:.1e} | {note} |")
    if png is not None:
        lines += ["", f"![latency by head count]({_rel(png, root)})"]
    return lines + [""]


def _flashmla_pairs(docs) -> dict:
    """``{(workload, h): [(FlashMLA ms, ours ms), one per run]}`` from FlashMLA comparison files."""
    pairs = {}
    for d in docs:
        by = {}
        for r in d["rows"]:
            by.setdefault((r["workload"], r["h"]), {})[r["method"]] = r
        for key, m in by.items():
            ours = m.get("quilt_cuda") or m.get("quilt")
            if "flashmla" in m and ours:
                pairs.setdefault(key, []).append((m["flashmla"]["ms"], ours["ms"]))
    return pairs


def _flashmla(docs) -> list[str]:
    if not docs:
        return []
    pairs = _flashmla_pairs(docs)  # (workload, h) -> [(flashmla ms, ours ms)]
    lines = [
        "## FlashMLA on the same board",
        "",
        f"FlashMLA's sm90 sparse prefill ({FLASHMLA_RELEASE}, built out of tree through "
        "`benchmarks/flashmla_shim.cu`; nothing of it is in this repository) timed beside this package's CUDA "
        "kernel: same inputs, one process, 6 alternating rounds, both outputs checked. One column per run "
        "(commit " + "; ".join(f"`{d['commit']}`, {d['date']}" for d in docs) + "). The issue's 8.0 / 15.6 ms "
        "(HOPPER-NOTES) come from another board on another day.",
        "",
        "| workload | h | FlashMLA ms | this kernel ms | this / FlashMLA |",
        "| --- | --- | --- | --- | --- |",
    ]
    for (wl, h), ps in pairs.items():
        lines.append(f"| {wl} | {h} | {' / '.join(f'{f:.3f}' for f, _ in ps)} | "
                     f"{' / '.join(f'{o:.3f}' for _, o in ps)} | {' / '.join(f'{o / f:.3f}' for f, o in ps)} |")
    lines += ["", "At 64 and 128 heads QUILT has nothing to share inside a tile (one query fills it); parity with "
              "FlashMLA is the target there. Below 64 heads engines pad to 64 for FlashMLA: at 16 heads, its current "
              "release took 8.05 ms beside this kernel's 3.36 (`../shared/ENGINES.md`).", ""]
    return lines


def _planning(grid_rows, overlap, beside, root, paths) -> list[str]:
    lines = ["## Planning", ""]
    cells = []
    for h in (8, 16, 32):
        got = [r["plan_ms"] for r in grid_rows if (r["workload"], r["h"], r["method"], r.get("backend"), r["kv"]) ==
               ("glm53-like", h, "quilt", "cuda", "bf16") and r.get("plan_ms")]
        if got:
            cells.append(f"{_span(got)} ms at h={h}")
    if cells:
        lines.append("`quilt_attn.plan` on the CUDA planner, glm53-like, in the grids: " + ", ".join(cells) + ".")
    lines += ["A plan can be reused across layers that share indices; otherwise it is paid per call."]
    if overlap or beside:
        lines[-1] += (" Plan + attention over the attention alone, CUDA backend (`do_bench` medians; the last "
                      "column the median of 6 rounds):")
    lines.append("")
    if overlap or beside:
        lines += ["| workload | h | attention ms | plan ms | plan, then attention (one stream) | "
                  "pipelined, best chunk | plan of the next indices beside a whole call (`plan_ahead`) |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        keys = []
        for d in (overlap, beside):
            for r in (d or {}).get("rows", []):
                if (r["workload"], r["h"]) not in keys:
                    keys.append((r["workload"], r["h"]))
        for wl, h in keys:
            o = [r for r in (overlap or {}).get("rows", []) if (r["workload"], r["h"]) == (wl, h)]
            b = next((r for r in (beside or {}).get("rows", []) if (r["workload"], r["h"]) == (wl, h)
                      and r.get("free_sms", 0) == 0), None)
            get = {r["name"]: r for r in o}
            pipes = [r["ratio_to_attn"] for r in o if r["name"].startswith("pipe/") and "first" not in r["name"]]
            attn = get.get("attn", {}).get("ms") or (b or {}).get("attn_ms")
            plan = get.get("plan", {}).get("ms") or (b or {}).get("plan_alone_ms")
            cells = [wl, str(h), _num(attn, "{:.2f}"), _num(plan), _num(get.get("serial", {}).get("ratio_to_attn")),
                     _num(min(pipes) if pipes else None), _num((b or {}).get("both_over_full_attn"))]
            lines.append("| " + " | ".join(cells) + " |")
        srcs = [f"{_header_lines(d, p, root)}" for d, p in ((overlap, paths[0]), (beside, paths[1])) if d]
        lines += ["", "(" + "; ".join(srcs) + ".) The attention kernel holds "
                  "every SM, so a planner on a second stream only gets the SMs its last programs leave idle; "
                  "chunking one call costs the attention 2-4%, so the pipelined call loses to planning first.", ""]
    return lines


def _by_shape(rows) -> dict:
    """``{(shape, h): {method: row}}`` of an engine-shape or FP8-cache run's rows."""
    by = {}
    for r in rows:
        by.setdefault((r.get("shape"), r.get("h")), {})[r.get("method")] = r
    return by


def _engine_table(doc) -> list[str]:
    lines = ["| case | h | kernel ms | call ms | call / kernel | plan ms | FlashMLA ms | FlashMLA / call | "
             "extra MiB | rel_err |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by = _by_shape(doc["rows"])
    for (shape, h), m in by.items():
        c, k, f = m.get("call", {}), m.get("kernel", {}), m.get("flashmla") or {}
        num = _num
        lines.append(f"| {shape} | {h} | {num(k.get('ms'))} | {num(c.get('ms'))} | {num(c.get('call_over_kernel'))} | "
                     f"{num(c.get('plan_ms'))} | {num(f.get('ms'))} | "
                     f"{num(c.get('flashmla_over_call'), '{:.2f}')} | {num(c.get('extra_mib'), '{:.0f}')} | "
                     f"{num(c.get('rel_err'), '{:.1e}')} |")
    return lines


def _unchained_table(doc) -> list[str]:
    """The run's `call-unchained` rows (``engine_shapes.py --unchained``: the call with a memset before each launch
    and no programmatic dependent launches, interleaved with the others) beside the call as it ships."""
    return _variant_table(doc, "call-unchained", (
        "The same run's calls with their launches unchained (`--unchained`: a memset before the attention and "
        "before the repair pass, each launch waiting for the one before it to finish), interleaved with the "
        "rest; `paired`: the median over rounds of (unchained - chained), each round's two calls timed next to "
        "each other:"), "chained", "unchained")


def _general_table(doc) -> list[str]:
    """The run's `call-general` rows (``engine_shapes.py --general``: the call with ``ops/cuda_call.py``'s short
    host path off, interleaved with the others) beside the call as it ships."""
    return _variant_table(doc, "call-general", (
        "The same run's calls through the general path (`--general`: `planner.plan`, then the plan's passes, as "
        "before the short host path of `quilt_attn/ops/cuda_call.py`), interleaved with the rest; `paired`: the "
        "median over rounds of (general - short). Where the host takes longer to enqueue a call than the GPU to "
        "run it, the call's time is the host's:"), "short path", "general path")


def _variant_table(doc, method: str, intro: str, ours: str, theirs: str) -> list[str]:
    """The run's ``method`` rows beside its ``call`` rows (``ours``: the call as it ships, ``theirs``: the
    variant), with the median over rounds of each round's paired difference."""
    by = _by_shape(doc["rows"])
    pairs = [(k, m) for k, m in by.items() if method in m and "call" in m]
    if not pairs:
        return []
    lines = [intro, "",
             f"| case | h | call, {ours} (ms) | call, {theirs} (ms) | call / kernel, {ours} / {theirs} | "
             "paired (us) |", "| --- | --- | --- | --- | --- | --- |"]
    for (shape, h), m in pairs:
        c, u = m["call"], m[method]
        paired = statistics.median(b - a for a, b in zip(c["rounds_ms"], u["rounds_ms"])) * 1e3
        lines.append(f"| {shape} | {h} | {c['ms']:.3f} | {u['ms']:.3f} | {c['call_over_kernel']:.3f} / "
                     f"{u['call_over_kernel']:.3f} | {paired:+.0f} |")
    return lines + [""]


def _engine(docs, paths, root) -> list[str]:
    """The engine-shape section: ``docs`` newest first (the first: the current code's run; the others earlier
    runs, e.g. the last one beside FlashMLA), ``paths`` their files."""
    doc, path = (docs[0], paths[0]) if docs else (None, None)
    lines = [
        "## Engine shapes",
        "",
        "How engines call sparse prefill (`../shared/ENGINES.md`): global slot ids into a paged pool of "
        "millions of rows, new indices every layer, requests of odd lengths back to back. The baseline, measured "
        "before the changes listed at the top (`../shared/ENGINES.md`, \"Measured here\": one H200, 2026-12-01, "
        "GLM-5.3-like indices, Top-2048, bf16, beside FlashMLA's current release at 64 heads), is what the "
        "hash-table planners and the "
        "settings-only dispatch aim at: the whole call rose from 3.74 to 5.07 ms once the slot ids point into a "
        "256K-row pool, while the kernel stayed at 3.4 ms.",
        "",
        "| case | kernel, plan prebuilt (ms) | whole call (ms) | FlashMLA (ms) |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {c} | {k} | {w} | {f} |" for c, k, w, f in ENGINE_BASELINE]
    lines.append("")
    if doc is None:
        lines += ["`benchmarks/engine_shapes.py` (`benchmarks/run.py engine-shapes`) times these shapes on the "
                  "current code; it has not run yet.", ""]
        return lines
    lines += [f"Current code ({_header_lines(doc, path, root)}). `kernel`: the CUDA attention with a plan built "
              "beforehand; `call`: `sparse_prefill(q, kv, indices)` with default arguments, planning inside; "
              "`plan`: `quilt_attn.plan` alone; FlashMLA at 64 heads, as engines pad; `extra MiB`: the call's peak "
              "device memory above its inputs and outputs; `rel_err`: the call's out against the float32 "
              "reference. Two index / q / kv sets alternate between timed calls"
              + ("." if any(r.get("method") == "flashmla" for r in doc["rows"]) else
                 "; FlashMLA was not timed in this run (\"-\"): the earlier run below ran beside it."), "",
              *_engine_table(doc), ""]
    lines += _unchained_table(doc)
    lines += _general_table(doc)
    for d, p in zip(docs[1:], paths[1:]):
        same = d.get("commit") == doc.get("commit")
        lines += [(f"The same code beside FlashMLA ({_header_lines(d, p, root)}; fewer rounds, so its call / kernel "
                   "ratios are the noisier):" if same else
                   f"Earlier run ({_header_lines(d, p, root)}), the code before the changes of the run above "
                   "(`docs/design-log.md`), beside FlashMLA on the same board:"), "", *_engine_table(d), ""]
    return lines


def _targets(rows, repeat_rows, fm_docs, overlap, beside, clip) -> list[str]:
    grids = [rows] + repeat_rows
    lines = [
        "## Targets and where they stand",
        "",
        f"From the grid{' and its repeat at the same commit' if repeat_rows else ''} (\"a / b\": one figure per "
        "grid), the same-board FlashMLA runs, the planning runs and the CPU clipping study above.",
        "",
        "| target | measured | status |",
        "| --- | --- | --- |",
    ]

    def each(wl, h, **kw):
        return [r for r in (_find(g, wl, h, **kw) for g in grids) if r]

    ratios = {key: [ours / fm for fm, ours in v] for key, v in _flashmla_pairs(fm_docs).items()}
    for h in (8, 16, 32, 64, 128):
        got = each("glm53-like", h)
        if not got:
            continue
        ms = [r["ms"] for r in got]
        n_ok = sum(m <= CUDA_MIN_MS[h] for m in ms)
        status = "met" if n_ok == len(ms) else ("**not met**" if n_ok == 0 else f"met in {n_ok} of {len(ms)} grids")
        goal = "goal met" if max(ms) <= CUDA_GOAL_MS[h] else "goal not met"
        extra = ""
        if ("glm53-like", h) in ratios:
            rr = ratios[("glm53-like", h)]
            extra = f"; {_span(rr)}x FlashMLA on this board"
            if h >= 64 and status != "met":
                status += " (absolute)" + ("; at parity with FlashMLA" if max(abs(x - 1) for x in rr) <= PARITY else "")
        lines.append(f"| CUDA, glm53-like h={h}: <= {CUDA_MIN_MS[h]} ms (goal {CUDA_GOAL_MS[h]}) | "
                     f"{' / '.join(f'{m:.2f}' for m in ms)} ms{extra} | {status}; {goal} |")
    fast = [(_find(rows, "glm53-like", h, backend="triton"), _find(rows, "glm53-like", h))
            for h in (8, 16, 32, 64, 128)]
    fast = [t["ms"] / c["ms"] for t, c in fast if t and c]
    if fast:
        lines.append(f"| CUDA faster than Triton QUILT at every head count (glm53-like) | {_span(fast, '{:.2f}')}x | "
                     f"{_verdict(min(fast) > 1)} |")
    ds = [_find(rows, "ds32-like", h) for h in (8, 16, 32)]
    if all(ds):
        lines.append(f"| CUDA, ds32-like faster than FlashMLA (7.98 ms padded, HOPPER-NOTES) at h <= 32 | "
                     f"{' / '.join(_ms(r) for r in ds)} ms | {_verdict(max(r['ms'] for r in ds) < 7.98)} |")
    for h in (64, 128):
        got = each("random", h)
        rr = ratios.get(("random", h), [])
        if got:
            lim = FLASHMLA_NOTES_RANDOM_MS[h] * 1.05
            same = f"; {_span(rr)}x FlashMLA on this board" if rr else ""
            ok = max(r["ms"] for r in got) <= lim and (not rr or max(rr) <= 1.05)
            lines.append(f"| CUDA, random h={h} within 5% of FlashMLA ({lim:.2f} ms from HOPPER-NOTES) | "
                         f"{' / '.join(_ms(r) for r in got)} ms{same} | {_verdict(ok)} |")
    fp = [(h, _find(rows, "glm53-like", h, kv="fp8"), _find(rows, "glm53-like", h)) for h in (8, 16, 64)]
    fp = [(h, f, b) for h, f, b in fp if f and b]
    if fp:
        lines.append("| CUDA, FP8 cache no slower than bf16 | " + ", ".join(f"h={h} {f['ms']:.2f} vs {b['ms']:.2f}"
                                                                        for h, f, b in fp) +
                     f" ms | {_slower(max(f['ms'] / b['ms'] for _, f, b in fp))} |")
    q = [_find(rows, "qasper-like", h, backend="triton") for h in (8, 16)]
    if all(q):
        lines.append(f"| Triton, qasper-like h=8 <= 4.0 ms, h=16 <= 6.0 ms | {_ms(q[0])} / {_ms(q[1])} ms | "
                     f"{_verdict(q[0]['ms'] <= 4.0 and q[1]['ms'] <= 6.0)} |")
    t = [_find(rows, "glm53-like", h, backend="triton") for h in (8, 16)]
    if all(t):
        lines.append(f"| Triton QUILT faster than FlashMLA (7.98 ms padded) at h = 8, 16 (glm53-like) | "
                     f"{_ms(t[0])} / {_ms(t[1])} ms | {_verdict(max(r['ms'] for r in t) < 7.98)} |")
    for be in ("triton", "cuda"):
        sp = [_find(rows, "glm53-like", h, backend=be) for h in (8, 16, 32)]
        if all(sp):
            v = [r.get("speedup_vs_query_parallel", 0) for r in sp]
            ok = v[0] >= 2 and v[1] >= 2 and v[2] >= 1.4
            lines.append(f"| {'Triton' if be == 'triton' else 'CUDA'} QUILT >= 2x Triton query-parallel at h <= 16, "
                         f">= 1.4x at h=32 | {' / '.join(f'{x:.2f}x' for x in v)} | {_verdict(ok)} |")
    rq, rp = _find(rows, "random", 16, backend="triton"), _find(rows, "random", 16, method="query_parallel",
                                                                 backend="triton")
    if rq and rp:
        lines.append(f"| Triton QUILT on random no more than 5% slower than query-parallel (h=16) | "
                     f"{rq['ms']:.2f} vs {rp['ms']:.2f} ms | {_verdict(rq['ms'] <= 1.05 * rp['ms'])} |")
    tf = [(h, _find(rows, "glm53-like", h, backend="triton", kv="fp8"), _find(rows, "glm53-like", h, backend="triton"))
          for h in (8, 16)]
    tf = [(h, f, b) for h, f, b in tf if f and b]
    if tf:
        worst = max(f["ms"] / b["ms"] for _, f, b in tf)
        lines.append("| Triton, FP8 cache no slower than bf16 (QUILT) | " +
                     ", ".join(f"h={h} {f['ms']:.2f} vs {b['ms']:.2f}" for h, f, b in tf) +
                     f" ms | {_slower(worst)} |")
    if clip:
        c = [r for r in clip["rows"] if r.get("clip_threshold") == 0.5]
        if c:
            lines.append("| importance clipping rel-L2 <= 1e-2 at tau 0.5, q / kv that follow the ranking (CPU) | " +
                         ", ".join(f"{r['workload']} {r['rel_err']:.1e}" for r in c) +
                         f" | {_verdict(max(r['rel_err'] for r in c) <= 1e-2)} |")
    for h in (16, 8):
        o = {r["name"]: r for r in (overlap or {}).get("rows", []) if (r["workload"], r["h"]) == ("glm53-like", h)}
        if "plan" in o and "attn" in o:
            share = o["plan"]["ms"] / o["attn"]["ms"]
            lines.append(f"| planning <= 10% of the kernel at h={h} (glm53-like) | {o['plan']['ms']:.3f} / "
                         f"{o['attn']['ms']:.2f} ms = {100 * share:.1f}% | {_verdict(share <= 0.10)} |")
    for h in (16, 8):
        s = next((r for r in (overlap or {}).get("rows", []) if (r["workload"], r["h"], r["name"]) ==
                  ("glm53-like", h, "serial")), None)
        b = next((r for r in (beside or {}).get("rows", []) if (r["workload"], r["h"]) == ("glm53-like", h)
                  and r.get("free_sms", 0) == 0), None)
        if s or b:
            got = [f"one stream {s['ratio_to_attn']:.3f}"] if s else []
            got += [f"beside a whole call {b['both_over_full_attn']:.3f}"] if b else []
            if b and b["both_over_full_attn"] <= 1.05:
                one = "" if not s or s["ratio_to_attn"] <= 1.05 else "; **not met** on one stream"
                status = "met beside a call" + one
            else:
                status = _verdict(bool(s) and s["ratio_to_attn"] <= 1.05)
            lines.append(f"| plan + attention <= 1.05x the attention at h={h} (glm53-like) | {', '.join(got)} | "
                         f"{status} |")
    return lines + [""]


def _reproduce() -> list[str]:
    return [
        "## Reproduce",
        "",
        "On an H100 / H200 with nvcc (the CUDA kernels build on first use). Set `QUILT_COMMIT` to the local "
        "commit when the device's copy of the tree has no git history (result files record it). Without "
        "arguments `make_benchmarks_md.py` regenerates this file from the recorded files it names (`DEFAULTS`).",
        "",
        "```bash",
        "python benchmarks/run.py grid --out benchmarks/results/h200.json        # the grid above",
        "python benchmarks/run.py flashmla --lib FLASHMLA.so --out benchmarks/results/h200_flashmla_COMMIT.json",
        "python benchmarks/run.py engine-shapes --flashmla FLASHMLA.so --out benchmarks/results/engine_shapes.json",
        "python benchmarks/run.py plan-timing --out PLAN.json                  # plan() per backend and method",
        "python benchmarks/run.py ab-cuda --variants a=A.so,b=package --rounds 6 --out AB.json  # kernel A/B",
        "python benchmarks/run.py cp-split --out benchmarks/results/h200_cp_split.json  # docs/distributed.md",
        "python benchmarks/run.py fp8-cache --out FP8.json        # FP8 cache: expanded vs widened in the kernel",
        "python benchmarks/run.py plan-timing --cuda-builds base,NAME=1 --out PLAN_AB.json  # planner build A/B",
        "python benchmarks/run.py fp8-accuracy --out benchmarks/results/fp8_accuracy_cpu.json  # CPU",
        "compute-sanitizer --tool memcheck python benchmarks/run.py sanitize-cuda",
        "compute-sanitizer --tool racecheck --racecheck-report all \\",
        "    python benchmarks/run.py sanitize-cuda --strict-sync",
        "compute-sanitizer --tool synccheck python benchmarks/run.py sanitize-plan   # also memcheck, racecheck",
        "python benchmarks/run.py boundary-timeline --out TIMELINE.json        # clock64 stamps of program boundaries",
        "ncu --set full --clock-control none -k regex:quilt_sm90 -c 1 -o prof python benchmarks/run.py profile --h 64",
        "python benchmarks/run.py profile --summarize prof.ncu-rep            # hottest SASS lines by stall samples",
        "python benchmarks/make_benchmarks_md.py GRID --repeat GRID2 --flashmla FM1 --flashmla FM2  # this file",
        "```",
        "",
        "The FlashMLA library is built by the user from `benchmarks/flashmla_shim.cu`, a FlashMLA source tree and "
        "CUTLASS headers (`benchmarks/flashmla.py`). Run GPU tests per file "
        "(`python -m pytest -m gpu tests/test_cuda_backend.py -v --durations 10`), not the whole marker under one "
        "time limit.",
        "",
    ]


def _plot(rows, png, gpu) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (wl, kv, m, be), style in [(("glm53-like", "bf16", "query_parallel", "triton"), "o--"),
                                   (("glm53-like", "bf16", "quilt", "triton"), "o-"),
                                   (("glm53-like", "bf16", "quilt", "cuda"), "o-"),
                                   (("ds32-like", "bf16", "quilt", "cuda"), "s-"),
                                   (("qasper-like", "bf16", "quilt", "cuda"), "^-")]:
        pts = sorted((r["h"], r["ms"]) for r in rows
                     if (r["workload"], r["kv"], r["method"], r.get("backend", "triton")) == (wl, kv, m, be))
        if pts:
            ax.plot(*zip(*pts), style, label=f"{m} {wl} ({be})")
    hs = sorted(FLASHMLA_NOTES_MS)
    ax.plot(hs, [FLASHMLA_NOTES_MS[h] for h in hs], "k:", label="FlashMLA sm90 (padded to 64 heads; HOPPER-NOTES)")
    ax.plot(hs, [CUDA_GOAL_MS[h] for h in hs], "g:", label="goal (glm53-like)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("heads")
    ax.set_ylabel("ms")
    ax.set_title(f"sparse prefill, s_q 16384, s_kv 65536, top-2048 ({gpu})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)


def _fp8_cache(docs, paths, root) -> list[str]:
    """The FP8 cache on the CUDA backend: the pool expanded to bf16, the referenced rows compacted, or every
    gathered row widened in the kernel, beside the bf16 kernel on the dequantized pool (one or more runs)."""
    docs = [d for d in docs if d is not None]
    if not docs:
        return []
    heads = "; ".join(_header_lines(d, pth, root) for d, pth in zip(docs, paths))
    lines = ["## FP8 cache on the CUDA backend", "",
             f"`benchmarks/fp8_cache.py` ({heads}): slot ids into an FP8 pool (uint8 rows of 656 bytes), "
             "GLM-5.3-like, s_q 16384 of a 64K context. Kernel rows have the plan built beforehand: `bf16`, the "
             "kernel on the pool dequantized beforehand; `expand`, the whole pool widened to bf16, then the "
             "kernel; `compact`, the rows the plan references widened into a compact buffer, then the kernel on "
             "it, the numbering of the rows (mark, prefix sum, renumbered columns: `ops/fp8_compact.py`) kept "
             "with the plan from its first call, so a call only widens; `compact fresh`, the same with the rows "
             "numbered again every call (what a plan made in the call pays, and query programs, h >= 64, always "
             "do: there the two are the same path); `widen`, the kernel reading the FP8 rows and widening them "
             "on their way into shared memory. `call`: `sparse_prefill` made to take each path, the plan made in "
             "the call; `default`: as it is (expanded up to `FP8_COMPACT_POOL` = 512K rows, compacted above; "
             "with a caller's plan, compacted at any size; a plan made in the call is renumbered in place, no copy of "
             "its columns). Every output equals the bf16 kernel's bit for bit "
             "(`same bits`); `extra MiB`: the call's peak device memory above inputs and outputs. A row's ms is "
             "the median of its interleaved rounds, which spread by up to 5-8% on this power-capped board (the "
             "first round runs fastest): a ratio within a few percent of 1 is the spread, not a cost.", "",
             "| pool | h | bf16 kernel | expand + kernel | compact + kernel | / bf16 | compact fresh + kernel | "
             "/ bf16 | widen kernel | expand call | compact call | default call | extra MiB expand / compact / "
             "widen | same bits |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    by = _by_shape([r for doc in docs for r in doc["rows"]])
    for (shape, h), m in sorted(by.items(), key=lambda kv: (kv[0][0] != "pool-64K", kv[0][0], kv[0][1])):
        ms = lambda k: f"{m[k]['ms']:.3f}" if k in m else "-"  # noqa: E731
        ratio = lambda k: f"{m[k]['over_bf16_kernel']:.3f}" if k in m else "-"  # noqa: E731
        mib = lambda k: f"{m[k]['extra_mib']:.0f}" if k in m else "-"  # noqa: E731
        same = all(m[k].get("same_bits_as_bf16", True) for k in m if k.endswith("-kernel") and k != "bf16-kernel")
        lines.append(f"| {shape} | {h} | {ms('bf16-kernel')} | {ms('expand-kernel')} | {ms('compact-kernel')} | "
                     f"{ratio('compact-kernel')} | {ms('compact-fresh-kernel')} | {ratio('compact-fresh-kernel')} | "
                     f"{ms('widen-kernel')} | {ms('expand-call')} | {ms('compact-call')} | {ms('default-call')} | "
                     f"{mib('expand-call')} / {mib('compact-call')} / {mib('widen-call')} | "
                     f"{'yes' if same else '**no**'} |")
    kept = [m["compact-kernel"]["over_bf16_kernel"] for (_, h), m in by.items() if h <= 32 and "compact-kernel" in m]
    fresh = [m["compact-fresh-kernel"]["ms"] - m["bf16-kernel"]["ms"] for (_, h), m in by.items()
             if h <= 32 and "compact-fresh-kernel" in m]
    qp = [m["compact-kernel"]["over_bf16_kernel"] for (_, h), m in by.items() if h >= 64 and "compact-kernel" in m]
    # the path a call takes by default with a prebuilt plan in a pool of FP8_COMPACT_POOL rows or fewer: compacted
    # (numbering kept) where it runs the plan (h <= 32), expanded for query programs (h >= 64)
    small = [(h, m["compact-kernel" if h <= 32 else "expand-kernel"]["ms"] / m["bf16-kernel"]["ms"])
             for (shape, h), m in sorted(by.items(), key=lambda kv: kv[0][1]) if shape == "pool-64K"
             and "bf16-kernel" in m and ("compact-kernel" if h <= 32 else "expand-kernel") in m]
    if small:
        lines += ["", "In the 64K pool (a 64K context, the FP8 target's shape) the default path with a prebuilt "
                  "plan, compacted with its numbering kept where the call runs the plan (h <= 32) and expanded "
                  "for query programs (h >= 64, a pool of at most `FP8_COMPACT_POOL` rows), costs "
                  + ", ".join(f"{r:.3f}x at h = {h}" for h, r in small) + " the bf16 kernel."]
    lines += ["", "Times in ms. With the plan's numbering kept, the FP8 kernel path costs "
              f"{_span(kept, '{:.3f}')}x the bf16 kernel at h = 8-32 in both pools (the widening of the "
              f"referenced rows, about 33 us); numbering the rows again costs {_span(fresh, '{:.2f}')} ms a call"
              + (f"; query programs (h >= 64) number their s_q x topk index lists every call: "
                 f"{_span(qp, '{:.3f}')}x" if qp else "") + ". Expanding grows with the pool. The widened kernel "
              "is producer-bound (about twice the bf16 kernel: one warpgroup gathers and widens, on each half "
              "tile's refill path; docs/design-log.md, 2026-12-02; staging each half by cp.async and widening it "
              "in place was slower still, and 1.57x the bf16 kernel with no arithmetic at all: "
              "`h200_fp8_widen_staged_ab_f93b923.json`). A call referencing more than "
              "`FP8_COMPACT_ROWS` (131,072) distinct rows runs the widening kernel, chosen on the device.", ""]
    return lines


def _repair(doc, path, root) -> list[str]:
    """What the repair pass costs a QUILT call (``benchmarks/repair_cost.py``): without it, with it over an
    empty queue, and with NaN rows whose partners it recomputes."""
    if doc is None:
        return []
    lines = ["## The repair pass", "",
             f"`benchmarks/repair_cost.py` ({_header_lines(doc, path, root)}): GLM-5.3-like, s_q 16384 of a 64K "
             "context, bf16, plan prebuilt, the CUDA launch interleaved in one process. `before`: a library built "
             "without the epilogue's NaN test and no repair pass (what a call ran before); `repair`: the shipping "
             "launch (NaN test, queue zeroed, repair pass over the empty queue); `repair-nan`: the same with a "
             "NaN in kv rows that one query selects each, whose tile partners the pass recomputes. `checked`: "
             "queries compared with the float32 reference (for `repair-nan`: every partner of a NaN row's query, "
             "none of which may be NaN; the selecting queries must be NaN).", "",
             "| h | variant | ms (median of rounds) | rounds' spread | vs before | rel-L2 | checked | "
             "selecting queries NaN |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    base = {r["h"]: r["ms"] for r in doc["rows"] if r["variant"] == "before"}
    for r in doc["rows"]:
        rel = r["ms"] / base[r["h"]] - 1
        nan_rows = f" ({r['nan_rows']} NaN rows)" if r.get("nan_rows") else ""
        owners = "-" if r.get("owners_nan") is None else ("yes" if r["owners_nan"] else "**no**")
        lines.append(f"| {r['h']} | {r['variant']}{nan_rows} | {r['ms']:.3f} | {_span(r['rounds_ms'])} | "
                     f"{100 * rel:+.1f}% | {r['rel_err']:.1e}{' **NaN**' if r['nan'] else ''} | {r['checked']} | "
                     f"{owners} |")
    empty = {r["h"]: r["ms"] / base[r["h"]] - 1 for r in doc["rows"] if r["variant"] == "repair"}
    spread = max(max(r["rounds_ms"]) / min(r["rounds_ms"]) - 1 for r in doc["rows"])
    lines += ["", "The empty queue's cost (" + " / ".join(f"{100 * v:+.1f}%" for v in empty.values())
              + f" at h = {' / '.join(map(str, empty))}) is of the size of the rounds' own spread (up to "
              f"{100 * spread:.0f}% within a variant): no more than about 1% a call.", ""]
    return lines


def _fp8_mode(doc, path, root) -> list[str]:
    """The accuracy of the FP8 tensor-core mode's candidate granularities, from the CPU emulation of the study."""
    if doc is None:
        return []
    b = doc["bounds"]
    lines = ["## FP8 tensor-core mode: the granularity study (CPU emulation)", "",
             f"`quilt_attn.fp8_mode.sparse_prefill_fp8_reference` against the exact float64 reference "
             f"({_header_lines(doc, path, root)}; `benchmarks/fp8_accuracy.py`, `docs/fp8-mode.md`): s_q "
             f"{doc['args']['s_q']} at the end of a {doc['args']['s_kv']}-row context, h {doc['args']['heads']}, "
             "each workload with Gaussian q / kv and with outlier channels, the cache's own e4m3 values and scales, "
             "P quantized with a scale per (query-head row, 64 list entries). Worst case over the workloads "
             f"({', '.join(doc['args']['workloads'])}); `aligned`: q and kv whose logits follow the glm53-like indexer score (~10-20 effective rows a query); `dsa-layer`: "
             "through the DSA layer proxy's output; bounds rel-L2 <= {b['rel_l2']}, "
             f"|d lse| <= {b['max_dlse']}.", "",
             "| q quantized | stats | rel-L2 of out | max abs d lse | min cosine | meets bounds |",
             "| --- | --- | --- | --- | --- | --- |"]
    worst = {}
    for r in doc["rows"]:
        if r.get("p_granularity") != "row_block" or r.get("acc_mantissa_bits") is not None:
            continue
        w = worst.setdefault((r["q_granularity"], r["stats"]), {"rel_l2": 0.0, "max_dlse": 0.0, "min_cos": 1.0,
                                                                 "ok": True})
        w["rel_l2"] = max(w["rel_l2"], r["rel_l2"])
        w["max_dlse"] = max(w["max_dlse"], r["max_dlse"])
        w["min_cos"] = min(w["min_cos"], r["min_cos"])
        w["ok"] = w["ok"] and bool(r["meets_bounds"])
    for (qg, st), w in worst.items():
        lines.append(f"| {qg} | {st} | {w['rel_l2']:.4f} | {w['max_dlse']:.4f} | {w['min_cos']:.5f} | "
                     f"{'yes' if w['ok'] else '**no**'} |")
    lines += ["", "`bf16`: q left in bf16 (the kv and P quantization alone). One scale per (token, head) fails the "
              "lse bound once channels carry outliers; the two-term q (q ~= e1 * s1 + e2 * s2, two e4m3 "
              "terms, two FP8 QK products) meets every bound. The shipped kernel (one e4m3 term a (query, head), one P scale a row) is measured under \"FP8 tensor-core mode: the kernel\" below.", ""]
    return lines


def write_benchmarks_md(grid, *, repeats=(), flashmla=(), plan_overlap=None, plan_beside=None, clip=None,
                        engine=None, fp8_mode=None, fp8_cache=None, repair=None, target=None, root=None, png=None,
                        plot=True) -> Path:
    """Write BENCHMARKS.md from recorded result files.

    grid : the grid's JSON (``benchmarks/run.py grid``); its rows make the main table, the plot and the targets.
    repeats : more grids of the same code (their glm53-like and random CUDA rows join the targets table).
    flashmla : same-board FlashMLA runs (``benchmarks/run.py flashmla``), rows of methods ``flashmla`` and
        ``quilt_cuda`` per (workload, h).
    plan_overlap, plan_beside : plan + attention runs (rows named attn / plan / serial / pipe/N; rows with
        ``both_over_full_attn``).
    clip : the CPU importance-clipping study (``quilt-bench report``).
    engine : the engine-shape run or runs, newest first (``benchmarks/run.py engine-shapes``; a path or a list); none
        found says it has not run.
    fp8_mode : the FP8 mode's accuracy emulation (``benchmarks/fp8_accuracy.py``); missing: no section.
    fp8_cache : the FP8-cache run or runs (``benchmarks/run.py fp8-cache``; a path or a list); missing: no section.
    repair : the repair-pass cost run (``benchmarks/run.py repair-cost``); missing: no section.
    target : the markdown file (default ``<root>/BENCHMARKS.md``); text below ``MARKER`` in it is kept.
    root : paths in the text are relative to it (default: the repository root).
    png : the plot (default: ``grid`` with a ``.png`` suffix); ``plot=False`` leaves it alone.
    Returns the path written.
    """
    root = Path(root) if root is not None else ROOT
    grid = Path(grid)
    gdoc = json.loads(grid.read_text())
    rows = [r for r in gdoc["rows"] if "ms" in r]
    rep_docs = [d for d in (_load(p) for p in repeats) if d]
    fm_docs = [d for d in (_load(p) for p in flashmla) if d]
    ov, bs, cl, f8 = _load(plan_overlap), _load(plan_beside), _load(clip), _load(fp8_mode)
    en_paths = [] if engine is None else ([engine] if isinstance(engine, (str, Path)) else list(engine))
    en_loaded = [(d, x) for d, x in ((_load(x), x) for x in en_paths) if d]
    fp8_paths = [] if fp8_cache is None else ([fp8_cache] if isinstance(fp8_cache, (str, Path)) else list(fp8_cache))
    fc, rp = [_load(x) for x in fp8_paths], _load(repair)
    png = Path(png) if png is not None else grid.with_suffix(".png")
    if plot:
        _plot(rows, png, gdoc.get("gpu"))
    target = Path(target) if target is not None else root / "BENCHMARKS.md"
    lines = [
        "# Benchmarks",
        "",
        "Sparse-attention prefill on one H200: what is measured and how, the latest numbers, the targets, and how "
        "to reproduce them. Generated by `benchmarks/make_benchmarks_md.py` from the result files it names. What "
        "was learned on the way (each kernel and planner version, predictions against measurements, what did not "
        "work) is in [docs/learned.md](docs/learned.md); the changes since these numbers in "
        "[docs/design-log.md](docs/design-log.md).",
        "",
        *_status([gdoc, *fm_docs, ov, bs]),
        *_method(gdoc),
        f"Grid: {_header_lines(gdoc, grid, root)}"
        + "".join(f"; repeat: {_header_lines(d, p, root)}" for d, p in zip(rep_docs, repeats) if d) + ".",
        "",
        *_grid(rows, grid, png if png.exists() else None, root),
        *_flashmla(fm_docs),
        *_planning(rows + [r for d in rep_docs for r in d["rows"] if "ms" in r], ov, bs, root,
                   (plan_overlap, plan_beside)),
        *_engine([d for d, _ in en_loaded], [x for _, x in en_loaded], root),
        *_fp8_cache(fc, fp8_paths, root),
        *_repair(rp, repair, root),
        *_fp8_mode(f8, fp8_mode, root),
        *_targets(rows, [[r for r in d["rows"] if "ms" in r] for d in rep_docs], fm_docs, ov, bs, cl),
        "Not reached: the goals at 8 / 16 / 32 heads. A kv half's refill latency is the largest exposed wait "
        "(q and two 72 KB tile buffers fill shared memory, so there is no deeper ring), each program boundary "
        "costs about one tile pair, and at the power limit saved cycles give back less time than saved "
        "instructions (docs/learned.md).",
        "",
        *_reproduce(),
    ]
    kept = ""
    if target.exists() and MARKER in target.read_text():
        kept = target.read_text().split(MARKER, 1)[1]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(lines) + "\n" + MARKER + (kept if kept.strip() else "\n"))
    return target


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("grid", nargs="?", default=str(DEFAULTS["grid"]))
    p.add_argument("--repeat", action="append", default=None, help="another grid of the same code (repeatable)")
    p.add_argument("--flashmla", action="append", default=None, help="a same-board FlashMLA run (repeatable)")
    p.add_argument("--plan-overlap", default=str(DEFAULTS["plan_overlap"]))
    p.add_argument("--plan-beside", default=str(DEFAULTS["plan_beside"]))
    p.add_argument("--clip", default=str(DEFAULTS["clip"]))
    p.add_argument("--engine", action="append", default=None, help="an engine-shape run, newest first (repeatable)")
    p.add_argument("--fp8-mode", default=str(DEFAULTS["fp8_mode"]))
    p.add_argument("--fp8-cache", action="append", default=None, help="an FP8-cache run (repeatable)")
    p.add_argument("--repair", default=str(DEFAULTS["repair"]))
    p.add_argument("--out", default=None, help="default: BENCHMARKS.md at the repository root")
    p.add_argument("--no-plot", action="store_true")
    a = p.parse_args(argv)
    path = write_benchmarks_md(
        a.grid, repeats=a.repeat if a.repeat is not None else DEFAULTS["repeats"],
        flashmla=a.flashmla if a.flashmla is not None else DEFAULTS["flashmla"], plan_overlap=a.plan_overlap,
        plan_beside=a.plan_beside, clip=a.clip, engine=a.engine if a.engine is not None else DEFAULTS["engine"],
        fp8_mode=a.fp8_mode,
        fp8_cache=a.fp8_cache if a.fp8_cache is not None else DEFAULTS["fp8_cache"],
        repair=a.repair, target=a.out,
        plot=not a.no_plot)
    print(path)


if __name__ == "__main__":
    main()
