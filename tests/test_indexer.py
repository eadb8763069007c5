"""Fused lightning-indexer scores (quilt_bench.indexer) against float64 and the layer's torch indexer.

Tolerances (stated once, used by every comparison below)
--------------------------------------------------------
A product of two fp16 / bf16 numbers is exact in float32, so the kernel's only rounding is float32
accumulation: ``d`` products a head, ``h`` weighted head terms, then the scale. Against float64 on the
same rounded inputs each of those ``d + h + 2`` operations rounds with relative error <= 2**-24, so

    |kernel - exact| <= F32_SLACK * (d + h + 2) * 2**-24 * A,   A = scale * sum_j |w_j| sum_c |q_jc k_c|,

with ``F32_SLACK = 2`` because the summation order (tensor cores, the interpreter's numpy) is unknown.
The torch indexer (``DSALayer.index_scores``) also rounds each head's logit to the input dtype before
relu (relative error <= u: fp16 2**-11, bf16 2**-8), which adds ``u * B``, ``B = scale * sum_j |w_j|
|q_j . k|``. Top-K selections are compared by the exact scores of the keys they pick, sorted (ties may
pick different keys): if two scorings are within ``e1`` and ``e2`` of the exact one, the sorted exact
scores of their Top-K sets differ by at most ``2 * (e1 + e2)``.
"""
from __future__ import annotations

import pytest
import torch

from conftest import KERNEL_DEVICE, randn
from quilt_bench.layer import DSALayer, DSALayerConfig, layer_proxy, rope
from quilt_bench.indexer import indexer_scores

F32_SLACK = 2.0
U = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def _exact(q, k, w, pos, scale):
    """float64 ``(scores masked with -inf, A, B, mask)``: A and B as in the tolerance bounds above.

    q ``[s, h, d]``, k ``[n, d]``, w ``[s, h]``, pos ``[s]`` (the values the kernel sees); the first
    three outputs ``[s, n]``, mask bool ``[s, n]`` (True where the key is past the query's position).
    """
    logits = torch.einsum("shd,nd->shn", q.double(), k.double())
    wd = w.double()[:, :, None]
    scores = (torch.relu(logits) * wd).sum(1) * scale
    a = (torch.einsum("shd,nd->shn", q.double().abs(), k.double().abs()) * wd.abs()).sum(1) * scale
    b = (logits.abs() * wd.abs()).sum(1) * scale
    mask = torch.arange(k.shape[0], device=q.device)[None, :] > pos[:, None]
    return scores.masked_fill(mask, float("-inf")), a, b, mask


def _f32_bound(a, d, h):
    return F32_SLACK * (d + h + 2) * 2.0**-24 * a


def _check_scores(got, exact, bound, mask):
    """-inf exactly where masked, finite elsewhere, within ``bound`` of ``exact`` elementwise."""
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert not torch.isnan(got).any(), "unwritten (NaN-poisoned) or NaN scores"
    assert torch.equal(torch.isneginf(got), mask), "-inf must be exactly the masked keys"
    assert torch.isfinite(got[~mask]).all()
    err = (got.double() - exact).abs()[~mask]
    excess = err - bound[~mask]
    assert (excess <= 0).all(), (f"max error {float(err.max()):.3e}, "
                                 f"worst excess over the bound {float(excess.max()):.3e}")


# --------------------------------------------------------------------------- the kernel on its own
CASES = {  # s, h, d, n, pos, block_t, block_s
    # the real indexer heads x dims; n = 45 is no multiple of 16; pos -1: a query with every key masked;
    # the first query block ends at pos 30, so its key block 32..44 takes the all-masked branch;
    # pos 60 >= n: nothing masked
    "64x128": (5, 64, 128, 45, [-1, 3, 17, 30, 60], 4, 16),
    # the second query block ends at pos 32, exactly where the key block 32..36 starts: its first key counts
    "64x32": (5, 64, 32, 37, [7, 20, 21, 32, 36], 2, 32),
    "padded 5x24": (3, 5, 24, 20, [19, 0, 11], 4, 16),  # heads and dims padded up to 16 / 32
}


