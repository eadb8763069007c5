"""The harness's command line (``quilt-bench`` / ``python -m quilt_bench``, ``quilt_bench.cli``): help, ``bench``'s
grid loop with ``quilt_bench.bench`` stubbed out, ``report``'s CPU path at a tiny size and its GPU wiring with the
GPU work stubbed, errors. CPU-only and fast."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import check_bad_argument_named, check_help_mentions_every_option, cli_options
from quilt_bench import cli
from quilt_bench.cli import main

COMMANDS = ("bench", "report")


pytestmark = pytest.mark.usefixtures("restore_triton_interpret")


def _options(command: str) -> list[str]:
    return cli_options(cli.build_parser(), command)


# ------------------------------------------------------------------------------------ help

@pytest.mark.parametrize("command", COMMANDS)
def test_help_mentions_every_option(command, capsys):
    check_help_mentions_every_option(main, cli.build_parser(), command, capsys)


def test_help_options_are_the_requested_ones(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "usage: quilt-bench" in capsys.readouterr().out
    assert {"--heads", "--workloads", "--kv", "--methods", "--s-q", "--s-kv", "--topk", "--out",
            "--configs"} <= set(_options("bench"))
    assert {"--out-dir", "--cpu-only", "--skip", "--clip-s-q", "--overlap-s-q",
            "--layer-heads"} <= set(_options("report"))


@pytest.mark.parametrize("argv, needle", [
    (["bench", "--workloads", "glm53-like,bogus"], "--workloads"),
    (["bench", "--methods", "quilt,flash"], "--methods"),
    (["bench", "--configs", "num_wraps=4"], "--configs"),
])
def test_bad_arguments_name_the_argument(argv, needle, capsys):
    check_bad_argument_named(main, argv, needle, capsys)


def test_report_bad_folders_exit_2_in_one_line(tmp_path, capsys):
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    assert main(["report", "--out-dir", str(a_file), "-q", "--skip", "clip,overlap"]) == 2
    err = capsys.readouterr().err
    assert "--out-dir" in err and "not a folder" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as exc:
        main(["report", "--out-dir", str(tmp_path / "r"), "--clip-workloads", "random"])
    assert exc.value.code == 2 and "--clip-workloads" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- bench

def test_bench_without_cuda_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--heads", "16", "--workloads", "random"]) == 2
    err = capsys.readouterr().err
    assert "bench needs a CUDA GPU" in err


def test_bench_grid_records_errors_and_speedups(monkeypatch, tmp_path, capsys):
    """The grid loop with quilt_bench.bench stubbed: a failing configuration becomes an error row."""
    from quilt_bench import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU X1")
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench, "environment", lambda: {"gpu": "Fake GPU X1", "commit": "abc"})
    made, calls = [], []

    def make_inputs(case):
        if case.workload == "ds32-like" and case.kv == "fp8":
            raise RuntimeError("out of memory")
        made.append(case)
        return bench.Inputs(case, None)

    def run_case(inputs, method, *, importance_clip=False, check_rows=256, **kw):
        calls.append((method, importance_clip, kw))
        if kw.get("num_warps") == 2:
            raise ValueError("bad config")
        c = inputs.case
        ms = {"query_parallel": 4.0, "quilt": 2.0}[method] + (0.5 if importance_clip else 0.0)
        cfg = {"group_size": 8, "merge_level": 1, "dv_split": 1, "num_warps": kw.get("num_warps", 8),
               "num_stages": 2, "clip_threshold": 0.5}
        return {"method": method + ("+iclip" if importance_clip else ""), "workload": c.workload, "kv": c.kv,
                "h": c.h, "s_q": c.s_q, "s_kv": c.s_kv, "topk": c.topk, "ms": ms, "tflops": 1.0,
                "rel_err": 0.2 if importance_clip else 1e-3, "lse_err": 0.0, "kv_tiles": 10, "plan_ms": 0.1,
                "config": cfg, "regs": None, "spills": None}

    monkeypatch.setattr(bench, "make_inputs", make_inputs)
    monkeypatch.setattr(bench, "run_case", run_case)
    out_path = tmp_path / "res" / "fake.json"
    rc = main(["bench", "--heads", "16", "--workloads", "glm53-like,ds32-like", "--kv", "bf16,fp8",
               "--s-q", "128", "--s-kv", "1024", "--topk", "64", "--configs", "num_warps=8,group_size=4",
               "num_warps=2", "--out", str(out_path)])
    assert rc == 1  # error rows
    cap = capsys.readouterr()
    assert len(made) == 3
    assert all(kw.get("group_size") is None for m, _, kw in calls if m == "query_parallel")
    assert ("quilt", True, {"num_warps": 8, "group_size": 4}) in calls
    doc = json.loads(out_path.read_text())
    assert doc["gpu"] == "Fake GPU X1" and doc["grid"]["heads"] == [16]
    rows = doc["rows"]
    assert len(rows) == 4 * 3 * 2  # (workload, kv) x methods x configs
    errors = [r for r in rows if "error" in r]
    assert len(errors) == 3 * 3 + 3 * 2  # 3 failing configs per good input set + a whole failed input set
    assert any("make_inputs: RuntimeError: out of memory" in r["error"] for r in errors)
    good = {r["method"]: r for r in rows if "error" not in r and r["workload"] == "glm53-like" and r["kv"] == "bf16"}
    assert good["query_parallel"]["speedup"] == 1.0
    assert good["quilt"]["speedup"] == 2.0 and good["quilt+iclip"]["speedup"] == 4.0 / 2.5
    assert "method" in cap.out and "speedup vs query_parallel" in cap.out
    assert "configuration(s) failed" in cap.out and "bad config" in cap.out
    assert "check FAILED" not in cap.out  # iclip rows are approximate by design


def test_gpu_slug():
    assert cli.gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert cli.gpu_slug("NVIDIA GeForce RTX 4090 (x)") == "nvidia-geforce-rtx-4090-x"


# ---------------------------------------------------------------------------------- report

TINY_REPORT = ["--overlap-s-q", "64", "--overlap-s-kv", "1024", "--overlap-topk", "64", "--clip-s-q", "16",
               "--clip-s-kv", "1024", "--clip-topk", "64", "--clip-thresholds", "0.5", "-q"]
REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of report")
def test_report_cpu_path_writes_out_dir_only(tmp_path, capsys):
    protected = [REPO / "BENCHMARKS.md", REPO / "benchmarks" / "results" / "h200.json"]
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in protected}
    out = tmp_path / "rep"
    assert main(["report", "--out-dir", str(out), *TINY_REPORT]) == 0
    cap = capsys.readouterr()
    assert "skipped (need a CUDA GPU): grid, layer, context, sweep, breakdown" in cap.out
    assert "workload: govreport-like" in cap.out and "cascaded 8->1" in cap.out
    names = {p.name for p in out.iterdir()}
    assert {"overlap_presets.json", "clip_accuracy_small.json", "report.md", "report.json",
            "overlap_glm53-like.png"} <= names
    assert not names & {"BENCHMARKS.md", "h200.json", "layer_proxy.json"}
    for name in ("overlap_presets.json", "clip_accuracy_small.json", "report.json"):
        doc = json.loads((out / name).read_text())
        assert doc["command"].startswith("quilt-bench report --out-dir") and doc["gpu"] == "cpu"
        assert doc["commit"] and {"torch", "triton", "python"} <= set(doc["versions"])
    ov = json.loads((out / "overlap_presets.json").read_text())["rows"]
    assert [r["workload"] for r in ov] == ["glm53-like", "ds32-like", "qasper-like", "govreport-like"]
    assert all(r["s_q"] == 64 and r["topk"] == 64 for r in ov)
    clip = json.loads((out / "clip_accuracy_small.json").read_text())["rows"]
    assert [(r["workload"], r["clip_threshold"], r["s_q"], r["s_kv"]) for r in clip] == \
        [("glm53-like", 0.5, 16, 1024), ("ds32-like", 0.5, 16, 1024)]
    idx = json.loads((out / "report.json").read_text())
    assert idx["parts"] == ["overlap", "clip"]
    assert idx["skipped_need_gpu"] == ["grid", "layer", "context", "sweep", "breakdown"]
    assert "Skipped (need a CUDA GPU): grid, layer, context, sweep, breakdown" in (out / "report.md").read_text()
    for p in protected:
        assert (p.read_bytes(), p.stat().st_mtime_ns) == before[p]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of report")
def test_report_cpu_needs_out_dir_and_keeps_out_of_gpu_results(tmp_path, capsys):
    """No default folder (nothing is written inside an install); a CPU or quick run never writes into a folder
    holding results recorded on a GPU (the repository's benchmarks/results, or any other)."""
    assert main(["report", "-q"]) == 2
    assert "--out-dir" in capsys.readouterr().err
    assert main(["report", "--out-dir", str(REPO / "benchmarks" / "results"), "-q"]) == 2
    assert "--out-dir" in capsys.readouterr().err
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    (recorded / "grid.json").write_text(json.dumps({"gpu": "NVIDIA H200", "rows": []}))
    for extra in ([], ["--quick"]):
        assert main(["report", "--out-dir", str(recorded), *extra, *TINY_REPORT]) == 2
        assert "recorded on a GPU" in capsys.readouterr().err
    assert sorted(p.name for p in recorded.iterdir()) == ["grid.json"]


def test_report_skip_and_cpu_only(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["report", "--cpu-only", "--out-dir", str(out), "--skip", "clip", "--no-plots",
                 "--overlap-workloads", "ds32-like", *TINY_REPORT]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["overlap_presets.json", "report.json", "report.md"]
    assert json.loads((out / "report.json").read_text())["parts"] == ["overlap"]


def test_report_gpu_path_wiring(tmp_path, monkeypatch, capsys):
    """The GPU path with the GPU work stubbed out: grid -> JSON, layer proxy JSON, report.md; no BENCHMARKS.md
    (benchmarks/make_benchmarks_md.py writes it from the recorded files)."""
    import quilt_bench.bench as bench
    import quilt_bench.layer as layer

    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "environment", lambda: {"gpu": "NVIDIA H200", "commit": "c", "date": "d",
                                                       "versions": {"torch": "t"}})

    def fake_grid(out, *, only=None, extra=None, log=None, **kw):
        calls["grid"] = (out, only, extra)
        Path(out).write_text("{}")
        return [{"method": "quilt", "workload": "glm53-like", "kv": "bf16", "h": 8, "error": "boom"}]

    monkeypatch.setattr(bench, "run_grid", fake_grid)
    monkeypatch.setattr(layer, "layer_proxy", lambda **kw: calls.setdefault("layer", kw) and [
        {"heads": 16, "workload": "glm53-like", "method": "quilt", "stages_ms": {"total": 2.0, "attention": 1.0},
         "attention_share": 0.5, "layer_speedup_vs_query_parallel": 1.1}])
    out = tmp_path / "gpu"
    assert main(["report", "--out-dir", str(out), "--skip", "overlap,clip,context,sweep,breakdown",
                 "-q"]) == 1  # the grid had an error
    assert calls["grid"][0] == str(out / "nvidia-h200.json") and calls["grid"][2]["command"].startswith("quilt-bench")
    assert not (out / "BENCHMARKS.md").exists()
    assert calls["layer"]["heads"] == [16, 128]
    doc = json.loads((out / "layer_proxy.json").read_text())
    assert doc["gpu"] == "NVIDIA H200" and doc["rows"][0]["heads"] == 16
    assert json.loads((out / "report.json").read_text())["skipped_need_gpu"] == []
    assert "| 16 | glm53-like | quilt | 2.00 | 1.00 | 50% | 1.10x |" in (out / "report.md").read_text()


@pytest.mark.parametrize("given,recorded", [("5e170cd", "5e170cd"), ("5e170cd+dirty", "5e170cd+dirty"),
                                            ("abc", "unknown"), ("not a hash at all, far too long" * 2, "unknown")])
def test_result_files_record_a_given_commit(monkeypatch, given, recorded):
    from quilt_bench.bench import environment

    monkeypatch.setenv("QUILT_COMMIT", given)
    assert environment()["commit"] == recorded


@pytest.mark.interpret
def test_sanitize_triton_case_checks_every_path(capsys):
    """The memcheck case runs every Triton path (plan, private rows, query programs, FP8 in the kernel) and
    checks each against the reference (exit 0); under compute-sanitizer on a GPU it is the memory proof."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import sanitize_triton

    assert sanitize_triton.main(["--s-q", "8", "--s-kv", "256", "--topk", "64"]) == 0
    out = capsys.readouterr().out
    assert out.count("rel-L2") == len(sanitize_triton.CASES) and "sanitize case OK" in out
