"""FP8 KV cache (DeepSeek-V3.2 656-byte layout): layout, round-trip error bound, edge cases, errors.

Error bound of one latent value ``x`` in a group of 128 with power-of-two scale ``s``
(``s = 2**ceil(log2(amax / 448))``, so ``|x| / s <= 448``, the largest finite e4m3 value, and no
value saturates):

* ``y = x / s`` is exact (division by a power of two, no float32 underflow for the data here);
* e4m3 has 3 stored mantissa bits. For a normal ``|y| >= 2**-6`` with ``2**e <= |y| < 2**(e+1)``
  the spacing is ``2**(e-3)``, so round-to-nearest errs by at most ``2**(e-4) <= 2**-4 * |y|``;
  for a subnormal ``|y| < 2**-6`` the spacing is ``2**-9``, error ``<= 2**-10``;
* dequantization ``fp8 * s`` (in float32) is exact.

Hence ``|x - deq(q(x))| <= 2**-4 * |x| + 2**-10 * s`` for every latent element, where ``s`` is its
group's scale (the absolute term only matters for values below ``2**-6 * s``, i.e. more than
~2**15 times smaller than the group's largest value). Rope values are stored as bf16 and come
back exactly.
"""
from __future__ import annotations

import pytest
import torch

from conftest import randn
from quilt_attn import kv_cache, sparse_prefill, sparse_prefill_reference
from quilt_attn.kv_cache import FP8_BYTES, FP8_REL_ERR, dequantize_fp8, is_fp8_cache, quantize_fp8


def scales_of(cache):
    return cache[:, 512:528].contiguous().view(torch.float32)  # [s_kv, 4]


def mixed_magnitude_kv(s_kv=16, seed=0, binades=20):
    """Rows spanning many binades: per-row magnitudes 2**-binades .. 2**binades, a few tiny values a group."""
    x = randn(s_kv, 576, seed=seed, dtype=torch.float32)
    row_scale = torch.exp2(torch.linspace(-binades, binades, s_kv))[:, None]
    x = x * row_scale
    x[:, 5] *= 1e-6  # values far below their group's max: e4m3 subnormals / zero after scaling
    x[:, 300] *= 2**-12
    return x


