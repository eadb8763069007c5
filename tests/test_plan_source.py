"""``planner.source``: a plan carries what it was built for, and ``sparse_prefill`` refuses it elsewhere.

A plan from other indices of the same shape (or the same indices written since planning), or with a
``topk_length`` other than the call's, is a ``ValueError`` naming the argument, raised before any
kernel runs. The matching calls run the kernels (marker ``interpret``): tiny fp16 shapes, NaN-poisoned
outputs, compared with the float64 reference.
"""
from __future__ import annotations

import pytest
import torch

from conftest import assert_matches_reference, make_inputs, prefill_kw, random_indices
from quilt_attn import plan as make_plan
from quilt_attn import PlanSettings, plan_ahead, sparse_prefill, sparse_prefill_reference
from quilt_attn.planner.source import PlanSource, plan_source

F16 = torch.float16
DV = 64
S_Q, S_KV, TOPK, H = 16, 64, 24, 4


def inputs(seed=0, device=None):
    return make_inputs(S_Q, h=H, s_kv=S_KV, topk=TOPK, seed=seed, device=device)


def quilt(q, kv, idx, **kw):
    return sparse_prefill(q, kv, idx, method="quilt", d_v=DV, backend="triton", **prefill_kw(tile=16, **kw))


def ref(q, kv, idx, **kw):
    return sparse_prefill_reference(q, kv, idx, d_v=DV, **kw)


# ------------------------------------------------------------------ refused (no kernel runs)
def test_other_indices_of_the_same_shape_are_refused():
    q, kv, idx = inputs(device="cpu")
    p = make_plan(idx, s_kv=S_KV, group_size=4, merge_level=4, tile=16)
    other = random_indices(S_Q, S_KV, TOPK, seed=99)
    for bad in (other, idx.clone()):  # equal values in other memory do not match either: identity, not content
        with pytest.raises(ValueError, match="plan does not fit this call: indices are not the tensor the plan"):
            quilt(q, kv, bad, plan=p)


def test_indices_written_after_planning_are_refused():
    q, kv, idx = inputs(device="cpu")
    p = make_plan(idx, s_kv=S_KV, group_size=4, merge_level=4, tile=16)
    idx[3, 0] = idx[3, 1]  # in place: bumps the version counter
    with pytest.raises(ValueError, match="indices were written in place after the plan was built"):
        quilt(q, kv, idx, plan=p)
    base = torch.empty(2 * S_Q, TOPK, dtype=torch.int32)
    view = base[:S_Q]
    view.copy_(idx)
    p = make_plan(view, s_kv=S_KV, group_size=4, merge_level=4, tile=16)
    base[S_Q:].fill_(0)  # a write to the storage through another view counts too (conservative)
    with pytest.raises(ValueError, match="written in place"):
        quilt(q, kv, view, plan=p)


def test_topk_length_must_be_the_plans():
    q, kv, idx = inputs(device="cpu")
    tl = torch.randint(0, TOPK + 1, (S_Q,), dtype=torch.int32)
    with_tl = make_plan(idx, s_kv=S_KV, topk_length=tl, group_size=4, merge_level=4, tile=16)
    without = make_plan(idx, s_kv=S_KV, group_size=4, merge_level=4, tile=16)
    with pytest.raises(ValueError, match="topk_length: the plan was built with a topk_length but the call passes none"):
        quilt(q, kv, idx, plan=with_tl)
    with pytest.raises(ValueError, match="topk_length: the call passes one but the plan was built without"):
        quilt(q, kv, idx, plan=without, topk_length=tl)
    with pytest.raises(ValueError, match="topk_length is not the tensor the plan was built with"):
        quilt(q, kv, idx, plan=with_tl, topk_length=tl.clone())
    tl[0] = 1
    with pytest.raises(ValueError, match="topk_length was written in place"):
        quilt(q, kv, idx, plan=with_tl, topk_length=tl)


def test_kv_rows_must_be_the_plans():
    q, kv, idx = inputs(device="cpu")
    p = make_plan(idx, s_kv=S_KV, group_size=4, merge_level=4, tile=16)
    with pytest.raises(ValueError, match="kv has s_kv=40"):
        quilt(q, kv[:40], idx, plan=p)
    assert p.source.mismatch(idx, 40, None) == "kv has s_kv = 40 rows but the plan was built for s_kv = 64"


def test_a_plan_of_a_row_slice_records_the_slice():
    """A plan of some queries' rows (a context-parallel rank's) records that view of the caller's tensor."""
    q, kv, idx = inputs(device="cpu")
    p = make_plan(idx[8:], s_kv=S_KV, group_size=4, merge_level=4, tile=16)
    assert p.source.shape == (8, TOPK) and p.source.data_ptr == idx[8:].data_ptr()
    assert p.source.mismatch(idx[8:], S_KV, None) is None  # another view of the same rows
    with pytest.raises(ValueError, match="plan does not fit this call: indices are not the tensor"):
        quilt(q[8:], kv, idx[:8], plan=p)


