"""Scale-out on ``torch.distributed``: context parallelism (CP) over query shards and tensor parallelism (TP)
over heads, for ``quilt_attn.sparse_prefill``.

Context parallelism. Every rank of a process group holds the queries of its query shard and one contiguous
shard of the kv rows; ``sparse_prefill_cp`` brings each rank the kv rows its queries need and runs one
``sparse_prefill`` there. Two ways to move kv (``fetch``):

* ``"all_gather"``: every rank gathers every shard (``all_gather_single``, one collective); no host sync when
  ``s_kv`` is given.
* ``"needed"``: every rank receives only the rows its indices reference: it marks them in a row table on the
  device, the ranks exchange their per-owner counts (one all-gather of a ``[W, W]`` count matrix, read on the
  host: ``all_to_all_single`` takes its split sizes as Python ints, so this mode costs one host sync a call,
  acceptable at CP's sizes), send the row ids to their owners and receive the rows back (two
  ``all_to_all_single``), and run ``sparse_prefill`` on the compact kv with the indices remapped into it.

Query shards (``query_shards``): a zigzag of ``2 W`` chunks whose boundaries fall on multiples of the plan
group, so a rank's local groups are exactly groups of the one-process plan (its plan is those groups of
the one-process plan, and its results equal the one-process call's bit for bit). ``round_robin_shards``
(query ``i`` to rank ``i % W``, what SGLang does) is there for comparison: its local groups hold queries
``W`` apart, which share fewer rows.

Tensor parallelism (``tp_head_shard``): heads are independent, so a rank runs ``sparse_prefill`` on its head
slice and plans on its own; the plan depends only on the indices (and on the settings, whose defaults follow
the head count), so no plan is ever sent between ranks.

See ``docs/distributed.md`` for a ``torchrun`` example and the bytes each mode moves.
"""
from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from ._checks import canonical_indices, check_topk_length, require_ndim, require_same_device, require_tensor
from .api import sparse_prefill
from .dispatch import decide
from .pipeline import plan_ahead

FETCH_MODES = ("auto", "all_gather", "needed")
# "needed" is chosen when the most remote rows any rank needs are at most this fraction of the rows the
# all-gather brings each rank. Below 1 because "needed" runs three dependent exchanges (counts, ids, rows)
# and an index gather on every owner, where the all-gather is one bandwidth-optimal collective: it must
# save a clear share of the bytes to pay. A design margin, not a measured crossover.
FETCH_FACTOR = 0.5
_ID_BYTES = 4  # an int32 row id


