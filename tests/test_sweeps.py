"""The report's sweeps (``quilt_bench.sweeps``): context lengths, group size x clipping threshold,
time breakdown; the kernel's private no-kv-load mode; their CLI wiring.

CPU-only and fast: the sweeps run for real at tiny sizes through Triton's interpreter (fp16: the
interpreter's bf16 dot is wrong), once per module; their timings are the interpreter's and mean
nothing, so only their presence is checked, and the stage arithmetic of the breakdown is checked
on fabricated times. The CLI's GPU path runs with the measuring functions stubbed out.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from quilt_bench import bench, sweeps
from quilt_bench.cli import main

from conftest import KERNEL_DEVICE, KERNELS_CAN_RUN, assert_matches_reference, make_inputs, natural_stats

PNG = b"\x89PNG\r\n\x1a\n"
TOL = 2e-3  # rel-L2 of fp16 outputs against the float32 reference (quilt_attn.demo.TOLERANCE["fp16"])
# Tiny sizes: every kernel program costs the interpreter ~50 ms, so few queries and one tile a query.
TINY = dict(topk=32, dtype="fp16", device=str(KERNEL_DEVICE), check_rows=8)
META = {"gpu": "cpu", "commit": "c", "command": "quilt-bench report --test"}


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    """``run_part`` of every sweep at a tiny size: ``{part: (rows, files)}`` (one interpreter run each)."""
    if not KERNELS_CAN_RUN:
        pytest.skip("kernels need CUDA or TRITON_INTERPRET=1 (run `make test`)")
    out = tmp_path_factory.mktemp("sweeps")
    kw = {
        "context": dict(TINY, context_lens=(2, 8), heads=(16,), s_q=4),
        "sweep": dict(TINY, group_sizes=(2, 16), thresholds=(0.5,), h=16, s_q=4, s_kv=64),
        "breakdown": dict(TINY, heads=(16,), s_q=4, s_kv=64),
    }
    return {p: sweeps.run_part(p, out, META, **kw[p]) for p in sweeps.PARTS}


def _files_ok(files, part):
    js, png = map(Path, files)
    assert js.name == f"{sweeps.FILES[part]}.json" and png == js.with_suffix(".png")
    assert png.read_bytes()[:8] == PNG
    doc = json.loads(js.read_text())
    assert doc["command"] == META["command"] and doc["gpu"] == "cpu" and doc["part"] == part
    assert "device" not in doc["arguments"]
    return doc


# ------------------------------------------------------------------------------------ SKIP_KV

def _synthetic(s_kv, d_qk, dtype):
    """The kv the kernel's ``_synthetic_kv`` stands in: ``((row + col) & 15) / 16 - 1/2``."""
    r, c = torch.arange(s_kv)[:, None], torch.arange(d_qk)[None, :]
    return (((r + c) & 15).float() * 0.0625 - 0.5).to(dtype)


@pytest.mark.interpret
@pytest.mark.parametrize("fp8, with_plan", [(False, False), (False, True), (True, False)])
def test_skip_kv_reads_no_kv(fp8, with_plan):
    """With ``_skip_kv`` the kernel never reads kv (a NaN cache leaves no trace) and computes exact
    attention over the synthetic tiles: q.k and p.v products are all still executed."""
    from quilt_attn.ops.sparse_attention import launch_sparse_attention
    from quilt_attn.planner import plan
    from quilt_attn.reference import sparse_prefill_reference

    d_qk, d_v = (576, 512) if fp8 else (80, 64)
    q, _, idx = make_inputs(s_q=8, h=4, s_kv=96, topk=40, d_qk=d_qk, d_v=d_v)
    poison = (torch.full((96, 656), 0xFF, dtype=torch.uint8) if fp8  # 0xFF is NaN in e4m3
              else torch.full((96, d_qk), float("nan"), dtype=q.dtype)).to(q.device)
    pl = plan(idx, s_kv=96, group_size=4, tile=16, merge_level=2, split_private=True) if with_plan else None
    scale = d_qk**-0.5
    got = launch_sparse_attention(q, poison, scale, d_v, indices=None if pl else idx, plan=pl, _skip_kv=True)
    ref = sparse_prefill_reference(q.cpu(), _synthetic(96, d_qk, q.dtype), idx.cpu(), scale, d_v=d_v)
    # (launch_sparse_attention is the kernels' own launcher: base-2 statistics)
    assert_matches_reference(natural_stats(got), ref, q.dtype, what=f"skip_kv fp8={fp8} plan={with_plan}")


