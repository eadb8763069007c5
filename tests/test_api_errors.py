"""``sparse_prefill`` / ``flash_mla_sparse_fwd`` reject bad arguments with clear errors.

Every error names the offending argument (asserted with ``match=``): ``TypeError`` for a wrong
type or dtype, ``ValueError`` for a wrong shape, size, device or value. All of these are raised
before any kernel runs, so most run on the CPU without the Triton interpreter.
"""
from __future__ import annotations

import pytest
import torch

from conftest import KERNEL_DEVICE, make_inputs, prefill_kw, randn, random_indices
from quilt_attn import plan as make_plan
from quilt_attn import quantize_fp8, sparse_prefill, sparse_prefill_reference
from quilt_attn.compat import flash_mla_sparse_fwd

KERNEL_METHODS = ("quilt", "query_parallel")


def small(device="cpu", **kw):
    kw.setdefault("h", 2)
    return make_inputs(8, s_kv=32, topk=16, device=device, **kw)


def call(q, kv, idx, **kw):
    kw.setdefault("d_v", 64)
    kw.setdefault("tile", 16)
    return sparse_prefill(q, kv, idx, **prefill_kw(**kw))


# ----------------------------------------------------------------------------- q / kv
@pytest.mark.parametrize("method", KERNEL_METHODS)
def test_wrong_q_dtype(method):
    q, kv, idx = small()
    with pytest.raises(TypeError, match=r"q must have dtype in \(bfloat16, float16\), got float32"):
        call(q.float(), kv.float(), idx, method=method)
    with pytest.raises(TypeError, match="q must have dtype"):
        call(q.to(torch.int32), kv, idx, method="reference")


def test_kv_dtype_mismatch():
    q, kv, idx = small()
    with pytest.raises(TypeError, match=r"kv must have q's dtype \(torch.float16\)"):
        call(q, kv.to(torch.bfloat16), idx)
    with pytest.raises(ValueError, match=r"a uint8 kv must be the FP8 cache \[s_kv, 656\]"):
        call(q, kv.view(torch.uint8), idx)


def test_not_tensors():
    q, kv, idx = small()
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        call(q.tolist(), kv, idx)
    with pytest.raises(TypeError, match="kv must be a torch.Tensor"):
        call(q, kv.numpy(), idx)
    with pytest.raises(TypeError, match="indices must be a torch.Tensor"):
        call(q, kv, idx.tolist())


def test_wrong_shapes():
    q, kv, idx = small()
    with pytest.raises(ValueError, match=r"q must be \[s_q, h, d_qk\]"):
        call(q[:, 0], kv, idx)
    with pytest.raises(ValueError, match=r"q must be \[s_q, h, d_qk\]"):
        call(q[None], kv, idx)
    with pytest.raises(ValueError, match=r"kv of shape \[s_kv, h_kv, d\] must have h_kv == 1"):
        call(q, kv.view(16, 2, 80), idx)
    with pytest.raises(ValueError, match=r"kv must be \[s_kv, d_qk\]"):
        call(q, kv[0], idx)


@pytest.mark.parametrize("h", [0, 129])
@pytest.mark.parametrize("method", KERNEL_METHODS)
def test_head_count(h, method):
    q = torch.ones(4, h, 80, dtype=torch.float16)
    kv = randn(32, 80, seed=0)
    idx = random_indices(4, 32, 16, seed=1)
    with pytest.raises(ValueError, match=rf"q must have 1..128 heads, got h = {h}"):
        call(q, kv, idx, method=method)


def test_device_mismatch():
    q, kv, idx = small()
    with pytest.raises(ValueError, match="kv is on meta but q is on cpu"):
        call(q, kv.to("meta"), idx)
    with pytest.raises(ValueError, match="indices is on meta but q is on cpu"):
        call(q, kv, idx.to("meta"))
    with pytest.raises(ValueError, match="topk_length is on meta"):
        call(q, kv, idx, topk_length=torch.ones(8, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="attn_sink is on meta but q is on cpu"):
        call(q, kv, idx, attn_sink=torch.zeros(2, device="meta"))


@pytest.mark.parametrize("method", [*KERNEL_METHODS, "reference"])
def test_d_qk_mismatch(method):
    q, kv, idx = small()
    with pytest.raises(ValueError, match="kv has d_qk = 96 but q has d_qk = 80"):
        call(q, randn(32, 96, seed=3), idx, method=method)


def test_d_v():
    q, kv, idx = small()
    with pytest.raises(ValueError, match=r"d_v must be an int in \[1, d_qk = 80\], got 0"):
        call(q, kv, idx, d_v=0)
    with pytest.raises(ValueError, match="d_v must be an int"):
        call(q, kv, idx, d_v=96)
    for method in ("quilt", "reference"):
        with pytest.raises(TypeError, match="d_v must be an int in .* got float 64.0"):
            call(q, kv, idx, d_v=64.0, method=method)
        with pytest.raises(TypeError, match="d_v must be an int"):
            call(q, kv, idx, d_v=True, method=method)
    with pytest.raises(TypeError, match="d_v must be an int"):
        sparse_prefill_reference(q, kv, idx, d_v=16.0)
    with pytest.raises(ValueError, match="the kernels need d_v and d_qk - d_v to be powers of two >= 16"):
        call(q, kv, idx, d_v=48)


@pytest.mark.parametrize("method", ("quilt", "query_parallel", "reference"))
def test_sm_scale(method):
    q, kv, idx = small()
    for bad in ("abc", torch.tensor([0.1, 0.2]), torch.tensor(0.1), True, [0.1]):
        with pytest.raises(TypeError, match="sm_scale must be a real number"):
            call(q, kv, idx, sm_scale=bad, method=method)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="sm_scale must be finite"):
            call(q, kv, idx, sm_scale=bad, method=method)
    with pytest.raises(TypeError, match="sm_scale must be a real number"):
        sparse_prefill_reference(q, kv, idx, "abc", d_v=64)


