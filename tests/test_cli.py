"""Command line (``quilt-attn`` / ``python -m quilt_attn``): help, every subcommand at a tiny size, errors.

CPU-only and fast: ``demo`` runs the Triton kernels in the interpreter (``main`` sets
``TRITON_INTERPRET=1`` itself when there is no GPU); ``bench``'s grid loop is exercised with
``quilt_attn.bench`` stubbed out.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quilt_attn import cli
from quilt_attn.cli import main

COMMANDS = ("overlap", "plan", "demo", "bench", "report")
SMALL = ["--s-q", "64", "--s-kv", "1024", "--topk", "64", "--device", "cpu"]
TINY_DEMO = ["demo", "--s-q", "16", "--s-kv", "512", "--topk", "32", "--heads", "4", "--check-rows", "16"]


@pytest.fixture(autouse=True)
def _restore_triton_interpret(monkeypatch):
    """``main`` may set TRITON_INTERPRET=1 (no GPU); keep that from leaking into other test files."""
    if "TRITON_INTERPRET" in os.environ:
        monkeypatch.setenv("TRITON_INTERPRET", os.environ["TRITON_INTERPRET"])
    else:  # set first so that monkeypatch records "absent" and deletes it again afterwards
        monkeypatch.setenv("TRITON_INTERPRET", "")
        monkeypatch.delenv("TRITON_INTERPRET")


def _skip_unless_kernels_can_interpret():
    """On the CPU the kernels must be defined under TRITON_INTERPRET=1: skip if another test file
    imported them without it (run the suite with TRITON_INTERPRET=1, as `make test` does)."""
    mod = sys.modules.get("quilt_attn.ops.sparse_attention")
    if (not torch.cuda.is_available() and mod is not None
            and type(mod._sparse_attention_kernel).__name__ != "InterpretedFunction"):
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1 earlier in this process")


def _options(command: str) -> list[str]:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, cli.argparse._SubParsersAction))
    return [o for a in sub.choices[command]._actions for o in a.option_strings if o.startswith("--")]


# ------------------------------------------------------------------------------------ help

def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "usage: quilt-attn" in out
    for command in COMMANDS:
        assert command in out


@pytest.mark.parametrize("command", COMMANDS)
def test_help_mentions_every_option(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    options = _options(command)
    assert "--help" in options and "--quiet" in options
    for option in options:
        assert option in out, f"{command} --help does not mention {option}"


def test_help_options_are_the_requested_ones():
    assert {"--workload", "--indices", "--s-q", "--s-kv", "--topk", "--seed", "--device", "--plot",
            "--json"} <= set(_options("overlap"))
    assert {"--group-size", "--tile", "--clip-threshold", "--importance-clip", "--merge-level",
            "--method"} <= set(_options("plan"))
    assert {"--s-q", "--s-kv", "--topk", "--heads", "--workload"} <= set(_options("demo"))
    assert {"--heads", "--workloads", "--kv", "--methods", "--s-q", "--s-kv", "--topk", "--out",
            "--configs"} <= set(_options("bench"))
    assert {"--out-dir", "--cpu-only", "--skip", "--clip-s-q", "--overlap-s-q", "--layer-heads"} <= set(_options("report"))


def test_python_dash_m_help():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run([sys.executable, "-m", "quilt_attn", "--help"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "usage: quilt-attn" in res.stdout and "demo" in res.stdout


# --------------------------------------------------------------------------------- overlap

def test_overlap_prints_table_and_writes_png_and_json(tmp_path, capsys):
    png, js = tmp_path / "sub" / "overlap.png", tmp_path / "overlap.json"
    assert main(["overlap", "--workload", "glm53-like", *SMALL, "--plot", str(png), "--json", str(js)]) == 0
    cap = capsys.readouterr()
    assert "overlap profile: s_q=64 topk=64 s_kv=1024" in cap.out
    assert "cascaded 8->1" in cap.out and "pairwise overlap" in cap.out
    assert "generating workload glm53-like" in cap.err and "s]" in cap.err  # progress with elapsed time
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(js.read_text())
    assert doc["source"] == {"workload": "glm53-like", "s_q": 64, "s_kv": 1024, "topk": 64, "seed": 0}
    assert doc["profile"]["s_q"] == 64 and set(doc["profile"]["fixed_group"]) == {"2", "4", "8", "16"}


def test_overlap_of_loaded_indices(tmp_path, capsys):
    from quilt_attn.workloads import generate, save_indices

    path = tmp_path / "idx.npy"
    save_indices(generate("identical", 32, 256, 16, seed=1), path)
    assert main(["overlap", "--indices", str(path), "--group-sizes", "2,4", "--cascade-group", "4", "-q"]) == 0
    cap = capsys.readouterr()
    assert "overlap profile: s_q=32 topk=16 s_kv=None" in cap.out
    assert "idx.npy" in cap.out and cap.err == ""  # --quiet: no progress lines
    assert "pairwise overlap: 1.000" in cap.out  # identical lists in blocks of 16


# ------------------------------------------------------------------------------------ plan

@pytest.mark.parametrize("extra", [[], ["--merge-level", "4", "--method", "sort", "--tile", "16"],
                                   ["--importance-clip", "--clip-threshold", "0.75"]])
def test_plan_prints_summary(extra, tmp_path, capsys):
    js = tmp_path / "plan.json"
    assert main(["plan", "--workload", "ds32-like", *SMALL, *extra, "--json", str(js)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("QUILT plan: s_q=64 topk=64 group_size=8")
    assert "rows processed (logical)" in out and "tiles" in out and "dropped pairs" in out
    stats = json.loads(js.read_text())["stats"]
    assert stats["valid_pairs"] == 64 * 64 and 0 < stats["rows_processed"] <= 64 * 64


# ------------------------------------------------------------------------------------ demo

def test_demo_tiny_passes(capsys):
    _skip_unless_kernels_can_interpret()
    assert main([*TINY_DEMO, "--quiet"]) == 0
    out = capsys.readouterr().out
    for line in ("check against the float32 reference", "rel L2 err", "max |d lse|", "KV reduction",
                 "kv rows processed", "tiles of", "demo: PASS"):
        assert line in out
    checks = [ln for ln in out.splitlines() if "rel L2 err" in ln and not ln.startswith("check")]
    assert [ln.split()[0] for ln in checks] == ["quilt", "query_parallel"]
    assert all(ln.rstrip().endswith("OK") for ln in checks)
    if not torch.cuda.is_available():
        assert os.environ.get("TRITON_INTERPRET") == "1"
        assert "Triton interpreter" in out and "mean NOTHING" in out


def test_demo_cuda_backend_path_with_a_stand_in_kernel(cuda_stand_in, capsys):
    """The demo's CUDA-backend path on the CPU: the sm_90a kernel replaced by the Triton pass it mirrors.
    Its plan keeps private rows in the tiles (no private pass to count) and every result is checked."""
    _skip_unless_kernels_can_interpret()
    plans = cuda_stand_in
    assert main([*TINY_DEMO, "--backend", "cuda", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "backend cuda" in out and "demo: PASS" in out and "+ 0 x 64 rows private" in out
    assert plans and all(p is None or not p.split_private for p in plans)


def test_demo_check_failure_exits_nonzero(monkeypatch, capsys):
    _skip_unless_kernels_can_interpret()
    monkeypatch.setitem(cli.TOLERANCE, "fp16", 1e-12)
    monkeypatch.setitem(cli.TOLERANCE, "bf16", 1e-12)
    assert main([*TINY_DEMO, "--workload", "random", "-q"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "demo: FAIL" in out


# ----------------------------------------------------------------------------------- bench

def test_bench_without_cuda_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "--heads", "16", "--workloads", "random"]) == 2
    err = capsys.readouterr().err
    assert "bench needs a CUDA GPU" in err


def test_bench_grid_records_errors_and_speedups(monkeypatch, tmp_path, capsys):
    """The grid loop with quilt_attn.bench stubbed: a failing configuration becomes an error row."""
    from quilt_attn import bench

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


# ------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("argv, needle", [
    (["overlap", "--workload", "no-such-workload"], "--workload"),
    (["plan", "--workload", "bogus"], "--workload"),
    (["demo", "--workload", "bogus"], "--workload"),
    (["bench", "--workloads", "glm53-like,bogus"], "--workloads"),
    (["bench", "--methods", "quilt,flash"], "--methods"),
    (["bench", "--configs", "num_wraps=4"], "--configs"),
    (["plan", "--group-size", "12"], "--group-size"),
    (["plan", "--clip-threshold", "2"], "--clip-threshold"),
    (["demo", "--s-q", "0"], "--s-q"),
    (["overlap", "--workload", "random", "--indices", "x.npy"], "--indices"),
])
def test_bad_arguments_name_the_argument(argv, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err and "error" in err


@pytest.mark.parametrize("argv, needle", [
    (["plan", "--s-q", "2048", "--s-kv", "1024", "--topk", "8", "--device", "cpu"], "--s-q"),
    (["demo", "--s-q", "64", "--s-kv", "32"], "--s-q"),
    (["plan", *SMALL, "--merge-level", "16"], "--merge-level"),
    (["plan", *SMALL, "--importance-clip", "--merge-level", "2"], "--importance-clip"),
    (["overlap", "--indices", "/nonexistent/idx.npy"], "--indices"),
])
def test_bad_values_exit_2_with_message(argv, needle, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "error" in err


def test_bad_files_and_folders_exit_2_in_one_line(tmp_path, capsys):
    """A corrupt index file, an output folder that is a file, a workload without an indexer model:
    exit 2 and one line on stderr, never a traceback."""
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(bytes(range(256)))
    assert main(["plan", "--indices", str(corrupt), "-q"]) == 2
    err = capsys.readouterr().err
    assert "--indices" in err and "corrupt.pt" in err and "Traceback" not in err and err.count("\n") == 1
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    assert main(["report", "--out-dir", str(a_file), "-q", "--skip", "clip,overlap"]) == 2
    err = capsys.readouterr().err
    assert "--out-dir" in err and "not a folder" in err and err.count("\n") == 1
    with pytest.raises(SystemExit) as exc:
        main(["report", "--out-dir", str(tmp_path / "r"), "--clip-workloads", "random"])
    assert exc.value.code == 2 and "--clip-workloads" in capsys.readouterr().err


def test_main_turns_value_errors_into_exit_2(monkeypatch, capsys):
    """The one handler in main: a ValueError / TypeError / OSError a command meets is one line and exit 2."""
    build, raised = cli.build_parser, []

    def boom(args, log):
        raise raised[-1]

    def parser_with_boom():
        p = build()
        for action in p._subparsers._group_actions:
            action.choices["plan"].set_defaults(func=boom)
        return p

    monkeypatch.setattr(cli, "build_parser", parser_with_boom)
    for err in (ValueError("bad\nvalue"), TypeError("bad type"), FileExistsError(17, "File exists", "/x")):
        raised.append(err)
        assert main(["plan", "-q"]) == 2
        out = capsys.readouterr().err
        assert out.startswith("quilt-attn plan: error: ") and out.count("\n") == 1, out


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
        assert doc["command"].startswith("quilt-attn report --out-dir") and doc["gpu"] == "cpu"
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
def test_report_cpu_needs_out_dir_and_keeps_out_of_results(capsys):
    assert main(["report", "-q"]) == 2
    assert "--out-dir" in capsys.readouterr().err
    assert main(["report", "--out-dir", str(REPO / "benchmarks" / "results"), "-q"]) == 2
    assert "--out-dir" in capsys.readouterr().err


def test_report_skip_and_cpu_only(tmp_path, capsys):
    out = tmp_path / "r"
    assert main(["report", "--cpu-only", "--out-dir", str(out), "--skip", "clip", "--no-plots",
                 "--overlap-workloads", "ds32-like", *TINY_REPORT]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["overlap_presets.json", "report.json", "report.md"]
    assert json.loads((out / "report.json").read_text())["parts"] == ["overlap"]


def test_report_md_from_results_keeps_hand_written_part(tmp_path):
    """write_benchmarks_md (the logic of benchmarks/make_benchmarks_md.py) on a fabricated results file."""
    from quilt_attn.report import MARKER, write_benchmarks_md

    row = {"method": "quilt", "workload": "glm53-like", "kv": "bf16", "h": 16, "ms": 6.9, "tflops": 300.0,
           "kv_tiles": 123, "plan_ms": 2.3, "rel_err": 2e-3, "speedup_vs_query_parallel": 1.2,
           "config": {"fell_back_to_query_parallel": False}}
    res = tmp_path / "results" / "g.json"
    res.parent.mkdir()
    res.write_text(json.dumps({"gpu": "NVIDIA H200", "commit": "abc", "date": "d", "versions": {},
                               "rows": [row, {"method": "quilt", "workload": "x", "kv": "bf16", "h": 8, "error": "e"}]}))
    md = tmp_path / "B.md"
    md.write_text("old\n" + MARKER + "\nhand-written\n")
    write_benchmarks_md(str(res), target=md, root=tmp_path)
    text = md.read_text()
    assert "| glm53-like | bf16 | 16 | quilt | triton | 6.90 |" in text and "1.20x" in text
    assert text.endswith(MARKER + "\nhand-written\n") and "old" not in text
    assert "results/g.json" in text and (tmp_path / "results" / "g.png").exists()


def test_report_gpu_path_wiring(tmp_path, monkeypatch, capsys):
    """The GPU path with the GPU work stubbed out: grid -> JSON -> BENCHMARKS.md writer, layer proxy JSON."""
    import quilt_attn.bench as bench
    import quilt_attn.layer as layer
    import quilt_attn.report as report

    calls = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "environment", lambda: {"gpu": "NVIDIA H200", "commit": "c", "date": "d",
                                                       "versions": {"torch": "t"}})

    def fake_grid(out, *, only=None, extra=None, log=None, **kw):
        calls["grid"] = (out, only, extra)
        Path(out).write_text("{}")
        return [{"method": "quilt", "workload": "glm53-like", "kv": "bf16", "h": 8, "error": "boom"}]

    monkeypatch.setattr(bench, "run_grid", fake_grid)
    monkeypatch.setattr(report, "write_benchmarks_md", lambda path: calls.setdefault("md", path) and tmp_path / "B.md")
    monkeypatch.setattr(layer, "layer_proxy", lambda **kw: calls.setdefault("layer", kw) and [
        {"heads": 16, "workload": "glm53-like", "method": "quilt", "stages_ms": {"total": 2.0, "attention": 1.0},
         "attention_share": 0.5, "layer_speedup_vs_query_parallel": 1.1}])
    out = tmp_path / "gpu"
    assert main(["report", "--out-dir", str(out), "--skip", "overlap,clip,context,sweep,breakdown",
                 "-q"]) == 1  # the grid had an error
    assert calls["grid"][0] == str(out / "nvidia-h200.json") and calls["grid"][2]["command"].startswith("quilt-attn")
    assert calls["md"] == str(out / "nvidia-h200.json")
    assert calls["layer"]["heads"] == [16, 128]
    doc = json.loads((out / "layer_proxy.json").read_text())
    assert doc["gpu"] == "NVIDIA H200" and doc["rows"][0]["heads"] == 16
    assert json.loads((out / "report.json").read_text())["skipped_need_gpu"] == []
    assert "| 16 | glm53-like | quilt | 2.00 | 1.00 | 50% | 1.10x |" in (out / "report.md").read_text()


@pytest.mark.parametrize("given,recorded", [("5e170cd", "5e170cd"), ("5e170cd+dirty", "5e170cd+dirty"),
                                            ("abc", "unknown"), ("not a hash at all, far too long" * 2, "unknown")])
def test_result_files_record_a_given_commit(monkeypatch, given, recorded):
    from quilt_attn.bench import environment

    monkeypatch.setenv("QUILT_COMMIT", given)
    assert environment()["commit"] == recorded
