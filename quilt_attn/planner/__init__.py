"""QUILT planner: member masks (SCSD or bitmap), cascaded sharing, clipping, tile work list."""
from .membership import cascade_levels, member_masks
from .buffers import PACK_ROW_MASK, PACK_SHIFT, packs_columns, plan_workspace_bytes
from .plan import Plan, plan

__all__ = ["Plan", "plan", "plan_workspace_bytes", "packs_columns", "PACK_SHIFT", "PACK_ROW_MASK", "member_masks",
           "cascade_levels"]
