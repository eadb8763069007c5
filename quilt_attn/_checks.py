"""Argument checks shared by the public functions.

Every check raises ``TypeError`` (wrong type / dtype) or ``ValueError`` (wrong shape,
size, device or value) and names the argument, so a bad call never reaches a kernel.
"""
from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def require_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
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
    """Return indices as int32 ``[s_q, topk]``; accepts FlashMLA's ``[s_q, 1, topk]``."""
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


def check_topk_length(topk_length, s_q: int, device) -> torch.Tensor | None:
    if topk_length is None:
        return None
    require_tensor("topk_length", topk_length)
    if topk_length.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_length must be int32 (or int64), got {str(topk_length.dtype).replace('torch.', '')}")
    if topk_length.shape != (s_q,):
        raise ValueError(f"topk_length must have shape [s_q] = [{s_q}], got {tuple(topk_length.shape)}")
    if topk_length.device != device:
        raise ValueError(f"topk_length is on {topk_length.device} but indices are on {device}")
    return topk_length.to(torch.int32)


def check_attn_sink(attn_sink, h: int, device) -> torch.Tensor | None:
    if attn_sink is None:
        return None
    require_tensor("attn_sink", attn_sink)
    require_dtype("attn_sink", attn_sink, (torch.float32,))
    if attn_sink.shape != (h,):
        raise ValueError(f"attn_sink must have shape [h] = [{h}], got {tuple(attn_sink.shape)}")
    if attn_sink.device != device:
        raise ValueError(f"attn_sink is on {attn_sink.device} but q is on {device}")
    return attn_sink
