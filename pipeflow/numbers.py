"""Number checks every layer shares (torch-free, importing nothing of pipeflow)."""

from __future__ import annotations

from typing import Any


def is_whole(value: Any) -> bool:
    """An int that is not a bool (YAML's ``true`` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def whole(key: str, value: Any, low: int = 1) -> int:
    """``value`` if it is a whole number >= ``low``; else ValueError naming ``key``."""
    if not is_whole(value) or value < low:
        raise ValueError(f"{key}={value!r}: must be a whole number >= {low}")
    return value
