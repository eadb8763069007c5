"""Property-based fuzzing of every public entry point (hypothesis; bounded, derandomized).

Every case either raises a ``ValueError`` / ``TypeError`` whose message names the argument, or agrees
with ``expected`` -- an independent float64 computation written here from the raw arguments (Python
loops over each query's list, each occurrence of a row counted, elementwise IEEE products; not the
package's reference) -- within ``conftest.TOLERANCES``. Covered: ``sparse_prefill`` (``quilt``,
``query_parallel``, ``reference``; Triton), ``compat.flash_mla_sparse_fwd``, ``plan``, ``member_masks``,
``quantize_fp8`` / ``dequantize_fp8``, ``load_indices`` and ``sparse_prefill_reference``; on a GPU
(marker ``gpu``) also the CUDA backend at the production shape (bf16, dense and FP8, the FP8 pool path
included).

Drawn: head counts 1..128 (s_q tiny at high h), small d_v / d_rope (and the production 512 / 64 for the
FP8 cache), s_kv from 0, views with strides (q heads, kv rows and columns, column-major or 3-D
indices), invalid indices (-1, >= s_kv, 2**24 - 1, int32 extremes), rows repeated inside one list,
neighbours that share rows (QUILT tiles), topk_length (int32 / int64, negative, beyond topk and
int32), attn_sink (with infinities), sm_scale, planner settings, a prebuilt plan, and non-finite q / kv:
in rows no query selects (must reach nothing), in q, and in selected kv rows (which must reach only the
queries that select them, QUILT's tile partners included: the repair pass).

Outputs are NaN-poisoned (``torch.empty``) so that an unwritten element fails. ``QUILT_FUZZ_EXAMPLES=N``
runs N examples per property (e.g. a device run: ``QUILT_FUZZ_EXAMPLES=400 python -m pytest
tests/test_fuzz.py``); the default keeps the file well under a minute on one CPU core with
``TRITON_INTERPRET=1``.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from conftest import FP8_MODE_TOL, KERNEL_DEVICE, KERNELS_CAN_RUN, TOLERANCES, prefill_kw, rel_l2
from quilt_attn import dequantize_fp8, plan as make_plan, quantize_fp8, sparse_prefill, sparse_prefill_reference
from quilt_attn.compat import flash_mla_sparse_fwd
from quilt_attn.fp8_mode import sparse_prefill_fp8_kernel_reference
from quilt_attn.planner import member_masks
from quilt_attn.workloads import load_indices, save_indices

_N = int(os.environ.get("QUILT_FUZZ_EXAMPLES", "0"))


def fuzz(default: int):
    """Bounded hypothesis settings: ``default`` examples (``QUILT_FUZZ_EXAMPLES`` overrides), fixed sequence."""
    return settings(max_examples=_N or default, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much])


kernels = pytest.mark.skipif(not KERNELS_CAN_RUN, reason="kernels need CUDA or TRITON_INTERPRET=1")


def in_package_units(x: torch.Tensor) -> torch.Tensor:
    """The natural-log statistics of ``expected`` in the package's unit: natural log (FlashMLA's current
    convention). Were the package base 2, this one line would be ``return x * math.log2(math.e)``."""
    return x


INVALID = (-1, -7, 2**31 - 1, -(2**31), 2**24 - 1, 2**24)  # 2**24 - 1: the packed format's padding row field
NONFINITE = (float("inf"), float("-inf"), float("nan"))


# ============================================================================ the float64 computation
def expected(q, kv, indices, sm_scale, d_v, topk_length=None, attn_sink=None):
    """Sparse attention of the definition in float64 from the raw arguments (any layout, CPU).

    ``q [s_q, h, d_qk]``; ``kv [s_kv, d_qk]`` dense (values as the kernels read them); ``indices
    [s_q, topk]`` (or ``[s_q, 1, topk]``); ``topk_length`` any integer dtype. A query keeps the entries
    ``j < clamp(topk_length, 0, topk)`` with ``0 <= row < s_kv``, each occurrence once. Returns ``out [s_q,
    h, d_v]``, ``max_logits``, ``lse`` (natural log) float64: empty (no valid entry, or every valid logit
    -inf) -> 0 / -inf / +inf; otherwise IEEE arithmetic of ``lse = m + log sum exp(P - m)``.
    """
    q = q.detach().cpu().double()
    kv = kv.detach().cpu().double()
    idx = indices.detach().cpu()
    if idx.dim() == 3:
        idx = idx[:, 0]
    s_q, h, d_qk = q.shape
    s_kv, topk = kv.shape[0], idx.shape[1]
    scale = d_qk**-0.5 if sm_scale is None else float(sm_scale)
    out = torch.zeros(s_q, h, d_v, dtype=torch.float64)
    ml = torch.full((s_q, h), -math.inf, dtype=torch.float64)
    lse = torch.full((s_q, h), math.inf, dtype=torch.float64)
    rows_of = idx.tolist()
    lengths = None if topk_length is None else [int(x) for x in topk_length.detach().cpu().tolist()]
    for i in range(s_q):
        n = topk if lengths is None else max(0, min(lengths[i], topk))
        rows = [r for r in rows_of[i][:n] if 0 <= r < s_kv]
        if not rows:
            continue
        k = kv[rows]  # [n, d_qk]
        logits = (q[i][:, None, :] * k[None, :, :]).sum(-1) * scale  # [h, n], elementwise products
        m = logits.amax(-1)  # NaN if any logit is NaN
        empty = m == -math.inf
        m_s = torch.where(empty, 0.0, m)
        l_e = m_s + torch.log(torch.exp(logits - m_s[:, None]).sum(-1))
        w = torch.exp(logits - torch.where(empty, 0.0, l_e)[:, None])
        o = (w[:, :, None] * k[None, :, :d_v]).sum(1)  # IEEE: 0 * inf = NaN
        if attn_sink is not None:
            sink = attn_sink.detach().cpu().double()
            o = o * (1.0 / (1.0 + torch.exp(sink - l_e)))[:, None]
        out[i] = torch.where(empty[:, None], 0.0, o)
        ml[i] = m
        lse[i] = torch.where(empty, math.inf, l_e)
    return out, ml, lse


def assert_agrees(got, want, dtype, what="", bounds=None):
    """``got`` = the package's ``(out, max_logits, lse)``, ``want`` = ``expected(...)``.

    out: the same NaN elements, the rest finite and within ``TOLERANCES[dtype]`` (elementwise and rel-L2);
    lse: the same NaN / infinities, finite entries within ``stat_atol``; max_logits the same, except where
    the expected max is NaN (a NaN logit): a GPU max may skip the NaN, any value passes there.
    ``bounds = (out_row, stat)``, float64 ``[s_q, h]`` each, replaces the tolerances' values (not the
    patterns): a (query, head) row's out within ``out_row`` in L2, its lse and max_logits within ``stat``.
    """
    tol = TOLERANCES[dtype]
    out, ml, lse = (t.detach().cpu() for t in got)
    w_out, w_ml, w_lse = want
    tag = f"[{what}] "
    assert out.shape == w_out.shape and ml.shape == w_ml.shape == lse.shape, tag + "shapes"
    assert ml.dtype == lse.dtype == torch.float32, tag + "stat dtypes"
    o = out.double()
    nan_w = torch.isnan(w_out)
    bad = torch.isnan(o) != nan_w
    assert not bad.any(), (f"{tag}out NaN pattern differs at {int(bad.sum())} elements, first "
                           f"{tuple(torch.nonzero(bad)[0].tolist())}: got {float(o[bad][0])}, "
                           f"expected {float(w_out[bad][0])}")
    fin = ~nan_w
    assert torch.equal(torch.isinf(o[fin]), torch.isinf(w_out[fin])), tag + "out infinities differ"
    if bounds is not None:
        good = torch.isfinite(w_out).all(-1)  # rows of finite values
        d = torch.linalg.vector_norm((o - w_out).masked_fill(~good[..., None], 0.0), dim=-1)
        over = good & (d > bounds[0])
        assert not over.any(), (f"{tag}out: {int(over.sum())} (query, head) rows out of their bound, first "
                                f"{tuple(torch.nonzero(over)[0].tolist())}: L2 err {float(d[over][0]):.3e} > "
                                f"{float(bounds[0][over][0]):.3e}")
    else:
        of, wf = o[fin & torch.isfinite(w_out)], w_out[fin & torch.isfinite(w_out)]
        err = (of - wf).abs()
        over = err > tol.atol + tol.rtol * wf.abs()
        assert not over.any(), f"{tag}out: {int(over.sum())} elements out of tolerance, max err {float(err.max()):.3e}"
        # rel-L2 where the output is not all inside the elementwise atol of 0 (there it means nothing: an output
        # of ~1e-17 in float64 is 0 in fp16)
        if of.numel() and float(torch.linalg.vector_norm(wf)) > tol.atol * math.sqrt(wf.numel()):
            assert rel_l2(of, wf) <= tol.rel_l2, f"{tag}out rel-L2 {rel_l2(of, wf):.3e}"
    for name, t, r, nan_free in (("lse", lse, w_lse, False), ("max_logits", ml, w_ml, True)):
        t, r = t.double(), in_package_units(r)
        bound = torch.full_like(r, tol.stat_atol) if bounds is None else bounds[1]
        rn = torch.isnan(r)
        if nan_free:  # a NaN logit: the kernel's max may skip it
            t, r, bound = t[~rn], r[~rn], bound[~rn]
        else:
            assert torch.equal(torch.isnan(t), rn), f"{tag}{name}: NaN pattern differs"
            t, r, bound = t[~rn], r[~rn], bound[~rn]
        assert torch.equal(torch.isposinf(t), torch.isposinf(r)), f"{tag}{name}: +inf differs"
        assert torch.equal(torch.isneginf(t), torch.isneginf(r)), f"{tag}{name}: -inf differs"
        f = torch.isfinite(r)
        if f.any():
            d = (t[f] - r[f]).abs()
            assert (d <= bound[f]).all(), (f"{tag}{name}: max abs err {float(d.max()):.3e} (bound "
                                           f"{float(bound[f][d.argmax()]):.3e})")


def fp8_mode_bounds(q, cache, idx2d, topk_length, sm_scale) -> tuple:
    """``assert_agrees``' bounds for the FP8 mode's kernel against its emulation on inputs of any size and
    scale (``FP8_MODE_TOL`` holds on whole tensors of realistic size only). The kernel's FP8 adder keeps ~14
    bits where the emulation sums exactly (truncating, over 18 chunks of K = 32), so a logit may move by
    ``2**-8`` of its sum of absolute products (here the largest over the selected rows), on top of
    ``FP8_MODE_TOL.stat_atol``: that bounds lse and max_logits. Weights then move by a factor within ``exp(+-2 stat)``, and such a move can flip one e4m3
    rounding of a weight of P by one step (``2**-3`` of it); the weights sum to 1 within ``2**-4``. So a row's
    out moves by at most ``(2**-3 * (1 + 2**-4) + 2 (exp(2 stat) - 1) + 2**-7)`` times the largest selected
    value row (L2; ``2**-7``: the bf16 store)."""
    q = q.detach().cpu().double().abs()
    tl = None if topk_length is None else topk_length.cpu()
    rows = sorted(selected_rows(idx2d, cache.shape[0], tl))
    k = decode_fp8(cache.cpu()[rows], torch.float32).abs() if rows else torch.zeros(1, q.shape[2], dtype=torch.float64)
    scale = abs(q.shape[2] ** -0.5 if sm_scale is None else float(sm_scale))
    sums = torch.nan_to_num(torch.einsum("shd,rd->shr", q, k).amax(-1), nan=math.inf)
    stat = FP8_MODE_TOL.stat_atol + 2.0**-8 * scale * sums
    vmax = float(torch.nan_to_num(torch.linalg.vector_norm(k[:, :512], dim=-1), nan=math.inf).max())
    out_row = (2.0**-3 * (1 + 2.0**-4) + 2 * torch.expm1(2 * stat) + 2.0**-7) * vmax
    return out_row, stat


def decode_fp8(cache: torch.Tensor, dtype) -> torch.Tensor:
    """The 656-byte layout decoded here (512 e4m3 | 4 float32 scales | 64 bf16 rope), as the kernels read
    it: each value rounded to q's ``dtype``."""
    c = cache.detach().cpu().contiguous()
    vals = c[:, :512].contiguous().view(torch.float8_e4m3fn).double().view(-1, 4, 128)
    scales = c[:, 512:528].contiguous().view(torch.float32).double()
    rope = c[:, 528:].contiguous().view(torch.bfloat16).double()
    return torch.cat([(vals * scales[..., None]).view(-1, 512), rope], 1).to(dtype).double()


