"""CPU reference of the opt-in FP8 tensor-core mode (Hopper e4m3 wgmma): its arithmetic, specified.

The exact path (``sparse_prefill`` on the FP8 cache) dequantizes the cache and multiplies in bf16 with
float32 accumulation. The FP8 mode instead feeds the e4m3 values of the cache straight to FP8 tensor
cores, which needs q and the softmax weights P in e4m3 too. ``sparse_prefill_fp8_reference`` emulates
that arithmetic on the CPU; a kernel of the mode implements exactly the steps below (where it may
differ: "Kernel freedom" at the end).

Notation (one query ``i``, head ``j``, its selected kv rows ``r`` in list order; d_qk = 576 = 512 latent
+ 64 rope; the latent is 4 blocks ``b`` of 128 columns; ``fl32(x)`` rounds to float32, nearest even;
``e4m3(x)`` rounds to float8_e4m3fn, nearest even, after clamping to [-448, 448]; ``sum32`` is a float32
accumulator of float32 products: here the exact sum, rounded once, which a kernel's chain of float32
fmas matches to a few float32 ulps).
From the FP8 cache (``quilt_attn.kv_cache``, 656 bytes a row): ``Ke[r, c]`` the e4m3 latent values,
``ks[r, b]`` their float32 block scales (powers of two, ``quantize_fp8``), ``Kr[r, :]`` the bf16 rope.
The values V are the latent columns: ``Ve = Ke``.

1. q quantization (once per query). ``q_granularity="token_head"``: one scale a (query, head),
   ``qs = fl32(amax / 448)``, ``amax = max |q[i, j, :512]|``; ``"token_head_block"``: one scale per
   (query, head, 128-column block), ``qs[b] = fl32(amax_b / 448)``. ``Qe[c] = e4m3(fl32(q[c] / qs))``
   (an IEEE float32 division). The amax is taken over finite values; a group without a finite
   nonzero value gets ``qs = 1``; so ``+-inf`` saturates to ``+-448 qs`` and NaN stays NaN (as the
   cache's own quantization). ``"token_head_2term"``: q as two e4m3 terms, each with a scale a (query,
   head): ``Qe1, qs1`` as token_head, the residual ``d = fl32(q - fl32(Qe1 * qs1))``,
   ``qs2 = fl32(amax(d) / 448)``, ``Qe2 = e4m3(fl32(d / qs2))``: ~8 mantissa bits of q for two FP8
   products (the tensor time of QK in bf16).
   Each term ``t`` has its e4m3 values ``Qe_t`` and scales ``qs_t[b]`` (one value for every b when the
   scale is a (query, head)'s). The rope part stays bf16: ``Qr = bf16(q[i, j, 512:])`` (exact for bf16 q).
   ``q_granularity="bf16"``: q is not quantized and QK is not an FP8 product (the FP8 mode for PV only):
   ``s = fl32(fl32(sum_c bf16(q[c]) * Kd[r, c]) * fl32(sm_scale))`` over all 576 columns, ``Kd`` the
   dequantized cache row (``Ke * ks`` is exact in bf16), as the exact path's bf16 wgmma computes it.
2. QK, one 128-column block at a time (four K = 128 e4m3 wgmma blocks, promoted to float32 each)::

       S_tb = acc( sum_{c in block b} Qe_t[c] * Ke[r, c] )   products exact; acc: see below
       L = sum32_{t, b}( S_tb * fl32(qs_t[b] * ks[r, b]) )   promotions: an fma per term and block
       R = fl32( sum_c Qr[c] * Kr[r, c] )                    bf16 products, float32 accumulator
       s = fl32( fl32(L + R) * fl32(sm_scale) )

   ``acc``: ``acc_mantissa_bits=None``: the exact block sum rounded once to float32 (an ideal float32
   accumulator). ``acc_mantissa_bits=m``: the exact block sum truncated (toward zero) to ``m`` stored
   mantissa bits, a model of the FP8 wgmma accumulator, which keeps only ~13-14 bits while it adds
   (the reason for promoting to float32 every 128 columns); a model of the error's size, not the
   hardware's bits.
3. Softmax in float32, with the semantics of ``quilt_attn.reference`` (invalid entries -1 or >= s_kv
   and entries past ``topk_length`` ignored, empty rows ``out = 0``, ``max_logits = -inf``,
   ``lse = +inf``, ``attn_sink`` applied to ``out`` at the end)::

       m = max_r s          P[r] = fl32(exp(s_r - m))          l = fl32(sum_r P[r])

4. PV. V's block scale is folded into P, so each 128-column block b of the output has its own
   quantized P (four quantized P matrices a kv tile)::

       P'_b[r] = fl32(P[r] * ks[r, b])                        (exact: ks is a power of two)
       for each kv tile t (64 consecutive list entries, the last one padded with ignored entries)
       and each b:
           ps = fl32(max_{r in g} P'_b[r] / 448)              (1 where that max is 0)
                g = t for ``p_granularity="row_block"``; g = the whole list for ``"row"``
           Pe_b[r] = e4m3(fl32(P'_b[r] / ps))
           T = acc( sum_{r in t} Pe_b[r] * Ve[r, block b] )   products exact; acc as in step 2
           O[block b] = sum32_t( T * ps )                     promotions: an fma per tile
       out = fl32(O / l),  lse = fl32(m + log(l)) (natural log),  max_logits = m

Outputs: ``out`` float32 ``[s_q, h, 512]`` (the kernel's float32 ``O / l`` before it rounds to q's dtype
on the store: ``out.to(q.dtype)`` is the kernel's output), ``max_logits`` and ``lse`` float32 ``[s_q, h]``.

Kernel freedom (what a kernel may do differently and still implement this mode): the order of the
float32 sums of steps 3 (``l``) and R; the online softmax (P relative to a running max, ``O`` and ``l``
rescaled when it grows: P's block scale is relative to the block's own max, so the e4m3 values change
only where a float32 rounding flips an e4m3 rounding); ``exp2`` of base-2 logits instead of ``exp``;
the order and the intermediate float32 roundings of every ``sum32``. These are float32-rounding effects,
far below the e4m3 roundings of steps 1 and 4. The P blocks are the kernel's kv tiles: a query-parallel
kernel's tiles are 64 consecutive list entries, as here; a QUILT kernel's tiles group rows differently,
which changes the scales (not the error statistics).
``"row"`` needs each row's ``m`` and ``max_r P'_b`` before the PV product (a second pass, or a bound):
it is the coarse granularity the study compares against, not a one-pass kernel.

Emulation: the exact sums of steps 2 and 4 are float64 sums of e4m3 products, exact: an e4m3 value is a
multiple of 2**-9 below 2**9, so a sum of N products is a multiple of 2**-18 below N * 2**18, which
float64's 53 bits hold for N <= 2**17 (under "bf16" QK's sum of bf16 products is a float64 sum, rounded
once). A ``sum32`` is a float64 sum of the (exact) float64 products of float32 values, rounded to float32.
q is read as float32.
"""
from __future__ import annotations

