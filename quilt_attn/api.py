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
from .dispatch import PlanSettings
from .kv_cache import D_NOPE, D_QK, FP8_BYTES, canonical_fp8_cache, is_fp8_cache
from .ops import cuda_call
from .ops.cuda_backend import launch_sparse_attention_cuda
from .planner import Plan, plan as make_plan
from .reference import sparse_prefill_reference

METHODS = ("quilt", "query_parallel", "reference")
PRECISIONS = ("exact", "fp8")
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
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    plan: Plan | None = None,
    backend: str = "auto",
    method: str = "quilt",
    settings: PlanSettings | None = None,
    workspace: torch.Tensor | None = None,
    precision: str = "exact",
    _triton: dict | None = None,
):
    """Top-K sparse-attention prefill (FlashMLA ``flash_mla_sparse_fwd`` semantics).

    Parameters
    ----------
    q : ``[s_q, h, d_qk]`` bf16 / fp16, any ``h`` in 1..128.
    kv : ``[s_kv, d_qk]`` (or ``[s_kv, 1, d_qk]``) of q's dtype, or the FP8 cache ``uint8 [s_kv, 656]``.
    indices : int32 ``[s_q, topk]`` (or ``[s_q, 1, topk]``); -1 or ``>= s_kv`` entries are ignored.
    sm_scale : softmax scale, default ``d_qk ** -0.5``.
    d_v : value width (first ``d_v`` columns of kv).
    attn_sink : optional float32 ``[h]``. topk_length : optional int32 ``[s_q]``.
    plan : a ``Plan`` from ``quilt_attn.plan`` (or ``plan_ahead``) built from these ``indices`` (reuse it
        across layers); built here (with ``settings``) when None.
    backend : ``"triton"`` (portable), ``"cuda"`` (Hopper sm_90a kernel, compiled with nvcc on first
        use; d_qk 576 / d_v 512; an FP8 cache is widened to bf16 rows first, ``dispatch.kernel_kv``) or
        ``"auto"`` (``dispatch.choose_backend``).
    method : ``"quilt"`` (shared-query execution), ``"query_parallel"`` or ``"reference"`` (float64).
    settings : ``quilt_attn.PlanSettings``: the plan built here (group size, tile, clipping, merge level,
        private rows) and whether QUILT runs a plan at all (``fallback``); None: the defaults. What runs is
        decided from the settings, never from the data (``quilt_attn.dispatch``, no host sync).
    precision : ``"exact"`` (bf16 matrix math; an FP8 cache is dequantized exactly) or ``"fp8"``, the FP8
        tensor-core mode (CUDA backend, bf16 q): QK's latent part and PV in e4m3 from the FP8 cache's own values,
        q quantized to e4m3 a (query, head) (``quilt_attn.fp8_mode.sparse_prefill_fp8_kernel_reference`` is its
        arithmetic; accuracy in BENCHMARKS.md). A dense kv is quantized to the FP8 cache first (once a call:
        ``quantize_fp8``). Not with importance clipping (``settings.importance_clip``).
    workspace : optional uint8 tensor on q's device that the plan built in the call is carved from
        (``quilt_attn.planner.plan_workspace_bytes``; ``dispatch.workspace_bytes`` for this call's
        settings), so that the call allocates no plan memory; not with a given ``plan``.
    _triton : private Triton tuning for benchmarks and tests (``dispatch.TRITON_TUNING``: ``dv_split``,
        ``num_warps``, ``num_stages``, ``fp8_expand``); any of them but ``fp8_expand=True`` makes ``"auto"``
        run Triton (the CUDA kernel has no such knobs).

    Returns
    -------
    out ``[s_q, h, d_v]`` (q's dtype); max_logits ``[s_q, h]`` float32, ``max(q.k * sm_scale)`` over the
    valid rows; lse ``[s_q, h]`` float32, ``logsumexp(q.k * sm_scale)`` (natural log), as FlashMLA. A query
    without a valid row: ``out = 0``, ``max_logits = -inf``, ``lse = +inf``. The default call reads nothing
    on the host (no sync): it can be captured in a CUDA graph.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    settings = dispatch.check_settings(settings)
    tuning = dispatch.triton_tuning(_triton)
    if isinstance(plan, Plan):
        plan.wait()  # a plan_ahead plan: this stream waits for its planner (else nothing)
    require_tensor("q", q)
    require_ndim("q", q, (3,), "[s_q, h, d_qk]")
    require_tensor("kv", kv)
    require_same_device("kv", kv, "q", q)
    s_q, h, d_qk = q.shape
    indices_arg, topk_length_arg = indices, topk_length  # as passed: what a given plan must be built from
    indices = canonical_indices(indices, s_q)
    require_same_device("indices", indices, "q", q)
    topk_length = check_topk_length(topk_length, s_q, q.device, indices.shape[1])
    attn_sink = check_attn_sink(attn_sink, h, q.device)
    d_v = check_d_v(d_v, d_qk)
    sm_scale = check_sm_scale(sm_scale, d_qk)
    if not isinstance(precision, str) or precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp8":
        kv = _fp8_mode_inputs(q, kv, d_v, backend, method, settings)
    if method == "reference" and precision == "fp8":
        from .fp8_mode import sparse_prefill_fp8_kernel_reference

        out, max_logits, lse = sparse_prefill_fp8_kernel_reference(q, kv, indices, sm_scale, attn_sink=attn_sink,
                                                                   topk_length=topk_length)
        return out.to(q.dtype), max_logits, lse
    if method == "reference":
        out, max_logits, lse = sparse_prefill_reference(q, kv, indices, sm_scale, d_v=d_v, attn_sink=attn_sink,
                                                        topk_length=topk_length)
        return out.to(q.dtype) if q.dtype in KERNEL_DTYPES else out, max_logits, lse

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    kv = _check_kernel_inputs(q, kv, d_v)
    if plan is not None:
        _check_plan(plan, q, indices_arg, kv.shape[0], topk_length_arg)
    if kv.shape[0] == 0:  # no kv row: every index is invalid, every row empty; nothing to launch
        return empty_outputs(q, d_v)
    auto = backend == "auto"
    if precision == "fp8":  # (_fp8_mode_inputs: the CUDA backend runs here)
        backend = "cuda"
    else:
        backend = dispatch.choose_backend(backend, q, kv, d_v, plan, tile=settings.tile,
                                          triton_knobs=dispatch.triton_knobs(tuning))
    dv_split = tuning["dv_split"]
    if backend == "triton":
        if not _kernels_can_run(q.device):
            raise ValueError(f"method={method!r} runs Triton kernels: q must be on a CUDA device "
                             f"(or set TRITON_INTERPRET=1 to run them on the CPU); got {q.device}")
        if dv_split not in (1, 2) or (dv_split == 2 and (d_v // 2 < 16 or (kv.dtype == torch.uint8 and d_v // 2 % 128))):
            raise ValueError(f"dv_split must be 1 or 2 (2 needs d_v / 2 >= 16), got {dv_split}")
    if method != "quilt":
        plan = None  # (a given plan serves QUILT only)
    elif plan is not None:
        dispatch.check_kernel_tile(plan.tile)
        if workspace is not None:
            raise ValueError("workspace is the memory of the plan a call builds; a given plan has its own")
    decision = dispatch.decide(backend, method, h, settings, plan=plan,
                               auto=auto and precision == "exact")  # (the FP8 mode: CUDA programs)
    s_kv = kv.shape[0]
    if precision == "exact":  # (the FP8 mode reads the cache's own rows)
        kv = dispatch.kernel_kv(q, kv, backend, indices.shape[1], tuning["fp8_expand"],
                                plan=plan if decision.quilt else None)
    made_here = decision.quilt and plan is None
    if made_here:
        pkw = dispatch.plan_settings(h, backend, settings)
        if decision.kernel == "cuda" and precision == "exact":
            done = cuda_call.run(q, kv, indices, topk_length, attn_sink, sm_scale, pkw,
                                 workspace)  # (None: not its shape)
            if done is not None:
                return done
        plan = make_plan(indices, s_kv=s_kv, topk_length=topk_length, workspace=workspace, **pkw)
    work = dict(indices=indices, topk_length=topk_length)  # (with a plan: for its repair pass)
    if decision.quilt:
        work["plan"] = plan
    if decision.kernel == "cuda":
        out, max_logits, lse = launch_sparse_attention_cuda(q, kv, sm_scale, d_v, attn_sink=attn_sink,
                                                            precision=precision, plan_is_spent=made_here, **work)
    else:
        from .ops.sparse_attention import launch_sparse_attention  # a Triton kernel module: imported when first used

        out, max_logits, lse = launch_sparse_attention(q, kv, sm_scale, d_v, attn_sink=attn_sink, dv_split=dv_split,
                                                       num_warps=tuning["num_warps"],
                                                       num_stages=tuning["num_stages"], **work)
    dispatch.natural_log_stats(max_logits, lse)
    return out, max_logits, lse


def _fp8_mode_inputs(q: torch.Tensor, kv: torch.Tensor, d_v: int, backend: str, method: str,
                     settings: PlanSettings) -> torch.Tensor:
    """Check a ``precision="fp8"`` call's arguments; returns kv as the FP8 cache (a dense kv quantized)."""
    if q.dtype != torch.bfloat16:
        raise TypeError(f"precision='fp8' needs bf16 q (its rope part stays bf16), got {q.dtype}")
    if q.shape[2] != D_QK or d_v != D_NOPE:
        raise ValueError(f"precision='fp8' runs d_qk = {D_QK}, d_v = {D_NOPE}; got d_qk = {q.shape[2]}, d_v = {d_v}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if method != "reference":
        if backend == "triton":
            raise ValueError("precision='fp8' runs on the CUDA backend (Hopper e4m3 tensor cores), not 'triton'")
        from .ops.cuda_backend import unavailable_reason

        why = unavailable_reason(q.device)
        if why:
            raise ValueError(f"precision='fp8' needs the CUDA backend: {why}")
        if settings.importance_clip:
            raise ValueError("precision='fp8' does not run importance clipping (its private rows run in the exact "
                             "Triton pass); set settings.importance_clip=False")
    if is_fp8_cache(kv):
        return canonical_fp8_cache(kv)
    from .kv_cache import quantize_fp8

    kv = canonical_kv(kv)
    if kv.dtype not in KERNEL_DTYPES:
        raise TypeError(f"kv must be bf16 / fp16 or the FP8 cache, got {kv.dtype}")
    return quantize_fp8(kv)


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
