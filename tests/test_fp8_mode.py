"""CPU reference of the FP8 tensor-core mode (``quilt_attn.fp8_mode``): its arithmetic against the exact
reference on the dequantized cache, its semantics (invalid indices, empty rows, topk_length, attn_sink),
the accumulator model, granularities, determinism and argument errors.

Bounds. Where the mode must be exact up to float32 accumulation (q already e4m3 with scale 1, or QK in
bf16) the statistics use ``TOLERANCES[bf16].stat_atol`` (float32 logits against float64). Everything else is
FP8 against exact and uses the bounds below, stated once:

* ``FP8_REL_ERR`` (2**-4, ``kv_cache``): one e4m3 rounding of a normal value errs by at most 2**-4 of it.
  With q exact, every weight of ``out = sum_r w_r v_r`` carries one such rounding (P's), so
  ``|out - ref| <= 2**-4 * sum_r w_r |v_r|`` elementwise, when no P value is subnormal (kept so here:
  logit spread < 5, kv scales within a factor 2).
* ``FP8_OUT_REL_L2 = 0.06``: q and P each rounded to e4m3 (about 2.6% RMS relative error each, a
  uniform rounding error of a log-uniform mantissa) give an ``out`` rel-L2 of ~3% on Gaussian data
  (measured 2.9e-2 at topk 2048); 0.06 leaves 2x for the small samples here.
* ``FP8_LSE_ATOL = 0.05`` natural-log units: issue 19's bound on ``|lse - ref|`` (measured ~5e-3: lse
  averages the logits' errors).
* ``FP8_LOGIT_ATOL = 0.15``: one logit's error (``max_logits``). q's e4m3 rounding errs ~2.6% RMS a
  latent element, so a logit of unit Gaussian q, k errs ~0.025 RMS (``576**-0.5 * sqrt(512) * 0.026``);
  the largest of a few thousand logits' errors ~4 sigma = 0.1.
* ``FP32_ULPS = 2**-22``: two float32 ulps, for FP8-mode results that must agree up to the order of a
  float32 sum (the same entries in another place of the list).
"""
from __future__ import annotations

import pytest
import torch

from conftest import TOLERANCES, indexer_aligned_inputs, randn, random_indices, rel_l2
from quilt_attn import dequantize_fp8, quantize_fp8, sparse_prefill_reference
from quilt_attn.fp8_mode import P_BLOCK, q_terms, quantize_q, sparse_prefill_fp8_reference
from quilt_attn.kv_cache import FP8_REL_ERR
from quilt_attn.reference import apply_attn_sink

FP8_OUT_REL_L2 = 0.06
FP8_LSE_ATOL = 0.05
FP8_LOGIT_ATOL = 0.15
FP32_ULPS = 2.0**-22
STAT = TOLERANCES[torch.bfloat16].stat_atol

fp8 = sparse_prefill_fp8_reference


def inputs(s_q=6, h=3, s_kv=160, topk=40, *, seed=0, q_scale=1.0):
    q = randn(s_q, h, 576, seed=seed, dtype=torch.bfloat16, scale=q_scale)
    cache = quantize_fp8(randn(s_kv, 576, seed=seed + 1, dtype=torch.bfloat16))
    idx = random_indices(s_q, s_kv, topk, seed=seed + 2)
    return q, cache, idx


def e4m3_q(s_q, h, *, seed):
    """bf16 q whose latent part is e4m3 values with amax exactly 448 in every (query, head, 128-block):
    every e4m3 q granularity then quantizes it exactly, with scale 1 (and a zero second term)."""
    lat = (randn(s_q, h, 512, seed=seed, dtype=torch.float32) * 60).to(torch.float8_e4m3fn).float()
    lat = torch.where(lat == 0, torch.full_like(lat, 0.5), lat)
    lat.view(s_q, h, 4, 128)[..., 0] = 448.0
    rope = randn(s_q, h, 64, seed=seed + 5, dtype=torch.float32)
    return torch.cat([lat, rope], -1).to(torch.bfloat16)


def values(cache):
    return dequantize_fp8(cache, torch.float64)[:, :512]


def weights(q, cache, idx, sm_scale):
    """The exact softmax weights ``[s_q, h, topk]`` of a duplicate-free, all-valid ``idx``."""
    kv = dequantize_fp8(cache, torch.float64)
    s = torch.einsum("qhd,qkd->qhk", q.double(), kv[idx.long()]) * sm_scale
    return torch.softmax(s, -1)


