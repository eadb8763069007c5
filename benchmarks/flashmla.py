"""FlashMLA's sm90 sparse prefill as a baseline, loaded through ctypes from a library the user builds.

The library is ``benchmarks/flashmla_shim.cu`` (a C entry point filling FlashMLA's current
``SparseAttnFwdParams``) compiled together with a FlashMLA source tree and CUTLASS headers the user provides.
Nothing of FlashMLA is part of this repository.

A build that works (nvcc 13.0, no GPU needed; FlashMLA's sm90 sparse prefill and the CUTLASS commit its
submodule pins, headers only; about 30 s)::

    nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++20 -DNDEBUG -DFLASH_MLA_DISABLE_FP16 \
        --expt-relaxed-constexpr --expt-extended-lambda --use_fast_math -shared -Xcompiler -fPIC \
        -I FLASHMLA/csrc -I FLASHMLA/csrc/kerutils/include -I FLASHMLA/csrc/sm90 \
        -I CUTLASS/include -I CUTLASS/tools/util/include benchmarks/flashmla_shim.cu \
        FLASHMLA/csrc/sm90/prefill/sparse/instantiations/phase1_k576.cu \
        FLASHMLA/csrc/sm90/prefill/sparse/instantiations/phase1_k576_topklen.cu -o flashmla_sm90.so

FlashMLA runs 64 or 128 heads: below 64 an engine pads the query to 64 heads, and so do these benchmarks
(the padding heads are random, not zeros, so they cost what real heads cost). Its ``lse`` and
``max_logits`` are natural-log (``logsumexp(q.k * sm_scale)``), as this package's public results.
"""
from __future__ import annotations

import ctypes

import torch

D_QK, D_V = 576, 512


class FlashMLA:
    """``FlashMLA(path)``: the loaded library; ``call(q, kv, indices, ...)`` builds a launcher."""

    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        fn = self.lib.flashmla_sparse_prefill
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p] * 8 + [ctypes.c_int] * 4 + [ctypes.c_longlong] * 4
                       + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p])
        self.num_sm = torch.cuda.get_device_properties(0).multi_processor_count

    def outputs(self, s_q: int, h: int, dtype, device):
        """NaN-poisoned ``out [s_q, h, 512]`` and ``max_logits, lse [s_q, h]``."""
        out = torch.full((s_q, h, D_V), float("nan"), dtype=dtype, device=device)
        ml = torch.full((s_q, h), float("nan"), dtype=torch.float32, device=device)
        return out, ml, torch.full_like(ml, float("nan"))

    def launch(self, q, kv, indices, out, max_logits, lse, *, sm_scale=D_QK ** -0.5, attn_sink=None,
               topk_length=None) -> None:
        """One launch on torch's current stream. ``q [s_q, 64 or 128, 576]`` bf16, ``kv [s_kv, 576]`` bf16,
        ``indices [s_q, topk]`` int32 (topk a multiple of 128)."""
        s_q, h, d_qk = q.shape
        if h not in (64, 128) or d_qk != D_QK or q.dtype != torch.bfloat16 or kv.dtype != torch.bfloat16:
            raise ValueError(f"FlashMLA runs bf16 q of 64 or 128 heads and d_qk {D_QK}; got {tuple(q.shape)} {q.dtype}")
        if q.stride(2) != 1 or kv.stride(-1) != 1 or indices.stride(-1) != 1:
            raise ValueError("FlashMLA needs unit last strides")
        ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
        err = self.lib.flashmla_sparse_prefill(
            q.data_ptr(), kv.data_ptr(), indices.data_ptr(), out.data_ptr(), max_logits.data_ptr(), lse.data_ptr(),
            ptr(attn_sink), ptr(topk_length), s_q, kv.shape[0], h, indices.shape[-1], q.stride(0), q.stride(1),
            kv.stride(0), indices.stride(0), float(sm_scale), self.num_sm, torch.cuda.current_stream().cuda_stream)
        if err:
            raise RuntimeError(f"flashmla_sparse_prefill: CUDA error {err}")
