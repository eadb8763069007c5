"""CPU checks of benchmarks/owner_exact/predict.py: its share counting (against brute force) and tile model."""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "owner_exact"))
import predict  # noqa: E402

import quilt_attn  # noqa: E402
from quilt_attn.dispatch import plan_settings  # noqa: E402
from quilt_attn.workloads import generate  # noqa: E402


def test_tile_model_bytes():
    # today: Q + K (144 KB) + V (64 KB) + P read and written (16 KB) [+ the gather's 72 KB] at 128 B a clock
    assert predict.model_today(False) == {"mac_clk": 2176.0, "smem_clk": 1792.0, "clk": 2176.0}
    assert predict.model_today(True)["clk"] == 2368.0
    # swapped: 1088 + 18 N clocks of shared memory without the gather, 34 N of products
    for n in (8, 16, 32, 64):
        m = predict.model_swapped(n, False)
        assert m["smem_clk"] == 1088 + 18 * n and m["mac_clk"] == 34 * n
    # one wgmma an owner reads K and V^T once an owner
    assert predict.model_swapped(32, False, 4)["smem_clk"] == 4 * 1088 + 18 * 32


def test_bits():
    m = torch.tensor([0, 1, 0b1010, 0xFF, 0b0100])
    assert predict.popcount(m).tolist() == [0, 1, 2, 8, 1]
    lo, hi = predict.low_high(m)
    assert lo.tolist() == [0, 0, 1, 0, 2] and hi.tolist() == [0, 0, 3, 7, 2]


def brute_share(plan, qp):
    prog_tiles, ntiles = plan.work_list(qp)
    _, masks = plan.columns()
    flat = masks.reshape(-1, masks.shape[-1])
    n_sub = plan.group_size // qp
    useful = tiles = 0
    for p in range(prog_tiles.shape[0]):
        sub = p % n_sub
        for t in prog_tiles[p, : int(ntiles[p])].tolist():
            tiles += 1
            for w in flat[t].tolist():
                useful += bin((w >> (sub * qp)) & ((1 << qp) - 1)).count("1")
    return useful / (tiles * 64 * qp), tiles


@pytest.mark.parametrize("h,group", [(16, None), (32, None), (16, 8)])
def test_owner_stats_against_brute_force(h, group):
    idx = generate("glm53-like", 64, 2048, 256, seed=1)
    kw = plan_settings(h, "cuda")
    if group is not None:  # a group wider than a program: programs run sub-blocks of its tiles
        kw = dict(kw, group_size=group, merge_level=group)
    plan = quilt_attn.plan(idx, s_kv=2048, backend="torch", **kw)
    st = predict.owner_stats(plan, h)
    share, tiles = brute_share(plan, st["qp"])
    assert st["tiles"] == tiles
    assert st["share"] == pytest.approx(share, rel=1e-12)
    assert sum(st["col_hist"]) == tiles * 64


def test_regroup_cuts_by_program_and_span():
    # program 0: 70 columns owned by slot 0, 10 by slots 1-2; program 1: 5 columns owned by slots 0-3
    masks = torch.zeros(3, 64, dtype=torch.int64)
    prog = torch.tensor([0, 0, 1])
    masks[0, :64] = 1
    masks[1, :6] = 1
    masks[1, 6:16] = 0b110
    masks[2, :5] = 0b1111
    span, upc = predict.regroup(masks, prog)
    assert span.tolist() == [1, 3, 4]  # (64 of slot 0), (6 of slot 0 + 10 of slots 1-2), (5 of slots 0-3)
    assert upc.tolist() == [1, 3, 4]


def fake_measured(tmp_path):
    rows = [{"shape": "today", "n": 64, "h": 8, "issue": "one", "gather": 1, "ns_per_tile": 2000.0, "valid": True}]
    for n in (8, 16, 24, 32, 48, 64):
        rows.append({"shape": "swapped", "n": n, "h": 8, "issue": "one", "gather": 1,
                     "ns_per_tile": 1000.0 + 20.0 * n, "valid": True})
    for n in (16, 32, 64):
        rows.append({"shape": "swapped", "n": n, "h": 8, "issue": "owner", "gather": 1,
                     "ns_per_tile": 1000.0 * n / 8, "valid": True})
    path = tmp_path / "tile_rate.json"
    real = [{"h": 8, "gather": 1, "ms": 1.0, "ns_per_tile": 2500.0}]
    path.write_text("some table line\n" + json.dumps({"device": "fake", "rows": rows, "real": real}) + "\n")
    return path


def test_measured_interpolation(tmp_path):
    tt = predict.TileTimes(json.loads(fake_measured(tmp_path).read_text().splitlines()[-1]))
    assert tt.today() == 2000.0
    assert tt.swapped(40) == pytest.approx(1800.0)  # between 32 and 48
    assert tt.per_owner(8, 8) == tt.swapped(8)
    assert tt.per_owner(24, 8) == pytest.approx(3000.0)
    assert tt.per_owner(32, 16) > 0  # not measured at h=16: the model's ratio on the measured time


def test_main_smoke(tmp_path, capsys):
    out = tmp_path / "o.json"
    rc = predict.main(["--workloads", "glm53-like", "--heads", "16", "--s-q", "64", "--s-kv", "2048", "--topk", "256",
                       "--measured", str(fake_measured(tmp_path)), "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    forms = {r["form"] for r in res["results"][0]["forms"]}
    assert {"today", "regrouped", "cascade", "hybrid", "ideal"} <= forms
    assert "decision" in capsys.readouterr().out


def test_prototype_regroup_keeps_the_columns_and_sorts_them_by_span():
    """benchmarks/owner_exact/prototype.py's regrouped plan (CPU): every group's (row, member bits) columns are
    the plan's, as a multiset; tiles hold columns in (span length, first owner) order, padding only at a group's
    end; and the span statistics count what the swapped program computes."""
    import prototype

    for h, wl in ((16, "glm53-like"), (8, "random")):
        idx = generate(wl, 64, 4096, 256, seed=3)
        plan = quilt_attn.plan(idx, s_kv=4096, backend="torch", **plan_settings(h, "cuda"))
        new = prototype.regroup(plan, h)
        (r0, m0), (r1, m1) = plan.columns(), new.columns()
        for g in range(plan.n_groups):
            a = sorted(zip(r0[g][m0[g] != 0].tolist(), m0[g][m0[g] != 0].tolist()))
            b = sorted(zip(r1[g][m1[g] != 0].tolist(), m1[g][m1[g] != 0].tolist()))
            assert a == b
            n = len(b)
            flat_m = m1[g].reshape(-1)
            assert (flat_m[:n] != 0).all() and (flat_m[n:] == 0).all()  # padding only past the last column
            lo, ln = prototype.owner_span(flat_m[:n])
            key = (lo + ln if prototype.prefix(h) else ln * 64 + lo).tolist()
            assert key == sorted(key)
            assert int(new.group_tiles[g]) == -(-n // plan.tile)
        st, st0 = prototype.span_stats(new, h), prototype.span_stats(plan, h)
        assert st["tiles"] <= st0["tiles"] and sum(st["span_hist"]) == st["tiles"]
        assert 0 < st["swapped_work"] <= 1 and st["today_useful"] <= st["swapped_useful"] <= 1
