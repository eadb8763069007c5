"""Pieces of ``quilt-bench report`` (no GPU needed here).

* ``clip_accuracy``: accuracy of importance-aware clipping per threshold, with q / kv that follow
  the indexer.
* ``overlap_presets``: overlap profiles of the realistic workload presets.

(BENCHMARKS.md is generated from the recorded result files by ``benchmarks/make_benchmarks_md.py``.)
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

OVERLAP_PRESETS = ("glm53-like", "ds32-like", "qasper-like", "govreport-like")


# ------------------------------------------------------------------------------ clipping accuracy

def kept_indices(pl, indices: torch.Tensor, s_kv: int) -> torch.Tensor:
    """``indices`` with every pair the plan does not run set to -1 (rebuilt from tiles + private lists)."""
    s_q, G = indices.shape[0], pl.group_size
    covered = torch.zeros(s_q, s_kv, dtype=torch.bool)
    used = torch.arange(pl.capacity)[None, :] < pl.group_tiles[:, None]  # [n_groups, cap]
    tile_kv, tile_mask = pl.columns()  # (packed or wide plans alike)
    for k in range(G):
        owns = used[:, :, None] & (tile_kv >= 0) & (((tile_mask >> k) & 1) == 1)
        g, t, c = torch.nonzero(owns, as_tuple=True)
        q = g * G + k
        ok = q < s_q
        covered[q[ok], tile_kv[g, t, c][ok].long()] = True
    qi, j = torch.nonzero(pl.priv_idx >= 0, as_tuple=True)
    covered[qi, pl.priv_idx[qi, j].long()] = True
    valid = (indices >= 0) & (indices < s_kv)
    kept_mask = valid & covered.gather(1, indices.clamp(0, s_kv - 1).long())
    assert int((valid & ~kept_mask).sum()) == int(pl.dropped.sum())  # what is missing is what was dropped
    return torch.where(kept_mask, indices, -1)


def clip_accuracy(workloads=("glm53-like", "ds32-like"), thresholds=(0.25, 0.5, 0.75, 1.0), *, s_q: int = 256,
                  s_kv: int = 65536, topk: int = 2048, heads: int = 16, log=None) -> list[dict]:
    """Accuracy of importance-aware clipping per threshold (CPU, exact float64 reference).

    For each workload and threshold: plan with importance clipping (the kernel's default shape for
    ``heads``: group 8, merge level 64 / h, private rows split off), rebuild the kept (query, row)
    pairs, and compare the float64 reference on the kept pairs with the one on all pairs: relative
    L2 error, worst-query cosine similarity, the attention probability mass of the dropped pairs,
    and the tiles clipping saves. Returns one row per (workload, threshold).
    """
    from quilt_attn.ops.sparse_attention import program_shape
    from quilt_attn.planner import plan
    from quilt_attn.reference import sparse_prefill_reference
    from quilt_attn.workloads import indexer_aligned_inputs

    rows = []
    for wl in workloads:
        t0 = time.time()
        q, kv, idx, scale = indexer_aligned_inputs(wl, s_q, s_kv, topk, heads, d_qk=576,
                                                   dtype=torch.float64, device="cpu")
        full_out, _, full_lse = sparse_prefill_reference(q, kv, idx, scale, chunk=8)
        qp, _ = program_shape(heads, 8)
        base = plan(idx, s_kv=s_kv, merge_level=qp, split_private=True)
        base_tiles = base.stats["tiles"] + base.stats["private_tiles"]
        for tau in map(float, thresholds):
            pl = plan(idx, s_kv=s_kv, merge_level=qp, split_private=True, importance_clip=True, clip_threshold=tau)
            kept = kept_indices(pl, idx, s_kv)
            out, _, lse = sparse_prefill_reference(q, kv, kept, scale, chunk=8)
            # probability mass of the dropped pairs under the full softmax: 1 - exp(lse_kept - lse_full)
            mass = (1 - torch.exp(lse.double() - full_lse.double())).clamp_min(0)
            err = float((out - full_out).norm() / full_out.norm())
            cos = torch.nn.functional.cosine_similarity(out.flatten(1), full_out.flatten(1), dim=1)
            st = pl.stats
            r = {
                "workload": wl, "clip_threshold": tau, "heads": heads, "s_q": s_q, "s_kv": s_kv,
                "topk": topk, "dropped_pair_fraction": st["dropped_pairs"] / max(st["valid_pairs"], 1),
                "dropped_mass_mean": float(mass.mean()), "dropped_mass_max": float(mass.max()),
                "rel_err": err, "cosine_min": float(cos.min()), "cosine_mean": float(cos.mean()),
                "tiles_saved_fraction": 1 - (st["tiles"] + st["private_tiles"]) / max(base_tiles, 1),
            }
            rows.append(r)
            if log:
                log(f"{wl:<11} tau={tau:<4} dropped {r['dropped_pair_fraction']:.4f} of pairs, mass mean "
                    f"{r['dropped_mass_mean']:.2e} max {r['dropped_mass_max']:.2e}, rel err {err:.2e}, cos min "
                    f"{r['cosine_min']:.5f}, tiles saved {r['tiles_saved_fraction']:.3f}  [{time.time() - t0:.0f}s]")
    return rows


# ------------------------------------------------------------------------------------ overlap

def overlap_presets(workloads=OVERLAP_PRESETS, *, s_q: int = 2048, s_kv: int = 65536, topk: int = 2048,
                    seed: int = 0, device="cpu", plot_dir=None) -> list[dict]:
    """Overlap profile (``quilt_attn.overlap.overlap_profile``) of each workload; optional PNG per workload."""
    from quilt_attn.overlap import overlap_profile
    from quilt_attn.workloads import generate

    out = []
    for wl in workloads:
        idx = generate(wl, s_q, s_kv, topk, seed=seed, device=device)
        prof = overlap_profile(idx, s_kv=s_kv)
        entry = {"workload": wl, "s_q": s_q, "s_kv": s_kv, "topk": topk, "seed": seed, "profile": prof.to_dict(),
                 "table": prof.table()}
        if plot_dir is not None:
            png = Path(plot_dir) / f"overlap_{wl}.png"
            png.parent.mkdir(parents=True, exist_ok=True)
            prof.plot(str(png), title=f"{wl}: s_q={s_q}, topk={topk}, s_kv={s_kv}")
            entry["plot"] = str(png)
        out.append(entry)
    return out
