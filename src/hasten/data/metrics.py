"""``gather_for_metrics``: gather evaluation results and drop the samples added to even out the last batch.

``Accelerator.gather_for_metrics`` delegates here.
"""

from __future__ import annotations

import logging
from typing import Any

from hasten.logging import get_logger
from hasten.ops import gather, gather_object, recursively_apply
from hasten.state import GradientState

logger = get_logger(__name__)


def _all_tensors(data: Any) -> bool:
    try:
        recursively_apply(lambda t: t, data, error_on_other_type=True)
    except TypeError:
        return False
    return True


def gather_for_metrics(input_data: Any, use_gather_object: bool = False, sources: list[int] | None = None) -> Any:
    """Gather ``input_data`` from every process; on the last batch, keep only the real samples.

    Tensors (nested in lists/tuples/dicts) are gathered with ``gather``; anything else, or everything
    when ``use_gather_object``, with ``gather_object``. While the active prepared loader is on its last
    batch, the result is cut to its first ``remainder`` rows (``remainder`` = real samples in the last
    global batch), which removes exactly the duplicates that evened out the end, because padding always
    comes last and gathering concatenates in process order. Every process must call it, once per batch,
    inside the loop over a prepared loader.

    Args:
        input_data: a tensor, a nested structure of tensors, or picklable objects (one item per sample).
        use_gather_object: gather as Python objects.
        sources: the ranks whose results to keep, in order (one per data-parallel rank of an N-D run,
            whose tensor/context-parallel groups hold the same batch), so every sample still appears
            once; None keeps every process's.

    Example:
        >>> for batch in eval_loader:
        ...     preds = model(batch["x"]).argmax(-1)
        ...     preds, labels = gather_for_metrics((preds, batch["y"]))

    Returns:
        The gathered data; over a whole pass, every sample of the dataset exactly once.
    """
    as_objects = use_gather_object or not _all_tensors(input_data)
    if sources is not None:
        data = _gather_from(input_data, sources, as_objects)
    else:
        data = gather_object(input_data) if as_objects else gather(input_data)
    state = GradientState()
    if not state.end_of_dataloader:
        return data
    remainder = state.remainder
    if remainder == -1:
        if logger.isEnabledFor(logging.INFO):
            logger.info("The dataset has no length (or drop_last is set): returning everything gathered. Drop the "
                        "padding of the last batch yourself if there is any.")
        return data
    if remainder == 0:
        return data
    try:
        if as_objects:
            return data[:remainder]
        return recursively_apply(lambda t: t[:remainder], data)
    except (TypeError, IndexError):  # objects that cannot be sliced: nothing sensible to drop
        return data


def _gather_from(input_data: Any, sources: list[int], as_objects: bool) -> Any:
    """Gather from every process through ``ops`` (watched and debug-checked), keep what ``sources`` sent."""
    if as_objects:
        parts = gather_object([input_data])  # one item per rank: the rank's own object
        out: list[Any] = []
        for part in (parts[rank] for rank in sources):
            out.extend(part if isinstance(part, (list, tuple)) else [part])
        return out
    import torch
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1  # gather stacks each rank's rows in rank order
    return recursively_apply(lambda gathered: torch.cat([gathered.chunk(world, dim=0)[r] for r in sources], dim=0),
                             gather(input_data))
