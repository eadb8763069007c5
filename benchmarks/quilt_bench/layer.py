"""A DeepSeek-V3.2-style DSA attention layer with random weights: a prefill latency *proxy*.

What it is: one MLA attention layer as DeepSeek-V3.2 runs it in prefill with DeepSeek Sparse
Attention -- q low-rank projection (``q_lora_rank``), kv low-rank projection to the 512-wide latent
plus a 64-wide rope key, rope on the rope parts, the lightning indexer (``index_n_heads`` heads of
``index_head_dim``; score ``I[t, s] = sum_j w[t, j] * relu(q_idx[t, j] . k_idx[s])``, causal mask,
Top-K), absorbed MLA (``q_nope @ W_UK`` -> 512, plus the 64 rope dims = 576-wide queries over the
576-wide latent kv), the sparse attention (``quilt_attn.sparse_prefill(..., method=...)``: QUILT,
query-parallel or the float64 reference), the value up-projection ``W_UV`` and the output projection.

What it is not: a model. It is ONE layer with RANDOM weights, no MoE / FFN, no norms or residuals
around the layer, no tensor / expert parallel communication, bf16 indexer instead of FP8. Its timings
bound the share of *one layer's attention block* that the sparse attention takes (and what QUILT
saves of it); they are not TTFT and say nothing about end-to-end speedup by themselves.

``indices`` can be injected (e.g. ``quilt_attn.workloads.generate("glm53-like", ...)``) so that the
attention sees the paper's measured sharing instead of what a random-weight indexer selects (random
weights give little structure); the indexer still runs (``run_indexer=True``) so its cost is timed.

Prefill of the last chunk of a long prompt: ``x`` holds the ``s_q`` new tokens at positions
``prefix_len .. prefix_len + s_q - 1``; the latent kv and indexer keys of the ``prefix_len`` earlier
tokens come from a random cache built once per length (outside the timed region).
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch

STAGES = ("q_proj", "kv_proj", "indexer", "attention", "out_proj")
INDEXERS = ("torch", "triton")  # the lightning indexer's scores: unfused torch reference, or the fused kernel


@dataclass(frozen=True)
class DSALayerConfig:
    """Dimensions of the layer; defaults are DeepSeek-V3.2's (128 heads, Top-2048)."""

    hidden: int = 7168
    n_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512   # latent width = d_v of the sparse attention
    qk_rope_dim: int = 64     # latent kv is kv_lora_rank + qk_rope_dim = 576 wide
    qk_nope_dim: int = 128
    v_head_dim: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    topk: int = 2048
    rope_theta: float = 10000.0

    @property
    def d_qk(self) -> int:
        return self.kv_lora_rank + self.qk_rope_dim

    @property
    def sm_scale(self) -> float:
        """Softmax scale of the un-absorbed head dim (nope + rope = 192), as in MLA."""
        return (self.qk_nope_dim + self.qk_rope_dim) ** -0.5

    @classmethod
    def tiny(cls, **kw) -> "DSALayerConfig":
        """A test size (kernel-compatible: latent 32 + rope 16)."""
        base = dict(hidden=64, n_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_rope_dim=16, qk_nope_dim=16,
                    v_head_dim=16, index_n_heads=2, index_head_dim=16, topk=16)
        base.update(kw)
        return cls(**base)

    def with_heads(self, n_heads: int) -> "DSALayerConfig":
        return replace(self, n_heads=n_heads)


