"""How a sparse-prefill call runs: its backend, its kernel, whether it runs a plan and the plan's settings.

``sparse_prefill``, ``plan_ahead``, ``distributed``, the CLI demo and the benchmark harness all decide here, from
a call's ``PlanSettings``. The default decision reads nothing from the device (no host sync, so a call can be
captured in a CUDA graph): it depends on the settings and the head count only (``decide``):

* ``method="quilt"`` where a 64-row program holds more than one query (``64 // h``, so ``h <= 32``) runs a
  plan's tiles, the caller's plan or one built in the call with ``plan_settings``:

  - CUDA backend: every tile is a 64-row product, so a query's own tile costs as much as a shared one
    and the plan's tiles never lose to the CUDA kernel's own query programs; its plan keeps private
    rows in the tiles (``split_private`` only under importance clipping).
  - Triton: where a program holds at least ``TRITON_MIN_QUERIES`` queries (``h <= 16``); the plan splits
    rows one query owns alone off into 16-row query programs (``split_private``, the default), so a plan
    that shares little degrades gracefully towards query-parallel work instead of running mostly masked
    64-row tiles. At 32 heads (two queries a program) Triton runs query programs: on the H200 grid the
    measured tile-cost rule chose them on every preset there.

* from 33 heads (a query's heads padded to a 64-row block) one query fills a 64-row tile, and
  there is nothing to share inside it: with ``fallback=True`` (the default) the call runs query programs
  and plans nothing, unless importance clipping (its plan drops pairs a query program would keep) or
  ``fallback=False``.
* query programs of the CUDA backend under ``backend="auto"`` run Triton's 16- / 32-row programs where
  a CUDA program would compute a whole 64-row tile for fewer rows (``h <= 32``).

What the settings rule gives up: little on the H200 grid (``benchmarks/results/h200.json``, kernel
9a86f42): even on random indices, which share almost nothing, the CUDA plan's mostly masked 64-row tiles
ran 8.50 ms at ``h = 16`` against 9.67 for Triton's query programs (earlier kernels lost there, which is
what the cost rule was for). ``fallback="cost"`` opts into the measured tile-cost
rule for a plan the caller passes (``quilt_pays_off``, ``cuda_pays_off``): it reads the plan's tile counts
on the host once (one sync, cached in the plan), so it belongs where a plan is built once and reused.

The kernels keep their softmax statistics in base 2 (the partial-state passes continue base-2 state);
``natural_log_stats`` converts them once at the public boundary to FlashMLA's natural-log values.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from .ops import cuda_backend
from .ops.shapes import default_group_size, program_shape
from .planner import plan_workspace_bytes

BACKENDS = ("auto", "triton", "cuda")  # attention backends (the planner's own: ``planner.plan.PLANNER_BACKENDS``)
LN2 = math.log(2.0)

# Tile costs of the measured rule (``fallback="cost"``), H200 (docs/learned.md, section 5):
# a 64-row Triton tile over a 16-row one (1.96 measured);
TILE64_OVER_TILE16 = 2.0
# the time of a tile, ns, aggregated over the benchmark grid (benchmarks/results/h200.json): a 64-row CUDA
# tile (random indices, whose rows come from HBM, run slower ones) and a Triton query-program tile by
# program rows.
CUDA_TILE_NS = 16.3
TRITON_QP_TILE_NS = {16: 17.5, 32: 20.6}

# Triton's 64-row QUILT programs pay where they hold at least this many queries (h <= 16): at 32 heads the
# measured tile-cost rule chose query programs on every preset of the H200 grid (benchmarks/results/h200.json).
TRITON_MIN_QUERIES = 4

_WARNED: set = set()


# ----------------------------------------------------------------------------- settings
def check_fallback(fallback) -> bool | str:
    """``fallback`` as ``True``, ``False`` or ``"cost"``; anything else raises ``ValueError``."""
    if isinstance(fallback, str):
        if fallback == "cost":
            return fallback
    elif isinstance(fallback, (bool, int)) and fallback in (0, 1):
        return bool(fallback)
    raise ValueError(f"fallback must be True, False or 'cost', got {fallback!r}")


def check_kernel_tile(tile) -> int:
    """A plan tile the kernels run: a power of two >= 16 (their matrix products' smallest K)."""
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 16 or tile & (tile - 1):
        raise ValueError(f"the kernel needs a plan tile that is a power of two >= 16, got {tile!r}")
    return tile


@dataclass(frozen=True)
class PlanSettings:
    """The planner settings of a ``sparse_prefill`` call (also of ``plan_ahead`` and ``workspace_bytes``): the plan
    the call builds when it is given none, and whether it runs a plan at all (``decide``).

    Attributes
    ----------
    group_size : queries a plan group (see ``quilt_attn.plan``); None: the queries one program holds (``64 // h``,
        at most 8; 8 at ``h >= 64``, ``ops.sparse_attention.default_group_size``). A wider group's shared tiles
        would be run by each of its programs, so it saves no kernel work and plans slower.
    tile, clip_threshold, importance_clip : as in ``quilt_attn.plan``; ``tile`` a power of two >= 16.
    merge_level : where the cascade stops; None: the queries one program holds (``64 // h``, at most
        ``group_size``), so that every tile fills a 64-row matrix product.
    split_private : rows one query owns alone run in 16-row query programs instead of 64-row tiles (see
        ``quilt_attn.plan``); Triton only: the CUDA backend keeps them in its 64-row tiles (a query's own tile
        costs it as much as a shared one) unless ``importance_clip``.
    fallback : True: where one query fills a 64-row tile (``h > 32``) run query programs and plan nothing; where
        a program holds several queries always run the plan (the settings rule, no host sync). False: always
        run the plan. ``"cost"``: with a given ``plan``, the measured tile-cost rule decides whether sharing
        pays off (one host read of the plan's tile counts, cached in the plan).
    """

    group_size: int | None = None
    tile: int = 64
    clip_threshold: float = 0.5
    importance_clip: bool = False
    merge_level: int | None = None
    split_private: bool = True
    fallback: bool | str = True

    def __post_init__(self):
        # checked where made, so that a call which plans nothing (query programs) still refuses bad settings
        from .planner.membership import check_clip_threshold, check_group_size

        object.__setattr__(self, "fallback", check_fallback(self.fallback))
        if self.group_size is not None:
            check_group_size(self.group_size)
        if self.merge_level is not None:
            check_group_size(self.merge_level, self.group_size or 16, "merge_level")
        check_kernel_tile(self.tile)
        check_clip_threshold(self.clip_threshold)


DEFAULT_SETTINGS = PlanSettings()


def check_settings(settings) -> PlanSettings:
    """``settings`` itself, or the defaults for None; anything else raises ``TypeError`` naming it."""
    if settings is None:
        return DEFAULT_SETTINGS
    if not isinstance(settings, PlanSettings):
        raise TypeError(f"settings must be a quilt_attn.PlanSettings or None, got {type(settings).__name__}")
    return settings


# Triton tuning, private (``sparse_prefill(_triton=...)``, for the benchmarks and the tests): the split of d_v
# across programs (1 or 2), Triton's launch knobs (None: the measured defaults by program shape), and whether
# an FP8 cache is expanded once a call (True), dequantized on load (False) or as ``kernel_kv`` decides (None).
TRITON_TUNING = {"dv_split": 1, "num_warps": None, "num_stages": None, "fp8_expand": None}


def triton_tuning(tuning=None) -> dict:
    """``tuning`` (a dict of ``TRITON_TUNING``'s keys, or None) with the defaults filled in; unknown keys or a
    non-bool ``fp8_expand`` raise ``TypeError``."""
    if tuning is None:
        return dict(TRITON_TUNING)
    if not isinstance(tuning, dict):
        raise TypeError(f"_triton must be a dict or None, got {type(tuning).__name__}")
    unknown = sorted(set(tuning) - set(TRITON_TUNING))
    if unknown:
        raise TypeError(f"_triton: unknown key(s) {unknown}; known: {list(TRITON_TUNING)}")
    tuning = {**TRITON_TUNING, **tuning}
    if tuning["fp8_expand"] is not None and not isinstance(tuning["fp8_expand"], bool):
        raise TypeError(f"fp8_expand must be None or a bool, got {type(tuning['fp8_expand']).__name__}")
    return tuning


def triton_knobs(tuning: dict) -> bool:
    """Whether ``tuning`` (``triton_tuning``'s) asks for Triton-only tuning (``choose_backend``'s ``triton_knobs``)."""
    return (tuning["dv_split"] != 1 or tuning["num_warps"] is not None or tuning["num_stages"] is not None
            or tuning["fp8_expand"] is False)


# ----------------------------------------------------------------------------- backend


def choose_backend(backend: str, q: torch.Tensor, kv: torch.Tensor, d_v: int, plan=None, *, tile: int = 64,
                   triton_knobs: bool = False) -> str:
    """``"triton"`` or ``"cuda"`` for these (checked) inputs.

    ``"cuda"`` raises ``ValueError`` when the CUDA kernel cannot run them (naming why); ``"auto"`` takes the
    CUDA kernel wherever it runs (1.4-1.6x faster than Triton at every head count on the realistic workloads,
    BENCHMARKS.md) and otherwise Triton, saying once why when a GPU is present. ``triton_knobs``: Triton
    tuning arguments were given (the CUDA kernel has none). Reads no tensor data.
    """
    if backend == "triton":
        return backend
    dense = kv if kv.dtype != torch.uint8 else q.new_empty(0, q.shape[2])  # an FP8 cache is expanded first
    reason = cuda_backend.unavailable_reason(q.device) or cuda_backend.unsupported_reason(q, dense, d_v, plan)
    if reason is None and plan is None and tile != cuda_backend.TILE:
        reason = f"the CUDA backend runs tile = {cuda_backend.TILE}, got {tile}"
    if reason is None and triton_knobs:
        reason = "the _triton tuning (dv_split, num_warps, num_stages, fp8_expand=False) is the Triton kernel's"
    if reason is None:
        return "cuda"
    if backend == "cuda":
        raise ValueError(f"backend='cuda': {reason}")
    if q.device.type == "cuda" and reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"quilt_attn: backend='auto' runs Triton: {reason}", stacklevel=3)
    return "triton"


