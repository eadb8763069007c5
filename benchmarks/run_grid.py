"""The recorded benchmark grid (benchmarks/results/<gpu>.json): realistic workloads first.

Runs each (workload, kv, h) input set once, then its methods; speedup = query-parallel ms / ms. Every row is
checked against the float32 reference on sampled queries. The grid and its loop live in
``quilt_bench.bench`` (``GRID``, ``run_grid``), shared with ``quilt-bench report``.

    python benchmarks/run.py grid --out benchmarks/results/h200.json [--only glm53-like,random]
"""
from __future__ import annotations

import argparse
import sys


def main(argv=None, prog=None) -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON results (with GPU, commit, versions)")
    p.add_argument("--only", default="", help="comma-separated workloads to keep")
    a = p.parse_args(argv)
    from quilt_bench.bench import format_rows, run_grid

    rows = run_grid(a.out, only=[w for w in a.only.split(",") if w] or None,
                    extra={"command": "python " + " ".join(sys.argv)})
    print(format_rows([r for r in rows if "ms" in r]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
