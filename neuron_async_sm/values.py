"""Type checks for user-supplied values, written once: in JSON and in Python alike a bool is not a number."""

from __future__ import annotations


def is_int(value: object) -> bool:
    """An int, not a bool (`True` would otherwise pass as 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An int or a float, not a bool (NaN and infinities pass: range checks are the caller's)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
