"""Accelerate's ``accelerate.utils.operations`` module path: collectives and tensor-tree helpers.

A facade like ``hasten.utils``: names resolve lazily from :mod:`hasten.ops`, so importing this module
is cheap and never pulls a higher layer into the bottom one. ``DistributedOperationException`` is
hasten's :class:`~hasten.exceptions.DistributedOperationError` (the same class), raised by debug mode.

Example:
    >>> from hasten.utils.operations import DistributedOperationException, gather, pad_across_processes
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hasten._lazy import lazy_getattr
from hasten.exceptions import DistributedOperationException as DistributedOperationException

_EXPORTS: dict[str, str] = {}
for _module, _names in {
    "hasten.ops.collectives": "CannotPadNestedTensorWarning broadcast broadcast_object_list gather gather_object "
                              "pad_across_processes "
                              "pad_input_tensors reduce",
    "hasten.ops.tree": "concatenate convert_to_fp32 find_batch_size find_device get_data_structure honor_type "
                       "ignorant_find_batch_size is_namedtuple is_torch_tensor listify recursively_apply "
                       "send_to_device slice_tensors",
    "hasten.ops.compat": "TENSOR_INT_TO_DTYPE TENSOR_TYPE_TO_INT ConvertOutputsToFp32 GatheredParameters TensorInformation "
                         "chained_operation convert_outputs_to_fp32 copy_tensor_to_devices gather_tensor_shape "
                         "get_shape initialize_tensors is_tensor_information is_torch_xpu_tensor verify_operation",
}.items():
    _EXPORTS.update(dict.fromkeys(_names.split(), _module))

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time the names resolve on first use
    from hasten.ops.collectives import (
        CannotPadNestedTensorWarning as CannotPadNestedTensorWarning,
        broadcast as broadcast,
        broadcast_object_list as broadcast_object_list,
        gather as gather,
        gather_object as gather_object,
        pad_across_processes as pad_across_processes,
        pad_input_tensors as pad_input_tensors,
        reduce as reduce,
    )
    from hasten.ops.compat import (
        TENSOR_INT_TO_DTYPE as TENSOR_INT_TO_DTYPE,
        TENSOR_TYPE_TO_INT as TENSOR_TYPE_TO_INT,
        ConvertOutputsToFp32 as ConvertOutputsToFp32,
        GatheredParameters as GatheredParameters,
        TensorInformation as TensorInformation,
        chained_operation as chained_operation,
        convert_outputs_to_fp32 as convert_outputs_to_fp32,
        copy_tensor_to_devices as copy_tensor_to_devices,
        gather_tensor_shape as gather_tensor_shape,
        get_shape as get_shape,
        initialize_tensors as initialize_tensors,
        is_tensor_information as is_tensor_information,
        is_torch_xpu_tensor as is_torch_xpu_tensor,
        verify_operation as verify_operation,
    )
    from hasten.ops.tree import (
        concatenate as concatenate,
        convert_to_fp32 as convert_to_fp32,
        find_batch_size as find_batch_size,
        find_device as find_device,
        get_data_structure as get_data_structure,
        honor_type as honor_type,
        ignorant_find_batch_size as ignorant_find_batch_size,
        is_namedtuple as is_namedtuple,
        is_torch_tensor as is_torch_tensor,
        listify as listify,
        recursively_apply as recursively_apply,
        send_to_device as send_to_device,
        slice_tensors as slice_tensors,
    )

__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_EXPORTS))


__all__ = sorted([*_EXPORTS, "DistributedOperationException"])  # noqa: PLE0605
