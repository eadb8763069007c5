"""Write BENCHMARKS.md and its plot from a recorded results file (no GPU needed).

Usage: python benchmarks/make_benchmarks_md.py benchmarks/results/h200.json
The logic lives in ``quilt_attn.report.write_benchmarks_md`` (shared with ``quilt-attn report``).
"""
import sys

from quilt_attn.report import write_benchmarks_md

if __name__ == "__main__":
    write_benchmarks_md(sys.argv[1])