def test_constants_and_layout_size():
    assert FP8_BYTES == 656 == 512 + 4 * 4 + 2 * 64
    assert FP8_REL_ERR == 2.0**-4
    kv = randn(7, 576, seed=1, dtype=torch.bfloat16)
    cache = quantize_fp8(kv)
    assert cache.dtype == torch.uint8 and cache.shape == (7, 656) and cache.is_contiguous()
    assert is_fp8_cache(cache) and is_fp8_cache(cache[:, None, :])
    assert not is_fp8_cache(kv) and not is_fp8_cache(torch.zeros(3, 655, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scales_are_powers_of_two_fitting_e4m3(dtype):
    kv = mixed_magnitude_kv(seed=2, binades=8 if dtype == torch.float16 else 20).to(dtype).float()
    cache = quantize_fp8(kv.to(dtype))
    s = scales_of(cache)
    assert (s > 0).all() and torch.isfinite(s).all()
    mant, _ = torch.frexp(s)
    assert (mant == 0.5).all(), "scales must be exact powers of two"
    amax = kv[:, :512].abs().view(-1, 4, 128).amax(-1)
    ratio = amax / s
    # the smallest power of two with amax / s <= 448
    assert (ratio <= 448).all() and (ratio > 224).all()


def test_scale_at_exact_power_of_two_boundary():
    kv = torch.full((1, 576), 0.5)
    kv[0, :128] = 448.0 / 8  # amax / 448 = 2**-3 exactly -> scale 2**-3, y = 448 exactly
    kv[0, 128:256] = 448.0
    cache = quantize_fp8(kv)
    assert scales_of(cache)[0, :2].tolist() == [2.0**-3, 1.0]
    back = dequantize_fp8(cache, torch.float32)
    assert torch.equal(back[0, :256], kv[0, :256])  # 448 is representable: no saturation error


def test_latent_bytes_are_e4m3_of_scaled_values():
    kv = randn(9, 576, seed=3, dtype=torch.float32)
    cache = quantize_fp8(kv)
    s = scales_of(cache)
    y = (kv[:, :512].view(9, 4, 128) / s[..., None]).view(9, 512)
    want = y.to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(cache[:, :512], want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rope_bytes_are_the_bf16_values(dtype):
    kv = randn(6, 576, seed=4, dtype=dtype)
    cache = quantize_fp8(kv)
    rope = cache[:, 528:].contiguous().view(torch.bfloat16)
    assert torch.equal(rope, kv[:, 512:].to(torch.bfloat16))
    # and they come back bit-exactly
    back = dequantize_fp8(cache, torch.bfloat16)
    assert torch.equal(back[:, 512:], kv[:, 512:].to(torch.bfloat16))


def test_round_trip_error_bound():
    kv = mixed_magnitude_kv(s_kv=41, seed=5)
    cache = quantize_fp8(kv)
    back = dequantize_fp8(cache, torch.float32)
    s = scales_of(cache).repeat_interleave(128, dim=1)  # [s_kv, 512] scale of each element
    x = kv[:, :512]
    err = (back[:, :512] - x).abs()
    bound = 2.0**-4 * x.abs() + 2.0**-10 * s
    assert (err <= bound).all(), f"max excess {float((err - bound).max()):.3e}"
    # the bound is not vacuous: in the normal range the relative error reaches close to 2**-4
    normal = x.abs() >= 2.0**-6 * s
    assert (err[normal] / x[normal].abs()).max() > 2.0**-5
    # rope: the bf16 rounding of the input only
    assert torch.equal(back[:, 512:], kv[:, 512:].to(torch.bfloat16).float())


def test_round_trip_default_dtype_is_bf16():
    kv = randn(4, 576, seed=6, dtype=torch.bfloat16)
    back = dequantize_fp8(quantize_fp8(kv))
    assert back.dtype == torch.bfloat16 and back.shape == (4, 576)
    # e4m3 value * power-of-two scale is exact in bf16 (3 mantissa bits < 8)
    assert torch.equal(back.float(), dequantize_fp8(quantize_fp8(kv), torch.float32))


def test_zero_rows_and_groups():
    kv = randn(4, 576, seed=7, dtype=torch.float32)
    kv[1] = 0.0  # a zero row
    kv[2, 128:256] = 0.0  # a zero group inside a non-zero row
    cache = quantize_fp8(kv)
    s = scales_of(cache)
    assert torch.isfinite(s).all() and (s > 0).all()
    back = dequantize_fp8(cache, torch.float32)
    assert torch.isfinite(back).all()
    assert (back[1] == 0).all()
    assert (back[2, 128:256] == 0).all()
    err = (back[:, :512] - kv[:, :512]).abs()
    assert (err <= 2.0**-4 * kv[:, :512].abs() + 2.0**-10 * s.repeat_interleave(128, 1)).all()


def test_flashmla_layout_and_noncontiguous_input():
    kv = randn(5, 576, seed=8, dtype=torch.bfloat16)
    ref = quantize_fp8(kv)
    assert torch.equal(quantize_fp8(kv[:, None, :]), ref)
    wide = randn(5, 2 * 576, seed=8, dtype=torch.bfloat16)
    view = wide[:, ::2]  # non-contiguous
    assert torch.equal(quantize_fp8(view), quantize_fp8(view.contiguous()))
    assert torch.equal(dequantize_fp8(ref[:, None, :]), dequantize_fp8(ref))


def test_large_values_do_not_saturate():
    kv = randn(3, 576, seed=9, dtype=torch.float32) * 1e5
    back = dequantize_fp8(quantize_fp8(kv), torch.float32)
    assert (back[:, :512] - kv[:, :512]).abs().le(2.0**-4 * kv[:, :512].abs() + 1e-30).all()


# ----------------------------------------------------------------------------- errors
def test_quantize_errors():
    with pytest.raises(TypeError, match="kv must be a torch.Tensor"):
        quantize_fp8([[0.0] * 576])
    with pytest.raises(ValueError, match="kv must have d_qk = 576"):
        quantize_fp8(torch.randn(3, 575))
    with pytest.raises(ValueError, match=r"kv must be \[s_kv, 576\]"):
        quantize_fp8(torch.randn(576))
    with pytest.raises(ValueError, match=r"kv must be \[s_kv, 576\]"):
        quantize_fp8(torch.randn(3, 2, 576))
    with pytest.raises(TypeError, match="kv must have dtype"):
        quantize_fp8(torch.randn(3, 576, dtype=torch.float64))
    with pytest.raises(TypeError, match="kv must have dtype"):
        quantize_fp8(torch.ones(3, 576, dtype=torch.int32))


def test_dequantize_errors():
    with pytest.raises(TypeError, match="cache must be a torch.Tensor"):
        dequantize_fp8(None)
    with pytest.raises(ValueError, match="cache must be uint8"):
        dequantize_fp8(torch.zeros(3, 655, dtype=torch.uint8))
    with pytest.raises(ValueError, match="cache must be uint8"):
        dequantize_fp8(torch.zeros(3, 656, dtype=torch.float32))
    with pytest.raises(ValueError, match="cache must be uint8"):
        dequantize_fp8(torch.zeros(656, dtype=torch.uint8))
    with pytest.raises(ValueError, match="cache must be uint8"):
        dequantize_fp8(torch.zeros(3, 2, 656, dtype=torch.uint8))


def test_module_constants_consistent():
    assert kv_cache.D_QK == kv_cache.D_NOPE + kv_cache.D_ROPE == 576
    assert kv_cache.FP8_NUM_SCALES * kv_cache.FP8_GROUP == kv_cache.D_NOPE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_expand_fp8_equals_dequantize(dtype, monkeypatch):
    """The once-per-call expansion kernel (Triton; its interpreter on a CPU) gives dequantize_fp8's values bit
    for bit, for row counts that do not fill its last program."""
    from quilt_attn.ops.fp8_expand import ROWS_PER_PROGRAM, expand_fp8

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    for s_kv in (0, 1, ROWS_PER_PROGRAM + 5):
        cache = quantize_fp8(randn(s_kv, 576, seed=s_kv, dtype=torch.bfloat16).to(device) * 7)
        got, want = expand_fp8(cache, dtype), dequantize_fp8(cache, dtype)
        assert got.dtype == dtype and torch.equal(got.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match="cache must be uint8"):
        expand_fp8(torch.zeros(3, 576, dtype=torch.uint8))
    with pytest.raises(TypeError, match="dtype must be bfloat16 or float16"):
        expand_fp8(quantize_fp8(randn(2, 576, seed=1, dtype=torch.bfloat16)), torch.float32)


def test_quantize_non_finite_values_stay_in_their_element():
    """One inf / NaN no longer turns its whole 128-value group into NaN: the group scale comes from the finite
    values, NaN stays NaN in its own element, +-inf saturates to +-448 * scale (e4m3fn has no infinity)."""
    kv = torch.randn(3, 576, generator=torch.Generator().manual_seed(7))
    kv[0, 5] = kv[1, 130] = kv[2, 300] = kv[2, 520] = 0.0  # (so the clean row's group maxima are the same)
    bad = kv.clone()
    bad[0, 5] = float("inf")
    bad[1, 130] = float("nan")
    bad[2, 300] = float("-inf")
    bad[2, 520] = float("nan")  # a rope value: kept as bf16 NaN
    back = dequantize_fp8(quantize_fp8(bad), torch.float32)
    want = dequantize_fp8(quantize_fp8(kv), torch.float32)
    special = torch.zeros_like(bad, dtype=torch.bool)
    special[0, 5] = special[1, 130] = special[2, 300] = special[2, 520] = True
    assert torch.isnan(back).nonzero().tolist() == [[1, 130], [2, 520]]
    scale = quantize_fp8(bad)[:, 512:528].contiguous().view(torch.float32)  # [3, 4]
    assert back[0, 5] == 448 * scale[0, 0] and back[2, 300] == -448 * scale[2, 2]
    # every other element is exactly what the clean row gives (same scales: from the finite values)
    assert torch.equal(scale, scales_of(quantize_fp8(kv)))
    assert torch.equal(back[~special], want[~special])
    all_inf = torch.full((1, 576), float("inf"))
    got = dequantize_fp8(quantize_fp8(all_inf), torch.float32)
    assert (got[0, :512] == 448).all()  # no finite value: scale 1


def test_fp8_cache_layout_is_checked_in_one_place():
    """A 1-D ``[656]`` buffer (it read as 656 rows) or ``[s_kv, 2, 656]``: ValueError naming the argument."""
    from quilt_attn.kv_cache import canonical_fp8_cache

    cache = quantize_fp8(torch.randn(4, 576))
    assert canonical_fp8_cache(cache[:, None, :]).shape == (4, 656)
    q = torch.randn(2, 1, 576)
    idx = torch.zeros(2, 3, dtype=torch.int32)
    for bad in (cache[0], cache.view(2, 2, 656)):
        with pytest.raises(ValueError, match=r"kv must be uint8 \[s_kv, 656\]"):
            canonical_fp8_cache(bad)
        with pytest.raises(ValueError, match=r"kv must be uint8 \[s_kv, 656\]"):
            sparse_prefill_reference(q, bad, idx)
        with pytest.raises(ValueError, match=r"kv must be uint8 \[s_kv, 656\]"):
            sparse_prefill(q.half(), bad, idx, method="query_parallel")
        with pytest.raises(ValueError, match=r"cache must be uint8 \[s_kv, 656\]"):
            dequantize_fp8(bad)


@pytest.mark.parametrize("packed", [True, False])
def test_fp8_compaction_widens_the_referenced_rows_and_renumbers_them(packed, monkeypatch):
    """``fp8_compact.compact_columns`` and ``Compaction.widen`` (Triton; its interpreter on a CPU): every
    referencing word, renumbered, reaches the same dequantized values as the original row did (bit for bit);
    padding, negative and out-of-pool words are unchanged (all words, when the rows overflow ``cap``); compact
    rows are in pool order; ``fits`` is 1 exactly when the distinct rows are at most ``cap``; ``in_place``
    renumbers the words themselves alike; ``expand_fp8(rows=...)`` widens the listed rows."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    from quilt_attn.ops.fp8_compact import compact_columns
    from quilt_attn.ops.fp8_expand import expand_fp8

    s_kv = 700
    cache = quantize_fp8(randn(s_kv, 576, seed=3, dtype=torch.bfloat16).to(device) * 5)
    dense_all = dequantize_fp8(cache)
    g = torch.Generator().manual_seed(5)
    rows = torch.randint(0, s_kv, (40, 64), generator=g, dtype=torch.int32)
    rows[3, :10] = rows[0, :10]  # repeated rows
    bits = torch.randint(1, 256, rows.shape, generator=g, dtype=torch.int32)
    if packed:
        words = rows | (bits << 24)
        words[5, 40:] = -1  # padding
        words[6, 3] = s_kv + 9 | (1 << 24)  # a row past the pool
        ok = (words != -1) & ((words & 0xFFFFFF) < s_kv)
        row_of = lambda w: w & 0xFFFFFF  # noqa: E731
    else:
        words = rows.clone()
        words[5, 40:] = -1
        words[6, 3] = s_kv + 9
        ok = (words >= 0) & (words < s_kv)
        row_of = lambda w: w  # noqa: E731
    distinct = torch.unique(row_of(words)[ok]).numel()
    words = words.to(device)
    ok = ok.to(device)
    for cap, fits_want in ((s_kv, 1), (distinct, 1), (distinct - 1, 0)):
        c = compact_columns(words, s_kv, cap, packed=packed)
        dense, remapped, fits = c.widen(cache), c.columns, c.fits
        spent = words.clone()  # renumbered in place: the same numbering, in the words themselves
        c_in = compact_columns(spent, s_kv, cap, packed=packed, in_place=True)
        assert c_in.columns is spent and torch.equal(spent, remapped) and torch.equal(c_in.rows, c.rows)
        assert dense.shape == (cap, 576) and remapped.shape == words.shape and int(fits) == fits_want
        assert torch.equal(remapped[~ok], words[~ok])
        if not fits_want:  # overflowing: every word unchanged (the launch over the cache reads them)
            assert torch.equal(remapped, words)
        if packed:
            assert torch.equal(remapped[ok] >> 24, words[ok] >> 24)  # member bits kept
        new, old = row_of(remapped[ok]).long(), row_of(words[ok]).long()
        if fits_want:
            assert torch.equal(dense[new].view(torch.int16), dense_all[old].view(torch.int16))
            assert int(new.max()) == distinct - 1
        order = torch.unique(old)  # pool order: compact row i is the i-th referenced row
        listed = order[:cap]
        assert torch.equal(dense[:listed.numel()].view(torch.int16), dense_all[listed].view(torch.int16))
    picked = torch.tensor([4, 0, 699, 4], dtype=torch.int32, device=device)
    assert torch.equal(expand_fp8(cache, rows=picked).view(torch.int16), dense_all[picked.long()].view(torch.int16))
    two = torch.tensor([2], dtype=torch.int32, device=device)  # only the first two rows widened
    assert torch.equal(expand_fp8(cache, rows=picked, count=two)[:2].view(torch.int16),
                       dense_all[picked[:2].long()].view(torch.int16))
    with pytest.raises(ValueError, match="count must be"):
        expand_fp8(cache, count=two)
    with pytest.raises(ValueError, match="cap must be"):
        compact_columns(words, s_kv, 0, packed=packed)
    with pytest.raises(ValueError, match="words must be contiguous int32"):
        compact_columns(words.long(), s_kv, 4, packed=packed)


def test_quantize_fp8_of_an_empty_strided_view():
    """No rows in a view whose last dimension is not unit-stride: an empty cache, not a view error (found by the
    FP8-mode fuzz)."""
    big = torch.randn(0, 576, 2).to(torch.bfloat16)
    cache = quantize_fp8(big[..., 0])
    assert cache.shape == (0, 656) and cache.dtype == torch.uint8
