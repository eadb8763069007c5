"""Public entry point: ``sparse_prefill`` (checks inputs, sets defaults, dispatches)."""
from __future__ import annotations

import os

import torch

from . import dispatch
from ._checks import (
    canonical_indices,
    canonical_kv,
    check_attn_sink,
    check_d_v,
    check_sm_scale,
    check_topk_length,
    require_dtype,
    require_ndim,
    require_same_device,
    require_tensor,
)
from .kv_cache import D_NOPE, D_QK, FP8_BYTES, canonical_fp8_cache, is_fp8_cache
from .planner import Plan, plan as make_plan
from .reference import sparse_prefill_reference

METHODS = ("quilt", "query_parallel", "reference")
BACKENDS = dispatch.BACKENDS
KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _kernels_can_run(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _check_kernel_inputs(q: torch.Tensor, kv: torch.Tensor, d_v: int):
    """Validate q / kv for the Triton kernels; returns kv in its canonical 2-D layout."""
    s_q, h, d_qk = q.shape
    if h < 1 or h > 128:
        raise ValueError(f"q must have 1..128 heads, got h = {h}")
    require_dtype("q", q, KERNEL_DTYPES)
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in its last dimension")
    if is_fp8_cache(kv):
        kv = canonical_fp8_cache(kv)
        if d_qk != D_QK or d_v != D_NOPE:
            raise ValueError(f"the FP8 kv cache needs d_qk = {D_QK} and d_v = {D_NOPE}, got d_qk = {d_qk}, d_v = {d_v}")
        kv = kv.contiguous()
    else:
        kv = canonical_kv(kv)
        if kv.dtype == torch.uint8:
            raise ValueError(f"a uint8 kv must be the FP8 cache [s_kv, {FP8_BYTES}], got {tuple(kv.shape)}")
        if kv.dtype != q.dtype:
            raise TypeError(f"kv must have q's dtype ({q.dtype}) or be the FP8 cache, got {kv.dtype}")
        if kv.shape[1] != d_qk:
            raise ValueError(f"kv has d_qk = {kv.shape[1]} but q has d_qk = {d_qk}")
        if kv.stride(-1) != 1:
            kv = kv.contiguous()
    d_rope = d_qk - d_v
    if not (_is_pow2(d_v) and d_v >= 16 and _is_pow2(d_rope) and d_rope >= 16):
        raise ValueError(
            f"the kernels need d_v and d_qk - d_v to be powers of two >= 16 (576 = 512 + 64 in production); "
            f"got d_qk = {d_qk}, d_v = {d_v}")
    return kv


def sparse_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float | None = None,
    *,
    method: str = "quilt",
    plan: Plan | None = None,
    group_size: int | None = None,
    tile: int = 64,
    clip_threshold: float = 0.5,
    importance_clip: bool = False,
    merge_level: int | None = None,
    split_private: bool = True,
    fallback: bool | str = True,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    dv_split: int = 1,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8_expand: bool | None = None,
    backend: str = "auto",
    workspace: torch.Tensor | None = None,
):
    """Top-K sparse-attention prefill (FlashMLA ``flash_mla_sparse_fwd`` semantics).

    Parameters
    ----------
    q : ``[s_q, h, d_qk]`` bf16 / fp16, any ``h`` in 1..128.
    kv : ``[s_kv, d_qk]`` (or ``[s_kv, 1, d_qk]``) of q's dtype, or the FP8 cache ``uint8 [s_kv, 656]``.
    indices : int32 ``[s_q, topk]`` (or ``[s_q, 1, topk]``); -1 or ``>= s_kv`` entries are ignored.
    sm_scale : softmax scale, default ``d_qk ** -0.5``.
    method : ``"quilt"`` (shared-query execution), ``"query_parallel"`` or ``"reference"`` (float64).
    plan : a ``Plan`` from ``quilt_attn.plan`` (or ``plan_ahead``, ``plan_chunks``) built from these
        ``indices`` (reuse it across layers); built here when None.
    group_size : plan group (see ``quilt_attn.plan``); default: the queries one program holds (``64 // h``,
        at most 8; 8 at ``h >= 64``), see ``ops.sparse_attention.default_group_size``.
    tile, clip_threshold, importance_clip : planner settings (see ``quilt_attn.plan``).
    merge_level : where the cascade stops; default: the queries one program holds (``64 // h``),
        so that every tile fills a 64-row matrix product.
    split_private : rows one query owns alone run in 16-row query programs instead of 64-row tiles
        (see ``quilt_attn.plan``); Triton only (the CUDA backend keeps them in its 64-row tiles).
    fallback : True: where one query fills a 64-row tile (``h > 32``, heads padded to 64 rows), run query
        programs (and plan nothing); where a program holds several queries, always run the plan
        (``quilt_attn.dispatch``: decided from the settings, no host sync). False: always run the plan.
        ``"cost"``: with a given ``plan``, the measured tile-cost rule decides whether sharing pays off
        (one host read of the plan's tile counts, cached in the plan).
    d_v : value width (first ``d_v`` columns of kv).
    attn_sink : optional float32 ``[h]``. topk_length : optional int32 ``[s_q]``.
    dv_split, num_warps, num_stages : kernel tuning (split of d_v across programs, Triton knobs;
        None: measured defaults by program shape).
    fp8_expand : with the FP8 cache, expand it to dense rows once per call (``ops.fp8_expand``) instead
        of dequantizing every gathered row in the Triton kernel; None: expand when the call gathers at
        least as many rows as the cache holds. The CUDA kernel always reads expanded rows, so False
        (a Triton setting) makes ``"auto"`` run Triton.
    backend : ``"triton"`` (portable), ``"cuda"`` (Hopper sm_90a kernel, compiled with nvcc on first
        use; d_qk 576 / d_v 512; an FP8 cache is expanded to bf16 once per call) or ``"auto"``
        (``dispatch.choose_backend``).
    workspace : optional uint8 tensor on q's device that the plan built in the call is carved from
        (``quilt_attn.planner.plan_workspace_bytes``; ``dispatch.workspace_bytes`` for this call's
        settings), so that the call allocates no plan memory; not with a given ``plan``.

    Returns
    -------
    out ``[s_q, h, d_v]`` (q's dtype); max_logits ``[s_q, h]`` float32, ``max(q.k * sm_scale)`` over the
    valid rows; lse ``[s_q, h]`` float32, ``logsumexp(q.k * sm_scale)`` (natural log), as FlashMLA. A query
    without a valid row: ``out = 0``, ``max_logits = -inf``, ``lse = +inf``. The default call reads nothing
    on the host (no sync): it can be captured in a CUDA graph.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if isinstance(plan, Plan):
        plan.wait()  # a plan_ahead plan: this stream waits for its planner (else nothing)
    require_tensor("q", q)
    require_ndim("q", q, (3,), "[s_q, h, d_qk]")
    require_tensor("kv", kv)
    require_same_device("kv", kv, "q", q)
    s_q, h, d_qk = q.shape
    if group_size is None:
        from .ops.sparse_attention import default_group_size

        group_size = default_group_size(h)
    indices_arg, topk_length_arg = indices, topk_length  # as passed: what a given plan must be built from
    indices = canonical_indices(indices, s_q)
    require_same_device("indices", indices, "q", q)
    topk_length = check_topk_length(topk_length, s_q, q.device, indices.shape[1])
    attn_sink = check_attn_sink(attn_sink, h, q.device)
    d_v = check_d_v(d_v, d_qk)
    sm_scale = check_sm_scale(sm_scale, d_qk)
    if method == "reference":
        out, max_logits, lse = sparse_prefill_reference(q, kv, indices, sm_scale, d_v=d_v, attn_sink=attn_sink,
                                                        topk_length=topk_length)
        return out.to(q.dtype) if q.dtype in KERNEL_DTYPES else out, max_logits, lse

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    kv = _check_kernel_inputs(q, kv, d_v)
    if plan is not None:
        _check_plan(plan, q, indices_arg, kv.shape[0], topk_length_arg)
    knobs = dispatch.triton_knobs(dv_split, num_warps, num_stages, fp8_expand)
    if kv.shape[0] == 0:  # no kv row: every index is invalid, every row empty; nothing to launch
        return empty_outputs(q, d_v)
    fallback = dispatch.check_fallback(fallback)
    auto = backend == "auto"
    backend = dispatch.choose_backend(backend, q, kv, d_v, plan, tile=tile, triton_knobs=knobs)
    if backend == "triton":
        if not _kernels_can_run(q.device):
            raise ValueError(f"method={method!r} runs Triton kernels: q must be on a CUDA device "
                             f"(or set TRITON_INTERPRET=1 to run them on the CPU); got {q.device}")
        if dv_split not in (1, 2) or (dv_split == 2 and (d_v // 2 < 16 or (kv.dtype == torch.uint8 and d_v // 2 % 128))):
            raise ValueError(f"dv_split must be 1 or 2 (2 needs d_v / 2 >= 16), got {dv_split}")
    if method != "quilt":
        plan = None  # (a given plan serves QUILT only)
    elif plan is not None:
        if plan.tile < 16 or not _is_pow2(plan.tile):
            raise ValueError(f"the kernel needs a plan tile that is a power of two >= 16, got {plan.tile}")
        if workspace is not None:
            raise ValueError("workspace is the memory of the plan a call builds; a given plan has its own")
    decision = dispatch.decide(backend, method, h, group_size=group_size, fallback=fallback,
                               importance_clip=importance_clip, plan=plan, auto=auto)
    s_kv = kv.shape[0]
    kv = dispatch.kernel_kv(q, kv, backend, indices.shape[1], fp8_expand)
    if decision.quilt and plan is None:
        pkw = dispatch.plan_settings(h, backend, group_size=group_size, tile=tile, clip_threshold=clip_threshold,
                                     importance_clip=importance_clip, merge_level=merge_level,
                                     split_private=split_private)
        plan = make_plan(indices, s_kv=s_kv, topk_length=topk_length, workspace=workspace, **pkw)
    work = dict(plan=plan) if decision.quilt else dict(indices=indices.contiguous(), topk_length=topk_length)
    if decision.kernel == "cuda":
        from .ops.cuda_backend import launch_sparse_attention_cuda

        out, max_logits, lse = launch_sparse_attention_cuda(q, kv, sm_scale, d_v, attn_sink=attn_sink, **work)
    else:
        from .ops.sparse_attention import launch_sparse_attention

        out, max_logits, lse = launch_sparse_attention(q, kv, sm_scale, d_v, attn_sink=attn_sink, dv_split=dv_split,
                                                       num_warps=num_warps, num_stages=num_stages, **work)
    dispatch.natural_log_stats(max_logits, lse)
    return out, max_logits, lse


def _check_plan(plan, q: torch.Tensor, indices: torch.Tensor, s_kv: int,
                topk_length: torch.Tensor | None = None) -> None:
    """Refuse a plan built for other arguments: sizes, device, and its ``source`` (``planner.source``:
    the indices / topk_length tensors it was built from, unwritten since, and s_kv). ``indices`` and
    ``topk_length`` as the caller passed them (checked). Host metadata only, no sync."""
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a quilt_attn.Plan, got {type(plan).__name__}")
    if plan.s_q != q.shape[0] or plan.topk != indices.shape[-1]:
        raise ValueError(f"plan was built for s_q={plan.s_q}, topk={plan.topk}; "
                         f"got s_q={q.shape[0]}, topk={indices.shape[-1]}")
    if plan.s_kv is not None and plan.s_kv != s_kv:
        raise ValueError(f"plan was built for s_kv={plan.s_kv} but kv has s_kv={s_kv}")
    if plan.device != q.device:
        raise ValueError(f"plan is on {plan.device} but q is on {q.device}")
    if plan.source is not None:
        why = plan.source.mismatch(indices, s_kv, topk_length)
        if why is not None:
            raise ValueError(f"plan does not fit this call: {why}")


def empty_outputs(q: torch.Tensor, d_v: int):
    """What every query gets when no index can be valid (``s_kv = 0``): ``out = 0 [s_q, h, d_v]`` (q's
    dtype), ``max_logits = -inf`` and ``lse = +inf`` ``[s_q, h]`` float32, as FlashMLA's empty rows."""
    s_q, h, _ = q.shape
    return (torch.zeros(s_q, h, d_v, dtype=q.dtype, device=q.device),
            torch.full((s_q, h), float("-inf"), dtype=torch.float32, device=q.device),
            torch.full((s_q, h), float("inf"), dtype=torch.float32, device=q.device))