# ----------------------------------------------------------------------------- against the exact reference
@pytest.mark.parametrize("q_granularity", ["token_head", "bf16"])
def test_exact_q_logits_match_reference_and_p_rounding_is_bounded(q_granularity):
    """q exactly e4m3 (scale 1), or QK in bf16: the logits are the exact path's up to float32 accumulation."""
    s_q, h = 5, 3
    q = e4m3_q(s_q, h, seed=3)
    _, cache, idx = inputs(s_q, h, topk=100, seed=3)
    sm = 4e-4  # logits of std ~0.8, spread < 5: no P value subnormal
    if q_granularity == "bf16":  # any bf16 q: not quantized
        q, sm = randn(s_q, h, 576, seed=30, dtype=torch.bfloat16, scale=0.5), 576**-0.5
    got = fp8(q, cache, idx, sm, q_granularity=q_granularity)
    ref = sparse_prefill_reference(q, cache, idx, sm)
    for name, a, b in (("max_logits", got[1], ref[1]), ("lse", got[2], ref[2])):
        d = (a.double() - b.double()).abs().max()
        assert d <= STAT, f"{name} off by {float(d):.2e} with q exactly e4m3 (only float32 accumulation differs)"
    w = weights(q, cache, idx, sm)
    bound = FP8_REL_ERR * torch.einsum("qhk,qkd->qhd", w, values(cache)[idx.long()].abs())
    err = (got[0].double() - ref[0]).abs()
    ratio = float((err / bound).max())
    assert (err <= bound * (1 + 1e-3) + 1e-6).all(), f"P rounding beyond 2**-4 per weight: {ratio:.3f}"
    assert rel_l2(got[0], ref[0]) > 1e-3, "P was not quantized"


@pytest.mark.parametrize("q_granularity", ["token_head_block", "token_head_2term"])
def test_exact_q_granularities_agree(q_granularity):
    q = e4m3_q(4, 2, seed=4)
    _, cache, idx = inputs(4, 2, seed=4)
    a = fp8(q, cache, idx, 5e-4, q_granularity=q_granularity)
    b = fp8(q, cache, idx, 5e-4, q_granularity="token_head")
    for x, y in zip(a, b):  # scale 1 everywhere (a zero residual): the same logits up to the promotion order
        torch.testing.assert_close(x, y, rtol=FP32_ULPS, atol=1e-7)


def test_one_selected_row_gives_its_dequantized_values_exactly():
    q, cache, idx = inputs(5, 4, seed=5)
    length = torch.ones(5, dtype=torch.int32)
    out, ml, lse = fp8(q, cache, idx, topk_length=length)
    want = dequantize_fp8(cache, torch.float32)[idx[:, 0].long(), :512]
    # P = 1 folds to P' = ks, quantized to exactly 448 with scale fl32(ks / 448): the row comes back with
    # only that scale's and the promotion's float32 roundings
    torch.testing.assert_close(out, want[:, None, :].expand_as(out), rtol=FP32_ULPS, atol=0)
    assert torch.equal(ml, lse)
    ref = sparse_prefill_reference(q, cache, idx, topk_length=length)
    assert (ml.double() - ref[1].double()).abs().max() <= FP8_LOGIT_ATOL


def test_repeated_row_counts_per_occurrence():
    q, cache, _ = inputs(3, 2, seed=6)
    idx = torch.full((3, 70), 17, dtype=torch.int32)  # two tiles of one row
    out, ml, lse = fp8(q, cache, idx)
    want = dequantize_fp8(cache, torch.float32)[17, :512]
    torch.testing.assert_close(out, want.expand_as(out), rtol=FP32_ULPS, atol=0)
    torch.testing.assert_close(lse, ml + torch.log(torch.tensor(70.0)), rtol=FP32_ULPS, atol=1e-6)


@pytest.mark.parametrize("p_granularity", ["row_block", "row"])
@pytest.mark.parametrize("acc_mantissa_bits", [None, 13])
def test_gaussian_within_fp8_bounds(p_granularity, acc_mantissa_bits):
    q, cache, idx = inputs(8, 4, s_kv=400, topk=150, seed=7)
    got = fp8(q, cache, idx, p_granularity=p_granularity, acc_mantissa_bits=acc_mantissa_bits)
    ref = sparse_prefill_reference(q, cache, idx)
    e = rel_l2(got[0], ref[0])
    assert 1e-3 < e <= FP8_OUT_REL_L2, e
    assert (got[2].double() - ref[2].double()).abs().max() <= FP8_LSE_ATOL
    assert (got[1].double() - ref[1].double()).abs().max() <= FP8_LOGIT_ATOL


