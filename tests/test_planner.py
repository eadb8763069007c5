"""Tests of the QUILT planner (``quilt_attn.planner``); CPU, except the Triton-backend checks.

The checks reconstruct what a plan claims from its raw tensors (which query owns which kv row,
at which level) and compare it with the input's Top-K sets and with a pure-Python model of
cascaded sharing and clipping (dicts and sorted lists), never with the planner's own helpers.
Rows are assumed duplicate-free, as the workload generators produce them.
"""
from __future__ import annotations

import dataclasses
import math
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quilt_attn.planner import PACK_ROW_MASK, PACK_SHIFT, cascade_levels, member_masks, packs_columns, plan

try:  # the shared generators, once they exist; local ones below otherwise
    from quilt_attn.workloads import generate as _generate
except ImportError:  # pragma: no cover - depends on the state of the tree
    _generate = None

MASK_METHODS = ("sort", "bitmap")
GROUPS = (1, 2, 4, 8, 16)
TILES = (1, 2, 3, 4, 8, 16, 64)
TAUS = (0.0, 0.25, 0.5, 0.75, 1.0)
HYP = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ----------------------------------------------------------------------------- workloads
def _local_workload(kind: str, s_q: int, s_kv: int, topk: int, seed: int) -> torch.Tensor:
    """Duplicate-free rows of ``topk`` kv rows in ``[0, s_kv)``; int32 ``[s_q, topk]``."""
    rng = random.Random(seed)
    rows: list[list[int]] = []
    if kind == "random":
        rows = [rng.sample(range(s_kv), topk) for _ in range(s_q)]
    elif kind == "identical":
        row = rng.sample(range(s_kv), topk)
        rows = [list(row) for _ in range(s_q)]
    elif kind == "disjoint":
        assert s_kv >= s_q * topk
        perm = rng.sample(range(s_kv), s_q * topk)
        rows = [perm[i * topk:(i + 1) * topk] for i in range(s_q)]
    elif kind == "correlated":  # neighbours share most rows: each query replaces ~20% of the previous one's
        row = rng.sample(range(s_kv), topk)
        for _ in range(s_q):
            row = list(row)
            free = list(set(range(s_kv)) - set(row))
            for j in rng.sample(range(topk), min(len(free), max(1, topk // 5))):
                row[j] = free.pop(rng.randrange(len(free)))
            if rng.random() < 0.5:  # importance order changes a little too
                a, b = rng.randrange(topk), rng.randrange(topk)
                row[a], row[b] = row[b], row[a]
            rows.append(row)
    else:
        raise ValueError(kind)
    return torch.tensor(rows, dtype=torch.int32).view(s_q, topk)


_PRESET = {"correlated": "glm53-like"}
PRESETS = ("glm53-like", "ds32-like", "qasper-like", "govreport-like")


def workload(kind: str, s_q: int, s_kv: int, topk: int, seed: int = 0) -> tuple[torch.Tensor, int]:
    """``(indices, s_kv)`` from the shared generator when it exists (``correlated`` -> ``glm53-like``;
    causal, so early queries may hold -1 entries), else from the local one. ``disjoint`` may raise
    ``s_kv`` (the shared generator needs 16 * topk keys in the first query's range)."""
    if _generate is None:
        if kind in PRESETS:
            kind = "correlated"
        s_kv = max(s_kv, s_q * topk) if kind == "disjoint" else s_kv
        return _local_workload(kind, s_q, s_kv, topk, seed), s_kv
    s_kv = max(s_kv, s_q + 16 * topk) if kind == "disjoint" else max(s_kv, s_q)
    out = _generate(_PRESET.get(kind, kind), s_q, s_kv, topk, seed=seed)
    return out.to(torch.int32).reshape(s_q, topk).cpu(), s_kv


def add_invalid(idx: torch.Tensor, s_kv: int, frac: float, seed: int) -> torch.Tensor:
    """Replace about ``frac`` of the entries with -1 or with rows ``>= s_kv``."""
    g = torch.Generator().manual_seed(seed)
    hit = torch.rand(idx.shape, generator=g) < frac
    bad = torch.where(torch.rand(idx.shape, generator=g) < 0.5, -1, s_kv + torch.randint(0, 7, idx.shape, generator=g))
    return torch.where(hit, bad.to(torch.int32), idx)


# ----------------------------------------------------------------------------- pure-Python model
def valid_entries(idx: torch.Tensor, s_kv, topk_length) -> list[dict[int, int]]:
    """Per query: {kv row: position in the row} of its valid entries."""
    out = []
    for i, row in enumerate(idx.tolist()):
        n = len(row) if topk_length is None else int(topk_length[i])
        d = {}
        for j, kv in enumerate(row):
            if j < n and kv >= 0 and (s_kv is None or kv < s_kv):
                assert kv not in d, "test workloads have duplicate-free rows"
                d[kv] = j
        out.append(d)
    return out


def _levels_desc(G, lowest):
    out, L = [], G
    while L >= lowest:
        out.append(L)
        L //= 2
    return out


def model_plan(idx, *, s_kv, topk_length, G, T, tau, imp, M):
    """Reference decomposition. Returns per group the list of segments
    ``(level, member_bits, [(kv, mask), ...])`` (level 0 = merged) and the dropped rows per query."""
    sel = valid_entries(idx, s_kv, topk_length)
    s_q = len(sel)
    n_groups = -(-s_q // G)
    sel += [{} for _ in range(n_groups * G - s_q)]
    groups, dropped = [], [set() for _ in range(n_groups * G)]
    for g in range(n_groups):
        S = [sel[g * G + k] for k in range(G)]
        # cascade: every row of member k sits at the largest aligned all-selecting block
        lv = [{} for _ in range(G)]
        for k in range(G):
            for kv in S[k]:
                for L in _levels_desc(G, 1):
                    b0 = (k // L) * L
                    if all(kv in S[m] for m in range(b0, b0 + L)):
                        lv[k][kv] = L
                        break
        # tile-aware clipping, top level first: a segment's rows are ordered by the importance of
        # the block's first member (its representative); a short tail of them moves down a level
        for L in _levels_desc(G, max(M, 2)):
            for b0 in range(0, G, L):
                seg = sorted((S[b0][kv], kv) for kv, l in lv[b0].items() if l == L)
                for m in range(b0, b0 + L):  # every member has the same rows at this level
                    assert {kv for _, kv in seg} == {kv for kv, l in lv[m].items() if l == L}
                r = len(seg) % T
                if 0 < r < tau * T:
                    for _, kv in seg[len(seg) - r:]:
                        for m in range(b0, b0 + L):
                            lv[m][kv] = L // 2
        if imp:  # importance-aware clipping of the private residual: drop the lowest-ranked tail
            for k in range(G):
                priv = sorted((S[k][kv], kv) for kv, l in lv[k].items() if l == 1)
                r = len(priv) % T
                if 0 < r < tau * T:
                    for _, kv in priv[len(priv) - r:]:
                        del lv[k][kv]
                        dropped[g * G + k].add(kv)
        segs = []
        for L in _levels_desc(G, M):
            for b0 in range(0, G, L):
                bits = ((1 << L) - 1) << b0
                rows = sorted((S[b0][kv], kv) for kv, l in lv[b0].items() if l == L)
                segs.append((L, bits, [(kv, bits) for _, kv in rows]))
        if M > 1:
            for b0 in range(0, G, M):
                cols = {}
                for m in range(b0, b0 + M):
                    for kv, l in lv[m].items():
                        if l < M:
                            cols[kv] = cols.get(kv, 0) | (1 << m)
                segs.append((0, ((1 << M) - 1) << b0, sorted(cols.items())))
        groups.append(segs)
    return groups, dropped[:s_q]


def owned_pairs(p) -> list[tuple[int, int]]:
    """Sorted list of every (query, kv) pair the plan processes, with multiplicity."""
    kv, mask = p.columns()
    g = torch.arange(p.n_groups)[:, None, None].expand_as(kv)
    out = []
    for k in range(p.group_size):
        hit = (kv != -1) & (((mask >> k) & 1) == 1)
        q = g[hit] * p.group_size + k
        out += list(zip(q.tolist(), kv[hit].tolist()))
    return sorted(out)


def expected_pairs(idx, s_kv, topk_length, dropped=None) -> list[tuple[int, int]]:
    out = []
    for i, d in enumerate(valid_entries(idx, s_kv, topk_length)):
        out += [(i, kv) for kv in d if dropped is None or kv not in dropped[i]]
    return sorted(out)


def check_structure(p):
    """Layout invariants every plan must satisfy (on the decoded columns; the raw format checked too)."""
    n_groups, cap, T = p.tile_kv.shape
    G = p.group_size
    assert n_groups == -(-p.s_q // G)
    assert p.packed == packs_columns(p.s_kv, G) == (p.tile_mask is None)
    tile_kv, tile_mask = p.columns()
    if p.packed:  # padding words are -1, the others hold row | mask << 24
        assert torch.equal(p.tile_kv == -1, tile_kv == -1)
        assert torch.equal(torch.where(tile_kv >= 0, tile_kv | (tile_mask << PACK_SHIFT), -1), p.tile_kv)
    assert tile_mask.shape == tile_kv.shape and p.tile_level.shape == (n_groups, cap) == p.tile_members.shape
    for t in (tile_kv, tile_mask, p.tile_level, p.tile_members, p.group_tiles, p.dropped):
        assert t.dtype == torch.int32
    slot = torch.arange(cap)[None, :]
    used = slot < p.group_tiles[:, None]
    assert torch.equal(p.tile_level >= 0, used), "tiles 0..group_tiles-1 used, the rest tile_level -1"
    assert (tile_kv[~used] == -1).all() and (tile_mask[~used] == 0).all() and (p.tile_members[~used] == 0).all()
    pad = tile_kv == -1
    assert (tile_mask[pad] == 0).all(), "padding slots carry no member bits"
    assert (tile_mask[~pad] != 0).all(), "every used slot is owned by someone"
    assert ((tile_mask >> G) == 0).all() and (tile_mask >= 0).all()
    s_q_bits = torch.arange(n_groups * G).view(n_groups, G) < p.s_q  # padding queries own nothing
    for k in range(G):
        has = (((tile_mask >> k) & 1) == 1).flatten(1).any(1)
        assert not (has & ~s_q_bits[:, k]).any()
    members = torch.zeros_like(p.tile_members)
    for k in range(G):
        members |= (((tile_mask >> k) & 1).amax(2)) << k
    assert (members & ~p.tile_members == 0).all(), "a tile's owners lie inside its tile_members block"
    assert (p.tile_members[used] != 0).all() and (members[used] != 0).all(), "no empty used tile"
    tm = p.tile_members[used].tolist()
    for x, lv in zip(tm, p.tile_level[used].tolist()):  # tile_members is one aligned block of the tile's level
        width = lv if lv > 0 else p.merge_level
        low = (x & -x).bit_length() - 1
        assert low % width == 0 and x == ((1 << width) - 1) << low
    ok_levels = set(_levels_desc(G, p.merge_level)) | ({0} if p.merge_level > 1 else set())
    assert set(p.tile_level[used].tolist()) <= ok_levels
    for L in _levels_desc(G, p.merge_level):  # a level-L slot is owned by one whole aligned block
        lt = (p.tile_level == L)[..., None] & ~pad
        m = tile_mask[lt.expand_as(pad)]
        for x in m.tolist():
            low = (x & -x).bit_length() - 1
            assert low % L == 0 and x == ((1 << L) - 1) << low
    s = p.stats
    assert s["tiles"] == int(used.sum())
    assert s["tiles"] * T == s["rows_processed"] + s["padded_slots"]
    assert s["rows_processed"] == int((~pad & used[..., None]).sum())
    assert sum(s["tiles_per_level"].values()) == s["tiles"]
    assert s["reduction"] == pytest.approx(1 - s["rows_processed"] / max(1, s["valid_pairs"]))
    assert s["dropped_pairs"] == int(p.dropped.sum())


def check_against_model(p, idx, *, s_kv, topk_length):
    groups, dropped = model_plan(idx, s_kv=s_kv, topk_length=topk_length, G=p.group_size, T=p.tile,
                                 tau=p.clip_threshold, imp=p.importance_clip, M=p.merge_level)
    T = p.tile
    tile_kv, tile_mask = p.columns()
    for g, segs in enumerate(groups):
        slot = 0
        for level, _bits, cols in segs:
            nt = -(-len(cols) // T)
            kv = tile_kv[g, slot:slot + nt].reshape(-1).tolist()
            mk = tile_mask[g, slot:slot + nt].reshape(-1).tolist()
            assert p.tile_level[g, slot:slot + nt].tolist() == [level] * nt, (g, level)
            assert kv[len(cols):] == [-1] * (nt * T - len(cols)), "padding only at the segment's end"
            got = list(zip(kv[:len(cols)], mk[:len(cols)]))
            if level > 0:  # shared / private segments: rows in the representative's importance order
                assert got == cols, (g, level)
            else:  # merged segment: one column a distinct row, member-masked (order not pinned)
                assert sorted(got) == cols, (g, "merged")
            slot += nt
        assert int(p.group_tiles[g]) == slot
    assert p.dropped.tolist() == [len(d) for d in dropped]
    return groups, dropped


# ----------------------------------------------------------------------------- hypothesis: exactness
@st.composite
def plan_case(draw, force_misaligned=True):
    G = draw(st.sampled_from(GROUPS))
    T = draw(st.sampled_from(TILES))
    tau = draw(st.sampled_from(TAUS))
    M = draw(st.sampled_from([m for m in GROUPS if m <= G]))
    mask_method = draw(st.sampled_from(MASK_METHODS))
    n_groups = draw(st.integers(0, 4))
    extra = draw(st.integers(1, G - 1)) if (G > 1 and force_misaligned) else draw(st.integers(0, G - 1))
    s_q = max(1, n_groups * G + extra)
    if T > 1 and force_misaligned:
        topk = draw(st.integers(1, 40).filter(lambda k: k % T != 0))
    else:
        topk = draw(st.integers(1, 40))
    kind = draw(st.sampled_from(["random", "correlated", "identical", "disjoint"]))
    s_kv = s_q * topk + 3 if kind == "disjoint" else topk + draw(st.integers(0, 2 * topk + 4))
    if kind == "correlated":
        s_kv = max(s_kv, topk + 2)
    seed = draw(st.integers(0, 2**31 - 1))
    inv = draw(st.sampled_from([0.0, 0.1, 0.4]))
    use_len = draw(st.booleans())
    pass_s_kv = draw(st.booleans()) or inv > 0  # entries >= s_kv need s_kv to be invalid
    if _generate is not None and draw(st.integers(0, 3)) == 0:  # sometimes a shared (causal) preset
        s_kv = max(s_q, topk + draw(st.integers(0, 2 * topk + 4)))
        base = _generate(draw(st.sampled_from(PRESETS)), s_q, s_kv, topk, seed=seed)
    else:
        base = _local_workload(kind, s_q, s_kv, topk, seed)
    idx = add_invalid(base, s_kv, inv, seed + 1)
    topk_length = None
    if use_len:
        g = torch.Generator().manual_seed(seed + 2)
        topk_length = torch.randint(0, topk + 2, (s_q,), generator=g, dtype=torch.int32)
    return dict(idx=idx, s_kv=s_kv if pass_s_kv else None, topk_length=topk_length,
                G=G, T=T, tau=tau, M=M, mask_method=mask_method)


def _plan(c, **over):
    kw = dict(s_kv=c["s_kv"], topk_length=c["topk_length"], group_size=c["G"], tile=c["T"],
              clip_threshold=c["tau"], merge_level=c["M"], mask_method=c["mask_method"], importance_clip=False)
    kw.update(over)
    return plan(c["idx"], **kw)


@HYP
@given(plan_case())
def test_plan_is_exact(c):
    """Every valid (query, row) pair of the Top-K is owned by exactly one tile slot, nothing else is."""
    p = _plan(c)
    check_structure(p)
    assert owned_pairs(p) == expected_pairs(c["idx"], c["s_kv"], c["topk_length"])
    assert p.stats["valid_pairs"] == len(expected_pairs(c["idx"], c["s_kv"], c["topk_length"]))
    assert int(p.dropped.sum()) == 0


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_case(force_misaligned=False), st.booleans())
def test_plan_matches_python_model(c, imp):
    """Segment layout (levels G..M then merged; blocks in order; rows in the block representative's
    importance order; padding at the end),
    clipping and importance clipping agree with the pure-Python model."""
    if imp:
        c = dict(c, M=1)
    p = _plan(c, importance_clip=imp)
    check_structure(p)
    check_against_model(p, c["idx"], s_kv=c["s_kv"], topk_length=c["topk_length"])


# ----------------------------------------------------------------------------- methods agree
def _plans_equal(a, b):
    """Every tensor field of the two plans is equal (the same column format), so are the decoded columns
    and the stats."""
    names = [f.name for f in dataclasses.fields(a) if isinstance(getattr(a, f.name), torch.Tensor)]
    assert {"tile_kv", "tile_level", "tile_members", "group_tiles", "dropped"} <= set(names)
    assert a.packed == b.packed
    for name in names:
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for x, y in zip(a.columns(), b.columns()):
        assert torch.equal(x, y)
    assert a.stats == b.stats


@pytest.mark.parametrize("kind", ["random", "correlated", "identical", "disjoint", *PRESETS[1:]])
@pytest.mark.parametrize("G", [1, 2, 4, 8, 16])
def test_sort_and_bitmap_agree(kind, G):
    s_q, topk = 45, 24
    idx, s_kv = workload(kind, s_q, 96, topk, seed=G)
    idx = add_invalid(idx, s_kv, 0.1, seed=G)
    tl = torch.randint(0, topk + 1, (s_q,), generator=torch.Generator().manual_seed(G), dtype=torch.int32)
    for topk_length in (None, tl):
        ms, vs = member_masks(idx, G, s_kv=s_kv, topk_length=topk_length, mask_method="sort")
        mb, vb = member_masks(idx, G, s_kv=s_kv, topk_length=topk_length, mask_method="bitmap")
        assert torch.equal(ms, mb) and torch.equal(vs, vb)
        for M, T, tau, imp in ((1, 4, 0.5, False), (1, 3, 1.0, True), (G, 16, 0.75, False), (min(2, G), 64, 0.25, False)):
            kw = dict(s_kv=s_kv, topk_length=topk_length, group_size=G, tile=T, clip_threshold=tau, merge_level=M,
                      importance_clip=imp)
            _plans_equal(plan(idx, mask_method="sort", **kw), plan(idx, mask_method="bitmap", **kw))


@pytest.mark.parametrize("mask_method", MASK_METHODS)
@pytest.mark.parametrize("G", [1, 2, 4, 8, 16])
def test_member_masks_and_levels_brute_force(mask_method, G):
    s_q, topk, s_kv = 37, 12, 40
    idx, s_kv = workload("correlated", s_q, s_kv, topk, seed=3 + G)
    idx = add_invalid(idx, s_kv, 0.15, seed=G)
    masks, valid = member_masks(idx, G, s_kv=s_kv, mask_method=mask_method)
    sel = valid_entries(idx, s_kv, None)
    sel += [{} for _ in range((-s_q) % G)]
    exp_m = torch.zeros(s_q, topk, dtype=torch.int32)
    exp_l = torch.zeros(s_q, topk, dtype=torch.int32)
    for i in range(s_q):
        b0 = (i // G) * G
        for j, kv in enumerate(idx[i].tolist()):
            if kv in sel[i]:
                exp_m[i, j] = sum(1 << k for k in range(G) if kv in sel[b0 + k])
                exp_l[i, j] = next(L for L in _levels_desc(G, 1)
                                   if all(kv in sel[b0 + (i % G // L) * L + m] for m in range(L)))
    assert torch.equal(valid, torch.tensor([[kv in sel[i] for kv in r] for i, r in enumerate(idx.tolist())]))
    assert masks.dtype == torch.int32 and torch.equal(masks, exp_m)
    assert torch.equal(cascade_levels(masks, G), exp_l)


# ----------------------------------------------------------------------------- Table 1
A, B, C, D, E, F, Gr, H = range(8)
TABLE1 = torch.tensor([[A, B, C, E], [A, B, C, F], [A, B, D, Gr], [A, B, D, H]], dtype=torch.int32)


@pytest.mark.parametrize("mask_method", MASK_METHODS)
@pytest.mark.parametrize("G,rows", [(1, 16), (2, 10), (4, 8), (8, 8)])
def test_table1(mask_method, G, rows):
    p = plan(TABLE1, s_kv=8, group_size=G, tile=1, mask_method=mask_method)
    check_structure(p)
    assert p.stats["valid_pairs"] == 16
    assert p.stats["rows_processed"] == rows
    assert p.stats["padded_slots"] == 0 and p.stats["tiles"] == rows
    assert p.stats["reduction"] == pytest.approx(1 - rows / 16)
    assert owned_pairs(p) == expected_pairs(TABLE1, 8, None)
    if G == 4:  # {A,B} shared by all four, C and D by the pairs, E F G H private
        assert p.stats["tiles_per_level"] == {4: 2, 2: 2, 1: 4}
        kv, mask = p.columns()
        assert kv[0, :8, 0].tolist() == [A, B, C, D, E, F, Gr, H]
        assert mask[0, :8, 0].tolist() == [15, 15, 3, 12, 1, 2, 4, 8]


# ----------------------------------------------------------------------------- clipping
def _cascade_segment_sizes(idx, s_kv, topk_length, G, M=1):
    """Sizes of the no-clipping cascade segments (and merged segments), computed independently."""
    groups, _ = model_plan(idx, s_kv=s_kv, topk_length=topk_length, G=G, T=1, tau=0.0, imp=False, M=M)
    return [len(cols) for segs in groups for _, _, cols in segs]


@pytest.mark.parametrize("kind", ["random", "correlated", "identical"])
@pytest.mark.parametrize("G,M", [(1, 1), (2, 1), (4, 1), (8, 1), (16, 1), (8, 2), (8, 8)])
@pytest.mark.parametrize("T", [2, 3, 8, 16, 64])
def test_clip_threshold_zero_never_pushes(kind, G, M, T):
    s_q, topk, s_kv = 35, 29, 80
    idx, s_kv = workload(kind, s_q, s_kv, topk, seed=T * 17 + G)
    p = plan(idx, s_kv=s_kv, group_size=G, tile=T, clip_threshold=0.0, merge_level=M)
    p1 = plan(idx, s_kv=s_kv, group_size=G, tile=1, clip_threshold=0.0, merge_level=M)
    check_structure(p)
    sizes = _cascade_segment_sizes(idx, s_kv, None, G, M)
    assert p.stats["tiles"] == sum(-(-n // T) for n in sizes)
    assert p.stats["rows_processed"] == sum(sizes) == p1.stats["rows_processed"] == p1.stats["tiles"]
    assert p.stats["tiles_per_level"].keys() == p1.stats["tiles_per_level"].keys()  # nothing moved between levels


@pytest.mark.parametrize("kind", ["random", "correlated", "identical"])
@pytest.mark.parametrize("G,M", [(2, 1), (4, 1), (8, 1), (16, 1), (8, 2), (8, 4), (16, 16)])
@pytest.mark.parametrize("T", [2, 3, 8, 16])
def test_clip_threshold_one_fills_shared_tiles(kind, G, M, T):
    s_q, topk, s_kv = 35, 29, 60
    if kind == "identical":  # truly identical rows (the shared generator's are causal)
        idx = _local_workload(kind, s_q, s_kv, topk, seed=T * 31 + G)
    else:
        idx, s_kv = workload(kind, s_q, s_kv, topk, seed=T * 31 + G)
    p = plan(idx, s_kv=s_kv, group_size=G, tile=T, clip_threshold=1.0, merge_level=M)
    check_structure(p)
    shared = p.tile_level >= 2
    assert (p.columns()[0][shared] != -1).all(), "every tile at a level >= 2 is full"
    assert owned_pairs(p) == expected_pairs(idx, s_kv, None)
    if kind == "identical" and M == 1:  # every row shared by the whole group: the partial tail cascades to level 1
        full = s_q // G
        per_group = (topk // T) * T + G * (topk % T)
        assert int((p.columns()[0][:full] != -1).sum()) == full * per_group


@pytest.mark.parametrize("tau", TAUS)
@pytest.mark.parametrize("G", [1, 4, 8])
def test_clipping_monotone_sanity(tau, G):
    """Pushing down is exact at every threshold; stats stay consistent; rows never fall below distinct rows."""
    s_q, topk, s_kv = 24, 30, 70
    idx, s_kv = workload("correlated", s_q, s_kv, topk, seed=5)
    p = plan(idx, s_kv=s_kv, group_size=G, tile=8, clip_threshold=tau)
    check_structure(p)
    assert owned_pairs(p) == expected_pairs(idx, s_kv, None)
    distinct = sum(len(set(idx[g * G:(g + 1) * G].flatten().tolist())) for g in range(-(-s_q // G)))
    assert p.stats["rows_processed"] >= distinct


# ----------------------------------------------------------------------------- importance clipping
def _owned_by_level(p):
    """{query: {kv: level}} from the plan's tiles."""
    out = {}
    G = p.group_size
    tile_kv, tile_mask = p.columns()
    for g in range(p.n_groups):
        for s in range(int(p.group_tiles[g])):
            lvl = int(p.tile_level[g, s])
            for kv, m in zip(tile_kv[g, s].tolist(), tile_mask[g, s].tolist()):
                for k in range(G):
                    if kv != -1 and (m >> k) & 1:
                        out.setdefault(g * G + k, {})[kv] = lvl
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan_case(force_misaligned=False))
def test_importance_clip(c):
    c = dict(c, M=1)
    base = _plan(c, importance_clip=False)
    p = _plan(c, importance_clip=True)
    check_structure(p)
    T, thr = c["T"], c["tau"] * c["T"]
    pos = valid_entries(c["idx"], c["s_kv"], c["topk_length"])
    own0, own1 = _owned_by_level(base), _owned_by_level(p)
    dropped_sets = []
    for i in range(p.s_q):
        valid = set(pos[i])
        kept = set(own1.get(i, {}))
        dropped = valid - kept
        dropped_sets.append(dropped)
        private = sorted((pos[i][kv], kv) for kv, l in own0.get(i, {}).items() if l == 1)
        r = len(private) % T
        n_drop = r if 0 < r < thr else 0
        assert len(dropped) == n_drop == int(p.dropped[i]) <= T - 1
        # the dropped rows are the lowest-ranked (largest position) private rows
        assert dropped == {kv for _, kv in private[len(private) - n_drop:]}
        # everything else is processed at the same level as without importance clipping
        assert own1.get(i, {}) == {kv: l for kv, l in own0.get(i, {}).items() if kv not in dropped}
    assert owned_pairs(p) == expected_pairs(c["idx"], c["s_kv"], c["topk_length"], dropped_sets)
    assert p.stats["dropped_pairs"] == int(p.dropped.sum()) == sum(map(len, dropped_sets))
    assert p.stats["rows_processed"] == base.stats["rows_processed"] - p.stats["dropped_pairs"]
    if c["tau"] == 1.0:  # every private tile is full
        assert (p.columns()[0][p.tile_level == 1] != -1).all()


def test_importance_clip_needs_merge_level_one():
    idx, _ = workload("random", 8, 32, 8, seed=0)
    for M in (2, 4, 8):
        with pytest.raises(ValueError, match="merge_level"):
            plan(idx, s_kv=32, group_size=8, tile=4, importance_clip=True, merge_level=M)
    plan(idx, s_kv=32, group_size=8, tile=4, importance_clip=True, merge_level=1)


# ----------------------------------------------------------------------------- work list
@pytest.mark.parametrize("G,M", [(1, 1), (2, 1), (4, 1), (8, 1), (8, 4), (16, 1), (16, 2)])
@pytest.mark.parametrize("kind", ["random", "correlated"])
def test_work_list(G, M, kind):
    s_q, topk, s_kv = 43, 21, 64
    idx, s_kv = workload(kind, s_q, s_kv, topk, seed=G + M)
    idx = add_invalid(idx, s_kv, 0.05, seed=1)
    p = plan(idx, s_kv=s_kv, group_size=G, tile=4, merge_level=M)
    cap = p.capacity
    tile_kv, tile_mask = p.columns()
    qps = [1 << i for i in range(int(math.log2(G)) + 2)]  # up to 2G (clamped to G)
    for qp in qps:
        tiles, ntiles = p.work_list(qp)
        q = min(qp, G)
        n_sub = G // q
        assert tiles.shape == (p.n_groups * n_sub, cap) and ntiles.shape == (p.n_groups * n_sub,)
        assert tiles.dtype == torch.int32 and ntiles.dtype == torch.int32
        for g in range(p.n_groups):
            for s in range(n_sub):
                bits = ((1 << q) - 1) << (s * q)
                exp = [g * cap + t for t in range(int(p.group_tiles[g])) if int(p.tile_members[g, t]) & bits]
                prog = g * n_sub + s
                assert int(ntiles[prog]) == len(exp)
                assert tiles[prog, :len(exp)].tolist() == exp
        # every owned pair of a query is reachable from its program's tiles
        reach = set()
        for prog in range(tiles.shape[0]):
            g, s = divmod(prog, n_sub)
            for tid in tiles[prog, :int(ntiles[prog])].tolist():
                gg, slot = divmod(tid, cap)
                assert gg == g
                for kv, m in zip(tile_kv[g, slot].tolist(), tile_mask[g, slot].tolist()):
                    for k in range(s * q, (s + 1) * q):
                        if kv != -1 and (m >> k) & 1:
                            reach.add((g * G + k, kv))
        assert sorted(reach) == owned_pairs(p)
        assert p.work_list(qp)[0] is tiles  # cached
    for bad in (0, 3, -2):
        with pytest.raises(ValueError):
            p.work_list(bad)


@pytest.mark.parametrize("G,qp", [(1, 1), (8, 1), (8, 4), (8, 8), (16, 2)])
def test_program_order_is_a_longest_first_permutation(G, qp):
    idx, s_kv = workload("correlated", 45, 64, 21, seed=G + qp)
    p = plan(add_invalid(idx, s_kv, 0.05, seed=2), s_kv=s_kv, group_size=G, tile=4)
    _, ntiles = p.work_list(qp)
    assert torch.equal(p.program_counts(qp), ntiles)
    order = p.program_order(qp)
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(ntiles.shape[0]))
    runs = ntiles[order.long()].tolist()
    assert runs == sorted(runs, reverse=True)
    for a, b in zip(order.tolist(), order.tolist()[1:]):  # stable: ties keep program order
        if int(ntiles[a]) == int(ntiles[b]):
            assert a < b
    assert p.program_order(qp) is order  # cached
    for bad in (0, 3, -2):
        with pytest.raises(ValueError, match="power of two"):
            p.program_order(bad)


# ----------------------------------------------------------------------------- arguments and edge cases
def test_bad_arguments():
    idx, _ = workload("random", 6, 32, 8, seed=0)
    with pytest.raises(TypeError, match="int32"):
        plan(idx.long(), s_kv=32)
    with pytest.raises(TypeError):
        plan(idx.tolist(), s_kv=32)
    with pytest.raises(ValueError):
        plan(idx.view(-1), s_kv=32)
    with pytest.raises(ValueError):
        plan(idx.view(1, 6, 8), s_kv=32)  # [s_q, h_kv, topk] with h_kv != 1
    with pytest.raises(ValueError):
        plan(idx.view(1, 1, 6, 8), s_kv=32)
    with pytest.raises(ValueError):
        plan(idx[:, :0], s_kv=32)
    for G in (0, 3, 6, 32, -4):
        with pytest.raises(ValueError, match="group_size"):
            plan(idx, s_kv=32, group_size=G)
    with pytest.raises(TypeError, match="group_size"):
        plan(idx, s_kv=32, group_size=8.0)
    for T in (0, -1, 2.0):
        with pytest.raises(ValueError, match="tile"):
            plan(idx, s_kv=32, tile=T)
    for tau in (-0.1, 1.01, float("nan")):
        with pytest.raises(ValueError, match="clip_threshold"):
            plan(idx, s_kv=32, clip_threshold=tau)
    with pytest.raises(ValueError, match="mask_method"):
        plan(idx, s_kv=32, mask_method="hash")
    with pytest.raises(ValueError, match="mask_method"):
        member_masks(idx, 4, s_kv=32, mask_method="hash")
    for M in (0, 3, 16):
        with pytest.raises(ValueError):
            plan(idx, s_kv=32, group_size=8, merge_level=M)
    for bad_s_kv in (0, -3):
        with pytest.raises(ValueError, match="s_kv"):
            plan(idx, s_kv=bad_s_kv)
    with pytest.raises(ValueError, match="topk_length"):
        plan(idx, s_kv=32, topk_length=torch.full((5,), 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="topk_length"):
        plan(idx, s_kv=32, topk_length=torch.full((6, 1), 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="topk_length"):
        plan(idx, s_kv=32, topk_length=torch.full((6,), 4.0))


def test_three_dim_indices_and_int64_topk_length():
    s_q, topk, s_kv = 13, 10, 40
    idx, s_kv = workload("correlated", s_q, s_kv, topk, seed=9)
    idx = add_invalid(idx, s_kv, 0.1, seed=2)
    tl = torch.arange(s_q, dtype=torch.int64)
    a = plan(idx, s_kv=s_kv, topk_length=tl.int(), group_size=4, tile=4)
    b = plan(idx[:, None, :], s_kv=s_kv, topk_length=tl, group_size=4, tile=4)
    _plans_equal(a, b)


@pytest.mark.parametrize("mask_method", MASK_METHODS)
@pytest.mark.parametrize("s_kv", [None, 5])
def test_all_invalid_rows(mask_method, s_kv):
    """A batch with no valid entry plans to nothing (no tiles), whatever s_kv is."""
    idx = torch.full((5, 4), -1, dtype=torch.int32)
    p = plan(idx, s_kv=s_kv, group_size=2, tile=2, mask_method=mask_method)
    check_structure(p)
    assert p.stats["tiles"] == 0 and p.stats["valid_pairs"] == 0 and p.stats["rows_processed"] == 0
    masks, valid = member_masks(idx, 2, s_kv=s_kv, mask_method=mask_method)
    assert not valid.any() and not masks.any()


@pytest.mark.parametrize("mask_method", MASK_METHODS)
def test_member_masks_s_kv_zero(mask_method):
    masks, valid = member_masks(torch.tensor([[0, 1], [1, -1]], dtype=torch.int32), 2, s_kv=0, mask_method=mask_method)
    assert not valid.any() and not masks.any()


@pytest.mark.parametrize("mask_method", MASK_METHODS)
@pytest.mark.parametrize("G", [1, 4])
def test_empty_batch(mask_method, G):
    """s_q = 0 is a legal shape; the plan is empty and its work list too."""
    p = plan(torch.zeros((0, 6), dtype=torch.int32), s_kv=8, group_size=G, tile=2, mask_method=mask_method)
    assert p.n_groups == 0 and p.stats["tiles"] == 0 and p.dropped.shape == (0,)
    tiles, ntiles = p.work_list(1)
    assert tiles.shape[0] == 0 and ntiles.shape == (0,)


@pytest.mark.parametrize("mask_method", MASK_METHODS)
def test_rows_beyond_s_kv_ignored_without_s_kv_bound(mask_method):
    """With s_kv=None only negative entries are invalid; large rows are real rows."""
    idx = torch.tensor([[0, 1000, -1, 7], [1000, 7, 3, -5]], dtype=torch.int32)
    p = plan(idx, group_size=2, tile=2, mask_method=mask_method)
    assert owned_pairs(p) == sorted([(0, 0), (0, 1000), (0, 7), (1, 1000), (1, 7), (1, 3)])
    assert p.stats["rows_processed"] == 4  # 7 and 1000 shared by the pair


def test_duplicate_entries_owned_as_often_as_selected():
    idx = torch.tensor([[5, 5], [5, 7]], dtype=torch.int32)
    p = plan(idx, s_kv=8, group_size=2, tile=1)
    assert owned_pairs(p) == [(0, 5), (0, 5), (1, 5), (1, 7)]  # reference semantics: every entry counts


# ----------------------------------------------------------------------------- Triton planner backend
_ON_GPU = torch.cuda.is_available()
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _backend_case(G, M, T, tau, imp, mask_method, device, s_q=37, topk=24, s_kv=200, seed=0, both_lengths=True,
                  backend="triton", split=False):
    idx, s_kv = workload("correlated", s_q, s_kv, topk, seed=seed)
    idx = add_invalid(idx, s_kv, 0.1, seed=seed).to(device)
    tl = torch.randint(0, topk + 1, (s_q,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32).to(device)
    for topk_length in ((None, tl) if both_lengths else (tl,)):
        kw = dict(s_kv=s_kv, topk_length=topk_length, group_size=G, tile=T, clip_threshold=tau, merge_level=M,
                  importance_clip=imp, mask_method=mask_method, split_private=split)
        _plans_equal(plan(idx, backend=backend, **kw), plan(idx, backend="torch", **kw))


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mask_method", MASK_METHODS)
@pytest.mark.parametrize("G,M,T,tau,imp", [(1, 1, 64, 0.5, False), (2, 1, 4, 0.5, True), (4, 2, 8, 1.0, False),
                                           (8, 1, 16, 0.5, True), (8, 4, 64, 0.5, False), (8, 8, 2, 0.25, False),
                                           (16, 1, 32, 0.75, False), (16, 4, 1, 0.5, False)])
def test_triton_backend_matches_torch_gpu(G, M, T, tau, imp, mask_method):
    """The fused Triton planner equals the torch planner."""
    _backend_case(G, M, T, tau, imp, mask_method, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_GPU, reason="needs a CUDA GPU")
def test_triton_planner_refuses_tiles_not_a_power_of_two():
    """Tiles of 3 or 6 rows plan with the torch planner only; asking Triton for them names the fix."""
    idx = torch.randint(0, 64, (16, 8), dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="power-of-two tile, got 3; use backend='torch'"):
        plan(idx, s_kv=64, tile=3, backend="triton")
    assert plan(idx, s_kv=64, tile=6).tile == 6  # auto: a planner for any tile (CUDA on Hopper, else torch)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # raised inside Triton's interpreter
@pytest.mark.skipif(_ON_GPU or not _INTERPRET, reason="Triton interpreter check (CPU with TRITON_INTERPRET=1)")
def test_triton_backend_matches_torch_interpreter():
    _backend_case(4, 1, 4, 0.5, True, "bitmap", "cpu", s_q=9, topk=10, s_kv=40, both_lengths=False)


# ----------------------------------------------------------------------------- CUDA planner backend
_ON_HOPPER = _ON_GPU and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_HOPPER, reason="the CUDA planner needs an sm_90 GPU")
@pytest.mark.parametrize("G,M,T,tau,imp,split", [(1, 1, 64, 0.5, False, False), (2, 1, 4, 0.5, True, False),
                                                 (4, 2, 8, 1.0, False, True), (8, 1, 16, 0.5, True, False),
                                                 (8, 4, 64, 0.5, False, True), (8, 4, 8, 0.5, True, True),
                                                 (8, 8, 2, 0.25, False, False), (8, 2, 3, 0.75, False, False),
                                                 (4, 4, 64, 0.0, False, True), (8, 1, 1, 0.5, False, False),
                                                 (2, 2, 8, 0.5, False, False), (4, 4, 16, 1.0, False, False)])
@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_planner_matches_torch_gpu(G, M, T, tau, imp, split, seed, monkeypatch):
    """The CUDA planner equals the torch planner (invalid rows, topk_length, clipping, split private rows);
    its tile arrays and dropped counts come uninitialized (poisoned here), so every slot must have been written."""
    _poison_cuda_plan_buffers(monkeypatch)
    _backend_case(G, M, T, tau, imp, "bitmap", "cuda", seed=seed, backend="cuda", split=split)


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_HOPPER, reason="the CUDA planner needs an sm_90 GPU")
@pytest.mark.parametrize("T,tau,topk", [(64, 0.5, 1000), (16, 1.0, 1000), (32, 0.0, 2048), (64, 1.0, 2048)])
def test_cuda_planner_two_runs_a_thread(T, tau, topk, monkeypatch):
    """Group 8 at merge level 8 with lists of more than 512 entries: 512-thread CTAs whose threads hold two
    runs of 16 entries (the second run's rows read again from the list for the tile writes); invalid
    entries, topk_length and a partial last group included; equal to the torch planner."""
    _poison_cuda_plan_buffers(monkeypatch)
    _backend_case(8, 8, T, tau, False, "bitmap", "cuda", s_q=300, topk=topk, s_kv=6000, backend="cuda")


def _poison_cuda_plan_buffers(monkeypatch):
    from quilt_attn.planner import cuda_plan

    def poisoned(*args, **kw):
        buf = cuda_plan_buffers(*args, **kw)
        for name in ("tile_kv", "tile_mask", "tile_level", "tile_members", "dropped"):
            if buf[name] is not None:  # (tile_mask None: packed columns)
                buf[name].fill_(0x5EADBEEF)
        return buf

    cuda_plan_buffers = cuda_plan.plan_buffers
    monkeypatch.setattr(cuda_plan, "plan_buffers", poisoned)


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_HOPPER, reason="the CUDA planner needs an sm_90 GPU")
@pytest.mark.parametrize("kind", ["glm53-like", "random", "identical"])
@pytest.mark.parametrize("G,M,split", [(8, 8, False), (8, 4, True), (8, 1, False), (4, 4, False), (2, 2, False),
                                       (2, 1, True)])
def test_cuda_planner_matches_triton_full_topk(kind, G, M, split, monkeypatch):
    """Full-size lists (topk 2048 over a 64K context): the CUDA planner's hash table equals the Triton planner."""
    from quilt_attn.workloads import generate

    if kind == "identical":
        idx = generate("random", 1, 65536, 2048, seed=3, device="cuda").expand(300, 2048).contiguous()
    else:
        idx = generate(kind, 300, 65536, 2048, seed=3, device="cuda")
    kw = dict(s_kv=65536, group_size=G, merge_level=M, split_private=split)
    want = plan(idx, backend="triton", **kw)
    _poison_cuda_plan_buffers(monkeypatch)
    _plans_equal(plan(idx, backend="cuda", **kw), want)


@pytest.mark.gpu
@pytest.mark.skipif(not _ON_HOPPER, reason="the CUDA planner needs an sm_90 GPU")
def test_cuda_planner_scope_and_auto():
    """Outside its scope the CUDA planner names the limit; ``auto`` then runs Triton, inside it CUDA."""
    idx = torch.randint(0, 4096, (64, 32), dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="group sizes up to 8"):
        plan(idx, s_kv=4096, group_size=16, backend="cuda")
    with pytest.raises(ValueError, match="mask_method='bitmap'"):
        plan(idx, s_kv=4096, mask_method="sort", backend="cuda")
    big = torch.randint(0, 4096, (16, 4096), dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="16384 entries a group"):
        plan(big, s_kv=4096, group_size=8, backend="cuda")
    _plans_equal(plan(idx, s_kv=4096, group_size=16), plan(idx, s_kv=4096, group_size=16, backend="triton"))
    for s_kv in (250_000, 400_000, 1 << 24, 2**31 - 1):  # the membership table is sized by entries, not s_kv
        _plans_equal(plan(idx, s_kv=s_kv, backend="cuda"), plan(idx, s_kv=s_kv, backend="triton"))
        assert plan(idx, s_kv=s_kv).packed == (s_kv <= PACK_ROW_MASK)
    _plans_equal(plan(idx, backend="cuda"), plan(idx, backend="torch"))  # no s_kv: only negatives invalid
    _plans_equal(plan(idx, s_kv=4096), plan(idx, s_kv=4096, backend="cuda"))


def test_cuda_planner_refuses_cpu_indices():
    idx = torch.randint(0, 64, (16, 8), dtype=torch.int32)
    with pytest.raises(ValueError, match="backend='cuda': the CUDA backend needs a CUDA device"):
        plan(idx, s_kv=64, backend="cuda")
