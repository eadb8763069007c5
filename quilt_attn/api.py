"""Public entry point: ``sparse_prefill`` (checks inputs, sets defaults, dispatches)."""
from __future__ import annotations

import os

import torch

from ._checks import (
    canonical_indices,
    canonical_kv,
    check_attn_sink,
    check_topk_length,
    require_dtype,
    require_ndim,
    require_same_device,
    require_tensor,
)
from .kv_cache import D_NOPE, D_QK, FP8_BYTES, is_fp8_cache
from .planner import Plan, plan as make_plan
from .reference import sparse_prefill_reference

METHODS = ("quilt", "query_parallel", "reference")
BACKENDS = ("auto", "triton", "cuda")
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
        if kv.dim() == 3:
            if kv.shape[1] != 1:
                raise ValueError(f"kv (FP8 cache) must be [s_kv, {FP8_BYTES}] or [s_kv, 1, {FP8_BYTES}], got {tuple(kv.shape)}")
            kv = kv[:, 0]
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
    fallback: bool = True,
    d_v: int = 512,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    dv_split: int = 1,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8_expand: bool | None = None,
    backend: str = "auto",
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
        (see ``quilt_attn.plan``).
    fallback : run query-parallel when the plan's tile count says sharing would not pay off
        (little overlap, or ``h >= 64`` where one query fills a tile); decided once per plan.
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
        (see ``choose_backend``).

    Returns
    -------
    out ``[s_q, h, d_v]`` (q's dtype), max_logits ``[s_q, h]`` float32, lse ``[s_q, h]`` float32 (base 2).
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
    indices = canonical_indices(indices, s_q)
    require_same_device("indices", indices, "q", q)
    topk_length = check_topk_length(topk_length, s_q, q.device)
    attn_sink = check_attn_sink(attn_sink, h, q.device)
    if not isinstance(d_v, int) or not 0 < d_v <= d_qk:
        raise ValueError(f"d_v must be an int in [1, d_qk = {d_qk}], got {d_v!r}")
    if sm_scale is None:
        sm_scale = d_qk**-0.5
    if method == "reference":
        out, max_logits, lse = sparse_prefill_reference(q, kv, indices, sm_scale, d_v=d_v, attn_sink=attn_sink,
                                                        topk_length=topk_length)
        return out.to(q.dtype) if q.dtype in KERNEL_DTYPES else out, max_logits, lse

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    kv = _check_kernel_inputs(q, kv, d_v)
    knobs = triton_knobs(dv_split, num_warps, num_stages, fp8_expand)
    auto = backend == "auto"
    backend = choose_backend(backend, q, kv, d_v, plan, tile=tile, triton_knobs=knobs)
    if backend == "cuda":
        return _run_cuda(q, kv, indices, sm_scale, d_v, method=method, plan=plan, group_size=group_size, tile=tile,
                         clip_threshold=clip_threshold, importance_clip=importance_clip, merge_level=merge_level,
                         fallback=fallback, attn_sink=attn_sink, topk_length=topk_length, auto=auto)
    if not _kernels_can_run(q.device):
        raise ValueError(f"method={method!r} runs Triton kernels: q must be on a CUDA device "
                         f"(or set TRITON_INTERPRET=1 to run them on the CPU); got {q.device}")
    if dv_split not in (1, 2) or (dv_split == 2 and (d_v // 2 < 16 or (kv.dtype == torch.uint8 and d_v // 2 % 128))):
        raise ValueError(f"dv_split must be 1 or 2 (2 needs d_v / 2 >= 16), got {dv_split}")
    from .ops.sparse_attention import launch_sparse_attention, program_shape, runs_quilt

    s_kv = kv.shape[0]
    kv = maybe_expand_fp8(q, kv, indices.shape[1], fp8_expand)
    tuning = dict(attn_sink=attn_sink, dv_split=dv_split, num_warps=num_warps, num_stages=num_stages)

    def query_parallel():
        return launch_sparse_attention(q, kv, sm_scale, d_v, indices=indices.contiguous(), topk_length=topk_length,
                                       **tuning)

    if method == "query_parallel":
        return query_parallel()
    if plan is None and fallback and not importance_clip and program_shape(h, group_size)[0] == 1:
        # h >= 64: one query already fills a 64-row tile, nothing to share inside it; skip planning
        return query_parallel()
    if plan is None:
        if merge_level is None:
            merge_level = program_shape(h, group_size)[0]
        plan = make_plan(indices, s_kv=s_kv, topk_length=topk_length, group_size=group_size, tile=tile,
                         clip_threshold=clip_threshold, importance_clip=importance_clip, merge_level=merge_level,
                         split_private=split_private)
    else:
        _check_plan(plan, q, indices, s_kv)
    if plan.tile < 16 or not _is_pow2(plan.tile):
        raise ValueError(f"the kernel needs a plan tile that is a power of two >= 16, got {plan.tile}")
    if not runs_quilt(plan, h, fallback):
        # too little is shared to fill 64-row tiles (or one query fills them): run query by query
        return query_parallel()
    return launch_sparse_attention(q, kv, sm_scale, d_v, plan=plan, **tuning)


_WARNED: set = set()


def choose_backend(backend: str, q: torch.Tensor, kv: torch.Tensor, d_v: int, plan: Plan | None = None, *,
                   tile: int = 64, triton_knobs: bool = False) -> str:
    """``"triton"`` or ``"cuda"`` for these (checked) inputs.

    ``"cuda"`` raises ``ValueError`` when the CUDA kernel cannot run them (naming why); ``"auto"``
    takes the CUDA kernel wherever it runs (1.4-1.6x faster than Triton at every head count on the
    realistic workloads, BENCHMARKS.md; where a plan shares too little, ``_run_cuda`` still hands the
    call to Triton's query programs) and otherwise Triton, saying once why when a GPU is present. ``triton_knobs``: Triton tuning
    arguments were given (the CUDA kernel has none).
    """
    if backend == "triton":
        return backend
    from .ops import cuda_backend

    dense = kv if kv.dtype != torch.uint8 else q.new_empty(0, q.shape[2])  # an FP8 cache is expanded first
    reason = cuda_backend.unavailable_reason(q.device) or cuda_backend.unsupported_reason(q, dense, d_v, plan)
    if reason is None and plan is None and tile != cuda_backend.TILE:
        reason = f"the CUDA backend runs tile = {cuda_backend.TILE}, got {tile}"
    if reason is None and triton_knobs:
        reason = "dv_split, num_warps, num_stages and fp8_expand=False tune the Triton kernel"
    if reason is None:
        return "cuda"
    if backend == "cuda":
        raise ValueError(f"backend='cuda': {reason}")
    if q.device.type == "cuda" and reason not in _WARNED:
        import warnings

        _WARNED.add(reason)
        warnings.warn(f"quilt_attn: backend='auto' runs Triton: {reason}", stacklevel=3)
    return "triton"


def triton_knobs(dv_split, num_warps, num_stages, fp8_expand) -> bool:
    """Whether Triton-only tuning was asked for (``choose_backend``'s ``triton_knobs``); checks ``fp8_expand``."""
    if fp8_expand is not None and not isinstance(fp8_expand, bool):
        raise TypeError(f"fp8_expand must be None or a bool, got {type(fp8_expand).__name__}")
    return dv_split != 1 or num_warps is not None or num_stages is not None or fp8_expand is False


def maybe_expand_fp8(q: torch.Tensor, kv: torch.Tensor, topk: int, fp8_expand: bool | None) -> torch.Tensor:
    """kv for the Triton kernels: an FP8 cache expanded to q's dtype once (``fp8_expand``, or by default
    when the call gathers at least ``s_kv`` rows), else as given (dequantized on load)."""
    if kv.dtype != torch.uint8:
        return kv
    from .ops.fp8_expand import expand_fp8, expansion_pays_off

    if fp8_expand is None:
        fp8_expand = expansion_pays_off(kv.shape[0], q.shape[0], topk)
    return expand_fp8(kv, q.dtype) if fp8_expand else kv


def _cuda_setup(q, kv, *, group_size, tile, clip_threshold, importance_clip, merge_level, fallback):
    """What the CUDA backend runs from: kv as its kernel reads it, and the settings of the plans it runs.

    Shared by ``_run_cuda`` and ``pipeline.sparse_prefill_pipelined``, so that both expand kv and plan alike.

    Parameters
    ----------
    q : ``[s_q, h, 576]`` bf16 / fp16.
    kv : as ``_check_kernel_inputs`` returns it: ``[s_kv, 576]`` of q's dtype or the FP8 cache
        ``uint8 [s_kv, 656]``.
    group_size, tile, clip_threshold, importance_clip, merge_level, fallback : as in ``sparse_prefill``.

    Returns
    -------
    kv : ``[s_kv, 576]`` of q's dtype; an FP8 cache is expanded here, once per call (1152 bytes a row):
        prefill reads each row many times, and the kernel reads dense rows only.
    plan_kw : ``quilt_attn.plan`` keywords without ``s_kv`` / ``topk_length``, or None where nothing is
        to be planned: with ``fallback`` at ``h >= 64`` one query already fills a 64-row tile, so the
        kernel runs query-parallel over all queries.
    """
    from .ops.fp8_expand import expand_fp8
    from .ops.sparse_attention import program_shape

    if kv.dtype == torch.uint8:
        kv = expand_fp8(kv, q.dtype)
    qp = program_shape(q.shape[1], group_size)[0]
    if fallback and not importance_clip and qp == 1:
        return kv, None
    # every CUDA tile is a 64-row product: a query's own rows cost as much alone as in a shared tile,
    # so nothing is split off into 16-row private programs -- except under importance clipping, which
    # clips the private lists (those then run in the Triton query pass that continues the CUDA state)
    return kv, dict(group_size=group_size, tile=tile, clip_threshold=clip_threshold, importance_clip=importance_clip,
                    merge_level=qp if merge_level is None else merge_level, split_private=importance_clip)


def _run_cuda(q, kv, indices, sm_scale, d_v, *, method, plan, group_size, tile, clip_threshold, importance_clip,
              merge_level, fallback, attn_sink, topk_length, auto=False):
    """The CUDA backend's dispatch: every tile is a 64-row matrix product, so QUILT never loses to the
    CUDA query-parallel kernel below 64 heads (a query's own tile is as costly as a shared one) and is
    skipped at 64+ (``cuda_backend.cuda_runs_quilt``). Chosen by ``backend="auto"`` (``auto``),
    query-parallel work below 64 heads and, with ``fallback``, a plan that shares too little run
    Triton's 16- / 32-row query programs instead (``cuda_backend.query_programs_on_triton``,
    ``cuda_backend.cuda_pays_off``)."""
    from .ops.cuda_backend import cuda_runs_quilt, launch_sparse_attention_cuda, query_programs_on_triton
    from .ops.sparse_attention import launch_sparse_attention

    kv, plan_kw = _cuda_setup(q, kv, group_size=group_size, tile=tile, clip_threshold=clip_threshold,
                              importance_clip=importance_clip, merge_level=merge_level, fallback=fallback)
    run = dict(attn_sink=attn_sink)

    def query_parallel():
        launcher = launch_sparse_attention if query_programs_on_triton(q.shape[1], auto) else \
            launch_sparse_attention_cuda
        return launcher(q, kv, sm_scale, d_v, indices=indices.contiguous(), topk_length=topk_length, **run)

    if method == "query_parallel" or (plan is None and plan_kw is None):
        return query_parallel()
    if plan is None:
        plan = make_plan(indices, s_kv=kv.shape[0], topk_length=topk_length, **plan_kw)
    else:
        _check_plan(plan, q, indices, kv.shape[0])
    if not cuda_runs_quilt(plan, q.shape[1], fallback, auto):
        return query_parallel()
    return launch_sparse_attention_cuda(q, kv, sm_scale, d_v, plan=plan, **run)


def _check_plan(plan, q: torch.Tensor, indices: torch.Tensor, s_kv: int) -> None:
    if not isinstance(plan, Plan):
        raise TypeError(f"plan must be a quilt_attn.Plan, got {type(plan).__name__}")
    if plan.s_q != q.shape[0] or plan.topk != indices.shape[1]:
        raise ValueError(f"plan was built for s_q={plan.s_q}, topk={plan.topk}; "
                         f"got s_q={q.shape[0]}, topk={indices.shape[1]}")
    if plan.s_kv is not None and plan.s_kv != s_kv:
        raise ValueError(f"plan was built for s_kv={plan.s_kv} but kv has s_kv={s_kv}")
    if plan.device != q.device:
        raise ValueError(f"plan is on {plan.device} but q is on {q.device}")
