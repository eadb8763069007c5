"""The planner overlapped with attention: ``plan_ahead`` (plan indices on a side stream, beside the
attention the current stream runs next) and ``sparse_prefill_pipelined`` (plan chunk i+1 on a side stream
while chunk i attends).

On the H200 the CUDA planner takes 6-9% of the CUDA attention's time at 8-16 heads (BENCHMARKS.md,
"Planning plus attention"). That attention kernel holds every SM, so a planner beside it runs on the SMs
its last programs leave idle: planned ahead beside a whole call it adds 4% at 16 heads (7% planned first);
chunking one call costs the attention more than it hides there.

Groups are aligned to query 0 and planned independently, so the queries can be
cut into chunks of whole groups: the plan of a chunk equals the corresponding groups of the full plan
(tested), and each chunk's attention writes its rows of one preallocated output. On a CUDA device the
planner runs on a side stream one chunk ahead of the attention on the current stream; only the first
chunk's plan is exposed. On the CPU (Triton interpreter) the same steps run one after another.

What runs is decided as ``sparse_prefill`` decides it (``quilt_attn.dispatch``: backend resolved once per
call, plan settings, QUILT or query programs), from the settings, so no host sync: where a program holds
several queries (``h <= 32``) every chunk runs its plan (the CUDA kernel's plans keep private rows in the
tiles; an FP8 cache is expanded once per call); where one query fills a 64-row tile (``h > 32``) with
``fallback`` (and without ``importance_clip``) nothing is planned and all queries run query programs in one
launch. ``fallback="cost"`` (prebuilt ``plans`` only) applies the
measured tile-cost rule per chunk plan, reading its tile counts on the host.
"""
from __future__ import annotations

import torch

from . import dispatch
from ._checks import (
    canonical_indices,
    check_attn_sink,
    check_d_v,
    check_sm_scale,
    check_topk_length,
    indices_view,
    require_ndim,
    require_same_device,
    require_tensor,
)
from .api import BACKENDS, _check_kernel_inputs, _is_pow2, _kernels_can_run, empty_outputs
from .planner import Plan
from .planner import plan as make_plan
from .planner.membership import check_group_size

# One planning stream per device (the Triton planner's scratch table is kept per stream:
# planner/triton_plan.py, _workspace).
_PLAN_STREAMS: dict = {}


