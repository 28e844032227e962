"""Human-readable sizes ("10GB", "500MiB", "8Gb") to bytes."""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
          "KI": 2**10, "MI": 2**20, "GI": 2**30, "TI": 2**40}


def convert_file_size_to_int(size: int | str) -> int:
    """Bytes in ``size``: an int, or a string such as ``"5GB"`` (10**9), ``"5GiB"`` (2**30), ``"5Gb"`` (bits).

    Example:
        >>> convert_file_size_to_int("5GB")
        5000000000

    Raises:
        ValueError: a string that is not a size.
    """
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?)?([Bb])?\s*", str(size), flags=re.IGNORECASE)
    if not match:
        raise ValueError(f"`size` {size!r} is not in a valid format: use an integer or strings like '5GB', "
                         "'500MiB' or '8Gb' (bits).")
    number, unit, byte = match.groups()
    multiplier = _UNITS[(unit or "").upper()]
    value = float(number) * multiplier
    if byte == "b":  # lower-case b: bits
        value /= 8
    return int(value)
