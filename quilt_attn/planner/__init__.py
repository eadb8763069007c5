"""QUILT planner: member masks (SCSD or bitmap), cascaded sharing, clipping, tile work list."""
from .membership import cascade_levels, member_masks
from .plan import Plan, plan

__all__ = ["Plan", "plan", "member_masks", "cascade_levels"]