def kernel_kv(q: torch.Tensor, kv: torch.Tensor, backend: str, topk: int, fp8_expand: bool | None,
              plan=None) -> torch.Tensor:
    """kv as ``backend``'s kernel reads it. An FP8 cache, for the CUDA kernel with bf16 q: given as it is, for
    ``cuda_backend.launch_sparse_attention_cuda`` to widen only the rows the call references (or, with
    ``cuda_backend.FP8_IN_KERNEL``, every gathered row in the kernel), in pools of more than
    ``cuda_backend.FP8_COMPACT_POOL`` rows and wherever the call runs the caller's ``plan`` (which keeps the
    numbering of its rows: its later calls only widen them), but for split-private plans; else expanded to q's
    dtype once per call (prefill reads each row many times). For Triton: expanded when ``fp8_expand`` (None:
    when the call gathers at least ``s_kv`` rows), else as given (dequantized on load)."""
    if kv.dtype != torch.uint8:
        return kv
    reused_plan = plan is not None and plan.priv_n is None
    if (backend == "cuda" and q.dtype == torch.bfloat16 and fp8_expand is not True
            and (cuda_backend.FP8_IN_KERNEL or reused_plan or kv.shape[0] > cuda_backend.FP8_COMPACT_POOL)):
        return kv
    from .ops.fp8_expand import expand_fp8, expansion_pays_off  # a Triton kernel module: imported when first used

    if backend != "cuda" and fp8_expand is None:
        fp8_expand = expansion_pays_off(kv.shape[0], q.shape[0], topk)
    return expand_fp8(kv, q.dtype) if backend == "cuda" or fp8_expand else kv


