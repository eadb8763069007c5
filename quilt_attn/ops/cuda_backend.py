"""CUDA backend (Hopper, sm_90a): built on first use, launched through ctypes.

The kernels (``csrc/quilt_sm90.cu``: attention; ``csrc/quilt_plan.cu``: the planner; ``csrc/quilt_compact.cu``:
the FP8 compaction's mark pass) have no torch dependency: nvcc builds them into one plain shared library (about 10 s), cached under ``$QUILT_CUDA_CACHE`` (default ``~/.cache/quilt_attn``) by a
hash of the sources and flags, so one build serves every torch version and later runs load it at
once. Tensors are passed as raw pointers on torch's current stream.

Scope: d_qk 576 / d_v 512, bf16 or fp16 q and dense kv of q's dtype or the FP8 cache (expanded by the caller,
``dispatch.kernel_kv``, its referenced rows compacted, ``launch_fp8_compact``, or widened in the kernel), plans
with 64-row tiles, any head count 1..128.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from ..kv_cache import FP8_BYTES
from ..reference import LOG2E
from .shapes import program_shape, sm_count

CSRC = Path(__file__).with_name("csrc")
UNITS = ("quilt_sm90.cu", "quilt_plan.cu", "quilt_compact.cu")  # translation units, linked into one library
# what the build-cache hash covers: the units and every header beside them
SOURCES = (*UNITS, *sorted(p.name for p in CSRC.glob("*.cuh")))
NVCC_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "--use_fast_math",
              "-shared", "-Xcompiler", "-fPIC")
D_QK, D_V, TILE = 576, 512, 64


class CudaBackendError(RuntimeError):
    """The CUDA backend cannot run here (no Hopper GPU, no nvcc, a failed build or launch)."""


class _Params(ctypes.Structure):
    # mirrors quilt_sm90::Params field by field (checked against the library's layout table at load)
    _fields_ = [(n, ctypes.c_void_p) for n in ("q", "kv", "out", "max_logits", "lse", "sink", "tile_kv",
                                                "tile_mask", "prog_tiles", "prog_ntiles", "prog_order", "indices",
                                                "topk_length")]
    _fields_ += [(n, ctypes.c_longlong) for n in ("stride_qs", "stride_qh", "stride_kv", "stride_idx",
                                                  "stride_os", "stride_oh")]
    _fields_ += [(n, ctypes.c_int) for n in ("s_q", "s_kv", "h", "topk", "prog_cap", "group_size", "qp", "hb",
                                             "from_plan", "n_work", "nhb")]
    _fields_ += [("work_counter", ctypes.c_void_p), ("scale2", ctypes.c_float), ("skip", ctypes.c_int),
                 ("run_flag", ctypes.c_void_p), ("run_when", ctypes.c_int), ("repair", ctypes.c_void_p),
                 ("q_scale", ctypes.c_void_p), ("queue", ctypes.c_void_p), ("launch_flags", ctypes.c_int)]


# Params.launch_flags (csrc/sm90_config.cuh)
_LAUNCH_CHAINED, _LAUNCH_COUNTER_ZEROED = 1, 2
# A call's launches are chained (programmatic dependent launches, csrc/launch.cuh: each may be scheduled while
# the kernel ahead of it finishes) and the attention's and the repair pass's work counters come zeroed with the
# repair queue (sparse_attention.spare_word), so that no memset stands between the order kernel, the attention
# and the repair pass. False (measurement only): a memset before each launch, nothing chained.
CHAIN_LAUNCHES = True


class _PlanParams(ctypes.Structure):
    # mirrors quilt_plan::PlanParams field by field (checked against the library's layout table at load)
    _fields_ = [(n, ctypes.c_void_p) for n in ("indices", "topk_length", "tile_kv", "tile_mask", "tile_level",
                                                "tile_members", "group_tiles", "group_rows", "group_valid", "dropped",
                                                "priv_idx", "priv_n")]
    _fields_ += [("stride_idx", ctypes.c_longlong)]
    _fields_ += [(n, ctypes.c_int) for n in ("s_q", "s_kv", "topk", "n_groups", "cap", "tile", "merge", "iclip",
                                             "split", "log_flags", "nslots")]
    _fields_ += [("thr", ctypes.c_float)]


def find_nvcc() -> str | None:
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if root and os.access(os.path.join(root, "bin", "nvcc"), os.X_OK):
            return os.path.join(root, "bin", "nvcc")
    found = shutil.which("nvcc")
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if os.access("/usr/local/cuda/bin/nvcc", os.X_OK) else None


def cache_dir() -> Path:
    return Path(os.environ.get("QUILT_CUDA_CACHE") or Path.home() / ".cache" / "quilt_attn")


@functools.lru_cache(maxsize=None)
def _build_digest(defines: tuple[str, ...], units: tuple[Path, ...] = ()) -> str:
    """Hash of the flags and sources (with ``units``: those files and the headers beside them too), read once a
    process (``unavailable_reason`` asks on every call)."""
    h = hashlib.sha256(" ".join(NVCC_FLAGS + defines).encode())
    own = [CSRC / name for name in SOURCES]
    extra = ({*units} | {hdr for u in units for hdr in u.parent.glob("*.cuh")}) - set(own)
    for path in own + sorted(extra):
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def library_path(defines: tuple[str, ...] = (), units: tuple[Path, ...] = (), name: str = "quilt_sm90") -> Path:
    """Where ``build`` caches the library of these arguments."""
    return cache_dir() / f"{name}_{_build_digest(tuple(defines), tuple(units))}.so"


def build(nvcc: str | None = None, *, verbose: bool = False, defines: tuple[str, ...] = (),
          units: tuple[Path, ...] = (), name: str = "quilt_sm90") -> Path:
    """Compile the kernel library unless the cache has it; returns its path.

    ``defines`` (``-DNAME`` flags) build a variant for tools, e.g. the compute-sanitizer build; ``units`` (paths)
    replace the library's translation units for a study that builds its own kernel against these sources
    (``benchmarks/owner_exact``), cached as ``name``."""
    units = tuple(Path(u) for u in units)
    path = library_path(defines, units, name)
    if path.exists():
        return path
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise CudaBackendError("the CUDA backend is compiled on first use and needs nvcc (CUDA 12.3+); none found "
                               "(set CUDA_HOME)")
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        tmp_lib = Path(tmp) / path.name
        sources = units or tuple(CSRC / u for u in UNITS)
        cmd = [nvcc, *NVCC_FLAGS, *defines, "-o", str(tmp_lib), *(str(u) for u in sources)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if verbose or res.returncode != 0:
            print(res.stdout + res.stderr)
        if res.returncode != 0:
            raise CudaBackendError(f"building the CUDA backend failed ({' '.join(cmd)}):\n{res.stderr[-3000:]}")
        os.replace(tmp_lib, path)  # atomic: concurrent builders agree on one file
    return path


_LOCK = threading.Lock()
_LIB = None
_OVERRIDE: Path | None = None  # a prebuilt library to load instead of the package's build (use_library)


def use_library(path: str | Path | None = None) -> None:
    """Load the kernels from ``path`` from the next launch on (a prebuilt variant, e.g. ``build(defines=...)``
    for compute-sanitizer or a -D measurement switch); None: the package's own build again."""
    global _LIB, _OVERRIDE
    with _LOCK:
        _LIB, _OVERRIDE = None, (None if path is None else Path(path))