def test_skip_kv_is_private():
    import inspect

    from quilt_attn import sparse_prefill

    assert not any("skip" in p for p in inspect.signature(sparse_prefill).parameters)


# ------------------------------------------------------------------------------------- context

@pytest.mark.interpret
def test_context_rows(parts):
    rows, files = parts["context"]
    assert [(r["s_kv"], r["s_q"], r["method"]) for r in rows] == [
        (2, 2, "query_parallel"), (2, 2, "quilt"), (8, 4, "query_parallel"), (8, 4, "quilt")]  # s_q capped
    for r in rows:
        assert "error" not in r, r
        assert r["h"] == 16 and r["topk"] == 32 and r["dtype"] == "fp16" and r["workload"] == "glm53-like"
        assert r["rel_err"] < TOL and math.isfinite(r["ms"]) and r["ms"] > 0
        assert r["kv_tiles_per_query"] == r["kv_tiles"] / r["s_q"]
        assert r["ms_per_1k_queries"] == pytest.approx(r["ms"] * 1024 / r["s_q"])
        assert r["backend"] == "triton"
    qp = [r for r in rows if r["method"] == "query_parallel"]
    assert all(r["kv_tiles"] == r["s_q"] for r in qp)  # topk 32 fits one 64-row tile a query, h 16 one block
    quilt = [r for r in rows if r["method"] == "quilt"]
    assert all(r["speedup_vs_query_parallel"] > 0 and 0 <= r["reduction"] <= 1 for r in quilt)
    doc = _files_ok(files, "context")
    assert doc["arguments"]["context_lens"] == [2, 8] and doc["rows"] == json.loads(json.dumps(rows))
    md = "\n".join(sweeps.context_md(rows, "context_lengths.png"))
    assert "| 2 | 2 | 16 | query_parallel |" in md and "![](context_lengths.png)" in md


# --------------------------------------------------------------------------------------- sweep

@pytest.mark.interpret
def test_sweep_rows(parts):
    rows, files = parts["sweep"]
    assert [r["method"] for r in rows] == ["query_parallel", "quilt", "quilt"]
    assert "error" not in rows[0] and rows[0]["rel_err"] < TOL
    for r, G in zip(rows[1:], (2, 16)):
        assert "error" not in r, r
        assert r["group_size"] == G and r["clip_threshold"] == 0.5 and r["timed"].endswith("(fallback=False)")
        cfg = r["config"]
        assert cfg["group_size"] == G and cfg["clip_threshold"] == 0.5 and not cfg["fell_back_to_query_parallel"]
        p = r["plan"]
        assert p["merge_level"] == cfg["merge_level"] == min(G, 4)  # h=16: a program holds 4 queries
        assert p["merge_level"] <= G and isinstance(p["would_fall_back"], bool)
        # the plan statistics taken apart are those of the timed plan
        for k in ("rows_processed", "reduction", "tile_utilization"):
            assert p[k] == r[k]
        assert p["valid_pairs"] == 4 * 32 and 0 < p["rows_processed"] <= p["valid_pairs"]
        assert 0 < p["tile_utilization"] <= 1 and r["rel_err"] < TOL and r["plan_ms"] > 0
        assert r["speedup_vs_query_parallel"] == pytest.approx(rows[0]["ms"] / r["ms"])
    _files_ok(files, "sweep")
    md = "\n".join(sweeps.sweep_md(rows))
    assert "| 2 | 2 | 0.5 |" in md and "| 16 | 4 | 0.5 |" in md