# ----------------------------------------------------------------------------- decision
@dataclass(frozen=True)
class Decision:
    """What a call runs.

    quilt : a plan's tiles (the caller's, or one built with ``plan_settings``), else query programs over
        the indices.
    kernel : ``"triton"`` or ``"cuda"``, the kernel that runs that work (a plan with split private rows
        run by the CUDA kernel still runs those rows in Triton's query pass).
    """

    quilt: bool
    kernel: str


def decide(backend: str, method: str, h: int, settings: PlanSettings | None = None, *, plan=None,
           auto: bool = False) -> Decision:
    """The work a call runs (see the module docstring for the rule).

    Parameters
    ----------
    backend : the resolved backend, ``"triton"`` or ``"cuda"`` (``choose_backend``).
    method : ``"quilt"`` or ``"query_parallel"``.
    h : heads of q.
    settings : the call's ``PlanSettings`` (None: the defaults); its ``fallback`` is the rule, True (the
        settings rule), False (always run the plan) or ``"cost"`` (the measured tile-cost rule; needs ``plan``,
        whose tile counts it reads on the host once). A given ``plan``'s group size and importance clipping
        stand for the settings'.
    plan : the caller's plan, or None.
    auto : the backend was chosen by ``backend="auto"`` (which may hand CUDA query programs to Triton).

    Reads no tensor data unless ``fallback="cost"``.
    """
    settings = check_settings(settings)
    fallback = settings.fallback
    if fallback == "cost" and plan is None and method == "quilt":
        raise ValueError("fallback='cost' reads the tile counts of a plan the caller passes (one host sync a "
                         "plan): pass plan=, or use fallback=True")
    if plan is not None:
        group_size, importance_clip = plan.group_size, plan.importance_clip
    else:
        group_size, importance_clip = settings.group_size, settings.importance_clip
        if group_size is None:
            group_size = default_group_size(h)
    if method != "quilt":
        quilt = False
    elif fallback is False or importance_clip:
        quilt = True
    elif program_shape(h, group_size)[0] == 1:  # one query fills a 64-row tile: nothing to share in it
        quilt = False
    elif fallback == "cost":
        quilt = quilt_pays_off(plan, h) if backend == "triton" else (not auto or cuda_pays_off(plan, h))
    else:
        quilt = backend == "cuda" or program_shape(h, group_size)[0] >= TRITON_MIN_QUERIES
    kernel = backend
    if backend == "cuda" and not quilt and auto and program_shape(h, 1)[1] < 64:
        kernel = "triton"  # a CUDA query program would compute a whole 64-row tile for h rows
    return Decision(quilt, kernel)


