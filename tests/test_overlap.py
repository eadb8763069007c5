"""Overlap profile: the paper's running example, exact synthetic cases, a brute-force cross-check."""
from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quilt_attn.overlap import OverlapProfile, overlap_profile
from quilt_attn.workloads import generate

A, B, C, D, E, F, G_, H = range(8)
# Table 1 / Figure 7: S1..S4 of four neighbouring queries.
TABLE1 = torch.tensor([[A, B, C, E], [A, B, C, F], [A, B, D, G_], [A, B, D, H]], dtype=torch.int32)


@pytest.mark.parametrize("cascade_group", [4, 8])
def test_paper_table1(cascade_group):
    prof = overlap_profile(TABLE1, group_sizes=(1, 2, 4), cascade_group=cascade_group)
    assert prof.total_entries == 16  # no sharing
    assert prof.fixed_group[1] * 16 == 16
    assert prof.fixed_group[2] * 16 == 10  # A, B loaded by both pairs
    assert prof.fixed_group[4] * 16 == 10  # C, D not shared by all four
    assert prof.cascaded * 16 == 8  # {A,B} once, C and D once per pair, E..H
    assert prof.union[4] * 16 == 8 and prof.union[2] * 16 == 10
    assert prof.shared_fraction[2] == 0.75 and prof.shared_fraction[4] == 0.5
    assert prof.pairwise_overlap == 0.75
    expect = {4: 2 / 16, 2: 2 / 16, 1: 4 / 16}
    assert {L: v for L, v in prof.cascade_levels.items() if v} == expect
    assert math.isclose(sum(prof.cascade_levels.values()), prof.cascaded)


def test_entry_order_and_invalid_padding_do_not_matter():
    shuffled = TABLE1[:, torch.tensor([3, 1, 0, 2])]
    padded = torch.cat([shuffled, torch.full((4, 2), -1, dtype=torch.int32)], dim=1)
    a = overlap_profile(TABLE1, group_sizes=(2, 4), cascade_group=4)
    b = overlap_profile(padded, group_sizes=(2, 4), cascade_group=4)
    assert a.fixed_group == b.fixed_group and a.cascaded == b.cascaded and a.union == b.union
    # pairwise overlap is relative to the row width, topk
    assert b.pairwise_overlap == a.pairwise_overlap * 4 / 6


@pytest.mark.parametrize("cascade_group", [2, 8, 16])
def test_identical_workload(cascade_group):
    idx = generate("identical", 64, 4096, 128, seed=0, group=16)
    prof = overlap_profile(idx, s_kv=4096, cascade_group=cascade_group)
    for G in (2, 4, 8, 16):
        assert prof.shared_fraction[G] == 1.0
        assert math.isclose(prof.fixed_group[G], 1 / G)
        assert math.isclose(prof.union[G], 1 / G)
    assert math.isclose(prof.cascaded, 1 / cascade_group)
    assert prof.cascade_levels[cascade_group] == prof.cascaded
    assert prof.pairwise_overlap == 1.0


def test_disjoint_workload():
    idx = generate("disjoint", 64, 8192, 128, seed=0)
    prof = overlap_profile(idx, s_kv=8192, cascade_group=8)
    for G in (2, 4, 8, 16):
        assert prof.shared_fraction[G] == 0.0
        assert prof.fixed_group[G] == 1.0 and prof.union[G] == 1.0
    assert prof.cascaded == 1.0 and prof.cascade_levels[1] == 1.0
    assert prof.pairwise_overlap == 0.0


def test_random_workload_shares_little():
    prof = overlap_profile(generate("random", 64, 8192, 256, seed=0), s_kv=8192)
    assert prof.pairwise_overlap < 0.1 and prof.cascaded > 0.9


def test_invalid_entries_and_topk_length():
    idx = torch.tensor([[0, 1, 2, 9], [0, 1, 3, 9]], dtype=torch.int32)
    # With s_kv = 9 the 9s are invalid: 3 + 3 entries, {0, 1} shared.
    prof = overlap_profile(idx, s_kv=9, group_sizes=(2,), cascade_group=2)
    assert prof.total_entries == 6
    assert math.isclose(prof.fixed_group[2], 4 / 6) and math.isclose(prof.cascaded, 4 / 6)
    assert math.isclose(prof.shared_fraction[2], 2 / 3)
    lengths = torch.tensor([2, 4], dtype=torch.int32)
    prof = overlap_profile(idx, topk_length=lengths, group_sizes=(2,), cascade_group=2)
    assert prof.total_entries == 6  # 2 + 4 entries; {0, 1} shared
    assert math.isclose(prof.fixed_group[2], 4 / 6) and math.isclose(prof.union[2], 4 / 6)
    assert math.isclose(prof.shared_fraction[2], 2 / 3)


# ----------------------------------------------------------------------------------------------
# Brute force with Python sets
# ----------------------------------------------------------------------------------------------
def _sets(indices, s_kv, topk_length):
    rows = []
    for i, row in enumerate(indices.tolist()):
        n = len(row) if topk_length is None else int(topk_length[i])
        rows.append({k for k in row[:n] if k >= 0 and (s_kv is None or k < s_kv)})
    return rows


def _groups(sets, G):
    return [sets[g : g + G] for g in range(0, len(sets), G)]


