"""Owner-exact (swapped A/B) kernel study, issue 24: the arithmetic prediction, the owner histograms of real
plans, and (with ``--measured``) the microbenchmark's tile times combined with them into predicted kernel times.

Today every 64-row kv tile is one 64-row wgmma over all 64 / h queries a program holds, owners or not. The
swapped program multiplies a tile only against its owners: ``S^T = K Q^T`` (M = 64 kv rows, N = h x owners)
and ``O^T += V^T P^T`` (M = 64-row chunks of d_v). The tile model (``model_today``, ``model_swapped``): a tile
takes the larger of its tensor time (2048 bf16 MAC a clock an SM) and its shared-memory time (128 B a clock an
SM, reads and writes alike), bytes counted operand by operand. The swapped tile keeps the K and V reads (136 KB)
and the gather's 72 KB write whatever N, so at small N it is bound by shared memory, not by the products.

Plans: ``quilt_attn.plan(indices, s_kv, backend="torch", **dispatch.plan_settings(h, "cuda"))`` on the CPU,
the tiles each program runs (``Plan.work_list``), each column's owners among the program's queries. From
them, the swapped tile lists this study can build, each with its N per tile:

- ``as planned``: today's tiles as they are; N = h x the span of the tile's owners (lowest to highest query
  slot: B = contiguous Q rows, a contiguous accumulator slice);
- ``regrouped``: each program's columns sorted by their owners' span and re-cut into 64-column tiles; N as above;
- ``regrouped, per owner``: the same tiles issued one wgmma an owner (N = h x the owners of the tile's
  union): the form arbitrary owner sets need; measured as ``issue owner`` by tile_rate.cu;
- ``cascade``: a full-cascade plan (``merge_level=1``): a level-L tile is owned by its aligned block of L
  queries, N = h x L exactly, but the plan has more, emptier tiles;
- ``hybrid``: columns owned by one query alone go to swapped tiles of N = h (per query, 64 a tile), all others to
  today's tiles (regrouped full); ``hybrid span<=k``: columns whose owner span is at most k go to regrouped
  swapped tiles, the rest to today's (best k reported);
- ``ideal``: every column costs min(t_swapped(h x its owners), t_today) / 64, no padding: a bound, not a program.

Predicted kernel time = today's measured time x (sum of the swapped tiles' times) / (today's tiles x today's tile
time): the rest of the kernel (boundaries, refill waits) assumed to scale with tile time; with ``--measured`` also
the additive form (today's time minus its tiles' time, plus the swapped tiles' time). The decision rule
(docs/owner-exact.md): adopt only if a buildable form (not ``ideal``) is predicted at least 10% faster at h = 8 or 16
on GLM-5.3-like (the issue's targets); the other workloads are reported beside it.

Usage (CPU; s_q 2048 takes about a minute on two cores):
    python benchmarks/run.py owner-exact
    python benchmarks/run.py owner-exact --measured tile_rate.json --s-q 16384 --out owner_exact.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

D_QK, D_V, TILE, ROWS = 576, 512, 64, 64
MAC_PER_CLK = 2048  # bf16 dense wgmma an SM a clock (989 TFLOP/s at 1830 MHz on 132 SMs)
SMEM_B_PER_CLK = 128  # shared memory an SM a clock
N_SM = 132
S_KV, TOPK = 65536, 2048
WORKLOADS = ("glm53-like", "ds32-like", "random")
# today's CUDA kernel (issue 24: H200, s_q 16384, 64K context, Top-2048, bf16, prebuilt plan), ms
TODAY_MS = {("glm53-like", 8): 2.08, ("glm53-like", 16): 3.36, ("glm53-like", 32): 5.25}
# the issue's useful pair shares (GLM-5.3-like, s_q 16384): the counting check
ISSUE_SHARE = {8: 0.49, 16: 0.60, 32: 0.76}
GOAL = 0.10  # the decision rule: at least 10% faster


# ----------------------------------------------------------------------------------------- the tile model
def _bound(mac: float, smem_bytes: float) -> dict:
    t_mac, t_smem = mac / MAC_PER_CLK, smem_bytes / SMEM_B_PER_CLK
    return {"mac_clk": t_mac, "smem_clk": t_smem, "clk": max(t_mac, t_smem)}


def model_today(gather: bool = True) -> dict:
    """Clocks of one 64-row kv tile in today's shape (an SM; both consumer warpgroups together).

    QK: A = Q (64 x 576) and B = K (64 x 576) from shared memory; PV: V (64 x 512) read once (each warpgroup its
    256 columns), P from registers for the warpgroup's own tile and from shared memory (8 KB) for the other's;
    P stored once (8 KB); with ``gather`` the producer's cp.async write of the tile (72 KB).
    """
    mac = ROWS * TILE * D_QK + ROWS * D_V * TILE
    smem = ROWS * D_QK * 2 + TILE * D_QK * 2 + TILE * D_V * 2 + ROWS * TILE * 2 + ROWS * TILE * 2
    return _bound(mac, smem + (TILE * D_QK * 2 if gather else 0))


def model_swapped(n: int, gather: bool = True, owners: int = 1) -> dict:
    """Clocks of one tile in the swapped shape at N = ``n`` columns (h x owners).

    QK^T: A = K (72 KB) and B = N rows of Q (N x 1152 B); PV^T: A = V^T (64 KB, each warpgroup its 4 d_v chunks),
    B = P^T (N x 128 B) read once per 64-row d_v chunk (8 x); P^T stored once (N x 128 B). ``owners`` > 1: one
    wgmma an owner (the per-owner issue), which reads A (K, then V^T) once per owner.
    """
    mac = n * (TILE * D_QK + D_V * TILE)
    smem = owners * (TILE * D_QK * 2 + TILE * D_V * 2) + n * D_QK * 2 + 8 * n * TILE * 2 + n * TILE * 2
    return _bound(mac, smem + (TILE * D_QK * 2 if gather else 0))


class TileTimes:
    """Time of a tile: today's, and the swapped shape's at N (contiguous, or one wgmma an owner of h columns).

    From the arithmetic model (clocks) or from tile_rate.cu's JSON (ns a tile an SM; between measured N,
    linear; ``mode``: "gather" or "compute" rows). Units cancel in every ratio this script reports.
    """

    def __init__(self, measured: dict | None = None, mode: str = "gather"):
        self.measured = measured
        self.gather = mode == "gather"
        self.unit = "ns" if measured else "clk"
        if measured is not None:
            g = 1 if self.gather else 0
            rows = [r for r in measured["rows"] if r["gather"] == g and r.get("valid", True)]
            bad = [r for r in measured["rows"] if not r.get("valid", True)]
            if bad:
                print(f"warning: {len(bad)} microbenchmark rows failed their check; left out", file=sys.stderr)
            self._today = next(r["ns_per_tile"] for r in rows if r["shape"] == "today")
            self._one = sorted((r["n"], r["ns_per_tile"]) for r in rows if r["shape"] == "swapped" and r["issue"] == "one")
            self._owner: dict[int, list] = {}
            for r in rows:
                if r["shape"] == "swapped" and r["issue"] == "owner":
                    self._owner.setdefault(r["h"], []).append((r["n"], r["ns_per_tile"]))
            for h in self._owner:  # one owner: the contiguous product itself
                one = [p for p in self._one if p[0] == h]
                self._owner[h] = sorted(set(self._owner[h]) | set(one))

    @staticmethod
    def _interp(points: list, n: float) -> float:
        xs = [p[0] for p in points]
        if n <= xs[0]:
            return points[0][1]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = points[-2], points[-1]  # past the last point: extend the last segment
        return y1 + (y1 - y0) * (n - x1) / (x1 - x0)

    def today(self) -> float:
        return self._today if self.measured else model_today(self.gather)["clk"]

    def swapped(self, n: int) -> float:
        if self.measured:
            return self._interp(self._one, n)
        return model_swapped(n, self.gather)["clk"]

    def per_owner(self, n: int, h: int) -> float:
        """N = n columns issued as n / h wgmmas of h columns."""
        if n <= h:
            return self.swapped(n)
        if self.measured and len(self._owner.get(h, [])) >= 2:
            return self._interp(self._owner[h], n)
        if self.measured:  # not measured at this h: scale the model by the measured contiguous time
            return self.swapped(n) * model_swapped(n, self.gather, n // h)["clk"] / model_swapped(n, self.gather)["clk"]
        return model_swapped(n, self.gather, n // h)["clk"]

    def swapped_many(self, ns: torch.Tensor) -> float:
        """Sum of swapped tile times over a tensor of N values."""
        vals, counts = torch.unique(ns, return_counts=True)
        return float(sum(self.swapped(int(v)) * int(c) for v, c in zip(vals, counts)))

    def per_owner_many(self, ns: torch.Tensor, h: int) -> float:
        vals, counts = torch.unique(ns, return_counts=True)
        return float(sum(self.per_owner(int(v), h) * int(c) for v, c in zip(vals, counts)))


# ----------------------------------------------------------------------------------------- plan columns
def popcount(m: torch.Tensor, bits: int = 8) -> torch.Tensor:
    c = torch.zeros_like(m)
    for b in range(bits):
        c += (m >> b) & 1
    return c


def low_high(m: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Lowest and highest set bit of each nonzero mask (0 where the mask is 0)."""
    lo = torch.full_like(m, bits)
    hi = torch.full_like(m, -1)
    for b in range(bits):
        on = ((m >> b) & 1) != 0
        lo = torch.where(on & (lo == bits), torch.full_like(m, b), lo)
        hi = torch.where(on, torch.full_like(m, b), hi)
    return torch.where(m != 0, lo, 0), torch.where(m != 0, hi, 0)


