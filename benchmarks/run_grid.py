"""The recorded benchmark grid (benchmarks/results/<gpu>.json): realistic workloads first.

Runs each (workload, kv, h) input set once, then its methods; speedup = query-parallel ms / ms.
The grid and its loop live in ``quilt_attn.bench`` (``GRID``, ``run_grid``), shared with
``quilt-attn report``.
"""
import argparse
import sys

from quilt_attn.bench import format_rows, run_grid

p = argparse.ArgumentParser(description=__doc__)
p.add_argument("--out", required=True)
p.add_argument("--only", default="", help="comma-separated workloads to keep")
a = p.parse_args()
rows = run_grid(a.out, only=[w for w in a.only.split(",") if w] or None,
                extra={"command": "python " + " ".join(sys.argv)})
print(format_rows([r for r in rows if "ms" in r]))
