"""The largest batch size whose planned peak fits a budget, found with few plans.

Each probe is a whole plan (a fake step), so the search guesses first: memory grows about linearly with
the batch size (activations and temporaries scale with it, parameters and optimizer state do not), so two
plans give a line whose crossing with the budget is the guess; plans at the guess and one above confirm
the boundary, and a bisection between sizes known to fit and not to fit settles any disagreement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The largest batch size the search tries (per process).
MAX_BATCH_SIZE = 1 << 16


def largest_batch_size(peak_at: Callable[[int], int], budget_bytes: int, start: int = 1,
                       cap: int = MAX_BATCH_SIZE) -> int:
    """The largest batch size ``b <= cap`` with ``peak_at(b) <= budget_bytes`` (0 when not even 1 fits).

    ``peak_at`` must not decrease with the batch size. When memory grows linearly with the batch size,
    four plans: ``start``, its double or half, the linear guess and the size above it; a strongly curved
    growth falls back to bisection (about twice log2 of the answer).

    Example:
        >>> largest_batch_size(lambda b: 100 + 10 * b, budget_bytes=200, start=4)
        10
    """
    peaks: dict[int, int] = {}

    def fits(size: int) -> bool:
        if size not in peaks:
            peaks[size] = peak_at(size)
        return peaks[size] <= budget_bytes

    start = max(1, min(start, cap))
    other = min(start * 2, cap) if fits(start) else max(1, start // 2)
    fits(other)
    for _ in range(_GUESSES):
        low, high = _bracket(peaks, budget_bytes, cap)
        if high <= low + 1:
            break
        guess = _linear_guess(peaks, budget_bytes, low, high)
        if guess is None:
            break
        fits(guess)
        if guess + 1 < high:
            fits(guess + 1)
    low, high = _bracket(peaks, budget_bytes, cap)
    while high > low + 1:  # bisection (a doubling first when nothing is known not to fit)
        probe = min(max(low, 1) * 2, cap) if high > cap else (low + high) // 2
        if probe <= low:
            break
        fits(probe)
        low, high = _bracket(peaks, budget_bytes, cap)
    return low


#: Rounds of linear guesses before bisection (each costs up to two plans).
_GUESSES = 3


def _linear_guess(peaks: dict[int, int], budget_bytes: int, low: int, high: int) -> int | None:
    """Where the line through the two known sizes nearest the boundary meets the budget, strictly
    between ``low`` (fits) and ``high`` (does not); None when the known sizes give no slope."""
    if low in peaks and high in peaks:  # the bracket itself (regula falsi)
        a, b = low, high
    else:
        nearest = sorted(peaks, key=lambda size: abs(peaks[size] - budget_bytes))[:2]
        a, b = sorted(nearest) if len(nearest) == 2 else (0, 0)
    if b <= a or peaks[b] <= peaks[a]:
        return None
    guess = a + (budget_bytes - peaks[a]) * (b - a) // (peaks[b] - peaks[a])
    guess = max(low + 1, min(guess, high - 1))
    return guess if low < guess < high and guess not in peaks else None


def _bracket(peaks: dict[int, int], budget_bytes: int, cap: int) -> tuple[int, int]:
    """(largest size known to fit or 0, smallest size known not to fit or ``cap + 1``)."""
    low = max((size for size, peak in peaks.items() if peak <= budget_bytes), default=0)
    high = min((size for size, peak in peaks.items() if peak > budget_bytes), default=cap + 1)
    return low, high


def plan_largest_batch_size(model: Any, budget_bytes: int, *, batch_size: int = 1, **plan_kwargs: Any) -> int:
    """The largest ``batch_size`` per process whose planned step fits ``budget_bytes`` (0: not even 1).

    ``plan_kwargs`` are :func:`hasten.memory_plan.plan_memory`'s (``seq_len`` or ``input_shape``, layout,
    optimizer, ...); ``batch_size`` is where the search starts. A start for ``find_executable_batch_size``
    that needs no out-of-memory error to find:

    Example:
        >>> start = plan_largest_batch_size("llama-config", 80 * 2**30, batch_size=8, seq_len=2048,
        ...                                 num_processes=8, layout="dp_shard=8", mixed_precision="bf16")
        >>> @find_executable_batch_size(starting_batch_size=max(start, 1))
        ... def train(batch_size): ...
    """
    from hasten.memory_plan.planner import plan_memory

    def peak_at(size: int) -> int:
        return plan_memory(model, batch_size=size, **plan_kwargs).peak_bytes

    return largest_batch_size(peak_at, budget_bytes, start=batch_size)



class BatchSizePlan:
    """``find_executable_batch_size``'s ``plan=``: called with the starting batch size, it returns the largest
    batch size per process, at most that, whose planned step fits ``budget``.

    Args:
        model: what :func:`hasten.memory_plan.plan_memory` takes (a config folder, a class path, a factory).
        budget: memory per process: bytes, or a size such as ``"80GiB"``.
        plan_kwargs: any other ``plan_memory`` keyword (``seq_len``, ``num_processes``, ``layout``, ...).

    The plan needs a process group of its own: inside a run that already has one, it runs in a fresh
    interpreter (``multiprocessing``'s spawn; ``model`` must then be a path, a class path or a picklable
    factory).

    Raises:
        PlanError: a budget that is not a size (here), or a plan that cannot be made (when called).

    Example:
        >>> @find_executable_batch_size(starting_batch_size=64, plan=BatchSizePlan(
        ...     "llama-config", "80GiB", seq_len=2048, num_processes=8, layout="dp_shard=8"))
        ... def train(batch_size): ...
    """

    def __init__(self, model: Any, budget: int | str, **plan_kwargs: Any) -> None:
        from hasten.memory_plan.inputs import PlanError
        from hasten.memory_plan.result import parse_bytes

        try:
            self.budget_bytes = budget if isinstance(budget, int) else parse_bytes(str(budget))
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        self.model = model
        self.plan_kwargs = plan_kwargs

    def __call__(self, cap: int) -> int:
        """The largest batch size ``<= cap`` whose planned step fits (0: not even one)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            found = plan_largest_batch_size(self.model, self.budget_bytes, batch_size=cap, **self.plan_kwargs)
        else:
            import multiprocessing

            with multiprocessing.get_context("spawn").Pool(1) as pool:
                found = pool.apply(plan_largest_batch_size, (self.model, self.budget_bytes),
                                   {"batch_size": cap, **self.plan_kwargs})
        return min(cap, int(found))
