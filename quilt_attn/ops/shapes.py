"""The shape of a kernel program, shared by the kernels, their launchers and ``quilt_attn.dispatch``: how many
queries and (padded) heads a 64-row program holds, the plan group ``sparse_prefill`` uses by default, and the
multiprocessor count the persistent grids are sized by.

Its own module, free of Triton kernels, so that the dispatch can import it at once (a Triton kernel module picks
the interpreter, ``TRITON_INTERPRET``, when it is first imported, which the command line sets after importing
the package).
"""
from __future__ import annotations

import functools


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=None)
def program_shape(h: int, group_size: int) -> tuple[int, int]:
    """``(QP, HB)``: queries and (padded) heads a program owns; ``QP * HB`` rows, 16..64."""
    hb = min(_next_pow2(h), 64)
    qp = min(group_size, max(1, 64 // hb))
    if qp * hb < 16:  # a matrix product needs at least 16 rows
        hb = 16 // qp
    return qp, hb


def default_group_size(h: int) -> int:
    """The plan group ``sparse_prefill`` uses at ``h`` heads: the queries one program holds (``64 // h``,
    at most 8), or 8 where a program holds one query (``h >= 64``).

    A program runs every tile of its group that meets its queries, so in a group larger than a program the
    wider levels' tiles are run by each sibling program; the program-sized group runs those rows in the
    same tiles, pads less, and plans faster (H200, glm53-like, s_q 16384: plan() 0.198 ms at group 4
    against 0.370 at group 8, merge level 4, kernel time within noise; ``docs/learned.md``).
    """
    qp = program_shape(h, 8)[0]
    return qp if qp > 1 else 8


def sm_count(device) -> int:
    """Multiprocessors of CUDA ``device`` (a ``torch.device``; no index: the current one), asked once a device: the
    persistent launches size their grids by it."""
    import torch

    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    import torch

    return torch.cuda.get_device_properties(index).multi_processor_count