def _library():
    global _LIB
    with _LOCK:
        if _LIB is None:
            lib = ctypes.CDLL(str(_OVERRIDE or build()))
            lib.quilt_sm90_launch.argtypes = [ctypes.POINTER(_Params), ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                              ctypes.c_void_p]
            lib.quilt_sm90_launch.restype = ctypes.c_int
            lib.quilt_sm90_fp8mma_launch.argtypes = [ctypes.POINTER(_Params), ctypes.c_int, ctypes.c_void_p]
            lib.quilt_sm90_fp8mma_launch.restype = ctypes.c_int
            lib.quilt_fp8_quantize_q.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int,
                                                 ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            lib.quilt_fp8_quantize_q.restype = ctypes.c_int
            lib.quilt_sm90_error_string.restype = ctypes.c_char_p
            lib.quilt_sm90_error_string.argtypes = [ctypes.c_int]
            lib.quilt_plan_launch.argtypes = [ctypes.POINTER(_PlanParams), ctypes.c_int, ctypes.c_int, ctypes.c_int,
                                              ctypes.c_void_p]
            lib.quilt_plan_launch.restype = ctypes.c_int
            lib.quilt_program_order_launch.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                                                       ctypes.c_int, ctypes.c_void_p]
            lib.quilt_program_order_launch.restype = ctypes.c_int
            if hasattr(lib, "quilt_compact_mark_launch"):  # (a study's own build may leave the unit out)
                lib.quilt_compact_mark_launch.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_int,
                                                          ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
                lib.quilt_compact_mark_launch.restype = ctypes.c_int
            for struct, prefix in ((_Params, "quilt_sm90"), (_PlanParams, "quilt_plan")):
                ours = mirror_layout(struct)
                # (a library built before the layout table: its size is all there is to check)
                theirs = library_layout(lib, prefix) if hasattr(lib, prefix + "_params_layout") else ours
                if getattr(lib, prefix + "_params_size")() != ctypes.sizeof(struct) or theirs != ours:
                    raise CudaBackendError(f"CUDA backend: the {struct.__name__[1:]} block's layout differs between "
                                           f"Python {ours} and the library {theirs}")
            _LIB = lib
    return _LIB


def library_layout(lib, prefix: str) -> list[tuple[str, int]]:
    """(field, byte offset) of a parameter block as the library compiled it, in declaration order;
    ``prefix``: ``"quilt_sm90"`` (Params) or ``"quilt_plan"`` (PlanParams)."""
    fn = getattr(lib, prefix + "_params_layout")
    fn.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_int), ctypes.c_int]
    fn.restype = ctypes.c_int
    names, offsets = ctypes.c_char_p(), (ctypes.c_int * 128)()
    n = fn(ctypes.byref(names), offsets, len(offsets))
    return list(zip(names.value.decode().rstrip(",").split(","), offsets[:n]))


def mirror_layout(struct) -> list[tuple[str, int]]:
    """(field, byte offset) of a ctypes mirror (``_Params``, ``_PlanParams``), in declaration order."""
    return [(name, getattr(struct, name).offset) for name, _ in struct._fields_]


@functools.lru_cache(maxsize=None)
def _capability_reason(device_index: int) -> str | None:
    major, minor = torch.cuda.get_device_capability(device_index)
    if (major, minor) != (9, 0):
        return f"the CUDA backend is built for Hopper (sm_90a); this GPU is sm_{major}{minor}"
    return None


