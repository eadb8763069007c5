"""Accuracy of importance-aware clipping, per threshold, with q / kv that follow the indexer.

For each workload and threshold: plan with importance clipping (the kernel's default shape for
``--heads``: group 8, merge level 64 / h, private rows split off), rebuild the kept (query, row)
pairs, and compare the exact float64 reference on the kept pairs with the one on all pairs:
relative L2 error, worst-query cosine similarity, the attention probability mass of the dropped
pairs, and the tiles clipping saves (what it buys in kernel time). Runs on the CPU.
The study lives in ``quilt_attn.report.clip_accuracy`` (shared with ``quilt-attn report``).

Usage: python benchmarks/clip_accuracy.py --out benchmarks/results/clip_accuracy.json
"""
import argparse

from quilt_attn.bench import environment
from quilt_attn.report import clip_accuracy, write_json


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--workloads", default="glm53-like,ds32-like")
    p.add_argument("--thresholds", default="0.25,0.5,0.75,1.0")
    p.add_argument("--s-q", type=int, default=256)
    p.add_argument("--s-kv", type=int, default=65536)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    a = p.parse_args()
    rows = clip_accuracy(a.workloads.split(","), [float(t) for t in a.thresholds.split(",")], s_q=a.s_q,
                         s_kv=a.s_kv, topk=a.topk, heads=a.heads, log=lambda m: print(m, flush=True))
    doc = environment()
    doc["command"] = "python benchmarks/clip_accuracy.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out")
    doc["rows"] = rows
    write_json(a.out, doc)


if __name__ == "__main__":
    main()
