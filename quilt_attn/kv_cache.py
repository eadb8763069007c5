"""KV-cache formats.

Two layouts of the MLA latent cache (one row a token, shared by all heads):

* dense: ``kv [s_kv, d_qk]`` in bf16 / fp16 (d_qk = 576 = 512 latent + 64 rope);
* FP8 (DeepSeek-V3.2 layout): ``uint8 [s_kv, 656]`` a token =
  512 ``float8_e4m3fn`` latent values | 4 float32 scales (one per 128 values) | 64 bf16 rope values.

Scales are powers of two (``2**ceil(log2(amax / 448))``), so dequantization is an exact
multiply and the only error is the e4m3 rounding of the latent values (relative error
<= 2**-4 per element, see ``FP8_REL_ERR``).

Non-finite values: a group's scale is taken from its finite values only, so an inf or NaN changes
no other element of its group. NaN stays NaN (e4m3fn has a NaN); e4m3fn has no infinity, so
``+-inf`` saturates to ``+-448 * scale``, the largest magnitude the group can hold (as torch's own
cast to ``float8_e4m3fn`` saturates). A group with no finite nonzero value gets scale 1.
"""
from __future__ import annotations

import torch

from ._checks import require_dtype, require_ndim, require_tensor

D_NOPE = 512
D_ROPE = 64
D_QK = D_NOPE + D_ROPE
FP8_GROUP = 128
FP8_NUM_SCALES = D_NOPE // FP8_GROUP  # 4
FP8_BYTES = D_NOPE + 4 * FP8_NUM_SCALES + 2 * D_ROPE  # 656
FP8_E4M3_MAX = 448.0
# e4m3 keeps 3 mantissa bits: round-to-nearest error <= 2**-4 of the value (normal range).
FP8_REL_ERR = 2.0**-4


def is_fp8_cache(kv: torch.Tensor) -> bool:
    """True when ``kv`` holds 656-byte FP8 rows (uint8, last dimension 656), whatever its rank:
    ``canonical_fp8_cache`` then checks the layout."""
    return kv.dtype == torch.uint8 and kv.dim() >= 1 and kv.shape[-1] == FP8_BYTES


def canonical_fp8_cache(kv: torch.Tensor, name: str = "kv") -> torch.Tensor:
    """The FP8 cache as ``uint8 [s_kv, 656]`` (``[s_kv, 1, 656]`` squeezed); ``ValueError`` naming
    ``name`` for any other layout (a 1-D ``[656]`` would otherwise read as 656 rows of one byte)."""
    require_tensor(name, kv)
    if kv.dim() == 3 and kv.shape[1] == 1:
        kv = kv[:, 0]
    if not is_fp8_cache(kv) or kv.dim() != 2:
        raise ValueError(f"{name} must be uint8 [s_kv, {FP8_BYTES}] (or [s_kv, 1, {FP8_BYTES}]) to be the FP8 cache, "
                         f"got {str(kv.dtype).replace('torch.', '')} {tuple(kv.shape)}")
    return kv


def quantize_fp8(kv: torch.Tensor) -> torch.Tensor:
    """Quantize a dense cache to the DeepSeek-V3.2 FP8 layout.

    Parameters
    ----------
    kv : Tensor ``[s_kv, 576]`` (or ``[s_kv, 1, 576]``), bf16 / fp16 / fp32.

    Returns
    -------
    Tensor ``uint8 [s_kv, 656]``. Non-finite values: see the module docstring (NaN kept, +-inf
    saturated to the group's largest magnitude, the rest of the group unaffected).
    """
    require_tensor("kv", kv)
    if kv.dim() == 3 and kv.shape[1] == 1:
        kv = kv[:, 0]
    require_ndim("kv", kv, (2,), "[s_kv, 576]")
    require_dtype("kv", kv, (torch.bfloat16, torch.float16, torch.float32))
    if kv.shape[1] != D_QK:
        raise ValueError(f"kv must have d_qk = {D_QK} for the FP8 cache, got {kv.shape[1]}")
    s_kv = kv.shape[0]
    out = torch.empty(s_kv, FP8_BYTES, dtype=torch.uint8, device=kv.device)
    if s_kv == 0:  # (an empty view keeps its strides through .contiguous(), which .view(uint8) refuses)
        return out
    nope = kv[:, :D_NOPE].float().reshape(s_kv, FP8_NUM_SCALES, FP8_GROUP)
    # the scale comes from the finite values only, so one inf / NaN spoils no other element of its
    # group; a group without a finite nonzero value gets scale 1
    amax = torch.where(torch.isfinite(nope), nope.abs(), 0.0).amax(dim=-1)
    amax = torch.where(amax > 0, amax, FP8_E4M3_MAX)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_E4M3_MAX)))  # [s_kv, 4], power of two
    q = (nope / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    out[:, :D_NOPE] = q.view(s_kv, D_NOPE).view(torch.uint8)
    out[:, D_NOPE : D_NOPE + 16] = scale.to(torch.float32).contiguous().view(torch.uint8)
    out[:, D_NOPE + 16 :] = kv[:, D_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    return out


def split_fp8_rows(rows: torch.Tensor):
    """The fields of FP8 cache rows ``uint8 [..., 656]``: the e4m3 latent values as float32 ``[..., 4, 128]``
    (exact), their scales float32 ``[..., 4]`` (one per 128 columns) and the rope part bf16 ``[..., 64]``."""
    rows = rows.contiguous()
    lat = rows[..., :D_NOPE].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[..., D_NOPE : D_NOPE + 4 * FP8_NUM_SCALES].contiguous().view(torch.float32)
    rope = rows[..., D_NOPE + 4 * FP8_NUM_SCALES :].contiguous().view(torch.bfloat16)
    return lat.reshape(*lat.shape[:-1], FP8_NUM_SCALES, FP8_GROUP), scale, rope


def dequantize_fp8(cache: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Expand the FP8 cache back to a dense ``[s_kv, 576]`` tensor of ``dtype``."""
    cache = canonical_fp8_cache(cache, "cache")
    s_kv = cache.shape[0]
    q, scale, rope = split_fp8_rows(cache)
    out = torch.empty(s_kv, D_QK, dtype=dtype, device=cache.device)
    out[:, :D_NOPE] = (q * scale[..., None]).view(s_kv, D_NOPE).to(dtype)
    out[:, D_NOPE:] = rope.to(dtype)
    return out
