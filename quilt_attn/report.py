"""Pieces of ``quilt-attn report`` shared with the benchmark scripts (no GPU needed here).

* ``clip_accuracy``: accuracy of importance-aware clipping per threshold, with q / kv that follow
  the indexer (``benchmarks/clip_accuracy.py``).
* ``overlap_presets``: overlap profiles of the realistic workload presets.
* ``write_benchmarks_md``: BENCHMARKS.md (the generated part above ``MARKER``) and its plot from a
  recorded grid results file (``benchmarks/make_benchmarks_md.py``), plus the sweeps of
  ``quilt_attn.sweeps`` recorded next to it.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

FLASHMLA_MS = {8: 7.98, 16: 7.98, 32: 7.98, 64: 7.98, 128: 15.6}  # sm90, padded to 64 heads (HOPPER-NOTES)
MARKER = "<!-- hand-written below -->"
GOAL_MS = {8: 1.8, 16: 3.0, 32: 4.8, 64: 7.6, 128: 15.5}  # glm53-like, bf16
OVERLAP_PRESETS = ("glm53-like", "ds32-like", "qasper-like", "govreport-like")
REPO_ROOT = Path(__file__).resolve().parent.parent


def write_json(path, doc: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")


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
    from .ops.sparse_attention import program_shape
    from .planner import plan
    from .reference import sparse_prefill_reference
    from .workloads import indexer_aligned_inputs

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
    from .overlap import overlap_profile
    from .workloads import generate

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


# ------------------------------------------------------------------------------- BENCHMARKS.md

def _rel(path: Path, root: Path) -> str:
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def write_benchmarks_md(results: str, *, target=None, root=None, png=None) -> Path:
    """Write the generated part of BENCHMARKS.md (above ``MARKER``) and its plot from grid results.

    results : a JSON written by ``quilt_attn.bench.run_grid`` / ``save``; the sweeps of
        ``quilt_attn.sweeps`` recorded in the same folder (``context_lengths.json``, ...) become
        sections below the grid table.
    target : the markdown file (default ``<root>/BENCHMARKS.md``); hand-written text below
        ``MARKER`` in an existing file is kept.
    root : paths in the text are relative to it (default: the repository root).
    png : the plot (default: ``results`` with a ``.png`` suffix).
    Returns the path written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    root = Path(root) if root is not None else REPO_ROOT
    results = Path(results).resolve()
    doc = json.loads(results.read_text())
    rows = [r for r in doc["rows"] if "ms" in r]
    png = Path(png) if png is not None else results.with_suffix(".png")
    target = Path(target) if target is not None else root / "BENCHMARKS.md"
    lines = [
        "# Benchmarks",
        "",
        f"GPU: {doc['gpu']}; commit `{doc['commit']}`; {doc['date']}; versions {doc['versions']}.",
        "Shape: s_q 16384 queries at the end of a 65536-token context, Top-K 2048, d_qk 576, d_v 512.",
        "Median of `triton.testing.do_bench` over two rotating input sets; every row checked against the",
        "float32 reference on 256 sampled queries in the same run (`rel_err`, relative L2 of `out`).",
        "`ms` is the attention kernel(s) with a prebuilt plan; `plan ms` is the planner alone (not overlapped).",
        "TFLOP/s = useful work 2*s_q*topk*h*(d_qk+d_v) / time. FlashMLA: the sm90 figures of",
        "HOPPER-NOTES (it pads 8-32 heads to 64). Reproduce: `python benchmarks/run_grid.py --out FILE`, then",
        f"`python benchmarks/make_benchmarks_md.py FILE` (or `quilt-attn report`). Raw rows: `{_rel(results, root)}`.",
        "",
        "| workload | kv | h | method | backend | ms | TFLOP/s | kv tiles | vs query-parallel (Triton) | vs FlashMLA | "
        "plan ms | rel_err | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        cfg = r.get("config", {})
        note = "ran query-parallel (fallback)" if cfg.get("fell_back_to_query_parallel") else ""
        if r.get("dropped_pairs"):
            note = f"dropped {r['dropped_pairs']} pairs"
        if r.get("backend_requested") == "auto":
            note = (note + "; " if note else "") + f"backend='auto' chose {r.get('backend')}"
        sp = r.get("speedup_vs_query_parallel")
        fm = FLASHMLA_MS.get(r["h"]) if r["workload"] != "random" else None
        vs_qp = f"{sp:.2f}x" if sp and (r["method"], r.get("backend")) != ("query_parallel", "triton") else ""
        vs_fm = f"{fm / r['ms']:.2f}x" if fm else ""
        lines.append(
            f"| {r['workload']} | {r['kv']} | {r['h']} | {r['method']} | {r.get('backend', 'triton')} | {r['ms']:.2f} | "
            f"{r['tflops']:.0f} | "
            f"{r['kv_tiles']} | {vs_qp} | {vs_fm} | {r['plan_ms']:.2f} | {r['rel_err']:.1e} | {note} |")
    lines += ["", f"![latency by head count]({_rel(png, root)})", ""]
    # the report's sweeps recorded next to the grid results (quilt_attn.sweeps), when there are any
    from .sweeps import recorded_sections

    lines += recorded_sections(results.parent, rel=lambda p: _rel(p, root))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (wl, kv, m, be), style in [(("glm53-like", "bf16", "query_parallel", "triton"), "o--"),
                                   (("glm53-like", "bf16", "quilt", "triton"), "o-"),
                                   (("glm53-like", "bf16", "quilt", "cuda"), "o-"),
                                   (("ds32-like", "bf16", "quilt", "cuda"), "s-"),
                                   (("qasper-like", "bf16", "quilt", "cuda"), "^-")]:
        pts = sorted((r["h"], r["ms"]) for r in rows
                     if (r["workload"], r["kv"], r["method"], r.get("backend", "triton")) == (wl, kv, m, be))
        if pts:
            ax.plot(*zip(*pts), style, label=f"{m} {wl} ({be})")
    hs = sorted(FLASHMLA_MS)
    ax.plot(hs, [FLASHMLA_MS[h] for h in hs], "k:", label="FlashMLA sm90 (padded to 64 heads)")
    ax.plot(hs, [GOAL_MS[h] for h in hs], "g:", label="goal (glm53-like)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("heads")
    ax.set_ylabel("ms")
    ax.set_title(f"sparse prefill, s_q 16384, s_kv 65536, top-2048 ({doc['gpu']})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=120)
    plt.close(fig)
    kept = ""  # hand-written sections below the marker survive regeneration
    if target.exists() and MARKER in target.read_text():
        kept = target.read_text().split(MARKER, 1)[1]
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("\n".join(lines) + "\n" + MARKER + kept)
    return target
