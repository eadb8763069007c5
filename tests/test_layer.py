"""DSA layer proxy (quilt_bench.layer) at a tiny size on the CPU, attention through the float64 reference."""
from __future__ import annotations

import math

import pytest
import torch

from quilt_bench.layer import STAGES, DSALayer, DSALayerConfig, layer_proxy
from quilt_attn.workloads import generate

CFG = DSALayerConfig.tiny()
S_Q, PREFIX = 24, 40


@pytest.fixture(scope="module")
def layer():
    return DSALayer(CFG, dtype=torch.float64, seed=3)


@pytest.fixture(scope="module")
def x():
    return torch.randn(S_Q, CFG.hidden, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def _inputs(layer, x):
    pos = torch.arange(PREFIX, PREFIX + S_Q)
    kv_pre, k_pre = layer.prefix_cache(PREFIX)
    q, cq = layer.project_q(x, pos)
    kv = torch.cat([kv_pre, layer.project_kv(x, pos)])
    k_idx = x @ layer.wk_idx
    from quilt_bench.layer import rope

    r = CFG.qk_rope_dim
    k_idx = torch.cat([k_pre, torch.cat([rope(k_idx[:, :r], pos), k_idx[:, r:]], dim=-1)])
    return pos, q, cq, kv, k_idx


def test_defaults_are_deepseek_v32():
    c = DSALayerConfig()
    assert (c.hidden, c.q_lora_rank, c.kv_lora_rank, c.qk_rope_dim, c.qk_nope_dim, c.v_head_dim) == \
        (7168, 1536, 512, 64, 128, 128)
    assert (c.index_n_heads, c.index_head_dim, c.topk, c.d_qk) == (64, 128, 2048, 576)


def test_shapes(layer, x):
    out, t = layer(x, attention_method="reference", prefix_len=PREFIX)
    assert out.shape == (S_Q, CFG.hidden) and out.dtype == x.dtype and torch.isfinite(out).all()
    assert t == {}
    pos, q, cq, kv, _ = _inputs(layer, x)
    assert q.shape == (S_Q, CFG.n_heads, CFG.d_qk) and kv.shape == (PREFIX + S_Q, CFG.d_qk)
    assert layer.w_uk.shape == (CFG.n_heads, CFG.qk_nope_dim, CFG.kv_lora_rank)
    assert layer.w_uv.shape == (CFG.n_heads, CFG.kv_lora_rank, CFG.v_head_dim)


def test_indexer_topk_is_causal_and_exact(layer, x):
    pos, q, cq, kv, k_idx = _inputs(layer, x)
    idx = layer.indexer(x, cq, pos, k_idx, budget=64)  # small budget: several chunks
    assert idx.shape == (S_Q, CFG.topk) and idx.dtype == torch.int32
    valid = idx >= 0
    assert (idx[valid].view(-1) >= 0).all()
    assert (idx <= pos[:, None].int()).all()  # causal: nothing past the query's own position
    assert valid.all()  # every query sees >= topk keys (PREFIX >= topk)
    scores = layer.index_scores(x, cq, pos, k_idx).masked_fill(torch.arange(PREFIX + S_Q)[None] > pos[:, None],
                                                               float("-inf"))
    ref = torch.topk(scores, CFG.topk, dim=1).values
    got = scores.gather(1, idx.long())
    torch.testing.assert_close(got, ref)
    assert all(len(set(r.tolist())) == CFG.topk for r in idx)


def test_short_causal_range_gives_minus_one():
    lay = DSALayer(CFG, dtype=torch.float64)
    x = torch.randn(8, CFG.hidden, dtype=torch.float64)
    pos = torch.arange(8)
    q, cq = lay.project_q(x, pos)
    k_idx = x @ lay.wk_idx
    idx = lay.indexer(x, cq, pos, k_idx)
    for i in range(8):  # query i sees keys 0..i only
        row = idx[i].tolist()
        assert sorted(row[: i + 1]) == list(range(i + 1)) and row[i + 1:] == [-1] * (CFG.topk - i - 1)


def _dense_masked_attention(q, kv, indices, scale, d_v):
    """Dense attention over all kv rows with everything outside ``indices`` masked out."""
    logits = torch.einsum("shd,nd->shn", q, kv) * scale
    mask = torch.zeros(q.shape[0], kv.shape[0], dtype=torch.bool)
    for i in range(q.shape[0]):
        sel = indices[i][indices[i] >= 0].long()
        mask[i, sel] = True
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    return torch.einsum("shn,nd->shd", torch.softmax(logits, dim=-1), kv[:, :d_v])


def test_layer_equals_dense_masked_attention(layer, x):
    pos, q, cq, kv, k_idx = _inputs(layer, x)
    idx = layer.indexer(x, cq, pos, k_idx)
    o = _dense_masked_attention(q, kv, idx, CFG.sm_scale, CFG.kv_lora_rank)
    o = torch.einsum("shc,hcv->shv", o, layer.w_uv)
    expect = o.reshape(S_Q, -1) @ layer.wo
    out, _ = layer(x, attention_method="reference", prefix_len=PREFIX)
    torch.testing.assert_close(out, expect, rtol=1e-9, atol=1e-9)
    # absorbed MLA equals the un-absorbed form for the nope part: q_nope . (W_UK c) == (q_nope W_UK) . c
    c = CFG
    cq2 = layer.project_q(x, pos)[1]
    qf = (cq2 @ layer.wq_b).view(S_Q, c.n_heads, -1)[..., : c.qk_nope_dim]
    k_nope = torch.einsum("nc,hdc->nhd", kv[:, : c.kv_lora_rank], layer.w_uk)
    torch.testing.assert_close(torch.einsum("shd,nhd->shn", qf, k_nope),
                               torch.einsum("shc,nc->shn", q[..., : c.kv_lora_rank], kv[:, : c.kv_lora_rank]))


def test_injected_indices_are_used(layer, x):
    pos, q, cq, kv, k_idx = _inputs(layer, x)
    own = layer.indexer(x, cq, pos, k_idx)
    base, _ = layer(x, attention_method="reference", prefix_len=PREFIX)
    same, _ = layer(x, attention_method="reference", prefix_len=PREFIX, indices=own)
    torch.testing.assert_close(same, base, rtol=0, atol=0)
    preset = generate("glm53-like", S_Q, PREFIX + S_Q, CFG.topk, seed=1)
    other, _ = layer(x, attention_method="reference", prefix_len=PREFIX, indices=preset, run_indexer=False)
    assert not torch.allclose(other, base)
    o = _dense_masked_attention(q, kv, preset, CFG.sm_scale, CFG.kv_lora_rank)
    expect = torch.einsum("shc,hcv->shv", o, layer.w_uv).reshape(S_Q, -1) @ layer.wo
    torch.testing.assert_close(other, expect, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="rows"):
        layer(x, attention_method="reference", prefix_len=PREFIX, indices=preset[:3])


def test_stage_timings(layer, x):
    _, t = layer(x, attention_method="reference", prefix_len=PREFIX, time_stages=True)
    assert set(t) == set(STAGES) | {"total"}
    assert all(v >= 0 and math.isfinite(v) for v in t.values())
    assert t["total"] == pytest.approx(sum(t[s] for s in STAGES))


def test_layer_proxy_rows():
    rows = layer_proxy(heads=(2, 4), workloads=("ds32-like",), methods=("reference", "reference"), s_q=16,
                       s_kv=64, config=CFG, device="cpu", dtype=torch.float32, reps=1)
    assert [r["heads"] for r in rows] == [2, 2, 4, 4]
    assert all(0 < r["attention_share"] < 1 and r["stages_ms"]["total"] > 0 for r in rows)


@pytest.mark.interpret
@pytest.mark.parametrize("method", ["query_parallel", "quilt"])
def test_layer_through_the_kernels(method):
    """The kernels (GPU, or Triton's interpreter on the CPU) agree with the reference inside the layer."""
    from conftest import KERNEL_DEVICE

    lay = DSALayer(CFG, dtype=torch.float16, device=KERNEL_DEVICE, seed=2)
    x = torch.randn(16, CFG.hidden, generator=torch.Generator().manual_seed(9)).to(KERNEL_DEVICE, torch.float16)
    preset = generate("glm53-like", 16, 64, CFG.topk, seed=0, device=KERNEL_DEVICE)
    ref, _ = lay(x, attention_method="reference", indices=preset, prefix_len=48)
    out, t = lay(x, attention_method=method, indices=preset, prefix_len=48, time_stages=True)
    err = float((out.float() - ref.float()).norm() / ref.float().norm())
    assert err < 5e-3 and t["attention"] > 0
