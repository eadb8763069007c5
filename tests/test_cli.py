"""Command line (``quilt-attn`` / ``python -m quilt_attn``): help, every subcommand at a tiny size, errors.

CPU-only and fast: ``demo`` runs the Triton kernels in the interpreter (``main`` sets
``TRITON_INTERPRET=1`` itself when there is no GPU). The harness's ``quilt-bench``: test_bench_cli.py.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import check_bad_argument_named, check_help_mentions_every_option, cli_options
from quilt_attn import cli
from quilt_attn.cli import main

COMMANDS = ("overlap", "plan", "demo")
SMALL = ["--s-q", "64", "--s-kv", "1024", "--topk", "64", "--device", "cpu"]
TINY_DEMO = ["demo", "--s-q", "16", "--s-kv", "512", "--topk", "32", "--heads", "4", "--check-rows", "16"]


pytestmark = pytest.mark.usefixtures("restore_triton_interpret")


def _skip_unless_kernels_can_interpret():
    """On the CPU the kernels must be defined under TRITON_INTERPRET=1: skip if another test file
    imported them without it (run the suite with TRITON_INTERPRET=1, as `make test` does)."""
    mod = sys.modules.get("quilt_attn.ops.sparse_attention")
    if (not torch.cuda.is_available() and mod is not None
            and type(mod._sparse_attention_kernel).__name__ != "InterpretedFunction"):
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1 earlier in this process")


def _options(command: str) -> list[str]:
    return cli_options(cli.build_parser(), command)


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
    check_help_mentions_every_option(main, cli.build_parser(), command, capsys)


def test_help_options_are_the_requested_ones():
    assert {"--workload", "--indices", "--s-q", "--s-kv", "--topk", "--seed", "--device", "--plot",
            "--json"} <= set(_options("overlap"))
    assert {"--group-size", "--tile", "--clip-threshold", "--importance-clip", "--merge-level",
            "--mask-method"} <= set(_options("plan"))
    assert {"--s-q", "--s-kv", "--topk", "--heads", "--workload"} <= set(_options("demo"))


def test_python_dash_m_help():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    res = subprocess.run([sys.executable, "-m", "quilt_attn", "--help"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "usage: quilt-attn" in res.stdout and "demo" in res.stdout
    assert "bench" not in res.stdout and "report" not in res.stdout  # the harness's (quilt-bench)


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


def test_overlap_plot_without_matplotlib_names_it(monkeypatch, tmp_path, capsys):
    """matplotlib is the harness's dependency, not the library's: without it --plot is one line, exit 2."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert main(["overlap", "--workload", "glm53-like", *SMALL, "-q", "--plot", str(tmp_path / "o.png")]) == 2
    err = capsys.readouterr().err
    assert "--plot" in err and "needs matplotlib" in err and err.count("\n") == 1
    assert not (tmp_path / "o.png").exists()


# ------------------------------------------------------------------------------------ plan

@pytest.mark.parametrize("extra", [[], ["--merge-level", "4", "--mask-method", "sort", "--tile", "16"],
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


# ------------------------------------------------------------------------------ bad input

@pytest.mark.parametrize("argv, needle", [
    (["overlap", "--workload", "no-such-workload"], "--workload"),
    (["plan", "--workload", "bogus"], "--workload"),
    (["demo", "--workload", "bogus"], "--workload"),
    (["plan", "--group-size", "12"], "--group-size"),
    (["plan", "--clip-threshold", "2"], "--clip-threshold"),
    (["demo", "--s-q", "0"], "--s-q"),
    (["overlap", "--workload", "random", "--indices", "x.npy"], "--indices"),
])
def test_bad_arguments_name_the_argument(argv, needle, capsys):
    check_bad_argument_named(main, argv, needle, capsys)


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
    """A corrupt index file, an output file in a folder that is a file: exit 2 and one line on stderr, never a
    traceback."""
    corrupt = tmp_path / "corrupt.pt"
    corrupt.write_bytes(bytes(range(256)))
    assert main(["plan", "--indices", str(corrupt), "-q"]) == 2
    err = capsys.readouterr().err
    assert "--indices" in err and "corrupt.pt" in err and "Traceback" not in err and err.count("\n") == 1
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    assert main(["plan", *SMALL, "-q", "--json", str(a_file / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert "plan: error:" in err and "Traceback" not in err and err.count("\n") == 1


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
