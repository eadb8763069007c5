"""``sparse_prefill_reference`` against an independently written dense masked attention.

The oracle here builds the full ``[s_q, h, s_kv]`` logits matrix in float64, masks every query to
the set of kv rows its index list selects (built with Python loops from the raw indices, the
``topk_length`` prefix and the ``[0, s_kv)`` range), and applies a natural-log softmax: the definitions
FlashMLA documents, ``max_logits = max(q.k * sm_scale)`` and ``lse = logsumexp(q.k * sm_scale)`` over the
valid rows (natural log), empty rows ``-inf`` / ``+inf``, and the sink factor
``exp(lse) / (exp(lse) + exp(attn_sink))`` (infinite sinks as numbers). Index lists are duplicate-free
(Top-K lists never repeat a row), so a set mask is the same as summing over the list.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import randn, random_indices
from quilt_attn import dequantize_fp8, quantize_fp8, sparse_prefill, sparse_prefill_reference

INT32_MAX = 2**31 - 1


def dense_oracle(q, kv, indices, sm_scale=None, *, d_v, attn_sink=None, topk_length=None):
    """Dense masked softmax attention in float64, FlashMLA's natural-log statistics."""
    if kv.dim() == 3:
        kv = kv[:, 0]
    if indices.dim() == 3:
        indices = indices[:, 0]
    s_q, h, d_qk = q.shape
    s_kv = kv.shape[0]
    scale = d_qk**-0.5 if sm_scale is None else sm_scale
    mask = torch.zeros(s_q, s_kv, dtype=torch.bool)
    idx = indices.tolist()
    for i in range(s_q):
        n = len(idx[i]) if topk_length is None else max(0, min(int(topk_length[i]), len(idx[i])))
        for r in idx[i][:n]:
            if 0 <= r < s_kv:
                mask[i, r] = True
    logits = torch.einsum("qhd,kd->qhk", q.double().cpu(), kv.double().cpu()) * scale
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    empty = ~mask.any(dim=1)  # [s_q]
    lse_e = torch.logsumexp(logits, dim=-1)  # -inf on empty rows
    w = torch.exp(logits - torch.where(empty[:, None], 0.0, lse_e)[..., None])
    w = torch.where(empty[:, None, None], 0.0, w)
    out = torch.einsum("qhk,kd->qhd", w, kv.double().cpu()[:, :d_v])
    max_logits = logits.amax(dim=-1)  # -inf on empty rows
    lse = torch.where(empty[:, None], float("inf"), lse_e)
    if attn_sink is not None:
        sink = attn_sink.double().cpu()[None, :]
        fac = torch.exp(lse_e) / (torch.exp(lse_e) + torch.exp(sink))  # 0/0 only when both are 0
        fac = torch.where(empty[:, None], 0.0, torch.nan_to_num(fac, nan=0.0))
        if torch.isinf(sink).any():  # exp(+inf) = inf -> factor 0; exp(-inf) = 0 -> factor 1
            fac = torch.where(torch.isposinf(sink), 0.0, fac)
            fac = torch.where(torch.isneginf(sink) & ~empty[:, None], 1.0, fac)
        out = out * fac[..., None]
    return out, max_logits, lse


def check(got, want, *, out_tol=1e-10):
    out, ml, lse = got
    w_out, w_ml, w_lse = want
    assert out.dtype == torch.float64
    assert ml.dtype == torch.float32 and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(ml).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out, w_out, atol=out_tol, rtol=out_tol)
    for got_s, want_s in ((ml, w_ml), (lse, w_lse)):
        inf = torch.isinf(want_s)
        assert torch.equal(torch.isinf(got_s), inf)
        assert torch.equal(got_s[inf], want_s[inf].float())
        # float32 results of float64 math: one rounding
        torch.testing.assert_close(got_s[~inf].double(), want_s[~inf], atol=1e-6, rtol=2**-23)


def inputs(s_q, h, s_kv, topk, d_qk=80, seed=0, dtype=torch.float32):
    q = randn(s_q, h, d_qk, seed=seed, dtype=dtype)
    kv = randn(s_kv, d_qk, seed=seed + 1, dtype=dtype)
    idx = random_indices(s_q, s_kv, topk, seed=seed + 2)
    return q, kv, idx


