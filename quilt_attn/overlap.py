"""How much of a top-K workload neighbouring queries could share.

For aligned groups of ``G`` neighbouring queries (queries ``gG .. gG+G-1``; a trailing partial
group counts as a group of its real members), ``overlap_profile`` measures:

* ``shared_fraction[G]`` -- mean over groups of |rows selected by all members| / mean |row|;
* ``fixed_group[G]`` -- rows processed by a kernel that loads the all-member intersection once per
  group and every other entry per query, relative to query-parallel:
  ``sum_groups (sum_q |S_q| - (G - 1) |intersection|) / sum_q |S_q|`` (the paper's "Group = G");
* ``union[G]`` -- ``sum_groups |union| / sum_q |S_q|``: each distinct row loaded once per group;
* ``cascaded`` -- cascaded sharing ``C -> C/2 -> ... -> 1`` (``C = cascade_group``): every entry is
  counted once, at the largest aligned sub-block of its group that fully selected it;
* ``pairwise_overlap`` -- mean ``|S_2k ∩ S_2k+1| / topk`` over aligned neighbour pairs.

Everything is counted from the per-entry member masks of ``planner.membership.member_masks``
(bit ``k`` of entry ``(i, j)`` set iff query ``(i // G) * G + k`` selected row ``indices[i, j]``):

* an entry belongs to the group intersection iff its mask has every member bit set;
* it is the union's representative of its row iff its own bit is the lowest set bit;
* under cascading it is processed by its query iff the query is the first member of the largest
  aligned all-set block of the mask that contains it.

Rows are taken to be duplicate-free (the package convention); a repeated key would count twice.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ._checks import canonical_indices
from .planner.membership import cascade_levels, check_group_size, member_masks


@dataclasses.dataclass(frozen=True)
class OverlapProfile:
    """Sharing statistics of one index workload (see the module docstring).

    Ratios are relative to query-parallel processing (``total_entries``); dicts are keyed by
    group size. ``cascade_levels[L]`` is the fraction of the query-parallel entries processed at
    cascade level ``L`` (``L`` queries share them), summed over its blocks, i.e. the cascaded
    ratio's breakdown: ``sum(cascade_levels.values()) == cascaded``.
    """

    s_q: int
    topk: int
    s_kv: int | None
    total_entries: int
    group_sizes: tuple[int, ...]
    shared_fraction: dict[int, float]
    fixed_group: dict[int, float]
    union: dict[int, float]
    cascade_group: int
    cascaded: float
    cascade_levels: dict[int, float]
    pairwise_overlap: float

    def to_dict(self) -> dict:
        """JSON-ready dict (dict keys become strings, NaN becomes None)."""

        def clean(value):
            if isinstance(value, dict):
                return {str(k): clean(v) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                return [clean(v) for v in value]
            if isinstance(value, float) and math.isnan(value):
                return None
            return value

        return clean(dataclasses.asdict(self))

    def table(self) -> str:
        """Plain-text table: one line per group size, then cascaded and pairwise overlap."""
        lines = [
            f"overlap profile: s_q={self.s_q} topk={self.topk} s_kv={self.s_kv} entries={self.total_entries}",
            f"{'group':>6} {'shared by all':>14} {'fixed group':>12} {'union':>8}",
        ]
        for G in self.group_sizes:
            lines.append(
                f"{G:>6} {self.shared_fraction[G]:>14.3f} {self.fixed_group[G]:>12.3f} {self.union[G]:>8.3f}"
            )
        levels = " + ".join(f"{self.cascade_levels[L]:.3f}@{L}" for L in sorted(self.cascade_levels, reverse=True))
        lines.append(f"cascaded {self.cascade_group}->1: {self.cascaded:.3f}  ({levels})")
        lines.append(f"pairwise overlap: {self.pairwise_overlap:.3f}")
        return "\n".join(lines)

    def plot(self, path, title: str | None = None) -> None:
        """Write a PNG: processed-row ratios and shared fractions against group size (needs matplotlib, which
        the rest of the package does not)."""
        try:
            import matplotlib
        except ImportError as err:  # a dependency of the benchmark harness, not of the library
            raise ImportError("OverlapProfile.plot needs matplotlib (pip install matplotlib)") from err

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        Gs = list(self.group_sizes)
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot(Gs, [self.fixed_group[G] for G in Gs], "o-", label="fixed group (share all-member rows)")
        ax.plot(Gs, [self.union[G] for G in Gs], "s-", label="union of group")
        ax.plot(Gs, [self.shared_fraction[G] for G in Gs], "^--", label="fraction shared by all")
        ax.axhline(self.cascaded, color="k", ls=":", label=f"cascaded {self.cascade_group}->1")
        ax.set_xscale("log", base=2)
        ax.set_xticks(Gs, [str(G) for G in Gs])
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("group size G (aligned neighbouring queries)")
        ax.set_ylabel("ratio to query-parallel rows")
        ax.set_title(title or f"s_q={self.s_q}, topk={self.topk}, pairwise overlap {self.pairwise_overlap:.2f}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)


def _group_sums(per_entry: torch.Tensor, G: int) -> torch.Tensor:
    """Sum a ``[s_q, topk]`` count over the entries of each aligned group; int64 ``[n_groups]``."""
    s_q = per_entry.shape[0]
    pad = (-s_q) % G
    flat = per_entry.to(torch.int64).sum(dim=1)
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return flat.view(-1, G).sum(dim=1)


def _member_of(s_q: int, G: int, device) -> torch.Tensor:
    """Member number ``i % G`` of every query, int64 ``[s_q, 1]``."""
    return (torch.arange(s_q, device=device) % G)[:, None]


def _full_masks(s_q: int, G: int, device) -> torch.Tensor:
    """Mask with every real member's bit set, per query, int32 ``[s_q, 1]``.

    A trailing partial group of ``m`` queries has ``(1 << m) - 1``: its missing members never select.
    """
    start = torch.arange(s_q, device=device) // G * G
    members = (s_q - start).clamp(max=G)
    return ((1 << members) - 1).to(torch.int32)[:, None]


def _group_stats(masks: torch.Tensor, valid: torch.Tensor, G: int):
    """Intersection, union and entry counts per aligned group of ``G``, each int64 ``[n_groups]``."""
    s_q = masks.shape[0]
    member = _member_of(s_q, G, masks.device)
    in_all = valid & (masks == _full_masks(s_q, G, masks.device))
    # Intersection size: the all-set entries of one member (the first) of each group.
    inter = _group_sums(in_all & (member == 0), G)
    # Union: one representative per distinct row, the member whose bit is the lowest set bit.
    lower_bits = (1 << member).to(torch.int32) - 1
    union = _group_sums(valid & ((masks & lower_bits) == 0), G)
    return inter, union, _group_sums(valid, G)


def _cascade_breakdown(masks, valid, cascade_group: int, total: int) -> dict[int, float]:
    """Entries processed at each cascade level, as fractions of ``total`` (query-parallel entries).

    ``masks, valid`` are the member masks for groups of ``cascade_group``.
    """
    level = cascade_levels(masks, cascade_group).to(torch.int64)
    member = _member_of(masks.shape[0], cascade_group, masks.device)
    # The entry is processed (for its whole block) by the block's first member only.
    processed = valid & (level > 0) & (member % level.clamp(min=1) == 0)
    out = {}
    L = cascade_group
    while L >= 1:
        out[L] = int((processed & (level == L)).sum()) / total if total else math.nan
        L //= 2
    return out


def _pairwise(masks, valid, topk: int) -> float:
    """Mean ``|S_2k ∩ S_2k+1| / topk`` over complete aligned pairs (NaN without one).

    ``masks, valid`` are the member masks for groups of 2.
    """
    n_pairs = masks.shape[0] // 2
    if n_pairs == 0:
        return math.nan
    both = valid[0 : 2 * n_pairs : 2] & (masks[0 : 2 * n_pairs : 2] == 3)
    return float(both.sum(dim=1).to(torch.float64).mean()) / topk


def overlap_profile(
    indices: torch.Tensor,
    *,
    s_kv: int | None = None,
    topk_length: torch.Tensor | None = None,
    group_sizes=(2, 4, 8, 16),
    cascade_group: int = 8,
) -> OverlapProfile:
    """Measure how much aligned groups of neighbouring queries could share.

    Parameters
    ----------
    indices : int32 ``[s_q, topk]`` (or ``[s_q, 1, topk]``); ``-1`` / ``>= s_kv`` entries are invalid.
    s_kv : context length; ``None`` treats only negative entries as invalid.
    topk_length : optional int32 ``[s_q]``: only the first ``topk_length[i]`` entries of row ``i`` count.
    group_sizes : group sizes to report, powers of two in [1, 16].
    cascade_group : first (largest) group of cascaded sharing, a power of two in [1, 16].

    Returns
    -------
    OverlapProfile
    """
    indices = canonical_indices(indices)
    if isinstance(group_sizes, int) or not all(isinstance(G, int) for G in group_sizes):
        raise TypeError("group_sizes must be a sequence of ints")
    group_sizes = tuple(sorted(set(check_group_size(G, name="group_sizes") for G in group_sizes)))
    if not group_sizes:
        raise ValueError("group_sizes must not be empty")
    cascade_group = check_group_size(cascade_group, name="cascade_group")
    if s_kv is not None and (not isinstance(s_kv, int) or isinstance(s_kv, bool) or s_kv < 1):
        raise ValueError(f"s_kv must be None or an int >= 1, got {s_kv!r}")
    s_q, topk = indices.shape

    # One member-mask pass per group size, shared by every statistic that needs it.
    masks = {
        G: member_masks(indices, G, s_kv=s_kv, topk_length=topk_length)
        for G in sorted(set(group_sizes) | {cascade_group, 2})
    }
    shared, fixed, union = {}, {}, {}
    total = int(masks[cascade_group][1].sum())
    for G in group_sizes:
        inter, uni, entries = _group_stats(*masks[G], G)
        members = (s_q - torch.arange(len(entries), device=entries.device) * G).clamp(max=G)
        shared[G] = _mean_shared(inter, entries, members)
        fixed[G] = int((entries - (members - 1) * inter).sum()) / total if total else math.nan
        union[G] = int(uni.sum()) / total if total else math.nan

    levels = _cascade_breakdown(*masks[cascade_group], cascade_group, total)
    return OverlapProfile(
        s_q=s_q,
        topk=topk,
        s_kv=s_kv,
        total_entries=total,
        group_sizes=group_sizes,
        shared_fraction=shared,
        fixed_group=fixed,
        union=union,
        cascade_group=cascade_group,
        cascaded=sum(levels.values()) if total else math.nan,
        cascade_levels=levels,
        pairwise_overlap=_pairwise(*masks[2], topk),
    )


def _mean_shared(inter: torch.Tensor, entries: torch.Tensor, members: torch.Tensor) -> float:
    """Mean over groups with entries of |intersection| / mean |row| (NaN when no group has any)."""
    mean_row = entries.to(torch.float64) / members
    keep = mean_row > 0
    if not bool(keep.any()):
        return math.nan
    return float((inter[keep] / mean_row[keep]).mean())
