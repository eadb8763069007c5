"""Save and load index tensors as ``.npy``, ``.pt`` or ``.safetensors`` files.

The tensor is int32 ``[s_q, topk]`` (``-1`` = invalid entry). A ``.safetensors`` file stores it
under the key ``"indices"``; a ``.pt`` file holds the tensor itself (or a dict with that key).
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

FORMATS = (".npy", ".pt", ".safetensors")
KEY = "indices"
_INT32 = torch.iinfo(torch.int32)
_UNSIGNED = tuple(getattr(torch, n) for n in ("uint16", "uint32", "uint64") if hasattr(torch, n))


def _format_of(path) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"path must end in one of {list(FORMATS)}, got {str(path)!r}")
    return suffix


def _as_int32(indices: torch.Tensor, what: str) -> torch.Tensor:
    """Check dtype and shape; int64 (or a narrower int) becomes int32 when its values fit.

    Parameters
    ----------
    indices : integer tensor ``[s_q, topk]`` (``[s_q, 1, topk]`` is squeezed).
    what : how to name the tensor in errors.
    """
    if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
        raise TypeError(f"{what} must hold integers (int32), got {str(indices.dtype).replace('torch.', '')}")
    if indices.dim() == 3 and indices.shape[1] == 1:
        indices = indices[:, 0, :]
    if indices.dim() != 2:
        raise ValueError(f"{what} must be [s_q, topk] (or [s_q, 1, topk]), got shape {tuple(indices.shape)}")
    if indices.dtype in _UNSIGNED:  # torch has few unsigned kernels: check the range in NumPy
        array = indices.cpu().numpy()
        if array.size and int(array.max()) > _INT32.max:
            raise ValueError(f"{what} has values outside the int32 range; they cannot be kv row indices")
        indices = torch.from_numpy(array.astype(np.int32))
    if indices.dtype != torch.int32:
        if indices.numel() and (int(indices.min()) < _INT32.min or int(indices.max()) > _INT32.max):
            raise ValueError(f"{what} has values outside the int32 range; they cannot be kv row indices")
        indices = indices.to(torch.int32)
    return indices.contiguous()


def save_indices(indices: torch.Tensor, path) -> None:
    """Write ``indices`` (int32 ``[s_q, topk]``) to ``path``; the suffix picks the format.

    Parameters
    ----------
    indices : int32 (or int64 with int32 values) ``[s_q, topk]``, on any device.
    path : str or path ending in ``.npy``, ``.pt`` or ``.safetensors``.
    """
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices must be a torch.Tensor, got {type(indices).__name__}")
    fmt = _format_of(path)
    indices = _as_int32(indices.detach().cpu(), "indices")
    if fmt == ".npy":
        np.save(path, indices.numpy(), allow_pickle=False)
    elif fmt == ".pt":
        torch.save(indices, path)
    else:
        from safetensors.torch import save_file

        save_file({KEY: indices}, str(path))


class _Unreadable(Exception):
    """A reader library failed on the file's bytes (empty, corrupt, truncated); ``load_indices`` names it."""


def _reading(fn):
    """``fn()``, with any error of the reader library (each raises its own kind: EOFError, RuntimeError,
    UnpicklingError, SafetensorError, ValueError, ...) turned into ``_Unreadable`` (its first line)."""
    try:
        return fn()
    except Exception as err:  # noqa: BLE001 -- whatever the library raises, the file is unreadable
        detail = str(err).strip().splitlines()
        raise _Unreadable(f"{type(err).__name__}: {detail[0] if detail else 'no detail'}") from err


def _read(path, fmt: str) -> torch.Tensor:
    if fmt == ".npy":
        array = _reading(lambda: np.load(path, allow_pickle=False))
        if not isinstance(array, np.ndarray):  # an .npz archive
            raise ValueError(f"{str(path)!r} holds a {type(array).__name__}, not one .npy array")
        if array.dtype.kind not in "iufb":
            raise TypeError(f"{str(path)!r} holds a {array.dtype} array, not integers")
        if array.dtype.kind == "u":  # torch has no full unsigned support: check the range here
            if array.size and array.max() > _INT32.max:
                raise ValueError(f"indices in {str(path)!r} have values outside the int32 range")
            array = array.astype(np.int32)
        return torch.from_numpy(np.ascontiguousarray(array))
    if fmt == ".pt":
        obj = _reading(lambda: torch.load(path, map_location="cpu", weights_only=True))
        if isinstance(obj, dict):
            if KEY not in obj:
                raise ValueError(f"{str(path)!r} holds a dict without the key {KEY!r} (keys: {sorted(map(str, obj))})")
            obj = obj[KEY]
        if not isinstance(obj, torch.Tensor):
            raise TypeError(f"{str(path)!r} holds a {type(obj).__name__}, not a tensor")
        if obj.layout != torch.strided:
            raise ValueError(f"{str(path)!r} holds a {obj.layout} tensor; an index file holds a dense one")
        return obj
    from safetensors import safe_open

    def read():
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            return f.get_tensor(KEY) if KEY in names else names

    got = _reading(read)
    if not isinstance(got, torch.Tensor):
        raise ValueError(f"{str(path)!r} has no tensor named {KEY!r} (names: {sorted(got)})")
    return got


def load_indices(path) -> torch.Tensor:
    """Read an index tensor written by ``save_indices`` (or any tool using the same layout).

    Parameters
    ----------
    path : str or path ending in ``.npy``, ``.pt`` or ``.safetensors``.

    Returns
    -------
    indices : int32 ``[s_q, topk]`` on the cpu. Wider integer dtypes are converted when every value
        fits int32; anything else (floats, other shapes, a missing ``"indices"`` tensor) raises.

    Raises
    ------
    FileNotFoundError : no file at ``path``.
    ValueError / TypeError : naming ``path`` and the reason: an empty, corrupt or truncated file, a
        sparse tensor, values outside int32, a wrong shape (ValueError), or non-integer content (TypeError).
    """
    fmt = _format_of(path)
    if not Path(path).is_file():
        raise FileNotFoundError(f"no index file at {str(path)!r}")
    if Path(path).stat().st_size == 0:
        raise ValueError(f"{str(path)!r} is not a readable {fmt} file: it is empty")
    try:
        indices = _read(path, fmt)
    except _Unreadable as err:
        raise ValueError(f"{str(path)!r} is not a readable {fmt} index file (corrupt, truncated, or not plain "
                         f"numeric data): {err}") from None
    return _as_int32(indices, f"indices in {str(path)!r}")
