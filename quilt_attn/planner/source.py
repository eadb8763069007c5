"""What a plan was built for, so that a plan is never run on other indices.

A plan depends on the values of its ``indices`` (and ``topk_length``), which cannot be compared
without reading them (a kernel launch, or a host sync). ``PlanSource`` records their identity
instead: the memory (``data_ptr``, shape, strides, device) and torch's in-place version counter
(``Tensor._version``, bumped by every in-place write to the tensor or to any view of its storage).
A call passing other tensors, or these tensors written since planning, does not match. Host
metadata only: no host sync, no kernel launch.

Identity is not content: a copy of the indices (``.clone()``, ``.contiguous()`` of a strided
tensor, ``.to(device)``) does not match its plan even with equal values, while a fresh tensor that
reuses freed memory of the same shape could. Plan from the tensor the calls pass.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


def _version(t: torch.Tensor) -> int | None:
    """``t._version``, or None for an inference-mode tensor (it keeps no version counter)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _view(indices: torch.Tensor) -> torch.Tensor:
    """The ``[s_q, topk]`` view of already checked indices (FlashMLA's ``[s_q, 1, topk]`` squeezed)."""
    return indices[:, 0, :] if indices.dim() == 3 else indices


@dataclass(frozen=True)
class PlanSource:
    """Identity of the tensors a plan was built from (see the module docstring).

    Attributes
    ----------
    data_ptr, shape, stride, version, device : of the ``[s_q, topk]`` view of the indices
        (``version``: ``indices._version``; None for an inference tensor).
    s_kv : the ``s_kv`` given to the planner (None: not given; the plan then fits any kv).
    has_topk_length : whether ``topk_length`` was given.
    topk_length_ptr, topk_length_version : its ``data_ptr`` and ``_version`` (None without it).
    """

    data_ptr: int
    shape: tuple
    stride: tuple
    version: int | None
    device: torch.device
    s_kv: int | None
    has_topk_length: bool
    topk_length_ptr: int | None
    topk_length_version: int | None

    def mismatch(self, indices: torch.Tensor, s_kv: int, topk_length: torch.Tensor | None) -> str | None:
        """What differs between this source and a call's arguments, as an error message naming the
        argument (``indices``, ``kv``, ``topk_length``); None when the call matches.

        Parameters
        ----------
        indices : the call's checked int32 ``[s_q, topk]`` (or ``[s_q, 1, topk]``), as the caller passed it.
        s_kv : rows of the call's kv.
        topk_length : the call's ``topk_length`` as the caller passed it, or None.
        """
        v = _view(indices)
        if (v.device != self.device or v.data_ptr() != self.data_ptr or tuple(v.shape) != self.shape
                or tuple(v.stride()) != self.stride):
            return (f"indices are not the tensor the plan was built from (plan: shape {self.shape}, stride "
                    f"{self.stride}, data_ptr {self.data_ptr:#x} on {self.device}; got shape {tuple(v.shape)}, "
                    f"stride {tuple(v.stride())}, data_ptr {v.data_ptr():#x} on {v.device}): plan these indices")
        ver = _version(v)
        if self.version is not None and ver is not None and ver != self.version:
            return (f"indices were written in place after the plan was built (version {ver}, planned at "
                    f"{self.version}): plan them again")
        if self.s_kv is not None and s_kv != self.s_kv:
            return f"kv has s_kv = {s_kv} rows but the plan was built for s_kv = {self.s_kv}"
        if topk_length is None:
            if self.has_topk_length:
                return "topk_length: the plan was built with a topk_length but the call passes none"
            return None
        if not self.has_topk_length:
            return "topk_length: the call passes one but the plan was built without (plan with it)"
        if topk_length.data_ptr() != self.topk_length_ptr:
            return "topk_length is not the tensor the plan was built with: plan with this topk_length"
        ver = _version(topk_length)
        if self.topk_length_version is not None and ver is not None and ver != self.topk_length_version:
            return (f"topk_length was written in place after the plan was built (version {ver}, planned at "
                    f"{self.topk_length_version}): plan again")
        return None


def plan_source(indices: torch.Tensor, s_kv: int | None, topk_length: torch.Tensor | None) -> PlanSource:
    """The ``PlanSource`` of a plan built from these (already checked) arguments, as the caller passed them.

    Parameters
    ----------
    indices : int32 ``[s_q, topk]`` or ``[s_q, 1, topk]``, the caller's tensor (before any copy).
    s_kv : the planner's ``s_kv`` (or None).
    topk_length : the caller's ``topk_length [s_q]`` (before any cast), or None.
    """
    v = _view(indices)
    return PlanSource(data_ptr=v.data_ptr(), shape=tuple(v.shape), stride=tuple(v.stride()), version=_version(v),
                      device=v.device, s_kv=s_kv, has_topk_length=topk_length is not None,
                      topk_length_ptr=None if topk_length is None else topk_length.data_ptr(),
                      topk_length_version=None if topk_length is None else _version(topk_length))