import numbers

import torch

from ._checks import (
    FLOAT_DTYPES,
    canonical_indices,
    check_attn_sink,
    check_sm_scale,
    check_topk_length,
    require_dtype,
    require_ndim,
    require_same_device,
    require_tensor,
)
from .kv_cache import D_NOPE, D_QK, FP8_E4M3_MAX, FP8_GROUP, FP8_NUM_SCALES, canonical_fp8_cache, split_fp8_rows
from .reference import apply_attn_sink, sparse_prefill_reference, valid_index_mask

Q_GRANULARITIES = ("token_head", "token_head_block", "token_head_2term", "bf16")
P_GRANULARITIES = ("row_block", "row")
P_BLOCK = 64  # kv rows a P scale covers under "row_block": the kernel's kv tile
MAX_ACC_BITS = 23  # float32's stored mantissa bits
# elements of the largest float64 intermediate of one chunk of queries (bounds memory: 2**25 = 256 MiB)
_BUDGET = 1 << 25


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 ``x`` rounded to float8_e4m3fn (nearest even; clamped to +-448 first, NaN kept), as float32."""
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def _accumulate(exact: torch.Tensor, bits: int | None) -> torch.Tensor:
    """The float32 accumulator's value of an exact (float64) sum: rounded to float32, or truncated toward zero
    to ``bits`` stored mantissa bits (the FP8 wgmma accumulator model)."""
    if bits is None:
        return exact.to(torch.float32)
    mant, exp = torch.frexp(exact)  # mant in [0.5, 1): bits + 1 significant bits = 1 implicit + bits stored
    step = float(2 ** (bits + 1))
    return torch.ldexp(torch.trunc(mant * step) / step, exp).to(torch.float32)




def quantize_q(q_latent: torch.Tensor, granularity: str = "token_head"):
    """Step 1 of the mode: q's latent part in e4m3 with float32 scales.

    Parameters
    ----------
    q_latent : ``[..., 512]`` float tensor (q's latent columns).
    granularity : "token_head" (one scale for the 512 columns) or "token_head_block" (one per 128).

    Returns
    -------
    ``(qe, qs)``: ``qe [..., 512]`` float32 holding e4m3 values, ``qs`` float32 ``[..., 1]`` (token_head) or
    ``[..., 4]`` (token_head_block), ``q ~= qe * qs`` block-wise.
    """
    x = q_latent.to(torch.float32)
    groups = 1 if granularity == "token_head" else FP8_NUM_SCALES
    xg = x.reshape(*x.shape[:-1], groups, D_NOPE // groups)
    # the scale from the finite values only: one inf / NaN spoils no other element (as quantize_fp8)
    amax = torch.where(torch.isfinite(xg), xg.abs(), 0.0).amax(dim=-1)
    qs = torch.where(amax > 0, amax / FP8_E4M3_MAX, 1.0).to(torch.float32)
    qe = _e4m3(xg / qs[..., None]).reshape(x.shape)
    return qe, qs


def q_terms(q_latent: torch.Tensor, granularity: str = "token_head"):
    """q's latent part as the e4m3 terms the QK products of ``granularity`` multiply (step 1).

    Returns a list of ``(qe [..., 512], qs [..., 1 | 4])`` (``quantize_q``): one term, or two for
    "token_head_2term" (q ~= qe1 * qs1 + qe2 * qs2); for "bf16" one term of q's bf16 values with scale 1.
    """
    if granularity == "bf16":
        x = q_latent.to(torch.bfloat16).to(torch.float32)
        return [(x, torch.ones(*x.shape[:-1], 1))]
    if granularity != "token_head_2term":
        return [quantize_q(q_latent, granularity)]
    x = q_latent.to(torch.float32)
    qe1, qs1 = quantize_q(x, "token_head")
    qe2, qs2 = quantize_q(x - qe1 * qs1, "token_head")  # float32 residual, then its own e4m3 term
    return [(qe1, qs1), (qe2, qs2)]


def _decode_rows(rows: torch.Tensor):
    """Gathered FP8 cache rows ``uint8 [..., 656]`` -> (e4m3 latent as float64 ``[..., 4, 128]``,
    scales float32 ``[..., 4]``, rope bf16 ``[..., 64]``)."""
    lat, scale, rope = split_fp8_rows(rows)
    return lat.to(torch.float64), scale, rope


def _check_choice(name: str, value, choices) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


def _check_acc_bits(acc_mantissa_bits) -> int | None:
    if acc_mantissa_bits is None:
        return None
    if isinstance(acc_mantissa_bits, bool) or not isinstance(acc_mantissa_bits, numbers.Integral):
        raise TypeError(f"acc_mantissa_bits must be None or an int in [1, {MAX_ACC_BITS}], "
                        f"got {type(acc_mantissa_bits).__name__}")
    if not 1 <= acc_mantissa_bits <= MAX_ACC_BITS:
        raise ValueError(f"acc_mantissa_bits must be None or an int in [1, {MAX_ACC_BITS}], got {acc_mantissa_bits}")
    return int(acc_mantissa_bits)


def _check_chunk(chunk) -> int | None:
    if chunk is None:
        return None
    if isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral):
        raise TypeError(f"chunk must be None or a positive int, got {type(chunk).__name__}")
    if chunk < 1:
        raise ValueError(f"chunk must be None or a positive int, got {chunk}")
    return int(chunk)


def _logits(terms, qr, lat, ks, rope, sm_scale: float, q_granularity: str, bits):
    """Step 2 for a chunk: float32 logits ``[c, h, topk]``.

    terms: ``[(qe [c, h, 4, 128] float64, qs [c, h, 1 | 4] float32)]`` (``q_terms``); qr ``[c, h, 64]`` bf16;
    lat ``[c, topk, 4, 128]`` float64, ks ``[c, topk, 4]``, rope ``[c, topk, 64]`` bf16.
    """
    r = torch.einsum("chd,ckd->chk", qr.double(), rope.double())
    if q_granularity == "bf16":  # one float32 accumulator over the 576 columns of bf16 products
        lat_sum = torch.einsum("chbd,ckbd->chk", terms[0][0], lat * ks.double()[..., None])
        return (lat_sum + r).to(torch.float32) * torch.tensor(sm_scale, dtype=torch.float32)
    ks = ks[:, None, :, :]  # [c, 1, topk, 4]
    acc = 0.0
    for qe, qs in terms:
        partial = _accumulate(torch.einsum("chbd,ckbd->chkb", qe, lat), bits)  # S_tb [c, h, topk, 4]
        w = (qs[:, :, None, :] * ks).to(torch.float32)  # fl32(qs_t[b] * ks[r, b]) [c, h, topk, 4]
        acc = acc + (partial.double() * w.double()).sum(-1)
    acc = acc.to(torch.float32)  # L: sum32 of the promotions
    return (acc + r.to(torch.float32)) * torch.tensor(sm_scale, dtype=torch.float32)  # times fl32(sm_scale)


def _pv(p, ks, lat, p_granularity: str, bits):
    """Step 4 for a chunk: float32 ``O [c, h, 512]`` (not yet divided by l).

    p ``[c, h, topk]`` float32 softmax weights (0 at ignored entries), ks ``[c, topk, 4]`` (0 at ignored entries),
    lat ``[c, topk, 4, 128]`` float64 (0 at ignored entries).
    """
    c, h, topk = p.shape
    n_t = -(-topk // P_BLOCK)
    pad = n_t * P_BLOCK - topk
    pp = (p[..., None] * ks[:, None, :, :]).to(torch.float32)  # P'_b [c, h, topk, 4], exact
    if pad:  # zero weights and rows fill the last tile: they change no max and no sum
        pp = torch.nn.functional.pad(pp, (0, 0, 0, pad))
        lat = torch.nn.functional.pad(lat, (0, 0, 0, 0, 0, pad))
    pp = pp.view(c, h, n_t, P_BLOCK, FP8_NUM_SCALES)
    if p_granularity == "row_block":
        amax = pp.amax(dim=3)  # [c, h, n_t, 4]; NaN propagates
    else:  # one scale for the whole row, the same in every tile
        amax = pp.amax(dim=(2, 3))[:, :, None, :].expand(c, h, n_t, FP8_NUM_SCALES)
    ps = torch.where(amax > 0, amax / FP8_E4M3_MAX, 1.0).to(torch.float32)
    pe = _e4m3(pp / ps[:, :, :, None, :]).double()
    # one tile's product, promoted to float32 (the accumulator model applies to each tile's sum)
    t = _accumulate(torch.einsum("chtrb,ctrbd->chtbd", pe,
                                 lat.view(c, n_t, P_BLOCK, FP8_NUM_SCALES, FP8_GROUP)), bits)  # [c, h, n_t, 4, 128]
    o = torch.einsum("chtbd,chtb->chbd", t.double(), ps.double()).to(torch.float32)  # sum32 of the promotions
    return o.reshape(c, h, D_NOPE)


def _check_arguments(q, cache, indices, sm_scale, topk_length, attn_sink):
    """The FP8 references' arguments, checked: (cache, indices, topk_length, attn_sink) canonical, and the
    softmax scale."""
    require_tensor("q", q)
    require_ndim("q", q, (3,), "[s_q, h, d_qk]")
    require_dtype("q", q, FLOAT_DTYPES)
    if q.shape[2] != D_QK:
        raise ValueError(f"q must have d_qk = {D_QK} (512 latent + 64 rope) for the FP8 mode, got {q.shape[2]}")
    if not (isinstance(cache, torch.Tensor) and cache.dtype == torch.uint8):
        require_tensor("cache", cache)
        raise TypeError(f"cache must be the FP8 cache (uint8 [s_kv, 656], quilt_attn.quantize_fp8), got "
                        f"{str(cache.dtype).replace('torch.', '')} {tuple(cache.shape)}")
    cache = canonical_fp8_cache(cache, "cache")
    require_same_device("cache", cache, "q", q)
    s_q, h, _ = q.shape
    indices = canonical_indices(indices, s_q)
    require_same_device("indices", indices, "q", q)
    topk = indices.shape[1]
    topk_length = check_topk_length(topk_length, s_q, indices.device, topk)
    attn_sink = check_attn_sink(attn_sink, h, q.device)
    return cache, indices, topk_length, attn_sink, check_sm_scale(sm_scale, D_QK)


def sparse_prefill_fp8_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    indices: torch.Tensor,
    sm_scale: float | None = None,
    *,
    topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    q_granularity: str = "token_head",
    p_granularity: str = "row_block",
    acc_mantissa_bits: int | None = None,
    chunk: int | None = None,
):
    """Sparse-attention prefill with the FP8 tensor-core mode's arithmetic (module docstring), on the CPU.

    Parameters
    ----------
    q : ``[s_q, h, 576]`` float tensor (bf16 in production; its rope part is used as bf16).
    cache : the FP8 cache ``uint8 [s_kv, 656]`` (or ``[s_kv, 1, 656]``), ``quilt_attn.quantize_fp8``.
    indices : ``[s_q, topk]`` (or ``[s_q, 1, topk]``) int32; -1 or >= s_kv is ignored.
    sm_scale : softmax scale; default ``576 ** -0.5``.
    topk_length : optional ``[s_q]`` int32 / int64: keep the first entries of each row.
    attn_sink : optional ``[h]`` float32, as in ``quilt_attn.reference``.
    q_granularity : "token_head" or "token_head_block" (q's e4m3 scale per (query, head) or per 128 columns),
        "token_head_2term" (q as two e4m3 terms, two FP8 QK products), or "bf16" (QK not in FP8: q in bf16
        against the dequantized cache; only PV in FP8).
    p_granularity : "row_block" (P's scale per (query-head row, 64 list entries)) or "row" (per row).
    acc_mantissa_bits : None (ideal float32 accumulation) or the stored mantissa bits, 1..23, each FP8 block
        sum keeps (truncated): QK's 128-column blocks and PV's 64-row tiles (PV's only under "bf16").
    chunk : queries computed at a time (default: a memory budget); the results do not depend on it.

    Returns
    -------
    out ``[s_q, h, 512]`` float32, max_logits ``[s_q, h]`` and lse ``[s_q, h]`` float32 (natural log).
    """
    cache, indices, topk_length, attn_sink, scale = _check_arguments(q, cache, indices, sm_scale, topk_length,
                                                                     attn_sink)
    s_q, h, _ = q.shape
    topk = indices.shape[1]
    _check_choice("q_granularity", q_granularity, Q_GRANULARITIES)
    _check_choice("p_granularity", p_granularity, P_GRANULARITIES)
    bits = _check_acc_bits(acc_mantissa_bits)
    chunk = _check_chunk(chunk) or max(1, _BUDGET // (topk * (8 * h * FP8_NUM_SCALES + D_QK)))

    dev = q.device
    q, cache, indices = q.cpu(), cache.cpu(), indices.cpu()
    s_kv = cache.shape[0]
    valid = valid_index_mask(indices, s_kv, None if topk_length is None else topk_length.cpu())
    terms = [(qe.view(s_q, h, FP8_NUM_SCALES, FP8_GROUP), qs) for qe, qs in q_terms(q[..., :D_NOPE], q_granularity)]
    qr = q[..., D_NOPE:].to(torch.bfloat16)

    out = torch.empty(s_q, h, D_NOPE, dtype=torch.float32)
    max_logits = torch.empty(s_q, h, dtype=torch.float32)
    lse = torch.empty(s_q, h, dtype=torch.float32)
    for a in range(0, s_q, chunk):
        e = min(s_q, a + chunk)
        ok = valid[a:e]  # [c, topk]
        # an ignored entry reads a zero row: nothing of a row no query selected (NaN) reaches a sum
        rows = (cache[torch.where(ok, indices[a:e], 0).long()] if s_kv else
                cache.new_zeros(e - a, topk, cache.shape[1]))
        lat, ks, rope = _decode_rows(rows)
        lat = lat.masked_fill(~ok[..., None, None], 0.0)
        ks = ks.masked_fill(~ok[..., None], 0.0)
        rope = rope.masked_fill(~ok[..., None], 0.0)
        s = _logits([(qe[a:e].double(), qs[a:e]) for qe, qs in terms], qr[a:e], lat, ks, rope, scale,
                    q_granularity, bits)
        s = s.masked_fill(~ok[:, None, :], float("-inf"))
        m = s.amax(dim=-1)  # [c, h]; NaN where a valid logit is NaN
        empty = m == float("-inf")  # nothing carries weight (as the reference)
        p = torch.exp(s - m.masked_fill(empty, 0.0)[..., None])  # float32; exactly 0 at ignored entries
        l_sum = p.double().sum(-1).to(torch.float32)
        o = _pv(p, ks, lat, p_granularity, bits)
        o = (o / l_sum[..., None]).masked_fill(empty[..., None], 0.0)
        l_e = (m + torch.log(l_sum)).masked_fill(empty, float("inf"))
        if attn_sink is not None:
            o = apply_attn_sink(o, l_e, attn_sink.cpu())
        out[a:e] = o
        max_logits[a:e] = m
        lse[a:e] = l_e
    return out.to(dev), max_logits.to(dev), lse.to(dev)


# --------------------------------------------------------------------------------------------------------------
# The shipped kernel's arithmetic (``sparse_prefill(..., precision="fp8")``, ops/csrc/sm90_fp8mma.cuh)
#
# The study above weighs granularities; the kernel implements one point of it, with three changes that make it
# a one-pass Hopper kernel at the bf16 kernel's program shape (docs/fp8-mode.md, section 5):
#
# 1. q: one e4m3 term a (query, head), ``qs = pow2up(fl32(amax / 448))`` (the smallest power of two >= it, from
#    the float32 bits; 1 without a nonzero latent value; NaN when any of the row's 576 values is not finite),
#    ``Qe = e4m3(q / qs)``, rope ``Qr = bf16(q_r / qs)``.
# 2. One scale a cache row: ``ks = max_b ks[r, b]`` (1 when all four are 0, NaN when one is), its latent
#    ``Ke'[c] = e4m3(Ke[c] * fl32(ks[r, b] / ks))`` (exact for power-of-two scales, but for values that fall
#    into e4m3's subnormals), rope ``Kr' = bf16(Kr / ks)``.
# 3. ``S = sum_c Qe Ke' + sum_c Qr Kr'`` (one float32 accumulator: the tensor cores' FP8 adder, not promoted
#    every 128 columns), ``a = fl32(S ks)``, ``c = fl32(qs * fl32(sm_scale log2 e))``, base-2 logit ``a c``.
# 4. ``e = ceil(log2 ks)``, ``y = a c + e``; a reference ``M`` (integer) per row: the emulation takes
#    ``ceil(max y)``; ``P_l = 2^(a c + 6 - M)``, ``P' = fl32(P_l ks)`` (V's scale folded into P), ``Pe = e4m3(P')``;
#    ``l = sum P_l``; ``O = sum_r Pe Ke'[r, :512]``; ``out = O / l``, ``lse = (M - 6 + log2 l) ln 2``,
#    ``max_logits = max(a c) ln 2``.
# 5. A query whose ``out`` holds a NaN in any head gets the exact path's result in all its heads (the call's
#    repair pass recomputes it over its own rows in bf16): a non-finite q value (``qs`` NaN) takes this route,
#    so such a query gets what the exact path gives it, not a saturated e4m3 value; so does a NaN from a
#    selected row's non-finite value. (In a QUILT tile a partner's non-finite row can also leave a NaN in a
#    query's output; the repair gives that query the exact path's result too, which the emulation, query by
#    query, cannot see: there the two differ by the mode's error.)
#
# Kernel freedom: the kernel's reference is any integer with ``max y - 2 <= M``, so its ``P'`` is the
# emulation's times a power of two: the same e4m3 value wherever both are normal (>= 2^-6); the order and
# roundings of its float32 sums, and its FP8 accumulator's (~14 bits kept while adding) in ``S`` and ``O``.
# --------------------------------------------------------------------------------------------------------------

KERNEL_P_OFFSET = 6.0  # P' = 2^(y - M + KERNEL_P_OFFSET) <= 2^(slack + offset) = 256 < 448 (sm90_fp8mma.cuh)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def _pow2_up(v: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= positive float32 ``v`` (float32 bits: exponent up when the mantissa is not 0)."""
    b = v.to(torch.float32).contiguous().view(torch.int32)
    return ((b + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def kernel_quantize_q(q: torch.Tensor):
    """Step 1 on ``q [..., 576]``: (``Qe`` float32 e4m3 values ``[..., 512]``, ``Qr`` bf16 ``[..., 64]``, ``qs``
    float32 ``[...]``)."""
    x = q[..., :D_NOPE].to(torch.float32)
    amax = torch.where(torch.isfinite(x), x.abs(), 0.0).amax(dim=-1)
    qs = torch.where(amax > 0, _pow2_up(amax / FP8_E4M3_MAX), 1.0)
    qs = qs.masked_fill(~torch.isfinite(q).all(dim=-1), float("nan"))  # (step 5: the exact path's result)
    qe = _e4m3(x / qs[..., None])
    qr = (q[..., D_NOPE:].to(torch.float32) / qs[..., None]).to(torch.bfloat16)
    return qe, qr, qs


def kernel_rows(cache: torch.Tensor):
    """Step 2 on FP8 cache rows ``uint8 [..., 656]``: (``Ke'`` float32 ``[..., 512]``, ``Kr'`` bf16 ``[..., 64]``,
    ``ks`` float32 ``[...]``, ``e = ceil(log2 ks)`` float32 ``[...]``)."""
    lat, scale, rope = split_fp8_rows(cache)
    mx = scale.amax(dim=-1)  # NaN propagates
    ks = torch.where(mx == 0, 1.0, mx)
    f = (scale / ks[..., None]).to(torch.float32)
    lat = _e4m3(lat * f[..., None]).reshape(*lat.shape[:-2], D_NOPE)
    kr = (rope.to(torch.float32) / ks[..., None]).to(torch.bfloat16)
    b = ks.contiguous().view(torch.int32)
    e = (((b >> 23) & 0xFF) - 127 + ((b & 0x7FFFFF) != 0).to(torch.int32)).to(torch.float32)
    return lat, kr, ks, e


def sparse_prefill_fp8_kernel_reference(q: torch.Tensor, cache: torch.Tensor, indices: torch.Tensor,
                                        sm_scale: float | None = None, *, topk_length: torch.Tensor | None = None,
                                        attn_sink: torch.Tensor | None = None, chunk: int | None = None):
    """``sparse_prefill(q, cache, indices, precision="fp8")``'s arithmetic (the comment above), emulated.

    Arguments as ``sparse_prefill_fp8_reference`` (q bf16 in production). Returns out ``[s_q, h, 512]``
    float32 (the kernel rounds it to bf16 on the store), max_logits and lse ``[s_q, h]`` float32, natural log.
    The exact sums are float64 sums of e4m3 / bf16 products (exact, see the module docstring), each rounded
    once to float32.
    """
    cache, indices, topk_length, attn_sink, scale = _check_arguments(q, cache, indices, sm_scale, topk_length,
                                                                     attn_sink)
    s_q, h, _ = q.shape
    topk = indices.shape[1]
    scale2 = torch.tensor(scale * LOG2E, dtype=torch.float32)  # (the kernel's float)
    chunk = _check_chunk(chunk) or max(1, _BUDGET // (topk * (2 * h + D_QK)))

    dev = q.device
    q, cache, indices = q.cpu(), cache.cpu(), indices.cpu()
    s_kv = cache.shape[0]
    valid = valid_index_mask(indices, s_kv, None if topk_length is None else topk_length.cpu())
    qe, qr, qs = kernel_quantize_q(q)
    c = (qs * scale2).to(torch.float32)  # [s_q, h]
    lat, kr, ks, e = kernel_rows(cache) if s_kv else (torch.zeros(1, D_NOPE), torch.zeros(1, 64, dtype=torch.bfloat16),
                                                      torch.ones(1), torch.zeros(1))
    out = torch.empty(s_q, h, D_NOPE, dtype=torch.float32)
    max_logits = torch.empty(s_q, h, dtype=torch.float32)
    lse = torch.empty(s_q, h, dtype=torch.float32)
    for a0 in range(0, s_q, chunk):
        a1 = min(s_q, a0 + chunk)
        ok = valid[a0:a1]
        idx = torch.where(ok, indices[a0:a1], 0).long()
        k_lat = lat[idx].double().masked_fill(~ok[..., None], 0.0)  # [n, topk, 512] (ignored entries: zero rows)
        k_r = kr[idx].double().masked_fill(~ok[..., None], 0.0)
        s = (torch.einsum("nhd,nkd->nhk", qe[a0:a1].double(), k_lat)
             + torch.einsum("nhd,nkd->nhk", qr[a0:a1].double(), k_r)).to(torch.float32)
        ak = s * ks[idx][:, None, :]  # a = fl32(S ks)
        cc = c[a0:a1][..., None]
        # ignored entries are masked after the scale: a negative sm_scale turns a -inf of a into +inf
        ign = ~ok[:, None, :]
        t = (ak * cc).masked_fill(ign, float("-inf"))  # base-2 logits a c (-inf at ignored entries)
        y = t + e[idx][:, None, :]
        ym = y.amax(dim=-1)
        empty = ym == float("-inf")
        ref = torch.ceil(ym).masked_fill(empty, 0.0)[..., None]  # M
        pl = torch.exp2(torch.addcmul(KERNEL_P_OFFSET - ref, ak, cc)).masked_fill(ign, 0.0)  # 2^(a c + 6 - M)
        pe = _e4m3(pl * ks[idx][:, None, :]).double()
        l_sum = pl.double().sum(-1).to(torch.float32)
        o = torch.einsum("nhk,nkd->nhd", pe, k_lat).to(torch.float32)
        o = (o / l_sum[..., None]).masked_fill(empty[..., None], 0.0)
        l2 = (ref[..., 0] - KERNEL_P_OFFSET + torch.log2(l_sum)).masked_fill(empty, float("inf"))
        l_e = l2 * LN2
        if attn_sink is not None:
            o = apply_attn_sink(o, l_e, attn_sink.cpu())
        out[a0:a1] = o
        max_logits[a0:a1] = (t.amax(dim=-1) * LN2).masked_fill(empty, float("-inf"))
        lse[a0:a1] = l_e
    redo = out.isnan().flatten(1).any(dim=1).nonzero()[:, 0]  # step 5
    if redo.numel():
        exact = sparse_prefill_reference(q[redo], cache, indices[redo], scale,
                                         attn_sink=None if attn_sink is None else attn_sink.cpu(),
                                         topk_length=None if topk_length is None else topk_length.cpu()[redo])
        out[redo], max_logits[redo], lse[redo] = (t.to(torch.float32).cpu() for t in exact)
    return out.to(dev), max_logits.to(dev), lse.to(dev)
