"""Synthetic top-K index workloads and their storage.

``generate(name, s_q, s_kv, topk, seed=..., device=...)`` returns int32 ``indices [s_q, topk]``
for one of ``WORKLOADS``; ``PRESETS`` holds the calibrated indexer parameters of the realistic
ones. ``save_indices`` / ``load_indices`` move index tensors through ``.npy``, ``.pt`` and
``.safetensors`` files.
"""
from .generators import PRESETS, WORKLOADS, IndexerParams, generate, indexer_features, query_positions
from .aligned import INDEXER_WORKLOADS, indexer_aligned_inputs
from .io import FORMATS, load_indices, save_indices

__all__ = [
    "FORMATS",
    "INDEXER_WORKLOADS",
    "PRESETS",
    "WORKLOADS",
    "IndexerParams",
    "generate",
    "indexer_aligned_inputs",
    "indexer_features",
    "load_indices",
    "query_positions",
    "save_indices",
]