def test_source_is_host_metadata_and_names_what_differs():
    idx = random_indices(S_Q, S_KV, TOPK, seed=1)
    tl = torch.full((S_Q,), 5, dtype=torch.int64)
    src = plan_source(idx, S_KV, tl)
    assert isinstance(src, PlanSource)
    assert (src.data_ptr, src.shape, src.stride, src.device) == (idx.data_ptr(), (S_Q, TOPK), (TOPK, 1), idx.device)
    assert src.has_topk_length and src.topk_length_ptr == tl.data_ptr()
    assert src.mismatch(idx, S_KV, tl) is None
    assert src.mismatch(idx[:, None, :], S_KV, tl) is None  # FlashMLA's [s_q, 1, topk] view of the same memory
    with pytest.raises(AttributeError):
        src.s_kv = 3  # frozen
    with torch.inference_mode():  # inference tensors keep no version counter: identity only
        inf_idx = random_indices(S_Q, S_KV, TOPK, seed=2)
        s = plan_source(inf_idx, None, None)
        assert s.version is None and s.mismatch(inf_idx, 10, None) is None


# ------------------------------------------------------------------ accepted (kernels run)
@pytest.mark.interpret
@pytest.mark.parametrize("form", ["2d", "3d", "2d_then_3d", "column_major"])
def test_the_same_tensor_matches_its_plan(form, nan_poison):
    """A plan from the 3-D form, the 2-D view of the same memory, or a strided tensor (the planner works
    on a contiguous copy, the source stays the caller's tensor) runs when that tensor is passed again."""
    q, kv, idx = inputs()
    if form == "column_major":
        idx = idx.t().contiguous().t()
        assert not idx.is_contiguous()
    planned = idx[:, None, :] if form == "3d" else idx
    passed = idx[:, None, :] if form in ("3d", "2d_then_3d") else idx
    p = make_plan(planned, s_kv=S_KV, group_size=4, merge_level=4, tile=16, split_private=True)
    assert_matches_reference(quilt(q, kv, passed, plan=p), ref(q, kv, idx), F16, what=form)


@pytest.mark.interpret
def test_plan_ahead_and_topk_length_match(nan_poison):
    q, kv, idx = inputs()
    tl = torch.randint(-3, TOPK + 9, (S_Q,), dtype=torch.int64, device=idx.device)
    p = plan_ahead(idx, H, s_kv=S_KV, topk_length=tl, settings=PlanSettings(tile=16), backend="triton")
    assert p.source.mismatch(idx, S_KV, tl) is None
    assert_matches_reference(quilt(q, kv, idx, plan=p, topk_length=tl), ref(q, kv, idx, topk_length=tl), F16)


@pytest.mark.interpret
@pytest.mark.parametrize("split_private", [False, True])
def test_plan_without_s_kv_on_a_shorter_kv(split_private, nan_poison):
    """``plan(indices)`` without ``s_kv`` keeps rows up to the largest index; run with a kv of fewer rows,
    every kernel path must still ignore the rows ``>= kv.shape[0]`` (its own bound, not the plan's)."""
    q, kv, idx = inputs()
    s_kv = 40  # about a third of the indices point past it
    p = make_plan(idx, group_size=4, merge_level=4, tile=16, split_private=split_private)
    assert p.s_kv is None and int((idx >= s_kv).sum()) > 0
    short = kv[:s_kv].clone()
    got = quilt(q, short, idx, plan=p, fallback=False)
    assert_matches_reference(got, ref(q, short, idx), F16, what=f"split_private={split_private}")


@pytest.mark.gpu
def test_plan_without_s_kv_on_a_shorter_kv_cuda_backend():
    """The same on the sm_90a kernel (production shape: d_qk 576, d_v 512, bf16)."""
    torch.manual_seed(0)
    s_q, s_kv_plan, s_kv, topk, h = 64, 4096, 1500, 256, 16
    idx = random_indices(s_q, s_kv_plan, topk, seed=3, device="cuda")
    q = torch.randn(s_q, h, 576, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(s_kv, 576, device="cuda", dtype=torch.bfloat16)
    p = make_plan(idx, group_size=4, merge_level=4)
    got = sparse_prefill(q, kv, idx, method="quilt", plan=p, backend="cuda", settings=PlanSettings(fallback=False))
    assert_matches_reference(got, sparse_prefill_reference(q, kv, idx), torch.bfloat16)
