"""Calibrate the indexer parameters of the realistic workload presets.

Targets (Top-2048 over a 65536-token context):

* ``glm53-like`` / ``ds32-like``: the paper's processed-KV table (rows processed relative to
  query-parallel) for fixed groups of 2/4/8 sharing only the rows all members selected, and for
  cascaded sharing 8 -> 4 -> 2 -> 1: GLM-5.3 0.657/0.572/0.590 and 0.455, DeepSeek-3.2
  0.789/0.829/0.884 and 0.701.
* ``qasper-like`` / ``govreport-like``: the mean overlap of aligned neighbour pairs the paper reports
  for those datasets (at least 0.86 and about 0.78). Only ``noise`` is searched; the other parameters
  are glm53-like's, since that profile was measured on GLM-5.3.

Each candidate is scored on the mean over a few seeds (the key draws, shared by all queries, are the
main source of seed-to-seed spread; more queries do not reduce it), at two places: the last queries
of the 65536 context (the calibration target) and a cheap proxy of the benchmark shape, whose 16384
queries span positions 49152..65535. Sharing in this model grows with the context a query sees (the
heavy-tailed salience fills more of the top-K), so fitting only the last queries would leave the
benchmark shape ~0.03 less shared; the search balances the two. It is a bounded Nelder-Mead over
the free parameters (a bisection on ``noise`` for the single-target presets). The JSON records the
achieved ratios at the last ``--s-q`` queries and at the full benchmark shape.

Usage::

    python benchmarks/calibrate_workloads.py              # search, print, write the JSON
    python benchmarks/calibrate_workloads.py --check      # evaluate the frozen PRESETS only

The found parameters are frozen by hand into ``quilt_attn.workloads.generators.PRESETS``; ``--check``
then records what the frozen values achieve in ``benchmarks/results/workload_calibration.json``.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from quilt_attn.overlap import overlap_profile
from quilt_attn.workloads import PRESETS, generate

S_KV = 65536
TOPK = 2048
GROUPS = (2, 4, 8)
CASCADE_GROUP = 8
# The benchmark shape: the last 16384 queries of the 65536 context (positions 49152..65535).
BENCH_S_Q = 16384
OUT = Path(__file__).resolve().parent / "results" / "workload_calibration.json"

# Paper targets: "fixed_group" keyed by group size, "cascaded", or "pairwise_overlap".
TARGETS = {
    "glm53-like": {"fixed_group": {2: 0.657, 4: 0.572, 8: 0.590}, "cascaded": 0.455},
    "ds32-like": {"fixed_group": {2: 0.789, 4: 0.829, 8: 0.884}, "cascaded": 0.701},
    "qasper-like": {"pairwise_overlap": 0.88},
    "govreport-like": {"pairwise_overlap": 0.78},
}
TOLERANCE = 0.03

# Parameters held fixed in the search. A small feature dimension spreads the key norms and with
# them how consistently neighbours select a key: that gives the paper's slow decay of sharing from
# groups of 2 to 8 (at dim 64 group-4 sharing falls ~0.02 short). For glm53-like, dim 8 fits the
# last queries and the benchmark shape together better than dim 16 (squared error 0.0007 vs 0.0015).
FIXED = {"glm53-like": {"dim": 8}, "ds32-like": {"dim": 16}}
# Free parameters of the multi-target search: (lower, upper) bounds and the starting point.
BOUNDS = {"noise": (0.0, 1.0), "drift": (0.5, 0.999), "salience": (0.0, 1.5), "salience_sigma": (0.0, 3.0)}
STARTS = {
    "glm53-like": {"noise": 0.73, "drift": 0.95, "salience": 0.65, "salience_sigma": 1.2},
    "ds32-like": {"noise": 0.56, "drift": 0.95, "salience": 0.13, "salience_sigma": 1.49},
}
# Single-target presets bisect `noise` on top of this preset's other parameters.
PAIRWISE_BASE = "glm53-like"


def primary_windows(s_q: int) -> list[tuple[int, int]]:
    """The calibration target: the last ``s_q`` queries of the 65536 context, as (s_q, s_kv)."""
    return [(s_q, S_KV)]


def bench_proxy_windows(s_q: int) -> list[tuple[int, int]]:
    """A cheap stand-in for the benchmark shape: windows of ``s_q`` queries centred on the middles
    of its two halves (positions 53248 and 61440). Queries at the end of a shorter context behave
    like queries at that position of the long one (causality), so each window is a ``generate`` of
    its own context length."""
    return [(s_q, mid + s_q // 2) for mid in (53248, 61440)]


def measure(params: dict, windows, seeds, name: str = "indexer") -> dict:
    """Overlap statistics of ``generate(name, **params)`` over (s_q, s_kv) windows and seeds.

    Returns ``{"mean": stats, "per_seed": {seed: stats}}``; windows are averaged with equal weight.
    """
    per_seed = {}
    for seed in seeds:
        stats = []
        for s_q, s_kv in windows:
            indices = generate(name, s_q, s_kv, TOPK, seed=seed, **params)
            prof = overlap_profile(indices, s_kv=s_kv, group_sizes=GROUPS, cascade_group=CASCADE_GROUP)
            stats.append(
                {
                    "fixed_group": {G: prof.fixed_group[G] for G in GROUPS},
                    "union": {G: prof.union[G] for G in GROUPS},
                    "shared_fraction": {G: prof.shared_fraction[G] for G in GROUPS},
                    "cascaded": prof.cascaded,
                    "pairwise_overlap": prof.pairwise_overlap,
                }
            )
        per_seed[str(seed)] = _mean_of(stats)
    return {"mean": _mean_of(list(per_seed.values())), "per_seed": per_seed}


def _mean_of(stats: list[dict]) -> dict:
    first = stats[0]
    out = {}
    for key, value in first.items():
        if isinstance(value, dict):
            out[key] = {G: sum(s[key][G] for s in stats) / len(stats) for G in value}
        else:
            out[key] = sum(s[key] for s in stats) / len(stats)
    return out


def errors(stats: dict, target: dict) -> dict[str, float]:
    """Signed error (achieved - target) of every targeted ratio, keyed e.g. ``fixed_group[2]``."""
    out = {}
    for key, want in target.items():
        if isinstance(want, dict):
            out.update({f"{key}[{G}]": stats[key][G] - w for G, w in want.items()})
        else:
            out[key] = stats[key] - want
    return out


def nelder_mead(f, x0, step=0.1, max_evals=80, tol=1e-6):
    """Minimise ``f`` over the unit cube (points are clipped into it) with Nelder-Mead."""
    clip = lambda x: [min(1.0, max(0.0, v)) for v in x]  # noqa: E731
    simplex = [clip(x0)] + [clip([v + (step if i == j else 0.0) for j, v in enumerate(x0)]) for i in range(len(x0))]
    values = [f(x) for x in simplex]
    evals = len(simplex)
    while evals < max_evals:
        order = sorted(range(len(simplex)), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = [sum(p[k] for p in simplex[:-1]) / (len(simplex) - 1) for k in range(len(x0))]
        towards = lambda a: clip([c + a * (w - c) for c, w in zip(centroid, simplex[-1])])  # noqa: E731
        xr = towards(-1.0)
        fr = f(xr)
        evals += 1
        if fr < values[0]:
            xe = towards(-2.0)
            fe = f(xe)
            evals += 1
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = towards(0.5)
            fc = f(xc)
            evals += 1
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:  # shrink towards the best point
                for i in range(1, len(simplex)):
                    simplex[i] = clip([b + 0.5 * (v - b) for b, v in zip(simplex[0], simplex[i])])
                    values[i] = f(simplex[i])
                    evals += 1
    best = min(range(len(simplex)), key=values.__getitem__)
    return simplex[best], values[best], evals


def _to_params(x, names, fixed: dict) -> dict:
    free = {n: round(BOUNDS[n][0] + v * (BOUNDS[n][1] - BOUNDS[n][0]), 4) for n, v in zip(names, x)}
    return {**fixed, **free}


def _to_unit(params, names) -> list[float]:
    return [(params[n] - BOUNDS[n][0]) / (BOUNDS[n][1] - BOUNDS[n][0]) for n in names]


def search_multi(name: str, s_q: int, seeds, max_evals: int, log) -> dict:
    """Nelder-Mead over BOUNDS' parameters: squared error to TARGETS[name] at the last queries plus
    the same at the benchmark-shape proxy."""
    names = list(BOUNDS)
    target = TARGETS[name]

    def loss(x):
        params = _to_params(x, names, FIXED[name])
        errs = [errors(measure(params, w, seeds)["mean"], target) for w in (primary_windows(s_q), bench_proxy_windows(s_q))]
        value = sum(e * e for err in errs for e in err.values())
        worst = max(abs(e) for err in errs for e in err.values())
        log(f"  {name} {params} max|err|={worst:.4f} loss={value:.6f}")
        return value

    x, _, evals = nelder_mead(loss, _to_unit(STARTS[name], names), step=0.05, max_evals=max_evals)
    return {"params": _to_params(x, names, FIXED[name]), "evaluations": evals}


def search_pairwise(name: str, base: dict, s_q: int, seeds, max_evals: int, log) -> dict:
    """Bisect ``noise`` (pairwise overlap falls as it grows) to hit TARGETS[name]'s pairwise overlap,
    averaged over the last queries and the benchmark-shape proxy."""
    want = TARGETS[name]["pairwise_overlap"]
    windows = primary_windows(s_q) + bench_proxy_windows(s_q)
    lo, hi = 0.0, 1.0
    evals = 0
    for evals in range(1, max_evals + 1):
        mid = round((lo + hi) / 2, 4)
        got = measure({**base, "noise": mid}, windows, seeds)["mean"]["pairwise_overlap"]
        log(f"  {name} noise={mid} pairwise={got:.4f}")
        lo, hi = (mid, hi) if got > want else (lo, mid)
        if abs(got - want) < 0.002:
            break
    return {"params": {**base, "noise": mid}, "evaluations": evals}


def _summary(stats: dict, target: dict) -> dict:
    errs = errors(stats["mean"], target)
    worst = max(abs(e) for per in stats["per_seed"].values() for e in errors(per, target).values())
    return {
        "achieved": stats["mean"],
        "achieved_per_seed": stats["per_seed"],
        "errors": errs,
        "max_abs_error": max(map(abs, errs.values())),
        "max_abs_error_any_seed": worst,
        "within_tolerance": worst <= TOLERANCE,
    }


def record(name: str, params: dict, s_q: int, bench_s_q: int, seeds, found: dict | None = None) -> dict:
    """The JSON entry of one preset: targets, params, and what they achieve at the last ``s_q``
    queries of the 65536 context and (when ``bench_s_q``) at the benchmark shape."""
    entry = {"targets": TARGETS[name], "params": params}
    entry.update(_summary(measure(params, primary_windows(s_q), seeds), TARGETS[name]))
    if bench_s_q:
        entry["benchmark_shape"] = {"s_q": bench_s_q, "s_kv": S_KV}
        entry["benchmark_shape"].update(_summary(measure(params, [(bench_s_q, S_KV)], seeds), TARGETS[name]))
    if found is not None:
        entry["search_evaluations"] = found["evaluations"]
    return entry


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    parser.add_argument("--s-q", type=int, default=1024, help="queries of the recorded evaluation")
    parser.add_argument("--search-s-q", type=int, default=256, help="queries per search window")
    parser.add_argument("--bench-s-q", type=int, default=BENCH_S_Q, help="benchmark-shape queries (0: skip)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--max-evals", type=int, default=80)
    parser.add_argument("--check", action="store_true", help="evaluate the frozen PRESETS, no search")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    t0 = time.time()
    report = {
        "s_q": args.s_q,
        "search_s_q": None if args.check else args.search_s_q,
        "benchmark_s_q": args.bench_s_q,
        "s_kv": S_KV,
        "topk": TOPK,
        "seeds": args.seeds,
        "group_sizes": list(GROUPS),
        "cascade_group": CASCADE_GROUP,
        "tolerance": TOLERANCE,
        "mode": "check of frozen PRESETS" if args.check else "search",
        "presets": {},
    }
    for name in args.presets:
        log(f"{name}:")
        if args.check:
            params, found = dict(PRESETS[name]), None
        elif "pairwise_overlap" in TARGETS[name]:
            base = dict(PRESETS[PAIRWISE_BASE])
            found = search_pairwise(name, base, args.search_s_q, args.seeds, args.max_evals, log)
            params = found["params"]
        else:
            found = search_multi(name, args.search_s_q, args.seeds, args.max_evals, log)
            params = found["params"]
        entry = record(name, params, args.s_q, args.bench_s_q, args.seeds, found)
        report["presets"][name] = entry
        log(f"  -> params {params}\n     errors {({k: round(v, 4) for k, v in entry['errors'].items()})}")
        if "benchmark_shape" in entry:
            log(f"     benchmark-shape errors {({k: round(v, 4) for k, v in entry['benchmark_shape']['errors'].items()})}")
    report["seconds"] = round(time.time() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