@pytest.mark.interpret
@pytest.mark.parametrize("case", list(CASES))
def test_scores_match_float64(case, nan_poison):
    s, h, d, n, pos, bt, bs = CASES[case]
    dev = KERNEL_DEVICE
    q = randn(s, h, d, seed=1, device=dev)
    k = randn(n, d, seed=2, device=dev)
    w = randn(s, h, seed=3, dtype=torch.float32, device=dev) * h**-0.5
    pos = torch.tensor(pos, device=dev)
    scale = d**-0.5
    got = indexer_scores(q, k, w, pos, scale=scale, block_t=bt, block_s=bs)
    exact, a, _, mask = _exact(q, k, w, pos, scale)
    _check_scores(got, exact, _f32_bound(a, d, h), mask)
    if case == "64x128":
        assert mask[0].all() and not mask[4].any()


@pytest.mark.interpret
def test_default_launch_and_int32_positions():
    """Default block sizes (block_t capped at the query count) and int32 / non-contiguous inputs."""
    dev = KERNEL_DEVICE
    s, h, d, n = 3, 64, 32, 40
    q = randn(h, s, d, seed=4, device=dev).transpose(0, 1)  # [s, h, d], not contiguous
    k = randn(n, d, seed=5, device=dev)
    w = randn(s, h, seed=6, dtype=torch.float64, device=dev) * h**-0.5
    pos = torch.tensor([39, 12, 25], dtype=torch.int32, device=dev)
    got = indexer_scores(q, k, w, pos, scale=d**-0.5)
    exact, a, _, mask = _exact(q, k, w.float(), pos, d**-0.5)
    _check_scores(got, exact, _f32_bound(a, d, h), mask)


def test_bad_inputs_name_the_argument(monkeypatch):
    q = torch.zeros(4, 8, 16, dtype=torch.float16)
    k = torch.zeros(10, 16, dtype=torch.float16)
    w = torch.zeros(4, 8)
    pos = torch.arange(4)
    with pytest.raises(TypeError, match="q_idx"):
        indexer_scores(q.float(), k, w, pos, scale=1.0)
    with pytest.raises(TypeError, match="k_idx"):
        indexer_scores(q, k.bfloat16(), w, pos, scale=1.0)
    with pytest.raises(ValueError, match="k_idx"):
        indexer_scores(q, k[:, :8], w, pos, scale=1.0)
    with pytest.raises(ValueError, match="w must have shape"):
        indexer_scores(q, k, w[:, :4], pos, scale=1.0)
    with pytest.raises(TypeError, match="w must be floating"):
        indexer_scores(q, k, w.long(), pos, scale=1.0)
    with pytest.raises(ValueError, match="pos"):
        indexer_scores(q, k, w, pos[:3], scale=1.0)
    with pytest.raises(TypeError, match="pos"):
        indexer_scores(q, k, w, pos.float(), scale=1.0)
    with pytest.raises(ValueError, match="q_idx must be"):
        indexer_scores(q[0], k, w, pos, scale=1.0)
    with pytest.raises(ValueError, match="powers of two"):
        indexer_scores(q, k, w, pos, scale=1.0, block_s=24)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="CUDA device"):
        indexer_scores(q, k, w, pos, scale=1.0)


# --------------------------------------------------------------------------- inside the layer
CFG = DSALayerConfig.tiny(index_n_heads=64, index_head_dim=32)  # DeepSeek's 64 indexer heads, short dims
S_Q, PREFIX = 16, 8  # queries 0..7 see fewer than topk = 16 keys (-1 entries), the rest choose


@pytest.fixture(scope="module")
def layer_inputs():
    lay = DSALayer(CFG, dtype=torch.float16, device=KERNEL_DEVICE, seed=4)
    x = torch.randn(S_Q, CFG.hidden, generator=torch.Generator().manual_seed(8)).to(KERNEL_DEVICE, torch.float16)
    pos = torch.arange(PREFIX, PREFIX + S_Q, device=KERNEL_DEVICE)
    _, cq = lay.project_q(x, pos)
    k_new = x @ lay.wk_idx
    r = CFG.qk_rope_dim
    k_new = torch.cat([rope(k_new[:, :r], pos), k_new[:, r:]], dim=-1)
    k_idx = torch.cat([lay.prefix_cache(PREFIX)[1], k_new])
    return lay, x, cq, pos, k_idx


