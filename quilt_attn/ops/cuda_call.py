"""The default CUDA call in a few host steps: a call that plans its own indices over a dense kv.

This is how engines call (new indices every layer, default arguments), and where a short prefill's GPU work is
small enough for the host to bound the call: the general path (``planner.plan``, then
``cuda_backend.run_plan_passes_cuda``) builds a ``Plan`` object, checks and derives the same shape facts at each
of its layers, and spends a few hundred microseconds of host time a call. Here everything that depends on the
call's shapes alone (the plan's layout in one workspace, launch shapes, work counts) is worked out once a shape
(``_layout``), and a call allocates four buffers and launches the same kernels with the same parameter blocks
(``cuda_backend.plan_block``, ``attention_block``: the one place each block is filled):

1. the planner into the workspace (no ``Plan``: the plan is read by this call's kernels only);
2. the order kernel (its programs by descending tile count);
3. the attention over the plan's tiles, queueing every query whose output holds a NaN;
4. the repair pass over the call's indices for the queued queries (``sparse_attention.run_plan_passes``);

then the statistics in natural log (``dispatch.natural_log_stats``). Outputs are bit-for-bit the general
path's (a GPU test compares them). ``run`` returns None for any call outside this shape, which then takes the
general path.
"""
from __future__ import annotations

import functools

import torch

from ..dispatch import natural_log_stats
from ..planner.buffers import buffer_layout, check_workspace
from . import cuda_backend as cb
from .shapes import program_shape

ENABLED = True  # False (measurement, tests): every call takes the general path


@functools.lru_cache(maxsize=64)
def _layout(s_q: int, h: int, topk: int, s_kv: int, group_size: int, merge_level: int, tile: int):
    """What a call of these shapes needs beyond its tensors' addresses, or None where the general path runs it:
    (byte offset of each plan output in the workspace, the plan's bytes (the program order follows them),
    n_groups, tile capacity)."""
    qp = program_shape(h, group_size)[0]
    if tile != cb.TILE or qp < group_size or cb.plan_unsupported_reason(group_size, topk, tile) is not None:
        return None
    shapes, offsets, nbytes = buffer_layout(s_q, topk, group_size, merge_level, tile, False, s_kv)
    n_groups, cap = shapes["tile_kv"][0], shapes["tile_kv"][1]
    if cap > cb.PROGRAM_ORDER_MAX_TILES:
        return None
    return tuple(offsets.items()), nbytes, n_groups, cap


def run(q, kv, indices, topk_length, attn_sink, sm_scale: float, pkw: dict, workspace=None):
    """``(out, max_logits, lse)`` of ``sparse_prefill`` for checked arguments (``indices`` contiguous int32,
    ``topk_length`` / ``attn_sink`` checked or None) and the plan settings ``pkw`` the call would plan with
    (``dispatch.plan_settings``), or None when the call is not of this path's shape. ``workspace``: the
    caller's (``sparse_prefill``'s), which the plan is written into as the general path carves it."""
    s_q, h, _ = q.shape
    s_kv, topk = kv.shape[0], indices.shape[1]
    if (not ENABLED or q.device.type != "cuda" or not cb.CHAIN_LAUNCHES or s_q == 0 or not sm_scale > 0
            or kv.dtype != q.dtype or pkw["split_private"] or pkw["importance_clip"] or not cb.copies_16_bytes(q)
            or not cb.copies_16_bytes(kv)):
        return None
    G, M, T = pkw["group_size"], pkw["merge_level"], pkw["tile"]
    layout = _layout(s_q, h, topk, s_kv, G, M, T)
    if layout is None:
        return None
    offsets, nbytes, n_groups, cap = layout
    dev = q.device
    from .sparse_attention import alloc_outputs, repair_buffer, spare_address  # (a Triton kernel module)

    if workspace is None:  # the plan, then the program order (16-byte aligned: nbytes is)
        work = torch.empty(nbytes + 4 * n_groups, dtype=torch.uint8, device=dev)
        base = work.data_ptr()
        order = base + nbytes
    else:
        check_workspace(workspace, nbytes, dev)
        work = torch.empty(n_groups, dtype=torch.int32, device=dev)
        base, order = workspace.data_ptr(), work.data_ptr()
    out, max_logits, lse = alloc_outputs(q, cb.D_V)
    queue = repair_buffer(s_q, dev)
    stream = cb._raw_stream(dev)
    qa = queue.data_ptr()
    at = {name: base + off for name, off in offsets}
    lengths = None if topk_length is None else topk_length.data_ptr()
    cb.submit_plan(cb.plan_block(indices.data_ptr(), indices.stride(0), lengths, s_q, topk, s_kv, n_groups, cap,
                                 G, M, T, float(pkw["clip_threshold"]) * T, False, False, at),
                   stream)
    cb.submit_order(at["group_tiles"], n_groups, cap, order, stream)
    sink = None if attn_sink is None else attn_sink.data_ptr()
    code = cb.kv_code(q, kv)
    tiles = cb.attention_block(q, kv, out, max_logits, lse, sm_scale, G, sink=sink, tile_kv=at["tile_kv"],
                               tile_mask=at.get("tile_mask"), prog_ntiles=at["group_tiles"], prog_order=order,
                               prog_cap=cap, n_groups=n_groups, topk=topk, counter=spare_address(queue, 0),
                               counter_zeroed=True, repair=qa)
    cb.submit_attention(tiles, code, False, False, dev)
    fix = cb.attention_block(q, kv, out, max_logits, lse, sm_scale, 1, sink=sink, indices=indices.data_ptr(),
                             stride_idx=indices.stride(0), topk=topk, topk_length=lengths,
                             counter=spare_address(queue, 1), counter_zeroed=True, queue=qa)
    cb.submit_attention(fix, code, False, False, dev)
    # the buffers outlive their use: the caching allocator hands their memory out again only to work queued
    # after these launches on this stream
    return (out, *natural_log_stats(max_logits, lse))