def test_sweep_failing_timing_keeps_plan_stats(monkeypatch, tmp_path):
    """A point whose timing raises is an error row that still carries its plan statistics; the sweep
    goes on, and the plot draws tile utilization from them."""
    def boom(inputs, method, **kw):
        raise RuntimeError(f"no {method} today")

    monkeypatch.setattr(bench, "run_case", boom)
    rows = sweeps.sweep_rows((2, 8), (0.0, 1.0), h=16, s_q=16, s_kv=256, topk=64, dtype="fp16", device="cpu")
    assert len(rows) == 1 + 4 and all("no " in r["error"] for r in rows)
    pts = rows[1:]
    assert [(r["group_size"], r["clip_threshold"]) for r in pts] == [(2, 0.0), (2, 1.0), (8, 0.0), (8, 1.0)]
    assert all(0 < r["plan"]["tile_utilization"] <= 1 and r["plan"]["valid_pairs"] == 16 * 64 for r in pts)
    png = sweeps.plot_sweep(rows, tmp_path / "s.png")
    assert Path(png).read_bytes()[:8] == PNG
    assert "error: RuntimeError: no quilt today" in "\n".join(sweeps.sweep_md(rows))


# ----------------------------------------------------------------------------------- breakdown

def test_window_indices():
    idx = sweeps.window_indices(4, 6, 4)
    assert idx.dtype == torch.int32
    assert idx.tolist() == [[-1, 0, 1, 2], [0, 1, 2, 3], [1, 2, 3, 4], [2, 3, 4, 5]]  # causal windows at 2..5


@pytest.mark.interpret
def test_breakdown_rows(parts):
    rows, files = parts["breakdown"]
    assert [r["variant"] for r in rows] == list(sweeps.BREAKDOWN_VARIANTS)
    by = {r["variant"]: r for r in rows}
    for v, r in by.items():
        assert "error" not in r, r
        assert r["method"] == "query_parallel" and r["h"] == 16 and r["s_q"] == 4 and r["ms"] > 0
        assert r["backend"] == "triton"
    assert by["fp8"]["kv"] == "fp8" and by["full"]["kv"] == "bf16"
    for v in ("full", "fp8", "contiguous"):  # checked, each against a reference of its own kv / indices
        assert by[v]["rel_err"] < TOL and "float32 reference" in by[v]["check"]
    assert by["no_kv_load"]["check"] == sweeps.NOT_CHECKED and "rel_err" not in by["no_kv_load"]
    assert by["no_kv_load"]["outputs_finite"] and by["no_kv_load"]["config"]["skip_kv"]
    (s,) = sweeps.breakdown_summary(rows)
    assert s["full_ms"] == by["full"]["ms"]  # interpreter wall times: either order of full / no_kv_load
    assert s.get("compute_ms") == by["no_kv_load"]["ms"] or s.get("no_kv_load_invalid")
    _files_ok(files, "breakdown")
    md = "\n".join(sweeps.breakdown_md(rows))
    assert "| 16 | no_kv_load | bf16 |" in md and "not checked" in md


def _fake_breakdown(ms):
    return [{"method": "query_parallel", "variant": v, "h": h, "kv": "fp8" if v == "fp8" else "bf16",
             "workload": "glm53-like", "s_q": 16384, "s_kv": 65536, "topk": 2048, "ms": t, "tflops": 1.0,
             **({} if v == "no_kv_load" else {"rel_err": 1e-3})}
            for h, times in ms.items() for v, t in zip(sweeps.BREAKDOWN_VARIANTS, times)]