@pytest.mark.interpret
def test_layer_scores_torch_vs_triton(layer_inputs):
    lay, x, cq, pos, k_idx = layer_inputs
    d, h = CFG.index_head_dim, CFG.index_n_heads
    q_idx, w = lay.index_queries(x, cq, pos)
    got = indexer_scores(q_idx, k_idx, w, pos, scale=d**-0.5)
    exact, a, b, mask = _exact(q_idx, k_idx, w, pos, d**-0.5)
    _check_scores(got, exact, _f32_bound(a, d, h), mask)
    ref = lay.index_scores(x, cq, pos, k_idx).masked_fill(mask, float("-inf"))
    _check_scores(ref, exact, U[torch.float16] * b + _f32_bound(a, d, h), mask)  # the torch path's own bound


@pytest.mark.interpret
def test_layer_topk_agrees_between_indexers(layer_inputs):
    lay, x, cq, pos, k_idx = layer_inputs
    d, h = CFG.index_head_dim, CFG.index_n_heads
    n = k_idx.shape[0]
    # small budgets: several chunks in both paths (torch: 1 query a chunk, triton: 3)
    by = {ix: lay.indexer(x, cq, pos, k_idx, budget=3 * n, indexer=ix) for ix in ("torch", "triton")}
    t, f = by["torch"], by["triton"]
    assert t.dtype == f.dtype == torch.int32 and t.shape == f.shape == (S_Q, CFG.topk)
    assert torch.equal(t < 0, f < 0)  # -1 at the same places: past each query's causal range
    assert (f <= pos[:, None]).all()
    q_idx, w = lay.index_queries(x, cq, pos)
    exact, a, b, _ = _exact(q_idx, k_idx, w, pos, d**-0.5)
    e_triton = _f32_bound(a, d, h).max(1).values
    e_torch = (U[torch.float16] * b + _f32_bound(a, d, h)).max(1).values
    for i in range(S_Q):
        valid = t[i] >= 0
        sel_t = exact[i, t[i][valid].long()].sort(descending=True).values
        sel_f = exact[i, f[i][valid].long()].sort(descending=True).values
        assert len(set(f[i][valid].tolist())) == int(valid.sum())  # distinct keys
        assert ((sel_t - sel_f).abs() <= 2 * (e_torch[i] + e_triton[i])).all(), f"query {i}"


def test_unknown_indexer_is_rejected(layer_inputs):
    lay, x, cq, pos, k_idx = layer_inputs
    with pytest.raises(ValueError, match="indexer"):
        lay.indexer(x, cq, pos, k_idx, indexer="cuda")
    with pytest.raises(ValueError, match="indexer"):
        layer_proxy(heads=(4,), workloads=("ds32-like",), methods=("reference",), s_q=8, s_kv=32, config=CFG,
                    device="cpu", reps=1, indexer="fused")


@pytest.mark.interpret
def test_layer_proxy_records_the_indexer():
    kw = dict(heads=(4,), workloads=("ds32-like",), methods=("reference",), s_q=16, s_kv=48,
              config=DSALayerConfig.tiny(), device=KERNEL_DEVICE, dtype=torch.float16, reps=1)
    rows = layer_proxy(**kw, indexer="triton") + layer_proxy(**kw)
    assert [r["indexer"] for r in rows] == ["triton", "torch"]
    assert all(r["stages_ms"]["indexer"] > 0 for r in rows)


# --------------------------------------------------------------------------- GPU, bf16, real sizes
@pytest.mark.gpu
def test_scores_bf16_real_size_on_gpu():
    s, h, d, n = 300, 64, 128, 5000
    q = randn(s, h, d, seed=11, dtype=torch.bfloat16, device="cuda")
    k = randn(n, d, seed=12, dtype=torch.bfloat16, device="cuda")
    w = randn(s, h, seed=13, dtype=torch.float32, device="cuda") * h**-0.5
    # every query has 100..399 future keys masked; the last query block has an all-masked key block
    pos = torch.arange(n - s, n, device="cuda") - 100
    scale = d**-0.5
    got = indexer_scores(q, k, w, pos, scale=scale)
    exact, a, b, mask = _exact(q, k, w, pos, scale)
    e = _f32_bound(a, d, h)
    _check_scores(got, exact, e, mask)
    top = torch.topk(got, 2048, dim=1).indices
    sel = exact.gather(1, top).sort(dim=1, descending=True).values
    assert ((sel - torch.topk(exact, 2048, dim=1).values).abs() <= 2 * e.max(1, keepdim=True).values).all()