def _rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary embedding (half-split) of the last dim of ``x [s, ..., d]`` at positions ``pos [s]``."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos.to(torch.float32)[:, None] * inv[None, :]  # [s, d/2]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class _Timer:
    """Per-stage times in ms: CUDA events on a GPU, perf_counter on the CPU; no-op when disabled."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.cuda = enabled, device.type == "cuda"
        self.marks: list[tuple[str, object, object]] = []
        self._open = None

    def _now(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def start(self, name: str) -> None:
        if self.enabled:
            self._open = (name, self._now())

    def stop(self) -> None:
        if self.enabled:
            name, t0 = self._open
            self.marks.append((name, t0, self._now()))

    def result(self) -> dict:
        if not self.enabled:
            return {}
        if self.cuda:
            torch.cuda.synchronize()
            out = {n: float(a.elapsed_time(b)) for n, a, b in self.marks}
        else:
            out = {n: (b - a) * 1e3 for n, a, b in self.marks}
        out["total"] = sum(out.values())
        return out


class DSALayer(torch.nn.Module):
    """DSA attention layer with random weights (see the module docstring: a proxy, not a model)."""

    def __init__(self, config: DSALayerConfig = DSALayerConfig(), *, device=None, dtype=torch.bfloat16,
                 seed: int = 0):
        super().__init__()
        c = self.config = config
        if c.kv_lora_rank + c.qk_rope_dim <= 0 or c.qk_rope_dim % 2 or c.index_head_dim < c.qk_rope_dim:
            raise ValueError(f"bad config {c}")
        g = torch.Generator(device="cpu").manual_seed(seed)

        def w(n_in, n_out):  # stored [n_in, n_out]; x @ w
            t = torch.randn(n_in, n_out, generator=g) / math.sqrt(n_in)
            return torch.nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)

        h = c.n_heads
        self.wq_a = w(c.hidden, c.q_lora_rank)
        self.wq_b = w(c.q_lora_rank, h * (c.qk_nope_dim + c.qk_rope_dim))
        self.wkv_a = w(c.hidden, c.kv_lora_rank + c.qk_rope_dim)
        self.wkv_b = w(c.kv_lora_rank, h * (c.qk_nope_dim + c.v_head_dim))
        self.wo = w(h * c.v_head_dim, c.hidden)
        # lightning indexer: queries from the q latent, one shared key head, per-head weights from x
        self.wq_idx = w(c.q_lora_rank, c.index_n_heads * c.index_head_dim)
        self.wk_idx = w(c.hidden, c.index_head_dim)
        self.w_idx = w(c.hidden, c.index_n_heads)
        self._prefix: dict = {}

    # ------------------------------------------------------------------ pieces
    @property
    def w_uk(self) -> torch.Tensor:
        """``[h, nope, kv_lora_rank]``: absorbs q_nope into the latent space."""
        c = self.config
        return self.wkv_b.view(c.kv_lora_rank, c.n_heads, c.qk_nope_dim + c.v_head_dim)[..., : c.qk_nope_dim].permute(1, 2, 0)

    @property
    def w_uv(self) -> torch.Tensor:
        """``[h, kv_lora_rank, v_head_dim]``: value up-projection of the latent attention output."""
        c = self.config
        return self.wkv_b.view(c.kv_lora_rank, c.n_heads, c.qk_nope_dim + c.v_head_dim)[..., c.qk_nope_dim:].permute(1, 0, 2)

    def prefix_cache(self, prefix_len: int):
        """Random latent kv ``[prefix_len, d_qk]`` and indexer keys ``[prefix_len, index_head_dim]`` (cached)."""
        if prefix_len not in self._prefix:
            c, p = self.config, self.wq_a
            g = torch.Generator(device="cpu").manual_seed(1000 + prefix_len)
            kv = torch.randn(prefix_len, c.d_qk, generator=g).to(p.device, p.dtype)
            k_idx = torch.randn(prefix_len, c.index_head_dim, generator=g).to(p.device, p.dtype)
            self._prefix = {prefix_len: (kv, k_idx)}  # one length at a time
        return self._prefix[prefix_len]

    def project_q(self, x, pos):
        """``(q [s, h, d_qk] absorbed into the latent space, q latent [s, q_lora_rank])``."""
        c = self.config
        cq = _rms_norm(x @ self.wq_a)
        q = (cq @ self.wq_b).view(x.shape[0], c.n_heads, c.qk_nope_dim + c.qk_rope_dim)
        q_nope, q_rope = q[..., : c.qk_nope_dim], q[..., c.qk_nope_dim:]
        q_lat = torch.einsum("shn,hnc->shc", q_nope, self.w_uk)
        return torch.cat([q_lat, rope(q_rope, pos, c.rope_theta)], dim=-1).contiguous(), cq

    def project_kv(self, x, pos):
        """Latent kv ``[s, d_qk]``: normed ``kv_lora_rank`` part plus the rope key."""
        c = self.config
        kv = x @ self.wkv_a
        return torch.cat([_rms_norm(kv[:, : c.kv_lora_rank]), rope(kv[:, c.kv_lora_rank:], pos, c.rope_theta)], dim=-1)

    def index_queries(self, x, cq, pos):
        """Indexer queries and head weights of the tokens ``x [s, hidden]`` at positions ``pos [s]``.

        Returns ``(q_idx, w)``: ``q_idx [s, index_n_heads, index_head_dim]`` in x's dtype, rope on its
        first ``qk_rope_dim`` dims; ``w`` float32 ``[s, index_n_heads]``, including ``index_n_heads**-0.5``.
        """
        c = self.config
        q_idx = (cq @ self.wq_idx).view(x.shape[0], c.index_n_heads, c.index_head_dim)
        r = c.qk_rope_dim
        q_idx = torch.cat([rope(q_idx[..., :r], pos, c.rope_theta), q_idx[..., r:]], dim=-1)
        return q_idx, (x @ self.w_idx).float() * c.index_n_heads ** -0.5

    def index_scores(self, x, cq, pos, k_idx_all):
        """Indexer scores of the queries against keys ``0..n-1`` (float32 ``[s, n]``, not masked), in torch."""
        c = self.config
        q_idx, wts = self.index_queries(x, cq, pos)
        s = torch.relu(torch.einsum("shd,nd->shn", q_idx, k_idx_all).float())
        return torch.einsum("shn,sh->sn", s, wts) * c.index_head_dim ** -0.5

    def indexer(self, x, cq, pos, k_idx_all, *, budget: int = 1 << 28, indexer: str = "torch") -> torch.Tensor:
        """Causal Top-K of the indexer: int32 ``[s, topk]``, descending score, -1 past a short causal range.

        x, cq, pos : ``[s, hidden]``, ``[s, q_lora_rank]``, ``[s]``: the queries' tokens, q latents, positions.
        k_idx_all : ``[n, index_head_dim]``, the indexer keys of positions ``0..n-1``.
        budget : elements of the largest float32 intermediate of one chunk of queries: ``[chunk, heads, n]``
            per-head scores in torch, ``[chunk, n]`` scores with the fused kernel (so its chunks are
            ``index_n_heads`` times longer).
        indexer : "torch" (``index_scores``, then the causal mask) or "triton" (the fused kernel
            ``quilt_bench.indexer.indexer_scores``, which masks; needs CUDA or ``TRITON_INTERPRET=1``).
        """
        if indexer not in INDEXERS:
            raise ValueError(f"indexer must be one of {INDEXERS}, got {indexer!r}")
        c = self.config
        s, n = x.shape[0], k_idx_all.shape[0]
        topk = c.topk
        out = torch.full((s, topk), -1, dtype=torch.int32, device=x.device)
        per_query = n * (c.index_n_heads if indexer == "torch" else 1)
        step = max(1, budget // max(1, per_query))
        keys = torch.arange(n, device=x.device)
        for a in range(0, s, step):
            b = min(s, a + step)
            n_cols = int(pos[b - 1]) + 1
            if indexer == "torch":
                sc = self.index_scores(x[a:b], cq[a:b], pos[a:b], k_idx_all[:n_cols])
                sc.masked_fill_(keys[None, :n_cols] > pos[a:b, None], float("-inf"))
            else:
                from .indexer import indexer_scores

                q_idx, wts = self.index_queries(x[a:b], cq[a:b], pos[a:b])
                sc = indexer_scores(q_idx, k_idx_all[:n_cols], wts, pos[a:b], scale=c.index_head_dim ** -0.5)
            k = min(topk, n_cols)
            top_s, top_i = torch.topk(sc, k, dim=1)
            out[a:b, :k] = torch.where(top_s == float("-inf"), -1, top_i).to(torch.int32)
        return out

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(self, x: torch.Tensor, *, attention_method: str = "quilt", indices: torch.Tensor | None = None,
                prefix_len: int = 0, run_indexer: bool = True, time_stages: bool = False,
                attention_kwargs: dict | None = None, indexer: str = "torch"):
        """Layer output ``[s_q, hidden]`` and per-stage times.

        x : ``[s_q, hidden]``, the new tokens (positions ``prefix_len ..``).
        attention_method : ``sparse_prefill``'s method: "quilt", "query_parallel" or "reference".
        indices : optional int32 ``[s_q, topk']`` into the ``prefix_len + s_q`` positions, used instead
            of the indexer's Top-K (the indexer still runs when ``run_indexer``, its result discarded).
        time_stages : return ``{stage: ms}`` for ``STAGES`` plus "total" (CUDA events on a GPU,
            perf_counter on the CPU); ``{}`` otherwise. "attention" includes QUILT's planning.
        attention_kwargs : passed on to ``sparse_prefill`` (plan, settings, ...).
        indexer : how the indexer's scores are computed, "torch" or "triton" (see ``indexer``).

        Returns ``(out, timings)``.
        """
        from quilt_attn import sparse_prefill

        c = self.config
        s_q = x.shape[0]
        kv_pre, k_idx_pre = self.prefix_cache(prefix_len) if prefix_len else (None, None)
        pos = torch.arange(prefix_len, prefix_len + s_q, device=x.device)
        tm = _Timer(time_stages, x.device)
        tm.start("q_proj")
        q, cq = self.project_q(x, pos)
        tm.stop()
        tm.start("kv_proj")
        kv = self.project_kv(x, pos)
        k_idx = x @ self.wk_idx
        k_idx = torch.cat([rope(k_idx[:, : c.qk_rope_dim], pos, c.rope_theta), k_idx[:, c.qk_rope_dim:]], dim=-1)
        if prefix_len:
            kv, k_idx = torch.cat([kv_pre, kv]), torch.cat([k_idx_pre, k_idx])
        tm.stop()
        tm.start("indexer")
        if indices is None or run_indexer:
            own = self.indexer(x, cq, pos, k_idx, indexer=indexer)
        tm.stop()
        if indices is None:
            indices = own
        elif indices.shape[0] != s_q:
            raise ValueError(f"indices must have s_q = {s_q} rows, got {tuple(indices.shape)}")
        tm.start("attention")
        o, _, _ = sparse_prefill(q, kv, indices.to(device=x.device, dtype=torch.int32), c.sm_scale,
                                 method=attention_method, d_v=c.kv_lora_rank, **(attention_kwargs or {}))
        tm.stop()
        tm.start("out_proj")
        o = torch.einsum("shc,hcv->shv", o.to(x.dtype), self.w_uv)
        out = o.reshape(s_q, c.n_heads * c.v_head_dim) @ self.wo
        tm.stop()
        return out, tm.result()


def layer_proxy(*, heads=(16, 128), workloads=("glm53-like", "ds32-like"), methods=("query_parallel", "quilt"),
                s_q: int = 16384, s_kv: int = 65536, config: DSALayerConfig | None = None, device=None,
                dtype=torch.bfloat16, reps: int = 5, seed: int = 0, indexer: str = "torch",
                log=None) -> list[dict]:
    """Time the layer per (heads, workload, method) with the workload's indices injected.

    One warm-up call, then the median over ``reps`` calls of each stage. Rows carry the stage times,
    ``attention_share`` (attention / total), the ``indexer`` that ran ("torch" or "triton", see
    ``DSALayer.indexer``) and, against query-parallel on the same input,
    ``layer_speedup_vs_query_parallel``. A proxy: see the module docstring.
    """
    from quilt_attn.workloads import generate

    if indexer not in INDEXERS:
        raise ValueError(f"indexer must be one of {INDEXERS}, got {indexer!r}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    base = config or DSALayerConfig()
    rows = []
    for h in heads:
        cfg = base.with_heads(h)
        layer = DSALayer(cfg, device=device, dtype=dtype, seed=seed)
        x = (torch.randn(s_q, cfg.hidden, generator=torch.Generator(device="cpu").manual_seed(seed + 7))
             .to(device, dtype))
        for wl in workloads:
            idx = generate(wl, s_q, s_kv, cfg.topk, seed=seed, device=device)
            qp_total = None
            for m in methods:
                kw = dict(attention_method=m, indices=idx, prefix_len=s_kv - s_q, time_stages=True, indexer=indexer)
                layer(x, **kw)  # warm-up (compilation, prefix cache)
                runs = [layer(x, **kw)[1] for _ in range(reps)]
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                row = {"heads": h, "workload": wl, "method": m, "indexer": indexer, "s_q": s_q, "s_kv": s_kv,
                       "topk": cfg.topk, "reps": reps, "stages_ms": med,
                       "attention_share": med["attention"] / med["total"], "config": asdict(cfg)}
                if m == "query_parallel":
                    qp_total = med["total"]
                elif qp_total:
                    row["layer_speedup_vs_query_parallel"] = qp_total / med["total"]
                rows.append(row)
                if log:
                    log(f"layer h={h} {wl} {m}: total {med['total']:.2f} ms, attention {med['attention']:.2f} ms "
                        f"({row['attention_share']:.0%}), indexer ({indexer}) {med['indexer']:.2f} ms")
        del layer, x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
