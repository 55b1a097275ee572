"""The value rules every argument check shares: what counts as an int, a positive int, and the one
`ConfigError` message for a value that is not one ("[where: ]name=value must be <meaning>")."""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_positive_int(value: Any) -> bool:
    """An int >= 1 that is not a bool (True is an int to Python, never a degree or a count here)."""
    return is_int(value) and value >= 1


def positive_int(
    name: str, value: Any, meaning: str = "a positive integer", *, where: str = "", allow_none: bool = False
) -> Any:
    """`value` if it is a positive int (or None with `allow_none`), else ConfigError
    "[where: ]name=value must be <meaning>"."""
    if (value is None and allow_none) or is_positive_int(value):
        return value
    prefix = f"{where}: " if where else ""
    raise ConfigError(f"{prefix}{name}={value!r} must be {meaning}")
