"""The typed result of a memory plan: bytes per process, by category, with the largest modules."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

#: The categories of a plan, in the order a table prints them.
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "communication")

# torch's trackers name their categories by enum value (``_MemRefType`` / ``_FSDPRefType``); these are the values.
_TRACKER_CATEGORY = {
    "Parameter": "parameters", "Buffer": "parameters", "Sharded Param": "parameters",
    "Unsharded Param": "parameters", "Gradient": "gradients", "Sharded Grad": "gradients",
    "Unsharded Grad": "gradients", "Optstate": "optimizer_state", "OptState": "optimizer_state",
    "Activation": "activations", "Inputs": "activations", "Temp": "temporaries", "Other": "temporaries",
    "All Gather": "communication", "Reduce Scatter": "communication",
}


def categorize(snapshot: Mapping[Any, int]) -> dict[str, int]:
    """One device's tracker snapshot (``{ref type: bytes, "Total": bytes}``) summed into :data:`CATEGORIES`."""
    sums = dict.fromkeys(CATEGORIES, 0)
    for key, nbytes in snapshot.items():
        name = str(getattr(key, "value", key))
        if name != "Total":
            sums[_TRACKER_CATEGORY.get(name, "temporaries")] += int(nbytes)
    return sums


@dataclass(frozen=True)
class ModuleMemory:
    """One module's share of a process's memory: its (local) parameters and the output its forward keeps."""

    name: str
    parameter_bytes: int
    output_bytes: int


@dataclass(frozen=True)
class ProcessPlan:
    """The planned peak of one process and what is alive at that peak, by category.

    Example:
        >>> plan.per_process[0].peak_bytes, plan.per_process[0].optimizer_state
    """

    rank: int
    peak_bytes: int
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    temporaries: int
    communication: int
    largest_modules: tuple[ModuleMemory, ...] = ()

    def categories(self) -> dict[str, int]:
        """Bytes by category at the peak (they add up to ``peak_bytes``)."""
        return {name: getattr(self, name) for name in CATEGORIES}


@dataclass(frozen=True)
class MemoryPlan:
    """A memory plan of one training step (two optimizer steps, so optimizer state exists) per process.

    Example:
        >>> plan = hasten.plan_memory(factory, batch=torch.empty(8, 128), num_processes=4, layout="dp_shard=4")
        >>> plan.peak_bytes <= 80 * 2**30
    """

    model: str
    layout: str
    num_processes: int
    optimizer: str
    mixed_precision: str
    batch: dict[str, list[int]]
    per_process: list[ProcessPlan] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        """The largest peak of any process."""
        return max(p.peak_bytes for p in self.per_process)

    def fits(self, budget_bytes: int) -> bool:
        """True when every process's peak is within ``budget_bytes``."""
        return self.peak_bytes <= budget_bytes

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON-ready data (what ``hasten estimate-memory --json`` prints)."""
        data = asdict(self)
        data["peak_bytes"] = self.peak_bytes
        return data


def format_bytes(nbytes: float) -> str:
    """``1536`` -> ``'1.50 KiB'``: binary units, two decimals."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} B" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def parse_bytes(text: str) -> int:
    """``'80GiB'``, ``'80GB'``, ``'512MiB'`` or a plain number of bytes -> bytes.

    Raises:
        ValueError: text that is not a size.
    """
    units = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
             "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
    stripped = text.strip().lower().replace(" ", "")
    number = stripped.rstrip("kmgtib")
    unit = stripped[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value < 0:
        raise ValueError(f"budget {text!r} is not a size: write it like 80GiB, 80GB or 512MiB.")
    return int(value * units[unit])


def format_plan(plan: MemoryPlan) -> str:
    """A text table of the plan: one row per category, one column per distinct process plan."""
    first = plan.per_process[0]
    same = all(p.categories() == first.categories() for p in plan.per_process)
    shown = [first] if same else plan.per_process
    heads = ["every process" if same and plan.num_processes > 1 else f"rank {p.rank}" for p in shown]
    rows = [(name.replace("_", " "), [format_bytes(getattr(p, name)) for p in shown]) for name in CATEGORIES]
    rows.append(("peak", [format_bytes(p.peak_bytes) for p in shown]))
    width = max(len(name) for name, _ in rows)
    cols = [max(len(h), *(len(values[i]) for _, values in rows)) for i, h in enumerate(heads)]
    lines = [f"Memory plan of one training step: {plan.model}",
             f"  layout {plan.layout} on {plan.num_processes} process(es), optimizer {plan.optimizer}, "
             f"mixed precision {plan.mixed_precision}, batch per process "
             + ", ".join(f"{k}{tuple(v)}" for k, v in plan.batch.items()),
             "  " + " " * width + "  " + "  ".join(h.rjust(c) for h, c in zip(heads, cols))]
    for name, values in rows:
        lines.append("  " + name.ljust(width) + "  " + "  ".join(v.rjust(c) for v, c in zip(values, cols)))
    if first.largest_modules:
        lines.append("  largest modules (parameters held here + the output each forward keeps):")
        lines.extend(f"    {m.name}: {format_bytes(m.parameter_bytes)} + {format_bytes(m.output_bytes)}"
                     for m in first.largest_modules)
    return "\n".join(lines)
