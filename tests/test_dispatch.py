"""``quilt_attn.dispatch``: what a call runs, decided from the settings (no host sync), and the call path
that this makes capturable.

CPU part: the decision table of both backends, the plan settings of a call, the opt-in tile-cost rule and
the plan cache it keeps, and the caller-owned ``workspace`` (Triton interpreter). GPU part (marker ``gpu``,
production shape, bf16): the default ``sparse_prefill(q, kv, indices)`` captured in a CUDA graph with the
plan built inside the captured call, replayed on new indices written into the captured buffer; and the
default call path of ``sparse_prefill`` and ``flash_mla_sparse_fwd`` run under
``torch.cuda.set_sync_debug_mode("error")``.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import assert_matches_reference, make_inputs, randn
from quilt_attn import PlanSettings, dispatch
from quilt_attn import plan as make_plan
from quilt_attn import quantize_fp8, sparse_prefill, sparse_prefill_reference
from quilt_attn.compat import flash_mla_sparse_fwd
from quilt_attn.dispatch import Decision, decide, plan_settings
from quilt_attn.ops import cuda_backend
from quilt_attn.planner import plan_workspace_bytes
from quilt_attn.workloads import generate

BF16 = torch.bfloat16
DV = 64  # CPU shapes: d_qk = 80 = 64 + 16


# ----------------------------------------------------------------------------- the decision
@pytest.mark.parametrize("h,quilt", [(1, True), (8, True), (16, True), (32, True), (40, False), (64, False),
                                     (128, False)])
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_quilt_runs_a_plan_below_64_heads_on_both_backends(backend, h, quilt):
    """The default rule: a plan's tiles wherever a program holds more than one query (h <= 32; on Triton at
    least four, h <= 16), query programs where one query fills a 64-row tile (its heads padded to a power of
    two: h > 32), on the backend that was chosen."""
    if backend == "triton" and h == 32:
        quilt = False  # two queries a 64-row Triton program: query programs measured faster
    for auto in (False, True):
        assert decide(backend, "quilt", h, auto=auto) == Decision(quilt, backend), (auto, h)
    # fallback=False or importance clipping always run the plan (its dropped pairs must stay dropped)
    assert decide(backend, "quilt", h, PlanSettings(fallback=False)) == Decision(True, backend)
    assert decide(backend, "quilt", h, PlanSettings(importance_clip=True)) == Decision(True, backend)
    # an explicit group of one query a program has nothing to share either
    assert decide(backend, "quilt", h, PlanSettings(group_size=1)).quilt is False


@pytest.mark.parametrize("h,kernel", [(4, "triton"), (16, "triton"), (32, "triton"), (40, "cuda"), (64, "cuda")])
def test_cuda_query_programs_run_on_triton_under_auto_only(h, kernel):
    """Query programs of the CUDA backend under "auto" run Triton's 16- / 32-row programs where a CUDA
    program would compute a whole 64-row tile for fewer rows; "cuda" itself always runs its own kernel."""
    assert decide("cuda", "query_parallel", h, auto=True) == Decision(False, kernel)
    assert decide("cuda", "query_parallel", h, auto=False) == Decision(False, "cuda")
    assert decide("triton", "query_parallel", h, auto=True) == Decision(False, "triton")
    assert decide("cuda", "quilt", max(h, 64), auto=True) == Decision(False, "cuda")  # h >= 64: CUDA programs


def test_the_default_rule_reads_no_plan_data():
    """A given plan's settings decide, never its tensors (so no host sync): a stand-in with only its settings
    is enough. The measured rule is an opt-in that needs a plan; bad values name the argument."""
    fake = SimpleNamespace(group_size=4, importance_clip=False)
    assert decide("triton", "quilt", 16, plan=fake) == Decision(True, "triton")
    assert decide("cuda", "quilt", 16, plan=fake, auto=True) == Decision(True, "cuda")
    assert decide("triton", "quilt", 16, plan=SimpleNamespace(group_size=8, importance_clip=False)).quilt
    assert decide("triton", "quilt", 64, plan=SimpleNamespace(group_size=8, importance_clip=True)).quilt
    with pytest.raises(ValueError, match="fallback='cost' reads the tile counts of a plan the caller passes"):
        decide("triton", "quilt", 16, PlanSettings(fallback="cost"))
    with pytest.raises(ValueError, match="fallback='cost' reads the tile counts"):
        decide("cuda", "quilt", 64, PlanSettings(fallback="cost"))
    with pytest.raises(TypeError, match="settings must be a quilt_attn.PlanSettings or None, got dict"):
        decide("triton", "quilt", 16, {"fallback": False})
    for bad in ("yes", None, 2, 0.5):
        with pytest.raises(ValueError, match=r"fallback must be True, False or 'cost', got"):
            dispatch.check_fallback(bad)
    assert dispatch.check_fallback(1) is True and dispatch.check_fallback(0) is False


def test_the_cost_rule_is_read_once_and_cached_in_the_plan(monkeypatch):
    """``fallback="cost"``: the measured rule on the plan's tile counts (one host read, then cached), on
    Triton (``quilt_pays_off``) and for the CUDA backend under "auto" (``cuda_pays_off``: its mostly masked
    tiles against Triton's query programs; "cuda" chosen explicitly never switches)."""
    s_q, s_kv, topk, h = 16, 4096, 40, 16
    shared = generate("identical", s_q, s_kv, topk, seed=1, group=16)
    lonely = generate("random", s_q, s_kv, topk, seed=1)
    pkw = dict(s_kv=s_kv, group_size=4, tile=64, merge_level=4, split_private=False)
    p_shared, p_lonely = make_plan(shared, **pkw), make_plan(lonely, **pkw)
    assert dispatch.cuda_pays_off(p_shared, h) and not dispatch.cuda_pays_off(p_lonely, h)
    cost = PlanSettings(fallback="cost")
    assert decide("cuda", "quilt", h, cost, plan=p_lonely, auto=True) == Decision(False, "triton")
    assert decide("cuda", "quilt", h, cost, plan=p_lonely, auto=False) == Decision(True, "cuda")
    assert decide("cuda", "quilt", h, cost, plan=p_shared, auto=True) == Decision(True, "cuda")
    assert decide("cuda", "quilt", h, plan=p_lonely, auto=True) == Decision(True, "cuda")  # the default
    reads = []
    real = dispatch._host_counts
    monkeypatch.setattr(dispatch, "_host_counts", lambda *a: reads.append(a) or real(*a))
    p = make_plan(lonely, **pkw)
    for _ in range(3):
        assert decide("triton", "quilt", h, cost, plan=p) == Decision(False, "triton")
    assert len(reads) == 1, "the cost rule reads a plan's counts once"


def test_plan_cache_api():
    p = make_plan(generate("random", 8, 256, 16, seed=2), s_kv=256, group_size=4, tile=16, merge_level=4)
    calls = []
    assert p.cached(("test.owner", 1), lambda: calls.append(1) or "v") == "v"
    assert p.cached(("test.owner", 1), lambda: calls.append(1) or "w") == "v" and calls == [1]
    for bad in ("owner", (), (1, 2)):
        with pytest.raises(TypeError, match="key must be a tuple starting with its owner's name"):
            p.cached(bad, lambda: None)


def test_fp8_cache_reaches_the_cuda_kernel_compacted_with_a_callers_plan(monkeypatch):
    """``kernel_kv``: the CUDA kernel takes an FP8 cache as it is (its referenced rows compacted, the numbering
    kept with the plan) wherever the call runs the caller's plan, but for a split-private plan, whose Triton pass
    reads the cache's own rows; without one, only in pools above ``FP8_COMPACT_POOL`` rows (else expanded)."""
    expanded = []
    from quilt_attn.ops import fp8_expand

    monkeypatch.setattr(fp8_expand, "expand_fp8", lambda kv, dtype: expanded.append(1) or "expanded")
    q = torch.zeros(8, 16, 576, dtype=BF16)
    cache = torch.zeros(64, 656, dtype=torch.uint8)
    idx = generate("random", 8, 64, 16, seed=1)
    kept = make_plan(idx, s_kv=64, group_size=4, merge_level=4, split_private=False)
    split = make_plan(idx, s_kv=64, group_size=4, merge_level=4, split_private=True)
    assert dispatch.kernel_kv(q, cache, "cuda", 16, None, plan=kept) is cache
    assert dispatch.kernel_kv(q, cache, "cuda", 16, None, plan=split) == "expanded"
    assert dispatch.kernel_kv(q, cache, "cuda", 16, None) == "expanded"
    assert dispatch.kernel_kv(q, cache, "cuda", 16, True, plan=kept) == "expanded"  # (fp8_expand=True: expanded)
    monkeypatch.setattr(cuda_backend, "FP8_COMPACT_POOL", 32)
    assert dispatch.kernel_kv(q, cache, "cuda", 16, None) is cache
    assert len(expanded) == 3


# ----------------------------------------------------------------------------- plan settings
def test_plan_settings_are_the_calls():
    """One function gives the plan a call builds: group and merge level the queries a program holds
    (64 // h, at most 8), private rows split off for Triton's query pass, kept in the CUDA tiles."""
    assert plan_settings(16) == dict(group_size=4, tile=64, clip_threshold=0.5, importance_clip=False,
                                     merge_level=4, split_private=True)
    assert plan_settings(16, "triton")["split_private"] is True
    assert plan_settings(16, "triton", PlanSettings(split_private=False))["split_private"] is False
    assert plan_settings(16, "cuda")["split_private"] is False
    assert plan_settings(16, "cuda", PlanSettings(importance_clip=True))["split_private"] is True  # clipped lists
    assert (plan_settings(8)["group_size"], plan_settings(8)["merge_level"]) == (8, 8)
    assert (plan_settings(128)["group_size"], plan_settings(128)["merge_level"]) == (8, 1)
    assert plan_settings(16, None, PlanSettings(group_size=8))["merge_level"] == 4
    assert plan_settings(16, None, PlanSettings(merge_level=2))["merge_level"] == 2
    for bad in (8, 48, 64.0, True):
        with pytest.raises(ValueError, match="the kernel needs a plan tile that is a power of two >= 16, got"):
            plan_settings(16, None, PlanSettings(tile=bad))


def test_workspace_bytes_follow_the_settings():
    s_q, topk, s_kv = 64, 128, 4096
    for backend, split in (("triton", True), ("cuda", False)):
        want = plan_workspace_bytes(s_q, topk, group_size=4, merge_level=4, tile=64, split_private=split, s_kv=s_kv)
        assert dispatch.workspace_bytes(s_q, topk, 16, s_kv=s_kv, backend=backend) == want > 0
        assert dispatch.workspace_bytes(s_q, topk, 64, s_kv=s_kv, backend=backend) == 0  # nothing planned


@pytest.mark.interpret
def test_workspace_holds_the_plan_the_call_builds(monkeypatch):
    """``workspace=``: the plan built in the call is carved from it (its tensors lie inside), the results are
    those of a call without one, bit for bit; compat passes it on; too small, or beside a given plan, it is
    refused naming ``workspace``."""
    from quilt_attn import api

    s_q, s_kv, topk, h = 16, 96, 40, 4
    q, kv, idx = make_inputs(s_q, h, s_kv=s_kv, topk=topk, seed=9)
    backend = dispatch.choose_backend("auto", q, kv, DV, tile=16)
    need = max(dispatch.workspace_bytes(s_q, topk, h, s_kv=s_kv, backend=backend, settings=PlanSettings(tile=t))
               for t in (16, 64))
    tile16 = PlanSettings(tile=16)
    ws = torch.zeros(need, dtype=torch.uint8, device=q.device)
    plans, real = [], api.make_plan
    monkeypatch.setattr(api, "make_plan", lambda *a, **k: plans.append(real(*a, **k)) or plans[-1])
    got = sparse_prefill(q, kv, idx, d_v=DV, settings=tile16, workspace=ws)
    lo, hi = ws.data_ptr(), ws.data_ptr() + need

    def in_workspace(p):
        parts = [p.tile_kv, p.tile_mask, p.tile_level, p.tile_members, p.group_tiles, p.group_rows, p.dropped,
                 p.priv_idx, p.priv_n]
        return all(lo <= t.data_ptr() < hi for t in parts if t is not None)

    assert in_workspace(plans[-1]), "the plan's tensors are the workspace's"
    for a, b in zip(got, sparse_prefill(q, kv, idx, d_v=DV, settings=tile16)):
        assert torch.equal(a, b)
    got = flash_mla_sparse_fwd(q, kv[:, None], idx[:, None], 0.1, d_v=DV, workspace=ws)
    assert in_workspace(plans[-1])
    for a, b in zip(got, flash_mla_sparse_fwd(q, kv[:, None], idx[:, None], 0.1, d_v=DV)):
        assert torch.equal(a, b)
    small = dispatch.workspace_bytes(s_q, topk, h, s_kv=s_kv, backend=backend, settings=tile16)
    with pytest.raises(ValueError, match="workspace"):
        sparse_prefill(q, kv, idx, d_v=DV, settings=tile16, workspace=ws[: small - 16])
    p = make_plan(idx, s_kv=s_kv, **plan_settings(h, backend, tile16))
    with pytest.raises(ValueError, match="workspace is the memory of the plan a call builds"):
        sparse_prefill(q, kv, idx, d_v=DV, plan=p, workspace=ws)


# =============================================================================================
# GPU: the default call path, captured and watched for host syncs (production shape, bf16)
gpu = pytest.mark.gpu


def _gpu_inputs(h, s_q=1024, s_kv=8192, topk=2048, seed=70):
    q = randn(s_q, h, 576, seed=seed + h, dtype=BF16, device="cuda")
    kv = randn(s_kv, 576, seed=seed + 1, dtype=BF16, device="cuda")
    idx = generate("glm53-like", s_q, s_kv, topk, seed=seed + 2, device="cuda")
    return q, kv, idx


@gpu
@pytest.mark.parametrize("use_workspace", [False, True])
@pytest.mark.parametrize("h", [16, 8])
def test_gpu_default_call_captures_in_a_cuda_graph(h, use_workspace):
    """``sparse_prefill(q, kv, indices)`` with default arguments (backend "auto", a new plan built inside the
    captured call) is captured after a warm-up on a side stream; new indices written into the captured
    buffer (invalid entries, an empty row) and a replay give the eager call's results bit for bit, and the
    reference's. Outputs are NaN-poisoned before the replay."""
    q, kv, idx = _gpu_inputs(h)
    s_q, s_kv, topk = idx.shape[0], kv.shape[0], idx.shape[1]
    kw = {}
    if use_workspace:
        backend = dispatch.choose_backend("auto", q, kv, 512)
        n = dispatch.workspace_bytes(s_q, topk, h, s_kv=s_kv, backend=backend)
        kw["workspace"] = torch.empty(n, dtype=torch.uint8, device="cuda")
    static = idx.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compiles the kernels, builds the CUDA library, fills every cache
            sparse_prefill(q, kv, static, **kw)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, ml, lse = sparse_prefill(q, kv, static, **kw)
    new = generate("glm53-like", s_q, s_kv, topk, seed=99, device="cuda")
    new[5, :300] = -1
    new[9] = -1  # an empty row
    new[11, 7] = s_kv + 3
    static.copy_(new)
    for t in (out, ml, lse):
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = sparse_prefill(q, kv, new, **kw)
    for name, a, b in zip(("out", "max_logits", "lse"), (out, ml, lse), eager):
        assert torch.equal(a, b), f"replayed {name} differs from the eager call"
    rows = torch.cat([torch.arange(0, s_q, 8), torch.tensor([5, 9, 11])]).to("cuda")
    want = sparse_prefill_reference(q[rows], kv, new[rows])
    assert_matches_reference((out[rows], ml[rows], lse[rows]), want, BF16, what=f"graph replay h={h}")
    assert torch.isposinf(lse[9]).all() and torch.isneginf(ml[9]).all() and (out[9] == 0).all()


@gpu
@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("h,kind", [(8, "dense"), (16, "dense"), (16, "fp8"), (16, "fp8-pool"), (64, "fp8-pool"),
                                    (64, "dense"), (16, "fp8-plan")])
def test_gpu_default_call_path_makes_no_host_sync(backend, h, kind, monkeypatch):
    """After a warm-up, the default calls of ``sparse_prefill`` and ``flash_mla_sparse_fwd`` run with
    ``torch.cuda.set_sync_debug_mode("error")``: planning, the backend and kernel decision, the kernels and
    the natural-log conversion read nothing on the host. ``fp8-plan``: a caller's plan over an FP8 cache, whose
    first call (numbering the plan's rows, on the CUDA backend) runs under the check too."""
    q, kv, idx = _gpu_inputs(h, s_q=512)
    if kind.startswith("fp8"):
        kv = quantize_fp8(kv)
    if kind == "fp8-pool":  # a pool above FP8_COMPACT_POOL rows: referenced rows compacted, launch chosen on the device
        monkeypatch.setattr(cuda_backend, "FP8_COMPACT_POOL", 1024)
    calls = {
        "sparse_prefill": lambda: sparse_prefill(q, kv, idx, backend=backend),
        "flash_mla_sparse_fwd": lambda: flash_mla_sparse_fwd(q, kv[:, None], idx[:, None], 576**-0.5,
                                                             backend=backend),
    }
    if kind == "fp8-plan":
        pkw = plan_settings(h, "cuda" if backend == "auto" else backend)
        warm, fresh = (make_plan(idx, s_kv=kv.shape[0], **pkw) for _ in range(2))
        sparse_prefill(q, kv, idx, plan=warm, backend=backend)  # (compiles what the plan's calls run)
        torch.cuda.synchronize()
        calls = {"sparse_prefill with a plan": lambda: sparse_prefill(q, kv, idx, plan=fresh, backend=backend)}
    for call in calls.values():
        if kind != "fp8-plan":
            call()
    torch.cuda.synchronize()
    got = {}
    torch.cuda.set_sync_debug_mode("error")
    try:
        for name, call in calls.items():
            got[name] = call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    want = sparse_prefill_reference(q, kv, idx)
    for name, res in got.items():
        assert_matches_reference(res, want, BF16, what=f"{name} {backend} h={h} {kind}")


@gpu
def test_gpu_cost_rule_with_a_given_plan_reads_once():
    """The opt-in measured rule syncs once per plan (its tile counts), then the plan's calls run sync-free."""
    h = 16
    q, kv, idx = _gpu_inputs(h, s_q=512)
    p = make_plan(idx, s_kv=kv.shape[0], **plan_settings(h, "triton"))
    cost = PlanSettings(fallback="cost")
    sparse_prefill(q, kv, idx, plan=p, settings=cost)  # the one read
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = sparse_prefill(q, kv, idx, plan=p, settings=cost)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_matches_reference(got, sparse_prefill_reference(q, kv, idx), BF16)


@pytest.mark.parametrize("layout", ["halves", "separate", "reversed halves", "strided"])
def test_natural_log_stats_converts_both_whatever_their_buffer(layout):
    """``max_logits`` and ``lse`` times ln 2 in place, -inf / +inf kept: in one launch when they are the two halves
    of one buffer in that order (``alloc_outputs``), else each by itself; nothing else in their buffer changes."""
    import math

    from quilt_attn.ops.sparse_attention import alloc_outputs

    g = torch.Generator().manual_seed(5)
    want_m, want_l = torch.randn(7, 3, generator=g), torch.randn(7, 3, generator=g)
    want_m[2, 1], want_l[2, 1] = -math.inf, math.inf
    outer = torch.full((3, 7, 3), 9.0)  # the buffer around them in the last two layouts
    if layout == "halves":
        _, m, l = alloc_outputs(torch.empty(7, 3, 576), 512)
        assert l.data_ptr() == m.data_ptr() + m.numel() * 4
    elif layout == "separate":
        m, l = torch.empty(7, 3), torch.empty(7, 3)
    elif layout == "reversed halves":  # adjacent, but lse first: not the one-launch form
        l, m = outer[0], outer[1]
    else:  # every other element of a buffer: not contiguous
        m, l = outer.view(-1)[0:42:2].view(7, 3), outer.view(-1)[1:42:2].view(7, 3)
    m.copy_(want_m)
    l.copy_(want_l)
    rest = outer.clone()
    got = dispatch.natural_log_stats(m, l)
    assert got[0] is m and got[1] is l
    assert torch.equal(m, want_m * dispatch.LN2) and torch.equal(l, want_l * dispatch.LN2)
    if layout in ("reversed halves", "strided"):
        mine = torch.zeros(outer.numel(), dtype=torch.bool)
        for t in (m, l):
            mine[t.storage_offset() + t.stride(0) * torch.arange(7)[:, None] + t.stride(1) * torch.arange(3)] = True
        assert torch.equal(outer.view(-1)[~mine], rest.view(-1)[~mine])