# ----------------------------------------------------------------------------- semantics of the reference
def test_invalid_indices_and_empty_rows_as_the_reference():
    q, cache, idx = inputs(6, 3, s_kv=160, topk=40, seed=8)
    idx = idx.clone()
    idx[0] = -1  # no valid index
    idx[1, ::3] = -1
    idx[2, 1::4] = 160  # >= s_kv
    idx[3, 5] = 10**6
    length = torch.tensor([40, 40, 40, 40, 0, 40], dtype=torch.int32)  # row 4: keeps nothing
    out, ml, lse = fp8(q, cache, idx, topk_length=length)
    r_out, r_ml, r_lse = sparse_prefill_reference(q, cache, idx, topk_length=length)
    for i in (0, 4):
        assert torch.equal(out[i], torch.zeros_like(out[i]))
        assert (ml[i] == float("-inf")).all() and (lse[i] == float("inf")).all()
    assert torch.equal(torch.isinf(ml), torch.isinf(r_ml)) and torch.equal(torch.isinf(lse), torch.isinf(r_lse))
    live = torch.isfinite(r_lse)
    assert torch.isfinite(out).all() and (lse[live].double() - r_lse[live].double()).abs().max() <= FP8_LSE_ATOL
    assert rel_l2(out, r_out) <= FP8_OUT_REL_L2
    # within one P tile (topk <= 64) the ignored entries change nothing: the same as the valid ones packed first
    for i in (1, 2, 3):
        keep = idx[i][(idx[i] >= 0) & (idx[i] < 160)]
        packed = torch.full((1, 40), -1, dtype=torch.int32)
        packed[0, : keep.numel()] = keep
        p = fp8(q[i:i + 1], cache, packed)
        for x, y in zip(p, (out[i:i + 1], ml[i:i + 1], lse[i:i + 1])):
            torch.testing.assert_close(x, y, rtol=FP32_ULPS, atol=1e-7)


def test_unselected_nan_rows_never_reach_an_output():
    q, clean_cache, idx = inputs(4, 2, s_kv=160, topk=40, seed=9)
    cache = clean_cache.clone()
    unused = torch.ones(160, dtype=torch.bool)
    unused[idx.flatten().long()] = False
    bad = torch.nonzero(unused)[:, 0]
    cache[bad, :512] = 0x7F  # e4m3 NaN
    cache[bad, 512:528] = torch.tensor([float("nan")] * 4).view(torch.uint8)
    clean = fp8(q, clean_cache, idx)
    got = fp8(q, cache, idx)
    for x, y in zip(got, clean):
        assert torch.equal(x, y)


def test_topk_length_is_masking_the_tail():
    q, cache, idx = inputs(5, 2, s_kv=300, topk=150, seed=10)
    length = torch.tensor([150, 0, 1, 64, 97], dtype=torch.int64)
    got = fp8(q, cache, idx, topk_length=length)
    cut = idx.clone()
    cut[torch.arange(150)[None, :] >= length[:, None]] = -1
    want = fp8(q, cache, cut)
    for x, y in zip(got, want):  # the same entries at the same places: bit for bit
        assert torch.equal(x, y)
    ref = sparse_prefill_reference(q, cache, idx, topk_length=length)
    assert torch.equal(torch.isinf(got[2]), torch.isinf(ref[2]))


def test_attn_sink_as_the_reference():
    q, cache, idx = inputs(4, 3, seed=11)
    idx = idx.clone()
    idx[2] = -1
    sink = torch.tensor([0.5, float("inf"), float("-inf")], dtype=torch.float32)
    out, ml, lse = fp8(q, cache, idx)
    s_out, s_ml, s_lse = fp8(q, cache, idx, attn_sink=sink)
    assert torch.equal(s_ml, ml) and torch.equal(s_lse, lse)
    assert torch.equal(s_out, apply_attn_sink(out, lse, sink))
    assert torch.equal(s_out[:, 1], torch.zeros_like(s_out[:, 1])) and torch.equal(s_out[:, 2], out[:, 2])
    assert torch.equal(s_out[2], torch.zeros_like(s_out[2]))
    ref = sparse_prefill_reference(q, cache, idx, attn_sink=sink)
    assert rel_l2(s_out, ref[0]) <= FP8_OUT_REL_L2


# ----------------------------------------------------------------------------- the mode's options
def test_accumulator_bits_error_grows_as_bits_shrink():
    q, cache, idx = inputs(4, 2, s_kv=300, topk=130, seed=12)
    base = fp8(q, cache, idx)
    full = fp8(q, cache, idx, acc_mantissa_bits=23)
    # truncation to float32's own 23 bits differs from rounding by at most one ulp per block sum
    torch.testing.assert_close(full[0], base[0], rtol=1e-5, atol=1e-6)
    errs = [rel_l2(fp8(q, cache, idx, acc_mantissa_bits=b)[0], base[0]) for b in (16, 10, 6, 3)]
    assert all(a < b for a, b in zip(errs, errs[1:])), errs
    assert errs[0] < 1e-3 < errs[-1], errs