def program_columns(plan, qp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tiles each ``qp``-query program of ``plan`` runs: ``(masks int64 [n_exec, 64], prog int64 [n_exec])``,
    each column's owners among the program's queries (bit k = its k-th query; 0 = padding)."""
    prog_tiles, ntiles = plan.work_list(qp)
    qp_eff = min(qp, plan.group_size)
    n_sub = plan.group_size // qp_eff
    _, masks = plan.columns()
    flat = masks.reshape(-1, masks.shape[-1]).to(torch.int64)
    cap = prog_tiles.shape[1]
    valid = torch.arange(cap)[None, :] < ntiles[:, None].to(torch.int64)
    prog = torch.arange(prog_tiles.shape[0])[:, None].expand_as(valid)[valid]
    tiles = prog_tiles.to(torch.int64)[valid]
    sub = (prog % n_sub)[:, None]
    m = (flat[tiles] >> (sub * qp_eff)) & ((1 << qp_eff) - 1)
    return m, prog


def regroup(masks: torch.Tensor, prog: torch.Tensor, keep: torch.Tensor | None = None):
    """Each program's nonzero columns (those with ``keep``), sorted by owner span (lowest, highest slot), cut into
    64-column tiles. Returns per new tile ``(span, union popcount)`` and the tile count."""
    m = masks.reshape(-1)
    p = prog[:, None].expand_as(masks).reshape(-1)
    sel = m != 0 if keep is None else (m != 0) & keep.reshape(-1)
    m, p = m[sel], p[sel]
    if m.numel() == 0:
        z = torch.zeros(0, dtype=torch.int64)
        return z, z
    lo, hi = low_high(m)
    key = (p * 8 + lo) * 8 + hi
    order = torch.sort(key, stable=True).indices
    m, p, lo, hi = m[order], p[order], lo[order], hi[order]
    n_prog = int(p.max()) + 1
    counts = torch.bincount(p, minlength=n_prog)
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(m.numel()) - first[p]
    chunks = (counts + TILE - 1) // TILE
    base = torch.cumsum(chunks, 0) - chunks
    tile = base[p] + rank // TILE
    n_t = int(chunks.sum())
    lo_t = torch.full((n_t,), 8, dtype=torch.int64).scatter_reduce(0, tile, lo, "amin")
    hi_t = torch.full((n_t,), -1, dtype=torch.int64).scatter_reduce(0, tile, hi, "amax")
    union = torch.zeros(n_t, dtype=torch.int64)
    for b in range(8):
        bit = torch.zeros(n_t, dtype=torch.int64).scatter_reduce(0, tile, (m >> b) & 1, "amax")
        union |= bit << b
    return hi_t - lo_t + 1, popcount(union)


def owner_stats(plan, h: int) -> dict:
    """Useful pair share and owner histograms of the tiles a plan's programs run at ``h`` heads."""
    qp = min(64 // h, plan.group_size)
    masks, prog = program_columns(plan, qp)
    pc = popcount(masks)
    union = torch.zeros(masks.shape[0], dtype=torch.int64)
    for b in range(8):
        union |= ((((masks >> b) & 1) != 0).any(1).to(torch.int64)) << b
    lo, hi = low_high(union)
    col_hist = torch.bincount(pc.reshape(-1), minlength=qp + 1)[: qp + 1]
    return {
        "qp": qp, "masks": masks, "prog": prog, "tiles": masks.shape[0],
        "share": float(pc.sum()) / max(1, masks.shape[0] * TILE * qp),
        "owners_per_column": float(pc.sum()) / max(1, masks.numel()),
        "col_hist": col_hist.tolist(),                       # columns by owner count 0 (padding) .. qp
        "tile_span": (hi - lo + 1) * (union != 0),           # per tile: owner span of its union
        "tile_union": popcount(union),
    }


# ----------------------------------------------------------------------------------------- the swapped forms
def swapped_forms(st: dict, st_cascade: dict | None, h: int, tt: TileTimes) -> dict:
    """Sum of tile times (tt's unit) of each swapped form, and today's, for one (workload, h)."""
    qp, masks, prog = st["qp"], st["masks"], st["prog"]
    forms = {"today": st["tiles"] * tt.today()}
    forms["as planned"] = tt.swapped_many(h * st["tile_span"].clamp(min=1))
    span, upc = regroup(masks, prog)
    forms["regrouped"] = tt.swapped_many(h * span)
    forms["regrouped, per owner"] = tt.per_owner_many(h * upc, h)
    if st_cascade is not None:
        forms["cascade"] = tt.swapped_many(h * st_cascade["tile_span"].clamp(min=1))
    # hybrid: columns of owner span <= k to regrouped swapped tiles, the rest to today's (regrouped full)
    lo, hi = low_high(masks)
    colspan = torch.where(masks != 0, hi - lo + 1, 0)
    best_name, best = None, None
    for k in range(1, qp):
        swap_sel = (masks != 0) & (colspan <= k)
        sp, _ = regroup(masks, prog, swap_sel)
        rest = (masks != 0) & ~swap_sel
        n_rest = torch.bincount(prog[:, None].expand_as(masks)[rest], minlength=int(prog.max()) + 1)
        today_tiles = int(((n_rest + TILE - 1) // TILE).sum())
        cost = tt.swapped_many(h * sp) + today_tiles * tt.today()
        if k == 1:
            forms["hybrid"] = cost
        if best is None or cost < best:
            best_name, best = f"hybrid span<={k}", cost
    if best_name is not None and best_name != "hybrid span<=1":
        forms[best_name] = best
    # ideal: each column in the cheaper shape for its owner count, t / 64, no padding
    hist = st["col_hist"]
    forms["ideal"] = sum(hist[k] * min(tt.swapped(h * k), tt.today()) / TILE for k in range(1, qp + 1))
    return forms


def predict(forms: dict, workload: str, h: int, s_q: int, tt: TileTimes) -> list[dict]:
    rows = []
    base = forms["today"]
    known = TODAY_MS.get((workload, h))
    for name, cost in forms.items():
        r = {"form": name, "ratio": cost / base}
        if known is not None:
            r["ms_ratio_model"] = known * cost / base
            if tt.measured:  # additive: today's non-tile time kept, tile time replaced (scaled to s_q 16384)
                scale = 16384 / s_q
                t_today_ms = base * scale / N_SM * 1e-6
                r["ms_additive"] = known - t_today_ms + cost * scale / N_SM * 1e-6
        rows.append(r)
    return rows


BUILDABLE = lambda name: name not in ("today", "ideal")  # noqa: E731


def main(argv=None, prog=None) -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--measured", default=None, help="tile_rate.cu's JSON (--json FILE or its last stdout line)")
    ap.add_argument("--mode", default="gather", choices=["gather", "compute"],
                    help="which microbenchmark rows (and model terms): with the gather's writes, or compute only")
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    ap.add_argument("--heads", nargs="+", type=int, default=[8, 16, 32])
    ap.add_argument("--s-q", type=int, default=2048, help="queries planned (the issue's shares are at 16384)")
    ap.add_argument("--s-kv", type=int, default=S_KV)
    ap.add_argument("--topk", type=int, default=TOPK)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="JSON file for the results")
    args = ap.parse_args(argv)
    for h in args.heads:
        if h < 1 or 64 % h or h > 32:
            ap.error(f"--heads: each must divide 64 and be at most 32 (a program holds 64 / h >= 2 queries), got {h}")

    import quilt_attn
    from quilt_attn.dispatch import plan_settings
    from quilt_attn.workloads import generate

    measured = None
    if args.measured:
        with open(args.measured) as f:
            lines = [ln for ln in f.read().splitlines() if ln.lstrip().startswith("{")]
        if not lines:
            ap.error(f"--measured: no JSON line in {args.measured}")
        measured = json.loads(lines[-1])
    tt = TileTimes(measured, args.mode)
    gather = args.mode == "gather"

    print(f"tile model ({args.mode}: {'with' if gather else 'without'} the gather's 72 KB shared-memory write), clocks:")
    t0 = model_today(gather)
    print(f"  today      mac {t0['mac_clk']:6.0f}  smem {t0['smem_clk']:6.0f}  tile {t0['clk']:6.0f}")
    for n in (8, 16, 24, 32, 48, 64):
        m = model_swapped(n, gather)
        print(f"  swapped {n:2d} mac {m['mac_clk']:6.0f}  smem {m['smem_clk']:6.0f}  tile {m['clk']:6.0f}"
              f"  ({m['clk'] / t0['clk']:.2f} of today)")
    if measured:
        print(f"measured ({measured.get('device')}, {args.mode}): today {tt.today():.0f} ns/tile/SM; swapped "
              + ", ".join(f"N={n} {t:.0f}" for n, t in tt._one))
        for r in measured.get("real", []):  # the shipping kernel on uniform full tiles: the micro loop's coverage
            if r["gather"] == (1 if gather else 0):
                print(f"  shipping kernel, h={r['h']}, uniform full tiles: {r['ns_per_tile']:.0f} ns/tile/SM "
                      f"(the micro loop's today is {tt.today() / r['ns_per_tile']:.2f} of it)")

    results = []
    for wl in args.workloads:
        t = time.time()
        idx = generate(wl, args.s_q, args.s_kv, args.topk, seed=args.seed)
        print(f"\n{wl}: s_q {args.s_q}, s_kv {args.s_kv}, Top-{args.topk} ({time.time() - t:.1f} s to generate)")
        for h in args.heads:
            kw = plan_settings(h, "cuda")
            p = quilt_attn.plan(idx, s_kv=args.s_kv, backend="torch", **kw)
            st = owner_stats(p, h)
            pc = quilt_attn.plan(idx, s_kv=args.s_kv, backend="torch", **dict(kw, merge_level=1))
            stc = owner_stats(pc, h)
            forms = swapped_forms(st, stc, h, tt)
            rows = predict(forms, wl, h, args.s_q, tt)
            check = ISSUE_SHARE.get(h) if wl == "glm53-like" else None
            print(f"  h={h:<2d} qp={st['qp']}  tiles today {st['tiles']}  (cascade plan {stc['tiles']})  useful pair share "
                  f"{st['share']:.3f}" + (f" (issue, s_q 16384: {check:.2f})" if check else "")
                  + f"  owners/column {st['owners_per_column']:.2f}")
            hist = st["col_hist"]
            tot = max(1, sum(hist))
            print("        columns by owners 0..qp: " + " ".join(f"{k}:{hist[k] / tot:.3f}" for k in range(len(hist))))
            for r in rows:
                extra = ""
                if "ms_ratio_model" in r:
                    extra = f"  -> {r['ms_ratio_model']:.2f} ms"
                    if "ms_additive" in r:
                        extra += f" (additive {r['ms_additive']:.2f})"
                print(f"        {r['form']:<22s} {r['ratio']:.3f} of today{extra}")
            buildable = [r for r in rows if BUILDABLE(r["form"])]
            best = min(buildable, key=lambda r: r["ratio"])
            results.append({"workload": wl, "h": h, "qp": st["qp"], "tiles": st["tiles"], "cascade_tiles": stc["tiles"],
                            "share": st["share"], "owners_per_column": st["owners_per_column"],
                            "col_hist": hist, "forms": rows, "best": best})

    print("\ndecision (a buildable form >= 10% faster at h = 8 or 16; the issue's targets are GLM-5.3-like):")
    pays = []
    for r in results:
        if r["h"] not in (8, 16):
            continue
        gain = 1.0 - r["best"]["ratio"]
        r["pays"] = gain >= GOAL
        if r["pays"]:
            pays.append(f"{r['workload']} h={r['h']}")
        print(f"  {r['workload']:<11s} h={r['h']:<2d} best {r['best']['form']:<22s} {gain:+.1%}"
              f"  {'pays' if r['pays'] else 'does not pay'}")
    headline = "glm53-like" if "glm53-like" in args.workloads else None
    adopt = any(r.get("pays") for r in results if headline is None or r["workload"] == headline)
    source = f"measured tile times ({args.mode})" if measured else f"the arithmetic model ({args.mode})"
    print(f"  -> {'ADOPT: build the prototype' if adopt else 'do not adopt'}"
          f"{' on ' + headline if headline else ''} (from {source}, s_q {args.s_q}); pays on: {', '.join(pays) or 'none'}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "source": source, "adopt": adopt,
                       "model": {"today": model_today(gather),
                                 "swapped": {n: model_swapped(n, gather) for n in (8, 16, 24, 32, 48, 64)}},
                       "measured": measured, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