def unavailable_reason(device: torch.device) -> str | None:
    """Why the CUDA backend cannot run on ``device`` (None when it can). Asked on every call: the device's
    answer is cached, and once the library is loaded the file system is not asked again."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"the CUDA backend needs a CUDA device, got {device}"
    reason = _capability_reason(device.index if device.index is not None else torch.cuda.current_device())
    if reason:
        return reason
    if _LIB is None and not library_path().exists() and find_nvcc() is None:
        return "the CUDA backend is compiled on first use and needs nvcc (set CUDA_HOME); none found"
    return None


# FP8 cache rows widened to bf16 inside the kernel, on their way into shared memory (True), instead of the whole
# cache expanded to bf16 once a call before the kernel runs (False, the default: widening in the producer takes
# about twice the bf16 kernel's time, BENCHMARKS.md; it saves the pool's bf16 copy). dispatch.kernel_kv reads it.
FP8_IN_KERNEL = False


def unsupported_reason(q: torch.Tensor, kv: torch.Tensor, d_v: int, plan=None) -> str | None:
    """Why these (checked) inputs are outside the CUDA kernel's scope (None when inside): a dense kv of q's
    dtype, or (bf16 q) the FP8 cache ``uint8 [s_kv, 656]`` read in the kernel."""
    if q.shape[2] != D_QK or d_v != D_V:
        return f"the CUDA backend runs d_qk = {D_QK}, d_v = {D_V}; got d_qk = {q.shape[2]}, d_v = {d_v}"
    if kv.dtype == torch.uint8:
        if q.dtype != torch.bfloat16 or kv.dim() != 2 or kv.shape[1] != FP8_BYTES:
            return (f"the CUDA kernel reads an FP8 cache uint8 [s_kv, {FP8_BYTES}] with bf16 q; got "
                    f"{q.dtype} q and kv {tuple(kv.shape)}")
    elif q.dtype not in (torch.bfloat16, torch.float16) or kv.dtype != q.dtype:
        return f"the CUDA backend needs bf16 / fp16 q and a dense kv of the same dtype; got {q.dtype}, {kv.dtype}"
    if plan is not None and plan.tile != TILE:
        return f"the CUDA backend runs plans with tile = {TILE}, got {plan.tile}"
    return None


def _ptr(t) -> int | None:
    return None if t is None else t.data_ptr()


_CURRENT_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _raw_stream(device: torch.device) -> int:
    """The handle of torch's current stream on ``device``, for a launch (the raw query Triton's launcher makes:
    a few microseconds less a launch than building a ``torch.cuda.Stream``)."""
    if _CURRENT_RAW_STREAM is None:
        return torch.cuda.current_stream(device).cuda_stream
    return _CURRENT_RAW_STREAM(device.index if device.index is not None else torch.cuda.current_device())


# The planner kernel's scope (csrc/quilt_plan.cu): member bits in one byte, 16 list entries a thread in
# one CTA, and its shared memory: the entries' slot references, the pushed-row set and the membership hash
# table (1.5 slots an entry: its size follows the group's entries, not s_kv).
PLAN_MAX_GROUP, PLAN_MAX_ENTRIES, PLAN_SMEM_BYTES = 8, 16384, 232448 - 1024  # the kernel's static arrays: < 1 KB
PLAN_NO_BOUND = 2**31 - 1  # s_kv the kernel is given for a plan without one: only negatives are invalid


def plan_list_pad(topk: int) -> int:
    """Entries a member list occupies in the planner kernel (16 a thread, whole warps a member)."""
    return -(-topk // 512) * 512


# Membership-table slots a list entry: more make collision chains shorter and take more shared memory
# (group 4 at 1.5: 98 KB, two CTAs an SM; at 1.75 108 KB, still two). A measurement knob
# (benchmarks/plan_timing.py --table-slots); slot references stay below the planner's kDup bit (2^15).
PLAN_TABLE_SLOTS_PER_ENTRY = 1.5
PLAN_MAX_TABLE_SLOTS = (1 << 15) - 1


def plan_table_slots(group_size: int, topk: int) -> int:
    """Slots of the planner's membership hash table (``PLAN_TABLE_SLOTS_PER_ENTRY`` an entry), so that linear
    probing stays short even when no two entries share a row."""
    entries = group_size * plan_list_pad(topk)
    return min(int(entries * PLAN_TABLE_SLOTS_PER_ENTRY), PLAN_MAX_TABLE_SLOTS)


def plan_launch_shape(group_size: int, topk: int, tile: int) -> tuple[int, int, int]:
    """(threads, log2 of the pushed-row set's slots, dynamic shared memory bytes) of a planner launch."""
    threads = group_size * plan_list_pad(topk) // 16
    pushed = max(1, (group_size - 1) * tile)  # at most tile - 1 rows a (level, block), G - 1 of them
    log_flags = max(6, (2 * pushed - 1).bit_length())
    slots = plan_table_slots(group_size, topk)
    table = 4 * (-(-(slots + 1) // 4) * 4) + -(-(slots + 1) // 16) * 16  # keys, then member bytes (+1: a spare)
    return threads, log_flags, 64 * threads + (8 << log_flags) + table


def plan_unsupported_reason(group_size: int, topk: int, tile: int) -> str | None:
    """Why the CUDA planner cannot plan this shape (None when it can); any s_kv."""
    if group_size > PLAN_MAX_GROUP:
        return f"the CUDA planner runs group sizes up to {PLAN_MAX_GROUP}, got {group_size}"
    if topk < 1 or group_size * plan_list_pad(topk) > PLAN_MAX_ENTRIES:
        return f"the CUDA planner holds up to {PLAN_MAX_ENTRIES} entries a group, got group_size x topk {group_size} x {topk}"
    smem = plan_launch_shape(group_size, topk, tile)[2]
    if smem > PLAN_SMEM_BYTES:
        return (f"the CUDA planner's shared memory ({smem} bytes for topk {topk}, tile {tile}) exceeds "
                f"{PLAN_SMEM_BYTES}")
    return None


def launch_plan(indices, topk_length, s_kv, group_size, merge_level, tile, thr, importance_clip, split_private,
                out: dict) -> None:
    """Run the planner kernel over ``indices [s_q, topk]`` (contiguous int32) into the tensors of ``out``
    (``planner.cuda_plan`` allocates them; ``out["tile_mask"]`` None: packed columns); one CTA a group, no
    host sync. ``s_kv`` None: only negative rows are invalid."""
    s_q, topk = indices.shape
    reason = plan_unsupported_reason(group_size, topk, tile)
    if reason:
        raise ValueError(reason)
    n_groups = out["group_tiles"].shape[0]
    if n_groups == 0:
        return
    prm = plan_block(indices.data_ptr(), indices.stride(0), _ptr(topk_length), s_q, topk, s_kv, n_groups,
                     out["tile_kv"].shape[1], group_size, merge_level, tile, thr, importance_clip, split_private,
                     {name: _ptr(out[name]) for name in PLAN_OUTPUTS})
    submit_plan(prm, _raw_stream(indices.device))


PLAN_OUTPUTS = ("tile_kv", "tile_mask", "tile_level", "tile_members", "group_tiles", "group_rows", "group_valid",
                "dropped", "priv_idx", "priv_n")  # PlanParams' output pointers, in its order


def plan_block(indices: int, stride_idx: int, topk_length: int | None, s_q: int, topk: int, s_kv: int | None,
               n_groups: int, cap: int, group_size: int, merge_level: int, tile: int, thr: float,
               importance_clip: bool, split_private: bool, outputs: dict) -> _PlanParams:
    """The planner's parameter block: device addresses (``outputs``: ``PLAN_OUTPUTS`` -> address or None) and
    the plan's shape, for ``submit_plan``; the one place the block is filled."""
    prm = _PlanParams()
    prm.indices, prm.topk_length = indices, topk_length
    for name in PLAN_OUTPUTS:
        setattr(prm, name, outputs.get(name))
    prm.stride_idx = stride_idx
    prm.s_q, prm.s_kv, prm.topk, prm.n_groups = s_q, PLAN_NO_BOUND if s_kv is None else s_kv, topk, n_groups
    prm.cap, prm.tile, prm.merge = cap, tile, merge_level
    prm.iclip, prm.split, prm.thr = int(importance_clip), int(split_private), float(thr)
    threads, prm.log_flags, smem = plan_launch_shape(group_size, topk, tile)
    prm.nslots = plan_table_slots(group_size, topk)
    prm._launch = (group_size, threads, smem)
    return prm


def submit_plan(prm: _PlanParams, stream: int) -> None:
    """Launch the planner kernel with ``plan_block``'s block on ``stream`` (a raw handle)."""
    lib = _library()
    err = lib.quilt_plan_launch(ctypes.byref(prm), *prm._launch, ctypes.c_void_p(stream))
    if err != 0:
        raise CudaBackendError(f"CUDA planner launch failed: {lib.quilt_sm90_error_string(err).decode()}")


PROGRAM_ORDER_MAX_TILES = 1535  # the order kernel's bins less one (kOrderMaxBins, quilt_program_order_launch)


def program_order(ntiles: torch.Tensor, max_tiles: int) -> torch.Tensor:
    """``torch.argsort(ntiles, descending=True, stable=True)`` as int32 by one small kernel (a counting sort: one
    launch where torch's sort takes several and ~20 us), for contiguous int32 ``ntiles [n]`` on the GPU, each
    in ``0..max_tiles`` (at most ``PROGRAM_ORDER_MAX_TILES``). No host sync."""
    if (not ntiles.is_cuda or ntiles.dtype != torch.int32 or not ntiles.is_contiguous() or ntiles.dim() != 1
            or not 0 <= max_tiles <= PROGRAM_ORDER_MAX_TILES):
        raise ValueError(f"the order kernel sorts contiguous int32 [n] counts on a GPU in 0..max_tiles <= "
                         f"{PROGRAM_ORDER_MAX_TILES}; got {ntiles.dtype} {tuple(ntiles.shape)} on {ntiles.device}, "
                         f"max_tiles {max_tiles}")
    order = torch.empty_like(ntiles)
    submit_order(ntiles.data_ptr(), ntiles.numel(), max_tiles, order.data_ptr(), _raw_stream(ntiles.device))
    return order


def submit_order(ntiles: int, n: int, max_tiles: int, order: int, stream: int) -> None:
    """Launch the order kernel (``program_order``) on device addresses: ``order [n]`` from ``ntiles [n]``."""
    lib = _library()
    err = lib.quilt_program_order_launch(ntiles, n, max_tiles, order, int(CHAIN_LAUNCHES), ctypes.c_void_p(stream))
    if err != 0:
        raise CudaBackendError(f"program order launch failed: {lib.quilt_sm90_error_string(err).decode()}")


def mark_rows(words: torch.Tensor, s_kv: int, mark: torch.Tensor, packed: bool) -> None:
    """``mark[r] = 1`` for every pool row ``r`` that ``words`` reference (``fp8_compact.compact_columns``' mark pass,
    by ``csrc/quilt_compact.cu``: each CTA's rows deduplicated in shared memory first), for contiguous int32
    ``words`` (``packed``: plan columns) and a zeroed contiguous uint8 ``mark [s_kv]`` on the same GPU. No host
    sync."""
    if (words.dtype != torch.int32 or not words.is_contiguous() or not words.is_cuda or mark.dtype != torch.uint8
            or mark.shape != (s_kv,) or not mark.is_contiguous() or mark.device != words.device):
        raise ValueError(f"mark_rows marks uint8 [s_kv={s_kv}] on the GPU of its contiguous int32 words; got words "
                         f"{words.dtype} on {words.device}, marks {mark.dtype} {tuple(mark.shape)} on {mark.device}")
    err = _library().quilt_compact_mark_launch(words.data_ptr(), words.numel(), s_kv, int(packed), mark.data_ptr(),
                                               ctypes.c_void_p(_raw_stream(words.device)))
    if err != 0:
        raise CudaBackendError(f"mark launch failed: {_library().quilt_sm90_error_string(err).decode()}")


def plan_programs(plan, qp: int):
    """``(prog_tiles, prog_ntiles, order)`` of ``plan``'s programs of ``qp`` queries for the kernel: with one
    program a group (``qp >= group_size``) no tile list (None: the kernel reads tile ``i`` of program ``g`` at
    slot ``g * cap + i``), else ``plan.work_list(qp)``'s; ``plan.program_counts(qp)``; ``plan.program_order(qp)``,
    by the order kernel where the plan's capacity fits it."""
    tiles = None if qp >= plan.group_size else plan.work_list(qp)[0]
    sort = (lambda counts: program_order(counts, plan.capacity)) if plan.capacity <= PROGRAM_ORDER_MAX_TILES \
        else None
    return tiles, plan.program_counts(qp), plan.program_order(qp, sort=sort)


def work_items(h: int, s_q: int, plan=None) -> int:
    """Work items of a launch: programs (the plan's, else one a query) x head blocks."""
    return _work_shape(h, s_q, 1 if plan is None else plan.group_size, None if plan is None else plan.n_groups)[1]


def _work_shape(h: int, s_q: int, group_size: int, n_groups: int | None) -> tuple[int, int]:
    """(head blocks, work items) of a launch over ``n_groups`` plan groups of ``group_size`` (None: a program a
    query): programs x head blocks."""
    qp, hb = program_shape(h, group_size)
    nhb = -(-h // hb)
    n_prog = s_q if n_groups is None else n_groups * (group_size // min(qp, group_size))
    return nhb, n_prog * nhb


def launch(q, kv, sm_scale, out, max_logits, lse, *, indices=None, topk_length=None, plan=None, attn_sink=None,
           partial: bool = False, tile_kv=None, run_if=None, repair=None, queue=None, q_scale=None, counter=None,
           _skip: int = 0, _ctas: int | None = None) -> None:
    """One pass of the sm_90a kernel over ``plan``'s tiles or, without a plan, ``indices`` query by query.

    ``q [s_q, h, 576]``, ``kv [s_kv, 576]`` (q's dtype, unit stride in the last dimension),
    ``out [s_q, h, 512]`` (q's dtype, or float32 with ``partial``), ``max_logits, lse [s_q, h]`` float32.
    kv may also be the FP8 cache ``uint8 [s_kv, 656]`` (bf16 q): its rows are widened in the kernel.
    ``_skip`` (measurement only, results invalid): 1 skips the kv gather, 2 the matrix products.
    The grid is persistent: a CTA an SM, each taking work items (programs x head blocks, longest
    programs first) from a counter as it finishes the last; ``_ctas`` (measurement only) sets the CTA
    count, e.g. one a work item (what a non-persistent launch does).
    ``tile_kv``: the plan's columns renumbered (same shape and format, e.g. ``fp8_compact``'s), read in place
    of ``plan.tile_kv``. ``run_if = (flag, value)``: the kernel does nothing unless the int32 ``flag[0]``
    equals ``value`` when it starts (two launches, one chosen on the device). ``repair``: the call's repair queue
    (``sparse_attention.repair_buffer``), into which a pass that writes the final outputs queues every query
    whose output holds a NaN (``run_plan_passes``); ``queue``, such a queue once the passes that fill it have
    run: the repair pass, query programs over ``indices`` for the queued queries only (their count read on the
    device). ``q_scale``: the FP8 tensor-core mode (csrc/sm90_fp8mma.cuh): ``q`` is then ``quantize_q_fp8``'s
    rows ``uint8 [s_q, h, 640]`` and ``q_scale`` its scales, kv the FP8 cache, out bf16 (no partial mode).
    ``counter``: an int32 ``[1]`` on q's device holding 0 (``sparse_attention.spare_word``), the launch's work
    counter, used up by it; None: one of its own, zeroed by the launch. With ``CHAIN_LAUNCHES`` the launch is
    chained to the kernel before it in the stream (the FP8 mode's is not).
    """
    fp8mma = q_scale is not None
    if fp8mma and (partial or kv.dtype != torch.uint8 or q.dtype != torch.uint8 or q.shape[2] != FP8_Q_BYTES
                   or q_scale.dtype != torch.float32 or not q_scale.is_contiguous() or q_scale.shape != q.shape[:2]):
        raise ValueError(f"the FP8 mode runs quantize_q_fp8's q (uint8 [s_q, h, {FP8_Q_BYTES}] and float32 scales "
                         f"[s_q, h]) over the FP8 cache, final outputs only; got q {q.dtype} {tuple(q.shape)}, kv "
                         f"{kv.dtype}, partial={partial}")
    if not partial and (out.stride(-1) != 1 or out.data_ptr() % 16 or out.stride(0) % 8 or out.stride(1) % 8):
        raise ValueError("out must have a unit last stride, 16-byte alignment and row strides that are multiples of 8 "
                         f"(the kernel writes 16-byte pieces); got strides {tuple(out.stride())}")
    if not sm_scale > 0:  # (launch_sparse_attention_cuda turns any other real scale into a positive one)
        raise ValueError(f"sm_scale must be positive here (the kernel's running max assumes it), got {sm_scale}")
    for name, x in (("q", q), ("kv", kv)):
        if not copies_16_bytes(x):
            raise ValueError(f"{name} must start at a 16-byte aligned address with unit last stride and other strides "
                             f"that are multiples of 16 bytes (the kernel copies 16-byte pieces); got strides "
                             f"{tuple(x.stride())}, address % 16 = {x.data_ptr() % 16}")
    s_q, h, _ = q.shape
    G = plan.group_size if plan is not None else 1
    if queue is not None and (plan is not None or indices is None or partial or fp8mma or repair is not None):
        raise ValueError("the repair pass (queue) runs final outputs over indices, without a plan, q_scale or "
                         "a repair queue of its own")
    if plan is not None:
        prog_tiles, prog_ntiles, order = plan_programs(plan, program_shape(h, G)[0])
        cols = plan.tile_kv if tile_kv is None else tile_kv
        if cols.shape != plan.tile_kv.shape or cols.dtype != torch.int32 or not cols.is_contiguous():
            raise ValueError(f"tile_kv must be contiguous int32 {tuple(plan.tile_kv.shape)}, got {cols.dtype} "
                             f"{tuple(cols.shape)}")
        source = dict(tile_kv=cols.data_ptr(), tile_mask=_ptr(plan.tile_mask),  # tile_mask None: packed columns
                      prog_tiles=_ptr(prog_tiles), prog_ntiles=prog_ntiles.data_ptr(),
                      prog_order=order.data_ptr(), prog_cap=plan.capacity, n_groups=plan.n_groups, topk=plan.topk)
    else:
        source = dict(indices=indices.data_ptr(), stride_idx=indices.stride(0), topk=indices.shape[1],
                      topk_length=_ptr(topk_length))
    if counter is not None and (counter.dtype != torch.int32 or counter.numel() != 1 or counter.device != q.device):
        raise ValueError(f"counter must be one int32 on q's device, got {counter.dtype} {tuple(counter.shape)} "
                         f"on {counter.device}")
    zeroed = counter is not None and CHAIN_LAUNCHES and not fp8mma  # (the FP8 mode's launch zeroes its own)
    if not zeroed:
        counter = torch.empty(1, dtype=torch.int32, device=q.device)  # zeroed by the launch, on its stream
    if run_if is not None:
        flag = run_if[0]
        if flag.dtype != torch.int32 or flag.numel() < 1 or flag.device != q.device:
            raise ValueError(f"run_if's flag must be an int32 tensor on q's device, got {flag.dtype} on {flag.device}")
    prm = attention_block(q, kv, out, max_logits, lse, sm_scale, G, sink=None if partial else _ptr(attn_sink),
                          counter=counter.data_ptr(), counter_zeroed=zeroed, q_scale=_ptr(q_scale),
                          queue=_ptr(queue), repair=None if partial else _ptr(repair),
                          run_flag=None if run_if is None else run_if[0].data_ptr(),
                          run_when=0 if run_if is None else int(run_if[1]), skip=_skip, **source)
    if fp8mma:
        if kv.dim() != 2 or kv.shape[1] != FP8_BYTES or out.dtype != torch.bfloat16:
            raise ValueError(f"the FP8 mode reads the FP8 cache uint8 [s_kv, {FP8_BYTES}] into bf16 out; got kv "
                             f"{tuple(kv.shape)}, out {out.dtype}")
    else:
        reason = unsupported_reason(q, kv, D_V)
        if reason:
            raise ValueError(reason)
    submit_attention(prm, kv_code(q, kv), partial, fp8mma, q.device, ctas=_ctas)


def kv_code(q, kv) -> int:
    """The kernel instance's dtype code (``quilt_sm90_launch``): 0 bf16, 1 fp16, 2 bf16 q over the FP8 cache."""
    return 2 if kv.dtype == torch.uint8 else 0 if q.dtype == torch.bfloat16 else 1


def attention_block(q, kv, out, max_logits, lse, sm_scale: float, group_size: int, *, sink=None, tile_kv=None,
                    tile_mask=None, prog_tiles=None, prog_ntiles=None, prog_order=None, prog_cap: int = 0,
                    n_groups: int = 0, indices=None, stride_idx: int = 0, topk: int = 0, topk_length=None,
                    counter: int, counter_zeroed: bool, q_scale=None, queue=None, repair=None, run_flag=None,
                    run_when: int = 0, skip: int = 0) -> _Params:
    """The attention kernel's parameter block, the one place it is filled: the tensors ``q, kv, out,
    max_logits, lse`` (their addresses, strides and sizes) and device addresses (ints, or None) for the rest;
    with ``tile_kv`` over a plan's programs (``n_groups`` groups of ``group_size``; ``prog_tiles`` None: one
    program a group), else over ``indices`` query by query. ``counter``: the launch's work counter, zero
    already when ``counter_zeroed``, else zeroed by the launch."""
    s_q, h, _ = q.shape
    qp, hb = program_shape(h, group_size)
    assert hb & (hb - 1) == 0, f"program heads {hb} must be a power of two (the kernel shifts by log2)"
    prm = _Params()
    prm.q, prm.kv, prm.out, prm.max_logits, prm.lse = (t.data_ptr() for t in (q, kv, out, max_logits, lse))
    prm.sink = sink
    prm.stride_qs, prm.stride_qh = q.stride(0), q.stride(1)
    prm.stride_kv = kv.stride(0)
    prm.stride_os, prm.stride_oh = out.stride(0), out.stride(1)
    prm.s_q, prm.s_kv, prm.h = s_q, kv.shape[0], h
    prm.group_size, prm.qp, prm.hb = group_size, qp, hb
    prm.scale2 = float(sm_scale) * LOG2E
    prm.skip = skip
    prm.q_scale, prm.queue, prm.repair = q_scale, queue, repair
    if tile_kv is not None:
        prm.tile_kv, prm.tile_mask, prm.prog_tiles, prm.prog_ntiles = tile_kv, tile_mask, prog_tiles, prog_ntiles
        prm.prog_order, prm.prog_cap, prm.topk, prm.from_plan = prog_order, prog_cap, topk, 1
    else:
        prm.indices, prm.stride_idx, prm.topk, prm.topk_length = indices, stride_idx, topk, topk_length
    prm.nhb, prm.n_work = _work_shape(h, s_q, group_size, n_groups if tile_kv is not None else None)
    prm.work_counter = counter
    prm.launch_flags = (_LAUNCH_COUNTER_ZEROED if counter_zeroed else 0) | (_LAUNCH_CHAINED if CHAIN_LAUNCHES else 0)
    prm.run_flag, prm.run_when = run_flag, run_when
    return prm


def submit_attention(prm: _Params, dtype_code: int, partial: bool, fp8mma: bool, device: torch.device,
                     ctas: int | None = None) -> None:
    """Launch the attention kernel (``fp8mma``: the FP8 mode's) with ``attention_block``'s block on the current
    stream of ``device``: a persistent grid of one CTA an SM (``ctas``, measurement only: that many), never more
    than the block's work items."""
    ctas = min(int(sm_count(device) if ctas is None else ctas), prm.n_work)
    stream = _raw_stream(device)
    lib = _library()
    if fp8mma:
        err = lib.quilt_sm90_fp8mma_launch(ctypes.byref(prm), ctas, ctypes.c_void_p(stream))
    else:
        err = lib.quilt_sm90_launch(ctypes.byref(prm), dtype_code, int(partial), ctas, ctypes.c_void_p(stream))
    if err != 0:
        raise CudaBackendError(f"CUDA backend launch failed: {lib.quilt_sm90_error_string(err).decode()}")


FP8_Q_BYTES = 640  # a row of quantize_q_fp8: 512 e4m3 latent values, 64 bf16 rope values


def quantize_q_fp8(q: torch.Tensor):
    """q for the FP8 mode (``fp8_mode.kernel_quantize_q``'s arithmetic, on the GPU, one warp a (query, head)):
    ``q [s_q, h, 576]`` bf16 -> (rows ``uint8 [s_q, h, 640]``: the e4m3 latent of ``q / qs`` and the bf16 rope
    ``q_r / qs``; ``qs`` float32 ``[s_q, h]``, a power of two a (query, head), NaN for a row with a non-finite
    value)."""
    if q.dtype != torch.bfloat16 or q.dim() != 3 or q.shape[2] != D_QK:
        raise ValueError(f"the FP8 mode quantizes bf16 q [s_q, h, {D_QK}], got {q.dtype} {tuple(q.shape)}")
    q = aligned_16(q)
    s_q, h, _ = q.shape
    rows = torch.empty(s_q, h, FP8_Q_BYTES, dtype=torch.uint8, device=q.device)
    scale = torch.empty(s_q, h, dtype=torch.float32, device=q.device)
    stream = _raw_stream(q.device)
    err = _library().quilt_fp8_quantize_q(q.data_ptr(), q.stride(0), q.stride(1), s_q, h, rows.data_ptr(),
                                          scale.data_ptr(), ctypes.c_void_p(stream))
    if err != 0:
        raise CudaBackendError(f"FP8 q quantization failed: {_library().quilt_sm90_error_string(err).decode()}")
    return rows, scale


def copies_16_bytes(x: torch.Tensor) -> bool:
    """Whether the kernel's 16-byte copies can read ``x`` in place: an aligned start, unit last stride and the
    other strides multiples of 16 bytes."""
    e = x.element_size()
    return (x.data_ptr() % 16 == 0 and x.stride(-1) == 1
            and all((st * e) % 16 == 0 for st, n in zip(x.stride()[:-1], x.shape[:-1]) if n > 1))


def aligned_16(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a contiguous copy of it where the kernel could not read it in place (a view that starts
    inside a row, odd strides)."""
    return x if copies_16_bytes(x) else x.clone(memory_format=torch.contiguous_format)


def launch_sparse_attention_cuda(q, kv, sm_scale, d_v, *, indices=None, topk_length=None, plan=None,
                                 attn_sink=None, precision: str = "exact", plan_is_spent: bool = False):
    """Allocate outputs and run the CUDA kernel (the counterpart of ``launch_sparse_attention``).

    A plan that split private rows off runs its shared tiles here (float32 partial state) and the
    private rows in the Triton query pass that continues that state. ``indices`` (and ``topk_length``) given
    with a plan: the ones it was built from, for the repair pass (``sparse_attention.run_plan_passes``).
    ``plan_is_spent``: the plan was made for this call alone (an FP8 pool's compaction renumbers it in place).
    """
    from .sparse_attention import alloc_outputs  # a Triton kernel module: imported when first used

    out, max_logits, lse = alloc_outputs(q, d_v)
    if q.shape[0] == 0:
        return out, max_logits, lse
    q, kv = aligned_16(q), aligned_16(kv)
    if sm_scale <= 0:  # the kernel's running max assumes a positive scale: q.k s = (-q).k (-s), exactly; a zero
        # scale is q times 0 (a NaN or inf in q still makes its logits NaN, as q.k x 0 does) at scale 1
        q, sm_scale = (-q, -sm_scale) if sm_scale < 0 else (q * 0, 1.0)
    if precision == "fp8":
        launch_fp8mma(q, kv, sm_scale, d_v, out, max_logits, lse, indices=indices, topk_length=topk_length, plan=plan,
                      attn_sink=attn_sink)
    elif plan is not None:
        run_plan_passes_cuda(q, kv, sm_scale, d_v, out, max_logits, lse, plan=plan, attn_sink=attn_sink,
                             repair_from=None if indices is None else (indices, topk_length),
                             plan_is_spent=plan_is_spent)
    elif _compacts(kv):
        launch_fp8_compact(q, kv, sm_scale, out, max_logits, lse, indices=indices, topk_length=topk_length,
                           attn_sink=attn_sink)
    else:
        launch(q, kv, sm_scale, out, max_logits, lse, indices=indices, topk_length=topk_length, attn_sink=attn_sink)
    return out, max_logits, lse


# FP8 pools of more rows than FP8_COMPACT_POOL have a call's referenced rows widened into a compact bf16 buffer
# of FP8_COMPACT_ROWS rows (ops/fp8_compact.py; 1152 bytes a row, 144 MiB) instead of the whole pool expanded
# (dispatch.kernel_kv); a call referencing more distinct rows widens them in the kernel instead.
FP8_COMPACT_POOL = 1 << 19
FP8_COMPACT_ROWS = 1 << 17
# The compaction's mark pass by the CUDA kernel (mark_rows: the rows of neighbouring lists or plan groups
# deduplicated in shared memory before any store); False (measurement only): the Triton pass.
FP8_CUDA_MARK = True


def _compacts(kv) -> bool:
    """Whether a pass over ``kv`` (as ``dispatch.kernel_kv`` gives it) runs on its compacted rows: an FP8 cache
    not widened in the kernel (``FP8_IN_KERNEL``). Not for the tiles of split-private plans: their Triton
    pass reads the cache's own rows."""
    return kv.dtype == torch.uint8 and not FP8_IN_KERNEL


def launch_fp8_compact(q, cache, sm_scale, out, max_logits, lse, *, indices=None, topk_length=None, plan=None,
                       attn_sink=None, cap: int | None = None, repair=None, plan_is_spent: bool = False) -> None:
    """The kernel over an FP8 cache's referenced rows widened into a compact bf16 buffer (``fp8_compact``),
    and, chosen on the device when they are more than ``cap`` (default ``FP8_COMPACT_ROWS``), over the cache
    itself, widened in the kernel; no host sync. Not for split-private plans (their Triton pass reads the
    cache's own rows). ``repair``: as in ``launch``.

    With a plan, the numbering of its rows depends on its columns alone: it is made on the plan's first FP8
    call and kept with the plan (``Plan.cached``; one more int32 a column), so a plan reused across calls pays
    only the widening. ``plan_is_spent``: a plan the call made and drops after it, renumbered in place instead
    (no copy of its columns; the plan then addresses the compact rows). Query programs number their index lists
    every call."""
    from .fp8_compact import compact_columns  # a Triton kernel module: imported when first used

    cap = min(FP8_COMPACT_ROWS if cap is None else cap, cache.shape[0])
    cache = cache.contiguous()  # (its layout is checked where it is widened, expand_fp8)
    s_kv = cache.shape[0]
    if plan is not None:
        plan.wait()
        number = functools.partial(compact_columns, plan.tile_kv, s_kv, cap, packed=plan.tile_mask is None,
                                   cuda_mark=FP8_CUDA_MARK)
        c = number(in_place=True) if plan_is_spent else plan.cached(("cuda_backend.fp8_compact", s_kv, cap), number)
        work = dict(plan=plan)
        compact = dict(plan=plan, tile_kv=c.columns)
    else:
        indices = indices.contiguous()
        c = compact_columns(indices, s_kv, cap, packed=False, cuda_mark=FP8_CUDA_MARK)
        work = dict(indices=indices, topk_length=topk_length)
        compact = dict(indices=c.columns, topk_length=topk_length)
    launch(q, c.widen(cache), sm_scale, out, max_logits, lse, attn_sink=attn_sink, run_if=(c.fits, 1), repair=repair,
           **compact)
    launch(q, cache, sm_scale, out, max_logits, lse, attn_sink=attn_sink, run_if=(c.fits, 0), repair=repair, **work)


def launch_fp8mma(q, cache, sm_scale, d_v, out, max_logits, lse, *, indices=None, topk_length=None, plan=None,
                  attn_sink=None) -> None:
    """The FP8 tensor-core mode (``precision="fp8"``): q quantized (``quantize_q_fp8``), then the kernel over the
    plan's tiles or, without a plan, query by query; then the repair pass: a query whose output holds a NaN (a
    non-finite q value, a selected row's non-finite value, or in a tile a partner's) is recomputed by the exact
    query pass (``fp8_mode``, step 5). Not for split-private plans (no partial state)."""
    from .sparse_attention import repair_buffer, run_plan_passes

    qf8, qs = quantize_q_fp8(q)
    if plan is None:
        repair = repair_buffer(q.shape[0], q.device)
        launch(qf8, cache, sm_scale, out, max_logits, lse, indices=indices, topk_length=topk_length,
               attn_sink=attn_sink, q_scale=qs, repair=repair)
        _repair_pass(q, cache, sm_scale, attn_sink)(out, max_logits, lse, indices, topk_length, repair)
        return
    if plan.split_private:
        raise ValueError("precision='fp8' runs plans whose private rows stay in the tiles (split_private=False; "
                         "importance clipping splits them off)")

    def tile_pass(o, m, l, partial, repair):
        launch(qf8, cache, sm_scale, o, m, l, plan=plan, attn_sink=attn_sink, repair=repair, q_scale=qs)

    run_plan_passes(q, cache, sm_scale, d_v, out, max_logits, lse, plan=plan, attn_sink=attn_sink,
                    tile_pass=tile_pass, repair_from=None if indices is None else (indices, topk_length),
                    repair_pass=_repair_pass(q, cache, sm_scale, attn_sink))


def _repair_pass(q, kv, sm_scale, attn_sink):
    """``run_plan_passes``' repair pass on this kernel: query programs over the call's own indices for the queued
    queries (exact arithmetic; an FP8 cache's rows widened in the kernel), its work counter the queue's spare
    word 1."""
    from .sparse_attention import spare_word

    def run(o, m, l, indices, topk_length, queue):
        launch(q, kv, sm_scale, o, m, l, indices=indices, topk_length=topk_length, attn_sink=attn_sink, queue=queue,
               counter=spare_word(queue, 1))
    return run


def run_plan_passes_cuda(q, kv, sm_scale, d_v, out, max_logits, lse, *, plan, attn_sink=None, repair_from=None,
                         plan_is_spent: bool = False):
    """``sparse_attention.run_plan_passes`` with this kernel running the plan's tiles (an FP8 cache's on its
    compacted rows, ``_compacts``, but for the partial pass of a split-private plan)."""
    from .sparse_attention import run_plan_passes, spare_word

    def tile_pass(o, m, l, partial, repair):
        if _compacts(kv) and not partial:
            launch_fp8_compact(q, kv, sm_scale, o, m, l, plan=plan, attn_sink=attn_sink, repair=repair,
                               plan_is_spent=plan_is_spent)
        else:  # (the queue's spare word 0: this pass's work counter, zeroed with the queue)
            launch(q, kv, sm_scale, o, m, l, plan=plan, attn_sink=attn_sink, partial=partial, repair=repair,
                   counter=None if repair is None else spare_word(repair, 0))

    run_plan_passes(q, kv, sm_scale, d_v, out, max_logits, lse, plan=plan, attn_sink=attn_sink, tile_pass=tile_pass,
                    repair_from=repair_from, repair_pass=_repair_pass(q, kv, sm_scale, attn_sink))
