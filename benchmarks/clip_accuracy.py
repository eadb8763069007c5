"""Accuracy of importance-aware clipping, per threshold, with q / kv that follow the indexer.

For each workload and threshold: plan with importance clipping (the kernel's default shape for
``--heads``: group 8, merge level 64 / h, private rows split off), rebuild the kept (query, row)
pairs, and compare the exact float64 reference on the kept pairs with the one on all pairs:
relative L2 error, worst-query cosine similarity, the attention probability mass of the dropped
pairs, and the tiles clipping saves (what it buys in kernel time). Runs on the CPU.

Usage: python benchmarks/clip_accuracy.py --out benchmarks/results/clip_accuracy.json
"""
import argparse
import json
import time

import torch

from quilt_attn import plan, sparse_prefill_reference
from quilt_attn.bench import environment
from quilt_attn.ops.sparse_attention import program_shape
from quilt_attn.workloads import indexer_aligned_inputs


def kept_indices(pl, indices: torch.Tensor, s_kv: int) -> torch.Tensor:
    """``indices`` with every pair the plan does not run set to -1 (rebuilt from tiles + private lists)."""
    s_q, G = indices.shape[0], pl.group_size
    covered = torch.zeros(s_q, s_kv, dtype=torch.bool)
    used = torch.arange(pl.capacity)[None, :] < pl.group_tiles[:, None]  # [n_groups, cap]
    for k in range(G):
        owns = used[:, :, None] & (pl.tile_kv >= 0) & (((pl.tile_mask >> k) & 1) == 1)
        g, t, c = torch.nonzero(owns, as_tuple=True)
        q = g * G + k
        ok = q < s_q
        covered[q[ok], pl.tile_kv[g, t, c][ok].long()] = True
    qi, j = torch.nonzero(pl.priv_idx >= 0, as_tuple=True)
    covered[qi, pl.priv_idx[qi, j].long()] = True
    valid = (indices >= 0) & (indices < s_kv)
    kept_mask = valid & covered.gather(1, indices.clamp(0, s_kv - 1).long())
    assert int((valid & ~kept_mask).sum()) == int(pl.dropped.sum())  # what is missing is what was dropped
    return torch.where(kept_mask, indices, -1)


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
    rows = []
    for wl in a.workloads.split(","):
        t0 = time.time()
        q, kv, idx, scale = indexer_aligned_inputs(wl, a.s_q, a.s_kv, a.topk, a.heads, d_qk=576,
                                                   dtype=torch.float64, device="cpu")
        full_out, _, full_lse = sparse_prefill_reference(q, kv, idx, scale, chunk=8)
        qp, _ = program_shape(a.heads, 8)
        base = plan(idx, s_kv=a.s_kv, merge_level=qp, split_private=True)
        base_tiles = base.stats["tiles"] + base.stats["private_tiles"]
        for tau in map(float, a.thresholds.split(",")):
            pl = plan(idx, s_kv=a.s_kv, merge_level=qp, split_private=True, importance_clip=True, clip_threshold=tau)
            kept = kept_indices(pl, idx, a.s_kv)
            out, _, lse = sparse_prefill_reference(q, kv, kept, scale, chunk=8)
            # probability mass of the dropped pairs under the full softmax: 1 - 2^(lse_kept - lse_full)
            mass = (1 - torch.exp2(lse.double() - full_lse.double())).clamp_min(0)
            err = float((out - full_out).norm() / full_out.norm())
            cos = torch.nn.functional.cosine_similarity(out.flatten(1), full_out.flatten(1), dim=1)
            st = pl.stats
            rows.append({
                "workload": wl, "clip_threshold": tau, "heads": a.heads, "s_q": a.s_q, "s_kv": a.s_kv,
                "topk": a.topk, "dropped_pair_fraction": st["dropped_pairs"] / st["valid_pairs"],
                "dropped_mass_mean": float(mass.mean()), "dropped_mass_max": float(mass.max()),
                "rel_err": err, "cosine_min": float(cos.min()), "cosine_mean": float(cos.mean()),
                "tiles_saved_fraction": 1 - (st["tiles"] + st["private_tiles"]) / base_tiles,
            })
            r = rows[-1]
            print(f"{wl:<11} tau={tau:<4} dropped {r['dropped_pair_fraction']:.4f} of pairs, mass mean "
                  f"{r['dropped_mass_mean']:.2e} max {r['dropped_mass_max']:.2e}, rel err {err:.2e}, cos min "
                  f"{r['cosine_min']:.5f}, tiles saved {r['tiles_saved_fraction']:.3f}  [{time.time() - t0:.0f}s]",
                  flush=True)
    doc = environment()
    doc["command"] = "python benchmarks/clip_accuracy.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "out")
    doc["rows"] = rows
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