def test_breakdown_stage_arithmetic(tmp_path):
    # (full, fp8, contiguous, no kv load) ms; at h=64 FP8 beats dense (smaller rows win over dequant)
    rows = _fake_breakdown({16: (10.0, 12.0, 7.0, 4.0), 64: (20.0, 19.0, 18.0, 15.0)})
    s16, s64 = sweeps.breakdown_summary(rows)
    assert (s16["compute_ms"], s16["load_gather_ms"], s16["gather_ms"], s16["stream_load_ms"], s16["dequant_ms"]) == \
        (4.0, 6.0, 3.0, 3.0, 2.0)
    assert (s16["compute_share"], s16["load_gather_share"], s16["gather_share"]) == (0.4, 0.6, 0.3)
    assert s16["dequant_share_of_fp8"] == pytest.approx(2 / 12) and s64["dequant_ms"] == -1.0
    bars = dict(sweeps.breakdown_bars([s16, s64]))
    assert bars["h=16 dense"] == [("compute", 4.0), ("kv load (contiguous)", 3.0), ("scattered gather", 3.0)]
    assert bars["h=16 fp8"] == [("compute", 4.0), ("kv load + gather", 6.0), ("dequant", 2.0)]
    assert bars["h=64 fp8"] == [("compute", 15.0), ("kv load + gather + dequant", 4.0)]
    totals = {"h=16 dense": 10.0, "h=16 fp8": 12.0, "h=64 dense": 20.0, "h=64 fp8": 19.0}
    assert {label: sum(v for _, v in segs) for label, segs in bars.items()} == totals  # a bar adds up to its time
    assert Path(sweeps.plot_breakdown(rows, tmp_path / "b.png")).read_bytes()[:8] == PNG
    md = "\n".join(sweeps.breakdown_md(rows))
    assert "| 16 | 4.000 ms (40%) | 6.000 ms (60%) | 3.000 ms (30%) | 2.000 ms (17%) |" in md


def test_breakdown_no_kv_load_slower_than_full_gives_no_split():
    """A synthetic tile that costs more than the load it replaces does not isolate the compute."""
    (s,) = sweeps.breakdown_summary(_fake_breakdown({16: (8.5, 23.6, 8.5, 14.3)}))
    assert s["no_kv_load_invalid"] and "compute_ms" not in s and "stream_load_ms" not in s
    assert s["dequant_ms"] == pytest.approx(15.1)
    md = "\n".join(sweeps.breakdown_md(_fake_breakdown({16: (8.5, 23.6, 8.5, 14.3)})))
    assert "does not isolate the compute" in md
    bars = dict(sweeps.breakdown_bars([s]))  # still drawn: what was measured, each bar adding up to its time
    assert bars["h=16 dense"] == [("compute + kv load (contiguous)", 8.5), ("scattered gather", 0.0)]
    assert [k for k, _ in bars["h=16 fp8"]][-1] == "dequant"
    assert sum(v for _, v in bars["h=16 fp8"]) == pytest.approx(23.6)


def test_breakdown_missing_variant_leaves_its_stage_out():
    rows = [r for r in _fake_breakdown({16: (10.0, 12.0, 7.0, 4.0)}) if r["variant"] != "contiguous"]
    rows.append({"method": "query_parallel", "variant": "contiguous", "h": 16, "kv": "bf16", "error": "x"})
    (s,) = sweeps.breakdown_summary(rows)
    assert "gather_ms" not in s and s["load_gather_ms"] == 6.0
    assert dict(sweeps.breakdown_bars([s]))["h=16 dense"] == [("compute", 4.0), ("kv load + gather", 6.0)]


def test_estimates_are_positive_and_scale():
    full = {p: sweeps.estimate_seconds(p) for p in sweeps.PARTS}
    quick = {p: sweeps.estimate_seconds(p, s_q=4096) for p in sweeps.PARTS}
    assert all(0 < quick[p] < full[p] < 120 for p in sweeps.PARTS)
    with pytest.raises(ValueError):
        sweeps.estimate_seconds("grid")


# ------------------------------------------------------------------------------------------ CLI

@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of report")
def test_report_cpu_lists_sweeps_as_skipped(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["report", "--out-dir", str(out), "--skip", "overlap,clip,sweep", "-q"]) == 0
    assert "skipped (need a CUDA GPU): grid, layer, context, breakdown" in capsys.readouterr().out
    skipped = json.loads((out / "report.json").read_text())["skipped_need_gpu"]
    assert skipped == ["grid", "layer", "context", "breakdown"]
    assert sorted(p.name for p in out.iterdir()) == ["report.json", "report.md"]


