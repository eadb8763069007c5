"""The default CUDA call's short path (``ops/cuda_call.py``): the same outputs as the general path, bit for bit.

``sparse_prefill(q, kv, indices)`` with a plan made in the call and a dense kv runs the planner, the order
kernel, the attention and the repair pass from per-shape layouts (``cuda_call.run``); with
``cuda_call.ENABLED`` off the same call takes the general path (``planner.plan``, then
``cuda_backend.run_plan_passes_cuda``). Both must give identical bits, and the reference's values.
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_matches_reference, randn
from quilt_attn import dispatch, sparse_prefill, sparse_prefill_reference
from quilt_attn import plan as make_plan
from quilt_attn.ops import cuda_call
from quilt_attn.planner import PACK_ROW_MASK
from quilt_attn.workloads import generate

BF16, FP16 = torch.bfloat16, torch.float16


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _inputs(h, s_q, s_kv, dtype, seed, wide):
    ctx = 16384
    idx = generate("glm53-like", s_q, ctx, 2048, seed=seed, device="cuda")
    if s_kv != ctx:  # slot ids scattered over a pool of s_kv rows, as an engine's paged pool
        slots = torch.randperm(s_kv, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))[:ctx]
        idx = torch.where(idx >= 0, slots[idx.clamp(min=0).long()].int(), idx)
    idx[3, 6] = idx[3, 5]  # a repeated row
    idx[7, :100] = -1
    idx[9, 0] = s_kv + 7  # past the pool: invalid
    idx[11] = -1  # an empty row
    q = randn(s_q, h, 576, seed=seed + 1, dtype=dtype, device="cuda")
    if wide:  # a pool past the packed columns' row field: only the referenced rows are written
        kv = torch.empty(s_kv, 576, dtype=dtype, device="cuda")
        rows = idx[(idx >= 0) & (idx < s_kv)].unique().long()
        kv[rows] = randn(rows.numel(), 576, seed=seed + 2, dtype=dtype, device="cuda")
    else:
        kv = randn(s_kv, 576, seed=seed + 2, dtype=dtype, device="cuda")
    return q, kv, idx


@pytest.mark.gpu
@pytest.mark.parametrize("h,s_q,s_kv,dtype,extra", [
    (16, 1000, 16384, BF16, ""),           # a last group of fewer queries than the group
    (8, 777, 1 << 20, BF16, "topk_length"),  # slot ids in a pool
    (32, 512, 16384, BF16, "sink"),
    (16, 512, 16384, BF16, "sink_view"),   # the sink a strided view: one layer's column of a table
    (4, 300, 16384, BF16, "nan_row"),      # a NaN row one query selects: the repair pass recomputes its partners
    (3, 256, 16384, FP16, ""),
    (1, 129, 16384, BF16, "sink"),
    (16, 384, PACK_ROW_MASK + 5, BF16, ""),  # wide plan columns (rows beyond the packed row field)
    (16, 640, 16384, BF16, "workspace"),   # the plan written into the caller's workspace
    (8, 640, 1 << 20, BF16, "workspace"),
])
def test_gpu_default_call_equals_the_general_path_bit_for_bit(h, s_q, s_kv, dtype, extra, monkeypatch, nan_poison):
    q, kv, idx = _inputs(h, s_q, s_kv, dtype, seed=40 + h, wide=s_kv > PACK_ROW_MASK)
    kw = {}
    if extra == "topk_length":
        kw["topk_length"] = torch.randint(0, 2049, (s_q,), device="cuda", dtype=torch.int32)
    if extra == "sink":
        kw["attn_sink"] = torch.randn(h, device="cuda", dtype=torch.float32)
    if extra == "sink_view":
        kw["attn_sink"] = (3 * torch.randn(h, 3, device="cuda", dtype=torch.float32))[:, 1]
        assert not kw["attn_sink"].is_contiguous()
    if extra == "workspace":
        n = dispatch.workspace_bytes(s_q, 2048, h, s_kv=s_kv, backend="cuda")
        kw["workspace"] = torch.full((n,), 0xAB, dtype=torch.uint8, device="cuda")  # (garbage: the plan overwrites)
    if extra == "nan_row":  # the last kv row NaN, selected by query 20 alone
        idx[idx == s_kv - 1] = -1
        idx[20, 0] = s_kv - 1
        kv[s_kv - 1] = float("nan")
    taken = []
    real_run = cuda_call.run
    monkeypatch.setattr(cuda_call, "run", lambda *a, **k: taken.append(real_run(*a, **k)) or taken[-1])
    fast = sparse_prefill(q, kv, idx, **kw)
    assert taken and taken[-1] is not None, "the default call did not take the short path"
    monkeypatch.setattr(cuda_call, "ENABLED", False)
    general = sparse_prefill(q, kv, idx, **kw)
    assert taken[-1] is None
    for name, a, b in zip(("out", "max_logits", "lse"), fast, general):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.equal(_bits(a), _bits(b)), f"{name} differs from the general path's"
    rows = torch.tensor([0, 3, 7, 9, 11, 20, s_q // 2, s_q - 1], device="cuda")
    want = sparse_prefill_reference(q[rows], kv, idx[rows], **{k: v[rows] if k == "topk_length" else v.contiguous()
                                                              for k, v in kw.items() if k != "workspace"})
    got = tuple(t[rows] for t in fast)
    if extra == "nan_row":  # query 20 selected the NaN row itself: NaN there, as in the reference; its partners not
        assert torch.isnan(got[0][5]).all() and torch.isnan(want[0][5]).all()
        assert not torch.isnan(fast[0][[16, 17, 18, 19, 21, 22, 23]]).any()
        keep = torch.tensor([i for i in range(rows.numel()) if i != 5], device="cuda")
        got, want = tuple(t[keep] for t in got), tuple(t[keep.cpu()] for t in want)
    assert_matches_reference(got, want, dtype, what=f"h={h} {extra}")


@pytest.mark.gpu
def test_gpu_calls_outside_the_short_path_decline_it(monkeypatch):
    """A caller's plan, split-private settings, a misaligned q or a non-positive scale take the general path
    (``cuda_call.run`` returns None or is not asked); a workspace too small is refused as the general path
    refuses it."""
    q, kv, idx = _inputs(16, 256, 16384, BF16, seed=5, wide=False)
    asked = []
    real_run = cuda_call.run
    monkeypatch.setattr(cuda_call, "run", lambda *a, **k: asked.append(real_run(*a, **k)) or asked[-1])
    pkw = dispatch.plan_settings(16, "cuda")
    sparse_prefill(q, kv, idx, plan=make_plan(idx, s_kv=16384, **pkw))
    assert not asked
    n = dispatch.workspace_bytes(256, 2048, 16, s_kv=16384, backend="cuda")
    with pytest.raises(ValueError, match="workspace holds"):
        sparse_prefill(q, kv, idx, workspace=torch.empty(n - 16, dtype=torch.uint8, device="cuda"))
    asked.clear()
    sparse_prefill(q, kv, idx, settings=dispatch.PlanSettings(importance_clip=True))
    q_odd = torch.empty(256 * 16 * 576 + 1, dtype=BF16, device="cuda")[1:].view(256, 16, 576).copy_(q)
    sparse_prefill(q_odd, kv, idx)
    sparse_prefill(q, kv, idx, -1.0)
    assert asked == [None, None, None]
