"""Memory plans: how much memory one training step needs per process, for a layout, without allocating it.

Example:
    >>> from hasten.memory_plan import plan_memory
    >>> plan = plan_memory("configs/llama", batch_size=8, seq_len=128, num_processes=8, layout="dp_shard=8")
"""

from hasten.memory_plan.inputs import Layout, PlanError, parse_layout
from hasten.memory_plan.planner import plan_memory
from hasten.memory_plan.result import (
    CATEGORIES,
    MemoryPlan,
    ModuleMemory,
    ProcessPlan,
    format_bytes,
    format_plan,
    parse_bytes,
)
from hasten.memory_plan.search import BatchSizePlan, largest_batch_size, plan_largest_batch_size

__all__ = ["BatchSizePlan", "CATEGORIES", "Layout", "MemoryPlan", "ModuleMemory", "PlanError", "ProcessPlan", "format_bytes",
           "format_plan", "largest_batch_size", "parse_bytes", "parse_layout", "plan_largest_batch_size",
           "plan_memory"]