def test_report_quick_needs_out_dir(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert main(["report", "--quick", "-q"]) == 2
    assert "--out-dir" in capsys.readouterr().err


def _fake_rows(part, kw):
    base = {"workload": kw["workload"], "kv": "bf16", "topk": kw["topk"], "tflops": 100.0, "rel_err": 2e-3}
    if part == "context":
        return [dict(base, method=m, h=h, s_kv=n, s_q=min(kw["s_q"], n), ms=ms, kv_tiles=t, ms_per_1k_queries=ms / 4,
                     kv_tiles_per_query=t / 4, **({"speedup_vs_query_parallel": 1.25} if m == "quilt" else {}))
                for n in kw["context_lens"] for h in kw["heads"]
                for m, ms, t in (("query_parallel", 5.0, 400), ("quilt", 4.0, 300))]
    if part == "sweep":
        plan = {"merge_level": 4, "would_fall_back": False, "tile_utilization": 0.8, "rows_processed": 10,
                "reduction": 0.5}
        return [dict(base, method="query_parallel", h=kw["h"], ms=9.0, kv_tiles=500)] + [
            dict(base, method="quilt", h=kw["h"], group_size=G, clip_threshold=t, ms=7.0, plan_ms=2.0, kv_tiles=300,
                 plan=plan, speedup_vs_query_parallel=9 / 7)
            for G in kw["group_sizes"] for t in kw["thresholds"]]
    return _fake_breakdown({h: (10.0, 12.0, 7.0, 4.0) for h in kw["heads"]})


def test_report_gpu_path_runs_sweeps(tmp_path, monkeypatch, capsys):
    """The GPU path with the measuring functions stubbed: each sweep writes its JSON, PNG and report.md
    section; --quick runs every GPU part at s_q 4096."""
    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "environment", lambda: {"gpu": "NVIDIA H200", "commit": "c", "date": "d",
                                                       "versions": {"torch": "t"}})

    def fake_grid(out, *, log=None, case_kwargs=None, **kw):
        calls["grid"] = case_kwargs
        row = {"method": "quilt", "workload": "glm53-like", "kv": "bf16", "h": 16, "ms": 6.9, "tflops": 300.0,
               "kv_tiles": 123, "plan_ms": 2.3, "rel_err": 2e-3,
               "config": {"group_size": 8, "merge_level": 4, "num_warps": 8, "num_stages": 2, "dv_split": 1}}
        Path(out).write_text(json.dumps({"gpu": "NVIDIA H200", "commit": "c", "date": "d", "versions": {},
                                         "rows": [row]}))
        return [row]

    monkeypatch.setattr(bench, "run_grid", fake_grid)
    for part in sweeps.PARTS:
        def fake(*, log=None, _part=part, **kw):
            calls[_part] = kw
            return _fake_rows(_part, kw)
        monkeypatch.setitem(sweeps._ROWS, part, fake)

    out = tmp_path / "gpu"
    assert main(["report", "--out-dir", str(out), "--skip", "overlap,clip,layer", "--context-lens", "8192,131072",
                 "--sweep-thresholds", "0,1", "-q"]) == 0
    assert calls["grid"] is None
    assert calls["context"]["context_lens"] == (8192, 131072) and calls["context"]["s_q"] == 16384
    assert calls["context"]["heads"] == (16,) and calls["context"]["dtype"] == "bf16"
    assert calls["context"]["backend"] == calls["sweep"]["backend"] == "triton" and "backend" not in calls["breakdown"]
    assert calls["sweep"]["group_sizes"] == (2, 4, 8, 16) and calls["sweep"]["thresholds"] == (0.0, 1.0)
    assert (calls["sweep"]["h"], calls["sweep"]["s_q"], calls["sweep"]["s_kv"]) == (16, 16384, 65536)
    assert calls["breakdown"]["heads"] == (16, 64) and calls["breakdown"]["s_q"] == 16384
    for part in sweeps.PARTS:
        doc = json.loads((out / f"{sweeps.FILES[part]}.json").read_text())
        assert doc["gpu"] == "NVIDIA H200" and doc["command"].startswith("quilt-bench report --out-dir")
        assert (out / f"{sweeps.FILES[part]}.png").read_bytes()[:8] == PNG
    md = (out / "report.md").read_text()
    for heading in ("## Latency by context length", "## Group size x tile-aware clipping threshold",
                    "## Where the query-parallel kernel's time goes"):
        assert heading in md
    assert "| 131072 | 16384 | 16 | quilt | 4.000 |" in md and "![](context_lengths.png)" in md
    idx = json.loads((out / "report.json").read_text())
    assert idx["parts"] == ["grid", "context", "sweep", "breakdown"] and idx["skipped_need_gpu"] == []

    # --quick: every GPU part at s_q 4096
    assert main(["report", "--quick", "--out-dir", str(tmp_path / "q"), "--skip", "overlap,clip,layer", "-q"]) == 0
    assert calls["grid"] == {"s_q": 4096}
    assert calls["context"]["s_q"] == calls["sweep"]["s_q"] == calls["breakdown"]["s_q"] == 4096
    assert not list(tmp_path.glob("**/BENCHMARKS.md"))