def plan_settings(h: int, backend: str | None = None, settings: PlanSettings | None = None) -> dict:
    """``quilt_attn.plan`` keywords (without ``s_kv`` / ``topk_length``) of the plan a call with ``settings``
    builds.

    Parameters
    ----------
    h : heads of the q the plan serves.
    backend : ``"cuda"``: private rows stay in the 64-row tiles (``split_private = importance_clip``
        whatever is set: importance clipping clips the private lists, which then run in the Triton query
        pass that continues the CUDA state); ``"triton"`` or None: ``split_private`` as set.
    settings : ``PlanSettings`` (None: the defaults); ``group_size`` and ``merge_level`` None become the
        queries one program holds (``ops.sparse_attention.default_group_size``, ``program_shape``); ``tile``
        must be a power of two >= 16 (the kernels' tile).
    """
    st = check_settings(settings)
    group_size = default_group_size(h) if st.group_size is None else st.group_size
    tile = st.tile  # (checked by PlanSettings)
    merge_level = program_shape(h, group_size)[0] if st.merge_level is None else st.merge_level
    split_private = bool(st.importance_clip) if backend == "cuda" else st.split_private
    return dict(group_size=group_size, tile=tile, clip_threshold=st.clip_threshold,
                importance_clip=st.importance_clip, merge_level=merge_level, split_private=split_private)


