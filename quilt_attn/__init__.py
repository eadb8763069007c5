"""quilt-attn: shared-query execution (QUILT) for top-K sparse-attention prefill."""
from .api import sparse_prefill
from .dispatch import PlanSettings
from .kv_cache import dequantize_fp8, quantize_fp8
from .pipeline import plan_ahead
from .planner import Plan, plan
from .reference import sparse_prefill_reference

__version__ = "0.1.0"
__all__ = ["sparse_prefill", "sparse_prefill_reference", "PlanSettings", "plan", "plan_ahead", "Plan",
           "quantize_fp8", "dequantize_fp8"]