def raises_named(exc, needle, fn):
    with pytest.raises(exc) as err:
        fn()
    assert needle in str(err.value), f"{exc.__name__} without {needle!r}: {err.value}"


# ============================================================================ inputs
def make_indices(g: torch.Generator, s_q, s_kv, topk, p_invalid, p_repeat, share) -> torch.Tensor:
    """int32 ``[s_q, topk]``: valid rows (neighbours in groups of 8 drawing from one small pool when
    ``share``), invalid entries with probability ``p_invalid``, repeats of an earlier entry with ``p_repeat``."""
    if s_kv > 0:
        if share:
            pools = torch.randint(0, s_kv, (-(-max(s_q, 1) // 8), max(2, topk + topk // 4)), generator=g)
            pick = torch.randint(0, pools.shape[1], (s_q, topk), generator=g)
            idx = torch.gather(pools.repeat_interleave(8, 0)[:s_q], 1, pick)
        else:
            idx = torch.randint(0, s_kv, (s_q, topk), generator=g)
    else:
        idx = torch.full((s_q, topk), -1, dtype=torch.int64)
    bad = torch.rand(s_q, topk, generator=g) < p_invalid
    choice = torch.tensor(INVALID + (s_kv, s_kv + 3), dtype=torch.int64)
    idx = torch.where(bad, choice[torch.randint(0, len(choice), (s_q, topk), generator=g)], idx)
    if topk > 1 and p_repeat:
        rep = torch.rand(s_q, topk, generator=g) < p_repeat
        rep[:, 0] = False
        src = (torch.rand(s_q, topk, generator=g) * torch.arange(topk)).long()  # an earlier position
        idx = torch.where(rep, torch.gather(idx, 1, src), idx)
    return idx.to(torch.int32)


def selected_rows(idx: torch.Tensor, s_kv: int, topk_length) -> set:
    """Rows some valid entry (inside topk_length) selects."""
    topk = idx.shape[1]
    n = [topk] * idx.shape[0] if topk_length is None else [max(0, min(int(x), topk)) for x in topk_length.tolist()]
    return {r for i, row in enumerate(idx.tolist()) for r in row[: n[i]] if 0 <= r < s_kv}


def layout(x: torch.Tensor, how: str) -> torch.Tensor:
    """The same values as a view with other strides."""
    if how == "heads_strided":  # q [s_q, h, d]: every other head of a wider tensor
        big = torch.empty(x.shape[0], 2 * x.shape[1], x.shape[2], dtype=x.dtype, device=x.device)
        big[:, ::2] = x
        return big[:, ::2]
    if how == "cols_sliced":  # last dim a slice of wider rows (unit stride kept)
        big = torch.empty(*x.shape[:-1], x.shape[-1] + 8, dtype=x.dtype, device=x.device)
        big[..., 4:-4] = x
        return big[..., 4:-4]
    if how == "rows_strided":
        big = torch.empty(2 * x.shape[0], *x.shape[1:], dtype=x.dtype, device=x.device)
        big[::2] = x
        return big[::2]
    if how == "col_major":
        return x.t().contiguous().t()
    if how == "last_strided":  # unit stride lost in the last dim
        big = torch.empty(*x.shape, 2, dtype=x.dtype, device=x.device)
        big[..., 0] = x
        return big[..., 0]
    if how == "3d":
        return x[:, None]
    return x


@dataclass
class Case:
    method: str
    q: torch.Tensor
    kv: torch.Tensor  # as passed (dense fp16 or the FP8 cache)
    kv_values: torch.Tensor  # dense values the kernels read (float64 CPU)
    indices: torch.Tensor  # as passed
    idx2d: torch.Tensor
    kw: dict = field(default_factory=dict)
    sm_scale: float | None = None
    d_v: int = 16
    topk_length: torch.Tensor | None = None
    attn_sink: torch.Tensor | None = None
    plan_kw: dict | None = None  # build a plan from the call's own tensors and pass it
    fault: str = "none"
    note: str = ""


def _faults_for(method: str) -> list[str]:
    common = ["idx_int64", "idx_h2", "idx_rows", "idx_topk0", "idx_sparse", "q_2d", "kv_width", "kv_h2",
              "fp8_1d", "tl_float", "tl_shape", "sink_f16", "sink_shape", "sm_scale_str", "sm_scale_tensor",
              "sm_scale_nan", "d_v_float", "d_v_big", "kv_list", "method_bad"]
    if method != "reference":
        common += ["q_float32", "kv_dtype", "q_last_strided", "heads_129", "backend_bad", "plan_other", "plan_tl"]
    return common


def fault_error(fault: str, method: str):
    """``(exception, text the message must hold)`` of a fault, or None when the call is valid for ``method``."""
    table = {
        "idx_int64": (TypeError, "indices must be int32"), "idx_h2": (ValueError, "indices of shape"),
        "idx_rows": (ValueError, "indices has"), "idx_topk0": (ValueError, "indices must have topk >= 1"),
        "idx_sparse": (TypeError, "indices must be a dense"), "q_2d": (ValueError, "q must be"),
        "kv_width": (ValueError, "kv has d_qk"), "kv_h2": (ValueError, "kv of shape"),
        "fp8_1d": (ValueError, "kv must be uint8 [s_kv, 656]"), "tl_float": (TypeError, "topk_length must be int32"),
        "tl_shape": (ValueError, "topk_length must have shape"), "sink_f16": (TypeError, "attn_sink must have dtype"),
        "sink_shape": (ValueError, "attn_sink must have shape"), "sm_scale_str": (TypeError, "sm_scale"),
        "sm_scale_tensor": (TypeError, "sm_scale"), "sm_scale_nan": (ValueError, "sm_scale"),
        "d_v_float": (TypeError, "d_v must be an int"), "d_v_big": (ValueError, "d_v must be an int"),
        "kv_list": (TypeError, "kv must be a torch.Tensor"), "method_bad": (ValueError, "method must be one of"),
        "q_float32": (TypeError, "q must have dtype"), "kv_dtype": (TypeError, "kv must have q's dtype"),
        "q_last_strided": (ValueError, "q must be contiguous in its last dimension"),
        "heads_129": (ValueError, "q must have 1..128 heads"), "backend_bad": (ValueError, "backend must be one of"),
        "plan_other": (ValueError, "indices are not the tensor the plan was built from"),
        "plan_tl": (ValueError, "topk_length"),
    }
    return table.get(fault)


@st.composite
def cases(draw, methods=("quilt", "query_parallel", "reference"), faults=True, fp8=True, backend="triton",
          dtype=torch.float16, production=False):
    """A ``Case``; ``production``: d_qk 576 / d_v 512 only (the CUDA backend's shape), larger s_q."""
    method = draw(st.sampled_from(methods))
    h = draw(st.sampled_from([1, 2, 3, 4, 5, 8, 12, 16, 17, 32, 64, 100, 128]))
    s_q = draw(st.integers(0, max(1, min(40 if production else 10, (512 if production else 96) // h))))
    kind = draw(st.sampled_from(["dense", "dense"] + (["fp8"] if fp8 else []) + ["dense"])) \
        if production or (h <= 8 and s_q <= 4) else "dense"
    d_v, d_rope = (512, 64) if kind == "fp8" or production else \
        draw(st.sampled_from([(16, 16), (32, 16), (64, 16), (16, 32)]))
    d_qk = d_v + d_rope
    s_kv = draw(st.sampled_from([33, 17, 48, 5, 2, 1, 0]))  # (hypothesis favours the first: 0 is rare)
    topk = draw(st.integers(1, 80 if production else 12 if kind == "fp8" else 40))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    p_invalid = draw(st.sampled_from([0.0, 0.0, 0.15, 0.6, 1.0]))
    p_repeat = draw(st.sampled_from([0.0, 0.0, 0.25]))
    share = draw(st.booleans())
    idx = make_indices(g, s_q, s_kv, topk, p_invalid, p_repeat, share)

    tl = None
    tl_kind = draw(st.sampled_from(["none", "none", "int32", "int64", "int64_huge"]))
    if tl_kind != "none":
        tl = torch.randint(-3, topk + 4, (s_q,), generator=g)
        if tl_kind == "int64_huge" and s_q:
            tl[0] = 2**32 + 5
            tl[-1] = 2**31
        tl = tl.to(torch.int32 if tl_kind == "int32" else torch.int64)

    q = torch.randn(s_q, h, d_qk, generator=g, dtype=torch.float64).to(dtype)
    kv = torch.randn(s_kv, d_qk, generator=g, dtype=torch.float64).to(dtype)
    nonfinite = draw(st.sampled_from(["none", "q", "kv_unselected", "none", "kv_selected", "none"]))
    note = nonfinite
    sel = selected_rows(idx, s_kv, tl)
    vals = torch.tensor(NONFINITE)
    # Triton's interpreter decodes the e4m3fn NaN byte as 480 (the GPU as NaN): no NaN in an FP8 cache there
    fp8_no_nan = kind == "fp8" and method != "reference" and KERNEL_DEVICE.type == "cpu"
    if nonfinite == "q" and q.numel():
        for _ in range(draw(st.integers(1, 3))):
            i, hh, c = (int(torch.randint(0, n, (1,), generator=g)) for n in q.shape)
            q[i, hh, c] = vals[int(torch.randint(0, 3, (1,), generator=g))]
    elif nonfinite in ("kv_unselected", "kv_selected"):
        pool = sorted(sel) if nonfinite == "kv_selected" else sorted(set(range(s_kv)) - sel)
        for _ in range(draw(st.integers(1, 3)) if pool else 0):
            r = pool[int(torch.randint(0, len(pool), (1,), generator=g))]
            c = int(torch.randint(0, d_qk, (1,), generator=g))
            kv[r, c] = vals[int(torch.randint(0, 2 if fp8_no_nan and c < 512 else 3, (1,), generator=g))]
            if nonfinite == "kv_unselected" and draw(st.booleans()):
                kv[r] = float("nan")  # a whole row of NaN nobody selects

    dev = KERNEL_DEVICE
    if kind == "fp8":
        cache = quantize_fp8(kv).to(dev)
        kv_pass, kv_values = cache, decode_fp8(cache, dtype)
    else:
        kv_values = kv.double()
        kv_pass = layout(kv.to(dev), draw(st.sampled_from(["contig", "rows_strided", "cols_sliced", "3d",
                                                            "last_strided"])))
    q_pass = layout(q.to(dev), draw(st.sampled_from(["contig", "heads_strided", "cols_sliced"])))
    idx_pass = layout(idx.to(dev), draw(st.sampled_from(["contig", "col_major", "3d", "rows_strided"])))

    sink = None
    if draw(st.booleans()):
        sink = (torch.randn(h, generator=g) * 2).float()
        if h > 1 and draw(st.booleans()):
            sink[0], sink[-1] = float("inf"), float("-inf")
        sink = sink.to(dev)
    sm_scale = draw(st.sampled_from([None, None, 0.05, 0.3, -0.2, 1, 0.0]))
    kw = {}
    plan_kw = None
    if method != "reference":
        kw["backend"] = backend
        if kind == "fp8" and backend == "triton":
            kw["fp8_expand"] = draw(st.sampled_from([None, True, False]))
    if method == "quilt":
        G = draw(st.sampled_from([None, 1, 2, 4, 8, 16] if backend == "triton" else [None, 1, 2, 4, 8]))
        tile = draw(st.sampled_from([16, 16, 32, 64] if backend == "triton" else [64]))
        kw.update(tile=tile, fallback=draw(st.booleans()), split_private=draw(st.booleans()) and backend == "triton",
                  clip_threshold=draw(st.sampled_from([0.0, 0.5, 1.0])))
        if G is not None:
            kw["group_size"] = G
            kw["merge_level"] = draw(st.sampled_from([None] + [m for m in (1, 2, 4, 8, 16) if m <= G]))
        if draw(st.integers(0, 3)) == 0:  # a prebuilt plan from the call's own tensors
            plan_kw = dict(group_size=G or 4, merge_level=min(G or 4, 2), tile=tile, split_private=kw["split_private"],
                           s_kv=draw(st.sampled_from([s_kv if s_kv else None, None])),
                           backend=draw(st.sampled_from(["auto", "triton"] if backend == "triton" else ["auto"])))
    if tl is not None:
        tl = tl.to(dev)
    fault = "none"
    if faults and draw(st.integers(0, 3)) == 0:
        fault = draw(st.sampled_from(_faults_for(method)))
    return Case(method, q_pass, kv_pass, kv_values, idx_pass, idx, kw, sm_scale, d_v, tl, sink, plan_kw, fault, note)


def apply_fault(c: Case) -> dict:
    """The call's arguments with the case's fault applied."""
    args = dict(q=c.q, kv=c.kv, indices=c.indices, sm_scale=c.sm_scale, d_v=c.d_v, topk_length=c.topk_length,
                attn_sink=c.attn_sink, method=c.method, **c.kw)
    f, s_q = c.fault, c.q.shape[0]
    idx = c.idx2d.to(c.q.device)
    if f == "idx_int64":
        args["indices"] = idx.long()
    elif f == "idx_h2":
        args["indices"] = torch.stack([idx, idx], 1)
    elif f == "idx_rows":
        args["indices"] = torch.cat([idx, idx[:1] if s_q else torch.zeros(1, idx.shape[1], dtype=idx.dtype, device=idx.device)])
    elif f == "idx_topk0":
        args["indices"] = idx[:, :0]
    elif f == "idx_sparse":
        args["indices"] = idx.to_sparse()
    elif f == "q_2d":
        args["q"] = c.q[:, 0]
    elif f == "kv_width":
        args["kv"] = torch.zeros(4, c.q.shape[2] + 1, dtype=c.q.dtype, device=c.q.device)
    elif f == "kv_h2":
        args["kv"] = torch.zeros(4, 2, c.q.shape[2], dtype=c.q.dtype, device=c.q.device)
    elif f == "fp8_1d":
        args["kv"] = torch.zeros(656, dtype=torch.uint8, device=c.q.device)
    elif f == "tl_float":
        args["topk_length"] = torch.ones(s_q, device=c.q.device)
    elif f == "tl_shape":
        args["topk_length"] = torch.ones(s_q + 1, dtype=torch.int32, device=c.q.device)
    elif f == "sink_f16":
        args["attn_sink"] = torch.zeros(c.q.shape[1], dtype=torch.float16, device=c.q.device)
    elif f == "sink_shape":
        args["attn_sink"] = torch.zeros(c.q.shape[1] + 1, device=c.q.device)
    elif f == "sm_scale_str":
        args["sm_scale"] = "abc"
    elif f == "sm_scale_tensor":
        args["sm_scale"] = torch.tensor([0.1, 0.2])
    elif f == "sm_scale_nan":
        args["sm_scale"] = float("nan")
    elif f == "d_v_float":
        args["d_v"] = float(c.d_v)
    elif f == "d_v_big":
        args["d_v"] = c.q.shape[2] + 1
    elif f == "kv_list":
        args["kv"] = [[0.0]]
    elif f == "method_bad":
        args["method"] = "dense"
    elif f == "q_float32":
        args["q"] = c.q.float()
    elif f == "kv_dtype":  # kv of the other 16-bit type than q's (the CUDA fuzz draws bf16 q)
        other = torch.float16 if c.q.dtype == torch.bfloat16 else torch.bfloat16
        args["kv"] = torch.zeros(4, c.q.shape[2], dtype=other, device=c.q.device)
    elif f == "q_last_strided":
        args["q"] = layout(c.q.contiguous(), "last_strided")
    elif f == "heads_129":
        args["q"] = torch.zeros(s_q, 129, c.q.shape[2], dtype=c.q.dtype, device=c.q.device)
        args["attn_sink"] = None
    elif f == "backend_bad":
        args["backend"] = "gpu"
    elif f == "plan_other":  # a plan of other indices of the same shape
        args["plan"] = make_plan(idx.clone(), group_size=2, tile=16)
    elif f == "plan_tl":  # a plan with a topk_length the call does not pass
        args["plan"] = make_plan(c.indices, topk_length=torch.ones(s_q, dtype=torch.int32, device=c.q.device),
                                 group_size=2, tile=16)
        args["topk_length"] = None
    return args


def call(args: dict):
    a = dict(args)  # planner settings and Triton tuning by name (conftest.prefill_kw)
    return sparse_prefill(a.pop("q"), a.pop("kv"), a.pop("indices"), a.pop("sm_scale"), **prefill_kw(**a))


def check_case(c: Case, dtype=torch.float16):
    if c.fault in ("plan_other", "plan_tl") and (c.method != "quilt" or c.q.shape[0] == 0):
        c.fault = "none"  # (a plan of no query fits any call of no query: nothing differs)
    args = apply_fault(c)
    if c.plan_kw is not None and c.fault == "none":
        args["plan"] = make_plan(c.indices, topk_length=c.topk_length, **c.plan_kw)
    err = fault_error(c.fault, c.method)
    for e in (f"method {c.method}", f"fault {c.fault}", f"values {c.note}", f"kv {c.kv.dtype}",
              f"h {c.q.shape[1]}", f"s_kv {'0' if not c.kv_values.shape[0] else '>0'}",
              f"plan {'given' if c.plan_kw else 'none'}", f"topk_length {c.topk_length is not None}"):
        event(e)  # coverage, shown by pytest --hypothesis-show-statistics
    what = (f"{c.method} h={c.q.shape[1]} s_q={c.q.shape[0]} s_kv={c.kv_values.shape[0]} "
            f"topk={c.idx2d.shape[1]} {c.note} {c.kw} plan={c.plan_kw} fault={c.fault}")
    if err is not None:
        raises_named(*err, lambda: call(args))
        return
    got = call(args)
    want = expected(c.q, c.kv_values, c.idx2d, c.sm_scale, c.d_v, c.topk_length, c.attn_sink)
    assert got[0].dtype == dtype, what
    assert_agrees(got, want, dtype, what)


# ============================================================================ properties
@kernels
@fuzz(250)
@given(c=cases())
def test_sparse_prefill_fuzz(c, nan_poison):
    check_case(c)


@pytest.mark.gpu
@fuzz(60)
@given(c=cases(methods=("quilt", "query_parallel"), backend="cuda", dtype=torch.bfloat16, production=True))
def test_cuda_backend_fuzz(c, nan_poison):
    """The sm_90a backend (production d_qk 576 / d_v 512, bf16, dense and FP8): the same properties."""
    check_case(c, torch.bfloat16)


@pytest.mark.gpu
@fuzz(40)
@given(c=cases(methods=("quilt", "query_parallel"), backend="cuda", dtype=torch.bfloat16, production=True),
       cap=st.sampled_from([1, 3, 64]))
def test_cuda_backend_fp8_pool_fuzz(c, cap, nan_poison, monkeypatch):
    """The same on the FP8 path of large pools: every FP8 pool treated as one above ``FP8_COMPACT_POOL``, its
    referenced rows compacted into ``cap`` rows (1 and 3: most calls overflow them and run the widening
    kernel, chosen on the device)."""
    from quilt_attn.ops import cuda_backend

    assume(c.kv.dtype == torch.uint8)
    monkeypatch.setattr(cuda_backend, "FP8_COMPACT_POOL", 0)
    monkeypatch.setattr(cuda_backend, "FP8_COMPACT_ROWS", cap)
    check_case(c, torch.bfloat16)


@pytest.mark.gpu
@fuzz(40)
@given(c=cases(methods=("quilt", "query_parallel"), faults=False, backend="cuda", dtype=torch.bfloat16,
               production=True))
def test_fp8_mode_fuzz(c, nan_poison):
    """``precision="fp8"`` (the FP8 tensor-core mode) on the same inputs, against the emulation of its arithmetic
    (``fp8_mode.sparse_prefill_fp8_kernel_reference``, the mode's specification) on the FP8 cache the call
    runs on (a dense kv quantized by ``quantize_fp8``, as the call does): the same NaN and infinite elements,
    the rest within ``fp8_mode_bounds``. How far the mode is from the exact definition is test_fp8_mode.py's and
    BENCHMARKS.md's question; the fuzz asks that it computes what it specifies on every input."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8 mode runs on sm_90")
    args = apply_fault(c)
    args["precision"] = "fp8"
    if c.plan_kw is not None:
        args["plan"] = make_plan(c.indices, topk_length=c.topk_length, **c.plan_kw)
    cache = c.kv if c.kv.dtype == torch.uint8 else quantize_fp8(c.kv_values.to(torch.bfloat16).to(c.q.device))
    what = (f"fp8 mode {c.method} h={c.q.shape[1]} s_q={c.q.shape[0]} s_kv={c.kv_values.shape[0]} "
            f"topk={c.idx2d.shape[1]} {c.note} {c.kw} plan={c.plan_kw}")
    event(f"fp8 mode {c.method}, values {c.note}, kv {c.kv.dtype}")
    got = call(args)
    assert got[0].dtype == torch.bfloat16, what
    want = sparse_prefill_fp8_kernel_reference(c.q.cpu(), cache.cpu(), c.idx2d, c.sm_scale, attn_sink=
                                               None if c.attn_sink is None else c.attn_sink.cpu(),
                                               topk_length=None if c.topk_length is None else c.topk_length.cpu())
    assert_agrees(got, tuple(t.double() for t in want), torch.bfloat16, what,
                  bounds=fp8_mode_bounds(c.q, cache, c.idx2d, c.topk_length, c.sm_scale))


@kernels
@fuzz(100)
@given(c=cases(methods=("quilt",), faults=False))
def test_quilt_fuzz(c, nan_poison):
    """QUILT alone (the plan's tiles, shared rows, repeats, partial groups), no faults."""
    check_case(c)


@kernels
@fuzz(20)
@given(c=cases(methods=("quilt",), faults=False, fp8=False))
def test_compat_flash_mla_sparse_fwd_fuzz(c, nan_poison):
    """The drop-in: FlashMLA's layouts ([s_kv, 1, d_qk], [s_q, 1, topk]) and a required sm_scale."""
    sm_scale = 0.1 if c.sm_scale is None else c.sm_scale
    kv3 = c.kv if c.kv.dim() == 3 else c.kv[:, None]
    idx3 = c.indices if c.indices.dim() == 3 else c.indices[:, None]
    got = flash_mla_sparse_fwd(c.q, kv3, idx3, sm_scale, d_v=c.d_v, attn_sink=c.attn_sink,
                               topk_length=c.topk_length, backend="triton")
    want = expected(c.q, c.kv_values, c.idx2d, sm_scale, c.d_v, c.topk_length, c.attn_sink)
    assert_agrees(got, want, torch.float16, f"compat {c.note}")


@fuzz(40)
@given(c=cases(methods=("reference",), faults=False),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]))
def test_sparse_prefill_reference_fuzz(c, dtype):
    """The float64 reference itself (any float dtype in, float64 out) against the computation here."""
    q = c.q.to(dtype)
    kv = c.kv if c.kv.dtype == torch.uint8 else c.kv.to(dtype)
    kv_values = c.kv_values if c.kv.dtype == torch.uint8 else c.kv_values.to(dtype).double()
    if c.kv.dtype == torch.uint8:  # the reference dequantizes in float32 (no rounding to q's dtype)
        kv_values = decode_fp8(c.kv, torch.float32)
    got = sparse_prefill_reference(q, kv, c.indices, c.sm_scale, d_v=c.d_v, attn_sink=c.attn_sink,
                                   topk_length=c.topk_length)
    assert got[0].dtype == torch.float64
    want = expected(q, kv_values, c.idx2d, c.sm_scale, c.d_v, c.topk_length, c.attn_sink)
    assert_agrees(got, want, torch.float64, f"reference {dtype} {c.note}")


@st.composite
def plan_cases(draw):
    s_q = draw(st.integers(1, 24))
    s_kv = draw(st.sampled_from([1, 3, 17, 64, 300]))
    topk = draw(st.integers(1, 48))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    idx = make_indices(g, s_q, s_kv, topk, draw(st.sampled_from([0.0, 0.2, 1.0])),
                       draw(st.sampled_from([0.0, 0.3])), draw(st.booleans()))
    tl = torch.randint(-2, topk + 3, (s_q,), generator=g, dtype=torch.int32) if draw(st.booleans()) else None
    G = draw(st.sampled_from([1, 2, 4, 8, 16]))
    kw = dict(group_size=G, merge_level=draw(st.sampled_from([m for m in (1, 2, 4, 8, 16) if m <= G])),
              tile=draw(st.sampled_from([1, 3, 16, 32, 64])), clip_threshold=draw(st.sampled_from([0.0, 0.5, 1.0])),
              split_private=draw(st.booleans()), mask_method=draw(st.sampled_from(["bitmap", "sort"])),
              s_kv=draw(st.sampled_from([s_kv, None])))
    kw["backend"] = draw(st.sampled_from(["torch", "triton"])) if kw["tile"] in (16, 32, 64) else "torch"
    return idx, tl, kw


def entry_limits(idx, tl, s_kv):
    """The bound of a valid row (``s_kv``, or 2^31 - 1 without it) and each query's entry count (``topk_length``
    clamped to 0..topk)."""
    s_q, topk = idx.shape
    bound = s_kv if s_kv is not None else 2**31 - 1
    return bound, [topk] * s_q if tl is None else [max(0, min(int(x), topk)) for x in tl.tolist()]


def valid_rows(idx, tl, s_kv):
    """Each query's valid entries' rows in list order, repeats included."""
    bound, n = entry_limits(idx, tl, s_kv)
    return [[r for r in row[: n[i]] if 0 <= r < bound] for i, row in enumerate(idx.tolist())]


def owned(p, s_q):
    """For each query, the sorted list of rows the plan gives it (tile columns with its bit, private lists)."""
    rows, masks = (t.cpu() for t in (p.columns() if hasattr(p, "columns") else (p.tile_kv, p.tile_mask)))
    G = p.group_size
    got = [[] for _ in range(s_q)]
    n_tiles = p.group_tiles.cpu().tolist()
    for gi in range(rows.shape[0]):
        r, m = rows[gi, : n_tiles[gi]].reshape(-1), masks[gi, : n_tiles[gi]].reshape(-1)
        for k in range(G):
            i = gi * G + k
            if i < s_q:
                got[i] += r[((m >> k) & 1) != 0].tolist()
    if p.priv_idx is not None:
        pi, pn = p.priv_idx.cpu(), p.priv_n.cpu()
        for i in range(s_q):
            got[i] += pi[i, : int(pn[i])].tolist()
    return [sorted(x) for x in got]


@fuzz(40)
@given(case=plan_cases())
def test_plan_fuzz(case):
    """Every valid (query, entry) -- each occurrence of a repeated row -- is in the plan exactly once for
    its own query (no partner gets it), whatever the settings; bad settings are named errors."""
    idx, tl, kw = case
    if kw["backend"] == "triton" and not KERNELS_CAN_RUN:
        kw["backend"] = "torch"
    p = make_plan(idx, topk_length=tl, **kw)
    want = [sorted(w) for w in valid_rows(idx, tl, kw["s_kv"])]
    assert owned(p, idx.shape[0]) == want, f"plan {kw}"
    assert int(p.valid_pairs) == sum(map(len, want))
    assert p.source.mismatch(idx, kw["s_kv"] or 1000, tl) is None  # (without s_kv any kv fits)


@pytest.mark.gpu
@fuzz(80)
@given(case=plan_cases())
def test_cuda_plan_fuzz(case):
    """The CUDA planner, in its scope (groups 1-8, any tile, threshold, merge level, split, topk_length, invalid
    entries, repeated rows): every valid occurrence is in the plan once for its own query, and without repeated
    rows the plan is the torch planner's field by field (with repeats, which occurrence tiles first is decided
    by the table's racing inserts)."""
    from quilt_attn.planner.cuda_plan import unsupported_reason
    from quilt_bench.bench import plans_equal

    idx, tl, kw = case
    dev = torch.device("cuda")
    assume(unsupported_reason(dev, kw["group_size"], idx.shape[1], kw["s_kv"], kw["tile"], "bitmap") is None)
    kw = dict(kw, mask_method="bitmap", topk_length=None if tl is None else tl.to(dev))
    p = make_plan(idx.to(dev), **dict(kw, backend="cuda"))
    want = valid_rows(idx, tl, kw["s_kv"])
    assert owned(p, idx.shape[0]) == [sorted(w) for w in want], f"plan {kw}"
    assert int(p.valid_pairs) == sum(map(len, want))
    repeats = any(len(set(w)) < len(w) for w in want)
    event(f"repeated rows: {repeats}")
    if not repeats:
        assert plans_equal(p, make_plan(idx.to(dev), **dict(kw, backend="torch"))), f"plan {kw}"


@fuzz(30)
@given(case=plan_cases(), bad=st.sampled_from(["group_size", "merge_level", "tile", "clip_threshold", "s_kv",
                                               "mask_method", "backend", "topk_length", "indices"]))
def test_plan_errors_fuzz(case, bad):
    idx, tl, kw = case
    kw = dict(kw, backend="torch")
    exc, value = {"group_size": (ValueError, 3), "merge_level": (ValueError, 32), "tile": (ValueError, 0),
                  "clip_threshold": (ValueError, 1.5), "s_kv": (ValueError, 0), "mask_method": (ValueError, "scan"),
                  "backend": (ValueError, "gpu"), "topk_length": (TypeError, torch.ones(idx.shape[0])),
                  "indices": (TypeError, idx.float())}[bad]
    if bad == "indices":
        raises_named(exc, "indices", lambda: make_plan(value, topk_length=tl, **kw))
    else:
        kw[bad] = value
        raises_named(exc, bad, lambda: make_plan(idx, **({"topk_length": tl} | kw)))


@fuzz(40)
@given(case=plan_cases())
def test_member_masks_fuzz(case):
    """Bit k of an entry's mask: query ``(i // G) * G + k`` selected its row (validly); a later repeat of a
    row in one list carries the query's own bit only; invalid entries 0."""
    idx, tl, kw = case
    G = kw["group_size"]
    s_kv = kw["s_kv"]
    masks, valid = member_masks(idx, G, s_kv=s_kv, topk_length=tl, mask_method=kw["mask_method"])
    s_q, topk = idx.shape
    bound, n = entry_limits(idx, tl, s_kv)
    rows = idx.tolist()
    sets = [{r for r in rows[i][: n[i]] if 0 <= r < bound} for i in range(s_q)]
    want = torch.zeros(s_q, topk, dtype=torch.int64)
    for i in range(s_q):
        seen = set()
        for j in range(n[i]):
            r = rows[i][j]
            if not 0 <= r < bound:
                continue
            if r in seen:
                want[i, j] = 1 << (i % G)
            else:
                g0 = i // G * G
                want[i, j] = sum(1 << k for k in range(G) if g0 + k < s_q and r in sets[g0 + k])
            seen.add(r)
    assert torch.equal(valid, want != 0)
    assert torch.equal(masks.long(), want), f"G={G} s_kv={s_kv}"


@fuzz(40)
@given(seed=st.integers(0, 2**31 - 1), s_kv=st.integers(0, 6), shape3=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       n_bad=st.integers(0, 4), strided=st.booleans())
def test_fp8_round_trip_fuzz(seed, s_kv, shape3, dtype, n_bad, strided):
    """quantize_fp8 -> dequantize_fp8: finite values within e4m3 rounding of their group (relative
    2**-4 of the value, or half an e4m3 subnormal step of the group scale), NaN only where NaN was, +-inf
    saturated to +-448 * scale, rope exact in bf16; the rest of a group unaffected by its non-finite values."""
    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(s_kv, 576, generator=g) * torch.exp2(torch.randint(-6, 7, (s_kv, 1), generator=g))).to(dtype)
    for _ in range(n_bad if s_kv else 0):
        kv[int(torch.randint(0, s_kv, (1,), generator=g)), int(torch.randint(0, 576, (1,), generator=g))] = \
            NONFINITE[int(torch.randint(0, 3, (1,), generator=g))]
    x = layout(kv, "rows_strided") if strided else kv
    cache = quantize_fp8(x[:, None] if shape3 else x)
    assert cache.shape == (s_kv, 656) and cache.dtype == torch.uint8
    back = dequantize_fp8(cache, torch.float32).double()
    ref = kv.double()
    assert torch.equal(torch.isnan(back), torch.isnan(ref))
    rope_ok = torch.isnan(ref[:, 512:]) | (back[:, 512:] == ref[:, 512:].to(torch.bfloat16).double())
    assert rope_ok.all()
    nope = ref[:, :512].view(s_kv, 4, 128)
    bn = back[:, :512].view(s_kv, 4, 128)
    fin = torch.isfinite(nope)
    amax = torch.where(fin, nope.abs(), 0).amax(-1)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / 448))), 1.0)[..., None]
    assert torch.equal(cache[:, 512:528].contiguous().view(torch.float32).double(), scale[..., 0])
    err = (bn - nope).abs()
    bound = torch.maximum(nope.abs() * 2.0**-4, scale * 2.0**-10)  # e4m3: 3 mantissa bits, subnormals 2**-9
    assert (err[fin] <= bound.expand_as(err)[fin]).all()
    inf = torch.isinf(nope)
    assert torch.equal(bn[inf], torch.sign(nope[inf]) * 448 * scale.expand_as(bn)[inf])


@fuzz(15)
@given(seed=st.integers(0, 2**31 - 1), bad=st.sampled_from(["dtype", "width", "ndim", "h2", "list"]))
def test_fp8_errors_fuzz(seed, bad):
    kv = torch.randn(3, 576, generator=torch.Generator().manual_seed(seed))
    arg = {"dtype": kv.double(), "width": kv[:, :575], "ndim": kv[0], "h2": kv[:, None].expand(3, 2, 576),
           "list": kv.tolist()}[bad]
    exc = TypeError if bad in ("dtype", "list") else ValueError
    raises_named(exc, "kv", lambda: quantize_fp8(arg))
    cache = quantize_fp8(kv)
    arg = {"dtype": cache.float(), "width": cache[:, :655], "ndim": cache[0], "h2": cache[:, None].expand(3, 2, 656),
           "list": cache.tolist()}[bad]
    raises_named(ValueError if bad != "list" else TypeError, "cache", lambda: dequantize_fp8(arg))


@fuzz(40)
@given(seed=st.integers(0, 2**31 - 1), fmt=st.sampled_from([".npy", ".pt", ".safetensors"]),
       damage=st.sampled_from(["none", "truncate", "flip", "empty", "random", "append"]),
       dtype=st.sampled_from(["int32", "int64", "uint16", "int16", "float32", "bool"]),
       shape=st.sampled_from([(4, 7), (3, 1, 5), (6,), (0, 3), (2, 2, 2)]))
def test_load_indices_fuzz(tmp_path_factory, seed, fmt, damage, dtype, shape):
    """A file written with some content and then damaged: load_indices returns int32 ``[s_q, topk]`` equal
    to what was written, or a ValueError / TypeError naming the path -- never another exception."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(-1, 1000, shape, generator=g).to(getattr(torch, dtype))
    path = tmp_path_factory.mktemp("li") / f"idx{fmt}"
    if fmt == ".npy":
        np.save(path, data.numpy() if dtype != "uint16" else data.to(torch.int32).numpy().astype(np.uint16))
    elif fmt == ".pt":
        torch.save(data, path)
    else:
        from safetensors.torch import save_file

        save_file({"indices": data}, str(path))
    raw = path.read_bytes()
    rng = np.random.default_rng(seed)
    if damage == "truncate":
        raw = raw[: int(rng.integers(0, len(raw)))]
    elif damage == "flip" and raw:
        b = bytearray(raw)
        for pos in rng.integers(0, len(b), 4):
            b[pos] ^= 0xFF
        raw = bytes(b)
    elif damage == "empty":
        raw = b""
    elif damage == "random":
        raw = rng.integers(0, 256, int(rng.integers(1, 400)), dtype=np.uint8).tobytes()
    elif damage == "append":
        raw = raw + b"\x00garbage"
    path.write_bytes(raw)
    try:
        got = load_indices(path)
    except (ValueError, TypeError) as err:
        assert str(path) in str(err) or "indices in" in str(err), f"error without the path: {err!r}"
        return
    assert got.dtype == torch.int32 and got.dim() == 2 and got.is_contiguous()
    if damage == "none":
        want = data[:, 0] if data.dim() == 3 and data.shape[1] == 1 else data
        assert torch.equal(got, want.to(torch.int32))
    save_indices(got, path)  # whatever loaded can be written back
    assert torch.equal(load_indices(path), got)


@kernels
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_selected_row_reaches_only_its_queries(nan_poison, value):
    """A NaN / inf in a kv row that only query 0 selects: NaN for query 0, none for its partners -- query by
    query, and in QUILT whether that row runs in a tile shared with the partners (``0 x inf`` there: the
    repair pass recomputes the partners) or in query 0's own pass (``split_private``)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(4, 2, 32, generator=g).half().to(KERNEL_DEVICE)
    kv = torch.randn(8, 32, generator=g).half()
    kv[5, 3] = value
    kv = kv.to(KERNEL_DEVICE)
    idx = torch.tensor([[0, 1, 5], [0, 1, 2], [1, 2, 3], [0, 2, 3]], dtype=torch.int32, device=KERNEL_DEVICE)
    want = expected(q, kv, idx, None, 16)
    for method, kw in (("query_parallel", {}),
                       ("quilt", dict(group_size=4, merge_level=4, split_private=False, fallback=False, tile=16)),
                       ("quilt", dict(group_size=4, merge_level=4, split_private=True, fallback=False, tile=16))):
        got = sparse_prefill(q, kv, idx, method=method, d_v=16, backend="triton", **prefill_kw(**kw))
        assert torch.isnan(got[0][0]).any() and torch.isfinite(got[0][1:]).all(), (method, kw)
        assert_agrees(got, want, torch.float16, method)