def _cascade_count(members, L):
    """Entries processed by cascading over an aligned block of L members (missing members: empty)."""
    members = members + [set()] * (L - len(members))
    if L == 1:
        return len(members[0])
    shared = set.intersection(*members)
    rest = [m - shared for m in members]
    return len(shared) + _cascade_count(rest[: L // 2], L // 2) + _cascade_count(rest[L // 2 :], L // 2)


def brute_profile(indices, s_kv, topk_length, group_sizes, cascade_group):
    sets = _sets(indices, s_kv, topk_length)
    total = sum(map(len, sets))
    out = {"fixed": {}, "union": {}, "shared": {}}
    for G in group_sizes:
        groups = _groups(sets, G)
        inter = [len(set.intersection(*g)) for g in groups]
        out["fixed"][G] = sum(sum(map(len, g)) - (len(g) - 1) * n for g, n in zip(groups, inter)) / total
        out["union"][G] = sum(len(set.union(*g)) for g in groups) / total
        ratios = [n / (sum(map(len, g)) / len(g)) for g, n in zip(groups, inter) if sum(map(len, g))]
        out["shared"][G] = sum(ratios) / len(ratios)
    out["cascaded"] = sum(_cascade_count(g, cascade_group) for g in _groups(sets, cascade_group)) / total
    pairs = _groups(sets, 2)
    topk = indices.shape[1]
    out["pairwise"] = sum(len(p[0] & p[1]) for p in pairs if len(p) == 2) / (len(sets) // 2) / topk
    return out


@settings(max_examples=40, deadline=None)
@given(
    s_q=st.integers(2, 21),
    topk=st.integers(1, 12),
    s_kv=st.integers(4, 24),
    cascade_group=st.sampled_from([1, 2, 4, 8, 16]),
    use_lengths=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_matches_brute_force(s_q, topk, s_kv, cascade_group, use_lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    # Small key range -> heavy overlap; values in [-1, s_kv + 2) exercise both kinds of invalid entry;
    # rows are made duplicate-free by a per-row permutation.
    rows = [torch.randperm(s_kv + 3, generator=gen)[:topk] - 1 for _ in range(s_q)]
    idx = torch.stack(rows).to(torch.int32)
    lengths = torch.randint(0, topk + 1, (s_q,), generator=gen, dtype=torch.int32) if use_lengths else None
    groups = (1, 2, 4, 8, 16)
    prof = overlap_profile(idx, s_kv=s_kv, topk_length=lengths, group_sizes=groups, cascade_group=cascade_group)
    if prof.total_entries == 0:  # nothing selected: every ratio is undefined
        assert math.isnan(prof.cascaded) and all(math.isnan(prof.fixed_group[G]) for G in groups)
        return
    want = brute_profile(idx, s_kv, lengths, groups, cascade_group)
    for G in groups:
        assert math.isclose(prof.fixed_group[G], want["fixed"][G], abs_tol=1e-12)
        assert math.isclose(prof.union[G], want["union"][G], abs_tol=1e-12)
        assert math.isclose(prof.shared_fraction[G], want["shared"][G], abs_tol=1e-12)
    assert math.isclose(prof.cascaded, want["cascaded"], abs_tol=1e-12)
    assert math.isclose(prof.pairwise_overlap, want["pairwise"], abs_tol=1e-12)


# ----------------------------------------------------------------------------------------------
# Output: table, JSON, plot; errors
# ----------------------------------------------------------------------------------------------
def test_table_dict_and_plot(tmp_path):
    prof = overlap_profile(generate("glm53-like", 64, 4096, 64), s_kv=4096)
    assert isinstance(prof, OverlapProfile)
    text = prof.table()
    assert "cascaded 8->1" in text and "pairwise overlap" in text and len(text.splitlines()) == 2 + 4 + 2
    data = json.loads(json.dumps(prof.to_dict()))
    assert data["fixed_group"]["2"] == prof.fixed_group[2] and data["cascaded"] == prof.cascaded
    path = tmp_path / "profile.png"
    prof.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_single_query_has_nan_pairwise():
    prof = overlap_profile(torch.tensor([[0, 1]], dtype=torch.int32), group_sizes=(2,))
    assert math.isnan(prof.pairwise_overlap) and prof.to_dict()["pairwise_overlap"] is None
    assert prof.fixed_group[2] == 1.0 and prof.cascaded == 1.0


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        ({"group_sizes": (3,)}, ValueError, "group_size"),
        ({"group_sizes": (32,)}, ValueError, "group_size"),
        ({"group_sizes": 4}, TypeError, "group_sizes"),
        ({"group_sizes": ()}, ValueError, "group_sizes"),
        ({"cascade_group": 6}, ValueError, "cascade_group must be a power of two"),
        ({"s_kv": 0}, ValueError, "s_kv"),
        ({"s_kv": 2.5}, ValueError, "s_kv"),
    ],
)
def test_bad_arguments(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        overlap_profile(TABLE1, **kwargs)


def test_bad_indices():
    with pytest.raises(TypeError, match="indices"):
        overlap_profile(TABLE1.float())
    with pytest.raises(TypeError, match="indices"):
        overlap_profile(TABLE1.tolist())
    with pytest.raises(ValueError, match="indices"):
        overlap_profile(TABLE1[0])
