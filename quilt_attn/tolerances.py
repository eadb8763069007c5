"""How far a result may be from the reference (``reference.sparse_prefill_reference``), stated once.

``CALL_REL_L2``: a call's ``out`` against the float32 reference, relative L2, by q's dtype: the demo's, the
benchmarks' and the sanitizers' check. ``TOLERANCES``: the tests' elementwise tables, by out's dtype.
``FP8_MODE_TOL`` / ``FP8_MODE_VS_EXACT_REL_L2``: the FP8 tensor-core mode against its emulation and against
the exact path. ``SHAPE_ROUNDING``: one computation run through matrix products of other shapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

CALL_REL_L2 = {"fp16": 2e-3, "bf16": 1e-2}


@dataclass(frozen=True)
class Tol:
    atol: float  # elementwise |out - ref| <= atol + rtol * |ref|
    rtol: float
    rel_l2: float  # ||out - ref||_2 / ||ref||_2 over the whole output
    stat_atol: float  # |max_logits - ref|, |lse - ref| (natural-log units), finite entries


_U = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}  # unit roundoff
TOLERANCES: dict[torch.dtype, Tol] = {
    dt: Tol(atol=4 * u, rtol=2 * u, rel_l2=2.5 * u, stat_atol=1.4e-3) for dt, u in _U.items()
}
# float64 outputs (the float64 reference against another float64 computation): summation order only;
# its float32 max_logits / lse carry one float32 rounding (|lse| <~ 50 here: <= 3e-6).
TOLERANCES[torch.float64] = Tol(atol=1e-10, rtol=1e-10, rel_l2=1e-10, stat_atol=1e-5)
# The FP8 tensor-core mode's kernel against its emulation (fp8_mode.sparse_prefill_fp8_kernel_reference): the
# tensor cores' FP8 adder keeps ~14 bits of S and O where the emulation sums exactly, and a logit that moves by
# that flips an occasional e4m3 rounding of P (measured on the H200: rel-L2 4.5-5.8e-3, lse 2-6e-4, max_logits
# <= 7e-3); whole-tensor bounds only (a flipped weight is a one-step e4m3 difference of one element).
FP8_MODE_TOL = Tol(atol=float("inf"), rtol=float("inf"), rel_l2=1.5e-2, stat_atol=2e-2)
# ... and the mode against the exact path on N(0, 1) data: its accuracy (e4m3 q and P: ~3.2e-2, BENCHMARKS.md)
FP8_MODE_VS_EXACT_REL_L2 = 4.5e-2
# The same plan run with another head count (a tensor-parallel shard): its programs' matrix products have other
# shapes, and a float32 product's rounding may follow its shape (the CPU interpreter's tl.dot is NumPy's BLAS,
# whose kernels do on some machines: 3 ulps of max_logits seen). For the float32 statistics; out, rounded to
# its dtype, may then differ by one unit in its last place (seen: one fp16 subnormal step of 512 values).
SHAPE_ROUNDING = Tol(atol=2.0**-20, rtol=2.0**-20, rel_l2=2.0**-20, stat_atol=2.0**-20)
