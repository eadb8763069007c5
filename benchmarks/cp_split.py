"""Context-parallel query splits on one GPU: zigzag (``quilt_attn.distributed.query_shards``) against
round-robin (``round_robin_shards``, SGLang's), the ranks simulated one after another.

For each workload and W in ``--world-sizes``, each split and each rank r: the rank's queries
(``q[pos]``, ``indices[pos]``) are planned as ``sparse_prefill`` plans them (``quilt_attn.plan_ahead``, the
default settings for the backend at ``--heads`` heads) and attended over the whole context (the kv an
all-gather gives the rank). Per rank: kernel time with the prebuilt plan (median of
``triton.testing.do_bench`` over two rotating input sets, ``quilt_bench.bench.time_ms``), the plan's kv tiles
(``Plan.stats["tiles"]``, plus its private tiles when the plan splits them off), a reference check on
sampled queries (``quilt_bench.bench.check``), the distinct rows its indices reference and the bytes it must
fetch from other ranks (rows outside its own kv shard ``kv_shard(s_kv, W, r)``, x 1152 B a bf16 row of 576),
against the all-gather's ``(W - 1) ceil(s_kv / W)`` rows; ``choose_fetch`` says which mode ``fetch="auto"``
takes; whether the rank's outputs equal the one-GPU call's rows bit for bit (zigzag: they must; round-robin
groups differ, so they differ in rounding). Per split: the slowest rank (the CP step), the sum over ranks,
and the total tiles over the one-GPU plan's (the target: zigzag <= 1.03x at W = 8 on glm53-like).

Without CUDA but with ``TRITON_INTERPRET=1`` the GPU mode runs in the interpreter (a smoke run of this
script at tiny sizes, ``--dtype fp16``; its times mean nothing).

``--cpu``: no kernels; the torch planner on the CPU (the plan the CUDA backend runs, ``--plan-for``), a
smaller ``--s-q``; prints tile counts and fetch bytes only.

Usage (GPU):  python benchmarks/run.py cp-split --out $OUT/h200_cp_split.json
      (CPU):  python benchmarks/run.py cp-split --cpu --s-q 16384 --workloads glm53-like
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from quilt_attn import plan_ahead, sparse_prefill
from quilt_attn.distributed import choose_fetch, query_shards, round_robin_shards, shard_positions
from quilt_attn.workloads import generate
from quilt_bench.bench import Case, Inputs, check, environment, make_inputs, rotating, save, time_ms

ROW_BYTES = 576 * 2  # a bf16 kv row
SPLITS = ("zigzag", "round_robin")


def positions(split: str, s_q: int, W: int, device) -> list[torch.Tensor]:
    if split == "zigzag":
        return [shard_positions(r, device=device) for r in query_shards(s_q, W)]
    return round_robin_shards(s_q, W, device=device)


def plan_tiles(p) -> dict:
    st = p.stats
    return {"tiles": st["tiles"], "private_tiles": st["private_tiles"], "kv_tiles": st["tiles"] + st["private_tiles"]}


def need_counts(idx: torch.Tensor, s_kv: int, W: int) -> list[int]:
    """Distinct valid rows ``idx`` references in each of the W kv shards."""
    S = -(-s_kv // W)
    mark = torch.zeros(W * S + 1, dtype=torch.int32, device=idx.device)
    key = idx.to(torch.int64)
    mark.index_fill_(0, torch.where((key >= 0) & (key < s_kv), key, W * S).view(-1), 1)
    return mark[:W * S].view(W, S).sum(1).tolist()


def fetch_fields(matrix: list[list[int]], s_kv: int, W: int) -> dict:
    S = -(-s_kv // W)
    remote = [sum(row) - row[r] for r, row in enumerate(matrix)]
    return {"unique_rows": [sum(row) for row in matrix], "remote_rows": remote,
            "fetch_bytes": [n * ROW_BYTES for n in remote], "all_gather_bytes": (W - 1) * S * ROW_BYTES,
            "auto_fetch": choose_fetch(matrix, s_kv, W)}


def summarize(row: dict, base_tiles: int) -> dict:
    t = [r["kv_tiles"] for r in row["ranks"]]
    row.update(total_kv_tiles=sum(t), tiles_vs_one_gpu=sum(t) / base_tiles,
               max_over_mean_tiles=max(t) * len(t) / sum(t))
    if "ms" in row["ranks"][0]:
        ms = [r["ms"] for r in row["ranks"]]
        row.update(max_rank_ms=max(ms), sum_rank_ms=sum(ms))
    return row


def line(row: dict) -> str:
    s = (f"{row['workload']:<11} W={row['W']:<2} {row['split']:<12} tiles {row['total_kv_tiles']:>9} "
         f"({row['tiles_vs_one_gpu']:.3f}x one GPU, max/mean rank {row['max_over_mean_tiles']:.3f})  "
         f"fetch max {max(row['fetch_bytes']) / 2**20:7.1f} MiB of all-gather {row['all_gather_bytes'] / 2**20:6.1f} "
         f"MiB -> auto {row['auto_fetch']}")
    if "max_rank_ms" in row:
        s += f"  ms max {row['max_rank_ms']:.3f} sum {row['sum_rank_ms']:.3f}"
    return s


def run_cpu(args) -> list[dict]:
    rows = []
    for wl in args.workloads:
        t0 = time.time()
        idx = generate(wl, args.s_q, args.s_kv, args.topk, seed=args.seed)
        base = plan_tiles(plan_ahead(idx, args.heads, s_kv=args.s_kv, backend=args.plan_for))
        rows.append({"workload": wl, "W": 1, "split": "one_gpu", **base})
        print(f"{wl:<11} one GPU: {base['kv_tiles']} kv tiles  ({time.time() - t0:.0f} s)", flush=True)
        for W in args.world_sizes:
            for split in SPLITS:
                ranks, matrix = [], []
                for pos in positions(split, args.s_q, W, "cpu"):
                    p = plan_ahead(idx[pos], args.heads, s_kv=args.s_kv, backend=args.plan_for)
                    ranks.append({"queries": int(pos.numel()), **plan_tiles(p)})
                    matrix.append(need_counts(idx[pos], args.s_kv, W))
                row = summarize({"workload": wl, "W": W, "split": split, "ranks": ranks,
                                 **fetch_fields(matrix, args.s_kv, W)}, base["kv_tiles"])
                rows.append(row)
                print(line(row) + f"  ({time.time() - t0:.0f} s)", flush=True)
    return rows


def run_gpu(args) -> list[dict]:
    # without CUDA (TRITON_INTERPRET=1, a smoke run of this path): the interpreter, whose times mean nothing
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for wl in args.workloads:
        case = Case(wl, args.heads, s_q=args.s_q, s_kv=args.s_kv, topk=args.topk, seed=args.seed, dtype=args.dtype)
        inputs = make_inputs(case, device=device)
        idx = inputs.indices

        one_gpu = []  # the one-GPU outputs, which a zigzag rank's must equal bit for bit

        def measure(sub: Inputs, plan, pos=None) -> dict:
            call = lambda q, kv: sparse_prefill(q, kv, sub.indices, plan=plan, backend=args.backend)  # noqa: E731
            out = call(*sub.sets[0])
            if device == "cuda":
                torch.cuda.synchronize()
            res = check(sub, *out, n_check=args.check_rows)
            if pos is None:
                one_gpu[:] = out
            else:
                res["same_bits_as_one_gpu"] = all(torch.equal(a, b[pos]) for a, b in zip(out, one_gpu))
            del out
            res["ms"] = time_ms(rotating(sub, call), warmup=args.warmup, rep=args.rep)
            return res

        p = plan_ahead(idx, args.heads, s_kv=args.s_kv, backend=args.backend)
        base = {**plan_tiles(p), **measure(inputs, p)}
        rows.append({"workload": wl, "W": 1, "split": "one_gpu", **base})
        print(f"{wl:<11} one GPU: {base['kv_tiles']} kv tiles, {base['ms']:.3f} ms, rel_err {base['rel_err']:.2e}",
              flush=True)
        for W in args.world_sizes:
            for split in SPLITS:
                ranks, matrix = [], []
                for pos in positions(split, args.s_q, W, idx.device):
                    sub = Inputs(Case(wl, args.heads, s_q=int(pos.numel()), s_kv=args.s_kv, topk=args.topk,
                                      dtype=args.dtype),
                                 idx[pos].contiguous(), [(q[pos].contiguous(), kv) for q, kv in inputs.sets])
                    p = plan_ahead(sub.indices, args.heads, s_kv=args.s_kv, backend=args.backend)
                    ranks.append({"queries": int(pos.numel()), **plan_tiles(p), **measure(sub, p, pos)})
                    matrix.append(need_counts(sub.indices, args.s_kv, W))
                    del sub, p
                row = summarize({"workload": wl, "W": W, "split": split, "ranks": ranks,
                                 **fetch_fields(matrix, args.s_kv, W)}, base["kv_tiles"])
                rows.append(row)
                same = all(r["same_bits_as_one_gpu"] for r in ranks)
                print(line(row) + f"  rel_err max {max(r['rel_err'] for r in ranks):.2e}  same bits {same}", flush=True)
                if device == "cuda":
                    torch.cuda.empty_cache()
        one_gpu.clear()  # (not del: measure() refers to it, a name of this function)
        del inputs
    return rows


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="tile counts only, torch planner on the CPU")
    ap.add_argument("--workloads", nargs="+", default=["glm53-like", "ds32-like", "random"])
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4, 8])
    ap.add_argument("--s-q", type=int, default=None, help="queries (default 65536 on the GPU, 8192 with --cpu)")
    ap.add_argument("--s-kv", type=int, default=131072)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="auto", help="GPU: the attention backend (plans follow it)")
    ap.add_argument("--plan-for", default="cuda", choices=["cuda", "triton"],
                    help="--cpu: plan as sparse_prefill plans for this backend (cuda: no split private rows)")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"], help="GPU mode: q and kv")
    ap.add_argument("--check-rows", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=25)
    ap.add_argument("--rep", type=int, default=100)
    ap.add_argument("--out", default=None, help="JSON file for the rows (with commit, GPU, versions)")
    args = ap.parse_args(argv)
    if args.s_q is None:
        args.s_q = 8192 if args.cpu else 65536
    if not args.cpu and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        print("no CUDA device: run with --cpu for the tile counts", file=sys.stderr)
        return 2
    env = environment()
    print(f"commit {env['commit']}  {env['gpu']}  {env['versions']}", flush=True)
    rows = run_cpu(args) if args.cpu else run_gpu(args)
    for row in rows:  # each row self-describing
        row.update(commit=env["commit"], gpu=env["gpu"], versions=env["versions"])
    if args.out:
        save(rows, args.out, extra={"args": vars(args), "mode": "cpu" if args.cpu else "gpu"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