def test_quantize_q_error_bound_and_block_granularity():
    x = randn(3, 2, 512, seed=13, dtype=torch.float32)
    x.view(3, 2, 4, 128)[:, :, 0] *= 2.0**16  # block 0 far larger: under one scale the rest is e4m3 subnormal
    for gran, n in (("token_head", 1), ("token_head_block", 4)):
        qe, qs = quantize_q(x, gran)
        assert qs.shape == (3, 2, n) and (qe.abs() <= 448).all()
        assert torch.equal(qe, qe.to(torch.float8_e4m3fn).float())
        s = qs.repeat_interleave(512 // n, -1)
        err = (qe * s - x).abs()
        assert (err <= FP8_REL_ERR * x.abs() + 2.0**-10 * s).all(), gran
    small = x.view(3, 2, 4, 128)[:, :, 1:]
    qe, qs = quantize_q(x, "token_head")
    e_tok = rel_l2((qe * qs).view(3, 2, 4, 128)[:, :, 1:], small)
    qe, qs = quantize_q(x, "token_head_block")
    e_blk = rel_l2((qe.view(3, 2, 4, 128) * qs[..., None])[:, :, 1:], small)
    assert e_blk < 0.05 < e_tok, (e_blk, e_tok)  # normal e4m3 (~2.6%) against subnormals


def test_two_term_q():
    x = randn(3, 2, 512, seed=25, dtype=torch.float32)
    (qe1, qs1), (qe2, qs2) = q_terms(x, "token_head_2term")
    assert torch.equal(qe1, quantize_q(x)[0]) and qs2.shape == qs1.shape == (3, 2, 1)
    d = x - qe1 * qs1
    err = (qe1 * qs1 + qe2 * qs2 - x).abs()
    assert (err <= FP8_REL_ERR * d.abs() + 2.0**-10 * qs2 + 1e-7 * x.abs()).all()
    assert rel_l2(qe1 * qs1 + qe2 * qs2, x) < 2e-3 < 0.02 < rel_l2(qe1 * qs1, x)  # ~2**-10 against ~2**-5


def test_two_term_q_holds_lse_where_one_term_does_not():
    """Logits that follow the indexer (large, coherent across a query's rows): one e4m3 term of q shifts lse by
    ~0.3, two terms by ~0.004."""
    q, kv, idx, sm = indexer_aligned_inputs("glm53-like", 8, 2048, 256, 2, d_qk=576, dtype=torch.bfloat16,
                                            device="cpu")
    cache = quantize_fp8(kv)
    ref = sparse_prefill_reference(q, cache, idx, sm)
    d = {g: (fp8(q, cache, idx, sm, q_granularity=g)[2].double() - ref[2].double()).abs().max()
         for g in ("token_head", "token_head_2term")}
    assert d["token_head_2term"] <= FP8_LSE_ATOL < d["token_head"], d


def test_block_q_granularity_helps_a_dominant_block():
    s_q, h = 4, 2
    q = randn(s_q, h, 576, seed=14, dtype=torch.float32)
    q[..., :128] *= 2.0**16
    q = q.to(torch.bfloat16)
    kv = randn(200, 576, seed=15, dtype=torch.float32)
    kv[:, :128] *= 2.0**-16  # block 0 of q and kv: logits of the usual size
    cache = quantize_fp8(kv.to(torch.bfloat16))
    idx = random_indices(s_q, 200, 50, seed=16)
    ref = sparse_prefill_reference(q, cache, idx)
    e_tok = rel_l2(fp8(q, cache, idx, q_granularity="token_head")[0], ref[0])
    e_blk = rel_l2(fp8(q, cache, idx, q_granularity="token_head_block")[0], ref[0])
    assert e_blk < e_tok and e_blk <= FP8_OUT_REL_L2, (e_blk, e_tok)


def test_p_granularity_one_tile_is_the_same():
    q, cache, idx = inputs(4, 2, s_kv=400, topk=P_BLOCK, seed=17)
    for x, y in zip(fp8(q, cache, idx, p_granularity="row"), fp8(q, cache, idx, p_granularity="row_block")):
        assert torch.equal(x, y)  # one tile: one scale either way


def test_p_row_scale_loses_the_far_tiles():
    """One dominant row in tile 0, the rows of the other tiles ~e**-11.5 below it: under one scale a row their
    P values are e4m3 subnormals (448 e**-11.5 ~ 0.0045 < 2**-6), under a scale a tile they stay normal."""
    s_q, h, topk, sm = 2, 2, 4 * P_BLOCK, 1e-5
    q = e4m3_q(s_q, h, seed=21)  # exact in e4m3: P's rounding is the only error
    q[..., 512] = 1.0  # rope channel 0 carries the logits: s ~ k[512] * sm (the latent adds ~0.02)
    q[..., 513:] = randn(s_q, h, 63, seed=22, dtype=torch.bfloat16, scale=1e-3)
    kv = randn(topk, 576, seed=23, dtype=torch.float32)
    kv[:, 512] = (-12.0 + torch.rand(topk, generator=torch.Generator().manual_seed(24))) / sm
    kv[1:P_BLOCK, 512] = -40.0 / sm  # tile 0 holds the dominant row alone (weight e**-40: none)
    kv[0, 512] = 0.0
    cache = quantize_fp8(kv.to(torch.bfloat16))
    idx = torch.arange(topk, dtype=torch.int32).expand(s_q, topk).contiguous()
    ref = sparse_prefill_reference(q, cache, idx, sm)
    e_row = rel_l2(fp8(q, cache, idx, sm, p_granularity="row")[0], ref[0])
    e_blk = rel_l2(fp8(q, cache, idx, sm, p_granularity="row_block")[0], ref[0])
    assert 2 * e_blk < e_row, (e_blk, e_row)


def test_deterministic_and_chunk_independent():
    q, cache, idx = inputs(7, 3, s_kv=300, topk=100, seed=19)
    a = fp8(q, cache, idx, q_granularity="token_head_block", acc_mantissa_bits=13)
    b = fp8(q, cache, idx, q_granularity="token_head_block", acc_mantissa_bits=13)
    c = fp8(q, cache, idx, q_granularity="token_head_block", acc_mantissa_bits=13, chunk=2)
    for x, y, z in zip(a, b, c):
        assert torch.equal(x, y) and torch.equal(x, z)
    assert a[0].dtype == torch.float32 and a[0].shape == (7, 3, 512)


def test_empty_cache_makes_every_row_empty():
    q, _, idx = inputs(3, 2, seed=20)
    out, ml, lse = fp8(q, torch.zeros(0, 656, dtype=torch.uint8), idx)
    assert torch.equal(out, torch.zeros(3, 2, 512)) and (ml == float("-inf")).all() and (lse == float("inf")).all()


# ----------------------------------------------------------------------------- argument errors
@pytest.mark.parametrize("change, exc, needle", [
    (dict(q=torch.zeros(2, 2, 80)), ValueError, "q"),
    (dict(q=torch.zeros(2, 576)), ValueError, "q"),
    (dict(q=torch.zeros(2, 2, 576, dtype=torch.int32)), TypeError, "q"),
    (dict(cache=torch.zeros(10, 576, dtype=torch.bfloat16)), TypeError, "cache"),
    (dict(cache=torch.zeros(10, 655, dtype=torch.uint8)), ValueError, "cache"),
    (dict(cache="kv"), TypeError, "cache"),
    (dict(indices=torch.zeros(2, 4, dtype=torch.int64)), TypeError, "indices"),
    (dict(indices=torch.zeros(3, 4, dtype=torch.int32)), ValueError, "indices"),
    (dict(sm_scale=float("nan")), ValueError, "sm_scale"),
    (dict(topk_length=torch.zeros(3, dtype=torch.int32)), ValueError, "topk_length"),
    (dict(attn_sink=torch.zeros(2, dtype=torch.float64)), TypeError, "attn_sink"),
    (dict(q_granularity="token"), ValueError, "q_granularity"),
    (dict(p_granularity="block"), ValueError, "p_granularity"),
    (dict(acc_mantissa_bits=0), ValueError, "acc_mantissa_bits"),
    (dict(acc_mantissa_bits=24), ValueError, "acc_mantissa_bits"),
    (dict(acc_mantissa_bits=13.0), TypeError, "acc_mantissa_bits"),
    (dict(acc_mantissa_bits=True), TypeError, "acc_mantissa_bits"),
    (dict(chunk=0), ValueError, "chunk"),
])
def test_bad_arguments_are_named(change, exc, needle):
    args = dict(q=torch.zeros(2, 2, 576, dtype=torch.bfloat16), cache=torch.zeros(10, 656, dtype=torch.uint8),
                indices=torch.zeros(2, 4, dtype=torch.int32))
    args.update(change)
    with pytest.raises(exc, match=needle):
        fp8(**args)


# ----------------------------------------------------------------------------- the accuracy study's command
def test_fp8_accuracy_benchmark_smoke(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "run.py"
    spec = importlib.util.spec_from_file_location("quilt_benchmarks_run", path)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    out = tmp_path / "fp8.json"
    argv = ["fp8-accuracy", "--s-q", "4", "--s-kv", "512", "--topk", "64", "--heads", "2", "--workloads", "random",
            "--stats", "gauss", "outlier", "--no-layer", "--acc-bits", "none", "--kernel", "--quiet", "--out", str(out)]
    assert run.main(argv) == 0
    table = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 3 * (4 * 2 + 1)  # (2 stats + aligned) x (4 q x 2 P granularities, and the kernel's)
    assert sum(r["q_granularity"] == "kernel" for r in rows) == 3
    assert sum(line.startswith("|") for line in table.splitlines()) == len(rows) + 2  # header, separator, rows
    for r in rows:
        assert 0 < r["rel_l2"] < 0.2 and r["infinities_match"] and 0.9 < r["min_cos"] <= 1.0


# ============================================================================================ the kernel's arithmetic
from conftest import FP8_MODE_TOL, FP8_MODE_VS_EXACT_REL_L2  # noqa: E402
from quilt_attn import sparse_prefill  # noqa: E402
from quilt_attn.fp8_mode import (  # noqa: E402
    kernel_quantize_q,
    kernel_rows,
    sparse_prefill_fp8_kernel_reference,
)


def test_kernel_q_scale_is_the_power_of_two_above_amax_over_448():
    q = randn(8, 4, 576, seed=11, dtype=torch.bfloat16) * 3
    q[0, 0, 7] = float("inf")  # a non-finite value anywhere in the row: scale NaN (step 5, the exact path)
    q[2, 3, 530] = float("nan")
    q[1, 1, :512] = 0.0  # no nonzero value: scale 1
    qe, qr, qs = kernel_quantize_q(q)
    bad = torch.zeros(8, 4, dtype=torch.bool)
    bad[0, 0] = bad[2, 3] = True
    assert torch.equal(qs.isnan(), bad)
    qs, qe, qr, q = qs[~bad], qe[~bad], qr[~bad], q[~bad]
    amax = q[..., :512].float().abs().amax(-1)
    assert torch.equal(torch.exp2(torch.round(torch.log2(qs))), qs)  # powers of two
    ok = amax > 0
    assert (qs[ok] >= amax[ok] / 448).all() and (qs[ok] / 2 < amax[ok] / 448).all()
    assert (qs[~ok] == 1.0).all() and (~ok).sum() == 1 and qe.abs().max() <= 448
    assert torch.equal(qr.float() * qs[..., None], q[..., 512:].float())  # the rope exactly, divided by qs


@pytest.mark.parametrize("where", [7, 530])  # a latent value, a rope value
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_kernel_reference_gives_a_non_finite_q_query_the_exact_result(where, value):
    """A query with a non-finite q value in one head gets the exact path's result in every head (step 5:
    the repair pass), the other queries the mode's own."""
    q, cache, idx = inputs(s_q=6, h=3, s_kv=64, topk=12, seed=23)
    q = q.clone()
    q[2, 1, where] = value
    sink = randn(3, seed=24, dtype=torch.float32)
    got = sparse_prefill_fp8_kernel_reference(q, cache, idx, attn_sink=sink)
    exact = sparse_prefill_reference(q[2:3], cache, idx[2:3], attn_sink=sink)

    def same(a, b):  # equal, NaN where NaN
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())

    assert all(same(a[2], b[0].float()) for a, b in zip(got, exact))
    assert exact[0][0, 1].isnan().any() and not exact[0][0, 0].isnan().any()  # (the case means something)
    others = torch.tensor([0, 1, 3, 4, 5])
    mine = sparse_prefill_fp8_kernel_reference(q[others], cache, idx[others], attn_sink=sink)
    assert all(torch.equal(a[others], b) for a, b in zip(got, mine))


def test_kernel_rows_keep_a_row_with_one_scale_exactly():
    kv = randn(64, 576, seed=12, dtype=torch.bfloat16)
    cache = quantize_fp8(kv)
    lat, kr, ks, e = kernel_rows(cache)
    scale = cache[:, 512:528].contiguous().view(torch.float32)
    assert torch.equal(ks, scale.amax(-1)) and torch.equal(torch.exp2(e), ks)
    deq = dequantize_fp8(cache).float()
    same = (scale == scale[:, :1]).all(-1)  # rows whose four blocks share one scale: nothing re-rounded
    assert same.any()
    assert torch.equal((lat * ks[:, None])[same], deq[same, :512])
    # the others differ from the exact dequantization only in e4m3 values below 2^-6 of the row scale
    diff = ((lat * ks[:, None]) - deq[:, :512]).abs()
    assert (diff <= 2.0**-9 * ks[:, None]).all()
    assert torch.equal(kr.float() * ks[:, None], deq[:, 512:])


def test_kernel_reference_is_close_to_the_exact_path_on_the_cpu():
    q = randn(8, 16, 576, seed=13, dtype=torch.bfloat16)
    cache = quantize_fp8(randn(2048, 576, seed=14, dtype=torch.bfloat16))
    idx = random_indices(8, 2048, 512, seed=15)
    idx[3] = -1  # an empty row
    got = sparse_prefill_fp8_kernel_reference(q, cache, idx)
    ref = sparse_prefill_reference(q, dequantize_fp8(cache), idx)
    assert rel_l2(got[0], ref[0]) < FP8_MODE_VS_EXACT_REL_L2
    assert (got[0][3] == 0).all() and torch.isinf(got[2][3]).all() and (got[1][3] == float("-inf")).all()
    fin = torch.isfinite(ref[2])
    assert (got[2] - ref[2])[fin].abs().max() < 0.05


@pytest.mark.parametrize("sm_scale", [-0.2, 0.0, 0.3])
def test_kernel_reference_ignores_invalid_entries_at_any_sm_scale(sm_scale):
    """Ignored entries (invalid, past topk_length) carry no weight and empty rows stay empty whatever the sign of
    sm_scale (a negative one once turned the masked logits' -inf into +inf: NaN rows). A list padded with invalid
    entries gives the list's own result, to float32 summation order."""
    q, cache, idx = inputs(s_q=4, h=3, s_kv=64, topk=12, seed=21)
    padded = torch.cat([idx[:, :5], torch.full((4, 3), -1, dtype=torch.int32), idx[:, 5:]], 1)
    padded[1] = -1  # an empty row
    lengths = torch.tensor([15, 15, 0, -3], dtype=torch.int32)  # rows 2 and 3 empty by topk_length
    got = sparse_prefill_fp8_kernel_reference(q, cache, padded, sm_scale, topk_length=lengths)
    want = sparse_prefill_fp8_kernel_reference(q, cache, idx, sm_scale)
    empty = torch.tensor([False, True, True, True])
    assert not got[0].isnan().any() and not got[2].isnan().any()
    assert (got[0][empty] == 0).all() and (got[1][empty] == float("-inf")).all() and torch.isposinf(got[2][empty]).all()
    assert torch.allclose(got[0][0], want[0][0], rtol=FP32_ULPS * 64, atol=0)
    assert torch.allclose(got[2][0], want[2][0], rtol=FP32_ULPS * 64, atol=0)


def test_fp8_precision_through_sparse_prefill_reference_method():
    q = randn(4, 8, 576, seed=16, dtype=torch.bfloat16)
    kv = randn(512, 576, seed=17, dtype=torch.bfloat16)
    idx = random_indices(4, 512, 128, seed=18)
    got = sparse_prefill(q, kv, idx, precision="fp8", method="reference")  # dense kv: quantized first
    want = sparse_prefill_fp8_kernel_reference(q, quantize_fp8(kv), idx)
    assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], want[0].to(torch.bfloat16))
    assert torch.equal(got[2], want[2])