def chunk_bounds(s_q: int, chunk: int, group_size: int, first_chunk: int | None = None) -> list[tuple[int, int]]:
    """Query ranges ``[(q0, q1), ...]`` covering ``0 .. s_q``: ``first_chunk`` queries, then ``chunk`` each.

    Both sizes must be whole multiples of ``group_size`` so that every chunk starts on a group boundary
    (groups are aligned to query 0); the last chunk takes what is left (it may end in a partial group,
    padded by the planner as the unchunked plan pads it).
    """
    check_group_size(group_size)
    first = chunk if first_chunk is None else first_chunk
    for name, n in (("chunk", chunk), ("first_chunk", first)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1 or n % group_size:
            raise ValueError(f"{name} must be a positive multiple of group_size = {group_size} (chunks hold whole, "
                             f"query-0-aligned groups), got {n!r}")
    bounds, q0 = [], 0
    while q0 < s_q:
        q1 = min(s_q, q0 + (first if q0 == 0 else chunk))
        bounds.append((q0, q1))
        q0 = q1
    return bounds


def _group_size(h: int, group_size) -> int:
    """``group_size`` with ``sparse_prefill``'s default (the queries one program holds)."""
    from .ops.sparse_attention import default_group_size

    return default_group_size(h) if group_size is None else group_size


def plan_chunks(indices: torch.Tensor, h: int, *, s_kv: int, chunk: int = 4096, first_chunk: int | None = None,
                topk_length: torch.Tensor | None = None, group_size: int | None = None, tile: int = 64,
                clip_threshold: float = 0.5, importance_clip: bool = False, merge_level: int | None = None,
                split_private: bool = True) -> list[Plan]:
    """Plan ``indices`` chunk by chunk, on the current stream, for ``sparse_prefill_pipelined(plans=...)``.

    Parameters
    ----------
    indices : int32 ``[s_q, topk]`` (or ``[s_q, 1, topk]``).
    h : heads of the q the plans will serve (sets the default ``merge_level``, as in ``sparse_prefill``).
    s_kv, topk_length, group_size, tile, clip_threshold, importance_clip, merge_level, split_private :
        as in ``sparse_prefill``. chunk, first_chunk : see ``chunk_bounds``.

    Returns
    -------
    One ``Plan`` a chunk, for ``indices[q0:q1]`` of ``chunk_bounds(s_q, chunk, group_size, first_chunk)``;
    each equals the corresponding groups of the unchunked plan.
    """
    indices = indices_view(indices)  # chunks are slices of the caller's tensors: each plan's source
    s_q = indices.shape[0]
    check_topk_length(topk_length, s_q, indices.device)
    group_size = _group_size(h, group_size)
    pkw = dispatch.plan_settings(h, group_size=group_size, tile=tile, clip_threshold=clip_threshold,
                                 importance_clip=importance_clip, merge_level=merge_level, split_private=split_private)
    return [make_plan(indices[q0:q1], s_kv=s_kv, topk_length=None if topk_length is None else topk_length[q0:q1],
                      **pkw)
            for q0, q1 in chunk_bounds(s_q, chunk, group_size, first_chunk)]


def _plan_tensors(p: Plan):
    """Every tensor a plan holds, its cached work lists included (all read by the attention kernels)."""
    yield from p.tensors()
    for v in p._work.values():
        for t in v if isinstance(v, tuple) else (v,):
            if isinstance(t, torch.Tensor):
                yield t


def _attend(q, kv, sm_scale, d_v, out, max_logits, lse, *, plan, attn_sink, tuning):
    """One chunk's plan passes into the given output views (those of ``launch_sparse_attention``).

    ``launch_sparse_attention`` allocates its outputs; writing each chunk straight into its rows of one
    output saves concatenating them afterwards (a copy of ``out``: ~0.1 ms at 16384 x 16 x 512 bf16).
    The kernel addresses ``out`` by its strides and ``max_logits`` / ``lse`` as contiguous ``[s_q, h]``,
    which row slices of contiguous tensors are.
    """
    from .ops.sparse_attention import run_plan_passes

    run_plan_passes(q, kv, sm_scale, d_v, out, max_logits, lse, plan=plan, attn_sink=attn_sink, **tuning)


def _attend_cuda(q, kv, sm_scale, d_v, out, max_logits, lse, *, plan, attn_sink):
    """One chunk's CUDA attention into the given output views (the passes of ``launch_sparse_attention_cuda``).

    ``q [s, h, 576]``, dense ``kv [s_kv, 576]`` of q's dtype; ``out [s, h, 512]``, ``max_logits, lse [s, h]``
    row slices of the call's outputs (the kernel takes any strides for out's first two dimensions).
    """
    from .ops.cuda_backend import run_plan_passes_cuda

    run_plan_passes_cuda(q, kv, sm_scale, d_v, out, max_logits, lse, plan=plan, attn_sink=attn_sink)


def _default_plan_stream(device: torch.device):
    """A high-priority stream per device: its planner programs are dispatched ahead of the attention
    programs still waiting for an SM, so the next chunk's plan is ready early instead of queueing
    behind the whole attention grid."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _PLAN_STREAMS:
        _PLAN_STREAMS[key] = torch.cuda.Stream(device=device, priority=torch.cuda.Stream.priority_range()[1])
    return _PLAN_STREAMS[key]


def plan_ahead(indices: torch.Tensor, h: int, *, s_kv: int, topk_length: torch.Tensor | None = None,
               group_size: int | None = None, tile: int = 64, clip_threshold: float = 0.5,
               importance_clip: bool = False, merge_level: int | None = None, split_private: bool | None = None,
               backend: str = "auto", plan_stream=None) -> Plan:
    """Plan ``indices`` on a side stream, beside the work the current stream runs next.

    For indices known before an attention that precedes theirs (the other micro-batch's, where an engine
    interleaves two; the next request's): call this, then launch that attention. The planner starts once
    the current stream's work so far is done (the indices are written) and runs on the SMs that the
    attention leaves idle (H200, glm53-like, 16 heads, s_q 16384: attention + planning 1.04x the attention
    alone, against 1.07x planned first; 8 heads: 1.06-1.08x against 1.11x). The plan is used like any other:
    its first reader on a stream (``sparse_prefill(plan=...)``, ``Plan.stats``, ...) makes that stream wait
    for the planner (``Plan.wait``), so no result depends on the timing. No host sync.

    Parameters
    ----------
    indices : int32 ``[s_q, topk]`` (or ``[s_q, 1, topk]``). On the CPU it is planned at once.
    h : heads of the q the plan will serve (sets ``sparse_prefill``'s defaults).
    s_kv, topk_length, group_size, tile, clip_threshold, importance_clip, merge_level : as in
        ``sparse_prefill``.
    split_private : as in ``sparse_prefill``; None: as ``sparse_prefill`` plans for ``backend``.
    backend : the attention backend the plan is for (``"cuda"``, ``"triton"``, or ``"auto"``: CUDA where
        the CUDA backend can run on the indices' device): the CUDA kernel runs plans without split private
        rows (except under ``importance_clip``), the Triton kernel with them.
    plan_stream : the stream to plan on (default: the device's high-priority planning stream).

    Returns
    -------
    A ``Plan`` equal to ``plan_chunks(indices, h, chunk=s_q, ...)[0]`` with the same settings.
    """
    from .ops import cuda_backend

    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(h, int) or isinstance(h, bool) or h < 1:
        raise ValueError(f"h must be a positive int, got {h!r}")
    indices = indices_view(indices)  # the caller's tensors go to the planner: the plan's source
    check_topk_length(topk_length, indices.shape[0], indices.device)
    which = None  # split_private given: as given
    if split_private is None:
        cuda = backend == "cuda" or (backend == "auto" and cuda_backend.unavailable_reason(indices.device) is None)
        which, split_private = ("cuda" if cuda else "triton"), True
    pkw = dispatch.plan_settings(h, which, group_size=_group_size(h, group_size), tile=tile,
                                 clip_threshold=clip_threshold, importance_clip=importance_clip,
                                 merge_level=merge_level, split_private=split_private)
    if indices.device.type != "cuda":
        return make_plan(indices, s_kv=s_kv, topk_length=topk_length, **pkw)
    main = torch.cuda.current_stream(indices.device)
    side = plan_stream if plan_stream is not None else _default_plan_stream(indices.device)
    side.wait_stream(main)  # the indices (and topk_length) are written by work already on the current stream
    with torch.cuda.stream(side):
        p = make_plan(indices, s_kv=s_kv, topk_length=topk_length, **pkw)
        ready = torch.cuda.Event()
        ready.record(side)
    for t in (indices, topk_length):  # read on the side stream: keep their memory until it is done
        if t is not None:
            t.record_stream(side)
    p._ready = ready
    return p


def sparse_prefill_pipelined(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float | None = None,
    *,
    chunk: int = 4096,
    first_chunk: int | None = None,
    plans: list[Plan] | None = None,
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
    plan_stream=None,
    backend: str = "auto",
):
    """QUILT sparse prefill in chunks of queries, each chunk planned while the previous one attends.

    Same semantics, arguments and defaults as ``sparse_prefill(method="quilt")``; the outputs equal its
    outputs (same backend) bit for bit (with ``fallback="cost"``, where every chunk plan takes the decision
    the unchunked plan takes).

    Parameters
    ----------
    q : ``[s_q, h, d_qk]`` bf16 / fp16. kv : ``[s_kv, d_qk]`` (or ``[s_kv, 1, d_qk]``) or the FP8 cache.
    indices : int32 ``[s_q, topk]`` (or ``[s_q, 1, topk]``).
    sm_scale : softmax scale, default ``d_qk ** -0.5``.
    chunk : queries a chunk; a positive multiple of ``group_size`` (chunks hold whole groups, aligned to
        query 0, so that chunk plans are slices of the full plan). ``s_q`` need not be a multiple.
    first_chunk : queries of the first chunk (default ``chunk``). Its plan is the one that cannot be
        hidden; a smaller first chunk shortens that exposed step.
    plans : prebuilt chunk plans (``plan_chunks``); then nothing is planned and the chunks run one after
        another on the current stream. Their ``s_q`` must add up to ``s_q``. For the CUDA backend build
        them with ``split_private=False`` (as it plans); a split plan runs as ``sparse_prefill`` runs it.
    group_size, tile, clip_threshold, importance_clip, merge_level, split_private : planner settings,
        as in ``sparse_prefill`` (``group_size`` and ``merge_level`` default ``64 // h`` queries, at most 8;
        the CUDA backend plans with ``split_private=False`` whatever is given).
    fallback : as in ``sparse_prefill``: True: at ``h > 32`` nothing is planned and all queries run query
        programs, below every chunk runs its plan; False: plans always run; ``"cost"`` (with ``plans``
        only): the measured tile-cost rule per chunk plan (a host read of its tile counts).
    d_v, attn_sink ``[h]``, topk_length ``[s_q]``, dv_split, num_warps, num_stages, fp8_expand : as in
        ``sparse_prefill`` (an FP8 cache, when expanded, is expanded once for all chunks).
    plan_stream : CUDA stream for the planner (default: one high-priority stream per device).
    backend : ``"auto"``, ``"triton"`` or ``"cuda"``, as in ``sparse_prefill`` (``dispatch.choose_backend``).

    Returns
    -------
    out ``[s_q, h, d_v]`` (q's dtype), max_logits and lse ``[s_q, h]`` float32 (natural log), as
    ``sparse_prefill``.
    """
    from .ops import cuda_backend
    from .ops.sparse_attention import _launch, program_shape

    require_tensor("q", q)
    require_ndim("q", q, (3,), "[s_q, h, d_qk]")
    require_tensor("kv", kv)
    require_same_device("kv", kv, "q", q)
    s_q, h, d_qk = q.shape
    group_size = _group_size(h, group_size)
    indices_arg, topk_length_arg = indices_view(indices, s_q), topk_length  # what prebuilt plans must come from
    indices = canonical_indices(indices, s_q)
    require_same_device("indices", indices, "q", q)
    topk_length = check_topk_length(topk_length, s_q, q.device, indices.shape[1])
    attn_sink = check_attn_sink(attn_sink, h, q.device)
    d_v = check_d_v(d_v, d_qk)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    kv = _check_kernel_inputs(q, kv, d_v)
    knobs = dispatch.triton_knobs(dv_split, num_warps, num_stages, fp8_expand)
    fallback = dispatch.check_fallback(fallback)
    if fallback == "cost" and plans is None:
        raise ValueError("fallback='cost' reads the tile counts of prebuilt plans (a host sync each): pass plans= "
                         "(plan_chunks), or use fallback=True")
    # prebuilt plans: the first one's tile decides, as sparse_prefill's plan does (all are checked below)
    first_plan = plans[0] if plans and isinstance(plans[0], Plan) else None
    auto = backend == "auto"
    backend = dispatch.choose_backend(backend, q, kv, d_v, first_plan, tile=tile, triton_knobs=knobs)
    cuda = backend == "cuda"
    if not cuda and not _kernels_can_run(q.device):
        raise ValueError(f"sparse_prefill_pipelined runs Triton kernels: q must be on a CUDA device "
                         f"(or set TRITON_INTERPRET=1 to run them on the CPU); got {q.device}")
    if dv_split not in (1, 2) or (dv_split == 2 and (d_v // 2 < 16 or (kv.dtype == torch.uint8 and d_v // 2 % 128))):
        raise ValueError(f"dv_split must be 1 or 2 (2 needs d_v / 2 >= 16), got {dv_split}")
    sm_scale = check_sm_scale(sm_scale, d_qk)
    s_kv = kv.shape[0]
    tuning = dict(dv_split=dv_split, num_warps=num_warps, num_stages=num_stages)

    # kv, and the plan settings and decision, as sparse_prefill makes them (an FP8 cache expanded once)
    kv = dispatch.kernel_kv(q, kv, backend, indices.shape[1], fp8_expand)
    whole = dispatch.decide(backend, "quilt", h, group_size=group_size, fallback=fallback,
                            importance_clip=importance_clip, auto=auto) if plans is None else None
    pkw = dispatch.plan_settings(h, backend, group_size=group_size, tile=tile, clip_threshold=clip_threshold,
                                 importance_clip=importance_clip, merge_level=merge_level,
                                 split_private=split_private) if whole is not None and whole.quilt else None
    if plans is None:
        bounds = chunk_bounds(s_q, chunk, group_size, first_chunk)
    else:
        bounds, q0 = [], 0
        for i, p in enumerate(plans):
            if not isinstance(p, Plan):
                raise TypeError(f"plans[{i}] must be a quilt_attn.Plan, got {type(p).__name__}")
            if p.topk != indices.shape[1] or (p.s_kv is not None and p.s_kv != s_kv) or p.device != q.device:
                raise ValueError(f"plans[{i}] was built for topk={p.topk}, s_kv={p.s_kv} on {p.device}; got "
                                 f"topk={indices.shape[1]}, s_kv={s_kv} on {q.device}")
            if p.tile < 16 or not _is_pow2(p.tile):
                raise ValueError(f"the kernel needs a plan tile that is a power of two >= 16, got {p.tile}")
            if cuda and p.tile != cuda_backend.TILE:
                raise ValueError(f"the CUDA backend runs plans with tile = {cuda_backend.TILE}, got plans[{i}].tile "
                                 f"= {p.tile}")
            q1 = q0 + p.s_q
            why = None if p.source is None or q1 > s_q else p.source.mismatch(
                indices_arg[q0:q1], s_kv, None if topk_length_arg is None else topk_length_arg[q0:q1])
            if why is not None:
                raise ValueError(f"plans[{i}] does not fit queries {q0}..{q1}: {why}")
            bounds.append((q0, q1))
            q0 = q1
        if q0 != s_q:
            raise ValueError(f"plans cover {q0} queries but q has s_q = {s_q}")

    if s_kv == 0:  # no kv row: every index is invalid, every row empty (as sparse_prefill)
        return empty_outputs(q, d_v)
    out = torch.empty(s_q, h, d_v, dtype=q.dtype, device=q.device)
    max_logits = torch.empty(s_q, h, dtype=torch.float32, device=q.device)
    lse = torch.empty(s_q, h, dtype=torch.float32, device=q.device)
    if s_q == 0:
        return out, max_logits, lse

    def query_programs(kernel, sl):
        """Query programs over the queries ``sl`` on ``kernel`` (``"cuda"`` or ``"triton"``)."""
        qpar = dict(indices=indices[sl].contiguous(), topk_length=None if topk_length is None else topk_length[sl],
                    attn_sink=attn_sink)
        if kernel == "cuda":
            cuda_backend.launch(q[sl], kv, sm_scale, out[sl], max_logits[sl], lse[sl], **qpar)
        else:
            _launch(q[sl], kv, sm_scale, d_v, out[sl], max_logits[sl], lse[sl], **qpar, **tuning)

    if whole is not None and not whole.quilt:
        # h > 32: one query already fills a 64-row tile (sparse_prefill skips planning here too)
        query_programs(whole.kernel, slice(0, s_q))
        dispatch.natural_log_stats(max_logits, lse)
        return out, max_logits, lse

    def plan_chunk(i):
        """Chunk i's plan, what runs it, and its work list built here (not on the attention's stream)."""
        q0, q1 = bounds[i]
        if plans is not None:
            p = plans[i].wait()  # (a plan_ahead plan: this stream waits for its planner)
        else:
            p = make_plan(indices[q0:q1], s_kv=s_kv,
                          topk_length=None if topk_length is None else topk_length[q0:q1], **pkw)
        # as sparse_prefill decides for a given plan (fallback="cost": a host read, on this stream only)
        run = dispatch.decide(backend, "quilt", h, plan=p, fallback=fallback, auto=auto)
        if run.quilt:
            qp = program_shape(h, p.group_size)[0]
            p.work_list(qp)
            if run.kernel == "cuda":
                p.program_order(qp)
        return p, run

    def attend(i, p, run):
        q0, q1 = bounds[i]
        if not run.quilt:  # a prebuilt plan at h > 32, or one the cost rule turns down
            query_programs(run.kernel, slice(q0, q1))
        elif run.kernel == "cuda":
            _attend_cuda(q[q0:q1], kv, sm_scale, d_v, out[q0:q1], max_logits[q0:q1], lse[q0:q1], plan=p,
                         attn_sink=attn_sink)
        else:
            _attend(q[q0:q1], kv, sm_scale, d_v, out[q0:q1], max_logits[q0:q1], lse[q0:q1], plan=p,
                    attn_sink=attn_sink, tuning=tuning)

    if q.device.type != "cuda" or plans is not None:  # nothing to overlap: one chunk after another
        for i in range(len(bounds)):
            attend(i, *plan_chunk(i))
        dispatch.natural_log_stats(max_logits, lse)
        return out, max_logits, lse

    main = torch.cuda.current_stream(q.device)
    side = plan_stream if plan_stream is not None else _default_plan_stream(q.device)
    side.wait_stream(main)  # indices / topk_length may still be being written on the current stream

    def plan_on_side(i):
        with torch.cuda.stream(side):
            p, run = plan_chunk(i)
            ready = torch.cuda.Event()
            ready.record(side)
        return p, run, ready

    nxt = plan_on_side(0)
    for i in range(len(bounds)):
        p, run, ready = nxt
        main.wait_event(ready)
        attend(i, p, run)
        # the plan's tensors were allocated on the side stream: without this the allocator could hand
        # them to the next chunk's plan as soon as this reference goes, while this attention still reads them
        for t in _plan_tensors(p):
            t.record_stream(main)
        if i + 1 < len(bounds):
            nxt = plan_on_side(i + 1)  # enqueued behind attention i, so the host blocks (if at all) while it runs
    main.wait_stream(side)  # work after this call (and the planner's scratch table) stays ordered after planning
    dispatch.natural_log_stats(max_logits, lse)
    return out, max_logits, lse
