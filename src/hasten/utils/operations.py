"""Accelerate's ``accelerate.utils.operations`` module path: collectives and tensor-tree helpers.

A facade like ``hasten.utils``: names resolve lazily from :mod:`hasten.ops`, so importing this module
is cheap and never pulls a higher layer into the bottom one. ``DistributedOperationException`` is
hasten's :class:`~hasten.exceptions.DistributedOperationError` (the same class), raised by debug mode.

Example:
    >>> from hasten.utils.operations import DistributedOperationException, gather, pad_across_processes
"""

from __future__ import annotations

from hasten._lazy import lazy_getattr
from hasten.exceptions import DistributedOperationException as DistributedOperationException

_EXPORTS: dict[str, str] = {}
for _module, _names in {
    "hasten.ops.collectives": "broadcast broadcast_object_list gather gather_object pad_across_processes "
                              "pad_input_tensors reduce",
    "hasten.ops.tree": "concatenate convert_to_fp32 find_batch_size find_device get_data_structure honor_type "
                       "ignorant_find_batch_size is_namedtuple is_torch_tensor listify recursively_apply "
                       "send_to_device slice_tensors",
    "hasten.ops.compat": "CannotPadNestedTensorWarning ConvertOutputsToFp32 GatheredParameters TensorInformation "
                         "chained_operation convert_outputs_to_fp32 copy_tensor_to_devices gather_tensor_shape "
                         "get_shape initialize_tensors is_tensor_information is_torch_xpu_tensor verify_operation",
}.items():
    _EXPORTS.update(dict.fromkeys(_names.split(), _module))


__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted([*_EXPORTS, "DistributedOperationException"])  # noqa: PLE0605