@pytest.mark.parametrize("kw, exc, needle", [
    (dict(precision="fp4"), ValueError, "precision"),
    (dict(precision="fp8", backend="triton"), ValueError, "CUDA backend"),
    (dict(precision="fp8", q_dtype=torch.float16), TypeError, "bf16 q"),
])
def test_fp8_precision_refuses_what_it_cannot_run(kw, exc, needle):
    dt = kw.pop("q_dtype", torch.bfloat16)
    q = randn(4, 8, 576, seed=19, dtype=dt)
    cache = quantize_fp8(randn(512, 576, seed=20, dtype=torch.bfloat16))
    with pytest.raises(exc, match=needle):
        sparse_prefill(q, cache, random_indices(4, 512, 128, seed=21), **kw)


def _fp8_case(h, s_q, topk, workload, seed):
    from quilt_attn.workloads import generate

    q = randn(s_q, h, 576, seed=seed, dtype=torch.bfloat16, device="cuda")
    cache = quantize_fp8(randn(8192, 576, seed=seed + 1, dtype=torch.bfloat16, device="cuda"))
    idx = generate(workload, s_q, 8192, topk, seed=seed, device="cuda")
    return q, cache, idx


@pytest.mark.gpu
@pytest.mark.parametrize("h, method, workload, extras", [
    (16, "query_parallel", "random", ""), (64, "query_parallel", "glm53-like", "len,sink"),
    (3, "query_parallel", "random", "neg"), (128, "quilt", "random", "sink"),
    (16, "quilt", "glm53-like", ""), (8, "quilt", "glm53-like", "neg,len"), (5, "quilt", "ds32-like", "sink"),
    (32, "quilt", "glm53-like", "neg,sink"),
])
def test_fp8_mode_kernel_matches_its_emulation(h, method, workload, extras, nan_poison):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8 mode runs on sm_90")
    q, cache, idx = _fp8_case(h, 96, 1024, workload, seed=h)
    kw = {}
    if "neg" in extras:
        idx = idx.clone()
        idx[::3, ::5] = -1
        idx[7] = -1  # an empty row
    if "len" in extras:
        kw["topk_length"] = torch.randint(0, 1025, (96,), device="cuda", dtype=torch.int32,
                                          generator=torch.Generator(device="cuda").manual_seed(h))
    if "sink" in extras:
        kw["attn_sink"] = randn(h, seed=h + 7, dtype=torch.float32, device="cuda")
    got = sparse_prefill(q, cache, idx, precision="fp8", method=method, **kw)
    want = sparse_prefill_fp8_kernel_reference(q, cache, idx, **kw)
    out, ml, lse = got
    assert not out.isnan().any() and not lse.isnan().any() and not ml.isnan().any()
    assert rel_l2(out, want[0]) < FP8_MODE_TOL.rel_l2
    assert torch.equal(torch.isinf(lse), torch.isinf(want[2])) and torch.equal(torch.isinf(ml), torch.isinf(want[1]))
    fin = torch.isfinite(want[2])
    assert (lse - want[2])[fin].abs().max() < FP8_MODE_TOL.stat_atol
    assert (ml - want[1])[fin].abs().max() < FP8_MODE_TOL.stat_atol
    empty = torch.isinf(want[2])
    assert (out[empty] == 0).all()
    exact = sparse_prefill_reference(q, dequantize_fp8(cache), idx, **kw)
    assert rel_l2(out, exact[0]) < FP8_MODE_VS_EXACT_REL_L2


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["quilt", "query_parallel"])
def test_fp8_mode_gives_a_non_finite_q_query_the_exact_result(method, nan_poison):
    """The kernel follows step 5: the queries with a non-finite q value come back as the exact path gives them
    (bf16 tolerance of the float64 reference, NaN where it has NaN), the others as the mode's emulation."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8 mode runs on sm_90")
    q, cache, idx = _fp8_case(16, 96, 1024, "glm53-like", seed=6)
    q = q.clone()
    q[5, 3, 100] = float("inf")
    q[6, 0, 540] = float("-inf")  # its group partner (rope)
    q[40, 15, 0] = float("nan")
    bad = torch.tensor([5, 6, 40])
    got = [t.cpu() for t in sparse_prefill(q, cache, idx, precision="fp8", method=method)]
    want = [t.cpu() for t in sparse_prefill_fp8_kernel_reference(q, cache, idx)]
    exact = [t.cpu() for t in sparse_prefill_reference(q[bad], cache, idx[bad])]
    tol = TOLERANCES[torch.bfloat16]
    for i in (0, 2):  # out, lse (a GPU max may skip a NaN logit: max_logits' NaN are not compared)
        g, e = got[i][bad].double(), exact[i].double()
        assert torch.equal(g.isnan(), e.isnan()) and torch.equal(want[i][bad].isnan(), e.isnan())
        assert e.isnan().any() and not e.isnan().all()  # (the case means something)
        ok = e.isfinite()
        assert torch.equal(g.isinf(), e.isinf())
        assert ((g - e).abs()[ok] <= (tol.atol + tol.rtol * e.abs())[ok] if i == 0 else
                (g - e).abs()[ok] <= tol.stat_atol).all()
    keep = torch.ones(96, dtype=torch.bool)
    keep[bad] = False
    assert not got[0][keep].isnan().any() and rel_l2(got[0][keep], want[0][keep]) < FP8_MODE_TOL.rel_l2


@pytest.mark.gpu
def test_fp8_mode_repairs_a_partner_rows_nan():
    """A NaN latent value in a row one query selects must not reach its tile partners (the repair pass)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the FP8 mode runs on sm_90")
    q, cache, idx = _fp8_case(16, 64, 512, "glm53-like", seed=4)
    row = int(idx[0, 0])
    cache = cache.clone()
    cache[row, 3] = 0x7F  # e4m3 NaN
    out, _, lse = sparse_prefill(q, cache, idx, precision="fp8", method="quilt")
    selects = (idx == row).any(-1)
    assert out[selects].isnan().any(-1).any(-1).all()  # the queries that chose it see it (as the exact path)
    assert not out[~selects].isnan().any()