def workspace_bytes(s_q: int, topk: int, h: int, *, s_kv: int, backend: str,
                    settings: PlanSettings | None = None) -> int:
    """Bytes of the ``workspace`` that ``sparse_prefill(..., settings=settings, workspace=...)`` plans in
    (0 where the call plans nothing); ``backend`` resolved (``choose_backend``)."""
    if not decide(backend, "quilt", h, settings).quilt:
        return 0
    pkw = plan_settings(h, backend, settings)
    return plan_workspace_bytes(s_q, topk, group_size=pkw["group_size"], merge_level=pkw["merge_level"],
                                tile=pkw["tile"], split_private=pkw["split_private"], s_kv=s_kv)


# ----------------------------------------------------------------------------- measured cost rule
def _host_counts(plan, qp: int) -> tuple[int, int, int]:
    """(shared tiles a ``qp``-query program runs, summed over programs; private 64-row query tiles; valid
    pairs) of ``plan``, read in one device-to-host copy."""
    shared = plan.work_list(qp)[1].sum(dtype=torch.int64)
    zero = torch.zeros((), dtype=torch.int64, device=plan.device)
    priv = ((plan.priv_n + 63) // 64).sum(dtype=torch.int64) if plan.priv_n is not None else zero
    shared, priv, valid = torch.stack([shared, priv, plan.valid_pairs.to(torch.int64).reshape(())]).tolist()
    return shared, priv, valid


def quilt_pays_off(plan, h: int, margin: float = 0.95) -> bool:
    """The measured rule on Triton: whether running ``plan`` at ``h`` heads beats query programs.

    Counts tile-times: a shared 64-row tile costs ``TILE64_OVER_TILE16`` 16-row query tiles. One host
    sync, cached in the plan (``Plan.cached``).
    """
    qp, hb = program_shape(h, plan.group_size)
    if qp == 1:  # one query fills the 64 rows: nothing to share inside a tile
        return False
    hb16 = program_shape(h, 1)[1]

    def pays() -> bool:
        shared, priv, valid = _host_counts(plan, qp)
        cost = TILE64_OVER_TILE16 * shared * -(-h // hb) * (plan.tile / 64) + priv * -(-h // hb16)  # 64-row kv units
        return cost < margin * -(-valid // 64) * -(-h // hb16)  # (a lower bound of the query tiles)

    return plan.cached(("dispatch.quilt_pays_off", h, margin), pays)


def cuda_pays_off(plan, h: int) -> bool:
    """The measured rule on the CUDA backend: whether running ``plan`` with the CUDA kernel beats Triton's
    query programs at ``h`` heads.

    With little sharing the CUDA kernel's 64-row tiles are mostly masked while Triton runs 16- or 32-row
    query programs; the tile costs below decide which is faster. One host sync, cached in the plan.
    """
    qp = program_shape(h, plan.group_size)[0]
    rows16 = program_shape(h, 1)[1]
    if qp == 1 or rows16 not in TRITON_QP_TILE_NS:
        return True

    def pays() -> bool:
        cuda_tiles, _, valid = _host_counts(plan, qp)
        return cuda_tiles * CUDA_TILE_NS < -(-valid // 64) * TRITON_QP_TILE_NS[rows16]

    return plan.cached(("dispatch.cuda_pays_off", h), pays)


# ----------------------------------------------------------------------------- outputs
def natural_log_stats(max_logits: torch.Tensor, lse: torch.Tensor):
    """The kernels' base-2 ``max_logits, lse [s_q, h]`` (float32) turned into FlashMLA's natural-log values,
    in place on the device (times ln 2; an empty row's -inf / +inf stay). Returns them. One launch when they
    are the two halves of one contiguous buffer (``alloc_outputs``'), two otherwise."""
    n = max_logits.numel()
    if (max_logits.is_contiguous() and lse.is_contiguous() and lse.numel() == n and lse.dtype == max_logits.dtype
            and lse.device == max_logits.device
            and lse.data_ptr() == max_logits.data_ptr() + n * max_logits.element_size()
            and lse.untyped_storage().data_ptr() == max_logits.untyped_storage().data_ptr()):
        max_logits.as_strided((2 * n,), (1,)).mul_(LN2)
        return max_logits, lse
    max_logits.mul_(LN2)
    lse.mul_(LN2)
    return max_logits, lse
