"""Argument checks shared by the public functions.

Every check raises ``TypeError`` (wrong type / dtype) or ``ValueError`` (wrong shape,
size, device or value) and names the argument, so a bad call never reaches a kernel.
"""
from __future__ import annotations

import math
import numbers

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_INT32_MAX = torch.iinfo(torch.int32).max


def require_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.layout != torch.strided:  # sparse / nested tensors have no strides for the kernels to read
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")
    return x


def require_dtype(name: str, x: torch.Tensor, allowed) -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise TypeError(f"{name} must have dtype in ({names}), got {str(x.dtype).replace('torch.', '')}")


def require_ndim(name: str, x: torch.Tensor, ndims, layout: str) -> None:
    if x.dim() not in ndims:
        raise ValueError(f"{name} must be {layout}, got shape {tuple(x.shape)}")


def require_same_device(name: str, x: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but {ref_name} is on {ref.device}; put them on one device")


def canonical_indices(indices, s_q: int | None = None, name: str = "indices") -> torch.Tensor:
    """Return indices as a row-major contiguous int32 ``[s_q, topk]``; accepts FlashMLA's ``[s_q, 1, topk]``.

    Every reader (kernels, planners) then sees unit-stride rows whatever strides the caller's
    tensor had; a no-op (no copy) when the tensor is already contiguous.
    """
    return indices_view(indices, s_q, name).contiguous()


def indices_view(indices, s_q: int | None = None, name: str = "indices") -> torch.Tensor:
    """The checked ``[s_q, topk]`` int32 view of ``indices`` (``[s_q, 1, topk]`` squeezed), no copy.

    The caller's own memory, strides kept: what a plan records as its source (``planner.source``).
    """
    require_tensor(name, indices)
    if indices.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {str(indices.dtype).replace('torch.', '')}")
    if indices.dim() == 3:
        if indices.shape[1] != 1:
            raise ValueError(f"{name} of shape [s_q, h_kv, topk] must have h_kv == 1, got {tuple(indices.shape)}")
        indices = indices[:, 0, :]
    require_ndim(name, indices, (2,), "[s_q, topk] (or [s_q, 1, topk])")
    if indices.shape[1] < 1:
        raise ValueError(f"{name} must have topk >= 1, got shape {tuple(indices.shape)}")
    if s_q is not None and indices.shape[0] != s_q:
        raise ValueError(f"{name} has {indices.shape[0]} rows but q has s_q = {s_q}")
    return indices


def canonical_kv(kv, name: str = "kv") -> torch.Tensor:
    """Return a dense kv as ``[s_kv, d_qk]``; accepts FlashMLA's ``[s_kv, 1, d_qk]``."""
    require_tensor(name, kv)
    if kv.dim() == 3:
        if kv.shape[1] != 1:
            raise ValueError(f"{name} of shape [s_kv, h_kv, d] must have h_kv == 1 (MLA latent cache), got {tuple(kv.shape)}")
        kv = kv[:, 0, :]
    require_ndim(name, kv, (2,), "[s_kv, d_qk] (or [s_kv, 1, d_qk])")
    return kv


def check_topk_length(topk_length, s_q: int, device, topk: int | None = None) -> torch.Tensor | None:
    """Checked ``topk_length [s_q]`` as int32, clamped into ``[0, topk]`` (``[0, 2**31 - 1]`` without ``topk``).

    The clamp runs on the device before the cast (no host sync): an int64 length beyond int32 would
    otherwise wrap (``2**32 + 5`` acting as 5); a negative length keeps no entry, like 0.
    """
    if topk_length is None:
        return None
    require_tensor("topk_length", topk_length)
    if topk_length.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_length must be int32 (or int64), got {str(topk_length.dtype).replace('torch.', '')}")
    if topk_length.shape != (s_q,):
        raise ValueError(f"topk_length must have shape [s_q] = [{s_q}], got {tuple(topk_length.shape)}")
    if topk_length.device != device:
        raise ValueError(f"topk_length is on {topk_length.device} but indices are on {device}")
    return topk_length.clamp(0, _INT32_MAX if topk is None else topk).to(torch.int32)


def check_sm_scale(sm_scale, d_qk: int) -> float:
    """``sm_scale`` as a float (default ``d_qk ** -0.5``): a finite real Python / NumPy number.

    A tensor is refused rather than read (reading it would be a host sync on every call).
    """
    if sm_scale is None:
        return d_qk**-0.5
    if isinstance(sm_scale, bool) or not isinstance(sm_scale, numbers.Real):
        raise TypeError(f"sm_scale must be a real number (int or float) or None, got {type(sm_scale).__name__}")
    if not math.isfinite(float(sm_scale)):
        raise ValueError(f"sm_scale must be finite, got {sm_scale!r}")
    return float(sm_scale)


def check_d_v(d_v, d_qk: int) -> int:
    """``d_v``: an int in ``[1, d_qk]`` (the values are the first ``d_v`` columns of kv)."""
    if isinstance(d_v, bool) or not isinstance(d_v, numbers.Integral):
        raise TypeError(f"d_v must be an int in [1, d_qk = {d_qk}], got {type(d_v).__name__} {d_v!r}")
    if not 0 < d_v <= d_qk:
        raise ValueError(f"d_v must be an int in [1, d_qk = {d_qk}], got {d_v}")
    return int(d_v)


def check_attn_sink(attn_sink, h: int, device) -> torch.Tensor | None:
    if attn_sink is None:
        return None
    require_tensor("attn_sink", attn_sink)
    require_dtype("attn_sink", attn_sink, (torch.float32,))
    if attn_sink.shape != (h,):
        raise ValueError(f"attn_sink must have shape [h] = [{h}], got {tuple(attn_sink.shape)}")
    if attn_sink.device != device:
        raise ValueError(f"attn_sink is on {attn_sink.device} but q is on {device}")
    return attn_sink.contiguous()  # (the kernels read one float a head by address: a strided view is copied)