# ------------------------------------------------------------------------------ CUDA breakdown

@pytest.mark.interpret
def test_cuda_breakdown_rows_with_a_stand_in(cuda_stand_in, monkeypatch):
    """The CUDA breakdown's loop on the CPU: the stand-in (the Triton pass the kernel mirrors) ignores the
    stage switch, so this checks the plumbing: every variant launched with its switch and timed, QUILT
    below 64 heads and the query programs at 64, only ``cuda_full`` checked against the reference."""
    from quilt_attn.ops import cuda_backend

    stand_in, switches = cuda_backend.launch, []

    def launch(*a, _skip=0, **k):
        switches.append(_skip)
        return stand_in(*a, **k)

    monkeypatch.setattr(cuda_backend, "launch", launch)
    rows = sweeps.cuda_breakdown_rows([("glm53-like", 16), ("glm53-like", 64)], s_q=4, s_kv=64, topk=32,
                                      dtype="fp16", device="cpu", check_rows=4, timing=dict(warmup=1, rep=1))
    assert [(r["h"], r["variant"]) for r in rows] == [(h, v) for h in (16, 64) for v in sweeps.CUDA_BREAKDOWN_VARIANTS]
    assert switches == [0, 0, 1, 2, 3] * 2  # the checked launch, then one timed launch a variant
    assert [r["method"] for r in rows] == ["quilt"] * 4 + ["query_parallel"] * 4
    assert [p is not None for p in cuda_stand_in] == [True] * 5 + [False] * 5
    for r in rows:
        assert r["backend"] == "cuda" and r["lib"] == "package" and r["ms"] > 0
        if r["variant"] == "cuda_full":
            assert r["rel_err"] < TOL and "float32 reference" in r["check"]
        else:
            assert "rel_err" not in r and r["check"] == sweeps.CUDA_NOT_CHECKED
    assert cuda_backend._LIB is None and cuda_backend._OVERRIDE is None  # the package's build, loaded on next use


def test_cuda_breakdown_md_and_the_breakdown_section_with_cuda_rows():
    cuda = [{"workload": "glm53-like", "h": 64, "method": "query_parallel", "lib": "package", "variant": v, "ms": t,
             "tflops": 1.0, "backend": "cuda", **({"rel_err": 1.9e-3} if v == "cuda_full" else {})}
            for v, t in zip(sweeps.CUDA_BREAKDOWN_VARIANTS, (9.0, 7.5, 5.25, 3.25))]
    md = sweeps.cuda_breakdown_md(cuda)
    assert "| glm53-like | 64 | query_parallel | package | 9.000 | 7.500 | 5.250 | 3.250 | 1.500 | 3.750 | 1.9e-03 |" in md
    assert sweeps.cuda_breakdown_md([]) == []
    rows = _fake_breakdown({16: (10.0, 12.0, 7.0, 4.0)}) + cuda
    assert [s["h"] for s in sweeps.breakdown_summary(rows)] == [16]  # the CUDA rows stay out of the Triton stages
    text = "\n".join(sweeps.breakdown_md(rows))
    assert "### The CUDA kernel" in text and "| 16 | 4.000 ms (40%) |" in text