# ----------------------------------------------------------------------------- basic agreement
@pytest.mark.parametrize("h", [1, 3, 16])
@pytest.mark.parametrize("topk", [1, 37, 100])
def test_matches_dense_oracle(h, topk):
    q, kv, idx = inputs(9, h, 130, topk, seed=h * 1000 + topk)
    check(sparse_prefill_reference(q, kv, idx, 0.11, d_v=64), dense_oracle(q, kv, idx, 0.11, d_v=64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_input_dtypes(dtype):
    q, kv, idx = inputs(7, 4, 64, 20, seed=5, dtype=dtype)
    check(sparse_prefill_reference(q, kv, idx, d_v=48), dense_oracle(q, kv, idx, d_v=48))


def test_default_sm_scale_is_rsqrt_d_qk():
    q, kv, idx = inputs(6, 2, 50, 17, d_qk=72, seed=1)
    got = sparse_prefill_reference(q, kv, idx, d_v=64)
    explicit = sparse_prefill_reference(q, kv, idx, 72**-0.5, d_v=64)
    for a, b in zip(got, explicit):
        assert torch.equal(a, b)
    check(got, dense_oracle(q, kv, idx, 72**-0.5, d_v=64))


def test_large_logits_are_stable():
    q, kv, idx = inputs(5, 3, 40, 16, seed=2)
    q = q * 40  # logits of several hundred: exp would overflow without max subtraction
    got = sparse_prefill_reference(q, kv, idx, 1.0, d_v=64)
    check(got, dense_oracle(q, kv, idx, 1.0, d_v=64), out_tol=1e-9)
    assert torch.isfinite(got[2]).all() and got[1].abs().max() > 500


def test_values_are_first_d_v_columns():
    q, kv, idx = inputs(4, 2, 30, 10, seed=3)
    out_full = sparse_prefill_reference(q, kv, idx, d_v=80)[0]
    out_32 = sparse_prefill_reference(q, kv, idx, d_v=32)[0]
    torch.testing.assert_close(out_32, out_full[..., :32], atol=1e-12, rtol=1e-12)


# ----------------------------------------------------------------------------- index semantics
def test_invalid_indices_are_ignored():
    s_q, s_kv, topk = 8, 60, 24
    q, kv, idx = inputs(s_q, 3, s_kv, topk, seed=4)
    bad = idx.clone()
    bad[0, 3] = -1
    bad[1, :5] = s_kv  # just past the end
    bad[2, 7] = s_kv + 17
    bad[3, -1] = INT32_MAX
    bad[4, ::2] = -1
    bad[5, 0] = -5  # any negative value means "no row"
    got = sparse_prefill_reference(q, kv, bad, d_v=64)
    check(got, dense_oracle(q, kv, bad, d_v=64))
    # identical to dropping those entries: rewrite them as -1
    cleaned = torch.where((bad >= 0) & (bad < s_kv), bad, -1)
    for a, b in zip(got, sparse_prefill_reference(q, kv, cleaned, d_v=64)):
        assert torch.equal(a, b)


def test_topk_length():
    s_q, topk = 8, 20
    q, kv, idx = inputs(s_q, 2, 50, topk, seed=6)
    lengths = torch.tensor([0, 1, 5, 19, 20, 21, 1000, 13], dtype=torch.int32)
    got = sparse_prefill_reference(q, kv, idx, d_v=64, topk_length=lengths)
    check(got, dense_oracle(q, kv, idx, d_v=64, topk_length=lengths))
    # row 0 (length 0) is empty; rows with length >= topk equal the unrestricted rows
    assert torch.isposinf(got[2][0]).all() and torch.isneginf(got[1][0]).all() and (got[0][0] == 0).all()
    full = sparse_prefill_reference(q, kv, idx, d_v=64)
    for r in (4, 5, 6):
        assert torch.equal(got[0][r], full[0][r]) and torch.equal(got[2][r], full[2][r])
    # int64 lengths are accepted and mean the same
    got64 = sparse_prefill_reference(q, kv, idx, d_v=64, topk_length=lengths.long())
    assert torch.equal(got64[0], got[0])


def test_topk_length_combined_with_invalid_indices():
    q, kv, idx = inputs(4, 2, 40, 12, seed=7)
    idx[:, 1] = -1
    idx[:, 10] = 40
    lengths = torch.tensor([2, 11, 12, 1], dtype=torch.int32)
    check(sparse_prefill_reference(q, kv, idx, d_v=64, topk_length=lengths),
          dense_oracle(q, kv, idx, d_v=64, topk_length=lengths))


def test_empty_rows():
    s_q, s_kv = 6, 30
    q, kv, idx = inputs(s_q, 3, s_kv, 8, seed=8)
    idx[1] = -1
    idx[3] = s_kv + torch.arange(8, dtype=torch.int32)
    lengths = torch.tensor([8, 8, 8, 8, 0, 8], dtype=torch.int32)
    out, ml, lse = got = sparse_prefill_reference(q, kv, idx, d_v=64, topk_length=lengths)
    check(got, dense_oracle(q, kv, idx, d_v=64, topk_length=lengths))
    for r in (1, 3, 4):
        assert (out[r] == 0).all()
        assert torch.isneginf(ml[r]).all()
        assert torch.isposinf(lse[r]).all()
    for r in (0, 2, 5):
        assert torch.isfinite(ml[r]).all() and torch.isfinite(lse[r]).all()


# ----------------------------------------------------------------------------- attn_sink
def test_attn_sink_finite_and_infinite():
    h = 5
    q, kv, idx = inputs(7, h, 45, 15, seed=9)
    idx[2] = -1  # an empty row stays 0 whatever the sink
    sink = torch.tensor([0.0, 2.5, -1.0, float("-inf"), float("inf")], dtype=torch.float32)
    out, ml, lse = got = sparse_prefill_reference(q, kv, idx, d_v=64, attn_sink=sink)
    check(got, dense_oracle(q, kv, idx, d_v=64, attn_sink=sink))
    base_out, base_ml, base_lse = sparse_prefill_reference(q, kv, idx, d_v=64)
    # lse and max_logits do not see the sink
    assert torch.equal(ml, base_ml) and torch.equal(lse, base_lse)
    # -inf: no effect; +inf: zero output
    assert torch.equal(out[:, 3], base_out[:, 3])
    assert (out[:, 4] == 0).all()
    assert (out[2] == 0).all()
    # finite sink: out scaled by exp(lse_e) / (exp(lse_e) + exp(sink))
    lse_e = base_lse[:, 1].double()  # natural log
    fac = torch.exp(lse_e) / (torch.exp(lse_e) + math.exp(2.5))
    ok = torch.arange(7) != 2
    torch.testing.assert_close(out[ok, 1], base_out[ok, 1] * fac[ok, None], atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------- layouts and inputs
def test_flashmla_layouts():
    q, kv, idx = inputs(6, 4, 40, 16, seed=10)
    got = sparse_prefill_reference(q, kv[:, None, :], idx[:, None, :], 0.2, d_v=64)
    want = sparse_prefill_reference(q, kv, idx, 0.2, d_v=64)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    check(got, dense_oracle(q, kv[:, None, :], idx[:, None, :], 0.2, d_v=64))


def test_fp8_cache_input():
    s_q, h, s_kv, topk = 5, 2, 40, 24
    q = randn(s_q, h, 576, seed=11, dtype=torch.bfloat16)
    dense = randn(s_kv, 576, seed=12, dtype=torch.bfloat16)
    cache = quantize_fp8(dense)
    idx = random_indices(s_q, s_kv, topk, seed=13)
    idx[0, 4] = -1
    got = sparse_prefill_reference(q, cache, idx)
    deq = dequantize_fp8(cache, torch.float32)
    for a, b in zip(got, sparse_prefill_reference(q, deq, idx)):
        assert torch.equal(a, b)  # the cache is read as its exact dequantized values
    for a, b in zip(got, sparse_prefill_reference(q, cache[:, None, :], idx)):
        assert torch.equal(a, b)  # FlashMLA's [s_kv, 1, 656]
    assert got[0].shape == (s_q, h, 512)  # d_v defaults to 512
    check(got, dense_oracle(q, deq, idx, d_v=512))


def test_float32_compute_dtype_close_to_float64():
    q, kv, idx = inputs(12, 4, 80, 33, seed=14)
    o64, m64, l64 = sparse_prefill_reference(q, kv, idx, d_v=64)
    o32, m32, l32 = sparse_prefill_reference(q, kv, idx, d_v=64, compute_dtype=torch.float32)
    assert o32.dtype == torch.float32
    torch.testing.assert_close(o32.double(), o64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l32, l64, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(m32, m64, atol=1e-5, rtol=1e-5)


def test_chunking_does_not_change_results():
    q, kv, idx = inputs(11, 3, 50, 20, seed=15)
    idx[4] = -1
    a = sparse_prefill_reference(q, kv, idx, d_v=64, chunk=3)
    b = sparse_prefill_reference(q, kv, idx, d_v=64)
    for x, y in zip(a, b):  # einsum batch sizes may change the float64 summation order only
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-12)


def test_api_reference_method():
    q, kv, idx = inputs(6, 3, 40, 16, seed=16, dtype=torch.float16)
    out, ml, lse = sparse_prefill(q, kv, idx, method="reference", d_v=64)
    r_out, r_ml, r_lse = sparse_prefill_reference(q, kv, idx, d_v=64)
    assert out.dtype == torch.float16
    assert torch.equal(out, r_out.to(torch.float16)) and torch.equal(ml, r_ml) and torch.equal(lse, r_lse)


# ----------------------------------------------------------------------------- non-finite values
def test_kv_without_rows():
    """``s_kv = 0``: the validity mask is all false, every row is empty (it raised IndexError)."""
    q, kv, idx = inputs(4, 2, 8, 5, seed=300)
    for cache in (kv[:0], kv[:0, None, :]):
        out, ml, lse = sparse_prefill_reference(q, cache, idx, d_v=64)
        assert out.shape == (4, 2, 64) and (out == 0).all()
        assert torch.isneginf(ml).all() and torch.isposinf(lse).all()
    fp8 = quantize_fp8(randn(3, 576, seed=301))[:0]
    out, ml, lse = sparse_prefill_reference(randn(4, 2, 576, seed=302, dtype=torch.float32), fp8, idx)
    assert (out == 0).all() and torch.isposinf(lse).all()


def test_non_finite_logits_follow_ieee():
    """A +inf logit is NaN (inf - inf), not "no valid index"; a row whose valid logits are all -inf carries no
    weight (empty); a -inf logit among finite ones weighs 0; a NaN in a selected row is NaN; a non-finite value
    in a row no query selects, or in an ignored entry, reaches nothing."""
    s_q, h, s_kv, topk = 6, 2, 20, 4
    q, kv, idx = inputs(s_q, h, s_kv, topk, seed=310, dtype=torch.float64)
    idx[:, :] = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, -1, -1], [10, 11, 12, 13], [14, 15, 1, 2],
                              [3, 4, 5, 6]], dtype=torch.int32)  # rows 16..19: selected by nobody
    clean = sparse_prefill_reference(q, kv, idx, d_v=64)
    # query 0, head 0: one +inf logit (only column 70 of q is nonzero, kv[0..3, 70] > 0)
    q[0, 0, :] = 0.0
    q[0, 0, 70] = float("inf")
    kv[0:4, 70] = torch.tensor([0.5, 1.0, 0.25, 0.125], dtype=torch.float64)
    # query 1, head 1: every valid logit -inf: no weight, an empty row
    q[1, 1, :] = 0.0
    q[1, 1, 71] = float("-inf")
    kv[4:8, 71] = 1.0
    # row 6 gets a -inf rope value: a -inf logit (weight 0) for the queries whose q is positive there
    kv[6, 75] = float("-inf")
    q[[1, 5], :, 75] = 1.0
    # query 3: row 10 holds a NaN: a NaN logit, NaN everything for query 3
    kv[10, 3] = float("nan")
    # rows nobody selects
    kv[17, :] = float("nan")
    kv[18, 3] = float("inf")
    out, ml, lse = sparse_prefill_reference(q, kv, idx, d_v=64)
    assert torch.isnan(out[0, 0]).all() and torch.isnan(lse[0, 0]) and torch.isposinf(ml[0, 0])
    assert torch.isfinite(out[0, 1]).all() and torch.isfinite(lse[0, 1])
    assert (out[1, 1] == 0).all() and torch.isneginf(ml[1, 1]) and torch.isposinf(lse[1, 1])
    assert torch.isnan(out[3]).all() and torch.isnan(lse[3]).all() and torch.isnan(ml[3]).all()
    torch.testing.assert_close(out[2], clean[0][2], atol=1e-12, rtol=1e-12)  # its rows untouched
    assert torch.isfinite(out[4]).all() and torch.isfinite(lse[4]).all()
    # query 5: row 6 weighs 0 (its values are finite): the softmax over rows 3, 4, 5
    without6 = sparse_prefill_reference(q, kv, idx, d_v=64, topk_length=torch.full((s_q,), 3, dtype=torch.int32))
    torch.testing.assert_close(out[5], without6[0][5], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse[5], without6[2][5])
    # an ignored entry (past topk_length, or -1) pointing at a non-finite row changes nothing
    idx2 = idx.clone()
    idx2[5, 3] = 10
    a = sparse_prefill_reference(q, kv, idx2, d_v=64, topk_length=torch.tensor([4, 4, 4, 4, 4, 3]))
    assert torch.equal(a[0][5], without6[0][5])
