"""The planner overlapped with attention: ``plan_ahead`` plans indices on a side stream, beside the attention the
current stream runs next.

On the H200 the CUDA planner takes 6-9% of the CUDA attention's time at 8-16 heads (BENCHMARKS.md,
"Planning plus attention"). That attention kernel holds every SM, so a planner beside it runs on the SMs
its last programs leave idle: planned ahead beside a whole call it adds 4% at 16 heads (7% planned first).
Chunking one call (plan chunk i+1 while chunk i attends) costs the attention more than it hides there, so the
library has no chunked call.

The plan's settings are those ``sparse_prefill`` would build for the backend (``quilt_attn.dispatch``), so a
plan made ahead is the plan the call would make itself; no host sync.
"""
from __future__ import annotations

import torch

from . import dispatch
from ._checks import check_topk_length, indices_view
from .dispatch import BACKENDS, PlanSettings
from .ops import cuda_backend
from .planner import Plan
from .planner import plan as make_plan

# One planning stream per device (the Triton planner's scratch table is kept per stream:
# planner/triton_plan.py, _workspace).
_PLAN_STREAMS: dict = {}


def _default_plan_stream(device: torch.device):
    """A high-priority stream per device: its planner programs are dispatched ahead of the attention
    programs still waiting for an SM, so the plan is ready early instead of queueing behind the whole
    attention grid."""
    key = device.index if device.index is not None else torch.cuda.current_device()
    if key not in _PLAN_STREAMS:
        _PLAN_STREAMS[key] = torch.cuda.Stream(device=device, priority=torch.cuda.Stream.priority_range()[1])
    return _PLAN_STREAMS[key]


def plan_ahead(indices: torch.Tensor, h: int, *, s_kv: int, topk_length: torch.Tensor | None = None,
               settings: PlanSettings | None = None, backend: str = "auto", plan_stream=None) -> Plan:
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
    h : heads of the q the plan will serve (sets the defaults of ``settings``, as in ``sparse_prefill``).
    s_kv, topk_length : as in ``sparse_prefill``.
    settings : ``quilt_attn.PlanSettings`` of the call the plan is for (None: the defaults).
    backend : the attention backend the plan is for (``"cuda"``, ``"triton"``, or ``"auto"``: CUDA where
        the CUDA backend can run on the indices' device): the CUDA kernel runs plans without split private
        rows (except under ``importance_clip``), the Triton kernel with them (``dispatch.plan_settings``).
    plan_stream : the stream to plan on (default: the device's high-priority planning stream).

    Returns
    -------
    A ``Plan`` equal to the one ``sparse_prefill(..., settings=settings, backend=backend)`` builds.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not isinstance(h, int) or isinstance(h, bool) or h < 1:
        raise ValueError(f"h must be a positive int, got {h!r}")
    indices = indices_view(indices)  # the caller's tensors go to the planner: the plan's source
    check_topk_length(topk_length, indices.shape[0], indices.device)
    cuda = backend == "cuda" or (backend == "auto" and cuda_backend.unavailable_reason(indices.device) is None)
    pkw = dispatch.plan_settings(h, "cuda" if cuda else "triton", settings)
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
