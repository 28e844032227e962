"""Stateless tensor-tree helpers and collectives (torch.distributed only; no hasten state).

What the collectives report to (the hang watchdog's tracker, debug mode's checks) is process-group
state and lives in :mod:`hasten.runtime` with the group's lifetime; ``tests/test_house_rules.py``
keeps module-level mutable state and threads out of this package.
"""

from hasten.ops.collectives import (
    barrier,
    broadcast,
    broadcast_object_list,
    gather,
    gather_object,
    is_distributed,
    pad_across_processes,
    pad_input_tensors,
    reduce,
)
from hasten.ops.random import set_seed, synchronize_rng_state, synchronize_rng_states
from hasten.ops.tree import (
    concatenate,
    convert_to_fp32,
    find_batch_size,
    find_device,
    get_data_structure,
    honor_type,
    ignorant_find_batch_size,
    is_namedtuple,
    is_torch_tensor,
    listify,
    recursively_apply,
    send_to_device,
    slice_tensors,
)
from hasten.runtime.debug_checks import debug_checks_enabled, verify_operation

__all__ = [
    "barrier", "debug_checks_enabled", "broadcast", "broadcast_object_list", "concatenate", "convert_to_fp32",
    "find_batch_size", "find_device", "gather", "gather_object", "get_data_structure", "honor_type",
    "ignorant_find_batch_size", "is_distributed", "is_namedtuple", "is_torch_tensor", "listify",
    "pad_across_processes", "pad_input_tensors", "recursively_apply", "reduce", "send_to_device", "set_seed",
    "slice_tensors", "synchronize_rng_state", "synchronize_rng_states", "verify_operation",
]
