"""How a config value or an environment variable reads as a flag. Pure."""

from __future__ import annotations

from typing import Any


def truthy(value: Any, default: bool = False) -> bool:
    """A config value read as a flag: None -> ``default``; text is true when it says 1, true, yes or
    on (any case); anything else by Python truth."""
    if value is None:
        return default
    if isinstance(value, str):
        return value.strip().lower() in ("1", "true", "yes", "on")
    return bool(value)