def test_q_last_dim_not_contiguous():
    q, kv, idx = small()
    wide = randn(8, 2, 160, seed=5)
    with pytest.raises(ValueError, match="q must be contiguous in its last dimension"):
        call(wide[:, :, ::2], kv, idx)


# ----------------------------------------------------------------------------- indices & co
def test_indices_dtype():
    q, kv, idx = small()
    with pytest.raises(TypeError, match="indices must be int32, got int64"):
        call(q, kv, idx.long())
    with pytest.raises(TypeError, match="indices must be int32, got float32"):
        call(q, kv, idx.float())


def test_indices_shape():
    q, kv, idx = small()
    with pytest.raises(ValueError, match="indices has 7 rows but q has s_q = 8"):
        call(q, kv, idx[:7])
    with pytest.raises(ValueError, match=r"indices of shape \[s_q, h_kv, topk\] must have h_kv == 1"):
        call(q, kv, idx.view(8, 2, 8))
    with pytest.raises(ValueError, match=r"indices must be \[s_q, topk\]"):
        call(q, kv, idx[0])
    with pytest.raises(ValueError, match="indices must have topk >= 1"):
        call(q, kv, idx[:, :0])


def test_topk_length_errors():
    q, kv, idx = small()
    with pytest.raises(ValueError, match=r"topk_length must have shape \[s_q\] = \[8\], got \(9,\)"):
        call(q, kv, idx, topk_length=torch.ones(9, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"topk_length must have shape \[s_q\]"):
        call(q, kv, idx, topk_length=torch.ones(8, 1, dtype=torch.int32))
    with pytest.raises(TypeError, match="topk_length must be int32"):
        call(q, kv, idx, topk_length=torch.ones(8))
    with pytest.raises(TypeError, match="topk_length must be a torch.Tensor"):
        call(q, kv, idx, topk_length=[1] * 8)


def test_attn_sink_errors():
    q, kv, idx = small()
    with pytest.raises(TypeError, match=r"attn_sink must have dtype in \(float32\), got float16"):
        call(q, kv, idx, attn_sink=torch.zeros(2, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"attn_sink must have shape \[h\] = \[2\], got \(3,\)"):
        call(q, kv, idx, attn_sink=torch.zeros(3))
    with pytest.raises(ValueError, match=r"attn_sink must have shape \[h\]"):
        call(q, kv, idx, attn_sink=torch.zeros(1, 2))


def test_unknown_method():
    q, kv, idx = small()
    with pytest.raises(ValueError, match=r"method must be one of \('quilt', 'query_parallel', 'reference'\), got 'dense'"):
        call(q, kv, idx, method="dense")


# ----------------------------------------------------------------------------- FP8 cache
def test_fp8_cache_needs_576_and_512():
    cache = quantize_fp8(randn(32, 576, seed=6, dtype=torch.bfloat16))
    q, _, idx = small()  # d_qk = 80
    with pytest.raises(ValueError, match="the FP8 kv cache needs d_qk = 576 and d_v = 512, got d_qk = 80"):
        call(q, cache, idx)
    q576 = randn(8, 2, 576, seed=7)
    with pytest.raises(ValueError, match="the FP8 kv cache needs d_qk = 576 and d_v = 512, got d_qk = 576, d_v = 256"):
        call(q576, cache, idx, d_v=256)
    with pytest.raises(ValueError, match=r"kv must be uint8 \[s_kv, 656\] \(or \[s_kv, 1, 656\]\) to be the FP8 cache"):
        call(q576, cache.view(16, 2, 656), idx, d_v=512)


def test_fp8_cache_wrong_d_qk_reference():
    cache = quantize_fp8(randn(32, 576, seed=6, dtype=torch.bfloat16))
    q, _, idx = small()
    with pytest.raises(ValueError, match="kv has d_qk = 576 but q has d_qk = 80"):
        call(q, cache, idx, method="reference")


# ----------------------------------------------------------------------------- kernel settings
def test_kernels_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, kv, idx = small(device="cpu")
    for method in KERNEL_METHODS:
        with pytest.raises(ValueError, match=r"q must be on a CUDA device \(or set TRITON_INTERPRET=1"):
            call(q, kv, idx, method=method)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"method='quilt' runs Triton kernels.*TRITON_INTERPRET=1"):
        flash_mla_sparse_fwd(q, kv[:, None], idx[:, None], 0.1, d_v=64)


@pytest.mark.interpret
def test_dv_split():
    q, kv, idx = small(device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match="dv_split must be 1 or 2"):
        call(q, kv, idx, dv_split=3)
    with pytest.raises(ValueError, match="dv_split must be 1 or 2"):
        call(q, kv, idx, dv_split=0)
    # d_v = 16: halves of 8 columns are too narrow
    q2 = randn(8, 2, 32, seed=9, device=KERNEL_DEVICE)
    kv2 = randn(32, 32, seed=10, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match=r"dv_split must be 1 or 2 \(2 needs d_v / 2 >= 16\), got 2"):
        call(q2, kv2, idx.to(KERNEL_DEVICE), d_v=16, dv_split=2)


@pytest.mark.interpret
def test_planner_settings_errors():
    q, kv, idx = small(device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match=r"group_size must be a power of two in \[1, 16\], got 3"):
        call(q, kv, idx, group_size=3)
    with pytest.raises(ValueError, match=r"clip_threshold must be in \[0, 1\]"):
        call(q, kv, idx, clip_threshold=1.5)
    with pytest.raises(ValueError, match="importance_clip needs merge_level=1"):
        call(q, kv, idx, importance_clip=True, merge_level=2, group_size=4, split_private=False)
    with pytest.raises(ValueError, match="the kernel needs a plan tile that is a power of two >= 16, got 8"):
        call(q, kv, idx, tile=8)


def test_settings_argument():
    """Planner settings come in one frozen ``PlanSettings``, checked where they are made; Triton tuning is private."""
    import dataclasses
    import inspect

    from quilt_attn import PlanSettings

    assert list(inspect.signature(sparse_prefill).parameters) == [
        "q", "kv", "indices", "sm_scale", "d_v", "attn_sink", "topk_length", "plan", "backend", "method", "settings",
        "workspace", "precision", "_triton"]
    q, kv, idx = small()
    with pytest.raises(TypeError, match="settings must be a quilt_attn.PlanSettings or None, got dict"):
        sparse_prefill(q, kv, idx, settings={"group_size": 4})
    with pytest.raises(TypeError, match="group_size"):  # not a keyword of sparse_prefill
        sparse_prefill(q, kv, idx, group_size=4)
    with pytest.raises(ValueError, match="fallback must be True, False or 'cost', got 'x'"):
        PlanSettings(fallback="x")
    with pytest.raises(dataclasses.FrozenInstanceError):
        PlanSettings().tile = 32
    assert PlanSettings(fallback=1).fallback is True
    with pytest.raises(TypeError, match=r"_triton must be a dict or None, got int"):
        sparse_prefill(q, kv, idx, _triton=2)


@pytest.mark.interpret
def test_plan_built_for_other_sizes():
    q, kv, idx = small(device=KERNEL_DEVICE)
    dev = KERNEL_DEVICE
    other_sq = make_plan(random_indices(16, 32, 16, seed=11, device=dev), s_kv=32, group_size=4, tile=16)
    with pytest.raises(ValueError, match="plan was built for s_q=16, topk=16; got s_q=8, topk=16"):
        call(q, kv, idx, plan=other_sq)
    other_topk = make_plan(random_indices(8, 32, 24, seed=12, device=dev), s_kv=32, group_size=4, tile=16)
    with pytest.raises(ValueError, match="plan was built for s_q=8, topk=24; got s_q=8, topk=16"):
        call(q, kv, idx, plan=other_topk)
    other_skv = make_plan(idx, s_kv=64, group_size=4, tile=16)
    with pytest.raises(ValueError, match="plan was built for s_kv=64 but kv has s_kv=32"):
        call(q, kv, idx, plan=other_skv)
    with pytest.raises(TypeError, match="plan must be a quilt_attn.Plan, got dict"):
        call(q, kv, idx, plan={})
    small_tile = make_plan(idx, s_kv=32, group_size=4, tile=8)
    with pytest.raises(ValueError, match="plan tile that is a power of two >= 16, got 8"):
        call(q, kv, idx, plan=small_tile)


def test_compat_passes_errors_through():
    q, kv, idx = small()
    with pytest.raises(TypeError, match="indices must be int32"):
        flash_mla_sparse_fwd(q, kv[:, None], idx[:, None].long(), 0.1, d_v=64)
    with pytest.raises(ValueError, match="q must have 1..128 heads"):
        flash_mla_sparse_fwd(torch.ones(8, 129, 80, dtype=torch.float16), kv[:, None], idx[:, None], 0.1, d_v=64)
