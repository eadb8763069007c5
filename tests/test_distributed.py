"""Scale-out (quilt_attn/distributed.py): query / kv / head shards, the fetch rule, and ``sparse_prefill_cp``
on real process groups.

Shards and the fetch rule are plain functions (no processes). The CP runs start 2 and 4 worker processes
(this file run as a script, a ``FileStore`` in the test's tmp dir for the rendezvous): gloo on the CPU with
the Triton interpreter (``TRITON_INTERPRET=1`` inherited; tiny fp16 shapes, d_qk 48 = 32 + 16, d_v 32, tile
16) and, marked ``gpu`` (skipped below 2 GPUs), NCCL at the production width in bf16. Every rank's result
is compared with the one-process ``sparse_prefill``: bit for bit where the arithmetic is the same (zigzag
shards in both fetch modes; a round-robin rank against the one-process call on the same queries), within
float32 roundings for head shards whose plan equals the unsharded one (their products have other shapes:
``tolerances.SHAPE_ROUNDING``), and every element against the float64 reference within
``conftest.TOLERANCES``. Worker outputs are allocated NaN-poisoned.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import HAS_CUDA, SHAPE_ROUNDING, TOLERANCES, assert_matches_reference, prefill_kw, randn
from quilt_attn.distributed import (
    FETCH_FACTOR,
    choose_fetch,
    kv_shard,
    query_shards,
    round_robin_shards,
    shard_positions,
    sparse_prefill_cp,
    tp_head_shard,
)

HYP = settings(max_examples=60, deadline=None)


# ----------------------------------------------------------------------------- shards (no processes)
def _check_zigzag(s_q, W, G):
    shards = query_shards(s_q, W, group_size=G)
    assert len(shards) == W
    seen = torch.zeros(s_q, dtype=torch.int64)
    for runs in shards:
        assert len(runs) <= 2
        for (a, b), nxt in zip(runs, runs[1:] + [None]):
            assert 0 <= a < b <= s_q
            assert a % G == 0, f"run {(a, b)} starts inside a group"
            assert b % G == 0 or b == s_q, f"run {(a, b)} ends inside a group"
            if nxt is not None:
                assert b < nxt[0], "runs ascending, separate (touching chunks are merged)"
        pos = shard_positions(runs)
        seen[pos] += 1
        assert torch.equal(pos, torch.sort(pos).values)
    assert torch.equal(seen, torch.ones(s_q, dtype=torch.int64)), "every query on exactly one rank"
    return shards


@HYP
@given(st.integers(0, 700), st.integers(1, 9), st.sampled_from([1, 2, 4, 8, 16]))
def test_query_shards_cover_once_contiguous_aligned(s_q, W, G):
    _check_zigzag(s_q, W, G)


@pytest.mark.parametrize("W", [2, 4, 8])
def test_query_shards_zigzag_pairs_chunks(W):
    s_q = 2 * W * 8 * 5  # equal chunks of 40
    shards = query_shards(s_q, W, group_size=8)
    for r, runs in enumerate(shards):
        c = s_q // (2 * W)
        want = [(r * c, (r + 1) * c), ((2 * W - 1 - r) * c, (2 * W - r) * c)]
        if r == W - 1:
            want = [(r * c, (r + 2) * c)]  # chunks W - 1 and W touch
        assert runs == want
    # equal chunks: every rank the same causal work (keys seen, sum of p + 1), where contiguous blocks differ
    work = [sum(b * (b + 1) // 2 - a * (a + 1) // 2 for a, b in runs) for runs in shards]
    assert len(set(work)) == 1
    block = [(s_q * (r + 1) // W) * (s_q * (r + 1) // W + 1) // 2 - (s_q * r // W) * (s_q * r // W + 1) // 2
             for r in range(W)]
    assert max(block) > 2 * min(block)


@HYP
@given(st.integers(1, 8), st.integers(4, 40), st.sampled_from([1, 4, 8]), st.integers(0, 3000), st.booleans())
def test_query_shards_balance_causal_work(W, m, G, offset, capped):
    """Query p's causal work: the keys it sees (offset + p + 1, dense causal attention), or with top-K past
    the first topk positions a constant (``capped``). Each rank's total is the mean within the boundary
    rounding (4 boundaries a rank, each moved <= G / 2 queries). (Queries whose causal range is still
    shorter than topk ramp up: the two chunks of a rank balance a linear ramp, not its bend.)"""
    s_q = 2 * W * G * m + G // 2
    work = torch.arange(offset + 1, offset + s_q + 1, dtype=torch.float64)
    if capped:
        work = torch.full_like(work, 2048.0)
    totals = torch.stack([work[shard_positions(r)].sum() for r in query_shards(s_q, W, group_size=G)])
    slack = (2 * G + 2) * float(work.max())
    assert float((totals - totals.mean()).abs().max()) <= slack


def test_query_shards_small_and_errors():
    assert query_shards(0, 3) == [[], [], []]
    assert query_shards(5, 1) == [[(0, 5)]]
    assert sum(len(r) for r in query_shards(8, 4, group_size=8)) == 1  # one group: one rank holds it
    for bad, exc in (((-1, 2), ValueError), ((4, 0), ValueError), ((4.0, 2), TypeError), ((4, True), TypeError)):
        with pytest.raises(exc, match="s_q|world_size"):
            query_shards(*bad)
    with pytest.raises(ValueError, match="group_size"):
        query_shards(8, 2, group_size=0)


def test_zigzag_plans_are_the_one_process_plan_groups():
    """The claim ``sparse_prefill_cp`` rests on: a zigzag rank's plan is the one-process plan's groups."""
    from quilt_attn import plan as make_plan
    from quilt_attn.workloads import generate

    s_q, s_kv, topk, W, G = 200, 512, 32, 4, 4  # s_q not a multiple of 2 W G: a partial last group
    idx = generate("glm53-like", s_q, s_kv, topk, seed=3)
    kw = dict(s_kv=s_kv, group_size=G, merge_level=G, tile=16, backend="torch")
    full = make_plan(idx, **kw)
    tiles = 0
    for runs in query_shards(s_q, W, group_size=G):
        part = make_plan(idx[shard_positions(runs)], **kw)
        groups = torch.cat([torch.arange(a // G, -(-b // G)) for a, b in runs])
        assert torch.equal(part.group_tiles, full.group_tiles[groups])
        assert torch.equal(part.tile_kv[:, :full.capacity], full.tile_kv[groups][:, :part.capacity])
        tiles += part.stats["tiles"]
    assert tiles == full.stats["tiles"]
    rr = sum(make_plan(idx[p], **kw).stats["tiles"] for p in round_robin_shards(s_q, W))
    assert rr > tiles, "round-robin groups hold queries W apart: they share less"


def test_round_robin_and_kv_shards():
    shards = round_robin_shards(10, 3)
    assert [s.tolist() for s in shards] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert shard_positions(shards[1]) is not None and shard_positions(shards[1]).dtype == torch.int64
    assert [kv_shard(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [kv_shard(12, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    assert [kv_shard(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]  # an empty last shard
    with pytest.raises(ValueError, match="rank"):
        kv_shard(10, 4, 4)
    with pytest.raises(ValueError, match="s_kv"):
        kv_shard(0, 4, 0)


def test_tp_head_shard():
    for h, W in ((16, 2), (16, 4), (10, 4), (128, 8), (3, 3)):
        sl = [tp_head_shard(h, W, r) for r in range(W)]
        assert sl[0].start == 0 and sl[-1].stop == h
        assert all(a.stop == b.start for a, b in zip(sl, sl[1:]))
        sizes = [s.stop - s.start for s in sl]
        assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="world_size"):
        tp_head_shard(2, 4, 0)
    with pytest.raises(ValueError, match="rank"):
        tp_head_shard(8, 2, 2)


def test_choose_fetch():
    s_kv, W = 1000, 4  # S = 250: the all-gather brings each rank 750 rows
    lim = int(FETCH_FACTOR * 750)
    m = [[100, 0, 0, 0], [0, 100, 0, 0], [0, 0, 100, 0], [0, 0, 0, 100]]
    assert choose_fetch(m, s_kv, W) == "needed"  # every rank needs only its own rows
    m[2] = [lim // 3, lim // 3, 250, lim - 2 * (lim // 3)]
    assert choose_fetch(torch.tensor(m), s_kv, W) == "needed"  # the remote rows at the limit
    m[2][0] += 1
    assert choose_fetch(m, s_kv, W) == "all_gather"  # one rank over it decides for all
    assert choose_fetch([[5]], 5, 1) == "all_gather"
    with pytest.raises(ValueError, match="need_counts"):
        choose_fetch([[1, 2]], s_kv, W)


def test_sparse_prefill_cp_argument_errors():
    q = randn(8, 2, 48, seed=0)
    kv = randn(16, 48, seed=1)
    idx = torch.zeros(8, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="group"):  # this process has no process group
        sparse_prefill_cp(q, kv, idx, d_v=32)
    with pytest.raises(ValueError, match="fetch"):
        sparse_prefill_cp(q, kv, idx, d_v=32, fetch="rows")
    with pytest.raises(TypeError, match="indices"):
        sparse_prefill_cp(q, kv, idx.long(), d_v=32)
    with pytest.raises(ValueError, match="indices"):
        sparse_prefill_cp(q, kv, idx[:4], d_v=32)
    with pytest.raises(ValueError, match="q"):
        sparse_prefill_cp(q[0], kv, idx, d_v=32)
    with pytest.raises(TypeError, match="plan"):
        sparse_prefill_cp(q, kv, idx, d_v=32, plan=None)
    with pytest.raises(ValueError, match="s_kv"):
        sparse_prefill_cp(q, kv, idx, d_v=32, s_kv=0)


# ----------------------------------------------------------------------------- process-group runs
# (name, split, fetch, extra): every case runs on every rank; "tp" runs the rank's head shard of all queries
CASES = [
    ("zz/all_gather", "zigzag", "all_gather", {}),
    ("zz/needed", "zigzag", "needed", {}),
    ("zz/auto+len+sink", "zigzag", "auto", {"lengths": True, "exchange_s_kv": True}),
    ("rr/all_gather", "round_robin", "all_gather", {}),
    ("rr/needed", "round_robin", "needed", {}),
    ("zz/defaults", "zigzag", "auto", {"defaults": True}),
    ("tp", None, None, {}),
    ("zz/needed/fp8", "zigzag", "needed", {"fp8": True}),  # NCCL only: the FP8 cache needs d_qk 576
]


def _shape(device_kind: str, W: int) -> dict:
    if device_kind == "cpu":
        # a shorter last kv shard: s_kv = 255 (W 2: 128 + 127), 250 (W 4: 3 x 63 + 61); at W 4, 40 queries are
        # five groups of 8 over 8 zigzag chunks: uneven shards, rank 1 without any query
        return dict(s_q=32 if W == 2 else 40, s_kv=255 if W == 2 else 250, topk=32, h=4, d_qk=48, d_v=32,
                    dtype=torch.float16, kw=dict(tile=16, fallback=False))
    return dict(s_q=1024, s_kv=8191, topk=512, h=16, d_qk=576, d_v=512, dtype=torch.bfloat16,
                kw=dict(fallback=False))


def _make_inputs(shape: dict) -> dict:
    """glm53-like indices (shared rows) with invalid entries (-1, >= s_kv) and one query without any."""
    from quilt_attn.workloads import generate

    s_q, s_kv, topk, h = shape["s_q"], shape["s_kv"], shape["topk"], shape["h"]
    idx = generate("glm53-like", s_q, s_kv, topk, seed=5)
    g = torch.Generator().manual_seed(6)
    hole = torch.rand(s_q, topk, generator=g)
    idx = torch.where(hole < 0.05, -1, idx)
    idx = torch.where(hole > 0.97, s_kv + 3, idx).to(torch.int32)
    idx[s_q // 3] = -1
    return dict(q=randn(s_q, h, shape["d_qk"], seed=7, dtype=shape["dtype"]),
                kv=randn(s_kv, shape["d_qk"], seed=8, dtype=shape["dtype"]), indices=idx,
                topk_length=torch.randint(0, topk + 1, (s_q,), generator=g, dtype=torch.int32),
                attn_sink=torch.randn(h, generator=g, dtype=torch.float32))


def _positions(split: str, s_q: int, W: int, rank: int) -> torch.Tensor:
    if split == "zigzag":
        return shard_positions(query_shards(s_q, W)[rank])
    return round_robin_shards(s_q, W)[rank]


def _case_kwargs(extra: dict, shape: dict, inp: dict, pos, device) -> dict:
    kw = {} if extra.get("defaults") else prefill_kw(**shape["kw"])  # (settings=PlanSettings(...))
    kw["d_v"] = shape["d_v"]
    if extra.get("lengths"):
        kw.update(topk_length=inp["topk_length"][pos.cpu()].to(device), attn_sink=inp["attn_sink"].to(device))
    return kw


def _worker(rank: int, W: int, backend: str, store: str, in_path: str, out_path: str) -> None:
    """One rank: every case of CASES, its outputs (and stats) saved to ``out_path``."""
    import torch.distributed as dist

    from quilt_attn import quantize_fp8, sparse_prefill

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    real_empty = torch.empty

    def poisoned_empty(*args, **kwargs):  # every kernel output starts NaN
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    torch.empty = poisoned_empty
    dist.init_process_group(backend, store=dist.FileStore(store, W), rank=rank, world_size=W)
    data = torch.load(in_path)
    shape, inp = data["shape"], data["inputs"]
    q, kv, idx = (inp[k].to(device) for k in ("q", "kv", "indices"))
    s_q, s_kv = shape["s_q"], shape["s_kv"]
    a, b = kv_shard(s_kv, W, rank)
    res = {}
    for name, split, fetch, extra in CASES:
        if extra.get("fp8") and backend != "nccl":
            continue
        t0 = time.perf_counter()
        if name == "tp":
            sl, n = tp_head_shard(shape["h"], W, rank), s_q // 16 * 8  # about half the queries: whole groups
            got = sparse_prefill(q[:n, sl].contiguous(), kv, idx[:n], d_v=shape["d_v"], **prefill_kw(**shape["kw"]))
            st = {}
        else:
            pos = _positions(split, s_q, W, rank).to(device)
            st = {}
            cache = quantize_fp8(kv) if extra.get("fp8") else kv  # row by row: shards are rows of the cache
            got = sparse_prefill_cp(q[pos], cache[a:b], idx[pos], fetch=fetch, stats=st,
                                    s_kv=None if extra.get("exchange_s_kv") else s_kv,
                                    **_case_kwargs(extra, shape, inp, pos, device))
        res[name] = dict(out=tuple(t.cpu() for t in got), stats=st, seconds=time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    torch.save(res, out_path)


def _run_ranks(W: int, backend: str, shape: dict, inp: dict, tmp: Path, timeout: float) -> list[dict]:
    in_path = tmp / "inputs.pt"
    torch.save(dict(shape=shape, inputs=inp), in_path)
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"  # the loopback device: no hostname lookup
    if backend == "nccl":
        env.pop("TRITON_INTERPRET", None)
    procs, logs = [], []
    for r in range(W):
        log = open(tmp / f"rank{r}.log", "w+")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(r), str(W), backend,
               str(tmp / "store"), str(in_path), str(tmp / f"rank{r}.pt")]
        procs.append(subprocess.Popen(cmd, env=env, cwd=root, stdout=log, stderr=subprocess.STDOUT))
        logs.append(log)
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:  # only the processes started here
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = []
        for r, rc in failed:
            logs[r].seek(0)
            tails.append(f"--- rank {r} (rc {rc}):\n" + logs[r].read()[-3000:])
        pytest.fail("worker(s) failed:\n" + "\n".join(tails))
    for log in logs:
        log.close()
    return [torch.load(tmp / f"rank{r}.pt") for r in range(W)]


def _needed_counts(idx: torch.Tensor, s_kv: int, W: int, lengths=None) -> list[list[int]]:
    """The [W, W] matrix of distinct valid rows each zigzag rank references in each kv shard."""
    m = []
    for r in range(W):
        rows = idx[_positions("zigzag", idx.shape[0], W, r)]
        keep = (rows >= 0) & (rows < s_kv)
        if lengths is not None:
            keep &= torch.arange(rows.shape[1])[None, :] < lengths[_positions("zigzag", idx.shape[0], W, r)][:, None]
        u = torch.unique(rows[keep].long())
        m.append([int(((u >= a) & (u < b)).sum()) for a, b in (kv_shard(s_kv, W, o) for o in range(W))])
    return m


def _check_cp(W: int, backend: str, tmp: Path, timeout: float) -> None:
    from quilt_attn import plan_ahead, sparse_prefill, sparse_prefill_reference
    from quilt_bench.bench import plans_equal

    dev = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
    shape = _shape("cpu" if backend == "gloo" else "cuda", W)
    inp = _make_inputs(shape)
    results = _run_ranks(W, backend, shape, inp, tmp, timeout)

    q, kv, idx = (inp[k].to(dev) for k in ("q", "kv", "indices"))
    s_q, s_kv, h, dtype = shape["s_q"], shape["s_kv"], shape["h"], shape["dtype"]
    S = -(-s_kv // W)
    row_bytes = shape["d_qk"] * kv.element_size()
    whole = ("zz/all_gather", "zz/needed", "zz/auto+len+sink", "zz/defaults")
    one, calls, refs = {}, {}, {}  # the one-process calls the zigzag cases must equal (one a distinct setting)
    for name in whole:
        extra = next(c[3] for c in CASES if c[0] == name)
        kw = _case_kwargs(extra, shape, inp, torch.arange(s_q), dev)
        key = tuple(sorted(extra.items()))
        if key not in calls:
            calls[key] = sparse_prefill(q, kv, idx, **kw)
        one[name] = calls[key]
        ref_kw = {k: kw[k] for k in ("d_v", "topk_length", "attn_sink") if k in kw}
        key = "len" if "topk_length" in kw else "plain"
        if key not in refs:
            refs[key] = sparse_prefill_reference(q, kv, idx, **ref_kw)
    if backend == "nccl":
        from quilt_attn import quantize_fp8

        cache = quantize_fp8(kv)
        one_fp8 = sparse_prefill(q, cache, idx, **_case_kwargs({}, shape, inp, None, dev))
        ref_fp8 = sparse_prefill_reference(q, cache, idx, d_v=shape["d_v"])
    matrix = _needed_counts(inp["indices"], s_kv, W)
    matrix_len = _needed_counts(inp["indices"], s_kv, W, inp["topk_length"])
    for r, res in enumerate(results):
        for name in whole:
            got = res[name]["out"]
            pos = _positions("zigzag", s_q, W, r)
            key = "len" if name == "zz/auto+len+sink" else "plain"
            want = tuple(t[pos.to(dev)].cpu() for t in one[name])
            ref = tuple(t[pos.to(dev)].cpu() for t in refs[key])
            assert_matches_reference(got, ref, dtype, what=f"{name} rank {r}/{W}")
            if name != "zz/defaults":  # defaults: fallback decides per rank, the path may differ
                for w, g, what in zip(want, got, ("out", "max_logits", "lse")):
                    assert torch.equal(g, w), f"{name} rank {r}/{W}: {what} differs from the one-process call"
        st = res["zz/all_gather"]["stats"]
        assert st["fetch"] == "all_gather" and st["rows_received"] == (W - 1) * S
        assert st["bytes_received"] == (W - 1) * S * row_bytes
        st = res["zz/needed"]["stats"]
        remote = sum(matrix[r]) - matrix[r][r]
        assert st["fetch"] == "needed" and st["rows_needed"] == sum(matrix[r]) and st["rows_received"] == remote
        assert st["bytes_received"] >= remote * row_bytes
        st = res["zz/auto+len+sink"]["stats"]
        assert st["fetch"] == choose_fetch(matrix_len, s_kv, W) and st["rows_needed"] == sum(matrix_len[r])
        # round robin: bit for bit the one-process call on the same queries, and the reference
        pos = _positions("round_robin", s_q, W, r)
        kw = _case_kwargs({}, shape, inp, pos, dev)
        want = sparse_prefill(q[pos.to(dev)], kv, idx[pos.to(dev)], **kw)
        ref = tuple(t[pos.to(dev)].cpu() for t in refs["plain"])
        for name in ("rr/all_gather", "rr/needed"):
            got = res[name]["out"]
            assert_matches_reference(got, ref, dtype, what=f"{name} rank {r}/{W}")
            for w, g, what in zip(want, got, ("out", "max_logits", "lse")):
                assert torch.equal(g, w.cpu()), f"{name} rank {r}/{W}: {what} differs from the same-queries call"
        if backend == "nccl":  # the FP8 cache moved as bytes: the one-process call on the whole cache
            pos = _positions("zigzag", s_q, W, r)
            got, st = res["zz/needed/fp8"]["out"], res["zz/needed/fp8"]["stats"]
            assert st["fetch"] == "needed" and st["rows_received"] == sum(matrix[r]) - matrix[r][r]
            assert_matches_reference(got, tuple(t[pos.to(dev)].cpu() for t in ref_fp8), dtype, what=f"fp8 rank {r}/{W}")
            want = tuple(t[pos.to(dev)].cpu() for t in one_fp8)
            assert all(torch.equal(g, w) for g, w in zip(got, want)), f"fp8 rank {r}/{W}: differs from one process"
        # head shards: each rank planned alone; equal to the unsharded call's heads
        sl = tp_head_shard(h, W, r)
        got = res["tp"]["out"]
        n = s_q // 16 * 8
        want = tuple(t[:n, sl].cpu() for t in one["zz/all_gather"])
        assert_matches_reference(got, tuple(t[:n, sl].cpu() for t in refs["plain"]), dtype, what=f"tp rank {r}/{W}")
        pkw = prefill_kw(**shape["kw"])  # (settings=PlanSettings(...): plan_ahead plans with them)
        same_plan = plans_equal(plan_ahead(idx[:n], h, s_kv=s_kv, **pkw).wait(),
                                plan_ahead(idx[:n], sl.stop - sl.start, s_kv=s_kv, **pkw).wait())
        if dev.type == "cpu":  # 4 heads over 2 or 4 ranks: the same default plan (group 8, merge level 8)
            assert same_plan, f"tp rank {r}/{W}: its default plan differs from the unsharded call's"
            # (the shard's programs are narrower: its products' float32 roundings may differ, SHAPE_ROUNDING;
            # out, rounded to its dtype, by at most one unit in its last place: 2u relative (TOLERANCES' rtol),
            # the subnormal spacing below the smallest normal)
            for w, g, what in zip(want, got, ("out", "max_logits", "lse")):
                fi = torch.finfo(g.dtype)
                rtol, atol = ((TOLERANCES[g.dtype].rtol, fi.smallest_normal * fi.eps) if what == "out"
                              else (SHAPE_ROUNDING.rtol, SHAPE_ROUNDING.atol))
                torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m, what=what, r=r, W=W:
                                           f"tp rank {r}/{W}: {what} differs from the unsharded call (same plan): {m}")


@pytest.mark.interpret
@pytest.mark.parametrize("W", [2, 4])
def test_sparse_prefill_cp_gloo(W, tmp_path):
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the gloo runs use Triton's interpreter on the CPU (TRITON_INTERPRET=1)")
    _check_cp(W, "gloo", tmp_path, timeout=300)


@pytest.mark.gpu
@pytest.mark.parametrize("W", [2, 4])
def test_sparse_prefill_cp_nccl(W, tmp_path):
    if not HAS_CUDA or torch.cuda.device_count() < W:
        pytest.skip(f"needs {W} GPUs")
    import torch.distributed as dist

    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    _check_cp(W, "nccl", tmp_path, timeout=600)


if __name__ == "__main__":  # a worker rank, started by _run_ranks
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=6, required=True, metavar=("RANK", "W", "BACKEND", "STORE", "IN", "OUT"))
    a = ap.parse_args().worker
    _worker(int(a[0]), int(a[1]), a[2], a[3], a[4], a[5])
