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


def test_report_is_a_stub(capsys):
    assert main(["report"]) == 2
    assert "not implemented" in capsys.readouterr().err
