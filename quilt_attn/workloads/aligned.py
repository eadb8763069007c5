"""q / kv whose attention follows a workload's indexer model (for accuracy studies).

The generated index workloads rank kv rows with an indexer score; random q / kv would give
attention weights unrelated to that ranking, which makes importance-aware clipping look worse
than it is. ``indexer_aligned_inputs`` builds q / kv whose logits follow the same score.
"""
from __future__ import annotations

import math

import torch

from .generators import PRESETS, IndexerParams, generate, indexer_features


# the workloads ranked by the indexer score model (the others have no score for q / kv to follow)
INDEXER_WORKLOADS: tuple[str, ...] = ("indexer", *PRESETS)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def indexer_aligned_inputs(name: str, s_q: int, s_kv: int, topk: int, h: int, *, d_qk: int, dtype, device,
                           seed: int = 0, beta: float = 2.0, noise: float = 0.5, **overrides):
    """q / kv whose attention logits follow a workload's indexer model, and that workload's indices.

    The indexer ranks kv row ``r`` for query ``i`` by ``u_i . k_r + bias_r`` (+ a local-window
    bonus), ``(u, k, bias) = quilt_attn.workloads.indexer_features(...)`` of the preset. Here, with
    ``sm_scale = beta``::

        logit[i, j, r] = beta * gamma_j * (u_i . k_r + log(1 + bias_r)) + N(0, noise**2)

    ``gamma_j`` in [0.6, 1.4] varies per head. The salience is log-compressed because it is
    heavy-tailed (up to ~160 at s_kv = 8192): used raw, one row takes all the attention of every
    query. The local bonus is not a q . k product and is left out of the logits. At the
    production shape (glm53-like, s_kv 8192, topk 2048, beta 2) the Top-K holds ~95% of the
    full-context attention mass with ~10-20 effective rows a query, as in a real model the
    indexer's low-ranked rows carry little mass. ``overrides`` go to the preset (``generate``).

    Returns ``q, kv, indices, sm_scale``.
    """
    if name not in INDEXER_WORKLOADS:
        raise ValueError(f"name must be 'indexer' or a preset ({', '.join(INDEXER_WORKLOADS[1:])}): q / kv follow "
                         f"the indexer score model; got {name!r}")
    params = IndexerParams(**{**PRESETS.get(name, {}), **overrides})
    u, k, bias = indexer_features(s_q, s_kv, params, seed)
    dim = params.dim
    rest = d_qk - dim - 1
    gamma = torch.linspace(0.6, 1.4, h, dtype=torch.float64) if h > 1 else torch.ones(1, dtype=torch.float64)
    q = torch.empty(s_q, h, d_qk, dtype=torch.float64)
    q[:, :, :dim] = u.double()[:, None, :] * gamma[None, :, None]
    q[:, :, dim] = gamma[None, :]
    q[:, :, dim + 1:] = torch.randn(s_q, h, rest, generator=_gen(seed + 11), dtype=torch.float64) * (
        noise / beta / math.sqrt(rest))
    kv = torch.empty(s_kv, d_qk, dtype=torch.float64)
    kv[:, :dim] = k.double()
    kv[:, dim] = torch.log1p(bias.double())
    kv[:, dim + 1:] = torch.randn(s_kv, rest, generator=_gen(seed + 12), dtype=torch.float64)
    indices = generate(name, s_q, s_kv, topk, seed=seed, device=device, **overrides)
    return q.to(dtype).to(device), kv.to(dtype).to(device), indices, float(beta)