def _check_count(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


# ----------------------------------------------------------------------------------------------
# Shards
# ----------------------------------------------------------------------------------------------
def query_shards(s_q: int, world_size: int, *, group_size: int = 8) -> list[list[tuple[int, int]]]:
    """Zigzag query shards: each rank's query positions as contiguous, group-aligned runs.

    ``[0, s_q)`` is cut into ``2 * world_size`` chunks of about ``s_q / (2 W)`` queries, each boundary
    rounded to the nearest multiple of ``group_size``; rank ``r`` takes chunks ``r`` and ``2W - 1 - r``.
    Under dense causal masking query ``p``'s work grows linearly with ``p``, and the two chunks of a rank add
    up to the same work on every rank (exactly for equal chunks; the rounding moves at most
    ``group_size / 2`` queries a boundary); under top-K a query's work is constant once its causal range
    exceeds topk, which equal chunk sizes balance. Every run starts on a multiple of ``group_size`` and
    has a length that is a multiple of it (only the run ending at ``s_q`` may end a partial group), so a
    rank's queries, taken in run order, form whole groups of the one-process plan: the rank plans exactly
    those groups.

    Parameters
    ----------
    s_q : queries of the call (positions ``0 .. s_q - 1`` of its ``q`` / ``indices``), >= 0.
    world_size : ranks W >= 1.
    group_size : the plan group to align to (``quilt_attn.plan``'s ``group_size``; 8 aligns every
        smaller power-of-two group too).

    Returns
    -------
    ``shards[r]``: rank r's ``(start, stop)`` runs in ascending order, at most two (one where its two
    chunks touch, rank ``W - 1``; none where both are empty, ``s_q < 2 W group_size``). Its local queries
    are the concatenation ``q[start:stop]`` of its runs, in that order (``shard_positions`` gives them as
    positions).
    """
    s_q = _check_count("s_q", s_q, 0)
    W = _check_count("world_size", world_size, 1)
    G = _check_count("group_size", group_size, 1)
    n = 2 * W
    # boundary k: k * s_q / n rounded to the nearest multiple of G (integer arithmetic), the last one s_q
    bounds = [min(s_q, G * ((2 * k * s_q + n * G) // (2 * n * G))) for k in range(n)] + [s_q]
    shards = []
    for r in range(W):
        runs = []
        for c in (r, n - 1 - r):
            a, b = bounds[c], bounds[c + 1]
            if a == b:
                continue
            if runs and runs[-1][1] == a:
                runs[-1] = (runs[-1][0], b)  # chunks W - 1 and W touch: one run
            else:
                runs.append((a, b))
        shards.append(runs)
    return shards


def round_robin_shards(s_q: int, world_size: int, *, device=None) -> list[torch.Tensor]:
    """Round-robin query shards (query ``i`` to rank ``i % W``, as SGLang splits): int64 positions a rank.

    For comparison with ``query_shards``: a rank's neighbouring local queries sit ``W`` apart in the
    sequence and share fewer kv rows, so the rank's plan has more tiles.
    """
    s_q = _check_count("s_q", s_q, 0)
    W = _check_count("world_size", world_size, 1)
    return [torch.arange(r, s_q, W, device=device, dtype=torch.int64) for r in range(W)]


def shard_positions(shard, device=None) -> torch.Tensor:
    """A shard's query positions, int64 ``[s_q_local]``: runs ``[(start, stop), ...]`` from ``query_shards``
    concatenated, or a position tensor (``round_robin_shards``) returned as it is (moved to ``device``)."""
    if isinstance(shard, torch.Tensor):
        return shard.to(device=device, dtype=torch.int64) if device is not None else shard.long()
    parts = [torch.arange(int(a), int(b), device=device, dtype=torch.int64) for a, b in shard]
    return torch.cat(parts) if parts else torch.zeros(0, device=device, dtype=torch.int64)


def kv_shard(s_kv: int, world_size: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of the context that rank ``rank`` holds.

    Every rank holds ``S = ceil(s_kv / W)`` rows, ``[r S, (r + 1) S)``, except that the shards are cut at
    ``s_kv``: when ``W`` does not divide ``s_kv`` the last shard is shorter (and, for ``s_kv`` below
    ``(W - 1) S``, later ones empty). With ``W | s_kv`` these are the rows ``[r s_kv / W, (r + 1) s_kv / W)``.
    """
    s_kv = _check_count("s_kv", s_kv, 1)
    W = _check_count("world_size", world_size, 1)
    rank = _check_count("rank", rank, 0)
    if rank >= W:
        raise ValueError(f"rank must be < world_size = {W}, got {rank}")
    S = -(-s_kv // W)
    return min(s_kv, rank * S), min(s_kv, (rank + 1) * S)


def tp_head_shard(h: int, world_size: int, rank: int) -> slice:
    """Rank ``rank``'s heads for tensor parallelism: ``slice(rank * h // W, (rank + 1) * h // W)``.

    Contiguous and balanced (sizes differ by at most one); needs ``1 <= W <= h`` so that no rank is
    empty. Heads are independent: ``sparse_prefill(q[:, s], kv, indices)`` on each rank gives the
    unsharded call's ``out[:, s]``, ``max_logits[:, s]``, ``lse[:, s]``, each rank planning by itself
    (the plan depends only on the indices and on the plan settings, whose defaults follow the head count:
    where a rank's defaults differ from the unsharded call's, e.g. 8 heads of 16 plan groups of 8 instead
    of 4, its tiles run in another order and the results agree to rounding instead of bit for bit).
    """
    h = _check_count("h", h, 1)
    W = _check_count("world_size", world_size, 1)
    rank = _check_count("rank", rank, 0)
    if W > h:
        raise ValueError(f"world_size must be <= h = {h} (a rank needs at least one head), got {W}")
    if rank >= W:
        raise ValueError(f"rank must be < world_size = {W}, got {rank}")
    return slice(rank * h // W, (rank + 1) * h // W)


# ----------------------------------------------------------------------------------------------
# The fetch rule
# ----------------------------------------------------------------------------------------------
def choose_fetch(need_counts, s_kv: int, world_size: int) -> str:
    """``fetch="auto"``'s choice from the rows every rank needs from every owner.

    Parameters
    ----------
    need_counts : ``[W, W]`` (nested lists or a CPU tensor): ``need_counts[a][b]`` = distinct rows rank
        ``a``'s indices reference in rank ``b``'s shard.
    s_kv, world_size : the context and W.

    Returns
    -------
    ``"needed"`` when ``max_a sum_{b != a} need_counts[a][b] <= FETCH_FACTOR * (W - 1) * S`` (``S`` =
    ``ceil(s_kv / W)``, the all-gather brings each rank ``(W - 1) S`` rows), else ``"all_gather"``. Every
    rank sees the same matrix, so all choose alike.
    """
    W = _check_count("world_size", world_size, 1)
    S = -(-_check_count("s_kv", s_kv, 1) // W)
    m = need_counts.tolist() if isinstance(need_counts, torch.Tensor) else need_counts
    if len(m) != W or any(len(row) != W for row in m):
        raise ValueError(f"need_counts must be [world_size, world_size] = [{W}, {W}]")
    if W == 1:
        return "all_gather"
    remote = max(sum(row) - row[a] for a, row in enumerate(m))
    return "needed" if remote <= FETCH_FACTOR * (W - 1) * S else "all_gather"


# ----------------------------------------------------------------------------------------------
# Context-parallel prefill
# ----------------------------------------------------------------------------------------------
def _all_gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name first
    return fn(out, inp, group=group, async_op=async_op)


def _group_rank(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: torch.distributed is not initialized; call torch.distributed.init_process_group "
                         "(NCCL for GPU tensors, gloo for CPU tensors) on every rank first")
    W, r = dist.get_world_size(group), dist.get_rank(group)
    if r < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return W, r


def _plan(indices, h, s_kv, topk_length, backend, kw):
    """The plan ``sparse_prefill`` would build (``plan_ahead``: on a GPU, on a side stream beside the kv
    transfer), or None where it would not plan (query-parallel method, h > 32 with fallback, no queries)."""
    if indices.shape[0] == 0:
        return None
    # the same rule as sparse_prefill's (the backend matters only to the cost rule, which needs a given plan)
    if not decide("triton", kw.get("method", "quilt"), h, kw.get("settings")).quilt:
        return None
    return plan_ahead(indices, h, s_kv=s_kv, topk_length=topk_length, settings=kw.get("settings"), backend=backend)


def sparse_prefill_cp(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sm_scale: float | None = None, *,
                      group=None, d_v: int = 512, attn_sink: torch.Tensor | None = None,
                      topk_length: torch.Tensor | None = None, backend: str = "auto", fetch: str = "auto",
                      s_kv: int | None = None, stats: dict | None = None, **prefill_kw):
    """Context-parallel ``sparse_prefill``: called on every rank of ``group``, each with its own queries and
    kv shard; each rank gets the one-process call's results for its queries.

    Parameters
    ----------
    q : ``[s_q_local, h, d_qk]``, this rank's queries (e.g. ``q[shard_positions(query_shards(...)[rank])]``).
    kv : this rank's kv shard ``[n_local, d_qk]`` (or ``[n_local, 1, d_qk]``, or the FP8 cache
        ``uint8 [n_local, 656]``): rows ``kv_shard(s_kv, W, rank)`` of the context (``ceil(s_kv / W)`` rows
        on every rank, the last shard cut at ``s_kv``). Same dtype and width on every rank.
    indices : int32 ``[s_q_local, topk]`` (or ``[s_q_local, 1, topk]``): positions in the whole context of
        ``s_kv`` rows; -1 or ``>= s_kv`` ignored. ``topk`` must be the same on every rank.
    sm_scale, d_v, attn_sink, topk_length, backend : as in ``sparse_prefill`` (``topk_length [s_q_local]``).
    group : the process group (default: the world). NCCL for CUDA tensors, gloo for CPU tensors.
    fetch : ``"all_gather"`` (every shard to every rank), ``"needed"`` (only the rows this rank's indices
        reference; one host sync) or ``"auto"`` (``choose_fetch`` on the exchanged counts; one host sync).
    s_kv : the context length; None: the ranks exchange their shard lengths (one more host sync).
    stats : optional dict, filled with ``fetch`` (the mode run), ``rows_needed`` (distinct valid rows the
        indices reference; "needed" / "auto" only), ``rows_received`` (kv rows received from other ranks)
        and ``bytes_received`` (kv bytes plus row ids received from other ranks).
    **prefill_kw : further ``sparse_prefill`` keywords (``method``, ``settings``, ...); ``settings`` also sets
        the plan, built beside the kv transfer.

    Returns
    -------
    out ``[s_q_local, h, d_v]``, max_logits ``[s_q_local, h]``, lse ``[s_q_local, h]``: equal to the
    ``sparse_prefill`` of the whole context for these queries. Bit for bit when the rank's plan is the
    one-process plan's groups (``query_shards``, the same settings and the same QUILT / query-parallel
    decision): ``fallback`` decides per plan, i.e. here per rank, and under it a rank may run the other
    path than one process would (results then agree to rounding).

    Notes
    -----
    The plan depends only on the indices, and in ``"needed"`` mode remapping is a bijection on the rows
    (ascending row id to compact position, each query's list kept in its order, invalid stays -1), so the
    rank plans (``plan_ahead``: a side stream on a GPU) while the kv is in flight; the plan is that of the
    original indices with rows renamed. Mismatched arguments across ranks (topk, kv width, ``s_kv``) are
    not detected and make the collectives fail or hang.
    """
    require_tensor("q", q)
    require_ndim("q", q, (3,), "[s_q_local, h, d_qk]")
    require_tensor("kv", kv)
    require_same_device("kv", kv, "q", q)
    if kv.dim() == 3:
        if kv.shape[1] != 1:
            raise ValueError(f"kv of shape [n_local, h_kv, d] must have h_kv == 1, got {tuple(kv.shape)}")
        kv = kv[:, 0]
    require_ndim("kv", kv, (2,), "[n_local, d_qk] (or [n_local, 1, d_qk], or the FP8 cache [n_local, 656])")
    s_q, h = q.shape[0], q.shape[1]
    indices = canonical_indices(indices, s_q)
    require_same_device("indices", indices, "q", q)
    topk_length = check_topk_length(topk_length, s_q, q.device)
    if fetch not in FETCH_MODES:
        raise ValueError(f"fetch must be one of {FETCH_MODES}, got {fetch!r}")
    if s_kv is not None:
        s_kv = _check_count("s_kv", s_kv, 1)
    bad = sorted(set(prefill_kw) & {"plan", "q", "kv", "indices"})
    if bad:
        raise TypeError(f"sparse_prefill_cp got unexpected keyword(s) {bad} (each rank plans its own queries)")
    W, rank = _group_rank(group)
    dev, n_local = q.device, kv.shape[0]
    if s_kv is None:  # every shard's length, on the host (a sync); all ranks then check the same layout
        lens = torch.empty(W, dtype=torch.int64, device=dev)
        _all_gather(lens, torch.tensor([n_local], dtype=torch.int64, device=dev), group)
        lens = lens.tolist()
        s_kv = sum(lens)
        if s_kv < 1:
            raise ValueError("kv: every rank's shard is empty (s_kv = 0)")
        expect = [b - a for a, b in (kv_shard(s_kv, W, i) for i in range(W))]
        if lens != expect:
            raise ValueError(f"kv: shard lengths {lens} do not follow kv_shard's layout for s_kv = {s_kv} "
                             f"(ceil(s_kv / W) rows a rank, the last shard cut at s_kv): {expect}")
    start, stop = kv_shard(s_kv, W, rank)
    if n_local != stop - start:
        raise ValueError(f"kv: rank {rank} of {W} must hold rows [{start}, {stop}) of s_kv = {s_kv} "
                         f"(kv_shard), i.e. {stop - start} rows; got {n_local}")
    S = -(-s_kv // W)
    kw = dict(d_v=d_v, attn_sink=attn_sink, topk_length=topk_length, backend=backend, **prefill_kw)

    def attend(kv_full, idx):
        if s_q == 0:
            return (q.new_zeros(0, h, d_v), torch.zeros(0, h, dtype=torch.float32, device=dev),
                    torch.zeros(0, h, dtype=torch.float32, device=dev))
        return sparse_prefill(q, kv_full, idx, sm_scale, plan=plans[0], **kw)

    plans = [None]
    row_bytes = kv.shape[1] * kv.element_size()
    local = kv.contiguous().view(torch.uint8).view(n_local, row_bytes)  # moved as bytes: any dtype, FP8 cache too
    if W == 1:
        if stats is not None:
            stats.update(fetch="all_gather", rows_needed=None, rows_received=0, bytes_received=0)
        return attend(kv, indices)

    mode = fetch
    if fetch != "all_gather":
        # mark the valid rows this rank needs (a table over the W * S padded rows, one slot for invalid
        # entries): O(s_q_local * topk + s_kv), no sort; a needed row's compact position is the count of
        # needed rows before it, so the compact kv is in ascending row order
        key = indices.to(torch.int64)
        valid = (key >= 0) & (key < s_kv)
        if topk_length is not None:  # entries past a row's length are never read: do not fetch them
            valid &= torch.arange(key.shape[1], device=dev)[None, :] < topk_length[:, None]
        key = torch.where(valid, key, W * S)
        mark = torch.zeros(W * S + 1, dtype=torch.int32, device=dev)
        mark.index_fill_(0, key.view(-1), 1)
        mark = mark[:W * S]
        pos = torch.cumsum(mark, 0, dtype=torch.int32) - 1
        counts = mark.view(W, S).sum(1, dtype=torch.int64)
        matrix = torch.empty(W * W, dtype=torch.int64, device=dev)
        _all_gather(matrix, counts, group)
        matrix = matrix.view(W, W).tolist()  # the host sync: all_to_all_single takes its splits as ints
        if fetch == "auto":
            mode = choose_fetch(matrix, s_kv, W)

    if mode == "all_gather":
        if n_local < S:  # the gather needs equal pieces: pad the short last shard (rows past s_kv, never read)
            padded = local.new_zeros(S, row_bytes)
            padded[:n_local] = local
            local = padded
        full = torch.empty(W * S, row_bytes, dtype=torch.uint8, device=dev)
        work = _all_gather(full, local, group, async_op=True)
        plans[0] = _plan(indices, h, s_kv, topk_length, backend, kw)  # beside the transfer
        work.wait()
        if stats is not None:
            stats.update(fetch=mode, rows_needed=None if fetch == "all_gather" else sum(matrix[rank]),
                         rows_received=(W - 1) * S, bytes_received=(W - 1) * S * row_bytes)
        return attend(full[:s_kv].view(kv.dtype), indices)

    # "needed": ids to their owners, rows back
    want = matrix[rank]  # rows this rank needs from each owner (its ids go out in these splits)
    serve = [matrix[a][rank] for a in range(W)]  # rows each rank needs from this one
    n_need = sum(want)
    dest = torch.where(mark > 0, pos.to(torch.int64), W * S)
    ids = torch.empty(W * S + 1, dtype=torch.int32, device=dev)
    ids.scatter_(0, dest, torch.arange(W * S, dtype=torch.int32, device=dev))  # needed rows, ascending
    ids = ids[:n_need]
    asked = torch.empty(sum(serve), dtype=torch.int32, device=dev)
    work = dist.all_to_all_single(asked, ids, output_split_sizes=serve, input_split_sizes=want, group=group,
                                  async_op=True)
    remapped = torch.where(valid, pos[key.clamp(max=W * S - 1)], -1).to(torch.int32)
    n_rows = max(n_need, 1)  # a query set without one valid index still gets a (never read) kv row
    plans[0] = _plan(remapped, h, n_rows, topk_length, backend, kw)  # beside the transfers
    work.wait()
    rows = local.index_select(0, (asked - start).to(torch.int64))
    compact = torch.zeros(n_rows, row_bytes, dtype=torch.uint8, device=dev)
    dist.all_to_all_single(compact[:n_need], rows, output_split_sizes=want, input_split_sizes=serve, group=group)
    if stats is not None:
        remote = n_need - want[rank]
        stats.update(fetch=mode, rows_needed=n_need, rows_received=remote,
                     bytes_received=remote * row_bytes + (sum(serve) - serve[rank]) * _ID_BYTES)
    return attend(compact.view(kv.dtype), remapped)
